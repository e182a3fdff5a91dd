"""OPER Fig. 8: 2 hosts x 4 ranks, inter-host links 4.21x the per-byte cost of intra-host links.

Criteo Kaggle cardinalities, power-law profile, 5% extra memory. Bar: communication-cost DoB (min/max
of the per-rank communication cost) at least 0.98.

    .venv/bin/python benchmarks/bench_plan_hetero.py [--quick]

``figure`` = oper's DoB of communication in training at batch 2048; ``baseline`` = row-wise's;
inference and batch 8192 in ``cases``.
"""

import argparse

from _plan_common import criteo_profile, criteo_tables, emit, log
from embedscale.plan.api import compare
from embedscale.specs import Topology


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--alpha", type=float, default=1.1)
    args = ap.parse_args()
    tables = criteo_tables()
    prof = criteo_profile(tables, args.alpha)
    topo = Topology(num_hosts=2, ranks_per_host=4, intra_host_bw=100.0, inter_host_bw=100.0 / 4.21)
    grid = [("training", 2048)] if args.quick else [("training", 2048), ("inference", 2048), ("training", 8192), ("inference", 8192)]
    cases = []
    for mode, batch in grid:
        rep = compare(["oper", "row_wise", "table_wise"], tables, prof, topo, mode=mode, batch_size=batch, traffic="access")
        s = rep["strategies"]
        row = {"mode": mode, "batch_size_per_rank": batch,
               **{f"{n}_dob_comm": e["dob_comm"] for n, e in s.items()},
               **{f"{n}_max_rank_cost": e["max_rank_cost"] for n, e in s.items()},
               "oper_dob_lookup": s["oper"]["dob_lookup"], "oper_dob_memory": s["oper"]["dob_memory"],
               "oper_comm_per_rank": s["oper"]["comm_per_rank"]}
        log(row)
        cases.append(row)
    emit("plan_hetero_2x4_dob_comm", cases[0]["oper_dob_comm"], cases[0]["row_wise_dob_comm"], "DoB (min/max comm per rank)",
         {"tables": "criteo-kaggle", "profile": f"zipf alpha={args.alpha}", "ranks": "2x4", "inter_over_intra_cost": 4.21,
          "extra_memory": 0.05, "mode": cases[0]["mode"], "batch_size_per_rank": cases[0]["batch_size_per_rank"]},
         cases=cases)


if __name__ == "__main__":
    main()
