"""The one training loop: drives any :class:`~embedscale.train.run.Run` (one process, N ranks, DMT towers).

Per step it does only what every run needs (learning-rate warmup, the run's step, position and loss
bookkeeping, the progress bar); every ``log_every`` steps a metrics row, every ``eval_every`` an exact
evaluation, every ``checkpoint_every`` a checkpoint (``checkpoints/step-N/``, with ``metrics.csv`` written
beside it), and at the end a final evaluation, a checkpoint, ``metrics.csv``, ``curves.png`` and
``summary.json`` (rank 0). ``metrics.csv`` keeps the rows of earlier attempts up to the step the run was
restored at (:class:`~embedscale.train.metrics.MetricsLog`), so a resumed or restarted run lists every
step once.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from embedscale.errors import ConfigError
from embedscale.io import atomic_write_json
from embedscale.train.metrics import MetricRow, MetricsLog
from embedscale.train.plots import plot_curves
from embedscale.train.run import Run, save_checkpoint


@dataclass
class LoopConfig:
    """When the loop stops, logs, evaluates and checkpoints (``train.*`` of the run config).

    epochs, max_steps: stop after ``epochs`` passes or ``max_steps`` steps (0 = no step limit).
    eval_every, log_every, checkpoint_every: in steps (0 = only at the end for eval/checkpoint).
    lr_warmup_steps: linear warmup of the dense optimizer's learning rate (:func:`warm_up_lr`).
    """

    epochs: int = 1
    max_steps: int = 0
    eval_every: int = 0
    log_every: int = 10
    checkpoint_every: int = 0
    lr_warmup_steps: int = 0

    @classmethod
    def from_train(cls, t) -> "LoopConfig":
        return cls(epochs=t.epochs, max_steps=t.max_steps, eval_every=t.eval_every, log_every=t.log_every,
                   checkpoint_every=t.checkpoint_every, lr_warmup_steps=t.lr_warmup_steps)


def warm_up_lr(opt, step: int, warmup_steps: int) -> None:
    """Linear learning-rate warmup of the dense optimizer: step ``k`` (0-based) runs at
    ``min(1, (k + 1) / warmup_steps)`` times each group's configured rate (kept in the group as
    ``warmup_base_lr``, so it survives a checkpoint and resume is exact). ``warmup_steps <= 0``: no-op.

    Why: Adagrad's (and Adam's) first update moves every weight by about the learning rate, whatever the
    size of its gradient (the step is normalised by the gradient itself). On a freshly initialised ReLU
    MLP that coherent jump pushes whole layers below zero for every input: measured on DLRM (bottom MLP
    512-256-64-16, Adagrad lr 0.01) 50-69% of the units of the deeper bottom layers stop firing after
    step 1, and once all 16 outputs of the bottom MLP are dead (which happened at batch 2048, not at
    1024) the dense features never reach the model again (eval AUC 0.712 instead of 0.761 on 2M synthetic
    Criteo samples). Ramping the rate up over the first steps keeps the initial units alive. The DLRM
    MLPerf reference and TorchRec's DLRM example warm up the same way (``lr_warmup_steps``)."""
    if warmup_steps < 0:
        raise ConfigError(f"train.lr_warmup_steps must be >= 0 (0 = no warmup), got {warmup_steps}")
    if warmup_steps == 0:
        return
    f = min(1.0, (step + 1) / warmup_steps)
    for g in opt.param_groups:
        g["lr"] = g.setdefault("warmup_base_lr", g["lr"]) * f


def inject_fault(kind: str) -> None:
    """Fault injection for the fault tests (``EMBEDSCALE_FAULT_STEP``): this rank dies or hangs here."""
    if kind == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), 9)


def fit(run: Run, loop: LoopConfig, *, fault_step: int | None = None, title: str = "",
        ceiling_auc: float = math.nan, extra: dict | None = None) -> dict | None:
    """Train ``run`` from its current position to the end (``loop.epochs`` or ``loop.max_steps``); return the
    summary on rank 0 (``None`` on the others). ``fault_step``: this rank dies at that step (tests).
    ``extra`` goes into the summary."""
    st = run.state
    metrics = MetricsLog(run.run_dir, enabled=run.rank == 0)
    metrics.restart(st.step)
    total = loop.max_steps or loop.epochs * len(run.train_loader)
    bar = tqdm(total=total, initial=st.step, desc="train" if run.world == 1 else f"train x{run.world}", unit="step",
               disable=not run.progress, file=sys.stderr, dynamic_ncols=True)
    t_start = time.perf_counter()
    train_s, trained = 0.0, 0
    window: list[float] = []
    window_samples, t_window = 0, t_start
    last_eval: tuple[int, dict] = (-1, {})  # (step, figures) of the latest evaluation
    done = lambda: bool(loop.max_steps) and st.step >= loop.max_steps  # noqa: E731
    while st.epoch < loop.epochs and not done():
        run.train_loader.set_epoch(st.epoch, skip_batches=st.batch_in_epoch)
        for batch in run.train_loader:
            if fault_step is not None and st.step == fault_step:
                inject_fault(os.environ.get("EMBEDSCALE_FAULT", "kill"))
            s0 = time.perf_counter()
            warm_up_lr(run.opt, st.step, loop.lr_warmup_steps)
            try:
                loss = run.train_step(batch)
            except RuntimeError as e:
                raise run.step_error(e) from e
            train_s += time.perf_counter() - s0
            n = batch.global_size or batch.batch_size
            trained += n
            window_samples += n
            st.step += 1
            st.batch_in_epoch += 1
            st.samples += n
            st.losses.append(loss)
            window.append(loss)
            bar.update(1)
            if loop.log_every and st.step % loop.log_every == 0:
                now = time.perf_counter()
                sps = window_samples / max(now - t_window, 1e-9)
                mean = float(np.mean(window))
                bar.set_postfix(loss=f"{mean:.4f}", sps=f"{sps:,.0f}")
                metrics.log(MetricRow(st.step, st.epoch, st.samples, mean, samples_per_s=sps, seconds=now - t_start))
                window, window_samples, t_window = [], 0, now
            if loop.eval_every and st.step % loop.eval_every == 0 and run.eval_loader is not None:
                last_eval = (st.step, run.evaluate())
                m = last_eval[1]
                metrics.log_eval(st.step, st.epoch, st.samples, m["logloss"], m["auc"], time.perf_counter() - t_start)
            if loop.checkpoint_every and st.step % loop.checkpoint_every == 0:
                save_checkpoint(run)
                metrics.write()
            if done():
                break
        else:
            st.epoch += 1
            st.batch_in_epoch = 0
    bar.close()
    if last_eval[0] == st.step:  # evaluated at this very step already
        final = last_eval[1]
    else:
        final = run.evaluate() if run.eval_loader is not None else {}
    if final:
        metrics.log_eval(st.step, st.epoch, st.samples, final["logloss"], final["auc"], time.perf_counter() - t_start)
    save_checkpoint(run)
    figures = run.figures()  # every rank calls it (collective for N ranks)
    if run.rank != 0:
        return None
    metrics.write()
    last = st.losses[-max(loop.log_every, 1):]
    summary = {
        "world_size": run.world, "steps": st.step, "samples": st.samples,
        "train_samples_per_s": trained / train_s if train_s else math.nan,
        "train_logloss": float(np.mean(last)) if last else math.nan,
        "eval_logloss": final.get("logloss", math.nan), "eval_auc": final.get("auc", math.nan),
        "eval_samples": final.get("samples", 0), "run_dir": str(run.run_dir), **(extra or {}), **figures,
    }
    plot_curves(metrics.rows, run.run_dir / "curves.png", title=title, ceiling_auc=ceiling_auc)
    atomic_write_json(run.run_dir / "summary.json", summary)
    return summary


__all__ = ["LoopConfig", "fit", "inject_fault", "warm_up_lr"]
