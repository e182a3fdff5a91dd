"""A drifting synthetic click stream: a rotating hot set and new ids at a set rate.

What this module owns: :class:`DriftingStream`, the input of the online-training tests and benchmarks
(managed ids, rolling profile, re-planning). :mod:`embedscale.data.synthetic` draws a fixed power law
over a fixed table; here the input moves, as click logs do (new users and items every day, a hot set
that moves within hours; OPER section 8 names re-planning under such drift as future work).
:func:`write_drift_dataset` writes batches as shards of raw 64-bit ids, the input of managed tables in
training (``specs.ManagedConfig``).

Definitions, per table (every table follows them with its own random streams):

* **Ids.** The ``j``-th id of a table (``j = 0, 1, ...``) is the raw 64-bit id
  ``splitmix64(j xor key_table)`` (a bijection: distinct ``j`` give distinct ids, scattered over the
  64-bit space as hashed production ids are). ``index`` below means ``j``.
* **Arrivals.** Before step 0 the table knows ``initial_ids`` ids; step ``s`` brings exactly
  ``new_ids_per_step`` new ones, indices ``U(s) .. U(s+1) - 1`` with
  ``U(s) = initial_ids + new_ids_per_step * s`` (:meth:`universe_size`). Each new id appears at one
  position of batch ``s`` (positions drawn without replacement): the first time it is ever seen.
* **Hot set.** Window ``w = s // rotate_every`` has a hot set of ``hot_ids`` indices drawn without
  replacement from the ids known at the window's start, ``[0, U(w * rotate_every))``, independently
  per window: every ``rotate_every`` steps the hot set rotates (:meth:`hot_set`).
* **Other positions** of batch ``s`` draw from the hot set with probability ``hot_share`` (uniformly
  within it) and otherwise uniformly over the known ids ``[0, U(s))``.
* **Teacher.** ``logit = bias + c_row * sum_t e_t(id_t) + c_dense * <w, dense> / |w|`` (``w`` fixed by
  the seed), where ``e_t(id)`` is hashed from ``(seed, table, id)`` (uniform with variance 1, never
  materialised), so a new id carries signal from its first appearance;
  ``label ~ Bernoulli(sigmoid(logit))``. The row
  and dense parts get the variance shares of ``synthetic.py`` (``SHARE_ROW``, ``SHARE_DENSE``) of a
  logit standard deviation ``LOGIT_STD``; ``bias = log(POSITIVE_RATE / (1 - POSITIVE_RATE))`` (the
  positive rate comes out near, not at, 25%).
* **Determinism.** Batch ``s`` depends only on ``(config, seed, s)``: any step can be drawn in any
  order.

Batches are one-hot (one id per table and sample) :class:`embedscale.data.shards.Columns` whose
sparse values are the raw ids (``int64``, two's complement of the 64-bit id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embedscale.data.shards import Columns, Manifest, ShardWriter, SparseFeatureInfo
from embedscale.data.synthetic import (LOGIT_STD, POSITIVE_RATE, SHARE_DENSE, SHARE_ROW, _mix,
                                       _splitmix64_int)
from embedscale.errors import ConfigError

_DRIFT, _IDS, _EFFECT, _HOT, _BATCH = 0xD21F, 0x1D5, 0xEFEC, 0x4075, 0xBA7C


@dataclass(frozen=True)
class DriftConfig:
    """Shape of a drifting stream (definitions in the module docstring).

    tables: table names (one one-hot sparse feature each, named as the table).
    initial_ids: ids each table knows before step 0.
    new_ids_per_step: new ids per table per step (0 = no arrivals).
    hot_ids: size of each table's hot set (at most ``initial_ids``).
    hot_share: probability that a position (other than a new id's) draws from the hot set.
    hot_alpha: Zipf exponent over the hot set's members, ranked in a seeded random order per window
        (0 = uniform, the original draw; real hot sets are skewed within themselves).
    rotate_every: K, steps per hot-set window.
    batch_size: samples per step (at least ``new_ids_per_step``).
    num_dense: dense features (standard normal).
    """

    tables: tuple[str, ...] = ("C1", "C2")
    initial_ids: int = 100_000
    new_ids_per_step: int = 16
    hot_ids: int = 1_000
    hot_share: float = 0.8
    hot_alpha: float = 0.0  # Zipf exponent over the hot set's members (0 = uniform, the original draw)
    rotate_every: int = 200
    batch_size: int = 1024
    num_dense: int = 0

    def validate(self) -> None:
        if not self.tables or len(set(self.tables)) != len(self.tables):
            raise ConfigError(f"drift stream: tables must be distinct names, got {list(self.tables)}")
        for name in ("initial_ids", "hot_ids", "rotate_every", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"drift stream: {name} must be >= 1, got {getattr(self, name)}")
        if self.new_ids_per_step < 0 or self.num_dense < 0:
            raise ConfigError(f"drift stream: new_ids_per_step ({self.new_ids_per_step}) and num_dense "
                              f"({self.num_dense}) must be >= 0")
        if self.hot_ids > self.initial_ids:
            raise ConfigError(f"drift stream: hot_ids {self.hot_ids} exceeds initial_ids {self.initial_ids}")
        if self.new_ids_per_step > self.batch_size:
            raise ConfigError(f"drift stream: new_ids_per_step {self.new_ids_per_step} exceeds batch_size "
                              f"{self.batch_size} (each new id takes one position of its step's batch)")
        if not (math.isfinite(self.hot_alpha) and self.hot_alpha >= 0.0):
            raise ConfigError(f"drift stream: hot_alpha must be a finite number >= 0, got {self.hot_alpha}")
        if not 0.0 <= self.hot_share <= 1.0:
            raise ConfigError(f"drift stream: hot_share must be in [0, 1], got {self.hot_share}")


class DriftingStream:
    """Batches of a drifting click stream, deterministic by ``(config, seed, step)``.

    Example::

        stream = DriftingStream(DriftConfig(tables=("user", "item"), rotate_every=200), seed=0)
        cols = stream.batch(0)                 # Columns: labels, dense, sparse "user"/"item" raw ids
        stream.hot_set("item", 3)              # the raw ids of item's hot set in window 3
    """

    def __init__(self, cfg: DriftConfig, seed: int = 0):
        cfg.validate()
        self.cfg = cfg
        self.seed = int(seed)
        # probability of each hot-set rank r = 1..hot_ids: r**-hot_alpha / sum (float64; used when hot_alpha > 0)
        w = np.arange(1, cfg.hot_ids + 1, dtype=np.float64) ** -cfg.hot_alpha
        self._hot_pmf = w / w.sum()
        base = _splitmix64_int((self.seed ^ _DRIFT) & ((1 << 64) - 1))
        self._id_key = [_splitmix64_int(base ^ _IDS ^ (t << 20)) for t in range(len(cfg.tables))]
        self._effect_key = [_splitmix64_int(base ^ _EFFECT ^ (t << 20)) for t in range(len(cfg.tables))]
        self._dense_w = np.random.default_rng([self.seed, _DRIFT, _EFFECT]).standard_normal(cfg.num_dense)
        T = len(cfg.tables)
        share_row = SHARE_ROW if cfg.num_dense else SHARE_ROW + SHARE_DENSE
        self._c_row = LOGIT_STD * math.sqrt(share_row / T)
        self._c_dense = LOGIT_STD * math.sqrt(SHARE_DENSE) / max(1.0, float(np.linalg.norm(self._dense_w))) \
            if cfg.num_dense else 0.0
        self._bias = math.log(POSITIVE_RATE / (1 - POSITIVE_RATE))

    def _t(self, table: str) -> int:
        try:
            return self.cfg.tables.index(table)
        except ValueError:
            raise ConfigError(f"drift stream has no table {table!r}; tables: {list(self.cfg.tables)}") from None

    @staticmethod
    def _check_step(step: int) -> None:
        if int(step) < 0:
            raise ConfigError(f"drift stream: step must be >= 0, got {step}")

    # -- the definitions ---------------------------------------------------------------------------
    def universe_size(self, step: int) -> int:
        """``U(step)``: ids known before batch ``step`` (the same for every table)."""
        self._check_step(step)
        return self.cfg.initial_ids + self.cfg.new_ids_per_step * int(step)

    def ids(self, table: str, index: np.ndarray) -> np.ndarray:
        """The raw 64-bit ids (as int64) of indices ``index`` of ``table``."""
        x = np.asarray(index, dtype=np.int64).astype(np.uint64) ^ np.uint64(self._id_key[self._t(table)])
        return _mix(x).view(np.int64)

    def window(self, step: int) -> int:
        return int(step) // self.cfg.rotate_every

    def hot_indices(self, table: str, window: int) -> np.ndarray:
        """Indices of ``table``'s hot set in ``window`` (sorted)."""
        if int(window) < 0:
            raise ConfigError(f"drift stream: window must be >= 0, got {window}")
        known = self.universe_size(int(window) * self.cfg.rotate_every)
        rng = np.random.default_rng([self.seed, _DRIFT, _HOT, self._t(table), int(window)])
        return np.sort(rng.choice(known, size=self.cfg.hot_ids, replace=False)).astype(np.int64)

    def hot_set(self, table: str, window: int) -> np.ndarray:
        """Raw ids of ``table``'s hot set in ``window``."""
        return self.ids(table, self.hot_indices(table, window))

    def new_indices(self, step: int) -> np.ndarray:
        """Indices of the ids that arrive at ``step`` (every table)."""
        return np.arange(self.universe_size(step), self.universe_size(step + 1), dtype=np.int64)

    def effect(self, table: str, ids: np.ndarray) -> np.ndarray:
        """``e_t(id)``: the teacher's effect of raw ids, uniform on ``[-sqrt 3, sqrt 3]`` (variance 1)."""
        x = np.asarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(self._effect_key[self._t(table)])
        u = (_mix(x) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return (2.0 * u - 1.0) * math.sqrt(3.0)

    # -- batches -----------------------------------------------------------------------------------
    def batch_indices(self, step: int) -> dict[str, np.ndarray]:
        """Per table, the id index of every sample of batch ``step``."""
        cfg = self.cfg
        U = self.universe_size(step)
        out = {}
        window = self.window(step)
        for t, name in enumerate(cfg.tables):
            rng = np.random.default_rng([self.seed, _DRIFT, _BATCH, int(step), t])
            hot = self.hot_indices(name, window)
            from_hot = rng.random(cfg.batch_size) < cfg.hot_share
            if cfg.hot_alpha > 0.0:
                # Zipf over the members in a seeded random order (heat not tied to row position)
                hot = hot[np.random.default_rng([self.seed, _DRIFT, _BATCH, window, t, 1]).permutation(cfg.hot_ids)]
                which = rng.choice(cfg.hot_ids, size=cfg.batch_size, p=self._hot_pmf)
            else:
                which = rng.integers(0, cfg.hot_ids, cfg.batch_size)
            idx = np.where(from_hot, hot[which],
                           rng.integers(0, U, cfg.batch_size))
            pos = rng.choice(cfg.batch_size, size=cfg.new_ids_per_step, replace=False)
            idx[pos] = rng.permutation(self.new_indices(step))
            out[name] = idx
        return out

    def batch_with_probability(self, step: int) -> tuple[Columns, np.ndarray]:
        """Batch ``step`` and the teacher's click probability of each sample."""
        cfg = self.cfg
        B = cfg.batch_size
        rng = np.random.default_rng([self.seed, _DRIFT, _BATCH, int(step), len(cfg.tables)])
        dense = rng.standard_normal((B, cfg.num_dense)).astype(np.float32)
        logit = np.full(B, self._bias)
        sparse = {}
        for name, idx in self.batch_indices(step).items():
            ids = self.ids(name, idx)
            logit += self._c_row * self.effect(name, ids)
            sparse[name] = (ids, np.ones(B, dtype=np.int64))
        if cfg.num_dense:
            logit += self._c_dense * (dense.astype(np.float64) @ self._dense_w)
        prob = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(B) < prob).astype(np.int8)
        return Columns(labels, dense, sparse), prob

    def batch(self, step: int) -> Columns:
        """Batch ``step``: labels int8 ``[B]``, dense float32 ``[B, num_dense]``, per table
        ``(raw ids int64 [B], lengths of ones)``."""
        return self.batch_with_probability(step)[0]


def write_drift_dataset(stream: DriftingStream, directory, steps: int, *, num_rows: int, first_step: int = 0,
                        shard_rows: int = 1_000_000) -> Manifest:
    """Batches ``first_step .. first_step + steps - 1`` of ``stream`` as a shard dataset (``data.shards``) whose
    sparse features (one per table) hold the *raw* 64-bit ids (int64), for managed tables (``specs.ManagedConfig``:
    ids are mapped to rows while training). ``num_rows``: the rows the manifest gives every feature (what a
    model's default tables get); a loader checks these ids only for a table that is not managed."""
    if int(steps) < 1 or int(num_rows) < 2:
        raise ConfigError(f"drift dataset: steps ({steps}) must be >= 1 and num_rows ({num_rows}) >= 2")
    cfg = stream.cfg
    dense_names = [f"I{i + 1}" for i in range(cfg.num_dense)]
    sparse = [SparseFeatureInfo(name, int(num_rows)) for name in cfg.tables]
    extra = {"generator": "drift_stream", "raw_ids": list(cfg.tables), "seed": stream.seed,
             "first_step": int(first_step), "steps": int(steps)}
    with ShardWriter(directory, dense_names, sparse, shard_rows=shard_rows, extra=extra) as w:
        for s in range(int(first_step), int(first_step) + int(steps)):
            cols = stream.batch(s)
            w.write(cols.labels, cols.dense, {name: cols.sparse[name][0] for name in cfg.tables})
    return w.manifest
