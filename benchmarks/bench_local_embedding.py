"""Embedding training step: LocalEmbeddingBags (fused optimizer) vs FBGEMM's CPU TBE, at every pooling factor.

One step = forward + backward + sparse update of 26 tables with the Criteo Kaggle cardinalities
(``specs.CRITEO_KAGGLE_ROWS``) capped at ``--max-rows``, ``--dim`` 16, batch ``--batch`` 4096; every bag holds
``L`` ids (``--pooling`` 1, 4, 16, 64: ids per sample and feature) drawn from Zipf(``--alpha`` 1.2) over each
table's rows (inverse CDF; popularity ranks permuted per table); loss = sum(outputs * fixed random tensor).
One case per pooling factor x pooling mode (``--modes`` sum, mean) x optimizer (``--optimizers`` sgd,
rowwise_adagrad). Measured in the same run, same threads (``--threads``, default 2), same weights:

* ours: ``LocalEmbeddingBags(optimizer=...)`` (one flat storage, one fused lookup, update in backward),
  input validation on (the default);
* fbgemm: ``fbgemm_gpu``'s ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU (``EmbeddingLocation.HOST``,
  ``ComputeDevice.CPU``) with ``OptimType.EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD`` (same lr and eps) and
  ``PoolingMode.SUM`` / ``MEAN``, given preallocated ``indices``/``offsets`` (its best form: no input
  conversion in the timed step);
* ours_pytorch: the same module with ``cpu_kernel=False`` (the pure PyTorch path), timed too when the fused
  C++ kernel (``embedding/kernels.cpp``) is built, so ours (which then uses it) is compared with both;
* ``--per-table`` adds 26 ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SGD`` (SGD cases only).

Agreement, never a reason to refuse to measure: after one step from the same weights, each method's pooled
output and updated rows are compared with a float64 reference computed from the float32 weights; the
allowed error of each value is derived from the number of float32 terms summed into it (``(terms + 2) *
2**-24 * sum of |terms|``, times 4 for slack, plus the rounding of the stored result). ``agree`` and the
largest error/bound ratio are reported per method.

Methods are timed step by step, interleaved (``--steps`` steps each, order rotating); each figure is
batch / median step time; ``p90`` is batch / 90th-percentile step time and ``spread`` = p90 / median step
time; ``ratio_cpu_time`` is the same ratio of median process CPU times (all threads; less sensitive to a
loaded machine's scheduling, blind to threads waiting on each other); ``ratio_over_pytorch_path`` is
ours_pytorch's median step time over ours'. Prints one JSON line per case on stdout (figure, baseline,
ratio, median and p90 per method, load average at the case's start and end, config); progress goes to
stderr.

    .venv/bin/python benchmarks/bench_local_embedding.py [--quick] [--pooling 4 16] [--optimizers sgd]
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
import torch.nn as nn

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.specs import CRITEO_KAGGLE_ROWS, TableSpec

U32 = 2.0**-24  # unit roundoff of float32


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def zipf_ids(rng: np.random.Generator, num_rows: int, alpha: float, n: int) -> np.ndarray:
    """``n`` row ids with P(rank k) ~ k^-alpha (inverse CDF), ranks permuted over the rows."""
    cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), num_rows - 1)
    return rng.permutation(num_rows)[ranks].astype(np.int64)


class PerTable(nn.Module):
    def __init__(self, rows: list[int], dim: int, mode: str) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode=mode, sparse=True) for n in rows)
        self.batch = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T, B * L]: L ids per sample
        B = self.batch
        return torch.cat([bag(ids[t].view(B, -1)) for t, bag in enumerate(self.bags)], dim=1)


def reference_step(w0: list[torch.Tensor], ids: torch.Tensor, grad_out: torch.Tensor, L: int, mode: str,
                   optimizer: str, lr: float, eps: float) -> dict:
    """Float64 forward and update of one step, per table, on the rows the batch touches; with the
    error bound of a float32 computation of each value (see the module docstring)."""
    T, D = len(w0), w0[0].shape[1]
    B = grad_out.shape[0]
    outs, bounds, tables = [], [], []
    for t in range(T):
        idx = ids[t].view(B, L)
        uniq, inv = torch.unique(idx, return_inverse=True)
        w = w0[t].index_select(0, uniq).double()  # [u, D]
        terms = w[inv]  # [B, L, D]
        s = 1.0 / L if mode == "mean" else 1.0
        out = terms.sum(1) * s
        outs.append(out)
        bounds.append(4 * (L + 2) * U32 * terms.abs().sum(1) * s + U32 * out.abs())
        g = grad_out[:, t * D:(t + 1) * D].double() * s  # d loss / d row, per looked-up value
        gv = g.repeat_interleave(L, 0)  # [B * L, D]
        G = torch.zeros_like(w).index_add_(0, inv.reshape(-1), gv)
        S = torch.zeros_like(w).index_add_(0, inv.reshape(-1), gv.abs())
        c = torch.bincount(inv.reshape(-1), minlength=uniq.numel()).double().unsqueeze(1)
        if optimizer == "sgd":
            new = w - lr * G
            err = 4 * (c + 2) * U32 * lr * S
        else:
            m = G.pow(2).mean(1, keepdim=True)  # state starts at 0
            den = m.sqrt() + eps
            new = w - lr * G / den
            # error of G (relative (c + 2) u S / |G|) enters numerator and, through m, the denominator
            err = 4 * (c + 2) * U32 * lr * (S + S.abs().amax(1, keepdim=True) * G.abs() / den) / den
        tables.append((uniq, new, err + 2 * U32 * (new.abs() + w.abs())))
    return {"out": torch.cat(outs, 1), "out_bound": torch.cat(bounds, 1), "tables": tables}


def agreement(ref: dict, out: torch.Tensor, rows_after: list[torch.Tensor]) -> dict:
    """Largest |error| / bound over the pooled output and the updated rows (<= 1: agrees)."""
    r_out = float(((out.double() - ref["out"]).abs() / ref["out_bound"].clamp(min=1e-30)).max())
    r_rows = 0.0
    for (uniq, new, bound), got in zip(ref["tables"], rows_after):
        r_rows = max(r_rows, float(((got.index_select(0, uniq).double() - new).abs() / bound.clamp(min=1e-30)).max()))
    worst = max(r_out, r_rows)
    return {"agree": worst <= 1.0, "max_err_over_bound": round(worst, 4), "output": round(r_out, 4),
            "updated_rows": round(r_rows, 4)}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_case(args, rows: list[int], L: int, mode: str, optimizer: str, tbe_mod) -> dict:
    B, D, T = args.batch, args.dim, len(rows)
    load_start = os.getloadavg()
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    num_batches = max(2, min(8, 2**24 // (T * B * L)))
    ids = np.stack([zipf_ids(rng, n, args.alpha, num_batches * B * L) for n in rows])  # [T, nb * B * L]
    batches = [torch.from_numpy(np.ascontiguousarray(ids[:, i * B * L:(i + 1) * B * L])) for i in range(num_batches)]
    del ids
    names = [f"C{t + 1}" for t in range(T)]
    lengths = torch.full((T * B,), L, dtype=torch.int64)
    jfs = [JaggedFeatures(names, b.reshape(-1), lengths) for b in batches]
    flat = [b.reshape(-1) for b in batches]
    offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
    grad_out = torch.randn(B, T * D)
    unique = float(np.mean([len(np.unique(b[t].numpy())) for b in batches for t in range(T)]))

    ours = LocalEmbeddingBags([TableSpec(n_, n, D, pooling=mode) for n_, n in zip(names, rows)],
                              optimizer=optimizer, lr=args.lr, eps=args.eps, seed=args.seed)
    w0 = [ours.table_weight(n_).clone() for n_ in names]
    methods = {}

    def step_ours(i: int) -> torch.Tensor:
        out = ours(jfs[i % num_batches])
        (out * grad_out).sum().backward()
        return out

    methods["ours"] = step_ours
    rows_of = {"ours": lambda: [ours.table_weight(n_) for n_ in names]}
    kernel = ours.uses_cpu_kernel
    if kernel and not args.no_pytorch_path:
        # the same module without the C++ kernel: the pure PyTorch path, from the same weights
        ours_pt = LocalEmbeddingBags([TableSpec(n_, n, D, pooling=mode) for n_, n in zip(names, rows)],
                                     optimizer=optimizer, lr=args.lr, eps=args.eps, seed=args.seed,
                                     cpu_kernel=False)

        def step_ours_pt(i: int) -> torch.Tensor:
            out = ours_pt(jfs[i % num_batches])
            (out * grad_out).sum().backward()
            return out

        methods["ours_pytorch"] = step_ours_pt
        rows_of["ours_pytorch"] = lambda: [ours_pt.table_weight(n_) for n_ in names]

    tbe = None
    if tbe_mod is not None:
        EmbeddingLocation, ComputeDevice, OptimType, PoolingMode, TBE = tbe_mod
        tbe = TBE([(n, D, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows],
                  optimizer=OptimType.EXACT_SGD if optimizer == "sgd" else OptimType.EXACT_ROWWISE_ADAGRAD,
                  learning_rate=args.lr, eps=args.eps,
                  pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN)
        with torch.no_grad():
            for t, w in enumerate(tbe.split_embedding_weights()):
                w.copy_(w0[t])

        def step_tbe(i: int) -> torch.Tensor:
            out = tbe(flat[i % num_batches], offsets)
            (out * grad_out).sum().backward()
            return out

        methods["fbgemm"] = step_tbe
        rows_of["fbgemm"] = lambda: list(tbe.split_embedding_weights())

    if args.per_table and optimizer == "sgd":
        base = PerTable(rows, D, mode)
        base.batch = B
        with torch.no_grad():
            for t, bag in enumerate(base.bags):
                bag.weight.copy_(w0[t])
        base_opt = torch.optim.SGD(base.parameters(), lr=args.lr)

        def step_base(i: int) -> torch.Tensor:
            out = base(batches[i % num_batches])
            base_opt.zero_grad(set_to_none=True)
            (out * grad_out).sum().backward()
            base_opt.step()
            return out

        methods["per_table"] = step_base
        rows_of["per_table"] = lambda: [bag.weight.detach() for bag in base.bags]

    # Agreement: one step of every method from the same weights, against the float64 reference.
    ref = reference_step(w0, batches[0], grad_out, L, mode, optimizer, args.lr, args.eps)
    check = {}
    for name, fn in methods.items():
        out = fn(0).detach()
        check[name] = agreement(ref, out, rows_of[name]())
    del ref, w0
    log(f"  agreement with the float64 reference: {check}")

    for fn in methods.values():  # warm-up
        for i in range(1, 3):
            fn(i)
    times: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}
    order = list(methods)
    for i in range(args.steps):
        for name in order[i % len(order):] + order[:i % len(order)]:
            c0, t0 = time.process_time(), time.perf_counter()
            methods[name](i)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: percentile(v, 0.9) for k, v in times.items()}
    stats = {k: {"median": round(B / med[k]), "p90": round(B / p90[k]), "best": round(B / min(v)),
                 "spread_p90_over_p50": round(p90[k] / med[k], 3),
                 "cpu_ms_median": round(1e3 * statistics.median(cpu[k]), 3)} for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    base_name = "fbgemm" if "fbgemm" in methods else ("per_table" if "per_table" in methods else None)
    result = {
        "benchmark": "local_embedding_train_step",
        "case": f"pooling{L}_{mode}_{optimizer}",
        "figure": stats["ours"]["median"],
        "baseline": stats[base_name]["median"] if base_name else None,
        "ratio": round(med[base_name] / med["ours"], 3) if base_name else None,
        "ratio_p90": round(p90[base_name] / p90["ours"], 3) if base_name else None,
        "ratio_cpu_time": round(cpu_med[base_name] / cpu_med["ours"], 3) if base_name else None,
        "ratio_over_pytorch_path": round(med["ours_pytorch"] / med["ours"], 3) if "ours_pytorch" in med else None,
        "ours_path": "C++ kernel (embedding/kernels.cpp)" if kernel else "PyTorch ops",
        "unit": "samples/s",
        "baseline_name": {"fbgemm": f"fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen CPU "
                                    f"{'EXACT_SGD' if optimizer == 'sgd' else 'EXACT_ROWWISE_ADAGRAD'} "
                                    f"{mode.upper()}", "per_table": "per-table nn.EmbeddingBag + torch.optim.SGD",
                          None: None}[base_name],
        "methods": stats,
        "agreement": check,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "config": {
            "tables": T, "total_rows": sum(rows), "max_rows": args.max_rows, "dim": D, "batch": B,
            "ids_per_feature": L, "pooling": mode, "optimizer": optimizer, "zipf_alpha": args.alpha,
            "lr": args.lr, "eps": args.eps, "steps": args.steps, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "mean_unique_ids_per_table": round(unique),
            "statistic": "batch / median (p90) step time, steps interleaved across methods",
        },
    }
    log(f"  {result['case']}: ours {stats['ours']}, " + ", ".join(
        f"{k} {v}" for k, v in stats.items() if k != "ours") + f", ratio {result['ratio']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 steps per case instead of 50")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--alpha", type=float, default=1.2)
    ap.add_argument("--pooling", type=int, nargs="+", default=[1, 4, 16, 64], help="ids per sample and feature")
    ap.add_argument("--modes", nargs="+", default=["sum", "mean"], choices=["sum", "mean"])
    ap.add_argument("--optimizers", nargs="+", default=["sgd", "rowwise_adagrad"], choices=["sgd", "rowwise_adagrad"])
    ap.add_argument("--per-table", action="store_true", help="also time per-table nn.EmbeddingBag (SGD cases)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per method and case (default 50)")
    ap.add_argument("--no-pytorch-path", action="store_true",
                    help="do not also time ours without the C++ kernel (when the kernel is built)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.steps = args.steps or (20 if args.quick else 50)
    torch.set_num_threads(args.threads)
    rows = [min(n, args.max_rows) for n in CRITEO_KAGGLE_ROWS] if args.max_rows else list(CRITEO_KAGGLE_ROWS)

    tbe_mod = None
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            OptimType,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe_mod = (EmbeddingLocation, ComputeDevice, OptimType, PoolingMode, SplitTableBatchedEmbeddingBagsCodegen)
    except Exception as e:  # ImportError, or a build without CPU kernels
        log(f"fbgemm_gpu not usable ({type(e).__name__}: {e}); measuring without it")

    log(f"tables={len(rows)} rows={sum(rows)} dim={args.dim} batch={args.batch} alpha={args.alpha} "
        f"threads={torch.get_num_threads()} load={os.getloadavg()}")
    for L in args.pooling:
        for optimizer in args.optimizers:
            for mode in args.modes:
                log(f"case pooling={L} {mode} {optimizer}")
                print(json.dumps(run_case(args, rows, L, mode, optimizer, tbe_mod)), flush=True)


if __name__ == "__main__":
    main()
