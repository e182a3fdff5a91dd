"""DLRM's dot interaction, forward + backward: ours (``models.dlrm.InteractionArch``, the pairs by one
``index_select`` of the flattened Gram matrix) against the same op written as the DLRM reference and TorchRec
write it (the pairs by advanced indexing ``gram[:, i, j]``, whose backward is an accumulating ``index_put``).

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/bench_interaction.py [--batch 1024] [--features 26]
        [--dim 16] [--threads 1] [--rounds 15]

Same inputs, same output gradient, same threads, interleaved (the order alternates every round); each round
times ``--reps`` calls of one form. Checks that both give the same output and gradients, then prints one JSON
line: figure = our forward + backward per call (ms, median over rounds), baseline = the indexing form's, ratio
= baseline / figure (speed-up), median and p90 of both, load average, config.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from embedscale.models.dlrm import InteractionArch


class IndexingInteraction(torch.nn.Module):
    """The baseline: the pairs gathered as ``gram[:, i, j]`` (what this repository did before, as DLRM's
    reference ``interact_features`` and TorchRec's ``InteractionArch`` do)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        n = num_sparse_features + 1
        self.register_buffer("triu_indices", torch.triu_indices(n, n, offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([dense, gram[:, self.triu_indices[0], self.triu_indices[1]]], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--features", type=int, default=26)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, F, D = args.batch, args.features, args.dim
    dense = torch.randn(B, D, requires_grad=True)
    sparse = torch.randn(B, F, D, requires_grad=True)
    forms = {"ours": InteractionArch(F), "indexing": IndexingInteraction(F)}
    grad_out = torch.randn(B, D + (F + 1) * F // 2)

    def call(m):
        dense.grad = sparse.grad = None
        out = m(dense, sparse)
        out.backward(grad_out)
        return out

    ref = {k: (call(m).detach(), dense.grad.clone(), sparse.grad.clone()) for k, m in forms.items()}
    for a, b in zip(ref["ours"], ref["indexing"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    times: dict[str, list[float]] = {k: [] for k in forms}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        for k in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
            t0 = time.perf_counter()
            for _ in range(args.reps):
                call(forms[k])
            times[k].append((time.perf_counter() - t0) / args.reps * 1e3)
    med = {k: float(np.median(v)) for k, v in times.items()}
    p90 = {k: float(np.percentile(v, 90)) for k, v in times.items()}
    print(json.dumps({"benchmark": "interaction", "figure": med["ours"], "baseline": med["indexing"],
                      "ratio": med["indexing"] / med["ours"], "unit": "ms per forward + backward (median of rounds)",
                      "median_ms": med, "p90_ms": p90, "same_results": True,
                      "load_average_before": load0, "load_average_after": os.getloadavg(),
                      "config": {"batch": B, "features": F, "dim": D, "threads": args.threads,
                                 "rounds": args.rounds, "reps": args.reps, "torch": torch.__version__}}))


if __name__ == "__main__":
    main()
