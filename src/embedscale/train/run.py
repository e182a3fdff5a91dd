"""The run protocol every training run implements, its position state, and the model-state helpers of the
one checkpoint format (``train.checkpoint``).

A *run* is what one rank holds to train: a single-process ``Trainer`` (a world of one, pipelined host
tables included), a ``DistributedRun`` (sharded rows under any plan, TT/host mixtures) or a ``DMTRun``
(tower transform). :func:`embedscale.train.loop.fit` drives any of them; it only calls what
:class:`Run` declares, never probes for attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from embedscale.device import HOST
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import FormatError
from embedscale.storage import remove_tree
from embedscale.train.checkpoint import agree, assemble_table, begin, publish, step_dir, temp_dir, write_manifest
from embedscale.train.nodes import writes_node_dir

EMBEDDING_PREFIX = "sparse_arch.embedding."  # model state under it: the tables (saved by row, not by module)


@dataclass
class RunState:
    """Where a run is: steps done, the epoch and the batches done in it (the loader skips them on resume),
    samples seen and every step's loss; and the early-stopping state (``train.loop``): the best evaluation
    so far (``best_step``, ``best_value`` of the monitored metric, ``best`` = that evaluation's figures),
    the evaluations since it without improvement (``bad_evals``), whether the run has ``stopped`` early, and
    the latest evaluation (``eval_step``, its figures ``eval``: a run resumed at that step is not scored again);
    a stream source's position (``stream``: the shard and row its next batch starts at, ``data.stream``).
    All of it goes into every checkpoint's manifest, so a resumed run stops where the uninterrupted one would."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples: int = 0
    losses: list[float] = field(default_factory=list)
    best_step: int = -1
    best_value: float | None = None
    best: dict = field(default_factory=dict)
    bad_evals: int = 0
    stopped: bool = False
    eval_step: int = -1
    eval: dict = field(default_factory=dict)
    stream: dict = field(default_factory=dict)  # a stream source's position: {"shard", "row"} of the next batch

    def position(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "samples": self.samples, "early_stopping": {
                    "best_step": self.best_step, "best_value": self.best_value, "best": dict(self.best),
                    "bad_evals": self.bad_evals, "stopped": self.stopped, "eval_step": self.eval_step,
                    "eval": dict(self.eval)},
                **({"stream": dict(self.stream)} if self.stream else {})}

    def restore(self, manifest: dict, losses: Iterable[float]) -> None:
        self.step, self.epoch = int(manifest["step"]), int(manifest["epoch"])
        self.batch_in_epoch, self.samples = int(manifest["batch_in_epoch"]), int(manifest["samples"])
        self.losses = [float(x) for x in losses]
        es = manifest.get("early_stopping") or {}  # checkpoints written before early stopping: a fresh state
        self.best_step = int(es.get("best_step", -1))
        self.best_value = None if es.get("best_value") is None else float(es["best_value"])
        self.best = dict(es.get("best") or {})
        self.bad_evals = int(es.get("bad_evals", 0))
        self.stopped = bool(es.get("stopped", False))
        self.eval_step = int(es.get("eval_step", -1))
        self.eval = dict(es.get("eval") or {})
        self.stream = dict(manifest.get("stream") or {})


@runtime_checkable
class Run(Protocol):
    """What :func:`~embedscale.train.loop.fit` needs of a run (one rank's part of it).

    Attributes: ``state`` (:class:`RunState`), ``run_dir``, ``rank``, ``world``, ``train_loader`` (batches
    with ``batch_size``/``global_size``, ``set_epoch(epoch, skip_batches)``), ``eval_loader`` (or ``None``),
    ``opt`` (the dense optimizer, for the learning-rate warmup), ``progress`` (this rank draws bars);
    optionally ``step_logits``: this rank's logits of the last ``train_step``'s forward, taken before its update
    (the loop's progressive validation scores them; a run without them has none); optionally
    ``prefetch_batch(batch)``: called with the next step's batch before each step (a stream's too) when the
    run's ``input_pipeline`` is true (it converts its input ahead, e.g. the sharded rows' ids, OPER 5.1
    pipelined).
    """

    state: RunState
    run_dir: Path
    rank: int
    world: int
    progress: bool

    def train_step(self, batch) -> float:
        """One step on this rank's part of the global batch; returns the global batch's mean loss."""

    def evaluate(self) -> dict:
        """Exact figures over the whole eval split, the same on every rank (collective on N ranks):
        ``data.metrics.binary_metrics`` (``logloss``, ``auc``, ``ne``, ``calibration``, ``samples``,
        ``positive_rate``)."""

    def save(self, ckpt_dir: Path, delta: bool = False, track: bool = False) -> dict:
        """Write this rank's file into ``ckpt_dir``; return the manifest fields of this run (kind, tables...).
        ``delta``: of the row-stored tables only the rows updated since the last ``track`` save (a delta
        checkpoint, ``train.checkpoint``); ``track``: a full checkpoint after which the updated rows are
        recorded (from here)."""

    def restore(self, ckpt_dir: Path) -> None:
        """Load this rank's part of any checkpoint (any world size or plan) and the run position."""

    def figures(self) -> dict:
        """What the summary adds for this run (collective on N ranks: every rank calls it)."""

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""

    def step_error(self, err: RuntimeError) -> Exception:
        """The error to raise for a failed step (N ranks: name the ranks that stopped answering)."""


def save_checkpoint(run: Run, base: dict | None = None, track: bool = False,
                    before_publish: Callable[[], None] | None = None, home=None) -> Path:
    """``checkpoints/step-N/``: every rank writes its file, then rank 0 the manifest (the checkpoint is complete
    only once every rank file is), all in a temporary directory renamed into place at the end; a failed part is
    one error for every rank and leaves nothing (``checkpoint.agree``). ``base`` (``checkpoint.base_ref``): a
    delta checkpoint against that full one; ``track``: a full one that deltas will follow (``Run.save``);
    ``before_publish``: what rank 0 writes beside it (``metrics.csv``), a failure of it failing the checkpoint;
    ``home``: where ``checkpoints/`` goes (``checkpoint.checkpoint_home``; the run directory by default)."""
    d = step_dir(run.run_dir if home is None else home, run.state.step)
    tmp = temp_dir(d)
    fields: dict = {}

    def part(stage) -> None:  # this rank's part of a stage, then every rank learns whether all parts succeeded
        try:
            stage()
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised (checkpoint.agree)
            agree(run.rank, run.world, d, e)
            raise
        except BaseException:  # a stop signal (every rank gets one): leave nothing half-written
            if run.rank == 0:
                remove_tree(tmp)
            raise
        agree(run.rank, run.world, d, None)

    def prepare() -> None:
        if run.rank == 0 or writes_node_dir(run.rank):  # a node without rank 0's directory: its own (train.nodes)
            begin(d)

    def write() -> None:
        fields.update(run.save(tmp, delta=base is not None, track=track) if base is not None or track
                      else run.save(tmp))

    def complete() -> None:
        if run.rank == 0:
            if before_publish is not None:
                before_publish()
            write_manifest(tmp, run.world, {**fields, **run.state.position()}, delta=base)
            publish(tmp, d)
        elif writes_node_dir(run.rank):  # this node's rank files, beside no manifest
            publish(tmp, d)

    for stage in (prepare, write, complete):
        part(stage)
    return d


# -- model state helpers (single process and N ranks) ------------------------------------------------
def local_tables(model: nn.Module, names: Iterable[str]) -> dict[str, LocalEmbeddingBags]:
    """The ``LocalEmbeddingBags`` that holds each of ``names`` in ``model`` (a single-process model: plain,
    mixed with TT tables, behind a host parameter server, or in towers)."""
    want = set(names)
    out: dict[str, LocalEmbeddingBags] = {}
    for m in model.modules():
        if isinstance(m, LocalEmbeddingBags):
            for spec in m.tables:
                if spec.name in want and spec.name not in out:
                    out[spec.name] = m
    return out


def table_entry(weight: torch.Tensor, momentum: torch.Tensor | None, rows: np.ndarray | torch.Tensor) -> dict:
    e = {"rows": torch.as_tensor(rows, dtype=torch.int64).to(HOST), "weight": weight.detach().to(HOST).clone()}
    if momentum is not None:
        e["momentum"] = momentum.detach().to(HOST).clone()
    return e


def whole_table_entries(mods: dict[str, LocalEmbeddingBags]) -> dict:
    """Every row of every table in ``mods`` (a world of one holds them all)."""
    out = {}
    for name, m in mods.items():
        w = m.table_weight(name)
        out[name] = table_entry(w, m.table_momentum(name) if m.momentum is not None else None,
                                np.arange(w.shape[0]))
    return out


def load_whole_tables(mods: dict[str, LocalEmbeddingBags], shards: list[dict], where) -> None:
    """Fill every table of ``mods`` from the rank files of a checkpoint of any world size."""
    with torch.no_grad():
        for name, m in mods.items():
            dst = m.table_weight(name)
            w, mom = assemble_table(shards, name, dst.shape[0], where)
            if w.shape[1] != dst.shape[1]:
                raise FormatError(f"{where}: table {name!r} has dim {w.shape[1]}, this model's {dst.shape[1]}")
            dst.copy_(w)
            if m.momentum is not None:
                if mom is None:
                    raise FormatError(f"{where}: table {name!r} has no row-wise Adagrad state")
                m.table_momentum(name).copy_(mom)


def dense_state(model: nn.Module, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """Model state outside the embedding tables (CPU copies), names ``keep`` accepts."""
    return {k: v.detach().to(HOST).clone() for k, v in model.state_dict().items()
            if not k.startswith(EMBEDDING_PREFIX) and keep(k)}


def load_dense_state(model: nn.Module, dense: dict, where) -> None:
    """Load the model state outside the tables; a name the checkpoint lacks or a shape that differs is a
    ``FormatError`` naming it."""
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(EMBEDDING_PREFIX)}
    # a checkpoint written before the logit calibration: its model predicts uncalibrated (the map's identity)
    own = {k: v for k, v in own.items() if k in dense or not k.endswith(("calibration.scale_shift", "calibration.tail"))}
    missing = sorted(set(own) - set(dense))
    if missing and all(k.startswith("first_order.") for k in missing):
        raise FormatError(f"{where}: no saved values for {missing} (a model without the first-order term: load it "
                          "with model.first_order false)")
    if missing:
        raise FormatError(f"{where}: no saved values for {missing[:5]} (another model shape or towers?)")
    for k, v in own.items():
        if tuple(dense[k].shape) != tuple(v.shape):
            raise FormatError(f"{where}: {k} has shape {tuple(dense[k].shape)}, this model's {tuple(v.shape)}")
    model.load_state_dict({k: dense[k] for k in own}, strict=False)


def param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters, in its order."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in opt.param_groups for p in g["params"]]


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to(HOST).clone()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def optimizer_state(opt: torch.optim.Optimizer, names: list[str], keep=lambda name: True) -> dict:
    """``{parameter name: state}`` of the parameters ``keep`` accepts (positions become names)."""
    return {names[i]: _cpu(st) for i, st in opt.state_dict()["state"].items() if keep(names[i])}


def optimizer_groups(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]


def load_optimizer_state(opt: torch.optim.Optimizer, names: list[str], by_name: dict, groups: list[dict],
                         where) -> None:
    sd = opt.state_dict()
    if len(groups) != len(sd["param_groups"]):
        raise FormatError(f"{where}: {len(groups)} optimizer parameter groups, this run has {len(sd['param_groups'])}")
    sd["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    sd["param_groups"] = [{**saved, "params": cur["params"]} for saved, cur in zip(groups, sd["param_groups"])]
    opt.load_state_dict(sd)


__all__ = ["EMBEDDING_PREFIX", "Run", "RunState", "dense_state", "load_dense_state", "load_optimizer_state",
           "load_whole_tables", "local_tables", "optimizer_groups", "optimizer_state", "param_names",
           "save_checkpoint", "table_entry", "whole_table_entries"]
