"""CSV quoting (RFC 4180), headers (Avazu files without one, ``header: auto`` with a positional label), empty
sample weights and JSON lines records without a declared key: each against what Python's ``csv`` and ``json``
modules, or a reading by hand, say the small files the tests write hold."""

from __future__ import annotations

import csv
import io
import math
import subprocess
import sys

import numpy as np
import pytest

from embedscale.data.avazu import convert_avazu
from embedscale.data.schema import Schema
from embedscale.data.shards import Manifest, iter_shards
from embedscale.data.tabular import convert
from embedscale.errors import InputError
from embedscale.specs import AVAZU_COLUMNS

ROWS = 1_000_003


def fnv(b: str) -> int:
    """FNV-1a 64 byte by byte; the empty value is key 0."""
    if not b:
        return 0
    h = 0xCBF29CE484222325
    for c in b.encode():
        h = ((h ^ c) * 0x100000001B3) % 2**64
    return h


def columns(directory):
    cols = list(iter_shards(directory))
    labels = np.concatenate([c.labels for c in cols]).tolist()
    dense = np.concatenate([c.dense for c in cols])
    sparse = {n: (np.concatenate([c.sparse[n][0] for c in cols]).tolist(),
                  np.concatenate([c.sparse[n][1] for c in cols]).tolist()) for n in cols[0].sparse}
    return labels, dense, sparse


QUOTED = '''label,"site",tags,x
1,"a,b","1|2,3",1.5
0,"say ""hi""",4,"2"
1,"",,3
0,plain,"",-1
1,"x""",5|6,0
'''


def test_quoted_csv_fields_are_read_as_the_csv_module_reads_them(tmp_path):
    p = tmp_path / "q.csv"
    p.write_text(QUOTED)
    schema = Schema.from_dict({"format": "csv", "dense": ["x"],
                               "sparse": ["site", {"column": "tags", "separator": "|"}]})
    ref = list(csv.reader(io.StringIO(QUOTED)))[1:]
    assert [r[1] for r in ref] == ["a,b", 'say "hi"', "", "plain", 'x"']  # the reference, as RFC 4180 reads
    for block_bytes in (1 << 20, 16):  # one block; a line per block
        out = tmp_path / f"o{block_bytes}"
        convert(schema, p, out, table_rows=ROWS, progress=False, block_bytes=block_bytes)
        labels, dense, sp = columns(out)
        assert labels == [int(r[0]) for r in ref]
        assert dense[:, 0].tolist() == [float(r[3]) for r in ref]
        assert sp["site"][0] == [fnv(r[1]) % ROWS for r in ref]
        tags = [r[2].split("|") if r[2] else [] for r in ref]
        assert sp["tags"] == ([fnv(t) % ROWS for ts in tags for t in ts], [len(ts) for ts in tags])


def test_quoted_lines_beside_a_malformed_one_and_an_unterminated_quote(tmp_path):
    text = QUOTED.replace("0,plain,\"\",-1\n", '0,plain,"",-1,"one,too many"\n')
    p = tmp_path / "bad.csv"
    p.write_text(text)
    schema = Schema.from_dict({"format": "csv", "dense": ["x"], "sparse": ["site", "tags"]})
    with pytest.raises(InputError, match=f"^{p}:5: expected 4 fields, got 5"):
        convert(schema, p, tmp_path / "o", progress=False)
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        convert(schema, p, tmp_path / "o", table_rows=ROWS, progress=False, skip_malformed=True)
    ref = [r for r in csv.reader(io.StringIO(text))][1:]
    kept = [r for r in ref if len(r) == 4]
    assert len(kept) == 4 and columns(tmp_path / "o")[2]["site"][0] == [fnv(r[1]) % ROWS for r in kept]
    p.write_text(QUOTED.replace('1,"",,3', '1,"open,,3'))
    with pytest.raises(InputError, match=f"^{p}:4: a quoted field does not end on its line"):
        convert(schema, p, tmp_path / "u", progress=False)
    assert not (tmp_path / "u").exists()


def avazu_rows(n: int) -> list[list[str]]:
    rows = []
    for i in range(n):
        hour = f"141021{i % 24:02d}"
        cats = ["1005", str(i % 3), '"a,b"' if i % 4 == 0 else f"s{i % 5}"] + [f"v{(i * j) % 7}" for j in range(18)]
        rows.append([str(10**19 + i), str(i % 2), hour] + cats)
    return rows


def test_avazu_without_a_header(tmp_path):
    rows = avazu_rows(30)
    text = "".join(",".join(r) + "\n" for r in rows)
    p = tmp_path / "test.csv"
    p.write_text(text)
    ref = list(csv.reader(io.StringIO(text)))
    assert ref[0][5] == "a,b" and all(len(r) == 24 for r in ref)
    m = convert_avazu(p, tmp_path / "o", header="none", table_rows=ROWS, progress=False)
    labels, dense, sp = columns(tmp_path / "o")
    assert m.rows == 30 and labels == [int(r[1]) for r in ref]
    np.testing.assert_allclose(dense[:, 0], [math.log1p(int(r[2][-2:])) for r in ref], rtol=1e-6)
    np.testing.assert_allclose(dense[:, 1], [math.log1p(1)] * 30, rtol=1e-6)  # 2014-10-21 was a Tuesday
    for j, name in enumerate(AVAZU_COLUMNS[3:]):
        assert sp[name][0] == [fnv(r[3 + j]) % ROWS for r in ref], name
    # auto: a file with the header and one without, the same rows
    h = tmp_path / "train.csv"
    h.write_text(",".join(AVAZU_COLUMNS) + "\n" + text)
    convert_avazu({"train": [h], "test": [p]}, tmp_path / "a", header="auto", table_rows=ROWS, progress=False)
    assert columns(tmp_path / "a")[2] == sp and columns(tmp_path / "a" / "test")[2] == sp
    # the default wants the header, and says how to do without
    with pytest.raises(InputError, match=f"^{p}:1: header is .*header none, or auto"):
        convert_avazu(p, tmp_path / "x", progress=False)
    r = subprocess.run([sys.executable, "-m", "embedscale", "data", "avazu", str(p), "--header", "none", "--out",
                        str(tmp_path / "cli"), "--table-rows", str(ROWS), "--no-progress"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert columns(tmp_path / "cli")[2] == sp


def test_header_auto_with_a_positional_label(tmp_path):
    with_header = tmp_path / "a.tsv"
    with_header.write_text("click\tsite\tn\n1\ta\t5\n0\tb\t6\n")
    without = tmp_path / "b.tsv"
    without.write_text("0\tc\t7\n1\ta\t8\n")
    schema = Schema.from_dict({"format": "tsv", "header": "auto", "label": 0,
                               "sparse": [{"column": 1, "name": "site"}], "dense": [{"column": 2, "name": "n"}]})
    for first, second in ((with_header, without), (without, with_header)):
        out = tmp_path / first.stem
        convert(schema, {"train": [first], "test": [second]}, out, table_rows=ROWS, progress=False)
        want = {with_header: ([1, 0], ["a", "b"], [5, 6]), without: ([0, 1], ["c", "a"], [7, 8])}
        for d, f in ((out, first), (out / "test", second)):
            labels, dense, sp = columns(d)
            assert labels == want[f][0] and sp["site"][0] == [fnv(v) % ROWS for v in want[f][1]]
            assert dense[:, 0].tolist() == want[f][2]


def test_an_empty_sample_weight_is_named(tmp_path):
    p = tmp_path / "w.csv"
    p.write_text("label,w,c\n1,0.5,a\n0,,b\n1,2,c\n")
    schema = Schema.from_dict({"format": "csv", "weight": "w", "sparse": ["c"]})
    with pytest.raises(InputError, match=f"^{p}:3: w '' is not a number >= 0"):
        convert(schema, p, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        m = convert(schema, p, tmp_path / "o", progress=False, skip_malformed=True)
    assert m.rows == 2 and next(iter_shards(tmp_path / "o")).weights.tolist() == [0.5, 2.0]


JSONL = '{"label": 1, "c": "a", "x": 2}\n{"label": 0, "c": "b"}\n{"label": 1, "c": null, "x": null}\n'


def test_jsonl_record_without_a_declared_key(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(JSONL)
    with pytest.raises(InputError, match=f"^{p}:2: no key 'x'"):
        convert(Schema.from_dict({"format": "jsonl", "dense": ["x"], "sparse": ["c"]}), p, tmp_path / "o",
                progress=False)
    assert not (tmp_path / "o").exists()
    # optional: read as missing, counted and reported; an explicit null is a missing value, not an absent key
    schema = Schema.from_dict({"format": "jsonl", "dense": [{"column": "x", "optional": True, "missing": -1}],
                               "sparse": ["c"]})
    with pytest.warns(UserWarning, match="without an optional key, read as missing: x 1"):
        m = convert(schema, p, tmp_path / "o", table_rows=ROWS, progress=False)
    labels, dense, sp = columns(tmp_path / "o")
    assert m.extra["absent_keys"] == {"x": 1} and Manifest.load(tmp_path / "o").extra["absent_keys"] == {"x": 1}
    assert labels == [1, 0, 1] and dense[:, 0].tolist() == [2, -1, -1]
    assert sp["c"][0] == [fnv("a") % ROWS, fnv("b") % ROWS, 0]
    # a record without the label is named as such
    p.write_text(JSONL + '{"c": "d", "x": 1}\n')
    with pytest.raises(InputError, match=f"^{p}:4: no key 'label'"):
        convert(schema, p, tmp_path / "l", progress=False)


def test_a_file_without_header_takes_the_names_and_vocabulary_of_the_dataset_it_reuses(tmp_path):
    # the first dataset (with a header) counts site a 3 times, b twice, c once: vocab rows 1, 2, 3 by descending
    # count; the second file has no header, its schema names the columns, and --vocab-from gives the names
    first = tmp_path / "a.csv"
    first.write_text("label,site,x\n1,a,1\n0,b,2\n1,a,3\n0,c,4\n1,b,5\n0,a,6\n")
    second = tmp_path / "b.csv"
    second.write_text("1,c,7\n0,z,8\n1,a,9\n")
    named = {"format": "csv", "label": "label", "dense": ["x"], "sparse": ["site"]}
    convert(Schema.from_dict(named), first, tmp_path / "d1", categorical="vocab", progress=False)
    convert(Schema.from_dict({**named, "header": False}), second, tmp_path / "d2", vocab_from=tmp_path / "d1",
            progress=False)
    labels, dense, sp = columns(tmp_path / "d2")
    assert labels == [1, 0, 1] and sp["site"][0] == [3, 0, 1]  # c -> 3, z unseen -> 0, a -> 1
    assert Manifest.load(tmp_path / "d2").extra["columns"] == ["label", "site", "x"]
