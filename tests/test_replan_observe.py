"""The drift monitor's count of a batch (``DriftMonitor.observe``: one ``index_add_`` over every table's rows,
``RollingProfile.update_flat``). Reference: the decayed access counts worked in float64 by a plain-Python loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.errors import InputError
from embedscale.specs import TableSpec
from embedscale.train.replan import DriftMonitor

# table "a" has two features (x, y), "b" one (z); the batches name their keys in another order than the tables
TABLES = [TableSpec("a", 7, 2, features=["x", "y"]), TableSpec("b", 5, 2, features=["z"])]
KEYS = ["z", "x", "y"]


def _monitor(every=4):
    run = SimpleNamespace(host_embedding=None, device=torch.device("cpu"), tables=TABLES)
    return DriftMonitor(run, every, 0.05)


def _batch(step):
    """Two samples; sample 1 has two ids of x and none of y (a jagged batch), row ids by hand from the step."""
    per_key = {"z": [[step % 5], [(step + 2) % 5]], "x": [[step % 7], [6, 0]], "y": [[(3 * step) % 7], []]}
    return per_key, JaggedFeatures.from_lists({k: per_key[k] for k in KEYS})


def test_a_batch_is_counted_as_the_decayed_sum_of_its_accesses():
    """12 steps: each access at step s weighs q^(11 - s) at the end (q = 0.5^(1/4)), every table and feature."""
    mon = _monitor()
    want = {"a": [0.0] * 7, "b": [0.0] * 5}
    q = 0.5 ** (1 / 4)
    for s in range(12):
        per_key, batch = _batch(s)
        mon._step = s
        mon.observe(batch, samples=2)
        for k, t in (("x", "a"), ("y", "a"), ("z", "b")):
            for ids in per_key[k]:
                for r in ids:
                    want[t][r] += q ** (11 - s)
    assert mon._flat_cache, "the batch was not counted in one index_add_ (update_flat)"
    for t in ("a", "b"):
        assert mon.profile.counts(t).tolist() == pytest.approx(want[t], rel=1e-12), t
    assert mon.profile.samples == pytest.approx(sum(2 * q ** (11 - s) for s in range(12)), rel=1e-12)


@pytest.mark.parametrize("key,bad", [("y", 7), ("z", -1)])
def test_an_id_outside_its_table_is_named_and_nothing_is_counted(key, bad):
    """Row 7 of table a (7 rows) would land on row 0 of b in the one flat count; -1 before it: refused with the
    feature, the id and the table's range, and the profile is untouched."""
    mon = _monitor()
    per_key, _ = _batch(3)
    per_key[key][0] = [bad]
    with pytest.raises(InputError, match=rf"feature '{key}': row id {bad} outside its table \[0, "):
        mon.observe(JaggedFeatures.from_lists({k: per_key[k] for k in KEYS}), samples=2)
    assert all(float(mon.profile.counts(t).abs().sum()) == 0.0 for t in ("a", "b"))
    assert mon.profile.steps == 0
