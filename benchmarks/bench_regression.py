"""The "no slower than before a refactor" bar, measured: the refactored tree against a pre-change tree in the same
session, interleaved (base, new, base, new, ...), so that the noise of a shared machine hits both alike.

Two figures, each run once per round in each tree, every run a fresh subprocess with ``PYTHONPATH=<tree>/src``:

- ``bench_vs_torchrec.py`` (each tree runs ITS OWN copy of the script, ``<tree>/benchmarks/bench_vs_torchrec.py``):
  the ratios ours / TorchRec for training and inference. TorchRec runs in the same process and alternates with
  ours step by step, so it is the control for machine noise: a regression shows as a lower ratio, not merely a
  lower samples/s.
- the main job, ``python -m embedscale run <--run-args> --no-progress --json`` (a smaller variant of the default
  job, same flags for both trees): ``train_samples_per_s`` of its JSON summary. This has no control in-run, so
  the interleaving and the load average recorded during each run are what make it comparable.

The 1-minute load average is sampled every second while each run is going (mean and max kept per run).
Prints progress on stderr and one JSON line on stdout: ``figure`` = the new tree's median main-job samples/s,
``baseline`` = the base tree's median, ``ratio`` = figure / baseline, the same for both vs_torchrec ratios,
p90s of every figure over the runs (nearest-rank), every run's raw figures and load, and the config.

    .venv/bin/python benchmarks/bench_regression.py --base /work/wt/base [--new .] [--rounds 2]
        [--vs-torchrec-args "--quick --steps 12"] [--run-args "--data-train-samples 300000"]
        [--skip-vs-torchrec] [--skip-run]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _p90(xs: list) -> float:
    """Nearest-rank 90th percentile (with 2-3 runs: the largest)."""
    s = sorted(xs)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)] if s else math.nan


def _stats(xs: list) -> dict:
    return {"median": statistics.median(xs) if xs else math.nan, "min": min(xs, default=math.nan),
            "max": max(xs, default=math.nan), "p90": _p90(xs), "n": len(xs), "values": xs}


class _LoadSampler:
    """Samples ``os.getloadavg()[0]`` every ``period`` s in a thread while a run is going."""

    def __init__(self, period: float = 1.0):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        s = self.samples or [math.nan]
        return {"mean": statistics.fmean(s), "max": max(s)}


def _last_json(stdout: str, what: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what}: no JSON line on stdout:\n{stdout[-2000:]}")


def _run(cmd: list, tree: Path, cwd: str, timeout: float, what: str) -> tuple:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    t0 = time.perf_counter()
    with _LoadSampler() as ls:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return _last_json(p.stdout, what), {"wall_s": wall, "load1": ls.summary()}


def run_vs_torchrec(tree: Path, extra: list, timeout: float) -> dict:
    """One ``bench_vs_torchrec.py`` run with the tree's own copy of the script; its ratios and samples/s."""
    script = tree / "benchmarks" / "bench_vs_torchrec.py"
    with tempfile.TemporaryDirectory() as d:
        out, meta = _run([sys.executable, str(script), *extra, "--out", ""], tree, d, timeout,
                         f"vs_torchrec ({tree})")
    return {"train_ratio": out["ratio"], "train_paired_ratio": out["paired_ratio"],
            "inference_ratio": out["inference"]["ratio"],
            "inference_paired_ratio": out["inference"]["paired_ratio"],
            "ours_train_samples_per_s": out["figure"], "torchrec_train_samples_per_s": out["baseline"],
            "ours_inference_samples_per_s": out["inference"]["figure"],
            "torchrec_inference_samples_per_s": out["inference"]["baseline"],
            "check": out.get("results", {}).get(out["config"]["main_config"], {}).get("check"), **meta}


def run_main_job(tree: Path, extra: list, timeout: float) -> dict:
    """One ``embedscale run`` (the main job with ``extra`` flags) in a scratch directory; its samples/s."""
    with tempfile.TemporaryDirectory() as d:
        out, meta = _run([sys.executable, "-m", "embedscale", "run", *extra, "--out-dir", str(Path(d) / "runs"),
                          "--no-progress", "--json"], tree, d, timeout, f"embedscale run ({tree})")
    return {"train_samples_per_s": out["train_samples_per_s"],
            "summary": {k: v for k, v in out.items() if k != "run_dir"}, **meta}


def _git_head(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the pre-change tree (its src/ and its own benchmarks/)")
    ap.add_argument("--new", default=str(ROOT), help="the refactored tree (default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="base/new pairs per figure")
    ap.add_argument("--vs-torchrec-args", default="--quick --steps 12")
    ap.add_argument("--run-args", default="--data-train-samples 300000")
    ap.add_argument("--skip-vs-torchrec", action="store_true")
    ap.add_argument("--skip-run", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=1200)
    args = ap.parse_args()
    trees = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    vt_extra, run_extra = shlex.split(args.vs_torchrec_args), shlex.split(args.run_args)
    runs = {"vs_torchrec": {"base": [], "new": []}, "main_job": {"base": [], "new": []}}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        # base first in even rounds, new first in odd ones, so neither always follows the other
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for which in order:
            if not args.skip_vs_torchrec:
                x = run_vs_torchrec(trees[which], vt_extra, args.timeout_s)
                runs["vs_torchrec"][which].append(x)
                _log(f"round {r} {which:4s} vs_torchrec: train {x['train_ratio']:.3f}x, inference "
                     f"{x['inference_ratio']:.3f}x ({x['ours_train_samples_per_s']:.0f} / "
                     f"{x['torchrec_train_samples_per_s']:.0f} samples/s), load {x['load1']['mean']:.2f}, "
                     f"{x['wall_s']:.0f} s")
        for which in order:
            if not args.skip_run:
                x = run_main_job(trees[which], run_extra, args.timeout_s)
                runs["main_job"][which].append(x)
                _log(f"round {r} {which:4s} main job: {x['train_samples_per_s']:.0f} samples/s, load "
                     f"{x['load1']['mean']:.2f}, {x['wall_s']:.0f} s")

    def figs(kind, key):
        return {w: _stats([x[key] for x in runs[kind][w]]) for w in ("base", "new")}

    summary = {}
    for kind, keys in (("vs_torchrec", ("train_ratio", "inference_ratio", "train_paired_ratio",
                                        "inference_paired_ratio", "ours_train_samples_per_s",
                                        "torchrec_train_samples_per_s", "ours_inference_samples_per_s",
                                        "torchrec_inference_samples_per_s")),
                       ("main_job", ("train_samples_per_s",))):
        for key in keys:
            f = figs(kind, key)
            if f["base"]["n"] and f["new"]["n"]:
                summary[f"{kind}.{key}"] = {**f, "new_over_base": f["new"]["median"] / f["base"]["median"]}
    load = {kind: {w: _stats([x["load1"]["mean"] for x in runs[kind][w]]) for w in ("base", "new")}
            for kind in runs}
    mj = summary.get("main_job.train_samples_per_s")
    vt = summary.get("vs_torchrec.train_ratio")
    vi = summary.get("vs_torchrec.inference_ratio")
    line = {
        "benchmark": "refactor_regression", "unit": "samples/s",
        "figure": mj["new"]["median"] if mj else None, "baseline": mj["base"]["median"] if mj else None,
        "ratio": mj["new_over_base"] if mj else None,
        "p90": {"new": mj["new"]["p90"], "base": mj["base"]["p90"]} if mj else None,
        "vs_torchrec_train_ratio": {"new": vt["new"]["median"], "base": vt["base"]["median"],
                                    "new_over_base": vt["new_over_base"], "p90_new": vt["new"]["p90"],
                                    "p90_base": vt["base"]["p90"]} if vt else None,
        "vs_torchrec_inference_ratio": {"new": vi["new"]["median"], "base": vi["base"]["median"],
                                        "new_over_base": vi["new_over_base"], "p90_new": vi["new"]["p90"],
                                        "p90_base": vi["base"]["p90"]} if vi else None,
        "load": load, "summary": summary, "runs": runs,
        "config": {"base": str(trees["base"]), "base_commit": _git_head(trees["base"]), "new": str(trees["new"]),
                   "new_commit": _git_head(trees["new"]), "rounds": args.rounds,
                   "vs_torchrec_args": args.vs_torchrec_args, "run_args": args.run_args,
                   "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
                   "command": " ".join([".venv/bin/python", "benchmarks/bench_regression.py", *sys.argv[1:]])},
    }
    print(json.dumps(line, default=float))


if __name__ == "__main__":
    main()
