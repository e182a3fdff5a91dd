"""The auto planner's decision: every table's form under the budgets (:func:`decide`, an :class:`AutoResult`),
the per-table search weighed against the terms a plan pays once per kind of table (:func:`best_over_kinds`,
:func:`plan_seconds`). numpy only.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence

from embedscale.errors import ConfigError
from embedscale.plan.auto_candidates import (DEFAULT_TT_RANKS, Candidate, TableStats, candidates,
                                             table_stats)
from embedscale.plan.auto_costs import CandidateKind, Costs, exchange_latency_of
from embedscale.plan.auto_rules import best_of_rules
from embedscale.plan.auto_search import _totals, budget_error, fits, search_greedy, search_milp
from embedscale.plan.forms import TableForm


@dataclass
class AutoResult:
    """What :func:`decide` returns: per table the candidates, the choice and its stats."""

    names: list[str]
    stats: list[TableStats]
    cands: list[list[Candidate]]
    choice: list[int]
    dev_budget: float
    host_budget: float
    search: str
    search_seconds: float
    rule: str | None = None  # the rule whose plan was kept (auto_rules.best_of_rules); None: the search's
    rules: list = field(default_factory=list)  # every rule priced: name, predicted seconds, fits; lowest first

    def chosen(self, i: int) -> Candidate:
        return self.cands[i][self.choice[i]]

    @property
    def forms(self) -> dict[str, TableForm]:
        return {n: self.chosen(i).form for i, n in enumerate(self.names)}

    @property
    def replicated(self) -> list[str]:
        return [n for i, n in enumerate(self.names) if self.chosen(i).kind is CandidateKind.REPLICATED]

    def predicted_seconds(self) -> float:
        return _totals(self.cands, self.choice)[0]

    def runner_up(self, i: int) -> Candidate | None:
        """The next-best form of table ``i`` with the others fixed: the fastest alternative that keeps the
        budgets, else the fastest alternative."""
        _, d, h = _totals(self.cands, self.choice)
        cur = self.chosen(i)
        alts = [c for j, c in enumerate(self.cands[i]) if j != self.choice[i]]
        if not alts:
            return None
        ok = [c for c in alts if d - cur.device_bytes + c.device_bytes <= self.dev_budget
              and h - cur.host_bytes + c.host_bytes <= self.host_budget]
        return min(ok or alts, key=lambda c: c.seconds)


def decide(tables, counts_of, samples, world: int, device_memory: float, host_memory: float, *,
           costs: Costs | None = None, batch_size: int = 2048, tt_rank_list: Sequence[int] = DEFAULT_TT_RANKS,
           host_depth: int = 1, hot_touch: float = 0.01, tt_min_rows: int = 10_000, search: str = "greedy",
           bins: int = 2048, stats: Sequence[TableStats] | None = None,
           hot_row_touch: float = 0.0, rules: bool = True) -> AutoResult:
    """Every table's form under the budgets (per rank, bytes). ``counts_of(name)`` gives a table's per-row
    profile counts (or ``stats`` their :func:`table_stats`, computed once for several budgets). ``search``:
    ``greedy`` (default) or ``milp`` (exact, small cases). ``rules``: weigh the plans of the rules a user writes
    beside the search's and keep the cheapest (:func:`~embedscale.plan.auto_rules.best_of_rules`). Raises
    :class:`BudgetError` when nothing fits."""
    if device_memory <= 0:
        raise ConfigError(f"--device-memory must be positive, got {device_memory}")
    if host_memory < 0:
        raise ConfigError(f"--host-memory must be >= 0, got {host_memory}")
    if search not in ("greedy", "milp"):
        raise ConfigError(f"auto search {search!r} is not greedy or milp")
    costs = costs or Costs()
    tables = list(tables)
    if stats is None:
        stats = [table_stats(t, counts_of(t.name), samples, batch_size, world, hot_touch=hot_touch,
                             tt_min_rows=tt_min_rows, bins=bins) for t in tables]
    stats = list(stats)
    cands = [candidates(s, world, costs, tt_rank_list=tt_rank_list, host_depth=host_depth,
                        hot_row_touch=hot_row_touch) for s in stats]
    t0 = time.perf_counter()
    if search == "milp":
        choice = search_milp(cands, device_memory, host_memory)
        if choice is None:
            choice = search_greedy(cands, device_memory, host_memory, pairs=False)
    else:
        choice = search_greedy(cands, device_memory, host_memory)
    choice = best_over_kinds(cands, choice, device_memory, host_memory, world, costs, search)
    rule, priced = None, []
    if rules:
        choice, rule, priced = best_of_rules(cands, stats, choice, device_memory, host_memory, world, costs,
                                             tt_ranks=tt_rank_list, host_depth=host_depth,
                                             hot_row_touch=hot_row_touch)
    secs = time.perf_counter() - t0
    names = [t.name for t in tables]
    if not fits(cands, choice, device_memory, host_memory):
        raise budget_error(names, cands, choice, device_memory, host_memory)
    return AutoResult(names, stats, cands, choice, float(device_memory), float(host_memory), search, secs,
                      rule, priced)


def plan_seconds(cands, choice, world: int, costs: Costs) -> float:
    """A choice's step seconds by the model the explain report predicts (sharded rows evenly spread): its tables'
    seconds plus what a plan pays once per kind of table in it (:func:`exchange_latency_of`: each kind's
    exchange latency, the host form's work per step)."""
    kinds = [cands[i][j].kind for i, j in enumerate(choice)]
    return sum(cands[i][j].seconds for i, j in enumerate(choice)) + exchange_latency_of(kinds, world, costs)


def best_over_kinds(cands, choice, dev_budget: float, host_budget: float, world: int, costs: Costs,
                    search: str = "greedy") -> list[int]:
    """``choice`` (the per-table search's), or the best choice that leaves out some kinds of form, whichever
    costs least by :func:`plan_seconds`.

    The search sums per-table seconds; a plan also pays terms once per kind of table it holds (the all-to-alls'
    and all-reduces' latency, the host pipeline's work per step), which no per-table move sees: two host tables
    may each save less than the host form costs the plan. So the search runs again with every set of kinds
    left out (tables then choose among the rest; a set that leaves a table no form is skipped) and the choice
    of least :func:`plan_seconds` is kept. The kinds' terms only add up, so with an exact search (``milp``)
    this is the exact optimum of the whole objective (tests: a brute force over every choice)."""
    best, best_s = list(choice), plan_seconds(cands, choice, world, costs)
    if world <= 1 or not fits(cands, choice, dev_budget, host_budget):  # (no per-plan terms; or the budget error)
        return best
    present = sorted({c.kind for cs in cands for c in cs}, key=str)
    seen = set()
    for r in range(1, len(present)):
        for drop in itertools.combinations(present, r):
            keep = [[j for j, c in enumerate(cs) if c.kind not in drop] for cs in cands]
            key = tuple(tuple(k) for k in keep)
            if any(not k for k in keep) or key in seen:
                continue
            seen.add(key)
            sub = [[cands[i][j] for j in k] for i, k in enumerate(keep)]
            alt = search_milp(sub, dev_budget, host_budget) if search == "milp" else None
            if alt is None:
                alt = search_greedy(sub, dev_budget, host_budget)
            alt = [keep[i][j] for i, j in enumerate(alt)]
            if not fits(cands, alt, dev_budget, host_budget):
                continue
            t = plan_seconds(cands, alt, world, costs)
            if t < best_s:
                best, best_s = alt, t
    return best
