"""Baselines of OPER 6.4 and the TorchRec conversion, by hand."""

import numpy as np
import pytest

from embedscale.plan.baselines import access_greedy, memory_greedy, row_wise, table_wise
from embedscale.plan.synthetic_profile import ArrayProfile
from embedscale.plan.torchrec_plan import convert_sharding
from embedscale.specs import TableSpec

TABLES = [TableSpec("a", 10, dim=4), TableSpec("b", 3, dim=8), TableSpec("c", 1, dim=4)]


def owners(plan, t):
    return plan.address_map(t)[0].tolist()


def test_table_wise_round_robin():
    p = table_wise(TABLES, 2)
    p.validate()
    assert [owners(p, t) for t in range(3)] == [[0] * 10, [1] * 3, [0]]


def test_row_wise_even_ranges():
    p = row_wise(TABLES, 3)
    p.validate()
    assert owners(p, 0) == [0] * 4 + [1] * 3 + [2] * 3
    assert owners(p, 1) == [0, 1, 2] and owners(p, 2) == [0]


def test_memory_greedy_equal_bytes():
    # bytes: a 10 x 16 = 160, b 3 x 32 = 96, c 16: total 272, 136 per rank of 2
    p = memory_greedy(TABLES, 2)
    p.validate()
    assert owners(p, 0) == [0] * 9 + [1]  # rows 0..8 = 144 bytes: row 8 starts at byte 128 < 136
    assert owners(p, 1) == [1] * 3 and owners(p, 2) == [1]
    np.testing.assert_array_equal(p.memory_per_rank(), [144, 128])


def test_access_greedy_balances_access_row_by_row():
    prof = ArrayProfile({"a": np.array([0, 8, 0, 1, 0, 0, 7, 0, 0, 2]), "b": np.array([5, 0, 0]), "c": np.array([3])})
    p = access_greedy(TABLES, prof, 2, granularity=1e-6)  # every accessed row its own chunk
    p.validate()
    # hottest first to the least loaded: 8 -> r0, 7 -> r1, 5 -> r1 (7 < 8), 3 -> r0 (8 < 12),
    # 2 -> r0 (11 < 12), 1 -> r1 (12 < 13): 13 each
    load = np.zeros(2)
    for t, counts in enumerate([prof.counts("a"), prof.counts("b"), prof.counts("c")]):
        np.add.at(load, np.array(owners(p, t)), counts)
    assert load.tolist() == [13.0, 13.0]


def test_convert_torchrec_sharding_types():
    shards = {
        "a": ("row_wise", [(5, 5, 0, 4, 1), (0, 5, 0, 4, 0)]),
        "b": ("data_parallel", [(-1, -1, -1, -1, r) for r in range(2)]),
        "c": ("table_wise", [(0, 1, 0, 4, 1)]),
    }
    p = convert_sharding(TABLES, 2, shards, "training", 64)
    p.validate()
    assert owners(p, 0) == [0] * 5 + [1] * 5 and owners(p, 2) == [1]
    assert p.holders[p.table_partitions(1)].all()
    cw = convert_sharding(TABLES[:1], 2, {"a": ("column_wise", [(0, 10, 0, 1, 0), (0, 10, 1, 3, 1)])}, "training", 64)
    assert owners(cw, 0) == [0] * 2 + [1] * 8  # rows split 1:3 like the columns
    assert cw.meta["approximations"]


@pytest.mark.torchrec
def test_torchrec_planner_runs_and_converts():
    pytest.importorskip("torchrec")
    from embedscale.plan.synthetic_profile import ZipfProfile
    from embedscale.plan.torchrec_plan import plan_torchrec
    from embedscale.specs import Topology

    tabs = [TableSpec(f"t{i}", n, dim=16) for i, n in enumerate([100_000, 20, 5000, 300_000])]
    plan = plan_torchrec(tabs, ZipfProfile.from_tables(tabs), Topology(num_hosts=1, ranks_per_host=4), batch_size=512)
    plan.validate()
    assert set(plan.meta["torchrec_sharding_types"]) == {t.name for t in tabs}
