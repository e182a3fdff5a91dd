"""The send design's stages (the classic model-parallel path): ids to their owners, owners pool partial bags.

``input_dist``: every value's id is decoded to its owner; the values of one bag held by one owner form a partial
bag (one per (owner, bag), numbered per owner); the ``(offset, partial bag)`` pairs and the values' scales go to
their owners (the local half, ``decode``, runs on the input pipeline's worker when the batch was prefetched).
``compute``: each owner pools, for every requester, the partial bags it was sent.
``output_dist``: the partial sums go back, and the requester adds them per bag in rank order, then lays the
bags out per sample (``[B, F * D]``). ``grad_dist``: the partial bags' gradients go back to their owners.
``update``: each owner expands them to rows, sums per row and applies the fused optimizer (replicas through
``grad_sync``).

Every stage function takes the module (a ``ShardedEmbedding``: its storage, address map, transport and
fused optimizer) and the batch's context (``embedding.context``).
"""

from __future__ import annotations

import torch

from embedscale.embedding.context import SendContext, Stage
from embedscale.embedding.retrieve import split_by_rank


def input_dist(mod, ctx: SendContext) -> None:
    """Decode the batch (unless ``prefetch`` did) and send every owner the ids and scales of its values."""
    if ctx.state is Stage.NEW:
        decode(mod, ctx)
    me, tr = mod.rank, mod.transport
    v_counts = [len(x) for x in ctx.out_ids]
    # one count swap (values and partial bags per peer: both sizes an owner allocates by), one exchange of the
    # ids and scales together: the counts are the only data the host reads
    cnt = tr.exchange_counts(torch.tensor([[v, b] if p != me else [0, 0] for p, (v, b) in
                                           enumerate(zip(v_counts, ctx.p_counts))], dtype=torch.int64))
    ctx.recv_counts = [tuple(c) for c in cnt.tolist()]
    ids0, s0 = ctx.out_ids[me][:0], ctx.out_scale[me][:0]
    got = tr.exchange_packed([[i.contiguous(), sc.contiguous()] for i, sc in zip(ctx.out_ids, ctx.out_scale)],
                             [[(torch.int64, (2,), v), (s0.dtype, (), v)] for v, _b in ctx.recv_counts],
                             ["ids", "ids"], device=mod.weight.device)
    ctx.recv_ids = [ids0 if x is None else x[0] for x in got]
    ctx.recv_scale = [s0 if x is None else x[1] for x in got]
    ctx.my_ids, ctx.my_scale = ctx.out_ids[me], ctx.out_scale[me]
    ctx.out_ids = ctx.out_scale = None
    ctx.state = Stage.ANNOUNCED


def decode(mod, ctx: SendContext) -> None:
    """``input_dist``'s local half (thread-safe: the prefetch thread runs it ahead): the batch's flat lookups, its
    partial bags and, per owner, the ``(offset, partial bag)`` pairs and scales of the values it owns."""
    W = mod.world_size
    ctx.gids, ctx.bag, ctx.scale, ctx.nbags, ctx.B = mod.flat_lookups(ctx.features)[:5]
    dev = ctx.gids.device  # host memory, where the address map decodes (the ids cross in the exchange)
    nbags = ctx.nbags
    src, off, _slot = mod.tmap.decode(ctx.gids)
    key = src * nbags + ctx.bag  # partial bags: one per (source rank, bag) pair, numbered per source rank
    pkeys, pinv = torch.unique(key, sorted=True, return_inverse=True)
    ctx.p_bag = pkeys % nbags
    ctx.p_counts = split_by_rank(pkeys // nbags, W)
    p_first = torch.zeros(W + 1, dtype=torch.int64, device=dev)
    p_first[1:] = torch.cumsum(torch.tensor(ctx.p_counts, device=dev), 0)
    local_pbag = pinv - p_first[src]  # partial-bag number inside its source rank's list
    order = torch.argsort(src, stable=True)
    v_counts = split_by_rank(src, W)
    ids = torch.stack([off[order], local_pbag[order]], 1)  # (offset on source, partial bag), rank-major
    ctx.out_ids = list(torch.split(ids, v_counts))
    ctx.out_scale = list(torch.split(ctx.scale[order], v_counts))
    ctx.state = Stage.DECODED


def _served(ctx: SendContext, q: int, me: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(offset, partial bag)`` pairs and scales requester ``q`` sent this rank."""
    return (ctx.my_ids, ctx.my_scale) if q == me else (ctx.recv_ids[q], ctx.recv_scale[q])


def _partial_bags_of(ctx: SendContext, q: int, me: int) -> int:
    return ctx.p_counts[me] if q == me else ctx.recv_counts[q][1]


def compute(mod, ctx: SendContext) -> None:
    """Pool, for every requester, the partial bags it asked this rank for."""
    dev = mod.weight.device
    ctx.pooled = []
    for q in range(mod.world_size):
        src_ids, src_scale = _served(ctx, q, mod.rank)
        out_q = torch.zeros((_partial_bags_of(ctx, q, mod.rank), mod.dim), dtype=mod.weight.dtype, device=dev)
        if src_ids.numel():
            rows = mod.weight.index_select(0, src_ids[:, 0].to(dev))
            out_q.index_add_(0, src_ids[:, 1].to(dev), rows * src_scale.to(dev, mod.weight.dtype)[:, None])
        ctx.pooled.append(out_q)
    ctx.state = Stage.POOLED


def output_dist(mod, ctx: SendContext) -> torch.Tensor:
    """The partial sums back to their requesters, added per bag in rank order; ``[B, F * D]``."""
    W, me = mod.world_size, mod.rank
    pooled = ctx.pooled
    back = mod.transport.exchange([pooled[q] if q != me else pooled[q][:0] for q in range(W)],
                                  recv_counts=[c if q != me else 0 for q, c in enumerate(ctx.p_counts)],
                                  kind="pooled")
    back[me] = pooled[me]
    ctx.pooled = None
    partials = torch.cat(back)  # ordered like the partial bags (rank-major)
    out = torch.zeros((ctx.nbags, mod.dim), dtype=mod.weight.dtype, device=mod.weight.device)
    out.index_add_(0, ctx.p_bag.to(out.device), partials)
    F_ = len(mod.feature_names)
    return out.view(F_, ctx.B, mod.dim).transpose(0, 1).reshape(ctx.B, F_ * mod.dim)


def grad_dist(mod, ctx: SendContext, grad_out: torch.Tensor) -> None:
    """Every partial bag's gradient back to the owner that pooled it."""
    W, me = mod.world_size, mod.rank
    F_ = len(mod.feature_names)
    per_bag = grad_out.view(ctx.B, F_, mod.dim).transpose(0, 1).reshape(ctx.nbags, mod.dim)  # feature-major bags
    parts = list(torch.split(per_bag[ctx.p_bag.to(grad_out.device)], ctx.p_counts))
    n_recv = [_partial_bags_of(ctx, q, me) if q != me else 0 for q in range(W)]
    ctx.grads = mod.transport.exchange([parts[q] if q != me else parts[q][:0] for q in range(W)],
                                       recv_counts=n_recv, kind="grads")
    ctx.grads[me] = parts[me]
    ctx.state = Stage.GRADS_SENT


def update(mod, ctx: SendContext) -> None:
    """Owner side: the partial bags' gradients expanded to rows, summed per row, applied."""
    served = []
    for q in range(mod.world_size):
        ids_q, sc_q = _served(ctx, q, mod.rank)
        served.append((ids_q[:, 0], ids_q[:, 1], sc_q, ctx.grads[q]))
    mod.apply_partial_bag_grads(served, ctx.grads[mod.rank].dtype)
    ctx.state = Stage.UPDATED
