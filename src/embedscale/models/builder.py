"""The one constructor of a model's embedding: ``build_embedding(tables, plan, env, forms=...) -> nn.Module``.

Every table's form is decided in the plan (``embedscale.plan.forms``: ``sharded``, ``tt``, ``host``) and
arrives beside the tables as ``forms``, ``{table: TableForm}`` (``Plan.forms`` with a plan, ``decide_forms`` in
a world of one); the ``TableSpec`` s hold only facts. What is built:

* world of one (``plan`` is ``None``): the sharded tables in one :class:`~embedscale.embedding.local.LocalEmbeddingBags`
  (the fast path when nothing is sharded across ranks);
* ``N`` ranks: the sharded tables in a :class:`~embedscale.embedding.sharded.ShardedEmbedding` (or
  :class:`~embedscale.embedding.pgas_lookup.PgasShardedEmbedding` on the PGAS transport) executing the plan's
  row placement (OPER section 4, through ``env.address_map``);
* TT tables (EL-Rec section III): a :class:`~embedscale.embedding.mixed.MixedEmbedding` around the above, its
  TT tables replicas whose core gradients are summed over the ranks before the fused update (EL-Rec VI-B,
  ``compression.replica_grad_sync`` on a process group of their own, made by ``env.new_group``); the TT
  tables whose form says ``reorder`` rename their ids by ``env.reordering`` (EL-Rec IV, the plan's);
* host tables (EL-Rec section V): a :class:`~embedscale.pipeline.PipelinedEmbedding` with the above as its
  device module and the host tables in a :class:`~embedscale.pipeline.HostParameterServer` (one per rank,
  or one per machine with ``env.pipeline_server == "shared"``);
* DMT towers (``env.towers``, a :class:`~embedscale.embedding.towers.TowerSetup`, or tables of form
  ``tower``; :func:`build_tower_embedding`), from :mod:`embedscale.embedding.towers`: all towers in one
  process (``LocalTowerEmbedding``), one rank's share of the tower transform (``TowerEmbedding``, DMT 3.1)
  or the table-wise baseline (``FlatTableWiseEmbedding``, DMT 2.2); ``models.dmt`` resolves the towers and
  builds their modules.

Every part is initialised by ``workflow.hash_init`` with the table's index among all tables, so the same
table starts with the same rows whatever its form or placement (single process == N ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn as nn

from embedscale.embedding.compression import replica_grad_sync
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.mixed import MixedEmbedding
from embedscale.embedding.pgas_lookup import PgasShardedEmbedding
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.embedding.towers import FlatTableWiseEmbedding, LocalTowerEmbedding, TowerEmbedding, TowerSetup
from embedscale.errors import ConfigError
from embedscale.pipeline import HostParameterServer, PipelinedEmbedding
from embedscale.plan.forms import TableForm
from embedscale.specs import TableSpec


@dataclass
class EmbeddingEnv:
    """Where and how the embedding is built (everything but the tables and the plan).

    Args:
        device: where the rows live (from the run's config, ``train.device``).
        optimizer: the fused sparse optimizer (``sgd``, ``rowwise_adagrad``; ``train.sparse_optimizer``).
        inference: no update: the sharded and TT parts get no optimizer (the host server keeps its own).
        lr: its learning rate (``train.lr_sparse``); ``tt_lr`` the TT cores' (``workflow.tt_lr``).
        seed: ``train.seed`` (row initialisation).
        rank, world_size: this rank and the world (1: single process).
        design, grad_sync: ``dist.design`` and ``dist.grad_sync`` of the sharded embedding.
        transport, address_map, sync_group: N ranks: the transport the sharded embedding talks through,
            the plan's address map (``address_map_from_plan``) and the process group of its gradient sync.
        pgas: use ``PgasShardedEmbedding`` (``dist.transport: pgas``) with ``max_batch_size`` ids per rank and
            heap room for ``storage_spare`` (a fraction) more storage rows than the plan needs (a live re-plan
            migrates in place within it, ``embedding.migrate``).
        validate: the embedding checks the batch's ids itself (``False`` when the ``ShardLoader`` did: the
            sharded embedding, and in one process the local/mixed tables; host tables' server checks its own).
        new_group: N ranks: makes a new process group (the TT core gradients', the host rows' exchange).
        new_share_group: makes the process group of this machine's ranks that share one host server
            (``train.pipeline_server: shared``); ``None``: a server per rank.
        timeout_s: ``dist.timeout_s``.
        stats: counters the parts add to (``tt_grad_sync_bytes``).
        towers: DMT: the towers to build (:class:`~embedscale.embedding.towers.TowerSetup`: assignment, tower
            modules, ``TowerComm``, sharding, permute, or the flat baseline); ``None``: no towers.
        reordering: the index reordering (EL-Rec IV, a :class:`~embedscale.reorder.Reordering`) of the TT tables
            whose form says ``reorder`` (the plan's, ``reorder.plan_reordering``); it must cover exactly those.
    """

    device: torch.device
    optimizer: str = "rowwise_adagrad"
    inference: bool = False
    lr: float = 0.05
    tt_lr: float = 0.05
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    design: str = "retrieve"
    grad_sync: str = "local_aggregated"
    transport: Any = None
    address_map: Any = None
    sync_group: Any = None
    pgas: bool = False
    max_batch_size: int = 0
    storage_spare: float = 0.0
    validate: bool = True
    new_group: Callable[[], Any] | None = None
    new_share_group: Callable[[], Any] | None = None
    timeout_s: float = 300.0
    stats: dict = field(default_factory=dict)
    towers: TowerSetup | None = None
    reordering: Any = None


def hash_init(seed: int, tables: list[TableSpec]):
    """``LocalEmbeddingBags`` init callable giving every row its placement-independent initial value
    (``embedding.init.uniform_rows`` of the table's index in ``tables``), so single-process and sharded runs
    start from the same model."""
    index = {t.name: i for i, t in enumerate(tables)}

    def init(spec: TableSpec, weight: torch.Tensor) -> None:
        rows = uniform_rows(seed, index[spec.name], np.arange(spec.num_rows), spec.dim, spec.num_rows)
        weight.copy_(torch.from_numpy(rows))

    return init


def build_embedding(tables: list[TableSpec], plan, env: EmbeddingEnv, *, forms: Mapping[str, TableForm]) -> nn.Module:
    """The model's embedding over ``tables`` in their ``forms`` (every table's, see the module docstring) for
    ``plan`` (``None``: a world of one) in ``env``. Bit-identical to the constructors it replaces (same seeds,
    same order)."""
    missing = [t.name for t in tables if t.name not in forms]
    if missing:
        raise ConfigError(f"build_embedding: tables {missing} have no form (forms for {sorted(forms)})")
    if env.towers is not None or any(forms[t.name].kind == "tower" for t in tables):
        return build_tower_embedding(tables, plan, env, forms=forms)
    host = [t for t in tables if forms[t.name].kind == "host"]
    rest = [t for t in tables if forms[t.name].kind != "host"]
    tt = {t.name: forms[t.name].tt_rank for t in rest if forms[t.name].kind == "tt"}
    hot = {n: forms[n].hot_rows for n in tt if forms[n].hot_rows}  # row groups: exact hot rows (embedding.hybrid)
    has_tt = bool(tt)
    _check_reordering(env.reordering, forms)
    init = hash_init(env.seed, tables)
    if plan is None:
        if env.world_size != 1:
            raise ConfigError(f"build_embedding: {env.world_size} ranks need a plan")
        if host:
            device_modules = None
            if has_tt:  # TT tables beside the host ones (EL-Rec III with V)
                device_modules = [MixedEmbedding(rest, tt=tt, device=env.device, optimizer=env.optimizer, lr=env.lr,
                                                 init=init, seed=env.seed, tt_lr=env.tt_lr,
                                                 init_index=[tables.index(x) for x in rest], validate=env.validate,
                                                 reordering=env.reordering, hot_rows=hot)]
            return PipelinedEmbedding.from_tables(tables, forms, device=env.device, optimizer=env.optimizer, lr=env.lr,
                                                  seed=env.seed, init=init, device_modules=device_modules,
                                                  validate=env.validate)
        if has_tt:
            return MixedEmbedding(tables, tt=tt, device=env.device, optimizer=env.optimizer, lr=env.lr, init=init,
                                  seed=env.seed, tt_lr=env.tt_lr, validate=env.validate, reordering=env.reordering,
                                  hot_rows=hot)
        return LocalEmbeddingBags(tables, device=env.device, optimizer=env.optimizer, lr=env.lr, init=init,
                                  validate=env.validate)
    return _distributed(tables, host, rest, tt, plan, env, hot)


def _distributed(tables, host, rest, tt, plan, env: EmbeddingEnv, hot) -> nn.Module:
    has_tt = bool(tt)
    sharded_tables = [t for t in rest if t.name not in tt]
    if plan.world_size != env.world_size:
        raise ConfigError(f"build_embedding: the plan is for {plan.world_size} ranks, this run has {env.world_size}")
    if env.transport is None or env.address_map is None:
        raise ConfigError("build_embedding: several ranks need env.transport and env.address_map")
    opt = None if env.inference else env.optimizer
    module: nn.Module = build_sharded(tables, sharded_tables, env)
    init = hash_init(env.seed, tables)
    if has_tt:  # TT replicas beside the sharded tables, their core gradients summed over the ranks (EL-Rec VI-B)
        sync = None if env.inference else replica_grad_sync(_group(env), env.stats)
        module = MixedEmbedding(rest, tt=tt, local=module, device=env.device, optimizer=opt, lr=env.lr,
                                init=init, seed=env.seed, grad_sync=sync, init_index=[tables.index(x) for x in rest],
                                tt_lr=env.tt_lr, validate=env.validate, reordering=env.reordering, hot_rows=hot)
    if host:  # host rows in a parameter server, data parallel: every rank applies every update (EL-Rec V)
        if env.optimizer not in ("sgd", "rowwise_adagrad"):
            raise ConfigError(f"host tables need a fused sparse optimizer (sgd, rowwise_adagrad), got {env.optimizer!r}")
        share = env.new_share_group() if env.new_share_group is not None else None
        server = HostParameterServer(host, optimizer=env.optimizer, lr=env.lr, init=init, share_group=share,
                                     timeout_s=env.timeout_s, validate=env.validate)
        module = PipelinedEmbedding(tables, server, [module], device=env.device, process_group=_group(env))
    return module


def build_sharded(tables: list[TableSpec], sharded_tables: list[TableSpec], env: EmbeddingEnv) -> ShardedEmbedding:
    """The sharded rows of ``sharded_tables`` (a subset of ``tables``, whose indices seed their rows) placed by
    ``env.address_map``: a ``ShardedEmbedding``, or a ``PgasShardedEmbedding`` with ``env.pgas``. The part of
    ``build_embedding`` a live re-plan rebuilds for the new plan's map (``embedding.migrate``)."""
    opt = None if env.inference else env.optimizer
    cls, extra = ShardedEmbedding, {}
    if env.pgas:
        cls, extra = PgasShardedEmbedding, {"max_batch_size": env.max_batch_size, "storage_spare": env.storage_spare}
    return cls(sharded_tables, env.address_map, env.transport, env.rank, design=env.design,
               optimizer=opt, lr=env.lr, grad_sync=env.grad_sync, **extra, validate=env.validate,
               sync_group=env.sync_group, seed=env.seed, device=env.device,
               init_index=[tables.index(tb) for tb in sharded_tables])


def build_tower_embedding(tables: list[TableSpec], plan, env: EmbeddingEnv, *,
                          forms: Mapping[str, TableForm]) -> nn.Module:
    """The DMT tower embedding of ``tables`` (``build_embedding``'s tower branch; DMT Luo et al., MLSys 2024).

    ``env.towers`` says what to build (:class:`~embedscale.embedding.towers.TowerSetup`): without a ``comm``
    every tower in this process (a :class:`~embedscale.embedding.towers.LocalTowerEmbedding`, or with
    ``model_order`` its fused lookup alone: the plain model's embedding), with one this rank's share of the
    tower transform (:class:`~embedscale.embedding.towers.TowerEmbedding`, DMT 3.1), with ``flat`` the
    table-wise baseline (:class:`~embedscale.embedding.towers.FlatTableWiseEmbedding`, DMT 2.2). The towers
    place their own rows (``plan`` must be ``None``); their tables are device tables of one dim (form
    ``sharded`` or ``tower``; TT and host tables are a ``ConfigError``). The rows start from the
    placement-independent :func:`hash_init` values whatever rank holds them, so one process and any number of
    ranks build the same tables. The tables always get the fused optimizer ``env.optimizer`` (an inference run
    restores them and never steps).
    """
    setup = env.towers
    if setup is None:
        named = [t.name for t in tables if forms[t.name].kind == "tower"]
        raise ConfigError(f"build_embedding: tables {named} are DMT tower tables; env.towers must say the towers "
                          "(assignment, tower modules)")
    if plan is not None:
        raise ConfigError("build_embedding: DMT towers place their own rows (tower assignment and layout); "
                          "pass plan=None")
    if not tables:
        raise ConfigError("build_embedding: DMT towers need at least one table")
    for t in tables:
        if forms[t.name].kind not in ("sharded", "tower"):
            raise ConfigError(f"table {t.name!r}: form {forms[t.name].kind!r}; DMT towers hold device tables only "
                              "(no TT or host tables)")
    if setup.flat:
        return FlatTableWiseEmbedding(tables, setup.comm, setup.placement, optimizer=env.optimizer, lr=env.lr,
                                      seed=env.seed, device=env.device)
    if setup.comm is None:
        local = LocalTowerEmbedding(tables, setup.assignment, setup.modules, init=hash_init(env.seed, tables),
                                    optimizer=env.optimizer, lr=env.lr, device=env.device)
        return local.embedding if setup.model_order else local
    return TowerEmbedding(tables, setup.assignment, setup.modules, setup.comm, setup.tower_out_features,
                          sharding=setup.sharding, permute=setup.permute, optimizer=env.optimizer, lr=env.lr,
                          seed=env.seed, device=env.device, model_order=setup.model_order)


def _check_reordering(reordering, forms: Mapping[str, TableForm]) -> None:
    """The reordering covers exactly the TT tables whose form says ``reorder`` (EL-Rec IV)."""
    want = sorted(n for n, f in forms.items() if f.reorder)
    have = sorted(reordering.tables) if reordering is not None else []
    if want != have:
        raise ConfigError(f"build_embedding: the TT tables {want} carry an index reordering (their forms), the "
                          f"reordering given covers {have}")


def _group(env: EmbeddingEnv):
    if env.new_group is None:
        raise ConfigError("build_embedding: TT or host tables on several ranks need env.new_group")
    return env.new_group()


def embedding_parts(module: nn.Module) -> tuple[nn.Module, MixedEmbedding | None, PipelinedEmbedding | None]:
    """``(rows, tt, host)`` of a built embedding: the module holding the sharded (or local) rows, the
    ``MixedEmbedding`` of the TT tables (``None`` without), the ``PipelinedEmbedding`` (``None`` without)."""
    host = module if isinstance(module, PipelinedEmbedding) else None
    device = host.device_modules[0] if host is not None and len(host.device_modules) else module
    tt = device if isinstance(device, MixedEmbedding) else None
    rows = tt.local if tt is not None else device
    return rows, tt, host
