"""Live row migration (``embedding.migrate``): in place, against rebuilding the module and against the re-shard
through a checkpoint, on 2 local gloo ranks.

What a run that re-plans must do between two steps: move the rows (and row-wise Adagrad state) from plan P1
to plan P2. Ours: ``migrate_in_place(module, placement)`` (what ``train.replan`` runs): the running map edited,
the routes from the rows whose place changes, one all-to-all of the rows whose holder changes, only those and
the rows that change place locally written into the running storage. Baselines, each timed with everything it
needs from P2's placement arrays on:

* ``rebuild``: the previous version: P2's address map built (``AddressMap.build``), the P2 module built
  (storage allocated and initialised), ``migrate(old, new)`` (routes from both whole maps, every kept row
  copied);
* ``checkpoint``: the re-shard path without a process restart and on tmpfs (``/dev/shm``: no disk): P2's map
  and module built, every rank writes its shard state in the one checkpoint format (``write_rank_file``), a
  barrier, every rank reads every rank file (``read_shards``, ``table_pieces``) and keeps its P2 rows
  (``load_rows``).

``--transport pgas``: the same on the one-sided transport, ``PgasShardedEmbedding`` modules (storage in a
symmetric heap), the running one built with the room a run that re-plans gives it (``storage_spare`` 0.25,
``train.replan.PGAS_REPLAN_SPARE``) so that ours moves in place inside the heap; the baselines build the P2
module and its heap.

Each repetition starts the three from the same P1 module state (built and given a lookup, untimed: a running
module has its pooling table's spare rows) and checks that all three give the same rows and state by global id.

Setup: 4 tables x ``--rows`` rows, dim 16, float32, row-wise Adagrad. P1: each table split in two contiguous
halves, its first 5% (the hot set) replicated on both ranks. P2 (default, the bulk move): 20% of every table's
rows change owner and the replicated hot set moves to another 5% of the rows. ``--moves N``: the online
re-plan's size instead: N rows of every table change owner and the hot set shifts by N rows (N replicas
dropped, N added per table). The figure is seconds per re-shard (median and p90 over repetitions, the methods
interleaved in a rotating order, slowest rank); bytes are what each sends or reads. Prints one JSON line with
the load average.

    .venv/bin/python benchmarks/bench_migrate.py [--quick] [--rows 250000] [--reps 7] [--moves 8] [--transport pgas]
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
from embedscale.comm.pgas import PgasTransport
from embedscale.embedding.address_map import AddressMap
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.migrate import Placement, migrate, migrate_in_place
from embedscale.embedding.pgas_lookup import PgasShardedEmbedding
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.specs import TableSpec
from embedscale.train.checkpoint import read_manifest, read_shards, table_pieces, write_manifest, write_rank_file
from embedscale.train.launch import spawn_local
from embedscale.train.replan import PGAS_REPLAN_SPARE
from embedscale.train.run import table_entry

W, DIM, TABLES = 2, 16, 4


def tables(rows):
    return [TableSpec(f"t{i}", rows, DIM, features=[f"f{i}"]) for i in range(TABLES)]


def placements(rows, moves=None):
    """P1's and P2's ``AddressMap.build`` arguments: ``(owners, replicas)`` each (module docstring)."""
    ts = tables(rows)
    hot = max(1, rows // 20)
    owner1 = [np.minimum(np.arange(rows) * W // rows, W - 1).astype(np.int8) for _ in ts]
    rng = np.random.default_rng(1)
    owner2 = []
    for o in owner1:
        o2 = o.copy()
        flip = rng.choice(rows, size=rows // 5 if moves is None else moves, replace=False)
        o2[flip] = 1 - o2[flip]
        owner2.append(o2)
    rep1 = [np.arange(hot) for _ in ts]
    rep2 = [np.arange(rows // 2, rows // 2 + hot) if moves is None else np.arange(moves, hot + moves) for _ in ts]
    return (owner1, rep1), (owner2, rep2)


def by_gid(emb, rank):
    gids = emb.amap.storage_gids(rank)
    idx = np.flatnonzero(gids >= 0)
    idx = torch.from_numpy(idx[np.argsort(gids[idx], kind="stable")])
    return emb.weight[idx].clone(), emb.momentum[idx].clone()


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
    (o1, r1), (o2, r2) = placements(cfg["rows"], cfg["moves"])
    ts = tables(cfg["rows"])
    p1 = AddressMap.build(ts, W, o1, r1)
    pgas = cfg.get("transport") == "pgas"
    tr = PgasTransport(job_id=cfg["job"]) if pgas else CollectiveTransport()
    kw = dict(optimizer="rowwise_adagrad", lr=0.1)

    def module(amap, spare=0.0):
        if pgas:
            return PgasShardedEmbedding(ts, amap, tr, rank, max_batch_size=8, storage_spare=spare, **kw)
        return ShardedEmbedding(ts, amap, tr, rank, **kw)
    batch = JaggedFeatures([f"f{i}" for i in range(TABLES)], torch.arange(TABLES * 4) % 7,
                           torch.ones(TABLES * 4, dtype=torch.int64))

    def running():  # the P1 module as a run has it: rows and state not the initial ones, its pooling table made
        m = module(p1, PGAS_REPLAN_SPARE)
        with torch.no_grad():
            m(batch)
            m.weight.mul_(1.5).add_(0.25)  # (a replica's the same on every holder)
            m.momentum.copy_(torch.from_numpy(p1.storage_gids(rank)).float() * 1e-3)
        return m

    root = Path(cfg["root"])
    methods = ["in_place", "rebuild", "checkpoint"]
    times = {m: [] for m in methods}
    sent = {m: 0 for m in methods}
    same, moved, written, grew = True, 0, 0, False
    for rep in range(cfg["reps"]):
        got = {}
        for method in methods[rep % 3:] + methods[:rep % 3]:
            old = running()
            dist.barrier()
            t0 = time.perf_counter()
            if method == "in_place":
                mig = migrate_in_place(old, Placement.of_arrays(ts, W, o2, r2))
                new, b, moved, written, grew = old, mig.bytes_sent, mig.rows_sent, mig.rows_written, mig.storage_grew
            else:
                new = module(AddressMap.build(ts, W, o2, r2))
                if method == "rebuild":
                    b = migrate(old, new, release=False).bytes_sent
                else:
                    b = reshard_by_checkpoint(old, new, rank, root / f"rep{rep}")
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[method].append(float(t))
            sent[method] = b
            got[method] = by_gid(new, rank)
            dist.barrier()
            for m in {id(old): old, id(new): new}.values():  # PGAS: release the heaps of this repetition
                if hasattr(m, "close"):
                    m.close()
            if rank == 0:
                shutil.rmtree(root / f"rep{rep}", ignore_errors=True)
        same &= all(torch.equal(a, b) for m in methods[1:] for a, b in zip(got["in_place"], got[m]))
    return {"times": times, "bytes": sent, "same": same, "rows_moved": moved, "rows_written": written,
            "storage_grew": grew, "storage_rows": int(p1.storage_rows(rank))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=250_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--moves", type=int, default=None,
                    help="rows per table that change owner (and replicas shifted by as many); default 20%%")
    ap.add_argument("--transport", choices=("collective", "pgas"), default="collective")
    args = ap.parse_args()
    rows, reps = (20_000, 3) if args.quick else (args.rows, args.reps)
    root = tempfile.mkdtemp(prefix="bench-migrate-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        load0 = os.getloadavg()[0]
        res = spawn_local(worker, W, {"rows": rows, "reps": reps, "root": root, "moves": args.moves,
                                      "transport": args.transport, "job": f"bm{os.getpid()}"}, timeout_s=3600)
        load1 = os.getloadavg()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t = res[0]["times"]
    fig = {m: {"median_s": float(np.median(v)), "p90_s": float(np.percentile(v, 90))} for m, v in t.items()}
    out = {"figure": "seconds per re-shard P1 -> P2 (slowest of 2 ranks)", "ours": {"name": "migrate_in_place",
                                                                                  **fig["in_place"]},
           "baseline": {"name": "rebuild: P2 map and module built, migrate(old, new)", **fig["rebuild"]},
           "baseline_checkpoint": {"name": "P2 map and module built, checkpoint re-shard on tmpfs (write, barrier, "
                                           "read every rank file, load_rows)", **fig["checkpoint"]},
           "ratio_median": fig["rebuild"]["median_s"] / fig["in_place"]["median_s"],
           "ratio_median_checkpoint": fig["checkpoint"]["median_s"] / fig["in_place"]["median_s"],
           "bytes_per_rank": {"ours_sent": [r["bytes"]["in_place"] for r in res],
                              "rebuild_sent": [r["bytes"]["rebuild"] for r in res],
                              "checkpoint_read_from_peers": [r["bytes"]["checkpoint"] for r in res]},
           "rows_moved_per_rank": [r["rows_moved"] for r in res],
           "rows_written_per_rank": [r["rows_written"] for r in res],
           "storage_grew": [r["storage_grew"] for r in res], "same_bits": all(r["same"] for r in res),
           "load_average": [round(load0, 2), round(load1, 2)],
           "config": {"world": W, "transport": args.transport, "tables": TABLES, "rows_per_table": rows, "dim": DIM, "reps": reps,
                      "moves_per_table": args.moves if args.moves is not None else rows // 5,
                      "optimizer": "rowwise_adagrad", "threads_per_rank": 1,
                      "storage_rows_per_rank": [r["storage_rows"] for r in res]}}
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
