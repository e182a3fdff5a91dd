"""The logit's calibration: Platt scaling and beta calibration (``data.metrics.platt_scaling``,
``data.metrics.beta_calibration``, ``models.dlrm.LogitCalibration``, ``train.calibrate``).

References: the fits against scipy's BFGS on a float64 logloss written here; the map against hand-worked values;
a trained run's best checkpoint against the beta-calibration optimum of its own raw logits, computed here from
scratch."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import config, make_data  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.cli import main  # noqa: E402
from embedscale.data.loader import ShardLoader  # noqa: E402
from embedscale.data.metrics import beta_calibration, binary_metrics, platt_scaling  # noqa: E402
from embedscale.models.dlrm import LogitCalibration  # noqa: E402
from embedscale.train.checkpoint import best_checkpoint  # noqa: E402
from embedscale.train.trainer import load_model_state  # noqa: E402


def reference_beta(y, z, w):
    """argmin over (a, b, d) of the weighted mean float64 logloss of sigmoid(a z + b + d ln(1 + e^-z)) (scipy
    BFGS from Platt's optimum) and the minimum."""
    s = np.log1p(np.exp(-np.abs(z))) + np.maximum(-z, 0)  # ln(1 + e^-z), written apart from the code's

    def loss(v):
        t = v[0] * z + v[1] + v[2] * s
        return float(np.sum(w * (np.log1p(np.exp(-np.abs(t))) + np.maximum(t, 0) - y * t)) / np.sum(w))
    (a, b), _ = reference_platt(y, z, w)
    r = minimize(loss, [a, b, 0.0], method="BFGS", options={"gtol": 1e-10})
    return r.x, r.fun


def reference_platt(y, z, w):
    """argmin over (a, b) of the weighted mean float64 logloss of sigmoid(a z + b) (scipy BFGS) and the minimum."""
    def loss(v):
        t = v[0] * z + v[1]
        return float(np.sum(w * (np.log1p(np.exp(-np.abs(t))) + np.maximum(t, 0) - y * t)) / np.sum(w))
    r = minimize(loss, [1.0, 0.0], method="BFGS", options={"gtol": 1e-10})
    return r.x, r.fun


@pytest.mark.parametrize("seed,scale,shift,weighted", [(0, 0.4, -0.3, False), (1, 2.5, 1.0, True),
                                                       (2, 1.0, 0.0, False)])
def test_platt_scaling_is_the_logloss_minimum(seed, scale, shift, weighted):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=3000) * 3
    y = (rng.random(3000) < 1 / (1 + np.exp(-(scale * z + shift)))).astype(np.float64)
    w = rng.random(3000) * 2 if weighted else np.ones(3000)
    (a_ref, b_ref), best = reference_platt(y, z, w)
    a, b = platt_scaling(y, z, w if weighted else None)
    assert a == pytest.approx(a_ref, abs=1e-4) and b == pytest.approx(b_ref, abs=1e-4)
    m = binary_metrics(y, z, w if weighted else None)
    assert m["platt_logloss"] == pytest.approx(best, rel=1e-8)
    assert m["platt_logloss"] <= m["logloss"] + 1e-12
    # the weighted mean of the calibrated probabilities equals the observed rate (the fit's b equation)
    p = 1 / (1 + np.exp(-(a * z + b)))
    assert m["platt_calibration"] == pytest.approx(np.sum(w * p) / np.sum(w * y), abs=1e-9)
    assert m["platt_calibration"] == pytest.approx(1.0, abs=1e-6)


def test_platt_scaling_leaves_undefined_or_order_reversing_fits_alone():
    z = np.array([-1.0, 0.5, 2.0, 3.0])
    assert platt_scaling(np.zeros(4), z) == (1.0, 0.0)  # one class: no fit
    assert platt_scaling(np.array([]), np.array([])) == (1.0, 0.0)
    assert platt_scaling(np.array([1.0, 1.0, 0.0, 0.0]), z) == (1.0, 0.0)  # a < 0 would reverse the ranking


@pytest.mark.parametrize("seed,high,low,weighted", [(0, 1.5, 0.2, False), (1, 0.5, 0.5, True), (2, 0.3, 2.0, False)])
def test_beta_calibration_is_the_logloss_minimum_of_two_slopes(seed, high, low, weighted):
    """Labels drawn with one slope for high scores and another for low ones (equal: Platt's case)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=4000) * 4
    t = np.where(z > 0, high * z, low * z) - 0.5
    y = (rng.random(4000) < 1 / (1 + np.exp(-t))).astype(np.float64)
    w = rng.random(4000) * 2 if weighted else np.ones(4000)
    (a_ref, b_ref, d_ref), best = reference_beta(y, z, w)
    a, b, d = beta_calibration(y, z, w if weighted else None)
    assert (a, b, d) == pytest.approx((a_ref, b_ref, d_ref), abs=1e-4)
    m = binary_metrics(y, z, w if weighted else None)
    assert m["beta_logloss"] == pytest.approx(best, rel=1e-8)
    assert m["beta_logloss"] <= m["platt_logloss"] + 1e-12  # Platt's map is the d = 0 case
    assert m["beta_calibration"] == pytest.approx(1.0, abs=1e-6)  # the fit's b equation
    if high != low:
        assert m["beta_logloss"] < m["platt_logloss"] - 1e-3


def test_beta_calibration_falls_back_to_platt_when_a_slope_would_not_be_positive():
    z = np.array([-4.0, -3.0, -2.0, -1.0, 0.5, 1.0, 2.0, 3.0])
    y = np.array([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # the lowest score a click: low slope < 0 fits best
    (_, _, d_ref), _ = reference_beta(y, z, np.ones(8))
    a_ref, b_ref = reference_platt(y, z, np.ones(8))[0]
    assert d_ref > 0 and d_ref > reference_beta(y, z, np.ones(8))[0][0]  # the free fit: a - d < 0
    a, b, d = beta_calibration(y, z)
    assert d == 0.0 and (a, b) == pytest.approx((a_ref, b_ref), abs=1e-4)
    assert beta_calibration(np.zeros(4), z[:4]) == (1.0, 0.0, 0.0)  # one class: no fit


def test_logit_calibration_beta_map_by_hand():
    cal = LogitCalibration().eval()
    cal.set(2.0, 1.0, 1.5)  # z -> 2 z + 1 + 1.5 ln(1 + e^-z)
    z = torch.tensor([0.0, 2.0, -3.0, float("-inf")])
    want = [1.0 + 1.5 * math.log(2.0), 5.0 + 1.5 * math.log1p(math.exp(-2.0)), -5.0 + 1.5 * math.log1p(math.exp(3.0)),
            float("-inf")]
    assert cal(z[:3]).tolist() == pytest.approx(want[:3], rel=1e-6)
    cal.compose(0.5, -1.0)  # then -> 0.5 (.) - 1: a, b and d scale
    assert cal.scale_shift.tolist() == [1.0, -0.5] and cal.tail.tolist() == [0.75]
    assert cal(z[:3]).tolist() == pytest.approx([0.5 * v - 1.0 for v in want[:3]], rel=1e-6)
    cal.set(2.0, 1.0, 0.0)  # no tail: Platt's map, -inf stays -inf (no 0 * inf)
    assert cal(z).tolist() == [1.0, 5.0, -5.0, float("-inf")]


def test_logit_calibration_composes_and_is_the_identity_while_training():
    cal = LogitCalibration()
    z = torch.tensor([2.0, -1.0, 0.0])
    cal.compose(0.5, 1.0)   # z -> 0.5 z + 1
    cal.compose(2.0, -3.0)  # then -> 2 (0.5 z + 1) - 3 = z - 1
    assert cal.scale_shift.tolist() == [1.0, -1.0]
    assert cal(z).tolist() == z.tolist()  # a new module trains: identity
    assert cal.eval()(z).tolist() == [1.0, -2.0, -1.0]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_data(d, n=600)
    return d


def _logits(model, split):
    loader = ShardLoader(split.directory, 1000, start=split.start, stop=split.stop)
    model.eval()
    with torch.no_grad():
        out = [(model(b.dense, b.sparse).double().numpy(), b.labels.double().numpy()) for b in loader]
    return np.concatenate([z for z, _ in out]), np.concatenate([y for _, y in out])


def test_the_best_checkpoint_predicts_the_beta_optimum_of_its_raw_logits(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    cfg.train.epochs, cfg.train.eval_every, cfg.train.max_steps = 4, 3, 0
    cfg.train.early_stopping_patience = 0
    cfg.train.lr_sparse = 2.0  # overconfident soon: a scale well below 1
    assert cfg.train.calibrate  # the default
    rd = tmp_path / "run"
    s = workflow.train(cfg, rd, resume=False, progress=False)
    ck = best_checkpoint(rd)
    data = workflow.prepare_data(cfg)
    model, _ = workflow.build(cfg, workflow.tables_for(cfg, data.manifest), data.manifest.num_dense,
                              torch.device("cpu"), validate=False)
    load_model_state(model, ck)
    a, b = model.calibration.scale_shift.tolist()
    assert a != 1.0 or b != 0.0
    calibrated, y = _logits(model, data.eval)
    model.calibration.set(1.0, 0.0, 0.0)
    raw, _ = _logits(model, data.eval)
    _, best = reference_beta(y, raw, np.ones_like(y))
    _, best_platt = reference_platt(y, raw, np.ones_like(y))
    cal = binary_metrics(y, calibrated)
    assert cal["logloss"] == pytest.approx(best, rel=1e-5)  # the optimum over every (a, b, d)
    assert cal["logloss"] <= best_platt * (1 + 1e-6)
    assert cal["auc"] == pytest.approx(binary_metrics(y, raw)["auc"], abs=1e-12)  # the ranking is kept
    r = CliRunner().invoke(main, ["evaluate", str(rd), "--json"])  # what a user scores
    assert r.exit_code == 0, r.output
    got = json.loads(r.output.strip().splitlines()[-1])
    assert got["step"] == s["best"]["step"]
    for k in ("logloss", "auc", "calibration"):
        assert got[k] == pytest.approx(s["best"][f"eval_{k}"], rel=1e-5), k
    assert got["logloss"] == pytest.approx(best, rel=1e-5)


def test_calibrate_off_keeps_the_raw_logits(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    cfg.train.calibrate = False
    rd = tmp_path / "run"
    workflow.train(cfg, rd, resume=False, progress=False)
    data = workflow.prepare_data(cfg)
    model, _ = workflow.build(cfg, workflow.tables_for(cfg, data.manifest), data.manifest.num_dense,
                              torch.device("cpu"), validate=False)
    load_model_state(model, best_checkpoint(rd))
    assert model.calibration.scale_shift.tolist() == [1.0, 0.0]
