"""``ShardedEmbedding``: execute any placement plan with one flat storage and one fused lookup per rank.

OPER section 5 (all-in-one EMT). Each rank holds the rows it owns and the replicas it holds in one flat
storage. The address map (``embedding.address_map``), kept as torch tensors in host memory (OPER 5.1),
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

Stages (as TorchRec's ``ShardedModule``): a lookup runs ``create_context`` / ``input_dist(ctx, features)`` (check
the batch, decode its addresses, announce its ids to their owners) / ``compute(ctx)`` (pool what this rank holds)
/ ``output_dist(ctx)`` (the pooled rows to their samples), and in the backward ``grad_dist(ctx, grad)`` (the
gradients to the ranks that apply them) / ``update(ctx)`` (the fused optimizer); what passes between them is the
batch's typed context (``embedding.context``), and each design implements the stages in its own module
(``embedding.retrieve``, ``embedding.send``; the PGAS transport's in ``embedding.pgas_lookup``). The module holds
only its storage: the fused optimizer is ``embedding.row_update``, checkpoint state and migration
``embedding.shard_state``.

Per-step costs beyond the pooling kernel: a training step of the retrieve design makes four all-to-alls (request
counts, ids, rows, gradients) and sums each row's gradients once (one sort of the batch's values; an owner adds
its peers' per-row sums to its own without sorting again, and updates owned and replica rows in one fused call).
``ShardedEmbedding.prefetch`` runs the next batch's ``input_dist`` ahead, as TorchRec's
``TrainPipelineSparseDist`` does: the next batch is decoded on a worker thread, its request counts ride in the
current step's row all-to-all (send design: pooled all-to-all) and its ids in the current gradient all-to-all, so
a prefetched step makes two all-to-alls; the results are the same bits. Either design's steady step reads at most
three values on the host (the next batch's counts, the rows updated, the replica sync's union or sizes).

Replicated rows (data parallel, OPER 4.3) are read locally where held; their gradients are summed over
all ranks with ``grad_sync`` (local-aggregated sparse AllReduce by default, OPER 5.3; or, for few ranks,
``alltoall``: inside the retrieve design's backward all-to-all, no collective of its own), and every
holder applies the same update, so replicas stay identical.

Device: a batch's ids are decoded and deduplicated in host memory, where the address map is (on the input
pipeline's worker thread when prefetched); the retrieve design plans the step there too (each value's pooling row,
the per-row gradient segments, the replica picks: ``retrieve.DevicePlan``) and the plan crosses to the storage's
device once. Rows are pooled and updated on the device and pooled rows never leave it; the host reads only
counts (the next batch's requests, the rows updated, the replica union). Every tensor goes to the transport
where it is, and the transport moves it to the device its backend needs (``Transport.wire_device``: CUDA for
NCCL, host for gloo). Designed for GPU; tested on CPU (gloo) only.

Gradient scale: the module applies exactly the gradient it receives. Data-parallel training that wants
the single-process result uses a loss that is the sum over the local samples divided by the *global*
batch size, and sums (not averages) dense gradients over ranks; ``train.distributed`` does both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from embedscale.comm.transport import Transport
from embedscale.data.batch import JaggedFeatures, same_batch
from embedscale.device import HOST
from embedscale.embedding import retrieve, send
from embedscale.embedding.address_map import AddressMap, TorchAddressMap
from embedscale.embedding.context import LookupContext, RetrieveContext, SendContext, Stage
from embedscale.embedding.grad_sync import METHODS as _SYNC_METHODS
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.input_pipeline import Ahead, InputPipeline
from embedscale.embedding.interop import as_jagged, keyed_tensor
from embedscale.embedding.optim import RowGradientScratch
from embedscale.embedding.row_update import RowUpdates
from embedscale.embedding.shard_state import ShardState
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec, feature_to_table

DESIGNS = ("retrieve", "send")
SYNC_METHODS = (*_SYNC_METHODS, "alltoall")
_MAX_AHEAD = 4  # prefetched batches kept at most while none was announced to the peers
_SHIFT = TorchAddressMap.SHIFT  # (rank << 40) | offset packs a (rank, offset) pair into one sortable int64


@dataclass(frozen=True)
class Stages:
    """One design's stage functions (each takes the module and the batch's context) and its context type."""

    context: type
    input_dist: Callable
    compute: Callable
    output_dist: Callable
    grad_dist: Callable
    update: Callable
    start: Callable | None = None  # compute's exchange started, not waited for (``ShardedEmbedding.start``)
    grads_received: Callable | None = None  # the wait for a gradient exchange grad_dist left in flight


RETRIEVE = Stages(RetrieveContext, retrieve.input_dist, retrieve.compute, retrieve.output_dist, retrieve.grad_dist,
                  retrieve.update, retrieve.start_ahead, retrieve.grads_received)
SEND = Stages(SendContext, send.input_dist, send.compute, send.output_dist, send.grad_dist, send.update)


class ShardedEmbedding(RowUpdates, ShardState, nn.Module):
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
            (retrieve design over a transport that ``fuses_exchanges``): each rank's locally aggregated replica
            gradients ride in the backward all-to-all that returns the fetched rows' gradients, and every
            rank sums all ranks' contributions in rank order: no collective of its own (two fewer per step
            than ``local_aggregated``; it sends ``(W - 1) x`` the rows a rank touched, against the ring's
            ``2 (W - 1) / W x`` their union: about the same bytes at 2 ranks, more beyond).
        sync_group: process group for the replica AllReduce (default: the world).
        seed: row initialisation seed (``embedding.init``: the same rows as single-process training).
        init_index: each table's index for ``embedding.init`` (its position among the model's tables, when
            these are a subset of them, e.g. beside host-placed tables); default ``0, 1, ...``.
        device, dtype: where and how the storage lives.

    Forward runs the stages (``create_context``, ``input_dist``, then ``compute`` and ``output_dist`` in one
    autograd function whose backward runs ``grad_dist`` and ``update``). It takes this rank's mini-batch
    (``JaggedFeatures`` over ``feature_names``) and returns ``[B_local, F * D]`` in ``feature_names`` order,
    like ``LocalEmbeddingBags``. Given a TorchRec
    ``KeyedJaggedTensor`` (its keys in any order) it returns an ``EmbeddingBagCollection``'s ``KeyedTensor``;
    ``load_state_dict`` takes an EBC's state dict (``embedding_bags.<table>.weight``, whole tables: each rank
    keeps its rows) and :meth:`ebc_state_dict` gathers the tables back under those names
    (:mod:`embedscale.embedding.interop`).

    On the CPU with float32 storage the step's pooling, per-row gradient sums and fused updates run in the C++
    kernel (:mod:`embedscale.embedding.kernels`, when built; the same bits as the PyTorch ops, which every
    other device and dtype uses); ``cpu_kernel = False`` on an instance keeps the PyTorch ops.
    """

    cpu_kernel = True  # use the C++ CPU kernel where it applies (``kernel_ops``)

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
        self.weight_decay = 0.0  # optim.set_weight_decay; > 0: the PyTorch update path
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
        self._set_map(amap, device)  # (the map and the per-feature tables above stay in host memory)
        weight = initial_rows(self.tables, amap, rank, seed, init_index, dtype)
        self.register_buffer("weight", weight.to(device))
        if optimizer == "rowwise_adagrad":
            self.register_buffer("momentum", torch.zeros(weight.shape[0], dtype=torch.float32, device=device))
        elif optimizer not in ("sgd", None):
            raise ConfigError(f"sharded embedding: optimizer {optimizer!r} is not sgd, rowwise_adagrad or None")
        # a zero-size parameter so that autograd calls our backward even though the storage is a buffer
        self.anchor = nn.Parameter(torch.zeros(0, device=device))
        self.stats: dict[str, int] = {}
        self._backing: torch.Tensor | None = None  # storage + fetch area (``pool_table``)
        self._momentum_room: torch.Tensor | None = None  # what the row-wise state grows into (``adopt_address_map``)
        self._touched_room: torch.Tensor | None = None
        # storage rows the optimizer updated since track_touched() (delta checkpoints); None: not tracked
        self.register_buffer("touched", None, persistent=False)
        self.stages = RETRIEVE if design == "retrieve" else SEND
        # prefetched batches, in step order (``prefetch``), on a pipeline of its own until a run attaches its own
        self.input_lane = InputPipeline().lane("sharded", _MAX_AHEAD, _undistributed)
        self.prefetching = False  # set by the first ``prefetch``: training row exchanges carry a header
        # a lookup started ahead leaves its gradient all-to-all in flight beside the bottom MLP's backward (OPER 5.2;
        # the same bits). Off by default: the backend's worker thread that runs it costs wake-ups that made the main
        # job's step slower on a loaded 2-core machine (BENCHMARKS.md)
        self.overlap_backward = False
        self._slot_of: torch.Tensor | None = None  # storage row -> gradient slot, -1 outside a backward
        self._first_of: torch.Tensor | None = None  # storage row -> its first gradient entry (merge_and_apply)
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
        """The storage's device; the replica slot -> storage row table (per replica slot, used by the update)
        follows it there when the module was moved (``.to(device)`` moves buffers only). The address map and
        the per-feature tables stay in host memory, where the ids are decoded (OPER 5.1). A no-op check per
        step otherwise."""
        dev = self.weight.device
        if self.replica_storage_rows.device != dev:
            self.replica_storage_rows = self.replica_storage_rows.to(dev)
        return dev

    def host_tensors(self) -> list[torch.Tensor]:
        """What this module keeps in host memory on every run (OPER 5.1): the address map and the per-feature
        tables the ids are decoded with, and the replica region's slots."""
        return [*self.tmap.tensors().values(), self._feature_table, self._feature_rows, self._feature_mean,
                self.region_slot]

    def flat_lookups(self, features: JaggedFeatures, ones: bool = True):
        """A mini-batch as flat lookups: ``(gids, bag, scale, nbags, B, offsets, one_hot)``.

        ``gids``: global row id of every value; ``bag``: its bag, ``f * B + b`` (features major, as the
        values come); ``scale``: its per-sample weight (``1/length`` folded in for mean pooling), or ``None``
        when every weight is 1 and ``ones`` is false; ``offsets``: ``[nbags + 1]`` start of every bag;
        ``one_hot``: every bag holds exactly one value.
        Values of feature ``f`` are one contiguous block, so table bases and bounds repeat per feature.
        Everything is computed in host memory, where the address map is (OPER 5.1; a batch on another device
        is moved there once): the decoded batch crosses to the storage's device afterwards, once; with
        ``validate`` the ids are checked here, once, by one vectorised comparison (a batch already checked by
        the loader against the same tables can skip it: ``validate=False``).
        """
        self._check_keys(features)
        self._follow_storage()
        dev = self.tmap.row_code.device
        F_, B = len(self.feature_names), features.batch_size
        lengths = features.lengths.to(dev)
        values = features.values.to(dev)
        n = values.numel()
        per_feature = lengths.view(F_, B).sum(1) if B else torch.zeros(F_, dtype=torch.int64, device=dev)
        base = self.tmap.table_base.index_select(0, self._feature_table)  # each feature's table's first gid
        ops = self.kernel_ops() if values.dtype == torch.int64 and n else None
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

    def read_ranks(self, features: JaggedFeatures, max_values: int = 8192) -> torch.Tensor:
        """How many of a batch's values each rank serves under the running map (OPER 5.1's decode: a replica read
        counts at the rank that reads it): ``world_size`` int64 counts of a strided sample of the batch's values
        (every ``k``-th, ``k`` the smallest stride that keeps at most ``max_values``), those of this module's
        features within their tables (values of other features, or outside their table, are left out: the lookup
        itself rejects the latter). The drift monitor's alarm (``train.replan``) reads it for one batch a
        monitoring period, in NumPy on the host map (values on a device are copied to the host first)."""
        lpk = features.length_per_key_list()
        fbase, frows = self._read_features(features.keys)
        vals = features.values
        if vals.device != HOST:
            vals = vals.to(HOST)
        n = vals.numel()
        stride = max(1, -(-n // max(1, int(max_values))))
        f = np.searchsorted(np.cumsum(lpk), np.arange(0, n, stride), side="right")
        v = vals.numpy()[::stride].astype(np.int64, copy=False)
        rows = frows[f]
        gids = v + fbase[f]
        ok = (v >= 0) & (v < rows)
        if not ok.all():
            gids = gids[ok]
        return torch.from_numpy(np.bincount(self.tmap.sources(gids), minlength=self.world_size).astype(np.int64))

    def _read_features(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read_ranks`' per-key table offset (first global id) and rows, 0 rows for a key of no table of
        this module (so none of its values is counted)."""
        index = {name: f for f, name in enumerate(self.feature_names)}
        base = self.tmap.table_base.tolist()
        t = [int(self._feature_table[index[k]]) if k in index else -1 for k in keys]
        return (np.array([base[i] if i >= 0 else 0 for i in t], dtype=np.int64),
                np.array([self.tables[i].num_rows if i >= 0 else 0 for i in t], dtype=np.int64))

    def _keyed_forward(self, features: JaggedFeatures):
        """A TorchRec KJT's lookup (its keys in any order): an ``EmbeddingBagCollection``'s ``KeyedTensor``."""
        if features.keys != self.feature_names and sorted(features.keys) == sorted(self.feature_names):
            features = features.select(self.feature_names)
        return keyed_tensor(self.feature_names, [self.dim] * len(self.feature_names), self.forward(features))

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        features, kjt = as_jagged(features)
        if kjt:
            return self._keyed_forward(features)
        ctx = self.create_context()
        self.input_dist(ctx, features)
        return _Lookup.apply(self.anchor, self, ctx)

    def start(self, features: JaggedFeatures) -> LookupContext | None:
        """Begin a lookup ahead of its result (OPER 5.2): ``input_dist``, then ``compute``'s exchange started and
        not waited for (the retrieve design's rows); :meth:`finish` completes it, the same bits as ``forward``.
        The model computes its bottom MLP in between. ``None``: this lookup runs only whole (another design or
        transport, a TorchRec KJT, or a forward hook on the module, such as a managed-id mapping)."""
        features, kjt = as_jagged(features)
        if kjt or self.stages.start is None or self._forward_pre_hooks or self._forward_hooks:
            return None
        ctx = self.create_context()
        self.input_dist(ctx, features)
        self.stages.start(self, ctx)
        return ctx

    def finish(self, ctx: LookupContext) -> torch.Tensor:
        """The result of a lookup :meth:`start` began: ``forward``'s ``[B, F * D]``."""
        return _Lookup.apply(self.anchor, self, ctx)

    # -- the stages (TorchRec's ShardedModule); each design's in its own module ------------------------
    def create_context(self, training: bool | None = None) -> LookupContext:
        """A new batch context of this design (``training``: default, whether autograd records)."""
        return self.stages.context(None, torch.is_grad_enabled() if training is None else training)

    def input_dist(self, ctx: LookupContext, features: JaggedFeatures) -> None:
        """Check ``features``, decode their addresses and announce their ids to their owners (as far as
        ``prefetch`` did not do it ahead: then ``ctx`` takes over the prefetched batch's progress)."""
        features = as_jagged(features)[0]
        if ctx.state is Stage.NEW:
            ahead = self._take_prefetched(features, ctx.training)
            if ahead is not None:
                ctx.take_over(ahead)
            else:
                ctx.features = features
        self.stages.input_dist(self, ctx)

    def compute(self, ctx: LookupContext) -> None:
        """Pool what this rank holds of the batch (and serve its peers' requests)."""
        self.stages.compute(self, ctx)

    def output_dist(self, ctx: LookupContext) -> torch.Tensor:
        """The pooled rows to their samples: ``[B, F * D]`` in ``feature_names`` order."""
        return self.stages.output_dist(self, ctx)

    def grad_dist(self, ctx: LookupContext, grad: torch.Tensor) -> None:
        """Backward: the gradient of ``output_dist``'s result to the ranks that apply it."""
        self.stages.grad_dist(self, ctx, grad)

    def update(self, ctx: LookupContext) -> None:
        """Backward: the fused optimizer on the rows this rank applies (replicas synced)."""
        self.stages.update(self, ctx)

    # -- the next batch's input_dist ahead of its step (OPER 5.1 pipelined) ----------------------------
    def prefetch(self, features: JaggedFeatures, *, background: bool = True) -> None:
        """Run an upcoming training batch's ``input_dist`` ahead of its step (OPER 5.1 pipelined with the previous
        step, as TorchRec's ``TrainPipelineSparseDist`` distributes the next batch's input during the current step).

        Optional. Call it with every upcoming training batch, in the order of their steps,
        before the ``forward`` of the step *before* theirs (``emb.prefetch(next_batch); loss(emb(batch))
        .backward()``; or further ahead); every rank for the same steps. The batch's ids are checked and
        decoded, its remote rows deduplicated and sorted by owner (with ``background``, on a worker thread,
        while this rank computes and waits for its peers; the step that needs the result joins it). Then,
        over a transport that fuses exchanges, the row exchange of the step before the batch's tells every
        owner how many rows it will be asked for, and that step's gradient exchange carries the requests
        themselves: a step whose batch was prefetched sends only rows and gradients, two all-to-alls instead
        of four. Exact: requests are row addresses, which no update changes, and the rows travel in their own
        step, after the previous update. The send design decodes the batch ahead (its partial bags and the
        messages to their owners, ``send.decode``); the pooled exchange of the step before tells every owner how
        many values, partial bags and distinct rows it will get, and that step's gradient exchange carries the
        messages: two all-to-alls a step instead of four, the same bits. A ``forward`` of
        another batch in training, once the peers were told of the prefetched one, is an ``InputError``;
        inference lookups of other batches leave the queue alone.
        """
        jf = as_jagged(features)[0]
        self._check_keys(jf)
        self.prefetching = True
        self.input_lane.push(jf, self._decode_ahead, background)  # (drops batches never consumed nor announced)

    def _decode_ahead(self, features: JaggedFeatures) -> LookupContext:
        ctx = self.stages.context(features, True)
        with torch.no_grad():
            (retrieve.decode if self.stages is RETRIEVE else send.decode)(self, ctx)
        return ctx

    def attach_input_pipeline(self, pipeline: InputPipeline) -> None:
        """Prefetch on ``pipeline`` (the run's) from now on; nothing may be queued yet."""
        if len(self.input_lane):
            raise InputError(f"sharded embedding (rank {self.rank}): {len(self.input_lane)} batch(es) prefetched "
                             "before the input pipeline was attached")
        self.input_lane.leave()
        self.input_lane = pipeline.lane("sharded", _MAX_AHEAD, _undistributed)

    @property
    def pending_batches(self) -> int:
        """Batches prefetched and not looked up yet."""
        return len(self.input_lane)

    def next_prefetched(self) -> RetrieveContext | None:
        """The context of the next prefetched batch (joins its decoding), or ``None``."""
        head = self.input_lane.head()
        return head.value if head is not None else None

    def next_ready(self) -> bool:
        """Whether the next prefetched batch, if any, is decoded (its context read without waiting)."""
        head = self.input_lane.head()
        return head is None or head.ready

    def queued_undistributed(self) -> RetrieveContext | None:
        """The next prefetched batch's context while no peer has heard of it (its counts ride the coming row
        exchange), else ``None``."""
        head = self.input_lane.head()
        return head.value if head is not None and _undistributed(head) else None

    def _take_prefetched(self, features: JaggedFeatures, training: bool) -> RetrieveContext | None:
        """The prefetched context of ``features`` (the head of the queue), or ``None`` (decode now)."""
        head = self.input_lane.head()
        if head is None:
            return None
        if same_batch(head.features, features):
            if training:
                self.stats["prefetched_steps"] = self.stats.get("prefetched_steps", 0) + 1
            return self.input_lane.pop().value
        if not training:  # an evaluation between training steps: the queue waits for its batch
            return None
        if not _undistributed(head):  # the peers already sent or expect this batch's requests
            raise InputError(f"sharded embedding (rank {self.rank}): forward got another batch than the one "
                             "prefetched for this step; prefetch(next) must be followed by forward(next)")
        return None  # a batch of a later step (the first prefetch of a loop): it waits

    def pool_table(self, extra: int) -> torch.Tensor:
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


    def _set_map(self, amap: AddressMap, device) -> None:
        """The state derived from this rank's view of ``amap`` (at construction and when a live migration hands
        the module a new map): the decode tables, the owned and slot counts, the replica region's global slots
        and the replica slot -> storage row map of the kernel's update."""
        me = self.rank
        self.tmap = TorchAddressMap(amap, me)  # host memory (OPER 5.1): never copied to the device
        self.num_owned = int(amap.num_owned()[me])
        self.num_slots = amap.num_slots
        # replica region index -> global slot (for gradients of replicas a peer read from this rank)
        region = np.full(int(amap.num_replicas_held()[me]), -1, dtype=np.int64)
        if self.num_slots:
            held = np.flatnonzero(amap.replica_local[:, me] >= 0)
            region[amap.replica_local[held, me]] = held
        self.region_slot = torch.from_numpy(region)
        # replica slot -> this rank's storage row, or -1 where it holds no copy (on the storage's device)
        local = self.tmap.replica_local
        self.replica_storage_rows = torch.where(local >= 0, local + self.num_owned,
                                                torch.full_like(local, -1)).to(device)


def initial_rows(tables: list[TableSpec], amap: AddressMap, rank: int, seed: int, init_index: list[int] | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """The initial storage of ``rank`` (its owned rows, then its replicas): every row as single-process training
    initialises it (``embedding.init``), table ``t`` under init index ``init_index[t]`` (default ``t``)."""
    gids = amap.storage_gids(rank)
    dim = tables[0].dim
    weight = torch.empty((gids.size, dim), dtype=dtype)
    table_of = np.searchsorted(amap.table_base, gids, side="right") - 1
    init_index = list(range(len(tables))) if init_index is None else list(init_index)
    if len(init_index) != len(tables):
        raise ConfigError(f"sharded embedding: {len(init_index)} init indices for {len(tables)} tables")
    for t, spec in enumerate(tables):
        sel = np.flatnonzero(table_of == t)
        if sel.size:
            weight[torch.from_numpy(sel)] = torch.from_numpy(uniform_rows(
                seed, init_index[t], gids[sel] - amap.table_base[t], dim, spec.num_rows)).to(dtype)
    return weight


class _Lookup(torch.autograd.Function):
    """A lookup's differentiable stages: ``compute`` and ``output_dist`` forward, ``grad_dist`` and ``update``
    backward (the module applies the gradient to its storage itself: the anchor's gradient is empty)."""

    @staticmethod
    def forward(fctx, anchor, mod, ctx: LookupContext):
        mod.compute(ctx)
        out = mod.output_dist(ctx)
        if ctx.training:
            fctx.mod, fctx.batch = mod, ctx
        return out

    @staticmethod
    def backward(fctx, grad_out):
        mod, ctx = fctx.mod, fctx.batch
        fctx.batch = None  # the batch's tensors go with this step
        mod.grad_dist(ctx, grad_out)
        if ctx.state is Stage.GRADS_SENDING:  # in flight: the rest of the backward (the bottom MLP's) runs beside
            # it; the wait and the update at the backward's end (the engine's final callbacks, OPER 5.2)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish_backward(mod, ctx))
        else:
            _finish_backward(mod, ctx)
        return torch.zeros_like(mod.anchor), None, None


def _finish_backward(mod, ctx: LookupContext) -> None:
    """A lookup's backward after ``grad_dist``: its exchange waited for (when left in flight), then ``update``."""
    if ctx.state is Stage.GRADS_SENDING:
        mod.stages.grads_received(mod, ctx)
    mod.update(ctx)
    ctx.nxt = None


def _undistributed(ahead: Ahead) -> bool:
    """Whether no peer has heard of a prefetched batch yet (still decoding, or decoded here only)."""
    return not ahead.joined or ahead.value.state is Stage.DECODED
