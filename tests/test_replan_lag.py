"""The drift monitor plans beside training (``train.replan_lag``): a check at step N runs in rank 0's thread while
every rank trains on, and the rows move between steps N + L and N + L + 1 (2 gloo ranks, the drifting stream of
tests/test_migrate.py: its first check, at step 4, re-plans).

References: a plain-Python model of the steps (which plan each step runs under); the run without a monitor,
checkpointed at step N + L and restarted under the plan the lag-0 run made at N (same profile, same plan);
the uninterrupted run against one resumed inside the lag window; a check made slow by a known delay."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from embedscale.specs import to_dict
from embedscale.train.checkpoint import step_dir
from embedscale.train.launch import spawn_local
from embedscale.train.replan import read_replans

from test_migrate import EVERY, _drift_rank, assert_same_run, drift_config, drift_data

W = 2


def plan_in_force(steps: int, every: int, lag: int, replans_at_check: set[int]) -> list[int]:
    """The model: for each step s (the run's state.step before it trains), the check step whose plan it runs
    under (0: the initial plan). A check at N (N a multiple of ``every``, N >= 1) that re-plans takes effect for
    the steps s >= N + lag."""
    out, cur = [], 0
    for s in range(steps):
        for n in range(every, s + 1, every):
            if n in replans_at_check and s == n + lag:
                cur = n
        out.append(cur)
    return out


def _plans_rank(rank, world, cfg_dict, run_dir, resume_from, out_path, check_delay, step_sleep):
    """A rank of ``train_distributed`` that logs, per step, the check step of the plan it trains under and its
    seconds in the monitor (``maybe_replan``) and in the whole step; ``check_delay``: the check sleeps first (the
    test hook), ``step_sleep``: every step sleeps (a slow step, so the lag's steps outlast the check)."""
    import time

    from embedscale.specs import RunConfig, from_dict
    from embedscale.train import replan
    from embedscale.train.distributed import DistributedRun
    from embedscale.train.ranks import train_distributed

    replan._CHECK_DELAY_S = check_delay
    log = []
    step_fn, monitor_fn = DistributedRun.train_step, replan.DriftMonitor.maybe_replan

    def maybe_replan(self, run):
        t0 = time.perf_counter()
        out = monitor_fn(self, run)
        log.append({"step": run.state.step, "monitor_s": time.perf_counter() - t0,
                    "plan_checked_at": int(run.plan.meta.get("replanned_at_step", 0))})
        return out

    def train_step(self, batch):
        t0 = time.perf_counter()
        time.sleep(step_sleep)
        loss = step_fn(self, batch)
        log[-1]["step_s"] = time.perf_counter() - t0
        return loss

    replan.DriftMonitor.maybe_replan, DistributedRun.train_step = maybe_replan, train_step
    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False, resume_from=resume_from)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(log, f)
    return True


def _cfg(tmp_path, data, lag, **kw):
    return to_dict(drift_config(tmp_path, data, replan_every=EVERY, replan_min_gain=0.0, replan_weigh_costs=False,
                                replan_lag=lag, **kw))


def _log(path, rank=0):
    return json.loads(open(f"{path}.{rank}").read())


@pytest.fixture(scope="module")
def lagged(tmp_path_factory):
    """The run with lag 2 and a checkpoint every step (7 steps; its check of step 4 re-plans, taken at step 6),
    each step's plan logged: one run for the tests that read it (they copy it before resuming)."""
    root = tmp_path_factory.mktemp("lagged")
    data = root / "data"
    drift_data(data)
    spawn_local(_plans_rank, W, _cfg(root, data, 2, checkpoint_every=1), str(root / "lagged"), None,
                str(root / "log"), 0.0, 0.0, timeout_s=600)
    return SimpleNamespace(root=root, data=data, run=root / "lagged", log=root / "log")


def test_lag_moves_the_rows_lag_steps_after_the_check_as_a_restart_would(tmp_path, lagged):
    """Lag 2, a check every 4 steps, 7 steps: the check of step 4 re-plans and steps 0-5 run under the initial
    plan, step 6 under the new one (the model); the new plan is the one the lag-0 run made at step 4 (the same
    profile); and the run equals the run without a monitor checkpointed at step 6 and restarted from there under
    that plan: losses, rows, row-wise state and dense state bit for bit. The lag-0 run's check sleeps 1.5 s (the
    test hook): rank 1 waits for the whole check at step 4 (>= 1.5 s in the monitor), the wait a lag removes
    (test_a_slow_check_does_not_stall_the_other_ranks)."""
    from embedscale.plan.plan import Plan

    data = lagged.data
    lag, delay = 2, 1.5
    now, static = tmp_path / "now", tmp_path / "static"
    spawn_local(_plans_rank, W, _cfg(tmp_path, data, 0), str(now), None, str(tmp_path / "log0"), delay, 0.0,
                timeout_s=600)
    assert [int(r["step"]) for r in read_replans(now)] == [EVERY]
    assert {e["step"]: e["monitor_s"] for e in _log(tmp_path / "log0", 1)}[EVERY] >= delay
    lagged = lagged.run
    rows = read_replans(lagged)
    assert [(int(r["step"]), int(r["checked_at"])) for r in rows] == [(EVERY + lag, EVERY)], rows
    want = plan_in_force(7, EVERY, lag, {EVERY})
    for rank in range(W):
        got = [e["plan_checked_at"] for e in _log(lagged.parent / "log", rank) if "step_s" in e]
        assert got == want, (rank, got, want)
    a, b = Plan.load(now / "replans" / f"step-{EVERY}"), Plan.load(lagged / "replans" / f"step-{EVERY + lag}")
    for name in ("part_table", "part_start", "part_stop", "owner_of_part", "holders", "fetch"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    # the reference: no monitor to step 6, then restarted under that plan
    cfg = drift_config(tmp_path, data, replan_every=0, max_steps=EVERY + lag, checkpoint_every=1)
    spawn_local(_drift_rank, W, to_dict(cfg), str(static), None, timeout_s=600)
    cfg = drift_config(tmp_path, data, replan_every=0, checkpoint_every=1)
    cfg.dist.plan = str(now / "replans" / f"step-{EVERY}")
    spawn_local(_drift_rank, W, to_dict(cfg), str(tmp_path / "restart"), str(step_dir(static, EVERY + lag)),
                timeout_s=600)
    assert_same_run(lagged, tmp_path / "restart", 7)


@pytest.mark.parametrize("at", [EVERY + 1, EVERY + 2])
def test_resume_inside_the_lag_window_equals_the_uninterrupted_run(tmp_path, at, lagged):
    """Lag 2: the check of step 4 is taken at step 6. A checkpoint at step 5 or 6 (after the check, before the
    rows move) resumes to the same losses, rows, row-wise state, dense state and replans.csv row as the
    uninterrupted run (its verdict was on disk before the checkpoint: the resumed run cannot check step 4 again,
    its profile has moved on)."""
    from embedscale.plan.plan import Plan

    whole = lagged.run
    cfg = _cfg(lagged.root, lagged.data, 2, checkpoint_every=1)
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    (cut / "replans.csv").unlink()  # written again by the resumed run
    spawn_local(_plans_rank, W, cfg, str(cut), str(step_dir(cut, at)), str(tmp_path / "log"), 0.0, 0.0,
                timeout_s=600)
    assert_same_run(whole, cut, 7)
    keys = ("step", "checked_at", "reason", "gain", "rows_moved", "bytes", "balance_before", "balance_after")
    want = [{k: r[k] for k in keys} for r in read_replans(whole)]
    assert [int(r["step"]) for r in want] == [EVERY + 2]
    assert [{k: r[k] for k in keys} for r in read_replans(cut)] == want
    # the plan each resumed step ran under (the model), and the one a later resume starts from (plan/)
    model = plan_in_force(7, EVERY, 2, {EVERY})[at:]
    for rank in range(W):
        assert [e["plan_checked_at"] for e in _log(tmp_path / "log", rank) if "step_s" in e] == model, rank
    a, b = Plan.load(whole / "replans" / f"step-{EVERY + 2}"), Plan.load(cut / "plan")
    assert np.array_equal(a.owner_of_part, b.owner_of_part) and np.array_equal(a.holders, b.holders)


def test_a_slow_check_does_not_stall_the_other_ranks(tmp_path):
    """8 steps. The check sleeps 1.5 s (the test hook); every step sleeps 0.6 s. Lag 3: the three steps after the
    check (>= 1.8 s) outlast it, so no step of rank 1 (its time in the monitor and in the step, where it would
    wait for rank 0 in the step's collectives) exceeds its median step by one step or more. (The same check with
    lag 0 holds rank 1 for all of it: test_lag_moves_the_rows_lag_steps_after_the_check_as_a_restart_would.)"""
    data = tmp_path / "data"
    drift_data(data)
    delay, sleep, lag = 1.5, 0.6, 3
    spawn_local(_plans_rank, W, _cfg(tmp_path, data, lag, max_steps=8), str(tmp_path / f"lag{lag}"), None,
                str(tmp_path / f"log{lag}"), delay, sleep, timeout_s=600)
    assert [int(r["step"]) for r in read_replans(tmp_path / f"lag{lag}")] == [EVERY + lag]
    log = _log(tmp_path / f"log{lag}", 1)
    step = float(np.median([e["step_s"] for e in log if "step_s" in e]))
    stall = {e["step"]: e["monitor_s"] + e["step_s"] - step for e in log if "step_s" in e}
    assert all(v < step for v in stall.values()), (stall, step)


def test_a_lag_beyond_the_monitoring_period_is_a_named_error():
    """Two checks in flight at once are refused: lag 5 with a check every 4 steps names the setting and both
    values; lag 4 (the verdict taken as the next check starts) and 0 are accepted."""
    import torch
    from types import SimpleNamespace

    from embedscale.errors import ConfigError
    from embedscale.specs import TableSpec
    from embedscale.train.replan import DriftMonitor

    run = SimpleNamespace(host_embedding=None, device=torch.device("cpu"),
                          tables=[TableSpec("t", 10, 4, features=["f"])])
    with pytest.raises(ConfigError, match=r"train\.replan_lag 5.*train\.replan_every \(4\)"):
        DriftMonitor(run, 4, 0.05, 5)
    assert DriftMonitor(run, 4, 0.05, 4).lag == 4 and DriftMonitor(run, 4, 0.05, 0).lag == 0


def test_a_check_that_outlasts_the_lag_is_taken_a_period_later_and_no_rank_waits(tmp_path):
    """Lag 1, a check every 4 steps, 12 steps of 0.5 s; the check of step 4 sleeps 0.8 s (the test hook), so it is
    not done at step 5: rank 0 answers "not ready" and every rank asks again at step 9 (no check starts at step 8
    while one is in flight), where it re-plans. The model: steps 0-8 under the initial plan, 9-11 under the
    check of step 4's; no step of rank 1 exceeds its median step by one step or more (the lag-0 run of
    test_a_slow_check_does_not_stall_the_other_ranks shows the wait this replaces). A resume from the checkpoint of
    step 8, inside the deferred window, equals the uninterrupted run."""
    data = tmp_path / "data"
    drift_data(data)
    spawn_local(_plans_rank, W, _cfg(tmp_path, data, 1, max_steps=12), str(tmp_path / "run"), None,
                str(tmp_path / "log"), 0.8, 0.5, timeout_s=600)
    rows = read_replans(tmp_path / "run")
    assert [(int(r["step"]), int(r["checked_at"])) for r in rows] == [(EVERY * 2 + 1, EVERY)], rows
    want = [0] * (EVERY * 2 + 1) + [EVERY] * (12 - EVERY * 2 - 1)
    for rank in range(W):
        got = [e["plan_checked_at"] for e in _log(tmp_path / "log", rank) if "step_s" in e]
        assert got == want, (rank, got, want)
    log = _log(tmp_path / "log", 1)
    step = float(np.median([e["step_s"] for e in log if "step_s" in e]))
    stall = {e["step"]: e["monitor_s"] + e["step_s"] - step for e in log if "step_s" in e}
    assert all(v < step for v in stall.values()), (stall, step)
    # resumed from the checkpoint of step 8 (inside the deferred window), the run takes the verdict at step 9 and
    # equals the uninterrupted run (losses, rows, row-wise and dense state)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", cut)
    (cut / "replans.csv").unlink()
    spawn_local(_drift_rank, W, _cfg(tmp_path, data, 1, max_steps=12), str(cut), str(step_dir(cut, 2 * EVERY)),
                timeout_s=600)
    assert_same_run(tmp_path / "run", cut, 12)
    assert [(int(r["step"]), int(r["checked_at"])) for r in read_replans(cut)] == [(EVERY * 2 + 1, EVERY)]


def test_a_checkpoint_inside_the_window_publishes_the_verdict_first(tmp_path):
    """``settle`` (before a checkpoint is written) waits for the check still running and publishes its verdict for
    the step it will be taken at: the staged plans (``replans/check-4/``) become ``replans/step-9/`` (a check of
    step 4, lag 1, deferred once: 4 + 1 + 4) and ``plan/`` holds the new plan's files, byte for byte."""
    import threading
    import time

    from embedscale.train.replan import DriftMonitor, PendingCheck

    stage = tmp_path / "replans" / "check-4"
    (stage / "before").mkdir(parents=True)
    files = {"rows_by_partition.npy": b"order", "partitions.npz": b"parts", "plan.json": b'{"new": 1}'}
    for name, data in files.items():
        (stage / name).write_bytes(data)
        (stage / "before" / name).write_bytes(b"old " + data)
    p = PendingCheck(step=4, apply_at=9, run_dir=tmp_path, deferred=1)

    def check():  # a check that finishes after settle is called
        time.sleep(0.3)
        p.verdict = 1

    p.thread = threading.Thread(target=check)
    p.thread.start()
    mon = DriftMonitor.__new__(DriftMonitor)
    mon.lag, mon._pending = 1, p
    mon.settle()
    assert p.verdict == 1 and not stage.exists()
    for name, data in files.items():
        assert (tmp_path / "replans" / "step-9" / name).read_bytes() == data
        assert (tmp_path / "replans" / "step-9" / "before" / name).read_bytes() == b"old " + data
        assert (tmp_path / "plan" / name).read_bytes() == data
