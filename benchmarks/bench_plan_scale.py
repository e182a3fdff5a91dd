"""Scale: an OPER Syn_Small-like table set (50 tables x 2^24 rows = 838.9M rows, dim 64, power law) on
4 hosts x 4 ranks. Bar: planned in at most 120 s with peak memory under 12 GiB.

    .venv/bin/python benchmarks/bench_plan_scale.py [--quick] [--mode training]

Peak memory is the process's maximum resident set right after ``oper`` planned (before anything else
runs). ``figure`` = oper's ``max_rank_cost``; ``baseline`` = row-wise's (planned and evaluated after).
``--quick``: 8 tables (134M rows).
"""

import argparse
import time

from _plan_common import emit, log, peak_rss_gib
from embedscale.plan.api import make_plan
from embedscale.plan.cost import evaluate
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.specs import TableSpec, Topology


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mode", default="training")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--traffic", choices=["distinct", "access"], default="distinct",
                    help="What oper plans against (plan.cost): the executor's traffic, or OPER's eq. 3.")
    args = ap.parse_args()
    n_tables = 8 if args.quick else 50
    tables = [TableSpec(f"T{i}", 1 << 24, dim=64) for i in range(n_tables)]
    prof = ZipfProfile.from_tables(tables, alpha=args.alpha, samples=100_000_000)
    topo = Topology(num_hosts=4, ranks_per_host=4)
    rss0 = peak_rss_gib()
    t = time.perf_counter()
    plan = make_plan("oper", tables, prof, topo, mode=args.mode, extra_memory=0.05, batch_size=args.batch,
                     traffic=args.traffic)
    plan_s = time.perf_counter() - t
    rss = peak_rss_gib()
    log(f"oper planned {sum(x.num_rows for x in tables)} rows in {plan_s:.1f} s, peak RSS {rss:.2f} GiB, "
        f"{plan.num_partitions} partitions")
    t = time.perf_counter()
    plan.validate()
    val_s = time.perf_counter() - t
    co = evaluate(plan, prof, topo, mode=args.mode, batch_size=args.batch, part_counts=plan.part_counts)
    t = time.perf_counter()
    rw = make_plan("row_wise", tables, prof, topo, mode=args.mode, extra_memory=0.05, batch_size=args.batch)
    cr = evaluate(rw, prof, topo, mode=args.mode, batch_size=args.batch)
    rw_s = time.perf_counter() - t
    log(f"validate {val_s:.1f} s; row-wise plan+evaluate {rw_s:.1f} s")
    emit("plan_scale_syn_small_4x4", co.max_rank_cost, cr.max_rank_cost, "us per iteration (max over ranks)",
         {"tables": f"{n_tables} x 2^24 rows, dim 64", "rows": sum(x.num_rows for x in tables),
          "profile": f"zipf alpha={args.alpha}", "ranks": "4x4", "mode": args.mode, "extra_memory": 0.05,
          "batch_size_per_rank": args.batch, "traffic": args.traffic},
         plan_seconds=plan_s, peak_rss_gib=rss, rss_before_planning_gib=rss0, validate_seconds=val_s,
         partitions=plan.num_partitions, dob_memory=co.dob_memory, dob_lookup=co.dob_lookup, dob_comm=co.dob_comm,
         row_wise_dob_lookup=cr.dob_lookup, row_wise_dob_comm=cr.dob_comm)


if __name__ == "__main__":
    main()
