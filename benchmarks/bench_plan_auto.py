"""``plan --strategy auto`` at scale: the OPER Syn_Small-like case of bench_plan_scale.py (50 tables x 2^24 rows =
838.9M rows, dim 64, Zipf 1.1, 4 hosts x 4 ranks) under a per-rank budget of 2 GiB device and 8 GiB host memory
(the exact tables need 13.6 GiB per rank sharded: the forms are a real choice).

    .venv/bin/python benchmarks/bench_plan_auto.py [--quick] [--device-memory 2GiB] [--host-memory 8GiB]

Bar: planned in at most 60 s with peak memory at most 8 GiB. ``figure`` = auto's planning
seconds; ``baseline`` = oper's planning seconds of the same tables with every table sharded and no budget (what
``--strategy oper`` runs today), planned after auto in the same process (so auto's peak RSS is measured first).
Also reported: the forms chosen, the predicted step time, the per-rank memory, and the greedy search's time.
Costs are the documented defaults (``embedscale calibrate`` measures them on a machine).

``--train DIR``: a small training comparison instead (2 gloo ranks, synthetic criteo-kaggle capped at 200k rows
per table, dim 16): the auto plan under 16 MiB device / 64 MiB host per rank (calibrated costs) against the
hand-made EL-Rec rule of today (tables of at least 100k rows TT rank 32, the rest placed by oper), trained in turns
(A B A B A B); prints train samples/s of both, and both plans' predicted steps (costs of ``embedscale calibrate
--ranks 2``: single-process costs and the executor's overheads per form from real 2-rank steps) against the
measured steps.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _plan_common import emit, log, peak_rss_gib
from embedscale.data.profile import AccessProfile
from embedscale.plan.api import make_plan
from embedscale.plan.auto import load_costs, parse_bytes
from embedscale.plan.autoplan import make_auto_plan, predict_plan_forms
from embedscale.plan.forms import tables_from_profile
from embedscale.plan.plan import Plan
from embedscale.plan.step import DenseModel
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.specs import TableSpec, Topology


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--device-memory", default="2GiB")
    ap.add_argument("--host-memory", default="8GiB")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--train", default=None, help="Work directory of the small training comparison.")
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--train-repeats", type=int, default=3)
    args = ap.parse_args()
    if args.train:
        return train_comparison(Path(args.train), args.train_steps, args.train_repeats)
    n_tables = 8 if args.quick else 50
    tables = [TableSpec(f"T{i}", 1 << 24, dim=64) for i in range(n_tables)]
    prof = ZipfProfile.from_tables(tables, alpha=args.alpha, samples=100_000_000)
    topo = Topology(num_hosts=4, ranks_per_host=4)
    dev, host = parse_bytes(args.device_memory), parse_bytes(args.host_memory)
    load0 = os.getloadavg()
    rss0 = peak_rss_gib()
    t = time.perf_counter()
    plan = make_auto_plan(tables, prof, topo, device_memory=dev, host_memory=host, batch_size=args.batch)
    auto_s = time.perf_counter() - t
    rss = peak_rss_gib()
    rep = plan.meta["auto"]
    kinds = {}
    for e in rep["tables"]:
        kinds[e["chosen"]["form"]] = kinds.get(e["chosen"]["form"], 0) + 1
    log(f"auto planned {sum(x.num_rows for x in tables)} rows in {auto_s:.1f} s (search {rep['search_seconds']:.2f} s),"
        f" peak RSS {rss:.2f} GiB; forms {kinds}; predicted {rep['predicted_step_seconds'] * 1e3:.2f} ms")
    oper_s = float("nan")
    if not args.no_baseline:
        t = time.perf_counter()
        make_plan("oper", tables, prof, topo, extra_memory=0.05, batch_size=args.batch)
        oper_s = time.perf_counter() - t
        log(f"oper (every table sharded, no budget) planned in {oper_s:.1f} s")
    pr = rep["per_rank"]
    emit("plan_auto_syn_small_4x4", auto_s, oper_s, "seconds to plan",
         {"tables": f"{n_tables} x 2^24 rows, dim 64", "rows": sum(x.num_rows for x in tables),
          "profile": f"zipf alpha={args.alpha}", "ranks": "4x4", "batch_size_per_rank": args.batch,
          "device_memory": args.device_memory, "host_memory": args.host_memory, "costs": "defaults"},
         peak_rss_gib=rss, rss_before_planning_gib=rss0, search_seconds=rep["search_seconds"], forms=kinds,
         predicted_step_ms=rep["predicted_step_seconds"] * 1e3, max_device_gib=max(pr["device_total"]) / 2**30,
         max_host_gib=max(pr["host_bytes"]) / 2**30, bar_seconds=60, bar_gib=8, meets_bar=auto_s <= 60 and rss <= 8,
         load_average_before=load0, load_average_after=os.getloadavg())


def _es(*args, cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "embedscale", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"embedscale {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return p


def train_comparison(work: Path, steps: int, repeats: int = 3) -> None:
    work.mkdir(parents=True, exist_ok=True)
    batch = 1024
    if not (work / "data" / "manifest.json").exists():
        _es("data", "synthetic", "--preset", "criteo-kaggle", "--max-rows", "200000", "--samples", "120000",
            "--out", "data", "--no-progress", cwd=work)
    if not (work / "profile").exists():
        _es("profile", "data", "--out", "profile", cwd=work)
    if not (work / "costs.json").exists():
        _es("calibrate", "--rows", "200000", "--batch", str(batch // 2), "--tt-ranks", "8,16,32", "--ranks", "2",
            "--rank-steps", str(steps), "--work", "calibrate-ranks", "--out", "costs.json", cwd=work)
    _es("plan", "--profile", "profile", "--strategy", "auto", "--device-memory", "16MiB", "--host-memory", "64MiB",
        "--hot-touch", "1", "--tt-ranks", "8,16,32", "--costs", "costs.json", "--batch-size", str(batch // 2),
        "--out", "plans-auto", cwd=work)
    _es("plan", "--profile", "profile", "--strategy", "oper", "--tt-min-rows", "100000", "--tt-rank", "32",
        "--batch-size", str(batch // 2), "--out", "plans-elrec", "--json", cwd=work)
    explain = json.loads((work / "plans-auto" / "auto" / "explain.json").read_text())
    plans = {"auto": "plans-auto/auto", "elrec_rule": "plans-elrec/oper"}
    tables = tables_from_profile(AccessProfile.load(work / "profile"), 16)
    costs = load_costs(work / "costs.json")
    predicted = {name: predict_plan_forms(tables, work / "profile", Topology(num_hosts=1, ranks_per_host=2),
                                          Plan.load(work / d).forms, costs=costs, batch_size=batch // 2,
                                          dense=DenseModel(num_features=len(tables), embedding_dim=16))["step_seconds"]
                 for name, d in plans.items()}
    predicted["auto"] = explain["predicted_step_seconds"]
    sps: dict[str, list[float]] = {k: [] for k in plans}
    load0 = os.getloadavg()
    for rep in range(repeats):
        for name, d in plans.items():
            rd = work / "runs" / f"{name}-{rep}"
            if rd.exists():
                subprocess.run(["rm", "-rf", str(rd)], check=True)
            _es("train", "--data-source", "shards", "--data-path", "data", "--train-batch-size", str(batch),
                "--train-max-steps", str(steps), "--nproc", "2", "--dist-plan", d, "--run-dir", str(rd),
                "--no-progress", cwd=work)
            s = json.loads((rd / "summary.json").read_text())
            sps[name].append(float(s["train_samples_per_s"]))
            log(f"{name} run {rep}: {s['train_samples_per_s']:.0f} samples/s")
    a, b = float(np.median(sps["auto"])), float(np.median(sps["elrec_rule"]))
    measured = {k: batch / float(np.median(v)) for k, v in sps.items()}
    forms = {}
    for e in explain["tables"]:
        forms[e["chosen"]["form"]] = forms.get(e["chosen"]["form"], 0) + 1
    emit("plan_auto_train_2ranks", a, b, f"train samples/s (median of {repeats}, interleaved)",
         {"data": "synthetic criteo-kaggle, tables capped at 200k rows, dim 16", "ranks": 2, "batch": batch,
          "steps": steps, "auto_budget": "16MiB device / 64MiB host per rank", "hand_plan": "tt-min-rows 100000 rank 32 + oper"},
         auto_runs=sps["auto"], elrec_rule_runs=sps["elrec_rule"], auto_forms=forms,
         predicted_step_s=predicted, measured_step_s=measured,
         prediction_error={k: predicted[k] / measured[k] - 1 for k in measured},
         executor_overhead_s=costs.executor_overhead_s,
         load_average_before=load0, load_average_after=os.getloadavg())


if __name__ == "__main__":
    main()
