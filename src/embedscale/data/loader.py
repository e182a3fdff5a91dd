"""Batches of (dense, sparse, labels) from a shard directory, with background prefetch and per-rank slicing.

The loader walks the rows ``[start, stop)`` of a dataset in a deterministic order, cuts global batches of
``batch_size`` rows, and hands each rank its contiguous slice of every global batch (data parallelism: all
ranks see the same global batch sequence). The order is the dataset's (shard order), or with ``shuffle`` a
global shuffle across shards: the range is cut into blocks of ``shuffle_block`` consecutive rows, and each
epoch takes the blocks in the order of ``numpy.random.default_rng([seed, epoch]).permutation(blocks)``.
Batches, and each rank's slice of them, are planned from the manifest's row counts alone; a rank then reads
only the rows of its own slices from the memory-mapped shards (``shards.ShardRows``), so the bytes read per
rank and epoch are the dataset's over the world size (``bytes_read`` counts them, per pass). A shuffle block
keeps rows that are neighbours on disk together, which is what keeps a rank's reads in runs of whole pages
(a per-row shuffle would have every rank touch every page); with the shards' page-aligned layout
(``data.shards``) a run of a multiple of 1,024 rows starting at such a row reads only its own pages. A range
whose rows are not a multiple of the block has a short block, which shifts every later block against the
batches: ranks' slices then split blocks off page boundaries and both neighbours read the page at each split.
``skip_batches`` fast-forwards without reading, which is how a resumed run continues exactly where its
checkpoint stopped.

Every batch is checked before it leaves the loader: dense values finite, labels 0 or 1, row ids inside
their table (except the ``raw_ids`` features: a managed table's raw 64-bit ids, any int64). A failure names the shard file, the row in it, and the feature.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.data.shards import ID_WEIGHTS, Manifest, ShardRows
from embedscale.errors import InputError


_OPEN_SHARDS = 8  # shards a loader keeps memory-mapped at once


@dataclass
class _Block:
    """Rows of one shard, with per-feature offsets for slicing multi-hot columns."""

    file: str
    first_row: int  # row number of the block's first row inside its shard
    order: np.ndarray | None  # permutation of the shard's rows (shuffle), else None
    labels: np.ndarray
    dense: np.ndarray
    sparse: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (values, offsets [n+1])
    weights: np.ndarray | None = None  # sample weights (weighted datasets)


def check_raw_ids(raw_ids, features: list[str], where) -> frozenset[str]:
    """The raw-id features a loader leaves unchecked, each one a feature of the data (else an ``InputError``)."""
    raw = frozenset(raw_ids)
    unknown = sorted(raw - set(features))
    if unknown:
        raise InputError(f"{where}: raw-id (managed) features {unknown} are not in the data (features: "
                         f"{', '.join(features)})")
    return raw


def check_batching(batch_size: int, rank: int, world_size: int) -> None:
    """A loader's batch size and rank, checked (every loader: shards and streams)."""
    if batch_size <= 0:
        raise InputError(f"batch_size must be positive, got {batch_size}")
    if not (0 <= rank < world_size):
        raise InputError(f"rank {rank} outside world size {world_size}")
    if batch_size < world_size:
        raise InputError(f"batch_size {batch_size} is smaller than world size {world_size}")


class ShardLoader:
    """Iterate ``Batch``es over a shard directory.

    Args:
        directory: a dataset written by ``ShardWriter`` (``manifest.json`` + shards).
        batch_size: global batch size (all ranks together).
        rank, world_size: this rank's slice of every global batch.
        start, stop: row range of the dataset to read (train/eval splits); ``stop=None`` = end.
        shuffle, seed: a global shuffle, per epoch, of the range's blocks of ``shuffle_block`` rows (module
            docstring), from ``(seed, epoch)``.
        shuffle_block: rows of a shuffle block (a smaller block mixes finer, a larger one reads in longer runs);
            ``None``: the range's rows // 256, at least 1 and at most 1024 (a 4 KiB page of int32 offsets).
        drop_last: drop a final partial global batch (otherwise it is yielded, smaller).
        prefetch: batches prepared ahead on a background thread (0 = synchronous).
        device: where tensors go.
        validate: check dense, labels and row ids of every batch.
        raw_ids: features whose values are raw 64-bit ids (the features of managed tables, ``specs.ManagedConfig``):
            any int64 passes; the others' ids must lie in ``[0, num_rows)`` of their table.
        sector_edges: read the partial pages at the ends of this rank's runs by 512-byte sector (``O_DIRECT``,
            ``data.page_edges``) rather than whole through the page cache, so no rank reads its neighbours'
            bytes. ``None``: when the ranks span machines (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``); the ranks of
            one machine share its page cache, which reads a shared page once and keeps it for the next epoch.

    After (or during) a pass, ``bytes_read`` is what this rank has read of the shards in it (``ShardRows``).

    Example::

        loader = ShardLoader("data/train", batch_size=2048)
        for batch in loader:
            logits = model(batch.dense, batch.sparse)
    """

    def __init__(self, directory: str | Path, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 start: int = 0, stop: int | None = None, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, prefetch: int = 2, device: torch.device | str | None = None,
                 validate: bool = True, raw_ids=(), shuffle_block: int | None = None,
                 sector_edges: bool | None = None):
        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        total = self.manifest.rows
        stop = total if stop is None else stop
        if not (0 <= start <= stop <= total):
            raise InputError(f"{self.directory}: row range [{start}, {stop}) outside the dataset's {total} rows")
        if stop == start:
            raise InputError(f"{self.directory}: empty input (row range [{start}, {stop}) has no rows)")
        check_batching(batch_size, rank, world_size)
        if shuffle_block is None:
            shuffle_block = min(1024, max(1, (stop - start) // 256))
        if isinstance(shuffle_block, bool) or not isinstance(shuffle_block, int) or shuffle_block <= 0:
            raise InputError(f"shuffle_block must be a positive number of rows, got {shuffle_block!r}")
        self.batch_size = int(batch_size)
        self.rank, self.world_size = rank, world_size
        self.start, self.stop = int(start), int(stop)
        self.shuffle_block = shuffle_block
        self._firsts = np.cumsum([0] + [s["rows"] for s in self.manifest.shards])  # each shard's first row
        self._open: dict[int, ShardRows] = {}
        self.bytes_read = 0
        self.shuffle, self.seed = shuffle, seed
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.device = device
        self.validate = validate
        self.epoch = 0
        self.skip_batches = 0
        self.feature_names = self.manifest.sparse_names
        self._num_rows = {s.name: s.num_rows for s in self.manifest.sparse}
        self.id_weighted = {s.name for s in self.manifest.sparse if s.id_weights}  # features with id weights
        self.raw_ids = check_raw_ids(raw_ids, self.feature_names, self.directory)
        if sector_edges is None:
            sector_edges = world_size > int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
        self.sector_edges = bool(sector_edges) and world_size > 1

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        full, rest = divmod(self.rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Choose the epoch (shuffle seed) and how many global batches to skip (exact resume)."""
        self.epoch, self.skip_batches = int(epoch), int(skip_batches)

    # -- reading --------------------------------------------------------------------------------
    def _sequence(self) -> tuple[np.ndarray, np.ndarray]:
        """The pass's row order as runs ``[lo, hi)`` of dataset rows: the whole range, or shuffled its blocks of
        ``shuffle_block`` rows in the order of ``default_rng([seed, epoch]).permutation``."""
        if not self.shuffle:
            return np.array([self.start]), np.array([self.stop])
        firsts = np.arange(self.start, self.stop, self.shuffle_block, dtype=np.int64)
        lo = firsts[np.random.default_rng([self.seed, self.epoch]).permutation(len(firsts))]
        return lo, np.minimum(lo + self.shuffle_block, self.stop)

    def _global_batches(self) -> Iterator[list[tuple[int, int]]]:
        """Global batches as lists of runs ``[lo, hi)`` of dataset rows, in batch order (no data is read)."""
        pieces: list[tuple[int, int]] = []
        have = 0
        for lo, hi in zip(*(a.tolist() for a in self._sequence())):
            while lo < hi:
                take = min(self.batch_size - have, hi - lo)
                pieces.append((lo, lo + take))
                have, lo = have + take, lo + take
                if have == self.batch_size:
                    yield pieces
                    pieces, have = [], 0
        if have and not self.drop_last:
            yield pieces

    def _rank_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """This rank's contiguous share ``[B * rank // W, B * (rank + 1) // W)`` of a global batch's runs."""
        B = sum(hi - lo for lo, hi in runs)
        a, b = (B * self.rank) // self.world_size, (B * (self.rank + 1)) // self.world_size
        out, pos = [], 0
        for lo, hi in runs:
            x, y = max(a, pos) - pos, min(b, pos + hi - lo) - pos
            if x < y:
                out.append((lo + x, lo + y))
            pos += hi - lo
        return out

    def _read(self, runs: list[tuple[int, int]]) -> list[tuple[_Block, slice]]:
        """Read the runs of dataset rows from their shards (only those rows), as ``_build``'s pieces."""
        pieces = []
        for lo, hi in runs or [(self.start, self.start)]:  # an empty share: a block of no rows
            i = int(np.searchsorted(self._firsts, lo, side="right")) - 1
            while True:
                first = int(self._firsts[i])
                a, b = lo - first, min(hi, int(self._firsts[i + 1])) - first
                shard = self._shard(i)
                before = shard.bytes_read
                for row, cols in shard.read(a, b):
                    blk = _Block(shard.path.name, row, None, cols.labels, cols.dense, block_sparse(cols), cols.weights)
                    pieces.append((blk, slice(0, cols.rows)))
                self.bytes_read += shard.bytes_read - before
                lo = first + b
                if lo >= hi:
                    break
                i += 1
        return pieces

    def _shard(self, i: int) -> ShardRows:
        """Shard ``i``'s row reader (memory-mapped; the last few opened stay open)."""
        if i not in self._open:
            if len(self._open) >= _OPEN_SHARDS:
                del self._open[next(iter(self._open))]
            self._open[i] = ShardRows(self.directory / self.manifest.shards[i]["file"], self.manifest.num_dense,
                                      random_access=self.world_size > 1, sector_edges=self.sector_edges)
        return self._open[i]

    def _rank_pieces(self, pieces):
        """Cut this rank's contiguous share out of a global batch's pieces."""
        B = sum(_sel_len(sel) for _, sel in pieces)
        lo, hi = (B * self.rank) // self.world_size, (B * (self.rank + 1)) // self.world_size
        out, pos = [], 0
        for blk, sel in pieces:
            n = _sel_len(sel)
            a, b = max(lo, pos) - pos, min(hi, pos + n) - pos
            if a < b:
                out.append((blk, sel[a:b] if isinstance(sel, np.ndarray) else slice(sel.start + a, sel.start + b)))
            pos += n
        return out

    def _build(self, pieces) -> Batch:
        labels = np.concatenate([blk.labels[sel] for blk, sel in pieces])
        dense = np.concatenate([blk.dense[sel] for blk, sel in pieces])
        values, lengths = [], []
        for name in self.feature_names:
            for blk, sel in pieces:
                v, ln = _gather(blk.sparse[name], sel)
                values.append(v)
                lengths.append(ln)
        flat = np.concatenate(values).astype(np.int64, copy=False)
        if self.validate:
            self._check(pieces, labels, dense, values, flat)
        id_weights = None
        if self.id_weighted:  # a weight per value, in the values' order: the features' own, 1 for the others
            parts = [_gather(blk.sparse[name + ID_WEIGHTS], sel)[0] if name in self.id_weighted else None
                     for name in self.feature_names for blk, sel in pieces]
            id_weights = torch.from_numpy(np.concatenate([np.ones(len(v), np.float32) if w is None else w
                                                          for w, v in zip(parts, values)]).astype(np.float32))
        sparse = JaggedFeatures(self.feature_names, torch.from_numpy(flat),
                                torch.from_numpy(np.concatenate(lengths).astype(np.int64, copy=False)), id_weights)
        weights = None
        if self.manifest.weighted:
            weights = torch.from_numpy(np.concatenate([blk.weights[sel] for blk, sel in pieces]).astype(np.float32))
        batch = Batch(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), sparse,
                      torch.from_numpy(labels.astype(np.float32)), weights=weights)
        return batch.to(self.device) if self.device is not None else batch

    def _check(self, pieces, labels, dense, values, flat: np.ndarray) -> None:
        """Dense finite, labels 0/1, and every row id inside its feature's table: one vectorised comparison
        of the batch's ids (``flat``, key-major) against per-value bounds, on the host before the batch is
        built. This is where a run's ids are validated (the lookups behind it need not check them again)."""
        if not np.isfinite(dense).all():
            r, c = np.argwhere(~np.isfinite(dense))[0]
            raise InputError(f"{self._where(pieces, int(r))}: dense feature "
                             f"{self.manifest.dense_names[c]} is {dense[r, c]} (NaN/inf)")
        bad = (labels != 0) & (labels != 1)
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise InputError(f"{self._where(pieces, r)}: label {labels[r]} is not 0 or 1")
        P = len(pieces)
        if not flat.size:
            return
        counts = [sum(v.size for v in values[f * P:(f + 1) * P]) for f in range(len(self.feature_names))]
        bounds = np.repeat(np.array([self._num_rows[n] for n in self.feature_names], dtype=np.int64), counts)
        bad = (flat < 0) | (flat >= bounds)
        if self.raw_ids:  # managed tables' features: raw 64-bit ids, mapped to rows by the run (any value)
            bad &= np.repeat(np.array([n not in self.raw_ids for n in self.feature_names]), counts)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            f = int(np.searchsorted(np.cumsum(counts), i, side="right"))
            name = self.feature_names[f]
            raise InputError(f"{self.directory}: feature {name}: row id {flat[i]} outside its table "
                             f"[0, {self._num_rows[name]})")

    def _where(self, pieces, r: int) -> str:
        for blk, sel in pieces:
            n = _sel_len(sel)
            if r < n:
                row = int(sel[r]) if isinstance(sel, np.ndarray) else blk.first_row + sel.start + r
                return f"{self.directory / blk.file}: row {row}"
            r -= n
        return str(self.directory)

    def __iter__(self) -> Iterator[Batch]:
        def produce():
            self.bytes_read = 0
            for i, runs in enumerate(self._global_batches()):
                if i < self.skip_batches:
                    continue
                batch = self._build(self._read(self._rank_runs(runs)))
                batch.global_size = sum(hi - lo for lo, hi in runs)
                yield batch

        if self.prefetch <= 0:
            yield from produce()
            return
        yield from _prefetched(produce(), self.prefetch)


def _sel_len(sel) -> int:
    return len(sel) if isinstance(sel, np.ndarray) else sel.stop - sel.start


def block_sparse(cols) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A shard's sparse columns as ``name -> (values, offsets [n + 1])``; a feature's id weights ride along as
    ``"<name>/weights"`` with the same offsets, so every slice and gather of the values cuts them alike."""
    sparse = {}
    for name, (values, lengths) in cols.sparse.items():
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        sparse[name] = (values, offsets)
        if name in cols.id_weights:
            sparse[name + ID_WEIGHTS] = (cols.id_weights[name], offsets)
    return sparse


def _slice_sparse(sparse, a: int, b: int):
    out = {}
    for name, (v, offs) in sparse.items():
        out[name] = (v[offs[a]:offs[b]], offs[a:b + 1] - offs[a])
    return out


def _gather(column: tuple[np.ndarray, np.ndarray], sel) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of the rows ``sel`` (a slice or row indices) of a ``(values, offsets)`` column."""
    v, offs = column
    if isinstance(sel, slice):
        return v[offs[sel.start]:offs[sel.stop]], np.diff(offs[sel.start:sel.stop + 1])
    ln = offs[sel + 1] - offs[sel]
    if (ln == 1).all():
        return v[offs[sel]], ln
    return _gather_ragged(v, offs[sel], ln), ln


def _gather_ragged(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``values[starts[i] : starts[i] + lengths[i]]`` for all i, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return values[:0]
    seg_start = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=seg_start[1:])
    idx = np.arange(total, dtype=np.int64) - np.repeat(seg_start - starts, lengths)
    return values[idx]


_DONE = object()


def _prefetched(it: Iterator, depth: int) -> Iterator:
    """Run ``it`` on a background thread, ``depth`` items ahead; re-raise its exception here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def worker():
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_DONE)
        except BaseException as e:  # handed to the consumer
            q.put(e)

    t = threading.Thread(target=worker, daemon=True, name="embedscale-prefetch")
    t.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join(timeout=5)
