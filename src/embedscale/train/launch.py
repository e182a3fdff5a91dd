"""Process-group setup for local ranks and torchrun, and a local spawner for tests and ``--nproc``.

``init_from_env`` reads the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and joins the group with a timeout, so a rank that dies or hangs turns into an error on the
others instead of a silent hang. ``spawn_local`` runs a function on N local processes (gloo) and returns
what each rank returned, re-raising the first failure with the rank that failed named. ``launch_ranks``
is the one launcher of every command that starts ranks: it runs torchrun, owns the ranks and ends all of
them (and only then itself) on SIGINT/SIGTERM; killed outright (SIGKILL), it takes them with it
(:func:`die_with_launcher`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import functools
import io
import math
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embedscale.errors import EmbedscaleError
from embedscale.threads import keep_freed_memory
from embedscale.train import watchdog
from embedscale.train.lock import Stopped, proc_files, record_run_processes


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
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "embedscale.workflow"]


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

LAUNCHER_PID_ENV = "EMBEDSCALE_LAUNCHER_PID"  # the launcher's pid, in every rank it starts
LAUNCH_ID_ENV = "EMBEDSCALE_LAUNCH_ID"  # new for every launch, in the environment of every process of it
NODE_RANK_ENV = "EMBEDSCALE_NODE_RANK"  # the node's --node-rank, in every rank a multi-node launch starts


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

# torchrun is started through this: the kernel SIGKILLs it when the launcher's thread that started it exits
# (PR_SET_PDEATHSIG, kept across execve), unless the launcher died before the prctl (then it never starts)
_DIE_WITH_PARENT = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "
                    "os.getppid() == int(sys.argv[1]) or os._exit(137); os.execv(sys.argv[2], sys.argv[2:])")


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



# ---------------------------------------------------------------------------------------------------------------
# The launcher: one function starts the ranks of every command (train, infer, run) and owns them.
# ---------------------------------------------------------------------------------------------------------------

STOP_GRACE_S = 5.0  # after SIGTERM, how long ranks may take to finish (e.g. an atomic checkpoint write)
KILL_WAIT_S = 3.0  # after SIGKILL, how long to wait for the processes to be gone
FROZEN_GRACE_S = 1.0  # a stopped rank asked to end (SIGTERM pending) is SIGKILLed after this


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """``pid -> (ppid, session id, state)`` of every process we can see (Linux ``/proc``; empty elsewhere)."""
    out = {}
    for pid, raw in proc_files("stat"):
        stat = raw.decode(errors="replace")
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        try:
            out[pid] = (int(fields[1]), int(fields[3]), fields[0])
        except (IndexError, ValueError):
            continue
    return out


def run_processes(root: int, sessions: set[int]) -> set[int]:
    """Live processes of a run: ``root``'s descendants and every process in one of ``sessions`` (torchrun
    starts each rank in a session of its own, and a rank's helpers stay in it even when orphaned). Adds the
    sessions of the processes found to ``sessions``. Zombies count as gone."""
    table = _proc_table()
    me = os.getpid()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, sid, _) in table.items() if sid in sessions}
    stack = [root, *found]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in found:
                found.add(c)
                stack.append(c)
    if root in table:
        found.add(root)
    found = {p for p in found if p != me and table.get(p, (0, 0, "Z"))[2] not in ("Z", "X")}
    sessions.update(table[p][1] for p in found if table[p][1] != me and table[p][1] != 0)
    return found


def _signal_all(pids: set[int], sessions: set[int], sig: int) -> None:
    for sid in sessions:
        with contextlib.suppress(OSError):
            os.killpg(sid, sig)  # the session leader's group: the rank and whatever it started
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _wait_gone(root: int, sessions: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = run_processes(root, sessions)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def end_run_processes(proc: subprocess.Popen, sessions: set[int], grace_s: float = STOP_GRACE_S) -> int:
    """End torchrun and all its ranks: SIGKILL torchrun (it only supervises; killed, it prints no
    traceback of its own and restarts nothing), SIGTERM to the ranks and their helpers, up to ``grace_s``
    for them to finish what they write (atomically) and exit, then SIGKILL whatever is left. Returns how
    many processes it found."""
    procs = run_processes(proc.pid, sessions)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's own group (start_new_session: pgid == its pid)
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=KILL_WAIT_S)
    procs |= run_processes(proc.pid, sessions)
    ranks = procs - {proc.pid}
    _signal_all(ranks, sessions - {proc.pid}, signal.SIGTERM)
    left = _wait_gone(proc.pid, sessions, grace_s)
    if left:
        _signal_all(left, sessions, signal.SIGKILL)
        left = _wait_gone(proc.pid, sessions, KILL_WAIT_S)
    if left:
        print(f"embedscale: processes {sorted(left)} of the run did not end after SIGKILL", file=sys.stderr,
              flush=True)
    return len(procs)


def remove_orphan_temps(run_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary files ``io.atomic_open`` leaves when its writer is killed (``.NAME.XXXX.tmp``), and
    the temporary directories of checkpoints being written (``checkpoints/.step-N.tmp``), under ``run_dir``: only
    call it when every process of the run is gone (and the run's lock is held). The final files are untouched:
    a write either renamed its temporary file into place or it never happened."""
    removed = []
    root = Path(run_dir)
    if not root.is_dir():
        return removed
    for p in sorted(root.rglob(".*.tmp"), key=lambda q: len(q.parts)):
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
            else:
                continue  # inside a directory removed already
            removed.append(p)
    return removed


def _pending_signals(pid: int) -> int:
    """The signals pending for ``pid`` (thread and process, ``/proc/PID/status``) as a bit mask; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return functools.reduce(lambda m, line: m | int(line.split()[1], 16), (
                line for line in f if line.startswith(("SigPnd:", "ShdPnd:"))), 0)
    except (OSError, ValueError, IndexError):
        return 0


def kill_frozen(pids: set[int], pending_since: dict[int, float]) -> None:
    """SIGKILL the processes of ``pids`` that are stopped (SIGSTOP, a debugger) with a SIGTERM pending for
    ``FROZEN_GRACE_S``: torchrun asked them to end (a peer failed) and they cannot; torchrun would wait 30 s
    for them whatever its ``--shutdown-timeout``. A run frozen as a whole and asked nothing is left alone.
    ``pending_since``: pid -> when its SIGTERM was first seen pending (kept between calls)."""
    table, now = _proc_table(), time.monotonic()
    for pid in pids:
        if table.get(pid, (0, 0, ""))[2] in ("T", "t") and _pending_signals(pid) & (1 << (signal.SIGTERM - 1)):
            if now - pending_since.setdefault(pid, now) >= FROZEN_GRACE_S:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        else:
            pending_since.pop(pid, None)


_TRACEBACK = b"Traceback (most recent call last):"


def forward_stderr(src, dst) -> None:
    """Copy torchrun's stderr (its own and its ranks') to ``dst`` as it comes, leaving out torchrun's own Python
    traceback of ``ChildFailedError``: a rank that fails has printed its error already, and torchrun's summary
    below the traceback (which rank, exit code, root cause) is kept. Any other traceback passes unchanged.
    Partial lines (progress bars) pass at once, except a line that may still become a traceback's first line."""
    held: list[bytes] = []  # a traceback being read, held until its last line says whose it is
    partial = b""
    while True:
        try:
            chunk = os.read(src, 65536)
        except OSError:  # the pipe closed under us (the launcher exiting after a stop signal): the stream ended
            chunk = b""
        if not chunk:
            break
        data = partial + chunk
        lines = data.split(b"\n")
        partial = lines.pop()
        out = []
        for line in lines:
            line += b"\n"
            if held:
                if line[:1] in (b" ", b"\t") or line.startswith(_TRACEBACK) or len(held) > 2000:
                    held.append(line)
                    continue
                if b"ChildFailedError" not in line:  # someone else's traceback: as it was
                    out.extend(held)
                    out.append(line)
                held = []
                continue
            if line.startswith(_TRACEBACK):
                held = [line]
                continue
            out.append(line)
        if partial and not held and not _TRACEBACK.startswith(partial[: len(_TRACEBACK)]):
            out.append(partial)
            partial = b""
        if out:
            dst.write(b"".join(out))
            dst.flush()
    rest = b"".join(held) + partial
    if rest:
        dst.write(rest)
        dst.flush()


@dataclass
class Nodes:
    """Where this launch's local ranks stand among the run's machines (``--nnodes/--node-rank/--rdzv-endpoint``).

    ``nnodes`` nodes meet at ``endpoint`` (``host:port``) through torchrun's c10d rendezvous, under ``rdzv_id``
    (the same on every node). Node ``node_rank`` 0 hosts the rendezvous store at the endpoint (its address);
    the nodes' ranks follow ``node_rank`` (:func:`follow_node_rank`), not the rendezvous's order."""

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str = ""
    rdzv_id: str = ""

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    def check(self) -> None:
        """A named error for flags that cannot describe a launch."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise EmbedscaleError(f"--node-rank {self.node_rank}: expected 0 <= node rank < --nnodes {self.nnodes}")
        if self.multi and not self.endpoint:
            raise EmbedscaleError(f"--nnodes {self.nnodes}: every node needs --rdzv-endpoint HOST:PORT (the address "
                                  "of node 0, which hosts the rendezvous)")
        if self.endpoint:
            host, sep, port = self.endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise EmbedscaleError(f"--rdzv-endpoint {self.endpoint!r}: expected HOST:PORT, e.g. head:29400")

    def torchrun_args(self, timeout_s: float) -> list[str]:
        """torchrun's flags for this node: c10d rendezvous (``is_host`` on node 0), or ``--standalone``."""
        if not self.multi:
            return ["--standalone"]
        conf = f"is_host={'1' if self.node_rank == 0 else '0'},join_timeout={max(1, math.ceil(timeout_s))}"
        return [f"--nnodes={self.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.rdzv_id or 'embedscale'}", f"--rdzv-conf={conf}"]


def launch_ranks(nproc: int, module_args: list[str], *, max_restarts: int = 0, env: dict | None = None,
                 run_dir: str | os.PathLike | None = None, nodes: Nodes | None = None,
                 join_timeout_s: float = 600.0) -> int:
    """Run ``python -m embedscale <module_args>`` on ``nproc`` local ranks under torchrun (standalone, or this
    node's part of a multi-node run: ``nodes``, c10d rendezvous waiting up to ``join_timeout_s`` for the other
    nodes) and own them; returns torchrun's exit code. Every command that starts ranks goes through here.

    torchrun supervises the ranks: a rank that dies ends the others and torchrun reports which rank failed
    and how; with ``max_restarts`` it restarts the group, and the run resumes from its last complete
    checkpoint. torchrun runs in a session of its own (and starts each rank in one of its own), so a Ctrl-C
    in the terminal reaches only this process; on SIGINT or SIGTERM this process ends every process of the
    run (:func:`end_run_processes`: SIGTERM, ``STOP_GRACE_S`` for the ranks to finish atomic writes, then
    SIGKILL), removes temporary files the killed ranks left in ``run_dir`` and raises :class:`Stopped`
    (exit code 130 or 143). The ranks see ``EMBEDSCALE_LAUNCHED=1`` (this process holds the run's lock), the
    launcher's pid and a launch id (:func:`die_with_launcher`: nothing of the run outlives this process, SIGKILL
    included); the lock on ``run_dir`` lists torchrun and each rank as they start (``lock.RunLock.record``).
    """
    nodes = nodes or Nodes()
    nodes.check()
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(join_timeout_s),
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           f"--shutdown-timeout={math.ceil(STOP_GRACE_S)}",  # then SIGKILL: a frozen rank never handles SIGTERM
           "-m", "embedscale", *module_args]
    if sys.platform.startswith("linux"):  # torchrun dies with this process (parent-death signal)
        cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    full_env["EMBEDSCALE_LAUNCHED"] = "1"
    full_env[LAUNCHER_PID_ENV] = str(os.getpid())
    full_env[LAUNCH_ID_ENV] = uuid.uuid4().hex
    if nodes.multi:  # the ranks number themselves by it (follow_node_rank)
        full_env[NODE_RANK_ENV] = str(nodes.node_rank)
    full_env.update(env or {})
    if run_dir is not None:  # before torchrun starts: the run's lock finds every process of it by this marker
        record_run_processes(run_dir, (), marker=f"{LAUNCH_ID_ENV}={full_env[LAUNCH_ID_ENV]}")
    received: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    old = {}
    if main:
        old = {s: signal.signal(s, lambda signum, frame: received.append(signum))
               for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if received:
            raise Stopped(received[0], "no rank was started")
        proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, stderr=subprocess.PIPE)
        relay = threading.Thread(target=forward_stderr, args=(proc.stderr.fileno(), sys.stderr.buffer),
                                 name="torchrun-stderr", daemon=True)
        relay.start()
        sessions, seen, frozen = {proc.pid}, set(), {}
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received:
                n = end_run_processes(proc, sessions)
                removed = remove_orphan_temps(run_dir) if run_dir is not None else []
                where = f"; {run_dir} keeps its last complete checkpoint" if run_dir is not None else ""
                relay.join(timeout=5)  # the ranks' last words ("rank 0: stopped by ...") come before the launcher's
                raise Stopped(received[0], f"ended the run's {n} process(es){where}"
                              + (f" (removed {len(removed)} unfinished temporary file(s))" if removed else ""))
            found = run_processes(proc.pid, sessions)  # learn the ranks' sessions while torchrun is there to find them
            kill_frozen(found - {proc.pid}, frozen)
            if not found <= seen:  # the run's lock lists every process of the run
                seen |= found
                if run_dir is not None:
                    record_run_processes(run_dir, found)
        left = run_processes(proc.pid, sessions)
        if left:  # torchrun ended but something it started did not: nothing of the run outlives the launcher
            _signal_all(left, sessions, signal.SIGKILL)
            _wait_gone(proc.pid, sessions, KILL_WAIT_S)
        relay.join(timeout=5)  # the ranks' last words reach the terminal before the launcher's own
        return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)


launch_torchrun = launch_ranks  # the former name
