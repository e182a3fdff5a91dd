"""A run's life through the real CLI (subprocesses): SIGTERM/SIGINT to the launcher end every process of the
run and exit 143/130 with one line and no traceback, leaving no temporary file; one run per run directory
(RUN_DIR/run.lock): a second run into a held directory fails at once naming the holder and changes nothing,
while the first completes as it would have; a stale lock naming a dead process is taken over.

The process tree is read from /proc here (independently of the launcher's own bookkeeping): every process
descended from the launcher, plus every process in a session one of them leads (torchrun starts each rank
in a session of its own), recorded before the signal; none may be alive (zombies count as gone) after."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from embedscale.train.launcher import KILL_WAIT_S, STOP_GRACE_S, end_run_processes, run_processes
from embedscale.train.lock import LOCK_NAME, RunDirBusy, RunLock, read_holder

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")

START_TIMEOUT_S = 240  # data generation, planning and torchrun start under a loaded machine
# the bar is "no process of the run after 10 s" (on a machine with cores to spare). Not asserted as a
# wall-clock time: at a load average of 30 on 2 cores a single process took 39 s of wall time to unwind and
# exit (its share of a core is a fifteenth). What is asserted: the launcher exits by itself on the signal
# (within STOP_WAIT_S, or the test fails) and no process of the run outlives it.
STOP_WAIT_S = 300


def cli(run_dir: Path, out_dir: Path, *, nproc: int | None, max_steps: int, every: int = 5, extra=()) -> list[str]:
    """``embedscale train`` of a tiny synthetic run (``nproc=None``: no --nproc, as under plain torchrun)."""
    return [sys.executable, "-m", "embedscale", "train", "--no-progress", "--run-dir", str(run_dir),
            *(["--nproc", str(nproc)] if nproc else []), "--out-dir", str(out_dir),
            "--data-synthetic-preset", "criteo-kaggle-tiny",
            "--data-train-samples", "20000", "--data-eval-samples", "2000", "--train-batch-size", "64",
            "--train-max-steps", str(max_steps), "--train-checkpoint-every", str(every), "--train-log-every", "5",
            *extra]


def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, session, state) from /proc/*/stat."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            f = stat[stat.rfind(")") + 2:].split()
            out[int(name)] = (int(f[1]), int(f[3]), f[0])
    return out


def tree(root: int) -> set[int]:
    """``root``'s live descendants and the members of the sessions they lead."""
    t = proc_table()
    found, stack = set(), [root]
    while stack:
        p = stack.pop()
        for pid, (ppid, _, _) in t.items():
            if ppid == p and pid not in found:
                found.add(pid)
                stack.append(pid)
    found |= {pid for pid, (_, sid, _) in t.items() if sid in found}
    return {p for p in found if t[p][2] not in "ZX"}


def alive(pids: set[int]) -> set[int]:
    t = proc_table()
    return {p for p in pids if p in t and t[p][2] not in "ZX"}


def signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_for(what: str, cond, proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = cond()
        if v:
            return v
        if proc.poll() is not None:
            err = proc.communicate()[1] if proc.stderr else ""
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{(err or '')[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no {what} within {timeout_s} s")


def checkpoints(run_dir: Path) -> list[Path]:
    d = run_dir / "checkpoints"
    return sorted(p for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lifecycle-runs")  # shared: the synthetic data is generated once


@pytest.mark.parametrize("nproc,sig", [(2, signal.SIGTERM), (2, signal.SIGINT), (1, signal.SIGTERM),
                                       (1, signal.SIGINT)],
                         ids=["2ranks-SIGTERM", "2ranks-SIGINT", "single-SIGTERM", "single-SIGINT"])
def test_signal_ends_every_process_of_the_run(tmp_path, out_dir, nproc, sig):
    rd = tmp_path / "run"
    log = tmp_path / "stderr.txt"  # a file, not a pipe: a rank left behind must not hang the test
    procs: set[int] = set()
    with open(log, "w") as f:
        p = subprocess.Popen(cli(rd, out_dir, nproc=nproc, max_steps=10**6, every=3, extra=["--train-epochs", "100"]),
                             stdout=subprocess.DEVNULL, stderr=f, text=True)
    try:
        wait_for("checkpoint", lambda: checkpoints(rd), p)
        procs = tree(p.pid)
        if nproc > 1:  # torchrun and its 2 ranks (at least) are running
            assert len(procs) >= 3, procs
        p.send_signal(sig)
        p.wait(timeout=STOP_WAIT_S)
        left = alive(procs)
    finally:
        if p.poll() is None:
            p.kill()
        signal_all(alive(procs), signal.SIGKILL)  # whatever a failing launcher left behind
    err = log.read_text()
    assert p.returncode == 128 + sig, (p.returncode, err[-3000:])
    assert not left, f"processes of the run still alive after the launcher exited: {sorted(left)}"
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: stopped by {signal.Signals(sig).name}; "), last
    assert str(rd) in last, last
    tmp = [str(x) for x in rd.rglob("*.tmp")]
    assert not tmp, f"half-written files left: {tmp}"
    # the last checkpoint is complete: every file of it loads
    ck = checkpoints(rd)[-1]
    for f in ([ck] if ck.is_file() else sorted(ck.glob("*.pt"))):
        torch.load(f, weights_only=True)
    assert read_holder(rd).get("pid") in (None, p.pid)  # the lock is free again (OS released it at exit)
    with RunLock(rd, "test"):
        pass


def _held(rd: Path, pid: int) -> bool:
    return read_holder(rd).get("pid") == pid


@pytest.mark.parametrize("nproc", [2, 1], ids=["2ranks", "single"])
def test_second_run_into_held_dir_fails_and_first_completes(tmp_path, out_dir, nproc):
    """While the first run trains, a second run into its directory (the launcher; and for 2 ranks a plain
    torchrun, where rank 0 takes the lock) fails at once naming the holder; config.yaml is untouched and the
    first run ends normally with its own config and summary. The first run is frozen (SIGSTOP to all its
    processes, which keeps its lock) while the others try, so it cannot finish before them however loaded
    the machine is; SIGCONT lets it go on."""
    rd = tmp_path / "run"
    steps = 40 if nproc > 1 else 60  # the first run is frozen while the others try: it need not be long
    first = subprocess.Popen(cli(rd, out_dir, nproc=nproc, max_steps=steps, every=10, extra=["--json"]),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen: list[int] = []
    members: set[int] = set()
    try:
        wait_for("first checkpoint", lambda: _held(rd, first.pid) and checkpoints(rd), first)
        members = tree(first.pid)
        frozen = [first.pid, *members]
        signal_all(frozen, signal.SIGSTOP)
        holder = read_holder(rd)
        cfg_path = rd / "config.yaml"
        before = (cfg_path.read_bytes(), cfg_path.stat().st_mtime_ns, cfg_path.stat().st_ino)
        assert b"lr_dense: 0.777" not in before[0]
        # the first run is frozen: the second can only end by failing on the lock (no wall-clock assert)
        second = subprocess.run(cli(rd, out_dir, nproc=nproc, max_steps=7, extra=["--train-lr-dense", "0.777"]),
                                capture_output=True, text=True, timeout=600)
        assert second.returncode == 2, (second.returncode, second.stderr[-3000:])
        msg = second.stderr.strip().splitlines()[-1]
        assert msg.startswith("error: ") and str(rd) in msg, msg
        for part in (f"pid {first.pid}", f"host {socket.gethostname()}", f"started {holder['started']}"):
            assert part in msg, (part, msg)
        assert "Traceback" not in second.stderr
        after = (cfg_path.read_bytes(), cfg_path.stat().st_mtime_ns, cfg_path.stat().st_ino)
        assert after == before, "the second run changed config.yaml"
        if nproc > 1:  # plain torchrun, no launcher: rank 0 takes the lock, and every rank ends promptly
            plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node=2", "-m", "embedscale",
                                    *cli(rd, out_dir, nproc=None, max_steps=7,
                                         extra=["--train-lr-dense", "0.777"])[3:]],
                                   capture_output=True, text=True, timeout=600,
                                   env={k: v for k, v in os.environ.items() if k != "EMBEDSCALE_LAUNCHED"})
            assert plain.returncode != 0
            assert f"pid {first.pid}" in plain.stderr and f"started {holder['started']}" in plain.stderr, \
                plain.stderr[-3000:]
            assert (cfg_path.read_bytes(), cfg_path.stat().st_mtime_ns) == before[:2]
        assert first.poll() is None
        signal_all(frozen, signal.SIGCONT)
        frozen = []
        out, err = first.communicate(timeout=600)
    finally:
        signal_all(frozen, signal.SIGCONT)
        if first.poll() is None:
            first.kill()
            signal_all(alive(members), signal.SIGKILL)
    assert first.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == steps, summary
    assert cfg_path.read_bytes() == before[0]
    assert json.loads((rd / "summary.json").read_text())["steps"] == steps
    assert read_holder(rd) == {}  # released at the end: the directory can be resumed by a later run


def test_stale_lock_is_taken_over(tmp_path, out_dir):
    rd = tmp_path / "run"
    rd.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"pid": dead.pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00+00:00",
             "command": "embedscale train (killed)"}
    (rd / LOCK_NAME).write_text(json.dumps(stale) + "\n")
    p = subprocess.run(cli(rd, out_dir, nproc=1, max_steps=4, every=2), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "stale lock" in ln]
    assert len(lines) == 1 and f"pid {dead.pid}" in lines[0] and "no longer running" in lines[0], p.stderr[-3000:]
    assert (rd / "summary.json").exists()
    assert read_holder(rd) == {}


HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "S0",
                         "command": "holder"}).encode())
print("held", flush=True)
time.sleep(600)
"""


def test_lock_against_another_process_then_taken_over_when_it_dies(tmp_path, capfd):
    """RunLock against a plain flock holder (an independent implementation of the protocol): busy while it
    lives, naming it; once it is SIGKILLed (no clean-up: the file still names it) taken over with one line."""
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.yaml").write_text("x: 1\n")
    h = subprocess.Popen([sys.executable, "-c", HOLDER, str(rd / LOCK_NAME)], stdout=subprocess.PIPE, text=True)
    try:
        assert h.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"{rd}.*pid {h.pid} on host {socket.gethostname()}, started S0"):
            RunLock(rd, "second").acquire()
        assert sorted(x.name for x in rd.iterdir()) == ["config.yaml", LOCK_NAME]
        assert read_holder(rd)["pid"] == h.pid  # the failed attempt wrote nothing
    finally:
        h.kill()
        h.wait()
    capfd.readouterr()
    with RunLock(rd, "third") as lock:
        assert "taking over the stale lock" in capfd.readouterr().err
        assert read_holder(rd)["pid"] == os.getpid() and read_holder(rd)["command"] == "third"
        with RunLock(rd, "nested"):  # the same process: nests instead of failing on itself
            pass
        assert lock.held and read_holder(rd)["command"] == "third"
        # another process cannot take it while we hold it
        other = subprocess.run([sys.executable, "-c", ("import sys; from embedscale.train.lock import RunLock;"
                                                      "RunLock(sys.argv[1]).acquire()"), str(rd)], capture_output=True, text=True)
        assert other.returncode != 0 and f"pid {os.getpid()}" in other.stderr and "RunDirBusy" in other.stderr
    assert read_holder(rd) == {}


def test_stop_on_signals_raises_in_process_and_restores_handlers():
    """In one process SIGTERM becomes StopRequested (so clean-ups run) and the handlers come back after."""
    from embedscale.train.lock import StopRequested, stop_on_signals, stop_requested

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopRequested) as e, stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes
            time.sleep(0.01)
    assert e.value.signum == signal.SIGTERM and stop_requested() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    with stop_on_signals():
        assert stop_requested() is None  # a new command starts clean


_IGNORES_TERM = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank stuck where it cannot act on SIGTERM
print("ready", flush=True)
time.sleep(600)
"""


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace():
    """The 10 s bar by construction: the launcher ends torchrun at once, gives the ranks ``STOP_GRACE_S`` after
    SIGTERM, then SIGKILLs what is left and waits ``KILL_WAIT_S``. A rank that ignores SIGTERM is gone after
    that, whatever the load (the waits are deadlines, not sleeps to count on)."""
    assert STOP_GRACE_S + 2 * KILL_WAIT_S <= 11.0  # the stop budget fits the 10 s bar (+ polling)
    torchrun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    rank = subprocess.Popen([sys.executable, "-c", _IGNORES_TERM], start_new_session=True, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        sessions = {rank.pid}
        assert run_processes(torchrun.pid, sessions) >= {torchrun.pid, rank.pid}
        t0 = time.monotonic()
        found = end_run_processes(torchrun, sessions, grace_s=1.0)
        waited = time.monotonic() - t0
        assert found >= 2
        assert rank.wait(timeout=60) == -signal.SIGKILL  # SIGTERM was ignored: the escalation ended it
        assert torchrun.wait(timeout=60) == -signal.SIGKILL
        assert waited >= 1.0  # the rank had its grace before SIGKILL
        assert not run_processes(torchrun.pid, sessions)
    finally:
        for p in (rank, torchrun):
            if p.poll() is None:
                p.kill()
                p.wait()


def children(pids: set[int], of: set[int]) -> set[int]:
    """The members of ``pids`` whose parent is in ``of`` (read from /proc now)."""
    t = proc_table()
    return {p for p in pids if p in t and t[p][0] in of}


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """Wait up to ``timeout_s`` for ``pids`` to end; the ones still alive then."""
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


GONE_S = 10.0  # the bar: no process of the run 10 s after its launcher was SIGKILLed


def test_sigkill_of_the_launcher_ends_the_run_and_the_lock_waits_for_it(tmp_path, out_dir, capfd):
    """SIGKILL of the launcher (no handler of it runs): torchrun and the ranks end with it. One rank is frozen
    (SIGSTOP) first, so that a process of the killed run is certainly alive, however loaded the machine: torchrun
    and the other rank are gone within 10 s all the same; a new run into the directory is then refused naming
    the frozen rank's pid; let go (SIGCONT), that rank is gone within 10 s too, its PGAS heap left no segment,
    and the directory is taken over. The processes are found from /proc (the launcher's descendants), not
    from what the run recorded."""
    rd = tmp_path / "run"
    shm = tmp_path / "shm"
    shm.mkdir()
    log = tmp_path / "stderr.txt"
    env = {**os.environ, "EMBEDSCALE_SHM_DIR": str(shm)}
    with open(log, "w") as f:
        p = subprocess.Popen(cli(rd, out_dir, nproc=2, max_steps=10**6, every=3,
                                 extra=["--train-epochs", "100", "--dist-transport", "pgas"]),
                             stdout=subprocess.DEVNULL, stderr=f, text=True, env=env)
    procs: set[int] = set()
    frozen: set[int] = set()
    try:
        wait_for("checkpoint", lambda: checkpoints(rd), p)
        procs = tree(p.pid)
        torchrun = children(procs, {p.pid})
        ranks = children(procs, torchrun)
        assert len(torchrun) == 1 and len(ranks) == 2, (procs, torchrun, ranks)
        holder = read_holder(rd)  # the lock lists the launcher, torchrun and the ranks (the launcher's polls)
        assert {p.pid, *torchrun, *ranks} <= {e[0] for e in holder["processes"]}, holder
        frozen = {max(ranks)}
        signal_all(frozen, signal.SIGSTOP)
        p.kill()
        p.wait(timeout=60)
        left = wait_gone(procs - frozen, GONE_S)
        assert not left, f"torchrun or a rank outlived the SIGKILLed launcher by {GONE_S} s: {sorted(left)}"
        assert alive(frozen) == frozen
        second = subprocess.run(cli(rd, out_dir, nproc=1, max_steps=4), capture_output=True, text=True, timeout=600)
        assert second.returncode == 2, (second.returncode, second.stderr[-3000:])
        msg = second.stderr.strip().splitlines()[-1]
        assert msg.startswith("error: ") and str(rd) in msg and "pids" in msg, msg
        assert str(next(iter(frozen))) in msg and f"pid {p.pid}" in msg, msg
        assert "Traceback" not in second.stderr and "stale lock" not in second.stderr
        signal_all(frozen, signal.SIGCONT)
        left = wait_gone(frozen, GONE_S)
        assert not left, f"the frozen rank outlived its launcher by {GONE_S} s after SIGCONT: {sorted(left)}"
        frozen = set()
    finally:
        signal_all(alive(procs), signal.SIGKILL)  # whatever a failing run left behind
        signal_all(frozen, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not list(shm.iterdir()), f"shared-memory segments left: {sorted(x.name for x in shm.iterdir())}"
    capfd.readouterr()
    with RunLock(rd, "after"):  # nothing of the run lives: the stale hold is taken over
        assert "taking over the stale lock" in capfd.readouterr().err


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat (starttime), read here independently of the lock's own reader."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2:].split()[19])


def test_lock_is_refused_while_a_listed_or_marked_process_lives(tmp_path, capfd):
    """A lock file whose holder died (no flock) but which lists a live process by pid and start time, or names a
    marker that a live process carries in its environment, is refused naming that pid; the same pid with another
    start time (a reused pid) or a marker nobody carries is a stale hold, taken over."""
    rd = tmp_path / "run"
    rd.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    marker = f"EMBEDSCALE_LAUNCH_ID=test-{os.getpid()}-{time.monotonic_ns()}"
    name, value = marker.split("=")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, name: value})
    try:
        base = {"pid": dead.pid, "host": socket.gethostname(), "started": "S0", "command": "killed launcher"}
        cases = [({"processes": [[dead.pid, None], [rank.pid, _start_ticks(rank.pid)]]}, True),
                 ({"processes": [[rank.pid, _start_ticks(rank.pid) + 1]]}, False),  # the pid of another process now
                 ({"processes": [[dead.pid, None]], "marker": marker}, True),
                 ({"processes": [[dead.pid, None]], "marker": marker + "x"}, False)]
        for extra, busy in cases:
            (rd / LOCK_NAME).write_text(json.dumps({**base, **extra}) + "\n")
            capfd.readouterr()
            if busy:
                with pytest.raises(RunDirBusy, match=rf"{rd}.*pids {rank.pid} .*pid {dead.pid}"):
                    RunLock(rd, "second").acquire()
                assert read_holder(rd) == {**base, **extra}  # the refused attempt wrote nothing
            else:
                with RunLock(rd, "second"):
                    assert "taking over the stale lock" in capfd.readouterr().err
    finally:
        rank.kill()
        rank.wait()
