"""A single-process run with ``train.checkpoint_dir`` on an fsspec URI (``memory://``: an object store in this
process, no rename, no links): it checkpoints there, keeps ``checkpoints/best`` as an object naming the step,
and a second run resumes from there; losses, rows and the best step equal the same runs with checkpoints in the
run directory (the reference), and nothing of the checkpoints lands in the run directory."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import checkpoint_state, config, make_data  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.storage import ObjectPath, location  # noqa: E402
from embedscale.train.checkpoint import best_checkpoint, latest_checkpoint, read_manifest, step_dir  # noqa: E402


def _cfg(tmp_path, steps: int, home: str):
    cfg = config(tmp_path, tmp_path / "data")
    cfg.train.max_steps, cfg.train.checkpoint_every, cfg.train.eval_every = steps, 2, 2
    cfg.train.checkpoint_dir = home
    return cfg


def test_a_run_checkpoints_to_a_uri_and_resumes_from_it(tmp_path):
    make_data(tmp_path / "data")
    home = "memory://ckpt-uri-test/run"
    ids = []
    for steps in (2, 4):  # 2 steps, then the same run directory resumed for 2 more
        workflow.train(_cfg(tmp_path, steps, home), tmp_path / "remote", resume=True, progress=False)
        workflow.train(_cfg(tmp_path, steps, ""), tmp_path / "local", resume=True, progress=False)
        ids.append(read_manifest(step_dir(home, 2))["id"])
    assert ids[0] == ids[1]  # the second run resumed from step 2 (a fresh start would have written it again)
    assert not (tmp_path / "remote" / "checkpoints").exists()
    ck = latest_checkpoint(home)
    assert isinstance(ck, ObjectPath) and read_manifest(ck)["step"] == 4
    assert [p.name for p in (location(home) / "checkpoints").iterdir()] == \
        sorted(p.name for p in (tmp_path / "local" / "checkpoints").iterdir())  # best, step-2, step-4
    assert best_checkpoint(home).name == best_checkpoint(tmp_path / "local").name
    losses, w, dense = checkpoint_state(home)
    ref_losses, ref_w, ref_dense = checkpoint_state(tmp_path / "local")
    assert len(losses) == 4 and losses == ref_losses  # resumed at step 2: the same losses bit for bit
    assert torch.equal(w, ref_w) and all(torch.equal(dense[k], ref_dense[k]) for k in ref_dense)
