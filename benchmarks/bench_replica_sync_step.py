"""Replica-gradient synchronisation inside a whole embedding training step: ``grad_sync="alltoall"`` (the
replicas' gradients ride in the retrieve design's backward all-to-all; no collective of its own) against
OPER 5.3's local-aggregated sparse AllReduce (the default) and a dense AllReduce of every replicated row.

Setup: ``ShardedEmbedding`` (retrieve design, collective transport, fused row-wise Adagrad) under the ``oper``
training plan with ``--extra-memory`` (default 5%) of 26 criteo-kaggle tables capped at ``--max-rows`` rows, dim
16, Zipf(1.1) one-hot data, global batch 4096 split over ``--world`` local gloo ranks; every step is a forward and
a backward with a fixed output gradient. The three methods run in the same process group, step by step in
turn (order rotated every step); a step's time is the slowest rank's; medians. Bytes per step: payload bytes
all ranks send (transport counter plus the AllReduce's ring bytes). The same plan, data and updates for all three
(the embedding rows are checked equal after the run).

Baselines: all three methods run through the same executor, transport (gloo collectives, TCP
on loopback), kernels and threads (one per rank); only the replica-gradient sync differs. ``local_aggregated``
and ``dense`` are the library's ``embedding.grad_sync`` forms, inside ``ShardedEmbedding``: ``dense`` allocates
its ``[replicated rows, dim]`` buffer at every step (its form at its best, the buffer kept, is measured on its
own in ``bench_grad_sync.py``: ``dense_prealloc``). The figure is alltoall against the faster of the two.

Prints one JSON line (figure: alltoall steps/s; baseline: the faster of local_aggregated and dense, steps/s).

    .venv/bin/python benchmarks/bench_replica_sync_step.py [--world 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

METHODS = ("alltoall", "local_aggregated", "dense")


def worker(rank, world, cfg):
    import torch.distributed as dist

    from embedscale.comm.collective import CollectiveTransport
    from embedscale.data.batch import JaggedFeatures
    from embedscale.data.profile import AccessProfile
    from embedscale.data.synthetic import SyntheticGenerator
    from embedscale.embedding.address_map import address_map_from_plan
    from embedscale.embedding.sharded import ShardedEmbedding
    from embedscale.plan.api import make_plan
    from embedscale.specs import SyntheticConfig, Topology

    torch.set_num_threads(1)
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=cfg["max_rows"], alpha=1.1), seed=0,
                             embedding_dim=16)
    tables, keys = gen.tables, [t.name for t in gen.tables]
    B, P, nb = cfg["batch"], 200_000, 8
    Bl = B // world
    cols = gen.sample(0, P)
    profile = AccessProfile({t.name: np.bincount(cols.sparse[t.name][0], minlength=t.num_rows) for t in tables}, P)
    data = gen.sample(P, B * nb)
    batches = []
    for s in range(nb):
        lo, hi = s * B + Bl * rank, s * B + Bl * (rank + 1)
        v = torch.from_numpy(np.concatenate([data.sparse[k][0][lo:hi] for k in keys])).to(torch.int64)
        batches.append(JaggedFeatures(keys, v, torch.ones(v.numel(), dtype=torch.int64)))
    plan = make_plan("oper", tables, profile, Topology(ranks_per_host=world), mode="training",
                     extra_memory=cfg["extra_memory"], batch_size=Bl)
    amap = address_map_from_plan(plan, tables)
    tr = CollectiveTransport(rank, world)
    embs = {m: ShardedEmbedding(tables, amap, tr, rank, optimizer="rowwise_adagrad", lr=0.05, grad_sync=m, seed=0)
            for m in METHODS}
    g = torch.randn(Bl, len(tables) * 16, generator=torch.Generator().manual_seed(rank)) * 1e-3
    times = {m: [] for m in METHODS}
    sent = {m: [] for m in METHODS}
    for s in range(cfg["warmup"] + cfg["steps"]):
        order = METHODS[s % 3:] + METHODS[:s % 3]
        for m in order:
            emb = embs[m]
            tr.counter.reset()
            sync0 = emb.stats.get("grad_sync_bytes", 0)
            dist.barrier()
            t0 = time.perf_counter()
            emb(batches[s % nb]).backward(g)
            dt = time.perf_counter() - t0
            if s >= cfg["warmup"]:
                times[m].append(dt)
                sent[m].append(int(tr.counter.sent.sum()) + emb.stats.get("grad_sync_bytes", 0) - sync0)
    out = {}
    for m in METHODS:
        t = torch.tensor(times[m], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        b = torch.tensor([float(np.mean(sent[m]))], dtype=torch.float64)
        dist.all_reduce(b)
        out[m] = {"median_ms": 1e3 * float(t.median()), "p90_ms": 1e3 * float(torch.quantile(t, 0.9)),
                  "bytes_per_step": float(b)}
    w = {m: embs[m].weight for m in METHODS}
    out["max_weight_diff_vs_local_aggregated"] = {m: float((w[m] - w["local_aggregated"]).abs().max())
                                                  for m in METHODS}
    out["replicated_rows"] = int(amap.num_slots)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096, help="global batch")
    ap.add_argument("--extra-memory", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    from embedscale.train.launch import spawn_local

    cfg = {"world": args.world, "max_rows": args.max_rows, "batch": args.batch, "extra_memory": args.extra_memory,
           "steps": args.steps, "warmup": 5}
    load = os.getloadavg()
    res = spawn_local(worker, args.world, cfg, timeout_s=1800)[0]
    for m in METHODS:
        print(f"  {m:17s} {res[m]['median_ms']:7.2f} ms/step (p90 {res[m]['p90_ms']:7.2f})  "
              f"{res[m]['bytes_per_step'] / 1e6:7.3f} MB/step",
              file=sys.stderr)
    a, la = res["alltoall"], res["local_aggregated"]
    base = min(("local_aggregated", "dense"), key=lambda m: res[m]["median_ms"])
    print(json.dumps({"benchmark": "replica_sync_step", "figure": 1e3 / a["median_ms"],
                      "baseline": 1e3 / res[base]["median_ms"], "ratio": res[base]["median_ms"] / a["median_ms"],
                      "baseline_method": base, "ratio_vs_local_aggregated": la["median_ms"] / a["median_ms"],
                      "unit": "steps/s", "bytes_ratio": a["bytes_per_step"] / la["bytes_per_step"],
                      "results": res, "config": {**cfg, "loadavg_before": load, "loadavg_after": os.getloadavg(),
                                                 "command": " ".join([".venv/bin/python",
                                                                      "benchmarks/bench_replica_sync_step.py",
                                                                      *sys.argv[1:]])}}))


if __name__ == "__main__":
    main()
