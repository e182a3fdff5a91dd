"""Single-process training on a machine whose cores are busy: embedscale's thread settings against torch's.

Two busy loops (a Python ``while`` loop, started here, bounded by ``timeout`` and by its own clock, and ended
here by their PIDs) load the machine's cores while ``embedscale train`` (one process, a small synthetic
Criteo-shaped dataset) runs the same steps under three settings, interleaved round by round:

* ``ours``: nothing set, embedscale's choice (``embedscale.threads``: ``OMP_WAIT_POLICY=PASSIVE``, available
  cores // local ranks intra-op threads);
* ``torch``: ``EMBEDSCALE_THREADS=torch``, torch's and OpenMP's defaults (as before the thread settings): the
  baseline;
* ``one_thread``: ``OMP_NUM_THREADS=1``, the hand fix a user would try.

The figure is ``ours``' training samples/s (all steps), the baseline ``torch``'s; both medians over the rounds,
with the steady step time (median and p90 of the steps after the warm-up, from the run's summary).

    .venv/bin/python benchmarks/bench_threads.py                 # 3 rounds of 24 steps, batch 512
    .venv/bin/python benchmarks/bench_threads.py --busy 0        # the same on the machine as it is

Prints one JSON line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
VARIANTS = {"ours": {}, "torch": {"EMBEDSCALE_THREADS": "torch"}, "one_thread": {"OMP_NUM_THREADS": "1"}}


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS",
                                                             "EMBEDSCALE_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**env, **extra}


def _embedscale(args: list, extra: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedscale", *map(str, args)], capture_output=True, text=True,
                          env=_env(extra), timeout=timeout)


def _train(data: Path, runs: Path, name: str, args, timeout: float) -> dict:
    p = _embedscale(["train", "--data-source", "shards", "--data-path", data, "--train-max-steps", args.steps,
                     "--train-batch-size", args.batch, "--train-eval-every", "0", "--train-log-every", "1000",
                     "--train-early-stopping-patience", "0", "--run-dir", runs / f"{name}-{time.time_ns()}",
                     "--no-progress", "--json"], VARIANTS[name], timeout)
    if p.returncode != 0:
        raise SystemExit(f"{name}: embedscale train failed:\n{p.stderr[-3000:]}")
    s = json.loads(p.stdout.strip().splitlines()[-1])
    return {"samples_per_s": s["train_samples_per_s"], "step_median_s": s["train_step_seconds"]["median"],
            "step_p90_s": s["train_step_seconds"]["p90"]}


def _busy_loops(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` busy loops, each bounded twice: by ``timeout`` and by its own clock."""
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen(["timeout", str(int(seconds)), sys.executable, "-c", loop]) for _ in range(n)]


def _stop(busy: list[subprocess.Popen]) -> None:
    """End the busy loops by their PIDs: SIGTERM to ``timeout``, which passes it on to its loop (a SIGKILL would
    end ``timeout`` alone and leave the loop running)."""
    for b in busy:
        b.terminate()
    for b in busy:
        b.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--samples", type=int, default=30_000)
    ap.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)), help="busy loops (default: one a core)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="the busy loops' and every run's bound, seconds")
    args = ap.parse_args()
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_threads_") as tmp:
        data, runs = Path(tmp) / "data", Path(tmp) / "runs"
        p = _embedscale(["data", "synthetic", "--out", data, "--samples", args.samples, "--max-rows", 20_000,
                         "--no-progress"], {}, args.timeout)
        if p.returncode != 0:
            raise SystemExit(p.stderr[-3000:])
        busy = _busy_loops(args.busy, args.timeout)
        got: dict[str, list[dict]] = {k: [] for k in VARIANTS}
        try:
            for r in range(args.rounds):
                for name in VARIANTS:
                    got[name].append(_train(data, runs, name, args, args.timeout))
                    print(f"round {r + 1} {name}: {got[name][-1]}", file=sys.stderr, flush=True)
        finally:
            _stop(busy)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in got[name])

    ours, base = med("ours", "samples_per_s"), med("torch", "samples_per_s")
    print(json.dumps({
        "figure": "single-process training samples/s with embedscale's thread settings, cores busy",
        "value": round(ours, 1), "baseline": round(base, 1), "baseline_name": "torch's and OpenMP's defaults",
        "ratio": round(ours / base, 2),
        "median": {n: round(med(n, "samples_per_s"), 1) for n in VARIANTS},
        "step_median_ms": {n: round(med(n, "step_median_s") * 1e3, 2) for n in VARIANTS},
        "step_p90_ms": {n: round(med(n, "step_p90_s") * 1e3, 2) for n in VARIANTS},
        "runs": got, "load": {"start": load_start, "end": os.getloadavg()},
        "config": {"rounds": args.rounds, "steps": args.steps, "batch": args.batch, "samples": args.samples,
                   "busy_loops": args.busy, "cores": len(os.sched_getaffinity(0)),
                   "wall_s": round(time.perf_counter() - t0, 1)},
    }))


if __name__ == "__main__":
    main()
