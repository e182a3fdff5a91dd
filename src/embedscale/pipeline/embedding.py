"""An embedding module whose host-placed tables live in a host parameter server (EL-Rec section V).

:class:`PipelinedEmbedding` presents every table of a model behind the interface the models expect
(``feature_names``; ``forward(JaggedFeatures) -> [B, sum of dims]`` in ``feature_names`` order) while its
tables live in two places:

* **device-side modules**: any embedding modules with ``feature_names`` and that ``forward``, each fed
  only its own features (a :class:`~embedscale.embedding.local.LocalEmbeddingBags` for plain tables; a TT
  table or a sharded embedding plugs in the same way). They train themselves in backward, as usual.
* **host tables** in a :class:`~embedscale.pipeline.server.HostParameterServer`. For each batch the
  trainer pools from a small local buffer: the batch's unique rows, read by the server (ahead of time when
  pipelined, EL-Rec Fig. 9 step 1), patched from the life-cycle cache (V-B, Fig. 10), and looked up by
  local ids. Backward sums the gradient per unique row (as the fused local optimizer does), updates the
  local copies and puts them in the cache, and sends the per-row gradients to the server (step 3).

Exactness: pooling and the per-row gradient sums use the value order and bag layout of
``LocalEmbeddingBags`` with ids remapped monotonically to local ids (a sort sees the same order), and the
optimizer step is the same function on the same values; so training equals training the host tables in a
``LocalEmbeddingBags`` of their own, bit for bit, at any pipeline depth.

Several ranks (data parallelism, one server per rank holding a replica of the host tables): every rank
gathers the others' per-row gradients and pre-update rows of the step (one variable-size all-gather per
dim group), sums them per row in rank order, and applies the same update to its cache and its server, so
all replicas stay identical and every rank's cache covers rows that only another rank touched.

Outside a pipeline (evaluation, or training driven by the plain :class:`~embedscale.train.trainer.Trainer`)
a lookup reads the server synchronously (patched from the cache if a pipeline is running) and backward
updates the server directly: that is sequential training. Designed for, untested on GPU: buffers follow
``device``, the server stays on ``host_device``.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import ConfigError, InputError
from embedscale.pipeline.cache import LifeCycleCache
from embedscale.pipeline.queues import GradientBatch, HostRows, PipelineError, PrefetchedBatch
from embedscale.pipeline.server import HostParameterServer, aggregate_row_updates, apply_buffer_updates_
from embedscale.plan.forms import TableForm
from embedscale.specs import TableSpec


def select_features(features: JaggedFeatures, keys: Sequence[str]) -> JaggedFeatures:
    """The features ``keys`` (in that order) of ``features`` (``JaggedFeatures.select``): the input itself when
    it already is exactly that."""
    keys = list(keys)
    missing = [k for k in keys if k not in features.keys]
    if missing:
        raise InputError(f"got features {features.keys}: missing {missing}")
    return features.select(keys)


class _HostLookup(torch.autograd.Function):
    """Pooled lookup of the host tables from the batch's local buffer; backward sends the row gradients."""

    @staticmethod
    def forward(ctx, anchor, module, pre):  # noqa: ARG004
        ctx.module, ctx.pre = module, pre
        return module._pool_host(pre)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.no_grad():
            ctx.module._host_backward(ctx.pre, grad_out)
        ctx.pre = None
        return None, None, None


class PipelinedEmbedding(nn.Module):
    """Device-side embedding modules plus host tables served by a parameter server, as one module.

    Args:
        tables: every pooled table of the model; ``feature_names`` follows their order. Each feature must be
            produced by exactly one device module or by the server.
        server: the :class:`HostParameterServer` holding the host tables (``None``: no host tables).
        device_modules: embedding modules on the trainer's device (``feature_names`` and
            ``forward(JaggedFeatures) -> [B, sum of dims]``), each fed only its own features.
        device: the trainer's device (local buffers, cache); default the first device module's, else torch's
            default device.
        process_group: data-parallel ranks sharing the host tables' updates (``None``: the default group
            when torch.distributed is initialised with more than one rank, else single rank).

    Attributes:
        feature_names, feature_dims: pooled features in output order and their dims.
        cache: the :class:`LifeCycleCache` (EL-Rec V-B).
        host_feature_names: the features the server produces.

    Example::

        >>> import torch
        >>> from embedscale.data.batch import JaggedFeatures
        >>> from embedscale.specs import TableSpec
        >>> from embedscale.plan.forms import TableForm
        >>> tables = [TableSpec("small", 10, 4), TableSpec("big", 1000, 4)]
        >>> emb = PipelinedEmbedding.from_tables(tables, {"big": TableForm("host")}, optimizer="sgd", lr=0.1, seed=0)
        >>> jf = JaggedFeatures.from_dense(["small", "big"], torch.tensor([[1, 7], [2, 3]]))
        >>> out = emb(jf)                # no pipeline running: reads the server synchronously
        >>> out.shape
        torch.Size([2, 8])
        >>> out.sum().backward()         # updates the device table and, synchronously, the server
    """

    def __init__(self, tables: list[TableSpec], server: HostParameterServer | None,
                 device_modules: Sequence[nn.Module] = (), *, device: torch.device | str | None = None,
                 process_group=None) -> None:
        super().__init__()
        self.tables = list(tables)
        self.device_modules = nn.ModuleList(device_modules)
        object.__setattr__(self, "server", server)  # not a submodule: .to(device) must not move host tables
        self.feature_names: list[str] = []
        self.feature_dims: list[int] = []
        for spec in self.tables:
            if spec.pooling == "none":
                raise ConfigError(f"table {spec.name!r}: pooling 'none' is not produced by PipelinedEmbedding")
            for f in spec.features:
                self.feature_names.append(f)
                self.feature_dims.append(spec.dim)
        dims = dict(zip(self.feature_names, self.feature_dims))
        self._check_producers(dims)
        device = torch.device(device if device is not None else self._default_device())
        col_perm, host_perm = self._output_perms(dims)
        self.register_buffer("_col_perm", None if col_perm is None else torch.tensor(col_perm, device=device),
                             persistent=False)
        self.register_buffer("_anchor_dev", torch.empty(0, device=device), persistent=False)
        self.register_buffer("_host_perm", None if host_perm is None else torch.tensor(host_perm, device=device),
                             persistent=False)
        self.cache = LifeCycleCache(server.dims if server is not None else [], device=device,
                                    dtype=server.dtype if server is not None else torch.float32,
                                    with_momentum=server is not None and server.optimizer == "rowwise_adagrad")
        self.process_group = process_group
        # set by a running pipeline (embedscale.pipeline.loop)
        self._pending: PrefetchedBatch | None = None
        self._sink: Callable[[GradientBatch], None] | None = None
        self._track_updates = False  # update local copies and fill the cache (pipelined, depth > 1)
        self._sync_read_hook: Callable[[], None] | None = None  # before a read outside the schedule
        self.host_lookups = 0

    def _check_producers(self, dims: dict[str, int]) -> None:
        """Every pooled feature produced by exactly one device module or by the server (``_device_keys``, each
        device module's features; ``host_feature_names``), at the dim its table has."""
        self._device_keys: list[list[str]] = []
        produced: dict[str, str] = {}
        for i, m in enumerate(self.device_modules):
            names = getattr(m, "feature_names", None)
            if names is None:
                raise ConfigError(f"device module {i} ({type(m).__name__}) has no feature_names attribute")
            self._device_keys.append(list(names))
            for f in names:
                if f in produced:
                    raise ConfigError(f"feature {f!r} is produced by {produced[f]} and device module {i}")
                produced[f] = f"device module {i}"
        server = self.server
        self.host_feature_names = list(server.feature_names) if server is not None else []
        for f in self.host_feature_names:
            if f in produced:
                raise ConfigError(f"feature {f!r} is produced by {produced[f]} and the host parameter server")
            produced[f] = "the host parameter server"
        unknown = [f for f in produced if f not in dims]
        if unknown:
            raise ConfigError(f"features {unknown} are produced but no table given reads them")
        missing = [f for f in self.feature_names if f not in produced]
        if missing:
            raise ConfigError(f"features {missing} are produced by no device module and not by the server")
        for lay in server.layouts if server is not None else []:
            for f in lay.features:
                if dims[f] != lay.dim:
                    raise ConfigError(f"feature {f!r}: dim {dims[f]} in the tables, {lay.dim} on the server")

    def _default_device(self) -> torch.device:
        """The first device module's buffer's (or parameter's) device, else torch's default device."""
        buf = next(iter(self.device_modules.buffers()), None) if len(self.device_modules) else None
        par = next(iter(self.device_modules.parameters()), None) if len(self.device_modules) else None
        t = buf if buf is not None else par
        return t.device if t is not None else torch.get_default_device()

    def _output_perms(self, dims: dict[str, int]) -> tuple[list[int] | None, list[int] | None]:
        """The column permutations of the output: ``[device module 0 | ... | host]`` to feature order, and inside
        the host part the server's dim groups (one after another) to server feature order; ``None`` where it is
        the identity."""
        order = [f for keys in self._device_keys for f in keys] + self.host_feature_names
        perm = [c + j for f, c in zip(self.feature_names, _starts(order, dims, self.feature_names))
                for j in range(dims[f])]
        host_perm = None
        if self.server is not None:
            grouped = [f for lay in self.server.layouts for f in lay.features]
            hp = [c + j for f, c in zip(self.host_feature_names, _starts(grouped, dims, self.host_feature_names))
                  for j in range(dims[f])]
            host_perm = None if hp == list(range(len(hp))) else hp
        return (None if perm == list(range(len(perm))) else perm), host_perm

    @classmethod
    def from_tables(cls, tables: list[TableSpec], forms: Mapping[str, TableForm], *,
                    device: torch.device | str | None = None,
                    host_device: torch.device | str | None = None, optimizer: str = "rowwise_adagrad",
                    lr: float = 0.01, eps: float = 1e-8, seed: int | None = None, init="uniform",
                    device_modules: Sequence[nn.Module] | None = None, process_group=None,
                    server_group=None, timeout_s: float = 300.0, validate: bool = True) -> "PipelinedEmbedding":
        """Tables whose form in ``forms`` (``{table: TableForm}``; a table it does not name is ``sharded``) is
        ``host`` go to a new :class:`HostParameterServer` on ``host_device``; the others, unless
        ``device_modules`` is given, to one ``LocalEmbeddingBags`` on ``device`` (a TT table then needs
        ``device_modules``: a ``MixedEmbedding``). Both are
        initialised with ``init`` and ``seed`` (each as a ``LocalEmbeddingBags`` of its own tables would be).
        ``server_group``: the ranks of this machine that share one copy of the host tables
        (:mod:`embedscale.pipeline.shared`); ``None``: one server with its own copy per rank. ``validate``:
        both check the ids they read (``False`` when the ``ShardLoader`` did)."""
        kind = {t.name: forms[t.name].kind if t.name in forms else "sharded" for t in tables}
        host = [t for t in tables if kind[t.name] == "host"]
        rest = [t for t in tables if kind[t.name] != "host"]
        if device_modules is None:
            tt = [t.name for t in rest if kind[t.name] != "sharded"]
            if tt:
                raise ConfigError(f"PipelinedEmbedding.from_tables: tables {tt} are {[kind[n] for n in tt]}, not "
                                  "stored in a LocalEmbeddingBags: pass device_modules (a MixedEmbedding for TT)")
            device_modules = [LocalEmbeddingBags(rest, device=device, optimizer=optimizer, lr=lr, eps=eps,
                                                 init=init, seed=seed, validate=validate)] if rest else []
        server = HostParameterServer(host, device=host_device, optimizer=optimizer, lr=lr, eps=eps, init=init,
                                     seed=seed, share_group=server_group, timeout_s=timeout_s,
                                     validate=validate) if host else None
        return cls(tables, server, device_modules, device=device, process_group=process_group)

    # -- attributes ------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._anchor_dev.device

    @property
    def output_dim(self) -> int:
        return sum(self.feature_dims)

    @property
    def pipelined(self) -> bool:
        """A pipeline is running (its server thread may be reading and updating the host tables)."""
        return self._sink is not None

    def _group(self):
        if self.process_group is not None:
            return self.process_group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    def extra_repr(self) -> str:
        host = len(self.server.tables) if self.server is not None else 0
        return f"features={len(self.feature_names)}, host_tables={host}, device_modules={len(self.device_modules)}"

    # -- server-side preparation (runs on the server thread when pipelined) -----------------------------
    def device_features(self, features: JaggedFeatures) -> list[JaggedFeatures]:
        """Each device module's features of the batch ``features``, in ``device_modules`` order."""
        return [select_features(features, keys) for keys in self._device_keys]

    def prefetch(self, features: JaggedFeatures, *, index: int = 0, applied: int = 0, batch=None,
                 in_flight: Sequence[tuple[int, list[torch.Tensor]]] | None = None,
                 device_features: list[JaggedFeatures] | None = None) -> PrefetchedBatch:
        """Everything the trainer needs for one batch: device modules' features and the host rows, read now.

        ``in_flight``: ``(batch, rows per group)`` of the batches whose gradients the server has not applied
        yet; for each, the positions of the rows both batches read are computed here (the cache's patch
        plan), so the trainer does not search for them. ``device_features``: :meth:`device_features` of
        ``features``, if already selected.
        """
        dev_feats = self.device_features(features) if device_features is None else device_features
        host: list[HostRows] = []
        plan = None
        if self.server is not None:
            prepared = self.server.prepare(features)
            if in_flight is not None:
                plan = {}
                for t, rows_t in in_flight:
                    per_group = []
                    for hr, rt in zip(prepared, rows_t):
                        if rt.numel() == 0:
                            per_group.append((rt.new_empty(0), rt.new_empty(0)))
                            continue
                        pos = torch.searchsorted(rt, hr.rows).clamp_(max=rt.numel() - 1)
                        dst = (rt.index_select(0, pos) == hr.rows).nonzero().view(-1)
                        per_group.append((dst.to(self.device), pos.index_select(0, dst).to(self.device)))
                    plan[t] = per_group
            host = self.server.read(prepared, self.device)
        return PrefetchedBatch(index, applied, batch, features, dev_feats, host, plan)

    # -- trainer side --------------------------------------------------------------------------------
    def attach(self, pre: PrefetchedBatch, *, patch: bool = True) -> int:
        """Make ``pre`` the next batch to look up: count the server's gradient pulls (evicting rows whose
        life cycle ended) and patch its rows from the cache (``patch=False``: already patched, by the server
        thread). Returns the rows patched."""
        if self._pending is not None:
            raise PipelineError(f"batch {self._pending.index} was prefetched but never looked up "
                                "(the pipeline needs exactly one forward and one backward per batch)")
        patched = self._patch(pre) if patch else 0
        self._pending = pre
        return patched

    def _patch(self, pre: PrefetchedBatch) -> int:
        if self.server is None:
            return 0
        self.cache.advance(pre.applied)
        n = 0
        for hr in pre.host:
            plans = None
            if pre.patch_plan is not None:
                plans = {t: per_group[hr.group] for t, per_group in pre.patch_plan.items()}
            n += self.cache.patch(hr.group, hr.rows, hr.weights, hr.momentum, plans)
        return n

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        """Pooled embeddings ``[B, sum(feature_dims)]``, columns in ``feature_names`` order."""
        pre = self._pending
        if pre is not None and pre.features is features:
            self._pending = None
        else:
            if self.pipelined and torch.is_grad_enabled() and self.training:
                raise PipelineError("a training lookup of a batch the pipeline did not prefetch: while a pipeline "
                                    "runs, train only on the batches it yields, one forward each")
            if self._sync_read_hook is not None:
                self._sync_read_hook()
            pre = self.prefetch(features)
            if self.pipelined:
                self._patch_sync(pre)
        outs = [m(f) for m, f in zip(self.device_modules, pre.device_features)]
        if self.server is not None:
            self.host_lookups += 1
            if torch.is_grad_enabled():
                anchor = torch.empty(0, device=self.device, requires_grad=True)
                outs.append(_HostLookup.apply(anchor, self, pre))
            else:
                outs.append(self._pool_host(pre))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self._col_perm is not None:
            out = out.index_select(1, self._col_perm)
        return out

    def _patch_sync(self, pre: PrefetchedBatch) -> None:
        """A synchronous read while a pipeline runs: rows the server has not caught up on are in the cache."""
        for hr in pre.host:
            self.cache.patch(hr.group, hr.rows, hr.weights, hr.momentum)

    def _pool_host(self, pre: PrefetchedBatch) -> torch.Tensor:
        B = pre.features.batch_size
        outs = []
        for hr in pre.host:
            offsets = hr.offsets
            if offsets is None:
                offsets = torch.arange(hr.ids.numel() + 1, dtype=hr.ids.dtype, device=hr.ids.device)
            out = F.embedding_bag(hr.ids, hr.weights, offsets, mode="sum", per_sample_weights=hr.scale,
                                  include_last_offset=True)
            if hr.key_major > 1:
                out = out.view(hr.key_major, B, hr.dim).transpose(0, 1)
            outs.append(out.reshape(B, hr.width))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self._host_perm is not None:
            out = out.index_select(1, self._host_perm)
        return out

    def _host_backward(self, pre: PrefetchedBatch, grad_out: torch.Tensor) -> None:
        server = self.server
        if self._host_perm is not None:
            grad_out = grad_out.index_select(1, torch.argsort(self._host_perm))
        lr = server.lr
        group = self._group()
        rows, updates, w_pre, m_pre = [], [], [], []
        start = 0
        for hr in pre.host:
            grad_bags = grad_out[:, start:start + hr.width].reshape(hr.num_bags, hr.dim)
            start += hr.width
            upd = aggregate_row_updates(server.optimizer, lr, hr, grad_bags)
            rows.append(hr.rows)
            updates.append(upd)
            w_pre.append(hr.weights)
            m_pre.append(hr.momentum)
        if group is not None:
            rows, updates, w_pre, m_pre = _exchange(rows, updates, w_pre, m_pre, group)
        if self._track_updates:
            # LC: gradient pulls the server still has to make before it has applied this batch. The local
            # buffers become the cache entry by reference (they are not used again), with the optimizer
            # step deferred to the rows a later batch actually reads (LifeCycleCache.insert)
            opt, eps = server.optimizer, server.eps

            def update(w, m, u, opt=opt, lr=lr, eps=eps):
                apply_buffer_updates_(opt, w, m, u, lr, eps)

            self.cache.insert(pre.index, rows, w_pre, m_pre, life=pre.index + 1 - self.cache.applied,
                              updates=updates, update=update)
        grads = GradientBatch(pre.index, lr, rows, updates)
        if self._sink is not None:
            self._sink(grads)
        else:
            server.apply(grads)

    # -- checkpoints: host tables under "host.{table}.weight" / ".momentum" ----------------------------
    def host_state(self) -> dict[str, torch.Tensor]:
        """Copies of the host tables as sequential training would have them now: the server's rows, with
        the rows it has not caught up on (pipeline running) taken from the cache."""
        if self.server is None:
            return {}
        if self._sync_read_hook is not None:
            self._sync_read_hook()
        ps = self.server
        ps.sync()
        with torch.no_grad():
            weights = [ps.group_weight(g).clone() for g in range(len(ps.layouts))]
            moms = [ps.group_momentum(g) for g in range(len(ps.layouts))]
            moms = [m.clone() if m is not None else None for m in moms]
            if self.pipelined:
                for g in range(len(ps.layouts)):
                    rows, w, m = self.cache.latest(g)
                    rows = rows.to(ps.device)
                    weights[g].index_copy_(0, rows, w.to(ps.device))
                    if moms[g] is not None:
                        moms[g].index_copy_(0, rows, m.to(ps.device))
        out = {}
        for spec in ps.tables:
            g = ps.store.group_of(spec.name).index
            off = ps.store.row_offset(spec.name)
            out[f"{spec.name}.weight"] = weights[g].narrow(0, off, spec.num_rows)
            if moms[g] is not None:
                out[f"{spec.name}.momentum"] = moms[g].narrow(0, off, spec.num_rows)
        return out

    def load_host_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load the host tables from ``host_state()``'s format (``<table>.weight`` / ``.momentum``), every
        key required; not while a pipeline runs."""
        if self.server is None:
            if state:
                raise InputError(f"no host tables to load {sorted(state)[:3]} into")
            return
        if self.pipelined:
            raise PipelineError("PipelinedEmbedding: cannot load host tables while a pipeline runs")
        result = self.server.store.load_state_dict(state, strict=True)
        if result.missing_keys or result.unexpected_keys:  # pragma: no cover - strict raises first
            raise InputError(f"host tables: missing {result.missing_keys}, unexpected {result.unexpected_keys}")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for k, v in self.host_state().items():
            destination[f"{prefix}host.{k}"] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        n_unexpected = len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # the base class does not know the host tables: they are not parameters or buffers here
        unexpected_keys[n_unexpected:] = [k for k in unexpected_keys[n_unexpected:]
                                          if not (self.server is not None and k.startswith(prefix + "host."))]
        if self.server is None:
            return
        if self.pipelined:
            error_msgs.append("PipelinedEmbedding: cannot load host tables while a pipeline runs")
            return
        sub = {k[len(prefix) + 5:]: v for k, v in state_dict.items() if k.startswith(prefix + "host.")}
        # torch passes strict=True to every module and applies ``strict`` itself to the keys reported here
        result = self.server.store.load_state_dict(sub, strict=False)
        missing_keys.extend(prefix + "host." + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + "host." + k for k in result.unexpected_keys)


def _starts(order: list[str], dims: dict[str, int], features: list[str]) -> list[int]:
    """The first column of each of ``features`` in an output whose features come in ``order`` (widths ``dims``)."""
    col0, c = {}, 0
    for f in order:
        col0[f] = c
        c += dims[f]
    return [col0[f] for f in features]


def _all_gather_rows(t: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    top = max(sizes)
    pad = torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
    pad[: t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(out, pad, group=group)
    return [o[:s] for o, s in zip(out, sizes)]


def _exchange(rows, updates, w_pre, m_pre, group):
    """Data parallelism over ranks: every rank gets every rank's per-row updates and pre-update rows of
    this step, sums the updates per row in rank order, and keeps for each row the first rank's copy."""
    world = dist.get_world_size(group)
    dev = rows[0].device if rows else None
    n = torch.tensor([r.numel() for r in rows], dtype=torch.int64, device=dev)
    all_n = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(all_n, n, group=group)
    sizes = torch.stack(all_n).tolist()  # [world][groups]
    out = ([], [], [], [])
    for g in range(len(rows)):
        sz = [s[g] for s in sizes]
        m = m_pre[g]
        packed = torch.cat([updates[g], w_pre[g].to(updates[g].dtype)] +
                           ([m.to(updates[g].dtype).unsqueeze(1)] if m is not None else []), dim=1)
        r_all = torch.cat(_all_gather_rows(rows[g], sz, group))
        p_all = torch.cat(_all_gather_rows(packed, sz, group))
        d = updates[g].shape[1]
        uniq, inverse = torch.unique(r_all, sorted=True, return_inverse=True)
        summed = torch.zeros(uniq.numel(), d, dtype=p_all.dtype, device=p_all.device)
        # sum per row in rank order: a sort by row that keeps rank order (stable) and a segment sum
        order = torch.sort(inverse, stable=True).indices
        seg = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=p_all.device)
        torch.cumsum(torch.bincount(inverse, minlength=uniq.numel()), 0, out=seg[1:])
        summed = F.embedding_bag(order, p_all[:, :d].contiguous(), seg, mode="sum", include_last_offset=True)
        first = order.index_select(0, seg[:-1])  # first rank's copy of each row
        w = p_all.index_select(0, first)[:, d:2 * d].to(w_pre[g].dtype).contiguous()
        mm = p_all.index_select(0, first)[:, 2 * d].to(torch.float32).contiguous() if m is not None else None
        out[0].append(uniq)
        out[1].append(summed)
        out[2].append(w)
        out[3].append(mm)
    return out
