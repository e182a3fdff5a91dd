"""Managed ids against hashing, on a drifting stream with new ids: progressive AUC.

Input: a ``DriftingStream`` (``data.drift_stream``): two tables (``user``, ``item``) whose universe grows by
``--new-ids`` ids per step, a hot set rotating every ``--rotate`` steps, labels from the stream's teacher.
Both models get the same memory per table and see the same batches: the managed table ``--rows`` rows plus its
mapping (measured at its fullest, :func:`managed_bytes`), the hashed table as many rows as those bytes hold
(``--equal-rows``: the managed table's rows only, the mapping not counted):

* ours: a *managed* table (``model.managed``: ``admit_after`` k, ``lru``/``lfu``/``ttl``): raw ids admitted
  to rows after k sightings, the rows of stale ids taken back (``embedding.managed_lookup``);
* baseline at its best: the raw 64-bit ids hashed into the table (``id mod rows``; the stream's ids are
  already splitmix64-scattered, so this is a uniform hash), the way a fixed table takes a growing vocabulary.

With ``--nproc N`` both models train on N local ranks (gloo, ``row_wise`` plan, 1 thread each): the managed
mapping is then sharded over the ranks (``embedding.managed_lookup``: ids to their mapping shard's rank, rows
back), and the JSON adds the bytes of that exchange per training step, summed over the ranks
(``managed_exchange_bytes_per_step``, measured), beside those of the former replicated design (one
``all_gather`` of every rank's ids and per-feature counts, padded to the largest rank's, after one of the
sizes: ``(N - 1) x 8 x (1 + F + F x ceil(B / N))`` per rank for F managed features of one id per sample;
the formula its test asserted exactly, not re-run here).

The figure is the progressive AUC (``pv_auc``: every batch scored by the training forward before its update,
over the last ``--window`` samples) at the end of the run, and its mean over the logged windows of the
second half (a stream's learning is judged while it runs). Per seed both runs, alternating which goes first;
median and p90 over seeds of the figure and of the per-seed difference. The teacher's own AUC over the
same final window is the ceiling. Seconds per run are reported too (1 torch thread, ``--threads``). Prints
one JSON line with the load average and the bytes per table of both sides.

    .venv/bin/python benchmarks/bench_online_ids.py [--quick] [--seeds 3] [--steps 300] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from embedscale import workflow
from embedscale.data.drift_stream import DriftConfig, DriftingStream, write_drift_dataset
from embedscale.data.metrics import binary_metrics
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.embedding.managed import ManagedIdTable
from embedscale.specs import RunConfig, from_dict, to_dict
from embedscale.train.launch import spawn_local
from embedscale.train.metrics import MetricsLog


def _train_rank(rank, world, cfg_dict, run_dir):
    """One rank of an ``--nproc N`` run."""
    from embedscale.train.ranks import train_distributed

    torch.set_num_threads(1)
    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def write_hashed(stream: DriftingStream, directory: Path, steps: int, rows: int) -> None:
    """The same batches with every raw id hashed into ``rows`` rows (``id mod rows`` as unsigned 64-bit)."""
    cfg = stream.cfg
    sparse = [SparseFeatureInfo(t, rows) for t in cfg.tables]
    with ShardWriter(directory, [f"I{i + 1}" for i in range(cfg.num_dense)], sparse, shard_rows=1 << 20) as w:
        for s in range(steps):
            cols = stream.batch(s)
            w.write(cols.labels, cols.dense,
                    {t: (cols.sparse[t][0].view(np.uint64) % np.uint64(rows)).astype(np.int64) for t in cfg.tables})


def managed_bytes(rows: int, admit_after: int, policy: str, ttl: int, pending_capacity: int, shards: int = 16
                  ) -> int:
    """Bytes of one managed table's mapping at its fullest, measured: a ``ManagedIdTable`` of the run's settings
    fed distinct ids until every row is taken and the pending ids are at capacity, then every tensor it holds
    (row ids, flags, last steps, counts, shard and global row maps, the sorted index, the pending ids with their
    counts, last steps and shards) summed."""
    t = ManagedIdTable("m", rows, admit_after=admit_after, policy=policy, ttl=ttl or None,
                       pending_capacity=pending_capacity or None, device="cpu", shards=min(shards, rows - 1))
    rng = np.random.default_rng(0)
    for _ in range(4):  # admit_after sightings of a full table's ids, then a pending capacity's worth more
        ids = torch.from_numpy(rng.integers(0, 2**62, t.num_rows + t.pending_capacity))
        for _ in range(admit_after):
            t.assign(ids[: t.num_rows])
        t.assign(ids[t.num_rows:])
    return int(sum(v.nbytes for v in vars(t).values() if isinstance(v, torch.Tensor)))


def equal_memory_rows(rows: int, dim: int, mapping_bytes: int) -> int:
    """The hashed table's rows at the managed table's total bytes: its own ``rows`` plus the mapping's bytes in
    rows of ``dim`` float32 weights and one float32 of row-wise Adagrad state."""
    return rows + mapping_bytes // (4 * dim + 4)


def teacher_auc(stream: DriftingStream, steps: int, window: int) -> float:
    """The teacher's AUC over the last ``window`` samples (its probabilities as scores)."""
    ys, zs = [], []
    B = stream.cfg.batch_size
    for s in range(steps - max(1, window // B), steps):
        cols, p = stream.batch_with_probability(s)
        ys.append(cols.labels.astype(np.float64))
        zs.append(np.log(p / (1 - p)))
    return binary_metrics(np.concatenate(ys), np.concatenate(zs))["auc"]


def run(directory: Path, out: Path, args, managed: dict) -> dict:
    cfg = from_dict(RunConfig, {
        "name": "online", "out_dir": str(out),
        "data": {"source": "shards", "path": str(directory), "eval_fraction": 0.0},
        "model": {"embedding_dim": args.dim, "bottom_mlp": [32, args.dim], "top_mlp": [64, 32], "managed": managed},
        "train": {"batch_size": args.batch, "log_every": args.log_every, "progressive_window": args.window,
                  "lr_sparse": args.lr_sparse, "lr_dense": 0.01, "lr_warmup_steps": 20, "dropout": 0.0,
                  "eval_every": 0, "prefetch": 2},
        "dist": {"plan": "row_wise", "nproc": args.nproc, "timeout_s": 1800},
    })
    t0 = time.perf_counter()
    if args.nproc > 1:
        spawn_local(_train_rank, args.nproc, to_dict(cfg), str(out), timeout_s=7200)
        s = json.loads((out / "summary.json").read_text())
    else:
        s = workflow.train(cfg, out, resume=False, progress=False)
    secs = time.perf_counter() - t0
    rows = [r for r in MetricsLog(out).read() if np.isfinite(getattr(r, "pv_auc", np.nan))]
    half = [r.pv_auc for r in rows if r.step > args.steps // 2]
    return {"final": s["progressive"]["auc"], "second_half_mean": float(np.mean(half)), "seconds": secs,
            "managed": s.get("managed", {}), "exchange_bytes_per_step": s.get("managed_exchange_bytes_per_step"),
            "exchange_bytes": s.get("managed_exchange_bytes")}


def former_gather_bytes(world: int, batch: int, features: int) -> int:
    """Bytes per step, summed over the ranks, of the former replicated mapping's id exchange
    (``grad_sync.all_gather_var`` of ``[count per feature, ids...]``: the sizes, ``(W - 1) x 8`` per rank, then
    the payload padded to the largest rank's, ``(W - 1) x 8 x (F + F x largest slice)``)."""
    if world <= 1:
        return 0
    top = max((batch * (r + 1)) // world - (batch * r) // world for r in range(world))
    return world * (world - 1) * 8 * (1 + features + features * top)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small run (CI-sized)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4096, help="rows per table, both models")
    ap.add_argument("--initial-ids", type=int, default=20_000)
    ap.add_argument("--new-ids", type=int, default=64, help="new ids per table per step")
    ap.add_argument("--hot-ids", type=int, default=2_000)
    ap.add_argument("--rotate", type=int, default=50)
    ap.add_argument("--window", type=int, default=25_600)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr-sparse", type=float, default=0.05)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--admit-after", type=int, default=2)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--ttl", type=int, default=0)
    ap.add_argument("--pending-capacity", type=int, default=0, help="managed: pending ids kept (0: 4 x rows)")
    ap.add_argument("--equal-rows", action="store_true",
                    help="give the hashed table the managed table's rows only (the mapping's memory not counted)")
    ap.add_argument("--nproc", type=int, default=1, help="local ranks (gloo) of both models")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both models (1: robust under "
                    "load; the mapping's small tensor ops slow down 20-40x with 2 contended threads)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.seeds, args.steps, args.window = 1, 60, 10_240
    dcfg = DriftConfig(tables=("user", "item"), initial_ids=args.initial_ids, new_ids_per_step=args.new_ids,
                       hot_ids=args.hot_ids, hot_share=0.8, rotate_every=args.rotate, batch_size=args.batch,
                       num_dense=4)
    managed = {"admit_after": args.admit_after, "policy": args.policy, **({"ttl": args.ttl} if args.ttl else {}),
               **({"pending_capacity": args.pending_capacity} if args.pending_capacity else {})}
    mapping = managed_bytes(args.rows, args.admit_after, args.policy, args.ttl, args.pending_capacity)
    hashed_rows = args.rows if args.equal_rows else equal_memory_rows(args.rows, args.dim, mapping)
    print(f"managed: {args.rows} rows + {mapping:,} bytes of mapping a table; hashed: {hashed_rows} rows",
          file=sys.stderr)
    res = {"managed": [], "hashed": [], "teacher": []}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_online_ids-") as tmp:
        tmp = Path(tmp)
        for seed in range(args.seeds):
            stream = DriftingStream(dcfg, seed=seed)
            raw, hashed = tmp / f"raw-{seed}", tmp / f"hashed-{seed}"
            write_drift_dataset(stream, raw, args.steps, num_rows=args.rows)
            write_hashed(stream, hashed, args.steps, hashed_rows)
            order = [("managed", raw, managed), ("hashed", hashed, {})]
            for name, d, m in (order if seed % 2 == 0 else order[::-1]):  # interleaved: alternate who goes first
                res[name].append(run(d, tmp / f"{name}-{seed}", args, m))
                print(f"seed {seed} {name}: {res[name][-1]}", file=sys.stderr, flush=True)
            res["teacher"].append(teacher_auc(stream, args.steps, args.window))
    load1 = os.getloadavg()[0]
    fig = [r["final"] for r in res["managed"]]
    base = [r["final"] for r in res["hashed"]]
    diff = [a - b for a, b in zip(fig, base)]
    half_m = [r["second_half_mean"] for r in res["managed"]]
    half_h = [r["second_half_mean"] for r in res["hashed"]]
    out = {
        "benchmark": "online_ids", "figure": "progressive AUC at the end (managed ids)",
        "value": float(np.median(fig)), "baseline": float(np.median(base)),
        "ratio": float(np.median(fig) / np.median(base)),
        "median_diff": float(np.median(diff)), "p90_diff": float(np.percentile(diff, 90)),
        "min_diff": float(np.min(diff)),
        "p90": {"managed": float(np.percentile(fig, 90)), "hashed": float(np.percentile(base, 90))},
        "second_half_mean_pv_auc": {"managed": float(np.median(half_m)), "hashed": float(np.median(half_h))},
        "teacher_auc": float(np.median(res["teacher"])),
        "seconds_per_run": {"managed": float(np.median([r["seconds"] for r in res["managed"]])),
                            "hashed": float(np.median([r["seconds"] for r in res["hashed"]]))},
        "managed_counters": res["managed"][0]["managed"],
        "nproc": args.nproc,
        "memory": {"managed_rows": args.rows, "managed_mapping_bytes_per_table": mapping,
                   "hashed_rows": hashed_rows, "equal_total_bytes": not args.equal_rows,
                   "bytes_per_table": {"managed": args.rows * (4 * args.dim + 4) + mapping,
                                       "hashed": hashed_rows * (4 * args.dim + 4)}},
        "managed_exchange_bytes_per_step": res["managed"][0]["exchange_bytes_per_step"],
        "managed_exchange_bytes": res["managed"][0]["exchange_bytes"],
        "former_all_gather_bytes_per_step": former_gather_bytes(args.nproc, args.batch, len(dcfg.tables)),
        "per_seed": {"managed": fig, "hashed": base},
        "load_average": [round(load0, 2), round(load1, 2)],
        "config": {**vars(args), "drift": {k: v for k, v in vars(dcfg).items()}, "managed": managed},
    }
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
