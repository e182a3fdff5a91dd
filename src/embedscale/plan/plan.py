"""``Plan``: the data contract between the planner and everything that runs (ARCHITECTURE.md).

A plan says, for every row of every table, which rank owns it and at which local offset, which ranks
hold a replica, and from which rank every rank fetches it. It is the OPER parallelization
``P = {P_1 .. P_N}`` of section 3.2 (``P_k[i][j] = 1`` when rank ``i`` fetches row ``k`` from rank
``j``), stored compactly:

* per table, a permutation ``rows_by_partition`` (row ids grouped by partition, e.g. by decreasing
  access count; ``None`` means the identity) and contiguous partitions ``[start, stop)`` of it;
* per partition: ``owner`` rank, ``holders`` (``[P, M]`` bool: owner plus replicas), ``fetch``
  (``[P, M]``: the rank every rank reads the partition from; itself when it holds a copy) and
  ``local_base`` (``[P, M]``: where the partition's rows start in a holder's flat storage, -1 elsewhere).

There is never a Python object per row. Every rank stores its rows in one flat storage laid out table
by table (in table order) and, within a table, partition by partition; ``rank_layout`` gives the
per-table segments for an executor that keeps one storage per table.

Files: a directory with ``plan.json`` (tables, metadata, array shapes), ``partitions.npz`` and
``rows_by_partition.npy``; nothing is pickled, everything is written atomically, ``plan.json`` last.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.io import atomic_open, atomic_write_json, read_json
from embedscale.plan.forms import SHARDED, TableForm

FORMAT = "embedscale.plan"
VERSION = 1
PLAN_JSON = "plan.json"
PARTS_NPZ = "partitions.npz"
ORDER_NPY = "rows_by_partition.npy"


class PlanError(FormatError):
    """A plan that breaks the contract: a row owned twice or never, a capacity exceeded, a bad fetch path."""


@dataclass(frozen=True)
class PlanTable:
    """What the plan needs to know about a table: rows and bytes per row."""

    name: str
    num_rows: int
    dim: int
    bytes_per_value: int = 4

    @property
    def row_bytes(self) -> int:
        return self.dim * self.bytes_per_value

    @classmethod
    def from_spec(cls, spec) -> "PlanTable":
        return cls(spec.name, int(spec.num_rows), int(spec.dim), int(getattr(spec, "bytes_per_value", 4)))


def _as_tables(tables: Iterable) -> list[PlanTable]:
    out = [t if isinstance(t, PlanTable) else PlanTable.from_spec(t) for t in tables]
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"plan: table names repeat: {dup}")
    return out


class Plan:
    """Row ownership, replicas and fetch paths for all tables on ``world_size`` ranks.

    Args:
        tables: ``TableSpec`` or ``PlanTable`` list (order fixes the per-rank storage layout).
        world_size: ranks.
        rows_by_partition: per table, the row ids grouped by partition (length ``num_rows``), or None
            for the identity.
        part_table, part_start, part_stop: per partition, its table and its range ``[start, stop)`` in
            that table's ``rows_by_partition``. Partitions are grouped by table, in table order.
        owner: per partition, the owning rank.
        holders: ``[P, M]`` bool, ranks that store the partition (owner included); default owner only.
        fetch: ``[P, M]`` int, the rank each rank reads the partition from; default: itself when a
            holder, else the owner.
        meta: strategy, mode, batch size, cost parameters, ... (JSON-safe).
        local_base: ``[P, M]`` offsets (default: the layout described in the module docstring).
        part_counts: optional per-partition access counts of the profile the plan was made from
            (saved with the plan; ``drift`` compares a new profile against them).

    Example:
        >>> from embedscale.specs import TableSpec
        >>> p = Plan([TableSpec("t", 4, dim=2)], 2, [np.array([3, 0, 1, 2])],
        ...          [0, 0], [0, 2], [2, 4], owner=[1, 0])
        >>> p.owner("t", np.array([0, 1, 3])).tolist()
        [1, 0, 1]
        >>> p.local_offset("t", np.array([3, 0, 1, 2])).tolist()
        [0, 1, 0, 1]
    """

    def __init__(
        self,
        tables: Iterable,
        world_size: int,
        rows_by_partition: list[np.ndarray | None],
        part_table,
        part_start,
        part_stop,
        owner,
        holders=None,
        fetch=None,
        meta: dict[str, Any] | None = None,
        local_base=None,
        part_counts=None,
    ) -> None:
        self.tables = _as_tables(tables)
        self.world_size = int(world_size)
        if self.world_size < 1:
            raise ConfigError(f"plan: world_size must be >= 1, got {world_size}")
        if len(rows_by_partition) != len(self.tables):
            raise ConfigError(f"plan: {len(rows_by_partition)} row permutations for {len(self.tables)} tables")
        self.rows_by_partition = [None if o is None else np.asarray(o) for o in rows_by_partition]
        self.part_table = np.asarray(part_table, dtype=np.int32)
        self.part_start = np.asarray(part_start, dtype=np.int64)
        self.part_stop = np.asarray(part_stop, dtype=np.int64)
        self.owner_of_part = np.asarray(owner, dtype=np.int32)
        p, m = self.part_table.size, self.world_size
        for name, a in (("part_start", self.part_start), ("part_stop", self.part_stop), ("owner", self.owner_of_part)):
            if a.shape != (p,):
                raise PlanError(f"plan: {name} has shape {a.shape}, expected ({p},)")
        if holders is None:
            holders = np.zeros((p, m), dtype=bool)
            ok = (self.owner_of_part >= 0) & (self.owner_of_part < m)
            holders[np.flatnonzero(ok), self.owner_of_part[ok]] = True
        self.holders = np.asarray(holders, dtype=bool)
        if fetch is None:
            fetch = np.where(self.holders, np.arange(m, dtype=np.int32)[None, :], self.owner_of_part[:, None])
        self.fetch = np.asarray(fetch, dtype=np.int32)
        for name, a in (("holders", self.holders), ("fetch", self.fetch)):
            if a.shape != (p, m):
                raise PlanError(f"plan: {name} has shape {a.shape}, expected ({p}, {m})")
        self.meta: dict[str, Any] = dict(meta or {})
        self.local_base = self._layout() if local_base is None else np.asarray(local_base, dtype=np.int64)
        if self.local_base.shape != (p, m):
            raise PlanError(f"plan: local_base has shape {self.local_base.shape}, expected ({p}, {m})")
        self._bounds = np.searchsorted(self.part_table, np.arange(len(self.tables) + 1), side="left")
        self._inverse: dict[int, np.ndarray] = {}
        self.part_counts = None if part_counts is None else np.asarray(part_counts, dtype=np.float64)
        if self.part_counts is not None and self.part_counts.shape != (p,):
            raise PlanError(f"plan: part_counts has shape {self.part_counts.shape}, expected ({p},)")

    # ------------------------------------------------------------------ basic facts

    @property
    def num_partitions(self) -> int:
        return int(self.part_table.size)

    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def forms(self) -> dict[str, TableForm]:
        """Every table's form (``plan.forms``): the tables this plan places are ``sharded``; the others (TT,
        host) as ``meta["forms"]`` records them (``plan.api.make_plan``). A plan saved before plans recorded
        forms: its TT tables from ``meta["replicated_tables"]``."""
        out = {n: SHARDED for n in self.table_names}
        if "forms" in self.meta:
            for n, d in self.meta["forms"].items():
                out[n] = TableForm.from_dict(d, f"plan forms[{n!r}]")
        else:
            for m in self.meta.get("replicated_tables", []):
                out[m["name"]] = TableForm("tt", tt_rank=int(m["tt_rank"]))
        bad = sorted(n for n in self.table_names if out[n].kind != "sharded")
        if bad:
            raise PlanError(f"plan: tables {bad} have rows placed but forms {[out[n].kind for n in bad]} (not sharded)")
        return out

    @property
    def part_rows(self) -> np.ndarray:
        return self.part_stop - self.part_start

    @property
    def part_bytes(self) -> np.ndarray:
        rb = np.array([t.row_bytes for t in self.tables], dtype=np.int64)
        return self.part_rows * rb[self.part_table]

    def table_index(self, table: str | int) -> int:
        if isinstance(table, (int, np.integer)):
            if not 0 <= int(table) < len(self.tables):
                raise ConfigError(f"plan: table index {table} out of range [0, {len(self.tables)})")
            return int(table)
        for i, t in enumerate(self.tables):
            if t.name == table:
                return i
        raise ConfigError(f"plan has no table {table!r}; it has {self.table_names}")

    def table_partitions(self, table: str | int) -> slice:
        t = self.table_index(table)
        return slice(int(self._bounds[t]), int(self._bounds[t + 1]))

    def order(self, table: str | int) -> np.ndarray:
        """``rows_by_partition`` of a table (materialises the identity)."""
        t = self.table_index(table)
        o = self.rows_by_partition[t]
        return np.arange(self.tables[t].num_rows, dtype=np.int64) if o is None else o

    def rows_per_rank(self) -> np.ndarray:
        """Rows stored per rank (owned plus replicas)."""
        return (self.holders * self.part_rows[:, None]).sum(axis=0).astype(np.int64)

    def memory_per_rank(self) -> np.ndarray:
        """Bytes stored per rank, OPER eq. (1) over the holder sets."""
        return (self.holders * self.part_bytes[:, None]).sum(axis=0).astype(np.int64)

    # ------------------------------------------------------------------ layout

    def _layout(self) -> np.ndarray:
        rows = self.part_stop - self.part_start
        base = np.full(self.holders.shape, -1, dtype=np.int64)
        for j in range(self.world_size):
            held = self.holders[:, j]
            sizes = np.where(held, rows, 0)
            start = np.cumsum(sizes) - sizes
            base[:, j] = np.where(held, start, -1)
        return base

    def rank_layout(self, rank: int) -> list[dict[str, int]]:
        """Per table, the segment ``[start, start + count)`` of ``rank``'s flat storage it occupies."""
        self._check_rank(rank)
        out = []
        for t, tab in enumerate(self.tables):
            sl = self.table_partitions(t)
            held = self.holders[sl, rank]
            count = int(self.part_rows[sl][held].sum())
            start = int(self.local_base[sl, rank][held].min()) if count else int(
                (self.holders[: sl.start, rank] * self.part_rows[: sl.start]).sum()
            )
            out.append({"table": tab.name, "start": start, "count": count})
        return out

    # ------------------------------------------------------------------ vectorised queries

    def _check_rank(self, rank: int) -> None:
        if not 0 <= int(rank) < self.world_size:
            raise ConfigError(f"plan: rank {rank} out of range [0, {self.world_size})")

    def _positions(self, t: int, rows) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        n = self.tables[t].num_rows
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            bad = rows[(rows < 0) | (rows >= n)][0]
            raise InputError(f"table {self.tables[t].name!r}: row {bad} outside [0, {n})")
        o = self.rows_by_partition[t]
        if o is None:
            return rows
        inv = self._inverse.get(t)
        if inv is None:
            inv = np.empty(n, dtype=np.int64 if n >= 2**31 else np.int32)
            inv[o] = np.arange(n, dtype=inv.dtype)
            self._inverse[t] = inv
        return inv[rows].astype(np.int64)

    def _parts(self, table, rows) -> tuple[int, np.ndarray, np.ndarray]:
        t = self.table_index(table)
        pos = self._positions(t, rows)
        lo, hi = int(self._bounds[t]), int(self._bounds[t + 1])
        part = lo + np.searchsorted(self.part_start[lo:hi], pos, side="right") - 1
        return t, pos, part

    def partition_of(self, table, rows) -> np.ndarray:
        """Global partition index of each row."""
        return self._parts(table, rows)[2]

    def owner(self, table, rows) -> np.ndarray:
        """Owning rank of each row (int32)."""
        return self.owner_of_part[self._parts(table, rows)[2]]

    def local_offset(self, table, rows, rank: int | None = None) -> np.ndarray:
        """Offset of each row in a rank's flat storage: the owner's (``rank=None``) or ``rank``'s (-1 where
        ``rank`` holds no copy)."""
        _, pos, part = self._parts(table, rows)
        if rank is None:
            base = self.local_base[part, self.owner_of_part[part]]
        else:
            self._check_rank(rank)
            base = self.local_base[part, rank]
        return np.where(base >= 0, base + pos - self.part_start[part], -1)

    def replicas(self, table, rows) -> np.ndarray:
        """``[len(rows), M]`` bool: ranks holding a replica (not the owner) of each row."""
        part = self._parts(table, rows)[2]
        h = self.holders[part].copy()
        h[np.arange(part.size), self.owner_of_part[part]] = False
        return h

    def fetch_rank(self, table, rows, rank: int) -> np.ndarray:
        """The rank ``rank`` reads each row from (``rank`` itself when it holds a copy)."""
        self._check_rank(rank)
        return self.fetch[self._parts(table, rows)[2], rank]

    def address(self, table, rows, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source rank, offset in that rank's storage)`` for each row, as read by ``rank``."""
        self._check_rank(rank)
        _, pos, part = self._parts(table, rows)
        src = self.fetch[part, rank]
        return src, self.local_base[part, src] + pos - self.part_start[part]

    def address_map(self, table, rank: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Dense ``global row -> (rank, local offset)`` for a whole table, built in O(rows) numpy.

        With ``rank=None`` the owner map; with a rank, the map that rank reads through (its fetch paths).
        Returns ``(ranks int32[num_rows], offsets int64[num_rows])``.
        """
        t = self.table_index(table)
        sl = self.table_partitions(t)
        n = self.tables[t].num_rows
        lens = self.part_rows[sl]
        if rank is None:
            src = self.owner_of_part[sl]
        else:
            self._check_rank(rank)
            src = self.fetch[sl, rank]
        base = self.local_base[np.arange(sl.start, sl.stop), src]
        within = np.arange(n, dtype=np.int64) - np.repeat(self.part_start[sl], lens)
        offs = np.repeat(base, lens) + within
        ranks = np.repeat(src.astype(np.int32), lens)
        o = self.rows_by_partition[t]
        if o is None:
            return ranks, offs
        out_r = np.empty(n, dtype=np.int32)
        out_o = np.empty(n, dtype=np.int64)
        out_r[o] = ranks
        out_o[o] = offs
        return out_r, out_o

    def rows_on_rank(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every row ``rank`` stores (owned and replicated): ``(table ids, rows, local offsets)`` by offset."""
        self._check_rank(rank)
        held = np.flatnonzero(self.holders[:, rank])
        lens = self.part_rows[held]
        total = int(lens.sum())
        tabs = np.repeat(self.part_table[held], lens)
        offs = np.repeat(self.local_base[held, rank], lens) + (
            np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        )
        rows = np.empty(total, dtype=np.int64)
        at = 0
        for t in range(len(self.tables)):
            sl = self.table_partitions(t)
            mine = held[(held >= sl.start) & (held < sl.stop)]
            if mine.size == 0:
                continue
            o = self.order(t)
            for p in _runs(mine):
                a, b = int(self.part_start[p[0]]), int(self.part_stop[p[-1]])
                rows[at : at + b - a] = o[a:b]
                at += b - a
        idx = np.argsort(offs, kind="stable")
        return tabs[idx].astype(np.int32), rows[idx], offs[idx]

    # ------------------------------------------------------------------ derived plans

    def with_replicas(self, holders: np.ndarray, fetch: np.ndarray | None = None, meta: dict | None = None) -> "Plan":
        """The same partitions and owners with other holder sets (and fetch paths)."""
        return Plan(self.tables, self.world_size, self.rows_by_partition, self.part_table, self.part_start,
                    self.part_stop, self.owner_of_part, holders, fetch, meta if meta is not None else dict(self.meta),
                    part_counts=self.part_counts)

    def repoint_to_cheapest(self, cost_matrix: np.ndarray) -> None:
        """Point every non-holder's fetch at its cheapest holder (ties: the current one, then the owner)."""
        m = self.world_size
        big = np.where(self.holders[:, None, :], cost_matrix[None, :, :], np.inf)  # [P, i, j]
        cur = np.take_along_axis(big, self.fetch[:, :, None], axis=2)[:, :, 0]
        best = np.argmin(big, axis=2).astype(np.int32)
        bestc = np.take_along_axis(big, best[:, :, None], axis=2)[:, :, 0]
        keep = (cur <= bestc) & np.take_along_axis(self.holders, self.fetch, axis=1)
        fetch = np.where(keep, self.fetch, best)
        fetch = np.where(self.holders, np.arange(m, dtype=np.int32)[None, :], fetch)
        self.fetch = fetch.astype(np.int32)

    # ------------------------------------------------------------------ validation

    def validate(self, capacity_bytes: int | np.ndarray | None = None, check_rows: bool = True) -> None:
        """Raise ``PlanError`` naming table, row range, rank and value for anything broken.

        Checks: partitions tile every table exactly; ``rows_by_partition`` is a permutation (every row
        owned exactly once); owners, holders and fetch paths are consistent; local offsets do not overlap
        and fill each rank's storage; memory per rank within ``capacity_bytes`` (default: the plan's
        ``meta["capacity_bytes"]`` if any).
        """
        m, p = self.world_size, self.num_partitions
        if p and (np.any(np.diff(self.part_table) < 0) or self.part_table.min() < 0 or self.part_table.max() >= len(self.tables)):
            raise PlanError("plan: partitions must be grouped by table in table order with valid table ids")
        for t, tab in enumerate(self.tables):
            self._check_tiling(t, tab)
            if self.rows_by_partition[t] is not None and check_rows:
                self._check_row_order(t, tab)
        self._check_owners_and_fetch()
        self._check_local_offsets()
        cap = capacity_bytes if capacity_bytes is not None else self.meta.get("capacity_bytes")
        if cap is not None:
            capv = np.broadcast_to(np.asarray(cap, dtype=np.float64), (m,))
            mem = self.memory_per_rank()
            over = np.flatnonzero((capv > 0) & (mem > capv))
            if over.size:
                j = int(over[0])
                raise PlanError(f"rank {j}: stores {int(mem[j])} bytes, over its capacity of {int(capv[j])} bytes "
                                f"by {int(mem[j] - capv[j])} (ranks over capacity: {over.tolist()})")

    def _check_tiling(self, t: int, tab) -> None:
        """Table ``t``'s partitions tile its sorted positions ``[0, num_rows)``: no gap, no overlap, none empty."""
        sl = self.table_partitions(t)
        st, sp = self.part_start[sl], self.part_stop[sl]
        if st.size == 0:
            raise PlanError(f"table {tab.name!r}: no partitions, rows [0, {tab.num_rows}) are owned by no rank")
        if st[0] != 0:
            raise PlanError(f"table {tab.name!r}: rows at positions [0, {st[0]}) belong to no partition")
        bad = np.flatnonzero(sp <= st)
        if bad.size:
            k = sl.start + int(bad[0])
            raise PlanError(f"table {tab.name!r}: partition {k} has empty or negative range [{self.part_start[k]}, {self.part_stop[k]})")
        gap = np.flatnonzero(st[1:] != sp[:-1])
        if gap.size:
            k = sl.start + int(gap[0])
            what = "overlap" if st[gap[0] + 1] < sp[gap[0]] else "leave a gap between"
            raise PlanError(
                f"table {tab.name!r}: partitions {k} [{self.part_start[k]}, {self.part_stop[k]}) and {k + 1} "
                f"[{self.part_start[k + 1]}, {self.part_stop[k + 1]}) {what} them (rows owned twice or by no rank)"
            )
        if sp[-1] != tab.num_rows:
            raise PlanError(f"table {tab.name!r}: partitions end at {sp[-1]} but the table has {tab.num_rows} rows")

    def _check_row_order(self, t: int, tab) -> None:
        """Table ``t``'s ``rows_by_partition`` is a permutation of its rows: every row owned exactly once."""
        o = self.rows_by_partition[t]
        sl = self.table_partitions(t)
        st = self.part_start[sl]
        if o.shape != (tab.num_rows,):
            raise PlanError(f"table {tab.name!r}: rows_by_partition has {o.size} entries for {tab.num_rows} rows")
        if o.dtype.kind not in "iu":
            raise PlanError(f"table {tab.name!r}: rows_by_partition must be integers, got {o.dtype}")
        if o.size and (o.min() < 0 or o.max() >= tab.num_rows):
            i = int(np.flatnonzero((o < 0) | (o >= tab.num_rows))[0])
            raise PlanError(f"table {tab.name!r}: rows_by_partition[{i}] = {o[i]} is outside [0, {tab.num_rows})")
        seen = np.bincount(o, minlength=tab.num_rows)
        if np.any(seen != 1):
            twice = np.flatnonzero(seen > 1)
            never = np.flatnonzero(seen == 0)
            row = int(twice[0]) if twice.size else int(never[0])
            pos = np.flatnonzero(o == row)
            parts = [sl.start + int(np.searchsorted(st, q, side="right") - 1) for q in pos]
            if twice.size:
                raise PlanError(f"table {tab.name!r}: row {row} is owned {int(seen[row])} times (partitions {parts}); "
                                f"{twice.size} rows owned more than once, {never.size} never")
            raise PlanError(f"table {tab.name!r}: row {row} is owned by no partition; {never.size} rows never owned")

    def _check_owners_and_fetch(self) -> None:
        """Owners are ranks among the holders; every rank fetches from a holder, a holder from itself."""
        m, p = self.world_size, self.num_partitions
        ow = self.owner_of_part
        bad = np.flatnonzero((ow < 0) | (ow >= m))
        if bad.size:
            k = int(bad[0])
            raise PlanError(f"{self._where(k)}: owner rank {ow[k]} is outside [0, {m})")
        nh = np.flatnonzero(~self.holders[np.arange(p), ow])
        if nh.size:
            k = int(nh[0])
            raise PlanError(f"{self._where(k)}: owner rank {ow[k]} is not among its holders")
        f = self.fetch
        bad = np.argwhere((f < 0) | (f >= m))
        if bad.size:
            k, i = (int(x) for x in bad[0])
            raise PlanError(f"{self._where(k)}: rank {i} fetches from rank {f[k, i]}, outside [0, {m})")
        fh = np.take_along_axis(self.holders, f.astype(np.int64), axis=1)
        bad = np.argwhere(~fh)
        if bad.size:
            k, i = (int(x) for x in bad[0])
            raise PlanError(f"{self._where(k)}: rank {i} fetches from rank {f[k, i]}, which holds no copy")
        bad = np.argwhere(self.holders & (f != np.arange(m)[None, :]))
        if bad.size:
            k, i = (int(x) for x in bad[0])
            raise PlanError(f"{self._where(k)}: rank {i} holds a copy but fetches from rank {f[k, i]}")

    def _check_local_offsets(self) -> None:
        """Every holder, and only a holder, has a local offset; a rank's offsets fill its storage from 0 without
        overlap or hole."""
        lb = self.local_base
        bad = np.argwhere(self.holders != (lb >= 0))
        if bad.size:
            k, j = (int(x) for x in bad[0])
            raise PlanError(f"{self._where(k)}: local offset {lb[k, j]} on rank {j} disagrees with holding={bool(self.holders[k, j])}")
        rows = self.part_rows
        for j in range(self.world_size):
            held = np.flatnonzero(self.holders[:, j])
            b = lb[held, j]
            idx = np.argsort(b, kind="stable")
            b, e, hk = b[idx], b[idx] + rows[held][idx], held[idx]
            if b.size and b[0] != 0:
                raise PlanError(f"rank {j}: local storage starts at offset {b[0]}, not 0")
            clash = np.flatnonzero(b[1:] != e[:-1])
            if clash.size:
                c = int(clash[0])
                raise PlanError(f"rank {j}: {self._where(int(hk[c]))} at offsets [{b[c]}, {e[c]}) and "
                                f"{self._where(int(hk[c + 1]))} at [{b[c + 1]}, {e[c + 1]}) overlap or leave a hole")

    def _where(self, k: int) -> str:
        t = self.tables[int(self.part_table[k])]
        return f"table {t.name!r} partition {k} (rows at positions [{self.part_start[k]}, {self.part_stop[k]}))"

    # ------------------------------------------------------------------ files

    def save(self, path: str | Path) -> Path:
        """Write the plan directory (arrays first, ``plan.json`` last, each atomically)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        stored = [o for o in self.rows_by_partition if o is not None]
        big = any(t.num_rows >= 2**31 for t in self.tables)
        odt = np.int64 if big else np.int32
        offsets, at = [], 0
        for o in self.rows_by_partition:
            offsets.append(None if o is None else at)
            at += 0 if o is None else int(o.size)
        with atomic_open(path / ORDER_NPY, "wb") as f:
            _write_npy_concat(f, stored, odt, at)
        arrays = {
            "part_table": self.part_table, "part_start": self.part_start, "part_stop": self.part_stop,
            "owner": self.owner_of_part, "holders": self.holders, "fetch": self.fetch, "local_base": self.local_base,
        }
        if self.part_counts is not None:
            arrays["part_counts"] = self.part_counts
        with atomic_open(path / PARTS_NPZ, "wb") as f:
            np.savez(f, **arrays)
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "tables": [
                {"name": t.name, "num_rows": t.num_rows, "dim": t.dim, "bytes_per_value": t.bytes_per_value,
                 "order_offset": off}
                for t, off in zip(self.tables, offsets)
            ],
            "num_partitions": self.num_partitions,
            "order_dtype": np.dtype(odt).name,
            "order_length": at,
            "meta": _json_safe(self.meta),
        }
        atomic_write_json(path / PLAN_JSON, doc)
        return path

    @classmethod
    def load(cls, path: str | Path, mmap: bool = False, validate: bool = True) -> "Plan":
        """Read a plan directory; ``FormatError`` names the file and what is wrong with it."""
        path = Path(path)
        doc = read_json(path / PLAN_JSON, "plan")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise FormatError(f"{path / PLAN_JSON}: not an embedscale plan (format {doc.get('format') if isinstance(doc, dict) else None!r})")
        if doc.get("version") != VERSION:
            raise FormatError(f"{path / PLAN_JSON}: plan version {doc.get('version')} is not {VERSION}")
        try:
            tables = [PlanTable(d["name"], int(d["num_rows"]), int(d["dim"]), int(d.get("bytes_per_value", 4))) for d in doc["tables"]]
            m = int(doc["world_size"])
            nparts = int(doc["num_partitions"])
            olen = int(doc["order_length"])
            odt = np.dtype(doc["order_dtype"])
            offs = [d.get("order_offset") for d in doc["tables"]]
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{path / PLAN_JSON}: missing or bad field ({e})") from None
        for name in (ORDER_NPY, PARTS_NPZ):
            if not (path / name).exists():
                raise FormatError(f"plan file not found: {path / name}")
        try:
            order = np.load(path / ORDER_NPY, allow_pickle=False, mmap_mode="r" if mmap else None)
        except (ValueError, OSError, EOFError) as e:
            raise FormatError(f"{path / ORDER_NPY}: plan array unreadable ({e})") from None
        try:
            with np.load(path / PARTS_NPZ, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # a truncated .npz: BadZipFile
            raise FormatError(f"{path / PARTS_NPZ}: plan arrays unreadable ({type(e).__name__}: {e})") from None
        if order.shape != (olen,) or order.dtype != odt:
            raise FormatError(f"{path / ORDER_NPY}: shape {order.shape} dtype {order.dtype}, plan.json says ({olen},) {odt}")
        need = {"part_table": (nparts,), "part_start": (nparts,), "part_stop": (nparts,), "owner": (nparts,),
                "holders": (nparts, m), "fetch": (nparts, m), "local_base": (nparts, m)}
        for k, shp in need.items():
            if k not in arrays:
                raise FormatError(f"{path / PARTS_NPZ}: array {k!r} missing")
            if arrays[k].shape != shp:
                raise FormatError(f"{path / PARTS_NPZ}: array {k!r} has shape {arrays[k].shape}, expected {shp}")
        rbp: list[np.ndarray | None] = []
        for t, off in zip(tables, offs):
            if off is None:
                rbp.append(None)
            else:
                if off + t.num_rows > olen:
                    raise FormatError(f"{path / ORDER_NPY}: table {t.name!r} rows [{off}, {off + t.num_rows}) beyond its {olen} entries")
                rbp.append(order[off : off + t.num_rows])
        pc = arrays.get("part_counts")
        if pc is not None and pc.shape != (nparts,):
            raise FormatError(f"{path / PARTS_NPZ}: array 'part_counts' has shape {pc.shape}, expected ({nparts},)")
        plan = cls(tables, m, rbp, arrays["part_table"], arrays["part_start"], arrays["part_stop"], arrays["owner"],
                   arrays["holders"], arrays["fetch"], doc.get("meta", {}), local_base=arrays["local_base"], part_counts=pc)
        if validate:
            try:
                plan.validate()
            except PlanError as e:
                raise PlanError(f"{path}: {e}") from None
        return plan

    def summary(self) -> dict[str, Any]:
        return {
            "tables": len(self.tables),
            "rows": int(sum(t.num_rows for t in self.tables)),
            "partitions": self.num_partitions,
            "world_size": self.world_size,
            "replicated_partitions": int((self.holders.sum(1) > 1).sum()),
            "rows_per_rank": self.rows_per_rank().tolist(),
            "memory_per_rank": self.memory_per_rank().tolist(),
            # TT tables (EL-Rec VI-B) are outside the plan: their cores sit on every rank besides these rows
            "replicated_tables": [m["name"] for m in self.meta.get("replicated_tables", [])],
            "replicated_bytes_per_rank": int(sum(m["bytes"] for m in self.meta.get("replicated_tables", []))),
        }


def _runs(idx: np.ndarray) -> list[np.ndarray]:
    """Split sorted indices into runs of consecutive values."""
    if idx.size == 0:
        return []
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    return np.split(idx, cut)


def _write_npy_concat(f, arrays: list[np.ndarray], dtype, length: int) -> None:
    """Write one .npy of the concatenation without materialising it (the orders can be gigabytes)."""
    from numpy.lib import format as npf

    npf.write_array_header_1_0(f, {"descr": npf.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (length,)})
    chunk = 1 << 24
    for a in arrays:
        for s in range(0, a.size, chunk):
            f.write(np.ascontiguousarray(a[s : s + chunk], dtype=dtype).tobytes())


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return str(obj)
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        return str(obj)
