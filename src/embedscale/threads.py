"""Threads of a process that trains or serves: torch's intra-op threads and OpenMP's wait policy.

On a machine whose cores other work keeps busy, OpenMP's default wait policy makes a thread that finished its
share of an operator spin for the others, on a core that the others need: small training steps on 2 cores that
two busy loops (and other work) kept busy ran at 97 samples/s with torch's defaults (2 threads, OpenMP's default
policy), 1,007 with one thread and 5,359 with 2 threads and the passive policy (``benchmarks/bench_threads.py``,
medians of 3 interleaved rounds). So every ``embedscale`` command sets ``OMP_WAIT_POLICY=PASSIVE`` before torch
is imported (the OpenMP runtime reads it when it loads; torchrun's ranks inherit it) and gives a process
``available cores // local ranks`` intra-op threads (the cores this process may run on, ``os.sched_getaffinity``,
shared by the ranks of one machine), at least one.

What the user set wins: ``OMP_WAIT_POLICY`` and ``OMP_NUM_THREADS`` as given, and ``EMBEDSCALE_THREADS``:
``auto`` (the default: the rule above), ``torch`` (leave torch's and OpenMP's defaults alone) or a number of
threads.

The same processes keep the memory a step frees for the next step (:func:`keep_freed_memory`): by default glibc's
``malloc`` hands a freed heap top above a few MB back to the kernel and serves a block of a few MB by ``mmap``,
so every step's activations (MBs each at DLRM's batch sizes) are faulted in page by page again: the dense
forward of OPER Table 1's DLRM at 2,048 samples on one thread took 1,431 page faults and 32.7 ms of CPU a step
so, none and 30.4 ms with the freed memory kept (forward + backward 96.5 and 94.2 ms;
``benchmarks/bench_malloc.py``). ``GLIBC_TUNABLES`` or a ``MALLOC_*`` variable the user set, or
``EMBEDSCALE_THREADS=torch``, leave ``malloc`` as it is.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, MutableMapping

from embedscale.errors import ConfigError

KNOB = "EMBEDSCALE_THREADS"
WAIT_POLICY = "PASSIVE"
HEAP_KEPT = 256 << 20  # bytes of freed heap top malloc keeps for reuse (M_TRIM_THRESHOLD)
MMAP_ABOVE = 32 << 20  # blocks served by mmap from this size (M_MMAP_THRESHOLD; glibc's largest)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_per_process(cores: int, local_ranks: int = 1) -> int:
    """Intra-op threads of one of ``local_ranks`` processes sharing ``cores``: an equal share, at least one."""
    return max(1, int(cores) // max(1, int(local_ranks)))


def _knob(env: MutableMapping[str, str]) -> str:
    v = env.get(KNOB, "auto").strip().lower() or "auto"
    if v in ("auto", "torch") or (v.isdigit() and int(v) > 0):
        return v
    raise ConfigError(f"{KNOB}={env[KNOB]!r}: expected auto, torch or a positive number of threads")


def set_wait_policy(env: MutableMapping[str, str] = os.environ) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless set (or ``EMBEDSCALE_THREADS=torch``); call before torch is imported."""
    if _knob(env) != "torch":
        env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def chosen_threads(env: MutableMapping[str, str] = os.environ, cores: int | None = None) -> int | None:
    """This process's intra-op threads by the rule (module docstring), or ``None`` to leave torch's count (the
    user's ``OMP_NUM_THREADS``, which torch read, or ``EMBEDSCALE_THREADS=torch``). Under torchrun the ranks of
    this machine (``LOCAL_WORLD_SIZE``) share the cores."""
    knob = _knob(env)
    if knob == "torch":
        return None
    if knob != "auto":
        return int(knob)
    if "OMP_NUM_THREADS" in env:
        return None
    return threads_per_process(available_cores() if cores is None else cores, int(env.get("LOCAL_WORLD_SIZE", "1")))


def keep_freed_memory(env: MutableMapping[str, str] = os.environ) -> bool:
    """Have glibc's ``malloc`` keep up to :data:`HEAP_KEPT` bytes of freed heap for reuse and serve blocks below
    :data:`MMAP_ABOVE` from the heap (module docstring), unless the user tuned ``malloc`` or chose torch's
    defaults. Returns whether it did (``False`` also where the C library has no ``mallopt``)."""
    if _knob(env) == "torch" or "GLIBC_TUNABLES" in env or any(k.startswith("MALLOC_") for k in env):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_ABOVE)) and bool(mallopt(_M_TRIM_THRESHOLD, HEAP_KEPT))


def apply_threads(env: MutableMapping[str, str] = os.environ) -> int | None:
    """Set torch's intra-op threads by :func:`chosen_threads` (and keep freed memory, :func:`keep_freed_memory`);
    returns the count in effect. Before torch is imported the setting waits for its import (:class:`_AfterImport`)
    and this returns ``None``: a command that never needs torch (a launcher of ranks, ``data``, ``plan``) never
    loads it."""
    global _pending
    keep_freed_memory(env)
    if "torch" in sys.modules:
        return _set_threads(env)
    if _pending is None:
        _pending = _AfterImport("torch", lambda: _set_threads(env))
        sys.meta_path.insert(0, _pending)
    return None


def _set_threads(env: MutableMapping[str, str]) -> int:
    torch = sys.modules["torch"]
    n = chosen_threads(env)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` once the module ``name`` has been imported the first time, by whoever imports it."""

    def __init__(self, name: str, then: Callable[[], object]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            global _pending
            load(module)
            _pending = None
            self.then()

        spec.loader.exec_module = exec_module
        return spec


_pending: _AfterImport | None = None


def rank_env(nproc: int, env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The thread settings of ``nproc`` local ranks a command launches: ``OMP_NUM_THREADS`` of each (an equal
    share of the available cores) unless the user set it or ``EMBEDSCALE_THREADS`` says otherwise."""
    knob = _knob(env)
    if knob == "torch" or "OMP_NUM_THREADS" in env:
        return {}
    n = int(knob) if knob != "auto" else threads_per_process(available_cores(), nproc)
    return {"OMP_NUM_THREADS": str(n)}
