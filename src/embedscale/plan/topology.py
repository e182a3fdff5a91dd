"""The planner's view of the machine: ranks, hosts, link classes and the per-byte cost matrix L.

OPER section 3.2 describes the hardware by one ``M x M`` matrix ``L``: ``L[i][j]`` is the cost for
rank ``i`` to fetch from rank ``j`` (the diagonal is the cost of a local lookup). We keep the two
figures a link is usually measured by, a bandwidth and a per-message latency, per link class
(same rank, same host, other host), and derive ``L`` from the bandwidths:

    L[i][j] = 1 / bandwidth[i][j]          microseconds per byte  (bandwidth in GB/s = 1e3 bytes/us)

so the per-embedding cost of equations (2) and (3) is ``S_k * L[i][j]`` for a row of ``S_k`` bytes.
The latency is charged once per link and iteration by the cost model (one message per peer), not per
embedding: a batched fetch of thousands of rows does not pay thousands of latencies.

``specs.Topology`` holds the link-class figures; ``LinkTopology`` adds what a measurement can add
(full ``M x M`` bandwidth and latency matrices) without changing the shared spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedscale.errors import ConfigError
from embedscale.io import read_yaml
from embedscale.specs import Topology
from embedscale.specs import from_dict

SAME_RANK, SAME_HOST, OTHER_HOST = 0, 1, 2
LINK_CLASS_NAMES = ("same_rank", "same_host", "other_host")


@dataclass
class LinkTopology:
    """Hosts x ranks per host with a bandwidth and latency for every ordered pair of ranks.

    Args:
        num_hosts: hosts.
        ranks_per_host: ranks on every host.
        memory_per_rank: bytes of embedding memory per rank; 0 = no limit beyond the extra-memory budget.
        bandwidth: ``M x M`` GB/s; ``bandwidth[i][j]`` is how fast rank ``i`` reads from rank ``j``
            (the diagonal is the local lookup bandwidth).
        latency_us: ``M x M`` microseconds per message (diagonal 0).
        allreduce_bw: bandwidth of the gradient AllReduce, GB/s (OPER eq. 5, ``BW_AR``).
        source: where the figures came from (``spec`` or ``measured``).

    Example:
        >>> t = LinkTopology.from_spec(Topology(num_hosts=2, ranks_per_host=2))
        >>> t.link_class()[0].tolist()
        [0, 1, 2, 2]
    """

    num_hosts: int
    ranks_per_host: int
    memory_per_rank: int
    bandwidth: np.ndarray
    latency_us: np.ndarray
    allreduce_bw: float
    source: str = "spec"
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        m = self.num_hosts * self.ranks_per_host
        if self.num_hosts < 1 or self.ranks_per_host < 1:
            raise ConfigError(
                f"topology: num_hosts and ranks_per_host must be >= 1, got {self.num_hosts} x {self.ranks_per_host}"
            )
        self.bandwidth = np.asarray(self.bandwidth, dtype=np.float64)
        self.latency_us = np.asarray(self.latency_us, dtype=np.float64)
        for name, arr in (("bandwidth", self.bandwidth), ("latency_us", self.latency_us)):
            if arr.shape != (m, m):
                raise ConfigError(f"topology: {name} must be {m} x {m} for {self.num_hosts} x {self.ranks_per_host} ranks, got {arr.shape}")
            if not np.all(np.isfinite(arr)):
                i, j = np.argwhere(~np.isfinite(arr))[0]
                raise ConfigError(f"topology: {name}[{i}][{j}] is {arr[i, j]}, not a finite number")
        if np.any(self.bandwidth <= 0):
            i, j = np.argwhere(self.bandwidth <= 0)[0]
            raise ConfigError(f"topology: bandwidth[{i}][{j}] = {self.bandwidth[i, j]} GB/s must be positive")
        if np.any(self.latency_us < 0):
            i, j = np.argwhere(self.latency_us < 0)[0]
            raise ConfigError(f"topology: latency_us[{i}][{j}] = {self.latency_us[i, j]} must be >= 0")
        if not self.allreduce_bw > 0:
            raise ConfigError(f"topology: allreduce_bw = {self.allreduce_bw} GB/s must be positive")
        if self.memory_per_rank < 0:
            raise ConfigError(f"topology: memory_per_rank = {self.memory_per_rank} must be >= 0 (0 = no limit)")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_spec(cls, topo: Topology) -> "LinkTopology":
        """Fill the matrices from the link-class figures of ``specs.Topology``."""
        m = topo.num_hosts * topo.ranks_per_host
        cls_ = _link_class(topo.num_hosts, topo.ranks_per_host)
        bw = np.choose(cls_, [topo.local_bw, topo.intra_host_bw, topo.inter_host_bw]).astype(np.float64)
        lat = np.choose(cls_, [0.0, topo.intra_host_latency_us, topo.inter_host_latency_us]).astype(np.float64)
        del m
        return cls(
            num_hosts=topo.num_hosts,
            ranks_per_host=topo.ranks_per_host,
            memory_per_rank=int(topo.memory_per_rank),
            bandwidth=bw,
            latency_us=lat,
            allreduce_bw=float(topo.allreduce_bw),
        )

    @classmethod
    def from_link_classes(
        cls,
        num_hosts: int,
        ranks_per_host: int,
        bandwidth: dict[str, float],
        latency_us: dict[str, float] | None = None,
        allreduce_bw: float = 100.0,
        memory_per_rank: int = 0,
        source: str = "spec",
    ) -> "LinkTopology":
        """Matrices from one bandwidth (and latency) per link class, keyed by ``LINK_CLASS_NAMES``."""
        latency_us = latency_us or {}
        for k in list(bandwidth) + list(latency_us):
            if k not in LINK_CLASS_NAMES:
                raise ConfigError(f"topology: unknown link class {k!r}; known: {', '.join(LINK_CLASS_NAMES)}")
        c = _link_class(num_hosts, ranks_per_host)
        bw = np.choose(c, [bandwidth.get(n, np.nan) for n in LINK_CLASS_NAMES])
        lat = np.choose(c, [latency_us.get(n, 0.0) for n in LINK_CLASS_NAMES])
        return cls(num_hosts, ranks_per_host, memory_per_rank, bw, lat, allreduce_bw, source=source)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_hosts": self.num_hosts,
            "ranks_per_host": self.ranks_per_host,
            "memory_per_rank": int(self.memory_per_rank),
            "bandwidth": self.bandwidth.tolist(),
            "latency_us": self.latency_us.tolist(),
            "allreduce_bw": self.allreduce_bw,
            "source": self.source,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LinkTopology":
        """Inverse of ``to_dict``; also accepts the fields of ``specs.Topology``."""
        if not isinstance(d, dict):
            raise ConfigError(f"topology: expected a mapping, got {type(d).__name__}")
        if "bandwidth" in d:
            known = {"num_hosts", "ranks_per_host", "memory_per_rank", "bandwidth", "latency_us", "allreduce_bw", "source", "notes"}
            unknown = sorted(set(d) - known)
            if unknown:
                raise ConfigError(f"topology: unknown key(s) {unknown}; known: {sorted(known)}")
            try:
                return cls(
                    num_hosts=int(d["num_hosts"]),
                    ranks_per_host=int(d["ranks_per_host"]),
                    memory_per_rank=int(d.get("memory_per_rank", 0)),
                    bandwidth=np.asarray(d["bandwidth"], dtype=np.float64),
                    latency_us=np.asarray(d.get("latency_us", np.zeros_like(np.asarray(d["bandwidth"]))), dtype=np.float64),
                    allreduce_bw=float(d.get("allreduce_bw", 100.0)),
                    source=str(d.get("source", "spec")),
                    notes=dict(d.get("notes", {})),
                )
            except KeyError as e:
                raise ConfigError(f"topology: missing key {e.args[0]!r}") from None
        return cls.from_spec(from_dict(Topology, d, "topology"))

    # ------------------------------------------------------------------ queries

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def host_of(self, rank: int | np.ndarray):
        return np.asarray(rank) // self.ranks_per_host

    def link_class(self) -> np.ndarray:
        """``M x M`` int8: 0 same rank, 1 same host, 2 other host."""
        return _link_class(self.num_hosts, self.ranks_per_host)

    def cost_matrix(self) -> np.ndarray:
        """OPER's ``L`` (section 3.2) in microseconds per byte: ``L[i][j] = 1 / bandwidth[i][j]``."""
        return 1.0 / (self.bandwidth * 1e3)

    def embedding_cost(self, row_bytes: float) -> np.ndarray:
        """Cost in microseconds for rank ``i`` to fetch one row of ``row_bytes`` from rank ``j``: ``S * L``."""
        return row_bytes * self.cost_matrix()

    def p2p_bandwidth(self) -> float:
        """``BW_P2P`` of OPER eq. (4): the harmonic mean of the bandwidths between distinct ranks.

        Fetches are spread over all peers, so the mean per-byte cost is what a row pays; with one rank
        there is no peer and the local bandwidth is returned.
        """
        m = self.world_size
        if m == 1:
            return float(self.bandwidth[0, 0])
        off = ~np.eye(m, dtype=bool)
        return float(1.0 / np.mean(1.0 / self.bandwidth[off]))


def _link_class(num_hosts: int, ranks_per_host: int) -> np.ndarray:
    m = num_hosts * ranks_per_host
    r = np.arange(m)
    host = r // ranks_per_host
    c = np.where(host[:, None] == host[None, :], SAME_HOST, OTHER_HOST).astype(np.int8)
    c[r, r] = SAME_RANK
    return c


def as_link_topology(topo: "Topology | LinkTopology | dict") -> LinkTopology:
    """Accept a ``specs.Topology``, a ``LinkTopology`` or a dict of either."""
    if isinstance(topo, LinkTopology):
        return topo
    if isinstance(topo, Topology):
        return LinkTopology.from_spec(topo)
    if isinstance(topo, dict):
        return LinkTopology.from_dict(topo)
    raise ConfigError(f"topology: expected specs.Topology, LinkTopology or a mapping, got {type(topo).__name__}")


def load_topology(path) -> LinkTopology:
    """Read a topology from YAML or JSON (either ``specs.Topology`` fields or a ``LinkTopology`` dict)."""
    data = read_yaml(path, "topology file")  # YAML reads JSON too
    if isinstance(data, dict) and "topology" in data and len(data) == 1:
        data = data["topology"]
    try:
        return as_link_topology(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
