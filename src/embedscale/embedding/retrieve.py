"""The retrieve design's stages (OPER 5.1-5.2): fetch the unique remote rows a batch reads, pool locally.

``input_dist``: the batch's ids are checked and decoded to ``(rank, offset)`` codes; only the remote values are
deduplicated: their codes, made unique and sorted, come in source-rank order, so the rows to request from each
peer are contiguous blocks; the requests go to their owners (a count exchange, then the ids; or, prefetched,
they already rode the previous step's row and gradient exchanges). ``compute``: every owner replies with the
rows asked of it; the fetched blocks land in a fetch area right after the rank's own storage
(``ShardedEmbedding.pool_table``, OPER 5.2), and one ``embedding_bag`` pools local and fetched rows together,
sample-major. ``output_dist``: the pooled rows are already the samples' ``[B, F * D]`` (no movement).
``grad_dist``: the gradients are summed per storage or fetch-area row in batch order (the one sort of the step),
and those of fetched rows go back to their owners (replicas through ``grad_sync``). ``update``: each owner adds
the peers' sums to its own (no second sort) and applies the fused optimizer once.

All-to-alls per training step: request counts, ids, rows, gradients: four. Prefetched (``prefetch``), the next
batch's counts ride the row exchange and its ids the gradient exchange: two.

Every stage function takes the module (a ``ShardedEmbedding``: its storage, address map, transport and
fused optimizer) and the batch's context (``embedding.context``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embedscale.comm.transport import PendingExchange
from embedscale.device import HOST, on_host
from embedscale.embedding.address_map import TorchAddressMap
from embedscale.embedding.context import RetrieveContext, Stage
from embedscale.embedding.optim import aggregate_row_gradients
from embedscale.errors import InputError


def split_by_rank(src: torch.Tensor, W: int) -> list[int]:
    """How many of ``src`` (ranks) name each of ``W`` ranks."""
    return torch.bincount(src, minlength=W).tolist()


# -- input_dist ------------------------------------------------------------------------------------------
def decode(mod, ctx: RetrieveContext) -> None:
    """``input_dist``'s local half (thread-safe: the prefetch thread runs it ahead): the batch's flat lookups
    (``ShardedEmbedding.flat_lookups``) and remote rows (``remote_rows``), with what a training step needs of
    them (replica slots of fetched rows; with ``grad_sync="alltoall"`` the replicas the batch reads)."""
    gids, ctx.bag, ctx.scale, _nbags, ctx.B, ctx.offsets, ctx.one_hot = mod.flat_lookups(ctx.features, ones=False)
    tm, W, me = mod.tmap, mod.world_size, mod.rank
    code, key, remote, ridx, runiq, rinv, per_rank = remote_rows(tm, gids, me, W, ops=mod.kernel_ops())
    r_slot = None
    if ctx.training and mod.num_slots:  # fetched rows that are replicas (held elsewhere, not here)
        rep = (code.index_select(0, ridx) & tm.REPLICA) != 0
        if bool(rep.any()):
            r_slot = torch.full((runiq.numel(),), -1, dtype=torch.int64, device=gids.device)
            r_slot[rinv[rep]] = tm.slots(gids.index_select(0, ridx[rep]))
    ctx.fused = bool(ctx.training and mod.num_slots and mod.grad_sync == "alltoall" and mod.optimizer is not None)
    ctx.t_slots = touched_replicas(mod, key, remote, r_slot) if ctx.fused else None
    ctx.key, ctx.ridx, ctx.rinv, ctx.per_rank, ctx.r_slot = key, ridx, rinv, per_rank, r_slot
    ctx.blocks = list(torch.split(runiq & tm.OFF_MASK, per_rank))
    ctx.plan = device_plan(mod, ctx) if mod.kernel_ops() is None else None
    ctx.state = Stage.DECODED


@dataclass
class DevicePlan:
    """Everything the device needs of a decoded batch, made on the host from its ids and the address map
    (OPER 5.1: the index conversion is host work) and moved to the storage's device in one go, so the step's
    pooling and its per-row gradient sums read no size the device computes.

    Forward: the pooling table row of every value in sample-major bags (``pos_s``, ``offsets_s``, ``scale_s``).
    Backward (training): the values sorted by pooling-table row (``src``: each one's bag, ``w``: its scale),
    ``seg`` the bounds of each row's run, ``rows`` the rows in order, the first ``k`` of them storage rows (the
    others the fetch area's, in request order), ``k_own`` of those owned; ``lrep`` / ``rsel`` pick the held
    and the fetched replica rows' sums, ``rep_slots`` their replica slots and ``rep_order`` the order that
    sorts those slots (``grad_sync``'s input, unique and ascending)."""

    n: int
    pos_s: torch.Tensor
    offsets_s: torch.Tensor
    scale_s: torch.Tensor | None
    src: torch.Tensor | None = None
    w: torch.Tensor | None = None
    seg: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    k: int = 0
    k_own: int = 0
    lrep: torch.Tensor | None = None
    rsel: torch.Tensor | None = None
    rep_slots: torch.Tensor | None = None
    rep_order: torch.Tensor | None = None


def device_plan(mod, ctx: RetrieveContext) -> DevicePlan:
    """The batch's :class:`DevicePlan`: computed on the host (where the decoded ids are), then moved to the
    storage's device once (no copy on a CPU run)."""
    n, dev = int(mod.weight.shape[0]), mod.weight.device
    pos = (ctx.key & mod.tmap.OFF_MASK).index_copy_(0, ctx.ridx, ctx.rinv + n)  # storage row or fetch-area row
    pos_s, scale_s, offsets_s, bag_s = sample_major(pos, ctx.scale, ctx.bag, ctx.offsets, ctx.B, ctx.one_hot)
    plan = DevicePlan(n, pos_s, offsets_s, scale_s)
    if ctx.training and pos.numel():
        R = sum(ctx.per_rank)
        keys = pos.to(torch.int32) if n + R <= torch.iinfo(torch.int32).max else pos
        srt, perm = torch.sort(keys, stable=True)  # each row's values summed in batch order (optim)
        rows, counts = torch.unique_consecutive(srt, return_counts=True)
        plan.rows = rows.to(torch.int64)
        plan.seg = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=plan.seg[1:])
        plan.src = bag_s.index_select(0, perm)
        plan.w = None if ctx.scale is None else ctx.scale.index_select(0, perm).to(mod.weight.dtype)
        plan.k = int(torch.searchsorted(plan.rows, n))
        plan.k_own = int(torch.searchsorted(plan.rows[:plan.k], mod.num_owned))
        if mod.num_slots:
            plan.lrep = torch.arange(plan.k_own, plan.k)
            held = mod.region_slot.index_select(0, plan.rows[plan.k_own:plan.k] - mod.num_owned)
            plan.rsel = torch.empty(0, dtype=torch.int64) if ctx.r_slot is None else \
                (ctx.r_slot >= 0).nonzero().squeeze(1)
            plan.rep_slots = held if ctx.r_slot is None else torch.cat([held, ctx.r_slot.index_select(0, plan.rsel)])
            plan.rep_order = torch.argsort(plan.rep_slots)
    if dev != HOST:  # the batch crosses to the device here, once
        for name in ("pos_s", "offsets_s", "scale_s", "src", "w", "seg", "rows", "lrep", "rsel", "rep_slots",
                     "rep_order"):
            t = getattr(plan, name)
            if t is not None:
                setattr(plan, name, t.to(dev, non_blocking=True))
    return plan


def input_dist(mod, ctx: RetrieveContext) -> None:
    """Decode the batch (unless ``prefetch`` did) and announce its requests to their owners."""
    if ctx.state is Stage.NEW:
        decode(mod, ctx)
    announce(mod, ctx)


def announce(mod, ctx: RetrieveContext) -> None:
    """``input_dist``'s exchange: this rank's requests to their owners, and the peers' to this rank, as far as a
    previous step did not carry them already (``COUNTED``: their counts rode the previous row exchange)."""
    W, me, tr = mod.world_size, mod.rank, mod.transport
    fused = ctx.fused and ctx.training
    dev = mod.weight.device
    t_slots = ctx.t_slots.to(dev) if fused else None
    if ctx.state is not Stage.ANNOUNCED:  # the requested offsets cross to the device (what peers get back)
        blocks = [b.to(dev) for b in ctx.blocks]
    if ctx.state is Stage.COUNTED:
        rc = ctx.recv_counts  # as announced: with the replica slots when the batch was decoded fused
        got = tr.exchange([torch.cat([b, ctx.t_slots.to(dev)]) if ctx.fused else b for b in blocks],
                          recv_counts=[a + b if p != me else 0 for p, (a, b) in enumerate(rc)], kind="ids")
        ctx.requests = [x[:a] for x, (a, _b) in zip(got, rc)]
        ctx.peer_slots = [x[a:] for x, (a, _b) in zip(got, rc)] if fused else None
    elif ctx.state is Stage.DECODED and fused:  # the replica rows the batch read travel with the requests
        cnt = tr.exchange_counts(torch.tensor([[c, t_slots.numel()] if p != me else [0, 0]
                                               for p, c in enumerate(ctx.per_rank)], dtype=torch.int64,
                                              device=mod.weight.device))
        got = tr.exchange([torch.cat([b, t_slots]) if p != me else b for p, b in enumerate(blocks)],
                          recv_counts=cnt.sum(1).tolist(), kind="ids")
        ctx.requests = [x[:c] for x, c in zip(got, cnt[:, 0].tolist())]
        ctx.peer_slots = [x[c:] for x, c in zip(got, cnt[:, 0].tolist())]
    elif ctx.state is Stage.DECODED:
        ctx.requests = tr.exchange(blocks, kind="ids")
        ctx.peer_slots = None
    if fused:
        ctx.peer_slots[me] = t_slots
        mod.stats["grad_sync_alltoall_bytes"] = mod.stats.get("grad_sync_alltoall_bytes", 0) + \
            (W - 1) * ctx.t_slots.numel() * (8 + mod.dim * mod.weight.element_size())
    elif ctx.state is Stage.ANNOUNCED:  # announced ahead, looked up without training: no replica slots
        ctx.peer_slots = None
    ctx.state = Stage.ANNOUNCED


# -- compute -----------------------------------------------------------------------------------------------
def start_rows(mod, ctx: RetrieveContext, background: bool = True) -> None:
    """``compute``'s first half: owners reply with the rows asked of them, the row exchange started and not
    waited for (``ShardedEmbedding.start``: the model computes its bottom MLP meanwhile, OPER 5.2); without
    ``background``, exchanged now (nothing to overlap: a blocking all-to-all is cheaper)."""
    me = mod.rank
    dev = mod.weight.device
    replies = [mod.weight.index_select(0, r.to(dev)) if p != me else mod.weight[:0]
               for p, r in enumerate(ctx.requests)]
    ctx.fetching = exchange_rows(mod, ctx, replies, background)
    ctx.state = Stage.FETCHING


def start_ahead(mod, ctx: RetrieveContext) -> None:
    """``start_rows`` ahead of the bottom MLP when it need not wait: not while the next batch's counts, which ride
    this row exchange, are still being decoded on the input pipeline's worker (the MLP overlaps that decoding
    instead; ``compute`` starts the exchange after it). With ``overlap_backward``, its gradient exchange overlaps
    the bottom MLP's backward too (``grad_dist``)."""
    ctx.overlap = bool(mod.overlap_backward)
    if not (rides_header(mod, ctx) and not mod.next_ready()):
        start_rows(mod, ctx)


def rides_header(mod, ctx: RetrieveContext) -> bool:
    """Whether this batch's row exchange carries the next batch's counts (training with prefetched batches over a
    fusing transport)."""
    return bool(ctx.training and mod.prefetching and mod.transport.fuses_exchanges and mod.world_size > 1)


def compute(mod, ctx: RetrieveContext) -> None:
    """Owners reply with the rows asked of them (unless ``start_rows`` did); the fetched rows land after the
    storage; one lookup pools all."""
    if ctx.state is not Stage.FETCHING:
        start_rows(mod, ctx, background=False)
    R = sum(ctx.per_rank)
    dev = mod.weight.device
    ctx.n = n = mod.weight.shape[0]
    table = mod.pool_table(R)
    fetched = rows_received(mod, ctx)
    if R:
        torch.cat(fetched, out=table[n:n + R])
    plan = ctx.plan
    if plan is not None and plan.n == n and mod.kernel_ops() is None:  # the host-made plan: no size read here
        ctx.out = F.embedding_bag(plan.pos_s, table[:n + R], plan.offsets_s, mode="sum", include_last_offset=True,
                                  per_sample_weights=None if plan.scale_s is None else plan.scale_s.to(table.dtype))
        ctx.pos, ctx.bag_s = None, plan.src  # (not None: the PyTorch ops pooled, kernel_pooled is false)
        ctx.state = Stage.POOLED
        return
    ctx.plan = None
    out, pos, bag_s = pool_local_and_fetched(table[:n + R], n, ctx.key, ctx.ridx, ctx.rinv, ctx.scale, ctx.bag,
                                             ctx.offsets, ctx.B, ctx.one_hot, off_mask=mod.tmap.OFF_MASK,
                                             ops=mod.kernel_ops())
    ctx.out, ctx.pos, ctx.bag_s = out, pos.to(dev), None if bag_s is None else bag_s.to(dev)
    ctx.state = Stage.POOLED


def exchange_rows(mod, ctx: RetrieveContext, replies: list, background: bool) -> PendingExchange:
    """The row exchange, started (``rows_received`` waits for it). Training with prefetched batches over a fusing
    transport, it carries a header: how many rows each rank will request next step (``ctx.nxt``)."""
    W, me, tr = mod.world_size, mod.rank, mod.transport
    per_rank = ctx.per_rank
    ctx.with_header = rides_header(mod, ctx)
    if not ctx.with_header:
        counts = [c if p != me else 0 for p, c in enumerate(per_rank)]
        return tr.exchange_start(replies, recv_counts=counts, kind="rows") if background else \
            PendingExchange(tr.exchange(replies, recv_counts=counts, kind="rows"))
    ctx.nxt = nxt = mod.queued_undistributed()
    hdr = nxt.header(me, W) if nxt is not None else torch.zeros((W, 2), dtype=torch.int64)
    dev = mod.weight.device
    return tr.exchange_packed_start([[hdr[p], replies[p]] for p in range(W)],
                                    [[(torch.int64, (), 2), (mod.weight.dtype, (mod.dim,), c)] for c in per_rank],
                                    ["meta", "rows"], background=background, device=dev)


def rows_received(mod, ctx: RetrieveContext) -> list[torch.Tensor]:
    """Wait for the row exchange: the fetched rows from every rank (with a header: the next batch's context
    becomes ``COUNTED``)."""
    got, ctx.fetching = ctx.fetching.wait(), None
    if not ctx.with_header:
        return got
    W, me, nxt = mod.world_size, mod.rank, ctx.nxt
    fetched = [x[1] if x is not None else mod.weight[:0] for x in got]
    heads = torch.stack([x[0] for p, x in enumerate(got) if p != me]).view(-1, 2).tolist()
    if any((h[0] > 0) != (nxt is not None) for h in heads):
        raise InputError(f"sharded embedding (rank {me}): ranks disagree on prefetching the next batch; "
                         "every rank calls prefetch for the same steps")
    if nxt is not None:
        rc = [(0, 0)] * W
        for p, h in zip([p for p in range(W) if p != me], heads):
            rc[p] = (h[0] - 1, h[1])
        nxt.recv_counts = rc
        nxt.state = Stage.COUNTED
    return fetched


def output_dist(mod, ctx: RetrieveContext) -> torch.Tensor:
    """The pooled rows are sample-major already: ``[B, F * D]`` with no transpose and no exchange."""
    out, ctx.out = ctx.out, None
    return out.view(ctx.B, len(mod.feature_names) * mod.dim)


# -- grad_dist -------------------------------------------------------------------------------------------
def row_sums(mod, ctx: RetrieveContext, grad_out: torch.Tensor):
    """One gradient per storage / fetch-area row, its values summed in batch order (feature-major, as
    single-process lookups and the PGAS design sum them): ``(rows_l, g_l, g_r)``, the storage rows read with
    their sums, and every fetched row's sum (request order)."""
    n, R = ctx.n, sum(ctx.per_rank)
    if ctx.kernel_pooled:  # the C++ kernel: one pass, no sort; storage rows in first-seen order
        return mod.kernel_row_sums(ctx.pos, (ctx.offsets, ctx.one_hot, ctx.B), ctx.scale, grad_out, n, R)
    plan = ctx.plan
    if plan is not None:  # the host sorted the values by row: one segment sum (optim.aggregate_row_gradients)
        if plan.rows is None:
            return grad_out.new_empty(0, dtype=torch.int64), grad_out.new_zeros(0, mod.dim), \
                grad_out.new_zeros(R, mod.dim)
        g = F.embedding_bag(plan.src, grad_out.reshape(-1, mod.dim).contiguous(), plan.seg, mode="sum",
                            per_sample_weights=plan.w, include_last_offset=True)
        return plan.rows[:plan.k], g[:plan.k], g[plan.k:]
    dev = grad_out.device
    grad_out = grad_out.reshape(-1, mod.dim)  # a row per sample-major bag
    rows, g = aggregate_row_gradients(ctx.pos, grad_out, src_index=ctx.bag_s.to(dev),
                                      scale=None if ctx.scale is None else ctx.scale.to(dev), num_rows=n + R)
    k = int(torch.searchsorted(rows, n))
    return rows[:k], g[:k], g[k:]  # every fetched row was read: rows[k:] == n + arange(R), in request order


def replica_grads(mod, ctx: RetrieveContext, rows_l, g_l, g_r, r_rep) -> None:
    """The gradients of the replica rows the batch read, in ``touched_replicas``' order: the held ones
    (ascending storage rows), then the fetched ones (request order); into ``ctx.rep_slots`` / ``ctx.rep_g``."""
    dev = g_l.device
    plan = ctx.plan
    if plan is not None:  # which sums are replicas' was decided on the host
        ctx.rep_slots = plan.rep_slots
        ctx.rep_g = torch.cat([g_l.index_select(0, plan.lrep), g_r.index_select(0, plan.rsel)])
        return
    lrep = (rows_l >= mod.num_owned).nonzero().squeeze(1)
    if ctx.kernel_pooled and lrep.numel() > 1:  # ascending storage rows, as touched_replicas lists them
        lrep = lrep.index_select(0, torch.argsort(rows_l.index_select(0, lrep)))
    slots = [mod.region_slot.to(dev).index_select(0, rows_l.index_select(0, lrep) - mod.num_owned)]
    rep_g = [g_l.index_select(0, lrep)]
    if r_rep is not None:
        rsel = r_rep.nonzero().squeeze(1)
        slots.append(ctx.r_slot.to(dev).index_select(0, rsel))
        rep_g.append(g_r.index_select(0, rsel))
    ctx.rep_slots, ctx.rep_g = torch.cat(slots), torch.cat(rep_g)


def grad_dist(mod, ctx: RetrieveContext, grad_out: torch.Tensor) -> None:
    """The fetched rows' gradient sums back to their owners (replica sums behind them with
    ``grad_sync="alltoall"``; the next batch's requests behind them when its counts rode the row exchange).
    A lookup the model started ahead (``ctx.overlap``: its bottom MLP ran beside the row exchange) leaves the
    exchange in flight, its bottom MLP's backward beside it (OPER 5.2), and ``grads_received`` waits for it."""
    me, W, tr = mod.rank, mod.world_size, mod.transport
    rows_l, g_l, g_r = row_sums(mod, ctx, grad_out)
    r_rep = (ctx.r_slot >= 0).to(g_r.device) if ctx.r_slot is not None else None
    send = g_r.masked_fill(r_rep.unsqueeze(1), 0.0) if r_rep is not None else g_r
    blocks = list(torch.split(send, ctx.per_rank))
    blocks[me] = send[:0]
    if mod.num_slots:
        replica_grads(mod, ctx, rows_l, g_l, g_r, r_rep)
    peer_slots, requests = ctx.peer_slots, ctx.requests
    if peer_slots is not None:  # grad_sync "alltoall": they ride behind each peer's block
        blocks = [torch.cat([b, ctx.rep_g]) if p != me else b for p, b in enumerate(blocks)]
    g_counts = [r.numel() + (peer_slots[p].numel() if peer_slots is not None else 0) if p != me else 0
                for p, r in enumerate(requests)]
    nxt, background = ctx.nxt, ctx.overlap
    ctx.with_ids = nxt is not None and nxt.state is Stage.COUNTED
    if ctx.with_ids:
        ids = [torch.cat([b, nxt.t_slots]) if nxt.fused else b for b in nxt.blocks]
        ctx.grads_in = tr.exchange_packed_start([[blocks[p], ids[p]] for p in range(W)],
                                                [[(send.dtype, (mod.dim,), g_counts[p]), (torch.int64, (), a + b)]
                                                 for p, (a, b) in enumerate(nxt.recv_counts)], ["grads", "ids"],
                                                background=background, device=send.device)
    elif background:
        ctx.grads_in = tr.exchange_start(blocks, recv_counts=g_counts, kind="grads")
    else:
        ctx.grads_in = PendingExchange(tr.exchange(blocks, recv_counts=g_counts, kind="grads"))
    ctx.rows_l, ctx.g_l = rows_l, g_l
    ctx.state = Stage.GRADS_SENDING
    if not background:
        grads_received(mod, ctx)


def grads_received(mod, ctx: RetrieveContext) -> None:
    """Wait for ``grad_dist``'s exchange: what every peer sent back (and, riding it, the next batch's requests
    from every peer: that context becomes ``ANNOUNCED``)."""
    me, requests, nxt = mod.rank, ctx.requests, ctx.nxt
    got, ctx.grads_in = ctx.grads_in.wait(), None
    if ctx.with_ids:
        rc = nxt.recv_counts
        nxt.requests = [nxt.blocks[me][:0] if x is None else x[1][:a] for x, (a, _b) in zip(got, rc)]
        nxt.peer_slots = [None if x is None else x[1][a:] for x, (a, _b) in zip(got, rc)] if nxt.fused else None
        nxt.state = Stage.ANNOUNCED
        empty = ctx.g_l.new_empty((0, mod.dim))
        got = [empty if x is None else x[0] for x in got]
    ctx.recv = [x[:r.numel()] for x, r in zip(got, requests)]
    if ctx.peer_slots is not None:
        ctx.peer_g = [ctx.rep_g if p == me else x[r.numel():] for p, (x, r) in enumerate(zip(got, requests))]
    ctx.state = Stage.GRADS_SENT


# -- update ------------------------------------------------------------------------------------------------
def update(mod, ctx: RetrieveContext) -> None:
    """Owner side: the rows read here plus the rows peers read from here (replicas are synced instead), each
    peer's rows unique and already summed there, added to this rank's sums (no second sort); one fused update."""
    me = mod.rank
    dev = ctx.g_l.device
    if ctx.plan is not None and mod.optimizer is not None:
        update_planned(mod, ctx)
        return
    own = [(ctx.rows_l, ctx.g_l)] + [(r.to(dev), g) for p, (r, g) in enumerate(zip(ctx.requests, ctx.recv))
                                     if p != me and r.numel()]
    replicas = None
    if ctx.peer_slots is not None:  # every rank's replica sums, in rank order: the same bits everywhere
        replicas = [(s.to(dev), g) for s, g in zip(ctx.peer_slots, ctx.peer_g)]
    mod.apply_row_sums(own, replicas, kernel=ctx.kernel_pooled)
    if ctx.peer_slots is None and mod.num_slots:
        mod.sync_and_apply_replicas(ctx.rep_slots, ctx.rep_g)
    ctx.state = Stage.UPDATED


def update_planned(mod, ctx: RetrieveContext) -> None:
    """``update`` of a batch pooled by its :class:`DevicePlan`: the replica gradients synced first, then one
    fused update of the owned rows (this rank's sums, then each peer's) and the replica rows this rank holds
    (every rank's sums in rank order, or the synced sums), reading one count on the host
    (``RowUpdates.merge_and_apply``). The same rows and bits as the update of the other path."""
    me, plan = mod.rank, ctx.plan
    dev = ctx.g_l.device
    owned = mod.num_owned
    peers = [(torch.where(r.to(dev) < owned, r.to(dev), -1), g) for p, (r, g) in enumerate(zip(ctx.requests, ctx.recv))
             if p != me and r.numel()]  # replica rows peers read here are synced instead
    rmap = mod.replica_storage_rows  # replica slot -> storage row here, -1: not held here
    if ctx.peer_slots is not None:  # every rank's replica sums, in rank order
        replicas = [(rmap.index_select(0, s.to(dev)), g) for s, g in zip(ctx.peer_slots, ctx.peer_g)]
    elif mod.num_slots:
        replicas = [(rmap.index_select(0, s), g) for s, g in mod.sync_replica_lists(plan.rep_slots, ctx.rep_g,
                                                                                    plan.rep_order)]
    else:
        replicas = []
    mod.merge_and_apply((ctx.rows_l[:plan.k_own], ctx.g_l[:plan.k_own]), peers + replicas)
    ctx.state = Stage.UPDATED


# -- the index conversion and the pooling of OPER 5.1-5.2 ---------------------------------------------------
def remote_rows(tm: TorchAddressMap, gids: torch.Tensor, me: int, W: int, ops=None):
    """Decode a batch's global ids on rank ``me`` and deduplicate the values read from other ranks (OPER 5.1):
    ``(code, key, remote, ridx, runiq, rinv, per_rank)``: packed codes, the codes without the replica bit,
    which values are remote and their positions, the unique remote keys (source-rank order, so each peer's
    rows are one block), each remote value's index among them, and how many rows come from each rank.
    With ``ops`` (the C++ kernel; CPU ids) the codes, keys and remote values come from one pass."""
    if ops is not None and on_host(gids) and gids.dtype == torch.int64:
        n = gids.numel()
        code, key = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        remote, ridx = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.int64)
        ridx = ridx[:ops.sharded_remote_split(gids.contiguous(), tm.row_code, tm.SHIFT, tm.KEY_MASK, me, code, key,
                                              remote, ridx)]
        runiq, rinv = ops.sharded_remote_unique(key, ridx)  # hashed, then the unique keys sorted: the same
    else:
        code = tm.codes(gids)
        key = code & tm.KEY_MASK
        remote = (key >> tm.SHIFT) != me
        ridx = remote.nonzero().squeeze(1)
        runiq, rinv = torch.unique(key.index_select(0, ridx), sorted=True, return_inverse=True)
    return code, key, remote, ridx, runiq, rinv, split_by_rank(runiq >> tm.SHIFT, W)


def pool_local_and_fetched(table: torch.Tensor, fetch_base: int, key: torch.Tensor, ridx: torch.Tensor,
                           rinv: torch.Tensor, scale, bag: torch.Tensor, offsets: torch.Tensor, B: int,
                           one_hot: bool, *, off_mask: int, ops=None):
    """One ``embedding_bag`` over ``table`` (the storage, then the fetched rows from row ``fetch_base``):
    local values read their storage row, remote ones their fetched row; bags pooled sample-major so the
    output is ``[B * F, D]`` = ``[B, F * D]``. ``key`` and ``rinv`` are overwritten. Returns ``(out, pos,
    bag_s)``: each value's table row and its sample-major bag, in the original value order (for backward).
    With ``ops`` (the C++ kernel, ``kernels.fused_ops()``; float32 CPU table) the kernel pools the
    feature-major values straight into the sample-major output, the same bits, and ``bag_s`` is ``None``."""
    dev = table.device
    pos = key.bitwise_and_(off_mask)  # storage row of local values (the map's OFF_MASK) ...
    pos.index_copy_(0, ridx, rinv.add_(fetch_base))  # ... fetch-area row of remote ones
    if ops is not None and B:
        out = ops.fused_pooled_forward(table, pos, offsets, None if scale is None else scale.contiguous(), B,
                                       (offsets.numel() - 1) // B, False)
        return out, pos, None
    pos_s, scale_s, offsets_s, bag_s = sample_major(pos, scale, bag, offsets, B, one_hot)
    out = F.embedding_bag(pos_s.to(dev), table, offsets_s.to(dev), mode="sum", include_last_offset=True,
                          per_sample_weights=None if scale_s is None else scale_s.to(device=dev, dtype=table.dtype))
    return out, pos, bag_s


def sample_major(pos: torch.Tensor, scale, bag: torch.Tensor, offsets: torch.Tensor, B: int, one_hot: bool):
    """Reorder feature-major lookups (bag ``f * B + b``, as a KJT holds them) into sample-major bags
    (``b * F + f``), each bag's values kept in their order, so that pooling them gives ``[B, F * D]``
    with no transpose. Returns ``(pos, scale, offsets, bag_s)``; ``bag_s`` is every value's sample-major
    bag, in the *original* value order (what backward needs to sum in feature-major order)."""
    F_ = (offsets.numel() - 1) // B if B else 0
    bag_s = (bag % B) * F_ + bag // B if B else bag
    if one_hot:
        return (pos.view(F_, B).t().reshape(-1), None if scale is None else scale.view(F_, B).t().reshape(-1),
                offsets, bag_s)
    lengths_s = (offsets[1:] - offsets[:-1]).view(F_, B).t().reshape(-1)
    offsets_s = torch.zeros_like(offsets)
    torch.cumsum(lengths_s, 0, out=offsets_s[1:])
    dest = offsets_s.index_select(0, bag_s) + torch.arange(pos.numel(), device=pos.device) - \
        offsets.index_select(0, bag)
    pos_s = torch.empty_like(pos).index_copy_(0, dest, pos)
    scale_s = None if scale is None else torch.empty_like(scale).index_copy_(0, dest, scale)
    return pos_s, scale_s, offsets_s, bag_s


def touched_replicas(mod, key: torch.Tensor, remote: torch.Tensor, r_slot) -> torch.Tensor:
    """Replica slots a batch reads: the held replica rows its local values read (ascending storage row),
    then the replicas it fetched (request order), the order backward lists their gradients in."""
    held = int(mod.weight.shape[0]) - mod.num_owned
    ops = mod.kernel_ops()
    if ops is not None and on_host(key):  # one pass, a flag per held replica
        out = [ops.sharded_local_replicas(key, remote, mod.num_owned, mod.tmap.OFF_MASK,
                                          mod.region_slot[:held].contiguous())]
    else:
        off = key & mod.tmap.OFF_MASK
        sel = ((~remote) & (off >= mod.num_owned)).nonzero().squeeze(1)
        flag = torch.zeros(held, dtype=torch.bool, device=key.device)
        flag.index_fill_(0, off.index_select(0, sel) - mod.num_owned, True)
        out = [mod.region_slot.index_select(0, flag.nonzero().squeeze(1))]
    if r_slot is not None:
        out.append(r_slot[r_slot >= 0])
    return torch.cat(out)
