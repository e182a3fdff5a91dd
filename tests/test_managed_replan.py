"""Managed tables under live re-planning.

A 2-rank run whose managed tables (raw ids mapped to rows with admission and LRU eviction, rows reset as ids
come and go) re-plans at step 4 and migrates its rows must equal the run restarted from its step-4 checkpoint
under the new plan (no monitor): the same losses, rows, row-wise optimizer state, dense state and id
mappings, bit for bit. Both designs of the sharded lookup (retrieve, send) and both ways of migrating (in
place over the collective transport; into a new module on the PGAS heap, where the managed hook must follow
the rows). The re-plan must be driven by the rows the lookup read (the mapped rows), and it must move rows.
"""

from __future__ import annotations

import json

import pytest
import torch

from embedscale.data.drift_stream import DriftConfig, DriftingStream, write_drift_dataset
from embedscale.specs import RunConfig, from_dict, to_dict
from embedscale.train.checkpoint import step_dir
from embedscale.train.launch import spawn_local

from test_migrate import assert_same_run

B, STEPS, EVERY, ROWS = 64, 7, 4, 40
TABLES = ("C1", "C2", "C3")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Batches of a drifting stream (hot set of 8 ids rotating every 4 steps, 6 new ids a step) with raw ids:
    ~200 distinct ids per table for 40 rows, so ids are admitted and evicted all along."""
    d = tmp_path_factory.mktemp("managed_drift")
    stream = DriftingStream(DriftConfig(tables=TABLES, initial_ids=200, new_ids_per_step=6, hot_ids=8,
                                        hot_share=0.9, rotate_every=EVERY, batch_size=B, num_dense=3), seed=5)
    write_drift_dataset(stream, d, 10, num_rows=ROWS, shard_rows=2 * B)  # 8 training steps, then 2 of eval
    return d


def config(tmp_path, data_dir, design, transport, **train) -> RunConfig:
    return from_dict(RunConfig, {
        "name": "mr", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8],
                  "managed": {"admit_after": 1, "policy": "lru"}},
        "train": {"batch_size": B, "max_steps": STEPS, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                  "eval_every": 0, "checkpoint_every": EVERY, "sparse_optimizer": "rowwise_adagrad",
                  "dense_optimizer": "adagrad", "prefetch": 0, "lr_warmup_steps": 0, "dropout": 0.0, **train},
        "dist": {"plan": "oper", "design": design, "transport": transport, "timeout_s": 300}})


def _rank(rank, world, cfg_dict, run_dir, resume_from):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False, resume_from=resume_from)
    return True


@pytest.mark.parametrize("design,transport", [("retrieve", "collective"), ("send", "pgas")])
def test_managed_run_replans_and_equals_restart_under_new_plan(tmp_path, data_dir, design, transport):
    from embedscale.train.replan import read_replans

    live = tmp_path / "live"
    cfg = config(tmp_path, data_dir, design, transport, replan_every=EVERY, replan_min_gain=0.0,
                 replan_weigh_costs=False, replan_lag=0)
    spawn_local(_rank, 2, to_dict(cfg), str(live), None, timeout_s=600)
    rows = read_replans(live)
    assert [int(r["step"]) for r in rows] == [EVERY], rows
    assert int(rows[0]["rows_moved"]) > 0 and int(rows[0]["bytes"]) > 0
    assert rows[0]["in_place"] == "1"  # the PGAS heap too: built with room for the re-plans (PGAS_REPLAN_SPARE)
    summary = json.loads((live / "summary.json").read_text())
    counts = summary["managed"]
    assert all(counts[f"t_{t}"]["evictions"] > 0 and counts[f"t_{t}"]["admissions"] > 0 for t in TABLES), counts
    # the monitor profiled rows (< ROWS), never raw ids: every row the re-plan placed is one of the table's
    new_plan = live / "replans" / f"step-{EVERY}"
    ref = tmp_path / "restart"
    rcfg = config(tmp_path, data_dir, design, transport, replan_every=0)
    rcfg.dist.plan = str(new_plan)
    spawn_local(_rank, 2, to_dict(rcfg), str(ref), str(step_dir(live, EVERY)), timeout_s=600)
    a, b = assert_same_run(live, ref, STEPS)  # losses, rows, row-wise state, dense state
    assert a["managed"].keys() == b["managed"].keys()
    for k in a["managed"]:
        assert torch.equal(a["managed"][k], b["managed"][k]), k
