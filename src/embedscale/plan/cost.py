"""The cost model of OPER section 3.2 and 4.3: evaluates any plan (ours, hand-written, TorchRec's).

Per iteration, with ``B`` samples per rank, a row ``k`` of ``S_k`` bytes accessed ``c_k`` times over
the profile's ``samples`` samples is looked up ``A_k = B * c_k / samples`` times by every rank (the
"average access count among GPUs" of eq. 2). With ``P_k[i][j] = 1`` when rank ``i`` reads row ``k``
from rank ``j`` (``Plan.fetch``):

* memory (eq. 1):     ``M_j = sum_k S_k * [j holds k]``
* lookup (eq. 2):     ``E_j = sum_k S_k * A_k * (sum_i P_k[i][j]) * L[j][j]``
* communication (eq. 3): ``C_ij = sum_k S_k * A_k * P_k[i][j] * L[i][j]`` for ``i != j``
  (the paper prints ``L[j][j]`` in eq. 3; Algorithm 1 lines 10 and 17 use ``L[i][j]``, which is what a
  fetch over link ``i <- j`` costs). A rank issues its fetches to all peers at once, so it also waits
  one latency per round: the largest latency among the links it reads over (``latency_per_rank``).
* training: every fetched row sends its gradient back over the same link (the factor 2 of eq. 4, and a
  second latency round),
  and a row held by ``h > 1`` ranks is all-reduced among them every iteration:
  ``2 (h-1)/h * S_k / BW_AR`` per holder (eq. 5; ``h = M`` in the paper).

What the executor pays (``traffic="distinct"``: the ``oper`` planner's default, the plan command's report,
a run's summary). Eq. 3 charges every access, while the executor (``embedding.sharded``) fetches a remote
row once per batch however often the batch reads it (OPER 5.1) and synchronises replicas with one sparse
AllReduce over *all* ranks (OPER 5.3, ``embedding.grad_sync``, ``local_aggregated``), whoever holds them.
So with ``n_k`` the table's lookups per rank batch and ``u_k = 1 - (1 - p_k) ** n`` the probability that
row ``k`` (``p_k`` its share of the table's accesses) is in a rank's batch, ``U_k`` the same for the
global batch (``M n`` lookups):

* eqs. 2-4 move ``S_k * u_k`` bytes per iteration where eq. 3 charges ``S_k * A_k``;
* the replicas' sync costs every rank ``2 (M-1)/M * (R b/8 + sum_{k replicated} U_k S_k) / BW_AR``
  (``R`` replicated rows: the union bitmap of ``b`` = 2, 4 or 8 bits a row by ``M``, then the touched
  rows' gradients), where eq. 5 charges
  ``2 (h-1)/h * S_k`` per holder for every replicated row.

``traffic="access"`` (``evaluate``'s default) is the paper's model, kept to reproduce it (OPER Table 2), for
the MILP and the lower bound, and for the online re-plan rule (``plan.drift``).

Costs are microseconds per iteration (``L`` is microseconds per byte, see ``topology``), amounts are
bytes per iteration. The degree of balance (DoB) of a per-rank quantity is ``min / max`` (OPER
Table 3). A rank's communication cost is what it waits for: its fetches (and gradient pushes) from
every peer plus its share of the AllReduce; ``max_rank_cost`` is the largest lookup-plus-communication
cost of any rank, the iteration's bottleneck.

Everything is computed on partition aggregates (``[P]`` and ``[P, M]`` arrays), never per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.topology import LinkTopology, as_link_topology

MODES = ("training", "inference")
TRAFFIC = ("distinct", "access")


def check_traffic(traffic: str) -> str:
    if traffic not in TRAFFIC:
        raise ConfigError(f"traffic {traffic!r} is not one of {TRAFFIC} (distinct: what the executor moves, a "
                          "remote row once per batch; access: OPER's eq. 3, every access)")
    return traffic


def batch_presence(counts: np.ndarray, lookups: float, total: float | None = None) -> np.ndarray:
    """``u_k = 1 - (1 - p_k) ** n``: the probability that row ``k`` is in a batch of ``n`` lookups of its table,
    ``p_k = c_k / total`` (``total``: the table's summed counts, default ``sum(c)`` when ``counts`` are all its
    rows; float64; zeros when the table was never read)."""
    c = np.asarray(counts, dtype=np.float64)
    tot = float(c.sum()) if total is None else float(total)
    if tot <= 0:
        return np.zeros(c.shape)
    return -np.expm1(float(lookups) * np.log1p(-np.minimum(c / tot, 1.0)))


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r} is not one of {MODES}")
    return mode


def profile_samples(profile) -> float:
    """Samples the profile's counts stand for (1 when the profile does not say)."""
    s = getattr(profile, "samples", 1)
    s = s() if callable(s) else s
    if not s or s <= 0:
        raise ConfigError(f"profile: samples must be positive, got {s}")
    return float(s)


def table_counts(profile, name: str, num_rows: int) -> np.ndarray:
    """A table's per-row counts from a duck-typed profile, checked against the table's rows."""
    if name not in list(profile.table_names):
        raise ConfigError(f"profile has no table {name!r}; it has {list(profile.table_names)}")
    c = np.asarray(profile.counts(name))
    if c.shape != (num_rows,):
        raise ConfigError(f"profile table {name!r}: {c.size} counts for a table of {num_rows} rows")
    if c.dtype.kind not in "iuf":
        raise ConfigError(f"profile table {name!r}: counts must be numbers, got dtype {c.dtype}")
    return c


def partition_counts(plan, profile) -> np.ndarray:
    """Access count of every partition of ``plan`` under ``profile`` (sum over its rows), float64 ``[P]``."""
    out = np.zeros(plan.num_partitions, dtype=np.float64)
    for t, tab in enumerate(plan.tables):
        c = table_counts(profile, tab.name, tab.num_rows)
        o = plan.rows_by_partition[t]
        srt = c if o is None else c[o]
        sl = plan.table_partitions(t)
        out[sl] = np.add.reduceat(srt.astype(np.float64, copy=False), plan.part_start[sl])
    return out


def partition_distinct(plan, profile, batch_size: int, world: int = 1) -> np.ndarray:
    """Expected distinct rows of every partition of ``plan`` in a batch of ``world * batch_size`` samples
    (``sum_k u_k`` over its rows, see :func:`batch_presence`), float64 ``[P]``; ``world=1``: a rank's batch,
    ``world=M``: the global batch (the replicas' sync)."""
    samples = profile_samples(profile)
    out = np.zeros(plan.num_partitions, dtype=np.float64)
    for t, tab in enumerate(plan.tables):
        c = table_counts(profile, tab.name, tab.num_rows).astype(np.float64, copy=False)
        u = batch_presence(c, c.sum() * world * batch_size / samples)
        o = plan.rows_by_partition[t]
        srt = u if o is None else u[o]
        sl = plan.table_partitions(t)
        out[sl] = np.add.reduceat(srt, plan.part_start[sl])
    return out


@dataclass
class Cost:
    """Per-rank and per-link figures of one plan on one profile (see module docstring for units)."""

    mode: str
    batch_size: int
    memory_per_rank: np.ndarray
    lookup_per_rank: np.ndarray
    lookup_bytes_per_rank: np.ndarray
    comm_matrix: np.ndarray
    comm_bytes_matrix: np.ndarray
    allreduce_per_rank: np.ndarray
    allreduce_bytes_per_rank: np.ndarray
    latency_per_rank: np.ndarray
    capacity_bytes: np.ndarray | None = None

    @property
    def world_size(self) -> int:
        return int(self.memory_per_rank.size)

    @property
    def comm_per_rank(self) -> np.ndarray:
        """Cost each rank pays for communication: fetches (+ gradient pushes), latency rounds, AllReduce."""
        return self.comm_matrix.sum(axis=1) + self.latency_per_rank + self.allreduce_per_rank

    @property
    def comm_bytes_per_rank(self) -> np.ndarray:
        return self.comm_bytes_matrix.sum(axis=1) + self.allreduce_bytes_per_rank

    @property
    def total_per_rank(self) -> np.ndarray:
        return self.lookup_per_rank + self.comm_per_rank

    @property
    def max_rank_cost(self) -> float:
        return float(self.total_per_rank.max())

    @property
    def dob_memory(self) -> float:
        return dob(self.memory_per_rank)

    @property
    def dob_lookup(self) -> float:
        return dob(self.lookup_per_rank)

    @property
    def dob_comm(self) -> float:
        return dob(self.comm_per_rank)

    def _link_bytes(self) -> np.ndarray:
        m = self.world_size
        off = ~np.eye(m, dtype=bool)
        # AllReduce bytes leave a rank over its links: spread them evenly for the per-link figures.
        share = self.allreduce_bytes_per_rank / max(m - 1, 1)
        return (self.comm_bytes_matrix + share[:, None])[off]

    @property
    def comm_mean(self) -> float:
        """Mean communication per link per iteration, bytes (OPER Table 2 "Mean", there in MB)."""
        return float(self._link_bytes().mean()) if self.world_size > 1 else 0.0

    @property
    def comm_var(self) -> float:
        """Variance over links of the communication per iteration, MB^2 (OPER Table 2 "Var.")."""
        return float((self._link_bytes() / 1e6).var()) if self.world_size > 1 else 0.0

    @property
    def fits_memory(self) -> bool:
        if self.capacity_bytes is None:
            return True
        cap = self.capacity_bytes
        return bool(np.all((cap <= 0) | (self.memory_per_rank <= cap)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "batch_size": self.batch_size,
            "memory_per_rank": self.memory_per_rank.tolist(),
            "lookup_per_rank": self.lookup_per_rank.tolist(),
            "lookup_bytes_per_rank": self.lookup_bytes_per_rank.tolist(),
            "comm_per_rank": self.comm_per_rank.tolist(),
            "comm_bytes_per_rank": self.comm_bytes_per_rank.tolist(),
            "allreduce_per_rank": self.allreduce_per_rank.tolist(),
            "latency_per_rank": self.latency_per_rank.tolist(),
            "total_per_rank": self.total_per_rank.tolist(),
            "comm_matrix": self.comm_matrix.tolist(),
            "comm_bytes_matrix": self.comm_bytes_matrix.tolist(),
            "dob_memory": self.dob_memory,
            "dob_lookup": self.dob_lookup,
            "dob_comm": self.dob_comm,
            "comm_mean": self.comm_mean,
            "comm_mean_mb": self.comm_mean / 1e6,
            "comm_var_mb2": self.comm_var,
            "max_rank_cost": self.max_rank_cost,
            "fits_memory": self.fits_memory,
            "capacity_bytes": None if self.capacity_bytes is None else self.capacity_bytes.tolist(),
            "units": {"memory": "bytes", "lookup": "us/iteration", "comm": "us/iteration",
                      "comm_bytes": "bytes/iteration", "comm_mean": "bytes/link/iteration"},
        }


def dob(x: np.ndarray) -> float:
    """Degree of balance ``min / max`` (1.0 when everything is zero)."""
    x = np.asarray(x, dtype=np.float64)
    mx = float(x.max()) if x.size else 0.0
    return 1.0 if mx <= 0 else float(x.min()) / mx


def evaluate_arrays(
    part_table: np.ndarray,
    part_rows: np.ndarray,
    part_access: np.ndarray,
    row_bytes: np.ndarray,
    holders: np.ndarray,
    fetch: np.ndarray,
    topology,
    mode: str,
    batch_size: int = 1,
    capacity_bytes=None,
    sync_rows: np.ndarray | None = None,
) -> Cost:
    """Equations (1)-(5) on partition aggregates.

    Args:
        part_table, part_rows: per partition, its table and number of rows.
        part_access: per partition, lookups *per rank per iteration* (``A`` summed over its rows).
        row_bytes: per table, bytes per row (``S_k``).
        holders, fetch: ``[P, M]`` as in ``Plan``.
        topology: ``LinkTopology`` (or ``specs.Topology``).
        mode: ``training`` (gradients and AllReduce) or ``inference`` (forward only).
        sync_rows: ``None``: eq. 5, a replicated partition's rows all-reduced among its holders. Given
            (``[P]``, expected rows of each partition in the global batch, :func:`partition_distinct`): the
            executor's sync, every rank all-reducing the replicas' bitmap and the touched replica rows
            (``part_access`` is then the distinct rows a rank's batch reads, ``traffic="distinct"``).
    """
    check_mode(mode)
    topo: LinkTopology = as_link_topology(topology)
    m = topo.world_size
    if holders.shape[1] != m:
        raise ConfigError(f"plan has {holders.shape[1]} ranks, topology has {m}")
    s = np.asarray(row_bytes, dtype=np.float64)[part_table]
    vol = np.asarray(part_access, dtype=np.float64) * s  # bytes every rank reads of each partition
    comm_bytes = np.zeros((m, m), dtype=np.float64)
    for i in range(m):
        comm_bytes[i] = np.bincount(fetch[:, i], weights=vol, minlength=m)
    lb = topo.cost_matrix()
    lookup_bytes = comm_bytes.sum(axis=0)  # eq. 2: everything rank j serves, to itself and to others
    lookup = lookup_bytes * np.diag(lb)
    off = ~np.eye(m, dtype=bool)
    fwd = np.where(off, comm_bytes, 0.0)
    fwd_cost = fwd * lb  # eq. 3
    lat = np.where(fwd > 0, topo.latency_us, 0.0).max(axis=1)  # one round of concurrent messages
    mem = (holders * (part_rows * s)[:, None]).sum(axis=0)
    if mode == "training":
        link_bytes, link_cost = 2.0 * fwd, 2.0 * fwd_cost  # eq. 4: gradients return over the same link
        lat = 2.0 * lat
        h = holders.sum(axis=1).astype(np.float64)
        if sync_rows is None:
            arb = np.where(h > 1, 2.0 * (h - 1) / np.maximum(h, 1) * part_rows * s, 0.0)  # eq. 5 per holder
            ar_bytes = holders.T.astype(np.float64) @ arb
        else:  # the executor's sparse AllReduce over all ranks (OPER 5.3): bitmap, then the touched rows
            rep = h > 1
            bits = 2 if m <= 3 else 4 if m <= 15 else 8  # the bitmap's bits a row (grad_sync.union_bits)
            sync = float(np.ceil(part_rows[rep].sum() * bits / 8) + (np.asarray(sync_rows)[rep] * s[rep]).sum())
            ar_bytes = np.full(m, 2.0 * (m - 1) / m * sync if rep.any() and m > 1 else 0.0)
        ar_cost = ar_bytes / (topo.allreduce_bw * 1e3)
    else:
        link_bytes, link_cost = fwd, fwd_cost
        ar_bytes = np.zeros(m)
        ar_cost = np.zeros(m)
    cap = None
    if capacity_bytes is not None:
        cap = np.broadcast_to(np.asarray(capacity_bytes, dtype=np.float64), (m,)).copy()
    return Cost(mode, int(batch_size), mem.astype(np.float64), lookup, lookup_bytes, link_cost, link_bytes,
                ar_cost, ar_bytes, lat, cap)


def evaluate(plan, profile, topology, *, mode: str = "training", batch_size: int = 2048,
             part_counts: np.ndarray | None = None, capacity_bytes=None, traffic: str = "access") -> Cost:
    """Evaluate ``plan`` on ``profile`` and ``topology`` (OPER eqs. 1-5).

    ``traffic``: ``distinct`` (what the executor moves and syncs, see the module docstring) or ``access``
    (OPER's eqs. 3 and 5 as printed; ``part_counts``, per-partition access counts, then skips reading the
    profile when already known). ``capacity_bytes`` defaults to the plan's ``meta["capacity_bytes"]``.
    """
    check_mode(mode)
    check_traffic(traffic)
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    topo = as_link_topology(topology)
    if plan.world_size != topo.world_size:
        raise ConfigError(f"plan is for {plan.world_size} ranks, topology has {topo.world_size}")
    rb = np.array([t.row_bytes for t in plan.tables], dtype=np.float64)
    cap = capacity_bytes if capacity_bytes is not None else plan.meta.get("capacity_bytes")
    sync = None
    if traffic == "distinct":
        if profile is None:
            raise ConfigError("evaluate: traffic 'distinct' needs the access profile (per-row counts)")
        access = partition_distinct(plan, profile, batch_size)
        sync = partition_distinct(plan, profile, batch_size, topo.world_size) if mode == "training" else None
    else:
        if part_counts is None:
            part_counts = partition_counts(plan, profile)
        samples = profile_samples(profile) if profile is not None else 1.0
        access = np.asarray(part_counts, dtype=np.float64) * (batch_size / samples)
    return evaluate_arrays(plan.part_table, plan.part_rows.astype(np.float64), access, rb, plan.holders, plan.fetch,
                           topo, mode, batch_size, cap, sync_rows=sync)


def training_replication_threshold(topology, batch_size: int) -> float:
    """OPER section 4.3: duplicate a row for training only when its per-sample frequency
    ``f > BW_P2P / (Batch_Size * BW_AR)`` (from ``T_dup < T_non-dup``, eqs. 4 and 5)."""
    topo = as_link_topology(topology)
    return topo.p2p_bandwidth() / (batch_size * topo.allreduce_bw)
