"""make_plan / compare / plan_command (the CLI's functions), the report, and drift (OPER section 8)."""

import json

import numpy as np
import pytest

from embedscale.errors import ConfigError
from embedscale.plan.api import compare, make_plan, plan_command, topology_command
from embedscale.plan.drift import drift, rows_moved
from embedscale.plan.plan import Plan
from embedscale.plan.synthetic_profile import ArrayProfile, ZipfProfile
from embedscale.specs import TableSpec, Topology

TABLES = [TableSpec(f"t{i}", n, dim=8) for i, n in enumerate([20_000, 3_000, 50, 7])]
TOPO = Topology(num_hosts=1, ranks_per_host=4)
REQUIRED = ("plan_seconds", "memory_per_rank", "lookup_per_rank", "comm_matrix", "dob_memory", "dob_lookup", "dob_comm",
            "comm_mean", "max_rank_cost")


def test_plan_command_writes_plans_and_report(tmp_path, capsys):
    rep = plan_command(TABLES, {"kind": "zipf", "alpha": 1.1, "samples": 100_000}, TOPO,
                       ["oper", "table_wise", "row_wise", "memory_greedy", "access_greedy"], tmp_path / "out",
                       mode="inference", json_output=True, batch_size=256)
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and json.loads(line[0])["config"]["mode"] == "inference"
    for name, e in rep["strategies"].items():
        for k in REQUIRED:
            assert k in e, (name, k)
        assert np.array(e["comm_matrix"]).shape == (4, 4)
        plan = Plan.load(tmp_path / "out" / name)
        assert plan.meta["mode"] == "inference" and plan.meta["batch_size"] == 256
    for f in ("report.json", "report.md", "report.png"):
        assert (tmp_path / "out" / f).stat().st_size > 0
    o = rep["strategies"]["oper"]
    assert o["max_rank_cost"] < min(e["max_rank_cost"] for n, e in rep["strategies"].items() if n != "oper")


def test_compare_reports_errors_per_strategy():
    rep = compare(["row_wise", "milp"], TABLES, ZipfProfile.from_tables(TABLES), TOPO, options={"milp": {"max_units": 10}})
    assert "error" in rep["strategies"]["milp"] and "max_units" in rep["strategies"]["milp"]["error"]
    assert "dob_comm" in rep["strategies"]["row_wise"]
    with pytest.raises(ConfigError, match="unknown strategy 'best'"):
        compare(["best"], TABLES, ZipfProfile.from_tables(TABLES), TOPO)


def test_topology_command(tmp_path):
    d = topology_command(tmp_path / "topo.json", num_hosts=2, ranks_per_host=2)
    assert json.loads((tmp_path / "topo.json").read_text())["bandwidth"] == d["bandwidth"]


def test_drift_detects_shift_and_counts_moves():
    tabs = [TableSpec("a", 4000, dim=8), TableSpec("b", 500, dim=8)]
    old = ZipfProfile.from_tables(tabs, alpha=1.2, samples=50_000, seed=0)
    new = ZipfProfile.from_tables(tabs, alpha=1.2, samples=50_000, seed=1)  # same skew, other hot rows
    topo = Topology(num_hosts=1, ranks_per_host=4, intra_host_latency_us=0.0)
    plan = make_plan("oper", tabs, old, topo, mode="inference", batch_size=512, traffic="access")
    same = drift(plan, old, topo)
    assert same["replan"] is False and same["rows_moved"] == 0
    assert same["after"]["max_rank_cost"] == pytest.approx(same["before"]["max_rank_cost"])
    shifted = drift(plan, new, topo)
    assert shifted["replan"] is True
    assert shifted["after"]["max_rank_cost"] > 1.5 * shifted["before"]["max_rank_cost"]
    assert shifted["replanned"]["max_rank_cost"] < shifted["after"]["max_rank_cost"]
    assert 0 < shifted["rows_moved"] <= 4500
    # rows_moved counts exactly the rows whose owner differs
    fresh = make_plan("oper", tabs, new, topo, mode="inference", batch_size=512, traffic="access")
    expect = sum(int((plan.address_map(t)[0] != fresh.address_map(t)[0]).sum()) for t in range(2))
    assert rows_moved(plan, fresh)["rows_moved"] == expect


def test_make_plan_bad_profile():
    with pytest.raises(ConfigError, match="profile table 't0': 3 counts for a table of 20000 rows"):
        make_plan("oper", TABLES, ArrayProfile({t.name: np.ones(3) for t in TABLES}), TOPO)


def test_access_profile_duck_typing_matches_array_profile():
    mod = pytest.importorskip("embedscale.data.profile")
    rng = np.random.default_rng(0)
    counts = {t.name: rng.zipf(1.5, size=t.num_rows).astype(np.int64) for t in TABLES}
    ap = mod.AccessProfile(counts, samples=1000)
    arr = ArrayProfile(counts, samples=1000)
    a = make_plan("oper", TABLES, ap, TOPO, mode="training", batch_size=512)
    b = make_plan("oper", TABLES, arr, TOPO, mode="training", batch_size=512)
    a.validate()
    from embedscale.plan.cost import evaluate

    ca, cb = evaluate(a, arr, TOPO, mode="training", batch_size=512), evaluate(b, ap, TOPO, mode="training", batch_size=512)
    assert ca.max_rank_cost == pytest.approx(cb.max_rank_cost, rel=1e-9)
