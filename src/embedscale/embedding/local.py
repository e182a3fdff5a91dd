"""All embedding tables of one rank in one flat storage, one fused lookup, fused sparse optimizers.

``LocalEmbeddingBags`` is embedscale's counterpart of FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
(TBE) and of TorchRec's ``EmbeddingBagCollection`` with a fused optimizer, written with plain PyTorch ops
so the same code runs on every device:

* **One storage.** Every table lives in one 1-D tensor ``weights`` (an ``nn.Parameter`` only when
  ``optimizer=None``, otherwise a buffer). Tables are grouped by ``dim`` (TorchRec groups tables the same
  way before handing them to TBE); each *dim group* is a contiguous ``[group_rows, dim]`` slice of the
  storage with its tables stacked in the order given. A table's *flat row offset* is the index of its
  row 0 in its group (:meth:`row_offset`), so ``flat row = row_offset(table) + row``: the address space
  of OPER's all-in-one, address-mapped embedding. With one ``dim`` (the usual case) there is one group
  and one flat row space for all tables.
* **One fused lookup** per dim group for all its features: the input ids are shifted by the per-feature
  row offset (a precomputed tensor, no Python loop over tables) and pooled by a single
  ``torch.nn.functional.embedding_bag`` over the group's storage. Several features may share a table
  (``TableSpec.features``). One-hot batches are transposed to sample-major order on the (cheap) ids, so
  the pooled result is directly ``[B, sum of feature dims]``; multi-hot batches are pooled in the
  input's key-major bag order and the ``[F, B, dim]`` result is transposed (cheaper than permuting
  jagged ids). When every bag holds the same number ``L`` of ids (fixed-length multi-hot), the ids are
  a ``[F, B * L]`` matrix: the range check, the row shift and the mean factors are per-feature
  broadcasts and the bags are ``arange(0, n + 1, L)`` (no per-value ``repeat_interleave``).
* **Fused sparse optimizers** (FBGEMM's "fused" TBE): when ``optimizer`` is ``"sgd"`` or
  ``"rowwise_adagrad"`` the lookup is a custom ``torch.autograd.Function`` whose backward sums the
  gradient per unique looked-up row (sort by row, then a segment sum over the output gradient rows of
  each value's bag, scaled by per-sample weight and ``1/length`` for mean) and updates those rows in
  place during ``loss.backward()``. The backward reads the output gradient in bag order (one transpose
  of the pooled-size gradient) so a fixed-length bag's values find their bag as ``i // L`` of the sort
  permutation; when each feature reads a table of its own (the usual case), the rows are sorted table
  run by table run, in chunks of ``optim.SORT_CHUNK`` values (the same order as one sort, faster); the
  per-value buffers (rows, sort outputs, weights) are reused across steps
  (``optim.RowGradientScratch``: no per-step page faults of ``O(n)`` memory; :mod:`embedscale.embedding.optim`
  documents the exact formulas). No dense ``[rows, dim]`` gradient is ever built and the weights never
  get a ``.grad``; do not call ``backward`` twice through the same lookup (each call applies the update).
  Dense model parameters keep their own torch optimizer.
* **The C++ CPU kernel** (:mod:`embedscale.embedding.kernels`, ``kernels.cpp``): when it is built and the
  rule of ``_kernel_applies`` holds (float32 storage on the CPU, ``dim`` <= 1024, each feature of the group
  reading a table of its own, ``cpu_kernel=True``), the pooled forward writes the sample-major output
  directly and the backward + optimizer update is one OpenMP pass over the features: each value's output
  gradient is accumulated into its row through a row -> slot map (no sort), then SGD / row-wise Adagrad is
  applied once per distinct row. Same bits as the PyTorch ops (same per-row summation order, same
  rounding); every other case (CUDA, other dtypes, shared tables, sequences, :meth:`lookup_bags`,
  :meth:`apply_row_gradients`, no build) uses the PyTorch ops above. :attr:`uses_cpu_kernel` tells which.
* ``optimizer=None``: ``weights`` is a regular ``nn.Parameter`` with dense autograd gradients (small
  data-parallel tables, tests).

Pooling per table (``TableSpec.pooling``): ``sum``; ``mean`` (the sum divided by the bag length, an empty
bag gives zeros; with per-sample weights it is the weighted sum divided by the length); ``none``
(unpooled sequences, returned by :meth:`lookup_sequences`, not by :meth:`forward`). Per-sample weights
(``JaggedFeatures.weights``) multiply each looked-up row before pooling (TorchRec's weighted features).

Initialisation (``init="uniform"``): every row of a table with ``n`` rows is drawn from
``U(-1/sqrt(n), 1/sqrt(n))`` as in the DLRM reference (``dlrm_s_pytorch.py`` ``create_emb``).

Input validation (``validate=True``, the default) costs one vectorised min/max check per lookup and
raises :class:`embedscale.errors.InputError` naming the feature, table and offending row id; turn it off
(``validate=False`` or the attribute) in speed-critical inner loops whose ids are already checked
(an unchecked id past its table reads a neighbouring table of the same dim group, or fails in
``embedding_bag``). Host syncs per lookup: one to tell one-hot from multi-hot batches, one for the
validation (relevant on GPUs, where they stall the stream).

Example::

    >>> import torch
    >>> from embedscale.specs import TableSpec
    >>> from embedscale.data.batch import JaggedFeatures
    >>> from embedscale.embedding.local import LocalEmbeddingBags
    >>> ebc = LocalEmbeddingBags([TableSpec("user", 100, 8), TableSpec("item", 50, 8, features=["a", "b"])],
    ...                          optimizer="rowwise_adagrad", lr=0.1, seed=0)
    >>> jf = JaggedFeatures.from_dense(["user", "a", "b"], torch.tensor([[1, 2, 3], [4, 5, 5]]))
    >>> out = ebc(jf)                      # [2, 24]: user | a | b
    >>> out.sum().backward()               # rows 1, 4 of user and 2, 3, 5 of item are updated in place
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding import kernels
from embedscale.embedding.interop import as_jagged, ebc_state_dict, ebc_weight_key, has_ebc_names, keyed_tensor
from embedscale.embedding.optim import (
    OPTIMIZERS,
    RowGradientScratch,
    add_rows_,
    aggregate_row_gradients,
    rowwise_adagrad_update_,
    sgd_update_,
)
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec, feature_to_table

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class DimGroup:
    """Tables of one ``dim``: a contiguous ``[num_rows, dim]`` slice of the flat storage.

    ``elem_offset`` is the slice's first element in ``weights``; ``state_offset`` its first row in the
    per-row optimizer state; ``tables`` indexes ``LocalEmbeddingBags.tables``; ``pooled`` and
    ``sequence`` index ``feature_names`` and ``sequence_feature_names``.
    """

    index: int
    dim: int
    tables: tuple[int, ...]
    num_rows: int
    elem_offset: int
    state_offset: int
    pooled: tuple[int, ...]
    sequence: tuple[int, ...]


@dataclass
class _BagPlan:
    """One dim group's share of a lookup: ``rows`` are flat rows in the group, bags ``offsets``."""

    rows: torch.Tensor  # int32/int64 [n] flat rows in the group
    offsets: torch.Tensor | None  # [num_bags + 1] (dtype of rows); None = one value per bag (one-hot)
    scale: torch.Tensor | None  # [n] per-value factor (per-sample weight, 1/length for mean) or None
    num_bags: int
    width: int  # output columns of this group per sample (features x dim)
    key_major: int = 1  # k > 1: bags are in key-major order f * B + b (output transposed to [B, k, dim])
    fixed_len: int = 0  # L > 0: every bag holds exactly L values (value i is in bag i // L); 0 = jagged
    segments: list[int] | None = None  # values per key when each key's rows are a table of its own, in row order
    disjoint: bool = False  # each of the plan's features reads a table of its own (the C++ kernel's condition)


def check_lengths(lengths: torch.Tensor, n: int, names: list[str]) -> None:
    """Bag lengths of ``names`` must be non-negative and add up to the ``n`` values."""
    if lengths.numel() == 0:
        if n:
            raise InputError(f"features {names}: {n} values but no lengths")
        return
    lo, total = int(lengths.min()), int(lengths.sum())
    if lo < 0:
        raise InputError(f"features {names}: negative bag length {lo}")
    if total != n:
        raise InputError(f"features {names}: lengths sum to {total} but there are {n} values")


def bag_plan(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, B: int,
             row_off: torch.Tensor, limit: torch.Tensor, mean: torch.Tensor | None, dim: int, *,
             dtype: torch.dtype, row_dtype: torch.dtype, offsets_dtype: torch.dtype | None = None,
             validate: bool = True, names: list[str] = (), on_bad=None,
             alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> _BagPlan:
    """One dim group's key-major ids (``k`` features x ``B`` samples, ``lengths`` ``[k, B]``) as flat rows
    of the group (``row_off[f]`` + id, checked against ``limit[f]``) and bags; shared by the fused local
    lookup and the host parameter server, which must agree value for value.

    One-hot batches transpose to sample-major bags of one value each (``offsets`` None; mean = sum);
    multi-hot ones keep the input's key-major bags ``f * B + b`` (``key_major = k``; the pooled
    ``[k, B, dim]`` is transposed afterwards), with ``1 / length`` folded into ``scale`` for the features
    whose ``mean`` flag is set. ``on_bad()`` raises the error naming the first id outside its table.
    ``alloc(n, dtype)`` provides the rows' buffer (default ``torch.empty``; a training module passes a
    buffer reused across steps). The rows are written as a copy of the ids plus a same-dtype shift (a
    mixed-dtype add into an int32 output is several times slower on CPU).
    """
    k = lengths.shape[0]
    n = values.numel()
    dev = values.device
    if alloc is None:
        def alloc(m: int, dt: torch.dtype) -> torch.Tensor:
            return torch.empty(m, dtype=dt, device=dev)
    shift = row_off.to(row_dtype)
    if weights is not None:
        weights = weights.to(dtype)
    fixed = 0  # every bag has this many values (one sync; 0: jagged or empty)
    if n and k * B and n % (k * B) == 0:
        lo_len, hi_len = torch.aminmax(lengths)
        lo_len, hi_len = int(lo_len), int(hi_len)
        if lo_len == hi_len and lo_len * k * B == n:
            fixed = lo_len
    if fixed > 1:
        return _fixed_length_bags(values, k, fixed, weights, B, shift, limit, mean, dim, dtype, row_dtype,
                                  offsets_dtype, validate, on_bad, alloc)
    if fixed == 1:
        return _one_hot_bags(values, k, weights, B, shift, limit, dim, row_dtype, validate, on_bad, alloc)
    return _jagged_bags(values, lengths, weights, B, shift, limit, mean, dim, dtype, row_dtype, offsets_dtype,
                        validate, names, on_bad, alloc)


def _fixed_length_bags(values, k, fixed, weights, B, shift, limit, mean, dim, dtype, row_dtype, offsets_dtype,
                       validate, on_bad, alloc) -> _BagPlan:
    """Fixed-length multi-hot (L ids per bag): the ids are a [k, B * L] matrix, so the check, the row shift
    and the mean factors are per-feature broadcasts (no per-value repeat_interleave), and the bags are
    arange(0, n + 1, L). Same rows, offsets and scales as the jagged path (``_jagged_bags``)."""
    n, dev = values.numel(), values.device
    v2 = values.view(k, B * fixed)
    if validate:
        lo, hi = torch.aminmax(v2, dim=1)  # one pass for both bounds of every feature
        if bool(((hi >= limit) | (lo < 0)).any()):
            on_bad()
    rows = alloc(n, row_dtype)
    rows.copy_(values)
    rows.view(k, B * fixed).add_(shift.unsqueeze(1))
    offsets = torch.arange(0, n + 1, fixed, dtype=offsets_dtype or row_dtype, device=dev)
    scale = weights
    if mean is not None and bool(mean.any()):
        one = torch.ones((), dtype=dtype, device=dev)
        inv = torch.where(mean, one / torch.full((), fixed, dtype=dtype, device=dev), one)
        inv_v = inv.unsqueeze(1).expand(k, B * fixed).reshape(-1)
        scale = inv_v if scale is None else scale * inv_v
    return _BagPlan(rows, offsets, scale, k * B, k * dim, k, fixed)


def _one_hot_bags(values, k, weights, B, shift, limit, dim, row_dtype, validate, on_bad, alloc) -> _BagPlan:
    """One value per bag: transposed to sample-major bags (``offsets`` None; mean = sum)."""
    n = values.numel()
    v2 = values.view(k, B)
    # per-feature max and one global min: one vectorised check, one sync
    if validate and bool((v2.amax(1) >= limit).any() | (v2.min() < 0)):
        on_bad()
    rows = alloc(n, row_dtype)
    rows.view(B, k).copy_(v2.t()).add_(shift)  # transpose to sample-major, then shift
    scale = weights.view(k, B).t().reshape(-1) if weights is not None else None
    return _BagPlan(rows, None, scale, k * B, k * dim, 1, 1)


def _jagged_bags(values, lengths, weights, B, shift, limit, mean, dim, dtype, row_dtype, offsets_dtype, validate,
                 names, on_bad, alloc) -> _BagPlan:
    """Bags of any length, key-major ``f * B + b``, with ``1 / length`` in ``scale`` for the mean features."""
    k, n, dev = lengths.shape[0], values.numel(), values.device
    if validate:
        check_lengths(lengths, n, list(names))
    lpk = lengths.sum(1)
    if validate and n:
        limit_v = torch.repeat_interleave(limit, lpk, output_size=n)
        if bool(((values >= limit_v) | (values < 0)).any()):
            on_bad()
    rows = alloc(n, row_dtype)
    rows.copy_(values).add_(torch.repeat_interleave(shift, lpk, output_size=n))
    lengths_flat = lengths.reshape(-1)
    offsets = torch.zeros(k * B + 1, dtype=offsets_dtype or row_dtype, device=dev)
    torch.cumsum(lengths_flat, 0, out=offsets[1:])
    scale = weights
    if mean is not None and bool(mean.any()):
        inv = torch.where(mean.repeat_interleave(B), 1.0 / lengths_flat.clamp(min=1).to(dtype),
                          torch.ones((), dtype=dtype, device=dev))
        inv_v = torch.repeat_interleave(inv, lengths_flat, output_size=n)
        scale = inv_v if scale is None else scale * inv_v
    return _BagPlan(rows, offsets, scale, k * B, k * dim, k)


@dataclass
class _KeyPlan:
    """Where the module's features sit in one input key order (cached per key tuple)."""

    pooled_pos: list[list[int]]  # per group: input positions of its pooled features
    pooled_all: list[bool]  # per group: its pooled features are exactly the input keys, in order
    sequence_pos: list[list[int]]
    missing_pooled: list[str]
    missing_sequence: list[str]


def _bag_of_values(plan: _BagPlan) -> torch.Tensor | None:
    """Bag of each value (an index into the plan's bag order), for jagged bags; None when it follows from
    the value's position (one value per bag: value i -> bag i; fixed length L: value i -> bag i // L)."""
    if plan.offsets is None or plan.fixed_len:
        return None
    ids = torch.arange(plan.num_bags, device=plan.rows.device)
    return torch.repeat_interleave(ids, plan.offsets.diff(), output_size=plan.rows.numel())


def _grad_in_bag_order(plan: _BagPlan, grad: torch.Tensor, dim: int) -> torch.Tensor:
    """The ``[B, width]`` output gradient columns of one plan as ``[num_bags, dim]`` rows in bag order:
    key-major plans transpose it back to bag ``f * B + b`` (one copy of the gradient, the size of the
    pooled output, instead of a per-value bag index remapped to sample-major rows)."""
    if plan.key_major > 1:
        B = grad.shape[0]
        return grad.reshape(B, plan.key_major, dim).transpose(0, 1).reshape(plan.num_bags, dim)
    return grad.reshape(plan.num_bags, dim)


class _FusedPooledLookup(torch.autograd.Function):
    """Pooled lookup whose backward applies the module's sparse optimizer in place (fused TBE)."""

    @staticmethod
    def forward(ctx, anchor, module, groups, plans, batch_size, col_perm):  # noqa: ARG004
        ctx.module, ctx.groups, ctx.plans, ctx.col_perm = module, groups, plans, col_perm
        return module._pool(groups, plans, batch_size, col_perm, module._group_weight)

    @staticmethod
    def backward(ctx, grad_out):
        module, groups, plans = ctx.module, ctx.groups, ctx.plans
        if ctx.col_perm is not None:
            grad_out = grad_out.index_select(1, torch.argsort(ctx.col_perm))
        start = 0
        with torch.no_grad():
            for g, plan in zip(groups, plans):
                if module._kernel_applies(g, plan):
                    module._kernel_update(g, plan, grad_out[:, start:start + plan.width])
                    start += plan.width
                    continue
                grad_bags = _grad_in_bag_order(plan, grad_out[:, start:start + plan.width], g.dim)
                start += plan.width
                fixed = plan.fixed_len if plan.offsets is not None else 0
                module._fused_update(g, plan.rows, grad_bags, _bag_of_values(plan), plan.scale, fixed,
                                     plan.segments)
        # The update is applied (a second backward through this lookup is not allowed): drop the plans so
        # their rows buffer can be reused by the next step even while the caller still holds this graph.
        ctx.plans = None
        return None, None, None, None, None, None


class _FusedRowLookup(torch.autograd.Function):
    """Unpooled row lookup (sequences) whose backward applies the sparse optimizer in place."""

    @staticmethod
    def forward(ctx, anchor, module, group, rows):  # noqa: ARG004
        ctx.module, ctx.group, ctx.rows = module, group, rows
        return module._group_weight(group).index_select(0, rows)

    @staticmethod
    def backward(ctx, grad_rows):
        with torch.no_grad():
            ctx.module._fused_update(ctx.group, ctx.rows, grad_rows, None, None)
        return None, None, None, None


class LocalEmbeddingBags(nn.Module):
    """Embedding tables in one flat storage with one fused lookup and a fused sparse optimizer.

    Args:
        tables: the tables; their features, in this order, are the output columns.
        device: where the storage lives (default: torch's default device).
        dtype: storage dtype (float32 default). Optimizer state is always float32.
        optimizer: ``"sgd"`` (FBGEMM ``EXACT_SGD``), ``"rowwise_adagrad"`` (``EXACT_ROWWISE_ADAGRAD``),
            or ``None`` for a dense ``nn.Parameter`` trained by an outside torch optimizer.
        lr: learning rate of the fused optimizer (the attribute ``lr`` may be changed between steps).
        eps: Adagrad epsilon, added to ``sqrt(state)``.
        init: ``"uniform"`` (``U(-1/sqrt(num_rows), 1/sqrt(num_rows))`` per table, DLRM reference) or a
            callable ``init(spec, weight_view)`` filling the ``[num_rows, dim]`` view in place.
        seed: seed of the initialisation (a ``torch.Generator`` on ``device``); ``None`` uses the
            global RNG.
        validate: check every lookup's ids (one vectorised min/max per call); see the module docstring.
        cpu_kernel: use the fused C++ CPU kernel where it applies (module docstring); ``False`` keeps the
            PyTorch ops (same results, for comparisons).

    Attributes:
        feature_names: pooled features in output order; ``forward`` returns ``[B, sum(feature_dims)]``.
        feature_dims: dim of each pooled feature.
        sequence_feature_names: features of ``pooling="none"`` tables (:meth:`lookup_sequences`).
        groups: the :class:`DimGroup` layout of the storage.
    """

    def __init__(
        self,
        tables: list[TableSpec],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        optimizer: str | None = "sgd",
        lr: float = 0.01,
        eps: float = 1e-8,
        init: str | Callable[[TableSpec, torch.Tensor], None] = "uniform",
        seed: int | None = None,
        validate: bool = True,
        cpu_kernel: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ConfigError("LocalEmbeddingBags: no tables")
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise ConfigError(f"LocalEmbeddingBags: optimizer {optimizer!r} is not one of {OPTIMIZERS} or None")
        feature_to_table(tables)  # raises on repeated tables or features
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.tables = list(tables)
        self.table_names = [t.name for t in tables]
        self._table_index = {t.name: i for i, t in enumerate(tables)}
        self.optimizer = optimizer
        self.lr = float(lr)
        self.eps = float(eps)
        self.weight_decay = 0.0  # L2 on the rows a step updates (optim.set_weight_decay); > 0: the PyTorch path
        self.dtype = dtype
        self.validate = validate
        self._index_features(tables)
        groups, elem, state = self._lay_out_groups(tables)
        self.groups = groups
        self._register_storage(device, dtype, optimizer, elem, state)
        self._register_group_buffers(device)
        self._group_has_mean = [any(tables[self._feature_table[self.feature_names[p]]].pooling == "mean"
                                    for p in g.pooled) for g in groups]
        self._key_plans: dict[tuple[str, ...], _KeyPlan] = {}
        self._group_one_table_per_feature = []
        for g in groups:
            offs = [self._row_offset[self._feature_table[self.feature_names[p]]] for p in g.pooled]
            self._group_one_table_per_feature.append(all(a < b for a, b in zip(offs, offs[1:])))
        self._scratch = RowGradientScratch()  # per-value backward buffers reused across steps
        self.register_buffer("_arange", None, persistent=False)
        self.register_buffer("_arange32", None, persistent=False)
        self._row_dtype = [torch.int32 if g.num_rows <= _INT32_MAX else torch.int64 for g in groups]
        # The fused C++ CPU kernel (embedding.kernels) for the backward + update of pooled lookups: loaded
        # (never compiled) when the rule of _kernel_applies can hold; None keeps the PyTorch path.
        self.cpu_kernel = cpu_kernel
        # a flag, not the extension module itself: a module object cannot be deep-copied (copy.deepcopy(model))
        self._kernel_loaded = bool(cpu_kernel and optimizer is not None and kernels.takes(self.weights)
                                   and kernels.fused_ops() is not None)
        self._kernel_slots: dict[int, torch.Tensor] = {}  # per dim group: int32 row -> slot map, all -1
        self._kernel_bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per group: features' row ranges
        # rows the fused optimizer updated since track_touched() (delta checkpoints); None: not tracked
        self.register_buffer("touched", None, persistent=False)
        self.reset_parameters(init, seed)

    def _index_features(self, tables: list[TableSpec]) -> None:
        """Pooled features (the output columns, in table order) and sequence features, with their tables."""
        self.feature_names: list[str] = []
        self.feature_dims: list[int] = []
        self.sequence_feature_names: list[str] = []
        self._feature_table: dict[str, int] = {}
        self._feature_kind: dict[str, tuple[str, int]] = {}
        for t, spec in enumerate(tables):
            for f in spec.features:
                self._feature_table[f] = t
                if spec.pooling == "none":
                    self._feature_kind[f] = ("sequence", len(self.sequence_feature_names))
                    self.sequence_feature_names.append(f)
                else:
                    self._feature_kind[f] = ("pooled", len(self.feature_names))
                    self.feature_names.append(f)
                    self.feature_dims.append(spec.dim)

    def _lay_out_groups(self, tables: list[TableSpec]) -> tuple[list[DimGroup], int, int]:
        """Dim groups in order of first appearance, tables stacked in the given order. Returns the groups and
        the storage's elements and optimizer-state rows."""
        dims = list(dict.fromkeys(t.dim for t in tables))
        self._row_offset: list[int] = [0] * len(tables)
        self._table_group: list[int] = [0] * len(tables)
        groups: list[DimGroup] = []
        elem = state = 0
        for gi, d in enumerate(dims):
            members = tuple(i for i, t in enumerate(tables) if t.dim == d)
            rows = 0
            for i in members:
                self._row_offset[i] = rows
                self._table_group[i] = gi
                rows += tables[i].num_rows
            pooled = tuple(p for p, f in enumerate(self.feature_names) if tables[self._feature_table[f]].dim == d)
            seq = tuple(p for p, f in enumerate(self.sequence_feature_names)
                        if tables[self._feature_table[f]].dim == d)
            groups.append(DimGroup(gi, d, members, rows, elem, state, pooled, seq))
            elem += rows * d
            state += rows
        return groups, elem, state

    def _column_permutation(self) -> list[int] | None:
        """Output columns come group by group from the lookup; ``out[:, j] = grouped[:, perm[j]]`` puts them in
        feature order (None when they already are)."""
        group_cols = []
        col = [0]
        for p, d in enumerate(self.feature_dims):
            col.append(col[-1] + d)
        for g in self.groups:
            for p in g.pooled:
                group_cols.extend(range(col[p], col[p + 1]))
        perm = [0] * len(group_cols)
        for pos, c in enumerate(group_cols):
            perm[c] = pos
        return None if perm == list(range(len(perm))) else perm

    def _register_storage(self, device, dtype, optimizer, elem: int, state: int) -> None:
        """The flat storage (a parameter without a fused optimizer), Adagrad's per-row state, the column order."""
        perm = self._column_permutation()
        storage = torch.empty(elem, device=device, dtype=dtype)
        if optimizer is None:
            self.weights = nn.Parameter(storage)
        else:
            self.register_buffer("weights", storage, persistent=False)
        if optimizer == "rowwise_adagrad":
            self.register_buffer("momentum", torch.zeros(state, device=device, dtype=torch.float32),
                                 persistent=False)
        else:
            self.momentum = None
        self.register_buffer("_col_perm", None if perm is None else torch.tensor(perm, device=device),
                             persistent=False)

    def _register_group_buffers(self, device) -> None:
        """Per dim group, its pooled and sequence features' row offsets, table rows (the ids' limits) and mean
        flags."""
        tables = self.tables
        for g in self.groups:
            def tab(features, names):
                ts = [self._feature_table[names[p]] for p in features]
                return ([self._row_offset[t] for t in ts], [tables[t].num_rows for t in ts],
                        [tables[t].pooling == "mean" for t in ts])
            off, lim, mean = tab(g.pooled, self.feature_names)
            self.register_buffer(f"_g{g.index}_row_off", torch.tensor(off, dtype=torch.int64, device=device),
                                 persistent=False)
            self.register_buffer(f"_g{g.index}_limit", torch.tensor(lim, dtype=torch.int64, device=device),
                                 persistent=False)
            self.register_buffer(f"_g{g.index}_mean", torch.tensor(mean, dtype=torch.bool, device=device),
                                 persistent=False)
            soff, slim, _ = tab(g.sequence, self.sequence_feature_names)
            self.register_buffer(f"_g{g.index}_seq_row_off",
                                 torch.tensor(soff, dtype=torch.int64, device=device), persistent=False)
            self.register_buffer(f"_g{g.index}_seq_limit",
                                 torch.tensor(slim, dtype=torch.int64, device=device), persistent=False)

    # -- initialisation, layout, views -----------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, init: str | Callable[[TableSpec, torch.Tensor], None] = "uniform",
                         seed: int | None = None) -> None:
        """(Re)initialise every table (see the class docstring) and zero the optimizer state."""
        if not callable(init) and init != "uniform":
            raise ConfigError(f"LocalEmbeddingBags: init {init!r} is not 'uniform' or a callable")
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.weights.device)
            gen.manual_seed(int(seed))
        for spec in self.tables:
            w = self.table_weight(spec.name)
            if callable(init):
                init(spec, w)
            else:
                bound = 1.0 / spec.num_rows ** 0.5
                w.uniform_(-bound, bound, generator=gen)
        if self.momentum is not None:
            self.momentum.zero_()

    def _group_weight(self, g: DimGroup) -> torch.Tensor:
        return self.weights.narrow(0, g.elem_offset, g.num_rows * g.dim).view(g.num_rows, g.dim)

    def _group_momentum(self, g: DimGroup) -> torch.Tensor:
        return self.momentum.narrow(0, g.state_offset, g.num_rows)

    def _table(self, table: str) -> int:
        try:
            return self._table_index[table]
        except KeyError:
            raise InputError(f"table {table!r} is not in this module; tables: {self.table_names}") from None

    def row_offset(self, table: str) -> int:
        """Flat row of the table's row 0 in its dim group (``flat row = row_offset + row``)."""
        return self._row_offset[self._table(table)]

    def group_of(self, table: str) -> DimGroup:
        """The :class:`DimGroup` that stores ``table``."""
        return self.groups[self._table_group[self._table(table)]]

    def table_weight(self, name: str) -> torch.Tensor:
        """``[num_rows, dim]`` view of table ``name`` in the flat storage (writes go to the module)."""
        t = self._table(name)
        spec = self.tables[t]
        g = self.groups[self._table_group[t]]
        w = self._group_weight(g).narrow(0, self._row_offset[t], spec.num_rows)
        return w.detach() if self.optimizer is None else w

    def table_momentum(self, name: str) -> torch.Tensor:
        """``[num_rows]`` float32 view of the row-wise Adagrad state of table ``name``."""
        if self.momentum is None:
            raise ConfigError(f"optimizer {self.optimizer!r} keeps no per-row state")
        t = self._table(name)
        g = self.groups[self._table_group[t]]
        return self._group_momentum(g).narrow(0, self._row_offset[t], self.tables[t].num_rows)

    def track_touched(self) -> None:
        """Record from now on which rows the fused optimizer updates (one bool per storage row, on the
        storage's device, set by the update itself: :meth:`table_touched`); called again, forget the rows
        recorded so far. For delta checkpoints (``train.checkpoint``)."""
        if self.touched is None:
            self.touched = torch.zeros(self.groups[-1].state_offset + self.groups[-1].num_rows, dtype=torch.bool,
                                       device=self.weights.device)
        else:
            self.touched.zero_()

    def table_touched(self, name: str) -> torch.Tensor:
        """``[num_rows]`` bool view: the rows of table ``name`` updated since :meth:`track_touched`."""
        if self.touched is None:
            raise ConfigError("table_touched: rows are not tracked (call track_touched first)")
        t = self._table(name)
        g = self.groups[self._table_group[t]]
        return self.touched.narrow(0, g.state_offset + self._row_offset[t], self.tables[t].num_rows)

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def output_dim(self) -> int:
        return sum(self.feature_dims)

    @property
    def num_parameters(self) -> int:
        """Embedding values stored (sum of ``num_rows * dim``)."""
        return self.weights.numel()

    @property
    def memory_bytes(self) -> int:
        """Bytes of weights plus optimizer state."""
        n = self.weights.numel() * self.weights.element_size()
        if self.momentum is not None:
            n += self.momentum.numel() * self.momentum.element_size()
        return n

    def extra_repr(self) -> str:
        return (f"tables={len(self.tables)}, features={len(self.feature_names)}+"
                f"{len(self.sequence_feature_names)} seq, dims={[g.dim for g in self.groups]}, "
                f"rows={sum(t.num_rows for t in self.tables)}, optimizer={self.optimizer}, lr={self.lr}")

    # -- lookups ----------------------------------------------------------------------------------
    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        """Pooled embeddings ``[B, sum(feature_dims)]``, columns in ``feature_names`` order.

        ``features`` must hold every pooled feature (any key order); keys of sequence features are
        ignored here; an unknown key is an error. Given a TorchRec ``KeyedJaggedTensor`` instead, returns
        what an ``EmbeddingBagCollection`` returns: a ``KeyedTensor`` over ``feature_names``
        (:mod:`embedscale.embedding.interop`).
        """
        features, kjt = as_jagged(features)
        if kjt:
            return keyed_tensor(self.feature_names, self.feature_dims, self.forward(features))
        kp = self._key_plan(features.keys)
        if kp.missing_pooled:
            raise InputError(
                f"got {len(features.keys)} features {features.keys}, expected the {len(self.feature_names)} "
                f"pooled features {self.feature_names}: missing {kp.missing_pooled}"
            )
        B = features.batch_size
        groups, plans = self._pooled_plans(features, kp)
        return self._run_pooled(groups, plans, B, self._col_perm)

    def forward_dict(self, features: JaggedFeatures) -> dict[str, torch.Tensor]:
        """``{feature: [B, dim]}`` column views of :meth:`forward`."""
        out = self.forward(as_jagged(features)[0])
        return dict(zip(self.feature_names, torch.split(out, self.feature_dims, dim=1)))

    def lookup_sequences(self, features: JaggedFeatures) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Unpooled rows of the ``pooling="none"`` features: ``{feature: (rows [n, dim], lengths [B])}``.

        ``rows`` holds the looked-up rows of all samples, sample after sample (jagged, lengths as
        given). Gradients flow through the fused optimizer (or dense autograd with ``optimizer=None``).
        ``features`` may be a TorchRec ``KeyedJaggedTensor``.
        """
        features = as_jagged(features)[0]
        kp = self._key_plan(features.keys)
        if kp.missing_sequence:
            raise InputError(
                f"got {len(features.keys)} features {features.keys}, expected the sequence features "
                f"{self.sequence_feature_names}: missing {kp.missing_sequence}"
            )
        B = features.batch_size
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, pos in zip(self.groups, kp.sequence_pos):
            if not pos:
                continue
            sub = features.permute(pos)  # the batch's per-key split, computed once (JaggedFeatures)
            values, lengths = sub.values, sub.lengths.view(len(pos), B)
            names = [self.sequence_feature_names[p] for p in g.sequence]
            row_off = getattr(self, f"_g{g.index}_seq_row_off")
            limit = getattr(self, f"_g{g.index}_seq_limit")
            rows, lpk = self._flat_rows_key_major(values, lengths, row_off, limit, names)
            emb = self._lookup_rows_autograd(g, rows)
            for name, e, n in zip(names, torch.split(emb, lpk.tolist()), lengths):
                out[name] = (e, n)
        return out

    def lookup_rows(self, rows: torch.Tensor, table: str | None = None, *, dim: int | None = None) -> torch.Tensor:
        """Copy of rows ``[n, dim]`` without autograd: table-local rows of ``table``, or flat rows.

        Flat rows address the dim group of ``dim`` (may be omitted when there is one group). For the
        sharded embedding: a rank serving rows to others.
        """
        g, flat = self._resolve_rows(rows, table, dim)
        with torch.no_grad():
            return self._group_weight(g).index_select(0, flat)

    def lookup_bags(self, rows: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                    *, dim: int | None = None) -> torch.Tensor:
        """Sum-pooled bags ``[len(offsets) - 1, dim]`` of flat rows, with the fused optimizer in backward.

        ``offsets`` has ``num_bags + 1`` entries (``include_last_offset`` layout of ``embedding_bag``).
        The building block for a sharded module that pools locally-owned rows of remote samples.
        """
        g, flat = self._resolve_rows(rows, None, dim)
        nb = offsets.numel() - 1
        scale = None if per_sample_weights is None else per_sample_weights.to(self.dtype)
        plan = _BagPlan(flat, offsets.to(flat.dtype), scale, nb, nb * g.dim, 1)
        return self._run_pooled([g], [plan], 1, None).view(nb, g.dim)

    # -- fused optimizer entry point for remote gradients -------------------------------------------
    @torch.no_grad()
    def apply_row_gradients(self, rows: torch.Tensor, grads: torch.Tensor, table: str | None = None) -> None:
        """Apply the fused optimizer to gradient rows ``grads [n, dim]`` of ``rows`` (repeats are summed).

        ``rows`` are table-local when ``table`` is given, else flat rows of the dim group of
        ``grads.shape[1]``. This is the same update the backward of :meth:`forward` applies, for a
        module that receives row gradients from other ranks.
        """
        if self.optimizer is None:
            raise ConfigError("apply_row_gradients needs a fused optimizer (optimizer is None)")
        if grads.dim() != 2 or grads.shape[0] != rows.numel():
            raise InputError(f"apply_row_gradients: grads of shape {tuple(grads.shape)} for {rows.numel()} rows")
        g, flat = self._resolve_rows(rows, table, grads.shape[1])
        if g.dim != grads.shape[1]:
            raise InputError(f"apply_row_gradients: grads have dim {grads.shape[1]}, table {table!r} has {g.dim}")
        self._fused_update(g, flat, grads, None, None)

    # -- internals --------------------------------------------------------------------------------
    def _resolve_rows(self, rows: torch.Tensor, table: str | None, dim: int | None) -> tuple[DimGroup, torch.Tensor]:
        rows = rows.reshape(-1).to(torch.int64)
        if table is not None:
            t = self._table(table)
            g = self.groups[self._table_group[t]]
            limit, base, what = self.tables[t].num_rows, self._row_offset[t], f"table {table!r}"
        else:
            cands = [g for g in self.groups if dim is None or g.dim == dim]
            if len(cands) != 1:
                raise InputError(f"flat rows need a dim naming one dim group; dims here: "
                                 f"{[g.dim for g in self.groups]}, got dim={dim}")
            g = cands[0]
            limit, base, what = g.num_rows, 0, f"dim-{g.dim} group (flat rows)"
        if self.validate and rows.numel():
            lo, hi = torch.aminmax(rows)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise InputError(f"{what}: row {bad} is outside [0, {limit})")
        return g, (rows + base if base else rows)

    def _key_plan(self, keys: list[str]) -> _KeyPlan:
        key = tuple(keys)
        kp = self._key_plans.get(key)
        if kp is not None:
            return kp
        pos: dict[str, int] = {}
        for i, k in enumerate(keys):
            if k not in self._feature_kind:
                raise InputError(
                    f"feature {k!r} is not read by any table here; known features: "
                    f"{self.feature_names + self.sequence_feature_names}"
                )
            if k in pos:
                raise InputError(f"feature {k!r} appears twice in the input keys")
            pos[k] = i
        pooled_pos, pooled_all, seq_pos = [], [], []
        for g in self.groups:
            pp = [pos[self.feature_names[p]] for p in g.pooled if self.feature_names[p] in pos]
            pooled_pos.append(pp)
            pooled_all.append(pp == list(range(len(keys))))
            seq_pos.append([pos[self.sequence_feature_names[p]] for p in g.sequence
                            if self.sequence_feature_names[p] in pos])
        kp = _KeyPlan(pooled_pos, pooled_all, seq_pos,
                      [f for f in self.feature_names if f not in pos],
                      [f for f in self.sequence_feature_names if f not in pos])
        if len(self._key_plans) < 64:
            self._key_plans[key] = kp
        return kp

    def _raise_bad_ids(self, values: torch.Tensor, lengths: torch.Tensor, names: list[str], limits: list[int]) -> None:
        """Slow path, only after the vectorised check failed: find and name the first bad id."""
        B = lengths.shape[1]
        per_feature = torch.split(values, lengths.sum(1).tolist())
        for name, v, lim, lens in zip(names, per_feature, limits, lengths):
            bad = ((v < 0) | (v >= lim)).nonzero()
            if bad.numel():
                i = int(bad[0])
                sample = int(torch.searchsorted(torch.cumsum(lens, 0), i, right=True))
                value = int(v[i])
                table = self.tables[self._feature_table[name]].name
                kind = "negative row id" if value < 0 else "row id"
                raise InputError(
                    f"feature {name!r} (table {table!r}, {lim} rows): {kind} {value} at sample {sample} "
                    f"of {B} is outside [0, {lim})"
                )
        raise InputError("row id outside its table")  # pragma: no cover - the fast check said so

    def _check_lengths(self, lengths: torch.Tensor, n: int, names: list[str]) -> None:
        check_lengths(lengths, n, names)

    def _flat_rows_key_major(self, values, lengths, row_off, limit, names, row_dtype=torch.int64):
        """Key-major ids -> flat rows (validated); returns ``(rows, values_per_key)``."""
        n = values.numel()
        if self.validate:
            self._check_lengths(lengths, n, names)
        lpk = lengths.sum(1)
        if self.validate and n:
            limit_v = torch.repeat_interleave(limit, lpk, output_size=n)
            if bool(((values >= limit_v) | (values < 0)).any()):
                self._raise_bad_ids(values, lengths, names, limit.tolist())
        rows = torch.empty(n, dtype=row_dtype, device=values.device)
        torch.add(values, torch.repeat_interleave(row_off, lpk, output_size=n), out=rows)
        return rows, lpk

    def _pooled_plans(self, features: JaggedFeatures, kp: _KeyPlan) -> tuple[list[DimGroup], list[_BagPlan]]:
        B = features.batch_size
        groups, plans = [], []
        for g, pos, all_keys in zip(self.groups, kp.pooled_pos, kp.pooled_all):
            if not pos:
                continue
            sub = features if all_keys else features.permute(pos)  # per-key split computed once per batch
            values, lengths, weights = sub.values, sub.lengths.view(len(sub.keys), B), sub.weights
            groups.append(g)
            plans.append(self._bag_plan(g, values, lengths, weights, B))
        return groups, plans

    def _bag_plan(self, g: DimGroup, values, lengths, weights, B: int) -> _BagPlan:
        """Flat rows of a group's features: :func:`bag_plan`."""
        names = [self.feature_names[p] for p in g.pooled]
        limit = getattr(self, f"_g{g.index}_limit")
        plan = bag_plan(values, lengths, weights, B, getattr(self, f"_g{g.index}_row_off"), limit,
                        getattr(self, f"_g{g.index}_mean") if self._group_has_mean[g.index] else None, g.dim,
                        dtype=self.dtype, row_dtype=self._row_dtype[g.index], validate=self.validate, names=names,
                        on_bad=lambda: self._raise_bad_ids(values, lengths, names, limit.tolist()),
                        alloc=self._rows_alloc(g.index) if self.optimizer is not None and torch.is_grad_enabled()
                        else None)
        plan.disjoint = self._group_one_table_per_feature[g.index]
        if plan.key_major > 1 and self._group_one_table_per_feature[g.index] and self.optimizer is not None:
            # key-major values: each feature's rows are one table's, tables in row order, so the backward
            # sorts feature by feature (optim.aggregate_row_gradients ``segments``)
            plan.segments = ([B * plan.fixed_len] * plan.key_major if plan.fixed_len
                             else lengths.sum(1).tolist())
        return plan

    def release_buffers(self) -> None:
        """Free the per-value buffers kept across training steps (they are rebuilt on the next step);
        they hold about 20 bytes per looked-up value of the largest batch seen (``buffer_bytes``)."""
        self._scratch.clear()
        self._kernel_slots.clear()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers kept across training steps (not in :attr:`memory_bytes`): the per-value
        buffers of the PyTorch path, and the C++ kernel's row -> slot map (4 bytes per row of a group it
        updated)."""
        return self._scratch.nbytes + sum(s.numel() * s.element_size() for s in self._kernel_slots.values())

    @property
    def _ops(self):
        """The loaded extension (:func:`kernels.fused_ops`, cached there) when this module may use it, else None."""
        return kernels.fused_ops() if self._kernel_loaded else None

    @property
    def uses_cpu_kernel(self) -> bool:
        """The fused C++ kernel is loaded and enabled (``cpu_kernel``) for this module's pooled lookups."""
        return self._ops is not None and self.cpu_kernel

    def _kernel_applies(self, g: DimGroup, plan: _BagPlan) -> bool:
        """The rule that picks the C++ kernel for a pooled lookup's forward and backward, else the PyTorch
        ops: the kernel is built and enabled (``cpu_kernel``), the storage is float32 on the CPU (checked
        when it was loaded, and again here: the module may have been moved), ``dim`` <= ``kernels.MAX_DIM``,
        and each feature of the plan reads a table of its own (features update in parallel); lookups from
        :meth:`forward` only."""
        return (self._ops is not None and self.cpu_kernel and plan.disjoint and kernels.takes(self.weights)
                and g.dim <= kernels.MAX_DIM and not self.weight_decay)

    def _kernel_update(self, g: DimGroup, plan: _BagPlan, grad: torch.Tensor) -> None:
        """Backward + optimizer update of one plan by the C++ kernel (``kernels.cpp``); ``grad`` is the
        ``[B, width]`` output gradient of the plan's columns."""
        slot = self._kernel_slots.get(g.index)
        if slot is None:
            slot = torch.full((g.num_rows,), -1, dtype=torch.int32, device=self.weights.device)
            self._kernel_slots[g.index] = slot
        if grad.dtype != torch.float32:
            grad = grad.float()
        if grad.stride(1) != 1:
            grad = grad.contiguous()
        scale = plan.scale.contiguous() if plan.scale is not None else None
        touched = self.touched.narrow(0, g.state_offset, g.num_rows) if self.touched is not None else None
        momentum = self._group_momentum(g) if self.optimizer == "rowwise_adagrad" else None
        row_lo = getattr(self, f"_g{g.index}_row_off")
        bounds = self._kernel_bounds.get(g.index)
        if bounds is None or bounds[0] is not row_lo:  # cached per group (the buffers may be moved)
            bounds = self._kernel_bounds[g.index] = (row_lo, row_lo + getattr(self, f"_g{g.index}_limit"))
        self._ops.fused_pooled_update(self._group_weight(g), momentum, slot, plan.rows, plan.offsets, scale,
                                      grad, touched, bounds[0], bounds[1], self.lr, self.eps)

    def _rows_alloc(self, group: int) -> Callable[[int, torch.dtype], torch.Tensor]:
        """Buffer for a training lookup's flat rows (kept by the autograd graph until the backward),
        reused across steps once the previous step's graph is gone (``RowGradientScratch.take_unshared``)."""
        dev = self.weights.device
        return lambda n, dt: self._scratch.take_unshared(f"rows{group}", n, dt, dev)

    def _pool(self, groups, plans, batch_size, col_perm, weight_of) -> torch.Tensor:
        outs = []
        for g, plan in zip(groups, plans):
            w = weight_of(g)
            if self._kernel_applies(g, plan):  # straight into the sample-major [B, width], no transpose
                scale = plan.scale.contiguous() if plan.scale is not None else None
                outs.append(self._ops.fused_pooled_forward(w, plan.rows, plan.offsets, scale, batch_size,
                                                           plan.width // g.dim, not self.validate))
                continue
            # embedding_bag is also the fastest one-hot gather on CPU (faster than index_select).
            offsets = plan.offsets
            if offsets is None:
                offsets = self._unit_offsets(plan.rows.numel(), plan.rows.dtype)
            out = F.embedding_bag(plan.rows, w, offsets, mode="sum", per_sample_weights=plan.scale,
                                  include_last_offset=True)
            if plan.key_major > 1:
                out = out.view(plan.key_major, batch_size, g.dim).transpose(0, 1)
            outs.append(out.reshape(batch_size, plan.width))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if col_perm is not None:
            out = out.index_select(1, col_perm)
        return out

    def _unit_offsets(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``arange(n + 1)``: offsets of ``n`` bags of one value each (cached per dtype, grown on demand)."""
        cached = self._arange if dtype == torch.int64 else self._arange32
        if cached is None or cached.numel() < n + 1:
            cached = torch.arange(max(n + 1, 1024), dtype=dtype, device=self.weights.device)
            if dtype == torch.int64:
                self._arange = cached
            else:
                self._arange32 = cached
        return cached[: n + 1]

    def _run_pooled(self, groups, plans, batch_size, col_perm) -> torch.Tensor:
        if self.optimizer is None:
            return self._pool(groups, plans, batch_size, col_perm, self._group_weight)
        if torch.is_grad_enabled():
            anchor = torch.empty(0, device=self.weights.device, requires_grad=True)
            return _FusedPooledLookup.apply(anchor, self, groups, plans, batch_size, col_perm)
        return self._pool(groups, plans, batch_size, col_perm, self._group_weight)

    def _lookup_rows_autograd(self, g: DimGroup, rows: torch.Tensor) -> torch.Tensor:
        if self.optimizer is None:
            return F.embedding(rows, self._group_weight(g))
        if torch.is_grad_enabled():
            anchor = torch.empty(0, device=self.weights.device, requires_grad=True)
            return _FusedRowLookup.apply(anchor, self, g, rows)
        return self._group_weight(g).index_select(0, rows)

    def _fused_update(self, g: DimGroup, rows, grad_src, src_index, scale, values_per_src: int = 0,
                      segments: list[int] | None = None) -> None:
        w = self._group_weight(g)
        if self.optimizer == "sgd" and not self.weight_decay:
            # -lr rides along as the segment sum's per-sample weight: the sum is already the update
            unique_rows, delta = aggregate_row_gradients(rows, grad_src, src_index, scale, num_rows=g.num_rows,
                                                         factor=-self.lr, values_per_src=values_per_src,
                                                         scratch=self._scratch, segments=segments)
            add_rows_(w, unique_rows, delta)
        else:
            unique_rows, grads = aggregate_row_gradients(rows, grad_src, src_index, scale, num_rows=g.num_rows,
                                                         values_per_src=values_per_src, scratch=self._scratch,
                                                         segments=segments)
            if self.optimizer == "sgd":
                sgd_update_(w, unique_rows, grads, self.lr, self.weight_decay)
            else:
                rowwise_adagrad_update_(w, self._group_momentum(g), unique_rows, grads, self.lr, self.eps,
                                        self.weight_decay)
        if self.touched is not None:
            self.touched.narrow(0, g.state_offset, g.num_rows)[unique_rows] = True

    # -- checkpoints: per-table tensors ------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """``{prefix}{table}.weight`` ``[num_rows, dim]`` and, for row-wise Adagrad,
        ``{prefix}{table}.momentum`` ``[num_rows]``: views into the flat storage (clone to detach)."""
        for spec in self.tables:
            w = self.table_weight(spec.name)
            destination[f"{prefix}{spec.name}.weight"] = w if keep_vars else w.detach()
            if self.momentum is not None:
                destination[f"{prefix}{spec.name}.momentum"] = self.table_momentum(spec.name).detach()

    def ebc_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tables under a TorchRec ``EmbeddingBagCollection``'s names, ``{prefix}embedding_bags.<table>.weight``
        (views into the storage, detached; clone to keep them past the next update): what
        ``EmbeddingBagCollection.load_state_dict`` takes. ``load_state_dict`` takes these names too."""
        return ebc_state_dict(self.table_names, self.table_weight, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Our names (``{prefix}{table}.weight`` / ``.momentum``) or an ``EmbeddingBagCollection``'s
        (``{prefix}embedding_bags.{table}.weight``: weights only, the row-wise Adagrad state of every
        loaded table restarts at zero; :mod:`embedscale.embedding.interop`)."""
        expected = {}
        ebc = has_ebc_names(state_dict, prefix)
        for spec in self.tables:
            if ebc:
                expected[ebc_weight_key(spec.name, prefix)] = self.table_weight(spec.name)
                continue
            expected[f"{prefix}{spec.name}.weight"] = self.table_weight(spec.name)
            if self.momentum is not None:
                expected[f"{prefix}{spec.name}.momentum"] = self.table_momentum(spec.name)
        if ebc and self.momentum is not None:
            with torch.no_grad():
                for spec in self.tables:
                    if ebc_weight_key(spec.name, prefix) in state_dict:
                        self.table_momentum(spec.name).zero_()
        with torch.no_grad():
            for key, dst in expected.items():
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                src = state_dict[key]
                if tuple(src.shape) != tuple(dst.shape):
                    error_msgs.append(f"{key}: shape {tuple(src.shape)} in the checkpoint, "
                                      f"{tuple(dst.shape)} in the module")
                    continue
                dst.copy_(src)
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and key not in expected:
                    unexpected_keys.append(key)
