"""Managed tables in a run (issue 17 part 2): raw 64-bit ids mapped to rows before every lookup.

What this module owns: :class:`ManagedLookup`, the run-side glue between the id mappings of
:mod:`embedscale.embedding.managed` (one :class:`~embedscale.embedding.managed.ManagedIdTable` per managed
table, ``specs.ManagedConfig``) and the module holding the tables' rows (a ``LocalEmbeddingBags`` in a world of
one, a ``ShardedEmbedding`` on N ranks), installed by :func:`install` as a forward pre-hook of the model's
embedding. What the hook does with a batch's ``JaggedFeatures``:

* training (the embedding module in training mode): every managed feature's raw ids go through their table's
  ``assign`` (admission after ``admit_after`` sightings, LRU/LFU/TTL eviction), the rows it reports (evicted,
  newly admitted) are reset, and the lookup reads the assigned rows (row 0: the default row of ids without a
  row of their own);
* evaluation (eval mode): ``rows_of``, the mapping as it stands, unchanged.

A table's ids in one batch are its features' values in the table's feature order (``TableSpec.features``),
each in sample order; that order decides ties among new ids (``ManagedIdTable.assign``: first occurrence).

**N ranks.** The mapping is *replicated*: every rank holds the whole mapping of every managed table and
runs the same deterministic ``assign`` on the *global* batch. Each step the ranks' raw ids of all managed
features go in one ``all_gather`` (``grad_sync.all_gather_var``: the sizes, then the ids), every rank
rebuilds the global order (feature by feature, ranks in order: the single process's order) and keeps its
own positions of the result. A reset row is reset by every rank that holds it (its owner and the ranks with
a replica of it), so every copy stays identical. Not yet: the mapping sharded with the rows (each rank
mapping the ids its rows own), as the issue asks.

**Live re-planning** (``train.replan_every``, ``train.replan``). The mapping names rows, not places: a
migration moves rows and their optimizer state and the mapping stays valid as it is. The reset of later
batches finds a row where the running address map puts it (:func:`storage_positions` reads the module's map
each time); a migration that builds a new module (PGAS) points :attr:`ManagedLookup.rows` and the hook at it
(``DistributedRun.swap_sharded``). The drift monitor profiles the rows a batch read (:attr:`ManagedLookup.last`),
not its raw ids.

A reset row takes its initial value again (``embedding.init.uniform_rows`` of the table's index among all
tables: placement-independent, so one process and N ranks reset alike) and row-wise optimizer state 0, and
counts as updated for a delta checkpoint. Everything per id is a tensor operation on the run's device; the
reset rows' values are drawn on the host (numpy, the init's hash) for those rows only.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.grad_sync import all_gather_var
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.managed import ManagedIds, ManagedIdTable
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import ConfigError, FormatError
from embedscale.specs import ManagedConfig, TableSpec

_ATTR = "managed_lookup"  # the embedding module's attribute naming its ManagedLookup (managed_of)


class ManagedLookup:
    """The managed tables of a run: their mappings, and the rows module whose rows they reset.

    Args:
        tables: every table of the model (their indices seed the rows' initial values, ``hash_init``).
        managed: ``{table: ManagedConfig}`` of the managed ones (``specs.managed_tables``).
        rows: the module holding the managed tables' rows: ``LocalEmbeddingBags`` or ``ShardedEmbedding``.
        seed: ``train.seed`` (the rows' initial values).
        device: the run's device (the mappings live there).
        group: N ranks: the process group of the ids' all_gather (``None``: a world of one).
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
        self.specs = {name: by_name[name] for name in managed}
        self.index = {t.name: i for i, t in enumerate(tables)}
        self.ids = ManagedIds({
            name: ManagedIdTable(name, by_name[name].num_rows, m.admit_after, m.policy, m.ttl or None,
                                 m.pending_capacity or None, device=device)
            for name, m in managed.items()})
        self.features = [f for name in managed for f in by_name[name].features]  # table order, then feature order
        self.rows = rows
        self.seed = int(seed)
        self.device = torch.device(device)
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.stats: dict[str, int] = {}
        # the last training batch as the lookup read it (rows, not raw ids): the drift monitor's rolling profile
        # counts these (train.replan)
        self.last: JaggedFeatures | None = None

    # -- the hook --------------------------------------------------------------------------------
    def __call__(self, module: nn.Module, args: tuple):
        """Forward pre-hook: the batch's features with the managed ids replaced by rows."""
        features = args[0]
        return (self.map(features, training=module.training), *args[1:])

    def map(self, features: JaggedFeatures, *, training: bool) -> JaggedFeatures:
        """``features`` with every managed feature's raw ids replaced by their rows (``assign`` while
        training: N ranks call it together; ``rows_of`` otherwise)."""
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
        if training:
            rows = self._assign(local)
        else:
            rows = {f: self.ids[self._table_of(f)].rows_of(local[f]) for f in self.features}
        out = values.clone()
        for f in self.features:
            a, b = span[f]
            out[a:b] = rows[f].to(out.device, out.dtype)
        mapped = JaggedFeatures(keys, out, features.lengths, features.weights)
        if training:
            self.last = mapped
        return mapped

    def _table_of(self, feature: str) -> str:
        return next(n for n, s in self.specs.items() if feature in s.features)

    def _assign(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Assign the global batch (every rank's ids of every managed feature), reset the reported rows, and
        return this rank's rows per feature."""
        feats = self.features
        if self.world == 1:
            parts = {f: [local[f]] for f in feats}
        else:  # one all_gather of [count per feature, ids...] for every managed table at once
            counts = torch.tensor([local[f].numel() for f in feats], dtype=torch.int64, device=self.device)
            payload = torch.cat([counts] + [local[f] for f in feats])
            got = all_gather_var(payload, self.group, self.stats)
            parts = {f: [] for f in feats}
            for g in got:
                n = g[:len(feats)].tolist()
                pos = len(feats)
                for f, c in zip(feats, n):
                    parts[f].append(g[pos:pos + c])
                    pos += c
        rows: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            mine = [f for f in spec.features]
            ids = torch.cat([p for f in mine for p in parts[f]])
            a = self.ids[name].assign(ids)
            self.reset(name, a.reset)
            pos = 0
            for f in mine:
                for r, p in enumerate(parts[f]):
                    if r == self.rank:
                        rows[f] = a.rows[pos:pos + p.numel()]
                    pos += p.numel()
        return rows

    # -- resetting rows --------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, table: str, rows: torch.Tensor) -> None:
        """Give ``rows`` of ``table`` their initial values again and zero their optimizer state, in every copy
        this rank holds (owned or replica); mark them updated for a delta checkpoint."""
        if rows.numel() == 0:
            return
        spec = self.specs[table]
        r = rows.cpu().numpy().astype(np.int64)
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
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every managed table's mapping (``ManagedIds.state_dict``: tensors only), on the host."""
        return {k: v.detach().cpu() for k, v in self.ids.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], where) -> None:
        """The mappings of a checkpoint (any world size wrote it: the mapping is the same on every rank)."""
        tables = sorted({k.split(".", 1)[0] for k in state})
        missing = sorted(set(self.specs) - set(tables))
        if missing:
            raise FormatError(f"{where}: the checkpoint has no id mapping for managed table(s) {missing} "
                              f"(it has {tables})")
        self.ids.load_state_dict(state)

    def counters(self) -> dict[str, dict[str, int]]:
        return self.ids.counters()


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
    return lookup


def managed_of(model: nn.Module) -> ManagedLookup | None:
    """The :class:`ManagedLookup` installed in ``model`` (``None``: no managed tables)."""
    return next((getattr(m, _ATTR) for m in model.modules() if isinstance(getattr(m, _ATTR, None), ManagedLookup)),
                None)
