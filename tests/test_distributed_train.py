"""N-rank training (DLRM, sharded embeddings + DDP) against single-process training on the same batches.

Reference: ``workflow.train`` in one process with ``LocalEmbeddingBags`` (fused row-wise Adagrad) and the
same placement-independent initial rows. The distributed runs use hand-written plans (table-wise,
row-wise, row-level with replicas) on 2 and 4 gloo ranks, both lookup designs; per-step losses and final
weights must match within 1e-5. A 2-rank checkpoint resumed on 4 ranks under another plan must continue
exactly as the single-process run does (re-sharding).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embedscale import workflow
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.plan.plan import Plan
from embedscale.specs import RunConfig, TableSpec, from_dict, to_dict
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.launch import spawn_local

ROWS = [30, 9, 120, 5]
STEPS = 6


def make_data(path, n=400, seed=0):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    ids = [np.minimum((rng.random(n) ** 3 * r).astype(np.int64), r - 1) for r in ROWS]
    logit = dense[:, 0] + 0.5 * (ids[0] % 3 == 0) - 0.5 * (ids[2] < 10)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    sp = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(ROWS)]
    with ShardWriter(path, ["I1", "I2", "I3"], sp, shard_rows=150) as w:
        w.write(labels, dense, {f"C{i + 1}": ids[i] for i in range(len(ROWS))})


def config(tmp_path, data_dir, optimizer="rowwise_adagrad", design="retrieve", plan="") -> RunConfig:
    cfg = from_dict(RunConfig, {
        "name": "t", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8]},
        "train": {"batch_size": 50, "max_steps": STEPS, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                  "sparse_optimizer": optimizer, "dense_optimizer": "adagrad", "prefetch": 0},
        "dist": {"design": design, "plan": plan, "timeout_s": 300},  # generous: no test here is about a hang
    })
    return cfg


def tables():
    return [TableSpec(f"t_C{i + 1}", r, 4, features=[f"C{i + 1}"]) for i, r in enumerate(ROWS)]


def hand_plan(kind: str, world: int) -> Plan:
    ts = tables()
    T = len(ts)
    if kind == "table_wise":
        return Plan(ts, world, [None] * T, np.arange(T), np.zeros(T), ROWS, owner=np.arange(T) % world,
                    meta={"strategy": "table_wise"})
    # row-wise: every table split evenly; "replicas": additionally the first 3 rows of tables 0 and 2
    # (the hot ones) in partitions held by every rank
    pt, ps, pe, own, hold = [], [], [], [], []
    for t, n in enumerate(ROWS):
        cuts = np.linspace(3 if kind == "replicas" and t in (0, 2) else 0, n, world + 1).astype(int)
        if kind == "replicas" and t in (0, 2):
            pt.append(t), ps.append(0), pe.append(3), own.append(t % world), hold.append(np.ones(world, bool))
        for r in range(world):
            if cuts[r] < cuts[r + 1]:
                h = np.zeros(world, bool)
                h[(r + t) % world] = True
                pt.append(t), ps.append(cuts[r]), pe.append(cuts[r + 1]), own.append((r + t) % world), hold.append(h)
    return Plan(ts, world, [None] * T, pt, ps, pe, owner=own, holders=np.array(hold), meta={"strategy": kind})


def single_process(tmp_path, data_dir, optimizer):
    cfg = config(tmp_path, data_dir, optimizer)
    rd = tmp_path / f"single-{optimizer}"
    workflow.train(cfg, rd, resume=False, progress=False)
    return checkpoint_state(rd)


def checkpoint_state(path):
    """Losses, the tables stacked in order ``[sum(ROWS), 4]`` and the dense state of a checkpoint (or run
    directory) of any world size."""
    ck = load_checkpoint(path)
    weights = torch.cat([ck["tables"][f"t_C{i + 1}"]["weight"] for i in range(len(ROWS))])
    return ck["losses"], weights, ck["dense"]


def _rank(rank, world, cfg_dict, run_dir, resume_from):
    from embedscale.train.ranks import train_distributed

    cfg = from_dict(RunConfig, cfg_dict)
    train_distributed(cfg, run_dir, progress=False, resume_from=resume_from)
    return True


def distributed(cfg, run_dir, world, resume_from=None):
    spawn_local(_rank, world, to_dict(cfg), str(run_dir), resume_from, timeout_s=600)
    assert load_checkpoint(run_dir)["manifest"]["world_size"] == world
    return checkpoint_state(run_dir)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_data(d)
    return d


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """The single-process run every distributed run here must match (trained once for the module)."""
    return single_process(tmp_path_factory.mktemp("reference"), data_dir, "rowwise_adagrad")


@pytest.mark.parametrize("world,kind,design", [(2, "table_wise", "retrieve"), (2, "replicas", "send"),
                                               (4, "row_wise", "send"), (4, "replicas", "retrieve")])
def test_n_rank_training_equals_single_process(tmp_path, data_dir, reference, world, kind, design):
    ref_losses, ref_w, ref_dense = reference
    plan_dir = tmp_path / "plan"
    hand_plan(kind, world).save(plan_dir)
    cfg = config(tmp_path, data_dir, design=design, plan=str(plan_dir))
    losses, w, dense = distributed(cfg, tmp_path / "dist", world)
    assert len(losses) == STEPS
    # dist.input_pipeline (on by default): a run converts every step's ids but the first during the step before
    # (ShardedEmbedding.prefetch), in either design
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert summary.get("input_pipelined_steps", 0) == STEPS - 1, summary
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-5)
    for k, v in ref_dense.items():
        torch.testing.assert_close(dense[k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_input_pipeline_off_gives_the_same_run(tmp_path, data_dir, reference):
    """``dist.input_pipeline false``: every step converts its own ids (four all-to-alls); same losses and rows."""
    ref_losses, ref_w, _ = reference
    plan_dir = tmp_path / "plan"
    hand_plan("replicas", 2).save(plan_dir)
    cfg = config(tmp_path, data_dir, plan=str(plan_dir))
    cfg.dist.input_pipeline = False
    losses, w, _ = distributed(cfg, tmp_path / "dist", 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-5)
    assert "input_pipelined_steps" not in json.loads((tmp_path / "dist" / "summary.json").read_text())


def test_resharding_2_to_4_ranks_continues_exactly(tmp_path, data_dir, reference):
    ref_losses, ref_w, _ = reference
    p2, p4 = tmp_path / "plan2", tmp_path / "plan4"
    hand_plan("replicas", 2).save(p2)
    hand_plan("row_wise", 4).save(p4)
    cfg2 = config(tmp_path, data_dir, plan=str(p2))
    cfg2.train.max_steps = 3
    distributed(cfg2, tmp_path / "two", 2)
    ck = sorted((tmp_path / "two" / "checkpoints").iterdir())[-1]
    cfg4 = config(tmp_path, data_dir, plan=str(p4), design="send")
    losses, w, _ = distributed(cfg4, tmp_path / "four", 4, resume_from=str(ck))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-5)
