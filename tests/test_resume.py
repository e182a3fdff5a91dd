"""Resume on any world size, plan records and metrics history.

A run trains k steps on world A and checkpoints; then (a) its run directory is resumed on world B for m more
steps (re-planned with the run's strategy, re-sharded from the checkpoint by row id, by itself: no marker to
delete), and (b) the same checkpoint is restored in a fresh run on world B that trains the same m steps.
(a) and (b) must agree (losses and weights within 1e-5), (a) must really continue from step k (its first k
checkpoints are world A's, its losses up to k are A's), and both must equal the independent reference:
single-process training of the k + m steps (within 1e-5).
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import checkpoint_state, config, make_data  # noqa: E402

from click.testing import CliRunner  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.cli import main, resolve_config  # noqa: E402
from embedscale.io import read_json  # noqa: E402
from embedscale.specs import RunConfig, from_dict, to_dict  # noqa: E402
from embedscale.train.checkpoint import latest_checkpoint, read_manifest, step_dir  # noqa: E402
from embedscale.train.launch import RankFailed, spawn_local  # noqa: E402

K, M = 3, 3  # steps on world A, then on world B


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume-data")
    make_data(d)
    return d


def cfg_for(tmp_path, data_dir, steps: int, plan: str = "row_wise", replan: bool = False) -> RunConfig:
    cfg = config(tmp_path, data_dir, plan=plan)
    cfg.train.max_steps = steps
    cfg.train.checkpoint_every = 1
    cfg.train.eval_every = 2
    cfg.dist.replan = replan
    return cfg


def _rank(rank, world, cfg_dict, run_dir, resume_from):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False, resume_from=resume_from)
    return True


def train_on(world: int, cfg: RunConfig, run_dir: Path, resume_from: Path | None = None) -> None:
    """Train (or resume) ``run_dir`` on ``world`` ranks (one: the single-process workflow)."""
    if world == 1:
        if resume_from is not None:  # a fresh run seeded with the checkpoint: it is the run's latest
            shutil.copytree(resume_from, step_dir(run_dir, read_manifest(resume_from)["step"]))
        workflow.train(cfg, run_dir, resume=True, progress=False)
    else:
        spawn_local(_rank, world, to_dict(cfg), str(run_dir), str(resume_from) if resume_from else None,
                    timeout_s=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """Single-process training of all K + M steps in one go: losses, stacked tables, dense state."""
    tmp = tmp_path_factory.mktemp("resume-ref")
    workflow.train(cfg_for(tmp, data_dir, K + M), tmp / "ref", resume=False, progress=False)
    return checkpoint_state(tmp / "ref")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, data_dir):
    """``first_run(a)``: a run directory that trained K steps on world ``a``, trained once per world for the
    module; every test resumes its own copy."""
    runs: dict[int, Path] = {}

    def get(a: int, dest: Path) -> Path:
        if a not in runs:
            tmp = tmp_path_factory.mktemp(f"resume-first-{a}")
            train_on(a, cfg_for(tmp, data_dir, K), tmp / "run")
            runs[a] = tmp / "run"
        shutil.copytree(runs[a], dest, symlinks=True)  # as cp -a: checkpoints/best stays a link
        return dest

    return get


def worlds_of(run_dir: Path) -> dict[int, int]:
    return {read_manifest(p)["step"]: read_manifest(p)["world_size"] for p in (run_dir / "checkpoints").iterdir()}


@pytest.mark.parametrize("a,b", [(2, 3), (2, 1), (1, 2)])
def test_resume_on_another_world_size(tmp_path, data_dir, reference, first_run, a, b):
    run = first_run(a, tmp_path / "run")
    ck = latest_checkpoint(run)
    assert read_manifest(ck)["step"] == K and read_manifest(ck)["world_size"] == a
    first_losses = checkpoint_state(run)[0]
    assert len(first_losses) == K

    # (a) the run directory resumed on world b
    train_on(b, cfg_for(tmp_path, data_dir, K + M), run)
    losses_a, w_a, dense_a = checkpoint_state(run)
    assert worlds_of(run) == {s: (a if s <= K else b) for s in range(1, K + M + 1)}  # continued from step K
    assert losses_a[:K] == first_losses and len(losses_a) == K + M
    if b > 1:
        rec = read_json(run / "run-plan.json")
        assert rec["world_size"] == b and rec["plan"] == "row_wise"

    # (b) the same checkpoint restored in a fresh run on world b
    fresh = tmp_path / "fresh"
    train_on(b, cfg_for(tmp_path, data_dir, K + M), fresh, resume_from=ck)
    losses_b, w_b, dense_b = checkpoint_state(fresh)
    np.testing.assert_allclose(losses_a, losses_b, rtol=0, atol=1e-5)
    torch.testing.assert_close(w_a, w_b, rtol=0, atol=1e-5)
    for k, v in dense_b.items():
        torch.testing.assert_close(dense_a[k], v, rtol=0, atol=1e-5, msg=lambda msg: f"{k}: {msg}")

    # and both the uninterrupted single-process run (independent reference)
    ref_losses, ref_w, ref_dense = reference
    np.testing.assert_allclose(losses_a, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w_a, ref_w, rtol=0, atol=1e-5)
    for k, v in ref_dense.items():
        torch.testing.assert_close(dense_a[k], v, rtol=0, atol=1e-5, msg=lambda msg: f"{k}: {msg}")

    # metrics.csv of the resumed run: every step once (log_every 1), evaluations at steps 2, 4, 6 and the first
    # attempt's final one at step 3
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, K + M + 1))
    assert [int(r["step"]) for r in rows if r["eval_auc"]] == [2, 3, 4, 6]
    np.testing.assert_allclose([float(r["train_loss"]) for r in rows], losses_a, rtol=0, atol=1e-6)
    assert (run / "curves.png").stat().st_size > 0


def test_another_plan_is_an_error_unless_replanned(tmp_path, data_dir):
    run = tmp_path / "run"
    train_on(2, cfg_for(tmp_path, data_dir, 1, plan="oper"), run)
    assert read_json(run / "run-plan.json")["plan"] == "oper"
    config_before = (run / "config.yaml").read_text()
    with pytest.raises(RankFailed, match=r"planned with dist.plan 'oper' on 2 ranks.*asks for dist.plan 'row_wise'"):
        train_on(2, cfg_for(tmp_path, data_dir, 2, plan="row_wise"), run)
    assert (run / "config.yaml").read_text() == config_before  # a failed command leaves the config alone
    assert worlds_of(run) == {1: 2}
    train_on(2, cfg_for(tmp_path, data_dir, 2, plan="row_wise", replan=True), run)
    assert read_json(run / "run-plan.json")["plan"] == "row_wise"
    assert worlds_of(run) == {1: 2, 2: 2} and len(checkpoint_state(run)[0]) == 2
    assert "plan: row_wise" in (run / "config.yaml").read_text()
    # the CLI flag
    assert resolve_config(None, [], {"cfg__dist__replan": "true"}).dist.replan is True
    # `embedscale evaluate` reads the 2-rank run in one process (its latest checkpoint): the run's own final
    # evaluation; the run directory scores the checkpoint its best evaluation kept (checkpoints/best)
    summary = read_json(run / "summary.json")
    r = CliRunner().invoke(main, ["evaluate", str(latest_checkpoint(run)), "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output.strip().splitlines()[-1])
    assert got["step"] == 2 and got["samples"] == summary["eval_samples"]
    assert abs(got["auc"] - summary["eval_auc"]) < 1e-6 and abs(got["logloss"] - summary["eval_logloss"]) < 1e-5
    r = CliRunner().invoke(main, ["evaluate", str(run), "--json"])
    assert r.exit_code == 0, r.output
    best_step = int((run / "checkpoints" / "best").resolve().name.split("-")[1])
    assert json.loads(r.output.strip().splitlines()[-1])["step"] == best_step


def test_metrics_log_keeps_the_rows_up_to_the_restored_step(tmp_path):
    from embedscale.train.metrics import MetricRow, MetricsLog

    log = MetricsLog(tmp_path)
    for s in range(1, 6):
        log.log(MetricRow(s, 0, 10 * s, train_loss=0.5 + s))
    log.log_eval(5, 0, 50, 0.4, 0.7, 1.0)
    log.write()
    again = MetricsLog(tmp_path)
    again.restart(3)
    assert [r.step for r in again.rows] == [1, 2, 3] and again.rows[2].train_loss == 3.5
    again.restart(0)
    assert again.rows == []
    full = MetricsLog(tmp_path)
    full.restart(5)
    assert full.rows[-1].eval_auc == 0.7 and full.rows[-1].train_loss == 5.5
