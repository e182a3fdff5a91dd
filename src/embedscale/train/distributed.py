"""Training and evaluation on several ranks: embeddings placed by a Plan, dense part data-parallel.

One process per rank (``embedscale train --nproc N`` on one machine, or ``torchrun ... -m embedscale
train`` anywhere). Rank 0 prepares what every rank reads (data shards, access profile, plan) before the
ranks join the process group; the others wait for its "ready" marker, so a long data preparation never
runs into a collective timeout. Then every rank builds (``assemble.build_run``, once):

- a ``ShardedEmbedding`` from the plan's address map (OPER 5.1), over a transport on its own process
  group (so embedding traffic never interleaves with the dense AllReduce);
- the dense arches wrapped in ``DistributedDataParallel`` with a *sum* AllReduce hook, and a loss that
  is the sum over the rank's samples divided by the global batch size: the dense gradients are then
  exactly the global-batch mean gradient, and the embedding gradients exactly those of single-process
  training, whatever the split of the batch over ranks (sizes may differ by one).

DMT models (``model.arch: dmt-dlrm | dmt-dcn``) run as a ``DMTRun`` (``embedscale.train.dmt_run``): the
tower transform instead of a plan, tower-group gradient sync instead of DDP, the same loop and summary.

Checkpoints are the one format of ``train.checkpoint``: every rank writes the rows it owns (by table and
row id, with their optimizer state) and rank 0 the dense state; a manifest written last marks the
checkpoint complete. Restoring reads every rank file and keeps the rows the *current* plan puts on this
rank, so a checkpoint restores onto the same plan exactly, or onto another plan or world size, one
process included (re-sharding). The loop is :func:`embedscale.train.loop.fit`.

Resume: the run directory records its plan (``run-plan.json``: ``dist.plan`` and world size). Resumed on the
same world size and plan it continues exactly; on another world size rank 0 re-plans with the run's
strategy and the ranks re-shard from the last checkpoint. A ``dist.plan`` other than the run's is a
``ConfigError`` unless ``dist.replan`` asks to re-plan. The ready/failed markers between rank 0 and the
others carry the attempt (torchrun run id and restart count), so a marker of an earlier attempt is never
read as this one's.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from embedscale import assemble
from embedscale.assemble import planned_tables
from embedscale.device import HOST, process_group_backend, run_device
from embedscale.errors import ConfigError, EmbedscaleError, FormatError
from embedscale.io import atomic_open, atomic_write_json, atomic_write_text, read_json
from embedscale.models.dmt import is_dmt_arch
from embedscale.plan.auto import load_costs, write_explain
from embedscale.plan.auto_settings import AUTO, check_auto_settings
from embedscale.plan.autoplan import make_auto_plan
from embedscale.plan.step import DenseModel
from embedscale.plan.forms import (TableForm, check_plan_sizes, config_forms, forms_for_run, host_pipeline_depth,
                                   replicated_tables_meta, with_reorder)
from embedscale.plan.plan import Plan
from embedscale.reorder import PLAN_REORDER_DIR, plan_reordering, reordering_meta
from embedscale.specs import RunConfig, dump_config
from embedscale.units import parse_bytes
from embedscale.train.checkpoint import (checkpoint_home, delta_entry, latest_checkpoint, read_manifest, read_rows,
                                        read_shards, resolve_checkpoint, table_pieces)
from embedscale.train.run import RunState, param_names, table_entry
from embedscale.train.persist import CheckpointParts, restore_parts, write_rank
from embedscale.train.dmt_towers import prepare_towers
from embedscale.train.lock import hold_run_dir
from embedscale.train.replan import PGAS_REPLAN_SPARE, DriftMonitor, resume_plan
from embedscale.train.plan_trial import choose_by_trial
from embedscale.data.profile import AccessProfile
from embedscale.embedding.compression import table_bytes
from embedscale.embedding.grad_sync import all_gather_var
from embedscale.embedding.input_pipeline import InputPipeline, held_back, not_pipelined
from embedscale.embedding.managed_lookup import install, managed_of
from embedscale.embedding.mixed import MixedEmbedding
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.embedding.wire import expected_wire_bytes
from embedscale.models.dlrm import set_dropout_rows
from embedscale.pipeline import PipelinedLoader
from embedscale.plan.api import make_plan
from embedscale.plan.cost import evaluate
from embedscale.specs import Topology
from embedscale.train.launch import die_with_launcher, init_from_env, rendezvous_store
from embedscale.train import watchdog
from embedscale.train.nodes import Handoff, apply_launch_topology, node_of, set_node_dir_shared
from embedscale.train.loss import batch_loss_sum
from embedscale.train.metrics import binary_metrics

READY, FAILED = ".ready", ".failed"
EXPLAIN_FILES = ("explain.txt", "explain.json", "memory.png")  # an auto plan's report (plan.auto.write_explain)
RUN_PLAN = "run-plan.json"  # the plan a run directory was trained with: dist.plan and world size


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _allreduce_sum_hook(state, bucket):
    """DDP comm hook: sum (not average) gradients over ranks; the loss already divides by the global batch."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


DENSE_BUCKET_MB = 25  # DDP's bucket cap, given explicitly: its first bucket is as large as the others


def dense_ddp(model: nn.Module, embedding: nn.Module, hook=_allreduce_sum_hook, state=None) -> DDP:
    """``model``'s dense arches in ``DistributedDataParallel``, as every run trains them: the embedding's rank-local
    parameters and buffers left out, no buffer broadcast, a *sum* AllReduce ``hook`` (``state`` its state), and
    the gradients living in DDP's buckets (``gradient_as_bucket_view``: no copy into the bucket and back each
    step). Buckets of :data:`DENSE_BUCKET_MB` from the first one on (DDP's default opens with a 1 MB bucket,
    whose AllReduce then runs on the backend's thread beside the rest of the backward: on a CPU rank that
    thread takes the core from the backward's GEMMs and hides nothing), so a DLRM's dense gradients (a few MB)
    go in one AllReduce after the backward. TorchRec's ``DistributedModelParallel`` wraps its dense part so
    too. ``embedding`` is the module at ``model.sparse_arch.embedding``."""
    ignore = [f"sparse_arch.embedding.{n}" for n, _ in embedding.named_parameters()]
    ignore += [f"sparse_arch.embedding.{n}" for n, _ in embedding.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    with warnings.catch_warnings():  # broadcast_buffers=False is what we mean: rank-local storage
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DDP(model, broadcast_buffers=False, gradient_as_bucket_view=True, bucket_cap_mb=DENSE_BUCKET_MB)
    ddp.register_comm_hook(state, hook)
    return ddp


STREAM_FOLLOW = "stream-follow.json"  # rank 0's record of a stream's admitted shards and its end (data.stream)


def shared_run_dir(cfg: RunConfig, run_dir: str | None) -> Path:
    """A run directory every rank agrees on without talking: given, or named after torchrun's run id."""
    if run_dir:
        return Path(run_dir)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("EMBEDSCALE_RUN_ID")
    if not run_id:
        raise ConfigError("several ranks need a shared run directory: pass --run-dir")
    return Path(cfg.out_dir) / f"{cfg.name}-{run_id}"


_JOINS = [0]  # join() calls of this process: every rank makes the same calls in the same order


def attempt_token(world: int) -> str:
    """This attempt of the run: torchrun's run id and restart count and the world size (the same on every rank
    of the attempt, different from any earlier attempt's under torchrun)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("EMBEDSCALE_RUN_ID", "")
    return f"{run_id}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}:{world}"


def prepare_on_rank0(cfg: RunConfig, run_dir: Path, progress: bool, token: str = "") -> assemble.RunInputs:
    """Data, profile and plan (rank 0 only, every attempt); ``config.yaml`` once they are valid, the ready
    marker of this attempt last, or a failure marker. Returns the data and tables (the rank's run receives
    them)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for marker in (READY, FAILED):
            (run_dir / marker).unlink(missing_ok=True)
        inputs = assemble.run_inputs(cfg, progress=progress)
        data, tables = inputs.data, inputs.tables
        if is_dmt_arch(cfg.model.arch):  # DMT: the towers are the plan (tower groups hold their tables)
            if cfg.train.replan_every:
                raise ConfigError(f"train.replan_every {cfg.train.replan_every}: live re-planning moves the rows of "
                                  f"a plan; model.arch {cfg.model.arch!r} places its tables by towers: set "
                                  "train.replan_every 0")
            prepare_towers(cfg, tables, run_dir)
        else:
            ensure_run_plan(cfg, data, tables, run_dir, progress)
        atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
        atomic_write_text(run_dir / READY, f"{token}\nok\n")
    except BaseException as e:
        atomic_write_text(run_dir / FAILED, f"{token}\n{type(e).__name__}: {e}\n")
        raise
    return inputs


def ensure_run_plan(cfg: RunConfig, data, tables, run_dir: Path, progress: bool):
    """The run's plan for ``dist.nproc`` ranks: the run directory's own when the world size and ``dist.plan`` are
    the ones it was made for (the run continues exactly); else made anew with ``dist.plan`` (re-sharding from the
    checkpoints by row id). ``dist.plan`` other than the run's is a ``ConfigError`` naming both, unless
    ``dist.replan`` is set. Records ``dist.plan`` and the world size in ``<run dir>/run-plan.json``."""
    plan_dir, d, world = run_dir / "plan", cfg.dist, cfg.dist.nproc
    check_auto_settings(cfg)
    rec = read_json(run_dir / RUN_PLAN, "run plan record") if (run_dir / RUN_PLAN).exists() else None
    if rec is None and (plan_dir / "plan.json").exists():  # a run directory planned before the record existed
        old = Plan.load(plan_dir)
        rec = {"plan": old.meta.get("strategy", d.plan), "world_size": old.world_size}
    if rec is not None:
        if rec["plan"] != d.plan and not d.replan:
            raise ConfigError(f"{run_dir}: this run was planned with dist.plan {rec['plan']!r} on {rec['world_size']} "
                              f"ranks; this command asks for dist.plan {d.plan!r}. Resume with --dist-plan "
                              f"{rec['plan']}, or re-plan the run with {d.plan!r} by --dist-replan true (its "
                              "checkpoints re-shard by row id)")
        if rec["plan"] == d.plan and rec["world_size"] == world and (plan_dir / "plan.json").exists() \
                and not d.replan:
            return Plan.load(plan_dir)
        _log(0, f"re-planning {run_dir} with {d.plan!r} for {world} ranks (was {rec['plan']!r} on "
                f"{rec['world_size']})")
    kept = None  # a re-plan of a run with checkpoints: they re-shard by row id within a table's form only
    if rec is not None and (plan_dir / "plan.json").exists() and \
            latest_checkpoint(checkpoint_home(run_dir, cfg.train.checkpoint_dir)) is not None:
        kept = Plan.load(plan_dir).forms
    plan = make_run_plan(cfg, data, tables, plan_dir, progress, checkpoint_forms=kept)
    atomic_write_json(run_dir / RUN_PLAN, {"plan": d.plan, "world_size": world,
                                           "strategy": plan.meta.get("strategy", d.plan)})
    return plan


def make_auto_run_plan(cfg: RunConfig, prof, tables, topo: Topology, plan_dir: Path, num_dense: int):
    """``dist.plan auto``: ``plan.autoplan.make_auto_plan`` from the run's access profile for ``dist.nproc``
    ranks under the per-rank budgets ``dist.device_memory`` / ``dist.host_memory`` (``dist.costs``: measured
    per-row costs, else the documented defaults), with the per-rank batch and ``train.pipeline_depth`` as the
    host tables' depth (it sizes their device cache; training then runs the depth the plan recorded), and the
    run's own dense model (``model`` sizes, ``num_dense`` inputs) in the whole step's prediction. Its
    explain data is ``plan.meta["auto"]`` (``make_run_plan`` writes the report beside the plan). A budget
    nothing fits in is a ``plan.auto.BudgetError`` (a ``ConfigError``) saying by how much."""
    d = cfg.dist
    check_auto_settings(cfg)
    plan = make_auto_plan(tables, prof, topo, device_memory=parse_bytes(d.device_memory, "dist.device_memory"),
                          host_memory=parse_bytes(d.host_memory or 0, "dist.host_memory"),
                          costs=load_costs(d.costs or None), batch_size=max(1, cfg.train.batch_size // d.nproc),
                          mode=d.mode, host_depth=max(1, cfg.train.pipeline_depth), requests=cfg.model.tables,
                          dense=DenseModel.from_config(cfg.model, sum(len(t.features or [t.name]) for t in tables),
                                                      num_dense))
    return plan


def check_forms_kept(old: Mapping[str, TableForm], new: Mapping[str, TableForm], where: str) -> None:
    """A re-plan of a run with checkpoints must keep every table's form (kind, TT rank): checkpoints re-shard
    by row id within a form (exact rows, host rows, TT cores), not from one form into another. A change is a
    ``ConfigError`` naming the tables (``dist.plan auto`` may choose other forms on another world size)."""
    changed = [f"{n}: {old[n].describe()} -> {f.describe()}" for n, f in new.items()
               if n in old and (old[n].kind, old[n].tt_rank) != (f.kind, f.tt_rank)]
    if changed:
        raise ConfigError(f"{where}: the new plan changes the form of tables its checkpoints hold "
                          f"({'; '.join(changed)}); checkpoints re-shard by row id within a form only: resume on "
                          "the run's world size, give a budget that keeps the forms, or start a new run directory")


def make_run_plan(cfg: RunConfig, data, tables, plan_dir: Path, progress: bool,
                  checkpoint_forms: Mapping[str, TableForm] | None = None):
    """The run's plan: a saved plan (``dist.plan`` is a path) or one made now from the training split's
    access profile with the named strategy (``auto``: :func:`make_auto_run_plan`, every table's form decided
    under the memory budgets). The plan records every table's form (``Plan.forms``); a saved
    plan's forms win over the config's, and an explicit request contradicting them is a ``ConfigError``
    (``plan.forms.forms_for_run``). Host and TT tables get no rows (``planned_tables``). ``checkpoint_forms``:
    the forms of the checkpoints a re-planned run resumes from; the new plan must keep them
    (:func:`check_forms_kept`), checked before it is saved."""
    d = cfg.dist
    world = d.nproc
    saved = Path(d.plan).exists()
    if d.plan == AUTO and not saved:
        if world % d.topology_hosts:
            raise ConfigError(f"dist.topology_hosts {d.topology_hosts} does not divide {world} ranks")
        plan_dir.mkdir(parents=True, exist_ok=True)
        prof = assemble.profile(data, plan_dir.parent / "profile", tables, progress=progress,
                                raw_ids=assemble.raw_id_features(cfg, tables))
        topo = Topology(num_hosts=d.topology_hosts, ranks_per_host=world // d.topology_hosts)
        plan = make_auto_run_plan(cfg, prof, tables, topo, plan_dir, data.manifest.num_dense)
        if d.plan_trial_steps > 0:  # a measured choice among the model's close plans (train.plan_trial)
            plan = choose_by_trial(cfg, plan, data, tables, prof, topo, plan_dir, progress,
                                   load_costs(d.costs or None).notes)
        forms = with_reorder(plan.forms, cfg.model.tt_reorder)  # model.tt_reorder: the TT tables' (EL-Rec IV)
        plan.meta["forms"] = {n: f.to_dict() for n, f in forms.items()}
        if checkpoint_forms:
            check_forms_kept(checkpoint_forms, plan.forms, str(plan_dir.parent))
        reo = assemble.run_reordering(cfg, data, tables, forms, plan_dir, progress, prof=prof)  # before plan.json
        if reo is not None:
            plan.meta["reordering"] = reordering_meta(reo)
        write_explain(plan.meta["auto"], plan_dir, png=False)  # explain.txt / explain.json beside the plan
        plan.save(plan_dir)
        return plan
    forms = config_forms(cfg.model, tables)  # what the config asks for
    prof = carried = None
    if saved:
        plan = Plan.load(d.plan)
        if plan.world_size != world:
            raise ConfigError(f"plan {d.plan} is for {plan.world_size} ranks, this run has {world}")
        check_plan_sizes(plan, tables, d.plan)
        forms = forms_for_run(plan.forms, forms, d.plan)
        carried = plan_reordering(d.plan, forms, tables)  # the saved plan's TT tables' reordering (EL-Rec IV)
        if carried is not None and Path(d.plan).resolve() != plan_dir.resolve():
            carried.save(plan_dir / PLAN_REORDER_DIR)
    if not planned_tables(tables, forms):
        raise ConfigError("several ranks need at least one table with placement: device and no compression to "
                          "plan; every table is host-placed or TT-compressed (replicated)")
    if not saved:
        if world % d.topology_hosts:
            raise ConfigError(f"dist.topology_hosts {d.topology_hosts} does not divide {world} ranks")
        prof = assemble.profile(data, plan_dir.parent / "profile", tables, progress=progress,
                                raw_ids=assemble.raw_id_features(cfg, tables))
        topo = Topology(num_hosts=d.topology_hosts, ranks_per_host=world // d.topology_hosts)
        plan = make_plan(d.plan, tables, prof, topo, forms=forms, mode=d.mode, extra_memory=d.extra_memory,
                         batch_size=max(1, cfg.train.batch_size // world),
                         **({"traffic": d.oper_traffic} if d.plan == "oper" else {}))
    if any(f.kind == "tt" for f in forms.values()):  # not sharded: a copy on every rank (EL-Rec VI-B)
        plan.meta["replicated_tables"] = replicated_tables_meta(tables, forms)
    plan.meta["forms"] = {n: f.to_dict() for n, f in forms.items()}
    if checkpoint_forms:
        check_forms_kept(checkpoint_forms, forms, str(plan_dir.parent))
    for name in EXPLAIN_FILES:  # an earlier auto plan's report would describe another plan
        (plan_dir / name).unlink(missing_ok=True)
    if not saved:  # model.tt_reorder: the TT tables' index reordering (EL-Rec IV), saved before plan.json
        carried = assemble.run_reordering(cfg, data, tables, forms, plan_dir, progress, prof=prof)
    if carried is not None:
        plan.meta["reordering"] = reordering_meta(carried)
    plan.save(plan_dir)
    return plan


def rank_device(cfg: RunConfig) -> torch.device:
    """This rank's device: ``train.device``, ``cuda:LOCAL_RANK`` on GPUs."""
    return run_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", 0)))


def stream_follow(run_dir: Path, world: int) -> tuple[Path, str]:
    """The follow file by which rank 0 ends a stream for every rank (``data.stream``), and this attempt."""
    return run_dir / STREAM_FOLLOW, attempt_token(world)


@torch.no_grad()
def evaluate_ranks(model: nn.Module, loader) -> dict:
    """Exact figures of ``model`` over the whole eval split, every rank scoring its part of ``loader``'s batches
    (collective: the logits gathered on every rank, so every rank returns the same figures)."""
    model.eval()
    zs, ys, ws = [], [], []
    for batch in loader:
        zs.append(model(batch.dense, batch.sparse).float())
        ys.append(batch.labels.float())
        ws.append(batch.weights)
    model.train()
    z, y, w = gather_logits(zs, ys, ws, weighted_data(loader))
    return binary_metrics(y, z, w)


def rank_figures(run, tables: list) -> dict:
    """What the summary adds for every N-rank run, flat or DMT (collective: every rank calls it): the embedding
    and gradient-sync bytes on wire per step summed over ranks, the run's plan and transport, and its ``tables``
    in their forms (``run.forms``)."""
    means = torch.tensor([float(np.mean(run.bytes_per_step)) if run.bytes_per_step else 0.0,
                          float(np.mean(run.sync_bytes_per_step)) if run.sync_bytes_per_step else 0.0])
    dist.all_reduce(means)
    d, forms = run.cfg.dist, run.forms
    return {"embedding_bytes_on_wire_per_step": means[0].item(), "grad_sync_bytes_per_step": means[1].item(),
            "steps_measured": max(len(run.bytes_per_step), 1), "plan": run.plan_name, "design": d.design,
            "transport": d.transport, "grad_sync": d.grad_sync, "teacher_auc": run.data.teacher_auc,
            "num_tables": len(tables), "embedding_bytes": sum(table_bytes(tb, forms[tb.name]) for tb in tables),
            "host_tables": sum(forms[tb.name].kind == "host" for tb in tables),
            "tt_tables": sum(forms[tb.name].kind == "tt" for tb in tables)}


class DistributedRun:
    """Everything one rank holds for a distributed run under a plan: the parts ``assemble.build_run`` made, DDP
    over the dense arches, the drift monitor and the input pipeline."""

    def __init__(self, cfg: RunConfig, run_dir: Path, rank: int, world: int, progress: bool = True,
                 inference: bool = False, inputs: assemble.RunInputs | None = None,
                 parts: assemble.RunParts | None = None):
        """Rank ``rank``'s run: its parts (``parts``, else ``assemble.build_run`` under the run directory's plan from
        ``inputs``, as :func:`join` prepared them, else read now), then what wraps them for training: DDP over the
        dense arches, the drift monitor, the input pipeline."""
        self._init_common(cfg, run_dir, rank, world, progress, inference)
        t, d = cfg.train, cfg.dist
        if parts is None:
            parts = assemble.build_run(cfg, inputs or assemble.run_inputs(cfg, progress=False), self.device,
                                       rank=rank, world=world, plan_dir=self.run_dir / "plan", inference=inference,
                                       follow=stream_follow(self.run_dir, world),
                                       storage_spare=PGAS_REPLAN_SPARE if t.replan_every else 0.0)
        self._hold(parts)
        device_module = self.tt_embedding or self.embedding
        self.monitor = None  # train.replan_every: the drift monitor (train.replan), made with the loaders
        if inference:
            return
        # rank-local rows and TT replicas (own sync): never DDP's
        self.ddp = dense_ddp(self.model, self.host_embedding or device_module)
        if t.replan_every:
            self.monitor = DriftMonitor(self, t.replan_every, t.replan_min_gain, t.replan_lag,
                                        count_every=t.replan_count_every, seed=t.seed)
        # the run's input pipeline (embedding.input_pipeline): the loop hands it the next batch before this step
        # (prefetch_batch); not_pipelined is the one place that says when it cannot run
        self.inputs = InputPipeline(f"input-r{rank}")
        entry = device_module if isinstance(device_module, (ShardedEmbedding, MixedEmbedding)) else None
        entry = self.managed if entry is not None and self.managed is not None else entry  # (maps, then hands on)
        mods = self.host_embedding.device_modules if self.host_embedding is not None else []
        self.pipeline_depth = host_pipeline_depth(self.forms, t.pipeline_depth) if self.host_embedding else 0
        self.not_pipelined = not_pipelined(enabled=d.input_pipeline, entry=entry is not None,
                                           host_depth=self.pipeline_depth, managed=self.managed is not None,
                                           host_entry=len(mods) == 1 and mods[0] is device_module)
        self.input_pipeline = self.not_pipelined is None
        if self.host_embedding is not None:  # host rows prefetched ahead by the server (EL-Rec V)
            self.train_loader = PipelinedLoader(self.train_loader, self.host_embedding, self.pipeline_depth,
                                                use_cache=t.pipeline_cache, timeout_s=d.timeout_s,
                                                lookahead=self.input_pipeline, inputs=self.inputs)
        if self.input_pipeline:
            self.inputs.drive(entry)

    def prefetch_batch(self, batch) -> None:
        """Run protocol (optional): ``batch`` is the next step's; the input pipeline prepares its input now, on
        worker threads, while this step computes (OPER 5.1 pipelined with the previous step: the retrieve design's
        prefetched step sends two all-to-alls instead of four). Same results either way. ``held_back`` says which
        steps' batches wait for their own step."""
        if not self.input_pipeline:
            return
        t, step = self.cfg.train, self.state.step + 1
        migrates = self.monitor is not None and self.monitor.may_migrate_before(step)
        if not held_back(step, migrates=migrates, managed=self.managed is not None, eval_every=t.eval_every,
                         checkpoint_every=t.checkpoint_every):
            self.inputs.prefetch(batch)

    def swap_sharded(self, new: nn.Module, plan: Plan) -> None:
        """Look up through ``new`` (the sharded module a live re-plan migrated the rows into, ``train.replan``)
        wherever the model held the old one, and run under ``plan`` from now on."""
        old = self.embedding
        for parent in self.model.modules():
            for name, child in list(parent.named_children()):
                if child is old:
                    setattr(parent, name, new)
        self.embedding, self.plan = new, plan
        if new is not old and self.managed is not None:  # managed ids: reset rows in, and map before, the new module
            self.managed.rows = new
            if managed_of(old) is self.managed:  # the hook sat on the old module itself (no TT module around it)
                install(new, self.managed)
        if new is not old and self.input_pipeline:  # the new module's lane on the run's input pipeline
            old.input_lane.leave()
            self.inputs.drive(new if self.inputs.entry is old else self.inputs.entry)

    def _init_common(self, cfg: RunConfig, run_dir: Path, rank: int, world: int, progress: bool,
                     inference: bool) -> None:
        """What the run holds before its parts: config, rank, device, position, byte counters."""
        self.cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world
        self.progress = progress and rank == 0
        self.inference = inference
        self.device = rank_device(cfg)
        self.state = RunState()
        self.bytes_per_step: list[int] = []
        self.sync_bytes_per_step: list[int] = []
        self.input_pipeline, self.pipeline_depth = False, 0  # next batch's ids converted ahead; host tables' depth

    def _hold(self, parts: assemble.RunParts) -> None:
        """Hold the parts ``assemble.build_run`` made, by the names the run's step, checkpoints and live re-plans
        (``train.replan``) read."""
        self.data, self.all_tables, self.forms, self.plan = parts.data, parts.tables, parts.forms, parts.plan
        self.tables = parts.sharded_tables  # the sharded ones; host tables: a parameter server
        self.monitor_group, self.transport = parts.monitor_group, parts.transport
        self.embedding_env, self.tt_stats = parts.env, parts.env.stats
        self.embedding, self.tt_embedding = parts.embedding, parts.tt_embedding
        self.host_embedding = parts.host_embedding
        self.managed = parts.managed
        self.model, self.opt = parts.model, parts.opt
        self._names = param_names(self.model, self.opt)
        self.train_loader, self.eval_loader = parts.train_loader, parts.eval_loader

    # the position, as attributes
    step = property(lambda self: self.state.step)
    epoch = property(lambda self: self.state.epoch)
    samples = property(lambda self: self.state.samples)
    losses = property(lambda self: self.state.losses)

    def barrier(self) -> None:
        dist.barrier()

    def step_error(self, err: RuntimeError) -> Exception:
        return diagnose(self, err)

    @property
    def plan_name(self) -> str:
        return self.plan.meta.get("strategy", self.cfg.dist.plan)

    def figures(self) -> dict:
        """What the summary adds (collective: every rank calls it): :func:`rank_figures`, the input pipeline's and
        managed tables' figures, and this executor's own figures (:meth:`executor_figures`)."""
        out = rank_figures(self, self.all_tables)
        if self.input_pipeline:  # steps whose ids were converted during the step before
            out["input_pipelined_steps"] = int(self.embedding.stats.get("prefetched_steps", 0))
        if self.pipeline_depth:  # host tables: the depth they ran (host_pipeline_depth)
            out["pipeline_depth"] = self.pipeline_depth
        if self.managed is not None:  # managed tables: the mapping's counters (all shards, summed)
            out["managed"] = self.managed.counters()
            # the id exchange of a training step (ids to their shard's host, rows and resets back, counts): bytes
            # sent summed over the ranks, comm.transport's convention (embedding.managed_lookup)
            ex = self.managed.exchange_figures()
            out["managed_exchange_bytes_per_step"] = ex.pop("bytes_per_step")
            out["managed_exchange_bytes"] = ex
        out.update(self.executor_figures())
        return out

    def executor_figures(self) -> dict:
        """The plan's figures (``plan_figures``, rank 0) and the drift monitor's re-plans (``train.replan``)."""
        if self.rank != 0:
            return {}
        return {**plan_figures(self), **(self.monitor.figures() if self.monitor is not None else {})}

    # -- one step -------------------------------------------------------------------------------
    def train_step(self, batch) -> float:
        if self.monitor is not None:  # between two steps: maybe re-plan and migrate (train.replan)
            self.monitor.maybe_replan(self)
            if self.managed is None:
                self.monitor.observe(batch.sparse, batch.batch_size, reader=self.embedding)
        t_step = time.perf_counter()  # the measured step the drift monitor's gains are calibrated on
        self.ddp.train()
        self.transport.counter.reset()  # this step's bytes: forward (ids, rows) and backward (gradients)
        set_dropout_rows(self.model, batch.global_size, (batch.global_size * self.rank) // self.world)
        logits = self.ddp(batch.dense, batch.sparse)
        self.step_logits = logits.detach()  # scored before the update (progressive validation)
        loss_sum = batch_loss_sum(logits, batch)  # sample weights of a weighted dataset (train.loss)
        loss = loss_sum / batch.global_size
        # the global loss for the loop's log: started now, beside the backward, and waited for at the step's end
        # (a blocking all-reduce there would be one more meeting point of the ranks every step)
        total = loss_sum.detach().reshape(1).clone()
        total_work = dist.all_reduce(total, async_op=True)
        self.opt.zero_grad(set_to_none=True)
        sync_before = self.embedding.stats.get("grad_sync_bytes", 0) + self.tt_stats.get("tt_grad_sync_bytes", 0)
        loss.backward()
        self.opt.step()
        if self.monitor is not None and self.managed is not None:  # managed: the rows the lookup read, not raw ids
            self.monitor.observe(self.managed.last, batch.batch_size)
        self.bytes_per_step.append(int(self.transport.counter.sent.sum()))
        self.sync_bytes_per_step.append(self.embedding.stats.get("grad_sync_bytes", 0)
                                        + self.tt_stats.get("tt_grad_sync_bytes", 0) - sync_before)
        total_work.wait()
        if self.monitor is not None:
            self.monitor.stepped(time.perf_counter() - t_step)
        return float(total) / batch.global_size

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        return evaluate_ranks(self.model, self.eval_loader)

    # -- checkpoints (train.checkpoint) ---------------------------------------------------------
    def save(self, ckpt_dir: Path, delta: bool = False, track: bool = False) -> dict:
        """This rank's rows (by table and row id, with their optimizer state; ``delta``: those updated since the
        last ``track`` save); rank 0 the dense state, named optimizer state, losses, host tables and TT cores.
        Returns the manifest fields (``Run.save``)."""
        st = self.embedding.shard_state(touched_only=delta)
        gids = st["gids"].numpy()
        base = self.embedding.amap.table_base
        tables = {}
        for t, spec in enumerate(self.tables):
            sel = np.flatnonzero((gids >= base[t]) & (gids < base[t + 1]))
            idx = torch.from_numpy(sel)
            w, mom = st["weight"][idx], st["momentum"][idx] if "momentum" in st else None
            tables[spec.name] = (delta_entry(gids[sel] - base[t], w, mom, spec.num_rows) if delta
                                 else table_entry(w, mom, gids[sel] - base[t]))
        write_rank(self.saved_parts(), ckpt_dir, self.rank, self.world, tables, delta=delta, track=track)
        if track:
            self.embedding.track_touched()
        return {"kind": "plan", "tables": [t.name for t in self.tables], "table_rows": [t.num_rows for t in self.tables],
                "optimizer": self.cfg.train.sparse_optimizer, "dense_optimizer": type(self.opt).__name__.lower(),
                "tt_tables": [t.name for t in self.all_tables if self.forms[t.name].kind == "tt"],
                "host_tables": [t.name for t in self.all_tables if self.forms[t.name].kind == "host"],
                "plan": self.plan_name, "config_yaml": dump_config(self.cfg)}

    def restore(self, ckpt_dir: Path) -> None:
        """Load a checkpoint written by any world size or plan, one process included (re-sharding by row id);
        a delta with its base under it, reading only this rank's rows (``checkpoint.read_rows``); a run that
        re-plans live moves its rows onto the plan the checkpoint's step ran under (``train.replan.resume_plan``)."""
        ckpt_dir = resolve_checkpoint(ckpt_dir)
        m = read_manifest(ckpt_dir)
        if m.get("kind", "plan") != "plan":
            raise FormatError(f"{ckpt_dir}: written by a {m['kind']!r} model (model.arch dmt-*); it resumes only as one")
        rows = dict(zip(m["tables"], m["table_rows"]))
        for t in self.tables:
            if rows.get(t.name) != t.num_rows:
                raise FormatError(f"{ckpt_dir}: table {t.name!r} has {rows.get(t.name)} rows in the checkpoint "
                                  f"(tables {m['tables']}), {t.num_rows} in this model")
        base = self.embedding.amap.table_base
        gids, weights, moms = [], [], []
        adagrad = self.cfg.train.sparse_optimizer == "rowwise_adagrad" and not self.inference
        mine = np.sort(self.embedding.amap.storage_gids(self.rank))
        wanted = {spec.name: mine[(mine >= base[t]) & (mine < base[t] + spec.num_rows)] - base[t]
                  for t, spec in enumerate(self.tables)}
        # this rank's rows, and 1/N of the rest of the rank files, all-gathered (a delta: over its base's)
        by_index = read_rows(ckpt_dir, m, wanted, self.monitor_group)
        if by_index is not None:
            shards, got, rows_read = by_index
        else:
            shards = read_shards(ckpt_dir, m)  # no row index: every rank file (local: memory-mapped)
        for t, spec in enumerate(self.tables):
            if by_index is not None:
                r, (w, mo) = wanted[spec.name], got[spec.name]
            else:
                r, w, mo = table_pieces(shards, spec.name)
            if adagrad and mo is None:
                raise FormatError(f"{ckpt_dir}: table {spec.name!r} has no row-wise Adagrad state")
            gids.append(r + base[t])
            weights.append(w)
            moms.append(mo)
        g = np.concatenate(gids)
        self.restore_bytes_read = rows_read if by_index is not None else None  # else: every rank file
        # (read_rows found every row this rank stores, or named the one it did not)
        n = self.embedding.amap.num_rows
        if by_index is None and (np.unique(g).size != n or g.size != n):
            raise FormatError(f"{ckpt_dir}: rank files hold {g.size} rows ({np.unique(g).size} distinct), "
                              f"the model has {self.embedding.amap.num_rows}")
        mom = torch.cat(moms) if adagrad else None
        filled = self.embedding.load_rows(g, torch.cat(weights), mom)
        assert filled == self.embedding.weight.shape[0]
        restore_parts(self.saved_parts(), ckpt_dir, m, shards, rank=self.rank, world=self.world,
                      inference=self.inference)
        if self.monitor is not None:  # the plan the checkpoint's step ran under (train.replan)
            resume_plan(self)

    def saved_parts(self) -> CheckpointParts:
        """What a checkpoint holds beside this rank's rows (``train.persist``)."""
        mixed = self.tt_embedding
        return CheckpointParts(self.model, self.opt, self._names, self.state, host=self.host_embedding,
                        host_tables=[t.name for t in self.all_tables if self.forms[t.name].kind == "host"],
                        tt=mixed.tt if mixed is not None else None, mixed=mixed, managed=self.managed,
                        monitor=self.monitor)


def serve_eval_split(run, rd: Path, checkpoint, warmup: int, extra: dict) -> dict | None:
    """Score the eval split with ``run``'s restored model on every rank (the timed part: forward passes after
    ``warmup`` batches, the slowest rank's); rank 0 writes ``predictions.npy`` and ``inference.json``
    (logloss, AUC, samples/s and ``extra``) into ``rd`` and returns the figures; other ranks return None."""
    if run.eval_loader is None:
        raise ConfigError("inference needs an eval split (data.eval_samples or data.eval_fraction)")
    run.model.eval()
    zs, ys, ws, secs, n = [], [], [], 0.0, 0
    warmup = min(warmup, len(run.eval_loader) - 1)  # the first batches warm caches; time the rest
    with torch.no_grad():
        for i, batch in enumerate(run.eval_loader):
            dist.barrier(group=run.monitor_group)
            t0 = time.perf_counter()
            z = run.model(batch.dense, batch.sparse)
            if i >= warmup:
                secs += time.perf_counter() - t0
                n += batch.global_size
            zs.append(z.float().to(HOST))
            ys.append(batch.labels.float().to(HOST))
            ws.append(batch.weights)
    z, y, w = gather_logits(zs, ys, ws, weighted_data(run.eval_loader))
    t = torch.tensor([secs])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if run.rank != 0:
        return None
    out = {"world_size": run.world, "checkpoint": str(checkpoint), "samples": int(y.size),
           **{k: v for k, v in binary_metrics(y, z, w).items() if k != "samples"},
           "samples_per_s": n / float(t) if float(t) > 0 else math.nan, **extra}
    with atomic_open(rd / "predictions.npy", "wb") as f:
        np.save(f, 1.0 / (1.0 + np.exp(-z)), allow_pickle=False)
    atomic_write_json(rd / "inference.json", out)
    return out


def gather_logits(zs: list[torch.Tensor], ys: list[torch.Tensor], ws: list | None = None, weighted: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Every rank's logits, labels and, for a ``weighted`` dataset (every rank says the same: its manifest's),
    sample weights (else None), concatenated in rank order on every rank (for exact AUC)."""
    if zs:
        cols = [torch.cat([z.float().to(HOST) for z in zs]), torch.cat([y.float().to(HOST) for y in ys])]
        if weighted:
            cols.append(torch.cat([w.float().to(HOST) for w in ws]))
        local = torch.stack(cols, 1)
    else:
        local = torch.zeros(0, 3 if weighted else 2)
    both = torch.cat(all_gather_var(local))
    return both[:, 0].numpy(), both[:, 1].numpy(), (both[:, 2].numpy() if weighted else None)


def weighted_data(loader) -> bool:
    """Whether ``loader`` reads a weighted dataset (its manifest has sample weights)."""
    return bool(getattr(getattr(loader, "manifest", None), "weighted", False))


latest_sharded_checkpoint = latest_checkpoint  # one format: every checkpoint is a step directory


@dataclass
class Joined:
    """A rank that joined its run: the shared run directory, its rank, the world size and the run's inputs
    (data and tables, prepared once in this process)."""

    run_dir: Path
    rank: int
    world: int
    inputs: assemble.RunInputs


def join_run(cfg: RunConfig, run_dir: str | None, progress: bool) -> tuple[Path, int, int]:
    """:func:`join`, as ``(run directory, rank, world size)``."""
    j = join(cfg, run_dir, progress)
    return j.run_dir, j.rank, j.world


def join(cfg: RunConfig, run_dir: str | None, progress: bool) -> Joined:
    """Rank 0 prepares the run (data, profile, plan), the others wait for it and read the prepared data; then
    all join the group."""
    die_with_launcher()  # from the start: a rank waiting for rank 0 must not outlive its launcher either
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.dist.nproc = world
    apply_launch_topology(cfg, world)  # several nodes: the launch's hosts (train.nodes)
    rd = shared_run_dir(cfg, run_dir)
    _JOINS[0] += 1  # runs one after another in the same processes (tests, tools) keep apart in the store
    token = f"{attempt_token(world)}:{_JOINS[0]}"
    wait_s = max(cfg.dist.timeout_s, 3600.0)
    # rank 0's plan reaches the other nodes through the launch's store, not the run directory (train.nodes)
    handoff = Handoff(rendezvous_store(cfg.dist.timeout_s), token) if world > 1 else None
    if rank == 0:
        if not os.environ.get("EMBEDSCALE_LAUNCHED"):  # plain torchrun: rank 0 holds the run (train.lock)
            hold_run_dir(rd)
        try:
            inputs = prepare_on_rank0(cfg, rd, progress, token)
            if handoff is not None:
                handoff.publish(rd, inputs.tables)
        except BaseException as e:
            if handoff is not None:
                handoff.fail("rank 0", e)
            raise
    else:  # the node's own data cache: read, or made by the node's first rank
        inputs, shared = handoff.receive(rd, wait_s, lambda: assemble.run_inputs(cfg, progress=False))
        set_node_dir_shared(shared)
    if handoff is not None:
        handoff.wait_all_nodes(node_of()[2], wait_s)
    backend = cfg.dist.backend or process_group_backend(torch.device(cfg.train.device))
    init_from_env(backend, timeout_s=cfg.dist.timeout_s)
    watchdog.start(rank, world, token, cfg.dist.timeout_s)  # a frozen or lost rank named by the others (_diagnose)
    return Joined(rd, rank, world, inputs)


def plan_figures(run: DistributedRun) -> dict:
    """The plan's balance under the OPER cost model (eqs. 1-5) and the bytes on wire it predicts for this
    executor (``embedding.wire``), next to what was measured."""
    out: dict = {"plan_summary": run.plan.summary()}
    trial = (run.plan.meta.get("auto") or {}).get("measured_choice")
    if trial:  # the measured choice among the auto plan's close candidates (train.plan_trial): its seconds
        out.update(plan_trial_seconds=trial["trial_seconds"], plan_trial_chosen=trial["chosen"])
    prof_dir = run.run_dir / "profile"
    if not prof_dir.exists():
        return out
    prof = AccessProfile.load(prof_dir)
    b_local = run.cfg.train.batch_size / run.world
    topo = run.plan.meta.get("topology") or {"num_hosts": 1, "ranks_per_host": run.world}
    try:
        cost = evaluate(run.plan, prof, topo, mode=run.plan.meta.get("mode", "training"),
                        batch_size=max(1, int(b_local)), traffic="distinct")
        out.update({"dob_memory": cost.dob_memory, "dob_lookup": cost.dob_lookup, "dob_comm": cost.dob_comm})
    except EmbedscaleError as e:
        out["cost_model_error"] = str(e)
    if run.cfg.dist.design == "retrieve":
        lookups = {t.name: prof.total(t.name) / max(prof.samples, 1) * b_local for t in run.tables}
        pred = expected_wire_bytes(run.embedding.amap, run.tables, prof, lookups, mode="training",
                                   grad_sync=run.cfg.dist.grad_sync)
        out["predicted_bytes_on_wire_per_step"] = pred["total"]
    return out


def diagnose(run: DistributedRun, err: RuntimeError) -> EmbedscaleError:
    """Turn a failed collective into an error that names the rank(s) that stopped answering.

    gloo's own message names a socket, not a rank. The ranks' heartbeats (``train.watchdog``) name the ranks
    that are frozen or gone, with the collective this rank waited in (a :class:`watchdog.PeerLost`: the rank
    ends at once); when every rank still beats (one stuck in Python), a monitored barrier (gloo) on a group made
    at setup finds which ranks do not respond (rank 0 names them).
    """
    stopped, collective = watchdog.diagnose()
    if stopped:
        return watchdog.PeerLost(
            f"rank {run.rank}: {collective} failed at step {run.step}: rank{'s' if len(stopped) > 1 else ''} "
            f"{', '.join(map(str, stopped))} stopped answering (no heartbeat for {watchdog.STALE_S:g} s: frozen, "
            f"killed or its node lost; timeout dist.timeout_s = {run.cfg.dist.timeout_s:g} s): "
            f"{str(err).splitlines()[0]}")
    culprits = ""
    try:
        dist.monitored_barrier(group=run.monitor_group, wait_all_ranks=True,
                               timeout=datetime.timedelta(seconds=max(2.0, run.cfg.dist.timeout_s / 2)))
    except RuntimeError as e2:
        culprits = f" Diagnosis: {str(e2).splitlines()[0]}"
    except Exception:  # noqa: BLE001 - the diagnosis is best effort
        pass
    return EmbedscaleError(f"rank {run.rank}: a collective with the other ranks failed at step {run.state.step} "
                           f"(timeout dist.timeout_s = {run.cfg.dist.timeout_s:g} s): {str(err).splitlines()[0]}."
                           f"{culprits}")
