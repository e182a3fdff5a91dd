"""The transport interface: how ranks exchange embedding rows, pooled vectors and gradients.

Everything that moves embedding data between ranks goes through a ``Transport``, so the executor
(``embedding.sharded``) is the same whether the bytes travel by collectives (gloo/NCCL), by one-sided
writes into a symmetric heap (PGAS), or hierarchically (DMT's tower transform). Every transport counts
the payload bytes it sends to and receives from each peer; those counts are what the cost model's
communication figures (OPER eq. 3) are checked against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch


class ByteCounter:
    """Payload bytes sent to / received from each peer (self excluded), and metadata bytes apart."""

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

    def _count(self, send: list[torch.Tensor], recv: list[torch.Tensor], kind: str = "data") -> None:
        total = 0
        for p in range(self.world_size):
            if p == self.rank:
                continue
            b = send[p].numel() * send[p].element_size()
            total += b
            self.counter.sent[p] += b
            self.counter.recv[p] += recv[p].numel() * recv[p].element_size()
        self.counter.by_kind[kind] = self.counter.by_kind.get(kind, 0) + total
        self.counter.calls += 1


def backend_device(backend: str) -> torch.device:
    """The device a ``torch.distributed`` backend's all-to-all takes tensors on: the current CUDA device
    for NCCL, host memory for gloo and MPI (their all-to-all is CPU-only). Designed for GPU (NCCL branch
    untested here)."""
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
