"""TT tables on several ranks (EL-Rec VI-B): replicated, trained data-parallel, next to sharded tables.

Reference: ``workflow.train`` in one process (``MixedEmbedding``: uncompressed tables in a
``LocalEmbeddingBags``, TT tables as ``TTEmbeddingBag``, fused row-wise Adagrad / Adagrad on the cores).
The 2-rank runs shard the uncompressed tables by a hand-written plan and hold a replica of every TT table
on each rank, their core gradients summed over the ranks; per-step losses, the uncompressed rows, the TT
cores (and the materialised TT tables) and the dense weights must match within 1e-5, and the two replicas
must be identical. Also: EL-Rec's policy from the config (``model.tt_min_rows``), the planner leaving TT
tables out of the plan, and resuming a 2-rank checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedscale import workflow
from embedscale.data.shards import Manifest, ShardWriter, SparseFeatureInfo
from embedscale.embedding.tt import TTEmbeddingBag
from embedscale.errors import ConfigError
from embedscale.plan.forms import TableForm, config_forms, decide_forms
from embedscale.plan.plan import Plan
from embedscale.specs import RunConfig, TableSpec, Topology, from_dict, to_dict
from embedscale.train.checkpoint import latest_checkpoint, load_checkpoint
from embedscale.train.launch import spawn_local

ROWS = [30, 9, 130, 5, 210]  # C3 and C5 reach tt_min_rows: TT; C4 sits after a TT table (init index)
TT_MIN = 100
STEPS = 6
PLAIN = [0, 1, 3]  # indices of the uncompressed tables


def make_data(path, n=400, seed=0):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    ids = [np.minimum((rng.random(n) ** 3 * r).astype(np.int64), r - 1) for r in ROWS]
    logit = dense[:, 0] + 0.5 * (ids[0] % 3 == 0) - 0.5 * (ids[2] < 10) + 0.3 * (ids[4] % 2)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    sp = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(ROWS)]
    with ShardWriter(path, ["I1", "I2", "I3"], sp, shard_rows=150) as w:
        w.write(labels, dense, {f"C{i + 1}": ids[i] for i in range(len(ROWS))})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tt-data")
    make_data(d)
    return d


def config(tmp_path, data_dir, plan="", design="retrieve", steps=STEPS) -> RunConfig:
    # lr 0.1 (rows and cores): element-wise Adagrad on the cores turns the float rounding of near-zero core
    # gradients (summed in another order on two ranks) into steps; at 0.3 that reaches 3e-5 after 6 steps,
    # at 0.1 3e-7
    return from_dict(RunConfig, {
        "name": "t", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], "tt_min_rows": TT_MIN, "tt_rank": 3},
        "train": {"batch_size": 50, "max_steps": steps, "lr_dense": 0.1, "lr_sparse": 0.1, "log_every": 1,
                  "lr_tt": 0.1, "sparse_optimizer": "rowwise_adagrad", "dense_optimizer": "adagrad", "prefetch": 0,
                  "lr_warmup_steps": 3},
        "dist": {"design": design, "plan": plan, "timeout_s": 60},
    })


def plain_tables():
    return [TableSpec(f"t_C{i + 1}", ROWS[i], 4, features=[f"C{i + 1}"]) for i in PLAIN]


def hand_plan(kind: str, world: int) -> Plan:
    """Table-wise, or row-wise with the first 3 rows of t_C1 replicated on every rank."""
    ts = plain_tables()
    T = len(ts)
    if kind == "table_wise":
        return Plan(ts, world, [None] * T, np.arange(T), np.zeros(T), [t.num_rows for t in ts],
                    owner=np.arange(T) % world, meta={"strategy": "table_wise"})
    pt, ps, pe, own, hold = [], [], [], [], []
    for t, spec in enumerate(ts):
        lo = 3 if t == 0 else 0
        if lo:
            pt.append(t), ps.append(0), pe.append(lo), own.append(0), hold.append(np.ones(world, bool))
        cuts = np.linspace(lo, spec.num_rows, world + 1).astype(int)
        for r in range(world):
            h = np.zeros(world, bool)
            h[(r + t) % world] = True
            pt.append(t), ps.append(cuts[r]), pe.append(cuts[r + 1]), own.append((r + t) % world), hold.append(h)
    return Plan(ts, world, [None] * T, pt, ps, pe, owner=own, holders=np.array(hold), meta={"strategy": kind})


def single_process(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    rd = tmp_path / "single"
    workflow.train(cfg, rd, resume=False, progress=False)
    ck = load_checkpoint(rd)
    weights = torch.cat([ck["tables"][f"t_C{i + 1}"]["weight"] for i in PLAIN])
    return ck["losses"], weights, ck["tt"], ck["dense"], rd


def _rank(rank, world, cfg_dict, run_dir, resume_from):
    from embedscale.train.distributed import DistributedRun, join_run
    from embedscale.train.loop import LoopConfig, fit

    cfg = from_dict(RunConfig, cfg_dict)
    rd, r, w = join_run(cfg, run_dir, False)
    run = DistributedRun(cfg, rd, r, w, False)
    if resume_from:
        run.restore(__import__("pathlib").Path(resume_from))
    fit(run, LoopConfig.from_train(cfg.train))
    out = {k: v.detach().clone() for k, v in run.tt_embedding.tt.state_dict().items()}
    out["prefetched_tt_steps"] = torch.tensor(run.tt_embedding.prefetched_tt_steps)
    return out


def distributed(cfg, run_dir, world=2, resume_from=None):
    replicas = spawn_local(_rank, world, to_dict(cfg), str(run_dir), resume_from, timeout_s=120)
    ck = load_checkpoint(run_dir)
    full = torch.cat([ck["tables"][f"t_C{i + 1}"]["weight"] for i in PLAIN])
    return ck["losses"], full, ck["tt"], ck["dense"], replicas


def materialise(state: dict, name: str) -> torch.Tensor:
    """The [rows, dim] TT table held by cores ``state``: an independent reference of what the cores mean."""
    i = int(name[len("t_C"):]) - 1
    bag = TTEmbeddingBag(ROWS[i], 4, 3, optimizer=None)
    with torch.no_grad():
        for k, c in enumerate(bag.cores):
            c.copy_(state[f"{name}.core{k}"])
    return bag.full_weight()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    return single_process(tmp_path_factory.mktemp("ref"), data_dir)


@pytest.mark.parametrize("kind,design", [("table_wise", "retrieve"), ("replicas", "send")])
def test_two_ranks_with_tt_tables_equal_single_process(tmp_path, data_dir, reference, kind, design):
    ref_losses, ref_w, ref_tt, ref_dense, _ = reference
    assert sorted({k.split(".")[0] for k in ref_tt}) == ["t_C3", "t_C5"]
    plan_dir = tmp_path / "plan"
    hand_plan(kind, 2).save(plan_dir)
    losses, w, tt, dense, replicas = distributed(config(tmp_path, data_dir, str(plan_dir), design), tmp_path / "d")
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-5)
    assert set(tt) == set(ref_tt)
    for k, v in ref_tt.items():
        torch.testing.assert_close(tt[k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    for name in ("t_C3", "t_C5"):
        torch.testing.assert_close(materialise(tt, name), materialise(ref_tt, name), rtol=0, atol=1e-5)
    for k, v in ref_dense.items():
        torch.testing.assert_close(dense[k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    for k in replicas[0]:  # the replicas never drift apart: the same summed gradient on both ranks
        torch.testing.assert_close(replicas[0][k], replicas[1][k], rtol=0, atol=0)
    # beside TT replicas the sharded rows' ids still go through the input pipeline (MixedEmbedding.prefetch):
    # every step's but the first converted during the step before, and the losses above unchanged by it
    summary = __import__("json").loads((tmp_path / "d" / "summary.json").read_text())
    assert summary.get("input_pipelined_steps", 0) == STEPS - 1, summary  # either design
    assert int(replicas[0]["prefetched_tt_steps"]) == STEPS - 1  # TT inputs too


def test_two_rank_checkpoint_with_tt_tables_resumes_exactly(tmp_path, data_dir, reference):
    ref_losses, ref_w, ref_tt, _, _ = reference
    plan_dir = tmp_path / "plan"
    hand_plan("replicas", 2).save(plan_dir)
    distributed(config(tmp_path, data_dir, str(plan_dir), steps=3), tmp_path / "first")
    ck = sorted(p for p in (tmp_path / "first" / "checkpoints").iterdir() if p.is_dir())[-1]
    assert "tt" in torch.load(ck / "rank-00000.pt", weights_only=True)
    losses, w, tt, _, _ = distributed(config(tmp_path, data_dir, str(plan_dir)), tmp_path / "second",
                                      resume_from=str(ck))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-5)
    for k, v in ref_tt.items():
        torch.testing.assert_close(tt[k], v, rtol=0, atol=1e-5)


def test_policy_from_config_marks_tables_and_checks_conflicts(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    tables = workflow.tables_for(cfg, Manifest.load(data_dir))
    forms = config_forms(cfg.model, tables)
    assert [(t.name, forms[t.name].kind, forms[t.name].tt_rank or None) for t in tables] == [
        ("t_C1", "sharded", None), ("t_C2", "sharded", None), ("t_C3", "tt", 3), ("t_C4", "sharded", None),
        ("t_C5", "tt", 3)]
    cfg.model.tt_min_rows = 0  # off: nothing compressed (the default)
    assert all(f == TableForm() for f in config_forms(cfg.model, workflow.tables_for(cfg, Manifest.load(data_dir)))
               .values())
    cfg.model.tt_min_rows, cfg.model.host_min_rows = TT_MIN, 200
    with pytest.raises(ConfigError, match="t_C5.*tt_min_rows.*host_min_rows"):
        workflow.tables_for(cfg, Manifest.load(data_dir))
    cfg.model.host_min_rows, cfg.model.tt_min_rows = 0, -1
    with pytest.raises(ConfigError, match="model.tt_min_rows"):
        workflow.tables_for(cfg, Manifest.load(data_dir))


def test_planner_replicates_tt_tables_instead_of_sharding_them(tmp_path):
    from embedscale.plan.api import compare, make_plan
    from embedscale.plan.synthetic_profile import ZipfProfile
    from embedscale.embedding.compression import table_bytes

    tables = [TableSpec("small", 1000, 16), TableSpec("big", 3_000_000, 16), TableSpec("mid", 50_000, 16)]
    forms = decide_forms(tables, tt_min_rows=1_000_001, tt_rank=32)
    prof = ZipfProfile.from_tables(tables)
    plan = make_plan("oper", tables, prof, Topology(ranks_per_host=2), forms=forms)
    assert plan.table_names == ["small", "mid"] and plan.forms == forms
    (meta,) = plan.meta["replicated_tables"]
    assert meta["name"] == "big" and meta["tt_rank"] == 32 and meta["bytes"] == table_bytes(tables[1], forms["big"])
    assert meta["bytes"] < tables[1].memory_bytes / 100
    assert plan.summary()["replicated_tables"] == ["big"] and plan.summary()["replicated_bytes_per_rank"] == meta["bytes"]
    rep = compare(["oper", "table_wise"], tables, prof, Topology(ranks_per_host=2), forms=forms)
    assert rep["config"]["replicated_bytes_per_rank"] == meta["bytes"]
    plain_bytes = (1000 + 50_000) * 16 * 4
    assert rep["config"]["memory_budget_bytes"] < plain_bytes  # the budget is the sharded tables' share only
    with pytest.raises(ConfigError, match="every table is TT-compressed"):
        make_plan("oper", [tables[1]], prof, Topology(ranks_per_host=2), forms=forms)
    with pytest.raises(ConfigError, match=r"tables \['mid'\] have no form"):
        make_plan("oper", tables, prof, Topology(ranks_per_host=2), forms={"small": TableForm(), "big": forms["big"]})


def test_plan_cli_applies_the_policy(tmp_path):
    import json

    from click.testing import CliRunner

    from embedscale.cli import main

    out = tmp_path / "plans"
    res = CliRunner().invoke(main, ["plan", "--preset", "criteo-kaggle", "--tt-min-rows", "1000000",
                                    "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output.strip().splitlines()[-1])
    names = [m["name"] for m in rep["config"]["replicated_tables"]]
    assert names == ["C3", "C4", "C12", "C16", "C21"]  # criteo-kaggle's five tables over 1M rows
    assert Plan.load(out / "oper").table_names == [f"C{i}" for i in range(1, 27) if f"C{i}" not in names]
    assert "replicated on every rank" in (out / "report.md").read_text()


def _infer_rank(rank, world, cfg_dict, checkpoint, run_dir):
    from embedscale.train.ranks import infer_distributed

    return infer_distributed(from_dict(RunConfig, cfg_dict), checkpoint, run_dir, progress=False)


def test_single_process_checkpoint_with_tt_tables_serves_on_two_ranks(tmp_path, data_dir, reference):
    """A single-process checkpoint (uncompressed tables under ``local.``, TT cores under ``tt.``) restored onto
    an inference plan on 2 ranks scores the eval split as the single-process model did."""
    *_, rd = reference
    summary = __import__("json").loads((rd / "summary.json").read_text())
    plan_dir = tmp_path / "plan"
    hand_plan("table_wise", 2).save(plan_dir)
    ck = latest_checkpoint(rd)
    out = spawn_local(_infer_rank, 2, to_dict(config(tmp_path, data_dir, str(plan_dir))), str(ck),
                      str(tmp_path / "infer"), timeout_s=120)[0]
    assert out["samples"] == summary["eval_samples"]
    assert abs(out["auc"] - summary["eval_auc"]) < 1e-6 and abs(out["logloss"] - summary["eval_logloss"]) < 1e-5
