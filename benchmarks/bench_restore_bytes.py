"""Bytes a re-sharding restore reads per rank: a checkpoint written by 4 ranks restored onto 1, 2, 3 and 8 ranks,
on a local path and on S3 (moto's local server), our reader (the manifest's row index: a rank's rows only, and
the rest of each rank file without the tables' rows) against the strongest plain alternative, every rank
reading every rank file whole (``read_shards`` then ``table_pieces``), interleaved.

Figure: the most a rank reads, over a rank's share of the checkpoint (its total bytes / new world size); the bar
is <= 1.2. Every rank also needs the dense state whole (1 MB here, replicated), which weighs on that share as the
world grows; ``over_need`` divides instead by what the rank needs (its rows, weight and momentum, and the dense
state). On S3 the bytes are those fetched (``storage.BYTES_READ``); locally the rank files are memory-mapped,
so ours is the row reader's count plus the bytes of what else it loads (dense state, run position), and the
baseline the files' sizes. One JSON line per store and world size; times are medians / p90 over the repeats.

    python benchmarks/bench_restore_bytes.py [--rows 200000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from embedscale import storage
from embedscale.storage import ObjectPath, location
from embedscale.train.checkpoint import read_manifest, read_shards, table_pieces, write_manifest, write_rank_file
from embedscale.train.ckpt_rows import RowReader

DIM, WRITERS = 16, 4
DENSE = 512 * 512 * 4  # rank 0's dense state, bytes


def write_checkpoint(d, rows: list[int]) -> None:
    """A 4-rank checkpoint: every table split row-wise; rank 0 holds a dense state of ~1 MB."""
    g = torch.Generator().manual_seed(0)
    for r in range(WRITERS):
        tables = {}
        for t, n in enumerate(rows):
            ids = torch.arange(n * r // WRITERS, n * (r + 1) // WRITERS)
            tables[f"t{t}"] = {"rows": ids, "weight": torch.randn(ids.numel(), DIM, generator=g),
                               "momentum": torch.rand(ids.numel(), generator=g)}
        payload = {"rank": r, "tables": tables}
        if r == 0:
            payload.update({"dense": {"mlp.weight": torch.randn(512, 512, generator=g)}, "losses": [0.5] * 100})
        write_rank_file(d, r, payload)
    write_manifest(d, WRITERS, {"tables": [f"t{t}" for t in range(len(rows))], "table_rows": rows, "step": 1,
                                "epoch": 0, "batch_in_epoch": 1, "samples": 1})


def file_bytes(d, m) -> int:
    return sum((d / s).size() if isinstance(d, ObjectPath) else os.path.getsize(d / s) for s in m["shards"])


def ours(d, q: int, world: int) -> int:
    m = read_manifest(d)
    before = storage.BYTES_READ[0]
    shards = read_shards(d, m, tables=False)
    reader = RowReader(d, m)
    for name, n in zip(m["tables"], m["table_rows"]):
        reader.read(name, np.arange(n * q // world, n * (q + 1) // world))
    if isinstance(d, ObjectPath):
        return storage.BYTES_READ[0] - before
    other = sum(t.nbytes for sh in shards for k in ("dense",) for t in (sh.get(k) or {}).values())
    return reader.bytes_read + other


def whole(d, q: int, world: int) -> int:
    m = read_manifest(d)
    before = storage.BYTES_READ[0]
    shards = read_shards(d, m)
    for name in m["tables"]:
        rows, w, mom = table_pieces(shards, name)
        float(w.sum()) + float(mom.sum())  # touch every page, as a restore that copies the rows out does
    return storage.BYTES_READ[0] - before if isinstance(d, ObjectPath) else file_bytes(d, m)


def moto():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    location("s3://bench").fs.mkdir("bench")
    return server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the largest table")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = [args.rows, args.rows // 4, args.rows // 2]
    load0 = os.getloadavg()
    server = moto()
    try:
        tmp = Path(tempfile.mkdtemp(prefix="bench-restore-"))
        for store, d in (("local", tmp / "step"), ("s3", location("s3://bench/run/checkpoints/step-00000001"))):
            write_checkpoint(d, rows)
            total = file_bytes(d, read_manifest(d))
            for world in (1, 2, 3, 8):
                got = {"ours": [], "whole": []}
                secs = {"ours": [], "whole": []}
                for _ in range(args.repeats):
                    for name, fn in (("ours", ours), ("whole", whole)):  # interleaved
                        t0 = time.perf_counter()
                        got[name].append(max(fn(d, q, world) for q in range(world)))
                        secs[name].append((time.perf_counter() - t0) / world)
                share = total / world
                o, w = max(got["ours"]) / share, max(got["whole"]) / share
                need = max(sum(n * (q + 1) // world - n * q // world for n in rows) for q in range(world)) \
                    * (DIM * 4 + 4) + DENSE
                print(json.dumps({
                    "figure": "restore_bytes_per_rank_over_share", "store": store, "world": world,
                    "ours": round(o, 4), "baseline_read_every_file_whole": round(w, 4), "ratio": round(w / o, 2),
                    "bar": 1.2, "meets_bar": o <= 1.2, "ours_over_need": round(max(got["ours"]) / need, 4),
                    "seconds_per_rank": {k: {"median": round(statistics.median(v), 4),
                                             "p90": round(float(np.percentile(v, 90)), 4)} for k, v in secs.items()},
                    "config": {"rows": rows, "dim": DIM, "writers": WRITERS, "checkpoint_bytes": total,
                               "repeats": args.repeats},
                    "load": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]}}))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
