"""Single-process training: exact resume from a checkpoint, run-directory contents, config errors."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from eval_reference import eval_logits, pair_count_auc  # noqa: E402
from test_distributed_train import config, make_data  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.cli import main  # noqa: E402
from embedscale.errors import ConfigError, FormatError  # noqa: E402
from embedscale.specs import ModelConfig, TableConfig, TableSpec, from_dict, to_dict  # noqa: E402
from embedscale.train.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_data(d)
    return d


def losses_of(run_dir):
    return load_checkpoint(run_dir)["losses"]


def assert_same_state(a, b):
    """Two checkpoints (``load_checkpoint``) hold the same tables and dense state, bit for bit."""
    assert set(a["tables"]) == set(b["tables"]) and set(a["dense"]) == set(b["dense"])
    for name in a["tables"]:
        for k, v in a["tables"][name].items():
            assert torch.equal(v, b["tables"][name][k]), (name, k)
    for k, v in a["dense"].items():
        assert torch.equal(v, b["dense"][k]), k


def test_resumed_run_equals_uninterrupted(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    cfg.train.max_steps = 10
    cfg.train.epochs = 2  # crosses an epoch boundary (7 steps per epoch)
    workflow.train(cfg, tmp_path / "full", resume=False, progress=False)
    cut = config(tmp_path, data_dir)
    cut.train.max_steps = 8
    cut.train.epochs = 2
    workflow.train(cut, tmp_path / "cut", resume=False, progress=False)
    cfg2 = config(tmp_path, data_dir)
    cfg2.train.max_steps = 10
    cfg2.train.epochs = 2
    workflow.train(cfg2, tmp_path / "cut", resume=True, progress=False)  # resumes at step 8
    full, resumed = losses_of(tmp_path / "full"), losses_of(tmp_path / "cut")
    assert len(full) == 10 and resumed == full  # bitwise
    assert_same_state(load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "cut"))
    # the checkpoint format: a step directory, manifest + one rank file (a world of one)
    ck = latest_checkpoint(tmp_path / "cut")
    assert ck.name == "step-00000010" and sorted(p.name for p in ck.iterdir()) == ["manifest.json", "rank-00000.pt"]


def test_cli_train_writes_the_run_directory(tmp_path, data_dir):
    rd = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--data-source", "shards", "--data-path", str(data_dir),
                                  "--model-embedding-dim", "4", "--model-bottom-mlp", "8", "--model-top-mlp", "8",
                                  "--train-batch-size", "64", "--train-eval-every", "3", "--train-log-every", "1",
                                  "--run-dir", str(rd), "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    for f in ["config.yaml", "metrics.csv", "curves.png", "summary.json"]:
        assert (rd / f).stat().st_size > 0, f
    rows = list(csv.DictReader((rd / "metrics.csv").open()))
    assert any(row["eval_auc"] for row in rows) and any(row["train_loss"] for row in rows)
    ck = latest_checkpoint(rd)
    summary = json.loads((rd / "summary.json").read_text())
    st = summary["train_step_seconds"]  # the steady state: the steps after the first third of this short run
    assert st["steps"] + st["skipped"] == summary["steps"] and st["skipped"] == min(10, summary["steps"] // 3)
    assert 0 < st["median"] <= st["p90"] and st["mean"] > 0
    r2 = CliRunner().invoke(main, ["evaluate", str(ck), "--json"])  # a checkpoint: its own figures
    assert r2.exit_code == 0, r2.output
    got = json.loads(r2.output.strip().splitlines()[-1])
    assert got["step"] == summary["steps"] and got["checkpoint"] == str(ck)
    # logloss: a best evaluation's figure is that of its logits Platt-scaled in float64 (train.calibrate), the
    # checkpoint applies the map in float32
    assert abs(got["auc"] - summary["eval_auc"]) < 1e-9 and abs(got["logloss"] - summary["eval_logloss"]) < 1e-7
    r2 = CliRunner().invoke(main, ["evaluate", str(rd), "--json"])  # a run directory: its best evaluation's
    assert r2.exit_code == 0, r2.output
    got, best = json.loads(r2.output.strip().splitlines()[-1]), summary["best"]
    assert got["step"] == best["step"] and abs(got["auc"] - best["eval_auc"]) < 1e-9
    assert abs(got["logloss"] - best["eval_logloss"]) < 1e-7
    r3 = CliRunner().invoke(main, ["infer", str(rd), "--run-dir", str(tmp_path / "served"), "--no-progress", "--json"])
    assert r3.exit_code == 0, r3.output
    got = json.loads(r3.output.strip().splitlines()[-1])
    # infer RUN serves the run's best evaluation's checkpoint, as evaluate RUN scores it
    assert got["samples"] == summary["eval_samples"] and abs(got["auc"] - best["eval_auc"]) < 1e-6


def test_config_naming_an_unknown_feature(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    cfg.model.tables = [TableConfig("t_C1", 30, 4, features=["C1"]), TableConfig("t_X", 10, 4, features=["nope"])]
    data = workflow.prepare_data(cfg, progress=False)
    with pytest.raises(ConfigError, match="'nope'"):
        workflow.tables_for(cfg, data.manifest)
    cfg.model.tables = [TableConfig("t_C1", 3, 4, features=["C1"])]
    with pytest.raises(ConfigError, match="has 3 rows but feature 'C1'"):
        workflow.tables_for(cfg, data.manifest)
    cfg.model.tables = [TableSpec("t_C1", 30, 4, features=["C1"])]  # facts only: not a config entry
    with pytest.raises(ConfigError, match=r"model.tables\[0\]: expected a table entry .*got TableSpec"):
        workflow.tables_for(cfg, data.manifest)


def test_damaged_checkpoint_is_a_clear_error(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    cfg.train.max_steps = 2
    workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    ck = latest_checkpoint(tmp_path / "run")
    (ck / "rank-00000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(FormatError, match=r"rank-00000\.pt: not a readable checkpoint file"):
        load_checkpoint(ck)
    with pytest.raises(FormatError, match=r"rank-00000\.pt: not a readable checkpoint file"):
        workflow.train(cfg, tmp_path / "run", resume=True, progress=False)
    # a step directory without its manifest (an interrupted write) is never read: the run has no checkpoint
    (ck / "manifest.json").unlink()
    assert latest_checkpoint(tmp_path / "run") is None
    with pytest.raises(FormatError, match="not a checkpoint directory|neither a checkpoint"):
        load_checkpoint(ck)


def test_cli_plan_compares_strategies(tmp_path):
    out = tmp_path / "plans"
    r = CliRunner().invoke(main, ["plan", "--preset", "criteo-kaggle", "--max-rows", "2000", "--ranks-per-host", "4",
                                  "--strategy", "oper", "--strategy", "table_wise", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    import json

    rep = json.loads(r.output.strip().splitlines()[-1])
    for name in ("oper", "table_wise"):
        e = rep["strategies"][name]
        for key in ("plan_seconds", "memory_per_rank", "lookup_per_rank", "comm_matrix", "dob_memory", "dob_lookup",
                    "dob_comm", "comm_mean", "max_rank_cost"):
            assert key in e, (name, key)
        assert (out / name / "plan.json").exists()
    assert rep["strategies"]["oper"]["max_rank_cost"] < rep["strategies"]["table_wise"]["max_rank_cost"]
    assert (out / "report.png").stat().st_size > 0


def test_workflow_host_tables_pipelined_equal_sequential(tmp_path, data_dir):
    """`placement: host` tables through the workflow: depth 3 gives the same losses as depth 1."""
    out = []
    for depth in (1, 3):
        cfg = config(tmp_path, data_dir)
        cfg.model.tables = [TableConfig("t_C1", 30, 4, features=["C1"]), TableConfig("t_C2", 9, 4, features=["C2"]),
                            TableConfig("t_C3", 120, 4, features=["C3"], placement="host"),
                            TableConfig("t_C4", 5, 4, features=["C4"])]
        cfg.train.pipeline_depth = depth
        workflow.train(cfg, tmp_path / f"d{depth}", resume=False, progress=False)
        out.append(losses_of(tmp_path / f"d{depth}"))
    assert len(out[0]) == 6 and out[0] == out[1]


def test_workflow_tt_table_trains(tmp_path, data_dir):
    """A config table saying ``compression: tt`` (the YAML keys) trains as a TT table of its rank in one process:
    the request is the config's, the form decided by ``plan.forms``, the spec holds only facts."""
    cfg = config(tmp_path, data_dir)
    cfg.model = from_dict(ModelConfig, {**to_dict(cfg.model), "tables": [
        {"name": "t_C1", "num_rows": 30, "dim": 4, "features": ["C1"]},
        {"name": "t_C2", "num_rows": 9, "dim": 4, "features": ["C2"]},
        {"name": "t_C3", "num_rows": 120, "dim": 4, "features": ["C3"], "compression": "tt", "tt_rank": 4},
        {"name": "t_C4", "num_rows": 5, "dim": 4, "features": ["C4"]}]}, "model")
    data = workflow.prepare_data(cfg, progress=False)
    tables = workflow.tables_for(cfg, data.manifest)
    assert all(type(t) is TableSpec for t in tables) and not hasattr(tables[2], "compression")
    s = workflow.train(cfg, tmp_path / "tt", resume=False, progress=False)
    assert s["steps"] == 6 and 0.0 < s["eval_logloss"] < 5.0 and s["tt_tables"] == 1
    ck = load_checkpoint(tmp_path / "tt")
    assert sorted(ck["tables"]) == ["t_C1", "t_C2", "t_C4"]  # rows of the plain tables only
    assert sorted(ck["tt"]) == [f"t_C3.{k}{i}" for k in ("core", "state") for i in range(3)]
    assert ck["tt"]["t_C3.core1"].shape[1] == 4  # (m_2, R_1, n_2 * R_2): rank 4 as asked


def test_evaluate_prints_the_figures_of_an_independent_computation(tmp_path, data_dir):
    """``embedscale evaluate`` prints AUC, logloss, NE and calibration equal to those computed here from the same
    predictions by brute-force pair counting and the definitions in float64 (not through ``data.metrics``)."""
    import math
    import re

    cfg = config(tmp_path, data_dir)
    cfg.train.max_steps = 6
    rd = tmp_path / "run"
    workflow.train(cfg, rd, resume=False, progress=False)
    # the same predictions, scored here
    z, y = eval_logits(cfg, rd)
    p = 1.0 / (1.0 + np.exp(-z))
    auc = pair_count_auc(z, y)
    ll = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    ctr = y.mean()
    ne = ll / -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    cal = p.sum() / y.sum()
    r = CliRunner().invoke(main, ["evaluate", str(rd)])
    assert r.exit_code == 0, r.output
    line = r.output.strip().splitlines()[-1]
    printed = {k: float(v) for k, v in re.findall(r"(logloss|AUC|NE|calibration) ([0-9.]+)", line)}
    assert printed.keys() == {"logloss", "AUC", "NE", "calibration"}, line
    assert abs(printed["AUC"] - auc) < 1e-5 and abs(printed["logloss"] - ll) < 1e-5, (line, auc, ll)
    assert abs(printed["NE"] - ne) < 1e-5 and abs(printed["calibration"] - cal) < 1e-5, (line, ne, cal)
    assert f"on {y.size:,} samples" in line
    got = json.loads(CliRunner().invoke(main, ["evaluate", str(rd), "--json"]).output.strip().splitlines()[-1])
    assert got["auc"] == pytest.approx(auc, abs=1e-9) and got["logloss"] == pytest.approx(ll, rel=1e-6)
    assert got["ne"] == pytest.approx(ne, rel=1e-6) and got["calibration"] == pytest.approx(cal, rel=1e-6)


def test_dropout_masks_the_global_batch_whatever_the_ranks():
    """Top-MLP dropout (``train.dropout``): off in eval mode; in training, the rows a rank holds of a global batch
    get the mask one process training the whole batch gets (same seed)."""
    from embedscale.models.dlrm import OverArch, set_dropout, set_dropout_rows

    torch.manual_seed(0)
    arch = OverArch(6, [64, 32], dropout=0.5)
    x = torch.rand(10, 6)
    arch.eval()
    plain = arch.model(x)
    assert torch.equal(arch(x), plain)
    arch.train()
    torch.manual_seed(1)
    whole = arch(x)
    parts = []
    for off, n in ((0, 4), (4, 6)):  # two "ranks": rows [0, 4) and [4, 10) of the global batch of 10
        torch.manual_seed(1)
        set_dropout_rows(arch, 10, off)
        parts.append(arch(x[off:off + n]))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)
    assert not torch.allclose(whole, plain)
    set_dropout_rows(arch, None, 0)
    torch.manual_seed(1)
    assert torch.equal(arch(x), whole)  # no global rows: the batch is the whole batch
    with pytest.raises(ConfigError, match="train.dropout"):
        set_dropout(arch, 1.0)
    assert set_dropout(torch.nn.Sequential(arch), 0.1) == 1 and arch.dropout == 0.1


@pytest.mark.parametrize("p", [0.5, 0.1, 0.3])
def test_dropout_rate_scale_and_gradient_against_the_definition(p):
    """Inverted dropout (Srivastava et al. 2014): an element is dropped with probability p (the mask's resolution is
    2^-8 or 2^-16), kept ones are scaled by 1 / P(keep); the fused ReLU + mask node's output and input gradient
    equal ``relu(h) * mask / keep`` computed by autograd in float64."""
    from embedscale.models.dlrm import OverArch, dropout_mask, quantized_keep

    keep = 1.0 - p
    assert abs(quantized_keep(keep) - keep) <= 2 ** -17
    torch.manual_seed(3)
    m = dropout_mask(4096, 0, 4096, 64, keep, "cpu")
    assert abs(m.float().mean().item() - quantized_keep(keep)) < 4 * (keep * p / m.numel()) ** 0.5 + 1e-3
    torch.manual_seed(3)
    mf = dropout_mask(4096, 0, 4096, 64, keep, "cpu", torch.float32)
    assert torch.equal(mf, m.float())

    torch.manual_seed(0)
    arch = OverArch(5, [7], dropout=p).train()
    x = torch.randn(300, 5)
    torch.manual_seed(9)
    out = arch(x)
    out.sum().backward()
    got_w = arch.model[0].weight.grad.clone()
    torch.manual_seed(9)
    mask = dropout_mask(300, 0, 300, 7, keep, "cpu").double()
    lin0, lin1 = arch.model[0], arch.model[2]
    w0, b0 = lin0.weight.detach().double().requires_grad_(), lin0.bias.detach().double()
    h = torch.relu(x.double() @ w0.t() + b0) * mask / quantized_keep(keep)
    ref = h @ lin1.weight.detach().double().t() + lin1.bias.detach().double()
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w.double(), w0.grad, rtol=1e-4, atol=1e-5)


def test_step_times_drop_the_warm_up_and_keep_a_bounded_tail(monkeypatch):
    """The summary's steady-state step figures against numpy on the same list: the first ``WARMUP`` steps (or
    the first third of a shorter run) left out, the last ``KEEP`` kept."""
    from embedscale.train.loop import StepTimes
    t = StepTimes()
    assert t.figures()["steps"] == 0 and t.figures()["median"] != t.figures()["median"]  # NaN without steps
    times = [1.0] * 10 + [0.01 * (i % 7 + 1) for i in range(50)]  # 10 slow warm-up steps, then the steady state
    for x in times:
        t.add(x)
    f = t.figures()
    assert f["skipped"] == 10 and f["steps"] == 50
    assert f["median"] == np.median(times[10:]) and f["p90"] == np.percentile(times[10:], 90)
    assert abs(f["mean"] - np.mean(times[10:])) < 1e-12
    short = StepTimes()
    for x in [5.0, 1.0, 2.0, 3.0, 4.0, 6.0]:
        short.add(x)
    assert short.figures()["skipped"] == 2 and short.figures()["median"] == 3.5
    monkeypatch.setattr(StepTimes, "KEEP", 20)
    tail = StepTimes()
    for i in range(100):
        tail.add(float(i))
    g = tail.figures()  # the warm-up lies outside the kept tail: all 20 kept steps count
    assert g["steps"] == 20 and g["median"] == np.median(np.arange(80, 100)) and g["skipped"] == 10


def test_printed_summary_shows_the_steady_step_only_when_there_is_one():
    """``embedscale run``'s summary text: the steady-state step from ``train_step_seconds`` (ms, p90, warm-up
    steps) after the all-steps samples/s; nothing more for a run with no step after its warm-up."""
    from embedscale.workflow import format_summary
    base = {"run_dir": "r", "num_tables": 2, "steps": 30, "samples": 3000, "train_samples_per_s": 1234.5}
    st = {"median": 0.0123, "p90": 0.02, "mean": 0.013, "steps": 20, "skipped": 10}
    line = format_summary({**base, "train_step_seconds": st}).splitlines()[2]
    assert line.endswith("1,234 samples/s; steady step 12.3 ms (p90 20.0) after 10 warm-up steps"), line
    for none in ({}, {"train_step_seconds": {**st, "steps": 0, "median": float("nan")}}):
        assert format_summary({**base, **none}).splitlines()[2].endswith("1,234 samples/s")
