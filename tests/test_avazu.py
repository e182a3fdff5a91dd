"""The Avazu reader against a plain-Python parse of an Avazu-format file the test writes."""

from __future__ import annotations

import csv
import datetime
import math
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from embedscale.data.avazu import convert_avazu
from embedscale.data.shards import Manifest, iter_shards
from embedscale.errors import InputError
from embedscale.specs import AVAZU_COLUMNS

HEADER = ",".join(AVAZU_COLUMNS)


def fnv1a(value: str) -> int:
    """FNV-1a 64 written out from its definition; the empty (missing) value is key 0."""
    if not value:
        return 0
    h = 14695981039346656037
    for byte in value.encode():
        h = ((h ^ byte) * 1099511628211) % 2**64
    return h


def make_rows(n: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        hour = f"14{rng.randint(10, 12):02d}{rng.randint(1, 28):02d}{rng.randint(0, 23):02d}"
        cats = [str(rng.choice([1005, 1002, 1010])), str(rng.randint(0, 7))]
        cats += [rng.choice([f"{rng.randrange(1 << 32):08x}", f"{rng.randrange(20):08x}", ""]) for _ in range(12)]
        cats += [str(rng.choice([-1, rng.randint(0, 30), rng.randint(15000, 25000)])) for _ in range(7)]
        rows.append([str(10**19 + i), str(rng.randint(0, 1)), hour] + cats)
    return rows


def write(path: Path, rows: list[list[str]], header: str = HEADER) -> Path:
    path.write_text(header + "\n" + "".join(",".join(r) + "\n" for r in rows))
    return path


def load(out: Path):
    parts = list(iter_shards(out))
    m = Manifest.load(out)
    ids = np.stack([np.concatenate([p.sparse[n][0] for p in parts]) for n in m.sparse_names], axis=1)
    return np.concatenate([p.labels for p in parts]), np.concatenate([p.dense for p in parts]), ids


def test_hash_mode_labels_hour_and_ids(tmp_path):
    rows = make_rows(400)
    path = write(tmp_path / "train.csv", rows)
    m = convert_avazu(path, tmp_path / "out", table_rows=10_007, shard_rows=150, progress=False, block_bytes=5000)
    with open(path, newline="") as f:
        ref = list(csv.reader(f))[1:]
    assert ref == rows
    assert m.rows == 400 and m.positives == sum(int(r[1]) for r in ref)
    assert [s["rows"] for s in m.shards] == [150, 150, 100]
    assert m.dense_names == ["hour_of_day", "day_of_week"] and m.sparse_names == AVAZU_COLUMNS[3:]
    labels, dense, ids = load(tmp_path / "out")
    assert labels.tolist() == [int(r[1]) for r in ref]
    when = [datetime.datetime.strptime(r[2], "%y%m%d%H") for r in ref]
    np.testing.assert_allclose(dense, [[math.log1p(t.hour), math.log1p(t.weekday())] for t in when], rtol=1e-6)
    np.testing.assert_array_equal(ids, [[fnv1a(v) % 10_007 for v in r[3:]] for r in ref])


def test_vocab_mode_counts_and_min_frequency(tmp_path):
    rows = make_rows(300, seed=1)
    path = write(tmp_path / "train.csv", rows)
    for min_frequency in (1, 3):
        out = tmp_path / f"out{min_frequency}"
        m = convert_avazu(path, out, categorical="vocab", min_frequency=min_frequency, progress=False)
        _, _, ids = load(out)
        for j, name in enumerate(AVAZU_COLUMNS[3:]):
            column = [r[3 + j] for r in rows]
            counts = Counter(fnv1a(v) for v in column)
            assert len(counts) == len(set(column))  # no 64-bit collision in this file
            kept = sorted((k for k, c in counts.items() if c >= min_frequency), key=lambda k: (-counts[k], k))
            row_of = {k: i + 1 for i, k in enumerate(kept)}
            assert m.sparse[j].num_rows == len(kept) + 1, name
            assert ids[:, j].tolist() == [row_of.get(fnv1a(v), 0) for v in column], name


@pytest.mark.parametrize("how, message", [
    ("click", r"click '2' is not 0 or 1"),
    ("hour", r"hour '1410x100' is not YYMMDDHH"),
    ("hour7", r"hour '4102100' is not YYMMDDHH"),
    ("date", r"hour '14023012' is not a valid date and hour"),
    ("hour24", r"hour '14102124' is not a valid date and hour"),
    ("fields", r"expected 24 fields, got 25"),
])
def test_malformed_lines(tmp_path, how, message):
    rows = make_rows(200, seed=2)
    r = rows[150]
    if how == "click":
        r[1] = "2"
    elif how == "hour":
        r[2] = "1410x100"
    elif how == "hour7":
        r[2] = "4102100"
    elif how == "date":
        r[2] = "14023012"
    elif how == "hour24":
        r[2] = "14102124"
    else:
        r.append("extra")
    path = write(tmp_path / "bad.csv", rows)
    with pytest.raises(InputError, match=re.escape(f"{path}:152: ") + message):  # line 1 is the header
        convert_avazu(path, tmp_path / "out", progress=False, block_bytes=3000)
    assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        m = convert_avazu(path, tmp_path / "skip", skip_malformed=True, progress=False, block_bytes=3000)
    assert m.rows == 199 and m.extra["skipped"]["examples"][0].startswith(f"{path}:152: ")


def test_header_is_checked(tmp_path):
    path = write(tmp_path / "test.csv", [r[:1] + r[2:] for r in make_rows(3)],
                 header=",".join(c for c in AVAZU_COLUMNS if c != "click"))
    with pytest.raises(InputError, match=re.escape(f"{path}:1: header is 'id,hour,")):
        convert_avazu(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # a rejected input leaves no (empty) output directory behind
