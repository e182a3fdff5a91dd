"""The one writer of a run's ``metrics.csv`` (rows kept across resumes and restarts), the exact metrics
it records (``data.metrics``: logloss, ROC AUC with ties averaged, normalised entropy, calibration), and
the progressive-validation window (:class:`ProgressiveWindow`: every batch scored before it is trained on).
"""

from __future__ import annotations

import csv
import io
import math
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from embedscale.data.metrics import (binary_metrics, calibration, logloss, logloss_from_logits,  # noqa: F401
                                     normalized_entropy, roc_auc)  # (the run's metrics)
from embedscale.device import HOST
from embedscale.errors import FormatError
from embedscale.io import atomic_write_text


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
    eval_ne: float = math.nan  # normalised entropy (data.metrics.normalized_entropy)
    eval_calibration: float = math.nan  # predicted over observed CTR
    # progressive validation (ProgressiveWindow): the window's figures of pre-update logits (rows of older
    # files: NaN)
    pv_logloss: float = math.nan
    pv_auc: float = math.nan
    pv_ne: float = math.nan
    pv_samples: float = math.nan  # samples in the window


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

    def log_eval(self, step: int, epoch: int, samples: int, logloss: float, auc: float, seconds: float, *,
                 ne: float = math.nan, calibration: float = math.nan) -> None:
        """An evaluation at ``step``: into that step's training row if it is the last one, else a row of its own."""
        if not self.enabled:
            return
        if self.rows and self.rows[-1].step == step:
            r = self.rows[-1]
            r.eval_logloss, r.eval_auc, r.eval_ne, r.eval_calibration = logloss, auc, ne, calibration
        else:
            self.rows.append(MetricRow(step, epoch, samples, eval_logloss=logloss, eval_auc=auc, seconds=seconds,
                                       eval_ne=ne, eval_calibration=calibration))

    def write(self) -> None:
        if not self.enabled:
            return
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=METRIC_FIELDS, lineterminator="\n")
        w.writeheader()
        for r in self.rows:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()})
        atomic_write_text(self.path, buf.getvalue())


class ProgressiveWindow:
    """Progressive validation over a sliding window: every batch is scored by the logits of its training
    forward, before the update it causes, so each sample is scored by a model that has not trained on it
    (the online-learning estimate of generalisation: Blum, Kalai & Langford, COLT 1999; McMahan et al.,
    "Ad click prediction: a view from the trenches", KDD 2013, section 5.1).

    ``add(logits, labels, weights, global_size)`` keeps this rank's slice of a global batch (on its device,
    nothing copied until asked). The window is the most recent global batches that together hold at least
    ``window`` samples (the fewest such; all of them while fewer have been seen): whole batches, so every rank
    keeps the same batches, and its figures are order-free (AUC, logloss, NE), so gathering the ranks' slices
    in any order gives the figures of exactly those batches. ``arrays()`` is this rank's part
    ``(logits, labels, weights or None)`` as float64 numpy."""

    def __init__(self, window: int):
        if window <= 0:
            raise ValueError(f"progressive window must be > 0 samples, got {window}")
        self.window = int(window)
        self.batches: deque = deque()
        self.samples = 0  # global samples in the window

    def add(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None, global_size: int,
            epoch: int = 0) -> None:
        """``epoch``: the pass over the training data the batch is from (0: the first; later passes score samples
        that earlier ones trained on, :meth:`epochs`)."""
        self.batches.append((logits.detach().reshape(-1), labels.detach().reshape(-1),
                             None if weights is None else weights.detach().reshape(-1), int(global_size), int(epoch)))
        self.samples += int(global_size)
        while len(self.batches) > 1 and self.samples - self.batches[0][3] >= self.window:
            self.samples -= self.batches.popleft()[3]

    def epochs(self) -> tuple[int, int]:
        """The epochs (0-based) of the window's oldest and newest batch."""
        return (self.batches[0][4], self.batches[-1][4]) if self.batches else (0, 0)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if not self.batches:
            return np.zeros(0), np.zeros(0), None
        z = torch.cat([b[0] for b in self.batches]).double().to(HOST).numpy()
        y = torch.cat([b[1] for b in self.batches]).double().to(HOST).numpy()
        w = None
        if self.batches[0][2] is not None:
            w = torch.cat([b[2] for b in self.batches]).double().to(HOST).numpy()
        return z, y, w
