"""An independent scorer for tests: a checkpoint's eval-split logits computed here, one batch at a time, and the
AUC by counting every (positive, negative) pair in float64 (ties 1/2), not through ``embedscale.data.metrics``."""
from __future__ import annotations

import numpy as np
import torch

from embedscale import workflow
from embedscale.data.loader import ShardLoader
from embedscale.train.trainer import load_model_state


def eval_logits(cfg, checkpoint) -> tuple[np.ndarray, np.ndarray]:
    """``checkpoint``'s model logits and the labels over ``cfg``'s eval split, in float64."""
    data = workflow.prepare_data(cfg, progress=False)
    model, _ = workflow.build(cfg, workflow.tables_for(cfg, data.manifest), data.manifest.num_dense,
                              torch.device("cpu"))
    load_model_state(model, checkpoint)
    model.eval()
    z, y = [], []
    with torch.no_grad():
        for b in ShardLoader(data.eval.directory, 64, start=data.eval.start, stop=data.eval.stop):
            z.append(model(b.dense, b.sparse).double().numpy())
            y.append(b.labels.double().numpy())
    return np.concatenate(z), np.concatenate(y)


def pair_count_auc(z: np.ndarray, y: np.ndarray) -> float:
    """AUC as the share of (positive, negative) pairs ranked right, ties counted 1/2."""
    pos, neg = z[y == 1], z[y == 0]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (pos.size * neg.size))
