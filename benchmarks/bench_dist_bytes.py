"""Embedding bytes on wire per training iteration on 2 ranks: the `oper` plan (5% extra memory) against
TorchRec's planner's plan, table-wise and row-wise, all run through the same executor (ShardedEmbedding,
retrieve design, collective transport) on the same power-law batches. Issue 4's bar: oper at most 0.2x
of TorchRec's plan.

Setup: 26 criteo-kaggle tables capped at 100k rows (scaled to fit), dim 16, synthetic power-law data
(per-table exponent 1.1), global batch 4096, one-hot; bytes counted by the transport (ids, rows,
gradients) plus the replica gradient AllReduce, summed over ranks, mean over the measured iterations.

    .venv/bin/python benchmarks/bench_dist_bytes.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from embedscale.comm.collective import CollectiveTransport
from embedscale.data.batch import JaggedFeatures
from embedscale.data.profile import AccessProfile
from embedscale.data.synthetic import SyntheticGenerator
from embedscale.embedding.address_map import address_map_from_plan
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.plan.api import make_plan
from embedscale.specs import SyntheticConfig, Topology
from embedscale.train.launch import spawn_local

STRATEGIES = ["oper", "torchrec", "table_wise", "row_wise"]


def worker(rank, world, cfg):
    torch.set_num_threads(1)
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=cfg["max_rows"], alpha=cfg["alpha"]),
                             seed=0, embedding_dim=cfg["dim"])
    tables = gen.tables
    B = cfg["batch"]
    # profile of the training stream's first part; batches come from later samples of the same stream
    cols = gen.sample(0, cfg["profile_samples"])
    counts = {t.name: np.bincount(cols.sparse[t.name][0], minlength=t.num_rows) for t in tables}
    profile = AccessProfile(counts, cfg["profile_samples"])
    batches = gen.sample(cfg["profile_samples"], B * cfg["steps"])
    keys = [t.name for t in tables]
    out = {}
    for strategy in STRATEGIES:
        try:
            plan = make_plan(strategy, tables, profile, Topology(ranks_per_host=world), mode="training",
                             extra_memory=0.05, batch_size=B // world)
        except Exception as e:  # noqa: BLE001 - e.g. TorchRec not installed: reported, not fatal
            out[strategy] = {"error": f"{type(e).__name__}: {e}"}
            continue
        amap = address_map_from_plan(plan, tables)
        tr = CollectiveTransport()
        emb = ShardedEmbedding(tables, amap, tr, rank, optimizer="sgd", lr=0.01)
        sent, sync = [], []
        for s in range(cfg["steps"]):
            lo, hi = s * B + B * rank // world, s * B + B * (rank + 1) // world
            values = torch.from_numpy(np.concatenate([batches.sparse[k][0][lo:hi] for k in keys]))
            jf = JaggedFeatures(keys, values, torch.ones(values.numel(), dtype=torch.int64))
            tr.counter.reset()
            before = emb.stats.get("grad_sync_bytes", 0)
            emb(jf).sum().backward()
            sent.append(int(tr.counter.sent.sum()))
            sync.append(emb.stats.get("grad_sync_bytes", 0) - before)
        out[strategy] = {"a2a_bytes": float(np.mean(sent)), "sync_bytes": float(np.mean(sync)),
                         "replicated_rows": int(amap.num_slots), "plan_seconds": plan.meta.get("plan_seconds")}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    cfg = {"max_rows": 100_000, "dim": 16, "alpha": 1.1, "batch": 4096, "steps": 5 if args.quick else 20,
           "profile_samples": 200_000}
    print(f"bytes on wire, {args.world} ranks: {cfg}", file=sys.stderr)
    res = spawn_local(worker, args.world, cfg, timeout_s=1800)
    tot = {}
    for s in STRATEGIES:
        if "error" in res[0][s]:
            tot[s] = {"error": res[0][s]["error"]}
            continue
        a2a = sum(r[s]["a2a_bytes"] for r in res)
        sync = sum(r[s]["sync_bytes"] for r in res)
        tot[s] = {"bytes_per_iteration": a2a + sync, "a2a": a2a, "replica_sync": sync,
                  "replicated_rows": res[0][s]["replicated_rows"], "plan_seconds": res[0][s]["plan_seconds"]}
    base = "torchrec" if "bytes_per_iteration" in tot.get("torchrec", {}) else "row_wise"
    ours = tot["oper"]["bytes_per_iteration"]
    theirs = tot[base]["bytes_per_iteration"]
    print(json.dumps({
        "benchmark": "dist_bytes_on_wire", "figure": ours, "baseline": theirs, "ratio": ours / theirs,
        "unit": "bytes/iteration (all ranks)", "baseline_plan": base, "strategies": tot,
        "config": {**cfg, "world": args.world, "loadavg": os.getloadavg()},
    }))


if __name__ == "__main__":
    main()
