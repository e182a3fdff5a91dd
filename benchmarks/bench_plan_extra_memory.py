"""OPER Table 2: mean communication per iteration vs the extra memory for replicas (0 .. 20%).

Criteo Kaggle cardinalities, power-law profile, 8 ranks on one host, ``oper`` in inference mode
(Algorithm 1 fills the budget; in training the frequency threshold, not the budget, bounds replication,
so the training sweep is an extra key). Bar: the mean at 1% at least 10x below the mean at 0%.

    .venv/bin/python benchmarks/bench_plan_extra_memory.py [--quick] [--batch 2048] [--alpha 1.1]

``figure`` = mean communication per link per iteration at 1% (MB); ``baseline`` = at 0% (pure model
parallelism, planned in the same run).
"""

import argparse

from _plan_common import criteo_profile, criteo_tables, emit, log
from embedscale.plan.api import make_plan
from embedscale.plan.cost import evaluate
from embedscale.specs import Topology

RATIOS = (0.0, 0.01, 0.02, 0.05, 0.10, 0.15, 0.20)


def sweep(tables, prof, topo, mode, batch, ratios):
    rows = []
    for e in ratios:
        plan = make_plan("oper", tables, prof, topo, mode=mode, extra_memory=e, batch_size=batch, traffic="access")
        plan.validate()
        c = evaluate(plan, prof, topo, mode=mode, batch_size=batch, part_counts=plan.part_counts)
        rows.append({"extra_memory": e, "comm_mean_mb": c.comm_mean / 1e6, "comm_var_mb2": c.comm_var,
                     "dob_comm": c.dob_comm, "max_rank_cost": c.max_rank_cost,
                     "max_memory_over_footprint_share": float(c.memory_per_rank.max() * 8 / sum(t.memory_bytes for t in tables)),
                     "plan_seconds": plan.meta["plan_seconds"]})
        log(mode, rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="0%, 1%, 5% only; no training sweep")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--alpha", type=float, default=1.1)
    args = ap.parse_args()
    tables = criteo_tables()
    prof = criteo_profile(tables, args.alpha)
    topo = Topology(num_hosts=1, ranks_per_host=8)
    ratios = (0.0, 0.01, 0.05) if args.quick else RATIOS
    inf = sweep(tables, prof, topo, "inference", args.batch, ratios)
    extra = {"inference": inf}
    if not args.quick:
        extra["training"] = sweep(tables, prof, topo, "training", args.batch, ratios)
    emit("plan_extra_memory_sweep", inf[1]["comm_mean_mb"], inf[0]["comm_mean_mb"], "MB per link per iteration",
         {"tables": "criteo-kaggle", "profile": f"zipf alpha={args.alpha}", "ranks": "1x8", "mode": "inference",
          "batch_size_per_rank": args.batch, "extra_memory": list(ratios)},
         reduction_at_1pct=inf[0]["comm_mean_mb"] / inf[1]["comm_mean_mb"], **extra)


if __name__ == "__main__":
    main()
