"""Raw Criteo TSV -> shards: throughput per core and peak memory of ``convert_criteo``, against a
straightforward line-by-line Python parse of the same file (the shape of Meta's DLRM reference loop).

The input is the real 10k-row Kaggle sample repeated to ~1 GB (``--quick``: ~100 MB) in a temp dir.
The conversion runs in a child process so its peak RSS (``ru_maxrss`` from ``wait4``) is its own.
Bar: >= 20 MB/s per core and peak RSS < 2 GiB. Prints one JSON line on stdout; progress on stderr.

    .venv/bin/python benchmarks/bench_reader.py [--quick] [--categorical vocab]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SAMPLE = Path(__file__).resolve().parents[2] / "shared/data/criteo_kaggle_head10k.tsv"
BAR_MB_S_PER_CORE = 20.0
BAR_PEAK_MIB = 2048.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_input(path: Path, target_bytes: int) -> int:
    sample = SAMPLE.read_bytes()
    copies = max(1, round(target_bytes / len(sample)))
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(sample)
    return copies * len(sample)


def baseline_parse(path: Path, limit_bytes: int, table_rows: int = 1_000_000,
                   block: int = 100_000) -> tuple[int, float, float]:
    """Line by line in Python: split, int(), log1p, int(hex, 16) % rows, into numpy blocks (kept in
    memory, not written). Returns (bytes parsed, wall seconds, CPU seconds) over the first ``limit_bytes``."""
    start, cpu = time.perf_counter(), time.process_time()
    done = 0
    y = np.zeros(block, np.int8)
    x_int = np.zeros((block, 13), np.float32)
    x_cat = np.zeros((block, 26), np.int64)
    i = 0
    with open(path, "rb") as f:
        for raw in f:
            fields = raw.rstrip(b"\n").split(b"\t")
            y[i] = int(fields[0])
            x_int[i] = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1:14]]
            x_cat[i] = [int(v or b"0", 16) % table_rows for v in fields[14:]]
            i += 1
            if i == block:
                i = 0
            done += len(raw)
            if done >= limit_bytes:
                break
    return done, time.perf_counter() - start, time.process_time() - cpu


def child(args: argparse.Namespace) -> None:
    import resource

    from embedscale.data.criteo import convert_criteo

    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    m = convert_criteo(args.input, args.out, categorical=args.categorical, progress=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)  # all threads, no imports
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "rows": m.rows, "shards": len(m.shards)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~100 MB input instead of ~1 GB")
    ap.add_argument("--categorical", default="hash", choices=["hash", "vocab"])
    ap.add_argument("--baseline-mb", type=float, default=50.0, help="prefix the Python baseline parses")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not SAMPLE.exists():
        sys.exit(f"bench_reader: the real Criteo sample is not at {SAMPLE} (see shared/data/README.md)")
    import pyarrow as pa

    load = os.getloadavg()  # other jobs on the machine stretch wall-clock figures; CPU figures less so
    target = (100 if args.quick else 1000) * 1_000_000
    with tempfile.TemporaryDirectory(prefix="bench_reader-") as tmp:
        src = Path(tmp) / "criteo.tsv"
        size = make_input(src, target)
        log(f"input: {size / 1e6:.0f} MB at {src}")

        cmd = [sys.executable, __file__, "--child", "--input", str(src), "--out", str(Path(tmp) / "shards"),
               "--categorical", args.categorical]
        wall = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - wall
        if status != 0:
            sys.exit(f"bench_reader: conversion failed (status {status})")
        result = json.loads(out.decode().strip().splitlines()[-1])
        seconds = result["seconds"]
        cpu = result["cpu_seconds"]
        peak_mib = usage.ru_maxrss / 1024  # kilobytes on Linux
        threads = min(pa.cpu_count(), os.cpu_count() or 1)
        ours = size / 1e6 / seconds / threads
        log(f"ours: {size / 1e6 / seconds:.1f} MB/s on {threads} threads = {ours:.1f} MB/s per core, "
            f"{cpu:.1f} CPU s, peak RSS {peak_mib:.0f} MiB")

        limit = min(size, int(args.baseline_mb * 1e6))
        log(f"baseline: line-by-line Python on the first {limit / 1e6:.0f} MB ...")
        b_bytes, b_seconds, b_cpu = baseline_parse(src, limit)
        base = b_bytes / 1e6 / b_seconds  # one thread
        log(f"baseline: {base:.2f} MB/s per core, {b_bytes / 1e6 / b_cpu:.1f} MB per CPU s "
            f"(would take {size / 1e6 / base:.0f} s for the whole file)")

    print(json.dumps({
        "benchmark": "reader",
        "figure": round(ours, 2),
        "baseline": round(base, 2),
        "ratio": round(ours / base, 2),
        "unit": "MB/s per core",
        "peak_rss_mib": round(peak_mib, 1),
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu, 2),
        "mb_per_cpu_second": round(size / 1e6 / cpu, 2),
        "baseline_mb_per_cpu_second": round(b_bytes / 1e6 / b_cpu, 2),
        "cpu_ratio": round((size / cpu) / (b_bytes / b_cpu), 2),
        "meets_bar": bool(ours >= BAR_MB_S_PER_CORE and peak_mib < BAR_PEAK_MIB),
        "config": {
            "load_average_at_start": [round(x, 2) for x in load],
            "input_mb": round(size / 1e6, 1), "rows": result["rows"], "shards": result["shards"],
            "categorical": args.categorical, "threads": threads, "cores": os.cpu_count(),
            "figure": "input bytes / conversion wall seconds (in the child, imports excluded) / threads; "
                      "mb_per_cpu_second: input bytes / (user + sys) CPU seconds of the conversion",
            "baseline": f"line-by-line Python parse (split, int, log1p, int(hex,16) % 1e6) of the first "
                        f"{b_bytes / 1e6:.0f} MB, timed and extrapolated; 1 thread",
            "peak_rss": "ru_maxrss of the conversion's child process",
            "bar": {"mb_s_per_core": BAR_MB_S_PER_CORE, "peak_rss_mib": BAR_PEAK_MIB},
        },
    }))


if __name__ == "__main__":
    main()
