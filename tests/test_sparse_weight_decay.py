"""Weight decay on the embedding rows a step touches (``train.sparse_weight_decay``, ``embedding.optim``), against
a plain-Python float64 model of the rule: every unique row's summed gradient gets ``wd * w`` added, then row-wise
Adagrad (``m += mean(g^2)``, ``w -= lr g / (sqrt(m) + eps)``) or SGD (``w -= lr g``); rows not touched keep their
values bit for bit. Also: 2 ranks with the decay train as one process does."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from embedscale import workflow
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.optim import rowwise_adagrad_update_, set_weight_decay, sgd_update_
from embedscale.errors import ConfigError
from embedscale.specs import TableSpec

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import checkpoint_state, config, distributed, hand_plan, make_data  # noqa: E402

LR, EPS = 0.3, 1e-8


def python_step(w: list[list[float]], m: list[float], grads: dict[int, list[float]], optimizer: str, wd: float):
    """One step of the rule on ``w`` (rows of floats) and ``m`` (state per row), in place; ``grads``: each touched
    row's summed gradient."""
    for r, g in grads.items():
        g = [gj + wd * wj for gj, wj in zip(g, w[r])]
        if optimizer == "sgd":
            w[r] = [wj - LR * gj for wj, gj in zip(w[r], g)]
        else:
            m[r] += sum(gj * gj for gj in g) / len(g)
            w[r] = [wj - LR * gj / (math.sqrt(m[r]) + EPS) for wj, gj in zip(w[r], g)]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_update_functions_equal_the_python_rule(optimizer):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(9, 5, generator=gen)
    momentum = torch.rand(9, generator=gen)
    rows = torch.tensor([1, 4, 7, 8])
    grads = torch.randn(4, 5, generator=gen)
    w, m = weight.double().tolist(), momentum.double().tolist()
    python_step(w, m, {int(r): g for r, g in zip(rows, grads.double().tolist())}, optimizer, 0.2)
    if optimizer == "sgd":
        sgd_update_(weight, rows, grads, LR, weight_decay=0.2)
    else:
        rowwise_adagrad_update_(weight, momentum, rows, grads, LR, EPS, weight_decay=0.2)
        torch.testing.assert_close(momentum.double(), torch.tensor(m, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weight.double(), torch.tensor(w, dtype=torch.float64), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_training_step_decays_the_rows_it_touches_only(optimizer):
    tables = [TableSpec("a", 12, 4), TableSpec("b", 8, 4, pooling="mean")]
    emb = LocalEmbeddingBags(tables, optimizer=optimizer, lr=LR, eps=EPS, seed=3)
    assert set_weight_decay(emb, 0.5) == 1
    before = {t.name: emb.table_weight(t.name).clone() for t in tables}
    # bags with repeats: row 2 of "a" twice in one bag and once more in another; "b" mean-pooled
    per_key = {"a": [[2, 2, 5], [2], []], "b": [[1, 3], [3], [6]]}
    features = JaggedFeatures.from_lists(per_key)
    gen = torch.Generator().manual_seed(4)
    grad_out = torch.randn(3, 8, generator=gen)
    (emb(features) * grad_out).sum().backward()

    for col, t in enumerate(tables):
        w = before[t.name].double().tolist()
        m = [0.0] * t.num_rows
        grads: dict[int, list[float]] = {}
        for b, bag in enumerate(per_key[t.name]):
            scale = 1.0 / len(bag) if t.pooling == "mean" and bag else 1.0
            for r in bag:
                g = grads.setdefault(r, [0.0] * 4)
                for j in range(4):
                    g[j] += scale * float(grad_out[b, col * 4 + j])
        python_step(w, m, grads, optimizer, 0.5)
        after = emb.table_weight(t.name)
        torch.testing.assert_close(after.double(), torch.tensor(w, dtype=torch.float64), rtol=1e-5, atol=1e-6)
        untouched = [r for r in range(t.num_rows) if r not in grads]
        assert torch.equal(after[untouched], before[t.name][untouched])  # no decay without a lookup


def test_weight_decay_must_be_a_non_negative_number():
    emb = LocalEmbeddingBags([TableSpec("a", 4, 2)], optimizer="rowwise_adagrad", lr=LR)
    with pytest.raises(ConfigError, match="sparse_weight_decay"):
        set_weight_decay(emb, -0.1)


def test_two_ranks_with_weight_decay_train_as_one_process(tmp_path):
    data_dir = tmp_path / "data"
    make_data(data_dir)
    cfg = config(tmp_path, data_dir)
    cfg.train.sparse_weight_decay = 0.3
    workflow.train(cfg, tmp_path / "single", resume=False, progress=False)
    losses, weights, dense = checkpoint_state(tmp_path / "single")
    plain = config(tmp_path, data_dir)
    workflow.train(plain, tmp_path / "plain", resume=False, progress=False)
    assert not torch.allclose(weights, checkpoint_state(tmp_path / "plain")[1], atol=1e-4)  # the decay acts

    plan_dir = tmp_path / "plan"
    hand_plan("replicas", 2).save(plan_dir)
    dcfg = config(tmp_path, data_dir, plan=str(plan_dir))
    dcfg.train.sparse_weight_decay = 0.3
    d_losses, d_weights, d_dense = distributed(dcfg, tmp_path / "two", 2)
    assert d_losses == pytest.approx(losses, abs=1e-5)
    torch.testing.assert_close(d_weights, weights, rtol=1e-5, atol=1e-5)
