"""``--strategy auto``: every table's form chosen under per-rank device and host memory budgets (numpy only).

The search (issue 16, part 3). For every table it weighs the forms the executor can build:

* ``replicated``: the whole table on every rank, exact (OPER section 4.3's replication taken to a table);
  its gradient rows are all-reduced every step;
* ``sharded``: exact rows placed on the ranks by OPER (sections 4.1-4.2), a batch's remote rows fetched
  once and their gradients sent back;
* ``tt`` of a rank from a candidate list (EL-Rec section III): the cores on every rank, their gradients
  all-reduced (EL-Rec VI-B); a table with hot rows (a global batch reads each at least ``hot_row_touch`` times)
  is TT as *row groups* only (:func:`hybrid_candidate`): those rows exact on every rank and only the others TT
  (``embedding.hybrid``; the plan carries the index reordering whose first ids are those rows, EL-Rec IV);
* ``host``: the rows in the host parameter server (EL-Rec section V; one copy per rank), every batch's
  distinct rows read and prefetched to the device, the life-cycle cache (V-B) holding the rows of the last
  ``pipeline_depth`` batches, sized from the table's miss-ratio curve (:mod:`embedscale.plan.mrc`).

**Cost model.** Per rank and step, with ``L`` the table's lookups per rank batch (profile: lookups per
sample times the batch), ``D_r`` / ``D_g`` the expected distinct rows of a rank's / the global batch
(:class:`~embedscale.plan.mrc.MissRatioCurve`, the per-batch deduplicated traffic the executor pays) and
the per-row costs of :class:`Costs` (measured by ``embedscale calibrate``; documented defaults otherwise):

    replicated:  L * exact + D_g * row_bytes * 2 (M-1)/M / allreduce_bw
    sharded:     L * exact + 2 * D_r * (M-1)/M * row_bytes / link_bw
    tt(R):       L * tt(R) + core_bytes * 2 (M-1)/M / allreduce_bw
    tt(R), H hot rows exact (a / d: their share of the lookups / of the batch's distinct rows):
                 a L * exact + (1-d) L * tt(R) + (core_bytes + H row_bytes) * 2 (M-1)/M / allreduce_bw + overhead
    host(k):     L * exact + (D_r + D_g) * host_row + 2 * D_g * row_bytes * (M-1)/M / link_bw

each plus, on several ranks, the executor's own work per table of its form (``Costs.executor_overhead``:
fitted from real N-rank steps by ``embedscale calibrate --ranks N``; 0 when not measured),
plus the link latency once per exchange a step runs (:func:`exchange_latency`, once per kind of table in the
plan: not separable by table), plus, with any host table, the host form's executor cost per step
(:meth:`Costs.host_step_overhead`) and with host and TT tables both, what the two cost beside each other
(:meth:`Costs.host_tt_step_overhead`), and memory per rank: replicated ``N (row + state)``, sharded ``N (row + state) / M``, tt its cores and
row-wise state (with ``H`` hot rows: plus ``H (row + state)``), host ``N (row + state)`` in host memory plus ``(k D_r + (k-1) D_g) (row + state)`` on the
device (prefetched rows and the life-cycle cache). The objective is the bottleneck rank's predicted step time
(the model is symmetric across ranks; after OPER places the sharded tables the report evaluates each rank).

**Search.** :func:`search_greedy`: Lagrangian starts (every table's form minimising seconds plus priced bytes,
for a grid of prices per tier), each repaired to the budgets by the moves that buy the most bytes (over the
tiers that overflow) per second lost and improved by single form changes; the best one then improved by
single and paired changes until none helps. :func:`search_milp` solves the same multiple-choice knapsack exactly with HiGHS
(``scipy.optimize.milp``) for checking on small cases. The terms a plan pays once per kind of table (latencies,
host step) are weighed by :func:`best_over_kinds`: the search again with each set of kinds left out, the choice
of least :func:`plan_seconds` kept (exact with the MILP). When nothing fits, :class:`BudgetError` names the
bytes over per tier and the tables that could not be placed.

**Quality guard** (issue 16, part 4): a table whose rows are hot (the global batch reads it at least
``hot_touch`` times per row on average, lookups / rows; or it has fewer than ``tt_min_rows`` rows) stays
exact: never TT; within a TT table, the rows a global batch reads at least ``hot_row_touch`` times each stay
exact (row groups). A TT form records its
rank in the plan (``TableForm.tt_rank``).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from embedscale.errors import ConfigError
from embedscale.io import atomic_write_json, atomic_write_text, read_json
from embedscale.plan.forms import SHARDED, TableForm, core_shapes, factor_dim, factor_rows, tt_ranks
from embedscale.plan.mrc import MissRatioCurve, probability_histogram

COSTS_FORMAT = "embedscale.costs"
STATE_BYTES_PER_ROW = 4  # row-wise Adagrad: one float32 per row
DEFAULT_TT_RANKS = (8, 16, 32, 64)


class BudgetError(ConfigError):
    """No assignment of forms fits the per-rank memory budgets: says by how much per tier, and which tables."""


# -- measured costs --------------------------------------------------------------------------------------

#: the executor's overheads a plan pays per step whatever its number of tables, for the kinds of table it holds
#: (:func:`step_terms`), and all that ``Costs.executor_overhead_s`` holds: those and the ones per table of a kind
STEP_TERMS = ("host_step", "host_tt_step")
EXECUTOR_TERMS = ("sharded", "tt", "host") + STEP_TERMS


def step_terms(kinds) -> dict[str, int]:
    """Which of :data:`STEP_TERMS` a plan holding tables of ``kinds`` (candidate kinds) pays, once each:
    ``host_step`` with any host table, ``host_tt_step`` with host and TT tables both."""
    kinds = set(kinds)
    return {"host_step": int("host" in kinds), "host_tt_step": int("host" in kinds and "tt" in kinds)}


def executor_overheads_text(over: Mapping[str, float], fmt=lambda s: f"{s * 1e3:.3f} ms") -> str:
    """``executor_overhead_s`` for people: the overheads per table, then those per step (:data:`STEP_TERMS`)."""
    text = "per table " + ", ".join(f"{k} {fmt(v)}" for k, v in over.items() if k not in STEP_TERMS)
    if "host_step" in over:
        text += f"; per step with host tables {fmt(over['host_step'])}"
    if "host_tt_step" in over:
        text += f", with host and TT tables {fmt(over['host_tt_step'])} more"
    return text


@dataclass
class Costs:
    """Per-row costs the planner reads (``embedscale calibrate`` writes them as JSON).

    The defaults are assumptions, not measurements (``source: "default"``): exact lookup+update 50 ns per
    lookup, TT lookup+update ``50 ns * (1 + (R/8)^2 / 4)`` per lookup, a host parameter-server row 400 ns,
    links 10 GB/s and 20 us, all-reduce 10 GB/s, dense model 20 GFLOP/s, 5 ms per step and 50 us per table
    of fixed overheads. A costs file written before a field existed gets that field's default.

    Attributes:
        exact_lookup_s: seconds per lookup of an exact table (fused ``LocalEmbeddingBags``: forward, backward,
            row-wise Adagrad update).
        tt_lookup_s: TT rank -> seconds per lookup (forward, backward, core update); ranks in between are
            interpolated quadratically in the rank (the cost of a TT lookup grows with ``R^2``).
        host_row_s: seconds per distinct row of a batch served by the host parameter server (read, move to the
            device, apply the update).
        link_bandwidth_gbs, link_latency_us, allreduce_gbs: the rank-to-rank link.
        dense_flops_per_s: FLOP rate of the dense model's forward, backward and update (an MLP of the model's
            sizes at the calibration's batch; :mod:`embedscale.plan.step` turns layer sizes into FLOPs).
        step_overhead_s, table_overhead_s: the fixed seconds of a training step, and per table and step,
            beyond the lookups and the dense FLOPs (the residual of a real DLRM step at two feature counts).
        row_group_overhead_s: seconds per step a row-group table (hot rows exact, the rest TT,
            ``embedding.hybrid``) pays beyond its parts' lookups: the second lookup over the batch, the hot rows'
            gradient sum and update (a row-group table against the same TT table on the same batches).
        executor_overhead_s, executor_world: form kind (``sharded``, ``tt``, ``host``) -> seconds per table and
            step that a real ``executor_world``-rank training step pays beyond everything above (bucketing ids by
            owner, the exchanges beyond their bytes, host tables' all-gathers and server reads, the ranks and
            their loader threads sharing the cores): fitted by ``embedscale calibrate --ranks N`` from N-rank
            steps of plans of each form (:func:`embedscale.plan.step.fit_executor_overheads`); empty = not
            measured (0); never negative (the fit's non-negative least squares; a costs file with a negative one
            is an error).
        source: ``measured`` or ``default``; notes: what the calibration ran.
    """

    exact_lookup_s: float = 50e-9
    tt_lookup_s: dict = field(default_factory=lambda: {r: 50e-9 * (1 + (r / 8) ** 2 / 4) for r in DEFAULT_TT_RANKS})
    host_row_s: float = 400e-9
    link_bandwidth_gbs: float = 10.0
    link_latency_us: float = 20.0
    allreduce_gbs: float = 10.0
    dense_flops_per_s: float = 20e9
    step_overhead_s: float = 5e-3
    table_overhead_s: float = 50e-6
    row_group_overhead_s: float = 100e-6
    executor_overhead_s: dict = field(default_factory=dict)
    executor_world: int = 0
    source: str = "default"
    notes: dict = field(default_factory=dict)

    def scaled(self, s: float) -> "Costs":
        """These costs with every time figure multiplied by ``s`` (rates and bandwidths divided by it; the
        executor overheads, fitted after scaling, kept): every term of the cost model is linear in them, so every
        prediction, without executor overheads, is ``s`` times this one's. The link figures are scaled too and
        then kept by the planner (``notes["links_scaled"]``): give costs whose links are not measured the
        topology's first (``plan.autoplan.with_topology_links``)."""
        if not (s > 0 and math.isfinite(s)):
            raise ConfigError(f"costs: scale must be a positive number, got {s}")
        return Costs(**{**self.__dict__, "exact_lookup_s": self.exact_lookup_s * s,
                        "tt_lookup_s": {r: v * s for r, v in self.tt_lookup_s.items()},
                        "host_row_s": self.host_row_s * s, "link_bandwidth_gbs": self.link_bandwidth_gbs / s,
                        "link_latency_us": self.link_latency_us * s, "allreduce_gbs": self.allreduce_gbs / s,
                        "dense_flops_per_s": self.dense_flops_per_s / s, "step_overhead_s": self.step_overhead_s * s,
                        "table_overhead_s": self.table_overhead_s * s,
                        "row_group_overhead_s": self.row_group_overhead_s * s,
                        "notes": {**self.notes, "links_scaled": True}})

    def executor_overhead(self, label: str, world: int) -> float:
        """Seconds per step a table of candidate ``label`` (``sharded``, ``replicated``, ``tt-R``, ``host-k``)
        costs the distributed executor beyond the single-process costs above (``executor_overhead_s`` by form
        kind, fitted from real ``executor_world``-rank steps by ``embedscale calibrate --ranks``; a replicated
        table is a sharded one every rank holds). 0 in a world of one, or when not measured."""
        if world <= 1 or not self.executor_overhead_s:
            return 0.0
        kind = label.split("-")[0]
        return float(self.executor_overhead_s.get("sharded" if kind == "replicated" else kind, 0.0))

    def host_step_overhead(self, world: int) -> float:
        """Seconds per step the distributed executor spends on host tables whatever their number (the server's
        and the pipeline's threads, the rows' all-gathers: ``executor_overhead_s["host_step"]``, fitted by
        ``embedscale calibrate --ranks`` from two host plans of different table counts). 0 in a world of one, or
        when not measured. Not per table: the search weighs it per plan (:func:`best_over_kinds`)."""
        if world <= 1:
            return 0.0
        return float(self.executor_overhead_s.get("host_step", 0.0))

    def host_tt_step_overhead(self, world: int) -> float:
        """Seconds per step a plan holding host and TT tables both pays beyond each form's own costs
        (``executor_overhead_s["host_tt_step"]``, fitted by ``embedscale calibrate --ranks`` from a plan of the two
        beside plans of each alone). On a CPU the host pipeline's threads (server, cache patcher) run in the gaps
        a step waits on its exchanges; TT's compute fills those gaps, and the threads then take the cores from
        it. 0 in a world of one, or when not measured."""
        if world <= 1:
            return 0.0
        return float(self.executor_overhead_s.get("host_tt_step", 0.0))

    def kinds_overhead(self, kinds, world: int) -> float:
        """The executor's seconds per step of a plan holding tables of ``kinds`` (candidate kinds: ``host``,
        ``tt``, ...), paid once whatever the number of tables: :meth:`host_step_overhead` with any host table,
        :meth:`host_tt_step_overhead` with host and TT tables."""
        if world <= 1:
            return 0.0
        return sum(n * float(self.executor_overhead_s.get(k, 0.0)) for k, n in step_terms(kinds).items())

    def tt(self, rank: int) -> float:
        """Seconds per TT lookup at ``rank`` (measured ranks exactly; others by ``a + b R^2`` through the two
        nearest measured ranks, never below the exact lookup)."""
        pts = sorted((int(r), float(s)) for r, s in self.tt_lookup_s.items())
        if not pts:
            raise ConfigError("costs: tt_lookup_s is empty")
        for r, s in pts:
            if r == rank:
                return s
        if len(pts) == 1:
            return max(self.exact_lookup_s, pts[0][1] * (rank / pts[0][0]) ** 2)
        lo = max((p for p in pts if p[0] < rank), default=pts[0], key=lambda p: p[0])
        hi = min((p for p in pts if p[0] > rank), default=pts[-1], key=lambda p: p[0])
        if lo == hi:
            lo, hi = (pts[-2], pts[-1]) if rank > pts[-1][0] else (pts[0], pts[1])
        b = (hi[1] - lo[1]) / max(hi[0] ** 2 - lo[0] ** 2, 1e-9)
        return max(self.exact_lookup_s, lo[1] + b * (rank ** 2 - lo[0] ** 2))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tt_lookup_s"] = {str(k): float(v) for k, v in self.tt_lookup_s.items()}
        return {"format": COSTS_FORMAT, "version": 1, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "costs") -> "Costs":
        if not isinstance(d, Mapping) or d.get("format") != COSTS_FORMAT:
            raise ConfigError(f"{where}: not an {COSTS_FORMAT} file (format {d.get('format') if isinstance(d, Mapping) else d!r})")
        kw = {k: v for k, v in d.items() if k not in ("format", "version")}
        unknown = sorted(set(kw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}")
        try:
            if "tt_lookup_s" in kw:
                kw["tt_lookup_s"] = {int(k): float(v) for k, v in dict(kw["tt_lookup_s"]).items()}
            out = cls(**kw)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
        for name in ("exact_lookup_s", "host_row_s", "link_bandwidth_gbs", "allreduce_gbs", "dense_flops_per_s"):
            v = float(getattr(out, name))
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{where}: {name} must be a positive number, got {v}")
        for name in ("link_latency_us", "step_overhead_s", "table_overhead_s", "row_group_overhead_s"):
            v = float(getattr(out, name))
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"{where}: {name} must be a number >= 0, got {v}")
        try:
            out.executor_overhead_s = {str(k): float(v) for k, v in dict(out.executor_overhead_s).items()}
            out.executor_world = int(out.executor_world)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: executor_overhead_s / executor_world: {e}") from None
        bad = sorted(set(out.executor_overhead_s) - set(EXECUTOR_TERMS))
        if bad or any(not (math.isfinite(v) and v >= 0) for v in out.executor_overhead_s.values()):
            raise ConfigError(f"{where}: executor_overhead_s must map sharded / tt / host / host_step / host_tt_step "
                              f"to seconds >= 0, got {out.executor_overhead_s}")
        if out.executor_world < 0 or (out.executor_overhead_s and out.executor_world < 2):
            raise ConfigError(f"{where}: executor_world must be the ranks the executor overheads were measured on "
                              f"(>= 2), got {out.executor_world}")
        if any(not (v > 0 and math.isfinite(v)) for v in out.tt_lookup_s.values()):
            raise ConfigError(f"{where}: tt_lookup_s must hold positive numbers, got {out.tt_lookup_s}")
        return out

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())


def load_costs(path: str | Path | None) -> Costs:
    """The costs of ``path`` (``embedscale calibrate``), or the documented defaults when ``path`` is None."""
    if path is None:
        return Costs()
    return Costs.from_dict(read_json(Path(path), "costs file"), str(path))


# -- candidates ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One form of one table with what it costs per rank: step seconds, device and host bytes."""

    label: str  # replicated | sharded | tt-R | host-k
    form: TableForm
    seconds: float
    device_bytes: float
    host_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"form": self.label, "seconds": self.seconds, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes}


def tt_core_bytes(num_rows: int, dim: int, rank: int, num_cores: int = 3) -> int:
    """Bytes of a TT table's cores (float32) plus its row-wise Adagrad state (one float32 per core slice)."""
    shapes = core_shapes(factor_rows(num_rows, num_cores), factor_dim(dim, num_cores), tt_ranks(rank, num_cores))
    return 4 * sum(math.prod(s) for s in shapes) + 4 * sum(s[0] for s in shapes)


@dataclass
class TableStats:
    """What the search needs of one table's profile: lookups and distinct rows per batch, hotness."""

    name: str
    num_rows: int
    dim: int
    pooling: str
    lookups_rank: float  # L: lookups per rank batch
    distinct_rank: float  # D_r
    distinct_global: float  # D_g
    hot: bool
    mrc: MissRatioCurve  # per rank batch
    # rows by descending probability: cumulative rows and the share of the table's lookups they take
    cum_rows: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cum_share: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cum_distinct: np.ndarray = field(default_factory=lambda: np.zeros(0))  # ... and of D_r they make up
    p_desc: np.ndarray = field(default_factory=lambda: np.zeros(0))  # ... their per-lookup probability

    @property
    def row_bytes(self) -> int:
        return 4 * self.dim

    def rows_for_share(self, share: float) -> int:
        """The fewest hottest rows that take ``share`` of the table's lookups (0 when unknown)."""
        if self.cum_share.size == 0:
            return 0
        return int(math.ceil(float(np.interp(share, np.r_[0.0, self.cum_share], np.r_[0.0, self.cum_rows]))))

    def distinct_of_rows(self, rows: int) -> float:
        """Expected distinct rows of a rank batch among the table's ``rows`` hottest rows."""
        if self.cum_rows.size == 0:
            return 0.0
        return float(np.interp(rows, np.r_[0.0, self.cum_rows], np.r_[0.0, self.cum_distinct]))

    def rows_read_at_least(self, reads: float, world: int) -> int:
        """The rows a global batch (``world`` rank batches) reads at least ``reads`` times on average."""
        if self.p_desc.size == 0 or reads <= 0:
            return 0
        k = int(np.searchsorted(-self.p_desc, -reads / max(self.lookups_rank * world, 1e-300), side="right"))
        return int(round(float(self.cum_rows[k - 1]))) if k else 0

    def share_of_rows(self, rows: int) -> float:
        """The share of the table's lookups its ``rows`` hottest rows take (the profile's histogram)."""
        if self.cum_rows.size == 0:
            return 0.0
        return float(np.interp(rows, np.r_[0.0, self.cum_rows], np.r_[0.0, self.cum_share]))


def table_stats(table, counts: np.ndarray, samples: float | None, batch_size: int, world: int, *,
                hot_touch: float = 0.01, tt_min_rows: int = 10_000, bins: int = 2048,
                hist: tuple[np.ndarray, np.ndarray] | None = None, total: float | None = None) -> TableStats:
    """Lookups, distinct rows per batch (rank and global) and hotness of ``table`` from its profile counts
    (``hist``: their :func:`~embedscale.plan.mrc.probability_histogram`, when already known, and ``total``)."""
    counts = np.asarray(counts)
    total = float(counts.sum(dtype=np.float64)) if total is None else float(total)
    feats = list(getattr(table, "features", None) or [table.name])
    per_sample = total / float(samples) if samples and total > 0 else float(len(feats))
    lookups = per_sample * batch_size
    hist = probability_histogram(counts, bins) if hist is None else hist
    mrc = MissRatioCurve.from_histogram(*hist, lookups)
    d_r = mrc.distinct()
    d_g = MissRatioCurve.from_histogram(*hist, lookups * world).distinct() if world > 1 else d_r
    n = int(table.num_rows)
    hot = n < tt_min_rows or (lookups * world) / max(n, 1) >= hot_touch
    p, rows = (np.asarray(x, dtype=np.float64) for x in hist)
    order = np.argsort(-p, kind="stable")
    cum_rows, cum_share = np.cumsum(rows[order]), np.cumsum((p * rows)[order])
    seen = -np.expm1(lookups * np.log1p(-np.minimum(p[order], 1.0)))  # P(a row of the bin in a rank batch)
    return TableStats(table.name, n, int(table.dim), getattr(table, "pooling", "sum"), lookups, d_r, d_g, hot, mrc,
                      cum_rows, cum_share / max(float(cum_share[-1]) if cum_share.size else 0.0, 1e-300),
                      np.cumsum(rows[order] * seen), p[order])


def hybrid_candidate(s: TableStats, rank: int, hot_rows: int, world: int, costs: Costs) -> Candidate:
    """Row groups of table ``s``: its ``hot_rows`` hottest rows exact on every rank, the rest TT of ``rank``
    (``embedding.hybrid``). Per rank and step, with ``a`` the share of lookups the hot rows take and ``d`` the
    share of the batch's distinct rows they make up:
    ``a L exact + (1-d) L tt(R) + (cores(N) + H row) 2 (M-1)/M / allreduce_bw + row_group_overhead`` (the hot
    rows' dense gradient joins the cores' all-reduce; the overhead measured by ``embedscale calibrate``); memory
    ``cores(N) + H (row + state)``. The TT part is charged by the
    distinct rows it loses, not the lookups: Eff-TT computes each distinct row of a batch once (EL-Rec III-A), so
    taking the hot rows' many repeats out of its batch saves little (measured: a 10M-row rank-8 table whose 93
    hottest rows take half the lookups, 2.5% of its step, BENCHMARKS.md)."""
    m = world
    a = s.share_of_rows(hot_rows)
    d = min(1.0, s.distinct_of_rows(hot_rows) / max(s.distinct_rank, 1e-12))
    cb = tt_core_bytes(s.num_rows, s.dim, int(rank))  # the cores cover every row (embedding.hybrid)
    sync = (cb + hot_rows * s.row_bytes) * 2 * (m - 1) / m / (costs.allreduce_gbs * 1e9)
    sec = s.lookups_rank * (a * costs.exact_lookup_s + (1 - d) * costs.tt(int(rank))) + sync \
        + costs.row_group_overhead_s
    return Candidate(f"tt-{rank}-hot{hot_rows}",
                     TableForm("tt", tt_rank=int(rank), reorder=True, hot_rows=int(hot_rows)), sec,
                     float(cb + hot_rows * (s.row_bytes + STATE_BYTES_PER_ROW)), 0.0)


#: the quality guard of row groups (issue 16 part 4): a row a global batch reads at least this many times on
#: average stays exact; a TT table with such rows is TT for its other rows only (row groups)
DEFAULT_HOT_ROW_TOUCH = 1.0
#: a table more than this share of whose rows are hot is not compressed at all
MAX_HOT_ROW_SHARE = 0.1


def candidates(s: TableStats, world: int, costs: Costs, *, tt_rank_list: Sequence[int] = DEFAULT_TT_RANKS,
               host_depth: int = 1, forms: Sequence[str] = ("replicated", "sharded", "tt", "host"),
               keep_larger: bool = False, hot_row_touch: float = 0.0) -> list[Candidate]:
    """Every form ``s`` may take, costed per rank (module docstring's model). ``keep_larger``: cost TT ranks whose
    cores outweigh the table too (a hand-made plan may choose them; the search never does). ``hot_row_touch`` > 0:
    the rows a global batch reads at least this often stay exact, so a table with such rows is TT only as row
    groups (:func:`hybrid_candidate`; not at all when they are more than ``MAX_HOT_ROW_SHARE`` of its rows)."""
    m = world
    frac = (m - 1) / m
    rb = s.row_bytes
    full = s.num_rows * (rb + STATE_BYTES_PER_ROW)
    link = costs.link_bandwidth_gbs * 1e9
    ar = costs.allreduce_gbs * 1e9
    out = []
    exact = s.lookups_rank * costs.exact_lookup_s
    if "sharded" in forms:
        out.append(Candidate("sharded", SHARDED, exact + 2 * s.distinct_rank * frac * rb / link,
                             full / m, 0.0))
    if "replicated" in forms and m > 1:
        out.append(Candidate("replicated", SHARDED, exact + s.distinct_global * rb * 2 * frac / ar, full, 0.0))
    hot_rows = s.rows_read_at_least(hot_row_touch, m) if hot_row_touch > 0 else 0
    if "tt" in forms and not s.hot and s.pooling != "none" and hot_rows <= MAX_HOT_ROW_SHARE * s.num_rows:
        for r in (tt_rank_list if not hot_rows else ()):
            cb = tt_core_bytes(s.num_rows, s.dim, int(r))
            if cb >= full and not keep_larger:  # a TT table larger than the table itself is never worth it
                continue
            out.append(Candidate(f"tt-{r}", TableForm("tt", tt_rank=int(r)),
                                 s.lookups_rank * costs.tt(int(r)) + cb * 2 * frac / ar,
                                 float(cb), 0.0))
        for r in (tt_rank_list if hot_rows else ()):
            c = hybrid_candidate(s, int(r), hot_rows, m, costs)
            if c.device_bytes < full or keep_larger:
                out.append(c)
    if "host" in forms:
        k = max(1, int(host_depth))
        dev = (k * s.distinct_rank + (k - 1) * s.distinct_global) * (rb + STATE_BYTES_PER_ROW)
        sec = exact + (s.distinct_rank + (s.distinct_global if m > 1 else 0.0)) * costs.host_row_s \
            + 2 * s.distinct_global * frac * rb / link
        out.append(Candidate(f"host-{k}", TableForm("host", pipeline_depth=k), sec, min(dev, full), float(full)))
    if not out:
        raise ConfigError(f"table {s.name!r}: no form allowed (forms {list(forms)})")
    if costs.executor_overhead_s and m > 1:  # the executor's own work per table of a form (Costs.executor_overhead)
        out = [replace(c, seconds=c.seconds + costs.executor_overhead(c.label, m)) for c in out]
    return out


# -- the search ------------------------------------------------------------------------------------------

def _totals(cands, choice) -> tuple[float, float, float]:
    t = d = h = 0.0
    for cs, j in zip(cands, choice):
        c = cs[j]
        t += c.seconds
        d += c.device_bytes
        h += c.host_bytes
    return t, d, h


def _over(d: float, h: float, dev_budget: float, host_budget: float) -> float:
    return max(0.0, d - dev_budget) / dev_budget + max(0.0, h - host_budget) / max(host_budget, 1.0)


def _arrays(cands) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seconds, device and host bytes as ``[tables, max forms]`` arrays (a missing form: infinite seconds, no
    bytes)."""
    k = max(len(cs) for cs in cands)
    out = [np.full((len(cands), k), np.inf), np.zeros((len(cands), k)), np.zeros((len(cands), k))]
    for i, cs in enumerate(cands):
        for j, c in enumerate(cs):
            out[0][i, j], out[1][i, j], out[2][i, j] = c.seconds, c.device_bytes, c.host_bytes
    return out[0], out[1], out[2]


def _repair(cands, choice, dev_budget, host_budget, arrays=None) -> list[int]:
    """Moves that remove the most over-budget (bytes over, relative to the budget, summed over tiers) per second
    they cost, until the budgets hold or no move helps."""
    sec, dev, host = arrays if arrays is not None else _arrays(cands)
    rows = np.arange(len(cands))
    ch = np.asarray(choice, dtype=np.int64).copy()
    hb = max(host_budget, 1.0)
    d, h = float(dev[rows, ch].sum()), float(host[rows, ch].sum())
    over = _over(d, h, dev_budget, host_budget)
    with np.errstate(invalid="ignore", divide="ignore"):
        while over > 0:
            nd = d - dev[rows, ch][:, None] + dev
            nh = h - host[rows, ch][:, None] + host
            gain = over - (np.maximum(0.0, nd - dev_budget) / dev_budget + np.maximum(0.0, nh - host_budget) / hb)
            ok = np.isfinite(sec) & (gain > 1e-15)
            if not ok.any():
                break
            key = np.where(ok, (np.where(ok, sec, 0.0) - sec[rows, ch][:, None]) / np.where(ok, gain, 1.0), np.inf)
            i, j = np.unravel_index(int(np.argmin(key)), key.shape)
            d, h = float(nd[i, j]), float(nh[i, j])
            ch[i] = j
            over = _over(d, h, dev_budget, host_budget)
    return [int(x) for x in ch]


def _improve(cands, choice, dev_budget, host_budget, pairs: bool) -> list[int]:
    """Take the single move, then (``pairs``) the pair of moves, that saves the most seconds within the
    budgets, until none does."""
    choice = list(choice)
    n = len(cands)
    _, d, h = _totals(cands, choice)
    while True:
        best, best_save = None, 1e-12 * max(1e-30, _totals(cands, choice)[0])
        for i, cs in enumerate(cands):
            cur = cs[choice[i]]
            for j, c in enumerate(cs):
                save = cur.seconds - c.seconds
                if j != choice[i] and save > best_save and d - cur.device_bytes + c.device_bytes <= dev_budget \
                        and h - cur.host_bytes + c.host_bytes <= host_budget:
                    best, best_save = [(i, j)], save
        if best is None and pairs:
            for i in range(n):
                ci = cands[i][choice[i]]
                for j, a in enumerate(cands[i]):
                    if j == choice[i]:
                        continue
                    d1, h1 = d - ci.device_bytes + a.device_bytes, h - ci.host_bytes + a.host_bytes
                    s1 = ci.seconds - a.seconds
                    for i2 in range(i + 1, n):
                        ck = cands[i2][choice[i2]]
                        for j2, b in enumerate(cands[i2]):
                            if j2 == choice[i2]:
                                continue
                            save = s1 + ck.seconds - b.seconds
                            if save > best_save and d1 - ck.device_bytes + b.device_bytes <= dev_budget \
                                    and h1 - ck.host_bytes + b.host_bytes <= host_budget:
                                best, best_save = [(i, j), (i2, j2)], save
        if not best:
            return choice
        for i, j in best:
            cur, c = cands[i][choice[i]], cands[i][j]
            choice[i] = j
            d, h = d - cur.device_bytes + c.device_bytes, h - cur.host_bytes + c.host_bytes


def search_greedy(cands: Sequence[Sequence[Candidate]], dev_budget: float, host_budget: float,
                  pairs: bool = True, multipliers: int = 13) -> list[int]:
    """A feasible choice (index per table) of low total seconds, or the least-over one (see :func:`fits`).

    Lagrangian starts: for multipliers ``(a, b)`` on a grid, every table takes the form minimising
    ``seconds + a * device_bytes / device_budget + b * host_bytes / host_budget`` (``a = b = 0``: the fastest
    form); each start is repaired (:func:`_repair`: the moves that remove the most over-budget per second lost)
    and improved by single moves; the best is then improved by single and paired moves (:func:`_improve`)."""
    fastest = [int(np.argmin([c.seconds for c in cs])) for cs in cands]
    scale = max(_totals(cands, fastest)[0], 1e-30)
    grid = [0.0] + list(scale * np.geomspace(1e-3, 1e2, max(1, multipliers - 1)))
    has_host = any(c.host_bytes > 0 for cs in cands for c in cs)
    hb = max(host_budget, 1.0)
    arrays = _arrays(cands)
    sec, dev, host = arrays
    best, best_key, tried = None, None, set()
    for a in grid:
        for b in (grid if has_host else [0.0]):
            start = tuple(int(x) for x in np.argmin(sec + a * dev / dev_budget + b * host / hb, axis=1))
            if start in tried:
                continue
            tried.add(start)
            ch = _repair(cands, start, dev_budget, host_budget, arrays)
            t, d, h = _totals(cands, ch)
            over = _over(d, h, dev_budget, host_budget)
            if over == 0:
                ch = _improve(cands, ch, dev_budget, host_budget, pairs=False)
                t = _totals(cands, ch)[0]
            key = (over, t)
            if best_key is None or key < best_key:
                best, best_key = ch, key
    if best_key[0] > 0:
        return best
    return _improve(cands, best, dev_budget, host_budget, pairs=pairs)


def search_milp(cands: Sequence[Sequence[Candidate]], dev_budget: float, host_budget: float,
                time_limit: float = 60.0) -> list[int] | None:
    """The exact optimum of the same model (a multiple-choice knapsack with two budgets) by HiGHS; ``None``
    when infeasible."""
    sizes = [len(cs) for cs in cands]
    nv = sum(sizes)
    flat = [c for cs in cands for c in cs]
    scale = max(max(c.seconds for c in flat), 1e-30)
    cost = np.array([c.seconds / scale for c in flat])
    a = np.zeros((len(cands) + 2, nv))
    at = 0
    for i, k in enumerate(sizes):
        a[i, at:at + k] = 1.0
        at += k
    a[-2] = [c.device_bytes / dev_budget for c in flat]
    a[-1] = [c.host_bytes / max(host_budget, 1.0) for c in flat]
    lo = np.r_[np.ones(len(cands)), -np.inf, -np.inf]
    hi = np.r_[np.ones(len(cands)), 1.0, host_budget / max(host_budget, 1.0)]
    res = milp(cost, constraints=LinearConstraint(a, lo, hi), integrality=np.ones(nv), bounds=Bounds(0, 1),
               options={"time_limit": time_limit, "mip_rel_gap": 1e-9})
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    out, at = [], 0
    for k in sizes:
        out.append(int(np.argmax(x[at:at + k])))
        at += k
    return out


def fits(cands, choice, dev_budget: float, host_budget: float) -> bool:
    _, d, h = _totals(cands, choice)
    return d <= dev_budget and h <= host_budget


def budget_error(names: Sequence[str], cands, choice, dev_budget: float, host_budget: float) -> BudgetError:
    """The error for a choice that does not fit: bytes over per tier; the tables that could not be placed (the
    smallest footprints of the largest tables, enough of them to cover the overflow)."""
    _, d, h = _totals(cands, choice)
    over_d, over_h = max(0.0, d - dev_budget), max(0.0, h - host_budget)
    order = sorted(range(len(names)), key=lambda i: -(cands[i][choice[i]].device_bytes * (over_d > 0)
                                                      + cands[i][choice[i]].host_bytes * (over_h > 0)))
    left_d, left_h, unplaced = over_d, over_h, []
    for i in order:
        if left_d <= 0 and left_h <= 0:
            break
        c = cands[i][choice[i]]
        unplaced.append(f"{names[i]} (smallest: {c.label}, {human_bytes(c.device_bytes)} device, {human_bytes(c.host_bytes)} host)")
        left_d -= c.device_bytes
        left_h -= c.host_bytes
    parts = []
    if over_d > 0:
        parts.append(f"device memory over by {human_bytes(over_d)} per rank (needs {human_bytes(d)}, budget {human_bytes(dev_budget)})")
    if over_h > 0:
        parts.append(f"host memory over by {human_bytes(over_h)} per rank (needs {human_bytes(h)}, budget {human_bytes(host_budget)})")
    return BudgetError("no plan fits the memory budget: " + "; ".join(parts) + ". Tables that could not be placed: "
                       + ", ".join(unplaced) + ". Raise --device-memory / --host-memory or add ranks")


def human_bytes(b: float) -> str:
    """Bytes for people: B, KiB, MiB or GiB."""
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= f:
            return f"{b / f:,.1f} {unit}"
    return f"{b:,.0f} B"


# -- the whole decision ----------------------------------------------------------------------------------

@dataclass
class AutoResult:
    """What :func:`decide` returns: per table the candidates, the choice and its stats."""

    names: list[str]
    stats: list[TableStats]
    cands: list[list[Candidate]]
    choice: list[int]
    dev_budget: float
    host_budget: float
    search: str
    search_seconds: float

    def chosen(self, i: int) -> Candidate:
        return self.cands[i][self.choice[i]]

    @property
    def forms(self) -> dict[str, TableForm]:
        return {n: self.chosen(i).form for i, n in enumerate(self.names)}

    @property
    def replicated(self) -> list[str]:
        return [n for i, n in enumerate(self.names) if self.chosen(i).label == "replicated"]

    def predicted_seconds(self) -> float:
        return _totals(self.cands, self.choice)[0]

    def runner_up(self, i: int) -> Candidate | None:
        """The next-best form of table ``i`` with the others fixed: the fastest alternative that keeps the
        budgets, else the fastest alternative."""
        _, d, h = _totals(self.cands, self.choice)
        cur = self.chosen(i)
        alts = [c for j, c in enumerate(self.cands[i]) if j != self.choice[i]]
        if not alts:
            return None
        ok = [c for c in alts if d - cur.device_bytes + c.device_bytes <= self.dev_budget
              and h - cur.host_bytes + c.host_bytes <= self.host_budget]
        return min(ok or alts, key=lambda c: c.seconds)


def decide(tables, counts_of, samples, world: int, device_memory: float, host_memory: float, *,
           costs: Costs | None = None, batch_size: int = 2048, tt_rank_list: Sequence[int] = DEFAULT_TT_RANKS,
           host_depth: int = 1, hot_touch: float = 0.01, tt_min_rows: int = 10_000, search: str = "greedy",
           bins: int = 2048, stats: Sequence[TableStats] | None = None,
           hot_row_touch: float = 0.0) -> AutoResult:
    """Every table's form under the budgets (per rank, bytes). ``counts_of(name)`` gives a table's per-row
    profile counts (or ``stats`` their :func:`table_stats`, computed once for several budgets). ``search``:
    ``greedy`` (default) or ``milp`` (exact, small cases). Raises :class:`BudgetError` when nothing fits."""
    if device_memory <= 0:
        raise ConfigError(f"--device-memory must be positive, got {device_memory}")
    if host_memory < 0:
        raise ConfigError(f"--host-memory must be >= 0, got {host_memory}")
    if search not in ("greedy", "milp"):
        raise ConfigError(f"auto search {search!r} is not greedy or milp")
    costs = costs or Costs()
    tables = list(tables)
    if stats is None:
        stats = [table_stats(t, counts_of(t.name), samples, batch_size, world, hot_touch=hot_touch,
                             tt_min_rows=tt_min_rows, bins=bins) for t in tables]
    stats = list(stats)
    cands = [candidates(s, world, costs, tt_rank_list=tt_rank_list, host_depth=host_depth,
                        hot_row_touch=hot_row_touch) for s in stats]
    t0 = time.perf_counter()
    if search == "milp":
        choice = search_milp(cands, device_memory, host_memory)
        if choice is None:
            choice = search_greedy(cands, device_memory, host_memory, pairs=False)
    else:
        choice = search_greedy(cands, device_memory, host_memory)
    choice = best_over_kinds(cands, choice, device_memory, host_memory, world, costs, search)
    secs = time.perf_counter() - t0
    names = [t.name for t in tables]
    if not fits(cands, choice, device_memory, host_memory):
        raise budget_error(names, cands, choice, device_memory, host_memory)
    return AutoResult(names, stats, cands, choice, float(device_memory), float(host_memory), search, secs)


def kind_of(label: str) -> str:
    """A candidate's kind (sharded, replicated, tt, host): its label's first word."""
    return label.split("-")[0]


def plan_seconds(cands, choice, world: int, costs: Costs) -> float:
    """A choice's step seconds by the model the explain report predicts (sharded rows evenly spread): its tables'
    seconds plus what a plan pays once per kind of table in it (:func:`exchange_latency_of`: each kind's
    exchange latency, the host form's work per step)."""
    labels = [cands[i][j].label for i, j in enumerate(choice)]
    return sum(cands[i][j].seconds for i, j in enumerate(choice)) + exchange_latency_of(labels, world, costs)


def best_over_kinds(cands, choice, dev_budget: float, host_budget: float, world: int, costs: Costs,
                    search: str = "greedy") -> list[int]:
    """``choice`` (the per-table search's), or the best choice that leaves out some kinds of form, whichever
    costs least by :func:`plan_seconds`.

    The search sums per-table seconds; a plan also pays terms once per kind of table it holds (the all-to-alls'
    and all-reduces' latency, the host pipeline's work per step), which no per-table move sees: two host tables
    may each save less than the host form costs the plan. So the search runs again with every set of kinds
    left out (tables then choose among the rest; a set that leaves a table no form is skipped) and the choice
    of least :func:`plan_seconds` is kept. The kinds' terms only add up, so with an exact search (``milp``)
    this is the exact optimum of the whole objective (tests: a brute force over every choice)."""
    best, best_s = list(choice), plan_seconds(cands, choice, world, costs)
    if world <= 1 or not fits(cands, choice, dev_budget, host_budget):  # (no per-plan terms; or the budget error)
        return best
    present = sorted({kind_of(c.label) for cs in cands for c in cs})
    seen = set()
    for r in range(1, len(present)):
        for drop in itertools.combinations(present, r):
            keep = [[j for j, c in enumerate(cs) if kind_of(c.label) not in drop] for cs in cands]
            key = tuple(tuple(k) for k in keep)
            if any(not k for k in keep) or key in seen:
                continue
            seen.add(key)
            sub = [[cands[i][j] for j in k] for i, k in enumerate(keep)]
            alt = search_milp(sub, dev_budget, host_budget) if search == "milp" else None
            if alt is None:
                alt = search_greedy(sub, dev_budget, host_budget)
            alt = [keep[i][j] for i, j in enumerate(alt)]
            if not fits(cands, alt, dev_budget, host_budget):
                continue
            t = plan_seconds(cands, alt, world, costs)
            if t < best_s:
                best, best_s = alt, t
    return best


def parse_bytes(text: str | int | float, what: str = "memory") -> int:
    """``256MiB``, ``1.5GiB``, ``512MB``, ``1000000`` -> bytes (a ``ConfigError`` naming ``what`` otherwise)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip()
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
             "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ").strip()
    unit = s[len(num):].strip().lower()
    try:
        v = float(num)
    except ValueError:
        raise ConfigError(f"{what}: cannot read {text!r} as a size (e.g. 256MiB, 2GiB, 1000000)") from None
    if unit not in units or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{what}: cannot read {text!r} as a size (units: {', '.join(u for u in units if u)})")
    return int(v * units[unit])


# -- per rank after placement, and the explain report -------------------------------------------------------

def exchange_latency(res: AutoResult, world: int, costs: Costs) -> float:
    """The latency a step pays once per exchange, whatever the tables in it: the sharded rows' all-to-all
    (forward and backward), one all-reduce of replicated rows, one of TT cores, the host rows' all-gathers
    (two). Not per table: the executor sends each kind's tables together. With host tables, also the host
    form's executor work per step whatever their number (:meth:`Costs.kinds_overhead`: host step, and host beside
    TT)."""
    return exchange_latency_of([res.chosen(i).label for i in range(len(res.names))], world, costs)


def exchange_latency_of(labels: Sequence[str], world: int, costs: Costs) -> float:
    """:func:`exchange_latency` of tables costed as candidate ``labels`` (one per table)."""
    if world <= 1:
        return 0.0
    kinds = {kind_of(lb) for lb in labels}
    n = 2 * ("sharded" in kinds) + ("replicated" in kinds) + ("tt" in kinds) + 2 * ("host" in kinds)
    return n * costs.link_latency_us * 1e-6 + costs.kinds_overhead(kinds, world)


def rank_breakdown(res: AutoResult, plan, world: int, costs: Costs) -> dict[str, Any]:
    """Per rank: device and host bytes by kind, and predicted step seconds, with the sharded tables' lookups and
    memory as ``plan`` (OPER) placed them (the symmetric model's other terms are the same on every rank)."""
    dev = {k: np.zeros(world) for k in ("sharded", "replicated", "tt", "host_cache")}
    host = np.zeros(world)
    secs = np.zeros(world)
    share = np.full(world, 1.0 / world)
    if plan is not None and plan.part_counts is not None and plan.part_counts.sum() > 0:
        pc = plan.part_counts
        share = np.bincount(plan.owner_of_part, weights=pc, minlength=world)[:world] / pc.sum()
    sharded_lookup = 0.0
    for i, name in enumerate(res.names):
        c = res.chosen(i)
        if c.label == "sharded":
            s = res.stats[i]
            look = s.lookups_rank * costs.exact_lookup_s
            sharded_lookup += look * world  # lookups of every rank's batch, served by the rows' owners
            secs += c.seconds - look
        else:
            secs += c.seconds
        if c.label == "replicated":
            dev["replicated"] += c.device_bytes
        elif c.label.startswith("tt"):
            dev["tt"] += c.device_bytes
        elif c.label.startswith("host"):
            dev["host_cache"] += c.device_bytes
            host += c.host_bytes
    secs += share * sharded_lookup
    secs += exchange_latency(res, world, costs)
    if plan is not None:
        rows = plan.rows_per_rank().astype(np.float64)
        mem = plan.memory_per_rank().astype(np.float64)
        repl = set(res.replicated)
        # the plan holds the replicated tables too: count them once, under "replicated"
        rep_rows = np.zeros(world)
        rep_mem = np.zeros(world)
        for ti, t in enumerate(plan.tables):
            if t.name in repl:
                sl = plan.table_partitions(ti)
                h = plan.holders[sl]
                r = plan.part_rows[sl].astype(np.float64)
                rep_rows += (h * r[:, None]).sum(0)
                rep_mem += (h * (r * t.row_bytes)[:, None]).sum(0)
        dev["sharded"] = (mem - rep_mem) + (rows - rep_rows) * STATE_BYTES_PER_ROW
    else:
        for i in range(len(res.names)):
            if res.chosen(i).label == "sharded":
                dev["sharded"] += res.chosen(i).device_bytes
    total = sum(dev.values())
    return {"device_bytes": {k: v.tolist() for k, v in dev.items()}, "device_total": total.tolist(),
            "host_bytes": host.tolist(), "step_seconds": secs.tolist(), "bottleneck_rank": int(np.argmax(secs)),
            "predicted_step_seconds": float(secs.max())}


def explain(res: AutoResult, per_rank: Mapping[str, Any], costs: Costs, alternatives: Mapping[str, Any], *,
            fixed: Mapping[str, float] | None = None, dense: Mapping[str, Any] | None = None) -> dict:
    """The explain report's data: per table the form chosen, the runner-up and its cost, the per-rank memory
    stack, the predicted step time, and the plans at other budgets (``alternatives``). ``fixed``: the seconds
    every plan pays beyond its tables (:func:`embedscale.plan.step.fixed_terms`: dense model, its all-reduce,
    overheads), added to the embedding part for the whole step's prediction."""
    tables = []
    for i, n in enumerate(res.names):
        c, s, ru = res.chosen(i), res.stats[i], res.runner_up(i)
        e = {"table": n, "rows": s.num_rows, "dim": s.dim, "hot": s.hot, "lookups_per_rank_batch": s.lookups_rank,
             "distinct_per_rank_batch": s.distinct_rank, "distinct_per_global_batch": s.distinct_global,
             "chosen": c.to_dict(), "runner_up": ru.to_dict() if ru else None}
        if c.form.kind == "host":
            k = max(1, c.form.pipeline_depth)
            e["cache"] = {"pipeline_depth": k, "life_cycle_rows": s.mrc.window_rows(k) if k > 1 else 0.0,
                          "life_cycle_hit_ratio": s.mrc.window_hit_ratio(k - 1) if k > 1 else 0.0,
                          "lru_curve": s.mrc.curve(sorted({int(x) for x in np.geomspace(
                              max(1.0, s.distinct_rank / 16), max(2.0, min(s.num_rows, 64 * s.distinct_rank)), 7)}))}
        tables.append(e)
    fixed = {k: float(v) for k, v in (fixed or {}).items()}
    emb = float(per_rank["predicted_step_seconds"])
    world = len(per_rank["step_seconds"])
    labels = [res.chosen(i).label for i in range(len(res.names))]
    executor = float(sum(costs.executor_overhead(lb, world) for lb in labels)) \
        + costs.kinds_overhead({kind_of(lb) for lb in labels}, world)  # (in exchange_latency)
    parts = {"embedding": emb - executor, **({"executor": executor} if costs.executor_overhead_s else {}), **fixed}
    return {"strategy": "auto", "search": res.search, "search_seconds": res.search_seconds,
            "device_budget_bytes": res.dev_budget, "host_budget_bytes": res.host_budget,
            "predicted_step_seconds": emb + sum(fixed.values()),
            "predicted_embedding_step_seconds": emb,
            "predicted_step_parts": parts,
            # the model the search and the other budgets' lines use: sharded rows evenly spread
            "predicted_step_seconds_symmetric": plan_seconds(res.cands, res.choice, world, costs) + sum(fixed.values()),
            "dense_model": dict(dense or {}),
            "costs": costs.to_dict(), "tables": tables, "per_rank": dict(per_rank),
            "other_budgets": dict(alternatives),
            "notes": ["predicted step = the embedding part on the bottleneck rank (lookups, updates, communication) "
                      "+ the dense model's FLOPs at the calibrated rate + its all-reduce + fixed overheads "
                      "(embedscale.plan.step)" if fixed else
                      "predicted time is the embedding part of a step (lookups, updates, communication); the "
                      "dense model is not modelled",
                      "costs are " + ("measured by embedscale calibrate" if costs.source == "measured"
                                      else "the documented defaults (run embedscale calibrate to measure them)")]}


def summarize_choice(res: AutoResult, world: int, costs: Costs) -> dict[str, Any]:
    """A short account of a choice (for the half / twice budget lines of the report): forms, predicted step
    seconds (the symmetric model, sharded rows evenly spread), device and host bytes per rank."""
    _, d, h = _totals(res.cands, res.choice)
    return {"forms": {n: res.chosen(i).label for i, n in enumerate(res.names)},
            "predicted_step_seconds": res.predicted_seconds() + exchange_latency(res, world, costs),
            "device_bytes": d, "host_bytes": h}


def explain_text(rep: Mapping[str, Any]) -> str:
    parts = rep.get("predicted_step_parts") or {}
    lines = [f"auto plan: predicted step {rep['predicted_step_seconds'] * 1e3:.3f} ms on the bottleneck rank "
             f"(rank {rep['per_rank']['bottleneck_rank']}); budgets per rank: device "
             f"{human_bytes(rep['device_budget_bytes'])}, host {human_bytes(rep['host_budget_bytes'])}; costs: {rep['costs']['source']}",
             "step parts (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in parts.items()),
             "", f"{'table':<16} {'rows':>12} {'hot':>4} {'chosen':>12} {'ms':>9} {'device MiB':>11} {'host MiB':>9}"
             f" {'runner-up':>12} {'ms':>9} {'device MiB':>11}"]
    for e in rep["tables"]:
        c, r = e["chosen"], e["runner_up"]
        ru = f"{r['form']:>12} {r['seconds'] * 1e3:>9.4f} {r['device_bytes'] / 2**20:>11.2f}" if r else f"{'-':>12}"
        lines.append(f"{e['table']:<16} {e['rows']:>12,} {'yes' if e['hot'] else 'no':>4} {c['form']:>12} "
                     f"{c['seconds'] * 1e3:>9.4f} {c['device_bytes'] / 2**20:>11.2f} {c['host_bytes'] / 2**20:>9.2f} {ru}")
    pr = rep["per_rank"]
    lines += ["", "memory per rank (MiB): " + ", ".join(
        f"rank {r}: device " + " + ".join(f"{k} {pr['device_bytes'][k][r] / 2**20:.1f}" for k in pr["device_bytes"])
        + f" = {pr['device_total'][r] / 2**20:.1f}, host {pr['host_bytes'][r] / 2**20:.1f}"
        for r in range(len(pr["device_total"])))]
    for label, alt in rep["other_budgets"].items():
        if "error" in alt:
            lines.append(f"with {label} the budget: {alt['error']}")
            continue
        changed = {n: f for n, f in alt["forms"].items() if f != next(e["chosen"]["form"] for e in rep["tables"]
                                                                     if e["table"] == n)}
        lines.append(f"with {label} the budget: predicted {alt['predicted_step_seconds'] * 1e3:.3f} ms "
                     f"(sharded rows spread evenly; this plan so: {rep['predicted_step_seconds_symmetric'] * 1e3:.3f} "
                     "ms); " + (f"changes {changed}" if changed else "the same forms"))
    lines += [""] + [f"note: {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"


def write_explain(rep: Mapping[str, Any], out_dir: str | Path, png: bool = True) -> None:
    """``explain.json``, ``explain.txt`` and (matplotlib present) ``memory.png`` in ``out_dir``."""
    out = Path(out_dir)
    atomic_write_json(out / "explain.json", rep)
    atomic_write_text(out / "explain.txt", explain_text(rep))
    if png:
        write_memory_png(rep, out / "memory.png")


def write_memory_png(rep: Mapping[str, Any], path: Path) -> None:
    """A stacked bar per rank of device memory by kind, with the budget as a line."""
    try:
        import matplotlib  # optional dependency: the PNG is skipped without it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pr = rep["per_rank"]
    m = len(pr["device_total"])
    fig, ax = plt.subplots(figsize=(1.2 * m + 3, 3.5))
    bottom = np.zeros(m)
    for k, v in pr["device_bytes"].items():
        v = np.asarray(v) / 2**20
        ax.bar(np.arange(m), v, bottom=bottom, label=k)
        bottom += v
    ax.axhline(rep["device_budget_bytes"] / 2**20, color="k", ls="--", lw=1, label="budget")
    ax.set_xlabel("rank")
    ax.set_ylabel("device MiB")
    ax.set_xticks(np.arange(m))
    ax.legend(fontsize=7)
    ax.set_title("auto plan: device memory per rank")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
