"""Local-aggregated sparse AllReduce (OPER 5.3, Fig. 9b) against dense AllReduce and AllGather-based sparse
AllReduce, for the gradients of replicated hot rows, on 4 local gloo ranks.

Setup (scaled OPER training): the replicated region is OPER's 5% extra memory of the criteo-kaggle tables
capped at 1M rows (5% of 5.57M rows = 278k hot rows, dim 16); every rank's mini-batch (4096 / 4 samples x
26 features, Zipf(1.1)) touches some of them, with many repeats. Each iteration every rank
syncs its (rows, gradients) with each method; the figure is iterations per second (median over repeats,
methods interleaved). The AllGather baseline is at its best: one size exchange, rows and gradients in one
all_gather. Bytes are what each method counts at its collective calls (``comm.transport``'s convention).
Prints one JSON line.

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

from embedscale.embedding.grad_sync import METHODS, sync_replica_grads
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


def worker(rank, world, cfg):
    torch.set_num_threads(1)
    batches = [make_batch(rank, s, cfg["replica_rows"], cfg["per_rank_ids"], cfg["dim"], cfg["alpha"])
               for s in range(cfg["steps"])]
    times = {m: [] for m in METHODS}
    sent = {m: 0 for m in METHODS}
    check = {}
    for s, (rows, grads) in enumerate(batches):
        for m in (METHODS if s % 2 == 0 else METHODS[::-1]):  # interleave to share the noise
            st: dict = {}
            torch.distributed.barrier()
            t0 = time.perf_counter()
            r, g = sync_replica_grads(rows, grads, cfg["replica_rows"], method=m, stats=st)
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
    return {"median_s": {m: float(np.median(times[m][1:])) for m in METHODS},
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
    res = spawn_local(worker, args.world, cfg, timeout_s=600)
    # a step takes as long as its slowest rank
    med = {m: max(r["median_s"][m] for r in res) for m in METHODS}
    ours, dense, ag = med["local_aggregated"], med["dense"], med["allgather"]
    out = {
        "benchmark": "grad_sync_local_aggregated",
        "figure": 1.0 / ours, "baseline": 1.0 / min(dense, ag), "ratio": min(dense, ag) / ours,
        "unit": "syncs/s",
        "ratio_vs_dense": dense / ours, "ratio_vs_allgather": ag / ours,
        "ms": {m: 1e3 * v for m, v in med.items()},
        "bytes_sent_per_rank_step": res[0]["bytes_per_step"],
        "unique_rows_per_rank_step": res[0]["unique_rows"],
        "results_equal": all(r["same"] for r in res),
        "config": {**cfg, "world": args.world, "threads_per_rank": 1, "loadavg": os.getloadavg()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
