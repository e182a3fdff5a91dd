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
