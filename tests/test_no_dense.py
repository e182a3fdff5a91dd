"""A click log without dense features (most libFM data): DLRM and DCN train and evaluate on it, in one process
and through ``embedscale train`` / ``embedscale evaluate``, and the trained model's eval logloss equals that of a
model written out by hand (float64, Python loops) from the checkpoint's weights."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from embedscale import workflow
from embedscale.data.shards import ShardWriter, SparseFeatureInfo, iter_shards
from embedscale.specs import RunConfig, from_dict
from embedscale.train.checkpoint import load_checkpoint

ROWS = [13, 7, 21]
N = 300


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nodense")
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, r, N) for r in ROWS]
    logit = 1.5 * (ids[0] % 2 == 0) - 1.0 * (ids[1] < 3) + 0.8 * ((ids[0] + ids[2]) % 3 == 0) - 0.5
    labels = (rng.random(N) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    sp = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(ROWS)]
    with ShardWriter(d, [], sp, shard_rows=100) as w:
        w.write(labels, np.zeros((N, 0), np.float32), {f"C{i + 1}": ids[i] for i in range(len(ROWS))})
    return d


def config(tmp_path, data_dir, arch) -> RunConfig:
    return from_dict(RunConfig, {
        "name": "nd", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"arch": arch, "embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], "cross_layers": 2},
        "train": {"batch_size": 40, "max_steps": 12, "lr_dense": 0.05, "lr_sparse": 0.2, "dropout": 0.0,
                  "prefetch": 0, "eval_every": 0, "calibrate": False},  # the raw logit (the CLI test: calibrated)
    })


def eval_rows(data_dir):
    """Labels and ids of the eval split (the last 20% of the rows)."""
    labels, ids = [], []
    for c in iter_shards(data_dir):
        labels.append(c.labels)
        ids.append(np.stack([c.sparse[f"C{i + 1}"][0] for i in range(len(ROWS))], 1))
    y, x = np.concatenate(labels), np.concatenate(ids)
    cut = N - int(round(N * 0.2))
    return y[cut:], x[cut:]


def mlp_by_hand(dense: dict, prefix: str, x: list[float]) -> float:
    """The top MLP (Linear + ReLU ..., then the logit layer) in Python floats."""
    layers = sorted({int(k.split(".")[2]) for k in dense if k.startswith(prefix) and k.endswith("weight")})
    for n, i in enumerate(layers):
        w = dense[f"{prefix}{i}.weight"].double().tolist()
        b = dense[f"{prefix}{i}.bias"].double().tolist()
        x = [sum(wj * xj for wj, xj in zip(row, x)) + bj for row, bj in zip(w, b)]
        if n < len(layers) - 1:
            x = [max(v, 0.0) for v in x]
    return x[0]


def logit_by_hand(ck: dict, arch: str, sample: np.ndarray) -> float:
    dense = ck["dense"]
    e = [ck["tables"][f"t_C{f + 1}"]["weight"][int(sample[f])].double().tolist() for f in range(len(ROWS))]
    if arch == "dlrm":  # the embeddings' pairwise dots, no dense vector
        x = [sum(a * b for a, b in zip(e[i], e[j])) for i in range(len(e)) for j in range(i + 1, len(e))]
    else:  # DCN: x0 = the embeddings alone, full-rank cross layers
        x0 = [v for vec in e for v in vec]
        x = list(x0)
        layers = sorted({int(k.split(".")[2]) for k in dense if k.startswith("cross_net.W.")})
        for k in layers:
            W = dense[f"cross_net.W.{k}"].double().tolist()
            b = dense[f"cross_net.b.{k}"].double().tolist()
            h = [sum(wj * xj for wj, xj in zip(row, x)) + bk for row, bk in zip(W, b)]
            x = [x0[i] * h[i] + x[i] for i in range(len(x))]
    u = dense["first_order.sparse"].double().tolist()
    wide = sum(ui * vi for ui, vi in zip(u, [v for vec in e for v in vec]))
    return mlp_by_hand(dense, "over_arch.model.", x) + wide


def logloss_by_hand(ck, arch, y, x, calibrated: bool = False) -> float:
    """``calibrated``: the logit's calibration map ``a z + b + d ln(1 + e^-z)`` of the checkpoint
    (``calibration.scale_shift``, ``calibration.tail``) applied, as the model predicts at inference."""
    a, b = ck["dense"]["calibration.scale_shift"].double().tolist() if calibrated else (1.0, 0.0)
    d = float(ck["dense"]["calibration.tail"].double()[0]) if calibrated else 0.0
    total = 0.0
    for label, sample in zip(y, x):
        z = logit_by_hand(ck, arch, sample)
        p = 1.0 / (1.0 + math.exp(-(a * z + b + d * math.log1p(math.exp(-z)))))
        total -= math.log(p) if label else math.log(1.0 - p)
    return total / len(y)


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_a_log_without_dense_features_trains_and_matches_a_hand_built_model(tmp_path, data_dir, arch):
    cfg = config(tmp_path, data_dir, arch)
    rd = tmp_path / arch
    s = workflow.train(cfg, rd, resume=False, progress=False)
    assert s["steps"] == 12 and math.isfinite(s["eval_logloss"])
    ck = load_checkpoint(rd)
    assert "dense_arch.model.0.weight" not in ck["dense"]  # no bottom MLP without dense features
    assert float(ck["dense"]["first_order.sparse"].abs().sum()) > 0
    y, x = eval_rows(data_dir)
    assert s["eval_logloss"] == pytest.approx(logloss_by_hand(ck, arch, y, x), abs=1e-5)
    losses = ck["losses"]
    assert np.mean(losses[-4:]) < np.mean(losses[:4])  # it learns


def test_cli_trains_and_evaluates_a_log_without_dense_features(tmp_path, data_dir):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    rd = tmp_path / "cli"
    cmd = [sys.executable, "-m", "embedscale", "train", "--data-source", "shards", "--data-path", str(data_dir),
           "--train-max-steps", "6", "--train-batch-size", "40", "--model-embedding-dim", "4",
           "--data-eval-fraction", "0.2",
           "--run-dir", str(rd), "--no-progress", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6 and math.isfinite(summary["eval_auc"])
    r = subprocess.run([sys.executable, "-m", "embedscale", "evaluate", str(rd), "--json"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ck = load_checkpoint(rd)
    y, x = eval_rows(data_dir)
    logloss = next(v for k, v in _flat(out) if k.endswith("logloss"))
    assert logloss == pytest.approx(logloss_by_hand(ck, "dlrm", y, x, calibrated=True), abs=1e-5)


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
