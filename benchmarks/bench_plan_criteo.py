"""Criteo Kaggle cardinalities, power-law profile, 8 ranks on one host, training, 5% extra memory.

Bar: DoB of lookup and of communication >= 0.99, memory within the budget, planned in <= 10 s (OPER
Table 3: 120 s for a 99.1% DoB). The baseline, planned and evaluated in the same run, is the row-wise
even split (and table-wise, TorchRec's planner when installed, as extra keys).

    .venv/bin/python benchmarks/bench_plan_criteo.py [--quick] [--batch 2048] [--alpha 1.1]

``figure`` = min(DoB lookup, DoB comm) of ``oper``; ``baseline`` = the same for row-wise.
"""

import argparse
import time

import numpy as np

from _plan_common import criteo_profile, criteo_tables, emit, log
from embedscale.plan.api import make_plan
from embedscale.plan.cost import evaluate
from embedscale.plan.oper import rank_capacity
from embedscale.plan.synthetic_profile import ArrayProfile
from embedscale.specs import Topology


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the generic-profile (argsort) timing")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--mode", default="training")
    args = ap.parse_args()
    tables = criteo_tables()
    prof = criteo_profile(tables, args.alpha)
    topo = Topology(num_hosts=1, ranks_per_host=8)
    res = {}
    for name in ("oper", "row_wise", "table_wise", "torchrec"):
        t = time.perf_counter()
        try:
            plan = make_plan(name, tables, prof, topo, mode=args.mode, extra_memory=0.05, batch_size=args.batch,
                             **({"traffic": "access"} if name == "oper" else {}))
        except Exception as e:  # torchrec missing: report why
            res[name] = {"error": str(e)}
            continue
        secs = time.perf_counter() - t
        plan.validate(capacity_bytes=0) if name != "oper" else plan.validate()
        c = evaluate(plan, prof, topo, mode=args.mode, batch_size=args.batch, part_counts=plan.part_counts)
        res[name] = {"plan_seconds": secs, "dob_memory": c.dob_memory, "dob_lookup": c.dob_lookup,
                     "dob_comm": c.dob_comm, "max_rank_cost": c.max_rank_cost, "comm_mean_mb": c.comm_mean / 1e6,
                     "max_memory_bytes": float(c.memory_per_rank.max())}
        log(name, res[name])
    budget = float(rank_capacity(topo, sum(t.memory_bytes for t in tables), 0.05)[0])
    o = res["oper"]
    extra = {}
    if not args.quick:
        # the same plan from a profile that only has .counts(): our own argsort path
        arr = ArrayProfile({t.name: prof.counts(t.name) for t in tables}, samples=prof.samples)
        t = time.perf_counter()
        make_plan("oper", tables, arr, topo, mode=args.mode, extra_memory=0.05, batch_size=args.batch, traffic="access")
        extra["plan_seconds_counts_only_profile"] = time.perf_counter() - t
    fig = min(o["dob_lookup"], o["dob_comm"])
    base = min(res["row_wise"]["dob_lookup"], res["row_wise"]["dob_comm"])
    emit("plan_criteo_kaggle_8ranks", fig, base, "DoB (min of lookup, comm)",
         {"tables": "criteo-kaggle (26, 33.8M rows, dim 16)", "profile": f"zipf alpha={args.alpha}", "ranks": "1x8",
          "mode": args.mode, "extra_memory": 0.05, "batch_size_per_rank": args.batch},
         plan_seconds=o["plan_seconds"], dob_lookup=o["dob_lookup"], dob_comm=o["dob_comm"], dob_memory=o["dob_memory"],
         max_memory_bytes=o["max_memory_bytes"], memory_budget_bytes=budget,
         memory_within_budget=bool(o["max_memory_bytes"] <= budget), strategies=res, **extra)


if __name__ == "__main__":
    main()
