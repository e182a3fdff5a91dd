"""The schema-driven tabular reader (data.tabular): every format, against an independent Python reading.

One small table, written as CSV (with and without a header), TSV, Parquet (a file and a directory),
JSON lines, libFM and libSVM, must read into identical shards, and those shards must hold what a plain
line-by-line Python reading of the CSV computes (labels, float dense values, FNV-1a keys modulo the table
rows, multi-hot lengths). Malformed input is named by file and line (Parquet: row) in every format and a
rejected input leaves no output directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedscale.data.criteo import convert_criteo
from embedscale.data.loader import ShardLoader
from embedscale.data.schema import Schema
from embedscale.data.shards import Manifest, iter_shards
from embedscale.data.tabular import convert
from embedscale.errors import ConfigError, InputError

REAL = Path(__file__).resolve().parents[2] / "shared/data/criteo_kaggle_head10k.tsv"
FIELDS = ["label", "d1", "d2", "c1", "c2", "tags"]
MASK64 = (1 << 64) - 1


def fnv(b: bytes) -> int:
    """FNV-1a 64, the reference: byte by byte in Python; the empty value is key 0."""
    if not b:
        return 0
    h = 0xCBF29CE484222325
    for c in b:
        h = ((h ^ c) * 0x100000001B3) & MASK64
    return h


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of the test table: d1 a float (sometimes missing), d2 an integer, c1 in [10, 99], c2 in
    [100, 999] (Zipf-ish, so vocabularies have ties and rare values), tags 0-3 values in [1000, 1999]."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        rows.append({
            "label": rng.choice([0, 1]),
            "d1": None if rng.random() < 0.2 else round(rng.uniform(-3, 50), 3),
            "d2": rng.randint(0, 1000),
            "c1": 10 + min(89, int(rng.paretovariate(1.2))),
            "c2": 100 + rng.randint(0, 40) ** 2 % 900,
            "tags": [1000 + rng.randint(0, 30) for _ in range(rng.randint(0, 3))],
        })
    return rows


def _num(v) -> str:
    return "" if v is None else (repr(v) if isinstance(v, float) else str(v))


def write_formats(d: Path, rows: list[dict], name: str = "t") -> dict[str, tuple[Path, dict]]:
    """The table in every format: {format: (path, schema dict)}."""
    d.mkdir(parents=True, exist_ok=True)
    common = {"label": "label", "dense": ["d1", "d2"], "sparse": ["c1", "c2", {"column": "tags", "separator": "|"}]}
    out = {}
    lines = [",".join([str(r["label"]), _num(r["d1"]), str(r["d2"]), str(r["c1"]), str(r["c2"]),
                       "|".join(map(str, r["tags"]))]) for r in rows]
    p = d / f"{name}.csv"
    p.write_text(",".join(FIELDS) + "\n" + "\n".join(lines) + "\n")
    out["csv"] = (p, {"format": "csv", **common})
    p = d / f"{name}_noheader.csv"
    p.write_text("\n".join(lines) + "\n")
    out["csv-noheader"] = (p, {"format": "csv", "header": False, "columns": FIELDS, **common})
    p = d / f"{name}.tsv"
    p.write_text("\n".join(line.replace(",", "\t") for line in lines) + "\n")
    out["tsv"] = (p, {"format": "tsv", "header": False, **common, "label": 0, "dense": [
        {"column": 1, "name": "d1"}, {"column": 2, "name": "d2"}], "sparse": [
        {"column": 3, "name": "c1"}, {"column": 4, "name": "c2"}, {"column": 5, "name": "tags", "separator": "|"}]})
    table = pa.table({"label": pa.array([r["label"] for r in rows], pa.int8()),
                      "d1": pa.array([r["d1"] for r in rows], pa.float64()),
                      "d2": pa.array([r["d2"] for r in rows], pa.int64()),
                      "c1": pa.array([r["c1"] for r in rows], pa.int32()),
                      "c2": pa.array([str(r["c2"]) for r in rows]),
                      "tags": pa.array([[str(t) for t in r["tags"]] for r in rows], pa.list_(pa.string()))})
    p = d / f"{name}.parquet"
    pq.write_table(table, p, row_group_size=97)
    out["parquet"] = (p, {"format": "parquet", **common, "sparse": ["c1", "c2", {"column": "tags", "multi_hot": True}]})
    pdir = d / f"{name}_parquet"
    pdir.mkdir()
    half = len(rows) // 2
    pq.write_table(table.slice(0, half), pdir / "part-0.parquet")
    pq.write_table(table.slice(half), pdir / "part-1.parquet")
    out["parquet-dir"] = (pdir, out["parquet"][1])
    p = d / f"{name}.jsonl"
    with p.open("w") as f:
        for i, r in enumerate(rows):
            obj = {k: v for k, v in r.items() if not (k == "d1" and v is None and i % 2)}  # null or absent
            f.write(json.dumps(obj) + "\n")
    out["jsonl"] = (p, {"format": "jsonl", **common, "dense": [{"column": "d1", "optional": True}, "d2"],
                        "sparse": ["c1", "c2", {"column": "tags", "multi_hot": True}]})  # d1 may be absent
    p = d / f"{name}.ffm"
    with p.open("w") as f:
        for r in rows:
            toks = [str(r["label"])] + ([f"0:0:{r['d1']!r}"] if r["d1"] is not None else [])
            toks += [f"1:0:{r['d2']}", f"2:{r['c1']}:1", f"3:{r['c2']}:1"] + [f"4:{t}:1" for t in r["tags"]]
            f.write(" ".join(toks) + "\n")
    out["libffm"] = (p, {"format": "libffm", "fields": FIELDS[1:], "label": "label", "dense": ["d1", "d2"],
                         "sparse": ["c1", "c2", {"column": "tags", "multi_hot": True}]})
    p = d / f"{name}.libsvm"
    with p.open("w") as f:
        for r in rows:
            toks = [str(r["label"])] + ([f"0:{r['d1']!r}"] if r["d1"] is not None else [])
            toks += [f"1:{r['d2']}", f"{r['c1']}:1", f"{r['c2']}:1"] + [f"{t}:1" for t in r["tags"]]
            f.write(" ".join(toks) + "\n")
    ranges = [{"name": "d1", "first": 0, "last": 0}, {"name": "d2", "first": 1, "last": 1},
              {"name": "c1", "first": 10, "last": 99}, {"name": "c2", "first": 100, "last": 999},
              {"name": "tags", "first": 1000, "last": 1999}]
    out["libsvm"] = (p, {**out["libffm"][1], "format": "libsvm", "fields": ranges})
    out["libfm"] = (p, {**out["libsvm"][1], "format": "libfm"})  # libFM reads SVMlight's format
    return out


def read_all(directory: Path):
    cols = list(iter_shards(directory))
    labels = np.concatenate([c.labels for c in cols])
    dense = np.concatenate([c.dense for c in cols])
    sparse = {n: (np.concatenate([c.sparse[n][0] for c in cols]), np.concatenate([c.sparse[n][1] for c in cols]))
              for n in cols[0].sparse}
    return labels, dense, sparse


def assert_same_dataset(a: Path, b: Path) -> None:
    ma, mb = Manifest.load(a), Manifest.load(b)
    assert [vars(s) for s in ma.sparse] == [vars(s) for s in mb.sparse] and ma.dense_names == mb.dense_names
    assert [s["rows"] for s in ma.shards] == [s["rows"] for s in mb.shards]
    for sa, sb in zip(ma.shards, mb.shards):
        ta = pa.ipc.open_file(pa.memory_map(str(a / sa["file"]))).read_all()
        tb = pa.ipc.open_file(pa.memory_map(str(b / sb["file"]))).read_all()
        assert ta.equals(tb), f"{a} and {b} differ"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    rows = make_rows(700)
    return rows, write_formats(d, rows)


@pytest.mark.parametrize("categorical", ["hash", "vocab"])
def test_every_format_reads_into_identical_shards(table, tmp_path, categorical):
    rows, files = table
    kw = dict(categorical=categorical, min_frequency=2, shard_rows=300, progress=False, block_bytes=4096)
    ref = None
    for fmt, (path, schema) in files.items():
        out = tmp_path / fmt
        convert(Schema.from_dict(schema), path, out, **kw)
        if ref is None:
            ref = out
        else:
            assert_same_dataset(ref, out)
    # and they hold what a plain reading of the rows says
    m = Manifest.load(ref)
    labels, dense, sparse = read_all(ref)
    assert labels.tolist() == [r["label"] for r in rows]
    want_dense = np.array([[0.0 if r["d1"] is None else r["d1"], r["d2"]] for r in rows], np.float32)
    np.testing.assert_array_equal(dense, want_dense)
    rows_of = {s.name: s.num_rows for s in m.sparse}
    for name in ("c1", "c2"):
        keys = [fnv(str(r[name]).encode()) for r in rows]
        if categorical == "hash":
            distinct = len(set(keys))
            assert rows_of[name] == math.ceil(distinct / 0.5)  # sized from the data
            want = [k % rows_of[name] for k in keys]
        else:
            counts: dict = {}
            for k in keys:
                counts[k] = counts.get(k, 0) + 1
            kept = sorted((k for k in counts if counts[k] >= 2), key=lambda k: (-counts[k], k))
            row = {k: i + 1 for i, k in enumerate(kept)}
            assert rows_of[name] == len(kept) + 1
            want = [row.get(k, 0) for k in keys]
        assert sparse[name][0].tolist() == want, name
    values, lengths = sparse["tags"]
    assert lengths.tolist() == [len(r["tags"]) for r in rows]
    tag_keys = [fnv(str(t).encode()) for r in rows for t in r["tags"]]
    if categorical == "hash":
        assert values.tolist() == [k % rows_of["tags"] for k in tag_keys]
    assert m.sparse[2].multi_hot


def test_criteo_preset_is_bitwise_todays_reader(tmp_path):
    """The shards of the real 10k rows, hash with 1,000,003 rows and vocab with min_frequency 2, 4,000 rows per
    shard (sha256 of each shard's columns: name, then the values' bytes, column by column). Labels and
    categorical columns are the bytes the Criteo reader wrote before it became a schema of the tabular reader;
    the dense column is log1p computed in float64 and rounded once (``decode.log1p_float32``), the same bits on
    every CPU, where that reader's float32 log1p differed from it by one ulp in 3-4% of values depending on the
    CPU's SIMD path. The column hashes were taken from the files of the single-record-batch layout (whose
    sha256 were 8ed89ab5.., 70238dd9.., 3989ae6b..; 9f14998e.., 11b868bf.., 3d04b47f..); the page-aligned layout
    (``data.shards``) writes the same values in other record batches."""
    if not REAL.exists():
        pytest.skip(f"real Criteo sample not found at {REAL} (see shared/data/README.md)")
    before = {
        "hash": ["520cd0e11579c97efa84008e1f032cd0bc438ed93a28c809f50b4961aca4f181",
                 "5ab4f6b2eede1e6fc089d0a702f96c9b3c9d78009c4040d03472aee5e56eb6f8",
                 "6eaf0faa71acbe3a5f51272a1dac50acec39c8aa2dcd78f78e491b2a21e9b521"],
        "vocab": ["2aaf10500d42576ae33329bbf4c2e781624a66199a626036735b9ee70c1e3600",
                  "2f36662c8c710060d558da0366a29c596261bb547578e658aaeeffef8a3cb35b",
                  "5141ad9c8ba8205ce249e7d54fa1fad183eeb64246cc20bfbd44b7b03e128a47"]}
    for mode, kw in (("hash", {"table_rows": 1_000_003}), ("vocab", {"categorical": "vocab", "min_frequency": 2})):
        m = convert_criteo(REAL, tmp_path / mode, shard_rows=4000, progress=False, **kw)
        got = [columns_sha256(tmp_path / mode / s["file"]) for s in m.shards]
        assert got == before[mode], mode


def columns_sha256(path: Path) -> str:
    """sha256 of an Arrow file's columns (pyarrow): each column's name, then its values' bytes."""
    import pyarrow.ipc as ipc

    table = ipc.open_file(pa.py_buffer(path.read_bytes())).read_all()
    h = hashlib.sha256()
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        col = col.flatten() if pa.types.is_fixed_size_list(col.type) else col
        h.update(name.encode())
        h.update(col.to_numpy().tobytes())
    return h.hexdigest()


def test_vocabulary_carries_to_another_file(tmp_path):
    rows = make_rows(600, seed=1)
    later = make_rows(300, seed=2)
    for r in later[::7]:
        r["c1"], r["c2"] = 12345, 67890  # never seen in training
    train = write_formats(tmp_path / "a", rows)["csv"]
    day2 = write_formats(tmp_path / "b", later)["csv"]
    schema = Schema.from_dict(train[1])
    m = convert(schema, train[0], tmp_path / "train", categorical="vocab", progress=False)
    m2 = convert(schema, day2[0], tmp_path / "day2", vocab_from=tmp_path / "train", progress=False)
    assert [s.num_rows for s in m2.sparse] == [s.num_rows for s in m.sparse]
    _, _, sp = read_all(tmp_path / "train")
    _, _, sp2 = read_all(tmp_path / "day2")
    for name in ("c1", "c2"):
        row_of = dict(zip((r[name] for r in rows), sp[name][0].tolist()))  # the training rows' encoding
        want = [row_of.get(r[name], 0) for r in later]  # seen: the same row; unseen: the OOV row 0
        assert sp2[name][0].tolist() == want
        assert 0 in want and any(w > 0 for w in want)
    # eval and test files given beside train are encoded the same way, into out/eval and out/test
    m3 = convert(schema, {"train": [train[0]], "eval": [day2[0]], "test": [day2[0]]}, tmp_path / "split",
                 categorical="vocab", progress=False)
    assert m3.extra["splits"] == {"eval": "eval", "test": "test"} and m3.rows == len(rows)
    for sub in ("eval", "test"):
        assert_same_dataset(tmp_path / "day2", tmp_path / "split" / sub)


def test_split_and_time_columns(tmp_path):
    rows = make_rows(400, seed=3)
    lines = ["label,t,split,c1"] + [f"{r['label']},{i},{('train', 'eval', 'test')[i % 3]},{r['c1']}"
                                    for i, r in enumerate(rows)]
    p = tmp_path / "s.csv"
    p.write_text("\n".join(lines) + "\n")
    schema = Schema.from_dict({"format": "csv", "sparse": ["c1"]})
    m = convert(schema, p, tmp_path / "bycol", split_column="split", categorical="vocab", progress=False)
    assert m.rows == len(range(0, 400, 3)) and Manifest.load(tmp_path / "bycol" / "eval").rows == len(range(1, 400, 3))
    keys_train = {r["c1"] for i, r in enumerate(rows) if i % 3 == 0}
    assert m.sparse[0].num_rows == len(keys_train) + 1  # the vocabulary is the training rows' alone
    m = convert(schema, p, tmp_path / "bytime", time_column="t", eval_from="300", test_from="350",
                table_rows=101, progress=False)
    assert (m.rows, Manifest.load(tmp_path / "bytime" / "eval").rows,
            Manifest.load(tmp_path / "bytime" / "test").rows) == (300, 50, 50)
    labels, _, sp = read_all(tmp_path / "bytime" / "test")
    assert labels.tolist() == [r["label"] for r in rows[350:]]
    assert sp["c1"][0].tolist() == [fnv(str(r["c1"]).encode()) % 101 for r in rows[350:]]


def test_header_auto_reads_a_test_file_without_header(tmp_path):
    rows = make_rows(50, seed=4)
    files = write_formats(tmp_path, rows)
    schema = Schema.from_dict({**files["csv"][1], "header": "auto"})
    m = convert(schema, {"train": [files["csv"][0]], "test": [files["csv-noheader"][0]]}, tmp_path / "o",
                progress=False)
    assert m.rows == 50 and Manifest.load(tmp_path / "o" / "test").rows == 50


def test_zero_dense_and_zero_categorical_columns(tmp_path):
    rows = make_rows(30, seed=5)
    path = write_formats(tmp_path, rows)["csv"][0]
    m = convert(Schema.from_dict({"format": "csv", "sparse": ["c1"]}), path, tmp_path / "nodense", progress=False)
    labels, dense, sp = read_all(tmp_path / "nodense")
    assert m.num_dense == 0 and dense.shape == (30, 0) and len(sp["c1"][0]) == 30
    m = convert(Schema.from_dict({"format": "csv", "dense": ["d2"]}), path, tmp_path / "nosparse", progress=False)
    assert m.sparse == [] and Manifest.load(tmp_path / "nosparse").rows == 30


def test_labels_weights_and_transforms(tmp_path):
    p = tmp_path / "w.csv"
    p.write_text("y,w,x,z\n-1,0.5,1,3\n1,2,3,-1\n+1,1,,8\n")
    schema = Schema.from_dict({"format": "csv", "label": "y", "label_values": "-1/1", "weight": "w",
                               "dense": [{"column": "x", "transform": "standardise", "missing": 2},
                                         {"column": "z", "transform": "log1p"}]})
    m = convert(schema, p, tmp_path / "o", progress=False)
    cols = next(iter_shards(tmp_path / "o"))
    assert m.weighted and cols.labels.tolist() == [0, 1, 1] and cols.weights.tolist() == [0.5, 2.0, 1.0]
    x = np.array([1.0, 3.0, 2.0])
    np.testing.assert_allclose(cols.dense[:, 0], (x - x.mean()) / x.std(), rtol=1e-6)
    np.testing.assert_allclose(cols.dense[:, 1], np.log1p(np.maximum([3.0, -1.0, 8.0], 0)), rtol=1e-6)


BAD = {  # format -> (how to break row 5 of the table, the message)
    "csv": ("d1", "x1", "d1 'x1' is not a finite number"),
    "tsv": (None, None, "expected 6 fields, got 7"),
    "parquet": ("label", 2, "label '2' is not 0 or 1"),
    "jsonl": (None, None, "not a JSON object"),
    "libffm": (None, None, "'2:17' is not field:index:value"),
    "libsvm": ("c1", 5000, "c1 '5000' is not 1"),
}


@pytest.mark.parametrize("fmt", list(BAD))
def test_malformed_input_is_named_by_file_and_line(tmp_path, fmt):
    rows = make_rows(40, seed=6)
    files = write_formats(tmp_path / "ok", rows)
    path, schema = files[fmt]
    col, value, message = BAD[fmt]
    bad = tmp_path / "bad"
    bad.mkdir()
    target = bad / path.name
    if fmt == "parquet":
        t = pq.read_table(path)
        labels = t.column("label").to_pylist()
        labels[5] = value
        pq.write_table(t.set_column(0, "label", pa.array(labels, pa.int8())), target)
        where = f"{target}: row 5: "
    else:
        lines = path.read_text().splitlines()
        i = 5 + (1 if fmt == "csv" else 0)  # the csv has a header line
        if fmt == "csv":
            f = lines[i].split(",")
            f[1] = value
            lines[i] = ",".join(f)
        elif fmt == "tsv":
            lines[i] += "\textra"
        elif fmt == "jsonl":
            lines[i] = lines[i][:-3]
        elif fmt == "libffm":
            lines[i] = lines[i] + " 2:17"
        else:
            lines[i] = lines[i].replace(f" {rows[5]['c1']}:1", f" {rows[5]['c1']}:2")
            message = f"c1 '{rows[5]['c1']}'"  # libsvm names the field, the index and the value
            message = "c1 value '2' is not 1"
        target.write_text("\n".join(lines) + "\n")
        where = f"{target}:{i + 1}: "
    out = tmp_path / "out"
    with pytest.raises(InputError) as e:
        convert(Schema.from_dict(schema), target, out, progress=False, block_bytes=512)
    assert str(e.value).startswith(where) and message in str(e.value), str(e.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        m = convert(Schema.from_dict(schema), target, out, progress=False, skip_malformed=True, block_bytes=512)
    assert m.rows == 39 and m.extra["skipped"]["examples"][0].startswith(where)


def test_bad_schemas_are_named(tmp_path):
    with pytest.raises(ConfigError, match="format 'xls'"):
        Schema.from_dict({"format": "xls"})
    with pytest.raises(ConfigError, match="unknown key.*colour"):
        Schema.from_dict({"colour": 1})
    with pytest.raises(ConfigError, match="transform 'log'"):
        Schema.from_dict({"dense": [{"column": "x", "transform": "log"}]})
    p = tmp_path / "t.csv"
    p.write_text("label,a\n1,2\n")
    with pytest.raises(ConfigError, match="column 'b' is not among the file's columns"):
        convert(Schema.from_dict({"sparse": ["b"]}), p, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an embedscale dataset"):
        convert(Schema.from_dict({"sparse": ["a"]}), p, tmp_path / "stuff", progress=False)


def test_cli_table_flags_and_errors(tmp_path):
    rows = make_rows(60, seed=7)
    files = write_formats(tmp_path, rows)
    exe = [sys.executable, "-m", "embedscale", "data", "table"]
    r = subprocess.run(exe + [str(files["csv"][0]), "--dense", "d1,d2", "--sparse", "c1,c2", "--multi-hot", "tags:|",
                              "--out", str(tmp_path / "cli"), "--no-progress", "--table-rows", "c1=7"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    convert(Schema.from_dict(files["csv"][1]), files["csv"][0], tmp_path / "api", table_rows={"c1": 7}, progress=False)
    assert_same_dataset(tmp_path / "api", tmp_path / "cli")
    assert Manifest.load(tmp_path / "cli").sparse[0].num_rows == 7
    r = subprocess.run(exe + [str(files["csv"][0]), "--sparse", "nope", "--out", str(tmp_path / "x"), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "error: " in r.stderr and "'nope'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()


def test_loader_hands_out_sample_weights(tmp_path):
    p = tmp_path / "w.csv"
    rng = random.Random(8)
    rows = [(rng.choice([0, 1]), round(rng.uniform(0, 3), 2), rng.randint(0, 9)) for _ in range(50)]
    p.write_text("label,w,c\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    convert(Schema.from_dict({"format": "csv", "weight": "w", "sparse": ["c"]}), p, tmp_path / "o", shard_rows=17,
            progress=False)
    got = [b.weights for b in ShardLoader(tmp_path / "o", batch_size=8, shuffle=True, seed=1)]
    labels = [b.labels for b in ShardLoader(tmp_path / "o", batch_size=8, shuffle=True, seed=1)]
    w = torch.cat(got).tolist()
    by_label = sorted(zip(torch.cat(labels).tolist(), w))
    assert by_label == sorted((float(a), float(np.float32(b))) for a, b, _ in rows)
    first = next(iter(ShardLoader(tmp_path / "o", batch_size=8)))
    assert first.weights.tolist() == [float(np.float32(b)) for _, b, _ in rows[:8]]
    assert first.for_rank(1, 2).weights.tolist() == first.weights[4:].tolist()
