"""AccessProfile: exact per-table, per-row access counts, the input of the OPER planner.

OPER plans from the profiled access frequency of every embedding row (OPER section 3: access- and
memory-aware partitioning, hot-row replication by frequency). ``AccessProfile.from_shards`` counts
every id of every sparse feature in one streaming pass over a shard directory; memory is the count
arrays plus one shard's columns.

Counts are ``uint32`` (4 bytes per row: the 188M rows of criteo-terabyte take 0.75 GB). A
table whose count could pass 2^32 - 1 is promoted to ``int64`` before the add: counts never wrap and
are never clipped. An *expected* profile (``AccessProfile.expected``) holds real-valued expected
counts in ``float64``. Saved profiles are one ``.npy`` per table plus a JSON manifest, and load
memory-mapped (copied on the first write).

Per block, a table's counts are accumulated with ``np.bincount`` when the block has many ids for the
table's size and with ``np.unique`` (sort, then add to the touched rows) when the table is much
larger than the block: bincount would allocate and add a table-sized array per block.

Input drift (OPER section 8: monitor the input distribution, re-plan when it moved) is measured by
``drift``: the total-variation distance between normalised access distributions and the overlap of
the hot sets (the fewest rows covering ``hot_share`` of the accesses).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from embedscale.data.shards import Columns, Manifest, read_shard
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.io import atomic_save_npy, atomic_write_json, read_json

PROFILE_MANIFEST = "profile.json"
FORMAT = "embedscale.profile"
VERSION = 1
UINT32_MAX = np.iinfo(np.uint32).max
_DTYPES = (np.dtype(np.uint32), np.dtype(np.int64), np.dtype(np.float64))
# bincount a block into a table-sized array only when the table is at most this many times the ids
_BINCOUNT_RATIO = 8


class AccessProfile:
    """Per-table per-row access counts over ``samples`` samples.

    Args:
        tables: table name -> counts ``[num_rows]`` (``uint32``/``int64`` exact counts, ``float64``
            expected counts; other integer types are converted to ``int64``).
        samples: the number of samples counted.
        feature_to_table: sparse feature name -> table name, used by ``add`` (default: each feature is
            counted in the table of the same name).

    Example::

        prof = AccessProfile.from_shards("data/train")       # one table per feature
        prof.sorted_rows("C3")[:10]                           # the ten hottest rows of C3
        prof.coverage("C3", 0.01)                             # share of accesses on the top 1% rows
    """

    def __init__(self, tables: Mapping[str, np.ndarray], samples: int,
                 feature_to_table: Mapping[str, str] | None = None):
        if samples < 0:
            raise InputError(f"AccessProfile: samples must be >= 0, got {samples}")
        self.samples = int(samples)
        self._tables: dict[str, np.ndarray] = {}
        self._bound: dict[str, int | None] = {}  # upper bound on a uint32 table's max count (None = unknown)
        self._order_cache: tuple[str, np.ndarray] | None = None
        for name, counts in tables.items():
            a = np.asarray(counts)
            if a.ndim != 1 or a.size == 0:
                raise InputError(f"AccessProfile: table {name!r}: counts must be 1-D with one entry per row, "
                                 f"got shape {a.shape}")
            if a.dtype not in _DTYPES:
                if a.dtype.kind not in "iub":
                    raise InputError(f"AccessProfile: table {name!r}: counts of dtype {a.dtype} are not numbers")
                a = a.astype(np.int64)
            if a.dtype.kind in "if" and a.size:
                lo = a.min()
                if not (lo >= 0):  # also catches NaN
                    raise InputError(f"AccessProfile: table {name!r}: negative or NaN count {lo}")
            self._tables[name] = a
            self._bound[name] = None
        if feature_to_table is not None:
            unknown = sorted({t for t in feature_to_table.values() if t not in self._tables})
            if unknown:
                raise ConfigError(f"AccessProfile: feature_to_table names unknown table(s) {unknown}")
        self.feature_to_table = dict(feature_to_table) if feature_to_table is not None else None

    # -- what is in it ---------------------------------------------------------------------------
    @property
    def table_names(self) -> list[str]:
        return list(self._tables)

    @property
    def tables(self) -> dict[str, np.ndarray]:
        return dict(self._tables)

    def _get(self, name: str) -> np.ndarray:
        try:
            return self._tables[name]
        except KeyError:
            raise ConfigError(f"access profile has no table {name!r}; tables: {self.table_names}") from None

    def counts(self, name: str) -> np.ndarray:
        """Access count of every row of table ``name`` (read-only view when memory-mapped)."""
        return self._get(name)

    def num_rows(self, name: str) -> int:
        return int(self._get(name).size)

    def total(self, name: str) -> float | int:
        """All accesses of table ``name`` (ids counted, so a multi-hot bag counts each of its ids)."""
        c = self._get(name)
        return float(c.sum()) if c.dtype.kind == "f" else int(c.sum(dtype=np.int64))

    def probabilities(self, name: str) -> np.ndarray:
        """Normalised access distribution of table ``name`` (zeros if it was never accessed)."""
        c = self._get(name).astype(np.float64)
        tot = c.sum()
        return c / tot if tot > 0 else c

    def sorted_rows(self, name: str) -> np.ndarray:
        """Row ids by descending count; ties in ascending row id (a stable order). int64.

        The last table's order is cached (the planner asks for ``sorted_rows`` then ``sorted_counts``)."""
        cached = self._order_cache
        if cached is not None and cached[0] == name:
            return cached[1]
        c = self._get(name)
        nz = np.flatnonzero(c)  # sort only accessed rows: most rows of a large table are never read
        key = c[nz].astype(np.float64 if c.dtype.kind == "f" else np.int64)
        hot = nz[np.argsort(-key, kind="stable")]
        cold = np.flatnonzero(c == 0)
        order = np.concatenate([hot, cold]).astype(np.int64, copy=False)
        order.flags.writeable = False
        self._order_cache = (name, order)
        return order

    def sorted_counts(self, name: str) -> np.ndarray:
        """The counts of table ``name`` in ``sorted_rows`` order (non-increasing)."""
        return self._get(name)[self.sorted_rows(name)]

    def coverage(self, name: str, fraction: float) -> float:
        """Share of table ``name``'s accesses that hit its top ``ceil(fraction * num_rows)`` rows
        (0.0 for a table never accessed)."""
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"coverage: fraction must be in [0, 1], got {fraction}")
        c = self._get(name)
        n = c.size
        k = min(n, math.ceil(fraction * n))
        tot = self.total(name)
        if k == 0 or tot == 0:
            return 0.0
        top = np.partition(c, n - k)[n - k:]
        return float(top.sum(dtype=np.float64) / tot)

    def hot_rows(self, name: str, share: float) -> np.ndarray:
        """The fewest rows (in ``sorted_rows`` order) whose accesses cover at least ``share`` of the table's."""
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"hot_rows: share must be in [0, 1], got {share}")
        rows = self.sorted_rows(name)
        c = self._get(name)
        nz = int(np.count_nonzero(c))
        tot = self.total(name)
        if share == 0.0 or tot == 0:
            return rows[:0]
        cum = np.cumsum(c[rows[:nz]], dtype=np.float64)
        k = int(np.searchsorted(cum, share * tot * (1 - 1e-12), side="left")) + 1
        return rows[:min(k, nz)]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per table: rows, accessed rows, accesses, dtype, and the share of accesses on the top 1% / 10% rows."""
        out = {}
        for name, c in self._tables.items():
            out[name] = {
                "rows": int(c.size),
                "accessed_rows": int(np.count_nonzero(c)),
                "accesses": self.total(name),
                "dtype": str(c.dtype),
                "top1pct_coverage": self.coverage(name, 0.01),
                "top10pct_coverage": self.coverage(name, 0.10),
            }
        return out

    def format_summary(self) -> str:
        lines = [f"{'table':<12}{'rows':>12}{'accessed':>12}{'accesses':>14}{'top1%':>8}{'top10%':>8}"]
        for name, s in self.summary().items():
            lines.append(f"{name:<12}{s['rows']:>12}{s['accessed_rows']:>12}{s['accesses']:>14.0f}"
                         f"{s['top1pct_coverage']:>8.3f}{s['top10pct_coverage']:>8.3f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"AccessProfile({len(self._tables)} tables, {self.samples} samples)"

    # -- counting --------------------------------------------------------------------------------
    def _writable(self, name: str) -> np.ndarray:
        a = self._tables[name]
        if not a.flags.writeable:  # memory-mapped read-only after load: copy on first write
            a = np.array(a)
            self._tables[name] = a
        return a

    def _max_bound(self, name: str) -> int:
        b = self._bound[name]
        if b is None:
            b = int(self._tables[name].max())
            self._bound[name] = b
        return b

    def _accumulate(self, name: str, ids: np.ndarray, feature: str, source: str | None) -> None:
        """Add one access per id in ``ids`` to table ``name``, promoting uint32 counts before they overflow."""
        m = ids.size
        if m == 0:
            return
        a = self._tables[name]
        n = a.size
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            where = f"{source}: " if source else ""
            raise InputError(f"{where}feature {feature!r}: row id {bad} outside table {name!r} of {n} rows "
                             f"(valid ids 0..{n - 1})")
        ids = ids.astype(np.int64, copy=False)
        self._order_cache = None
        a = self._writable(name)
        dense_path = n <= _BINCOUNT_RATIO * m
        if dense_path:
            rows, inc = None, np.bincount(ids, minlength=n)
        else:
            rows, inc = np.unique(ids, return_counts=True)
        if a.dtype == np.uint32:
            step = int(inc.max())  # the most any one row gains in this block
            bound = self._max_bound(name)
            if bound + step > UINT32_MAX:
                bound = int(a.max())  # the bound may be loose: tighten it, then check exactly
                if bound + step > UINT32_MAX:
                    touched = a if dense_path else a[rows]
                    new_max = int((touched.astype(np.int64) + inc).max())
                    if new_max > UINT32_MAX:
                        a = a.astype(np.int64)  # promote this table; never wrap
                        self._tables[name] = a
                    else:
                        step = new_max - bound if new_max > bound else 0
            self._bound[name] = bound + step if a.dtype == np.uint32 else None
        if dense_path:
            np.add(a, inc, out=a, casting="unsafe")  # safe: overflow was ruled out above
        else:
            a[rows] += inc.astype(a.dtype)

    def _table_of(self, feature: str) -> str:
        if self.feature_to_table is None:
            if feature not in self._tables:
                raise InputError(f"sparse feature {feature!r} has no table in the access profile "
                                 f"(tables: {self.table_names}); pass feature_to_table")
            return feature
        if feature not in self.feature_to_table:
            raise InputError(f"sparse feature {feature!r} is not in the profile's feature_to_table "
                             f"(features: {sorted(self.feature_to_table)})")
        return self.feature_to_table[feature]

    def add(self, columns: Columns, source: str | os.PathLike | None = None) -> None:
        """Count every id of every sparse feature of ``columns`` (one block of samples).

        ``source`` (e.g. the shard file) is named in the error for an id outside its table.
        A block is applied table by table; after an error the profile is partly updated.
        """
        for feature, (values, _lengths) in columns.sparse.items():
            table = self._table_of(feature)
            ids = np.asarray(values)
            if ids.dtype.kind not in "iu":
                raise InputError(f"{source or 'columns'}: feature {feature!r}: ids of dtype {ids.dtype} are not integers")
            self._accumulate(table, ids, feature, None if source is None else str(source))
        self.samples += columns.rows

    @classmethod
    def from_shards(cls, directory: str | os.PathLike, feature_to_table: Mapping[str, str] | None = None,
                    num_rows: Mapping[str, int] | None = None, progress: bool = True) -> "AccessProfile":
        """Count every access of a shard directory in one streaming pass.

        Args:
            directory: a shard directory (``data.shards``).
            feature_to_table: sparse feature -> table name. Default: one table per sparse feature, named
                as the feature. When given it must map every sparse feature of the dataset.
            num_rows: table -> rows. Default: the features' ``num_rows`` from the manifest (the largest,
                for a table read by several features).
            progress: show a tqdm bar on stderr.
        """
        from tqdm import tqdm

        directory = Path(directory)
        m = Manifest.load(directory)
        features = m.sparse_names
        if feature_to_table is None:
            mapping = {f: f for f in features}
        else:
            mapping = dict(feature_to_table)
            missing = [f for f in features if f not in mapping]
            extra = sorted(set(mapping) - set(features))
            if missing or extra:
                raise ConfigError(f"{directory}: feature_to_table does not match the dataset's sparse features: "
                                  f"unmapped {missing}, not in the dataset {extra}")
        rows: dict[str, int] = {}
        for info in m.sparse:
            t = mapping[info.name]
            rows[t] = max(rows.get(t, 0), int(info.num_rows))
        if num_rows is not None:
            unknown = sorted(set(num_rows) - set(rows))
            if unknown:
                raise ConfigError(f"{directory}: num_rows names table(s) {unknown} no feature maps to")
            rows.update({t: int(n) for t, n in num_rows.items()})
        for t, n in rows.items():
            if n <= 0:
                raise ConfigError(f"{directory}: table {t!r} has {n} rows")
        prof = cls({t: np.zeros(n, dtype=np.uint32) for t, n in rows.items()}, 0, mapping)
        for t in rows:
            prof._bound[t] = 0
        with tqdm(total=m.rows, desc="profile", unit="sample", unit_scale=True, disable=not progress) as bar:
            for s in m.shards:
                path = directory / s["file"]
                prof.add(read_shard(path, m.num_dense), source=path)
                bar.update(s["rows"])
        return prof

    @classmethod
    def expected(cls, source: Any, samples: int) -> "AccessProfile":
        """The expected profile of ``samples`` samples, from exact probabilities instead of sampling.

        ``source`` is a ``SyntheticGenerator`` (each table's ``access_probability`` times its pooling
        factor, the mean ids per sample) or a mapping table -> expected accesses per sample of every row
        (a probability vector for a one-hot feature). Counts are float64 expectations.
        """
        if samples < 0:
            raise ConfigError(f"expected: samples must be >= 0, got {samples}")
        tables: dict[str, np.ndarray] = {}
        if hasattr(source, "access_probability") and hasattr(source, "feature_names"):
            for ti, (name, pf) in enumerate(zip(source.feature_names, source.pooling_factors)):
                p = source.access_probability(ti)
                p *= pf * samples
                tables[name] = p
        elif isinstance(source, Mapping):
            for name, p in source.items():
                p = np.asarray(p, dtype=np.float64)
                if p.ndim != 1 or not np.all(np.isfinite(p)) or (p.size and p.min() < 0):
                    raise InputError(f"expected: table {name!r}: per-row accesses must be a finite, "
                                     f"non-negative 1-D array")
                tables[name] = p * samples
        else:
            raise ConfigError(f"expected: need a SyntheticGenerator or a mapping table -> probabilities, "
                              f"got {type(source).__name__}")
        return cls(tables, samples)

    # -- combining -------------------------------------------------------------------------------
    def _check_compatible(self, other: "AccessProfile", what: str) -> None:
        if set(self._tables) != set(other._tables):
            raise InputError(f"{what}: the profiles have different tables: only here "
                             f"{sorted(set(self._tables) - set(other._tables))}, only there "
                             f"{sorted(set(other._tables) - set(self._tables))}")
        for name in self._tables:
            if self.num_rows(name) != other.num_rows(name):
                raise InputError(f"{what}: table {name!r} has {self.num_rows(name)} rows here and "
                                 f"{other.num_rows(name)} there")

    def merge(self, other: "AccessProfile") -> "AccessProfile":
        """A new profile with the summed counts and samples (tables and row counts must agree).
        Integer sums stay ``uint32`` when they fit and become ``int64`` otherwise."""
        self._check_compatible(other, "merge")
        out: dict[str, np.ndarray] = {}
        for name, a in self._tables.items():
            b = other._tables[name]
            if a.dtype.kind == "f" or b.dtype.kind == "f":
                out[name] = a.astype(np.float64) + b
            else:
                s = a.astype(np.int64) + b
                out[name] = s.astype(np.uint32) if s.max() <= UINT32_MAX else s
        return AccessProfile(out, self.samples + other.samples, self.feature_to_table)

    def drift(self, other: "AccessProfile", hot_share: float = 0.8) -> dict[str, Any]:
        """How far the access distribution moved from this profile to ``other`` (OPER section 8).

        Per table and overall:

        - ``tv``: total-variation distance ``1/2 * sum_r |p_r - q_r|`` between the normalised access
          distributions (0 = identical, 1 = disjoint rows). Overall, each access is a ``(table, row)``
          pair of one joint distribution. A table never accessed on one side and accessed on the other
          has ``tv = 1``; never accessed on both sides, 0.
        - ``hot_jaccard``: ``|H ∩ H'| / |H ∪ H'|`` of the hot sets, ``H`` = the fewest rows covering
          ``hot_share`` of the accesses (1 when both are empty).
        - ``hot_coverage``: the share of ``other``'s accesses that hit this profile's hot set: what a
          plan that replicates this profile's hot rows still serves locally (compare with ``hot_share``;
          1 when ``other`` has no accesses).
        """
        self._check_compatible(other, "drift")
        if not 0.0 < hot_share <= 1.0:
            raise ConfigError(f"drift: hot_share must be in (0, 1], got {hot_share}")
        tot_a = sum(float(self.total(n)) for n in self._tables)
        tot_b = sum(float(other.total(n)) for n in self._tables)
        tables: dict[str, dict[str, Any]] = {}
        tv_joint = 0.0
        inter_all = union_all = 0
        covered_all = 0.0
        for name in self._tables:
            a = self._tables[name].astype(np.float64)
            b = other._tables[name].astype(np.float64)
            ta, tb = float(a.sum()), float(b.sum())
            if ta > 0 and tb > 0:
                tv = 0.5 * float(np.abs(a / ta - b / tb).sum())
            else:
                tv = 0.0 if ta == tb == 0 else 1.0
            if tot_a > 0 and tot_b > 0:
                tv_joint += 0.5 * float(np.abs(a / tot_a - b / tot_b).sum())
            ha = self.hot_rows(name, hot_share)
            hb = other.hot_rows(name, hot_share)
            inter = int(np.intersect1d(ha, hb, assume_unique=True).size)
            union = int(ha.size + hb.size - inter)
            covered = float(b[ha].sum())
            tables[name] = {
                "tv": tv,
                "hot_jaccard": inter / union if union else 1.0,
                "hot_coverage": covered / tb if tb > 0 else 1.0,
                "hot_rows": int(ha.size),
                "hot_rows_other": int(hb.size),
            }
            inter_all += inter
            union_all += union
            covered_all += covered
        if not (tot_a > 0 and tot_b > 0):
            tv_joint = 0.0 if tot_a == tot_b == 0 else 1.0
        overall = {
            "tv": tv_joint,
            "hot_jaccard": inter_all / union_all if union_all else 1.0,
            "hot_coverage": covered_all / tot_b if tot_b > 0 else 1.0,
        }
        return {"hot_share": hot_share, "overall": overall, "tables": tables}

    # -- files -----------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> None:
        """Write ``profile.json`` and ``table-NNNNN.npy`` per table, each atomically (the manifest last)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for i, (name, a) in enumerate(self._tables.items()):
            file = f"table-{i:05d}.npy"
            atomic_save_npy(directory / file, a)
            entries.append({"name": name, "file": file, "num_rows": int(a.size), "dtype": str(a.dtype),
                            "total": self.total(name)})
        atomic_write_json(directory / PROFILE_MANIFEST, {
            "format": FORMAT,
            "version": VERSION,
            "samples": self.samples,
            "feature_to_table": self.feature_to_table,
            "tables": entries,
        })

    @classmethod
    def load(cls, directory: str | os.PathLike, mmap: bool = True) -> "AccessProfile":
        """Read a saved profile; with ``mmap`` the counts are memory-mapped read-only (copied on first write)."""
        directory = Path(directory)
        path = directory / PROFILE_MANIFEST
        d = read_json(path, "access profile manifest")
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise FormatError(f"{path}: not an embedscale access profile (format={d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("version") != VERSION:
            raise FormatError(f"{path}: access profile version {d.get('version')} is not {VERSION}")
        tables = {}
        entries = d.get("tables")
        if not isinstance(entries, list) or not all(isinstance(e, dict) and {"name", "file", "num_rows", "dtype"}
                                                    <= set(e) for e in entries) or "samples" not in d:
            raise FormatError(f"{path}: 'samples' or a table entry (name, file, num_rows, dtype) is missing")
        for e in entries:
            f = directory / e["file"]
            if not f.exists():
                raise FormatError(f"{path}: table {e['name']!r}: file {e['file']} is missing")
            try:
                a = np.load(f, mmap_mode="r" if mmap else None, allow_pickle=False)
            except (ValueError, OSError, EOFError) as err:  # a truncated .npy: ValueError or EOFError
                raise FormatError(f"{f}: not a readable .npy count array ({err})") from None
            if a.shape != (e["num_rows"],) or str(a.dtype) != e["dtype"]:
                raise FormatError(f"{f}: table {e['name']!r} holds {a.dtype}{list(a.shape)}, the manifest says "
                                  f"{e['dtype']}[{e['num_rows']}]")
            tables[e["name"]] = a
        prof = cls.__new__(cls)
        prof.samples = int(d["samples"])
        prof._tables = tables
        prof._bound = {n: None for n in tables}
        prof._order_cache = None
        prof.feature_to_table = d.get("feature_to_table")
        return prof
