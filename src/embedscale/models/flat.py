"""The flat models' builder: DLRM or DCN-v2 over any embedding module, every argument checked before a
parameter is allocated (``models.build_model`` calls it for ``dlrm``/``dcn``; DMT builds its plain baseline
with it too, so it imports nothing of ``models.dmt``), and the flat baseline's quantized embedding
communication (:class:`QuantizedComm`).

Quantized communication is what the DMT paper's *Strong Baseline* turns on (DMT section 5, "quantized
embedding and gradient communication", after Yang et al. 2021 and TorchRec's ``QCommsConfig``): the pooled
embeddings of the model-parallel all_to_all travel in a narrower type (fp16 forward and bf16 backward by
default, as TorchRec's qcomms; or row-wise int8 with an fp32 scale and offset per row) and are widened back
to float32 on arrival. Gradients pass through the codec as they are (straight-through), as in TorchRec.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from embedscale.comm.transport import Transport
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import ConfigError, InputError
from embedscale.models.dcn import DCN
from embedscale.models.dlrm import DLRM
from embedscale.specs import ModelConfig, TableSpec, feature_to_table


def _check_widths(key: str, sizes: Sequence[int]) -> list[int]:
    out = list(sizes)
    for i, s in enumerate(out):
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ConfigError(f"{key}[{i}] must be a positive integer, got {s!r} (in {out})")
    return out


def build_flat(cfg: ModelConfig, tables: list[TableSpec], num_dense: int, embedding: nn.Module | None = None, *,
               device: torch.device | str | None = None, first_order: bool = False) -> nn.Module:
    """``cfg.arch`` (``dlrm`` or ``dcn``) over ``tables`` and ``embedding`` (default ``LocalEmbeddingBags``);
    the checks and arguments of :func:`embedscale.models.build_model` for the flat archs. ``first_order``: the
    first-order (wide) term (``models.dlrm.FirstOrder``; ``build_model`` passes ``model.first_order``, the DMT
    builders' plain baselines none). ``num_dense`` may be 0 (a log without dense features: no bottom MLP)."""
    arch = cfg.arch.lower()
    if isinstance(num_dense, bool) or not isinstance(num_dense, int) or num_dense < 0:
        raise ConfigError(f"num_dense: the number of dense features must be an integer >= 0, got {num_dense!r}")
    if isinstance(cfg.embedding_dim, bool) or not isinstance(cfg.embedding_dim, int) or cfg.embedding_dim <= 0:
        raise ConfigError(f"model.embedding_dim must be a positive integer, got {cfg.embedding_dim!r}")
    bottom = _check_widths("model.bottom_mlp", cfg.bottom_mlp)
    top = _check_widths("model.top_mlp", cfg.top_mlp)
    if not tables:
        raise ConfigError("build_model: no embedding tables")
    table_of = feature_to_table(tables)
    for spec in tables:
        if spec.pooling == "none":
            raise ConfigError(
                f"table {spec.name!r}: pooling 'none' (unpooled sequence) cannot feed {arch}, which needs one "
                "pooled vector per feature; use 'sum' or 'mean'"
            )
        if arch == "dlrm" and spec.dim != cfg.embedding_dim:
            raise ConfigError(
                f"table {spec.name!r}: dim {spec.dim} differs from model.embedding_dim {cfg.embedding_dim}; "
                "DLRM's dot interaction needs every table and the bottom MLP output to share one dim"
            )
    if arch == "dcn":
        for key in ("cross_layers", "cross_low_rank"):
            v = getattr(cfg, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"model.{key} must be a non-negative integer, got {v!r}")

    if embedding is None:
        embedding = LocalEmbeddingBags(tables, device=device)

    names = getattr(embedding, "feature_names", None)
    if names is None:
        raise ConfigError(
            f"build_model: the embedding module {type(embedding).__name__} has no `feature_names` attribute"
        )
    names = list(names)
    unknown = [f for f in names if f not in table_of]
    if unknown:
        raise ConfigError(
            f"build_model: the embedding module produces features {unknown} that no table reads "
            f"(tables: {[t.name for t in tables]})"
        )
    missing = [f for f in table_of if f not in names]
    if missing:
        raise ConfigError(f"build_model: features {missing} of the tables are not produced by the embedding module")
    feature_dims = [tables[table_of[f]].dim for f in names]

    if arch == "dlrm":
        if num_dense == 0 and len(names) < 2:
            raise ConfigError(f"model.arch dlrm: without dense features the dot interaction needs at least 2 sparse "
                              f"features, the data has {names}; use model.arch dcn")
        return DLRM(num_dense, embedding, cfg.embedding_dim, bottom_mlp=bottom, top_mlp=top, device=device,
                    first_order=first_order)
    return DCN(num_dense, embedding, cfg.embedding_dim, feature_dims=feature_dims, bottom_mlp=bottom, top_mlp=top,
               cross_layers=cfg.cross_layers, cross_low_rank=cfg.cross_low_rank, device=device,
               first_order=first_order)


# --------------------------------------------------------------------------------------------------
# quantized embedding communication (the DMT paper's Strong Baseline, section 5)

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
_FLOAT = {"fp16": torch.float16, "bf16": torch.bfloat16}
_FP16_MAX = 65504.0
QUANTIZED_KINDS = ("flat_a2a", "tower_a2a", "peer_a2a")  # pooled-vector exchanges; ids and counts never


def quantize_rows_int8(x: torch.Tensor, row_width: int) -> torch.Tensor:
    """Row-wise asymmetric int8 (TorchRec's INT8 qcomm codec): ``x`` (numel a multiple of ``row_width``) ->
    ``[rows, row_width + 8]`` uint8: each row's codes ``round((x - min) / scale)`` in ``[0, 255]``, then its
    fp32 ``scale = (max - min) / 255`` and ``min`` as 8 bytes."""
    rows = x.reshape(-1, row_width).to(torch.float32)
    lo = rows.amin(1, keepdim=True) if rows.shape[0] else rows[:, :1]
    hi = rows.amax(1, keepdim=True) if rows.shape[0] else rows[:, :1]
    scale = (hi - lo) / 255.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((rows - lo) / safe).clamp_(0, 255).to(torch.uint8)  # in range by construction
    meta = torch.cat([scale, lo], 1).contiguous().view(torch.uint8)  # [rows, 8]
    return torch.cat([q, meta], 1)


def dequantize_rows_int8(packed: torch.Tensor, row_width: int) -> torch.Tensor:
    """Inverse of :func:`quantize_rows_int8`: ``[rows, row_width + 8]`` uint8 -> flat float32."""
    meta = packed[:, row_width:].contiguous().view(torch.float32)  # [rows, 2]
    return (packed[:, :row_width].to(torch.float32) * meta[:, :1] + meta[:, 1:]).reshape(-1)


class QuantizedTransport(Transport):
    """A transport whose float32 pooled-vector exchanges travel quantized (everything else as it is).

    ``exchange(send, recv_counts, kind)``: when ``kind`` (without a ``_grad`` suffix) is one of ``kinds`` and
    the tensors are float32, each piece is encoded (``forward`` precision, or ``backward`` for ``*_grad``
    kinds), exchanged through ``inner`` (which counts and, with a link model, pays for the narrower bytes)
    and decoded to float32. Every piece, this rank's own included, goes through the codec, so the result
    does not depend on which rank a sample lives on. Other attributes come from ``inner``.

    Args:
        inner: the transport that moves the bytes (a ``comm.hierarchical.HostAwareTransport``).
        forward, backward: ``fp32`` (unchanged), ``fp16``, ``bf16`` or ``int8`` (row-wise, needs ``row_width``).
        kinds: the exchange kinds to quantize.
        row_width: values per row of the int8 codec (the embedding dim).
    """

    name = "quantized"

    def __init__(self, inner: Transport, forward: str = "fp16", backward: str = "bf16",
                 kinds: Sequence[str] = QUANTIZED_KINDS, row_width: int | None = None):
        for what, prec in (("forward", forward), ("backward", backward)):
            if prec not in PRECISIONS:
                raise ConfigError(f"quantized communication: {what} precision {prec!r} is not one of "
                                  f"{', '.join(PRECISIONS)}")
            if prec == "int8" and not (isinstance(row_width, int) and row_width > 0):
                raise ConfigError(f"quantized communication: {what} int8 needs row_width (the embedding dim), "
                                  f"got {row_width!r}")
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner
        self.counter = inner.counter
        self.forward_precision = forward
        self.backward_precision = backward
        self.kinds = tuple(kinds)
        self.row_width = row_width

    @property
    def wire_device(self):
        return self.inner.wire_device

    def __getattr__(self, name: str):  # allreduce_sum_, byte counters, link of the inner transport
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def precision(self, kind: str) -> str:
        """The codec of an exchange of ``kind`` (``fp32``: not quantized)."""
        base = kind[:-len("_grad")] if kind.endswith("_grad") else kind
        if base not in self.kinds:
            return "fp32"
        return self.backward_precision if kind.endswith("_grad") else self.forward_precision

    def _encode(self, t: torch.Tensor, prec: str, kind: str) -> torch.Tensor:
        if prec == "int8":
            if t.numel() % self.row_width:
                raise ConfigError(f"quantized communication ({kind}): a piece of {t.numel()} values is not whole "
                                  f"rows of {self.row_width}")
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise InputError(f"quantized communication ({kind}): non-finite values cannot be int8-encoded")
            return quantize_rows_int8(t, self.row_width)
        if prec == "fp16" and t.numel():
            m = float(t.abs().max())
            if m > _FP16_MAX:
                raise InputError(f"quantized communication ({kind}): a value of magnitude {m:.6g} exceeds "
                                 f"float16's range ({_FP16_MAX:g}); use bf16 for this exchange")
        # the 16-bit values as their bytes ([rows, 2 x values per row] uint8, the rows of ``t``): every backend
        # carries uint8 bit for bit (gloo's all_to_all has no int16)
        width = 1
        for d in t.shape[1:]:
            width *= d
        return t.to(_FLOAT[prec]).reshape(t.shape[0], width).view(torch.uint8)

    def _decode(self, t: torch.Tensor, prec: str, shape: tuple) -> torch.Tensor:
        if prec == "int8":
            return dequantize_rows_int8(t, self.row_width).view(shape)
        return t.view(_FLOAT[prec]).to(torch.float32).view(shape)

    def exchange(self, send: list[torch.Tensor], recv_counts: list[int] | None = None,
                 kind: str = "data") -> list[torch.Tensor]:
        prec = self.precision(kind)
        if prec == "fp32" or not send or send[0].dtype != torch.float32:
            return self.inner.exchange(send, recv_counts, kind)
        tail = tuple(send[0].shape[1:])
        per_row = 1
        for d in tail:
            per_row *= d
        if prec == "int8":
            enc = [self._encode(t.reshape(-1), prec, kind) for t in send]  # [rows, width + 8] uint8
            rc = None if recv_counts is None else [c * per_row // self.row_width for c in recv_counts]
            got = self.inner.exchange(enc, rc, kind)
            return [self._decode(g, prec, (-1, *tail)) for g in got]
        enc = [self._encode(t, prec, kind) for t in send]
        got = self.inner.exchange(enc, recv_counts, kind)
        return [self._decode(g, prec, (-1, *tail)) for g in got]


class QuantizedComm:
    """A ``comm.hierarchical.TowerComm`` whose world, tower and peer transports quantize the pooled-vector
    exchanges (:class:`QuantizedTransport`): pass it where the TowerComm goes (``models.dmt.build_flat_model``,
    ``build_dmt_model``); process groups, layout, dense all-reduces and byte reports are the inner comm's."""

    def __init__(self, comm, forward: str = "fp16", backward: str = "bf16", kinds: Sequence[str] = QUANTIZED_KINDS,
                 row_width: int | None = None):
        self.inner = comm
        self.world = QuantizedTransport(comm.world, forward, backward, kinds, row_width)
        self.tower = QuantizedTransport(comm.tower, forward, backward, kinds, row_width)
        self.peer = QuantizedTransport(comm.peer, forward, backward, kinds, row_width)

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
