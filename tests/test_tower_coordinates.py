"""The partitioner's coordinate fit (DMT 3.3 step 3), written out in numpy, against torch autograd + Adam.

``embed_coordinates`` computes the stress gradient by hand and applies Adam's update itself (autograd's
per-step overhead on these tiny tensors made ``embedscale towers`` take minutes on a busy machine). The
reference here is the former implementation: ``torch.optim.Adam`` on the same objective through autograd.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedscale.plan.towers import embed_coordinates, partition_features


def autograd_adam(distance, dim, steps, lr, restarts, seed):
    D = torch.as_tensor(np.asarray(distance, dtype=np.float64))
    F = D.shape[0]
    iu = torch.triu_indices(F, F, offset=1)
    target = D[iu[0], iu[1]]
    scale = max(float(target.mean()), 1e-3)
    start = np.random.default_rng(seed).standard_normal((restarts, F, dim))  # the planner's starts (numpy)
    X = (torch.from_numpy(start) * scale).requires_grad_(True)
    opt = torch.optim.Adam([X], lr=lr * scale)
    for _ in range(steps):
        opt.zero_grad()
        diff = X[:, iu[0]] - X[:, iu[1]]
        ((torch.sqrt((diff ** 2).sum(2) + 1e-12) - target) ** 2).sum().backward()
        opt.step()
    with torch.no_grad():
        diff = X[:, iu[0]] - X[:, iu[1]]
        st = (((diff ** 2).sum(2).sqrt() - target) ** 2).sum(1) / float((target ** 2).sum())
    return X.detach().numpy(), st.numpy()


def random_interaction(F, seed):
    A = np.random.default_rng(seed).random((F, F))
    I = (A + A.T) / 2
    np.fill_diagonal(I, 1.0)
    return I


@pytest.mark.parametrize("F,dim,restarts,seed", [(9, 2, 1, 0), (14, 3, 3, 5)])
def test_coordinates_follow_autograd_adam_step_for_step(F, dim, restarts, seed):
    D = 1.0 - random_interaction(F, seed)
    for steps in (1, 7, 150):
        Xs, st = autograd_adam(D, dim, steps, 0.05, restarts, seed)
        best = int(np.argmin(st))
        X, stress = embed_coordinates(D, dim, steps=steps, restarts=restarts, seed=seed)
        np.testing.assert_allclose(X, Xs[best], rtol=0, atol=1e-9)
        assert stress == pytest.approx(float(st[best]), abs=1e-12)


def test_partition_matches_the_autograd_implementations_output():
    """Recorded with the autograd implementation (default settings) before the numpy rewrite."""
    a, rep = partition_features([f"C{i}" for i in range(8)], random_interaction(8, 4), 2)
    assert a.towers == [["C0", "C1", "C2", "C6"], ["C3", "C4", "C5", "C7"]]
    assert rep["stress"] == pytest.approx(0.04675757265610316, abs=1e-12)
    a, rep = partition_features([f"C{i}" for i in range(13)], random_interaction(13, 1), 3, max_ratio=1.5)
    assert a.towers == [["C0", "C1", "C6", "C10"], ["C2", "C3", "C8", "C9"], ["C4", "C5", "C7", "C11", "C12"]]
    assert rep["stress"] == pytest.approx(0.0918063393599678, abs=1e-12)
