"""The auto planner's quality bar: eval AUC of the auto plan against the same model trained exact without a budget.

    nice -n 15 .venv/bin/python benchmarks/bench_plan_auto_quality.py --work /tmp/bench_auto_quality \\
        [--max-rows 0] [--train-samples 2000000] [--eval-samples 200000] [--learnable-count 2] \\
        [--costs costs.json] [--device-memory 256MiB] [--host-memory 512MiB]

Bar: "eval AUC after 2M training samples within 0.002 of the same model trained exact without a budget (1
rank), on a planted teacher in which tail rows carry signal too". Data: synthetic criteo-kaggle (full size by
default: 26 tables, 33.76M rows) whose teacher puts signal on tail rows (``data.synthetic.learnable_count``
``--learnable-count``: a row's effect is scaled by ``m / (m + K)``, ``m`` its expected accesses per 200k
samples; the library default K = 2000 leaves signal on a few head rows per large table only, K = 2 gives a row
read 20 times in 2M samples half its effect). Two runs of ``embedscale train`` over the same generated data
(train samples ``[0, N)``, eval ``[N, N + M)``, one epoch, the library's training defaults, global batch
``--batch``):

* ``auto``: 2 gloo ranks, ``--dist-plan auto`` under ``--device-memory`` / ``--host-memory`` per rank (the
  full-size throughput bar's budget by default), costs from ``--costs`` (an ``embedscale calibrate`` file, e.g.
  bench_plan_auto_full.py's) or measured here (single process, ``--batch / 2`` per rank); the plan's forms
  (TT ranks, host tables) are reported;
* ``exact``: 1 process, every table exact on the device, no budget.

Prints one JSON line: figure = auto's eval AUC, baseline = exact's, ``auc_difference``, the teacher's AUC
(the ceiling), the forms, the seconds of each run and the load average before and after.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _plan_common import emit, log


def _es(*args, cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "embedscale", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"embedscale {' '.join(args[:3])} ... failed:\n{p.stderr[-3000:]}")
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/bench_auto_quality")
    ap.add_argument("--max-rows", type=int, default=0, help="Cap every table's rows (0 = full size).")
    ap.add_argument("--train-samples", type=int, default=2_000_000)
    ap.add_argument("--eval-samples", type=int, default=200_000)
    ap.add_argument("--learnable-count", type=float, default=2.0, help="data.synthetic.learnable_count (K).")
    ap.add_argument("--batch", type=int, default=2048, help="Global batch (both runs).")
    ap.add_argument("--device-memory", default="256MiB")
    ap.add_argument("--host-memory", default="512MiB")
    ap.add_argument("--depth", type=int, default=2, help="Pipeline depth of host tables.")
    ap.add_argument("--costs", default=None, help="embedscale calibrate's costs file (default: measured here).")
    ap.add_argument("--runs", default="exact,auto", help="Which runs (comma-separated; an existing summary is kept).")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    costs = Path(args.costs).resolve() if args.costs else work / "costs.json"
    if not costs.exists():
        _es("calibrate", "--rows", "1000000", "--batch", str(args.batch // 2), "--repeats", "7", "--out", str(costs),
            cwd=work)
    data = ["--data-source", "synthetic", "--data-synthetic-preset", "criteo-kaggle",
            "--data-synthetic-max-rows", str(args.max_rows), "--data-synthetic-learnable-count", str(args.learnable_count),
            "--data-train-samples", str(args.train_samples), "--data-eval-samples", str(args.eval_samples),
            "--out-dir", str(work), "--train-batch-size", str(args.batch), "--train-epochs", "1",
            "--train-eval-every", "0", "--train-checkpoint-every", "0", "--no-progress"]
    runs = {"exact": ["--nproc", "1"],
            "auto": ["--nproc", "2", "--dist-plan", "auto", "--dist-device-memory", args.device_memory,
                     "--dist-host-memory", args.host_memory, "--dist-costs", str(costs),
                     "--train-pipeline-depth", str(args.depth)]}
    out, seconds = {}, {}
    for name in [r for r in args.runs.split(",") if r]:
        rd = work / f"run-{name}"
        if not (rd / "summary.json").exists():
            t = time.perf_counter()
            _es("train", *data, *runs[name], "--run-dir", str(rd), cwd=work)
            seconds[name] = time.perf_counter() - t
            log(f"{name}: {seconds[name]:.0f} s; load {os.getloadavg()[0]:.1f}")
        out[name] = json.loads((rd / "summary.json").read_text())
        log(f"{name}: eval AUC {out[name]['eval_auc']:.5f} logloss {out[name]['eval_logloss']:.5f} after "
            f"{out[name]['samples']:,} samples")
    forms = {}
    plan_meta = work / "run-auto" / "plan" / "plan.json"
    if plan_meta.exists():
        meta = json.loads(plan_meta.read_text()).get("meta", {})
        forms = {k: (f["kind"] if f["kind"] != "tt" else f"tt-{f['tt_rank']}"
                     + (f"-hot{f['hot_rows']}" if f.get("hot_rows") else ""))
                 for k, f in meta.get("forms", {}).items() if f["kind"] != "sharded"}
    a = out.get("auto", {}).get("eval_auc", float("nan"))
    b = out.get("exact", {}).get("eval_auc", float("nan"))
    emit("plan_auto_quality", a, b, "eval AUC (auto plan, 2 ranks) vs exact without a budget (1 rank)",
         {"data": "synthetic criteo-kaggle" + (f" capped at {args.max_rows} rows" if args.max_rows else ", full size"),
          "learnable_count": args.learnable_count, "train_samples": args.train_samples,
          "eval_samples": args.eval_samples, "global_batch": args.batch, "epochs": 1,
          "budget": f"{args.device_memory} device / {args.host_memory} host per rank", "pipeline_depth": args.depth,
          "model": "DLRM 512-256-64 / 512-256, dim 16, training defaults"},
         auc_difference=a - b, within_0_002=abs(a - b) <= 0.002,
         teacher_auc={k: v.get("teacher_auc") for k, v in out.items()},
         eval_logloss={k: v.get("eval_logloss") for k, v in out.items()},
         samples={k: v.get("samples") for k, v in out.items()}, forms=forms, seconds=seconds,
         train_samples_per_s={k: v.get("train_samples_per_s") for k, v in out.items()},
         load_average_before=load0, load_average_after=os.getloadavg())


if __name__ == "__main__":
    main()
