"""Input drift (OPER section 8): how an existing plan fares on a new profile, and whether to re-plan.

OPER monitors the input distribution, re-evaluates the running plan with the section 3.2 model and
re-plans when optimality has degraded. ``drift`` does exactly that on two profiles:

1. the plan's cost on the profile it was made for (its stored ``part_counts``, or ``old_profile``);
2. its cost on the new profile: how far each degree of balance and the bottleneck cost moved;
3. a fresh plan for the new profile (same strategy options), its cost, and how many rows change owner
   (and how many replica copies appear or go) if we switch: what re-planning would move.

``replan`` is recommended when the fresh plan's bottleneck (``max_rank_cost``) is lower than the old
plan's on the new profile by more than ``min_gain`` (default 5%), or the old plan's lookup or
communication DoB on the new profile is below ``dob_floor`` (for ``embedscale drift``: and below what it was on
the old profile, as a plan made below the floor, e.g. whole tables on more ranks than tables, is no drift).

Every cost, and the fresh ``oper`` plan, is on one traffic model (``plan.cost``): ``traffic="access"``, OPER's
own equations, for the online re-planning of a run (``train.replan``: measured and tuned on them, its lookup-DoB
bars count accesses); the plan's own model for ``drift_command`` (``embedscale drift``: the ``traffic`` the plan
was made and reported with, ``distinct`` by default, what the executor moves), so a plan on the profile it was
made for costs what its report said and its fresh plan is itself.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from embedscale.errors import ConfigError
from embedscale.io import atomic_write_json
from embedscale.plan.api import make_plan, resolve_profile, resolve_topology
from embedscale.plan.cost import check_traffic, evaluate
from embedscale.plan.forms import table_profile
from embedscale.plan.plan import Plan
from embedscale.plan.synthetic_profile import ArrayProfile
from embedscale.plan.topology import as_link_topology
from embedscale.specs import TableSpec


def rows_moved(old: Plan, new: Plan) -> dict[str, Any]:
    """Rows whose owner changes, and replica copies added or dropped, between two plans (per table)."""
    if [t.name for t in old.tables] != [t.name for t in new.tables]:
        raise ConfigError(f"plans have different tables: {old.table_names} vs {new.table_names}")
    if old.world_size != new.world_size:
        raise ConfigError(f"plans have different world sizes: {old.world_size} vs {new.world_size}")
    per_table, moved, moved_bytes, rep_add, rep_drop = {}, 0, 0, 0, 0
    for t, tab in enumerate(old.tables):
        o_old, _ = old.address_map(t)
        o_new, _ = new.address_map(t)
        k = int(np.count_nonzero(o_old != o_new))
        h_old = _holder_counts(old, t)
        h_new = _holder_counts(new, t)
        add = int(np.maximum(h_new - h_old, 0).sum())
        drop = int(np.maximum(h_old - h_new, 0).sum())
        per_table[tab.name] = {"owner_changed": k, "replicas_added": add, "replicas_dropped": drop}
        moved += k
        moved_bytes += k * tab.row_bytes
        rep_add += add
        rep_drop += drop
    return {"rows_moved": moved, "bytes_moved": moved_bytes, "replica_rows_added": rep_add,
            "replica_rows_dropped": rep_drop, "per_table": per_table}


def _holder_counts(plan: Plan, t: int) -> np.ndarray:
    """Per row of table ``t``, the number of replica copies (holders minus one)."""
    sl = plan.table_partitions(t)
    per_part = plan.holders[sl].sum(axis=1) - 1
    out = np.empty(plan.tables[t].num_rows, dtype=np.int32)
    out[plan.order(t)] = np.repeat(per_part.astype(np.int32), plan.part_rows[sl])
    return out


def drift(plan: Plan, new_profile, topology, **kw) -> dict[str, Any]:
    """Evaluate ``plan`` on ``new_profile`` and decide whether to re-plan (OPER section 8): the report of
    :func:`drift_and_plan` (its arguments)."""
    return drift_and_plan(plan, new_profile, topology, **kw)[0]


def drift_and_plan(plan: Plan, new_profile, topology, *, old_profile=None, mode: str | None = None,
                   batch_size: int | None = None, strategy: str | None = None, min_gain: float = 0.05,
                   dob_floor: float = 0.9, replan: bool = True, traffic: str = "access",
                   floor_from_before: bool = False, **opts) -> tuple[dict[str, Any], Plan | None]:
    """Evaluate ``plan`` on ``new_profile`` and decide whether to re-plan (OPER section 8): ``(report, fresh
    plan)`` (``None`` without ``replan``). The live re-plan of a run (``train.replan``) migrates to the fresh
    plan when ``report["replan"]``; ``report["after"]["balance"]`` / ``["replanned"]["balance"]`` are the
    running and the fresh plan's max / mean per-rank cost on the new profile.

    Args:
        plan: the plan in use.
        new_profile: the profile of the new data.
        topology: the machine (``specs.Topology`` / ``LinkTopology``).
        old_profile: the profile the plan was made for (default: the plan's stored ``part_counts``).
        mode, batch_size: default to the plan's metadata.
        strategy: strategy of the fresh plan (default: the plan's own, else ``oper``).
        min_gain, dob_floor: the re-plan rule (see module docstring).
        replan: False skips the fresh plan (no ``rows_moved``).
        traffic: the cost model's volumes (``plan.cost``): ``access`` (OPER eqs. 3 and 5, the live re-plan rule)
            or ``distinct`` (what the executor moves; the fresh ``oper`` plan is made on the same).
        floor_from_before: a degree of balance below ``dob_floor`` asks for a re-plan only when it is also below
            the plan's on the old profile (``drift_command``; the live rule asks whenever it is below).
        **opts: options for the fresh plan (e.g. ``extra_memory``).
    """
    topo = as_link_topology(topology)
    mode = mode or plan.meta.get("mode", "training")
    batch_size = int(batch_size or plan.meta.get("batch_size", 2048))
    check_traffic(traffic)
    before = _cost_before(plan, old_profile, topo, mode, batch_size, traffic)
    after = evaluate(plan, new_profile, topo, mode=mode, batch_size=batch_size, traffic=traffic)
    out: dict[str, Any] = {
        "mode": mode,
        "batch_size": batch_size,
        "traffic": traffic,
        "before": _figures(before),
        "after": _figures(after),
        "dob_lookup_change": after.dob_lookup - before.dob_lookup,
        "dob_comm_change": after.dob_comm - before.dob_comm,
        "max_rank_cost_ratio": after.max_rank_cost / before.max_rank_cost if before.max_rank_cost > 0 else float("inf"),
    }
    degraded = after.dob_lookup < dob_floor or after.dob_comm < dob_floor
    if floor_from_before:  # a balance the plan had on its own profile already is how it was made, not drift
        degraded = ((after.dob_lookup < dob_floor and after.dob_lookup < before.dob_lookup - 1e-9)
                    or (after.dob_comm < dob_floor and after.dob_comm < before.dob_comm - 1e-9))
    if replan:
        strat = strategy or plan.meta.get("strategy", "oper")
        if strat not in ("oper", "access_greedy", "milp", "torchrec", "table_wise", "row_wise", "memory_greedy"):
            strat = "oper"
        extra = dict(opts)
        extra.setdefault("extra_memory", plan.meta.get("extra_memory", 0.05))
        if strat == "oper":
            extra.setdefault("traffic", traffic)
        fresh = make_plan(strat, plan.tables, new_profile, topo, mode=mode, batch_size=batch_size, **extra)
        fresh_cost = evaluate(fresh, new_profile, topo, mode=mode, batch_size=batch_size, part_counts=fresh.part_counts,
                              traffic=traffic)
        gain = 1.0 - fresh_cost.max_rank_cost / after.max_rank_cost if after.max_rank_cost > 0 else 0.0
        out["replanned"] = _figures(fresh_cost)
        out["replan_strategy"] = strat
        out["replan_gain"] = gain
        out["replan_seconds"] = fresh.meta.get("plan_seconds")
        out.update(rows_moved(plan, fresh))
        out["replan"] = bool(gain > min_gain or degraded)
        out["reason"] = (
            f"re-planning lowers the bottleneck cost by {gain:.1%}" if gain > min_gain
            else f"balance fell below {dob_floor}" if degraded
            else f"re-planning gains only {gain:.1%} (< {min_gain:.0%}); keep the plan"
        )
    else:
        fresh = None
        out["replan"] = bool(degraded)
        out["reason"] = f"balance fell below {dob_floor}" if degraded else "balance holds"
    return out, fresh


def _cost_before(plan: Plan, old_profile, topo, mode: str, batch_size: int, traffic: str):
    """The plan's cost on the profile it was made for: ``old_profile``, else the plan's stored per-partition
    counts (``part_counts``; for ``distinct`` traffic, which needs per-row counts, each partition's count spread
    evenly over its rows: OPER's partitions group rows of like frequency)."""
    if old_profile is not None:
        return evaluate(plan, old_profile, topo, mode=mode, batch_size=batch_size, traffic=traffic)
    if plan.part_counts is None:
        raise ConfigError(f"drift: the {plan.meta.get('strategy', '')} plan stores no per-partition counts "
                          "(part_counts): give the profile it was made from (old_profile; embedscale drift "
                          "--old-profile DIR)")
    samples = plan.meta.get("samples", 1)
    if traffic == "distinct":
        return evaluate(plan, _spread_part_counts(plan, samples), topo, mode=mode, batch_size=batch_size,
                        traffic=traffic)

    class _Stored:  # the stored per-partition counts stand in for the old profile
        pass

    prof = _Stored()
    prof.samples = samples
    return evaluate(plan, prof, topo, mode=mode, batch_size=batch_size, part_counts=plan.part_counts,
                    traffic=traffic)


def _spread_part_counts(plan: Plan, samples: float) -> ArrayProfile:
    """A per-row profile from the plan's per-partition counts, every row of a partition its mean."""
    pc = np.asarray(plan.part_counts, dtype=np.float64)
    counts = {}
    for t, tab in enumerate(plan.tables):
        sl = plan.table_partitions(t)
        c = np.empty(tab.num_rows, dtype=np.float64)
        c[plan.order(t)] = np.repeat(pc[sl] / np.maximum(plan.part_rows[sl], 1), plan.part_rows[sl])
        counts[tab.name] = c
    return ArrayProfile(counts, samples=max(int(round(float(samples))), 1))


def _figures(c) -> dict[str, float]:
    total = c.total_per_rank
    mean = float(total.mean()) if total.size else 0.0
    return {"dob_memory": c.dob_memory, "dob_lookup": c.dob_lookup, "dob_comm": c.dob_comm,
            "comm_mean": c.comm_mean, "max_rank_cost": c.max_rank_cost,
            "balance": c.max_rank_cost / mean if mean > 0 else 1.0,
            # a floor under any plan's bottleneck: every access is looked up once, by some rank, at the local
            # bandwidth (eq. 2), so the ranks' lookups sum to the same whatever the placement
            "lookup_mean": float(c.lookup_per_rank.mean()) if c.lookup_per_rank.size else 0.0}


def drift_command(plan_dir, new_profile, topology, *, json_output: bool = False, out_path=None, old_profile=None,
                  **opts) -> dict[str, Any]:
    """``embedscale drift``: evaluate a saved plan on a new profile (OPER section 8) with the traffic model the plan
    was made with; ``old_profile``: the profile it was made from (default: its stored per-partition counts).
    Write the verdict to ``out_path`` (JSON) if given, print it as one JSON line with ``json_output``."""
    plan = Plan.load(plan_dir)
    opts.setdefault("traffic", plan.meta.get("traffic") or "distinct")  # the plan's own model (plan's default)
    opts.setdefault("floor_from_before", True)
    tables = plan.tables
    features = plan.meta.get("features") or {}  # a per-feature profile (embedscale profile) sums by table
    specs = [TableSpec(t.name, t.num_rows, t.dim, features=features.get(t.name) or [t.name]) for t in tables]
    if old_profile is not None:
        opts["old_profile"] = table_profile(resolve_profile(old_profile, tables), specs)
    rep = drift(plan, table_profile(resolve_profile(new_profile, tables), specs), resolve_topology(topology), **opts)
    if out_path is not None:
        atomic_write_json(out_path, rep)
    if json_output:
        sys.stdout.write(json.dumps(rep) + "\n")
    return rep
