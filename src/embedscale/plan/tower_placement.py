"""Where the tables of a DMT model live (DMT section 3.1, section 4): the tower layout of ranks, hosts and tower
groups (:class:`TowerLayout`) and which member of which tower group holds which rows of every table
(:class:`TowerPlacement`), the tower form's placement. numpy only: the executor
(:mod:`embedscale.embedding.tower_router`, :mod:`embedscale.embedding.towers`) and the process groups
(:mod:`embedscale.comm.hierarchical`) read it.

Vocabulary (DMT 3.1.1). ``G`` ranks, ``L`` per host. A *tower group* is a set of ``S = K * L``
consecutive ranks on ``K`` hosts (DMT 3.1.3: "a tower can be assigned to a set of K hosts"; K = 1 is
the paper's main case). There are ``P = G / S`` tower groups. The *peers* of rank ``g`` are the ranks
``g'`` with ``g % S == g' % S`` (one per tower group), and the *peer order* sorts all ranks by
``(g % S, g // S)`` (DMT writes the key as ``(g % T, g // L)`` for its 2 x 2 example; both give
``(0, 2, 1, 3)`` there). Each tower group holds the tables of its features, table-wise or row-wise
over its ``S`` members.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from embedscale.errors import ConfigError
from embedscale.specs import TableSpec, Topology, feature_to_table

SHARDINGS = ("table", "row")


# --------------------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class TowerLayout:
    """Ranks, hosts and tower groups (DMT 3.1.1 and 3.1.3).

    Args:
        world_size: G, all ranks.
        ranks_per_host: L.
        hosts_per_tower: K, hosts of one tower group (DMT 3.1.3: "a tower can be assigned to a set of K
            hosts instead of 1"); the number of hosts must be a multiple of K.

    Example::

        >>> layout = TowerLayout(world_size=4, ranks_per_host=2)
        >>> layout.num_groups, layout.group_size, layout.peer_order()
        (2, 2, [0, 2, 1, 3])
    """

    world_size: int
    ranks_per_host: int
    hosts_per_tower: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_host", "hosts_per_tower"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"tower layout: {name} must be a positive integer, got {v!r}")
        if self.world_size % self.ranks_per_host:
            raise ConfigError(f"tower layout: world size {self.world_size} is not a multiple of "
                              f"{self.ranks_per_host} ranks per host")
        if self.num_hosts % self.hosts_per_tower:
            raise ConfigError(f"tower layout: {self.num_hosts} hosts cannot form towers of {self.hosts_per_tower} "
                              "hosts each (DMT 3.1.3 needs G % K == 0)")

    @classmethod
    def from_topology(cls, topology: Topology, hosts_per_tower: int = 1) -> "TowerLayout":
        return cls(topology.world_size, topology.ranks_per_host, hosts_per_tower)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    @property
    def group_size(self) -> int:
        """S = K * L ranks per tower group."""
        return self.ranks_per_host * self.hosts_per_tower

    @property
    def num_groups(self) -> int:
        """P = G / S tower groups: the world size of every peer all_to_all (step f)."""
        return self.world_size // self.group_size

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def local_index(self, rank: int) -> int:
        return rank % self.group_size

    def group_ranks(self, group: int) -> list[int]:
        S = self.group_size
        return list(range(group * S, (group + 1) * S))

    def peer_ranks(self, rank: int) -> list[int]:
        """The peers of ``rank`` (itself included), one per tower group, in group order."""
        j, S = rank % self.group_size, self.group_size
        return [q * S + j for q in range(self.num_groups)]

    def peer_order(self) -> list[int]:
        """All ranks sorted by ``(rank % S, rank // S)`` (DMT 3.1.1)."""
        return sorted(range(self.world_size), key=lambda g: (g % self.group_size, g // self.group_size))


# --------------------------------------------------------------------------------------------------
# placement


class TowerPlacement:
    """Which member of which tower group holds which rows of every table.

    Args:
        tables: the model's tables (one shared ``dim``); features in table order are the model order.
        table_group: tower group of every table (all features of a table go to one tower group).
        layout: the tower layout.
        sharding: ``"table"`` (each table whole on one member, balanced by pooled output per sample, then
            rows: DMT section 4 "placement of embedding tables within a tower to individual GPUs") or
            ``"row"`` (every table split into ``S`` contiguous row ranges, one per member; DMT 3.1.3).
        owners: table-wise only: the member index (0..S-1) of every table, overriding the balance.

    Attributes:
        feature_names: all features, model order.
        group_features: per tower group, model indices of its features in *group order* (the order of
            the columns after step e).
        rank_features: per rank, model indices of the features its lookup pools, in output order.
    """

    def __init__(self, tables: list[TableSpec], table_group: Sequence[int], layout: TowerLayout,
                 sharding: str = "table", owners: Sequence[int] | None = None):
        if sharding not in SHARDINGS:
            raise ConfigError(f"tower placement: sharding {sharding!r} is not one of {SHARDINGS}")
        if not tables:
            raise ConfigError("tower placement: no tables")
        feature_to_table(tables)
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ConfigError(f"tower placement: tables have dims {sorted(dims)}; towers need one shared dim")
        for t in tables:
            if t.pooling == "none":
                raise ConfigError(f"table {t.name!r}: pooling 'none' cannot feed a tower (pooled vectors only)")
        table_group = [int(g) for g in table_group]
        if len(table_group) != len(tables):
            raise ConfigError(f"tower placement: {len(table_group)} tower groups for {len(tables)} tables")
        P, S = layout.num_groups, layout.group_size
        for t, g in zip(tables, table_group):
            if not 0 <= g < P:
                raise ConfigError(f"table {t.name!r}: tower group {g} outside [0, {P})")
        self.tables = list(tables)
        self.layout = layout
        self.sharding = sharding
        self.dim = dims.pop()
        self.table_group = np.array(table_group, dtype=np.int64)
        self.feature_names = [f for t in tables for f in t.features]
        self.feature_table = np.array([i for i, t in enumerate(tables) for _ in t.features], dtype=np.int64)
        table_features = []
        k = 0
        for t in tables:
            table_features.append(list(range(k, k + len(t.features))))
            k += len(t.features)
        # member of every table (table-wise) or row bounds per member (row-wise)
        self.owner = np.full(len(tables), -1, dtype=np.int64)
        self.bounds = np.zeros((len(tables), S + 1), dtype=np.int64)
        for g in range(P):
            mine = [i for i in range(len(tables)) if table_group[i] == g]
            if sharding == "row":
                for i in mine:
                    n = tables[i].num_rows
                    self.bounds[i] = (np.arange(S + 1) * n) // S
                continue
            if owners is not None:
                for i in mine:
                    o = int(owners[i])
                    if not 0 <= o < S:
                        raise ConfigError(f"table {tables[i].name!r}: owner member {o} outside [0, {S})")
                    self.owner[i] = o
            else:
                load = np.zeros(S)
                rows = np.zeros(S)
                for i in sorted(mine, key=lambda i: (-len(tables[i].features) * tables[i].dim, -tables[i].num_rows, i)):
                    o = min(range(S), key=lambda m: (load[m], rows[m], m))
                    self.owner[i] = o
                    load[o] += len(tables[i].features) * tables[i].dim
                    rows[o] += tables[i].num_rows
            for i in mine:
                o = self.owner[i]
                self.bounds[i, : o + 1] = 0
                self.bounds[i, o + 1:] = tables[i].num_rows
        # rank -> its tables (with row ranges) and features
        self.rank_tables: list[list[tuple[int, int, int]]] = []
        self.rank_features: list[list[int]] = []
        for r in range(layout.world_size):
            g, m = layout.group_of(r), layout.local_index(r)
            ts = [i for i in range(len(tables)) if table_group[i] == g
                  and (sharding == "row" or self.owner[i] == m)]
            self.rank_tables.append([(i, int(self.bounds[i, m]), int(self.bounds[i, m + 1])) for i in ts])
            self.rank_features.append([f for i in ts for f in table_features[i]])
        self.group_features: list[list[int]] = []
        for g in range(P):
            if sharding == "row":
                self.group_features.append(self.rank_features[g * S])
            else:
                self.group_features.append([f for r in layout.group_ranks(g) for f in self.rank_features[r]])
        self.feature_group = np.empty(len(self.feature_names), dtype=np.int64)
        for g, fs in enumerate(self.group_features):
            self.feature_group[fs] = g

    def shard_tables(self, rank: int) -> list[TableSpec]:
        """The table shards ``rank`` stores, as ``TableSpec``s for its local embedding module.

        Table-wise: the tables themselves. Row-wise: ``name[lo:hi]`` with ``hi - lo`` rows (at least one:
        a member with an empty range keeps one unused row) and ``sum`` pooling (mean pooling and
        per-sample weights arrive folded into the per-value weights, see ``TowerRouter.route_ids``).
        """
        out = []
        for i, lo, hi in self.rank_tables[rank]:
            t = self.tables[i]
            if self.sharding == "table":
                out.append(t)
            else:
                out.append(TableSpec(f"{t.name}[{lo}:{hi}]", max(hi - lo, 1), t.dim, features=list(t.features),
                                     pooling="sum", bytes_per_value=t.bytes_per_value))
        return out
