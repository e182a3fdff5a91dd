"""The auto planner's measured costs (``embedscale calibrate`` writes them, :func:`load_costs` reads them) and the
kinds of candidate they are kept by (:class:`CandidateKind`): per row, per table of a kind, per step of a plan
holding some kinds (:data:`STEP_TERMS`), and the latency a step pays once per kind of exchange
(:func:`exchange_latency_of`). numpy only; the model they feed is :mod:`embedscale.plan.auto`'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable, Mapping

from embedscale.errors import ConfigError
from embedscale.io import atomic_write_json, read_json
from embedscale.plan.forms import FormKind

COSTS_FORMAT = "embedscale.costs"
DEFAULT_TT_RANKS = (8, 16, 32, 64)


class CandidateKind(StrEnum):
    """What a candidate is: its table's form kind, with ``replicated`` (a sharded table every rank holds whole)
    apart, since it pays other exchanges."""

    REPLICATED = "replicated"
    SHARDED = "sharded"
    TT = "tt"
    HOST = "host"

    @property
    def form(self) -> FormKind:
        """The table form a candidate of this kind builds (replicated is a placement of the sharded form)."""
        return FormKind.SHARDED if self is CandidateKind.REPLICATED else FormKind(self.value)

    @classmethod
    def of(cls, label: "str | CandidateKind") -> "CandidateKind | None":
        """The kind of a candidate label (``tt-8``, ``tt-8-hot93``, ``host-2``, ``replicated``: the first word) or of a
        kind; ``None`` for a label of no kind. Labels come back from recorded calibrations and from candidates made
        by hand; the planner's own candidates carry their kind (:attr:`Candidate.kind`)."""
        if isinstance(label, CandidateKind):
            return label
        first = str(label).split("-", 1)[0]
        return cls(first) if first in cls._value2member_map_ else None


def kind_of(label: "str | CandidateKind") -> "str":
    """A candidate's kind (sharded, replicated, tt, host) from its label (:meth:`CandidateKind.of`); a label of
    no kind is its own."""
    kind = CandidateKind.of(label)
    return str(label) if kind is None else kind


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
        tt_rows, tt_size_slope: the rows of the table ``tt_lookup_s`` was measured on, and the relative growth of a
            TT lookup's seconds per doubling of the table's rows (Eff-TT reuses the first cores' slices among a
            batch's rows, EL-Rec III-A: a larger table's factorisation has more slices per core, fewer shared;
            measured: a rank-8 lookup 1.49 us at 1M rows, 2.11 us at 10M, single thread). :meth:`tt` scales by
            ``1 + tt_size_slope * log2(rows / tt_rows)`` (:meth:`tt_size_factor`); ``tt_rows = 0``: not measured,
            no scaling. Fitted by ``embedscale calibrate`` from its table and one of 16 times its rows.
        tt_replica_factor: what a TT lookup costs on several ranks relative to ``tt_lookup_s`` (one process). On
            several ranks the cores are replicated and their gradients summed across ranks (EL-Rec VI-B), so the
            backward accumulates one dense gradient per core and the update is applied to the whole core
            (``TTEmbeddingBag.grad_sync``) instead of the fused per-slice update of one process; measured by
            ``embedscale calibrate`` as the same TT step with a dense gradient against the fused one (the
            median over the calibrated ranks: 0.82-0.88 at ranks 8 and 32 on 1M and 8M rows in one measurement
            at load 17, 0.86-1.11 in one calibration at load 20, so the load decides it as much as the path).
            The all-reduce itself is the model's core-bytes term. 1 = not measured.
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
    tt_rows: int = 0
    tt_size_slope: float = 0.0
    tt_replica_factor: float = 1.0
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

    def executor_overhead(self, label: str | CandidateKind, world: int) -> float:
        """Seconds per step a table of candidate ``label`` (``sharded``, ``replicated``, ``tt-R``, ``host-k``, or its
        :class:`CandidateKind`)
        costs the distributed executor beyond the single-process costs above (``executor_overhead_s`` by form
        kind, fitted from real ``executor_world``-rank steps by ``embedscale calibrate --ranks``; a replicated
        table is a sharded one every rank holds). 0 in a world of one, or when not measured."""
        if world <= 1 or not self.executor_overhead_s:
            return 0.0
        kind = CandidateKind.of(label)
        if kind is None:
            return 0.0
        return float(self.executor_overhead_s.get(kind.form.value, 0.0))

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

    def tt_size_factor(self, rows: int | None) -> float:
        """What a TT lookup into a table of ``rows`` rows costs relative to one into the calibration's table
        (``1 + tt_size_slope * log2(rows / tt_rows)``, at least 0.5; 1 when either is unknown)."""
        if not rows or not self.tt_rows or not self.tt_size_slope:
            return 1.0
        return max(0.5, 1.0 + float(self.tt_size_slope) * math.log2(float(rows) / float(self.tt_rows)))

    def tt(self, rank: int, rows: int | None = None, world: int = 1) -> float:
        """Seconds per TT lookup at ``rank`` into a table of ``rows`` rows (:meth:`tt_size_factor`; ``None``: the
        calibration's table) on ``world`` ranks (several: times ``tt_replica_factor``, the dense gradient path
        of replicated cores): the measured figures made non-decreasing in the rank
        (:func:`non_decreasing`: a lookup of a higher rank does more work, EL-Rec III-A, so a measured inversion
        is the load's noise), measured ranks at those figures, others by ``a + b R^2`` through the two nearest
        measured ranks, never below the exact lookup."""
        replica = float(self.tt_replica_factor) if world > 1 else 1.0
        return self._tt_at_calibration_rows(rank) * self.tt_size_factor(rows) * replica

    def _tt_at_calibration_rows(self, rank: int) -> float:
        pts = non_decreasing(sorted((int(r), float(s)) for r, s in self.tt_lookup_s.items()))
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
        for name in ("link_latency_us", "step_overhead_s", "table_overhead_s", "row_group_overhead_s", "tt_rows"):
            v = float(getattr(out, name))
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"{where}: {name} must be a number >= 0, got {v}")
        if not (float(out.tt_replica_factor) > 0 and math.isfinite(float(out.tt_replica_factor))):
            raise ConfigError(f"{where}: tt_replica_factor must be a positive number, got {out.tt_replica_factor}")
        if not math.isfinite(float(out.tt_size_slope)):
            raise ConfigError(f"{where}: tt_size_slope must be a finite number, got {out.tt_size_slope}")
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


def non_decreasing(pts: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``pts`` (rank, seconds), sorted by rank, with the seconds made non-decreasing by pooling adjacent
    violators: every run of ranks whose figures fall as the rank grows takes their mean (the least-squares
    non-decreasing fit). Figures already non-decreasing come back as they are. On a loaded machine one
    calibration measured rank 16 at 16.2 us and rank 32 at 13.7 us a lookup: both are taken at 15.0 us."""
    blocks: list[list[float]] = []  # [sum, count] per pooled run
    for _, s in pts:
        blocks.append([s, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, n2 = blocks.pop()
            blocks[-1][0] += s2
            blocks[-1][1] += n2
    vals = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return [(r, v) for (r, _), v in zip(pts, vals)]


def load_costs(path: str | Path | None) -> Costs:
    """The costs of ``path`` (``embedscale calibrate``), or the documented defaults when ``path`` is None."""
    if path is None:
        return Costs()
    return Costs.from_dict(read_json(Path(path), "costs file"), str(path))


def exchange_latency_of(labels: Iterable[str | CandidateKind], world: int, costs: Costs) -> float:
    """The latency a step pays once per exchange of tables costed as candidate ``labels`` (one per table, labels or
    kinds), whatever the tables in it: the sharded rows' all-to-all (forward and backward), one all-reduce of
    replicated rows, one of TT cores, the host rows' all-gathers (two); plus the executor's work per step of the
    kinds present (:meth:`Costs.kinds_overhead`)."""
    if world <= 1:
        return 0.0
    kinds = {CandidateKind.of(lb) for lb in labels}
    K = CandidateKind
    n = 2 * (K.SHARDED in kinds) + (K.REPLICATED in kinds) + (K.TT in kinds) + 2 * (K.HOST in kinds)
    return n * costs.link_latency_us * 1e-6 + costs.kinds_overhead(kinds, world)
