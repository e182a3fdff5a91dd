"""The shared decoders and the vocabulary counter against plain-Python references."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pyarrow as pa

from embedscale.data.raw import CategoricalEncoder, ValueCounter, fnv1a64, parse_decimal, parse_hex


def chunked(values: list[bytes], pieces: int = 3) -> pa.ChunkedArray:
    cut = [len(values) * i // pieces for i in range(pieces + 1)]
    return pa.chunked_array([pa.array(values[a:b], pa.binary()) for a, b in zip(cut, cut[1:])], pa.binary())


def test_parse_hex_variable_and_fixed_width():
    rng = random.Random(0)
    fixed = [f"{rng.randrange(1 << 32):08x}".encode() if rng.random() < 0.7 else b"" for _ in range(500)]
    mixed = [f"{rng.randrange(1 << 64):x}".encode()[: rng.randint(0, 16)] for _ in range(500)]
    mixed += [b"ABCdef01", b"0", b"f" * 16]
    for values in (fixed, mixed):
        keys, bad = parse_hex(chunked(values))
        assert not bad.any()
        assert keys.dtype == np.uint64 and keys.tolist() == [int(v or b"0", 16) for v in values]
    odd = pa.array([b"abc"] + fixed, pa.binary()).slice(1)  # a slice whose data starts at an odd byte
    assert parse_hex(odd)[0].tolist() == [int(v or b"0", 16) for v in fixed]
    for values in (fixed[:9] + [b"0000000g"], mixed[:9] + [b"1" * 17], [b"12345678", b"1234567 "], [b"0x1f"]):
        _, bad = parse_hex(pa.array(values, pa.binary()))
        assert bad.tolist() == [False] * (len(values) - 1) + [True], values


def test_parse_decimal_rules():
    values = [b"0", b"-3", b"", b"123456789012345678", b"-123456789012345678", b"007", b"5"]
    v, missing, bad = parse_decimal(chunked(values))
    assert not bad.any()
    assert v.tolist() == [int(x or b"0") for x in values] and missing.tolist() == [x == b"" for x in values]
    for wrong in (b"+5", b" 5", b"5 ", b"0x1f", b"1.0", b"-", b"--1", b"1-", b"1234567890123456789", b"1e3"):
        _, _, bad = parse_decimal(pa.array([b"12", wrong], pa.binary()))
        assert bad.tolist() == [False, True], wrong


def test_fnv1a64_matches_definition():
    values = [b"", b"a", b"1fbe01fe", b"-1", "é".encode(), bytes(range(256))[:40]]

    def ref(b: bytes) -> int:
        h = 14695981039346656037
        for c in b:
            h = ((h ^ c) * 1099511628211) % 2**64
        return h if b else 0

    (keys,) = fnv1a64(chunked(values, 2))
    assert keys.tolist() == [ref(v) for v in values]
    assert ref(b"a") == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector


def test_value_counter_merges_many_blocks():
    rng = np.random.default_rng(0)
    # ~350k distinct keys a block: the pending lists pass 1M and merge three times
    blocks = [rng.integers(0, 3_000_000, 400_000).astype(np.uint64) for _ in range(6)]
    counter = ValueCounter()
    for b in blocks:
        counter.add(b)
    keys, counts = counter.result()
    ref = Counter(np.concatenate(blocks).tolist())
    assert keys.tolist() == sorted(ref) and counts.tolist() == [ref[k] for k in sorted(ref)]


def test_vocab_encoder_order_and_oov():
    keys = np.array([[5], [7], [7], [9], [9], [5], [1], [7]], dtype=np.uint64)
    enc = CategoricalEncoder(["f"], "vocab", min_frequency=2)
    enc.count(keys)
    enc.build()
    # 7 seen 3 times -> row 1; 5 and 9 twice -> rows 2, 3 by key; 1 seen once -> row 0
    assert enc.encode(keys)[:, 0].tolist() == [2, 1, 1, 3, 3, 2, 0, 1]
    assert enc.table_rows == [4]
    assert enc.encode(np.array([[123]], dtype=np.uint64)).tolist() == [[0]]  # never seen: row 0
