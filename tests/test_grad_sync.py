"""Sparse AllReduce variants against a single-process sum over every rank's gradients, and the bytes each
method reports against hand-computed values (1 to 4 gloo ranks).

The byte figures are published (``grad_sync_bytes_per_step``, bench_grad_sync), so they are checked exactly:
the expected values are written below as arithmetic from the test's own row counts, dim and dtype, by the
counting convention of ``comm.transport`` (bytes a rank sends: ring all_reduce ``2 (W - 1) / W x n``
rounded down, all_gather ``(W - 1) x`` its contribution). At 3 and 4 ranks ``2 (W - 1) / W`` and ``W - 1``
differ from 1, so a dropped factor fails here. The collectives each method issues are counted too.
"""

import pytest
import torch
import torch.distributed as dist

from embedscale.embedding.grad_sync import METHODS, sync_replica_grads
from embedscale.train.launch import spawn_local

R, DIM = 50, 4
F64 = 8  # bytes per gradient value (float64)
ID = 8  # bytes per row id (int64)


def rank_rows(rank):
    return 20 + 7 * rank  # (row, gradient) pairs rank ``rank`` holds


def rank_data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    n = rank_rows(rank)
    rows = (torch.rand(n, generator=g) ** 3 * R).long()  # skewed, with repeats
    grads = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    return rows, grads


def _worker(rank, world):
    rows, grads = rank_data(rank)
    calls = {"all_reduce": 0, "all_gather": 0}
    real = {k: getattr(dist, k) for k in calls}

    def counting(name):
        def call(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)
        return call

    out = {}
    for m in METHODS:
        for k in calls:
            calls[k] = 0
            setattr(dist, k, counting(k))
        try:
            stats = {}
            r, g = sync_replica_grads(rows, grads, R, method=m, stats=stats)
        finally:
            for k in calls:
                setattr(dist, k, real[k])
        out[m] = (r, g, stats["bytes_sent"], dict(calls))
    return out


def expected_bytes(world, union):
    """Bytes one rank sends per method, by hand (the same on every rank)."""
    ring = 2 * (world - 1)  # ring all_reduce: 2 (W - 1) / W x n, the division last (rounded down)
    # the union bitmap: a field per row wide enough to count ``world`` ranks (NCCL has no bitwise OR, so the
    # fields are summed): 2 bits up to 3 ranks, 4 up to 15 (50 rows -> 13 or 25 bytes); one bit alone
    bits = 1 if world == 1 else 2 if world <= 3 else 4
    bitmap = (R * bits + 7) // 8
    largest = rank_rows(world - 1)  # all_gather pads every rank's pairs to the largest rank's
    return {
        "local_aggregated": ring * bitmap // world + ring * (union * DIM * F64) // world,
        "dense": ring * (R * DIM * F64) // world,
        "allgather": (world - 1) * ID + (world - 1) * largest * (ID + DIM * F64),  # sizes, then the pairs
    }


CALLS = {"local_aggregated": {"all_reduce": 2, "all_gather": 0}, "dense": {"all_reduce": 1, "all_gather": 0},
         "allgather": {"all_reduce": 0, "all_gather": 2}}  # the AllGather baseline: one size exchange


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_methods_equal_the_global_sum_and_send_the_hand_counted_bytes(world):
    results = spawn_local(_worker, world, timeout_s=300)
    full = torch.zeros(R, DIM, dtype=torch.float64)
    touched = set()
    for rk in range(world):
        rows, grads = rank_data(rk)
        full.index_add_(0, rows, grads)
        touched |= set(rows.tolist())
    want = expected_bytes(world, len(touched))
    if world == 1:
        assert all(v == 0 for v in want.values())  # one rank sends nothing
    for rk, res in enumerate(results):
        for m in METHODS:
            r, g, sent, calls = res[m]
            dense = torch.zeros(R, DIM, dtype=torch.float64)
            dense[r] = g
            torch.testing.assert_close(dense, full, rtol=0, atol=1e-12)
            if m != "dense":
                assert set(r.tolist()) == touched
            assert sent == want[m], (world, rk, m, sent, want[m])
            assert calls == CALLS[m], (m, calls)
    # every rank ends with the same result
    for m in METHODS:
        assert all(torch.equal(results[0][m][1], res[m][1]) for res in results)



def _union_worker(rank, world, bits):
    from embedscale.embedding import grad_sync

    grad_sync.union_bits = lambda w: bits  # the field width of a larger world, here on 2 ranks
    rows, grads = rank_data(rank)
    r, _g = sync_replica_grads(rows, grads, R, method="local_aggregated")
    return r


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_union_bitmap_at_every_field_width_is_the_union_of_touched_rows(bits):
    """2, 4 and 8 bits a row (8: a MAX of one byte a row) give the union; 1 bit summed carries (2 ranks
    touching a row make a 0 bit and a carry into the next row's): the width must hold the rank count."""
    touched = sorted(set(rank_data(0)[0].tolist()) | set(rank_data(1)[0].tolist()))
    for r in spawn_local(_union_worker, 2, bits, timeout_s=300):
        assert (r.tolist() == touched) == (bits > 1), (bits, r.tolist(), touched)
