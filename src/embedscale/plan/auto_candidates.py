"""The auto planner's candidates: what the search needs of a table's profile (:class:`TableStats`,
:func:`table_stats`) and every form a table may take, costed per rank by :mod:`embedscale.plan.auto`'s model
(:func:`candidates`, :func:`hybrid_candidate` for row groups). numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.auto_costs import DEFAULT_TT_RANKS, CandidateKind, Costs
from embedscale.plan.forms import SHARDED, FormKind, TableForm, core_shapes, factor_dim, factor_rows, tt_ranks
from embedscale.plan.mrc import MissRatioCurve, probability_histogram

STATE_BYTES_PER_ROW = 4  # row-wise Adagrad: one float32 per row


@dataclass(frozen=True)
class Candidate:
    """One form of one table with what it costs per rank: step seconds, device and host bytes."""

    label: str  # replicated | sharded | tt-R | tt-R-hotH | host-k: for people and reports
    form: TableForm
    seconds: float
    device_bytes: float
    host_bytes: float
    kind: CandidateKind | None = None  # None: the label's (CandidateKind.of; a candidate made by hand)

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", CandidateKind.of(self.label))

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
    sec = s.lookups_rank * (a * costs.exact_lookup_s + (1 - d) * costs.tt(int(rank), s.num_rows, m)) + sync \
        + costs.row_group_overhead_s
    return Candidate(f"tt-{rank}-hot{hot_rows}",
                     TableForm(FormKind.TT, tt_rank=int(rank), reorder=True, hot_rows=int(hot_rows)), sec,
                     float(cb + hot_rows * (s.row_bytes + STATE_BYTES_PER_ROW)), 0.0, CandidateKind.TT)


#: the quality guard of row groups: a row a global batch reads at least this many times on
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
                             full / m, 0.0, CandidateKind.SHARDED))
    if "replicated" in forms and m > 1:
        out.append(Candidate("replicated", SHARDED, exact + s.distinct_global * rb * 2 * frac / ar, full, 0.0,
                             CandidateKind.REPLICATED))
    hot_rows = s.rows_read_at_least(hot_row_touch, m) if hot_row_touch > 0 else 0
    if "tt" in forms and not s.hot and s.pooling != "none" and hot_rows <= MAX_HOT_ROW_SHARE * s.num_rows:
        for r in (tt_rank_list if not hot_rows else ()):
            cb = tt_core_bytes(s.num_rows, s.dim, int(r))
            if cb >= full and not keep_larger:  # a TT table larger than the table itself is never worth it
                continue
            out.append(Candidate(f"tt-{r}", TableForm(FormKind.TT, tt_rank=int(r)),
                                 s.lookups_rank * costs.tt(int(r), s.num_rows, m) + cb * 2 * frac / ar,
                                 float(cb), 0.0, CandidateKind.TT))
        for r in (tt_rank_list if hot_rows else ()):
            c = hybrid_candidate(s, int(r), hot_rows, m, costs)
            if c.device_bytes < full or keep_larger:
                out.append(c)
    if "host" in forms:
        k = max(1, int(host_depth))
        dev = (k * s.distinct_rank + (k - 1) * s.distinct_global) * (rb + STATE_BYTES_PER_ROW)
        sec = exact + (s.distinct_rank + (s.distinct_global if m > 1 else 0.0)) * costs.host_row_s \
            + 2 * s.distinct_global * frac * rb / link
        out.append(Candidate(f"host-{k}", TableForm(FormKind.HOST, pipeline_depth=k), sec, min(dev, full), float(full),
                             CandidateKind.HOST))
    if not out:
        raise ConfigError(f"table {s.name!r}: no form allowed (forms {list(forms)})")
    if costs.executor_overhead_s and m > 1:  # the executor's own work per table of a form (Costs.executor_overhead)
        out = [replace(c, seconds=c.seconds + costs.executor_overhead(c.kind, m)) for c in out]
    return out
