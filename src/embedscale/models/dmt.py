"""Disaggregated Multi-Tower models (DMT, Luo et al., MLSys 2024): ``dmt-dlrm`` and ``dmt-dcn``.

This module owns the DMT models, the resolution of their towers (:func:`resolve_towers`: assignment,
tower modules), the flat model-parallel baseline's model, and the gradient synchronisation of DMT 3.2
(tower modules inside the tower, the rest over the world). The tower embeddings themselves (every tower in
one process, one rank's share of the tower transform, the table-wise baseline) live in
:mod:`embedscale.embedding.towers` and are built by the one embedding builder,
:func:`embedscale.models.builder.build_embedding` (``EmbeddingEnv.towers``).

Models:

* :class:`DMTDLRM`: bottom MLP to ``D``; every tower emits ``c F_t + p`` vectors of width ``D`` (DLRM
  tower module, Listing 1); DLRM's dot interaction over the dense vector and all tower vectors; top MLP.
* :class:`DMTDCN`: ``x0 = [bottom MLP (width N), tower outputs (F_t D each, Listing 2)]``, CrossNet,
  deep MLP.

:func:`build_dmt_model` builds either from a ``ModelConfig``, tables and a :class:`DMTConfig`; without a
``TowerComm`` it builds the single-process model, with one the distributed one (same initial weights):
:func:`resolve_towers`, then ``build_embedding``, then :func:`dmt_model` around the built embedding.
Designed for GPUs (devices come from arguments), tested on CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from embedscale.comm.hierarchical import TowerComm
from embedscale.data.batch import JaggedFeatures
from embedscale.models.builder import EmbeddingEnv, build_embedding
from embedscale.embedding.tower_router import PERMUTES
from embedscale.embedding.towers import TowerSetup, tower_forms, tower_groups_of
from embedscale.errors import ConfigError
from embedscale.models.dcn import CrossNet
from embedscale.models.dlrm import DenseArch, InteractionArch, OverArch, _check_dense
from embedscale.plan.tower_placement import SHARDINGS, TowerPlacement
from embedscale.plan.towers import TowerAssignment, naive_assignment
from embedscale.specs import ModelConfig, TableSpec
from embedscale.models.tower_modules import TOWER_MODULES, build_tower_modules, compression_ratio, tower_out_features
from embedscale.models.flat import build_flat

DMT_ARCHS = ("dmt-dlrm", "dmt-dcn")
# the ModelConfig fields that configure DMT only (a plain arch keeps them at their defaults)
TOWER_FIELDS = ("towers", "tower_assignment", "tower_module", "tower_compression", "tower_dim", "tower_c", "tower_p",
                "tower_cross_layers", "tower_cross_low_rank", "hosts_per_tower", "tower_sharding", "tower_permute")


@dataclass
class DMTConfig:
    """The DMT part of a model config (``model.arch: dmt-dlrm | dmt-dcn``).

    Args:
        towers: number of towers T; 0 = one per tower group (one per host when ``hosts_per_tower`` = 1).
        tower_module: ``auto`` (``dlrm`` for dmt-dlrm, ``dcn`` for dmt-dcn), ``dlrm``, ``dcn``, or ``none``
            (pass-through: the tower transform alone, semantics of the flat model).
        compression: CR when ``tower_dim`` is 0: ``D = N / CR`` for the DLRM module with ``c = 1, p = 0``
            (and for the DCN module, whose CR is ``N / D`` too).
        tower_dim: D, the width of tower output vectors; 0 = ``embedding_dim // compression``.
        c, p: DLRM tower module (Listing 1).
        tower_cross_layers, tower_cross_low_rank: DCN tower module's CrossNet (Listing 2).
        hosts_per_tower: K, hosts of one tower group (DMT 3.1.3).
        sharding: ``table`` or ``row`` inside a tower (DMT 3.1.3, section 4).
        permute: ``embeddings``, ``ids`` (steps b and c swapped) or ``auto``.
        assignment: ``naive`` (strided, DMT 5.2.3) or the path of a saved ``TowerAssignment``.
    """

    towers: int = 0
    tower_module: str = "auto"
    compression: int = 4
    tower_dim: int = 0
    c: int = 1
    p: int = 0
    tower_cross_layers: int = 1
    tower_cross_low_rank: int = 0
    hosts_per_tower: int = 1
    sharding: str = "table"
    permute: str = "auto"
    assignment: str = "naive"

    @classmethod
    def from_model(cls, cfg: ModelConfig, check_file: bool = True) -> "DMTConfig":
        """The DMT settings of a run's model config (``model.towers``, ``model.tower_*``,
        ``model.hosts_per_tower``), checked: a bad value is a ``ConfigError`` naming its ``model.`` key
        (``check_file=False``: the assignment comes from elsewhere, its file need not exist here)."""

        def integer(key: str, low: int) -> int:
            v = getattr(cfg, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"model.{key} must be an integer >= {low}, got {v!r}")
            return v

        def choice(key: str, allowed: Sequence[str]) -> str:
            v = getattr(cfg, key)
            if v not in allowed:
                raise ConfigError(f"model.{key} {v!r} is not one of {', '.join(allowed)}")
            return v

        out = cls(towers=integer("towers", 0), tower_module=choice("tower_module", ("auto",) + TOWER_MODULES),
                  compression=integer("tower_compression", 1), tower_dim=integer("tower_dim", 0),
                  c=integer("tower_c", 0), p=integer("tower_p", 0),
                  tower_cross_layers=integer("tower_cross_layers", 0),
                  tower_cross_low_rank=integer("tower_cross_low_rank", 0),
                  hosts_per_tower=integer("hosts_per_tower", 1), sharding=choice("tower_sharding", SHARDINGS),
                  permute=choice("tower_permute", PERMUTES), assignment=cfg.tower_assignment or "naive")
        if out.c == 0 and out.p == 0:
            raise ConfigError("model.tower_c and model.tower_p are both 0: a DLRM tower module would output nothing "
                              "(DMT Listing 1: O = D (c F + p))")
        if check_file and out.assignment != "naive" and not Path(out.assignment).is_file():
            raise ConfigError(f"model.tower_assignment: file not found: {out.assignment} (a JSON file written by "
                              "`embedscale towers`, or 'naive')")
        return out


def is_dmt_arch(arch) -> bool:
    """Whether ``model.arch`` names a DMT model (``dmt-dlrm`` or ``dmt-dcn``)."""
    return isinstance(arch, str) and arch.lower() in DMT_ARCHS


def check_no_tower_settings(cfg: ModelConfig) -> None:
    """A plain arch with a DMT field changed from its default is a ``ConfigError`` (never silently ignored)."""
    default = ModelConfig()
    changed = [k for k in TOWER_FIELDS if getattr(cfg, k, getattr(default, k)) != getattr(default, k)]
    if changed:
        raise ConfigError(f"model.{changed[0]} is set but model.arch is {cfg.arch!r}: the tower settings "
                          f"({', '.join('model.' + k for k in changed)}) apply to dmt-dlrm and dmt-dcn only")


# --------------------------------------------------------------------------------------------------
# models


def _embedding_param_ids(model: nn.Module) -> set[int]:
    emb = getattr(model.sparse_arch, "embedding", None)
    return {id(p) for p in emb.parameters()} if emb is not None else set()


class _DMTBase(nn.Module):
    def tower_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the tower modules: synchronised inside the tower group only (DMT 3.2)."""
        return self.sparse_arch.towers.parameters()

    def global_parameters(self) -> Iterator[nn.Parameter]:
        """Dense parameters synchronised over the world (bottom MLP, interaction, top MLP)."""
        skip = {id(p) for p in self.tower_parameters()} | _embedding_param_ids(self)
        return (p for p in self.parameters() if id(p) not in skip)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter the dense optimizer steps (tower modules included, embeddings excluded)."""
        skip = _embedding_param_ids(self)
        return (p for p in self.parameters() if id(p) not in skip)

    @property
    def compression_ratio(self) -> float:
        """CR of this rank's towers (all towers in a single process)."""
        return compression_ratio(list(self.sparse_arch.towers.values()) if isinstance(self.sparse_arch.towers,
                                                                                     nn.ModuleDict)
                                 else list(self.sparse_arch.towers))


class DMTDLRM(_DMTBase):
    """DMT-DLRM: bottom MLP to D, towers of DLRM tower modules (vectors of width D), dot interaction over
    the dense vector and every tower vector, top MLP (DMT 3.2 "hierarchical feature interaction").

    Args:
        dense_in_features: dense features.
        towers: a ``LocalTowerEmbedding`` or ``TowerEmbedding`` (``embedding.towers``) whose modules emit vectors of
            width ``vector_dim`` (``out_features = num_vectors * vector_dim``).
        vector_dim: D.
        bottom_mlp, top_mlp: hidden widths (the D-wide bottom output and the logit layer are added).
        device: where the dense parameters go.
    """

    def __init__(self, dense_in_features: int, towers: nn.Module, vector_dim: int,
                 bottom_mlp: Sequence[int] = (512, 256, 64), top_mlp: Sequence[int] = (512, 256),
                 device: torch.device | str | None = None):
        super().__init__()
        if towers.out_features % vector_dim:
            raise ConfigError(f"DMT-DLRM: towers emit {towers.out_features} values per sample, not a multiple of "
                              f"the vector width D = {vector_dim}")
        self.sparse_arch = towers
        self.dense_in_features = dense_in_features
        self.vector_dim = vector_dim
        self.num_vectors = towers.out_features // vector_dim
        self.dense_arch = DenseArch(dense_in_features, list(bottom_mlp) + [vector_dim], device=device)
        self.inter_arch = InteractionArch(self.num_vectors, device=device)
        self.over_arch = OverArch(self.inter_arch.output_dim(vector_dim), list(top_mlp), device=device)

    def forward(self, dense: torch.Tensor, sparse: JaggedFeatures) -> torch.Tensor:
        _check_dense(dense, self.dense_in_features, sparse)
        d = self.dense_arch(dense)
        s = self.sparse_arch(sparse).view(-1, self.num_vectors, self.vector_dim)
        return self.over_arch(self.inter_arch(d, s)).squeeze(-1)


class DMTDCN(_DMTBase):
    """DMT-DCN: ``x0 = [bottom MLP (width N), tower outputs]``, CrossNet, deep MLP, logit (DMT 3.2, 4).

    Args:
        dense_in_features: dense features.
        towers: the tower executor (DCN tower modules, Listing 2).
        embedding_dim: N, the bottom MLP's output width.
        bottom_mlp, top_mlp: hidden widths.
        cross_layers, cross_low_rank: the global CrossNet.
        device: where the dense parameters go.
    """

    def __init__(self, dense_in_features: int, towers: nn.Module, embedding_dim: int,
                 bottom_mlp: Sequence[int] = (512, 256, 64), top_mlp: Sequence[int] = (512, 256),
                 cross_layers: int = 3, cross_low_rank: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.sparse_arch = towers
        self.dense_in_features = dense_in_features
        self.dense_arch = DenseArch(dense_in_features, list(bottom_mlp) + [embedding_dim], device=device)
        self.cross_net = CrossNet(embedding_dim + towers.out_features, cross_layers, cross_low_rank, device=device)
        self.over_arch = OverArch(self.cross_net.in_features, list(top_mlp), device=device)

    def forward(self, dense: torch.Tensor, sparse: JaggedFeatures) -> torch.Tensor:
        _check_dense(dense, self.dense_in_features, sparse)
        x0 = torch.cat([self.dense_arch(dense), self.sparse_arch(sparse)], dim=1)
        return self.over_arch(self.cross_net(x0)).squeeze(-1)


# --------------------------------------------------------------------------------------------------
# builders


def resolve_assignment(dmt: DMTConfig, features: Sequence[str], default_towers: int,
                       assignment: TowerAssignment | None = None) -> TowerAssignment:
    """The towers: ``assignment`` if given, else ``dmt.assignment`` (``naive`` or a file of ``embedscale
    towers``). The number of towers is ``dmt.towers`` when set, else the assignment's (given or file), else
    ``default_towers`` (one per tower group); a mismatch, or towers that do not hold exactly the model's
    features, is a ``ConfigError`` naming the file."""
    source = "the tower assignment"
    if assignment is None and dmt.assignment not in ("", "naive"):
        assignment = TowerAssignment.load(dmt.assignment)
        source = f"tower assignment {dmt.assignment}"
    if assignment is None:
        assignment = naive_assignment(list(features), dmt.towers or default_towers)
    try:
        assignment.check_covers(list(features))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    if dmt.towers and assignment.num_towers != dmt.towers:
        raise ConfigError(f"{source} has {assignment.num_towers} towers, model.towers asks for {dmt.towers}")
    return assignment


@dataclass
class DMTTowers:
    """A DMT model's resolved towers (:func:`resolve_towers`): what the model around them needs, and the
    :class:`~embedscale.embedding.towers.TowerSetup` ``build_embedding`` builds the tower embedding from.

    Args:
        arch: ``dmt-dlrm`` or ``dmt-dcn``.
        kind: the tower module (``dlrm``, ``dcn`` or ``none``: pass-through, the plain model over SPTT).
        vector_dim: D, the width of the tower output vectors (DLRM tower modules).
        setup: assignment, this rank's tower modules, every tower's width, ``TowerComm``, sharding, permute.
    """

    arch: str
    kind: str
    vector_dim: int
    setup: TowerSetup


def resolve_towers(cfg: ModelConfig, tables: list[TableSpec], dmt: DMTConfig | None = None, *,
                   arch: str | None = None, assignment: TowerAssignment | None = None, comm: TowerComm | None = None,
                   num_hosts: int = 1, seed: int = 0, device: torch.device | str | None = None) -> DMTTowers:
    """Check a DMT model's settings, resolve its towers and build this rank's tower modules (the arguments of
    :func:`build_dmt_model`); a bad setting is a ``ConfigError`` naming its ``model.`` key. Tower ``t``'s module
    is created under seed ``(seed, t)`` whatever rank builds it (``models.tower_modules``)."""
    dmt = dmt or DMTConfig()
    arch = (arch or cfg.arch).lower()
    if arch in ("dlrm", "dcn"):
        arch = "dmt-" + arch
    if arch not in DMT_ARCHS:
        raise ConfigError(f"model.arch: {arch!r} is not a DMT architecture ({', '.join(DMT_ARCHS)})")
    if not tables:
        raise ConfigError("build_dmt_model: no tables")
    N = cfg.embedding_dim
    for t in tables:
        if t.dim != N:
            raise ConfigError(f"table {t.name!r}: dim {t.dim} differs from model.embedding_dim {N}; DMT towers "
                              "need one shared embedding dim")
    kind = dmt.tower_module
    if kind == "auto":
        kind = "dlrm" if arch == "dmt-dlrm" else "dcn"
    if kind not in TOWER_MODULES:
        raise ConfigError(f"model.tower_module {dmt.tower_module!r} is not auto or one of {TOWER_MODULES}")
    if arch == "dmt-dlrm" and kind == "dcn":
        raise ConfigError("model.tower_module dcn: dmt-dlrm needs DLRM tower modules (vectors for the dot "
                          "interaction); use dlrm or none")
    D = dmt.tower_dim
    if kind != "none" and D <= 0:
        if isinstance(dmt.compression, bool) or dmt.compression <= 0 or N % int(dmt.compression):
            raise ConfigError(f"model.tower_compression {dmt.compression!r} must divide model.embedding_dim {N} "
                              "(or set model.tower_dim)")
        D = N // int(dmt.compression)
    features = [f for t in tables for f in t.features]
    if comm is not None:
        layout = comm.layout
        if layout.hosts_per_tower != dmt.hosts_per_tower:
            raise ConfigError(f"model.hosts_per_tower {dmt.hosts_per_tower} differs from the TowerComm layout's "
                              f"{layout.hosts_per_tower}")
        default_towers = layout.num_groups
    else:
        if num_hosts % dmt.hosts_per_tower:
            raise ConfigError(f"{num_hosts} hosts (dist.topology_hosts) cannot form towers of model.hosts_per_tower = "
                              f"{dmt.hosts_per_tower} hosts")
        default_towers = num_hosts // dmt.hosts_per_tower
    assignment = resolve_assignment(dmt, features, default_towers, assignment)
    T = assignment.num_towers
    sizes = assignment.sizes
    if comm is not None:
        groups = tower_groups_of(T, comm.layout.num_groups)
        keep = [t for t in range(T) if groups[t] == comm.layout.group_of(comm.rank)]
    else:
        keep = list(range(T))
    # a rank builds its own towers' modules, and knows every tower's width (the peer all_to_all needs them)
    modules = build_tower_modules(kind, sizes, N, out_dim=D, c=dmt.c, p=dmt.p, cross_layers=dmt.tower_cross_layers,
                                  low_rank=dmt.tower_cross_low_rank, seed=seed, towers=keep, device=device)
    outs = [tower_out_features(kind, F, N, D, dmt.c, dmt.p) for F in sizes]
    setup = TowerSetup(assignment, modules, outs, comm=comm, sharding=dmt.sharding, permute=dmt.permute,
                       model_order=(kind == "none"))
    return DMTTowers(arch, kind, D, setup)


def dmt_model(cfg: ModelConfig, tables: list[TableSpec], num_dense: int, towers: DMTTowers, embedding: nn.Module, *,
              seed: int = 0, device: torch.device | str | None = None) -> nn.Module:
    """The DMT model around a built tower ``embedding`` (``build_embedding`` with ``EmbeddingEnv.towers =
    towers.setup``): ``DMTDLRM`` / ``DMTDCN``, or with pass-through towers the plain ``DLRM`` / ``DCN``. The
    dense arches are initialised under ``seed`` (the same on every rank and in one process)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if towers.kind == "none":
            return _with_split(build_flat(_plain_config(cfg, towers.arch[4:]), tables, num_dense, embedding=embedding,
                                          device=device))
        if towers.arch == "dmt-dlrm":
            return DMTDLRM(num_dense, embedding, towers.vector_dim, cfg.bottom_mlp, cfg.top_mlp, device=device)
        return DMTDCN(num_dense, embedding, cfg.embedding_dim, cfg.bottom_mlp, cfg.top_mlp,
                      cross_layers=cfg.cross_layers, cross_low_rank=cfg.cross_low_rank, device=device)


def build_dmt_model(cfg: ModelConfig, tables: list[TableSpec], num_dense: int, dmt: DMTConfig | None = None, *,
                    arch: str | None = None, assignment: TowerAssignment | None = None, comm: TowerComm | None = None,
                    num_hosts: int = 1, optimizer: str = "rowwise_adagrad", lr: float = 0.05, seed: int = 0,
                    device: torch.device | str | None = None) -> nn.Module:
    """Build ``dmt-dlrm`` or ``dmt-dcn`` (single process without ``comm``, one rank's part with it):
    :func:`resolve_towers`, the tower embedding from ``models.builder.build_embedding`` (the one embedding
    builder), :func:`dmt_model` around it.

    Args:
        cfg: the model config (embedding dim N, MLPs, DCN cross layers); ``cfg.arch`` may be ``dmt-dlrm``,
            ``dmt-dcn``, ``dlrm`` or ``dcn`` unless ``arch`` says which.
        tables: the tables (one shared dim, ``cfg.embedding_dim``).
        num_dense: dense features.
        dmt: the DMT settings (default ``DMTConfig()``).
        assignment: features per tower (default from ``dmt.assignment``).
        comm: this rank's ``TowerComm``: build the distributed model (tower transform); ``None``: all
            towers in this process.
        num_hosts: single process only: hosts the default tower count counts (``towers: 0``).
        optimizer, lr: the fused sparse optimizer of the tables.
        seed: the initialisation of tables (placement-independent), tower modules (per tower) and dense
            arches; the same seed gives the same model in one process and on any number of ranks.
        device: where everything lives.

    Returns:
        ``DMTDLRM`` / ``DMTDCN``; with ``tower_module: none`` the plain ``DLRM`` / ``DCN`` over the tower
        transform (SPTT only). ``model.tower_parameters()`` and ``model.global_parameters()`` split the
        dense parameters for :func:`sync_dense_gradients`.

    Example::

        >>> from embedscale.specs import ModelConfig, TableSpec
        >>> tables = [TableSpec(f"C{i}", 50, dim=8) for i in range(6)]
        >>> cfg = ModelConfig(embedding_dim=8, bottom_mlp=[16], top_mlp=[16])
        >>> model = build_dmt_model(cfg, tables, 4, DMTConfig(towers=2, compression=2), arch="dmt-dlrm")
        >>> model.num_vectors, model.compression_ratio
        (6, 2.0)
    """
    towers = resolve_towers(cfg, tables, dmt, arch=arch, assignment=assignment, comm=comm, num_hosts=num_hosts,
                            seed=seed, device=device)
    embedding = build_embedding(tables, None, EmbeddingEnv(device=device, optimizer=optimizer, lr=lr, seed=seed,
                                                           towers=towers.setup),
                                forms=tower_forms(tables, towers.setup.assignment))
    return dmt_model(cfg, tables, num_dense, towers, embedding, seed=seed, device=device)


def _plain_config(cfg: ModelConfig, arch: str) -> ModelConfig:
    """``cfg`` as the plain ``arch`` (dlrm/dcn): same sizes, tower settings back at their defaults."""
    default = ModelConfig()
    out = copy.copy(cfg)
    out.arch = arch
    for k in TOWER_FIELDS:
        setattr(out, k, getattr(default, k))
    return out


def _with_split(model: nn.Module) -> nn.Module:
    """Plain DLRM/DCN: every dense parameter is global, there are no tower parameters."""
    model.tower_parameters = lambda: iter(())  # type: ignore[attr-defined]
    model.global_parameters = model.dense_parameters  # type: ignore[attr-defined]
    return model


def build_flat_model(cfg: ModelConfig, tables: list[TableSpec], num_dense: int, comm: TowerComm, *,
                     placement: TowerPlacement | None = None, optimizer: str = "rowwise_adagrad", lr: float = 0.05,
                     seed: int = 0, device: torch.device | str | None = None) -> nn.Module:
    """The baseline: plain ``cfg.arch`` (dlrm/dcn) over the classic table-wise model parallelism
    (:class:`~embedscale.embedding.towers.FlatTableWiseEmbedding`, DMT 2.2, built by ``build_embedding``),
    initialised as :func:`build_dmt_model` with the same seed."""
    arch = cfg.arch.lower().removeprefix("dmt-")
    emb = build_embedding(tables, None, EmbeddingEnv(device=device, optimizer=optimizer, lr=lr, seed=seed,
                                                     towers=TowerSetup(comm=comm, flat=True, placement=placement)),
                          forms=tower_forms(tables, None))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _with_split(build_flat(_plain_config(cfg, arch), tables, num_dense, embedding=emb, device=device))


# --------------------------------------------------------------------------------------------------
# training helpers


def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor | None:
    if not params:
        return None
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _unflat_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    start = 0
    for p in params:
        n = p.numel()
        g = flat[start:start + n].view_as(p)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        start += n


def sync_dense_gradients(model: nn.Module, comm: TowerComm) -> None:
    """Sum dense gradients: tower modules over the tower group only, the rest over the world (DMT 3.2).

    Call after ``loss.backward()`` with a loss that is the sum over the local samples divided by the
    global batch size: the summed gradients are then the global-batch mean gradient.
    """
    tower = [p for p in model.tower_parameters() if p.requires_grad]
    glob = [p for p in model.global_parameters() if p.requires_grad]
    for params, transport, group, kind in ((glob, comm.world, comm.world_group, "dense_grads"),
                                           (tower, comm.tower, comm.tower_group, "tower_grads")):
        flat = _flat_grads(params)
        if flat is None:
            continue
        transport.allreduce_sum_(flat, group, kind)
        _unflat_grads(params, flat)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, dense: torch.Tensor, sparse: JaggedFeatures,
               labels: torch.Tensor, global_batch_size: int, comm: TowerComm | None = None) -> tuple[float, torch.Tensor]:
    """One step: logits, ``BCE sum / global batch``, backward (embedding rows update in place), dense
    gradient sync (when ``comm``), dense optimizer step. Returns ``(local loss sum / global batch, logits)``."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(dense, sparse)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_batch_size
    loss.backward()
    if comm is not None:
        sync_dense_gradients(model, comm)
    optimizer.step()
    return float(loss.detach()), logits.detach()


def training_flops_per_sample(model: nn.Module, dense: torch.Tensor, sparse: JaggedFeatures) -> dict:
    """Forward and forward+backward FLOPs per sample of the dense compute (matrix products: linear layers,
    tower modules, interactions), counted by ``torch.utils.flop_counter`` on a copy of ``model`` (the
    embedding lookups are memory-bound and not counted, as in DMT Table 4's profiler figures)."""
    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(model)
    B = dense.shape[0]
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            m(dense, sparse)
    with FlopCounterMode(display=False) as both:
        m(dense, sparse).sum().backward()
    return {"forward": fwd.get_total_flops() / B, "train": both.get_total_flops() / B}
