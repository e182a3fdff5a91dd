"""The drift monitor of an N-rank run: live re-planning and row migration between two steps (OPER section 4).

OPER plans once from a profile of the whole dataset (section 3) and names re-planning under input drift as
future work (section 8). With ``train.replan_every`` N > 0 a ``DistributedRun`` keeps a
:class:`~embedscale.data.rolling_profile.RollingProfile` of the rows its batches read (each rank its own
slice, decayed with a half-life of N steps) and, before the step that follows every N-th, checks its plan:

1. the ranks' profiles are summed (one ``all_reduce``); rank 0 costs the running plan on the summed profile
   with the section 3.2 model (``plan.drift``): while its bottleneck cost (``max_rank_cost``) is within
   ``train.replan_min_gain`` of its cost on the profile it was made for and its degrees of balance stay at
   0.9 or more, the plan is kept without further search (with ``replan_min_gain`` 0 every check plans);
   else rank 0 makes a fresh plan (the run's strategy, ``oper`` for hand-made or ``auto`` plans) and the
   incremental one (``plan.incremental``: the running placement, the fresh plan's replicas, the fewest row
   moves that balance the lookups), for the run's topology and per-rank batch, and takes the incremental
   plan when its predicted bottleneck is within 2% of the fresh plan's (a plan from scratch re-sorts every
   row by the new counts: it moved half of every table on 2 ranks, benchmarks/bench_online.py);
2. when the plan taken lowers the predicted bottleneck by more than ``train.replan_min_gain`` (default
   5%), or a degree of balance fell below 0.9, and (``train.replan_weigh_costs``, the default) the step seconds
   it saves over the steps to the next check outweigh the check's measured seconds and the migration's predicted
   ones (:func:`replan_pays`; the model's gain taken as its share of the modelled bottleneck times the run's
   measured step, :func:`gain_seconds`; else the check is counted in the summary's ``replans_declined``), every rank loads
   that plan (rank 0 saves it:
   ``<run dir>/replans/step-N/`` and the run's ``plan/``, so a resume continues under it; the plan it leaves in
   ``replans/step-N/before/``, so a resume from a checkpoint at or before step N starts under that one:
   :func:`resume_plan`) and moves the
   rows and their row-wise optimizer state onto it (:func:`move_to_plan`: one all-to-all; in place, the
   running module's map edited and only what moves written, ``embedding.migrate.migrate_in_place``);
3. each re-plan is one row of ``<run dir>/replans.csv`` (:data:`COLUMNS`: the step, the reason, rows and
   bytes moved summed over the ranks (and ``rows_written``: storage rows written, received or moved locally;
   ``in_place``: 1 when the running module moved in place, 0 when the plan's module was built and filled),
   the slowest rank's seconds (all of its pause; the check: profile sum and wait for the verdict; the
   migration: edit, move, swap; ``plan_seconds``: rank 0's check in its thread; ``checked_at``: the check's
   step), the predicted gain and the max / mean
   per-rank cost of the running and of the new plan on the profile) and of the summary's ``replans``.

Rank 0 plans beside training (``train.replan_lag`` L, 0 <= L <= N): the profiles' sum starts at the check's
step N (every rank, one ``all_reduce``; with L > 0 it completes beside the next step), rank 0 runs the check of step 1 and the weighing of step 2 in a thread
(:meth:`DriftMonitor._decide`: plain CPU work on the summed profile and the running plan, no tensor of the run)
while every rank trains on; at step M = N + L the verdict is taken if the check is done, else
:data:`NOT_READY`, and every rank asks again one monitoring period later (M = N + L + kN, no new check started
meanwhile): no rank waits for a plan. With L > 0 on N ranks the verdict travels on its own gloo group: the other
ranks post its receive at step N, rank 0's check thread sends it (published first) as soon as it is done, so at M
they take a message already there instead of meeting rank 0 in a broadcast (rank 0 sends :data:`NOT_READY` at M
itself when its check still runs); a verdict step past the run's known end is not posted (nothing in flight). The re-plan (``replans/step-M/``) happens between step M and M+1, after
the loop's checkpoint of step M (written under the old plan, restorable under any), and the run continues
exactly as one restarted from that checkpoint with the new plan (tests/test_migrate.py,
tests/test_replan_lag.py). M is N + L unless the check outlasts L steps (then the migration step depends on
timing; the input pipeline holds back the batches around each verdict step a check in flight may take, and
around the next check's: :meth:`DriftMonitor.may_migrate_before`); with L = 0 the other ranks wait for the
check (M = N). A check that kept the plan (the plan holds, no plan could pay for the check:
:meth:`DriftMonitor._cannot_pay`, or the plan it searched did not pay) doubles the periods to the next one, up to :data:`MAX_QUIET_PERIODS` (rank 0
sends them with the verdict; at once when not even a plan that removed the whole measured step could pay): on a
stream where balance does not pay the checks become rare. While they are spaced out, a drift alarm watches the
reads (:meth:`DriftMonitor._judge_alarm`): at the first batch of every :data:`ALARM_PERIODS`-th monitoring period
every rank decodes a sample of its values to the ranks that serve them under the running map
(``ShardedEmbedding.read_ranks``, a few thousand values), the W x W counts are summed over the ranks beside the
next period (one small ``all_reduce``), and when the busiest owner's lookups or the busiest rank's transfers
(:func:`alarm_stats`) rose by ``replan_min_gain`` (at least 5%) over their level at the last check (the batch
before it, sampled the same way), the next check comes :data:`QUIET_OBSERVE_PERIODS` periods later (its profile
counted in them) instead of up to :data:`MAX_QUIET_PERIODS`.
Before it plans, the check bounds the gain of any plan (:meth:`DriftMonitor._cannot_pay`: the running
bottleneck less the ranks' mean lookup, which no placement changes) and keeps the plan without the search when
even that bound does not pay for the last planning's seconds. A checkpoint taken inside the window (steps
N+1..M) waits for the verdict first (:meth:`DriftMonitor.settle`), which is on disk with its check step in the
plan's meta, so a resume from it takes that verdict at M (:func:`resume_plan`).
Each rank's rolling profile is in its rank file of every full checkpoint
(:data:`CHECKPOINT_KEY`) and restored on resume (:meth:`DriftMonitor.restore`: the same world size bit for
bit, another one as the same sum), with the checks' spacing (:data:`SPACING_KEY`, rank 0's, on every rank), so a
run resumed from a full checkpoint checks, counts and re-plans as the uninterrupted one; a delta checkpoint carries
none and a resume from it takes its base's (a lag of the steps between them).
A counted batch's ids are checked against their own tables (:meth:`DriftMonitor._flat_ids`: one ``aminmax`` when
they all fit the smallest table) and held; the profile adds the held batches (an ``index_add_`` each) over every
table's rows laid end to end when the check reads it (``RollingProfile.update_flat``, ``defer``). A batch not
counted touches no tensor (its decay is kept in the profile's scale). With ``train.replan_count_every`` k > 1 a
batch of the counting periods is counted with probability 1/k and weight k (:func:`counted_step`: the same expected
counts).
Forms are kept (the fresh plan places the same sharded tables; TT and host tables stay as they are).
Not supported yet: host-placed tables beside the sharded ones (their pipeline holds the device module).
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import sys
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from embedscale.comm.hierarchical import link_topology
from embedscale.device import HOST
from embedscale.data.rolling_profile import RollingProfile
from embedscale.embedding.address_map import address_map_from_plan
from embedscale.models.builder import build_sharded
from embedscale.embedding.migrate import Placement, migrate, migrate_in_place
from embedscale.embedding.pgas_lookup import HeapTooSmall
from embedscale.errors import ConfigError, EmbedscaleError, InputError
from embedscale.io import atomic_write_text
from embedscale.plan.cost import evaluate
from embedscale.plan.drift import drift_and_plan, rows_moved
from embedscale.plan.incremental import incremental_plan
from embedscale.plan.plan import ORDER_NPY, PARTS_NPZ, PLAN_JSON, Plan
from embedscale.specs import Topology
from embedscale.train.checkpoint import ROLLING_PROFILE

REPLANS_CSV = "replans.csv"
CHECKPOINT_KEY = ROLLING_PROFILE  # a full checkpoint's rank file entry: that rank's profile (DriftMonitor.state_dict)
PGAS_REPLAN_SPARE = 0.25  # a PGAS run that re-plans: heap room for a quarter more storage rows (in-place migration)
DOB_FLOOR = 0.9  # plan.drift's default dob_floor: a balance below it asks for a re-plan
INCREMENTAL_SLACK = 0.02  # the incremental plan's bottleneck may exceed the fresh plan's by this much
BEFORE = "before"  # replans/step-N/before/: the plan the run left at step N (resume_plan)
KEPT = "kept"  # replans/step-N/kept: the last check for step N kept the plan (an earlier attempt's re-plan void)
STAGED = "check-"  # replans/check-N/: the plan rank 0's check of step N made, before its verdict step is known
NOT_READY = 2  # the verdict broadcast when the check still runs: taken one monitoring period later
SPACING_KEY = "spacing"  # DriftMonitor.state_dict: the checks' spacing (DriftMonitor._spacing)
MAX_QUIET_PERIODS = 16  # checks that cannot pay space out to one in this many monitoring periods (at most)
# while checks are spaced out, batches are counted only in this many periods before the next check (an older
# batch weighs a quarter or less at it: the profile's half-life is one period); the others only decay it
QUIET_OBSERVE_PERIODS = 2
# and those of the earlier of the two (weighing a half to a quarter at the check) with probability 1 / this, weighted
# by it (counted_step: the same expected counts)
QUIET_COUNT_EVERY = 4

# the drift alarm while the checks are spaced out (DriftMonitor._alarm_sample): every ALARM_PERIODS monitoring periods
# each rank decodes a strided sample of about ALARM_VALUES values of one batch to the ranks that serve them
# (ShardedEmbedding.read_ranks). A sample every period cost the 2-rank stream of 10 ms steps where no re-plan pays
# 1.3% of its CPU (bench_online.py); every third period, a drift is still seen within about six periods, not 16
ALARM_PERIODS = 3
ALARM_VALUES = 8192
ALARM_MIN_VALUES = 4096  # a period's samples, summed over the ranks, are judged only when they hold this many values
ALARM_KEY = "alarm"  # DriftMonitor.state_dict: a sampled period's reads, reduced over the ranks, not yet judged
# the kinds of the alarm's samples: a spaced-out period's (judged against the base), the last batch before a check (the
# base: the reads the check's profile ends with), one void (its check re-planned: its reads are the old plan's)
ALARM_PERIOD, ALARM_BASE, ALARM_VOID = 0, 1, 2

# the interpreter's switch interval while a check runs beside training (default 5 ms): a step's thread waits at most
# this long for the GIL the check's Python holds (the check runs slower by a few switches)
CHECK_SWITCH_S = 0.0005
STEP_TIMES_KEPT = 32  # the measured steps (their median) a check's model gains are calibrated on (gain_seconds)
_CHECK_DELAY_S = 0.0  # a test hook: seconds every check sleeps first (a slow check)
COLUMNS = ["step", "reason", "gain", "rows_moved", "bytes", "seconds", "check_seconds", "migrate_seconds",
           "replicas_added", "replicas_dropped", "balance_before", "balance_after", "strategy", "rows_written",
           "in_place", "checked_at", "plan_seconds"]


def counted_step(seed: int, step: int, every: int) -> bool:
    """Whether the drift monitor counts the batch of ``step`` under ``train.replan_count_every`` = ``every``: a
    draw with probability ``1 / every`` from a 64-bit mix (splitmix64) of ``seed`` and ``step``, the same on every
    rank and in a resumed run. A counted batch weighs ``every``, so the expected rolling count is the full one;
    its variance, per row, is ``(every - 1) * sum_s (decay^(T - s) * n_s)^2`` (independent draws per step)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z % every == 0



def alarm_stats(reads) -> tuple[float, float]:
    """The two figures the drift alarm follows, from ``reads[i][o]``: the sampled values rank ``i`` reads from
    rank ``o`` (a replica read on the rank that reads it). Both are in units of the ranks' mean lookups
    ``m = sum(reads) / W``, the terms of OPER's bottleneck cost (section 3.2) a placement changes:

        lookups   = max_o sum_i reads[i][o] / m                  (the busiest owner's lookups)
        transfers = max_r (sum_{o != r} reads[r][o] + sum_{i != r} reads[i][r]) / m   (its rows sent and received)
    """
    r = [[float(x) for x in row] for row in reads]  # W x W: plain Python, a few microseconds at any real W
    served = [sum(col) for col in zip(*r)]
    m = sum(served) / len(r)
    if m <= 0:
        return 0.0, 0.0
    moved = [sum(r[i]) - r[i][i] + served[i] - r[i][i] for i in range(len(r))]
    return max(served) / m, max(moved) / m


def alarm_fires(stats: tuple[float, float], base: tuple[float, float], rise: float) -> bool:
    """Whether a period's :func:`alarm_stats` ``stats`` rose past those measured after the last check (``base``):
    either figure ``s`` above ``b + rise * max(b, 1)`` (a rise of ``rise`` of itself, or of the mean lookups when
    it was below them: a plan that read every row locally alarms when ``rise`` of the lookups go remote)."""
    return any(s > b + rise * max(b, 1.0) for s, b in zip(stats, base))


def replan_pays(gain_per_step_s: float, steps_to_next_check: int, check_s: float, migrate_s: float) -> bool:
    """Whether a re-plan pays for itself before the monitor looks again:

        gain_per_step_s * steps_to_next_check > check_s + migrate_s

    ``gain_per_step_s``: the step seconds the new plan saves on the bottleneck rank by the cost model (OPER
    section 3.2: the running plan's ``max_rank_cost`` on the current profile less the new plan's);
    ``steps_to_next_check``: the steps it runs before the next check could change it again (the monitoring
    period, or the steps the run has left if fewer); ``check_s``: the check's measured seconds (the profiles'
    sum and the plans, while the other ranks wait); ``migrate_s``: the migration's (:func:`migration_seconds`).
    The gain beyond the next check is not counted: that check weighs the plan afresh."""
    return gain_per_step_s * max(0, int(steps_to_next_check)) > check_s + migrate_s


def gain_seconds(cost_us: float, running_us: float, step_s: float | None) -> float:
    """A cost-model figure (``plan.cost``: microseconds a step of its default links) in the run's measured seconds:
    its share of the running plan's modelled bottleneck (``running_us``, the model's step) times the measured step
    ``step_s`` (the median of the run's last :data:`STEP_TIMES_KEPT` steps, the monitor's own pause excluded).
    Without a measured step, the model's microseconds as seconds. The whole measured step is taken to scale with
    the bottleneck (the dense arches and the optimizer do not shrink with a placement), so the calibrated gain
    is an upper bound: the monitor errs toward re-planning, while the costs it is weighed against are measured."""
    if step_s is not None and step_s > 0 and running_us > 0:
        return float(cost_us) / float(running_us) * float(step_s)
    return float(cost_us) * 1e-6


def migration_seconds(bytes_moved: float, link_gbs: float, measured: tuple[float, float] | None = None) -> float:
    """The predicted seconds of a migration that moves ``bytes_moved`` (rows and their row-wise optimizer state,
    summed over the ranks): the run's last migration's seconds per byte when one was measured (``measured``:
    its seconds and bytes), else one all-to-all of those bytes at ``link_gbs`` GB/s, each byte sent and written
    once (2 bytes' worth of link time)."""
    if measured is not None and measured[1] > 0:
        return float(measured[0]) * float(bytes_moved) / float(measured[1])
    return 2.0 * float(bytes_moved) / (float(link_gbs) * 1e9)


def record_fields(report: dict) -> dict:
    """The figures of a check's report that go into its ``replans.csv`` row (kept in the new plan's meta, so a
    run resumed between the check and the migration records the same row)."""
    return {"reason": report["reason"], "gain": round(float(report["replan_gain"]), 6),
            "balance_before": round(float(report["after"]["balance"]), 6),
            "balance_after": round(float(report["replanned"]["balance"]), 6),
            "strategy": report["replan_strategy"]}


@dataclass
class PendingCheck:
    """A check started at step ``step`` whose verdict is taken at ``apply_at`` (``step + replan_lag``)."""
    step: int
    apply_at: int
    begin_s: float = 0.0  # this rank's seconds at the check's step (the profiles' sum)
    thread: threading.Thread | None = None  # rank 0: the check beside training
    verdict: int = 0  # rank 0, once decided: 1 re-plan, 0 keep, -1 failed
    report: dict | None = None
    error: BaseException | None = None
    check_s: float = 0.0  # rank 0: the check's seconds (in its thread)
    known: int | None = None  # every rank: the verdict restored from replans/ (resume_plan), no broadcast
    known_quiet: int = 1  # with ``known``: the periods to the next check it sets (a kept verdict's, restored)
    known_streak: int | None = None  # with ``known``: rank 0's streak after it (None: 0 after a re-plan)
    flag: torch.Tensor | None = None  # the verdict's message (:meth:`DriftMonitor._send`): [verdict, periods]
    work: object = None  # its broadcast: rank 0's send of the verdict, the others' receive (posted ahead)
    posted: bool = False  # the verdict travels on the verdicts' group, sent when ready (DriftMonitor._send)
    sent: int = 0  # rank 0: the periods to the next check its check thread sent with its verdict (0: not sent)
    total: object = None  # the profiles' sum (RollingProfile), or the function that waits for it
    switch_s: float | None = None  # rank 0: the interpreter's switch interval before the check's thread
    run_dir: object = None  # rank 0: where the verdict goes (:meth:`DriftMonitor._publish`)
    published: bool = False  # rank 0: the verdict is on disk under replans/step-<apply_at>
    deferred: int = 0  # the apply steps this check was not ready at (each one monitoring period later)
    searched: bool = True  # rank 0: the check made a fresh plan (else the running one held, or none could pay)
    idle: bool = False  # rank 0: not even a plan that removed the whole measured step could pay (_cannot_pay)


class CheckJob:
    """Rank 0: a check handed to the monitor's check thread (:meth:`DriftMonitor._checker`), awaited as a thread is
    (``is_alive``, ``join``)."""

    def __init__(self):
        self._done = threading.Event()

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)


class DriftMonitor:
    """One rank's drift monitor (module docstring): ``observe`` every batch, ``maybe_replan`` before each step."""

    def __init__(self, run, every: int, min_gain: float, lag: int = 0, count_every: int = 1, seed: int = 0):
        if run.host_embedding is not None:
            raise ConfigError("train.replan_every: live re-planning of a run with host-placed tables is not "
                              "supported yet; set train.replan_every 0")
        self.every, self.min_gain = int(every), float(min_gain)
        self.decay = 0.5 ** (1.0 / self.every)  # an access weighs half after one monitoring period
        self.profile = RollingProfile({t.name: t.num_rows for t in run.tables}, decay=self.decay, device=run.device)
        self._features = {t.name: list(t.features) for t in run.tables}
        self._flat_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # _flat_ids: by keys and lengths
        self.records: list[dict] = []
        self.checks = 0
        self.declined = 0  # checks whose re-plan did not pay for itself (replan_pays)
        self.check_seconds: list[float] = []  # this rank's pause at every check (profile sum, wait for the verdict)
        self._checked_at = -1
        self.lag = int(lag)  # train.replan_lag: the check of step N is taken at N + lag
        if not 0 <= self.lag <= self.every:  # one check in flight at a time
            raise ConfigError(f"train.replan_lag {self.lag}: the steps a check plans beside training must be at "
                              f"least 0 and at most train.replan_every ({self.every})")
        self._pending: PendingCheck | None = None  # the check started and not yet taken
        self.deferred = 0  # verdict steps a check was not ready at (NOT_READY: taken a period later)
        self._quiet_until = 0  # no check starts before this step (checks that cannot pay space out)
        self._step = 0  # the step maybe_replan saw last (the batch observe counts)
        self._quiet_streak = 0  # rank 0: the checks in a row that no plan could pay for
        self.pause_parts: list[tuple[int, str, float]] = []  # (step, part, seconds) of this rank's pauses
        # rank 0: the last planning's seconds (_cannot_pay); before the first check, the running plan's own
        plan_s = getattr(run, "plan", None) and run.plan.meta.get("plan_seconds")
        self.plan_seconds: float | None = float(plan_s) if plan_s else None
        if int(count_every) < 1:
            raise ConfigError(f"train.replan_count_every {count_every}: must be at least 1")
        self.count_every, self._seed = int(count_every), int(seed)  # sampled counting (:func:`counted_step`)
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)  # the run's measured steps (stepped)
        self._step_s: float | None = None  # rank 0: the measured step a check's gains are calibrated on
        self._lock = threading.Lock()  # rank 0: the verdict's message is sent once, by the check or at its step
        # lag > 0 on N ranks: the verdicts' own gloo group; rank 0's check thread sends the verdict as soon as it is
        # done and the other ranks take it, long arrived, at the verdict step (_send, _take_verdict)
        self._verdicts = None
        self._jobs: "queue.SimpleQueue | None" = None  # rank 0: the check thread's queue (_checker)
        # the drift alarm while the checks are spaced out (_alarm_sample, _judge_alarm): a sampled period's reads in
        # flight (the step it is judged at, the W x W reads, their all_reduce), the figures after the last check
        self._alarm: tuple[int, int, torch.Tensor, object] | None = None  # (judged at, kind, reads, all_reduce)
        self._alarm_base: tuple[float, float] | None = None
        self.alarms = 0  # the alarms that brought a check forward
        self._group = getattr(run, "monitor_group", None)
        self._rank, self._world = int(getattr(run, "rank", 0)), int(getattr(run, "world", 1))
        if self.lag and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            timeout = timedelta(seconds=float(getattr(getattr(run, "cfg", None) and run.cfg.dist, "timeout_s", 1800)))
            self._verdicts = dist.new_group(backend="gloo", timeout=timeout)
        if self.lag and getattr(run, "rank", None) == 0:
            self._checker()  # the check thread, started before the first check

    def may_migrate_before(self, step: int) -> bool:
        """Whether a re-plan may migrate the rows at the start of step ``step - 1`` or ``step``, asked when the
        loop hands the batch of ``step`` to the input pipeline (before step ``step - 1`` runs; ``held_back``):
        a check in flight whose verdict step is at most ``step`` (its verdict may come then), or, none in flight,
        a check the schedule lets start at ``step - 1`` (or at ``step`` with ``replan_lag`` 0, :meth:`_on_schedule`)
        that takes its verdict by ``step``. Only these batches wait for their own step; while the checks are
        spaced out nearly all batches are prepared ahead."""
        p = self._pending
        if p is not None:  # no other check starts before its verdict
            return p.apply_at <= step
        return any(self._on_schedule(c) for c in (step - 1, step) if c + self.lag <= step)

    def _on_schedule(self, step: int) -> bool:
        """Whether the schedule lets a check start at ``step``: a positive multiple of ``replan_every``, not
        before the spaced-out checks' next one (:meth:`maybe_replan` also needs none in flight and counts)."""
        return step > 0 and step % self.every == 0 and step >= self._quiet_until

    def _alarm_kind(self, step: int, reader) -> int | None:
        """Whether the batch of ``step`` is one of the drift alarm's samples, and which (``None``: not one), on
        several ranks under a module that decodes reads (``read_ranks``), no sample unjudged, no check in flight: the
        last batch before a check may start (the schedule lets one start at ``step + 1``) is the base
        (:data:`ALARM_BASE`: the reads the check's profile ends with; a drift from the check's own step on is then
        seen); while the checks are spaced out and the profile is not counted (more than
        :data:`QUIET_OBSERVE_PERIODS` periods before the next check), the first batch of every
        :data:`ALARM_PERIODS`-th monitoring period (of the run's steps) is judged against it (:data:`ALARM_PERIOD`).
        The same on every rank (the spacing is rank 0's, sent with each verdict)."""
        if (self._world <= 1 or self._alarm is not None or self._pending is not None
                or not hasattr(reader, "read_ranks")):
            return None
        if self._on_schedule(step + 1):
            return ALARM_BASE
        if (step > 0 and step % (ALARM_PERIODS * self.every) == 0
                and step < self._quiet_until - QUIET_OBSERVE_PERIODS * self.every):
            return ALARM_PERIOD
        return None

    def _alarm_sample(self, reader, sparse, kind: int) -> None:
        """This rank's row of the period's reads (:data:`ALARM_VALUES` values of the batch decoded to the ranks that
        serve them, ``ShardedEmbedding.read_ranks``), summed over the ranks beside the next period's steps (one
        ``all_reduce`` of W x W counts, not waited for) and judged at its first step (:meth:`_judge_alarm`)."""
        reads = torch.zeros(self._world, self._world, dtype=torch.int64)
        reads[self._rank] = reader.read_ranks(sparse, ALARM_VALUES)
        work = dist.all_reduce(reads, group=self._group, async_op=True)
        self._alarm = (self._step + self.every, kind, reads, work)

    def _judge_alarm(self) -> None:
        """Every rank, a period after a sampled batch (the same figures on all): the sample before a check sets the
        alarm's base (:func:`alarm_stats`; with none, the first period's after it); a period's sample that rose past
        it (:func:`alarm_fires`, by ``train.replan_min_gain``, at least 5%) brings the next check forward to
        :data:`QUIET_OBSERVE_PERIODS` periods from now (the profile is counted in those periods, so the check sees the
        new reads): a drift is checked within :data:`ALARM_PERIODS` + 3 periods instead of up to
        :data:`MAX_QUIET_PERIODS` (the checks' spacing cost a drifting 4-rank run 31-86 steps of its old plan,
        benchmarks/bench_online.py)."""
        due, kind, reads, work = self._alarm
        self._alarm = None
        if work is not None:
            work.wait()
        reads = reads.tolist()
        if kind == ALARM_VOID or sum(map(sum, reads)) < ALARM_MIN_VALUES:
            return
        stats = alarm_stats(reads)
        if kind == ALARM_BASE or self._alarm_base is None:
            self._alarm_base = stats
        elif alarm_fires(stats, self._alarm_base, max(self.min_gain, 0.05)):
            self.alarms += 1
            self._alarm_base = None
            self._quiet_until = min(self._quiet_until, due + QUIET_OBSERVE_PERIODS * self.every)

    def stepped(self, seconds: float) -> None:
        """The run's measured seconds of a step (``DistributedRun.train_step``, the monitor's pause excluded): the
        median of the last :data:`STEP_TIMES_KEPT` calibrates a check's model gains (:func:`gain_seconds`)."""
        self._step_times.append(float(seconds))

    def measured_step_s(self) -> float | None:
        """The median of the run's last measured steps (``None`` before the first): plain Python on at most
        :data:`STEP_TIMES_KEPT` numbers (NumPy's first ``median`` of a process took 18 ms, a step, at a check's start)."""
        if not self._step_times:
            return None
        v, n = sorted(self._step_times), len(self._step_times)
        return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])

    def observe(self, sparse, samples: int, reader=None) -> None:
        """Count the rows this rank's slice of a batch reads (one decay step); while the checks are spaced out,
        only in the :data:`QUIET_OBSERVE_PERIODS` periods before the next one (else the decay alone: no tensor
        touched), the earlier of them sampled (:data:`QUIET_COUNT_EVERY`, :func:`counted_step`). A counted batch's ids are checked and held; the profile adds the held batches in one
        ``index_add_`` when it is read (``RollingProfile.update_flat``, ``defer``): at the next check. ``reader``
        (the running sharded module): the batch may be the drift alarm's sample (:meth:`_alarm_sample`)."""
        kind = self._alarm_kind(self._step, reader) if reader is not None else None
        if kind is not None:
            self._alarm_sample(reader, sparse, kind)
        k = getattr(self, "count_every", 1)
        if self._step < self._quiet_until - self.every:  # spaced out: not the last period before the next check
            k *= QUIET_COUNT_EVERY  # the earlier counting period: sampled (the ones before it: skipped below)
        if (self._step < self._quiet_until - QUIET_OBSERVE_PERIODS * self.every
                or (k > 1 and not counted_step(self._seed, self._step, k))):
            self.profile.decay_only(1)
            return
        flat = self._flat_ids(sparse)
        if flat is not None:  # held, added (an index_add_ each) when the check reads it (RollingProfile.update_flat)
            self.profile.update_flat(flat, steps=1, samples=samples, check=False, defer=True, weight=k)
            return
        parts = sparse.to_dict()
        rows = {t: torch.cat([parts[f][0].reshape(-1) for f in feats]) for t, feats in self._features.items()}
        self.profile.update(rows, steps=1, samples=samples, weight=k)

    def _flat_ids(self, sparse) -> torch.Tensor | None:
        """The batch's row ids as :meth:`RollingProfile.update_flat` counts them (each value plus its table's
        offset), each checked against its table's rows; ``None`` when a key of the batch is no profiled table's
        feature (then the rows are counted table by table). The per-value offsets and bounds are kept for the
        batch's keys and lengths (the same for every full batch)."""
        keys = getattr(sparse, "keys", None)
        if keys is None or not hasattr(sparse, "length_per_key_list"):
            return None
        lpk = sparse.length_per_key_list()
        key = (tuple(keys), tuple(lpk))
        cached = self._flat_cache.get(key)
        if cached is None:
            table_of = {f: t for t, feats in self._features.items() for f in feats}
            if any(k not in table_of for k in keys):
                return None
            off = self.profile.table_offsets
            rows = self.profile.num_rows
            sizes = torch.tensor(lpk, dtype=torch.int64)
            cached = (torch.repeat_interleave(torch.tensor([off[table_of[k]] for k in keys]), sizes),
                      torch.repeat_interleave(torch.tensor([rows[table_of[k]] - 1 for k in keys]), sizes))
            cached = tuple(c.to(self.profile.device) for c in cached)
            if len(self._flat_cache) >= 8:  # a few shapes (the last, short batch): never grows without bound
                self._flat_cache.clear()
            self._flat_cache[key] = cached
        off, last = cached
        vals = sparse.values
        if vals.dtype != torch.int64 or vals.device != off.device:
            vals = vals.to(off.device, torch.int64)
        # 0 <= v <= last for every value: neither v nor last - v is negative (their bitwise or has no sign bit)
        if (vals.numel() and not self._within_smallest(vals)
                and int(torch.bitwise_or(vals, last - vals).min()) < 0):
            i = int(torch.nonzero((vals < 0) | (vals > last))[0])
            k = int(np.searchsorted(np.cumsum(lpk), i, side="right"))
            raise InputError(f"drift monitor: feature {keys[k]!r}: row id {int(vals[i])} outside its table "
                             f"[0, {int(last[i]) + 1})")
        return vals + off

    def _within_smallest(self, vals: torch.Tensor) -> bool:
        """Whether every value lies in ``[0, rows)`` of the smallest profiled table (then in its own table's range):
        one reduction, the per-value check of :meth:`_flat_ids` only when not."""
        smallest = getattr(self, "_smallest_last", None)
        if smallest is None:
            smallest = self._smallest_last = min(self.profile.num_rows.values()) - 1
        lo, hi = torch.aminmax(vals)
        return int(lo) >= 0 and int(hi) <= smallest

    def maybe_replan(self, run) -> dict | None:
        """Collective (every rank calls it before each step): every ``replan_every`` steps start a check (rank 0
        plans in a thread, :meth:`_begin`), and ``replan_lag`` steps later take its verdict and migrate when the
        new plan pays (:meth:`_conclude`). Returns the re-plan's record (rank 0), else ``None``."""
        step = self._step = run.state.step
        out = None
        pending = self._pending
        if pending is not None and step >= pending.apply_at:
            self._pending = None
            out = self._conclude(run, pending)
        if self._alarm is not None and step >= self._alarm[0]:
            self._judge_alarm()
        if (not self._on_schedule(step) or step == self._checked_at or self.profile.steps == 0
                or self._pending is not None):  # a check in flight, or spaced out
            return out
        self._checked_at = step
        self.checks += 1
        self._pending = self._begin(run, step)
        if self.lag == 0:  # the other ranks wait for the verdict now
            pending, self._pending = self._pending, None
            out = self._conclude(run, pending)
        return out

    def _begin(self, run, step: int) -> "PendingCheck":
        """Collective: the ranks' profiles summed (started now; with ``replan_lag`` > 0 it completes beside the
        next step); rank 0 starts the check of step ``step`` (:meth:`_decide`) in a thread (in line with
        ``replan_lag`` 0) while every rank trains on."""
        t0 = time.perf_counter()
        p = PendingCheck(step=step, apply_at=step + self.lag, begin_s=0.0, run_dir=run.run_dir)
        p.total = self.profile.all_reduce_async()  # every rank's slices: the global batches' rows
        if self.lag == 0:
            p.total = p.total()
        p.posted = self._posts(run, p.apply_at)
        if p.posted and run.rank != 0:  # the verdict's receive, posted now: taken at the verdict step
            self._receive(p)
        if run.rank == 0:
            self._step_s = self.measured_step_s()  # the check's gains in the run's measured seconds (gain_seconds)
            args = (run, p, t0)
            if self.lag == 0:
                self._decide(*args)
            else:  # the training thread takes the GIL back within CHECK_SWITCH_S while the check runs
                p.switch_s = sys.getswitchinterval()
                sys.setswitchinterval(min(p.switch_s, CHECK_SWITCH_S))
                p.thread = CheckJob()
                self._checker().put((p.thread, args))  # no wait for a new thread to be scheduled
        p.begin_s = time.perf_counter() - t0
        self.pause_parts.append((step, "begin", p.begin_s))
        return p

    def _decide(self, run, p: "PendingCheck", t0: float) -> None:
        """Rank 0 (a thread with ``replan_lag`` > 0): the check of step ``p.step`` and its verdict. A re-plan's plan
        and the plan it leaves (``before/``) are staged in ``replans/check-N/``; the verdict step publishes them
        (:meth:`_publish`). Touches no tensor of the run and nothing a step changes (the step comes as ``p.step``)."""
        try:
            if _CHECK_DELAY_S:  # a test's slow check (tests/test_replan_lag.py)
                time.sleep(_CHECK_DELAY_S)
            if callable(p.total):
                p.total = p.total()
            prof = p.total.to_access_profile()
            t1 = time.perf_counter()
            report, fresh = self._check(run, prof, p.step)
            p.searched = fresh is not None
            p.idle = bool(report.get("replan_costs", {}).get("whole_step_cannot_pay", False))
            if fresh is not None:  # the planning's seconds: what the next check weighs before it plans
                self.plan_seconds = time.perf_counter() - t1
            if fresh is not None and report["replan"] and getattr(run.cfg.train, "replan_weigh_costs", True):
                self._weigh_costs(run, report, time.perf_counter() - t0, p.step)
            if report["replan"]:
                stage = p.run_dir / "replans" / f"{STAGED}{p.step}"
                shutil.rmtree(stage, ignore_errors=True)  # an earlier attempt's
                fresh.meta["replan_record"] = record_fields(report)
                fresh.save(stage)
                run.plan.save(stage / BEFORE)  # for resume_plan
            p.report, p.verdict = report, 1 if report["replan"] else 0
        except BaseException as e:  # every rank stops with it, none waits for a verdict
            p.error, p.verdict = e, -1
        finally:
            if p.switch_s is not None:
                sys.setswitchinterval(p.switch_s)
        p.check_s = time.perf_counter() - t0
        if p.posted:  # the verdict goes out now (published first): the others take it at the verdict step
            with self._lock:
                if p.posted and not p.sent:  # (the verdict step may have passed meanwhile: _take_verdict)
                    self._publish(p)
                    p.sent = self._quiet_periods(p) if p.verdict >= 0 else 1
                    p.flag, p.work = self._send([p.verdict, p.sent])

    def _checker(self) -> "queue.SimpleQueue":
        """Rank 0: the queue of the monitor's check thread, started once (a daemon): each check is handed to it
        instead of a thread of its own, so the step that starts a check does not wait for a new thread to be
        scheduled (on a loaded machine a thread's start waits for a core)."""
        jobs = self._jobs
        if jobs is None:
            jobs = self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="replan-check", daemon=True).start()
        return jobs

    def _serve(self, jobs: "queue.SimpleQueue") -> None:
        """The check thread: run each check handed to it (:meth:`_decide`, which never raises), then mark it done."""
        while True:
            job, args = jobs.get()
            try:
                self._decide(*args)
            finally:
                job._done.set()

    def _posts(self, run, apply_at: int) -> bool:
        """Whether the verdict taken at ``apply_at`` travels on the verdicts' group (sent by rank 0's check thread
        when done, received ahead by the others): with ``replan_lag`` > 0 on N ranks, when the run's steps are
        known and the verdict step falls inside them (no message is left in flight when the run ends)."""
        max_steps = run.cfg.train.max_steps
        return self._verdicts is not None and 0 < max_steps and apply_at < max_steps

    def _send(self, flag: list[int]):
        """Rank 0: the verdict's message ``[verdict, periods to the next check]``, broadcast without waiting."""
        t = torch.tensor(flag, dtype=torch.int64)
        return t, dist.broadcast(t, 0, group=self._verdicts, async_op=True)

    def _receive(self, p: "PendingCheck") -> None:
        """The other ranks: the verdict's receive posted ahead (``p.flag``, ``p.work``)."""
        p.flag = torch.zeros(2, dtype=torch.int64)
        p.work = dist.broadcast(p.flag, 0, group=self._verdicts, async_op=True)

    def _take_verdict(self, run, p: "PendingCheck") -> tuple[int, int]:
        """Every rank at the verdict step: rank 0's verdict and the periods to the next check. On the verdicts'
        group (``p.posted``) rank 0 sent it when its check was done, else sends :data:`NOT_READY` now (the check
        is then taken one monitoring period later, published for that step: ``apply_at`` moves under the lock);
        the others wait for a message that has mostly arrived. Else one blocking broadcast on the monitor group."""
        if not p.posted:
            flag = torch.zeros(2, dtype=torch.int64)  # rank 0's verdict (1 re-plan, 0 keep, -1 failed), periods
            if run.rank == 0:
                ready = p.thread is None or not p.thread.is_alive()
                if ready:
                    self._publish(p)
                flag[0] = p.verdict if ready else NOT_READY
                flag[1] = self._quiet_periods(p) if ready and p.verdict >= 0 else 1
            dist.broadcast(flag, 0, group=run.monitor_group)
            return int(flag[0]), int(flag[1])
        if run.rank == 0:
            with self._lock:
                if p.sent:
                    flag, work = p.flag, p.work
                else:  # the check still runs: "not ready", and its verdict is sent for a period later
                    flag, work = self._send([NOT_READY, 1])
                    p.apply_at += self.every
                    p.posted = self._posts(run, p.apply_at)
        else:
            flag, work = p.flag, p.work
        work.wait()
        verdict, quiet = int(flag[0]), int(flag[1])
        if verdict == NOT_READY and run.rank != 0:
            p.apply_at += self.every
            p.posted = self._posts(run, p.apply_at)
            if p.posted:
                self._receive(p)
        return verdict, quiet

    def _publish(self, p: "PendingCheck") -> None:
        """Rank 0, once the check is done and before its verdict is broadcast: the verdict on disk for the step
        ``p.apply_at`` it is taken at. A re-plan's staged plans become ``replans/step-M/`` (renamed) and the run's
        ``plan/`` (hard links, ``plan.json`` last), so a resume continues under it; a kept plan voids an earlier
        attempt's re-plan of step M (``kept``)."""
        if p.published or p.verdict < 0:
            return
        d = p.run_dir / "replans" / f"step-{p.apply_at}"
        if p.verdict == 1:
            shutil.rmtree(d, ignore_errors=True)  # an earlier attempt's re-plan of the same step
            os.replace(p.run_dir / "replans" / f"{STAGED}{p.step}", d)
            _link_plan(d, p.run_dir / "plan")
        elif self.lag and (d / PLAN_JSON).exists():  # an earlier attempt's re-plan, not this run's
            atomic_write_text(d / KEPT, f"the check of step {p.step} kept the plan\n")
        p.published = True

    def settle(self) -> None:
        """Rank 0, before a checkpoint is written: wait for a pending check and publish its verdict, so it is on
        disk (under ``replans/``) before the checkpoint is, and a resume from it takes it at the same step."""
        p = self._pending
        if p is not None and p.thread is not None:
            p.thread.join()
            self._publish(p)

    def _quiet_periods(self, p: "PendingCheck") -> int:
        """Rank 0: the monitoring periods to the next check. A check that kept the plan (its cost held within
        ``replan_min_gain`` and its balance, no plan could pay, :meth:`_cannot_pay`, or the plan searched did not
        pay) doubles them, up to :data:`MAX_QUIET_PERIODS`: a stream where balance does not pay is checked ever less
        often (a drift is seen that many periods late at most); a check that re-planned resets them to one."""
        self._quiet_streak = self._next_streak(p)
        return min(MAX_QUIET_PERIODS, 2 ** self._quiet_streak)

    def _next_streak(self, p: "PendingCheck") -> int:
        """Rank 0: the streak after check ``p`` (:meth:`_quiet_periods`): 0 after a re-plan, else one more (a search
        whose plan did not pay keeps the plan too: its gain is known small); a check where no plan could pay even
        by removing the whole measured step (``p.idle``) goes straight to the streak of the longest spacing (the
        step or the planning's seconds must change before any check could pay)."""
        streak = 0 if p.verdict == 1 else self._quiet_streak + 1
        return max(streak, MAX_QUIET_PERIODS.bit_length() - 1) if p.idle else streak

    def _conclude(self, run, p: "PendingCheck") -> dict | None:
        """Collective: rank 0 broadcasts the verdict if its check is done (publishing it first), else
        :data:`NOT_READY`, and every rank takes it one monitoring period later: no rank waits for a plan. A check
        restored from ``replans/`` by :func:`resume_plan` needs no broadcast. On a re-plan every rank moves the
        rows (:func:`move_to_plan`) and rank 0 records it (``replans.csv``)."""
        t0 = time.perf_counter()
        step = p.apply_at
        if callable(p.total):  # the profiles' sum, long done: its work released
            p.total()
        t_sum = time.perf_counter()
        quiet, posted = 1, p.posted
        if p.known is None:
            verdict, quiet = self._take_verdict(run, p)
        else:  # restored (resume_plan, DriftMonitor._restore_spacing): the spacing it sets, as the broadcast would
            verdict, quiet = p.known, p.known_quiet
            self._quiet_streak = p.known_streak if p.known_streak is not None else 0
        t_wait = time.perf_counter()
        self.pause_parts += [(step, "sum_wait", t_sum - t0), (step, "verdict", t_wait - t_sum)]
        if verdict == NOT_READY:  # the check still runs: its verdict one monitoring period later
            if not posted:  # (on the verdicts' group _take_verdict moved it)
                p.apply_at += self.every
            p.deferred += 1
            p.begin_s += t_wait - t0
            self.deferred += 1
            self._pending = p
            return None
        self._quiet_until = p.step + quiet * self.every
        if verdict == 1:  # the reads change with the plan: the alarm's base is measured afresh under the new one
            self._alarm_base = None
            if self._alarm is not None:
                self._alarm = (self._alarm[0], ALARM_VOID, *self._alarm[2:])
        if verdict < 0:
            if p.error is not None:  # rank 0: the check's own error
                raise p.error
            raise EmbedscaleError(f"rank {run.rank}: rank 0's re-plan check at step {p.step} failed "
                                  "(its error says why)")
        if not verdict:
            self.check_seconds.append(p.begin_s + t_wait - t0)
            return None
        new_plan = Plan.load(run.run_dir / "replans" / f"step-{step}")  # published by rank 0 before the broadcast
        if p.known is not None and run.rank == 0:  # resume_plan left plan/ at the plan the rows leave now
            new_plan.save(run.run_dir / "plan")
        mig = move_to_plan(run, new_plan)
        t2 = time.perf_counter()
        self.pause_parts.append((step, "migrate", t2 - t_wait))
        self.check_seconds.append(p.begin_s + t_wait - t0)
        figs = torch.tensor([mig.rows_sent, mig.bytes_sent, mig.replicas_added, mig.replicas_dropped,
                             mig.rows_written], dtype=torch.float64)
        dist.all_reduce(figs, group=run.monitor_group)
        # the pause of this rank: the profiles' sum at the check, the wait for the verdict, the migration
        secs = torch.tensor([p.begin_s + t2 - t0, p.begin_s + t_wait - t0, t2 - t_wait], dtype=torch.float64)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX, group=run.monitor_group)
        if run.rank != 0:
            return None
        fields = new_plan.meta.get("replan_record") or record_fields(p.report)
        rec = {"step": step, "reason": fields["reason"], "gain": fields["gain"],
               "rows_moved": int(figs[0]), "bytes": int(figs[1]), "seconds": round(float(secs[0]), 6),
               "check_seconds": round(float(secs[1]), 6), "migrate_seconds": round(float(secs[2]), 6),
               "replicas_added": int(figs[2]), "replicas_dropped": int(figs[3]),
               "balance_before": fields["balance_before"], "balance_after": fields["balance_after"],
               "strategy": fields["strategy"], "rows_written": int(figs[4]), "in_place": int(mig.in_place),
               "checked_at": p.step, "plan_seconds": round(float(p.check_s), 6) if p.known is None else ""}
        self.records.append(rec)
        write_replans(run.run_dir, rec)
        return rec

    def _weigh_costs(self, run, report: dict, check_s: float, step: int | None = None) -> None:
        """Rank 0: keep the running plan unless the new one pays for the check and the migration before the next
        check (:func:`replan_pays`); the terms go into ``report["replan_costs"]``. The check of step ``step``
        (default: the run's) moves the rows ``replan_lag`` steps later: the gain counts from there."""
        after, new = report["after"]["max_rank_cost"], report["replanned"]["max_rank_cost"]
        step_s = getattr(self, "_step_s", None)  # the measured step (gain_seconds; None: the model's seconds)
        gain = gain_seconds(max(0.0, after - new), after, step_s)
        steps = self._gain_steps(run, run.state.step if step is None else step)
        nbytes = float(report.get("bytes_moved", 0)) + 4.0 * float(report.get("rows_moved", 0))  # + row-wise state
        last = next((r for r in reversed(self.records) if float(r["bytes"]) > 0), None)
        topo = link_topology(Topology(), getattr(run.cfg.dist, "link_gbit_s", 0.0))  # the links the check's plans see
        link = topo.intra_host_bw if run.cfg.dist.topology_hosts <= 1 else topo.inter_host_bw
        mig = migration_seconds(nbytes, link, (float(last["migrate_seconds"]), float(last["bytes"])) if last else None)
        pays = replan_pays(gain, steps, check_s, mig)
        report["replan_costs"] = {"gain_per_step_s": gain, "steps_to_next_check": steps, "check_s": check_s,
                                  "migrate_s": mig, "pays": pays, "measured_step_s": step_s}
        if not pays:
            self.declined += 1
            report["replan"] = False
            report["reason"] = (f"the new plan saves {gain * 1e3:.3f} ms a step x {steps} steps to the next check, "
                                f"not more than the check ({check_s * 1e3:.1f} ms) and the migration "
                                f"({mig * 1e3:.1f} ms): keep the plan")

    def _check(self, run, total, step: int | None = None):
        """Rank 0: the running plan and a fresh one costed on the summed profile (``plan.drift``; ``total``: the
        summed ``RollingProfile`` or its ``AccessProfile``) at step ``step`` (default: the run's)."""
        d, world = run.cfg.dist, run.world
        prof = total.to_access_profile() if hasattr(total, "to_access_profile") else total
        topo = Topology(num_hosts=d.topology_hosts, ranks_per_host=world // d.topology_hosts)
        topo = link_topology(topo, getattr(d, "link_gbit_s", 0.0), d.mode)  # dist.link_gbit_s: every rank's own link
        plan = run.plan
        kw = dict(old_profile=None if plan.part_counts is not None else prof, mode=d.mode,
                  batch_size=max(1, run.cfg.train.batch_size // world), min_gain=self.min_gain)
        if self.min_gain > 0:  # the running plan holds: no fresh plan (OPER's search is most of a check's time)
            report, _ = drift_and_plan(plan, prof, topo, replan=False, dob_floor=DOB_FLOOR, **kw)
            if not report["replan"] and report["max_rank_cost_ratio"] <= 1 + self.min_gain:
                report["reason"] = (f"the plan's bottleneck cost moved by {report['max_rank_cost_ratio'] - 1:+.1%} "
                                    f"(<= {self.min_gain:.0%}) and its balance holds: keep the plan")
                return report, None
            if self._cannot_pay(run, report, run.state.step if step is None else step):
                return report, None
        report, fresh = drift_and_plan(plan, prof, topo, extra_memory=d.extra_memory, dob_floor=DOB_FLOOR, **kw)
        if fresh is not None:
            fresh = self._prefer_incremental(plan, fresh, prof, topo, report, d.mode,
                                             max(1, run.cfg.train.batch_size // world))
        if fresh is not None:  # the same forms as the running plan (TT, host tables beside the placed ones)
            for key in ("forms", "replicated_tables", "topology"):
                if key in plan.meta:
                    fresh.meta[key] = plan.meta[key]
            fresh.meta["replanned_at_step"] = run.state.step if step is None else step
        return report, fresh

    def _cannot_pay(self, run, report: dict, step: int) -> bool:
        """Rank 0, before planning: whether no plan could pay for the check (:func:`replan_pays` with the best
        gain any plan can have: the running bottleneck less the ranks' mean lookup, ``plan.drift``'s
        ``lookup_mean``, against the last planning's measured seconds; no migration counted). Then the plan is
        kept without the search (counted in ``replans_declined``)."""
        plan_s = getattr(self, "plan_seconds", None)
        if plan_s is None or not getattr(run.cfg.train, "replan_weigh_costs", True):
            return False
        after = report["after"]
        step_s = getattr(self, "_step_s", None)  # the measured step (gain_seconds; None: the model's seconds)
        bound = gain_seconds(max(0.0, after["max_rank_cost"] - after["lookup_mean"]), after["max_rank_cost"], step_s)
        steps = self._gain_steps(run, step)
        if replan_pays(bound, steps, plan_s, 0.0):
            return False
        self.declined += 1
        report["replan"] = False
        report["replan_costs"] = {"gain_bound_per_step_s": bound, "steps_to_next_check": steps, "check_s": plan_s,
                                  "pays": False, "measured_step_s": step_s,
                                  "whole_step_cannot_pay": step_s is not None and step_s * steps <= plan_s}
        report["reason"] = (f"no plan saves more than {bound * 1e3:.3f} ms a step (the bottleneck less the mean "
                            f"lookup) x {steps} steps, not more than planning ({plan_s * 1e3:.1f} ms): keep the plan")
        return True

    def _gain_steps(self, run, step: int) -> int:
        """The steps a plan taken at the check of ``step`` runs before the next check's verdict could change it:
        ``every`` steps from ``step + lag``, or to the run's end."""
        lag = getattr(self, "lag", 0)
        left = run.cfg.train.max_steps - step - lag if run.cfg.train.max_steps > 0 else self.every
        return max(0, min(self.every, left))

    def _prefer_incremental(self, plan: Plan, fresh: Plan, prof, topo, report: dict, mode: str, batch: int) -> Plan:
        """The incremental plan (``plan.incremental``: the running placement, the fresh plan's replicas, the
        fewest row moves that balance the lookups) instead of the fresh one when it passes the same re-plan
        rule and its bottleneck cost is within :data:`INCREMENTAL_SLACK` of the fresh plan's; ``report`` is
        updated to describe the plan chosen."""
        inc, _ = incremental_plan(plan, fresh, prof, batch_size=batch)
        cost = evaluate(inc, prof, topo, mode=mode, batch_size=batch, part_counts=inc.part_counts, traffic="access")
        after = report["after"]["max_rank_cost"]
        gain = 1.0 - cost.max_rank_cost / after if after > 0 else 0.0
        balanced = cost.dob_lookup >= DOB_FLOOR and cost.dob_comm >= DOB_FLOOR
        close = cost.max_rank_cost <= report["replanned"]["max_rank_cost"] * (1 + INCREMENTAL_SLACK)
        if not (cost.fits_memory and close and (gain > self.min_gain or (report["replan"] and balanced))):
            return fresh
        tot = cost.total_per_rank
        report["fresh"] = {"replanned": report["replanned"], "replan_gain": report["replan_gain"],
                           "rows_moved": report["rows_moved"]}
        report["replanned"] = {"dob_memory": cost.dob_memory, "dob_lookup": cost.dob_lookup,
                               "dob_comm": cost.dob_comm, "comm_mean": cost.comm_mean,
                               "max_rank_cost": cost.max_rank_cost,
                               "balance": cost.max_rank_cost / float(tot.mean()) if tot.mean() > 0 else 1.0}
        report.update(rows_moved(plan, inc))
        report["replan_gain"], report["replan"] = gain, True
        report["replan_strategy"] = f"{report['replan_strategy']}+incremental"
        report["reason"] = (f"incremental re-plan lowers the bottleneck cost by {gain:.1%}" if gain > self.min_gain
                            else f"balance fell below {DOB_FLOOR}; the incremental plan restores it")
        return inc

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's rolling profile (``RollingProfile.state_dict``) and the checks' spacing
        (:data:`SPACING_KEY`, :meth:`_spacing`), for its rank file of a checkpoint (``DistributedRun.save``: key
        :data:`CHECKPOINT_KEY`)."""
        out = {k: v.to(HOST) for k, v in self.profile.state_dict().items()}
        out[SPACING_KEY] = self._spacing()
        if self._alarm is not None:  # a sample not judged yet: its reads, summed over the ranks
            due, kind, reads, work = self._alarm
            if work is not None:
                work.wait()
            self._alarm = (due, kind, reads, None)
            out[ALARM_KEY] = torch.cat([torch.tensor([due, kind], dtype=torch.int64), reads.reshape(-1)])
        return out

    def _spacing(self) -> torch.Tensor:
        """The checks' spacing, 9 numbers (float64): the step before which no check starts, rank 0's streak of
        checks that kept the plan without a search, its last planning's seconds (NaN: none), a check whose
        verdict "keep" is known (rank 0, after :meth:`settle`) but not yet taken: its step, its verdict step, the
        periods and the streak it sets (-1: none), and the drift alarm's base (:func:`alarm_stats`; NaN: none).
        A re-plan's verdict is restored from ``replans/`` instead (:func:`resume_plan`)."""
        kept = [-1.0] * 4
        p = getattr(self, "_pending", None)
        done = p is not None and (p.known == 0 or (p.known is None and p.thread is not None
                                                   and not p.thread.is_alive() and p.verdict == 0))
        if done and p.sent:  # its message sent by the check's thread: the spacing it set is the monitor's
            kept = [p.step, p.apply_at, p.sent, self._quiet_streak]
        elif done:
            streak = p.known_streak if p.known is not None else self._next_streak(p)
            kept = [p.step, p.apply_at, min(MAX_QUIET_PERIODS, 2 ** streak), streak]
        plan_s = self.plan_seconds if self.plan_seconds is not None else float("nan")
        base = self._alarm_base if self._alarm_base is not None else (float("nan"),) * 2
        return torch.tensor([self._quiet_until, self._quiet_streak, plan_s, *kept, *base], dtype=torch.float64)

    def _restore_spacing(self, spacing: torch.Tensor | None) -> None:
        """Rank 0's :meth:`_spacing` of a checkpoint, on every rank (the step before which no check starts is the
        same on all; the rest only rank 0 reads). A checkpoint without one: the spacing starts afresh."""
        if spacing is None:
            return
        v = spacing.tolist()
        self._quiet_until, self._quiet_streak = int(v[0]), int(v[1])
        if v[2] == v[2]:  # not NaN
            self.plan_seconds = float(v[2])
        if v[3] >= 0:  # a kept verdict, taken at its step (resume_plan drops it when the run is past that step)
            self._pending = PendingCheck(step=int(v[3]), apply_at=int(v[4]), known=0, known_quiet=int(v[5]),
                                         known_streak=int(v[6]))
        if len(v) >= 9 and v[7] == v[7]:  # the alarm's base (a checkpoint before the alarm has none)
            self._alarm_base = (float(v[7]), float(v[8]))

    def restore(self, shards: list[dict], rank: int, world: int) -> None:
        """The rolling profile a checkpoint's rank files hold (``read_shards``; a checkpoint without one leaves
        it empty). Written by ``world`` ranks: each rank takes its own, bit for bit; by another number of ranks:
        rank 0 takes their sum and the others start empty, so the monitor's sum over the ranks (what it plans
        from) is the saved one. Delta checkpoints carry none (8 bytes a row per rank would be most of a small
        delta): a delta's base's profiles are taken, which lack the steps since the base."""
        states = sorted(((sh["rank"], sh[CHECKPOINT_KEY]) for sh in shards
                         if sh.get("rank", -1) >= 0 and sh.get(CHECKPOINT_KEY) is not None), key=lambda x: x[0])
        if not states:  # a delta: its base's rank files (ranks -1, -2, ... for the base's 0, 1, ...)
            states = sorted(((-1 - sh["rank"], sh[CHECKPOINT_KEY]) for sh in shards
                             if sh.get("rank", 0) < 0 and sh.get(CHECKPOINT_KEY) is not None), key=lambda x: x[0])
        if not states:
            return
        if [r for r, _ in states] == list(range(world)):
            self.profile.load_state_dict(states[rank][1])
        elif rank == 0:
            self.profile.load_state_dict(states[0][1])
            for _r, st in states[1:]:
                self.profile.add_state(st)
        self._checked_at = -1
        self._restore_spacing(states[0][1].get(SPACING_KEY))
        alarm = states[0][1].get(ALARM_KEY)  # the same on every rank; another world's reads are not comparable
        if alarm is not None and alarm.numel() == 2 + self._world ** 2:
            self._alarm = (int(alarm[0]), int(alarm[1]), alarm[2:].reshape(self._world, self._world).clone(), None)

    def figures(self) -> dict:
        return {"replan_every": self.every, "replan_checks": self.checks, "replan_deferred": self.deferred,
                "replan_check_seconds": round(sum(self.check_seconds), 6), "replans_declined": self.declined,
                "replan_alarms": self.alarms, "replans": list(self.records)}


def resume_plan(run) -> None:
    """Collective (every rank, after ``restore``): the checkpoint of step s was written under the plan the run
    held then, but ``<run dir>/plan`` is the last re-plan's. When an earlier attempt re-planned at a step
    N >= s, move the rows onto the plan it left at the first such N (``replans/step-N/before/``), so the resumed
    run checks, re-plans and trains as the uninterrupted one (and ``replans.csv`` gets that run's rows again).
    A checkpoint taken after that re-plan's check (``replan_lag`` > 0) also takes its verdict at step N."""
    d = run.run_dir / "replans"
    step = run.state.step
    mon = run.monitor
    if mon._pending is not None and mon._pending.apply_at < step:  # a kept verdict of a delta's base: taken
        mon._pending = None
    later = sorted(int(p.name[5:]) for p in d.glob("step-*") if p.name[5:].isdigit()
                   and int(p.name[5:]) >= step and (p / BEFORE / "plan.json").exists()) if d.is_dir() else []
    if not later:
        return
    plan = Plan.load(d / f"step-{later[0]}" / BEFORE)
    if plan.world_size != run.world:
        return
    move_to_plan(run, plan)
    if run.rank == 0:
        plan.save(run.run_dir / "plan")
    checked = Plan.load(d / f"step-{later[0]}").meta.get("replanned_at_step")
    if checked is not None and int(checked) < step and not (d / f"step-{later[0]}" / KEPT).exists():
        # the checkpoint fell between that re-plan's check and its migration (train.replan_lag): its verdict,
        # on disk before the checkpoint was (DriftMonitor.settle), is taken at the same step
        run.monitor._pending = PendingCheck(step=int(checked), apply_at=later[0], known=1)


def move_to_plan(run, plan: Plan):
    """Collective (every rank): move the run's sharded rows and their row-wise optimizer state onto ``plan``
    and run under it from now on (``run.swap_sharded``). In place (``embedding.migrate.migrate_in_place``: its
    map edited, only the rows that change holder or place written), a ``PgasShardedEmbedding`` too while the
    new storage fits its heap (built with :data:`PGAS_REPLAN_SPARE` more room in a run that re-plans); else
    into the sharded module built for the plan's address map (``embedding.migrate.migrate``). Returns this
    rank's ``Migration``."""
    emb = run.embedding
    try:
        mig = migrate_in_place(emb, Placement.of_plan(plan, run.tables))
    except HeapTooSmall:  # every rank alike, nothing moved: a new heap of the plan's size
        amap = address_map_from_plan(plan, run.tables)
        emb = build_sharded(run.all_tables, run.tables, replace(run.embedding_env, address_map=amap))
        mig = migrate(run.embedding, emb)
    run.swap_sharded(emb, plan)
    return mig


def _link_plan(src, dst) -> None:
    """The plan directory ``src`` as ``dst`` without copying: its files hard-linked in (each replaced atomically,
    ``plan.json`` last, as ``Plan.save`` writes them)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in (ORDER_NPY, PARTS_NPZ, PLAN_JSON):
        tmp = dst / f".{name}.link"
        tmp.unlink(missing_ok=True)
        os.link(src / name, tmp)
        os.replace(tmp, dst / name)


def read_replans(run_dir) -> list[dict]:
    """The rows of ``<run dir>/replans.csv`` (empty without one)."""
    path = run_dir / REPLANS_CSV
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_replans(run_dir, rec: dict) -> None:
    """Add ``rec`` to ``replans.csv`` (rewritten atomically; rows of earlier attempts at or after its step go:
    a resumed run re-plans them again)."""
    rows = [r for r in read_replans(run_dir) if int(r["step"]) < rec["step"]] + [rec]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in COLUMNS})
    atomic_write_text(run_dir / REPLANS_CSV, buf.getvalue())

