"""The host-memory parameter server: the tables whose form is ``host`` and their fused sparse optimizer.

EL-Rec (SC 2022) section V-A, Fig. 9: embedding tables that do not fit in the trainer's device memory
stay in host memory, where a parameter server (PS) reads the rows of upcoming batches for the trainer
(step 1) and applies the row gradients the trainer sends back (step 3). This module owns the server's
state and its two operations; :mod:`embedscale.pipeline.loop` runs them on a server thread (PyTorch ops
release the GIL, so the thread computes in parallel with the trainer).

* **Storage**: a :class:`embedscale.embedding.local.LocalEmbeddingBags` on the host device: every host
  table in one flat storage, grouped by dim, with its initialisation, row-wise Adagrad state and
  checkpoint views. Only its storage and layout are used; the server never runs its autograd lookup.
* **Read** (:meth:`HostParameterServer.prepare`, :meth:`HostParameterServer.read`): for one batch and
  dim group, the looked-up values in the exact order and bag layout of ``LocalEmbeddingBags`` (one-hot
  sample-major, multi-hot key-major), their unique rows and each value's local id, the plan of the
  backward's per-row gradient sum (one sort, done here so the trainer does not), then the unique rows'
  weights and optimizer state, moved to the trainer's device.
* **Update** (:meth:`HostParameterServer.apply`): the fused optimizers of
  :mod:`embedscale.embedding.optim` on unique rows, in the order the gradients arrive.

:func:`aggregate_row_updates` and :func:`apply_row_updates_` split ``LocalEmbeddingBags``' fused update
into its two halves (sum per unique row over the server's plan; optimizer step), so the trainer can
aggregate and the server (and the trainer's cache) can apply, with the same floating-point operations as
one fused local update.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.local import LocalEmbeddingBags, bag_plan
from embedscale.embedding.optim import add_rows_, row_mean_squares, rowwise_adagrad_multiplier, rowwise_adagrad_update_
from embedscale.errors import ConfigError, InputError
from embedscale.pipeline.queues import GradientBatch, HostRows
from embedscale.pipeline.shared import SharedHostStorage
from embedscale.specs import TableSpec


def aggregate_row_updates(optimizer: str, lr: float, hr: HostRows, grad_bags: torch.Tensor) -> torch.Tensor:
    """First half of the fused update: one ``[dim]`` value per unique row of ``hr`` (``[u, dim]``, row order).

    The segment sum of :func:`embedscale.embedding.optim.aggregate_row_gradients` over the plan the server
    prepared (``hr.src``, ``hr.seg``, ``hr.scale_sorted``): value ``i`` contributes
    ``scale[i] * grad_bags[bag(i)]`` to its row, in the order ``torch.sort`` puts them. For ``sgd`` the value
    is the update itself, ``-lr`` riding along as the per-value factor of the sum (as ``LocalEmbeddingBags``
    does); for ``rowwise_adagrad`` it is the summed gradient.
    """
    n = hr.src.numel()
    if n == 0:
        return grad_bags.new_zeros(0, grad_bags.shape[1])
    factor = -lr if optimizer == "sgd" else 1.0
    w = hr.scale_sorted
    if w is not None:
        w = w.to(grad_bags.dtype)
        if factor != 1.0:
            w = w * factor
    elif factor != 1.0:
        w = torch.full((n,), factor, dtype=grad_bags.dtype, device=grad_bags.device)
    return F.embedding_bag(hr.src, grad_bags.contiguous(), hr.seg, mode="sum", per_sample_weights=w,
                           include_last_offset=True)


def apply_row_updates_(optimizer: str, weight: torch.Tensor, momentum: torch.Tensor | None,
                       rows: torch.Tensor, updates: torch.Tensor, lr: float, eps: float) -> None:
    """Second half of the fused update, in place on ``weight[rows]`` (``rows`` unique): SGD adds the
    aggregated update; row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``) steps with the summed gradient."""
    if optimizer == "sgd":
        add_rows_(weight, rows, updates)
    else:
        rowwise_adagrad_update_(weight, momentum, rows, updates, lr, eps)


_INT32_MAX = 2**31 - 1


def _no_init(spec: TableSpec, weight: torch.Tensor) -> None:  # noqa: ARG001
    """Shared tables: only the first local rank initialises (the others' storage is replaced, never read)."""


def _bag_of_values(offsets, key_major: int, num_bags: int, B: int, n: int, dev) -> torch.Tensor | None:
    """Row of each value in the sample-major ``[num_bags, dim]`` output gradient (as LocalEmbeddingBags);
    ``None`` for one value per bag in sample-major order (value i -> row i)."""
    if offsets is None:
        return None
    lengths = offsets.diff()
    if key_major > 1:  # key-major bag f * B + b is output row b * k + f
        k = key_major
        bags = (torch.arange(B, device=dev) * k + torch.arange(k, device=dev).unsqueeze(1)).reshape(-1)
    else:
        bags = torch.arange(num_bags, device=dev)
    return torch.repeat_interleave(bags, lengths, output_size=n)


def apply_buffer_updates_(optimizer: str, weight: torch.Tensor, momentum: torch.Tensor | None,
                          updates: torch.Tensor, lr: float, eps: float) -> None:
    """:func:`apply_row_updates_` on every row of a contiguous buffer (row ``i`` gets ``updates[i]``), with
    the same elementwise operations (so the same bits) and without the row gathers and scatters."""
    if updates.shape[0] == 0:
        return
    if optimizer == "sgd":
        weight.add_(updates.to(weight.dtype))
    else:
        g = updates.to(torch.float32)
        momentum.add_(row_mean_squares(g))
        multiplier = rowwise_adagrad_multiplier(momentum, lr, eps)
        weight.add_((g * multiplier.unsqueeze(1)).to(weight.dtype))


class _GroupLayout:
    """Per dim group of the server: its pooled features, their row offsets, limits and mean flags."""

    def __init__(self, store: LocalEmbeddingBags, g) -> None:
        self.index = g.index
        self.dim = g.dim
        self.num_rows = g.num_rows
        self.features = [store.feature_names[p] for p in g.pooled]
        table_of = {f: spec for spec in store.tables for f in spec.features}
        self.tables = [table_of[f] for f in self.features]
        dev = store.device
        self.row_off = torch.tensor([store.row_offset(t.name) for t in self.tables], dtype=torch.int64, device=dev)
        self.limit = torch.tensor([t.num_rows for t in self.tables], dtype=torch.int64, device=dev)
        self.mean = torch.tensor([t.pooling == "mean" for t in self.tables], dtype=torch.bool, device=dev)
        self.has_mean = any(t.pooling == "mean" for t in self.tables)


class HostParameterServer:
    """Host tables, their fused sparse optimizer, and the read/update operations of EL-Rec's PS.

    Args:
        tables: the host tables (whatever is given lives here: the tables whose form is ``host``, decided
            by ``plan.forms.decide_forms``, which never makes a TT table host-placed). Pooling ``sum`` or
            ``mean``.
        device: the host device the tables live on (from the run config; default torch's default device).
        dtype: weight dtype.
        optimizer: ``"sgd"`` or ``"rowwise_adagrad"`` (FBGEMM ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD``).
        lr, eps: learning rate and Adagrad epsilon (``lr`` may be changed between steps).
        init, seed: initialisation as ``LocalEmbeddingBags`` (same seed and tables give the same rows).
        validate: check the row ids of every read (one vectorised min/max per group) and name the
            feature, table, sample and value of a bad one.
        share_group: the process group of the ranks of this machine to share one copy of the tables with
            (:class:`~embedscale.pipeline.shared.SharedHostStorage`: the first rank initialises, every rank
            applies its stripe of each update); ``None``: this rank's own copy.
        timeout_s: shared tables: how long a read may wait for the other local ranks' updates.

    Attributes:
        store: the ``LocalEmbeddingBags`` holding the tables (its views are the checkpoint format).
        feature_names: the pooled features the server serves, in table order.
        rows_read, rows_updated, batches_applied: counters.

    Example::

        >>> import torch
        >>> from embedscale.data.batch import JaggedFeatures
        >>> from embedscale.device import HOST
        >>> from embedscale.specs import TableSpec
        >>> ps = HostParameterServer([TableSpec("big", 1000, 4)], optimizer="sgd", lr=0.1, seed=0)
        >>> jf = JaggedFeatures.from_dense(["big"], torch.tensor([[7], [3], [7]]))
        >>> hr = ps.read(ps.prepare(jf), HOST)[0]
        >>> hr.rows.tolist(), hr.ids.tolist(), tuple(hr.weights.shape)
        ([3, 7], [1, 0, 1], (2, 4))
    """

    def __init__(self, tables: list[TableSpec], *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, optimizer: str = "rowwise_adagrad", lr: float = 0.01,
                 eps: float = 1e-8, init: str | Callable[[TableSpec, torch.Tensor], None] = "uniform",
                 seed: int | None = None, validate: bool = True, share_group=None,
                 timeout_s: float = 300.0) -> None:
        if not tables:
            raise ConfigError("HostParameterServer: no host tables")
        if optimizer is None:
            raise ConfigError("HostParameterServer: the parameter server needs a fused optimizer "
                              "('sgd' or 'rowwise_adagrad'), got None")
        for spec in tables:
            if spec.pooling == "none":
                raise ConfigError(f"table {spec.name!r}: pooling 'none' (sequences) is not served from host "
                                  "memory; use placement 'device'")
        leader = share_group is None or dist.get_rank(share_group) == 0
        self.store = LocalEmbeddingBags(tables, device=device, dtype=dtype, optimizer=optimizer, lr=lr, eps=eps,
                                        init=init if leader else _no_init, seed=seed, validate=False)
        self.shared: SharedHostStorage | None = None
        if share_group is not None:  # one copy per machine: the first local rank's tables, mapped by all
            self.shared = SharedHostStorage(self.store.weights, self.store.momentum, share_group,
                                            timeout_s=timeout_s)
            self.store.weights = self.shared.weights
            if self.store.momentum is not None:
                self.store.momentum = self.shared.momentum
        self.tables = self.store.tables
        self.optimizer = optimizer
        self.eps = float(eps)
        self.dtype = dtype
        self.validate = validate
        self.feature_names = list(self.store.feature_names)
        self.layouts = [_GroupLayout(self.store, g) for g in self.store.groups]
        self.rows_read = 0
        self.rows_updated = 0
        self.batches_applied = 0

    # -- attributes --------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.store.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.store.lr = float(value)

    @property
    def device(self) -> torch.device:
        return self.store.device

    @property
    def dims(self) -> list[int]:
        return [lay.dim for lay in self.layouts]

    def group_weight(self, group: int) -> torch.Tensor:
        """``[group_rows, dim]`` view of a dim group's storage (flat rows)."""
        g = self.store.groups[group]
        return self.store.weights.narrow(0, g.elem_offset, g.num_rows * g.dim).view(g.num_rows, g.dim)

    def group_momentum(self, group: int) -> torch.Tensor | None:
        """``[group_rows]`` view of a dim group's row-wise Adagrad state, or ``None`` for SGD."""
        if self.store.momentum is None:
            return None
        g = self.store.groups[group]
        return self.store.momentum.narrow(0, g.state_offset, g.num_rows)

    # -- read ----------------------------------------------------------------------------------------
    def prepare(self, features: JaggedFeatures) -> list[HostRows]:
        """The layout of one batch's host lookups: per dim group, unique rows and each value's local id.

        ``features`` must hold every host feature (other keys are ignored). No weights are read yet.
        """
        keys = features.keys
        pos = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self.feature_names if f not in pos]
        if missing:
            raise InputError(f"got features {keys}; the host tables need {self.feature_names}: missing {missing}")
        B = features.batch_size
        out = []
        for lay in self.layouts:
            sub = features.permute([pos[f] for f in lay.features])  # per-key split computed once per batch
            out.append(self._group_rows(lay, sub.values, sub.lengths.view(len(lay.features), B), sub.weights, B))
        return out

    def _group_rows(self, lay: _GroupLayout, values, lengths, weights, B: int) -> HostRows:
        """The group's rows, bags and scales as the fused local lookup lays them out (``local.bag_plan``:
        the same value order, so the same sums), then its unique rows."""
        k = lengths.shape[0]
        n = values.numel()
        dev = values.device
        plan = bag_plan(values, lengths, weights, B, lay.row_off.to(dev), lay.limit.to(dev),
                        lay.mean.to(dev) if lay.has_mean else None, lay.dim, dtype=self.dtype, row_dtype=torch.int64,
                        offsets_dtype=torch.int32, validate=self.validate, names=lay.features,
                        on_bad=lambda: self._raise_bad_ids(lay, values, lengths))
        flat, offsets, scale, key_major = plan.rows, plan.offsets, plan.scale, plan.key_major
        # Unique rows and the backward's segment-sum plan from one sort of the rows, with the key dtype
        # LocalEmbeddingBags sorts (int32 when the group fits): local ids are a monotone relabelling of the
        # rows, so the trainer's sums see the values in the order a local fused update would.
        keys = flat.to(torch.int32) if lay.num_rows <= _INT32_MAX else flat
        sorted_keys, perm = torch.sort(keys, stable=True)
        uniq, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
        u = uniq.numel()
        seg = torch.zeros(u + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=seg[1:])
        ids = torch.empty(n, dtype=torch.int32, device=dev)
        ids.index_copy_(0, perm, torch.repeat_interleave(torch.arange(u, dtype=torch.int32, device=dev), counts,
                                                         output_size=n))
        bag = _bag_of_values(offsets, key_major, k * B, B, n, dev)
        src = perm if bag is None else bag.index_select(0, perm)
        scale_sorted = scale.index_select(0, perm) if scale is not None else None
        return HostRows(lay.index, lay.dim, uniq.to(torch.int64), ids, offsets, scale, k * B, k * lay.dim,
                        key_major, src, seg, scale_sorted)

    def _raise_bad_ids(self, lay: _GroupLayout, values: torch.Tensor, lengths: torch.Tensor) -> None:
        B = lengths.shape[1]
        for name, spec, v, lens in zip(lay.features, lay.tables, torch.split(values, lengths.sum(1).tolist()),
                                       lengths):
            lim = spec.num_rows
            bad = ((v < 0) | (v >= lim)).nonzero()
            if bad.numel():
                i = int(bad[0])
                sample = int(torch.searchsorted(torch.cumsum(lens, 0), i, right=True))
                value = int(v[i])
                kind = "negative row id" if value < 0 else "row id"
                raise InputError(f"feature {name!r} (host table {spec.name!r}, {lim} rows): {kind} {value} at "
                                 f"sample {sample} of {B} is outside [0, {lim})")
        raise InputError(f"features {lay.features}: row id outside its table")  # pragma: no cover

    def sync(self) -> None:
        """Shared tables: wait until every local rank has applied as many gradient batches as this one."""
        if self.shared is not None:
            self.shared.wait_all_applied()

    def read(self, host: list[HostRows], device: torch.device) -> list[HostRows]:
        """Fill every group's ``weights`` (and ``momentum``) with a copy of its rows, moved to ``device``
        (shared tables: once every local rank has applied the gradient batches this one has)."""
        self.sync()
        out = []
        for hr in host:
            w = self.group_weight(hr.group).index_select(0, hr.rows)
            m = self.group_momentum(hr.group)
            hr.weights = w
            hr.momentum = m.index_select(0, hr.rows) if m is not None else None
            self.rows_read += hr.rows.numel()
            out.append(hr.to(device) if device != self.device else hr)
        return out

    # -- update --------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, grads: GradientBatch) -> None:
        """Apply one batch's aggregated row gradients (the fused optimizer, at the rate the trainer used).
        Shared tables: only this rank's stripe of the rows (the others apply theirs)."""
        for g, (rows, upd) in enumerate(zip(grads.rows, grads.updates)):
            if rows.numel() == 0:
                continue
            rows = rows.to(self.device)
            upd = upd.to(self.device)
            if self.shared is not None:
                mine = self.shared.stripe(rows)
                rows, upd = rows[mine], upd[mine]
            apply_row_updates_(self.optimizer, self.group_weight(g), self.group_momentum(g), rows, upd,
                               grads.lr, self.eps)
            self.rows_updated += rows.numel()
        self.batches_applied += 1
        if self.shared is not None:
            self.shared.mark_applied()

    @property
    def memory_bytes(self) -> int:
        return self.store.memory_bytes
