"""``oper`` against the exact optimum (the MILP, HiGHS) on instances the MILP solves in 60 s.

Small skewed instances (2-3 tables, 14-24 rows, 2-3 ranks, both modes, 0% and 25% extra memory, links
with and without latency). For every instance solved to optimality within the time limit we report
both plans' ``max_rank_cost`` and both times. Bar: ``oper`` within 2% of the optimum.

    .venv/bin/python benchmarks/bench_plan_milp.py [--quick] [--time-limit 60]

``figure`` = the worst oper / optimum over the solved instances; ``baseline`` = the same for row-wise.
"""

import argparse
import time

from _plan_common import emit, log
from embedscale.plan.api import make_plan
from embedscale.plan.cost import evaluate
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.specs import TableSpec, Topology


def instances(quick: bool):
    shapes = [([12, 8, 4], 2), ([10, 4], 2), ([6, 5, 3], 3)] if not quick else [([10, 4], 2), ([6, 5, 3], 3)]
    for k, (rows, m) in enumerate(shapes):
        for mode in ("inference", "training"):
            for extra in (0.0, 0.25):
                lat = 0.0 if (k + (mode == "training")) % 2 == 0 else 2.0
                yield rows, m, mode, extra, lat, 1.0 + 0.1 * k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()
    results = []
    for rows, m, mode, extra, lat, alpha in instances(args.quick):
        tables = [TableSpec(f"t{i}", n, dim=16) for i, n in enumerate(rows)]
        prof = ZipfProfile.from_tables(tables, alpha=alpha, samples=1000, seed=len(rows))
        topo = Topology(num_hosts=1, ranks_per_host=m, intra_host_latency_us=lat)
        t = time.perf_counter()
        mp = make_plan("milp", tables, prof, topo, mode=mode, extra_memory=extra, batch_size=args.batch,
                       time_limit=args.time_limit)
        milp_s = time.perf_counter() - t
        t = time.perf_counter()
        op = make_plan("oper", tables, prof, topo, mode=mode, extra_memory=extra, batch_size=args.batch,
                       traffic="access")
        oper_s = time.perf_counter() - t
        rw = make_plan("row_wise", tables, prof, topo, mode=mode, extra_memory=extra, batch_size=args.batch)
        cm, co, cr = (evaluate(p, prof, topo, mode=mode, batch_size=args.batch) for p in (mp, op, rw))
        r = {"rows": rows, "ranks": m, "mode": mode, "extra_memory": extra, "latency_us": lat, "alpha": alpha,
             "optimal": bool(mp.meta["milp"]["optimal"]), "milp_seconds": milp_s, "oper_seconds": oper_s,
             "milp_max_rank_cost": cm.max_rank_cost, "oper_max_rank_cost": co.max_rank_cost,
             "oper_over_opt": co.max_rank_cost / cm.max_rank_cost, "row_wise_over_opt": cr.max_rank_cost / cm.max_rank_cost,
             "milp_variables": mp.meta["milp"]["variables"]}
        log(r)
        results.append(r)
    solved = [r for r in results if r["optimal"]]
    worst = max(r["oper_over_opt"] for r in solved) if solved else float("nan")
    worst_rw = max(r["row_wise_over_opt"] for r in solved) if solved else float("nan")
    emit("plan_oper_vs_milp_optimum", worst, worst_rw, "max_rank_cost / optimum (worst solved instance)",
         {"instances": len(results), "solved_to_optimality": len(solved), "time_limit_s": args.time_limit,
          "batch_size_per_rank": args.batch},
         mean_oper_over_opt=sum(r["oper_over_opt"] for r in solved) / max(len(solved), 1), instances=results)


if __name__ == "__main__":
    main()
