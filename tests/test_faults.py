"""Faults on 2 local ranks under torchrun (`embedscale train --nproc 2`): a killed or hung rank ends the run
with an error naming the rank inside the timeout; with --max-restarts the run resumes from its last
checkpoint and ends exactly where an uninterrupted run does.

Only the hang test is about the timeout: it runs with ``dist.timeout_s`` = HANG_TIMEOUT_S (long enough for a
healthy rank's every collective on a machine whose cores are busy, short enough to wait for). The other runs
get a generous timeout (a killed rank is found by its exit, not by a timeout), so load cannot fail them.
Nothing here asserts a wall-clock time: a run that does not end fails by the subprocess timeout."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import hand_plan, make_data  # noqa: E402

HANG_TIMEOUT_S = 20
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    make_data(d / "data")
    hand_plan("replicas", 2).save(d / "plan")
    return d


def run(setup, run_dir, fault=None, restarts=0, timeout_s=TIMEOUT_S):
    args = [sys.executable, "-m", "embedscale", "train", "--nproc", "2", "--run-dir", str(run_dir),
            "--max-restarts", str(restarts), "--no-progress",
            "--data-source", "shards", "--data-path", str(setup / "data"), "--model-embedding-dim", "4",
            "--model-bottom-mlp", "8", "--model-top-mlp", "8", "--train-batch-size", "50", "--train-max-steps", "6",
            "--train-checkpoint-every", "2", "--train-log-every", "1", "--train-eval-every", "3", "--dist-plan", str(setup / "plan"), "--dist-timeout-s", str(timeout_s),
            "--out-dir", str(setup / "runs")]
    env = dict(os.environ)
    if fault:
        env.update({"EMBEDSCALE_FAULT": fault, "EMBEDSCALE_FAULT_STEP": "3", "EMBEDSCALE_FAULT_RANK": "1"})
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)


def losses(run_dir):
    ck = sorted((run_dir / "checkpoints").iterdir())[-1]
    return torch.load(ck / "rank-00000.pt", weights_only=True)["losses"]


def metric_rows(run_dir):
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_killed_rank_is_named(setup, tmp_path):
    p = run(setup, tmp_path / "r", fault="kill")
    assert p.returncode != 0
    assert "rank      : 1 (local_rank: 1)" in p.stderr and "exitcode  : -9" in p.stderr
    assert "Root Cause" in p.stderr


def test_hung_rank_is_named_within_timeout(setup, tmp_path):
    p = run(setup, tmp_path / "r", fault="hang", timeout_s=HANG_TIMEOUT_S)
    assert p.returncode != 0
    assert f"timeout dist.timeout_s = {HANG_TIMEOUT_S} s" in p.stderr
    assert "Ranks 1 failed to pass monitoredBarrier" in p.stderr


def test_restart_resumes_from_checkpoint_exactly(setup, tmp_path):
    ok = run(setup, tmp_path / "clean")
    assert ok.returncode == 0, ok.stderr[-2000:]
    p = run(setup, tmp_path / "faulty", fault="kill", restarts=1)
    assert p.returncode == 0, p.stderr[-2000:]
    # the latest checkpoint before the kill: step 3's (the evaluation at step 3 improved, so a best checkpoint
    # was written there beside the periodic one of step 2)
    assert "resumed from" in p.stderr and "step-00000003" in p.stderr
    assert losses(tmp_path / "faulty") == losses(tmp_path / "clean")
    # metrics.csv across the restart: every logged step exactly once (the first attempt's rows up to the
    # checkpoint it resumed from, then the second attempt's), the same losses and evaluations as the clean run
    clean, faulty = metric_rows(tmp_path / "clean"), metric_rows(tmp_path / "faulty")
    assert [int(r["step"]) for r in faulty] == list(range(1, 7))
    assert [r["train_loss"] for r in faulty] == [r["train_loss"] for r in clean]
    assert [(r["eval_logloss"], r["eval_auc"]) for r in faulty] == [(r["eval_logloss"], r["eval_auc"]) for r in clean]
    assert faulty[2]["eval_auc"] != "" and faulty[5]["eval_auc"] != ""
