"""The drift alarm of spaced-out checks (train.replan): the reads it samples, its two figures, and the check it
brings forward, each against an independent reference (the plan's owner arrays, hand-worked figures, a hand-worked
schedule)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedscale.comm.collective import CollectiveTransport
from embedscale.data.batch import JaggedFeatures
from embedscale.data.profile import AccessProfile
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.plan.api import make_plan
from embedscale.specs import DistConfig, TableSpec, Topology
from embedscale.train.replan import CHECKPOINT_KEY, DriftMonitor, alarm_fires, alarm_stats, resume_plan

W = 3
SHARDED = [TableSpec("t0", 40, 4, features=["f0"]), TableSpec("t1", 7, 4, features=["f1", "f2"]),
           TableSpec("t2", 90, 4, features=["f3"])]


def _placement():
    rng = np.random.default_rng(3)
    owner = [rng.integers(0, W, t.num_rows) for t in SHARDED]
    replicas = [np.array([], dtype=np.int64), np.array([2, 5]), np.array([0, 10, 11, 89])]
    holders = np.zeros((6, W), dtype=bool)
    holders[:, 0] = holders[:, 1] = True  # every replica on ranks 0 and 1; rank 2 reads them from their owner
    return owner, replicas, holders


def _served_by(rank, table, row, owner, replicas, holders):
    """Plain Python: the rank a value is read from (a replica held here is read here, else from its owner)."""
    slots = [(t, int(r)) for t, rows in enumerate(replicas) for r in rows]
    if (table, row) in slots and holders[slots.index((table, row)), rank]:
        return rank
    return int(owner[table][row])


@pytest.mark.parametrize("max_values", [10**6, 50])
def test_read_ranks_counts_each_sampled_value_at_the_rank_that_serves_it(max_values):
    owner, replicas, holders = _placement()
    amap = AddressMap.build(SHARDED, W, owner, replicas, holders)
    rng = np.random.default_rng(5)
    keys = ["f0", "f1", "other", "f2", "f3"]  # "other": a feature of no table of this module (a TT table's)
    rows = {"f0": 40, "f1": 7, "other": 1000, "f2": 7, "f3": 90}
    table = {"f0": 0, "f1": 1, "f2": 1, "f3": 2}
    lengths = rng.integers(0, 4, (len(keys), 16))
    lengths[0, 0] = lengths[4, -1] = 2
    vals = [rng.integers(0, rows[k], int(lengths[i].sum())) for i, k in enumerate(keys)]
    vals[0][0], vals[4][-1] = -1, 90  # outside their tables: left out of the sample (the lookup rejects them)
    jf = JaggedFeatures(keys, torch.from_numpy(np.concatenate(vals)), torch.from_numpy(lengths.reshape(-1)))
    flat = [(k, int(row)) for k, v in zip(keys, vals) for row in v]  # the batch's values in their order
    stride = max(1, -(-len(flat) // max_values))
    for rank in range(W):
        emb = ShardedEmbedding(SHARDED, amap, CollectiveTransport(rank=rank, world_size=W), rank, optimizer=None)
        want = np.zeros(W, dtype=np.int64)
        for k, row in flat[::stride]:
            if k in table and 0 <= row < rows[k]:
                want[_served_by(rank, table[k], row, owner, replicas, holders)] += 1
        got = emb.read_ranks(jf, max_values)
        assert got.tolist() == want.tolist(), (rank, max_values)
    assert stride > 1 or max_values > len(flat)


def test_alarm_figures_and_threshold_hand_worked():
    # rank 0 reads 2 values at home and 8 at rank 1; rank 1 reads 10 at home: m = 10 lookups a rank;
    # rank 1 serves 18 (1.8 m); each rank moves 8 values (0.8 m)
    assert alarm_stats([[2, 8], [0, 10]]) == pytest.approx((1.8, 0.8))
    assert alarm_stats([[5, 5], [5, 5]]) == pytest.approx((1.0, 1.0))
    assert alarm_stats([[0, 0], [0, 0]]) == (0.0, 0.0)
    base = (1.0, 0.0)  # balanced, every read local
    assert not alarm_fires((1.05, 0.0), base, 0.05) and alarm_fires((1.06, 0.0), base, 0.05)
    assert not alarm_fires((1.0, 0.05), base, 0.05) and alarm_fires((1.0, 0.051), base, 0.05)
    base = (1.2, 2.0)  # the rise counted of the figure itself when it is above the mean lookups
    assert not alarm_fires((1.26, 2.1), base, 0.05) and alarm_fires((1.27, 2.0), base, 0.05)
    assert alarm_fires((1.2, 2.11), base, 0.05)


# -- the schedule: one process standing for rank 0 of two (its group of one sums nothing else) ----------------
EVERY, LAG, STEPS = 4, 1, 140
TABLES = [TableSpec("a", 50, 4, features=["x"]), TableSpec("b", 30, 4, features=["y"])]


class _Reader:
    """Rank 0's reads of each batch as a stand-in module decodes them: balanced until ``drift_at``, then most of
    them at rank 1 (the hot rows moved there)."""

    def __init__(self, drift_at):
        self.drift_at, self.step, self.calls = drift_at, 0, []

    def read_ranks(self, features, max_values):
        self.calls.append(self.step)
        return torch.tensor([3000, 3000] if self.step < self.drift_at else [1000, 5000])


def _batch(step):
    rng = np.random.default_rng(step)
    return JaggedFeatures.from_dense(["x", "y"], torch.from_numpy(np.stack(
        [rng.integers(0, 50, 16), rng.integers(0, 30, 16)], axis=1)))


def _run(tmp_path):
    plan = make_plan("oper", TABLES, AccessProfile({"a": np.ones(50), "b": np.ones(30)}, 16),
                     Topology(ranks_per_host=1), batch_size=16)
    return SimpleNamespace(host_embedding=None, device=torch.device("cpu"), tables=TABLES, plan=plan, rank=0,
                           world=1, monitor_group=None, run_dir=tmp_path, state=SimpleNamespace(step=0),
                           cfg=SimpleNamespace(dist=DistConfig(), train=SimpleNamespace(
                               batch_size=16, max_steps=STEPS, replan_weigh_costs=True)))


def _monitor(run):
    mon = DriftMonitor(run, EVERY, 0.05, LAG)
    mon._world = 2  # rank 0 of two: its row of the reads; the group of one returns it as the sum
    run.monitor = mon
    return mon


def _steps(run, mon, reader, start, stop, log):
    for s in range(start, stop):
        run.state.step = reader.step = s
        mon.settle()
        before = mon.checks
        mon.maybe_replan(run)
        if mon.checks > before:
            log.append(s)
        mon.observe(_batch(s), 16, reader=reader)


@pytest.mark.parametrize("drift_at,want", [(None, [4, 12, 28, 60, 124]), (85, [4, 12, 28, 60, 108]),
                                           (84, [4, 12, 28, 60, 96]), (62, [4, 12, 28, 60, 84]),
                                           (60, [4, 12, 28, 60, 84])])
def test_a_drift_brings_the_next_check_forward(tmp_path, group, drift_at, want):
    """Checks that keep the plan space out (4, 12, 28, 60, then 64 steps). The batch before each check sets the
    alarm's base (judged a period later); the alarm samples the first batch of every third period (steps 12, 24,
    ...) after the check at 60 (its verdict at 61) before 116, two periods before the next check, each judged a
    period after it. Reads that move to rank 1 from the batch of step 84 are judged at 88 and the check comes two
    periods later, at 96; from step 85 the sample of 96, judged at 100, brings it to 108; from step 62, or from the
    check's own step 60 (its profile and base the reads before it), the first sample (72, judged at 76) brings it
    to 84."""
    run, reader, log = _run(tmp_path), _Reader(drift_at or 10**9), []
    mon = _monitor(run)
    _steps(run, mon, reader, 0, STEPS, log)
    assert log == want
    assert mon.alarms == (0 if drift_at is None else 1)
    # sampled before each check (the base) and while the profile is not counted: after the check at 28 (none after
    # 12: 24 is counted) and from 72 until the sample that fired (or the last one before 116, two periods before the
    # check), then before the check it brought forward
    got = [c for c in reader.calls if c < want[-1]]
    assert got == [3, 11, 27, 36, 48, 59, *range(72, min(want[-1] - 3 * EVERY, 108) + 1, 12), want[-1] - 1]


@pytest.mark.parametrize("cut", [62, 74, 78, 86, 89])
def test_a_resume_takes_the_alarm_as_the_uninterrupted_run(tmp_path, group, cut):
    """A checkpoint with the check's base sample in flight (62: sampled at 59, judged at 63), a period's sample in
    flight (74: sampled at 72, judged at 76), the alarm's base set (78), the drifted sample in flight (86: sampled at
    84, judged at 88), and after it fired (89): the resumed run checks at the same steps."""
    run, log = _run(tmp_path), []
    _steps(run, _monitor(run), _Reader(84), 0, STEPS, log)
    first, got = _monitor(run), []
    _steps(run, first, _Reader(84), 0, cut, got)
    first.settle()
    state = {k: v.clone() for k, v in first.state_dict().items()}
    resumed = _monitor(run)
    run.state.step = cut
    resumed.restore([{"rank": 0, CHECKPOINT_KEY: state}], 0, 1)
    resume_plan(run)
    _steps(run, resumed, _Reader(84), cut, STEPS, got)
    assert got == log == [4, 12, 28, 60, 96]
