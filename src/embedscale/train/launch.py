"""Process-group setup for local ranks and torchrun, and a local spawner for tests and ``--nproc``.

``init_from_env`` reads the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and joins the group with a timeout, so a rank that dies or hangs turns into an error on the
others instead of a silent hang. ``spawn_local`` runs a function on N local processes (gloo) and returns
what each rank returned, re-raising the first failure with the rank that failed named. A rank of a launch
ends with its launcher (:func:`die_with_launcher`); the launcher itself (``launch_ranks``, which runs torchrun
and owns the ranks) is :mod:`embedscale.train.launcher`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import io
import math
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embedscale.errors import EmbedscaleError
from embedscale.threads import keep_freed_memory
from embedscale.train import watchdog
from embedscale.train.launcher import LAUNCHER_PID_ENV, NODE_RANK_ENV, STOP_GRACE_S


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_JOINED_HERE = False  # init_from_env made the default process group (leave_group may destroy it)


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the default process group from torchrun's environment; returns ``(rank, world_size)``."""
    global _JOINED_HERE
    die_with_launcher()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    _JOINED_HERE = True
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # A world of one without torchrun picks a free port of its own and leaves the environment alone: a port
    # written into os.environ would be inherited by every process started later from this one (a CLI command
    # run in-process, then a subprocess launch) while this process still listens on it.
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else (free_port() if world == 1 else 29500)
    backend = backend or ("nccl" if torch.cuda.is_available() and os.environ.get("EMBEDSCALE_BACKEND") != "gloo"
                          else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _STORE.pop((addr, port), None) or _tcp_store(addr, port, rank, world, timeout_s)
    store.set_timeout(timeout)
    # Under torchrun the store may be the agent's, which outlives a restart: keys of the failed attempt
    # (the dead ranks' addresses) would be read by the new one. A prefix per attempt keeps them apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"embedscale/attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)
    atexit.register(_destroy_at_exit)
    return rank, world


_STORE: dict = {}  # (addr, port) -> the store rendezvous_store connected before the group was made


def _tcp_store(addr: str, port: int, rank: int, world: int, timeout_s: float):
    """The launch's key-value store: torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``, hosted by the
    rendezvous), else one rank 0 hosts."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(addr, port, world, is_master=(rank == 0 and not agent_store),
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def rendezvous_store(timeout_s: float = 300.0):
    """The store every rank of this launch reaches before the process group exists (the default group's
    store once it does): rank 0 hands the run's plan to the other nodes through it (``train.nodes``).
    ``init_from_env`` makes its group on the same store."""
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    if (addr, port) not in _STORE:
        _STORE[(addr, port)] = _tcp_store(addr, port, rank, world, timeout_s)
    return _STORE[(addr, port)]


def _destroy_at_exit() -> None:
    """Destroy the group this process joined while the interpreter is still whole: gloo's worker threads hold
    work objects with tensors, and destroying them during interpreter finalization aborts the process ("terminate
    called without an active exception", SIGABRT: PyTorch issue 190489). Every path that returns without
    ``leave_group`` (DMT serving, an error already reported) ends here."""
    global _JOINED_HERE
    if _JOINED_HERE and dist.is_initialized():
        _JOINED_HERE = False
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def leave_group(before_destroy=None) -> None:
    """A rank's orderly exit from the group ``init_from_env`` joined: a barrier (no peer still waits in a
    collective or reads this rank's memory), ``before_destroy()``, then the group destroyed. A group someone else
    made (a test's ``spawn_local`` worker, a caller's ``init_process_group``) is left to its maker after the
    barrier."""
    global _JOINED_HERE
    watchdog.stop_watch()  # the others may end before this rank does: no longer a lost rank
    if dist.is_initialized():
        dist.barrier()
    watchdog.stop()
    if before_destroy is not None:
        before_destroy()
    if dist.is_initialized() and _JOINED_HERE:
        dist.destroy_process_group()
        _JOINED_HERE = False


class RankFailed(RuntimeError):
    """A rank of a local multi-process run raised; the message names the rank and its traceback."""


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results, timeout_s: float,
            env: dict | None = None) -> None:
    if env is not None:  # the caller's environment at the call (a forkserver child starts with the server's)
        os.environ.clear()
        os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # this launch's id (the same on its ranks, new for every launch): a run's ready/failed markers name their
    # attempt by it, so a marker an earlier launch left in the run directory is never taken for this one's
    os.environ.setdefault("EMBEDSCALE_RUN_ID", f"local-{port}")
    torch.set_num_threads(1)
    keep_freed_memory()
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


# What a forkserver imports once, before it forks the ranks of every spawn_local call: a spawned rank imports torch
# and embedscale anew (about 2 s of CPU each); a forked one has them already. The server never runs an op, so no
# OpenMP pool or CUDA context is forked.
# torch._dynamo: the first optimizer of a process imports it (torch.optim's _disable_dynamo, ~1.3 s of CPU), once here
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "embedscale.workflow"]


def _rank_context():
    """A ``forkserver`` context preloading :data:`FORKSERVER_PRELOAD` (``spawn`` where the platform lacks it)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def spawn_local(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes; return per-rank results.

    ``fn`` must be importable (module level). The ranks are forked by a forkserver that has imported torch and
    embedscale once (:data:`FORKSERVER_PRELOAD`) and see this process's environment as it is at the call. Results travel by value through a queue as ``torch.save``
    bytes read back with ``weights_only=True``: tensors, numbers, strings, lists, tuples and dicts.
    """
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, timeout_s, env),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    deadline = timeout_s + 60
    waited = 0.0
    while len(out) + len(errors) < world_size:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue.Empty:
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
        others = "".join(f"\nrank {r} failed too:\n{m}" for r, m in sorted(errors)[1:])
        raise RankFailed(f"rank {rank} failed:\n{msg}{others}")
    return [out[r] for r in range(world_size)]



# ---------------------------------------------------------------------------------------------------------------
# Dying with the launcher: no process of a run outlives the one that started it, however that one ends.
# ---------------------------------------------------------------------------------------------------------------



def follow_node_rank(env=os.environ) -> bool:
    """Number a multi-node launch's ranks by ``--node-rank`` (``EMBEDSCALE_NODE_RANK``), before anything reads
    them: ``GROUP_RANK`` the node rank, ``RANK = node rank * LOCAL_WORLD_SIZE + LOCAL_RANK``. torchrun's c10d
    rendezvous ignores ``--node-rank`` and numbers the nodes by sorting (host name, agent pid): on one host the
    node started first, across hosts ``worker-10`` before ``worker-2``. The ranks meet in the agent's store
    (``TORCHELASTIC_USE_AGENT_STORE``), which no rank hosts, so any numbering joins the same group; without it
    (rank 0 would host the store at node 0's address) torchrun's order stays. Two nodes with the same node rank
    are an ``EmbedscaleError`` naming it. Returns whether the ranks were renumbered; torchrun's own messages
    keep its numbering (``EMBEDSCALE_TORCHRUN_RANK``). ``launch_ranks`` sets the variable; under plain torchrun
    a node sets it itself (``EMBEDSCALE_NODE_RANK=1 torchrun ...``), or keeps torchrun's order."""
    node = env.get(NODE_RANK_ENV)
    nodes = int(env.get("GROUP_WORLD_SIZE", "1") or 1)
    if node is None or nodes <= 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    node, local = int(node), int(env.get("LOCAL_RANK", "0"))
    per = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if not 0 <= node < nodes:
        raise EmbedscaleError(f"--node-rank {node}: this launch has {nodes} nodes (0 .. {nodes - 1})")
    if local == 0:  # one claim per node of its node rank, per launch attempt
        key = (f"embedscale/node-rank/{env.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{node}")
        if rendezvous_store().add(key, 1) > 1:
            raise EmbedscaleError(f"--node-rank {node} is given to two nodes: every node needs its own "
                                  f"(0 .. {nodes - 1})")
    env.setdefault("EMBEDSCALE_TORCHRUN_RANK", env.get("RANK", "0"))
    env.update({"GROUP_RANK": str(node), "ROLE_RANK": str(node * per + local), "RANK": str(node * per + local)})
    return True
WATCH_INTERVAL_S = 0.25  # how often a rank looks whether its parent and its launcher still live
_PR_SET_PDEATHSIG = 1  # prctl(2)
_watching = False



def set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``: the kernel sends this process ``sig`` when the *thread* that started it
    exits (Linux; ``False`` elsewhere or when it fails)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher() -> None:
    """Make this rank end with its launcher (a no-op outside torchrun, and the second time).

    Two ways, either enough: the parent-death signal (SIGTERM when torchrun, which started this rank from its
    main thread, dies; the launcher starts torchrun with SIGKILL as its own), and a daemon thread watching the
    parent (``getppid`` changes when it dies) and the launcher (``EMBEDSCALE_LAUNCHER_PID``, by a pidfd: a
    launcher that is a zombie counts as dead). On either death the watch ends this rank (:func:`_end_self`)."""
    global _watching
    if _watching or not (os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(LAUNCHER_PID_ENV)):
        return
    _watching = True
    parent = os.getppid()
    set_parent_death_signal(signal.SIGTERM)
    launcher = int(os.environ.get(LAUNCHER_PID_ENV) or 0)
    threading.Thread(target=_watch, args=(parent, launcher), name="embedscale-launcher-watch", daemon=True).start()


def _process_ended(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (``/proc``; ``kill(pid, 0)`` where there is none)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _watch(parent: int, launcher: int) -> None:
    fd = None
    if launcher and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(launcher)
        except ProcessLookupError:
            _end_self(launcher_gone=True)
            return
        except OSError:
            fd = None
    while True:
        if os.getppid() != parent:
            _end_self(launcher_gone=not launcher or _process_ended(launcher))
            return
        if fd is not None:
            if select.select([fd], [], [], WATCH_INTERVAL_S)[0]:  # a pidfd is readable once its process ended
                break
        else:
            time.sleep(WATCH_INTERVAL_S)
            if launcher and _process_ended(launcher):
                break
    _end_self(launcher_gone=True)


def _end_self(launcher_gone: bool) -> None:
    """This rank's parent or launcher died: SIGTERM to itself (its stop path: clean-ups, then exit), and a hard
    deadline of ``STOP_GRACE_S`` (``alarm``: SIGALRM's default action ends the process in the kernel, whatever
    the main thread is blocked in). With the launcher gone nobody reads this rank's output: it goes to
    ``/dev/null``, so a last word to a closed pipe cannot fail the way out."""
    if launcher_gone:
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
    signal.alarm(max(1, math.ceil(STOP_GRACE_S)))
    os.kill(os.getpid(), signal.SIGTERM)

