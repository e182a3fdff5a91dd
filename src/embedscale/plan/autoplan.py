"""``embedscale plan --strategy auto``: the forms of :mod:`embedscale.plan.auto` made into a saved Plan.

:func:`make_auto_plan` decides every table's form under the budgets (:func:`embedscale.plan.auto.decide`),
places the exact tables with OPER (``replicated`` ones then held by every rank), records every form in the
plan (``plan.meta["forms"]``, read back by ``Plan.forms``: training with ``--dist-plan DIR`` builds them) and
the explain data in ``plan.meta["auto"]``. :func:`auto_plan_command` writes the plan and its explain report
(``explain.txt``, ``explain.json``, ``memory.png``) into ``OUT/auto/``. numpy only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.api import make_plan, resolve_profile, resolve_topology
from embedscale.plan.auto import (DEFAULT_HOT_ROW_TOUCH, DEFAULT_TT_RANKS, AutoResult, BudgetError, Costs, decide, explain, human_bytes,
                                  rank_breakdown, summarize_choice, table_stats, write_explain)
from embedscale.plan.mrc import probability_histogram
from embedscale.plan.forms import table_profile
from embedscale.plan.plan import Plan
from embedscale.plan.step import DenseModel, default_dense, fixed_terms, predict_forms
from embedscale.plan.synthetic_profile import ZipfProfile


def with_topology_links(costs: Costs, topo) -> Costs:
    """``costs`` with the link figures of ``topo``: the mean bandwidth and latency between distinct ranks (the
    slowest class present dominates an all-to-all, so the mean is a compromise) and its all-reduce bandwidth."""
    m = topo.world_size
    off = ~np.eye(m, dtype=bool)
    out = Costs(**{**costs.__dict__, "notes": {**costs.notes, "links_from": "topology"}})
    if m > 1:
        out.link_bandwidth_gbs = float(topo.bandwidth[off].mean())
        out.link_latency_us = float(topo.latency_us[off].mean())
    out.allreduce_gbs = float(topo.allreduce_bw)
    return out


def _links_fixed(costs: Costs) -> bool:
    """Whether ``costs`` carry their own link figures (measured, or scaled by ``calibrate --ranks`` from the
    topology's: :meth:`Costs.scaled`); otherwise the planner takes the topology's."""
    return bool(costs.notes.get("links_measured") or costs.notes.get("links_scaled"))


def _replicate(plan: Plan, names: Sequence[str]) -> Plan:
    """``plan`` with every partition of the tables ``names`` held (and read locally) by every rank."""
    if not names:
        return plan
    holders = plan.holders.copy()
    fetch = plan.fetch.copy()
    for n in names:
        sl = plan.table_partitions(n)
        holders[sl] = True
        fetch[sl] = np.arange(plan.world_size, dtype=np.int32)[None, :]
    return plan.with_replicas(holders, fetch)


def make_auto_plan(tables, profile, topology, *, device_memory: float, host_memory: float, costs: Costs | None = None,
                   batch_size: int = 2048, mode: str = "training", tt_rank_list: Sequence[int] = DEFAULT_TT_RANKS,
                   host_depth: int = 1, hot_touch: float = 0.01, tt_min_rows: int = 10_000, search: str = "greedy",
                   other_budgets: bool = True, bins: int = 2048, requests: Sequence = (),
                   dense: DenseModel | None = None, hot_row_touch: float = DEFAULT_HOT_ROW_TOUCH,
                   rules: bool = True) -> Plan:
    """The auto plan of ``tables`` (see the module docstring). ``device_memory`` / ``host_memory``: bytes per
    rank. ``dense``: the dense model, for the whole step's prediction (:mod:`embedscale.plan.step`; default:
    DLRM of ``ModelConfig``'s default sizes over the tables' features). ``requests``: the ``specs.TableConfig``
    entries the tables came from (a table that asks for a form
    is a ``ConfigError``: auto decides every form). ``hot_row_touch``: the rows a global batch reads at least this
    often stay exact inside TT tables (row groups, ``plan.auto.candidates``; 0: whole tables only). ``rules``: weigh
    the plans of the rules a user writes beside the search's (``plan.auto_rules``). Raises :class:`~embedscale.plan.auto.BudgetError` when
    nothing fits."""
    t0 = time.perf_counter()
    tables = list(tables)
    if not tables:
        raise ConfigError("no tables to plan")
    asked = [r.name for r in requests if r.compression != "none" or r.placement != "device"]
    if asked:
        raise ConfigError(f"--strategy auto decides every table's form; tables {asked} ask for one (compression / "
                          "placement): drop the request or plan with another strategy")
    costs = costs or Costs()
    topo = resolve_topology(topology)
    world = topo.world_size
    if not _links_fixed(costs):  # the links as the topology describes them
        costs = with_topology_links(costs, topo)
    prof = table_profile(resolve_profile(profile, tables), tables)
    samples = getattr(prof, "samples", None)
    samples = samples() if callable(samples) else samples
    stats = _table_stats(tables, prof, samples, batch_size, world, hot_touch, tt_min_rows, bins)
    kw = dict(costs=costs, batch_size=batch_size, tt_rank_list=tt_rank_list, host_depth=host_depth,
              search=search, stats=stats,
              hot_row_touch=float(hot_row_touch), rules=rules)
    res = decide(tables, prof.counts, samples, world, device_memory, host_memory, **kw)
    plan, per_rank = _place(res, tables, prof, topo, mode, batch_size, costs)
    over = max(per_rank["device_total"]) - device_memory
    if over > 0:  # OPER's placement left one rank above the balanced share: plan again with that margin
        res = decide(tables, prof.counts, samples, world, device_memory - over, host_memory, **kw)
        res.dev_budget = float(device_memory)
        plan, per_rank = _place(res, tables, prof, topo, mode, batch_size, costs)
        over = max(per_rank["device_total"]) - device_memory
        if over > 0:
            raise BudgetError(f"no plan fits the memory budget: after placement rank {int(np.argmax(per_rank['device_total']))} "
                              f"needs {human_bytes(over)} of device memory more than the budget")
    dense = dense or default_dense(tables)
    fixed = fixed_terms(dense, batch_size, world, len(tables), costs)
    alts: dict[str, Any] = {}
    if other_budgets:
        for label, f in (("half", 0.5), ("twice", 2.0)):
            try:
                alt = decide(tables, prof.counts, samples, world, device_memory * f, host_memory * f, **kw)
                alts[label] = summarize_choice(alt, world, costs)
                alts[label]["predicted_step_seconds"] += sum(fixed.values())
            except BudgetError as e:
                alts[label] = {"error": str(e)}
    rep = explain(res, per_rank, costs, alts, fixed=fixed, dense=dense.to_dict())
    rep["plan_seconds"] = time.perf_counter() - t0
    plan.meta["strategy"] = "auto"
    plan.meta["capacity_bytes"] = float(device_memory)  # the rows the plan places are part of the device budget
    plan.meta["forms"] = {n: f.to_dict() for n, f in res.forms.items()}
    plan.meta["replicated_tables"] = [
        {"name": n, "num_rows": int(s.num_rows), "dim": int(s.dim), "compression": "tt",
         "tt_rank": int(res.forms[n].tt_rank), "hot_rows": int(res.forms[n].hot_rows),
         "bytes": int(res.chosen(i).device_bytes),
         "placement": "replicated on every rank"}
        for i, (n, s) in enumerate(zip(res.names, res.stats)) if res.forms[n].kind == "tt"]
    plan.meta["auto"] = rep
    plan.meta["plan_seconds"] = rep["plan_seconds"]
    return plan


def _table_stats(tables, prof, samples, batch_size, world, hot_touch, tt_min_rows, bins):
    """Every table's :func:`~embedscale.plan.auto.table_stats`. The rows' order does not matter to them: a
    synthetic profile's counts are taken as generated (sorted, no scatter; tables of one shape share one array,
    so their histogram is computed once)."""
    synthetic = isinstance(prof, ZipfProfile)
    seen: dict[int, tuple] = {}  # id of a shared counts array -> (array, histogram, total); the array kept alive
    out = []
    for t in tables:
        c = prof.sorted_counts(t.name) if synthetic else prof.counts(t.name)
        hit = seen.get(id(c))
        if hit is None or hit[0] is not c:
            hit = (c, probability_histogram(c, bins, descending=synthetic), float(np.sum(c, dtype=np.float64)))
            if synthetic:
                seen[id(c)] = hit
        out.append(table_stats(t, c, samples, batch_size, world, hot_touch=hot_touch, tt_min_rows=tt_min_rows,
                               bins=bins, hist=hit[1], total=hit[2]))
    return out


def _place(res: AutoResult, tables, prof, topo, mode, batch_size, costs):
    exact = [t for t in tables if res.forms[t.name].kind == "sharded"]
    if not exact:
        raise ConfigError("the auto plan made every table TT or host-placed; training on several ranks needs at "
                          "least one exact (sharded or replicated) table: raise --device-memory")
    plan = make_plan("oper", exact, prof, topo, mode=mode, extra_memory=0.0, batch_size=batch_size)
    plan = _replicate(plan, res.replicated)
    plan.meta["features"] = {t.name: list(getattr(t, "features", None) or [t.name]) for t in exact}
    return plan, rank_breakdown(res, plan, topo.world_size, costs)


def auto_plan_command(tables, profile, topology, out_dir, *, device_memory: float, host_memory: float,
                      costs: Costs | None = None, json_output: bool = False, png: bool = True, **opts) -> dict:
    """Write ``out_dir/auto/`` (the plan, ``explain.txt``, ``explain.json``, ``memory.png``); return the explain
    data (printed as one JSON line with ``json_output``)."""
    plan = make_auto_plan(tables, profile, topology, device_memory=device_memory, host_memory=host_memory,
                          costs=costs, **opts)
    d = Path(out_dir) / "auto"
    plan.save(d)
    rep = dict(plan.meta["auto"])
    rep["plan_dir"] = str(d)
    write_explain(rep, d, png=png)
    if json_output:
        sys.stdout.write(json.dumps(rep, default=float) + "\n")
    return rep


def predict_plan_forms(tables, profile, topology, forms, *, costs: Costs | None = None, batch_size: int = 2048,
                       dense: DenseModel | None = None, host_depth: int = 1, hot_touch: float = 0.01,
                       tt_min_rows: int = 10_000, bins: int = 2048) -> dict:
    """The predicted step (:func:`embedscale.plan.step.predict_forms`) of any plan of ``tables`` given by its forms
    (``{table: TableForm}``, e.g. a hand-made plan's ``Plan.forms`` or ``plan.forms.decide_forms``), by the cost
    model ``--strategy auto`` optimises: hand-made plans and the auto plan are predicted alike."""
    tables = list(tables)
    costs = costs or Costs()
    topo = resolve_topology(topology)
    if not _links_fixed(costs):
        costs = with_topology_links(costs, topo)
    prof = table_profile(resolve_profile(profile, tables), tables)
    samples = getattr(prof, "samples", None)
    samples = samples() if callable(samples) else samples
    stats = _table_stats(tables, prof, samples, batch_size, topo.world_size, hot_touch, tt_min_rows, bins)
    dense = dense or default_dense(tables)
    return predict_forms(stats, forms, dense, batch_size, topo.world_size, costs, host_depth=host_depth)
