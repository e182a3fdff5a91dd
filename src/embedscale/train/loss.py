"""The training loss of every run: binary cross-entropy on the logits, each sample weighted by its sample
weight when the dataset has one (a schema's ``weight`` column, ``data.schema``), 1 otherwise.

The loss of a batch is ``sum_i w_i * bce(z_i, y_i) / B`` with ``B`` the global batch size: PyTorch's
``BCEWithLogitsLoss(weight=w)`` with mean reduction, and the plain mean when every weight is 1. Dividing by
``B`` (not by the sum of the weights) keeps a rank's share of an N-rank batch exactly its share of the sum, so
N ranks compute the single-process gradient.
"""

from __future__ import annotations

import torch
from torch import nn


def bce_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_i w_i * bce(logits_i, labels_i)`` (``w_i`` = 1 without ``weights``)."""
    return nn.functional.binary_cross_entropy_with_logits(logits, labels, weight=weights, reduction="sum")


def batch_loss_sum(logits: torch.Tensor, batch) -> torch.Tensor:
    """:func:`bce_sum` of a ``data.batch.Batch`` (its labels and, for a weighted dataset, its weights)."""
    return bce_sum(logits, batch.labels, getattr(batch, "weights", None))


__all__ = ["batch_loss_sum", "bce_sum"]
