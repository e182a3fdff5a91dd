"""Data paths a user relies on, against plain-Python references.

- two resumes within one stream shard (``data.stream``): the rows three loaders hand out, each started at the
  position the previous one stopped at, equal the stream's rows in order, read by numpy from the shards'
  source columns (no row twice, none missing);
- an empty sample-weight field (``data.decode``): named by file, line and column (the reader's behaviour at
  this branch's base; narrow on purpose: the readers are being reworked);
- ``header: auto`` with a positional label (``data.tabular``): a file's first line is a header exactly when
  its label field is not a label, as a line-by-line Python reading decides.
"""

from __future__ import annotations

import numpy as np
import pytest

from embedscale.data.schema import Schema
from embedscale.data.shards import iter_shards
from embedscale.data.stream import StreamLoader, StreamWriter
from embedscale.data.tabular import convert
from embedscale.errors import InputError

from test_reader import fnv
from test_stream_train import DENSE, SPARSE, shard_columns

SHARDS, SHARD_ROWS, BATCH = 3, 130, 50  # shard_columns makes 130 rows a shard


# -- two resumes within one stream shard -------------------------------------------------------------------------

def _take(loader: StreamLoader, n: int | None):
    """The first ``n`` batches (all with ``None``): their dense rows, labels, one sparse feature's ids, and the
    position after the last."""
    dense, labels, ids, pos = [], [], [], None
    for k, b in enumerate(loader):
        if n is not None and k == n:
            break
        dense.append(b.dense.numpy())
        labels.append(b.labels.numpy())
        ids.append(b.sparse.to_dict()["C3"][0].numpy())
        pos = b.stream_position
    return dense, labels, ids, pos


def test_two_resumes_within_one_shard_read_every_row_once(tmp_path):
    d = tmp_path / "in"
    w = StreamWriter(d, DENSE, SPARSE)
    src = [shard_columns(k) for k in range(SHARDS)]
    for cols in src:
        w.write_shard(*cols)
    w.end()
    # the reference: the shards' rows in order (numpy, from the columns written)
    want_dense = np.concatenate([c[1] for c in src])
    want_labels = np.concatenate([c[0] for c in src]).astype(np.float32)
    want_ids = np.concatenate([c[2]["C3"] for c in src])

    parts = ([], [], [])
    pos = None
    stops = []
    for n in (3, 1, None):  # 150 rows (shard 1, row 20); 50 more (shard 1, row 70); the rest
        ld = StreamLoader(d, BATCH, prefetch=0)
        ld.seek(pos)
        dn, lb, ids, pos = _take(ld, n)
        for acc, x in zip(parts, (dn, lb, ids)):
            acc.extend(x)
        stops.append(pos)
    # both stops lie inside shard 1, at the rows a plain count gives
    assert stops[0] == {"shard": 1, "row": 150 - SHARD_ROWS}
    assert stops[1] == {"shard": 1, "row": 200 - SHARD_ROWS}
    assert stops[2] == {"shard": SHARDS, "row": 0}
    np.testing.assert_array_equal(np.concatenate(parts[0]), want_dense)
    np.testing.assert_array_equal(np.concatenate(parts[1]), want_labels)
    np.testing.assert_array_equal(np.concatenate(parts[2]), want_ids)


# -- an empty sample-weight field ----------------------------------------------------------------------------------

def test_an_empty_sample_weight_is_named_by_file_line_and_column(tmp_path):
    """A weight is a number >= 0; an empty field is not one: the reader names the file, the line (the header
    is line 1) and the column, and writes nothing. A weight of 0 is a weight."""
    p = tmp_path / "w.csv"
    p.write_text("label,w,c\n1,0.5,a\n0,0,b\n1,,c\n0,2,d\n")
    schema = Schema.from_dict({"format": "csv", "weight": "w", "sparse": ["c"]})
    with pytest.raises(InputError, match=r"w\.csv:4: w '' is not a number >= 0"):
        convert(schema, p, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
    p.write_text("label,w,c\n1,0.5,a\n0,0,b\n1,3,c\n0,2,d\n")
    m = convert(schema, p, tmp_path / "o", progress=False)
    assert m.weighted and next(iter_shards(tmp_path / "o")).weights.tolist() == [0.5, 0.0, 3.0, 2.0]


# -- header: auto with a positional label ----------------------------------------------------------------------------

def _python_read(path, label_at: int, rows: int):
    """Line by line: the first line is a header when its label field is not 0 or 1; every other line a row."""
    lines = path.read_text().splitlines()
    fields = [ln.split(",") for ln in lines]
    if fields and fields[0][label_at] not in ("0", "1"):
        fields = fields[1:]
    return ([int(f[label_at]) for f in fields], [float(f[0]) for f in fields],
            [fnv(f[1].encode()) % rows for f in fields])


def test_header_auto_with_a_positional_label_reads_files_with_and_without_a_header(tmp_path):
    """The label is column 2 (a position: no name to look for). Column 0 holds numbers that are not labels
    (7, 5, ...), so a rule that looked at another column than the label's would take a data line for a header."""
    with_header = tmp_path / "h.csv"
    without = tmp_path / "n.csv"
    with_header.write_text("price,site,click,tag\n7,x,1,p\n3,y,0,q\n4,x,0,q\n")
    without.write_text("5,z,0,r\n9,x,1,p\n2,y,1,q\n")
    rows = 101
    schema = Schema.from_dict({"format": "csv", "header": "auto", "label": 2, "dense": [0], "sparse": [1, 3]})
    convert(schema, {"train": [without, with_header], "test": [without]}, tmp_path / "o", table_rows=rows,
            progress=False)
    for split, files in (("", [without, with_header]), ("test", [without])):
        want = [sum(x, []) for x in zip(*[_python_read(f, 2, rows) for f in files])]
        shards = list(iter_shards(tmp_path / "o" / split if split else tmp_path / "o"))
        labels = np.concatenate([c.labels for c in shards]).tolist()
        dense = np.concatenate([c.dense[:, 0] for c in shards]).tolist()
        site = np.concatenate([c.sparse["c1"][0] for c in shards]).tolist()
        assert (labels, dense, site) == tuple(want), split
