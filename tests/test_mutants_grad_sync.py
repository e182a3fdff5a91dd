"""Replica gradient sync (``embedding.grad_sync``) when no rank touches row 0.

The zero-padding to the union of touched rows must not invent row 0 (a padding or bitmap default of 0 would
put a zero-gradient row 0 into the union, which then gets an optimizer step it should not: row-wise Adagrad
moves nothing with a zero gradient, but the union, its bytes and what the caller applies differ). Reference: a
dense float64 sum of every rank's gradients, and the set of rows some rank touched.
"""

from __future__ import annotations

import pytest
import torch

from embedscale.embedding.grad_sync import METHODS, sync_replica_grads
from embedscale.train.launch import spawn_local

R, DIM = 37, 3


def rank_data(rank):
    """Rows 1..R-1 only (row 0 untouched on every rank), skewed, with repeats; rank 1 touches row R-1."""
    g = torch.Generator().manual_seed(7 + rank)
    n = 9 + 4 * rank
    rows = 1 + (torch.rand(n, generator=g) ** 2 * (R - 2)).long()
    if rank == 1:
        rows[-1] = R - 1
    return rows, torch.randn(n, DIM, generator=g, dtype=torch.float64)


def _worker(rank, world):
    rows, grads = rank_data(rank)
    return {m: sync_replica_grads(rows, grads, R, method=m) for m in METHODS}


@pytest.mark.parametrize("world", [2, 3])
def test_sync_without_row_0_equals_the_dense_sum_and_the_touched_union(world):
    results = spawn_local(_worker, world, timeout_s=300)
    full = torch.zeros(R, DIM, dtype=torch.float64)
    touched = set()
    for rk in range(world):
        rows, grads = rank_data(rk)
        for r, g in zip(rows.tolist(), grads):
            full[r] += g
        touched |= set(rows.tolist())
    assert 0 not in touched and R - 1 in touched
    for rk, res in enumerate(results):
        for m in METHODS:
            rows, grads = res[m]
            dense = torch.zeros(R, DIM, dtype=torch.float64)
            dense[rows] = grads  # rows are unique: assignment, so a row listed twice would not hide
            assert rows.unique().numel() == rows.numel(), (m, rows)
            torch.testing.assert_close(dense, full, rtol=0, atol=1e-12, msg=lambda s: f"{m} rank {rk}: {s}")
            if m != "dense":  # the dense method returns every replica row by definition
                assert sorted(rows.tolist()) == sorted(touched), (m, rk, rows.tolist())
                assert torch.all(grads.abs().sum(1) > 0), (m, rk)  # no padding row in the union
