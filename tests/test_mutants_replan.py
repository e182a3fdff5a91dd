"""Online re-planning (``train.replan``, ``plan.drift``, ``plan.incremental``) against independent references.

- the drift monitor's half-life: an access weighs exactly one half after one monitoring period (float64);
- an incremental plan worse than the fresh one is rejected: the lookups of each rank counted row by row
  (OPER eq. 2) show it far above the fresh plan;
- a plan whose communication balance alone degrades: eqs. 2-5 worked in plain Python on a three-rank plan
  whose lookups stay balanced;
- the incremental plan's moved rows on a hand-worked case (the rule of ``plan.incremental``, step by step);
- ``replans.csv`` after a resume at a logged step: a plain list model of the rows a resumed run rewrites.
"""

from __future__ import annotations

import csv
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedscale.data.profile import AccessProfile
from embedscale.plan.plan import Plan
from embedscale.specs import TableSpec, Topology


# -- the drift monitor's decay -----------------------------------------------------------------------------------

class _Sparse:
    """The part of a batch's sparse features the monitor reads: ``to_dict() -> {feature: (values, ...)}``."""

    def __init__(self, rows: dict):
        self.rows = rows

    def to_dict(self):
        return {f: (torch.tensor(r, dtype=torch.int64), None) for f, r in self.rows.items()}


@pytest.mark.parametrize("every", [1, 4, 7])
def test_monitor_halves_an_access_after_one_monitoring_period(every):
    from embedscale.train.replan import DriftMonitor

    run = SimpleNamespace(host_embedding=None, device=torch.device("cpu"),
                          tables=[TableSpec("t", 10, 4, features=["f", "g"])])
    mon = DriftMonitor(run, every, 0.05)
    mon.observe(_Sparse({"f": [3, 3], "g": [5]}), samples=2)  # step 1: row 3 twice, row 5 once
    for _ in range(every):  # one period of batches that read only row 0
        mon.observe(_Sparse({"f": [0], "g": []}), samples=1)
    c = mon.profile.counts("t").double()
    assert float(c[3]) == pytest.approx(2 * 0.5, rel=1e-12)  # two accesses, one half-life ago
    assert float(c[5]) == pytest.approx(0.5, rel=1e-12)
    q = 0.5 ** (1.0 / every)  # the per-step factor of a half-life of `every` steps, float64
    assert float(c[0]) == pytest.approx(sum(q**k for k in range(every)), rel=1e-12)
    assert mon.profile.samples == pytest.approx(2 * 0.5 + sum(q**k for k in range(every)), rel=1e-12)
    for _ in range(every):  # a second period: a quarter
        mon.observe(_Sparse({"f": [], "g": []}), samples=0)
    assert float(mon.profile.counts("t")[3]) == pytest.approx(2 * 0.25, rel=1e-12)


# -- plans by hand ------------------------------------------------------------------------------------------------

def _hand_plan(tables, world, owners, holders=None, fetch=None, meta=None) -> Plan:
    """A plan with one partition per row: ``owners[t][r]`` owns row r of table t (holders / fetch per row)."""
    orders, pt, ps, pe, po = [], [], [], [], []
    for t, own in enumerate(owners):
        n = len(own)
        orders.append(np.arange(n, dtype=np.int64))
        pt += [t] * n
        ps += list(range(n))
        pe += list(range(1, n + 1))
        po += list(own)
    return Plan(tables, world, orders, pt, ps, pe, po, holders=holders, fetch=fetch, meta=dict(meta or {}))


def _lookup_per_rank(plan: Plan, counts: dict, samples: float, batch: int) -> np.ndarray:
    """OPER eq. 2 row by row: every rank reads row k ``B c_k / samples`` times from its fetch rank; the rank
    that serves it carries ``S_k`` bytes per read (in bytes; the topology's per-byte factor is the same on
    every rank here)."""
    load = np.zeros(plan.world_size)
    for tab in plan.tables:
        a = batch * np.asarray(counts[tab.name], dtype=np.float64) / samples * tab.row_bytes
        for i in range(plan.world_size):
            src = plan.fetch_rank(tab.name, np.arange(tab.num_rows), i)
            for k in range(tab.num_rows):
                load[int(src[k])] += a[k]
    return load


def test_an_incremental_plan_worse_than_the_fresh_one_is_rejected():
    """Table a (1200 rows, every one read alike) on rank 0, table b (1150 rows, never read) on rank 1. The
    incremental plan may move at most 64 rows, so rank 0 keeps at least 1136 of a's 1200 rows' lookups (eq. 2
    row by row) while the fresh plan splits them about evenly; its moves fit the memory and lower the running
    plan's bottleneck, so only the comparison with the fresh plan can reject it. The monitor's choice
    (``DriftMonitor._prefer_incremental``, after ``plan.drift``'s verdict as in its check) must be the fresh
    plan, and the report must describe the fresh plan."""
    from embedscale.plan.drift import drift_and_plan
    from embedscale.plan.incremental import incremental_plan
    from embedscale.train.replan import DriftMonitor

    W, B = 2, 64
    tabs = [TableSpec("a", 1200, 8, features=["a"]), TableSpec("b", 1150, 8, features=["b"])]
    counts = {"a": np.full(1200, 5.0), "b": np.zeros(1150)}
    prof = AccessProfile(counts, 10_000)
    plan = _hand_plan(tabs, W, [np.zeros(1200, dtype=np.int64), np.ones(1150, dtype=np.int64)],
                      meta={"strategy": "oper"})
    topo = Topology(ranks_per_host=W, intra_host_latency_us=0.0)  # the bytes alone decide
    report, fresh = drift_and_plan(plan, prof, topo, old_profile=prof, batch_size=B, min_gain=0.0, dob_floor=0.9)
    assert report["replan"] is True and fresh is not None
    # the two candidates, by hand
    inc, changed = incremental_plan(plan, fresh, prof, batch_size=B)
    assert changed <= 64
    load_inc = _lookup_per_rank(inc, counts, prof.samples, B)
    load_fresh = _lookup_per_rank(fresh, counts, prof.samples, B)
    assert load_inc.max() >= (1136 / 1200) * load_inc.sum() - 1e-6  # rank 0 keeps >= 1136 of a's rows
    assert load_fresh.max() <= 0.55 * load_fresh.sum(), load_fresh  # the fresh plan: about even
    assert load_inc.max() > 1.5 * load_fresh.max(), (load_inc, load_fresh)
    # the monitor takes the fresh plan
    mon = DriftMonitor.__new__(DriftMonitor)
    mon.min_gain = 0.0
    before = dict(report)
    chosen = mon._prefer_incremental(plan, fresh, prof, topo, report, "training", B)
    assert chosen is fresh and not chosen.meta.get("incremental")
    assert report == before and report["replan_strategy"] == "oper"


# -- the communication balance alone ---------------------------------------------------------------------------

def test_a_plan_whose_communication_balance_alone_degrades_is_re_planned():
    """Three ranks, one table of four rows: a (rank 0, unread), b (rank 2), c (held by ranks 0 and 1, rank 2
    reads it from 0), d (rank 1). On the new profile (b, c, d read 2, 3, 1 times per sample) the lookups are
    6, 6, 6 (balanced, eq. 2) while the fetches are 3, 2, 4 (eq. 3): the communication DoB is about 0.5.
    Worked in plain Python (lookup, fetch, gradient return, latency rounds, the replica's all-reduce); the
    drift rule must re-plan on the communication balance alone."""
    from embedscale.plan.drift import drift_and_plan

    tab = TableSpec("t", 4, 8, features=["t"])
    W, B, S = 3, 100_000, tab.row_bytes  # bytes dominate the latency rounds
    holders = np.array([[1, 0, 0], [0, 0, 1], [1, 1, 0], [0, 1, 0]], dtype=bool)
    fetch = np.array([[0, 0, 0], [2, 2, 2], [0, 1, 0], [1, 1, 1]], dtype=np.int32)
    plan = _hand_plan([tab], W, [np.array([0, 2, 0, 1])], holders=holders, fetch=fetch,
                      meta={"strategy": "oper", "batch_size": B, "mode": "training"})
    samples = 1000
    old = AccessProfile({"t": np.array([1.0, 1.0, 1.0, 1.0]) * samples}, samples)
    new = AccessProfile({"t": np.array([0.0, 2.0, 3.0, 1.0]) * samples}, samples)
    topo = Topology(num_hosts=1, ranks_per_host=3)
    # the reference: eqs. 2-5 in plain Python (L in microseconds per byte: 1 / (GB/s * 1e3))
    l_local, l_link = 1.0 / (topo.local_bw * 1e3), 1.0 / (topo.intra_host_bw * 1e3)
    reads = B * np.array([0.0, 2.0, 3.0, 1.0]) * S  # bytes every rank reads of each row per iteration
    lookup, comm = np.zeros(W), np.zeros(W)
    for k in range(4):
        for i in range(W):
            j = fetch[k, i]
            lookup[j] += reads[k] * l_local
            if j != i and reads[k] > 0:
                comm[i] += 2 * reads[k] * l_link  # the fetch and the gradient's return
    comm += 2 * topo.intra_host_latency_us  # every rank fetches from a peer: two latency rounds
    h = holders.sum(axis=1)
    for k in range(4):  # eq. 5: a replicated row all-reduced among its holders
        if h[k] > 1:
            comm[holders[k]] += 2 * (h[k] - 1) / h[k] * S / (topo.allreduce_bw * 1e3)
    dob = lambda x: x.min() / x.max()  # noqa: E731
    assert dob(lookup) == pytest.approx(1.0) and dob(comm) < 0.6, (lookup, comm)
    rep, fresh = drift_and_plan(plan, new, topo, old_profile=old, batch_size=B, replan=False, dob_floor=0.9)
    assert fresh is None
    assert rep["after"]["dob_lookup"] == pytest.approx(dob(lookup), rel=1e-9)
    assert rep["after"]["dob_comm"] == pytest.approx(dob(comm), rel=1e-9)
    assert rep["replan"] is True and "balance" in rep["reason"], rep["reason"]
    # with a fresh plan that gains nothing measurable the rule still re-plans, for the balance
    rep2, _ = drift_and_plan(plan, new, topo, old_profile=old, batch_size=B, min_gain=10.0, dob_floor=0.9)
    assert rep2["replan"] is True and "balance" in rep2["reason"], rep2["reason"]


# -- the incremental plan's moves, by hand ---------------------------------------------------------------------------

def test_incremental_plan_moves_the_hand_worked_rows():
    """Two ranks, one table of 8 rows: rows 0-3 on rank 0, 4-7 on rank 1; new counts 10, 6, 1, 1 | 1, 1, 1, 1.
    The rule (move from the most to the least loaded rank the row whose load is the largest not above half
    the gap, until min / max >= 0.98), by hand in units of one count: loads 18 | 4, gap 14: row 1 (6 <= 7)
    moves, 12 | 10; gap 2: a row of 1 (the last of rows 2, 3 in id order: row 3) moves, 11 | 11: balanced.
    Two rows moved; every other row stays."""
    from embedscale.plan.drift import rows_moved
    from embedscale.plan.incremental import incremental_plan

    tab = TableSpec("t", 8, 4, features=["t"])
    plan = _hand_plan([tab], 2, [np.array([0, 0, 0, 0, 1, 1, 1, 1])])
    prof = AccessProfile({"t": np.array([10.0, 6, 1, 1, 1, 1, 1, 1])}, 100)
    inc, changed = incremental_plan(plan, plan, prof, batch_size=10)
    assert changed == 2
    assert inc.owner("t", np.arange(8)).tolist() == [0, 1, 0, 1, 1, 1, 1, 1]
    assert rows_moved(plan, inc)["rows_moved"] == 2 and inc.meta["rows_rebalanced"] == 2
    load = _lookup_per_rank(inc, {"t": prof.tables["t"]}, prof.samples, 10)
    assert load[0] == pytest.approx(load[1])  # 11 | 11 counts


# -- replans.csv after a resume at a logged step ----------------------------------------------------------------

def _csv_steps(run_dir) -> list[int]:
    with open(run_dir / "replans.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_replans_csv_after_a_resume_at_a_logged_step_has_each_step_once(tmp_path):
    """A run re-planned at steps 4, 8 and 12; resumed from its step-8 checkpoint (written before the step-8
    check) it re-plans at 8 and 12 again. The model: the file holds, for every step, the row of the last attempt
    that reached it; no duplicate, none missing, in step order, and the rows before the resume are kept as
    written."""
    from embedscale.train.replan import write_replans

    def rec(step, attempt):
        return {"step": step, "reason": f"attempt {attempt}", "gain": 0.1 * attempt, "rows_moved": step + attempt}

    model: dict[int, dict] = {}
    for step in (4, 8, 12):  # the first attempt
        write_replans(tmp_path, rec(step, 1))
        model[step] = rec(step, 1)
    assert _csv_steps(tmp_path) == [4, 8, 12]
    write_replans(tmp_path, rec(8, 2))  # the resumed attempt, at the logged step 8
    model = {s: r for s, r in model.items() if s < 8}
    model[8] = rec(8, 2)
    assert _csv_steps(tmp_path) == [4, 8]  # step 12 is re-planned again, not kept from the first attempt
    write_replans(tmp_path, rec(12, 2))
    model[12] = rec(12, 2)
    with open(tmp_path / "replans.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == sorted(model)
    for r in rows:
        want = model[int(r["step"])]
        assert r["reason"] == want["reason"] and int(r["rows_moved"]) == want["rows_moved"]


# -- resumes of a re-planning run (2 gloo ranks) ---------------------------------------------------------------------

def test_delta_resume_and_a_resume_at_a_logged_step_of_a_replanning_run(tmp_path):
    """A 2-rank run that re-plans at step 4 (between steps 4 and 5) and checkpoints every 2 steps.

    1. Stopped at 6 with a full checkpoint every 8 steps: the step-6 checkpoint is a delta on step 2's, across
       the re-plan (rows updated in steps 3-4 then moved to another rank must be in it). Resumed from that delta
       to step 8 it is bit for bit the uninterrupted run (losses, rows, row-wise state, dense state), and
       ``replans.csv`` holds the step-4 re-plan once, as the uninterrupted run's.
    2. The uninterrupted run (a full checkpoint every 4 steps) resumed in its own directory from step 4, a
       logged re-plan step whose checkpoint precedes the check: it re-plans at 4 again under the plan it had
       then, ``replans.csv`` holds step 4 exactly once with the first attempt's figures, and the state is again
       the uninterrupted run's."""
    from embedscale.specs import to_dict
    from embedscale.train.checkpoint import read_manifest, step_dir
    from embedscale.train.launch import spawn_local
    from embedscale.train.replan import read_replans

    from test_migrate import EVERY, _drift_rank, assert_same_run, drift_config, drift_data

    data = tmp_path / "data"
    drift_data(data)
    steps = 2 * EVERY

    def config(max_steps, full_every):
        return to_dict(drift_config(tmp_path, data, replan_every=EVERY, replan_min_gain=0.0, max_steps=max_steps,
                                    checkpoint_every=2, checkpoint_full_every=full_every,
                                    replan_weigh_costs=False, replan_lag=0))

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    spawn_local(_drift_rank, 2, config(steps, EVERY), str(whole), None, timeout_s=600)
    keys = ("step", "reason", "gain", "rows_moved", "bytes", "balance_before", "balance_after")
    want = [{k: r[k] for k in keys} for r in read_replans(whole)]
    assert [int(r["step"]) for r in want] == [EVERY] and int(want[0]["rows_moved"]) > 0, want

    spawn_local(_drift_rank, 2, config(6, 2 * EVERY), str(cut), None, timeout_s=600)
    assert read_manifest(step_dir(cut, 6))["delta"]["base_step"] == 2  # a delta across the re-plan
    spawn_local(_drift_rank, 2, config(steps, 2 * EVERY), str(cut), str(step_dir(cut, 6)), timeout_s=600)
    assert_same_run(whole, cut, steps)
    assert [{k: r[k] for k in keys} for r in read_replans(cut)] == want

    assert "delta" not in read_manifest(step_dir(whole, EVERY))
    spawn_local(_drift_rank, 2, config(steps, EVERY), str(whole), str(step_dir(whole, EVERY)), timeout_s=600)
    assert [{k: r[k] for k in keys} for r in read_replans(whole)] == want  # step 4 once, as first written
    assert_same_run(whole, cut, steps)
