"""The README workflow through the CLI on real Criteo rows: data criteo -> profile -> plan --profile ->
train --dist-plan on 2 ranks. The plan covers exactly the tables training builds (same names, same forms),
its counts are the data's (checked against a bincount of the shards), and training uses the saved plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from embedscale.cli import main
from embedscale.data.shards import Manifest, iter_shards
from embedscale.errors import ConfigError
from embedscale.plan.forms import TableForm, config_forms, decide_forms, default_tables, forms_for_run, table_profile
from embedscale.plan.plan import Plan
from embedscale.specs import RunConfig, TableConfig, TableSpec, from_dict

_CANDIDATES = [Path(__file__).resolve().parents[2] / "shared/data/criteo_kaggle_head10k.tsv",
               Path("/work/shared/data/criteo_kaggle_head10k.tsv")]
REAL = next((p for p in _CANDIDATES if p.exists()), _CANDIDATES[0])


def _cli(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """d (shards of the real rows), prof (per-feature profile), plans/oper (and plans_tt/oper with TT tables)."""
    if not REAL.exists():
        pytest.skip(f"real Criteo sample not found at {REAL} (see shared/data/README.md)")
    root = tmp_path_factory.mktemp("workflow")
    _cli("data", "criteo", REAL, "--out", root / "d", "--categorical", "vocab", "--no-progress")  # 4..5522 rows
    _cli("profile", root / "d", "--out", root / "prof", "--no-progress", "--json")
    _cli("plan", "--profile", root / "prof", "--out", root / "plans", "--json")
    _cli("plan", "--profile", root / "prof", "--out", root / "plans_tt", "--tt-min-rows", 3000, "--tt-rank", 4,
         "--json")
    return root


def _reference_counts(d: Path) -> dict[str, np.ndarray]:
    """Per-row access counts of every feature, straight from the shards (np.bincount)."""
    m = Manifest.load(d)
    out = {s.name: np.zeros(s.num_rows, dtype=np.int64) for s in m.sparse}
    for part in iter_shards(d):
        for name, (ids, _) in part.sparse.items():
            out[name] += np.bincount(np.asarray(ids, dtype=np.int64), minlength=out[name].size)
    return out


def test_plan_from_profile_covers_the_tables_training_builds(planned):
    from embedscale import workflow

    cfg = from_dict(RunConfig, {"data": {"source": "shards", "path": str(planned / "d")}})
    data = workflow.prepare_data(cfg, progress=False)
    tables = workflow.tables_for(cfg, data.manifest)
    plan = Plan.load(planned / "plans" / "oper")
    assert plan.table_names == [t.name for t in tables]
    assert [t.num_rows for t in plan.tables] == [t.num_rows for t in tables]
    assert set(plan.forms) == {t.name for t in tables} and all(f.kind == "sharded" for f in plan.forms.values())
    # the plan's counts by table are the data's counts of the table's feature
    ref = _reference_counts(planned / "d")
    counts = plan.part_counts
    assert counts is not None
    for t in tables:
        sl = plan.table_partitions(t.name)
        assert counts[sl].sum() == ref[t.features[0]].sum(), t.name


def test_train_with_the_saved_plan_on_two_ranks(planned, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    p = subprocess.run([sys.executable, "-m", "embedscale", "train", "--data-source", "shards", "--data-path",
                        str(planned / "d"), "--nproc", "2", "--dist-plan", str(planned / "plans" / "oper"),
                        "--train-max-steps", "3", "--train-batch-size", "256", "--no-progress", "--json",
                        "--run-dir", str(run)], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["steps"] == 3 and s["world_size"] == 2 and s["num_tables"] == 26
    saved, used = Plan.load(planned / "plans" / "oper"), Plan.load(run / "plan")
    assert used.table_names == saved.table_names
    np.testing.assert_array_equal(used.owner_of_part, saved.owner_of_part)
    np.testing.assert_array_equal(used.part_stop, saved.part_stop)


def test_saved_plan_forms_are_what_training_builds(planned):
    """plan --tt-min-rows: the run builds the plan's TT tables without asking; a contradicting request fails."""
    from embedscale import workflow
    from embedscale.assemble import run_tables

    plan = Plan.load(planned / "plans_tt" / "oper")
    tt = {n for n, f in plan.forms.items() if f.kind == "tt"}
    m = Manifest.load(planned / "d")
    assert tt == {f"t_{s.name}" for s in m.sparse if s.num_rows >= 3000} and tt
    assert all(plan.forms[n] == TableForm("tt", tt_rank=4) for n in tt)
    assert not tt & set(plan.table_names)  # TT tables get no rows
    cfg = from_dict(RunConfig, {"data": {"source": "shards", "path": str(planned / "d")}})
    tables, built = run_tables(cfg, m, plan, "plans_tt/oper")
    assert [t.name for t in tables] == list(built) == [f"t_{s.name}" for s in m.sparse]
    assert {n for n, f in built.items() if f.kind == "tt"} == tt
    assert all(built[n] == TableForm("tt", tt_rank=4) for n in tt)
    # the same request agrees; a different rank contradicts the plan: an error naming table, plan and request
    same = from_dict(RunConfig, {"data": {"source": "shards", "path": str(planned / "d")},
                                 "model": {"tt_min_rows": 3000, "tt_rank": 4}})
    assert run_tables(same, m, plan, "p")[1] == built
    other = from_dict(RunConfig, {"data": {"source": "shards", "path": str(planned / "d")},
                                  "model": {"tt_min_rows": 3000, "tt_rank": 8}})
    with pytest.raises(ConfigError, match=r"table 't_C\d+'.*tt \(rank 8\).*plans_tt/oper.*tt \(rank 4\)"):
        run_tables(other, m, plan, "plans_tt/oper")
    host = from_dict(RunConfig, {"data": {"source": "shards", "path": str(planned / "d")},
                                 "model": {"host_min_rows": 3000}})
    with pytest.raises(ConfigError, match=r"asks for host but plan p made it tt"):
        run_tables(host, m, plan, "p")
    assert all(f.kind == "sharded" for f in config_forms(cfg.model, workflow.tables_for(cfg, m)).values())  # no asks
    wide = from_dict(RunConfig, {"data": {"source": "shards", "path": str(planned / "d")},
                                 "model": {"embedding_dim": 32}})
    with pytest.raises(ConfigError, match=r"table 't_C\d+': plan p placed \d+ rows of dim 16, the model has \d+ rows "
                                          r"of dim 32"):
        run_tables(wide, m, plan, "p")


def test_decide_forms_requests():
    tabs = [TableSpec("a", 100, 8), TableSpec("b", 10, 8), TableSpec("c", 50, 8),
            TableSpec("d", 200, 8, pooling="none")]
    asks = [TableConfig("b", 10, 8, compression="tt", tt_rank=3), TableConfig("c", 50, 8, placement="host")]
    f = decide_forms(tabs[:3], requests=asks, tt_min_rows=100, tt_rank=5)
    assert f == {"a": TableForm("tt", tt_rank=5), "b": TableForm("tt", tt_rank=3), "c": TableForm("host")}
    assert decide_forms(tabs[:3], tt_min_rows=100, tt_rank=5)["b"] == TableForm()  # the requests are not on specs
    assert decide_forms(tabs, requests=asks, host_min_rows=100)["d"] == TableForm("host")
    with pytest.raises(ConfigError, match=r"requests for tables \['b', 'c'\] that the model does not have"):
        decide_forms(tabs[:1], requests=asks)
    with pytest.raises(ConfigError, match="'b' asks for compression: tt and placement: host"):
        decide_forms(tabs, requests=[TableConfig("b", 10, 8, compression="tt", placement="host")])
    with pytest.raises(ConfigError, match="'d'.*pooling 'none'"):
        decide_forms(tabs, tt_min_rows=100)
    with pytest.raises(ConfigError, match="'a'.*both"):
        decide_forms(tabs[:1], tt_min_rows=50, host_min_rows=50)
    assert decide_forms(tabs[:1], towers={"a": 1}) == {"a": TableForm("tower", tower=1)}
    with pytest.raises(ConfigError, match="'x'.*not in plan P"):
        forms_for_run({"a": TableForm()}, {"a": TableForm(), "x": TableForm()}, "P")


def test_table_profile_sums_features_by_table():
    class P:  # a per-feature profile
        table_names = ["f", "g"]
        samples = 7

        def counts(self, n):
            return {"f": np.array([1, 2, 0]), "g": np.array([0, 5])}[n]

    t = [TableSpec("shared", 4, 8, features=["f", "g"])]
    agg = table_profile(P(), t)
    np.testing.assert_array_equal(agg.counts("shared"), [1, 7, 0, 0])
    assert agg.samples == 7 and agg.table_names == ["shared"]
    assert [x.name for x in default_tables([("f", 3), ("g", 2)], 8)] == ["t_f", "t_g"]
    with pytest.raises(ConfigError, match="'shared' reads feature 'h'"):
        table_profile(P(), [TableSpec("shared", 4, 8, features=["f", "h"])])


def test_plan_tables_file_requests_become_the_plans_forms(tmp_path):
    """``embedscale plan --tables FILE``: the entries' ``compression: tt`` / ``placement: host`` are requests the
    plan decides and records (``Plan.forms``); the TT table's cores are listed per rank, neither gets rows."""
    f = tmp_path / "tables.yaml"
    f.write_text("tables:\n  - {name: a, num_rows: 4000}\n  - {name: b, num_rows: 3000, compression: tt, tt_rank: 4}\n"
                 "  - {name: c, num_rows: 2000, placement: host}\n  - {name: d, num_rows: 1000}\n")
    out = json.loads(_cli("plan", "--tables", f, "--dim", 8, "--out", tmp_path / "p", "--json").strip().splitlines()[-1])
    assert [m["name"] for m in out["config"]["replicated_tables"]] == ["b"]
    plan = Plan.load(tmp_path / "p" / "oper")
    assert plan.table_names == ["a", "d"] and [t.dim for t in plan.tables] == [8, 8]
    assert plan.forms == {"a": TableForm(), "b": TableForm("tt", tt_rank=4), "c": TableForm("host"), "d": TableForm()}
    f.write_text("- {name: a, num_rows: 10, compression: zip}\n")
    r = CliRunner().invoke(main, ["plan", "--tables", str(f), "--out", str(tmp_path / "q")])
    assert r.exit_code == 2 and "error:" in r.output and "compression 'zip'" in r.output, r.output
