"""Cost of the managed mapping per batch: ``ManagedIdTable.assign`` with mapping shards against the former
table-wide code.

Input: one table's ids of a ``DriftingStream`` (20,000 initial ids, 64 new a step, 2,000 hot ids drawing 80%,
rotating every 50 steps), ``--batch`` ids a batch, a table of ``--rows`` rows, k = 2, LRU. Four mappings see
the same batches, interleaved per repetition: the former implementation (``embedding/managed.py`` at
``--baseline-rev``, one table-wide mapping, read from git), the current one with 1 shard, with ``--shards``
shards all hosted (a world of one), and hosting every other shard (a rank of 2, fed the ids of its shards).
The four run one after the other on every batch (interleaved per batch). Figure: milliseconds per ``assign``,
per batch the fastest of ``--reps`` repetitions, median and p90 over batches 50 .. end (1 torch thread). Prints one JSON line with the load average.

    .venv/bin/python benchmarks/bench_managed_assign.py [--reps 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from embedscale.data.drift_stream import DriftConfig, DriftingStream
from embedscale.embedding.managed import ManagedIdTable, shard_of

ROOT = Path(__file__).resolve().parents[1]


def former_module(rev: str):
    """``embedding/managed.py`` as it was at ``rev`` (the table-wide mapping), imported from a temporary file."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/embedscale/embedding/managed.py"],
                         check=True, capture_output=True, text=True).stdout
    d = tempfile.mkdtemp(prefix="bench_managed_assign-")
    path = Path(d) / "former_managed.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("former_managed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--baseline-rev", default="efa0840", help="git revision of the former table-wide code")
    args = ap.parse_args()
    torch.set_num_threads(1)
    former = former_module(args.baseline_rev)
    st = DriftingStream(DriftConfig(tables=("user",), initial_ids=20_000, new_ids_per_step=64, hot_ids=2_000,
                                    hot_share=0.8, rotate_every=50, batch_size=args.batch, num_dense=1), seed=0)
    batches = [torch.from_numpy(st.batch(s).sparse["user"][0].astype(np.int64)) for s in range(args.steps)]
    S, R = args.shards, args.rows
    makers = {"former": (lambda: former.ManagedIdTable("t", R, 2, "lru"), None),
              "shards_1": (lambda: ManagedIdTable("t", R, 2, "lru", shards=1), None),
              f"shards_{S}": (lambda: ManagedIdTable("t", R, 2, "lru", shards=S), None),
              f"shards_{S}_half_hosted": (lambda: ManagedIdTable("t", R, 2, "lru", shards=S, hosted=range(0, S, 2)),
                                          lambda b: b[shard_of(b, S) % 2 == 0])}
    times = {k: np.zeros((args.reps, len(batches))) for k in makers}
    load0 = os.getloadavg()[0]
    for rep in range(args.reps):
        tables = {name: make() for name, (make, _) in makers.items()}
        for i, b in enumerate(batches):
            for name, (_, select) in makers.items():  # interleaved per batch: the same moment's load for all four
                x = select(b) if select is not None else b
                t0 = time.perf_counter()
                tables[name].assign(x)
                times[name][rep, i] = (time.perf_counter() - t0) * 1e3
    load1 = os.getloadavg()[0]
    # per batch the fastest of the repetitions (a load spike hits one repetition), batches 50 .. end
    best = {k: v[:, 50:].min(0) for k, v in times.items()}
    stats = {k: {"median_ms": float(np.median(v)), "p90_ms": float(np.percentile(v, 90)),
                 "median_ms_all_reps": float(np.median(times[k][:, 50:]))} for k, v in best.items()}
    out = {"benchmark": "managed_assign", "figure": f"ms per assign, {S} shards all hosted",
           "value": stats[f"shards_{S}"]["median_ms"], "baseline": stats["former"]["median_ms"],
           "ratio": stats[f"shards_{S}"]["median_ms"] / stats["former"]["median_ms"], "all": stats,
           "load_average": [round(load0, 2), round(load1, 2)], "config": vars(args)}
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
