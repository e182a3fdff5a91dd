"""The run's input pipeline in the runs it newly covers: host tables, managed tables, a stream and the send design
(at the module, and a run).

Reference: the same run with ``dist.input_pipeline: false`` (every step prepares its own input at its own step).
Two gloo ranks each; the prefetched run must give the same bits: every step's loss, every table's rows and
row-wise state, the dense state, the managed tables' id mappings and the final evaluation. The summary's
``input_pipelined_steps`` (steps whose sharded input was prepared during the step before) shows the pipeline ran:
every step but the first, less the steps the run keeps from it (counted here by hand from the rules).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from embedscale.data.drift_stream import DriftConfig, DriftingStream, write_drift_dataset
from embedscale.specs import RunConfig, from_dict, to_dict
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.launch import spawn_local

import test_distributed_host as host_case
import test_distributed_train as send_case
import test_sharded as sharded_case
import test_managed_train as managed_case
import test_stream_train as stream_case


def _rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def prefetched_and_not(cfg: RunConfig, tmp_path, world: int = 2) -> tuple[dict, dict, dict]:
    """Run ``cfg`` with the input pipeline and without it; both checkpoints and the pipelined run's summary."""
    off = copy.deepcopy(cfg)
    off.dist.input_pipeline = False
    cfg.dist.input_pipeline = True
    for name, c in (("on", cfg), ("off", off)):
        spawn_local(_rank, world, to_dict(c), str(tmp_path / name), timeout_s=600)
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    off_summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert "input_pipelined_steps" not in off_summary  # the reference prepared every step's input at its step
    assert summary["eval_auc"] == off_summary["eval_auc"] or (summary["eval_auc"] != summary["eval_auc"]
                                                              and off_summary["eval_auc"] != off_summary["eval_auc"])
    return load_checkpoint(tmp_path / "on"), load_checkpoint(tmp_path / "off"), summary


def assert_same_bits(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["losses"] == b["losses"]
    assert sorted(a["tables"]) == sorted(b["tables"])
    for name, entry in b["tables"].items():
        for key, v in entry.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(a["tables"][name][key], v), (name, key)
    for k, v in b["dense"].items():
        assert torch.equal(a["dense"][k], v), k
    for k, v in (b.get("managed") or {}).items():
        got = a["managed"][k]
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k


def _send_worker(rank, world):
    from embedscale.comm.collective import CollectiveTransport
    from embedscale.embedding.address_map import AddressMap
    from embedscale.embedding.sharded import ShardedEmbedding

    ts = sharded_case.tables()
    owner, replicas, holders = sharded_case.plans(world)["oper_replicas"]
    amap = AddressMap.build(ts, world, owner, replicas, holders)
    data = sharded_case.batches()
    B, steps = sharded_case.B, 2 * len(data)
    parts = [jf.slice_batch(B * rank // world, B * (rank + 1) // world) for jf, _ in data]
    lo, hi = B * rank // world, B * (rank + 1) // world
    out = {}
    for prefetch in (False, True):
        emb = ShardedEmbedding(ts, amap, CollectiveTransport(), rank, design="send", optimizer="rowwise_adagrad",
                               lr=sharded_case.LR, eps=sharded_case.EPS)
        ys = []
        for s in range(steps):
            if prefetch and s + 1 < steps:  # the next batch decoded on the input pipeline's worker
                emb.prefetch(parts[(s + 1) % len(data)], background=True)
            y = emb(parts[s % len(data)])
            ys.append(y.detach().clone())
            ((y * data[s % len(data)][1][lo:hi]).sum() / B).backward()
        out[prefetch] = (ys, emb.weight.clone(), emb.momentum.clone(), emb.stats.get("prefetched_steps", 0))
    return out


def test_send_design_prefetched_equals_not_prefetched():
    """The send design's ``ShardedEmbedding.prefetch`` (its batches decoded ahead, ``send.decode``; their counts
    riding the step before's pooled exchange and their ids its gradient exchange): the same outputs, rows and
    row-wise state bit for bit over 6 steps on 2 ranks, with replicated rows."""
    for res in spawn_local(_send_worker, 2, timeout_s=600):
        ys, w, m, n = res[True]
        ref_ys, ref_w, ref_m, ref_n = res[False]
        assert n == len(ys) - 1 and ref_n == 0
        assert all(torch.equal(a, b) for a, b in zip(ys, ref_ys)) and torch.equal(w, ref_w) and torch.equal(m, ref_m)


def test_send_run_prefetched_equals_not_prefetched(tmp_path):
    """A send-design run with replicated hot rows: its pipeline prepares every step's input but the first during
    the step before, and gives the same bits as the run without it."""
    data = tmp_path / "data"
    send_case.make_data(data)
    send_case.hand_plan("replicas", 2).save(tmp_path / "plan")
    cfg = send_case.config(tmp_path, data, design="send", plan=str(tmp_path / "plan"))
    on, off, summary = prefetched_and_not(cfg, tmp_path)
    assert_same_bits(on, off)
    assert summary["input_pipelined_steps"] == send_case.STEPS - 1


def test_host_tables_prefetched_equal_not_prefetched(tmp_path):
    """Host tables at depth 2 (the server's lookahead is the pipeline's host lane), a TT table and sharded rows."""
    data = tmp_path / "data"
    send_case.make_data(data)
    cfg = host_case.config(tmp_path, data, host=True, depth=2)
    on, off, summary = prefetched_and_not(cfg, tmp_path)
    assert_same_bits(on, off)
    assert summary["input_pipelined_steps"] == send_case.STEPS - 1 and summary["pipeline_depth"] == 2


def test_managed_tables_prefetched_equal_not_prefetched(tmp_path):
    """Managed tables: the next batch's ids mapped during the step before (their resets at its own step); the run
    evaluates and checkpoints in between, so some steps keep their batch (a checkpoint every 3 steps, an
    evaluation every 4)."""
    data = tmp_path / "data"  # test_managed_train's drifting data: new ids every step, 12 rows per table
    stream = DriftingStream(DriftConfig(tables=managed_case.TABLES, initial_ids=120, new_ids_per_step=4, hot_ids=10,
                                        hot_share=0.7, rotate_every=3, batch_size=managed_case.BATCH, num_dense=2),
                            seed=3)
    write_drift_dataset(stream, data, 10, num_rows=managed_case.ROWS, shard_rows=130)
    managed_case.replicated_plan(2).save(tmp_path / "plan")
    cfg = managed_case.config(tmp_path, data, checkpoint_every=3, eval_every=4)
    cfg.dist.plan = str(tmp_path / "plan")
    on, off, summary = prefetched_and_not(cfg, tmp_path)
    assert_same_bits(on, off)
    assert on["managed"] and summary["managed"]["t_user"]["evictions"] > 0  # rows were reset along the way
    # steps 1 .. STEPS-1 may be prepared ahead; not those right after a checkpoint (3, 6) or an evaluation (4)
    assert summary["input_pipelined_steps"] == len([s for s in range(1, managed_case.STEPS) if s % 3 and s % 4])


def test_stream_prefetched_equals_not_prefetched(tmp_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("stream") / "in"
    stream_case.write_stream(d)
    cfg = stream_case.config(tmp_path, "stream", d, idle_s=1.0)
    on, off, summary = prefetched_and_not(cfg, tmp_path)
    assert_same_bits(on, off)
    assert summary["steps"] == stream_case.STEPS and summary["input_pipelined_steps"] == stream_case.STEPS - 1
