"""The cost model against the executor's traffic: a remote row moves once per batch (distinct
rows, not accesses) and replicas are synchronised by one sparse AllReduce over all ranks.

References: a per-row float64 sum of ``1 - (1 - p) ** n`` written out here, batches drawn at random from the
profile (Monte Carlo), ``embedding.wire`` (which decodes the address map row by row; its own test checks it
against the transport's byte counter), and a brute-force scan of OPER's replication rule per row.
"""

import numpy as np
import pytest

from embedscale.cli import main
from embedscale.errors import ConfigError
from embedscale.embedding.address_map import address_map_from_plan
from embedscale.embedding.wire import expected_wire_bytes
from embedscale.plan.api import compare, make_plan
from embedscale.plan.cost import evaluate, partition_distinct
from embedscale.plan.oper import _distinct_hot_count
from embedscale.plan.partition import partition_tables, sort_tables
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.plan.topology import as_link_topology
from embedscale.specs import TableSpec, Topology

TABLES = [TableSpec("a", 5000, dim=8), TableSpec("b", 800, dim=8), TableSpec("c", 60, dim=4)]
PROFILE = ZipfProfile.from_tables(TABLES, alpha=1.15, samples=40_000, seed=3)
B = 256


def brute_distinct(plan, profile, batch, world=1):
    """Per partition, sum over its rows of 1 - (1 - p_k) ** (lookups of the table in the batch)."""
    out = np.zeros(plan.num_partitions)
    for t, tab in enumerate(plan.tables):
        c = np.asarray(profile.counts(tab.name), dtype=np.float64)
        n = c.sum() * batch * world / profile.samples
        u = 1.0 - np.power(1.0 - c / c.sum(), n)
        order = plan.order(t)
        for q in range(plan.table_partitions(t).start, plan.table_partitions(t).stop):
            out[q] = u[order[plan.part_start[q]:plan.part_stop[q]]].sum()
    return out


@pytest.mark.parametrize("world", [1, 4])
def test_partition_distinct_is_the_per_row_sum(world):
    plan = make_plan("oper", TABLES, PROFILE, Topology(ranks_per_host=4), batch_size=B, traffic="access")
    got = partition_distinct(plan, PROFILE, B, world)
    np.testing.assert_allclose(got, brute_distinct(plan, PROFILE, B, world), rtol=1e-9, atol=1e-12)
    acc = plan.part_counts * B * world / PROFILE.samples
    assert np.all(got <= acc * (1 + 1e-9))  # a row moves at most once per access ...
    assert got.sum() < 0.5 * acc.sum()  # ... and this skewed profile reads its hot rows many times a batch


def test_sorted_table_distinct_matches_the_exact_sum_on_any_range():
    st = sort_tables(TABLES, PROFILE)
    parts = partition_tables(st, 1e-3)
    scale = B / PROFILE.samples
    got = parts.distinct(st, scale)
    ref = np.zeros(parts.size)
    for q in range(parts.size):
        t = st[parts.table[q]]
        c = np.asarray(PROFILE.counts(t.name), dtype=np.float64)
        u = 1.0 - np.power(1.0 - c / c.sum(), c.sum() * scale)
        ref[q] = u[t.order[parts.start[q]:parts.stop[q]]].sum()
    np.testing.assert_allclose(got, ref, rtol=5e-4)  # the tail's A_k stands for u_k within A_k / 2 < 5e-4


def test_distinct_rows_match_random_batches():
    """The expected distinct rows of a partition against batches drawn from the profile's distribution."""
    plan = make_plan("oper", TABLES, PROFILE, Topology(ranks_per_host=2), batch_size=B, traffic="access")
    pred = partition_distinct(plan, PROFILE, B)
    rng = np.random.default_rng(0)
    draws = 400
    seen = np.zeros(plan.num_partitions)
    for t, tab in enumerate(plan.tables):
        c = np.asarray(PROFILE.counts(tab.name), dtype=np.float64)
        n = int(round(c.sum() * B / PROFILE.samples))
        part_of = np.empty(tab.num_rows, dtype=np.int64)
        sl = plan.table_partitions(t)
        for q in range(sl.start, sl.stop):
            part_of[plan.order(t)[plan.part_start[q]:plan.part_stop[q]]] = q
        for _ in range(draws):
            rows = np.unique(rng.choice(tab.num_rows, size=n, p=c / c.sum()))
            seen += np.bincount(part_of[rows], minlength=plan.num_partitions)
    seen /= draws
    # each table's partitions in four runs of consecutive ones (hot head to cold tail): enough rows per run
    # for 400 draws to pin the mean
    groups = np.concatenate([np.minimum(4 * np.arange(sl.stop - sl.start) // (sl.stop - sl.start), 3) + 4 * t
                             for t, sl in enumerate(plan.table_partitions(t) for t in range(len(TABLES)))])
    got = np.bincount(groups, weights=seen)
    ref = np.bincount(groups, weights=pred)
    assert (ref > 3).sum() >= 8
    np.testing.assert_allclose(got, ref, rtol=0.03, atol=0.3)


def partial_replicas_plan(topo):
    """An OPER plan (the paper's equations: a hot head on every rank) plus second copies of the ten hottest
    single-holder partitions: replicas on some ranks, read by the others from their holders."""
    plan = make_plan("oper", TABLES, PROFILE, topo, batch_size=B, traffic="access", extra_memory=0.3)
    holders, fetch = plan.holders.copy(), plan.fetch.copy()
    single = np.flatnonzero(holders.sum(axis=1) == 1)
    for q in single[np.argsort(-plan.part_counts[single], kind="stable")[:10]]:
        x = (int(np.flatnonzero(holders[q])[0]) + 1) % holders.shape[1]
        holders[q, x] = True
        fetch[q, x] = x
    out = plan.with_replicas(holders, fetch)
    h = out.holders.sum(axis=1)
    assert (h == 2).sum() == 10 and (h == holders.shape[1]).any()
    return out


@pytest.mark.parametrize("strategy", ["oper", "table_wise"])
def test_distinct_bytes_equal_the_wire_prediction(strategy):
    """eqs. 3-4 with distinct rows move exactly what embedding.wire predicts the executor sends (rows and
    gradients; wire also counts the ids): an OPER plan with replicas on some ranks (4 ranks) and a table-wise one."""
    topo = Topology(ranks_per_host=4)
    plan = partial_replicas_plan(topo) if strategy == "oper" else make_plan(strategy, TABLES, PROFILE, topo, batch_size=B)
    cost = evaluate(plan, PROFILE, topo, batch_size=B, traffic="distinct")
    amap = address_map_from_plan(plan, TABLES)
    lookups = {t.name: float(np.sum(PROFILE.counts(t.name))) * B / PROFILE.samples for t in TABLES}
    wire = expected_wire_bytes(amap, TABLES, PROFILE, lookups, mode="training")
    assert cost.comm_bytes_matrix.sum() == pytest.approx(wire["rows"] + wire["grads"], rel=1e-9)
    access = evaluate(plan, PROFILE, topo, batch_size=B, traffic="access")
    # what eq. 3 over-charges: the hot rows' repeats (oper's are mostly replicated, table_wise reads them remotely)
    assert access.comm_bytes_matrix.sum() > (1.1 if strategy == "oper" else 1.5) * cost.comm_bytes_matrix.sum()


def test_replica_sync_is_charged_to_every_rank_as_the_executor_runs_it():
    topo = Topology(ranks_per_host=4)
    plan = partial_replicas_plan(topo)
    cost = evaluate(plan, PROFILE, topo, batch_size=B, traffic="distinct")
    rep = plan.holders.sum(axis=1) > 1
    glob = brute_distinct(plan, PROFILE, B, world=4)
    rb = np.array([t.row_bytes for t in plan.tables], dtype=np.float64)[plan.part_table]
    slots = int(plan.part_rows[rep].sum())
    expect = 2 * 3 / 4 * (np.ceil(slots * 4 / 8) + (glob[rep] * rb[rep]).sum())  # 4 ranks: 4-bit counts a row
    np.testing.assert_allclose(cost.allreduce_bytes_per_rank, np.full(4, expect), rtol=1e-9)
    paper = evaluate(plan, PROFILE, topo, batch_size=B, traffic="access")
    assert not np.allclose(paper.allreduce_bytes_per_rank, paper.allreduce_bytes_per_rank[0])  # holders only
    inf = evaluate(plan, PROFILE, topo, batch_size=B, traffic="distinct", mode="inference")
    assert not inf.allreduce_bytes_per_rank.any()


def brute_hot_count(table, profile, scale, m, ratio):
    c = np.sort(np.asarray(profile.counts(table.name), dtype=np.float64))[::-1]
    p = c / c.sum()
    n = c.sum() * scale
    u, big = 1 - np.power(1 - p, n), 1 - np.power(1 - p, n * m)
    ok = (p > 0) & (u > ratio * big)
    k = int(np.argmin(ok)) if not ok.all() else ok.size
    assert not ok[k:].any()  # the rows that pass are a prefix
    return k


@pytest.mark.parametrize("ratio", [0.3, 0.6, 0.9, 1.0])
def test_distinct_replication_rule_by_brute_force(ratio):
    st = sort_tables(TABLES, PROFILE)
    scale = B / PROFILE.samples
    for t, spec in zip(st, TABLES):
        got = _distinct_hot_count(t, scale, 4, ratio, t.prefix())
        assert got == brute_hot_count(spec, PROFILE, scale, 4, ratio), (spec.name, ratio)
    if ratio == 0.3:
        assert got > 0


def test_oper_against_the_executor_costs():
    """On one host (BW_AR = BW_P2P) no row is worth a replica any more; across hosts the hot rows read over
    the slow links are. Planned against distinct traffic, oper's plan costs less on that model than the plan
    made by the paper's equations."""
    one = Topology(ranks_per_host=4)
    d = make_plan("oper", TABLES, PROFILE, one, batch_size=B)
    assert d.meta["traffic"] == "distinct" and d.meta["replicated_rows_everywhere"] == 0
    two = Topology(num_hosts=2, ranks_per_host=2)
    topo = as_link_topology(two)
    off = ~np.eye(4, dtype=bool)
    ratio = (1 / (topo.allreduce_bw * 1e3)) / topo.cost_matrix()[off].mean()
    plan = make_plan("oper", TABLES, PROFILE, two, batch_size=B, extra_memory=0.3)
    expect = sum(brute_hot_count(t, PROFILE, B / PROFILE.samples, 4, ratio) for t in TABLES)
    assert 0 < plan.meta["replicated_rows_everywhere"] <= expect
    paper = make_plan("oper", TABLES, PROFILE, two, batch_size=B, extra_memory=0.3, traffic="access")
    for p in (plan, paper):
        p.validate()
    cd = evaluate(plan, PROFILE, two, batch_size=B, traffic="distinct").max_rank_cost
    ca = evaluate(paper, PROFILE, two, batch_size=B, traffic="distinct").max_rank_cost
    assert cd <= ca


def test_bad_traffic_is_a_named_error(tmp_path):
    with pytest.raises(ConfigError, match="traffic 'bytes' is not one of"):
        make_plan("oper", TABLES, PROFILE, Topology(ranks_per_host=2), traffic="bytes")
    rep = compare(["oper", "row_wise"], TABLES, PROFILE, Topology(ranks_per_host=2), traffic="access")
    assert rep["config"]["traffic"] == "access"
    from click.testing import CliRunner
    out = tmp_path / "plans"
    res = CliRunner().invoke(main, ["plan", "--preset", "criteo-kaggle", "--max-rows", "2000", "--traffic", "access",
                                    "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert '"traffic": "access"' in res.output
