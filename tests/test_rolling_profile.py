"""RollingProfile against the decay rule written literally in float64 numpy."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.distributed as dist

from embedscale.data.profile import AccessProfile
from embedscale.data.rolling_profile import RollingProfile
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.plan.api import make_plan
from embedscale.specs import TableSpec, Topology
from embedscale.train.launch import spawn_local

ROWS = {"a": 50, "b": 7}


def reference(batches, steps, decay):
    """count = count * decay**steps + bincount(rows), per batch, in float64."""
    out = {n: np.zeros(r) for n, r in ROWS.items()}
    samples = 0.0
    for batch, s in zip(batches, steps):
        samples = samples * decay ** s + len(batch["a"])
        for n in out:
            out[n] = out[n] * decay ** s
            if n in batch:
                out[n] = out[n] + np.bincount(batch[n], minlength=ROWS[n])
    return out, samples


def stream(seed, n=40):
    rng = np.random.default_rng(seed)
    batches, steps = [], []
    for i in range(n):
        b = {"a": rng.zipf(1.3, size=16).clip(max=50) - 1}
        if i % 3:
            b["b"] = rng.integers(0, 7, size=int(rng.integers(0, 5)))
        batches.append(b)
        steps.append(int(rng.integers(0, 3)))
    return batches, steps


def feed(prof, batches, steps):
    for b, s in zip(batches, steps):
        prof.update({n: torch.from_numpy(v) for n, v in b.items()}, steps=s, samples=len(b["a"]))


@pytest.mark.parametrize("decay", [1.0, 0.9, 0.3])
def test_matches_definition(decay):
    batches, steps = stream(0, 400 if decay == 0.3 else 40)  # 0.3: the lazy scale passes 1e150 and is rescaled
    prof = RollingProfile(ROWS, decay)
    feed(prof, batches, steps)
    ref, samples = reference(batches, steps, decay)
    for n in ROWS:
        np.testing.assert_allclose(prof.counts(n).numpy(), ref[n], rtol=1e-12, atol=1e-300)
    assert prof.samples == pytest.approx(samples, rel=1e-12)
    assert prof.steps == sum(steps)


def test_long_gap_decays_without_overflow():
    prof = RollingProfile(ROWS, 0.9)
    prof.update({"a": torch.tensor([1, 1, 2])}, samples=3)
    prof.update({"a": torch.tensor([3])}, steps=5)
    prof.update({}, steps=100_000)  # 0.9^-100000 does not fit a float
    prof.update({"a": torch.tensor([4])}, steps=2)
    want = np.zeros(50)
    want[4] = 1.0
    want[3] = 0.9 ** 100_002  # underflows to 0, as the definition does in float64
    np.testing.assert_allclose(prof.counts("a").numpy(), want, rtol=1e-12, atol=0)
    assert prof.steps == 100_008


def restored(a: RollingProfile) -> RollingProfile:
    """A new profile loaded from ``a``'s state after a trip through the checkpoint format (torch.save, then
    torch.load with weights_only)."""
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = RollingProfile(ROWS, a.decay)
    b.load_state_dict(torch.load(buf, weights_only=True))
    return b


def test_state_round_trip_and_errors():
    batches, steps = stream(1)
    a = RollingProfile(ROWS, 0.8)
    feed(a, batches[:20], steps[:20])
    b = restored(a)
    feed(a, batches[20:], steps[20:])
    feed(b, batches[20:], steps[20:])
    for n in ROWS:
        torch.testing.assert_close(a.counts(n), b.counts(n), rtol=1e-12, atol=0)
    with pytest.raises(FormatError, match="decay"):
        RollingProfile(ROWS, 0.5).load_state_dict(a.state_dict())
    with pytest.raises(InputError, match="table 'b': row 7 outside 0..6"):
        a.update({"b": torch.tensor([7])})
    with pytest.raises(ConfigError, match="decay"):
        RollingProfile(ROWS, 0.0)


def test_state_restores_bit_for_bit_and_adds_across_ranks():
    """A profile restored from its state continues with the same bits as the saved one (the stored values and
    the scale travel); ``add_state`` gives two ranks' sum on one (what a checkpoint restored on another world
    size hands rank 0), against the float64 reference of both streams added."""
    b1, s1 = stream(3)
    b2, _ = stream(4)
    a = RollingProfile(ROWS, 0.8)
    feed(a, b1[:25], s1[:25])
    b = restored(a)
    assert a._scale != 1.0  # the lazy scale is part of the state
    feed(a, b1[25:], s1[25:])
    feed(b, b1[25:], s1[25:])
    for n in ROWS:
        assert torch.equal(a.counts(n), b.counts(n)), n
    assert a.samples == b.samples and a.steps == b.steps
    r1, r2 = RollingProfile(ROWS, 0.8), RollingProfile(ROWS, 0.8)
    feed(r1, b1, s1)
    feed(r2, b2, s1)  # the same steps: two ranks' slices of the same batches
    r1.add_state(r2.state_dict())
    (w1, n1), (w2, n2) = reference(b1, s1, 0.8), reference(b2, s1, 0.8)
    for n in ROWS:
        np.testing.assert_allclose(r1.counts(n).numpy(), w1[n] + w2[n], rtol=1e-12, atol=0)
    assert r1.samples == pytest.approx(n1 + n2, rel=1e-12)
    short = RollingProfile(ROWS, 0.8)
    feed(short, b2[:3], s1[:3])
    with pytest.raises(FormatError, match="steps"):
        r1.add_state(short.state_dict())


def test_monitor_restores_its_profile_on_any_world_size():
    """``DriftMonitor.restore`` (no collectives): rank files of the same world size give every rank its own
    profile; of 2 ranks read by 3, rank 0 gets their sum and ranks 1-2 start empty (the monitor sums them); a
    delta (rank files without profiles) gives its base's."""
    from embedscale.train.replan import CHECKPOINT_KEY, DriftMonitor

    b1, s1 = stream(5)
    b2, _ = stream(6)
    saved = []
    for bs in (b1, b2):
        p = RollingProfile(ROWS, 0.9)
        feed(p, bs, s1)
        saved.append(p)
    shards = [{"rank": r, CHECKPOINT_KEY: p.state_dict()} for r, p in enumerate(saved)]
    base = [{"rank": -1 - r, CHECKPOINT_KEY: p.state_dict()} for r, p in enumerate(saved)]
    shards.append({"rank": -1, CHECKPOINT_KEY: RollingProfile(ROWS, 0.9).state_dict()})  # a delta's base: ignored

    def monitor():
        m = DriftMonitor.__new__(DriftMonitor)
        m.profile, m._checked_at = RollingProfile(ROWS, 0.9), 7
        return m

    for r in range(2):
        m = monitor()
        m.restore(shards, r, 2)
        for n in ROWS:
            assert torch.equal(m.profile.counts(n), saved[r].counts(n))
    got = []
    for r in range(3):
        m = monitor()
        m.restore(shards, r, 3)
        got.append(m.profile)
    for n in ROWS:
        np.testing.assert_allclose(sum(p.counts(n) for p in got).numpy(),
                                   (saved[0].counts(n) + saved[1].counts(n)).numpy(), rtol=1e-12, atol=0)
        assert not got[1].counts(n).any() and not got[2].counts(n).any()
    for r in range(2):  # a delta (no profiles of its own): its base's rank files' (ranks -1, -2)
        m = monitor()
        m.restore(base + [{"rank": 0}, {"rank": 1}], r, 2)
        for n in ROWS:
            assert torch.equal(m.profile.counts(n), saved[r].counts(n))
    m = monitor()
    m.restore([{"rank": 0}], 0, 1)  # a checkpoint without profiles: it stays empty
    assert m.profile.steps == 0


def test_to_access_profile_plans():
    batches, steps = stream(2)
    prof = RollingProfile(ROWS, 0.95)
    feed(prof, batches, steps)
    ap = prof.to_access_profile()
    ref, samples = reference(batches, steps, 0.95)
    assert isinstance(ap, AccessProfile) and ap.samples == round(samples)
    np.testing.assert_allclose(ap.counts("a"), ref["a"], rtol=1e-12)
    assert ap.sorted_rows("a")[0] == int(np.argmax(ref["a"]))
    plan = make_plan("oper", [TableSpec("a", 50, 4), TableSpec("b", 7, 4)], ap, Topology(ranks_per_host=2),
                     batch_size=16)
    plan.validate()


def _two_ranks(rank, world):
    batches, steps = stream(10 + rank)
    prof = RollingProfile(ROWS, 0.9)
    feed(prof, batches, steps)
    total = prof.all_reduce(dist.new_group([0, 1]))  # a given process group
    return {"a": total.counts("a"), "b": total.counts("b"), "samples": total.samples, "own": prof.counts("a")}


def test_all_reduce_two_ranks():
    out = spawn_local(_two_ranks, 2, timeout_s=300)
    refs = [reference(*stream(10 + r), 0.9) for r in range(2)]
    for r in range(2):
        for n in ROWS:
            np.testing.assert_allclose(out[r][n].numpy(), refs[0][0][n] + refs[1][0][n], rtol=1e-12)
        assert out[r]["samples"] == pytest.approx(refs[0][1] + refs[1][1], rel=1e-12)
        np.testing.assert_allclose(out[r]["own"].numpy(), refs[r][0]["a"], rtol=1e-12)  # own counts unchanged
