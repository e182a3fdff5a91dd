import numpy as np
import pytest
import torch

from embedscale.data.loader import ShardLoader
from embedscale.data.shards import MANIFEST, Manifest, ShardWriter, SparseFeatureInfo
from embedscale.errors import FormatError, InputError


def make_dataset(path, n=103, shard_rows=17, seed=0, bad=None):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    one = rng.integers(0, 50, n)
    lens = rng.integers(0, 4, n)
    multi = rng.integers(0, 20, lens.sum())
    if bad == "nan":
        dense[40, 1] = np.nan
    if bad == "label":
        labels[41] = 3
    if bad == "row":
        one[42] = 50
    if bad == "multi":  # the second (multi-hot) feature: the check must name it, not the first
        multi[min(30, multi.size - 1)] = 20
    if bad == "negative":
        one[43] = -1
    sp = [SparseFeatureInfo("one", 50), SparseFeatureInfo("multi", 20, multi_hot=True)]
    with ShardWriter(path, ["d0", "d1", "d2"], sp, shard_rows=shard_rows) as w:
        # write in uneven pieces to cross shard boundaries
        offs = np.concatenate([[0], np.cumsum(lens)])
        for a, b in [(0, 5), (5, 60), (60, n)]:
            w.write(labels[a:b], dense[a:b], {"one": one[a:b], "multi": (multi[offs[a]:offs[b]], lens[a:b])})
    rows = [(labels[i], dense[i], [one[i]], list(multi[offs[i]:offs[i + 1]])) for i in range(n)]
    return rows


def batch_rows(batch):
    """Independent decode of a Batch into per-sample tuples."""
    d = batch.sparse.to_dict()
    out = []
    for name in ("one", "multi"):
        v, l = d[name]
        pos, per = 0, []
        for n in l.tolist():
            per.append(v[pos:pos + n].tolist())
            pos += n
        out.append(per)
    return [(int(batch.labels[i]), batch.dense[i].numpy(), out[0][i], out[1][i]) for i in range(batch.batch_size)]


def same(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and list(a[2]) == list(b[2]) and list(a[3]) == list(b[3])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_are_the_rows_in_order(tmp_path, prefetch):
    rows = make_dataset(tmp_path)
    m = Manifest.load(tmp_path)
    assert m.rows == 103 and len(m.shards) == 7
    assert m.positives == sum(r[0] for r in rows)
    loader = ShardLoader(tmp_path, 10, prefetch=prefetch)
    got = [r for b in loader for r in batch_rows(b)]
    assert len(loader) == 11
    assert len(got) == 103 and all(same(g, r) for g, r in zip(got, rows))


def test_row_range_drop_last_and_ranks(tmp_path):
    rows = make_dataset(tmp_path)
    L = ShardLoader(tmp_path, 8, start=20, stop=95, drop_last=True, prefetch=0)
    assert len(L) == 9
    got = [r for b in L for r in batch_rows(b)]
    assert all(same(g, r) for g, r in zip(got, rows[20:92]))
    # three ranks: each global batch splits into contiguous slices whose union is the global batch
    per_rank = [list(ShardLoader(tmp_path, 8, start=20, stop=95, rank=r, world_size=3, prefetch=0)) for r in range(3)]
    glob = list(ShardLoader(tmp_path, 8, start=20, stop=95, prefetch=0))
    for i, g in enumerate(glob):
        parts = [r for rk in range(3) for r in batch_rows(per_rank[rk][i])]
        assert all(same(a, b) for a, b in zip(parts, batch_rows(g))) and len(parts) == g.batch_size


def test_shuffle_is_a_seeded_permutation_and_skip_resumes(tmp_path):
    rows = make_dataset(tmp_path)
    L = ShardLoader(tmp_path, 10, shuffle=True, seed=3, prefetch=0)
    a = [r for b in L for r in batch_rows(b)]
    b = [r for b in ShardLoader(tmp_path, 10, shuffle=True, seed=3, prefetch=0) for r in batch_rows(b)]
    assert all(same(x, y) for x, y in zip(a, b))
    key = lambda r: (r[0], tuple(r[1].tolist()), tuple(r[2]), tuple(r[3]))
    assert sorted(map(key, a)) == sorted(map(key, rows))
    assert [key(r) for r in a] != [key(r) for r in rows]
    L.set_epoch(1)
    c = [r for b in L for r in batch_rows(b)]
    assert [key(r) for r in c] != [key(r) for r in a]
    L.set_epoch(1, skip_batches=4)
    d = [r for b in L for r in batch_rows(b)]
    assert [key(r) for r in d] == [key(r) for r in c[40:]]


@pytest.mark.parametrize("bad,msg", [("nan", r"shard-00002\.arrow: row 6: dense feature d1 is nan"),
                                     ("label", r"shard-00002\.arrow: row 7: label 3 is not 0 or 1"),
                                     ("row", r"feature one: row id 50 outside its table \[0, 50\)"),
                                     ("multi", r"feature multi: row id 20 outside its table \[0, 20\)"),
                                     ("negative", r"feature one: row id -1 outside its table \[0, 50\)")])
def test_bad_rows_are_named(tmp_path, bad, msg):
    make_dataset(tmp_path, bad=bad)
    with pytest.raises(InputError, match=msg):
        list(ShardLoader(tmp_path, 16))


def test_missing_or_unfinished_dataset(tmp_path):
    with pytest.raises(FormatError, match="manifest"):
        ShardLoader(tmp_path, 4)
    make_dataset(tmp_path)
    with pytest.raises(InputError, match="empty input"):
        ShardLoader(tmp_path, 4, start=5, stop=5)
    (tmp_path / "shard-00001.arrow").unlink()
    with pytest.raises(FormatError, match="shard-00001.arrow is listed but missing"):
        ShardLoader(tmp_path, 4)


def test_writer_error_leaves_no_manifest(tmp_path):
    sp = [SparseFeatureInfo("one", 5)]
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, ["d"], sp, shard_rows=2) as w:
            w.write(np.array([0, 1, 1]), np.zeros((3, 1)), {"one": np.array([1, 2, 3])})
            raise RuntimeError("boom")
    assert not (tmp_path / MANIFEST).exists()
