"""The send design's stages (the classic model-parallel path): ids to their owners, owners pool partial bags.

``input_dist``: every value's id is decoded to its owner; the values of one bag held by one owner form a partial
bag (one per (owner, bag), numbered per owner); the ``(offset, partial bag)`` pairs and the values' scales go to
their owners, after one count swap that gives every owner each size of the step (values, partial bags and the
distinct owned and replica rows they read, counted by the requester on the host). Prefetched, the local half,
``decode``, runs on the input pipeline's worker, the counts ride the step before's pooled exchange and the ids
its gradient exchange: two all-to-alls a step instead of four.
``compute``: each owner pools, for every requester, the partial bags it was sent.
``output_dist``: the partial sums go back, and the requester adds them per bag in rank order, then lays the
bags out per sample (``[B, F * D]``). ``grad_dist``: the partial bags' gradients go back to their owners.
``update``: each owner expands them to rows, sums per row and applies the fused optimizer (replicas through
``grad_sync``). The host reads, per step, the swapped counts, the number of rows updated and the replica sync's
union or sizes: every other size is known from the counts.

Every stage function takes the module (a ``ShardedEmbedding``: its storage, address map, transport and
fused optimizer) and the batch's context (``embedding.context``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedscale.embedding.context import SendContext, Stage
from embedscale.embedding.retrieve import split_by_rank
from embedscale.errors import InputError


def input_dist(mod, ctx: SendContext) -> None:
    """Decode the batch (unless ``prefetch`` did) and send every owner the ids and scales of its values, as far as
    the step before did not (prefetched: the batch's counts rode that step's pooled exchange, ``COUNTED``, and its
    ids that step's gradient exchange, ``ANNOUNCED``)."""
    if ctx.state is Stage.NEW:
        decode(mod, ctx)
    tr = mod.transport
    if ctx.state is Stage.DECODED:
        # one count swap, every size an owner needs for the whole step (the only data the host reads): per peer
        # the values and partial bags it sends, and the distinct owned and replica rows they read (each packed
        # beside one of the first two)
        ctx.recv_counts = unpack_counts(tr.exchange_counts(pack_counts(ctx, mod.rank)).tolist())
        ctx.state = Stage.COUNTED
    if ctx.state is Stage.COUNTED:  # the ids and scales together, in one exchange
        announced(ctx, mod.rank, tr.exchange_packed(ids_parts(ctx), ids_layout(ctx), ["ids", "ids"],
                                                    device=mod.weight.device))


def ids_parts(ctx: SendContext) -> list[list[torch.Tensor]]:
    """Per owner, the ``(offset, partial bag)`` pairs and scales of the values it owns."""
    return [[i.contiguous(), sc.contiguous()] for i, sc in zip(ctx.out_ids, ctx.out_scale)]


def ids_layout(ctx: SendContext) -> list[list[tuple]]:
    """What every peer sends this rank in :func:`ids_parts` (``exchange_packed``'s ``recv_parts``)."""
    return [[(torch.int64, (2,), c[0]), (torch.float32, (), c[0])] for c in ctx.recv_counts]


def announced(ctx: SendContext, me: int, got: list) -> None:
    """The ids and scales every peer sent (``got``: per peer ``[ids, scales]``, ``None`` for this rank)."""
    ids0, s0 = ctx.out_ids[me][:0], ctx.out_scale[me][:0]
    ctx.recv_ids = [ids0 if x is None else x[0] for x in got]
    ctx.recv_scale = [s0 if x is None else x[1] for x in got]
    ctx.my_ids, ctx.my_scale = ctx.out_ids[me], ctx.out_scale[me]
    ctx.out_ids = ctx.out_scale = None
    ctx.state = Stage.ANNOUNCED


_HALF = 32  # two counts per int64 of the count swap: a low and a high half


def pack_counts(ctx: SendContext, me: int, ahead: bool = False) -> torch.Tensor:
    """``[W, 2]`` int64: per peer ``[values | owned rows << 32, partial bags | replica rows << 32]`` (this rank's
    own row ``[0, 0]``): four counts in the two numbers a peer receives. ``ahead`` (the header of the step
    before's pooled exchange): values + 1, so that ``[0, 0]`` says no batch was prefetched."""
    rows = []
    for p, (v, b, (uo, ur)) in enumerate(zip(ctx.v_counts, ctx.p_counts, ctx.u_counts)):
        if max(v + 1, b) >> _HALF:
            raise InputError(f"sharded embedding (rank {me}): {v} values in {b} partial bags for rank {p}; "
                             f"a batch sends each rank fewer than 2**{_HALF} - 1")
        rows.append([v + ahead | uo << _HALF, b | ur << _HALF] if p != me else [0, 0])
    return torch.tensor(rows, dtype=torch.int64)


def unpack_counts(cnt: list, ahead: bool = False) -> list[tuple[int, int, int, int]]:
    """:func:`pack_counts`' rows as ``(values, partial bags, owned rows, replica rows)`` per peer."""
    low = (1 << _HALF) - 1
    return [((a & low) - ahead, b & low, a >> _HALF, b >> _HALF) for a, b in cnt]


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
    ctx.v_counts = v_counts = split_by_rank(src, W)
    ctx.u_counts = distinct_rows(mod.tmap, src, off, W)
    ids = torch.stack([off[order], local_pbag[order]], 1)  # (offset on source, partial bag), rank-major
    ctx.out_ids = list(torch.split(ids, v_counts))
    ctx.out_scale = list(torch.split(ctx.scale[order], v_counts))
    ctx.state = Stage.DECODED


def distinct_rows(tm, src: torch.Tensor, off: torch.Tensor, W: int) -> list[tuple[int, int]]:
    """Per owner, how many distinct owned rows and distinct replica rows the batch's values read there (host work:
    the owner's update sizes its per-row sums by them and reads no size the device computes)."""
    key = torch.unique((src << tm.SHIFT) | off)
    ksrc = key >> tm.SHIFT
    rep = (key & tm.OFF_MASK) >= tm.num_owned.index_select(0, ksrc)  # replicas follow the owned rows
    return list(zip(split_by_rank(ksrc[~rep], W), split_by_rank(ksrc[rep], W)))


def _served(ctx: SendContext, q: int, me: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(offset, partial bag)`` pairs and scales requester ``q`` sent this rank."""
    return (ctx.my_ids, ctx.my_scale) if q == me else (ctx.recv_ids[q], ctx.recv_scale[q])


def _partial_bags_of(ctx: SendContext, q: int, me: int) -> int:
    return ctx.p_counts[me] if q == me else ctx.recv_counts[q][1]


def _rows_of(ctx: SendContext, q: int, me: int) -> tuple[int, int]:
    """The distinct owned and replica rows requester ``q``'s values read on this rank."""
    return ctx.u_counts[me] if q == me else ctx.recv_counts[q][2:]


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
    send = [pooled[q] if q != me else pooled[q][:0] for q in range(W)]
    counts = [c if q != me else 0 for q, c in enumerate(ctx.p_counts)]
    if rides_header(mod, ctx):
        back = pooled_with_header(mod, ctx, send, counts)
    else:
        back = mod.transport.exchange(send, recv_counts=counts, kind="pooled")
    back[me] = pooled[me]
    ctx.pooled = None
    partials = torch.cat(back)  # ordered like the partial bags (rank-major)
    out = torch.zeros((ctx.nbags, mod.dim), dtype=mod.weight.dtype, device=mod.weight.device)
    out.index_add_(0, ctx.p_bag.to(out.device), partials)
    F_ = len(mod.feature_names)
    return out.view(F_, ctx.B, mod.dim).transpose(0, 1).reshape(ctx.B, F_ * mod.dim)


def rides_header(mod, ctx: SendContext) -> bool:
    """Whether this batch's pooled exchange carries the next batch's counts (training with prefetched batches over
    a fusing transport): its ids then ride this batch's gradient exchange."""
    return bool(ctx.training and mod.prefetching and mod.transport.fuses_exchanges and mod.world_size > 1)


def pooled_with_header(mod, ctx: SendContext, send: list, counts: list) -> list[torch.Tensor]:
    """The pooled exchange with a header: the next prefetched batch's counts (:func:`pack_counts`, ``[0, 0]``:
    none), read once here; that batch becomes ``COUNTED``."""
    W, me = mod.world_size, mod.rank
    ctx.nxt = nxt = mod.queued_undistributed()
    hdr = pack_counts(nxt, me, ahead=True) if nxt is not None else torch.zeros((W, 2), dtype=torch.int64)
    got = mod.transport.exchange_packed([[hdr[p], send[p]] for p in range(W)],
                                        [[(torch.int64, (), 2), (mod.weight.dtype, (mod.dim,), c)] for c in counts],
                                        ["meta", "pooled"], device=mod.weight.device)
    heads = torch.stack([x[0] for x in got if x is not None]).tolist()
    if any((h[0] > 0) != (nxt is not None) for h in heads):
        raise InputError(f"sharded embedding (rank {me}): ranks disagree on prefetching the next batch; "
                         "every rank calls prefetch for the same steps")
    if nxt is not None:
        heads.insert(me, [1, 0])  # (this rank's own entry: no values; its own come from its context)
        nxt.recv_counts = unpack_counts(heads, ahead=True)
        nxt.state = Stage.COUNTED
    return [send[me] if x is None else x[1] for x in got]


def grad_dist(mod, ctx: SendContext, grad_out: torch.Tensor) -> None:
    """Every partial bag's gradient back to the owner that pooled it (the next batch's ids and scales behind them
    when its counts rode this batch's pooled exchange)."""
    W, me = mod.world_size, mod.rank
    F_ = len(mod.feature_names)
    per_bag = grad_out.view(ctx.B, F_, mod.dim).transpose(0, 1).reshape(ctx.nbags, mod.dim)  # feature-major bags
    parts = list(torch.split(per_bag[ctx.p_bag.to(grad_out.device)], ctx.p_counts))
    n_recv = [_partial_bags_of(ctx, q, me) if q != me else 0 for q in range(W)]
    nxt = ctx.nxt
    if nxt is not None and nxt.state is Stage.COUNTED:
        layout = [[(grad_out.dtype, (mod.dim,), n), *ids] for n, ids in zip(n_recv, ids_layout(nxt))]
        got = mod.transport.exchange_packed([[g, *ids] for g, ids in zip(parts, ids_parts(nxt))], layout,
                                            ["grads", "ids", "ids"], device=grad_out.device)
        announced(nxt, me, [None if x is None else x[1:] for x in got])
        ctx.grads = [parts[me] if x is None else x[0] for x in got]
    else:
        ctx.grads = mod.transport.exchange([parts[q] if q != me else parts[q][:0] for q in range(W)],
                                           recv_counts=n_recv, kind="grads")
    ctx.grads[me] = parts[me]
    ctx.state = Stage.GRADS_SENT


def update(mod, ctx: SendContext) -> None:
    """Owner side: every requester's partial bags' gradients expanded to its values and summed per row, in the
    order it sent them; the owned rows' sums of all requesters (in rank order) and the synced replica sums applied
    in one fused update (``RowUpdates.apply_owned_and_replica_sums``)."""
    owned, replicas = [], []
    if mod.optimizer is not None:
        for q in range(mod.world_size):
            uo, ur = _rows_of(ctx, q, mod.rank)
            if uo + ur:
                ids_q, sc_q = _served(ctx, q, mod.rank)
                rows, sums = row_sums(ids_q[:, 0], ids_q[:, 1], sc_q, ctx.grads[q], uo + ur)
                owned.append((rows[:uo], sums[:uo]))
                if ur:
                    replicas.append((rows[uo:], sums[uo:]))
        mod.apply_owned_and_replica_sums(owned, replicas)
    ctx.state = Stage.UPDATED


def row_sums(rows: torch.Tensor, pbag: torch.Tensor, scale: torch.Tensor, g_bags: torch.Tensor, u: int):
    """The sum per row of the values ``rows`` (partial bag ``pbag``, weight ``scale``) of one requester, over its
    ``u`` distinct rows (counted by the requester): ``(rows, sums)``, rows ascending, each row's values summed in
    their order, as ``optim.aggregate_row_gradients`` sums them (a stable sort, then one ``embedding_bag`` over
    the segments), with no size read from the device: the segments' starts are scattered, not compacted."""
    dev = g_bags.device
    rows, pbag, scale = rows.to(dev), pbag.to(dev), scale.to(dev)
    srt, perm = torch.sort(rows, stable=True)
    n = srt.numel()
    new = torch.ones(n, dtype=torch.bool, device=dev)
    torch.ne(srt[1:], srt[:-1], out=new[1:])
    seg = torch.full((u + 1,), n, dtype=torch.int64, device=dev)
    seg.scatter_reduce_(0, torch.cumsum(new, 0) - 1, torch.arange(n, device=dev), "amin")  # each segment's start
    sums = F.embedding_bag(pbag.index_select(0, perm), g_bags.contiguous(), seg, mode="sum",
                           per_sample_weights=scale.index_select(0, perm).to(g_bags.dtype), include_last_offset=True)
    return srt.index_select(0, seg[:u]), sums
