"""Access- and memory-aware partitioning (OPER section 4.1).

Rows of each table are sorted by decreasing access count; walking that order, a partition grows until
one more row would take its access count over ``threshold * total access`` or its footprint over
``threshold * total bytes``. Partitions that stopped on access are *access-bound* (the hot head: few
rows, much traffic), the others *memory-bound* (the cold tail).

Because counts never increase along the sorted order, once one partition is memory-bound every later
partition of the table is too and has exactly ``max_rows`` rows: the tail is cut in one vectorised step
and the Python loop only runs over the access-bound head (about ``1 / threshold`` partitions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.cost import batch_presence, table_counts
from embedscale.plan.synthetic_profile import ZipfProfile


_LAST_PREFIX: tuple[np.ndarray, np.ndarray] | None = None
_DISTINCT_EPS = 1e-3  # SortedTable.distinct: rows read more often than this per batch get the exact u_k


@dataclass
class SortedTable:
    """One table in access order: the permutation and (optionally cached) prefix sums of its counts."""

    index: int
    name: str
    num_rows: int
    row_bytes: int
    order: np.ndarray | None  # rows by decreasing count (None: identity)
    total: float  # sum of counts
    skip: int = 0  # positions [0, skip) are not partitioned (e.g. replicated to every rank)
    skip_count: float = 0.0  # sum of the counts at positions [0, skip)
    _native: bool = False  # order came from the profile's own sorted_rows (so its sorted_counts match)
    _prefix: np.ndarray | None = field(default=None, repr=False)
    _profile: object = field(default=None, repr=False)
    _distinct: dict = field(default_factory=dict, repr=False)  # lookups per batch -> (head, correction prefix)

    def sorted_counts(self) -> np.ndarray:
        p = self._profile
        if self._native:
            return np.asarray(p.sorted_counts(self.name), dtype=np.float64)
        c = table_counts(p, self.name, self.num_rows)
        return (c if self.order is None else c[self.order]).astype(np.float64, copy=False)

    def prefix(self) -> np.ndarray:
        """Exclusive prefix sums of the sorted counts, length ``num_rows + 1`` (float64).

        Tables whose profile hands out the very same sorted-counts array (equal-shaped synthetic tables)
        share one prefix array instead of recomputing it."""
        global _LAST_PREFIX
        if self._prefix is not None:
            return self._prefix
        c = self.sorted_counts()
        if _LAST_PREFIX is not None and _LAST_PREFIX[0] is c:
            return _LAST_PREFIX[1]
        out = np.empty(c.size + 1, dtype=np.float64)
        out[0] = 0.0
        np.cumsum(c, out=out[1:])
        if not c.flags.writeable:  # an immutable array can be trusted not to change under the cache
            _LAST_PREFIX = (c, out)
        return out

    def count_above(self, value: float, pre: np.ndarray | None = None) -> int:
        """How many rows have a count above ``value`` (binary search on the prefix sums: counts are sorted)."""
        pre = self.prefix() if pre is None else pre
        lo, hi = 0, self.num_rows  # invariant: rows [0, lo) are above, rows [hi, n) are not
        while lo < hi:
            mid = (lo + hi) // 2
            if pre[mid + 1] - pre[mid] > value:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def head_counts(self, k: int) -> np.ndarray:
        """The first ``k`` sorted counts."""
        return np.diff(self.prefix()[: k + 1])

    def distinct(self, start, stop, scale: float, counts=None) -> np.ndarray:
        """Expected distinct rows among sorted positions ``[start, stop)`` in a batch of ``scale * total``
        lookups of this table (``scale``: batch samples / profile samples), ``sum_k u_k`` with

            u_k = 1 - (1 - p_k) ** n,   p_k = c_k / total,   n = scale * total

        the probability that row ``k`` is in the batch (what the executor moves: a remote row once per
        batch, OPER 5.1; ``embedding.wire``). ``u_k`` is computed exactly on the head of the order, where
        the batch reads a row more than ``1e-3`` times on average; below that ``u_k`` and the accesses
        ``A_k = n p_k`` differ by less than ``A_k / 2 < 5e-4 A_k``, so the tail takes ``A_k`` from the
        count prefix sums: O(head) memory, not O(rows), and cached per ``scale`` (the 838.9M-row case of
        ``bench_plan_scale.py``: 1e-4 cached 6 GB of heads for the global batch's scale). ``counts``: the ranges' summed
        counts when known (no pass over the prefix sums, which tables too large to cache recompute)."""
        start = np.asarray(start, dtype=np.int64)
        stop = np.asarray(stop, dtype=np.int64)
        key = float(scale)
        pre = self.prefix() if counts is None or key not in self._distinct else None
        acc = (np.asarray(counts, dtype=np.float64) if counts is not None else pre[stop] - pre[start]) * scale
        if key not in self._distinct:
            head = self.count_above(_DISTINCT_EPS / scale, pre) if scale > 0 else 0
            c = np.diff(pre[: head + 1])
            u = batch_presence(c, scale * self.total, self.total)
            corr = np.zeros(head + 1)
            np.cumsum(u - c * scale, out=corr[1:])
            self._distinct[key] = (head, corr)
        head, corr = self._distinct[key]
        return acc + corr[np.minimum(stop, head)] - corr[np.minimum(start, head)]

    def cache_prefix(self) -> None:
        self._prefix = self.prefix()

    def drop_cache(self) -> None:
        self._prefix = None


def sort_tables(tables, profile, cache_rows: int = 200_000_000) -> list[SortedTable]:
    """Sort every table's rows by decreasing access count (OPER 4.1, Fig. 3a).

    Uses the profile's ``sorted_rows`` when it has one (checked to really be non-increasing), else a
    stable argsort of the counts that sorts only the rows ever accessed. Prefix sums are cached when
    all tables together have at most ``cache_rows`` rows (re-partitioning is then free).
    """
    out = []
    total_rows = sum(int(t.num_rows) for t in tables)
    names = list(profile.table_names)
    for i, t in enumerate(tables):
        if t.name not in names:
            raise ConfigError(f"profile has no table {t.name!r}; it has {names}")
        n = int(t.num_rows)
        order, native = None, False
        sr = getattr(profile, "sorted_rows", None)
        srt = None
        if sr is not None:
            order = np.asarray(sr(t.name))
            if order.shape != (n,):
                raise ConfigError(f"profile table {t.name!r}: sorted_rows has {order.size} rows for a table of {n}")
            if hasattr(profile, "sorted_counts"):
                srt = np.asarray(profile.sorted_counts(t.name), dtype=np.float64)
                native = True
            else:
                srt = table_counts(profile, t.name, n)[order].astype(np.float64)
            # trust our own exact profile; check anybody else's order really is non-increasing
            if not isinstance(profile, ZipfProfile) and bool((srt[1:] > srt[:-1]).any()):
                order, native, srt = None, False, None
        if order is None:
            c = table_counts(profile, t.name, n)
            if c.size and c.min() < 0:
                bad = int(np.argmin(c))
                raise ConfigError(f"profile table {t.name!r}: row {bad} has negative count {c[bad]}")
            if c.dtype.kind == "f" and not np.all(np.isfinite(c)):
                bad = int(np.flatnonzero(~np.isfinite(c))[0])
                raise ConfigError(f"profile table {t.name!r}: row {bad} has count {c[bad]}")
            nz = np.flatnonzero(c)
            idx = nz[np.argsort(-c[nz], kind="stable")]
            dt = np.int32 if n < 2**31 else np.int64
            order = np.empty(n, dtype=dt)
            order[: idx.size] = idx
            if idx.size < n:
                zero = np.ones(n, dtype=bool)
                zero[nz] = False
                order[idx.size :] = np.flatnonzero(zero)
            srt = c[order].astype(np.float64)
        if order.dtype != np.int32 and n < 2**31:
            order = order.astype(np.int32)
        st = SortedTable(i, t.name, n, int(t.dim * getattr(t, "bytes_per_value", 4)), order, float(srt.sum()),
                         _profile=profile)
        st._native = native
        if total_rows <= cache_rows:
            st._prefix = st.prefix() if native else _prefix_of(srt)
        out.append(st)
        del srt
    return out


def _prefix_of(c: np.ndarray) -> np.ndarray:
    out = np.empty(c.size + 1, dtype=np.float64)
    out[0] = 0.0
    np.cumsum(c, out=out[1:])
    return out


@dataclass
class Partitions:
    """Partitions of all tables: ranges of each table's sorted order, with their access and size."""

    table: np.ndarray  # int32 [P]
    start: np.ndarray  # int64 [P]
    stop: np.ndarray  # int64 [P]
    counts: np.ndarray  # float64 [P], sum of the rows' counts
    nbytes: np.ndarray  # float64 [P]
    access_bound: np.ndarray  # bool [P]

    @property
    def size(self) -> int:
        return int(self.table.size)

    @property
    def rows(self) -> np.ndarray:
        return self.stop - self.start

    def distinct(self, sorted_tables: list[SortedTable], scale: float) -> np.ndarray:
        """``[P]`` expected distinct rows of each partition in a batch of ``scale`` x the profile's samples
        (:meth:`SortedTable.distinct`)."""
        return distinct_of(sorted_tables, self.table, self.start, self.stop, scale, self.counts)


def distinct_of(sorted_tables: list[SortedTable], table, start, stop, scale: float, counts=None) -> np.ndarray:
    """Expected distinct rows in a batch of ``scale`` x the profile's samples of each range ``[start, stop)`` of
    sorted positions of table ``table`` (arrays; ``counts``: their summed counts, if known;
    :meth:`SortedTable.distinct`)."""
    table = np.asarray(table)
    out = np.zeros(table.size)
    for t in np.unique(table).tolist():
        i = np.flatnonzero(table == t)
        c = None if counts is None else np.asarray(counts)[i]
        out[i] = sorted_tables[t].distinct(np.asarray(start)[i], np.asarray(stop)[i], scale, c)
    return out


def cut_table(prefix: np.ndarray, start: int, row_bytes: int, thr_count: float, thr_bytes: float):
    """Greedy cuts of one table's sorted positions ``[start, n)`` (OPER 4.1).

    Returns ``(starts, stops, access_bound)``. A partition is access-bound when the access threshold
    stopped it before the memory threshold did. A single row above either threshold is a partition.
    """
    n = prefix.size - 1
    max_rows = max(1, int(thr_bytes // row_bytes)) if thr_bytes > 0 else n
    starts, stops, abound = [], [], []
    s = start
    while s < n:
        e_acc = int(np.searchsorted(prefix, prefix[s] + thr_count, side="right")) - 1 if thr_count > 0 else n
        e_mem = min(s + max_rows, n)
        if e_acc < e_mem:  # access-bound
            e = max(e_acc, s + 1)
            starts.append(s)
            stops.append(e)
            abound.append(True)
            s = e
            continue
        # memory-bound: counts never increase, so every later partition is memory-bound with max_rows rows
        tail = np.arange(s, n, max_rows, dtype=np.int64)
        return (np.concatenate([np.asarray(starts, dtype=np.int64), tail]),
                np.concatenate([np.asarray(stops, dtype=np.int64), np.minimum(tail + max_rows, n)]),
                np.concatenate([np.asarray(abound, dtype=bool), np.zeros(tail.size, dtype=bool)]))
    return np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64), np.asarray(abound, dtype=bool)


def partition_tables(sorted_tables: list[SortedTable], threshold: float, memory_threshold: float | None = None,
                     total_count: float | None = None, total_bytes: float | None = None) -> Partitions:
    """Partition every table at ``threshold`` of the total access and ``memory_threshold`` (default: the
    same) of the total bytes of the rows being partitioned (OPER 4.1; both 0.1% in OPER section 6.1)."""
    if memory_threshold is None:
        memory_threshold = threshold
    for name, v in (("threshold", threshold), ("memory_threshold", memory_threshold)):
        if not 0 < v <= 1:
            raise ConfigError(f"partition {name} must be in (0, 1], got {v}")
    if total_bytes is None:
        total_bytes = float(sum((t.num_rows - t.skip) * t.row_bytes for t in sorted_tables))
    if total_count is None:
        total_count = float(sum(t.total - t.skip_count for t in sorted_tables))
    thr_c, thr_b = threshold * total_count, memory_threshold * total_bytes
    tabs, sts, sps, cnts, abs_ = [], [], [], [], []
    for t in sorted_tables:
        if t.skip >= t.num_rows:
            continue
        pre = t.prefix()
        st, sp, ab = cut_table(pre, t.skip, t.row_bytes, thr_c, thr_b)
        tabs.append(np.full(st.size, t.index, dtype=np.int32))
        sts.append(st)
        sps.append(sp)
        cnts.append(pre[sp] - pre[st])
        abs_.append(ab)
        del pre
    if not tabs:
        z = np.zeros(0)
        return Partitions(z.astype(np.int32), z.astype(np.int64), z.astype(np.int64), z, z, z.astype(bool))
    table = np.concatenate(tabs)
    start, stop = np.concatenate(sts), np.concatenate(sps)
    rb = np.array([t.row_bytes for t in sorted_tables], dtype=np.float64)
    nbytes = (stop - start) * rb[table]
    return Partitions(table, start, stop, np.concatenate(cnts), nbytes, np.concatenate(abs_))
