"""The Plan contract: vectorised queries, the dense address map, validation errors, save/load."""

import json

import numpy as np
import pytest

from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.plan.plan import Plan, PlanError
from embedscale.specs import TableSpec

TABLES = [TableSpec("a", 6, dim=2), TableSpec("b", 3, dim=4)]


def good_plan() -> Plan:
    # table a: order [4 0 5 1 2 3]; partitions [0,2) on rank 1, [2,3) on rank 0 (replica on 2), [3,6) on rank 2
    # table b: identity; [0,3) on rank 0 (replicas on 1 and 2)
    holders = np.array([[0, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 1]], dtype=bool)
    return Plan(TABLES, 3, [np.array([4, 0, 5, 1, 2, 3]), None], [0, 0, 0, 1], [0, 2, 3, 0], [2, 3, 6, 3],
                [1, 0, 2, 0], holders)


def test_queries_by_hand():
    p = good_plan()
    p.validate()
    # rank 0 stores: a partition 1 (row 5) at 0, then b rows 0..2 at 1..3
    # rank 1 stores: a partition 0 (rows 4, 0) at 0..1, then b at 2..4
    # rank 2 stores: a partition 1 (row 5) at 0, a partition 2 (rows 1, 2, 3) at 1..3, b at 4..6
    assert p.owner("a", [0, 1, 2, 3, 4, 5]).tolist() == [1, 2, 2, 2, 1, 0]
    assert p.local_offset("a", [4, 0, 5, 1, 2, 3]).tolist() == [0, 1, 0, 1, 2, 3]
    assert p.local_offset("b", [0, 2]).tolist() == [1, 3]
    assert p.local_offset("a", [5], rank=2).tolist() == [0]
    assert p.local_offset("a", [4], rank=0).tolist() == [-1]
    assert p.fetch_rank("a", [4, 5, 1], rank=2).tolist() == [1, 2, 2]
    src, off = p.address("b", [0, 2], rank=2)
    assert src.tolist() == [2, 2] and off.tolist() == [4, 6]
    assert p.replicas("a", [5]).tolist() == [[False, False, True]]
    np.testing.assert_array_equal(p.memory_per_rank(), [1 * 8 + 3 * 16, 2 * 8 + 3 * 16, 4 * 8 + 3 * 16])
    assert p.rank_layout(2) == [{"table": "a", "start": 0, "count": 4}, {"table": "b", "start": 4, "count": 3}]
    ranks, offs = p.address_map("a")
    assert ranks.tolist() == [1, 2, 2, 2, 1, 0] and offs.tolist() == [1, 1, 2, 3, 0, 0]


def test_rows_on_rank_agree_with_address_maps():
    p = good_plan()
    for r in range(3):
        tabs, rows, offs = p.rows_on_rank(r)
        assert offs.tolist() == list(range(int(p.rows_per_rank()[r])))
        for t in range(2):
            sel = tabs == t
            src, off = p.address_map(t, rank=r)
            assert np.all(src[rows[sel]] == r)
            np.testing.assert_array_equal(off[rows[sel]], offs[sel])


def test_out_of_range_rows_and_ranks():
    p = good_plan()
    with pytest.raises(InputError, match="table 'a': row 6 outside"):
        p.owner("a", [6])
    with pytest.raises(ConfigError, match="rank 3 out of range"):
        p.fetch_rank("a", [0], rank=3)
    with pytest.raises(ConfigError, match="no table 'z'"):
        p.owner("z", [0])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.rows_by_partition.__setitem__(0, np.array([4, 0, 5, 1, 2, 2])), "table 'a': row 2 is owned 2 times"),
        (lambda p: p.rows_by_partition.__setitem__(0, np.array([4, 0, 5, 1, 2, 9])), r"rows_by_partition\[5\] = 9"),
        (lambda p: p.part_start.__setitem__(2, 4), "partitions 1 .* and 2 .* leave a gap"),
        (lambda p: p.part_stop.__setitem__(2, 5), "partitions end at 5 but the table has 6 rows"),
        (lambda p: p.owner_of_part.__setitem__(2, 7), "owner rank 7 is outside"),
        (lambda p: p.fetch.__setitem__((0, 2), 0), "rank 2 fetches from rank 0, which holds no copy"),
        (lambda p: p.fetch.__setitem__((1, 2), 0), "rank 2 holds a copy but fetches from rank 0"),
        (lambda p: p.local_base.__setitem__((3, 0), 0), "rank 0: .* overlap or leave a hole"),
    ],
)
def test_validation_rejects_broken_plans(mutate, message):
    p = good_plan()
    mutate(p)
    with pytest.raises(PlanError, match=message):
        p.validate()


def test_validation_capacity():
    p = good_plan()
    p.validate(capacity_bytes=80)
    with pytest.raises(PlanError, match="rank 2: stores 80 bytes, over its capacity of 79 bytes by 1"):
        p.validate(capacity_bytes=79)


def test_save_load_round_trip(tmp_path):
    p = good_plan()
    p.meta.update({"strategy": "hand", "mode": "inference", "batch_size": 7})
    p.save(tmp_path / "plan")
    q = Plan.load(tmp_path / "plan")
    assert q.meta["batch_size"] == 7 and q.table_names == ["a", "b"]
    for t in range(2):
        for r in [None, 0, 1, 2]:
            for x, y in zip(p.address_map(t, r), q.address_map(t, r)):
                np.testing.assert_array_equal(x, y)
    q2 = Plan.load(tmp_path / "plan", mmap=True)
    np.testing.assert_array_equal(q2.owner("a", np.arange(6)), p.owner("a", np.arange(6)))
    names = sorted(x.name for x in (tmp_path / "plan").iterdir())
    assert names == ["partitions.npz", "plan.json", "rows_by_partition.npy"]  # no temporaries left


def test_load_rejects_bad_files(tmp_path):
    d = good_plan().save(tmp_path / "plan")
    doc = json.loads((d / "plan.json").read_text())
    doc["num_partitions"] = 5
    (d / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="array 'part_table' has shape"):
        Plan.load(d)
    doc["num_partitions"], doc["version"] = 4, 99
    (d / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="plan version 99"):
        Plan.load(d)
    with pytest.raises(FormatError, match="plan not found"):
        Plan.load(tmp_path / "nowhere")
    doc["version"] = 1
    (d / "plan.json").write_text(json.dumps(doc))
    np.save(d / "rows_by_partition.npy", np.array([4, 0, 5, 1, 2, 2], dtype=np.int32))
    with pytest.raises(PlanError, match="row 2 is owned 2 times"):
        Plan.load(d)
