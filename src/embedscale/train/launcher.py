"""The launcher: one function (``launch_ranks``) starts the local ranks of every command (train, infer, calibrate
--ranks, run) under torchrun and owns them: it ends all of them (and only then itself) on SIGINT/SIGTERM, and
killed outright (SIGKILL) takes them with it (the ranks' side: ``launch.die_with_launcher``).

This module imports no torch: a launcher process only starts torchrun and watches its processes, so it starts in a
fraction of a second instead of paying torch's import (the ranks and torchrun pay it themselves).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from embedscale.errors import EmbedscaleError
from embedscale.train.lock import Stopped, proc_files, record_run_processes

LAUNCHER_PID_ENV = "EMBEDSCALE_LAUNCHER_PID"  # the launcher's pid, in every rank it starts
LAUNCH_ID_ENV = "EMBEDSCALE_LAUNCH_ID"  # new for every launch, in the environment of every process of it
NODE_RANK_ENV = "EMBEDSCALE_NODE_RANK"  # the node's --node-rank, in every rank a multi-node launch starts

# torchrun is started through this: the kernel SIGKILLs it when the launcher's thread that started it exits
# (PR_SET_PDEATHSIG, kept across execve), unless the launcher died before the prctl (then it never starts)
_DIE_WITH_PARENT = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "
                    "os.getppid() == int(sys.argv[1]) or os._exit(137); os.execv(sys.argv[2], sys.argv[2:])")

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
