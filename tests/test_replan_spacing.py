"""The checks' spacing survives a checkpoint: a run resumed from one checks at the same steps, counts the same
batches and keeps the same profile as the uninterrupted run (the reference), in one process (a gloo group of 1).

A stationary stream on one rank: every check keeps the plan without a search, so the periods to the next check
double (a check every 4 steps, lag 1: checks at 4, 12, 28, 60) and only the batches of the two periods before a
check are counted (DriftMonitor.observe)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.data.profile import AccessProfile
from embedscale.plan.api import make_plan
from embedscale.specs import DistConfig, TableSpec, Topology
from embedscale.train.replan import CHECKPOINT_KEY, DriftMonitor, resume_plan

EVERY, LAG, STEPS = 4, 1, 64
TABLES = [TableSpec("a", 50, 4, features=["x"]), TableSpec("b", 30, 4, features=["y"])]


def _batch(step):
    rng = np.random.default_rng(step)  # the same distribution every step: the plan always holds
    return JaggedFeatures.from_dense(["x", "y"], torch.from_numpy(np.stack(
        [rng.integers(0, 50, 16), rng.integers(0, 30, 16)], axis=1)))


def _run(tmp_path):
    counts = {"a": np.ones(50), "b": np.ones(30)}
    plan = make_plan("oper", TABLES, AccessProfile(counts, 16), Topology(ranks_per_host=1), batch_size=16)
    return SimpleNamespace(host_embedding=None, device=torch.device("cpu"), tables=TABLES, plan=plan, rank=0,
                           world=1, monitor_group=None, run_dir=tmp_path, state=SimpleNamespace(step=0),
                           cfg=SimpleNamespace(dist=DistConfig(), train=SimpleNamespace(
                               batch_size=16, max_steps=STEPS, replan_weigh_costs=True)))


def _steps(run, mon, start, stop, log):
    """Steps ``start``..``stop - 1`` as ``DistributedRun.train_step`` drives the monitor; each check is done
    before its verdict is asked for (``settle``: no verdict deferred by the machine's timing)."""
    for s in range(start, stop):
        run.state.step = s
        mon.settle()
        before = mon.checks
        mon.maybe_replan(run)
        if mon.checks > before:
            log.append(s)
        mon.observe(_batch(s), 16)


def test_a_resume_checks_and_counts_as_the_uninterrupted_run(tmp_path, group):
    run = _run(tmp_path)
    whole, log = DriftMonitor(run, EVERY, 0.05, LAG), []
    run.monitor = whole
    _steps(run, whole, 0, STEPS, log)
    assert log == [4, 12, 28, 60], log  # the reference run's checks: each kept the plan, the periods doubled
    for cut in (5, 13, 16, 29):  # at a verdict step (the check kept, not yet taken), inside a quiet stretch
        first, got = DriftMonitor(run, EVERY, 0.05, LAG), []
        run.monitor = first
        _steps(run, first, 0, cut, got)
        first.settle()  # as a checkpoint is written (train.persist)
        state = {k: v.clone() for k, v in first.state_dict().items()}
        resumed = DriftMonitor(run, EVERY, 0.05, LAG)
        run.monitor, run.state.step = resumed, cut
        resumed.restore([{"rank": 0, CHECKPOINT_KEY: state}], 0, 1)
        resume_plan(run)
        _steps(run, resumed, cut, STEPS, got)
        assert got == log, (cut, got)
        a, b = whole.profile.state_dict(), resumed.profile.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), cut  # the same batches counted, bit for bit
        assert resumed._quiet_until == whole._quiet_until and resumed._quiet_streak == whole._quiet_streak


def _migration_steps_possible(handover: int, every: int, lag: int, quiet_until: int, pending_apply_at,
                              horizon: int = 200) -> set[int]:
    """Plain-Python model of the monitor's schedule, seen when the loop hands over the batch of step
    ``handover`` (steps before ``handover - 1`` have run): a check in flight takes its verdict at its verdict step
    or a whole number of periods later (not ready); a check not started yet may start at any multiple of
    ``every`` from ``handover - 1`` on, not before ``quiet_until``, when none is in flight, and takes its verdict
    ``lag`` steps later or whole periods after. Every step a migration may happen at."""
    out = set()
    if pending_apply_at is not None:
        out |= set(range(pending_apply_at, horizon, every))
        return out  # no check starts while one is in flight (its verdict ends it first: covered above)
    for c in range(max(handover - 1, 1), horizon):
        if c % every == 0 and c >= quiet_until:
            out |= set(range(c + lag, horizon, every))
    return out


@pytest.mark.parametrize("every,lag", [(3, 0), (3, 1), (4, 1), (4, 3), (5, 5), (2, 2)])
def test_the_input_pipeline_holds_back_only_batches_a_migration_may_precede(every, lag):
    """``DriftMonitor.may_migrate_before(t)`` (asked when the batch of step t is handed over, before step t - 1
    runs) is true exactly when the plain-Python schedule allows a migration at the start of step t - 1 or t,
    over spaced-out checks, checks in flight and deferred verdicts; while the checks are spaced out 16 periods,
    only the batches around the next check are held back (the monitor's every multiple were before)."""
    from types import SimpleNamespace

    from embedscale.train.replan import DriftMonitor

    mon = DriftMonitor.__new__(DriftMonitor)
    mon.every, mon.lag = every, lag
    for quiet_until in (0, every, 16 * every, 7 * every):
        for handover in range(2, 20 * every):
            for pending in (None, *range(handover - 1, handover + 3 * every)):
                if pending is not None and pending < lag:
                    continue
                mon._quiet_until = quiet_until
                mon._pending = None if pending is None else SimpleNamespace(apply_at=pending)
                want = bool(_migration_steps_possible(handover, every, lag, quiet_until, pending)
                            & {handover - 1, handover})
                assert mon.may_migrate_before(handover) == want, (handover, quiet_until, pending)
    mon._pending, mon._quiet_until = None, 16 * every
    held = [t for t in range(2, 16 * every + 2) if mon.may_migrate_before(t)]
    assert held == [t for t in (16 * every, 16 * every + 1) if 16 * every + lag in (t - 1, t)], held
