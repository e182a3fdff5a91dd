"""DMT tower embeddings (Disaggregated Multi-Tower, Luo et al., MLSys 2024): the embedding executors of the
``dmt-dlrm`` / ``dmt-dcn`` models and of their flat model-parallel baseline.

Built by the one embedding builder, :func:`embedscale.models.builder.build_embedding`, when its
``EmbeddingEnv.towers`` holds a :class:`TowerSetup` (the towers resolved and their modules built by
``models.dmt``; this module imports nothing of ``models``). All executors return ``[B, sum_t O_t]``, towers in
order, for the local mini-batch:

* :class:`LocalTowerEmbedding`: every tower in one process (single-process training, the reference
  semantics, flops counting, the partitioner's quality runs);
* :class:`TowerEmbedding`: one rank's share of the tower transform (DMT 3.1, Figure 7): step a
  (ids all_to_all), step b (fused lookup of the rows it holds), steps c-e (peer permute, intra-tower
  all_to_all or reduce-scatter, shuffle), its tower group's tower modules, step f (peer all_to_all).
  With pass-through towers and ``model_order=True`` it is a drop-in embedding module for the plain
  DLRM/DCN (DMT Table 3's SPTT-DLRM);
* :class:`FlatTableWiseEmbedding`: the classic model-parallel baseline: ids all_to_all to table owners,
  owners pool, one all_to_all of pooled vectors back (DMT section 2.2, Figure 4).

Every table's rows start from ``embedding.init.uniform_rows`` of the table's index among all tables, whatever
rank holds them, so one process and any number of ranks start from the same tables.
Designed for GPUs (devices come from arguments), tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from embedscale.comm.hierarchical import TowerComm
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.tower_router import TowerRouter, to_model_order
from embedscale.errors import ConfigError
from embedscale.plan.forms import TableForm
from embedscale.plan.tower_placement import SHARDINGS, TowerLayout, TowerPlacement
from embedscale.plan.towers import TowerAssignment
from embedscale.specs import TableSpec, feature_to_table


def tower_forms(tables: list[TableSpec], assignment: TowerAssignment | None) -> dict[str, TableForm]:
    """Every table's form in a DMT model: ``tower`` with the first tower reading it (DMT 3.1; a table read by
    several towers is held by their tower group, which :class:`TowerEmbedding` checks is one); the flat
    baseline (``assignment`` ``None``) shards tables whole (form ``sharded``)."""
    if assignment is None:
        return {t.name: TableForm() for t in tables}
    tower_of: dict[str, int] = {}
    for g, fs in enumerate(assignment.towers):
        for f in fs:
            tower_of.setdefault(f, g)
    out = {}
    for t in tables:
        groups = [tower_of[f] for f in t.features if f in tower_of]
        if not groups:
            raise ConfigError(f"table {t.name!r}: none of its features {t.features} is in a tower")
        out[t.name] = TableForm("tower", tower=min(groups))
    return out


@dataclass
class TowerSetup:
    """What :func:`~embedscale.models.builder.build_embedding` builds a tower embedding from
    (``EmbeddingEnv.towers``); ``models.dmt.resolve_towers`` makes it from a model config.

    Args:
        assignment: features per tower (a ``plan.towers.TowerAssignment``); ``None`` for the flat baseline.
        modules: ``{tower: module}``, the tower modules (``models.tower_modules``: ``forward(embs [B, F, N]) ->
            [B, O]``, attributes ``num_features``, ``embedding_dim``, ``out_features``): every tower in one
            process, at least this rank's tower group's towers with ``comm``.
        tower_out_features: ``O_t`` of every tower (every rank needs them all for the peer all_to_all).
        comm: this rank's :class:`~embedscale.comm.hierarchical.TowerComm`; ``None``: all towers in one process.
        sharding, permute: in-tower sharding and permute of the tower transform (DMT 3.1.3, section 4).
        model_order: pass-through towers: the embedding of the plain DLRM/DCN, features in model order (one
            process: the fused lookup itself; several ranks: the tower transform alone, DMT Table 3's SPTT).
        flat: the classic table-wise baseline (DMT 2.2) on ``comm``'s world instead of towers.
        placement: the flat baseline's table owners (default: balanced over the world).
    """

    assignment: TowerAssignment | None = None
    modules: dict = field(default_factory=dict)
    tower_out_features: Sequence[int] = ()
    comm: TowerComm | None = None
    sharding: str = "table"
    permute: str = "auto"
    model_order: bool = False
    flat: bool = False
    placement: TowerPlacement | None = None

    def __post_init__(self) -> None:
        if self.flat:
            if self.comm is None:
                raise ConfigError("TowerSetup: the flat table-wise baseline runs on several ranks (needs comm)")
            return
        if self.assignment is None:
            raise ConfigError("TowerSetup: a tower embedding needs the feature-to-tower assignment")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"TowerSetup: sharding {self.sharding!r} is not one of {', '.join(SHARDINGS)}")
        if len(self.tower_out_features) != self.assignment.num_towers:
            raise ConfigError(f"TowerSetup: {len(self.tower_out_features)} tower widths for "
                              f"{self.assignment.num_towers} towers")


def tower_groups_of(num_towers: int, num_groups: int) -> list[int]:
    """Tower group of every tower: contiguous blocks, tower ``t`` to group ``t * P // T`` (T >= P)."""
    if num_towers < num_groups:
        raise ConfigError(f"{num_towers} towers for {num_groups} tower groups: use hosts_per_tower = "
                          f"hosts / towers so that every tower group holds at least one tower")
    return [t * num_groups // num_towers for t in range(num_towers)]


def tower_feature_index(assignment: TowerAssignment, features: list[str]) -> list[list[int]]:
    """Positions in ``features`` of every tower's features (a ``ConfigError`` unless the towers hold exactly
    ``features``)."""
    assignment.check_covers(features)
    pos = {f: i for i, f in enumerate(features)}
    return [[pos[f] for f in t] for t in assignment.towers]


class LocalTowerEmbedding(nn.Module):
    """All towers in one process: fused lookup of every table, then each tower's module.

    Args:
        tables: the tables (one shared dim N).
        assignment: features per tower.
        modules: ``{tower: module}`` for every tower (see :class:`TowerSetup`).
        init: ``init(spec, weight)`` filling a table's rows (``models.builder.hash_init``: placement-independent).
        optimizer, lr, eps: the fused sparse optimizer (``LocalEmbeddingBags``).
        device: where the tables live.
    """

    def __init__(self, tables: list[TableSpec], assignment: TowerAssignment, modules: dict[int, nn.Module], *,
                 init: Callable[[TableSpec, torch.Tensor], None], optimizer: str | None = "rowwise_adagrad",
                 lr: float = 0.05, eps: float = 1e-8, device: torch.device | str | None = None):
        super().__init__()
        self.embedding = LocalEmbeddingBags(tables, device=device, optimizer=optimizer, lr=lr, eps=eps, init=init)
        self.feature_names = list(self.embedding.feature_names)
        self.dim = tables[0].dim
        self.assignment = assignment
        idx = tower_feature_index(assignment, self.feature_names)
        for t, ix in enumerate(idx):
            self.register_buffer(f"_tower{t}", torch.tensor(ix, dtype=torch.int64, device=device), persistent=False)
        self.towers = nn.ModuleList([modules[t] for t in range(assignment.num_towers)])
        self.out_features = sum(m.out_features for m in self.towers)

    def pooled(self, features: JaggedFeatures) -> torch.Tensor:
        """``[B, F N]`` pooled embeddings in ``feature_names`` order (for the partitioner)."""
        return self.embedding(features)

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        B = features.batch_size
        e = self.embedding(features).view(B, len(self.feature_names), self.dim)
        outs = [tm(e.index_select(1, getattr(self, f"_tower{t}"))) for t, tm in enumerate(self.towers)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class TowerEmbedding(nn.Module):
    """One rank's part of the tower-transformed lookup (DMT 3.1, Figure 7) with its tower group's modules.

    Args:
        tables: all tables of the model (one shared dim N).
        assignment: features per tower.
        modules: ``{tower: module}`` for the towers of this rank's tower group (at least; see :class:`TowerSetup`).
        comm: this rank's :class:`TowerComm`.
        tower_out_features: ``O_t`` of every tower (all towers: every rank must know the widths of the
            peer all_to_all).
        sharding, permute: see :class:`~embedscale.embedding.tower_router.TowerRouter` / ``TowerPlacement``.
        optimizer, lr, eps, device: the fused lookup of the rows this rank holds.
        seed: the rows' placement-independent initialisation (:func:`shard_init`).
        model_order: pass-through towers only: return the features in model order (a drop-in embedding
            module for DLRM/DCN, bitwise the flat model's).
    """

    def __init__(self, tables: list[TableSpec], assignment: TowerAssignment, modules: dict[int, nn.Module],
                 comm: TowerComm, tower_out_features: Sequence[int], *, sharding: str = "table",
                 permute: str = "auto", optimizer: str = "rowwise_adagrad", lr: float = 0.05, eps: float = 1e-8,
                 seed: int = 0, device: torch.device | str | None = None, model_order: bool = False):
        super().__init__()
        if optimizer is None:
            raise ConfigError("TowerEmbedding needs a fused sparse optimizer (sgd or rowwise_adagrad)")
        layout: TowerLayout = comm.layout
        features = [f for t in tables for f in t.features]
        tower_idx = tower_feature_index(assignment, features)
        T, P = assignment.num_towers, layout.num_groups
        self.tower_group = tower_groups_of(T, P)
        f2t = feature_to_table(tables)
        table_group = [-1] * len(tables)
        for t, ix in enumerate(tower_idx):
            for f in ix:
                ti = f2t[features[f]]
                if table_group[ti] not in (-1, self.tower_group[t]):
                    raise ConfigError(f"table {tables[ti].name!r} is read by features in towers of different tower "
                                      f"groups (feature {features[f]!r} in tower {t}); keep a table's features in "
                                      "one tower group")
                table_group[ti] = self.tower_group[t]
        self.placement = TowerPlacement(tables, table_group, layout, sharding)
        self.router = TowerRouter(self.placement, comm, permute)
        self.comm = comm
        self.rank = comm.rank
        self.assignment = assignment
        self.dim = self.placement.dim
        self.feature_names = features
        shards = self.placement.shard_tables(self.rank)
        self.embedding = LocalEmbeddingBags(shards, device=device, optimizer=optimizer, lr=lr, eps=eps,
                                            init=shard_init(self.placement, self.rank, seed)) if shards else None
        self._device = device
        g = layout.group_of(self.rank)
        self.group = g
        group_pos = {f: i for i, f in enumerate(self.placement.group_features[g])}
        self.my_towers = [t for t in range(T) if self.tower_group[t] == g]
        missing = [t for t in self.my_towers if t not in modules]
        if missing:
            raise ConfigError(f"rank {self.rank} (tower group {g}): no module for towers {missing}")
        self.towers = nn.ModuleDict({str(t): modules[t] for t in self.my_towers})
        for t in self.my_towers:
            self.register_buffer(f"_tower{t}", torch.tensor([group_pos[f] for f in tower_idx[t]], dtype=torch.int64,
                                                            device=device), persistent=False)
        self.tower_out_features = [int(o) for o in tower_out_features]
        self.group_widths = [sum(self.tower_out_features[t] for t in range(T) if self.tower_group[t] == q)
                             for q in range(P)]
        self.out_features = sum(self.tower_out_features)
        self.model_order = model_order
        if model_order:
            if not all(getattr(m, "out_features", None) == m.num_features * m.embedding_dim
                       and not list(m.parameters()) for m in self.towers.values()):
                raise ConfigError("model_order=True needs pass-through towers")
            self._model_perm = [f for t in range(T) for f in tower_idx[t]]

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        routed = self.router.route_ids(features)  # step a
        dev = features.values.device
        pooled = self.embedding(routed.features) if routed.features is not None else None  # step b
        x = self.router.to_tower(pooled, routed, dev)  # steps c, d, e
        M = x.shape[0]
        x3 = x.view(M, -1, self.dim)
        ys = [self.towers[str(t)](x3.index_select(1, getattr(self, f"_tower{t}"))) for t in self.my_towers]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        out = self.router.from_tower(y, routed.sizes, self.group_widths)  # step f
        if self.model_order:
            out = to_model_order(out, self._model_perm, self.dim)
        return out


class FlatTableWiseEmbedding(nn.Module):
    """The classic model-parallel lookup (DMT 2.2, Figure 4): ids all_to_all to table owners, owners pool
    the global batch, one all_to_all of pooled vectors back. Output ``[B, F N]`` in model order.

    Args:
        tables: all tables.
        comm: the rank's :class:`TowerComm` (only its world transport is used).
        placement: which rank owns which table; default: table-wise over all ranks, balanced by pooled
            output per sample, then rows (``TowerPlacement`` with one group of the whole world).
        optimizer, lr, eps, seed, device: as :class:`TowerEmbedding`.
    """

    def __init__(self, tables: list[TableSpec], comm: TowerComm, placement: TowerPlacement | None = None, *,
                 optimizer: str = "rowwise_adagrad", lr: float = 0.05, eps: float = 1e-8, seed: int = 0,
                 device: torch.device | str | None = None):
        super().__init__()
        lay = comm.layout
        if placement is None:
            flat = TowerLayout(lay.world_size, lay.ranks_per_host, lay.num_hosts)
            placement = TowerPlacement(tables, [0] * len(tables), flat, "table")
        if placement.sharding != "table":
            raise ConfigError("the flat baseline is table-wise")
        self.placement = placement
        self.router = TowerRouter(placement, comm, "embeddings")
        self.comm = comm
        self.rank = comm.rank
        self.dim = placement.dim
        self.feature_names = placement.feature_names
        shards = placement.shard_tables(self.rank)
        self.embedding = LocalEmbeddingBags(shards, device=device, optimizer=optimizer, lr=lr, eps=eps,
                                            init=shard_init(placement, self.rank, seed)) if shards else None

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        routed = self.router.route_ids(features)
        pooled = self.embedding(routed.features) if routed.features is not None else None
        return self.router.flat_return(pooled, routed, features.values.device)


def shard_init(placement: TowerPlacement, rank: int, seed: int = 0) -> Callable[[TableSpec, torch.Tensor], None]:
    """An ``init(spec, weight_view)`` for ``LocalEmbeddingBags`` that fills every shard ``rank`` stores under
    ``placement`` with the placement-independent rows of ``embedding.init.uniform_rows`` (table index, global
    row id)."""
    shards = zip(placement.shard_tables(rank), placement.rank_tables[rank])
    by_name = {s.name: (i, lo, hi) for s, (i, lo, hi) in shards}

    def init(spec: TableSpec, weight: torch.Tensor) -> None:
        i, lo, hi = by_name[spec.name]
        t = placement.tables[i]
        if hi > lo:
            rows = uniform_rows(seed, i, np.arange(lo, hi), t.dim, t.num_rows)
            weight[: hi - lo].copy_(torch.from_numpy(rows).to(weight))
        if weight.shape[0] > hi - lo:
            weight[hi - lo:].zero_()

    return init
