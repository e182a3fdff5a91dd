"""``embedscale calibrate``: measure on this machine the per-row costs ``plan --strategy auto`` reads.

Costs measured, not assumed. On the run's device (``--device``; designed for GPU,
untested there) with ``threads`` intra-op threads (default 1: what each of ``embedscale train --nproc 2``'s
ranks runs with on this machine, ``train.launch``) it times every step below in turns, ``repeats`` rounds after
a warm-up, each round a block of back-to-back steps of at least 50 ms, and takes each one's median block (what
a training step pays on the machine as it is, other processes' load included, preemptions weighed as a
training step of that length weighs them; in turns, so all steps see the same load and the overheads, which
are differences, are not the load's drift; the load average is recorded in ``notes``), on a power-law batch of ``batch`` one-hot lookups into a table of ``rows`` rows of dim ``dim``:

* ``exact_lookup_s``: a fused :class:`~embedscale.embedding.local.LocalEmbeddingBags` step (lookup, backward,
  row-wise Adagrad update in place), per lookup;
* ``tt_lookup_s[R]``: a :class:`~embedscale.embedding.tt.TTEmbeddingBag` step of rank ``R`` (EL-Rec III: forward,
  backward, core update), per lookup, for every candidate rank;
* ``tt_size_slope``: the smallest rank's TT step again on a table of 16 times the rows, the relative growth per
  doubling of the rows (``Costs.tt``: a TT lookup into a table of another size is scaled by it);
* ``tt_replica_factor``: every rank's TT step again with the gradient path of replicated cores (a dense gradient
  per core for the all-reduce, the update applied to the whole core: ``TTEmbeddingBag.grad_sync``, here a sum
  over one rank), over the fused step; the median over the ranks (``Costs.tt`` on several ranks);
* ``host_row_s``: a :class:`~embedscale.pipeline.PipelinedEmbedding` step of a host table (EL-Rec V: the
  parameter server reads the batch's distinct rows, the trainer pools them, the update goes back to the
  server), minus the exact step, per distinct row of the batch;
* ``dense_flops_per_s``: the dense model's FLOP rate, from a step (forward, backward, Adagrad update) of the
  MLPs of ``dense`` (:class:`~embedscale.plan.step.DenseModel`: the bottom MLP and the top MLP at the
  interaction's width) on ``batch`` samples, FLOPs counted by ``DenseModel.train_flops``;
* ``step_overhead_s`` and ``table_overhead_s``: a real :class:`~embedscale.models.dlrm.DLRM` training step
  (``dense``'s sizes, exact tables of ``rows // 16`` rows, Adagrad on the dense parameters) at the full feature
  count and at a quarter of it; what the step takes beyond the dense FLOPs at the measured rate and the
  lookups at ``exact_lookup_s`` is ``step_overhead_s + features * table_overhead_s`` (two equations, two
  unknowns; when a noisy machine makes one negative it is 0 and the other keeps their sum at the full feature
  count; the residuals are in ``notes``);
* with ``links=True``, the link bandwidth, latency and all-reduce bandwidth of two local ranks
  (:func:`embedscale.plan.measure.measure_topology`); otherwise the planner takes them from its topology.

The result is a :class:`~embedscale.plan.auto.Costs` JSON (``source: measured``). The planner itself stays
numpy-only: it reads the JSON, never this module.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np
import torch

from torch import nn

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.hybrid import HybridTTEmbeddingBag
from embedscale.embedding.tt import TTEmbeddingBag
from embedscale.errors import ConfigError
from embedscale.models.dcn import DCN
from embedscale.models.dlrm import DLRM, DenseArch, OverArch
from embedscale.pipeline.embedding import PipelinedEmbedding
from embedscale.plan.auto import DEFAULT_TT_RANKS, Costs
from embedscale.plan.forms import TableForm
from embedscale.plan.measure import measure_topology
from embedscale.plan.step import DenseModel
from embedscale.plan.topology import SAME_HOST
from embedscale.specs import TableSpec


#: ``tt_size_slope``: the smallest rank's TT lookup timed again on a table of this many times the rows
SIZE_RATIO = 16


def _zipf_ids(rng: np.random.Generator, rows: int, n: int, alpha: float, permute: bool = True) -> np.ndarray:
    """``n`` row ids with ``P(row r) ~ (r + 1) ** -alpha`` over a random permutation of the rows (``permute``),
    else in frequency order (row 0 the hottest: a frequency-reordered table's ids, EL-Rec IV)."""
    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    w /= w.sum()
    ids = rng.choice(rows, size=n, p=w)
    return rng.permutation(rows)[ids] if permute else ids


def _half_lookup_rows(rows: int, alpha: float) -> int:
    """The hottest rows of the calibration's Zipf table that take half its lookups (at most a tenth of it)."""
    w = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -alpha)
    return int(min(max(1, rows // 10), np.searchsorted(w / w[-1], 0.5) + 1))


def _interleaved_blocks(steps: dict, repeats: int, block_s: float = 0.05) -> dict[str, float]:
    """``steps``: name -> ``(step, batches)``. Every step warmed up, then timed in turns, ``repeats`` rounds of
    one block each: a block runs a step back to back for at least ``block_s`` seconds (as its warm-up timed
    it), so a preemption costs a short step what it costs a training step of that length, not a whole
    scheduler slice. In turns, all steps see the same load, so their differences (the overheads below) are
    not the load's drift. Returns each step's median over rounds of its block's mean seconds per step."""
    reps = {}
    for name, (step, batches) in steps.items():
        step(batches[0])
        t0 = time.perf_counter()
        step(batches[1 % len(batches)])
        reps[name] = max(1, min(1000, int(np.ceil(block_s / max(time.perf_counter() - t0, 1e-6)))))
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(repeats):
        for name, (step, batches) in steps.items():
            k = reps[name]
            t0 = time.perf_counter()
            for j in range(k):
                step(batches[(i * k + j) % len(batches)])
            times[name].append((time.perf_counter() - t0) / k)
    return {k: float(np.median(v)) for k, v in times.items()}


def _one_rank_sum(grads) -> None:
    """The cores' gradient sum across ranks on one rank: nothing to add (``TTEmbeddingBag.grad_sync``)."""


def _mlp_step(dense: DenseModel, batch: int, dev: torch.device, seed: int):
    """A training step of the MLPs of ``dense`` on ``batch`` samples, and its FLOPs (module docstring)."""
    torch.manual_seed(seed)
    bottom = DenseArch(dense.dense_in, list(dense.bottom_mlp) + [dense.embedding_dim], device=dev)
    top = OverArch(dense.interaction_width(), list(dense.top_mlp), device=dev)
    opt = torch.optim.Adagrad(list(bottom.parameters()) + list(top.parameters()), lr=1e-3)
    xs = [(torch.randn(batch, dense.dense_in, device=dev), torch.randn(batch, dense.interaction_width(), device=dev))
          for _ in range(2)]

    def step(x):
        opt.zero_grad(set_to_none=True)
        (bottom(x[0]).sum() + top(x[1]).sum()).backward()
        opt.step()

    mlp = DenseModel(arch="dlrm", dense_in=dense.dense_in, num_features=dense.num_features,
                     embedding_dim=dense.embedding_dim, bottom_mlp=dense.bottom_mlp, top_mlp=dense.top_mlp)
    flops = mlp.train_flops(batch) - 3.0 * batch * 2.0 * (dense.num_features + 1) ** 2 * dense.embedding_dim
    return (step, xs), flops


def _model_step(dense: DenseModel, features: int, rows: int, batch: int, dev: torch.device, alpha: float, seed: int):
    """A real training step of ``dense``'s arch with ``features`` exact tables of ``rows`` rows, and that model."""
    rng = np.random.default_rng(seed)
    d = DenseModel(**{**dense.to_dict(), "num_features": features, "bottom_mlp": dense.bottom_mlp,
                      "top_mlp": dense.top_mlp})
    names = [f"f{i}" for i in range(features)]
    emb = LocalEmbeddingBags([TableSpec(n, rows, d.embedding_dim) for n in names], device=dev,
                             optimizer="rowwise_adagrad", lr=0.01, seed=seed, validate=False)
    torch.manual_seed(seed)
    kw = dict(bottom_mlp=list(d.bottom_mlp), top_mlp=list(d.top_mlp), device=dev)
    model = (DLRM(d.dense_in, emb, d.embedding_dim, **kw) if d.arch == "dlrm"
             else DCN(d.dense_in, emb, d.embedding_dim, cross_layers=d.cross_layers, cross_low_rank=d.cross_low_rank, **kw))
    opt = torch.optim.Adagrad(list(model.dense_parameters()), lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    batches = []
    for _ in range(2):
        ids = torch.from_numpy(np.stack([_zipf_ids(rng, rows, batch, alpha) for _ in names], 1)).to(dev)
        batches.append((torch.randn(batch, d.dense_in, device=dev), JaggedFeatures.from_dense(names, ids),
                        torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32)).to(dev)))

    def step(b):
        loss = loss_fn(model(b[0], b[1]), b[2])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return (step, batches), d


def calibrate(*, device: str | torch.device | None = None, rows: int = 1 << 20, dim: int = 16, batch: int = 4096,
              tt_ranks: Sequence[int] = DEFAULT_TT_RANKS, repeats: int = 7, alpha: float = 1.1, links: bool = False,
              seed: int = 0, dense: DenseModel | None = None, threads: int | None = 1) -> Costs:
    """Measure the costs (module docstring) and return them as :class:`Costs`. ``dense``: the dense model
    (default: DLRM of ``ModelConfig``'s default sizes, 26 features of dim ``dim``); ``threads``: torch's
    intra-op threads while measuring (None: leave as is; restored afterwards)."""
    if rows < 8 or dim < 1 or batch < 1 or repeats < 1:
        raise ConfigError(f"calibrate: rows >= 8, dim, batch and repeats >= 1 needed; got rows={rows}, dim={dim}, "
                          f"batch={batch}, repeats={repeats}")
    if threads is not None and threads < 1:
        raise ConfigError(f"calibrate: threads must be >= 1, got {threads}")
    dense = dense or DenseModel(embedding_dim=dim)
    if dense.embedding_dim != dim:
        raise ConfigError(f"calibrate: the dense model's embedding_dim {dense.embedding_dim} is not --dim {dim}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        return _calibrate(device, rows, dim, batch, tt_ranks, repeats, alpha, links, seed, dense)
    finally:
        torch.set_num_threads(before)


def _calibrate(device, rows, dim, batch, tt_ranks, repeats, alpha, links, seed, dense: DenseModel) -> Costs:
    dev = torch.device(device) if device is not None else torch.get_default_device()
    rng = np.random.default_rng(seed)
    ids = [torch.from_numpy(_zipf_ids(rng, rows, batch, alpha)).to(dev) for _ in range(4)]
    distinct = float(np.mean([torch.unique(b).numel() for b in ids]))
    jfs = [JaggedFeatures.from_dense(["t"], b.view(-1, 1)) for b in ids]
    offsets = torch.arange(batch, device=dev)
    steps: dict = {}
    exact = LocalEmbeddingBags([TableSpec("t", rows, dim)], device=dev, optimizer="rowwise_adagrad", lr=0.01,
                               seed=seed, validate=False)
    steps["exact"] = (lambda jf: exact(jf).sum().backward(), jfs)
    for r in tt_ranks:
        tt = TTEmbeddingBag(rows, dim, int(r), optimizer="rowwise_adagrad", lr=0.01, seed=seed, device=dev,
                            name="t", validate=False)
        steps[f"tt-{int(r)}"] = ((lambda m: lambda b: m(b, offsets).sum().backward())(tt), ids)
        rep = TTEmbeddingBag(rows, dim, int(r), optimizer="rowwise_adagrad", lr=0.01, seed=seed, device=dev,
                             name="t", validate=False)
        rep.grad_sync = _one_rank_sum  # replicated cores: dense gradients summed (over one rank), applied whole
        steps[f"tt-replica-{int(r)}"] = ((lambda m: lambda b: m(b, offsets).sum().backward())(rep), ids)
    # the same lookup into a table of 16 times the rows (Costs.tt_size_slope): the smallest rank, its cores small
    big_rows = rows * SIZE_RATIO
    big_ids = [torch.from_numpy(_zipf_ids(rng, big_rows, batch, alpha)).to(dev) for _ in range(4)]
    tt_big = TTEmbeddingBag(big_rows, dim, int(min(tt_ranks)), optimizer="rowwise_adagrad", lr=0.01, seed=seed,
                            device=dev, name="t", validate=False)
    steps["tt-big"] = ((lambda m: lambda b: m(b, offsets).sum().backward())(tt_big), big_ids)
    # row groups (embedding.hybrid): the hottest rows exact, the rest TT, against the same TT table, on
    # frequency-ordered ids (a row-group table is reordered): what the second lookup and the hot update cost
    r0 = int(min(tt_ranks))
    freq = [torch.from_numpy(_zipf_ids(rng, rows, batch, alpha, permute=False)).to(dev) for _ in range(4)]
    rg_tt = TTEmbeddingBag(rows, dim, r0, optimizer="rowwise_adagrad", lr=0.01, seed=seed, device=dev, name="t",
                           validate=False)
    rg = HybridTTEmbeddingBag(rows, dim, r0, hot_rows=_half_lookup_rows(rows, alpha), optimizer="rowwise_adagrad",
                              lr=0.01, tt_optimizer="rowwise_adagrad", tt_lr=0.01, seed=seed, device=dev, name="t",
                              validate=False)
    steps["rg-tt"] = ((lambda m: lambda b: m(b, offsets).sum().backward())(rg_tt), freq)
    steps["rg"] = ((lambda m: lambda b: m(b, offsets).sum().backward())(rg), freq)
    host = PipelinedEmbedding.from_tables([TableSpec("t", rows, dim)], {"t": TableForm("host")}, device=dev,
                                          optimizer="rowwise_adagrad", lr=0.01, seed=seed)
    steps["host"] = (lambda jf: host(jf).sum().backward(), jfs)
    steps["mlp"], mlp_flops = _mlp_step(dense, batch, dev, seed)
    small_rows = max(8, rows // 16)
    f_hi = dense.num_features
    f_lo = max(1, f_hi // 4)
    models = {}
    for f in sorted({f_lo, f_hi}):
        steps[f"model-{f}"], models[f] = _model_step(dense, f, small_rows, batch, dev, alpha, seed)
    t = _interleaved_blocks(steps, repeats)
    t_exact, t_host = t["exact"], t["host"]
    tt_s = {int(r): t[f"tt-{int(r)}"] / batch for r in tt_ranks}
    rate = mlp_flops / t["mlp"]
    exact_s = t_exact / batch
    resid = {f: (t[f"model-{f}"], t[f"model-{f}"] - d.train_flops(batch) / rate - f * batch * exact_s)
             for f, d in models.items()}
    per_table = max(0.0, (resid[f_hi][1] - resid[f_lo][1]) / (f_hi - f_lo)) if f_hi > f_lo else 0.0
    step_over = resid[f_hi][1] - f_hi * per_table
    if step_over < 0:  # noise made the two unknowns' split negative: keep their sum at the full feature count
        per_table, step_over = max(0.0, resid[f_hi][1]) / f_hi, 0.0
    slope = (t["tt-big"] / t[f"tt-{int(min(tt_ranks))}"] - 1.0) / np.log2(SIZE_RATIO)
    replica = {int(r): t[f"tt-replica-{int(r)}"] / t[f"tt-{int(r)}"] for r in tt_ranks}
    costs = Costs(exact_lookup_s=exact_s, tt_lookup_s=tt_s, tt_rows=int(rows), tt_size_slope=float(slope),
                  tt_replica_factor=float(np.median(list(replica.values()))),
                  row_group_overhead_s=max(0.0, t["rg"] - t["rg-tt"]),
                  host_row_s=max(t_host - t_exact, 1e-3 * t_exact) / max(distinct, 1.0), source="measured",
                  dense_flops_per_s=rate, step_overhead_s=step_over, table_overhead_s=per_table,
                  notes={"device": str(dev), "rows": rows, "dim": dim, "batch": batch, "alpha": alpha,
                         "repeats": repeats, "statistic": "median of 50 ms blocks, interleaved", "threads": torch.get_num_threads(),
                         "distinct_rows_per_batch": distinct, "links_measured": False,
                         "tt_replica_factor_by_rank": {str(r): v for r, v in replica.items()},
                         "exact_step_s": t_exact, "host_step_s": t_host, "dense_model": dense.to_dict(),
                         "model_step_s": {str(f): v[0] for f, v in resid.items()},
                         "model_step_residual_s": {str(f): v[1] for f, v in resid.items()},
                         "load_average": list(os.getloadavg())})
    if links:
        topo = measure_topology(ranks_per_host=2, device=str(dev))
        same = topo.link_class() == SAME_HOST
        costs.link_bandwidth_gbs = float(topo.bandwidth[same].mean())
        costs.link_latency_us = float(topo.latency_us[same].mean())
        costs.allreduce_gbs = float(topo.allreduce_bw)
        costs.notes["links_measured"] = True
    return costs
