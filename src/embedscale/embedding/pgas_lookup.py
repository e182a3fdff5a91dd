"""``PgasShardedEmbedding``: the sharded embedding with its communication fused into the lookup.

Same plans, same address map, same results as ``ShardedEmbedding`` (bitwise: every pooled vector and
every row update is computed by the same operations on the same values in the same order), but the
embedding storage, the pooled outputs and the fetched rows live in a symmetric heap
(``comm.pgas.SymmetricHeap``) that every rank of the host maps, and the heavy data moves by one-sided
writes and reads fused with the lookup:

``send`` (PGAS paper, section III-C, Listing 2): each rank receives the ids of the values it owns for
    the whole global batch (one small exchange through the heap), pools them chunk by chunk and writes
    each pooled vector straight to its final position ``[sample, feature]`` in the requesting rank's
    output tensor, which lives in the requester's heap segment (``GetEmbOwnerId`` -> remote store). No
    all_to_all, no staging buffer, no unpack: the output a rank returns *is* the buffer its peers
    wrote into. A bag whose rows live on several ranks (row-wise plans) has several partial sums; those
    go through the transport and the requester adds them in rank order, exactly as the collective
    design does, so results stay bitwise identical. The completion signal of a peer is the (often
    empty) message that follows its last write: a per-peer signal, not a barrier.
``retrieve`` (OPER section 5.2, local-remote lookup overlapping): the rows a rank's mini-batch needs
    from other ranks of its host are read by one-sided gets from the owners' segments (the owners do
    nothing) into a fetch area placed right after the rank's own storage, so one ``embedding_bag``
    pools local and fetched rows together. The batch is pooled in chunks of bags; the gets of chunk
    k+1 run on a helper thread while chunk k is pooled (OPER Fig. 4(b)). Before reading a peer's rows a
    rank waits for the peer's *version* word (bumped after each update), so it never reads rows in the
    middle of an update.
Backward (both): the gradients of remote rows / partial bags are pushed into per-source slots in the
    owner's segment (the transport's rings: one writer per slot, no races), the owner sums them per
    row in the collective design's order and applies the fused optimizer (``embedding.optim``);
    replicated rows go through ``grad_sync`` (OPER 5.3) as in ``ShardedEmbedding``.

Stages: the module runs ``ShardedEmbedding``'s stages (``input_dist`` / ``compute`` / ``output_dist``, backward
``grad_dist`` / ``update``, one autograd function for every design) with this module's stage functions
(``retrieve_*`` and ``send_*`` below) and a per-batch context (``embedding.context``): ``send``'s ``input_dist`` is
the ids exchange, its ``compute`` the owners' pooling and remote writes, its ``output_dist`` the wait for them and
the partial sums; ``retrieve``'s ``compute`` is the gets overlapped with pooling.

Ranks on other hosts (``PgasTransport.ranks_per_host``) are served through the transport's
collective fallback inside the same steps: their pooled partials / rows travel by ``exchange``.

Lifetime rule: the output of a ``send`` forward is a view of this rank's heap; it stays valid until the
forward after next (outputs are double-buffered) — clone it to keep it longer. Autograd notices misuse
(a later forward writes the buffer in place). The module must stay where it was built (no ``.to()``).
Accelerators: the heap uses CUDA symmetric memory there; designed for, untested here.
"""

from __future__ import annotations

import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from embedscale.comm.pgas import PgasTransport
from embedscale.data.batch import JaggedFeatures
from embedscale.device import HOST
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.context import IdsLayout, PgasRetrieveContext, PgasSendContext, Stage
from embedscale.embedding.interop import as_jagged
from embedscale.embedding.optim import aggregate_row_gradients
from embedscale.embedding.retrieve import pool_local_and_fetched, remote_rows
from embedscale.embedding.sharded import _SHIFT, ShardedEmbedding, Stages
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec

_MASK = (1 << _SHIFT) - 1


class HeapTooSmall(ConfigError):
    """A live migration's map needs more storage rows than a ``PgasShardedEmbedding``'s heap holds."""
_VERSION_LINE = 0


def _bits_as(t: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Reinterpret the bytes of 1-D ``t`` as ``[len(t), cols]`` of ``dtype`` (lossless, no arithmetic)."""
    return t.contiguous().view(dtype).view(t.shape[0], cols)


def _scale_bits(s: torch.Tensor) -> torch.Tensor:
    """float32 scales packed two per int64 word (bit copies)."""
    out = torch.zeros(s.numel() + s.numel() % 2, dtype=torch.float32)
    out[: s.numel()] = s
    return out.view(torch.int64)


class PgasShardedEmbedding(ShardedEmbedding):
    """``ShardedEmbedding`` whose lookups write and read a symmetric heap directly (see module docstring).

    Args:
        tables, amap, rank, design, optimizer, lr, eps, grad_sync, sync_group, seed, device, dtype,
            validate: as ``ShardedEmbedding``.
        transport: a ``PgasTransport`` (its ranks, hosts and job id; its rings carry ids and gradients).
        max_batch_size: the largest mini-batch (samples) a rank's forward gets: sizes the output buffers
            (``send``) and, with ``max_ids_per_bag``, the fetch area (``retrieve``).
        max_ids_per_bag: expected ids per bag, for the fetch area (a batch needing more unique remote
            rows falls back to a private buffer for that batch: same results, one more copy).
        chunk_bags: bags pooled per chunk (the unit of overlap and of one burst of remote writes).
        fetch_rows: override the fetch area (rows).
        overlap: run the ``retrieve`` gets of chunk k+1 on a helper thread while chunk k is pooled.

    Example (on every rank of a job; ``amap`` from a plan)::

        tr = PgasTransport(ranks_per_host=4)
        emb = PgasShardedEmbedding(tables, amap, tr, rank, design="send", max_batch_size=4096)
        out = emb(features)       # [B, F * D], written by the owners straight into this rank's heap
    """

    def __init__(self, tables: list[TableSpec], amap: AddressMap, transport: PgasTransport, rank: int, *,
                 max_batch_size: int, max_ids_per_bag: float = 1.0, chunk_bags: int = 4096,
                 fetch_rows: int | None = None, overlap: bool = True, storage_spare: float = 0.0, **kwargs):
        if not isinstance(transport, PgasTransport):
            raise ConfigError(f"PgasShardedEmbedding needs a PgasTransport, got {type(transport).__name__}; "
                              "use ShardedEmbedding for other transports")
        super().__init__(tables, amap, transport, rank, **kwargs)
        if max_batch_size <= 0:
            raise ConfigError(f"PgasShardedEmbedding: max_batch_size must be positive, got {max_batch_size}")
        self.max_batch_size = int(max_batch_size)
        self.chunk_bags = max(1, int(chunk_bags))
        self.overlap = overlap
        W, me, D = self.world_size, rank, self.dim
        F_ = len(self.feature_names)
        storage = (amap.num_owned() + amap.num_replicas_held()).astype(np.int64)
        self._storage_rows = storage
        if storage_spare < 0:
            raise ConfigError(f"PgasShardedEmbedding: storage_spare must be >= 0, got {storage_spare}")
        # room for every rank's storage, and storage_spare more rows: a live migration edits the map in place
        # within it (adopt_address_map)
        self._cap = int(math.ceil(int(storage.max()) * (1.0 + float(storage_spare))))
        itemsize = self.weight.element_size()
        if fetch_rows is None:
            elsewhere = int(amap.num_rows)  # a bound: any row of another rank
            fetch_rows = min(elsewhere, int(math.ceil(self.max_batch_size * F_ * max(max_ids_per_bag, 1.0))))
        self.fetch_rows = int(fetch_rows) if self.design == "retrieve" else 0
        w_bytes = (self._cap + self.fetch_rows) * D * itemsize
        self._out_off = -(-w_bytes // 64) * 64
        out_rows = self.max_batch_size * F_ if self.design == "send" else 0
        total = self._out_off + 2 * out_rows * D * itemsize
        dev = self.weight.device
        self.heap = transport.new_heap(total, num_lines=1, device=dev)
        heap = self.heap
        n_me = int(storage[me])
        self._table = heap.view(me, 0, (self._cap + self.fetch_rows, D), self.weight.dtype)
        self._table[:n_me].copy_(self.weight)
        self.weight = self._table[:n_me]  # the storage now lives in the heap (peers read it in place)
        self._weight_ptr = self.weight.data_ptr()
        self._local = [p for p in heap.local_ranks]
        self._same_host = torch.tensor([heap.is_local(p) for p in range(W)])
        self._peer_weight = {p: heap.view(p, 0, (int(storage[p]), D), self.weight.dtype)
                             for p in self._local if p != me}
        self._out = {}
        if out_rows:
            for p in self._local:
                self._out[p] = [heap.view(p, self._out_off + k * out_rows * D * itemsize, (out_rows, D),
                                          self.weight.dtype) for k in range(2)]
        self._ctrl = {p: heap.ctrl(p) for p in self._local}
        self._version = 0
        self._publish_version()  # the initial rows are in place: peers wait for this before their first get
        self._epoch = 0
        self._pool: ThreadPoolExecutor | None = None
        self._warned_fetch = False
        self._blocks = self._feature_blocks() if self.design == "send" else None
        self.stages = PGAS_RETRIEVE if self.design == "retrieve" else PGAS_SEND

    def _feature_blocks(self) -> dict | None:
        """Where each feature's rows are when every table lives whole on one rank of this host, as one
        contiguous range of its storage, without replicas (table-wise plans): ``offset[f]`` (storage row
        of the table's row 0 on its owner) and ``features_of[q]`` (the features rank ``q`` owns).
        Then a feature's values form one block of the mini-batch and need no sort. None otherwise."""
        if any(not self.heap.is_local(p) for p in range(self.world_size)):
            return None
        tm = self.tmap
        per_table = []
        for t in range(len(self.tables)):
            a, b = int(tm.table_base[t]), int(tm.table_base[t + 1])
            src, off, slot = tm.decode(torch.arange(a, b, device=tm.device))
            if bool((slot >= 0).any()) or not bool((src == src[0]).all()) or \
                    not bool((off - torch.arange(b - a) == off[0]).all()):
                return None
            per_table.append((int(src[0]), int(off[0])))
        ft = self._feature_table.tolist()
        owner = [per_table[t][0] for t in ft]
        return {"offset": [per_table[t][1] for t in ft],
                "features_of": {q: [f for f, o in enumerate(owner) if o == q] for q in range(self.world_size)}}

    # -- signals ----------------------------------------------------------------------------------
    def _publish_version(self) -> None:
        """This rank's rows are updated: peers may read them for the next step."""
        self._version += 1
        self.heap.fence()
        self._ctrl[self.rank][_VERSION_LINE, 0] = self._version

    def _await_versions(self, peers: list[int]) -> None:
        v = self._version
        ctrl = self._ctrl
        if peers:
            self.heap.wait_until(lambda: all(int(ctrl[p][_VERSION_LINE, 0]) >= v for p in peers), peers,
                                 f"the rows of step {v}")

    # -- live migration in place -------------------------------------------------------------------
    def fits(self, amap: AddressMap) -> bool:
        """Whether every rank's storage under ``amap`` fits the heap's storage room (same answer on every rank)."""
        return int((amap.num_owned() + amap.num_replicas_held()).max()) <= self._cap

    def adopt_address_map(self, amap: AddressMap) -> None:
        """Run under ``amap`` (a live migration's edited map, ``embedding.migrate.migrate_in_place``) with the
        storage where it is: it grows or shrinks inside this rank's heap room (never out of the heap peers map),
        and the views of the peers' storage follow their new sizes. A map whose storage does not fit the room
        is a :class:`HeapTooSmall` (every rank raises it alike, before anything moved: the caller rebuilds)."""
        if not self.fits(amap):
            raise HeapTooSmall(f"rank {self.rank}: the new map needs "
                               f"{int((amap.num_owned() + amap.num_replicas_held()).max())} storage rows on some "
                               f"rank, the heap holds {self._cap}")
        storage = (amap.num_owned() + amap.num_replicas_held()).astype(np.int64)
        self._backing = self._table[:self._cap]  # the heap is the room the storage grows into
        super().adopt_address_map(amap)
        if self.weight.data_ptr() != self._table.data_ptr():  # pragma: no cover - fits() above guarantees it
            raise ConfigError(f"rank {self.rank}: the migrated storage left the symmetric heap")
        self._weight_ptr = self.weight.data_ptr()
        self._storage_rows = storage
        self._peer_weight = {p: self.heap.view(p, 0, (int(storage[p]), self.dim), self.weight.dtype)
                             for p in self._peer_weight}
        self._blocks = self._feature_blocks() if self.design == "send" else None

    def migrated(self) -> None:
        """Collective: every rank has written the rows a migration brought (peers may read them from now on)."""
        self._publish_version()

    def load_rows(self, gids: np.ndarray, weight: torch.Tensor, momentum: torch.Tensor | None = None) -> int:
        n = super().load_rows(gids, weight, momentum)
        self._publish_version()  # every rank restores once: versions stay in step
        return n

    def close(self) -> None:
        """Release the heap mappings (the segments' names are long gone)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.heap.close()

    # -- forward: the stages of the base class, this module's stage functions ----------------------
    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        features, kjt = as_jagged(features)
        if kjt:  # a TorchRec KJT in, a KeyedTensor out (as ShardedEmbedding)
            return self._keyed_forward(features)
        if self.weight.data_ptr() != self._weight_ptr:
            raise ConfigError(f"rank {self.rank}: the embedding storage was moved out of the symmetric heap "
                              f"(segment {self.heap.names[self.rank]}); build the module on its device instead")
        if self.design == "retrieve" and not torch.is_grad_enabled() and all(self._same_host.tolist()):
            out = self._lookup_one_sided(features)
            if out is not None:
                return out
        return super().forward(features)

    def prefetch(self, features: JaggedFeatures, *, background: bool = True) -> None:
        """Nothing to run ahead: the owners on this host need no requests (rows are read in place) and the
        send design's ids go out in the step itself."""

    def _lookup_one_sided(self, features: JaggedFeatures) -> torch.Tensor | None:
        """``retrieve`` without autograd (inference) when every rank is on this host: the unique remote rows
        are read by one-sided gets straight into the fetch area after the storage, in one pass (no chunks,
        no helper thread: nothing to overlap a get with when nothing else waits), and one ``embedding_bag``
        pools local and fetched rows sample-major, bit for bit as the collective design. No message at all.
        ``None`` when the batch's unique remote rows overflow the fetch area (the general path takes it)."""
        gids, bag, scale, _, B, offsets, one_hot = self.flat_lookups(features, ones=False)
        tm, me, W, dev = self.tmap, self.rank, self.world_size, self.weight.device
        _, key, _, ridx, runiq, rinv, counts = remote_rows(tm, gids, me, W, ops=self.kernel_ops())
        R = runiq.numel()
        if R > self.fetch_rows:
            return None
        self._await_versions([p for p in range(W) if p != me and counts[p]])
        fetch = self._table[self._cap:self._cap + R]
        u_off = runiq & tm.OFF_MASK
        a = 0
        for p, c in enumerate(counts):
            if c and p != me:
                _get(self, p, u_off[a:a + c].to(dev), fetch[a:a + c])
            a += c
        out, _, _ = pool_local_and_fetched(self._table[:self._cap + R], self._cap, key, ridx, rinv, scale, bag,
                                           offsets, B, one_hot, off_mask=tm.OFF_MASK, ops=self.kernel_ops())
        return out.view(B, len(self.feature_names) * self.dim)

    def _decode_send(self, ctx: PgasSendContext) -> None:
        """The send design's inputs: feature blocks (table-wise plans: no per-value decode) or, for any
        other plan, ``ShardedEmbedding.flat_lookups``'s global ids, bags and scales."""
        features = ctx.features
        ctx.F = F_ = len(self.feature_names)
        if self._blocks is None:
            ctx.gids, ctx.bag, ctx.scale, ctx.nbags, ctx.B = self.flat_lookups(features)[:5]
            self._check_batch(ctx.B)
            ctx.layout = IdsLayout.GENERAL
            return
        self._check_keys(features)
        ctx.B = B = features.batch_size
        self._check_batch(B)
        lengths, values = features.lengths.to(HOST), features.values.to(HOST)
        vstart = [0] + torch.cumsum(lengths.view(F_, B).sum(1), 0).tolist()
        if self.validate:
            for f in range(F_):
                v = values[vstart[f]:vstart[f + 1]]
                if v.numel():
                    lo, hi = torch.aminmax(v)
                    n = int(self._feature_rows[f])
                    if int(lo) < 0 or int(hi) >= n:
                        bad = int(v[(v < 0) | (v >= n)][0])
                        raise InputError(f"feature {self.feature_names[f]}: row id {bad} outside table "
                                         f"{self.tables[int(self._feature_table[f])].name!r} [0, {n})")
        scale = None
        if features.weights is not None or bool(self._feature_mean.any()):
            scale = features.weights.to(HOST, torch.float32) if features.weights is not None else \
                torch.ones(values.numel(), dtype=torch.float32)
            for f in torch.nonzero(self._feature_mean).view(-1).tolist():
                a, b = vstart[f], vstart[f + 1]
                ln = lengths.view(F_, B)[f]
                scale[a:b] = scale[a:b] / torch.repeat_interleave(ln.clamp(min=1), ln).to(torch.float32)
        ctx.layout, ctx.lengths, ctx.values, ctx.vstart, ctx.scale = IdsLayout.FEATURE_BLOCKS, lengths, values, \
            vstart, scale

    def _check_batch(self, B: int) -> None:
        if self.design == "send" and B > self.max_batch_size:
            raise InputError(f"rank {self.rank}: mini-batch of {B} samples exceeds the heap's output buffer "
                             f"({self.max_batch_size} samples, segment {self.heap.names[self.rank]}); "
                             f"build PgasShardedEmbedding with max_batch_size >= {B}")

    def _chunks(self, B: int, F_: int) -> list[tuple[int, int, int, int]]:
        """Bag ranges ``(f0, f1, b0, b1)`` of about ``chunk_bags`` bags (KJT order: feature-major)."""
        cb = self.chunk_bags
        if B == 0:
            return []
        if B >= cb:
            return [(f, f + 1, b0, min(b0 + cb, B)) for f in range(F_) for b0 in range(0, B, cb)]
        step = max(1, cb // B)
        return [(f, min(f + step, F_), 0, B) for f in range(0, F_, step)]

    # -- bookkeeping shared with backward -----------------------------------------------------
    def _count_direct(self, peer: int, nbytes: int, kind: str, sent: bool) -> None:
        if sent:
            self.transport.count_put(peer, nbytes, kind)
        else:
            self.transport.count_received(peer, nbytes)


# -- the retrieve design's stages (OPER 5.2: one-sided gets overlapped with pooling) ---------------------------
def retrieve_input_dist(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext) -> None:
    """Decode the batch and deduplicate its remote rows; the requests of rows on other hosts go out through the
    collective fallback (owners on this host need none: their rows are read in place)."""
    W, me = mod.world_size, mod.rank
    ctx.gids, ctx.bag, ctx.scale, ctx.nbags, ctx.B = mod.flat_lookups(ctx.features)[:5]
    ctx.F = ctx.nbags // ctx.B if ctx.B else len(mod.feature_names)
    src, ctx.off, ctx.slot = mod.tmap.decode(ctx.gids)
    ctx.local = src == me
    nl = ~ctx.local
    ctx.runiq, ctx.rinv = torch.unique((src[nl] << _SHIFT) | ctx.off[nl], sorted=True, return_inverse=True)
    ctx.u_src, ctx.u_off = ctx.runiq >> _SHIFT, ctx.runiq & _MASK
    counts = torch.bincount(ctx.u_src, minlength=W)
    starts = torch.zeros(W + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(counts, 0)
    ctx.counts, ctx.starts = counts.tolist(), starts.tolist()
    ctx.remote_src = [p for p in range(W) if not mod.heap.is_local(p)]
    if ctx.remote_src:  # other hosts: request / reply through the collective fallback
        req = [ctx.u_off[ctx.starts[p]:ctx.starts[p + 1]] if p in ctx.remote_src else ctx.u_off[:0]
               for p in range(W)]
        ctx.requests = mod.transport.exchange(req, kind="ids")
    ctx.state = Stage.ANNOUNCED


def retrieve_compute(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext) -> None:
    """Serve the other hosts' requests, wait for the peers' rows of this step, then pool (fused with the gets
    when the unique remote rows fit the fetch area, else from a private copy)."""
    W, me, dev = mod.world_size, mod.rank, mod.weight.device
    local_src = [p for p in mod._local if p != me and ctx.counts[p]]
    if ctx.remote_src:
        replies = [mod.weight.index_select(0, r.to(dev)) if (p != me and p in ctx.remote_src) else mod.weight[:0]
                   for p, r in enumerate(ctx.requests)]
        rc = [ctx.counts[p] if p in ctx.remote_src else 0 for p in range(W)]
        ctx.fetched_remote = mod.transport.exchange(replies, recv_counts=rc, kind="rows")
    mod._await_versions(local_src)
    voff = torch.zeros(ctx.nbags + 1, dtype=torch.int64)
    voff[1:] = torch.cumsum(torch.bincount(ctx.bag, minlength=ctx.nbags), 0)
    ctx.out = torch.empty((ctx.B, ctx.F * mod.dim), dtype=mod.weight.dtype, device=dev)
    out3 = ctx.out.view(ctx.B, ctx.F, mod.dim)
    scale_d = ctx.scale.to(device=dev, dtype=mod.weight.dtype)
    if ctx.runiq.numel() > mod.fetch_rows:
        _pool_private(mod, ctx, out3, voff, scale_d)
    else:
        _pool_fused(mod, ctx, out3, voff, scale_d)
    ctx.fetched_remote = None
    ctx.state = Stage.POOLED


def retrieve_output_dist(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext) -> torch.Tensor:
    """The bags were pooled straight into the samples' ``[B, F * D]``."""
    out, ctx.out = ctx.out, None
    return out


def retrieve_grad_dist(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext, grad_out: torch.Tensor) -> None:
    """Sum the gradients per row in the collective design's order (its combined layout ``[local unique | remote
    unique]``, rebuilt), and push each remote row's ``(gradient | offset)`` into its owner's slot for this rank
    (the owner never saw a request)."""
    D, dev = mod.dim, grad_out.device
    grad = grad_out.contiguous().view(ctx.B * ctx.F, D)
    local, nl = ctx.local, ~ctx.local
    luniq, linv = torch.unique(ctx.off[local], sorted=True, return_inverse=True)
    ctx.luniq_slot = torch.full_like(luniq, -1)
    ctx.luniq_slot[linv] = ctx.slot[local]
    ctx.runiq_slot = torch.full_like(ctx.runiq, -1)
    ctx.runiq_slot[ctx.rinv] = ctx.slot[nl]
    L = luniq.numel()
    idx = torch.empty(ctx.off.numel(), dtype=torch.int64)
    idx[local] = linv
    idx[nl] = L + ctx.rinv
    B, F_, bag = ctx.B, ctx.F, ctx.bag
    bpos = (bag % B) * F_ + bag // B if B else bag
    pos, g = aggregate_row_gradients(idx.to(dev), grad, src_index=bpos.to(dev), scale=ctx.scale.to(dev))
    g_comb = torch.zeros((L + ctx.runiq.numel(), D), dtype=grad.dtype, device=dev)
    g_comb[pos] = g
    ctx.luniq, ctx.g_local, ctx.g_remote = luniq, g_comb[:L], g_comb[L:]
    ctx.rep_remote = (ctx.runiq_slot >= 0).to(dev)
    send = ctx.g_remote.masked_fill(ctx.rep_remote.unsqueeze(1), 0.0) if bool(ctx.rep_remote.any()) else \
        ctx.g_remote
    u_off = (ctx.runiq & _MASK).to(dev)
    packed = torch.cat([send, _bits_as(u_off, send.dtype, 8 // send.element_size())], 1)
    ctx.recv = mod.transport.exchange(list(torch.split(packed, ctx.counts)), kind="grads")
    ctx.state = Stage.GRADS_SENT


def retrieve_update(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext) -> None:
    """Owner side: this rank's sums and the peers' pushed ones, one update; replicas synced; version published."""
    me, D, dev = mod.rank, mod.dim, ctx.g_local.device
    rep_L = (ctx.luniq_slot >= 0).to(dev)
    rows = [ctx.luniq.to(dev)[~rep_L]]
    grads = [ctx.g_local[~rep_L]]
    for p, pk in enumerate(ctx.recv):
        if p == me or pk.numel() == 0:
            continue
        r = pk[:, D:].contiguous().view(torch.int64).view(-1)
        owned = r < mod.num_owned  # replica rows a peer read here are synced, not applied here
        rows.append(r[owned])
        grads.append(pk[:, :D][owned])
    mod.apply_owned(torch.cat(rows), torch.cat(grads))
    if mod.num_slots:
        rep_R = ctx.rep_remote
        slots = torch.cat([ctx.luniq_slot.to(dev)[rep_L], ctx.runiq_slot.to(dev)[rep_R]])
        mod.sync_and_apply_replicas(slots, torch.cat([ctx.g_local[rep_L], ctx.g_remote[rep_R]]))
    mod._publish_version()
    ctx.state = Stage.UPDATED


def _get(mod: PgasShardedEmbedding, p: int, rows: torch.Tensor, dst: torch.Tensor) -> None:
    """One-sided get: rows ``rows`` of rank ``p``'s storage into ``dst`` (this rank's fetch area)."""
    torch.index_select(mod._peer_weight[p], 0, rows, out=dst)
    nbytes = dst.numel() * dst.element_size()
    mod.transport.count_get(p, nbytes, "rows")
    mod.transport.record(nbytes, p, "rows")



def _plan_gets(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext, K: int, fetch: torch.Tensor):
    """Where each unique remote row lands in the fetch area (by the first of the ``K`` chunks that reads it, then
    owner) and the gets of every chunk ``(peer, first, last)``; rows from other hosts (arrived by the collective)
    are placed now. Returns ``(fetch_pos, gets, rows_in_order)``."""
    W, me, B, bag, dev = mod.world_size, mod.rank, ctx.B, ctx.bag, fetch.device
    R = ctx.u_off.numel()
    if B >= mod.chunk_bags:  # the chunk of every value
        chunk_of_value = (bag // B) * -(-B // mod.chunk_bags) + (bag % B) // mod.chunk_bags
    else:
        chunk_of_value = (bag // B) // max(1, mod.chunk_bags // B)
    fetch_pos = torch.empty(R, dtype=torch.int64)
    gets: list[list[tuple[int, int, int]]] = [[] for _ in range(K)]
    if not R:
        return fetch_pos, gets, ctx.u_off
    first = torch.full((R,), K, dtype=torch.int64)
    first.scatter_reduce_(0, ctx.rinv, chunk_of_value[~ctx.local], reduce="amin")
    order = torch.argsort(first * W + ctx.u_src, stable=True)
    fetch_pos[order] = torch.arange(R)
    cnt = torch.bincount(first * W + ctx.u_src, minlength=K * W).view(K, W).tolist()
    a = 0
    for k in range(K):
        for p in range(W):
            n = cnt[k][p]
            if n and p != me and mod.heap.is_local(p):
                gets[k].append((p, a, a + n))
            a += n
    for p in ctx.remote_src:  # rows from other hosts arrived by the collective: place them in the fetch area
        if ctx.counts[p]:
            fetch.index_copy_(0, fetch_pos[ctx.starts[p]:ctx.starts[p + 1]].to(dev), ctx.fetched_remote[p])
    return fetch_pos, gets, ctx.u_off[order]


def _pool_fused(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext, out3: torch.Tensor, voff: torch.Tensor,
                scale_d: torch.Tensor) -> None:
    """Pool the batch in chunks of bags from ``[storage | fetch area]``, the gets of chunk k+1 (on the helper
    thread) overlapping the pooling of chunk k (OPER Fig. 4(b))."""
    me, B, off, local = mod.rank, ctx.B, ctx.off, ctx.local
    dev = out3.device
    chunks = mod._chunks(B, ctx.F)
    K = len(chunks)
    cap, table = mod._cap, mod._table
    fetch = table[cap:cap + ctx.u_off.numel()]
    fetch_pos, gets, rows_in_order = _plan_gets(mod, ctx, K, fetch)
    idx = torch.empty(off.numel(), dtype=torch.int64)
    idx[local] = off[local]
    idx[~local] = cap + fetch_pos[ctx.rinv]
    idx = idx.to(dev)

    def do_gets(k: int) -> None:
        for p, a, b in gets[k]:
            _get(mod, p, rows_in_order[a:b].to(dev), fetch[a:b])

    use_thread = mod.overlap and any(gets)
    if use_thread and mod._pool is None:
        mod._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pgas-get-r{me}")
    fut = mod._pool.submit(do_gets, 0) if use_thread and K else None
    if not use_thread and K:
        do_gets(0)
    for k, (f0, f1, b0, b1) in enumerate(chunks):
        if fut is not None:
            fut.result()
            fut = None
        if k + 1 < K:  # issue the gets of chunk k+1, then pool chunk k
            if use_thread:
                fut = mod._pool.submit(do_gets, k + 1)
            else:
                do_gets(k + 1)
        g0, g1 = f0 * B + b0, (f1 - 1) * B + b1
        va, vb = int(voff[g0]), int(voff[g1])
        offs = (voff[g0:g1 + 1] - va).to(dev)
        pooled = F.embedding_bag(idx[va:vb], table, offs, mode="sum", per_sample_weights=scale_d[va:vb],
                                 include_last_offset=True)
        if f1 - f0 == 1:
            out3[b0:b1, f0].copy_(pooled)
        else:
            out3[:, f0:f1].copy_(pooled.view(f1 - f0, B, -1).transpose(0, 1))


def _pool_private(mod: PgasShardedEmbedding, ctx: PgasRetrieveContext, out3: torch.Tensor, voff: torch.Tensor,
                  scale_d: torch.Tensor) -> None:
    """Fallback when the unique remote rows exceed the fetch area: the collective design's layout."""
    off, local, rinv, u_off, B, F_ = ctx.off, ctx.local, ctx.rinv, ctx.u_off, ctx.B, ctx.F
    counts_l, starts_l, remote_src, fetched_remote = ctx.counts, ctx.starts, ctx.remote_src, ctx.fetched_remote
    if not mod._warned_fetch:
        mod._warned_fetch = True
        warnings.warn(f"rank {mod.rank}: {u_off.numel()} unique remote rows exceed the PGAS fetch area "
                      f"({mod.fetch_rows} rows); pooling from a private copy for such batches (raise "
                      f"max_ids_per_bag or fetch_rows)", RuntimeWarning, stacklevel=3)
    mod.stats["fetch_overflows"] = mod.stats.get("fetch_overflows", 0) + 1
    dev = out3.device
    fetched = torch.empty((u_off.numel(), mod.dim), dtype=mod.weight.dtype, device=dev)
    for p in range(mod.world_size):
        a, b = starts_l[p], starts_l[p + 1]
        if a == b or p == mod.rank:
            continue
        if p in remote_src:
            fetched[a:b] = fetched_remote[p]
        else:
            _get(mod, p, u_off[a:b].to(dev), fetched[a:b])
    luniq, linv = torch.unique(off[local], sorted=True, return_inverse=True)
    combined = torch.cat([mod.weight.index_select(0, luniq.to(dev)), fetched])
    idx = torch.empty(off.numel(), dtype=torch.int64)
    idx[local] = linv
    idx[~local] = luniq.numel() + rinv
    pooled = F.embedding_bag(idx.to(dev), combined, voff.to(dev), mode="sum", per_sample_weights=scale_d,
                             include_last_offset=True)
    out3.copy_(pooled.view(F_, B, -1).transpose(0, 1))


# -- the send design's stages (PGAS paper, section III-C, Listing 2) ------------------------------------------
def send_input_dist(mod: PgasShardedEmbedding, ctx: PgasSendContext) -> None:
    """Requester side: the ids every owner needs, one exchange through the heap.

    Two layouts of the ids message to an owner (int64 words):

    * feature blocks (every feature's table on one rank of this host, no replicas: table-wise plans):
      ``[1, B, nf, nv, has_scale, features(nf), lengths(nf * B), row offsets(nv), scales]``; every bag
      of those features is one partial bag, written directly (empty bags as zeros); no sort anywhere.
    * general (any plan): ``[0, npb, nv, has_scale, lengths(npb), places(npb), row offsets(nv), scales]``
      with one partial bag per (owner, bag) as in ``ShardedEmbedding``; ``places[i]`` is the bag's final
      row in the requester's ``[B * F, D]`` output, or -1 when the bag has several owners (or its owner
      is on another host): those partial sums go back through the transport and are added in rank order.

    Scales (per-sample weights, 1/length for mean pooling) travel as float32 bits only when some is not 1.
    """
    mod._decode_send(ctx)
    mod._epoch += 1
    ctx.buf = mod._epoch % 2
    if ctx.layout is IdsLayout.FEATURE_BLOCKS:
        _messages_blocks(mod, ctx)
    else:
        _messages_general(mod, ctx)
    ctx.requests = mod.transport.exchange(ctx.msgs, kind="ids")  # the input distribution
    ctx.msgs = None
    ctx.state = Stage.ANNOUNCED


def send_compute(mod: PgasShardedEmbedding, ctx: PgasSendContext) -> None:
    """Owner side: pool every requester's bags, write each pooled vector where it is consumed (the requester's
    heap, this host); the partial sums of bags with several owners go back through the transport."""
    W, me, tr = mod.world_size, mod.rank, mod.transport
    served = [None] * W
    ctx.sends, ctx.remote_parts = {}, [None] * W
    for i in range(1, W + 1):
        q = (me + i) % W
        served[q], part = _serve(mod, q, ctx.requests[q], ctx.buf, ctx.F, mod.weight.device)
        if q == me:
            ctx.own_part = part
        elif mod.heap.is_local(q):
            ctx.sends[q] = tr.post(q, part, "pooled")  # also q's completion signal for the direct writes
            mod._count_direct(q, part.numel() * part.element_size(), "pooled", sent=True)
        else:
            ctx.remote_parts[q] = part
    ctx.served = served
    ctx.requests = None
    ctx.state = Stage.POOLED


def send_output_dist(mod: PgasShardedEmbedding, ctx: PgasSendContext) -> torch.Tensor:
    """Requester side: wait until every owner wrote what it writes here, then add the partial sums of bags with
    several owners (rank order, as the collective design). Returns ``[B, F * D]``, a view of this rank's heap."""
    W, me, tr = mod.world_size, mod.rank, mod.transport
    D, dev = mod.dim, mod.weight.device
    F_, B = ctx.F, ctx.B
    out_flat = mod._out[me][ctx.buf][: B * F_]
    if ctx.layout is IdsLayout.FEATURE_BLOCKS:
        ind_counts = [0] * W
    else:
        code, p_counts = ctx.code, ctx.p_counts
        ind_counts = [int((code[a:a + n] < 0).sum()) for a, n in zip(np.cumsum([0] + p_counts[:-1]), p_counts)]
    got: list = [None] * W
    if tr.collective is not None:
        empty = mod.weight.new_zeros((0, D))
        cs = [ctx.remote_parts[q] if ctx.remote_parts[q] is not None else empty for q in range(W)]
        rc = [ind_counts[q] if not mod.heap.is_local(q) else 0 for q in range(W)]
        rr = tr.collective.exchange(cs, rc, "pooled")
        for q in range(W):
            if not mod.heap.is_local(q):
                got[q] = rr[q]
                tr.count_put(q, cs[q].numel() * cs[q].element_size(), "pooled")
                tr.count_received(q, rr[q].numel() * rr[q].element_size())
    recvs = {q: tr.expect((D,), mod.weight.dtype, dev, ind_counts[q]) for q in ctx.sends}
    tr.progress(ctx.sends, recvs, "pooled vectors")  # every owner has written all it writes here
    for q, r in recvs.items():
        got[q] = r["out"]
        tr.count_received(q, r["out"].numel() * r["out"].element_size())
    got[me] = ctx.own_part
    ctx.sends = ctx.remote_parts = ctx.own_part = None
    _count_written_here(mod, ctx, out_flat.element_size())
    if ctx.layout is IdsLayout.GENERAL:
        ind = ctx.code < 0
        if bool(ind.any()):  # ((0 + p_0) + p_1) + ...: the collective design's index_add_, rank order
            out_flat.index_add_(0, ctx.bpos[ind].to(dev), torch.cat([g for g in got if g is not None]))
    return out_flat.view(B, F_ * D)


def _count_written_here(mod: PgasShardedEmbedding, ctx: PgasSendContext, itemsize: int) -> None:
    """Count what the owners on this host wrote straight into this rank's output buffer."""
    me, D = mod.rank, mod.dim
    for q in mod._local:
        if q == me:
            continue
        if ctx.layout is IdsLayout.FEATURE_BLOCKS:
            n = ctx.p_counts[q]
        else:
            n = int(ctx.direct[ctx.p_src == q].sum())
        mod._count_direct(q, n * D * itemsize, "pooled", sent=False)


def send_grad_dist(mod: PgasShardedEmbedding, ctx: PgasSendContext, grad_out: torch.Tensor) -> None:
    """Every partial bag's gradient back to the owner that pooled it."""
    W, me, D = mod.world_size, mod.rank, mod.dim
    B, F_ = ctx.B, ctx.F
    grad = grad_out.contiguous().view(B * F_, D)
    if ctx.layout is IdsLayout.FEATURE_BLOCKS:  # the bags of each owner's features, feature-major: in order
        g3 = grad.view(B, F_, D)
        parts = [g3[:, mod._blocks["features_of"][q]].transpose(0, 1).reshape(-1, D) for q in range(W)]
    else:
        g_partial = grad.index_select(0, ctx.bpos.to(grad.device))  # gradient of every partial bag, rank-major
        parts = list(torch.split(g_partial, ctx.p_counts))
    n_recv = [ctx.served[q][3] if q != me else 0 for q in range(W)]
    ctx.grads = mod.transport.exchange([parts[q] if q != me else parts[q][:0] for q in range(W)],
                                       recv_counts=n_recv, kind="grads")
    ctx.grads[me] = parts[me]
    ctx.state = Stage.GRADS_SENT


def send_update(mod: PgasShardedEmbedding, ctx: PgasSendContext) -> None:
    """Owner side: the partial bags' gradients expanded to rows and applied; version published."""
    work = []
    for q in range(mod.world_size):
        offq, lens, scq, npb = ctx.served[q]
        pbv = torch.repeat_interleave(torch.arange(npb), lens)  # the partial bag of every value
        sc = scq if scq is not None else torch.ones(offq.numel(), dtype=torch.float32)
        work.append((offq, pbv, sc, ctx.grads[q]))
    mod.apply_partial_bag_grads(work, ctx.grads[mod.rank].dtype)
    mod._publish_version()
    ctx.state = Stage.UPDATED


def _messages_blocks(mod: PgasShardedEmbedding, ctx: PgasSendContext) -> None:
    """The ids messages in the feature-block layout (table-wise plans: no per-value decode, no sort)."""
    W = mod.world_size
    B, F_ = ctx.B, ctx.F
    lengths, values, vstart, scale = ctx.lengths, ctx.values, ctx.vstart, ctx.scale
    fc = mod._blocks["offset"]
    has = scale is not None
    msgs, p_counts = [], []
    for q in range(W):
        fq = mod._blocks["features_of"][q]
        vals = [values[vstart[f]:vstart[f + 1]] + fc[f] for f in fq]
        nv = sum(v.numel() for v in vals)
        parts = [torch.tensor([1, B, len(fq), nv, int(has)] + fq, dtype=torch.int64)]
        if fq:
            parts.append(lengths.view(F_, B)[fq].reshape(-1))
            parts += vals
            if has:
                parts.append(_scale_bits(torch.cat([scale[vstart[f]:vstart[f + 1]] for f in fq])))
        msgs.append(torch.cat(parts))
        p_counts.append(len(fq) * B)
    ctx.msgs, ctx.p_counts = msgs, p_counts


def _messages_general(mod: PgasShardedEmbedding, ctx: PgasSendContext) -> None:
    """The ids messages in the general layout (any plan): one partial bag per (owner, bag)."""
    W = mod.world_size
    gids, bag, scale, nbags, B, F_, buf = ctx.gids, ctx.bag, ctx.scale, ctx.nbags, ctx.B, ctx.F, ctx.buf
    dev = mod.weight.device
    src, off, _slot = mod.tmap.decode(gids)
    # partial bags: one per (source rank, bag), numbered per source rank (the collective design's)
    key = src * nbags + bag
    pkeys, pinv = torch.unique(key, sorted=True, return_inverse=True)
    p_src, p_bag = pkeys // nbags, pkeys % nbags
    p_counts = torch.bincount(p_src, minlength=W).tolist()
    p_len = torch.bincount(pinv, minlength=pkeys.numel())
    n_src = torch.bincount(p_bag, minlength=nbags)
    bpos = (p_bag % B) * F_ + p_bag // B if B else p_bag  # final place of the bag in the [B, F, D] output
    direct = (n_src[p_bag] == 1) & mod._same_host[p_src]
    code = torch.where(direct, bpos, torch.full_like(bpos, -1))
    out_flat = mod._out[mod.rank][buf][: B * F_]
    # places no owner writes directly: empty bags, and bags summed here from partials; zeroed before
    # the ids go out, since the owners write as soon as they have them
    if B:
        written = torch.zeros(nbags, dtype=torch.bool)
        written[p_bag[direct]] = True
        gaps = torch.nonzero(~written).view(-1)
        if gaps.numel():
            out_flat.index_fill_(0, ((gaps % B) * F_ + gaps // B).to(dev), 0)
    order = torch.argsort(src, stable=True)
    v_counts = torch.bincount(src, minlength=W).tolist()
    has = not bool((scale == 1).all())
    off_o = off[order]
    sc_o = scale[order].to(torch.float32) if has else None
    msgs, va, pa = [], 0, 0
    for q in range(W):
        nv, npb = v_counts[q], p_counts[q]
        parts = [torch.tensor([0, npb, nv, int(has)], dtype=torch.int64), p_len[pa:pa + npb],
                 code[pa:pa + npb], off_o[va:va + nv]]
        if has:
            parts.append(_scale_bits(sc_o[va:va + nv]))
        msgs.append(torch.cat(parts))
        va += nv
        pa += npb
    ctx.msgs, ctx.bpos, ctx.code, ctx.direct, ctx.p_src, ctx.p_counts, ctx.out = \
        msgs, bpos, code, direct, p_src, p_counts, out_flat


def _write_runs(dst: torch.Tensor, places: torch.Tensor, pooled: torch.Tensor, F_: int) -> None:
    """``dst[places[i]] = pooled[i]``: strided stores for runs of consecutive samples of one feature
    (places ``c, c + F, c + 2F, ...``), ``index_copy_`` when the places are scattered."""
    n = places.numel()
    if n == 0:
        return
    brk = torch.nonzero(places[1:] - places[:-1] != F_).view(-1) if n > 1 else places[:0]
    if brk.numel() > 16:
        dst.index_copy_(0, places.to(dst.device), pooled)
        return
    bounds = [0] + (brk + 1).tolist() + [n]
    for s, e in zip(bounds[:-1], bounds[1:]):
        c0 = int(places[s])
        dst[c0:c0 + F_ * (e - s - 1) + 1:F_].copy_(pooled[s:e])


def _serve(mod: PgasShardedEmbedding, q: int, msg: torch.Tensor, buf: int, F_: int, dev) -> tuple:
    """Pool requester ``q``'s partial bags; write the direct ones into ``q``'s output, return the rest."""
    D = mod.dim
    itemsize = mod.weight.element_size()
    kind = int(msg[0])
    if kind == 1:
        B, nf, nv, has = (int(x) for x in msg[1:5])
        feats = msg[5:5 + nf].tolist()
        h = 5 + nf
        npb = nf * B
        lens = msg[h:h + npb]
        offq = msg[h + npb:h + npb + nv]
        scq = msg[h + npb + nv:].view(torch.float32)[:nv] if has else None
        code = None
    else:
        npb, nv, has = (int(x) for x in msg[1:4])
        lens = msg[4:4 + npb]
        code = msg[4 + npb:4 + 2 * npb]
        offq = msg[4 + 2 * npb:4 + 2 * npb + nv]
        scq = msg[4 + 2 * npb + nv:].view(torch.float32)[:nv] if has else None
    voff = torch.zeros(npb + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=voff[1:])
    offq_d = offq.to(dev)
    unit = scq is None or bool((scq == 1).all())
    local_q = mod.heap.is_local(q)
    dst = mod._out[q][buf] if local_q else None
    parts = []
    cb = mod.chunk_bags
    for a in range(0, npb, cb):
        b = min(a + cb, npb)
        va, vb = int(voff[a]), int(voff[b])
        offs = (voff[a:b + 1] - va).to(dev)
        if unit:  # sum of the rows in value order: the collective design's index_add_, bit for bit
            pooled = F.embedding_bag(offq_d[va:vb], mod.weight, offs, mode="sum", include_last_offset=True)
        else:  # rows scaled first (w * s), then summed in order: again the collective design's arithmetic
            scaled = mod.weight.index_select(0, offq_d[va:vb]) * scq[va:vb].to(dev, mod.weight.dtype)[:, None]
            pooled = F.embedding_bag(torch.arange(vb - va, device=dev), scaled, offs, mode="sum",
                                     include_last_offset=True)
        if kind == 1:  # feature blocks: bag i of the block is sample i % B of feature feats[i // B]
            dst3 = dst[: B * F_].view(B, F_, D)
            for i in range(a // B, (b - 1) // B + 1):
                s, e = max(a, i * B), min(b, (i + 1) * B)
                dst3[s - i * B:e - i * B, feats[i]].copy_(pooled[s - a:e - a])
            nd = b - a
        elif not local_q:
            parts.append(pooled)
            continue
        else:
            c = code[a:b]
            d = c >= 0
            nd = int(d.sum())
            if nd == b - a:
                _write_runs(dst, c, pooled, F_)
            else:
                if nd:
                    dst.index_copy_(0, c[d].to(dev), pooled[d.to(dev)])
                parts.append(pooled[(~d).to(dev)])
        if nd and q != mod.rank:
            mod.transport.record(nd * D * itemsize, q, "pooled")
            mod._count_direct(q, nd * D * itemsize, "pooled", sent=True)
    part = torch.cat(parts) if parts else mod.weight.new_zeros((0, D))
    return (offq, lens, scq, npb), part


PGAS_RETRIEVE = Stages(PgasRetrieveContext, retrieve_input_dist, retrieve_compute, retrieve_output_dist,
                       retrieve_grad_dist, retrieve_update)
PGAS_SEND = Stages(PgasSendContext, send_input_dist, send_compute, send_output_dist, send_grad_dist, send_update)
