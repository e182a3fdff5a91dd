"""Restore reads only a rank's rows: the checkpoint manifest's row index and ``RowReader``, against the tables
materialised by hand (a 4-rank checkpoint re-sharded onto 3 ranks) and against ``load_checkpoint`` (which
reads every rank file whole) on a real run's checkpoint; the bytes a re-sharding restore reads, counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedscale.errors import FormatError
from embedscale.train.checkpoint import load_checkpoint, read_manifest, write_manifest, write_rank_file
from embedscale.train.ckpt_rows import RowReader, row_runs

A_ROWS, A_DIM, B_ROWS, B_DIM = 1000, 8, 600, 4


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Table ``a``: rank r holds rows [250 r, 250 (r + 1)) (row-wise); table ``b``: rank r holds rows r, r + 4, ...
    (scattered). Both with row-wise Adagrad state."""
    d = tmp_path_factory.mktemp("ck")
    g = torch.Generator().manual_seed(1)
    A, Am = torch.randn(A_ROWS, A_DIM, generator=g), torch.rand(A_ROWS, generator=g)
    B, Bm = torch.randn(B_ROWS, B_DIM, generator=g), torch.rand(B_ROWS, generator=g)
    for r in range(4):
        ra = torch.arange(250 * r, 250 * (r + 1))
        rb = torch.arange(r, B_ROWS, 4)
        write_rank_file(d, r, {"rank": r, "tables": {"a": {"rows": ra, "weight": A[ra].clone(), "momentum": Am[ra].clone()},
                                                      "b": {"rows": rb, "weight": B[rb].clone(), "momentum": Bm[rb].clone()}}})
    write_manifest(d, 4, {"tables": ["a", "b"], "table_rows": [A_ROWS, B_ROWS]})
    return d, {"a": (A, Am), "b": (B, Bm)}


def test_runs_of_consecutive_rows():
    assert row_runs(np.array([5, 6, 7] + list(range(100, 400)))) == [[5, 8, 0], [100, 400, 3]]
    assert row_runs(np.arange(0, 600, 4)) is None  # one run per row: indexed by count only
    assert row_runs(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("q", [0, 1, 2])
def test_a_rank_of_three_reads_its_rows_of_a_four_rank_checkpoint(four_ranks, q):
    d, ref = four_ranks
    m = read_manifest(d)
    runs = {t: {k: e[k] for k in ("rows", "runs")} for t, e in m["index"]["rank-00001.pt"].items()}  # "at": S3's
    assert runs["a"] == {"rows": 250, "runs": [[250, 500, 0]]}
    assert runs["b"] == {"rows": 150, "runs": None}
    rows = np.arange(A_ROWS * q // 3, A_ROWS * (q + 1) // 3)
    reader = RowReader(d, m)
    w, mom = reader.read("a", rows[::-1].copy())  # any order
    assert torch.equal(w, ref["a"][0][torch.from_numpy(rows[::-1].copy())])
    assert torch.equal(mom, ref["a"][1][torch.from_numpy(rows[::-1].copy())])
    share = rows.size * (A_DIM * 4 + 4)  # this rank's rows: weight and momentum, float32
    assert reader.bytes_read == share  # <= 1.2x a rank's share: exactly it
    # the scattered table: right rows too, at the cost of reading every file's row ids (8 bytes a row)
    rows_b = np.arange(B_ROWS * q // 3, B_ROWS * (q + 1) // 3)
    before = reader.bytes_read
    w, mom = reader.read("b", rows_b)
    assert torch.equal(w, ref["b"][0][torch.from_numpy(rows_b)]) and torch.equal(mom, ref["b"][1][torch.from_numpy(rows_b)])
    assert reader.bytes_read - before == rows_b.size * (B_DIM * 4 + 4) + B_ROWS * 8


def test_missing_rows_and_unindexed_checkpoints_are_named(four_ranks, tmp_path):
    d, _ = four_ranks
    m = read_manifest(d)
    with pytest.raises(FormatError, match=r"table 'a': row 1000 outside \[0, 1000\)"):
        RowReader(d, m).read("a", np.array([3, 1000]))
    with pytest.raises(FormatError, match="no row index"):
        RowReader(d, {k: v for k, v in m.items() if k != "index"})
    gap = {**m, "index": {**m["index"], "rank-00002.pt": {"a": {"rows": 0, "runs": []}}}}
    with pytest.raises(FormatError, match="no rank file holds row 500 of table 'a'"):
        RowReader(d, gap).read("a", np.array([499, 500]))


def test_a_run_s_checkpoint_reads_back_as_load_checkpoint_reads_it(tmp_path):
    """A real single-process run: every table read row by row through the index equals the table
    ``load_checkpoint`` assembles from whole rank files."""
    from embedscale import workflow
    from embedscale.data.shards import ShardWriter, SparseFeatureInfo
    from embedscale.specs import RunConfig, from_dict

    rng = np.random.default_rng(0)
    n = 200
    with ShardWriter(tmp_path / "data", ["x"], [SparseFeatureInfo("C1", 50), SparseFeatureInfo("C2", 30)]) as w:
        w.write(rng.integers(0, 2, n), rng.normal(size=(n, 1)), {"C1": rng.integers(0, 50, n), "C2": rng.integers(0, 30, n)})
    cfg = from_dict(RunConfig, {
        "name": "ck", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(tmp_path / "data"), "eval_fraction": 0.2},
        "model": {"arch": "dlrm", "embedding_dim": 4, "bottom_mlp": [4], "top_mlp": [4]},
        "train": {"batch_size": 32, "max_steps": 3, "prefetch": 0, "eval_every": 0, "dropout": 0.0},
    })
    workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    ck = load_checkpoint(tmp_path / "run")
    reader = RowReader(ck["path"], ck["manifest"])
    assert ck["tables"]
    for name, t in ck["tables"].items():
        rows = np.arange(t["weight"].shape[0])
        w, mom = reader.read(name, rows)
        assert torch.equal(w, t["weight"])
        assert (mom is None) == ("momentum" not in t) and (mom is None or torch.equal(mom, t["momentum"]))
