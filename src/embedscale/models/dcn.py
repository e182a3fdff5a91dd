"""DCN-v2 (Wang et al. 2021, "DCN V2: Improved Deep & Cross Network and Practical Lessons for Web-scale
Learning to Rank Systems"): the cross network and the stacked DCN model.

This module owns ``CrossNet`` (full-rank and low-rank cross layers; also the building block of DMT's DCN
tower module) and ``DCN``, which reuses DLRM's bottom MLP, ``SparseArch`` and ``OverArch`` from
``embedscale.models.dlrm``.

Structure (the *stacked* DCN-v2 of Wang et al. 2021 section 3, Figure 1 left):

    x0     = [ bottom_mlp(dense) , e_1 , ... , e_F ]        (concatenation, width D + sum of feature dims)
    x_L    = CrossNet(x0)                                    (L cross layers, same width)
    logit  = OverArch(x_L) [+ FirstOrder(e, dense)]          (deep MLP of ReLU layers, then 1 logit; the
                                                              first-order (wide) term with ``first_order``)

The parallel structure (cross and deep side by side) is not implemented. Unlike DLRM, features may have
different embedding dims, since nothing is dotted.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import nn

from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError, InputError
from embedscale.models.dlrm import (DenseArch, FirstOrder, LogitCalibration, OverArch, SparseArch, _check_dense,
                                    _check_num_dense, dense_parameters)

__all__ = ["DCN", "CrossNet"]


class CrossNet(nn.Module):
    """The DCN-v2 cross network: ``num_layers`` cross layers of constant width ``in_features``.

    Full rank (Wang et al. 2021, eq. 1)::

        x_{l+1} = x_0 * (W_l x_l + b_l) + x_l            W_l: [d, d]

    Low rank (Wang et al. 2021, section 5, eq. 2: ``W_l = U_l V_l``; our ``V_l`` is the paper's ``V_l^T``),
    when ``low_rank = r > 0``::

        x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l      U_l: [d, r], V_l: [r, d]

    ``*`` is the element-wise product. Init: kernels (``W_l``, ``U_l``, ``V_l``) ~ N(0, sqrt(2 / (fan_in +
    fan_out))) (Glorot normal, the same rule as the DLRM reference's linear layers); biases ``b_l`` = 0, so
    each layer starts as ``x_0 * (W_l x_l) + x_l``.

    Args:
        in_features: d, the width of ``x_0``.
        num_layers: number of cross layers L (0 = identity).
        low_rank: r; 0 for full-rank layers.
        device: where to allocate the parameters.

    Example::

        >>> import torch
        >>> cross = CrossNet(in_features=6, num_layers=2, low_rank=3)
        >>> cross(torch.rand(4, 6)).shape
        torch.Size([4, 6])
    """

    def __init__(
        self, in_features: int, num_layers: int, low_rank: int = 0, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        checks = (("in_features", in_features, 1), ("num_layers", num_layers, 0), ("low_rank", low_rank, 0))
        for name, value, low in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"CrossNet: {name} must be an integer >= {low}, got {value!r}")
        self.in_features = in_features
        self.num_layers = num_layers
        self.low_rank = low_rank
        d, r = in_features, low_rank

        def kernel(rows: int, cols: int) -> nn.Parameter:
            w = torch.empty(rows, cols, device=device)
            nn.init.normal_(w, 0.0, math.sqrt(2.0 / (rows + cols)))
            return nn.Parameter(w)

        if r > 0:
            self.U = nn.ParameterList([kernel(d, r) for _ in range(num_layers)])
            self.V = nn.ParameterList([kernel(r, d) for _ in range(num_layers)])
        else:
            self.W = nn.ParameterList([kernel(d, d) for _ in range(num_layers)])
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(d, device=device)) for _ in range(num_layers)])

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x0: ``[B, in_features]``.

        Returns:
            torch.Tensor: ``x_L``, ``[B, in_features]``.
        """
        if x0.dim() != 2 or x0.shape[1] != self.in_features:
            raise InputError(f"CrossNet: expected input [B, {self.in_features}], got {list(x0.shape)}")
        x = x0
        for layer in range(self.num_layers):
            if self.low_rank > 0:
                h = (x @ self.V[layer].t()) @ self.U[layer].t()
            else:
                h = x @ self.W[layer].t()
            x = x0 * (h + self.b[layer]) + x
        return x


class DCN(nn.Module):
    """DCN-v2, stacked (Wang et al. 2021): bottom MLP and embeddings, cross network, deep MLP, logit.

    Args:
        dense_in_features: number of dense features (13 for Criteo).
        embedding: the embedding module (``feature_names`` attribute, ``forward(JaggedFeatures) -> [B, sum
            of dims]``); reachable afterwards as ``model.sparse_arch.embedding``.
        embedding_dim: width of the bottom MLP's last layer (and the default dim of every feature).
        feature_dims: embedding dim of every feature in ``embedding.feature_names`` order (default: all
            ``embedding_dim``).
        bottom_mlp: hidden widths of the bottom MLP; a last layer of width ``embedding_dim`` is added.
        top_mlp: hidden widths of the deep MLP on top of the cross network; the logit layer is added.
        cross_layers: number of cross layers.
        cross_low_rank: rank r of the low-rank cross layers; 0 for full rank.
        device: where to allocate the dense parameters (the embedding module is used as given).
        first_order: add the first-order (wide) term (``models.dlrm.FirstOrder``) to the logit.

    Without dense features (``dense_in_features = 0``) there is no bottom MLP: ``x0`` is the embeddings alone.

    Example::

        >>> import torch
        >>> from embedscale.data.batch import JaggedFeatures
        >>> from embedscale.embedding.local import LocalEmbeddingBags
        >>> from embedscale.specs import TableSpec
        >>> tables = [TableSpec("t1", num_rows=10, dim=4), TableSpec("t2", num_rows=20, dim=8)]
        >>> model = DCN(13, LocalEmbeddingBags(tables), embedding_dim=4, feature_dims=[4, 8],
        ...             bottom_mlp=[8], top_mlp=[8], cross_layers=2, cross_low_rank=2)
        >>> model.cross_net.in_features  # 4 (bottom MLP) + 4 + 8
        16
        >>> features = JaggedFeatures.from_lists({"t1": [[0, 1], [3]], "t2": [[5], [7]]})
        >>> model(torch.rand(2, 13), features).shape
        torch.Size([2])
    """

    def __init__(
        self,
        dense_in_features: int,
        embedding: nn.Module,
        embedding_dim: int,
        feature_dims: Sequence[int] | None = None,
        bottom_mlp: Sequence[int] = (512, 256, 64),
        top_mlp: Sequence[int] = (512, 256),
        cross_layers: int = 3,
        cross_low_rank: int = 0,
        device: torch.device | str | None = None,
        first_order: bool = False,
    ) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(embedding, embedding_dim if feature_dims is None else feature_dims)
        self.dense_in_features = _check_num_dense(dense_in_features)
        self.embedding_dim = embedding_dim
        self.dense_arch = (DenseArch(dense_in_features, list(bottom_mlp) + [embedding_dim], device=device)
                           if dense_in_features else None)
        width = (embedding_dim if self.dense_arch is not None else 0) + self.sparse_arch.out_features
        self.cross_net = CrossNet(width, cross_layers, cross_low_rank, device=device)
        self.over_arch = OverArch(self.cross_net.in_features, list(top_mlp), device=device)
        self.first_order = (FirstOrder(self.sparse_arch.feature_dims, dense_in_features, device=device)
                            if first_order else None)
        self.calibration = LogitCalibration(device=device)
        self.overlap = True  # as DLRM's: the embedding's exchange in flight during the bottom MLP

    def forward(self, dense: torch.Tensor, sparse: JaggedFeatures) -> torch.Tensor:
        """
        Args:
            dense: dense features ``[B, dense_in_features]``.
            sparse: sparse features of the same ``B`` samples.

        Returns:
            torch.Tensor: logits ``[B]``.
        """
        _check_dense(dense, self.dense_in_features, sparse)
        if self.overlap and self.dense_arch is not None:  # the exchange in flight during the bottom MLP (OPER 5.2)
            started = self.sparse_arch.start(sparse)
            dense_out = self.dense_arch(dense)
            pooled = self.sparse_arch.pooled(sparse, started)
            x0 = torch.cat([dense_out, pooled], dim=1)
        else:
            pooled = self.sparse_arch.pooled(sparse)
            x0 = torch.cat([self.dense_arch(dense), pooled], dim=1) if self.dense_arch is not None else pooled
        logit = self.over_arch(self.cross_net(x0)).squeeze(-1)
        if self.first_order is not None:
            logit = logit + self.first_order(pooled, dense)
        return self.calibration(logit)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """All parameters but the embedding module's (for a separate dense optimizer)."""
        return dense_parameters(self)
