"""Evaluation metrics at the edges a user hits: predictions of exactly 0 or 1.

Reference: the documented clipping (``data.metrics.logloss``: probabilities clipped to ``[eps, 1 - eps]``,
``eps = 1e-7``) worked by hand in float64 Python arithmetic; a confident wrong prediction costs
``-log(eps)`` (about 16.12 nats), never ``inf`` or NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from embedscale.data.metrics import logloss, logloss_from_logits, normalized_entropy

EPS = 1e-7  # the documented default of logloss's clipping


def test_logloss_at_p_0_and_1_is_the_clipped_float64_value():
    y = [1, 0, 1, 0]
    p = [0.0, 1.0, 1.0, 0.0]  # two confident mistakes, two confident hits
    hi = 1 - EPS  # the upper clip in float64 (1 - hi is 1e-7 to 9 digits, not exactly)
    wrong, wrong_neg = -math.log(EPS), -math.log1p(-hi)  # a click at p = 0; a non-click at p = 1
    right, right_neg = -math.log(hi), -math.log1p(-EPS)  # a click at p = 1; a non-click at p = 0
    want = (wrong + wrong_neg + right + right_neg) / 4
    got = logloss(y, p)
    assert math.isfinite(got)
    assert got == pytest.approx(want, rel=1e-12)
    assert got == pytest.approx(8.0590478756, rel=1e-9)  # the same number, written out (16.118 / 2)
    # one sample each way, and weights: the weighted mean of the clipped terms
    assert logloss([1], [0.0]) == pytest.approx(wrong, rel=1e-12)
    assert logloss([0], [1.0]) == pytest.approx(wrong_neg, rel=1e-12)
    assert logloss([1], [1.0]) == pytest.approx(right, rel=1e-9)
    assert logloss([0], [0.0]) == pytest.approx(right_neg, rel=1e-9)
    assert logloss(y, p, weights=[3.0, 0.0, 1.0, 0.0]) == pytest.approx((3 * wrong + right) / 4, rel=1e-12)
    # another eps is honoured
    assert logloss([1, 0], [0.0, 0.5], eps=1e-3) == pytest.approx((-math.log(1e-3) + math.log(2)) / 2, rel=1e-12)


def test_ne_of_certain_predictions_is_finite():
    """NE = logloss / H(ctr): with p in {0, 1} the numerator is the clipped logloss above, never inf."""
    y = np.array([1, 0, 0, 0])
    p = np.array([1.0, 1.0, 0.0, 0.0])  # one hit at 1, one miss at 1, two hits at 0
    ll = (-math.log1p(-(1 - EPS)) - math.log(1 - EPS) - 2 * math.log1p(-EPS)) / 4
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert normalized_entropy(y, p) == pytest.approx(ll / h, rel=1e-12)


def test_logloss_from_saturated_logits_is_exact_and_finite():
    """From logits the loss needs no clipping: a logit of -40 for a click costs 40 nats (+ log1p(e^-40))."""
    z = np.array([-40.0, 40.0, 800.0, -800.0])
    y = np.array([1, 0, 1, 0])
    want = (40 + math.log1p(math.exp(-40))) * 2 / 4 + 2 * math.log1p(math.exp(-800)) / 4
    assert logloss_from_logits(y, z) == pytest.approx(want, rel=1e-12)
