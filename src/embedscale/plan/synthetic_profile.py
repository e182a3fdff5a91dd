"""Access profiles the planner can read without a dataset: exact power-law expectations and plain arrays.

The planner takes any object with ``.table_names`` and ``.counts(name) -> ndarray`` (per-row access
counts over ``.samples`` samples), like ``embedscale.data.profile.AccessProfile``. Two more methods
are optional and make planning faster: ``.sorted_rows(name)`` (rows by decreasing count) and
``.sorted_counts(name)`` (the counts in that order).

``ZipfProfile`` is the ``synthetic profile spec``: for every table the *expected* count of the row of
popularity rank ``r`` (1-based) is ``samples * pooling * r**-alpha / H(n, alpha)`` (the power law of
OPER section 6.1's synthetic data sets). Which row id has rank ``r`` is a bijection per table,
``row = (a * (r - 1) + b) mod n`` with ``gcd(a, n) = 1``, so hot rows are scattered over the id space
as in hashed real data, and a row-wise even split does not get them for free. Nothing is sampled:
counts are exact expectations, so every cost-model figure is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from embedscale.errors import ConfigError


class ArrayProfile:
    """A profile from per-table count arrays (tests and hand-written cases).

    Args:
        tables: table name -> counts (any non-negative numbers, one per row).
        samples: how many samples the counts were gathered over.

    Example:
        >>> p = ArrayProfile({"t": np.array([5, 1, 0])}, samples=2)
        >>> p.total("t"), p.num_rows("t")
        (6.0, 3)
    """

    def __init__(self, tables: dict[str, np.ndarray], samples: int = 1) -> None:
        if samples <= 0:
            raise ConfigError(f"profile: samples must be positive, got {samples}")
        self._tables: dict[str, np.ndarray] = {}
        for name, c in tables.items():
            c = np.asarray(c)
            if c.ndim != 1:
                raise ConfigError(f"profile table {name!r}: counts must be 1-D, got shape {c.shape}")
            if c.dtype.kind not in "iuf":
                raise ConfigError(f"profile table {name!r}: counts must be numbers, got dtype {c.dtype}")
            if c.dtype.kind == "f" and not np.all(np.isfinite(c)):
                bad = int(np.flatnonzero(~np.isfinite(c))[0])
                raise ConfigError(f"profile table {name!r}: row {bad} count is {c[bad]}")
            if c.size and c.min() < 0:
                bad = int(np.argmin(c))
                raise ConfigError(f"profile table {name!r}: row {bad} count {c[bad]} is negative")
            self._tables[name] = c
        self.samples = int(samples)

    @property
    def table_names(self) -> list[str]:
        return list(self._tables)

    def counts(self, name: str) -> np.ndarray:
        try:
            return self._tables[name]
        except KeyError:
            raise ConfigError(f"profile has no table {name!r}; it has {self.table_names}") from None

    def num_rows(self, name: str) -> int:
        return int(self.counts(name).size)

    def total(self, name: str) -> float:
        return float(self.counts(name).sum())


def zipf_weights(n: int, alpha: float, dtype=np.float64) -> np.ndarray:
    """Probabilities ``r**-alpha / H(n, alpha)`` for ranks ``r = 1..n`` (most popular first)."""
    if n <= 0:
        raise ConfigError(f"zipf: n must be positive, got {n}")
    if not alpha >= 0:
        raise ConfigError(f"zipf: alpha must be >= 0, got {alpha}")
    w = np.arange(1, n + 1, dtype=np.float64)
    np.power(w, -alpha, out=w)
    w /= w.sum()
    return w.astype(dtype, copy=False)


def rank_to_row_bijection(n: int, seed: int, table_index: int) -> tuple[int, int]:
    """``(a, b)`` of the bijection ``row = (a * rank + b) mod n`` (``gcd(a, n) = 1``), seeded per table."""
    rng = np.random.default_rng([seed, table_index, n])
    if n == 1:
        return 1, 0
    a = int(rng.integers(max(1, n // 3), max(2, n - 1))) | 1
    while math.gcd(a, n) != 1:
        a += 1
    b = int(rng.integers(0, n))
    return a, b


@dataclass
class ZipfProfile:
    """Exact expected per-row counts of a power-law access pattern (the synthetic profile spec).

    Args:
        table_rows: table name -> rows.
        alpha: power-law exponent for every table, or a mapping name -> exponent.
        samples: samples the counts stand for.
        pooling: lookups per sample per table (a number, or a mapping name -> number).
        seed: seeds the rank -> row bijection of every table.

    Example:
        >>> p = ZipfProfile({"t": 4}, alpha=1.0, samples=100)
        >>> np.round(p.sorted_counts("t"), 2).tolist()
        [48.0, 24.0, 16.0, 12.0]
    """

    table_rows: dict[str, int]
    alpha: float | dict[str, float] = 1.1
    samples: int = 1_000_000
    pooling: float | dict[str, float] = 1.0
    seed: int = 0
    _bij: dict[str, tuple[int, int]] = field(default_factory=dict, init=False, repr=False)
    _last: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.samples <= 0:
            raise ConfigError(f"synthetic profile: samples must be positive, got {self.samples}")
        for i, (name, n) in enumerate(self.table_rows.items()):
            if int(n) <= 0:
                raise ConfigError(f"synthetic profile table {name!r}: num_rows must be positive, got {n}")
            a = self._alpha(name)
            if not (a >= 0 and math.isfinite(a)):
                raise ConfigError(f"synthetic profile table {name!r}: alpha must be a finite number >= 0, got {a}")
            p = self._pooling(name)
            if not (p > 0 and math.isfinite(p)):
                raise ConfigError(f"synthetic profile table {name!r}: pooling must be positive, got {p}")
            self._bij[name] = rank_to_row_bijection(int(n), self.seed, i)

    @classmethod
    def from_tables(cls, tables: Iterable, **kw) -> "ZipfProfile":
        """From ``TableSpec``s (or anything with ``.name`` and ``.num_rows``)."""
        return cls({t.name: int(t.num_rows) for t in tables}, **kw)

    def _alpha(self, name: str) -> float:
        return float(self.alpha[name]) if isinstance(self.alpha, dict) else float(self.alpha)

    def _pooling(self, name: str) -> float:
        return float(self.pooling[name]) if isinstance(self.pooling, dict) else float(self.pooling)

    def _check(self, name: str) -> int:
        if name not in self.table_rows:
            raise ConfigError(f"synthetic profile has no table {name!r}; it has {self.table_names}")
        return int(self.table_rows[name])

    @property
    def table_names(self) -> list[str]:
        return list(self.table_rows)

    def spec(self) -> dict[str, Any]:
        return {"kind": "zipf", "alpha": self.alpha, "samples": self.samples, "pooling": self.pooling, "seed": self.seed}

    def sorted_counts(self, name: str) -> np.ndarray:
        """Expected counts, most popular row first (float64, read-only: tables of equal shape share it)."""
        n = self._check(name)
        key = (n, self._alpha(name), self.samples * self._pooling(name))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        w = zipf_weights(n, key[1])
        w *= key[2]
        w.flags.writeable = False
        self._last = (key, w)
        return w

    def sorted_rows(self, name: str) -> np.ndarray:
        """Row ids by decreasing expected count (int32 when the table fits)."""
        n = self._check(name)
        a, b = self._bij[name]
        out = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)
        chunk = 1 << 20  # int64 temporaries that stay in cache: the big array is written once
        for s in range(0, n, chunk):
            r = np.arange(s, min(s + chunk, n), dtype=np.int64)
            r *= a
            r += b
            np.remainder(r, n, out=r)
            out[s : s + r.size] = r
        return out

    def counts(self, name: str) -> np.ndarray:
        out = np.empty(self._check(name), dtype=np.float64)
        out[self.sorted_rows(name)] = self.sorted_counts(name)
        return out

    def total(self, name: str) -> float:
        return float(self.samples * self._pooling(name))

    def num_rows(self, name: str) -> int:
        return self._check(name)


def profile_from_spec(spec: dict[str, Any], tables: list) -> ZipfProfile:
    """Build the profile a ``synthetic profile spec`` describes, e.g. ``{"kind": "zipf", "alpha": 1.1}``.

    Keys: ``kind`` (only ``zipf``), ``alpha`` (number or name -> number), ``samples``, ``pooling``,
    ``seed``. Unknown keys are a ``ConfigError``.
    """
    if not isinstance(spec, dict):
        raise ConfigError(f"synthetic profile spec: expected a mapping, got {spec!r}")
    known = {"kind", "alpha", "samples", "pooling", "seed"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"synthetic profile spec: unknown key(s) {unknown}; known: {sorted(known)}")
    kind = spec.get("kind", "zipf")
    if kind != "zipf":
        raise ConfigError(f"synthetic profile spec: kind {kind!r} is not 'zipf'")
    names = {t.name for t in tables}
    for key in ("alpha", "pooling"):
        if isinstance(spec.get(key), dict):
            extra = sorted(set(spec[key]) - names)
            if extra:
                raise ConfigError(f"synthetic profile spec: {key} names unknown table(s) {extra}")
            missing = sorted(names - set(spec[key]))
            if missing:
                raise ConfigError(f"synthetic profile spec: {key} has no value for table(s) {missing}")
    return ZipfProfile.from_tables(
        tables,
        alpha=spec.get("alpha", 1.1),
        samples=int(spec.get("samples", 1_000_000)),
        pooling=spec.get("pooling", 1.0),
        seed=int(spec.get("seed", 0)),
    )
