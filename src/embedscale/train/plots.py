"""PNG of a run's curves: training loss, eval logloss/AUC and the progressive-validation window's over steps."""

from __future__ import annotations

import math
from pathlib import Path

from embedscale.io import atomic_open


def plot_curves(rows, path: str | Path, title: str = "", ceiling_auc: float | None = None) -> Path:
    """Two panels, loss (train, eval and progressive) and AUC (eval and progressive: each batch scored before
    it was trained on, over the window; ``train.loop``), against the step; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(10, 3.8))
    tr = [(r.step, r.train_loss) for r in rows if not math.isnan(r.train_loss)]
    ev = [(r.step, r.eval_logloss, r.eval_auc) for r in rows if not math.isnan(r.eval_auc)]
    pv = [(r.step, r.pv_logloss, r.pv_auc) for r in rows if not math.isnan(r.pv_auc)]
    if tr:
        ax_loss.plot(*zip(*tr), label="train logloss (window mean)")
    if ev:
        s, ll, auc = zip(*ev)
        ax_loss.plot(s, ll, "o-", label="eval logloss")
        ax_auc.plot(s, auc, "o-", color="tab:green", label="eval AUC")
    if pv:
        s, ll, auc = zip(*pv)
        ax_loss.plot(s, ll, color="tab:purple", alpha=0.8, label="progressive logloss (window)")
        ax_auc.plot(s, auc, color="tab:purple", alpha=0.8, label="progressive AUC (window)")
    if ceiling_auc is not None and not math.isnan(ceiling_auc):
        ax_auc.axhline(ceiling_auc, ls="--", color="gray", label=f"teacher ceiling {ceiling_auc:.4f}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("logloss")
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run with no logged step or evaluation has nothing to name
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path
