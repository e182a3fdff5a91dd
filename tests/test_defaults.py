"""Defaults that fit a log the library has not seen: the batch from the training rows, passes until early stopping,
vocabulary encoding when the vocabulary fits. Each against hand-worked figures or an independent count."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from embedscale import workflow
from embedscale.data.categorical import CategoricalEncoder
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.assemble import prepare_data
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.specs import RunConfig, TrainConfig, auto_batch_size, auto_sparse_weight_decay, from_dict
from embedscale.train.loop import LoopConfig, auto_epochs


@pytest.mark.parametrize("rows,batch", [(8000, 128), (8087, 128), (57722, 1024), (65536, 1024), (10**7, 1024),
                                        (5000, 64), (3000, 64), (1500, 32), (100, 32), (0, 1024), (24000, 512)])
def test_auto_batch_is_the_power_of_two_nearest_rows_over_64(rows, batch):
    # hand-worked: 8000 / 64 = 125 -> 128; 5000 / 64 = 78 -> 64; 3000 / 64 = 47 -> 64 (log2 5.55 rounds to 6);
    # 24000 / 64 = 375 -> 512 (log2 8.55 rounds to 9);
    # 57722 / 64 = 902 -> 1024; at most 1024, at least 32; 0 rows (a stream): 1024
    assert auto_batch_size(rows) == batch


def test_defaults_are_auto():
    t = TrainConfig()
    assert t.batch_size == 0 and t.epochs == 0 and t.early_stopping_patience > 0
    assert RunConfig().data.categorical == "auto" and RunConfig().model.first_order
    assert t.calibrate and t.lr_dense == 0.01  # Platt scaling of the best checkpoint; torch's Adagrad default


@pytest.mark.parametrize("epochs,steps,batch,has_eval,expected", [
    (0, 8, 128, True, 977),         # ceil(1e6 / (8 * 128)) passes, early stopping ends it
    (0, 1465, 1024, True, 1),       # a log larger than epoch_samples: one pass
    (0, 56, 1024, True, 18),        # ceil(1e6 / 57344)
    (0, 8, 128, False, 1),          # no eval split: nothing can stop it, one pass
    (3, 8, 128, True, 3),           # given: as given
])
def test_auto_epochs(epochs, steps, batch, has_eval, expected):
    loop = LoopConfig(epochs=epochs, batch_size=batch, epoch_samples=1_000_000)
    assert auto_epochs(loop, steps, has_eval) == expected


def _keys(counts: dict[int, int], gen) -> np.ndarray:
    keys = np.array([k for k, c in counts.items() for _ in range(c)], np.uint64)
    gen.shuffle(keys)
    return keys


def test_auto_encoding_is_vocab_when_the_vocabulary_fits():
    gen = np.random.default_rng(0)
    a = _keys({11: 5, 7: 9, 3: 1, 40: 2}, gen)
    b = _keys({5: 3, 6: 3}, gen)
    n = min(len(a), len(b))
    keys = np.stack([a[:n], b[:n]])
    enc = CategoricalEncoder(["a", "b"], "auto", max_rows=10)
    enc.count(keys)
    enc.build()
    assert enc.mode == "vocab"
    for f, col in enumerate(keys):
        counts = collections.Counter(col.tolist())
        assert enc.table_rows[f] == len(counts) + 1  # every value a row, row 0 the out-of-vocabulary row
        rows = enc.encode_feature(f, col)
        by_count = sorted(counts, key=lambda k: (-counts[k], k))  # row 1 the most frequent, ties by key
        assert rows.tolist() == [by_count.index(k) + 1 for k in col.tolist()]


def test_auto_encoding_hashes_when_a_vocabulary_does_not_fit_or_rows_are_given():
    gen = np.random.default_rng(1)
    wide = _keys({k: 1 for k in range(30)}, gen)  # 30 values: more than max_rows - 1 = 9
    narrow = _keys({1: 15, 2: 15}, gen)
    enc = CategoricalEncoder(["wide", "narrow"], "auto", max_rows=10, load_factor=0.5)
    enc.count(np.stack([wide, narrow]))
    enc.build()
    assert enc.mode == "hash"
    assert enc.table_rows == [10, 4]  # the cap; ceil(2 distinct / 0.5)
    assert enc.encode_feature(0, wide).tolist() == (wide % np.uint64(10)).astype(np.int64).tolist()
    given = CategoricalEncoder(["wide"], "auto", table_rows=7)
    assert given.mode == "hash" and given.table_rows == [7]


def test_a_small_log_trains_several_passes_until_early_stopping(tmp_path):
    """At the defaults (no batch, epochs or patience given) a log of 640 training rows trains at batch 32
    (20 steps a pass) for more than one pass and stops early on its eval split."""
    rng = np.random.default_rng(5)
    n = 800
    ids = [rng.integers(0, 50, n), rng.integers(0, 9, n)]
    y = (rng.random(n) < 1 / (1 + np.exp(-(ids[1] % 3 - 1.0)))).astype(np.int8)
    with ShardWriter(tmp_path / "data", ["x"], [SparseFeatureInfo("C1", 50), SparseFeatureInfo("C2", 9)]) as w:
        w.write(y, rng.normal(size=(n, 1)).astype(np.float32), {"C1": ids[0], "C2": ids[1]})
    cfg = from_dict(RunConfig, {"out_dir": str(tmp_path / "runs"),
                                "data": {"source": "shards", "path": str(tmp_path / "data"), "eval_fraction": 0.2},
                                "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8]},
                                "train": {"prefetch": 0, "lr_dense": 0.2, "lr_sparse": 0.5}})
    s = workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    assert cfg.train.batch_size == 32  # resolved from the 640 training rows
    assert s["stopped_early"] and s["steps"] > 20 and s["steps"] % 20 == 0
    assert s["best"]["step"] <= s["steps"] - 3 * 20 + 20  # the last patience evaluations did not improve


@pytest.mark.parametrize("rows,epochs,has_eval,expected", [
    (6470, 0, True, 1e-3),       # a small log until early stopping: several passes, the rows decayed
    (999_999, 0, True, 1e-3),    # one row short of epoch_samples: a second pass
    (1_000_000, 0, True, 0.0),   # epoch_samples rows or more: one pass, no decay
    (6470, 0, False, 0.0),       # no eval split: one pass
    (6470, 1, True, 0.0),        # one pass given
    (2_000_000, 3, True, 1e-3),  # passes given
    (0, 0, True, 0.0),           # a stream: one pass
])
def test_auto_sparse_weight_decay_only_when_rows_are_passed_over_again(rows, epochs, has_eval, expected):
    assert auto_sparse_weight_decay(rows, epochs, 1_000_000, has_eval) == expected


@pytest.mark.parametrize("max_steps,batch,expected", [
    (50, 128, 0.0),     # 6,400 samples of 6,470 rows: within the first pass
    (51, 128, 1e-3),    # 6,528 samples: into the second
    (8, 1024, 1e-3),    # 8,192 samples
    (0, 128, 1e-3),     # no step limit: until early stopping
])
def test_auto_sparse_weight_decay_none_when_max_steps_ends_the_first_pass(max_steps, batch, expected):
    assert auto_sparse_weight_decay(6470, 0, 1_000_000, True, max_steps, batch) == expected


def _small_log(path, n: int = 1000) -> None:
    rng = np.random.default_rng(3)
    with ShardWriter(path, ["x"], [SparseFeatureInfo("C1", 20)]) as w:
        w.write((rng.random(n) < 0.3).astype(np.int8), rng.normal(size=(n, 1)).astype(np.float32),
                {"C1": rng.integers(0, 20, n)})


@pytest.mark.parametrize("given,expected", [({}, 1e-3), ({"sparse_weight_decay": 0.0}, 0.0),
                                            ({"sparse_weight_decay": 0.05}, 0.05), ({"epochs": 1}, 0.0)])
def test_a_run_resolves_the_eval_split_and_row_decay_from_its_data(tmp_path, given, expected):
    """1,000 rows at the defaults: the last 10% (100 rows) are the eval split, the run passes over the 900 others
    until early stopping, so its rows are decayed by 1e-3 and the model's embedding carries that decay; a decay
    or one pass given is kept."""
    _small_log(tmp_path / "data")
    cfg = from_dict(RunConfig, {"data": {"source": "shards", "path": str(tmp_path / "data")}, "train": given})
    assert cfg.train.sparse_weight_decay == given.get("sparse_weight_decay", -1.0)
    data = prepare_data(cfg, progress=False)
    assert (data.train.start, data.train.stop, data.eval.start, data.eval.stop) == (0, 900, 900, 1000)
    assert cfg.train.sparse_weight_decay == expected
    tables = workflow.tables_for(cfg, data.manifest)
    model = workflow.build(cfg, tables, data.manifest.num_dense, "cpu")[0]
    decays = [m.weight_decay for m in model.modules() if isinstance(m, LocalEmbeddingBags)]
    assert decays == [expected]
