"""Sparse AllReduce variants against a single-process sum over every rank's gradients."""

import pytest
import torch

from embedscale.embedding.grad_sync import METHODS, sync_replica_grads
from embedscale.train.launch import spawn_local

R, DIM = 50, 4


def rank_data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    n = 20 + 7 * rank
    rows = (torch.rand(n, generator=g) ** 3 * R).long()  # skewed, with repeats
    grads = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    return rows, grads


def _worker(rank, world):
    rows, grads = rank_data(rank)
    out = {}
    for m in METHODS:
        stats = {}
        r, g = sync_replica_grads(rows, grads, R, method=m, stats=stats)
        out[m] = (r, g, stats["bytes_sent"])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_all_methods_equal_the_global_sum(world):
    results = spawn_local(_worker, world)
    full = torch.zeros(R, DIM, dtype=torch.float64)
    touched = set()
    for rk in range(world):
        rows, grads = rank_data(rk)
        full.index_add_(0, rows, grads)
        touched |= set(rows.tolist())
    for res in results:
        for m in METHODS:
            r, g, sent = res[m]
            dense = torch.zeros(R, DIM, dtype=torch.float64)
            dense[r] = g
            torch.testing.assert_close(dense, full, rtol=0, atol=1e-12)
            if m != "dense":
                assert set(r.tolist()) == touched
            assert sent > 0
    # every rank ends with the same result
    for m in METHODS:
        assert all(torch.equal(results[0][m][1], res[m][1]) for res in results)
