"""One rank's part of a distributed run or of sharded inference: the entry every rank calls (under torchrun,
the launcher's ranks or a test's local processes). It joins the run (rank 0 prepares data, profile and plan),
builds the run of the checkpoint's kind - a flat :class:`~embedscale.train.distributed.DistributedRun` (rows
placed by a plan) or a :class:`~embedscale.train.dmt_run.DMTRun` (DMT's tower transform) - and hands it to the
one loop (``train.loop.fit``) or to serving (``serve_eval_split``). Above both run kinds, which know nothing of
each other's modules.
"""

from __future__ import annotations

import os
from pathlib import Path


from embedscale.models.dmt import is_dmt_arch
from embedscale.specs import RunConfig
from embedscale.train.checkpoint import checkpoint_home, latest_checkpoint, resolve_checkpoint
from embedscale.train.distributed import DistributedRun, _log, join, serve_eval_split
from embedscale.train.dmt_run import DMTRun, infer_dmt
from embedscale.train import watchdog
from embedscale.train.launch import leave_group
from embedscale.train.loop import LoopConfig, fit


def infer_distributed(cfg: RunConfig, checkpoint: str, run_dir: str | None = None, *, progress: bool = True,
                      warmup: int = 2) -> dict | None:
    """Sharded inference: the checkpoint's model under an inference plan (``dist.mode = inference``: hot rows
    replicated by OPER Algorithm 1), scoring the eval split; rank 0 writes ``predictions.npy`` and
    ``inference.json`` (logloss, AUC, samples/s) into the run directory and returns the figures."""
    if is_dmt_arch(cfg.model.arch):  # DMT models serve through the tower transform, with their own towers
        return infer_dmt(cfg, checkpoint, run_dir, progress=progress, warmup=warmup)
    cfg.dist.mode = "inference"
    j = join(cfg, run_dir, progress)
    rd = j.run_dir
    run = DistributedRun(cfg, rd, j.rank, j.world, progress, inference=True, inputs=j.inputs)
    run.restore(Path(checkpoint))
    out = serve_eval_split(run, rd, checkpoint, warmup,
                           {"plan": run.plan.meta.get("strategy"), "design": cfg.dist.design})
    leave_run(run)
    return out


def leave_run(run) -> None:
    """A rank's orderly exit after its work succeeded (``launch.leave_group``): every rank at a barrier, the
    embedding's resources released (the PGAS lookup's worker threads and heap mappings), then the process group
    left. A rank that exits while its peers' collectives or gloo's threads are still running can abort in C++
    ("terminate called without an active exception", seen under load after PGAS inference)."""
    close = getattr(getattr(run, "embedding", None), "close", None)
    leave_group(close if callable(close) else None)


def train_distributed(cfg: RunConfig, run_dir: str | None = None, *, progress: bool = True,
                      resume_from: str | None = None, fault_step: int | None = None) -> dict | None:
    """One rank's part of a distributed run (call it on every rank; torchrun's env says which); a DMT arch
    (``model.arch: dmt-*``) runs as a ``DMTRun`` (tower transform, ``embedscale.train.dmt_run``). Resumes from
    ``resume_from`` (a checkpoint or run directory) or the run directory's latest checkpoint, whatever world
    size wrote it. Returns the summary on rank 0."""
    j = join(cfg, run_dir, progress)
    rd, rank, world = j.run_dir, j.rank, j.world
    if is_dmt_arch(cfg.model.arch):
        run: DistributedRun | DMTRun = DMTRun(cfg, rd, rank, world, progress, inputs=j.inputs)
    else:
        run = DistributedRun(cfg, rd, rank, world, progress, inputs=j.inputs)
    home = checkpoint_home(rd, cfg.train.checkpoint_dir)  # where checkpoints/ goes (train.checkpoint_dir)
    ck = resolve_checkpoint(resume_from) if resume_from else latest_checkpoint(home)
    if ck is not None:
        run.restore(ck)  # (a run that re-plans live: onto the plan the checkpoint's step ran under)
        _log(rank, f"resumed from {ck} (step {run.state.step})")
    if fault_step is None and os.environ.get("EMBEDSCALE_FAULT_STEP") and \
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fault_step = int(os.environ["EMBEDSCALE_FAULT_STEP"])  # fault injection (tests): first attempt only
    if rank != int(os.environ.get("EMBEDSCALE_FAULT_RANK", "1")):
        fault_step = None
    try:
        out = fit(run, LoopConfig.from_train(cfg.train), fault_step=fault_step,
                  title=f"{cfg.model.arch} x{world} ranks ({run.plan_name})", ceiling_auc=run.data.teacher_auc)
    except RuntimeError as e:  # a collective of an evaluation or a checkpoint (a step's: the loop's own error)
        if not watchdog.collective_failure(e):
            raise
        raise run.step_error(e) from e
    leave_run(run)
    return out
