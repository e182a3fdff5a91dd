"""The MILP (OPER section 3.3) equals a brute-force enumeration of every plan on tiny instances.

The brute force enumerates every holder set of every row (in training too: any number of holders, each
paying eq. 5's ``2 (h-1)/h`` AllReduce share) and every fetch path of every non-holder, evaluates each
plan with the cost model, and keeps the smallest ``max_rank_cost`` among those within capacity.
"""

import itertools

import numpy as np
import pytest

from embedscale.plan.cost import evaluate, evaluate_arrays
from embedscale.plan.milp import plan_milp, solve_units
from embedscale.plan.oper import plan_oper
from embedscale.plan.synthetic_profile import ArrayProfile
from embedscale.plan.topology import LinkTopology
from embedscale.specs import TableSpec


def row_options(m: int, mode: str):
    """Every (holders, fetch) of one row on m ranks."""
    out = []
    sets = [frozenset(s) for k in range(1, m + 1) for s in itertools.combinations(range(m), k)]
    for s in sets:
        non = [i for i in range(m) if i not in s]
        for srcs in itertools.product(sorted(s), repeat=len(non)):
            h = np.zeros(m, dtype=bool)
            h[list(s)] = True
            f = np.arange(m)
            f[non] = srcs
            out.append((h, f))
    return out


def brute_force(access, row_bytes, topo, cap, mode):
    m = topo.world_size
    p = access.size
    opts = row_options(m, mode)
    best = np.inf
    table = np.zeros(p, dtype=np.int64)
    rows = np.ones(p)
    for combo in itertools.product(range(len(opts)), repeat=p):
        holders = np.array([opts[c][0] for c in combo])
        if np.any(holders.sum(axis=0) * row_bytes > cap + 1e-9):
            continue
        fetch = np.array([opts[c][1] for c in combo])
        c = evaluate_arrays(table, rows, access, np.array([row_bytes]), holders, fetch, topo, mode)
        best = min(best, c.max_rank_cost)
    return best


@pytest.mark.parametrize(
    "m, mode, latency, cap_rows",
    [(2, "inference", 0.0, 3), (2, "training", 0.0, 3), (2, "inference", 3.0, 4),
     (3, "inference", 1.0, 2), (3, "training", 0.5, 3)],
)
def test_milp_equals_brute_force(m, mode, latency, cap_rows):
    rng = np.random.default_rng(m * 10 + cap_rows)
    p = 5 if m == 2 else 4
    access = rng.integers(0, 20, size=p).astype(np.float64)
    row_bytes = 8.0
    topo = LinkTopology.from_link_classes(1, m, {"same_rank": 0.05, "same_host": 0.01}, {"same_host": latency},
                                          allreduce_bw=0.004)
    cap = np.full(m, cap_rows * row_bytes)
    bf = brute_force(access, row_bytes, topo, cap, mode)
    sol = solve_units(access, np.full(p, row_bytes), np.full(p, row_bytes), topo, cap, mode, time_limit=30)
    assert sol["optimal"]
    assert sol["objective"] == pytest.approx(bf, rel=1e-6, abs=1e-9)
    # and the plan the solver returns is evaluated by the cost model at the same figure
    c = evaluate_arrays(np.zeros(p, dtype=np.int64), np.ones(p), access, np.array([row_bytes]), sol["holders"],
                        sol["fetch"], topo, mode)
    assert c.max_rank_cost == pytest.approx(bf, rel=1e-6, abs=1e-9)
    assert np.all(c.memory_per_rank <= cap + 1e-9)


def test_plan_milp_is_a_valid_plan_no_worse_than_oper():
    tables = [TableSpec("a", 5, dim=2), TableSpec("b", 3, dim=2)]
    prof = ArrayProfile({"a": np.array([9, 0, 4, 1, 2]), "b": np.array([1, 6, 3])}, samples=10)
    topo = LinkTopology.from_link_classes(1, 2, {"same_rank": 1.0, "same_host": 0.1})
    for mode in ("inference", "training"):
        mp = plan_milp(tables, prof, topo, mode=mode, extra_memory=0.25, batch_size=100, time_limit=30)
        mp.validate()
        cm = evaluate(mp, prof, topo, mode=mode, batch_size=100)
        assert mp.meta["milp"]["optimal"]
        assert cm.max_rank_cost == pytest.approx(mp.meta["milp"]["objective"], rel=1e-6)
        op = plan_oper(tables, prof, topo, mode=mode, extra_memory=0.25, batch_size=100, traffic="access")
        co = evaluate(op, prof, topo, mode=mode, batch_size=100)
        assert cm.max_rank_cost <= co.max_rank_cost * (1 + 1e-9)


@pytest.mark.parametrize("mode, extra", [("inference", 0.25), ("training", 0.0), ("training", 0.25)])
def test_oper_within_two_percent_of_the_optimum(mode, extra):
    from embedscale.plan.synthetic_profile import ZipfProfile
    from embedscale.specs import Topology

    tables = [TableSpec("t0", 10, dim=16), TableSpec("t1", 4, dim=16)]
    prof = ZipfProfile.from_tables(tables, alpha=1.1, samples=1000, seed=2)
    topo = Topology(num_hosts=1, ranks_per_host=2, intra_host_latency_us=0.0)
    mp = plan_milp(tables, prof, topo, mode=mode, extra_memory=extra, batch_size=4096, time_limit=30)
    assert mp.meta["milp"]["optimal"]
    op = plan_oper(tables, prof, topo, mode=mode, extra_memory=extra, batch_size=4096, traffic="access")
    opt = evaluate(mp, prof, topo, mode=mode, batch_size=4096).max_rank_cost
    got = evaluate(op, prof, topo, mode=mode, batch_size=4096).max_rank_cost
    assert opt <= got <= 1.02 * opt
