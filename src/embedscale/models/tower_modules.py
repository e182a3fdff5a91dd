"""Tower modules (DMT section 3.2 and section 4, Listings 1-2): dense modules that compress a tower's
embeddings before they cross hosts, and the compression ratio they achieve.

A tower module (TM) takes ``embs [B, F_t, N]``, the pooled embeddings of the ``F_t`` features of one
tower for a batch of samples (the output of step e of the tower transform, DMT Figure 7), and returns
``[B, O_t]``. It sits right before the peer all_to_all (step f), so only ``O_t`` values per sample cross
hosts instead of ``F_t * N``. Its parameters are replicated on the ranks of one tower group only and
synchronised there (DMT 3.2, "System Perspective"): ``embedscale.models.dmt.sync_dense_gradients``.

Modules:

* :class:`PassThroughTower`: no module, ``O = F N`` (the tower transform alone, DMT Table 3).
* :class:`DLRMTowerModule` (Listing 1): ``cat(linear(F N -> p D)(flat embs), linear(N -> c D)(embs))``,
  ``O = D (c F + p)``: ``c F + p`` vectors of width ``D`` that join DLRM's dot interaction.
* :class:`DCNTowerModule` (Listing 2): a smaller CrossNet on the flat tower input, then
  ``linear(F N -> F D)``: ``O = F D``.

Compression ratio. DMT section 4 prints ``CR = sum_t O_t / (|F| N)`` but reports ``CR = 2, 4, 8, 16``
for ``D = 64, 32, 16, 8`` at ``N = 128`` (Table 5), i.e. input over output; :func:`compression_ratio`
returns input over output, so CR 4 means a quarter of the bytes cross hosts.

Initialisation: linear layers as the DLRM reference (``models.dlrm.init_linear_``), CrossNet as DCN-v2;
:func:`build_tower_modules` creates each tower's module under its own seed (``torch.manual_seed`` inside
``fork_rng``, so the caller's generators are untouched), so a tower's module starts identical on every
rank and in single-process runs on the same kind of device.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from embedscale.errors import ConfigError, InputError
from embedscale.models.dcn import CrossNet
from embedscale.models.dlrm import init_linear_

TOWER_MODULES = ("none", "dlrm", "dcn")


def _check_positive(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"tower module: {name} must be an integer >= {low}, got {value!r}")
    return value


class TowerModule(nn.Module):
    """Base: ``forward(embs [B, F, N]) -> [B, out_features]``.

    Attributes:
        num_features: F, the tower's features.
        embedding_dim: N.
        out_features: O.
        vector_dim: width of the output's vectors when the global interaction is a dot product (DLRM).
        num_vectors: ``out_features / vector_dim``.
    """

    num_features: int
    embedding_dim: int
    out_features: int
    vector_dim: int

    @property
    def num_vectors(self) -> int:
        return self.out_features // self.vector_dim

    def _check(self, embs: torch.Tensor) -> None:
        if embs.dim() != 3 or embs.shape[1] != self.num_features or embs.shape[2] != self.embedding_dim:
            raise InputError(f"{type(self).__name__}: expected embs [B, {self.num_features}, {self.embedding_dim}], "
                             f"got {list(embs.shape)}")


class PassThroughTower(TowerModule):
    """No tower module: the tower's embeddings flattened, ``O = F N`` (SPTT alone, DMT 5.2.1).

    Example::

        >>> PassThroughTower(3, 4)(torch.rand(2, 3, 4)).shape
        torch.Size([2, 12])
    """

    def __init__(self, num_features: int, embedding_dim: int):
        super().__init__()
        self.num_features = _check_positive("num_features", num_features)
        self.embedding_dim = _check_positive("embedding_dim", embedding_dim)
        self.out_features = num_features * embedding_dim
        self.vector_dim = embedding_dim

    def forward(self, embs: torch.Tensor) -> torch.Tensor:
        self._check(embs)
        return embs.reshape(embs.shape[0], -1)


class DLRMTowerModule(TowerModule):
    """DMT Listing 1, the DLRM tower module: a linear combination of the tower's features and a
    projection of the embedding dimension, lifted from DLRM's over arch.

    ::

        o1 = linear(F N -> p D)(embs.view(B, F N))          # p "mixed" vectors of width D
        o2 = linear(N -> c D)(embs).view(B, F c D)          # each feature projected to c vectors of width D
        out = cat([o1, o2], dim=1)                          # O = D (c F + p)

    Args:
        num_features: F.
        embedding_dim: N.
        out_dim: D, the width of every output vector (the dot interaction's dim).
        c: projected vectors per feature (DMT 5.2.2 uses c = 1, p = 0 for 2-8 and 26 towers).
        p: mixed vectors per tower (p = 1, c = 0 for 16 towers).
        device: where the parameters go.

    Example::

        >>> tm = DLRMTowerModule(num_features=4, embedding_dim=16, out_dim=4, c=1, p=1)
        >>> tm(torch.rand(2, 4, 16)).shape, tm.num_vectors
        (torch.Size([2, 20]), 5)
    """

    def __init__(self, num_features: int, embedding_dim: int, out_dim: int, c: int = 1, p: int = 0,
                 device: torch.device | str | None = None):
        super().__init__()
        self.num_features = _check_positive("num_features", num_features)
        self.embedding_dim = _check_positive("embedding_dim", embedding_dim)
        self.vector_dim = _check_positive("out_dim (D)", out_dim)
        self.c = _check_positive("c", c, 0)
        self.p = _check_positive("p", p, 0)
        if c == 0 and p == 0:
            raise ConfigError("DLRM tower module: c and p are both 0, the tower would output nothing")
        F, N, D = num_features, embedding_dim, out_dim
        self.mix = init_linear_(nn.Linear(F * N, p * D, device=device)) if p else None
        self.project = init_linear_(nn.Linear(N, c * D, device=device)) if c else None
        self.out_features = D * (c * F + p)

    def forward(self, embs: torch.Tensor) -> torch.Tensor:
        self._check(embs)
        B = embs.shape[0]
        outs = []
        if self.mix is not None:
            outs.append(self.mix(embs.reshape(B, -1)))
        if self.project is not None:
            outs.append(self.project(embs).reshape(B, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class DCNTowerModule(TowerModule):
    """DMT Listing 2, the DCN tower module: a smaller CrossNet over the tower's features, then a
    projection to ``D`` per feature.

    ::

        o = crossnet(F N)(embs.view(B, F N))                 # cross layers of width F N (< DCN's full width)
        out = linear(F N -> F D)(o)                          # O = F D

    Args:
        num_features: F.
        embedding_dim: N.
        out_dim: D.
        cross_layers: cross layers of the tower's CrossNet.
        low_rank: rank of the low-rank cross layers (0 = full rank).
        device: where the parameters go.

    Example::

        >>> tm = DCNTowerModule(num_features=3, embedding_dim=8, out_dim=2, cross_layers=1)
        >>> tm(torch.rand(5, 3, 8)).shape
        torch.Size([5, 6])
    """

    def __init__(self, num_features: int, embedding_dim: int, out_dim: int, cross_layers: int = 1,
                 low_rank: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.num_features = _check_positive("num_features", num_features)
        self.embedding_dim = _check_positive("embedding_dim", embedding_dim)
        self.vector_dim = _check_positive("out_dim (D)", out_dim)
        F, N, D = num_features, embedding_dim, out_dim
        self.cross = CrossNet(F * N, _check_positive("cross_layers", cross_layers, 0),
                              _check_positive("low_rank", low_rank, 0), device=device)
        self.project = init_linear_(nn.Linear(F * N, F * D, device=device))
        self.out_features = F * D

    def forward(self, embs: torch.Tensor) -> torch.Tensor:
        self._check(embs)
        return self.project(self.cross(embs.reshape(embs.shape[0], -1)))


def build_tower_modules(kind: str, tower_sizes: Sequence[int], embedding_dim: int, *, out_dim: int = 0,
                        c: int = 1, p: int = 0, cross_layers: int = 1, low_rank: int = 0, seed: int = 0,
                        towers: Sequence[int] | None = None,
                        device: torch.device | str | None = None) -> dict[int, TowerModule]:
    """One module per tower (or per tower in ``towers``), each created under seed ``(seed, tower)``.

    Args:
        kind: ``none`` (pass-through), ``dlrm`` (Listing 1) or ``dcn`` (Listing 2).
        tower_sizes: F_t of every tower (all towers, so that indices are global).
        embedding_dim: N.
        out_dim: D (required unless ``kind == "none"``).
        c, p: DLRM module parameters. cross_layers, low_rank: DCN module parameters.
        seed: initialisation seed; tower ``t`` uses ``seed * 1_000_003 + t``.
        towers: build only these towers (a rank builds its tower group's); default all.
        device: where the modules go.

    Returns:
        ``{tower index: module}``.
    """
    if kind not in TOWER_MODULES:
        raise ConfigError(f"tower module {kind!r} is not one of {TOWER_MODULES}")
    if kind != "none":
        _check_positive("out_dim (D)", out_dim)
    out: dict[int, TowerModule] = {}
    for t in (range(len(tower_sizes)) if towers is None else towers):
        F = int(tower_sizes[t])
        if F <= 0:
            raise ConfigError(f"tower {t} has no features")
        with torch.random.fork_rng():  # seeds (and restores) the generators of every device
            torch.manual_seed(seed * 1_000_003 + t)
            if kind == "none":
                m: TowerModule = PassThroughTower(F, embedding_dim)
            elif kind == "dlrm":
                m = DLRMTowerModule(F, embedding_dim, out_dim, c=c, p=p, device=device)
            else:
                m = DCNTowerModule(F, embedding_dim, out_dim, cross_layers=cross_layers, low_rank=low_rank,
                                   device=device)
        out[t] = m
    return out


def tower_out_features(kind: str, num_features: int, embedding_dim: int, out_dim: int, c: int = 1, p: int = 0) -> int:
    """``O_t`` of a tower module without building it: ``F N`` (none), ``D (c F + p)`` (dlrm), ``F D`` (dcn)."""
    if kind == "none":
        return num_features * embedding_dim
    if kind == "dlrm":
        return out_dim * (c * num_features + p)
    if kind == "dcn":
        return num_features * out_dim
    raise ConfigError(f"tower module {kind!r} is not one of {TOWER_MODULES}")


def compression_ratio(modules: Sequence[TowerModule]) -> float:
    """``sum_t F_t N / sum_t O_t``: how many times fewer values per sample leave the towers (DMT
    section 4; input over output, matching DMT Table 5's CR = 2..16)."""
    inp = sum(m.num_features * m.embedding_dim for m in modules)
    out = sum(m.out_features for m in modules)
    return inp / out
