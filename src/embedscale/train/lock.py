"""One run per run directory: an advisory ``fcntl.flock`` on ``RUN_DIR/run.lock``.

The process that owns a run (the ``embedscale`` launcher; rank 0 under a plain ``torchrun``) holds the lock
for the whole run. The lock file names the holder (JSON: pid, host, start time, command), so a second run
into the same directory fails at once with an error naming them, before it writes anything there. It also
names every process of the run (``processes``: pid and start time of the holder, torchrun and each rank, as
the launcher finds them) and a ``marker`` in the environment of all of them (``EMBEDSCALE_LAUNCH_ID=...``).
The OS releases a flock when its holder dies however it dies, but the ranks may outlive it for a moment
(they die with their launcher, ``train.launch.die_with_launcher``): while any process of the run lives (by
pid and start time, or by the marker) the next run is refused naming their pids (:class:`RunDirBusy`);
once none does, the file is a stale hold and the next run takes it over (and says so). The lock is held
only while running: a finished run's directory can be resumed by a later run.

The file is rewritten in place (truncate + write), never replaced: a rename would give the path a new inode
and a second run could lock that one while the first still holds the old one. For the same reason the file
is never deleted.

Stopping: a run ends on SIGINT or SIGTERM with exit code 128 + the signal (130, 143) and one line
"error: stopped by SIGTERM; ..." (:class:`Stopped`); in a single process (or one rank) the signal raises
:class:`StopRequested` (:func:`stop_on_signals`) so clean-ups run on the way out (``io.atomic_open`` removes
its temporary file: nothing half-written is left).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from embedscale.errors import EmbedscaleError

LOCK_NAME = "run.lock"
_held: dict[Path, RunLock] = {}  # the directories this process holds (resolved path -> its outermost lock)


class RunDirBusy(EmbedscaleError):
    """Another running process holds the run directory; the message names its pid, host and start time."""


def _describe(holder: dict) -> str:
    if not holder:
        return "a process that has not written its name yet"
    cmd = holder.get("command")
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
            + (f" ({cmd})" if cmd else ""))


def read_holder(run_dir: str | os.PathLike) -> dict:
    """What ``RUN_DIR/run.lock`` says about its (last) holder; ``{}`` if absent, empty or unreadable."""
    try:
        text = (Path(run_dir) / LOCK_NAME).read_text()
        holder = json.loads(text) if text.strip() else {}
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/PID/stat``): with the pid it names one process,
    whatever reuses the pid later. ``None`` when unknown (no ``/proc``, or no such process)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int, start) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a zombie has ended)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return _pid_alive(pid)
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return False
    return start is None or int(fields[19]) == int(start)


def proc_files(name: str):
    """``(pid, bytes of /proc/<pid>/<name>)`` for every process whose file can be read (Linux; none elsewhere)."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                yield pid, f.read()
        except OSError:
            continue


def _with_marker(marker: str) -> set[int]:
    """The live processes whose environment holds ``marker`` (``NAME=value``), read from ``/proc``."""
    needle = marker.encode()
    return {pid for pid, env in proc_files("environ") if needle in env.split(b"\0") and _running(pid, None)}


def live_run_processes(holder: dict) -> list[int]:
    """The processes of the run ``holder`` (a lock file's content) names that still run on this host: listed
    ones (pid and start time) and any carrying its marker. Another host's processes cannot be seen: ``[]``."""
    if not holder or holder.get("host") != socket.gethostname():
        return []
    live = set()
    for entry in holder.get("processes") or []:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            if _running(int(entry[0]), entry[1]):
                live.add(int(entry[0]))
    if isinstance(holder.get("marker"), str) and "=" in holder["marker"]:
        live |= _with_marker(holder["marker"])
    return sorted(live - {os.getpid()})


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``with RunLock(run_dir, command):`` holds ``run_dir`` for one run (``acquire``/``release`` by hand too).

    ``acquire`` raises :class:`RunDirBusy` naming the holder when another live process holds the directory, and
    creates nothing but ``run.lock`` (and the directory itself if it does not exist yet). Within one process it
    nests: when this process holds the directory already (an outer ``RunLock``), ``acquire`` succeeds at once
    and ``release`` leaves the outer hold alone.
    """

    def __init__(self, run_dir: str | os.PathLike, command: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.command = command if command is not None else (
            " ".join(["embedscale", *sys.argv[1:]]) if sys.argv else "")
        self._fd: int | None = None
        self._nested = False
        self._holder: dict = {}

    @property
    def held(self) -> bool:
        return self._fd is not None or self._nested

    def acquire(self) -> RunLock:
        if self.held:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        key = self.run_dir.resolve()
        outer = _held.get(key)
        if outer is not None and outer._fd is not None:
            self._nested = True
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise EmbedscaleError(f"{self.path}: cannot lock the run directory: {e}") from e
            raise RunDirBusy(f"{self.run_dir} is in use by another run: {_describe(read_holder(self.run_dir))}; "
                             f"wait for it to end or pass another --run-dir") from None
        previous = read_holder(self.run_dir)
        live = live_run_processes(previous)
        if live:  # the holder died but not all of its run: the ranks still train (or are on their way out)
            os.close(fd)
            raise RunDirBusy(f"{self.run_dir} is in use by an earlier run whose processes still run: pids "
                             f"{', '.join(map(str, live))} ({_describe(previous)}); wait for them to end, end them, "
                             f"or pass another --run-dir")
        if previous.get("pid") is not None:
            same_host = previous.get("host") == socket.gethostname()
            state = ("no longer running" if same_host and not _pid_alive(previous["pid"])
                     else "its lock was released")
            print(f"embedscale: taking over the stale lock of {self.run_dir} ({_describe(previous)}; {state})",
                  file=sys.stderr, flush=True)
        me = os.getpid()
        self._holder = {"pid": me, "host": socket.gethostname(),
                        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "command": self.command, "processes": [[me, process_start(me)]]}
        self._fd = fd
        self._write_holder()
        _held[key] = self
        return self

    def _write_holder(self) -> None:
        data = (json.dumps(self._holder) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def record(self, pids, marker: str | None = None) -> None:
        """Add processes of this run (``pids``, with their start times) and the ``marker`` in their environment
        to the lock file, so a run that finds the lock free while one of them lives refuses the directory. Best
        effort: a failed write (a full disk) keeps the lock and the run going, with the holder's own entry."""
        if self._fd is None:
            return
        known = {p for p, _ in self._holder["processes"]}
        self._holder["processes"] += [[p, process_start(p)] for p in sorted(set(pids) - known)]
        if marker is not None:
            self._holder["marker"] = marker
        with contextlib.suppress(OSError):
            self._write_holder()

    def release(self) -> None:
        """Let go of the directory; the file is emptied (a clean end, not a stale hold) but kept."""
        if self._nested:
            self._nested = False
            return
        if self._fd is None:
            return
        _held.pop(self.run_dir.resolve(), None)
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def hold_run_dir(run_dir: str | os.PathLike, command: str | None = None) -> RunLock:
    """Take ``run_dir``'s lock for the rest of this process (the OS releases it at exit); a no-op when this
    process holds it already. For a holder without an enclosing ``with`` (rank 0 under plain torchrun: the
    lock names torchrun too, and its run id as the marker when it has one of its own)."""
    lock = RunLock(run_dir, command).acquire()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id:
        lock.record([os.getppid()], marker=f"TORCHELASTIC_RUN_ID={run_id}" if run_id != "none" else None)
    return lock


def record_run_processes(run_dir: str | os.PathLike, pids, marker: str | None = None) -> None:
    """``RunLock.record`` on the lock this process holds on ``run_dir`` (nothing when it holds none)."""
    lock = _held.get(Path(run_dir).resolve())
    if lock is not None:
        lock.record(pids, marker)


# Stopping a run (SIGINT, SIGTERM): the exit codes and messages every command shares.

class Stopped(EmbedscaleError):
    """The run was stopped by a signal (SIGINT, SIGTERM); ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"stopped by {signal.Signals(self.signum).name}" + (f"; {detail}" if detail else ""))


class StopRequested(KeyboardInterrupt):
    """Raised in the main thread by :func:`stop_on_signals`' handler; a KeyboardInterrupt, so ``except
    Exception`` does not swallow it and ``finally``/``except BaseException`` clean-ups (``io.atomic_open``
    removes its temporary file) run on the way out."""

    def __init__(self, signum: int):
        super().__init__(int(signum))
        self.signum = int(signum)


_stop_signal: int | None = None


def stop_requested() -> int | None:
    """The stop signal this process received under :func:`stop_on_signals`, if any."""
    return _stop_signal


def _raise_stop(signum, frame) -> None:
    global _stop_signal
    if _stop_signal is not None:
        return  # a second signal while unwinding: the first one is already on its way
    _stop_signal = signum
    raise StopRequested(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`StopRequested` in the main thread while inside (a single-process run,
    or one rank); the previous handlers come back after. Outside the main thread it does nothing."""
    global _stop_signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    if _raise_stop not in old.values():  # the outermost: a new command (in-process callers run several)
        _stop_signal = None
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
