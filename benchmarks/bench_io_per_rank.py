"""Bytes of the shards each rank reads per epoch, at 1, 2 and 4 ranks, against the dataset's.

Data-parallel ranks each train on their slice of every global batch; the loader (``data.loader.ShardLoader``)
reads only those rows of each shard (``data.shards.ShardRows``). The baseline is the strongest form of the
alternative: each rank reads every shard whole (``data.shards.read_shard``, memory-mapped, every column
touched once), as the loader did before. Same run, interleaved per rank: baseline; the loader unshuffled
(the order training uses) and with the global shuffle (default block), each with the partial pages at the
ends of a rank's runs read by sector (``sector_edges=True``: ``loader``, ``loader_shuffled``, the default when
ranks span machines, as here: each rank reads with a cold cache, as on its own machine) and by page
(``*_pages``, one machine's default); and on a copy of the dataset in the layout shards had before the
page-aligned one (one record batch per shard, written by pyarrow), by sector (``*_unaligned``) and by page
(``*_before``: the loader as it was).

Two measures per rank and epoch: the loader's ``bytes_read`` (the bytes of the rows it copies out; the
baseline counts the same way over whole shards), and the kernel's storage reads of the process
(``read_bytes`` of ``/proc/self/io``) after the shard files were dropped from the page cache
(``posix_fadvise(DONTNEED)``); the latter includes the kernel's readahead, so short runs of rows (a rank's
slice of a batch is ``batch / ranks`` rows) are paged in with their neighbours. Where the page cache cannot
be dropped (files pinned by another process) it reads 0: reported as ``null``. Seconds are not comparable
between the two: the loader builds and validates every batch, the baseline only pages the columns in.
The headline ``value`` / ``value_shuffled`` are the storage reads (the counted bytes where those are null):
the most any rank read, times N, over N = 1, 2, 4; ``value_counted`` the loader's own count.

The dataset is synthetic, Criteo-shaped: 13 dense float32, 26 one-hot int64 ids, an int8 label (261 bytes per
row), ``--rows`` rows in shards of ``--shard-rows``. Bar: per rank per epoch <= 1.1 / N of the dataset.
Prints one JSON line.

    .venv/bin/python benchmarks/bench_io_per_rank.py [--rows 400000] [--shard-rows 100000] [--batch 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embedscale.data.loader import ShardLoader
from embedscale.data.shards import Manifest, ShardWriter, SparseFeatureInfo, read_shard

DENSE, SPARSE = 13, 26
BAR = 1.1


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_dataset(d: Path, rows: int, shard_rows: int) -> int:
    """The dataset; its bytes counted as the loader counts them (all rows)."""
    rng = np.random.default_rng(0)
    sp = [SparseFeatureInfo(f"C{i}", 100_000) for i in range(1, SPARSE + 1)]
    with ShardWriter(d, [f"I{i}" for i in range(1, DENSE + 1)], sp, shard_rows=shard_rows) as w:
        for a in range(0, rows, 50_000):
            n = min(50_000, rows - a)
            w.write(rng.integers(0, 2, n), rng.random((n, DENSE), dtype=np.float32),
                    {s.name: rng.integers(0, s.num_rows, n) for s in sp})
    os.sync()  # written back: the page cache can drop the files' pages
    return rows * (1 + 4 * DENSE + 8 * SPARSE)


def unaligned_copy(d: Path, to: Path) -> None:
    """The dataset in the layout before the page-aligned one: each shard one record batch (pyarrow's writer)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    to.mkdir()
    (to / "manifest.json").write_bytes((d / "manifest.json").read_bytes())
    for f in sorted(d.glob("shard-*.arrow")):
        table = ipc.open_file(pa.memory_map(str(f))).read_all().combine_chunks()
        with pa.OSFile(str(to / f.name), "wb") as sink, ipc.new_file(sink, table.schema) as w:
            w.write_table(table, max_chunksize=table.num_rows)
    os.sync()


def drop_cache(d: Path) -> None:
    for f in d.glob("shard-*.arrow"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def storage_reads() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def whole_shards(d: Path, world: int, rank: int, batch: int) -> int:
    """The baseline: every shard read whole (every column touched), the bytes counted as the loader counts."""
    m = Manifest.load(d)
    total = 0
    for s in m.shards:
        c = read_shard(d / s["file"], m.num_dense)
        columns = [c.labels, c.dense] + [v for v, _ in c.sparse.values()]
        for a in columns:
            a.sum()  # every page of the column read
        total += sum(a.nbytes for a in columns)
    return total


def loader_pass(d: Path, world: int, rank: int, batch: int, shuffle: bool, edges: bool) -> int:
    loader = ShardLoader(d, batch, rank=rank, world_size=world, shuffle=shuffle, seed=1, prefetch=0,
                         sector_edges=edges)
    for _ in loader:
        pass
    return loader.bytes_read


def measure(fn, d: Path, *args) -> tuple[int, int | None, float]:
    drop_cache(d)
    r0, t0 = storage_reads(), time.perf_counter()
    counted = fn(d, *args)
    dt = time.perf_counter() - t0
    phys = storage_reads() - r0
    return counted, phys, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--shard-rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_io_") as tmp:
        d, old = Path(tmp) / "ds", Path(tmp) / "ds_unaligned"
        total = make_dataset(d, args.rows, args.shard_rows)
        unaligned_copy(d, old)
        files = sum(f.stat().st_size for f in d.glob("shard-*.arrow"))
        log(f"dataset: {args.rows} rows, {total / 1e6:.1f} MB of rows, {files / 1e6:.1f} MB of files")
        physical_ok = True
        out = {}
        for world in (1, 2, 4):
            rows = {k: [] for k in RUNS}
            for rank in range(world):
                for name, (fn, where, extra) in RUNS.items():
                    counted, phys, dt = measure(fn, {"aligned": d, "unaligned": old}[where], world, rank,
                                                args.batch, *extra)
                    rows[name].append((counted, phys, dt))
                    log(f"N={world} rank {rank} {name}: {counted / 1e6:.1f} MB counted, {phys / 1e6:.1f} MB storage "
                        f"reads, {dt:.2f} s")
            if all(p == 0 for v in rows.values() for _, p, _ in v):
                physical_ok = False
            out[str(world)] = {name: figures(v, total, world) for name, v in rows.items()}
        if not physical_ok:
            for v in out.values():
                for f in v.values():
                    f["storage_reads_fraction_max"] = None
        key = "storage_reads_fraction_max" if physical_ok else "fraction_max"
        worst, worst_sh, counted = (max(out[str(w)][name][k] * w for w in (1, 2, 4)) for name, k in
                                    (("loader", key), ("loader_shuffled", key), ("loader", "fraction_max")))
        line = {
            "benchmark": "io_per_rank",
            "figure": "bytes read from storage per rank per epoch / dataset bytes, times N (bar <= 1.1)",
            "value": round(worst, 4), "value_shuffled": round(worst_sh, 4), "value_counted": round(counted, 4),
            "others": {n: round(max(out[str(w)][n][key] * w for w in (1, 2, 4)), 4) for n in RUNS
                       if n not in ("baseline", "loader", "loader_shuffled")},
            "baseline": round(max(out[str(w)]["baseline"]["fraction_max"] * w for w in (1, 2, 4)), 4),
            "ratio": round(worst / max(out["4"]["baseline"]["fraction_max"] * 4, 1e-12), 4),
            "bar": BAR, "meets_bar": worst <= BAR and worst_sh <= BAR,
            "per_world": out, "dataset_bytes": total, "file_bytes": files,
            "load": os.getloadavg()[0],
            "config": {"rows": args.rows, "shard_rows": args.shard_rows, "batch": args.batch, "dense": DENSE,
                       "sparse": SPARSE, "shuffle_block": min(1024, max(1, args.rows // 256)),
                       "short_block_rows": args.rows % min(1024, max(1, args.rows // 256))},
        }
        print(json.dumps(line), flush=True)


RUNS = {"baseline": (whole_shards, "aligned", ()),
        "loader": (loader_pass, "aligned", (False, True)), "loader_shuffled": (loader_pass, "aligned", (True, True)),
        "loader_pages": (loader_pass, "aligned", (False, False)),
        "loader_shuffled_pages": (loader_pass, "aligned", (True, False)),
        "loader_unaligned": (loader_pass, "unaligned", (False, True)),
        "loader_shuffled_unaligned": (loader_pass, "unaligned", (True, True)),
        "loader_before": (loader_pass, "unaligned", (False, False)),
        "loader_shuffled_before": (loader_pass, "unaligned", (True, False))}


def figures(v: list[tuple[int, int, float]], total: int, world: int) -> dict:
    fr = [c / total for c, _, _ in v]
    ph = [p / total for _, p, _ in v]
    secs = sorted(t for _, _, t in v)
    return {"fraction_max": round(max(fr), 4), "fraction_median": round(statistics.median(fr), 4),
            "bar_fraction": round(BAR / world, 4), "storage_reads_fraction_max": round(max(ph), 4),
            "seconds_median": round(statistics.median(secs), 3),
            "seconds_p90": round(secs[min(len(secs) - 1, int(0.9 * len(secs)))], 3)}


if __name__ == "__main__":
    main()
