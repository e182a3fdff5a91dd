"""The one writer of a run's ``metrics.csv`` (rows kept across resumes and restarts), and the exact metrics
it records (``data.metrics``: logloss, ROC AUC with ties averaged, normalised entropy, calibration).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from embedscale.data.metrics import (binary_metrics, calibration, logloss, logloss_from_logits,  # noqa: F401
                                     normalized_entropy, roc_auc)  # (the run's metrics)
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
