"""Eff-TT vs the TT-Rec reference: lookup, backward with fused update, index reordering (EL-Rec Figs. 17-18).

One table of ``--rows`` rows (10M), dims ``--dims`` (16 and 64), TT rank ``--rank`` (32), batch ``--batch``
(4096) one-hot ids drawn from a Zipf(``--alpha`` 1.2) law over the rows (finite-support inverse CDF,
popularity ranks scattered over the rows by a random permutation, as hashed ids are). Measured in the
same run, interleaved step by step in a fresh random order, each on the same batches:

* ``eff``: ``TTEmbeddingBag`` (batch-level reuse, in-advance aggregation, fused SGD update);
* ``ttrec``: ``TTRecEmbeddingBag`` (one chain per index, per-occurrence backward, dense aggregation,
  whole-core update), started from the same cores;
* ``eff_reordered``: ``eff`` on ids renamed by ``build_reorder`` (hot ratio ``--hot-ratio``; counts and
  co-occurrence graph from ``--profile-batches`` other batches of the same law);
* ``eff_ungrouped``: ablation, ``eff`` with ``grouped=False`` (one gathered core slice per distinct entry,
  Algorithm 1's batched GEMM as is): what reuse alone gives here;
* ``uncompressed``: ``LocalEmbeddingBags`` with fused SGD over the full ``rows x dim`` table.

The TT-Rec baseline at its best: it runs the same kernels as Eff-TT (``index_select``,
``bmm``, ``embedding_bag``), the same core layout, optimizer and thread count, its buffers as TT-Rec's design
needs them; what differs is TT-Rec's algorithm: one slice-product chain per occurrence (no batch-level
reuse), the chain recomputed in backward, per-occurrence core gradients summed into dense core-shaped
gradients before the update. Not modelled: TT-Rec's optional cache of the most frequent rows kept
uncompressed (TT-Rec section 4), which EL-Rec's comparison does not use either (EL-Rec VI: "the compressed
embedding table API of TT-Rec"). The ratios depend on the batch's reuse (distinct rows and prefixes per
batch, reported as ``reuse_levels_median``): Zipf 1.2 over 10M rows at batch 4096 repeats a lot.

Forward is timed without autograd; backward is ``loss.backward()`` after a forward with autograd (the
gradient aggregation and the fused update of the cores). Figures are medians over all timed steps.
Before timing, Eff-TT's output and one SGD step are checked against the TT-Rec reference.

Threads: ``--threads`` (default 1). On the shared 2-core machine the OpenMP barrier of every parallel
op stalls for a scheduler slice (~8 ms) whenever another process holds a core, which swamps these
millisecond kernels; one thread gives stable ratios. The JSON records threads and the load average.

    .venv/bin/python benchmarks/bench_tt.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from embedscale.data.profile import AccessProfile
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.tt import TTEmbeddingBag, TTRecEmbeddingBag
from embedscale.reorder import build_reorder
from embedscale.specs import TableSpec

RESULTS = Path(__file__).resolve().parent / "results" / "tt.md"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def zipf_ranks(rng: np.random.Generator, n_rows: int, alpha: float, n: int) -> np.ndarray:
    """Popularity ranks in [0, n_rows) with P(r) ~ (r + 1)^-alpha (midpoint-rule inverse CDF)."""
    t = 1.0 - alpha
    span = math.log(2 * n_rows + 1)
    u = rng.random(n)
    y = u * span if t == 0 else np.log1p(u * math.expm1(t * span)) / t
    return np.minimum(np.floor(0.5 * np.expm1(y)).astype(np.int64), n_rows - 1)


def run_dim(args, dim: int, rng: np.random.Generator, steps: int) -> dict:
    M, B = args.rows, args.batch
    row_of_rank = rng.permutation(M)
    timed = [torch.from_numpy(row_of_rank[zipf_ranks(rng, M, args.alpha, B)]) for _ in range(8)]
    profile_batches = [row_of_rank[zipf_ranks(rng, M, args.alpha, B)] for _ in range(args.profile_batches)]
    counts = np.bincount(np.concatenate(profile_batches), minlength=M)
    t0 = time.perf_counter()
    reo = build_reorder(AccessProfile({"t": counts}, len(profile_batches) * B), [TableSpec("t", M, dim)],
                        hot_ratio=args.hot_ratio, batches=[{"t": b} for b in profile_batches], progress=False)
    build_s = time.perf_counter() - t0
    log(f"dim {dim}: reordering built in {build_s:.1f} s: {reo.tables['t'].info}")
    reordered = [torch.from_numpy(reo.map("t")[b.numpy()]) for b in timed]
    offsets = torch.arange(B)

    eff = TTEmbeddingBag(M, dim, args.rank, optimizer="sgd", lr=args.lr, seed=args.seed, name="t")
    ref = TTRecEmbeddingBag(M, dim, args.rank, optimizer="sgd", lr=args.lr, name="t")
    ref.copy_cores_from(eff)
    # same start, same batch: outputs and one SGD step must agree
    g = torch.randn(B, dim) * 1e-3
    with torch.no_grad():
        scale = float(eff(timed[0], offsets).abs().max())
        diff_fwd = float((eff(timed[0], offsets) - ref(timed[0], offsets)).abs().max())
    (eff(timed[0], offsets) * g).sum().backward()
    (ref(timed[0], offsets) * g).sum().backward()
    diff_step = max(float((a - b).abs().max()) for a, b in zip(eff.cores, ref.cores))
    core_scale = max(float(c.abs().max()) for c in eff.cores)
    log(f"dim {dim}: |eff - ttrec| forward {diff_fwd:.2e} (of {scale:.2e}), cores after a step {diff_step:.2e} "
        f"(of {core_scale:.2e})")
    if diff_fwd > 1e-5 * max(1.0, scale) or diff_step > 1e-5 * max(1.0, core_scale):
        raise SystemExit(f"Eff-TT and TT-Rec disagree at dim {dim}")
    ungrouped = TTEmbeddingBag(M, dim, args.rank, optimizer="sgd", lr=args.lr, grouped=False, name="t")
    ungrouped.copy_cores_from(eff)
    reord = TTEmbeddingBag(M, dim, args.rank, optimizer="sgd", lr=args.lr, name="t")
    reord.copy_cores_from(eff)
    t0 = time.perf_counter()
    local = LocalEmbeddingBags([TableSpec("t", M, dim)], optimizer="sgd", lr=args.lr, seed=args.seed,
                               validate=False)
    log(f"dim {dim}: uncompressed table ({M * dim * 4 / 2**30:.2f} GiB) allocated in {time.perf_counter() - t0:.1f} s")
    jfs = [local_features(b) for b in timed]

    sizes = {"eff": [], "eff_reordered": []}

    def tt_method(m, batches, key=None):
        def fwd(i):
            with torch.no_grad():
                m(batches[i % 8], offsets)
            if key:
                sizes[key].append(m.last_sizes)

        def step(i):
            out = m(batches[i % 8], offsets)
            t = time.perf_counter()
            (out * g).sum().backward()
            return time.perf_counter() - t
        return fwd, step

    def local_fwd(i):
        with torch.no_grad():
            local(jfs[i % 8])

    def local_step(i):
        out = local(jfs[i % 8])
        t = time.perf_counter()
        (out * g).sum().backward()
        return time.perf_counter() - t

    methods = {"eff": tt_method(eff, timed, "eff"), "ttrec": tt_method(ref, timed),
               "eff_reordered": tt_method(reord, reordered, "eff_reordered"),
               "eff_ungrouped": tt_method(ungrouped, timed), "uncompressed": (local_fwd, local_step)}
    for fwd, step in methods.values():  # warm-up
        for i in range(2):
            fwd(i)
            step(i)
    fwd_t = {k: [] for k in methods}
    bwd_t = {k: [] for k in methods}
    step_t = {k: [] for k in methods}
    order = list(methods)
    shuffle = np.random.default_rng(args.seed + dim)
    for i in tqdm(range(steps), desc=f"dim {dim}", file=sys.stderr, leave=False):
        # a fresh random order every step: each method follows every other equally often (a method run
        # right after TT-Rec's large buffers or the uncompressed table's scattered writes meets other
        # cache and allocator states than one run after a small method)
        for name in shuffle.permutation(order):
            fwd, step = methods[name]
            t = time.perf_counter()
            fwd(i)
            fwd_t[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            b = step(i)
            step_t[name].append(time.perf_counter() - t)
            bwd_t[name].append(b)
    med = lambda d: {k: statistics.median(v) * 1e3 for k, v in d.items()}  # noqa: E731
    f, b, s = med(fwd_t), med(bwd_t), med(step_t)
    lv = lambda key: [round(float(x)) for x in np.median(np.array(sizes[key]), axis=0)]  # noqa: E731
    res = {
        "forward_ms": {k: round(v, 3) for k, v in f.items()},
        "backward_ms": {k: round(v, 3) for k, v in b.items()},
        "step_ms": {k: round(v, 3) for k, v in s.items()},
        "forward_speedup_vs_ttrec": round(f["ttrec"] / f["eff"], 3),
        "backward_speedup_vs_ttrec": round(b["ttrec"] / b["eff"], 3),
        "step_speedup_vs_ttrec": round(s["ttrec"] / s["eff"], 3),
        "reordering_forward_speedup": round(f["eff"] / f["eff_reordered"], 3),
        "reordering_backward_speedup": round(b["eff"] / b["eff_reordered"], 3),
        "reordering_step_speedup": round(s["eff"] / s["eff_reordered"], 3),
        "reuse_only_forward_speedup_vs_ttrec": round(f["ttrec"] / f["eff_ungrouped"], 3),
        "reuse_only_backward_speedup_vs_ttrec": round(b["ttrec"] / b["eff_ungrouped"], 3),
        "eff_step_time_over_uncompressed": round(s["eff"] / s["uncompressed"], 3),
        "eff_reordered_step_time_over_uncompressed": round(s["eff_reordered"] / s["uncompressed"], 3),
        "samples_per_s": {k: round(B / (v / 1e3)) for k, v in s.items()},
        "reuse_levels_median": {"eff": lv("eff"), "eff_reordered": lv("eff_reordered"),
                                "levels": "distinct i1, distinct (i1, i2) prefixes, distinct rows"},
        "core_bytes": eff.core_bytes, "uncompressed_bytes": M * dim * 4,
        "row_shape": eff.row_shape, "dim_shape": eff.dim_shape,
        "reorder_info": reo.tables["t"].info, "reorder_build_s": round(build_s, 1),
        "check_max_abs_diff": {"forward": diff_fwd, "one_sgd_step_cores": diff_step},
    }
    log(f"dim {dim}: " + json.dumps({k: v for k, v in res.items() if "speedup" in k or k.endswith("_ms")}))
    del local
    return res


def compression_figures(rank: int) -> dict:
    """EL-Rec Table III at ``rank``: tables over 1M rows as TT, total embedding bytes before and after."""
    from embedscale.embedding.compression import compression_report
    from embedscale.plan.forms import decide_forms
    from embedscale.specs import CRITEO_KAGGLE_ROWS, CRITEO_TERABYTE_ROWS

    out = {}
    for key, rows, dim, paper in (("criteo_kaggle_dim16", CRITEO_KAGGLE_ROWS, 16, 7.29),
                                  ("criteo_terabyte_dim64", CRITEO_TERABYTE_ROWS, 64, 74.19)):
        tables = [TableSpec(f"C{i + 1}", n, dim) for i, n in enumerate(rows)]
        # EL-Rec VI-A: the tables of more than 1M rows
        rep = compression_report(tables, decide_forms(tables, tt_min_rows=1_000_001, tt_rank=rank))
        out[key] = {"bytes_before": rep.bytes_before, "bytes_after": rep.bytes_after, "ratio": round(rep.ratio, 2),
                    "el_rec_table_iii": paper,
                    "tt_tables": sum(t.compression == "tt" for t in rep.tables)}
    return out


def local_features(ids: torch.Tensor):
    from embedscale.data.batch import JaggedFeatures

    return JaggedFeatures(["t"], ids, torch.ones(ids.numel(), dtype=torch.int64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2M rows, few steps (~1-2 min)")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--dims", type=str, default="16,64")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--alpha", type=float, default=1.2)
    ap.add_argument("--hot-ratio", type=float, default=0.01)
    ap.add_argument("--profile-batches", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="write the report to benchmarks/results/tt.md")
    ap.add_argument("--no-results", action="store_true", help="no report even with --record")
    args = ap.parse_args()
    args.rows = args.rows or (2_000_000 if args.quick else 10_000_000)
    args.profile_batches = args.profile_batches or (8 if args.quick else 32)
    steps = args.steps or (6 if args.quick else 40)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    load_start = os.getloadavg()
    dims = [int(d) for d in args.dims.split(",")]
    log(f"rows={args.rows:,} dims={dims} rank={args.rank} batch={args.batch} alpha={args.alpha} "
        f"threads={torch.get_num_threads()} load={load_start}")
    per_dim = {str(d): run_dim(args, d, rng, steps) for d in dims}
    first = per_dim[str(dims[0])]
    B = args.batch
    result = {
        "benchmark": "tt_eff_vs_ttrec",
        "figure": round(B / (first["forward_ms"]["eff"] / 1e3)),
        "baseline": round(B / (first["forward_ms"]["ttrec"] / 1e3)),
        "ratio": first["forward_speedup_vs_ttrec"],
        "unit": "samples/s (forward, first dim)",
        "bars": {d: {"forward_vs_ttrec": r["forward_speedup_vs_ttrec"],
                     "backward_with_update_vs_ttrec": r["backward_speedup_vs_ttrec"],
                     "reordering_forward": r["reordering_forward_speedup"],
                     "reordering_backward": r["reordering_backward_speedup"],
                     "reordering_step": r["reordering_step_speedup"],
                     "eff_step_time_over_uncompressed_fused_sgd": r["eff_step_time_over_uncompressed"]}
                 for d, r in per_dim.items()},
        "dims": per_dim,
        "compression_rank": compression_figures(args.rank),
        "baseline_name": "TTRecEmbeddingBag (TT-Rec: chain per index, per-occurrence backward)",
        "config": {"rows": args.rows, "dims": dims, "rank": args.rank, "batch": B, "zipf_alpha": args.alpha,
                   "hot_ratio": args.hot_ratio, "profile_batches": args.profile_batches, "steps": steps,
                   "optimizer": "sgd", "lr": args.lr, "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                   "statistic": "median per-step time, methods interleaved step by step in a random order"},
    }
    print(json.dumps(result))
    if args.record and not args.no_results:
        write_markdown(result, " ".join(["benchmarks/bench_tt.py"] + sys.argv[1:]))


def write_markdown(r: dict, command: str) -> None:
    from embedscale.io import atomic_write_text

    c = r["config"]
    lines = [f"### Eff-TT vs TT-Rec (EL-Rec Figs. 17-18), {c['rows']:,} rows, rank {c['rank']}, batch {c['batch']}, "
             f"Zipf {c['zipf_alpha']}",
             "",
             f"`.venv/bin/python {command}` — {c['threads']} thread(s), load average {c['loadavg_start'][0]:.1f} "
             f"at start, {c['loadavg_end'][0]:.1f} at end; medians of {c['steps']} steps, methods interleaved in a "
             "random order every step.",
             "",
             "| dim | forward vs TT-Rec | backward+update vs TT-Rec | reordering (fwd / bwd / step) | "
             "reuse only, no grouping (fwd / bwd) | Eff-TT step time / uncompressed fused SGD | cores vs table |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for d, x in r["dims"].items():
        lines.append(f"| {d} | {x['forward_speedup_vs_ttrec']:.2f}x | {x['backward_speedup_vs_ttrec']:.2f}x | "
                     f"{x['reordering_forward_speedup']:.2f}x / {x['reordering_backward_speedup']:.2f}x / "
                     f"{x['reordering_step_speedup']:.2f}x | {x['reuse_only_forward_speedup_vs_ttrec']:.2f}x / "
                     f"{x['reuse_only_backward_speedup_vs_ttrec']:.2f}x | {x['eff_step_time_over_uncompressed']:.2f} | "
                     f"{x['core_bytes'] / 2**20:.1f} MiB vs {x['uncompressed_bytes'] / 2**30:.2f} GiB |")
    lines += ["", "Milliseconds (median) per method:", "",
              "| dim | method | forward | backward | step |", "| ---: | --- | ---: | ---: | ---: |"]
    for d, x in r["dims"].items():
        for k in x["forward_ms"]:
            lines.append(f"| {d} | {k} | {x['forward_ms'][k]:.2f} | {x['backward_ms'][k]:.2f} | {x['step_ms'][k]:.2f} |")
    lines += ["", "Bars: forward >= 1.8x, backward with update >= 1.7x, reordering >= 1.05x (EL-Rec: 1.83x, 1.70x, "
              "1.05-1.06x).", "",
              f"Compression at rank {c['rank']} (tables over 1M rows as TT, `compression_report`; bars 7x and 70x):", "",
              "| tables | TT tables | bytes before | bytes after | ratio | EL-Rec Table III |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, x in r.get("compression_rank", {}).items():
        lines.append(f"| {key} | {x['tt_tables']} | {x['bytes_before'] / 2**30:.2f} GiB | "
                     f"{x['bytes_after'] / 2**20:.1f} MiB | {x['ratio']:.1f}x | {x['el_rec_table_iii']}x |")
    lines.append("")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(RESULTS, "\n".join(lines))


if __name__ == "__main__":
    main()
