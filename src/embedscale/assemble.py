"""Assembly: from a run config to what a run holds, below the run loop and above the executors.

data (``prepare_data``: synthetic, raw logs converted once, or shards; the train/eval split) -> tables
(``tables_for``: the facts, as configured or one per sparse feature; their forms, ``{table: TableForm}``, are
the plan's or, in a world of one, the config's requests decided by ``plan.forms.config_forms``) -> access
profile (``profile``) -> model (``build``: the one embedding builder ``models.builder.build_embedding`` plus
the dense arches) and its dense optimizer. Nothing here starts ranks,
loops or writes a run's results: the run loop and the launcher (``embedscale.train``) and the orchestration
(``embedscale.workflow``) sit above this module and call it (ARCHITECTURE.md, layers).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.hierarchical import TowerComm
from embedscale.comm.pgas import PgasTransport, slot_bytes_for
from embedscale.data import avazu, criteo, tabular
from embedscale.data.loader import ShardLoader
from embedscale.data.schema import Schema
from embedscale.data.profile import AccessProfile
from embedscale.data.shards import MANIFEST, Manifest, read_shard
from embedscale.data.stream import StreamLoader, complete_shards, read_stream_schema
from embedscale.data.synthetic import GENERATOR_VERSION, generate_dataset
from embedscale.device import on_host
from embedscale.embedding.address_map import address_map_from_plan
from embedscale.errors import ConfigError, FormatError
from embedscale.models.builder import (EmbeddingEnv, build_embedding, embedding_parts,  # noqa: F401
                                        hash_init)  # hash_init: re-exported
from embedscale.embedding.managed_lookup import ManagedLookup, install
from embedscale.units import human_bytes
from embedscale.pipeline.shared import local_group
from embedscale.plan.forms import (TableForm, check_plan_sizes, config_forms, default_tables, forms_for_run,
                                   reordered_tables, table_bytes)
from embedscale.plan.plan import Plan
from embedscale.specs import (ManagedConfig, RunConfig, TableConfig, TableSpec, auto_batch_size, feature_to_table,
                              auto_sparse_weight_decay, managed_tables, to_dict)
from embedscale.embedding.optim import set_weight_decay
from embedscale.models import build_model
from embedscale.models.dlrm import set_dropout
from embedscale.models.dmt import is_dmt_arch
from embedscale.reorder import plan_reordering, reorder_for_plan


@dataclass
class Split:
    """A row range ``[start, stop)`` of a shard directory."""

    directory: Path
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass
class PreparedData:
    train: Split
    eval: Split | None
    manifest: Manifest
    teacher_auc: float = math.nan
    test: Split | None = None  # a test split given as files or a dataset's test/ (``evaluate --split test``)
    stream: bool = False  # train is a stream directory (data.stream; ``manifest`` is its schema, no rows known)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _file_identity(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path: file not found: {p}")
    st = p.stat()
    return {"path": str(p.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}


def prepare_data(cfg: RunConfig, cache_root: str | Path | None = None, progress: bool = True) -> PreparedData:
    """:func:`_prepare_data`, and ``train.batch_size: 0`` and ``train.sparse_weight_decay < 0`` resolved from the
    training rows (``specs.auto_batch_size``, ``specs.auto_sparse_weight_decay``; in ``cfg``, so the run trains
    with them)."""
    data = _prepare_data(cfg, cache_root, progress)
    t, rows = cfg.train, 0 if data.stream else data.train.stop - data.train.start
    if t.batch_size == 0:
        t.batch_size = auto_batch_size(rows)
    if t.sparse_weight_decay < 0:
        t.sparse_weight_decay = auto_sparse_weight_decay(rows, t.epochs, t.epoch_samples, data.eval is not None,
                                                         t.max_steps, t.batch_size)
    return data


def _prepare_data(cfg: RunConfig, cache_root: str | Path | None = None, progress: bool = True) -> PreparedData:
    """Make (or reuse from the cache) the shard directories the run reads, and its train/eval split.

    ``synthetic`` generates train samples ``[0, N)`` and eval samples ``[N, N+M)`` of one seeded stream;
    raw ``criteo``/``avazu`` files or any ``table`` described by ``data.schema`` are converted once (with
    ``data.eval_path``/``data.test_path`` as separate splits encoded with the training vocabulary);
    ``shards`` reads an existing directory. The splits: ``split_existing``. ``stream`` follows a directory
    as shards arrive (``data.stream``): its schema is the manifest, ``data.eval_path`` an optional eval
    dataset (a shard directory).
    """
    d = cfg.data
    cache_root = Path(cache_root or Path(cfg.out_dir) / "data-cache")
    if d.source == "synthetic":
        key = _fingerprint({"v": GENERATOR_VERSION, "synthetic": to_dict(d.synthetic), "seed": d.seed, "train": d.train_samples,
                            "eval": d.eval_samples})
        base = cache_root / f"synthetic-{d.synthetic.preset}-{key}"
        dirs = {}
        for name, first, n in (("train", 0, d.train_samples), ("eval", d.train_samples, d.eval_samples)):
            out = base / name
            if n <= 0:
                continue
            if not (out / MANIFEST).exists():
                _log(f"generating {n:,} synthetic {d.synthetic.preset} {name} samples into {out}")
                generate_dataset(d.synthetic, out, n, seed=d.seed, first_sample=first, shard_rows=d.shard_rows,
                                 progress=progress)
            dirs[name] = out
        m = Manifest.load(dirs["train"])
        ev = Manifest.load(dirs["eval"]) if "eval" in dirs else None
        return PreparedData(Split(dirs["train"], 0, m.rows), Split(dirs["eval"], 0, ev.rows) if ev else None, m,
                            float(ev.extra.get("teacher_auc", math.nan)) if ev else math.nan)
    if d.source in ("criteo", "avazu", "table"):
        train, ev, test = _files(d.path), _files(d.eval_path), _files(d.test_path)
        if not train:
            raise ConfigError(f"data.source is {d.source!r} but data.path names no file")
        if d.source == "table":
            if not d.schema:
                raise ConfigError("data.source is 'table' but data.schema (the schema YAML) is empty")
            schema = Schema.load(d.schema)
        else:
            schema = (criteo if d.source == "criteo" else avazu).schema()
        key = _fingerprint({"v": 2, "src": d.source, "schema": schema.to_dict(),
                            "files": [[_file_identity(p) for p in fs] for fs in (train, ev, test)],
                            "cat": d.categorical, "rows": d.table_rows, "lf": d.load_factor, "cap": d.max_table_rows,
                            "minf": d.min_frequency, "skip": d.skip_malformed})
        out = cache_root / f"{d.source}-{key}"
        if not (out / MANIFEST).exists():
            _log(f"converting {', '.join(train + ev + test)} ({d.source}) into {out}")
            tabular.convert(schema, {"train": train, "eval": ev, "test": test}, out, categorical=d.categorical,
                            table_rows=d.table_rows, min_frequency=d.min_frequency, load_factor=d.load_factor,
                            max_table_rows=d.max_table_rows, shard_rows=d.shard_rows,
                            skip_malformed=d.skip_malformed, progress=progress)
        return split_existing(out, d.eval_fraction)
    if d.source == "stream":
        schema = read_stream_schema(d.path)
        ev = None
        if d.eval_path:
            em = Manifest.load(d.eval_path)
            if em.sparse_names != schema.sparse_names or em.num_dense != schema.num_dense:
                raise ConfigError(f"data.eval_path: {d.eval_path} has other features than the stream {d.path}")
            ev = Split(Path(d.eval_path), 0, em.rows)
        return PreparedData(Split(Path(d.path), 0, 0), ev, schema, stream=True)
    if d.source == "shards":
        if not d.path:
            raise ConfigError("data.source is 'shards' but data.path is empty")
        return split_existing(Path(d.path), d.eval_fraction)
    raise ConfigError(f"data.source {d.source!r} is not one of synthetic, criteo, avazu, table, shards, stream")


def managed_for(cfg: RunConfig, tables: list[TableSpec], forms: dict[str, TableForm] | None = None
                ) -> dict[str, ManagedConfig]:
    """The run's managed tables (``specs.managed_tables``: ``model.managed``, a table's ``managed``) and their
    settings; a ``ConfigError`` for what cannot be managed yet: a TT or host table (``forms``: the run's, else
    the config's), DMT towers."""
    managed = managed_tables(cfg.model, tables)
    if not managed:
        return managed
    if is_dmt_arch(cfg.model.arch):
        raise ConfigError(f"managed tables {sorted(managed)}: model.arch {cfg.model.arch!r} (DMT towers) does not map "
                          "managed ids yet; use dlrm or dcn")
    forms = forms if forms is not None else config_forms(cfg.model, tables)
    for name in managed:
        if forms[name].kind not in ("sharded",):
            raise ConfigError(f"table {name!r}: managed tables must be plain device rows, not form "
                              f"{forms[name].kind!r} (compression/placement, model.tt_min_rows/host_min_rows)")
    return managed


def raw_id_features(cfg: RunConfig, tables: list[TableSpec]) -> frozenset[str]:
    """The features whose values are raw 64-bit ids: those of the managed tables (the loaders do not check them
    against the table's rows; the run maps them, ``embedding.managed_lookup``). What cannot be managed is a
    ``ConfigError`` here already (:func:`managed_for`), before a loader or a profile reads the data."""
    managed = managed_for(cfg, tables)
    return frozenset(f for t in tables if t.name in managed for f in t.features)


def install_managed(cfg: RunConfig, tables: list[TableSpec], embedding, forms: dict[str, TableForm] | None = None,
                    group=None) -> ManagedLookup | None:
    """Map the managed tables' raw ids before every lookup of ``embedding`` (the model's embedding module, as
    ``build_embedding`` made it): a ``ManagedLookup`` on its rows module (``group``: N ranks)."""
    managed = managed_for(cfg, tables, forms)
    if not managed:
        return None
    rows = embedding_parts(embedding)[0]
    lookup = ManagedLookup(tables, managed, rows, seed=cfg.train.seed, device=torch.device(cfg.train.device),
                           group=group)
    return install(embedding, lookup)


def train_loader(cfg: RunConfig, data: PreparedData, device: torch.device, *, rank: int = 0, world: int = 1,
                 pipelined: bool = False, follow: tuple[Path, str] | None = None,
                 tables: list[TableSpec] | None = None):
    """The training batches of ``data``: a ``ShardLoader`` over the train split, or for a stream a
    ``StreamLoader`` following its directory (``data.stream_idle_s``, ``data.stream_poll_s``; ``follow``: the
    ranks' follow file and attempt token, by which rank 0 decides an idle end for all). Ids are checked
    there, once. ``pipelined``: the run has host tables (a stream does not feed them yet). ``tables``: the run's
    (:func:`tables_for`, computed once by the caller; else here)."""
    t = cfg.train
    raw = raw_id_features(cfg, tables_for(cfg, data.manifest) if tables is None else tables)
    if data.stream:
        if pipelined:
            raise ConfigError("data.source stream: host-placed tables (placement: host, model.host_min_rows) are not "
                              "fed from a stream yet; place them on the device")
        return StreamLoader(data.train.directory, t.batch_size, rank=rank, world_size=world,
                            idle_s=cfg.data.stream_idle_s, poll_s=cfg.data.stream_poll_s, prefetch=t.prefetch,
                            device=device, follow=follow, raw_ids=raw)
    return ShardLoader(data.train.directory, t.batch_size, rank=rank, world_size=world, start=data.train.start,
                       stop=data.train.stop, prefetch=t.prefetch, device=device, drop_last=False, raw_ids=raw)


def eval_loader(cfg: RunConfig, split: Split, device: torch.device, *, rank: int = 0, world: int = 1,
                batch_size: int = 0, manifest: Manifest | None = None,
                tables: list[TableSpec] | None = None) -> ShardLoader:
    """The loader of an eval or test split (ids checked, the managed tables' raw ids excepted; ``tables``: the
    run's, else derived from the split's manifest)."""
    if tables is None:
        tables = tables_for(cfg, manifest or Manifest.load(split.directory))
    raw = raw_id_features(cfg, tables)
    return ShardLoader(split.directory, batch_size or max(cfg.train.batch_size, 8192), rank=rank, world_size=world,
                       start=split.start, stop=split.stop, prefetch=cfg.train.prefetch, device=device, raw_ids=raw)


def _files(paths: str) -> list[str]:
    return [p.strip() for p in (paths or "").split(",") if p.strip()]


def split_existing(directory: Path, eval_fraction: float) -> PreparedData:
    """The train/eval/test splits of a dataset: its ``eval/`` and ``test/`` datasets when it has them
    (``extra["splits"]``: written from separate files or a split column), else the last ``eval_fraction``
    of its rows is the eval split (time order, as with real click logs)."""
    if not (0.0 <= eval_fraction < 1.0):
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
    m = Manifest.load(directory)
    splits = m.extra.get("splits", {})
    test = None
    if "test" in splits:
        tm = Manifest.load(Path(directory) / splits["test"])
        test = Split(Path(directory) / splits["test"], 0, tm.rows)
    if "eval" in splits:
        em = Manifest.load(Path(directory) / splits["eval"])
        return PreparedData(Split(Path(directory), 0, m.rows), Split(Path(directory) / splits["eval"], 0, em.rows), m,
                            test=test)
    n_eval = int(round(m.rows * eval_fraction))
    cut = m.rows - n_eval
    return PreparedData(Split(directory, 0, cut), Split(directory, cut, m.rows) if n_eval else None, m, test=test)


def embedding_memory(tables: list[TableSpec], forms: dict[str, TableForm]) -> str:
    """One line: the embedding tables' rows and the bytes their values take as stored in their ``forms`` (TT:
    the cores)."""
    size = {t.name: table_bytes(t, forms[t.name]) for t in tables}
    total = sum(size.values())
    rows = sum(t.num_rows for t in tables)
    biggest = max(tables, key=lambda t: size[t.name], default=None)
    return (f"embedding tables: {len(tables)}, {rows:,} rows, {human_bytes(total)} of weights"
            + (f" (largest {biggest.name}: {biggest.num_rows:,} rows, {human_bytes(size[biggest.name])})"
               if biggest else "") + "; optimizer state comes on top")


def tables_for(cfg: RunConfig, manifest: Manifest) -> list[TableSpec]:
    """The model's tables (facts only): as configured, or one per sparse feature of the data (sized by the data).

    A configured table that reads a feature the data does not have, or has fewer rows than the data's
    ids need, is a ``ConfigError`` naming table and feature.

    The default tables are ``plan.forms.default_tables`` (``t_<feature>``: the names ``embedscale plan
    --profile`` gives them too). The forms the config requests (``compression: tt``, ``placement: host``,
    ``model.tt_min_rows`` (EL-Rec VI-A), ``model.host_min_rows`` (EL-Rec V)) are checked here (a bad request is a
    ``ConfigError`` before anything runs) and decided by ``plan.forms.config_forms`` where a world of one
    builds (:func:`build`); a run with a saved plan builds the plan's forms (``train.distributed.run_forms``).
    """
    rows = {s.name: s.num_rows for s in manifest.sparse}
    m = cfg.model

    def decided(tables: list[TableSpec]) -> list[TableSpec]:  # the requests checked, as they were decided
        config_forms(m, tables)
        return tables

    if not cfg.model.tables:
        return decided(default_tables(((s.name, s.num_rows) for s in manifest.sparse), m.embedding_dim, m.pooling))
    for i, t in enumerate(cfg.model.tables):
        if not isinstance(t, TableConfig):
            raise ConfigError(f"model.tables[{i}]: expected a table entry (specs.TableConfig: the facts and the "
                              f"requested form), got {type(t).__name__}")
    try:
        feature_to_table(cfg.model.tables)  # a feature read by two tables, named with both
    except ConfigError as e:
        raise ConfigError(f"model.tables: {e}") from None
    seen = set()
    for t in cfg.model.tables:
        for f in t.features:
            if f not in rows:
                raise ConfigError(f"model.tables: table {t.name!r} reads feature {f!r}, which the data does not "
                                  f"have (features: {', '.join(rows)})")
            if rows[f] > t.num_rows and not (t.managed.enabled or m.managed.enabled):  # managed: raw ids
                raise ConfigError(f"model.tables: table {t.name!r} has {t.num_rows} rows but feature {f!r} "
                                  f"has ids up to {rows[f] - 1}")
            seen.add(f)
    missing = [f for f in rows if f not in seen]
    if missing:
        raise ConfigError(f"model.tables: no table reads feature(s) {', '.join(missing)}")
    return decided([t.spec for t in cfg.model.tables])


@dataclass
class RunInputs:
    """What a run reads, prepared once per process: the data's splits and the model's tables (facts)."""

    data: PreparedData
    tables: list[TableSpec]


def run_inputs(cfg: RunConfig, progress: bool = True) -> RunInputs:
    """The run's data (:func:`prepare_data`) and tables (:func:`tables_for`), made once: the ranks' runs receive
    them instead of re-deriving them."""
    data = prepare_data(cfg, progress=progress)
    return RunInputs(data, tables_for(cfg, data.manifest))


def say_embedding_memory(tables: list[TableSpec], forms: dict[str, TableForm], rank: int = 0) -> None:
    """Say the embedding memory once, before training builds the tables in their ``forms`` (rank 0 only:
    every rank builds the same tables)."""
    if rank == 0:
        _log(embedding_memory(tables, forms))


def build(cfg: RunConfig, tables: list[TableSpec], num_dense: int, device: torch.device, *, comm=None,
          assignment=None, validate: bool = True, reordering=None):
    """Model (with fused-optimizer embeddings) and the dense optimizer, seeded by ``train.seed``, in a world of
    one: the tables' forms are the config's requests decided (``plan.forms.config_forms``).

    DMT archs (``model.arch: dmt-dlrm | dmt-dcn``): without ``comm`` all towers in this process (one per
    host of ``dist.topology_hosts`` unless ``model.towers`` says otherwise: the same model a distributed
    run of this config trains); with a ``TowerComm`` this rank's part of the tower transform.
    ``assignment`` (a ``TowerAssignment``) overrides ``model.tower_assignment``. ``validate=False``: the
    embedding does not check ids again (every batch comes from a ``ShardLoader`` that checked them against
    the data's cardinalities, which ``tables_for`` made sure the tables cover). ``reordering``: the index
    reordering of the TT tables (EL-Rec IV; :func:`run_reordering`, or a checkpoint's,
    ``train.trainer.checkpoint_reordering``): the TT tables it covers rename their ids by it; without one they are
    built unrenamed and a checkpoint loaded into the model brings its maps (``train.trainer.load_reorder``), except
    row-group tables (``hot_rows``), which need it to be built.
    """
    parts = _model_parts(cfg, tables, num_dense, device, comm=comm, assignment=assignment, validate=validate,
                         reordering=reordering)
    return parts.model, parts.opt


@dataclass
class RunParts:
    """A run's parts, built once by :func:`build_run` and held by the run that trains or serves them (the
    single-process ``Trainer``, an N-rank ``DistributedRun`` or ``DMTRun``; the run adds only what wraps them: DDP,
    the drift monitor, the input pipeline). ``None``: the run has no such part."""

    tables: list[TableSpec]  # every table of the model (facts)
    forms: dict[str, TableForm]  # their forms: the plan's, else the config's requests decided
    model: nn.Module
    opt: torch.optim.Optimizer  # the dense optimizer (the embedding's is fused into it)
    data: PreparedData | None = None
    train_loader: object | None = None  # an inference run has none
    eval_loader: ShardLoader | None = None
    embedding: nn.Module | None = None  # the module holding the sharded (or local) rows
    tt_embedding: nn.Module | None = None  # the MixedEmbedding of the TT tables
    host_embedding: nn.Module | None = None  # the PipelinedEmbedding of the host parameter server's tables
    managed: ManagedLookup | None = None  # the managed tables' id mapping
    # N ranks: what the executor talks through, made in the same order on every rank
    monitor_group: object = None  # gloo, every rank: finds the ranks that stopped answering
    plan: Plan | None = None  # a flat run's plan, its sharded tables, their transport and the embedding's env
    sharded_tables: list[TableSpec] = field(default_factory=list)
    transport: object = None
    env: EmbeddingEnv | None = None  # (a live re-plan rebuilds the sharded rows with it)
    comm: TowerComm | None = None  # DMT: the tower transform's process groups


def build_run(cfg: RunConfig, inputs: RunInputs, device: torch.device, *, rank: int = 0, world: int = 1,
              plan_dir: Path | None = None, towers=None, inference: bool = False, assignment=None,
              reordering=None, follow: tuple[Path, str] | None = None, storage_spare: float = 0.0) -> RunParts:
    """The parts of a run (:class:`RunParts`), built once from its ``inputs`` (:func:`run_inputs`) on ``device``:
    tables and forms, embedding modules, model, dense optimizer, loaders (an ``inference`` run: no training
    loader), seeded by ``train.seed``.

    Which run: rank ``rank`` of ``world`` under the plan in ``plan_dir`` (:func:`_planned_parts`; ``follow``:
    a stream's follow file, ``storage_spare``: the PGAS heap's spare rows for live re-plans), rank ``rank`` of a
    DMT run's ``towers`` (``(TowerLayout, TowerAssignment)``, :func:`_tower_parts`), or a world of one (the
    config's forms; ``assignment``: a DMT model's towers, ``reordering``: the TT tables' index reordering,
    :func:`build`)."""
    if plan_dir is not None:
        parts = _planned_parts(cfg, inputs, device, Path(plan_dir), rank, world, inference, storage_spare)
    elif towers is not None:
        parts = _tower_parts(cfg, inputs, device, *towers, inference)
    else:
        parts = _model_parts(cfg, inputs.tables, inputs.data.manifest.num_dense, device, assignment=assignment,
                             validate=False, reordering=reordering)  # the ShardLoaders check every batch's ids
    data = parts.data = inputs.data
    if not inference:
        parts.train_loader = train_loader(cfg, data, device, rank=rank, world=world, follow=follow,
                                          pipelined=any(f.kind == "host" for f in parts.forms.values()),
                                          tables=parts.tables)
    if data.eval:
        parts.eval_loader = eval_loader(cfg, data.eval, device, rank=rank, world=world, tables=parts.tables)
    return parts


def _model_parts(cfg: RunConfig, tables: list[TableSpec], num_dense: int, device: torch.device, *, comm=None,
                 assignment=None, validate: bool = True, reordering=None) -> RunParts:
    """A world of one's model and optimizer (:func:`build`), or a DMT rank's (``comm``), with their parts."""
    torch.manual_seed(cfg.train.seed)
    t = cfg.train
    forms = config_forms(cfg.model, tables)
    if is_dmt_arch(cfg.model.arch):
        model = build_model(cfg.model, tables, num_dense, device=device, num_hosts=cfg.dist.topology_hosts, comm=comm,
                            assignment=assignment, sparse_optimizer=t.sparse_optimizer, lr_sparse=t.lr_sparse,
                            seed=t.seed)
        return RunParts(tables, forms, *_trained_by(t, model))
    covered = set(reordering.tables) if reordering is not None else set()
    forms = {n: (replace(f, reorder=n in covered or bool(f.hot_rows)) if f.kind == "tt" else f)
             for n, f in forms.items()}
    embedding = build_embedding(tables, None, EmbeddingEnv(device=device, optimizer=t.sparse_optimizer,
                                                           lr=t.lr_sparse, tt_lr=tt_lr(t), seed=t.seed,
                                                           validate=validate, reordering=reordering),
                                forms=forms)
    managed = install_managed(cfg, tables, embedding)  # managed tables: raw ids mapped to rows before every lookup
    model = build_model(cfg.model, tables, num_dense, embedding=embedding, device=device)
    rows, tt, host = embedding_parts(embedding)
    return RunParts(tables, forms, *_trained_by(t, model), embedding=rows, tt_embedding=tt, host_embedding=host,
                    managed=managed)


def _trained_by(t, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` with its training settings (``train.dropout``, ``train.sparse_weight_decay``) and its dense
    optimizer."""
    set_dropout(model, t.dropout)
    set_weight_decay(model, max(t.sparse_weight_decay, 0.0))  # < 0: auto, resolved by prepare_data (else none)
    return model, make_dense_optimizer(t, model.dense_parameters())


def _planned_parts(cfg: RunConfig, inputs: RunInputs, device: torch.device, plan_dir: Path, rank: int, world: int,
                   inference: bool, storage_spare: float) -> RunParts:
    """Rank ``rank``'s parts under the plan in ``plan_dir``: the tables in the plan's forms, the sharded ones'
    address map (OPER 5.1) and transport on their own process group (embedding traffic never interleaves with
    the dense AllReduce), the embedding (``models.builder.build_embedding``: sharded rows, TT replicas, host
    tables), managed tables' id mapping (sharded over the ranks), model and dense optimizer."""
    t, d = cfg.train, cfg.dist
    plan = Plan.load(plan_dir)
    if plan.world_size != world:
        raise ConfigError(f"{plan_dir} is for {plan.world_size} ranks, this run has {world}")
    tables, forms = run_tables(cfg, inputs.data.manifest, plan, plan_dir, inputs.tables)
    sharded = planned_tables(tables, forms)  # host tables: a parameter server; TT tables: replicas
    amap = address_map_from_plan(plan, sharded)
    new_group = partial(rank_group, device, d.timeout_s)
    emb_group = new_group()
    # made now, while every rank answers: after a failure it finds the ranks that stopped (monitored barrier)
    monitor_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=d.timeout_s))
    max_batch = -(-max(t.batch_size, 8192) // world)  # per rank, the eval loader's batches included
    transport = rank_transport(cfg, rank, world, emb_group, sharded, amap, max_batch)
    torch.manual_seed(t.seed)
    if t.pipeline_server not in ("per-rank", "shared"):
        raise ConfigError(f"train.pipeline_server {t.pipeline_server!r} is not 'per-rank' or 'shared'")
    if not inference:
        say_embedding_memory(tables, forms, rank)
    env = EmbeddingEnv(
        device=device, optimizer=t.sparse_optimizer, inference=inference, lr=t.lr_sparse,
        tt_lr=tt_lr(t), seed=t.seed, rank=rank, world_size=world, design=d.design,
        grad_sync=d.grad_sync, transport=transport, address_map=amap, sync_group=emb_group,
        pgas=d.transport == "pgas", max_batch_size=max_batch, validate=False,  # ShardLoader checked the ids
        storage_spare=storage_spare, new_group=new_group,
        new_share_group=local_group if t.pipeline_server == "shared" else None, timeout_s=d.timeout_s,
        stats={}, reordering=plan_reordering(plan_dir, forms, tables))
    built = build_embedding(tables, plan, env, forms=forms)
    rows, tt, host = embedding_parts(built)
    # managed tables: raw ids mapped to rows before every lookup, the mapping sharded (embedding.managed_lookup)
    managed = install_managed(cfg, tables, built, forms, group=new_group())
    model = build_model(cfg.model, tables, inputs.data.manifest.num_dense, embedding=host or tt or rows, device=device)
    return RunParts(tables, forms, *_trained_by(t, model), embedding=rows, tt_embedding=tt, host_embedding=host,
                    managed=managed, monitor_group=monitor_group, plan=plan, sharded_tables=sharded,
                    transport=transport, env=env)


def _tower_parts(cfg: RunConfig, inputs: RunInputs, device: torch.device, layout, assignment,
                 inference: bool) -> RunParts:
    """A DMT rank's parts: the process groups of the tower transform (``TowerComm`` of ``layout``: a tower group's,
    a peer set's; DMT 3.1.1) and this rank's part of the model under the towers of ``assignment``."""
    # made first, in the same order on every rank: the monitor group finds ranks that stopped answering
    monitor_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))
    comm = TowerComm(layout)
    parts = _model_parts(cfg, inputs.tables, inputs.data.manifest.num_dense, device, comm=comm,
                         assignment=assignment)
    parts.monitor_group, parts.comm = monitor_group, comm
    return parts


def rank_group(device: torch.device, timeout_s: float):
    """A process group of every rank (the sharded rows', the TT core gradients', the host rows' exchange): gloo
    for rows on the host, the device's backend otherwise."""
    return dist.new_group(backend="gloo" if on_host(device) else None, timeout=datetime.timedelta(seconds=timeout_s))


def rank_transport(cfg: RunConfig, rank: int, world: int, group, sharded: list[TableSpec], amap, max_batch: int):
    """The sharded rows' transport (``dist.transport``) on ``group``: collectives, or PGAS one-sided reads and
    writes with slots for ``max_batch`` ids per rank."""
    d = cfg.dist
    if d.transport == "collective":
        return CollectiveTransport(rank, world, group=group)
    if d.transport == "pgas":
        return PgasTransport(rank, world, group=group, ranks_per_host=-(-world // d.topology_hosts),
                             slot_bytes=slot_bytes_for(sharded, amap, max_batch, design=d.design),
                             timeout_s=d.timeout_s)
    raise ConfigError(f"dist.transport {d.transport!r} is not one of collective, pgas")


def planned_tables(tables: list, forms: Mapping[str, TableForm]) -> list:
    """The tables a plan places: those whose form is ``sharded``; not host tables (they live in a parameter
    server) nor TT ones (replicated on every rank and trained data-parallel, EL-Rec VI-B)."""
    return [t for t in tables if forms[t.name].kind == "sharded"]


def run_tables(cfg: RunConfig, manifest, plan, plan_name,
               tables: list | None = None) -> tuple[list, dict[str, TableForm]]:
    """The tables a distributed run builds, ``(tables, forms)``: the config's (:func:`tables_for`, or ``tables``
    when the caller made them) in the forms ``plan`` recorded (``plan.forms.forms_for_run``: an explicit request
    contradicting them is a ``ConfigError``)."""
    tables = tables_for(cfg, manifest) if tables is None else tables
    check_plan_sizes(plan, tables, str(plan_name))
    return tables, forms_for_run(plan.forms, config_forms(cfg.model, tables), str(plan_name))


def run_reordering(cfg: RunConfig, data: PreparedData, tables: list[TableSpec], forms, directory: str | Path,
                   progress: bool = True, prof=None):
    """The index reordering (EL-Rec IV) of the TT tables whose ``forms`` say ``reorder`` (``model.tt_reorder``),
    kept in ``directory/reorder/`` (a plan's directory, or a run's in a world of one): the one already there
    when it covers these tables (a resumed run's), else built from the training split (its access profile
    ``prof`` by table, made now when not given, and its first batches for ``leiden`` / ``louvain``) and
    saved. ``None`` when no form asks."""
    if not reordered_tables(forms):
        return None
    directory = Path(directory)
    try:
        return plan_reordering(directory, forms, tables)  # already there (a resumed run's)
    except FormatError:
        pass
    if prof is None:
        prof = profile(data, directory / "profile", tables, progress=progress)
    return reorder_for_plan(directory, forms, tables, prof, method=cfg.model.tt_reorder,  # none: row groups only
                            hot_ratio=cfg.model.tt_reorder_hot_ratio,
                            shards=None if data.stream else data.train.directory, seed=cfg.train.seed,
                            progress=progress)


def tt_lr(t) -> float:
    """The TT cores' learning rate: ``train.lr_tt``, or ``train.lr_sparse`` when it is 0."""
    if t.lr_tt < 0:
        raise ConfigError(f"train.lr_tt must be >= 0 (0 = train.lr_sparse), got {t.lr_tt}")
    return t.lr_tt or t.lr_sparse


def make_dense_optimizer(t, params) -> torch.optim.Optimizer:
    """The optimizer of the dense (non-embedding) parameters."""
    params = list(params)
    if t.dense_optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr_dense)
    if t.dense_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=t.lr_dense)
    if t.dense_optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr_dense)
    raise ConfigError(f"train.dense_optimizer {t.dense_optimizer!r} is not one of sgd, adagrad, adam")


def profile(data: PreparedData, out_dir: str | Path, tables: list[TableSpec] | None = None, progress: bool = True,
            raw_ids=()):
    """Per-row access counts of the training data (the planner's input), saved under ``out_dir``.

    With ``tables`` the counts are per table (features sharing a table add up); otherwise per feature.
    For raw files split by ``eval_fraction`` the whole converted file is profiled. A stream: the complete
    shards present now (none yet: zero counts, the plan balances rows alone). ``raw_ids``: features holding
    raw ids (managed tables, :func:`raw_id_features`): not counted (their rows are assigned while training).
    """
    f2t = {f: t.name for t in tables for f in t.features} if tables else None
    num_rows = {t.name: t.num_rows for t in tables} if tables else None
    if raw_ids or data.stream:
        m = data.manifest
        f2t = f2t or {f: f for f in m.sparse_names}
        rows: dict[str, int] = {}
        for s in m.sparse:
            rows[f2t[s.name]] = max(rows.get(f2t[s.name], 0), s.num_rows)
        rows.update(num_rows or {})
        prof = AccessProfile({t: np.zeros(n, dtype=np.int64) for t, n in rows.items()}, 0, f2t)
        if data.stream:
            shards = complete_shards(data.train.directory)
            if m.extra.get("finished_shards") is not None:
                shards = shards[:m.extra["finished_shards"]]
        else:
            shards = [data.train.directory / s["file"] for s in m.shards]
        for path in shards:
            cols = read_shard(path, m.num_dense)
            cols.sparse = {f: v for f, v in cols.sparse.items() if f not in raw_ids}
            prof.add(cols, source=path)
        prof.save(out_dir)
        return prof
    prof = AccessProfile.from_shards(data.train.directory, feature_to_table=f2t, num_rows=num_rows,
                                     progress=progress)
    prof.save(out_dir)
    return prof
