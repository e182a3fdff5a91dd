"""Embedding bytes on wire per training iteration on 2 ranks: the `oper` plan (5% extra memory) against
TorchRec's planner's plan, table-wise and row-wise, all run through the same executor (ShardedEmbedding,
retrieve design, collective transport) on the same power-law batches. The bar: oper at most 0.2x
of TorchRec's plan. Also a lower bound for any plan within the same extra memory (``any_plan_bound``).

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
        if strategy == "torchrec":  # its data-parallel tables: every partition on every rank
            full = plan.holders.all(axis=1)
            out["torchrec_replicated_tables"] = [t.name for k, t in enumerate(tables)
                                                 if full[plan.table_partitions(k)].all()]
        out[strategy] = {"a2a_bytes": float(np.mean(sent)), "sync_bytes": float(np.mean(sync)),
                         "replicated_rows": int(amap.num_slots), "plan_seconds": plan.meta.get("plan_seconds")}
    return out


def any_plan_bound(cfg, world: int, torchrec_replicated: list[str], extra_memory: float = 0.05) -> dict:
    """Expected bytes per iteration of the best conceivable plan through this executor, against TorchRec's.

    The executor fetches a remote row at most once per iteration and rank (ids out, row back, gradient out).
    A rank reads row ``r`` in an iteration with probability ``q_r = 1 - (1 - p_r)^b`` (``p_r``: its per-sample
    frequency in the profile, ``b`` samples per rank). A placement fixed before the batches are drawn, with
    every rank's batch drawn alike, leaves a non-replicated row remote for ``world - 1`` of the ranks, so it
    costs ``(world - 1) q_r`` fetches per iteration; a replicated row costs none (its AllReduce is ignored, in
    the bound's favour). The best replica set within ``extra_memory`` of the rows (``world - 1`` extra copies
    each) takes the rows of highest ``q_r``. TorchRec's plan replicates its data-parallel tables."""
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=cfg["max_rows"], alpha=cfg["alpha"]),
                             seed=0, embedding_dim=cfg["dim"])
    tables = gen.tables
    b = cfg["batch"] // world
    cols = gen.sample(0, cfg["profile_samples"])
    q, dp = [], []
    for t in tables:
        p = np.bincount(cols.sparse[t.name][0], minlength=t.num_rows) / cfg["profile_samples"]
        q.append(-np.expm1(b * np.log1p(-np.minimum(p, 1 - 1e-12))))
        dp.append(np.full(t.num_rows, t.name in torchrec_replicated))
    q, dp = np.concatenate(q), np.concatenate(dp)
    total = q.size
    budget = int(extra_memory * total / max(world - 1, 1))
    per_fetch = (8 + 2 * cfg["dim"] * 4) * (world - 1)  # expected remote fetches, summed over ranks
    best = (q.sum() - np.sort(q)[::-1][:budget].sum()) * per_fetch
    torchrec = q[~dp].sum() * per_fetch
    return {"bytes_per_iteration": float(best), "torchrec_plan_expected_bytes_per_iteration": float(torchrec),
            "ratio": float(best / torchrec), "replica_budget_rows": budget, "total_rows": int(total)}


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
    bound = any_plan_bound(cfg, args.world, res[0].get("torchrec_replicated_tables", []))
    print(f"best conceivable plan within 5% extra memory: {bound['bytes_per_iteration']:,.0f} bytes/iteration "
          f"expected, {bound['ratio']:.3f}x of TorchRec's plan ({bound['torchrec_plan_expected_bytes_per_iteration']:,.0f}"
          " expected)", file=sys.stderr)
    print(json.dumps({
        "benchmark": "dist_bytes_on_wire", "figure": ours, "baseline": theirs, "ratio": ours / theirs,
        "unit": "bytes/iteration (all ranks)", "baseline_plan": base, "strategies": tot, "any_plan_bound": bound,
        "config": {**cfg, "world": args.world, "loadavg": os.getloadavg()},
    }))


if __name__ == "__main__":
    main()
