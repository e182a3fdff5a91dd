"""``oper`` against TorchRec's own planner, table-wise and row-wise, on one cost model.

Criteo Kaggle cardinalities, power-law profile, 8 ranks on one host, 5% extra memory. Every plan is
evaluated by ``plan.cost`` (OPER eqs. 1-5). Bar: ``oper``'s largest per-rank lookup-plus-communication
cost at most 0.5x TorchRec's (and table-wise's, row-wise's).

    .venv/bin/python benchmarks/bench_plan_vs_torchrec.py [--quick] [--alpha 1.1]

``figure`` = oper's ``max_rank_cost`` (us/iteration) in training at batch 2048 per rank; ``baseline`` =
TorchRec's; the other modes and batch sizes are in ``cases``.
"""

import argparse

from _plan_common import criteo_profile, criteo_tables, emit, log
from embedscale.plan.api import compare
from embedscale.specs import Topology


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="training at batch 2048 only")
    ap.add_argument("--alpha", type=float, default=1.1)
    args = ap.parse_args()
    tables = criteo_tables()
    prof = criteo_profile(tables, args.alpha)
    topo = Topology(num_hosts=1, ranks_per_host=8)
    cases = []
    grid = [("training", 2048)] if args.quick else [("training", 2048), ("inference", 2048), ("training", 8192), ("inference", 8192)]
    for mode, batch in grid:
        rep = compare(["oper", "torchrec", "table_wise", "row_wise"], tables, prof, topo, mode=mode, batch_size=batch)
        s = rep["strategies"]
        row = {"mode": mode, "batch_size_per_rank": batch}
        for n, e in s.items():
            row[n] = e.get("max_rank_cost", e.get("error"))
            if "error" not in e and n != "oper":
                row[f"oper_over_{n}"] = s["oper"]["max_rank_cost"] / e["max_rank_cost"]
        row["torchrec_sharding_types"] = s.get("torchrec", {}).get("plan_meta", {}).get("torchrec_sharding_types")
        log(row)
        cases.append(row)
    first = cases[0]
    tr = first["torchrec"] if isinstance(first["torchrec"], float) else float("nan")
    emit("plan_oper_vs_torchrec_max_rank_cost", first["oper"], tr, "us per iteration (max over ranks)",
         {"tables": "criteo-kaggle", "profile": f"zipf alpha={args.alpha}", "ranks": "1x8", "extra_memory": 0.05,
          "mode": first["mode"], "batch_size_per_rank": first["batch_size_per_rank"]}, cases=cases)


if __name__ == "__main__":
    main()
