"""The auto planner (``plan.auto``, ``plan.autoplan``, ``plan.step``) against independent references.

- hotness on several ranks: the documented rule (a table is hot when a *global* batch, ``world`` rank
  batches, reads it at least ``hot_touch`` times per row; a row is hot when a global batch reads it at least
  ``hot_row_touch`` times), the distinct rows of a rank and of a global batch (the exact expectation
  ``sum_k 1 - (1 - p_k)^n`` written out in float64) and the rows read at least once per global batch
  (a plain count over the rows);
- the report's half / twice budget plans: a brute force over every choice of forms at that budget;
- ``best_over_kinds``: a brute force over every choice, on several hundred random cases;
- the TT lookup cost below the smallest measured rank: the documented rule (``a + b R^2`` through the two
  nearest measured ranks, never below an exact lookup) worked by hand;
- the dense-model size of tables with several features: the parameters of the built ``nn.Module``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from embedscale.data.profile import AccessProfile
from embedscale.plan.auto import (Candidate, Costs, best_over_kinds, candidates, fits, plan_seconds,
                                  search_milp, table_stats, tt_core_bytes)
from embedscale.plan.autoplan import make_auto_plan, with_topology_links
from embedscale.plan.forms import SHARDED
from embedscale.plan.step import DenseModel, default_dense
from embedscale.plan.topology import as_link_topology
from embedscale.specs import ModelConfig, TableSpec, Topology


# -- hotness on more than one rank ------------------------------------------------------------------------

def _skewed_counts(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = np.zeros(n, dtype=np.int64)
    c[:40] = rng.integers(500, 5000, 40)  # 40 hot rows
    c[40:4000] = rng.integers(1, 4, 3960)  # a cold tail; the rest never read
    return rng.permutation(c)


def _distinct(counts: np.ndarray, lookups: float) -> float:
    """Expected distinct rows of a batch of ``lookups`` draws (float64, row by row)."""
    p = counts.astype(np.float64) / counts.sum()
    return float(np.sum(1.0 - (1.0 - p) ** lookups))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_hotness_and_distinct_rows_count_the_global_batch(world):
    n, samples, batch = 20_000, 1_000, 100
    counts = _skewed_counts(n)
    tab = TableSpec("t", n, 8)
    per_sample = counts.sum() / samples
    L = per_sample * batch  # lookups per rank batch
    # the table's hotness: L / n is below hot_touch, world L / n reaches it from 2 ranks on
    hot_touch = 1.5 * L / n
    s = table_stats(tab, counts, samples, batch, world, hot_touch=hot_touch, tt_min_rows=1000, bins=0)
    assert s.lookups_rank == pytest.approx(L, rel=1e-12)
    assert s.hot == (world * L / n >= hot_touch) == (world >= 2)
    assert s.distinct_rank == pytest.approx(_distinct(counts, L), rel=1e-9)
    assert s.distinct_global == pytest.approx(_distinct(counts, world * L), rel=1e-9)
    # the rows a global batch reads at least once, on average: p_k * world * L >= 1
    p = counts / counts.sum()
    assert s.rows_read_at_least(1.0, world) == int(np.sum(p * world * L >= 1.0))
    # a hot table is never TT; on one rank the same table is compressible
    labels = [c.label for c in candidates(s, world, Costs(), tt_rank_list=(8,))]
    assert any(x.startswith("tt") for x in labels) == (world == 1), labels


def test_hot_rows_of_a_row_group_table_count_every_rank():
    """``hot_row_touch``: the rows a *global* batch reads at least that often stay exact (row groups). At 4
    ranks a row read 0.32 times per rank batch is read 1.28 times per global batch: hot."""
    n, samples, batch = 200_000, 10_000, 64
    counts = np.zeros(n, dtype=np.int64)
    counts[:10] = 1000  # read 6.4 times per rank batch (by hand below)
    counts[10:30] = 50
    counts[30:100_000] = 1
    tab = TableSpec("t", n, 8)
    total = counts.sum()
    L = total / samples * batch
    s1 = table_stats(tab, counts, samples, batch, 1, hot_touch=10.0, tt_min_rows=1000, bins=0)
    s4 = table_stats(tab, counts, samples, batch, 4, hot_touch=10.0, tt_min_rows=1000, bins=0)
    assert not s1.hot and not s4.hot
    reads_hot, reads_warm = 1000 / total * L, 50 / total * L
    assert reads_hot >= 1.0 > reads_warm and 4 * reads_warm >= 1.0  # warm rows: hot on 4 ranks only
    want1, want4 = 10, 30
    assert s1.rows_read_at_least(1.0, 1) == want1 and s4.rows_read_at_least(1.0, 4) == want4
    c4 = [c for c in candidates(s4, 4, Costs(), tt_rank_list=(8,), hot_row_touch=1.0) if c.label.startswith("tt")]
    assert [c.label for c in c4] == [f"tt-8-hot{want4}"] and c4[0].form.hot_rows == want4


# -- the report's half / twice budget plans ------------------------------------------------------------------

def _brute_force(cands, dev, host, world, costs):
    """The choice of least ``plan_seconds`` within the budgets, over every choice."""
    best = None
    for ch in itertools.product(*[range(len(c)) for c in cands]):
        if fits(cands, ch, dev, host):
            t = plan_seconds(cands, ch, world, costs)
            if best is None or t < best[0] - 1e-15:
                best = (t, ch)
    return best


def test_half_and_twice_budget_plans_are_the_optimum_at_that_budget():
    """The report's ``other_budgets`` lines are the plans at half and twice both budgets: each equals the
    brute-force optimum over every choice of forms at that budget (MILP search: exact), and they differ
    from the plan at the given budget (so a line computed at the wrong budget fails here)."""
    tabs = [TableSpec("a", 60_000, 8), TableSpec("b", 120_000, 8), TableSpec("c", 250_000, 8),
            TableSpec("d", 40_000, 8)]
    rng = np.random.default_rng(3)
    samples = 100_000
    counts = {t.name: np.maximum(rng.zipf(1.3, t.num_rows), 1).astype(np.float64) for t in tabs}
    for t in tabs:
        counts[t.name] *= samples / counts[t.name].sum()  # one lookup per sample and table
    prof = AccessProfile(counts, samples)
    topo, batch, world = Topology(ranks_per_host=2), 128, 2
    dev, host = 5.0 * 2**20, 4.2 * 2**20  # half the host budget no longer holds table b (4.1 MiB)
    given = Costs(tt_lookup_s={8: 4e-7, 16: 8e-7, 32: 1.6e-6, 64: 3.2e-6})  # TT dear: host tables pay
    plan = make_auto_plan(tabs, prof, topo, device_memory=dev, host_memory=host, costs=given, batch_size=batch,
                          search="milp", hot_row_touch=0.0)
    rep = plan.meta["auto"]
    costs = with_topology_links(given, as_link_topology(topo))
    stats = [table_stats(t, counts[t.name], samples, batch, world) for t in tabs]
    cands = [candidates(s, world, costs) for s in stats]
    got_forms = {}
    for label, f in (("half", 0.5), ("twice", 2.0)):
        alt = rep["other_budgets"][label]
        assert "error" not in alt, alt
        _, ch = _brute_force(cands, dev * f, host * f, world, costs)
        want = {tab.name: cands[i][j].label for i, (tab, j) in enumerate(zip(tabs, ch))}
        assert alt["forms"] == want, (label, alt["forms"], want)
        assert alt["device_bytes"] <= dev * f and alt["host_bytes"] <= host * f
        got_forms[label] = alt["forms"]
    main = {e["table"]: e["chosen"]["form"] for e in rep["tables"]}
    assert got_forms["half"] != main and got_forms["twice"] != main, (got_forms, main)


# -- best_over_kinds against a brute force ---------------------------------------------------------------------

KINDS = ["sharded", "replicated", "tt-8", "tt-16", "host-1", "host-2"]


def _random_kinds_case(rng):
    cands = []
    for _ in range(int(rng.integers(1, 5))):
        ks = ["sharded"] + [k for k in KINDS[1:] if rng.random() < 0.45]
        cands.append([Candidate(k, SHARDED, float(rng.uniform(1e-3, 6e-3)), float(rng.uniform(0, 100)),
                                float(rng.uniform(10, 100)) * k.startswith("host")) for k in ks])
    return cands


def test_best_over_kinds_is_the_brute_force_optimum_on_several_hundred_cases():
    """With the exact per-table search (MILP), ``best_over_kinds`` gives the least ``plan_seconds`` over every
    choice that fits (a brute force over the product of the tables' candidates), whatever the per-plan terms:
    each kind's exchange latency, the host step and the host + TT step. 200 random cases; enough of them must
    differ from the per-table optimum for the check to bite."""
    rng = np.random.default_rng(2024)
    costs = Costs(link_latency_us=600.0, executor_overhead_s={"host_step": 1.2e-3, "host_tt_step": 0.8e-3},
                  executor_world=2)
    checked = changed = 0
    for case in range(200):
        cands = _random_kinds_case(rng)
        dev, host = float(rng.uniform(30, 300)), float(rng.uniform(0, 250))
        ref = _brute_force(cands, dev, host, 2, costs)
        per_table = search_milp(cands, dev, host)
        if ref is None:
            assert per_table is None, case
            continue
        got = best_over_kinds(cands, per_table, dev, host, 2, costs, "milp")
        assert fits(cands, got, dev, host), case
        assert plan_seconds(cands, got, 2, costs) == pytest.approx(ref[0], rel=1e-9, abs=1e-15), case
        changed += plan_seconds(cands, per_table, 2, costs) > ref[0] * (1 + 1e-9)
        checked += 1
    assert checked >= 150 and changed >= 30, (checked, changed)


# -- TT cost below the smallest measured rank ----------------------------------------------------------------------

def test_tt_cost_below_the_smallest_measured_rank_follows_the_documented_rule():
    """``Costs.tt``: a rank below every measured one is on ``a + b R^2`` through the two nearest measured ranks
    (the two smallest), never below an exact lookup; with one measured rank, ``s (R / R0)^2``."""
    c = Costs(exact_lookup_s=1e-8, tt_lookup_s={8: 2e-8, 16: 3e-8, 32: 8e-8})
    b = (3e-8 - 2e-8) / (16**2 - 8**2)  # the slope in R^2 through ranks 8 and 16: 1e-8 / 192
    assert c.tt(4) == pytest.approx(2e-8 - b * (64 - 16), rel=1e-12)  # 1.75e-8
    assert c.tt(4) == pytest.approx(1.75e-8, rel=1e-12)
    assert c.tt(2) == pytest.approx(1.6875e-8, rel=1e-12)  # 2e-8 - (64 - 4) / 192 * 1e-8
    assert c.tt(8) == 2e-8 and c.tt(32) == 8e-8  # measured ranks exactly
    # never below an exact lookup
    floor = Costs(exact_lookup_s=1.8e-8, tt_lookup_s={8: 2e-8, 16: 3e-8, 32: 8e-8})
    assert floor.tt(4) == pytest.approx(1.8e-8, rel=1e-12) and floor.tt(2) == pytest.approx(1.8e-8, rel=1e-12)
    # one measured rank: quadratic from the origin, floored
    one = Costs(exact_lookup_s=1e-9, tt_lookup_s={16: 4e-8})
    assert one.tt(8) == pytest.approx(1e-8, rel=1e-12) and one.tt(2) == pytest.approx(1e-9, rel=1e-12)


def test_tt_candidate_of_an_unmeasured_small_rank_is_costed_by_the_extrapolation():
    """The plan cost of a TT table of rank 4 from costs measured at 8, 16 and 32: ``L tt(4) + cores 2 (M-1)/M
    / all-reduce bandwidth`` with ``tt(4)`` worked by hand (1.75e-8 s)."""
    costs = Costs(exact_lookup_s=1e-8, tt_lookup_s={8: 2e-8, 16: 3e-8, 32: 8e-8}, allreduce_gbs=5.0)
    n, samples, batch = 500_000, 1_000, 64
    counts = np.ones(n, dtype=np.int64)
    s = table_stats(TableSpec("t", n, 16), counts, samples, batch, 2, hot_touch=1.0, tt_min_rows=1000)
    (tt4,) = [c for c in candidates(s, 2, costs, tt_rank_list=(4,)) if c.label == "tt-4"]
    L = n / samples * batch
    want = L * 1.75e-8 + tt_core_bytes(n, 16, 4) * 2 * 0.5 / 5e9
    assert tt4.seconds == pytest.approx(want, rel=1e-9)


# -- the dense model's size with multi-feature tables --------------------------------------------------------

def _linear_parameters(module: torch.nn.Module) -> int:
    """Weights and biases of every ``nn.Linear`` of a built model, counted from the module itself."""
    return sum(p.numel() for m in module.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())


def test_dense_model_size_counts_every_feature_of_a_multi_feature_table():
    """``default_dense`` (the auto planner's dense model) over a table read by three features and one read by
    one: four embedding vectors meet in the interaction, as in the DLRM module ``build_model`` makes; its
    parameters equal the built module's linear layers' (counted from the ``nn.Module``)."""
    from embedscale.models import build_model

    tabs = [TableSpec("shared", 50, 4, features=["a", "b", "c"]), TableSpec("solo", 30, 4, features=["d"])]
    dm = default_dense(tabs)
    assert dm.num_features == 4
    model = build_model(ModelConfig(embedding_dim=4), tabs, num_dense=13)
    assert model.sparse_arch.num_features == 4
    assert dm.parameters() == _linear_parameters(model)
    # by hand: bottom 13-512-256-64-4, interaction 4 + 5*4/2 = 14, top 14-512-256-1
    layers = [(13, 512), (512, 256), (256, 64), (64, 4), (14, 512), (512, 256), (256, 1)]
    assert dm.parameters() == sum(i * o + o for i, o in layers)
    # the auto plan's report carries the same dense model
    prof = AccessProfile({"shared": np.ones(50), "solo": np.ones(30)}, 10)
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=2**20, host_memory=0,
                          batch_size=8, other_budgets=False)
    d = plan.meta["auto"]["dense_model"]
    assert d["num_features"] == 4
    assert DenseModel(**{**d, "bottom_mlp": tuple(d["bottom_mlp"]), "top_mlp": tuple(d["top_mlp"])}).parameters() \
        == _linear_parameters(model)
