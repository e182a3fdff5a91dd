"""``export RUN --follow``: an export kept equal to the latest checkpoint of a run that is still training. The
reference: the run's newest checkpoint loaded into the trained model here (``workflow.build`` +
``load_model_state``), scored on the same rows; an FP32 export must give its logits bit for bit."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import train_tiny  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.data.loader import ShardLoader  # noqa: E402
from embedscale.serve.export import follow_run  # noqa: E402
from embedscale.serve.predict import load_export  # noqa: E402
from embedscale.train.checkpoint import latest_checkpoint  # noqa: E402
from embedscale.train.trainer import load_model_state  # noqa: E402


def _logits(model, cfg) -> np.ndarray:
    data = workflow.prepare_data(cfg, progress=False)
    model.eval()
    with torch.no_grad():
        return np.concatenate([model(b.dense, b.sparse).numpy()
                               for b in ShardLoader(data.train.directory, 256, start=0, stop=data.manifest.rows)])


def test_follow_exports_each_new_checkpoint_of_a_training_run(tmp_path):
    run_dir, cfg = train_tiny(tmp_path)  # checkpoints at steps 6 and 12
    out, logs, made = tmp_path / "live", [], []
    follower = threading.Thread(target=lambda: made.append(
        follow_run(run_dir, out, "fp32", poll_s=0.05, max_exports=2, idle_s=300, log=logs.append)))
    follower.start()
    deadline = time.monotonic() + 120
    while not (out / "export.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads((out / "export.json").read_text())["source"]["step"] == 12  # the latest, not the best
    cfg.train.max_steps = 18  # the run goes on: a new checkpoint at step 18
    workflow.train(cfg, run_dir, resume=True, progress=False)
    follower.join(timeout=300)
    assert not follower.is_alive() and made == [2], logs
    newest = latest_checkpoint(run_dir)
    assert newest.name == "step-00000018"
    m = json.loads((out / "export.json").read_text())
    assert m["source"]["step"] == 18 and Path(m["source"]["checkpoint"]) == newest.resolve()
    data = workflow.prepare_data(cfg, progress=False)
    model, _ = workflow.build(cfg, workflow.tables_for(cfg, data.manifest), data.manifest.num_dense,
                              torch.device("cpu"), validate=False)
    load_model_state(model, newest)
    assert np.array_equal(_logits(load_export(out).model, cfg), _logits(model, cfg))  # bit for bit
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".live.")]  # no temporary export left


def test_follow_stops_when_idle_and_when_asked(tmp_path):
    run_dir, _ = train_tiny(tmp_path)
    t0 = time.monotonic()
    assert follow_run(run_dir, tmp_path / "a", "int8", poll_s=0.05, idle_s=0.5, log=lambda m: None) == 1
    assert time.monotonic() - t0 < 60
    assert follow_run(run_dir, tmp_path / "b", "int8", poll_s=0.05, stop=lambda: True, log=lambda m: None) == 0
