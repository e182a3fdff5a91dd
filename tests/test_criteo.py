"""The Criteo reader against a plain-Python ``csv`` parse of the same lines."""

from __future__ import annotations

import csv
import gzip
import math
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from embedscale.data.criteo import convert_criteo
from embedscale.data.shards import MANIFEST, Manifest, iter_shards
from embedscale.errors import ConfigError, InputError

REAL = Path(__file__).resolve().parents[2] / "shared/data/criteo_kaggle_head10k.tsv"


def read_reference(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def load(out: Path):
    """All shards concatenated: labels [N], dense [N, 13], ids [N, 26]."""
    parts = list(iter_shards(out))
    labels = np.concatenate([p.labels for p in parts])
    dense = np.concatenate([p.dense for p in parts])
    m = Manifest.load(out)
    ids = np.stack([np.concatenate([p.sparse[n][0] for p in parts]) for n in m.sparse_names], axis=1)
    return labels, dense, ids


def ref_key(v: str) -> int:
    return int(v or "0", 16)  # the DLRM reference fills a missing field with "0"


def ref_vocab_rows(column: list[str], min_frequency: int) -> dict[int, int]:
    counts = Counter(ref_key(v) for v in column)
    kept = sorted((k for k, c in counts.items() if c >= min_frequency), key=lambda k: (-counts[k], k))
    return {k: i + 1 for i, k in enumerate(kept)}


@pytest.fixture(scope="module")
def real() -> list[list[str]]:
    if not REAL.exists():
        pytest.skip(f"real Criteo sample not found at {REAL} (see shared/data/README.md)")
    return read_reference(REAL)


def synthetic_lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        dense = [rng.choice(["", str(rng.randint(-3, 5000))]) for _ in range(13)]
        cats = [rng.choice(["", f"{rng.randrange(1 << 32):08x}", f"{rng.randrange(50):08x}"]) for _ in range(26)]
        lines.append("\t".join([str(rng.randint(0, 1))] + dense + cats))
    return lines


def write(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_bytes("".join(line + end for line in lines).encode())
    return path


# --------------------------------------------------------------------------------------------------
# the real 10k sample


def test_real_rows_positives_labels_dense(real, tmp_path):
    m = convert_criteo(REAL, tmp_path / "out", progress=False)
    assert m.rows == len(real) == 10_000
    assert m.positives == sum(int(r[0]) for r in real) == 2_182
    assert m.dense_names == [f"I{i}" for i in range(1, 14)] and m.sparse_names == [f"C{i}" for i in range(1, 27)]
    assert m.extra["format"] == "criteo" and m.extra["categorical"] == "hash"
    assert m.extra["source"] == [str(REAL)] and m.extra["skipped"] == {"count": 0, "examples": []}
    labels, dense, _ = load(tmp_path / "out")
    assert labels.tolist() == [int(r[0]) for r in real]
    want = np.array([[math.log1p(max(int(v or "0"), 0)) for v in r[1:14]] for r in real]).astype(np.float32)
    assert dense.dtype == np.float32
    np.testing.assert_array_equal(dense, want)  # libm's log1p rounded once: the same bits on every CPU


def test_real_hash_ids(real, tmp_path):
    rows = [1000 + 37 * j for j in range(26)]  # a different modulus per feature
    m = convert_criteo(REAL, tmp_path / "out", table_rows=rows, progress=False)
    assert [s.num_rows for s in m.sparse] == rows == m.extra["table_rows"]
    _, _, ids = load(tmp_path / "out")
    want = np.array([[ref_key(v) % rows[j] for j, v in enumerate(r[14:])] for r in real])
    np.testing.assert_array_equal(ids, want)


def test_real_vocab_distinct_counts_and_order(real, tmp_path):
    m = convert_criteo(REAL, tmp_path / "out", categorical="vocab", progress=False)
    _, _, ids = load(tmp_path / "out")
    for j in range(26):
        column = [r[14 + j] for r in real]
        distinct = {ref_key(v) for v in column}
        assert m.sparse[j].num_rows == len(distinct) + 1, f"C{j + 1}"  # + the out-of-vocabulary row 0
        rows = ref_vocab_rows(column, 1)
        np.testing.assert_array_equal(ids[:, j], [rows[ref_key(v)] for v in column], err_msg=f"C{j + 1}")
        by_row = np.load(tmp_path / "out" / f"vocab-C{j + 1}.npy")
        assert [int(k) for k in by_row] == sorted(rows, key=rows.get)
    assert sum(s.num_rows - 1 for s in m.sparse) == sum(len({ref_key(r[14 + j]) for r in real}) for j in range(26))


def test_real_vocab_min_frequency(real, tmp_path):
    m = convert_criteo(REAL, tmp_path / "out", categorical="vocab", min_frequency=5, progress=False)
    assert m.extra["min_frequency"] == 5
    _, _, ids = load(tmp_path / "out")
    rare_seen = 0
    for j in range(26):
        column = [r[14 + j] for r in real]
        rows = ref_vocab_rows(column, 5)
        assert m.sparse[j].num_rows == len(rows) + 1
        want = [rows.get(ref_key(v), 0) for v in column]
        rare_seen += want.count(0)
        np.testing.assert_array_equal(ids[:, j], want, err_msg=f"C{j + 1}")
    assert rare_seen > 0  # the cut did something on this data


def test_real_sharding_and_max_rows(real, tmp_path):
    whole = convert_criteo(REAL, tmp_path / "whole", progress=False)
    m = convert_criteo(REAL, tmp_path / "sharded", shard_rows=3000, progress=False, block_bytes=100_000)
    assert [s["rows"] for s in m.shards] == [3000, 3000, 3000, 1000]
    assert all((tmp_path / "sharded" / s["file"]).exists() for s in m.shards)
    assert m.positives == whole.positives
    for a, b in zip(load(tmp_path / "whole"), load(tmp_path / "sharded")):
        np.testing.assert_array_equal(a, b)
    rows = [s.num_rows for s in whole.sparse]  # sized from all 10k rows; the cut would size from its 2,500
    cut = convert_criteo(REAL, tmp_path / "cut", max_rows=2500, block_bytes=100_000, progress=False, table_rows=rows)
    assert cut.rows == 2500 and cut.positives == sum(int(r[0]) for r in real[:2500])
    np.testing.assert_array_equal(load(tmp_path / "cut")[2], load(tmp_path / "whole")[2][:2500])
    auto = convert_criteo(REAL, tmp_path / "auto", max_rows=2500, progress=False)  # sized from the rows it keeps
    for j, s in enumerate(auto.sparse):
        distinct = len({r[14 + j] for r in real[:2500]})
        assert s.num_rows == min(1_000_000, -(-distinct // 0.5)), s.name


# --------------------------------------------------------------------------------------------------
# malformed lines, on small files the tests write


def _corrupt(lines: list[str], i: int, how: str) -> list[str]:
    f = lines[i].split("\t")
    if how == "field count":
        f = f[:-1]
    elif how == "bad hex":
        f[14 + 4] = "zz12ab00"
    elif how == "bad label":
        f[0] = "2"
    elif how == "bad int":
        f[1 + 2] = "1.5"
    elif how == "hex in dense":
        f[1 + 2] = "0x1f"
    elif how == "hex too long":
        f[14] = "1" * 17
    elif how == "empty line":
        f = [""]
    out = list(lines)
    out[i] = "\t".join(f)
    return out


CASES = {
    "field count": r"expected 40 fields, got 39",
    "bad hex": r"C5 'zz12ab00' is not hexadecimal",
    "bad label": r"label '2' is not 0 or 1",
    "bad int": r"I3 '1.5' is not an integer",
    "hex in dense": r"I3 '0x1f' is not an integer",
    "hex too long": r"C1 '1{17}' is not hexadecimal",
    "empty line": r"expected 40 fields, got 1",
}


@pytest.mark.parametrize("how", list(CASES))
def test_malformed_line_names_file_and_line(tmp_path, how):
    lines = _corrupt(synthetic_lines(300), 236, how)
    path = write(tmp_path / "bad.tsv", lines)
    with pytest.raises(InputError, match=re.escape(f"{path}:237: ") + CASES[how]):
        convert_criteo(path, tmp_path / "out", progress=False, block_bytes=4096)  # line 237 is in a later block
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_skip_malformed_counts_and_keeps_the_rest(tmp_path):
    lines = synthetic_lines(400, seed=1)
    bad_at = {10: "bad hex", 11: "field count", 150: "bad label", 151: "bad int", 399: "empty line"}
    for i, how in bad_at.items():
        lines = _corrupt(lines, i, how)
    path = write(tmp_path / "bad.tsv", lines)
    with pytest.raises(InputError, match=re.escape(f"{path}:11: ")):
        convert_criteo(path, tmp_path / "strict", progress=False)
    with pytest.warns(UserWarning, match="skipped 5 malformed"):
        m = convert_criteo(path, tmp_path / "out", skip_malformed=True, progress=False, block_bytes=2048,
                           table_rows=997)
    assert m.rows == 395
    assert m.extra["skipped"]["count"] == 5
    assert [e.split(": ")[0] for e in m.extra["skipped"]["examples"]] == [f"{path}:{i + 1}" for i in sorted(bad_at)]
    good = [line.split("\t") for i, line in enumerate(lines) if i not in bad_at]
    labels, dense, ids = load(tmp_path / "out")
    assert labels.tolist() == [int(r[0]) for r in good]
    np.testing.assert_array_equal(ids, [[ref_key(v) % 997 for v in r[14:]] for r in good])


def test_skip_examples_capped_at_ten(tmp_path):
    lines = synthetic_lines(100, seed=2)
    for i in range(0, 100, 5):
        lines = _corrupt(lines, i, "bad label")
    path = write(tmp_path / "bad.tsv", lines)
    with pytest.warns(UserWarning):
        m = convert_criteo(path, tmp_path / "out", skip_malformed=True, progress=False)
    assert m.rows == 80 and m.extra["skipped"]["count"] == 20 and len(m.extra["skipped"]["examples"]) == 10


def test_error_leaves_nothing_half_written(tmp_path):
    lines = synthetic_lines(500, seed=3)
    good = write(tmp_path / "good.tsv", lines[:100])
    bad = write(tmp_path / "bad.tsv", _corrupt(lines, 480, "bad hex"))
    out = tmp_path / "fresh"
    with pytest.raises(InputError, match=":481: "):
        convert_criteo(bad, out, shard_rows=50, block_bytes=4096, progress=False)  # shards were due before line 481
    assert not out.exists()  # a rejected input leaves no output directory
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nor a staging directory
    # a finished dataset in the way stays whole until the new one is complete
    old = convert_criteo(good, tmp_path / "existing", shard_rows=30, progress=False)
    with pytest.raises(InputError):
        convert_criteo(bad, tmp_path / "existing", shard_rows=50, block_bytes=4096, progress=False)
    again = Manifest.load(tmp_path / "existing")
    assert again.rows == old.rows == 100 and len(list((tmp_path / "existing").iterdir())) == 1 + len(old.shards)


def test_several_files_gzip_and_crlf(tmp_path):
    lines = synthetic_lines(120, seed=4)
    a = write(tmp_path / "a.tsv", lines[:70], end="\r\n")
    b = tmp_path / "b.tsv.gz"
    with gzip.open(b, "wb") as f:
        f.write("".join(line + "\n" for line in lines[70:]).encode())
    m = convert_criteo([a, b], tmp_path / "out", categorical="vocab", progress=False)
    assert m.rows == 120 and m.extra["source"] == [str(a), str(b)]
    ref = [line.split("\t") for line in lines]
    _, _, ids = load(tmp_path / "out")
    for j in range(26):
        rows = ref_vocab_rows([r[14 + j] for r in ref], 1)
        assert ids[:, j].tolist() == [rows[ref_key(r[14 + j])] for r in ref]
    # errors name the file they are in, with its own line numbers
    write(tmp_path / "c.tsv", _corrupt(lines[:30], 4, "bad label"))
    with pytest.raises(InputError, match=re.escape(f"{tmp_path / 'c.tsv'}:5: ")):
        convert_criteo([a, tmp_path / "c.tsv"], tmp_path / "out2", progress=False)
    # a malformed line in a CRLF file is named, and skipping it keeps the other CRLF lines intact
    d = write(tmp_path / "d.tsv", _corrupt(lines[:30], 6, "bad label"), end="\r\n")
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        m = convert_criteo(d, tmp_path / "out3", skip_malformed=True, progress=False)
    assert m.rows == 29 and m.extra["skipped"]["examples"][0].startswith(f"{d}:7: label")


def test_lone_carriage_return_is_malformed(tmp_path):
    lines = synthetic_lines(20, seed=5)
    lines[7] = lines[7] + "\r" + lines[8]
    path = write(tmp_path / "cr.tsv", lines)
    with pytest.raises(InputError, match=re.escape(f"{path}:8: ") + "expected 40 fields"):
        convert_criteo(path, tmp_path / "out", progress=False)


def test_bad_arguments(tmp_path):
    path = write(tmp_path / "ok.tsv", synthetic_lines(5))
    with pytest.raises(ConfigError, match="26 sparse features"):
        convert_criteo(path, tmp_path / "o", table_rows=[10] * 25, progress=False)
    with pytest.raises(ConfigError, match="'hash' or 'vocab'"):
        convert_criteo(path, tmp_path / "o", categorical="onehot", progress=False)
    with pytest.raises(ConfigError, match="min_frequency"):
        convert_criteo(path, tmp_path / "o", categorical="vocab", min_frequency=0, progress=False)
    with pytest.raises(InputError, match="no such file"):
        convert_criteo(tmp_path / "missing.tsv", tmp_path / "o", progress=False)
    (tmp_path / "empty.tsv").write_bytes(b"")
    with pytest.raises(InputError, match="empty.tsv: no rows$"):
        convert_criteo(tmp_path / "empty.tsv", tmp_path / "o", progress=False)
    write(tmp_path / "junk.tsv", ["junk"] * 3)
    with pytest.raises(InputError, match=r"no rows \(3 malformed lines skipped\)"):
        convert_criteo(tmp_path / "junk.tsv", tmp_path / "o", skip_malformed=True, progress=False)
    assert not (tmp_path / "o" / MANIFEST).exists()
