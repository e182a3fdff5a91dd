"""Single-process training: a :class:`~embedscale.train.run.Run` of a world of one.

The model is any ``nn.Module`` called as ``model(dense, sparse) -> logits [B]`` whose embedding module
updates itself during ``backward`` (fused sparse optimizer, FBGEMM style) and whose other parameters are
stepped by ``dense_optimizer``. The loop is :func:`embedscale.train.loop.fit`; checkpoints are the one
format (``train.checkpoint``): this process writes ``rank-00000.pt`` with every table's rows by row id,
so its checkpoints restore on any number of ranks and it restores checkpoints written by any number.
Resume is exact: the loader skips the batches already consumed in the checkpoint's epoch, and model,
optimizer and RNG states are restored, so the losses after a resume are bit-for-bit those of an
uninterrupted run.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from embedscale.device import HOST
from embedscale.data.loader import ShardLoader
from embedscale.embedding.mixed import MixedEmbedding
from embedscale.errors import ConfigError, FormatError
from embedscale.pipeline.embedding import PipelinedEmbedding
from embedscale.pipeline.loop import PipelinedLoader
from embedscale.embedding.managed_lookup import managed_of
from embedscale.reorder import Reordering, TableReordering
from embedscale.storage import location
from embedscale.train.checkpoint import (checkpoint_home, delta_entry, latest_checkpoint, load_managed, merged, rank0,
                                        read_manifest, read_shards, resolve_checkpoint)
from embedscale.train.loop import LoopConfig, fit, warm_up_lr
from embedscale.train.loss import batch_loss_sum
from embedscale.train.metrics import MetricRow, MetricsLog, binary_metrics
from embedscale.train.persist import CheckpointParts, load_reorder, load_tt_state, restore_parts, write_rank
from embedscale.train.run import (RunState, load_dense_state, load_whole_tables, local_tables, param_names,
                                  whole_table_entries)

__all__ = ["Trainer", "evaluate", "warm_up_lr", "MetricRow", "load_tt_state", "load_model_state"]


@torch.no_grad()
def evaluate(model: nn.Module, loader: ShardLoader, progress: bool = False) -> dict:
    """Exact figures of ``model`` over every row of ``loader`` (``data.metrics.binary_metrics``: logloss, AUC,
    normalised entropy, calibration, samples, positive rate)."""
    was_training = model.training
    model.eval()
    logits, labels, weights = [], [], []
    for batch in tqdm(loader, desc="eval", disable=not progress, leave=False, file=sys.stderr):
        logits.append(model(batch.dense, batch.sparse).float().to(HOST).numpy())
        labels.append(batch.labels.to(HOST).numpy())
        if batch.weights is not None:  # a weighted dataset: every figure weighted (data.metrics)
            weights.append(batch.weights.to(HOST).numpy())
    model.train(was_training)
    z = np.concatenate(logits)
    y = np.concatenate(labels)
    return binary_metrics(y, z, np.concatenate(weights) if weights else None)


def _parts(model: nn.Module):
    """The model's row-stored tables (``{name: LocalEmbeddingBags}``), its host parameter-server embedding and its
    TT tables (``ModuleDict`` or ``None``)."""
    tables = local_tables(model, [s.name for m in model.modules() if hasattr(m, "tables") and
                                  isinstance(getattr(m, "tables"), list) for s in m.tables])
    host = next((m for m in model.modules() if isinstance(m, PipelinedEmbedding) and m.server is not None), None)
    tt = next((m.tt for m in model.modules() if isinstance(m, MixedEmbedding) and len(m.tt)), None)
    return tables, host, tt


def mixed_of(model: nn.Module) -> MixedEmbedding | None:
    """The model's ``MixedEmbedding`` (TT tables, reordering) or ``None``."""
    return next((m for m in model.modules() if isinstance(m, MixedEmbedding)), None)


def checkpoint_reordering(checkpoint: str | Path, tables) -> Reordering | None:
    """The index reordering a checkpoint's TT cores were trained under (EL-Rec IV; rank 0's ``"reorder"``) as a
    ``Reordering`` of ``tables``' features, to build the model it loads into (row-group tables need it);
    ``None`` without one."""
    ckpt = resolve_checkpoint(checkpoint)
    maps = rank0(read_shards(ckpt, read_manifest(ckpt))).get("reorder") or {}
    by = {t.name: t for t in tables}
    unknown = sorted(set(maps) - set(by))
    if unknown:
        raise FormatError(f"{ckpt}: index reordering of tables {unknown}, which this model does not have")
    if not maps:
        return None
    return Reordering([TableReordering(n, np.asarray(m), list(by[n].features)) for n, m in maps.items()],
                      meta={"source": str(ckpt)})


def load_model_state(model: nn.Module, checkpoint: str | Path) -> dict:
    """Load a checkpoint of any world size into a single-process ``model`` (its tables, host tables, TT cores and
    dense state; no optimizer); returns the manifest. For serving and tests."""
    ckpt = resolve_checkpoint(checkpoint)
    m = read_manifest(ckpt)
    shards = read_shards(ckpt, m)
    tables, host, tt = _parts(model)
    load_whole_tables(tables, shards, ckpt)
    if host is not None:
        host.load_host_state(rank0(shards).get("host") or {})
    if tt is not None:
        load_tt_state(tt, rank0(shards).get("tt"), ckpt, with_optimizer=False)
    load_reorder(mixed_of(model), rank0(shards), ckpt)
    if managed_of(model) is not None:
        load_managed(managed_of(model), shards, ckpt)
    load_dense_state(model, merged(shards, "dense"), ckpt)
    return m


class Trainer:
    """Train ``model`` on ``train_loader``; evaluate on ``eval_loader``; checkpoint into ``run_dir``.

    Args:
        model: ``model(dense, sparse) -> logits``.
        dense_optimizer: optimizer over the non-embedding parameters.
        train_loader, eval_loader: ``ShardLoader``s (eval may be ``None``).
        run_dir: where ``metrics.csv``, ``curves.png``, ``summary.json`` and ``checkpoints/`` go.
        epochs, max_steps, eval_every, log_every, checkpoint_every, lr_warmup_steps: :class:`LoopConfig`.
        config_yaml: the resolved run config, stored in every checkpoint's manifest.
        checkpoint_fields: more manifest fields (``kind: dmt`` and the towers of a DMT model).
        loop: the whole :class:`LoopConfig` (early stopping, warmup fraction, best checkpoint); given, it
            replaces the loop arguments above.
    """

    rank, world = 0, 1

    def __init__(self, model: nn.Module, dense_optimizer: torch.optim.Optimizer, train_loader: ShardLoader,
                 eval_loader: ShardLoader | None, run_dir: str | Path, *, epochs: int = 1, max_steps: int = 0,
                 eval_every: int = 0, log_every: int = 10, checkpoint_every: int = 0, config_yaml: str = "",
                 progress: bool = True, lr_warmup_steps: int = 0, checkpoint_fields: dict | None = None,
                 loop: LoopConfig | None = None):
        self.model = model
        self.opt = dense_optimizer
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.run_dir = Path(run_dir)
        self.loop = loop or LoopConfig(epochs=epochs, max_steps=max_steps, eval_every=eval_every, log_every=log_every,
                                       checkpoint_every=checkpoint_every, lr_warmup_steps=int(lr_warmup_steps))
        self.config_yaml = config_yaml
        self.progress = progress
        self.fields = {"kind": "plan", **(checkpoint_fields or {})}
        self.state = RunState()
        self.rows: list[MetricRow] = []
        self._tables, self._host, self._tt = _parts(model)
        self._mixed = mixed_of(model)
        self._managed = managed_of(model)  # managed tables' id mappings (embedding.managed_lookup), or None
        self._names = param_names(model, dense_optimizer)

    # the position, as attributes (tests and callers read them)
    step = property(lambda self: self.state.step)
    epoch = property(lambda self: self.state.epoch)
    samples = property(lambda self: self.state.samples)
    losses = property(lambda self: self.state.losses)

    # -- Run protocol ---------------------------------------------------------------------------
    def train_step(self, batch) -> float:
        self.model.train()
        logits = self.model(batch.dense, batch.sparse)
        self.step_logits = logits.detach()  # scored before the update (progressive validation)
        loss = batch_loss_sum(logits, batch) / batch.batch_size  # sample weights of a weighted dataset (train.loss)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # the embedding module applies its fused sparse update here
        self.opt.step()
        return float(loss.detach())

    def evaluate(self) -> dict:
        return evaluate(self.model, self.eval_loader, progress=self.progress)

    def figures(self) -> dict:
        return {"managed": self._managed.counters()} if self._managed is not None else {}

    def barrier(self) -> None:
        pass

    def step_error(self, err: RuntimeError) -> Exception:
        return err

    def save(self, ckpt_dir: Path, delta: bool = False, track: bool = False) -> dict:
        """A world of one: every row of every table (``delta``: the rows updated since the last ``track`` save),
        the dense state and optimizer, host tables, TT cores (``Run.save``)."""
        tables = self._touched_entries() if delta else whole_table_entries(self._tables)
        write_rank(self._saved_parts(), ckpt_dir, 0, 1, tables, delta=delta, track=track)
        if track:
            for m in {id(m): m for m in self._tables.values()}.values():
                if m.optimizer is None:
                    raise ConfigError("train.checkpoint_full_every: delta checkpoints need the fused sparse "
                                      "optimizer (train.sparse_optimizer) on the embedding tables")
                m.track_touched()
        opt = next(iter(self._tables.values())).optimizer if self._tables else None
        return {**self.fields, "tables": list(self._tables), "table_rows": [m.table_weight(n).shape[0]
                                                                          for n, m in self._tables.items()],
                "optimizer": opt, "dense_optimizer": type(self.opt).__name__.lower(),
                "tt_tables": list(self._tt.keys()) if self._tt is not None else [],
                "host_tables": [s.name for s in self._host.server.tables] if self._host is not None else [],
                "config_yaml": self.config_yaml}

    def _touched_entries(self) -> dict:
        """Every table's rows updated since the last ``track`` save, with their optimizer state."""
        out = {}
        for name, m in self._tables.items():
            rows = m.table_touched(name).nonzero().squeeze(1)
            w = m.table_weight(name)
            out[name] = delta_entry(rows, w.index_select(0, rows),
                                    m.table_momentum(name).index_select(0, rows) if m.momentum is not None else None,
                                    w.shape[0])
        return out

    def restore(self, ckpt_dir: Path) -> None:
        """Restore a checkpoint of any world size (rows by table and row id), a delta included (its base
        under it), and the run position."""
        ckpt_dir = location(ckpt_dir)  # a local path or a remote one (embedscale.storage)
        m = read_manifest(ckpt_dir)
        if m.get("kind", "plan") != self.fields["kind"]:
            raise FormatError(f"{ckpt_dir}: written by a {m.get('kind')!r} model, this run trains a "
                              f"{self.fields['kind']!r} model (model.arch dmt-* is 'dmt')")
        # one process holds every row, so its share is every rank file: each read whole, each byte once (a delta's
        # with its base's; reading only the base rows the delta does not replace costs more requests than it saves)
        shards = read_shards(ckpt_dir, m)
        load_whole_tables(self._tables, shards, ckpt_dir)
        restore_parts(self._saved_parts(), ckpt_dir, m, shards)

    def _saved_parts(self) -> CheckpointParts:
        """What a checkpoint holds beside the rows (``train.persist``)."""
        return CheckpointParts(self.model, self.opt, self._names, self.state, host=self._host,
                        host_tables=[s.name for s in self._host.server.tables] if self._host is not None else [],
                        tt=self._tt, mixed=self._mixed, managed=self._managed)

    # -- entry points ---------------------------------------------------------------------------
    def resume(self, path: str | Path | None = None) -> bool:
        """Restore from ``path`` or the latest checkpoint in the run dir; False if there is none."""
        path = path if path else latest_checkpoint(checkpoint_home(self.run_dir, self.loop.checkpoint_dir))
        if path is None:
            return False
        self.restore(path)
        return True

    def fit(self, *, title: str = "", ceiling_auc: float = math.nan, extra: dict | None = None) -> dict:
        """Train to the end (``epochs`` or ``max_steps``) with :func:`~embedscale.train.loop.fit`; the summary."""
        summary = fit(self, self.loop, title=title, ceiling_auc=ceiling_auc, extra=extra)
        self.rows = MetricsLog(self.run_dir).read()
        return summary


def pipelined_trainer(model: nn.Module, dense_optimizer: torch.optim.Optimizer, train_loader, eval_loader,
                      run_dir: str | Path, *, pipeline_depth: int = 2, use_cache: bool = True, **kwargs):
    """The single-process run (:class:`Trainer`, a ``train.run.Run``), pipelined
    (EL-Rec section V).

    Same arguments as ``Trainer`` plus ``pipeline_depth`` and ``use_cache``; ``model.sparse_arch.embedding``
    must be a :class:`~embedscale.pipeline.PipelinedEmbedding`. Returns a ``Trainer`` whose training loader is a
    :class:`~embedscale.pipeline.PipelinedLoader`; the one loop (``train.loop.fit``) drives it: metrics, evaluation, checkpoints and
    exact resume are every run's, and a checkpoint holds the host tables (rank file ``host``:
    ``<table>.weight``) as sequential training would have them at that step.
    """
    emb = getattr(getattr(model, "sparse_arch", None), "embedding", None)
    if not isinstance(emb, PipelinedEmbedding):
        raise ConfigError("pipelined_trainer: model.sparse_arch.embedding must be a PipelinedEmbedding, got "
                          f"{type(emb).__name__}")
    loader = PipelinedLoader(train_loader, emb, pipeline_depth, use_cache=use_cache)
    return Trainer(model, dense_optimizer, loader, eval_loader, run_dir, **kwargs)
