"""DMT's semantic-preserving tower transform (SPTT, DMT section 3.1, Figure 7) and the flat all_to_all.

This module owns the *data movement* of a tower-partitioned embedding lookup: which rank holds which
rows (:class:`TowerPlacement`), the process groups of towers and peer sets (:class:`TowerComm`), and the
routing steps of Figure 7 (:class:`TowerRouter`). The lookup itself (step b) and the tower modules run by
the caller (``embedscale.models.dmt``), so the same routing serves any embedding module.

Vocabulary (DMT 3.1.1). ``G`` ranks, ``L`` per host. A *tower group* is a set of ``S = K * L``
consecutive ranks on ``K`` hosts (DMT 3.1.3: "a tower can be assigned to a set of K hosts"; K = 1 is
the paper's main case). There are ``P = G / S`` tower groups. The *peers* of rank ``g`` are the ranks
``g'`` with ``g % S == g' % S`` (one per tower group), and the *peer order* sorts all ranks by
``(g % S, g // S)`` (DMT writes the key as ``(g % T, g // L)`` for its 2 x 2 example; both give
``(0, 2, 1, 3)`` there). Each tower group holds the tables of its features, table-wise or row-wise
over its ``S`` members.

The steps, per iteration, for the local mini-batch of every rank (DMT Figure 7):

a. *sparse-input all_to_all* (world): every rank sends the ids of its samples to the ranks holding
   their rows (:meth:`TowerRouter.route_ids`);
b. *local lookup*: every rank pools the bags of the global batch for the rows it holds (caller);
c. *peer permute*: the pooled rows are reordered into peer order (:meth:`TowerRouter.to_tower`);
   DMT 3.1.3 "step b and step c can be swapped": ``permute="ids"`` reorders the (smaller) ids before
   the lookup instead, and step c vanishes;
d. *intra-tower all_to_all* (tower group; intra-host when K = 1): member ``i`` sends member ``j`` the
   pooled rows of ``j``'s peers; with row-wise shards inside the tower it is a *reduce-scatter* of
   partial sums (DMT 3.1.3, second specialisation);
e. *shuffle*: the pieces, ``(members' features) x (peers' samples)``, become ``[peers' samples, tower
   features, N]``: every rank now holds the whole tower's embeddings for all its peers' samples, the
   input of the tower modules (DMT 3.2, Figure 8);
f. *peer all_to_all* (peer set, world size ``P``): every rank sends each peer that peer's samples and
   receives from every tower the tower's output for its own samples (:meth:`TowerRouter.from_tower`).

The backward pass runs the same exchanges in reverse (autograd functions below). With pass-through
towers the result is exactly the flat all_to_all's (the classic model-parallel lookup: ids to table
owners, owners pool, one all_to_all of pooled vectors back, :meth:`TowerRouter.flat_return`), bit for
bit, because only the route differs (DMT Table 3). The fourth specialisation of DMT 3.1.3 (a virtual
process group already in peer order, which drops step c) is not implemented: step c is one gather.

Byte accounting: :class:`HostAwareTransport` counts the payload bytes of every exchange by kind and by
whether the peer is on this rank's host or another host. Its optional :class:`LinkModel` injects slower
links: after an exchange it sleeps for the modelled transfer time of this rank's cross-host bytes (and,
optionally, intra-host bytes) at the given rates (a documented bandwidth model for one machine, where
every "host" is a group of local processes).

Designed for GPUs with NCCL (every tensor stays on the device of its input), tested on CPU with gloo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.transport import Transport
from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec, Topology, feature_to_table
from embedscale.embedding.init import uniform_rows

SHARDINGS = ("table", "row")
PERMUTES = ("embeddings", "ids", "auto")


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
# byte counting and the injected link


@dataclass(frozen=True)
class LinkModel:
    """Injected links: ``cross_host_gbit_s`` Gbit/s per rank across hosts, optionally
    ``intra_host_gbit_s`` inside a host (0 = not modelled), plus a latency per exchange that moves bytes.

    The modelled time of an exchange is ``latency + max(cross * 8 / cross rate, intra * 8 / intra rate)``
    where ``cross`` and ``intra`` are this rank's bytes on each kind of link, the larger of sent and
    received (full-duplex links per rank, as the per-GPU NICs and NVLink of DMT Table 1; the two kinds
    of link work in parallel).
    """

    cross_host_gbit_s: float
    latency_us: float = 0.0
    intra_host_gbit_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.cross_host_gbit_s > 0:
            raise ConfigError(f"link model: cross_host_gbit_s must be positive, got {self.cross_host_gbit_s}")
        if self.intra_host_gbit_s < 0:
            raise ConfigError(f"link model: intra_host_gbit_s must be >= 0, got {self.intra_host_gbit_s}")

    def seconds(self, sent_bytes: int, recv_bytes: int, intra_bytes: int = 0) -> float:
        intra = intra_bytes * 8.0 / (self.intra_host_gbit_s * 1e9) if self.intra_host_gbit_s > 0 else 0.0
        cross = max(sent_bytes, recv_bytes) * 8.0 / (self.cross_host_gbit_s * 1e9)
        if cross == 0.0 and intra == 0.0:
            return 0.0
        return self.latency_us * 1e-6 + max(cross, intra)


class HostAwareTransport(Transport):
    """A group's transport that knows which members share this rank's host.

    Counts, per ``kind``, the payload bytes this rank sends to members on its own host
    (``intra_bytes``) and on other hosts (``cross_bytes``; received bytes in ``cross_recv_bytes``), and
    with a :class:`LinkModel` sleeps for the modelled time of the cross-host part after every exchange.

    Args:
        inner: the transport over the group (group-local ranks).
        members: global rank of every group member, in group-rank order.
        ranks_per_host: L, to tell hosts apart.
        link: the injected cross-host link, or ``None`` (count only).
    """

    name = "host-aware"

    def __init__(self, inner: Transport, members: Sequence[int], ranks_per_host: int, link: LinkModel | None = None):
        super().__init__(inner.rank, inner.world_size)
        if len(members) != inner.world_size:
            raise ConfigError(f"host-aware transport: {len(members)} members for a group of {inner.world_size}")
        self.inner = inner
        self.counter = inner.counter
        self.members = list(members)
        me = self.members[inner.rank] // ranks_per_host
        self.cross = [m // ranks_per_host != me for m in self.members]
        self.link = link
        self.num_hosts = len({m // ranks_per_host for m in self.members})
        self.reset_bytes()

    @property
    def wire_device(self):
        return self.inner.wire_device  # the inner transport's backend moves the bytes

    def reset_bytes(self) -> None:
        self.cross_bytes: dict[str, int] = {}
        self.cross_recv_bytes: dict[str, int] = {}
        self.intra_bytes: dict[str, int] = {}
        self.modelled_seconds = 0.0

    def exchange(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                 kind: str = "data") -> list[torch.Tensor]:
        recv = self.inner.exchange(send, recv_counts, kind)
        sc = rc = ic = irc = 0
        for p in range(self.world_size):
            if p == self.rank:
                continue
            s = send[p].numel() * send[p].element_size()
            r = recv[p].numel() * recv[p].element_size()
            if self.cross[p]:
                sc += s
                rc += r
            else:
                ic += s
                irc += r
        self.cross_bytes[kind] = self.cross_bytes.get(kind, 0) + sc
        self.cross_recv_bytes[kind] = self.cross_recv_bytes.get(kind, 0) + rc
        self.intra_bytes[kind] = self.intra_bytes.get(kind, 0) + ic
        if self.link is not None:
            delay = self.link.seconds(sc, rc, max(ic, irc))
            if delay > 0:
                self.modelled_seconds += delay
                time.sleep(delay)
        return recv

    def allreduce_sum_(self, tensor: torch.Tensor, group, kind: str = "dense_grads") -> torch.Tensor:
        """Sum ``tensor`` over the group in place, counting the cross-host bytes of a hierarchical ring.

        The modelled algorithm is NCCL's for multi-host groups: reduce-scatter inside each host, a ring
        AllReduce of one ``1/l`` shard per rank across the ``h`` hosts, all-gather inside each host; a
        rank sends ``2 (h - 1) / h * bytes / l`` across hosts (0 when the group is on one host).
        """
        if self.world_size > 1:
            dist.all_reduce(tensor, group=group)
        hosts = self.num_hosts
        per_host = self.world_size / hosts
        nbytes = tensor.numel() * tensor.element_size()
        cross = int(round(2 * (hosts - 1) / hosts * nbytes / per_host)) if hosts > 1 else 0
        per_rank_intra = 2 * (per_host - 1) / per_host * nbytes if per_host > 1 else 0  # reduce-scatter + all-gather
        intra = int(round(per_rank_intra))
        self.cross_bytes[kind] = self.cross_bytes.get(kind, 0) + cross
        self.cross_recv_bytes[kind] = self.cross_recv_bytes.get(kind, 0) + cross
        self.intra_bytes[kind] = self.intra_bytes.get(kind, 0) + intra
        if self.link is not None:
            delay = self.link.seconds(cross, cross, intra)
            if delay > 0:
                self.modelled_seconds += delay
                time.sleep(delay)
        return tensor


class TowerComm:
    """Process groups and transports of one rank for the tower transform (DMT 3.1.1).

    Creates, collectively on every rank of the default process group and in the same order, one group
    per tower group (``S`` ranks, on one host when K = 1) and one per peer set (``P`` ranks, one per tower
    group): "process groups per host and per peer set". Every transport is a
    :class:`HostAwareTransport` over a :class:`~embedscale.comm.collective.CollectiveTransport`.

    Attributes:
        world, tower, peer: the transports (world: step a and the flat all_to_all; tower: step d; peer:
            step f).
        world_group, tower_group, peer_group: the process groups (``None`` is the default group).
    """

    def __init__(self, layout: TowerLayout, link: LinkModel | None = None):
        if not dist.is_initialized():
            raise ConfigError("TowerComm needs an initialised default process group (torch.distributed)")
        if dist.get_world_size() != layout.world_size:
            raise ConfigError(f"TowerComm: layout for {layout.world_size} ranks, the process group has "
                              f"{dist.get_world_size()}")
        self.layout = layout
        self.rank = dist.get_rank()
        L = layout.ranks_per_host
        self.tower_group = self.peer_group = None
        for g in range(layout.num_groups):  # every rank creates every group, in the same order
            pg = dist.new_group(layout.group_ranks(g))
            if g == layout.group_of(self.rank):
                self.tower_group = pg
        for j in range(layout.group_size):
            ranks = [q * layout.group_size + j for q in range(layout.num_groups)]
            pg = dist.new_group(ranks)
            if j == layout.local_index(self.rank):
                self.peer_group = pg
        self.world_group = None
        self.world = HostAwareTransport(CollectiveTransport(), list(range(layout.world_size)), L, link)
        self.tower = HostAwareTransport(
            CollectiveTransport(layout.local_index(self.rank), layout.group_size, self.tower_group),
            layout.group_ranks(layout.group_of(self.rank)), L, link)
        self.peer = HostAwareTransport(
            CollectiveTransport(layout.group_of(self.rank), layout.num_groups, self.peer_group),
            layout.peer_ranks(self.rank), L, link)

    @property
    def transports(self) -> dict[str, HostAwareTransport]:
        return {"world": self.world, "tower": self.tower, "peer": self.peer}

    def reset_bytes(self) -> None:
        for t in self.transports.values():
            t.reset_bytes()
            t.counter.reset()

    def bytes_report(self) -> dict:
        """``{"cross": {kind: bytes}, "intra": {...}, "modelled_seconds": s}`` summed over the transports."""
        cross: dict[str, int] = {}
        intra: dict[str, int] = {}
        secs = 0.0
        for t in self.transports.values():
            for k, v in t.cross_bytes.items():
                cross[k] = cross.get(k, 0) + v
            for k, v in t.intra_bytes.items():
                intra[k] = intra.get(k, 0) + v
            secs += t.modelled_seconds
        return {"cross": cross, "intra": intra, "modelled_seconds": secs}


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

    def shard_init(self, rank: int, seed: int = 0):
        """An ``init(spec, weight_view)`` for ``LocalEmbeddingBags`` that fills every shard with the
        placement-independent rows of ``embedding.init.uniform_rows`` (table index, global row id)."""
        by_name = {s.name: (i, lo, hi) for s, (i, lo, hi) in zip(self.shard_tables(rank), self.rank_tables[rank])}

        def init(spec: TableSpec, weight: torch.Tensor) -> None:
            i, lo, hi = by_name[spec.name]
            t = self.tables[i]
            if hi > lo:
                rows = uniform_rows(seed, i, np.arange(lo, hi), t.dim, t.num_rows)
                weight[: hi - lo].copy_(torch.from_numpy(rows).to(weight))
            if weight.shape[0] > hi - lo:
                weight[hi - lo:].zero_()

        return init


# --------------------------------------------------------------------------------------------------
# autograd exchanges


class _AllToAllV(torch.autograd.Function):
    """All-to-all of a 1-D tensor cut into ``send_counts`` pieces; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, transport: Transport, send_counts, recv_counts, kind):
        ctx.transport, ctx.send_counts, ctx.recv_counts, ctx.kind = transport, send_counts, recv_counts, kind
        recv = transport.exchange(list(torch.split(x, send_counts)), recv_counts=recv_counts, kind=kind)
        return torch.cat(recv)

    @staticmethod
    def backward(ctx, grad):
        back = ctx.transport.exchange(list(torch.split(grad.contiguous(), ctx.recv_counts)),
                                      recv_counts=ctx.send_counts, kind=ctx.kind + "_grad")
        return torch.cat(back), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Step d with row-wise shards (DMT 3.1.3): each member sums every member's partial pooled vectors
    of its peers' samples; backward is the all-gather of the gradients."""

    @staticmethod
    def forward(ctx, x, transport: Transport, send_counts, recv_count, kind):
        W = transport.world_size
        ctx.transport, ctx.send_counts, ctx.recv_count, ctx.kind = transport, send_counts, recv_count, kind
        recv = transport.exchange(list(torch.split(x, send_counts)), recv_counts=[recv_count] * W, kind=kind)
        out = recv[0].clone()
        for r in recv[1:]:  # member order: a fixed summation order on every rank
            out += r
        return out

    @staticmethod
    def backward(ctx, grad):
        W = ctx.transport.world_size
        g = grad.contiguous()
        back = ctx.transport.exchange([g] * W, recv_counts=ctx.send_counts, kind=ctx.kind + "_grad")
        return torch.cat(back), None, None, None, None


def _placeholder(rows: int, cols: int, device) -> torch.Tensor:
    """An empty-width lookup result for a rank that holds no rows. It requires grad (when autograd is
    on) so that the backward exchanges run on this rank too: every rank must join every collective."""
    return torch.zeros((rows, cols), device=device, requires_grad=torch.is_grad_enabled())


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    out_start = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - out_start, lengths, output_size=total) + \
        torch.arange(total, device=starts.device)


# --------------------------------------------------------------------------------------------------
# the router


@dataclass
class RoutedBatch:
    """What step a delivers to a rank: the global batch of its lookup features, and the bookkeeping."""

    features: JaggedFeatures | None  # lookup features x all ranks' samples (None: this rank holds no rows)
    sizes: list[int]  # local batch size of every rank
    peer_ordered: bool  # samples already in peer order (steps b and c swapped)


class TowerRouter:
    """Steps a, c, d, e, f of the tower transform, and the flat all_to_all, for one rank.

    Args:
        placement: the table placement (its layout gives the tower groups).
        comm: the rank's transports (:class:`TowerComm`, or any object with ``world``, ``tower``,
            ``peer`` transports and a ``rank``).
        permute: ``"embeddings"`` (step c on pooled rows, DMT's default order), ``"ids"`` (steps b and c
            swapped: the ids are put in peer order before the lookup) or ``"auto"`` (ids when the received
            ids are fewer bytes than the pooled rows; decided per rank, per batch).
    """

    def __init__(self, placement: TowerPlacement, comm, permute: str = "embeddings"):
        if permute not in PERMUTES:
            raise ConfigError(f"tower router: permute {permute!r} is not one of {PERMUTES}")
        self.placement = placement
        self.layout = layout = placement.layout
        self.comm = comm
        self.rank = comm.rank
        self.permute = permute
        W, S = layout.world_size, layout.group_size
        self.dim = placement.dim
        self.feature_names = placement.feature_names
        self._feature_index = {f: i for i, f in enumerate(self.feature_names)}
        F = len(self.feature_names)
        tabs = placement.tables
        ft = placement.feature_table
        self.my_features = placement.rank_features[self.rank]
        self.my_feature_names = [self.feature_names[f] for f in self.my_features]
        self.num_slots = [len(fs) for fs in placement.rank_features]
        self.max_slots = max(max(self.num_slots), 1)
        # per model feature: its group's first rank, slot (position in a holder's lookup), rows, bounds
        group_base = placement.feature_group * S
        slot = np.zeros(F, dtype=np.int64)
        dest = np.zeros(F, dtype=np.int64)
        for r in range(W):
            for pos, f in enumerate(placement.rank_features[r]):
                slot[f] = pos  # row-wise: the same position on every member
                if placement.sharding == "table":
                    dest[f] = r
        self._dest = torch.from_numpy(dest)
        self._group_base = torch.from_numpy(group_base)
        self._slot = torch.from_numpy(slot)
        self._rows = torch.tensor([tabs[t].num_rows for t in ft], dtype=torch.int64)
        self._bounds = torch.from_numpy(placement.bounds[ft])  # [F, S + 1]
        self._mean = torch.tensor([tabs[t].pooling == "mean" for t in ft])
        self._cache: dict = {}

    # -- helpers --------------------------------------------------------------------------------
    def _dev(self, t: torch.Tensor, device) -> torch.Tensor:
        key = (id(t), device)
        out = self._cache.get(key)
        if out is None:
            out = t.to(device)
            self._cache[key] = out
        return out

    def exchange_batch_sizes(self, batch_size: int, weighted: bool, device, bad: bool = False
                             ) -> tuple[list[int], bool, list[int]]:
        """Every rank's local batch size, whether any rank's batch has per-sample weights, and the ranks
        whose batch failed validation (so that a bad id is an error on every rank, not a hang)."""
        W = self.layout.world_size
        mine = torch.tensor([batch_size, int(weighted), int(bad)], dtype=torch.int64, device=device)
        got = self.comm.world.exchange([mine] * W, recv_counts=[3] * W, kind="meta")
        sizes = [int(g[0]) for g in got]
        return sizes, any(int(g[1]) for g in got), [r for r, g in enumerate(got) if int(g[2])]

    def peer_sources(self) -> list[int]:
        return self.layout.peer_order()

    # -- step a ---------------------------------------------------------------------------------
    def route_ids(self, features: JaggedFeatures) -> RoutedBatch:
        """Step a: send every id to the rank holding its row; assemble this rank's global batch.

        Accepts the model's features in any key order. Mean pooling and per-sample weights: table-wise,
        the holder pools whole bags itself (weights travel as they are); row-wise, each value carries
        ``weight / bag length`` for mean tables and shards pool ``sum``, so partial bags add up.
        """
        lay, pl = self.layout, self.placement
        W, S = lay.world_size, lay.group_size
        dev = features.values.device
        keys = features.keys
        unknown = [k for k in keys if k not in self._feature_index]
        missing = sorted(set(self.feature_names) - set(keys))
        if unknown or missing or len(keys) != len(self.feature_names):
            raise InputError(f"rank {self.rank}: tower routing got features {keys}; expected {self.feature_names}"
                             f" (unknown {unknown}, missing {missing})")
        B = features.batch_size
        Fin = len(keys)
        values, lengths = features.values, features.lengths
        n = values.numel()
        key_model = torch.tensor([self._feature_index[k] for k in keys], dtype=torch.int64, device=dev)
        bag = torch.repeat_interleave(torch.arange(Fin * B, device=dev), lengths, output_size=n)
        fv = key_model[bag // B] if n else bag
        b = bag % B
        rows = self._dev(self._rows, dev)
        message = None
        if n:
            bad = (values < 0) | (values >= rows[fv])
            if bool(bad.any()):
                i = int(torch.nonzero(bad)[0])
                f = int(fv[i])
                t = pl.tables[pl.feature_table[f]]
                message = (f"rank {self.rank}: feature {self.feature_names[f]!r} (table {t.name!r}, tower group "
                           f"{int(pl.feature_group[f])}): row id {int(values[i])} at sample {int(b[i])} is outside "
                           f"[0, {t.num_rows})")
        sizes, weighted, bad_ranks = self.exchange_batch_sizes(B, features.weights is not None, dev,
                                                               message is not None)
        if bad_ranks:
            raise InputError(message or f"rank {self.rank}: rank(s) {bad_ranks} got row ids outside their tables "
                                        "(their errors name the feature); no rank looked anything up")
        row_wise = pl.sharding == "row"
        use_weights = weighted or (row_wise and bool(self._mean.any()))
        slot = self._dev(self._slot, dev)[fv]
        if row_wise:
            bounds = self._dev(self._bounds, dev)[fv]  # [n, S + 1]
            member = (values.unsqueeze(1) >= bounds[:, 1:S]).sum(1)
            dest = self._dev(self._group_base, dev)[fv] + member
            local = values - bounds.gather(1, member.unsqueeze(1)).squeeze(1)
        else:
            dest = self._dev(self._dest, dev)[fv]
            local = values
        scale = None
        if use_weights:
            scale = features.weights.to(torch.float32) if features.weights is not None else \
                torch.ones(n, dtype=torch.float32, device=dev)
            if row_wise:
                mean = self._dev(self._mean, dev)[fv]
                if bool(mean.any()):
                    inv = 1.0 / lengths[bag].clamp(min=1).to(torch.float32)
                    scale = torch.where(mean, scale * inv, scale)
        M = self.max_slots
        key = (dest * M + slot) * B + b
        order = torch.argsort(key, stable=True)
        per_dest = torch.bincount(dest, minlength=W).tolist() if n else [0] * W
        counts = torch.bincount(key, minlength=W * M * B).view(W, M * B) if n else \
            torch.zeros((W, M * B), dtype=torch.int64, device=dev)
        send_len = [counts[d, : self.num_slots[d] * B] for d in range(W)]
        me = self.rank
        k = self.num_slots[me]
        recv_len = self.comm.world.exchange(send_len, recv_counts=[k * s for s in sizes], kind="ids")
        per_src = [int(x.sum()) for x in recv_len]
        recv_val = self.comm.world.exchange(list(torch.split(local[order], per_dest)), recv_counts=per_src,
                                            kind="ids")
        recv_w = None
        if use_weights:
            recv_w = self.comm.world.exchange(list(torch.split(scale[order], per_dest)), recv_counts=per_src,
                                              kind="ids")
        if k == 0:
            return RoutedBatch(None, sizes, False)
        peer = self.permute == "ids"
        if self.permute == "auto":  # steps b and c swapped when ids are the smaller object (DMT 3.1.3)
            id_bytes = sum(per_src) * (8 + (4 if use_weights else 0)) + k * sum(sizes) * 8
            peer = id_bytes < k * sum(sizes) * self.dim * 4
        src_order = lay.peer_order() if peer else list(range(W))
        L2 = [recv_len[s].view(k, sizes[s]) for s in range(W)]
        cnt = torch.stack([l.sum(1) for l in L2])  # [W, k] values per (source, slot)
        src_base = torch.cumsum(torch.tensor(per_src, device=dev), 0) - torch.tensor(per_src, device=dev)
        seg_start = src_base.unsqueeze(1) + (torch.cumsum(cnt, 1) - cnt)  # [W, k]
        so = torch.tensor(src_order, device=dev)
        idx = _ranges(seg_start[so].t().reshape(-1), cnt[so].t().reshape(-1))
        all_val = torch.cat(recv_val)[idx]
        all_w = torch.cat(recv_w)[idx] if recv_w is not None else None
        all_len = torch.cat([L2[s] for s in src_order], dim=1).reshape(-1)
        return RoutedBatch(JaggedFeatures(self.my_feature_names, all_val, all_len, all_w), sizes, peer)

    # -- steps c, d, e ----------------------------------------------------------------------------
    def to_tower(self, pooled: torch.Tensor | None, routed: RoutedBatch, device=None) -> torch.Tensor:
        """Steps c, d, e: this rank's pooled rows (global batch) -> ``[M, F_group * N]``, the whole
        tower's embeddings of the samples of this rank's peers, peers in group order, features in group
        order (``placement.group_features``)."""
        lay, pl = self.layout, self.placement
        S, P, N = lay.group_size, lay.num_groups, self.dim
        sizes = routed.sizes
        me_j = lay.local_index(self.rank)
        g = lay.group_of(self.rank)
        total = sum(sizes)
        width = len(self.my_features) * N
        if pooled is None:  # holds no rows; still part of every exchange, forward and backward
            pooled = _placeholder(total, width, device)
        dev = pooled.device
        if not routed.peer_ordered and P > 1 and S > 1:  # step c: peer permute
            order = lay.peer_order()
            starts = torch.tensor(np.cumsum([0] + sizes[:-1])[order], device=dev)
            pooled = pooled.index_select(0, _ranges(starts, torch.tensor([sizes[s] for s in order], device=dev)))
        M = [sum(sizes[q * S + j] for q in range(P)) for j in range(S)]
        x = pooled.reshape(-1)
        if pl.sharding == "row":  # step d as a reduce-scatter of partial sums
            out = _ReduceScatter.apply(x, self.comm.tower, [m * width for m in M], M[me_j] * width, "tower_a2a")
            return out.view(M[me_j], width)
        widths = [len(pl.rank_features[r]) * N for r in lay.group_ranks(g)]
        out = _AllToAllV.apply(x, self.comm.tower, [m * width for m in M], [M[me_j] * w for w in widths],
                               "tower_a2a")
        parts = torch.split(out, [M[me_j] * w for w in widths])
        # step e: (members' features) x (peers' samples) -> (peers' samples) x (tower features)
        return torch.cat([p.view(M[me_j], w) for p, w in zip(parts, widths)], dim=1)

    # -- step f -----------------------------------------------------------------------------------
    def from_tower(self, y: torch.Tensor, sizes: list[int], group_widths: Sequence[int]) -> torch.Tensor:
        """Step f: ``[M, O_g]`` tower outputs of this rank's peers' samples -> ``[B, sum_g O_g]``, this
        rank's samples with every tower group's output, groups in order."""
        lay = self.layout
        S, P = lay.group_size, lay.num_groups
        j = lay.local_index(self.rank)
        B = sizes[self.rank]
        O_me = y.shape[1]
        send = [sizes[q * S + j] * O_me for q in range(P)]
        recv = [B * int(w) for w in group_widths]
        out = _AllToAllV.apply(y.reshape(-1), self.comm.peer, send, recv, "peer_a2a")
        parts = torch.split(out, recv)
        return torch.cat([p.view(B, int(w)) for p, w in zip(parts, group_widths)], dim=1)

    def group_feature_order(self) -> list[int]:
        """Model indices of the features in the column order of ``from_tower`` with pass-through towers."""
        return [f for fs in self.placement.group_features for f in fs]

    # -- the flat baseline ------------------------------------------------------------------------
    def flat_return(self, pooled: torch.Tensor | None, routed: RoutedBatch, device=None) -> torch.Tensor:
        """The classic return path: one world all_to_all of pooled rows back to the samples' ranks.

        ``pooled`` rows in rank order (``permute="embeddings"``). Returns ``[B, F * N]`` in model order.
        """
        if routed.peer_ordered:
            raise ConfigError("flat_return needs the lookup in rank order (permute='embeddings')")
        lay, pl = self.layout, self.placement
        W, N = lay.world_size, self.dim
        sizes = routed.sizes
        B = sizes[self.rank]
        width = len(self.my_features) * N
        if pooled is None:
            pooled = _placeholder(sum(sizes), width, device)
        widths = [len(pl.rank_features[r]) * N for r in range(W)]
        out = _AllToAllV.apply(pooled.reshape(-1), self.comm.world, [s * width for s in sizes],
                               [B * w for w in widths], "flat_a2a")
        parts = torch.split(out, [B * w for w in widths])
        x = torch.cat([p.view(B, w) for p, w in zip(parts, widths)], dim=1)
        cat_order = [f for r in range(W) for f in pl.rank_features[r]]
        return to_model_order(x, cat_order, N)


def to_model_order(x: torch.Tensor, order: Sequence[int], dim: int) -> torch.Tensor:
    """Columns ``[B, F * dim]`` whose feature blocks are model features ``order`` -> model order."""
    order = list(order)
    if order == list(range(len(order))):
        return x
    inv = torch.empty(len(order), dtype=torch.int64)
    inv[torch.tensor(order)] = torch.arange(len(order))
    B = x.shape[0]
    return x.view(B, len(order), dim).index_select(1, inv.to(x.device)).reshape(B, len(order) * dim)
