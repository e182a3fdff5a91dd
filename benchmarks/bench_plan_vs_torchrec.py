"""``oper`` against TorchRec's own planner, table-wise and row-wise, on one cost model.

Criteo Kaggle cardinalities, power-law profile, 8 ranks on one host, 5% extra memory. Every plan is
evaluated by ``plan.cost`` (OPER eqs. 1-5). Bar: ``oper``'s largest per-rank lookup-plus-communication
cost at most 0.5x TorchRec's (and table-wise's, row-wise's).

Next to every case: ``plan.bound.lower_bound``, a floor no plan within oper's memory budget can go
below (``lower_bound_over_torchrec`` is the best ratio any plan could reach), and the busiest rank's
cost split into lookup (eq. 2), fetches (eq. 3, x2 in training for the gradients, eq. 4), latency
rounds and replica AllReduce (eq. 5) for oper and TorchRec.

    .venv/bin/python benchmarks/bench_plan_vs_torchrec.py [--quick] [--alpha 1.1]

``figure`` = oper's ``max_rank_cost`` (us/iteration) in training at batch 2048 per rank; ``baseline`` =
TorchRec's; the other modes and batch sizes are in ``cases``.
"""

import argparse

import numpy as np

from _plan_common import criteo_profile, criteo_tables, emit, log
from embedscale.plan.api import compare
from embedscale.plan.bound import lower_bound
from embedscale.plan.partition import sort_tables
from embedscale.specs import Topology


def breakdown(entry: dict) -> dict:
    """The busiest rank's cost by component (us/iteration)."""
    r = int(np.argmax(entry["total_per_rank"]))
    lat, ar = entry["latency_per_rank"][r], entry["allreduce_per_rank"][r]
    return {"rank": r, "lookup": entry["lookup_per_rank"][r], "fetch": entry["comm_per_rank"][r] - lat - ar,
            "latency": lat, "allreduce": ar, "total": entry["total_per_rank"][r]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="training at batch 2048 only")
    ap.add_argument("--alpha", type=float, default=1.1)
    args = ap.parse_args()
    tables = criteo_tables()
    prof = criteo_profile(tables, args.alpha)
    st = sort_tables(tables, prof)
    topo = Topology(num_hosts=1, ranks_per_host=8)
    cases = []
    grid = [("training", 2048)] if args.quick else [("training", 2048), ("inference", 2048), ("training", 8192), ("inference", 8192)]
    for mode, batch in grid:
        rep = compare(["oper", "torchrec", "table_wise", "row_wise"], tables, prof, topo, mode=mode, batch_size=batch,
                      traffic="access")
        s = rep["strategies"]
        row = {"mode": mode, "batch_size_per_rank": batch}
        for n, e in s.items():
            row[n] = e.get("max_rank_cost", e.get("error"))
            if "error" not in e and n != "oper":
                row[f"oper_over_{n}"] = s["oper"]["max_rank_cost"] / e["max_rank_cost"]
        cap = max(s["oper"]["capacity_bytes"])
        b = lower_bound(tables, prof, topo, mode=mode, batch_size=batch, capacity_bytes=cap, sorted_tables=st)
        row["lower_bound"] = b["max_rank_cost"]
        row["oper_over_lower_bound"] = s["oper"]["max_rank_cost"] / b["max_rank_cost"]
        row["lower_bound_capacity_bytes"] = cap
        row["rows_worth_replicating"] = b["rows_worth_replicating"]
        if "error" not in s.get("torchrec", {"error": 1}):
            row["lower_bound_over_torchrec"] = b["max_rank_cost"] / s["torchrec"]["max_rank_cost"]
            row["torchrec_busiest_rank"] = breakdown(s["torchrec"])
            row["torchrec_memory_max_bytes"] = max(s["torchrec"]["memory_per_rank"])
        row["oper_busiest_rank"] = breakdown(s["oper"])
        row["oper_replicated_rows"] = s["oper"]["plan_meta"].get("replicated_rows_everywhere")
        row["oper_plan_seconds"] = s["oper"]["plan_seconds"]
        row["torchrec_sharding_types"] = s.get("torchrec", {}).get("plan_meta", {}).get("torchrec_sharding_types")
        log(row)
        cases.append(row)
    first = cases[0]
    tr = first["torchrec"] if isinstance(first["torchrec"], float) else float("nan")
    emit("plan_oper_vs_torchrec_max_rank_cost", first["oper"], tr, "us per iteration (max over ranks)",
         {"tables": "criteo-kaggle", "profile": f"zipf alpha={args.alpha}", "ranks": "1x8", "extra_memory": 0.05,
          "mode": first["mode"], "batch_size_per_rank": first["batch_size_per_rank"]},
         lower_bound=first["lower_bound"], lower_bound_over_torchrec=first.get("lower_bound_over_torchrec"),
         cases=cases)


if __name__ == "__main__":
    main()
