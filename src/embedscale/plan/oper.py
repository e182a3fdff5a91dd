"""The ``oper`` strategy: OPER's optimality-guided heuristic (section 4, Fig. 3) end to end.

1. Sort every table's rows by access (4.1) and, in training, set aside the rows worth replicating on
   every rank (4.3, ``f > BW_P2P / (B * BW_AR)``) within the extra-memory budget.
2. Partition the rest under the access and memory threshold (4.1).
3. Balanced model parallelism (4.2): access-bound partitions by lookup load, then memory-bound ones by
   memory; if the degree of balance of memory or lookup misses the target, halve the threshold and
   repeat (the threshold refinement of 4.2).
4. Inference: Algorithm 1 fills each rank's free memory with replicas of the hot partitions it fetches,
   re-pointing fetch paths to the cheapest holder (4.3). Training: the memory step 1's all-rank copies
   left free takes single copies of partitions that still pass 4.3's test (``replicate.training_fill``).
5. Polish (our addition): partition moves and swaps that lower the largest per-rank cost.

Every step weighs what the executor pays (``traffic="distinct"``, the default; ``plan.cost``): a
partition's volume is the distinct rows a rank's batch reads of it (a remote row is fetched once per batch,
OPER 5.1), not its accesses (eq. 3), and a replica costs every rank the sparse AllReduce of its touched rows
(OPER 5.3, all ranks take part), not eq. 5's dense AllReduce among its holders (``plan.cost``). Step 1's
rule becomes, per row, ``u_k L_P2P > U_k / BW_AR`` (``u_k`` / ``U_k``: the probability the row is in a rank's /
the global batch): on one host with ``BW_AR = BW_P2P`` no row passes, since a replicated row is all-reduced
in every batch that any rank read it. ``traffic="access"`` plans by the paper's equations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.cost import (batch_presence, check_mode, check_traffic, dob, evaluate_arrays,
                                  profile_samples, training_replication_threshold)
from embedscale.plan.partition import Partitions, distinct_of, partition_tables, sort_tables
from embedscale.plan.place import balanced_model_parallel, lookup_cost_per_partition, polish
from embedscale.plan.plan import Plan
from embedscale.plan.replicate import algorithm1, training_fill, training_hot_rows
from embedscale.plan.topology import as_link_topology


def rank_capacity(topology, total_bytes: float, extra_memory: float, slack_bytes: float = 0.0) -> np.ndarray:
    """Bytes per rank: ``(1 + extra_memory) * total / M`` (OPER 6.1: the memory for tables is
    ``(1 + 5%)`` of their footprint), at least ``total / M + slack_bytes`` (room for the last
    indivisible partition when there is no extra memory), never above ``memory_per_rank``."""
    topo = as_link_topology(topology)
    m = topo.world_size
    if not (extra_memory >= 0 and np.isfinite(extra_memory)):
        raise ConfigError(f"extra_memory must be a finite number >= 0, got {extra_memory}")
    cap = max((1.0 + extra_memory) * total_bytes / m, total_bytes / m + slack_bytes)
    if topo.memory_per_rank > 0:
        if topo.memory_per_rank * m < total_bytes:
            raise ConfigError(
                f"tables need {int(total_bytes)} bytes but {m} ranks x memory_per_rank {topo.memory_per_rank} "
                f"= {topo.memory_per_rank * m} bytes"
            )
        cap = min(cap, float(topo.memory_per_rank))
    return np.full(m, cap)


def plan_oper(
    tables,
    profile,
    topology,
    *,
    mode: str = "training",
    extra_memory: float = 0.05,
    batch_size: int = 2048,
    threshold: float = 1e-3,
    balance_target: float = 0.99,
    min_threshold: float = 1e-5,
    max_partitions: int = 2_000_000,
    replicate: bool = True,
    exhaust_links: bool = True,
    polish_moves: int = 200,
    fill_rounds: int = 3,
    alg1_order: str = "max_comm",
    alg1_choice: str = "best_gain",
    sorted_tables=None,
    traffic: str = "distinct",
) -> Plan:
    """Plan with OPER (section 4). See the module docstring for the steps.

    Args:
        tables: ``TableSpec`` list.
        profile: anything with ``.table_names`` and ``.counts(name)`` (``samples`` optional).
        topology: ``specs.Topology`` or ``LinkTopology``.
        mode: ``training`` (frequency-threshold replication) or ``inference`` (Algorithm 1).
        extra_memory: replication budget as a fraction of the total table footprint (OPER: 5%).
        batch_size: samples per rank per iteration (turns counts into per-iteration accesses).
        threshold: initial partitioning threshold (fraction of total access and bytes; OPER: 0.1%).
        balance_target: refine the threshold until the DoB of memory and lookup reach this.
        min_threshold, max_partitions: where refinement stops.
        replicate: False skips step 1's replication and step 4 (so does ``extra_memory=0``; the slack
            of one partition that packing may need is never used for replicas).
        exhaust_links: see ``replicate.algorithm1``.
        alg1_order, alg1_choice: see ``replicate.algorithm1``.
        polish_moves: at most this many partition moves or swaps that lower the largest per-rank cost
            (``place.polish``, our addition; 0 = OPER's steps only).
        fill_rounds: training: at most this many rounds of ``replicate.training_fill`` + polish (0: none,
            OPER's all-rank copies only).
        traffic: ``distinct`` (plan against what the executor moves and syncs) or ``access`` (OPER's eqs. 3
            and 5); see the module docstring.
    """
    t0 = time.perf_counter()
    _check_arguments(mode, traffic, batch_size, balance_target)
    topo = as_link_topology(topology)
    tables = list(tables)
    replicate = replicate and extra_memory > 0  # 0% extra memory: pure model parallelism (OPER Table 2)
    st = sorted_tables if sorted_tables is not None else sort_tables(tables, profile)
    ctx = _OperContext.create(st, profile, topo, mode, traffic, extra_memory, batch_size, threshold)
    everywhere = _rows_for_every_rank(ctx, replicate)  # step 1
    alg1_options = {"replicate": replicate, "exhaust_links": exhaust_links, "order": alg1_order,
                    "choice": alg1_choice}
    history: list[dict] = []
    refine_options = {"threshold": threshold, "balance_target": balance_target, "min_threshold": min_threshold,
                      "max_partitions": max_partitions}
    best, thr_used = _partition_and_place(ctx, everywhere, alg1_options, refine_options, history)  # steps 2-4
    placement = _Placement(ctx, best)
    polish_stats: dict = {}
    moves = placement.polish_singles(polish_moves, polish_stats)  # step 5
    fill = None
    if ctx.mode == "training" and replicate and ctx.m > 1 and fill_rounds > 0:
        extra_moves, fill = _fill_and_polish(placement, fill_rounds, polish_moves, polish_stats)  # step 4, training
        moves += extra_moves
    meta = _oper_meta(ctx, everywhere, history, thr_used, balance_target, best["alg1"], fill, moves, polish_stats)
    plan = Plan(tables, ctx.m, [t.order for t in st], placement.table, placement.start, placement.stop,
                placement.own, placement.holders, placement.fetch, meta, part_counts=placement.counts)
    plan.meta["plan_seconds"] = time.perf_counter() - t0
    return plan


def _check_arguments(mode: str, traffic: str, batch_size: int, balance_target: float) -> None:
    check_mode(mode)
    check_traffic(traffic)
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if not 0 < balance_target <= 1:
        raise ConfigError(f"balance_target must be in (0, 1], got {balance_target}")


@dataclass
class _OperContext:
    """What every step of one OPER run reads: the sorted tables, the topology's costs, the rank capacity and
    how counts turn into per-iteration volumes (``traffic``; module docstring)."""

    st: list
    topo: object
    mode: str
    traffic: str
    extra_memory: float
    batch_size: int
    m: int
    samples: float
    rb: np.ndarray
    total_bytes: float
    mem_thr: float
    budget_cap: np.ndarray
    cap: np.ndarray  # placement's capacity: may overshoot an exactly-full rank by one memory-bound partition
    lb: np.ndarray
    local: np.ndarray
    scale: float
    distinct: bool
    ar_us: float
    p2p_us: float

    @classmethod
    def create(cls, st, profile, topo, mode, traffic, extra_memory, batch_size, threshold) -> "_OperContext":
        m = topo.world_size
        samples = profile_samples(profile)
        rb = np.array([t.row_bytes for t in st], dtype=np.float64)
        nrows = np.array([t.num_rows for t in st], dtype=np.int64)
        total_bytes = float((rb * nrows).sum())
        mem_thr = threshold if extra_memory <= 0 else min(threshold, extra_memory / (2 * m))
        budget_cap = rank_capacity(topo, total_bytes, extra_memory)
        # placement may overshoot an exactly-full rank by one memory-bound partition when there is no slack
        cap = rank_capacity(topo, total_bytes, extra_memory, max(mem_thr * total_bytes, float(rb.max())))
        lb = topo.cost_matrix()
        off = ~np.eye(m, dtype=bool)
        return cls(
            st=st, topo=topo, mode=mode, traffic=traffic, extra_memory=extra_memory, batch_size=batch_size, m=m,
            samples=samples, rb=rb, total_bytes=total_bytes, mem_thr=mem_thr, budget_cap=budget_cap, cap=cap,
            lb=lb, local=np.diag(lb).copy(),
            scale=batch_size / samples,  # count -> accesses per rank per iteration
            distinct=traffic == "distinct",
            ar_us=1.0 / (topo.allreduce_bw * 1e3),  # us per byte of the AllReduce
            p2p_us=float(lb[off].mean()) if m > 1 else 0.0,  # a fetch's us per byte, on average over the links
        )

    @property
    def slack(self) -> float:
        """One partition's worth of bytes: the most a memory-bound partition may hold."""
        return max(self.mem_thr * self.total_bytes, float(self.rb.max()))

    def volume(self, table, start, stop, counts):
        """Per partition: rows every rank reads per iteration (distinct rows, or accesses)."""
        return distinct_of(self.st, table, start, stop, self.scale, counts) if self.distinct else counts * self.scale

    def sync_rows(self, table, start, stop, counts):
        """Per partition: rows in the global batch (the replicas' sync), or None (eq. 5)."""
        if self.distinct and self.mode == "training":
            return distinct_of(self.st, table, start, stop, self.scale * self.m, counts)
        return None


@dataclass
class _EverywhereRows:
    """Step 1 (training, OPER 4.3, eqs. 4-5): per sorted table, the counts of the leading rows worth a copy on
    every rank (``heads``) and how many of them the budget takes, hottest per byte first (``hot``)."""

    heads: list
    thr_count: float | None
    budget: float
    hot: np.ndarray
    f_thr: float

    def give_back(self, ctx: _OperContext, attempt: int) -> None:
        """Replicas left too little room for the rest (memory balance is only as fine as a partition): give back
        one partition's worth of budget (the first 8 attempts), then halve it."""
        self.budget = self.budget - ctx.slack if attempt <= 8 else self.budget / 2
        self.hot = (training_hot_rows(self.heads, ctx.rb, self.thr_count, self.budget, ctx.m) if self.budget > 0
                    else np.zeros_like(self.hot))


def _rows_for_every_rank(ctx: _OperContext, replicate: bool) -> _EverywhereRows:
    """Step 1: the rows worth replicating on every rank for training (eqs. 4-5, or per row ``u_k L_P2P > U_k /
    BW_AR`` when ``traffic="distinct"``), hottest per byte within the extra-memory budget."""
    m, st = ctx.m, ctx.st
    rows = _EverywhereRows(heads=[], thr_count=None, budget=0.0, hot=np.zeros(len(st), dtype=np.int64),
                           f_thr=training_replication_threshold(ctx.topo, ctx.batch_size))
    if ctx.mode == "training" and replicate and m > 1:
        rows.budget = max(0.0, (m * float(ctx.cap.min()) - ctx.total_bytes) / (m - 1))
        for t in st:
            pre = t.prefix()
            if ctx.distinct:
                ratio = ctx.ar_us / ctx.p2p_us if ctx.p2p_us > 0 else np.inf
                k = _distinct_hot_count(t, ctx.scale, m, ratio, pre)
                rows.heads.append(np.diff(pre[: k + 1]))
            else:
                rows.heads.append(np.diff(pre[: t.count_above(rows.f_thr * ctx.samples, pre) + 1]))
            del pre
        # distinct: heads hold exactly the rows that pass
        rows.thr_count = -1.0 if ctx.distinct else rows.f_thr * ctx.samples
        rows.hot = training_hot_rows(rows.heads, ctx.rb, rows.thr_count, rows.budget, m)
    return rows


def _partition_and_place(ctx: _OperContext, everywhere: _EverywhereRows, alg1_options: dict,
                         refine_options: dict, history: list) -> tuple[dict, float]:
    """Steps 2-4 around step 1's copies: mark every table's replicated prefix, then partition (4.1), place
    (4.2) and replicate (4.3) under threshold refinement (``_refine``); when the copies leave too little room,
    shrink their budget and start again."""
    st, m = ctx.st, ctx.m
    attempt = 0
    while True:
        hot = everywhere.hot
        for i, (t, k) in enumerate(zip(st, hot)):
            t.skip = int(k)
            t.skip_count = float(everywhere.heads[i][:k].sum()) if k else 0.0
        rep_bytes = float((hot * ctx.rb).sum())
        rep_access = (distinct_of(st, np.arange(len(st)), np.zeros(len(st), dtype=np.int64), hot, ctx.scale,
                                  [t.skip_count for t in st]) if ctx.distinct
                      else np.array([t.skip_count for t in st]) * ctx.scale)  # per rank, looked up locally
        base_lookup = np.full(m, float((rep_access * ctx.rb).sum())) * ctx.local
        base_mem = np.full(m, rep_bytes)

        def build(parts: Partitions, owner: np.ndarray, hot=hot) -> dict:
            return _build_plan_arrays(ctx, hot, parts, owner, alg1_options)

        try:
            return _refine(st, ctx.topo, ctx.cap, base_lookup, base_mem, ctx.scale, ctx.local,
                           refine_options["threshold"], ctx.mem_thr, refine_options["balance_target"],
                           refine_options["min_threshold"], refine_options["max_partitions"], history, build,
                           volume=ctx.volume)
        except ConfigError:
            if hot.sum() == 0:
                raise
            attempt += 1
            everywhere.give_back(ctx, attempt)


def _build_plan_arrays(ctx: _OperContext, hot: np.ndarray, parts: Partitions, owner: np.ndarray,
                       alg1_options: dict) -> dict:
    """Assemble one plan's arrays (replicated prefixes + partitions), run Algorithm 1 (inference, OPER 4.3),
    evaluate it."""
    st, m, rb = ctx.st, ctx.m, ctx.rb
    pt = [np.flatnonzero(hot > 0).astype(np.int32), parts.table]
    ps = [np.zeros(int((hot > 0).sum()), dtype=np.int64), parts.start]
    pe = [hot[hot > 0], parts.stop]
    po = [(np.flatnonzero(hot > 0) % m).astype(np.int32), owner]
    pc = [np.array([t.skip_count for t, k in zip(st, hot) if k > 0]), parts.counts]
    table, start = np.concatenate(pt), np.concatenate(ps)
    idx = np.lexsort((start, table))
    table, start = table[idx], start[idx]
    stop, own = np.concatenate(pe)[idx], np.concatenate(po)[idx].astype(np.int32)
    counts = np.concatenate(pc)[idx]
    is_rep = np.concatenate([np.ones(pt[0].size, dtype=bool), np.zeros(parts.size, dtype=bool)])[idx]
    holders = np.zeros((table.size, m), dtype=bool)
    holders[np.arange(table.size), own] = True
    holders[is_rep] = True
    fetch = np.where(holders, np.arange(m, dtype=np.int32)[None, :], own[:, None]).astype(np.int32)
    alg1 = None
    acc = ctx.volume(table, start, stop, counts)
    if ctx.mode == "inference" and alg1_options["replicate"] and m > 1:  # 4. Algorithm 1
        nbytes = (stop - start) * rb[table]
        avail = ctx.cap - (holders * nbytes[:, None]).sum(axis=0)
        alg1 = algorithm1(holders, fetch, acc * rb[table], nbytes, ctx.lb, avail,
                          exhaust_links=alg1_options["exhaust_links"], order=alg1_options["order"],
                          choice=alg1_options["choice"])
    sync = ctx.sync_rows(table, start, stop, counts)
    cost = evaluate_arrays(table, (stop - start).astype(np.float64), acc, rb, holders, fetch, ctx.topo, ctx.mode,
                           sync_rows=sync)
    return {"table": table, "start": start, "stop": stop, "own": own, "counts": counts, "holders": holders,
            "fetch": fetch, "alg1": alg1, "cost": cost, "access": acc, "sync": sync}


class _Placement:
    """The chosen plan's arrays, edited in place by the polish (step 5) and the training fill (step 4)."""

    def __init__(self, ctx: _OperContext, best: dict) -> None:
        self.ctx = ctx
        self.table, self.start, self.stop = best["table"], best["start"], best["stop"]
        self.own, self.counts = best["own"], best["counts"]
        self.holders, self.fetch = best["holders"], best["fetch"]
        rb, m = ctx.rb, ctx.m
        self.nbytes = (self.stop - self.start) * rb[self.table]
        self.acc, self.sync = best["access"], best["sync"]
        self.vol = self.acc * rb[self.table]
        # bytes per rank if replicated
        self.sync_vol = None if self.sync is None else 2.0 * (m - 1) / m * self.sync * rb[self.table]

    def cost(self):
        ctx = self.ctx
        return evaluate_arrays(self.table, (self.stop - self.start).astype(np.float64), self.acc, ctx.rb,
                               self.holders, self.fetch, ctx.topo, ctx.mode, sync_rows=self.sync)

    def polish_singles(self, polish_moves: int, polish_stats: dict) -> int:
        """5. Our addition: moves and swaps of single-holder partitions that lower the largest per-rank cost;
        adds the polish's counters to ``polish_stats``."""
        stats: dict = {}
        n = self._polish(polish_moves, stats)
        for k, v in stats.items():
            polish_stats[k] = polish_stats.get(k, 0) + v
        return n

    def _polish(self, polish_moves: int, stats: dict) -> int:
        ctx = self.ctx
        if polish_moves <= 0 or ctx.m <= 1:
            return 0
        own, holders = self.own, self.holders
        single = holders.sum(axis=1) == 1
        c0 = self.cost()
        n = polish(own, single, self.vol, self.nbytes, ctx.lb, c0.total_per_rank - c0.latency_per_rank,
                   c0.memory_per_rank.copy(), ctx.cap, 2.0 if ctx.mode == "training" else 1.0,
                   max_moves=polish_moves, stats=stats)
        if n:
            holders[single] = False
            holders[np.flatnonzero(single), own[single]] = True
            self.fetch[single] = own[single][:, None]
        return n

    def drop_single_copies(self, everywhere: np.ndarray) -> None:
        """Back to one holder (the owner) for every partition not copied on all ranks."""
        m, own = self.ctx.m, self.own
        self.holders[~everywhere] = False
        self.holders[np.flatnonzero(~everywhere), own[~everywhere]] = True
        self.fetch[~everywhere] = np.where(self.holders[~everywhere], np.arange(m, dtype=np.int32)[None, :],
                                           own[~everywhere][:, None])


def _fill_and_polish(placement: _Placement, fill_rounds: int, polish_moves: int,
                     polish_stats: dict) -> tuple[int, dict]:
    """4. training: single copies that pass 4.3's test in the room left, then polish around them. The
    placement polish settles on decides which copies fit where, so drop the copies and fill again while that
    lowers the largest per-rank cost (at most ``fill_rounds`` times; kept only if it does). Returns the polish
    moves kept and ``training_fill``'s summary of the kept fill."""
    ctx, p = placement.ctx, placement
    everywhere = p.holders.all(axis=1)
    moves = 0
    best_state = (p.cost().max_rank_cost, p.own.copy(), p.holders.copy(), p.fetch.copy(),
                  {"replicas": 0, "bytes": [0.0] * ctx.m})
    for _ in range(fill_rounds):
        p.drop_single_copies(everywhere)
        c0 = p.cost()
        f = training_fill(p.holders, p.fetch, p.vol, p.nbytes, ctx.lb, ctx.cap - c0.memory_per_rank,
                          c0.total_per_rank - c0.latency_per_rank, ctx.topo.allreduce_bw, sync_volume=p.sync_vol)
        n = p.polish_singles(polish_moves, polish_stats) if f["replicas"] else 0
        c = p.cost().max_rank_cost
        if c >= best_state[0] * (1 - 1e-12):
            break
        moves += n
        best_state = (c, p.own.copy(), p.holders.copy(), p.fetch.copy(), f)
        if not f["replicas"]:
            break
    _, p.own[:], p.holders[:], p.fetch[:], fill = best_state
    return moves, fill


def _oper_meta(ctx: _OperContext, everywhere: _EverywhereRows, history: list, thr_used: float,
               balance_target: float, alg1, fill, moves: int, polish_stats: dict) -> dict:
    """The plan's record of how OPER ran: its settings, the threshold refinement, what each step did."""
    return {
        "strategy": "oper",
        "mode": ctx.mode,
        "batch_size": int(ctx.batch_size),
        "extra_memory": float(ctx.extra_memory),
        "capacity_bytes": float(ctx.cap.max()),
        "memory_budget_bytes": float(ctx.budget_cap.max()),
        "threshold": thr_used,
        "memory_threshold": min(thr_used, ctx.mem_thr),
        "threshold_history": history,
        "balance_target": balance_target,
        "training_freq_threshold": everywhere.f_thr if ctx.mode == "training" and not ctx.distinct else None,
        "traffic": ctx.traffic,
        "replicated_rows_everywhere": int(everywhere.hot.sum()),
        "replication_budget_bytes": everywhere.budget,
        "algorithm1": alg1,
        "training_fill": fill,
        "polish_moves": moves,
        "polish": polish_stats,
        "samples": ctx.samples,
        "topology": ctx.topo.to_dict(),
    }


def _distinct_hot_count(t, scale: float, m: int, ratio: float, pre: np.ndarray) -> int:
    """Leading rows of sorted table ``t`` worth replicating on every rank for training when traffic is what the
    executor moves: ``u_k / U_k > ratio`` (``ratio = (1 / BW_AR) / L_P2P``; ``u_k``, ``U_k``: the row in a rank's,
    in the global batch, ``cost.batch_presence``). Replicated, a row costs every rank its sparse AllReduce in
    every batch any rank read it (``2 (M-1)/M U_k S``); left single, the ``M-1`` other ranks each fetch it and
    push its gradient when their batch reads it (``2 u_k S``, summed over ranks). ``u / U`` grows with the count,
    so the rows that pass are a prefix of the order: binary search."""
    if not np.isfinite(ratio) or ratio >= 1.0 or t.total <= 0:
        return 0
    n = scale * t.total

    def passes(i: int) -> bool:
        c = np.array([pre[i + 1] - pre[i]])
        if c[0] <= 0:
            return False
        return bool(batch_presence(c, n, t.total)[0] > ratio * batch_presence(c, n * m, t.total)[0])

    lo, hi = 0, t.num_rows  # rows [0, lo) pass, rows [hi, n) do not
    while lo < hi:
        mid = (lo + hi) // 2
        if passes(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _refine(st, topo, cap, base_lookup, base_mem, scale, local, threshold, mem_thr, target, min_threshold,
            max_partitions, history, build, patience=2, volume=None):
    """Partition (4.1), balanced model parallelism (4.2) and replication (4.3, via ``build``), halving the
    threshold until the degree of balance of memory, lookup and communication of the finished plan all
    reach ``target`` (4.2: "re-generate new partitions ... with a smaller threshold"), or ``patience``
    halvings in a row brought nothing better. Returns the most balanced plan seen (ties: the lower
    bottleneck cost) and its threshold."""
    m = topo.world_size
    rb = np.array([t.row_bytes for t in st], dtype=np.float64)
    thr, mthr = threshold, mem_thr
    best = None
    stale = 0  # halvings since the best plan improved
    while True:
        parts: Partitions = partition_tables(st, thr, memory_threshold=min(thr, mthr))
        a = parts.counts * scale if volume is None else volume(parts.table, parts.start, parts.stop, parts.counts)
        lookup = lookup_cost_per_partition(a, rb[parts.table], local, m)

        def describe(q, parts=parts):
            t = st[int(parts.table[q])]
            return f"table {t.name!r} partition of rows at sorted positions [{parts.start[q]}, {parts.stop[q]})"

        owner, e, mem = balanced_model_parallel(lookup, parts.nbytes, parts.access_bound, cap, base_lookup, base_mem,
                                                describe)
        built = build(parts, owner)
        c = built["cost"]
        dm, dl, dc = c.dob_memory, c.dob_lookup, c.dob_comm
        history.append({"threshold": thr, "memory_threshold": min(thr, mthr), "partitions": parts.size,
                        "dob_memory_mp": dob(mem), "dob_lookup_mp": dob(e),
                        "dob_memory": dm, "dob_lookup": dl, "dob_comm": dc, "max_rank_cost": c.max_rank_cost})
        score = (min(dm, dl, dc), -c.max_rank_cost)
        if best is None or score > best[0]:
            best, stale = (score, built, thr), 0
        else:
            stale += 1
        if (min(dm, dl, dc) >= target or thr / 2 < min_threshold or parts.size * 2 > max_partitions
                or stale >= patience):
            break
        thr /= 2
        mthr /= 2
    return best[1], best[2]
