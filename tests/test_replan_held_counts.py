"""The drift monitor's cheap per-step path: a counted batch held and added when the profile is read
(``RollingProfile.update_flat(defer=True)``), a batch not counted only decaying (no tensor touched), and the ids'
range check by one reduction when they fit the smallest table, and the sampled count (``train.replan_count_every``).
References: the decay rule worked in float64 by a plain-Python loop, the same profile counting every batch at once
(bit for bit), and the brute-force count's mean and stated variance over many seeds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.data.rolling_profile import RollingProfile
from embedscale.errors import InputError
from embedscale.specs import TableSpec
from embedscale.train.replan import DriftMonitor

ROWS = {"a": 30, "b": 9}


def _stream(seed: int, n: int):
    """Per step: flat ids over both tables (or None: a step not counted), its samples."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append((None, 0))
        else:
            ids = rng.integers(0, 39, size=int(rng.integers(0, 12)))
            out.append((torch.from_numpy(ids.astype(np.int64)), int(rng.integers(1, 5))))
    return out


def _reference(stream, decay):
    """count = count * decay + bincount(ids), every step, in float64 (plain Python)."""
    c, samples = [0.0] * 39, 0.0
    for ids, s in stream:
        c = [x * decay for x in c]
        samples = samples * decay + s
        for i in (ids.tolist() if ids is not None else []):
            c[i] += 1.0
    return c, samples


def _feed(prof, stream, defer, reads=()):
    for k, (ids, s) in enumerate(stream):
        if ids is None:
            prof.update({}, steps=1)
        else:
            prof.update_flat(ids, steps=1, samples=s, check=False, defer=defer)
        if k in reads:  # a read in the middle: the held batches are added then
            prof.counts("a")


@pytest.mark.parametrize("dtype,decay,n", [(torch.float64, 0.9, 60), (torch.float32, 0.3, 120)])
def test_held_batches_count_as_each_batch_at_once(dtype, decay, n):
    """Held (added when read) against added at once: the same bits; against the float64 rule: equal. float32 at
    decay 0.3 passes the rescale limit (1e18) while batches are held, several times."""
    stream = _stream(1, n)
    now, held = RollingProfile(ROWS, decay, dtype=dtype), RollingProfile(ROWS, decay, dtype=dtype)
    _feed(now, stream, defer=False)
    _feed(held, stream, defer=True, reads={10, 11, 37})
    assert held.steps == now.steps == n
    for t in ROWS:
        assert torch.equal(held.counts(t), now.counts(t)), t
    assert held.samples == now.samples
    want, samples = _reference(stream, decay)
    got = torch.cat([held.counts("a"), held.counts("b")]).double().tolist()
    rel = 1e-12 if dtype == torch.float64 else 1e-5
    assert got == pytest.approx(want, rel=rel, abs=1e-300 if dtype == torch.float64 else 1e-30)
    assert held.samples == pytest.approx(samples, rel=rel)


def test_a_profile_saved_while_holding_continues_as_the_unsaved_one():
    """state_dict with batches held and steps not yet in the scale: a profile restored from it and fed on equals
    the one never saved (bit for bit), and both the float64 rule."""
    stream = _stream(2, 50)
    a = RollingProfile(ROWS, 0.8)
    _feed(a, stream[:23], defer=True)
    assert a._held or a._idle, "the case holds nothing: it tests nothing"
    b = RollingProfile(ROWS, 0.8)
    b.load_state_dict(a.state_dict())
    _feed(a, stream[23:], defer=True)
    _feed(b, stream[23:], defer=True)
    for t in ROWS:
        assert torch.equal(a.counts(t), b.counts(t)), t
    want, _ = _reference(stream, 0.8)
    assert torch.cat([b.counts("a"), b.counts("b")]).tolist() == pytest.approx(want, rel=1e-12, abs=1e-300)


TABLES = [TableSpec("big", 100, 2, features=["x"]), TableSpec("small", 6, 2, features=["y"])]


def _monitor():
    run = SimpleNamespace(host_embedding=None, device=torch.device("cpu"), tables=TABLES)
    return DriftMonitor(run, 4, 0.05)


def test_ids_beyond_the_smallest_table_are_checked_against_their_own():
    """x's ids up to 99 are valid (table big, 100 rows) though above the smallest table's 6 rows: counted on big's
    rows; y's id 6 (table small, 6 rows) is refused although it lies within big's range."""
    mon = _monitor()
    per_key = {"x": [[99], [7, 50]], "y": [[5], []]}
    mon.observe(JaggedFeatures.from_lists(per_key), samples=2)
    big, small = [0.0] * 100, [0.0] * 6
    big[99] = big[7] = big[50] = small[5] = 1.0
    assert mon.profile.counts("big").tolist() == big and mon.profile.counts("small").tolist() == small
    for bad in ([[6], []], [[-1], []]):
        with pytest.raises(InputError, match=rf"feature 'y': row id {bad[0][0]} outside its table \[0, 6\)"):
            mon.observe(JaggedFeatures.from_lists({"x": [[1], [2]], "y": bad}), samples=2)
    assert mon.profile.counts("big").tolist() == big and mon.profile.samples == 2.0


def test_batches_not_counted_only_decay():
    """The monitor's quiet steps (checks spaced out): the profile keeps its counts' storage untouched, and the
    counts read afterwards carry the decay of every step (q^steps, q = 0.5^(1/4))."""
    mon = _monitor()
    mon.observe(JaggedFeatures.from_lists({"x": [[3], [3]], "y": [[1], []]}), samples=2)
    mon.profile.counts("big")  # the held batch added
    before = mon.profile._flat.clone()
    mon._quiet_until = 100
    for s in range(1, 9):
        mon._step = s
        mon.observe(JaggedFeatures.from_lists({"x": [[4], [5]], "y": [[2], []]}), samples=2)
    assert mon.profile._held == [] and torch.equal(mon.profile._flat, before)
    q = 0.5 ** (1 / 4)
    assert mon.profile.steps == 9
    assert mon.profile.counts("big")[[3, 4, 5]].tolist() == pytest.approx([2 * q ** 8, 0.0, 0.0], rel=1e-12)
    assert mon.profile.samples == pytest.approx(2 * q ** 8, rel=1e-12)


def test_sampled_counting_is_unbiased_with_the_stated_variance():
    """``train.replan_count_every`` k = 4: each batch counted with probability 1/4, weighted 4. Over 400 seeds, per
    row, the estimates' mean is the full decayed count (brute force in float64, within 5 standard errors) and
    their variance the stated ``(k - 1) * sum_s (q^(T - s) n_s)^2`` (within [0.6, 1.6] of it)."""
    k, steps, seeds = 4, 20, 400
    q = 0.5 ** (1 / 4)
    rng = np.random.default_rng(7)
    batches = [{"x": [[int(v)] for v in rng.zipf(1.5, 6).clip(max=100) - 1], "y": [[int(v)] for v in
                                                                                  rng.integers(0, 6, 6)]}
               for _ in range(steps)]
    full, var = np.zeros(106), np.zeros(106)  # big's 100 rows, then small's 6
    for s, b in enumerate(batches):
        n = np.bincount([r[0] for r in b["x"]], minlength=100).tolist() + np.bincount(
            [r[0] for r in b["y"]], minlength=6).tolist()
        w = q ** (steps - 1 - s)
        full += w * np.asarray(n, dtype=np.float64)
        var += (k - 1) * (w * np.asarray(n, dtype=np.float64)) ** 2
    est = np.zeros((seeds, 106))
    for seed in range(seeds):
        run = SimpleNamespace(host_embedding=None, device=torch.device("cpu"), tables=TABLES)
        mon = DriftMonitor(run, 4, 0.05, count_every=k, seed=seed)
        for s, b in enumerate(batches):
            mon._step = s
            mon.observe(JaggedFeatures.from_lists(b), samples=6)
        est[seed] = torch.cat([mon.profile.counts("big"), mon.profile.counts("small")]).numpy()
    hit = var > 0
    assert hit.sum() >= 6, "too few rows to test"
    assert np.all(np.abs(est.mean(0) - full) <= 5 * np.sqrt(var / seeds) + 1e-12)
    ratio = est.var(0, ddof=1)[hit] / var[hit]
    assert 0.6 <= ratio.min() and ratio.max() <= 1.6, ratio
    assert np.array_equal(est[:, ~hit], np.zeros((seeds, int((~hit).sum()))))
