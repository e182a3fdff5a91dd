"""Gradient synchronisation for replicated (data-parallel) embedding rows.

Three ways to sum, over all ranks, the gradients of rows that every rank holds a replica of:

- ``local_aggregated`` (OPER section 5.3, Fig. 5): (1) the union of the unique rows every rank touched
  (one AllReduce of a packed per-row bitmap of the replicated rows, :func:`union_bits` bits a row: NCCL has
  no bitwise-OR reduction, so each row's field counts the ranks that touched it, summed, wide enough that
  no count carries into the next row's field; one byte a row and a MAX from 16 ranks on), (2) each rank
  aggregates its gradients per unique row locally and zero-pads them to that union, (3) one dense ring
  AllReduce of the ``[union, dim]`` block.
- ``dense``: one AllReduce of the gradient of *every* replicated row (zeros where untouched).
- ``allgather``: every rank all_gathers everybody's (row, gradient) pairs and reduces them locally: one
  all_gather of the per-rank pair counts, one of the pairs (row id and gradient bytes packed side by side
  in one tensor), padded to the largest rank's.

All three return ``(rows, grads)``: sorted unique replica rows and their summed gradients, identical on
every rank, so every replica applies the same update and replicas never drift apart.

Bytes (``stats["bytes_sent"]``): what this rank sends, counted at each collective call from the tensor
handed to it, by the convention of ``comm.transport`` (ring all_reduce ``2 (W - 1) / W x n``, all_gather
``(W - 1) x n``). Per step, with ``R`` replica rows of ``dim`` values of ``s`` bytes, ``U`` rows in the
union and ``m`` the largest rank's (row, gradient) pairs:

- ``local_aggregated``: ``2 (W - 1) / W x (ceil(R b / 8) + U dim s)`` with ``b = union_bits(W)`` (two
  all_reduces);
- ``dense``: ``2 (W - 1) / W x R dim s`` (one all_reduce);
- ``allgather``: ``(W - 1) x (8 + m (8 + dim s))`` (two all_gathers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embedscale.comm.transport import counted_all_gather, counted_all_reduce
from embedscale.embedding.optim import aggregate_row_gradients

METHODS = ("local_aggregated", "dense", "allgather")


def _add(stats: dict | None, sent: int) -> None:
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + int(sent)


def all_gather_var(t: torch.Tensor, group=None, stats: dict | None = None) -> list[torch.Tensor]:
    """all_gather of tensors whose first dimension differs per rank: one all_gather of the sizes, one of the
    data padded to the largest (two collectives). ``stats["bytes_sent"]``, if given, grows by the bytes
    this rank sent (the padded data counts padded)."""
    world = dist.get_world_size(group)
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    sent = counted_all_gather(sizes, n, group)
    sizes_l = torch.cat(sizes).tolist()  # one read of the sizes
    top = max(sizes_l)
    if t.shape[0] == top:
        pad = t.contiguous()
    else:
        pad = torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
        pad[: t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in range(world)]
    sent += counted_all_gather(out, pad, group)
    _add(stats, sent)
    return [o[:s] for o, s in zip(out, sizes_l)]


def _pack(rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``[n, 8 + dim * itemsize]`` bytes: each row id (int64) beside its gradient, for one all_gather."""
    n = rows.numel()
    return torch.cat([rows.to(torch.int64).contiguous().view(torch.uint8).view(n, 8),
                      grads.contiguous().view(torch.uint8).view(n, grads.shape[1] * grads.element_size())], 1)


def _unpack(packed: torch.Tensor, dtype: torch.dtype, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack`: ``(rows, grads)``."""
    rows = packed[:, :8].contiguous().view(torch.int64).view(-1)
    grads = packed[:, 8:].contiguous().view(dtype).view(-1, dim)
    return rows, grads


def union_bits(world: int) -> int:
    """Bits per row of the union bitmap over ``world`` ranks: the smallest field of 2, 4 or 8 bits (one that
    tiles a byte) holding the count ``world`` (a SUM of 0/1 per rank never carries into the next field);
    8 from 16 ranks on, where each byte is one row's 0/1 and the reduction a MAX (any number of ranks).
    One rank sends nothing: 1."""
    return 1 if world <= 1 else 2 if world <= 3 else 4 if world <= 15 else 8


def _union_by_bitmap(uniq: torch.Tensor, num_rows: int, group=None, stats: dict | None = None) -> torch.Tensor:
    """Sorted union over all ranks of ``uniq`` (rows in ``[0, num_rows)``): one AllReduce (SUM, or MAX at 8
    bits a row) of a bitmap of :func:`union_bits` bits per row (``num_rows b / 8`` bytes), whatever the
    number of rows each rank touched. Reduce ops and dtype (uint8) are ones NCCL takes."""
    world = dist.get_world_size(group)
    b = union_bits(world)
    per = 8 // b  # rows per byte
    nbytes = (num_rows + per - 1) // per
    flags = torch.zeros(nbytes * per, dtype=torch.uint8, device=uniq.device)
    flags[uniq] = 1
    shifts = torch.arange(0, 8, b, dtype=torch.uint8, device=uniq.device)
    if per == 1:
        packed = flags
    else:
        packed = (flags.view(nbytes, per) << shifts).sum(1, dtype=torch.uint8)  # fields never overlap
    _add(stats, counted_all_reduce(packed, group, op=dist.ReduceOp.MAX if per == 1 else dist.ReduceOp.SUM))
    counts = packed.unsqueeze(1) >> shifts if per > 1 else packed.unsqueeze(1)
    touched = (counts & ((1 << b) - 1)).ne(0).view(-1)[:num_rows]
    return torch.nonzero(touched).view(-1)


def aggregate_rows(rows: torch.Tensor, grads: torch.Tensor, num_rows: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum gradients per unique row (local aggregation): sorted unique rows and their summed gradients."""
    return aggregate_row_gradients(rows, grads, num_rows=num_rows)


def gather_replica_grads(rows: torch.Tensor, grads: torch.Tensor, group=None, stats: dict | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``allgather`` method's exchange: every rank's ``(rows, grads)``, in rank order (the same on every
    rank; summing them per row in that order is the method's result)."""
    parts = all_gather_var(_pack(rows, grads), group, stats)
    return [_unpack(p, grads.dtype, grads.shape[1]) for p in parts]


def sync_replica_entries(rows: torch.Tensor, grads: torch.Tensor, num_replica_rows: int, *,
                         method: str = "local_aggregated", group=None, stats: dict | None = None) -> list:
    """:func:`sync_replica_grads` of entries whose rows may repeat, summed in entry order where they are added,
    with no local sort (whose row count the host would read): ``(rows, grads)`` lists whose per-row sums, added
    in list order, are the synced gradients: one list (``local_aggregated``: the union, its block zero-padded and
    the entries added into it before the ring AllReduce; ``dense``), or one per rank in rank order
    (``allgather``)."""
    if method == "local_aggregated":
        union = _union_by_bitmap(rows, num_replica_rows, group, stats)
        padded = torch.zeros((union.numel(), grads.shape[1]), dtype=grads.dtype, device=grads.device)
        padded.index_add_(0, torch.searchsorted(union, rows), grads)
        _add(stats, counted_all_reduce(padded, group))
        return [(union, padded)]
    if method == "allgather":
        return gather_replica_grads(rows, grads, group, stats)
    return [sync_replica_grads(rows, grads, num_replica_rows, method=method, group=group, stats=stats)]


def sync_replica_grads(rows: torch.Tensor, grads: torch.Tensor, num_replica_rows: int, *,
                       method: str = "local_aggregated", group=None, stats: dict | None = None,
                       presorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum replica-row gradients over all ranks of ``group``.

    Args:
        rows: replica-row ids this rank touched (any order, repeats allowed), in ``[0, num_replica_rows)``.
        grads: ``[len(rows), dim]`` gradients for them.
        num_replica_rows: how many replicated rows there are (the dense method's buffer size).
        method: ``local_aggregated`` | ``dense`` | ``allgather``.
        stats: if given, ``stats["bytes_sent"]`` is increased by the bytes this rank sends.
        presorted: ``rows`` are unique and ascending already (``local_aggregated`` then sums nothing locally).

    Returns:
        ``(rows, grads)`` with sorted unique rows and gradients summed over all ranks, the same everywhere.
    """
    dim = grads.shape[1]
    if method == "local_aggregated":
        uniq, local = (rows, grads) if presorted else \
            aggregate_rows(rows, grads, num_replica_rows)  # step 1 (local part) and step 2
        union = _union_by_bitmap(uniq, num_replica_rows, group, stats)  # step 1: union of unique indices
        padded = torch.zeros((union.numel(), dim), dtype=grads.dtype, device=grads.device)
        padded[torch.searchsorted(union, uniq)] = local  # zero-padding to the union
        _add(stats, counted_all_reduce(padded, group))  # step 3: one dense ring AllReduce
        return union, padded
    if method == "dense":
        full = torch.zeros((num_replica_rows, dim), dtype=grads.dtype, device=grads.device)
        full.index_add_(0, rows, grads)
        _add(stats, counted_all_reduce(full, group))
        # every replicated row, touched or not: a zero gradient leaves SGD and row-wise Adagrad rows
        # exactly as they were, so applying it everywhere is exact (and is what dense AllReduce costs).
        return torch.arange(num_replica_rows, device=grads.device), full
    if method == "allgather":
        parts = gather_replica_grads(rows, grads, group, stats)
        return aggregate_rows(torch.cat([r for r, _g in parts]), torch.cat([g for _r, g in parts]), num_replica_rows)
    raise ValueError(f"grad sync method {method!r} is not one of {METHODS}")
