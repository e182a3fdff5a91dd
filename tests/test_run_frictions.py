"""What a new user trips on when running: ``evaluate RUN`` scores the best checkpoint, ``drift`` on a plan's own
profile recommends nothing, the progressive line says when its samples were trained on before, and config errors
(``--nproc 0``, ``train.batch_size: -5``, ``train: [1, 2]``, ``dist.plan auto`` without its budget) are named at
load, with their key path and file, before any data is read or any rank starts.

Each is checked against an independent reference: a brute-force AUC of the chosen checkpoint's predictions, a
hand-made shift of a profile's hot rows, the epochs a window of known size must hold, the key path a hand-written
file puts the error at.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from eval_reference import eval_logits, pair_count_auc  # noqa: E402
from test_distributed_train import config, make_data  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.cli import main  # noqa: E402
from embedscale.train.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint, write_best  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def cli_process(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """``python -m embedscale ARGS`` in a process of its own (what the shell sees: exit code, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "embedscale", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


def cli(*args):
    """``embedscale ARGS`` in this process (click's runner: exit code, stdout and stderr as the shell sees them)."""
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="embedscale")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_data(d)
    return d


# -- evaluate RUN: the best evaluation's checkpoint ------------------------------------------------------------
def _brute_force_auc(cfg, checkpoint) -> float:
    """The eval split's AUC of ``checkpoint``'s model, by counting every (positive, negative) pair (ties 1/2)."""
    return pair_count_auc(*eval_logits(cfg, checkpoint))


def test_evaluate_a_run_scores_its_best_checkpoint_not_its_latest(tmp_path, data_dir):
    """A run with checkpoints at steps 2 and 6 whose best evaluation is step 2's: ``evaluate RUN`` scores step 2
    (AUC of its predictions counted here pair by pair), says so, and differs from the latest's AUC; ``infer RUN``
    serves the same checkpoint."""
    cfg = config(tmp_path, data_dir)
    cfg.train.max_steps, cfg.train.checkpoint_every, cfg.train.eval_every = 6, 2, 0
    rd = tmp_path / "run"
    workflow.train(cfg, rd, resume=False, progress=False)
    latest = latest_checkpoint(rd)
    best = write_best(rd, 2).resolve()  # the best evaluation was step 2's (as early stopping would leave it)
    assert load_checkpoint(latest)["step"] == 6 and load_checkpoint(best)["step"] == 2
    auc_best, auc_latest = _brute_force_auc(cfg, best), _brute_force_auc(cfg, latest)
    assert abs(auc_best - auc_latest) > 1e-4  # the two are told apart

    r = CliRunner().invoke(main, ["evaluate", str(rd), "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output.strip().splitlines()[-1])
    assert got["step"] == 2 and got["chosen"] == "best" and Path(got["checkpoint"]).resolve() == best
    assert got["auc"] == pytest.approx(auc_best, abs=1e-9)

    r = CliRunner().invoke(main, ["evaluate", str(rd)])  # the text names the checkpoint and why
    assert r.exit_code == 0, r.output
    assert f"{best.name} (the best evaluation's checkpoint)" in r.output and "step 2:" in r.output

    # infer RUN serves the same checkpoint (its AUC over the eval split, counted here, is the best's)
    r = CliRunner().invoke(main, ["infer", str(rd), "--run-dir", str(tmp_path / "infer"), "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output.strip().splitlines()[-1])
    assert Path(got["checkpoint"]).resolve() == best and got["auc"] == pytest.approx(auc_best, abs=1e-6)

    # a checkpoint given by path is scored as given; a run without a best pointer falls back to the latest
    r = CliRunner().invoke(main, ["evaluate", str(latest), "--json"])
    assert json.loads(r.output.strip().splitlines()[-1])["auc"] == pytest.approx(auc_latest, abs=1e-9)
    (rd / "checkpoints" / "best").unlink()
    assert best_checkpoint(rd) is None
    r = CliRunner().invoke(main, ["evaluate", str(rd), "--json"])
    got = json.loads(r.output.strip().splitlines()[-1])
    assert got["step"] == 6 and got["chosen"] == "latest" and got["auc"] == pytest.approx(auc_latest, abs=1e-9)


# -- the progressive line: held out in epoch 1 only -------------------------------------------------------------
@pytest.mark.parametrize("epochs,window,expect", [
    (1, 100, [1, 1]),  # one pass: every sample scored before any training on it
    (2, 100, [2, 2]),  # the last 3 batches (20 + 50 + 50 samples): all in epoch 2, trained on in epoch 1
    (2, 10_000, [1, 2]),  # a window larger than the run: every batch of both epochs
])
def test_progressive_line_says_which_epochs_its_window_holds(tmp_path, data_dir, epochs, window, expect):
    cfg = config(tmp_path, data_dir)
    cfg.train.max_steps, cfg.train.epochs, cfg.train.progressive_window = 0, epochs, window
    cfg.train.early_stopping_patience = 0
    s = workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    assert s["progressive"]["epochs"] == expect
    sizes = ([50] * 6 + [20]) * epochs  # 320 training rows (400, the last 20% eval) in batches of 50
    held = 0
    while sizes and held < window:  # the fewest most recent whole batches holding the window
        held += sizes.pop()
    assert s["progressive"]["samples"] == held
    line = next(x for x in workflow.format_summary(s).splitlines() if x.startswith("progressive"))
    held_out = "each scored before it was trained on"
    if expect[1] == 1:
        assert held_out in line, line
    else:  # samples of epoch 2 were trained on in epoch 1: not held out, and the line must not say they were
        assert held_out not in line and "not" in line and "held out" in line and "epoch" in line, line
        assert (f"epoch {expect[0]}," if expect[0] == expect[1] else f"epochs {expect[0]}-{expect[1]}") in line


# -- config errors at load -------------------------------------------------------------------------------------
def _assert_named_before_data(p: subprocess.CompletedProcess, *needles: str) -> None:
    err = p.stderr
    assert p.returncode == 2, (p.returncode, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert "manifest" not in err and "torchrun" not in err.lower() and not re.search(r"\brank \d", err), err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("text,key", [
    ("train:\n  batch_size: -5\n", "train.batch_size"),
    ("train: [1, 2]\n", "train"),
    ("dist:\n  nproc: 0\n", "dist.nproc"),
])
def test_config_file_errors_name_the_file_and_key_before_any_data_is_read(tmp_path, text, key):
    """A bad value in a YAML file: ``error: FILE: KEY: ...``, exit 2, no traceback, before the data (a path that
    does not exist: reading it would say ``manifest``) is read or a run directory made. A flag given beside the
    file (``--train-lr-dense``) is not blamed for the file's ``train: [1, 2]``."""
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    p = cli_process("train", "--config", f, "--data-source", "shards", "--data-path", tmp_path / "no-such-data",
                    "--train-lr-dense", "0.1", "--no-progress", cwd=tmp_path)
    _assert_named_before_data(p, f"{f}: {key}:")
    assert "lr_dense" not in p.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text,key", [
    ("data:\n  synthetic: 3\n", "data.synthetic"), ("train:\n  epochs: -1\n", "train.epochs"),
    ("train:\n  log_every: -1\n", "train.log_every"), ("data:\n  shard_rows: 0\n", "data.shard_rows"),
    ("model:\n  embedding_dim: 0\n", "model.embedding_dim"), ("dist:\n  topology_hosts: 0\n", "dist.topology_hosts"),
])
def test_more_config_file_errors_name_the_file_and_key(tmp_path, text, key):
    """The same in this process (click's runner): a section given as a scalar, a count below its least value."""
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    r = cli("train", "--config", f, "--data-source", "shards", "--data-path", tmp_path / "no-such-data",
            "--train-lr-dense", "0.1", "--out-dir", tmp_path / "runs", "--no-progress")
    assert r.exit_code == 2 and f"{f}: {key}:" in r.stderr, r.output
    assert isinstance(r.exception, SystemExit) and "manifest" not in r.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("n", ["0", "-1"])
def test_nproc_below_one_is_an_error_naming_the_flag(tmp_path, n):
    """``--nproc 0`` / ``-1`` ran one process; now a usage error naming ``--nproc``, before anything runs."""
    p = cli_process("train", "--nproc", n, "--data-source", "shards", "--data-path", tmp_path / "no-such-data",
                    "--no-progress", cwd=tmp_path)
    _assert_named_before_data(p, "--nproc", n)
    assert not (tmp_path / "runs").exists()
    r = cli("train", "--set", f"dist.nproc={n}", "--data-source", "shards", "--data-path", tmp_path / "no-such-data",
            "--out-dir", tmp_path / "runs", "--no-progress")
    assert r.exit_code == 2 and f"dist.nproc: {n} is not an integer >= 1" in r.stderr, r.output
    assert not (tmp_path / "runs").exists()


def test_dist_plan_auto_without_a_budget_fails_before_any_rank_starts(tmp_path, data_dir):
    """``train --nproc 2 --dist-plan auto`` without ``dist.device_memory``: one named error, exit 2, no torchrun
    output (no rank started), no run directory made."""
    p = cli_process("train", "--nproc", "2", "--dist-plan", "auto", "--data-source", "shards", "--data-path", data_dir,
                    "--out-dir", tmp_path / "runs", "--no-progress", cwd=tmp_path)
    _assert_named_before_data(p, "dist.device_memory", "--dist-device-memory")
    assert p.stderr.count("error:") == 1 and "Root Cause" not in p.stderr
    assert not (tmp_path / "runs").exists()


# -- drift: a plan on its own profile recommends nothing ---------------------------------------------------------
def _zipf_counts(rows: int, samples: int, seed: int) -> np.ndarray:
    """Per-row counts of ``samples`` lookups drawn from a power law over ``rows`` rows (row 0 the hottest)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, rows + 1) ** 1.2
    return np.bincount(rng.choice(rows, size=samples, p=p / p.sum()), minlength=rows).astype(np.int64)


@pytest.mark.parametrize("traffic", ["distinct", "access"])
def test_drift_on_the_plans_own_profile_recommends_nothing(tmp_path, traffic):
    """``embedscale drift PLAN --profile P`` with P the profile the plan was made from: no re-plan, a gain of 0,
    no row to move, whichever traffic model the plan was made with. The same plan on a profile whose hot rows
    were moved by hand (every table's counts rolled by half its rows) is recommended a re-plan."""
    from embedscale.data.profile import AccessProfile

    samples = 20_000
    rows = {"C1": 3000, "C2": 800, "C3": 60}
    own = {f: _zipf_counts(n, samples, i) for i, (f, n) in enumerate(rows.items())}
    AccessProfile(own, samples).save(tmp_path / "own")
    AccessProfile({f: np.roll(c, rows[f] // 2) for f, c in own.items()}, samples).save(tmp_path / "shifted")
    p = cli("plan", "--profile", tmp_path / "own", "--traffic", traffic, "--batch-size", "512",
            "--ranks-per-host", "4", "--strategy", "oper", "--strategy", "table_wise", "--out", tmp_path / "plans")
    assert p.exit_code == 0, p.output[-3000:]
    report = json.loads((tmp_path / "plans" / "report.json").read_text())["strategies"]["oper"]

    def drift(profile, strategy="oper", *more) -> dict:
        r = cli("drift", tmp_path / "plans" / strategy, "--profile", profile, "--ranks-per-host", "4", "--json",
                *more)
        assert r.exit_code == 0, r.output[-3000:]
        return json.loads(r.stdout.strip().splitlines()[0])

    same = drift(tmp_path / "own")
    assert same["replan"] is False, same["reason"]
    assert abs(same["replan_gain"]) < 0.01 and same["rows_moved"] == 0
    # the plan's cost on its own profile is the one its report gave (the same traffic model)
    assert same["after"]["max_rank_cost"] == pytest.approx(report["max_rank_cost"], rel=1e-6)
    shifted = drift(tmp_path / "shifted")
    assert shifted["replan"] is True, shifted["reason"]
    # the hot rows now sit elsewhere: the ranks' lookups are out of balance and a fresh plan restores it
    assert shifted["after"]["dob_lookup"] < 0.9 < same["after"]["dob_lookup"]
    assert shifted["replanned"]["dob_lookup"] > 0.9 and shifted["rows_moved"] > 0
    assert shifted["replanned"]["max_rank_cost"] <= shifted["after"]["max_rank_cost"]

    # 3 tables on 4 ranks, whole: one rank holds none, so the lookup balance is 0 on the plan's own profile. That
    # is how the plan was made, not drift: nothing to recommend (a fresh table-wise plan is the same plan)
    r = cli("drift", tmp_path / "plans" / "table_wise", "--profile", tmp_path / "own", "--ranks-per-host", "4")
    assert r.exit_code == 2 and "--old-profile" in r.stderr, r.output[-2000:]
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # a named error, no traceback
    whole = drift(tmp_path / "own", "table_wise", "--old-profile", tmp_path / "own")
    assert whole["after"]["dob_lookup"] == 0.0 and whole["replan"] is False and whole["rows_moved"] == 0, whole


# -- threads on a shared machine -------------------------------------------------------------------------------
def test_thread_count_and_wait_policy_follow_the_rule():
    """Each of N local ranks on C available cores gets max(1, C // N) intra-op threads (counted here by hand),
    the OpenMP wait policy is passive; what the user set (OMP_NUM_THREADS, OMP_WAIT_POLICY, EMBEDSCALE_THREADS)
    wins; a bad EMBEDSCALE_THREADS is a named error."""
    from embedscale.errors import ConfigError
    from embedscale.threads import chosen_threads, rank_env, set_wait_policy

    for cores in range(1, 9):
        for ranks in range(1, 5):
            share = [n for n in range(cores, 0, -1) if n * ranks <= cores]  # the largest equal share, else 1
            expect = share[0] if share else 1
            assert chosen_threads({"LOCAL_WORLD_SIZE": str(ranks)}, cores=cores) == expect, (cores, ranks)
    assert chosen_threads({}, cores=2) == 2 and chosen_threads({"LOCAL_WORLD_SIZE": "2"}, cores=2) == 1
    assert chosen_threads({"OMP_NUM_THREADS": "3"}, cores=8) is None  # torch read the user's count already
    assert chosen_threads({"EMBEDSCALE_THREADS": "5", "OMP_NUM_THREADS": "3"}, cores=8) == 5
    assert chosen_threads({"EMBEDSCALE_THREADS": "torch"}, cores=8) is None
    assert rank_env(2, {}) == {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // 2))}
    assert rank_env(2, {"OMP_NUM_THREADS": "4"}) == {} and rank_env(2, {"EMBEDSCALE_THREADS": "torch"}) == {}
    env: dict = {}
    set_wait_policy(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    set_wait_policy(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"
    env = {"EMBEDSCALE_THREADS": "torch"}
    set_wait_policy(env)
    assert "OMP_WAIT_POLICY" not in env
    with pytest.raises(ConfigError, match="EMBEDSCALE_THREADS='many'"):
        chosen_threads({"EMBEDSCALE_THREADS": "many"})


def test_the_cli_sets_the_passive_wait_policy_before_torch_is_imported(tmp_path):
    """The OpenMP runtime reads OMP_WAIT_POLICY when torch loads it: the command sets it first."""
    probe = ("import os, sys\nfrom click.testing import CliRunner\nfrom embedscale.cli import main\n"
             "os.environ.pop('OMP_WAIT_POLICY', None)\n"
             f"r = CliRunner().invoke(main, ['topology', '--out', {str(tmp_path / 't.json')!r}])\n"
             "print(r.exit_code, os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "EMBEDSCALE_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert p.stdout.split() == ["0", "PASSIVE", "False"], (p.stdout, p.stderr[-2000:])


def test_towers_reads_a_runs_best_checkpoint_else_its_latest(tmp_path):
    """``towers RUN`` learns from the checkpoint ``evaluate RUN`` scores: ``checkpoints/best`` when there is one."""
    from embedscale.towers.command import _find_checkpoint

    for step in (2, 6):
        d = tmp_path / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
    assert _find_checkpoint(tmp_path)[1].name == "step-00000006"  # no best: the latest
    write_best(tmp_path, 2)
    assert _find_checkpoint(tmp_path) == (tmp_path, tmp_path / "checkpoints" / "step-00000002")
