"""Which rank stopped answering, and in which collective: a heartbeat per rank and the collective in flight.

A collective that waits for a rank that is frozen (SIGSTOP), swapped out or on a lost node fails after the
process group's timeout (``dist.timeout_s``) with gloo's words ("Timed out waiting 10000ms for recv"), which
name a socket, not a rank. Two records make the error name both:

- every rank beats into the launch's store (a counter per rank, :data:`BEAT_S` apart) from a daemon thread on a
  store connection of its own. A rank whose counter stands still for a few beats is frozen or gone (a process
  that is alive but stuck in Python still beats: the run's monitored barrier finds that one);
- every collective a rank starts through ``torch.distributed`` is recorded (its name and the function that called
  it, :func:`track_collectives`): the last one is the one the rank waits in.

:func:`diagnose` reads the counters twice, :data:`STALE_S` apart, and returns the ranks that did not beat; the
error it words (:class:`PeerLost`) ends the rank at once (``os._exit`` after the message: gloo's threads may
still wait on the frozen peer, and an orderly interpreter exit would wait with them), so every other rank ends
with the error within the timeout plus about ``STALE_S``.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import sys
import threading
import time

import torch.distributed as dist

from embedscale.errors import EmbedscaleError

BEAT_S = 0.25  # how often a rank beats
STALE_S = 1.5  # a rank whose counter did not move over this long is taken as stopped
STORE_TIMEOUT_S = 3.0  # a store operation of the watchdog waits at most this long
TRACKED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast",
           "barrier", "reduce_scatter_tensor", "gather", "scatter", "send", "recv", "monitored_barrier")
_state: dict = {"last": None, "beat": None}


class PeerLost(EmbedscaleError):
    """A collective failed because other ranks stopped answering; names them and the collective. The rank
    ends at once after saying so (``exit_now``)."""

    exit_now = True


def _tracked(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        f = sys._getframe(1)
        _state["last"] = (name, f"{f.f_globals.get('__name__', '?')}.{f.f_code.co_name}", time.monotonic())
        return fn(*args, **kwargs)

    call._embedscale_tracked = True  # type: ignore[attr-defined]
    return call


def track_collectives() -> None:
    """Record every collective started through ``torch.distributed.<name>`` (:data:`TRACKED`) in this process:
    its name, its caller and when (a dictionary write per call). Idempotent."""
    for name in TRACKED:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_embedscale_tracked", False):
            setattr(dist, name, _tracked(name, fn))


def last_collective() -> str:
    """The collective this rank started last, as ``all_reduce (from module.function, 12 s ago)``."""
    last = _state["last"]
    if last is None:
        return "a collective"
    name, caller, t = last
    return f"{name} (called from {caller}, {time.monotonic() - t:.0f} s ago)"


class Heartbeat:
    """This rank's beat into ``PREFIX/<rank>`` of the launch's store (``MASTER_ADDR:MASTER_PORT``), from a
    daemon thread on a connection of its own, and its watch over the others' beats: a rank whose counter stood
    still for ``timeout_s`` (the process group's) ends this rank with an error naming it and the collective
    this rank is in (:meth:`_lost`), whatever this rank is doing, so every rank ends within the timeout of the
    stop (plus a poll), not of its own next collective's start. A poll that finds this rank itself was frozen
    (a gap of several polls: the whole run stopped and continued) judges nobody on that gap. The watch ends
    with :func:`stop_watch` (a rank leaving the group: the others may end before it); the store's loss ends
    the thread quietly (rank 0's node is gone; the collectives' errors tell the rest)."""

    def __init__(self, rank: int, world: int, token: str, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.prefix = f"embedscale/beat/{token}"
        self.store = self._connect()
        self.keys = [str(r) for r in range(world)]
        for k in self.keys:  # every counter exists from now on (multi_get never waits for a missing key)
            self.store.add(k, 0)
        self.watching = True
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, name="embedscale-heartbeat", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """End the thread and drop its connection while the interpreter is whole (a thread left in the store's
        C++ code at exit can abort the process, as gloo's can: ``launch._destroy_at_exit``)."""
        self.watching = False
        self.ended.set()
        self.thread.join(timeout=BEAT_S + 2 * STORE_TIMEOUT_S)
        self.store = None

    def _connect(self):
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
                              wait_for_workers=False)
        return dist.PrefixStore(self.prefix, store)

    def _run(self) -> None:
        last = [-1] * self.world
        self.changed = changed = [time.monotonic()] * self.world
        prev = time.monotonic()
        while not self.ended.wait(BEAT_S):
            try:
                self.store.add(self.keys[self.rank], 1)
                now_counts = [int(v) for v in self.store.multi_get(self.keys)]
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read the beats
                return
            now = time.monotonic()
            if now - prev > 4 * BEAT_S + STORE_TIMEOUT_S:  # this rank was frozen itself: judge nobody on the gap
                self.changed = changed = [now] * self.world
            prev = now
            for r, c in enumerate(now_counts):
                if c != last[r]:
                    last[r], changed[r] = c, now
            lost = [r for r in range(self.world) if r != self.rank and now - changed[r] > self.timeout_s]
            if lost and self.watching:
                self._lost(lost, now - min(changed[r] for r in lost))

    def _lost(self, ranks: list[int], silent_s: float) -> None:
        """End this rank: the ``ranks`` stopped beating ``silent_s`` ago (``os._exit``: the main thread may
        wait in a collective that never returns)."""
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        print(f"error: rank {self.rank}: {who} stopped answering (no heartbeat for {silent_s:.0f} s: frozen, killed "
              f"or its node lost; timeout dist.timeout_s = {self.timeout_s:g} s); this rank was in "
              f"{last_collective()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)

    def stale_ranks(self) -> list[int] | None:
        """The ranks whose counter did not move over :data:`STALE_S` (read on a fresh connection: the beating
        thread's may be mid-call); ``None`` when the store does not answer."""
        try:
            store = self._connect()
            a = [int(v) for v in store.multi_get(self.keys)]
            time.sleep(STALE_S)
            b = [int(v) for v in store.multi_get(self.keys)]
        except Exception:  # noqa: BLE001 - the store's host is gone (or frozen)
            return None
        return [r for r in range(self.world) if r != self.rank and a[r] == b[r]]


def lost_note() -> str:
    """Why a rank told to stop (torchrun ends a node's ranks once one failed) was stopped, when its watch saw
    peers silent for half the timeout or more: ``"; rank 1 stopped answering ..."``; else ``""``."""
    beat = _state["beat"]
    if beat is None or not beat.watching:
        return ""
    now = time.monotonic()
    silent = {r: now - t for r, t in enumerate(beat.changed) if r != beat.rank}
    lost = [r for r, s in silent.items() if s >= max(STALE_S, beat.timeout_s / 2)]
    if not lost:
        return ""
    return (f"; rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} stopped answering (no heartbeat for "
            f"{max(silent[r] for r in lost):.0f} s; timeout dist.timeout_s = {beat.timeout_s:g} s), this rank was in "
            f"{last_collective()}")


def stop_watch() -> None:
    """This rank leaves the group: stop judging the others (they may end before it); it keeps beating."""
    if _state["beat"] is not None:
        _state["beat"].watching = False


_COLLECTIVE_WORDS = ("gloo", "nccl", "timed out waiting", "connection closed by peer", "connection reset by peer",
                     "pair closure", "processgroup")


def collective_failure(err: BaseException) -> bool:
    """Whether ``err`` reads as a failed collective (gloo's or NCCL's words), not an error of this rank's own."""
    text = str(err).lower()
    return any(w in text for w in _COLLECTIVE_WORDS)


def start(rank: int, world: int, token: str, timeout_s: float) -> Heartbeat | None:
    """Track this rank's collectives and start its heartbeat and watch (several ranks only; ``None`` when the
    store cannot be reached, which the process group would have found first)."""
    if world <= 1:
        return None
    track_collectives()
    if _state["beat"] is None:
        try:
            _state["beat"] = Heartbeat(rank, world, token, timeout_s)
            atexit.register(stop)
        except Exception:  # noqa: BLE001 - no heartbeat: the diagnosis falls back to the monitored barrier
            _state["beat"] = None
    return _state["beat"]


def stop() -> None:
    """End this rank's heartbeat (a rank leaving the group, and at exit)."""
    beat, _state["beat"] = _state["beat"], None
    if beat is not None:
        beat.close()


def diagnose() -> tuple[list[int] | None, str]:
    """``(stopped ranks or None when unknown, the collective in flight)`` (:class:`Heartbeat.stale_ranks`,
    :func:`last_collective`)."""
    beat = _state["beat"]
    return (beat.stale_ranks() if beat is not None else None), last_collective()
