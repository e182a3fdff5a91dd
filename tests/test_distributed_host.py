"""Host-placed tables in a distributed run (EL-Rec V with OPER 5): a parameter server per rank or one shared by
the local ranks, pipelined, beside sharded tables and a TT table, against single-process training of the same
model with every table on the device (``MixedEmbedding``: plain tables and the TT table). Also: the host tables go through the sharded checkpoint and a
resumed run continues exactly, switching from the shared server at depth 3 to per-rank servers at depth 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from embedscale import workflow
from embedscale.plan.forms import TableForm, config_forms
from embedscale.plan.plan import Plan
from embedscale.specs import RunConfig, TableSpec, from_dict, to_dict
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.launch import spawn_local

from test_distributed_train import ROWS, STEPS, make_data

HOST = {0, 2}  # t_C1 and t_C3 live in the parameter server


TT = {1}  # t_C2 is a TT table (replicated, EL-Rec VI-B): host, TT and sharded tables in one model


def config(tmp_path, data_dir, *, host: bool, depth: int = 1, server: str = "per-rank", steps: int = STEPS):
    tables = [{"name": f"t_C{i + 1}", "num_rows": r, "dim": 4, "features": [f"C{i + 1}"],
               "placement": "host" if host and i in HOST else "device",
               **({"compression": "tt", "tt_rank": 2} if i in TT else {})} for i, r in enumerate(ROWS)]
    return from_dict(RunConfig, {
        "name": "h", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], "tables": tables},
        "train": {"batch_size": 50, "max_steps": steps, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                  "eval_every": 2, "sparse_optimizer": "rowwise_adagrad", "dense_optimizer": "adagrad",
                  "prefetch": 0, "pipeline_depth": depth, "pipeline_server": server},
        "dist": {"plan": "row_wise", "timeout_s": 60},
    })


def _rank(rank, world, cfg_dict, run_dir, resume_from):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False, resume_from=resume_from)
    return True


def test_host_tables_beside_sharded_tables_on_two_ranks(tmp_path):
    data_dir = tmp_path / "data"
    make_data(data_dir)
    # reference: one process, all four tables plain device tables
    rd = tmp_path / "single"
    workflow.train(config(tmp_path, data_dir, host=False), rd, resume=False, progress=False)
    ck = load_checkpoint(rd)
    ref_losses = ck["losses"]
    ref = {f"t_C{i + 1}": ck["tables"][f"t_C{i + 1}"]["weight"] for i in range(len(ROWS)) if i not in TT}
    ref_dense = ck["dense"]

    # two ranks: three steps with one shared server at depth 3, then resumed with per-rank servers at depth 2
    first = config(tmp_path, data_dir, host=True, depth=3, server="shared", steps=3)
    spawn_local(_rank, 2, to_dict(first), str(tmp_path / "a"), None, timeout_s=120)
    mid = sorted((tmp_path / "a" / "checkpoints").iterdir())[-1]
    second = config(tmp_path, data_dir, host=True, depth=2, server="per-rank")
    spawn_local(_rank, 2, to_dict(second), str(tmp_path / "b"), str(mid), timeout_s=120)

    last = load_checkpoint(tmp_path / "b")
    losses, dense, tt = last["losses"], last["dense"], last["tt"]
    got = {name: e["weight"] for name, e in last["tables"].items()}
    got.update({k[:-len(".weight")]: v for k, v in last["host"].items() if k.endswith(".weight")})
    assert sorted(got) == sorted(ref)
    # the config's requests (placement: host, compression: tt) became the forms the run's plan records and built
    forms = Plan.load(tmp_path / "b" / "plan").forms
    assert forms == {"t_C1": TableForm("host"), "t_C2": TableForm("tt", tt_rank=2), "t_C3": TableForm("host"),
                     "t_C4": TableForm()}
    assert tt["t_C2.core1"].shape[1] == 2  # (m_2, R_1, n_2 * R_2): the rank the plan says
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for name, w in ref.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    specs = [TableSpec(f"t_C{i + 1}", r, 4, features=[f"C{i + 1}"]) for i, r in enumerate(ROWS)]
    init = torch.empty(ROWS[0], 4)
    workflow.hash_init(0, specs)(specs[0], init)
    assert not torch.allclose(got["t_C1"], init, atol=1e-3)  # the host table did train
    ref_tt = ck["tt"]
    assert ref_tt and sorted(tt) == sorted(ref_tt)
    for k, v in ref_tt.items():
        torch.testing.assert_close(tt[k], v, rtol=0, atol=1e-5, msg=lambda m: f"TT {k}: {m}")
    for k, v in ref_dense.items():
        if k.startswith("sparse_arch.embedding."):
            continue
        torch.testing.assert_close(dense[k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert not list(Path("/dev/shm").glob("embedscale-ps-*")) if Path("/dev/shm").is_dir() else True
    # the sharded table's ids went through the input pipeline behind the host pipeline (its server takes the
    # next batch from the loader before this step ends): every step's of each run but its first
    for run, steps in (("a", 3), ("b", STEPS - 3)):
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        assert summary.get("input_pipelined_steps") == steps - 1, (run, summary)


def test_host_min_rows_places_the_largest_tables_on_the_server(tmp_path):
    from embedscale.data.shards import Manifest
    from embedscale.errors import ConfigError

    data_dir = tmp_path / "data"
    make_data(data_dir)
    manifest = Manifest.load(data_dir)
    cfg = config(tmp_path, data_dir, host=False)
    cfg.model.host_min_rows = 30
    def kinds():
        return [f.kind for f in config_forms(cfg.model, workflow.tables_for(cfg, manifest)).values()]

    assert kinds() == ["host", "tt", "host", "sharded"]  # t_C2 asks for TT (its config entry)
    cfg.model.tables = []  # one table per feature, sized by the data: the same rule
    assert kinds() == ["host", "sharded", "host", "sharded"]
    cfg.model.host_min_rows = -1
    with pytest.raises(ConfigError, match="host_min_rows"):
        workflow.tables_for(cfg, manifest)
