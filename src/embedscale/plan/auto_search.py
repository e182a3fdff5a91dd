"""The auto planner's search: one candidate per table under per-rank device and host budgets, a multiple-choice
knapsack on step seconds. :func:`search_greedy` (Lagrangian starts, repaired to the budgets and improved by single
and paired changes) and :func:`search_milp` (exact, HiGHS through ``scipy.optimize.milp``, for small cases); when
nothing fits, :func:`budget_error` says by how much per tier and which tables. numpy and scipy only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.auto_candidates import Candidate
from embedscale.units import human_bytes


class BudgetError(ConfigError):
    """No assignment of forms fits the per-rank memory budgets: says by how much per tier, and which tables."""


def _totals(cands, choice) -> tuple[float, float, float]:
    t = d = h = 0.0
    for cs, j in zip(cands, choice):
        c = cs[j]
        t += c.seconds
        d += c.device_bytes
        h += c.host_bytes
    return t, d, h


def _over(d: float, h: float, dev_budget: float, host_budget: float) -> float:
    return max(0.0, d - dev_budget) / dev_budget + max(0.0, h - host_budget) / max(host_budget, 1.0)


def _arrays(cands) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seconds, device and host bytes as ``[tables, max forms]`` arrays (a missing form: infinite seconds, no
    bytes)."""
    k = max(len(cs) for cs in cands)
    out = [np.full((len(cands), k), np.inf), np.zeros((len(cands), k)), np.zeros((len(cands), k))]
    for i, cs in enumerate(cands):
        for j, c in enumerate(cs):
            out[0][i, j], out[1][i, j], out[2][i, j] = c.seconds, c.device_bytes, c.host_bytes
    return out[0], out[1], out[2]


def _repair(cands, choice, dev_budget, host_budget, arrays=None) -> list[int]:
    """Moves that remove the most over-budget (bytes over, relative to the budget, summed over tiers) per second
    they cost, until the budgets hold or no move helps."""
    sec, dev, host = arrays if arrays is not None else _arrays(cands)
    rows = np.arange(len(cands))
    ch = np.asarray(choice, dtype=np.int64).copy()
    hb = max(host_budget, 1.0)
    d, h = float(dev[rows, ch].sum()), float(host[rows, ch].sum())
    over = _over(d, h, dev_budget, host_budget)
    with np.errstate(invalid="ignore", divide="ignore"):
        while over > 0:
            nd = d - dev[rows, ch][:, None] + dev
            nh = h - host[rows, ch][:, None] + host
            gain = over - (np.maximum(0.0, nd - dev_budget) / dev_budget + np.maximum(0.0, nh - host_budget) / hb)
            ok = np.isfinite(sec) & (gain > 1e-15)
            if not ok.any():
                break
            key = np.where(ok, (np.where(ok, sec, 0.0) - sec[rows, ch][:, None]) / np.where(ok, gain, 1.0), np.inf)
            i, j = np.unravel_index(int(np.argmin(key)), key.shape)
            d, h = float(nd[i, j]), float(nh[i, j])
            ch[i] = j
            over = _over(d, h, dev_budget, host_budget)
    return [int(x) for x in ch]


def improve(cands, choice, dev_budget, host_budget, pairs: bool) -> list[int]:
    """Take the single move, then (``pairs``) the pair of moves, that saves the most seconds within the
    budgets, until none does."""
    choice = list(choice)
    n = len(cands)
    _, d, h = _totals(cands, choice)
    while True:
        best, best_save = None, 1e-12 * max(1e-30, _totals(cands, choice)[0])
        for i, cs in enumerate(cands):
            cur = cs[choice[i]]
            for j, c in enumerate(cs):
                save = cur.seconds - c.seconds
                if j != choice[i] and save > best_save and d - cur.device_bytes + c.device_bytes <= dev_budget \
                        and h - cur.host_bytes + c.host_bytes <= host_budget:
                    best, best_save = [(i, j)], save
        if best is None and pairs:
            for i in range(n):
                ci = cands[i][choice[i]]
                for j, a in enumerate(cands[i]):
                    if j == choice[i]:
                        continue
                    d1, h1 = d - ci.device_bytes + a.device_bytes, h - ci.host_bytes + a.host_bytes
                    s1 = ci.seconds - a.seconds
                    for i2 in range(i + 1, n):
                        ck = cands[i2][choice[i2]]
                        for j2, b in enumerate(cands[i2]):
                            if j2 == choice[i2]:
                                continue
                            save = s1 + ck.seconds - b.seconds
                            if save > best_save and d1 - ck.device_bytes + b.device_bytes <= dev_budget \
                                    and h1 - ck.host_bytes + b.host_bytes <= host_budget:
                                best, best_save = [(i, j), (i2, j2)], save
        if not best:
            return choice
        for i, j in best:
            cur, c = cands[i][choice[i]], cands[i][j]
            choice[i] = j
            d, h = d - cur.device_bytes + c.device_bytes, h - cur.host_bytes + c.host_bytes


def search_greedy(cands: Sequence[Sequence[Candidate]], dev_budget: float, host_budget: float,
                  pairs: bool = True, multipliers: int = 13) -> list[int]:
    """A feasible choice (index per table) of low total seconds, or the least-over one (see :func:`fits`).

    Lagrangian starts: for multipliers ``(a, b)`` on a grid, every table takes the form minimising
    ``seconds + a * device_bytes / device_budget + b * host_bytes / host_budget`` (``a = b = 0``: the fastest
    form); each start is repaired (:func:`_repair`: the moves that remove the most over-budget per second lost)
    and improved by single moves; the best is then improved by single and paired moves (:func:`improve`)."""
    fastest = [int(np.argmin([c.seconds for c in cs])) for cs in cands]
    scale = max(_totals(cands, fastest)[0], 1e-30)
    grid = [0.0] + list(scale * np.geomspace(1e-3, 1e2, max(1, multipliers - 1)))
    has_host = any(c.host_bytes > 0 for cs in cands for c in cs)
    hb = max(host_budget, 1.0)
    arrays = _arrays(cands)
    sec, dev, host = arrays
    best, best_key, tried = None, None, set()
    for a in grid:
        for b in (grid if has_host else [0.0]):
            start = tuple(int(x) for x in np.argmin(sec + a * dev / dev_budget + b * host / hb, axis=1))
            if start in tried:
                continue
            tried.add(start)
            ch = _repair(cands, start, dev_budget, host_budget, arrays)
            t, d, h = _totals(cands, ch)
            over = _over(d, h, dev_budget, host_budget)
            if over == 0:
                ch = improve(cands, ch, dev_budget, host_budget, pairs=False)
                t = _totals(cands, ch)[0]
            key = (over, t)
            if best_key is None or key < best_key:
                best, best_key = ch, key
    if best_key[0] > 0:
        return best
    return improve(cands, best, dev_budget, host_budget, pairs=pairs)


def search_milp(cands: Sequence[Sequence[Candidate]], dev_budget: float, host_budget: float,
                time_limit: float = 60.0) -> list[int] | None:
    """The exact optimum of the same model (a multiple-choice knapsack with two budgets) by HiGHS; ``None``
    when infeasible."""
    sizes = [len(cs) for cs in cands]
    nv = sum(sizes)
    flat = [c for cs in cands for c in cs]
    scale = max(max(c.seconds for c in flat), 1e-30)
    cost = np.array([c.seconds / scale for c in flat])
    a = np.zeros((len(cands) + 2, nv))
    at = 0
    for i, k in enumerate(sizes):
        a[i, at:at + k] = 1.0
        at += k
    a[-2] = [c.device_bytes / dev_budget for c in flat]
    a[-1] = [c.host_bytes / max(host_budget, 1.0) for c in flat]
    lo = np.r_[np.ones(len(cands)), -np.inf, -np.inf]
    hi = np.r_[np.ones(len(cands)), 1.0, host_budget / max(host_budget, 1.0)]
    from scipy.optimize import Bounds, LinearConstraint, milp  # scipy on first use: a training rank never searches

    res = milp(cost, constraints=LinearConstraint(a, lo, hi), integrality=np.ones(nv), bounds=Bounds(0, 1),
               options={"time_limit": time_limit, "mip_rel_gap": 1e-9})
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    out, at = [], 0
    for k in sizes:
        out.append(int(np.argmax(x[at:at + k])))
        at += k
    return out


def fits(cands, choice, dev_budget: float, host_budget: float) -> bool:
    _, d, h = _totals(cands, choice)
    return d <= dev_budget and h <= host_budget


def budget_error(names: Sequence[str], cands, choice, dev_budget: float, host_budget: float) -> BudgetError:
    """The error for a choice that does not fit: bytes over per tier; the tables that could not be placed (the
    smallest footprints of the largest tables, enough of them to cover the overflow)."""
    _, d, h = _totals(cands, choice)
    over_d, over_h = max(0.0, d - dev_budget), max(0.0, h - host_budget)
    order = sorted(range(len(names)), key=lambda i: -(cands[i][choice[i]].device_bytes * (over_d > 0)
                                                      + cands[i][choice[i]].host_bytes * (over_h > 0)))
    left_d, left_h, unplaced = over_d, over_h, []
    for i in order:
        if left_d <= 0 and left_h <= 0:
            break
        c = cands[i][choice[i]]
        unplaced.append(f"{names[i]} (smallest: {c.label}, {human_bytes(c.device_bytes)} device, {human_bytes(c.host_bytes)} host)")
        left_d -= c.device_bytes
        left_h -= c.host_bytes
    parts = []
    if over_d > 0:
        parts.append(f"device memory over by {human_bytes(over_d)} per rank (needs {human_bytes(d)}, budget {human_bytes(dev_budget)})")
    if over_h > 0:
        parts.append(f"host memory over by {human_bytes(over_h)} per rank (needs {human_bytes(h)}, budget {human_bytes(host_budget)})")
    return BudgetError("no plan fits the memory budget: " + "; ".join(parts) + ". Tables that could not be placed: "
                       + ", ".join(unplaced) + ". Raise --device-memory / --host-memory or add ranks")
