"""Managed ids: raw 64-bit ids mapped to embedding rows with admission and eviction.

A stream brings ids no fixed vocabulary knew. Hashing them modulo the table size makes unrelated ids
share rows for ever; a *managed* table gives an id its own row once it has proven frequent and takes
the row back when the id went stale (TorchRec's managed-collision modules, ``MCHManagedCollisionModule``,
and HugeCTR's dynamic embedding tables do the same; OPER section 8 names adapting to new ids as future work).

What this module owns: the mapping of one table (:class:`ManagedIdTable`) and of several
(:class:`ManagedIds`), the mapping shards (:func:`shard_of`, :func:`shard_bounds`), and :func:`reset_rows`,
which re-initialises rows and their optimizer state in a ``LocalEmbeddingBags``-like ``[rows, dim]`` weight
and ``[rows]`` row-wise state. A run uses them through :mod:`embedscale.embedding.managed_lookup` (managed
tables, ``specs.ManagedConfig``; the mapping sharded over the ranks, in the checkpoint).

**Mapping shards** (as TorchRec's MCH modules remap per shard, each shard evicting among its own rows). A
table's id space is split into ``S`` mapping shards by a fixed hash of the raw id (:func:`shard_of`:
Fibonacci hashing, the high bits of ``id x 0x9E3779B97F4A7C15`` mod 2^64, mod ``S``). Row 0 is the *default
row*, shared by every id that has no row of its own; rows ``1 .. num_rows - 1`` are cut into ``S``
contiguous ranges (:func:`shard_bounds`: shard ``s`` holds rows ``[1 + s R // S, 1 + (s + 1) R // S)``,
``R = num_rows - 1``), and shard ``s`` admits its ids only into its own range and evicts only among them.
``S`` is a property of the table (``managed.shards``), never of the world size: a table holding every shard
(a world of one) and the same shards hosted by N ranks (``hosted``: rank ``r`` the shards ``s % N == r``)
assign every id the same row, and a checkpoint (per shard) re-shards onto any world size by re-hosting
shards; rows are never renumbered. ``S = 1`` is the unsharded table.

Layout. A table object holds the rows of its hosted shards only (*local* rows: the hosted shards' ranges
concatenated in shard order). Everything is a tensor on the table's device: per local row the id it holds,
whether it is used, its last step and its frequency; the resident ids sorted (looked up with
``searchsorted``); the *pending* ids (seen, not yet admitted) sorted with their counts and last step;
per hosted shard its counters. A batch costs a sort of its ids, a merge of the pending set and a rebuild of
the sorted index, ``O((B + P + R) log(B + P + R))`` for ``B`` ids, ``P`` pending ids and ``R`` local rows;
every hosted shard is handled in the same tensor operations (ranks within a shard by ``searchsorted`` over
shard-sorted keys). No Python loop per id or per shard; a few host syncs per batch (sizes).

Semantics of one batch (:meth:`ManagedIdTable.assign`), at step ``t`` (one more than the last batch), for
every mapping shard on its own (the ids of the batch that hash to it, in batch order):

1. The batch's distinct ids are taken in order of *first occurrence*; an id occurring ``c`` times
   counts ``c``.
2. Hits: an id with a row adds ``c`` to the row's frequency and sets its last step to ``t``.
3. TTL (policy ``"ttl"``): every used row with ``t - last > ttl`` is evicted (its id forgotten).
4. Admission: a missing id adds ``c`` to its pending count; an id whose pending count reaches
   ``admit_after`` (k) is a candidate. The shard's candidates, in first-occurrence order, take the shard's
   free rows in ascending row order; when none is free, ``"lru"`` and ``"lfu"`` evict a victim per
   candidate: among the shard's used rows *not touched in this batch* (``last < t``), LRU takes the
   smallest ``(last, row)``, LFU the smallest ``(freq, last, row)`` (ties: least recently used, then lowest
   row). ``"ttl"`` never evicts on demand: a candidate without a free row stays pending. A candidate left
   without a row (no free row and no eligible victim in its shard) stays pending too.
5. An admitted id gets ``freq`` = its pending count (this batch included), ``last = t`` and leaves the
   pending set; an evicted id is forgotten (it starts over at pending count 0).
6. Pending is bounded per shard: shard ``s`` keeps at most ``pending_capacity // S`` ids (one more for the
   first ``pending_capacity % S`` shards); above it, the entries with the smallest ``(last, id)`` are
   dropped and counted in ``pending_dropped`` (never silently).
7. The returned rows are those after the batch: an id admitted in this batch reads its new row,
   every other missing id the default row 0 (counted in ``collisions``, per occurrence).

Rows touched by a batch are never evicted by it, so a batch's result does not depend on the order of
its positions beyond the first-occurrence order of each shard's candidates. The step ``t`` is the table's
(every hosted shard steps with every batch, with or without ids). The caller resets the rows of
:attr:`Assignment.reset` (evicted and newly admitted) with :func:`reset_rows` before the lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from embedscale.errors import ConfigError, FormatError, InputError

POLICIES = ("lru", "lfu", "ttl")
_COUNTERS = ("lookups", "hits", "collisions", "admissions", "evictions", "pending_dropped")
_ROW_KEYS = ("row_id", "row_used", "row_last", "row_freq")
_PEND_KEYS = ("pend_ids", "pend_count", "pend_last")
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / phi as a signed int64 (Fibonacci hashing)


def shard_of(ids: torch.Tensor, shards: int) -> torch.Tensor:
    """The mapping shard of every raw 64-bit id: bits 32..62 of ``id x 0x9E3779B97F4A7C15`` (mod 2^64), after
    folding in its bits 29..63 by a shift-xor, modulo ``shards`` (int64, on ``ids``' device; any int64 id)."""
    if shards == 1:
        return torch.zeros_like(ids, dtype=torch.int64)
    h = ids.to(torch.int64) * _GOLDEN  # wraps modulo 2^64 (two's complement)
    h = h ^ ((h >> 29) & ((1 << 35) - 1))  # a logical shift by 29
    return ((h >> 32) & 0x7FFFFFFF) % shards


def shard_bounds(num_rows: int, shards: int) -> list[int]:
    """Row bounds of the mapping shards: shard ``s`` holds rows ``[b[s], b[s + 1])``; row 0 (the default row)
    is none's. Every shard holds at least one row (``shards <= num_rows - 1``)."""
    r = num_rows - 1
    return [1 + s * r // shards for s in range(shards + 1)]


def _per_group(groups: torch.Tensor, n: int) -> torch.Tensor:
    """How many elements each group ``0 .. n - 1`` has (``bincount`` without its min/max passes)."""
    return torch.zeros(n, dtype=torch.int64, device=groups.device).scatter_add_(0, groups, torch.ones_like(groups))


_KEY_SHIFT = 40  # composite sort keys: (shard << 40) | value, for values below 2^40 (steps, frequencies)


def _rank_in_group(groups: torch.Tensor) -> torch.Tensor:
    """For ascending group keys: each element's rank among the elements of its group (0, 1, ...)."""
    if groups.numel() == 0:
        return groups.clone()
    return torch.arange(groups.numel(), device=groups.device) - torch.searchsorted(groups, groups)


@dataclass
class Assignment:
    """What one batch did to a managed table.

    rows: the row of every position of the batch (same shape as the ids; 0 = the default row).
    admitted_ids / admitted_rows: ids given a row in this batch and their rows.
    evicted_ids / evicted_rows: ids that lost their row in this batch and the rows they had.
    """

    rows: torch.Tensor
    admitted_ids: torch.Tensor
    admitted_rows: torch.Tensor
    evicted_ids: torch.Tensor
    evicted_rows: torch.Tensor

    @property
    def reset(self) -> torch.Tensor:
        """Rows whose weights and optimizer state must be re-initialised (sorted, distinct)."""
        return torch.unique(torch.cat([self.evicted_rows, self.admitted_rows]))


class ManagedIdTable:
    """The id-to-row mapping of one managed table, or of the mapping shards of it that one rank hosts
    (semantics in the module docstring).

    Args:
        name: the table's name (in error messages).
        num_rows: rows of the embedding table, row 0 included (the default row); at least 2.
        admit_after: k, the accesses an id needs before it gets its own row (>= 1).
        policy: ``"lru"``, ``"lfu"`` or ``"ttl"``.
        ttl: for ``"ttl"``: a row idle for more than ``ttl`` steps is evicted (>= 1).
        pending_capacity: the most pending ids kept over all shards (default ``4 * num_rows``), split evenly.
        device: where the mapping lives (the run's device; default: torch's default device).
        shards: ``S``, the mapping shards (1 .. num_rows - 1).
        hosted: the shards this object holds (ascending; default all): ids of other shards are an error.
    """

    def __init__(self, name: str, num_rows: int, admit_after: int = 1, policy: str = "lru",
                 ttl: int | None = None, pending_capacity: int | None = None,
                 device: torch.device | str | None = None, shards: int = 1, hosted: Sequence[int] | None = None):
        if policy not in POLICIES:
            raise ConfigError(f"managed table {name!r}: eviction policy {policy!r} is not one of {list(POLICIES)}")
        if int(num_rows) < 2:
            raise ConfigError(f"managed table {name!r}: num_rows must be >= 2 (row 0 is the default row), "
                              f"got {num_rows}")
        if int(admit_after) < 1:
            raise ConfigError(f"managed table {name!r}: admit_after must be >= 1, got {admit_after}")
        if policy == "ttl" and (ttl is None or int(ttl) < 1):
            raise ConfigError(f"managed table {name!r}: policy 'ttl' needs ttl >= 1 steps, got {ttl}")
        if policy != "ttl" and ttl is not None:
            raise ConfigError(f"managed table {name!r}: ttl={ttl} is given but the policy is {policy!r}")
        if not 1 <= int(shards) <= int(num_rows) - 1:
            raise ConfigError(f"managed table {name!r}: shards must be in [1, num_rows - 1 = {int(num_rows) - 1}] "
                              f"(each mapping shard owns at least one row), got {shards}")
        self.name = name
        self.num_rows = int(num_rows)
        self.admit_after = int(admit_after)
        self.policy = policy
        self.ttl = None if ttl is None else int(ttl)
        self.pending_capacity = 4 * self.num_rows if pending_capacity is None else int(pending_capacity)
        if self.pending_capacity < 0:
            raise ConfigError(f"managed table {name!r}: pending_capacity must be >= 0, got {pending_capacity}")
        self.shards = int(shards)
        self.hosted = list(range(self.shards)) if hosted is None else sorted(int(s) for s in hosted)
        if any(not 0 <= s < self.shards for s in self.hosted) or len(set(self.hosted)) != len(self.hosted):
            raise ConfigError(f"managed table {name!r}: hosted shards {self.hosted} are not distinct shards of "
                              f"[0, {self.shards})")
        dev = torch.device(device) if device is not None else torch.get_default_device()
        i64 = dict(dtype=torch.int64, device=dev)
        bounds = shard_bounds(self.num_rows, self.shards)
        self._ranges = [(bounds[s], bounds[s + 1]) for s in self.hosted]  # global rows of each hosted shard
        sizes = [b - a for a, b in self._ranges]
        self._offsets = [0]
        for n in sizes:
            self._offsets.append(self._offsets[-1] + n)
        H = len(self.hosted)
        self.row_global = torch.cat([torch.arange(a, b, **i64) for a, b in self._ranges]) if H else \
            torch.zeros(0, **i64)  # local row -> the table's row
        self.row_shard = torch.repeat_interleave(torch.arange(H, **i64), torch.tensor(sizes, **i64)) if H else \
            torch.zeros(0, **i64)  # local row -> index into hosted
        self._local_of = torch.full((self.shards,), -1, **i64)  # shard -> index into hosted (-1: not here)
        self._local_of[torch.tensor(self.hosted, **i64)] = torch.arange(H, **i64)
        cap, extra = divmod(self.pending_capacity, self.shards)
        self.pend_cap = torch.tensor([cap + (s < extra) for s in self.hosted], **i64)
        self._cap_min = cap if H else 0  # no shard is over its capacity while the pending ids are at most this
        L = self._offsets[-1]
        self.step = 0
        self.row_id = torch.zeros(L, **i64)
        self.row_used = torch.zeros(L, dtype=torch.bool, device=dev)
        self.row_last = torch.zeros(L, **i64)
        self.row_freq = torch.zeros(L, **i64)
        self.pend_ids = torch.zeros(0, **i64)
        self.pend_count = torch.zeros(0, **i64)
        self.pend_last = torch.zeros(0, **i64)
        self.pend_shard = torch.zeros(0, **i64)  # each pending id's index into hosted (kept, not re-hashed)
        self.shard_counters = torch.zeros(H, len(_COUNTERS), **i64)  # per hosted shard, _COUNTERS order
        # delta checkpoints (track): local rows changed since the base, the base's step and pending ids per shard
        self._dirty: torch.Tensor | None = None
        self._base_step = -1
        self._base_pend: dict[int, torch.Tensor] = {}
        self._rebuild_index()

    @property
    def device(self) -> torch.device:
        return self.row_id.device

    @property
    def counters(self) -> dict[str, int]:
        """The counters summed over the hosted shards (lookups, hits, collisions, admissions, evictions,
        pending_dropped)."""
        return dict(zip(_COUNTERS, (int(v) for v in self.shard_counters.sum(0).tolist())))

    @property
    def resident(self) -> int:
        """Ids holding a row of their own (in the hosted shards)."""
        return int(self._sorted_ids.numel())

    def shard_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The mapping shard of every id (:func:`shard_of` with this table's ``S``)."""
        return shard_of(ids, self.shards)

    def _local_shard(self, ids: torch.Tensor) -> torch.Tensor:
        """Index into ``hosted`` of every id's shard; an ``InputError`` for an id of a shard not hosted here."""
        if len(self.hosted) == self.shards:  # every shard here: hosted index == shard
            return shard_of(ids, self.shards)
        ls = self._local_of[shard_of(ids, self.shards)]
        if bool((ls < 0).any()):
            bad = ids[ls < 0][0]
            raise InputError(f"managed table {self.name!r}: id {int(bad)} belongs to mapping shard "
                             f"{int(shard_of(bad.view(1), self.shards))}, not hosted here (hosted: {self.hosted})")
        return ls

    def _rebuild_index(self) -> None:
        rows = torch.nonzero(self.row_used, as_tuple=True)[0]
        ids, order = torch.sort(self.row_id[rows])
        self._sorted_ids = ids
        self._sorted_rows = rows[order]  # local rows

    @staticmethod
    def _find(keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """Index of every query in the sorted ``keys`` or -1."""
        if keys.numel() == 0:
            return torch.full_like(query, -1)
        pos = torch.searchsorted(keys, query).clamp_(max=keys.numel() - 1)
        return torch.where(keys[pos] == query, pos, torch.full_like(pos, -1))

    @staticmethod
    def _gather(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``values[idx]`` where ``idx >= 0``, 0 elsewhere (``values`` may be empty)."""
        if values.numel() == 0:
            return torch.zeros_like(idx)
        return torch.where(idx >= 0, values[idx.clamp(min=0)], torch.zeros_like(idx))

    def _rows_of_sorted(self, query: torch.Tensor) -> torch.Tensor:
        """The table row of every id (0: none), from the sorted index."""
        idx = self._find(self._sorted_ids, query)
        if self._sorted_ids.numel() == 0:
            return torch.zeros_like(query)
        glob = self.row_global[self._sorted_rows[idx.clamp(min=0)]]
        return torch.where(idx >= 0, glob, torch.zeros_like(glob))

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The current row of every id (0 for ids without one), without changing any state."""
        flat = ids.reshape(-1).to(self.device, torch.int64)
        self._local_shard(flat)
        return self._rows_of_sorted(flat).view(ids.shape)

    @torch.no_grad()
    def assign(self, ids: torch.Tensor) -> Assignment:
        """Map one batch of raw ids to rows, admitting and evicting as the module docstring says (each
        hosted shard on its own, all in the same tensor operations)."""
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise InputError(f"managed table {self.name!r}: ids must be integers, got {ids.dtype}")
        dev = self.device
        flat = ids.reshape(-1).to(dev, torch.int64)
        n = flat.numel()
        self.step += 1
        t = self.step
        uniq, inv, cnt = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        u_ls = self._local_shard(uniq)
        first = torch.full((uniq.numel(),), n, dtype=torch.int64, device=dev)
        first.scatter_reduce_(0, inv, torch.arange(n, device=dev), reduce="amin")
        hit, hit_rows = self._count_hits(uniq, cnt, t)  # 2.
        evicted_rows = [torch.zeros(0, dtype=torch.int64, device=dev)]
        if self.policy == "ttl":  # 3. TTL expiry of rows idle too long (touched rows have last == t)
            expired = torch.nonzero(self.row_used & (t - self.row_last > self.ttl), as_tuple=True)[0]
            evicted_rows.append(expired)
            self.row_used[expired] = False
        # 4. admission, per shard: candidates by (shard, first occurrence) meet free rows by (shard, row)
        miss = ~hit
        m_ids, m_cnt, m_first, m_ls = uniq[miss], cnt[miss], first[miss], u_ls[miss]
        p_idx = self._find(self.pend_ids, m_ids)
        total = m_cnt + self._gather(self.pend_count, p_idx)
        cand = torch.nonzero(total >= self.admit_after, as_tuple=True)[0]
        cand = cand[torch.argsort(m_first[cand] if len(self.hosted) == 1 else m_ls[cand] * (n + 1) + m_first[cand])]
        target = self._admission_targets(m_ls[cand], t, evicted_rows)
        got = target >= 0
        adm, adm_rows = cand[got], target[got]
        ev_rows = torch.cat(evicted_rows)
        ev_ids = self.row_id[ev_rows].clone()
        adm_ids = m_ids[adm]
        self._admit(adm_rows, adm_ids, total[adm], t)
        if self._dirty is not None:  # every row whose entry this batch changed (hit, expired, evicted, admitted)
            self._dirty[hit_rows] = True
            self._dirty[ev_rows] = True
            self._dirty[adm_rows] = True
        self._update_pending(m_ids, m_ls, total, adm, p_idx, t)  # 5./6.
        self._rebuild_index()
        rows = self._rows_of_sorted(uniq)[inv]  # 7. rows of the batch after admission
        self._count_lookups(u_ls[inv], rows, adm_rows, ev_rows)
        return Assignment(rows.view(ids.shape), adm_ids, self.row_global[adm_rows], ev_ids,
                          self.row_global[ev_rows])

    def _count_hits(self, uniq: torch.Tensor, cnt: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: the batch's distinct ids that hold a row (mask) and those rows, their frequency and last
        step updated."""
        idx = self._find(self._sorted_ids, uniq)
        hit = idx >= 0
        hit_rows = self._sorted_rows[idx[hit]]
        self.row_freq[hit_rows] += cnt[hit]
        self.row_last[hit_rows] = t
        return hit, hit_rows

    def _admission_targets(self, c_ls: torch.Tensor, t: int, evicted_rows: list) -> torch.Tensor:
        """Step 4: the local row each admission candidate (in order, ``c_ls`` their hosted shards) takes: the
        shard's free rows first, then (LRU / LFU) its victims in eviction order, appended to ``evicted_rows``;
        -1 for a candidate left without one."""
        target = torch.full_like(c_ls, -1)
        if not c_ls.numel():
            return target
        H = len(self.hosted)
        c_rank = _rank_in_group(c_ls)
        shard_ids = torch.arange(H, device=self.device)
        free = torch.nonzero(~self.row_used, as_tuple=True)[0]  # ascending: grouped by shard, rows ascending
        f_ls = self.row_shard[free]
        c_free = _per_group(f_ls, H)[c_ls]
        gets_free = c_rank < c_free
        if free.numel():  # the c_rank-th free row of the candidate's shard, where it has one
            at = (torch.searchsorted(f_ls, shard_ids)[c_ls] + c_rank).clamp_(max=free.numel() - 1)
            target = torch.where(gets_free, free[at], target)
        rest = ~gets_free
        if self.policy not in ("lru", "lfu") or not bool(rest.any()):
            return target
        order = self._victims(t)
        e_ls = self.row_shard[order]
        r2 = c_rank - c_free
        ok = rest & (r2 < _per_group(e_ls, H)[c_ls])
        if order.numel():  # the r2-th victim of the candidate's shard, where it has one
            at = (torch.searchsorted(e_ls, shard_ids)[c_ls] + r2).clamp_(min=0, max=order.numel() - 1)
            target = torch.where(ok, order[at], target)
            evicted_rows.append(torch.sort(target[ok]).values)
        return target

    def _victims(self, t: int) -> torch.Tensor:
        """Rows that may be evicted (used, not touched at step ``t``) in eviction order within each shard: LRU by
        (shard, last, row), LFU by (shard, freq, last, row)."""
        eligible = torch.nonzero(self.row_used & (self.row_last < t), as_tuple=True)[0]  # ascending
        e_sh = self.row_shard[eligible] << _KEY_SHIFT
        if self.policy == "lru":  # rows ascend already: one stable sort
            return eligible[torch.argsort(e_sh | self.row_last[eligible], stable=True)]
        o = torch.argsort(self.row_last[eligible], stable=True)
        freq = self.row_freq[eligible].clamp(max=(1 << _KEY_SHIFT) - 1)
        return eligible[o[torch.argsort((e_sh | freq)[o], stable=True)]]

    def _admit(self, rows: torch.Tensor, ids: torch.Tensor, freq: torch.Tensor, t: int) -> None:
        self.row_id[rows] = ids
        self.row_used[rows] = True
        self.row_last[rows] = t
        self.row_freq[rows] = freq

    def _update_pending(self, m_ids, m_ls, total, adm, p_idx, t: int) -> None:
        """Steps 5-6: the pending ids become the old entries not in this batch plus this batch's misses not
        admitted (counts summed), sorted by id; a shard over its capacity drops its oldest (last, id) first."""
        dev, H = self.device, len(self.hosted)
        admitted_mask = torch.zeros(m_ids.numel(), dtype=torch.bool, device=dev)
        admitted_mask[adm] = True
        seen = torch.zeros(self.pend_ids.numel(), dtype=torch.bool, device=dev)
        seen[p_idx[p_idx >= 0]] = True
        old_keep = torch.nonzero(~seen, as_tuple=True)[0]
        new_keep = torch.nonzero(~admitted_mask, as_tuple=True)[0]
        p_ids = torch.cat([self.pend_ids[old_keep], m_ids[new_keep]])
        o = torch.argsort(p_ids)
        p_ids = p_ids[o]  # sorted by id (ids are distinct)
        p_cnt = torch.cat([self.pend_count[old_keep], total[new_keep]])[o]
        p_last = torch.cat([self.pend_last[old_keep], torch.full_like(new_keep, t)])[o]
        p_ls = torch.cat([self.pend_shard[old_keep], m_ls[new_keep]])[o]
        if p_ids.numel() > self._cap_min:  # some shard may be over its capacity
            excess = (_per_group(p_ls, H) - self.pend_cap).clamp_(min=0)
            if int(excess.sum()) > 0:  # drop the smallest (last, id) of each shard: one stable sort over id order
                q = torch.argsort((p_ls << _KEY_SHIFT) | p_last, stable=True)
                q_ls = p_ls[q]
                drop = torch.zeros(p_ids.numel(), dtype=torch.bool, device=dev)
                drop[q[_rank_in_group(q_ls) < excess[q_ls]]] = True
                keep = torch.nonzero(~drop, as_tuple=True)[0]
                p_ids, p_cnt, p_last, p_ls = p_ids[keep], p_cnt[keep], p_last[keep], p_ls[keep]
                self.shard_counters[:, 5] += excess
        self.pend_ids, self.pend_count, self.pend_last, self.pend_shard = p_ids, p_cnt, p_last, p_ls

    def _count_lookups(self, v_ls: torch.Tensor, rows: torch.Tensor, adm_rows: torch.Tensor,
                       ev_rows: torch.Tensor) -> None:
        """Per hosted shard: lookups, hits, collisions (no row), admissions and evictions of this batch."""
        H, c = len(self.hosted), self.shard_counters
        both = _per_group(v_ls * 2 + (rows == 0), 2 * H).view(H, 2)  # per shard: (hits, collisions)
        collisions = both[:, 1]
        lookups = both[:, 0] + collisions
        c[:, 0] += lookups
        c[:, 1] += lookups - collisions
        c[:, 2] += collisions
        c[:, 3] += _per_group(self.row_shard[adm_rows], H)
        c[:, 4] += _per_group(self.row_shard[ev_rows], H)

    def mapping(self) -> dict[int, int]:
        """id -> row of every resident id of the hosted shards (a host copy, for inspection and tests)."""
        return dict(zip(self._sorted_ids.tolist(), self.row_global[self._sorted_rows].tolist()))

    # -- state -----------------------------------------------------------------------------------
    def _config(self) -> list[int]:
        return [self.num_rows, self.admit_after, POLICIES.index(self.policy), -1 if self.ttl is None else self.ttl,
                self.pending_capacity, self.shards]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (``torch.load(..., weights_only=True)`` reads them), config included for checking: the
        table's ``config`` and ``step``, and per hosted shard ``s`` its rows (``<s>.row_id`` ... over its row
        range), its pending ids (``<s>.pend_ids`` ...) and ``<s>.counters``. The states of the shards of one
        table written by several ranks together make the whole table (:meth:`load_state_dict` takes any
        superset of the shards it hosts)."""
        out = {"config": torch.tensor(self._config()), "step": torch.tensor(self.step)}
        p_ls = self.pend_shard
        for j, s in enumerate(self.hosted):
            a, b = self._offsets[j], self._offsets[j + 1]
            for k in _ROW_KEYS:
                out[f"{s}.{k}"] = getattr(self, k)[a:b].clone()
            mine = p_ls == j
            for k in _PEND_KEYS:
                out[f"{s}.{k}"] = getattr(self, k)[mine].clone()
            out[f"{s}.counters"] = self.shard_counters[j].clone()
        return out

    def track(self) -> None:
        """Make the state as it is now the base of later :meth:`delta_state_dict` calls (a full checkpoint was
        just written from :meth:`state_dict`): changed rows are counted from here, and the pending ids of
        each hosted shard are remembered (ids only, in :meth:`state_dict`'s order)."""
        self._dirty = torch.zeros(self.row_id.numel(), dtype=torch.bool, device=self.device)
        self._base_step = self.step
        p_ls = self._local_of[shard_of(self.pend_ids, self.shards)]
        self._base_pend = {s: self.pend_ids[p_ls == j].clone() for j, s in enumerate(self.hosted)}

    def delta_state_dict(self) -> dict[str, torch.Tensor]:
        """What changed since :meth:`track` (a delta checkpoint holds "the id mappings that
        changed"): ``config``, ``step``, ``base_step``, and per hosted shard ``s`` its counters (whole), the
        changed rows (``<s>.d.rows``: int32 positions in the shard's range; ``<s>.d.row_id`` ... their
        entries), which of the base's pending ids are still pending unchanged (``<s>.d.pend_kept``: one bool
        per base pending id, in the base's order; an unchanged entry's last step is at most the base's step,
        every sighting sets it to the batch's step) and the pending entries new or changed since
        (``<s>.d.pend_ids`` ...). :func:`apply_delta` on the base's :meth:`state_dict` gives this table's
        :meth:`state_dict` exactly."""
        if self._dirty is None:
            raise ConfigError(f"managed table {self.name!r}: a delta state needs a base (track() after a full "
                              "state)")
        out = {"config": torch.tensor(self._config()), "step": torch.tensor(self.step),
               "base_step": torch.tensor(self._base_step)}
        p_ls = self._local_of[shard_of(self.pend_ids, self.shards)]
        for j, s in enumerate(self.hosted):
            a, b = self._offsets[j], self._offsets[j + 1]
            rows = torch.nonzero(self._dirty[a:b], as_tuple=True)[0]
            out[f"{s}.d.rows"] = rows.to(torch.int32)
            for k in _ROW_KEYS:
                out[f"{s}.d.{k}"] = getattr(self, k)[a:b][rows].clone()
            mine = p_ls == j
            ids, cnt, last = self.pend_ids[mine], self.pend_count[mine], self.pend_last[mine]
            changed = last > self._base_step
            out[f"{s}.d.pend_kept"] = torch.isin(self._base_pend[s], ids[~changed])
            for k, v in zip(_PEND_KEYS, (ids, cnt, last)):
                out[f"{s}.d.{k}"] = v[changed].clone()
            out[f"{s}.counters"] = self.shard_counters[j].clone()
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore the hosted shards from ``state`` (the states of any hosting of the same shards, merged)."""
        if "config" not in state or "step" not in state:
            raise FormatError(f"managed table {self.name!r}: state lacks 'config' or 'step'")
        want = self._config()
        got = state["config"].tolist()
        if len(got) == 5 and "row_id" in state:  # written before mapping shards: one unsharded mapping
            if got + [1] != want:
                raise FormatError(f"managed table {self.name!r}: the saved mapping is unsharded (written before "
                                  f"mapping shards; config {got}): it resumes only as managed.shards 1 with the "
                                  f"same settings, this table is {want} (num_rows, admit_after, policy, ttl, "
                                  "pending_capacity, shards)")
            state = {"config": torch.tensor(want), "step": state["step"], "0.counters": state["counters"],
                     **{f"0.{k}": state[k][1:] for k in _ROW_KEYS}, **{f"0.{k}": state[k] for k in _PEND_KEYS}}
            got = want
        if got != want:
            raise FormatError(f"managed table {self.name!r}: saved config (num_rows, admit_after, policy, ttl, "
                              f"pending_capacity, shards) {got} differs from this table's {want}")
        missing = sorted(f"{s}.{k}" for s in self.hosted for k in (*_ROW_KEYS, *_PEND_KEYS, "counters")
                         if f"{s}.{k}" not in state)
        if missing:
            raise FormatError(f"managed table {self.name!r}: state lacks mapping shard entries {missing[:6]}"
                              f"{' ...' if len(missing) > 6 else ''}")
        dev = self.device
        rows = {k: [] for k in _ROW_KEYS}
        pend = {k: [] for k in (*_PEND_KEYS, "pend_shard")}
        for j, s in enumerate(self.hosted):
            size = self._offsets[j + 1] - self._offsets[j]
            for k in _ROW_KEYS:
                v = state[f"{s}.{k}"]
                if tuple(v.shape) != (size,):
                    raise FormatError(f"managed table {self.name!r}: shard {s}'s {k} has shape {tuple(v.shape)}, "
                                      f"expected ({size},)")
                rows[k].append(v.to(dev))
            for k in _PEND_KEYS:
                pend[k].append(state[f"{s}.{k}"].to(dev, torch.int64))
            pend["pend_shard"].append(torch.full_like(pend["pend_ids"][-1], j))
            self.shard_counters[j] = state[f"{s}.counters"].to(dev, torch.int64)
        for k in _ROW_KEYS:
            if rows[k]:
                setattr(self, k, torch.cat(rows[k]).clone())
        p = {k: torch.cat(v) if v else torch.zeros(0, dtype=torch.int64, device=dev) for k, v in pend.items()}
        o = torch.argsort(p["pend_ids"])
        self.pend_ids, self.pend_count, self.pend_last, self.pend_shard = (p[k][o] for k in (*_PEND_KEYS, "pend_shard"))
        self.step = int(state["step"])
        self._dirty, self._base_step, self._base_pend = None, -1, {}  # a delta needs a full state written first
        self._rebuild_index()


class ManagedIds:
    """The managed tables of a model, by table name (one :class:`ManagedIdTable` each, own policy)."""

    def __init__(self, tables: Mapping[str, ManagedIdTable]):
        self.tables = dict(tables)

    def __getitem__(self, name: str) -> ManagedIdTable:
        try:
            return self.tables[name]
        except KeyError:
            raise ConfigError(f"no managed table {name!r}; managed tables: {sorted(self.tables)}") from None

    def assign(self, ids_by_table: Mapping[str, torch.Tensor]) -> dict[str, Assignment]:
        return {name: self[name].assign(ids) for name, ids in ids_by_table.items()}

    def counters(self) -> dict[str, dict[str, int]]:
        return {name: dict(t.counters) for name, t in self.tables.items()}

    def state_dict(self, delta: bool = False) -> dict[str, torch.Tensor]:
        """Every table's :meth:`ManagedIdTable.state_dict` (``delta``: its ``delta_state_dict``), keys prefixed
        by the table's name."""
        return {f"{name}.{k}": v for name, t in self.tables.items()
                for k, v in (t.delta_state_dict() if delta else t.state_dict()).items()}

    def track(self) -> None:
        for t in self.tables.values():
            t.track()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, t in self.tables.items():
            prefix = f"{name}."
            t.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


def apply_delta(base: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full mapping state at a delta's step: ``base`` (``ManagedIds.state_dict()`` of the full checkpoint,
    every rank file's merged) with ``delta`` (``ManagedIds.state_dict(delta=True)``, merged) laid over it,
    shard by shard: changed rows replaced, the base's pending entries kept where ``pend_kept`` says and the
    new or changed ones added (sorted by id, as :meth:`ManagedIdTable.state_dict` writes them). A table whose
    delta entry is whole (written without a base) is taken as it is. A ``FormatError`` when the delta does
    not fit its base."""
    tables = sorted({k.split(".", 1)[0] for k in delta})
    out = {k: v for k, v in base.items() if k.split(".", 1)[0] not in tables}
    for name in tables:
        p = f"{name}."
        d = {k[len(p):]: v for k, v in delta.items() if k.startswith(p)}
        if "base_step" not in d:  # a whole state
            out.update({p + k: v for k, v in d.items()})
            continue
        b = {k[len(p):]: v for k, v in base.items() if k.startswith(p)}
        if "config" not in b or b["config"].tolist() != d["config"].tolist() or int(b["step"]) != int(d["base_step"]):
            raise FormatError(f"managed table {name!r}: the delta's mapping (config {d['config'].tolist()}, base "
                              f"step {int(d['base_step'])}) does not fit its base's (config "
                              f"{b['config'].tolist() if 'config' in b else None}, step "
                              f"{int(b['step']) if 'step' in b else None})")
        full = {"config": d["config"], "step": d["step"]}
        for s in sorted({int(k.split(".", 1)[0]) for k in d if k.endswith(".d.rows")}):
            rows = d[f"{s}.d.rows"].to(torch.int64)
            for k in _ROW_KEYS:
                if f"{s}.{k}" not in b:
                    raise FormatError(f"managed table {name!r}: the base lacks mapping shard {s}'s {k}")
                v = b[f"{s}.{k}"].clone()
                v[rows] = d[f"{s}.d.{k}"]
                full[f"{s}.{k}"] = v
            kept = d[f"{s}.d.pend_kept"]
            if kept.numel() != b[f"{s}.pend_ids"].numel():
                raise FormatError(f"managed table {name!r}: shard {s}: the delta keeps {kept.numel()} base pending "
                                  f"entries' flags, the base has {b[f'{s}.pend_ids'].numel()}")
            ids = torch.cat([b[f"{s}.pend_ids"][kept], d[f"{s}.d.pend_ids"]])
            o = torch.argsort(ids)
            full[f"{s}.pend_ids"] = ids[o]
            for k in _PEND_KEYS[1:]:
                full[f"{s}.{k}"] = torch.cat([b[f"{s}.{k}"][kept], d[f"{s}.d.{k}"]])[o]
            full[f"{s}.counters"] = d[f"{s}.counters"]
        out.update({p + k: v for k, v in full.items()})
    return out


@torch.no_grad()
def reset_rows(weight: torch.Tensor, state: torch.Tensor | None, rows: torch.Tensor, init: str = "uniform",
               generator: torch.Generator | None = None) -> None:
    """Re-initialise ``rows`` of a ``[num_rows, dim]`` table view and zero their optimizer state.

    ``weight`` and ``state`` are views such as ``LocalEmbeddingBags.table_weight(name)`` and
    ``table_momentum(name)`` (row-wise Adagrad; ``None`` for SGD). ``init``: ``"uniform"`` draws
    ``U(-1/sqrt(n), 1/sqrt(n))`` as the DLRM reference initialises a table of ``n`` rows; ``"zeros"``.
    Other rows are not touched.
    """
    if weight.dim() != 2:
        raise ConfigError(f"reset_rows: weight must be [num_rows, dim], got shape {tuple(weight.shape)}")
    rows = rows.to(weight.device, torch.int64)
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= weight.shape[0]:
        raise InputError(f"reset_rows: row {int(rows.max()) if int(rows.min()) >= 0 else int(rows.min())} "
                         f"outside a table of {weight.shape[0]} rows")
    if init == "zeros":
        fresh = torch.zeros(rows.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
    elif init == "uniform":
        bound = 1.0 / weight.shape[0] ** 0.5
        fresh = torch.empty(rows.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
        fresh.uniform_(-bound, bound, generator=generator)
    else:
        raise ConfigError(f"reset_rows: init {init!r} is not 'uniform' or 'zeros'")
    weight[rows] = fresh
    if state is not None:
        if state.shape[0] != weight.shape[0]:
            raise ConfigError(f"reset_rows: state has {state.shape[0]} rows, weight {weight.shape[0]}")
        state[rows] = 0
