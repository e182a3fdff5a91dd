"""Gradient synchronisation for replicated (data-parallel) embedding rows.

Three ways to sum, over all ranks, the gradients of rows that every rank holds a replica of:

- ``local_aggregated`` (OPER section 5.3, Fig. 5): (1) the union of the unique rows every rank touched
  (one bitwise-OR AllReduce of a packed bitmap of the replicated rows), (2) each rank aggregates its gradients per unique row locally and
  zero-pads them to that union, (3) one dense ring AllReduce of the ``[union, dim]`` block.
- ``dense``: one AllReduce of the gradient of *every* replicated row (zeros where untouched).
- ``allgather``: every rank all_gathers everybody's (row, gradient) pairs and reduces them locally.

All three return ``(rows, grads)``: sorted unique replica rows and their summed gradients, identical on
every rank, so every replica applies the same update and replicas never drift apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embedscale.embedding.optim import aggregate_row_gradients

METHODS = ("local_aggregated", "dense", "allgather")


def _ring_allreduce_bytes(numel: int, itemsize: int, world: int) -> int:
    """Bytes one rank sends in a ring AllReduce (OPER eq. 5: 2 (M-1)/M S)."""
    return int(2 * (world - 1) * numel * itemsize // max(world, 1))


def all_gather_var(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """all_gather of tensors whose first dimension differs per rank (sizes first, then padded data)."""
    world = dist.get_world_size(group)
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes_l = [int(s) for s in sizes]
    top = max(sizes_l)
    pad = torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
    pad[: t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(out, pad, group=group)
    return [o[:s] for o, s in zip(out, sizes_l)]


def _union_by_bitmap(uniq: torch.Tensor, num_rows: int, group=None) -> torch.Tensor:
    """Sorted union over all ranks of ``uniq`` (rows in ``[0, num_rows)``): one bitwise-OR AllReduce of a
    packed bitmap (``num_rows / 8`` bytes), whatever the number of ranks or of rows each touched."""
    nbytes = (num_rows + 7) // 8
    bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=uniq.device)
    bits[uniq] = 1
    weights = (2 ** torch.arange(8, device=uniq.device)).to(torch.uint8)
    packed = (bits.view(nbytes, 8) * weights).sum(1, dtype=torch.uint8)
    dist.all_reduce(packed, op=dist.ReduceOp.BOR, group=group)
    unpacked = (packed.unsqueeze(1) & weights).ne(0).view(-1)[:num_rows]
    return torch.nonzero(unpacked).view(-1)


def aggregate_rows(rows: torch.Tensor, grads: torch.Tensor, num_rows: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum gradients per unique row (local aggregation): sorted unique rows and their summed gradients."""
    return aggregate_row_gradients(rows, grads, num_rows=num_rows)


def sync_replica_grads(rows: torch.Tensor, grads: torch.Tensor, num_replica_rows: int, *,
                       method: str = "local_aggregated", group=None, stats: dict | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum replica-row gradients over all ranks of ``group``.

    Args:
        rows: replica-row ids this rank touched (any order, repeats allowed), in ``[0, num_replica_rows)``.
        grads: ``[len(rows), dim]`` gradients for them.
        num_replica_rows: how many replicated rows there are (the dense method's buffer size).
        method: ``local_aggregated`` | ``dense`` | ``allgather``.
        stats: if given, ``stats["bytes_sent"]`` is increased by the bytes this rank sends.

    Returns:
        ``(rows, grads)`` with sorted unique rows and gradients summed over all ranks, the same everywhere.
    """
    world = dist.get_world_size(group)
    dim = grads.shape[1]
    itemsize = grads.element_size()
    sent = 0
    if method == "local_aggregated":
        uniq, local = aggregate_rows(rows, grads, num_replica_rows)  # step 1 (local part) and step 2
        union = _union_by_bitmap(uniq, num_replica_rows, group)  # step 1: union of unique indices
        sent += _ring_allreduce_bytes((num_replica_rows + 7) // 8, 1, world)
        padded = torch.zeros((union.numel(), dim), dtype=grads.dtype, device=grads.device)
        padded[torch.searchsorted(union, uniq)] = local  # zero-padding to the union
        dist.all_reduce(padded, group=group)  # step 3: one dense ring AllReduce
        sent += _ring_allreduce_bytes(padded.numel(), itemsize, world)
        out = (union, padded)
    elif method == "dense":
        full = torch.zeros((num_replica_rows, dim), dtype=grads.dtype, device=grads.device)
        full.index_add_(0, rows, grads)
        dist.all_reduce(full, group=group)
        sent += _ring_allreduce_bytes(full.numel(), itemsize, world)
        # every replicated row, touched or not: a zero gradient leaves SGD and row-wise Adagrad rows
        # exactly as they were, so applying it everywhere is exact (and is what dense AllReduce costs).
        out = (torch.arange(num_replica_rows, device=grads.device), full)
    elif method == "allgather":
        rparts = all_gather_var(rows, group)
        gparts = all_gather_var(grads, group)
        sent += (world - 1) * (rows.numel() * 8 + grads.numel() * itemsize) + 16 * (world - 1)
        out = aggregate_rows(torch.cat(rparts), torch.cat(gparts), num_replica_rows)
    else:
        raise ValueError(f"grad sync method {method!r} is not one of {METHODS}")
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + int(sent)
    return out
