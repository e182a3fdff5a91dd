"""Data-parallel replication of hot partitions (OPER section 4.3).

* Inference: Algorithm 1. Every rank in turn looks at its most expensive incoming link, takes the
  hottest partition it fetches over that link that fits in its free memory, stores a replica, and
  every other rank that can now read that partition over a cheaper link re-points its fetch path to
  the new holder (lines 13-20). A rank stops when nothing it fetches fits any more.
* Training: a row is worth replicating on every rank only when its per-sample frequency
  ``f > BW_P2P / (Batch_Size * BW_AR)`` (eqs. 4-5); among those rows, the hottest per byte are
  replicated until the extra-memory budget is used (``training_hot_rows``). The room placement leaves
  then takes single copies that still pass the same test, per copy (``training_fill``; our addition:
  OPER copies to all ranks only).
"""

from __future__ import annotations

import heapq

import numpy as np

from embedscale.errors import ConfigError


class _Candidates:
    """Partitions one rank fetches over one link, hottest per byte first: a sorted array plus a heap
    for partitions re-pointed to this link later (Algorithm 1 line 16)."""

    __slots__ = ("arr", "ptr", "heap")

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr.tolist()
        self.ptr = 0
        self.heap: list[tuple[float, int]] = []

    def peek(self, key: np.ndarray) -> int:
        a = self.arr[self.ptr] if self.ptr < len(self.arr) else -1
        h = self.heap[0][1] if self.heap else -1
        if a < 0:
            return h
        if h < 0:
            return a
        return a if key[a] <= key[h] else h

    def pop(self, q: int) -> None:
        if self.ptr < len(self.arr) and self.arr[self.ptr] == q:
            self.ptr += 1
        else:
            heapq.heappop(self.heap)

    def push(self, keyval: float, q: int) -> None:
        heapq.heappush(self.heap, (keyval, q))


class _GainCandidates:
    """Everything one rank reads remotely, largest cost saved per byte first (``choice="best_gain"``)."""

    __slots__ = ("arr", "src", "keys", "ptr", "heap")

    def __init__(self, arr: np.ndarray, src: np.ndarray, keys: np.ndarray) -> None:
        self.arr, self.src, self.keys = arr.tolist(), src.tolist(), keys.tolist()
        self.ptr = 0
        self.heap: list[tuple[float, int, int]] = []

    def peek(self) -> tuple[int, int]:
        a = self.ptr < len(self.arr)
        if self.heap and (not a or self.heap[0][0] < self.keys[self.ptr]):
            return self.heap[0][1], self.heap[0][2]
        if a:
            return self.arr[self.ptr], self.src[self.ptr]
        return -1, -1

    def pop(self) -> None:
        a = self.ptr < len(self.arr)
        if self.heap and (not a or self.heap[0][0] < self.keys[self.ptr]):
            heapq.heappop(self.heap)
        else:
            self.ptr += 1

    def push(self, keyval: float, q: int, src: int) -> None:
        heapq.heappush(self.heap, (keyval, q, src))


def algorithm1(
    holders: np.ndarray,
    fetch: np.ndarray,
    part_volume: np.ndarray,
    part_bytes: np.ndarray,
    cost: np.ndarray,
    available: np.ndarray,
    exhaust_links: bool = True,
    order: str = "max_comm",
    choice: str = "max_link",
) -> dict:
    """OPER Algorithm 1 (EMT data parallelism for inference), in place on ``holders`` and ``fetch``.

    Args:
        holders, fetch: ``[P, M]`` as in ``Plan`` (modified in place).
        part_volume: ``[P]`` bytes each rank reads from the partition per iteration (``A_p * S_p``).
        part_bytes: ``[P]`` footprint (``p.mem``).
        cost: ``[M, M]`` OPER ``L`` (microseconds per byte).
        available: ``[M]`` free bytes per rank (``Ava_Mem``, modified in place).
        exhaust_links: when the most expensive link has nothing that fits, try the next link instead
            of stopping the rank (the paper stops; this only ever replicates more within memory).

        order: ``max_comm`` (default): each step serves the rank with the highest communication cost,
            the target GPU the text of 4.3 describes ("we first identify the target GPU with the highest
            communication cost"); ``round_robin``: every rank once per round, as the pseudo-code's loop.

        choice: ``max_link`` (the pseudo-code, lines 4-6): the hottest partition per byte on the rank's
            most expensive link; ``best_gain``: over all its links, the partition whose replica saves
            the rank the most cost per byte (``A_p S_p (L[gid][src] - L[gid][gid]) / p.mem``).

    Line 7 tests ``p.mem <= Ava_Mem`` (the paper prints ``<``): a partition that exactly fills the
    remaining memory fits.

    Returns:
        ``{"replicas": count, "bytes": per-rank bytes added, "rounds": rounds}``.
    """
    p, m = holders.shape
    vol = np.asarray(part_volume, dtype=np.float64)
    nb = np.asarray(part_bytes, dtype=np.float64)
    density = vol / np.maximum(nb, 1.0)
    key = -density  # smaller key = better candidate
    cl = np.zeros((m, m))
    for i in range(m):
        cl[i] = np.bincount(fetch[:, i], weights=vol, minlength=m) * cost[i]
    by_density = np.argsort(key, kind="stable")
    cands: list[list[_Candidates | None]] = []
    for i in range(m):
        f_i = fetch[by_density, i]
        row = []
        for j in range(m):
            row.append(None if j == i else _Candidates(by_density[(f_i == j) & (vol[by_density] > 0)]))
        cands.append(row)
    added = np.zeros(m)
    stop = np.zeros(m, dtype=bool)
    count = rounds = 0
    eps = 1e-12
    if order not in ("max_comm", "round_robin"):
        raise ConfigError(f"algorithm1: order {order!r} is not 'max_comm' or 'round_robin'")
    if choice not in ("max_link", "best_gain"):
        raise ConfigError(f"algorithm1: choice {choice!r} is not 'max_link' or 'best_gain'")
    gains: list[_GainCandidates] = []
    if choice == "best_gain":
        for i in range(m):
            src = fetch[:, i]
            g = vol * (cost[i, src] - cost[i, i]) / np.maximum(nb, 1.0)
            ok = np.flatnonzero(~holders[:, i] & (vol > 0))
            idx = ok[np.argsort(-g[ok], kind="stable")]
            gains.append(_GainCandidates(idx, src[idx], -g[idx]))
    off = ~np.eye(m, dtype=bool)

    def next_ranks():
        if order == "round_robin":
            return [g for g in range(m) if not stop[g]]
        load = np.where(off, cl, 0.0).sum(axis=1)
        load[stop] = -np.inf
        return [int(np.argmax(load))]

    while not stop.all():
        rounds += 1
        for gid in next_ranks():
            found = -1
            if choice == "best_gain":
                gc = gains[gid]
                while True:
                    q, src = gc.peek()
                    if q < 0:
                        break
                    gc.pop()
                    if fetch[q, gid] != src or holders[q, gid]:
                        continue  # stale entry
                    if nb[q] <= available[gid]:
                        found = q
                        break
                links = []
            else:
                row = cl[gid].copy()
                row[gid] = -np.inf
                links = [int(t) for t in np.argsort(-row, kind="stable") if t != gid and row[t] > eps]
                if not exhaust_links:
                    links = links[:1]
            for tid in links:
                c = cands[gid][tid]
                while True:
                    q = c.peek(key)
                    if q < 0:
                        break
                    if fetch[q, gid] != tid or holders[q, gid]:
                        c.pop(q)  # stale: re-pointed elsewhere or already local
                        continue
                    c.pop(q)
                    if nb[q] <= available[gid]:  # line 7 (free memory only shrinks: a miss is final)
                        found = q
                        break
                if found >= 0:
                    break
            if found < 0:
                stop[gid] = True
                continue
            q, tid = found, int(fetch[found, gid])
            holders[q, gid] = True  # lines 9-12
            fetch[q, gid] = gid
            cl[gid, tid] -= vol[q] * cost[gid, tid]
            cl[gid, gid] += vol[q] * cost[gid, gid]
            available[gid] -= nb[q]
            added[gid] += nb[q]
            count += 1
            for i in range(m):  # lines 13-20: peers re-point to the new holder when it is cheaper
                if i == gid or holders[q, i]:
                    continue
                oid = int(fetch[q, i])
                if cost[i, gid] < cost[i, oid]:
                    fetch[q, i] = gid
                    cl[i, oid] -= vol[q] * cost[i, oid]
                    cl[i, gid] += vol[q] * cost[i, gid]
                    cands[i][gid].push(key[q], q)
                    if choice == "best_gain":
                        gains[i].push(-vol[q] * (cost[i, gid] - cost[i, i]) / max(nb[q], 1.0), q, gid)
    return {"replicas": count, "bytes": added.tolist(), "rounds": rounds}


def training_hot_rows(heads: list[np.ndarray], row_bytes: np.ndarray, freq_threshold_count: float,
                      budget_bytes: float, world_size: int) -> np.ndarray:
    """How many leading (hottest) rows of each table to replicate on every rank for training (OPER 4.3).

    Args:
        heads: per table, the leading sorted counts (at least every row above the threshold).
        row_bytes: per table, bytes per row.
        freq_threshold_count: a row qualifies when its count exceeds this (``f_thr * samples``).
        budget_bytes: bytes each rank may spend on replicas.

    Returns:
        ``[T]`` prefix lengths. Rows are taken hottest per byte first across tables, so each table's
        choice is a prefix of its sorted order.
    """
    t = len(heads)
    if world_size <= 1 or budget_bytes <= 0:
        return np.zeros(t, dtype=np.int64)
    kmax = np.array([int(np.count_nonzero(h > freq_threshold_count)) for h in heads], dtype=np.int64)
    if kmax.sum() == 0:
        return kmax
    cnt = np.concatenate([h[:k] for h, k in zip(heads, kmax)])
    tab = np.repeat(np.arange(t), kmax)
    rb = np.asarray(row_bytes, dtype=np.float64)[tab]
    order = np.lexsort((np.arange(cnt.size), -(cnt / rb)))
    cum = np.cumsum(rb[order])
    take = int(np.searchsorted(cum, budget_bytes, side="right"))
    chosen = tab[order[:take]]
    k = np.bincount(chosen, minlength=t).astype(np.int64)
    if np.any(k > kmax):  # pragma: no cover - guarded by construction
        raise ConfigError("training replication chose more rows than qualify")
    return k


def training_fill(
    holders: np.ndarray,
    fetch: np.ndarray,
    part_volume: np.ndarray,
    part_bytes: np.ndarray,
    cost: np.ndarray,
    available: np.ndarray,
    total: np.ndarray,
    allreduce_bw: float,
    grad_factor: float = 2.0,
    max_replicas: int = 100_000,
    sync_volume: np.ndarray | None = None,
) -> dict:
    """Training replicas in the room the all-rank replicas of ``training_hot_rows`` leave (OPER 4.3, eqs. 4-5).

    ``training_hot_rows`` copies whole rows to every rank while the budget lasts; placement then leaves
    each rank some free memory (packing slack, budget given back when placement did not fit), while
    partitions that pass OPER's test may remain single. Copying partition ``p`` to one more rank ``x``
    changes the iteration's summed cost by

        - A_p S_p (g L[x][src] + L[src][src] - L[x][x]) + 2 p.mem / BW_AR

    (``x`` stops fetching it and looks it up locally, its source stops looking it up for ``x``; the
    ring AllReduce of ``h`` holders moves ``2 (h-1)/h p.mem`` per holder, ``2 (h-1) p.mem`` in all, so
    one more holder adds ``2 p.mem``). On a uniform machine this is negative exactly when OPER's
    ``f > BW_P2P / (B BW_AR)`` holds (eq. 4 > eq. 5), for any number of holders: the rule, applied per
    copy; across hosts it also admits copies of rows read over the slow links only. Each step takes,
    among the copies that lower that sum and fit a rank's free memory, the one that saves the most per
    byte (the hottest first, as 4.3 ranks rows), on the rank it leaves with the lowest (largest, second
    largest) per-rank cost; peers re-point to the new holder when it is cheaper (Algorithm 1 lines 13-20).

    Args:
        holders, fetch: ``[P, M]`` as in ``Plan`` (modified in place).
        part_volume: ``[P]`` bytes each rank reads from the partition per iteration (``A_p * S_p``).
        part_bytes: ``[P]`` footprint.
        cost: ``[M, M]`` OPER ``L`` (microseconds per byte).
        available: ``[M]`` free bytes per rank (modified in place).
        total: ``[M]`` each rank's lookup-plus-communication cost (modified in place, latency aside).
        allreduce_bw: ``BW_AR`` in GB/s.
        grad_factor: ``g``, 2 in training (eq. 4).
        sync_volume: ``None``: eq. 5 as above. Given (``[P]`` bytes each rank sends per iteration to sync the
            partition once it is replicated: ``2 (M-1)/M U_p S_p``, ``plan.cost``): the executor's sync, a sparse
            AllReduce over all ranks of the rows the global batch touched (OPER 5.3). Its cost is paid by
            every rank from the partition's second holder on, and a third holder adds nothing to it; the
            volumes are then distinct rows (``traffic="distinct"``).

    Returns:
        ``{"replicas": count, "bytes": per-rank bytes added}``.
    """
    p, m = holders.shape
    vol = np.asarray(part_volume, dtype=np.float64)
    nb = np.asarray(part_bytes, dtype=np.float64)
    ar = 1.0 / (allreduce_bw * 1e3)  # us per byte
    loc = np.diag(cost)
    g = float(grad_factor)
    # a copy can only pay when it would even from the costliest source to the cheapest rank
    remote = np.where(~np.eye(m, dtype=bool), cost, 0.0)
    sv = None if sync_volume is None else np.asarray(sync_volume, dtype=np.float64)

    def sync_added(q: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Summed cost one more holder adds to the replicas' sync: eq. 5's ``2 p.mem``, or the executor's
        sync on all ``m`` ranks when the partition had a single holder."""
        if sv is None:
            return 2.0 * ar * nb[q]
        return np.where(h == 1, m * ar * sv[q], 0.0)

    best_case = vol * (g * remote.max() + loc.max() - loc.min()) - sync_added(np.arange(p), holders.sum(axis=1))
    cand = np.flatnonzero((best_case > 0) & ~holders.all(axis=1))
    added = np.zeros(m)
    count = 0
    ranks = np.arange(m)
    while cand.size and count < max_replicas:
        v, b, hl, f = vol[cand], nb[cand], holders[cand], fetch[cand]
        h = hl.sum(axis=1).astype(np.float64)
        ar_new, ar_old = 2.0 * h / (h + 1) * b * ar, 2.0 * (h - 1) / h * b * ar
        added_sync = sync_added(cand, h)
        delta = np.zeros((cand.size, m, m))  # [candidate, new holder x, rank]
        gain = np.zeros((cand.size, m))
        for x in range(m):
            src = f[:, x]
            gain[:, x] = v * (g * cost[x, src] + loc[src] - loc[x]) - added_sync
            dx = delta[:, x, :]
            if sv is None:
                dx += hl * (ar_new - ar_old)[:, None]  # the holders' AllReduce share grows
                dx[:, x] += ar_new
            else:  # every rank takes part in the executor's sync, holder or not
                dx += (added_sync / m)[:, None]
            dx[:, x] += v * (loc[x] - g * cost[x, src])
            np.subtract.at(dx, (np.arange(cand.size), src), v * loc[src])
            for i in range(m):  # peers that re-point to x (lines 13-20)
                if i == x:
                    continue
                o = f[:, i]
                rp = ~hl[:, i] & (cost[i, x] < cost[i, o])
                if rp.any():
                    k = np.flatnonzero(rp)
                    dx[k, i] += g * v[k] * (cost[i, x] - cost[i, o[k]])
                    dx[k, x] += v[k] * loc[x]
                    np.subtract.at(dx, (k, o[k]), v[k] * loc[o[k]])
        ok = ~hl & (b[:, None] <= available[None, :]) & (gain > 0)
        if not ok.any():
            break
        # the copy that saves the most per byte (OPER's hottest first); among equally good ones, the
        # rank it leaves the lowest (largest, second largest) per-rank cost
        density = np.where(ok, gain / np.maximum(b, 1.0)[:, None], -np.inf)
        ok &= density >= density.max() * (1 - 1e-9)
        new = total[None, None, :] + delta
        top2 = -np.partition(-new, 1, axis=2)[:, :, :2]
        inf = np.inf
        key = np.lexsort((np.where(ok, top2[:, :, 1], inf).ravel(), np.where(ok, top2[:, :, 0], inf).ravel()))[0]
        c, x = np.unravel_index(key, ok.shape)
        q, x = int(cand[c]), int(x)
        total += delta[c, x]
        rp = ~holders[q] & (cost[:, x] < cost[ranks, fetch[q]])
        rp[x] = False
        holders[q, x] = True
        fetch[q, x] = x
        fetch[q, rp] = x
        available[x] -= nb[q]
        added[x] += nb[q]
        count += 1
        if holders[q].all():
            cand = cand[cand != q]
    return {"replicas": count, "bytes": added.tolist()}
