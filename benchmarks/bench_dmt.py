"""DMT-DLRM (tower transform + DLRM tower modules at CR 4) vs flat table-wise DLRM: iteration throughput on
4 local ranks as 2 hosts x 2 ranks whose cross-host traffic goes through a slower link.

The links. Every rank's exchanges go through ``HostAwareTransport`` with an injected ``LinkModel``
(``embedscale.comm.hierarchical``): after each exchange a rank sleeps for the modelled transfer time of
its bytes: ``max(cross-host bytes sent, received) * 8 / rate`` at each of ``--link-gbit`` Gbit/s per rank
(default 0, 0.25 and 1: no injected link, then two speeds, all in the same run, the link switched between
timed blocks) and, on a second, parallel link, its intra-host bytes at ``--intra-ratio`` (default 12, DMT
Table 1's NVLink-to-NIC ratio of an A100) times that rate, plus ``--link-latency-us``; dense AllReduces are
charged as a hierarchical ring (``2 (h - 1) / h * bytes / l`` across hosts). Every model runs through the
same transports, the same links, the same data and the same dense optimizer.

Why 0.25 Gbit/s: what matters is compute per byte on the wire. A rank here trains the dense model at
~11 GFLOP/s (1.2 MFLOP per sample, 1024 samples in ~110 ms with no link, measured on a quiet machine),
i.e. ~350 FLOP per cross-host byte at 0.25 Gbit/s. DMT Table 1's clusters have 1256 (V100), 6240 (A100)
and 19780 (H100) FLOP of peak per byte of scale-out bandwidth; at a typical 30% of peak a V100 cluster
has ~380. So 0.25 Gbit/s emulates the most network-rich generation of Table 1, and A100/H100 balances
would be 5-50x slower links; at 1 Gbit/s and without a link the network matters less or not at all.

Models (same seed, same tables). The baseline is the classic model-parallel DLRM (ids all_to_all to table
owners, tables balanced over all 4 ranks, owners pool, pooled all_to_all back; DMT Figure 4) at its best,
as DMT section 5's *Strong Baseline*: ``flat`` (float32 pooled vectors), ``flat_fp16``
(quantized communication as TorchRec's qcomms: fp16 forward, bf16 backward; ``models.flat.QuantizedComm``)
and ``flat_int8`` (row-wise int8 forward with an fp32 scale and offset per row, bf16 backward); the baseline
of a link is the fastest of them there. Column-wise sharding is not run: DMT uses it "when there are more
GPUs than embedding tables" to balance the load, and here 26 tables of one width go table-wise onto 4
ranks as 7, 7, 6, 6; column-wise halves would make it 6.5 each, at most 7% fewer bytes on the busiest
rank's link (14 against 13 feature-batches sent across hosts), while each id would go to two owners.
Ours is DMT-DLRM with 2 towers (one per host, the naive strided assignment), table-wise inside a tower,
DLRM tower modules ``c = 1, p = 0, D = N / 4`` (CR 4): ``dmt`` (float32) and ``dmt_fp16`` (the same
quantized communication on its tower and peer all_to_alls: DMT builds on the Strong Baseline); ``--full``
adds the tower transform alone (pass-through towers, DMT Figure 11's ablation). Steps are timed in blocks
between barriers, the models interleaved (the order rotated per repeat and link); a repeat's step is its
slowest rank's; figures are medians (and p90) over repeats; each throughput is the global batch over the
median step time.

Prints one JSON line on stdout; progress on stderr.

    .venv/bin/python benchmarks/bench_dmt.py [--quick] [--full]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from embedscale.specs import CRITEO_KAGGLE_ROWS, ModelConfig, TableSpec


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_tables(dim: int, max_rows: int) -> list[TableSpec]:
    return [TableSpec(f"C{i + 1}", min(n, max_rows), dim) for i, n in enumerate(CRITEO_KAGGLE_ROWS)]


def make_batches(tables, num_dense, global_b, n, seed):
    """``n`` global batches: one-hot ids, log-uniform popularity ranks (Zipf-like, exponent 1) scattered
    over each table's rows, uniform dense features, 25% positive labels."""
    from embedscale.data.batch import JaggedFeatures

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cols = []
        for t in tables:
            r = np.minimum(np.expm1(rng.random(global_b) * np.log(t.num_rows)).astype(np.int64), t.num_rows - 1)
            cols.append((r * 2654435761) % t.num_rows)
        ids = torch.from_numpy(np.stack(cols, 1))
        out.append((torch.from_numpy(rng.random((global_b, num_dense), dtype=np.float32)),
                    JaggedFeatures.from_dense([t.name for t in tables], ids),
                    torch.from_numpy((rng.random(global_b) < 0.25).astype(np.float32))))
    return out


def _models(cfg, comm, tables, mcfg):
    """Every model of the run, on its comm: plain (float32 pooled vectors) or quantized (``QuantizedComm``)."""
    from embedscale.models.dmt import DMTConfig, build_dmt_model, build_flat_model
    from embedscale.models.flat import QuantizedComm

    fp16 = QuantizedComm(comm, "fp16", "bf16")
    int8 = QuantizedComm(comm, "int8", "bf16", row_width=cfg["dim"])
    dmt_cfg = DMTConfig(tower_module="dlrm", compression=cfg["cr"])
    out = {"flat": (build_flat_model(mcfg, tables, 13, comm, seed=0, lr=0.05), comm),
           "flat_fp16": (build_flat_model(mcfg, tables, 13, fp16, seed=0, lr=0.05), fp16),
           "flat_int8": (build_flat_model(mcfg, tables, 13, int8, seed=0, lr=0.05), int8),
           "dmt": (build_dmt_model(mcfg, tables, 13, dmt_cfg, comm=comm, seed=0, lr=0.05), comm),
           "dmt_fp16": (build_dmt_model(mcfg, tables, 13, dmt_cfg, comm=fp16, seed=0, lr=0.05), fp16)}
    if cfg["full"]:
        out["sptt"] = (build_dmt_model(mcfg, tables, 13, DMTConfig(tower_module="none"), comm=comm, seed=0, lr=0.05),
                       comm)
    return {k: v for k, v in out.items() if k in cfg["models"]}


def worker(rank, world, cfg):
    import torch.distributed as dist

    from embedscale.comm.hierarchical import LinkModel, TowerComm
    from embedscale.plan.tower_placement import TowerLayout
    from embedscale.models.dmt import train_step

    torch.set_num_threads(1)
    links = {g: LinkModel(g, cfg["link_latency_us"], g * cfg["intra_ratio"]) if g > 0 else None
             for g in cfg["links_gbit"]}
    comm = TowerComm(TowerLayout(world, cfg["ranks_per_host"]))

    def set_link(g):  # the link model of every transport of the run (the models share them)
        for t in comm.transports.values():
            t.link = links[g]

    tables = make_tables(cfg["dim"], cfg["max_rows"])
    mcfg = ModelConfig(arch="dlrm", embedding_dim=cfg["dim"], bottom_mlp=cfg["bottom"], top_mlp=cfg["top"])
    models = _models(cfg, comm, tables, mcfg)
    opts = {k: torch.optim.Adagrad(m.dense_parameters(), lr=0.01) for k, (m, _) in models.items()}
    gb = cfg["batch"] * world
    lo, hi = cfg["batch"] * rank, cfg["batch"] * (rank + 1)
    data = [(d[lo:hi], jf.slice_batch(lo, hi), y[lo:hi]) for d, jf, y in make_batches(tables, 13, gb, cfg["steps"], 1)]
    names = list(models)

    def block(name, steps):
        (m, c), o = models[name], opts[name]
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(steps):
            d, jf, y = data[s % len(data)]
            train_step(m, o, d, jf, y, gb, c)
        dist.barrier()
        return (time.perf_counter() - t0) / steps

    set_link(cfg["links_gbit"][0])
    for name in names:
        block(name, cfg["warmup"])
    times = {g: {n: [] for n in names} for g in cfg["links_gbit"]}
    for rep in range(cfg["repeats"]):
        for li, g in enumerate(cfg["links_gbit"]):  # every link in every repeat: the load hits all alike
            set_link(g)
            k = (rep + li) % len(names)
            for name in names[k:] + names[:k]:
                times[g][name].append(block(name, cfg["steps"]))
            if rank == 0:
                log(f"repeat {rep + 1}/{cfg['repeats']}, link {g} Gbit/s: " +
                    ", ".join(f"{n} {times[g][n][-1] * 1e3:.1f} ms" for n in names))
    set_link(cfg["links_gbit"][0])
    traffic = {}
    for name in names:  # one counted step each (bytes do not depend on the link)
        comm.reset_bytes()
        d, jf, y = data[0]
        m, c = models[name]
        train_step(m, opts[name], d, jf, y, gb, c)
        rep = comm.bytes_report()
        traffic[name] = {"cross_bytes": int(sum(rep["cross"].values())), "intra_bytes": int(sum(rep["intra"].values())),
                         "cross_by_kind": rep["cross"]}
    return {"times": {str(g): v for g, v in times.items()}, "traffic": traffic}


def flops(cfg) -> dict:
    """Training FLOPs per sample of both models, single process (DMT Table 4's column)."""
    from embedscale.models.dmt import DMTConfig, build_dmt_model, training_flops_per_sample

    tables = make_tables(cfg["dim"], 1000)
    mcfg = ModelConfig(arch="dlrm", embedding_dim=cfg["dim"], bottom_mlp=cfg["bottom"], top_mlp=cfg["top"])
    d, jf, _ = make_batches(tables, 13, 64, 1, 0)[0]
    flat = build_dmt_model(mcfg, tables, 13, DMTConfig(tower_module="none", towers=1))
    dmt = build_dmt_model(mcfg, tables, 13, DMTConfig(tower_module="dlrm", compression=cfg["cr"], towers=2))
    return {"flat": training_flops_per_sample(flat, d, jf)["train"],
            "dmt": training_flops_per_sample(dmt, d, jf)["train"]}


FLATS = ("flat", "flat_fp16", "flat_int8")
DMTS = ("dmt", "dmt_fp16")


def summarise(res: list[dict], cfg: dict) -> dict:
    """Per link: each model's step time (a repeat's step is its slowest rank's; median and p90 over repeats),
    throughput, and DMT against the flat baseline at its best (the fastest flat variant at that link)."""
    gb = cfg["batch"] * cfg["world"]
    out = {}
    for g in cfg["links_gbit"]:
        key = str(g)
        names = list(res[0]["times"][key])
        per_rep = {n: [max(r["times"][key][n][i] for r in res) for i in range(cfg["repeats"])] for n in names}
        step = {n: statistics.median(v) for n, v in per_rep.items()}
        p90 = {n: float(np.percentile(v, 90)) for n, v in per_rep.items()}
        flats = [n for n in FLATS if n in step]
        dmts = [n for n in DMTS if n in step]
        best_flat = min(flats, key=lambda n: step[n])
        best_dmt = min(dmts, key=lambda n: step[n]) if dmts else None
        out[key] = {
            "step_ms": {n: round(step[n] * 1e3, 2) for n in names},
            "step_ms_p90": {n: round(p90[n] * 1e3, 2) for n in names},
            "throughput": {n: round(gb / step[n], 1) for n in names},
            "best_flat": best_flat, "best_dmt": best_dmt,
            "ratio_best_dmt_vs_best_flat": round(step[best_flat] / step[best_dmt], 3) if best_dmt else None,
            "ratio_dmt_vs_best_flat": round(step[best_flat] / step["dmt"], 3) if "dmt" in step else None,
            "ratio_dmt_fp16_vs_flat_fp16": round(step["flat_fp16"] / step["dmt_fp16"], 3)
            if {"dmt_fp16", "flat_fp16"} <= set(step) else None,
            "ratio_dmt_vs_flat_fp32": round(step["flat"] / step["dmt"], 3) if {"dmt", "flat"} <= set(step) else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--full", action="store_true", help="also time the tower transform alone (pass-through)")
    ap.add_argument("--link-gbit", type=float, nargs="+", default=[0.0, 0.25, 1.0],
                    help="cross-host link speeds, Gbit/s per rank (0 = no injected link), all in the same run")
    ap.add_argument("--intra-ratio", type=float, default=12.0,
                    help="intra-host link = this many times the cross-host one (DMT Table 1: 300 GB/s NVLink vs "
                         "200 Gbit/s NIC per A100 = 12; 0 = intra-host not modelled)")
    ap.add_argument("--link-latency-us", type=float, default=0.0)
    ap.add_argument("--models", nargs="+", default=list(FLATS + DMTS),
                    help=f"subset of {', '.join(FLATS + DMTS)} (and sptt with --full)")
    ap.add_argument("--batch", type=int, default=1024, help="local batch per rank")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--cr", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bad = [m for m in args.models if m not in FLATS + DMTS]
    if bad or not any(m in FLATS for m in args.models):
        ap.error(f"--models: unknown {bad}, or no flat baseline among {args.models}")
    if any(g < 0 for g in args.link_gbit):
        ap.error("--link-gbit: speeds must be >= 0")
    cfg = {"world": 4, "ranks_per_host": 2, "links_gbit": args.link_gbit, "link_latency_us": args.link_latency_us,
           "intra_ratio": args.intra_ratio, "models": args.models + (["sptt"] if args.full else []),
           "batch": args.batch, "dim": args.dim, "cr": args.cr, "max_rows": 100_000, "bottom": [128, 64],
           "top": [256, 128], "steps": 3 if args.quick else args.steps, "repeats": 3 if args.quick else args.repeats,
           "warmup": 1 if args.quick else 2, "full": args.full, "dense_optimizer": "adagrad",
           "sparse_optimizer": "rowwise_adagrad", "tables": "criteo-kaggle cardinalities capped at 100k, one-hot",
           "quantized_comm": {"flat_fp16": "pooled vectors fp16 forward, bf16 backward (TorchRec qcomms)",
                              "flat_int8": "pooled vectors row-wise int8 (+ fp32 scale, offset per row) forward, "
                                           "bf16 backward",
                              "dmt_fp16": "tower and peer all_to_alls fp16 forward, bf16 backward"}}
    from embedscale.train.launch import spawn_local

    load0 = os.getloadavg()
    log(f"bench_dmt: 4 ranks (2 hosts x 2), links {args.link_gbit} Gbit/s across hosts (intra-host "
        f"{args.intra_ratio}x), models {cfg['models']}; load {load0}")
    t0 = time.time()
    res = spawn_local(worker, 4, cfg, timeout_s=3600)
    wall = time.time() - t0
    per_link = summarise(res, cfg)
    head = next((str(g) for g in args.link_gbit if g == 0.25), str(args.link_gbit[0]))
    h = per_link[head]
    fl = flops(cfg)
    names = list(res[0]["traffic"])
    out = {
        "benchmark": "dmt_throughput",
        "figure": h["throughput"][h["best_dmt"]] if h["best_dmt"] else None,
        "baseline": h["throughput"][h["best_flat"]],
        "ratio": h["ratio_best_dmt_vs_best_flat"],
        "unit": f"samples/s at {head} Gbit/s (global batch / median step time, 4 ranks as 2 hosts x 2); "
                "baseline: the fastest flat variant",
        "per_link": per_link,
        "config": {**cfg, "traffic_per_step_rank0": res[0]["traffic"],
                   "cross_host_bytes_per_step_all_ranks": {n: sum(r["traffic"][n]["cross_bytes"] for r in res)
                                                           for n in names},
                   "flops_per_sample_train": fl, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                   "wall_s": round(wall, 1), "torch": torch.__version__,
                   "command": " ".join([".venv/bin/python", "benchmarks/bench_dmt.py"] + sys.argv[1:])},
    }
    print(json.dumps(out))
    for g, v in per_link.items():
        log(f"link {g} Gbit/s: " + ", ".join(f"{n} {ms:.1f} ms (p90 {v['step_ms_p90'][n]:.1f})"
                                             for n, ms in v["step_ms"].items()) +
            f"; best DMT ({v['best_dmt']}) vs best flat ({v['best_flat']}) {v['ratio_best_dmt_vs_best_flat']}x")


if __name__ == "__main__":
    main()
