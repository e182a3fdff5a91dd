"""The tower partitioner's learning side (TP, DMT section 3.3, step 1): the feature interaction matrix from a
trained model's per-sample pooled embeddings, and :func:`learn_towers`, which runs the whole pipeline on a model
and a data source (steps 2-5 are the planner's, :mod:`embedscale.plan.towers`).

1. **Feature interaction matrix** from a trained model's per-sample pooled embeddings ``R [B, F, N]``:
   ``I(i, j) = mean_b |cos(R[b, i], R[b, j])|`` (:func:`interaction_matrix`). DMT: averaging embeddings
   over the batch is meaningless (different rows per sample); the mean per-sample affinity
   ``mean(R R^T, dim=0)`` of normalised vectors is. By default (ours) every feature's mean embedding is
   subtracted first, so ``I`` measures how features vary together, not their constant parts.

:func:`learn_towers` returns a :class:`~embedscale.plan.towers.TowerAssignment` and a report;
:func:`plot_interaction` draws DMT Figure 9.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from embedscale.errors import ConfigError, InputError
from embedscale.io import atomic_open
from embedscale.plan.towers import TowerAssignment, check_towers, partition_features


# --------------------------------------------------------------------------------------------------
# step 1: interaction


class InteractionAccumulator:
    """Running ``mean_b |cos(R[b, i] - m_i, R[b, j] - m_j)|`` over batches of per-sample embeddings
    ``[B, F, N]``, with ``m`` the features' mean embeddings (``mean=None``: DMT's uncentred ``|cos|``).

    A zero vector (an empty bag) has no direction: its pairs are left out of that sample's mean, and of
    the feature means; so is a centred vector of zero length (a feature that never varies). The sums stay on
    the device of the embeddings given; :meth:`matrix` hands numpy the result.
    """

    def __init__(self, num_features: int, mean: torch.Tensor | None = None):
        self.F = num_features
        self.mean = None if mean is None else mean.detach().to(torch.float64)
        self.total = self.count = None  # [F, F] float64 on the first batch's device
        self.samples = 0

    @torch.no_grad()
    def add(self, embs: torch.Tensor) -> None:
        if embs.dim() != 3 or embs.shape[1] != self.F:
            raise InputError(f"interaction matrix: expected embeddings [B, {self.F}, N], got {list(embs.shape)}")
        if embs.shape[0] == 0:
            return
        e = embs.detach().to(torch.float64)
        if self.total is None:
            self.total = torch.zeros(self.F, self.F, dtype=torch.float64, device=e.device)
            self.count = torch.zeros_like(self.total)
        valid = e.norm(dim=2) > 0  # [B, F]
        if self.mean is not None:
            e = e - self.mean.to(e.device)
        norm = e.norm(dim=2, keepdim=True)
        valid &= norm.squeeze(2) > 1e-12 * (1.0 + embs.detach().abs().amax().item())
        v = valid.to(torch.float64)
        u = e / norm.clamp(min=1e-30) * v.unsqueeze(2)  # invalid vectors become 0: they add nothing
        cos = torch.bmm(u, u.transpose(1, 2)).abs()  # [B, F, F]
        self.total += cos.sum(0)
        self.count += torch.einsum("bi,bj->ij", v, v)
        self.samples += e.shape[0]

    def matrix(self) -> np.ndarray:
        if self.total is None:  # no batch: no pair seen
            return np.eye(self.F)
        out = (self.total / self.count.clamp(min=1)).numpy(force=True)
        out[self.count.numpy(force=True) == 0] = 0.0
        np.fill_diagonal(out, 1.0)
        return np.clip(out, 0.0, 1.0)


def feature_means(batches: Iterable[torch.Tensor]) -> torch.Tensor:
    """``[F, N]`` mean embedding of every feature over its non-empty bags (float64)."""
    total = count = None
    for e in batches:
        e = e.detach().to(torch.float64)
        valid = (e.norm(dim=2) > 0).to(torch.float64)  # [B, F]
        s, c = (e * valid.unsqueeze(2)).sum(0), valid.sum(0)
        total, count = (s, c) if total is None else (total + s.to(total.device), count + c.to(count.device))
    if total is None:
        raise InputError("interaction matrix: no embeddings")
    return total / count.clamp(min=1).unsqueeze(1)


def interaction_matrix(embeddings: torch.Tensor | Iterable[torch.Tensor], center: bool = True) -> np.ndarray:
    """The feature interaction matrix (float64 ``[F, F]``, 1 on the diagonal) from ``[B, F, N]``
    embeddings or an iterable of such batches (held in memory when ``center``).

    ``center=False`` is DMT 3.3's ``I(i, j) = mean_b |cos(R[b, i], R[b, j])|``. ``center=True`` (the
    default, ours) first subtracts every feature's mean embedding ``m_i`` (:func:`feature_means`):
    ``mean_b |cos(R[b, i] - m_i, R[b, j] - m_j)|``, the per-sample analogue of a correlation rather
    than of a second moment. A feature's constant part is the same for every sample, so it says nothing
    about how two features vary together, yet it dominates the uncentred cosine whenever a trained table
    drifts as a whole (e.g. towards the direction the dense vector interacts with): on planted groups,
    centring is what makes the partition's objective prefer the planted groups in every trained model
    (``benchmarks/results/dmt.md``).
    """
    if isinstance(embeddings, torch.Tensor):
        embeddings = [embeddings]
    batches = list(embeddings) if center else embeddings
    mean = feature_means(batches) if center else None
    acc = None
    for e in batches:
        if acc is None:
            acc = InteractionAccumulator(e.shape[1], mean)
        acc.add(e)
    if acc is None:
        raise InputError("interaction matrix: no embeddings")
    return acc.matrix()


def model_embeddings(model, batches: Iterable, max_batches: int = 0) -> tuple[list[str], Iterable[torch.Tensor]]:
    """Per-sample pooled embeddings ``[B, F, N]`` of a model's sparse features, batch by batch.

    ``model`` is a DLRM or DCN (``model.sparse_arch.pooled`` with one shared dim), a DMT model's local
    tower executor, or an embedding module with ``feature_names`` whose forward returns ``[B, F N]``;
    ``batches`` yields ``Batch`` or ``JaggedFeatures``.
    """
    arch = getattr(model, "sparse_arch", model)
    names = list(getattr(arch, "feature_names", None) or [])
    if not names:
        raise ConfigError(f"learn_towers: {type(model).__name__} exposes no sparse feature names")
    dims = list(getattr(arch, "feature_dims", []) or [])
    if dims and len(set(dims)) != 1:
        raise ConfigError(f"learn_towers: features have different dims {dict(zip(names, dims))}; the cosine "
                          "interaction needs one shared embedding dim")
    pooled = getattr(arch, "pooled", None) or arch

    def gen():
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                for i, b in enumerate(batches):
                    if max_batches and i >= max_batches:
                        break
                    sparse = getattr(b, "sparse", b)
                    out = pooled(sparse)
                    yield out.reshape(out.shape[0], len(names), -1)
        finally:
            model.train(was)

    return names, gen()


def learn_towers(model, batches: Iterable, num_towers: int, strategy: str = "coherent", max_ratio: float = 1.0,
                 *, max_batches: int = 0, coord_dim: int = 2, seed: int = 0, steps: int = 1500,
                 restarts: int = 8, n_init: int = 20, trials: int = 4, refine: bool = True, center: bool = True,
                 random_starts: int = 64) -> tuple[TowerAssignment, dict]:
    """Learn a balanced, meaningful feature-to-tower assignment from a trained model (DMT 3.3).

    Args:
        model: a trained DLRM/DCN (see :func:`model_embeddings`).
        batches: ``Batch``es (e.g. a ``ShardLoader``) or ``JaggedFeatures``.
        num_towers: T.
        strategy: ``coherent`` or ``diverse``.
        max_ratio: K, the largest allowed max/min tower size ratio (1 = as equal as possible; rounded
            up to the smallest feasible ratio when ``F % T != 0`` would make 1 impossible, see below).
        max_batches: stop after this many batches (0 = all).
        coord_dim: n, the dimension of the coordinates (DMT uses 2).
        seed, steps, restarts, n_init, trials, refine, random_starts: optimiser, K-Means and refinement
            settings (see :func:`partition_features`).
        center: centre every feature's embeddings before the cosine (:func:`interaction_matrix`; the
            embeddings of all batches are then held in memory: samples x F x N values).

    Returns:
        ``(TowerAssignment, report)``; the report holds the interaction matrix, coordinates, stress,
        tower sizes, within/cross-tower interaction, and the same scores for the naive assignment.

    When ``max_ratio`` is below the smallest feasible ratio ``ceil(F/T) / floor(F/T)``, that ratio is
    used instead and the report says so (``max_ratio_used``).
    """
    names, embs = model_embeddings(model, batches, max_batches)
    check_towers(len(names), num_towers)
    I = interaction_matrix(embs, center=center)
    F = len(names)
    feasible = math.ceil(F / num_towers) / (F // num_towers)
    used = max(float(max_ratio), feasible)
    assignment, report = partition_features(names, I, num_towers, strategy=strategy, max_ratio=used,
                                            coord_dim=coord_dim, seed=seed, steps=steps, restarts=restarts,
                                            n_init=n_init, trials=trials, refine=refine,
                                            random_starts=random_starts)
    report["centered"] = bool(center)
    report["max_ratio_requested"] = float(max_ratio)
    report["max_ratio_used"] = used
    return assignment, report


def plot_interaction(report: dict, path: str | Path) -> None:
    """DMT Figure 9: the interaction matrix with features sorted by tower, tower blocks outlined (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = report["features"]
    I = np.asarray(report["interaction"])
    towers = report["towers"]
    order = [names.index(f) for t in towers for f in t]
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(I[np.ix_(order, order)], vmin=0, vmax=1, cmap="viridis")
    start = 0
    for t in towers:
        ax.add_patch(plt.Rectangle((start - 0.5, start - 0.5), len(t), len(t), fill=False, ec="red", lw=1.5))
        start += len(t)
    ax.set_xticks(range(len(order)), [names[i] for i in order], rotation=90, fontsize=6)
    ax.set_yticks(range(len(order)), [names[i] for i in order], fontsize=6)
    ax.set_title(f"feature interaction ({report['strategy']}, {len(towers)} towers)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
