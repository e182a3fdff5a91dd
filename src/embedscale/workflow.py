"""The one flow, end to end (orchestration): data -> profile -> plan -> build -> train/evaluate -> report.

The CLI commands are thin wrappers over these functions, so what ``embedscale run`` does can be done
step by step from Python as well. The steps themselves are ``embedscale.assemble`` (below the run loop);
this module strings them together with the run loop and the launcher (``embedscale.train``), above both.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from embedscale.io import atomic_write_json, atomic_write_text, new_run_dir
from embedscale.plan.forms import config_forms, host_pipeline_depth, table_bytes
from embedscale.specs import RunConfig, TableSpec, dump_config
from embedscale.threads import rank_env
from embedscale.train.lock import RunLock
# the assembly steps, re-exported: `workflow.prepare_data(...)` etc. read as the flow's steps
from embedscale.assemble import (PreparedData, Split, _log, build, hash_init, make_dense_optimizer,  # noqa: F401
                                 prepare_data, profile, say_embedding_memory, split_existing, tables_for,
                                 run_reordering, tt_lr)
from embedscale.assemble import RunInputs, build_run, raw_id_features
from embedscale.errors import ConfigError, EmbedscaleError
from embedscale.io import read_json
from embedscale.models.dmt import is_dmt_arch
from embedscale.train.distributed import check_auto_settings, ensure_run_plan
from embedscale.train.dmt_run import dmt_checkpoint_fields
from embedscale.train.dmt_towers import prepare_towers
from embedscale.train.launcher import launch_ranks
from embedscale.train.loop import LoopConfig
from embedscale.train.summary import format_summary  # noqa: F401 (the commands print it)
from embedscale.train.trainer import Trainer, pipelined_trainer


def check_one_process(cfg: RunConfig) -> None:
    """What a run of one process cannot do, refused by name before anything is written: ``train.replan_every``
    (the drift monitor re-plans the rows of an N-rank run, ``train.replan``; one process has no plan to change)."""
    if cfg.train.replan_every:
        raise ConfigError(f"train.replan_every {cfg.train.replan_every}: live re-planning moves rows between the "
                          "ranks of a planned run; this run has one process (dist.nproc 1): set "
                          "train.replan_every 0, or dist.nproc 2 or more")


def train(cfg: RunConfig, run_dir: str | Path, data: PreparedData | None = None, *, resume: bool = True,
          progress: bool = True, tables: list[TableSpec] | None = None) -> dict:
    """Train and evaluate as ``cfg`` says in one process, writing config, metrics, plot and checkpoints into
    ``run_dir``; with ``resume`` it continues from the run directory's latest checkpoint, whatever world size
    wrote it (``train.checkpoint``: rows by table and row id). ``config.yaml`` is written once the inputs
    (data, tables, model) are valid, so a command that fails on them leaves the run directory as it was. ``data``
    and ``tables``: the run's, when the caller prepared them (else prepared here)."""
    check_one_process(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_yaml = dump_config(cfg)
    data = data or prepare_data(cfg, progress=progress)
    device = torch.device(cfg.train.device)
    tables = tables if tables is not None else tables_for(cfg, data.manifest)
    forms = config_forms(cfg.model, tables)  # a world of one: the config's requests decided (build does the same)
    say_embedding_memory(tables, forms)
    assignment = _dmt_towers(cfg, tables, run_dir)
    # model.tt_reorder: the TT tables' index reordering (EL-Rec IV), kept in run_dir/reorder/
    reordering = run_reordering(cfg, data, tables, forms, run_dir, progress=progress)
    parts = build_run(cfg, RunInputs(data, tables), device, assignment=assignment, reordering=reordering)
    model, opt, train_loader, eval_loader = parts.model, parts.opt, parts.train_loader, parts.eval_loader
    t = cfg.train
    fields = None
    if assignment is not None:  # DMT: the checkpoint says which towers and model shape it holds
        fields = dmt_checkpoint_fields(cfg, assignment, world=1)
    kw = dict(config_yaml=config_yaml, progress=progress, checkpoint_fields=fields, loop=LoopConfig.from_train(t))
    if any(f.kind == "host" for f in forms.values()):
        trainer = pipelined_trainer(model, opt, train_loader, eval_loader, run_dir,
                                    pipeline_depth=host_pipeline_depth(forms, t.pipeline_depth), use_cache=t.pipeline_cache, **kw)
    else:
        trainer = Trainer(model, opt, train_loader, eval_loader, run_dir, **kw)
    if resume and trainer.resume():
        _log(f"resumed from step {trainer.step} in {run_dir / 'checkpoints'}")
    atomic_write_text(run_dir / "config.yaml", config_yaml)
    extra = {"teacher_auc": data.teacher_auc, "train_rows": None if data.stream else data.train.rows,
             "eval_rows": data.eval.rows if data.eval else 0,
             "embedding_bytes": sum(table_bytes(tb, forms[tb.name]) for tb in tables), "num_tables": len(tables),
             "host_tables": sum(f.kind == "host" for f in forms.values()),
             "tt_tables": sum(f.kind == "tt" for f in forms.values())}
    return trainer.fit(title=f"{cfg.model.arch} on {cfg.data.source}", ceiling_auc=data.teacher_auc, extra=extra)


def _dmt_towers(cfg: RunConfig, tables: list[TableSpec], run_dir: Path):
    """DMT archs: the run's towers, written to (or, when resuming, checked against) ``run_dir/towers.json``."""
    if not is_dmt_arch(cfg.model.arch):
        return None
    return prepare_towers(cfg, tables, run_dir)


def run_main(cfg: RunConfig, progress: bool = True) -> dict:
    """The README's main job: data, profile, plan, train (on ``dist.nproc`` local ranks), evaluate, summary."""
    t0 = time.perf_counter()
    if cfg.dist.nproc <= 1:
        check_one_process(cfg)
    else:
        check_auto_settings(cfg)  # before any data is made or rank starts
    run_dir = new_run_dir(cfg)
    _log(f"run directory: {run_dir}")
    with RunLock(run_dir):  # this process holds the run for as long as it runs (train.lock)
        data = prepare_data(cfg, progress=progress)
        tables = tables_for(cfg, data.manifest)
        prof = profile(data, run_dir / "profile", tables, progress=progress, raw_ids=raw_id_features(cfg, tables))
        if cfg.dist.nproc > 1:
            summary = _run_distributed(cfg, run_dir, data, tables, progress)
        else:
            summary = train(cfg, run_dir, data, resume=False, progress=progress, tables=tables)
        summary["profile_summary"] = prof.summary() if hasattr(prof, "summary") else {}
        summary["wall_seconds"] = time.perf_counter() - t0
        atomic_write_json(run_dir / "summary.json", summary)
    return summary


def _run_distributed(cfg: RunConfig, run_dir: Path, data: PreparedData, tables, progress: bool) -> dict:
    """Plan here (the profile is made), then train on ``dist.nproc`` local ranks under torchrun."""
    towers = _dmt_towers(cfg, tables, run_dir)
    if towers is not None:  # DMT: the towers place the tables (tower groups), no plan
        _log(f"towers: {towers.num_towers} ({towers.strategy}) on {cfg.dist.nproc} ranks, "
             f"{cfg.dist.topology_hosts} host(s)")
    else:  # planned here, where the profile is; the ranks' rank 0 finds it made for this world and plan
        plan = ensure_run_plan(cfg, data, tables, run_dir, progress)
        _log(f"plan: {plan.meta.get('strategy', cfg.dist.plan)} on {cfg.dist.nproc} ranks "
             f"({plan.meta.get('plan_seconds', 0):.2f} s)")
    atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
    config_path = run_dir / "config.yaml"
    args = ["train", "--config", str(config_path), "--run-dir", str(run_dir)] + ([] if progress else ["--no-progress"])
    code = launch_ranks(cfg.dist.nproc, args, run_dir=run_dir, env=rank_env(cfg.dist.nproc))
    if code != 0:
        raise EmbedscaleError(f"distributed training failed (torchrun exit code {code}); see the rank errors above")
    return read_json(run_dir / "summary.json", "run summary")


