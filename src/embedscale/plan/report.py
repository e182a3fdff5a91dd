"""Reports: one entry per strategy from its plan and cost, a markdown table, and OPER Fig. 10 as a PNG.

The per-strategy entry carries what the issue asks for (``plan_seconds``, ``memory_per_rank``,
``lookup_per_rank``, ``comm_matrix``, ``dob_memory``, ``dob_lookup``, ``dob_comm``, ``comm_mean``,
``max_rank_cost``) plus the byte figures and a plan summary. The PNG has OPER Fig. 10's three panels:
memory, lookup workload and communication per rank, each as max / mean / min per strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from embedscale.io import atomic_open, atomic_write_text


def strategy_entry(plan, cost) -> dict[str, Any]:
    d = cost.to_dict()
    d["plan_seconds"] = float(plan.meta.get("plan_seconds", float("nan")))
    d["plan"] = plan.summary()
    keep = ("threshold", "threshold_history", "replicated_rows_everywhere", "training_freq_threshold", "algorithm1",
            "milp", "approximations", "torchrec_sharding_types", "memory_budget_bytes")
    d["plan_meta"] = {k: plan.meta[k] for k in keep if k in plan.meta}
    return d


def markdown(report: dict[str, Any]) -> str:
    """One row per strategy: the balance and cost figures."""
    cfg = report.get("config", {})
    lines = [
        f"Plan comparison: {cfg.get('mode')} mode, {cfg.get('world_size')} ranks "
        f"({cfg.get('num_hosts')} hosts), batch {cfg.get('batch_size')} per rank, extra memory {cfg.get('extra_memory')}",
        "",
        "| strategy | plan s | DoB memory | DoB lookup | DoB comm | comm mean (MB/link) | max rank cost (us) | fits memory |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, e in report["strategies"].items():
        if "error" in e:
            lines.append(f"| {name} | - | - | - | - | - | - | error: {e['error']} |")
            continue
        lines.append(
            f"| {name} | {e['plan_seconds']:.2f} | {e['dob_memory']:.4f} | {e['dob_lookup']:.4f} | {e['dob_comm']:.4f} "
            f"| {e['comm_mean'] / 1e6:.4f} | {e['max_rank_cost']:.2f} | {e['fits_memory']} |"
        )
    if cfg.get("replicated_tables"):  # TT tables (EL-Rec VI-B): not in any plan, a copy on every rank
        lines += ["", f"TT-compressed tables, replicated on every rank and trained data-parallel (not sharded): "
                  f"{cfg['replicated_bytes_per_rank'] / 2**20:,.2f} MiB of cores per rank", "",
                  "| table | rows | dim | TT rank | row factors | cores | uncompressed |", "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
        for m in cfg["replicated_tables"]:
            lines.append(f"| {m['name']} | {m['num_rows']:,} | {m['dim']} | {m['tt_rank']} | "
                         f"{'x'.join(map(str, m['row_shape']))} | {m['bytes'] / 2**20:,.2f} MiB | "
                         f"{m['uncompressed_bytes'] / 2**20:,.1f} MiB |")
    return "\n".join(lines) + "\n"


def write_png(report: dict[str, Any], path: str | Path) -> Path:
    """OPER Fig. 10: (a) memory, (b) lookup workload, (c) communication per rank; max/mean/min bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, e in report["strategies"].items() if "error" not in e]
    panels = [("memory_per_rank", "(a) memory (MB)", 1e-6), ("lookup_per_rank", "(b) lookup (us/iter)", 1.0),
              ("comm_per_rank", "(c) communication (us/iter)", 1.0)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    x = np.arange(len(names))
    w = 0.27
    for ax, (key, title, scale) in zip(axes, panels):
        vals = [np.asarray(report["strategies"][n][key], dtype=np.float64) * scale for n in names]
        for k, (lab, fn) in enumerate((("max", np.max), ("mean", np.mean), ("min", np.min))):
            ax.bar(x + (k - 1) * w, [fn(v) for v in vals], w, label=lab)
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    path = Path(path)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


def write_markdown(report: dict[str, Any], path: str | Path) -> None:
    atomic_write_text(path, markdown(report))
