"""DMT as a product: ``model.arch: dmt-dlrm | dmt-dcn`` through the config, the workflow, the CLI and the
distributed trainer, with checkpoints; ``embedscale towers``.

Reference: the same config trained in one process (``workflow.train``: all towers in one process over
``LocalEmbeddingBags``, the fused row-wise Adagrad, the same placement-independent initial rows, one tower
per host of ``dist.topology_hosts``). The 4-rank run (2 hosts x 2, through ``embedscale train --nproc 4``
under torchrun) goes through the tower transform with tower-group gradient sync instead; per-step losses,
every table row, tower modules and dense parameters, and the eval AUC must match within float
reassociation. Its mid-run checkpoint resumed on the same layout must end bitwise where the uninterrupted
run ended, and resumed on 2 ranks as one host with row-wise shards (re-sharding) must still match the
reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from embedscale import workflow
from embedscale.cli import main
from embedscale.errors import ConfigError
from embedscale.specs import RunConfig, from_dict, to_dict
from embedscale.plan.towers import TowerAssignment
from embedscale.train.checkpoint import latest_checkpoint, load_checkpoint
from embedscale.train.trainer import load_model_state
from embedscale.train.launch import spawn_local

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import ROWS, make_data  # noqa: E402

STEPS = 6
FEATURES = [f"C{i + 1}" for i in range(len(ROWS))]


def config(tmp_path, data_dir, **over) -> RunConfig:
    d = {"name": "dmt", "out_dir": str(tmp_path / "runs"),
         "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
         "model": {"arch": "dmt-dlrm", "embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], "tower_compression": 2,
                   "tower_c": 1, "tower_p": 1},
         "train": {"batch_size": 50, "max_steps": STEPS, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                   "checkpoint_every": 3, "sparse_optimizer": "rowwise_adagrad", "dense_optimizer": "adagrad",
                   "prefetch": 0},
         "dist": {"topology_hosts": 2, "timeout_s": 60}}
    for key, value in over.items():
        section, field = key.split("__")
        d[section][field] = value
    return from_dict(RunConfig, d)


def cli_flags(cfg: RunConfig) -> list[str]:
    m, t = cfg.model, cfg.train
    return ["--data-source", "shards", "--data-path", cfg.data.path, "--data-eval-fraction", "0.2",
            "--model-arch", m.arch, "--model-embedding-dim", "4", "--model-bottom-mlp", "8", "--model-top-mlp", "8",
            "--model-tower-compression", "2", "--model-tower-c", "1", "--model-tower-p", "1",
            "--train-batch-size", str(t.batch_size), "--train-max-steps", str(t.max_steps), "--train-lr-dense", "0.1",
            "--train-lr-sparse", "0.3", "--train-log-every", "1", "--train-checkpoint-every", "3",
            "--train-sparse-optimizer", "rowwise_adagrad", "--train-dense-optimizer", "adagrad", "--train-prefetch", "0",
            "--dist-topology-hosts", "2", "--dist-timeout-s", "60", "--out-dir", cfg.out_dir]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dmt-data")
    make_data(d)
    return d


def single_process(cfg: RunConfig, run_dir: Path) -> dict:
    summary = workflow.train(cfg, run_dir, resume=True, progress=False)
    return {**sharded(latest_checkpoint(run_dir)), "summary": summary}


def sharded(ckpt_dir: Path) -> dict:
    """Losses, whole tables (assembled from the rows of every rank file) and dense state of a DMT checkpoint of any
    world size (one process included)."""
    ck = load_checkpoint(ckpt_dir)
    assert ck["manifest"]["kind"] == "dmt"
    return {"losses": ck["losses"], "tables": {n: e["weight"] for n, e in ck["tables"].items()},
            "momentum": {n: e["momentum"] for n, e in ck["tables"].items()}, "dense": ck["dense"]}


def assert_matches(got: dict, ref: dict, atol: float, what: str) -> None:
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0, atol=atol, err_msg=f"{what}: losses")
    for key in ("tables", "momentum"):
        for name, w in ref[key].items():
            torch.testing.assert_close(got[key][name], w, rtol=0, atol=atol, msg=lambda m: f"{what} {key} {name}: {m}")
    assert set(got["dense"]) == set(ref["dense"]), (what, set(got["dense"]) ^ set(ref["dense"]))
    for k, v in ref["dense"].items():
        torch.testing.assert_close(got["dense"][k], v, rtol=0, atol=atol, msg=lambda m: f"{what} {k}: {m}")


def _resume_rank(rank, world, cfg_dict, run_dir, resume_from, bad_towers):
    """Resume ``resume_from`` on this layout and train to the end; then check that a restore under other
    towers is refused before any exchange."""
    from embedscale.train.distributed import join_run
    from embedscale.train.dmt_run import DMTRun
    from embedscale.train.ranks import train_distributed

    cfg = from_dict(RunConfig, cfg_dict)
    train_distributed(cfg, run_dir, progress=False, resume_from=resume_from)
    rd, _, _ = join_run(cfg, run_dir, False)
    run = DMTRun(cfg, rd, rank, world, False)
    run.assignment = TowerAssignment(bad_towers)
    try:
        run.restore(Path(resume_from))
        return "no error"
    except ConfigError as e:
        return str(e)


def cli_train(cfg, run_dir, nproc: int) -> dict:
    """``embedscale train --nproc N`` of ``cfg`` into ``run_dir``; its JSON summary."""
    p = subprocess.run([sys.executable, "-m", "embedscale", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
                        "--no-progress", "--json", *cli_flags(cfg)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_dmt_dlrm_on_4_ranks_through_the_cli_equals_single_process_and_resumes(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    ref = single_process(cfg, tmp_path / "single")
    assert len(ref["losses"]) == STEPS
    assert json.loads((tmp_path / "single" / "towers.json").read_text())["towers"] == [["C1", "C3"], ["C2", "C4"]]

    run4 = tmp_path / "four"
    s = cli_train(cfg, run4, 4)
    assert s["world_size"] == 4 and s["plan"].startswith("dmt: 2 towers on 2 tower group(s)")
    assert s["towers"] == [["C1", "C3"], ["C2", "C4"]] and s["compression_ratio"] == 8 / 6  # D = 2, c = p = 1: O = D (c F + p) = 6 of F N = 8
    assert s["cross_host_bytes_per_step"] > 0 and s["embedding_bytes_on_wire_per_step"] > 0
    got = sharded(run4 / "checkpoints" / f"step-{STEPS:08d}")
    assert_matches(got, ref, 1e-5, "4 ranks vs single process")
    assert abs(s["eval_auc"] - ref["summary"]["eval_auc"]) < 1e-6
    assert abs(s["eval_logloss"] - ref["summary"]["eval_logloss"]) < 1e-5

    half = run4 / "checkpoints" / "step-00000003"
    manifest = json.loads((half / "manifest.json").read_text())
    assert manifest["kind"] == "dmt" and manifest["world_size"] == 4 and manifest["step"] == 3

    # the same layout, resumed from step 3 in a new run directory: bitwise the uninterrupted run
    bad = [["C1", "C2"], ["C3", "C4"]]
    msgs = spawn_local(_resume_rank, 4, to_dict(cfg), str(tmp_path / "resumed4"), str(half), bad, timeout_s=180)
    again = sharded(tmp_path / "resumed4" / "checkpoints" / f"step-{STEPS:08d}")
    assert again["losses"] == got["losses"]
    for key in ("tables", "momentum", "dense"):
        for k in got[key]:
            assert torch.equal(again[key][k], got[key][k]), (key, k)
    for m in msgs:
        assert "trained with towers" in m and "['C1', 'C3']" in m and "same towers" in m, m

    # re-sharding: 2 ranks on one host, both towers in one tower group, row-wise shards (reduce-scatter)
    cfg2 = config(tmp_path, data_dir, model__towers=2, model__tower_sharding="row", dist__topology_hosts=1)
    spawn_local(_resume_rank, 2, to_dict(cfg2), str(tmp_path / "two"), str(half), bad, timeout_s=180)
    two = sharded(tmp_path / "two" / "checkpoints" / f"step-{STEPS:08d}")
    assert_matches(two, ref, 1e-5, "4 ranks resumed on 2 (row-wise) vs single process")


def test_single_process_dmt_dcn_resumes_exactly_and_keeps_its_towers(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir, model__arch="dmt-dcn", model__tower_cross_layers=1)
    a = tmp_path / "a"
    workflow.train(cfg, a, resume=False, progress=False)
    ck_a = load_checkpoint(a)
    model_keys = [k for k in ck_a["dense"] if k.startswith("sparse_arch.towers.")]
    assert any("cross" in k for k in model_keys), model_keys  # the DCN tower module (Listing 2) is there
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step-00000003", b / "checkpoints" / "step-00000003")
    shutil.copy(a / "towers.json", b)
    workflow.train(cfg, b, resume=True, progress=False)
    ck_b = load_checkpoint(b)
    assert ck_b["losses"] == ck_a["losses"]
    for k, v in ck_a["dense"].items():
        assert torch.equal(ck_b["dense"][k], v), k
    for n, e in ck_a["tables"].items():
        assert all(torch.equal(ck_b["tables"][n][k], v) for k, v in e.items()), n
    # resuming this run directory under other towers is refused
    other = tmp_path / "other.json"
    TowerAssignment([["C1", "C2"], ["C3", "C4"]]).save(other)
    cfg_other = config(tmp_path, data_dir, model__arch="dmt-dcn", model__tower_assignment=str(other))
    with pytest.raises(ConfigError, match=r"towers\.json: this run directory was trained with towers"):
        workflow.train(cfg_other, b, resume=True, progress=False)


def cli_infer(checkpoint: Path, run_dir: Path, nproc: int) -> dict:
    p = subprocess.run([sys.executable, "-m", "embedscale", "infer", str(checkpoint), "--nproc", str(nproc),
                        "--run-dir", str(run_dir), "--no-progress", "--json"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_dmt_dcn_on_4_ranks_through_the_cli_equals_single_process_and_serves(tmp_path, data_dir):
    """DMT-DCN (DCN tower modules, Listing 2) on 4 ranks as 2 hosts x 2 through ``embedscale train`` trains the
    single-process model; ``embedscale infer`` on one rank serves its sharded checkpoint as the run scored it."""
    cfg = config(tmp_path, data_dir, model__arch="dmt-dcn")
    ref = single_process(cfg, tmp_path / "single")
    run4 = tmp_path / "four"
    s = cli_train(cfg, run4, 4)
    assert s["world_size"] == 4 and s["plan"].startswith("dmt: 2 towers on 2 tower group(s)")
    assert s["towers"] == [["C1", "C3"], ["C2", "C4"]] and s["compression_ratio"] == 2.0  # D = 2: O = F D = 4 of F N = 8
    got = sharded(run4 / "checkpoints" / f"step-{STEPS:08d}")
    assert any(".cross" in k for k in got["dense"] if k.startswith("sparse_arch.towers."))  # the tower CrossNets
    assert_matches(got, ref, 1e-5, "dmt-dcn, 4 ranks vs single process")
    assert abs(s["eval_auc"] - ref["summary"]["eval_auc"]) < 1e-6
    assert abs(s["eval_logloss"] - ref["summary"]["eval_logloss"]) < 1e-5

    out = cli_infer(run4 / "checkpoints" / f"step-{STEPS:08d}", tmp_path / "served", 1)
    assert out["world_size"] == 1 and out["towers"] == s["towers"] and out["samples"] == ref["summary"]["eval_rows"]
    assert abs(out["auc"] - s["eval_auc"]) < 1e-6 and abs(out["logloss"] - s["eval_logloss"]) < 1e-5


def test_infer_serves_a_single_process_dmt_dlrm_checkpoint_on_1_and_2_ranks(tmp_path, data_dir):
    """``embedscale infer`` of a single-process DMT-DLRM checkpoint file: on one rank and on two (2 hosts x 1,
    each rank holding its tower group's rows) the predictions are the model's own on the eval split, and
    logloss and AUC those of the run's final evaluation."""
    from embedscale.data.loader import ShardLoader

    cfg = config(tmp_path, data_dir)
    run = tmp_path / "single"
    summary = workflow.train(cfg, run, resume=False, progress=False)
    ck_path = latest_checkpoint(run)
    # the reference: the checkpoint loaded into the single-process model (all towers in one process)
    data = workflow.prepare_data(cfg, progress=False)
    model, _ = workflow.build(cfg, workflow.tables_for(cfg, data.manifest), data.manifest.num_dense,
                              torch.device(cfg.train.device), assignment=TowerAssignment.load(run / "towers.json"))
    load_model_state(model, ck_path)
    model.eval()
    ev = data.eval
    with torch.no_grad():
        z = torch.cat([model(b.dense, b.sparse) for b in ShardLoader(ev.directory, 16, start=ev.start, stop=ev.stop)])
    want = (1 / (1 + np.exp(-z.double().numpy())))
    for nproc in (1, 2):
        out = cli_infer(ck_path, tmp_path / f"served{nproc}", nproc)
        assert out["world_size"] == nproc and out["towers"] == [["C1", "C3"], ["C2", "C4"]]
        assert out["samples"] == summary["eval_rows"] == len(want)
        assert abs(out["auc"] - summary["eval_auc"]) < 1e-6, (nproc, out, summary)
        assert abs(out["logloss"] - summary["eval_logloss"]) < 1e-5, (nproc, out, summary)
        pred = np.load(tmp_path / f"served{nproc}" / "predictions.npy")
        np.testing.assert_allclose(pred, want, rtol=0, atol=1e-6, err_msg=f"{nproc} rank(s)")
    # a checkpoint away from its run (no towers.json beside it): its manifest's towers
    alone = tmp_path / "alone" / "step"
    shutil.copytree(ck_path, alone)
    out = cli_infer(alone, tmp_path / "served-alone", 1)
    assert out["towers"] == [["C1", "C3"], ["C2", "C4"]] and abs(out["auc"] - summary["eval_auc"]) < 1e-6


def test_dmt_config_errors_name_the_key(tmp_path, data_dir):
    def build(**over):
        cfg = config(tmp_path, data_dir, **over)
        data = workflow.prepare_data(cfg, progress=False)
        return workflow.build(cfg, workflow.tables_for(cfg, data.manifest), data.manifest.num_dense,
                              torch.device(cfg.train.device))

    with pytest.raises(ConfigError, match="model.tower_compression 3 must divide model.embedding_dim 4"):
        build(model__tower_compression=3)
    with pytest.raises(ConfigError, match="model.towers is set but model.arch is 'dlrm'"):
        build(model__arch="dlrm", model__towers=2)
    with pytest.raises(ConfigError, match="model.tower_sharding 'column' is not one of table, row"):
        build(model__tower_sharding="column")
    with pytest.raises(ConfigError, match="model.tower_c and model.tower_p are both 0"):
        build(model__tower_c=0, model__tower_p=0)
    with pytest.raises(ConfigError, match="model.tower_assignment: file not found: .*nope.json"):
        build(model__tower_assignment=str(tmp_path / "nope.json"))
    partial = tmp_path / "partial.json"
    TowerAssignment([["C1", "C3"], ["C2"]]).save(partial)
    with pytest.raises(ConfigError, match=r"partial\.json: .*missing \['C4'\]"):
        build(model__tower_assignment=str(partial))
    with pytest.raises(ConfigError, match="has 2 towers, model.towers asks for 3"):
        build(model__tower_assignment=str(_save(tmp_path, [["C1", "C3"], ["C2", "C4"]])), model__towers=3)
    # an assignment file sets the tower count when model.towers is 0; the CLI has a flag per setting
    model, _ = build(model__tower_assignment=str(_save(tmp_path, [["C1"], ["C2"], ["C3", "C4"]])), dist__topology_hosts=1)
    assert model.sparse_arch.assignment.towers == [["C1"], ["C2"], ["C3", "C4"]]
    r = CliRunner().invoke(main, ["train", "--help"])
    for flag in ("--model-towers", "--model-tower-assignment", "--model-tower-compression", "--model-tower-c",
                 "--model-tower-p", "--model-hosts-per-tower", "--model-tower-sharding"):
        assert flag in r.output, flag


def _save(tmp_path, towers) -> Path:
    path = tmp_path / f"towers-{len(towers)}-{len(towers[0])}.json"
    TowerAssignment(towers).save(path)
    return path


# --------------------------------------------------------------------------------------------------
# embedscale towers


def planted_shards(path: Path, n: int):
    """``PlantedGroups`` (8 features, 2 planted groups) written as shards; returns the generator."""
    from embedscale.data.shards import ShardWriter, SparseFeatureInfo
    from embedscale.towers.planted import PlantedGroups

    data = PlantedGroups(num_features=8, num_groups=2, num_rows=30, seed=1)
    b = data.batch(0, n)
    assert int(b.sparse.lengths.max()) == 1 == int(b.sparse.lengths.min())
    # one-hot, key-major values: feature i's ids are values[i n: (i + 1) n]
    ids = {k: b.sparse.values[i * n:(i + 1) * n].numpy() for i, k in enumerate(b.sparse.keys)}
    with ShardWriter(path, [f"I{i + 1}" for i in range(data.num_dense)],
                     [SparseFeatureInfo(f, data.num_rows) for f in data.feature_names], shard_rows=50_000) as w:
        w.write(b.labels.numpy(), b.dense.numpy(), ids)
    return data


def test_towers_command_learns_planted_groups_and_training_accepts_them(tmp_path):
    from embedscale.plan.towers import adjusted_rand_index

    data = planted_shards(tmp_path / "planted", 130_000)
    cfg = from_dict(RunConfig, {
        "name": "plain", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(tmp_path / "planted"), "eval_fraction": 0.08},
        "model": {"arch": "dlrm", "embedding_dim": 8, "bottom_mlp": [16], "top_mlp": [16]},
        "train": {"batch_size": 512, "lr_dense": 0.05, "lr_sparse": 1.0, "dense_optimizer": "adagrad",
                  "eval_every": 0, "log_every": 50, "prefetch": 0}})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workflow.train(cfg, tmp_path / "plain", resume=False, progress=False)
    finally:
        torch.set_num_threads(threads)
    r = CliRunner().invoke(main, ["towers", str(tmp_path / "plain"), "--samples", "4096", "--no-progress", "--json"])
    assert r.exit_code == 2 and "pass --towers T" in r.output, r.output  # a one-host run: say how many
    out = tmp_path / "learned.json"
    r = CliRunner().invoke(main, ["towers", str(tmp_path / "plain"), "--towers", "2", "--samples", "4096", "--out",
                                  str(out), "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output.strip().splitlines()[-1])
    learned = TowerAssignment.load(out)
    assert learned.towers == s["towers"] and learned.sizes == [4, 4] and s["samples"] == 4096
    assert adjusted_rand_index(learned.labels(data.feature_names), data.group_labels) >= 0.9, (learned.towers,
                                                                                              data.groups())
    assert s["learned"]["within_tower_interaction"] > s["naive"]["within_tower_interaction"]
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert np.asarray(report["interaction"]).shape == (8, 8) and report["features"] == data.feature_names
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert Path(learned.meta["checkpoint"]).name.startswith("step-") and learned.meta["samples"] == 4096

    # training reads the file: a DMT run on one host with the learned towers (their count from the file)
    r = CliRunner().invoke(main, ["train", "--data-source", "shards", "--data-path", str(tmp_path / "planted"),
                                  "--data-eval-fraction", "0.08", "--model-arch", "dmt-dlrm", "--model-embedding-dim",
                                  "8", "--model-bottom-mlp", "16", "--model-top-mlp", "16", "--model-tower-assignment",
                                  str(out), "--train-max-steps", "3", "--train-batch-size", "256", "--run-dir",
                                  str(tmp_path / "dmt"), "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    assert TowerAssignment.load(tmp_path / "dmt" / "towers.json").towers == learned.towers


def test_towers_reads_checkpoints_of_any_world_size(tmp_path):
    """Whole tables rebuilt from the rows (by table and row id) of every rank file, whatever rank holds which."""
    from embedscale.specs import TableSpec
    from embedscale.towers.command import load_table_weights
    from embedscale.train.checkpoint import write_manifest, write_rank_file

    tables = [TableSpec("a", 5, 3), TableSpec("b", 7, 3, features=["b1", "b2"])]
    g = torch.Generator().manual_seed(0)
    full = {t.name: torch.randn(t.num_rows, 3, generator=g) for t in tables}
    ck = tmp_path / "ck"
    perm = {t.name: torch.randperm(t.num_rows, generator=g) for t in tables}
    for r in range(2):
        part = {n: {"rows": p[r::2], "weight": full[n][p[r::2]]} for n, p in perm.items()}
        write_rank_file(ck, r, {"rank": r, "world_size": 2, "tables": part})
    write_manifest(ck, 2, {"kind": "plan", "tables": ["a", "b"], "table_rows": [5, 7], "step": 1, "epoch": 0,
                           "batch_in_epoch": 1, "samples": 1})
    got = load_table_weights(ck, tables)
    for name, w in full.items():
        assert torch.equal(got[name], w), name
    write_rank_file(ck, 1, {"rank": 1, "world_size": 2, "tables": {}})
    with pytest.raises(Exception, match="no rank file holds row .* of table 'a'"):
        load_table_weights(ck, tables)
