"""Live updates under load: a server following a model that a 2-rank job is still training.

Three processes of ours run on this host, as a user would run them:

1. ``embedscale train --nproc 2`` on synthetic Criteo-shaped data (tables capped at ``--max-rows``), a checkpoint
   every ``--checkpoint-every`` steps (a full one, deltas between: online training's checkpoints). The cadence
   is in steps (the library checkpoints by steps); by default it is sized from the job's step time measured on
   this host just before (a 40-step run of the same job, its mean step after the warm-up), so that a new
   version is published about every ``--version-every`` seconds at that step time whatever the host's load
   (2.5 s: about 7.5 s under the serving load, whose share of 2 cores slows the steps about 3x);
2. ``embedscale export RUN --follow --quantize int8 --out LIVE``: each new checkpoint becomes the export LIVE;
3. ``embedscale serve LIVE --follow LIVE``: each new export is swapped in between batches (``--compute-nice``:
   the server's, 0 by default: its compute thread at the training job's priority).

The server's saturation rate is measured first (closed loop, ``--concurrency`` clients, 10 s), then an open-loop
load at ``--load`` (0.5) of it runs for ``--seconds`` (loopback only; bounded in requests and time). Every answer's
``model_version`` is recorded: a swap is the first answer of a new version. Requests sent within 1 s of a swap
are "during swaps", the rest steady. Where a swap's cost comes from: the p99 of requests sent within 1 s after a
new checkpoint is complete, after a new export is renamed into place, near a swap and away from all three
(``by_stage``), and the server's own time to load and warm each version (its log: wall and thread CPU).
``--export-nice``: the exporter at a lower priority (a background job yielding the cores to the server).
Prints one JSON line: swaps, failed requests (any status but 200, or no answer), p99 during swaps over steady
p99 (the bar: zero failures, at most 1.5x), QPS, load average, config.

    .venv/bin/python benchmarks/bench_serve_live.py [--quick] [--seconds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_serve import Client, closed_loop, free_port, request_bodies  # noqa: E402
from bench_serve import run as run_loop  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def embedscale(*args: str, log: Path, nice: int = 0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "embedscale", *args], env=ENV, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, preexec_fn=(lambda: os.nice(nice)) if nice else None)
    proc.log = log
    return proc


def train_args(out: Path, max_rows: int, checkpoint_every: int, *extra: str) -> list[str]:
    """The online-training job: 2 ranks on synthetic Criteo-shaped data, no evaluation or early stop."""
    return ["train", "--nproc", "2", "--out-dir", str(out), "--name", "live", "--no-progress",
            "--data-synthetic-max-rows", str(max_rows), "--data-train-samples", "200000",
            "--data-eval-samples", "4096", "--model-bottom-mlp", "64,16", "--model-top-mlp", "64",
            "--set", f"train.checkpoint_every={checkpoint_every}", "--set", "train.epochs=1000",
            "--set", "train.eval_every=0", "--set", "train.early_stopping_patience=0",
            "--set", "train.batch_size=1024", *extra]


def step_seconds(w: Path, args) -> float:
    """The job's mean step time (after its warm-up) on this host now: 40 steps of the same job, no checkpoint
    but the last."""
    proc = embedscale(*train_args(w / "calibrate", args.max_rows, 0, "--set", "train.max_steps=40"),
                      log=w / "calibrate.log", nice=args.train_nice)
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit("the 40-step calibration run of the training job did not end within 900 s")
    found = next((w / "calibrate").glob("*/summary.json"), None)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"the calibration run failed (exit {proc.returncode}):\n"
                         f"{(w / 'calibrate.log').read_text()[-3000:]}")
    return float(json.loads(found.read_text())["train_step_seconds"]["mean"])


def size_cadence(w: Path, args) -> float | None:
    """``--checkpoint-every 0``: set it from the job's measured step time (returned) and ``--version-every``."""
    if args.checkpoint_every:
        return None
    step_s = step_seconds(w, args)
    args.checkpoint_every = max(1, int(args.version_every / step_s))
    print(f"training step {step_s * 1e3:.0f} ms: a checkpoint every {args.checkpoint_every} steps", file=sys.stderr)
    return step_s


def wait_for(what: str, check, timeout: float, procs: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            log = Path(ended[0].log).read_text()[-3000:]
            raise SystemExit(f"{' '.join(map(str, ended[0].args[2:4]))} ended (exit {ended[0].returncode}) while "
                             f"waiting for {what}:\n{log}")
        time.sleep(0.5)
    raise SystemExit(f"no {what} within {timeout:.0f} s")


async def watch(events: dict, t0: float, run: Path, live: Path, every: float = 0.05) -> None:
    """Note when (seconds after ``t0``) each new checkpoint of ``run`` is complete (``checkpoints``) and each new
    export is renamed into ``live`` (``exports``), until cancelled: the stages before a swap, whose cost to the
    requests around them is reported beside the swaps'."""
    seen: dict = {"checkpoints": set(), "exports": None}
    while True:
        now = time.monotonic() - t0
        for m in run.glob("checkpoints/step-*/manifest.json"):
            if m.parent.name not in seen["checkpoints"]:
                seen["checkpoints"].add(m.parent.name)
                events["checkpoints"].append(now)
        try:
            st = (live / "export.json").stat()
            key = (st.st_ino, st.st_mtime_ns)
            if key != seen["exports"]:
                seen["exports"] = key
                events["exports"].append(now)
        except OSError:
            pass
        await asyncio.sleep(every)


async def open_loop_versions(url: str, bodies: list[bytes], rate: float, seconds: float,
                             events: dict | None = None, run: Path | None = None,
                             live: Path | None = None) -> list[tuple]:
    """``(sent at, latency s, status, model_version)`` of every request of a fixed-rate schedule; with
    ``events``, the times of new checkpoints and exports are noted into it (:func:`watch`)."""
    out: list[tuple] = []
    c = Client(url)
    await c.warm(16)

    async def one(i: int, t_send: float) -> None:
        t0 = time.perf_counter()
        status, body = await c.post("/v1/predict", bodies[i % len(bodies)])
        version = json.loads(body).get("model_version") if status == 200 else None
        out.append((t_send, time.perf_counter() - t0, status, version))

    t0 = time.monotonic()
    watcher = asyncio.create_task(watch(events, t0, run, live)) if events is not None else None
    tasks = []
    for i in range(int(rate * seconds)):  # bounded: rate x seconds requests
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, time.monotonic() - t0)))
    await asyncio.gather(*tasks)
    if watcher is not None:
        watcher.cancel()
    c.close()
    if c.errors:
        print(f"{len(c.errors)} requests without an answer, first: {c.errors[0]}", file=sys.stderr)
    return sorted(out)


def by_stage(rows: list[tuple], events: dict, swaps: list[float], window: float = 1.0) -> dict:
    """p99 (ms) and count of answered requests sent within ``window`` s after a new checkpoint, after a new
    export, within ``window`` s of a swap, and of the rest (none of these): which stage of the pipeline costs
    the requests around it."""
    ok = [r for r in rows if r[2] == 200]
    after = lambda t, ts: any(0 <= t - s <= window for s in ts)  # noqa: E731
    near = lambda t, ts: any(abs(t - s) <= window for s in ts)  # noqa: E731
    groups = {"checkpoint": [r[1] for r in ok if after(r[0], events["checkpoints"])],
              "export": [r[1] for r in ok if after(r[0], events["exports"])],
              "swap": [r[1] for r in ok if near(r[0], swaps)],
              "none": [r[1] for r in ok if not (after(r[0], events["checkpoints"]) or after(r[0], events["exports"])
                                                 or near(r[0], swaps))]}
    return {k: {"requests": len(v), "p99_ms": round(float(np.percentile(v, 99)) * 1e3, 1) if v else None,
                "p50_ms": round(float(np.median(v)) * 1e3, 1) if v else None} for k, v in groups.items()}


def swap_times(rows: list[tuple]) -> list[float]:
    """When each new version was first answered (its request's send time)."""
    swaps, seen = [], set()
    for t, _, status, v in rows:
        if status != 200:
            continue
        if seen and v not in seen:
            swaps.append(t)
        seen.add(v)
    return swaps


def analyse(rows: list[tuple], window: float = 1.0) -> dict:
    ok = [r for r in rows if r[2] == 200]
    swaps, seen = [], set()
    for t, _, _, v in ok:  # a swap: the first answer of a new version (answers of the old one may still follow)
        if seen and v not in seen:
            swaps.append(t)
        seen.add(v)
    near = lambda t: any(abs(t - s) <= window for s in swaps)  # noqa: E731
    during = [r[1] for r in ok if near(r[0])]
    steady = [r[1] for r in ok if not near(r[0])]
    p99 = lambda x: float(np.percentile(x, 99)) * 1e3 if x else float("nan")  # noqa: E731
    return {"requests": len(rows), "failed": len(rows) - len(ok), "failed_by_status": {
                str(c): sum(1 for r in rows if r[2] == c) for c in sorted({r[2] for r in rows} - {200})},
            "swaps": len(swaps),
            "versions": len({r[3] for r in ok}), "p99_steady_ms": p99(steady), "p99_swaps_ms": p99(during),
            "p50_steady_ms": float(np.median(steady)) * 1e3 if steady else float("nan"),
            "requests_during_swaps": len(during)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--load", type=float, default=0.5, help="offered rate as a share of saturation")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rows", type=int, default=100, help="candidates a request")
    ap.add_argument("--max-rows", type=int, default=10_000, help="rows a table at most")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="steps between the job's checkpoints (0: sized from a measured step time, --version-every)")
    ap.add_argument("--version-every", type=float, default=2.5,
                    help="seconds between the job's checkpoints at the step time measured before the load "
                         "(--checkpoint-every 0); under the load the steps take about 3x longer on 2 cores")
    ap.add_argument("--export-every", type=float, default=3.0,
                    help="seconds between the exporter's looks at the run (a new version at most this often)")
    ap.add_argument("--quick", action="store_true", help="60 s of load")
    ap.add_argument("--queue-rows", type=int, default=65536,
                    help="the server's queue: room for the stalls of a shared host at half saturation")
    ap.add_argument("--train-nice", type=int, default=0,
                    help="run the training job at this lower priority (nice), the server's cores first; 0: same "
                         "priority (the saturation is then measured while the job runs, and half of it offered)")
    ap.add_argument("--compute-nice", type=int, default=0,
                    help="the server's --compute-nice; 0 (not its default, 10): its compute thread shares the cores "
                         "with the training job's ranks at their priority instead of yielding to them")
    ap.add_argument("--export-nice", type=int, default=0,
                    help="run the exporter (export --follow) at this lower priority (nice): a background job that "
                         "yields the cores to the server it feeds")
    ap.add_argument("--keep-logs", default="", help="copy the three processes' logs into this directory")
    args = ap.parse_args()
    if args.quick:
        args.seconds = 60.0
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        w = Path(tmp)
        procs: list[subprocess.Popen] = []
        try:
            step_s = size_cadence(w, args)
            procs.append(embedscale(*train_args(w / "runs", args.max_rows, args.checkpoint_every),
                                    log=w / "train.log", nice=args.train_nice))
            ck = wait_for("first checkpoint", lambda: next((w / "runs").glob("*/checkpoints/step-*/manifest.json"),
                                                           None), 1800, procs)
            run = ck.parent.parent.parent
            live = w / "live"
            procs.append(embedscale("export", str(run), "--follow", "--quantize", "int8", "--out", str(live),
                                    "--poll-s", str(args.export_every), log=w / "export.log",
                                    nice=args.export_nice))
            wait_for("first export", lambda: (live / "export.json").exists(), 600, procs)
            port = free_port()
            procs.append(embedscale("serve", str(live), "--follow", str(live), "--follow-poll-s", "0.2",
                                    "--host", "127.0.0.1", "--port", str(port), "--max-rows", "1024",
                                    "--queue-rows", str(args.queue_rows), "--compute-nice", str(args.compute_nice),
                                    log=w / "serve.log"))
            url = f"http://127.0.0.1:{port}"
            import httpx

            wait_for("server", lambda: _ready(httpx, url), 300, procs)
            tables = [t["num_rows"] for t in json.loads((live / "export.json").read_text())["tables"]]
            bodies = request_bodies(64, args.rows, tables)
            sat = run_loop(closed_loop(url, bodies, args.concurrency, 10.0))["qps"]
            rate = max(args.load * sat, 0.5)
            print(f"saturation {sat:.1f} qps; offering {rate:.1f} for {args.seconds:.0f} s", file=sys.stderr)
            events = {"checkpoints": [], "exports": []}
            rows = run_loop(open_loop_versions(url, bodies, rate, args.seconds, events, run, live))
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
            if args.keep_logs:
                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                for log in ("train.log", "export.log", "serve.log"):
                    if (w / log).exists():
                        shutil.copy(w / log, Path(args.keep_logs) / log)
        res = analyse(rows)
        res["by_stage"] = by_stage(rows, events, swap_times(rows))
        res["events"] = {k: len(v) for k, v in events.items()}
        res["swap_log"] = swap_log(w / "serve.log")
    ratio = res["p99_swaps_ms"] / res["p99_steady_ms"] if res["swaps"] else None
    print(json.dumps({"benchmark": "serve_live_swaps", "figure": ratio, "unit": "p99 during swaps / steady p99",
                      "baseline": "the same server between swaps (steady)", **res, "saturation_qps": sat,
                      "offered_qps": rate, "train_step_s": step_s,
                      "load": {"start": load0, "end": os.getloadavg()},
                      "config": vars(args)}))
    return 0


def swap_log(log: Path) -> dict | None:
    """The server's own account of its swaps (``serve --follow`` logs each load's wall and CPU time): median and
    max, ms."""
    import re

    try:
        found = [tuple(map(float, m)) for m in re.findall(r"loaded in ([\d.]+) ms \(thread CPU ([\d.]+) ms\)",
                                                          log.read_text())]
    except OSError:
        return None
    if not found:
        return None
    wall, cpu = zip(*found)
    return {"loads": len(found), "wall_ms": [round(float(np.median(wall)), 1), round(max(wall), 1)],
            "cpu_ms": [round(float(np.median(cpu)), 1), round(max(cpu), 1)]}


def _ready(httpx, url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
