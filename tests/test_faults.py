"""Faults on 2 local ranks under torchrun (`embedscale train --nproc 2`): a killed or hung rank ends the run
with an error naming the rank inside the timeout; with --max-restarts the run resumes from its last
checkpoint and ends exactly where an uninterrupted run does.

Only the hang test is about the timeout: it runs with ``dist.timeout_s`` = HANG_TIMEOUT_S (long enough for a
healthy rank's every collective on a machine whose cores are busy, short enough to wait for). The other runs
get a generous timeout (a killed rank is found by its exit, not by a timeout), so load cannot fail them.
Nothing here asserts a wall-clock time: a run that does not end fails by the subprocess timeout."""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import hand_plan, make_data  # noqa: E402
from test_lifecycle import START_TIMEOUT_S, alive, signal_all, tree  # noqa: E402

HANG_TIMEOUT_S = 12
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


# -- a full disk while a checkpoint is written ------------------------------------------------------------------

def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _fill(path: Path) -> None:
    """Write zeros into ``path`` until its file system is full (ENOSPC)."""
    chunk = bytes(1 << 16)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    with open(path, "ab", buffering=0) as f:  # the last partial page too
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0")


def _complete_steps(run_dir: Path) -> list[int]:
    """Steps of the checkpoint directories (``step-N``) that hold a manifest, read from the directory."""
    d = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step-") and (p / "manifest.json").is_file()) \
        if d.is_dir() else []


def _logged_steps(run_dir: Path) -> list[int]:
    try:
        return [int(r["step"]) for r in metric_rows(run_dir)]
    except (OSError, KeyError, ValueError):
        return []


def _train_until_disk_full(setup, rd: Path, disk: Path, log: Path) -> tuple[int, list[int]]:
    """Run ``train --nproc 2`` into ``rd``; once a checkpoint is complete, freeze every process of the run (SIGSTOP)
    between two checkpoints (the last complete one logged in metrics.csv, none being written), fill ``disk``, let
    them go on. Returns the launcher's exit code and the complete steps before the fill; kills only what it
    started."""
    args = [sys.executable, "-m", "embedscale", "train", "--nproc", "2", "--run-dir", str(rd), "--no-progress",
            "--data-source", "shards", "--data-path", str(setup / "data"), "--model-embedding-dim", "4",
            "--model-bottom-mlp", "8", "--model-top-mlp", "8", "--train-batch-size", "50",
            "--train-max-steps", str(10**6), "--train-epochs", "10000", "--train-checkpoint-every", "2",
            "--train-log-every", "1", "--train-eval-every", "0", "--train-early-stopping-patience", "0",
            "--dist-plan", str(setup / "plan"), "--dist-timeout-s", str(TIMEOUT_S), "--out-dir", str(setup / "runs")]
    procs: set[int] = set()
    frozen: set[int] = set()
    with open(log, "w") as f:
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within the start timeout"
            if _complete_steps(rd):
                frozen = {p.pid, *tree(p.pid)}
                procs |= frozen
                signal_all(frozen, signal.SIGSTOP)
                steps = _complete_steps(rd)
                if steps and _logged_steps(rd)[-1:] == [steps[-1]] and \
                        not any(x.name.startswith(".step-") for x in (rd / "checkpoints").iterdir()):
                    break
                signal_all(frozen, signal.SIGCONT)
                frozen = set()
            time.sleep(0.05)
        before = _complete_steps(rd)
        _fill(disk / "filler")
        signal_all(frozen, signal.SIGCONT)
        frozen = set()
        return p.wait(timeout=600), before
    finally:
        signal_all(frozen, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
        signal_all(alive(procs), signal.SIGKILL)
        (disk / "filler").unlink(missing_ok=True)


def test_disk_full_while_checkpointing_is_one_error_and_leaves_no_partial_checkpoint(setup, tmp_path):
    """The run directory on a small tmpfs, filled while the run trains (between two checkpoints): the next
    checkpoint cannot be written. The run ends non-zero with one error naming the checkpoint and "no space left",
    no traceback from any process, and no directory under checkpoints/ but complete ones (each with its
    manifest; no temporary one); `evaluate RUN` then scores the last complete checkpoint."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "32m"):
        pytest.skip("cannot mount a tmpfs here (needs root): the full disk is simulated on one")
    rd = disk / "run"
    log = tmp_path / "stderr.txt"
    try:
        code, before = _train_until_disk_full(setup, rd, disk, log)
        err = log.read_text()
        assert code != 0, err[-3000:]
        assert "Traceback (most recent call last)" not in err, err[-5000:]
        named = [ln for ln in err.splitlines() if "no space left" in ln.lower()]
        assert len(named) == 1, err[-5000:]
        assert named[0].startswith("error: ") and str(rd / "checkpoints" / "step-") in named[0], named[0]
        ck = rd / "checkpoints"
        left = sorted(x.name for x in ck.iterdir() if x.name != "best")
        complete = _complete_steps(rd)
        assert left == [f"step-{s:08d}" for s in complete], left  # no partial or temporary directory
        assert complete[:len(before)] == before and complete, (before, complete)
        if (ck / "best").is_symlink():  # an evaluation at an epoch's end: the pointer names a complete one
            assert (ck / "best" / "manifest.json").is_file()
        ev = subprocess.run([sys.executable, "-m", "embedscale", "evaluate", str(rd), "--json"], capture_output=True,
                            text=True, timeout=600)
        assert ev.returncode == 0, ev.stderr[-3000:]
        scored = Path(json.loads(ev.stdout.strip().splitlines()[-1])["checkpoint"])
        assert scored.parent == ck and scored.name in [f"step-{s:08d}" for s in complete], scored
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=60)


@pytest.mark.parametrize("swap", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_readers_skip_temporary_checkpoints_and_a_rewritten_step_is_replaced_whole(tmp_path, monkeypatch, swap):
    """A temporary checkpoint directory is no checkpoint to any reader, even with a manifest in it (a write
    killed between the manifest and the rename); writing a step again replaces its directory whole (files of
    the old one do not survive) and leaves no temporary directory, with or without an atomic swap."""
    from embedscale.errors import FormatError
    from embedscale.train import checkpoint as C

    if not swap:
        monkeypatch.setattr(C, "_exchange", lambda a, b: False)
    ck = tmp_path / "checkpoints"
    done = ck / "step-00000002"
    done.mkdir(parents=True)
    (done / "manifest.json").write_text('{"old": 1}')
    (done / "rank-00001.pt").write_text("old")
    killed = ck / ".step-00000004.tmp"
    killed.mkdir()
    (killed / "manifest.json").write_text('{"killed": 1}')
    assert C.latest_checkpoint(tmp_path) == done
    with pytest.raises(FormatError):
        C.resolve_checkpoint(killed)
    new = C.begin(done)
    assert not killed.exists() and new.name == ".step-00000002.tmp" and not list(new.iterdir())
    (new / "manifest.json").write_text('{"new": 1}')
    C.publish(new, done)
    assert sorted(x.name for x in ck.iterdir()) == ["step-00000002"]
    assert sorted(x.name for x in done.iterdir()) == ["manifest.json"]
    assert json.loads((done / "manifest.json").read_text()) == {"new": 1}
