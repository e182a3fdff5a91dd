"""The auto planner's report: per rank after OPER placed the sharded tables (:func:`rank_breakdown`), and the explain
report (:func:`explain`, :func:`explain_text`, ``explain.json``/``explain.txt``/``memory.png`` by
:func:`write_explain`). numpy only (matplotlib, optional, for the PNG).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from embedscale.io import atomic_write_json, atomic_write_text
from embedscale.plan.auto_candidates import STATE_BYTES_PER_ROW
from embedscale.plan.auto_costs import CandidateKind, Costs, exchange_latency_of
from embedscale.plan.auto_decide import AutoResult, plan_seconds
from embedscale.plan.auto_rules import reported_rules
from embedscale.plan.auto_search import _totals
from embedscale.units import human_bytes


def exchange_latency(res: AutoResult, world: int, costs: Costs) -> float:
    """The latency a step pays once per exchange, whatever the tables in it: the sharded rows' all-to-all
    (forward and backward), one all-reduce of replicated rows, one of TT cores, the host rows' all-gathers
    (two). Not per table: the executor sends each kind's tables together. With host tables, also the host
    form's executor work per step whatever their number (:meth:`Costs.kinds_overhead`: host step, and host beside
    TT)."""
    return exchange_latency_of([res.chosen(i).kind for i in range(len(res.names))], world, costs)


def rank_breakdown(res: AutoResult, plan, world: int, costs: Costs) -> dict[str, Any]:
    """Per rank: device and host bytes by kind, and predicted step seconds, with the sharded tables' lookups and
    memory as ``plan`` (OPER) placed them (the symmetric model's other terms are the same on every rank)."""
    dev = {k: np.zeros(world) for k in ("sharded", "replicated", "tt", "host_cache")}
    host = np.zeros(world)
    secs = np.zeros(world)
    share = np.full(world, 1.0 / world)
    if plan is not None and plan.part_counts is not None and plan.part_counts.sum() > 0:
        pc = plan.part_counts
        share = np.bincount(plan.owner_of_part, weights=pc, minlength=world)[:world] / pc.sum()
    sharded_lookup = 0.0
    for i, name in enumerate(res.names):
        c = res.chosen(i)
        if c.kind is CandidateKind.SHARDED:
            s = res.stats[i]
            look = s.lookups_rank * costs.exact_lookup_s
            sharded_lookup += look * world  # lookups of every rank's batch, served by the rows' owners
            secs += c.seconds - look
        else:
            secs += c.seconds
        if c.kind is CandidateKind.REPLICATED:
            dev["replicated"] += c.device_bytes
        elif c.kind is CandidateKind.TT:
            dev["tt"] += c.device_bytes
        elif c.kind is CandidateKind.HOST:
            dev["host_cache"] += c.device_bytes
            host += c.host_bytes
    secs += share * sharded_lookup
    secs += exchange_latency(res, world, costs)
    if plan is not None:
        rows = plan.rows_per_rank().astype(np.float64)
        mem = plan.memory_per_rank().astype(np.float64)
        repl = set(res.replicated)
        # the plan holds the replicated tables too: count them once, under "replicated"
        rep_rows = np.zeros(world)
        rep_mem = np.zeros(world)
        for ti, t in enumerate(plan.tables):
            if t.name in repl:
                sl = plan.table_partitions(ti)
                h = plan.holders[sl]
                r = plan.part_rows[sl].astype(np.float64)
                rep_rows += (h * r[:, None]).sum(0)
                rep_mem += (h * (r * t.row_bytes)[:, None]).sum(0)
        dev["sharded"] = (mem - rep_mem) + (rows - rep_rows) * STATE_BYTES_PER_ROW
    else:
        for i in range(len(res.names)):
            if res.chosen(i).kind is CandidateKind.SHARDED:
                dev["sharded"] += res.chosen(i).device_bytes
    total = sum(dev.values())
    return {"device_bytes": {k: v.tolist() for k, v in dev.items()}, "device_total": total.tolist(),
            "host_bytes": host.tolist(), "step_seconds": secs.tolist(), "bottleneck_rank": int(np.argmax(secs)),
            "predicted_step_seconds": float(secs.max())}


def explain(res: AutoResult, per_rank: Mapping[str, Any], costs: Costs, alternatives: Mapping[str, Any], *,
            fixed: Mapping[str, float] | None = None, dense: Mapping[str, Any] | None = None) -> dict:
    """The explain report's data: per table the form chosen, the runner-up and its cost, the per-rank memory
    stack, the predicted step time, and the plans at other budgets (``alternatives``). ``fixed``: the seconds
    every plan pays beyond its tables (:func:`embedscale.plan.step.fixed_terms`: dense model, its all-reduce,
    overheads), added to the embedding part for the whole step's prediction."""
    tables = []
    for i, n in enumerate(res.names):
        c, s, ru = res.chosen(i), res.stats[i], res.runner_up(i)
        e = {"table": n, "rows": s.num_rows, "dim": s.dim, "hot": s.hot, "lookups_per_rank_batch": s.lookups_rank,
             "distinct_per_rank_batch": s.distinct_rank, "distinct_per_global_batch": s.distinct_global,
             "chosen": c.to_dict(), "runner_up": ru.to_dict() if ru else None}
        if c.form.kind == "host":
            k = max(1, c.form.pipeline_depth)
            e["cache"] = {"pipeline_depth": k, "life_cycle_rows": s.mrc.window_rows(k) if k > 1 else 0.0,
                          "life_cycle_hit_ratio": s.mrc.window_hit_ratio(k - 1) if k > 1 else 0.0,
                          "lru_curve": s.mrc.curve(sorted({int(x) for x in np.geomspace(
                              max(1.0, s.distinct_rank / 16), max(2.0, min(s.num_rows, 64 * s.distinct_rank)), 7)}))}
        tables.append(e)
    fixed = {k: float(v) for k, v in (fixed or {}).items()}
    emb = float(per_rank["predicted_step_seconds"])
    world = len(per_rank["step_seconds"])
    kinds = [res.chosen(i).kind for i in range(len(res.names))]
    executor = float(sum(costs.executor_overhead(k, world) for k in kinds)) \
        + costs.kinds_overhead(set(kinds), world)  # (in exchange_latency)
    parts = {"embedding": emb - executor, **({"executor": executor} if costs.executor_overhead_s else {}), **fixed}
    return {"strategy": "auto", "search": res.search, "search_seconds": res.search_seconds,
            "device_budget_bytes": res.dev_budget, "host_budget_bytes": res.host_budget,
            "predicted_step_seconds": emb + sum(fixed.values()),
            "predicted_embedding_step_seconds": emb,
            "predicted_step_parts": parts,
            # the model the search and the other budgets' lines use: sharded rows evenly spread
            "predicted_step_seconds_symmetric": plan_seconds(res.cands, res.choice, world, costs) + sum(fixed.values()),
            "dense_model": dict(dense or {}),
            "costs": costs.to_dict(), "tables": tables, "per_rank": dict(per_rank),
            "other_budgets": dict(alternatives),
            # the rules a user writes, priced by the same model (plan.auto_rules); the one kept when it beat the
            # search's plan
            "chosen_by": f"rule: {res.rule}" if res.rule else "search", "rules": reported_rules(res.rules),
            "plan_model_seconds": plan_seconds(res.cands, res.choice, world, costs),  # the rules' terms
            "notes": ["predicted step = the embedding part on the bottleneck rank (lookups, updates, communication) "
                      "+ the dense model's FLOPs at the calibrated rate + its all-reduce + fixed overheads "
                      "(embedscale.plan.step)" if fixed else
                      "predicted time is the embedding part of a step (lookups, updates, communication); the "
                      "dense model is not modelled",
                      "costs are " + ("measured by embedscale calibrate" if costs.source == "measured"
                                      else "the documented defaults (run embedscale calibrate to measure them)")]}


def summarize_choice(res: AutoResult, world: int, costs: Costs) -> dict[str, Any]:
    """A short account of a choice (for the half / twice budget lines of the report): forms, predicted step
    seconds (the symmetric model, sharded rows evenly spread), device and host bytes per rank."""
    _, d, h = _totals(res.cands, res.choice)
    return {"forms": {n: res.chosen(i).label for i, n in enumerate(res.names)},
            "predicted_step_seconds": res.predicted_seconds() + exchange_latency(res, world, costs),
            "device_bytes": d, "host_bytes": h}


def explain_text(rep: Mapping[str, Any]) -> str:
    parts = rep.get("predicted_step_parts") or {}
    lines = [f"auto plan: predicted step {rep['predicted_step_seconds'] * 1e3:.3f} ms on the bottleneck rank "
             f"(rank {rep['per_rank']['bottleneck_rank']}); budgets per rank: device "
             f"{human_bytes(rep['device_budget_bytes'])}, host {human_bytes(rep['host_budget_bytes'])}; costs: {rep['costs']['source']}",
             "step parts (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in parts.items()),
             "", f"{'table':<16} {'rows':>12} {'hot':>4} {'chosen':>12} {'ms':>9} {'device MiB':>11} {'host MiB':>9}"
             f" {'runner-up':>12} {'ms':>9} {'device MiB':>11}"]
    for e in rep["tables"]:
        c, r = e["chosen"], e["runner_up"]
        ru = f"{r['form']:>12} {r['seconds'] * 1e3:>9.4f} {r['device_bytes'] / 2**20:>11.2f}" if r else f"{'-':>12}"
        lines.append(f"{e['table']:<16} {e['rows']:>12,} {'yes' if e['hot'] else 'no':>4} {c['form']:>12} "
                     f"{c['seconds'] * 1e3:>9.4f} {c['device_bytes'] / 2**20:>11.2f} {c['host_bytes'] / 2**20:>9.2f} {ru}")
    pr = rep["per_rank"]
    lines += ["", "memory per rank (MiB): " + ", ".join(
        f"rank {r}: device " + " + ".join(f"{k} {pr['device_bytes'][k][r] / 2**20:.1f}" for k in pr["device_bytes"])
        + f" = {pr['device_total'][r] / 2**20:.1f}, host {pr['host_bytes'][r] / 2**20:.1f}"
        for r in range(len(pr["device_total"])))]
    for label, alt in rep["other_budgets"].items():
        if "error" in alt:
            lines.append(f"with {label} the budget: {alt['error']}")
            continue
        changed = {n: f for n, f in alt["forms"].items() if f != next(e["chosen"]["form"] for e in rep["tables"]
                                                                     if e["table"] == n)}
        lines.append(f"with {label} the budget: predicted {alt['predicted_step_seconds'] * 1e3:.3f} ms "
                     f"(sharded rows spread evenly; this plan so: {rep['predicted_step_seconds_symmetric'] * 1e3:.3f} "
                     "ms); " + (f"changes {changed}" if changed else "the same forms"))
    if rep.get("rules"):
        best = next((r for r in rep["rules"] if r["fits"] and r["rule"] != "search"), None)
        lines.append(f"chosen by: {rep.get('chosen_by', 'search')}" + (
            f"; the best rule that fits: {best['rule']}, predicted {best['predicted_seconds'] * 1e3:.3f} ms "
            f"(this plan so: {rep['plan_model_seconds'] * 1e3:.3f} ms; both without the terms every plan pays)"
            if best else "; no rule fits the budgets"))
    lines += _trial_lines(rep.get("measured_choice"))
    lines += [""] + [f"note: {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"


def _trial_lines(mc: Mapping[str, Any] | None) -> list[str]:
    """The measured choice (``train.plan_trial``) for people: each plan timed, predicted and measured, the plan
    kept and the seconds the trial took."""
    if not mc or not mc.get("trial"):
        return []
    rounds = mc.get("rounds", 1)
    lines = [f"measured choice (margin {mc['margin']:.0%} of the step): kept {mc['chosen']!r} after "
             f"{mc['trial_seconds']:.1f} s, {rounds} round{'s' if rounds != 1 else ''}"]
    for c in mc["candidates"]:
        fam = f" [{', '.join(c['families'])}]" if c.get("families") else ""
        err = (f" (error {c['prediction_error']:+.0%}; scaled by the other plans' timings {c['scaled_error']:+.0%})"
               if "scaled_error" in c else "")
        each = c.get("timings_seconds") or []
        runs = f" (median of {', '.join(f'{t * 1e3:.1f}' for t in each)})" if len(each) > 1 else ""
        lines.append(f"  {c['name']}{fam}: predicted {c['predicted_seconds'] * 1e3:.1f} ms, measured "
                     f"{c.get('measured_median_seconds', float('nan')) * 1e3:.1f} ms{runs}{err}")
    if mc.get("left_out"):
        lines.append(f"  not timed (the trial's limit): {', '.join(mc['left_out'])}")
    return lines


def write_explain(rep: Mapping[str, Any], out_dir: str | Path, png: bool = True) -> None:
    """``explain.json``, ``explain.txt`` and (matplotlib present) ``memory.png`` in ``out_dir``."""
    out = Path(out_dir)
    atomic_write_json(out / "explain.json", rep)
    atomic_write_text(out / "explain.txt", explain_text(rep))
    if png:
        write_memory_png(rep, out / "memory.png")


def write_memory_png(rep: Mapping[str, Any], path: Path) -> None:
    """A stacked bar per rank of device memory by kind, with the budget as a line."""
    try:
        import matplotlib  # optional dependency: the PNG is skipped without it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pr = rep["per_rank"]
    m = len(pr["device_total"])
    fig, ax = plt.subplots(figsize=(1.2 * m + 3, 3.5))
    bottom = np.zeros(m)
    for k, v in pr["device_bytes"].items():
        v = np.asarray(v) / 2**20
        ax.bar(np.arange(m), v, bottom=bottom, label=k)
        bottom += v
    ax.axhline(rep["device_budget_bytes"] / 2**20, color="k", ls="--", lw=1, label="budget")
    ax.set_xlabel("rank")
    ax.set_ylabel("device MiB")
    ax.set_xticks(np.arange(m))
    ax.legend(fontsize=7)
    ax.set_title("auto plan: device memory per rank")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
