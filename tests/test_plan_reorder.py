"""A TT table in a plan carries its index reordering (EL-Rec section IV).

References: the frequency reordering against a lexsort of the profile's counts; a 2-rank run of a plan made by
``embedscale plan --tt-reorder`` against one process training the same model with ``model.tt_reorder`` (and
against one without: the reordering must change the TT table); a checkpoint's maps loaded into a model built
without them against the trained model's own predictions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from embedscale import workflow
from embedscale.assemble import build, prepare_data, tables_for
from embedscale.data.loader import ShardLoader
from embedscale.data.profile import AccessProfile
from embedscale.errors import ConfigError, FormatError
from embedscale.plan.forms import TableForm, decide_forms, forms_for_run, reordered_tables
from embedscale.plan.plan import Plan
from embedscale.reorder import PLAN_REORDER_DIR, Reordering, plan_reordering, reorder_for_plan
from embedscale.specs import RunConfig, TableSpec, from_dict, to_dict
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.launch import spawn_local
from embedscale.train.trainer import load_model_state

from test_distributed_train import ROWS, STEPS, make_data

SRC = Path(__file__).resolve().parents[1] / "src"


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-m", "embedscale", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def frequency_map(counts: np.ndarray) -> np.ndarray:
    """``map[old] = new``: rows by descending count, ties by row id (EL-Rec Algorithm 2 with no batches)."""
    order = np.lexsort((np.arange(counts.size), -np.asarray(counts, dtype=np.int64)))
    m = np.empty(counts.size, dtype=np.int64)
    m[order] = np.arange(counts.size)
    return m


# -- forms -------------------------------------------------------------------------------------------------

def test_a_tt_form_records_its_reordering_and_only_tt_forms_can():
    f = TableForm("tt", tt_rank=4, reorder=True)
    assert TableForm.from_dict(f.to_dict()) == f and "reordered" in f.describe()
    assert TableForm.from_dict({"kind": "tt", "tt_rank": 4}).reorder is False  # plans saved before a TT form carried its reordering
    with pytest.raises(ConfigError, match="TT tables only"):
        TableForm("host", reorder=True)
    with pytest.raises(ConfigError, match="expected true or false"):
        TableForm.from_dict({"kind": "tt", "tt_rank": 4, "reorder": 1})
    tabs = [TableSpec("a", 10, 4), TableSpec("b", 1000, 4)]
    forms = decide_forms(tabs, tt_min_rows=100, tt_rank=4, tt_reorder="frequency")
    assert forms == {"a": TableForm(), "b": f} and reordered_tables(forms) == ["b"]
    assert decide_forms(tabs, tt_min_rows=100, tt_rank=4)["b"].reorder is False
    with pytest.raises(ConfigError, match="model.tt_reorder 'random' is not one of"):
        decide_forms(tabs, tt_min_rows=100, tt_reorder="random")
    # a config asking for a reordering the plan does not carry is an error; the plan's reordering wins otherwise
    plain = {"a": TableForm(), "b": TableForm("tt", tt_rank=4)}
    with pytest.raises(ConfigError, match=r"table 'b': the config asks for tt \(rank 4, reordered\)"):
        forms_for_run(plain, forms, "p")
    assert forms_for_run(forms, plain, "p") == forms


def test_the_frequency_reordering_ranks_rows_by_count_and_the_plan_carries_it(tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=200)  # many ties: broken by row id
    tabs = [TableSpec("t", 200, 4, features=["f"])]
    prof = AccessProfile({"t": counts}, 100)
    forms = {"t": TableForm("tt", tt_rank=2, reorder=True)}
    reo = reorder_for_plan(tmp_path, forms, tabs, prof, method="frequency", hot_ratio=0.05, progress=False)
    np.testing.assert_array_equal(reo.map("t"), frequency_map(counts))
    assert reo.meta["method"] == "frequency" and (tmp_path / PLAN_REORDER_DIR / "reorder.json").exists()
    np.testing.assert_array_equal(plan_reordering(tmp_path, forms, tabs).map("t"), frequency_map(counts))
    assert plan_reordering(tmp_path, {"t": TableForm("tt", tt_rank=2)}, tabs) is None  # no form asks
    with pytest.raises(FormatError, match="reorder.json is missing"):
        plan_reordering(tmp_path / "elsewhere", forms, tabs)
    with pytest.raises(FormatError, match="has 200 rows, the table 300"):
        plan_reordering(tmp_path, forms, [TableSpec("t", 300, 4, features=["f"])])
    with pytest.raises(ConfigError, match="needs the data's batches"):
        reorder_for_plan(tmp_path / "b", forms, tabs, prof, method="leiden", progress=False)


# -- plan, train on 2 ranks, one process, checkpoints ----------------------------------------------------

def run_config(tmp_path, data_dir, *, plan="", **model) -> RunConfig:
    """The small run of these tests (``model``: more ``model.`` keys; ``tables=None`` leaves them out)."""
    model = {k: v for k, v in model.items() if v is not None}
    return from_dict(RunConfig, {
        "name": "r", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], **model},
        "train": {"batch_size": 50, "max_steps": STEPS, "lr_dense": 0.1, "lr_sparse": 0.3, "lr_tt": 0.3,
                  "log_every": 1, "sparse_optimizer": "rowwise_adagrad", "dense_optimizer": "adagrad",
                  "prefetch": 0},
        "dist": {"plan": plan, "timeout_s": 60},
    })


def _config(tmp_path, data_dir, *, plan="", tt_reorder="frequency", tables=None) -> RunConfig:
    return run_config(tmp_path, data_dir, plan=plan, tt_reorder=tt_reorder, tables=tables)


def train_rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed  # in the spawned rank

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


TT_TABLES = [{"name": f"t_C{i + 1}", "num_rows": r, "dim": 4, "features": [f"C{i + 1}"],
              **({"compression": "tt", "tt_rank": 2} if i == 2 else {})} for i, r in enumerate(ROWS)]


def test_a_plan_made_with_tt_reorder_trains_on_two_ranks_like_one_process(tmp_path):
    data_dir = tmp_path / "data"
    make_data(data_dir)
    assert _cli("profile", str(data_dir), "--out", "prof", "--no-progress", cwd=tmp_path).returncode == 0
    p = _cli("plan", "--profile", "prof", "--dim", "4", "--tt-min-rows", "100", "--tt-rank", "2",
             "--tt-reorder", "frequency", "--out", "plans", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    plan_dir = tmp_path / "plans" / "oper"
    plan = Plan.load(plan_dir)
    assert plan.forms["t_C3"] == TableForm("tt", tt_rank=2, reorder=True)
    assert plan.meta["reordering"]["tables"] == ["t_C3"] and plan.meta["reordering"]["method"] == "frequency"
    counts = np.asarray(AccessProfile.load(tmp_path / "prof").counts("C3"))
    np.testing.assert_array_equal(Reordering.load(plan_dir / PLAN_REORDER_DIR).map("t_C3"), frequency_map(counts))

    # one process, model.tt_reorder: the same reordering built from the training split's profile
    workflow.train(_config(tmp_path, data_dir, tables=TT_TABLES), tmp_path / "single", resume=False, progress=False)
    ref = load_checkpoint(tmp_path / "single")
    assert sorted(ref["reorder"]) == ["t_C3"]
    # (the training split is 80% of the data: its own profile, so compare with the run's reorder, not the plan's)
    run_map = Reordering.load(tmp_path / "single" / PLAN_REORDER_DIR).map("t_C3")
    np.testing.assert_array_equal(ref["reorder"]["t_C3"].numpy(), run_map)
    np.testing.assert_array_equal(run_map, frequency_map(
        np.asarray(AccessProfile.load(tmp_path / "single" / "profile").counts("t_C3"))))
    # ... and without the reordering the TT table is another one: the comparison below can fail
    workflow.train(_config(tmp_path, data_dir, tables=TT_TABLES, tt_reorder="none"), tmp_path / "plain",
                   resume=False, progress=False)
    plain = load_checkpoint(tmp_path / "plain")
    assert not plain["reorder"] and not np.allclose(plain["losses"], ref["losses"], rtol=0, atol=1e-5)

    # 2 ranks with the saved plan (no reorder request in the config: the plan's form wins) and the plan's maps,
    # against one process with the same maps (the single run's reorder/ replaced by the plan's)
    single2 = tmp_path / "single2"
    single2.mkdir()
    Reordering.load(plan_dir / PLAN_REORDER_DIR).save(single2 / PLAN_REORDER_DIR)
    workflow.train(_config(tmp_path, data_dir, tables=TT_TABLES), single2, resume=False, progress=False)
    ref2 = load_checkpoint(single2)
    spawn_local(train_rank, 2, to_dict(_config(tmp_path, data_dir, plan=str(plan_dir), tt_reorder="none")),
                str(tmp_path / "dist"), timeout_s=180)
    got = load_checkpoint(tmp_path / "dist")
    assert got["manifest"]["world_size"] == 2
    assert (tmp_path / "dist" / "plan" / PLAN_REORDER_DIR / "reorder.json").exists()
    np.testing.assert_array_equal(got["reorder"]["t_C3"].numpy(), frequency_map(counts))
    np.testing.assert_allclose(got["losses"], ref2["losses"], rtol=0, atol=1e-5)
    for k, v in ref2["tt"].items():
        torch.testing.assert_close(got["tt"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"TT {k}: {m}")

    # the 2-rank checkpoint in one process built without any reordering: the checkpoint brings its maps
    cfg = _config(tmp_path, data_dir, tables=TT_TABLES)
    data = prepare_data(cfg, progress=False)
    tables = tables_for(cfg, data.manifest)
    model, _ = build(cfg, tables, data.manifest.num_dense, torch.device("cpu"))
    batch = next(iter(ShardLoader(data_dir, 64)))
    model.eval()
    before = model(batch.dense, batch.sparse).detach()
    load_model_state(model, tmp_path / "dist")
    after = model(batch.dense, batch.sparse).detach()
    emb = next(m for m in model.modules() if hasattr(m, "reorder_state"))
    np.testing.assert_array_equal(emb.reorder_state()["t_C3"].numpy(), frequency_map(counts))
    assert not torch.allclose(before, after)
    # the same checkpoint with the maps dropped predicts otherwise: the maps matter
    emb.load_reorder_state({}, "test")
    assert not torch.allclose(model(batch.dense, batch.sparse).detach(), after)


def test_a_plan_whose_reordering_is_missing_is_a_named_error(tmp_path):
    data_dir = tmp_path / "data"
    make_data(data_dir)
    assert _cli("profile", str(data_dir), "--out", "prof", "--no-progress", cwd=tmp_path).returncode == 0
    p = _cli("plan", "--profile", "prof", "--dim", "4", "--tt-min-rows", "100", "--tt-rank", "2",
             "--tt-reorder", "leiden", "--reorder-data", str(data_dir), "--out", "plans", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    plan_dir = tmp_path / "plans" / "oper"
    reo = Reordering.load(plan_dir / PLAN_REORDER_DIR)
    counts = np.asarray(AccessProfile.load(tmp_path / "prof").counts("C3"))
    hot = int(np.floor(counts.size * 0.01))
    assert reo.meta["method"] == "leiden" and np.array_equal(np.sort(reo.map("t_C3")), np.arange(counts.size))
    np.testing.assert_array_equal(reo.map("t_C3")[np.argsort(-counts.astype(np.int64), kind="stable")[:hot]], np.arange(hot))
    (plan_dir / PLAN_REORDER_DIR / "reorder.json").unlink()
    cfg = _config(tmp_path, data_dir, plan=str(plan_dir), tt_reorder="none")
    (tmp_path / "c.yaml").write_text(json.dumps(to_dict(cfg)))
    bad = _cli("train", "--config", "c.yaml", "--nproc", "2", "--run-dir", "run", "--no-progress", cwd=tmp_path)
    assert bad.returncode == 2 and "reorder.json is missing" in bad.stderr and "Traceback" not in bad.stderr
    no_prof = _cli("plan", "--preset", "criteo-kaggle", "--max-rows", "1000", "--tt-min-rows", "100",
                   "--tt-reorder", "frequency", "--out", "p2", cwd=tmp_path)
    assert no_prof.returncode == 2 and "give --profile DIR" in no_prof.stderr
