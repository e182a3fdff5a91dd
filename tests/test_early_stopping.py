"""Early stopping, the best checkpoint and the bounded warmup in the one loop (``train.loop.fit``).

A scripted run (the ``Run`` protocol with a known evaluation curve, no model) checks the loop's decisions
against the curve: where it stops, which step ``checkpoints/best`` names, what the summary reports, and that a
run interrupted and resumed from its checkpoint decides exactly as the uninterrupted one. A real
single-process run on shards then checks the best checkpoint against ``metrics.csv`` and ``embedscale
evaluate``."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import config, make_data  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.cli import main  # noqa: E402
from embedscale.errors import ConfigError  # noqa: E402
from embedscale.train.checkpoint import (best_checkpoint, best_pointer, latest_checkpoint,  # noqa: E402
                                         load_checkpoint, read_manifest, read_shards, resolve_checkpoint,
                                         step_dir, write_best, write_rank_file)
from embedscale.train.loop import LoopConfig, fit, improved, warmup_steps  # noqa: E402
from embedscale.train.run import RunState  # noqa: E402


class Interrupted(Exception):
    pass


class Batches:
    def __init__(self, n):
        self.n, self.skip = n, 0

    def __len__(self):
        return self.n

    def set_epoch(self, epoch, skip_batches=0):
        self.skip = skip_batches

    def __iter__(self):
        for _ in range(self.n - self.skip):
            yield SimpleNamespace(batch_size=4, global_size=4)


class ScriptedRun:
    """A world of one whose eval AUC at step s is ``curve[s]`` (logloss 1 - AUC); ``die_at``: raise there."""

    rank, world, progress = 0, 1, False

    def __init__(self, run_dir, curve, steps_per_epoch=100, die_at=None):
        self.run_dir, self.curve, self.die_at = Path(run_dir), curve, die_at
        self.state = RunState()
        self.train_loader, self.eval_loader = Batches(steps_per_epoch), object()
        self.opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        self.evals: list[int] = []
        self.lrs: list[float] = []

    def train_step(self, batch):
        if self.die_at is not None and self.state.step == self.die_at:
            raise Interrupted
        self.lrs.append(self.opt.param_groups[0]["lr"])
        return 0.5

    def evaluate(self):
        self.evals.append(self.state.step)
        auc = self.curve[self.state.step]
        return {"auc": auc, "logloss": 1 - auc, "ne": 1 - auc, "calibration": 1.0, "samples": 10}

    def save(self, d):
        write_rank_file(d, 0, {"rank": 0, "world_size": 1, "losses": list(self.state.losses),
                               "optimizer_groups": [{k: v for k, v in self.opt.param_groups[0].items()
                                                     if k != "params"}]})
        return {"kind": "scripted"}

    def restore(self, d):
        m = read_manifest(d)
        r0 = read_shards(d, m)[0]
        self.opt.param_groups[0].update(r0["optimizer_groups"][0])
        self.state.restore(m, r0["losses"])

    def figures(self):
        return {}

    def barrier(self):
        pass

    def step_error(self, err):
        return err


# AUC per step: rises to 0.8 at step 10, then falls; evaluated every 2 steps
CURVE = {s: 0.8 - abs(s - 10) * 0.01 for s in range(0, 200)}
CURVE[12] = 0.8  # a tie with the best is no improvement


def test_stops_after_patience_and_keeps_the_best(tmp_path):
    run = ScriptedRun(tmp_path, CURVE)
    loop = LoopConfig(epochs=20, eval_every=2, early_stopping_patience=3)
    s = fit(run, loop)
    # evaluations at 2, 4, ..., 10 (best), 12 (tie), 14, 16: three in a row without improvement -> stop at 16
    assert run.evals == [2, 4, 6, 8, 10, 12, 14, 16] and s["steps"] == 16 and s["stopped_early"]
    assert s["best"]["step"] == 10 and s["best"]["eval_auc"] == pytest.approx(0.8)
    assert s["eval_auc"] == pytest.approx(CURVE[16]) and s["early_stopping"]["bad_evals"] == 3
    ck = best_checkpoint(tmp_path)
    assert ck is not None and ck.name == "step-00000010" and read_manifest(ck)["step"] == 10
    assert read_manifest(tmp_path / "checkpoints" / "best")["early_stopping"]["best_step"] == 10
    assert resolve_checkpoint(tmp_path / "checkpoints" / "best") == ck == resolve_checkpoint(tmp_path, best=True)
    assert latest_checkpoint(tmp_path).name == "step-00000016"  # the last model beside the best
    # earlier bests were removed once beaten (no periodic checkpoints asked for)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "step-00000010", "step-00000016"]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r["eval_auc"]] == run.evals
    assert all(r["eval_ne"] and r["eval_calibration"] for r in rows if r["eval_auc"])


def test_monitoring_logloss_and_min_delta(tmp_path):
    run = ScriptedRun(tmp_path, CURVE)
    s = fit(run, LoopConfig(epochs=20, eval_every=2, early_stopping_patience=2, early_stopping_metric="logloss",
                            early_stopping_min_delta=0.015))
    # logloss improves by 0.02 per evaluation up to step 10: every one counts; 12 (same) and 14 (worse) stop it
    assert s["best"]["step"] == 10 and s["steps"] == 14 and s["best"]["metric"] == "logloss"
    assert s["best"]["value"] == pytest.approx(0.2)


def test_patience_zero_never_stops(tmp_path):
    run = ScriptedRun(tmp_path, CURVE, steps_per_epoch=5)
    s = fit(run, LoopConfig(epochs=6, eval_every=0, early_stopping_patience=0))  # evaluated at each epoch's end
    assert run.evals == [5, 10, 15, 20, 25, 30] and s["steps"] == 30 and not s["stopped_early"]
    assert s["best"]["step"] == 10


@pytest.mark.parametrize("die_at", [7, 11, 13])
def test_resume_decides_as_the_uninterrupted_run(tmp_path, die_at):
    loop = LoopConfig(epochs=20, eval_every=2, checkpoint_every=3, early_stopping_patience=3, lr_warmup_steps=8,
                      lr_warmup_fraction=0.5)
    full = ScriptedRun(tmp_path / "full", CURVE)
    ref = fit(full, loop)
    cut = ScriptedRun(tmp_path / "cut", CURVE, die_at=die_at)
    with pytest.raises(Interrupted):
        fit(cut, loop)
    again = ScriptedRun(tmp_path / "cut", CURVE)
    again.restore(latest_checkpoint(tmp_path / "cut"))
    got = fit(again, loop)
    for k in ("steps", "stopped_early", "eval_auc", "early_stopping"):
        assert got[k] == ref[k], k
    assert {**got["best"], "checkpoint": ""} == {**ref["best"], "checkpoint": ""}
    assert best_checkpoint(tmp_path / "cut").name == best_checkpoint(tmp_path / "full").name == "step-00000010"
    resumed_at = again.state.step - len(again.lrs)
    assert again.lrs == full.lrs[resumed_at:]  # the warmup continues where it was
    # every evaluation after the restored step happens again, none before it
    assert again.evals == [s for s in full.evals if s > resumed_at]


def test_a_stopped_run_resumed_stays_stopped(tmp_path):
    loop = LoopConfig(epochs=20, eval_every=2, early_stopping_patience=3)
    ref = fit(ScriptedRun(tmp_path, CURVE), loop)
    again = ScriptedRun(tmp_path, CURVE)
    again.restore(latest_checkpoint(tmp_path))
    got = fit(again, loop)
    assert again.evals == [] and again.lrs == []  # nothing trained, nothing scored again
    assert got["steps"] == ref["steps"] and got["best"] == ref["best"] and got["eval_auc"] == ref["eval_auc"]


def test_warmup_is_bounded_by_the_run():
    assert warmup_steps(LoopConfig(lr_warmup_steps=100, lr_warmup_fraction=0.1), 80) == 8
    assert warmup_steps(LoopConfig(lr_warmup_steps=100, lr_warmup_fraction=0.1), 5000) == 100
    assert warmup_steps(LoopConfig(lr_warmup_steps=100, lr_warmup_fraction=0.1), 5) == 1
    assert warmup_steps(LoopConfig(lr_warmup_steps=0, lr_warmup_fraction=0.1), 5000) == 0


def test_warmup_fraction_ramps_within_the_run(tmp_path):
    run = ScriptedRun(tmp_path, CURVE, steps_per_epoch=10)
    fit(run, LoopConfig(epochs=2, lr_warmup_steps=100, lr_warmup_fraction=0.2, early_stopping_patience=0))
    assert run.lrs[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # 20 steps: 4 of warmup, not 100


def test_improved_and_bad_settings():
    auc = LoopConfig(early_stopping_metric="auc", early_stopping_min_delta=0.01)
    assert improved(auc, 0.7, None) and not improved(auc, math.nan, None)
    assert improved(auc, 0.72, 0.7) and not improved(auc, 0.705, 0.7)
    ll = LoopConfig(early_stopping_metric="logloss")
    assert improved(ll, 0.4, 0.5) and not improved(ll, 0.5, 0.5)
    with pytest.raises(ConfigError, match="early_stopping_metric"):
        LoopConfig(early_stopping_metric="accuracy")
    with pytest.raises(ConfigError, match="lr_warmup_fraction"):
        LoopConfig(lr_warmup_fraction=1.5)
    # the config names the key before anything runs
    from embedscale.specs import load_config

    for key, value in (("train.lr_warmup_fraction", 1.5), ("train.early_stopping_metric", "accuracy"),
                       ("train.dropout", 1.0), ("train.early_stopping_patience", -1),
                       ("train.early_stopping_min_delta", -0.1)):
        with pytest.raises(ConfigError, match=key):
            load_config(None, {key: value})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_data(d)
    return d


def test_single_process_run_keeps_the_best_checkpoint(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    cfg.train.epochs, cfg.train.eval_every, cfg.train.max_steps = 4, 2, 0
    cfg.train.early_stopping_patience = 0
    cfg.train.lr_sparse = 2.0  # overfits fast: the last evaluation is rarely the best
    rd = tmp_path / "run"
    s = workflow.train(cfg, rd, resume=False, progress=False)
    rows = [r for r in csv.DictReader((rd / "metrics.csv").open()) if r["eval_auc"]]
    top = max(rows, key=lambda r: float(r["eval_auc"]))  # the first of equal maxima is the best
    assert s["best"]["step"] == int(top["step"]) and s["best"]["eval_auc"] == pytest.approx(float(top["eval_auc"]))
    assert s["eval_auc"] == pytest.approx(float(rows[-1]["eval_auc"])) and int(rows[-1]["step"]) == s["steps"]
    best = best_checkpoint(rd)
    assert load_checkpoint(best)["step"] == s["best"]["step"]
    r = CliRunner().invoke(main, ["evaluate", str(rd / "checkpoints" / "best"), "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output.strip().splitlines()[-1])
    assert got["step"] == s["best"]["step"]
    for k in ("auc", "logloss", "ne", "calibration"):
        assert got[k] == pytest.approx(s["best"][f"eval_{k}"], rel=1e-6), k


def test_two_ranks_stop_and_keep_the_best_as_one_process(tmp_path, data_dir):
    """The loop's decisions on 2 ranks (sharded rows, evaluation gathered on every rank) are those of the single
    process on the same data: the same evaluations, best step, stop step and best checkpoint."""
    from test_distributed_train import distributed

    def cfg():
        c = config(tmp_path, data_dir, plan="row_wise")
        c.train.epochs, c.train.max_steps, c.train.eval_every = 6, 0, 2
        c.train.early_stopping_patience, c.train.lr_sparse = 2, 2.0
        return c

    one = workflow.train(cfg(), tmp_path / "one", resume=False, progress=False)
    distributed(cfg(), tmp_path / "two", 2)
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["stopped_early"] and one["steps"] < 6 * 7  # 320 train rows at batch 50: 7 steps an epoch
    assert two["world_size"] == 2 and two["steps"] == one["steps"] and two["stopped_early"]
    assert two["best"]["step"] == one["best"]["step"]
    assert two["best"]["eval_auc"] == pytest.approx(one["best"]["eval_auc"], abs=1e-5)
    rows = [r for r in csv.DictReader((tmp_path / "two" / "metrics.csv").open()) if r["eval_auc"]]
    assert max(rows, key=lambda r: float(r["eval_auc"]))["step"] == str(two["best"]["step"])
    ck = best_checkpoint(tmp_path / "two")
    assert read_manifest(ck)["step"] == two["best"]["step"] and read_manifest(ck)["world_size"] == 2


def test_an_evaluation_after_a_checkpoint_of_the_same_step_is_saved(tmp_path):
    """At an epoch's end the periodic checkpoint comes before the epoch's evaluation; the stop decided by that
    evaluation is written into the step's checkpoint too (a resume must not find a run that has not stopped)."""
    run = ScriptedRun(tmp_path, {s: 0.9 - 0.01 * s for s in range(100)}, steps_per_epoch=4)
    s = fit(run, LoopConfig(epochs=10, eval_every=0, checkpoint_every=4, early_stopping_patience=1))
    assert run.evals == [4, 8] and s["steps"] == 8 and s["stopped_early"]
    es = read_manifest(latest_checkpoint(tmp_path))["early_stopping"]
    assert es["stopped"] and es["eval_step"] == 8 and es["best_step"] == 4 and es["bad_evals"] == 1


def test_best_pointer_replaces_a_copied_best_directory(tmp_path):
    """A run directory copied by a tool that follows links holds ``checkpoints/best`` as a real directory (a
    duplicate of a step directory): the next best is still recorded, as a link again."""
    for s in (2, 4):
        step_dir(tmp_path, s).mkdir(parents=True)
    copied = best_pointer(tmp_path)
    copied.mkdir()
    (copied / "rank-00000.pt").write_bytes(b"copy")
    write_best(tmp_path, 4)
    assert copied.is_symlink() and copied.readlink().name == step_dir(tmp_path, 4).name
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "step-00000002", "step-00000004"]
