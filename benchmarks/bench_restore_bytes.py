"""Bytes and time of a re-sharding restore per rank: a checkpoint written by 4 ranks restored onto 2, 4 and 8
ranks (real processes over gloo), on a local path and on S3 (moto's server on loopback), four ways interleaved
in the same processes:

- ``ours``: ``RowReader.restore`` over the ranks' group: a rank fetches its rows (byte ranges from the manifest
  index) and 1/N of the rank files' other bytes (dense and optimizer state, run position), all in one coalesced
  concurrent batch, then one all_gather hands every rank the rest;
- ``sequential``: the same byte ranges, one request at a time (``concurrency=1``);
- ``per_rank``: no group: every rank fetches every rank file's other bytes itself, plus its rows (the reader
  before the spread);
- ``whole``: the strongest plain alternative, every rank reads every rank file whole (all files at once,
  concurrently), then takes its rows.

``--restores delta,dmt`` (at 1, 2 and 4 ranks with ``--worlds 1,2,4``): the restore of a delta checkpoint (10%
of every table's rows replaced over a 4-rank base) and of a DMT run (row ranges of whole tables per tower group,
one table split), through ``checkpoint.read_rows`` (``ours``: what the sharded and DMT restores call) against
``whole``, what they did before: every rank reads every rank file (a delta: and its base's) whole
(``checkpoint.read_shards``). One process holds every row: ours then reads every file whole too (each byte
once). Bytes there are counted by the file system itself: a counting wrapper of the local one (``countfs://``)
and s3fs's ranged read; a rank's share is the bytes of every rank file the restore needs (a delta: its own and
its base's) times the part of all rows the rank restores (an equal split: 1/N; DMT's whole tables per tower
group are not equal).

Figure: the most a rank reads, over a rank's share of the checkpoint (its total bytes / N); bar <= 1.2. On S3 the
bytes are those fetched (``storage.BYTES_READ``); locally, ``storage.LOCAL_BYTES_READ`` (ranges read with
``pread``) plus the bytes of the rows the reader takes from memory-mapped files (``RowReader.bytes_read``; for
``per_rank`` also every file's bytes beside its tables' rows, paged in from the maps), and for ``whole`` the files'
sizes. Times: per rank, from the manifest read to every row and rank file in memory, the
slowest rank's per repeat (after one uncounted round of every way); median and p90 over the repeats. Each rank
checks its rows and dense state against ``whole``'s (bitwise). One JSON line per store and world size.

    python benchmarks/bench_restore_bytes.py [--rows 100000] [--repeats 3] [--worlds 2,4,8]
        [--restores flat,delta,dmt]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from embedscale import storage
from embedscale.storage import ObjectPath, location
from embedscale.train.checkpoint import (assemble_table, base_ref, delta_entry, merged, read_manifest, read_rows,
                                         read_shards, step_dir, table_pieces, write_manifest, write_rank_file)
from embedscale.train.ckpt_rows import SIZES, RowReader
from embedscale.train.launch import spawn_local

DIM, WRITERS = 16, 4
MODES = ("ours", "sequential", "per_rank", "whole")


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


def file_sizes(d, m) -> list[int]:
    return [(d / s).size() if isinstance(d, ObjectPath) else os.path.getsize(d / s) for s in m["shards"]]


def wanted(m: dict, q: int, world: int) -> dict:
    return {name: np.arange(n * q // world, n * (q + 1) // world) for name, n in zip(m["tables"], m["table_rows"])}


def restore(d, mode: str, q: int, world: int):
    """One rank's restore by ``mode``: ``(shards, {table: (weight, momentum)}, bytes the reader took from maps)``."""
    import torch.distributed as dist

    m = read_manifest(d)
    want = wanted(m, q, world)
    if mode != "whole":
        reader = RowReader(d, m, concurrency=1 if mode == "sequential" else None)
        shards, rows = reader.restore(want, None if mode == "per_rank" else dist.group.WORLD)
        if isinstance(d, ObjectPath):
            return shards, rows, 0
        if mode == "per_rank":  # every file's bytes beside its tables' rows, paged in from the memory maps
            return shards, rows, reader.bytes_read + sum(e - s for f in m["shards"]
                                                         for s, e in zip(*reader._layout(f)[2:4]))
        return shards, rows, reader.bytes_read
    files = storage.fetch_ranges([(d / s, 0, n) for s, n in zip(m["shards"], m.get(SIZES) or file_sizes(d, m))])
    shards = [torch.load(io.BytesIO(b), weights_only=True) for b in files]
    rows = {}
    for name, r in want.items():
        ids, w, mom = table_pieces(shards, name)
        at = np.empty(int(ids.max()) + 1, dtype=np.int64)
        at[ids] = np.arange(ids.size)
        rows[name] = (w[torch.from_numpy(at[r])], mom[torch.from_numpy(at[r])])
    return shards, rows, 0


def worker(rank: int, world: int, where: str, repeats: int) -> dict:
    import torch.distributed as dist

    d = location(where)
    out = {mode: {"bytes": [], "seconds": []} for mode in MODES}
    for mode in MODES:  # warm-up, not counted: connections, file system instances, imports
        restore(d, mode, rank, world)
    for mode in MODES:
        out[mode] = {"bytes": [], "seconds": []}
    for _ in range(repeats):
        got = {}
        for mode in MODES:  # interleaved
            dist.barrier()
            b0 = storage.BYTES_READ[0] + storage.LOCAL_BYTES_READ[0]
            t0 = time.perf_counter()
            shards, rows, mapped = restore(d, mode, rank, world)
            dense = merged(shards, "dense")
            for w, mom in rows.values():  # every byte in memory
                float(w.sum()) + float(mom.sum())
            out[mode]["seconds"].append(time.perf_counter() - t0)
            out[mode]["bytes"].append(storage.BYTES_READ[0] + storage.LOCAL_BYTES_READ[0] - b0 + mapped)
            got[mode] = (rows, dense)
        ref_rows, ref_dense = got["whole"]
        for mode in MODES:  # the same rows and dense state, bitwise, every way
            rows, dense = got[mode]
            assert dense.keys() == ref_dense.keys() and all(torch.equal(dense[k], ref_dense[k]) for k in dense)
            assert all(torch.equal(rows[t][0], ref_rows[t][0]) and torch.equal(rows[t][1], ref_rows[t][1])
                       for t in rows), mode
    if not isinstance(d, ObjectPath):  # whole local files: their sizes (memory-mapped reads are not counted)
        total = sum(file_sizes(d, read_manifest(d)))
        out["whole"]["bytes"] = [total] * repeats
    return out


def moto():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                       "AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "8"})
    for _ in range(100):
        try:
            location("s3://bench").fs.mkdir("bench")
            break
        except Exception:  # noqa: BLE001 - the server thread is still binding its socket
            time.sleep(0.1)
    return server


def stats(v: list[float]) -> dict:
    return {"median": round(statistics.median(v), 4), "p90": round(float(np.percentile(v, 90)), 4)}


def line(store: str, world: int, res: list[dict], total: int, rows: list[int], repeats: int, load0) -> dict:
    share = total / world
    top = {m: max(max(r[m]["bytes"]) for r in res) / share for m in MODES}
    slowest = {m: [max(r[m]["seconds"][i] for r in res) for i in range(repeats)] for m in MODES}
    med = {m: statistics.median(v) for m, v in slowest.items()}
    return {
        "figure": "restore_bytes_per_rank_over_share", "store": store, "world": world,
        "ours": round(top["ours"], 4), "baseline_read_every_file_whole": round(top["whole"], 4),
        "per_rank_reads_before": round(top["per_rank"], 4), "ratio": round(top["whole"] / top["ours"], 2),
        "bar": 1.2, "meets_bar": top["ours"] <= 1.2,
        "seconds_slowest_rank": {m: stats(v) for m, v in slowest.items()},
        "time_ratio": {"sequential_over_ours": round(med["sequential"] / med["ours"], 2),
                       "whole_over_ours": round(med["whole"] / med["ours"], 2),
                       "per_rank_over_ours": round(med["per_rank"] / med["ours"], 2)},
        "config": {"rows": rows, "dim": DIM, "writers": WRITERS, "checkpoint_bytes": total, "repeats": repeats},
        "load": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]}}


# -- delta and DMT restores ------------------------------------------------------------------------
TOUCHED = 0.1  # the share of every table's rows a delta replaces


class CountingFS(LocalFileSystem):
    """The local file system under ``countfs://``, counting the bytes of every read it serves."""

    protocol = "countfs"
    served = [0]

    def __init__(self, **kwargs):
        super().__init__(auto_mkdir=True, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        CountingFS.served[0] += len(data)
        return data


fsspec.register_implementation("countfs", CountingFS, clobber=True)


def count_s3() -> None:
    """Count the bytes of s3fs's own reads (whole objects and ranges) in ``CountingFS.served`` too."""
    import s3fs

    if getattr(s3fs.S3FileSystem, "_counted", False):
        return
    inner = s3fs.S3FileSystem._cat_file

    async def counted(self, path, start=None, end=None, **kw):
        data = await inner(self, path, start=start, end=end, **kw)
        CountingFS.served[0] += len(data)
        return data

    s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._counted = counted, True


def write_delta(home: str, rows: list[int]) -> str:
    """A 4-rank full checkpoint (step 1) under ``home`` and a 4-rank delta over it (step 2): the delta's path."""
    base, delta = step_dir(home, 1), step_dir(home, 2)
    write_checkpoint(base, rows)
    rng, g = np.random.default_rng(1), torch.Generator().manual_seed(1)
    for r in range(WRITERS):
        tables = {}
        for t, n in enumerate(rows):
            lo, hi = n * r // WRITERS, n * (r + 1) // WRITERS
            ids = np.sort(rng.choice(np.arange(lo, hi), int((hi - lo) * TOUCHED), replace=False))
            tables[f"t{t}"] = delta_entry(ids, torch.randn(ids.size, DIM, generator=g), torch.rand(ids.size, generator=g),
                                          n)
        payload = {"rank": r, "tables": tables}
        if r == 0:
            payload.update({"dense": {"mlp.weight": torch.randn(512, 512, generator=g)}, "losses": [0.5] * 100})
        write_rank_file(delta, r, payload)
    write_manifest(delta, WRITERS, {"tables": [f"t{t}" for t in range(len(rows))], "table_rows": rows, "step": 2,
                                    "epoch": 0, "batch_in_epoch": 1, "samples": 1}, delta=base_ref(base))
    return str(delta)


def dmt_wanted(m: dict, q: int, world: int) -> dict:
    """A DMT rank's rows: the first table split over the ranks, every other table whole on rank ``t % world``."""
    out = {name: np.arange(n) for t, (name, n) in enumerate(zip(m["tables"], m["table_rows"])) if t and t % world == q}
    n0 = m["table_rows"][0]
    out[m["tables"][0]] = np.arange(n0 * q // world, n0 * (q + 1) // world)
    return out


def kind_restore(d, kind: str, mode: str, q: int, world: int) -> dict:
    """One rank's delta or DMT restore by ``mode``: ``{table: (weight, momentum)}`` of its rows."""
    import torch.distributed as dist

    m = read_manifest(d)
    want = (dmt_wanted if kind == "dmt" else wanted)(m, q, world)
    got = read_rows(d, m, want, dist.group.WORLD if world > 1 else None) if mode == "ours" else None
    if got is not None:
        return got[1]
    shards = read_shards(d, m)  # one process (ours too: it holds every row) or the baseline  # every rank file whole (a delta: and its base's)
    out = {}
    for name, r in want.items():
        w, mom = assemble_table(shards, name, dict(zip(m["tables"], m["table_rows"]))[name], d)
        out[name] = (w[torch.from_numpy(r)], mom[torch.from_numpy(r)])
    return out


def kind_worker(rank: int, world: int, where: str, kind: str, repeats: int) -> dict:
    import torch.distributed as dist

    count_s3()
    d = location(where)
    modes = ("ours", "whole")
    for mode in modes:  # warm-up, not counted
        kind_restore(d, kind, mode, rank, world)
    m = read_manifest(d)
    out = {mode: {"bytes": [], "seconds": []} for mode in modes}
    out["rows"] = int(sum(r.size for r in (dmt_wanted if kind == "dmt" else wanted)(m, rank, world).values()))
    for _ in range(repeats):
        got = {}
        for mode in modes:  # interleaved
            if world > 1:
                dist.barrier()
            CountingFS.served[0] = 0
            t0 = time.perf_counter()
            got[mode] = kind_restore(d, kind, mode, rank, world)
            out[mode]["seconds"].append(time.perf_counter() - t0)
            out[mode]["bytes"].append(CountingFS.served[0])
        assert all(torch.equal(got["ours"][t][i], got["whole"][t][i]) for t in got["whole"] for i in (0, 1))
    return out


def kind_line(store: str, kind: str, world: int, res: list[dict], total: int, rows: list[int], repeats: int,
              load0) -> dict:
    shares = [total * r["rows"] / sum(rows) for r in res]  # its rows' part of the checkpoint (equal split: 1/N)
    top = {m: max(max(r[m]["bytes"]) / sh for r, sh in zip(res, shares)) for m in ("ours", "whole")}
    slowest = {m: [max(r[m]["seconds"][i] for r in res) for i in range(repeats)] for m in ("ours", "whole")}
    return {"figure": f"{kind}_restore_bytes_per_rank_over_share", "store": store, "world": world,
            "rank_shares": [round(sh / total, 4) for sh in shares],
            "ours": round(top["ours"], 4), "baseline_read_every_file_whole": round(top["whole"], 4),
            "ratio": round(top["whole"] / top["ours"], 2), "bar": 1.2, "meets_bar": top["ours"] <= 1.2,
            "seconds_slowest_rank": {m: stats(v) for m, v in slowest.items()},
            "time_ratio_whole_over_ours": round(statistics.median(slowest["whole"]) /
                                                statistics.median(slowest["ours"]), 2),
            "config": {"rows": rows, "dim": DIM, "writers": WRITERS, "touched": TOUCHED if kind == "delta" else None,
                       "checkpoint_bytes": total, "repeats": repeats, "counted_by": "file system"},
            "load": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]}}


def run_kind(kind: str, store: str, home: str, local: Path, rows: list[int], args) -> None:
    """The delta or DMT restore lines of one store (``local``: the same checkpoints' local copy, for sizes)."""
    if kind == "delta":
        where = write_delta(home, rows)
        write_delta(str(local), rows) if store == "s3" else None
        dirs = [step_dir(local, 1), step_dir(local, 2)]
    else:
        where = str(step_dir(home, 1))
        write_checkpoint(location(where), rows)
        write_checkpoint(step_dir(local, 1), rows) if store == "s3" else None
        dirs = [step_dir(local, 1)]
    total = sum(os.path.getsize(p / s) for p in dirs for s in read_manifest(p)["shards"])
    for world in (int(w) for w in args.worlds.split(",")):
        load0 = os.getloadavg()
        res = spawn_local(kind_worker, world, where, kind, args.repeats, timeout_s=1800)
        print(json.dumps(kind_line(store, kind, world, res, total, rows, args.repeats, load0)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000, help="rows of the largest table")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--restores", default="flat", help="flat (re-sharding), delta, dmt: comma-separated")
    args = ap.parse_args()
    rows = [args.rows, args.rows // 4, args.rows // 2]
    kinds = args.restores.split(",")
    server = moto()
    try:
        tmp = Path(tempfile.mkdtemp(prefix="bench-restore-"))
        if "flat" in kinds:
            for store, d in (("local", tmp / "step"), ("s3", location("s3://bench/run/checkpoints/step-00000001"))):
                write_checkpoint(d, rows)
                total = sum(file_sizes(d, read_manifest(d)))
                for world in (int(w) for w in args.worlds.split(",")):
                    load0 = os.getloadavg()
                    res = spawn_local(worker, world, str(d), args.repeats, timeout_s=1800)
                    print(json.dumps(line(store, world, res, total, rows, args.repeats, load0)), flush=True)
        for kind in (k for k in kinds if k in ("delta", "dmt")):
            for store in ("local", "s3"):
                local = tmp / f"{kind}-{store}"
                home = f"countfs://{local}" if store == "local" else f"s3://bench/{kind}"
                run_kind(kind, store, home, local, rows, args)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
