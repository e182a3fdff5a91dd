"""Row groups: a TT table whose hottest rows are exact against the same table all TT, one process.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/bench_tt_rowgroups.py [--rows 10000000] [--batch 1024]
        [--rank 8] [--shares 0.5,0.8] [--repeats 15]

Both sides run the same Eff-TT kernel (``TTEmbeddingBag``, row-wise Adagrad cores) on the same Zipf batches
(alpha 1.1 over the rows in frequency order: the frequency reordering a plan carries for both, EL-Rec IV); the
row-group side (``HybridTTEmbeddingBag``) keeps the hottest rows taking ``share`` of the lookups exact (row-wise
Adagrad rows) and the rest TT. One training step = lookup + backward + fused update, ``--batch`` ids of one
feature, one thread; the sides are interleaved step by step. Also reported: a TT table of all rows on the ids
in a random permutation (no reordering), the calibration's setting. Prints one JSON line per share: figure =
row-group step, baseline = whole-TT step, ratio = figure / baseline (< 1: row groups faster; ``speedup`` its
inverse), median and p90,
the hot rows, their share of the lookups and of the batch's distinct rows, the load.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from _plan_common import emit, log
from embedscale.embedding.hybrid import HybridTTEmbeddingBag
from embedscale.embedding.tt import TTEmbeddingBag


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--shares", default="0.5,0.8")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    n = args.rows
    w = np.arange(1, n + 1, dtype=np.float64) ** -args.alpha
    w /= w.sum()
    freq = [rng.choice(n, size=args.batch, p=w) for _ in range(args.batches)]  # ids in frequency order
    perm = rng.permutation(n)
    cum = np.cumsum(w)
    offsets = torch.arange(args.batch)
    kw = dict(optimizer="rowwise_adagrad", lr=0.01, seed=0, validate=False)
    load0 = os.getloadavg()
    for share in (float(x) for x in args.shares.split(",")):
        hot = int(np.searchsorted(cum, share) + 1)
        sides = {
            "row_groups": (HybridTTEmbeddingBag(n, args.dim, args.rank, hot_rows=hot, include_last_offset=False,
                                                optimizer="rowwise_adagrad", lr=0.01, tt_optimizer="rowwise_adagrad",
                                                tt_lr=0.01, seed=0, validate=False), freq),
            "whole_tt": (TTEmbeddingBag(n, args.dim, args.rank, **kw), freq),
            "whole_tt_unordered": (TTEmbeddingBag(n, args.dim, args.rank, **kw), [perm[b] for b in freq]),
        }
        times: dict[str, list[float]] = {k: [] for k in sides}
        for rep in range(args.repeats):
            for i in range(args.batches):
                for k, (m, batches) in sides.items():
                    ids = torch.from_numpy(batches[i])
                    t = time.perf_counter()
                    m(ids, offsets).sum().backward()
                    if rep:  # the first pass warms up
                        times[k].append(time.perf_counter() - t)
        med = {k: float(np.median(v)) for k, v in times.items()}
        p90 = {k: float(np.percentile(v, 90)) for k, v in times.items()}
        lookups_share = float(np.mean([np.mean(b < hot) for b in freq]))
        distinct_share = float(np.mean([np.mean(np.unique(b) < hot) for b in freq]))
        log(f"share {share}: {hot} hot rows ({lookups_share:.2f} of lookups, {distinct_share:.3f} of distinct rows); "
            + ", ".join(f"{k} {med[k] * 1e3:.2f} ms (p90 {p90[k] * 1e3:.2f})" for k in sides))
        emit("tt_rowgroups_step", med["row_groups"], med["whole_tt"], "s per training step of one table (median)",
             {"rows": n, "dim": args.dim, "batch": args.batch, "rank": args.rank, "alpha": args.alpha,
              "share": share, "batches": args.batches, "repeats": args.repeats, "threads": 1},
             speedup=med["whole_tt"] / med["row_groups"], median=med, p90=p90, hot_rows=hot,
             hot_lookup_share=lookups_share, hot_distinct_share=distinct_share,
             whole_tt_unordered_over_reordered=med["whole_tt_unordered"] / med["whole_tt"],
             load=[load0, os.getloadavg()])


if __name__ == "__main__":
    main()
