"""A lower bound on the largest per-rank cost any plan can reach (OPER eqs. 1-5, ``plan.cost``).

It says how far a plan is from the best possible one without solving the MILP, and it proves when a
target is out of reach. The bound holds for every plan the cost model can evaluate, row by row (the
finest partitioning there is), with any holders and fetch paths, under a per-rank capacity.

Notation as in ``plan.cost``: a row ``k`` of ``S_k`` bytes is read ``A_k`` times per rank and
iteration; ``L`` is OPER's per-byte cost matrix, ``g = 2`` in training (eq. 4: the gradient goes
back over the fetch link) and 1 in inference, ``BW_AR`` the AllReduce bandwidth.

Charge every read of row ``k`` by rank ``i`` to the pair ``(k, i)``: it costs ``A_k S_k L[i][i]`` when
``i`` holds a copy (eq. 2, looked up locally) and otherwise at least
``A_k S_k r_i`` with ``r_i = min_{j != i} (L[j][j] + g L[i][j])`` (eq. 2 on the source plus eq. 3).
Summed over ranks, these charges are exactly the plan's total lookup plus fetch cost; the AllReduce of
a row held by ``h`` ranks adds ``h * 2 (h-1)/h * S_k / BW_AR = (h-1) b_k`` over its holders (eq. 5,
``b_k = 2 S_k / BW_AR``). Two bounds on the sum over ranks follow:

* **per row**: with holder set ``H`` (not empty), row ``k`` costs
  ``sum_{i in H} A S L[i][i] + sum_{i not in H} A S r_i + (|H|-1) b``; with ``delta_i = A S (L[i][i] -
  r_i) + b`` sorted ascending that is at least ``A S (sum_i r_i + d_min) + sum_{t=2..|H|} delta_(t)``
  (``d_min = min_i (L[i][i] - r_i)``: the first holder pays no AllReduce). Every row needs one copy;
  the copies beyond it are items of ``S_k`` bytes costing ``delta_(t)``, and together they fit in the
  room ``E = sum_i cap_i - sum_k S_k``: a fractional knapsack, bounded below for any price
  ``mu >= 0`` per byte by ``sum_items S min(0, delta / S + mu) - mu E`` (weak duality; ``mu`` found
  by bisection). Without a memory limit ``mu = 0`` and a row takes every copy with ``delta < 0``: on a
  uniform machine the cost is linear in ``|H|``, so the best is one holder or all, all exactly when
  OPER 4.3's ``f > BW_P2P / (B BW_AR)`` holds; no partial replication (``1 < h < M``) does better.
* **per rank** (ignores the AllReduce): rank ``i`` holds at most ``cap_i`` bytes, so the reads it
  serves itself are at most the fractional knapsack ``V_held(cap_i)`` of the hottest bytes
  (``A_k`` is the value per byte), and its charges are at least ``V r_i - V_held (r_i - L[i][i])``
  with ``V = sum_k A_k S_k``.

Every rank that cannot hold all the rows that are read waits at least one latency round
(``g`` rounds in training) on its cheapest link. The largest per-rank cost is at least the mean:

    bound = (max(per-row sum, per-rank sum) + sum_i latency_i) / M

and at least any single rank's communication, ``g min_{j != i} L[i][j] (V - V_held(cap_i)) + latency_i``.
"""

from __future__ import annotations

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.cost import check_mode, profile_samples
from embedscale.plan.partition import sort_tables
from embedscale.plan.topology import as_link_topology


def lower_bound(tables, profile, topology, *, mode: str = "training", batch_size: int = 2048,
                capacity_bytes=None, sorted_tables=None) -> dict:
    """Lower bound on ``Cost.max_rank_cost`` over every plan of ``tables`` whose ranks store at most
    ``capacity_bytes`` each (scalar or per rank; ``None``: no limit). See the module docstring.

    Returns ``{"max_rank_cost"`` (the bound), ``"mean_bound", "per_row_sum", "per_rank_sum",
    "latency_per_rank", "comm_only_bound", "rows_worth_replicating", "replica_price_per_byte",
    "held_volume_fraction"}``; sums are over ranks, in microseconds per iteration. Works on every table's
    prefix sums of sorted counts (``partition.sort_tables``; pass ``sorted_tables`` to reuse them): a few
    hundred binary searches, no pass over the rows beyond sorting.
    """
    check_mode(mode)
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    topo = as_link_topology(topology)
    m = topo.world_size
    st = sorted_tables if sorted_tables is not None else sort_tables(list(tables), profile)
    scale = batch_size / profile_samples(profile)
    lb = topo.cost_matrix()
    loc = np.diag(lb).copy()
    g = 2.0 if mode == "training" else 1.0
    cap = None if capacity_bytes is None else np.broadcast_to(np.asarray(capacity_bytes, dtype=np.float64), (m,)).copy()

    if m == 1:
        return _single_rank_bound(st, scale, loc[0])

    off = ~np.eye(m, dtype=bool)
    r = np.where(off, loc[None, :] + g * lb, np.inf).min(axis=1)  # r_i: cheapest remote read, lookup included
    remote = np.where(off, lb, np.inf).min(axis=1)  # cheapest per-byte fetch of rank i
    beta = 2.0 / (topo.allreduce_bw * 1e3) if mode == "training" else 0.0  # b_k = beta * S_k
    d = np.sort(loc - r)  # delta_i = A S d_i + b, ascending: the first holder takes d[0]
    extra = np.unique(d[1:], return_counts=True)  # copies beyond the first
    extra = [(float(dv), int(k)) for dv, k in zip(*extra) if dv < 0]

    pres = [t.prefix() for t in st]
    vol_total = sum(float(pre[-1]) * scale * t.row_bytes for t, pre in zip(st, pres))
    all_bytes = float(sum(t.num_rows * t.row_bytes for t in st))
    bytes_read = float(sum(t.count_above(0.0, pre) * t.row_bytes for t, pre in zip(st, pres)))

    # per-row sum: one copy of every row, plus extra copies (item cost S (A d + beta), S bytes) within
    # the room left, E = sum cap - all bytes; weak duality for any mu >= 0 (the knapsack's price per byte):
    #   min >= sum_items S min(0, A d + beta + mu) - mu E
    base = vol_total * float(r.sum() + d[0])
    room = np.inf if cap is None else float(cap.sum()) - all_bytes
    if room < 0:
        raise ConfigError(f"lower bound: {int(all_bytes)} bytes of tables do not fit in {int(cap.sum())} bytes of capacity")

    v0, mu = _extra_copies(st, pres, scale, extra, beta, room)
    per_row = base + v0 - (mu * room if mu > 0 else 0.0)
    # rows worth a second copy when memory does not bind (OPER 4.3's rule on a uniform machine)
    replicate = int(sum(t.count_above(beta / -extra[0][0] / scale, pre) for t, pre in zip(st, pres))) if extra else 0

    held = np.full(m, vol_total) if cap is None else np.array([_held_volume(st, pres, scale, c) for c in cap])
    held = np.minimum(held, vol_total)
    per_rank = float((vol_total * r - held * np.maximum(r - loc, 0.0)).sum())
    must_fetch = np.zeros(m, dtype=bool) if cap is None else bytes_read > cap  # holds less than what is read
    lat = np.where(off, topo.latency_us, np.inf).min(axis=1) * g * must_fetch
    mean_bound = (max(per_row, per_rank) + float(lat.sum())) / m
    comm_only = float((g * remote * (vol_total - held) + lat).max())
    return {
        "max_rank_cost": max(mean_bound, comm_only),
        "mean_bound": mean_bound,
        "per_row_sum": per_row,
        "per_rank_sum": per_rank,
        "latency_per_rank": lat.tolist(),
        "comm_only_bound": comm_only,
        "rows_worth_replicating": replicate,
        "replica_price_per_byte": mu,
        "held_volume_fraction": (held / vol_total if vol_total > 0 else np.ones(m)).tolist(),
    }


def _single_rank_bound(st, scale: float, loc) -> dict:
    """One rank: every read is a local lookup, and the bound is the plan's cost."""
    vol = sum(float(t.prefix()[-1]) * t.row_bytes for t in st) * scale  # every read is a local lookup
    c = vol * loc
    return {"max_rank_cost": c, "mean_bound": c, "per_row_sum": c, "per_rank_sum": c,
            "latency_per_rank": [0.0], "comm_only_bound": 0.0, "rows_worth_replicating": 0,
            "replica_price_per_byte": 0.0, "held_volume_fraction": [1.0]}


def _extra_copies(st, pres, scale: float, extra: list, beta: float, room: float) -> tuple[float, float]:
    """The per-row sum's extra copies within the room left, by weak duality for the knapsack's price per byte
    ``mu``: ``sum_items S min(0, A d + beta + mu)`` at the ``mu`` where the items worth taking just fill the
    room (0 when they fit). Returns (that sum, ``mu``)."""

    def extra_items(mu: float) -> tuple[float, float]:
        """(sum over items worth taking at price mu of S (A d + beta + mu), their bytes)."""
        val = nbytes = 0.0
        for dv, k in extra:
            nb, vol = _above(st, pres, scale, (beta + mu) / -dv)
            val += k * (dv * vol + (beta + mu) * nb)
            nbytes += k * nb
        return val, nbytes

    v0, nb0 = extra_items(0.0)
    mu = 0.0
    if nb0 > room:  # the room binds: find the price at which the items worth taking just fill it
        hi = max((-dv * (float(pres[i][1] - pres[i][0]) * scale if pres[i].size > 1 else 0.0) for dv, _ in extra
                  for i in range(len(st))), default=0.0)
        lo = 0.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if extra_items(mid)[1] > room:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-12 * max(hi, 1e-300):
                break
        mu = hi
        v0, _ = extra_items(mu)
    return v0, mu


def _above(st, pres, scale: float, a_min: float) -> tuple[float, float]:
    """``(bytes, sum A_k S_k)`` of the rows read more than ``a_min`` times per rank and iteration (each
    table's counts are sorted: a binary search per table)."""
    nb = vol = 0.0
    for t, pre in zip(st, pres):
        k = t.count_above(a_min / scale, pre)
        nb += k * t.row_bytes
        vol += float(pre[k]) * scale * t.row_bytes
    return nb, vol


def _held_volume(st, pres, scale: float, cap: float) -> float:
    """Upper bound on the volume ``sum A_k S_k`` of rows fitting in ``cap`` bytes (fractional knapsack,
    value per byte ``A_k``). For any ``tau >= 0`` it is at most ``sum_k S_k max(A_k - tau, 0) + tau cap``
    (weak duality); ``tau`` is found by bisection where the rows above it just fill ``cap``."""
    if not np.isfinite(cap):
        return np.inf
    cap = max(float(cap), 0.0)
    nb0, v0 = _above(st, pres, scale, 0.0)
    if nb0 <= cap:
        return v0
    hi = max(float(pre[1] - pre[0]) for pre in pres if pre.size > 1) * scale  # nothing above hi
    lo = 0.0  # too much above lo
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _above(st, pres, scale, mid)[0] <= cap:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    nb, v = _above(st, pres, scale, hi)
    return v - hi * nb + hi * cap
