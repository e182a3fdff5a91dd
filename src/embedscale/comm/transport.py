"""The transport interface: how ranks exchange embedding rows, pooled vectors and gradients.

Everything that moves embedding data between ranks goes through a ``Transport``, so the executor
(``embedding.sharded``) is the same whether the bytes travel by collectives (gloo/NCCL), by one-sided
writes into a symmetric heap (PGAS), or hierarchically (DMT's tower transform). Every transport counts
the payload bytes it sends to and receives from each peer; those counts are what the cost model's
communication figures (OPER eq. 3) are checked against.

Counting convention (the transports' counters, the replica and TT gradient syncs' bytes, the run's
``embedding_bytes_on_wire_per_step`` and ``grad_sync_bytes_per_step``; DMT's cross-host figures add a
hierarchical link model on top, ``comm.hierarchical``): the payload bytes a rank *sends*, counted at the
collective call from the tensors handed to it (``nbytes`` = numel x element size, ``W`` = the group's
size), per kind of collective:

- all_to_all (``Transport.exchange``): the sum of the splits addressed to other ranks (a rank's own split
  stays local and is not communication), per peer in ``ByteCounter.sent``; ``ByteCounter.recv`` counts
  what arrives from each peer the same way.
- ring all_reduce of an ``n``-byte buffer: ``2 (W - 1) / W x n`` (a reduce-scatter and an all-gather, each
  sending ``W - 1`` chunks of ``n / W``; OPER eq. 5), rounded down (:func:`all_reduce_sent`). This is the
  ring's volume whatever algorithm the backend picks for the buffer.
- all_gather of an ``n``-byte contribution: ``(W - 1) x n`` (it reaches every other rank;
  :func:`all_gather_sent`). A contribution padded to the largest rank's counts padded: that is what is sent.
- the per-peer counts a transport swaps before an exchange are metadata (``ByteCounter.meta``), counted the
  same way (sent bytes), apart from the payload.
- one rank (``W = 1``) sends nothing.

:func:`counted_all_reduce` and :func:`counted_all_gather` run the collective and return these bytes, so a
caller counts exactly the tensor it communicated.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from embedscale.device import backend_device  # noqa: F401 (the transports' wire device, decided there)


class ByteCounter:
    """Payload bytes sent to / received from each peer (self excluded), and metadata bytes sent, apart (the
    module's counting convention)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.reset()

    def reset(self) -> None:
        self.sent = np.zeros(self.world_size, dtype=np.int64)
        self.recv = np.zeros(self.world_size, dtype=np.int64)
        self.meta = 0
        self.calls = 0
        self.by_kind: dict[str, int] = {}

    def snapshot(self) -> dict:
        return {"sent": self.sent.tolist(), "recv": self.recv.tolist(), "meta": int(self.meta),
                "calls": int(self.calls), "sent_total": int(self.sent.sum()), "recv_total": int(self.recv.sum()),
                "by_kind": dict(self.by_kind)}


class Transport(ABC):
    """Exchange variable-sized tensors between all ranks of a group.

    ``exchange(send)`` takes one tensor per peer (``send[p]`` goes to rank ``p``; all share the trailing
    shape and dtype) and returns one tensor per peer (what rank ``p`` sent here). The entry for this rank
    is passed through locally and never counted as communication.

    Device contract: callers hand ``exchange`` (and ``exchange_counts``) tensors on the run's device and get
    the received tensors back on that same device; a transport whose backend needs another device
    (gloo: host memory) moves them itself, through ``to_wire``, and ``wire_device`` says which device that
    is (``None``: any, the tensors are used where they are). So no caller moves ids to the host, and on
    NCCL every tensor reaches the collective on CUDA. Designed for GPU; tested on CPU (gloo) only.
    """

    name = "abstract"
    #: Whether an executor should fuse several messages into one exchange (the next batch's request counts
    #: riding this step's rows, its ids riding this step's gradients, replica gradients riding the gradient
    #: exchange): true where every exchange is one collective call whose fixed cost fusing saves.
    fuses_exchanges = False

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.counter = ByteCounter(world_size)

    @property
    def wire_device(self) -> torch.device | None:
        """The device this transport's backend moves tensors on, or ``None`` when any device will do."""
        return None

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on ``wire_device`` (``t`` itself when it is already there or any device will do)."""
        dev = self.wire_device
        return t if dev is None or t.device == dev else t.to(dev)

    @abstractmethod
    def exchange(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                 kind: str = "data") -> list[torch.Tensor]:
        """Send ``send[p]`` to every rank ``p``; return the tensors received from every rank.

        ``recv_counts`` (rows to expect from each peer), when the caller already knows them, saves the
        round of metadata that would otherwise tell every rank how much to expect. ``kind`` labels the
        bytes in the counter (``rows``, ``ids``, ``grads``, ``pooled``) so each can be checked on its own.
        """

    def exchange_start(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                       kind: str = "data") -> PendingExchange:
        """Start :meth:`exchange` and return at once; its ``wait()`` gives what ``exchange`` returns (the caller
        computes meanwhile, OPER 5.2). This default exchanges now; a transport whose collective runs in the
        background overrides it. ``send`` must not change until the wait."""
        return PendingExchange(self.exchange(send, recv_counts, kind))

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Swap small per-peer count vectors: ``counts`` int64 ``[W, k]`` (row ``p`` goes to rank ``p``);
        returns ``[W, k]`` on ``counts``' device, row ``p`` what rank ``p`` sent here. Counted as metadata.
        This default sends one row to every peer through :meth:`exchange`; a transport with a cheaper
        collective overrides it."""
        counts = counts.to(torch.int64).contiguous()
        W, me = self.world_size, self.rank
        if W == 1:
            return counts.clone()
        got = self.exchange([counts[p:p + 1] for p in range(W)], recv_counts=[1] * W, kind="meta")
        for p in range(W):
            if p != me:  # sent bytes, as the collective's count exchange counts them
                self._as_meta(p, nbytes(counts[p]), nbytes(got[p]), "meta", nbytes(counts[p]))
        if self.counter.by_kind.get("meta") == 0:
            del self.counter.by_kind["meta"]
        got[me] = counts[me:me + 1]
        return torch.cat(got)

    def exchange_packed(self, parts: list, recv_parts: list, kinds: list[str], device=None) -> list:
        """One exchange of several tensors per peer, sent as bytes: ``parts[p]`` the tensors for rank ``p``,
        ``recv_parts[p]`` the ``(dtype, tail, rows)`` of each tensor expected from rank ``p`` (both sides know
        them), ``kinds`` each tensor's label in the byte counter (``meta``: counted as metadata, as
        :meth:`exchange_counts` counts). Returns, per peer, the list of received tensors (``None`` for this
        rank), on ``device`` (the run's; default: the first tensor's), where the parts are moved too (a part
        decoded in host memory and one on the device travel together)."""
        return self.exchange_packed_start(parts, recv_parts, kinds, background=False, device=device).wait()

    def exchange_packed_start(self, parts: list, recv_parts: list, kinds: list[str],
                              background: bool = True, device=None) -> PendingExchange:
        """Start :meth:`exchange_packed` (over :meth:`exchange_start`; ``background=False``: over :meth:`exchange`,
        done when this returns); ``wait()`` gives what it returns."""
        me = self.rank
        dev = device if device is not None else next((ts[0].device for p, ts in enumerate(parts) if p != me and ts),
                                                     None)
        send = [torch.cat([_as_bytes(t if dev is None else t.to(dev)) for t in ts]) if p != me else
                torch.zeros(0, dtype=torch.uint8, device=dev) for p, ts in enumerate(parts)]
        sizes = [[rows * math.prod(tail) * torch.empty(0, dtype=dt).element_size() for dt, tail, rows in rp]
                 for rp in recv_parts]
        main = next(k for k in kinds if k != "meta")
        counts = [sum(sz) if p != me else 0 for p, sz in enumerate(sizes)]
        pending = self.exchange_start(send, recv_counts=counts, kind=main) if background else \
            PendingExchange(self.exchange(send, recv_counts=counts, kind=main))
        return PendingExchange(finish=lambda: self._unpack(pending.wait(), parts, recv_parts, kinds, sizes, main))

    def _unpack(self, got: list, parts: list, recv_parts: list, kinds: list[str], sizes: list, main: str) -> list:
        """:meth:`exchange_packed`'s received bytes as its tensors, every part counted under its own kind."""
        W, me = self.world_size, self.rank
        for p in range(W):  # count every part under its own kind
            if p == me:
                continue
            for i, (t, k) in enumerate(zip(parts[p], kinds)):
                if k == "meta":  # as the metadata of a count exchange, sent and received bytes
                    self._as_meta(p, nbytes(t), sizes[p][i], main, nbytes(t) + sizes[p][i])
                elif k != main:
                    self._relabel(nbytes(t), main, k)
        out = []
        for p in range(W):
            if p == me:
                out.append(None)
                continue
            pieces, a = [], 0
            for (dt, tail, _rows), b in zip(recv_parts[p], sizes[p]):
                pieces.append(_from_bytes(got[p][a:a + b], dt, tail))
                a += b
            out.append(pieces)
        return out

    # -- the byte counter: only the transport edits it ---------------------------------------------
    def count_put(self, peer: int, nbytes_: int, kind: str) -> None:
        """Count a one-sided write (or a send outside :meth:`exchange`) of ``nbytes_`` to ``peer``."""
        c = self.counter
        c.sent[peer] += nbytes_
        c.by_kind[kind] = c.by_kind.get(kind, 0) + nbytes_

    def count_received(self, peer: int, nbytes_: int) -> None:
        """Count ``nbytes_`` received from ``peer`` outside :meth:`exchange` (a peer's one-sided write)."""
        self.counter.recv[peer] += nbytes_

    def count_get(self, peer: int, nbytes_: int, kind: str) -> None:
        """Count a one-sided read of ``nbytes_`` from ``peer``'s memory (received, and under ``kind``)."""
        c = self.counter
        c.recv[peer] += nbytes_
        c.by_kind[kind] = c.by_kind.get(kind, 0) + nbytes_

    def _as_meta(self, peer: int, sent: int, recv: int, counted_as: str, meta: int) -> None:
        """Move bytes an exchange counted as payload of kind ``counted_as`` to ``meta`` bytes of metadata."""
        c = self.counter
        c.by_kind[counted_as] = c.by_kind.get(counted_as, 0) - sent
        c.sent[peer] -= sent
        c.recv[peer] -= recv
        c.meta += meta

    def _relabel(self, sent: int, counted_as: str, kind: str) -> None:
        c = self.counter
        c.by_kind[counted_as] -= sent
        c.by_kind[kind] = c.by_kind.get(kind, 0) + sent

    def _count(self, send: list[torch.Tensor], recv: list[torch.Tensor], kind: str = "data") -> None:
        total = 0
        for p in range(self.world_size):
            if p == self.rank:
                continue
            b = nbytes(send[p])
            total += b
            self.counter.sent[p] += b
            self.counter.recv[p] += nbytes(recv[p])
        self.counter.by_kind[kind] = self.counter.by_kind.get(kind, 0) + total
        self.counter.calls += 1


class PendingExchange:
    """An exchange in flight (:meth:`Transport.exchange_start`): :meth:`wait` blocks until it is done and returns
    what :meth:`Transport.exchange` would have returned; once."""

    def __init__(self, result: list | None = None, finish: Callable[[], list] | None = None):
        self._result, self._finish = result, finish

    def wait(self) -> list:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, dtype: torch.dtype, tail: tuple = ()) -> torch.Tensor:
    if buf.storage_offset() % torch.empty(0, dtype=dtype).element_size():
        buf = buf.clone()  # a view as a wider type needs an aligned start
    return buf.view(dtype).view(-1, *tail)


# -- the counting convention (module docstring) -------------------------------------------------------
def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (numel x element size)."""
    return t.numel() * t.element_size()


def all_reduce_sent(t: torch.Tensor, world: int) -> int:
    """Bytes a rank sends in a ring all_reduce of ``t`` over ``world`` ranks: ``2 (W - 1) / W x nbytes``
    rounded down (OPER eq. 5)."""
    return 2 * (world - 1) * nbytes(t) // max(world, 1)


def all_gather_sent(t: torch.Tensor, world: int) -> int:
    """Bytes a rank sends in an all_gather of its contribution ``t`` over ``world`` ranks:
    ``(W - 1) x nbytes``."""
    return (world - 1) * nbytes(t)


def counted_all_reduce(t: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> int:
    """``dist.all_reduce(t)`` in place; returns the bytes this rank sent (:func:`all_reduce_sent`)."""
    dist.all_reduce(t, op=op, group=group)
    return all_reduce_sent(t, dist.get_world_size(group))


def counted_all_gather(out: list[torch.Tensor], t: torch.Tensor, group=None) -> int:
    """``dist.all_gather(out, t)``; returns the bytes this rank sent (:func:`all_gather_sent`)."""
    dist.all_gather(out, t, group=group)
    return all_gather_sent(t, dist.get_world_size(group))
