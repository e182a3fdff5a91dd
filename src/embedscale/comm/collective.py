"""Collective transport: one ``all_to_all_single`` per exchange (gloo on CPU, NCCL on GPUs).

The transport knows its backend (``wire_device``): tensors reach ``all_to_all_single`` on CUDA for NCCL and
in host memory for gloo, whatever device the caller's tensors are on, and come back on the caller's device.
The NCCL path is designed for GPU and untested here (CPU-only machine)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from embedscale.comm.transport import PendingExchange, Transport, nbytes
from embedscale.device import HOST, backend_device


class CollectiveTransport(Transport):
    """``Transport`` over ``torch.distributed.all_to_all_single`` with uneven splits.

    Args:
        rank, world_size: this rank and the group's size (default: from the default process group).
        group: the process group (default: the world).
    """

    name = "collective"
    fuses_exchanges = True  # every exchange is one all-to-all: fusing messages saves calls

    def __init__(self, rank: int | None = None, world_size: int | None = None, group=None):
        super().__init__(dist.get_rank(group) if rank is None else rank,
                         dist.get_world_size(group) if world_size is None else world_size)
        self.group = group
        self._wire: torch.device | None = None

    @property
    def wire_device(self) -> torch.device:
        """CUDA for NCCL, host memory for gloo (``backend_device`` of the group's backend)."""
        if self._wire is None:
            self._wire = backend_device(dist.get_backend(self.group)) if dist.is_initialized() \
                else HOST
        return self._wire

    def _exchange_counts(self, counts: list[int], device=None) -> list[int]:
        send = torch.tensor(counts, dtype=torch.int64, device=self.wire_device).view(-1, 1)
        return self.exchange_counts(send).view(-1).tolist()

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Swap small per-peer count vectors: ``counts`` int64 ``[W, k]`` (row ``p`` goes to rank ``p``);
        returns ``[W, k]`` on ``counts``' device, row ``p`` what rank ``p`` sent here. One all-to-all,
        counted as metadata."""
        W = self.world_size
        dev = counts.device
        counts = self.to_wire(counts.to(torch.int64).contiguous())
        if W == 1:
            return counts.clone().to(dev)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        self.counter.meta += (W - 1) * nbytes(counts[0])  # sent: one row to each other rank
        return recv.to(dev)

    def exchange(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                 kind: str = "data") -> list[torch.Tensor]:
        return self._all_to_all(send, recv_counts, kind, background=False).wait()

    def exchange_start(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                       kind: str = "data") -> PendingExchange:
        """The all-to-all started in the background (``async_op``); ``wait()`` returns the received tensors."""
        return self._all_to_all(send, recv_counts, kind, background=True)

    def _all_to_all(self, send: list[torch.Tensor], recv_counts: list[int] | None, kind: str,
                    background: bool) -> PendingExchange:
        """One ``all_to_all_single``: in the background, or blocking (``exchange``: no hand-over to the backend's
        worker thread and back, whose wake-ups cost milliseconds on a loaded machine)."""
        W = self.world_size
        if len(send) != W:
            raise ValueError(f"exchange needs one tensor per rank ({W}), got {len(send)}")
        ref = send[self.rank]
        tail = tuple(ref.shape[1:])
        device, dtype = ref.device, ref.dtype
        counts = [int(t.shape[0]) for t in send]
        if recv_counts is None:
            recv_counts = self._exchange_counts(counts, device)
        if W == 1:
            return PendingExchange([send[0]])
        wire = self.wire_device
        flat_in = torch.cat([self.to_wire(t).reshape(t.shape[0], *tail) for t in send]) if sum(counts) else \
            torch.empty((0, *tail), dtype=dtype, device=wire)
        flat_out = torch.empty((sum(recv_counts), *tail), dtype=dtype, device=wire)
        work = dist.all_to_all_single(flat_out, flat_in.contiguous(), output_split_sizes=recv_counts,
                                      input_split_sizes=counts, group=self.group, async_op=background)

        def finish() -> list[torch.Tensor]:
            if work is not None:
                work.wait()
            recv = list(torch.split(flat_out.to(device), recv_counts))  # back on the caller's device
            self._count(send, recv, kind)
            return recv
        return PendingExchange(finish=finish)
