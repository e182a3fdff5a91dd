"""Specs and run configuration: tables, topology, and the run config, with YAML in and out.

Configs are plain dataclasses. ``from_dict`` is strict: an unknown key or a value of the wrong type is
a ``ConfigError`` that names the key path (``train.lr_dense``), so a typo never silently runs the
default. The CLI turns every leaf field into a flag (``--train-lr-dense``) that overrides the file.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from embedscale.errors import ConfigError

# Criteo Kaggle (Display Advertising Challenge) cardinalities of C1..C26.
CRITEO_KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
# Criteo Terabyte cardinalities as capped at 40M by the MLPerf DLRM reference.
CRITEO_TERABYTE_ROWS = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
    11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
]
CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
# Avazu (CTR prediction) CSV: id, click, hour, then 21 categorical columns.
AVAZU_COLUMNS = [
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
    "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
    "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]

POOLINGS = ("sum", "mean", "none")


@dataclass
class TableSpec:
    """One embedding table: the facts about it, nothing about how it is stored or placed.

    A table's *form* (sharded rows, TT with its rank, host parameter server, tower) is decided by the plan
    (``plan.forms.decide_forms``, recorded in ``Plan.forms``) and travels beside the specs as
    ``{table: TableForm}``, as TorchRec keeps ``EmbeddingBagConfig`` apart from its sharding plan. What a
    config asks for is a :class:`TableConfig`.

    Args:
        name: table name, unique in the model.
        num_rows: rows (the feature's cardinality after hashing or vocabulary building).
        dim: embedding dimension.
        features: the sparse features looked up in this table (default: one feature named as the table).
        pooling: ``sum``, ``mean``, or ``none`` (unpooled sequence).
        bytes_per_value: bytes per stored value (4 for fp32).
    """

    name: str
    num_rows: int
    dim: int = 16
    features: list[str] = field(default_factory=list)
    pooling: str = "sum"
    bytes_per_value: int = 4

    def __post_init__(self) -> None:
        if not self.features:
            self.features = [self.name]
        if self.num_rows <= 0:
            raise ConfigError(f"table {self.name!r}: num_rows must be positive, got {self.num_rows}")
        if self.dim <= 0:
            raise ConfigError(f"table {self.name!r}: dim must be positive, got {self.dim}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"table {self.name!r}: pooling {self.pooling!r} is not one of {POOLINGS}")

    @property
    def row_bytes(self) -> int:
        return self.dim * self.bytes_per_value

    @property
    def memory_bytes(self) -> int:
        return self.num_rows * self.row_bytes


FACT_FIELDS = tuple(f.name for f in dataclasses.fields(TableSpec))
COMPRESSIONS = ("none", "tt")
PLACEMENTS = ("device", "host")
MANAGED_POLICIES = ("lru", "lfu", "ttl")  # embedding.managed.POLICIES


@dataclass
class ManagedConfig:
    """A *managed* table: its features carry raw 64-bit ids (any int64, negative included),
    mapped to the table's rows by ``embedding.managed.ManagedIdTable`` while training (row 0: the default row
    of ids without a row of their own).

    admit_after: k, the sightings an id needs before it gets its own row (>= 1; 0 = the table is not managed).
    policy: eviction when no row is free: ``lru``, ``lfu``, or ``ttl`` (rows idle more than ``ttl`` steps freed).
    ttl: steps, for ``policy: ttl`` only (>= 1).
    pending_capacity: ids seen but not yet admitted that are remembered (0 = 4 x the table's rows).
    shards: mapping shards ``S`` (``embedding.managed``: a fixed hash of the raw id picks the shard, each shard
        admits into and evicts among its own range of rows, as TorchRec's MCH modules remap per shard; rank
        ``r`` of N hosts the shards ``s % N == r``). A property of the table, never of the world size, so a run
        assigns the same rows on any number of ranks. 0 = :meth:`shards_for`'s default: 16, or one per 64 rows
        of a smaller table (at least 1).
    """

    admit_after: int = 0
    policy: str = "lru"
    ttl: int = 0
    pending_capacity: int = 0
    shards: int = 0

    @property
    def enabled(self) -> bool:
        return self.admit_after > 0

    def shards_for(self, num_rows: int) -> int:
        """The table's mapping shards: ``shards``, or by default ``min(16, max(1, (num_rows - 1) // 64))``."""
        return self.shards or min(16, max(1, (num_rows - 1) // 64))


def check_managed(m: "ManagedConfig", where: str) -> None:
    """A ``managed`` entry's fields, each error naming ``where`` (the table or ``model.managed``) and the key."""
    if m.admit_after < 0:
        raise ConfigError(f"{where}.admit_after: {m.admit_after} must be >= 1 (0 = not managed)")
    if m.policy not in MANAGED_POLICIES:
        raise ConfigError(f"{where}.policy: {m.policy!r} is not one of {', '.join(MANAGED_POLICIES)}")
    if m.ttl < 0:
        raise ConfigError(f"{where}.ttl: {m.ttl} must be >= 1 steps (policy ttl) or 0")
    if m.pending_capacity < 0:
        raise ConfigError(f"{where}.pending_capacity: {m.pending_capacity} must be >= 0 (0 = 4 x rows)")
    if m.shards < 0:
        raise ConfigError(f"{where}.shards: {m.shards} must be >= 1 mapping shards (0 = the default)")
    if not m.enabled:
        if m.policy != "lru" or m.ttl or m.pending_capacity or m.shards:
            raise ConfigError(f"{where}.admit_after: 0 (not managed) but policy/ttl/pending_capacity/shards are set; "
                              "give admit_after >= 1 to manage the table")
        return
    if m.policy == "ttl" and m.ttl < 1:
        raise ConfigError(f"{where}.ttl: policy 'ttl' needs ttl >= 1 steps, got {m.ttl}")
    if m.policy != "ttl" and m.ttl:
        raise ConfigError(f"{where}.ttl: {m.ttl} is given but the policy is {m.policy!r} (ttl is for policy 'ttl')")


@dataclass
class TableConfig:
    """One entry of ``model.tables``: a table's facts (:attr:`spec`) and the form the config *requests*.

    ``compression: tt`` (with ``tt_rank``) asks for a tensor-train table (EL-Rec section III), ``placement:
    host`` for the host parameter server (EL-Rec section V). They are requests only: ``plan.forms.decide_forms``
    turns them (with ``model.tt_min_rows`` / ``model.host_min_rows``) into the table's form, and a run with a
    saved plan builds what the plan recorded.

    Args:
        name, num_rows, dim, features, pooling, bytes_per_value: the facts, as :class:`TableSpec`.
        compression: ``none`` or ``tt``.
        tt_rank: TT rank when ``compression == "tt"``.
        hot_rows: with ``compression: tt``, row groups: this many of the table's hottest rows stay exact and only
            the others are TT (the table then gets an index reordering, EL-Rec IV, whose first ids are those
            rows); 0: the whole table TT.
        placement: ``device`` or ``host``.
        managed: raw 64-bit ids mapped to the rows while training (:class:`ManagedConfig`; ``admit_after: 0``,
            the default, follows ``model.managed``). Not a form: what the table's features carry.
    """

    name: str
    num_rows: int
    dim: int = 16
    features: list[str] = field(default_factory=list)
    pooling: str = "sum"
    bytes_per_value: int = 4
    compression: str = "none"
    tt_rank: int = 32
    hot_rows: int = 0
    placement: str = "device"
    managed: ManagedConfig = field(default_factory=ManagedConfig)

    def __post_init__(self) -> None:
        self.features = self.spec.features  # the facts checked, the default feature filled in
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"table {self.name!r}: compression {self.compression!r} is not 'none' or 'tt'")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"table {self.name!r}: placement {self.placement!r} is not 'device' or 'host'")
        if self.compression == "tt" and self.tt_rank <= 0:
            raise ConfigError(f"table {self.name!r}: tt_rank must be positive, got {self.tt_rank}")
        if self.hot_rows and (self.compression != "tt" or not 0 < self.hot_rows < self.num_rows):
            raise ConfigError(f"table {self.name!r}: hot_rows {self.hot_rows} (exact hot rows beside TT cold rows) "
                              f"needs compression: tt and 0 < hot_rows < num_rows ({self.num_rows})")
        if isinstance(self.managed, dict):  # built by hand (from_dict builds the dataclass)
            self.managed = from_dict(ManagedConfig, self.managed, f"table {self.name!r}: managed")
        check_managed(self.managed, f"table {self.name!r}: managed")

    @property
    def spec(self) -> TableSpec:
        """The table's facts."""
        facts = {k: getattr(self, k) for k in FACT_FIELDS}
        return TableSpec(**{**facts, "features": list(self.features)})


def managed_tables(model: "ModelConfig", tables: list[TableSpec]) -> dict[str, ManagedConfig]:
    """The managed tables among ``tables`` (the model's, facts) and their settings: a ``model.tables`` entry's own
    ``managed`` (``admit_after >= 1``), else ``model.managed`` when it is on; a managed table needs at least 2
    rows (row 0 is the default row)."""
    own = {t.name: t.managed for t in model.tables if isinstance(t, TableConfig) and t.managed.enabled}
    out = {}
    for t in tables:
        m = own.get(t.name) or (model.managed if model.managed.enabled else None)
        if m is None:
            continue
        if t.num_rows < 2:
            raise ConfigError(f"table {t.name!r}: managed tables need num_rows >= 2 (row 0 is the default row), "
                              f"got {t.num_rows}")
        if m.shards > t.num_rows - 1:
            raise ConfigError(f"table {t.name!r}: managed.shards {m.shards} exceeds its {t.num_rows - 1} rows besides "
                              "the default row (each mapping shard owns at least one row)")
        out[t.name] = m
    return out


def feature_to_table(tables: list[TableSpec]) -> dict[str, int]:
    """Map every feature name to the index of the table it reads; a feature in two tables is an error."""
    out: dict[str, int] = {}
    for t, spec in enumerate(tables):
        for f in spec.features:
            if f in out:
                raise ConfigError(f"feature {f!r} is read by tables {tables[out[f]].name!r} and {spec.name!r}")
            out[f] = t
    names = [s.name for s in tables]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"table names repeat: {sorted(dup)}")
    return out


@dataclass
class Topology:
    """Hosts x ranks per host and the links between ranks (OPER section 3.2).

    Bandwidths in GB/s, latencies in microseconds. ``memory_per_rank`` in bytes (0 = unlimited).
    """

    num_hosts: int = 1
    ranks_per_host: int = 2
    memory_per_rank: int = 0
    intra_host_bw: float = 100.0
    inter_host_bw: float = 23.75
    intra_host_latency_us: float = 2.0
    inter_host_latency_us: float = 8.0
    local_bw: float = 1000.0
    allreduce_bw: float = 100.0

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host


@dataclass
class SyntheticConfig:
    """Synthetic Criteo-shaped data (see ``embedscale.data.synthetic``)."""

    preset: str = "criteo-kaggle"
    max_rows: int = 100_000  # cap every table's cardinality (scaled-down preset); 0 = no cap
    num_dense: int = 13
    alpha: float = 1.1  # power-law exponent of row access, used for every table unless alphas is set
    alphas: list[float] = field(default_factory=list)
    pooling_factors: list[int] = field(default_factory=list)  # per table; empty = one-hot everywhere
    teacher_dim: int = 8
    # K of the teacher's row learnability m / (m + K), m a row's expected accesses in 200k samples: the default
    # leaves the signal on head rows; a small K puts it into the tail too (0: every row its whole effect)
    learnable_count: float = 2000.0


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | criteo | avazu | table (data.schema) | shards | stream
    # raw training file(s) (criteo/avazu/table; comma-separated), shard directory (shards) or the directory a
    # stream's shards arrive in (stream: data.stream, one pass until its END marker or stream_idle_s)
    path: str = ""
    schema: str = ""  # source table: the schema YAML (embedscale.data.schema)
    eval_path: str = ""  # raw eval file(s): the eval split instead of eval_fraction (criteo/avazu/table); stream: a shard directory
    test_path: str = ""  # raw test file(s): scored by `embedscale evaluate --split test`
    train_samples: int = 1_500_000
    eval_samples: int = 100_000
    # without an eval split given (file or dataset's eval/): the last rows. The eval split only picks the best
    # checkpoint and fits the two parameters of the calibration; on a small log every row it leaves to training
    # counts (an Avazu sample of 8,087 rows: test AUC +0.005 at 0.1 against 0.2; BENCHMARKS.md, "Quality against
    # a logistic regression")
    eval_fraction: float = 0.1
    seed: int = 0
    shard_rows: int = 1_000_000
    # Raw readers (criteo/avazu/table): "hash" (hash/modulo to table_rows), "vocab" (min-frequency vocabulary) or
    # "auto" (vocab when every feature's vocabulary fits in max_table_rows, else hash: data.categorical)
    categorical: str = "auto"
    table_rows: int = 0  # hash buckets per table in hash mode; 0 = sized from the data (load factor, cap)
    load_factor: float = 0.5  # tables sized from the data: distinct values / load_factor rows ...
    max_table_rows: int = 1_000_000  # ... at most this many
    min_frequency: int = 1  # vocab mode: values seen fewer times share the out-of-vocabulary row 0
    skip_malformed: bool = False
    # stream: end when no new shard has arrived for this many seconds (0 = only at the END marker; a world of
    # one: N ranks end on the marker), and how often the directory is looked at while waiting
    stream_idle_s: float = 0.0
    stream_poll_s: float = 0.2
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class ModelConfig:
    """The model: ``arch`` and its sizes; the ``tower*`` fields configure the DMT archs only (DMT 3-4).

    DMT (``arch: dmt-dlrm | dmt-dcn``): the features are split into ``towers`` towers; each tower's
    embeddings meet in one tower group of ``hosts_per_tower`` hosts (the tower transform, DMT 3.1) and
    are compressed there by a tower module (DMT 3.2, section 4 Listings 1-2) before they cross hosts.
    Defaults: one tower per host (``dist.topology_hosts``), the naive strided assignment, DLRM tower
    modules for dmt-dlrm and DCN ones for dmt-dcn with ``D = embedding_dim / tower_compression``.
    """

    arch: str = "dlrm"  # dlrm | dcn | dmt-dlrm | dmt-dcn
    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256])
    cross_layers: int = 3
    cross_low_rank: int = 0  # 0 = full-rank DCN-v2 cross
    # the first-order (wide) term of Wide & Deep / DeepFM added to the logit of dlrm and dcn (models.dlrm.FirstOrder):
    # every feature value's own effect reaches the logit directly, not only through the interaction
    first_order: bool = True
    pooling: str = "sum"
    host_min_rows: int = 0  # > 0: tables of at least this many rows get placement: host (EL-Rec V parameter server)
    # the tables (facts and requested forms, TableConfig); empty = one table per sparse feature of the data
    tables: list[TableConfig] = field(default_factory=list)
    # > 0: tables of at least this many rows are stored as tensor-train tables of rank tt_rank (EL-Rec VI-A
    # compresses the tables over 1M rows: 1000000), replicated on every rank and trained data-parallel
    tt_min_rows: int = 0
    tt_rank: int = 32
    # index reordering of the TT tables (EL-Rec IV, embedscale.reorder): none | frequency (hot rows first, the rest
    # by count, from the access profile) | leiden | louvain (also co-accessed rows together, from the data's first
    # batches); the plan carries the bijection (<plan>/reorder/) and training renames the TT tables' ids by it
    tt_reorder: str = "none"
    tt_reorder_hot_ratio: float = 0.01  # Hot_ratio of EL-Rec's Algorithm 2: the hottest rows keep the first ids
    # DMT only (arch dmt-dlrm | dmt-dcn)
    towers: int = 0  # T; 0 = the tower assignment file's count, else one per host (dist.topology_hosts / hosts_per_tower)
    tower_assignment: str = "naive"  # naive (feature i to tower i % T, DMT 5.2.3) or a JSON file of `embedscale towers`
    tower_module: str = "auto"  # auto (dlrm for dmt-dlrm, dcn for dmt-dcn) | dlrm | dcn | none (tower transform only)
    tower_compression: int = 4  # D = embedding_dim / this when tower_dim is 0: the compression ratio for c=1, p=0 (DMT 4)
    tower_dim: int = 0  # D, the width of the tower module's output vectors; 0 = embedding_dim / tower_compression
    tower_c: int = 1  # DLRM tower module (Listing 1): projected vectors per feature
    tower_p: int = 0  # DLRM tower module (Listing 1): mixed vectors per tower
    tower_cross_layers: int = 1  # DCN tower module (Listing 2): layers of the tower's CrossNet
    tower_cross_low_rank: int = 0  # DCN tower module: low rank of its CrossNet (0 = full rank)
    hosts_per_tower: int = 1  # K: hosts of one tower group (DMT 3.1.3)
    tower_sharding: str = "table"  # table | row: tables inside a tower group (DMT 3.1.3, 4)
    tower_permute: str = "auto"  # auto | embeddings | ids (steps b and c swapped, DMT 3.1.3)
    # every table managed (raw 64-bit ids mapped to rows while training): admit_after k >= 1 turns it on;
    # a model.tables entry's own managed (admit_after >= 1) wins for that table (specs.ManagedConfig)
    managed: ManagedConfig = field(default_factory=ManagedConfig)


AUTO_BATCH_MAX = 1024  # the batch of a large log (OPER's and TorchRec's DLRM examples train at 1024 per rank or more)
AUTO_BATCH_MIN = 32
AUTO_BATCH_STEPS = 64  # a small log's batch: about this many steps per pass


def auto_batch_size(train_rows: int) -> int:
    """``train.batch_size: 0``: the batch of a log of ``train_rows`` training rows, the power of two nearest to
    ``train_rows / 64`` within ``[32, 1024]`` (1024 for a stream, whose size is not known). At a fixed batch a
    small log is a handful of steps per pass (8,000 rows at 1,024: 8), too few for the dense layers' Adagrad to
    move; a batch that scales with the log gives every pass about 64 steps, and a log of 65,536 rows or more the
    large-log batch of 1,024."""
    if train_rows <= 0:
        return AUTO_BATCH_MAX
    return int(min(AUTO_BATCH_MAX, max(AUTO_BATCH_MIN, 2 ** round(math.log2(train_rows / AUTO_BATCH_STEPS)))))


AUTO_SPARSE_WEIGHT_DECAY = 1e-3  # the rows' L2 of a run that passes over its rows more than once


def auto_sparse_weight_decay(train_rows: int, epochs: int, epoch_samples: int, has_eval: bool,
                             max_steps: int = 0, batch_size: int = 0) -> float:
    """``train.sparse_weight_decay`` < 0: the L2 on the touched rows of a run over ``train_rows`` rows.

    A run that passes over its rows more than once (``epochs`` > 1, or ``epochs: 0`` on a log of fewer rows than
    ``epoch_samples`` with an eval split to stop on: ``train.loop.auto_epochs``; and not ended within the first
    pass by ``max_steps`` steps of ``batch_size``) gets
    ``AUTO_SPARSE_WEIGHT_DECAY``: from the second pass on a rare value's row sees the same few labels again and
    memorises them (its eval AUC falls from the first pass's end: 0.716 -> 0.683 on an Avazu sample of 6,470
    rows), and the lazy L2 of the rows holds them back as the L2 of a logistic regression does. One pass (a
    large log, a stream) sees every row's samples once: no decay, and the fused row-update kernels."""
    several = epochs > 1 or (epochs == 0 and has_eval and 0 < train_rows < epoch_samples)
    if max_steps > 0 and max_steps * batch_size <= train_rows:
        several = False  # max_steps ends the run within its first pass
    return AUTO_SPARSE_WEIGHT_DECAY if several else 0.0


@dataclass
class TrainConfig:
    batch_size: int = 0  # global batch; 0 = from the training rows (auto_batch_size: 1024 for a large log)
    # passes over the training split; 0 = until early stopping on the eval split (train.loop.auto_epochs): at
    # most as many as make epoch_samples samples (at least one), so a large log gets one pass (click logs
    # overfit from the second on) and a small one the passes it needs; without an eval split, one pass
    epochs: int = 0
    epoch_samples: int = 1_000_000
    max_steps: int = 0  # 0 = run the epochs
    # Adagrad rates of the MLPs and (row-wise) of the embedding rows. lr_dense is torch.optim.Adagrad's own
    # default, 0.01: with the batch sized from the data and early stopping, 0.001 left the MLPs near their
    # init and the rows memorising (frappe's eval AUC 0.928 against 0.935 at 0.01; BENCHMARKS.md, "Quality
    # against a logistic regression"); the sparse rate 0.02 (0.1 overshot on the real Criteo rows)
    lr_dense: float = 0.01
    lr_sparse: float = 0.02
    # linear warmup of lr_dense over the first steps (train.trainer.warm_up_lr: without it Adagrad's first
    # step can kill the bottom MLP's ReLUs for good); 0 = none
    lr_warmup_steps: int = 100
    # ... but at most this fraction of the run's steps (a 100-step warmup is longer than an epoch of a small
    # data set: 8,000 rows at batch 1,024 are 8 steps); train.loop.warmup_steps
    lr_warmup_fraction: float = 0.1
    # Adagrad lr of the TT cores (compression: tt): every core slice is shared by many rows, so lr_sparse's
    # 0.1 overshoots (bench_tt_quality: 0.7604 eval AUC at 0.1, 0.7624 at 0.02); 0 = lr_sparse
    lr_tt: float = 0.02
    # L2 on the embedding rows a step updates, in the fused sparse optimizer (embedding.optim: wd * w added to each
    # touched row's gradient; local and sharded rows, not TT cores or host tables); 0 = none; < 0 (-1) = auto
    # (auto_sparse_weight_decay): AUTO_SPARSE_WEIGHT_DECAY when the run passes over its rows more than once, else 0
    sparse_weight_decay: float = -1.0
    dense_optimizer: str = "adagrad"  # sgd | adagrad | adam
    sparse_optimizer: str = "rowwise_adagrad"  # sgd | rowwise_adagrad
    eval_every: int = 100  # steps; 0 = at the end only
    log_every: int = 10
    checkpoint_every: int = 0  # steps; 0 = at the end only
    # > 0: a full checkpoint every this many steps, deltas (rows updated since the last full one) in between;
    # 0 = every checkpoint full (train.checkpoint)
    checkpoint_full_every: int = 0
    # where checkpoints/ goes: a local path or any fsspec URI (s3://bucket/runs/big; embedscale.storage);
    # "" = the run directory
    checkpoint_dir: str = ""
    # live re-planning (N ranks, train.replan): every this many steps the ranks' rolling access profile is summed,
    # the running plan and a fresh one are costed (plan.drift) and, when the fresh plan's predicted bottleneck is
    # lower by more than replan_min_gain, the rows migrate to it between two steps; 0 = off
    replan_every: int = 0
    replan_min_gain: float = 0.05
    # re-plan only when the predicted gain over the steps to the next check outweighs the check and the migration
    # (train.replan.replan_pays); false: whenever the plan taken gains more than replan_min_gain (tests of migration)
    replan_weigh_costs: bool = True
    # the steps rank 0 plans beside training: a check at step N runs in a thread while every rank trains on, and
    # its verdict is taken (the rows migrate) between steps N + replan_lag and N + replan_lag + 1, or a period later
    # while the check still runs; 0 = the other ranks wait for the check (train.replan); at most replan_every
    replan_lag: int = 1
    # the drift monitor counts each batch of its counting periods with probability 1 / replan_count_every, weighted
    # by replan_count_every (an unbiased estimate of the full count, drawn from train.seed and the step); 1 = all
    replan_count_every: int = 1
    # early stopping (train.loop): stop after this many evaluations in a row (every eval_every steps and at
    # each epoch's end) without improving early_stopping_metric by more than early_stopping_min_delta; 0 = off
    early_stopping_patience: int = 3
    early_stopping_metric: str = "auc"  # auc | logloss | ne
    early_stopping_min_delta: float = 0.0
    keep_best: bool = True  # checkpoints/best points at the best evaluation's checkpoint (written when it improves)
    # beta calibration of the logit at inference (models.dlrm.LogitCalibration; Platt scaling and a second slope
    # for the low scores): fitted on the eval split's raw logits at every evaluation and saved with that step's
    # checkpoints, so the best checkpoint's probabilities are calibrated (AUC unchanged)
    calibrate: bool = True
    # progressive validation (train.loop): AUC/logloss/NE of every batch's pre-update logits over the last
    # this-many samples, in every logged metrics row (pv_*); 0 = off
    progressive_window: int = 100_000
    dropout: float = 0.5  # dropout rate in the hidden layers of the top MLP while training (0 = none)
    seed: int = 0
    device: str = "cpu"
    prefetch: int = 2
    pipeline_depth: int = 1  # >1: host-placed tables prefetched this many batches ahead (EL-Rec section V); a plan's host form with pipeline_depth > 0 wins
    pipeline_cache: bool = True  # the life-cycle cache that keeps prefetched rows fresh (off: stale, for tests)
    pipeline_server: str = "per-rank"  # several ranks: per-rank (a replica each) | shared (one copy per machine)


@dataclass
class DistConfig:
    """Several ranks: how the embedding rows are placed and moved (OPER sections 4-5)."""

    nproc: int = 1  # local processes `embedscale train/run` launches (torchrun sets its own)
    plan: str = "oper"  # a strategy (oper, table_wise, row_wise, ..., auto: dist.device_memory below) or the path of a saved plan
    mode: str = "training"  # the plan's mode: training | inference
    extra_memory: float = 0.05  # OPER's extra-memory ratio for replicas
    oper_traffic: str = "distinct"  # plan oper against: distinct (what the executor moves) | access (OPER eq. 3, 5)
    design: str = "retrieve"  # retrieve | send
    transport: str = "collective"  # collective (or pgas: one-sided gets, shared memory)
    grad_sync: str = "local_aggregated"  # local_aggregated | dense | allgather | alltoall (retrieve, collective)
    timeout_s: float = 300.0  # a rank that dies or hangs becomes an error on the others after this
    backend: str = ""  # gloo | nccl; empty = nccl when the device is a GPU, else gloo
    topology_hosts: int = 1  # hosts the ranks are spread over (ranks per host = nproc / hosts)
    # every rank's own network link, Gbit/s, as the drift monitor's cost model sees it (comm.hierarchical.link_topology:
    # what a rank serves and fetches at that rate); 0 = the topology's default links
    link_gbit_s: float = 0.0
    replan: bool = False  # resume a run directory under another dist.plan: re-plan it (else a ConfigError)
    # the next batch's ids checked, decoded and announced to their owners during this step (OPER 5.1 pipelined,
    # as TorchRec's TrainPipelineSparseDist): sharded rows, retrieve design, no live re-plan (behind host tables:
    # pipeline depth >= 2); exact either way
    input_pipeline: bool = True
    # dist.plan auto: every table's form decided under these per-rank budgets (plan.auto.parse_bytes)
    device_memory: str = ""  # device memory per rank, e.g. 256MiB (required by auto)
    host_memory: str = ""  # host memory per rank for host-placed tables, e.g. 512MiB (empty: 0, no host tables)
    costs: str = ""  # per-row costs JSON from `embedscale calibrate` (empty: plan.auto.Costs' documented defaults)
    # auto: > 0 runs the model's plans within its error of the best this many steps each and keeps the fastest
    # (train.plan_trial); 0 = the model's choice
    plan_trial_steps: int = 0
    # rounds of that trial: after the first, the plans whose timings are within 15% of the best's run again, in the
    # reverse order (plan.choose.measured_choice); each plan's step is the median of its timings
    plan_trial_rounds: int = 2


@dataclass
class RunConfig:
    name: str = "default"
    out_dir: str = "runs"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)


# --------------------------------------------------------------------------------------------------
# dict <-> dataclass, strict


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, path)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: {value!r} fits none of {args}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if "e" in value.lower() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ``ConfigError``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown config key(s) {', '.join(where + k for k in unknown)}; "
            f"known: {', '.join(sorted(fields))}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from None
    validate(obj, path)
    return obj


# --------------------------------------------------------------------------------------------------
# value checks: enumerated names and numbers, when the config is loaded (a single-process run too)

# The names the code accepts (the modules that implement them check again; these lists must match them:
# embedding.grad_sync.METHODS + alltoall, embedding.optim.OPTIMIZERS, models.ALL_ARCHS, workflow.prepare_data).
CHOICES: dict[type, dict[str, tuple[str, ...]]] = {}  # filled below, once the classes exist
# float fields: (lowest allowed, whether the lowest itself is allowed, highest (exclusive) or None)
NUMBERS: dict[type, dict[str, tuple[float, bool, float | None]]] = {}


def validate(obj: Any, path: str = "") -> None:
    """Check ``obj``'s enumerated names and numbers (``CHOICES``/``NUMBERS``) and, for a ``TrainConfig``, that
    ``train.device`` exists here; a ``ConfigError`` names the key (``train.lr_dense``) and the value."""
    where = f"{path}." if path else ""
    for key, allowed in CHOICES.get(type(obj), {}).items():
        v = getattr(obj, key)
        if v not in allowed:
            raise ConfigError(f"{where}{key}: {v!r} is not one of {', '.join(allowed)}")
    for key, (low, low_ok, high) in NUMBERS.get(type(obj), {}).items():
        v = getattr(obj, key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        bad = not math.isfinite(v) or v < low or (v == low and not low_ok) or (high is not None and v >= high)
        if bad:
            rng = f"{'>=' if low_ok else '>'} {low:g}" + (f" and < {high:g}" if high is not None else "")
            what = "an integer" if isinstance(v, int) else "a finite number"
            raise ConfigError(f"{where}{key}: {v!r} is not {what} {rng}")
    if isinstance(obj, ModelConfig):
        check_managed(obj.managed, f"{where}managed")
    if isinstance(obj, TrainConfig):
        check_device(obj.device, f"{where}device")
        if obj.lr_warmup_fraction > 1.0:
            raise ConfigError(f"{where}lr_warmup_fraction: {obj.lr_warmup_fraction!r} is not in [0, 1]")
    if isinstance(obj, DistConfig) and obj.grad_sync == "alltoall" and (obj.design, obj.transport) != (
            "retrieve", "collective"):
        # caught here, before any rank starts, not as N rank errors under torchrun
        raise ConfigError(f"{where}grad_sync: 'alltoall' rides in the retrieve design's all-to-all; it needs "
                          f"{where}design 'retrieve' and {where}transport 'collective' (got {obj.design!r}, "
                          f"{obj.transport!r})")


def check_device(name: str, key: str = "train.device") -> None:
    """``name`` parses as a torch device and exists on this machine (device-agnostic: the type's accelerator
    API or its torch module says how many there are); else a ``ConfigError`` naming ``key`` and what exists."""
    if name == "cpu":  # the default: no torch import for it
        return
    # torch is imported here, not at the top: the planner imports specs and must stay torch-free
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"{key}: {name!r} is not a device ({e})") from None
    if dev.type in ("cpu", "meta"):
        return
    mod = getattr(torch, dev.type, None)
    count = 0
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available() and acc.current_accelerator().type == dev.type:
        count = acc.device_count()
    elif mod is not None and hasattr(mod, "device_count"):
        count = mod.device_count() if getattr(mod, "is_available", lambda: True)() else 0
    if count == 0 or (dev.index is not None and dev.index >= count):
        acc_dev = acc.current_accelerator() if acc is not None and acc.is_available() else None
        have = ["cpu"] + ([f"{acc_dev.type}:{i}" for i in range(acc.device_count())] if acc_dev is not None else [])
        raise ConfigError(f"{key}: {name!r} is not on this machine (devices here: {', '.join(have)})")


CHOICES.update({
    DataConfig: {"source": ("synthetic", "criteo", "avazu", "table", "shards", "stream"),
                 "categorical": ("auto", "hash", "vocab")},
    ModelConfig: {"arch": ("dlrm", "dcn", "dmt-dlrm", "dmt-dcn"), "pooling": POOLINGS},
    TrainConfig: {"dense_optimizer": ("sgd", "adagrad", "adam"), "sparse_optimizer": ("sgd", "rowwise_adagrad"),
                  "pipeline_server": ("per-rank", "shared"), "early_stopping_metric": ("auc", "logloss", "ne")},
    DistConfig: {"mode": ("training", "inference"), "design": ("retrieve", "send"),
                 "oper_traffic": ("distinct", "access"),
                 "transport": ("collective", "pgas"),
                 "grad_sync": ("local_aggregated", "dense", "allgather", "alltoall")},
})
# integer fields: counts and sizes (``(1, True, None)``: at least 1; ``(0, True, None)``: 0 = off / all)
_AT_LEAST_1, _AT_LEAST_0 = (1, True, None), (0, True, None)
NUMBERS.update({
    DataConfig: {"eval_fraction": (0.0, True, 1.0), "stream_idle_s": (0.0, True, None),
                 "stream_poll_s": (0.0, False, None), "load_factor": (0.0, False, None),
                 "train_samples": _AT_LEAST_0, "eval_samples": _AT_LEAST_0, "shard_rows": _AT_LEAST_1,
                 "table_rows": _AT_LEAST_0, "max_table_rows": _AT_LEAST_1, "min_frequency": _AT_LEAST_1},
    ModelConfig: {"embedding_dim": _AT_LEAST_1, "cross_layers": _AT_LEAST_0, "cross_low_rank": _AT_LEAST_0,
                  "tt_min_rows": _AT_LEAST_0, "tt_rank": _AT_LEAST_1, "host_min_rows": _AT_LEAST_0},
    SyntheticConfig: {"alpha": (0.0, True, None)},
    TrainConfig: {"lr_dense": (0.0, True, None), "lr_sparse": (0.0, True, None), "lr_tt": (0.0, True, None),
                  "lr_warmup_fraction": (0.0, True, None), "early_stopping_patience": (0.0, True, None),
                  "early_stopping_min_delta": (0.0, True, None), "dropout": (0.0, True, 1.0),
                  "progressive_window": (0.0, True, None), "replan_every": (0.0, True, None),
                  "epoch_samples": _AT_LEAST_1,
                  "sparse_weight_decay": (-1.0, True, None),
                  "replan_min_gain": (0.0, True, None), "replan_lag": _AT_LEAST_0, "replan_count_every": _AT_LEAST_1,
                  "batch_size": _AT_LEAST_0, "epochs": _AT_LEAST_0, "max_steps": _AT_LEAST_0,
                  "eval_every": _AT_LEAST_0, "log_every": _AT_LEAST_0, "checkpoint_every": _AT_LEAST_0,
                  "checkpoint_full_every": _AT_LEAST_0, "lr_warmup_steps": _AT_LEAST_0, "prefetch": _AT_LEAST_0,
                  "pipeline_depth": _AT_LEAST_0},
    DistConfig: {"extra_memory": (0.0, True, None), "timeout_s": (0.0, False, None), "nproc": _AT_LEAST_1,
                 "plan_trial_steps": _AT_LEAST_0, "plan_trial_rounds": _AT_LEAST_1,
                 "topology_hosts": _AT_LEAST_1, "link_gbit_s": (0.0, True, None)},
    Topology: {k: (0.0, True, None) for k in ("intra_host_bw", "inter_host_bw", "intra_host_latency_us",
                                              "inter_host_latency_us", "local_bw", "allreduce_bw")},
})


def to_dict(obj: Any) -> Any:
    """Dataclass to plain dict/list/scalars (YAML- and JSON-safe)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a YAML run config (or the defaults) and apply dotted overrides like ``{"train.lr_dense": 0.1}``."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
            raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
        try:  # a section the file gives as a scalar or a list is the file's error, not an override's
            _check_sections(data, RunConfig)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    try:
        return from_dict(RunConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def _check_sections(data: dict, cls: type, path: str = "") -> None:
    """Every section of ``cls`` present in ``data`` (``train``, ``data.synthetic``, ...) is a mapping; else a
    ``ConfigError`` naming its key path."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data or not dataclasses.is_dataclass(hints[f.name]):
            continue
        key, v = f"{path}{f.name}", data[f.name]
        if not isinstance(v, dict):
            raise ConfigError(f"{key}: expected a mapping (the {key} section), got {v!r}")
        _check_sections(v, hints[f.name], key + ".")


def set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    d = data
    for i, p in enumerate(parts[:-1]):
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: expected a mapping (a section of the config), got {d!r} "
                              f"(setting {key})")
    d[parts[-1]] = value


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def leaf_fields(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, type, default) of every scalar or list-of-scalar leaf: the CLI makes each a flag."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out.extend(leaf_fields(tp, name + "."))
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            continue  # lists of specs (tables) come from the YAML file
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append((name, tp, default))
    return out


