"""What travels between the trainer and the host parameter server (EL-Rec, SC 2022, section V-A, Fig. 9).

Two FIFO queues connect them. Down the *prefetch queue* go :class:`PrefetchedBatch` items: a batch, the
device-placed part of its sparse features, and, for every dim group of the host tables, the unique rows
the batch looks up with their weights (and row-wise Adagrad state) read from host memory
(:class:`HostRows`). Up the *gradient queue* go :class:`GradientBatch` items: one aggregated gradient
(or, for SGD, the update itself) per unique row, which the server applies in batch order.

Both queues hold at most ``depth`` items by construction of the schedule in
:mod:`embedscale.pipeline.loop` (the server prefetches batch ``s`` only after it has applied the
gradients of batch ``s - depth``), so they are plain unbounded ``queue.Queue``s that never block a
producer; :func:`get_from` is a ``get`` that notices a dead producer instead of waiting forever.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.errors import EmbedscaleError


class PipelineError(EmbedscaleError, RuntimeError):
    """The pipelined loop was driven out of order (a lookup without backward, a dead server thread...)."""


@dataclass
class HostRows:
    """One dim group of host tables for one batch: the small local buffer the trainer pools from.

    The looked-up values keep the order and bag layout of
    :class:`embedscale.embedding.local.LocalEmbeddingBags` (one-hot batches sample-major, one value per
    bag; multi-hot batches key-major with bag offsets), so pooling and the backward's per-row gradient
    sums perform the same floating-point operations in the same order as a plain local lookup.

    Attributes:
        group: index of the dim group in the server.
        dim: embedding dim of the group.
        rows: int64 ``[u]`` sorted unique flat rows of the server's dim group that the batch reads.
        ids: int32 ``[n]`` local id (position in ``rows``) of every looked-up value.
        offsets: int32 ``[num_bags + 1]`` bag offsets, or ``None`` for one value per bag (one-hot).
        scale: ``[n]`` per-value factor (per-sample weight, ``1/length`` for mean pooling) or ``None``.
        num_bags: bags in the group's lookup (features x samples).
        width: output columns of the group per sample (features x dim).
        key_major: ``k > 1``: bags are in key-major order ``f * B + b`` (output transposed to ``[B, k, dim]``).
        src: int64 ``[n]`` the backward's segment-sum plan, prepared by the server off the trainer's critical
            path: values sorted by local id (``torch.sort``, as ``aggregate_row_gradients`` sorts), each
            given as its row in the ``[num_bags, dim]`` output gradient.
        seg: int64 ``[u + 1]`` segment offsets of the sorted values (one segment per unique row).
        scale_sorted: ``scale`` in that sorted order, or ``None``.
        weights: ``[u, dim]`` the rows' weights on the trainer's device (filled by the server's read).
        momentum: float32 ``[u]`` their row-wise Adagrad state, or ``None`` for SGD.
    """

    group: int
    dim: int
    rows: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor | None
    scale: torch.Tensor | None
    num_bags: int
    width: int
    key_major: int
    src: torch.Tensor
    seg: torch.Tensor
    scale_sorted: torch.Tensor | None
    weights: torch.Tensor | None = None
    momentum: torch.Tensor | None = None

    def to(self, device: torch.device) -> "HostRows":
        """The same rows with every tensor on ``device`` (the trainer's); ``rows`` included (cache keys)."""
        def mv(t):
            return None if t is None else t.to(device, non_blocking=True)
        return HostRows(self.group, self.dim, mv(self.rows), mv(self.ids), mv(self.offsets), mv(self.scale),
                        self.num_bags, self.width, self.key_major, mv(self.src), mv(self.seg),
                        mv(self.scale_sorted), mv(self.weights), mv(self.momentum))


@dataclass
class PrefetchedBatch:
    """One batch as the server hands it to the trainer.

    Attributes:
        index: the batch's position in this pass (0, 1, ...).
        applied: gradient batches the server had applied when it read the rows (``p(s)``); the trainer's
            life-cycle cache uses it to count gradient pulls.
        batch: the batch itself (``None`` for a synchronous lookup outside a pipeline).
        features: the sparse features the rows were prepared from (matched by identity at lookup).
        device_features: per device-side module, the features it reads.
        host: per host dim group, the prefetched rows.
        patch_plan: for each batch still in flight when the rows were read (its gradients not yet applied):
            per host dim group ``(dst, src)``, the positions in this batch's rows and in that batch's rows
            of the rows both read; ``None`` when the server did not compute it (several ranks).
        patched: rows patched from the life-cycle cache by the pipeline's patcher thread.
    """

    index: int
    applied: int
    batch: Batch | None
    features: JaggedFeatures
    device_features: list[JaggedFeatures]
    host: list[HostRows]
    patch_plan: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    patched: int = 0


@dataclass
class GradientBatch:
    """The host-table gradient of one batch, aggregated per unique row (EL-Rec Fig. 9, step 3).

    ``updates[g]`` is, for SGD, the update itself (``-lr`` folded into the per-row sum exactly as the fused
    local optimizer does) and for row-wise Adagrad the summed gradient. ``lr`` is the rate the trainer
    used, so a rate changed between steps is applied by the server as the trainer applied it.
    """

    index: int
    lr: float
    rows: list[torch.Tensor]  # per host dim group: int64 [U] sorted unique flat rows
    updates: list[torch.Tensor]  # per host dim group: [U, dim]
    meta: dict = field(default_factory=dict)


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


END = _Sentinel("END")  # server -> trainer: no more batches in this pass
FINISH = _Sentinel("FINISH")  # trainer -> server: no more gradients will come


def get_from(q: queue.Queue, producer: threading.Thread | None, what: str, timeout_s: float):
    """``q.get()`` that raises :class:`PipelineError` if ``producer`` died or nothing came in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=0.05)
        except queue.Empty:
            if producer is not None and not producer.is_alive():
                try:
                    return q.get_nowait()
                except queue.Empty:
                    raise PipelineError(f"{what}: the {producer.name} thread ended without a reply") from None
            if time.monotonic() > deadline:
                raise PipelineError(f"{what}: nothing arrived within {timeout_s:.0f} s") from None
