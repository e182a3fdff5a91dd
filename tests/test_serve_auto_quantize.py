"""``export --quantize auto``: the greedy narrowing against a plain-Python model of its rules (a stand-in scorer
whose AUC is a known function of the forms), the budget rule on hand-worked cases, and an export of a trained
model whose served AUC, scored here through ``predict``, stays within the tolerance of its FP32 export."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from eval_reference import pair_count_auc  # noqa: E402
from serve_fixtures import train_tiny  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.errors import ConfigError  # noqa: E402
from embedscale.serve.auto_quantize import choose_forms  # noqa: E402
from embedscale.serve.export import export  # noqa: E402
from embedscale.serve.predict import load_export  # noqa: E402
from embedscale.specs import TableSpec  # noqa: E402


class KnownScorer:
    """AUC = 0.8 minus, per table, a known penalty of its current form."""

    def __init__(self, penalty: dict[str, dict[str, float]]):
        self.penalty = penalty
        self.form = {t: "fp32" for t in penalty}
        self.batches = [(None, None, np.zeros(10))]

    def set_form(self, name, form):
        self.form[name] = form

    def auc(self):
        return 0.8 - sum(self.penalty[t].get(f, 0.0) for t, f in self.form.items())


SPECS = [TableSpec("big", 1000, 16, ["a"]), TableSpec("mid", 500, 16, ["b"]), TableSpec("small", 10, 16, ["c"])]


def hand_greedy(penalty, tolerance):
    """The rule written out: largest table first, the first of int4, int8, fp16 whose cumulative drop fits."""
    drop, forms = 0.0, {}
    for t in ("big", "mid", "small"):
        forms[t] = "fp32"
        for f in ("int4", "int8", "fp16"):
            if drop + penalty[t].get(f, 0.0) <= tolerance:
                forms[t], drop = f, drop + penalty[t].get(f, 0.0)
                break
    return forms


@pytest.mark.parametrize("tolerance", [0.0, 0.0005, 0.001, 0.0025, 0.0035, 1.0])
def test_greedy_narrowing_follows_its_rule(tolerance):
    penalty = {"big": {"int4": 0.002, "int8": 0.0004, "fp16": 0.0},
               "mid": {"int4": 0.0009, "int8": 0.0003, "fp16": 0.0001},
               "small": {"int4": 0.0001, "int8": 0.0, "fp16": 0.0}}
    forms, report = choose_forms(KnownScorer(penalty), SPECS, tolerance, progress=False)
    assert forms == hand_greedy(penalty, tolerance)
    assert report["reference_auc"] - report["auc"] <= tolerance + 1e-12


def test_budget_narrows_the_largest_tables_and_an_impossible_budget_is_named():
    penalty = {t: {"int4": 0.01, "int8": 0.01, "fp16": 0.01} for t in ("big", "mid", "small")}
    # tolerance 0: every table stays fp32 (64 bytes a row: 96,640 bytes); int4 rows are 12 bytes
    forms, report = choose_forms(KnownScorer(penalty), SPECS, 0.0, budget=64 * 510 + 12 * 1000, progress=False)
    assert forms == {"big": "int4", "mid": "fp32", "small": "fp32"} and report["forced_by_budget"] == ["big"]
    forms, _ = choose_forms(KnownScorer(penalty), SPECS, 0.0, budget=12 * 1500 + 64 * 10, progress=False)
    assert forms == {"big": "int4", "mid": "int4", "small": "fp32"}
    with pytest.raises(ConfigError, match="even all at INT4"):
        choose_forms(KnownScorer(penalty), SPECS, 0.0, budget=12 * 1510 - 1, progress=False)


def _eval_auc(export_dir: Path, cfg) -> float:
    """The export's AUC over the run's eval split, scored through the loaded export and counted pairwise."""
    from embedscale.data.loader import ShardLoader

    served = load_export(export_dir)
    data = workflow.prepare_data(cfg, progress=False)
    z, y = [], []
    with torch.no_grad():
        for b in ShardLoader(data.eval.directory, 128, start=data.eval.start, stop=data.eval.stop):
            z.append(served.model(b.dense, b.sparse).double().numpy())
            y.append(b.labels.double().numpy())
    return pair_count_auc(np.concatenate(z), np.concatenate(y))


def test_auto_export_serves_within_the_tolerance(tmp_path):
    run_dir, cfg = train_tiny(tmp_path)
    export(run_dir, tmp_path / "fp32")
    m = export(run_dir, tmp_path / "auto", "auto", tolerance=0.002)
    forms = {t["name"]: t["form"] for t in m["tables"]}
    assert set(forms.values()) <= {"fp32", "fp16", "int8", "int4"} and m["quantize_auto"]["trials"]
    assert _eval_auc(tmp_path / "fp32", cfg) - _eval_auc(tmp_path / "auto", cfg) <= 0.002 + 1e-9
    assert m["table_bytes"] <= sum(t["num_rows"] * 4 * t["dim"] for t in m["tables"])
    with pytest.raises(ConfigError, match="even all at INT4"):
        export(run_dir, tmp_path / "tiny", "auto", table_budget=100)
