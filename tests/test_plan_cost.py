"""The cost model (OPER eqs. 1-5) against figures worked out by hand, in the spirit of OPER Fig. 2.

Three tables, two ranks with room for 7 rows each. Every row is 1 byte, the profile counts are the
per-rank accesses per iteration (samples = batch = 1), and links cost 1 us/byte remote, 0.1 us/byte
local (bandwidth 1e-3 and 1e-2 GB/s), no latency, AllReduce 1 us/byte:

    A = [10, 5, 2, 2, 1, 0]   (total 20)
    B = [4, 2, 1, 1]          (total 8)
    C = [3, 1]                (total 4)
"""

import numpy as np
import pytest

from embedscale.errors import ConfigError
from embedscale.plan.cost import dob, evaluate, partition_counts, training_replication_threshold
from embedscale.plan.plan import Plan
from embedscale.plan.synthetic_profile import ArrayProfile
from embedscale.plan.topology import LinkTopology
from embedscale.specs import TableSpec

TABLES = [TableSpec("A", 6, dim=1, bytes_per_value=1), TableSpec("B", 4, dim=1, bytes_per_value=1),
          TableSpec("C", 2, dim=1, bytes_per_value=1)]
COUNTS = {"A": np.array([10, 5, 2, 2, 1, 0]), "B": np.array([4, 2, 1, 1]), "C": np.array([3, 1])}
PROFILE = ArrayProfile(COUNTS, samples=1)


def topo(latency=0.0):
    return LinkTopology.from_link_classes(1, 2, {"same_rank": 1e-2, "same_host": 1e-3},
                                          {"same_host": latency}, allreduce_bw=1e-3)


def row_plan(owner_rows: dict[str, list[int]], replicas: dict[tuple[str, int], list[int]] = {}) -> Plan:
    """One partition per row (identity order); owner_rows[table][row] = rank; replicas add holders."""
    pt, ps, po = [], [], []
    for t, spec in enumerate(TABLES):
        for r in range(spec.num_rows):
            pt.append(t), ps.append(r), po.append(owner_rows[spec.name][r])
    holders = np.zeros((len(pt), 2), dtype=bool)
    holders[np.arange(len(pt)), po] = True
    for (name, row), ranks in replicas.items():
        k = [i for i, (t, s) in enumerate(zip(pt, ps)) if TABLES[t].name == name and s == row][0]
        holders[k, ranks] = True
    return Plan(TABLES, 2, [None] * 3, pt, ps, np.array(ps) + 1, po, holders)


def table_wise_plan():
    return Plan(TABLES, 2, [None] * 3, [0, 1, 2], [0, 0, 0], [6, 4, 2], [0, 1, 1])


def test_table_wise_by_hand():
    c = evaluate(table_wise_plan(), PROFILE, topo(), mode="inference", batch_size=1)
    # W0 = 20 (A), W1 = 12 (B, C); E_j = 2 ranks * W_j * 0.1; C[0][1] = 12, C[1][0] = 20
    np.testing.assert_allclose(c.memory_per_rank, [6, 6])
    np.testing.assert_allclose(c.lookup_per_rank, [4.0, 2.4])
    np.testing.assert_allclose(c.comm_matrix, [[0, 12], [20, 0]])
    np.testing.assert_allclose(c.total_per_rank, [16.0, 22.4])
    assert c.max_rank_cost == pytest.approx(22.4)
    assert c.dob_lookup == pytest.approx(0.6) and c.dob_comm == pytest.approx(0.6) and c.dob_memory == 1.0
    assert c.comm_mean == pytest.approx(16.0)
    t = evaluate(table_wise_plan(), PROFILE, topo(), mode="training", batch_size=1)
    np.testing.assert_allclose(t.total_per_rank, [4.0 + 24, 2.4 + 40])  # gradients double the links
    np.testing.assert_allclose(t.allreduce_per_rank, [0, 0])


def test_row_wise_by_hand():
    rw = row_plan({"A": [0, 0, 0, 1, 1, 1], "B": [0, 0, 1, 1], "C": [0, 1]})
    c = evaluate(rw, PROFILE, topo(), mode="inference", batch_size=1)
    # W0 = 17 + 6 + 3 = 26, W1 = 3 + 2 + 1 = 6
    np.testing.assert_allclose(c.lookup_per_rank, [5.2, 1.2])
    np.testing.assert_allclose(c.comm_matrix, [[0, 6], [26, 0]])
    np.testing.assert_allclose(c.total_per_rank, [11.2, 27.2])
    assert c.dob_comm == pytest.approx(6 / 26)


ROW_LEVEL = {"A": [0, 1, 0, 1, 0, 1], "B": [1, 1, 0, 0], "C": [1, 0]}  # 16 accesses and 6 rows each


def test_row_level_by_hand():
    c = evaluate(row_plan(ROW_LEVEL), PROFILE, topo(), mode="inference", batch_size=1)
    np.testing.assert_allclose(c.memory_per_rank, [6, 6])
    np.testing.assert_allclose(c.lookup_per_rank, [3.2, 3.2])
    np.testing.assert_allclose(c.comm_matrix, [[0, 16], [16, 0]])
    assert c.dob_lookup == c.dob_comm == c.dob_memory == 1.0
    assert c.max_rank_cost == pytest.approx(19.2)


def test_row_level_with_replicas_by_hand():
    # rank 0 also holds A1 (5 accesses), rank 1 also holds A0 (10): 7 rows each
    plan = row_plan(ROW_LEVEL, {("A", 1): [0], ("A", 0): [1]})
    plan.validate(capacity_bytes=7)
    c = evaluate(plan, PROFILE, topo(), mode="inference", batch_size=1)
    np.testing.assert_allclose(c.memory_per_rank, [7, 7])
    # rank 0 reads 16 - 5 = 11 remotely, rank 1 reads 16 - 10 = 6
    np.testing.assert_allclose(c.comm_matrix, [[0, 11], [6, 0]])
    # served: rank 0 = 21 local + 6 for rank 1 = 27; rank 1 = 26 local + 11 = 37 (x 0.1)
    np.testing.assert_allclose(c.lookup_per_rank, [2.7, 3.7])
    np.testing.assert_allclose(c.total_per_rank, [13.7, 9.7])
    assert c.comm_mean == pytest.approx(8.5)
    t = evaluate(plan, PROFILE, topo(), mode="training", batch_size=1)
    # eq. 5: two rows held by h = 2 ranks, 2 (h-1)/h * 1 byte * 1 us/byte each, on both ranks
    np.testing.assert_allclose(t.allreduce_per_rank, [2.0, 2.0])
    np.testing.assert_allclose(t.total_per_rank, [2.7 + 22 + 2, 3.7 + 12 + 2])
    assert t.comm_mean == pytest.approx((22 + 2 + 12 + 2) / 2)
    with pytest.raises(Exception, match="rank 0: stores 7 bytes, over its capacity of 6"):
        plan.validate(capacity_bytes=6)


def test_latency_is_one_round_per_rank():
    c = evaluate(row_plan(ROW_LEVEL), PROFILE, topo(latency=5.0), mode="inference", batch_size=1)
    np.testing.assert_allclose(c.latency_per_rank, [5.0, 5.0])
    np.testing.assert_allclose(c.total_per_rank, [24.2, 24.2])
    t = evaluate(row_plan(ROW_LEVEL), PROFILE, topo(latency=5.0), mode="training", batch_size=1)
    np.testing.assert_allclose(t.latency_per_rank, [10.0, 10.0])


def test_batch_and_samples_scale_accesses():
    prof = ArrayProfile({k: v * 100 for k, v in COUNTS.items()}, samples=400)  # 0.25 x per sample
    c = evaluate(table_wise_plan(), prof, topo(), mode="inference", batch_size=8)  # x 2 per iteration
    np.testing.assert_allclose(c.comm_matrix, [[0, 24], [40, 0]])


def test_partition_counts_follow_the_permutation():
    plan = Plan(TABLES, 2, [np.array([5, 0, 1, 2, 3, 4]), None, None], [0, 0, 1, 2], [0, 2, 0, 0], [2, 6, 4, 2],
                [0, 1, 1, 0])
    np.testing.assert_allclose(partition_counts(plan, PROFILE), [0 + 10, 5 + 2 + 2 + 1, 8, 4])


def test_dob_and_threshold():
    assert dob(np.array([2.0, 4.0])) == 0.5 and dob(np.zeros(3)) == 1.0
    t = LinkTopology.from_link_classes(1, 4, {"same_rank": 1000, "same_host": 50}, allreduce_bw=200)
    assert training_replication_threshold(t, 100) == pytest.approx(50 / (100 * 200))


def test_bad_inputs_are_named():
    with pytest.raises(ConfigError, match="profile table 'A': 5 counts for a table of 6 rows"):
        evaluate(table_wise_plan(), ArrayProfile({**COUNTS, "A": np.ones(5)}), topo(), mode="inference")
    with pytest.raises(ConfigError, match="profile has no table 'C'"):
        evaluate(table_wise_plan(), ArrayProfile({"A": COUNTS["A"], "B": COUNTS["B"]}), topo(), mode="inference")
    with pytest.raises(ConfigError, match="mode 'serving'"):
        evaluate(table_wise_plan(), PROFILE, topo(), mode="serving")
    with pytest.raises(ConfigError, match="plan is for 2 ranks, topology has 4"):
        evaluate(table_wise_plan(), PROFILE, LinkTopology.from_link_classes(1, 4, {"same_rank": 1, "same_host": 1}))
