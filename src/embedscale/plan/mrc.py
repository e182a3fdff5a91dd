"""Miss-ratio curves of a table's rows from its access profile (numpy only).

The planner needs, per table, how many distinct rows a batch touches and how many of them a device cache
of ``c`` rows would miss. Both follow from the per-row access counts of the profile
(``data/profile.py``) under the *independent reference model*: every lookup of a batch draws row ``i``
with probability ``p_i = count_i / sum(count)``, independently. A batch of ``L`` lookups then touches row
``i`` with probability

    q_i = 1 - (1 - p_i) ** L

so ``E[distinct rows per batch] = sum_i q_i`` (the deduplicated traffic the executor pays: a row is
fetched, sent or read from the host once per batch, however often the batch looks it up).

**The life-cycle cache** (EL-Rec V-B, ``pipeline/cache.py``) holds the rows of the last ``w`` batches.
A distinct row of the next batch is in it when one of those ``w`` independent batches touched it:

    hit ratio(w) = sum_i q_i (1 - (1 - q_i) ** w) / sum_i q_i,   rows held = sum_i (1 - (1 - q_i) ** w)

(``rows held`` counts each row once; the cache keeps one copy per batch, ``w * E[distinct]`` at most).

**An LRU-like cache of c rows** (what a hot-row device cache in front of the host parameter server would
be): Che's approximation (Che, Tung, Wang, IEEE JSAC 2002) says such a cache behaves like a window cache
of a *characteristic time* ``T`` batches, the ``T`` at which the window holds ``c`` rows; the miss ratio
of a batch's distinct rows is then ``sum_i q_i (1 - q_i) ** T / sum_i q_i``. :meth:`MissRatioCurve.lru`
solves for ``T`` by bisection.

Rows are compressed into a histogram of ``q`` on a logarithmic grid (``bins``; rows of similar ``q`` behave
alike), so a curve over a table of 2^24 rows costs one pass over its counts and then microseconds per
point; ``bins=0`` keeps every distinct ``q`` exactly (tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embedscale.errors import ConfigError

CHUNK = 1 << 22  # rows per pass (bounds the temporaries of a 2^24-row table)


def batch_touch_probability(p: np.ndarray, lookups: float) -> np.ndarray:
    """``q = 1 - (1 - p) ** lookups``: the probability that a batch of ``lookups`` independent draws touches a
    row drawn with probability ``p`` (computed as ``-expm1(lookups * log1p(-p))``: exact for tiny ``p``)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return -np.expm1(lookups * np.log1p(-p))


def probability_histogram(counts: np.ndarray, bins: int = 2048, descending: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(p, n)``: the rows of a table with access ``counts`` grouped by their per-lookup probability
    ``p = count / sum(counts)``; ``n[j]`` rows of mean probability ``p[j]``. ``bins > 0``: bins equally wide in
    ``log p`` from one access to all of them (one pass, ``CHUNK`` rows at a time; within a bin ``p`` varies by a
    factor ``total ** (1 / bins)``, about 1% for 10^8 accesses and 2048 bins); ``bins = 0``: every distinct count
    its own entry (exact). ``descending``: the counts are sorted, largest first (a synthetic profile's): the bins
    are then found by binary search and summed by ``np.add.reduceat``, no per-row logarithm."""
    counts = np.asarray(counts)
    total = float(counts.sum(dtype=np.float64))
    if total <= 0:
        return np.zeros(1), np.array([float(counts.size)])
    if bins <= 0:
        vals, n = np.unique(counts, return_counts=True)
        return vals / total, n.astype(np.float64)
    lo = math.log(1.0 / total)  # the smallest non-zero p: one access
    width = -lo / bins if lo < 0 else 1.0
    if descending:
        asc = counts[::-1]
        # count thresholds of the bin edges (bin j >= 1 holds lo + (j-1) w <= log p < lo + j w)
        edges = total * np.exp(lo + width * np.arange(bins + 1))
        edges[0] = np.nextafter(0.0, 1.0)  # bin 0: count 0
        pos = np.searchsorted(asc, edges, side="left")
        pos[-1] = asc.size
        starts = np.r_[0, pos[:-1]]
        n = (pos - starts).astype(np.float64)
        keep = n > 0
        sums = np.add.reduceat(asc, starts[keep].astype(np.int64), dtype=np.float64) if keep.any() else np.zeros(0)
        return sums / total / n[keep], n[keep]
    hist_n = np.zeros(bins + 1)  # bin 0: never accessed
    hist_p = np.zeros(bins + 1)  # sum of p in the bin
    for a in range(0, counts.size, CHUNK):
        c = counts[a:a + CHUNK].astype(np.float64)
        p = c / total
        with np.errstate(divide="ignore"):
            b = np.where(c > 0, 1 + np.clip(((np.log(np.where(c > 0, p, 1.0)) - lo) / width).astype(np.int64), 0, bins - 1), 0)
        hist_n += np.bincount(b, minlength=bins + 1)
        hist_p += np.bincount(b, weights=p, minlength=bins + 1)
    keep = hist_n > 0
    n = hist_n[keep]
    return hist_p[keep] / n, n


@dataclass
class MissRatioCurve:
    """A table's rows as ``(q, n)`` pairs: ``n[j]`` rows each touched by a batch with probability ``q[j]``.

    Args:
        q: per-batch touch probabilities (ascending).
        n: rows with that probability (floats: a histogram bin's rows).
        lookups: lookups per batch the curve is for.
    """

    q: np.ndarray
    n: np.ndarray
    lookups: float

    @classmethod
    def from_counts(cls, counts: np.ndarray, lookups: float, bins: int = 2048) -> "MissRatioCurve":
        """The curve of a table whose rows were accessed ``counts`` times in the profile, for batches of
        ``lookups`` lookups. Rows never accessed have ``q = 0`` (no batch touches them)."""
        return cls.from_histogram(*probability_histogram(counts, bins), lookups)

    @classmethod
    def from_histogram(cls, p: np.ndarray, n: np.ndarray, lookups: float) -> "MissRatioCurve":
        """The curve of ``n[j]`` rows each drawn with probability ``p[j]`` per lookup
        (:func:`probability_histogram`), for batches of ``lookups`` lookups."""
        if lookups < 0:
            raise ConfigError(f"miss-ratio curve: lookups per batch must be >= 0, got {lookups}")
        return cls(batch_touch_probability(p, lookups), np.asarray(n, dtype=np.float64), float(lookups))

    # -- per batch ---------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> float:
        return float(self.n.sum())

    def distinct(self) -> float:
        """Expected distinct rows per batch, ``sum_i q_i``."""
        return float(np.dot(self.n, self.q))

    def _miss_after(self, t: float) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.q >= 1.0, 0.0 if t > 0 else 1.0, np.exp(t * np.log1p(-np.minimum(self.q, 1.0))))

    # -- the life-cycle cache (a window of w batches) -------------------------------------------------------
    def window_rows(self, w: float) -> float:
        """Distinct rows the last ``w`` batches touched (what a window cache of ``w`` batches holds)."""
        return float(np.dot(self.n, 1.0 - self._miss_after(w)))

    def window_hit_ratio(self, w: float) -> float:
        """Share of a batch's distinct rows that one of the previous ``w`` batches touched (the life-cycle
        cache's hits, EL-Rec V-B)."""
        d = self.distinct()
        return 0.0 if d <= 0 else float(np.dot(self.n * self.q, 1.0 - self._miss_after(w)) / d)

    # -- an LRU-like cache of c rows (Che's approximation) ----------------------------------------------------
    def characteristic_time(self, cache_rows: float) -> float:
        """The window ``T`` (batches, real) whose rows fill ``cache_rows``; ``inf`` when the cache holds every
        row ever touched."""
        if cache_rows <= 0:
            return 0.0
        if cache_rows >= float(self.n[self.q > 0].sum()):
            return float("inf")
        lo, hi = 0.0, 1.0
        while self.window_rows(hi) < cache_rows:
            hi *= 2.0
            if hi > 1e15:
                return float("inf")
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if self.window_rows(mid) < cache_rows:
                lo = mid
            else:
                hi = mid
        return hi

    def lru_miss_ratio(self, cache_rows: float) -> float:
        """Share of a batch's distinct rows a cache of ``cache_rows`` rows misses (Che's approximation)."""
        d = self.distinct()
        if d <= 0:
            return 0.0
        t = self.characteristic_time(cache_rows)
        if t == float("inf"):
            return 0.0
        return float(np.dot(self.n * self.q, self._miss_after(t)) / d)

    def curve(self, sizes) -> list[dict]:
        """``[{"cache_rows", "miss_ratio", "misses_per_batch"}]`` at every size of ``sizes``."""
        d = self.distinct()
        out = []
        for c in sizes:
            m = self.lru_miss_ratio(float(c))
            out.append({"cache_rows": int(c), "miss_ratio": m, "misses_per_batch": m * d})
        return out
