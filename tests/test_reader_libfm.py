"""libFM (SVMlight's ``label index:value``), libSVM and libFFM (``label field:index:value``) files, read by the
tabular reader, against tables worked out by hand from the lines the tests write.

libFM's own text format is ``label index:value ...`` (libFM 1.4.2 manual, section 2.1): by default every
index is an id of one table and a line is a bag of its indices; with index ranges, one table per field.
Values of categorical ids are bag weights: 1 is read, anything else is named, never dropped in silence.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from embedscale.data.schema import Schema
from embedscale.data.shards import Manifest, iter_shards
from embedscale.data.tabular import convert
from embedscale.errors import ConfigError, InputError

# a Frappe-like file: labels -1/1, every value 1 (written as 1 or 1.0), an empty bag, an index repeated
LIBFM = """1 3:1 7:1 12:1
-1 7:1
1
-1 5:1.0 3:1 3:1
1 120:1 0:1
"""
BAGS = [[3, 7, 12], [7], [], [5, 3, 3], [120, 0]]  # the indices of each line, in order
LABELS = [1, 0, 1, 0, 1]


def bags(directory) -> tuple[list[int], dict[str, list[list[int]]]]:
    """(labels, {feature: the ids of each row}) of a dataset."""
    labels, out = [], {}
    for cols in iter_shards(directory):
        labels += cols.labels.tolist()
        for name, (values, lengths) in cols.sparse.items():
            ends = np.cumsum(lengths)
            out.setdefault(name, []).extend(values[e - n:e].tolist() for e, n in zip(ends, lengths))
    return labels, out


def test_libfm_file_is_one_table_of_bags(tmp_path):
    p = tmp_path / "frappe.libfm"
    p.write_text(LIBFM)
    m = convert(Schema.from_dict({"format": "libfm", "label_values": "-1/1"}), p, tmp_path / "o", table_rows=10,
                shard_rows=2, progress=False)
    assert m.num_dense == 0 and [(s.name, s.num_rows, s.multi_hot) for s in m.sparse] == [("features", 10, True)]
    labels, got = bags(tmp_path / "o")
    assert labels == LABELS
    assert got["features"] == [[i % 10 for i in bag] for bag in BAGS]  # key = the index, hashed by rows
    # vocabulary: rows by descending count, ties by ascending index (3: 3 times, 7: 2, then 0, 5, 12, 120)
    convert(Schema.from_dict({"format": "libfm", "label_values": "-1/1"}), p, tmp_path / "v", categorical="vocab",
            progress=False)
    row = {3: 1, 7: 2, 0: 3, 5: 4, 12: 5, 120: 6}
    assert bags(tmp_path / "v")[1]["features"] == [[row[i] for i in bag] for bag in BAGS]
    # the one table, named and sized in the schema
    named = {"format": "libfm", "label_values": "-1/1", "sparse": [{"column": "ids", "key": "int", "rows": 7}]}
    m = convert(Schema.from_dict(named), p, tmp_path / "n", progress=False)
    assert [(s.name, s.num_rows) for s in m.sparse] == [("ids", 7)]
    assert bags(tmp_path / "n")[1]["ids"] == [[i % 7 for i in bag] for bag in BAGS]


def test_libfm_weight_other_than_one_is_named(tmp_path):
    p = tmp_path / "w.libfm"
    p.write_text(LIBFM.replace("-1 7:1", "-1 7:0.5"))
    schema = Schema.from_dict({"format": "libfm", "label_values": "-1/1"})
    with pytest.raises(InputError) as e:
        convert(schema, p, tmp_path / "o", progress=False)
    assert str(e.value).startswith(f"{p}:2: features value '0.5' is not 1 (index 7") and "weight" in str(e.value)
    assert not (tmp_path / "o").exists()
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        m = convert(schema, p, tmp_path / "o", progress=False, skip_malformed=True, table_rows=1000)
    assert m.extra["skipped"]["count"] == 1
    assert bags(tmp_path / "o")[1]["features"] == [b for i, b in enumerate(BAGS) if i != 1]


def test_libfm_field_ranges_make_one_table_per_field(tmp_path):
    p = tmp_path / "r.libfm"
    p.write_text("1 2:1 15:1 17:1\n0 9:1 10:1\n")
    ranges = [{"name": "user", "first": 0, "last": 9}, {"name": "item", "first": 10, "last": 29}]
    m = convert(Schema.from_dict({"format": "libfm", "fields": ranges}), p, tmp_path / "o", table_rows=100,
                progress=False)
    assert [s.name for s in m.sparse] == ["user", "item"] and all(s.multi_hot for s in m.sparse)
    _, got = bags(tmp_path / "o")
    assert got == {"user": [[2], [9]], "item": [[15, 17], [10]]}
    # a dense field: its value is the feature; a one-hot field: the index is the key
    p = tmp_path / "price.libfm"
    p.write_text("1 2:1 15:1 17:1 30:0.25\n0 9:1 10:1 30:4\n")
    price = ranges + [{"name": "price", "first": 30, "last": 30}]
    convert(Schema.from_dict({"format": "libfm", "fields": price, "dense": ["price"],
                              "sparse": [{"column": "user", "key": "int"}]}), p, tmp_path / "d", table_rows=100,
            progress=False)
    cols = next(iter_shards(tmp_path / "d"))
    assert cols.dense[:, 0].tolist() == [0.25, 4.0] and cols.sparse["user"][0].tolist() == [2, 9]
    # an index beyond every range: named with its file and line, no dataset
    with pytest.raises(InputError, match=f"^{p}:1: index 30 is in no field of the schema"):
        convert(Schema.from_dict({"format": "libfm", "fields": ranges}), p, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_libffm_reads_field_index_value(tmp_path):
    p = tmp_path / "t.ffm"
    p.write_text("1 0:5:1 1:17:1 1:18:1 2:0:3.5\n0 0:6:1 2:0:-1\n")
    schema = {"format": "libffm", "fields": ["user", "tags", "price"], "dense": ["price"],
              "sparse": [{"column": "user", "key": "int"}, {"column": "tags", "key": "int", "multi_hot": True}]}
    m = convert(Schema.from_dict(schema), p, tmp_path / "o", table_rows=100, progress=False)
    labels, got = bags(tmp_path / "o")
    assert labels == [1, 0] and got == {"user": [[5], [6]], "tags": [[17, 18], []]}
    assert next(iter_shards(tmp_path / "o")).dense[:, 0].tolist() == [3.5, -1.0]
    assert m.sparse[1].multi_hot and not m.sparse[0].multi_hot
    # named fields without feature lists: every field a table of bags
    two = tmp_path / "u.ffm"
    two.write_text("1 0:5:1 1:17:1 1:18:1\n")
    convert(Schema.from_dict({"format": "libffm", "fields": ["user", "tags"]}), two, tmp_path / "n", table_rows=100,
            progress=False)
    assert bags(tmp_path / "n")[1] == {"user": [[5]], "tags": [[17, 18]]}
    # a field number beyond the named fields is named, not dropped
    with pytest.raises(InputError, match=f"^{p}:1: field 2 .* is beyond the schema's 2 fields"):
        convert(Schema.from_dict({"format": "libffm", "fields": ["user", "tags"]}), p, tmp_path / "x", progress=False)
    with pytest.raises(ConfigError, match="'item' name no libffm field"):
        Schema.from_dict({"format": "libffm", "fields": ["user", "tags"], "sparse": ["item"]})
    # the SVMlight reader names a field:index:value pair
    with pytest.raises(InputError, match=f"^{p}:1: '0:5:1' is not index:value"):
        convert(Schema.from_dict({"format": "libfm"}), p, tmp_path / "x", progress=False)


def test_libsvm_without_ranges_is_one_table_not_none(tmp_path):
    p = tmp_path / "a.libsvm"
    p.write_text(LIBFM.replace("-1 ", "0 "))
    r = subprocess.run([sys.executable, "-m", "embedscale", "data", "table", str(p), "--out", str(tmp_path / "o"),
                        "--table-rows", "1000", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "1 sparse features" in r.stdout and "features 1,000" in r.stdout
    m = Manifest.load(tmp_path / "o")
    assert [s.name for s in m.sparse] == ["features"] and bags(tmp_path / "o") == (LABELS, {"features": BAGS})
    # dense features need index ranges: a named error, not a dataset
    with pytest.raises(ConfigError, match="without field ranges"):
        Schema.from_dict({"format": "libsvm", "dense": ["x"]})
    with pytest.raises(ConfigError, match="'price' name no field of the index ranges"):
        Schema.from_dict({"format": "libfm", "fields": [{"name": "a", "first": 0, "last": 5}], "dense": ["price"]})
    with pytest.raises(ConfigError, match="overlap"):
        Schema.from_dict({"format": "libsvm", "fields": [{"name": "a", "first": 0, "last": 5},
                                                         {"name": "b", "first": 5, "last": 9}]})


def test_id_weights_reach_the_pooled_embedding(tmp_path):
    """``id_weights: true`` keeps a bag's values: in the shards, in the loader's ``JaggedFeatures.weights``
    (1 for a feature without), and in the pooled lookup, against a float64 weighted sum of the table's rows."""
    import torch

    from embedscale.data.loader import ShardLoader
    from embedscale.embedding.local import LocalEmbeddingBags
    from embedscale.specs import TableSpec

    p = tmp_path / "w.libfm"
    p.write_text("1 2:1 11:0.5 13:2\n0 5:1 12:-1.5\n1 11:3e-1\n")
    ranges = [{"name": "user", "first": 0, "last": 9}, {"name": "item", "first": 10, "last": 19}]
    schema = {"format": "libfm", "fields": ranges,
              "sparse": [{"column": "user", "key": "int", "multi_hot": True},
                         {"column": "item", "key": "int", "id_weights": True}]}
    m = convert(Schema.from_dict(schema), p, tmp_path / "o", table_rows=20, progress=False)
    assert [(s.name, s.id_weights) for s in m.sparse] == [("user", False), ("item", True)]
    cols = next(iter_shards(tmp_path / "o"))
    assert cols.sparse["item"][0].tolist() == [11, 13, 12, 11] and cols.id_weights["item"].tolist() == [0.5, 2, -1.5, float(np.float32(0.3))]
    batch = next(iter(ShardLoader(tmp_path / "o", batch_size=3)))
    # key-major: user's ids (2 | 5 | -), then item's (11 13 | 12 | 11)
    assert batch.sparse.values.tolist() == [2, 5, 11, 13, 12, 11]
    assert batch.sparse.weights.tolist() == [1, 1, 0.5, 2, -1.5, float(np.float32(0.3))]
    # shuffled, in batches of 2: every bag keeps its own weights
    pairs = []
    for b in ShardLoader(tmp_path / "o", batch_size=2, shuffle=True, seed=3):
        bag_sizes = b.sparse.lengths.view(2, -1)[1].tolist()
        n_user = int(b.sparse.lengths.view(2, -1)[0].sum())
        ids, ws = b.sparse.values[n_user:].tolist(), b.sparse.weights[n_user:].tolist()
        assert b.sparse.weights[:n_user].tolist() == [1.0] * n_user
        for k in bag_sizes:
            pairs.append(tuple(zip(ids[:k], ws[:k])))
            ids, ws = ids[k:], ws[k:]
    w03 = float(np.float32(0.3))
    assert sorted(pairs) == sorted([((11, 0.5), (13, 2.0)), ((12, -1.5),), ((11, w03),)])
    emb = LocalEmbeddingBags([TableSpec("user", 20, 4), TableSpec("item", 20, 4)], optimizer=None, seed=0)
    out = emb(batch.sparse).double()
    U, I = emb.table_weight("user").double(), emb.table_weight("item").double()
    want = torch.stack([torch.cat([U[2], 0.5 * I[11] + 2 * I[13]]), torch.cat([U[5], -1.5 * I[12]]),
                        torch.cat([torch.zeros(4, dtype=torch.float64), float(np.float32(0.3)) * I[11]])])
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # without id_weights, a value other than 1 is named (the default keeps weight-1 bags)
    with pytest.raises(InputError, match=f"^{p}:1: item value '0.5' is not 1 .*id_weights: true"):
        convert(Schema.from_dict({"format": "libfm", "fields": ranges}), p, tmp_path / "x", progress=False)
    with pytest.raises(ConfigError, match="id_weights are the values of libfm"):
        Schema.from_dict({"format": "csv", "sparse": [{"column": "c", "id_weights": True}]})
