"""One-sided (PGAS) communication between the ranks of a host: the symmetric heap and a transport on it.

PGAS paper (Accelerating Multi-GPU Embedding Retrieval with PGAS-Style Communication), section III-B:
instead of collecting messages into a bulk ``all_to_all`` (and unpacking it afterwards), every producer
writes each piece of data, as soon as it exists, straight into the memory of the rank that consumes it,
at the place it is consumed. That needs memory every rank of a host can address: a *symmetric heap*,
one segment per rank, same layout everywhere, so one offset names the same object on every rank (the
"global virtual memory space" of OPER section 5.1).

``SymmetricHeap`` (this module owns it):
    On the host (CPU tensors): one POSIX shared-memory file per rank, mapped by every rank of its host.
    On accelerators: ``torch.distributed._symmetric_memory`` (CUDA symmetric memory) holds the data,
    the control words stay in host shared memory. *The accelerator path is designed for, untested
    here* (this project is tested on CPU only).
    Rendezvous: all ranks agree on a random token (so concurrent jobs never collide), create their
    segment, report success, map every peer's segment, report again, and only then unlink their own
    name. POSIX keeps a mapping alive after its name is gone, so from then on no name exists: nothing
    can outlive the job, whether it ends normally, by an exception or by SIGKILL. If anything fails
    before that point (a rank dies or raises inside the rendezvous), every surviving rank unlinks every
    name of its host before re-raising.
    Completion is signalled per peer, never by a global barrier: each segment starts with control
    words (one 64-byte line each, so writers never share a cache line), written by one rank and read
    by another: sequence numbers in the style of a seqlock's epoch. A writer stores its data, then its
    sequence number; on x86-64 (TSO) stores become visible in program order, so a reader that sees
    the number sees the data. (Weakly ordered CPUs would need a fence between the two: not provided.)

``PgasTransport`` implements the ``Transport`` interface on the heap, so both existing designs of
``ShardedEmbedding`` run on it unchanged: ``exchange`` writes ``send[p]`` into a ring of slots for
this rank inside ``p``'s segment (one-sided writes; a message larger than a slot streams through the
ring, the reader draining it while the writer refills), and reads what every peer wrote into this
rank's rings. There is no count exchange (a slot header carries the size) and no all_to_all. Ranks on
other hosts (host id = ``rank // ranks_per_host``) are reached by a ``CollectiveTransport``; a job on
several hosts uses both in one ``exchange``. The fused paths of ``embedding.pgas_lookup`` write pooled
vectors and read rows directly in the heap and use this exchange only for ids and gradients.

Bytes are counted as ``CollectiveTransport`` counts them: payload bytes written for (received from)
each peer; the 24-byte slot headers go to ``counter.meta``.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import secrets
import signal
import tempfile
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.timeline import Timeline
from embedscale.comm.transport import Transport
from embedscale.errors import ConfigError, EmbedscaleError

_MAGIC = 0x656D6265645F7067  # b"embed_pg"
_LINE = 8  # int64 words per control line: 64 bytes, one cache line
_PAGE = 4096
_ALIGN = 64


class HeapError(EmbedscaleError, RuntimeError):
    """The symmetric heap cannot be set up, or a peer stopped answering; names rank, segment and size."""


def shm_dir() -> str:
    """Where segments are created: ``$EMBEDSCALE_SHM_DIR``, else ``/dev/shm`` (POSIX shm on Linux), else tmp."""
    d = os.environ.get("EMBEDSCALE_SHM_DIR")
    if d:
        return d
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _align(n: int, a: int = _ALIGN) -> int:
    return (int(n) + a - 1) // a * a


def _pid_alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie counts as exited)."""
    if pid <= 0:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


class SymmetricHeap:
    """One segment of ``nbytes`` per rank, mapped by every rank of the same host (a collective call).

    Args:
        nbytes: data bytes of each segment (the maximum over the ranks is used: segments are symmetric).
        num_lines: control lines (64 bytes, eight int64 words each) in front of every segment.
        rank, world_size: this rank and the job's size (default: from ``group``).
        ranks_per_host: ranks per host; host id = ``rank // ranks_per_host`` (default: one host).
        group: the process group whose ranks build the heap together (default: the world).
        device: where the data lives. Host memory: shared-memory files. An accelerator: CUDA symmetric
            memory via ``torch.distributed._symmetric_memory`` (designed for, untested here).
        job_id: part of every segment name (default: torchrun's run id, else ``local``); a random token
            agreed at the rendezvous makes names unique per heap, so concurrent jobs never collide.
        timeout_s: how long a wait for a peer's signal may take before it becomes an error.

    ``view(peer, offset, shape, dtype)`` is a tensor on ``peer``'s segment (any rank of this host,
    this one included); writing into it is a one-sided put, reading from it a one-sided get.
    ``ctrl(peer)`` is the ``[num_lines, 8]`` int64 array of ``peer``'s control lines.
    """

    def __init__(self, nbytes: int, *, num_lines: int = 0, rank: int | None = None, world_size: int | None = None,
                 ranks_per_host: int | None = None, group=None, device: torch.device | str | None = None,
                 job_id: str | None = None, timeout_s: float = 300.0):
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else int(rank)
        self.world_size = dist.get_world_size(group) if world_size is None else int(world_size)
        self.ranks_per_host = self.world_size if not ranks_per_host else int(ranks_per_host)
        if self.ranks_per_host <= 0:
            raise ConfigError(f"symmetric heap: ranks_per_host must be positive, got {ranks_per_host}")
        self.host = self.rank // self.ranks_per_host
        self.local_ranks = [r for r in range(self.world_size) if r // self.ranks_per_host == self.host]
        self.local_index = {r: i for i, r in enumerate(self.local_ranks)}
        self.num_lines = int(num_lines)
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device) if device is not None else None
        self.host_memory = self.device is None or torch.empty(0, device=self.device).is_cpu
        self.job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id or os.environ.get("TORCHELASTIC_RUN_ID") or "local")[:40]
        self._ctrl_bytes = _align((1 + self.num_lines) * _LINE * 8, _PAGE)
        self._maps: dict[int, mmap.mmap] = {}
        self._ctrl: dict[int, np.ndarray] = {}
        self._pids: dict[int, int] = {}
        self._symm = None
        self._closed = False
        want = torch.from_numpy(np.array([int(nbytes)], dtype=np.int64))
        self.nbytes = _align(int(self._all_gather(want).max()), _PAGE)
        token = self._all_gather(torch.from_numpy(np.array([secrets.randbits(62)], dtype=np.int64)))
        self.token = f"{int(token[0, 0]):016x}"
        host_bytes = self._ctrl_bytes + (self.nbytes if self.host_memory else 0)
        self.names = {r: f"embedscale-pgas-{self.job_id}-{self.token}-h{self.host}-r{r}" for r in self.local_ranks}
        self.dir = shm_dir()
        self._rendezvous(host_bytes)
        if not self.host_memory:
            self._rendezvous_device()

    # -- setup ------------------------------------------------------------------------------------
    def _coll(self, t: torch.Tensor) -> torch.Tensor:
        be = dist.get_backend(self.group)
        return t.to(self.device) if (be != "gloo" and self.device is not None) else t

    def _all_gather(self, t: torch.Tensor) -> np.ndarray:
        """[world, k] int64 of every rank's ``t`` (no pickle: plain int64 tensors)."""
        t = self._coll(t.reshape(-1))
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out).numpy(force=True)

    def _path(self, r: int) -> str:
        return os.path.join(self.dir, self.names[r])

    def _unlink_all(self) -> None:
        for r in self.local_ranks:
            with contextlib.suppress(FileNotFoundError, OSError):
                os.unlink(self._path(r))

    def _map(self, path: str, size: int, create: bool) -> mmap.mmap:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # reserve now: a full /dev/shm fails here, not as SIGBUS later
            else:
                have = os.fstat(fd).st_size
                if have < size:
                    raise HeapError(f"symmetric heap: segment {path} has {have} bytes, expected {size}")
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def _rendezvous(self, size: int) -> None:
        """Create, map, and unlink the shared-memory files: after this no name is left on disk."""
        me = self.rank
        fault = os.environ.get("EMBEDSCALE_PGAS_FAULT", "")  # tests: "kill_after_create:<rank>"
        try:
            err = 0
            msg = ""
            try:
                self._maps[me] = self._map(self._path(me), size, create=True)
            except OSError as e:
                err, msg = e.errno or -1, e.strerror or str(e)
            if fault == f"kill_after_create:{me}":
                os.kill(os.getpid(), signal.SIGKILL)
            status = self._all_gather(torch.from_numpy(np.array([err], dtype=np.int64)))[:, 0]
            if status.any():
                bad = int(np.flatnonzero(status)[0])
                free = ""
                with contextlib.suppress(OSError):
                    st = os.statvfs(self.dir)
                    free = f" ({_fmt_bytes(st.f_bavail * st.f_frsize)} free in {self.dir})"
                detail = f": {msg}" if bad == me else f" (errno {int(status[bad])})"
                raise HeapError(f"symmetric heap: rank {bad} could not create its segment "
                                f"{os.path.join(self.dir, self.names.get(bad, '?'))} of {_fmt_bytes(size)}"
                                f"{detail}{free}")
            ctrl = np.frombuffer(self._maps[me], dtype=np.int64, count=self._ctrl_bytes // 8)
            ctrl[:] = 0
            ctrl[:4] = [_MAGIC, os.getpid(), self.nbytes, self.num_lines]
            err = 0
            for r in self.local_ranks:
                if r == me:
                    continue
                try:
                    self._maps[r] = self._map(self._path(r), size, create=False)
                except (OSError, HeapError) as e:
                    err = r + 1
                    msg = str(e)
                    break
            status = self._all_gather(torch.from_numpy(np.array([err], dtype=np.int64)))[:, 0]
            if status.any():
                bad = int(np.flatnonzero(status)[0])
                raise HeapError(f"symmetric heap: rank {bad} could not map the segment of rank "
                                f"{int(status[bad]) - 1} ({_fmt_bytes(size)}){': ' + msg if bad == me else ''}")
        except BaseException:
            self._unlink_all()
            self._maps.clear()
            raise
        # every rank of the host has mapped every segment: the names can go
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(me))
        for r in self.local_ranks:
            arr = np.frombuffer(self._maps[r], dtype=np.int64, count=self._ctrl_bytes // 8)
            self._ctrl[r] = arr[: (1 + self.num_lines) * _LINE].reshape(1 + self.num_lines, _LINE)
            pid = int(self._ctrl[r][0, 1])
            # a peer in another pid namespace is invisible here: no liveness checks for it (timeouts only)
            self._pids[r] = pid if _pid_alive(pid) else 0
            if int(self._ctrl[r][0, 0]) != _MAGIC:
                raise HeapError(f"symmetric heap: segment of rank {r} ({self.names[r]}) has no valid header")

    def _rendezvous_device(self) -> None:  # pragma: no cover - accelerators only: designed for, untested here
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:
            raise ConfigError("symmetric heap: this PyTorch has no torch.distributed._symmetric_memory; "
                              "use host memory (device of the host) for the PGAS transport") from e
        groups = [list(range(h * self.ranks_per_host, min((h + 1) * self.ranks_per_host, self.world_size)))
                  for h in range((self.world_size + self.ranks_per_host - 1) // self.ranks_per_host)]
        host_group, _ = dist.new_subgroups_by_enumeration(groups)
        self._symm_buf = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._symm = symm_mem.rendezvous(self._symm_buf, host_group)

    # -- access -----------------------------------------------------------------------------------
    def is_local(self, peer: int) -> bool:
        return peer // self.ranks_per_host == self.host

    def ctrl(self, peer: int) -> np.ndarray:
        """``[num_lines, 8]`` int64 control lines of ``peer``'s segment (line 0 of the heap itself is hidden)."""
        return self._ctrl[peer][1:]

    def view(self, peer: int, offset: int, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over bytes ``[offset, ...)`` of ``peer``'s data region (a separate tensor per call)."""
        if peer not in self.local_index:
            raise HeapError(f"symmetric heap: rank {peer} is on host {peer // self.ranks_per_host}, "
                            f"not on this rank's host {self.host}: it has no segment here")
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        count = math.prod(shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if offset % itemsize or offset < 0 or offset + count * itemsize > self.nbytes:
            raise HeapError(f"symmetric heap: view [{offset}, {offset + count * itemsize}) of rank {peer}'s "
                            f"segment {self.names[peer]} is misaligned or outside its {self.nbytes} bytes")
        if self.host_memory:
            if count == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(self._maps[peer], dtype=dtype, count=count,
                                    offset=self._ctrl_bytes + offset).view(shape)
        return self._symm.get_buffer(self.local_index[peer], shape, dtype,  # pragma: no cover
                                     offset // itemsize)

    def fence(self) -> None:
        """Order data writes before the next control-word store (accelerators: wait for the stream)."""
        if not self.host_memory:  # pragma: no cover - accelerators only
            torch.accelerator.synchronize(self.device)

    def wait_until(self, ready: Callable[[], bool], peers, what: str) -> None:
        """Spin (yielding the core, then sleeping a little longer each time) until ``ready()``.

        Raises ``HeapError`` naming this rank, the awaited peers and ``what`` when one of ``peers`` has
        exited or after ``timeout_s``.
        """
        if ready():
            return
        t0 = time.monotonic()
        next_check = t0 + 0.2
        spins = 0
        while not ready():
            spins += 1
            if spins < 64:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 2e-5 * (1 << min((spins - 64) // 16, 6))))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.2
                self.check_peers(peers, what)
                if now - t0 > self.timeout_s:
                    raise HeapError(f"rank {self.rank}: timed out after {self.timeout_s:.0f} s waiting for "
                                    f"{what} (ranks {sorted(peers)}, heap {self.token})")

    def check_peers(self, peers, what: str) -> None:
        for p in peers:
            if p != self.rank and self._pids.get(p, 0) and not _pid_alive(self._pids[p]):
                raise HeapError(f"rank {self.rank}: rank {p} (pid {self._pids[p]}) exited while this rank "
                                f"waited for {what} (segment {self.names[p]}, {_fmt_bytes(self.nbytes)})")

    def close(self) -> None:
        """Drop this rank's references to the mappings (they are unmapped once no tensor uses them)."""
        if self._closed:
            return
        self._closed = True
        self._ctrl.clear()
        for mm in self._maps.values():
            with contextlib.suppress(BufferError, ValueError):
                mm.close()
        self._maps.clear()
        self._symm = None

    def __repr__(self) -> str:
        return (f"SymmetricHeap(rank={self.rank}, host={self.host}, local_ranks={self.local_ranks}, "
                f"nbytes={self.nbytes}, token={self.token})")


def heap_segments(job_id: str | None = None) -> list[str]:
    """Names of the segments in the shared-memory directory (of ``job_id`` only, if given)."""
    pre = "embedscale-pgas-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:40] + "-" if job_id else "")
    with contextlib.suppress(FileNotFoundError):
        return sorted(n for n in os.listdir(shm_dir()) if n.startswith(pre))
    return []


class PgasTransport(Transport):
    """``Transport`` by one-sided writes into a symmetric heap; collectives only towards other hosts.

    Args:
        rank, world_size: this rank and the group's size (default: from the default process group).
        group: the process group (the heap rendezvous and the cross-host collectives run on it).
        ranks_per_host: ranks per host; ranks ``h * ranks_per_host ...`` form host ``h`` (default: all
            ranks on one host). Peers on other hosts are reached through a ``CollectiveTransport``.
        slot_bytes: bytes of one ring slot per (writer, reader) pair; size it from the plan and batch
            with ``slot_bytes_for`` so one exchange fits one slot. Larger messages stream through the
            ring in several rounds: correct at any size, slower.
        depth: slots per ring (2: a writer may run one message ahead of its reader).
        device: where the heap data lives (default: host memory).
        job_id, timeout_s: see ``SymmetricHeap``.

    Protocol (per ordered pair writer ``w`` -> reader ``r``, inside ``r``'s segment): slot
    ``seq % depth`` receives the chunk, its header line gets ``(seq, message bytes, chunk bytes)``, then
    ``r``'s ready word for ``w`` gets ``seq``; ``r`` copies the chunk out and stores ``seq`` into its ack
    word in ``w``'s segment; ``w`` reuses a slot only once it is acked. Every exchange sends at least
    one chunk to every local peer (an empty message is the peer's completion signal).
    """

    name = "pgas"

    def __init__(self, rank: int | None = None, world_size: int | None = None, group=None, *,
                 ranks_per_host: int | None = None, slot_bytes: int = 4 << 20, depth: int = 2,
                 device: torch.device | str | None = None, job_id: str | None = None, timeout_s: float = 300.0):
        super().__init__(dist.get_rank(group) if rank is None else rank,
                         dist.get_world_size(group) if world_size is None else world_size)
        self.group = group
        self.ranks_per_host = self.world_size if not ranks_per_host else int(ranks_per_host)
        self.host = self.rank // self.ranks_per_host
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.device = device
        if depth < 1:
            raise ConfigError(f"pgas transport: depth must be >= 1, got {depth}")
        self.depth = int(depth)
        self.slot_bytes = _align(max(int(slot_bytes), _ALIGN))
        W, rph = self.world_size, self.ranks_per_host
        self.local_peers = [r for r in range(W) if r // rph == self.host]
        self.remote_peers = [r for r in range(W) if r // rph != self.host]
        self.L = len(self.local_peers)
        self.collective = CollectiveTransport(self.rank, W, group) if W > rph else None
        self.timeline: Timeline | None = None
        L, D = rph, self.depth  # symmetric layout: sized for the largest host
        self._ready_line = lambda lw: lw
        self._hdr_line = lambda lw, b: L + lw * D + b
        self._ack_line = lambda lr: L + L * D + lr
        self.heap = self.new_heap(L * D * self.slot_bytes, num_lines=L + L * D + L)
        me = self.heap.local_index[self.rank]
        self._me_local = me
        # slot views: where this rank writes for each local peer, and where each peer writes for it
        self._out_slots = {p: [self.heap.view(p, (me * D + b) * self.slot_bytes, self.slot_bytes, torch.uint8)
                               for b in range(D)] for p in self.local_peers if p != self.rank}
        self._in_slots = {p: [self.heap.view(self.rank, (self.heap.local_index[p] * D + b) * self.slot_bytes,
                                             self.slot_bytes, torch.uint8) for b in range(D)]
                          for p in self.local_peers if p != self.rank}
        self._ctrl = {p: self.heap.ctrl(p) for p in self.local_peers}
        self._remote_set = set(self.remote_peers)
        self._sent_seq = {p: 0 for p in self.local_peers}
        self._recv_seq = {p: 0 for p in self.local_peers}

    def new_heap(self, nbytes: int, num_lines: int = 0, device=None) -> SymmetricHeap:
        """Another symmetric heap over the same ranks and hosts (a collective call)."""
        return SymmetricHeap(nbytes, num_lines=num_lines, rank=self.rank, world_size=self.world_size,
                             ranks_per_host=self.ranks_per_host, group=self.group,
                             device=self.device if device is None else device, job_id=self.job_id,
                             timeout_s=self.timeout_s)

    def enable_timeline(self, capacity: int = 1 << 16) -> Timeline:
        """Record every one-sided write from now on (``comm.timeline``); returns the timeline."""
        self.timeline = Timeline(capacity)
        return self.timeline

    def record(self, nbytes: int, peer: int, kind: str) -> None:
        if self.timeline is not None:
            self.timeline.record(nbytes, peer, kind)

    def is_local(self, peer: int) -> bool:
        return peer // self.ranks_per_host == self.host

    # -- the ring protocol ------------------------------------------------------------------------
    def _try_push(self, p: int, st: dict) -> bool:
        """Write as many chunks of the message for ``p`` as the ring has free slots; True if any."""
        heap, D, me_l = self.heap, self.depth, self._me_local
        my_ctrl = self._ctrl[self.rank]
        peer_ctrl = self._ctrl[p]
        ack_line = self._ack_line(heap.local_index[p])
        moved = False
        while st["left"] > 0:
            seq = self._sent_seq[p] + 1
            if seq - int(my_ctrl[ack_line, 0]) > D:
                break
            b = (seq - 1) % D
            a = st["pos"]
            n = min(self.slot_bytes, st["n"] - a)
            if n:
                self._out_slots[p][b][:n].copy_(st["u8"][a:a + n])
            heap.fence()
            hdr = peer_ctrl[self._hdr_line(me_l, b)]
            hdr[1] = st["n"]
            hdr[2] = n
            hdr[0] = seq
            peer_ctrl[self._ready_line(me_l), 0] = seq  # publish: data and header are visible before this
            self._sent_seq[p] = seq
            st["pos"] = a + n
            st["left"] -= 1
            self.counter.meta += 24
            if n:
                self.record(n, p, st["kind"])
            moved = True
        return moved

    def _try_pull(self, p: int, st: dict) -> bool:
        """Copy out every chunk ``p`` has published for this rank; True if any."""
        heap, D = self.heap, self.depth
        my_ctrl = self._ctrl[self.rank]
        lp = heap.local_index[p]
        moved = False
        while st["left"] != 0:
            seq = self._recv_seq[p] + 1
            if int(my_ctrl[self._ready_line(lp), 0]) < seq:
                break
            b = (seq - 1) % D
            hdr = my_ctrl[self._hdr_line(lp, b)]
            total, n = int(hdr[1]), int(hdr[2])
            if st["out"] is None:
                rb = st["row_bytes"]
                if rb and total % rb:
                    raise HeapError(f"rank {self.rank}: received {total} bytes from rank {p}, not a multiple of "
                                    f"the row size {rb} ({st['dtype']}, rows of {st['tail']}): the ranks disagree "
                                    f"on this exchange")
                rows = total // rb if rb else 0
                if st["expect"] is not None and rows != st["expect"]:
                    raise HeapError(f"rank {self.rank}: expected {st['expect']} rows from rank {p}, got {rows}")
                st["out"] = torch.empty((rows, *st["tail"]), dtype=st["dtype"], device=st["device"])
                st["u8"] = st["out"].reshape(-1).view(torch.uint8) if total else None
                st["left"] = max(1, -(-total // self.slot_bytes))
                st["pos"] = 0
            if n:
                a = st["pos"]
                st["u8"][a:a + n].copy_(self._in_slots[p][b][:n])
                st["pos"] = a + n
            heap.fence()
            self._recv_seq[p] = seq
            self._ctrl[p][self._ack_line(self._me_local), 0] = seq  # the slot may be reused
            st["left"] -= 1
            moved = True
        return moved

    def post(self, peer: int, t: torch.Tensor, kind: str = "data") -> dict:
        """Start sending ``t`` to local ``peer`` (writes what the ring takes now); finish with ``progress``."""
        t = t.contiguous()
        n = t.numel() * t.element_size()
        st = {"u8": t.reshape(-1).view(torch.uint8) if n else None, "n": n, "pos": 0,
              "left": max(1, -(-n // self.slot_bytes)), "kind": kind, "keep": t}
        self._try_push(peer, st)
        return st

    def expect(self, tail: tuple, dtype: torch.dtype, device, rows: int | None = None) -> dict:
        rb = math.prod(tail) * torch.empty(0, dtype=dtype).element_size()
        return {"out": None, "left": -1, "tail": tuple(tail), "dtype": dtype, "device": device,
                "row_bytes": rb, "expect": rows}

    def progress(self, sends: dict[int, dict], recvs: dict[int, dict], what: str) -> None:
        """Drive posted sends and expected receives until all are complete (the per-peer signals)."""
        def done() -> bool:
            moved = False
            for p, st in sends.items():
                if st["left"] > 0:
                    moved |= self._try_push(p, st)
            for p, st in recvs.items():
                if st["left"] != 0:
                    moved |= self._try_pull(p, st)
            return all(st["left"] == 0 for st in sends.values()) and all(st["left"] == 0 for st in recvs.values())

        peers = {p for p, st in sends.items()} | set(recvs)
        self.heap.wait_until(done, peers, what)

    # -- Transport --------------------------------------------------------------------------------
    def exchange(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                 kind: str = "data") -> list[torch.Tensor]:
        W, me = self.world_size, self.rank
        if len(send) != W:
            raise ValueError(f"exchange needs one tensor per rank ({W}), got {len(send)}")
        ref = send[me]
        tail = tuple(ref.shape[1:])
        order = [p for p in (self.local_peers[(self._me_local + i) % self.L] for i in range(1, self.L))]
        sends = {p: self.post(p, send[p], kind) for p in order}
        recv: list[torch.Tensor | None] = [None] * W
        if self.collective is not None:
            meta0 = self.collective.counter.meta
            empty = ref[:0]
            csend = [send[p] if p in self._remote_set else empty for p in range(W)]
            crc = None if recv_counts is None else [recv_counts[p] if p in self._remote_set else 0 for p in range(W)]
            got = self.collective.exchange(csend, crc, kind)
            for p in self.remote_peers:
                recv[p] = got[p]
            self.counter.meta += self.collective.counter.meta - meta0
        recvs = {p: self.expect(tail, ref.dtype, ref.device, None if recv_counts is None else int(recv_counts[p]))
                 for p in order}
        self.progress(sends, recvs, f"exchange of {kind!r}")
        for p, st in recvs.items():
            recv[p] = st["out"]
        recv[me] = ref
        self._count(send, recv, kind)
        return recv

    def close(self) -> None:
        self.heap.close()


def slot_bytes_for(tables, amap, max_batch_size: int, max_ids_per_bag: float = 1.0, design: str = "retrieve",
                   cap: int = 16 << 20) -> int:
    """Ring slot bytes for ``PgasTransport`` from the plan and the batch: one step's largest message.

    The largest message a rank writes to one peer in a step is bounded by its mini-batch
    (``max_batch_size`` samples x features x ``max_ids_per_bag`` values): ``retrieve`` moves ids
    (8 bytes) and rows / gradients (``dim`` x bytes per value) per unique remote row, at most the rows a
    rank holds; ``send`` moves ids (up to 20 bytes) per value and one pooled vector / gradient per bag.
    Capped at ``cap`` (a rank maps ``ranks_per_host x depth`` slots per peer): larger messages stream
    through the ring in several rounds.
    """
    F_ = sum(len(t.features) for t in tables)
    row = max(t.dim * t.bytes_per_value for t in tables)
    values = int(math.ceil(max_batch_size * F_ * max(max_ids_per_bag, 1.0)))
    if design == "retrieve":
        rows = min(values, int((amap.num_owned() + amap.num_replicas_held()).max()))
        need = rows * (row + 8)
    else:
        need = max(values * 20 + max_batch_size * F_ * 16, max_batch_size * F_ * (row + 8))
    return _align(min(max(need, 64 << 10), int(cap)))
