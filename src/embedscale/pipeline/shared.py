"""One copy of the host tables per machine, shared by its local ranks (EL-Rec section V-A).

EL-Rec keeps the large tables in the host memory of a node, served to the trainers of that node. With several
data-parallel ranks on one machine, :class:`HostParameterServer` can hold one replica per rank (every rank
applies every update to its own copy) or, with :class:`SharedHostStorage`, one copy in a shared-memory file
that every local rank maps:

* **memory**: the tables and their optimizer state exist once per machine, not once per rank;
* **update**: every rank knows every rank's per-row updates of a step (the data-parallel exchange of
  :mod:`embedscale.pipeline.embedding`), so each applies only its stripe of rows (``row % ranks == rank``)
  and every row is updated exactly once, by the same arithmetic as in a replica;
* **read-after-write**: a rank reads rows for the next batch only once every local rank has applied as
  many gradient batches as it has itself (one int64 counter per rank in the file's header), so a read sees
  every row as one server that applied those batches would; rows of batches still in flight are patched
  by the life-cycle cache as before.

The file is created by the group's first rank, mapped by the others, and unlinked as soon as all have
mapped it: nothing is left in ``/dev/shm`` after the run, however it ends. Host memory only (a GPU trainer
still reads the rows through the server's copy to its device).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

from embedscale.comm.pgas import _align, shm_dir
from embedscale.errors import ConfigError
from embedscale.pipeline.queues import PipelineError

_LINE = 64


class SharedHostStorage:
    """A shared-memory file holding a server's flat ``weights`` and ``momentum`` plus per-rank counters.

    A collective call over ``group`` (the ranks of one machine). The group's first rank copies its
    (initialised) tensors in; the others' tensors are only read for their sizes.

    Attributes:
        weights, momentum: tensors on the shared file (``momentum`` ``None`` for SGD).
        rank, size: this rank's index in ``group`` and the group's size.
    """

    def __init__(self, weights: torch.Tensor, momentum: torch.Tensor | None, group, *,
                 timeout_s: float = 300.0) -> None:
        if not weights.is_cpu:
            raise ConfigError("a shared host parameter server keeps its tables in host memory; got weights on "
                              f"{weights.device}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        header = _align(self.size * 8, _LINE)
        wbytes = weights.numel() * weights.element_size()
        mbytes = momentum.numel() * momentum.element_size() if momentum is not None else 0
        total = header + _align(wbytes, _LINE) + max(mbytes, _LINE)
        token = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
        job = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
        job = "".join(c if c.isalnum() or c in "_.-" else "_" for c in job)[:40]
        self.path = os.path.join(shm_dir(), f"embedscale-ps-{job}-{int(token):016x}")
        self._mm = None
        err = 0
        if self.rank == 0:
            try:
                self._mm = self._map(total, create=True)
            except OSError as e:
                err = e.errno or -1
        self._check(err, f"could not create the shared host tables {self.path} ({total / 2**20:.1f} MiB)")
        if self._mm is not None:  # first rank: counters zero, its initialised tables in
            np.frombuffer(self._mm, dtype=np.int64, count=self.size)[:] = 0
        err = 0
        if self.rank != 0:
            try:
                self._mm = self._map(total, create=False)
            except OSError as e:
                err = e.errno or -1
        self._check(err, f"could not map the shared host tables {self.path}")
        if self.rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # every rank has it mapped: no name is left behind
        self.counters = np.frombuffer(self._mm, dtype=np.int64, count=self.size)
        self.weights = torch.frombuffer(self._mm, dtype=weights.dtype, count=weights.numel(), offset=header)
        self.momentum = None
        if momentum is not None:
            self.momentum = torch.frombuffer(self._mm, dtype=momentum.dtype, count=momentum.numel(),
                                             offset=header + _align(wbytes, _LINE))
        if self.rank == 0:
            self.weights.copy_(weights.reshape(-1))
            if momentum is not None:
                self.momentum.copy_(momentum.reshape(-1))
        dist.barrier(group=group)  # the first rank's tables are in before anyone reads

    def _map(self, size: int, create: bool) -> mmap.mmap:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not as SIGBUS later
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def _check(self, err: int, what: str) -> None:
        status = torch.tensor([err], dtype=torch.int64)
        gathered = [torch.zeros_like(status) for _ in range(self.size)]
        dist.all_gather(gathered, status, group=self.group)
        bad = [i for i, s in enumerate(gathered) if int(s)]
        if bad:
            if self._mm is not None and self.rank == 0:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise PipelineError(f"local rank {bad[0]}: {what} (errno {int(gathered[bad[0]])}, in {shm_dir()})")

    # -- update stripes and counters --------------------------------------------------------------
    def stripe(self, rows: torch.Tensor) -> torch.Tensor:
        """Mask of the rows this rank updates (``row % size == rank``)."""
        return rows.remainder(self.size) == self.rank

    def mark_applied(self) -> None:
        """This rank has applied its stripe of one more gradient batch (single writer per counter)."""
        self.counters[self.rank] += 1

    def wait_all_applied(self) -> None:
        """Block until every local rank has applied as many gradient batches as this one."""
        mine = int(self.counters[self.rank])
        if int(self.counters.min()) >= mine:
            return
        t0 = time.monotonic()
        pause = 1e-5
        while int(self.counters.min()) < mine:
            if time.monotonic() - t0 > self.timeout_s:
                lag = [i for i, c in enumerate(self.counters.tolist()) if c < mine]
                raise PipelineError(f"shared host tables: local rank(s) {lag} applied fewer gradient batches "
                                    f"({self.counters.tolist()}) than this rank ({mine}) within "
                                    f"{self.timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def local_group(world: int | None = None):
    """The process group of the ranks on this machine (``LOCAL_WORLD_SIZE`` consecutive ranks per machine, as
    torchrun assigns them; every rank when unset). A collective call: every rank builds every group."""
    world = dist.get_world_size() if world is None else world
    per = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if per <= 0 or world % per:
        raise ConfigError(f"LOCAL_WORLD_SIZE {per} does not divide the world size {world}")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world, per):
        g = dist.new_group(list(range(start, start + per)), backend="gloo")
        if start <= rank < start + per:
            mine = g
    return mine
