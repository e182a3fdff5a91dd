"""Recommendation models: DLRM (Naumov et al. 2019) and DCN-v2 (Wang et al. 2021), and ``build_model``.

``build_model`` turns a ``ModelConfig`` plus the table specs into a model whose embedding part is any
embedding module (by default ``embedscale.embedding.local.LocalEmbeddingBags``). It checks, before any
parameter is allocated, everything a run would otherwise trip over later: the arch name, the MLP widths,
that every feature the embedding produces belongs to a table, and (DLRM) that all tables share the
model's embedding dim.
"""

from __future__ import annotations


import torch
from torch import nn

from embedscale.errors import ConfigError
from embedscale.models.dcn import DCN, CrossNet
from embedscale.models.dlrm import (DLRM, DenseArch, FirstOrder, InteractionArch, OverArch, SparseArch,
                                    dense_parameters)
from embedscale.plan.forms import config_forms
from embedscale.specs import ModelConfig, TableSpec
from embedscale.models.dmt import DMTConfig, build_dmt_model, check_no_tower_settings
from embedscale.models.flat import _check_widths, build_flat

__all__ = [
    "ALL_ARCHS",
    "ARCHS",
    "DCN",
    "DLRM",
    "CrossNet",
    "DenseArch",
    "FirstOrder",
    "InteractionArch",
    "OverArch",
    "SparseArch",
    "build_model",
    "dense_parameters",
]

ARCHS = ("dlrm", "dcn")  # the flat models; DMT_ARCHS (models.dmt) are their multi-tower variants
ALL_ARCHS = ARCHS + ("dmt-dlrm", "dmt-dcn")


def build_model(
    cfg: ModelConfig,
    tables: list[TableSpec],
    num_dense: int,
    embedding: nn.Module | None = None,
    *,
    device: torch.device | str | None = None,
    num_hosts: int = 1,
    comm=None,
    assignment=None,
    sparse_optimizer: str = "rowwise_adagrad",
    lr_sparse: float = 0.05,
    seed: int = 0,
) -> nn.Module:
    """Build the ``cfg.arch`` model (``dlrm``, ``dcn``, ``dmt-dlrm`` or ``dmt-dcn``) over ``tables``.

    The DMT archs (Luo et al., MLSys 2024) are built by :func:`embedscale.models.dmt.build_dmt_model` from
    ``cfg``'s tower settings (``model.towers``, ``model.tower_*``): it resolves the towers and builds their
    embedding through ``models.builder.build_embedding``, so ``embedding`` must be ``None``; ``num_hosts``
    (single process: the default tower count, one per host), ``comm`` (a ``TowerComm``: build this rank's part of the
    distributed model), ``assignment`` (a ``TowerAssignment`` overriding ``model.tower_assignment``),
    ``sparse_optimizer``, ``lr_sparse`` (the tables' fused optimizer) and ``seed`` (placement-independent
    initialisation) are for them only.

    Args:
        cfg: the model config: arch, embedding dim D, bottom/top MLP hidden widths (OPER Table 1 defaults:
            512-256-64 and 512-256; the D-wide and 1-wide output layers are implied), DCN cross layers and
            low rank.
        tables: the embedding tables; every feature of the embedding module must be read by one of them.
        num_dense: number of dense features (13 for Criteo; 0 for a log without any: no bottom MLP; the DMT
            archs need at least one).
        embedding: the embedding module (``feature_names`` attribute, ``forward(JaggedFeatures) -> [B, sum
            of dims]``); default ``LocalEmbeddingBags(tables, device=device)``.
        device: where to allocate the parameters (from the run config; default torch's default device).

    Returns:
        nn.Module: a ``DLRM`` or ``DCN``; ``model(dense, sparse)`` gives logits ``[B]``,
        ``model.dense_parameters()`` the non-embedding parameters, ``model.sparse_arch.embedding`` the
        embedding module.

    Raises:
        ConfigError: unknown arch, a non-positive width, a feature no table reads, a table of pooling
            ``none``, or (DLRM) a table whose dim is not ``cfg.embedding_dim``.

    Example::

        >>> import torch
        >>> from embedscale.data.batch import JaggedFeatures
        >>> from embedscale.specs import ModelConfig, TableSpec
        >>> tables = [TableSpec("t1", num_rows=10, dim=4), TableSpec("t2", num_rows=20, dim=4)]
        >>> cfg = ModelConfig(arch="dlrm", embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
        >>> model = build_model(cfg, tables, num_dense=13)
        >>> features = JaggedFeatures.from_lists({"t1": [[0, 1], [3]], "t2": [[5], [7]]})
        >>> model(torch.rand(2, 13), features).shape
        torch.Size([2])
    """
    arch = cfg.arch.lower() if isinstance(cfg.arch, str) else cfg.arch
    if arch not in ALL_ARCHS:
        raise ConfigError(f"model.arch: unknown architecture {cfg.arch!r}; known: {', '.join(ALL_ARCHS)}")
    if arch.startswith("dmt-"):
        if embedding is not None:
            raise ConfigError(f"model.arch {arch}: DMT models build their own tower embedding; pass embedding=None")
        if isinstance(num_dense, bool) or not isinstance(num_dense, int) or num_dense <= 0:
            raise ConfigError(f"num_dense: the models need at least one dense feature, got {num_dense!r}")
        _check_widths("model.bottom_mlp", cfg.bottom_mlp)
        _check_widths("model.top_mlp", cfg.top_mlp)
        forms = config_forms(cfg, tables)  # the forms the config asks for: the towers hold plain tables
        for spec in tables:
            if spec.pooling == "none" or forms[spec.name].kind != "sharded":
                raise ConfigError(f"table {spec.name!r}: {arch} needs pooled (sum/mean), uncompressed, device-placed "
                                  f"tables (got pooling {spec.pooling!r}, form {forms[spec.name].describe()})")
        return build_dmt_model(cfg, tables, num_dense, DMTConfig.from_model(cfg, check_file=assignment is None),
                               arch=arch, assignment=assignment, comm=comm, num_hosts=num_hosts,
                               optimizer=sparse_optimizer, lr=lr_sparse, seed=seed, device=device)
    check_no_tower_settings(cfg)
    return build_flat(cfg, tables, num_dense, embedding, device=device, first_order=cfg.first_order)
