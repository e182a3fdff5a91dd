"""``plan --strategy auto`` : miss-ratio curves, the search under budgets, the explain
report, the calibration, and an auto plan trained on 2 ranks.

References: the miss-ratio formulas against a Monte-Carlo count of distinct rows, the life-cycle cache
(``pipeline/cache.py``) run on a synthetic Zipf stream and a brute-force LRU; the greedy search against the
MILP optimum (HiGHS), the MILP against enumeration; the 2-rank run of an auto plan (sharded, TT and host
tables) against one process training the same model (TT table configured, host table on the device).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from embedscale import workflow
from embedscale.calibrate import calibrate
from embedscale.calibrate_ranks import calibrate_ranks, plan_forms, refit
from embedscale.data.profile import AccessProfile
from embedscale.errors import ConfigError
from embedscale.pipeline.cache import LifeCycleCache
from embedscale.plan.auto import (BudgetError, Candidate, Costs, TableStats, best_over_kinds, candidates, decide,
                                  fits, load_costs, parse_bytes, plan_seconds, search_greedy, search_milp,
                                  tt_core_bytes)
from embedscale.plan.autoplan import make_auto_plan, predict_plan_forms
from embedscale.plan.step import DenseModel, fit_executor, fit_executor_overheads, form_counts, predict_forms
from embedscale.plan.forms import SHARDED, TableForm, host_pipeline_depth, tables_from_profile
from embedscale.plan.mrc import MissRatioCurve
from embedscale.plan.plan import Plan
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.specs import RunConfig, TableConfig, TableSpec, Topology, dump_config, from_dict, to_dict
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.distributed import check_auto_settings, check_forms_kept
from embedscale.train.launch import spawn_local

from test_distributed_train import ROWS, STEPS, make_data

SRC = Path(__file__).resolve().parents[1] / "src"


def zipf_probabilities(n: int, alpha: float, seed: int = 0) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return np.random.default_rng(seed).permutation(p / p.sum())


# -- miss-ratio curves ------------------------------------------------------------------------------------

def test_distinct_rows_per_batch_match_monte_carlo():
    rng = np.random.default_rng(1)
    p = zipf_probabilities(5000, 1.1)
    counts = np.round(p * 1e6).astype(np.int64)
    mrc = MissRatioCurve.from_counts(counts, 512, bins=0)
    pe = counts / counts.sum()
    sim = [np.unique(rng.choice(p.size, 512, p=pe)).size for _ in range(400)]
    assert abs(mrc.distinct() - np.mean(sim)) < 0.02 * np.mean(sim)
    binned = MissRatioCurve.from_counts(counts, 512, bins=2048)
    assert abs(binned.distinct() - mrc.distinct()) < 1e-3 * mrc.distinct()
    assert binned.window_hit_ratio(3) == pytest.approx(mrc.window_hit_ratio(3), abs=1e-3)


@pytest.mark.parametrize("window", [1, 3])
def test_window_hit_ratio_matches_the_life_cycle_cache(window):
    """The life-cycle cache holding the rows of the last ``window`` batches, run on a Zipf stream: the share of
    a batch's distinct rows it patches equals ``MissRatioCurve.window_hit_ratio``."""
    rng = np.random.default_rng(2)
    n, lookups, batches = 3000, 256, 300
    p = zipf_probabilities(n, 1.05, seed=3)
    cache = LifeCycleCache([1], device="cpu")
    hits = distinct = 0
    for t in range(batches):
        rows = torch.from_numpy(np.unique(rng.choice(n, lookups, p=p)))
        cache.advance(t)
        if t >= window:
            assert cache.num_entries == window
            w = torch.zeros(rows.numel(), 1)
            cache.patch(0, rows, w)
            hits += int((w[:, 0] > 0).sum())  # each patched row once, however many entries held it
            distinct += rows.numel()
        cache.insert(t, [rows], [torch.ones(rows.numel(), 1)], [None], life=window + 1)
    counts = np.round(p * 1e7).astype(np.int64)
    want = MissRatioCurve.from_counts(counts, lookups, bins=0).window_hit_ratio(window)
    assert hits / distinct == pytest.approx(want, abs=0.02)


def test_lru_miss_ratio_matches_a_simulated_lru():
    rng = np.random.default_rng(4)
    n, lookups = 4000, 200
    p = zipf_probabilities(n, 1.0, seed=5)
    mrc = MissRatioCurve.from_counts(np.round(p * 1e7).astype(np.int64), lookups, bins=0)
    for c in (100, 800):
        lru: OrderedDict = OrderedDict()
        miss = seen = 0
        for t in range(500):
            rows = np.unique(rng.choice(n, lookups, p=p))
            if t >= 100:
                miss += sum(1 for r in rows if r not in lru)
                seen += rows.size
            for r in rows:
                lru[r] = True
                lru.move_to_end(r)
            while len(lru) > c:
                lru.popitem(last=False)
        assert mrc.lru_miss_ratio(c) == pytest.approx(miss / seen, abs=0.04), c
    assert mrc.lru_miss_ratio(0) == 1.0 and mrc.lru_miss_ratio(10 * n) == 0.0


# -- the search ----------------------------------------------------------------------------------------

def _random_case(rng, n_tables):
    cands = []
    for _ in range(n_tables):
        k = int(rng.integers(2, 5))
        cands.append([Candidate(f"f{j}", SHARDED, float(rng.uniform(1, 10)), float(rng.uniform(0, 100)),
                                float(rng.uniform(0, 100)) * (rng.random() < 0.5)) for j in range(k)])
    return cands


def _brute_force(cands, dev, host):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in cands]):
        cs = [cands[i][j] for i, j in enumerate(choice)]
        if sum(c.device_bytes for c in cs) <= dev and sum(c.host_bytes for c in cs) <= host:
            t = sum(c.seconds for c in cs)
            if best is None or t < best[0]:
                best = (t, list(choice))
    return best


def test_greedy_within_2_percent_of_the_milp_optimum():
    rng = np.random.default_rng(6)
    checked = 0
    for case in range(40):
        cands = _random_case(rng, int(rng.integers(3, 7)))
        dev, host = float(rng.uniform(80, 250)), float(rng.uniform(50, 200))
        ref = _brute_force(cands, dev, host)
        exact = search_milp(cands, dev, host)
        if ref is None:
            assert exact is None
            continue
        t_exact = sum(cands[i][j].seconds for i, j in enumerate(exact))
        assert t_exact == pytest.approx(ref[0], rel=1e-9), case
        g = search_greedy(cands, dev, host)
        cs = [cands[i][j] for i, j in enumerate(g)]
        assert sum(c.device_bytes for c in cs) <= dev and sum(c.host_bytes for c in cs) <= host, case
        assert sum(c.seconds for c in cs) <= 1.02 * t_exact, case
        checked += 1
    assert checked >= 20


def test_search_weighs_the_terms_a_plan_pays_once_per_kind_of_table():
    """A plan pays some terms once per kind of table in it (each kind's exchange latency, the host form's work
    per step: ``plan_seconds``), which per-table moves do not see. ``best_over_kinds`` over the MILP's choice is
    the optimum of the whole objective (a brute force over every choice, independent of the search), and over
    the greedy's within 2%; some cases must change the per-table optimum for the check to mean something."""
    rng = np.random.default_rng(11)
    kinds = ["sharded", "replicated", "tt-8", "host-2"]
    costs = Costs(link_latency_us=800.0, executor_overhead_s={"host_step": 1.5e-3}, executor_world=2)
    checked = changed = 0
    for case in range(40):
        cands = [[Candidate(k, SHARDED, float(rng.uniform(1e-3, 6e-3)), float(rng.uniform(0, 100)),
                            float(rng.uniform(20, 100)) * (k.startswith("host")))
                  for k in kinds if k == "sharded" or rng.random() < 0.8] for _ in range(int(rng.integers(2, 6)))]
        dev, host = float(rng.uniform(60, 250)), float(rng.uniform(0, 200))
        best = None
        for choice in itertools.product(*[range(len(c)) for c in cands]):
            if fits(cands, choice, dev, host):
                t = plan_seconds(cands, choice, 2, costs)
                best = t if best is None else min(best, t)
        if best is None:
            continue
        per_table = search_milp(cands, dev, host)
        exact = best_over_kinds(cands, per_table, dev, host, 2, costs, "milp")
        assert fits(cands, exact, dev, host) and plan_seconds(cands, exact, 2, costs) == pytest.approx(best, rel=1e-9)
        changed += plan_seconds(cands, per_table, 2, costs) > best * (1 + 1e-9)
        g = best_over_kinds(cands, search_greedy(cands, dev, host), dev, host, 2, costs)
        assert fits(cands, g, dev, host) and plan_seconds(cands, g, 2, costs) <= 1.02 * best, case
        checked += 1
    assert checked >= 20 and changed >= 5, (checked, changed)


def _criteo_like():
    rows = [1_460, 583, 10_131_227, 2_202_608, 305, 24, 12_517, 633, 3, 93_145, 5_683, 8_351_593, 3_194, 27,
            14_992, 5_461_306, 10, 5_652, 2_173, 4, 7_046_547, 18, 15, 286_181, 105, 142_572]
    tabs = [TableSpec(f"t{i}", r, 16) for i, r in enumerate(rows)]
    return tabs, ZipfProfile.from_tables(tabs, alpha=1.1, samples=1_000_000)


def test_auto_plan_fits_keeps_hot_tables_exact_and_records_tt_ranks():
    tabs, prof = _criteo_like()
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=256 * 2**20,
                          host_memory=512 * 2**20, batch_size=2048)
    rep = plan.meta["auto"]
    forms = plan.forms
    assert sorted(forms) == sorted(t.name for t in tabs)
    kinds = {f.kind for f in forms.values()}
    assert "tt" in kinds or "host" in kinds  # 33.8M rows x 68 B do not fit 256 MiB exact
    rows = {t.name: t.num_rows for t in tabs}
    for e in rep["tables"]:
        # hot by the documented rule, not the report's flag: fewer rows than tt_min_rows (10k), or a global batch
        # (2 ranks x 2048 samples, one lookup each) reads the table at least hot_touch (0.01) times per row
        n = rows[e["table"]]
        hot = n < 10_000 or 2 * 2048 * prof.total(e["table"]) / 1_000_000 / n >= 0.01
        assert e["hot"] == hot, e
        if hot:
            assert forms[e["table"]].kind != "tt", e
        if forms[e["table"]].kind == "tt":
            assert forms[e["table"]].tt_rank in (8, 16, 32, 64)
            f = forms[e["table"]]  # a whole TT table, or row groups: hot rows exact, the rest TT
            assert e["chosen"]["form"] == f"tt-{f.tt_rank}" + (f"-hot{f.hot_rows}" if f.hot_rows else "")
            assert f.reorder == bool(f.hot_rows)
    assert max(rep["per_rank"]["device_total"]) <= 256 * 2**20
    assert max(rep["per_rank"]["host_bytes"]) <= 512 * 2**20
    assert set(rep["other_budgets"]) == {"half", "twice"}


def test_saved_auto_plan_loads_with_its_forms(tmp_path):
    tabs, prof = _criteo_like()
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=256 * 2**20,
                          host_memory=512 * 2**20, other_budgets=False)
    plan.save(tmp_path / "p")
    back = Plan.load(tmp_path / "p")
    assert back.forms == plan.forms and back.meta["strategy"] == "auto"
    repl = plan.meta["auto"]["tables"]
    for e in repl:  # a replicated table is held by every rank
        if e["chosen"]["form"] == "replicated":
            assert back.holders[back.table_partitions(e["table"])].all()


def test_budget_too_small_is_a_named_error():
    tabs, prof = _criteo_like()
    with pytest.raises(BudgetError, match=r"device memory over by .* per rank.*could not be placed: t"):
        make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=64 * 2**10, host_memory=0,
                       other_budgets=False)


def test_tt_lookup_costs_are_taken_non_decreasing_in_the_rank():
    """A loaded machine measured rank 16 dearer than rank 32: pooled by hand, both are their mean, 15 us; rank 24
    between them is 15 us too; ranks 8 and 64 keep their figures. A run of three falling figures pools all three
    (10, 9, 8 -> 9). Figures that already rise are kept as measured."""
    c = Costs(exact_lookup_s=1e-6, tt_lookup_s={8: 7e-6, 16: 16e-6, 32: 14e-6, 64: 39e-6})
    assert c.tt(16) == pytest.approx(15e-6, rel=1e-12) and c.tt(32) == pytest.approx(15e-6, rel=1e-12)
    assert c.tt(24) == pytest.approx(15e-6, rel=1e-12)
    assert c.tt(8) == 7e-6 and c.tt(64) == 39e-6
    three = Costs(exact_lookup_s=1e-6, tt_lookup_s={8: 10e-6, 16: 9e-6, 32: 8e-6, 64: 20e-6})
    assert [three.tt(r) for r in (8, 16, 32)] == [pytest.approx(9e-6, rel=1e-12)] * 3 and three.tt(64) == 20e-6
    rising = {8: 4.737e-6, 16: 5.579e-6, 32: 6.897e-6, 64: 19.98e-6}
    assert {r: Costs(tt_lookup_s=rising).tt(r) for r in rising} == rising
    assert Costs(tt_lookup_s={8: 7e-6, 16: 16e-6, 32: 14e-6}).tt_lookup_s[16] == 16e-6  # the file keeps what it measured


def test_costs_file_round_trip_and_errors(tmp_path):
    c = Costs(exact_lookup_s=1e-8, tt_lookup_s={8: 2e-8, 32: 8e-8}, source="measured")
    c.save(tmp_path / "c.json")
    back = load_costs(tmp_path / "c.json")
    assert back.tt_lookup_s == {8: 2e-8, 32: 8e-8} and back.source == "measured"
    assert back.tt(16) == pytest.approx(2e-8 + (8e-8 - 2e-8) * (256 - 64) / (1024 - 64))
    (tmp_path / "bad.json").write_text(json.dumps({**c.to_dict(), "host_row_s": -1}))
    with pytest.raises(ConfigError, match="bad.json.*host_row_s"):
        load_costs(tmp_path / "bad.json")
    assert parse_bytes("256MiB") == 256 * 2**20 and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(ConfigError, match="--device-memory"):
        parse_bytes("lots", "--device-memory")


def test_costs_files_without_the_step_terms_load_with_their_defaults(tmp_path):
    d = Costs(exact_lookup_s=1e-8, dense_flops_per_s=3e10, step_overhead_s=1e-3, table_overhead_s=2e-5).to_dict()
    c = Costs.from_dict(d)
    assert (c.dense_flops_per_s, c.step_overhead_s, c.table_overhead_s) == (3e10, 1e-3, 2e-5)
    old = {k: v for k, v in d.items() if k not in ("dense_flops_per_s", "step_overhead_s", "table_overhead_s")}
    assert Costs.from_dict(old).dense_flops_per_s == Costs().dense_flops_per_s
    with pytest.raises(ConfigError, match="where.*step_overhead_s"):
        Costs.from_dict({**d, "step_overhead_s": -1.0}, "where")
    with pytest.raises(ConfigError, match="dense_flops_per_s"):
        Costs.from_dict({**d, "dense_flops_per_s": 0})


def test_calibrate_measures_every_cost():
    c = calibrate(device="cpu", rows=2000, dim=4, batch=256, tt_ranks=(2, 4), repeats=1)
    assert c.source == "measured" and sorted(c.tt_lookup_s) == [2, 4]
    assert c.exact_lookup_s > 0 and c.host_row_s > 0 and all(v > 0 for v in c.tt_lookup_s.values())
    assert 0 < c.notes["distinct_rows_per_batch"] <= 256
    by_rank = c.notes["tt_replica_factor_by_rank"]  # the replica path timed at every rank, its median kept
    assert set(by_rank) == {"2", "4"} and c.tt_replica_factor == pytest.approx(float(np.median(list(by_rank.values()))))
    assert c.dense_flops_per_s > 1e6 and c.step_overhead_s >= 0 and c.table_overhead_s >= 0
    assert c.notes["threads"] == 1 and set(c.notes["model_step_s"]) == {"6", "26"}  # 26 features and a quarter
    assert torch.get_num_threads() >= 1  # restored


# -- the predicted step: a hand computation from the calibrated constants ------------------------------------

def test_dense_model_flops_and_parameters_by_hand():
    """DLRM 3 -> [4] -> 2 (bottom), 2 features of dim 2: interaction width 2 + 3*2/2 = 5, top 5 -> [5] -> 1."""
    m = DenseModel(dense_in=3, num_features=2, embedding_dim=2, bottom_mlp=(4,), top_mlp=(5,))
    assert m.linear_layers() == [(3, 4), (4, 2), (5, 5), (5, 1)]
    assert m.parameters() == (12 + 4) + (8 + 2) + (25 + 5) + (5 + 1)
    assert m.forward_flops_per_sample() == 2 * (12 + 8 + 25 + 5) + 2 * 3 * 3 * 2
    assert m.train_flops(8) == 3 * 8 * 136 + 6 * 62
    dcn = DenseModel(arch="dcn", dense_in=3, num_features=2, embedding_dim=2, bottom_mlp=(4,), top_mlp=(5,),
                     cross_layers=2, cross_low_rank=0)
    assert dcn.linear_layers() == [(3, 4), (4, 2), (6, 6), (6, 6), (6, 5), (5, 1)]
    with pytest.raises(ConfigError, match="dlrm and dcn"):
        DenseModel(arch="dmt")


def test_predicted_step_equals_a_hand_computation_from_the_calibrated_constants():
    """Three tables (sharded, TT rank 4, host at depth 2) on 2 ranks: the step ``predict_forms`` gives equals the
    module docstrings' formulas evaluated by hand from the constants of a costs file."""
    costs = Costs(exact_lookup_s=100e-9, tt_lookup_s={4: 300e-9, 8: 500e-9}, host_row_s=200e-9,
                  link_bandwidth_gbs=2.0, link_latency_us=50.0, allreduce_gbs=1.0, dense_flops_per_s=1e9,
                  step_overhead_s=2e-3, table_overhead_s=1e-4, source="measured")
    mrc = MissRatioCurve.from_counts(np.ones(10), 1.0, bins=0)  # not read by the formulas below
    # lookups per rank batch L, distinct rows of a rank's batch D_r and of the global batch D_g
    st = [TableStats("a", 1000, 4, "sum", 64.0, 40.0, 70.0, False, mrc),
          TableStats("b", 50_000, 4, "sum", 64.0, 60.0, 110.0, False, mrc),
          TableStats("c", 20_000, 4, "sum", 64.0, 50.0, 90.0, False, mrc)]
    forms = {"a": SHARDED, "b": TableForm("tt", tt_rank=4), "c": TableForm("host", pipeline_depth=2)}
    dense = DenseModel(dense_in=3, num_features=3, embedding_dim=4, bottom_mlp=(8,), top_mlp=(6,))
    got = predict_forms(st, forms, dense, 32, 2, costs)
    rb, half = 16, 0.5  # row bytes (dim 4, float32); (M - 1) / M
    sharded = 64 * 100e-9 + 2 * 40 * half * rb / 2e9
    cores = tt_core_bytes(50_000, 4, 4)
    tt = 64 * 300e-9 + cores * 2 * half / 1e9
    host = 64 * 100e-9 + (50 + 90) * 200e-9 + 2 * 90 * half * rb / 2e9
    latency = (2 + 1 + 2) * 50e-6  # sharded all-to-all twice, one TT all-reduce, two host all-gathers
    width = 4 + 4 * 3 // 2  # D + (F + 1) F / 2
    layers = [(3, 8), (8, 4), (width, 6), (6, 1)]
    params = sum(i * o + o for i, o in layers)
    flops = 3 * 32 * (2 * sum(i * o for i, o in layers) + 2 * 4 * 4 * 4) + 6 * params
    dense_s = flops / 1e9
    sync = 2 * half * 4 * params / 1e9 + 2 * 50e-6
    want = sharded + tt + host + latency + dense_s + sync + 3 * 1e-4 + 2e-3
    assert got["step_seconds"] == pytest.approx(want, rel=1e-9)
    assert got["parts"]["dense"] == pytest.approx(dense_s, rel=1e-12)
    assert got["forms"] == {"a": "sharded", "b": "tt-4", "c": "host-2"}
    k = 2  # host device bytes: k D_r + (k - 1) D_g rows with their state
    assert got["device_bytes"] == pytest.approx(1000 * 20 / 2 + cores + (k * 50 + 90) * 20)
    assert got["host_bytes"] == pytest.approx(20_000 * 20)
    # a host form of depth 0 takes the run's depth; one rank pays no exchange and no dense sync
    one = predict_forms(st, {**forms, "c": TableForm("host")}, dense, 32, 1, costs, host_depth=2)
    assert one["forms"]["c"] == "host-2" and one["parts"]["dense_sync"] == 0 and one["parts"]["exchange_latency"] == 0


def _three_tables():
    mrc = MissRatioCurve.from_counts(np.ones(10), 1.0, bins=0)  # not read by the formulas
    return [TableStats("a", 1000, 4, "sum", 64.0, 40.0, 70.0, False, mrc),
            TableStats("b", 50_000, 4, "sum", 64.0, 60.0, 110.0, False, mrc),
            TableStats("c", 20_000, 4, "sum", 64.0, 50.0, 90.0, False, mrc)]


def test_executor_overheads_of_a_costs_file_enter_the_step_by_hand(tmp_path):
    """``calibrate --ranks``' per-form executor overheads, read back from a costs file: on 2 ranks the step is
    the hand computation of the test above plus one overhead per table of its form (a replicated table paying
    the sharded one); in a world of one nothing is added."""
    base = Costs(exact_lookup_s=100e-9, tt_lookup_s={4: 300e-9, 8: 500e-9}, host_row_s=200e-9,
                 link_bandwidth_gbs=2.0, link_latency_us=50.0, allreduce_gbs=1.0, dense_flops_per_s=1e9,
                 step_overhead_s=2e-3, table_overhead_s=1e-4, source="measured")
    Costs(**{**base.__dict__, "executor_overhead_s": {"sharded": 1e-3, "tt": 2e-3, "host": 5e-4},
             "executor_world": 2}).save(tmp_path / "costs.json")
    costs = load_costs(tmp_path / "costs.json")
    assert costs.executor_overhead_s == {"sharded": 1e-3, "tt": 2e-3, "host": 5e-4} and costs.executor_world == 2
    st = _three_tables()
    forms = {"a": SHARDED, "b": TableForm("tt", tt_rank=4), "c": TableForm("host", pipeline_depth=2)}
    dense = DenseModel(dense_in=3, num_features=3, embedding_dim=4, bottom_mlp=(8,), top_mlp=(6,))
    without = predict_forms(st, forms, dense, 32, 2, base)
    got = predict_forms(st, forms, dense, 32, 2, costs)
    assert got["step_seconds"] == pytest.approx(without["step_seconds"] + 1e-3 + 2e-3 + 5e-4, rel=1e-12)
    assert got["parts"]["executor"] == pytest.approx(3.5e-3) and without["parts"]["executor"] == 0
    assert got["parts"]["embedding"] == pytest.approx(without["parts"]["embedding"], rel=1e-12)
    one = predict_forms(st, forms, dense, 32, 1, costs, host_depth=2)
    assert one["step_seconds"] == pytest.approx(predict_forms(st, forms, dense, 32, 1, base)["step_seconds"])
    rep = candidates(st[0], 2, costs, forms=("replicated",))[0]
    assert rep.seconds == pytest.approx(candidates(st[0], 2, base, forms=("replicated",))[0].seconds + 1e-3)
    for bad, match in (({"executor_overhead_s": {"dense": 1.0}, "executor_world": 2}, "sharded / tt / host"),
                       ({"executor_overhead_s": {"host": -1e-3}, "executor_world": 2}, "seconds >= 0"),
                       ({"executor_overhead_s": {"tt": 1.0}, "executor_world": 1}, "executor_world")):
        (tmp_path / "bad.json").write_text(json.dumps({**base.to_dict(), **bad}))
        with pytest.raises(ConfigError, match=match):
            load_costs(tmp_path / "bad.json")


def test_fitted_executor_overheads_reproduce_the_timed_plans():
    """``fit_executor_overheads`` (what ``calibrate --ranks`` runs): plans of each form timed at made-up steps;
    the overheads fitted from their residuals against the prediction without overheads, put in the costs, make
    the prediction of every timed plan its measured step; a known overhead is recovered exactly."""
    costs = Costs(exact_lookup_s=100e-9, tt_lookup_s={4: 300e-9}, host_row_s=200e-9, source="measured")
    st = _three_tables()
    dense = DenseModel(dense_in=3, num_features=3, embedding_dim=4, bottom_mlp=(8,), top_mlp=(6,))
    plans = {"sharded": {}, "tt": {"b": TableForm("tt", tt_rank=4), "c": TableForm("tt", tt_rank=4)},
             "host": {"c": TableForm("host", pipeline_depth=2)}}
    measured = {"sharded": 0.050, "tt": 0.090, "host": 0.070}
    runs = []
    for k, f in plans.items():
        p = predict_forms(st, f, dense, 32, 2, costs)
        runs.append({"tables": form_counts(list(p["forms"].values())), "measured_s": measured[k],
                     "predicted_s": p["step_seconds"]})
    assert runs[1]["tables"] == {"sharded": 1, "tt": 2, "host": 0, "host_step": 0, "host_tt_step": 0}
    over = fit_executor_overheads(runs)
    fitted = Costs(**{**costs.__dict__, "executor_overhead_s": over, "executor_world": 2})
    for k, f in plans.items():
        assert predict_forms(st, f, dense, 32, 2, fitted)["step_seconds"] == pytest.approx(measured[k], rel=1e-9)
    known = {"sharded": 3e-3, "tt": 1e-3, "host": 7e-3}
    synth = [{"tables": r["tables"], "predicted_s": r["predicted_s"],
              "measured_s": r["predicted_s"] + sum(n * known.get(k, 0.0) for k, n in r["tables"].items())}
             for r in runs]
    assert fit_executor_overheads(synth) == pytest.approx(known, rel=1e-9)  # one host plan: no host_step
    # the scale first: steps measured at 0.55x every prediction are the costs' figures scaled, no overhead
    scale, none = fit_executor([{**r, "measured_s": 0.55 * r["predicted_s"]} for r in runs])
    assert scale == pytest.approx(0.55) and none == pytest.approx({"sharded": 0, "tt": 0, "host": 0}, abs=1e-12)
    for k, f in plans.items():  # every term of the model is linear in the figures Costs.scaled scales
        assert predict_forms(st, f, dense, 32, 2, costs.scaled(0.55))["step_seconds"] == pytest.approx(
            0.55 * predict_forms(st, f, dense, 32, 2, costs)["step_seconds"], rel=1e-12)
    # a recorded calibration read again by the model (calibrate_ranks.refit): the same fit from its notes
    rec = Costs(**{**costs.__dict__, "notes": {"executor": {"ranks": 2, "plans": {
        k: {**r, "measured_s": 0.55 * r["predicted_s"]} for k, r in zip(plans, runs)}}}})
    again = refit(rec)
    assert again.notes["executor"]["scale"] == pytest.approx(0.55) and again.executor_world == 2
    assert again.exact_lookup_s == pytest.approx(0.55 * costs.exact_lookup_s)
    # never negative: a plan measured below its prediction gives its form no gain the search could take per table
    lower = [{**r, "measured_s": r["predicted_s"] - 4e-3} if r["tables"]["host"] else r for r in synth]
    got = fit_executor_overheads(lower)
    assert min(got.values()) >= 0 and got["host"] == 0
    with pytest.raises(ConfigError, match="do not separate"):
        fit_executor_overheads([{"tables": {"sharded": 2, "tt": 1}, "measured_s": 1, "predicted_s": 0},
                                {"tables": {"sharded": 4, "tt": 2}, "measured_s": 2, "predicted_s": 0}])


def test_executor_fit_takes_no_overhead_from_residuals_within_a_plans_own_spread():
    """``fit_executor`` with each plan's rounds (``steps_s``): a residual inside half their range is noise (no
    overhead); one beyond it counts only by what exceeds it. Hand-computed: the scale through the origin, then
    the overheads of the residuals shrunk by the spreads."""
    runs = [{"tables": {"sharded": 26}, "predicted_s": 0.100, "measured_s": 0.200, "steps_s": [0.19, 0.20, 0.23]},
            {"tables": {"sharded": 21, "tt": 5}, "predicted_s": 0.080, "measured_s": 0.150,
             "steps_s": [0.14, 0.15, 0.16]},
            {"tables": {"sharded": 21, "host": 5}, "predicted_s": 0.050, "measured_s": 0.110,
             "steps_s": [0.105, 0.110, 0.111]}]
    p, m = np.array([0.1, 0.08, 0.05]), np.array([0.2, 0.15, 0.11])
    s = float(m @ p / (p @ p))
    scale, over = fit_executor(runs)
    assert scale == pytest.approx(s, rel=1e-12)
    r = m - s * p  # residuals: sharded +0.0016 (inside +-0.02), tt -0.0087 (inside +-0.01), host +0.0108 (> 0.003)
    assert abs(r[0]) <= 0.02 and abs(r[1]) <= 0.01 and r[2] > 0.003
    want = fit_executor_overheads([{"tables": runs[0]["tables"], "measured_s": 0.0, "predicted_s": 0.0},
                                   {"tables": runs[1]["tables"], "measured_s": 0.0, "predicted_s": 0.0},
                                   {"tables": runs[2]["tables"], "measured_s": r[2] - 0.003, "predicted_s": 0.0}])
    assert over == pytest.approx(want, abs=1e-12) and over["host"] == pytest.approx((r[2] - 0.003) / 5, rel=1e-9)
    assert over["sharded"] == pytest.approx(0, abs=1e-15) and over["tt"] == pytest.approx(0, abs=1e-15)
    # without the rounds the residuals are taken whole: host and sharded overheads appear
    whole = fit_executor([{k: v for k, v in run.items() if k != "steps_s"} for run in runs])[1]
    assert whole["host"] > over["host"]


def test_calibrate_ranks_rows_cap_is_zero_for_full_size_or_at_least_8(tmp_path):
    """``rows=0`` (the run's full-size tables) is a valid cap; a negative or tiny one is a named error."""
    for bad in (-1, 5):
        with pytest.raises(ConfigError, match=f"rows={bad}"):
            calibrate_ranks(Costs(), rows=bad, work=tmp_path)


def test_calibrate_ranks_times_a_plan_of_each_form_and_its_fit_reproduces_them(tmp_path, monkeypatch):
    """``calibrate --ranks 2`` on a tiny case, its N-rank runs answered by a stand-in timer (the figures are
    timings, never asserted; the 2-rank runs of TT and host plans themselves are tested in
    ``test_auto_plan_trains_on_two_ranks_like_one_process`` and ``test_distributed_host``): it writes five plans
    whose saved forms are the documented ones (sharded; the 3 largest tables TT; on the host; the 2 largest on
    the host; those 2 on the host beside the third TT), times them in turns, every round; the costs it returns
    predict each timed plan, through the same planner entry the benchmarks use, at its prediction without
    overheads plus its tables' overheads by form and the per-step costs (host, host beside TT), and at its
    measured step when no overhead was held at 0 (five plans, five unknowns: the fit is then exact)."""
    import embedscale.calibrate_ranks as cr

    step_of = {"sharded": 0.040, "tt": 0.058, "host": 0.075, "host-few": 0.066, "tt-host": 0.081}
    calls = []

    def timer(work, run_dir, plan_dir, ranks, global_batch, steps, depth, device, dim, nodes=None, round_=0):
        kind = plan_dir.parent.name.removeprefix("plan-")
        forms = Plan.load(plan_dir).forms
        calls.append((kind, round_, ranks, global_batch, steps, depth,
                      {n: (f.kind, f.tt_rank, f.pipeline_depth) for n, f in forms.items() if f.kind != "sharded"}))
        return step_of[kind]

    monkeypatch.setattr(cr, "_train", timer)
    base = Costs(source="measured", notes={"device": "cpu"})
    c = calibrate_ranks(base, ranks=2, batch=32, rows=300, dim=4, steps=3, repeats=2, big=3, tt_rank=4,
                        host_depth=2, work=tmp_path, log=lambda m: None)
    tables = tables_from_profile(AccessProfile.load(tmp_path / "profile"), 4)
    big = [t.name for t in sorted(tables, key=lambda t: (-t.num_rows, t.name))[:3]]
    tt, host = ("tt", 4, 0), ("host", 0, 2)
    want = {"sharded": {}, "tt": dict.fromkeys(big, tt), "host": dict.fromkeys(big, host),
            "host-few": dict.fromkeys(big[:2], host), "tt-host": {**dict.fromkeys(big[:2], host), big[2]: tt}}
    assert [(k, r) for k, r, *_ in calls] == [(k, r) for r in range(2) for k in want]  # in turns, every round
    for kind, _, ranks, gb, steps, depth, forms in calls:
        assert (ranks, gb, steps, depth) == (2, 64, 3, 2) and forms == want[kind], kind
    assert c.executor_world == 2
    assert set(c.executor_overhead_s) == {"sharded", "tt", "host", "host_step", "host_tt_step"}
    runs = c.notes["executor"]["plans"]
    assert {k: r["measured_s"] for k, r in runs.items()} == step_of
    assert runs["tt"]["tables"] == {"sharded": 23, "tt": 3, "host": 0, "host_step": 0, "host_tt_step": 0}
    assert runs["host"]["tables"]["host"] == 3 and runs["host-few"]["tables"]["host"] == 2
    assert runs["tt-host"]["tables"] == {"sharded": 23, "tt": 1, "host": 2, "host_step": 1, "host_tt_step": 1}
    for k, run in runs.items():
        p = predict_plan_forms(tables, tmp_path / "profile", Topology(ranks_per_host=2), plan_forms(tables, k, 3, 4, 2),
                               costs=c, batch_size=32, dense=DenseModel(num_features=26, embedding_dim=4), host_depth=2)
        want_s = c.notes["executor"]["scale"] * run["predicted_s"] + sum(n * c.executor_overhead_s[f]
                                                                        for f, n in run["tables"].items())
        assert p["step_seconds"] == pytest.approx(want_s, rel=1e-6)
        if min(c.executor_overhead_s.values()) > 0:
            assert p["step_seconds"] == pytest.approx(run["measured_s"], rel=1e-6)


def test_the_auto_plan_reports_the_whole_step_and_ranks_hand_plans_by_the_same_model(tmp_path):
    tabs = [TableSpec(f"t{i}", n, 8) for i, n in enumerate([50, 400, 200_000, 300_000])]
    prof = ZipfProfile.from_tables(tabs, alpha=1.05, samples=100_000)
    costs = Costs(dense_flops_per_s=5e9, step_overhead_s=1e-3, table_overhead_s=1e-4, source="measured")
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=4 * 2**20, host_memory=16 * 2**20,
                          costs=costs, batch_size=256, other_budgets=False)
    rep = plan.meta["auto"]
    parts = rep["predicted_step_parts"]
    assert rep["predicted_step_seconds"] == pytest.approx(sum(parts.values()))
    assert parts["embedding"] == pytest.approx(rep["per_rank"]["predicted_step_seconds"])
    assert parts["dense"] == pytest.approx(DenseModel(num_features=4, embedding_dim=8).train_flops(256) / 5e9)
    # the auto plan's forms, costed by predict_plan_forms, agree with its own report up to OPER's placement
    p = predict_plan_forms(tabs, prof, Topology(ranks_per_host=2), plan.forms, costs=costs, batch_size=256)
    assert p["step_seconds"] == pytest.approx(rep["predicted_step_seconds"], rel=0.05)
    # every table TT of rank 32 (EL-Rec's rule, taken to all large tables) is never predicted faster than auto
    hand = predict_plan_forms(tabs, prof, Topology(ranks_per_host=2),
                              {t.name: TableForm("tt", tt_rank=32) for t in tabs if t.num_rows >= 100_000},
                              costs=costs, batch_size=256)
    assert hand["step_seconds"] >= p["step_seconds"] * (1 - 1e-9)


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-m", "embedscale", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_cli_writes_the_plan_and_its_explain_report(tmp_path):
    p = _cli("plan", "--strategy", "auto", "--preset", "criteo-kaggle", "--max-rows", "200000",
             "--device-memory", "16MiB", "--host-memory", "64MiB", "--hot-touch", "1", "--out", "plans", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    d = tmp_path / "plans" / "auto"
    for f in ("plan.json", "explain.txt", "explain.json"):
        assert (d / f).exists(), f
    rep = json.loads((d / "explain.json").read_text())
    plan = Plan.load(d)
    assert {n: f.kind for n, f in plan.forms.items()} == {e["table"]: e["chosen"]["form"].split("-")[0]
                                                          .replace("replicated", "sharded") for e in rep["tables"]}
    assert "runner-up" in (d / "explain.txt").read_text() and "predicted" in p.stdout
    bad = _cli("plan", "--strategy", "auto", "--preset", "criteo-kaggle", "--max-rows", "200000",
               "--device-memory", "1KiB", "--host-memory", "0", "--out", "plans2", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: no plan fits") and "Traceback" not in bad.stderr


# -- an auto plan trains on 2 ranks as in one process ---------------------------------------------------------

def _config(tmp_path, data_dir, plan="", tables=None):
    return from_dict(RunConfig, {
        "name": "a", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], **({"tables": tables} if tables else {})},
        "train": {"batch_size": 50, "max_steps": STEPS, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                  "sparse_optimizer": "rowwise_adagrad", "dense_optimizer": "adagrad", "prefetch": 0},
        "dist": {"plan": plan, "timeout_s": 60},
    })


def _rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed  # in the spawned rank

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def test_auto_plan_trains_on_two_ranks_like_one_process(tmp_path):
    data_dir = tmp_path / "data"
    make_data(data_dir)
    prof = AccessProfile.from_shards(data_dir)
    tabs = tables_from_profile(prof, 4)
    costs = Costs(exact_lookup_s=50e-9, tt_lookup_s={2: 60e-9}, host_row_s=100e-9)
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=740, host_memory=3000, costs=costs,
                          batch_size=25, tt_rank_list=[2], tt_min_rows=100, hot_touch=1e9, bins=0,
                          hot_row_touch=0)  # whole TT tables (row groups: test_plan_rowgroups)
    forms = plan.forms
    assert forms["t_C3"] == TableForm("tt", tt_rank=2) and forms["t_C1"].kind == "host"
    assert {forms["t_C2"].kind, forms["t_C4"].kind} == {"sharded"}
    plan.meta["forms"]["t_C1"]["pipeline_depth"] = 2  # the plan's depth, not train.pipeline_depth (1), runs
    plan.save(tmp_path / "plan")

    # one process: the same model, the TT table configured, the host table an ordinary device table (exact)
    ref_tables = [{"name": f"t_C{i + 1}", "num_rows": r, "dim": 4, "features": [f"C{i + 1}"],
                   **({"compression": "tt", "tt_rank": 2} if i == 2 else {})} for i, r in enumerate(ROWS)]
    workflow.train(_config(tmp_path, data_dir, tables=ref_tables), tmp_path / "single", resume=False, progress=False)
    ref = load_checkpoint(tmp_path / "single")

    spawn_local(_rank, 2, to_dict(_config(tmp_path, data_dir, plan=str(tmp_path / "plan"))), str(tmp_path / "dist"),
                timeout_s=180)
    got = load_checkpoint(tmp_path / "dist")
    assert got["manifest"]["world_size"] == 2
    assert json.loads((tmp_path / "dist" / "summary.json").read_text())["pipeline_depth"] == 2
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0, atol=1e-5)
    weights = {n: e["weight"] for n, e in got["tables"].items()}
    weights.update({k[:-len(".weight")]: v for k, v in got["host"].items() if k.endswith(".weight")})
    assert sorted(weights) == ["t_C1", "t_C2", "t_C4"]
    for n, w in weights.items():
        torch.testing.assert_close(w, ref["tables"][n]["weight"], rtol=0, atol=1e-5, msg=lambda m: f"{n}: {m}")
    assert ref["tt"] and sorted(got["tt"]) == sorted(ref["tt"])
    for k, v in ref["tt"].items():
        torch.testing.assert_close(got["tt"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"TT {k}: {m}")


def test_auto_plan_with_the_milp_equals_the_greedy_and_rejects_requests():
    tabs = [TableSpec(f"s{i}", n, 16) for i, n in enumerate([50, 3_000, 40_000, 200_000, 600_000, 1_500_000])]
    prof = ZipfProfile.from_tables(tabs, alpha=1.1, samples=1_000_000)
    kw = dict(device_memory=40 * 2**20, host_memory=64 * 2**20, batch_size=1024, other_budgets=False)
    g = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), **kw).meta["auto"]
    m = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), search="milp", **kw).meta["auto"]
    assert m["search"] == "milp"
    assert g["predicted_step_seconds_symmetric"] <= 1.02 * m["predicted_step_seconds_symmetric"]
    assert {e["chosen"]["form"] for e in g["tables"]} - {"sharded", "replicated"}  # the budget binds
    asked = [TableConfig("s0", 50, 16), TableConfig("s1", 3000, 16, compression="tt", tt_rank=8)]
    specs = [r.spec for r in asked]
    with pytest.raises(ConfigError, match=r"auto decides every table's form; tables \['s1'\]"):
        make_auto_plan(specs, ZipfProfile.from_tables(specs), Topology(ranks_per_host=2), device_memory=2**20,
                       host_memory=0, requests=asked)


def test_host_pipeline_depth_is_the_largest_host_form_depth():
    host = lambda k: TableForm("host", pipeline_depth=k)  # noqa: E731
    assert host_pipeline_depth({"a": SHARDED, "b": TableForm("tt", tt_rank=4)}, 3) == 3  # no host table
    assert host_pipeline_depth({"a": host(0)}, 0) == 1  # 0 = the run's depth, at least 1
    assert host_pipeline_depth({"a": host(0), "b": SHARDED}, 2) == 2
    assert host_pipeline_depth({"a": host(4), "b": host(0)}, 2) == 4  # they disagree: the largest
    assert host_pipeline_depth({"a": host(1), "b": host(0)}, 3) == 3


# -- train --dist-plan auto -------------------------------------------------------------------------------

def _auto_train(tmp_path, data_dir, run_dir, *extra):
    cfg = _config(tmp_path, data_dir)
    (tmp_path / "auto.yaml").write_text(dump_config(cfg))
    return _cli("train", "--config", str(tmp_path / "auto.yaml"), "--nproc", "2", "--run-dir", str(run_dir),
                "--no-progress", "--json", "--dist-plan", "auto", *extra, cwd=tmp_path)


def test_train_dist_plan_auto_plans_trains_and_resumes(tmp_path):
    data_dir = tmp_path / "data"
    make_data(data_dir)
    rd = tmp_path / "run"
    budget = ("--dist-device-memory", "1300B", "--dist-host-memory", "4KB")
    p = _auto_train(tmp_path, data_dir, rd, *budget)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["plan"] == "auto" and s["steps"] == STEPS and s["host_tables"] == 1 and s["pipeline_depth"] == 1
    plan = Plan.load(rd / "plan")
    assert plan.world_size == 2 and plan.meta["strategy"] == "auto"
    assert {n: f.kind for n, f in plan.forms.items()} == {"t_C1": "sharded", "t_C2": "sharded", "t_C3": "host",
                                                        "t_C4": "sharded"}
    assert sorted(t.name for t in plan.tables) == ["t_C1", "t_C2", "t_C4"]  # the host table gets no rows
    rep = json.loads((rd / "plan" / "explain.json").read_text())
    assert rep["device_budget_bytes"] == 1300 and "runner-up" in (rd / "plan" / "explain.txt").read_text()
    # the step prediction used the run's own dense model (_config's sizes, make_data's 3 dense inputs), not a default
    dm = rep["dense_model"]
    assert (dm["arch"], dm["dense_in"], dm["num_features"], dm["embedding_dim"], dm["bottom_mlp"], dm["top_mlp"]) == \
        ("dlrm", 3, 4, 4, [8], [8]), dm
    assert json.loads((rd / "run-plan.json").read_text())["plan"] == "auto"
    mtime = (rd / "plan" / "plan.json").stat().st_mtime_ns

    # resumed: the run's own plan (not re-planned), from the last checkpoint, to more steps
    p = _auto_train(tmp_path, data_dir, rd, *budget, "--train-max-steps", str(STEPS + 1))  # the epoch ends at 7
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["steps"] == STEPS + 1 and "resumed from" in p.stderr
    assert (rd / "plan" / "plan.json").stat().st_mtime_ns == mtime
    assert load_checkpoint(rd)["manifest"]["world_size"] == 2

    # too small a budget: a named error saying by how much, exit code 2, no traceback
    bad = _auto_train(tmp_path, data_dir, tmp_path / "bad", "--dist-device-memory", "400B")
    assert bad.returncode == 2 and "no plan fits the memory budget: device memory over by" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_train_dist_plan_auto_config_errors():
    base = {"dist": {"plan": "auto", "nproc": 2, "device_memory": "1MiB"}}

    def cfg(**kw):
        d = {k: dict(v) for k, v in base.items()}
        for k, v in kw.items():
            sect, key = k.split("__")
            d.setdefault(sect, {})[key] = v
        return from_dict(RunConfig, d)

    check_auto_settings(cfg())
    with pytest.raises(ConfigError, match=r"decides every table's form itself; .* model.tt_min_rows 100"):
        check_auto_settings(cfg(model__tt_min_rows=100))
    with pytest.raises(ConfigError, match=r"model.host_min_rows 7"):
        check_auto_settings(cfg(model__host_min_rows=7))
    with pytest.raises(ConfigError, match=r"needs the device memory per rank: set dist.device_memory"):
        check_auto_settings(cfg(dist__device_memory=""))
    with pytest.raises(ConfigError, match=r"dist.host_memory: cannot read '12 parsecs'"):
        check_auto_settings(cfg(dist__host_memory="12 parsecs"))
    with pytest.raises(ConfigError, match=r"dist.costs nope.json: no such file"):
        check_auto_settings(cfg(dist__costs="nope.json"))
    with pytest.raises(ConfigError, match=r"dist.device_memory is read by dist.plan auto only; this run's dist.plan "
                                          r"is 'oper'"):
        check_auto_settings(cfg(dist__plan="oper"))


def test_a_replan_that_changes_a_checkpointed_form_is_a_named_error():
    old = {"a": SHARDED, "b": TableForm("host", pipeline_depth=1), "c": TableForm("tt", tt_rank=8)}
    check_forms_kept(old, {**old, "b": TableForm("host", pipeline_depth=3)}, "runs/r")  # depth: not in checkpoints
    with pytest.raises(ConfigError, match=r"runs/r: the new plan changes the form of tables its checkpoints hold "
                                          r"\(b: host -> sharded; c: tt \(rank 8\) -> tt \(rank 16\)\)"):
        check_forms_kept(old, {"a": SHARDED, "b": SHARDED, "c": TableForm("tt", tt_rank=16)}, "runs/r")


def test_host_cost_per_step_is_fitted_from_two_host_plans_and_weighed_by_the_search():
    """A host plan costs the executor a part per step whatever its number of host tables (``host_step``): two
    host plans of different sizes separate it from the part per table (a known pair recovered exactly), the
    prediction of a plan with host tables adds it once, and the search (``decide``) gives up host tables whose
    per-table gain does not pay it, where the budget holds a plan without them; with one host plan it is not
    fitted, all of it per table as before."""
    costs = Costs(exact_lookup_s=100e-9, tt_lookup_s={4: 300e-9}, host_row_s=200e-9, source="measured")
    st = _three_tables()
    dense = DenseModel(dense_in=3, num_features=3, embedding_dim=4, bottom_mlp=(8,), top_mlp=(6,))
    host = TableForm("host", pipeline_depth=2)
    plans = {"sharded": {}, "tt": {"b": TableForm("tt", tt_rank=4), "c": TableForm("tt", tt_rank=4)},
             "host": {"b": host, "c": host}, "host-few": {"c": host}}
    known = {"sharded": 1e-3, "tt": 2e-3, "host": 0.5e-3, "host_step": 6e-3}
    runs = []
    for k, f in plans.items():
        p = predict_forms(st, f, dense, 32, 2, costs)
        t = form_counts(list(p["forms"].values()))
        runs.append({"tables": t, "predicted_s": p["step_seconds"],
                     "measured_s": p["step_seconds"] + sum(n * known.get(kind, 0.0) for kind, n in t.items())})
    assert [r["tables"]["host_step"] for r in runs] == [0, 0, 1, 1]
    assert fit_executor_overheads(runs) == pytest.approx(known, rel=1e-9)
    assert set(fit_executor_overheads(runs[:3])) == {"sharded", "tt", "host"}  # one host plan: per table only
    fitted = Costs(**{**costs.__dict__, "executor_overhead_s": known, "executor_world": 2})
    assert fitted.host_step_overhead(2) == 6e-3 and fitted.host_step_overhead(1) == 0
    for k, f in plans.items():  # the fitted costs predict every timed plan's step, host_step once per plan
        assert predict_forms(st, f, dense, 32, 2, fitted)["step_seconds"] == pytest.approx(runs[list(plans).index(k)]
                                                                                            ["measured_s"], rel=1e-9)
    # the search: a device budget that holds a and c sharded but not b; b's host form is cheap per table, its TT
    # form dear. Without host_step the search puts b on the host; with a host_step beyond what that saves it
    # makes b TT, and the prediction of each choice is what decide weighed
    specs = [TableSpec(x.name, x.num_rows, x.dim) for x in st]
    dear_tt = Costs(**{**costs.__dict__, "tt_lookup_s": {4: 1e-5}, "executor_world": 2})
    kw = dict(batch_size=32, host_depth=2, tt_rank_list=(4,), stats=st)
    free = decide(specs, None, 1000, 2, 300_000, 1e9, costs=Costs(**{**dear_tt.__dict__,
                  "executor_overhead_s": {"host": 0.0}}), **kw)
    assert [free.chosen(i).label for i in range(3)] == ["sharded", "host-2", "sharded"]
    gain = free.cands[1][[c.label for c in free.cands[1]].index("tt-4")].seconds - free.chosen(1).seconds
    for step, label in ((0.5 * gain, "host-2"), (2 * gain, "tt-4")):
        res = decide(specs, None, 1000, 2, 300_000, 1e9, costs=Costs(**{**dear_tt.__dict__,
                     "executor_overhead_s": {"host": 0.0, "host_step": step}}), **kw)
        assert [res.chosen(i).label for i in range(3)] == ["sharded", label, "sharded"], step


def test_host_beside_tt_is_fitted_from_a_plan_of_both_and_weighed_by_the_search():
    """Host and TT tables beside each other cost a plan more than each alone (``host_tt_step``, once per step):
    a timed plan holding both, beside plans of each alone, separates it (a known set of overheads recovered
    exactly); without that plan it is not fitted. The fitted costs predict each plan with it added once, and
    the search (``best_over_kinds``) takes it into account: per table, one table's host form and the other's TT
    form are the cheapest, but beside each other they cost more than both tables TT."""
    costs = Costs(exact_lookup_s=100e-9, tt_lookup_s={4: 300e-9}, host_row_s=200e-9, source="measured")
    st = _three_tables()
    dense = DenseModel(dense_in=3, num_features=3, embedding_dim=4, bottom_mlp=(8,), top_mlp=(6,))
    host, tt = TableForm("host", pipeline_depth=2), TableForm("tt", tt_rank=4)
    plans = {"sharded": {}, "tt": {"b": tt, "c": tt}, "host": {"b": host, "c": host}, "host-few": {"c": host},
             "tt-host": {"b": tt, "c": host}}
    known = {"sharded": 1e-3, "tt": 2e-3, "host": 0.5e-3, "host_step": 6e-3, "host_tt_step": 3e-3}
    runs = []
    for f in plans.values():
        p = predict_forms(st, f, dense, 32, 2, costs)
        t = form_counts(list(p["forms"].values()))
        runs.append({"tables": t, "predicted_s": p["step_seconds"],
                     "measured_s": p["step_seconds"] + sum(n * known[kind] for kind, n in t.items())})
    assert [r["tables"]["host_tt_step"] for r in runs] == [0, 0, 0, 0, 1]
    assert fit_executor_overheads(runs) == pytest.approx(known, rel=1e-9)
    assert "host_tt_step" not in fit_executor_overheads(runs[:4])
    fitted = Costs(**{**costs.__dict__, "executor_overhead_s": known, "executor_world": 2})
    assert fitted.kinds_overhead({"host", "tt"}, 2) == pytest.approx(9e-3) and fitted.kinds_overhead({"tt"}, 2) == 0
    assert fitted.kinds_overhead({"host", "tt"}, 1) == 0
    for r, f in zip(runs, plans.values()):
        assert predict_forms(st, f, dense, 32, 2, fitted)["step_seconds"] == pytest.approx(r["measured_s"], rel=1e-9)
    # the search: two tables that fit only off the device; per table x is cheaper on the host, y as TT
    cands = [[Candidate("sharded", SHARDED, 1e-4, 1e9, 0.0), Candidate("tt-4", SHARDED, 1.0e-3, 10.0, 0.0),
              Candidate("host-2", SHARDED, 0.8e-3, 1.0, 50.0)],
             [Candidate("sharded", SHARDED, 1e-4, 1e9, 0.0), Candidate("tt-4", SHARDED, 1.0e-3, 10.0, 0.0),
              Candidate("host-2", SHARDED, 1.5e-3, 1.0, 50.0)]]
    for beside, want in ((0.0, ["host-2", "tt-4"]), (0.5e-3, ["tt-4", "tt-4"])):
        c = Costs(link_latency_us=0.0, executor_overhead_s={"host_tt_step": beside}, executor_world=2)
        for search in ("greedy", "milp"):
            first = search_greedy(cands, 100.0, 100.0) if search == "greedy" else search_milp(cands, 100.0, 100.0)
            got = best_over_kinds(cands, first, 100.0, 100.0, 2, c, search)
            assert [cands[i][j].label for i, j in enumerate(got)] == want, (beside, search)
