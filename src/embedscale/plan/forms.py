"""What the plan decides about every table: its *form* (sharded, TT, host, tower), and the model's default tables.

numpy-only (like all of ``embedscale.plan``): no torch, nothing from ``embedscale.embedding``.

**Forms.** A :class:`TableForm` says how a table is stored and trained:

* ``sharded``: rows placed on the ranks by the plan's row placement (OPER section 4);
* ``tt``: a tensor-train table of rank ``tt_rank`` (EL-Rec section III), replicated on every rank and trained
  data-parallel (EL-Rec section VI-B): the plan gives it no rows; ``reorder`` says its ids are renamed by an
  index reordering (EL-Rec section IV, :mod:`embedscale.reorder`) that the plan carries (``<plan>/reorder/``,
  ``Plan.meta["reordering"]``) and training applies;
* ``host``: rows in the host parameter server, prefetched ``pipeline_depth`` batches ahead (EL-Rec section V);
* ``tower``: a DMT tower's table (DMT section 4), placed by the tower assignment.

A ``TableSpec`` holds only facts (rows, dim, pooling, features); the forms travel beside the specs as
``{table: TableForm}``. The config's keys (``model.tables[i].compression: tt``, ``placement: host``: a
``specs.TableConfig``; ``model.tt_min_rows``, ``model.host_min_rows``) and ``embedscale plan --tt-min-rows``
are *requests*; :func:`decide_forms` is the one function that turns them into forms (:func:`config_forms` for a
run config), and the plan records the result (``plan.meta["forms"]``, read back by ``Plan.forms``). Training
with a saved plan builds the forms the plan recorded (:func:`forms_for_run`).

**Default tables.** :func:`default_tables` is the one place that names the model's tables when the config lists
none: one table ``t_<feature>`` per sparse feature, used by ``embedscale plan --profile`` and by training
(``workflow.tables_for``), so a plan made from a profile of the data covers exactly the tables training builds.
A profile of the data is per feature; :func:`table_profile` sums it by table (features sharing a table add up).

**TT size arithmetic** (EL-Rec section III-A): :func:`factor_rows`, :func:`factor_dim`, :func:`tt_ranks`,
:func:`core_shapes`, :func:`tt_shapes` and :func:`table_bytes` (bytes a table takes in its form).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from embedscale.errors import ConfigError
from embedscale.specs import ModelConfig, TableConfig, TableSpec



class FormKind(StrEnum):
    """The kind of a table's form: ``sharded`` exact rows placed by the plan (or replicated), ``tt`` compressed
    (EL-Rec III), ``host`` in the host parameter server (EL-Rec V), ``tower`` in a DMT tower group (DMT 3.1). A
    ``StrEnum``: equal to its name as a string, written as it in JSON."""

    SHARDED = "sharded"
    TT = "tt"
    HOST = "host"
    TOWER = "tower"

    def __repr__(self) -> str:  # messages quote a kind as the text a config gives
        return repr(self.value)


KINDS = tuple(k.value for k in FormKind)
TT_BYTES_PER_VALUE = 4  # TT cores are float32
DEFAULT_TABLE_PREFIX = "t_"


@dataclass(frozen=True)
class TableForm:
    """How one table is stored and trained (see the module docstring).

    Args:
        kind: ``sharded``, ``tt``, ``host`` or ``tower``.
        tt_rank: TT rank (``kind == "tt"``), else 0.
        pipeline_depth: batches the host server prefetches ahead (``kind == "host"``; 0 = the run's
            ``train.pipeline_depth``).
        tower: the DMT tower holding the table (``kind == "tower"``), else -1.
        reorder: a TT table whose ids an index reordering renames (EL-Rec section IV; ``kind == "tt"`` only).
        hot_rows: row groups: a TT table whose ``hot_rows`` hottest rows stay exact (replicated, trained like
            the TT cores, data-parallel) and only the others are TT (``embedding.hybrid``); needs ``reorder`` (the
            reordering's first ids are the hot rows). 0: the whole table TT.
    """

    kind: FormKind = FormKind.SHARDED
    tt_rank: int = 0
    pipeline_depth: int = 0
    tower: int = -1
    reorder: bool = False
    hot_rows: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"table form {self.kind!r} is not one of {', '.join(KINDS)}")
        object.__setattr__(self, "kind", FormKind(self.kind))
        if self.kind == "tt" and self.tt_rank <= 0:
            raise ConfigError(f"a TT table form needs a positive tt_rank, got {self.tt_rank}")
        if self.kind != "tt" and self.tt_rank:
            raise ConfigError(f"tt_rank {self.tt_rank} given for a {self.kind!r} table form")
        if self.pipeline_depth < 0:
            raise ConfigError(f"table form: pipeline_depth must be >= 0, got {self.pipeline_depth}")
        if self.hot_rows < 0 or (self.hot_rows and not (self.kind == "tt" and self.reorder)):
            raise ConfigError(f"table form {self.kind!r}: hot_rows {self.hot_rows} (exact hot rows beside TT cold "
                              "rows) needs a TT form with an index reordering (reorder: true) and hot_rows >= 0")
        if self.reorder and self.kind != "tt":
            raise ConfigError(f"table form {self.kind!r}: index reordering (reorder) is for TT tables only "
                              "(EL-Rec section IV)")
        if (self.kind == "tower") != (self.tower >= 0):
            raise ConfigError(f"table form {self.kind!r}: tower {self.tower} (a tower table names its tower >= 0, "
                              "no other form does)")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "form") -> "TableForm":
        if not isinstance(d, Mapping) or "kind" not in d:
            raise ConfigError(f"{where}: expected a mapping with 'kind', got {d!r}")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}")
        try:
            return cls(**{k: (str(v) if k == "kind" else _flag(v, f"{where}.reorder") if k == "reorder" else int(v))
                          for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None

    def describe(self) -> str:
        hot = f", {self.hot_rows:,} hot rows exact" if self.hot_rows else ""
        tt = f"tt (rank {self.tt_rank}{hot}{', reordered' if self.reorder else ''})"
        return {"sharded": "sharded", "tt": tt, "host": "host", "tower": f"tower {self.tower}"}[self.kind]


def _flag(v, where: str) -> bool:
    if isinstance(v, bool):
        return v
    raise ConfigError(f"{where}: expected true or false, got {v!r}")


SHARDED = TableForm()
#: ``model.tt_reorder``: how a TT table's index reordering is built (EL-Rec IV; ``none``: no reordering):
#: ``frequency`` from the access profile alone (hot rows first, the rest by count: Algorithm 2's global
#: information), ``leiden`` / ``louvain`` also from co-access in the data's batches (its local information)
REORDER_METHODS = ("none", "frequency", "leiden", "louvain")


def reordered_tables(forms: Mapping[str, TableForm]) -> list[str]:
    """The tables whose form carries an index reordering (TT tables with ``reorder``), in ``forms`` order."""
    return [n for n, f in forms.items() if f.reorder]


def host_pipeline_depth(forms: Mapping[str, TableForm], default: int) -> int:
    """The depth the run's host tables are prefetched with (EL-Rec section V): the largest ``pipeline_depth``
    of their forms, a form's 0 standing for ``default`` (the run's ``train.pipeline_depth``); at least 1.

    One pipeline (``pipeline.PipelinedLoader``) serves every host table of a run, so they share one depth. When
    the forms disagree (a hand-edited or merged plan; ``--strategy auto`` gives every host table the same
    depth) the largest wins: no table gets less prefetch than its plan asked for, and a table planned for a
    smaller depth holds more rows on the device than its plan counted (``(k D_r + (k-1) D_g)`` rows, plan.auto)."""
    depths = [f.pipeline_depth or int(default) for f in forms.values() if f.kind == "host"]
    return max([1, *depths]) if depths else max(1, int(default))


# -- default tables and the profile by table --------------------------------------------------------------

def default_tables(features: Iterable[tuple[str, int]], dim: int, pooling: str = "sum") -> list[TableSpec]:
    """The model's tables when the config lists none: one table ``t_<feature>`` per sparse feature, with the
    feature's rows. ``features`` is ``(name, num_rows)`` pairs (a manifest's sparse features, or a per-feature
    access profile's tables)."""
    return [TableSpec(name=f"{DEFAULT_TABLE_PREFIX}{f}", num_rows=int(n), dim=dim, features=[f], pooling=pooling)
            for f, n in features]


class TableCounts:
    """An access profile by table: ``counts(table)`` sums the counts of the table's features (numpy only).

    Has what the planner reads from a profile: ``table_names``, ``counts``, ``num_rows``, ``samples``."""

    def __init__(self, counts: Mapping[str, np.ndarray], samples: int | float):
        self._counts = dict(counts)
        self.samples = samples

    @property
    def table_names(self) -> list[str]:
        return list(self._counts)

    def counts(self, name: str) -> np.ndarray:
        try:
            return self._counts[name]
        except KeyError:
            raise ConfigError(f"access profile has no table {name!r}; tables: {self.table_names}") from None

    def num_rows(self, name: str) -> int:
        return int(self.counts(name).size)

    def spec(self) -> str:
        return "AccessProfile (by table)"


def table_profile(profile, tables: Sequence[TableSpec]):
    """``profile`` as counts by table of ``tables``.

    A profile whose tables already are ``tables``' names is returned as it is. A per-feature profile (what
    ``embedscale profile DIR`` writes: one entry per sparse feature) is summed by table: a table's count of
    row ``r`` is the sum over its features of their counts of ``r``. A feature the profile lacks, or one
    with more rows than its table, is a ``ConfigError`` naming table and feature."""
    names = set(profile.table_names)
    if all(t.name in names for t in tables):
        return profile
    out = {}
    for t in tables:
        acc = np.zeros(t.num_rows, dtype=np.int64)
        for f in getattr(t, "features", None) or [t.name]:
            if f not in names:
                raise ConfigError(f"table {t.name!r} reads feature {f!r}, which the access profile does not have "
                                  f"(it has {sorted(names)})")
            c = np.asarray(profile.counts(f))
            if c.size > t.num_rows:
                raise ConfigError(f"table {t.name!r} has {t.num_rows} rows but the profile of feature {f!r} has "
                                  f"{c.size}")
            if c.dtype.kind == "f" and acc.dtype.kind != "f":
                acc = acc.astype(np.float64)
            acc[: c.size] += c
        out[t.name] = acc
    samples = getattr(profile, "samples", None)
    return TableCounts(out, samples() if callable(samples) else samples)


def tables_from_profile(profile, dim: int, pooling: str = "sum") -> list[TableSpec]:
    """The tables a plan over ``profile`` covers: the default tables of its features (:func:`default_tables`)
    for a per-feature profile (each feature its own entry, as ``embedscale profile DIR`` writes); for a
    profile saved by table (``feature_to_table`` set, e.g. a run's
    ``profile/``) its tables with the features that map to them."""
    f2t = getattr(profile, "feature_to_table", None)
    if not f2t or all(f == t for f, t in f2t.items()):  # per feature: one entry per sparse feature
        return default_tables(((n, profile.num_rows(n)) for n in profile.table_names), dim, pooling)
    return [TableSpec(n, profile.num_rows(n), dim, features=[f for f, t in f2t.items() if t == n], pooling=pooling)
            for n in profile.table_names]


# -- forms: requests -> decisions ---------------------------------------------------------------------------

def decide_forms(tables: Sequence[TableSpec], *, requests: Sequence[TableConfig] = (), tt_min_rows: int = 0,
                 tt_rank: int = 32, host_min_rows: int = 0, towers: Mapping[str, int] | None = None,
                 tt_reorder: str = "none") -> dict[str, TableForm]:
    """The form of every table, from the requests (the one place they are decided).

    ``requests`` are the config's table entries (``model.tables``, :class:`~embedscale.specs.TableConfig`),
    matched to ``tables`` by name. Requests, strongest first: ``towers`` (DMT: table -> tower, DMT section 4)
    makes tower tables; a table whose entry says ``compression: tt`` is TT of its ``tt_rank``, ``placement:
    host`` is host-placed; otherwise ``tt_min_rows > 0`` makes every table of at least that many rows TT of
    ``tt_rank`` (EL-Rec section VI-A's policy) and ``host_min_rows > 0`` moves tables of at least that many rows
    to the host parameter server (EL-Rec section V). A table both thresholds take, or that is both TT and host,
    is a ``ConfigError``; so is a TT table that does not pool, or a request for a table not in ``tables``.
    Everything else is sharded by the plan. ``tt_reorder`` (``model.tt_reorder``, one of
    :data:`REORDER_METHODS`): anything but ``none`` gives every TT table an index reordering (``reorder``).
    """
    out = _decide_forms(tables, requests, tt_min_rows, tt_rank, host_min_rows, towers)
    return with_reorder(out, tt_reorder)


def with_reorder(forms: Mapping[str, TableForm], tt_reorder: str) -> dict[str, TableForm]:
    """``forms`` with every TT table's ``reorder`` set when ``tt_reorder`` (``model.tt_reorder``) is not
    ``none`` (a ``ConfigError`` when it is not one of :data:`REORDER_METHODS`)."""
    if tt_reorder not in REORDER_METHODS:
        raise ConfigError(f"model.tt_reorder {tt_reorder!r} is not one of {', '.join(REORDER_METHODS)}")
    on = tt_reorder != "none"
    # a form with exact hot rows keeps its reordering: its first ids are those rows
    return {n: (dataclasses.replace(f, reorder=on or bool(f.hot_rows)) if f.kind == "tt" else f)
            for n, f in forms.items()}


def _decide_forms(tables, requests, tt_min_rows, tt_rank, host_min_rows, towers) -> dict[str, TableForm]:
    if tt_min_rows < 0:
        raise ConfigError(f"model.tt_min_rows must be >= 0 (0 = off), got {tt_min_rows}")
    if host_min_rows < 0:
        raise ConfigError(f"model.host_min_rows must be >= 0, got {host_min_rows}")
    if tt_min_rows and tt_rank <= 0:
        raise ConfigError(f"model.tt_rank must be positive, got {tt_rank}")
    asked = {r.name: r for r in requests}
    unknown = sorted(set(asked) - {t.name for t in tables})
    if unknown:
        raise ConfigError(f"model.tables: requests for tables {unknown} that the model does not have "
                          f"(its tables: {[t.name for t in tables]})")
    out: dict[str, TableForm] = {}
    for t in tables:
        if towers is not None:
            if t.name not in towers:
                raise ConfigError(f"table {t.name!r} is in no tower (towers hold {sorted(towers)})")
            out[t.name] = TableForm("tower", tower=int(towers[t.name]))
            continue
        req = asked.get(t.name)
        tt_req = req is not None and req.compression == "tt"
        host_req = req is not None and req.placement == "host"
        pooling = getattr(t, "pooling", "sum")  # a saved plan's PlanTable has none: it pools
        if tt_req and host_req:
            raise ConfigError(f"table {t.name!r} asks for compression: tt and placement: host; a table is either "
                              "TT-compressed (replicated) or host-placed")
        if not tt_req and not host_req and tt_min_rows and t.num_rows >= tt_min_rows:
            if host_min_rows and t.num_rows >= host_min_rows:
                raise ConfigError(f"table {t.name!r} ({t.num_rows} rows) reaches both model.tt_min_rows "
                                  f"({tt_min_rows}) and model.host_min_rows ({host_min_rows}): a table is either "
                                  "TT-compressed (replicated) or host-placed, set one")
            if pooling == "none":
                raise ConfigError(f"table {t.name!r} ({t.num_rows} rows) reaches model.tt_min_rows ({tt_min_rows}), "
                                  "but TT tables pool (sum or mean) and this one has pooling 'none'")
            out[t.name] = TableForm("tt", tt_rank=tt_rank)
        elif tt_req:
            if pooling == "none":
                raise ConfigError(f"table {t.name!r}: compression: tt, but TT tables pool (sum or mean) and this one "
                                  "has pooling 'none'")
            hot = int(getattr(req, "hot_rows", 0))
            out[t.name] = TableForm("tt", tt_rank=req.tt_rank, reorder=bool(hot), hot_rows=hot)
        elif host_req or (host_min_rows and t.num_rows >= host_min_rows):
            out[t.name] = TableForm("host")
        else:
            out[t.name] = SHARDED
    return out


def config_forms(model: ModelConfig, tables: Sequence[TableSpec]) -> dict[str, TableForm]:
    """The forms the model config asks for ``tables``: its ``model.tables`` entries' requests and its
    ``tt_min_rows`` / ``tt_rank`` / ``host_min_rows``, decided by :func:`decide_forms` (a world of one builds
    these; several ranks build what their plan recorded, :func:`forms_for_run`)."""
    return decide_forms(tables, requests=model.tables, tt_min_rows=model.tt_min_rows, tt_rank=model.tt_rank,
                        host_min_rows=model.host_min_rows, tt_reorder=model.tt_reorder)


def forms_for_run(saved: Mapping[str, TableForm], requested: Mapping[str, TableForm], plan: str) -> dict[str, TableForm]:
    """The forms a run with a saved plan builds: the plan's (``saved``, ``Plan.forms``), for exactly the tables
    of the model (``requested``: the forms this run's config asks for, :func:`decide_forms`).

    A table the plan does not know is a ``ConfigError``, except one the config asks to be TT or host (a plan
    saved without forms, e.g. hand-written, names only its sharded tables): it keeps its requested form. An explicit request (anything but ``sharded``) that
    contradicts the plan is a ``ConfigError`` naming table, plan and request (a TT request with ``reorder`` against
    a plan's TT form without one too); a table the plan made TT or host without the config asking, or TT with
    an index reordering, is built as the plan says."""
    extra = sorted(set(saved) - set(requested))
    if extra:
        raise ConfigError(f"plan {plan} has tables {extra} that the model does not have (the model's tables: "
                          f"{sorted(requested)}); plan the model's tables (embedscale plan --profile of its data "
                          "names them as training does)")
    out: dict[str, TableForm] = {}
    for name, want in requested.items():
        have = saved.get(name)
        if have is None:
            if want.kind == "sharded":
                raise ConfigError(f"table {name!r} is not in plan {plan} (the plan has {sorted(saved)})")
            out[name] = want
            continue
        same = (want.kind, want.tt_rank, want.pipeline_depth, want.tower) == \
            (have.kind, have.tt_rank, have.pipeline_depth, have.tower)
        if want.kind != "sharded" and (not same or (want.reorder and not have.reorder)):
            raise ConfigError(f"table {name!r}: the config asks for {want.describe()} but plan {plan} made it "
                              f"{have.describe()}; drop the request or re-plan with it")
        out[name] = have
    return out


def check_plan_sizes(plan, tables: Sequence[TableSpec], plan_name: str) -> None:
    """The rows and dim of every table ``plan`` places must be the model's (``embedscale plan --dim`` against
    ``model.embedding_dim``, a profile of other data): else a ``ConfigError`` naming table, plan and both."""
    mine = {t.name: t for t in tables}
    for p in plan.tables:
        t = mine.get(p.name)
        if t is not None and (int(p.num_rows), int(p.dim)) != (int(t.num_rows), int(t.dim)):
            raise ConfigError(f"table {p.name!r}: plan {plan_name} placed {p.num_rows} rows of dim {p.dim}, the model "
                              f"has {t.num_rows} rows of dim {t.dim}; re-plan (embedscale plan --dim {t.dim}) or match "
                              "the model to the plan")


# -- TT size arithmetic (EL-Rec section III-A) --------------------------------------------------------------

def factor_rows(num_rows: int, num_cores: int = 3) -> list[int]:
    """Row factors ``m_1..m_d`` with ``prod >= num_rows``, as balanced as possible, least padding first.

    Candidates are the integers near ``num_rows ** (1/d)``; among the combinations whose product covers
    the table, the smallest product wins (least padding), then the most balanced. The largest factor goes
    last (more rows share a prefix: more reuse, section III-A) and the smallest into the middle cores,
    whose slices carry ``R^2`` values each (the least memory).
    """
    if num_rows <= 0:
        raise ConfigError(f"factor_rows: num_rows must be positive, got {num_rows}")
    if num_cores < 2:
        raise ConfigError(f"factor_rows: a TT table needs at least 2 cores, got {num_cores}")
    base = max(1, int(round(num_rows ** (1.0 / num_cores))))
    cands = range(max(1, base - 2), base + 4)
    best = None
    for combo in itertools.combinations_with_replacement(cands, num_cores):
        p = math.prod(combo)
        if p < num_rows:
            continue
        key = (p, max(combo) - min(combo))
        if best is None or key < best[0]:
            best = (key, combo)
    if best is None:  # cannot happen: (base + 3) ** d >= num_rows
        raise ConfigError(f"factor_rows: no factorisation of {num_rows} rows into {num_cores} factors")
    s = sorted(best[1])
    if num_cores == 2:
        return s
    return [s[-2]] + s[:-2] + [s[-1]]


def factor_dim(dim: int, num_cores: int = 3) -> list[int]:
    """Exact dim factors ``n_1..n_d`` (``prod == dim``), most balanced, ascending (the largest last: the
    reuse buffer's width ``n_1 * .. * n_{d-1}`` and the middle cores stay small)."""
    if dim <= 0:
        raise ConfigError(f"factor_dim: dim must be positive, got {dim}")

    def splits(n: int, k: int):
        if k == 1:
            yield (n,)
            return
        for f in range(1, n + 1):
            if n % f == 0:
                for rest in splits(n // f, k - 1):
                    yield (f,) + rest

    best = min(splits(dim, num_cores), key=lambda c: (max(c), -min(c)))
    return sorted(best)


def tt_ranks(tt_rank: int | Sequence[int], num_cores: int) -> list[int]:
    """Full rank list ``[1, R_1, .., R_{d-1}, 1]`` from one rank or the ``d - 1`` inner ranks."""
    if isinstance(tt_rank, int) and not isinstance(tt_rank, bool):
        inner = [tt_rank] * (num_cores - 1)
    else:
        inner = [int(r) for r in tt_rank]
        if len(inner) != num_cores - 1:
            raise ConfigError(f"tt_rank: {num_cores} cores need {num_cores - 1} inner ranks, got {inner}")
    if any(r <= 0 for r in inner):
        raise ConfigError(f"tt_rank must be positive, got {inner}")
    return [1] + inner + [1]


def core_shapes(row_shape: Sequence[int], dim_shape: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Shape of every core: ``(m_k, R_{k-1}, n_k * R_k)``."""
    return [(m, ranks[k], n * ranks[k + 1]) for k, (m, n) in enumerate(zip(row_shape, dim_shape))]


def tt_shapes(spec: TableSpec, tt_rank: int | Sequence[int],
              num_cores: int = 3) -> tuple[list[int], list[int], list[int]]:
    """``(row_shape, dim_shape, ranks)`` a ``TTEmbeddingBag`` of ``spec`` at ``tt_rank`` uses by default."""
    return factor_rows(spec.num_rows, num_cores), factor_dim(spec.dim, num_cores), tt_ranks(tt_rank, num_cores)


def table_bytes(spec: TableSpec, form: TableForm, num_cores: int = 3) -> int:
    """Bytes the table's values take as stored in ``form``: TT cores (float32) for ``tt`` (plus the exact hot rows
    with ``hot_rows``), else ``num_rows * dim * bytes_per_value``."""
    if form.kind != "tt":
        return spec.memory_bytes
    rows, dims, ranks = tt_shapes(spec, form.tt_rank, num_cores)  # the cores cover every row (embedding.hybrid)
    hot = form.hot_rows * spec.dim * TT_BYTES_PER_VALUE
    return sum(math.prod(s) for s in core_shapes(rows, dims, ranks)) * TT_BYTES_PER_VALUE + hot


def replicated_tables_meta(tables: Sequence[TableSpec], forms: Mapping[str, TableForm],
                           num_cores: int = 3) -> list[dict]:
    """What a plan records about the TT tables (by ``forms``) it does not shard: name, rows, dim, rank,
    factorisation and core bytes, held by *every* rank (``Plan.meta["replicated_tables"]``)."""
    out = []
    for t in tables:
        f = forms[t.name]
        if f.kind != "tt":
            continue
        rows, dims, _ = tt_shapes(t, f.tt_rank, num_cores)
        out.append({"name": t.name, "num_rows": int(t.num_rows), "dim": int(t.dim), "compression": "tt",
                    "tt_rank": int(f.tt_rank), "row_shape": rows, "dim_shape": dims, "hot_rows": int(f.hot_rows),
                    "bytes": int(table_bytes(t, f, num_cores)), "uncompressed_bytes": int(t.memory_bytes),
                    "placement": "replicated on every rank"})
    return out
