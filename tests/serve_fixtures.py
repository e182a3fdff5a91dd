"""A tiny trained model for the serving tests: a Criteo-format click log of random hex values (labels
drawn from a known logistic rule), trained for a few steps by the README's main job in this process."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embedscale.specs import RunConfig, from_dict
from embedscale.workflow import run_main

VOCAB = 30  # distinct values per categorical column


def write_criteo(path: Path, rows: int, *, labeled: bool = True, seed: int = 0) -> list[dict]:
    """A Criteo TSV (label, I1..I13, C1..C26; empty fields are missing values); returns the rows as the JSON
    a client sends (raw values: ints or None, hex strings or None)."""
    rng = np.random.default_rng(seed)
    vocab = [[f"{int(rng.integers(0, 2**32)):08x}" for _ in range(VOCAB)] for _ in range(26)]
    out = []
    with open(path, "w") as f:
        for _ in range(rows):
            ints = [int(v) if v >= 0 else None for v in rng.integers(-1, 50, 13)]
            cats = [None if rng.random() < 0.05 else vocab[j][min(int(rng.zipf(1.5)) - 1, VOCAB - 1)] for j in range(26)]
            y = int(rng.random() < 1 / (1 + np.exp(-((ints[0] or 0) / 25 - 1 + (cats[0] == vocab[0][0])))))
            fields = ([str(y)] if labeled else []) + ["" if v is None else str(v) for v in ints] + \
                     ["" if c is None else c for c in cats]
            f.write("\t".join(fields) + "\n")
            out.append({**{f"I{i + 1}": v for i, v in enumerate(ints)}, **{f"C{j + 1}": c for j, c in enumerate(cats)}})
    return out


def train_tiny(root: Path, rows: int = 1200, categorical: str = "hash", arch: str = "dlrm",
               model: dict | None = None) -> tuple[Path, RunConfig]:
    """Train a small model on ``root/train.tsv`` (written here); returns its run directory and config."""
    write_criteo(root / "train.tsv", rows)
    cfg = from_dict(RunConfig, {
        "out_dir": str(root / "runs"),
        "data": {"source": "criteo", "path": str(root / "train.tsv"), "eval_fraction": 0.25,
                 "categorical": categorical},
        "model": {"arch": arch, "embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], "cross_layers": 1,
                  **(model or {})},
        "train": {"batch_size": 64, "max_steps": 12, "eval_every": 6, "checkpoint_every": 6}})
    run_main(cfg, progress=False)
    (run_dir,) = [p.parent for p in (root / "runs").glob("*/checkpoints")]
    return run_dir, cfg
