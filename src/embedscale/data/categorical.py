"""Categorical keys -> embedding-table rows, the two ways Meta's DLRM reference offers.

Raw readers turn every categorical value into a 64-bit key (Criteo: the hex value; Avazu: a stable
hash of the string; missing: key 0). ``CategoricalEncoder`` maps keys to rows, feature-major
(``keys[f]`` is feature ``f`` for every sample of a block, the layout of TorchRec's KJT values).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from embedscale.errors import ConfigError


class ValueCounter:
    """Exact per-value counts of one categorical feature, merged block by block (16 bytes per distinct value).
    With a ``limit``: once more than ``limit`` distinct values are seen it stops counting (``saturated``; memory
    bounded by the limit), for ``auto`` encoding, which then hashes."""

    def __init__(self, limit: int | None = None) -> None:
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0
        self.limit = limit
        self.saturated = False

    def add(self, keys: np.ndarray) -> None:
        if self.saturated:
            return
        k, c = np.unique(keys, return_counts=True)
        self._pending.append((k, c.astype(np.int64)))
        self._pending_size += len(k)
        if self._pending_size > max(1 << 20, len(self.keys)):  # amortised: merge when pending outgrows the total
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([self.keys] + [k for k, _ in self._pending])
        counts = np.concatenate([self.counts] + [c for _, c in self._pending])
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        if len(keys):
            starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
            keys, counts = keys[starts], np.add.reduceat(counts, starts)
        self.keys, self.counts = keys, counts
        self._pending, self._pending_size = [], 0
        if self.limit is not None and len(keys) > self.limit:
            self.saturated = True
            self.keys, self.counts = np.zeros(0, np.uint64), np.zeros(0, np.int64)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct keys, their counts)."""
        self._merge()
        return self.keys, self.counts


class DistinctCounter:
    """How many distinct keys one feature has, exactly up to ``limit`` (then it stops: memory <= 8 B * limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.keys = np.zeros(0, np.uint64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self.saturated = False

    def add(self, keys: np.ndarray) -> None:
        if self.saturated:
            return
        u = np.unique(keys)
        self._pending.append(u)
        self._pending_size += len(u)
        if self._pending_size > max(1 << 18, len(self.keys)):
            self._merge()

    def _merge(self) -> None:
        if self._pending:
            self.keys = np.unique(np.concatenate([self.keys] + self._pending))
            self._pending, self._pending_size = [], 0
            if len(self.keys) > self.limit:
                self.saturated, self.keys = True, np.zeros(0, np.uint64)

    def result(self) -> int:
        """Distinct keys seen, or ``limit + 1`` when there were more than ``limit``."""
        self._merge()
        return self.limit + 1 if self.saturated else len(self.keys)


def rows_for(distinct: int, load_factor: float, cap: int) -> int:
    """Hashed table rows for ``distinct`` observed values: ``ceil(distinct / load_factor)``, at most ``cap``."""
    return max(1, min(int(cap), math.ceil(distinct / load_factor)))


class CategoricalEncoder:
    """Keys -> table rows for every sparse feature.

    ``hash``: row = key % table_rows[f], the reference's ``--max-ind-range`` (``int(x, 16) % max_ind_range``
    in facebookresearch/dlrm ``data_utils.py``); one pass.

    ``vocab``: the reference numbers every distinct value of a feature; we add the frequency cut of the
    MLPerf / NVIDIA DLRM preprocessing. Pass 1 counts keys (``count``, ``build``); keys seen at least
    ``min_frequency`` times get rows 1..V in order of descending count, ties by ascending key (row 1
    is the most frequent value: hot rows first, and the same numbering on every run); row 0 is the
    shared out-of-vocabulary row of all rarer keys (and of keys never seen in pass 1). A missing value
    is key 0, as in the reference, and gets its own row like any other value when frequent enough.
    With ``min_frequency=1`` row 0 is never used and V is the number of distinct values.

    Hash mode sizes a table whose ``table_rows`` entry is 0 from the data: pass 1 counts the feature's
    distinct keys (``DistinctCounter``, exact up to the cap) and the table gets
    ``min(max_rows, ceil(distinct / load_factor))`` rows (``rows_for``).

    ``auto`` (the default of ``embedscale data`` and ``data.categorical``): ``vocab`` when every feature's
    vocabulary fits, i.e. has fewer than ``max_rows`` values (pass 1 counts them, at most ``max_rows`` per
    feature in memory), else ``hash`` with the tables sized from the data; ``hash`` too when table rows are
    given. Hashing a vocabulary that fits only adds collisions (two values sharing a row). After pass 1
    (``build``) ``mode`` is the one chosen.
    """

    def __init__(self, names: list[str], mode: str, table_rows: int | Sequence[int] = 0,
                 min_frequency: int = 1, load_factor: float = 0.5, max_rows: int = 1_000_000) -> None:
        if mode not in ("hash", "vocab", "auto"):
            raise ConfigError(f"categorical must be 'hash' or 'vocab' (or 'auto': vocab when it fits), got {mode!r}")
        rows = [int(table_rows)] * len(names) if np.isscalar(table_rows) else [int(r) for r in table_rows]
        if mode == "auto" and any(rows):
            mode = "hash"  # table rows given: hash buckets
        if len(rows) != len(names):
            raise ConfigError(f"table_rows has {len(rows)} entries for {len(names)} sparse features "
                              f"{names[0]}..{names[-1]}")
        bad = [f"{n}={r}" for n, r in zip(names, rows) if r < 0]
        if bad:
            raise ConfigError(f"table_rows must be positive (0 = sized from the data): {', '.join(bad)}")
        if int(min_frequency) < 1:
            raise ConfigError(f"min_frequency must be >= 1, got {min_frequency}")
        if not (0 < load_factor <= 1e6) or int(max_rows) < 1:
            raise ConfigError(f"load_factor must be > 0 and max_rows >= 1, got {load_factor} and {max_rows}")
        self.names, self.mode, self.min_frequency = list(names), mode, int(min_frequency)
        self.load_factor, self.max_rows = float(load_factor), int(max_rows)
        self.table_rows = rows
        self.sized_from_data = [mode == "hash" and r == 0 for r in rows]
        if mode == "vocab":
            self.counters = [ValueCounter() for _ in names]
        elif mode == "auto":
            self.counters = [ValueCounter(limit=self.max_rows - 1) for _ in names]
        elif any(self.sized_from_data):
            limit = math.ceil(self.max_rows * self.load_factor)
            self.counters = [DistinctCounter(limit) if auto else None for auto in self.sized_from_data]
        else:
            self.counters = None
        self.vocab: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (sorted keys, their rows, keys by row)

    @property
    def needs_counts(self) -> bool:
        return self.counters is not None

    def count(self, keys) -> None:
        """Pass 1: ``keys [F, N]`` or a list of F key arrays (multi-hot: every value)."""
        for f, counter in enumerate(self.counters):
            if counter is not None:
                counter.add(keys[f])

    def set_vocab(self, by_row: list[np.ndarray]) -> None:
        """Take vocabularies built before (``by_row[f][i - 1]`` is the key of row i), e.g. another dataset's."""
        self.vocab = []
        for f, keys_by_row in enumerate(by_row):
            keys_by_row = np.asarray(keys_by_row, np.uint64)
            order = np.argsort(keys_by_row, kind="stable")
            self.vocab.append((keys_by_row[order], (order + 1).astype(np.int64), keys_by_row))
            self.table_rows[f] = len(keys_by_row) + 1
        self.counters = None

    def build(self) -> None:
        """Close pass 1: fix each feature's vocabulary (vocab) or table rows (hash, sized from the data); ``auto``
        becomes one of them."""
        if self.mode == "auto":
            for c in self.counters:
                c.result()  # the pending counts merged: saturated or not
            if any(c.saturated for c in self.counters):
                self.mode = "hash"
                self.table_rows = [self.max_rows if c.saturated else rows_for(len(c.result()[0]), self.load_factor,
                                                                               self.max_rows)
                                   for c in self.counters]
                self.sized_from_data = [True] * len(self.names)
                self.counters = None
                return
            self.mode = "vocab"
        if self.mode == "hash":
            for f, counter in enumerate(self.counters):
                if counter is not None:
                    self.table_rows[f] = rows_for(counter.result(), self.load_factor, self.max_rows)
            self.counters = None
            return
        for f, counter in enumerate(self.counters):
            keys, counts = counter.result()
            keep = counts >= self.min_frequency
            k, c = keys[keep], counts[keep]
            by_row = k[np.lexsort((k, -c))]  # descending count, then ascending key
            rows = np.empty(len(k), np.int64)
            rows[np.searchsorted(k, by_row)] = np.arange(1, len(k) + 1)
            self.vocab.append((k, rows, by_row))
            self.table_rows[f] = len(k) + 1
        self.counters = None

    def encode(self, keys: np.ndarray) -> np.ndarray:
        """``keys [F, N]`` uint64 -> rows ``[F, N]`` int64."""
        if self.mode == "hash":
            return (keys % np.asarray(self.table_rows, np.uint64)[:, None]).view(np.int64)
        return np.stack([self.encode_feature(f, keys[f]) for f in range(len(self.names))]) if len(self.names) \
            else np.zeros(keys.shape, np.int64)

    def encode_feature(self, f: int, keys: np.ndarray) -> np.ndarray:
        """Feature ``f``'s keys (any number) -> its rows, int64."""
        if self.mode == "hash":
            return (keys % np.uint64(self.table_rows[f])).view(np.int64)
        k, rows, _ = self.vocab[f]
        if not len(k):
            return np.zeros(len(keys), np.int64)
        pos = np.minimum(np.searchsorted(k, keys), len(k) - 1)
        return np.where(k[pos] == keys, rows[pos], 0)
