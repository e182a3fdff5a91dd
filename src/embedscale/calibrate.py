"""``embedscale calibrate``: measure on this machine the per-row costs ``plan --strategy auto`` reads.

Issue 16, part 1 (costs measured, not assumed). On the run's device (``--device``; designed for GPU,
untested there) it times, the least of ``repeats`` after a warm-up (the cost without interference: on a shared
machine other processes only add to a step; the load average is recorded in ``notes``), on a power-law batch of ``batch`` one-hot
lookups into a table of ``rows`` rows of dim ``dim``:

* ``exact_lookup_s``: a fused :class:`~embedscale.embedding.local.LocalEmbeddingBags` step (lookup, backward,
  row-wise Adagrad update in place), per lookup;
* ``tt_lookup_s[R]``: a :class:`~embedscale.embedding.tt.TTEmbeddingBag` step of rank ``R`` (EL-Rec III: forward,
  backward, core update), per lookup, for every candidate rank;
* ``host_row_s``: a :class:`~embedscale.pipeline.PipelinedEmbedding` step of a host table (EL-Rec V: the
  parameter server reads the batch's distinct rows, the trainer pools them, the update goes back to the
  server), minus the exact step, per distinct row of the batch;
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

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.tt import TTEmbeddingBag
from embedscale.errors import ConfigError
from embedscale.pipeline.embedding import PipelinedEmbedding
from embedscale.plan.auto import DEFAULT_TT_RANKS, Costs
from embedscale.plan.forms import TableForm
from embedscale.plan.measure import measure_topology
from embedscale.plan.topology import SAME_HOST
from embedscale.specs import TableSpec


def _zipf_ids(rng: np.random.Generator, rows: int, n: int, alpha: float) -> np.ndarray:
    """``n`` row ids with ``P(row r) ~ (r + 1) ** -alpha`` over a random permutation of the rows."""
    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    w /= w.sum()
    return rng.permutation(rows)[rng.choice(rows, size=n, p=w)]


def _least_step(step, batches: Sequence, repeats: int) -> float:
    for b in batches[:2]:  # warm-up
        step(b)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return float(np.min(times))


def calibrate(*, device: str | torch.device | None = None, rows: int = 1 << 20, dim: int = 16, batch: int = 4096,
              tt_ranks: Sequence[int] = DEFAULT_TT_RANKS, repeats: int = 7, alpha: float = 1.1, links: bool = False,
              seed: int = 0) -> Costs:
    """Measure the per-row costs (module docstring) and return them as :class:`Costs`."""
    if rows < 8 or dim < 1 or batch < 1 or repeats < 1:
        raise ConfigError(f"calibrate: rows >= 8, dim, batch and repeats >= 1 needed; got rows={rows}, dim={dim}, "
                          f"batch={batch}, repeats={repeats}")
    dev = torch.device(device) if device is not None else torch.get_default_device()
    rng = np.random.default_rng(seed)
    ids = [torch.from_numpy(_zipf_ids(rng, rows, batch, alpha)).to(dev) for _ in range(4)]
    distinct = float(np.mean([torch.unique(b).numel() for b in ids]))
    jfs = [JaggedFeatures.from_dense(["t"], b.view(-1, 1)) for b in ids]
    table = TableSpec("t", rows, dim)

    exact = LocalEmbeddingBags([table], device=dev, optimizer="rowwise_adagrad", lr=0.01, seed=seed, validate=False)

    def exact_step(jf):
        exact(jf).sum().backward()

    t_exact = _least_step(exact_step, jfs, repeats)
    del exact
    offsets = torch.arange(batch, device=dev)
    tt_s = {}
    for r in tt_ranks:
        tt = TTEmbeddingBag(rows, dim, int(r), optimizer="rowwise_adagrad", lr=0.01, seed=seed, device=dev,
                            name="t", validate=False)
        tt_s[int(r)] = _least_step(lambda b: tt(b, offsets).sum().backward(), ids, repeats) / batch
        del tt
    host = PipelinedEmbedding.from_tables([TableSpec("t", rows, dim)], {"t": TableForm("host")}, device=dev,
                                          optimizer="rowwise_adagrad", lr=0.01, seed=seed)
    t_host = _least_step(lambda jf: host(jf).sum().backward(), jfs, repeats)
    del host
    costs = Costs(exact_lookup_s=t_exact / batch, tt_lookup_s=tt_s,
                  host_row_s=max(t_host - t_exact, 1e-3 * t_exact) / max(distinct, 1.0), source="measured",
                  notes={"device": str(dev), "rows": rows, "dim": dim, "batch": batch, "alpha": alpha,
                         "repeats": repeats, "distinct_rows_per_batch": distinct, "links_measured": False,
                         "exact_step_s": t_exact, "host_step_s": t_host, "load_average": list(os.getloadavg())})
    if links:
        topo = measure_topology(ranks_per_host=2, device=str(dev))
        same = topo.link_class() == SAME_HOST
        costs.link_bandwidth_gbs = float(topo.bandwidth[same].mean())
        costs.link_latency_us = float(topo.latency_us[same].mean())
        costs.allreduce_gbs = float(topo.allreduce_bw)
        costs.notes["links_measured"] = True
    return costs
