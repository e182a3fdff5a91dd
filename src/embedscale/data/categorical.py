"""Categorical keys -> embedding-table rows, the two ways Meta's DLRM reference offers.

Raw readers turn every categorical value into a 64-bit key (Criteo: the hex value; Avazu: a stable
hash of the string; missing: key 0). ``CategoricalEncoder`` maps keys to rows, feature-major
(``keys[f]`` is feature ``f`` for every sample of a block, the layout of TorchRec's KJT values).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from embedscale.errors import ConfigError


class ValueCounter:
    """Exact per-value counts of one categorical feature, merged block by block (16 bytes per distinct value)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, keys: np.ndarray) -> None:
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

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct keys, their counts)."""
        self._merge()
        return self.keys, self.counts


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
    """

    def __init__(self, names: list[str], mode: str, table_rows: int | Sequence[int] = 1_000_000,
                 min_frequency: int = 1) -> None:
        if mode not in ("hash", "vocab"):
            raise ConfigError(f"categorical must be 'hash' or 'vocab', got {mode!r}")
        rows = [int(table_rows)] * len(names) if np.isscalar(table_rows) else [int(r) for r in table_rows]
        if len(rows) != len(names):
            raise ConfigError(f"table_rows has {len(rows)} entries for {len(names)} sparse features "
                              f"{names[0]}..{names[-1]}")
        bad = [f"{n}={r}" for n, r in zip(names, rows) if r <= 0]
        if bad:
            raise ConfigError(f"table_rows must be positive: {', '.join(bad)}")
        if int(min_frequency) < 1:
            raise ConfigError(f"min_frequency must be >= 1, got {min_frequency}")
        self.names, self.mode, self.min_frequency = list(names), mode, int(min_frequency)
        self.table_rows = rows
        self.counters = [ValueCounter() for _ in names] if mode == "vocab" else None
        self.vocab: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (sorted keys, their rows, keys by row)

    @property
    def needs_counts(self) -> bool:
        return self.mode == "vocab" and not self.vocab

    def count(self, keys: np.ndarray) -> None:
        """Pass 1 of vocab mode: ``keys [F, N]``."""
        for f, counter in enumerate(self.counters):
            counter.add(keys[f])

    def build(self) -> None:
        """Close pass 1: fix each feature's vocabulary and row count."""
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
        out = np.zeros(keys.shape, np.int64)
        for f, (k, rows, _) in enumerate(self.vocab):
            if len(k):
                pos = np.minimum(np.searchsorted(k, keys[f]), len(k) - 1)
                out[f] = np.where(k[pos] == keys[f], rows[pos], 0)
        return out
