"""``embedscale calibrate --ranks N``: the distributed executor's own work per table form, from real N-rank steps.

The auto planner's prediction is held to within 20% of the measured step (BENCHMARKS.md). The single-process costs of
:mod:`embedscale.calibrate` do not see what only a run of N ranks does: bucketing the ids by owner, the
exchanges beyond their bytes, the host tables' all-gathers and server reads in the prefetch thread, and the N
ranks and their loader threads sharing the machine's cores. The full-size benchmark's predictions were low in
32 of 36 runs. Here, on the run's device and at its per-rank batch, a small synthetic criteo-kaggle (26 tables,
rows capped at ``rows``) is trained by ``embedscale train --nproc N`` (the very executor and loop the runs use,
their timer: train steps only) under five plans made by ``embedscale plan``:

* ``sharded``: every table sharded exact, placed by OPER;
* ``tt``: the ``big`` largest tables TT of rank ``tt_rank``, the rest sharded;
* ``host``: the ``big`` largest tables on the host parameter server at pipeline depth ``host_depth``, the
  rest sharded;
* ``host-few``: the same with only the 2 largest tables on the host. A host plan costs the executor a part per
  step whatever its number of host tables (the server's and the pipeline's threads, the rows' all-gathers): on
  the 2-core benchmark machine the 5-table plan ran ~10 ms a step slower than the sharded one and the 2-table
  plan ~7.5 ms. With two sizes the fit separates it (``executor_overhead_s["host_step"]``,
  :meth:`Costs.host_step_overhead`) from the part per table. Fitted per table only, it was spread over five
  tables, and a plan of two host tables was predicted 3-4 ms too fast: from one calibration to the next, the
  noise decided whether the search chose host tables (benchmark history, run Y);
* ``tt-host``: the 2 largest on the host and the rest of the ``big`` TT. Host and TT tables beside each other
  cost more than each alone: on a CPU the host pipeline's threads run in the gaps a step waits on its exchanges,
  and TT's compute fills those gaps. Plans of host and TT tables were predicted 2-6% fast while TT plans were
  predicted 1-3% slow, so from one calibration to the next the search chose two host tables over two TT tables
  by a predicted 1 ms that ran 3-4 ms slower (benchmark history, runs AA, AC). This plan's residual beyond the others'
  is ``executor_overhead_s["host_tt_step"]`` (:meth:`Costs.host_tt_step_overhead`), once per step;

``repeats`` rounds in turns (every plan sees the same load), ``steps`` steps each; a run's step is its
steady state (the summary's ``train_step_seconds`` median: the first 10 steps, or a third of a shorter run, left
out), a plan's measured step the median over the rounds. Each plan is predicted by :func:`embedscale.plan.autoplan.predict_plan_forms` with the
single-process ``costs`` measured in the same command, and :func:`embedscale.plan.step.fit_executor` fits
first one scale of the whole prediction (the single-process figures saw one process's share of a shared
machine, the N ranks get N shares; the costs' time figures are scaled by it, :meth:`Costs.scaled`), then the
residuals beyond the plan's own spread over the rounds as non-negative seconds per table and step of each form
kind (``Costs.executor_overhead_s``,
``executor_world = N``). The planner adds them to every candidate on several ranks (the search weighs them) and
the predicted step reports them as its ``executor`` part. The fit also absorbs whatever bias the
single-process figures of the same command carry on the machine as it is (the overheads are differences),
so the costs file is one measurement: calibrate again, whole, when the machine changes.

The calibration can also time the very tables of the run: ``rows = 0`` (no cap) or the run's own data placed
in ``work / "data"``. In one full-size run (benchmark history, run E) the plans with two host tables of 2.2M and
5.5M rows ran 30-45 ms a step slower than a fit on tables capped at 1M rows predicted; the two fits on the full-size
tables that followed (runs F, G) found no host overhead at all, so a size effect is not established: on the shared
machine the load's swings are larger than it.

Designed for any device (``--device``; untested on GPU). The dense model is the default DLRM (``DenseModel()``
sizes, 13 dense and 26 sparse features, as ``embedscale train`` builds it by default).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from embedscale.data.profile import AccessProfile
from embedscale.data.synthetic import generate_dataset
from embedscale.errors import ConfigError, EmbedscaleError
from embedscale.plan.auto import Costs, executor_overheads_text
from embedscale.plan.api import plan_command, resolve_topology
from embedscale.plan.autoplan import predict_plan_forms, with_topology_links
from embedscale.plan.forms import SHARDED, TableForm, tables_from_profile
from embedscale.plan.step import DenseModel, fit_executor, form_counts, held_out_errors
from embedscale.specs import SyntheticConfig, Topology, TrainConfig

PLANS = ("sharded", "tt", "host", "host-few", "tt-host")  # one per form kind, a second host plan, the two beside


def few_host_tables(big: int) -> int:
    """Host tables of the ``host-few`` plan: 2 (1 when ``big`` is 2 or less), so that with the ``big`` of the
    ``host`` plan the fit separates the host form's cost per step from its cost per table."""
    return 2 if big > 2 else 1


def plan_forms(tables, kind: str, big: int, tt_rank: int, host_depth: int) -> dict[str, TableForm]:
    """The forms of calibration plan ``kind`` (every table's): the ``big`` largest tables (rows, then name) TT /
    host, the others sharded; ``host-few``: the :func:`few_host_tables` largest on the host; ``tt-host``: those
    on the host and the rest of the ``big`` TT."""
    out = {t.name: SHARDED for t in tables}
    if kind == "sharded":
        return out
    if kind == "tt-host":
        order = sorted(tables, key=lambda t: (-t.num_rows, t.name))[:big]
        few = few_host_tables(big)
        for i, t in enumerate(order):
            out[t.name] = TableForm("host", pipeline_depth=host_depth) if i < few else TableForm("tt", tt_rank=tt_rank)
        return out
    form = TableForm("tt", tt_rank=tt_rank) if kind == "tt" else TableForm("host", pipeline_depth=host_depth)
    n = big if kind != "host-few" else few_host_tables(big)
    for t in sorted(tables, key=lambda t: (-t.num_rows, t.name))[:n]:
        out[t.name] = form
    return out


def _train(work: Path, run_dir: Path, plan_dir: Path, ranks: int, global_batch: int, steps: int, depth: int,
           device: str, dim: int, nodes=None, round_: int = 0) -> float | None:
    """One ``embedscale train --nproc ranks`` run; its steady-state step in seconds (the summary's
    ``train_step_seconds`` median: the loop's timer, the warm-up steps left out). ``nodes``
    (``train.launcher.Nodes``): this node's part of a run over several, under a rendezvous id of its own
    (``None`` on a node without rank 0: rank 0's node has the summary)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "embedscale", "train", "--data-source", "shards", "--data-path", str(work / "data"),
           "--train-batch-size", str(global_batch), "--train-max-steps", str(steps), "--train-eval-every", "0",
           "--train-checkpoint-every", "0", "--nproc", str(ranks), "--dist-plan", str(plan_dir),
           "--train-pipeline-depth", str(depth), "--train-device", device, "--model-embedding-dim", str(dim),
           "--run-dir", str(run_dir), "--no-progress"]
    if nodes is not None and nodes.multi:
        cmd += ["--nnodes", str(nodes.nnodes), "--node-rank", str(nodes.node_rank), "--rdzv-endpoint",
                nodes.endpoint, "--rdzv-id", f"{nodes.rdzv_id}-{run_dir.name}-{round_}"]
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if p.returncode:
        raise EmbedscaleError(f"calibrate --ranks: the {ranks}-rank run under {plan_dir.name} failed (exit "
                              f"{p.returncode}):\n{p.stderr[-2000:]}")
    if not (run_dir / "summary.json").exists():  # a node without rank 0
        shutil.rmtree(run_dir, ignore_errors=True)
        return None
    s = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return float(s["train_step_seconds"]["median"])


def calibrate_ranks(costs: Costs, *, ranks: int = 2, batch: int = 1024, rows: int = 1_000_000, dim: int = 16,
                    steps: int = 60, repeats: int = 3, tt_rank: int = 32, host_depth: int = 2, big: int = 5,
                    device: str = TrainConfig.device, seed: int = 0, work: str | os.PathLike | None = None,
                    log: Callable[[str], None] | None = None, nodes=None) -> Costs | None:
    """``costs`` (single-process, :func:`embedscale.calibrate.calibrate` at the same ``batch`` and ``dim``) with
    the executor overheads of ``ranks`` ranks fitted (module docstring). ``batch``: samples per rank and step;
    ``rows``: the cap on every table's rows of the generated data (0: the preset's full sizes); ``work``: a
    directory to keep the data, plans and timings in (default: a temporary one, removed); data already in
    ``work / "data"`` (e.g. a link to the run's own data) is used as it is, not generated. ``nodes``
    (``train.launcher.Nodes``): run on every node with the same flags; ``ranks`` is then per node, the topology
    the nodes' (``nnodes`` hosts); the node of rank 0 fits and returns the costs, the others ``None``."""
    if ranks < 2:
        raise ConfigError(f"calibrate --ranks: at least 2 ranks needed to time the distributed executor, got {ranks}")
    if steps < 2 or repeats < 1 or big < 1 or batch < 1 or not (rows == 0 or rows >= 8):
        raise ConfigError(f"calibrate --ranks: steps >= 2, repeats >= 1, big >= 1, batch >= 1, rows >= 8 needed; got "
                          f"steps={steps}, repeats={repeats}, big={big}, batch={batch}, rows={rows}")
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    tmp = None
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="embedscale-calibrate-ranks-")
        work = tmp.name
    work = Path(work).resolve()
    try:
        return _calibrate_ranks(costs, work, ranks, batch, rows, dim, steps, repeats, tt_rank, host_depth, big,
                                str(device), seed, say, nodes)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _calibrate_ranks(costs, work: Path, ranks, batch, rows, dim, steps, repeats, tt_rank, host_depth, big, device,
                     seed, say, nodes=None) -> Costs | None:
    work.mkdir(parents=True, exist_ok=True)
    hosts = nodes.nnodes if nodes is not None else 1
    global_batch = ranks * hosts * batch
    t0 = time.perf_counter()
    if not (work / "data" / "manifest.json").exists():
        generate_dataset(SyntheticConfig(preset="criteo-kaggle", max_rows=rows), work / "data", global_batch * steps,
                         seed=seed, progress=False)
    prof = AccessProfile.from_shards(work / "data", progress=False)
    prof.save(work / "profile")
    tables = tables_from_profile(prof, dim)
    topo = Topology(num_hosts=hosts, ranks_per_host=ranks)
    dense = DenseModel(num_features=len(tables), embedding_dim=dim)
    forms = {k: plan_forms(tables, k, big, tt_rank, host_depth) for k in PLANS}
    for k, f in forms.items():
        plan_command(tables, work / "profile", topo, ["oper"], work / f"plan-{k}", batch_size=batch, png=False,
                     forms=f)
    say(f"calibrate --ranks {ranks}: data, profile and plans in {time.perf_counter() - t0:.0f} s; timing "
        f"{len(PLANS)} plans x {repeats} rounds of {steps} steps")
    step_s: dict[str, list[float]] = {k: [] for k in PLANS}
    load = [list(os.getloadavg())]
    for i in range(repeats):
        for k in PLANS:
            step_s[k].append(_train(work, work / f"run-{k}", work / f"plan-{k}" / "oper", ranks, global_batch, steps,
                                    host_depth, device, dim, nodes, i))
            if step_s[k][-1] is not None:
                say(f"  {k} round {i}: {step_s[k][-1] * 1e3:.1f} ms/step")
        load.append(list(os.getloadavg()))
    if any(s is None for v in step_s.values() for s in v):
        say(f"calibrate --ranks: node {nodes.node_rank} ran its ranks' part; the node of rank 0 writes the costs")
        return None
    base = Costs(**{**costs.__dict__, "executor_overhead_s": {}, "executor_world": 0})
    if not base.notes.get("links_measured"):  # the topology's links, so that the scale applies to them too
        base = with_topology_links(base, resolve_topology(topo))
    runs = {}
    for k in PLANS:
        p = predict_plan_forms(tables, work / "profile", topo, forms[k], costs=base, batch_size=batch, dense=dense,
                               host_depth=host_depth)
        runs[k] = {"tables": form_counts(list(p["forms"].values())),
                   "measured_s": float(np.median(step_s[k])), "predicted_s": float(p["step_seconds"]),
                   "steps_s": list(step_s[k])}
    scale, over = fit_executor(list(runs.values()))
    held = dict(zip(runs, held_out_errors(list(runs.values()))))  # each plan predicted by a fit on the others
    scaled = base.scaled(scale)
    known = [abs(e) for e in held.values() if e is not None]
    if known:  # the model's own error out of sample (plan.choose.prediction_margin reads it)
        scaled.notes["prediction_error"] = max(known)
    out = Costs(**{**scaled.__dict__, "executor_overhead_s": over, "executor_world": int(ranks),
                   "notes": {**scaled.notes, "executor": {
                       "scale": scale, "single_process_costs": {k: v for k, v in base.to_dict().items() if k != "notes"},
                       "ranks": ranks, "batch_per_rank": batch, "rows_cap": rows, "steps": steps, "repeats": repeats,
                       "tt_rank": tt_rank, "host_depth": host_depth, "big_tables": big, "plans": runs,
                       "statistic": "median over rounds of each run's steady-state step (train_step_seconds)",
                       "load_average": load, "seconds": time.perf_counter() - t0,
                       "held_out_error": held}}})
    say(f"calibrate --ranks {ranks}: single-process figures scaled by {scale:.3f}; executor overhead "
        + executor_overheads_text(over) + "; each plan predicted by a fit on the others (out of sample): "
        + ", ".join(f"{k} {'-' if e is None else f'{e:+.1%}'}" for k, e in held.items()))
    return out


def refit(costs: Costs) -> Costs:
    """``costs`` of ``calibrate --ranks`` fitted again, by the current :func:`~embedscale.plan.step.fit_executor`,
    from the timings it recorded (``notes["executor"]["plans"]``: each plan's measured step and its prediction by
    the single-process figures, ``notes["executor"]["single_process_costs"]`` or, in a file written before that
    note, the file's own figures): a recorded calibration read by a newer model without timing anything again."""
    ex = costs.notes.get("executor") or {}
    if not ex.get("plans"):
        raise ConfigError("refit: these costs hold no recorded N-rank timings (calibrate --ranks)")
    single = ex.get("single_process_costs")
    base = (Costs.from_dict({**single, "format": costs.to_dict()["format"]}, "single_process_costs") if single
            else Costs(**{**costs.__dict__, "executor_overhead_s": {}, "executor_world": 0}))
    if not (base.notes.get("links_measured") or base.notes.get("links_from")):
        base = with_topology_links(base, resolve_topology(Topology(num_hosts=1, ranks_per_host=int(ex["ranks"]))))
    scale, over = fit_executor(list(ex["plans"].values()))
    scaled = base.scaled(scale)
    return Costs(**{**scaled.__dict__, "executor_overhead_s": over, "executor_world": int(ex["ranks"]),
                    "source": costs.source, "notes": {**costs.notes, **scaled.notes,
                                                      "executor": {**ex, "scale": scale, "refit": True}}})
