"""The auto planner at full size: the auto plan against the plans a user makes by hand, same budget, same run.

    nice -n 15 .venv/bin/python benchmarks/bench_plan_auto_full.py --work /tmp/bench_auto_full \\
        [--max-rows 0] [--steps 60] [--repeats 3] [--batch 2048]

2 gloo ranks, synthetic criteo-kaggle at full size (26 tables, 33.76M rows, dim 16, row-wise Adagrad; about
1.1 GB of rows and state per rank if sharded exact), DLRM of the default sizes, device budget 256 MiB and host
budget 512 MiB per rank. The plans, all made by ``embedscale plan`` from the same profile:

* ``auto``: ``--strategy auto`` with costs measured by ``embedscale calibrate --ranks 2`` in this run (at the
  per-rank batch, one thread as each rank runs, links measured on 2 local ranks, and the distributed executor's
  overhead per table of each form fitted from real 2-rank steps of a sharded, a TT and a host plan; with
  ``--rank-rows 0`` those steps run on this run's own full-size data and tables,
  ``embedscale.calibrate_ranks.calibrate_ranks(rows=0)``);
* ``elrec_rule``: EL-Rec's rule (tables of at least 1M rows TT rank 32, the rest placed by oper; with
  ``--hand-ranks 8,16,32`` also ``elrec_rule_r8`` / ``_r16`` and the mixtures at those ranks: the auto search
  weighs the same rules itself, ``plan.auto_rules``);
* ``mix_tt3_host2`` / ``mix_tt4_host1``: the mixtures of the two rules a user would try: the largest tables
  TT rank 32 until the others fit on the host parameter server (3 TT and 2 host tables: the 2 host tables are
  the largest pair that fits 512 MiB), and one more TT table (4 TT, 1 host); pipeline depth 2;
* with ``--trial-steps N``, auto is trained as a user runs it, ``train --dist-plan auto`` with
  ``dist.plan_trial_steps N``: the run measures the model's plans within its error of the best (its closest,
  and the best-priced plan of every rule family within that error) and keeps the fastest (``train.plan_trial``); the line's ``plan_trials`` gives each run's trial seconds and the plan kept (the
  steady step is the kept plan's; its prediction stays the search's plan's);
* ``exact_unbounded``: every table sharded exact by OPER with no budget (about 1.1 GB of rows and state a rank:
  it does not fit 256 MiB, it fits this machine's RAM): the measured ceiling, ``measured_ceiling`` = the best
  rule's step over its step (exact lookups are the cheapest form, so it bounds the plans within the budget from
  below when the measurement agrees: ``exact_unbounded_fastest``); not a rule (left out of the best rule);
* TorchRec's ``EmbeddingShardingPlanner`` asked for the same budget (``plan.torchrec_plan``, its CPU topology:
  DDR capacity = the device budget, and again = device + host budget; and a GPU topology of HBM = the device
  budget and DDR = the host budget, where it may choose UVM caching); what it answers is reported (it has no
  TT form; on CPU no host cache). Not trained: it answers no plan.

Every plan is trained ``--steps`` steps ``--repeats`` times, in turns, each round starting one plan later
(A B C D, B C D A, ...), and its measured
step (the median over its runs of each run's steady-state step: the summary's ``train_step_seconds`` median, the
loop's timer over the train steps after the first 10, which pay for the first touch of 1.1 GB of rows and
state, the caches and the host pipeline filling; the all-steps figure, ``train_samples_per_s``, is reported
beside it: in one run of 30 steps the first 10 steps of every plan ran 1.2-2.1x the later ones) is compared with
the step the planner's cost model predicts for it (``plan.autoplan.predict_plan_forms``, the model the auto
search optimises), with the costs measured once, before planning (``prediction_error_setup_costs``: the
prediction against the median measured step; ``prediction_error_without_executor``: the same costs without
the executor overheads, i.e. what a single-process calibration predicts). With ``--recalibrate`` the
single-process costs are also measured again just before every run (``--calibrate-procs`` processes at once,
their figures averaged) and the run predicted with them and the setup's executor overheads
(``prediction_error``: the median of a plan's predictions against its median measured step,
``prediction_error_each_run`` run by run). Every run is also predicted by the setup costs scaled by the same
round's other runs (``prediction_error_round_scaled``, out of sample: the median over the round's other plans of
measured / predicted step, times this plan's predicted step; the machine's state in that round is measured by
the others, the plan's own step never enters its prediction). The plan a run is predicted for is the one it ran
(auto's after a measured choice: the plan kept). Prints one JSON
line: figure = auto's steady-state train samples/s (global batch / measured step), baseline = the best
hand-made plan's, ratio (and ``all_steps_ratio``, the same from the all-steps figures; ``round_ratios``: in each
round, the best hand plan's step over auto's, and their median), and per plan the
runs, the predicted and measured step and the prediction's error; the model's own ceiling (``model_ceiling``: the
best rule's predicted step over auto's, and over every table exact with no budget); auto's measured choices
(``plan_trials``: each candidate's families, predicted and measured step, the seconds with the candidates'
building, the families left out); the load average before and after.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _plan_common import emit, log
from embedscale.calibrate_ranks import calibrate_ranks, refit
from embedscale.data.profile import AccessProfile
from embedscale.plan.api import resolve_profile
from embedscale.plan.auto import Costs, load_costs, parse_bytes
from embedscale.plan.autoplan import predict_plan_forms
from embedscale.plan.forms import host_pipeline_depth, table_profile, tables_from_profile
from embedscale.plan.plan import Plan
from embedscale.plan.step import DenseModel
from embedscale.plan.torchrec_plan import plan_torchrec
from embedscale.specs import Topology

CEILING = "exact_unbounded"  # every table sharded exact, no budget: the measured ceiling, not a rule


def _es(*args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "embedscale", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode and check:
        raise SystemExit(f"embedscale {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return p


def _mixture_yaml(path: Path, tables, tt: list[str], host: list[str], rank: int) -> None:
    lines = ["tables:"]
    for t in tables:
        lines.append(f"  - {{name: {t.name}, num_rows: {t.num_rows}, dim: {t.dim}, features: [{t.features[0]}]"
                     + (f", compression: tt, tt_rank: {rank}" if t.name in tt else "")
                     + (", placement: host" if t.name in host else "") + "}")
    path.write_text("\n".join(lines) + "\n")


def _mixtures(tables, host_budget: float, n_big: int) -> dict[str, tuple[list[str], list[str]]]:
    """Largest tables TT until the remaining large ones (>= 1M rows) fit the host budget, and one more TT."""
    big = sorted([t for t in tables if t.num_rows >= 1_000_000], key=lambda t: -t.num_rows)
    if not big:  # (tables capped below 1M rows: no mixture)
        return {}
    row = 4 * big[0].dim + 4  # a host row and its row-wise Adagrad state, as the planner counts it
    out = {}
    for k in range(len(big) + 1):
        rest = big[k:]
        if sum(t.num_rows * row for t in rest) <= host_budget:
            out[f"mix_tt{k}_host{len(rest)}"] = ([t.name for t in big[:k]], [t.name for t in rest])
            if k + 1 < len(big):
                out[f"mix_tt{k + 1}_host{len(big) - k - 1}"] = ([t.name for t in big[:k + 1]],
                                                                [t.name for t in big[k + 1:]])
            break
    return dict(list(out.items())[:n_big])


def calibrate_concurrently(work: Path, out: str, per_rank: int, links_from: Path, n: int = 1) -> Path:
    """``n`` ``embedscale calibrate`` processes at once (as many as the run has ranks: they compete for the cores
    as the ranks do), their figures averaged, the links taken from ``links_from``; written to ``work / out``."""
    procs = [subprocess.Popen([sys.executable, "-m", "embedscale", "calibrate", "--rows", "1000000", "--batch",
                               str(per_rank), "--tt-ranks", "8,16,32,64", "--repeats", "15", "--out", f"{out}.{i}.json"],
                              cwd=work,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(n)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"embedscale calibrate failed:\n{err[-3000:]}")
    parts = [json.loads((work / f"{out}.{i}.json").read_text()) for i in range(n)]
    links = json.loads(links_from.read_text())
    merged = dict(parts[0])
    for k in ("exact_lookup_s", "host_row_s", "dense_flops_per_s", "step_overhead_s", "table_overhead_s",
              "row_group_overhead_s", "tt_size_slope", "tt_replica_factor"):
        merged[k] = float(np.mean([q.get(k, Costs.__dataclass_fields__[k].default) for q in parts]))
    merged["tt_lookup_s"] = {r: float(np.mean([q["tt_lookup_s"][r] for q in parts])) for r in parts[0]["tt_lookup_s"]}
    for k in ("link_bandwidth_gbs", "link_latency_us", "allreduce_gbs"):
        merged[k] = links[k]
    for k in ("executor_overhead_s", "executor_world"):  # the 2-rank fit of the setup calibration
        merged[k] = links.get(k, merged.get(k))
    merged["notes"] = {**parts[0]["notes"], "links_measured": bool(links["notes"].get("links_measured")),
                       "concurrent_processes": n, "processes": [q["notes"] for q in parts]}
    (work / f"{out}.json").write_text(json.dumps(merged))
    return work / f"{out}.json"


def ask_torchrec(tables, profile_dir: Path, batch: int, cap_bytes: int) -> dict:
    try:
        prof = table_profile(resolve_profile(str(profile_dir), tables), tables)
        plan = plan_torchrec(tables, prof, Topology(num_hosts=1, ranks_per_host=2),
                             batch_size=batch, memory_per_rank=cap_bytes)
    except Exception as e:  # its answer, whatever it is
        return {"answer": "error", "error": f"{type(e).__name__}: {str(e)[:600]}"}
    mem = plan.memory_per_rank()
    return {"answer": "plan", "sharding_types": plan.meta.get("torchrec_sharding_types"),
            "max_rows_bytes_per_rank": float(np.max(mem)),
            "fits_device_budget": bool(np.max(mem) * 17 / 16 <= cap_bytes)}


def ask_torchrec_uvm(tables, profile_dir: Path, batch: int, hbm: int, ddr: int) -> dict:
    """TorchRec's planner on a GPU topology (``hbm`` device and ``ddr`` host bytes per rank), where it may choose
    its UVM-caching kernels (rows in host memory behind a device cache): the closest TorchRec comes to the
    budget's question. Planning only; nothing runs on a GPU."""
    import logging
    import warnings

    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.planner.types import Topology as TRTopology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    prof = table_profile(resolve_profile(str(profile_dir), tables), tables)
    samples = prof.samples() if callable(getattr(prof, "samples", None)) else prof.samples
    cons = {t.name: ParameterConstraints(pooling_factors=[max(float(np.sum(prof.counts(t.name))) / samples, 1e-6)])
            for t in tables}
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows,
                                                            feature_names=list(t.features)) for t in tables],
                                 device=torch.device("meta"))
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            topo = TRTopology(world_size=2, compute_device="cuda", local_world_size=2, hbm_cap=hbm, ddr_cap=ddr)
            sharding = EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons).plan(
                ebc, [EmbeddingBagCollectionSharder()])
    except Exception as e:
        return {"answer": "error", "error": f"{type(e).__name__}: {str(e)[:900]}"}
    per = sharding.plan.get("") or next(iter(sharding.plan.values()))
    return {"answer": "plan", "tables": {k: [v.sharding_type, v.compute_kernel] for k, v in per.items()}}


def predict_only(result: Path, work: Path, plans, tables, topo, dense, costs, per_rank: int, depth: int) -> None:
    """The plans of an earlier run predicted by ``costs`` fitted again (:func:`embedscale.calibrate_ranks.refit`)
    against that run's measured steps; one JSON line."""
    old = json.loads(result.read_text().strip().splitlines()[-1])
    rc = refit(costs)
    pred = {name: predict_plan_forms(tables, work / "profile", topo, Plan.load(work / d).forms, costs=rc,
                                     batch_size=per_rank, dense=dense, host_depth=depth)
            for name, d in plans.items()}
    measured = old["measured_step_s"]
    err = {k: pred[k]["step_seconds"] / measured[k] - 1 for k in measured}
    log("refit: scale %.3f, overheads %s" % (rc.notes["executor"]["scale"], rc.executor_overhead_s))
    for k in measured:
        log(f"{k}: predicted {pred[k]['step_seconds'] * 1e3:.1f} ms, measured {measured[k] * 1e3:.1f} ms, "
            f"error {err[k]:+.1%}")
    print(json.dumps({"benchmark": "plan_auto_full_2ranks_prediction", "result_of": str(result),
                      "scale": rc.notes["executor"]["scale"], "executor_overhead_s": rc.executor_overhead_s,
                      "predicted_step_s": {k: v["step_seconds"] for k, v in pred.items()},
                      "measured_step_s": measured, "prediction_error": err,
                      "within_20pct": {k: abs(v) <= 0.2 for k, v in err.items()},
                      "parts": {k: v["parts"] for k, v in pred.items()}}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/bench_auto_full")
    ap.add_argument("--max-rows", type=int, default=0, help="Cap every table's rows (0 = full size).")
    ap.add_argument("--samples", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=2048, help="Global batch (2 ranks).")
    ap.add_argument("--steps", type=int, default=60,
                    help="Steps per run (and per calibration run); the first 10 are the warm-up, left out.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device-memory", default="256MiB")
    ap.add_argument("--host-memory", default="512MiB")
    ap.add_argument("--depth", type=int, default=2, help="Pipeline depth of host tables (hand-made plans and auto).")
    ap.add_argument("--mixtures", type=int, default=2)
    ap.add_argument("--trial-steps", type=int, default=0,
                    help="Train auto with --dist-plan auto and dist.plan_trial_steps this many: the run measures the "
                         "model's close plans and keeps the fastest (its seconds reported as plan_trials).")
    ap.add_argument("--trial-rounds", type=int, default=2,
                    help="dist.plan_trial_rounds: rounds of that trial (the plans within 15%% of the best timed again).")
    ap.add_argument("--hand-ranks", default="32",
                    help="TT ranks of the hand-made plans (EL-Rec's rule and the mixtures at each), e.g. 8,16,32.")
    ap.add_argument("--calibrate-procs", type=int, default=1,
                    help="--recalibrate: embedscale calibrate processes run at once before every run (averaged).")
    ap.add_argument("--recalibrate", action="store_true",
                    help="Measure the single-process costs again before every run and predict the run with them.")
    ap.add_argument("--rank-repeats", type=int, default=3, help="calibrate --ranks 2: rounds of its three plans.")
    ap.add_argument("--rank-rows", type=int, default=1_000_000,
                    help="calibrate --ranks 2 on tables capped at this many rows; 0: on this run's own data and "
                         "tables (full size; the single-process figures stay on a 1M-row table).")
    ap.add_argument("--torchrec-only", action="store_true", help="Plan and ask TorchRec; train nothing.")
    ap.add_argument("--plans", default="", help="Comma-separated subset of plans to train (default: all).")
    ap.add_argument("--predict-only", default=None,
                    help="A result line of an earlier run (JSON file): train nothing; predict its plans with "
                         "WORK/costs.json fitted again by the current model (calibrate_ranks.refit) and compare "
                         "with that run's measured steps.")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    per_rank = args.batch // 2
    dev_b, host_b = parse_bytes(args.device_memory), parse_bytes(args.host_memory)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    if not (work / "data" / "manifest.json").exists():
        cap = ["--max-rows", str(args.max_rows)] if args.max_rows else []
        _es("data", "synthetic", "--preset", "criteo-kaggle", *cap, "--samples", str(args.samples), "--out", "data",
            "--no-progress", cwd=work)
    if not (work / "profile").exists():
        _es("profile", "data", "--out", "profile", cwd=work)
    if not (work / "costs.json").exists() and args.rank_rows == 0:
        # the single-process figures on a 1M-row table, then the 2-rank executor fit on this run's own data and
        # tables (full size: what a form costs the executor grows with the table, calibrate_ranks' docstring)
        _es("calibrate", "--rows", "1000000", "--batch", str(per_rank), "--tt-ranks", "8,16,32,64", "--links",
            "--repeats", "15", "--out", "costs-single.json", cwd=work)
        cw = work / "calibrate-ranks"
        cw.mkdir(exist_ok=True)
        if not (cw / "data").exists():
            (cw / "data").symlink_to(work / "data")
        single = load_costs(work / "costs-single.json")
        calibrate_ranks(single, ranks=2, batch=per_rank, rows=0, dim=16, steps=args.steps, repeats=args.rank_repeats,
                        host_depth=args.depth, device=single.notes["device"], work=cw, log=log).save(work / "costs.json")
    if not (work / "costs.json").exists():
        _es("calibrate", "--rows", "1000000", "--batch", str(per_rank), "--tt-ranks", "8,16,32,64", "--links",
            "--repeats", "15", "--ranks", "2", "--rank-steps", str(args.steps), "--rank-repeats",
            str(args.rank_repeats), "--host-depth", str(args.depth), "--work", "calibrate-ranks", "--out",
            "costs.json", cwd=work)
    costs = load_costs(work / "costs.json")
    costs_single = Costs(**{**costs.__dict__, "executor_overhead_s": {}, "executor_world": 0})
    log(f"setup {time.perf_counter() - t0:.0f} s; costs: dense {costs.dense_flops_per_s / 1e9:.1f} GFLOP/s, "
        f"step {costs.step_overhead_s * 1e3:.2f} ms, table {costs.table_overhead_s * 1e6:.0f} us, "
        f"exact {costs.exact_lookup_s * 1e9:.0f} ns, host {costs.host_row_s * 1e9:.0f} ns, "
        f"link {costs.link_bandwidth_gbs:.2f} GB/s {costs.link_latency_us:.0f} us; executor per table (host_step: per step) "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in costs.executor_overhead_s.items()))
    common = ["--profile", "profile", "--batch-size", str(per_rank), "--json"]
    plans: dict[str, str] = {}
    auto_plan = work / "plans-auto" / "auto" / "plan.json"
    if not auto_plan.exists() or auto_plan.stat().st_mtime < (work / "costs.json").stat().st_mtime:
        _es("plan", *common, "--strategy", "auto", "--device-memory", args.device_memory, "--host-memory",
            args.host_memory, "--costs", "costs.json", "--host-depth", str(args.depth), "--tt-ranks", "8,16,32,64",
            "--out", "plans-auto", cwd=work)
    plans["auto"] = "plans-auto/auto"
    tables = tables_from_profile(AccessProfile.load(work / "profile"), 16)
    for r in [int(x) for x in args.hand_ranks.split(",")]:  # EL-Rec's rule and the mixtures at every rank
        sfx = "" if r == 32 else f"_r{r}"  # (rank 32 keeps the names of earlier runs)
        if not (work / f"plans-elrec{sfx}" / "oper" / "plan.json").exists():
            _es("plan", *common, "--strategy", "oper", "--tt-min-rows", "1000000", "--tt-rank", str(r), "--out",
                f"plans-elrec{sfx}", cwd=work)
        plans[f"elrec_rule{sfx}"] = f"plans-elrec{sfx}/oper"
        for name, (tt, host) in _mixtures(tables, host_b, args.mixtures).items():
            d = work / f"plans-{name}{sfx}"
            if not (d / "oper" / "plan.json").exists():
                _mixture_yaml(work / f"{name}{sfx}.yaml", tables, tt, host, r)
                _es("plan", *common, "--tables", f"{name}{sfx}.yaml", "--strategy", "oper", "--out", d.name,
                    cwd=work)
            plans[f"{name}{sfx}"] = f"{d.name}/oper"
    if not (work / "plans-exact" / "oper" / "plan.json").exists():  # every table exact, no budget (the ceiling)
        _es("plan", *common, "--strategy", "oper", "--out", "plans-exact", cwd=work)
    plans[CEILING] = "plans-exact/oper"
    topo = Topology(num_hosts=1, ranks_per_host=2)
    dense = DenseModel(num_features=len(tables), embedding_dim=16)
    if args.predict_only:
        return predict_only(Path(args.predict_only), work, plans, tables, topo, dense, costs, per_rank, args.depth)
    predicted, predicted_single, forms_of, mem = {}, {}, {}, {}
    for name, d in plans.items():
        plan = Plan.load(work / d)
        forms = plan.forms
        forms_of[name] = {k: (f.kind if f.kind != "tt" else f"tt-{f.tt_rank}" + (f"-hot{f.hot_rows}" if f.hot_rows
                                                                                  else ""))
                          for k, f in forms.items() if f.kind != "sharded"}
        if name == "auto":
            rep = json.loads((work / d / "explain.json").read_text())
            predicted[name] = rep["predicted_step_seconds"]
            mem[name] = {"device_bytes": max(rep["per_rank"]["device_total"]), "host_bytes": max(rep["per_rank"]["host_bytes"])}
        else:
            p = predict_plan_forms(tables, work / "profile", topo, forms, costs=costs, batch_size=per_rank,
                                   dense=dense, host_depth=args.depth)
            predicted[name] = p["step_seconds"]
            mem[name] = {"device_bytes": p["device_bytes"], "host_bytes": p["host_bytes"]}
        predicted_single[name] = predict_plan_forms(tables, work / "profile", topo, forms, costs=costs_single,
                                                    batch_size=per_rank, dense=dense,
                                                    host_depth=args.depth)["step_seconds"]
        log(f"{name}: predicted step {predicted[name] * 1e3:.1f} ms (without the executor overheads "
            f"{predicted_single[name] * 1e3:.1f} ms); forms {forms_of[name]}; "
            f"device {mem[name]['device_bytes'] / 2**20:.1f} MiB host {mem[name]['host_bytes'] / 2**20:.1f} MiB")
    # the model's own ceiling: every table sharded exact, no budget (1.1 GB a rank: it does not fit), what no plan
    # within the budget can beat by the model
    unbounded = predict_plan_forms(tables, work / "profile", topo, {}, costs=costs, batch_size=per_rank, dense=dense,
                                   host_depth=args.depth)["step_seconds"]
    log(f"all sharded exact, no budget: predicted step {unbounded * 1e3:.1f} ms")
    torchrec = {f"ddr_{label}": ask_torchrec(tables, work / "profile", per_rank, cap)
                for label, cap in (("device_budget", dev_b), ("device_plus_host_budget", dev_b + host_b))}
    torchrec["gpu_topology_uvm_caching"] = ask_torchrec_uvm(tables, work / "profile", per_rank, dev_b, host_b)
    log(f"torchrec: {json.dumps(torchrec)[:800]}")
    if args.torchrec_only:
        print(json.dumps(torchrec))
        return
    names = [n for n in plans if not args.plans or n in args.plans.split(",")]
    sps: dict[str, list[float]] = {k: [] for k in names}
    steady: dict[str, list[float]] = {k: [] for k in names}  # each run's steady-state step (train_step_seconds)
    pred_rounds: dict[str, list[float]] = {k: [] for k in names}
    trials: list[dict] = []  # --trial-steps: auto's measured choice in each of its runs (its seconds, the plan kept)
    load_runs = os.getloadavg()
    pred_setup: dict[str, list[float]] = {k: [] for k in names}  # the setup costs' prediction of the plan run
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # each round starts one plan later
            rc = costs
            if args.recalibrate:  # the costs again, just before this run, as the machine's load makes them
                rc = load_costs(calibrate_concurrently(work, f"costs-{name}-{rep}", per_rank, work / "costs.json",
                                                       n=args.calibrate_procs))
            rd = work / "runs" / f"{name}-{rep}"
            shutil.rmtree(rd, ignore_errors=True)
            depth = host_pipeline_depth(Plan.load(work / plans[name]).forms, args.depth)
            t = time.perf_counter()
            how = ["--dist-plan", plans[name]]
            if name == "auto" and args.trial_steps:  # planned in the run, a measured choice among the close plans
                how = ["--dist-plan", "auto", "--dist-device-memory", args.device_memory, "--dist-host-memory",
                       args.host_memory, "--dist-costs", "costs.json", "--dist-plan-trial-steps", str(args.trial_steps),
                       "--dist-plan-trial-rounds", str(args.trial_rounds)]
            _es("train", "--data-source", "shards", "--data-path", "data", "--train-batch-size", str(args.batch),
                "--train-max-steps", str(args.steps), "--train-eval-every", "0", "--nproc", "2", *how,
                "--train-pipeline-depth", str(max(depth, args.depth)), "--run-dir", str(rd),
                "--no-progress", cwd=work)
            wall = time.perf_counter() - t
            s = json.loads((rd / "summary.json").read_text())
            ran = Plan.load(rd / "plan").forms if (rd / "plan" / "plan.json").exists() else \
                Plan.load(work / plans[name]).forms  # auto after a measured choice: the plan kept
            for costs_of, into in ((rc, pred_rounds), (costs, pred_setup)):
                into[name].append(predict_plan_forms(tables, work / "profile", topo, ran, costs=costs_of,
                                                     batch_size=per_rank, dense=dense,
                                                     host_depth=args.depth)["step_seconds"])
            if "plan_trial_seconds" in s:
                trials.append(trial_of(rep, s, rd, wall))
                log(f"auto run {rep}: measured choice {s['plan_trial_chosen']!r} in {s['plan_trial_seconds']:.0f} s: "
                    + "; ".join(f"{c['name']} predicted {c['predicted_seconds'] * 1e3:.0f} measured "
                                f"{c.get('measured_median_seconds', float('nan')) * 1e3:.0f} ms"
                                for c in trials[-1]["candidates"]))
            sps[name].append(float(s["train_samples_per_s"]))
            steady[name].append(float(s["train_step_seconds"]["median"]))
            log(f"{name} run {rep}: steady {steady[name][-1] * 1e3:.0f} ms/step (p90 "
                f"{s['train_step_seconds']['p90'] * 1e3:.0f}); all steps {sps[name][-1]:,.0f} samples/s = "
                f"{args.batch / sps[name][-1] * 1e3:.0f} ms/step "
                f"(predicted {pred_rounds[name][-1] * 1e3:.0f} ms: dense {rc.dense_flops_per_s / 1e9:.1f} GFLOP/s, "
                f"table {rc.table_overhead_s * 1e6:.0f} us; setup costs {pred_setup[name][-1] * 1e3:.0f} ms; "
                f"{wall:.0f} s wall); "
                f"load {os.getloadavg()[0]:.1f}")
            shutil.rmtree(rd / "checkpoints", ignore_errors=True)
    # the figure: the steady state (each run's median step after its warm-up, train_step_seconds; the median over
    # the runs), what the cost model predicts; the loop's all-steps figure is reported beside it
    measured = {k: float(np.median(v)) for k, v in steady.items()}
    med = {k: args.batch / v for k, v in measured.items()}
    med_all_steps = {k: float(np.median(v)) for k, v in sps.items()}
    err = {k: (predicted[k] - measured[k]) / measured[k] for k in med}
    err_single = {k: (predicted_single[k] - measured[k]) / measured[k] for k in med}
    pred_r = {k: float(np.median(v)) for k, v in pred_rounds.items()}
    err_r = {k: (pred_r[k] - measured[k]) / measured[k] for k in med}
    err_each = {k: [pv / m - 1 for pv, m in zip(pred_rounds[k], steady[k])] for k in med}
    scaled = round_scaled(pred_setup, steady, args.repeats)
    err_scaled_each = {k: [pv / m - 1 for pv, m in zip(scaled[k], steady[k])] for k in med}
    err_scaled = {k: float(np.median(scaled[k])) / measured[k] - 1 for k in med}
    for k in med:
        runs = ", ".join(f"{e:+.0%}" for e in err_scaled_each[k])
        log(f"{k}: measured {measured[k] * 1e3:.0f} ms; predicted, round-scaled "
            f"{float(np.median(scaled[k])) * 1e3:.0f} ms ({err_scaled[k]:+.1%}; runs {runs})")
    hand = {k: v for k, v in med.items() if k not in ("auto", CEILING)}
    best = max(hand, key=hand.get) if hand else None
    a = med.get("auto", float("nan"))
    b = hand[best] if best else float("nan")
    hand_all = {k: v for k, v in med_all_steps.items() if k not in ("auto", CEILING)}
    # paired by round: auto's step against the best hand plan's in the same round (the rounds' machine states differ)
    rounds = [min(steady[k][r] for k in steady if k not in ("auto", CEILING)) / steady["auto"][r]
              for r in range(args.repeats)] if "auto" in steady and len(set(steady) - {CEILING}) > 1 else []
    emit("plan_auto_full_2ranks", a, b, f"steady-state train samples/s (global batch / median over {args.repeats} "
         f"interleaved runs of each run's median step after its first 10)",
         {"data": "synthetic criteo-kaggle" + (f" capped at {args.max_rows} rows" if args.max_rows else ", full size"),
          "rows": sum(t.num_rows for t in tables), "dim": 16, "ranks": 2, "global_batch": args.batch,
          "steps": args.steps, "budget": f"{args.device_memory} device / {args.host_memory} host per rank",
          "pipeline_depth": args.depth, "model": "DLRM 512-256-64 / 512-256"},
         best_hand_plan=best, round_ratios=rounds, round_ratio_median=float(np.median(rounds)) if rounds else None,
         runs_steady_step_s=steady, runs=sps, median_samples_per_s=med,
         all_steps_median_samples_per_s=med_all_steps,
         all_steps_ratio=(med_all_steps.get("auto", float("nan")) / max(hand_all.values())) if hand_all else None,
         predicted_step_s=predicted, measured_step_s=measured,
         prediction_error_setup_costs=err, predicted_step_s_without_executor=predicted_single,
         prediction_error_without_executor=err_single, predicted_step_s_round_costs=pred_rounds,
         prediction_error=err_r, prediction_error_each_run=err_each, recalibrated=args.recalibrate,
         within_20pct={k: abs(v) <= 0.2 for k, v in err.items()}, forms=forms_of, memory=mem,
         costs=costs.to_dict(), torchrec=torchrec, load_average_before=load0, load_average_runs_start=load_runs,
         plan_trials=trials, predicted_all_exact_no_budget_s=unbounded,
         predicted_step_s_setup_costs_each_run=pred_setup, predicted_step_s_round_scaled=scaled,
         prediction_error_round_scaled=err_scaled, prediction_error_round_scaled_each_run=err_scaled_each,
         within_10pct_round_scaled={k: abs(v) <= 0.1 for k, v in err_scaled.items()},
         **measured_ceiling(measured, steady, best), model_ceiling=model_ceiling(predicted, unbounded),
         load_average_after=os.getloadavg())


def trial_of(rnd: int, summary: dict, rd: Path, wall: float) -> dict:
    """An auto run's measured choice (its explain report's ``measured_choice``): the plan kept, the seconds (the
    candidates' building and timing), each candidate, the families left out; the run's wall time with the trial."""
    mc = json.loads((rd / "plan" / "explain.json").read_text()).get("measured_choice", {})
    return {"round": rnd, "seconds": summary["plan_trial_seconds"], "chosen": summary["plan_trial_chosen"],
            "build_seconds": mc.get("build_seconds"), "margin": mc.get("margin"), "left_out": mc.get("left_out", []),
            "trial_rounds": mc.get("rounds"),
            "candidates": mc.get("candidates", []), "run_wall_seconds_with_trial": wall}


def round_scaled(pred: dict, steady: dict, repeats: int) -> dict:
    """Every run's prediction scaled by its round's other runs: ``pred[k][r]`` times the median over the other
    plans ``q`` of ``steady[q][r] / pred[q][r]`` (out of sample: a plan's own step never enters its prediction)."""
    out = {k: [] for k in pred}
    for r in range(repeats):
        ratio = {k: steady[k][r] / pred[k][r] for k in pred}
        for k in pred:
            others = [v for q, v in ratio.items() if q != k]
            out[k].append(pred[k][r] * float(np.median(others)) if others else float("nan"))
    return out


def measured_ceiling(measured: dict, steady: dict, best: str | None) -> dict:
    """The measured reach of the bar: the best rule's step over every table exact with no budget (median, and
    round by round), and whether that plan measured fastest of all (then it bounds the budget's plans from below
    by measurement)."""
    if CEILING not in measured or best is None:
        return {}
    return {"measured_ceiling": measured[best] / measured[CEILING],
            "measured_ceiling_rounds": [a / b for a, b in zip(steady[best], steady[CEILING])],
            "exact_unbounded_fastest": all(measured[CEILING] <= v for v in measured.values())}


def model_ceiling(predicted: dict, unbounded: float) -> dict:
    """What the cost model itself allows: the best rule's predicted step over auto's (the search's best plan under
    the budget, by the model), and over every table sharded exact with no budget (no plan within the budget is
    priced below it)."""
    rules = {k: v for k, v in predicted.items() if k not in ("auto", CEILING)}
    if not rules or "auto" not in predicted:
        return {}
    best = min(rules, key=rules.get)
    return {"best_rule_by_model": best, "best_rule_over_auto": rules[best] / predicted["auto"],
            "best_rule_over_all_exact_no_budget": rules[best] / unbounded}


if __name__ == "__main__":
    main()
