"""Fused sparse optimizers: row-gradient aggregation and in-place row updates on embedding storage.

This module owns the arithmetic of FBGEMM's "fused" table-batched-embedding (TBE) optimizers, written
with plain PyTorch ops so it runs on any device: the backward pass of an embedding lookup produces one
gradient row per looked-up value, never a dense ``[num_rows, dim]`` gradient; rows that were looked up
several times in the batch are summed first (one gradient per unique row, as FBGEMM's backward does
after its sort by row id), and the optimizer then updates exactly those rows in place.

Supported optimizers (the names follow ``fbgemm_gpu``'s ``OptimType``):

``sgd`` (``EXACT_SGD``)
    ``w[r] -= lr * g[r]`` where ``g[r]`` is the sum of all gradient rows of row ``r`` in the batch.
    Applying the summed gradient once equals applying each duplicate separately (the update is linear).

``rowwise_adagrad`` (``EXACT_ROWWISE_ADAGRAD``: FBGEMM's row-wise Adagrad kernel with
``weight_decay=0``, the sparse optimizer TorchRec's DLRM examples train with)
    one float32 state value per row, ``m[r]``. For every unique row ``r`` of the batch with summed
    gradient ``g[r]`` (a ``dim``-vector)::

        m[r] += mean(g[r] ** 2)                 # mean over the dim elements of the row
        w[r] -= lr * g[r] / (sqrt(m[r]) + eps)

    computed in float32 as ``w[r] += g[r] * (-lr * (1 / (sqrt(m[r]) + eps)))`` with a correctly rounded
    sqrt and the mean summed in a fixed order (:func:`row_mean_squares`): the C++ kernel
    (``kernels.cpp``) gives the same bits.

    "Exact" means duplicates are summed *before* the state update (not one update per occurrence).

Weight decay (``weight_decay = wd > 0``; FBGEMM's ``WeightDecayMode.L2``): the rows a step touches are
regularised, an untouched row is left as it is (the lazy L2 of sparse optimizers). The summed gradient
of every unique row gets ``wd * w[r]`` added before the update above (so row-wise Adagrad normalises the
decay with the data gradient, its state included)::

    g[r] += wd * w[r]

SGD then subtracts ``lr * g[r]``: ``w[r] *= (1 - lr * wd)`` besides the data step. ``set_weight_decay``
sets it on every fused-optimizer module of a model (``train.sparse_weight_decay``).

The functions here are shared by :class:`embedscale.embedding.local.LocalEmbeddingBags` (its autograd
backward) and by modules that receive row gradients from other ranks (sharded embeddings).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from embedscale.errors import ConfigError

OPTIMIZERS = ("sgd", "rowwise_adagrad")

_INT32_MAX = 2**31 - 1


SORT_CHUNK = 65536
"""Values per sort chunk when the rows come in table runs (``aggregate_row_gradients(segments=...)``).

PyTorch's CPU sort of a 1-D integer tensor switches to a radix sort from 32768 elements on, and a radix
sort's passes run out of cache on large arrays: measured on this project's 2-core machine (26 Zipf(1.2)
tables, 1 thread), chunks of 64k-128k values sort 1.4x (4 ids per feature) to 2.2x (64 ids) faster than
one sort of all values, chunks under 32k values 2-3x slower.
"""


def sort_chunks(segments: list[int]) -> list[int]:
    """Merge adjacent run lengths into chunks of at least ``SORT_CHUNK`` values (the last chunk absorbs a
    short tail); a run is never split, so a row's values stay in one chunk."""
    chunks: list[int] = []
    acc = 0
    for m in segments:
        acc += m
        if acc >= SORT_CHUNK:
            chunks.append(acc)
            acc = 0
    if acc:
        if chunks:
            chunks[-1] += acc
        else:
            chunks.append(acc)
    return chunks


def aggregate_row_gradients(
    rows: torch.Tensor,
    grad_src: torch.Tensor,
    src_index: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    num_rows: int | None = None,
    factor: float = 1.0,
    *,
    values_per_src: int = 0,
    scratch: "RowGradientScratch | None" = None,
    segments: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum gradient rows per unique destination row, without a dense ``[num_rows, dim]`` buffer.

    Value ``i`` contributes ``scale[i] * grad_src[src_index[i]]`` (``src_index`` defaults to ``i``,
    ``scale`` to 1) to row ``rows[i]``. Pooled lookups pass the per-bag output gradient as ``grad_src``
    and the bag of each value as ``src_index``, so the per-value gradient (FBGEMM's "expanded" gradient)
    is never materialised.

    Implementation: sort ``rows`` stably (as int32 when ``num_rows`` fits, which sorts faster), so every
    row's values are summed in batch order whatever the row numbering (lookups that number rows differently
    get the same bits), find the
    segments of equal rows, and reduce each segment with ``torch.nn.functional.embedding_bag`` in
    ``sum`` mode (the segment's source rows are the bag, ``scale`` the per-sample weights), which is a
    vectorised segment sum on every backend.

    Args:
        rows: int64 ``[n]`` destination row of each value.
        grad_src: ``[m, dim]`` gradient rows.
        src_index: int64 ``[n]`` source row in ``grad_src`` of each value, or ``None`` for ``arange(n)``.
        scale: ``[n]`` per-value factor (per-sample weight, ``1/bag_length`` for mean pooling), or ``None``.
        num_rows: an upper bound of ``rows`` (enables the int32 sort), or ``None``.
        factor: multiplies every contribution (SGD passes ``-lr`` and gets the update itself).
        values_per_src: ``L > 0`` says value ``i`` reads ``grad_src[i // L]`` (bags of ``L`` values each in
            ``grad_src``'s row order, the fixed-length multi-hot case): the source index is computed from the
            sort permutation with one integer division instead of being gathered from ``src_index``.
        segments: lengths of consecutive runs of ``rows`` whose row ranges are disjoint and increasing
            (one table per run, tables in storage order). Adjacent runs are merged into chunks of at least
            ``SORT_CHUNK`` values and each chunk is sorted on its own: the same order as one sort of all
            rows, faster (see ``SORT_CHUNK``).
        scratch: reusable buffers for the per-value arrays (sorted keys, permutation, weights), so a
            training loop does not allocate and page-fault ``O(n)`` memory every step.

    Returns:
        ``(unique_rows int64 [u], grads [u, dim])`` with ``unique_rows`` sorted ascending.
    """
    n = rows.numel()
    if n == 0:
        return rows.new_empty(0), grad_src.new_zeros(0, grad_src.shape[1])
    keys = rows.to(torch.int32) if num_rows is not None and num_rows <= _INT32_MAX else rows
    chunks = sort_chunks(segments) if segments is not None and n >= 2 * SORT_CHUNK else None
    if chunks is not None and len(chunks) > 1:
        sorted_rows = (scratch.take("keys", n, keys.dtype, keys.device) if scratch is not None
                       else torch.empty_like(keys))
        perm = (scratch.take("perm", n, torch.int64, keys.device) if scratch is not None
                else torch.empty(n, dtype=torch.int64, device=keys.device))
        start = 0
        for m in chunks:
            end = start + m
            torch.sort(keys[start:end], stable=True, out=(sorted_rows[start:end], perm[start:end]))
            if start:
                perm[start:end].add_(start)
            start = end
    elif scratch is not None:
        sorted_rows, perm = scratch.take("keys", n, keys.dtype, keys.device), scratch.take("perm", n, torch.int64,
                                                                                          keys.device)
        torch.sort(keys, stable=True, out=(sorted_rows, perm))  # each row's values summed in batch order
    else:
        sorted_rows, perm = torch.sort(keys, stable=True)
    unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    seg = counts.new_zeros(counts.numel() + 1)
    torch.cumsum(counts, 0, out=seg[1:])
    if scale is not None:
        if scratch is not None:
            w = torch.index_select(scale.to(grad_src.dtype), 0, perm,
                                   out=scratch.take("weights", n, grad_src.dtype, grad_src.device))
        else:
            w = scale.index_select(0, perm).to(grad_src.dtype)
        if factor != 1.0:
            w = w.mul_(factor)
    elif factor != 1.0:
        if scratch is not None:
            w = scratch.take("weights", n, grad_src.dtype, grad_src.device).fill_(factor)
        else:
            w = torch.full((n,), factor, dtype=grad_src.dtype, device=grad_src.device)
    else:
        w = None
    if values_per_src > 0:  # value i reads bag i // L: no gathered bag index (perm is ours to overwrite)
        L = values_per_src
        if L & (L - 1) == 0:  # a power of two: a shift (integer division is several times slower)
            src = perm.bitwise_right_shift_(L.bit_length() - 1) if L > 1 else perm
        else:
            src = perm.div_(L, rounding_mode="floor")
    else:
        src = perm if src_index is None else src_index.index_select(0, perm)
    grads = F.embedding_bag(src, grad_src.contiguous(), seg, mode="sum", per_sample_weights=w,
                            include_last_offset=True)
    return unique_rows.to(torch.int64), grads


class RowGradientScratch:
    """Per-value buffers of :func:`aggregate_row_gradients`, kept across training steps.

    ``take(name, n, dtype, device)`` returns the first ``n`` elements of a buffer that grows (by 1.25x, so
    batches of slowly varying size reuse it) and is never shrunk: a steady training loop allocates nothing
    per step for these ``O(n)`` arrays (fresh multi-megabyte allocations are page-faulted in again every
    step, which costs time and makes step times vary).
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._held: dict[str, weakref.ref] = {}

    def take(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(n, int(n * 1.25)), dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:n]

    def take_unshared(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Like :meth:`take`, for a buffer the caller keeps beyond this call (a lookup's rows, held by the
        autograd graph until its backward): while the view handed out last time is still alive (two
        lookups before one backward, a caller keeping the graph), a fresh tensor is returned instead."""
        held = self._held.get(name)
        if held is not None and held() is not None:
            return torch.empty(n, dtype=dtype, device=device)
        view = self.take(name, n, dtype, device)
        self._held[name] = weakref.ref(view)
        return view

    def clear(self) -> None:
        self._bufs.clear()
        self._held.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def add_rows_(weight: torch.Tensor, unique_rows: torch.Tensor, delta: torch.Tensor) -> None:
    """``weight[unique_rows[i]] += delta[i]`` in place; ``unique_rows`` must not repeat."""
    if unique_rows.numel() == 0:
        return
    # scatter_add_ with an expanded index: a plain row scatter (rows are unique, so no write
    # conflicts); on CPU it beats index_add_, which loops over rows.
    weight.scatter_add_(0, unique_rows.unsqueeze(1).expand(-1, weight.shape[1]), delta.to(weight.dtype))


def with_weight_decay(weight: torch.Tensor, unique_rows: torch.Tensor, grads: torch.Tensor,
                      weight_decay: float) -> torch.Tensor:
    """``grads[i] + weight_decay * weight[unique_rows[i]]`` (a new tensor; ``grads`` itself when the decay is 0)."""
    if not weight_decay:
        return grads
    return grads + weight.index_select(0, unique_rows).to(grads.dtype) * weight_decay


def sgd_update_(weight: torch.Tensor, unique_rows: torch.Tensor, grads: torch.Tensor, lr: float,
                weight_decay: float = 0.0) -> None:
    """``weight[r] -= lr * (grads[i] + weight_decay * weight[r])`` for ``r = unique_rows[i]``, in place;
    ``unique_rows`` must not repeat."""
    add_rows_(weight, unique_rows, with_weight_decay(weight, unique_rows, grads, weight_decay) * (-lr))


def rowwise_adagrad_update_(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    unique_rows: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """FBGEMM ``EXACT_ROWWISE_ADAGRAD`` on unique rows, in place (see the module docstring).

    Args:
        weight: ``[num_rows, dim]`` storage (updated).
        momentum: float32 ``[num_rows]`` per-row sum of mean squared gradients (updated).
        unique_rows: int64 ``[u]`` rows to update, no repeats.
        grads: ``[u, dim]`` summed gradient of each row.
        weight_decay: L2 on the rows updated: ``wd * weight[r]`` added to each row's gradient first.
    """
    if unique_rows.numel() == 0:
        return
    g = with_weight_decay(weight, unique_rows, grads.to(torch.float32), weight_decay)
    m = momentum.index_select(0, unique_rows).add_(row_mean_squares(g))
    momentum.index_copy_(0, unique_rows, m)
    add_rows_(weight, unique_rows, g * rowwise_adagrad_multiplier(m, lr, eps).unsqueeze(1))


def set_weight_decay(module: torch.nn.Module, weight_decay: float) -> int:
    """Weight decay ``weight_decay`` (>= 0, the module docstring's rule) on the rows every fused-optimizer
    submodule of ``module`` updates (each one that keeps a ``weight_decay`` attribute: local and sharded
    rows); returns how many it set. TT cores and host-placed tables keep their own updates, without it."""
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
        raise ConfigError(f"train.sparse_weight_decay must be a number >= 0, got {weight_decay!r}")
    n = 0
    for m in module.modules():
        if hasattr(m, "weight_decay") and hasattr(m, "lr"):
            m.weight_decay = float(weight_decay)
            n += 1
    return n


def rowwise_adagrad_multiplier(m: torch.Tensor, lr: float, eps: float) -> torch.Tensor:
    """``-lr / (sqrt(m) + eps)`` of the updated float32 state ``m``, as ``-lr * (1 / (sqrt(m) + eps))`` with
    a correctly rounded sqrt (taken in float64, then rounded; torch's vectorised float32 sqrt is not
    correctly rounded), so the C++ kernel's ``std::sqrt`` gives the same bits. ``m`` is not modified."""
    return m.double().sqrt_().to(torch.float32).add_(eps).reciprocal_().mul_(-lr)


def row_mean_squares(g: torch.Tensor) -> torch.Tensor:
    """``mean(g ** 2, dim=1)`` of a float32 ``[u, dim]`` matrix, summed in a fixed order: the squares
    are folded in halves (column ``j`` += column ``j + h``, ``h = width // 2``; an odd width's last column
    is added to column 0) until one column remains, then divided by ``dim``. torch's own reduction order
    depends on the CPU's vector width; this one is the C++ kernel's (``kernels.cpp``), so both paths give
    the same bits, and costs ``log2(dim)`` elementwise adds."""
    D = g.shape[1]
    s = g * g
    while s.shape[1] > 1:
        w = s.shape[1]
        h = w // 2
        t = s[:, :h] + s[:, h:2 * h]
        if w % 2:
            t[:, :1] += s[:, 2 * h:]
        s = t
    return s[:, 0] / D
