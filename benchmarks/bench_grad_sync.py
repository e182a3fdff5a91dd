"""Local-aggregated sparse AllReduce (OPER 5.3, Fig. 9b) against dense AllReduce and AllGather-based sparse
AllReduce, for the gradients of replicated hot rows, on 4 local gloo ranks.

Setup (scaled OPER training): the replicated region is OPER's 5% extra memory of the criteo-kaggle tables
capped at 1M rows (5% of 5.57M rows = 278k hot rows, dim 16); every rank's mini-batch (4096 / 4 samples x
26 features, Zipf(1.1)) touches some of them, with many repeats. Each iteration every rank
syncs its (rows, gradients) with each method; the figure is iterations per second (median over repeats,
methods interleaved). Bytes are what each method counts at its collective calls (``comm.transport``'s
convention). Prints one JSON line.

The baselines at their best, each beside the library's form:

* ``dense`` (library: a fresh ``[R, dim]`` buffer every sync, 17.8 MB here, so every sync page-faults a new
  allocation in) and ``dense_prealloc`` (the buffer allocated once, zeroed each sync: the same AllReduce);
* ``allgather`` (library: one size exchange, rows and gradients packed in one all_gather, every (row,
  gradient) pair of the batch sent, repeats included) and ``allgather_aggregated`` (the pairs summed per row
  on the rank first, as local-aggregated does: each rank sends its unique rows only).

The baseline is the fastest of the four; the ratios against each are reported too. Every method runs on the
same gloo process group (TCP on loopback), one thread per rank.

    .venv/bin/python benchmarks/bench_grad_sync.py [--quick] [--world 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from embedscale.comm.transport import counted_all_reduce
from embedscale.embedding.grad_sync import aggregate_rows, sync_replica_grads
from embedscale.train.launch import spawn_local


def make_batch(rank, step, replica_rows, per_rank_ids, dim, alpha):
    rng = np.random.default_rng([rank, step])
    u = rng.random(per_rank_ids)
    # Zipf over the replica rows by inverse CDF of the continuous power law (hot rows first)
    n = replica_rows
    r = np.floor(((n ** (1 - alpha) - 1) * u + 1) ** (1 / (1 - alpha))).astype(np.int64) - 1
    rows = torch.from_numpy(np.clip(r, 0, n - 1))
    grads = torch.from_numpy(rng.standard_normal((per_rank_ids, dim)).astype(np.float32))
    return rows, grads


METHODS = ("local_aggregated", "dense", "dense_prealloc", "allgather", "allgather_aggregated")
BASELINES = ("dense", "dense_prealloc", "allgather", "allgather_aggregated")


class Syncs:
    """Every method as ``sync(method, rows, grads, stats) -> (rows, grads)``; the bench's own forms of the
    baselines keep their buffers between syncs."""

    def __init__(self, num_rows: int, dim: int):
        self.num_rows = num_rows
        self.buf = torch.zeros(num_rows, dim)  # dense_prealloc: allocated once
        self.all_rows = torch.arange(num_rows)

    def __call__(self, method: str, rows, grads, stats: dict):
        if method in ("local_aggregated", "dense", "allgather"):
            return sync_replica_grads(rows, grads, self.num_rows, method=method, stats=stats)
        if method == "dense_prealloc":
            self.buf.zero_()
            self.buf.index_add_(0, rows, grads)
            stats["bytes_sent"] = stats.get("bytes_sent", 0) + counted_all_reduce(self.buf)
            return self.all_rows, self.buf
        if method == "allgather_aggregated":
            uniq, local = aggregate_rows(rows, grads, self.num_rows)
            return sync_replica_grads(uniq, local, self.num_rows, method="allgather", stats=stats)
        raise ValueError(method)


def worker(rank, world, cfg):
    torch.set_num_threads(1)
    batches = [make_batch(rank, s, cfg["replica_rows"], cfg["per_rank_ids"], cfg["dim"], cfg["alpha"])
               for s in range(cfg["steps"])]
    sync = Syncs(cfg["replica_rows"], cfg["dim"])
    times = {m: [] for m in METHODS}
    sent = {m: 0 for m in METHODS}
    check = {}
    for s, (rows, grads) in enumerate(batches):
        k = s % len(METHODS)
        for m in METHODS[k:] + METHODS[:k]:  # interleaved, the order rotated every step
            st: dict = {}
            torch.distributed.barrier()
            t0 = time.perf_counter()
            r, g = sync(m, rows, grads, st)
            times[m].append(time.perf_counter() - t0)
            sent[m] += st["bytes_sent"]
            if s == 0:
                dense = torch.zeros(cfg["replica_rows"], cfg["dim"], dtype=torch.float64)
                dense[r] = g.double()
                check[m] = dense
    # every method against the float64 sum of every rank's step-0 gradients, within float32 summation error
    # (a bound growing with the summed magnitude: hot rows sum thousands of terms)
    ref = torch.zeros(cfg["replica_rows"], cfg["dim"], dtype=torch.float64)
    mag = torch.zeros_like(ref)
    for q in range(world):
        rq, gq = make_batch(q, 0, cfg["replica_rows"], cfg["per_rank_ids"], cfg["dim"], cfg["alpha"])
        ref.index_add_(0, rq, gq.double())
        mag.index_add_(0, rq, gq.double().abs())
    tol = 1e-5 * mag + 1e-6
    same = all(bool(((check[m] - ref).abs() <= tol).all()) for m in METHODS)
    uniq = float(np.mean([torch.unique(b[0]).numel() for b in batches]))
    return {"times_s": {m: times[m][1:] for m in METHODS},
            "bytes_per_step": {m: sent[m] / cfg["steps"] for m in METHODS}, "same": same, "unique_rows": uniq}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    from embedscale.specs import CRITEO_KAGGLE_ROWS

    replica_rows = int(0.05 * sum(min(r, 1_000_000) for r in CRITEO_KAGGLE_ROWS))
    cfg = {"replica_rows": replica_rows, "dim": 16, "per_rank_ids": 4096 // args.world * 26, "alpha": 1.1,
           "steps": 8 if args.quick else 30}
    print(f"sparse AllReduce on {args.world} ranks: {cfg}", file=sys.stderr)
    load0 = os.getloadavg()
    res = spawn_local(worker, args.world, cfg, timeout_s=1200)
    # a sync takes as long as its slowest rank: per sync, the max over ranks; then median and p90
    per_sync = {m: np.max(np.array([r["times_s"][m] for r in res]), axis=0) for m in METHODS}
    med = {m: float(np.median(v)) for m, v in per_sync.items()}
    p90 = {m: float(np.percentile(v, 90)) for m, v in per_sync.items()}
    ours = med["local_aggregated"]
    base = min(BASELINES, key=lambda m: med[m])
    out = {
        "benchmark": "grad_sync_local_aggregated",
        "figure": 1.0 / ours, "baseline": 1.0 / med[base], "ratio": med[base] / ours,
        "baseline_method": base,
        "unit": "syncs/s",
        "ratio_vs": {m: med[m] / ours for m in BASELINES},
        "ms": {m: 1e3 * v for m, v in med.items()},
        "ms_p90": {m: 1e3 * v for m, v in p90.items()},
        "bytes_sent_per_rank_step": res[0]["bytes_per_step"],
        "unique_rows_per_rank_step": res[0]["unique_rows"],
        "results_equal": all(r["same"] for r in res),
        "config": {**cfg, "world": args.world, "threads_per_rank": 1, "transport": "gloo (TCP, loopback)",
                   "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                   "command": " ".join([".venv/bin/python", "benchmarks/bench_grad_sync.py"] + sys.argv[1:])},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
