"""The predicted time of a whole training step of a plan: embedding, dense model and fixed overheads (numpy only).

The prediction is held within 20% of the measured step (BENCHMARKS.md). :mod:`embedscale.plan.auto` costs every table's
form (lookups, updates, the rows and gradients it moves: the part of a step the search can change); a step
also pays, whatever the forms:

* the dense model's forward and backward (:class:`DenseModel`: FLOPs from the model's layer sizes, DLRM's
  bottom MLP, dot interaction and top MLP, or DCN-v2's cross layers; divided by the FLOP rate
  ``Costs.dense_flops_per_s`` that ``embedscale calibrate`` measures on the machine);
* with several ranks, the dense gradients' all-reduce (DDP: ``2 (M-1)/M`` of the parameter bytes over the
  all-reduce bandwidth, plus one latency) and the loss's all-reduce (one latency);
* a fixed overhead per step (``Costs.step_overhead_s``: the Python of a step, the loss, the dense optimizer's
  bookkeeping) and one per table (``Costs.table_overhead_s``: splitting the batch's ids by feature, pooling,
  concatenating), both measured by ``embedscale calibrate`` as the residual of a real DLRM step at two
  feature counts.

With ``B`` the samples per rank batch and ``T`` the tables:

    step = embedding (auto's per-table seconds, the exchange latencies)
         + B * flops_per_sample / dense_flops_per_s
         + T * table_overhead_s + step_overhead_s
         + [M > 1] (2 (M-1)/M * 4 P / allreduce_bw + 2 latency)
         + [M > 1] sum over tables of executor_overhead(form)

The last term is the distributed executor's own work that a single-process calibration cannot see (bucketing
ids by owner, the exchanges beyond their bytes, host tables' all-gathers and server reads, the ranks and their
loader threads sharing the cores): ``embedscale calibrate --ranks N`` times real N-rank training steps of a plan
of every form (all tables sharded; the largest ones TT; the largest ones on the host) and
:func:`fit_executor` fits one scale of this module's prediction (the figures of one calibration process
against N ranks' share of a shared machine; applied to the costs' figures, :meth:`Costs.scaled`) and the
plans' remaining residuals as seconds per table and step of each form (``Costs.executor_overhead_s``, >= 0). It is part of every candidate's seconds
(:func:`embedscale.plan.auto.candidates`), so the auto search weighs it too.

:func:`predict_forms` costs any assignment of forms (a hand-made plan's: EL-Rec's rule, a mixture of rules)
with the very model the auto search optimises, so hand-made plans and the auto plan are predicted alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.auto_candidates import Candidate, TableStats, candidates, hybrid_candidate
from embedscale.plan.auto_costs import (EXECUTOR_TERMS, STEP_TERMS, CandidateKind, Costs, exchange_latency_of,
                                        step_terms)
from embedscale.plan.forms import TableForm

#: the dense optimizer's work per parameter and step, in FLOPs (Adagrad: square, add, sqrt, divide, multiply)
OPTIMIZER_FLOPS_PER_PARAM = 6


@dataclass(frozen=True)
class DenseModel:
    """The dense side of a model, for its FLOPs and parameters: ``ModelConfig``'s sizes and the features.

    ``bottom_mlp`` / ``top_mlp`` are hidden widths as in ``ModelConfig`` (the bottom MLP's last layer of width
    ``embedding_dim`` and the top MLP's logit layer are implied, as in ``models.dlrm``)."""

    arch: str = "dlrm"
    dense_in: int = 13
    num_features: int = 26
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 64)
    top_mlp: tuple[int, ...] = (512, 256)
    cross_layers: int = 3
    cross_low_rank: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("dlrm", "dcn"):
            raise ConfigError(f"the step model knows the archs dlrm and dcn, not {self.arch!r}")
        for name in ("dense_in", "num_features", "embedding_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"dense model: {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, model, num_features: int, dense_in: int = 13) -> "DenseModel":
        """From a ``specs.ModelConfig`` (or any object with its fields) and the number of sparse features."""
        arch = str(getattr(model, "arch", "dlrm"))
        arch = {"dmt-dlrm": "dlrm", "dmt-dcn": "dcn"}.get(arch, arch)
        return cls(arch=arch, dense_in=int(dense_in), num_features=int(num_features),
                   embedding_dim=int(model.embedding_dim), bottom_mlp=tuple(int(x) for x in model.bottom_mlp),
                   top_mlp=tuple(int(x) for x in model.top_mlp), cross_layers=int(getattr(model, "cross_layers", 3)),
                   cross_low_rank=int(getattr(model, "cross_low_rank", 0)))

    def interaction_width(self) -> int:
        """Width of the top MLP's input: DLRM ``D + (F + 1) F / 2`` (``InteractionArch.output_dim``), DCN
        ``(F + 1) D`` (the cross network keeps its width)."""
        f, d = self.num_features, self.embedding_dim
        return d + (f + 1) * f // 2 if self.arch == "dlrm" else (f + 1) * d

    def linear_layers(self) -> list[tuple[int, int]]:
        """``(in, out)`` of every linear layer: bottom MLP, (DCN) cross layers, top MLP."""
        out = []
        w = self.dense_in
        for s in list(self.bottom_mlp) + [self.embedding_dim]:
            out.append((w, s))
            w = s
        if self.arch == "dcn":
            x = self.interaction_width()
            for _ in range(self.cross_layers):
                out += [(x, self.cross_low_rank), (self.cross_low_rank, x)] if self.cross_low_rank else [(x, x)]
        w = self.interaction_width()
        for s in list(self.top_mlp) + [1]:
            out.append((w, s))
            w = s
        return out

    def parameters(self) -> int:
        """Dense parameters (weights and biases)."""
        return sum(i * o + o for i, o in self.linear_layers())

    def forward_flops_per_sample(self) -> float:
        """Multiply-adds times two of one sample's forward: the linear layers and DLRM's dot interaction
        (a ``(F+1) x (F+1)`` Gram matrix of ``D``-vectors)."""
        f = 2.0 * sum(i * o for i, o in self.linear_layers())
        if self.arch == "dlrm":
            f += 2.0 * (self.num_features + 1) ** 2 * self.embedding_dim
        return f

    def train_flops(self, samples: float) -> float:
        """FLOPs of a training step over ``samples``: forward, backward (twice the forward: gradients of the
        inputs and of the weights) and the optimizer's update of every parameter."""
        return 3.0 * samples * self.forward_flops_per_sample() + OPTIMIZER_FLOPS_PER_PARAM * self.parameters()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bottom_mlp"], d["top_mlp"] = list(self.bottom_mlp), list(self.top_mlp)
        return d


def default_dense(tables) -> DenseModel:
    """DLRM of ``ModelConfig``'s default sizes over ``tables``' features (dim of the first table)."""
    return DenseModel(num_features=sum(len(getattr(t, "features", None) or [t.name]) for t in tables),
                      embedding_dim=int(tables[0].dim))


def fixed_terms(dense: DenseModel, batch_size: int, world: int, num_tables: int, costs: Costs) -> dict[str, float]:
    """The seconds of a step every plan pays (module docstring): ``dense`` (forward, backward, update),
    ``dense_sync`` (the gradients' and the loss's all-reduce, several ranks), ``tables`` (per-table overhead)
    and ``step`` (the fixed overhead). ``batch_size``: samples per rank batch."""
    m = int(world)
    out = {"dense": dense.train_flops(batch_size) / costs.dense_flops_per_s,
           "dense_sync": 0.0,
           "tables": num_tables * costs.table_overhead_s,
           "step": costs.step_overhead_s}
    if m > 1:
        out["dense_sync"] = (2 * (m - 1) / m * 4 * dense.parameters() / (costs.allreduce_gbs * 1e9)
                             + 2 * costs.link_latency_us * 1e-6)
    return out


def form_label(form: TableForm, host_depth: int = 1) -> str:
    """The candidate label of ``form`` (``sharded``, ``tt-R``, ``host-k``; a host form of depth 0 takes the
    run's ``host_depth``); ``replicated`` is a placement, not a form, so a sharded form is labelled ``sharded``."""
    if form.kind == "tt":
        return f"tt-{int(form.tt_rank)}" + (f"-hot{int(form.hot_rows)}" if form.hot_rows else "")
    if form.kind == "host":
        return f"host-{max(1, int(form.pipeline_depth or host_depth))}"
    return "sharded"


def candidate_of(s: TableStats, form: TableForm, world: int, costs: Costs, host_depth: int = 1) -> Candidate:
    """The costed candidate of table ``s`` in ``form`` (any TT rank or host depth, hot tables too: a hand-made
    plan may choose what the search would not). ``host_depth``: the run's pipeline depth, for host forms of
    depth 0."""
    label = form_label(form, host_depth)
    if form.kind == "tt" and form.hot_rows:  # row groups
        cs = [hybrid_candidate(s, int(form.tt_rank), int(form.hot_rows), world, costs)]
        if costs.executor_overhead_s and world > 1:
            cs = [replace(c, seconds=c.seconds + costs.executor_overhead(c.kind, world)) for c in cs]
    elif form.kind == "tt":
        cs = candidates(replace(s, hot=False, pooling=s.pooling if s.pooling != "none" else "sum"), world, costs,
                        tt_rank_list=[int(form.tt_rank)], forms=("tt",), keep_larger=True)
    elif form.kind == "host":
        cs = candidates(s, world, costs, host_depth=max(1, int(form.pipeline_depth or host_depth)), forms=("host",))
    else:
        cs = candidates(s, world, costs, forms=("sharded",))
    for c in cs:
        if c.label == label:
            return c
    raise ConfigError(f"table {s.name!r}: cannot cost form {form.to_dict()}")


def executor_term(labels: Sequence[str], world: int, costs: Costs) -> float:
    """The executor's own seconds per step of tables of candidate ``labels`` (``Costs.executor_overhead``: 0 in a
    world of one or when not measured)."""
    return float(sum(costs.executor_overhead(lb, world) for lb in labels))


def predict_step(cands: Sequence[Candidate], dense: DenseModel, batch_size: int, world: int,
                 costs: Costs) -> dict[str, Any]:
    """The predicted step of tables costed as ``cands`` (one per table): its seconds by part and in total (the
    candidates' seconds hold their executor overhead; it is reported as its own part, ``executor``)."""
    kinds = [c.kind for c in cands]
    executor = executor_term(kinds, world, costs)
    emb = float(sum(c.seconds for c in cands)) - executor
    lat = exchange_latency_of(kinds, world, costs)
    parts = {"embedding": emb, "executor": executor, "exchange_latency": lat,
             **fixed_terms(dense, batch_size, world, len(cands), costs)}
    return {"step_seconds": float(sum(parts.values())), "parts": parts,
            "device_bytes": float(sum(c.device_bytes for c in cands)),
            "host_bytes": float(sum(c.host_bytes for c in cands)),
            "forms": {}}


def predict_forms(stats: Sequence[TableStats], forms: Mapping[str, TableForm], dense: DenseModel, batch_size: int,
                  world: int, costs: Costs, host_depth: int = 1) -> dict[str, Any]:
    """The predicted step of a plan given by its forms (every table of ``stats``; a table ``forms`` leaves out is
    sharded), with the device and host bytes per rank, by the model the auto search optimises (sharded rows
    spread evenly). ``host_depth``: the run's pipeline depth (host forms of depth 0)."""
    cands = [candidate_of(s, forms.get(s.name, TableForm()), world, costs, host_depth) for s in stats]
    out = predict_step(cands, dense, batch_size, world, costs)
    out["forms"] = {s.name: c.label for s, c in zip(stats, cands)}
    return out


def form_counts(labels: Sequence[str]) -> dict[str, int]:
    """Tables per form kind of candidate ``labels`` (``replicated`` counted as ``sharded``): the regressors of
    :func:`fit_executor_overheads`."""
    out = {"sharded": 0, "tt": 0, "host": 0}
    kinds = [CandidateKind.of(lb) for lb in labels]
    for lb, k in zip(labels, kinds):
        if k is None:
            raise ConfigError(f"candidate label {lb!r} names no form kind ({', '.join(CandidateKind)})")
        out[k.form] += 1
    out.update(step_terms(kinds))  # once per plan, whatever the number of tables
    return out


def fit_executor_overheads(runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The executor's seconds per table and step of each form kind, from real N-rank steps of plans.

    ``runs``: one entry per plan timed, ``{"tables": {kind: count}, "measured_s": s, "predicted_s": s}`` with
    ``predicted_s`` this module's prediction of that plan *without* executor overheads. The residual of a plan
    is ``sum_kind count_kind * overhead_kind`` (the model of :meth:`Costs.executor_overhead`; the kind
    ``host_step`` counts 1 for a plan with any host table: :meth:`Costs.host_step_overhead`, fitted only where
    host plans of two sizes separate it from the per-table part; ``host_tt_step`` 1 for a plan with host and TT
    tables: :meth:`Costs.host_tt_step_overhead`, fitted only where such a plan was timed); non-negative least
    squares over the plans (exact with one plan per kind, as many plans as kinds and residuals that allow it)
    gives the overheads. Non-negative: they are work the executor adds. A negative residual says the
    single-process figures overestimate this machine as it is (a load that fell between the two timings), not
    that a form's executor saves time; a negative overhead would also be a gain the search could take once per
    table of that form (a fit on a shared machine once gave host tables -21 ms each, and the search put 22
    tables on the host for a predicted step below zero). A kind no plan holds is left out (not measured)."""
    runs = list(runs)
    kinds = [k for k in EXECUTOR_TERMS if any(int(r["tables"].get(k, 0)) for r in runs)]
    if not runs or not kinds:
        raise ConfigError("fit_executor_overheads: no timed plan with tables")
    a = np.array([[float(r["tables"].get(k, 0)) for k in kinds] for r in runs])
    y = np.array([float(r["measured_s"]) - float(r["predicted_s"]) for r in runs])
    for per_step in reversed(STEP_TERMS):
        if per_step in kinds and np.linalg.matrix_rank(a) < len(kinds):
            # not separable from the per-table parts (one host plan, or host plans of one size; host beside TT
            # with no plan of each alone): left to them, as before such plans were timed
            i = kinds.index(per_step)
            kinds, a = kinds[:i] + kinds[i + 1:], np.delete(a, i, axis=1)
    if np.linalg.matrix_rank(a) < len(kinds):
        raise ConfigError(f"fit_executor_overheads: the plans' form counts {a.tolist()} do not separate the kinds {kinds}")
    from scipy.optimize import nnls  # scipy on first use: a training rank never fits costs

    x, _ = nnls(a, y)
    return {k: float(v) for k, v in zip(kinds, x)}


def fit_executor(runs: Sequence[Mapping[str, Any]]) -> tuple[float, dict[str, float]]:
    """The scale of the single-process prediction and the executor's overheads per table of each form kind, from
    real N-rank steps of plans (``runs`` as :func:`fit_executor_overheads` reads them).

    Measured on a shared machine, the single-process figures and the ranks' steps see different shares of the
    cores: N rank processes get N shares where one calibration process got one, and the load moves between the
    two timings (at load 11 the single-process figures predicted 0.53-0.57x of every plan's measured 2-rank step,
    all three forms alike). So first the scale ``s`` of the whole prediction, least squares through the origin
    over the plans (``s = sum m p / sum p^2``), then the per-form overheads (:func:`fit_executor_overheads`, non
    negative) of the residuals ``m - s p``: what a form costs beyond the common scale. The scale is applied to
    the time figures themselves (:meth:`Costs.scaled`: every term of the model is linear in them), so the search,
    which a common scale does not change, and the prediction read one set of figures."""
    runs = list(runs)
    p = np.array([float(r["predicted_s"]) for r in runs])
    m = np.array([float(r["measured_s"]) for r in runs])
    if not runs or not np.all(p > 0) or not np.all(m > 0):
        raise ConfigError(f"fit_executor: positive predicted and measured steps needed, got {p.tolist()} / {m.tolist()}")
    scale = float(m @ p / (p @ p))
    return scale, fit_executor_overheads([{**r, "predicted_s": scale * float(r["predicted_s"]),
                                           "measured_s": _beyond_spread(r, scale)} for r in runs])


def held_out_errors(runs: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """The prediction error out of sample of every timed plan: :func:`fit_executor` on the other plans, then this
    plan's step predicted (the scaled prediction plus its tables' fitted overheads, per form kind and per step)
    against its measured step, ``predicted / measured - 1``. ``None`` where the other plans do not separate the
    kinds the fit needs (a kind only this plan holds is then predicted at no overhead: not left out silently, the
    error says so)."""
    runs = list(runs)
    out: list[float | None] = []
    for k, r in enumerate(runs):
        try:
            scale, over = fit_executor(runs[:k] + runs[k + 1:])
        except ConfigError:
            out.append(None)
            continue
        pred = scale * float(r["predicted_s"]) + sum(float(n) * over.get(kind, 0.0)
                                                      for kind, n in r["tables"].items())
        out.append(pred / float(r["measured_s"]) - 1.0)
    return out


def _beyond_spread(run: Mapping[str, Any], scale: float) -> float:
    """A plan's measured step for the overhead fit: the scaled prediction where the residual lies within the
    plan's own spread (half the range of its rounds' steps, ``steps_s``), else the measurement moved toward the
    prediction by that spread. A residual the plan's repeats do not resolve is noise, not a form's overhead:
    a fit on three plans with three kinds is otherwise exact on noise, and on a quiet machine it once charged
    sharded tables 0.39 ms each and host tables nothing, so the search moved eight tables of 3 to 27 rows to
    the host (benchmark history, run H). Without ``steps_s`` (or one round) the measurement is used as it is."""
    m, pred = float(run["measured_s"]), scale * float(run["predicted_s"])
    rounds = [float(x) for x in run.get("steps_s") or []]
    half = (max(rounds) - min(rounds)) / 2 if len(rounds) > 1 else 0.0
    r = m - pred
    return pred if abs(r) <= half else m - math.copysign(half, r)
