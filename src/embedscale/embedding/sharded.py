"""``ShardedEmbedding``: execute any placement plan with one flat storage and one fused lookup per rank.

OPER section 5 (all-in-one EMT). Each rank holds the rows it owns and the replicas it holds in one flat
storage. The address map (``embedding.address_map``), kept as torch tensors on the storage's device,
decodes every looked-up row to the rank it is read from and the offset there. Two designs, both measured
on this same code (OPER section 8):

``retrieve`` (default; OPER 5.1-5.2): a rank fetches the remote rows its own mini-batch needs,
    deduplicated per source rank, into a fetch area right after its storage, and pools local and
    fetched rows with one ``embedding_bag`` over ``[storage | fetch area]``, sample-major (the output is
    ``[B, F * D]`` with no transpose). Backward: gradients are summed per row; those of fetched rows go
    back to their owners, which apply the fused sparse optimizer to the sum of all ranks' contributions.
``send`` (the classic model-parallel path): a rank sends each remote owner the ids of the values it
    owns, grouped into partial bags; the owner pools them and returns one partial pooled vector per
    (bag, owner); the requester adds the partials. Backward: the partial bags' gradients go back to the
    owners, which expand them to rows and apply the optimizer.

Per-step costs beyond the pooling kernel (issue 15): a training step of the retrieve design makes four
all-to-alls (request counts, ids, rows, gradients) and sums each row's gradients once (one sort of the batch's
values; an owner adds its peers' per-row sums to its own without sorting again, and updates owned and
replica rows in one fused call). ``ShardedEmbedding.prefetch`` pipelines OPER 5.1's index conversion with the
previous step, as TorchRec's ``TrainPipelineSparseDist`` does its input distribution: the next batch is
converted on a worker thread, its request counts ride in the current step's row all-to-all and its ids in
the current gradient all-to-all, so a prefetched step makes two all-to-alls; the results are the same bits.

Replicated rows (data parallel, OPER 4.3) are read locally where held; their gradients are summed over
all ranks with ``grad_sync`` (local-aggregated sparse AllReduce by default, OPER 5.3; or, for few ranks,
``alltoall``: inside the retrieve design's backward all-to-all, no collective of its own), and every
holder applies the same update, so replicas stay identical.

Device: a batch's ids are decoded, deduplicated and pooled on the device of the storage (the run's
device); only per-peer counts (``W`` numbers) and scalar checks are read on the host, never the ids. Every
tensor goes to the transport on that device, and the transport moves it to the device its backend needs
(``Transport.wire_device``: CUDA for NCCL, host for gloo). Designed for GPU; tested on CPU (gloo) only.

Gradient scale: the module applies exactly the gradient it receives. Data-parallel training that wants
the single-process result uses a loss that is the sum over the local samples divided by the *global*
batch size, and sums (not averages) dense gradients over ranks; ``train.distributed`` does both.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embedscale.comm.transport import Transport
from embedscale.data.batch import JaggedFeatures, same_batch
from embedscale.embedding import kernels
from embedscale.embedding.address_map import AddressMap, TorchAddressMap
from embedscale.embedding.grad_sync import METHODS as _SYNC_METHODS
from embedscale.embedding.grad_sync import sync_replica_grads
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.interop import as_jagged, ebc_weight_key, has_ebc_names, keyed_tensor
from embedscale.embedding.optim import (RowGradientScratch, aggregate_row_gradients, rowwise_adagrad_update_,
                                        sgd_update_)
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec, feature_to_table

DESIGNS = ("retrieve", "send")
SYNC_METHODS = (*_SYNC_METHODS, "alltoall")
_INT32_MAX = 2**31 - 1
_MAX_AHEAD = 4  # prefetched batches kept at most while none was announced to the peers
_SHIFT = TorchAddressMap.SHIFT  # (rank << 40) | offset packs a (rank, offset) pair into one sortable int64


class ShardedEmbedding(nn.Module):
    """All tables, placed as ``amap`` says, looked up across ranks through ``transport``.

    Args:
        tables: table specs (one ``dim`` for all: the pooled outputs form ``[B, F, D]``).
        amap: the address map built from a plan.
        transport: how rows, ids and gradients move between ranks.
        rank: this rank.
        design: ``retrieve`` or ``send``.
        optimizer: ``sgd`` | ``rowwise_adagrad`` | ``None`` (inference: no updates).
        lr, eps: optimizer settings.
        grad_sync: ``local_aggregated`` | ``dense`` | ``allgather`` for replicated rows, or ``alltoall``
            (retrieve design over a ``CollectiveTransport``): each rank's locally aggregated replica
            gradients ride in the backward all-to-all that returns the fetched rows' gradients, and every
            rank sums all ranks' contributions in rank order: no collective of its own (two fewer per step
            than ``local_aggregated``; it sends ``(W - 1) x`` the rows a rank touched, against the ring's
            ``2 (W - 1) / W x`` their union: about the same bytes at 2 ranks, more beyond).
        sync_group: process group for the replica AllReduce (default: the world).
        seed: row initialisation seed (``embedding.init``: the same rows as single-process training).
        init_index: each table's index for ``embedding.init`` (its position among the model's tables, when
            these are a subset of them, e.g. beside host-placed tables); default ``0, 1, ...``.
        device, dtype: where and how the storage lives.

    Forward takes this rank's mini-batch (``JaggedFeatures`` over ``feature_names``) and returns
    ``[B_local, F * D]`` in ``feature_names`` order, like ``LocalEmbeddingBags``. Given a TorchRec
    ``KeyedJaggedTensor`` (its keys in any order) it returns an ``EmbeddingBagCollection``'s ``KeyedTensor``;
    ``load_state_dict`` takes an EBC's state dict (``embedding_bags.<table>.weight``, whole tables: each rank
    keeps its rows) and :meth:`ebc_state_dict` gathers the tables back under those names
    (:mod:`embedscale.embedding.interop`).

    On the CPU with float32 storage the step's pooling, per-row gradient sums and fused updates run in the C++
    kernel (:mod:`embedscale.embedding.kernels`, when built; the same bits as the PyTorch ops, which every
    other device and dtype uses); ``cpu_kernel = False`` on an instance keeps the PyTorch ops.
    """

    cpu_kernel = True  # use the C++ CPU kernel where it applies (``_kernel_ops``)

    def __init__(self, tables: list[TableSpec], amap: AddressMap, transport: Transport, rank: int, *,
                 design: str = "retrieve", optimizer: str | None = "sgd", lr: float = 0.01, eps: float = 1e-8,
                 grad_sync: str = "local_aggregated", sync_group=None, seed: int = 0,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32, validate: bool = True,
                 init_index: list[int] | None = None):
        super().__init__()
        if design not in DESIGNS:
            raise ConfigError(f"sharded embedding: design {design!r} is not one of {DESIGNS}")
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ConfigError(f"sharded embedding: tables have different dims {sorted(dims)}; use one dim")
        for t in tables:
            if t.pooling == "none":
                raise ConfigError(f"sharded embedding: table {t.name!r} is unpooled; use sum or mean")
        if amap.table_names != [t.name for t in tables]:
            raise ConfigError("sharded embedding: the address map's tables differ from the model's tables")
        self.tables = list(tables)
        self.dim = dims.pop()
        self.amap = amap
        self.transport = transport
        self.rank = rank
        self.world_size = amap.world_size
        self.design = design
        self.optimizer = optimizer
        self.lr, self.eps = lr, eps
        if grad_sync not in SYNC_METHODS:
            raise ConfigError(f"sharded embedding: grad_sync {grad_sync!r} is not one of {SYNC_METHODS}")
        if grad_sync == "alltoall" and optimizer is not None and \
                (design != "retrieve" or not transport.fuses_exchanges):
            raise ConfigError("sharded embedding: grad_sync 'alltoall' rides in the retrieve design's all-to-all; "
                              f"it needs design 'retrieve' and a collective transport (got {design!r}, "
                              f"{type(transport).__name__})")
        self.grad_sync = grad_sync
        self.sync_group = sync_group
        self.validate = validate
        f2t = feature_to_table(self.tables)
        self.feature_names = [f for t in self.tables for f in t.features]
        self._feature_table = torch.tensor([f2t[f] for f in self.feature_names], dtype=torch.int64)
        self._feature_rows = torch.tensor([self.tables[f2t[f]].num_rows for f in self.feature_names])
        self._feature_mean = torch.tensor([self.tables[f2t[f]].pooling == "mean" for f in self.feature_names])
        self._set_map(amap, device)
        self._feature_table = self._feature_table.to(device)
        self._feature_rows = self._feature_rows.to(device)
        self._feature_mean = self._feature_mean.to(device)
        gids = amap.storage_gids(rank)
        weight = torch.empty((gids.size, self.dim), dtype=dtype)
        table_of = np.searchsorted(amap.table_base, gids, side="right") - 1
        init_index = list(range(len(self.tables))) if init_index is None else list(init_index)
        if len(init_index) != len(self.tables):
            raise ConfigError(f"sharded embedding: {len(init_index)} init indices for {len(self.tables)} tables")
        for t, spec in enumerate(self.tables):
            sel = np.flatnonzero(table_of == t)
            if sel.size:
                weight[torch.from_numpy(sel)] = torch.from_numpy(uniform_rows(
                    seed, init_index[t], gids[sel] - amap.table_base[t], self.dim, spec.num_rows)).to(dtype)
        self.register_buffer("weight", weight.to(device))
        if optimizer == "rowwise_adagrad":
            self.register_buffer("momentum", torch.zeros(gids.size, dtype=torch.float32, device=device))
        elif optimizer not in ("sgd", None):
            raise ConfigError(f"sharded embedding: optimizer {optimizer!r} is not sgd, rowwise_adagrad or None")
        # a zero-size parameter so that autograd calls our backward even though the storage is a buffer
        self.anchor = nn.Parameter(torch.zeros(0, device=device))
        self.stats: dict[str, int] = {}
        self._backing: torch.Tensor | None = None  # storage + fetch area (``_pool_table``)
        # storage rows the optimizer updated since track_touched() (delta checkpoints); None: not tracked
        self.register_buffer("touched", None, persistent=False)
        self._queue: deque[_Ahead] = deque()  # prefetched batches, in step order (``prefetch``)
        self._pool: ThreadPoolExecutor | None = None  # the prefetch thread, made by the first prefetch
        self._pipelined = False  # set by the first ``prefetch``: training row exchanges carry a header
        self._slot_of: torch.Tensor | None = None  # storage row -> gradient slot, -1 outside a backward
        self._kslot: torch.Tensor | None = None  # the C++ kernel's int32 storage row -> slot map, all -1
        self._kscratch = RowGradientScratch()  # the C++ kernel's per-row gradient sums, kept across steps

    # -- inputs ---------------------------------------------------------------------------------
    def _check_keys(self, features: JaggedFeatures) -> None:
        if features.keys != self.feature_names:
            unknown = [k for k in features.keys if k not in self.feature_names]
            if unknown:
                raise InputError(f"sharded embedding: unknown feature(s) {unknown}; expected {self.feature_names}")
            raise InputError(f"sharded embedding: features {features.keys} are not in the order "
                             f"{self.feature_names}")

    def _follow_storage(self) -> torch.device:
        """The storage's device; the address map and per-feature tables follow it there when the module was
        moved (``.to(device)`` moves buffers only). A no-op check per step otherwise."""
        dev = self.weight.device
        if self.tmap.device != dev:
            self.tmap = self.tmap.to(dev)
            for name in ("_feature_table", "_feature_rows", "_feature_mean", "_region_slot", "_replica_storage_rows"):
                setattr(self, name, getattr(self, name).to(dev))
        return dev

    def _inputs(self, features: JaggedFeatures, ones: bool = True):
        """A mini-batch as flat lookups: ``(gids, bag, scale, nbags, B, offsets, one_hot)``.

        ``gids``: global row id of every value; ``bag``: its bag, ``f * B + b`` (features major, as the
        values come); ``scale``: its per-sample weight (``1/length`` folded in for mean pooling), or ``None``
        when every weight is 1 and ``ones`` is false; ``offsets``: ``[nbags + 1]`` start of every bag;
        ``one_hot``: every bag holds exactly one value.
        Values of feature ``f`` are one contiguous block, so table bases and bounds repeat per feature.
        Everything is computed on the storage's device, where the ids stay (a batch on another device is
        moved there once); with ``validate`` the ids are checked here, once, by one vectorised comparison
        (a batch already checked by the loader against the same tables can skip it: ``validate=False``).
        """
        self._check_keys(features)
        dev = self._follow_storage()
        F_, B = len(self.feature_names), features.batch_size
        lengths = features.lengths.to(dev)
        values = features.values.to(dev)
        n = values.numel()
        per_feature = lengths.view(F_, B).sum(1) if B else torch.zeros(F_, dtype=torch.int64, device=dev)
        base = self.tmap.table_base.index_select(0, self._feature_table)  # each feature's table's first gid
        ops = self._kernel_ops() if values.dtype == torch.int64 and n else None
        if ops is not None:  # the C++ kernel: check and offset every value in one pass
            gids = torch.empty_like(values)
            i = ops.sharded_feature_gids(values, per_feature, base, self._feature_rows, bool(self.validate), gids)
            bad = None if i < 0 else torch.arange(n, device=dev) == i
        elif self.validate and n:
            rows = torch.repeat_interleave(self._feature_rows, per_feature, output_size=n)
            bad = (values < 0) | (values >= rows)
        else:
            bad = None
        if bad is not None and bool(bad.any()):  # one scalar read per step; the details only on the error path
            i = int(torch.nonzero(bad)[0])
            f = int(torch.searchsorted(torch.cumsum(per_feature, 0), i, right=True))
            raise InputError(f"feature {self.feature_names[f]}: row id {int(values[i])} outside table "
                             f"{self.tables[int(self._feature_table[f])].name!r} [0, {int(self._feature_rows[f])})")
        if ops is None:
            gids = torch.repeat_interleave(base, per_feature, output_size=n) + values
        one_hot = n == F_ * B and bool((lengths == 1).all())
        bag = torch.arange(n, device=dev) if one_hot else \
            torch.repeat_interleave(torch.arange(F_ * B, device=dev), lengths, output_size=n)
        offsets = torch.zeros(F_ * B + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths, 0, out=offsets[1:])
        scale = features.weights.to(dev, torch.float32) if features.weights is not None else None
        if not one_hot and bool(self._feature_mean.any()):
            mean = torch.repeat_interleave(self._feature_mean, per_feature, output_size=n)
            if scale is None:
                scale = torch.ones(n, dtype=torch.float32, device=dev)
            scale = torch.where(mean, scale / lengths.index_select(0, bag).clamp(min=1).to(scale.dtype), scale)
        if scale is None and ones:
            scale = torch.ones(n, dtype=torch.float32, device=dev)
        return gids, bag, scale, F_ * B, B, offsets, one_hot

    def _prepare(self, features: JaggedFeatures):
        """``(gids, bag, scale, nbags, B)`` of ``_inputs``, with a scale for every value."""
        return self._inputs(features)[:5]

    def _keyed_forward(self, features: JaggedFeatures):
        """A TorchRec KJT's lookup (its keys in any order): an ``EmbeddingBagCollection``'s ``KeyedTensor``."""
        if features.keys != self.feature_names and sorted(features.keys) == sorted(self.feature_names):
            features = features.select(self.feature_names)
        return keyed_tensor(self.feature_names, [self.dim] * len(self.feature_names), self.forward(features))

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        features, kjt = as_jagged(features)
        if kjt:
            return self._keyed_forward(features)
        F_ = len(self.feature_names)
        if self.design == "retrieve":
            training = torch.is_grad_enabled()
            conv = self._take_prefetched(features, training)
            if conv is None:
                conv = self._convert(features, training)
            out = _Retrieve.apply(self.anchor, self, conv, training)
            return out.view(conv.B, F_ * self.dim)  # pooled sample-major: no transpose
        else:
            gids, bag, scale, nbags, B = self._prepare(features)
            out = _SendBased.apply(self.anchor, self, gids, bag, scale, nbags)
        return out.view(F_, B, self.dim).transpose(0, 1).reshape(B, F_ * self.dim)

    # -- the index conversion of OPER 5.1, synchronously or ahead of its step --------------------------
    def prefetch(self, features: JaggedFeatures, *, background: bool = True) -> None:
        """Convert an upcoming training batch ahead of its step (OPER 5.1 pipelined with the previous step,
        as TorchRec's ``TrainPipelineSparseDist`` distributes the next batch's input during the current step).

        Optional; retrieve design. Call it with every upcoming training batch, in the order of their steps,
        before the ``forward`` of the step *before* theirs (``emb.prefetch(next_batch); loss(emb(batch))
        .backward()``; or further ahead); every rank for the same steps. The batch's ids are checked and
        decoded, its remote rows deduplicated and sorted by owner (with ``background``, on a worker thread,
        while this rank computes and waits for its peers; the step that needs the result joins it). Then,
        over a collective transport, the row exchange of the step before the batch's tells every owner how
        many rows it will be asked for, and that step's gradient exchange carries the requests themselves:
        a step whose batch was prefetched sends only rows and gradients, two all-to-alls instead of four.
        Exact: requests are row addresses, which no update changes, and the rows travel in their own step,
        after the previous update. A ``forward`` of another batch in training, once the peers were told of
        the prefetched one, is an ``InputError``; inference lookups of other batches leave the queue alone.
        """
        if self.design != "retrieve":
            return
        jf = as_jagged(features)[0]
        self._check_keys(jf)
        self._pipelined = True
        while len(self._queue) >= _MAX_AHEAD and self._queue[0].state == "local":
            self._queue.popleft()  # never consumed, never announced: stale
        if background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"emb-prefetch-r{self.rank}")
            self._queue.append(_Ahead(jf, future=self._pool.submit(self._convert_ahead, jf)))
        else:
            self._queue.append(_Ahead(jf, conv=self._convert(jf, True)))

    def _convert_ahead(self, features: JaggedFeatures) -> "_Conversion":
        with torch.no_grad():
            return self._convert(features, True)

    def _take_prefetched(self, features: JaggedFeatures, training: bool):
        """The prefetched conversion of ``features`` (the head of the queue), or ``None`` (convert now)."""
        if not self._queue:
            return None
        head = self._queue[0]
        if same_batch(head.features, features):
            if training:
                self.stats["prefetched_steps"] = self.stats.get("prefetched_steps", 0) + 1
            return self._queue.popleft().conv
        if not training:  # an evaluation between training steps: the queue waits for its batch
            return None
        if head.state != "local":  # the peers already sent or expect this batch's requests
            raise InputError(f"sharded embedding (rank {self.rank}): forward got another batch than the one "
                             "prefetched for this step; prefetch(next) must be followed by forward(next)")
        return None  # a batch of a later step (the first prefetch of a loop): it waits

    def _convert(self, features: JaggedFeatures, training: bool) -> "_Conversion":
        """A batch's flat lookups (``_inputs``) and remote rows (``remote_rows``), with what the retrieve
        design's training step needs of them (replica slots of fetched rows; with ``grad_sync="alltoall"``
        the replicas the batch reads)."""
        gids, bag, scale, _nbags, B, offsets, one_hot = self._inputs(features, ones=False)
        tm, W, me = self.tmap, self.world_size, self.rank
        code, key, remote, ridx, runiq, rinv, per_rank = remote_rows(tm, gids, me, W, ops=self._kernel_ops())
        R = runiq.numel()
        r_slot = None
        if training and self.num_slots:  # fetched rows that are replicas (held elsewhere, not here)
            rep = (code.index_select(0, ridx) & tm.REPLICA) != 0
            if bool(rep.any()):
                r_slot = torch.full((R,), -1, dtype=torch.int64, device=gids.device)
                r_slot[rinv[rep]] = tm.slots(gids.index_select(0, ridx[rep]))
        fused = bool(training and self.num_slots and self.grad_sync == "alltoall" and self.optimizer is not None)
        t_slots = _touched_replicas(self, key, remote, r_slot) if fused else None
        blocks = list(torch.split(runiq & tm.OFF_MASK, per_rank))
        return _Conversion(features, bag, scale, B, offsets, one_hot, key, ridx, rinv, per_rank, r_slot, t_slots,
                           blocks, fused)

    def _pool_table(self, extra: int) -> torch.Tensor:
        """The storage with room for ``extra`` fetched rows right after it, as one tensor whose head *is*
        ``self.weight`` (OPER 5.2: local and fetched rows pooled by one lookup, no copy of the local rows).
        Grown, with the storage moved into it, when too small or when the storage was moved or replaced."""
        w = self.weight
        n = w.shape[0]
        back = self._backing
        if back is None or back.data_ptr() != w.data_ptr() or back.shape[0] < n + extra or \
                back.device != w.device or back.dtype != w.dtype:
            back = torch.empty((n + extra + extra // 4 + 64, self.dim), dtype=w.dtype, device=w.device)
            back[:n].copy_(w)
            self._backing = back
            self.weight = back[:n]  # the registered buffer, now the head of the pooling table
        return back

    # -- the C++ CPU kernel (embedding/kernels.cpp): same bits as the PyTorch ops ------------------
    def _kernel_ops(self):
        """The loaded C++ kernel when it applies to this module (``cpu_kernel``, float32 storage on the CPU,
        ``dim`` <= ``kernels.MAX_DIM``, built), else ``None``: the PyTorch ops."""
        if not self.cpu_kernel or self.dim > kernels.MAX_DIM or not kernels.takes(self.weight):
            return None
        return kernels.fused_ops()

    def _kernel_slot(self, n: int) -> torch.Tensor:
        """The kernel's row -> slot map over ``n`` storage rows (int32, all -1 between calls; 4 bytes a row)."""
        if self._kslot is None or self._kslot.numel() < n or self._kslot.device != self.weight.device:
            self._kslot = torch.full((n,), -1, dtype=torch.int32, device=self.weight.device)
        return self._kslot

    def _kernel_row_sums(self, pos: torch.Tensor, kern: tuple, scale, grad_out: torch.Tensor, n: int, R: int):
        """Backward of a kernel-pooled lookup over ``[storage (n rows) | fetch area (R rows)]``: ``(rows_l,
        g_l, g_r)``, the storage rows read (first-seen order) with their gradient sums, and the sum of every
        fetch-area row; each sum over its values in batch order, as ``aggregate_row_gradients`` (one pass, a
        row -> slot map, no sort). ``rows_l`` and ``g_l`` are views of buffers reused by the next step."""
        offsets, one_hot, B = kern
        nv = pos.numel()
        g = grad_out if grad_out.dtype == torch.float32 and grad_out.stride(1) == 1 else \
            grad_out.to(torch.float32).contiguous()
        urows = self._kscratch.take("urows", nv, torch.int64, pos.device)
        ugrads = self._kscratch.take("ugrads", nv * self.dim, torch.float32, pos.device).view(nv, self.dim)
        fetched = torch.empty((R, self.dim), dtype=torch.float32, device=pos.device)
        u = kernels.fused_ops().sharded_row_grad_sums(
            pos, None if one_hot else offsets, None if scale is None else scale.contiguous(), g, B,
            len(self.feature_names), n, self._kernel_slot(n), urows, ugrads, fetched)
        return urows[:u], ugrads[:u], fetched

    def _kernel_apply(self, lists: list) -> None:
        """The fused optimizer by the C++ kernel: ``lists`` of ``(rows, grads, map or None, limit)``, summed per
        storage row in list order (a row's contributions added in that order, from zero: the association of
        ``_merge_row_grads`` and ``aggregate_row_gradients``), then one update per row. ``rows`` index ``map``
        when given (entries < 0 skipped); storage rows >= ``limit`` are skipped."""
        w = self.weight
        n = w.shape[0]
        none = w.new_empty(0, dtype=torch.int64)
        rows = [r.to(torch.int64).contiguous() for r, _g, _m, _l in lists]
        grads = [g.to(torch.float32).contiguous() for _r, g, _m, _l in lists]
        maps = [none if m is None else m for _r, _g, m, _l in lists]
        kernels.fused_ops().sharded_apply_row_grads(
            w, self.momentum if self.optimizer == "rowwise_adagrad" else None, self.touched, self._kernel_slot(n),
            rows, grads, maps, [int(lim) for _r, _g, _m, lim in lists], self.lr, self.eps)

    def _set_map(self, amap: AddressMap, device) -> None:
        """The state derived from this rank's view of ``amap`` (at construction and when a live migration hands
        the module a new map): the decode tables, the owned and slot counts, the replica region's global slots
        and the replica slot -> storage row map of the kernel's update."""
        me = self.rank
        self.tmap = TorchAddressMap(amap, me).to(device)
        self.num_owned = int(amap.num_owned()[me])
        self.num_slots = amap.num_slots
        # replica region index -> global slot (for gradients of replicas a peer read from this rank)
        region = np.full(int(amap.num_replicas_held()[me]), -1, dtype=np.int64)
        if self.num_slots:
            held = np.flatnonzero(amap.replica_local[:, me] >= 0)
            region[amap.replica_local[held, me]] = held
        self._region_slot = torch.from_numpy(region).to(device)
        # replica slot -> this rank's storage row, or -1 where it holds no copy
        local = self.tmap.replica_local
        self._replica_storage_rows = torch.where(local >= 0, local + self.num_owned, torch.full_like(local, -1))

    # -- updates ----------------------------------------------------------------------------------
    def _apply_owned(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Fused optimizer on storage rows (repeats allowed: summed first, as FBGEMM's exact optimizers)."""
        if self.optimizer is None or rows.numel() == 0:
            return
        if self._kernel_ops() is not None:  # repeats summed in order, as the stable sort below sums them
            self._kernel_apply([(rows, grads, None, self.weight.shape[0])])
            return
        uniq, g = aggregate_row_gradients(rows, grads, num_rows=self.weight.shape[0])
        self._update(uniq, g)

    def _update(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Fused optimizer on *unique* storage rows, each with its summed gradient."""
        if self.optimizer is None or rows.numel() == 0:
            return
        if self._kernel_ops() is not None:
            self._kernel_apply([(rows, grads, None, self.weight.shape[0])])
            return
        if self.optimizer == "sgd":
            sgd_update_(self.weight, rows, grads, self.lr)
        else:
            rowwise_adagrad_update_(self.weight, self.momentum, rows, grads, self.lr, self.eps)
        if self.touched is not None:  # delta checkpoints: the rows updated since track_touched()
            self.touched[rows] = True

    def _merge_row_grads(self, rows: torch.Tensor, grads: torch.Tensor, more: list) -> tuple:
        """Sum per storage row: ``rows`` (unique, with ``grads``) first, then each ``(rows_q, grads_q)`` of
        ``more`` in order (each ``rows_q`` unique), without sorting: a row's sum is ``grads + grads_q0 +
        grads_q1 ...`` in that order, the association of summing the concatenation in order. A persistent
        row -> slot table (storage-sized, -1 outside this call) finds each row's slot. Returns unique rows
        and their sums (rows in first-seen order)."""
        more = [(r, g) for r, g in more if r.numel()]
        if not more:
            return rows, grads
        dev = rows.device
        n = self.weight.shape[0]
        if self._slot_of is None or self._slot_of.numel() < n or self._slot_of.device != dev:
            self._slot_of = torch.full((n,), -1, dtype=torch.int64, device=dev)
        slot_of = self._slot_of
        k = rows.numel()
        slot_of.index_copy_(0, rows, torch.arange(k, device=dev))
        all_rows, places = [rows], []
        for r, _g in more:
            s = slot_of.index_select(0, r)
            new = s < 0
            m = int(new.sum())
            if m:
                nr = r[new]
                ns = torch.arange(k, k + m, device=dev)
                slot_of.index_copy_(0, nr, ns)
                s = s.masked_scatter(new, ns)
                all_rows.append(nr)
                k += m
            places.append(s)
        out = grads.new_zeros((k, grads.shape[1]))
        out[:rows.numel()] = grads
        for s, (_r, g) in zip(places, more):
            out.index_add_(0, s, g.to(out.dtype))
        all_rows = torch.cat(all_rows)
        slot_of.index_fill_(0, all_rows, -1)
        return all_rows, out

    def _apply_partial_bag_grads(self, served, dtype) -> None:
        """Owner side of the send design's backward: for every peer, the rows it asked this rank to pool
        (``offsets``), each value's partial bag, its scale, and the gradients of those partial bags. Sums
        per row, applies owned rows, and sends replica rows through the replica AllReduce."""
        dev = self.weight.device
        rows, grads, rep_slots, rep_grads = [], [], [], []
        for offsets, pbag, scale, g_bags in served:
            if offsets.numel() == 0:
                continue
            r, g = aggregate_row_gradients(offsets.to(dev), g_bags, src_index=pbag.to(dev), scale=scale.to(dev))
            owned = r < self.num_owned
            rows.append(r[owned])
            grads.append(g[owned])
            if not bool(owned.all()):
                rep_slots.append(self._region_slot.to(dev)[r[~owned] - self.num_owned])
                rep_grads.append(g[~owned])
        if rows:
            self._apply_owned(torch.cat(rows), torch.cat(grads))
        if self.num_slots:
            self._sync_and_apply_replicas(
                torch.cat(rep_slots) if rep_slots else torch.zeros(0, dtype=torch.int64, device=dev),
                torch.cat(rep_grads) if rep_grads else torch.zeros((0, self.dim), dtype=dtype, device=dev))

    def _sync_and_apply_replicas(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """Sum replica gradients over all ranks (OPER 5.3) and apply them on every holder."""
        if self.num_slots == 0 or self.optimizer is None:
            return
        st: dict = {}
        uslots, g = sync_replica_grads(slots, grads, self.num_slots, method=self.grad_sync,
                                       group=self.sync_group, stats=st)
        self.stats["grad_sync_bytes"] = self.stats.get("grad_sync_bytes", 0) + st.get("bytes_sent", 0)
        self._apply_replicas(uslots, g)

    def _apply_replicas(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply the summed gradients of replica ``slots`` (unique) to the ones this rank holds."""
        rows, g = self._replica_rows(slots, grads)
        self._update(rows, g)

    def _replica_rows(self, slots: torch.Tensor, grads: torch.Tensor) -> tuple:
        """The storage rows of the replica ``slots`` (unique) this rank holds, with their gradients."""
        local = self.tmap.replica_local.to(slots.device).index_select(0, slots)
        keep = (local >= 0).nonzero().squeeze(1)
        return self.num_owned + local.index_select(0, keep), grads.index_select(0, keep)

    # -- checkpoints ------------------------------------------------------------------------------
    def track_touched(self) -> None:
        """Record from now on which storage rows the optimizer updates (owned rows and replicas: one bool per
        storage row, set by the update); called again, forget the rows recorded so far. For delta checkpoints:
        ``shard_state(touched_only=True)``."""
        if self.touched is None:
            self.touched = torch.zeros(self.weight.shape[0], dtype=torch.bool, device=self.weight.device)
        else:
            self.touched.zero_()

    def shard_state(self, touched_only: bool = False) -> dict:
        """The rows this rank owns (its owned region, and the replicas it owns), with optimizer state:
        what a sharded checkpoint stores. Every row of the model is in exactly one rank's shard state.
        ``touched_only``: only those updated since :meth:`track_touched` (a delta checkpoint's)."""
        rep = self.amap.replica_gids_on(self.rank)
        mine = self.amap.owner_of(rep) == self.rank
        owned, off = self.amap.owned_rows(self.rank)  # off: arange unless a live migration edited the map
        gids = np.concatenate([owned, rep[mine]])
        idx = torch.from_numpy(np.concatenate([off, self.num_owned + np.flatnonzero(mine)]))
        if touched_only:
            if self.touched is None:
                raise ConfigError("shard_state(touched_only=True): rows are not tracked (call track_touched first)")
            hit = self.touched.index_select(0, idx.to(self.touched.device)).cpu().numpy()
            gids, idx = gids[hit], idx[torch.from_numpy(hit)]
        st = {"gids": torch.from_numpy(gids), "weight": self.weight[idx.to(self.weight.device)].detach().cpu()}
        if self.optimizer == "rowwise_adagrad":
            st["momentum"] = self.momentum[idx.to(self.momentum.device)].cpu()
        return st

    @torch.no_grad()
    def adopt_address_map(self, amap: AddressMap) -> None:
        """Run under ``amap`` from now on: the running map as a live migration edited it
        (``embedding.migrate.migrate_in_place``, which writes the rows that move itself). The storage takes
        ``amap``'s size for this rank and every row keeps its place: a shorter storage is a view of the same
        memory, a longer one grows into the pooling table's spare rows when there are enough (no copy), else
        once into a new tensor with a quarter more room (amortised over migrations); the row-wise state and
        the updated-rows flags follow the same way. Rows past the old size start at zero."""
        if amap.world_size != self.world_size or amap.table_names != self.amap.table_names:
            raise ConfigError("sharded embedding: adopt_address_map needs a map of the same tables and world size")
        n, dev, me = amap.storage_rows(self.rank), self.weight.device, self.rank
        self.amap = amap
        self._set_map(amap, dev)
        self.weight, self._backing = _resized(self.weight, n, self._backing)
        if self.optimizer == "rowwise_adagrad":
            self.momentum, self._momentum_room = _resized(self.momentum, n, getattr(self, "_momentum_room", None))
        if self.touched is not None:
            self.touched, self._touched_room = _resized(self.touched, n, getattr(self, "_touched_room", None))

    def _shard_gids(self, rank: int) -> np.ndarray:
        """Global ids of the rows in ``rank``'s shard state (``shard_state``'s order), from the address map."""
        rep = self.amap.replica_gids_on(rank)
        return np.concatenate([self.amap.owned_gids(rank), rep[self.amap.owner_of(rep) == rank]])

    @torch.no_grad()
    def ebc_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Collective (every rank calls it): the whole tables under a TorchRec ``EmbeddingBagCollection``'s
        names, ``{prefix}embedding_bags.<table>.weight [num_rows, dim]``, on every rank (on the storage's
        device). Each rank sends the rows of its shard state (every row is in exactly one) to every peer
        through the transport, and every rank places them by table and row. Weights only (an EBC's state
        dict has no optimizer state); needs the memory of all tables on every rank."""
        me, W = self.rank, self.world_size
        st = self.shard_state()
        dev = self.weight.device
        mine = st["weight"].to(dev)
        counts = [self._shard_gids(p).size if p != me else 0 for p in range(W)]
        got = self.transport.exchange([mine if p != me else mine[:0] for p in range(W)], recv_counts=counts,
                                      kind="checkpoint")
        got[me] = mine
        gids = np.concatenate([st["gids"].numpy() if p == me else self._shard_gids(p) for p in range(W)])
        if gids.size != self.amap.num_rows or np.unique(gids).size != gids.size:
            raise InputError(f"rank {me}: the shards hold {gids.size} rows ({np.unique(gids).size} distinct), "
                             f"the tables {self.amap.num_rows}")
        full = torch.empty((self.amap.num_rows, self.dim), dtype=self.weight.dtype, device=dev)
        full[torch.from_numpy(gids).to(dev)] = torch.cat(got)
        base = self.amap.table_base
        return {ebc_weight_key(t.name, prefix): full[int(base[i]):int(base[i]) + t.num_rows]
                for i, t in enumerate(self.tables)}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """An ``EmbeddingBagCollection``'s state dict (``{prefix}embedding_bags.<table>.weight``, whole
        tables, the same on every rank): each rank keeps the rows it holds (owned and replicas, by table and
        row: ``load_rows``); row-wise Adagrad state restarts at zero for them. Our own names as usual."""
        if not has_ebc_names(state_dict, prefix):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        expected, gids, rows, bad = set(), [], [], False
        for i, t in enumerate(self.tables):
            key = ebc_weight_key(t.name, prefix)
            expected.add(key)
            if key not in state_dict:
                missing_keys.append(key)
                continue
            w = state_dict[key]
            if tuple(w.shape) != (t.num_rows, self.dim):
                error_msgs.append(f"{key}: shape {tuple(w.shape)} in the checkpoint, ({t.num_rows}, {self.dim}) "
                                  f"in the module")
                bad = True
                continue
            gids.append(int(self.amap.table_base[i]) + np.arange(t.num_rows, dtype=np.int64))
            rows.append(w.detach())
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if rows and not bad:  # all or nothing: every rank skips a bad checkpoint alike
            with torch.no_grad():
                g = np.concatenate(gids)
                zeros = torch.zeros(g.size, dtype=torch.float32) if self.optimizer == "rowwise_adagrad" else None
                self.load_rows(g, torch.cat([r.to(self.weight.device) for r in rows]), zeros)

    def load_rows(self, gids: np.ndarray, weight: torch.Tensor, momentum: torch.Tensor | None = None) -> int:
        """Fill every storage row (owned or replica) whose global id is in ``gids``; returns rows filled."""
        mine = self.amap.storage_gids(self.rank)
        gids = np.asarray(gids)
        order = np.argsort(gids, kind="stable")  # runs of sorted ids (a shard's, a table's) merge in O(n)
        sorted_gids = gids[order]
        pos = np.searchsorted(sorted_gids, mine)
        pos = np.clip(pos, 0, max(len(gids) - 1, 0))
        hit = (sorted_gids[pos] == mine) if len(gids) else np.zeros(len(mine), bool)
        dst = torch.from_numpy(np.flatnonzero(hit))
        src = torch.from_numpy(order[pos[hit]])
        self.weight[dst] = weight[src].to(self.weight)
        if momentum is not None and self.optimizer == "rowwise_adagrad":
            self.momentum[dst] = momentum[src].to(self.momentum)
        return int(hit.sum())


def _resized(t: torch.Tensor, n: int, room: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t`` (a storage-sized tensor, rows first) as ``n`` rows, its rows in place: a view of ``room`` (the
    tensor ``t`` heads, with spare rows after it) when that holds ``n`` rows, else a new tensor with a quarter
    more room, ``t`` copied once. Returns ``(the n rows, the room they head)``; rows past ``len(t)`` are zero."""
    old = t.shape[0]
    if n <= old:
        return t[:n], room
    if room is None or room.data_ptr() != t.data_ptr() or room.shape[0] < n or room.dtype != t.dtype or \
            room.device != t.device or room.shape[1:] != t.shape[1:]:
        spare = room.shape[0] - old if room is not None and room.data_ptr() == t.data_ptr() else 0
        room = torch.empty((n + max(n // 4, spare), *t.shape[1:]), dtype=t.dtype, device=t.device)
        room[:old].copy_(t)
    room[old:n].zero_()
    return room[:n], room


def _split_by_rank(src: torch.Tensor, W: int) -> list[int]:
    return torch.bincount(src, minlength=W).tolist()


class _Conversion:
    """One batch's index conversion (OPER 5.1) for the retrieve design, and how far its requests went.

    ``state``: ``local`` (converted here only), ``counted`` (every owner knows how many rows it will be
    asked for: they rode in the previous step's row exchange), ``ready`` (the owners hold the requests
    themselves, ``requests`` and ``peer_slots`` here: they rode in the previous step's gradient exchange)."""

    __slots__ = ("features", "bag", "scale", "B", "offsets", "one_hot", "key", "ridx", "rinv", "per_rank",
                 "r_slot", "t_slots", "blocks", "fused", "state", "recv_counts", "requests", "peer_slots")

    def __init__(self, features, bag, scale, B, offsets, one_hot, key, ridx, rinv, per_rank, r_slot, t_slots,
                 blocks, fused):
        self.features, self.bag, self.scale, self.B, self.offsets = features, bag, scale, B, offsets
        self.one_hot, self.key, self.ridx, self.rinv, self.per_rank = one_hot, key, ridx, rinv, per_rank
        self.r_slot, self.t_slots, self.blocks, self.fused = r_slot, t_slots, blocks, fused
        self.state = "local"
        self.recv_counts = None  # per peer: (rows it will request from here, replica slots it will send)
        self.requests = None
        self.peer_slots = None

    def announce(self, me: int, W: int) -> torch.Tensor:
        """The header this rank sends each peer about this batch: ``[rows it will request + 1, replica slots]``
        (``[0, 0]``: no batch prefetched)."""
        t = self.t_slots.numel() if self.fused else 0
        return torch.tensor([[c + 1, t] if p != me else [0, 0] for p, c in enumerate(self.per_rank)],
                            dtype=torch.int64)


class _Ahead:
    """A prefetched batch and its conversion, computed on the prefetch thread until first needed."""

    __slots__ = ("features", "_future", "_conv")

    def __init__(self, features: JaggedFeatures, future=None, conv: _Conversion | None = None):
        self.features, self._future, self._conv = features, future, conv

    @property
    def conv(self) -> _Conversion:
        if self._conv is None:
            self._conv = self._future.result()  # joins the prefetch thread (re-raises its InputError)
            self._future = None
        return self._conv

    @property
    def state(self) -> str:
        return "local" if self._conv is None else self._conv.state


class _Retrieve(torch.autograd.Function):
    """Retrieve-based lookup (OPER 5.1-5.2): fetch unique remote rows, pool locally.

    Only the remote values are deduplicated: their packed ``(source rank, offset)`` codes, made unique and
    sorted, come in source-rank order, so the rows to request from each peer are contiguous blocks, and the
    fetched blocks land in that order in a fetch area right after the rank's own storage
    (``ShardedEmbedding._pool_table``, OPER 5.2). Local values index the storage directly, remote ones the
    fetch area, and one ``embedding_bag`` pools them all, each bag in its values' order. Backward sums the
    gradients per storage or fetch-area row in batch order (``aggregate_row_gradients``, the one sort of the
    step): fetched rows go back to their owners (replicas through ``grad_sync``), and each owner adds the
    peers' sums to its own (``_merge_row_grads``, no second sort) and applies the fused optimizer once.

    All-to-alls per training step: requests (a count exchange, then the ids), rows, gradients: four. With
    ``ShardedEmbedding.prefetch`` the next batch's counts ride in the row exchange and its ids in the
    gradient exchange: two.
    """

    @staticmethod
    def forward(ctx, anchor, mod: ShardedEmbedding, conv: _Conversion, training):
        W, me, tr = mod.world_size, mod.rank, mod.transport
        dev = mod.weight.device
        per_rank, blocks, fused = conv.per_rank, conv.blocks, conv.fused and training
        R = sum(per_rank)
        collective = tr.fuses_exchanges
        if conv.state == "ready":  # the requests rode in the previous step's gradient exchange
            requests, peer_slots = conv.requests, conv.peer_slots
        elif conv.state == "counted":  # their counts rode in the previous step's row exchange
            rc = conv.recv_counts  # as announced: with the replica slots when the conversion was fused
            got = tr.exchange([torch.cat([b, conv.t_slots]) if conv.fused else b for b in blocks],
                              recv_counts=[a + b if p != me else 0 for p, (a, b) in enumerate(rc)], kind="ids")
            requests = [x[:a] for x, (a, _b) in zip(got, rc)]
            peer_slots = [x[a:] for x, (a, _b) in zip(got, rc)] if fused else None
        elif fused:  # grad_sync "alltoall": the replica rows this batch read travel with the requests
            t_slots = conv.t_slots
            cnt = tr.exchange_counts(torch.tensor([[c, t_slots.numel()] if p != me else [0, 0]
                                                   for p, c in enumerate(per_rank)], dtype=torch.int64, device=dev))
            got = tr.exchange([torch.cat([b, t_slots]) if p != me else b for p, b in enumerate(blocks)],
                              recv_counts=cnt.sum(1).tolist(), kind="ids")
            requests = [x[:c] for x, c in zip(got, cnt[:, 0].tolist())]
            peer_slots = [x[c:] for x, c in zip(got, cnt[:, 0].tolist())]
        else:
            requests = tr.exchange(blocks, kind="ids")
            peer_slots = None
        if fused:
            peer_slots[me] = conv.t_slots
            mod.stats["grad_sync_alltoall_bytes"] = mod.stats.get("grad_sync_alltoall_bytes", 0) + \
                (W - 1) * conv.t_slots.numel() * (8 + mod.dim * mod.weight.element_size())
        replies = [mod.weight.index_select(0, r.to(dev)) if p != me else mod.weight[:0]
                   for p, r in enumerate(requests)]
        nxt = None
        n = mod.weight.shape[0]
        table = mod._pool_table(R)
        if training and mod._pipelined and collective and W > 1:
            # the row exchange carries a header: how many rows each rank will request next step
            nxt = mod._queue[0].conv if mod._queue and mod._queue[0].state == "local" else None
            hdr = nxt.announce(me, W) if nxt is not None else torch.zeros((W, 2), dtype=torch.int64)
            wt = mod.weight.dtype
            got = tr.exchange_packed([[hdr[p].to(dev), replies[p]] for p in range(W)],
                                     [[(torch.int64, (), 2), (wt, (mod.dim,), c)] for c in per_rank],
                                     ["meta", "rows"])
            fetched = [x[1] if x is not None else mod.weight[:0] for x in got]
            heads = torch.stack([x[0] for p, x in enumerate(got) if p != me]).view(-1, 2).tolist()
            announced = [h[0] > 0 for h in heads]
            if any(a != (nxt is not None) for a in announced):
                raise InputError(f"sharded embedding (rank {me}): ranks disagree on prefetching the next batch; "
                                 "every rank calls prefetch for the same steps")
            if nxt is not None:
                peers = [p for p in range(W) if p != me]
                rc = [(0, 0)] * W
                for p, h in zip(peers, heads):
                    rc[p] = (h[0] - 1, h[1])
                nxt.recv_counts = rc
                nxt.state = "counted"
        else:
            fetched = tr.exchange(replies, recv_counts=[c if p != me else 0 for p, c in enumerate(per_rank)],
                                  kind="rows")
        if R:
            torch.cat(fetched, out=table[n:n + R])
        out, pos, bag_s = pool_local_and_fetched(table[:n + R], n, conv.key, conv.ridx, conv.rinv, conv.scale,
                                                 conv.bag, conv.offsets, conv.B, conv.one_hot,
                                                 off_mask=mod.tmap.OFF_MASK, ops=mod._kernel_ops())
        if training:
            ctx.mod = mod
            kern = (conv.offsets, conv.one_hot, conv.B) if bag_s is None else None  # pooled by the C++ kernel
            ctx.saved = (pos.to(dev), n, bag_s, conv.scale, conv.r_slot, per_rank, requests, peer_slots, nxt, kern)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        mod: ShardedEmbedding = ctx.mod
        pos, n, bag, scale, r_slot, per_rank, requests, peer_slots, nxt, kern = ctx.saved
        ctx.saved = None
        dev = grad_out.device
        me, W = mod.rank, mod.world_size
        # one gradient per storage / fetch-area row, its values summed in batch order
        # (values in feature-major order, as single-process lookups and the PGAS design sum them)
        if kern is not None:  # the C++ kernel: one pass, no sort; storage rows in first-seen order
            rows_l, g_l, g_r = mod._kernel_row_sums(pos, kern, scale, grad_out, n, sum(per_rank))
        else:
            rows, g = aggregate_row_gradients(pos, grad_out, src_index=bag.to(dev),
                                              scale=None if scale is None else scale.to(dev),
                                              num_rows=n + sum(per_rank))
            k = int(torch.searchsorted(rows, n))
            rows_l, g_l = rows[:k], g[:k]
            g_r = g[k:]  # every fetched row was read: rows[k:] == n + arange(R), in request order
        if r_slot is not None:
            r_rep = (r_slot >= 0).to(dev)
            send = g_r.masked_fill(r_rep.unsqueeze(1), 0.0)
        else:
            send = g_r
        blocks = list(torch.split(send, per_rank))
        blocks[me] = send[:0]
        own_l = rows_l < mod.num_owned
        rep_g = None
        if mod.num_slots:  # gradients of the replica rows read here, in _touched_replicas' order
            lrep = (~own_l).nonzero().squeeze(1)
            if kern is not None and lrep.numel() > 1:  # ascending storage rows, as _touched_replicas lists them
                lrep = lrep.index_select(0, torch.argsort(rows_l.index_select(0, lrep)))
            slots = [mod._region_slot.to(dev).index_select(0, rows_l.index_select(0, lrep) - mod.num_owned)]
            rep_g = [g_l.index_select(0, lrep)]
            if r_slot is not None:
                rsel = r_rep.nonzero().squeeze(1)
                slots.append(r_slot.to(dev).index_select(0, rsel))
                rep_g.append(g_r.index_select(0, rsel))
            slots, rep_g = torch.cat(slots), torch.cat(rep_g)
        if peer_slots is not None:  # grad_sync "alltoall": they ride behind each peer's block
            blocks = [torch.cat([b, rep_g]) if p != me else b for p, b in enumerate(blocks)]
        g_counts = [r.numel() + (peer_slots[p].numel() if peer_slots is not None else 0) if p != me else 0
                    for p, r in enumerate(requests)]
        if nxt is not None and nxt.state == "counted":
            # the next batch's requests ride behind the gradients (their counts rode in the row exchange)
            ids = [torch.cat([b, nxt.t_slots]) if nxt.fused else b for b in nxt.blocks]
            rc = nxt.recv_counts
            got = mod.transport.exchange_packed([[blocks[p], ids[p]] for p in range(W)],
                                                [[(send.dtype, (mod.dim,), g_counts[p]), (torch.int64, (), a + b)]
                                                 for p, (a, b) in enumerate(rc)], ["grads", "ids"])
            nxt.requests = [nxt.blocks[me][:0] if x is None else x[1][:a] for x, (a, _b) in zip(got, rc)]
            nxt.peer_slots = [None if x is None else x[1][a:] for x, (a, _b) in zip(got, rc)] if nxt.fused else None
            nxt.state = "ready"
            got = [send[:0] if x is None else x[0] for x in got]
        else:
            got = mod.transport.exchange(blocks, recv_counts=g_counts, kind="grads")
        recv = [x[:r.numel()] for x, r in zip(got, requests)]
        if peer_slots is not None:
            peer_g = [rep_g if p == me else x[r.numel():] for p, (x, r) in enumerate(zip(got, requests))]
        # owner side: own rows read here, plus the rows peers read from here (replicas are synced instead),
        # each peer's rows unique and already summed there: added to this rank's sums, no second sort
        if kern is not None and mod.optimizer is not None:  # the C++ kernel: merge and update in one call
            lists = [(rows_l, g_l, None, mod.num_owned)]
            lists += [(r.to(dev), gr, None, mod.num_owned) for p, (r, gr) in enumerate(zip(requests, recv))
                      if p != me and r.numel()]
            if peer_slots is not None:  # replica rows: every rank's sums in rank order, this rank's included
                rmap = mod._replica_storage_rows
                lists += [(peer_slots[p].to(dev), peer_g[p], rmap, n) for p in range(W)]
            mod._kernel_apply(lists)
            if peer_slots is None and mod.num_slots:
                mod._sync_and_apply_replicas(slots, rep_g)
            return torch.zeros_like(mod.anchor), None, None, None
        all_own = bool(own_l.all())
        rows_o = rows_l if all_own else rows_l[own_l]
        g_o = g_l if all_own else g_l[own_l]
        more = []
        for p, (r, gr) in enumerate(zip(requests, recv)):
            if p == me or r.numel() == 0:
                continue
            r = r.to(dev)
            owned = r < mod.num_owned
            if bool(owned.all()):
                more.append((r, gr))
            else:
                sel = owned.nonzero().squeeze(1)
                more.append((r.index_select(0, sel), gr.index_select(0, sel)))
        upd_rows, upd_g = mod._merge_row_grads(rows_o, g_o, more)
        if peer_slots is not None:  # every rank's contributions, summed in rank order: the same bits everywhere
            uslots, gsum = aggregate_row_gradients(torch.cat([x.to(dev) for x in peer_slots]), torch.cat(peer_g),
                                                   num_rows=mod.num_slots)
            rr, rg = mod._replica_rows(uslots, gsum)  # disjoint from the owned rows: one update for both
            upd_rows, upd_g = torch.cat([upd_rows, rr]), torch.cat([upd_g, rg.to(upd_g.dtype)])
        mod._update(upd_rows, upd_g)
        if peer_slots is None and mod.num_slots:
            mod._sync_and_apply_replicas(slots, rep_g)
        return torch.zeros_like(mod.anchor), None, None, None


def remote_rows(tm: TorchAddressMap, gids: torch.Tensor, me: int, W: int, ops=None):
    """Decode a batch's global ids on rank ``me`` and deduplicate the values read from other ranks (OPER 5.1):
    ``(code, key, remote, ridx, runiq, rinv, per_rank)``: packed codes, the codes without the replica bit,
    which values are remote and their positions, the unique remote keys (source-rank order, so each peer's
    rows are one block), each remote value's index among them, and how many rows come from each rank.
    With ``ops`` (the C++ kernel; CPU ids) the codes, keys and remote values come from one pass."""
    if ops is not None and gids.device.type == "cpu" and gids.dtype == torch.int64:
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
    return code, key, remote, ridx, runiq, rinv, _split_by_rank(runiq >> tm.SHIFT, W)


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


def _touched_replicas(mod: ShardedEmbedding, key: torch.Tensor, remote: torch.Tensor, r_slot) -> torch.Tensor:
    """Replica slots a batch reads: the held replica rows its local values read (ascending storage row),
    then the replicas it fetched (request order), the order backward lists their gradients in."""
    held = int(mod.weight.shape[0]) - mod.num_owned
    ops = mod._kernel_ops()
    if ops is not None and key.device.type == "cpu":  # one pass, a flag per held replica
        out = [ops.sharded_local_replicas(key, remote, mod.num_owned, mod.tmap.OFF_MASK,
                                          mod._region_slot[:held].contiguous())]
    else:
        off = key & mod.tmap.OFF_MASK
        sel = ((~remote) & (off >= mod.num_owned)).nonzero().squeeze(1)
        flag = torch.zeros(held, dtype=torch.bool, device=key.device)
        flag.index_fill_(0, off.index_select(0, sel) - mod.num_owned, True)
        out = [mod._region_slot.index_select(0, flag.nonzero().squeeze(1))]
    if r_slot is not None:
        out.append(r_slot[r_slot >= 0])
    return torch.cat(out)


class _SendBased(torch.autograd.Function):
    """Send-based lookup: ids to owners, owners pool partial bags, pooled partials back."""

    @staticmethod
    def forward(ctx, anchor, mod: ShardedEmbedding, gids, bag, scale, nbags):
        W, me, tr = mod.world_size, mod.rank, mod.transport
        dev = mod.weight.device
        src, off, _slot = mod.tmap.decode(gids)
        # partial bags: one per (source rank, bag) pair, numbered per source rank
        key = src * nbags + bag
        pkeys, pinv = torch.unique(key, sorted=True, return_inverse=True)
        p_src = pkeys // nbags
        p_bag = pkeys % nbags
        p_counts = _split_by_rank(p_src, W)
        p_first = torch.zeros(W + 1, dtype=torch.int64, device=dev)
        p_first[1:] = torch.cumsum(torch.tensor(p_counts, device=dev), 0)
        local_pbag = pinv - p_first[src]  # partial-bag number inside its source rank's list
        order = torch.argsort(src, stable=True)
        v_counts = _split_by_rank(src, W)
        ids = torch.stack([off[order], local_pbag[order]], 1)  # (offset on source, partial bag), rank-major
        s_ord = scale[order]
        recv_ids = tr.exchange(list(torch.split(ids, v_counts)), kind="ids")
        recv_scale = tr.exchange(list(torch.split(s_ord, v_counts)), kind="ids")
        a = sum(v_counts[:me])
        my_ids, my_scale = ids[a:a + v_counts[me]], s_ord[a:a + v_counts[me]]
        # pool, for every peer, the partial bags it asked for
        pooled = []
        for q in range(W):
            src_ids = my_ids if q == me else recv_ids[q]
            src_scale = my_scale if q == me else recv_scale[q]
            n_pb = p_counts[me] if q == me else (int(src_ids[:, 1].max()) + 1 if src_ids.numel() else 0)
            out_q = torch.zeros((n_pb, mod.dim), dtype=mod.weight.dtype, device=dev)
            if src_ids.numel():
                out_q.index_add_(0, src_ids[:, 1].to(dev),
                                 mod.weight.index_select(0, src_ids[:, 0].to(dev))
                                 * src_scale.to(dev, mod.weight.dtype)[:, None])
            pooled.append(out_q)
        back = tr.exchange([pooled[q] if q != me else pooled[q][:0] for q in range(W)],
                           recv_counts=[c if q != me else 0 for q, c in enumerate(p_counts)], kind="pooled")
        back[me] = pooled[me]
        partials = torch.cat(back)  # ordered like pkeys (rank-major)
        out = torch.zeros((nbags, mod.dim), dtype=mod.weight.dtype, device=dev)
        out.index_add_(0, p_bag.to(dev), partials)
        ctx.mod = mod
        ctx.saved = (p_bag, p_counts, recv_ids, recv_scale, my_ids, my_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        mod: ShardedEmbedding = ctx.mod
        p_bag, p_counts, recv_ids, recv_scale, my_ids, my_scale = ctx.saved
        dev = grad_out.device
        me, W = mod.rank, mod.world_size
        g_partial = grad_out[p_bag.to(dev)]  # gradient of every partial bag, rank-major
        parts = list(torch.split(g_partial, p_counts))
        n_recv = [int(recv_ids[q][:, 1].max()) + 1 if (q != me and recv_ids[q].numel()) else 0 for q in range(W)]
        got = mod.transport.exchange([parts[q] if q != me else parts[q][:0] for q in range(W)],
                                     recv_counts=n_recv, kind="grads")
        got[me] = parts[me]
        served = []
        for q in range(W):
            ids_q = my_ids if q == me else recv_ids[q]
            sc_q = my_scale if q == me else recv_scale[q]
            served.append((ids_q[:, 0], ids_q[:, 1], sc_q, got[q]))
        mod._apply_partial_bag_grads(served, grad_out.dtype)
        return torch.zeros_like(mod.anchor), None, None, None, None, None
