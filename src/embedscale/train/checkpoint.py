"""Checkpoints that resume exactly and never run code on load.

A checkpoint is one ``torch.save`` file holding only tensors, numbers, strings, lists and dicts: the
model's state (embedding weights and their fused-optimizer state included), the dense optimizer's state,
the position in the data (epoch, batches done in that epoch, global step), the RNG states and the
resolved config as YAML text. It is written to a temporary file and renamed, and read back with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from embedscale.errors import FormatError
from embedscale.io import atomic_open

FORMAT = "embedscale.checkpoint"
VERSION = 1
_NAME = re.compile(r"step-(\d+)\.pt$")


def save_checkpoint(path: str | Path, *, model_state: dict, optimizer_state: dict, step: int, epoch: int,
                    batch_in_epoch: int, config_yaml: str, extra: dict | None = None) -> Path:
    """Write a checkpoint atomically; returns its path."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_state,
        "optimizer": optimizer_state,
        "step": int(step),
        "epoch": int(epoch),
        "batch_in_epoch": int(batch_in_epoch),
        "rng_torch": torch.get_rng_state(),
        "config_yaml": config_yaml,
        "extra": extra or {},
    }
    path = Path(path)
    with atomic_open(path, "wb") as f:
        torch.save(payload, f)
    return path


def load_checkpoint(path: str | Path, map_location: Any = None) -> dict:
    """Read a checkpoint with ``weights_only=True``; a wrong or damaged file is a ``FormatError``."""
    path = Path(path)
    if not path.exists():
        raise FormatError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds here
        raise FormatError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise FormatError(f"{path}: not an embedscale checkpoint")
    if payload.get("version") != VERSION:
        raise FormatError(f"{path}: checkpoint version {payload.get('version')} is not {VERSION}")
    return payload


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint with the highest step in ``directory`` (``None`` if there is none)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.search(p.name))]
    return max(found)[1] if found else None
