"""Managed ids: raw 64-bit ids mapped to embedding rows with admission and eviction (issue 17 part 2).

A stream brings ids no fixed vocabulary knew. Hashing them modulo the table size makes unrelated ids
share rows for ever; a *managed* table gives an id its own row once it has proven frequent and takes
the row back when the id went stale (TorchRec's managed-collision modules and HugeCTR's dynamic
embedding tables do the same; OPER section 8 names adapting to new ids as future work).

What this module owns: the mapping of one table (:class:`ManagedIdTable`) and of several
(:class:`ManagedIds`), and :func:`reset_rows`, which re-initialises rows and their optimizer state in a
``LocalEmbeddingBags``-like ``[rows, dim]`` weight and ``[rows]`` row-wise state. A run uses them through
:mod:`embedscale.embedding.managed_lookup` (managed tables, ``specs.ManagedConfig``; the mapping replicated on
N ranks, in the checkpoint); the mapping sharded with the rows comes later.

Layout. A table of ``num_rows`` rows keeps row 0 as the *default row*, shared by every id that has no
row of its own; rows ``1 .. num_rows - 1`` are given to ids. Everything is a tensor on the table's
device: per row the id it holds, whether it is used, its last step and its frequency; the resident
ids sorted (looked up with ``searchsorted``); the *pending* ids (seen, not yet admitted) sorted with
their counts and last step. A batch costs a sort of its ids, a merge of the pending set and a rebuild
of the sorted index, ``O((B + P + R) log(B + P + R))`` for ``B`` ids, ``P`` pending ids and ``R`` rows
used so far (scans stop at the highest row ever used); an on-device hash table would make it
``O(B)``. No Python loop per id; a few host syncs per batch (sizes).

Semantics of one batch (:meth:`ManagedIdTable.assign`), at step ``t`` (one more than the last batch):

1. The batch's distinct ids are taken in order of *first occurrence*; an id occurring ``c`` times
   counts ``c``.
2. Hits: an id with a row adds ``c`` to the row's frequency and sets its last step to ``t``.
3. TTL (policy ``"ttl"``): every used row with ``t - last > ttl`` is evicted (its id forgotten).
4. Admission: a missing id adds ``c`` to its pending count; an id whose pending count reaches
   ``admit_after`` (k) is a candidate. Candidates, in first-occurrence order, take the free rows in
   ascending row order; when none is free, ``"lru"`` and ``"lfu"`` evict a victim per candidate:
   among used rows *not touched in this batch* (``last < t``), LRU takes the smallest
   ``(last, row)``, LFU the smallest ``(freq, last, row)`` (ties: least recently used, then lowest
   row). ``"ttl"`` never evicts on demand: a candidate without a free row stays pending. A candidate
   left without a row (no free row and no eligible victim) stays pending too.
5. An admitted id gets ``freq`` = its pending count (this batch included), ``last = t`` and leaves the
   pending set; an evicted id is forgotten (it starts over at pending count 0).
6. Pending is bounded by ``pending_capacity``: above it, the entries with the smallest
   ``(last, id)`` are dropped and counted in ``pending_dropped`` (never silently).
7. The returned rows are those after the batch: an id admitted in this batch reads its new row,
   every other missing id the default row 0 (counted in ``collisions``, per occurrence).

Rows touched by a batch are never evicted by it, so a batch's result does not depend on the order of
its positions beyond the first-occurrence order of its candidates. The caller resets the rows of
:attr:`Assignment.reset` (evicted and newly admitted) with :func:`reset_rows` before the lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from embedscale.errors import ConfigError, FormatError, InputError

POLICIES = ("lru", "lfu", "ttl")
_COUNTERS = ("lookups", "hits", "collisions", "admissions", "evictions", "pending_dropped")


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
    """The id-to-row mapping of one managed table (semantics in the module docstring).

    Args:
        name: the table's name (in error messages).
        num_rows: rows of the embedding table, row 0 included (the default row); at least 2.
        admit_after: k, the accesses an id needs before it gets its own row (>= 1).
        policy: ``"lru"``, ``"lfu"`` or ``"ttl"``.
        ttl: for ``"ttl"``: a row idle for more than ``ttl`` steps is evicted (>= 1).
        pending_capacity: the most pending ids kept (default ``4 * num_rows``).
        device: where the mapping lives (the run's device; default: torch's default device).
    """

    def __init__(self, name: str, num_rows: int, admit_after: int = 1, policy: str = "lru",
                 ttl: int | None = None, pending_capacity: int | None = None,
                 device: torch.device | str | None = None):
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
        self.name = name
        self.num_rows = int(num_rows)
        self.admit_after = int(admit_after)
        self.policy = policy
        self.ttl = None if ttl is None else int(ttl)
        self.pending_capacity = 4 * self.num_rows if pending_capacity is None else int(pending_capacity)
        if self.pending_capacity < 0:
            raise ConfigError(f"managed table {name!r}: pending_capacity must be >= 0, got {pending_capacity}")
        dev = torch.device(device) if device is not None else torch.get_default_device()
        i64 = dict(dtype=torch.int64, device=dev)
        self.step = 0
        self.row_id = torch.zeros(self.num_rows, **i64)
        self.row_used = torch.zeros(self.num_rows, dtype=torch.bool, device=dev)
        self.row_last = torch.zeros(self.num_rows, **i64)
        self.row_freq = torch.zeros(self.num_rows, **i64)
        self.pend_ids = torch.zeros(0, **i64)
        self.pend_count = torch.zeros(0, **i64)
        self.pend_last = torch.zeros(0, **i64)
        self.counters = {k: 0 for k in _COUNTERS}
        self._fresh = 1  # rows >= _fresh have never been used: scans stop there
        self._rebuild_index()

    @property
    def device(self) -> torch.device:
        return self.row_id.device

    @property
    def resident(self) -> int:
        """Ids holding a row of their own."""
        return int(self._sorted_ids.numel())

    def _rebuild_index(self) -> None:
        rows = torch.nonzero(self.row_used[:self._fresh], as_tuple=True)[0]
        ids, order = torch.sort(self.row_id[rows])
        self._sorted_ids = ids
        self._sorted_rows = rows[order]

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

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The current row of every id (0 for ids without one), without changing any state."""
        flat = ids.reshape(-1).to(self.device, torch.int64)
        idx = self._find(self._sorted_ids, flat)
        return self._gather(self._sorted_rows, idx).view(ids.shape)

    @torch.no_grad()
    def assign(self, ids: torch.Tensor) -> Assignment:
        """Map one batch of raw ids to rows, admitting and evicting as the module docstring says."""
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise InputError(f"managed table {self.name!r}: ids must be integers, got {ids.dtype}")
        dev = self.device
        flat = ids.reshape(-1).to(dev, torch.int64)
        n = flat.numel()
        self.step += 1
        t = self.step
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        uniq, inv, cnt = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        first = torch.full((uniq.numel(),), n, dtype=torch.int64, device=dev)
        first.scatter_reduce_(0, inv, torch.arange(n, device=dev), reduce="amin")
        # 2. hits
        idx = self._find(self._sorted_ids, uniq)
        hit = idx >= 0
        hit_rows = self._sorted_rows[idx[hit]]
        self.row_freq[hit_rows] += cnt[hit]
        self.row_last[hit_rows] = t
        evicted_rows = [empty]
        # 3. TTL expiry of rows idle too long (touched rows have last == t)
        if self.policy == "ttl":
            f = self._fresh
            expired = torch.nonzero(self.row_used[:f] & (t - self.row_last[:f] > self.ttl), as_tuple=True)[0]
            evicted_rows.append(expired)
            self.row_used[expired] = False
        # 4. admission
        miss = ~hit
        m_ids, m_cnt, m_first = uniq[miss], cnt[miss], first[miss]
        p_idx = self._find(self.pend_ids, m_ids)
        total = m_cnt + self._gather(self.pend_count, p_idx)
        cand = torch.nonzero(total >= self.admit_after, as_tuple=True)[0]
        cand = cand[torch.argsort(m_first[cand])]  # first-occurrence order
        n_cand = int(cand.numel())
        holes = torch.nonzero(~self.row_used[1:self._fresh], as_tuple=True)[0] + 1  # free rows, ascending
        fresh = torch.arange(self._fresh, min(self.num_rows, self._fresh + max(0, n_cand - holes.numel())),
                             device=dev)
        free = torch.cat([holes, fresh])
        n_free = min(n_cand, int(free.numel()))
        targets = [free[:n_free]]
        rest = n_cand - n_free
        if rest > 0 and self.policy in ("lru", "lfu"):
            f = self._fresh
            eligible = torch.nonzero(self.row_used[:f] & (self.row_last[:f] < t), as_tuple=True)[0]  # ascending
            order = eligible[torch.argsort(self.row_last[eligible], stable=True)]
            if self.policy == "lfu":
                order = order[torch.argsort(self.row_freq[order], stable=True)]
            victims = order[:rest]
            evicted_rows.append(victims)
            targets.append(victims)
        ev_rows = torch.cat(evicted_rows)
        ev_ids = self.row_id[ev_rows].clone()
        adm_rows = torch.cat(targets)
        adm = cand[:adm_rows.numel()]
        adm_ids = m_ids[adm]
        self.row_id[adm_rows] = adm_ids
        self.row_used[adm_rows] = True
        self.row_last[adm_rows] = t
        self.row_freq[adm_rows] = total[adm]
        if adm_rows.numel():
            self._fresh = max(self._fresh, int(adm_rows.max()) + 1)
        # 5./6. pending: the old entries not in this batch, plus this batch's misses not admitted
        admitted_mask = torch.zeros(m_ids.numel(), dtype=torch.bool, device=dev)
        admitted_mask[adm] = True
        seen = torch.zeros(self.pend_ids.numel(), dtype=torch.bool, device=dev)
        seen[p_idx[p_idx >= 0]] = True
        keep_new = ~admitted_mask
        p_ids = torch.cat([self.pend_ids[~seen], m_ids[keep_new]])
        p_cnt = torch.cat([self.pend_count[~seen], total[keep_new]])
        p_last = torch.cat([self.pend_last[~seen], torch.full_like(total[keep_new], t)])
        excess = p_ids.numel() - self.pending_capacity
        if excess > 0:
            o = torch.argsort(p_ids)
            o = o[torch.argsort(p_last[o], stable=True)]
            keep = torch.sort(o[excess:]).values
            p_ids, p_cnt, p_last = p_ids[keep], p_cnt[keep], p_last[keep]
            self.counters["pending_dropped"] += excess
        o = torch.argsort(p_ids)
        self.pend_ids, self.pend_count, self.pend_last = p_ids[o], p_cnt[o], p_last[o]
        self._rebuild_index()
        # 7. rows of the batch after admission
        idx = self._find(self._sorted_ids, uniq)
        rows = self._gather(self._sorted_rows, idx)[inv]
        c = self.counters
        collisions = int((rows == 0).sum())
        c["lookups"] += n
        c["collisions"] += collisions
        c["hits"] += n - collisions
        c["admissions"] += int(adm_rows.numel())
        c["evictions"] += int(ev_rows.numel())
        return Assignment(rows.view(ids.shape), adm_ids, adm_rows, ev_ids, ev_rows)

    def mapping(self) -> dict[int, int]:
        """id -> row of every resident id (a host copy, for inspection and tests)."""
        return dict(zip(self._sorted_ids.tolist(), self._sorted_rows.tolist()))

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (``torch.load(..., weights_only=True)`` reads them), config included for checking."""
        return {
            "config": torch.tensor([self.num_rows, self.admit_after, POLICIES.index(self.policy),
                                    -1 if self.ttl is None else self.ttl, self.pending_capacity]),
            "step": torch.tensor(self.step),
            "counters": torch.tensor([self.counters[k] for k in _COUNTERS]),
            "row_id": self.row_id.clone(), "row_used": self.row_used.clone(),
            "row_last": self.row_last.clone(), "row_freq": self.row_freq.clone(),
            "pend_ids": self.pend_ids.clone(), "pend_count": self.pend_count.clone(),
            "pend_last": self.pend_last.clone(),
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        want = self.state_dict()
        missing = sorted(set(want) - set(state))
        if missing:
            raise FormatError(f"managed table {self.name!r}: state lacks {missing}")
        if state["config"].tolist() != want["config"].tolist():
            raise FormatError(f"managed table {self.name!r}: saved config (num_rows, admit_after, policy, ttl, "
                              f"pending_capacity) {state['config'].tolist()} differs from this table's "
                              f"{want['config'].tolist()}")
        dev = self.device
        for k in ("row_id", "row_used", "row_last", "row_freq"):
            if tuple(state[k].shape) != (self.num_rows,):
                raise FormatError(f"managed table {self.name!r}: {k} has shape {tuple(state[k].shape)}, "
                                  f"expected ({self.num_rows},)")
            setattr(self, k, state[k].to(dev).clone())
        for k in ("pend_ids", "pend_count", "pend_last"):
            setattr(self, k, state[k].to(dev, torch.int64).clone())
        self.step = int(state["step"])
        self.counters = dict(zip(_COUNTERS, (int(v) for v in state["counters"].tolist())))
        used = torch.nonzero(self.row_used, as_tuple=True)[0]
        self._fresh = int(used.max()) + 1 if used.numel() else 1
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for name, t in self.tables.items() for k, v in t.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, t in self.tables.items():
            prefix = f"{name}."
            t.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


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
