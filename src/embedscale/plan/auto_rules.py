"""The plans a user writes by hand, weighed by the auto planner beside its search's (numpy only).

The search (:mod:`~embedscale.plan.auto_search`) chooses each table's form among the candidates the planner
generates; a rule a user would write may still be priced lower by the same model (a TT rank the search was
not given, a mixture the greedy search did not reach). So :func:`best_of_rules` prices every rule's plan with
the model the search optimises (:func:`embedscale.plan.step.candidate_of` per table, plus the terms a plan pays
once per kind of table, :func:`~embedscale.plan.auto_costs.exchange_latency_of`) and takes the lowest one that
fits the budgets when it beats the search's: auto never chooses a plan its own model prices worse than a rule.

The rules (:func:`rule_plans`), for every TT rank the calibration measured (and the search's ranks), and every
size threshold ``N`` (each distinct table size):

* ``all sharded exact``: every table's rows exact, placed by OPER (sections 4.1-4.2);
* EL-Rec's rule (EL-Rec section VI-A): every table of at least ``N`` rows TT of rank ``R``, the rest sharded;
* the host mixtures (EL-Rec sections V and VI-A together): the tables of at least ``N`` rows, largest first,
  TT of rank ``R`` until the others fit the host budget on the host parameter server, and with one more TT.

Under the planner's quality guard (``guard``, the default) a rule's TT table keeps what the search keeps exact:
a hot table stays sharded, and the rows a global batch reads at least ``hot_row_touch`` times stay exact
beside its TT cores (row groups); with ``guard=False`` the rules are taken as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from embedscale.plan.auto_candidates import MAX_HOT_ROW_SHARE, STATE_BYTES_PER_ROW, Candidate, TableStats
from embedscale.plan.auto_costs import CandidateKind, Costs, exchange_latency_of
from embedscale.plan.auto_search import improve
from embedscale.plan.forms import SHARDED, FormKind, TableForm
from embedscale.plan.step import candidate_of


@dataclass(frozen=True)
class RulePlan:
    """A rule's plan: its name for people, the form of every table it does not leave sharded, and its family (the
    rule with its size threshold left open: ``EL-Rec rule, TT rank 8``; a measured choice times each family's
    best, ``plan.choose.trial_plans``)."""

    name: str
    forms: dict = field(default_factory=dict)  # table name -> TableForm
    family: str = ""


def _tt(rank: int) -> TableForm:
    return TableForm(FormKind.TT, tt_rank=int(rank))


def rule_plans(stats: Sequence[TableStats], host_budget: float, tt_ranks: Sequence[int],
               host_depth: int = 1) -> list[RulePlan]:
    """Every rule's plan for tables ``stats`` (module docstring); a mixture only where its host tables fit
    ``host_budget`` (their rows and row-wise state, per rank)."""
    out = [RulePlan("all sharded exact", family="all sharded exact")]
    host = TableForm(FormKind.HOST, pipeline_depth=max(1, int(host_depth)))
    for n_min in sorted({int(s.num_rows) for s in stats}, reverse=True):
        big = sorted([s for s in stats if s.num_rows >= n_min], key=lambda s: -s.num_rows)
        for r in sorted({int(x) for x in tt_ranks}):
            out.append(RulePlan(f"EL-Rec rule: tables of >= {n_min:,} rows TT rank {r}",
                                {s.name: _tt(r) for s in big}, f"EL-Rec rule, TT rank {r}"))
            for k in range(len(big)):
                rest = big[k:]
                if sum(s.num_rows * (s.row_bytes + STATE_BYTES_PER_ROW) for s in rest) > host_budget:
                    continue
                for j in (k, k + 1):
                    if j == 0 and r == min(int(x) for x in tt_ranks):  # no TT table: one rule, whatever the rank
                        out.append(RulePlan(f"host rule: the {len(big)} tables of >= {n_min:,} rows on the host",
                                            {s.name: host for s in big}, "host rule"))
                    elif 0 < j < len(big):
                        out.append(RulePlan(f"mixture: the {j} largest of >= {n_min:,} rows TT rank {r}, "
                                            f"{len(big) - j} on the host",
                                            {**{s.name: _tt(r) for s in big[:j]},
                                             **{s.name: host for s in big[j:]}}, f"mixture, TT rank {r}"))
                break
    return out


def guarded(form: TableForm, s: TableStats, world: int, hot_row_touch: float) -> TableForm:
    """``form`` under the quality guard: a TT form of a hot table (or of one that does not pool, or whose hot rows
    are more than ``MAX_HOT_ROW_SHARE`` of it) is sharded; a TT form of a table with rows a global batch reads at
    least ``hot_row_touch`` times keeps them exact (row groups)."""
    if form.kind != "tt":
        return form
    if s.hot or s.pooling == "none":
        return SHARDED
    hot = s.rows_read_at_least(hot_row_touch, world) if hot_row_touch > 0 else 0
    if hot > MAX_HOT_ROW_SHARE * s.num_rows:
        return SHARDED
    return replace(form, hot_rows=int(hot), reorder=True) if hot else form


def price_rule(rule: RulePlan, stats: Sequence[TableStats], world: int, costs: Costs, host_depth: int = 1,
               guard: bool = True, hot_row_touch: float = 0.0,
               memo: dict | None = None) -> tuple[list[Candidate], float]:
    """A rule's plan costed per table (the search's model) and its step seconds (:func:`plan_seconds`'s terms).
    ``memo``: candidates already costed, by table and form (the rules share most of their forms)."""
    cs, memo = [], {} if memo is None else memo
    for s in stats:
        f = rule.forms.get(s.name, SHARDED)
        f = guarded(f, s, world, hot_row_touch) if guard else f
        if (s.name, f) not in memo:
            memo[s.name, f] = candidate_of(s, f, world, costs, host_depth)
        cs.append(memo[s.name, f])
    return cs, float(sum(c.seconds for c in cs)) + exchange_latency_of([c.kind for c in cs], world, costs)


def _forms_of(stats, cs) -> dict:
    """A plan's forms for people (``forms``: labels) and for building it (``table_forms``), sharded tables left
    out."""
    kept = [(s, c) for s, c in zip(stats, cs) if c.kind is not CandidateKind.SHARDED]
    return {"forms": {s.name: c.label for s, c in kept}, "table_forms": {s.name: c.form.to_dict() for s, c in kept}}


def best_of_rules(cands: list[list[Candidate]], stats: Sequence[TableStats], choice: Sequence[int],
                  dev_budget: float, host_budget: float, world: int, costs: Costs, *, tt_ranks: Sequence[int],
                  host_depth: int = 1, guard: bool = True,
                  hot_row_touch: float = 0.0) -> tuple[list[int], str | None, list[dict]]:
    """The search's ``choice``, or the plan of the rule its model prices lowest when that one fits the budgets
    and costs less by :func:`~embedscale.plan.auto_decide.plan_seconds` (or the search's does not fit). Returns
    the choice (a rule's forms the candidates lack are appended to ``cands``), the winning rule's name (``None``: the search's plan) and
    every rule priced (name, seconds, fits, forms), lowest first after the search's own plan (``rule`` "search")."""
    chosen = [cands[i][j] for i, j in enumerate(choice)]
    base = float(sum(c.seconds for c in chosen)) + exchange_latency_of([c.kind for c in chosen], world, costs)
    if sum(c.device_bytes for c in chosen) > dev_budget or sum(c.host_bytes for c in chosen) > host_budget:
        base = float("inf")  # the search found no plan that fits: any rule's that does is better
    priced, best, memo = [], None, {}
    ranks = sorted({int(r) for r in tt_ranks} | {int(r) for r in costs.tt_lookup_s})
    for rule in rule_plans(stats, host_budget, ranks, host_depth):
        cs, secs = price_rule(rule, stats, world, costs, host_depth, guard, hot_row_touch, memo)
        dev, host = sum(c.device_bytes for c in cs), sum(c.host_bytes for c in cs)
        exact = any(c.kind in (CandidateKind.SHARDED, CandidateKind.REPLICATED) for c in cs)  # (OPER needs one)
        ok = dev <= dev_budget and host <= host_budget and exact
        priced.append({"rule": rule.name, "family": rule.family, "predicted_seconds": secs, "fits": bool(ok),
                       **_forms_of(stats, cs)})
        if ok and secs < base * (1 - 1e-12) and (best is None or secs < best[1]):
            best = (rule, secs, cs)
    priced.sort(key=lambda r: (not r["fits"], r["predicted_seconds"]))
    priced.insert(0, {"rule": "search", "family": "search", "predicted_seconds": base, "fits": base < float("inf"),
                      **_forms_of(stats, chosen)})  # the search's own plan (a measured choice may take it)
    if best is None:
        return list(choice), None, priced
    out = []
    for i, c in enumerate(best[2]):
        j = next((j for j, x in enumerate(cands[i]) if x.label == c.label and x.kind is c.kind), None)
        if j is None:
            cands[i].append(c)
            j = len(cands[i]) - 1
        out.append(j)
    return _improved(cands, out, best[0].name, dev_budget, host_budget, world, costs) + (priced,)


def reported_rules(priced: Sequence[dict], n: int = 12) -> list[dict]:
    """The rules an explain report keeps of :func:`best_of_rules`' ``priced`` (lowest first): the ``n`` first, and
    the lowest-priced fitting plan of every family beyond them (a measured choice may time it,
    ``plan.choose.trial_plans``)."""
    out = list(priced[:n])
    have = {r.get("family") for r in out if r["fits"]}
    for r in priced[n:]:
        if r["fits"] and r.get("family") and r["family"] not in have:
            have.add(r["family"])
            out.append(r)
    return out


def _improved(cands, choice: list[int], name: str, dev_budget: float, host_budget: float, world: int,
              costs: Costs) -> tuple[list[int], str]:
    """A rule's ``choice`` improved by the search's single and paired form changes within the budgets
    (:func:`~embedscale.plan.auto_search.improve`), kept when the whole plan's seconds (the terms a plan pays once
    per kind of table included) fall: a rule's plan is a start, not a ceiling (one table of the rule in another
    form may be cheaper still). The name says how many tables changed."""
    def secs(ch):
        cs = [cands[i][j] for i, j in enumerate(ch)]
        return float(sum(c.seconds for c in cs)) + exchange_latency_of([c.kind for c in cs], world, costs)

    better = improve(cands, choice, dev_budget, host_budget, pairs=True)
    exact = any(cands[i][j].kind in (CandidateKind.SHARDED, CandidateKind.REPLICATED) for i, j in enumerate(better))
    changed = sum(a != b for a, b in zip(better, choice))
    if changed and exact and secs(better) < secs(choice) * (1 - 1e-12):
        return better, f"{name}, then {changed} table(s) in another form by the search"
    return list(choice), name
