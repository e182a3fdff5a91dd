"""A measured choice among the cost model's best plans (numpy only; the timing is the caller's).

The auto planner ranks plans by a model whose predictions miss by some percent (``embedscale calibrate`` reports
how much on the plans it timed). Where the model's best plans are within that error of each other, its ranking
among them says little: :func:`close_plans` names them (every plan whose predicted step is within ``margin`` of
the best, relative, at most ``limit``), and :func:`measured_choice` runs each for a few steps (``time_plan``: a
plan's name -> the seconds of its steps) and keeps the one of least median step. With one clear winner nothing
is timed. The choice, every candidate's predicted and measured step and the seconds the trial took go into the
explain report; the run counts those seconds in its own time.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from embedscale.errors import ConfigError

#: the relative margin within which the model's plans are taken as tied when the calibration measured no error
DEFAULT_MARGIN = 0.10


def prediction_margin(costs_notes: Mapping[str, Any] | None, default: float = DEFAULT_MARGIN) -> float:
    """The model's own relative error: the calibration's measured prediction error (``notes["prediction_error"]``,
    the largest absolute relative error over the plans it timed, out of sample when it held some out) when
    recorded, else ``default``."""
    err = (costs_notes or {}).get("prediction_error")
    return float(abs(err)) if isinstance(err, (int, float)) and err == err else float(default)


def close_plans(plans: Sequence[Mapping[str, Any]], margin: float, limit: int = 3) -> list[Mapping[str, Any]]:
    """The plans (each with ``name`` and ``predicted_seconds``) whose prediction is within ``margin`` (relative) of
    the best one's, best first, at most ``limit``; plans of the same name are taken once."""
    if margin < 0:
        raise ConfigError(f"plan trial: the margin must be >= 0, got {margin}")
    ranked, seen = [], set()
    for p in sorted(plans, key=lambda p: float(p["predicted_seconds"])):
        if p["name"] not in seen:
            seen.add(p["name"])
            ranked.append(p)
    if not ranked:
        return []
    best = float(ranked[0]["predicted_seconds"])
    return [p for p in ranked if float(p["predicted_seconds"]) <= best * (1 + margin)][:max(1, int(limit))]


def measured_choice(plans: Sequence[Mapping[str, Any]], margin: float,
                    time_plan: Callable[[str], Sequence[float]], limit: int = 3) -> dict[str, Any]:
    """The model's close plans (:func:`close_plans`) timed by ``time_plan`` (a plan's name -> its steps' seconds)
    and the one of least median step chosen. Returns ``chosen`` (a name), ``trial`` (whether anything ran),
    ``margin``, per candidate its predicted and measured median step and steps timed, and ``trial_seconds``
    (the wall time of the timing, which the run counts as its own)."""
    close = close_plans(plans, margin, limit)
    if not close:
        raise ConfigError("plan trial: no plan to choose from")
    out: dict[str, Any] = {"margin": float(margin), "trial": len(close) > 1, "trial_seconds": 0.0,
                           "candidates": [{"name": p["name"], "predicted_seconds": float(p["predicted_seconds"])}
                                          for p in close]}
    if len(close) == 1:
        out["chosen"] = close[0]["name"]
        return out
    t0 = time.perf_counter()
    for c in out["candidates"]:
        steps = [float(s) for s in time_plan(c["name"])]
        if not steps:
            raise ConfigError(f"plan trial: plan {c['name']!r} timed no step")
        c["measured_median_seconds"] = float(np.median(steps))
        c["steps_timed"] = len(steps)
    out["trial_seconds"] = time.perf_counter() - t0
    out["chosen"] = min(out["candidates"], key=lambda c: c["measured_median_seconds"])["name"]
    return out
