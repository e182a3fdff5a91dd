"""Embedding training step: LocalEmbeddingBags (fused SGD) vs per-table nn.EmbeddingBag vs FBGEMM TBE.

One step = forward + backward + sparse update of 26 tables with the Criteo Kaggle cardinalities
(``specs.CRITEO_KAGGLE_ROWS``) capped at ``--max-rows``, ``--dim`` 16, batch ``--batch`` 4096, one id per
feature drawn from Zipf(``--alpha`` 1.2) over each table's rows (inverse CDF; popularity ranks permuted
per table; ``--ids-per-feature`` L > 1 makes every bag L ids long), loss = sum(outputs * fixed random tensor). Measured in the same run:

* ours: ``LocalEmbeddingBags(optimizer="sgd")`` (one flat storage, one fused lookup, update in backward),
  with input validation on (the default) and off;
* baseline: 26 ``nn.EmbeddingBag(mode="sum", sparse=True)`` + ``torch.optim.SGD``;
* fbgemm: ``fbgemm_gpu``'s ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU (``EmbeddingLocation.HOST``,
  ``ComputeDevice.CPU``) with ``OptimType.EXACT_SGD``, when ``fbgemm_gpu`` imports.

All start from the same weights; before timing, one step of each is checked against the others.
Methods are timed step by step, interleaved (``--repeats`` x ``--steps`` steps each); each figure is
batch / median step time (``best_step``: batch / fastest step).
Prints one JSON line on stdout; progress goes to stderr.

    .venv/bin/python benchmarks/bench_local_embedding.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.specs import CRITEO_KAGGLE_ROWS, TableSpec


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def zipf_ids(rng: np.random.Generator, num_rows: int, alpha: float, n: int) -> np.ndarray:
    """``n`` row ids with P(rank k) ~ k^-alpha (inverse CDF), ranks permuted over the rows."""
    cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), num_rows - 1)
    return rng.permutation(num_rows)[ranks].astype(np.int64)


class PerTable(nn.Module):
    def __init__(self, rows: list[int], dim: int) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in rows)
        self.batch = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T, B * L]: L ids per sample
        B = self.batch
        return torch.cat([bag(ids[t].view(B, -1)) for t, bag in enumerate(self.bags)], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats (~1 min)")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--alpha", type=float, default=1.2)
    ap.add_argument("--ids-per-feature", type=int, default=1, help="ids per sample and feature (multi-hot if > 1)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=None, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    steps = args.steps or (10 if args.quick else 30)
    repeats = args.repeats or (3 if args.quick else 7)
    B, D = args.batch, args.dim
    rows = [min(n, args.max_rows) for n in CRITEO_KAGGLE_ROWS] if args.max_rows else list(CRITEO_KAGGLE_ROWS)
    T = len(rows)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    log(f"tables={T} rows={sum(rows)} dim={D} batch={B} alpha={args.alpha} threads={torch.get_num_threads()}")
    num_batches = 8
    L = args.ids_per_feature
    ids = np.stack([zipf_ids(rng, n, args.alpha, num_batches * B * L) for n in rows])  # [T, nb * B * L]
    batches = [torch.from_numpy(np.ascontiguousarray(ids[:, i * B * L:(i + 1) * B * L])) for i in range(num_batches)]
    names = [f"C{t + 1}" for t in range(T)]
    jfs = [JaggedFeatures(names, b.reshape(-1), torch.full((T * B,), L, dtype=torch.int64)) for b in batches]
    offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
    grad_weight = torch.randn(B, T * D)
    unique = np.mean([len(np.unique(b[t].numpy())) for b in batches for t in range(T)])
    log(f"mean unique ids per table per batch: {unique:.0f} of {B * L}")

    ours = LocalEmbeddingBags([TableSpec(n_, n, D) for n_, n in zip(names, rows)], optimizer="sgd",
                              lr=args.lr, seed=args.seed)
    base = PerTable(rows, D)
    base.batch = B
    with torch.no_grad():
        for t, bag in enumerate(base.bags):
            bag.weight.copy_(ours.table_weight(names[t]))
    base_opt = torch.optim.SGD(base.parameters(), lr=args.lr)

    tbe = None
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            OptimType,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(n, D, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows],
            optimizer=OptimType.EXACT_SGD, learning_rate=args.lr,
        )
        with torch.no_grad():
            for t, w in enumerate(tbe.split_embedding_weights()):
                w.copy_(ours.table_weight(names[t]))
    except Exception as e:  # ImportError, or a build without CPU kernels
        log(f"fbgemm_gpu not usable ({type(e).__name__}: {e}); comparing with nn.EmbeddingBag only")
        tbe = None

    def step_ours(i: int) -> torch.Tensor:
        out = ours(jfs[i % num_batches])
        (out * grad_weight).sum().backward()
        return out

    def step_base(i: int) -> torch.Tensor:
        out = base(batches[i % num_batches])
        base_opt.zero_grad(set_to_none=True)
        (out * grad_weight).sum().backward()
        base_opt.step()
        return out

    def step_tbe(i: int) -> torch.Tensor:
        b = batches[i % num_batches]
        out = tbe(b.reshape(-1), offsets)
        (out * grad_weight).sum().backward()
        return out

    # Same weights, same batch: every method must agree on the step (outputs, then updated rows).
    check = {}
    outs = {"ours": step_ours(0).detach(), "baseline": step_base(0).detach()}
    if tbe is not None:
        outs["fbgemm"] = step_tbe(0).detach()
    with torch.no_grad():  # forward only: the weights after the step
        after = {"ours": ours(jfs[1]), "baseline": base(batches[1])}
        if tbe is not None:
            after["fbgemm"] = tbe(batches[1].reshape(-1), offsets)
    for k in outs:
        check[k] = max(float((outs[k] - outs["ours"]).abs().max()), float((after[k] - after["ours"]).abs().max()))
    log(f"max |difference| to ours over two steps: {check}")
    if max(check.values()) > 1e-4:
        raise SystemExit(f"methods disagree: {check}")

    def step_ours_nocheck(i: int) -> torch.Tensor:
        ours.validate = False
        try:
            return step_ours(i)
        finally:
            ours.validate = True

    methods = {"ours": step_ours, "ours_no_validate": step_ours_nocheck, "baseline": step_base}
    if tbe is not None:
        methods["fbgemm"] = step_tbe
    for fn in methods.values():  # warm-up
        for i in range(3):
            fn(i)
    # Interleave at the step level (A B C A B C ...) so that load from other processes hits every method
    # alike, and take the median step time: robust to bursts on a shared machine.
    times: dict[str, list[float]] = {k: [] for k in methods}
    order = list(methods)
    for r in range(repeats):
        for i in range(steps):
            k = r * steps + i
            for name in order[k % len(order):] + order[:k % len(order)]:
                t0 = time.perf_counter()
                methods[name](k)
                times[name].append(time.perf_counter() - t0)
        log(f"repeat {r + 1}/{repeats}: median so far " + ", ".join(
            f"{k} {B / statistics.median(v):,.0f}" for k, v in times.items()) + " samples/s")
    med = {k: B / statistics.median(v) for k, v in times.items()}
    best = {k: B / min(v) for k, v in times.items()}
    result = {
        "benchmark": "local_embedding_train_step",
        "figure": round(med["ours"]),
        "baseline": round(med["baseline"]),
        "ratio": round(med["ours"] / med["baseline"], 3),
        "unit": "samples/s",
        "fbgemm": round(med["fbgemm"]) if tbe is not None else None,
        "ratio_fbgemm": round(med["ours"] / med["fbgemm"], 3) if tbe is not None else None,
        "ours_no_validate": round(med["ours_no_validate"]),
        "best_step": {k: round(v) for k, v in best.items()},
        "baseline_name": "per-table nn.EmbeddingBag(sparse=True) + torch.optim.SGD",
        "fbgemm_name": "fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen CPU EXACT_SGD"
        if tbe is not None else "fbgemm_gpu not importable",
        "config": {
            "tables": T, "total_rows": sum(rows), "max_rows": args.max_rows, "dim": D, "batch": B,
            "ids_per_feature": L, "zipf_alpha": args.alpha, "optimizer": "sgd", "lr": args.lr,
            "steps": steps, "repeats": repeats, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "mean_unique_ids_per_table": round(float(unique)),
            "max_abs_diff_vs_ours": check, "statistic": "batch / median step time, steps interleaved across methods",
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
