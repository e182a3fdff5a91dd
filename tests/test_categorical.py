"""Keys -> rows: the vocabulary counter and both encoder modes against plain-Python references."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from embedscale.data.categorical import CategoricalEncoder, ValueCounter
from embedscale.errors import ConfigError


def test_value_counter_merges_many_blocks():
    rng = np.random.default_rng(0)
    # ~350k distinct keys a block: the pending lists pass 1M and merge three times
    blocks = [rng.integers(0, 3_000_000, 400_000).astype(np.uint64) for _ in range(6)]
    counter = ValueCounter()
    for b in blocks:
        counter.add(b)
    assert len(counter.keys) > 0  # merged along the way, not only at the end
    keys, counts = counter.result()
    ref_keys, ref_counts = np.unique(np.concatenate(blocks), return_counts=True)  # one shot, no merging
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(counts, ref_counts)
    small = Counter(blocks[0][:1000].tolist())
    c = ValueCounter()
    c.add(blocks[0][:500])
    c.add(blocks[0][500:1000])
    assert dict(zip(*(a.tolist() for a in c.result()))) == small


def test_vocab_encoder_order_and_oov():
    keys = np.array([[5, 7, 7, 9, 9, 5, 1, 7]], dtype=np.uint64)  # [F=1, N=8]
    enc = CategoricalEncoder(["f"], "vocab", min_frequency=2)
    enc.count(keys)
    enc.build()
    # 7 seen 3 times -> row 1; 5 and 9 twice -> rows 2, 3 by key; 1 seen once -> row 0
    assert enc.encode(keys)[0].tolist() == [2, 1, 1, 3, 3, 2, 0, 1]
    assert enc.table_rows == [4]
    assert enc.encode(np.array([[123]], dtype=np.uint64)).tolist() == [[0]]  # never seen: row 0


def test_hash_encoder_is_key_modulo_rows_per_feature():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**64 - 1, size=(3, 1000), dtype=np.uint64)  # beyond int64 too
    rows = [7, 1_000_003, 2**40 + 15]
    ids = CategoricalEncoder(["a", "b", "c"], "hash", table_rows=rows).encode(keys)
    assert ids.dtype == np.int64
    assert ids.tolist() == [[int(k) % r for k in keys[f]] for f, r in enumerate(rows)]


def test_encoder_rejects_bad_config():
    with pytest.raises(ConfigError, match="2 entries for 3 sparse features a..c"):
        CategoricalEncoder(["a", "b", "c"], "hash", table_rows=[5, 5])
    with pytest.raises(ConfigError, match="b=-1"):
        CategoricalEncoder(["a", "b"], "hash", table_rows=[5, -1])
    with pytest.raises(ConfigError, match="'hash' or 'vocab'"):
        CategoricalEncoder(["a"], "modulo")


def test_tables_sized_from_the_data_load_factor_and_cap():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 50, 2000).astype(np.uint64)  # 50 distinct values at most
    b = rng.integers(0, 1 << 62, 3000).astype(np.uint64)  # ~3000 distinct: over the cap
    enc = CategoricalEncoder(["a", "b", "c"], "hash", table_rows=[0, 0, 7], load_factor=0.25, max_rows=1000)
    assert enc.needs_counts
    for lo in range(0, 3000, 700):  # several blocks
        enc.count([a[lo:lo + 700], b[lo:lo + 700], b[lo:lo + 700]])
    enc.build()
    assert enc.table_rows == [len(np.unique(a)) * 4, 1000, 7]  # ceil(distinct / 0.25); the cap; as given
    ids = enc.encode_feature(0, a)
    assert ids.tolist() == (a % np.uint64(enc.table_rows[0])).astype(np.int64).tolist()
