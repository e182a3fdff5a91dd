"""``benchmarks/gpu_smoke.py``: its ``--dry-run`` (the GPU script's code paths on the CPU, tiny) runs in CI and
prints one JSON line per figure whose embedding step agrees with FBGEMM's TBE (an independent implementation of
the same fused row-wise Adagrad step) after one step from the same weights; the ``gpu`` tests run the same
functions on a CUDA device and are skipped without one (designed for, untested on GPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.py"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fbgemm() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        return True
    except Exception:
        return False


def _module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_embedding_line(line: dict, expect_baseline: bool) -> None:
    assert line["figure"] == "embedding_step" and line["ours"]["median"] > 0
    if expect_baseline:  # one step from the same weights: the same pooled output and updated rows as FBGEMM's
        assert line["baseline"]["median"] > 0 and line["ratio"] > 0
        assert line["agreement"]["output_max_abs_diff"] <= 1e-5
        assert line["agreement"]["rows_max_abs_diff"] <= 1e-6


def test_dry_run_prints_one_line_per_figure_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert [x["figure"] for x in lines] == ["embedding_step", "dlrm_mixed"]
    assert all(x["device"] == "cpu" and x["note"] == "designed for, untested on GPU" for x in lines)
    _check_embedding_line(lines[0], _fbgemm())
    dlrm = lines[1]
    assert dlrm["ours"]["median"] > 0 and dlrm["baseline"]["median"] > 0
    assert math.isfinite(dlrm["ours"]["eval_logloss"]) and math.isfinite(dlrm["baseline"]["eval_logloss"])


def test_an_absent_device_is_a_named_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert p.returncode != 0 and "train.device: 'cuda:0' is not on this machine" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.gpu
@needs_cuda
def test_embedding_step_on_the_gpu_agrees_with_fbgemm():
    mod = _module()
    dev = torch.device("cuda:0")
    line = mod.embedding_step(dev, mod.DRY)
    _check_embedding_line(line, mod.fbgemm_tbe(dev) is not None)


@pytest.mark.gpu
@needs_cuda
def test_mixed_dlrm_trains_on_the_gpu():
    mod = _module()
    line = mod.dlrm_mixed("cuda:0", mod.DRY, rounds=1)
    assert math.isfinite(line["ours"]["eval_logloss"]) and line["ours"]["median"] > 0
