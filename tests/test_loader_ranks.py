"""Each rank's samples, their order, and the bytes it reads, against a plain-Python model of the loader's rule.

The rule (``data.loader``): the rows ``[start, stop)`` form a sequence (dataset order; shuffled: blocks of
``shuffle_block`` consecutive rows in the order of ``default_rng([seed, epoch]).permutation``); global batches
are consecutive ``batch_size`` positions of it (a final short one unless ``drop_last``); rank ``r`` of ``W`` gets
positions ``[b * r // W, b * (r + 1) // W)`` of a batch of ``b``. The unshuffled rule was checked by hand
against the loader before ranks read only their own rows (it is the order that loader gave), so an unshuffled
run's batches are what they were. The bytes a rank reads are counted from the raw arrays: per row 1 (label),
4 per dense value, 4 (sample weight), 8 per one-hot id, and for a multi-hot feature with id weights 4 + 8 per
id (offset, ids) plus 4 + 4 per id (offset, weights).
"""

import numpy as np
import pytest

from embedscale.data.loader import ShardLoader
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.errors import InputError

N, D = 103, 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """103 rows in shards of 17 (the last of one row), written in pieces that cross shard boundaries; the raw
    rows as Python values."""
    path = tmp_path_factory.mktemp("ds")
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, N)
    dense = rng.normal(size=(N, D)).astype(np.float32)
    weights = rng.uniform(0, 2, N).astype(np.float32)
    one = rng.integers(0, 50, N)
    lens = rng.integers(0, 4, N)
    multi = rng.integers(0, 20, int(lens.sum()))
    idw = rng.uniform(-1, 1, int(lens.sum())).astype(np.float32)
    offs = np.concatenate([[0], np.cumsum(lens)])
    sp = [SparseFeatureInfo("one", 50), SparseFeatureInfo("multi", 20, multi_hot=True, id_weights=True)]
    with ShardWriter(path, ["d0", "d1"], sp, shard_rows=17, weighted=True) as w:
        for a, b in [(0, 5), (5, 60), (60, N)]:
            w.write(labels[a:b], dense[a:b], {"one": one[a:b], "multi": (multi[offs[a]:offs[b]], lens[a:b],
                                                                       idw[offs[a]:offs[b]])}, weights[a:b])
    rows = [(int(labels[i]), dense[i].tolist(), float(weights[i]), [int(one[i])],
             [int(x) for x in multi[offs[i]:offs[i + 1]]], [float(x) for x in idw[offs[i]:offs[i + 1]]])
            for i in range(N)]
    return path, rows


def row_bytes(row) -> int:
    k = len(row[4])
    return 1 + 4 * D + 4 + 8 + (4 + 8 * k) + (4 + 4 * k)


def reference(start, stop, B, W, r, *, drop_last=False, shuffle=False, seed=0, epoch=0, block=1024):
    """This rank's global batches as lists of dataset row numbers: the documented rule, in plain Python."""
    if shuffle:
        blocks = [list(range(a, min(a + block, stop))) for a in range(start, stop, block)]
        order = [i for j in np.random.default_rng([seed, epoch]).permutation(len(blocks)) for i in blocks[j]]
    else:
        order = list(range(start, stop))
    out = []
    for k in range(0, len(order), B):
        batch = order[k:k + B]
        if len(batch) < B and drop_last:
            break
        b = len(batch)
        out.append(batch[b * r // W:b * (r + 1) // W])
    return out


def decode(batch):
    """A Batch as per-sample tuples (label, dense, weight, one, multi ids, multi id weights), read on its own."""
    if batch.batch_size == 0:  # a rank's share of a final batch smaller than the world
        return []
    d = batch.sparse.to_dict()
    per = {}
    for name in ("one", "multi"):
        v, ln = d[name]
        pos, out = 0, []
        for n in ln.tolist():
            out.append(v[pos:pos + n].tolist())
            pos += n
        per[name] = out
    n_one = int(d["one"][1].sum())
    ws = batch.sparse.weights[n_one:].tolist()
    pos, mw = 0, []
    for ids in per["multi"]:
        mw.append(ws[pos:pos + len(ids)])
        pos += len(ids)
    return [(int(batch.labels[i]), batch.dense[i].tolist(), float(batch.weights[i]), per["one"][i], per["multi"][i],
             mw[i]) for i in range(batch.batch_size)]


CASES = [dict(start=0, stop=N, B=10), dict(start=20, stop=95, B=8, drop_last=True), dict(start=3, stop=101, B=12)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_each_rank_gets_the_rule_s_rows_in_order(dataset, case, W):
    path, rows = dataset
    c = dict(case)
    B = c.pop("B")
    for r in range(W):
        want = reference(c["start"], c["stop"], B, W, r, drop_last=c.get("drop_last", False))
        loader = ShardLoader(path, B, rank=r, world_size=W, prefetch=0, **c)
        got = [decode(b) for b in loader]
        assert [len(g) for g in got] == [len(w) for w in want]
        assert got == [[rows[i] for i in w] for w in want], (W, r)
        if hasattr(loader, "bytes_read"):
            assert loader.bytes_read == sum(row_bytes(rows[i]) for w in want for i in w)


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("block", [None, 5, 17, 1024])
def test_shuffle_is_the_seeded_block_permutation(dataset, W, block):
    path, rows = dataset
    for epoch in (0, 1):
        for r in range(W):
            loader = ShardLoader(path, 10, rank=r, world_size=W, start=2, stop=N, shuffle=True, seed=7,
                                 shuffle_block=block, prefetch=r % 2)
            loader.set_epoch(epoch)
            rows_per_block = block or 1  # the default: 101 rows // 256, at least 1
            want = reference(2, N, 10, W, r, shuffle=True, seed=7, epoch=epoch, block=rows_per_block)
            assert [decode(b) for b in loader] == [[rows[i] for i in w] for w in want], (epoch, r)
            assert loader.bytes_read == sum(row_bytes(rows[i]) for w in want for i in w)
    if (block or 1) < N:  # the rule's order is a permutation of the rows, not their order, and another one next epoch
        whole = [[i for w in reference(2, N, 10, 1, 0, shuffle=True, seed=7, epoch=e, block=block or 1) for i in w]
                 for e in (0, 1)]
        assert sorted(whole[0]) == list(range(2, N)) and whole[0] != sorted(whole[0]) and whole[0] != whole[1]


def test_bad_shuffle_block_is_named(dataset):
    with pytest.raises(InputError, match="shuffle_block must be a positive number of rows, got 0"):
        ShardLoader(dataset[0], 8, shuffle=True, shuffle_block=0)


def test_bytes_divide_by_the_ranks_and_skipped_batches_are_not_read(dataset):
    path, rows = dataset
    total = sum(row_bytes(r) for r in rows)
    for W in (1, 2, 4):
        got = []
        for r in range(W):
            loader = ShardLoader(path, 8, rank=r, world_size=W, prefetch=2)
            assert sum(len(b.labels) for b in loader) in (N // W, N // W + 1, N // W + 2)
            got.append(loader.bytes_read)
        assert sum(got) == total
        assert max(got) <= 1.1 * total / W
    loader = ShardLoader(path, 8, rank=1, world_size=2, prefetch=0)
    loader.set_epoch(0, skip_batches=10)
    n = sum(len(b.labels) for b in loader)
    assert loader.bytes_read == sum(row_bytes(rows[i]) for w in reference(0, N, 8, 2, 1)[10:] for i in w)
    assert n == 4 + 4 + 4  # batches 10 (rows 80..87), 11 (88..95) and 12 (96..102): rank 1 has 84..87, 92..95, 99..102


def test_a_run_s_summary_reports_the_bytes_its_last_pass_read(dataset, tmp_path):
    """``workflow.train`` for one epoch of the train split (the first 80 rows): rank 0's reads in the summary are
    those rows' bytes, counted from the raw arrays."""
    from embedscale import workflow
    from embedscale.specs import RunConfig, from_dict

    path, rows = dataset
    cfg = from_dict(RunConfig, {
        "name": "io", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(path), "eval_fraction": 0.2},
        "model": {"arch": "dlrm", "embedding_dim": 4, "bottom_mlp": [4], "top_mlp": [4]},
        "train": {"batch_size": 16, "epochs": 1, "prefetch": 0, "eval_every": 0, "dropout": 0.0},
    })
    s = workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    cut = N - round(N * 0.2)
    assert s["samples"] == cut
    assert s["data_bytes_read"] == {"rank": 0, "last_pass": sum(row_bytes(r) for r in rows[:cut])}
