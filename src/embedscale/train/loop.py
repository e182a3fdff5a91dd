"""The one training loop: drives any :class:`~embedscale.train.run.Run` (one process, N ranks, DMT towers).

Per step it does only what every run needs (learning-rate warmup, the run's step, position and loss
bookkeeping, the progress bar); every ``log_every`` steps a metrics row, every ``eval_every`` (and at each
epoch's end when there are several) an exact evaluation followed by the early-stopping bookkeeping (the
best evaluation checkpointed and pointed at by ``checkpoints/best``; a stop after ``early_stopping_patience``
evaluations without improvement), every ``checkpoint_every`` a checkpoint (``checkpoints/step-N/``, with
``metrics.csv`` written beside it), and at the end a final evaluation, a checkpoint, ``metrics.csv``,
``curves.png`` and ``summary.json`` (rank 0). ``metrics.csv`` keeps the rows of earlier attempts up to the step the run was
restored at (:class:`~embedscale.train.metrics.MetricsLog`), so a resumed or restarted run lists every
step once.

Progressive validation (``progressive_window`` samples, :class:`~embedscale.train.metrics.ProgressiveWindow`):
every step's batch is scored by the logits of its training forward (``Run.step_logits``, before the update);
each logged row carries the window's AUC, logloss and NE (``pv_*``; N ranks: every rank's slices gathered).
A stream source (:class:`~embedscale.data.stream.StreamLoader`) is one pass that ends at its end condition;
its position (shard, row of the next batch) is the run state's ``stream``, so a checkpoint resumes there.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from embedscale.data.metrics import binary_metrics
from embedscale.data.stream import StreamLoader
from embedscale.embedding.grad_sync import all_gather_var
from embedscale.errors import ConfigError
from embedscale.io import atomic_write_json
from embedscale.models.dlrm import calibrate_logits, uncalibrated
from embedscale.train.metrics import MetricRow, MetricsLog, ProgressiveWindow
from embedscale.train.plots import plot_curves, plot_replans
from embedscale.storage import remove_tree
from embedscale.train.checkpoint import base_ref, bases_in_use, best_pointer, checkpoint_home, step_dir, write_best
from embedscale.train.replan import read_replans
from embedscale.train.run import Run, save_checkpoint


MONITORED = {"auc": "max", "logloss": "min", "ne": "min"}  # early_stopping_metric -> direction of improvement


@dataclass
class LoopConfig:
    """When the loop stops, logs, evaluates and checkpoints (``train.*`` of the run config).

    epochs, max_steps: stop after ``epochs`` passes or ``max_steps`` steps (0 = no step limit); ``epochs``
        0: until early stopping, at most :func:`auto_epochs` passes (``epoch_samples`` samples, at least one).
    eval_every, log_every, checkpoint_every: in steps (0 = only at the end for eval/checkpoint); with more than
        one epoch the eval split is also scored at the end of every epoch.
    lr_warmup_steps, lr_warmup_fraction: linear warmup of the dense optimizer's learning rate over
        ``min(lr_warmup_steps, lr_warmup_fraction x the run's steps)`` steps (:func:`warmup_steps`).
    early_stopping_patience: stop once this many evaluations in a row have not improved the monitored
        ``early_stopping_metric`` (``auc``, ``logloss`` or ``ne``) by more than ``early_stopping_min_delta``
        (0 = never stop early).
    keep_best: keep ``checkpoints/best`` pointing at the checkpoint of the best evaluation (one is written at
        every improvement; the previous best's directory is removed unless it is a periodic or the last one,
        or the base of a delta).
    checkpoint_full_every: M > 0: a full checkpoint when the step enters a new multiple of M (and the first
        of a process), deltas in between (``train.checkpoint``); 0 = every checkpoint full.
    progressive_window: samples in the progressive-validation window (0 = off), figures in every logged row.
    calibrate: at every evaluation, set the model's ``LogitCalibration`` to the beta calibration of the eval
        split's raw logits (``beta_scale``, ``beta_shift``, ``beta_tail`` of the figures; Platt's map when that
        fits as well) before a checkpoint of that step (the best one included) is written (inference only:
        training sees raw logits); the evaluation's recorded figures (the best's, the summary's, the early
        stopping's) become the calibrated ones, what its checkpoint predicts (``metrics.csv`` keeps the raw ones).
    """

    epochs: int = 1
    max_steps: int = 0
    epoch_samples: int = 1_000_000
    batch_size: int = 0  # the global batch (auto_epochs' samples per step)
    eval_every: int = 0
    log_every: int = 10
    checkpoint_every: int = 0
    lr_warmup_steps: int = 0
    lr_warmup_fraction: float = 1.0
    early_stopping_patience: int = 0
    early_stopping_metric: str = "auc"
    early_stopping_min_delta: float = 0.0
    keep_best: bool = True
    checkpoint_full_every: int = 0
    checkpoint_dir: str = ""  # where checkpoints/ goes (a local path or an fsspec URI); "" = the run directory
    progressive_window: int = 100_000
    calibrate: bool = False

    def __post_init__(self) -> None:
        if self.early_stopping_metric not in MONITORED:
            raise ConfigError(f"train.early_stopping_metric: {self.early_stopping_metric!r} is not one of "
                              f"{', '.join(MONITORED)}")
        if self.early_stopping_patience < 0:
            raise ConfigError(f"train.early_stopping_patience must be >= 0 (0 = off), got "
                              f"{self.early_stopping_patience}")
        if self.progressive_window < 0:
            raise ConfigError(f"train.progressive_window must be >= 0 samples (0 = off), got {self.progressive_window}")
        if not 0.0 <= self.lr_warmup_fraction <= 1.0:
            raise ConfigError(f"train.lr_warmup_fraction must be in [0, 1], got {self.lr_warmup_fraction}")
        if self.checkpoint_full_every < 0:
            raise ConfigError(f"train.checkpoint_full_every must be >= 0 (0 = every checkpoint full), got "
                              f"{self.checkpoint_full_every}")

    @classmethod
    def from_train(cls, t) -> "LoopConfig":
        return cls(epochs=t.epochs, max_steps=t.max_steps, epoch_samples=t.epoch_samples, batch_size=t.batch_size,
                   eval_every=t.eval_every, log_every=t.log_every,
                   checkpoint_every=t.checkpoint_every, lr_warmup_steps=t.lr_warmup_steps,
                   lr_warmup_fraction=t.lr_warmup_fraction, early_stopping_patience=t.early_stopping_patience,
                   early_stopping_metric=t.early_stopping_metric,
                   early_stopping_min_delta=t.early_stopping_min_delta, keep_best=t.keep_best,
                   checkpoint_full_every=t.checkpoint_full_every, progressive_window=t.progressive_window,
                   checkpoint_dir=t.checkpoint_dir, calibrate=t.calibrate)


def auto_epochs(loop: LoopConfig, steps_per_epoch: int, has_eval: bool) -> int:
    """The passes of a run: ``loop.epochs``, or for ``epochs: 0`` as many as make ``epoch_samples`` samples
    at ``batch_size`` (at least one; early stopping on the eval split ends the run where the eval metric stops
    improving, the point of more than one). Without an eval split, nothing can stop the run: one pass. A
    large log (more rows than ``epoch_samples``) gets one pass, as click logs overfit from the second on
    (rare rows get memorised); a small one, of few steps per pass, the passes it needs to converge."""
    if loop.epochs:
        return loop.epochs
    if not has_eval or steps_per_epoch <= 0:
        return 1
    return max(1, math.ceil(loop.epoch_samples / (steps_per_epoch * max(loop.batch_size, 1))))


def warmup_steps(loop: LoopConfig, total_steps: int) -> int:
    """The warmup of a run of ``total_steps`` steps: ``lr_warmup_steps``, but at most ``lr_warmup_fraction`` of
    the run (rounded down, at least 1 step when warmup is on): a fixed 100-step warmup is longer than a
    whole epoch of a small data set (8,000 rows at batch 1,024 are 8 steps), which would then train at a
    fraction of its rate throughout. Depends only on the config and the run's length, so a resumed run
    warms up as the uninterrupted one."""
    if loop.lr_warmup_steps <= 0:
        return loop.lr_warmup_steps  # 0: off; negative: warm_up_lr names the error
    if total_steps <= 0:
        return loop.lr_warmup_steps
    return max(1, min(loop.lr_warmup_steps, int(loop.lr_warmup_fraction * total_steps)))


def improved(loop: LoopConfig, value: float, best: float | None) -> bool:
    """Whether an evaluation's ``value`` of the monitored metric beats ``best`` by more than the min delta
    (a NaN value never does; the first finite one always does)."""
    if value is None or not math.isfinite(value):
        return False
    if best is None:
        return True
    if MONITORED[loop.early_stopping_metric] == "max":
        return value > best + loop.early_stopping_min_delta
    return value < best - loop.early_stopping_min_delta


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


def _finite(figures: dict) -> dict:
    """An evaluation's figures for JSON (NaN -> None)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}


class _Checkpoints:
    """The loop's checkpoint writes: at most one per step, each with ``metrics.csv`` up to it (a restart from
    any checkpoint, a best one included, finds every row it resumes after), and the ``best`` pointer kept
    (rank 0 writes it)."""

    def __init__(self, run: Run, loop: LoopConfig, metrics):
        self.run, self.loop, self.metrics = run, loop, metrics
        self.saved: dict | None = None  # the run position (early-stopping state included) last written
        self.periodic: set[int] = set()
        self.base: dict | None = None  # checkpoint_full_every: the full checkpoint deltas build on (base_ref)
        self.home = checkpoint_home(run.run_dir, loop.checkpoint_dir)  # where checkpoints/ goes

    def save(self, periodic: bool = False) -> None:
        """Checkpoint the current step, unless this very position (early-stopping state included) has just
        been written: an evaluation after a checkpoint of the same step (an epoch's end) rewrites it. With
        ``checkpoint_full_every`` M: a delta against the last full checkpoint of this process while the step
        stays in its multiple of M, else a full one (``train.checkpoint``)."""
        step = self.run.state.step
        if periodic:
            self.periodic.add(step)
        position = self.run.state.position()
        if position != self.saved:
            full_every, base = self.loop.checkpoint_full_every, self.base
            if full_every and base is not None and base["base_step"] != step and \
                    step // full_every == base["base_step"] // full_every:
                save_checkpoint(self.run, base=base, before_publish=self.metrics.write, home=self.home)
            else:
                d = save_checkpoint(self.run, track=bool(full_every), before_publish=self.metrics.write, home=self.home)
                self.base = base_ref(d) if full_every else None
            self.saved = position

    def new_best(self, previous: int) -> None:
        """The run's state has just become the best (``state.best_step`` is this step): checkpoint it, point
        ``best`` at it, and remove the previous best's directory unless it is a periodic checkpoint."""
        run = self.run
        self.save()
        if run.rank == 0:
            st = run.state
            write_best(self.home, st.step)
            old = step_dir(self.home, previous)
            if 0 <= previous < st.step and previous not in self.periodic and \
                    (not self.loop.checkpoint_every or previous % self.loop.checkpoint_every) and old.is_dir() \
                    and old.name != (self.base or {}).get("base") and old.name not in bases_in_use(self.home):
                remove_tree(old)
        run.barrier()


def _evaluated(run: Run, loop: LoopConfig, ckpts: _Checkpoints, figures: dict) -> None:
    """Record an evaluation at the current step and do the early-stopping bookkeeping (every rank: the
    figures are the same on all of them, so they decide alike)."""
    st = run.state
    st.eval_step, st.eval = st.step, _finite(figures)
    # the figures are of the raw logits (evaluate_now); the map fitted on them is set before any checkpoint of
    # this step is written, and the recorded figures become what the model now predicts
    if (loop.calibrate and getattr(run, "model", None) is not None and "beta_scale" in figures
            and calibrate_logits(run.model, figures["beta_scale"], figures["beta_shift"], figures["beta_tail"])):
        st.eval.update({k: st.eval[f"beta_{k}"] for k in ("logloss", "ne", "calibration")})
    value = st.eval.get(loop.early_stopping_metric)
    if improved(loop, value, st.best_value):
        previous = st.best_step
        st.best_step, st.best_value, st.bad_evals = st.step, float(value), 0
        st.best = {k: st.eval[k] for k in ("logloss", "auc", "ne", "calibration", "samples") if k in st.eval}
        if loop.keep_best:
            ckpts.new_best(previous)
    else:
        st.bad_evals += 1
        if loop.early_stopping_patience and st.bad_evals >= loop.early_stopping_patience:
            st.stopped = True


def _nan(v) -> float:
    return math.nan if v is None else v


def progressive_figures(run: Run, pv: ProgressiveWindow) -> dict:
    """The progressive window's figures over every rank's slices (collective on N ranks: all of them call it):
    ``data.metrics.binary_metrics`` of the window's pre-update logits."""
    z, y, w = pv.arrays()
    if run.world > 1:  # every rank's slices of the same batches (order-free figures), as evaluation gathers them
        cols = [z, y] + ([w] if w is not None else [])
        local = torch.from_numpy(np.stack(cols, 1) if len(z) else np.zeros((0, len(cols))))
        both = torch.cat(all_gather_var(local)).numpy()
        z, y, w = both[:, 0], both[:, 1], (both[:, 2] if w is not None else None)
    if not len(z):
        return {}
    if w is not None and not w.sum() > 0:  # a window of weight 0 (weighted data) has no figures, not an error
        return {"logloss": math.nan, "auc": math.nan, "ne": math.nan, "calibration": math.nan, "samples": len(z)}
    return binary_metrics(y, z, w)


_END = object()


class StepTimes:
    """The train steps' wall times of this attempt, for the steady-state figures of the summary.

    ``train_samples_per_s`` divides every sample by every step's time, the first steps' too, which pay for the
    first touch of the tables' rows and optimizer state, caches filling and the host pipeline starting; a short
    run's figure is mostly that. The steady state is the median step after the first ``WARMUP`` steps (or the
    first third of a shorter run), as benchmarks of the field report it (TorchRec's and FBGEMM's benchmarks drop
    warm-up iterations too); the p90 says how much the steps spread. The last ``KEEP`` steps are kept (a long
    run's memory stays bounded)."""

    WARMUP = 10
    KEEP = 100_000

    def __init__(self) -> None:
        self.seen = 0
        self.times: collections.deque[float] = collections.deque(maxlen=self.KEEP)

    def add(self, seconds: float) -> None:
        self.seen += 1
        self.times.append(float(seconds))

    def figures(self) -> dict:
        """``{"median", "p90", "mean", "steps", "skipped"}`` over the steps after the warm-up (NaN without steps);
        ``skipped`` counts the steps left out at the start."""
        kept = list(self.times)
        skip = min(self.WARMUP, self.seen // 3)
        skip_here = max(0, skip - (self.seen - len(kept)))
        kept = kept[skip_here:]
        if not kept:
            return {"median": math.nan, "p90": math.nan, "mean": math.nan, "steps": 0, "skipped": skip}
        a = np.asarray(kept)
        return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "mean": float(a.mean()),
                "steps": int(a.size), "skipped": skip}


def _with_next(batches: Iterable) -> Iterator[tuple[Any, Any]]:
    """``(batch, the batch after it or None)`` for every batch: the loop hands the next step's batch to a run
    that converts its input ahead (``Run.prefetch_batch``). A loader that can ``peek`` (a host pipeline's, with
    lookahead) hands the next batch over without handing it out: its pipeline attaches one batch at a time."""
    if getattr(batches, "lookahead", False):
        for cur in batches:
            yield cur, batches.peek()
        return
    it = iter(batches)
    cur = next(it, _END)
    while cur is not _END:
        nxt = next(it, _END)
        yield cur, (None if nxt is _END else nxt)
        cur = nxt


class _Attempt:
    """What the loop keeps of this attempt beside the run's ``RunState``: the metrics log, the checkpoint writes,
    the progressive window, the progress bar, the train steps' times and samples, and the loss window of the
    next logged row. Every step goes through :meth:`stepped`."""

    def __init__(self, run: Run, loop: LoopConfig, total: int):
        st = run.state
        self.run, self.loop = run, loop
        self.metrics = MetricsLog(run.run_dir, enabled=run.rank == 0)
        self.metrics.restart(st.step)
        self.ckpts = _Checkpoints(run, loop, self.metrics)
        self.pv = ProgressiveWindow(loop.progressive_window) if loop.progressive_window else None
        self.pv_last: dict = {}
        self.bar = tqdm(total=total or None, initial=st.step, desc="train" if run.world == 1 else f"train x{run.world}",
                        unit="step", disable=not run.progress, file=sys.stderr, dynamic_ncols=True)
        self.t_start = time.perf_counter()
        self.train_s, self.trained = 0.0, 0
        self.step_times = StepTimes()
        self.window: list[float] = []
        self.window_samples, self.t_window = 0, self.t_start

    def evaluate_now(self) -> None:
        """Score the eval split at the current step (once per step) and do the early-stopping bookkeeping."""
        run, st = self.run, self.run.state
        if st.eval_step == st.step:  # scored at this very step already (in this attempt or the restored one)
            return
        with uncalibrated(getattr(run, "model", None)):  # the map is fitted on the raw logits (_evaluated)
            figures = run.evaluate()
        m = figures
        self.metrics.log_eval(st.step, st.epoch, st.samples, m["logloss"], m["auc"], time.perf_counter() - self.t_start,
                              ne=m.get("ne", math.nan), calibration=m.get("calibration", math.nan))
        _evaluated(run, self.loop, self.ckpts, figures)

    def stepped(self, batch, loss: float, seconds: float, stream: bool) -> None:
        """A train step of ``seconds`` on ``batch`` is done: the position, losses, times and progressive window;
        then the metrics row, evaluation and checkpoint due at this step."""
        run, loop, st = self.run, self.loop, self.run.state
        self.train_s += seconds
        self.step_times.add(seconds)
        n = batch.global_size or batch.batch_size
        logits = getattr(run, "step_logits", None)  # optional in the protocol: a run without it has no pv
        if self.pv is not None and logits is not None:
            self.pv.add(logits, batch.labels, batch.weights, n, epoch=st.epoch)
        if stream:
            st.stream = dict(batch.stream_position)
        self.trained += n
        self.window_samples += n
        st.step += 1
        st.batch_in_epoch += 1
        st.samples += n
        st.losses.append(loss)
        self.window.append(loss)
        self.bar.update(1)
        if loop.log_every and st.step % loop.log_every == 0:
            self.log_row()
        if loop.eval_every and st.step % loop.eval_every == 0 and run.eval_loader is not None:
            self.evaluate_now()
        if loop.checkpoint_every and st.step % loop.checkpoint_every == 0:
            self.ckpts.save(periodic=True)

    def log_row(self) -> None:
        """The metrics row of the steps since the last one: mean loss, samples/s, the progressive window's figures."""
        st = self.run.state
        now = time.perf_counter()
        sps = self.window_samples / max(now - self.t_window, 1e-9)
        mean = float(np.mean(self.window))
        self.bar.set_postfix(loss=f"{mean:.4f}", sps=f"{sps:,.0f}")
        row = MetricRow(st.step, st.epoch, st.samples, mean, samples_per_s=sps, seconds=now - self.t_start)
        if self.pv is not None:
            self.pv_last = progressive_figures(self.run, self.pv)
            if self.pv_last:
                row.pv_logloss, row.pv_auc, row.pv_ne = self.pv_last["logloss"], self.pv_last["auc"], self.pv_last["ne"]
                row.pv_samples = self.pv_last["samples"]
        self.metrics.log(row)
        self.window, self.window_samples, self.t_window = [], 0, now


def fit(run: Run, loop: LoopConfig, *, fault_step: int | None = None, title: str = "",
        ceiling_auc: float = math.nan, extra: dict | None = None) -> dict | None:
    """Train ``run`` from its current position to the end (``loop.epochs`` or ``loop.max_steps``, or an early
    stop); return the summary on rank 0 (``None`` on the others). ``fault_step``: this rank dies at that step
    (tests). ``extra`` goes into the summary.

    Early stopping and the best checkpoint live here, for every kind of run: after each evaluation the
    monitored metric (``loop.early_stopping_metric``) is compared with the best so far; an improvement is
    checkpointed and ``checkpoints/best`` points at it; ``early_stopping_patience`` evaluations in a row
    without one stop the run. The state is the run's (``RunState``: in every checkpoint's manifest), so a
    resumed run makes the same decisions. The summary reports the last evaluation (``eval_*``) and the
    best (``best``)."""
    st = run.state
    stream = isinstance(run.train_loader, StreamLoader)  # one pass to its end condition, resumed by position
    per_epoch = 0 if stream else len(run.train_loader)
    epochs = auto_epochs(loop, per_epoch, run.eval_loader is not None)
    total = loop.max_steps or epochs * per_epoch
    # the warmup of an open-ended run (epochs: 0) is measured against its first pass, not its bound
    warmup = warmup_steps(loop, loop.max_steps or (per_epoch if not loop.epochs else total))
    at = _Attempt(run, loop, total)
    done = lambda: st.stopped or (bool(loop.max_steps) and st.step >= loop.max_steps)  # noqa: E731
    while st.epoch < epochs and not done():
        if not _train_pass(run, loop, at, warmup, stream, done, fault_step):
            break  # stopped within the pass
        st.epoch += 1
        st.batch_in_epoch = 0
        if stream:  # the stream ended (its END marker or idle): one pass, whatever loop.epochs says
            st.epoch = max(st.epoch, epochs)
            break
        if epochs > 1 and st.epoch < epochs and run.eval_loader is not None and not done():
            at.evaluate_now()  # an epoch's end: where a small data set can next stop early
    at.bar.close()
    if run.eval_loader is not None:
        at.evaluate_now()  # the last model's figures (once per step)
    final = {k: _nan(v) for k, v in st.eval.items()} if st.eval_step == st.step else {}
    at.ckpts.save()
    if at.pv is not None and at.pv.batches:
        at.pv_last = progressive_figures(run, at.pv)  # the window at the end (collective for N ranks)
    figures = run.figures()  # every rank calls it (collective for N ranks)
    if run.rank != 0:
        return None
    at.metrics.write()
    summary = _summary(run, loop, at, final, warmup, stream, {**(extra or {}), **figures})
    _write_results(run, at.metrics, summary, title, ceiling_auc)
    return summary


def _train_pass(run: Run, loop: LoopConfig, at: _Attempt, warmup: int, stream: bool, done, fault_step) -> bool:
    """One pass over the training data from the run's position (a stream: to its end condition); ``False`` when
    the run stopped within it (``done()``: ``max_steps`` or an early stop)."""
    st = run.state
    if stream:
        run.train_loader.seek(st.stream)
    else:
        run.train_loader.set_epoch(st.epoch, skip_batches=st.batch_in_epoch)
    # the next batch is read a step early only for a run that asks for it (a loader may act as it yields,
    # e.g. a reference mapping ids); never from a stream, whose next batch may be minutes away
    # the next batch is read a step early only for a run that asks for it (a loader may act as it yields,
    # e.g. a reference mapping ids); from a stream too: a step then starts once the batch after it is read (the
    # stream's own read-ahead usually holds it; its last batch waits for the stream's end)
    ahead = getattr(run, "prefetch_batch", None) if getattr(run, "input_pipeline", False) else None
    batches = _with_next(run.train_loader) if ahead is not None else ((b, None) for b in run.train_loader)
    for batch, upcoming in batches:
        if ahead is not None and upcoming is not None and not (loop.max_steps and st.step + 1 >= loop.max_steps):
            ahead(upcoming)
        if fault_step is not None and st.step == fault_step:
            inject_fault(os.environ.get("EMBEDSCALE_FAULT", "kill"))
        s0 = time.perf_counter()
        warm_up_lr(run.opt, st.step, warmup)
        try:
            loss = run.train_step(batch)
        except RuntimeError as e:
            raise run.step_error(e) from e
        at.stepped(batch, loss, time.perf_counter() - s0, stream)
        if done():
            return False
    return True


def _summary(run: Run, loop: LoopConfig, at: _Attempt, final: dict, warmup: int, stream: bool, extra: dict) -> dict:
    """The run's summary (rank 0): position, throughput and steady step times, the last evaluation (``final``)
    and the best, early stopping, the progressive window, the stream's or the shards' reading, and ``extra``."""
    st = run.state
    last = st.losses[-max(loop.log_every, 1):]
    best = {}
    if st.best_step >= 0:
        best = {"step": st.best_step, "metric": loop.early_stopping_metric, "value": st.best_value,
                **{f"eval_{k}": v for k, v in st.best.items() if k != "samples"},
                **({"checkpoint": str(best_pointer(at.ckpts.home))} if loop.keep_best else {})}
    summary = {
        "world_size": run.world, "steps": st.step, "samples": st.samples,
        "train_samples_per_s": at.trained / at.train_s if at.train_s else math.nan,
        "train_step_seconds": at.step_times.figures(),
        "train_logloss": float(np.mean(last)) if last else math.nan,
        "eval_logloss": final.get("logloss", math.nan), "eval_auc": final.get("auc", math.nan),
        "eval_ne": final.get("ne", math.nan), "eval_calibration": final.get("calibration", math.nan),
        "eval_samples": final.get("samples", 0), "best": best, "stopped_early": st.stopped,
        "early_stopping": {"metric": loop.early_stopping_metric, "patience": loop.early_stopping_patience,
                           "min_delta": loop.early_stopping_min_delta, "bad_evals": st.bad_evals},
        "lr_warmup_steps": warmup, "run_dir": str(run.run_dir), **extra,
    }
    if at.pv_last:
        # epochs (1-based) of the window's batches: in epoch 1 every sample is scored before any training on it;
        # from epoch 2 on, earlier epochs trained on it
        first, last = at.pv.epochs()
        summary["progressive"] = {"window": loop.progressive_window, "epochs": [first + 1, last + 1],
                                  **{k: at.pv_last[k] for k in ("auc", "logloss", "ne", "calibration", "samples")}}
    if stream:
        src = run.train_loader
        summary["stream"] = {"position": dict(st.stream), "end": src.end_reason, "shards_read": src.shards_read,
                             "directory": str(src.directory)}
    elif hasattr(run.train_loader, "bytes_read"):  # rank 0's share of the shards, read in its last pass
        summary["data_bytes_read"] = {"rank": 0, "last_pass": int(run.train_loader.bytes_read)}
    return summary


def _write_results(run: Run, metrics: MetricsLog, summary: dict, title: str, ceiling_auc: float) -> None:
    """Rank 0's results beside ``metrics.csv``: ``curves.png`` (and ``replans.png`` after live re-plans, earlier
    attempts' included) and ``summary.json``."""
    replans = read_replans(run.run_dir)  # live re-plans (train.replan), earlier attempts' included
    plot_curves(metrics.rows, run.run_dir / "curves.png", title=title, ceiling_auc=ceiling_auc,
                replan_steps=[int(r["step"]) for r in replans])
    if replans:
        plot_replans(replans, run.run_dir / "replans.png", title=title)
    atomic_write_json(run.run_dir / "summary.json", summary)


__all__ = ["LoopConfig", "MONITORED", "auto_epochs", "fit", "improved", "inject_fault", "warm_up_lr", "warmup_steps"]
