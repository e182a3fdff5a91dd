"""Synthetic Criteo-shaped click logs with power-law row access and a planted teacher model.

What this module owns: the generator behind ``data.source = synthetic``. It stands in for the
power-law datasets OPER evaluates on at scale (OPER section 5.1, "Syn_Small"/"Syn_Large", made with
FBGEMM's generator) and, unlike those, carries labels a model can learn, so training curves and AUC
mean something.

Shape. The presets ``criteo-kaggle`` and ``criteo-terabyte`` have 26 sparse features ``C1..C26``
whose tables have the cardinalities of ``specs.CRITEO_KAGGLE_ROWS`` / ``CRITEO_TERABYTE_ROWS`` and
13 dense features ``I1..I13``. ``SyntheticConfig.max_rows`` caps every cardinality (0 = no cap); the
named presets ``<preset>-small`` and ``<preset>-tiny`` cap at 100k and 10k rows (when ``max_rows`` is
also set, the smaller non-zero cap wins).

Row access (per table ``t`` with ``n`` rows and exponent ``s = alpha_t``). Every access draws a
popularity rank ``r`` from a power law on the finite support ``[0, n)``: the midpoint-rule Zipf

    P(r) = integral_{r+1/2}^{r+3/2} x^-s dx  /  integral_{1/2}^{n+1/2} x^-s dx   ~  (r+1)^-s,

which is the discrete Zipf law up to a head correction of a few percent, but has a closed-form CDF,
so it is sampled exactly by inverse CDF (vectorised, O(1) memory in ``n``, stable at ``s = 1`` and for
``s < 1`` through ``expm1``/``log1p``). The rank is mapped to a row id by the per-table bijection
``row = (a*r + b) mod n`` with ``gcd(a, n) = 1`` (``a``, ``b`` hashed from the seed and the table),
so hot rows are scattered over the table as in hashed real data. ``access_probability`` gives the
exact per-row probability of one access, the input of expected profiles and the planner.

Pooling factors. ``SyntheticConfig.pooling_factors[t]`` is the mean number of ids per sample of
feature ``t``. 1 is one-hot. For ``m > 1`` the bag length is ``1 + Poisson(m - 1)``: never empty and
with mean exactly ``m``. The ids of a bag are independent draws (a bag may repeat a row).

Teacher. ``logit = bias + c_dense * <w, standardised dense>
+ c_row * sum_f beta_f + c_pair * sum_{f<g} <v_f, v_g>``, where ``beta_f`` and ``v_f`` (dimension
``teacher_dim``) are the mean over the bag of per-row effects. A row's effects are hashed from
``(seed, table, row)`` (splitmix64; never materialised) and multiplied by its learnability
``m / (m + K)``, ``m`` = the row's expected accesses in ``REFERENCE_SAMPLES`` samples: the signal
lives on rows a model sees often enough to learn. ``K`` is ``SyntheticConfig.learnable_count``
(default ``LEARNABLE_COUNT`` = 2000: in a criteo-kaggle table of millions of rows only a few head rows
carry signal). A small ``K`` puts signal into the tail too (``K = 2``: a row read twice per 200k
samples, 20 times in 2M, carries half its effect; ``K = 0``: every row its whole effect), the teacher
the auto planner's quality benchmark asks for: a form that cannot tell tail rows apart (TT) then costs AUC. The three parts are scaled, on a fixed calibration
draw, to set shares of a logit standard deviation ``LOGIT_STD`` and the bias is solved for a
``POSITIVE_RATE`` of 25% (as in Criteo); the ceiling AUC (``roc_auc`` of the true probabilities) is
then about 0.78. The pairwise term is the FM/DLRM dot interaction, so a DLRM with 16-dimensional
embeddings can represent the teacher. ``label ~ Bernoulli(sigmoid(logit))``. Measured here: a plain
DLRM (dim 16, Adagrad, one epoch over 400k samples of criteo-kaggle capped at 100k rows) reaches an
eval AUC of about 0.73-0.74 against the 0.78 ceiling; dense and row effects are learnt almost fully,
the pairwise part slowest.

Determinism. Sample ``i`` comes from block ``i // BLOCK``, drawn by a generator seeded by
``(seed, block)``; a dataset of samples ``[first, first + n)`` is the same whatever the chunking or
shard size. The trainer takes train = ``[0, N)`` and eval = ``[N, N + M)`` from one stream.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedscale.data.shards import Columns, Manifest, ShardWriter, SparseFeatureInfo
from embedscale.errors import ConfigError, InputError
from embedscale.specs import CRITEO_KAGGLE_ROWS, CRITEO_TERABYTE_ROWS, SyntheticConfig, TableSpec, to_dict
from embedscale.data.metrics import logloss, roc_auc

GENERATOR_VERSION = 3  # bump when the stream for a given (cfg, seed) changes; recorded in manifest.extra
BLOCK = 1 << 16  # samples per generator block: the unit of determinism
PRESETS: dict[str, list[int]] = {"criteo-kaggle": CRITEO_KAGGLE_ROWS, "criteo-terabyte": CRITEO_TERABYTE_ROWS}
SCALES: dict[str, int] = {"small": 100_000, "tiny": 10_000}
MAX_TABLE_ROWS = (1 << 31) - 1  # keeps (a * r) and (a^-1 * row) inside int64

# Teacher calibration (see the module docstring).
POSITIVE_RATE = 0.25
LOGIT_STD = 1.2
SHARE_DENSE, SHARE_ROW, SHARE_PAIR = 0.3, 0.6, 0.1  # variance shares of the logit
REFERENCE_SAMPLES = 200_000
LEARNABLE_COUNT = 2000.0  # K: a row expected K times in REFERENCE_SAMPLES carries half its effect
CALIBRATION_SAMPLES = 1 << 15
TEACHER_AUC_MAX_SAMPLES = 20_000_000  # teacher_auc is exact over at most this many (the first) samples

_STREAM, _CALIB, _TEACHER, _TABLE = 0x5A11, 0xCA1B, 0x7EAC, 0x7AB1
_M64 = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    """splitmix64 of a Python int (scalar twin of ``_mix``)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic), in place."""
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def preset_rows(preset: str, max_rows: int = 0) -> list[int]:
    """Table cardinalities of a preset (``criteo-kaggle[-small|-tiny]``, ``criteo-terabyte[...]``),
    each capped at the preset's scale and at ``max_rows`` (0 = no cap)."""
    base, cap = preset, 0
    for suffix, rows in SCALES.items():
        if preset.endswith("-" + suffix):
            base, cap = preset[: -len(suffix) - 1], rows
    if base not in PRESETS:
        known = sorted(PRESETS) + [f"{p}-{s}" for p in sorted(PRESETS) for s in SCALES]
        raise ConfigError(f"synthetic preset {preset!r} is unknown; known: {', '.join(known)}")
    if max_rows < 0:
        raise ConfigError(f"synthetic.max_rows must be >= 0 (0 = no cap), got {max_rows}")
    caps = [c for c in (cap, max_rows) if c > 0]
    limit = min(caps) if caps else None
    return [min(n, limit) if limit else n for n in PRESETS[base]]


@dataclass(frozen=True)
class _Table:
    name: str
    num_rows: int
    alpha: float
    pooling_factor: int
    mult: int  # a of row = (a*r + b) mod n
    shift: int  # b
    inv: int  # a^-1 mod n
    key: int  # 64-bit hash key of (seed, table) for the teacher's row effects


class SyntheticGenerator:
    """Deterministic Criteo-shaped sample stream (see the module docstring for the model).

    Args:
        cfg: the ``SyntheticConfig`` (preset, row cap, exponents, pooling factors, teacher_dim).
        seed: non-negative seed; the stream is a function of ``(cfg, seed)`` only.
        embedding_dim: ``dim`` of the ``TableSpec`` list returned by ``tables``.

    Example::

        gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-tiny"), seed=0)
        cols = gen.sample(0, 1024)          # Columns: labels, dense [1024, 13], sparse C1..C26
        p = gen.access_probability(2)       # exact per-row access probabilities of table C3
    """

    def __init__(self, cfg: SyntheticConfig, seed: int = 0, embedding_dim: int = 16):
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"synthetic seed must be a non-negative integer, got {seed!r}")
        self.cfg = cfg
        self.seed = int(seed)
        self.embedding_dim = int(embedding_dim)
        rows = preset_rows(cfg.preset, cfg.max_rows)
        T = len(rows)
        if cfg.alphas and len(cfg.alphas) != T:
            raise ConfigError(f"synthetic.alphas has {len(cfg.alphas)} entries for {T} tables of {cfg.preset!r}")
        alphas = [float(a) for a in (cfg.alphas or [cfg.alpha] * T)]
        for t, a in enumerate(alphas):
            if not (math.isfinite(a) and a >= 0):
                raise ConfigError(f"synthetic alpha of table C{t + 1} must be finite and >= 0, got {a}")
        if cfg.pooling_factors and len(cfg.pooling_factors) != T:
            raise ConfigError(
                f"synthetic.pooling_factors has {len(cfg.pooling_factors)} entries for {T} tables of {cfg.preset!r}")
        pfs = [int(p) for p in (cfg.pooling_factors or [1] * T)]
        for t, p in enumerate(pfs):
            if p < 1:
                raise ConfigError(f"synthetic pooling factor of table C{t + 1} must be >= 1, got {p}")
        if cfg.num_dense < 0:
            raise ConfigError(f"synthetic.num_dense must be >= 0, got {cfg.num_dense}")
        if cfg.teacher_dim < 0:
            raise ConfigError(f"synthetic.teacher_dim must be >= 0, got {cfg.teacher_dim}")
        learnable = float(cfg.learnable_count)
        if not (math.isfinite(learnable) and learnable >= 0):
            raise ConfigError(f"synthetic.learnable_count must be finite and >= 0, got {cfg.learnable_count}")
        self.learnable_count = learnable
        self._tables = [self._make_table(t, n, alphas[t], pfs[t]) for t, n in enumerate(rows)]
        self.num_dense = int(cfg.num_dense)
        self.teacher_dim = int(cfg.teacher_dim)
        self._words = (self.teacher_dim + 1 + 3) // 4  # 64-bit hashes per row: four 16-bit uniforms each
        self._fit_teacher()

    # -- tables and bijections -----------------------------------------------------------------
    def _make_table(self, t: int, n: int, alpha: float, pf: int) -> _Table:
        name = f"C{t + 1}"
        if n > MAX_TABLE_ROWS:
            raise ConfigError(f"synthetic table {name}: {n} rows exceeds the supported {MAX_TABLE_ROWS}")
        h = _splitmix64_int(_splitmix64_int((self.seed << 20) ^ (_TABLE << 8) ^ t))
        a, b = 1, 0
        if n > 2:
            a = 2 + h % (n - 2)
            while math.gcd(a, n) != 1:
                a = a + 1 if a + 1 < n else 2
            b = (h >> 32) % n
        inv = pow(a, -1, n) if n > 1 else 0
        return _Table(name, n, alpha, pf, a, b, inv, _splitmix64_int(h ^ 0xD1B54A32D192ED03))

    @property
    def feature_names(self) -> list[str]:
        return [t.name for t in self._tables]

    @property
    def dense_names(self) -> list[str]:
        return [f"I{j + 1}" for j in range(self.num_dense)]

    @property
    def num_rows(self) -> list[int]:
        return [t.num_rows for t in self._tables]

    @property
    def alphas(self) -> list[float]:
        return [t.alpha for t in self._tables]

    @property
    def pooling_factors(self) -> list[int]:
        return [t.pooling_factor for t in self._tables]

    @property
    def tables(self) -> list[TableSpec]:
        """One ``TableSpec`` per sparse feature (named as the feature), ``dim = embedding_dim``."""
        return self.table_specs(self.embedding_dim)

    def table_specs(self, dim: int = 16) -> list[TableSpec]:
        return [TableSpec(name=t.name, num_rows=t.num_rows, dim=dim) for t in self._tables]

    def sparse_info(self) -> list[SparseFeatureInfo]:
        return [SparseFeatureInfo(t.name, t.num_rows, t.pooling_factor > 1) for t in self._tables]

    def rank_to_row(self, table_idx: int, ranks: np.ndarray) -> np.ndarray:
        """Popularity rank -> row id, ``(a*r + b) mod n`` (a permutation of ``[0, n)``)."""
        t = self._tables[table_idx]
        return (np.asarray(ranks, dtype=np.int64) * t.mult + t.shift) % t.num_rows

    def row_to_rank(self, table_idx: int, rows: np.ndarray) -> np.ndarray:
        """Row id -> popularity rank, the inverse of ``rank_to_row``."""
        t = self._tables[table_idx]
        return ((np.asarray(rows, dtype=np.int64) - t.shift) % t.num_rows) * t.inv % t.num_rows

    # -- the power law ---------------------------------------------------------------------------
    @staticmethod
    def _rank_mass(ranks: np.ndarray, n: int, s: float) -> np.ndarray:
        """Exact P(rank) of the midpoint-rule Zipf law on ``[0, n)`` with exponent ``s``."""
        r = np.asarray(ranks, dtype=np.float64)
        t = 1.0 - s
        log_span = math.log(2 * n + 1)  # log((n + 1/2) / (1/2))
        if t == 0.0:
            return np.log1p(2.0 / (2.0 * r + 1.0)) / log_span
        return np.exp(t * np.log(2.0 * r + 1.0)) * np.expm1(t * np.log1p(2.0 / (2.0 * r + 1.0))) / math.expm1(
            t * log_span)

    @staticmethod
    def _draw_ranks(u: np.ndarray, n: int, s: float) -> np.ndarray:
        """Inverse CDF of the midpoint-rule Zipf law: uniforms in [0, 1) -> ranks in [0, n)."""
        t = 1.0 - s
        log_span = math.log(2 * n + 1)
        if t == 0.0:
            y = u * log_span
        else:
            y = np.log1p(u * math.expm1(t * log_span)) / t
        ranks = np.floor(0.5 * np.expm1(y)).astype(np.int64)
        # u -> 1 can round onto the upper edge of the support
        return np.minimum(ranks, n - 1, out=ranks)

    def access_probability(self, table_idx: int) -> np.ndarray:
        """Exact probability, per row id, that one access of table ``table_idx`` reads that row (float64,
        sums to 1). Built on demand in chunks: memory is the output only."""
        t = self._tables[table_idx]
        out = np.empty(t.num_rows, dtype=np.float64)
        step = 1 << 22
        for lo in range(0, t.num_rows, step):
            ranks = np.arange(lo, min(lo + step, t.num_rows), dtype=np.int64)
            out[self.rank_to_row(table_idx, ranks)] = self._rank_mass(ranks, t.num_rows, t.alpha)
        return out

    # -- the teacher -----------------------------------------------------------------------------
    def _row_effects(self, table_idx: int, rows: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Per-access teacher effects ``[m, 1 + teacher_dim]`` (bias, latent): hashed unit-variance
        uniforms times the row's learnability ``m / (m + K)``."""
        t = self._tables[table_idx]
        W = self._words
        base = rows.astype(np.uint64) * np.uint64(W)
        base += np.uint64(t.key)
        eff = np.empty((rows.size, self.teacher_dim + 1), dtype=np.float64)
        for w in range(W):
            bits = _mix(base + np.uint64(w))
            for k in range(min(4, self.teacher_dim + 1 - 4 * w)):  # four 16-bit uniforms per hash
                eff[:, 4 * w + k] = (bits >> np.uint64(16 * k)) & np.uint64(0xFFFF)
        eff += 0.5
        eff *= 2.0 * math.sqrt(3.0) / 65536.0
        eff -= math.sqrt(3.0)
        seen = self._rank_mass(ranks, t.num_rows, t.alpha) * (t.pooling_factor * REFERENCE_SAMPLES)
        eff *= (seen / (seen + self.learnable_count))[:, None]
        return eff

    def _raw_parts(self, dense: np.ndarray, sparse_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
        """Unscaled teacher parts (dense linear, sum of row biases, pairwise dot) per sample."""
        B = dense.shape[0]
        d = self.teacher_dim
        dense_part = np.zeros(B) if self.num_dense == 0 else (
            (dense.astype(np.float64) - self._dense_mu) / self._dense_sd) @ self._dense_w
        row_part = np.zeros(B)
        vsum = np.zeros((B, d))
        vsq = np.zeros(B)
        for ti, (rows, ranks, lengths) in enumerate(sparse_rows):
            eff = self._row_effects(ti, rows, ranks)
            if rows.size != B:  # multi-hot: mean over the bag
                starts = np.zeros(B, dtype=np.int64)
                np.cumsum(lengths[:-1], out=starts[1:])
                eff = np.add.reduceat(eff, starts, axis=0) / lengths[:, None]
            row_part += eff[:, 0]
            v = eff[:, 1:]
            vsum += v
            vsq += np.einsum("ij,ij->i", v, v)
        pair_part = 0.5 * (np.einsum("ij,ij->i", vsum, vsum) - vsq)
        return dense_part, row_part, pair_part

    def _logit_from_parts(self, parts) -> np.ndarray:
        d, r, p = parts
        return self._bias + self._coef[0] * d + self._coef[1] * r + self._coef[2] * p

    def _fit_teacher(self) -> None:
        rng = np.random.default_rng([self.seed, _TEACHER])
        D = self.num_dense
        # dense counts: floor(exp(N(mu_j, sigma_j))), stored as log(1 + count) like preprocessed Criteo
        self._dense_loc = rng.uniform(0.0, 3.0, D)
        self._dense_scale = rng.uniform(0.5, 1.5, D)
        self._dense_w = rng.standard_normal(D) / math.sqrt(max(D, 1))
        self._dense_mu = np.zeros(D)
        self._dense_sd = np.ones(D)
        dense, sparse, _ = self._draw([self.seed, _CALIB], CALIBRATION_SAMPLES)
        if D:
            self._dense_mu = dense.astype(np.float64).mean(0)
            sd = dense.astype(np.float64).std(0)
            self._dense_sd = np.where(sd > 0, sd, 1.0)
        parts = self._raw_parts(dense, sparse)
        coef = []
        for share, part in zip((SHARE_DENSE, SHARE_ROW, SHARE_PAIR), parts):
            sd = float(np.std(part))
            coef.append(math.sqrt(share) * LOGIT_STD / sd if sd > 0 else 0.0)
        self._coef = np.array(coef)
        self._bias = 0.0
        z = self._logit_from_parts(parts)
        lo, hi = -30.0, 30.0  # mean sigmoid(b + z) is increasing in b: bisect for the positive rate
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(mid + z)))) < POSITIVE_RATE:
                lo = mid
            else:
                hi = mid
        self._bias = 0.5 * (lo + hi)

    def teacher_logit(self, columns: Columns) -> np.ndarray:
        """The teacher's logit of every sample in ``columns`` (a function of the features only)."""
        n = columns.rows
        if columns.dense.shape != (n, self.num_dense):
            raise InputError(f"teacher_logit: dense of shape {columns.dense.shape}, expected ({n}, {self.num_dense})")
        sparse = []
        for ti, t in enumerate(self._tables):
            if t.name not in columns.sparse:
                raise InputError(f"teacher_logit: sparse feature {t.name!r} is missing")
            values, lengths = columns.sparse[t.name]
            values = np.asarray(values, dtype=np.int64)
            lengths = np.asarray(lengths, dtype=np.int64)
            if lengths.size != n or int(lengths.sum()) != values.size or (n and int(lengths.min()) < 1):
                raise InputError(f"teacher_logit: feature {t.name!r}: lengths do not describe {values.size} ids "
                                 f"in {n} non-empty bags")
            if values.size and (int(values.min()) < 0 or int(values.max()) >= t.num_rows):
                bad = values[(values < 0) | (values >= t.num_rows)][0]
                raise InputError(f"teacher_logit: feature {t.name!r}: row id {bad} outside table of {t.num_rows} rows")
            sparse.append((values, self.row_to_rank(ti, values), lengths))
        return self._logit_from_parts(self._raw_parts(columns.dense, sparse))

    def teacher_probability(self, columns: Columns) -> np.ndarray:
        """The teacher's click probability ``sigmoid(logit)`` of every sample in ``columns``."""
        return 1.0 / (1.0 + np.exp(-self.teacher_logit(columns)))

    # -- sampling --------------------------------------------------------------------------------
    def _draw(self, key: list[int], B: int):
        """Features of ``B`` samples from the streams keyed ``key + [k]``: dense float32 ``[B, D]``,
        per table ``(rows, ranks, lengths)``, and the label uniforms."""
        D = self.num_dense
        rng = np.random.default_rng(key + [0])
        if D:
            counts = np.floor(np.exp(self._dense_loc + self._dense_scale * rng.standard_normal((B, D))))
            dense = np.log1p(counts).astype(np.float32)
        else:
            dense = np.zeros((B, 0), dtype=np.float32)
        label_u = np.random.default_rng(key + [1]).random(B)
        sparse = []
        for ti, t in enumerate(self._tables):
            trng = np.random.default_rng(key + [2 + ti])
            if t.pooling_factor > 1:
                lengths = 1 + trng.poisson(t.pooling_factor - 1, B).astype(np.int64)
            else:
                lengths = np.ones(B, dtype=np.int64)
            m = B if t.pooling_factor == 1 else int(lengths.sum())
            ranks = self._draw_ranks(trng.random(m), t.num_rows, t.alpha)
            sparse.append((self.rank_to_row(ti, ranks), ranks, lengths))
        return dense, sparse, label_u

    def _block(self, block: int) -> tuple[Columns, np.ndarray]:
        dense, sparse, label_u = self._draw([self.seed, _STREAM, block], BLOCK)
        logit = self._logit_from_parts(self._raw_parts(dense, sparse))
        prob = 1.0 / (1.0 + np.exp(-logit))
        labels = (label_u < prob).astype(np.int8)
        cols = Columns(labels, dense, {t.name: (rows, lengths) for t, (rows, _, lengths) in zip(self._tables, sparse)})
        return cols, prob

    def iter_blocks(self, first: int, n: int):
        """Yield ``(Columns, teacher probabilities)`` covering samples ``[first, first + n)`` in order,
        one generator block (or the part of it in range) at a time."""
        if first < 0 or n < 0:
            raise ConfigError(f"synthetic samples [{first}, {first + n}) must be non-negative")
        end = first + n
        b = first // BLOCK
        while b * BLOCK < end:
            lo, hi = max(first, b * BLOCK) - b * BLOCK, min(end, (b + 1) * BLOCK) - b * BLOCK
            cols, prob = self._block(b)
            if lo > 0 or hi < BLOCK:
                cols, prob = _slice_columns(cols, lo, hi), prob[lo:hi]
            yield cols, prob
            b += 1

    def sample(self, first: int, n: int) -> Columns:
        """Samples ``[first, first + n)`` of the stream: labels int8 ``[n]``, dense float32 ``[n, D]``,
        sparse ``name -> (values int64, lengths int64 [n])``."""
        return self.sample_with_probability(first, n)[0]

    def sample_with_probability(self, first: int, n: int) -> tuple[Columns, np.ndarray]:
        """``sample`` plus the teacher's true click probability of each sample."""
        parts = list(self.iter_blocks(first, n))
        if not parts:
            empty = {t.name: (np.zeros(0, np.int64), np.zeros(0, np.int64)) for t in self._tables}
            return Columns(np.zeros(0, np.int8), np.zeros((0, self.num_dense), np.float32), empty), np.zeros(0)
        if len(parts) == 1:
            return parts[0]
        cols = [c for c, _ in parts]
        sparse = {k: (np.concatenate([c.sparse[k][0] for c in cols]), np.concatenate([c.sparse[k][1] for c in cols]))
                  for k in cols[0].sparse}
        return (Columns(np.concatenate([c.labels for c in cols]), np.concatenate([c.dense for c in cols]), sparse),
                np.concatenate([p for _, p in parts]))


def _slice_columns(cols: Columns, lo: int, hi: int) -> Columns:
    sparse = {}
    for k, (values, lengths) in cols.sparse.items():
        if values.size == lengths.size:  # one id per sample
            sparse[k] = (values[lo:hi], lengths[lo:hi])
        else:
            offs = np.zeros(lengths.size + 1, dtype=np.int64)
            np.cumsum(lengths, out=offs[1:])
            sparse[k] = (values[offs[lo]:offs[hi]], lengths[lo:hi])
    return Columns(cols.labels[lo:hi], cols.dense[lo:hi], sparse)


def generate_dataset(cfg: SyntheticConfig, out_dir: str | os.PathLike, num_samples: int, *, seed: int = 0,
                     first_sample: int = 0, shard_rows: int = 1_000_000, progress: bool = True) -> Manifest:
    """Write samples ``[first_sample, first_sample + num_samples)`` of the stream ``(cfg, seed)`` as a
    shard directory (sparse ``C1..C26``, dense ``I1..I13``), one generator block in memory at a time.

    ``manifest.extra`` records the generator config and the teacher's ceiling on these samples:
    ``teacher_auc`` (``roc_auc`` of the true probabilities against the drawn labels, exact over the
    first ``teacher_auc_samples`` samples, at most ``TEACHER_AUC_MAX_SAMPLES``; absent when those hold
    one class only) and ``teacher_logloss`` (over all samples).
    """
    from tqdm import tqdm

    if num_samples <= 0:
        raise ConfigError(f"generate_dataset: num_samples must be positive, got {num_samples}")
    gen = SyntheticGenerator(cfg, seed)
    extra: dict[str, Any] = {
        "generator": "embedscale.synthetic",
        "generator_version": GENERATOR_VERSION,
        "preset": cfg.preset,
        "seed": int(seed),
        "first_sample": int(first_sample),
        "num_samples": int(num_samples),
        "block": BLOCK,
        "synthetic": to_dict(cfg),
        "num_rows": gen.num_rows,
        "alphas": gen.alphas,
        "pooling_factors": gen.pooling_factors,
    }
    auc_n = min(num_samples, TEACHER_AUC_MAX_SAMPLES)
    auc_labels = np.empty(auc_n, dtype=np.int8)
    auc_probs = np.empty(auc_n, dtype=np.float64)
    done, loss_sum = 0, 0.0
    with ShardWriter(out_dir, gen.dense_names, gen.sparse_info(), shard_rows=shard_rows, extra=extra) as writer, \
            tqdm(total=num_samples, desc="synthetic", unit="sample", unit_scale=True, disable=not progress) as bar:
        for cols, prob in gen.iter_blocks(first_sample, num_samples):
            m = cols.rows
            sparse = {info.name: (cols.sparse[info.name] if info.multi_hot else cols.sparse[info.name][0])
                      for info in writer.manifest.sparse}
            writer.write(cols.labels, cols.dense, sparse)
            take = max(0, min(m, auc_n - done))
            auc_labels[done:done + take] = cols.labels[:take]
            auc_probs[done:done + take] = prob[:take]
            loss_sum += logloss(cols.labels, prob) * m
            done += m
            bar.update(m)
        auc = roc_auc(auc_labels, auc_probs)
        if not math.isnan(auc):  # undefined when the labels hold one class only: the key is left out
            writer.manifest.extra["teacher_auc"] = auc
            writer.manifest.extra["teacher_auc_samples"] = auc_n
        writer.manifest.extra["teacher_logloss"] = loss_sum / done
    return writer.manifest
