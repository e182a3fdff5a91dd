"""The vectorised field decoders against plain-Python parses of the same values."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa

from embedscale.data.fields import field_lengths, fnv1a64, parse_decimal, parse_hex, parse_label


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

    keys = fnv1a64(chunked(values, 2))
    assert keys.tolist() == [ref(v) for v in values]
    assert ref(b"a") == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector


def test_parse_decimal_every_length_against_int():
    rng = random.Random(3)
    values = [str(rng.randrange(10 ** rng.randint(1, 18))).encode() for _ in range(2000)]
    values = [b"-" + v if rng.random() < 0.3 else v for v in values] + [b""] * 5
    rng.shuffle(values)
    v, missing, bad = parse_decimal(chunked(values, 4))
    assert not bad.any() and v.dtype == np.int64
    assert v.tolist() == [int(x or b"0") for x in values] and missing.sum() == 5


def test_parse_label_and_lengths():
    values = [b"0", b"1", b"", b"2", b"01", b" 1", b"1"]
    labels, bad = parse_label(chunked(values))
    assert bad.tolist() == [False, False, True, True, True, True, False]
    assert labels[~bad].tolist() == [0, 1, 1]
    assert field_lengths(chunked(values)).tolist() == [len(v) for v in values]


def test_fnv1a64_against_python_for_one_and_many_widths():
    def ref(b: bytes) -> int:
        if not b:
            return 0
        h = 0xCBF29CE484222325
        for c in b:
            h = ((h ^ c) * 0x100000001B3) % (1 << 64)
        return h

    for values in ([b"68fd1e64", b"", b"80e26c9b", b"fb936136"],  # one width: the reshaped path
                   [b"a", b"", b"hello world", b"\xff\x00z", b"12"]):  # several widths
        arr = pa.array(values, pa.binary())
        assert fnv1a64(arr).tolist() == [ref(v) for v in values]
        assert fnv1a64(pa.chunked_array([arr[:2], arr[2:]])).tolist() == [ref(v) for v in values]
