"""``embedscale topology --measure``: fill ``L`` (OPER section 3.2) from a micro-benchmark on the ranks at hand.

OPER obtains ``L`` "by conducting offline profiling on the hardware". We start ``ranks_per_host``
local processes with ``torch.distributed`` (gloo by default), and measure:

* same rank: gathering rows from a local table (``index_select``), bytes per second;
* same host: for every ordered pair ``(i, j)``, a send of ``j``'s rows to ``i`` at two message sizes;
  ``time = latency + bytes / bandwidth`` gives both figures (least squares over repeats);
* AllReduce: ``all_reduce`` of the larger message, bandwidth by the ring formula ``2 (M-1)/M * bytes``.

Only one host is at hand, so other-host links keep the figures of the base ``specs.Topology`` (and
``notes`` says so). The device is the run's (``torch.get_default_device()`` unless given).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.topology import OTHER_HOST, SAME_HOST, LinkTopology
from embedscale.specs import Topology


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, sizes: tuple[int, int], repeats: int, backend: str, device: str,
            out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world)
    dev = torch.device(device)
    res = {"pair": np.zeros((world, world, 2)), "local_bw": 0.0, "allreduce_s": 0.0}
    bufs = {s: torch.ones(s // 4, dtype=torch.float32, device=dev) for s in sizes}
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            for k, s in enumerate(sizes):
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if rank == src:
                        dist.send(bufs[s], dst)
                    elif rank == dst:
                        dist.recv(bufs[s], src)
                    times.append(time.perf_counter() - t0)
                if rank == dst:
                    res["pair"][dst, src, k] = float(np.median(times))
    table = torch.randn(1 << 16, 64, device=dev)
    idx = torch.randint(0, table.shape[0], (1 << 15,), device=dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        table.index_select(0, idx)
    res["local_bw"] = idx.numel() * 64 * 4 * repeats / (time.perf_counter() - t0)
    big = bufs[sizes[-1]]
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(big)
    res["allreduce_s"] = (time.perf_counter() - t0) / repeats
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), pair=res["pair"], local_bw=res["local_bw"],
             allreduce_s=res["allreduce_s"])
    dist.destroy_process_group()


def measure_topology(num_hosts: int = 1, ranks_per_host: int = 2, *, base=None, sizes=(1 << 14, 1 << 22),
                     repeats: int = 5, backend: str = "gloo", device: str | None = None) -> LinkTopology:
    """Measure link classes on ``ranks_per_host`` local ranks and return a ``LinkTopology``.

    Args:
        num_hosts: hosts of the topology to describe (other-host figures come from ``base``).
        ranks_per_host: local processes to start.
        base: ``specs.Topology`` with the figures the benchmark cannot reach.
        sizes: two message sizes in bytes (latency and bandwidth come from the pair).
        repeats: timed repeats per measurement (median).
        backend: ``torch.distributed`` backend.
        device: device of the buffers; default ``torch.get_default_device()``.
    """
    import torch
    import torch.multiprocessing as mp

    if ranks_per_host < 2:
        raise ConfigError(f"measure_topology needs at least 2 local ranks, got {ranks_per_host}")
    if len(sizes) != 2 or sizes[0] >= sizes[1]:
        raise ConfigError(f"measure_topology: sizes must be two increasing byte counts, got {sizes}")
    base = base or Topology(num_hosts=num_hosts, ranks_per_host=ranks_per_host)
    dev = str(device or torch.get_default_device())
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(ranks_per_host, _free_port(), tuple(sizes), repeats, backend, dev, tmp),
                           nprocs=ranks_per_host, join=True, start_method="spawn")
        parts = [np.load(os.path.join(tmp, f"rank{r}.npz")) for r in range(ranks_per_host)]
        pair = sum(p["pair"] for p in parts)
        local_bw = float(np.mean([float(p["local_bw"]) for p in parts]))
        ar_s = float(np.max([float(p["allreduce_s"]) for p in parts]))
    s0, s1 = sizes
    t0, t1 = pair[..., 0], pair[..., 1]
    bw_local = np.where(t1 > t0, (s1 - s0) / np.maximum(t1 - t0, 1e-12), s1 / np.maximum(t1, 1e-12))  # bytes/s
    lat_local = np.maximum(t0 - s0 / bw_local, 0.0)
    m = num_hosts * ranks_per_host
    spec = LinkTopology.from_spec(Topology(**{**base.__dict__, "num_hosts": num_hosts, "ranks_per_host": ranks_per_host}))
    bw, lat = spec.bandwidth.copy(), spec.latency_us.copy()
    cls = spec.link_class()
    r = ranks_per_host
    for h in range(num_hosts):  # every host is assumed to look like the one measured
        blk = slice(h * r, (h + 1) * r)
        sub_bw = bw[blk, blk]
        sub_lat = lat[blk, blk]
        off = ~np.eye(r, dtype=bool)
        sub_bw[off] = bw_local[off] / 1e9
        sub_lat[off] = lat_local[off] * 1e6
        np.fill_diagonal(sub_bw, local_bw / 1e9)
        bw[blk, blk], lat[blk, blk] = sub_bw, sub_lat
    ar_bw = 2.0 * (r - 1) / r * s1 / ar_s / 1e9
    notes = {"measured": ["same_rank", "same_host", "allreduce"], "from_spec": ["other_host"] if (cls == OTHER_HOST).any() else [],
             "backend": backend, "device": dev, "sizes": list(sizes), "repeats": repeats,
             "same_host_bw_mean_gbs": float(bw[cls == SAME_HOST].mean()) if (cls == SAME_HOST).any() else None}
    del m
    return LinkTopology(num_hosts, ranks_per_host, int(base.memory_per_rank), bw, lat, ar_bw, source="measured", notes=notes)
