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
    state = _Algorithm1(holders, fetch, part_volume, part_bytes, cost, available, exhaust_links, order, choice)
    return state.run()


class _Algorithm1:
    """Algorithm 1's state: each rank's per-link communication cost ``cl`` (``[M, M]``, lines 2-3) and, per
    rank, the partitions it fetches, by link and hottest per byte first (``max_link``) or by the cost a replica
    saves it (``best_gain``)."""

    def __init__(self, holders, fetch, part_volume, part_bytes, cost, available, exhaust_links, order,
                 choice) -> None:
        p, m = holders.shape
        self.holders, self.fetch, self.cost, self.available = holders, fetch, cost, available
        self.m, self.exhaust_links, self.order, self.choice = m, exhaust_links, order, choice
        vol = self.vol = np.asarray(part_volume, dtype=np.float64)
        nb = self.nb = np.asarray(part_bytes, dtype=np.float64)
        density = vol / np.maximum(nb, 1.0)
        key = self.key = -density  # smaller key = better candidate
        cl = self.cl = np.zeros((m, m))
        for i in range(m):
            cl[i] = np.bincount(fetch[:, i], weights=vol, minlength=m) * cost[i]
        by_density = np.argsort(key, kind="stable")
        self.cands: list[list[_Candidates | None]] = []
        for i in range(m):
            f_i = fetch[by_density, i]
            row = []
            for j in range(m):
                row.append(None if j == i else _Candidates(by_density[(f_i == j) & (vol[by_density] > 0)]))
            self.cands.append(row)
        self.added = np.zeros(m)
        self.stop = np.zeros(m, dtype=bool)
        self.count = self.rounds = 0
        if order not in ("max_comm", "round_robin"):
            raise ConfigError(f"algorithm1: order {order!r} is not 'max_comm' or 'round_robin'")
        if choice not in ("max_link", "best_gain"):
            raise ConfigError(f"algorithm1: choice {choice!r} is not 'max_link' or 'best_gain'")
        self.gains: list[_GainCandidates] = []
        if choice == "best_gain":
            for i in range(m):
                src = fetch[:, i]
                g = vol * (cost[i, src] - cost[i, i]) / np.maximum(nb, 1.0)
                ok = np.flatnonzero(~holders[:, i] & (vol > 0))
                idx = ok[np.argsort(-g[ok], kind="stable")]
                self.gains.append(_GainCandidates(idx, src[idx], -g[idx]))
        self.off = ~np.eye(m, dtype=bool)

    def run(self) -> dict:
        """Serve ranks until every one has stopped (nothing it fetches fits its free memory any more)."""
        while not self.stop.all():
            self.rounds += 1
            for gid in self.next_ranks():
                found = self.pick_by_gain(gid) if self.choice == "best_gain" else self.pick_on_links(gid)
                if found < 0:
                    self.stop[gid] = True
                    continue
                self.replicate(found, gid)
        return {"replicas": self.count, "bytes": self.added.tolist(), "rounds": self.rounds}

    def next_ranks(self) -> list[int]:
        """``round_robin``: every rank not stopped; ``max_comm``: the one with the highest communication cost."""
        if self.order == "round_robin":
            return [g for g in range(self.m) if not self.stop[g]]
        load = np.where(self.off, self.cl, 0.0).sum(axis=1)
        load[self.stop] = -np.inf
        return [int(np.argmax(load))]

    def pick_by_gain(self, gid: int) -> int:
        """``best_gain``: the partition whose replica saves rank ``gid`` the most per byte and fits; -1 if none."""
        gc = self.gains[gid]
        while True:
            q, src = gc.peek()
            if q < 0:
                return -1
            gc.pop()
            if self.fetch[q, gid] != src or self.holders[q, gid]:
                continue  # stale entry
            if self.nb[q] <= self.available[gid]:
                return q

    def pick_on_links(self, gid: int) -> int:
        """``max_link`` (lines 4-8): the hottest partition per byte on rank ``gid``'s most expensive link that fits
        (with ``exhaust_links``, on the next links when none does); -1 if none."""
        eps = 1e-12
        row = self.cl[gid].copy()
        row[gid] = -np.inf
        links = [int(t) for t in np.argsort(-row, kind="stable") if t != gid and row[t] > eps]
        if not self.exhaust_links:
            links = links[:1]
        for tid in links:
            c = self.cands[gid][tid]
            while True:
                q = c.peek(self.key)
                if q < 0:
                    break
                if self.fetch[q, gid] != tid or self.holders[q, gid]:
                    c.pop(q)  # stale: re-pointed elsewhere or already local
                    continue
                c.pop(q)
                if self.nb[q] <= self.available[gid]:  # line 7 (free memory only shrinks: a miss is final)
                    return q
        return -1

    def replicate(self, q: int, gid: int) -> None:
        """Lines 9-20: store a replica of ``q`` on ``gid``; peers re-point to it when it is cheaper."""
        holders, fetch, cost, vol, cl = self.holders, self.fetch, self.cost, self.vol, self.cl
        tid = int(fetch[q, gid])
        holders[q, gid] = True  # lines 9-12
        fetch[q, gid] = gid
        cl[gid, tid] -= vol[q] * cost[gid, tid]
        cl[gid, gid] += vol[q] * cost[gid, gid]
        self.available[gid] -= self.nb[q]
        self.added[gid] += self.nb[q]
        self.count += 1
        for i in range(self.m):  # lines 13-20: peers re-point to the new holder when it is cheaper
            if i == gid or holders[q, i]:
                continue
            oid = int(fetch[q, i])
            if cost[i, gid] < cost[i, oid]:
                fetch[q, i] = gid
                cl[i, oid] -= vol[q] * cost[i, oid]
                cl[i, gid] += vol[q] * cost[i, gid]
                self.cands[i][gid].push(self.key[q], q)
                if self.choice == "best_gain":
                    self.gains[i].push(-vol[q] * (cost[i, gid] - cost[i, i]) / max(self.nb[q], 1.0), q, gid)


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
    fill = _TrainingFill(holders, fetch, part_volume, part_bytes, cost, available, total, allreduce_bw, grad_factor,
                         sync_volume)
    return fill.run(max_replicas)


class _TrainingFill:
    """``training_fill``'s state: the plan's arrays (edited in place) and the cost terms of one more copy."""

    def __init__(self, holders, fetch, part_volume, part_bytes, cost, available, total, allreduce_bw, grad_factor,
                 sync_volume) -> None:
        self.holders, self.fetch, self.cost, self.available, self.total = holders, fetch, cost, available, total
        self.p, self.m = holders.shape
        self.vol = np.asarray(part_volume, dtype=np.float64)
        self.nb = np.asarray(part_bytes, dtype=np.float64)
        self.ar = 1.0 / (allreduce_bw * 1e3)  # us per byte
        self.loc = np.diag(cost)
        self.g = float(grad_factor)
        # a copy can only pay when it would even from the costliest source to the cheapest rank
        self.remote = np.where(~np.eye(self.m, dtype=bool), cost, 0.0)
        self.sv = None if sync_volume is None else np.asarray(sync_volume, dtype=np.float64)

    def sync_added(self, q: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Summed cost one more holder adds to the replicas' sync: eq. 5's ``2 p.mem``, or the executor's
        sync on all ``m`` ranks when the partition had a single holder."""
        if self.sv is None:
            return 2.0 * self.ar * self.nb[q]
        return np.where(h == 1, self.m * self.ar * self.sv[q], 0.0)

    def run(self, max_replicas: int) -> dict:
        """Take the best copy while one lowers the summed cost and fits (at most ``max_replicas``)."""
        vol, loc, m, holders = self.vol, self.loc, self.m, self.holders
        best_case = (vol * (self.g * self.remote.max() + loc.max() - loc.min())
                     - self.sync_added(np.arange(self.p), holders.sum(axis=1)))
        cand = np.flatnonzero((best_case > 0) & ~holders.all(axis=1))
        added = np.zeros(m)
        count = 0
        while cand.size and count < max_replicas:
            gain, delta = self.copy_effects(cand)
            chosen = self.choose(cand, gain, delta)
            if chosen is None:
                break
            c, x = chosen
            q = int(cand[c])
            self.add_copy(q, x, delta[c, x])
            added[x] += self.nb[q]
            count += 1
            if holders[q].all():
                cand = cand[cand != q]
        return {"replicas": count, "bytes": added.tolist()}

    def copy_effects(self, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For a copy of each candidate on each rank ``x``: the summed cost it saves (``gain``, ``[C, M]``) and
        how it changes every rank's cost (``delta``, ``[C, M new holder, M rank]``), peers re-pointing to
        ``x`` included (Algorithm 1 lines 13-20)."""
        cost, loc, g, m = self.cost, self.loc, self.g, self.m
        v, b, hl, f = self.vol[cand], self.nb[cand], self.holders[cand], self.fetch[cand]
        h = hl.sum(axis=1).astype(np.float64)
        ar_new, ar_old = 2.0 * h / (h + 1) * b * self.ar, 2.0 * (h - 1) / h * b * self.ar
        added_sync = self.sync_added(cand, h)
        delta = np.zeros((cand.size, m, m))  # [candidate, new holder x, rank]
        gain = np.zeros((cand.size, m))
        for x in range(m):
            src = f[:, x]
            gain[:, x] = v * (g * cost[x, src] + loc[src] - loc[x]) - added_sync
            dx = delta[:, x, :]
            if self.sv is None:
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
        return gain, delta

    def choose(self, cand: np.ndarray, gain: np.ndarray, delta: np.ndarray) -> tuple[int, int] | None:
        """The copy that saves the most per byte (OPER's hottest first) and fits; among equally good ones, the
        rank it leaves the lowest (largest, second largest) per-rank cost. None when no copy pays and fits."""
        b, hl = self.nb[cand], self.holders[cand]
        ok = ~hl & (b[:, None] <= self.available[None, :]) & (gain > 0)
        if not ok.any():
            return None
        density = np.where(ok, gain / np.maximum(b, 1.0)[:, None], -np.inf)
        ok &= density >= density.max() * (1 - 1e-9)
        new = self.total[None, None, :] + delta
        top2 = -np.partition(-new, 1, axis=2)[:, :, :2]
        inf = np.inf
        key = np.lexsort((np.where(ok, top2[:, :, 1], inf).ravel(), np.where(ok, top2[:, :, 0], inf).ravel()))[0]
        c, x = np.unravel_index(key, ok.shape)
        return c, int(x)

    def add_copy(self, q: int, x: int, delta: np.ndarray) -> None:
        """Store a copy of ``q`` on ``x``; peers re-point to it when it is cheaper (Algorithm 1 lines 13-20)."""
        holders, fetch, cost = self.holders, self.fetch, self.cost
        self.total += delta
        rp = ~holders[q] & (cost[:, x] < cost[np.arange(self.m), fetch[q]])
        rp[x] = False
        holders[q, x] = True
        fetch[q, x] = x
        fetch[q, rp] = x
        self.available[x] -= self.nb[q]
