"""Where a sharded embedding training step's time goes, per rank: ``cProfile`` over the
steps of ``ShardedEmbedding`` (retrieve design, collective transport, gloo) under the ``oper`` training plan,
the setup of ``bench_vs_torchrec.py --embedding-only`` (26 criteo-kaggle tables capped at ``--max-rows``, Zipf
1.1, one-hot, global batch 4096, row-wise Adagrad, ``grad_sync=alltoall``).

Prints, per rank, the step's median wall time, the time inside the collectives (``all_to_all_single``:
transfer plus waiting for the peer), the count of collectives per step, and the functions with the most
own time; with ``--prefetch`` the next batch's index conversion runs through ``ShardedEmbedding.prefetch``
as a pipelined loop would. A diagnostic, not a speed claim (``bench_vs_torchrec.py`` makes those).

    .venv/bin/python benchmarks/profile_sharded_step.py [--world 2] [--steps 40] [--prefetch] [--top 25]

``--ab OTHER/src/embedscale/embedding/sharded.py`` instead times that file's step (an older checkout's) against
this one's synchronous and prefetched steps, interleaved in the same ranks on the same rows and batches, and
prints one JSON line (medians, p90s, load, whether all three end with the same rows). ``--kernel-ab`` times this
checkout's step on its PyTorch ops (``cpu_kernel = False``) against the same step on the C++ CPU kernel
(``embedding/kernels.cpp``), synchronous and prefetched, the same way.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np
import torch


def worker(rank, world, cfg):
    import torch.distributed as dist

    from embedscale.comm.collective import CollectiveTransport
    from embedscale.data.batch import JaggedFeatures
    from embedscale.data.profile import AccessProfile
    from embedscale.data.synthetic import SyntheticGenerator
    from embedscale.embedding.address_map import address_map_from_plan
    from embedscale.embedding.sharded import ShardedEmbedding
    from embedscale.plan.api import make_plan
    from embedscale.specs import SyntheticConfig, Topology

    torch.set_num_threads(1)
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=cfg["max_rows"], alpha=1.1),
                             seed=0, embedding_dim=16)
    tables = gen.tables
    keys = [t.name for t in tables]
    B, Bl = cfg["batch"], cfg["batch"] // world
    P = 200_000
    cols = gen.sample(0, P)
    profile = AccessProfile({t.name: np.bincount(cols.sparse[t.name][0], minlength=t.num_rows) for t in tables}, P)
    nb = 8
    data = gen.sample(P, B * nb)
    batches = []
    for s in range(nb):
        lo, hi = s * B + Bl * rank, s * B + Bl * (rank + 1)
        values = torch.from_numpy(np.concatenate([data.sparse[k][0][lo:hi] for k in keys])).to(torch.int64)
        batches.append(JaggedFeatures(keys, values, torch.ones(values.numel(), dtype=torch.int64)))
    plan = make_plan("oper", tables, profile, Topology(ranks_per_host=world), mode="training", extra_memory=0.05,
                     batch_size=Bl)
    tr = CollectiveTransport(rank, world)
    emb = ShardedEmbedding(tables, address_map_from_plan(plan, tables), tr, rank, optimizer="rowwise_adagrad",
                           lr=0.05, grad_sync="alltoall", seed=0)
    g = torch.randn(Bl, len(tables) * 16, generator=torch.Generator().manual_seed(rank)) * 1e-3
    calls = {"n": 0, "s": 0.0}
    orig = dist.all_to_all_single

    def counted(*a, **k):
        t0 = time.perf_counter()
        out = orig(*a, **k)
        calls["s"] += time.perf_counter() - t0
        calls["n"] += 1
        return out

    dist.all_to_all_single = counted

    if cfg.get("ab") or cfg.get("kernel_ab"):
        return _ab(rank, emb, cfg, tables, address_map_from_plan(plan, tables), tr, batches, g)

    def step(s):
        if cfg["prefetch"]:
            emb.prefetch(batches[(s + 1) % nb])
        emb(batches[s % nb]).backward(g)

    for s in range(5):
        step(s)
    calls.update(n=0, s=0.0)
    times = []
    prof = cProfile.Profile()
    for s in range(5, 5 + cfg["steps"]):  # the batches go on in order (a prefetched batch is the next one)
        dist.barrier()
        t0 = time.perf_counter()
        prof.enable()
        step(s)
        prof.disable()
        times.append(time.perf_counter() - t0)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(cfg["top"])
    return {"rank": rank, "median_ms": 1e3 * float(np.median(times)), "p90_ms": 1e3 * float(np.quantile(times, 0.9)),
            "a2a_per_step": calls["n"] / cfg["steps"], "a2a_ms_per_step": 1e3 * calls["s"] / cfg["steps"],
            "profile": buf.getvalue(), "kernel": emb.kernel_ops() is not None}


def _ab(rank, emb, cfg, tables, amap, tr, batches, g):
    """``--ab FILE``: the step of another ``sharded.py`` (e.g. an older checkout's
    ``src/embedscale/embedding/sharded.py``, loaded as its own module) against this one's synchronous and
    prefetched steps, same ranks, rows and batches, interleaved step by step (order rotated every step);
    per variant the median and p90 of the slowest rank's step."""
    import importlib.util

    import torch.distributed as dist

    from embedscale.embedding.sharded import ShardedEmbedding

    kw = dict(optimizer="rowwise_adagrad", lr=0.05, grad_sync="alltoall", seed=0)
    if cfg.get("kernel_ab"):  # this checkout's PyTorch ops as "other"
        other_mod = ShardedEmbedding(tables, amap, tr, rank, **kw)
        other_mod.cpu_kernel = False
    else:
        spec = importlib.util.spec_from_file_location("other_sharded", cfg["ab"])
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        other_mod = other.ShardedEmbedding(tables, amap, tr, rank, **kw)
    mods = {"other": other_mod, "this_sync": emb, "this_prefetch": ShardedEmbedding(tables, amap, tr, rank, **kw)}
    nb = len(batches)
    times = {k: [] for k in mods}
    names = list(mods)
    for s in range(5 + cfg["steps"]):
        order = names[s % 3:] + names[:s % 3]
        for k in order:
            if k == "this_prefetch":
                mods[k].prefetch(batches[(s + 1) % nb])
            dist.barrier()
            t0 = time.perf_counter()
            mods[k](batches[s % nb]).backward(g)
            dt = time.perf_counter() - t0
            if s >= 5:
                times[k].append(dt)
    out = {}
    for k in names:
        t = torch.tensor(times[k], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[k] = (1e3 * float(t.median()), 1e3 * float(torch.quantile(t, 0.9)))
    same = all(torch.equal(mods["other"].weight, m.weight) for m in (mods["this_sync"], mods["this_prefetch"]))
    return {"rank": rank, "ab": out, "same_rows": same, "kernel": emb.kernel_ops() is not None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--ab", default=None, metavar="SHARDED_PY",
                    help="time another sharded.py's step against this one's (synchronous and prefetched), "
                         "interleaved")
    ap.add_argument("--kernel-ab", action="store_true",
                    help="time this step on its PyTorch ops against the C++ CPU kernel (synchronous and "
                         "prefetched), interleaved")
    args = ap.parse_args()
    from embedscale.train.launch import spawn_local

    cfg = {"max_rows": args.max_rows, "batch": args.batch, "steps": args.steps, "top": args.top,
           "prefetch": args.prefetch, "ab": args.ab, "kernel_ab": args.kernel_ab}
    load = os.getloadavg()
    res = spawn_local(worker, args.world, cfg, timeout_s=1800)
    if args.ab or args.kernel_ab:
        r0 = res[0]
        print(json.dumps({"benchmark": "sharded_step_ab",
                          "other": args.ab or "this checkout, PyTorch ops (cpu_kernel=False)",
                          "kernel": r0["kernel"], "world": args.world,
                          "median_p90_ms": r0["ab"], "same_rows": all(r["same_rows"] for r in res),
                          "speedup_sync": r0["ab"]["other"][0] / r0["ab"]["this_sync"][0],
                          "speedup_prefetch": r0["ab"]["other"][0] / r0["ab"]["this_prefetch"][0],
                          "loadavg_before": load, "loadavg_after": os.getloadavg(), "steps": args.steps}))
        return
    for r in sorted(res, key=lambda r: r["rank"]):
        print(f"== rank {r['rank']} (C++ kernel: {r['kernel']}): step median {r['median_ms']:.2f} ms, p90 {r['p90_ms']:.2f} ms; "
              f"{r['a2a_per_step']:.1f} all_to_all_single per step, {r['a2a_ms_per_step']:.2f} ms in them")
        print(r["profile"])


if __name__ == "__main__":
    sys.exit(main())
