"""Exact metrics for click-through-rate models (logloss and ROC AUC, ties averaged) and the one writer of a
run's ``metrics.csv``.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from embedscale.errors import FormatError
from embedscale.io import atomic_write_text


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
@dataclass
class MetricRow:
    """One row of ``metrics.csv``: a logged training window and/or an evaluation at ``step``."""

    step: int
    epoch: int
    samples: int
    train_loss: float = math.nan
    eval_logloss: float = math.nan
    eval_auc: float = math.nan
    samples_per_s: float = math.nan
    seconds: float = math.nan


METRIC_FIELDS = [f.name for f in fields(MetricRow)]


class MetricsLog:
    """The rows of a run's ``metrics.csv``, kept across resumes and restarts: every step's row once.

    ``restart(step)`` is called when a run starts or resumes at ``step`` (0 = from scratch): it reloads the
    file and keeps the rows with ``step <= step`` (the ones the restored checkpoint has seen), so rows written
    after the checkpoint by an attempt that then died are dropped and logged again by this one. ``write``
    rewrites the file atomically. Only the writing rank (rank 0) has ``enabled``; the others keep nothing.
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True):
        self.path = Path(run_dir) / "metrics.csv"
        self.enabled = enabled
        self.rows: list[MetricRow] = []

    def restart(self, step: int) -> None:
        self.rows = [r for r in self.read() if r.step <= step] if self.enabled else []

    def read(self) -> list[MetricRow]:
        if not self.path.exists():
            return []
        out = []
        with self.path.open(newline="") as f:
            for line, d in enumerate(csv.DictReader(f), start=2):
                try:
                    out.append(MetricRow(int(d["step"]), int(d["epoch"]), int(d["samples"]),
                                         *[float(d[k]) if d.get(k) not in ("", None) else math.nan
                                           for k in METRIC_FIELDS[3:]]))
                except (KeyError, TypeError, ValueError) as e:
                    raise FormatError(f"{self.path}:{line}: not a metrics row ({type(e).__name__}: {e})") from None
        return out

    def log(self, row: MetricRow) -> None:
        if self.enabled:
            self.rows.append(row)

    def log_eval(self, step: int, epoch: int, samples: int, logloss: float, auc: float, seconds: float) -> None:
        """An evaluation at ``step``: into that step's training row if it is the last one, else a row of its own."""
        if not self.enabled:
            return
        if self.rows and self.rows[-1].step == step:
            self.rows[-1].eval_logloss, self.rows[-1].eval_auc = logloss, auc
        else:
            self.rows.append(MetricRow(step, epoch, samples, eval_logloss=logloss, eval_auc=auc, seconds=seconds))

    def write(self) -> None:
        if not self.enabled:
            return
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=METRIC_FIELDS, lineterminator="\n")
        w.writeheader()
        for r in self.rows:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()})
        atomic_write_text(self.path, buf.getvalue())
