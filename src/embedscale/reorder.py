"""Locality-based index reordering (EL-Rec section IV): a per-table bijection of row ids, built offline.

What this module owns: the *index bijection* ``new_id = map[old_id]`` of a table, how it is built from
global and local information, saved, loaded and applied to batches. Reordering only renames rows:
every row of a table is initialised alike and trained alike, so for an uncompressed table training on
renamed ids equals training on the original ids up to the permutation of the rows (tested). For a TT
table it changes which rows share TT slices: rows that are read together get consecutive ids, share
their prefix ``(i_1, .., i_{d-1})`` (eq. 3), and the Eff-TT reuse buffer (section III-A) has fewer
distinct prefixes to compute (EL-Rec Figs. 7, 17, 18).

How the bijection is built (section IV-C, Fig. 8, Algorithm 2), per table:

1. **Global information.** Rows are ranked by access count (``AccessProfile.sorted_rows``: descending
   count, ties by row id). The top ``H = floor(num_rows * hot_ratio)`` rows are the *hot* rows
   (Algorithm 2, line 1); they take the first ids, ``0 .. H - 1``, in frequency order.
2. **Local information.** For every sampled batch, the non-hot rows it reads are linked in an *index
   graph* (lines 2-7: vertices are frequency-ordered ids shifted by ``H``; an edge joins two rows read
   in the same batch; repeated edges add up as weights). Algorithm 2 joins *all* pairs of a batch
   (``self_combinations``), which grows as the square of the batch; here a batch whose rows would give
   more than ``max_pairs_per_batch`` pairs instead links every row to ``max_pairs_per_batch // k``
   random partners from the same batch (``k`` its rows): the same communities (rows read together stay
   densely linked) at a bounded cost.
3. **Communities.** Modularity-based community detection ([34]-[36] of the paper: maximise
   ``Q = 1/2m sum_i [e_ii - k_i^2 / 2m]``) with igraph's Leiden (``community_leiden``, objective
   ``modularity``), or Louvain (``community_multilevel``). Each community takes consecutive ids, the
   communities in descending total access count, the rows of a community in frequency order.
4. Rows neither hot nor in the graph (never read in the sampled batches, or read alone) take the
   remaining ids in frequency order.

Saved as one ``.npy`` per table (the map, ``int32`` when it fits) plus ``reorder.json`` (atomic, no
pickle); ``load`` checks that every map is a bijection. ``apply`` renames the ids of a
``JaggedFeatures``/``Batch`` (the data path) or of numpy ids per feature.

Example::

    reo = build_reorder("data/train", tables, hot_ratio=0.01)      # shard directory
    reo.save("runs/x/reorder")
    batch = reo.apply(batch)                                         # in the data path
"""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.device import HOST
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.io import atomic_save_npy, atomic_write_json, read_json
from embedscale.plan.forms import reordered_tables, with_reorder
from embedscale.plan.plan import Plan
from embedscale.specs import TableSpec, feature_to_table
from embedscale.data.loader import ShardLoader
from embedscale.data.profile import AccessProfile
from embedscale.data.shards import Manifest

REORDER_MANIFEST = "reorder.json"
FORMAT = "embedscale.reorder"
VERSION = 1
METHODS = ("leiden", "louvain")
_INT32_MAX = 2**31 - 1


@dataclass
class TableReordering:
    """One table's bijection: ``map[old] = new`` for every row, the features that read it, and facts."""

    name: str
    map: np.ndarray
    features: list[str]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.map.size)

    def inverse(self) -> np.ndarray:
        """``inv[new] = old``."""
        inv = np.empty_like(self.map)
        inv[self.map] = np.arange(self.map.size, dtype=self.map.dtype)
        return inv


def _check_bijection(m: np.ndarray, where: str) -> None:
    if m.ndim != 1 or m.dtype.kind not in "iu":
        raise FormatError(f"{where}: the map must be a 1-D integer array, got {m.dtype} of shape {m.shape}")
    n = m.size
    if n == 0:
        raise FormatError(f"{where}: empty map")
    lo, hi = int(m.min()), int(m.max())
    if lo < 0 or hi >= n:
        raise FormatError(f"{where}: new id {lo if lo < 0 else hi} is outside [0, {n})")
    seen = np.bincount(m, minlength=n)
    if not (seen == 1).all():
        dup = int(np.flatnonzero(seen > 1)[0])
        raise FormatError(f"{where}: not a bijection: new id {dup} is given to {int(seen[dup])} rows")


class Reordering:
    """Index bijections of some tables, applied by feature name.

    Args:
        tables: the per-table bijections.
        hot_ratio: the ``Hot_ratio`` they were built with (recorded).
        meta: anything else worth keeping (method, seed, batches, source).
    """

    def __init__(self, tables: Iterable[TableReordering], hot_ratio: float = 0.0, meta: dict | None = None):
        self.tables: dict[str, TableReordering] = {}
        self.feature_table: dict[str, str] = {}
        for t in tables:
            if t.name in self.tables:
                raise ConfigError(f"reordering: table {t.name!r} given twice")
            self.tables[t.name] = t
            for f in t.features:
                if f in self.feature_table:
                    raise ConfigError(f"reordering: feature {f!r} is read by tables {self.feature_table[f]!r} "
                                      f"and {t.name!r}")
                self.feature_table[f] = t.name
        self.hot_ratio = float(hot_ratio)
        self.meta = dict(meta or {})
        self._torch_maps: dict[tuple[str, str], torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Reordering(tables={list(self.tables)}, hot_ratio={self.hot_ratio})"

    def map(self, table: str) -> np.ndarray:
        """``map[old] = new`` of ``table``."""
        try:
            return self.tables[table].map
        except KeyError:
            raise ConfigError(f"reordering has no table {table!r}; tables: {list(self.tables)}") from None

    def summary(self) -> dict[str, Any]:
        return {"hot_ratio": self.hot_ratio, **self.meta,
                "tables": {n: {"num_rows": t.num_rows, "features": t.features, **t.info} for n, t in self.tables.items()}}

    # -- applying ------------------------------------------------------------------------------------
    def _torch_map(self, table: str, device: torch.device) -> torch.Tensor:
        key = (table, str(device))
        t = self._torch_maps.get(key)
        if t is None:
            t = torch.from_numpy(np.ascontiguousarray(self.tables[table].map)).to(device)
            self._torch_maps[key] = t
        return t

    def _map_numpy(self, feature: str, ids: np.ndarray) -> np.ndarray:
        t = self.tables[self.feature_table[feature]]
        ids = np.asarray(ids)
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= t.num_rows:
                raise InputError(f"reordering: feature {feature!r} (table {t.name!r}, {t.num_rows} rows): row id "
                                 f"{lo if lo < 0 else hi} is outside [0, {t.num_rows})")
        return t.map[ids].astype(np.int64, copy=False)

    def _map_tensor(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        table = self.feature_table[feature]
        n = self.tables[table].num_rows
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= n:
                raise InputError(f"reordering: feature {feature!r} (table {table!r}, {n} rows): row id "
                                 f"{lo if lo < 0 else hi} is outside [0, {n})")
        return self._torch_map(table, ids.device).index_select(0, ids).to(torch.int64)

    def apply(self, x):
        """Rename row ids of the reordered tables' features; other features pass unchanged.

        ``x`` is a ``JaggedFeatures``, a ``Batch`` (its sparse part), or ``{feature: ids}`` with numpy
        ids (or ``(values, lengths)`` tuples); returns the same kind. An id outside its table is an
        ``InputError`` naming feature, table and id.
        """
        if isinstance(x, Batch):
            return Batch(x.dense, self.apply(x.sparse), x.labels, x.global_size, x.weights)
        if isinstance(x, JaggedFeatures):
            pos = [i for i, k in enumerate(x.keys) if k in self.feature_table]
            if not pos:
                return x
            F_in, B = len(x.keys), x.batch_size
            lpk = x.lengths.view(F_in, B).sum(1).tolist()
            parts = list(torch.split(x.values, lpk))
            for i in pos:
                parts[i] = self._map_tensor(x.keys[i], parts[i])
            return JaggedFeatures(x.keys, torch.cat(parts) if parts else x.values, x.lengths, x.weights)
        if isinstance(x, Mapping):
            out = {}
            for k, v in x.items():
                if k not in self.feature_table:
                    out[k] = v
                elif isinstance(v, tuple):
                    out[k] = (self._map_numpy(k, v[0]), v[1])
                else:
                    out[k] = self._map_numpy(k, v)
            return out
        raise InputError(f"reordering.apply: expected JaggedFeatures, Batch or a dict of ids, got {type(x).__name__}")

    def permute_rows(self, table: str, weight):
        """Rows of an uncompressed table in the new id order: ``out[map[old]] = weight[old]``."""
        m = self.map(table)
        if weight.shape[0] != m.size:
            raise ConfigError(f"reordering: table {table!r} has {m.size} rows in the map, {weight.shape[0]} in the weight")
        if isinstance(weight, torch.Tensor):
            out = torch.empty_like(weight)
            out[torch.from_numpy(m.astype(np.int64)).to(weight.device)] = weight
            return out
        out = np.empty_like(weight)
        out[m] = weight
        return out

    # -- files ------------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """``directory/table-NNN.npy`` per table plus ``directory/reorder.json`` (written last, atomically)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        entries = []
        for i, t in enumerate(self.tables.values()):
            file = f"table-{i:03d}.npy"
            dtype = np.int32 if t.num_rows <= _INT32_MAX else np.int64
            atomic_save_npy(d / file, t.map.astype(dtype, copy=False))
            entries.append({"name": t.name, "file": file, "num_rows": t.num_rows, "features": t.features,
                            "info": t.info})
        atomic_write_json(d / REORDER_MANIFEST, {"format": FORMAT, "version": VERSION, "hot_ratio": self.hot_ratio,
                                                 "meta": self.meta, "tables": entries})
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Reordering":
        """Read a saved reordering; every map must be a bijection of its table's rows."""
        d = Path(directory)
        path = d / REORDER_MANIFEST
        j = read_json(path, "reordering manifest")
        if not isinstance(j, dict) or j.get("format") != FORMAT:
            raise FormatError(f"{path}: not an embedscale reordering (format={j.get('format') if isinstance(j, dict) else None!r})")
        if j.get("version") != VERSION:
            raise FormatError(f"{path}: reordering version {j.get('version')} is not {VERSION}")
        tables = []
        for e in j.get("tables", []):
            try:
                name, file, n, features = e["name"], e["file"], int(e["num_rows"]), list(e["features"])
            except (KeyError, TypeError, ValueError):
                raise FormatError(f"{path}: malformed table entry {e!r}") from None
            f = d / file
            if not f.exists():
                raise FormatError(f"{path}: map {file} of table {name!r} is listed but missing")
            try:
                m = np.load(f, allow_pickle=False)
            except ValueError as ex:
                raise FormatError(f"{f}: not a readable .npy map ({ex})") from None
            if m.shape != (n,):
                raise FormatError(f"{f}: table {name!r} map has shape {m.shape}, the manifest says {n} rows")
            _check_bijection(m, f"{f} (table {name!r})")
            tables.append(TableReordering(name, m, features, dict(e.get("info", {}))))
        return cls(tables, float(j.get("hot_ratio", 0.0)), j.get("meta", {}))


# --------------------------------------------------------------------------------------------------
# building


def _batch_edges(ranks: np.ndarray, max_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Edges among the distinct non-hot rows of one batch (Algorithm 2, lines 5-6)."""
    k = ranks.size
    if k < 2:
        return ranks[:0], ranks[:0]
    if k * (k - 1) // 2 <= max_pairs:
        i, j = np.triu_indices(k, 1)
        return ranks[i], ranks[j]
    deg = max(1, max_pairs // k)
    i = np.repeat(np.arange(k), deg)
    j = rng.integers(0, k - 1, i.size)
    j += j >= i  # never a self loop
    return ranks[i], ranks[j]


def _communities(num_vertices: int, src: np.ndarray, dst: np.ndarray, weights: np.ndarray, method: str,
                 resolution: float, seed: int) -> tuple[np.ndarray, float]:
    import igraph as ig

    g = ig.Graph(n=num_vertices, edges=list(zip(src.tolist(), dst.tolist())))
    g.es["weight"] = weights.astype(np.float64).tolist()
    previous = random.getstate()
    ig.set_random_number_generator(random.Random(seed))
    try:
        if method == "leiden":
            part = g.community_leiden(objective_function="modularity", weights="weight", resolution=resolution,
                                      n_iterations=2)
        else:
            part = g.community_multilevel(weights="weight", resolution=resolution)
    finally:
        ig.set_random_number_generator(random)
        random.setstate(previous)
    return np.asarray(part.membership, dtype=np.int64), float(g.modularity(part.membership, weights="weight"))


def _table_map(counts: np.ndarray, order: np.ndarray, batch_ids: list[np.ndarray], hot_ratio: float,
               max_pairs: int, method: str, resolution: float, seed: int) -> tuple[np.ndarray, dict]:
    """One table's bijection from its counts (global) and its ids per sampled batch (local)."""
    n = counts.size
    H = min(n, int(math.floor(n * hot_ratio)))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n, dtype=np.int64)  # frequency-ordered id of every row
    rng = np.random.default_rng(seed)
    us, vs = [], []
    for ids in batch_ids:
        r = np.unique(rank[ids])
        r = r[r >= H]  # Algorithm 2, line 4: only non-hot rows go into the graph
        u, v = _batch_edges(r, max_pairs, rng)
        us.append(u)
        vs.append(v)
    info: dict[str, Any] = {"hot_rows": H, "batches": len(batch_ids)}
    u = np.concatenate(us) if us else np.zeros(0, np.int64)
    v = np.concatenate(vs) if vs else np.zeros(0, np.int64)
    communities = np.zeros(0, np.int64)
    verts = np.zeros(0, np.int64)
    if u.size:
        key, w = np.unique(np.minimum(u, v) * n + np.maximum(u, v), return_counts=True)
        lo, hi = key // n, key % n
        verts, local = np.unique(np.concatenate([lo, hi]), return_inverse=True)
        E = key.size
        communities, q = _communities(verts.size, local[:E], local[E:], w, method, resolution, seed)
        info.update({"graph_vertices": int(verts.size), "graph_edges": int(E),
                     "communities": int(communities.max()) + 1, "modularity": q})
    else:
        info.update({"graph_vertices": 0, "graph_edges": 0, "communities": 0, "modularity": 0.0})
    # new order of frequency-ordered ids: hot, then communities (by total count, members by frequency),
    # then everything else by frequency
    if verts.size:
        cnt = counts[order[verts]].astype(np.float64)
        total = np.bincount(communities, weights=cnt)
        first = np.full(total.size, np.iinfo(np.int64).max)
        np.minimum.at(first, communities, verts)
        comm_rank = np.empty(total.size, dtype=np.int64)
        comm_rank[np.lexsort((first, -total))] = np.arange(total.size)
        graph_part = verts[np.lexsort((verts, comm_rank[communities]))]
    else:
        graph_part = verts
    in_graph = np.zeros(n, dtype=bool)
    in_graph[verts] = True
    in_graph[:H] = True
    new_order = np.concatenate([np.arange(H, dtype=np.int64), graph_part, np.flatnonzero(~in_graph)])
    old_rows = order[new_order]
    m = np.empty(n, dtype=np.int64)
    m[old_rows] = np.arange(n, dtype=np.int64)
    return m, info


def _select(tables: list[TableSpec], names: list[str] | None) -> list[TableSpec]:
    if names is not None:
        by = {t.name: t for t in tables}
        unknown = [n for n in names if n not in by]
        if unknown:
            raise ConfigError(f"build_reorder: unknown table(s) {unknown}; tables: {list(by)}")
        return [by[n] for n in names]
    return list(tables)


def _iter_shard_batches(directory: Path, features: list[str], batch_size: int, max_batches: int):
    loader = ShardLoader(directory, batch_size, prefetch=0)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        yield {k: v for k, v in _per_key_numpy(batch.sparse).items() if k in features}


def _per_key_numpy(jf: JaggedFeatures) -> dict[str, np.ndarray]:
    lpk = jf.length_per_key().tolist()
    return {k: v.to(HOST).numpy() for k, v in zip(jf.keys, torch.split(jf.values, lpk))}


def _profile_of(source, tables: list[TableSpec] | None, progress: bool):
    """``build_reorder``'s source as (access profile, tables, shard directory or None): a profile as given, or
    a shard directory's counts (features of no given table counted on their own, not reordered)."""
    directory = None
    if isinstance(source, AccessProfile):
        profile = source
        if tables is None:
            tables = [TableSpec(t, profile.num_rows(t)) for t in profile.table_names]
    elif isinstance(source, (str, os.PathLike)):
        directory = Path(source)
        manifest = Manifest.load(directory)
        if tables is None:
            tables = [TableSpec(s.name, s.num_rows) for s in manifest.sparse]
        ftt = feature_to_table(tables)
        data_features = manifest.sparse_names
        mapping = {f: tables[ftt[f]].name for f in data_features if f in ftt}
        missing = [f for f in data_features if f not in ftt]
        for f in missing:  # features of no given table are counted on their own and not reordered
            mapping[f] = f"__unused__{f}"
        rows = {t.name: t.num_rows for t in tables}
        for info in manifest.sparse:
            if info.name in ftt and info.num_rows > rows[mapping[info.name]]:
                raise ConfigError(f"{directory}: feature {info.name!r} has {info.num_rows} rows, table "
                                  f"{mapping[info.name]!r} only {rows[mapping[info.name]]}")
        for f in missing:
            rows[mapping[f]] = next(s.num_rows for s in manifest.sparse if s.name == f)
        profile = AccessProfile.from_shards(directory, feature_to_table=mapping, num_rows=rows, progress=progress)
    else:
        raise ConfigError(f"build_reorder: source must be a shard directory or an AccessProfile, got "
                          f"{type(source).__name__}")
    return profile, tables, directory


def _check_profile_covers(chosen: list[TableSpec], profile) -> None:
    """Every table to reorder is in the profile, with its rows."""
    for t in chosen:
        if t.name not in profile.table_names:
            raise ConfigError(f"build_reorder: the access profile has no table {t.name!r}; tables: {profile.table_names}")
        if profile.num_rows(t.name) != t.num_rows:
            raise ConfigError(f"build_reorder: table {t.name!r} has {t.num_rows} rows, its profile "
                              f"{profile.num_rows(t.name)}")


def _batch_ids_by_table(b, features: dict[str, str], profile) -> dict[str, list[np.ndarray]]:
    """One batch's ids (``JaggedFeatures`` or ``{feature: ids}``) of the features to reorder, by table, each
    checked against its table's rows."""
    ids = _per_key_numpy(b) if isinstance(b, JaggedFeatures) else b
    grouped: dict[str, list[np.ndarray]] = {}
    for f, v in ids.items():
        if f in features:
            v = np.asarray(v[0] if isinstance(v, tuple) else v, dtype=np.int64)
            t = features[f]
            n = profile.num_rows(t)
            if v.size and (v.min() < 0 or v.max() >= n):
                bad = v[(v < 0) | (v >= n)][0]
                raise InputError(f"build_reorder: feature {f!r} (table {t!r}, {n} rows): row id {bad} is "
                                 f"outside [0, {n})")
            grouped.setdefault(t, []).append(v)
    return grouped


def build_reorder(source, tables: list[TableSpec] | None = None, hot_ratio: float = 0.01, *,
                  names: list[str] | None = None, batches: Iterable | None = None, batch_size: int = 4096,
                  max_batches: int = 64, max_pairs_per_batch: int = 16_384, method: str = "leiden",
                  resolution: float = 1.0, seed: int = 0, progress: bool = True) -> Reordering:
    """Build the index bijections of EL-Rec section IV-C (see the module docstring).

    Args:
        source: a shard directory (counts from all its rows, batches from its first ``max_batches``
            global batches of ``batch_size`` rows) or an ``AccessProfile`` (counts; batches from
            ``batches``, else frequency order only).
        tables: the tables; default one per sparse feature of the shard directory (or profile table),
            named as the feature.
        hot_ratio: ``Hot_ratio`` of Algorithm 2: the top ``floor(num_rows * hot_ratio)`` rows by count
            keep the first ids and stay out of the graph.
        names: tables to reorder; default all of ``tables`` (EL-Rec reorders the TT tables: name them, the
            tables whose form is ``tt``).
        batches: with a profile, an iterable of ``JaggedFeatures`` or ``{feature: numpy ids}``.
        max_pairs_per_batch: above this many pairs a batch links each row to ``max_pairs_per_batch // k``
            random partners instead of all (module docstring, step 2).
        method: ``leiden`` (igraph's Leiden on modularity) or ``louvain`` (igraph's multilevel).
        resolution: modularity resolution (1 = the paper's ``Q``).
        seed: seeds the partner sampling and the community detection.
        progress: tqdm bar on stderr.
    """
    from tqdm import tqdm

    if not 0.0 <= hot_ratio <= 1.0:
        raise ConfigError(f"build_reorder: hot_ratio must be in [0, 1], got {hot_ratio}")
    if method not in METHODS:
        raise ConfigError(f"build_reorder: method {method!r} is not one of {METHODS}")
    if batch_size <= 0 or max_batches < 0 or max_pairs_per_batch < 1:
        raise ConfigError(f"build_reorder: batch_size {batch_size}, max_batches {max_batches} and "
                          f"max_pairs_per_batch {max_pairs_per_batch} must be positive")
    profile, tables, directory = _profile_of(source, tables, progress)
    chosen = _select(list(tables), names)
    _check_profile_covers(chosen, profile)
    features = {f: t.name for t in chosen for f in t.features}
    per_table: dict[str, list[np.ndarray]] = {t.name: [] for t in chosen}
    if directory is not None:
        it = _iter_shard_batches(directory, list(features), batch_size, max_batches)
    else:
        it = iter(batches or [])
    for b in tqdm(it, desc="reorder batches", disable=not progress, file=sys.stderr,
                  total=max_batches if directory is not None else None, leave=False):
        for t, vs in _batch_ids_by_table(b, features, profile).items():
            per_table[t].append(np.concatenate(vs))
    out = []
    for t in tqdm(chosen, desc="reorder tables", disable=not progress, file=sys.stderr, leave=False):
        counts = profile.counts(t.name)
        order = np.asarray(profile.sorted_rows(t.name), dtype=np.int64)
        m, info = _table_map(np.asarray(counts), order, per_table[t.name], hot_ratio, max_pairs_per_batch,
                             method, resolution, seed)
        out.append(TableReordering(t.name, m, list(t.features), info))
    meta = {"method": method, "resolution": resolution, "seed": seed, "batch_size": batch_size,
            "max_batches": max_batches, "max_pairs_per_batch": max_pairs_per_batch,
            "source": str(directory) if directory is not None else "profile"}
    return Reordering(out, hot_ratio, meta)


def reorder_shards(shards: str | os.PathLike, out_dir: str | os.PathLike, *, hot_ratio: float = 0.01,
                   tables: list[TableSpec] | None = None, names: list[str] | None = None, batch_size: int = 4096,
                   max_batches: int = 64, max_pairs_per_batch: int = 16_384, method: str = "leiden",
                   seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """``embedscale reorder SHARDS --out DIR``: build the bijections from a shard directory, save them under
    ``out_dir`` and return a JSON-able summary (per table: hot rows, graph size, communities, modularity)."""
    reo = build_reorder(shards, tables, hot_ratio, names=names, batch_size=batch_size, max_batches=max_batches,
                        max_pairs_per_batch=max_pairs_per_batch, method=method, seed=seed, progress=progress)
    path = reo.save(out_dir)
    return {"out_dir": str(path), **reo.summary()}




# --------------------------------------------------------------------------------------------------
# a plan's reordering: the TT tables whose form says ``reorder`` (EL-Rec section IV)

PLAN_REORDER_DIR = "reorder"


def plan_reordering(plan_dir: str | os.PathLike, forms: Mapping[str, Any], tables: list[TableSpec]) -> "Reordering | None":
    """The index reordering a saved plan carries for its TT tables (``<plan_dir>/reorder/``), checked against
    the tables whose form says ``reorder`` (``plan.forms.reordered_tables``): ``None`` when no form does. A
    plan whose forms ask for a reordering it does not carry, or one that misses a table or has another
    number of rows, is a ``FormatError`` naming the plan directory and the table."""
    names = reordered_tables(forms)
    if not names:
        return None
    d = Path(plan_dir) / PLAN_REORDER_DIR
    if not (d / REORDER_MANIFEST).exists():
        raise FormatError(f"{plan_dir}: the plan's TT tables {names} are reordered (EL-Rec IV) but "
                          f"{d / REORDER_MANIFEST} is missing; re-plan (embedscale plan ... --tt-reorder)")
    reo = Reordering.load(d)
    _check_covers(reo, names, tables, str(d))
    return reo


def _check_covers(reo: "Reordering", names: list[str], tables: list[TableSpec], where: str) -> None:
    by = {t.name: t for t in tables}
    missing = [n for n in names if n not in reo.tables]
    if missing:
        raise FormatError(f"{where}: no index reordering of table(s) {missing} (it has {sorted(reo.tables)})")
    for n in names:
        t = by.get(n)
        if t is not None and reo.tables[n].num_rows != t.num_rows:
            raise FormatError(f"{where}: the reordering of table {n!r} has {reo.tables[n].num_rows} rows, the table "
                              f"{t.num_rows}")
        if t is not None and list(reo.tables[n].features) != list(t.features):
            raise FormatError(f"{where}: the reordering of table {n!r} renames features {reo.tables[n].features}, "
                              f"the table reads {list(t.features)}")


def reorder_for_plan(plan_dir: str | os.PathLike, forms: Mapping[str, Any], tables: list[TableSpec], profile, *,
                     method: str, hot_ratio: float = 0.01, shards: str | os.PathLike | None = None,
                     batch_size: int = 4096, max_batches: int = 64, seed: int = 0, reuse: bool = True,
                     progress: bool = True) -> "Reordering | None":
    """Build and save (under ``<plan_dir>/reorder/``) the index reordering of the TT tables whose form says
    ``reorder`` (EL-Rec section IV, Algorithm 2): the plan carries it and training renames those tables' ids by
    it. Call it before ``Plan.save`` (whose ``plan.json`` is written last). ``None`` when no form asks.

    ``method`` (``model.tt_reorder``): ``frequency`` ranks rows by their counts in ``profile`` (by table) alone;
    ``leiden`` / ``louvain`` also place rows read together in the first ``max_batches`` batches of
    ``batch_size`` of the shard directory ``shards`` at consecutive ids (without ``shards``: a
    ``ConfigError``). A reordering already in ``<plan_dir>/reorder/`` that covers exactly these tables (the
    run's earlier plan: its checkpoints' TT cores were trained under it) is kept as it is (``reuse=False``:
    built again)."""
    names = reordered_tables(forms)
    d = Path(plan_dir) / PLAN_REORDER_DIR
    if not names:
        return None
    if reuse and (d / REORDER_MANIFEST).exists():
        try:
            old = Reordering.load(d)
            if sorted(old.tables) == sorted(names):
                _check_covers(old, names, tables, str(d))
                return old
        except (FormatError, ConfigError):
            pass  # not this plan's: built again below
    if method == "none":  # only row-group tables ask (their first ids must be their hot rows)
        method = "frequency"
    if method not in ("frequency", *METHODS):
        raise ConfigError(f"model.tt_reorder {method!r}: a TT table's reordering is built by frequency, "
                          f"{' or '.join(METHODS)}")
    by = {t.name: t for t in tables}
    chosen = [by[n] for n in names]
    batches: list = []
    if method != "frequency":
        if shards is None:
            raise ConfigError(f"model.tt_reorder {method}: community reordering needs the data's batches (a shard "
                              "directory); give the data, or use frequency (the access profile alone)")
        features = [f for t in chosen for f in t.features]
        batches = list(_iter_shard_batches(Path(shards), features, batch_size, max_batches))
    prof = _by_table_profile(profile, chosen)
    # a row-group table's hot rows (TableForm.hot_rows) must be the first ids, in frequency order: its hot
    # prefix (Algorithm 2's Hot_ratio) covers them
    ratios: dict[float, list[TableSpec]] = {}
    for t in chosen:
        h = int(getattr(forms[t.name], "hot_rows", 0))
        ratios.setdefault(max(hot_ratio, min(1.0, (h + 0.5) / t.num_rows)) if h else hot_ratio, []).append(t)
    parts = [build_reorder(prof, group, r, batches=batches, batch_size=batch_size, max_batches=max_batches,
                           method=method if method != "frequency" else "leiden", seed=seed, progress=progress)
             for r, group in ratios.items()]
    reo = Reordering([t for p in parts for t in p.tables.values()], hot_ratio, parts[0].meta)
    reo.meta["method"] = method
    if d.exists():  # an earlier plan's maps: replaced as a whole (the manifest last)
        (d / REORDER_MANIFEST).unlink(missing_ok=True)
        for f in d.glob("table-*.npy"):
            f.unlink()
    reo.save(d)
    return reo


def _by_table_profile(profile, tables: list[TableSpec]) -> AccessProfile:
    """``profile`` (anything with ``counts(table)`` and ``samples``) as an ``AccessProfile`` of ``tables``."""
    if isinstance(profile, AccessProfile) and all(t.name in profile.table_names for t in tables):
        return profile
    counts = {t.name: np.asarray(profile.counts(t.name), dtype=np.int64) for t in tables}
    s = getattr(profile, "samples", 0)
    return AccessProfile(counts, int(s() if callable(s) else s or 0))


def attach_to_plan(plan_dir: str | os.PathLike, tables: list[TableSpec], profile, *, method: str,
                   hot_ratio: float = 0.01, shards: str | os.PathLike | None = None,
                   progress: bool = True) -> "Reordering | None":
    """``embedscale plan --tt-reorder METHOD``: give the TT tables of the saved plan in ``plan_dir`` an index
    reordering (EL-Rec IV, :func:`reorder_for_plan`, built afresh), record it in the plan's forms (``reorder``)
    and ``meta["reordering"]``, and save the plan again (``plan.json`` last). ``None`` (the plan untouched) when
    the plan has no TT table or ``method`` is ``none``."""
    plan = Plan.load(plan_dir)
    forms = with_reorder(plan.forms, method)
    if not reordered_tables(forms):
        return None
    reo = reorder_for_plan(plan_dir, forms, tables, profile, method=method, hot_ratio=hot_ratio, shards=shards,
                           reuse=False, progress=progress)
    plan.meta["forms"] = {n: f.to_dict() for n, f in forms.items()}
    plan.meta["reordering"] = reordering_meta(reo)
    plan.save(plan_dir)
    return reo


def reordering_meta(reo: "Reordering") -> dict[str, Any]:
    """What a plan records of the reordering it carries (``Plan.meta["reordering"]``; the maps are in
    ``<plan>/reorder/``)."""
    return {"dir": PLAN_REORDER_DIR, "method": reo.meta.get("method"), "hot_ratio": reo.hot_ratio,
            "tables": sorted(reo.tables)}
