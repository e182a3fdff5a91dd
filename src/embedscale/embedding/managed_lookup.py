"""Managed tables in a run: raw 64-bit ids mapped to rows before every lookup.

What this module owns: :class:`ManagedLookup`, the run-side glue between the id mappings of
:mod:`embedscale.embedding.managed` (one :class:`~embedscale.embedding.managed.ManagedIdTable` per managed
table, ``specs.ManagedConfig``) and the module holding the tables' rows (a ``LocalEmbeddingBags`` in a world of
one, a ``ShardedEmbedding`` on N ranks), installed by :func:`install` as a forward pre-hook of the model's
embedding. What the hook does with a batch's ``JaggedFeatures``:

* training (the embedding module in training mode): every managed feature's raw ids go through their table's
  ``assign`` (admission after ``admit_after`` sightings, LRU/LFU/TTL eviction), the rows it reports (evicted,
  newly admitted) are reset, and the lookup reads the assigned rows (row 0: the default row of ids without a
  row of their own); :attr:`ManagedLookup.last` keeps the mapped features (the drift monitor's rolling
  profile reads the rows of the last training batch);
* evaluation (eval mode): ``rows_of``, the mapping as it stands, unchanged.

A table's ids in one batch are its features' values in the table's feature order (``TableSpec.features``),
each in sample order; that order decides ties among new ids (``ManagedIdTable.assign``: first occurrence
within a mapping shard).

**N ranks: the mapping is sharded** (as TorchRec's managed-collision modules remap per shard; OPER section 8
names new ids as future work). Each managed table has ``S`` mapping shards (``ManagedConfig.shards_for``, a
property of the table, not of the world size): a fixed hash of the raw id picks the shard, and shard ``s``
admits into and evicts among its own range of rows (``embedding.managed``). Rank ``r`` hosts the shards
``s % N == r`` of every managed table (their rows' ids, last steps and counts, their pending ids): the
mapping's memory and work are split over the ranks. A step (:meth:`ManagedLookup.map`, every rank together,
through a ``CollectiveTransport`` on the lookup's own group, bytes counted by ``comm.transport``'s
convention in :attr:`ManagedLookup.stats`):

1. the per-rank, per-feature counts of ids for each host rank (one ``[N, F]`` all-to-all, metadata);
2. the raw ids to their shard's host rank (one all-to-all: each id travels once, to one rank; ids of a
   rank's own shards stay local), ordered by feature then position;
3. each host puts what it received in the single process's order (features in table order, then ranks in
   order, then positions: per shard the same order as a world of one sees) and runs ``assign`` per table,
   all its shards at once;
4. the rows back to the ranks that asked (one all-to-all, after the exchange of its sizes), each message
   followed by the global ids of the reset rows (evicted, admitted) that the receiving rank holds (owner or
   replica, ``AddressMap.holders_of``); every rank resets what it received. Int32 when the rows module's
   global row ids fit (under 2^31 rows in all), else int64.

A world of one hosts all shards and sees the same per-shard order, so N ranks and one process assign alike
(tests/test_managed_train.py). Evaluation sends ids and rows the same way (no resets, no size exchange).

**Live re-planning** (``train.replan_every``, ``train.replan``). The mapping names rows, not places: a
migration moves rows and their optimizer state and the mapping stays valid as it is. The reset of later
batches finds a row where the running address map puts it (:func:`storage_positions` reads the module's map
each time); a migration that builds a new module (a PGAS heap too small to migrate in place) points :attr:`ManagedLookup.rows` and the hook at it
(``DistributedRun.swap_sharded``). The drift monitor profiles the rows a batch read (:attr:`ManagedLookup.last`),
not its raw ids (tests/test_managed_replan.py).

**Input pipeline** (``embedding.input_pipeline``): a run hands the lookup each upcoming training batch
(:meth:`ManagedLookup.prefetch`, before the step before its own); the hook of that step maps it right after the
step's own batch (so ids are assigned in step order, every rank together) and hands the mapped batch to the module
it sits on, which prepares its lookup during the step. The rows its mapping resets are reset when the batch's own
step takes it (after the step before's update, as mapping at its own step does), and :attr:`ManagedLookup.last`
names it then. Between the two the mapping already holds that batch's ids: a run evaluates and checkpoints only
after a step whose successor was not mapped ahead (``embedding.input_pipeline.held_back``).

A reset row takes its initial value again (``embedding.init.uniform_rows`` of the table's index among all
tables: placement-independent, so one process and N ranks reset alike) and row-wise optimizer state 0, and
counts as updated for a delta checkpoint. Everything per id is a tensor operation on the run's device; the
reset rows' values are drawn on the host (numpy, the init's hash) for those rows only. Each rank's
checkpoint file holds its hosted shards (:meth:`ManagedLookup.state_dict`); a restore merges every rank
file's and each rank takes the shards it hosts now, so a checkpoint re-shards onto any world size.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from embedscale.comm.collective import CollectiveTransport
from embedscale.data.batch import JaggedFeatures, same_batch
from embedscale.device import HOST
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.input_pipeline import InputPipeline
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.managed import ManagedIds, ManagedIdTable, shard_of
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import ConfigError, FormatError
from embedscale.specs import ManagedConfig, TableSpec

_ATTR = "managed_lookup"  # the embedding module's attribute naming its ManagedLookup (managed_of)


class ManagedLookup:
    """The managed tables of a run: their mappings (this rank's mapping shards), and the rows module whose rows
    they reset.

    Args:
        tables: every table of the model (their indices seed the rows' initial values, ``hash_init``).
        managed: ``{table: ManagedConfig}`` of the managed ones (``specs.managed_tables``).
        rows: the module holding the managed tables' rows: ``LocalEmbeddingBags`` or ``ShardedEmbedding``.
        seed: ``train.seed`` (the rows' initial values).
        device: the run's device (the mappings live there).
        group: N ranks: the process group of the ids' and rows' all-to-alls (``None``: a world of one).
    """

    def __init__(self, tables: list[TableSpec], managed: Mapping[str, ManagedConfig], rows: nn.Module, *,
                 seed: int, device: torch.device, group=None):
        if not isinstance(rows, (LocalEmbeddingBags, ShardedEmbedding)):
            raise ConfigError(f"managed tables {sorted(managed)}: their rows must be device rows (local or sharded), "
                              f"not in a {type(rows).__name__}")
        by_name = {t.name: t for t in tables}
        held = {t.name for t in rows.tables}
        for name in managed:
            if name not in held:
                raise ConfigError(f"managed table {name!r}: its rows are not in the run's device rows (a TT or "
                                  "host table cannot be managed)")
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        order = [t.name for t in tables if t.name in managed]  # the model's table order
        self.specs = {name: by_name[name] for name in order}
        self.index = {t.name: i for i, t in enumerate(tables)}
        self.shards = {name: managed[name].shards_for(by_name[name].num_rows) for name in order}
        self.ids = ManagedIds({
            name: ManagedIdTable(name, by_name[name].num_rows, m.admit_after, m.policy, m.ttl or None,
                                 m.pending_capacity or None, device=device, shards=self.shards[name],
                                 hosted=[s for s in range(self.shards[name]) if s % self.world == self.rank])
            for name, m in ((n, managed[n]) for n in order)})
        self.features = [f for name in order for f in by_name[name].features]  # table order, then feature order
        self._table = {f: name for name in order for f in by_name[name].features}
        self.rows = rows
        self.seed = int(seed)
        self.device = torch.device(device)
        self.transport = CollectiveTransport(self.rank, self.world, group) if self.world > 1 else None
        # the rows' way back: int32 when every global row id of the rows module fits (rows and reset gids)
        total = int(rows.amap.table_base[-1]) if isinstance(rows, ShardedEmbedding) else 1 << 62
        self._back_dtype = torch.int32 if total < 2**31 else torch.int64
        self.stats: dict[str, int] = {}  # training steps' bytes sent (bytes_sent = ids + rows + meta), steps
        self.last: JaggedFeatures | None = None  # the mapped features of the last training batch
        self.inner: nn.Module | None = None  # the module the hook sits on (install): prefetch hands it mapped batches
        # upcoming training batches mapped ahead (prefetch): (mapped features, their resets), in step order
        self.input_lane = InputPipeline().lane("managed", 2)
        self._upcoming: JaggedFeatures | None = None  # the next training batch, mapped by the next hook

    # -- the hook --------------------------------------------------------------------------------
    def __call__(self, module: nn.Module, args: tuple):
        """Forward pre-hook: the batch's features with the managed ids replaced by rows (a training batch mapped
        ahead is taken, its resets applied now); then the upcoming batch :meth:`prefetch` was given is mapped."""
        features = args[0]
        if not module.training:
            return (self.map(features, training=False), *args[1:])
        head = self.input_lane.head()
        if head is not None and same_batch(head.features, features):
            mapped, resets = self.input_lane.pop().value
            resets()
            self.last = mapped
        else:
            mapped = self.map(features, training=True)
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is not None:
            ahead = self._mapped(upcoming, True)
            self.input_lane.push(upcoming, lambda f: ahead, background=False)
            inner = getattr(self.inner, "prefetch", None)
            if inner is not None:
                inner(ahead[0])
        return (mapped, *args[1:])

    def map(self, features: JaggedFeatures, *, training: bool) -> JaggedFeatures:
        """``features`` with every managed feature's raw ids replaced by their rows (``assign`` while
        training, ``rows_of`` otherwise; on N ranks every rank calls it together)."""
        mapped, resets = self._mapped(features, training)
        resets()
        if training:
            self.last = mapped
        return mapped

    # -- the input pipeline (embedding.input_pipeline) ----------------------------------------------
    def prefetch(self, features: JaggedFeatures) -> None:
        """``features`` are the next training step's (given before the step before theirs): the hook of that step
        maps them after its own batch and hands them on to the module it sits on (its ``prefetch``)."""
        self._upcoming = features

    def attach_input_pipeline(self, pipeline: InputPipeline) -> None:
        """Map ahead on ``pipeline`` (the run's) from now on, the inner module's lanes there too."""
        self.input_lane.leave()
        self.input_lane = pipeline.lane("managed", 2)
        inner = getattr(self.inner, "attach_input_pipeline", None)
        if inner is not None:
            inner(pipeline)

    @property
    def pending_batches(self) -> int:
        """Training batches mapped ahead and not looked up yet."""
        return len(self.input_lane)

    def _mapped(self, features: JaggedFeatures, training: bool):
        """``(features mapped, a function that applies the resets of the mapping)``."""
        keys = features.keys
        missing = [f for f in self.features if f not in keys]
        if missing:
            raise ConfigError(f"managed features {missing} are not in the batch (keys {keys})")
        B = features.batch_size
        per_key = features.lengths.view(len(keys), B).sum(1)
        starts = torch.zeros(len(keys) + 1, dtype=torch.int64, device=per_key.device)
        torch.cumsum(per_key, 0, out=starts[1:])
        bounds = starts.tolist()  # one host sync per batch: the features' value ranges
        span = {k: (bounds[i], bounds[i + 1]) for i, k in enumerate(keys)}
        values = features.values
        local = {f: values[span[f][0]:span[f][1]].to(self.device, torch.int64) for f in self.features}
        rows, resets = self._map_local(local, training) if self.world == 1 else self._map_exchange(local, training)
        out = values.clone()
        for f in self.features:
            a, b = span[f]
            out[a:b] = rows[f].to(out.device, out.dtype)
        return JaggedFeatures(keys, out, features.lengths, features.weights), resets

    def _table_of(self, feature: str) -> str:
        return self._table[feature]

    def _run_tables(self, ids: torch.Tensor, per_feature: list[int], training: bool) -> tuple[torch.Tensor, dict]:
        """Map ``ids`` (the managed features' ids one after the other, ``per_feature[i]`` of feature ``i`` of
        :attr:`features`) table by table: ``assign`` (training) or ``rows_of``. Returns the rows in the same
        order and ``{table: reset rows}``."""
        sizes = {f: n for f, n in zip(self.features, per_feature)}
        out, resets, pos = [], {}, 0
        for name, spec in self.specs.items():
            n = sum(sizes[f] for f in spec.features)
            part = ids[pos:pos + n]
            pos += n
            if training:
                a = self.ids[name].assign(part)
                out.append(a.rows)
                resets[name] = a.reset
            else:
                out.append(self.ids[name].rows_of(part))
        return (torch.cat(out) if out else ids.new_zeros(0)), resets

    def _map_local(self, local: dict[str, torch.Tensor], training: bool):
        """A world of one: every shard is here. Returns the rows and a function that resets the rows to reset."""
        sizes = [local[f].numel() for f in self.features]
        rows, resets = self._run_tables(torch.cat([local[f] for f in self.features]), sizes, training)

        def reset():
            for name, r in resets.items():
                self.reset(name, r)

        return dict(zip(self.features, torch.split(rows, sizes))), reset

    def _map_exchange(self, local: dict[str, torch.Tensor], training: bool):
        """N ranks: ids to their shard's host, ``assign`` there, rows (and the resets each rank holds) back
        (the module docstring's steps 1-4). Returns the rows and a function that resets the rows to reset."""
        tr, W, F, dev = self.transport, self.world, len(self.features), self.device
        counter = tr.counter
        before = (int(counter.by_kind.get("ids", 0)), int(counter.by_kind.get("rows", 0)), int(counter.meta))
        sizes = [local[f].numel() for f in self.features]
        vals = torch.cat([local[f] for f in self.features])
        fidx = torch.repeat_interleave(torch.arange(F, device=dev), torch.tensor(sizes, device=dev))
        dest = torch.cat([shard_of(local[f], self.shards[self._table[f]]) % W for f in self.features])
        key = dest * F + fidx
        order = torch.argsort(key, stable=True)  # by host rank, then feature, then position
        counts = torch.bincount(key, minlength=W * F).view(W, F)
        recv_counts = tr.exchange_counts(counts)  # row p: what rank p sends here, per feature (1.)
        send_n, recv_n = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        got = tr.exchange(list(torch.split(vals[order], send_n)), recv_n, kind="ids")  # (2.)
        flat = torch.cat(got)
        seg = torch.repeat_interleave(torch.arange(W * F, device=dev), recv_counts.reshape(-1))  # p * F + f
        perm = torch.argsort((seg % F) * W + seg // F, stable=True)  # to features, then ranks, then positions
        rows_fp, resets = self._run_tables(flat[perm], recv_counts.sum(0).tolist(), training)  # (3.)
        rows_recv = torch.empty_like(rows_fp)
        rows_recv[perm] = rows_fp
        back = list(torch.split(rows_recv, recv_n))
        bt = self._back_dtype
        if training:  # each rank gets the global ids of the reset rows it holds after its rows (4.)
            held = self._reset_gids_by_rank(resets)
            back = tr.exchange([torch.cat([back[p], held[p]]).to(bt) for p in range(W)], None, kind="rows")
        else:
            back = tr.exchange([b.to(bt) for b in back], send_n, kind="rows")
        mine = torch.empty_like(vals)
        mine[order] = torch.cat([m[:n] for m, n in zip(back, send_n)]).to(torch.int64)
        gids = None
        if training:
            gids = torch.cat([m[n:] for m, n in zip(back, send_n)]).to(torch.int64)
            now = (int(counter.by_kind.get("ids", 0)), int(counter.by_kind.get("rows", 0)), int(counter.meta))
            st = self.stats
            for k, b, a in zip(("ids_bytes", "rows_bytes", "meta_bytes"), before, now):
                st[k] = st.get(k, 0) + a - b
            st["bytes_sent"] = st.get("bytes_sent", 0) + sum(now) - sum(before)
            st["steps"] = st.get("steps", 0) + 1
        return dict(zip(self.features, torch.split(mine, sizes))), lambda: gids is not None and self._reset_gids(gids)

    def _reset_gids_by_rank(self, resets: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The reset rows of this rank's shards as global ids of the rows module, split by the ranks that hold
        them (owner and replica holders; every rank when the rows are not sharded)."""
        m, W = self.rows, self.world
        names = [s.name for s in m.tables]
        base = np.asarray(m.amap.table_base) if isinstance(m, ShardedEmbedding) else None
        gids, rows_of_name = [], []
        for name, r in resets.items():
            if r.numel():
                t = names.index(name)
                off = int(base[t]) if base is not None else t << 40
                gids.append(r.to(HOST).numpy().astype(np.int64) + off)
        g = np.concatenate(gids) if gids else np.zeros(0, dtype=np.int64)
        hold = m.amap.holders_of(g) if base is not None else np.ones((g.size, W), dtype=bool)
        return [torch.from_numpy(g[hold[:, p]]).to(self.device) for p in range(W)]

    def _reset_gids(self, gids: torch.Tensor) -> None:
        """Reset the rows named by global ids (:meth:`_reset_gids_by_rank`), table by table."""
        if gids.numel() == 0:
            return
        m = self.rows
        g = np.unique(gids.to(HOST).numpy())
        names = [s.name for s in m.tables]
        if isinstance(m, ShardedEmbedding):
            base = np.asarray(m.amap.table_base)
            t = np.searchsorted(base, g, side="right") - 1
            local = g - base[t]
        else:
            t, local = g >> 40, g & ((1 << 40) - 1)
        for ti in np.unique(t):
            self.reset(names[int(ti)], torch.from_numpy(local[t == ti]))

    # -- resetting rows --------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, table: str, rows: torch.Tensor) -> None:
        """Give ``rows`` of ``table`` their initial values again and zero their optimizer state, in every copy
        this rank holds (owned or replica); mark them updated for a delta checkpoint."""
        if rows.numel() == 0:
            return
        spec = self.specs[table]
        r = rows.to(HOST).numpy().astype(np.int64)
        fresh = torch.from_numpy(uniform_rows(self.seed, self.index[table], r, spec.dim, spec.num_rows))
        m = self.rows
        if isinstance(m, LocalEmbeddingBags):
            idx = torch.from_numpy(r).to(m.device)
            m.table_weight(table)[idx] = fresh.to(m.device, m.table_weight(table).dtype)
            if m.momentum is not None:
                m.table_momentum(table)[idx] = 0
            if m.touched is not None:
                m.table_touched(table)[idx] = True
            return
        pos, sel = storage_positions(m, table, r)
        if pos.size == 0:
            return
        dst = torch.from_numpy(pos).to(m.weight.device)
        m.weight[dst] = fresh[torch.from_numpy(sel)].to(m.weight)
        if m.optimizer == "rowwise_adagrad":
            m.momentum[dst] = 0
        if m.touched is not None:
            m.touched[dst] = True

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self, delta: bool = False) -> dict[str, torch.Tensor]:
        """This rank's mapping shards of every managed table (``ManagedIds.state_dict``: ``<table>.config``,
        ``<table>.step``, ``<table>.<shard>.<key>``; tensors only), on the host. ``delta``: only what changed
        since the last :meth:`track` (``ManagedIdTable.delta_state_dict``; ``embedding.managed.apply_delta``
        restores it over the base's)."""
        return {k: v.detach().to(HOST) for k, v in self.ids.state_dict(delta=delta).items()}

    def track(self) -> None:
        """The mapping as it is now is the base of later delta states (a full checkpoint was just written)."""
        self.ids.track()

    def load_state_dict(self, state: Mapping[str, torch.Tensor], where) -> None:
        """The mappings of a checkpoint: ``state`` merges every rank file's shards (any world size wrote it);
        each table takes the shards this rank hosts."""
        tables = sorted({k.split(".", 1)[0] for k in state})
        missing = sorted(set(self.specs) - set(tables))
        if missing:
            raise FormatError(f"{where}: the checkpoint has no id mapping for managed table(s) {missing} "
                              f"(it has {tables})")
        try:
            self.ids.load_state_dict(state)
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None

    def exchange_figures(self) -> dict:
        """The training steps' id exchange, bytes sent per step *summed over the ranks* (collective on N ranks):
        ``bytes_per_step`` and ``{ids, rows, meta}`` per step (``comm.transport``'s convention); zeros in a
        world of one."""
        keys = ("bytes_sent", "ids_bytes", "rows_bytes", "meta_bytes")
        v = torch.tensor([float(self.stats.get(k, 0)) for k in keys], dtype=torch.float64)
        if self.world > 1:
            v = v.to(self.transport.wire_device)
            dist.all_reduce(v, group=self.group)
            v = v.to(HOST)
        n = max(self.stats.get("steps", 0), 1)
        per = (v / n).tolist()
        return {"bytes_per_step": per[0], "ids": per[1], "rows": per[2], "meta": per[3]}

    def counters(self) -> dict[str, dict[str, int]]:
        """Every managed table's counters over all its shards (N ranks: a sum over the ranks, collective)."""
        names = list(self.specs)
        keys = list(self.ids[names[0]].counters) if names else []
        c = torch.tensor([[self.ids[n].counters[k] for k in keys] for n in names], dtype=torch.int64)
        if self.world > 1 and c.numel():
            c = c.to(self.transport.wire_device)
            dist.all_reduce(c, group=self.group)
            c = c.to(HOST)
        return {n: dict(zip(keys, (int(v) for v in row))) for n, row in zip(names, c.tolist())}


def storage_positions(m: ShardedEmbedding, table: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where ``rows`` of ``table`` sit in this rank's storage of ``m`` (owned region, or its replica region):
    ``(positions, index into rows)`` of the rows this rank holds."""
    amap, me = m.amap, m.rank
    t = [s.name for s in m.tables].index(table)
    gids = rows + int(amap.table_base[t])
    held = np.flatnonzero(amap.holders_of(gids)[:, me])
    g = gids[held]
    slot = amap.slot_of(g)
    rep = slot >= 0
    pos = np.empty(g.size, dtype=np.int64)
    pos[~rep] = amap.owner_offset_of(g[~rep])
    if rep.any():
        pos[rep] = m.num_owned + amap.replica_local[slot[rep], me]
    return pos, held


def install(embedding: nn.Module, lookup: ManagedLookup) -> ManagedLookup:
    """Map managed ids before every forward of ``embedding`` (the model's embedding module): a forward pre-hook
    (parameter names and the module tree unchanged). :func:`managed_of` finds it again."""
    embedding.register_forward_pre_hook(lookup)
    setattr(embedding, _ATTR, lookup)
    lookup.inner = embedding
    return lookup


def managed_of(model: nn.Module) -> ManagedLookup | None:
    """The :class:`ManagedLookup` installed in ``model`` (``None``: no managed tables)."""
    return next((getattr(m, _ATTR) for m in model.modules() if isinstance(getattr(m, _ATTR, None), ManagedLookup)),
                None)
