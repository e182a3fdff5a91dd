"""Uncompressed and tensor-train tables behind one embedding interface.

``MixedEmbedding(tables, tt={table: rank})`` keeps every table ``tt`` does not name in one
:class:`~embedscale.embedding.local.LocalEmbeddingBags` (flat storage, fused lookup, fused sparse
optimizer) and every table it names in its own :class:`~embedscale.embedding.tt.TTEmbeddingBag` of that
rank (EL-Rec's Eff-TT, cores updated in backward). ``tt`` comes from the tables' forms (the TT ones'
``TableForm.tt_rank``, decided by ``plan.forms.decide_forms`` or recorded in the plan): a ``TableSpec``
holds only facts. It has
the ``LocalEmbeddingBags`` interface the models use: ``feature_names`` (pooled features in table order,
features of a table in their order), ``feature_dims``, ``forward(JaggedFeatures) -> [B, sum of dims]``
in ``feature_names`` order, updates of both kinds applied during ``loss.backward()``, and a
``state_dict`` (``local.<table>.weight``/``.momentum``, ``tt.<table>.core<k>``/``.state<k>``,
``remap.<table>``). So a model config that says ``compression: tt`` on a table runs through
``build_model(cfg, tables, num_dense, embedding=MixedEmbedding(tables, tt=..., ...))``; the model's embedding is
built by :func:`embedscale.embedding.build.build_embedding` (a plain ``LocalEmbeddingBags`` when no table's
form is TT).

A TT table read by several features looks all of them up in one call (``k * B`` bags), so their
distinct rows share one reuse buffer.

Optimizers: ``optimizer`` (``sgd``, ``rowwise_adagrad`` or ``None``) drives the uncompressed tables;
the TT tables use ``tt_optimizer`` (default: ``sgd`` with ``sgd``, element-wise ``adagrad`` on the
cores with ``rowwise_adagrad`` (TT-Rec's core optimizer), ``None`` with ``None``) at ``tt_lr``
(default ``lr``).

Index reordering (EL-Rec section IV): given a :class:`~embedscale.reorder.Reordering`, the maps of the
tables it covers (matched by feature names and row count) become persistent buffers (so they are saved
with the model) and every lookup renames its ids first. Do not also apply the same reordering in the
data path. Checkpoints keep the maps beside the TT cores (:meth:`MixedEmbedding.reorder_state`,
:meth:`MixedEmbedding.load_reorder_state`): the cores were trained under them.

Several ranks (EL-Rec section VI-B): the TT tables are replicas (see
:mod:`embedscale.embedding.compression`); set ``grad_sync`` to sum their core gradients across ranks (all TT
tables' in one call per step, through one :class:`~embedscale.embedding.tt.GradSyncBucket`), and
pass the module that executes the plan for the uncompressed tables as ``local`` (a
:class:`~embedscale.embedding.sharded.ShardedEmbedding`): its lookups go across ranks, the TT lookups stay
on the rank, and the output is the same ``[B, sum of dims]`` in ``feature_names`` order.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn

from embedscale.data.batch import JaggedFeatures, same_batch
from embedscale.device import HOST
from embedscale.embedding.hybrid import HybridTTEmbeddingBag
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.input_pipeline import InputPipeline
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.embedding.tt import GradSyncBucket, TTEmbeddingBag
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.specs import TableSpec, feature_to_table

_TT_DEFAULT = {"sgd": "sgd", "rowwise_adagrad": "adagrad", None: None}


def _hot_init(t: TableSpec, hot: int, reordering, seed: int | None, index: int) -> torch.Tensor | None:
    """The initial values of a row-group table's ``hot`` exact rows: the rows the reordering puts first, with the
    values ``embedding.init.uniform_rows`` gives those rows in any other form (placement-independent)."""
    table = reordering.feature_table.get(t.features[0]) if reordering is not None else None
    if table is None:
        raise ConfigError(f"table {t.name!r}: {hot} hot rows kept exact need an index reordering of the table (its "
                          "first ids are the hot rows, EL-Rec IV)")
    m = np.asarray(reordering.map(table))
    if m.size != t.num_rows:
        raise ConfigError(f"table {t.name!r}: the reordering has {m.size} rows, the table {t.num_rows}")
    if seed is None:
        return None
    old = np.empty(hot, dtype=np.int64)
    first = np.flatnonzero(m < hot)  # the rows renamed to 0 .. hot-1
    old[m[first]] = first
    return torch.from_numpy(uniform_rows(seed, index, old, t.dim, t.num_rows))


class MixedEmbedding(nn.Module):
    """Uncompressed tables in a ``LocalEmbeddingBags``, the tables ``tt`` names as ``TTEmbeddingBag`` s.

    Args:
        tables: the tables; pooled features in table order are the output columns.
        tt: the TT tables and their ranks, ``{table name: tt_rank}`` (the TT forms); the others are
            uncompressed.
        device, dtype: where and how the uncompressed storage lives (TT cores are float32 on ``device``).
        optimizer, lr, eps: the fused optimizer of the uncompressed tables (``LocalEmbeddingBags``).
        init: init of the uncompressed tables (``"uniform"`` or a callable, as ``LocalEmbeddingBags``).
        seed: seeds both initialisations (TT table ``i`` of the list uses ``seed + 1 + init_index[i]``).
        validate: check ids (both kinds) and offsets.
        tt_optimizer: optimizer of the TT cores (default from ``optimizer``, see the module docstring).
        tt_lr: learning rate of the TT cores (default ``lr``).
        tt_init_std: std of the reconstructed TT rows at init (default ``1/sqrt(3 * num_rows)`` per table,
            the spread of DLRM's uniform rows).
        tt_options: extra ``TTEmbeddingBag`` keyword arguments (``num_cores``, ``grouped``, ...).
        reordering: a ``Reordering`` whose maps are applied to the ids of the tables it covers.
        hot_rows: row groups, ``{table: H}`` for TT tables whose ``H`` hottest rows stay exact
            (:class:`~embedscale.embedding.hybrid.HybridTTEmbeddingBag`; the reordering must cover the table:
            its first ``H`` ids are those rows). The hot rows take ``optimizer`` and ``lr``.
        grad_sync: sums a list of dense tensors across ranks in place (data-parallel replicas); the TT tables
            share it through one ``GradSyncBucket`` (``grad_sync_bucket``): one call per step for all of them.
        init_index: each table's position among the model's tables, when ``tables`` is a subset of them
            (beside host-placed tables): TT seeds follow it, so the subset starts as the whole model would.
        local: a module that already holds the uncompressed tables (e.g. a ``ShardedEmbedding`` executing a
            plan) instead of a ``LocalEmbeddingBags`` built here. It must have ``feature_names`` (the pooled
            features of the uncompressed tables, in table order) and return ``[B, sum of their dims]`` for a
            ``JaggedFeatures`` of those features in that order; ``optimizer``, ``lr``, ``init`` ... then
            only concern the TT tables.

    Attributes:
        local: the ``LocalEmbeddingBags`` of the uncompressed tables, or ``None``.
        tt: ``ModuleDict`` table name -> ``TTEmbeddingBag``.
        feature_names, feature_dims, tables, table_names: as ``LocalEmbeddingBags``.

    Example::

        >>> import torch
        >>> from embedscale.specs import TableSpec
        >>> from embedscale.data.batch import JaggedFeatures
        >>> tables = [TableSpec("small", 100, 8), TableSpec("big", 2_000_000, 8)]
        >>> emb = MixedEmbedding(tables, tt={"big": 8}, optimizer="rowwise_adagrad", lr=0.1, seed=0)
        >>> out = emb(JaggedFeatures.from_dense(["small", "big"], torch.tensor([[1, 123_456], [2, 7]])))
        >>> out.shape
        torch.Size([2, 16])
        >>> out.sum().backward()      # both kinds updated in place
    """

    def __init__(self, tables: list[TableSpec], *, tt: Mapping[str, int | Sequence[int]],
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, optimizer: str | None = "sgd", lr: float = 0.01,
                 eps: float = 1e-8, init: str | Callable[[TableSpec, torch.Tensor], None] = "uniform",
                 seed: int | None = None, validate: bool = True, tt_optimizer: str | None = "default",
                 tt_lr: float | None = None, tt_init_std: float | None = None, tt_options: dict | None = None,
                 reordering=None, grad_sync: Callable[[list[torch.Tensor]], None] | None = None,
                 local: nn.Module | None = None, init_index: list[int] | None = None,
                 hot_rows: Mapping[str, int] | None = None) -> None:
        super().__init__()
        plain, compressed, init_index = self._check_tables(tables, tt, init_index)
        self.optimizer = optimizer
        self.validate = validate
        self.tt_ranks = {t.name: tt[t.name] for t in compressed}
        if local is not None:
            expected = [f for t in plain if t.pooling != "none" for f in t.features]
            got = list(getattr(local, "feature_names", []))
            if got != expected:
                raise ConfigError(f"MixedEmbedding: the given local module serves features {got}, the uncompressed "
                                  f"tables have {expected}")
            self.local = local
        else:
            self.local = (LocalEmbeddingBags(plain, device=device, dtype=dtype, optimizer=optimizer, lr=lr, eps=eps,
                                             init=init, seed=seed, validate=validate) if plain else None)
        if tt_optimizer == "default":
            if optimizer not in _TT_DEFAULT:
                raise ConfigError(f"MixedEmbedding: optimizer {optimizer!r} is not one of sgd, rowwise_adagrad or None")
            tt_optimizer = _TT_DEFAULT[optimizer]
        hot_rows = {n: int(h) for n, h in (hot_rows or {}).items() if h}
        bad = sorted(set(hot_rows) - set(tt))
        if bad:
            raise ConfigError(f"MixedEmbedding: hot rows given for tables {bad} that are not TT tables")
        self.hot_rows = hot_rows
        self.tt = nn.ModuleDict()
        for t in compressed:
            tseed = None if seed is None else seed + 1 + init_index[self.tables.index(t)]
            self.tt[t.name] = self._tt_table(t, tt[t.name], tseed, init_index[self.tables.index(t)], reordering,
                                             dict(optimizer=optimizer, lr=lr, eps=eps, tt_optimizer=tt_optimizer,
                                                  tt_lr=lr if tt_lr is None else tt_lr, init_std=tt_init_std,
                                                  seed=seed, device=device, validate=validate,
                                                  options=dict(tt_options or {})))
        # one sum across ranks per step for all TT tables (tt.GradSyncBucket), not one per table
        self.grad_sync_bucket = (GradSyncBucket(grad_sync, [t.name for t in compressed])
                                 if grad_sync is not None and compressed else None)
        for m in self.tt.values():
            m.grad_sync = self.grad_sync_bucket
        self._feature_columns()
        # the TT tables' inputs of upcoming batches (``prefetch``), on a pipeline of its own until a run attaches its own
        self.input_lane = InputPipeline().lane("tt", 2)
        self.prefetched_tt_steps = 0  # lookups that took their TT inputs from prefetch
        self.remap = nn.Module()
        self._remapped: dict[str, str] = {}  # feature -> table whose map renames it
        if reordering is not None:
            self._install_reordering(reordering)

    def _check_tables(self, tables: list[TableSpec], tt: Mapping, init_index: list[int] | None):
        """Keep ``tables`` (after checking their names, features and the TT tables ``tt`` names); return the
        uncompressed and the TT tables and every table's init index."""
        if not tables:
            raise ConfigError("MixedEmbedding: no tables")
        feature_to_table(tables)
        self.tables = list(tables)
        self.table_names = [t.name for t in tables]
        self._spec = {t.name: t for t in tables}
        for t in tables:
            if "." in t.name or not t.name:
                raise ConfigError(f"MixedEmbedding: table name {t.name!r} cannot name a submodule (no '.', not empty)")
        unknown = sorted(set(tt) - set(self.table_names))
        if unknown:
            raise ConfigError(f"MixedEmbedding: TT ranks given for tables {unknown} that are not among the tables "
                              f"{self.table_names}")
        init_index = list(range(len(tables))) if init_index is None else list(init_index)
        if len(init_index) != len(tables):
            raise ConfigError(f"MixedEmbedding: {len(init_index)} init indices for {len(tables)} tables")
        for t in tables:
            if t.name in tt and t.pooling == "none":
                raise ConfigError(f"table {t.name!r}: TT tables pool (sum or mean), pooling 'none' is not supported")
        return [t for t in tables if t.name not in tt], [t for t in tables if t.name in tt], init_index

    def _tt_table(self, t: TableSpec, rank, tseed: int | None, index: int, reordering, o: dict) -> nn.Module:
        """Table ``t``'s TT module of TT rank ``rank``: a ``TTEmbeddingBag``, or with hot rows a
        ``HybridTTEmbeddingBag`` (row groups: the hot rows exact, the rest TT, ``embedding.hybrid``)."""
        if t.name in self.hot_rows:
            hot = self.hot_rows[t.name]
            return HybridTTEmbeddingBag(t.num_rows, t.dim, rank, hot_rows=hot, mode=t.pooling,
                                        include_last_offset=True, optimizer=o["optimizer"], lr=o["lr"], eps=o["eps"],
                                        hot_init=_hot_init(t, hot, reordering, o["seed"], index),
                                        tt_optimizer=o["tt_optimizer"], tt_lr=o["tt_lr"], init_std=o["init_std"],
                                        seed=tseed, device=o["device"], name=t.name, validate=o["validate"],
                                        **o["options"])
        return TTEmbeddingBag.from_spec(t, rank, include_last_offset=True, optimizer=o["tt_optimizer"],
                                        lr=o["tt_lr"], eps=o["eps"], init_std=o["init_std"], seed=tseed,
                                        device=o["device"], validate=o["validate"], **o["options"])

    def _feature_columns(self) -> None:
        """The output columns: pooled features in table order (``feature_names``, ``feature_dims``), each feature's
        table, the unpooled features ``local`` serves and the widths of ``local``'s output."""
        self.feature_names: list[str] = []
        self.feature_dims: list[int] = []
        self._feature_table: dict[str, TableSpec] = {}
        for t in self.tables:
            for f in t.features:
                self._feature_table[f] = t
                if t.pooling != "none":
                    self.feature_names.append(f)
                    self.feature_dims.append(t.dim)
        self.sequence_feature_names = list(getattr(self.local, "sequence_feature_names", []))
        self._local_dims = [self._feature_table[f].dim for f in self.local.feature_names] if self.local is not None \
            else []

    # -- reordering --------------------------------------------------------------------------------
    def _install_reordering(self, reordering) -> None:
        device = self.device
        for t in self.tables:
            covered = [reordering.feature_table.get(f) for f in t.features]
            if all(c is None for c in covered):
                continue
            if len(set(covered)) != 1 or None in covered:
                raise ConfigError(f"MixedEmbedding: the reordering covers only some features of table {t.name!r} "
                                  f"({dict(zip(t.features, covered))})")
            m = reordering.map(covered[0])
            if m.size != t.num_rows:
                raise ConfigError(f"MixedEmbedding: the reordering of table {covered[0]!r} has {m.size} rows, "
                                  f"table {t.name!r} {t.num_rows}")
            self.remap.register_buffer(t.name, torch.as_tensor(m, dtype=torch.int64).to(device))
            for f in t.features:
                self._remapped[f] = t.name

    def reorder_state(self) -> dict[str, torch.Tensor]:
        """``{table: map}`` of the reordered tables (``map[old] = new``, EL-Rec IV): a checkpoint keeps it beside
        the TT cores, which were trained under it."""
        return {t: getattr(self.remap, t).detach().to(HOST) for t in sorted(set(self._remapped.values()))}

    def load_reorder_state(self, maps: Mapping[str, torch.Tensor] | None, where) -> None:
        """Rename ids as a checkpoint's :meth:`reorder_state` says. The checkpoint's TT cores (and rows) were
        trained under its maps, so they replace the model's: a table it reorders is renamed by its map, one it
        does not is not renamed (a checkpoint written without reordering). A map of a table this model does not
        have, of another size, or not a bijection is a ``FormatError`` naming ``where`` and the table."""
        maps = dict(maps or {})
        lost = sorted(set(self.hot_rows) - set(maps))
        if lost:
            raise FormatError(f"{where}: tables {lost} keep their hot rows exact and need the index reordering that "
                              "says which rows those are; the checkpoint has none for them")
        for name, m in maps.items():
            t = self._spec.get(name)
            if t is None:
                raise FormatError(f"{where}: index reordering of table {name!r}, which this model does not have "
                                  f"(its tables: {self.table_names})")
            m = torch.as_tensor(m)
            if m.shape != (t.num_rows,) or m.dtype not in (torch.int32, torch.int64):
                raise FormatError(f"{where}: the reordering of table {name!r} has shape {tuple(m.shape)} and dtype "
                                  f"{m.dtype}, the table {t.num_rows} rows (an integer map)")
            if m.numel() and (int(m.min()) < 0 or int(m.max()) >= t.num_rows
                              or not bool(torch.bincount(m.long(), minlength=t.num_rows).eq(1).all())):
                raise FormatError(f"{where}: the reordering of table {name!r} is not a bijection of its rows")
        for name in sorted(set(self._remapped.values()) - set(maps)):
            delattr(self.remap, name)
            for f in self._spec[name].features:
                self._remapped.pop(f, None)
        device = self.device
        for name, m in maps.items():
            buf = torch.as_tensor(m, dtype=torch.int64).to(device)
            if name in self._remapped.values():
                getattr(self.remap, name).copy_(buf)
            else:
                self.remap.register_buffer(name, buf)
                for f in self._spec[name].features:
                    self._remapped[f] = name

    def _rename(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        table = self._remapped[feature]
        m = getattr(self.remap, table)
        if self.validate and ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= m.numel():
                bad = int(lo) if int(lo) < 0 else int(hi)
                raise InputError(f"feature {feature!r} (table {table!r}, {m.numel()} rows): row id {bad} is "
                                 f"outside [0, {m.numel()})")
        return m.index_select(0, ids)

    # -- interface -----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        if self.local is not None:
            dev = getattr(self.local, "device", None)
            return dev if dev is not None else next(self.local.buffers()).device
        return next(iter(self.tt.values())).device

    @property
    def output_dim(self) -> int:
        return sum(self.feature_dims)

    @property
    def memory_bytes(self) -> int:
        """Bytes of weights, TT cores and optimizer state."""
        n = 0
        if self.local is not None:
            n = getattr(self.local, "memory_bytes", None)
            if n is None:  # a module without the property (sharded): its storage on this rank
                n = sum(b.numel() * b.element_size() for b in self.local.buffers())
        return n + sum(m.memory_bytes for m in self.tt.values())

    @property
    def lr(self) -> float:
        return self.local.lr if self.local is not None else next(iter(self.tt.values())).lr

    def extra_repr(self) -> str:
        return (f"tables={len(self.tables)} ({len(self.tt)} TT), features={len(self.feature_names)}, "
                f"reordered={sorted(set(self._remapped.values()))}")

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        """Pooled embeddings ``[B, sum(feature_dims)]``, columns in ``feature_names`` order."""
        keys = features.keys
        pos: dict[str, int] = {}
        for i, k in enumerate(keys):
            if k not in self._feature_table:
                raise InputError(f"feature {k!r} is not read by any table here; known features: "
                                 f"{self.feature_names + self.sequence_feature_names}")
            pos[k] = i
        missing = [f for f in self.feature_names if f not in pos]
        if missing:
            raise InputError(f"got {len(keys)} features {keys}, expected the {len(self.feature_names)} pooled "
                             f"features {self.feature_names}: missing {missing}")
        B = features.batch_size
        if not self.tt and not self._remapped and self.local is not None:
            return self.local(features)
        ahead = self._take_ahead(features) if len(self.input_lane) else None
        if ahead is None or any(f in self._remapped and self._feature_table[f].name not in self.tt for f in keys):
            features = self._renamed(features, pos)  # (with the TT inputs prefetched: only for a local feature's map)
        cols: dict[str, torch.Tensor] = {}
        if self.local is not None:
            out = self.local(self._local_features(features))
            for f, o in zip(self.local.feature_names, torch.split(out, self._local_dims, dim=1)):
                cols[f] = o
        tt_inputs = ahead if ahead is not None else self._tt_inputs(features, renamed=True)
        for name, m in self.tt.items():
            t = self._spec[name]
            sub, offsets, plan = tt_inputs[name]
            k = len(t.features)
            out = m(sub.values, offsets, sub.weights, reuse_plan=plan)  # [k * B, dim], key-major bags
            out = out.view(k, B, t.dim)
            for j, f in enumerate(t.features):
                cols[f] = out[j]
        return torch.cat([cols[f] for f in self.feature_names], dim=1)

    def _renamed(self, features: JaggedFeatures, pos: dict[str, int] | None = None) -> JaggedFeatures:
        """``features`` with the reordered features' ids renamed (EL-Rec IV; the batch itself if none is)."""
        if not self._remapped:
            return features
        pos = pos if pos is not None else {k: i for i, k in enumerate(features.keys)}
        values = list(torch.split(features.values, features.length_per_key_list()))
        for f, i in pos.items():
            if f in self._remapped:
                values[i] = self._rename(f, values[i])
        return JaggedFeatures(features.keys, torch.cat(values), features.lengths, features.weights)

    def _local_features(self, features: JaggedFeatures) -> JaggedFeatures:
        """What ``local`` looks up: its pooled features in its own order (a sharded module takes no other), then
        any unpooled ones that are not a TT table's."""
        pooled = set(self.local.feature_names)
        lk = list(self.local.feature_names) + [k for k in features.keys if k not in pooled
                                               and self._feature_table[k].name not in self.tt]
        return features.select(lk)

    def _tt_inputs(self, features: JaggedFeatures, renamed: bool, plans: bool = False) -> dict:
        """Per TT table: its features' key-major bags (``JaggedFeatures``), their include-last offsets, and, with
        ``plans``, the table's reuse plan of those ids (else ``None``: the lookup builds it)."""
        if not renamed:
            features = self._renamed(features)
        B = features.batch_size
        out = {}
        for name, m in self.tt.items():
            sub = features.select(self._spec[name].features)  # key-major bags of the table's features
            offsets = sub.lengths.new_zeros(len(self._spec[name].features) * B + 1)
            torch.cumsum(sub.lengths, 0, out=offsets[1:])
            plan = m.reuse_plan(sub.values) if plans and sub.values.numel() else None
            out[name] = (sub, offsets, plan)
        return out

    def _take_ahead(self, features: JaggedFeatures) -> dict | None:
        """The TT inputs :meth:`prefetch` built for ``features`` (the head of the queue), or ``None``."""
        if not same_batch(self.input_lane.head().features, features):
            return None  # another batch (an evaluation's): the queue stays for the training step
        self.prefetched_tt_steps += 1
        return self.input_lane.pop().value

    def prefetch(self, features: JaggedFeatures) -> None:
        """Hand an upcoming training batch to the input pipeline, before the step before its own (the run loop's
        ``prefetch_batch``): to the local module's (``ShardedEmbedding.prefetch``, OPER 5.1: the sharded rows'
        ids converted and their requests sent during the step before), the same selection of the batch that
        :meth:`forward` will give it; and, on a worker thread, the TT tables' inputs: the ids renamed by the
        reordering, selected per table, and each table's reuse plan (EL-Rec III-A's sorts), which the lookup of
        that batch then takes instead of building them on the step's path. Same results either way."""
        if isinstance(self.local, ShardedEmbedding):
            sel = self._local_features(features)  # selecting, then renaming, as forward renames then selects
            self.local.prefetch(self._renamed(sel) if any(k in self._remapped for k in sel.keys) else sel)
        if not self.tt:
            return
        self.input_lane.push(features, self._tt_inputs_ahead)  # (at most 2: one never consumed goes)

    def _tt_inputs_ahead(self, features: JaggedFeatures) -> dict:
        return self._tt_inputs(features, False, True)

    def attach_input_pipeline(self, pipeline: InputPipeline) -> None:
        """Prefetch on ``pipeline`` (the run's) from now on, the sharded module's batches included."""
        self.input_lane.leave()
        self.input_lane = pipeline.lane("tt", 2)
        if isinstance(self.local, ShardedEmbedding):
            self.local.attach_input_pipeline(pipeline)

    @property
    def pending_batches(self) -> int:
        """Batches whose TT inputs were prefetched and not looked up yet."""
        return len(self.input_lane)

    def forward_dict(self, features: JaggedFeatures) -> dict[str, torch.Tensor]:
        """``{feature: [B, dim]}`` column views of :meth:`forward`."""
        out = self.forward(features)
        return dict(zip(self.feature_names, torch.split(out, self.feature_dims, dim=1)))
