"""Row-wise quantized embedding tables and a pooled lookup straight from them.

Forms (per table): ``fp32`` (as trained), ``fp16`` (half rows, ``2 * dim`` bytes, no scale or bias) and
``int8`` / ``int4`` row-wise: each row stores its values as unsigned ``bits``-bit integers ``q`` with one
fp16 ``scale`` and one fp16 ``bias`` per row, ``x ~= scale * q + bias``, in FBGEMM's fused row layout
(``FloatToFusedNBitRowwiseQuantizedSBHalf``): a row is ``dim * bits / 8`` bytes of packed values (INT4: two
per byte, the even column in the low nibble) followed by the fp16 scale and the fp16 bias, so
``dim * bits / 8 + 4`` bytes a row, and the bytes move unchanged between the two. The rounding is FBGEMM's:
the bias is the row minimum rounded to fp16, the scale ``(max - bias) / (2**bits - 1)`` rounded to fp16
(1 for a constant row), ``q = clamp(rint((x - bias) / scale), 0, 2**bits - 1)`` (round half to even).
Per element the error is at most ``scale / 2`` plus the fp16 rounding of scale and bias.

The lookup (:func:`pooled_lookup`) dequantises the rows a batch reads and pools them (sum or mean, per-sample
weights, empty bags give zeros), as TorchRec's quantized ``EmbeddingBagCollection`` does with FBGEMM's
``IntNBitTableBatchedEmbeddingBagsCodegen``. :func:`pooled_lookup_many` pools every feature of a batch in one
call of the fused C++ kernel (``embedding/quant_kernels.cpp``: rows dequantised in registers, never written
out, in parallel over features and bags, like FBGEMM's kernel), and falls back to :func:`pooled_lookup` per
feature when the kernel is not built.
"""

from __future__ import annotations

import torch

from embedscale.device import HOST
from embedscale.embedding.kernels import quant_ops

FORMS = ("fp32", "fp16", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
FORM_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}
"""Bits a stored value of each form takes (the fused kernel's ``bits``)."""
QPARAM_BYTES = 4  # fp16 scale + fp16 bias after a row's packed values


def row_bytes(form: str, dim: int) -> int:
    """Bytes of one stored row: ``4 dim`` (fp32), ``2 dim`` (fp16), ``dim * bits / 8 + 4`` (int8, int4)."""
    if form == "fp32":
        return 4 * dim
    if form == "fp16":
        return 2 * dim
    bits = BITS[form]
    if (dim * bits) % 8:
        raise ValueError(f"{form}: dim {dim} does not fill whole bytes ({bits} bits a value)")
    return dim * bits // 8 + QPARAM_BYTES


def quantize_rows(weight: torch.Tensor, form: str) -> torch.Tensor:
    """``[rows, dim]`` float -> the stored table: float32, float16, or ``uint8 [rows, row_bytes]`` fused rows."""
    w = weight.detach().to(torch.float32).to(HOST)
    if form == "fp32":
        return w.contiguous()
    if form == "fp16":
        return w.to(torch.float16).contiguous()
    if form not in BITS:
        raise ValueError(f"unknown table form {form!r}; one of {', '.join(FORMS)}")
    bits = BITS[form]
    levels = (1 << bits) - 1
    rows, dim = w.shape
    row_bytes(form, dim)  # checks the width
    lo = w.min(dim=1).values if dim else torch.zeros(rows)
    hi = w.max(dim=1).values if dim else torch.zeros(rows)
    bias = lo.to(torch.float16).to(torch.float32)  # the bias is stored as fp16: quantise against that value
    span = hi - bias
    scale = torch.where(span == 0, torch.ones_like(span), span / levels).to(torch.float16).to(torch.float32)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    inv = 1.0 / scale
    bad = torch.isinf(inv)
    scale, inv = torch.where(bad, 1.0, scale), torch.where(bad, 1.0, inv)
    q = torch.clamp(torch.round((w - bias[:, None]) * inv[:, None]), 0, levels).to(torch.uint8)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    qparams = torch.stack([scale.to(torch.float16), bias.to(torch.float16)], dim=1).contiguous()
    return torch.cat([q, qparams.view(torch.uint8).view(rows, QPARAM_BYTES)], dim=1).contiguous()


def dequantize_rows(stored: torch.Tensor, form: str, dim: int) -> torch.Tensor:
    """The float32 ``[rows, dim]`` values of stored rows (any subset of a table's rows)."""
    if form in ("fp32", "fp16"):
        return stored.to(torch.float32)
    bits = BITS[form]
    data = stored[:, : dim * bits // 8]
    qp = stored[:, dim * bits // 8:].contiguous().view(torch.float16).to(torch.float32)
    if bits == 4:
        q = torch.stack([data & 0xF, data >> 4], dim=2).reshape(stored.shape[0], dim)
    else:
        q = data
    return q.to(torch.float32) * qp[:, :1] + qp[:, 1:2]


def pooled_lookup(stored: torch.Tensor, form: str, dim: int, ids: torch.Tensor, offsets: torch.Tensor,
                  mode: str = "sum", weights: torch.Tensor | None = None) -> torch.Tensor:
    """Pool bags of rows of one stored table: ``ids`` (int64, every bag's rows back to back), ``offsets``
    (``[B + 1]`` bag starts, last = ``len(ids)``), ``mode`` ``sum`` or ``mean`` (weighted sum over the bag
    length), ``weights`` per id (or ``None``) -> float32 ``[B, dim]``; an empty bag gives zeros."""
    rows = dequantize_rows(stored[ids], form, dim)
    if weights is not None:
        rows = rows * weights.to(torch.float32)[:, None]
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    out = torch.zeros(len(lengths), dim, dtype=torch.float32)
    out.index_add_(0, bag, rows)
    if mode == "mean":
        out = out / lengths.clamp(min=1).to(torch.float32)[:, None]
    elif mode != "sum":
        raise ValueError(f"pooling {mode!r} is not sum or mean")
    return out


def pooled_lookup_many(tables: list[tuple[torch.Tensor, str, int]], features: list[tuple], batch_size: int,
                       use_kernel: bool = True) -> torch.Tensor:
    """Pool every feature of a batch: ``tables`` are ``(stored, form, dim)``; ``features`` are
    ``(table index, ids, offsets, mode, weights or None)`` as :func:`pooled_lookup` takes them. Returns float32
    ``[B, sum of the features' dims]``, the features' columns in the order given: one call of the fused kernel
    when it is built (``use_kernel``), else :func:`pooled_lookup` per feature (the same figures up to the order of
    float additions)."""
    ops = quant_ops() if use_kernel else None
    if ops is None:
        return torch.cat([pooled_lookup(tables[t][0], tables[t][1], tables[t][2], ids, offsets, mode, w)
                          for t, ids, offsets, mode, w in features], dim=1) if features else \
            torch.zeros(batch_size, 0)
    none = torch.empty(0, dtype=torch.float32)
    for t, _, _, mode, _ in features:
        if mode not in ("sum", "mean"):
            raise ValueError(f"pooling {mode!r} is not sum or mean")
    return ops.quantized_pooled_forward(
        [stored.contiguous() for stored, _, _ in tables], [FORM_BITS[form] for _, form, _ in tables],
        [dim for _, _, dim in tables], [t for t, *_ in features],
        [_int64(ids) for _, ids, _, _, _ in features], [_int64(offsets) for _, _, offsets, _, _ in features],
        [none if w is None else w.to(torch.float32).contiguous() for *_, w in features],
        [mode == "mean" for _, _, _, mode, _ in features], batch_size)


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def max_row_error(stored: torch.Tensor, form: str) -> torch.Tensor:
    """Per row, the largest rounding error of one value (``scale / 2``; 0 for fp32; fp16: not a per-row
    figure, ``None``)."""
    if form not in BITS:
        raise ValueError(f"{form}: no per-row quantisation step")
    dim_bytes = stored.shape[1] - QPARAM_BYTES
    qp = stored[:, dim_bytes:].contiguous().view(torch.float16).to(torch.float32)
    return qp[:, 0] / 2


__all__ = ["BITS", "FORMS", "FORM_BITS", "QPARAM_BYTES", "dequantize_rows", "max_row_error", "pooled_lookup",
           "pooled_lookup_many", "quantize_rows", "row_bytes"]
