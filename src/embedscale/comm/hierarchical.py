"""The process groups and byte-counting transports of DMT's tower transform (SPTT, DMT section 3.1, Figure 7).

This module owns the *communication* side of a tower-partitioned lookup: the process groups of towers and
peer sets (:class:`TowerComm`) and their transports, which count bytes by host (:class:`HostAwareTransport`).
Where rows live is the plan's (:class:`~embedscale.plan.tower_placement.TowerPlacement`, with the vocabulary of
ranks, hosts, tower groups and peers); the routing steps of Figure 7 are
:class:`~embedscale.embedding.tower_router.TowerRouter`'s.

Byte accounting: :class:`HostAwareTransport` counts the payload bytes of every exchange by kind and by
whether the peer is on this rank's host or another host. Its optional :class:`LinkModel` injects slower
links: after an exchange it sleeps for the modelled transfer time of this rank's cross-host bytes (and,
optionally, intra-host bytes) at the given rates (a documented bandwidth model for one machine, where
every "host" is a group of local processes); an exchange started in the background waits, when waited for,
until that time has passed since its start (the link works while the caller computes). With one rank per
host it is a simulated network link per rank: any run's transport wrapped in it (``benchmarks/bench_online.py
--link-gbit``) pays its busiest rank's bytes in wall time, not CPU.

Designed for GPUs with NCCL (every tensor stays on the device of its input), tested on CPU with gloo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.distributed as dist

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.transport import PendingExchange, Transport
from embedscale.errors import ConfigError
from embedscale.plan.tower_placement import TowerLayout
from embedscale.specs import Topology


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


def link_topology(topology: Topology, link_gbit_s: float, mode: str = "training") -> Topology:
    """``topology`` as the plan cost model (OPER 3.2, ``plan.cost``) sees ranks that each have their own network
    link of ``link_gbit_s`` Gbit/s (one rank per host, as :class:`LinkModel` models it); 0: ``topology`` as it is.

    Every link between ranks and the replicas' AllReduce run at that rate. The model charges a rank for what it
    fetches (eqs. 3-4), not for what it serves; a rank's lookup (eq. 2: every row it serves, to itself and to
    the others) is therefore charged at the link's rate too, halved in training (a served row crosses the
    server's link twice: the row or its pooled sum out, its gradient back, the fetching side's factor 2 of
    eq. 4). So a plan that puts the hot rows on one rank costs that rank's link, as the wall clock pays it.
    """
    if not link_gbit_s >= 0:
        raise ConfigError(f"link model: link_gbit_s must be >= 0, got {link_gbit_s}")
    if link_gbit_s == 0:
        return topology
    gbs = link_gbit_s / 8.0
    return replace(topology, intra_host_bw=gbs, inter_host_bw=gbs, allreduce_bw=gbs,
                   local_bw=gbs / 2 if mode == "training" else gbs)


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

    @property
    def fuses_exchanges(self) -> bool:
        return self.inner.fuses_exchanges  # the executor takes the inner transport's path, link or not

    def exchange(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                 kind: str = "data") -> list[torch.Tensor]:
        recv = self.inner.exchange(send, recv_counts, kind)
        self._sleep(self._charge(send, recv, kind))
        return recv

    def exchange_start(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                       kind: str = "data") -> PendingExchange:
        """The inner exchange started in the background; ``wait()`` returns once the link's modelled time since
        the start has passed (the link moves the bytes while the caller computes)."""
        t0 = time.perf_counter()
        pending = self.inner.exchange_start(send, recv_counts, kind)

        def finish() -> list[torch.Tensor]:
            recv = pending.wait()
            self._sleep(self._charge(send, recv, kind) - (time.perf_counter() - t0))
            return recv
        return PendingExchange(finish=finish)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The inner transport's count swap, charged to the link as one exchange of ``meta`` bytes."""
        got = self.inner.exchange_counts(counts)
        rows = [counts[p:p + 1] for p in range(self.world_size)]
        self._sleep(self._charge(rows, [got[p:p + 1] for p in range(self.world_size)], "meta"))
        return got

    @staticmethod
    def _sleep(seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def _charge(self, send: list[torch.Tensor], recv: list[torch.Tensor], kind: str) -> float:
        """Count one exchange's bytes to other ranks by host and return its modelled seconds on the link (0
        without a link), added to ``modelled_seconds``."""
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
        delay = self.link.seconds(sc, rc, max(ic, irc)) if self.link is not None else 0.0
        self.modelled_seconds += delay
        return delay

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
