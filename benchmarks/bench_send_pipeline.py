"""The send design's training step with and without its input pipeline, same run, interleaved.

Two gloo ranks on this machine, each with the thread settings a run gives it (``embedscale.threads``: the passive
OpenMP wait policy and ``cores // ranks`` intra-op threads), train a small DLRM-shaped model: a sharded embedding
in the send design (row-wise tables, the hottest rows replicated on both ranks, ``local_aggregated`` replica
sync) under a bottom and a top MLP, on skewed multi-hot synthetic batches. Two copies of the model from the
same state train on the same batches, alternating every ``--steps`` steps (the order rotated each round):

* baseline: every step's ``input_dist`` at its own step (decode, count all-to-all, ids all-to-all);
* ours: the input pipeline (``ShardedEmbedding.prefetch``): the next batch decoded on the pipeline's worker
  thread during this step, its counts riding this step's pooled all-to-all and its ids the gradient all-to-all;
* ``inline`` (the same riding, the decode on the step's own thread when the batch is handed over,
  ``prefetch(background=False)``): what the worker thread itself costs or buys.

The copies must stay bitwise equal (losses and rows; checked). Figures: rank 0's wall time per step (forward,
backward, dense optimizer), median and p90 over every measured step of every round, and its CPU time per step
(every thread of the process), less sensitive to other work on the machine than wall time. The headline is ours (the
worker, what a run takes) against the baseline. Prints one JSON line.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_send_pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from embedscale.threads import set_wait_policy

set_wait_policy()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from embedscale.comm.collective import CollectiveTransport  # noqa: E402
from embedscale.data.batch import JaggedFeatures  # noqa: E402
from embedscale.embedding.address_map import AddressMap  # noqa: E402
from embedscale.embedding.sharded import ShardedEmbedding  # noqa: E402
from embedscale.specs import TableSpec  # noqa: E402
from embedscale.threads import available_cores, threads_per_process  # noqa: E402
from embedscale.train.launch import spawn_local  # noqa: E402


def tables(a) -> list[TableSpec]:
    return [TableSpec(f"t{i}", a.rows, a.dim, features=[f"f{i}"]) for i in range(a.tables)]


def batch(a, step: int, rank: int) -> tuple[JaggedFeatures, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: power-law ids (hot rows first), 1 to 2 * pooling ids a bag."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 2 * a.pooling, (a.tables * a.batch,), generator=g)
    values = (torch.rand(int(lengths.sum()), generator=g) ** 4 * a.rows).long()
    return (JaggedFeatures([f"f{i}" for i in range(a.tables)], values, lengths),
            torch.randn(a.batch, 13, generator=g), (torch.rand(a.batch, generator=g) < 0.3).float())


class Model(nn.Module):
    def __init__(self, emb: ShardedEmbedding, a):
        super().__init__()
        torch.manual_seed(0)
        self.emb = emb
        self.bottom = nn.Sequential(nn.Linear(13, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear((a.tables + 1) * a.dim, a.hidden), nn.ReLU(), nn.Linear(a.hidden, 1))

    def forward(self, sparse, dense):
        return self.top(torch.cat([self.bottom(dense), self.emb(sparse)], 1)).squeeze(1)


def make(a, rank: int, world: int) -> tuple[Model, torch.optim.Optimizer]:
    ts = tables(a)
    owner = [torch.minimum(torch.arange(a.rows) * world // a.rows, torch.tensor(world - 1)).numpy() for _ in ts]
    hot = [torch.arange(a.replicated).numpy() for _ in ts]
    amap = AddressMap.build(ts, world, owner, hot)
    emb = ShardedEmbedding(ts, amap, CollectiveTransport(), rank, design="send", optimizer="rowwise_adagrad",
                           lr=0.05, grad_sync="local_aggregated")
    m = Model(emb, a)
    dense = [p for n, p in m.named_parameters() if not n.startswith("emb.")]
    return m, torch.optim.SGD(dense, lr=0.01)


def _steps(m, opt, a, first: int, rank: int, world: int, variant: str) -> tuple[list[float], list[float], list]:
    times, cpu, losses = [], [], []
    for s in range(first, first + a.steps):
        sparse, dense, label = batch(a, s, rank)
        ahead = variant != "unpipelined" and s + 1 < first + a.steps  # not across a switch of variants
        upcoming = batch(a, s + 1, rank)[0] if ahead else None  # (made outside the timed step, as its own)
        t0, c0 = time.perf_counter(), time.process_time()
        if ahead:
            m.emb.prefetch(upcoming, background=variant == "pipelined")
        loss = nn.functional.binary_cross_entropy_with_logits(m(sparse, dense), label)
        opt.zero_grad()
        loss.backward()
        for p in opt.param_groups[0]["params"]:  # data parallel dense part: gradients summed over the ranks
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # every thread of the process: the worker's decoding included
        losses.append(loss.item())
    return times, cpu, losses


def _worker(rank: int, world: int, a) -> dict:
    torch.set_num_threads(threads_per_process(available_cores(), world))
    variants = {v: make(a, rank, world) for v in ("unpipelined", "pipelined", "inline")}
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    losses = {k: [] for k in variants}
    for r in range(a.rounds):
        order = list(variants)[r % 3:] + list(variants)[:r % 3]
        for name in order:
            m, opt = variants[name]
            t, c, lo = _steps(m, opt, a, r * a.steps, rank, world, name)
            times[name] += t[a.warmup if r == 0 else 0:]
            cpu[name] += c[a.warmup if r == 0 else 0:]
            losses[name] += lo
    same = all(losses[v] == losses["unpipelined"] and
               torch.equal(variants[v][0].emb.weight, variants["unpipelined"][0].emb.weight) for v in variants)
    return {"times": times, "cpu": cpu, "same_bits": same, "threads": torch.get_num_threads()}


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10, help="steps of one variant in a round")
    ap.add_argument("--warmup", type=int, default=3, help="first steps of the first round not measured")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--replicated", type=int, default=64, help="hot rows of every table held by both ranks")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank")
    ap.add_argument("--pooling", type=int, default=4, help="mean ids a bag")
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps = 3, 6
    load0 = os.getloadavg()[0]
    res = spawn_local(_worker, 2, a, timeout_s=1800)
    t = res[0]["times"]
    med, bmed = statistics.median(t["pipelined"]), statistics.median(t["unpipelined"])
    print(json.dumps({
        "figure": "send design training step with its input pipeline (worker thread), ms",
        "value": round(1e3 * med, 2), "baseline": round(1e3 * bmed, 2), "ratio": round(bmed / med, 3),
        "median_ms": {k: round(1e3 * statistics.median(v), 2) for k, v in t.items()},
        "p90_ms": {k: round(1e3 * q(v, 0.9), 2) for k, v in t.items()},
        "cpu_ms_median": {k: round(1e3 * statistics.median(v), 2) for k, v in res[0]["cpu"].items()},
        "same_bits": all(r["same_bits"] for r in res), "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "config": {**vars(a), "ranks": 2, "threads_per_rank": res[0]["threads"], "cores": available_cores()}}))


if __name__ == "__main__":
    sys.exit(main())
