"""Sharded inference under inference plans (OPER Algorithm 1 replicas, table-wise) equals single-process
evaluation of the same checkpoint."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import config, hand_plan, make_data  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.data.loader import ShardLoader  # noqa: E402
from embedscale.specs import RunConfig, from_dict, to_dict  # noqa: E402
from embedscale.train.checkpoint import latest_checkpoint  # noqa: E402
from embedscale.train.trainer import load_model_state  # noqa: E402
from embedscale.train.launch import spawn_local  # noqa: E402


def _rank(rank, world, cfg_dict, ckpt, run_dir):
    from embedscale.train.ranks import infer_distributed

    return infer_distributed(from_dict(RunConfig, cfg_dict), ckpt, run_dir, progress=False)


@pytest.mark.parametrize("plan,design", [("oper", "retrieve"), ("table_wise", "send")])
def test_sharded_inference_equals_single_process(tmp_path, plan, design):
    make_data(tmp_path / "data")
    cfg = config(tmp_path, tmp_path / "data")
    workflow.train(cfg, tmp_path / "single", resume=False, progress=False)
    ck = latest_checkpoint(tmp_path / "single")
    # reference: the single-process model on the eval split
    data = workflow.prepare_data(cfg, progress=False)
    model, _ = workflow.build(cfg, workflow.tables_for(cfg, data.manifest), 3, torch.device("cpu"))
    load_model_state(model, ck)
    model.eval()
    loader = ShardLoader(data.eval.directory, 1000, start=data.eval.start, stop=data.eval.stop, prefetch=0)
    with torch.no_grad():
        ref = torch.cat([torch.sigmoid(model(b.dense, b.sparse)) for b in loader]).numpy()
    cfg.dist.plan = plan
    cfg.dist.design = design
    out = spawn_local(_rank, 2, to_dict(cfg), str(ck), str(tmp_path / "inf"))[0]
    got = np.load(tmp_path / "inf" / "predictions.npy", allow_pickle=False)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    assert out["samples"] == ref.size and out["world_size"] == 2
