"""``plan.bound.lower_bound``: worked by hand on the OPER Fig. 2-like case of test_plan_cost, never above
any plan the cost model evaluates (random plans, MILP optima, oper), and tight where it should be."""

import numpy as np
import pytest

from embedscale.plan.api import make_plan
from embedscale.plan.bound import lower_bound
from embedscale.plan.cost import evaluate
from embedscale.plan.plan import Plan
from embedscale.plan.synthetic_profile import ArrayProfile, ZipfProfile
from embedscale.plan.topology import LinkTopology
from embedscale.specs import TableSpec, Topology

# test_plan_cost's case: 1-byte rows, A_k = counts, local 0.1 us/byte, remote 1 us/byte, AllReduce 1 us/byte
TABLES = [TableSpec("A", 6, dim=1, bytes_per_value=1), TableSpec("B", 4, dim=1, bytes_per_value=1),
          TableSpec("C", 2, dim=1, bytes_per_value=1)]
PROFILE = ArrayProfile({"A": np.array([10, 5, 2, 2, 1, 0]), "B": np.array([4, 2, 1, 1]), "C": np.array([3, 1])},
                       samples=1)


def topo(latency=0.0):
    return LinkTopology.from_link_classes(1, 2, {"same_rank": 1e-2, "same_host": 1e-3},
                                          {"same_host": latency}, allreduce_bw=1e-3)


def test_training_by_hand():
    # a remote read costs r = 0.1 (lookup at the source) + 2 x 1 (fetch + gradient) = 2.1, a local one 0.1;
    # a second copy of a row read A times saves A (2.1 - 0.1) and costs b = 2 x 1 byte / BW_AR = 2.
    # No memory limit: copy rows with A >= 2 (A = 10, 5, 2, 2, 4, 2, 3: sum 28) on both ranks,
    # 2 x 0.1 A + 2 each = 19.6; rows with A = 1 (four) stay single, 2.2 A each = 8.8; sum 28.4 -> mean 14.2.
    b = lower_bound(TABLES, PROFILE, topo(), mode="training", batch_size=1)
    assert b["per_row_sum"] == pytest.approx(28.4)
    assert b["max_rank_cost"] == pytest.approx(14.2)
    assert b["rows_worth_replicating"] == 7
    # 7 rows per rank: 2 bytes of room for second copies, the rows read 10 and 5 times (save 18 and 8):
    # one copy of everything 2.2 x 32 = 70.4, minus 26 = 44.4 -> 22.2
    b = lower_bound(TABLES, PROFILE, topo(), mode="training", batch_size=1, capacity_bytes=7)
    assert b["per_row_sum"] == pytest.approx(44.4)
    assert b["max_rank_cost"] == pytest.approx(22.2)
    # each rank holds at most the 7 hottest rows' 28 reads: 32 x 2.1 - 28 x 2 = 11.2 per rank
    assert b["per_rank_sum"] == pytest.approx(22.4)


def test_inference_by_hand():
    # r = 0.1 + 1 = 1.1: one copy of everything 32 x (1.1 + 0.1) = 38.4; room for the rows read 10 and 5
    # times once more: -15 -> 23.4 -> 11.7. With latency 3 us every rank holds less than the 11 rows read.
    b = lower_bound(TABLES, PROFILE, topo(3.0), mode="inference", batch_size=1, capacity_bytes=7)
    assert b["per_row_sum"] == pytest.approx(23.4)
    assert b["latency_per_rank"] == [3.0, 3.0]
    assert b["max_rank_cost"] == pytest.approx(11.7 + 3.0)
    # the plan that reaches it: copies of rows 10 and 5 on both ranks, 8.5 of the other 17 reads on each
    # rank is out of reach with whole rows (9 / 8): 12.1 + 3
    rows = {"A": [0, 1, 0, 1, 1, 0], "B": [0, 1, 0, 1], "C": [1, 0]}
    owner = [rows[t.name][r] for t in TABLES for r in range(t.num_rows)]
    holders = np.zeros((12, 2), dtype=bool)
    holders[np.arange(12), owner] = True
    holders[[0, 1]] = True
    starts = [r for t in TABLES for r in range(t.num_rows)]
    plan = Plan(TABLES, 2, [None] * 3, [0] * 6 + [1] * 4 + [2] * 2, starts, np.array(starts) + 1, owner, holders)
    c = evaluate(plan, PROFILE, topo(3.0), mode="inference", batch_size=1)
    assert c.memory_per_rank.max() <= 7
    assert c.max_rank_cost >= b["max_rank_cost"]


def _random_plan(rng, tables, m, cap):
    """One partition per row; random owners within capacity, random extra holders, random fetch holder."""
    sizes = [t.num_rows for t in tables]
    pt = np.repeat(np.arange(len(tables)), sizes)
    ps = np.concatenate([np.arange(n) for n in sizes])
    rb = np.array([t.dim * 4 for t in tables])[pt]
    mem = np.zeros(m)
    owner = np.empty(pt.size, dtype=np.int32)
    for k in rng.permutation(pt.size):
        owner[k] = rng.choice(np.flatnonzero(mem + rb[k] <= cap))
        mem[owner[k]] += rb[k]
    holders = np.zeros((pt.size, m), dtype=bool)
    holders[np.arange(pt.size), owner] = True
    for k in rng.permutation(pt.size):
        for j in rng.permutation(m):
            if not holders[k, j] and rng.random() < 0.3 and mem[j] + rb[k] <= cap:
                holders[k, j] = True
                mem[j] += rb[k]
    fetch = np.empty((pt.size, m), dtype=np.int32)
    for k in range(pt.size):
        h = np.flatnonzero(holders[k])
        fetch[k] = [i if holders[k, i] else rng.choice(h) for i in range(m)]
    return Plan(tables, m, [None] * len(tables), pt, ps, ps + 1, owner, holders, fetch)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_no_plan_beats_the_bound(seed, mode):
    rng = np.random.default_rng(seed)
    tables = [TableSpec(f"t{i}", int(n), dim=4) for i, n in enumerate(rng.integers(3, 9, 3))]
    prof = ArrayProfile({t.name: rng.integers(0, 30, t.num_rows) for t in tables}, samples=10)
    hosts = 1 + seed % 2
    t = LinkTopology.from_link_classes(hosts, 2, {"same_rank": 50.0, "same_host": 5.0, "other_host": 1.0},
                                       {"same_host": 1.0, "other_host": 4.0}, allreduce_bw=float(rng.uniform(0.5, 20)))
    m = t.world_size
    total = sum(x.num_rows * 16 for x in tables)
    cap = np.ceil(total / m * rng.uniform(1.1, 2.0) / 16 + 1) * 16
    b = lower_bound(tables, prof, t, mode=mode, batch_size=4, capacity_bytes=cap)
    for _ in range(30):
        plan = _random_plan(rng, tables, m, cap)
        c = evaluate(plan, prof, t, mode=mode, batch_size=4)
        assert c.max_rank_cost >= b["max_rank_cost"] * (1 - 1e-9)
    op = make_plan("oper", tables, prof, t, mode=mode, extra_memory=float(cap * m / total - 1), batch_size=4, traffic="access")
    bo = lower_bound(tables, prof, t, mode=mode, batch_size=4, capacity_bytes=op.meta["capacity_bytes"])
    assert evaluate(op, prof, t, mode=mode, batch_size=4).max_rank_cost >= bo["max_rank_cost"] * (1 - 1e-9)


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_milp_optimum_is_at_or_above_the_bound(mode):
    tables = [TableSpec("a", 8, dim=16), TableSpec("b", 4, dim=16)]
    prof = ZipfProfile.from_tables(tables, alpha=1.1, samples=1000, seed=1)
    t = Topology(num_hosts=1, ranks_per_host=2, intra_host_latency_us=2.0)
    mp = make_plan("milp", tables, prof, t, mode=mode, extra_memory=0.25, batch_size=4096, time_limit=30)
    cap = mp.meta["capacity_bytes"]
    b = lower_bound(tables, prof, t, mode=mode, batch_size=4096, capacity_bytes=cap)
    opt = evaluate(mp, prof, t, mode=mode, batch_size=4096).max_rank_cost
    assert opt >= b["max_rank_cost"] * (1 - 1e-9)
    assert b["max_rank_cost"] >= 0.7 * opt  # and not vacuous


def test_oper_reaches_the_bound_in_training_on_a_uniform_machine():
    # with room for every row OPER 4.3's rule wants copied, the rule copies exactly the rows worth it and
    # 4.2 plus polish balances the rest: the plan's largest per-rank cost is the mean, which is the bound
    tables = [TableSpec(f"t{i}", n, dim=16) for i, n in enumerate([20000, 5000, 300, 40])]
    prof = ZipfProfile.from_tables(tables, alpha=1.1, samples=100_000, seed=0)
    t = Topology(num_hosts=1, ranks_per_host=4)
    plan = make_plan("oper", tables, prof, t, mode="training", batch_size=2048, extra_memory=0.2, traffic="access")
    c = evaluate(plan, prof, t, mode="training", batch_size=2048)
    b = lower_bound(tables, prof, t, mode="training", batch_size=2048, capacity_bytes=plan.meta["capacity_bytes"])
    assert b["rows_worth_replicating"] == plan.meta["replicated_rows_everywhere"] == 648
    assert b["max_rank_cost"] <= c.max_rank_cost * (1 + 1e-12) <= b["max_rank_cost"] * (1 + 1e-6)
