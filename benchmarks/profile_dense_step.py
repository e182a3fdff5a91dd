"""Where a training step's dense part goes, ours against TorchRec's, in the same 2 rank processes: the setup of
``bench_vs_torchrec.py`` table1 (26 criteo-kaggle tables capped at 100k rows, dim 16, bottom 512-256-64-16,
top 512-256-1, global batch 4096, row-wise Adagrad), each variant's steps interleaved with the others' (order
flipped every step).

Variants (``--variants``, any subset):

- ``ours``: the benchmark's step (``dense_ddp``, sum hook, loss sum / global batch; the model starts the
  embedding's row exchange before the bottom MLP and its gradient exchange beside the bottom MLP's backward);
- ``ours_serial``: the same step with the exchanges and the bottom MLP one after the other (``DLRM.overlap`` and
  ``overlap_backward`` off);
- ``torchrec``: TorchRec's DLRM under ``DistributedModelParallel``, its fused optimizer, its loss convention;
- ``dense_ours`` / ``dense_torchrec``: the dense part alone, the same fixed pooled embeddings (a parameter in
  place of the embedding: no lookup, no exchange) through our DLRM in ``dense_ddp`` and through TorchRec's DLRM
  class (its dense, interaction and over arches, copied from the sharded model) in DDP as TorchRec's
  ``DefaultDataParallelWrapper`` wraps it (static graph, mean hook, loss = local mean);
- ``dense_ours_1mb``: ``dense_ours`` in DDP's default buckets (a first bucket of 1 MB: two AllReduces, the first
  beside the backward) instead of ``dense_ddp``'s;
- ``emb_ours`` / ``emb_torchrec``: the embedding alone with a fixed output gradient (as the benchmark's
  breakdown).

Per variant: median wall step (the slowest rank's), median process CPU (the busier rank's), the calling
thread's CPU alone (the rest is the communication backend's threads) and the median step-by-step CPU
difference to ``torchrec``. ``--profile`` adds ``torch.profiler`` self CPU per op and step on rank 0, per
variant (interleaved, each step tagged), as one JSON object on stdout. A diagnostic, not a speed claim
(``bench_vs_torchrec.py`` makes those); on a loaded machine read the CPU figures, not the wall times.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/profile_dense_step.py [--steps 40] [--variants ...]
        [--profile]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_torchrec import rank_batches  # noqa: E402  (the same batches as the whole-step benchmark)

VARIANTS = ["torchrec", "ours", "ours_serial", "dense_ours", "dense_ours_1mb", "dense_torchrec", "emb_ours",
            "emb_torchrec"]
B, DIM, MAX_ROWS = 4096, 16, 100_000
BOTTOM, TOP = [512, 256, 64], [512, 256]


class _FixedPooled(torch.nn.Module):
    """The same pooled embeddings every step (a parameter: its gradient is computed, as an embedding's is)."""

    def __init__(self, pooled, names=None, shape=None):
        super().__init__()
        self.feature_names = names
        self.shape = shape
        self.pooled = torch.nn.Parameter(pooled.clone())

    def forward(self, _features):
        out = self.pooled * 1.0
        return out if self.shape is None else out.view(self.shape)


def _step(model, opt, features_key, mean, extra_opt=None):
    import torch.nn.functional as F

    def run(b):
        logits = model(b["dense"], b[features_key]).squeeze(-1)
        loss = (F.binary_cross_entropy_with_logits(logits, b["labels"]) if mean else
                F.binary_cross_entropy_with_logits(logits, b["labels"], reduction="sum") / B)
        for o in (opt, extra_opt):
            if o is not None:
                o.zero_grad(set_to_none=True)
        loss.backward()
        for o in (opt, extra_opt):
            if o is not None:
                o.step()
    return run


def _variants(rank, world, tables, profile):
    """Every variant's step function, built as ``bench_vs_torchrec`` builds its two sides."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import _torchrec_dlrm as trh
    from embedscale.comm.collective import CollectiveTransport
    from embedscale.embedding.address_map import address_map_from_plan
    from embedscale.embedding.sharded import ShardedEmbedding
    from embedscale.models import build_model
    from embedscale.plan.api import make_plan
    from embedscale.specs import ModelConfig, Topology
    from embedscale.train.distributed import dense_ddp

    Bl = B // world
    keys = [t.name for t in tables]
    mcfg = ModelConfig(arch="dlrm", embedding_dim=DIM, bottom_mlp=BOTTOM, top_mlp=TOP, first_order=False)
    group = dist.new_group(backend="gloo")
    plan = make_plan("oper", tables, profile, Topology(ranks_per_host=world), mode="training", extra_memory=0.05,
                     batch_size=Bl)
    emb = ShardedEmbedding(tables, address_map_from_plan(plan, tables), CollectiveTransport(rank, world, group=group),
                           rank, design="retrieve", optimizer="rowwise_adagrad", lr=0.05, eps=1e-8,
                           grad_sync="alltoall", sync_group=group, seed=0)
    emb.overlap_backward = True
    torch.manual_seed(0)
    ours = build_model(mcfg, tables, 13, embedding=emb)
    ddp = dense_ddp(ours, emb, trh.counting_allreduce_hook, trh.HookCounter(mean=False))
    ours_step = _step(ddp, torch.optim.SGD(ours.dense_parameters(), lr=0.05), "jf", mean=False)

    def ours_serial(b):
        ours.overlap, emb.overlap_backward = False, False
        try:
            ours_step(b)
        finally:
            ours.overlap, emb.overlap_backward = True, True

    trec, trec_plan = trh.build_torchrec_dlrm(tables, BOTTOM, TOP, world=world, batch_per_rank=Bl,
                                              optimizer="rowwise_adagrad", lr=0.05, eps=1e-8)
    trh.copy_dense(ours, trec)
    dmp, _, _ = trh.wrap_dmp(trec, trec_plan)
    trh.copy_embeddings(dmp, tables, seed=0)
    trec_opt, trec_dp_opt = trh.split_dense_optimizers(dmp, "rowwise_adagrad", 0.05, 1e-8, 0.05)
    inner = trh.inner_dlrm(dmp)

    pooled = torch.randn(Bl, len(tables) * DIM, generator=torch.Generator().manual_seed(rank)) * 0.1
    fixed = _FixedPooled(pooled, names=keys)
    torch.manual_seed(0)
    d_ours = build_model(mcfg, tables, 13, embedding=fixed)
    d_ddp = dense_ddp(d_ours, fixed, trh.counting_allreduce_hook, trh.HookCounter(mean=False))
    fixed1 = _FixedPooled(pooled, names=keys)  # DDP's default buckets (a first one of 1 MB)
    torch.manual_seed(0)
    d_ours1 = build_model(mcfg, tables, 13, embedding=fixed1)
    DDP._set_params_and_buffers_to_ignore_for_model(d_ours1, ["sparse_arch.embedding.pooled"])
    d_ddp1 = DDP(d_ours1, broadcast_buffers=False, gradient_as_bucket_view=True)
    d_ddp1.register_comm_hook(trh.HookCounter(mean=False), trh.counting_allreduce_hook)
    d_trec = copy.copy(inner)  # TorchRec's DLRM class, its own arches, a fixed sparse arch
    torch.nn.Module.__init__(d_trec)
    for name in ("dense_arch", "inter_arch", "over_arch"):
        setattr(d_trec, name, copy.deepcopy(getattr(inner, name)))
    d_trec.sparse_arch = _FixedPooled(pooled, shape=(Bl, len(tables), DIM))
    DDP._set_params_and_buffers_to_ignore_for_model(d_trec, ["sparse_arch.pooled"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_ddp = DDP(d_trec, broadcast_buffers=False, gradient_as_bucket_view=True, static_graph=True)
    t_ddp.register_comm_hook(trh.HookCounter(mean=True), trh.counting_allreduce_hook)
    t_dense = [p for n, p in d_trec.named_parameters() if not n.startswith("sparse_arch")]

    g = torch.randn(Bl, len(tables) * DIM, generator=torch.Generator().manual_seed(rank)) * 1e-3
    return {
        "torchrec": _step(dmp, trec_opt, "kjt", mean=True, extra_opt=trec_dp_opt),
        "ours": ours_step, "ours_serial": ours_serial,
        "dense_ours": _step(d_ddp, torch.optim.SGD(d_ours.dense_parameters(), lr=0.05), "jf", mean=False),
        "dense_ours_1mb": _step(d_ddp1, torch.optim.SGD(d_ours1.dense_parameters(), lr=0.05), "jf", mean=False),
        "dense_torchrec": _step(t_ddp, torch.optim.SGD(t_dense, lr=0.05), "kjt", mean=True),
        "emb_ours": lambda b: emb(b["jf"]).backward(g),
        "emb_torchrec": lambda b: inner.sparse_arch(b["kjt"]).backward(g.view(Bl, len(tables), DIM)),
    }


def _time(fns, batches, steps, warmup):
    import torch.distributed as dist

    names = list(fns)
    rec = {k: ([], [], []) for k in names}
    for s in range(warmup + steps):
        b = batches[s % len(batches)]
        for name in (names if s % 2 == 0 else names[::-1]):
            dist.barrier()
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            fns[name](b)
            if s >= warmup:
                for lst, v in zip(rec[name], (time.perf_counter() - t0, time.process_time() - c0,
                                              time.thread_time() - m0)):
                    lst.append(v)
    out = {}
    maxed = {}
    for name in names:
        maxed[name] = [torch.tensor(x, dtype=torch.float64) for x in rec[name]]
        for t in maxed[name]:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest / busier rank's
    ref = maxed.get("torchrec")
    for name, (wall, cpu, main) in maxed.items():
        out[name] = {"wall_ms": 1e3 * float(wall.median()), "cpu_ms": 1e3 * float(cpu.median()),
                     "main_thread_cpu_ms": 1e3 * float(main.median())}
        if ref is not None:
            out[name]["cpu_minus_torchrec_ms"] = 1e3 * float((cpu - ref[1]).median())
            out[name]["paired_wall_ratio"] = float((ref[0] / wall).median())  # TorchRec's step / this one
    return out


def _profile(fns, batches, steps=16):
    """Self CPU per op and step, per variant (rank 0): every step tagged ``V::name``, its ops attributed to it."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    names = list(fns)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for s in range(steps):
            for name in (names if s % 2 == 0 else names[::-1]):
                dist.barrier()
                with record_function("V::" + name):
                    fns[name](batches[s % len(batches)])
    agg: dict = {}
    for e in p.events():
        top = e
        while top.cpu_parent is not None:
            top = top.cpu_parent
        if not top.name.startswith("V::"):
            continue
        key = "<untraced: python, waits>" if top is e else e.name
        agg.setdefault(top.name[3:], {}).setdefault(key, 0.0)
        agg[top.name[3:]][key] += e.self_cpu_time_total / steps / 1e3
    return {v: dict(sorted(ops.items(), key=lambda kv: -kv[1])[:40]) for v, ops in agg.items()}


def worker(rank, world, cfg):
    import _torchrec_dlrm as trh
    from embedscale.data.profile import AccessProfile
    from embedscale.data.synthetic import SyntheticGenerator
    from embedscale.specs import SyntheticConfig

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    trh.patch_collectives()
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=MAX_ROWS, alpha=1.1), seed=0,
                             embedding_dim=DIM)
    tables = gen.tables
    cols = gen.sample(0, 200_000)
    profile = AccessProfile({t.name: np.bincount(cols.sparse[t.name][0], minlength=t.num_rows) for t in tables},
                            200_000)
    batches = rank_batches(gen, [t.name for t in tables], rank, world, B, 8, 200_000)
    fns = _variants(rank, world, tables, profile)
    fns = {k: fns[k] for k in cfg["variants"]}
    out = {"timing": _time(fns, batches, cfg["steps"], cfg["warmup"])}
    if cfg["profile"]:
        prof = _profile(fns, batches)
        if rank == 0:
            out["profile_self_cpu_ms_per_step"] = prof
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--profile", action="store_true", help="torch.profiler self CPU per op and step, per variant")
    args = ap.parse_args()
    from embedscale.train.launch import spawn_local

    load = os.getloadavg()
    cfg = {"steps": args.steps, "warmup": args.warmup, "variants": args.variants, "profile": args.profile}
    res = spawn_local(worker, 2, cfg, timeout_s=3600)
    for name, x in res[0]["timing"].items():
        print(f"{name:16s} " + "  ".join(f"{k} {v:.2f}" for k, v in x.items()), file=sys.stderr)
    print(json.dumps({"benchmark": "dense_step_profile", "timing": res[0]["timing"],
                      "profile_self_cpu_ms_per_step": res[0].get("profile_self_cpu_ms_per_step"),
                      "config": {**cfg, "batch": B, "dim": DIM, "max_rows": MAX_ROWS, "bottom_mlp": BOTTOM,
                                 "top_mlp": TOP, "world": 2, "loadavg_before": load,
                                 "loadavg_after": os.getloadavg(), "torch": torch.__version__}}))


if __name__ == "__main__":
    main()
