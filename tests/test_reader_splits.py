"""Train/eval/test files through a run: training evaluates on the eval files (not on eval_fraction), evaluate
scores the test split and another dataset of the same encoding with the figures of an independent
computation, and names the difference when a dataset is encoded another way (no load_state_dict traceback).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedscale.assemble import embedding_memory, split_existing
from embedscale.data.schema import Schema
from embedscale.data.shards import Manifest
from embedscale.data.tabular import convert
from embedscale.plan.forms import TableForm
from embedscale.specs import TableSpec

REAL = Path(__file__).resolve().parents[2] / "shared/data/criteo_kaggle_head10k.tsv"
SCHEMA = {"format": "tsv", "header": False, "label": 0, "dense": [{"column": 1, "name": "I1", "transform": "log1p"}],
          "sparse": [{"column": 14, "name": "C1"}, {"column": 15, "name": "C2"}, {"column": 16, "name": "C3"}]}


def cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "embedscale", *map(str, args)], capture_output=True, text=True,
                       timeout=900)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if not REAL.exists():
        pytest.skip(f"real Criteo sample not found at {REAL} (see shared/data/README.md)")
    d = tmp_path_factory.mktemp("splits")
    lines = REAL.read_text().splitlines(keepends=True)
    (d / "train.tsv").write_text("".join(lines[:3000]))
    (d / "eval.tsv").write_text("".join(lines[3000:3600]))
    (d / "test.tsv").write_text("".join(lines[3600:4200]))
    (d / "schema.yaml").write_text(json.dumps(SCHEMA))  # JSON is YAML
    return d


def test_split_datasets_are_the_runs_splits(files, tmp_path):
    m = convert(Schema.load(files / "schema.yaml"), {"train": [files / "train.tsv"], "eval": [files / "eval.tsv"],
                                                    "test": [files / "test.tsv"]}, tmp_path / "d",
                categorical="vocab", progress=False)
    data = split_existing(tmp_path / "d", 0.2)  # eval_fraction does not cut the training rows
    assert (data.train.rows, data.eval.rows, data.test.rows) == (3000, 600, 600) == (m.rows, 600, 600)
    assert data.eval.directory == tmp_path / "d" / "eval" and data.test.directory == tmp_path / "d" / "test"


def test_embedding_memory_line():
    tables = [TableSpec("a", 1000, dim=16), TableSpec("b", 2**20, dim=64)]
    line = embedding_memory(tables, {"a": TableForm(), "b": TableForm()})
    assert line.startswith("embedding tables: 2, 1,049,576 rows, 256.1 MiB of weights (largest b: 1,048,576 rows,")
    # b as TT of rank 4: its cores, not its rows (a is the largest then)
    line = embedding_memory(tables, {"a": TableForm(), "b": TableForm("tt", tt_rank=4)})
    assert "(largest a: 1,000 rows" in line


def test_train_evaluate_test_split_and_a_dataset_of_another_encoding(files, tmp_path):
    t = tmp_path
    cli("data", "table", "--schema", files / "schema.yaml", "--train", files / "train.tsv", "--eval",
        files / "eval.tsv", "--test", files / "test.tsv", "--categorical", "vocab", "--out", t / "d", "--no-progress")
    cli("data", "table", "--schema", files / "schema.yaml", files / "test.tsv", "--vocab-from", t / "d",
        "--out", t / "same", "--no-progress")
    cli("data", "table", "--schema", files / "schema.yaml", files / "test.tsv", "--categorical", "vocab",
        "--out", t / "own", "--no-progress")  # its own vocabulary: other table sizes
    r = cli("train", "--data-source", "shards", "--data-path", t / "d", "--train-max-steps", "3",
            "--train-batch-size", "256", "--model-bottom-mlp", "8", "--model-top-mlp", "8",
            "--run-dir", t / "run", "--no-progress", "--json")
    assert r.stderr.count("embedding tables: 3,") == 1  # said once, before training
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    ev = json.loads(cli("evaluate", t / "run", "--json").stdout)
    assert ev["samples"] == 600  # the eval file, not the last 20% of the training rows
    best = summary.get("best") or {}
    if best.get("eval_auc") is not None:  # evaluate RUN scores the best evaluation's checkpoint
        # (its logit calibration applied in float32: near-ties of 600 samples may order otherwise)
        assert abs(best["eval_auc"] - ev["auc"]) < 1e-4
    test = json.loads(cli("evaluate", t / "run", "--split", "test", "--json").stdout)
    same = json.loads(cli("evaluate", t / "run", "--data", t / "same", "--json").stdout)
    assert test["samples"] == same["samples"] == 600
    assert test["logloss"] == pytest.approx(same["logloss"], abs=1e-12) and test["auc"] == pytest.approx(same["auc"])
    assert (Manifest.load(t / "own").sparse[0].num_rows != Manifest.load(t / "d").sparse[0].num_rows)
    r = cli("evaluate", t / "run", "--data", t / "own", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "does not fit the model" in r.stderr and "table rows differ" in r.stderr and "t_C1" in r.stderr
    assert "--vocab-from" in r.stderr
    # the test split scored by evaluate is the test file encoded with the training vocabulary
    rows_d = np.load(t / "d" / "vocab-C1.npy")
    rows_same = np.load(t / "same" / "vocab-C1.npy")
    assert np.array_equal(rows_d, rows_same)
