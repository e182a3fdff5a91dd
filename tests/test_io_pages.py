"""The pages of the shard files a rank's loader reads, against the pages its rows lie on.

References, independent of the reader: where each column of each record batch lies in a shard file is read with
pyarrow from the file's bytes; which rows a rank gets is the loader's documented rule in plain Python (as in
``test_loader_ranks``); which pages the kernel read is ``mincore`` on the files after their page cache was
dropped. A rank must read no page of a column that holds none of its rows, and the pages its rows lie on must
come to at most 1.1 / W of the dataset's bytes (the page-aligned layout of ``data.shards``).
"""

import ctypes
import gc
import mmap
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from embedscale.data.loader import ShardLoader
from embedscale.data.shards import ShardWriter, SparseFeatureInfo, aligned_cuts

PAGE = 4096
D, S = 13, 8  # dense float32 values, one-hot int64 features: 1 + 52 + 64 = 117 bytes a row
ROWS, SHARD_ROWS, BATCH = 61_440, 25_000, 4096  # shards of 25,000 rows: each but the first starts off a page


def write(path: Path, rows: int = ROWS, shard_rows: int = SHARD_ROWS) -> dict:
    rng = np.random.default_rng(3)
    sp = [SparseFeatureInfo(f"C{i}", 1000) for i in range(S)]
    raw = {"label": rng.integers(0, 2, rows).astype(np.int8), "dense": rng.random((rows, D), dtype=np.float32),
           **{s.name: rng.integers(0, 1000, rows) for s in sp}}
    with ShardWriter(path, [f"I{i}" for i in range(D)], sp, shard_rows=shard_rows) as w:
        for a in range(0, rows, 7000):  # pieces that cross shard boundaries
            b = min(rows, a + 7000)
            w.write(raw["label"][a:b], raw["dense"][a:b], {s.name: raw[s.name][a:b] for s in sp})
    return raw


def layout(path: Path) -> list[tuple[str, int, int, dict]]:
    """Per record batch of every shard (pyarrow on the file's bytes): (file, first dataset row, rows,
    {column: (file offset of its values, bytes per row)})."""
    out, first = [], 0
    for f in sorted(path.glob("shard-*.arrow")):
        data = pa.py_buffer(f.read_bytes())
        reader = ipc.open_file(data)
        for i in range(reader.num_record_batches):
            b = reader.get_batch(i)
            cols = {}
            for name, col in zip(b.schema.names, b.columns):
                values = col.buffers()[-1]  # the data buffer (a fixed-size list's child values come last)
                cols[name] = (values.address - data.address, values.size // b.num_rows)
            out.append((f.name, first, b.num_rows, cols))
            first += b.num_rows
    return out


def rank_rows(W: int, r: int, shuffle: bool, block: int = 1024, seed: int = 1, rows: int = ROWS) -> np.ndarray:
    """The rule: the sequence (rows, or blocks of rows in ``default_rng([seed, 0]).permutation`` order) cut
    into global batches of BATCH (the last, short one dropped); rank r of W takes positions
    [BATCH * r // W, BATCH * (r + 1) // W) of each."""
    if shuffle:
        blocks = [np.arange(a, min(a + block, rows)) for a in range(0, rows, block)]
        order = np.concatenate([blocks[j] for j in np.random.default_rng([seed, 0]).permutation(len(blocks))])
    else:
        order = np.arange(rows)
    mine = [order[a + BATCH * r // W:a + BATCH * (r + 1) // W] for a in range(0, rows - BATCH + 1, BATCH)]
    return np.concatenate(mine)


def pages_of(rows: np.ndarray, lay) -> dict[str, set[int]]:
    """The pages (per file) the bytes of these dataset rows lie on, over every column."""
    out: dict[str, set[int]] = {}
    for name, first, n, cols in lay:
        mine = rows[(rows >= first) & (rows < first + n)] - first
        for off, size in cols.values():
            lo = off + mine * size
            pages = np.unique(np.concatenate([lo // PAGE, (lo + size - 1) // PAGE]))
            out.setdefault(name, set()).update(pages.tolist())
    return out


def framing_pages(files, lay) -> dict[str, set[int]]:
    """Per file, the pages holding some byte outside the record batches' column values: the magic, schema,
    each batch's metadata, the footer (every reader reads them when it opens the file)."""
    out = {}
    for f in files:
        spans = sorted((off, off + size * n) for name, _, n, cols in lay if name == f.name
                       for off, size in cols.values())
        pages, at = set(), 0
        for a, b in spans + [(f.stat().st_size, f.stat().st_size)]:
            if a > at:
                pages.update(range(at // PAGE, (a - 1) // PAGE + 1))
            at = max(at, b)
        out[f.name] = pages
    return out


def drop(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(f: Path) -> set[int]:
    """The file's pages in the page cache now (``mincore`` over a fresh map, which reads nothing)."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
        view = np.frombuffer(mm, np.uint8)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0
        del view
        return set(np.flatnonzero(np.frombuffer(vec, np.uint8) & 1).tolist())
    finally:
        mm.close()


def test_record_batches_start_on_pages_at_aligned_rows(tmp_path):
    raw = write(tmp_path)
    lay = layout(tmp_path)
    for name, first, n, cols in lay:
        shard_first = int(name[6:11]) * SHARD_ROWS
        assert first == shard_first or first % 4096 == 0, (name, first)
        if n % 4096 == 0:
            assert all(off % PAGE == 0 for off, _ in cols.values()), (name, first, cols)
    # hand-worked: shard 1 holds rows 25,000..50,000; 28,672 and 49,152 are the first and last multiple of 4,096
    assert [(f, a, n) for f, a, n, _ in lay if f == "shard-00001.arrow"] == [
        ("shard-00001.arrow", 25_000, 3_672), ("shard-00001.arrow", 28_672, 20_480), ("shard-00001.arrow", 49_152, 848)]
    assert aligned_cuts(20_000, 20_000) == [(0, 480), (480, 16_864), (16_864, 20_000)]
    assert aligned_cuts(0, 0) == [(0, 0)] and aligned_cuts(4096, 100) == [(0, 100)]
    assert aligned_cuts(3500, 5000) == [(0, 596), (596, 4692), (4692, 5000)]
    assert aligned_cuts(3500, 4000) == [(0, 4000)]  # no 4,096 aligned rows inside: one batch
    # the rows are the rows written
    got = [b for b in ShardLoader(tmp_path, BATCH, prefetch=0, validate=False)]
    assert np.array_equal(np.concatenate([b.labels.numpy() for b in got]), raw["label"])
    assert np.array_equal(np.concatenate([b.dense.numpy() for b in got]), raw["dense"])
    ids = np.concatenate([b.sparse.values.numpy().reshape(S, -1) for b in got], axis=1)
    assert np.array_equal(ids, np.stack([raw[f"C{i}"] for i in range(S)]))


def test_old_single_batch_shards_still_read(tmp_path):
    """A shard written before the aligned layout (one record batch, pyarrow's own writer) reads the same rows."""
    raw = write(tmp_path)
    for f in sorted(tmp_path.glob("shard-*.arrow")):
        table = ipc.open_file(pa.py_buffer(f.read_bytes())).read_all().combine_chunks()
        with pa.OSFile(str(f), "wb") as sink, ipc.new_file(sink, table.schema) as w:
            w.write_table(table, max_chunksize=table.num_rows)
        assert ipc.open_file(pa.py_buffer(f.read_bytes())).num_record_batches == 1
    got = [b for b in ShardLoader(tmp_path, BATCH, rank=1, world_size=2, prefetch=0)]
    want = rank_rows(2, 1, False)
    assert np.array_equal(np.concatenate([b.labels.numpy() for b in got])[:len(want)], raw["label"][want])


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_rank_reads_only_the_pages_of_its_rows(tmp_path, shuffle):
    if mmap.PAGESIZE != PAGE:
        pytest.skip(f"pages of {mmap.PAGESIZE} bytes here; the layout aligns to {PAGE}")
    write(tmp_path)
    lay = layout(tmp_path)
    files = sorted(tmp_path.glob("shard-*.arrow"))
    framing = framing_pages(files, lay)
    total = ROWS * (1 + 4 * D + 8 * S)
    W = 4
    for r in range(W):
        want = pages_of(rank_rows(W, r, shuffle), lay)
        assert sum(map(len, want.values())) * PAGE <= 1.1 * total / W  # the layout: a rank's rows fill its pages
        drop(files)
        if any(resident(f) for f in files):
            pytest.skip("the page cache of the shard files could not be dropped on this filesystem")
        loader = ShardLoader(tmp_path, BATCH, rank=r, world_size=W, shuffle=shuffle, seed=1, shuffle_block=1024,
                             drop_last=True, prefetch=0, validate=False)
        assert sum(len(b.labels) for b in loader) == len(rank_rows(W, r, shuffle))
        del loader
        gc.collect()  # its maps closed
        read = {f.name: resident(f) - framing[f.name] for f in files}
        for f in files:
            assert read[f.name] <= want.get(f.name, set()), (r, f.name, sorted(read[f.name] - want[f.name])[:5])
        assert sum(map(len, read.values())) >= 0.9 * sum(len(want[n] - framing[n]) for n in want)  # it read them


def test_sector_edges_read_the_rank_s_bytes_only(tmp_path, monkeypatch):
    """Shuffled with a short block (61,140 rows: 724 rows past the last whole block; seed 4 puts it first) every
    later block is split between ranks off page boundaries. With ``sector_edges`` a rank reads the partial
    pages by sector: every direct read (a counting wrapper of ``os.preadv``) is sector-aligned and inside one
    page its rows lie on, the page cache holds no page of a column it has no row on, and pages plus sectors
    come to <= 1.1 / W of the dataset. The rows are the rule's, compared with the arrays written."""
    from embedscale.data import page_edges

    rows = ROWS - 300
    raw = write(tmp_path, rows=rows)
    files = sorted(tmp_path.glob("shard-*.arrow"))
    if not page_edges.EdgeReader(files[0]).active:
        pytest.skip("this file system refuses O_DIRECT reads")
    if mmap.PAGESIZE != PAGE:
        pytest.skip(f"pages of {mmap.PAGESIZE} bytes here; the layout aligns to {PAGE}")
    lay = layout(tmp_path)
    framing = framing_pages(files, lay)
    total = rows * (1 + 4 * D + 8 * S)
    direct = []
    real = os.preadv

    def counting(fd, buffers, offset):
        direct.append((os.readlink(f"/proc/self/fd/{fd}"), offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(page_edges.os, "preadv", counting)
    W = 4
    for shuffle in (True, False):
        for r in range(W):
            mine = rank_rows(W, r, shuffle, seed=4, rows=rows)
            want = pages_of(mine, lay)
            drop(files)
            if any(resident(f) for f in files):
                pytest.skip("the page cache of the shard files could not be dropped on this filesystem")
            direct.clear()
            loader = ShardLoader(tmp_path, BATCH, rank=r, world_size=W, shuffle=shuffle, seed=4, shuffle_block=1024,
                                 drop_last=True, prefetch=0, sector_edges=True)
            got = list(loader)
            del loader
            gc.collect()
            assert np.array_equal(np.concatenate([b.labels.numpy() for b in got]), raw["label"][mine])
            assert np.array_equal(np.concatenate([b.dense.numpy() for b in got]), raw["dense"][mine])
            ids = np.concatenate([b.sparse.values.numpy().reshape(S, -1) for b in got], axis=1)
            assert np.array_equal(ids, np.stack([raw[f"C{i}"][mine] for i in range(S)]))
            read = {f.name: resident(f) - framing[f.name] for f in files}
            for f in files:
                assert read[f.name] <= want.get(f.name, set()), (shuffle, r, f.name)
            for path, off, n in direct:
                name = Path(path).name
                assert off % 512 == 0 and n % 512 == 0 and off // PAGE == (off + n - 1) // PAGE, (off, n)
                assert off // PAGE in want[name], (shuffle, r, name, off)
            assert sum(map(len, read.values())) * PAGE + sum(n for _, _, n in direct) <= 1.1 * total / W
            assert direct or not shuffle  # the split blocks' partial pages were read by sector
