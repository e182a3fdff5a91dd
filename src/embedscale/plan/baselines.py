"""Baseline strategies of OPER section 6.4, as plans the same cost model and executor take.

* ``table_wise`` (TW, DLRM / HugeCTR): whole tables, dealt round-robin so every rank holds about the
  same number of tables.
* ``row_wise``: every table split into ``M`` equal contiguous row-id ranges, range ``r`` on rank ``r``.
* ``memory_greedy`` (MG): all tables laid end to end and cut into ``M`` pieces of equal memory.
* ``access_greedy`` (AG): rows from the most accessed down, each to the rank with the least lookup
  load so far. Row by row is a Python loop per row; we take the rows in the same order in chunks of at
  most ``granularity`` of the total access (a chunk is one row wherever a row alone is that hot), which
  is the row-by-row greedy up to that granularity, and ignores memory exactly as AG does.

None of them replicates; none of them looks at capacity (``Cost.fits_memory`` says whether it fits).
"""

from __future__ import annotations

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.cost import profile_samples
from embedscale.plan.partition import partition_tables, sort_tables
from embedscale.plan.place import balanced_model_parallel
from embedscale.plan.plan import Plan


def _meta(name: str, mode: str, batch_size: int, **kw) -> dict:
    return {"strategy": name, "mode": mode, "batch_size": int(batch_size), **kw}


def table_wise(tables, world_size: int, *, mode: str = "training", batch_size: int = 2048) -> Plan:
    """TW: table ``t`` on rank ``t mod M`` (OPER 6.4 item 3)."""
    t = len(tables)
    return Plan(tables, world_size, [None] * t, np.arange(t), np.zeros(t, dtype=np.int64),
                [s.num_rows for s in tables], np.arange(t) % world_size, meta=_meta("table_wise", mode, batch_size))


def row_wise(tables, world_size: int, *, mode: str = "training", batch_size: int = 2048) -> Plan:
    """Row-wise even split: ``M`` contiguous row-id ranges per table (ranges of tables smaller than
    ``M`` rows go to the first ranks)."""
    pt, ps, pe, po = [], [], [], []
    for i, s in enumerate(tables):
        n = int(s.num_rows)
        sizes = np.full(world_size, n // world_size, dtype=np.int64)
        sizes[: n % world_size] += 1
        ranks = np.flatnonzero(sizes)
        stops = np.cumsum(sizes)[ranks]
        starts = stops - sizes[ranks]
        pt.append(np.full(ranks.size, i))
        ps.append(starts)
        pe.append(stops)
        po.append(ranks)
    return Plan(tables, world_size, [None] * len(tables), np.concatenate(pt), np.concatenate(ps), np.concatenate(pe),
                np.concatenate(po), meta=_meta("row_wise", mode, batch_size))


def memory_greedy(tables, world_size: int, *, mode: str = "training", batch_size: int = 2048) -> Plan:
    """MG: the concatenation of all tables (by row id) cut into ``M`` pieces of equal bytes (OPER 6.4 item 1)."""
    rb = np.array([s.dim * s.bytes_per_value for s in tables], dtype=np.float64)
    n = np.array([s.num_rows for s in tables], dtype=np.int64)
    ends = np.cumsum(n * rb)
    total = float(ends[-1])
    piece = total * np.arange(world_size + 1) / world_size  # piece k holds bytes [piece[k], piece[k+1])
    pt, ps, pe, po = [], [], [], []
    for i in range(len(tables)):
        b0 = float(ends[i] - n[i] * rb[i])
        # first row of table i whose first byte falls in piece k or later
        first = np.clip(np.ceil((piece - b0) / rb[i]), 0, n[i]).astype(np.int64)
        first[-1] = n[i]
        first[0] = 0
        k = np.flatnonzero(first[1:] > first[:-1])
        pt.append(np.full(k.size, i))
        ps.append(first[k])
        pe.append(first[k + 1])
        po.append(k)
    return Plan(tables, world_size, [None] * len(tables), np.concatenate(pt), np.concatenate(ps), np.concatenate(pe),
                np.concatenate(po), meta=_meta("memory_greedy", mode, batch_size))


def access_greedy(tables, profile, world_size: int, *, mode: str = "training", batch_size: int = 2048,
                  granularity: float = 1e-4, sorted_tables=None) -> Plan:
    """AG: hottest rows first, each to the least-loaded rank (OPER 6.4 item 2); see module docstring."""
    st = sorted_tables if sorted_tables is not None else sort_tables(tables, profile)
    parts = partition_tables(st, granularity, memory_threshold=1.0)
    parts.access_bound[:] = True  # placed by lookup load only
    load = parts.counts[:, None] * np.ones((1, world_size))
    owner, _, _ = balanced_model_parallel(load, parts.nbytes, parts.access_bound, np.full(world_size, np.inf))
    return Plan(tables, world_size, [t.order for t in st], parts.table, parts.start, parts.stop, owner,
                meta=_meta("access_greedy", mode, batch_size, granularity=granularity,
                           samples=profile_samples(profile)), part_counts=parts.counts)


BASELINES = ("table_wise", "row_wise", "memory_greedy", "access_greedy")


def plan_baseline(name: str, tables, profile, world_size: int, *, mode: str, batch_size: int, **opts) -> Plan:
    if name == "table_wise":
        return table_wise(tables, world_size, mode=mode, batch_size=batch_size)
    if name == "row_wise":
        return row_wise(tables, world_size, mode=mode, batch_size=batch_size)
    if name == "memory_greedy":
        return memory_greedy(tables, world_size, mode=mode, batch_size=batch_size)
    if name == "access_greedy":
        return access_greedy(tables, profile, world_size, mode=mode, batch_size=batch_size, **opts)
    raise ConfigError(f"unknown baseline {name!r}; known: {BASELINES}")
