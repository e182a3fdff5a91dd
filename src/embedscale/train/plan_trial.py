"""The measured choice of a ``dist.plan auto`` run (``dist.plan_trial_steps`` > 0): where the cost model's best
plans (the search's plan and the rules' plans it weighed, ``plan.auto_rules``) are within its own error of each
other (``plan.choose.prediction_margin``: the calibration's measured prediction error, else 10%, of the whole
step), each of the closest and the best of every rule family within that error (``plan.choose.trial_plans``) runs
``dist.plan_trial_steps`` steps on the run's ranks and data (``embedscale train`` under that plan, in
``<run dir>/plan-trial/<n>/``; over ``dist.plan_trial_rounds`` rounds the plans still within
``plan.choose.RERUN_MARGIN`` of the best run again) and the one of least steady-state step is the run's plan
(:func:`embedscale.plan.choose.measured_choice`). The choice, the candidates' predicted and measured steps and the
trial's seconds go into the explain report (``measured_choice``) and the run's summary (``plan_trial_seconds``,
``plan_trial_chosen``; a run started by ``embedscale run`` has them in its ``wall_seconds`` too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from embedscale import assemble
from embedscale.errors import EmbedscaleError
from embedscale.io import atomic_write_text
from embedscale.plan.api import make_plan
from embedscale.plan.choose import measured_choice, prediction_margin, trial_plans
from embedscale.plan.forms import TableForm, replicated_tables_meta, with_reorder
from embedscale.plan.plan import Plan
from embedscale.reorder import reordering_meta
from embedscale.specs import RunConfig, dump_config

TRIAL_DIR = "plan-trial"


def candidate_plans(rep: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The plans an auto plan's explain data (``plan.meta["auto"]``) weighed, by the model's prediction: the plan
    chosen (``auto``) and every other that fits (the search's own, the rules'), each once by its forms, with the
    rule families it stands for (a replicated table's form is the sharded one: a candidate other than the auto
    plan is built with its exact tables placed by OPER). Each prediction is the whole step: the rules' seconds
    plus the terms every plan pays (the dense model, its all-reduce, the fixed overheads), so a margin relative
    to the step (the calibration's error) is applied to the step."""
    by = rep["chosen_by"]
    name = by[len("rule: "):] if by.startswith("rule: ") else "search"
    fixed = float(rep.get("predicted_step_seconds", 0.0)) - float(rep.get("predicted_embedding_step_seconds", 0.0))
    chosen = next((r for r in rep.get("rules", ()) if r["rule"] == name), None)
    out = [{"name": "auto", "predicted_seconds": float(rep["plan_model_seconds"]) + fixed,
            "table_forms": dict(chosen["table_forms"]) if chosen else None,
            "families": [chosen["family"]] if chosen and chosen.get("family") else []}]
    for r in rep.get("rules", ()):
        if not r["fits"]:
            continue
        same = next((c for c in out if c["table_forms"] == r["table_forms"]), None)
        if same is None:
            out.append({"name": r["rule"], "predicted_seconds": float(r["predicted_seconds"]) + fixed,
                        "table_forms": dict(r["table_forms"]), "families": []})
            same = out[-1]
        if r.get("family") and r["family"] not in same["families"]:
            same["families"].append(r["family"])
    return out


def _save(cfg: RunConfig, data, tables, prof, plan: Plan, out: Path, progress: bool) -> Path:
    """``plan`` saved in ``out`` with its TT tables' index reordering (``assemble.run_reordering``), as
    ``make_run_plan`` saves a run's plan."""
    out.mkdir(parents=True, exist_ok=True)
    reo = assemble.run_reordering(cfg, data, tables, plan.forms, out, progress, prof=prof)
    if reo is not None:
        plan.meta["reordering"] = reordering_meta(reo)
    plan.save(out)
    return out


def _build(cfg: RunConfig, tables, prof, topo, table_forms: Mapping[str, Any]) -> Plan:
    """A candidate's plan as ``make_run_plan`` makes a hand-made one: OPER for its exact tables, its forms."""
    forms = {n: TableForm.from_dict(f, f"plan trial form of {n}") for n, f in table_forms.items()}
    forms = with_reorder({t.name: forms.get(t.name, TableForm()) for t in tables}, cfg.model.tt_reorder)
    plan = make_plan("oper", tables, prof, topo, forms=forms, mode=cfg.dist.mode, extra_memory=0.0,
                     batch_size=max(1, cfg.train.batch_size // cfg.dist.nproc))
    if any(f.kind == "tt" for f in forms.values()):
        plan.meta["replicated_tables"] = replicated_tables_meta(tables, forms)
    plan.meta["forms"] = {n: f.to_dict() for n, f in forms.items()}
    return plan


#: what a rank's environment says of its own launch (torchrun's and the launcher's): a trial is a launch of its own
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EMBEDSCALE_RUN_ID", "EMBEDSCALE_LAUNCH_ID",
            "EMBEDSCALE_LAUNCHER_PID", "EMBEDSCALE_LAUNCHED")


def launch_env() -> dict[str, str]:
    """This process's environment without what makes a process a rank of the running launch (a plan made in
    rank 0 starts its trials as launches of their own, not as ranks joining this one)."""
    return {k: v for k, v in os.environ.items() if k not in RANK_ENV and not k.startswith("TORCHELASTIC_")}


def _time(cfg: RunConfig, plan_dir: Path, run_dir: Path, steps: int) -> tuple[float, int]:
    """The steady-state step (the summary's ``train_step_seconds`` median) of ``steps`` steps under ``plan_dir``, and
    the steps it is the median of (those after the warm-up)."""
    trial = replace(cfg, dist=replace(cfg.dist, plan=str(plan_dir), device_memory="", host_memory="", costs="",
                                      plan_trial_steps=0),
                    train=replace(cfg.train, max_steps=int(steps), eval_every=0, checkpoint_every=0, replan_every=0))
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    atomic_write_text(run_dir / "trial.yaml", dump_config(trial))
    p = subprocess.run([sys.executable, "-m", "embedscale", "train", "--config", str(run_dir / "trial.yaml"),
                        "--run-dir", str(run_dir / "run"), "--no-progress"], capture_output=True, text=True,
                       env=launch_env())
    if p.returncode:
        raise EmbedscaleError(f"plan trial under {plan_dir} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    s = json.loads((run_dir / "run" / "summary.json").read_text())
    shutil.rmtree(run_dir / "run" / "checkpoints", ignore_errors=True)  # a timing, not a model (1+ GB a candidate)
    step = s["train_step_seconds"]
    return float(step["median"]), int(step.get("steps", 0))


def choose_by_trial(cfg: RunConfig, plan: Plan, data, tables: Sequence, prof, topo, plan_dir: Path,
                    progress: bool, costs_notes: Mapping[str, Any] | None = None) -> Plan:
    """``plan`` (an auto plan), or the candidate the trial measured fastest among the model's close plans and the
    rule families' best within its error (module docstring); the choice is recorded in
    ``plan.meta["auto"]["measured_choice"]``, its ``trial_seconds`` counting the candidates' building too."""
    rep = plan.meta["auto"]
    cands = candidate_plans(rep)
    margin = prediction_margin(costs_notes)
    timed, _ = trial_plans(cands, margin)
    if len(timed) < 2:
        rep["measured_choice"] = measured_choice(cands, margin, lambda _n: [])
        return plan
    t0 = time.perf_counter()
    work = plan_dir.parent / TRIAL_DIR
    dirs: dict[str, Path | EmbedscaleError] = {}
    for i, c in enumerate(timed):
        try:
            cand = plan if c["name"] == "auto" else _build(cfg, tables, prof, topo, c["table_forms"])
            dirs[c["name"]] = _save(cfg, data, tables, prof, cand, work / str(i) / "plan", progress)
        except EmbedscaleError as e:  # not buildable (e.g. OPER finds no placement): not timed, the report says why
            dirs[c["name"]] = EmbedscaleError(f"plan trial: building {c['name']!r} failed: {e}")
    build = time.perf_counter() - t0
    steps = int(cfg.dist.plan_trial_steps)

    steady: dict[str, int] = {}  # each candidate's steps its timings are the medians of

    def time_plan(name: str) -> list[float]:
        d = dirs[name]
        if isinstance(d, EmbedscaleError):
            raise d
        median, n = _time(cfg, d, d.parent / "run", steps)
        steady[name] = steady.get(name, 0) + n
        return [median]

    choice = measured_choice(cands, margin, time_plan, rounds=int(cfg.dist.plan_trial_rounds))
    for c in choice["candidates"]:  # a timing is the median of its run's steady steps
        if c["name"] in steady and "steps_timed" in c:
            c["steps_timed"] = steady[c["name"]]
    choice.update(build_seconds=build, trial_seconds=choice["trial_seconds"] + build)
    rep["measured_choice"] = choice
    if choice["chosen"] == "auto":
        return plan
    chosen = Plan.load(dirs[choice["chosen"]])
    chosen.meta["strategy"] = "auto"
    chosen.meta["auto"] = {**rep, "chosen_by": f"measured: {choice['chosen']}"}
    return chosen
