"""``embedscale doctor``: what a run over several machines needs, checked in a minute before a long job.

On every node, with the flags the run will use (``--nnodes/--node-rank/--rdzv-endpoint/--nproc``):

- the rendezvous endpoint: node 0 must own its address and the port must be free (it then answers on the port
  until its ranks start, so the other nodes' checks find it); every other node must reach it within
  ``reach_timeout_s`` (a named error otherwise: unknown host, refused, no route, timed out);
- the network interface this node reaches the endpoint by, as a ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
  hint (and a named problem when either names an interface this machine does not have);
- then the ranks start (the run's launcher, c10d rendezvous) and check together: the clocks (offsets from rank
  0's at a common barrier), whether the run directory is shared with rank 0's node, every rank's batches per
  epoch from its own node's copy of the data (given the run's config: unequal counts hang a run at the last
  batch), and a short exchange between every ordered pair of ranks (two message sizes, send/recv), whose
  bandwidth and latency matrix rank 0 writes as the planner's topology (``plan.topology.LinkTopology``, OPER
  3.2's link cost matrix L measured across the hosts instead of assumed; ``embedscale plan --topology FILE``
  reads it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from embedscale import assemble
from embedscale.device import HOST
from embedscale.errors import EmbedscaleError
from embedscale.io import atomic_write_json
from embedscale.plan.topology import LinkTopology
from embedscale.specs import Topology
from embedscale.train.launch import init_from_env, leave_group
from embedscale.train.nodes import launch_topology, node_of

REACH_TIMEOUT_S = 8.0  # how long a node tries to reach the rendezvous endpoint
SIZES = (1 << 12, 1 << 20)  # message sizes of the pair exchange (latency from the small, bandwidth from the pair)
REPEATS = 3
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


class Unreachable(EmbedscaleError):
    """The rendezvous endpoint cannot be reached (or, on node 0, owned) from this node."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def interface_addresses() -> dict[str, str]:
    """``{interface name: IPv4 address}`` of this machine (Linux ioctl; empty where unsupported)."""
    out = {}
    with contextlib.suppress(OSError, AttributeError):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):
                    req = struct.pack("256s", name.encode()[:15])
                    out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
    return out


def interface_hint(local_ip: str, env=os.environ) -> dict:
    """The interface that holds ``local_ip`` and what ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say:
    ``{"interface", "address", "hint", "problems"}``."""
    addrs = interface_addresses()
    name = next((n for n, a in addrs.items() if a == local_ip), None)
    problems = []
    for var in IFNAME_VARS:
        val = env.get(var)
        if val:
            missing = [i for i in val.lstrip("^=").split(",") if i and i not in addrs]
            if missing and addrs and not val.startswith("^"):
                problems.append(f"{var}={val}: this machine has no interface {', '.join(missing)} "
                                f"(it has {', '.join(sorted(addrs))})")
    hint = (" ".join(f"{v}={name}" for v in IFNAME_VARS) if name else
            f"no interface of this machine holds {local_ip}")
    return {"interface": name, "address": local_ip, "hint": hint, "problems": problems,
            "set": {v: env.get(v, "") for v in IFNAME_VARS}}


@dataclass
class Listener:
    """Node 0's answer on the endpoint's port while its checks run (closed before its ranks start)."""
    sock: socket.socket
    stop: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = self.sock.accept()
                conn.close()

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.close()


def own_endpoint(endpoint: str) -> Listener:
    """Node 0: bind the endpoint (its address must be this machine's, the port free) and answer there."""
    host, port = split_endpoint(endpoint)
    try:
        s = socket.create_server((host, port), reuse_port=False)
    except socket.gaierror as e:
        raise Unreachable(f"--rdzv-endpoint {endpoint}: cannot resolve {host!r} ({e.strerror})") from None
    except OSError as e:
        why = ("the port is in use (a run or another doctor holds it?)" if e.errno == 98 else
               f"{host} is not an address of this machine: node 0 hosts the rendezvous, so the endpoint is its "
               "address" if e.errno == 99 else e.strerror)
        raise Unreachable(f"--rdzv-endpoint {endpoint}: node 0 cannot listen there: {why}") from None
    lis = Listener(s)
    threading.Thread(target=lis.serve, name="doctor-endpoint", daemon=True).start()
    return lis


def reach_endpoint(endpoint: str, timeout_s: float = REACH_TIMEOUT_S) -> tuple[str, float]:
    """A node other than 0: connect to the endpoint, retrying for ``timeout_s`` (node 0 may start a moment later);
    returns ``(this node's address toward it, seconds to connect)``; an :class:`Unreachable` naming the cause."""
    host, port = split_endpoint(endpoint)
    t0 = time.monotonic()
    last = ""
    while True:
        left = timeout_s - (time.monotonic() - t0)
        if left <= 0:
            raise Unreachable(f"rendezvous endpoint {endpoint} not reachable from this node within {timeout_s:g} s "
                              f"({last}): start node 0's command with the same --rdzv-endpoint, and check the "
                              "address, the port and any firewall between the nodes")
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)) as s:
                return s.getsockname()[0], time.monotonic() - t0
        except socket.gaierror as e:
            raise Unreachable(f"rendezvous endpoint {endpoint}: cannot resolve {host!r} ({e.strerror})") from None
        except ConnectionRefusedError:
            last = "connection refused: nothing listens there yet"
        except TimeoutError:
            last = "connection timed out"
        except OSError as e:
            last = e.strerror or str(e)
        time.sleep(min(0.25, max(0.0, timeout_s - (time.monotonic() - t0))))


def node_checks(endpoint: str, node_rank: int, reach_timeout_s: float = REACH_TIMEOUT_S):
    """This node's checks before its ranks start: ``(report, listener or None)``."""
    if node_rank == 0:
        lis = own_endpoint(endpoint)
        host, _ = split_endpoint(endpoint)
        return {"endpoint": endpoint, "role": "hosts the rendezvous",
                **interface_hint(socket.gethostbyname(host))}, lis
    ip, secs = reach_endpoint(endpoint, reach_timeout_s)
    return {"endpoint": endpoint, "role": f"reached it in {secs * 1e3:.0f} ms", **interface_hint(ip)}, None


# -- the ranks' part (under torchrun) ---------------------------------------------------------------------------

def _gather_floats(values: list[float]):

    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).numpy()


def _gather_text(text: str, width: int = 64) -> list[str]:
    raw = text.encode()[:width].ljust(width, b"\0")
    rows = _gather_floats(list(raw))
    return [bytes(int(x) for x in r).rstrip(b"\0").decode(errors="replace") for r in rows]


def clock_offsets_ms() -> list[float]:
    """Every rank's wall clock against rank 0's at a common barrier, in ms (within the barrier's spread)."""
    dist.barrier()
    t = time.time()
    v = _gather_floats([t])[:, 0]
    return [float((x - v[0]) * 1e3) for x in v]


def shared_dir(run_dir: Path, rank: int) -> list[bool]:
    """Whether each rank sees rank 0's file in ``run_dir`` (the directory shared with rank 0's node)."""
    token = uuid.uuid4().hex if rank == 0 else ""
    token = _gather_text(token)[0]
    path = run_dir / f".doctor-{token}"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
    dist.barrier()
    try:
        seen = path.read_text() == token
    except OSError:
        seen = False
    flags = [bool(x) for x in _gather_floats([float(seen)])[:, 0]]
    dist.barrier()
    if rank == 0:
        path.unlink(missing_ok=True)
    return flags


def batch_counts(cfg, rank: int, world: int) -> list[tuple[int, int]]:
    """Every rank's ``(batches per epoch, training rows)`` from its own node's copy of the data (the node's
    first rank prepares it, the others read its cache)."""
    local = node_of()[1]
    data = None
    if local == 0:
        data = assemble.prepare_data(cfg, progress=False)
    dist.barrier()
    if data is None:
        data = assemble.prepare_data(cfg, progress=False)
    loader = assemble.train_loader(cfg, data, HOST, rank=rank, world=world)
    rows = data.train.stop - data.train.start
    return [(int(a), int(b)) for a, b in _gather_floats([float(len(loader)), float(rows)])]


def pair_times(sizes=SIZES, repeats: int = REPEATS):
    """``times[dst, src, k]``: the median seconds for rank ``src`` to send ``sizes[k]`` bytes to ``dst`` (every
    ordered pair in turn, the others waiting at a barrier), summed over the ranks onto every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    res = torch.zeros(world, world, len(sizes), dtype=torch.float64)
    bufs = [torch.ones(s // 4, dtype=torch.float32) for s in sizes]
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            for k, buf in enumerate(bufs):
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if rank == src:
                        dist.send(buf, dst)
                    elif rank == dst:
                        dist.recv(buf, src)
                    times.append(time.perf_counter() - t0)
                if rank == dst:
                    res[dst, src, k] = float(np.median(times))
    dist.all_reduce(res)
    return res.numpy()


def link_topology(times, hosts: int, per_host: int, sizes=SIZES, repeats: int = REPEATS, names=()):
    """The measured ``LinkTopology``: per ordered pair the bandwidth from the two sizes' difference and the
    latency the small message leaves over it (as ``plan.measure``); the diagonal (a rank's own lookups) and
    the AllReduce from ``specs.Topology``'s figures, which this exchange does not measure."""
    s0, s1 = sizes
    t0, t1 = times[..., 0], times[..., 1]
    bw = np.where(t1 > t0, (s1 - s0) / np.maximum(t1 - t0, 1e-9), s1 / np.maximum(t1, 1e-9))  # bytes/s
    lat = np.maximum(t0 - s0 / bw, 0.0)
    spec = LinkTopology.from_spec(Topology(num_hosts=hosts, ranks_per_host=per_host))
    off = ~np.eye(hosts * per_host, dtype=bool)
    b, la = spec.bandwidth.copy(), spec.latency_us.copy()
    b[off] = bw[off] / 1e9
    la[off] = lat[off] * 1e6
    return LinkTopology(hosts, per_host, 0, b, la, spec.allreduce_bw, source="measured",
                        notes={"by": "embedscale doctor", "sizes": list(sizes), "repeats": repeats,
                               "measured": ["same_host", "other_host"], "from_spec": ["same_rank", "allreduce"],
                               "hosts": list(names)})


def rank_checks(run_dir: Path, out: Path | None, cfg=None) -> dict | None:
    """Every rank under torchrun: the checks that need all ranks; rank 0 writes the topology to ``out`` and
    returns the report (the others None)."""
    rank, world = init_from_env("gloo", timeout_s=120)
    hosts, per = launch_topology(world)
    names = _gather_text(socket.gethostname())
    rep: dict = {"world_size": world, "hosts": hosts, "ranks_per_host": per, "host_names": names, "problems": []}
    offs = clock_offsets_ms()
    rep["clock_offset_ms"] = offs
    shared = shared_dir(run_dir, rank)
    rep["run_dir_shared_with_rank0"] = shared
    if cfg is not None:
        counts = batch_counts(cfg, rank, world)
        rep["batches_per_epoch"] = [c for c, _ in counts]
        if len({c for c, _ in counts}) > 1:
            rep["problems"].append("ranks see different batch counts per epoch (their nodes' data differ; a run "
                                   "would hang at the last batch): " + ", ".join(
                                       f"rank {r}: {c} batches of {n} rows" for r, (c, n) in enumerate(counts)))
    times = pair_times()
    topo = link_topology(times, hosts, per, names=names)
    rep["bandwidth_gbs"] = topo.bandwidth.round(4).tolist()
    rep["latency_us"] = topo.latency_us.round(1).tolist()
    if rank == 0 and out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, topo.to_dict())
        rep["topology_file"] = str(out)
    leave_group()
    return rep if rank == 0 else None


def format_report(node: dict, ranks: dict | None) -> str:
    lines = [f"rendezvous    {node['endpoint']}: {node['role']}",
             f"interface     {node['interface'] or '?'} ({node['address']}); hint: {node['hint']}"]
    if ranks is not None:
        offs = ranks["clock_offset_ms"]
        lines += [f"ranks         {ranks['world_size']} on {ranks['hosts']} host(s) of {ranks['ranks_per_host']}",
                  f"clocks        offsets from rank 0 {min(offs):+.1f} .. {max(offs):+.1f} ms",
                  "run dir       " + ", ".join(f"rank {r}: {'shared' if s else 'own'}"
                                               for r, s in enumerate(ranks["run_dir_shared_with_rank0"]))]
        if "batches_per_epoch" in ranks:
            lines.append(f"batches/epoch {ranks['batches_per_epoch']}")
        else:
            lines.append("batches/epoch not checked (give the run's --config or data flags)")
        if "topology_file" in ranks:
            lines.append(f"links         measured bandwidth and latency per pair of ranks: {ranks['topology_file']} "
                         "(embedscale plan --topology reads it)")
    else:
        lines.append("ranks         their report is on the node of rank 0")
    for p in node["problems"] + (ranks["problems"] if ranks else []):
        lines.append(f"problem       {p}")
    return "\n".join(lines)


def write_json(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")

