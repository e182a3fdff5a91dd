"""Sample weights (a schema's ``weight`` column) reach the training loss and every evaluation figure.

References: the float64 definition of the weighted binary cross-entropy; brute-force weighted pair counting
for AUC and float64 sums for logloss and calibration, on logits we know; a single-process run of the same
weighted data for 2 gloo ranks (losses, tables and evaluation within 1e-5). A run whose weights are all 0 learns
nothing (every loss exactly 0, tables as initialised), which a loss that ignores the weights cannot do.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from embedscale import workflow
from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.data.loader import ShardLoader
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.loss import batch_loss_sum, bce_sum
from embedscale.train.trainer import evaluate

from test_distributed_train import ROWS, config, distributed, hand_plan, make_data  # noqa: F401

N = 400


def weighted_copy(src, dst, weights: np.ndarray) -> None:
    """``src`` (test_distributed_train's data) rewritten with a ``weight`` column."""
    rows = ShardLoader(src, N, validate=False)
    b = next(iter(rows))
    sp = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(ROWS)]
    vals = b.sparse.values.numpy().reshape(len(ROWS), -1)  # one-hot features, key-major (KJT layout)
    ids = {f"C{i + 1}": vals[i] for i in range(len(ROWS))}
    with ShardWriter(dst, ["I1", "I2", "I3"], sp, shard_rows=150, weighted=True) as w:
        w.write(b.labels.numpy().astype(np.int8), b.dense.numpy(), ids, weights=weights)


def bce64(z, y, w):
    z, y, w = (np.asarray(a, dtype=np.float64) for a in (z, y, w))
    p = 1 / (1 + np.exp(-z))
    return float(np.sum(w * -(y * np.log(p) + (1 - y) * np.log1p(-p))))


def test_bce_sum_is_the_weighted_float64_sum():
    rng = np.random.default_rng(3)
    z, y = rng.normal(size=64) * 2, (rng.random(64) < 0.3).astype(np.float32)
    w = rng.choice([0.0, 0.5, 1.0, 4.0], size=64).astype(np.float32)
    got = float(bce_sum(torch.tensor(z, dtype=torch.float32), torch.tensor(y), torch.tensor(w)))
    assert got == pytest.approx(bce64(z, y, w), rel=1e-5)
    assert float(bce_sum(torch.tensor(z, dtype=torch.float32), torch.tensor(y))) == pytest.approx(
        bce64(z, y, np.ones(64)), rel=1e-5)
    batch = Batch(torch.zeros(64, 0), JaggedFeatures(["f"], torch.zeros(64, dtype=torch.int64),
                                                     torch.ones(64, dtype=torch.int64)),
                  torch.tensor(y), weights=torch.tensor(w))
    assert float(batch_loss_sum(torch.tensor(z, dtype=torch.float32), batch)) == pytest.approx(got, rel=1e-6)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    make_data(root / "plain")
    rng = np.random.default_rng(7)
    w = rng.choice([0.0, 0.5, 1.0, 3.0], size=N).astype(np.float32)
    weighted_copy(root / "plain", root / "weighted", w)
    weighted_copy(root / "plain", root / "zero", np.zeros(N, np.float32))
    return root, w


def brute_auc(y, z, w):
    """Weighted AUC by counting every (positive, negative) pair, ties 1/2, in float64."""
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    num = den = 0.0
    for i in pos:
        d = z[i] - z[neg]
        num += float(np.sum(w[i] * w[neg] * ((d > 0) + 0.5 * (d == 0))))
        den += float(np.sum(w[i] * w[neg]))
    return num / den


def test_evaluate_weights_every_figure(data):
    root, w = data
    loader = ShardLoader(root / "weighted", 64)
    b = next(iter(ShardLoader(root / "weighted", N)))
    y = b.labels.double().numpy()
    np.testing.assert_array_equal(b.weights.numpy(), w)
    model = nn.Module()  # logits we know: the first dense column, rounded (ties on purpose)
    model.forward = lambda dense, sparse: torch.round((dense[:, 0] * 1.5 - 0.2) * 1000) / 1000
    z = model.forward(b.dense, None).double().numpy()
    assert len(np.unique(z)) < len(z)
    got = evaluate(model, loader)
    assert got["auc"] == pytest.approx(brute_auc(y, z, w), abs=1e-9)
    assert got["logloss"] == pytest.approx(bce64(z, y, w) / w.sum(), rel=1e-6)
    p = 1 / (1 + np.exp(-z))
    assert got["calibration"] == pytest.approx(np.sum(w * p) / np.sum(w * y), rel=1e-6)
    plain = evaluate(model, ShardLoader(root / "plain", 64))
    assert abs(plain["auc"] - got["auc"]) > 1e-4  # the weights changed the figure (else this test proves nothing)


def _cfg(tmp_path, data_dir, **train):
    cfg = config(tmp_path, data_dir)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_all_zero_weights_learn_nothing(tmp_path, data):
    root, _ = data
    cfg = _cfg(tmp_path, root / "zero", max_steps=3)
    cfg.data.eval_fraction = 0.0
    workflow.train(cfg, tmp_path / "three", resume=False, progress=False)
    cfg.train.max_steps = 1
    workflow.train(cfg, tmp_path / "one", resume=False, progress=False)
    three, one = load_checkpoint(tmp_path / "three"), load_checkpoint(tmp_path / "one")
    assert three["losses"] == [0.0, 0.0, 0.0]
    for t in three["tables"]:
        torch.testing.assert_close(three["tables"][t]["weight"], one["tables"][t]["weight"], rtol=0, atol=0)
    for k, v in three["dense"].items():
        torch.testing.assert_close(v, one["dense"][k], rtol=0, atol=0)


def test_two_ranks_weighted_equal_one_process(tmp_path, data):
    root, _ = data
    cfg = _cfg(tmp_path, root / "weighted")
    workflow.train(cfg, tmp_path / "single", resume=False, progress=False)
    ref = load_checkpoint(tmp_path / "single")
    plain = _cfg(tmp_path, root / "plain")
    workflow.train(plain, tmp_path / "plain", resume=False, progress=False)
    assert abs(load_checkpoint(tmp_path / "plain")["losses"][0] - ref["losses"][0]) > 1e-3  # weights were used

    plan_dir = tmp_path / "plan"
    hand_plan("replicas", 2).save(plan_dir)
    cfg2 = _cfg(tmp_path, root / "weighted")
    cfg2.dist.plan = str(plan_dir)
    distributed(cfg2, tmp_path / "dist", 2)
    got = load_checkpoint(tmp_path / "dist")
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0, atol=1e-5)
    for t in ref["tables"]:
        torch.testing.assert_close(got["tables"][t]["weight"], ref["tables"][t]["weight"], rtol=0, atol=1e-5)
    one = json.loads((tmp_path / "single" / "summary.json").read_text())
    two = json.loads((tmp_path / "dist" / "summary.json").read_text())
    for k in ("eval_auc", "eval_logloss", "eval_calibration"):
        assert two[k] == pytest.approx(one[k], abs=1e-5), k
