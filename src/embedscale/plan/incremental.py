"""An incremental re-plan: keep the running placement, move only the rows that pay (live re-planning).

OPER section 8 re-plans when the input drifts; a plan made from scratch (``plan.drift``'s fresh plan) sorts
every table's rows by the new counts, so even its cold rows land on other ranks: half of every table moves
on 2 ranks when one hot row changes. The live migration then costs in proportion to the tables. Here the
running plan is the start, and only these change:

1. replicas: the fresh plan's replicated rows (OPER section 4.3, within its memory budget) get its holder
   sets; the running plan's replicas it does not keep are dropped (a replicated row keeps its owner when
   that rank still holds it);
2. balance: with the new profile's lookups (eq. 2: a row read from its owner by every rank loads the owner
   with ``W * A_k * S_k``), rows move from the most to the least loaded rank, each time the row closest to
   half the gap (no larger: the two ranks never swap places), hottest candidates first, until the lookup
   DoB reaches ``target_dob`` or ``max_moves`` rows have moved.

:func:`incremental_plan` returns the plan (partitions = runs of rows with the same owner and holder set,
``part_counts`` of the new profile) and the number of rows whose owner changed; the caller (``train.replan``)
prefers it to the fresh plan when its bottleneck cost is close enough.
"""

from __future__ import annotations

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.cost import partition_counts, profile_samples, table_counts
from embedscale.plan.plan import Plan


def row_placement(plan: Plan, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of table ``t``: its owner (int64) and its holders as a bit mask (bit ``j``: rank ``j`` stores it)."""
    sl = plan.table_partitions(t)
    lens = plan.part_rows[sl]
    bits = (plan.holders[sl].astype(np.int64) << np.arange(plan.world_size, dtype=np.int64)).sum(axis=1)
    order = plan.order(t)
    owner = np.empty(plan.tables[t].num_rows, dtype=np.int64)
    mask = np.empty(plan.tables[t].num_rows, dtype=np.int64)
    owner[order] = np.repeat(plan.owner_of_part[sl].astype(np.int64), lens)
    mask[order] = np.repeat(bits, lens)
    return owner, mask


def plan_from_rows(tables, world: int, owners: list[np.ndarray], masks: list[np.ndarray], meta: dict) -> Plan:
    """A ``Plan`` from per-row owners and holder bit masks (owner included): one partition per run of rows
    with the same owner and holders (rows in id order within it)."""
    if world > 62:
        raise ConfigError(f"incremental plan: holder bit masks hold at most 62 ranks, got {world}")
    orders, ptab, pstart, pstop, pown, phold = [], [], [], [], [], []
    for t, (own, mask) in enumerate(zip(owners, masks)):
        if np.any((mask >> own) & 1 == 0):
            raise ConfigError(f"incremental plan: table {tables[t].name}: an owner that does not hold its row")
        key = own * (np.int64(1) << world) + mask
        order = np.argsort(key, kind="stable")
        k = key[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        stops = np.r_[starts[1:], k.size]
        orders.append(order.astype(np.int64))
        ptab.append(np.full(starts.size, t))
        pstart.append(starts)
        pstop.append(stops)
        pown.append(own[order[starts]])
        m = mask[order[starts]]
        phold.append(((m[:, None] >> np.arange(world)) & 1).astype(bool))
    return Plan(tables, world, orders, np.concatenate(ptab), np.concatenate(pstart), np.concatenate(pstop),
                np.concatenate(pown), holders=np.concatenate(phold), meta=dict(meta))


def incremental_plan(plan: Plan, fresh: Plan, profile, *, batch_size: int, target_dob: float = 0.98,
                     max_moves: int | None = None, candidates: int = 4096) -> tuple[Plan, int]:
    """The running ``plan`` with ``fresh``'s replicas and the fewest row moves that balance the lookups of
    ``profile`` (module docstring). Returns ``(plan, rows whose owner changed)``.

    Args:
        plan, fresh: the running plan and a plan made from scratch for ``profile`` (same tables and ranks).
        profile: the new per-row access counts (``table_names``, ``counts(name)``, ``samples``).
        batch_size: samples per rank per iteration (``A_k = B c_k / samples``).
        target_dob: stop moving rows once the lookup DoB (min / max) reaches it.
        max_moves: at most this many rows change owner (default: 2% of all rows, at least 64).
        candidates: the hottest rows of each rank considered for a move.
    """
    W = plan.world_size
    if fresh.world_size != W or [t.name for t in fresh.tables] != [t.name for t in plan.tables]:
        raise ConfigError("incremental plan: the fresh plan has other tables or ranks than the running one")
    total_rows = sum(t.num_rows for t in plan.tables)
    max_moves = max(64, total_rows // 50) if max_moves is None else int(max_moves)
    scale = batch_size / profile_samples(profile)
    owners, masks, vals, running = [], [], [], []
    load = np.zeros(W)
    full = (np.int64(1) << np.arange(W, dtype=np.int64))
    for t, tab in enumerate(plan.tables):
        own, mask = row_placement(plan, t)
        running.append(own)
        f_own, f_mask = row_placement(fresh, t)
        rep = (f_mask & (f_mask - 1)) != 0  # more than one holder: a replicated row
        new_own = own.copy()
        keep = rep & (((f_mask >> own) & 1) == 1)
        new_own[rep & ~keep] = f_own[rep & ~keep]
        new_mask = np.where(rep, f_mask, np.int64(1) << new_own)
        c = table_counts(profile, tab.name, tab.num_rows).astype(np.float64) * scale * tab.row_bytes
        # eq. 2: a replicated row is read by each holder from itself and by the others from its owner
        held = (new_mask[:, None] >> np.arange(W)) & 1
        fetchers_of_owner = W - held.sum(axis=1) + 1
        load += np.bincount(new_own, weights=c * fetchers_of_owner, minlength=W)
        load += (held * c[:, None]).sum(axis=0) - np.bincount(new_own, weights=c, minlength=W)
        owners.append(new_own)
        masks.append(new_mask)
        vals.append(np.where(rep, 0.0, c * W))  # what moving the row shifts from its owner to another rank
    # candidates per rank: the hottest non-replicated rows, as (value, table, row), value ascending
    cand = []
    for j in range(W):
        v = np.concatenate([np.where(o == j, x, 0.0) for o, x in zip(owners, vals)])
        top = np.argsort(v, kind="stable")[-candidates:]
        top = top[v[top] > 0]
        cand.append([v[top], top])
    base = np.cumsum([0] + [t.num_rows for t in plan.tables])
    moved = 0
    while moved < max_moves:
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        if load[hi] <= 0 or load[lo] / load[hi] >= target_dob:
            break
        gap = load[hi] - load[lo]
        v, ids = cand[hi]
        if v.size == 0:
            break
        i = int(np.searchsorted(v, gap / 2, side="right")) - 1  # the largest value <= gap / 2
        if i < 0:
            break
        val, g = float(v[i]), int(ids[i])
        cand[hi] = [np.delete(v, i), np.delete(ids, i)]
        t = int(np.searchsorted(base, g, side="right")) - 1
        r = g - base[t]
        owners[t][r] = lo
        masks[t][r] = full[lo]
        load[hi] -= val
        load[lo] += val
        moved += 1
    meta = {**fresh.meta, "incremental": True, "rows_rebalanced": moved}
    out = plan_from_rows(plan.tables, W, owners, masks, meta)
    out.part_counts = partition_counts(out, profile)
    changed = sum(int(np.count_nonzero(o != r)) for o, r in zip(owners, running))
    return out, changed
