"""Entry points: ``make_plan``, ``compare`` and the functions behind ``embedscale plan`` / ``topology``.

``make_plan(strategy, tables, profile, topology, ...)`` returns a ``Plan`` for any strategy:
``oper`` (OPER section 4), the baselines of section 6.4 (``table_wise``, ``row_wise``,
``memory_greedy``, ``access_greedy``), ``torchrec`` (TorchRec's planner, converted) and ``milp``
(the exact formulation, small instances). ``compare`` evaluates several on one cost model.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from embedscale.errors import ConfigError, EmbedscaleError
from embedscale.io import atomic_write_json
from embedscale.plan.baselines import BASELINES, plan_baseline
from embedscale.plan.cost import check_mode, check_traffic, evaluate
from embedscale.plan.forms import SHARDED, TableForm, replicated_tables_meta, table_profile
from embedscale.plan.oper import plan_oper
from embedscale.plan.plan import Plan
from embedscale.plan.report import strategy_entry, write_markdown, write_png
from embedscale.plan.synthetic_profile import profile_from_spec
from embedscale.plan.topology import LinkTopology, as_link_topology, load_topology
from embedscale.plan.measure import measure_topology
from embedscale.plan.milp import plan_milp
from embedscale.plan.oper import rank_capacity
from embedscale.plan.torchrec_plan import plan_torchrec
from embedscale.specs import Topology

STRATEGIES = ("oper",) + BASELINES + ("torchrec", "milp")


def resolve_profile(profile, tables):
    """A profile object, a synthetic profile spec (dict with ``kind``), or a path to a saved AccessProfile."""
    if isinstance(profile, dict):
        return profile_from_spec(profile, tables)
    if isinstance(profile, (str, Path)):
        try:
            from embedscale.data.profile import AccessProfile  # written by the data issue
        except ImportError as e:
            raise ConfigError(f"cannot load profile {profile}: embedscale.data.profile unavailable ({e})") from None
        return AccessProfile.load(profile)
    if not hasattr(profile, "counts") or not hasattr(profile, "table_names"):
        raise ConfigError(f"profile: expected an object with .table_names and .counts(name), got {type(profile).__name__}")
    return profile


def resolve_topology(topology) -> LinkTopology:
    if isinstance(topology, (str, Path)):
        return load_topology(topology)
    return as_link_topology(topology)


def make_plan(strategy: str, tables, profile, topology, *, forms: Mapping[str, TableForm] | None = None,
              mode: str = "training", extra_memory: float = 0.05, batch_size: int = 2048, **opts) -> Plan:
    """Plan ``tables`` for ``topology`` with ``strategy`` (one of ``STRATEGIES``).

    Args:
        strategy: ``oper``, ``table_wise``, ``row_wise``, ``memory_greedy``, ``access_greedy``,
            ``torchrec`` or ``milp``.
        tables: ``TableSpec`` list (facts only).
        forms: every table's form, ``{table: TableForm}`` (``plan.forms.decide_forms``); ``None``: every table
            sharded. Only ``sharded`` tables get rows placed; TT tables are replicated on every rank and trained
            data-parallel (EL-Rec VI-B), listed in ``plan.meta["replicated_tables"]``; host tables live in the
            parameter server. ``plan.meta["forms"]`` records every table's form (``Plan.forms``).
        profile: per-row access counts (see ``resolve_profile``); a per-feature profile is summed by table
            (``plan.forms.table_profile``).
        topology: ``specs.Topology``, ``LinkTopology``, a dict or a YAML/JSON path.
        mode: ``training`` or ``inference`` (stored in the plan's metadata).
        extra_memory: replication budget, fraction of the tables' footprint (OPER: 5%).
        batch_size: samples per rank per iteration.
        **opts: strategy options (``threshold``, ``balance_target`` ... for ``oper``; ``time_limit``,
            ``threshold`` for ``milp``; ``granularity`` for ``access_greedy``).

    Example:
        >>> from embedscale.specs import TableSpec, Topology
        >>> from embedscale.plan.synthetic_profile import ZipfProfile
        >>> tabs = [TableSpec("a", 1000), TableSpec("b", 50)]
        >>> plan = make_plan("oper", tabs, ZipfProfile.from_tables(tabs), Topology(ranks_per_host=2))
        >>> plan.validate()
    """
    check_mode(mode)
    all_tables = list(tables)
    forms = _forms(all_tables, forms)
    tables, tt_tables = _split_tt(all_tables, forms)
    if not tables:
        raise ConfigError("no tables to plan" + (" (every table is TT-compressed or host-placed: nothing to shard)"
                                                 if all_tables else ""))
    profile = table_profile(resolve_profile(profile, tables), tables)
    topo = resolve_topology(topology)
    t0 = time.perf_counter()
    if strategy == "oper":
        plan = plan_oper(tables, profile, topo, mode=mode, extra_memory=extra_memory, batch_size=batch_size, **opts)
    elif strategy in BASELINES:
        plan = plan_baseline(strategy, tables, profile, topo.world_size, mode=mode, batch_size=batch_size, **opts)
    elif strategy == "torchrec":
        plan = plan_torchrec(tables, profile, topo, mode=mode, batch_size=batch_size, **opts)
    elif strategy == "milp":
        plan = plan_milp(tables, profile, topo, mode=mode, extra_memory=extra_memory, batch_size=batch_size, **opts)
    else:
        raise ConfigError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    plan.meta.setdefault("plan_seconds", time.perf_counter() - t0)
    plan.meta.update({"mode": mode, "batch_size": int(batch_size), "extra_memory": float(extra_memory)})
    plan.meta.setdefault("topology", topo.to_dict())
    if tt_tables:
        plan.meta["replicated_tables"] = replicated_tables_meta(tt_tables, forms)
    plan.meta["forms"] = {n: f.to_dict() for n, f in forms.items()}
    plan.meta["features"] = {t.name: list(getattr(t, "features", None) or [t.name]) for t in tables}
    return plan


def _forms(tables, forms: Mapping[str, TableForm] | None) -> dict[str, TableForm]:
    """``forms`` of exactly ``tables`` (``None``: all sharded); a table without a form is a ``ConfigError``."""
    if forms is None:
        return {t.name: SHARDED for t in tables}
    missing = [t.name for t in tables if t.name not in forms]
    if missing:
        raise ConfigError(f"tables {missing} have no form (forms given for {sorted(forms)})")
    return {t.name: forms[t.name] for t in tables}


def _split_tt(tables, forms: Mapping[str, TableForm]) -> tuple[list, list]:
    """(tables a plan shards, TT-compressed tables replicated on every rank); host tables are in neither."""
    return ([t for t in tables if forms[t.name].kind == "sharded"], [t for t in tables if forms[t.name].kind == "tt"])


def compare(strategies, tables, profile, topology, *, forms: Mapping[str, TableForm] | None = None,
            mode: str = "training", extra_memory: float = 0.05, batch_size: int = 2048,
            options: dict[str, dict] | None = None, keep_plans: bool = False,
            traffic: str = "distinct") -> dict[str, Any]:
    """Plan with every strategy and evaluate all on one cost model (OPER eqs. 1-5).

    ``traffic``: the cost model's volumes (``plan.cost``): ``distinct`` (default), what the executor moves and
    syncs, or ``access``, OPER's eqs. 3 and 5 as printed; ``oper`` plans against the same.

    A strategy that fails (TorchRec missing, MILP too big) gets ``{"error": message}``; the others
    still run. Returns ``{"config": ..., "strategies": {name: entry}}`` (+ ``"plans"`` if ``keep_plans``).
    ``forms``: as :func:`make_plan`.
    """
    tables = list(tables)
    forms = _forms(tables, forms)
    sharded, tt_tables = _split_tt(tables, forms)
    profile = table_profile(resolve_profile(profile, tables), sharded)
    topo = resolve_topology(topology)
    options = options or {}
    check_traffic(traffic)
    out: dict[str, Any] = {
        "config": {"mode": mode, "batch_size": int(batch_size), "extra_memory": float(extra_memory),
                   "traffic": traffic,
                   "world_size": topo.world_size, "num_hosts": topo.num_hosts, "ranks_per_host": topo.ranks_per_host,
                   "tables": len(tables), "rows": int(sum(t.num_rows for t in tables)),
                   "profile": getattr(profile, "spec", lambda: type(profile).__name__)()},
        "strategies": {},
    }
    budget = float(rank_capacity(topo, float(sum(t.num_rows * t.row_bytes for t in sharded)), extra_memory)[0])
    out["config"]["memory_budget_bytes"] = budget
    if tt_tables:  # not sharded: every rank holds their cores besides its share of the plan
        out["config"]["replicated_tables"] = replicated_tables_meta(tt_tables, forms)
        out["config"]["replicated_bytes_per_rank"] = sum(m["bytes"] for m in out["config"]["replicated_tables"])
    plans = {}
    for name in strategies:
        if name not in STRATEGIES:
            raise ConfigError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
        try:
            opts = dict(options.get(name, {}))
            if name == "oper":
                opts.setdefault("traffic", traffic)
            plan = make_plan(name, tables, profile, topo, forms=forms, mode=mode, extra_memory=extra_memory,
                             batch_size=batch_size, **opts)
        except EmbedscaleError as e:
            out["strategies"][name] = {"error": str(e)}
            continue
        plan.meta.setdefault("traffic", traffic)  # the model the plan is reported on (and drift costs it with)
        # every strategy is held to the same memory budget (a strategy's own packing slack, if it declares
        # one, counts: oper at 0% extra may overshoot by one partition)
        cap = max(budget, float(plan.meta.get("capacity_bytes") or 0.0))
        cost = evaluate(plan, profile, topo, mode=mode, batch_size=batch_size, part_counts=plan.part_counts,
                        capacity_bytes=cap, traffic=traffic)
        out["strategies"][name] = strategy_entry(plan, cost)
        plans[name] = plan
    if keep_plans:
        out["plans"] = plans
    return out


def plan_command(tables, profile, topology, strategies=("oper",), out_dir="plans", mode: str = "training",
                 extra_memory: float = 0.05, json_output: bool = False, batch_size: int = 2048, png: bool = True,
                 options: dict[str, dict] | None = None,
                 forms: Mapping[str, TableForm] | None = None, traffic: str = "distinct") -> dict[str, Any]:
    """``embedscale plan``: write ``out_dir/<strategy>/`` (the plan files), ``report.json``, ``report.md``
    and ``report.png``; with ``json_output`` print the report as one JSON line on stdout. ``forms``: as
    :func:`make_plan`."""
    out = Path(out_dir)
    report = compare(strategies, tables, profile, topology, forms=forms, mode=mode, extra_memory=extra_memory,
                     batch_size=batch_size, options=options, keep_plans=True, traffic=traffic)
    plans = report.pop("plans")
    for name, plan in plans.items():
        plan.save(out / name)
        report["strategies"][name]["plan_dir"] = str(out / name)
    atomic_write_json(out / "report.json", report)
    write_markdown(report, out / "report.md")
    if png and plans:
        write_png(report, out / "report.png")
    if json_output:
        sys.stdout.write(json.dumps(report) + "\n")
    return report


def topology_command(out_path, *, num_hosts: int = 1, ranks_per_host: int = 2, measure: bool = False,
                     base=None, **measure_opts) -> dict[str, Any]:
    """``embedscale topology``: write a topology file; ``measure=True`` fills the bandwidths and latencies
    of the classes it can reach on this machine with ``plan.measure.measure_topology``."""
    spec = base if base is not None else Topology(num_hosts=num_hosts, ranks_per_host=ranks_per_host)
    if measure:
        topo = measure_topology(num_hosts=spec.num_hosts, ranks_per_host=spec.ranks_per_host, base=spec, **measure_opts)
    else:
        topo = as_link_topology(spec)
    d = topo.to_dict()
    atomic_write_json(out_path, d)
    return d
