"""Tests of the synthetic generator: power law, bijection, determinism, teacher, multi-hot, datasets."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from scipy import stats

from embedscale.data.shards import Manifest, iter_shards
from embedscale.data.synthetic import BLOCK, SyntheticGenerator, generate_dataset, preset_rows
from embedscale.errors import ConfigError, InputError
from embedscale.specs import CRITEO_KAGGLE_ROWS, CRITEO_TERABYTE_ROWS, SyntheticConfig
from embedscale.train.metrics import logloss, roc_auc


def midpoint_zipf_reference(n: int, s: float) -> np.ndarray:
    """P(r) proportional to the integral of x^-s over [r + 1/2, r + 3/2), from the plain antiderivative."""
    edges = np.arange(n + 1, dtype=np.float64) + 0.5
    prim = np.log(edges) if s == 1.0 else edges ** (1.0 - s) / (1.0 - s)
    mass = np.diff(prim)
    return mass / mass.sum()


def pooled_chisquare(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value after merging bins with expected count < 5 into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("s", [0.0, 0.6, 1.0, 1.0 + 1e-9, 1.3])
def test_zipf_sampler_matches_exact_probabilities(s):
    n = 200
    exact = SyntheticGenerator._rank_mass(np.arange(n), n, s)
    np.testing.assert_allclose(exact, midpoint_zipf_reference(n, s) if abs(s - 1) > 1e-6
                               else midpoint_zipf_reference(n, 1.0), rtol=1e-6)
    assert math.isclose(exact.sum(), 1.0, rel_tol=1e-12)
    u = np.random.default_rng(1).random(400_000)
    ranks = SyntheticGenerator._draw_ranks(u, n, s)
    assert ranks.min() >= 0 and ranks.max() < n
    observed = np.bincount(ranks, minlength=n)
    assert pooled_chisquare(observed, exact * u.size) > 1e-4


def test_zipf_head_is_a_power_law():
    n = 10_000_000
    p = SyntheticGenerator._rank_mass(np.array([99, 999, 9999]), n, 1.1)
    # consecutive decades of rank differ by 10^-1.1 (up to the midpoint-rule correction)
    np.testing.assert_allclose(p[1:] / p[:-1], 10 ** -1.1, rtol=1e-3)
    # upper edge of the uniforms still lands inside the support
    assert SyntheticGenerator._draw_ranks(np.array([np.nextafter(1.0, 0.0)]), n, 1.1)[0] == n - 1


def test_bijection_is_a_permutation_and_inverse():
    cfg = SyntheticConfig(preset="criteo-kaggle", max_rows=5000)
    gen = SyntheticGenerator(cfg, seed=3)
    for t, n in enumerate(gen.num_rows):
        rows = gen.rank_to_row(t, np.arange(n))
        assert np.array_equal(np.sort(rows), np.arange(n)), f"table {t} is not a permutation"
        assert np.array_equal(gen.row_to_rank(t, rows), np.arange(n))
    big = [t for t, n in enumerate(gen.num_rows) if n == 5000]
    # the hottest rows are scattered, not all at id 0
    assert any(gen.rank_to_row(t, np.arange(5)).tolist() != list(range(5)) for t in big)


def test_access_probability_matches_sampled_frequencies():
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-tiny", alpha=1.05), seed=7)
    t = gen.feature_names.index("C2")  # 583 rows
    p = gen.access_probability(t)
    assert p.shape == (583,) and math.isclose(p.sum(), 1.0, rel_tol=1e-9)
    cols = gen.sample(0, 2 * BLOCK)
    counts = Counter(cols.sparse["C2"][0].tolist())
    observed = np.array([counts.get(r, 0) for r in range(583)], dtype=np.float64)
    assert pooled_chisquare(observed, p * cols.rows) > 1e-4
    # hottest row by probability is the rank-0 row of the bijection
    assert int(np.argmax(p)) == int(gen.rank_to_row(t, np.array([0]))[0])


def _assert_columns_equal(a, b):
    assert np.array_equal(a.labels, b.labels)
    assert np.array_equal(a.dense, b.dense)
    assert a.sparse.keys() == b.sparse.keys()
    for k in a.sparse:
        assert np.array_equal(a.sparse[k][0], b.sparse[k][0]), k
        assert np.array_equal(a.sparse[k][1], b.sparse[k][1]), k


def test_determinism_and_chunking_invariance():
    cfg = SyntheticConfig(preset="criteo-kaggle-tiny", pooling_factors=[1] * 24 + [3, 6])
    gen = SyntheticGenerator(cfg, seed=11)
    whole = gen.sample(0, 1000)
    a, b = gen.sample(0, 300), gen.sample(300, 700)
    joined = type(whole)(np.concatenate([a.labels, b.labels]), np.concatenate([a.dense, b.dense]),
                         {k: (np.concatenate([a.sparse[k][0], b.sparse[k][0]]),
                              np.concatenate([a.sparse[k][1], b.sparse[k][1]])) for k in a.sparse})
    _assert_columns_equal(whole, joined)
    _assert_columns_equal(whole, SyntheticGenerator(cfg, seed=11).sample(0, 1000))
    # across a block boundary
    span = gen.sample(BLOCK - 50, 100)
    head, tail = gen.sample(BLOCK - 50, 50), gen.sample(BLOCK, 50)
    assert np.array_equal(span.labels, np.concatenate([head.labels, tail.labels]))
    for k in ("C1", "C26"):
        assert np.array_equal(span.sparse[k][0], np.concatenate([head.sparse[k][0], tail.sparse[k][0]]))
    other = SyntheticGenerator(cfg, seed=12).sample(0, 1000)
    assert not np.array_equal(other.sparse["C3"][0], whole.sparse["C3"][0])


def test_multi_hot_lengths_have_the_pooling_factor_as_mean():
    pfs = [1] * 22 + [2, 4, 8, 20]
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-tiny", pooling_factors=pfs), seed=0)
    cols = gen.sample(0, BLOCK)
    for name, pf in zip(gen.feature_names, pfs):
        values, lengths = cols.sparse[name]
        assert lengths.min() >= 1 and lengths.sum() == values.size
        assert abs(lengths.mean() - pf) < 0.02 * pf + 0.01, (name, lengths.mean(), pf)
        if pf > 1:  # 1 + Poisson(pf - 1): variance pf - 1
            assert abs(lengths.var() - (pf - 1)) < 0.1 * (pf - 1)
    assert [i.multi_hot for i in gen.sparse_info()] == [pf > 1 for pf in pfs]


def test_teacher_is_a_function_of_the_features():
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-tiny", pooling_factors=[2] * 26), seed=5)
    cols, prob = gen.sample_with_probability(100, 2000)
    np.testing.assert_allclose(gen.teacher_probability(cols), prob, rtol=1e-12)
    values, lengths = cols.sparse["C4"]
    bad = values.copy()
    bad[3] = gen.num_rows[3]
    cols.sparse["C4"] = (bad, lengths)
    with pytest.raises(InputError, match="C4"):
        gen.teacher_logit(cols)


def test_generate_dataset_records_teacher_ceiling(tmp_path: Path):
    cfg = SyntheticConfig(preset="criteo-kaggle-tiny", pooling_factors=[1] * 25 + [3])
    gen = SyntheticGenerator(cfg, seed=2)
    first, n = 17, 70_000
    m = generate_dataset(cfg, tmp_path / "ds", n, seed=2, first_sample=first, shard_rows=30_000, progress=False)
    loaded = Manifest.load(tmp_path / "ds")
    assert [s["rows"] for s in loaded.shards] == [30_000, 30_000, 10_000]
    assert loaded.sparse_names == [f"C{i}" for i in range(1, 27)]
    assert loaded.dense_names == [f"I{i}" for i in range(1, 14)]
    assert [s.num_rows for s in loaded.sparse] == gen.num_rows
    # read the shards back with pyarrow directly and recompute the ceiling from the stored features
    labels, probs = [], []
    for cols in iter_shards(tmp_path / "ds"):
        labels.append(cols.labels)
        probs.append(gen.teacher_probability(cols))
    y, p = np.concatenate(labels), np.concatenate(probs)
    raw = ipc.open_file(pa.memory_map(str(tmp_path / "ds" / "shard-00000.arrow"))).read_all()
    assert np.array_equal(raw.column("C1").to_numpy(), gen.sample(first, 30_000).sparse["C1"][0])
    assert math.isclose(m.extra["teacher_auc"], roc_auc(y, p), rel_tol=1e-9)
    assert math.isclose(loaded.extra["teacher_logloss"], logloss(y, p), rel_tol=1e-6)
    assert 0.7 < loaded.extra["teacher_auc"] < 0.85
    assert 0.2 < y.mean() < 0.3
    assert loaded.positives == int(y.sum())
    # the ceiling: a constant predictor is worse than the teacher
    assert loaded.extra["teacher_logloss"] < logloss(y, np.full(y.size, y.mean()))


def test_presets_and_config_errors():
    assert preset_rows("criteo-kaggle", 0) == CRITEO_KAGGLE_ROWS
    assert preset_rows("criteo-terabyte", 0) == CRITEO_TERABYTE_ROWS
    assert preset_rows("criteo-terabyte-tiny", 0) == [min(n, 10_000) for n in CRITEO_TERABYTE_ROWS]
    assert preset_rows("criteo-kaggle-small", 5000) == [min(n, 5000) for n in CRITEO_KAGGLE_ROWS]
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=1000), seed=0, embedding_dim=32)
    assert [t.num_rows for t in gen.tables] == [min(n, 1000) for n in CRITEO_KAGGLE_ROWS]
    assert {t.dim for t in gen.tables} == {32}
    with pytest.raises(ConfigError, match="criteo-kagle"):
        SyntheticGenerator(SyntheticConfig(preset="criteo-kagle"), seed=0)
    with pytest.raises(ConfigError, match="alphas"):
        SyntheticGenerator(SyntheticConfig(alphas=[1.0, 1.2]), seed=0)
    with pytest.raises(ConfigError, match="C3"):
        SyntheticGenerator(SyntheticConfig(pooling_factors=[1, 1, 0] + [1] * 23), seed=0)
    with pytest.raises(ConfigError, match="seed"):
        SyntheticGenerator(SyntheticConfig(), seed=-1)


def test_default_teacher_is_unchanged_by_the_learnable_count_option():
    """The stream of the default config is the one generated before ``learnable_count`` existed (figures taken
    from that code: preset criteo-kaggle-tiny, seed 3, the first 2000 samples)."""
    g = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-tiny"), seed=3)
    cols, prob = g.sample_with_probability(0, 2000)
    assert float(prob.sum()) == pytest.approx(499.8024642738062, rel=1e-12)
    assert int(cols.labels.sum()) == 500
    assert float(g.teacher_logit(cols)[:5].sum()) == pytest.approx(-3.2994692705199653, rel=1e-12)


@pytest.mark.parametrize("k", [0.0, 2.0, 2000.0])
def test_learnable_count_scales_every_rows_effect_by_its_learnability(k):
    """A row's teacher effects are its whole (K = 0) effects times ``m / (m + K)``, ``m`` its expected accesses
    in 200k samples from the midpoint-Zipf reference; the features are the same whatever K; small K puts
    signal on tail rows (the teacher the auto planner's quality benchmark asks for)."""
    cfg = SyntheticConfig(preset="criteo-kaggle-tiny", alpha=1.1)
    full = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-tiny", alpha=1.1, learnable_count=0.0), seed=1)
    g = SyntheticGenerator(SyntheticConfig(**{**cfg.__dict__, "learnable_count": k}), seed=1)
    t = 2  # C3, 10k rows at this scale
    n = g.num_rows[t]
    ranks = np.array([0, 1, 10, 100, 1000, n - 1])
    rows = g.rank_to_row(t, ranks)
    m = midpoint_zipf_reference(n, 1.1)[ranks] * 200_000
    want = full._row_effects(t, rows, ranks) * (m / (m + k))[:, None]
    np.testing.assert_allclose(g._row_effects(t, rows, ranks), want, rtol=1e-9)
    a, b = full.sample(0, 500), g.sample(0, 500)
    assert all(np.array_equal(a.sparse[f][0], b.sparse[f][0]) for f in a.sparse)
    if k == 2.0:  # rank 1000 (about 15 expected accesses per 200k samples) keeps most of its effect
        assert m[4] / (m[4] + k) > 0.85
    if k == 2000.0:  # ... and almost none under the default teacher
        assert m[4] / (m[4] + k) < 0.01
    with pytest.raises(ConfigError, match="learnable_count"):
        SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-tiny", learnable_count=-1.0))
