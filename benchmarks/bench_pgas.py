"""PGAS fused embedding forward vs all_to_all + unpack (PGAS paper section IV, scaled to this machine).

Weak scaling as in the paper's section IV-A, scaled down: every rank owns 8 tables x 200k rows (table-wise
placement), dim 64, one feature per table; the global batch of 16384 samples is split over the ranks; every
bag has exactly ``P`` uniformly drawn ids, swept over P = 1, 4, 16, 32; 2 and 4 ranks (gloo, one thread each).
Measured in the same run, interleaved repeat by repeat:

* ``pgas``: ``PgasShardedEmbedding(design="send")``: each owner pools its features for the whole global
  batch, chunk by chunk, and writes every pooled vector at its final place ``[sample, feature]`` in the
  requesting rank's output tensor in the symmetric heap (Listing 2); completion is one per-peer signal.
* ``baseline``: the paper's baseline on the same inputs and the same storage, at its best:
  the same pooling kernel as the PGAS path (``embedding_bag`` over chunks of ``--chunk-bags`` bags of one
  requester's samples, as ``pgas_lookup._serve``), every buffer allocated once (batch-major send and receive
  buffers, the output), the rank's own samples pooled straight into its output (the self block of an
  all_to_all moves nothing; at one rank there is no collective at all), the peers' blocks through one
  ``all_to_all_single`` (gloo, waited on), then the unpack into ``[B_local, F * D]``. So at one rank both
  run the same pooling and stores, and what differs at more ranks is the communication design.

The timed region is the paper's: EMB forward + communication + unpack, after the sparse inputs have reached
their owners (untimed: ``input_dist`` for pgas; the baseline is given the owner-side ids). ``e2e`` adds
the input distribution to both (from the rank's KJT-layout batch, each owner's ids shifted to its storage
offsets, one block per owner: through the heap for ours; an id all_to_all among the peers, into a buffer
allocated once, for the baseline). Each iteration's time is the slowest rank's (max over ranks); figures
are medians over ``--repeats``. The baseline is broken down as the paper's Fig. 6:
computation (pooling + batch-major layout), communication (all_to_all minus the same all_to_all of one
float per peer), sync + unpack (that one-float all_to_all, which is mostly waiting for the slowest rank,
plus the unpack). Scaling references run the same code on 1 rank (no peers; the two methods must be within
10% of each other there: ``one_rank_ratio``): with 8 tables for the weak scaling factor, with all 16 tables
of the 2-rank job for the strong scaling factor at 2 ranks. A timeline
of bytes written per rank (the paper's Fig. 7) is drawn from one PGAS forward at 2 ranks, P = 4, with the
baseline's all_to_all phase dashed.

Every output is checked equal (bitwise) between pgas and baseline before timing.

    .venv/bin/python benchmarks/bench_pgas.py [--quick] [--repeats N]

Prints one JSON line on stdout; progress on stderr; writes benchmarks/results/pgas.md and pgas_timeline.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from embedscale.comm.pgas import PgasTransport, heap_segments
from embedscale.comm.timeline import plot_timeline
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.pgas_lookup import PgasShardedEmbedding
from embedscale.specs import TableSpec
from embedscale.train.launch import spawn_local

RESULTS = Path(__file__).resolve().parent / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ids(P: int, f: int, n: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * P + f)
    return torch.randint(0, rows, (n,), generator=g)


def _worker(rank: int, world: int, cfg: dict) -> dict:
    T_own, R, D, BG = cfg["tables_per_rank"], cfg["rows"], cfg["dim"], cfg["batch"]
    T = T_own * world
    Bl = BG // world
    tables = [TableSpec(f"t{i}", R, D) for i in range(T)]
    amap = AddressMap.build(tables, world, [np.full(R, i // T_own) for i in range(T)])
    tr = PgasTransport(job_id=cfg["job"], slot_bytes=cfg["slot_bytes"])
    emb = PgasShardedEmbedding(tables, amap, tr, rank, design="send", optimizer=None, max_batch_size=Bl,
                               chunk_bags=cfg["chunk_bags"], validate=False)
    weight = emb.weight  # rows of the owned tables, table after table: the baseline pools the same storage
    mine = list(range(rank * T_own, (rank + 1) * T_own))
    out: dict = {"per_p": {}, "load": [], "timeline": None}

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for P in cfg["pooling"]:
        # inputs: the global batch, P ids per bag, one generator per (P, feature): every rank agrees
        ids = {f: _ids(P, f, BG * P, R) for f in range(T)}
        lo, hi = rank * Bl, (rank + 1) * Bl
        local = JaggedFeatures([t.name for t in tables], torch.cat([ids[f][lo * P:hi * P] for f in range(T)]),
                               torch.full((T * Bl,), P, dtype=torch.int64))
        # the owner-side input of the baseline, per requester q (its samples of the owned features, feature-major,
        # in storage offsets): exactly what each requester sends the owner in the e2e variant
        own_blocks = [torch.cat([ids[f][q * Bl * P:(q + 1) * Bl * P] + (f - rank * T_own) * R for f in mine])
                      for q in range(world)]
        del ids
        # the baseline at its best: the PGAS path's pooling kernel (embedding_bag over chunks
        # of ``chunk_bags`` bags of one requester's samples, feature-major, as ``pgas_lookup._serve``) and
        # buffers allocated once: the pooled vectors are stored straight into a batch-major send buffer, the
        # rank's own samples straight into its output (the self block of an all_to_all moves nothing), the
        # peers' blocks go through one all_to_all_single into a receive buffer, unpacked into the output.
        nb = T_own * Bl  # bags per requester
        offs_all = torch.arange(0, nb * P + 1, P, dtype=torch.int64)
        chunks = [(a, min(a + cfg["chunk_bags"], nb)) for a in range(0, nb, cfg["chunk_bags"])]
        chunk_offs = [offs_all[a:b + 1] - offs_all[a] for a, b in chunks]
        peers = [q for q in range(world) if q != rank]
        send_buf = torch.empty(len(peers), Bl, T_own, D)  # batch-major blocks, one per peer
        recv_buf = torch.empty(len(peers), Bl, T_own, D)
        recv_ids = torch.empty(len(peers), T_own * Bl * P, dtype=torch.int64)
        send_ids = torch.empty(len(peers), T_own * Bl * P, dtype=torch.int64)
        self_ids = torch.empty(T_own * Bl * P, dtype=torch.int64)
        out_buf = torch.empty(Bl, T, D)  # [B_local, F * D], allocated once
        blk = {q: i for i, q in enumerate(peers)}

        def pool_into(vals: torch.Tensor, dst3: torch.Tensor) -> None:
            """Pool one requester's bags (feature-major) into ``dst3 [Bl, T_own, D]``, chunk by chunk."""
            for (a, b), offs in zip(chunks, chunk_offs):
                pooled = F.embedding_bag(vals[a * P:b * P], weight, offs, mode="sum", include_last_offset=True)
                for i in range(a // Bl, (b - 1) // Bl + 1):
                    s, e = max(a, i * Bl), min(b, (i + 1) * Bl)
                    dst3[s - i * Bl:e - i * Bl, i].copy_(pooled[s - a:e - a])

        def baseline_compute(blocks: list[torch.Tensor]) -> None:
            for q in range(world):
                pool_into(blocks[q], out_buf[:, rank * T_own:(rank + 1) * T_own] if q == rank else send_buf[blk[q]])

        def a2a(out: torch.Tensor, inp: torch.Tensor) -> None:
            """all_to_all_single among the peers only (the self block is not sent; nothing at one rank)."""
            if peers:
                sizes = [inp[0].numel() if q != rank else 0 for q in range(world)]
                dist.all_to_all_single(out.view(-1), inp.view(-1), sizes, sizes)

        def baseline(probe: bool = False, e2e: bool = False) -> tuple[float, dict]:
            t0 = time.perf_counter()
            blocks = own_blocks
            if e2e:  # the input distribution: every requester's ids of this rank's features to this rank
                # requester side, as the PGAS path's messages: each owner's features' ids, shifted to its
                # storage offsets, one block per owner (the KJT's values are feature-major already)
                vals = torch.split(local.values, local.length_per_key_list())
                for q in range(world):
                    torch.cat([vals[f] + (f - q * T_own) * R for f in range(q * T_own, (q + 1) * T_own)],
                              out=self_ids if q == rank else send_ids[blk[q]])
                a2a(recv_ids, send_ids)
                blocks = [self_ids if q == rank else recv_ids[blk[q]] for q in range(world)]
            t1 = time.perf_counter()
            baseline_compute(blocks)
            t2 = time.perf_counter()
            ns0 = time.perf_counter_ns()
            if probe:  # the paper's sync estimate: the same phase with one float per peer
                if peers:
                    dist.all_to_all_single(torch.empty(world), torch.zeros(world))
                t3 = time.perf_counter()
                return t3 - t0, {"compute": t2 - t1, "sync": t3 - t2}
            a2a(recv_buf, send_buf)
            t3 = time.perf_counter()
            ns1 = time.perf_counter_ns()
            for q in peers:  # unpack: each owner's block to its features' columns
                out_buf[:, q * T_own:(q + 1) * T_own].copy_(recv_buf[blk[q]])
            t4 = time.perf_counter()
            return t4 - t0, {"input": t1 - t0, "compute": t2 - t1, "a2a": t3 - t2, "unpack": t4 - t3,
                             "out": out_buf.view(Bl, T * D), "a2a_ns": (ns0, ns1),
                             "a2a_bytes": send_buf.numel() * 4}

        def pgas(e2e: bool = False) -> tuple[float, dict]:
            if e2e:
                t0 = time.perf_counter()
                with torch.no_grad():
                    res = emb(local)
                return time.perf_counter() - t0, {"out": res}
            h = emb.create_context(training=False)
            emb.input_dist(h, local)
            dist.barrier()
            t0 = time.perf_counter()
            emb.compute(h)
            res = emb.output_dist(h)
            return time.perf_counter() - t0, {"out": res}

        # equality: the same pooled vectors at the same places, bit for bit
        _, b = baseline()
        _, p = pgas()
        same = bool(torch.equal(b["out"], p["out"]))
        if not same:
            raise SystemExit(f"rank {rank}: pgas and baseline outputs differ at P={P}")
        _, p2 = pgas(e2e=True)
        _, b2 = baseline(e2e=True)
        if not torch.equal(b2["out"], p2["out"]):
            raise SystemExit(f"rank {rank}: e2e outputs differ at P={P}")
        methods = {"baseline": lambda: baseline(), "probe": lambda: baseline(probe=True), "pgas": lambda: pgas(),
                   "baseline_e2e": lambda: baseline(e2e=True), "pgas_e2e": lambda: pgas(e2e=True)}
        times: dict[str, list[float]] = {k: [] for k in methods}
        parts: dict[str, list[float]] = {"compute": [], "a2a": [], "unpack": [], "sync": [], "probe_compute": []}
        names = list(methods)
        for r in range(cfg["repeats"]):
            for name in names[r % len(names):] + names[:r % len(names)]:
                dist.barrier()
                el, info = methods[name]()
                times[name].append(slowest(el))
                if name == "baseline":
                    for k in ("compute", "a2a", "unpack"):
                        parts[k].append(slowest(info[k]))
                elif name == "probe":
                    parts["sync"].append(slowest(info["sync"]))
                    parts["probe_compute"].append(slowest(info["compute"]))
            out["load"].append(os.getloadavg()[0])
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        pm = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
        out["per_p"][P] = {"ms": med, "parts_ms": pm, "equal": same, "samples": {k: [x * 1e3 for x in v]
                                                                                for k, v in times.items()}}
        if rank == 0:
            log(f"  {world} ranks, P={P}: pgas {med['pgas']:.1f} ms, baseline {med['baseline']:.1f} ms "
                f"(x{med['baseline'] / med['pgas']:.2f}); e2e pgas {med['pgas_e2e']:.1f} ms, baseline "
                f"{med['baseline_e2e']:.1f} ms (x{med['baseline_e2e'] / med['pgas_e2e']:.2f})")
        if cfg["timeline_p"] == P:
            tl = tr.enable_timeline()
            h = emb.create_context(training=False)
            emb.input_dist(h, local)
            dist.barrier()
            tl.reset()
            tl.mark("forward")
            emb.compute(h)
            emb.output_dist(h)
            ev = tl.events()
            tr.timeline = None
            dist.barrier()
            _, b = baseline()
            out["timeline"] = {"pgas": {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in ev.items()},
                               "baseline": {"start_ns": b["a2a_ns"][0], "end_ns": b["a2a_ns"][1],
                                            "bytes": b["a2a_bytes"]}}
    emb.close()
    tr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 2 and 4 ranks, P = 1, 4, 32")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pooling", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--tables-per-rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--chunk-bags", type=int, default=4096)
    ap.add_argument("--no-md", action="store_true", help="do not write benchmarks/results/pgas.md")
    args = ap.parse_args()
    pooling = args.pooling or ([1, 4, 32] if args.quick else [1, 4, 16, 32])
    repeats = args.repeats or (3 if args.quick else 5)
    job = f"bench{os.getpid()}"
    cfg = {"tables_per_rank": args.tables_per_rank, "rows": args.rows, "dim": args.dim, "batch": args.batch,
           "pooling": pooling, "repeats": repeats, "chunk_bags": args.chunk_bags, "job": job,
           "slot_bytes": 1 << 20, "timeline_p": 4 if 4 in pooling else pooling[0]}
    load0 = os.getloadavg()
    t_start = time.time()
    weak = {}
    for W in args.worlds:
        log(f"{W} ranks: {args.tables_per_rank} tables x {args.rows} rows per rank, dim {args.dim}, "
            f"batch {args.batch}, pooling {pooling}, {repeats} repeats")
        c = dict(cfg, timeline_p=cfg["timeline_p"] if W == 2 else None)
        ranks = spawn_local(_worker, W, c, timeout_s=3600)
        weak[W] = dict(ranks[0], timelines=[r["timeline"] for r in ranks])
    # scaling references: the same code on 1 rank (no peers: both methods only pool and lay out),
    # with the tables of one rank (weak scaling) and with the 16 tables of the 2-rank job (strong scaling)
    single = {}
    for T in sorted({args.tables_per_rank, 2 * args.tables_per_rank}):
        log(f"1 rank, {T} tables (scaling reference)")
        single[T] = spawn_local(_worker, 1, dict(cfg, tables_per_rank=T, timeline_p=None), timeout_s=3600)[0]["per_p"]
    leftover = heap_segments(job)
    sweep = []
    for W, res in weak.items():
        for P, r in res["per_p"].items():
            ms, pm = r["ms"], r["parts_ms"]
            comm = max(pm["a2a"] - pm["sync"], 0.0)
            sweep.append({
                "ranks": W, "pooling": P, "pgas_ms": round(ms["pgas"], 2), "baseline_ms": round(ms["baseline"], 2),
                "speedup": round(ms["baseline"] / ms["pgas"], 3),
                "pgas_e2e_ms": round(ms["pgas_e2e"], 2), "baseline_e2e_ms": round(ms["baseline_e2e"], 2),
                "speedup_e2e": round(ms["baseline_e2e"] / ms["pgas_e2e"], 3),
                "baseline_breakdown_ms": {"computation": round(pm["compute"], 2), "communication": round(comm, 2),
                                          "sync_plus_unpack": round(pm["sync"] + pm["unpack"], 2),
                                          "a2a_phase": round(pm["a2a"], 2), "one_float_a2a": round(pm["sync"], 2),
                                          "unpack": round(pm["unpack"], 2)},
                "one_rank_ms": {k: round(single[args.tables_per_rank][P]["ms"][k], 2) for k in ("pgas", "baseline")},
                "weak_scaling_factor": {k: round(ms[k] / single[args.tables_per_rank][P]["ms"][k], 3)
                                        for k in ("pgas", "baseline")},
                "one_rank_ratio": round(single[args.tables_per_rank][P]["ms"]["baseline"]
                                        / single[args.tables_per_rank][P]["ms"]["pgas"], 3),
                "equal_outputs": r["equal"],
            })
    strong = []
    if 2 in weak:
        for P, r in weak[2]["per_p"].items():
            t1 = single[2 * args.tables_per_rank][P]["ms"]
            strong.append({"pooling": P, "one_rank_pgas_ms": round(t1["pgas"], 2),
                           "one_rank_baseline_ms": round(t1["baseline"], 2),
                           "two_ranks_pgas_ms": round(r["ms"]["pgas"], 2),
                           "two_ranks_baseline_ms": round(r["ms"]["baseline"], 2),
                           "strong_scaling_pgas": round(t1["pgas"] / r["ms"]["pgas"], 3),
                           "strong_scaling_baseline": round(t1["baseline"] / r["ms"]["baseline"], 3)})
    png = None
    if 2 in weak and weak[2]["timeline"] is not None:
        tls = weak[2]["timelines"]
        per_rank = [{k: (np.asarray(v) if k in ("t_ns", "nbytes", "peer", "kind") else v)
                     for k, v in tl["pgas"].items()} for tl in tls]
        # the baseline's all_to_all phase, measured in its own iteration, drawn after its computation time
        # from the start of the PGAS forward (where both start from the same owner-side inputs)
        comp = weak[2]["per_p"][cfg["timeline_p"]]["parts_ms"]["compute"]
        base = []
        for tl, e in zip(tls, per_rank):
            e["t0_ns"] = t0 = e["marks"][0][1]  # every rank on its own clock from the start of its forward
            dur = tl["baseline"]["end_ns"] - tl["baseline"]["start_ns"]
            start = t0 + int(comp * 1e6)
            base.append({"start_ns": start, "end_ns": start + dur, "bytes": tl["baseline"]["bytes"], "t0_ns": t0})
        png = plot_timeline(per_rank, RESULTS / "pgas_timeline.png", baseline=base,
                            title=f"bytes written to peers, 2 ranks, P={cfg['timeline_p']} (PGAS Fig. 7)")
    head = next((s for s in sweep if s["ranks"] == max(weak) and s["pooling"] == min(pooling)), sweep[0])
    low = [s["speedup"] for s in sweep if s["pooling"] in (1, 4)]
    result = {
        "benchmark": "pgas_fused_embedding_forward",
        "figure": head["pgas_ms"], "baseline": head["baseline_ms"], "ratio": head["speedup"],
        "unit": f"ms per global batch (EMB forward + communication + unpack), {head['ranks']} ranks, "
                f"pooling {head['pooling']}; ratio = baseline / pgas",
        "min_speedup_pooling_1_4": min(low) if low else None,
        "min_speedup_all": min(s["speedup"] for s in sweep),
        "min_speedup_e2e": min(s["speedup_e2e"] for s in sweep),
        "one_rank_ratio": {P: round(r["ms"]["baseline"] / r["ms"]["pgas"], 3)
                           for P, r in single[args.tables_per_rank].items()},
        "sweep": sweep, "strong_scaling_2_ranks": strong,
        "baseline_name": "chunked embedding_bag (the PGAS kernel) into buffers allocated once + all_to_all_single "
                         "among peers (gloo) + unpack",
        "config": {"tables_per_rank": args.tables_per_rank, "rows": args.rows, "dim": args.dim, "batch": args.batch,
                   "pooling": pooling, "ranks": list(weak), "repeats": repeats, "chunk_bags": args.chunk_bags,
                   "threads_per_rank": 1, "placement": "table-wise", "ids": "uniform, exactly P per bag",
                   "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                   "loadavg_during": [round(x, 2) for W in weak for x in weak[W]["load"]],
                   "cpus": os.cpu_count(), "torch": torch.__version__, "seconds": round(time.time() - t_start, 1),
                   "timeline_png": str(png) if png else None, "shm_segments_left": leftover},
    }
    if not args.no_md:
        _write_md(result, " ".join(["benchmarks/bench_pgas.py"] + sys.argv[1:]))
    print(json.dumps(result))


def _write_md(res: dict, cmd: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    c = res["config"]
    lines = [
        "# PGAS fused embedding forward vs all_to_all + unpack",
        "",
        f"Command: `.venv/bin/python {cmd}` ({c['seconds']} s; load average {c['loadavg_start']} at start, "
        f"{c['loadavg_end']} at the end, on {c['cpus']} cores shared with other jobs: timings are noisy).",
        "",
        f"Setup (PGAS paper IV-A weak scaling, scaled): {c['tables_per_rank']} tables x {c['rows']:,} rows per rank, "
        f"dim {c['dim']}, global batch {c['batch']:,} split over the ranks, exactly P uniform ids per bag, table-wise, "
        f"gloo, 1 thread per rank, median of {c['repeats']} interleaved repeats, slowest rank per repeat. "
        "Region timed: EMB forward + communication + unpack (inputs already at their owners), as the paper. "
        "`e2e` also includes the input distribution (ids to the owners) on both sides. "
        "Outputs of both are checked bitwise equal first.",
        "",
        "| ranks | P | PGAS fused (ms) | baseline (ms) | speedup | e2e PGAS (ms) | e2e baseline (ms) | e2e speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in res["sweep"]:
        lines.append(f"| {s['ranks']} | {s['pooling']} | {s['pgas_ms']} | {s['baseline_ms']} | **{s['speedup']}x** | "
                     f"{s['pgas_e2e_ms']} | {s['baseline_e2e_ms']} | {s['speedup_e2e']}x |")
    lines += ["", "Baseline breakdown (paper Fig. 6 method: communication = all_to_all phase minus the same phase "
              "with one float per peer; sync + unpack = that one-float phase + unpack):", "",
              "| ranks | P | computation | communication | sync + unpack | PGAS fused total | 1 rank PGAS / baseline | "
              "weak scaling factor PGAS / baseline |", "|---|---|---|---|---|---|---|---|"]
    for s in res["sweep"]:
        b = s["baseline_breakdown_ms"]
        lines.append(f"| {s['ranks']} | {s['pooling']} | {b['computation']} | {b['communication']} | "
                     f"{b['sync_plus_unpack']} | {s['pgas_ms']} | {s['one_rank_ms']['pgas']} / "
                     f"{s['one_rank_ms']['baseline']} | "
                     f"{s['weak_scaling_factor']['pgas']} / {s['weak_scaling_factor']['baseline']} |")
    if res["strong_scaling_2_ranks"]:
        lines += ["", "Strong scaling at 2 ranks (16 tables in total, the same global batch; the 1-rank run of each "
                  "method holds all 16 tables; factor = 1-rank time / 2-rank time, ideal 2):", "",
                  "| P | 1 rank PGAS (ms) | 1 rank baseline (ms) | 2 ranks PGAS (ms) | 2 ranks baseline (ms) | "
                  "strong scaling PGAS | baseline |", "|---|---|---|---|---|---|---|"]
        for s in res["strong_scaling_2_ranks"]:
            lines.append(f"| {s['pooling']} | {s['one_rank_pgas_ms']} | {s['one_rank_baseline_ms']} | "
                         f"{s['two_ranks_pgas_ms']} | {s['two_ranks_baseline_ms']} | {s['strong_scaling_pgas']} | "
                         f"{s['strong_scaling_baseline']} |")
    lines += ["", f"Minimum speedup at pooling 1 and 4: **{res['min_speedup_pooling_1_4']}x**; at any pooling factor: "
              f"**{res['min_speedup_all']}x** (paper, on V100s with NVLink: 1.97x weak, 2.63x strong).", ""]
    if c.get("timeline_png"):
        lines += ["Timeline (paper Fig. 7): bytes each rank wrote to its peer over one PGAS forward at 2 ranks, "
                  "from the start of its forward; dashed, the baseline's all_to_all volume interpolated over its "
                  "communication phase, placed after its computation: `benchmarks/results/pgas_timeline.png`.", ""]
    lines += [f"One rank (no peers, both methods pool with the same kernel into buffers allocated once), "
              f"baseline / PGAS time per P: {res['one_rank_ratio']} (bar: within 10%).", "",
              "On a CPU the same cores pool and copy; the PGAS writes are plain stores into another process's "
              "mapped pages, so what remains of the gain is the removed all_to_all (gloo over loopback TCP: "
              "serialisation, copies, waiting for the slowest rank) and the removed unpack. The baseline uses "
              "the PGAS path's pooling kernel and allocates its buffers once (earlier versions "
              "of this benchmark allocated fresh outputs every step and were 17x slower at one rank). "
              "The machine is shared with other jobs (see the load averages): absolute times vary between "
              "runs; the two methods are interleaved so both see the same load. The GPU path (CUDA "
              "symmetric memory) is designed for, untested here.", ""]
    (RESULTS / "pgas.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
