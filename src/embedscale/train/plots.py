"""PNGs of a run: its curves (training loss, eval logloss/AUC and the progressive-validation window's over steps)
and, for a run with live re-planning (``train.replan``), its re-plans."""

from __future__ import annotations

import math
from pathlib import Path

from embedscale.io import atomic_open


def plot_curves(rows, path: str | Path, title: str = "", ceiling_auc: float | None = None,
                replan_steps: list[int] | None = None) -> Path:
    """Two panels, loss (train, eval and progressive) and AUC (eval and progressive: each batch scored before
    it was trained on, over the window; ``train.loop``), against the step, a dotted line at every live re-plan
    (``replan_steps``); written atomically."""
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
    for i, step in enumerate(replan_steps or []):
        for ax in (ax_loss, ax_auc):
            ax.axvline(step, ls=":", color="tab:red", alpha=0.6, label="re-plan" if i == 0 else None)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("logloss")
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    for ax in (ax_loss, ax_auc):
        if ax.get_legend_handles_labels()[0]:  # a run with no logged step or evaluation has nothing to name
            ax.legend(fontsize=8)
    return _finish(fig, (ax_loss, ax_auc), path, title)


def plot_replans(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """A run's live re-plans (``replans.csv`` rows, ``train.replan.read_replans``): per re-plan, at its step, the
    running plan's balance (predicted bottleneck over mean per-rank cost, 1 = even) before and the new plan's
    after, and the rows moved with the seconds it took (the whole pause: check and migration); written
    atomically. Why each happened is the CSV's ``reason`` (and the summary's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    before = [float(r["balance_before"]) for r in rows]
    after = [float(r["balance_after"]) for r in rows]
    moved = [int(float(r["rows_moved"])) for r in rows]
    secs = [float(r["seconds"]) for r in rows]
    fig, (ax_bal, ax_mov) = plt.subplots(1, 2, figsize=(10, 3.8))
    for x, b, a in zip(steps, before, after):
        ax_bal.annotate("", xy=(x, a), xytext=(x, b), arrowprops=dict(arrowstyle="->", color="gray"))
    ax_bal.plot(steps, before, "o", color="tab:red", label="before (running plan)")
    ax_bal.plot(steps, after, "o", color="tab:green", label="after (new plan)")
    ax_bal.axhline(1.0, ls="--", color="gray", lw=0.8)
    ax_bal.ticklabel_format(axis="y", useOffset=False)
    ax_bal.set_xlabel("step")
    ax_bal.set_ylabel("max / mean per-rank cost")
    ax_bal.set_title("balance at each re-plan", fontsize=10)
    width = max(1.0, 0.02 * (max(steps) - min(steps))) if steps else 1.0
    ax_mov.bar(steps, moved, width=width, color="tab:blue", label="rows moved")
    ax_mov.set_xlabel("step")
    ax_mov.set_ylabel("rows moved")
    ax_sec = ax_mov.twinx()
    ax_sec.plot(steps, secs, "s", color="tab:orange", label="seconds (check + migration)")
    ax_sec.set_ylabel("seconds")
    ax_mov.set_title("rows moved and time taken", fontsize=10)
    handles = ax_mov.get_legend_handles_labels()
    more = ax_sec.get_legend_handles_labels()
    if steps:
        ax_bal.legend(fontsize=8)
        ax_mov.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8)
    return _finish(fig, (ax_bal, ax_mov), path, title)


def _finish(fig, axes, path: str | Path, title: str) -> Path:
    """Grid, title and layout, then the PNG written atomically (temporary file, rename) and the figure closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path
