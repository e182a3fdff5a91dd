"""The exact EMT parallelization problem (OPER section 3.3) as a MILP, solved by HiGHS (scipy.optimize.milp).

Units are partitions (single rows for an exact solution on small instances, or OPER's partitions at a
threshold, as the paper's solver runs in Table 3). Variables, for unit ``p`` and ranks ``i, j``:

* ``x[p,i,j]``: rank ``i`` fetches ``p`` from rank ``j`` (OPER's ``P_p[i][j]``);
* ``y[p,j]``: rank ``j`` holds ``p``; ``o[p,j]``: rank ``j`` owns ``p``;
* training only: ``n[p,h]``: ``p`` has exactly ``h`` holders, and ``a[p,j,h] >= y[p,j] + n[p,h] - 1``
  (continuous): rank ``j`` pays ``p``'s AllReduce share ``2 (h-1)/h * S_p / BW_AR`` (eq. 5 for ``h``
  holders; OPER 4.3 copies to all ranks, ``h = M``, but any holder set is a plan the cost model
  evaluates, and ``oper`` may make partial copies, so the optimum is over all of them);
* ``u[i,j]``: link ``i <- j`` carries bytes; ``w[i] >= lat[i][j] * u[i,j]``: rank ``i``'s latency round;
* ``z``: the largest per-rank cost.

Constraints: every rank reads every unit from exactly one holder and from itself when it holds it;
exactly one owner, who holds it; memory per rank (eq. 1) within capacity; each rank's lookup (eq. 2)
plus communication (eq. 3, doubled and plus AllReduce eq. 5 in training) at most ``z``. Objective:
minimise ``z``, the same ``max_rank_cost`` the cost model reports for any plan.
"""

from __future__ import annotations

import time

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.cost import check_mode, profile_samples
from embedscale.plan.oper import rank_capacity
from embedscale.plan.partition import Partitions, partition_tables, sort_tables
from embedscale.plan.plan import Plan
from embedscale.plan.topology import as_link_topology


def solve_units(
    part_access: np.ndarray,
    part_bytes: np.ndarray,
    part_row_bytes: np.ndarray,
    topology,
    capacity: np.ndarray,
    mode: str,
    time_limit: float = 60.0,
    replicas: bool = True,
) -> dict:
    """Solve the MILP for units with per-rank per-iteration accesses ``part_access`` (``A_p``).

    Returns ``{"status", "optimal", "objective", "bound", "gap", "seconds", "owner", "holders", "fetch"}``
    (the last three ``None`` when no feasible solution was found). ``replicas=False`` forbids copies
    beyond the owner (pure model parallelism, what ``extra_memory=0`` means for every strategy).
    """
    check_mode(mode)
    topo = as_link_topology(topology)
    model = _UnitsMilp(part_access, part_bytes, part_row_bytes, topo, mode)
    for q in range(model.p):
        model.add_placement(q, replicas)
    model.add_memory(capacity)
    model.add_link_latency()
    model.add_rank_cost()
    return model.solve(time_limit)


class _UnitsMilp:
    """The MILP of ``solve_units``: its variables' layout and its constraint rows, built in order.

    Variables: ``x[p,i,j]`` (rank ``i`` reads unit ``p`` from rank ``j``), ``y[p,j]`` (``j`` holds ``p``),
    ``o[p,j]`` (``j`` owns ``p``); training adds ``n[p,h]`` (``p`` has ``h`` holders) and the continuous
    ``a[p,j,h] >= y + n - 1`` (eq. 5 for ``h`` holders); then a 0/1 ``u`` per link with latency, the latency
    round ``w`` per rank and the bottleneck ``z`` (the objective)."""

    def __init__(self, part_access, part_bytes, part_row_bytes, topo, mode: str) -> None:
        self.topo, self.mode, self.part_bytes = topo, mode, part_bytes
        m = self.m = topo.world_size
        p = self.p = int(part_access.size)
        self.lb = topo.cost_matrix()
        self.lat = topo.latency_us
        self.k = 2.0 if mode == "training" else 1.0
        self.vol = np.asarray(part_access, dtype=np.float64) * np.asarray(part_row_bytes, dtype=np.float64)
        self.nx, self.ny = p * m * m, p * m
        self.ox, self.oy, self.oo = 0, self.nx, self.nx + self.ny
        self.orr = self.oo + self.ny
        nr = p * m if mode == "training" else 0  # n[p,h], h = 1..M
        self.ou = self.orr + nr
        self.links = [(i, j) for i in range(m) for j in range(m) if i != j and self.lat[i, j] > 0]
        self.ow = self.ou + len(self.links)  # latency round per rank (continuous)
        self.oz = self.ow + m
        self.oa = self.oz + 1  # a[p,j,h] for h = 2..M (continuous)
        na = p * m * (m - 1) if mode == "training" else 0
        self.nvar = self.oa + na
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []
        self.r = 0

    def N(self, q, h):
        return self.orr + q * self.m + (h - 1)

    def A(self, q, j, h):
        return self.oa + (q * self.m + j) * (self.m - 1) + (h - 2)

    def X(self, q, i, j):
        return self.ox + (q * self.m + i) * self.m + j

    def Y(self, q, j):
        return self.oy + q * self.m + j

    def O(self, q, j):
        return self.oo + q * self.m + j

    def add(self, entries, lower, upper) -> None:
        for c, v in entries:
            self.rows.append(self.r)
            self.cols.append(c)
            self.vals.append(v)
        self.lo.append(lower)
        self.hi.append(upper)
        self.r += 1

    def add_placement(self, q: int, replicas: bool) -> None:
        """Unit ``q``: one source per reader, read only from a holder, one owner that holds it (and, without
        replicas, nobody else); training: its holder count ``n`` and ``a``."""
        m, X, Y, O, N, A, add = self.m, self.X, self.Y, self.O, self.N, self.A, self.add
        for i in range(m):
            add([(X(q, i, j), 1.0) for j in range(m)], 1.0, 1.0)  # one source per reader
            add([(X(q, i, i), 1.0), (Y(q, i), -1.0)], 0.0, 0.0)  # a holder reads itself
            for j in range(m):
                if j != i:
                    add([(X(q, i, j), 1.0), (Y(q, j), -1.0)], -np.inf, 0.0)  # read only from a holder
        add([(O(q, j), 1.0) for j in range(m)], 1.0, 1.0)  # one owner
        for j in range(m):
            add([(O(q, j), 1.0), (Y(q, j), -1.0)], -np.inf, 0.0)  # the owner holds it
            if not replicas:
                add([(Y(q, j), 1.0), (O(q, j), -1.0)], -np.inf, 0.0)  # and nobody else does
            if self.mode == "training":
                for h in range(2, m + 1):  # a >= y + n - 1
                    add([(Y(q, j), 1.0), (N(q, h), 1.0), (A(q, j, h), -1.0)], -np.inf, 1.0)
        if self.mode == "training":
            add([(N(q, h), 1.0) for h in range(1, m + 1)], 1.0, 1.0)  # one holder count
            add([(Y(q, j), 1.0) for j in range(m)] + [(N(q, h), -float(h)) for h in range(1, m + 1)], 0.0, 0.0)

    def add_memory(self, capacity) -> None:
        """Eq. 1: the units a rank holds fit its capacity."""
        for j in range(self.m):
            self.add([(self.Y(q, j), float(self.part_bytes[q])) for q in range(self.p)], -np.inf, float(capacity[j]))

    def add_link_latency(self) -> None:
        """A link with traffic makes its latency the rank's round at least."""
        for n_, (i, j) in enumerate(self.links):
            for q in range(self.p):
                if self.vol[q] > 0:
                    self.add([(self.X(q, i, j), 1.0), (self.ou + n_, -1.0)], -np.inf, 0.0)
            self.add([(self.ow + i, 1.0), (self.ou + n_, -float(self.lat[i, j]))], 0.0, np.inf)

    def add_rank_cost(self) -> None:
        """Eqs. 2-5: the cost of every rank ``j`` (serving, reading, the replicas' AllReduce, latency) <= z."""
        m, lb, vol, k, X, A = self.m, self.lb, self.vol, self.k, self.X, self.A
        ar = 1.0 / (self.topo.allreduce_bw * 1e3)
        for j in range(m):
            e = []
            for q in range(self.p):
                for i in range(m):
                    c = vol[q] * lb[j, j]  # j serves i (eq. 2)
                    if i != j:
                        e.append((X(q, i, j), c))
                        e.append((X(q, j, i), k * vol[q] * lb[j, i]))  # j reads from i (eq. 3)
                    else:
                        e.append((X(q, j, j), c))
                if self.mode == "training":  # eq. 5 for h holders
                    e.extend((A(q, j, h), 2.0 * (h - 1) / h * ar * float(self.part_bytes[q])) for h in range(2, m + 1))
            e.append((self.ow + j, k))
            e.append((self.oz, -1.0))
            self.add(e, -np.inf, 0.0)

    def solve(self, time_limit: float) -> dict:
        """Minimise ``z`` with HiGHS (scipy ``milp``); the placement of the best solution found, if any."""
        nvar, ow, oz, p, m = self.nvar, self.ow, self.oz, self.p, self.m
        from scipy.optimize import Bounds, LinearConstraint, milp  # scipy on first use: most runs never solve a MILP
        from scipy.sparse import coo_matrix

        a_mat = coo_matrix((self.vals, (self.rows, self.cols)), shape=(self.r, nvar)).tocsr()
        c = np.zeros(nvar)
        c[oz] = 1.0
        integrality = np.ones(nvar)
        integrality[ow:] = 0
        ub = np.ones(nvar)
        ub[ow:] = np.inf
        t0 = time.perf_counter()
        res = milp(c, constraints=LinearConstraint(a_mat, self.lo, self.hi), integrality=integrality,
                   bounds=Bounds(np.zeros(nvar), ub),
                   options={"time_limit": float(time_limit), "disp": False, "mip_rel_gap": 1e-9})
        secs = time.perf_counter() - t0
        out = {"status": int(res.status), "message": res.message, "optimal": res.status == 0, "seconds": secs,
               "objective": None, "bound": getattr(res, "mip_dual_bound", None), "gap": getattr(res, "mip_gap", None),
               "owner": None, "holders": None, "fetch": None, "variables": nvar, "constraints": self.r}
        if res.x is not None:
            xv = np.round(res.x).astype(np.int64)
            out["objective"] = float(res.x[oz])
            x = xv[: self.nx].reshape(p, m, m)
            out["fetch"] = np.argmax(x, axis=2).astype(np.int32)
            out["holders"] = xv[self.oy : self.oy + self.ny].reshape(p, m).astype(bool)
            out["owner"] = np.argmax(xv[self.oo : self.oo + self.ny].reshape(p, m), axis=1).astype(np.int32)
        return out


def plan_milp(tables, profile, topology, *, mode: str = "training", extra_memory: float = 0.05,
              batch_size: int = 2048, threshold: float | None = None, time_limit: float = 60.0,
              max_units: int = 400) -> Plan:
    """The exact plan: units are single rows (``threshold=None``) or OPER partitions at ``threshold``.

    Raises ``ConfigError`` when the instance has more than ``max_units`` units or no feasible
    solution is found within ``time_limit`` seconds. ``meta["milp"]`` records status, objective, bound
    and time; ``meta["milp"]["optimal"]`` is False when the time limit stopped HiGHS first.
    """
    t0 = time.perf_counter()
    topo = as_link_topology(topology)
    m = topo.world_size
    st = sort_tables(tables, profile)
    if threshold is None:
        tab = np.concatenate([np.full(t.num_rows, t.index, dtype=np.int32) for t in st])
        start = np.concatenate([np.arange(t.num_rows, dtype=np.int64) for t in st])
        counts = np.concatenate([np.diff(t.prefix()) for t in st])
        rb = np.array([t.row_bytes for t in st], dtype=np.float64)
        parts = Partitions(tab, start, start + 1, counts, rb[tab], np.ones(tab.size, dtype=bool))
    else:
        parts = partition_tables(st, threshold)
    if parts.size > max_units:
        raise ConfigError(f"milp: {parts.size} units is more than max_units={max_units}; use a coarser threshold")
    rb = np.array([t.row_bytes for t in st], dtype=np.float64)
    total = float(sum(t.num_rows * t.row_bytes for t in st))
    cap = rank_capacity(topo, total, extra_memory, float(parts.nbytes.max()))
    scale = batch_size / profile_samples(profile)
    sol = solve_units(parts.counts * scale, parts.nbytes, rb[parts.table], topo, cap, mode, time_limit,
                      replicas=extra_memory > 0)
    if sol["owner"] is None:
        raise ConfigError(f"milp: no feasible solution within {time_limit} s ({sol['message']})")
    info = {k: sol[k] for k in ("status", "message", "optimal", "objective", "bound", "gap", "seconds", "variables", "constraints")}
    meta = {"strategy": "milp", "mode": mode, "batch_size": int(batch_size), "extra_memory": float(extra_memory),
            "capacity_bytes": float(cap.max()), "threshold": threshold, "milp": info}
    plan = Plan(tables, m, [t.order for t in st], parts.table, parts.start, parts.stop, sol["owner"],
                sol["holders"], sol["fetch"], meta, part_counts=parts.counts)
    plan.meta["plan_seconds"] = time.perf_counter() - t0
    return plan
