"""Distributed training of the DMT models (``model.arch: dmt-dlrm | dmt-dcn``) on several ranks.

The counterpart of :class:`~embedscale.train.distributed.DistributedRun` for Disaggregated Multi-Tower
models (Luo et al., MLSys 2024). Where the flat run places rows by an OPER plan and keeps the dense part
data-parallel under DDP, a DMT rank:

- joins the process groups of the tower transform (:class:`~embedscale.comm.hierarchical.TowerComm`:
  one group per tower group of ``model.hosts_per_tower`` hosts, one per peer set; DMT 3.1.1), with
  ``dist.topology_hosts`` hosts of ``nproc / topology_hosts`` ranks each;
- holds its tower group's tables (table-wise or row-wise inside the group, ``model.tower_sharding``)
  and its towers' modules; the embeddings go through steps a-f of the tower transform (DMT 3.1,
  Figure 7) and are compressed by the tower modules before they cross hosts (DMT 3.2, section 4);
- synchronises dense gradients itself (no DDP): tower-module gradients are summed inside the tower
  group only, every other dense gradient over the world (DMT 3.2 "System Perspective",
  :func:`~embedscale.models.dmt.sync_dense_gradients`). The loss is the rank's BCE sum over the global
  batch size, so the summed gradients are the global-batch mean gradient: the run trains the same
  model as single-process training of the same config on the same global batches.

The feature-to-tower assignment is resolved once by rank 0 (``model.tower_assignment``: ``naive`` or a
file of ``embedscale towers``) and written to ``<run dir>/towers.json``; every rank reads that file, and
a resumed run must use the same towers.

Checkpoints are the one format (``train.checkpoint``, ``kind: dmt``): every rank writes the rows it holds
(by table and row id, with row-wise Adagrad state), the first member of every tower group its towers'
modules, rank 0 the other dense parameters; optimizer state is keyed by parameter name. Restoring reads
every rank file and takes what the *current* layout puts on this rank, so a checkpoint resumes exactly on
the same layout and also onto another world size, host count or in-tower sharding with the same towers,
a single-process DMT run (a world of one) included; different towers (or tower module shapes) are a
clear error.

Serving (:func:`infer_dmt`, ``embedscale infer``): a :class:`DMTRun` built for inference restores a DMT
checkpoint (any layout) under the checkpoint's own towers and scores the eval split through the tower
transform.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from embedscale.errors import ConfigError, FormatError
from embedscale.specs import RunConfig, dump_config
from embedscale.train.checkpoint import (assemble_table, delta_entry, read_manifest, read_rows, read_shards,
                                        resolve_checkpoint)
from embedscale.train.distributed import diagnose, evaluate_ranks, rank_device, rank_figures, stream_follow
from embedscale.train.loss import batch_loss_sum
from embedscale.train.dmt_towers import TOWERS_FILE, dmt_layout, prepare_towers, resolve_run_towers  # noqa: F401
from embedscale.train.persist import CheckpointParts, restore_parts, write_rank
from embedscale.train.run import RunState, param_names, table_entry
from embedscale import assemble
from embedscale.io import new_run_dir
from embedscale.models.dlrm import set_dropout_rows
from embedscale.models.dmt import TOWER_FIELDS, sync_dense_gradients
from embedscale.plan.towers import TowerAssignment
from embedscale.train.distributed import join, serve_eval_split

CHECKPOINT_KIND = "dmt"
# kinds of HostAwareTransport bytes that are dense-gradient synchronisation, not embedding traffic
_SYNC_KINDS = ("dense_grads", "tower_grads")


def dmt_model_fields(cfg: RunConfig) -> dict:
    """The model settings a DMT checkpoint must be restored under (its shape; not where it runs)."""
    m = cfg.model
    keep = ("arch", "embedding_dim", "bottom_mlp", "top_mlp", "cross_layers", "cross_low_rank") + tuple(
        k for k in TOWER_FIELDS if k not in ("tower_assignment", "hosts_per_tower", "tower_sharding",
                                             "tower_permute", "towers"))
    return {k: getattr(m, k) for k in keep}


def dmt_checkpoint_fields(cfg: RunConfig, assignment, world: int) -> dict:
    """Manifest fields of a DMT checkpoint (``kind: dmt``): towers and model shape it must be restored under."""
    return {"kind": CHECKPOINT_KIND, "towers": assignment.towers, "model": dmt_model_fields(cfg),
            "topology_hosts": cfg.dist.topology_hosts if world > 1 else 1,
            "hosts_per_tower": cfg.model.hosts_per_tower if world > 1 else 1, "sharding": cfg.model.tower_sharding}


class DMTRun:
    """Everything one rank holds for a distributed DMT run (see the module docstring): the parts
    ``assemble.build_run`` made for its towers (the tower-transformed model, its process groups, the loaders).

    The training loop is the one of every run (``train.loop.fit``); evaluation, the common summary figures and a
    failed step's diagnosis are those of every N-rank run (``train.distributed``: :func:`evaluate_ranks`,
    :func:`rank_figures`); this class owns the tower transform's step, checkpoints and figures.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, rank: int, world: int, progress: bool = True,
                 inference: bool = False, inputs: assemble.RunInputs | None = None,
                 parts: assemble.RunParts | None = None):
        self.cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world
        self.progress = progress and rank == 0
        self.inference = inference
        self.device = rank_device(cfg)
        self.layout = dmt_layout(cfg, world)
        path = self.run_dir / TOWERS_FILE
        if not path.exists():
            raise ConfigError(f"{path} is missing: rank 0 writes it when it prepares the run (prepare_towers)")
        self.assignment = TowerAssignment.load(path)
        if parts is None:
            parts = assemble.build_run(cfg, inputs or assemble.run_inputs(cfg, progress=False), self.device,
                                       rank=rank, world=world, towers=(self.layout, self.assignment),
                                       inference=inference, follow=stream_follow(self.run_dir, world))
        self.data, self.tables, self.forms = parts.data, parts.tables, parts.forms
        self.model, self.opt = parts.model, parts.opt
        self.train_loader, self.eval_loader = parts.train_loader, parts.eval_loader
        self.monitor_group, self.comm = parts.monitor_group, parts.comm
        self.towers = self.model.sparse_arch  # the TowerEmbedding (embedding.towers, built by build_embedding)
        self.embedding = self.towers.embedding  # this rank's LocalEmbeddingBags (None: it holds no rows)
        self._names = param_names(self.model, self.opt)
        self.state = RunState()
        self.bytes_per_step: list[int] = []
        self.sync_bytes_per_step: list[int] = []
        self.cross_host_bytes_per_step: list[int] = []

    # -- what every N-rank run does alike (train.distributed) -------------------------------------
    def evaluate(self) -> dict:
        return evaluate_ranks(self.model, self.eval_loader)

    def figures(self) -> dict:
        """What the summary adds (collective: every rank calls it): :func:`rank_figures` and the towers'
        (:meth:`executor_figures`)."""
        return {**rank_figures(self, self.tables), **self.executor_figures()}

    def barrier(self) -> None:
        dist.barrier()

    def step_error(self, err: RuntimeError) -> Exception:
        return diagnose(self, err)

    # -- one step -------------------------------------------------------------------------------
    def train_step(self, batch) -> float:
        """Forward through the tower transform, backward (the tables update in place), tower-module
        gradients summed inside the tower group, the rest over the world (DMT 3.2), dense step."""
        self.model.train()
        self.comm.reset_bytes()
        set_dropout_rows(self.model, batch.global_size, (batch.global_size * self.rank) // self.world)
        logits = self.model(batch.dense, batch.sparse)
        self.step_logits = logits.detach()  # scored before the update (progressive validation)
        loss_sum = batch_loss_sum(logits, batch)  # sample weights of a weighted dataset (train.loss)
        self.opt.zero_grad(set_to_none=True)
        (loss_sum / batch.global_size).backward()
        sync_dense_gradients(self.model, self.comm)
        self.opt.step()
        rep = self.comm.bytes_report()
        emb = sum(v for part in ("cross", "intra") for k, v in rep[part].items() if k not in _SYNC_KINDS)
        sync = sum(v for part in ("cross", "intra") for k, v in rep[part].items() if k in _SYNC_KINDS)
        self.bytes_per_step.append(int(emb))
        self.sync_bytes_per_step.append(int(sync))
        self.cross_host_bytes_per_step.append(int(sum(rep["cross"].values())))
        total = loss_sum.detach().reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / batch.global_size

    # -- summary --------------------------------------------------------------------------------
    @property
    def plan_name(self) -> str:
        lay = self.layout
        return (f"dmt: {self.assignment.num_towers} towers on {lay.num_groups} tower group(s) of "
                f"{lay.hosts_per_tower} host(s) x {lay.ranks_per_host} ranks")

    def executor_figures(self) -> dict:
        """Towers, compression ratio (DMT 4: input over output values of all towers) and the cross-host
        bytes per step summed over ranks (collective: every rank calls it)."""
        outs = self.towers.tower_out_features
        cr = sum(self.assignment.sizes) * self.towers.dim / sum(outs)
        cross = torch.tensor([float(np.mean(self.cross_host_bytes_per_step)) if self.cross_host_bytes_per_step
                              else 0.0], dtype=torch.float64)
        dist.all_reduce(cross)
        return {"towers": self.assignment.towers, "num_towers": self.assignment.num_towers,
                "compression_ratio": cr, "cross_host_bytes_per_step": float(cross[0]),
                "topology_hosts": self.layout.num_hosts, "hosts_per_tower": self.layout.hosts_per_tower}

    # -- checkpoints ----------------------------------------------------------------------------
    def _tower_names(self) -> set[str]:
        ids = {id(p) for p in self.model.tower_parameters()}
        return {n for n, p in self.model.named_parameters() if id(p) in ids}

    def save(self, ckpt_dir: Path, delta: bool = False, track: bool = False) -> dict:
        """This rank's row ranges (by table and row id; ``delta``: the rows updated since the last ``track``
        save), its towers' modules (first rank of the tower group), the other dense state (rank 0); optimizer
        state by parameter name. Returns the manifest fields (``Run.save``)."""
        pl = self.towers.placement
        tables = {}
        for spec, (i, lo, hi) in zip(pl.shard_tables(self.rank), pl.rank_tables[self.rank]):
            w = self.embedding.table_weight(spec.name)[: hi - lo]
            mom = self.embedding.table_momentum(spec.name)[: hi - lo] if self.embedding.momentum is not None else None
            if delta:
                r = self.embedding.table_touched(spec.name)[: hi - lo].nonzero().squeeze(1)
                tables[pl.tables[i].name] = delta_entry(r + lo, w.index_select(0, r),  # (delta_entry: to the host)
                                                        mom.index_select(0, r) if mom is not None else None,
                                                        pl.tables[i].num_rows)
            else:
                tables[pl.tables[i].name] = table_entry(w, mom, np.arange(lo, hi))
        write_rank(self.saved_parts(), ckpt_dir, self.rank, self.world, tables, delta=delta, track=track)
        if track and self.embedding is not None:
            self.embedding.track_touched()
        return {**dmt_checkpoint_fields(self.cfg, self.assignment, self.world),
                "topology_hosts": self.layout.num_hosts, "hosts_per_tower": self.layout.hosts_per_tower,
                "tables": [t.name for t in self.tables], "table_rows": [t.num_rows for t in self.tables],
                "optimizer": self.cfg.train.sparse_optimizer, "dense_optimizer": type(self.opt).__name__.lower(),
                "config_yaml": dump_config(self.cfg)}

    def restore(self, ckpt_dir: Path) -> None:
        """Load a DMT checkpoint of any layout (one process included) onto this rank's part of the current
        layout (module docstring)."""
        ckpt_dir = resolve_checkpoint(ckpt_dir)
        m = read_manifest(ckpt_dir)
        if m.get("kind") != CHECKPOINT_KIND:
            raise FormatError(f"{ckpt_dir}: written by a flat model (model.arch dlrm/dcn under a plan); a DMT run "
                              "resumes from DMT checkpoints only")
        if m["tables"] != [t.name for t in self.tables] or m["table_rows"] != [t.num_rows for t in self.tables]:
            raise FormatError(f"{ckpt_dir}: tables {m['tables']} / {m['table_rows']} differ from this model's")
        if m["towers"] != self.assignment.towers:
            raise ConfigError(f"{ckpt_dir}: trained with towers {m['towers']}, this run has {self.assignment.towers}; "
                              "a DMT checkpoint resumes with the same towers only")
        mine = dmt_model_fields(self.cfg)
        diff = [k for k in mine if m["model"].get(k) != mine[k]]
        if diff:
            saved = ", ".join(f"model.{k} {m['model'].get(k)!r}" for k in diff)
            raise ConfigError(f"{ckpt_dir}: trained with {saved}; this run's differ (a DMT checkpoint resumes with "
                              "the same model shape)")
        dense_opt = type(self.opt).__name__.lower()
        if not self.inference and (m.get("optimizer") != self.cfg.train.sparse_optimizer
                                   or m.get("dense_optimizer") != dense_opt):
            raise ConfigError(f"{ckpt_dir}: optimizers {m.get('optimizer')}/{m.get('dense_optimizer')} differ from this "
                              f"run's {self.cfg.train.sparse_optimizer}/{dense_opt}")
        shards = self._restore_tables(ckpt_dir, m)
        restore_parts(self.saved_parts(), ckpt_dir, m, shards, rank=self.rank, world=self.world,
                      inference=self.inference)

    def saved_parts(self) -> CheckpointParts:
        """What a checkpoint holds beside this rank's rows (``train.persist``): the dense state spread over the
        ranks, a tower group's first rank its towers' modules, rank 0 the other dense parameters."""
        tower_names = self._tower_names()
        layout = self.layout

        def spread(rank: int):
            first_of_group = layout.local_index(rank) == 0
            return lambda n: (n in tower_names and first_of_group) or (n not in tower_names and rank == 0)

        return CheckpointParts(self.model, self.opt, self._names, self.state, spread=spread)

    def _restore_tables(self, ckpt_dir: Path, m: dict) -> list[dict]:
        """Every row range this rank holds, reading only those rows (``checkpoint.read_rows``: the rank files' other
        bytes once over the ranks); a checkpoint without a row index: from the rows of all rank files. Returns
        the rank files (without their rows when read by index) for ``restore_parts``."""
        pl = self.towers.placement
        held = list(zip(pl.shard_tables(self.rank), pl.rank_tables[self.rank])) if self.embedding is not None else []
        wanted: dict[str, list] = {}
        for _, (i, lo, hi) in held:
            wanted.setdefault(pl.tables[i].name, []).append(np.arange(lo, hi))
        wanted = {t: np.concatenate(r) for t, r in wanted.items()}
        got = read_rows(ckpt_dir, m, wanted, self.monitor_group if self.world > 1 else None)  # None: every file
        shards = got[0] if got is not None else read_shards(ckpt_dir, m)
        at = dict.fromkeys(wanted, 0)
        with torch.no_grad():
            for spec, (i, lo, hi) in held:
                table = pl.tables[i]
                if got is not None:
                    w, mom = got[1][table.name]
                    k = at[table.name]
                    at[table.name] = k + hi - lo
                    w, mom = w[k:k + hi - lo], (mom[k:k + hi - lo] if mom is not None else None)
                else:
                    w, mom = assemble_table(shards, table.name, table.num_rows, ckpt_dir)
                    w, mom = w[lo:hi], (mom[lo:hi] if mom is not None else None)
                self.embedding.table_weight(spec.name)[: hi - lo].copy_(w)
                if self.embedding.momentum is not None:
                    if mom is None:
                        raise FormatError(f"{ckpt_dir}: table {table.name!r} has no row-wise Adagrad state")
                    self.embedding.table_momentum(spec.name)[: hi - lo].copy_(mom)
        return shards


def checkpoint_towers(checkpoint: Path):
    """The towers a DMT checkpoint (or a run directory's latest) was trained with, from its manifest."""
    ckpt = resolve_checkpoint(checkpoint)
    m = read_manifest(ckpt)
    if m.get("kind") != CHECKPOINT_KIND:
        raise FormatError(f"{ckpt}: written by a flat model (model.arch dlrm/dcn under a plan), not a DMT model")
    return TowerAssignment(m["towers"])


def infer_dmt(cfg: RunConfig, checkpoint: str, run_dir: str | None = None, *, progress: bool = True,
              warmup: int = 2) -> dict | None:
    """Serve a DMT checkpoint (``embedscale infer``): score the eval split with the checkpoint's model on this
    rank's part of the tower transform (DMT 3.1; one rank: all towers in one tower group), as
    ``train.distributed.infer_distributed`` does for flat models; rank 0 writes ``predictions.npy`` and
    ``inference.json`` (logloss, AUC, samples/s) into the run directory and returns the figures.

    The checkpoint is a sharded DMT checkpoint (any layout: the restore re-shards) or a single-process
    checkpoint file. The towers are the checkpoint's (:func:`checkpoint_towers`), not re-derived from the
    config (whose ``model.tower_assignment`` file may be gone). On one rank the topology is one host
    (``dist.topology_hosts`` and ``model.hosts_per_tower`` set to 1: they place rows, not the model); on
    several, ``dist.topology_hosts`` must divide the ranks (``--set dist.topology_hosts=H``).
    """
    cfg.dist.mode = "inference"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if run_dir is None:
        if world > 1:
            raise ConfigError("DMT inference on several ranks needs a run directory shared by the ranks (--run-dir)")
        run_dir = str(new_run_dir(cfg))
    ck = Path(checkpoint)
    towers = checkpoint_towers(ck)
    if towers is not None:  # rank 0 resolves the run's towers (prepare_towers) from this file, then the ranks
        path = Path(run_dir) / "checkpoint_towers.json"  # read <run>/towers.json as in training
        if int(os.environ.get("RANK", "0")) == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            towers.save(path)
        cfg.model.tower_assignment = str(path)
    elif world == 1 and not cfg.model.towers and cfg.model.tower_assignment in ("", "naive"):
        # no towers beside the checkpoint: naive towers of the config, one per tower group of the trained
        # topology (kept before the topology becomes one host below)
        hosts, k = cfg.dist.topology_hosts, cfg.model.hosts_per_tower
        if isinstance(hosts, int) and isinstance(k, int) and k > 0 and hosts % k == 0:
            cfg.model.towers = hosts // k
    if world == 1:
        cfg.dist.topology_hosts = 1
        cfg.model.hosts_per_tower = 1
    j = join(cfg, run_dir, progress)
    rd = j.run_dir
    run = DMTRun(cfg, rd, j.rank, j.world, progress, inference=True, inputs=j.inputs)
    run.restore(ck)
    return serve_eval_split(run, rd, checkpoint, warmup,
                            {"plan": run.plan_name, "design": "tower transform", "towers": run.assignment.towers})


def is_dmt_checkpoint(ckpt_dir: Path) -> bool:
    try:
        return read_manifest(resolve_checkpoint(ckpt_dir)).get("kind") == CHECKPOINT_KIND
    except FormatError:
        return False


__all__ = ["DMTRun", "TOWERS_FILE", "checkpoint_towers", "dmt_checkpoint_fields", "dmt_layout", "dmt_model_fields", "infer_dmt", "is_dmt_checkpoint",
           "prepare_towers", "resolve_run_towers"]
