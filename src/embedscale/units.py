"""Sizes in configs and on the command line: ``256MiB`` -> bytes (:func:`parse_bytes`) and back for people
(:func:`human_bytes`). The config layer: every layer above reads sizes through these."""

from __future__ import annotations

import math

from embedscale.errors import ConfigError


def parse_bytes(text: str | int | float, what: str = "memory") -> int:
    """``256MiB``, ``1.5GiB``, ``512MB``, ``1000000`` -> bytes (a ``ConfigError`` naming ``what`` otherwise)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip()
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
             "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ").strip()
    unit = s[len(num):].strip().lower()
    try:
        v = float(num)
    except ValueError:
        raise ConfigError(f"{what}: cannot read {text!r} as a size (e.g. 256MiB, 2GiB, 1000000)") from None
    if unit not in units or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{what}: cannot read {text!r} as a size (units: {', '.join(u for u in units if u)})")
    return int(v * units[unit])


def human_bytes(b: float) -> str:
    """Bytes for people: B, KiB, MiB or GiB."""
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= f:
            return f"{b / f:,.1f} {unit}"
    return f"{b:,.0f} B"
