"""Live row migration (``embedding.migrate``) against the re-shard through a checkpoint, on 2 local gloo ranks.

What a run that re-plans must do between two steps: move the rows (and row-wise Adagrad state) from plan P1
to plan P2. Ours: ``migrate(old, new)``, one all-to-all of the rows whose holder changes. Baseline, at its best:
the existing re-shard path without a process restart and on tmpfs (``/dev/shm``: no disk): every rank writes
its shard state in the one checkpoint format (``write_rank_file``), a barrier, every rank reads every rank file
(``read_shards``, ``table_pieces``) and keeps its P2 rows (``load_rows``). Both fill the same freshly built P2
module (its build is outside the timing: both need it); each repetition checks that both give the same bits.

Setup: 4 tables x ``--rows`` rows, dim 16, float32, row-wise Adagrad. P1: each table split in two contiguous
halves, its first 5% (the hot set) replicated on both ranks; P2: the drifted plan: 20% of every table's rows
change owner and the replicated hot set moves to another 5% of the rows. The figure is seconds per re-shard
(median and p90 over repetitions, the two methods interleaved, slowest rank); bytes are what each sends or reads
(ours: the transport's count; the baseline: the rank files' bytes every rank reads from the others). Prints one
JSON line with the load average.

    .venv/bin/python benchmarks/bench_migrate.py [--quick] [--rows 250000] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from embedscale.comm.collective import CollectiveTransport
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.migrate import migrate
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.specs import TableSpec
from embedscale.train.checkpoint import read_manifest, read_shards, table_pieces, write_manifest, write_rank_file
from embedscale.train.launch import spawn_local
from embedscale.train.run import table_entry

W, DIM, TABLES = 2, 16, 4


def tables(rows):
    return [TableSpec(f"t{i}", rows, DIM, features=[f"f{i}"]) for i in range(TABLES)]


def maps(rows):
    ts = tables(rows)
    hot = max(1, rows // 20)
    owner1 = [np.minimum(np.arange(rows) * W // rows, W - 1).astype(np.int8) for _ in ts]
    rng = np.random.default_rng(1)
    owner2 = []
    for o in owner1:
        o2 = o.copy()
        flip = rng.choice(rows, size=rows // 5, replace=False)
        o2[flip] = 1 - o2[flip]
        owner2.append(o2)
    rep1 = [np.arange(hot) for _ in ts]
    rep2 = [np.arange(rows // 2, rows // 2 + hot) for _ in ts]
    return AddressMap.build(ts, W, owner1, rep1), AddressMap.build(ts, W, owner2, rep2)


def reshard_by_checkpoint(old, new, rank, ckpt: Path) -> int:
    st = old.shard_state()
    gids, base = st["gids"].numpy(), old.amap.table_base
    entries = {}
    for t, spec in enumerate(old.tables):
        sel = torch.from_numpy(np.flatnonzero((gids >= base[t]) & (gids < base[t + 1])))
        entries[spec.name] = table_entry(st["weight"][sel], st["momentum"][sel], gids[sel.numpy()] - base[t])
    write_rank_file(ckpt, rank, {"rank": rank, "world_size": W, "tables": entries})
    dist.barrier()
    if rank == 0:
        write_manifest(ckpt, W, {"kind": "plan", "tables": [t.name for t in old.tables]})
    dist.barrier()
    m = read_manifest(ckpt)
    shards = read_shards(ckpt, m)
    g, ws, ms = [], [], []
    for t, spec in enumerate(new.tables):
        r, w, mo = table_pieces(shards, spec.name)
        g.append(r + base[t])
        ws.append(w)
        ms.append(mo)
    new.load_rows(np.concatenate(g), torch.cat(ws), torch.cat(ms))
    return sum((ckpt / name).stat().st_size for i, name in enumerate(m["shards"]) if i != rank)


def worker(rank, world, cfg):
    torch.set_num_threads(1)
    p1, p2 = maps(cfg["rows"])
    ts = tables(cfg["rows"])
    tr = CollectiveTransport()
    kw = dict(optimizer="rowwise_adagrad", lr=0.1)
    old = ShardedEmbedding(ts, p1, tr, rank, **kw)
    with torch.no_grad():  # rows and state that are not the initial ones (a replica's the same on every holder)
        old.weight.mul_(1.5).add_(0.25)
        old.momentum.copy_(torch.from_numpy(p1.storage_gids(rank)).float() * 1e-3)
    root = Path(cfg["root"])
    times = {"migrate": [], "checkpoint": []}
    sent = {"migrate": 0, "checkpoint": 0}
    same, moved = True, 0
    for rep in range(cfg["reps"]):
        got = {}
        for method in (("migrate", "checkpoint") if rep % 2 == 0 else ("checkpoint", "migrate")):
            new = ShardedEmbedding(ts, p2, tr, rank, **kw)
            dist.barrier()
            t0 = time.perf_counter()
            if method == "migrate":
                mig = migrate(old, new, release=False)
                b, moved = mig.bytes_sent, mig.rows_sent
            else:
                b = reshard_by_checkpoint(old, new, rank, root / f"rep{rep}")
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[method].append(float(t))
            sent[method] = b
            got[method] = (new.weight.clone(), new.momentum.clone())
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root / f"rep{rep}", ignore_errors=True)
        same &= all(torch.equal(a, b) for a, b in zip(got["migrate"], got["checkpoint"]))
    return {"times": times, "bytes": sent, "same": same, "rows_moved": moved,
            "storage_rows": int(old.weight.shape[0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=250_000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rows, reps = (20_000, 3) if args.quick else (args.rows, args.reps)
    root = tempfile.mkdtemp(prefix="bench-migrate-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        load0 = os.getloadavg()[0]
        res = spawn_local(worker, W, {"rows": rows, "reps": reps, "root": root}, timeout_s=1800)
        load1 = os.getloadavg()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t = res[0]["times"]
    fig = {m: {"median_s": float(np.median(v)), "p90_s": float(np.percentile(v, 90))} for m, v in t.items()}
    out = {"figure": "seconds per re-shard P1 -> P2 (slowest of 2 ranks)", "ours": fig["migrate"],
           "baseline": {"name": "checkpoint re-shard on tmpfs (write, barrier, read every rank file, load_rows)",
                        **fig["checkpoint"]},
           "ratio_median": fig["checkpoint"]["median_s"] / fig["migrate"]["median_s"],
           "bytes_per_rank": {"ours_sent": [r["bytes"]["migrate"] for r in res],
                              "baseline_read_from_peers": [r["bytes"]["checkpoint"] for r in res]},
           "rows_moved_per_rank": [r["rows_moved"] for r in res], "same_bits": all(r["same"] for r in res),
           "load_average": [round(load0, 2), round(load1, 2)],
           "config": {"world": W, "tables": TABLES, "rows_per_table": rows, "dim": DIM, "reps": reps,
                      "optimizer": "rowwise_adagrad", "threads_per_rank": 1,
                      "storage_rows_rank0": res[0]["storage_rows"]}}
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
