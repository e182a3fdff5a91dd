"""The flat models' builder: DLRM or DCN-v2 over any embedding module, every argument checked before a
parameter is allocated (``models.build_model`` calls it for ``dlrm``/``dcn``; DMT builds its plain baseline
with it too, so it imports nothing of ``models.dmt``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import ConfigError
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
               device: torch.device | str | None = None) -> nn.Module:
    """``cfg.arch`` (``dlrm`` or ``dcn``) over ``tables`` and ``embedding`` (default ``LocalEmbeddingBags``);
    the checks and arguments of :func:`embedscale.models.build_model` for the flat archs."""
    arch = cfg.arch.lower()
    if isinstance(num_dense, bool) or not isinstance(num_dense, int) or num_dense <= 0:
        raise ConfigError(f"num_dense: the models need at least one dense feature, got {num_dense!r}")
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
        return DLRM(num_dense, embedding, cfg.embedding_dim, bottom_mlp=bottom, top_mlp=top, device=device)
    return DCN(num_dense, embedding, cfg.embedding_dim, feature_dims=feature_dims, bottom_mlp=bottom, top_mlp=top,
               cross_layers=cfg.cross_layers, cross_low_rank=cfg.cross_low_rank, device=device)
