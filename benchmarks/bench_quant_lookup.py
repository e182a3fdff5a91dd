"""The serving lookup straight from quantized rows: our fused CPU kernel against FBGEMM's CPU
``IntNBitTableBatchedEmbeddingBagsCodegen`` (the kernel behind TorchRec's quantized ``EmbeddingBagCollection``),
same run, same bytes, same ids, same output dtype (float32), interleaved.

Setup: the 26 criteo-kaggle tables (``--max-rows`` caps their rows; 0: full size, 33.8M rows), dim 16, INT8 and
INT4 row-wise (FBGEMM's fused rows: our tables are quantized once and the same scale, bias and values are
copied into FBGEMM's weights), one bag of ``--pooling`` ids per table and sample (1 and 16), batch ``--batch``
(4,096), sum pooling, ids drawn from a power law over each table's rows (exponent 1.05: a few hot rows, a long
tail). Before timing, both outputs are checked equal (to float32 rounding). Calls of the two alternate, the
order flipping every round, so that the load of a shared machine hits both alike; a figure is the median (and
p90) of a call's wall time over ``--rounds`` rounds. Threads: torch's default for both (at::parallel_for).

Prints one JSON line per (bits, pooling): figure = our median ms a lookup, baseline = FBGEMM's, ratio =
baseline / ours (above 1: ours faster), load average, config.

    .venv/bin/python benchmarks/bench_quant_lookup.py [--quick] [--max-rows N] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from embedscale.data.synthetic import PRESETS  # noqa: E402
from embedscale.embedding.kernels import quant_ops  # noqa: E402
from embedscale.serve.quantize import QPARAM_BYTES, pooled_lookup_many  # noqa: E402


def random_rows(rows: int, dim: int, bits: int, gen: torch.Generator) -> torch.Tensor:
    """Fused rows of random values with a valid fp16 scale and bias (what quantising random weights gives,
    without quantising 33.8M rows)."""
    data = torch.randint(0, 256, (rows, dim * bits // 8), dtype=torch.uint8, generator=gen)
    qp = torch.empty(rows, 2, dtype=torch.float16)
    qp[:, 0] = (torch.rand(rows, generator=gen) * 0.01 + 1e-3).to(torch.float16)
    qp[:, 1] = (torch.rand(rows, generator=gen) * 0.1 - 0.05).to(torch.float16)
    return torch.cat([data, qp.view(torch.uint8)], dim=1).contiguous()


def power_law_ids(rows: int, n: int, rng: np.random.Generator, exponent: float = 1.05) -> np.ndarray:
    """``n`` row ids with P(rank k) ~ k^-exponent over the table, hot ranks scattered over the rows."""
    u = rng.random(n)
    if rows == 1:
        return np.zeros(n, dtype=np.int64)
    a = 1.0 - exponent
    k = np.floor((u * (rows ** a - 1.0) + 1.0) ** (1.0 / a)).astype(np.int64) - 1  # inverse CDF of k^-s
    k = np.clip(k, 0, rows - 1)
    return (k * 2654435761) % rows  # hot ranks spread over the table, as hashed ids are


def fbgemm_module(row_counts: list[int], dim: int, bits: int):
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    weight_ty = SparseType.INT8 if bits == 8 else SparseType.INT4
    specs = [(f"t{i}", n, dim, weight_ty, EmbeddingLocation.HOST) for i, n in enumerate(row_counts)]
    return IntNBitTableBatchedEmbeddingBagsCodegen(specs, pooling_mode=PoolingMode.SUM, device="cpu",
                                                   output_dtype=SparseType.FP32)


def copy_into_fbgemm(module, tables: list[torch.Tensor], dim: int, bits: int) -> None:
    """Our fused rows (values, then scale and bias) into FBGEMM's split weights (its own row layout)."""
    module.initialize_weights()
    nbytes = dim * bits // 8
    for (w, sb), ours in zip(module.split_embedding_weights(split_scale_shifts=True), tables):
        w[:, :nbytes].copy_(ours[:, :nbytes])
        if sb is not None:
            sb.copy_(ours[:, nbytes:nbytes + QPARAM_BYTES])
        else:  # scale and bias inside the row, before the values
            raise SystemExit("FBGEMM returned no separate scale/bias view; this benchmark needs one")


def inputs(row_counts: list[int], batch: int, pooling: int, rng: np.random.Generator):
    ids = [torch.from_numpy(power_law_ids(n, batch * pooling, rng)) for n in row_counts]
    offsets = torch.arange(0, batch * pooling + 1, pooling, dtype=torch.int64)
    ours = [(t, ids[t], offsets, "sum", None) for t in range(len(row_counts))]
    flat_ids = torch.cat(ids)
    flat_offsets = torch.arange(0, len(row_counts) * batch * pooling + 1, pooling, dtype=torch.int64)
    return ours, flat_ids, flat_offsets


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def run_case(bits: int, pooling: int, row_counts: list[int], tables, module, args, rng) -> dict:
    form = "int8" if bits == 8 else "int4"
    spec = [(t, form, args.dim) for t in tables]
    feats, flat_ids, flat_offsets = inputs(row_counts, args.batch, pooling, rng)
    ours = lambda: pooled_lookup_many(spec, feats, args.batch)  # noqa: E731
    theirs = lambda: module(flat_ids, flat_offsets)  # noqa: E731
    a, b = ours(), theirs()
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(b.abs().max()))):
        raise SystemExit(f"{form} pooling {pooling}: outputs differ (max {float((a - b).abs().max()):.3g})")
    mine, base = [], []
    for r in range(args.rounds):
        pair = [(mine, ours), (base, theirs)]
        for sink, fn in (pair if r % 2 == 0 else pair[::-1]):
            sink.append(timed(fn, args.calls))
    med, p90 = float(np.median(mine)), float(np.percentile(mine, 90))
    bmed, bp90 = float(np.median(base)), float(np.percentile(base, 90))
    return {"benchmark": "quant_lookup", "figure": round(med, 4), "baseline": round(bmed, 4), "unit": "ms/lookup",
            "ratio": round(bmed / med, 3), "median": round(med, 4), "p90": round(p90, 4),
            "baseline_median": round(bmed, 4), "baseline_p90": round(bp90, 4),
            "load": [round(x, 2) for x in os.getloadavg()],
            "config": {"form": form, "pooling": pooling, "batch": args.batch, "dim": args.dim,
                       "tables": len(row_counts), "rows": int(sum(row_counts)), "rounds": args.rounds,
                       "calls": args.calls, "threads": torch.get_num_threads(), "output": "float32",
                       "ids": "power law 1.05"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-rows", type=int, default=0, help="cap every table's rows (0: full criteo-kaggle)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--poolings", default="1,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="100k-row tables, 5 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_rows, args.rounds = args.max_rows or 100_000, 5
    if quant_ops() is None:
        raise SystemExit("the fused quantized kernel is not built: python -m embedscale.embedding.kernels --build")
    row_counts = [int(r) if not args.max_rows else min(int(r), args.max_rows) for r in PRESETS["criteo-kaggle"]]
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    for bits in (8, 4):
        print(f"int{bits}: {sum(row_counts):,} rows ...", file=sys.stderr)
        tables = [random_rows(n, args.dim, bits, gen) for n in row_counts]
        module = fbgemm_module(row_counts, args.dim, bits)
        copy_into_fbgemm(module, tables, args.dim, bits)
        for pooling in (int(p) for p in args.poolings.split(",")):
            print(json.dumps(run_case(bits, pooling, row_counts, tables, module, args, rng)), flush=True)
        del tables, module
    return 0


if __name__ == "__main__":
    sys.exit(main())
