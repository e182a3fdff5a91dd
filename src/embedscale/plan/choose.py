"""A measured choice among the cost model's best plans (numpy only; the timing is the caller's).

The auto planner ranks plans by a model whose predictions miss by some percent (``embedscale calibrate`` reports
how much on the plans it timed). Where the model's best plans are within that error of each other, its ranking
among them says little: :func:`close_plans` names them (every plan whose predicted step is within ``margin`` of
the best, relative, at most ``limit``). A rule the model misprices would never be among them when the model's
error is wide and its closest plans are the search's variants of one form, so :func:`trial_plans` adds, to those,
the best-priced plan of every rule family (EL-Rec's rule at each TT rank, the host mixtures at each rank, the
host rule: ``plan.auto_rules``) whose prediction is within the same margin, at most ``max_plans`` in all (the
families priced lowest first; those left out are named). :func:`measured_choice` runs each for a few steps
(``time_plan``: a plan's name -> the seconds of its steps) and keeps the one of least median step. One short
timing of a plan moves from one launch to the next by about as much as these plans differ (15% measured at full
size on a quiet host), so a trial of several rounds times again, in the reverse order, every plan whose timings so
far are within ``RERUN_MARGIN`` of the best's, and ranks the plans by the median of their timings (a race: the
clearly slower plans drop out after one timing). With one clear winner nothing is timed. The choice, every
candidate's predicted and measured step and the seconds the trial took go into the explain report; the run counts
those seconds in its own time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from embedscale.errors import ConfigError, EmbedscaleError

#: the relative margin within which the model's plans are taken as tied when the calibration measured no error
DEFAULT_MARGIN = 0.10
#: the most plans a trial times: its few steps each are paid once per run, so the families priced highest go first
MAX_TRIAL_PLANS = 10
#: a plan whose timings so far are within this of the best plan's is timed again in the trial's next round: one
#: 20-step timing of EL-Rec's rule at rank 8, full size, 2 ranks, read 70-92 ms over ten launches on a quiet host
RERUN_MARGIN = 0.15


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


def _families(p: Mapping[str, Any]) -> list[str]:
    """The rule families a plan stands for (``families``, else its ``family``; several when plans of the same
    forms were taken once)."""
    fam = p.get("families")
    return [str(f) for f in fam] if fam else ([str(p["family"])] if p.get("family") else [])


def trial_plans(plans: Sequence[Mapping[str, Any]], margin: float, limit: int = 3,
                max_plans: int = MAX_TRIAL_PLANS) -> tuple[list[Mapping[str, Any]], list[str]]:
    """The plans a trial times: the model's ``limit`` closest (:func:`close_plans`), then the best-priced plan of
    every family (``family`` / ``families`` of a plan) not among them whose prediction is within ``margin`` of the
    best plan's, lowest first, until ``max_plans``. Returns them (in that order) and the families left out by
    ``max_plans``."""
    close = close_plans(plans, margin, limit)
    if not close:
        return [], []
    top = float(close[0]["predicted_seconds"]) * (1 + margin)
    covered = {f for p in close for f in _families(p)}
    taken, extra = {p["name"] for p in close}, []
    for p in sorted(plans, key=lambda p: float(p["predicted_seconds"])):
        new = [f for f in _families(p) if f not in covered]
        if float(p["predicted_seconds"]) > top or not new:
            continue
        covered.update(new)
        if p["name"] not in taken:
            taken.add(p["name"])
            extra.append((p, new))
    room = max(0, int(max_plans) - len(close))
    return close + [p for p, _ in extra[:room]], [f for _, fs in extra[room:] for f in fs]


def measured_choice(plans: Sequence[Mapping[str, Any]], margin: float,
                    time_plan: Callable[[str], Sequence[float]], limit: int = 3,
                    max_plans: int = MAX_TRIAL_PLANS, rounds: int = 1,
                    rerun_margin: float = RERUN_MARGIN) -> dict[str, Any]:
    """The plans of :func:`trial_plans` timed by ``time_plan`` (a plan's name -> its steps' seconds) and the one
    of least measured step chosen. Each timing's figure is the median of its steps; a plan's measured step is the
    median of its timings. ``rounds`` > 1: after the first round, each further round times again, in the reverse
    order of the round before, the plans whose measured step is within ``rerun_margin`` of the best one's (none
    when only the best is). Returns ``chosen`` (a name), ``trial`` (whether anything ran), ``margin``, per
    candidate its predicted and measured step, every timing (``timings_seconds``), steps timed (the timings
    ``time_plan`` returned; a run's trial, ``train.plan_trial``, puts the steps its runs' medians were taken over)
    and the rule families it stands for (or the ``error`` that stopped it: a candidate ``time_plan`` cannot run
    raises ``EmbedscaleError`` and is not chosen), the families ``left_out`` by ``max_plans``, ``rounds`` run, and
    ``trial_seconds`` (the wall time of the timing, which the run counts as its own)."""
    if int(rounds) < 1 or rerun_margin < 0:
        raise ConfigError(f"plan trial: rounds must be >= 1 and the rerun margin >= 0, got {rounds}, {rerun_margin}")
    close, left_out = trial_plans(plans, margin, limit, max_plans)
    if not close:
        raise ConfigError("plan trial: no plan to choose from")
    out: dict[str, Any] = {"margin": float(margin), "trial": len(close) > 1, "trial_seconds": 0.0,
                           "left_out": left_out, "rounds": 0,
                           "candidates": [{"name": p["name"], "predicted_seconds": float(p["predicted_seconds"]),
                                           "families": _families(p)} for p in close]}
    if len(close) == 1:
        out["chosen"] = close[0]["name"]
        return out
    t0 = time.perf_counter()
    order = list(out["candidates"])
    for r in range(int(rounds)):
        for c in order:
            _time_candidate(c, time_plan)
        out["rounds"] = r + 1
        timed = [c for c in out["candidates"] if "measured_median_seconds" in c]
        if not timed:
            raise ConfigError("plan trial: no candidate ran: " + "; ".join(f"{c['name']}: {c['error'][-300:]}"
                                                                           for c in out["candidates"]))
        best = min(c["measured_median_seconds"] for c in timed)
        near = best * (1 + rerun_margin)
        order = [c for c in reversed(order) if c.get("measured_median_seconds", math.inf) <= near]
        if len(order) < 2:
            break
    out["trial_seconds"] = time.perf_counter() - t0
    out["chosen"] = min(timed, key=lambda c: c["measured_median_seconds"])["name"]
    prediction_errors(timed)
    return out


def _time_candidate(c: dict, time_plan: Callable[[str], Sequence[float]]) -> None:
    """One more timing of candidate ``c`` (in place: ``timings_seconds``, ``steps_timed``, and its measured step, the
    median of its timings), or its ``error``."""
    try:
        steps = [float(s) for s in time_plan(c["name"])]
    except EmbedscaleError as e:  # a candidate that cannot run is not chosen; the report says why
        c["error"] = str(e)[-1000:]
        c.pop("measured_median_seconds", None)  # nor one that failed in a later round
        return
    if not steps:
        raise ConfigError(f"plan trial: plan {c['name']!r} timed no step")
    c.setdefault("timings_seconds", []).append(float(np.median(steps)))
    c["steps_timed"] = c.get("steps_timed", 0) + len(steps)
    c["measured_median_seconds"] = float(np.median(c["timings_seconds"]))


def prediction_errors(cands: Sequence[dict]) -> None:
    """The model's error on the plans a trial timed, in the run's own conditions: per candidate (``predicted_seconds``,
    ``measured_median_seconds``) ``prediction_error`` (predicted / measured - 1) and ``scaled_error``: its prediction
    times the median of measured / predicted over the other candidates, against its measurement (out of sample:
    the machine's state at the trial taken from the others, the plan's own step left out). In place."""
    ratio = [c["measured_median_seconds"] / c["predicted_seconds"] if c["predicted_seconds"] > 0 else float("nan")
             for c in cands]
    for i, c in enumerate(cands):
        c["prediction_error"] = c["predicted_seconds"] / c["measured_median_seconds"] - 1
        others = [r for j, r in enumerate(ratio) if j != i]
        c["scaled_error"] = (c["predicted_seconds"] * float(np.median(others)) / c["measured_median_seconds"] - 1
                             if others else float("nan"))  # no other candidate ran: nothing to scale by
