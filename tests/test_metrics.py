"""The evaluation metrics (``data.metrics``) against independent references: ROC AUC against brute-force
pair counting (ties 1/2, pairs weighted by the product of their weights), logloss, normalised entropy and
calibration against their definitions written out in float64 Python arithmetic; ties, one-class inputs
(NaN by definition) and sample weights (integer weights = repeated samples)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from embedscale.data.metrics import (base_entropy, binary_metrics, calibration, logloss, logloss_from_logits,
                                     normalized_entropy, roc_auc)


def brute_auc(y, s, w=None) -> float:
    """Every (positive, negative) pair: 1 if the positive scores higher, 1/2 on a tie, weighted by w_i w_j."""
    w = [1.0] * len(y) if w is None else [float(v) for v in w]
    num = den = 0.0
    for i in range(len(y)):
        if not y[i]:
            continue
        for j in range(len(y)):
            if y[j]:
                continue
            pair = w[i] * w[j]
            den += pair
            num += pair * (1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0)
    return num / den if den else math.nan


def def_logloss(y, p, w=None) -> float:
    w = [1.0] * len(y) if w is None else [float(v) for v in w]
    total = sum(-wi * (yi * math.log(pi) + (1 - yi) * math.log(1 - pi)) for yi, pi, wi in zip(y, p, w))
    return total / sum(w)


def def_ne(y, p, w=None) -> float:
    w = [1.0] * len(y) if w is None else [float(v) for v in w]
    ctr = sum(wi * yi for yi, wi in zip(y, w)) / sum(w)
    if ctr in (0.0, 1.0):
        return math.nan
    return def_logloss(y, p, w) / -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))


def def_calibration(y, p, w=None) -> float:
    w = [1.0] * len(y) if w is None else [float(v) for v in w]
    clicks = sum(wi * yi for yi, wi in zip(y, w))
    return sum(wi * pi for pi, wi in zip(p, w)) / clicks if clicks else math.nan


def cases():
    rng = np.random.default_rng(7)
    out = []
    for n, levels in ((50, 4), (200, 11), (300, 0), (97, 2)):  # levels: distinct score values (0 = continuous)
        y = (rng.random(n) < 0.3).astype(int)
        s = rng.integers(0, levels, n) / max(levels - 1, 1) if levels else rng.random(n)
        p = np.clip(0.05 + 0.9 * s, 0.01, 0.99)
        out.append((y, p, rng.integers(0, 4, n).astype(float)))  # weights 0..3, some zero
    return out


@pytest.mark.parametrize("case", range(4))
def test_auc_is_the_pair_count_with_ties_halved(case):
    y, p, w = cases()[case]
    assert roc_auc(y, p) == pytest.approx(brute_auc(y, p), abs=1e-12)
    assert roc_auc(y, p, w) == pytest.approx(brute_auc(y, p, w), abs=1e-12)


def test_auc_small_hand_cases():
    # one tie between a positive and a negative: half a pair
    assert roc_auc([1, 0], [0.5, 0.5]) == 0.5
    assert roc_auc([0, 1, 0, 1], [0.1, 0.4, 0.5, 0.8]) == 0.75
    # every score tied: 1/2 whatever the labels
    assert roc_auc([1, 0, 0, 1, 0], [3, 3, 3, 3, 3]) == 0.5
    # perfect and reversed orderings (an off-by-one in the rank statistic moves these)
    assert roc_auc([0, 0, 1, 1], [1, 2, 3, 4]) == 1.0
    assert roc_auc([1, 1, 0, 0], [1, 2, 3, 4]) == 0.0
    # the order of equal scores in the input does not matter
    assert roc_auc([1, 0, 1, 0], [2, 2, 1, 1]) == roc_auc([0, 1, 0, 1], [2, 2, 1, 1]) == 0.5


def test_integer_weights_equal_repeated_samples():
    y, p, w = cases()[1]
    reps = w.astype(int)
    yr, pr = np.repeat(y, reps), np.repeat(p, reps)
    assert roc_auc(y, p, w) == pytest.approx(roc_auc(yr, pr), abs=1e-12)
    assert logloss(y, p, weights=w) == pytest.approx(logloss(yr, pr), rel=1e-12)
    assert normalized_entropy(y, p, w) == pytest.approx(normalized_entropy(yr, pr), rel=1e-12)
    assert calibration(y, p, w) == pytest.approx(calibration(yr, pr), rel=1e-12)


@pytest.mark.parametrize("case", range(4))
def test_logloss_ne_calibration_follow_their_definitions(case):
    y, p, w = cases()[case]
    for weights in (None, w):
        assert logloss(y, p, weights=weights) == pytest.approx(def_logloss(y, p, weights), rel=1e-12)
        assert normalized_entropy(y, p, weights) == pytest.approx(def_ne(y, p, weights), rel=1e-12)
        assert calibration(y, p, weights) == pytest.approx(def_calibration(y, p, weights), rel=1e-12)
        z = np.log(p) - np.log1p(-p)  # the same predictions as logits
        assert logloss_from_logits(y, z, weights) == pytest.approx(def_logloss(y, p, weights), rel=1e-9)
        assert normalized_entropy(y, z, weights, logits=True) == pytest.approx(def_ne(y, p, weights), rel=1e-9)


def test_ne_of_the_base_rate_is_one():
    y = np.array([1, 0, 0, 0, 1, 0, 0, 0])
    assert normalized_entropy(y, np.full(8, 0.25)) == pytest.approx(1.0, rel=1e-12)
    assert base_entropy(y) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel=1e-12)
    assert calibration(y, np.full(8, 0.25)) == pytest.approx(1.0)
    assert calibration(y, np.full(8, 0.5)) == pytest.approx(2.0)


def test_one_class_is_nan_by_definition():
    p = np.array([0.2, 0.7, 0.4])
    for y in (np.ones(3), np.zeros(3)):
        assert math.isnan(roc_auc(y, p)) and math.isnan(normalized_entropy(y, p))
        assert logloss(y, p) == pytest.approx(def_logloss(y, p))  # still defined
    assert math.isnan(calibration(np.zeros(3), p))  # no click observed
    assert calibration(np.ones(3), p) == pytest.approx(1.3 / 3)
    # positives whose weights are all 0 are no positives
    assert math.isnan(roc_auc([1, 0, 0], p, [0, 1, 1]))
    m = binary_metrics(np.ones(3), np.array([0.0, 1.0, -1.0]))
    assert math.isnan(m["auc"]) and math.isnan(m["ne"]) and m["samples"] == 3 and m["positive_rate"] == 1.0


def test_empty_and_bad_weights():
    e = np.zeros(0)
    assert math.isnan(logloss(e, e)) and math.isnan(roc_auc(e, e)) and math.isnan(normalized_entropy(e, e))
    with pytest.raises(ValueError, match="weights"):
        roc_auc([1, 0], [0.1, 0.2], [1, -1])
    with pytest.raises(ValueError, match="2 sample weights for 3"):
        logloss([1, 0, 1], [0.1, 0.2, 0.3], weights=[1, 1])
    with pytest.raises(ValueError, match="weights"):
        calibration([1, 0], [0.1, 0.2], [0, 0])


def test_binary_metrics_from_logits():
    y, p, w = cases()[0]
    z = np.log(p) - np.log1p(-p)
    m = binary_metrics(y, z, w)
    assert m["auc"] == pytest.approx(brute_auc(y, p, w), abs=1e-12)
    assert m["logloss"] == pytest.approx(def_logloss(y, p, w), rel=1e-9)
    assert m["ne"] == pytest.approx(def_ne(y, p, w), rel=1e-9)
    assert m["calibration"] == pytest.approx(def_calibration(y, p, w), rel=1e-9)
    assert m["samples"] == len(y) and m["positive_rate"] == pytest.approx(float(np.sum(w * y) / w.sum()))
