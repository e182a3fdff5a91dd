"""Row groups: a table's hot rows exact, its cold rows TT, inside one table.

References: the hybrid table against ``F.embedding_bag`` over its materialised rows (forward) and against an
exact table plus a separate ``TTEmbeddingBag`` trained on the split ids (one SGD / row-wise Adagrad step); 2 ranks
against one process training the same row-group table; the planner's row-group candidate against a hand
computation and its search against the MILP; the CLI's auto plan against the profile's hottest rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedscale import workflow
from embedscale.data.profile import AccessProfile
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.embedding.hybrid import HybridTTEmbeddingBag
from embedscale.embedding.optim import rowwise_adagrad_update_
from embedscale.embedding.tt import TTEmbeddingBag
from embedscale.errors import ConfigError
from embedscale.plan.auto import Costs, candidates, hybrid_candidate, search_greedy, search_milp, table_stats, tt_core_bytes
from embedscale.plan.forms import TableForm, decide_forms, table_bytes
from embedscale.plan.plan import Plan
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.reorder import PLAN_REORDER_DIR, Reordering
from embedscale.specs import RunConfig, TableConfig, TableSpec, to_dict
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.launch import spawn_local

from test_distributed_train import ROWS, STEPS, make_data
from test_plan_reorder import _cli, run_config, train_rank

def _bags(n, H, B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 12, (B,), generator=g)
    lengths[1] = 0  # an empty bag
    ids = torch.randint(0, n, (int(lengths.sum()),), generator=g)
    ids[: ids.numel() // 3] = torch.randint(0, H, (ids.numel() // 3,), generator=g)  # hot ids, here and there
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    offs = torch.zeros(B + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(lengths, 0)
    return ids, offs


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_the_hybrid_table_pools_like_its_materialised_rows(mode, weighted):
    m = HybridTTEmbeddingBag(900, 8, 4, hot_rows=40, mode=mode, include_last_offset=True, seed=3)
    ids, offs = _bags(900, 40)
    w = torch.rand(ids.numel()) if weighted else None
    ref = F.embedding_bag(ids, m.full_weight(), offs, mode=mode, per_sample_weights=w, include_last_offset=True)
    torch.testing.assert_close(m(ids, offs, w), ref, rtol=0, atol=1e-6)
    plain = TTEmbeddingBag(900, 8, 4, optimizer="sgd")
    assert m.full_weight().shape == (900, 8) and m.memory_bytes == 40 * 8 * 4 + plain.memory_bytes
    with pytest.raises(ConfigError, match="hot_rows must be an integer in"):
        HybridTTEmbeddingBag(900, 8, 4, hot_rows=900)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_training_step_updates_hot_rows_exactly_and_cold_rows_as_a_tt_table(optimizer):
    N, H, lr = 900, 40, 0.1
    tt_opt = "sgd" if optimizer == "sgd" else "adagrad"
    m = HybridTTEmbeddingBag(N, 8, 4, hot_rows=H, include_last_offset=True, optimizer=optimizer, lr=lr,
                             tt_optimizer=tt_opt, tt_lr=0.05, seed=3)
    cold = TTEmbeddingBag(N, 8, 4, include_last_offset=True, optimizer=tt_opt, lr=0.05, seed=99)
    cold.copy_cores_from(m)
    hot = m.hot_weight.clone().requires_grad_(True)
    state = torch.zeros(H)
    ids, offs = _bags(N, H, B=8)
    gout = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    (m(ids, offs) * gout).sum().backward()
    # reference: the hot ids through an exact table, the cold ones (shifted) through a separate TT table
    bag = torch.repeat_interleave(torch.arange(8), offs.diff())
    is_hot = ids < H

    def offsets(b):
        o = torch.zeros(9, dtype=torch.int64)
        o[1:] = torch.cumsum(torch.bincount(b, minlength=8), 0)
        return o

    ref = F.embedding_bag(ids[is_hot], hot, offsets(bag[is_hot]), mode="sum", include_last_offset=True) \
        + cold(ids[~is_hot], offsets(bag[~is_hot]))
    (ref * gout).sum().backward()
    with torch.no_grad():
        if optimizer == "sgd":
            hot -= lr * hot.grad
        else:
            rows = torch.unique(ids[is_hot])
            rowwise_adagrad_update_(hot, state, rows, hot.grad[rows], lr, 1e-8)
    torch.testing.assert_close(m.hot_weight, hot.detach(), rtol=0, atol=1e-7)
    for a, b in zip(m.cores, cold.cores):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    untouched = torch.ones(H, dtype=torch.bool)
    untouched[ids[is_hot]] = False
    assert untouched.any() and torch.equal(m.hot_weight[untouched], m.full_weight()[:H][untouched])


# -- forms and the planner --------------------------------------------------------------------------------

def test_row_group_forms_need_a_reordering_and_count_their_bytes():
    f = TableForm("tt", tt_rank=4, reorder=True, hot_rows=100)
    assert TableForm.from_dict(f.to_dict()) == f and "100 hot rows exact" in f.describe()
    with pytest.raises(ConfigError, match="needs a TT form with an index reordering"):
        TableForm("tt", tt_rank=4, hot_rows=100)
    spec = TableSpec("t", 10_000, 16)
    assert table_bytes(spec, f) == table_bytes(spec, TableForm("tt", tt_rank=4)) + 100 * 16 * 4
    req = [TableConfig("t", 10_000, 16, compression="tt", tt_rank=4, hot_rows=100)]
    assert decide_forms([spec], requests=req) == {"t": f}
    with pytest.raises(ConfigError, match="needs compression: tt"):
        TableConfig("t", 10_000, 16, hot_rows=100)


def test_the_row_group_candidate_is_costed_by_hand_and_the_search_matches_the_milp():
    tabs = [TableSpec(f"s{i}", n, 16) for i, n in enumerate([3_000, 200_000, 600_000, 1_500_000])]
    prof = ZipfProfile.from_tables(tabs, alpha=1.2, samples=1_000_000)
    costs = Costs(exact_lookup_s=50e-9, tt_lookup_s={8: 2e-6, 16: 3e-6}, host_row_s=200e-9,
                  row_group_overhead_s=300e-6)
    s = table_stats(tabs[3], prof.counts("s3"), 1_000_000, 1024, 2, bins=0)
    H = s.rows_for_share(0.5)
    a = s.share_of_rows(H)
    counts = np.sort(np.asarray(prof.counts("s3"), dtype=np.float64))[::-1]
    assert abs(a - counts[:H].sum() / counts.sum()) < 1e-9 and 0.5 <= a < 0.5 + counts[H - 1] / counts.sum() + 1e-9
    c = hybrid_candidate(s, 8, H, 2, costs)
    cb = tt_core_bytes(1_500_000, 16, 8)
    # the share of a rank batch's distinct rows the hot rows make up, by its definition (1 - (1-p)^L per row)
    p = counts / counts.sum()
    seen = -np.expm1(s.lookups_rank * np.log1p(-p))
    d = seen[:H].sum() / seen.sum()
    assert 0 < d < a and s.distinct_of_rows(H) / s.distinct_rank == pytest.approx(d, rel=1e-6)
    sec = s.lookups_rank * (a * 50e-9 + (1 - d) * 2e-6) + (cb + H * 64) * 2 * 0.5 / (costs.allreduce_gbs * 1e9) \
        + 300e-6
    assert c.form == TableForm("tt", tt_rank=8, reorder=True, hot_rows=H)
    assert c.seconds == pytest.approx(sec, rel=1e-12) and c.device_bytes == cb + H * (64 + 4)
    # the quality guard: the rows a global batch (2 x 1024 lookups) reads at least once each stay exact, by
    # brute force over the profile; such a table is TT as row groups only
    hot = int((p * s.lookups_rank * 2 >= 1.0).sum())
    assert hot > 0 and s.rows_read_at_least(1.0, 2) == hot
    cs = candidates(s, 2, costs, tt_rank_list=[8, 16], hot_row_touch=1.0)
    tt = [c for c in cs if c.form.kind == "tt"]
    assert tt and all(c.form.hot_rows == hot for c in tt)
    assert {c.form.hot_rows for c in candidates(s, 2, costs, tt_rank_list=[8]) if c.form.kind == "tt"} == {0}
    cands = [candidates(table_stats(t, prof.counts(t.name), 1_000_000, 1024, 2, bins=0), 2, costs,
                        tt_rank_list=[8, 16], hot_row_touch=1.0) for t in tabs]
    dev = 0.4 * sum(t.num_rows for t in tabs) * 68 / 2
    g, m = search_greedy(cands, dev, 0.0), search_milp(cands, dev, 0.0)
    secs = lambda ch: sum(cs[j].seconds for cs, j in zip(cands, ch))  # noqa: E731
    assert secs(g) <= 1.02 * secs(m)
    assert any(cs[j].form.hot_rows for cs, j in zip(cands, m))


# -- train: 2 ranks == one process; the CLI's auto plan ------------------------------------------------------

RG_TABLES = [{"name": f"t_C{i + 1}", "num_rows": r, "dim": 4, "features": [f"C{i + 1}"],
              **({"compression": "tt", "tt_rank": 2, "hot_rows": 12} if i == 2 else {})} for i, r in enumerate(ROWS)]


def _config(tmp_path, data_dir, *, plan="", tables=RG_TABLES) -> RunConfig:
    return run_config(tmp_path, data_dir, plan=plan, tables=tables)


def test_a_row_group_table_trains_on_two_ranks_like_one_process_and_evaluates(tmp_path):
    data_dir = tmp_path / "data"
    make_data(data_dir)
    workflow.train(_config(tmp_path, data_dir), tmp_path / "single", resume=False, progress=False)
    ref = load_checkpoint(tmp_path / "single")
    assert sorted(ref["tt"]) == sorted(["t_C3.hot_weight", "t_C3.hot_state"]
                                       + [f"t_C3.{c}{k}" for c in ("core", "state") for k in range(3)])
    # the hot rows are the 12 the training split reads most (its profile), frequency order
    counts = np.asarray(AccessProfile.load(tmp_path / "single" / "profile").counts("t_C3"), dtype=np.int64)
    top = np.lexsort((np.arange(counts.size), -counts))[:12]
    np.testing.assert_array_equal(ref["reorder"]["t_C3"].numpy()[top], np.arange(12))
    # a whole-TT table of the same rank is another model: the comparison below can fail
    whole = [dict(t, hot_rows=0) if t.get("hot_rows") else t for t in RG_TABLES]
    workflow.train(_config(tmp_path, data_dir, tables=whole), tmp_path / "whole", resume=False, progress=False)
    assert not np.allclose(load_checkpoint(tmp_path / "whole")["losses"], ref["losses"], rtol=0, atol=1e-5)

    spawn_local(train_rank, 2, to_dict(_config(tmp_path, data_dir, plan="oper")), str(tmp_path / "dist"), timeout_s=180)
    got = load_checkpoint(tmp_path / "dist")
    assert got["manifest"]["world_size"] == 2
    plan = Plan.load(tmp_path / "dist" / "plan")
    assert plan.forms["t_C3"] == TableForm("tt", tt_rank=2, reorder=True, hot_rows=12)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got["reorder"]["t_C3"].numpy(), ref["reorder"]["t_C3"].numpy())
    for k, v in ref["tt"].items():
        torch.testing.assert_close(got["tt"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    for n in ("t_C1", "t_C2", "t_C4"):
        torch.testing.assert_close(got["tables"][n]["weight"], ref["tables"][n]["weight"], rtol=0, atol=1e-5)

    # evaluate (one process, the model built from the checkpoint's reordering) scores the single run's model as
    # its own final evaluation did
    p = _cli("evaluate", str(tmp_path / "single"), "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    final = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert json.loads(p.stdout.strip().splitlines()[-1])["auc"] == pytest.approx(final["eval_auc"], abs=1e-9)


def _skewed_data(path, rows=(30, 9, 20_000, 5), n=3000, seed=0):
    """Shards with one large, skewed feature (C3: half its lookups on its ~310 hottest rows)."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    ids = [np.minimum((rng.random(n) ** 6 * r).astype(np.int64), r - 1) for r in rows]
    labels = (rng.random(n) < 0.3).astype(np.int8)
    with ShardWriter(path, ["I1", "I2", "I3"], [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(rows)],
                     shard_rows=1000) as w:
        w.write(labels, dense, {f"C{i + 1}": ids[i] for i in range(len(rows))})


def test_the_cli_auto_plan_keeps_the_hottest_rows_exact_and_carries_their_reordering(tmp_path):
    data_dir = tmp_path / "data"
    _skewed_data(data_dir)
    assert _cli("profile", str(data_dir), "--out", "prof", "--no-progress", cwd=tmp_path).returncode == 0
    costs = Costs(exact_lookup_s=50e-9, tt_lookup_s={2: 5e-6}, host_row_s=1e-3)
    costs.save(tmp_path / "costs.json")
    args = ("plan", "--profile", "prof", "--dim", "4", "--strategy", "auto", "--device-memory", "20KB",
            "--host-memory", "0", "--costs", "costs.json", "--tt-ranks", "2", "--batch-size", "25",
            "--hot-touch", "1e9")
    p = _cli(*args, "--out", "plans", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    plan = Plan.load(tmp_path / "plans" / "auto")
    f = plan.forms["t_C3"]
    assert f.kind == "tt" and f.hot_rows > 0 and f.reorder, plan.forms
    reo = Reordering.load(tmp_path / "plans" / "auto" / PLAN_REORDER_DIR)
    counts = np.asarray(AccessProfile.load(tmp_path / "prof").counts("C3"), dtype=np.int64)
    top = np.lexsort((np.arange(counts.size), -counts))[: f.hot_rows]
    np.testing.assert_array_equal(reo.map("t_C3")[top], np.arange(f.hot_rows))
    assert f"tt-2-hot{f.hot_rows}" in (tmp_path / "plans" / "auto" / "explain.txt").read_text()
    off = _cli(*args, "--no-row-groups", "--out", "plans2", cwd=tmp_path)
    assert off.returncode == 0, off.stderr
    assert not any(g.hot_rows for g in Plan.load(tmp_path / "plans2" / "auto").forms.values())


def test_train_dist_plan_auto_trains_row_groups_and_resumes(tmp_path):
    data_dir = tmp_path / "data"
    _skewed_data(data_dir)
    Costs(exact_lookup_s=50e-9, tt_lookup_s={r: 5e-6 * r / 8 for r in (8, 16, 32, 64)},
          host_row_s=1e-3).save(tmp_path / "costs.json")
    cfg = _config(tmp_path, data_dir, tables=None)
    (tmp_path / "c.yaml").write_text(json.dumps(to_dict(cfg)))
    run = ("train", "--config", "c.yaml", "--nproc", "2", "--run-dir", "run", "--no-progress", "--json",
           "--dist-plan", "auto", "--dist-device-memory", "24KB", "--dist-host-memory", "0", "--dist-costs",
           "costs.json")
    p = _cli(*run, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    plan = Plan.load(tmp_path / "run" / "plan")
    f = plan.forms["t_C3"]
    assert f.kind == "tt" and f.hot_rows > 0 and f.reorder, plan.forms
    got = load_checkpoint(tmp_path / "run")
    assert got["tt"]["t_C3.hot_weight"].shape == (f.hot_rows, 4) and sorted(got["reorder"]) == ["t_C3"]
    assert (tmp_path / "run" / "plan" / PLAN_REORDER_DIR / "reorder.json").exists()
    counts = np.asarray(AccessProfile.load(tmp_path / "run" / "profile").counts("t_C3"), dtype=np.int64)
    top = np.lexsort((np.arange(counts.size), -counts))[: f.hot_rows]
    np.testing.assert_array_equal(got["reorder"]["t_C3"].numpy()[top], np.arange(f.hot_rows))
    again = _cli(*run, "--train-max-steps", str(STEPS + 2), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr and load_checkpoint(tmp_path / "run")["step"] == STEPS + 2
