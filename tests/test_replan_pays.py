"""The drift monitor's cost rule: a re-plan only when its predicted gain over the steps to the next check
outweighs the check and the migration. Hand-worked cases (figures chosen so every term is exact arithmetic)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from embedscale.train.replan import DriftMonitor, migration_seconds, replan_pays


def test_replan_pays_by_hand():
    # 0.1 ms a step saved over 5 steps = 0.5 ms against a 0.3 ms check and a 0.1 ms migration: pays
    assert replan_pays(1e-4, 5, 3e-4, 1e-4) is True
    # ... against a 0.3 ms check and a 0.3 ms migration (0.6 ms): does not
    assert replan_pays(1e-4, 5, 3e-4, 3e-4) is False
    # equal is not more: declined
    assert replan_pays(1e-4, 4, 2e-4, 2e-4) is False
    assert replan_pays(1.0, 0, 0.0, 0.0) is False  # no step left to gain on


def test_migration_seconds_by_hand():
    # 1e8 bytes at 100 GB/s, sent and written: 2 ms
    assert migration_seconds(1e8, 100.0) == pytest.approx(2e-3, rel=1e-12)
    # the run's last migration took 50 ms for 1e7 bytes: 5e-9 s a byte, so 2e7 bytes take 100 ms
    assert migration_seconds(2e7, 100.0, (0.05, 1e7)) == pytest.approx(0.1, rel=1e-12)


def _monitor(every, records=()):
    mon = DriftMonitor.__new__(DriftMonitor)
    mon.every, mon.min_gain, mon.records, mon.declined = every, 0.0, list(records), 0
    return mon


def _run(step, max_steps):
    return SimpleNamespace(state=SimpleNamespace(step=step),
                           cfg=SimpleNamespace(train=SimpleNamespace(max_steps=max_steps),
                                               dist=SimpleNamespace(topology_hosts=1)))


def _report(rows, row_bytes=12):
    # plan.cost's figures are microseconds a step: 1000 us running, 900 us new: 0.1 ms a step saved
    return {"replan": True, "reason": "gain", "after": {"max_rank_cost": 1000.0},
            "replanned": {"max_rank_cost": 900.0}, "rows_moved": rows, "bytes_moved": rows * row_bytes}


def test_the_monitor_declines_a_replan_whose_gain_is_below_its_cost():
    """Gain 0.1 ms a step x 5 steps = 0.5 ms. Moving 10M rows of 12 bytes (+ 4 bytes of state each: 1.6e8 bytes)
    at 100 GB/s (the default intra-host link), sent and written, takes 3.2 ms: declined. Moving 1000 rows
    (1.6e4 bytes: 0.32 us) with a 0.3 ms check: 0.30032 ms < 0.5 ms, taken."""
    mon = _monitor(5)
    rep = _report(10_000_000)
    mon._weigh_costs(_run(10, 100), rep, 3e-4)
    assert rep["replan"] is False and mon.declined == 1, rep
    assert rep["replan_costs"]["migrate_s"] == pytest.approx(3.2e-3, rel=1e-9)
    assert rep["replan_costs"]["gain_per_step_s"] == pytest.approx(1e-4, rel=1e-9)
    rep = _report(1000)
    mon._weigh_costs(_run(10, 100), rep, 3e-4)
    assert rep["replan"] is True and mon.declined == 1, rep


def test_the_steps_left_in_the_run_cap_the_gain_and_a_measured_migration_prices_the_next():
    # the same small move, but 2 steps left: 0.2 ms < 0.30032 ms: declined
    mon = _monitor(5)
    rep = _report(1000)
    mon._weigh_costs(_run(98, 100), rep, 3e-4)
    assert rep["replan"] is False and rep["replan_costs"]["steps_to_next_check"] == 2
    # an earlier migration of 1.6e4 bytes measured 0.25 ms: the same move now costs 0.25 ms; 0.3 + 0.25 > 0.5
    mon = _monitor(5, [{"bytes": 16_000, "migrate_seconds": 2.5e-4}])
    rep = _report(1000)
    mon._weigh_costs(_run(10, 100), rep, 3e-4)
    assert rep["replan"] is False and rep["replan_costs"]["migrate_s"] == pytest.approx(2.5e-4, rel=1e-9)


def test_a_check_that_no_plan_could_pay_for_keeps_the_plan_without_planning():
    """Before it plans, the monitor bounds the gain of any plan: every access is looked up once, by some rank,
    at the local bandwidth (OPER eq. 2), so no plan's bottleneck is below the ranks' mean lookup. A plan of 2
    ranks whose hot rows sit on rank 0: the bound (its bottleneck less the mean lookup, worked by hand with
    OPER's equations, tests/test_migrate.py ``hand_cost``) x 5 steps against the last planning's seconds just
    above it: kept, no fresh plan, one decline; just below: the monitor plans (and re-plans)."""
    import numpy as np

    from embedscale.data.profile import AccessProfile
    from embedscale.plan.api import make_plan
    from embedscale.specs import DistConfig, TableSpec, Topology

    from test_migrate import hand_cost

    ts = [TableSpec("a", 3000, 8, features=["a"]), TableSpec("b", 2000, 8, features=["b"])]
    rng = np.random.default_rng(1)
    old = AccessProfile({t.name: rng.poisson(5, t.num_rows).astype(float) for t in ts}, 10_000)
    W, B = 2, 128
    topo = Topology(ranks_per_host=W)
    plan = make_plan("oper", ts, old, topo, batch_size=B // W)
    counts = {t.name: rng.poisson(5, t.num_rows).astype(float) for t in ts}
    counts["a"][np.flatnonzero(plan.owner("a", np.arange(3000)) == 0)[:16]] += 2000.0
    new = AccessProfile(counts, 10_000)
    hand = hand_cost(plan, counts, new.samples, topo, B // W)
    bound = (hand["total"].max() - hand["lookup"].mean()) * 1e-6  # seconds a step
    run = SimpleNamespace(cfg=SimpleNamespace(dist=DistConfig(), train=SimpleNamespace(
        batch_size=B, max_steps=100, replan_weigh_costs=True)), world=W, plan=plan, state=SimpleNamespace(step=10))
    for scale, kept in ((1.001, True), (0.999, False)):
        mon = _monitor(5)
        mon.min_gain, mon.lag, mon.plan_seconds = 0.05, 0, bound * 5 * scale
        report, fresh = mon._check(run, new)
        assert (fresh is None) == kept and mon.declined == int(kept), (scale, report["reason"])
        assert report["replan"] is not kept
        if kept:
            assert report["replan_costs"]["gain_bound_per_step_s"] == pytest.approx(bound, rel=1e-9)
            assert "no plan saves" in report["reason"]


def test_checks_that_keep_the_plan_without_a_search_space_out_the_next_ones():
    """The periods to the next check, worked by hand: each check that kept the plan (it held, no plan could pay, or
    the plan it searched did not pay) doubles them (2, 4, 8, 16, then capped at 16); a check that re-planned resets
    them to 1; a check where not even a plan that removed the whole measured step could pay goes straight to 16."""
    from embedscale.train.replan import MAX_QUIET_PERIODS, PendingCheck

    assert MAX_QUIET_PERIODS == 16
    mon = _monitor(5)
    mon._quiet_streak = 0
    searched = [False, False, False, False, False, False, True, False, True, True, False, False, True, True, True]
    replanned = [False] * 6 + [True, False, True, True, False, False, True, False, False]
    idle = [False] * 10 + [True, False, False, False, False]
    want = [2, 4, 8, 16, 16, 16, 1, 2, 1, 1, 16, 16, 1, 2, 4]
    got = [mon._quiet_periods(PendingCheck(step=5 * (i + 1), apply_at=5 * (i + 1) + 1, searched=s, idle=d,
                                           verdict=int(r)))
           for i, (s, d, r) in enumerate(zip(searched, idle, replanned))]
    assert got == want


def test_while_checks_are_spaced_out_only_the_batches_of_the_last_two_periods_are_counted():
    """A check every 5 steps whose next check is at step 40 (spaced out): the batches of steps 0-29 only decay the
    profile, those of steps 35-39 are counted, and those of 30-34 each with probability 1/4, weighing 4. The
    reference: the decayed count worked in float64 by hand, an access at step s weighing q^(39 - s) at the end of
    step 39 (q = 0.5^(1/5)): steps 35-39 exactly, and per seed what 30-34 add is 4 q^(39 - s) over some subset of
    their steps; over 300 seeds its mean is the full count within 5 standard errors."""
    import itertools

    import numpy as np
    import torch

    from embedscale.specs import TableSpec
    from test_mutants_replan import _Sparse

    run = SimpleNamespace(host_embedding=None, device=torch.device("cpu"),
                          tables=[TableSpec("t", 4, 2, features=["f"])])
    q = 0.5 ** (1 / 5)
    late = np.array([sum(q ** (39 - s) for s in range(35, 40) if s % 4 == r) for r in range(4)])
    early = {r: [q ** (39 - s) for s in range(30, 35) if s % 4 == r] for r in range(4)}
    sums = {r: [4 * sum(c) for k in range(len(w) + 1) for c in itertools.combinations(w, k)]
            for r, w in early.items()}
    got = []
    for seed in range(300):
        mon = DriftMonitor(run, 5, 0.05, seed=seed)
        mon._quiet_until = 40
        for s in range(40):
            mon._step = s
            mon.observe(_Sparse({"f": [s % 4]}), samples=1)
        c = mon.profile.counts("t").double().numpy()
        for r in range(4):
            assert min(abs(c[r] - late[r] - x) for x in sums[r]) < 1e-9, (seed, r, c[r])
        got.append(c)
    full = late + np.array([sum(w) for w in early.values()])
    se = np.sqrt(np.array([3 * sum(x * x for x in w) for w in early.values()]) / 300)
    assert np.all(np.abs(np.mean(got, axis=0) - full) <= 5 * se), (np.mean(got, axis=0), full)
    assert 0.5 < np.mean([g.sum() > late.sum() + 1e-9 for g in got]) < 0.9  # 1 - (3/4)^5 = 0.76: one or more


def test_gain_seconds_by_hand():
    # the model's 100 us of a 1000 us bottleneck is a tenth of the step: of a measured 12 ms step, 1.2 ms
    from embedscale.train.replan import gain_seconds

    assert gain_seconds(100.0, 1000.0, 0.012) == pytest.approx(1.2e-3, rel=1e-12)
    assert gain_seconds(100.0, 1000.0, None) == pytest.approx(1e-4, rel=1e-12)  # no step measured: the model's
    assert gain_seconds(100.0, 0.0, 0.012) == pytest.approx(1e-4, rel=1e-12)


def test_the_monitor_weighs_the_gain_in_the_runs_measured_step_seconds():
    """The run measured steps of 11, 12, 13, 40 and 12 ms (median 12 ms). The new plan lowers the model's
    bottleneck from 1000 to 900 us: a tenth of the step, 1.2 ms a step x 5 steps = 6 ms. An earlier migration of
    1.6e4 bytes measured 2 ms, so the same move costs 2 ms: with a 5 ms check 7 ms > 6 ms, declined; with a 3 ms
    check 5 ms < 6 ms, taken. In the model's own microseconds (0.1 ms x 5 = 0.5 ms) both would be declined."""
    from collections import deque

    def monitor():
        mon = _monitor(5, [{"bytes": 16_000, "migrate_seconds": 2e-3}])
        mon._step_times = deque(maxlen=32)
        for s in (0.011, 0.012, 0.013, 0.040, 0.012):
            mon.stepped(s)
        mon._step_s = mon.measured_step_s()  # as the check's start takes it (rank 0)
        assert mon._step_s == 0.012
        return mon

    even = _monitor(5)  # an even count: the mean of the middle two, 11 and 13 ms
    even._step_times = deque(maxlen=32)
    for s in (0.010, 0.013, 0.011, 0.040):
        even.stepped(s)
    assert even.measured_step_s() == pytest.approx(0.012, rel=1e-12)

    for check_s, taken in ((5e-3, False), (3e-3, True)):
        mon, rep = monitor(), _report(1000)
        mon._weigh_costs(_run(10, 100), rep, check_s)
        assert rep["replan"] is taken and mon.declined == int(not taken), rep
        assert rep["replan_costs"]["gain_per_step_s"] == pytest.approx(1.2e-3, rel=1e-9)
        assert rep["replan_costs"]["migrate_s"] == pytest.approx(2e-3, rel=1e-9)
        mon, rep = _monitor(5, [{"bytes": 16_000, "migrate_seconds": 2e-3}]), _report(1000)  # no step measured
        mon._weigh_costs(_run(10, 100), rep, check_s)
        assert rep["replan"] is False


def test_the_gain_bound_in_measured_seconds_and_the_idle_check_by_hand():
    """The running plan's modelled bottleneck 1000 us, the ranks' mean lookup 800 us: no plan saves more than a
    fifth of the step; of a measured 12 ms step, 2.4 ms x 5 steps = 12 ms. Against the last planning's 100 ms:
    kept without planning, and idle (even the whole step, 5 x 12 = 60 ms, cannot pay); against 30 ms: kept, not
    idle (60 ms > 30 ms); against 10 ms: the check plans (12 ms > 10 ms)."""
    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(max_steps=100, replan_weigh_costs=True)))
    for plan_s, kept, idle in ((0.1, True, True), (0.03, True, False), (0.01, False, None)):
        mon = _monitor(5)
        mon.lag, mon.plan_seconds, mon._step_s = 1, plan_s, 0.012
        report = {"after": {"max_rank_cost": 1000.0, "lookup_mean": 800.0}, "replan": True}
        assert mon._cannot_pay(run, report, 10) is kept
        if kept:
            assert report["replan_costs"]["gain_bound_per_step_s"] == pytest.approx(2.4e-3, rel=1e-9)
            assert report["replan_costs"]["whole_step_cannot_pay"] is idle
