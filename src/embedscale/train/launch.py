"""Process-group setup for local ranks and torchrun, and a local spawner for tests and ``--nproc``.

``init_from_env`` reads the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and joins the group with a timeout, so a rank that dies or hangs turns into an error on the
others instead of a silent hang. ``spawn_local`` runs a function on N local processes (gloo) and returns
what each rank returned, re-raising the first failure with the rank that failed named.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the default process group from torchrun's environment; returns ``(rank, world_size)``."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()) if world == 1 else "29500")
    backend = backend or ("nccl" if torch.cuda.is_available() and os.environ.get("EMBEDSCALE_BACKEND") != "gloo"
                          else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    # Under torchrun the store may be the agent's, which outlives a restart: keys of the failed attempt
    # (the dead ranks' addresses) would be read by the new one. A prefix per attempt keeps them apart.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_store), timeout=timeout, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"embedscale/attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)
    return rank, world


class RankFailed(RuntimeError):
    """A rank of a local multi-process run raised; the message names the rank and its traceback."""


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results, timeout_s: float) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # by value: shared-memory tensors would die with this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with the rank
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def spawn_local(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes; return per-rank results.

    ``fn`` must be importable (module level). Results travel by value through a queue as ``torch.save``
    bytes read back with ``weights_only=True``: tensors, numbers, strings, lists, tuples and dicts.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, timeout_s), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    import queue as _q

    deadline = timeout_s + 60
    waited = 0.0
    while len(out) + len(errors) < world_size:
        try:
            rank, status, value = results.get(timeout=1.0)
        except _q.Empty:
            waited += 1.0
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)
                    and i not in out and all(e[0] != i for e in errors)]
            if dead:
                errors.extend((i, f"rank {i} exited with code {procs[i].exitcode} without a result") for i in dead)
            if waited > deadline:
                errors.append((-1, f"timed out after {deadline:.0f} s"))
                break
            continue
        if status == "ok":
            out[rank] = torch.load(io.BytesIO(value), weights_only=True)
        else:
            errors.append((rank, value))
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors:
        rank, msg = sorted(errors)[0]
        raise RankFailed(f"rank {rank} failed:\n{msg}")
    return [out[r] for r in range(world_size)]


def launch_torchrun(nproc: int, module_args: list[str], *, max_restarts: int = 0, env: dict | None = None) -> int:
    """Run ``python -m embedscale <module_args>`` on ``nproc`` local ranks under torchrun (standalone).

    torchrun supervises the ranks: a rank that dies ends the others and the launcher reports which rank
    failed and how; with ``max_restarts`` it restarts the group, and the run resumes from its last
    complete checkpoint. Returns torchrun's exit code.
    """
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "embedscale", *module_args]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    full_env.update(env or {})
    return subprocess.call(cmd, env=full_env)
