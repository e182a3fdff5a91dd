"""Exact click-prediction metrics over a whole split: logloss and ROC AUC (numpy, float64).

They sit with the data because both the synthetic generator (its teacher's AUC, the ceiling) and every run
(evaluation, ``train.metrics``) score with them.
"""

from __future__ import annotations

import numpy as np


def logloss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``probs`` against 0/1 ``labels``."""
    y = np.asarray(labels, dtype=np.float64)
    p = np.clip(np.asarray(probs, dtype=np.float64), eps, 1 - eps)
    if y.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def logloss_from_logits(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy computed stably from logits."""
    y = np.asarray(labels, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    if y.size == 0:
        return float("nan")
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC by the rank statistic (Mann-Whitney U), ties given the average rank.

    Returns NaN when only one class is present.
    """
    y = np.asarray(labels).astype(bool).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    # average ranks over ties
    boundaries = np.flatnonzero(np.diff(s_sorted)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [s.size]))
    avg_rank = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    ranks = np.repeat(avg_rank, ends - starts)
    rank_sum_pos = ranks[y[order]].sum()
    return float((rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# -- metrics.csv ------------------------------------------------------------------------------------
