"""End-to-end throughput on 2 ranks (gloo, local CPU processes): embedscale against TorchRec's
DistributedModelParallel, same run, same DLRM, same tables, same data, same initial weights. The
throughput bars: training at least 1.5x TorchRec (OPER on GPUs: 1.9-3.5x), inference at least 2x
(OPER: 2.4-6.4x).

Ours: ``ShardedEmbedding`` under the ``oper`` plan (5% extra memory; a training plan for training, an
inference plan, hot rows replicated by OPER Algorithm 1, for inference), retrieve design, collective
transport, fused row-wise Adagrad (or SGD), replica gradients in the backward all-to-all (``--grad-sync``,
default ``alltoall``); inference over the PGAS transport (``--inference-transport``, default ``pgas``:
``PgasShardedEmbedding``, one-sided gets from the peer's shared memory); dense arches (``build_model``,
without the first-order term: TorchRec's DLRM has none) in DDP with a sum hook and a loss of sum / global
batch, wrapped as ``train.distributed`` wraps them (``dense_ddp``: gradients as bucket views, as TorchRec's
DMP does); the model's forward starts the embedding's row exchange before the bottom MLP and waits for it
after, and its backward the gradient exchange before the bottom MLP's backward, waited for at the backward's
end (OPER 5.2; ``overlap_backward``, opt-in, on here); ``--prefetch 1``: the next batch's input_dist ahead of
its step, as ``embedscale run`` trains, and TorchRec's step then runs in its ``TrainPipelineSparseDist`` (the
next batch's input distribution during the step, as TorchRec trains; on CPU without streams). Both sides run
in the same rank processes, so with the same thread and allocator settings: one intra-op thread per rank (2
ranks on 2 cores), freed memory kept for the next step (``threads.keep_freed_memory``, as every embedscale
rank keeps it). The report's *ceiling* is TorchRec's step over its dense time: what
ours would reach with an embedding that cost nothing.

TorchRec: ``torchrec.models.dlrm.DLRM`` over an ``EmbeddingBagCollection`` of the same tables, sharded by
TorchRec's own ``EmbeddingShardingPlanner`` (default settings, compute device cpu, the same 2-rank
topology, the same per-rank batch) and wrapped in ``DistributedModelParallel`` (gloo; FBGEMM's CPU TBE
kernels), fused in-backward optimizer of the same kind (``apply_optimizer_in_backward``: EXACT_ROWWISE_ADAGRAD
or EXACT_SGD, same lr and eps); TorchRec's loss convention (mean over the local batch, DDP averaging,
pooled-embedding gradients divided by the world size), which gives the same gradients.

Both models get the same initial weights (our dense weights and our placement-independent embedding rows
copied into TorchRec's shards), and the benchmark checks they compute the same logits at init and after one
training step before it times anything. Steps of the two alternate (the order flips every step) so that the
noise of a shared machine hits both alike; a step's time is the slowest rank's; figures are medians after
warm-up. Breakdown: an embedding-only step (lookup + communication + fused update, with a fixed output
gradient) timed the same way; dense = full step - embedding step; each step's process CPU time too (the busier
rank's, medians: ``cpu_dense_ms``, the dense parts' work, which a loaded machine inflates far less than their
wall time; the JSON line's ``dense``), and the calling thread's alone (``main_thread_cpu_*``: the rest is the
communication backend's threads). Our step is timed a second way in the same run (``ours_serial``: the model's
start-ahead and the backward overlap off, the exchanges and the bottom MLP one after the other), interleaved with
the other two: what the overlap costs or hides on this machine. Bytes on wire: every ``all_to_all_single``
of either side is counted by one wrapper (bytes sent to other ranks), DDP's AllReduces by counting comm
hooks (ring model, 2 (W-1)/W of the bucket), our replica-gradient sync by its own counter.

Setup: 26 criteo-kaggle tables capped at ``--max-rows`` rows (default 100k, 840,543 rows in all; scaled to
fit), dim 16, synthetic power-law data (exponent 1.1, one-hot), global batch 4096 (2048 per rank). Two
configs: ``table1`` (OPER Table 1 MLPs: bottom 512-256-64-16, top 512-256-1) and ``small`` (bottom
64-32-16, top 128-64-1), where the dense part weighs less.

Prints one JSON line on stdout (figure = our training samples/s, baseline = TorchRec's, for the first
config; inference and every config inside); progress on stderr; ``--out PATH`` writes a report, ``--record``
it as ``benchmarks/results/vs_torchrec.md`` (``--from-json`` re-renders it from saved JSON lines).

    .venv/bin/python benchmarks/bench_vs_torchrec.py [--quick] [--max-rows N] [--optimizer sgd]
        [--grad-sync alltoall|local_aggregated|dense|allgather] [--inference-transport pgas|collective]

``--embedding-only`` times only the embedding steps (the bar: training at least 1.5x TorchRec's, inference
at least 3x): ours (``ShardedEmbedding`` under the oper training plan; inference as above) against TorchRec's
sharded ``EmbeddingBagCollection`` under DMP (its KJT input distribution, lookup, pooled-embedding all-to-all,
backward with the same fixed output gradient, fused update), small MLPs built only for the equality check,
interleaved step by step; one JSON line with medians, p90s and the load average. ``--prefetch DEPTH`` adds
``ShardedEmbedding.prefetch`` (the next DEPTH batches converted ahead on a worker thread, their counts and ids
riding in the current step's row and gradient all-to-alls) and times our synchronous step beside it (a second
module, same rows) in the same run. Our side runs the C++ CPU kernel (``embedding/kernels.cpp``: pooling,
per-row gradient sums, fused update, id decode) when built (the JSON line's ``cpu_kernel``);
``--no-cpu-kernel`` times its PyTorch ops instead:

    .venv/bin/python benchmarks/bench_vs_torchrec.py --embedding-only --max-rows 1000000 [--prefetch 1] [--world 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RESULTS_MD = Path(__file__).resolve().parent / "results" / "vs_torchrec.md"

CONFIGS = {
    "table1": {"bottom_mlp": [512, 256, 64], "top_mlp": [512, 256]},
    "small": {"bottom_mlp": [64, 32], "top_mlp": [128, 64]},
}


def _log(rank, msg):
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def rank_batches(gen, keys, rank, world, batch, nb, start):
    """``nb`` one-hot batches of ``batch`` samples from ``gen`` (from sample ``start`` on), each cut to this rank's
    share, as both sides take them: our ``JaggedFeatures`` and TorchRec's ``KeyedJaggedTensor`` of the same ids,
    the dense features and the labels."""
    from embedscale.data.batch import JaggedFeatures
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    bl = batch // world
    data = gen.sample(start, batch * nb)
    out = []
    for s in range(nb):
        lo, hi = s * batch + bl * rank, s * batch + bl * (rank + 1)
        values = torch.from_numpy(np.concatenate([data.sparse[k][0][lo:hi] for k in keys])).to(torch.int64)
        lengths = torch.ones(values.numel(), dtype=torch.int64)
        out.append({"i": s, "jf": JaggedFeatures(keys, values, lengths),
                    "kjt": KeyedJaggedTensor(keys=keys, values=values, lengths=lengths),
                    "dense": torch.from_numpy(np.ascontiguousarray(data.dense[lo:hi])),
                    "labels": torch.from_numpy(data.labels[lo:hi].astype(np.float32))})
    return out


def worker(rank, world, cfg):
    import torch.distributed as dist
    import torch.nn.functional as F

    import _torchrec_dlrm as trh
    from embedscale.comm.collective import CollectiveTransport
    from embedscale.data.profile import AccessProfile
    from embedscale.data.synthetic import SyntheticGenerator
    from embedscale.embedding.address_map import address_map_from_plan
    from embedscale.embedding.sharded import ShardedEmbedding
    from embedscale.models import build_model
    from embedscale.plan.api import make_plan
    from embedscale.specs import ModelConfig, SyntheticConfig, Topology
    from embedscale.train.distributed import dense_ddp

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    trh.patch_collectives()
    t_setup = time.perf_counter()
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=cfg["max_rows"], alpha=cfg["alpha"]),
                             seed=0, embedding_dim=cfg["dim"])
    tables = gen.tables
    keys = [t.name for t in tables]
    B, Bl = cfg["batch"], cfg["batch"] // world
    P = cfg["profile_samples"]
    cols = gen.sample(0, P)
    profile = AccessProfile({t.name: np.bincount(cols.sparse[t.name][0], minlength=t.num_rows) for t in tables}, P)
    nb = cfg["distinct_batches"]
    batches = rank_batches(gen, keys, rank, world, B, nb, P)
    # TorchRec's DLRM has no first-order term: ours without it, the same model (checked below)
    mcfg = ModelConfig(arch="dlrm", embedding_dim=cfg["dim"], bottom_mlp=cfg["bottom_mlp"], top_mlp=cfg["top_mlp"],
                       first_order=False)
    opt_name, lr, eps = cfg["optimizer"], cfg["lr"], cfg["eps"]
    topo = Topology(ranks_per_host=world)

    # -- ours: oper plans, ShardedEmbedding, dense DDP with a sum hook ---------------------------------
    emb_group = dist.new_group(backend="gloo")
    tr = CollectiveTransport(rank, world, group=emb_group)
    plan_tr = make_plan("oper", tables, profile, topo, mode="training", extra_memory=cfg["extra_memory"],
                        batch_size=Bl)
    plan_inf = make_plan("oper", tables, profile, topo, mode="inference", extra_memory=cfg["extra_memory"],
                         batch_size=Bl)
    amap_tr, amap_inf = address_map_from_plan(plan_tr, tables), address_map_from_plan(plan_inf, tables)
    emb = ShardedEmbedding(tables, amap_tr, tr, rank, design="retrieve", optimizer=opt_name, lr=lr, eps=eps,
                           grad_sync=cfg["grad_sync"], sync_group=emb_group, seed=0)
    emb.overlap_backward = True  # the gradient exchange beside the bottom MLP's backward (opt-in; same bits)
    torch.manual_seed(0)
    ours = build_model(mcfg, tables, 13, embedding=emb)
    ours_dense_hook = trh.HookCounter(mean=False)  # sum: the loss already divides by the global batch
    ddp = dense_ddp(ours, emb, trh.counting_allreduce_hook, ours_dense_hook)  # as train.distributed wraps it
    ours_opt = torch.optim.SGD(ours.dense_parameters(), lr=cfg["dense_lr"])
    pgas_tr = None
    if cfg["inference_transport"] == "pgas":  # one host: one-sided gets from the peers' shared segments
        from embedscale.comm.pgas import PgasTransport
        from embedscale.embedding.pgas_lookup import PgasShardedEmbedding
        pgas_tr = PgasTransport(ranks_per_host=world)
        emb_inf = PgasShardedEmbedding(tables, amap_inf, pgas_tr, rank, design="retrieve", optimizer=None, seed=0,
                                       max_batch_size=Bl)
    else:
        emb_inf = ShardedEmbedding(tables, amap_inf, tr, rank, design="retrieve", optimizer=None, seed=0)
    ours_inf = build_model(mcfg, tables, 13, embedding=emb_inf)
    ours_inf.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("sparse_arch.")},
                             strict=False)
    ours_inf.eval()

    # -- TorchRec: its planner, DMP, fused in-backward optimizer ---------------------------------------
    trec_model, trec_plan = trh.build_torchrec_dlrm(tables, cfg["bottom_mlp"], cfg["top_mlp"], world=world,
                                                    batch_per_rank=Bl, optimizer=opt_name, lr=lr, eps=eps)
    trh.copy_dense(ours, trec_model)
    dmp, trec_dense_hook, trec_dp_hook = trh.wrap_dmp(trec_model, trec_plan)
    trh.copy_embeddings(dmp, tables, seed=0)
    trec_opt, trec_dp_opt = trh.split_dense_optimizers(dmp, opt_name, lr, eps, cfg["dense_lr"])
    trec_inner = trh.inner_dlrm(dmp)
    _log(rank, f"  setup {time.perf_counter() - t_setup:.1f} s; torchrec plan: "
               f"{sorted(set(trh.sharding_types(trec_plan).values()))}")

    # --prefetch 1: ours trains as its runs do (``embedscale run``'s input pipeline): the next batch's input_dist
    # ahead of its step; the last step of a timed phase prefetches none, so the queue ends empty
    ahead = {"left": 0}

    def ours_train(b):
        if ahead["left"]:
            ahead["left"] -= 1
            emb.prefetch(batches[(b["i"] + 1) % nb]["jf"])
        logits = ddp(b["dense"], b["jf"])
        loss = F.binary_cross_entropy_with_logits(logits, b["labels"], reduction="sum") / B
        ours_opt.zero_grad(set_to_none=True)
        loss.backward()
        ours_opt.step()

    def ours_serial_train(b):  # the same step with the bottom MLP and the embedding's exchanges one after the other
        ours.overlap, emb.overlap_backward = False, False
        try:
            ours_train(b)
        finally:
            ours.overlap, emb.overlap_backward = True, True

    def trec_train(b):
        logits = dmp(b["dense"], b["kjt"]).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, b["labels"])  # TorchRec's convention: local mean
        trec_opt.zero_grad(set_to_none=True)
        if trec_dp_opt is not None:
            trec_dp_opt.zero_grad(set_to_none=True)
        loss.backward()
        trec_opt.step()
        if trec_dp_opt is not None:
            trec_dp_opt.step()

    # -- do both compute the same thing? (same weights at init; then after one step each) -----------------
    check = {}
    with torch.no_grad():
        b0 = batches[0]
        z_ours = ours(b0["dense"], b0["jf"])
        z_inf = ours_inf(b0["dense"], b0["jf"])
        z_trec = dmp(b0["dense"], b0["kjt"]).squeeze(-1)
    check["init_max_abs_diff"] = float((z_ours - z_trec).abs().max())
    check["init_inference_plan_max_abs_diff"] = float((z_inf - z_trec).abs().max())
    b1 = batches[1 % nb]
    with torch.no_grad():
        z_before = ours(b1["dense"], b1["jf"])
    ours_train(batches[0])
    trec_train(batches[0])
    with torch.no_grad():
        z_after = ours(b1["dense"], b1["jf"])
        d = (z_after - dmp(b1["dense"], b1["kjt"]).squeeze(-1)).abs().max()
    check["after_one_step_max_abs_diff"] = float(d)
    check["one_step_logit_change"] = float((z_after - z_before).abs().max())  # the step did move the model
    check["logit_scale"] = float(z_trec.abs().mean())

    # -- timing: the two alternate, order flipped every step --------------------------------------------
    def timed(fns, n_steps, warmup):
        times = {k: [] for k in fns}
        cpu = {k: [] for k in fns}  # the process's CPU time: a figure the machine's load inflates far less
        main_cpu = {k: [] for k in fns}  # the calling thread's alone (the rest: the backend's and workers' threads)
        bytes_ = {k: [] for k in fns}
        names = list(fns)
        for s in range(warmup + n_steps):
            b = batches[s % nb]
            for name in (names if s % 2 == 0 else names[::-1]):
                fn, counters = fns[name]
                before = [c() for c in counters]
                dist.barrier()
                t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
                fn(b)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                dm = time.thread_time() - m0
                if s >= warmup:
                    times[name].append(dt)
                    cpu[name].append(dc)
                    main_cpu[name].append(dm)
                    bytes_[name].append([c() - x for c, x in zip(counters, before)])
        out = {}
        for name in names:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            c = torch.tensor(cpu[name], dtype=torch.float64)
            dist.all_reduce(c, op=dist.ReduceOp.MAX)  # the busier rank's
            m = torch.tensor(main_cpu[name], dtype=torch.float64)
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
            by = torch.tensor(bytes_[name], dtype=torch.float64).mean(0) if bytes_[name] else torch.zeros(0)
            dist.all_reduce(by)  # summed over ranks
            out[name] = {"median_s": float(t.median()), "p90_s": float(torch.quantile(t, 0.9)) if t.numel() else 0.0,
                         "cpu_median_s": float(c.median()) if c.numel() else 0.0,
                         "main_thread_cpu_median_s": float(m.median()) if m.numel() else 0.0,
                         "times_s": [round(x, 5) for x in t.tolist()], "bytes": by.tolist()}
        return out

    a2a = lambda: trh.BYTES["a2a"]  # noqa: E731
    calls = lambda: trh.BYTES["a2a_calls"]  # noqa: E731
    ours_sync = lambda: emb.stats.get("grad_sync_bytes", 0)  # noqa: E731
    res = {"check": check}
    W, S = cfg["warmup"], cfg["steps"]
    emb_only = cfg.get("embedding_only", False)
    if not emb_only:
        _log(rank, "  training ...")
        ahead["left"] = W + S - 1 if cfg.get("prefetch", 0) else 0
        trec_step, detach = trec_train, None
        if cfg.get("prefetch", 0):  # TorchRec pipelined too: its TrainPipelineSparseDist, the same batch order
            step, detach = trh.train_pipeline(dmp, [(b["dense"], b["kjt"], b["labels"]) for b in batches],
                                              trec_opt, trec_dp_opt)
            trec_step = lambda b: step()  # noqa: E731
        res["train"] = timed({
            "ours": (ours_train, [a2a, ours_sync, lambda: ours_dense_hook.bytes, calls]),
            "torchrec": (trec_step, [a2a, lambda: trec_dp_hook.bytes, lambda: trec_dense_hook.bytes, calls]),
            **({"ours_serial": (ours_serial_train, [a2a, ours_sync, lambda: ours_dense_hook.bytes, calls])}
               if not cfg.get("prefetch", 0) else {}),
        }, S, W)
        if detach is not None:
            detach()

    dmp.eval()

    def ours_infer(b):
        with torch.no_grad():
            ours_inf(b["dense"], b["jf"])

    def trec_infer(b):
        with torch.no_grad():
            dmp(b["dense"], b["kjt"])

    # bytes ours moves: all-to-alls, plus the rows PGAS gets read from peers (counted once, by the reader)
    moved = (lambda: a2a() + int(pgas_tr.counter.recv.sum())) if pgas_tr is not None else a2a  # noqa: E731
    if not emb_only:
        _log(rank, "  inference ...")
        res["inference"] = timed({"ours": (ours_infer, [moved, calls]), "torchrec": (trec_infer, [a2a, calls])},
                                 S, W)

    # -- breakdown: the embedding part alone (lookup + comm [+ backward + fused update]) ----------------
    g = torch.randn(Bl, len(tables) * cfg["dim"], generator=torch.Generator().manual_seed(rank)) * 1e-3
    dmp.train()

    depth, calls_so_far = cfg.get("prefetch", 0), [0]  # the embedding step in the form the full step took

    def ours_emb_train(b):
        if depth:  # the batches of the next `depth` steps (converted on the prefetch thread; the next one's
            # counts and ids ride in this step's exchanges)
            for a in (range(1, depth + 1) if calls_so_far[0] == 0 else (depth,)):
                emb.prefetch(batches[(b["i"] + a) % nb]["jf"])
        calls_so_far[0] += 1
        emb(b["jf"]).backward(g)

    def trec_emb_train(b):
        trec_inner.sparse_arch(b["kjt"]).backward(g.view(Bl, len(tables), cfg["dim"]))

    sides = {"ours": (ours_emb_train, [a2a, ours_sync, calls]),
             "torchrec": (trec_emb_train, [a2a, lambda: trec_dp_hook.bytes, calls])}
    if depth:
        # both of ours in the same run: a second module (same plan, rows and updates) steps synchronously
        emb_sync = ShardedEmbedding(tables, amap_tr, tr, rank, design="retrieve", optimizer=opt_name, lr=lr, eps=eps,
                                    grad_sync=cfg["grad_sync"], sync_group=emb_group, seed=0)
        emb_sync.load_state_dict(emb.state_dict())
        if opt_name == "rowwise_adagrad":
            emb_sync.momentum.copy_(emb.momentum)

        def ours_sync_emb_train(b):
            emb_sync(b["jf"]).backward(g)

        sides["ours_sync"] = (ours_sync_emb_train, [a2a, lambda: emb_sync.stats.get("grad_sync_bytes", 0), calls])

    def ours_emb_infer(b):
        with torch.no_grad():
            emb_inf(b["jf"])

    def trec_emb_infer(b):
        with torch.no_grad():
            trec_inner.sparse_arch(b["kjt"])

    _log(rank, "  embedding-only breakdown ...")
    res["emb_train"] = timed(sides, S, W)
    dmp.eval()
    res["emb_infer"] = timed({"ours": (ours_emb_infer, [moved, calls]), "torchrec": (trec_emb_infer, [a2a, calls])},
                             S, W)

    res["plans"] = {
        "ours_training": {"replicated_rows": int(amap_tr.num_slots), "rows_per_rank": amap_tr.num_owned().tolist()},
        "ours_inference": {"replicated_rows": int(amap_inf.num_slots),
                           "rows_per_rank": amap_inf.num_owned().tolist()},
        "torchrec": _count_types(trh.sharding_types(trec_plan)),
    }
    res["cpu_kernel"] = {"training": emb.kernel_ops() is not None, "inference": emb_inf.kernel_ops() is not None}
    res["storage_rows"] = {"ours_training": int(emb.weight.shape[0]), "ours_inference": int(emb_inf.weight.shape[0]),
                           "torchrec": _torchrec_local_rows(dmp)}
    if pgas_tr is not None:
        dist.barrier()
        emb_inf.close()
    return res


def _count_types(types: dict) -> dict:
    out: dict[str, int] = {}
    for v in types.values():
        out[v] = out.get(v, 0) + 1
    return out


def _torchrec_local_rows(dmp) -> int:
    n = 0
    for k, w in dmp.state_dict().items():
        if "embedding_bags" not in k or not k.endswith(".weight"):
            continue
        if hasattr(w, "local_shards"):
            n += sum(s.tensor.shape[0] for s in w.local_shards())
        else:
            n += w.shape[0]
    return n


def summarise(res: list, cfg: dict) -> dict:
    B = cfg["batch"]
    r0 = res[0]
    out = {}
    for phase, emb_phase in (("train", "emb_train"), ("inference", "emb_infer")):
        ph = {}
        for side in ("ours", "torchrec"):
            full = r0[phase][side]["median_s"]
            e = r0[emb_phase][side]["median_s"]
            by = r0[phase][side]["bytes"]
            cf, ce = r0[phase][side]["cpu_median_s"], r0[emb_phase][side]["cpu_median_s"]
            d = {"samples_per_s": B / full, "step_ms": 1e3 * full, "embedding_ms": 1e3 * e,
                 "dense_ms": 1e3 * max(full - e, 0.0),
                 # CPU time of the busier rank's process (medians): what the load inflates far less than wall time
                 "cpu_step_ms": 1e3 * cf, "cpu_embedding_ms": 1e3 * ce, "cpu_dense_ms": 1e3 * max(cf - ce, 0.0),
                 # the calling thread's alone (process - this: the backend's and worker threads')
                 "main_thread_cpu_step_ms": 1e3 * r0[phase][side].get("main_thread_cpu_median_s", 0.0),
                 "main_thread_cpu_embedding_ms": 1e3 * r0[emb_phase][side].get("main_thread_cpu_median_s", 0.0)}
            if phase == "train":
                d["bytes_per_step"] = {"embedding_a2a": by[0], "embedding_sync": by[1],
                                       "embedding_total": by[0] + by[1], "dense_allreduce": by[2]}
            else:
                d["bytes_per_step"] = {"embedding_a2a": by[0], "embedding_total": by[0]}
            d["all_to_alls_per_step_per_rank"] = by[-1] / len(res)
            ph[side] = d
        ph["ratio"] = ph["ours"]["samples_per_s"] / ph["torchrec"]["samples_per_s"]
        ph["dense_ratio"] = ph["ours"]["dense_ms"] / max(ph["torchrec"]["dense_ms"], 1e-9)  # ours / TorchRec's
        ph["cpu_dense_ratio"] = ph["ours"]["cpu_dense_ms"] / max(ph["torchrec"]["cpu_dense_ms"], 1e-9)
        # step by step (same batch, adjacent in time): less exposed to the machine's load drifting
        ph["paired_ratio"] = float(np.median(np.array(r0[phase]["torchrec"]["times_s"]) /
                                             np.array(r0[phase]["ours"]["times_s"])))
        ph["bytes_ratio"] = (ph["ours"]["bytes_per_step"]["embedding_total"] /
                             max(ph["torchrec"]["bytes_per_step"]["embedding_total"], 1.0))
        ph["embedding_speedup"] = ph["torchrec"]["embedding_ms"] / max(ph["ours"]["embedding_ms"], 1e-9)
        serial = r0[phase].get("ours_serial")
        if serial is not None:  # our step without start-ahead and backward overlap, same run
            ph["ours_serial"] = {"step_ms": 1e3 * serial["median_s"], "cpu_step_ms": 1e3 * serial["cpu_median_s"],
                                 "main_thread_cpu_step_ms": 1e3 * serial["main_thread_cpu_median_s"],
                                 "ratio": r0[phase]["torchrec"]["median_s"] / serial["median_s"],
                                 "paired_ratio": float(np.median(np.array(r0[phase]["torchrec"]["times_s"]) /
                                                                 np.array(serial["times_s"])))}
        out[phase] = ph
    out["check"] = r0["check"]
    out["plans"] = r0["plans"]
    out["storage_rows_per_rank"] = [r["storage_rows"] for r in res]
    out["raw_step_times_s"] = {p: {s: r0[p][s]["times_s"] for s in ("ours", "torchrec")}
                               for p in ("train", "inference", "emb_train", "emb_infer")}
    return out


def summarise_embedding(res: list, cfg: dict) -> dict:
    """The embedding-only phases (``--embedding-only``): per phase and side, samples/s at the median, median and
    p90 step (ms; a step is the slowest rank's), bytes sent and all-to-alls per step; the ratios ours / TorchRec
    at the median and step by step (paired)."""
    B = cfg["batch"]
    r0 = res[0]
    out = {}
    for phase in ("emb_train", "emb_infer"):
        ph = {}
        for side in ("ours", "torchrec"):
            x = r0[phase][side]
            by = x["bytes"]
            ph[side] = {"samples_per_s": B / x["median_s"], "median_ms": 1e3 * x["median_s"],
                        "p90_ms": 1e3 * x["p90_s"], "p90_over_median": x["p90_s"] / max(x["median_s"], 1e-12),
                        "bytes_per_step": float(sum(by[:-1])), "all_to_alls_per_step_per_rank": by[-1] / len(res)}
        ph["ratio"] = ph["ours"]["samples_per_s"] / ph["torchrec"]["samples_per_s"]
        ph["paired_ratio"] = float(np.median(np.array(r0[phase]["torchrec"]["times_s"]) /
                                             np.array(r0[phase]["ours"]["times_s"])))
        if "ours_sync" in r0[phase]:  # --prefetch: our synchronous step, same run
            x = r0[phase]["ours_sync"]
            ph["ours_sync"] = {"samples_per_s": B / x["median_s"], "median_ms": 1e3 * x["median_s"],
                               "p90_ms": 1e3 * x["p90_s"], "all_to_alls_per_step_per_rank": x["bytes"][-1] / len(res),
                               "bytes_per_step": float(sum(x["bytes"][:-1]))}
            ph["ratio_sync"] = ph["ours_sync"]["samples_per_s"] / ph["torchrec"]["samples_per_s"]
            ph["paired_ratio_sync"] = float(np.median(np.array(r0[phase]["torchrec"]["times_s"]) /
                                                      np.array(x["times_s"])))
        out[phase] = ph
    out["check"] = r0["check"]
    out["cpu_kernel"] = r0.get("cpu_kernel")
    out["raw_step_times_s"] = {p: {s: v["times_s"] for s, v in r0[p].items()} for p in ("emb_train", "emb_infer")}
    return out


def main_embedding_only(args, base: dict) -> None:
    """``--embedding-only``: our ``ShardedEmbedding`` step (training: lookup, all-to-alls, backward with a fixed
    output gradient, fused update; inference: the lookup) against TorchRec's sharded ``EmbeddingBagCollection``
    step under ``DistributedModelParallel`` (its input distribution, lookup, pooled all-to-all [, backward and
    fused update]), same tables, data and initial rows, interleaved step by step. One JSON line."""
    from embedscale.train.launch import spawn_local

    cfg = {**base, **CONFIGS["small"], "embedding_only": True}
    print(f"vs torchrec, embedding only, {args.world} ranks: {cfg}", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    res = spawn_local(worker, args.world, cfg, timeout_s=3600)
    r = summarise_embedding(res, cfg)
    tr, inf = r["emb_train"], r["emb_infer"]
    if "ours_sync" in tr:
        print(f"  train, ours without prefetch: {tr['ours_sync']['median_ms']:.2f} ms (p90 "
              f"{tr['ours_sync']['p90_ms']:.2f}): {tr['ratio_sync']:.2f}x (paired {tr['paired_ratio_sync']:.2f}x)",
              file=sys.stderr, flush=True)
    print(f"  train {tr['ours']['median_ms']:.2f} ms (p90 {tr['ours']['p90_ms']:.2f}) vs "
          f"{tr['torchrec']['median_ms']:.2f} ms (p90 {tr['torchrec']['p90_ms']:.2f}): {tr['ratio']:.2f}x "
          f"(paired {tr['paired_ratio']:.2f}x); inference {inf['ours']['median_ms']:.2f} vs "
          f"{inf['torchrec']['median_ms']:.2f} ms: {inf['ratio']:.2f}x (paired {inf['paired_ratio']:.2f}x); "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    line = {"benchmark": "vs_torchrec_embedding_only", "figure": tr["ours"]["samples_per_s"],
            "baseline": tr["torchrec"]["samples_per_s"], "ratio": tr["ratio"], "unit": "samples/s",
            "median_ms": tr["ours"]["median_ms"], "p90_ms": tr["ours"]["p90_ms"],
            "baseline_median_ms": tr["torchrec"]["median_ms"], "baseline_p90_ms": tr["torchrec"]["p90_ms"],
            "paired_ratio": tr["paired_ratio"], "prefetch": base["prefetch"],
            "synchronous": ({"figure": tr["ours_sync"]["samples_per_s"], "ratio": tr["ratio_sync"],
                             "paired_ratio": tr["paired_ratio_sync"], "median_ms": tr["ours_sync"]["median_ms"],
                             "p90_ms": tr["ours_sync"]["p90_ms"]} if "ours_sync" in tr else None),
            "inference": {"figure": inf["ours"]["samples_per_s"], "baseline": inf["torchrec"]["samples_per_s"],
                          "ratio": inf["ratio"], "paired_ratio": inf["paired_ratio"],
                          "median_ms": inf["ours"]["median_ms"], "p90_ms": inf["ours"]["p90_ms"],
                          "baseline_median_ms": inf["torchrec"]["median_ms"],
                          "baseline_p90_ms": inf["torchrec"]["p90_ms"]},
            "cpu_kernel": r["cpu_kernel"],
            "config": {**base, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                       "torch": torch.__version__, "torchrec": _version("torchrec"),
                       "fbgemm_gpu": _version("fbgemm-gpu-cpu"),
                       "command": " ".join([".venv/bin/python", "benchmarks/bench_vs_torchrec.py", *sys.argv[1:]])},
            "results": r}
    print(json.dumps(line))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps, table1 config only")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096, help="global batch")
    ap.add_argument("--optimizer", choices=["rowwise_adagrad", "sgd"], default="rowwise_adagrad")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--inference-transport", default="pgas", choices=["pgas", "collective"],
                    help="our inference lookups: pgas (one-sided gets from the peers' shared memory, no message; "
                         "one host) or collective (all-to-alls)")
    ap.add_argument("--grad-sync", default="alltoall",
                    choices=["alltoall", "local_aggregated", "dense", "allgather"],
                    help="our replica-gradient sync (alltoall: in the backward all-to-all, no collective of its own; "
                         "two collectives fewer per step than local_aggregated)")
    ap.add_argument("--embedding-only", action="store_true",
                    help="time only the embedding step (ours: ShardedEmbedding; TorchRec: its sharded "
                         "EmbeddingBagCollection under DMP), training and inference, interleaved; one JSON line, "
                         "no markdown")
    ap.add_argument("--prefetch", type=int, default=0, metavar="DEPTH",
                    help="ours converts the batches of the next DEPTH steps ahead (ShardedEmbedding.prefetch, "
                         "OPER 5.1 pipelined), as a pipelined training loop does; our synchronous embedding step is "
                         "timed beside it in the same run; the whole training step takes DEPTH 1 (as embedscale "
                         "run trains), TorchRec's then its TrainPipelineSparseDist")
    ap.add_argument("--no-cpu-kernel", action="store_true",
                    help="our side on its PyTorch ops (EMBEDSCALE_NO_KERNELS=1), not the C++ CPU kernel")
    ap.add_argument("--configs", default=None, help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--out", default="", help="markdown report to write ('' = none)")
    ap.add_argument("--record", action="store_true", help="--out benchmarks/results/vs_torchrec.md")
    ap.add_argument("--from-json", nargs="+", default=None,
                    help="render --out from saved JSON lines of earlier runs instead of running (the first is "
                         "the main run; the others are appended as further runs)")
    args = ap.parse_args()
    args.out = args.out or (str(RESULTS_MD) if args.record else "")
    if args.from_json and not args.out:
        ap.error("--from-json renders a report: give --out PATH or --record")
    if args.no_cpu_kernel:  # the ranks inherit the environment
        os.environ["EMBEDSCALE_NO_KERNELS"] = "1"
    if args.from_json:
        lines = []
        for fn in args.from_json:
            with open(fn) as f:
                lines.append(json.loads(f.read().strip().splitlines()[-1]))
        write_markdown(lines, args.out)
        return
    from embedscale.train.launch import spawn_local

    names = (args.configs.split(",") if args.configs else (["table1"] if args.quick else list(CONFIGS)))
    base = {"max_rows": args.max_rows, "dim": 16, "alpha": 1.1, "batch": args.batch, "world": args.world,
            "optimizer": args.optimizer, "lr": 0.05, "eps": 1e-8, "dense_lr": 0.05, "extra_memory": 0.05,
            "grad_sync": args.grad_sync, "inference_transport": args.inference_transport,
            "profile_samples": 200_000, "distinct_batches": 8,
            "steps": args.steps or (6 if args.quick else 30), "warmup": 2 if args.quick else 5,
            "prefetch": args.prefetch}
    if args.prefetch > 1 and not args.embedding_only:
        ap.error(f"--prefetch {args.prefetch}: the whole training step prefetches 1 batch ahead (as embedscale run "
                 "trains); a deeper queue only with --embedding-only")
    if args.embedding_only:
        main_embedding_only(args, base)
        return
    load_before = os.getloadavg()
    results = {}
    for name in names:
        cfg = {**base, **CONFIGS[name]}
        print(f"vs torchrec [{name}] {args.world} ranks: {cfg}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = spawn_local(worker, args.world, cfg, timeout_s=3600)
        results[name] = summarise(res, cfg)
        tr, inf = results[name]["train"], results[name]["inference"]
        print(f"  [{name}] train {tr['ours']['samples_per_s']:.0f} vs {tr['torchrec']['samples_per_s']:.0f} samples/s "
              f"({tr['ratio']:.2f}x); inference {inf['ours']['samples_per_s']:.0f} vs "
              f"{inf['torchrec']['samples_per_s']:.0f} ({inf['ratio']:.2f}x); training dense part "
              f"{tr['ours']['dense_ms']:.1f} vs {tr['torchrec']['dense_ms']:.1f} ms ({tr['dense_ratio']:.3f}x; CPU "
              f"{tr['ours']['cpu_dense_ms']:.1f} vs {tr['torchrec']['cpu_dense_ms']:.1f} ms); "
              + (f"ours serial {tr['ours_serial']['step_ms']:.1f} ms ({tr['ours_serial']['ratio']:.2f}x); "
                 if "ours_serial" in tr else "") +
              f"check {results[name]['check']}; "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    main_cfg = names[0]
    m = results[main_cfg]
    line = {
        "benchmark": "vs_torchrec", "figure": m["train"]["ours"]["samples_per_s"],
        "baseline": m["train"]["torchrec"]["samples_per_s"], "ratio": m["train"]["ratio"], "unit": "samples/s",
        "paired_ratio": m["train"]["paired_ratio"],
        "dense": {"ours_ms": m["train"]["ours"]["dense_ms"], "torchrec_ms": m["train"]["torchrec"]["dense_ms"],
                  "ratio": m["train"]["dense_ratio"], "ours_cpu_ms": m["train"]["ours"]["cpu_dense_ms"],
                  "torchrec_cpu_ms": m["train"]["torchrec"]["cpu_dense_ms"],
                  "cpu_ratio": m["train"]["cpu_dense_ratio"]},
        "inference": {"figure": m["inference"]["ours"]["samples_per_s"],
                      "baseline": m["inference"]["torchrec"]["samples_per_s"], "ratio": m["inference"]["ratio"],
                      "paired_ratio": m["inference"]["paired_ratio"], "unit": "samples/s",
                      "by_config": {n: _brief(results[n]["inference"]) for n in names}},
        "train_by_config": {n: _brief(results[n]["train"]) for n in names},
        "config": {**{k: v for k, v in base.items()}, "main_config": main_cfg,
                   "mlps": {n: CONFIGS[n] for n in names}, "loadavg_before": load_before,
                   "loadavg_after": os.getloadavg(), "torch": torch.__version__, "torchrec": _version("torchrec"),
                   "fbgemm_gpu": _version("fbgemm-gpu-cpu")},
        "results": results,
    }
    line["config"]["command"] = " ".join([".venv/bin/python", "benchmarks/bench_vs_torchrec.py", *sys.argv[1:]])
    print(json.dumps(line))
    if args.out:
        write_markdown([line], args.out)


def write_markdown(lines: list, path: str) -> None:
    """The figures of runs (their JSON lines; the first is the main one) as ``benchmarks/results/vs_torchrec.md``."""
    L = ["# embedscale vs TorchRec DistributedModelParallel: end-to-end throughput, 2 ranks", ""]
    for i, line in enumerate(lines):
        if i:
            L += [f"# Further run {i}: {line['config']['max_rows']:,} rows per table at most", ""]
        L += _run_markdown(line)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(L))
    print(f"wrote {path}", file=sys.stderr)


def _run_markdown(line: dict) -> list[str]:
    c = line["config"]
    res = line["results"]
    L = [f"Command: `{c.get('command', '.venv/bin/python benchmarks/bench_vs_torchrec.py')}`", "",
         f"Setup: {c['world']} ranks = {c['world']} local processes on gloo (CPU, 1 torch thread each), 26 "
         f"criteo-kaggle tables capped at {c['max_rows']:,} rows (scaled to fit), dim {c['dim']}, synthetic "
         f"power-law data (exponent {c['alpha']}, one-hot), global batch {c['batch']} ({c['batch'] // c['world']} "
         f"per rank), sparse optimizer {c['optimizer']} (lr {c['lr']}, eps {c['eps']}) on both sides, dense SGD "
         f"(lr {c['dense_lr']}); {c['steps']} timed steps after {c['warmup']} warm-up, ours and TorchRec "
         "alternating step by step (order flipped every step); a step's time is the slowest rank's; medians. "
         f"torch {c['torch']}, torchrec {c['torchrec']}, fbgemm-gpu-cpu {c['fbgemm_gpu']}.", "",
         "- ours: `ShardedEmbedding` (retrieve design, collective transport) under the `oper` plan with "
         f"{c['extra_memory']:.0%} extra memory (training plan for training; inference plan, hot rows replicated "
         "by OPER Algorithm 1, for inference), fused row-wise update, replica gradients synchronised by "
         f"`{c.get('grad_sync', 'local_aggregated')}`; inference lookups over the "
         f"`{c.get('inference_transport', 'collective')}` transport"
         + (" (`PgasShardedEmbedding`: one-sided gets from the peers' shared-memory segments, no message; its "
            "bytes are the rows read from peers)" if c.get("inference_transport") == "pgas" else "")
         + "; dense arches in DDP (sum hook, loss = sum / global batch).",
         "- TorchRec: `torchrec.models.dlrm.DLRM` over an `EmbeddingBagCollection` of the same tables, "
         "`DistributedModelParallel` with the plan of its own `EmbeddingShardingPlanner` (defaults, compute "
         "device cpu, same topology and per-rank batch); FBGEMM CPU TBE kernels; fused in-backward optimizer "
         "(`apply_optimizer_in_backward`) of the same kind. Its data-parallel tables run on TorchRec's dense "
         "kernel, which gets no fused optimizer: they get TorchRec's `RowWiseAdagrad` (or SGD) as a normal "
         "optimizer, as TorchRec's DLRM example trains them with its dense optimizer.",
         f"- load average (2 cores, shared with other jobs): before {_fmt_load(c['loadavg_before'])}, after "
         f"{_fmt_load(c['loadavg_after'])}. Timings on this machine are noisy; the paired ratio is the median "
         "over steps of TorchRec's step time / ours on the same batch, adjacent in time.", "",
         "## Throughput", "",
         "| config (MLPs) | phase | ours samples/s | TorchRec samples/s | ratio (medians) | paired ratio | "
         "ceiling | bar |",
         "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for n, r in res.items():
        mlp = c["mlps"][n]
        desc = f"{n} (bottom {'-'.join(map(str, mlp['bottom_mlp'] + [c['dim']]))}, top " \
               f"{'-'.join(map(str, mlp['top_mlp'] + [1]))})"
        for ph, bar in (("train", 1.5), ("inference", 2.0)):
            x = r[ph]
            met = "met" if x["ratio"] >= bar else "**not met**"
            ceil = x["torchrec"]["step_ms"] / max(x["torchrec"]["dense_ms"], 1e-9)
            L.append(f"| {desc} | {ph} | {x['ours']['samples_per_s']:,.0f} | {x['torchrec']['samples_per_s']:,.0f} | "
                     f"{x['ratio']:.2f}x | {x['paired_ratio']:.2f}x | {ceil:.2f}x | >= {bar}x: {met} |")
    L += ["", "Ceiling: TorchRec's step time over its dense time (step minus its embedding-only step): the ratio "
          "ours would reach with an embedding that cost nothing and the same dense part (both sides run the same "
          "MLPs and interaction, checked equal below). A bar above the ceiling is out of reach on this machine "
          "for any embedding."]
    L += ["", "## Breakdown (ms per step, medians; embedding = an embedding-only step timed the same way: "
          "lookup + all-to-alls [+ backward, replica-gradient sync, fused update]; dense = full - embedding)", "",
          "| config | phase | ours step | ours embedding | ours dense | TorchRec step | TorchRec embedding | "
          "TorchRec dense | embedding speed-up |",
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, r in res.items():
        for ph in ("train", "inference"):
            o, t = r[ph]["ours"], r[ph]["torchrec"]
            L.append(f"| {n} | {ph} | {o['step_ms']:.1f} | {o['embedding_ms']:.1f} | {o['dense_ms']:.1f} | "
                     f"{t['step_ms']:.1f} | {t['embedding_ms']:.1f} | {t['dense_ms']:.1f} | "
                     f"{r[ph]['embedding_speedup']:.2f}x |")
    L += ["", "## Bytes on wire per step (summed over ranks; bytes sent to other ranks)", "",
          "Both sides' all-to-alls are counted by one wrapper around `torch.distributed.all_to_all_single` (our "
          "transport and TorchRec's KJT / pooled-embedding all-to-alls all go through it); DDP's AllReduces by "
          "counting comm hooks (ring model, 2 (W-1)/W of the bucket per rank); our replica-gradient sync by its "
          "own counter; TorchRec's data-parallel tables' gradient AllReduce is its table DDP's, hooked the same "
          "way.", "",
          "| config | phase | side | embedding all-to-all | embedding sync / DP-table AllReduce | embedding total | "
          "dense AllReduce | all-to-alls per rank | ours / TorchRec embedding bytes |",
          "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, r in res.items():
        for ph in ("train", "inference"):
            for side in ("ours", "torchrec"):
                b = r[ph][side]["bytes_per_step"]
                L.append(f"| {n} | {ph} | {side} | {b['embedding_a2a']:,.0f} | {b.get('embedding_sync', 0):,.0f} | "
                         f"{b['embedding_total']:,.0f} | {b.get('dense_allreduce', 0):,.0f} | "
                         f"{r[ph][side].get('all_to_alls_per_step_per_rank', float('nan')):.0f} | "
                         + (f"{r[ph]['bytes_ratio']:.3f} |" if side == "ours" else " |"))
    L += ["", "## Same model on both sides", ""]
    for n, r in res.items():
        ck = r["check"]
        L.append(f"- {n}: logits at init (our dense weights and our placement-independent rows copied into "
                 f"TorchRec's shards), max |ours - TorchRec| = {ck['init_max_abs_diff']:.3g} (training plan), "
                 f"{ck['init_inference_plan_max_abs_diff']:.3g} (inference plan); after one training step of each on "
                 f"the same batch, on the next batch: {ck['after_one_step_max_abs_diff']:.3g} (the step moved the "
                 f"logits by up to {ck['one_step_logit_change']:.3g}; mean |logit| {ck['logit_scale']:.3g}).")
    L += ["", "## Plans", ""]
    for n, r in res.items():
        pl = r["plans"]
        rows = r["storage_rows_per_rank"]
        L.append(f"- {n}: TorchRec's planner: {pl['torchrec']} (tables per sharding type); ours: "
                 f"{pl['ours_training']['replicated_rows']:,} replicated rows (training plan), "
                 f"{pl['ours_inference']['replicated_rows']:,} (inference plan); storage rows per rank: "
                 + "; ".join(f"rank {i}: ours {x['ours_training']:,} / {x['ours_inference']:,}, TorchRec "
                             f"{x['torchrec']:,}" for i, x in enumerate(rows)) + ".")
    L += ["", "## JSON line", "", "```json", json.dumps({k: v for k, v in line.items() if k != "results"}), "```", ""]
    return L


def _fmt_load(x) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in x) + "]"


def _brief(ph: dict) -> dict:
    return {"ours_samples_per_s": ph["ours"]["samples_per_s"],
            "torchrec_samples_per_s": ph["torchrec"]["samples_per_s"], "ratio": ph["ratio"],
            "paired_ratio": ph["paired_ratio"], "embedding_speedup": ph["embedding_speedup"],
            "embedding_bytes_ratio": ph["bytes_ratio"]}


def _version(dist_name: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist_name)
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    main()
