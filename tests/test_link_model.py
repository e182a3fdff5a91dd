"""The simulated per-rank network link (``comm.hierarchical``: ``HostAwareTransport`` with a ``LinkModel``, one
rank per host) against a hand-worked case, its cost-model view (``link_topology``), and its wiring into every run of
``benchmarks/bench_online.py --link-gbit``.

Hand plan (4 ranks, one table of 8 rows, dim 4, float32: 16 B a row): rows 0-1 (the hot rows) on rank 0, rows
2r..2r+1 on rank r. Rank r's batch: four one-hot samples reading rows 0, 0, 1 and 2r + 1. The send design's
training step, counted by hand (bytes to and from *other* ranks):

- count swap: two int64 to every peer: 3 x 16 = 48 B sent and 48 B received by every rank;
- ids: an (offset, partial bag) int64 pair and a float32 scale, 20 B a value; ranks 1-3 send rank 0 their three
  values on rows 0, 0, 1 (60 B each); rank 0 receives 180 B and sends none (its four values are its own);
- pooled sums: one 16 B row per partial bag back: rank 0 sends 3 x 48 = 144 B, ranks 1-3 receive 48 B each;
- gradients: the same bags' gradients to rank 0: ranks 1-3 send 48 B each, rank 0 receives 144 B.

Each exchange costs ``latency + max(sent, received) * 8 / rate``: rank 0 (the busiest) 4 latencies + (48 + 180 +
144 + 144) B, ranks 1-3 4 latencies + (48 + 60 + 48 + 48) B.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.hierarchical import HostAwareTransport, LinkModel, link_topology
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.address_map import address_map_from_plan
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import ConfigError
from embedscale.plan.cost import evaluate
from embedscale.plan.plan import Plan
from embedscale.specs import TableSpec, Topology
from embedscale.train.launch import spawn_local

W, ROWS, DIM = 4, 8, 4
GBIT, LAT_US = 0.001, 100.0  # 1 Mbit/s: the hand case's 516 B take 4.1 ms
HAND_BYTES = {0: 48 + 180 + 144 + 144, 1: 48 + 60 + 48 + 48}  # rank 0; every other rank


def hand_seconds(rank: int) -> float:
    return 4 * LAT_US * 1e-6 + HAND_BYTES[min(rank, 1)] * 8 / (GBIT * 1e9)


def tables():
    return [TableSpec("t_C1", ROWS, DIM, features=["C1"])]


def hand_plan() -> Plan:
    return Plan(tables(), W, [None], [0] * W, [0, 2, 4, 6], [2, 4, 6, 8], owner=[0, 1, 2, 3],
                holders=np.eye(W, dtype=bool), meta={"strategy": "hand"})


def batch(rank: int) -> JaggedFeatures:
    return JaggedFeatures(["C1"], torch.tensor([0, 0, 1, 2 * rank + 1]), torch.ones(4, dtype=torch.int64))


def _worker(rank, world):
    link = LinkModel(GBIT, LAT_US)
    tr = HostAwareTransport(CollectiveTransport(), list(range(world)), 1, link)
    emb = ShardedEmbedding(tables(), address_map_from_plan(hand_plan(), tables()), tr, rank, design="send",
                           optimizer="sgd", lr=0.1)
    t0 = time.perf_counter()
    emb(batch(rank)).sum().backward()
    wall = time.perf_counter() - t0
    step = {"modelled": tr.modelled_seconds, "wall": wall, "sent": dict(tr.cross_bytes),
            "recv": dict(tr.cross_recv_bytes)}
    # an exchange started in the background: charged once, and its wait returns no sooner than the link allows
    tr.reset_bytes()
    send = [torch.zeros(0, DIM) if p == rank else torch.ones(10 * (rank + 1), DIM) for p in range(world)]
    t0 = time.perf_counter()
    pending = tr.exchange_start(send, [0 if p == rank else 10 * (p + 1) for p in range(world)], kind="pooled")
    got = pending.wait()
    bg = {"modelled": tr.modelled_seconds, "wall": time.perf_counter() - t0, "rows": [int(g.shape[0]) for g in got]}
    return step, bg


def test_link_charges_each_ranks_bytes_as_counted_by_hand():
    res = spawn_local(_worker, W, timeout_s=300)
    for r, (step, bg) in enumerate(res):
        assert math.isclose(step["modelled"], hand_seconds(r), rel_tol=1e-9), (r, step)
        assert step["wall"] >= hand_seconds(r) * 0.999  # the link's time is slept, not only counted
        want_sent = {"meta": 48, "ids": 0 if r == 0 else 60, "pooled": 144 if r == 0 else 0,
                     "grads": 0 if r == 0 else 48}
        assert {k: step["sent"].get(k, 0) for k in want_sent} == want_sent, (r, step["sent"])
        # background: rank r sends 10 (r + 1) rows of 16 B to each of 3 peers, receives 10 (p + 1) from each p
        sent = 3 * 10 * (r + 1) * DIM * 4
        recv = sum(10 * (p + 1) * DIM * 4 for p in range(W) if p != r)
        want = LAT_US * 1e-6 + max(sent, recv) * 8 / (GBIT * 1e9)
        assert math.isclose(bg["modelled"], want, rel_tol=1e-9), (r, bg)
        assert bg["wall"] >= want * 0.999
        assert bg["rows"] == [0 if p == r else 10 * (p + 1) for p in range(W)]  # what each peer sent
    busiest = max(range(W), key=lambda r: res[r][0]["modelled"])
    assert busiest == 0  # the hot rows' owner: its step is the run's step


def test_link_topology_costs_the_hot_owners_link():
    """The cost model (``plan.cost``, access traffic) under ``link_topology``: rank 0 serves the hot rows. By hand:
    the profile is the hand batches (16 samples; rows 0, 1, 3, 5, 7 read 8, 5, 1, 1, 1 times), so each rank reads
    a row ``B c / 16`` times per batch of B = 4 (the model averages over ranks): row 0 twice, row 1 1.25 times,
    rows 3, 5, 7 0.25 times. A row is 16 B; the link 8 Gbit/s = 1 GB/s (1e-3 us a byte), a lookup at half that
    (2e-3 us a byte: out and back). Rank 0 serves 4 ranks x 3.25 reads = 13 rows (208 B) -> 0.416 us and fetches
    0.25 rows from each of 3 peers, twice (24 B) -> 0.024 us; rank r serves 4 x 0.25 rows (16 B) -> 0.032 us and
    fetches 3.25 rows from rank 0 and 0.25 from each of 2 peers, twice (120 B) -> 0.120 us; every rank waits two
    latency rounds of 2 us (one host). Without the link, rank 0's lookup is at 1000 GB/s."""
    counts = np.zeros(ROWS)
    for r in range(W):
        for i in (0, 0, 1, 2 * r + 1):
            counts[i] += 1
    from embedscale.plan.synthetic_profile import ArrayProfile
    prof = ArrayProfile({"t_C1": counts}, samples=W * 4)
    topo = link_topology(Topology(ranks_per_host=W), 8.0)
    c = evaluate(hand_plan(), prof, topo, mode="training", batch_size=4)
    want = [208 * 2e-3 + 24 * 1e-3 + 2 * 2.0] + [16 * 2e-3 + 120 * 1e-3 + 2 * 2.0] * 3
    np.testing.assert_allclose(c.total_per_rank, want, rtol=1e-9)
    assert int(np.argmax(c.total_per_rank)) == 0 and c.dob_lookup == pytest.approx(16 / 208)
    plain = evaluate(hand_plan(), prof, Topology(ranks_per_host=W), mode="training", batch_size=4)
    assert plain.lookup_per_rank[0] == pytest.approx(208 / 1000e3)  # the default: a local read at 1000 GB/s
    assert link_topology(Topology(), 0.0) == Topology()
    with pytest.raises(ConfigError, match="link_gbit_s"):
        link_topology(Topology(), -1.0)


# -- the benchmark's option -------------------------------------------------------------------------
def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_online.py"
    spec = importlib.util.spec_from_file_location("bench_online_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class _Env:
    transport: object = None


class _Inner(CollectiveTransport):
    def __init__(self):
        super().__init__(0, 2)

    def exchange(self, send, recv_counts=None, kind="data"):
        return [s.clone() for s in send]


class _Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp, self.embedding = torch.nn.Linear(10, 5), torch.nn.Embedding(100, 4)

    def dense_parameters(self):  # the embedding's rows are not in the dense AllReduce
        return self.mlp.parameters()


def _fake_run(sync_bytes: int):
    inner = _Inner()
    run = SimpleNamespace(world=2, embedding=SimpleNamespace(transport=inner), transport=inner,
                          embedding_env=_Env(inner), model=_Dense(), sync_bytes_per_step=[])

    def train_step(batch):
        run.embedding.transport.exchange([torch.zeros(0, 4), torch.ones(batch, 4)], kind="pooled")
        run.sync_bytes_per_step.append(sync_bytes)
        return 0.5
    run.train_step = train_step
    return run


def test_bench_option_puts_every_run_on_the_same_link():
    b = _bench()
    ap = argparse.ArgumentParser()
    b.add_link_options(ap)
    a = ap.parse_args(["--link-gbit", "0.001", "--link-latency-us", "50", "--design", "send", "--extra-memory", "0"])
    a.dim, a.batch, a.steps, a.every, a.min_gain, a.lag, a.count_every = 8, 64, 10, 5, 0.05, 1, 1
    for name in b.RUNS + (b.TWIN,):  # every run: the same design and the link's rate for the monitor's costs
        cfg = b.run_config(a, Path("/tmp/x"), Path("/tmp/d"), name, 4)
        assert (cfg.dist.design, cfg.dist.link_gbit_s, cfg.dist.extra_memory) == ("send", 0.001, 0.0), name
    assert b.plan_link(a) == {"link_gbit": 0.001, "traffic": "access", "extra_memory": 0.0}  # the plans' topology
    job = b.link_job(a)
    runs = {n: _fake_run(sync_bytes=100 * (i + 1)) for i, n in enumerate(b.RUNS + (b.TWIN,))}
    per_step = {n: b.attach_link(r, job) for n, r in runs.items()}
    # 55 dense parameters (float32, 220 B): a 2-rank ring sends 2 (W - 1) / W of them, 220 B
    for i, (n, r) in enumerate(runs.items()):
        tr = r.embedding.transport
        assert isinstance(tr, HostAwareTransport) and r.transport is tr and r.embedding_env.transport is tr
        assert tr.link == LinkModel(0.001, 50.0) and tr.cross == [False, True]  # one rank per host
        assert r.train_step(3) == 0.5
        pooled = 50e-6 + 3 * 16 * 8 / 1e6  # this rank sends 3 rows of 16 B to rank 1
        ring = 50e-6 + 220 * 8 / 1e6
        sync = 50e-6 + 100 * (i + 1) * 8 / 1e6
        assert per_step[n] == [pytest.approx(pooled + ring + sync, rel=1e-9)], n
    assert b.link_job(ap.parse_args([])) is None  # no --link-gbit: no link
