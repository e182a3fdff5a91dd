"""OPER's steps: partitioning (4.1), balanced model parallelism (4.2), replication (4.3, Algorithm 1)."""

import numpy as np
import pytest

from embedscale.errors import ConfigError
from embedscale.plan.cost import evaluate
from embedscale.plan.oper import plan_oper, rank_capacity
from embedscale.plan.partition import cut_table, partition_tables, sort_tables
from embedscale.plan.place import balanced_model_parallel
from embedscale.plan.cost import evaluate_arrays
from embedscale.plan.replicate import algorithm1, training_fill, training_hot_rows
from embedscale.plan.synthetic_profile import ArrayProfile, ZipfProfile
from embedscale.plan.topology import LinkTopology
from embedscale.specs import Topology, TableSpec


def prefix(counts):
    return np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])


def test_cut_table_by_hand():
    # sorted counts 10, 5, 2, 2, 1, 0, 0, 0; access threshold 6, at most 3 rows (memory threshold)
    st, sp, ab = cut_table(prefix([10, 5, 2, 2, 1, 0, 0, 0]), 0, row_bytes=4, thr_count=6, thr_bytes=12)
    # [10] alone (above the threshold), [5] (5+2 > 6), [2,2,1] stops on 3 rows: memory-bound, then [0,0,0]... [0,0]
    assert st.tolist() == [0, 1, 2, 5] and sp.tolist() == [1, 2, 5, 8]
    assert ab.tolist() == [True, True, False, False]


def test_sort_and_partition_tables():
    prof = ArrayProfile({"x": np.array([0, 3, 9, 1]), "y": np.array([4, 4])}, samples=1)
    tabs = [TableSpec("x", 4, dim=1), TableSpec("y", 2, dim=1)]
    st = sort_tables(tabs, prof)
    assert st[0].order.tolist() == [2, 1, 3, 0] and st[1].order.tolist() == [0, 1]
    parts = partition_tables(st, threshold=0.4)  # 0.4 * 21 = 8.4 accesses, 0.4 * 24 = 9.6 bytes = 2 rows
    assert list(zip(parts.table.tolist(), parts.start.tolist(), parts.stop.tolist())) == [(0, 0, 1), (0, 1, 3), (0, 3, 4), (1, 0, 2)]
    np.testing.assert_allclose(parts.counts, [9, 4, 0, 8])


def test_sort_tables_rejects_bad_counts():
    with pytest.raises(ConfigError, match="row 1 has negative count -2"):
        prof = ArrayProfile.__new__(ArrayProfile)
        prof._tables, prof.samples = {"x": np.array([1, -2, 0])}, 1
        sort_tables([TableSpec("x", 3)], prof)


def test_balanced_model_parallel_lpt_by_hand():
    lookup = np.array([5, 4, 3, 3, 3], dtype=float)[:, None] * np.ones((1, 2))
    owner, e, mem = balanced_model_parallel(lookup, np.ones(5), np.ones(5, dtype=bool), np.full(2, np.inf))
    # 5 -> r0; 4 -> r1; 3 -> r1 (4 < 5); 3 -> r0 (5 < 7); 3 -> r1 (7 < 8)
    assert owner.tolist() == [0, 1, 1, 0, 1] and e.tolist() == [8, 10]
    # memory-bound partitions go to the least memory, ties to the least lookup: 0 -> r0 (0 < 0.2),
    # 1 -> r1 (memory 0 < 4), 2 -> r1 (memory tie, lookup 0.2 < 1)
    owner, e, mem = balanced_model_parallel(np.array([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]), np.array([4.0, 4.0, 1.0]),
                                            np.array([False, False, False]), np.full(2, np.inf), base_lookup=np.array([0.0, 0.2]))
    assert owner.tolist() == [0, 1, 1] and mem.tolist() == [4, 5]
    with pytest.raises(ConfigError, match="part-x .* fits on no rank"):
        balanced_model_parallel(np.ones((1, 2)), np.array([5.0]), np.array([True]), np.array([4.0, 4.0]),
                                describe=lambda q: "part-x")


def test_algorithm1_by_hand_repoints_to_cheaper_holder():
    # 2 hosts x 2 ranks; partitions 0, 1 owned by rank 2 (other host for ranks 0 and 1)
    cost = np.array([[0.1, 1, 4, 4], [1, 0.1, 4, 4], [4, 4, 0.1, 1], [4, 4, 1, 0.1]])
    holders = np.zeros((2, 4), dtype=bool)
    holders[:, 2] = True
    fetch = np.full((2, 4), 2, dtype=np.int32)
    fetch[:, 2] = 2
    avail = np.array([10.0, 0.0, 0.0, 0.0])
    info = algorithm1(holders, fetch, np.array([6.0, 3.0]), np.array([10.0, 10.0]), cost, avail, choice="max_link")
    # rank 0 replicates the hotter partition 0; rank 1 then reads it from rank 0 (cost 1 < 4)
    assert info["replicas"] == 1 and holders[0].tolist() == [True, False, True, False]
    assert fetch[0].tolist() == [0, 0, 2, 2] and fetch[1].tolist() == [2, 2, 2, 2]
    assert avail.tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("seed", range(8))
def test_algorithm1_never_exceeds_memory(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(2, 7))
    p = int(rng.integers(5, 60))
    owner = rng.integers(0, m, size=p)
    holders = np.zeros((p, m), dtype=bool)
    holders[np.arange(p), owner] = True
    fetch = np.where(holders, np.arange(m), owner[:, None]).astype(np.int32)
    nb = rng.integers(1, 50, size=p).astype(float)
    base = (holders * nb[:, None]).sum(0)
    cap = base + rng.integers(0, 80, size=m)
    avail = cap - base
    cost = rng.uniform(0.5, 3, size=(m, m))
    np.fill_diagonal(cost, 0.05)
    algorithm1(holders, fetch, rng.exponential(5, size=p), nb, cost, avail, order=["max_comm", "round_robin"][seed % 2],
               choice=["max_link", "best_gain"][(seed // 2) % 2])
    mem = (holders * nb[:, None]).sum(0)
    assert np.all(mem <= cap) and np.all(avail >= 0)
    np.testing.assert_allclose(mem + avail, cap)
    assert np.all(np.take_along_axis(holders, fetch.astype(np.int64), axis=1))  # every fetch reads a holder
    assert np.all(fetch[holders] == np.nonzero(holders)[1])  # holders read themselves


@pytest.mark.parametrize("seed, hosts, rph, extra", [(0, 1, 3, 0.1), (1, 2, 2, 0.05), (2, 1, 4, 0.0), (3, 2, 3, 0.2)])
def test_oper_inference_plans_stay_within_memory(seed, hosts, rph, extra):
    rng = np.random.default_rng(seed)
    tabs = [TableSpec(f"t{i}", int(n), dim=int(d)) for i, (n, d) in
            enumerate(zip(rng.integers(1, 3000, size=5), rng.choice([4, 8, 16], size=5)))]
    prof = ZipfProfile.from_tables(tabs, alpha=float(rng.uniform(0.6, 1.4)), samples=10_000, seed=seed)
    topo = Topology(num_hosts=hosts, ranks_per_host=rph)
    plan = plan_oper(tabs, prof, topo, mode="inference", extra_memory=extra, batch_size=512)
    plan.validate()  # every row owned once, fetch paths consistent, memory within capacity_bytes
    total = sum(t.memory_bytes for t in tabs)
    budget = rank_capacity(topo, total, extra)
    assert np.all(plan.memory_per_rank() <= np.maximum(budget, plan.meta["capacity_bytes"]))
    if extra == 0:
        assert not (plan.holders.sum(1) > 1).any()  # no extra memory: no replicas
    else:
        assert np.all(plan.memory_per_rank() <= budget)


def test_training_replicates_exactly_the_rows_above_the_frequency_threshold():
    # 2 ranks, BW_P2P = 10, BW_AR = 5, B = 4: replicate rows with f > 10 / (4 * 5) = 0.5 per sample
    topo = LinkTopology.from_link_classes(1, 2, {"same_rank": 100, "same_host": 10}, allreduce_bw=5)
    counts = np.array([0, 60, 51, 50, 49, 30, 10, 0])  # over 100 samples: f = 0.6, 0.51 qualify; 0.5 does not
    tabs = [TableSpec("t", 8, dim=1)]
    plan = plan_oper(tabs, ArrayProfile({"t": counts}, samples=100), topo, mode="training", extra_memory=1.0,
                     batch_size=4, traffic="access")
    plan.validate()
    replicated = plan.holders.all(axis=1)[plan.partition_of("t", np.arange(8))]
    assert np.flatnonzero(replicated).tolist() == [1, 2]
    assert plan.meta["training_freq_threshold"] == pytest.approx(0.5)


def test_training_hot_rows_respects_budget_and_prefixes():
    heads = [np.array([9.0, 5, 3]), np.array([8.0, 7])]
    k = training_hot_rows(heads, np.array([1.0, 2.0]), 2.5, budget_bytes=5, world_size=4)
    # per byte: a0 9, a1 5, b0 4, b1 3.5, a2 3 -> a0 (1), a1 (2), b0 (4) fits, b1 would reach 6
    assert k.tolist() == [2, 1]


def test_training_fill_by_hand():
    # 2 ranks; L local 0.1, remote 1 us/byte; BW_AR 1e-3 GB/s = 1 us/byte; g = 2. All on rank 0, rank 1 has
    # 2 bytes free. A copy on rank 1 saves v (2 x 1 + 0.1 - 0.1) and costs 2 x mem of AllReduce:
    # p0 (v 10, 1 byte): 18 > 0, copied; p1 (v 0.5, 1 byte): -1, not; p2 (v 5, 3 bytes): does not fit.
    topo = LinkTopology.from_link_classes(1, 2, {"same_rank": 1e-2, "same_host": 1e-3}, allreduce_bw=1e-3)
    lb = topo.cost_matrix()
    vol, nb = np.array([10.0, 0.5, 5.0]), np.array([1.0, 1.0, 3.0])
    holders = np.array([[True, False]] * 3)
    fetch = np.zeros((3, 2), dtype=np.int32)
    args = (np.zeros(3, dtype=np.int32), nb, vol, np.array([1.0]))  # table, rows, accesses (1-byte rows)

    def totals():
        c = evaluate_arrays(*args, holders, fetch, topo, "training")
        return c.total_per_rank - c.latency_per_rank

    total = totals()
    avail = np.array([0.0, 2.0])
    out = training_fill(holders, fetch, vol, nb, lb, avail, total, topo.allreduce_bw)
    assert out == {"replicas": 1, "bytes": [0.0, 1.0]}
    assert holders.tolist() == [[True, True], [True, False], [True, False]]
    assert fetch.tolist() == [[0, 1], [0, 0], [0, 0]]
    assert avail.tolist() == [0.0, 1.0]
    np.testing.assert_allclose(total, totals())  # the running totals are the cost model's
    # before: rank 0 looks up 2 x 15.5 x 0.1 = 3.1, rank 1 fetches 2 x 15.5 = 31; after: each holder of p0
    # pays 2 (2-1)/2 x 1 = 1 of AllReduce, rank 1 reads p0 locally (1.0) and fetches 2 x 5.5 = 11
    np.testing.assert_allclose(total, [1.1 + 1.0 + 1.0, 1.0 + 11.0 + 1.0])


def test_training_fill_uses_the_room_the_everywhere_copies_leave():
    # 5% of four small tables is too little for every row OPER 4.3 wants copied on all ranks; the rest of
    # the room takes single copies and the plan ends within 0.1% of the lower bound (0.3% without them)
    from embedscale.plan.bound import lower_bound

    tabs = [TableSpec(f"t{i}", n, dim=16) for i, n in enumerate([20000, 5000, 300, 40])]
    prof = ZipfProfile.from_tables(tabs, alpha=1.1, samples=100_000, seed=0)
    topo = Topology(num_hosts=1, ranks_per_host=4)
    plan = plan_oper(tabs, prof, topo, mode="training", extra_memory=0.05, batch_size=2048, traffic="access")
    plan.validate()
    assert plan.meta["training_fill"]["replicas"] > 0
    assert 0 < plan.meta["replicated_rows_everywhere"] < 648
    c = evaluate(plan, prof, topo, mode="training", batch_size=2048)
    b = lower_bound(tabs, prof, topo, mode="training", batch_size=2048, capacity_bytes=plan.meta["capacity_bytes"])
    assert b["rows_worth_replicating"] == 648
    assert b["max_rank_cost"] <= c.max_rank_cost <= 1.001 * b["max_rank_cost"]
    bare = plan_oper(tabs, prof, topo, mode="training", extra_memory=0.05, batch_size=2048, fill_rounds=0, traffic="access")
    assert c.max_rank_cost < evaluate(bare, prof, topo, mode="training", batch_size=2048).max_rank_cost


def test_threshold_refinement_reaches_the_target():
    tabs = [TableSpec(f"t{i}", n, dim=8) for i, n in enumerate([5000, 300, 20000, 40])]
    prof = ZipfProfile.from_tables(tabs, alpha=1.0, samples=100_000)
    topo = Topology(num_hosts=1, ranks_per_host=4)
    plan = plan_oper(tabs, prof, topo, mode="inference", threshold=0.05, balance_target=0.99, replicate=False, traffic="access")
    hist = plan.meta["threshold_history"]
    assert len(hist) > 1 and hist[0]["dob_lookup"] < 0.99
    assert hist[-1]["dob_lookup"] >= 0.99 and hist[-1]["dob_memory"] >= 0.99
    assert [h["threshold"] for h in hist] == [0.05 / 2**k for k in range(len(hist))]
    c = evaluate(plan, prof, topo, mode="inference", batch_size=2048)
    assert c.dob_lookup >= 0.99 and c.dob_memory >= 0.99


def test_capacity_errors():
    topo = Topology(num_hosts=1, ranks_per_host=2, memory_per_rank=100)
    with pytest.raises(ConfigError, match="tables need 256 bytes but 2 ranks x memory_per_rank 100"):
        rank_capacity(topo, 256, 0.05)
    with pytest.raises(ConfigError, match="extra_memory must be"):
        rank_capacity(Topology(), 10, -0.1)


def test_polish_moves_a_partition_off_the_bottleneck_by_hand():
    from embedscale.plan.place import polish

    # 2 ranks, inference; L local 0, remote 1 us/byte. Partitions read 4, 3, 1 bytes per rank, all on rank 0:
    # rank 0 pays nothing (lookup free), rank 1 fetches 8. Moving the 4 to rank 1: costs 4 / 4 -> max 4.
    cost = np.array([[0.0, 1.0], [1.0, 0.0]])
    owner = np.array([0, 0, 0], dtype=np.int32)
    total = np.array([0.0, 8.0])
    mem = np.array([3.0, 0.0])
    n = polish(owner, np.ones(3, dtype=bool), np.array([4.0, 3.0, 1.0]), np.ones(3), cost, total, mem,
               np.array([3.0, 3.0]), grad_factor=1.0)
    assert n == 1 and owner.tolist() == [1, 0, 0] and total.tolist() == [4.0, 4.0] and mem.tolist() == [2.0, 1.0]


def test_polish_swaps_when_memory_is_full_by_hand():
    from itertools import combinations

    from embedscale.plan.place import polish

    # 2 ranks, training (g = 2); L local 0.1, remote 1 us/byte; four 1-byte partitions read 10, 6, 1, 1 bytes per
    # rank, two on each rank and every rank full (capacity 2): no single move fits, only swaps do. Rank x pays
    # M v L[x][x] for what it owns and g v L[x][j] for what it fetches: rank 0 (owns 16) 3.2 + 4 = 7.2, rank 1
    # (owns 2) 0.4 + 32 = 32.4. The best split of two-and-two is 11 / 7: max 2.2 + 14 = 16.2 vs 1.4 + 22 = 23.4.
    cost = np.array([[0.1, 1.0], [1.0, 0.1]])
    vol = np.array([10.0, 6.0, 1.0, 1.0])

    def per_rank(own):
        return np.array([sum(2 * v * cost[x, x] if o == x else 2 * v * cost[x, o] for v, o in zip(vol, own))
                         for x in range(2)])

    owner = np.array([0, 0, 1, 1], dtype=np.int32)
    total = per_rank(owner)
    np.testing.assert_allclose(total, [7.2, 32.4])
    mem = np.array([2.0, 2.0])
    stats: dict = {}
    n = polish(owner, np.ones(4, dtype=bool), vol, np.ones(4), cost, total, mem, np.array([2.0, 2.0]),
               grad_factor=2.0, stats=stats)
    best = min(per_rank([0 if q in on0 else 1 for q in range(4)]).max() for on0 in combinations(range(4), 2))
    assert best == pytest.approx(23.4)
    assert n == 1 and stats["swaps"] == 1 and stats["moves"] == 1
    assert sorted([vol[owner == 0].sum(), vol[owner == 1].sum()]) == [7, 11]
    np.testing.assert_allclose(total, per_rank(owner))  # the running totals are the cost model's
    assert total.max() == pytest.approx(best) and mem.tolist() == [2.0, 2.0]
