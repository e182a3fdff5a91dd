"""The drifting synthetic stream: rotation and arrival rates against their definitions."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from embedscale.data.drift_stream import DriftConfig, DriftingStream
from embedscale.data.metrics import roc_auc
from embedscale.errors import ConfigError

CFG = DriftConfig(tables=("u", "i"), initial_ids=300, new_ids_per_step=3, hot_ids=10, hot_share=0.8,
                  rotate_every=5, batch_size=64, num_dense=2)


def test_deterministic_by_seed_and_step():
    a, b = DriftingStream(CFG, seed=7), DriftingStream(CFG, seed=7)
    late = a.batch(12)
    for s in (3, 12, 0):  # any order
        x, y = a.batch(s), b.batch(s)
        assert np.array_equal(x.labels, y.labels) and np.array_equal(x.dense, y.dense)
        for n in CFG.tables:
            assert np.array_equal(x.sparse[n][0], y.sparse[n][0])
    assert np.array_equal(late.sparse["u"][0], b.batch(12).sparse["u"][0])
    other = DriftingStream(CFG, seed=8).batch(12)
    assert not np.array_equal(other.sparse["u"][0], late.sparse["u"][0])


def test_ids_are_distinct_raw_64_bit():
    s = DriftingStream(CFG, seed=0)
    ids = s.ids("u", np.arange(100_000))
    assert np.unique(ids).size == ids.size
    assert ids.min() < -(2**60) and ids.max() > 2**60  # spread over the 64-bit space, negatives included
    assert not np.array_equal(s.ids("u", np.arange(10)), s.ids("i", np.arange(10)))


def test_arrivals_at_the_set_rate():
    s = DriftingStream(CFG, seed=1)
    for n in CFG.tables:
        seen = set(s.ids(n, np.arange(CFG.initial_ids)).tolist())
        for step in range(40):
            batch = s.batch(step).sparse[n][0]
            new = set(batch.tolist()) - seen
            want = set(s.ids(n, s.new_indices(step)).tolist())
            assert new == want and len(new) == CFG.new_ids_per_step, f"table {n} step {step}"
            assert sum(x in want for x in batch.tolist()) == CFG.new_ids_per_step  # each once
            seen |= new
        assert len(seen) == s.universe_size(40)


def test_hot_set_rotates_every_k_steps():
    s = DriftingStream(CFG, seed=2)
    K = CFG.rotate_every
    for n in CFG.tables:
        prev = None
        for w in range(8):
            hot = set(s.hot_set(n, w).tolist())
            assert len(hot) == CFG.hot_ids
            known = set(s.ids(n, np.arange(s.universe_size(w * K))).tolist())
            assert hot <= known  # drawn from the ids known at the window's start
            # the empirical hot set of the window's batches is the defined one
            ids, counts = np.unique(np.concatenate([s.batch(st).sparse[n][0] for st in range(w * K, w * K + K)]),
                                    return_counts=True)
            top = set(ids[np.argsort(-counts, kind="stable")[:CFG.hot_ids]].tolist())
            assert top == hot, f"table {n} window {w}"
            if prev is not None:
                assert len(hot & prev) < CFG.hot_ids // 2  # rotated
            prev = hot


def test_hot_share_matches_definition():
    cfg = DriftConfig(tables=("t",), initial_ids=2000, new_ids_per_step=4, hot_ids=50, hot_share=0.6,
                      rotate_every=7, batch_size=256)
    s = DriftingStream(cfg, seed=3)
    hits, expected, var = 0, 0.0, 0.0
    for step in range(120):
        idx = s.batch_indices(step)["t"]
        new = set(s.new_indices(step).tolist())
        rest = np.array([i for i in idx.tolist() if i not in new])
        hot = set(s.hot_indices("t", s.window(step)).tolist())
        hits += sum(i in hot for i in rest.tolist())
        p = cfg.hot_share + (1 - cfg.hot_share) * cfg.hot_ids / s.universe_size(step)
        expected += p * rest.size
        var += p * (1 - p) * rest.size
    assert abs(hits - expected) < 5 * math.sqrt(var)


def test_teacher_signal_and_errors():
    s = DriftingStream(CFG, seed=4)
    labels, probs = [], []
    for step in range(60):
        cols, prob = s.batch_with_probability(step)
        labels.append(cols.labels)
        probs.append(prob)
    labels, probs = np.concatenate(labels), np.concatenate(probs)
    assert 0.15 < labels.mean() < 0.4
    assert roc_auc(labels, probs) > 0.65
    e = s.effect("u", s.ids("u", s.new_indices(100)))  # new ids carry their own effect
    assert np.all(np.abs(e) <= math.sqrt(3)) and np.std(e) > 0
    with pytest.raises(ConfigError, match="hot_ids 400 exceeds initial_ids 300"):
        DriftingStream(DriftConfig(initial_ids=300, hot_ids=400))
    with pytest.raises(ConfigError, match="no table 'x'"):
        s.hot_set("x", 0)


def test_hot_alpha_draw_matches_zipf_pmf():
    """hot_alpha > 0: hot draws follow r**-alpha over the hot set's ranks (exact float64 pmf, 5-sigma)."""
    cfg = DriftConfig(tables=("item",), initial_ids=500, hot_ids=20, hot_share=1.0, hot_alpha=1.0,
                      rotate_every=1_000, batch_size=4_000, new_ids_per_step=0)
    s = DriftingStream(cfg, seed=3)
    idx = np.concatenate([s.batch_indices(k)["item"] for k in range(5)])
    hot = set(s.hot_indices("item", 0).tolist())
    assert set(idx.tolist()) <= hot
    counts = np.sort(np.unique(idx, return_counts=True)[1])[::-1].astype(np.float64)
    n = idx.size
    pmf = np.arange(1, 21, dtype=np.float64) ** -1.0
    pmf /= pmf.sum()
    freq = np.zeros(20); freq[:counts.size] = counts / n
    assert np.all(np.abs(freq - pmf) <= 5 * np.sqrt(pmf * (1 - pmf) / n) + 1e-12)


def test_hot_alpha_zero_keeps_every_stream_bit_for_bit():
    """Default hot_alpha=0: batch indices equal the pre-hot_alpha stream (digest taken from that code)."""
    s = DriftingStream(DriftConfig(tables=("user", "item"), initial_ids=500, hot_ids=20, batch_size=256,
                                   rotate_every=3), seed=5)
    h = hashlib.sha256()
    for k in range(7):
        for _, idx in s.batch_indices(k).items():
            h.update(idx.astype("<i8").tobytes())
    assert h.hexdigest() == "35793203a17a9507df3ad6ebc4c0f13c330aca65fa60a4cc3091f84cd59cd8a2"


def test_hot_alpha_negative_is_a_config_error():
    with pytest.raises(ConfigError, match="hot_alpha"):
        DriftConfig(tables=("item",), hot_alpha=-0.5).validate()
