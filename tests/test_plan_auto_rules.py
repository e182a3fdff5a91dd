"""The rules a user writes (EL-Rec's rule at each TT rank, the host mixtures, all sharded) as candidates of the
auto search: auto's plan is never priced above a rule's.

Reference: every rule's plan built here from its written definition and priced by a plain-Python sum of the cost
model's documented terms (``plan.auto``'s module docstring), not by the planner's functions.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from embedscale.plan.auto import BudgetError, Costs, decide, table_stats, tt_core_bytes
from embedscale.plan.autoplan import make_auto_plan
from embedscale.plan.auto_report import explain_text
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.specs import TableSpec, Topology

WORLD = 2
COSTS = Costs(executor_overhead_s={"sharded": 2e-5, "tt": 5e-5, "host": 4e-5, "host_step": 3e-4}, executor_world=2,
              link_latency_us=50.0)
TT_RANKS = (8, 16, 32, 64)  # what COSTS (the documented defaults) measured


def _ref_form(s, form: str, c: Costs = COSTS):
    """(seconds, device bytes, host bytes, kind) of table ``s`` in ``form`` by the documented sums, per rank."""
    m, frac, rb = WORLD, (WORLD - 1) / WORLD, 4 * s.dim
    full = s.num_rows * (rb + 4)
    link, ar = c.link_bandwidth_gbs * 1e9, c.allreduce_gbs * 1e9
    L, dr, dg = s.lookups_rank, s.distinct_rank, s.distinct_global
    over = c.executor_overhead_s
    if form == "sharded":
        return L * c.exact_lookup_s + 2 * dr * frac * rb / link + over["sharded"], full / m, 0.0, "sharded"
    if form == "replicated":
        return L * c.exact_lookup_s + dg * rb * 2 * frac / ar + over["sharded"], full, 0.0, "replicated"
    if form.startswith("tt-"):
        r = int(form[3:])
        cb = tt_core_bytes(s.num_rows, s.dim, r)
        return L * c.tt_lookup_s[r] + cb * 2 * frac / ar + over["tt"], cb, 0.0, "tt"
    k = int(form[5:])
    dev = min((k * dr + (k - 1) * dg) * (rb + 4), full)
    return (L * c.exact_lookup_s + (dr + dg) * c.host_row_s + 2 * dg * frac * rb / link + over["host"], dev, full,
            "host")


def _ref_plan(stats, forms: dict, c: Costs = COSTS):
    """A plan's (seconds, device, host): its tables' sums plus the latency once per kind of exchange (sharded 2,
    replicated 1, TT 1, host 2) and the host form's work per step."""
    parts = [_ref_form(s, forms.get(s.name, "sharded"), c) for s in stats]
    kinds = {p[3] for p in parts}
    n = 2 * ("sharded" in kinds) + ("replicated" in kinds) + ("tt" in kinds) + 2 * ("host" in kinds)
    secs = sum(p[0] for p in parts) + n * c.link_latency_us * 1e-6 \
        + c.executor_overhead_s["host_step"] * ("host" in kinds)
    exact = bool(kinds & {"sharded", "replicated"})
    return secs, sum(p[1] for p in parts), sum(p[2] for p in parts), exact


def _ref_rules(stats, host_budget: float, depth: int):
    """The rules as a user writes them: all sharded; for every size threshold and TT rank, EL-Rec's rule (every
    table of at least that size TT) and the mixtures (the largest of those TT until the rest fit the host, and
    one more TT)."""
    out = {"all sharded": {}}
    for n_min in {s.num_rows for s in stats}:
        big = sorted([s for s in stats if s.num_rows >= n_min], key=lambda s: s.num_rows, reverse=True)
        for r in TT_RANKS:
            out[f"elrec {n_min} {r}"] = {s.name: f"tt-{r}" for s in big}
            first = next((k for k in range(len(big))
                          if sum(s.num_rows * (4 * s.dim + 4) for s in big[k:]) <= host_budget), None)
            for k in ([] if first is None else [first, first + 1]):
                if k < len(big):
                    out[f"mix {n_min} {r} {k}"] = {**{s.name: f"tt-{r}" for s in big[:k]},
                                                   **{s.name: f"host-{depth}" for s in big[k:]}}
    return out


def _case(rng):
    n = int(rng.integers(2, 6))
    tabs = [TableSpec(f"t{i}", int(rng.integers(20_000, 400_000)), int(rng.choice([8, 16]))) for i in range(n)]
    stats = []
    for t in tabs:
        p = np.arange(1, t.num_rows + 1, dtype=np.float64) ** -float(rng.uniform(0.6, 1.3))
        counts = np.round(p / p.sum() * 2e6).astype(np.int64)
        stats.append(table_stats(t, counts, 1e6, 1024, WORLD, hot_touch=1e9, tt_min_rows=1))
    full = sum(t.num_rows * (4 * t.dim + 4) for t in tabs)
    return tabs, stats, full * float(rng.uniform(0.05, 0.6)), full * float(rng.uniform(0.0, 0.8))


def test_auto_is_never_priced_above_a_rule():
    """Random small cases, the search given only some TT ranks (16 and 64) while the calibration knows 8 to 64:
    auto's plan, priced by the reference sums, is at most every fitting rule's; without the rules some case
    must be priced above one (else the check proves nothing)."""
    rng = np.random.default_rng(3)
    checked = beaten_without = rule_won = 0
    for case in range(30):
        tabs, stats, dev, host = _case(rng)
        rules = _ref_rules(stats, host, 2)
        fitting = {k: _ref_plan(stats, f)[0] for k, f in rules.items()
                   if (lambda p: p[1] <= dev and p[2] <= host and p[3])(_ref_plan(stats, f))}
        kw = dict(costs=COSTS, tt_rank_list=(16, 64), host_depth=2, stats=stats)
        try:
            res = decide(tabs, None, 1e6, WORLD, dev, host, **kw)
        except BudgetError:
            assert not fitting, (case, fitting)  # no rule fits either
            continue
        auto = _ref_plan(stats, {n: res.chosen(i).label for i, n in enumerate(res.names)})
        assert auto[1] <= dev * (1 + 1e-9) and auto[2] <= host * (1 + 1e-9)
        assert all(auto[0] <= v * (1 + 1e-9) for v in fitting.values()), (case, auto[0], min(fitting.values()))
        rule_won += res.rule is not None
        try:
            plain = decide(tabs, None, 1e6, WORLD, dev, host, rules=False, **kw)
            p = _ref_plan(stats, {n: plain.chosen(i).label for i, n in enumerate(plain.names)})[0]
            beaten_without += p > min(fitting.values(), default=np.inf) * (1 + 1e-9)
        except BudgetError:
            beaten_without += bool(fitting)
        checked += 1
    assert checked >= 15 and beaten_without >= 3 and rule_won >= 3, (checked, beaten_without, rule_won)


def test_the_search_returns_the_rules_plan_when_it_is_best_and_the_report_names_it():
    """A hand-built case: one large table that does not fit exact, the search given TT rank 64 only; TT rank 8 is
    cheaper by the model (50 ns x (1 + 1/4) a lookup against 50 ns x (1 + 64/4)) and fits: EL-Rec's rule at rank
    8 is the plan, and the explain report says so."""
    tabs = [TableSpec("big", 2_000_000, 16), TableSpec("small", 5_000, 16)]
    prof = ZipfProfile.from_tables(tabs, alpha=0.9, samples=1_000_000)
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=8 * 2**20, host_memory=0,
                          batch_size=1024, tt_rank_list=(64,), other_budgets=False, hot_row_touch=0.0)
    assert plan.forms["big"].kind == "tt" and plan.forms["big"].tt_rank == 8
    assert plan.forms["small"].kind == "sharded"
    rep = plan.meta["auto"]
    assert rep["chosen_by"] == "rule: EL-Rec rule: tables of >= 2,000,000 rows TT rank 8"
    assert "chosen by: rule: EL-Rec rule" in explain_text(rep)
    # the search alone (no rules) keeps rank 64: the rule is what changed the plan
    plain = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=8 * 2**20, host_memory=0,
                           batch_size=1024, tt_rank_list=(64,), other_budgets=False, hot_row_touch=0.0, rules=False)
    assert plain.forms["big"].tt_rank == 64 and plain.meta["auto"]["chosen_by"] == "search"


def test_a_rules_tt_table_keeps_its_hot_rows_exact_under_the_guard():
    """Under the quality guard (rows a global batch reads at least once stay exact) a rule's TT table is row
    groups: its hot rows exact beside the cores, as the search's own TT candidates are."""
    tabs = [TableSpec("big", 2_000_000, 16), TableSpec("small", 5_000, 16)]
    prof = ZipfProfile.from_tables(tabs, alpha=1.2, samples=1_000_000)
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=16 * 2**20, host_memory=0,
                          batch_size=1024, tt_rank_list=(64,), other_budgets=False, hot_row_touch=1.0)
    f = plan.forms["big"]
    assert f.kind == "tt" and f.tt_rank == 8 and f.hot_rows > 0 and f.reorder
    # the hot rows by the documented rule: a global batch (2 x 1024 lookups) reads each at least once
    p = np.asarray(prof.sorted_counts("big"), dtype=np.float64)
    p = p / p.sum()
    assert f.hot_rows == pytest.approx(int(np.sum(p * 2 * 1024 >= 1.0)), rel=0.05, abs=2)


def _brute_force(stats, dev: float, host: float, c: Costs):
    """The cheapest plan by the documented sums (``_ref_plan``) over every form of every table (sharded, replicated,
    host, TT of every calibrated rank) that fits the budgets and keeps an exact table."""
    forms = ["sharded", "replicated", "host-2"] + [f"tt-{r}" for r in TT_RANKS]
    best = None
    for combo in itertools.product(forms, repeat=len(stats)):
        plan = dict(zip([s.name for s in stats], combo))
        secs, d, h, exact = _ref_plan(stats, plan, c)
        if d <= dev and h <= host and exact and (best is None or secs < best[0]):
            best = (secs, plan)
    return best[1]


def _big_and_small():
    tabs = [TableSpec("big", 2_000_000, 16), TableSpec("small", 5_000, 16)]
    stats = []
    for t in tabs:
        p = np.arange(1, t.num_rows + 1, dtype=np.float64) ** -0.9
        stats.append(table_stats(t, np.round(p / p.sum() * 2e6).astype(np.int64), 1e6, 1024, WORLD,
                                 hot_touch=1e9, tt_min_rows=1))
    return tabs, stats


def test_a_hand_built_case_where_a_rule_is_the_brute_force_optimum():
    """One 2M-row table that fits the 8 MiB device budget only as TT, one small table; a slow all-reduce (1 GB/s)
    makes replicating the small table dear; the search is given TT rank 64 only. A brute force over every form of
    both tables, each plan priced by the documented sums, finds EL-Rec's rule at rank 8 best (worked by hand: a
    rank-8 lookup costs 62.5 ns against 850 ns at rank 64); auto returns exactly that plan and names the rule;
    without the rules it keeps rank 64 (the rule is what changed it)."""
    tabs, stats = _big_and_small()
    slow = Costs(**{**COSTS.__dict__, "allreduce_gbs": 1.0})
    dev, host = 8 * 2**20, 0.0
    assert _brute_force(stats, dev, host, slow) == {"big": "tt-8", "small": "sharded"}
    res = decide(tabs, None, 1e6, WORLD, dev, host, costs=slow, tt_rank_list=(64,), host_depth=2, stats=stats)
    assert {n: res.chosen(i).label for i, n in enumerate(res.names)} == {"big": "tt-8", "small": "sharded"}
    assert res.rule == "EL-Rec rule: tables of >= 2,000,000 rows TT rank 8"
    plain = decide(tabs, None, 1e6, WORLD, dev, host, costs=slow, tt_rank_list=(64,), host_depth=2, stats=stats,
                   rules=False)
    assert plain.chosen(0).label == "tt-64" and plain.rule is None


def test_a_rules_plan_is_a_start_the_search_improves_to_the_brute_force_optimum():
    """The same tables with a fast all-reduce (40 GB/s): replicating the small table is cheaper than sharding it
    (the brute force says so), so the rule's plan is improved by one form change and auto returns the brute
    force's optimum, naming the rule and the change."""
    tabs, stats = _big_and_small()
    fast = Costs(**{**COSTS.__dict__, "allreduce_gbs": 40.0})
    dev, host = 8 * 2**20, 0.0
    best = _brute_force(stats, dev, host, fast)
    assert best == {"big": "tt-8", "small": "replicated"}
    res = decide(tabs, None, 1e6, WORLD, dev, host, costs=fast, tt_rank_list=(64,), host_depth=2, stats=stats)
    assert {n: res.chosen(i).label for i, n in enumerate(res.names)} == best
    assert res.rule == "EL-Rec rule: tables of >= 2,000,000 rows TT rank 8, then 1 table(s) in another form by the search"
