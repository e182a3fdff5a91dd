"""Index reordering: bijection, hot rows first, planted communities recovered, files, the data path, and
training with the reordering equal to training without it up to the permutation of the rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.data.loader import ShardLoader
from embedscale.data.profile import AccessProfile
from embedscale.data.synthetic import generate_dataset
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.models import build_model
from embedscale.reorder import Reordering, build_reorder, reorder_shards
from embedscale.specs import ModelConfig, SyntheticConfig, TableSpec


def planted(seed=0, n=2000, groups=10, hot=10, batches_per_group=12, draws=300):
    """Rows of a table split into groups; every batch reads one group plus the hot rows."""
    rng = np.random.default_rng(seed)
    rows = rng.permutation(np.arange(hot, n))
    group_rows = np.array_split(rows[: (n - hot) // 2], groups)  # half the rows are never read
    hot_rows = np.arange(hot)
    batches = []
    for g in range(groups):
        for _ in range(batches_per_group):
            ids = np.concatenate([rng.choice(group_rows[g], draws), np.repeat(hot_rows, 40)])
            batches.append({"t": rng.permutation(ids)})
    counts = np.bincount(np.concatenate([b["t"] for b in batches]), minlength=n)
    return AccessProfile({"t": counts}, len(batches)), batches, group_rows, hot_rows, counts


def assert_bijection(m, n):
    assert m.shape == (n,) and np.array_equal(np.sort(m), np.arange(n))


@pytest.mark.parametrize("method", ["leiden", "louvain"])
def test_hot_rows_first_and_planted_communities_consecutive(method):
    prof, batches, group_rows, hot_rows, counts = planted()
    reo = build_reorder(prof, [TableSpec("t", 2000)], hot_ratio=0.005, batches=batches, method=method,
                        progress=False)
    m = reo.map("t")
    assert_bijection(m, 2000)
    # hot: the 10 most read rows take ids 0..9 in frequency order
    assert sorted(m[hot_rows]) == list(range(10))
    order_by_count = hot_rows[np.argsort(-counts[hot_rows], kind="stable")]
    assert list(m[order_by_count]) == list(range(10))
    # local: every group (its rows that were read) takes one consecutive block of ids
    for g in group_rows:
        seen = g[counts[g] > 0]
        ids = np.sort(m[seen])
        assert ids[-1] - ids[0] + 1 == seen.size
    info = reo.tables["t"].info
    assert info["communities"] == 10 and info["modularity"] > 0.8
    # rows never read come last
    unread = np.flatnonzero(counts == 0)
    assert m[unread].min() == 2000 - unread.size


def test_frequency_only_without_batches_and_bounded_pairs():
    prof, batches, *_ , counts = planted(seed=1)
    reo = build_reorder(prof, hot_ratio=0.0, progress=False)  # no batches: pure frequency order
    m = reo.map("t")
    assert_bijection(m, 2000)
    assert np.all(np.diff(counts[np.argsort(m)]) <= 0)
    bounded = build_reorder(prof, hot_ratio=0.005, batches=batches, max_pairs_per_batch=500, progress=False)
    assert_bijection(bounded.map("t"), 2000)
    assert bounded.tables["t"].info["graph_edges"] <= 500 * len(batches)


def test_save_load_and_corruption(tmp_path):
    prof, batches, *_ = planted(seed=2)
    reo = build_reorder(prof, hot_ratio=0.005, batches=batches, progress=False)
    reo.save(tmp_path / "r")
    back = Reordering.load(tmp_path / "r")
    assert np.array_equal(back.map("t"), reo.map("t")) and back.hot_ratio == 0.005
    assert back.tables["t"].info == json.loads(json.dumps(reo.tables["t"].info))
    bad = reo.map("t").copy()
    bad[1] = bad[0]
    np.save(tmp_path / "r" / "table-000.npy", bad.astype(np.int32))
    with pytest.raises(FormatError, match=r"table-000.npy.*not a bijection"):
        Reordering.load(tmp_path / "r")
    (tmp_path / "r" / "table-000.npy").unlink()
    with pytest.raises(FormatError, match="missing"):
        Reordering.load(tmp_path / "r")
    with pytest.raises(FormatError, match="not found"):
        Reordering.load(tmp_path / "nothing")


def test_apply_jagged_batch_and_numpy():
    m = np.array([3, 0, 4, 1, 2])
    from embedscale.reorder import TableReordering

    reo = Reordering([TableReordering("t", m, ["a", "b"])])
    jf = JaggedFeatures(["x", "a", "b"], torch.tensor([7, 8, 0, 4, 4, 2]), torch.tensor([1, 1, 2, 0, 1, 1]),
                        torch.arange(6, dtype=torch.float32))
    out = reo.apply(jf)
    assert out.values.tolist() == [7, 8, 3, 2, 2, 4] and out.values.dtype == torch.int64
    assert torch.equal(out.lengths, jf.lengths) and torch.equal(out.weights, jf.weights)
    d = reo.apply({"a": np.array([1, 2]), "x": np.array([9]), "b": (np.array([4]), np.array([1]))})
    assert d["a"].tolist() == [0, 4] and d["x"].tolist() == [9] and d["b"][0].tolist() == [2]
    with pytest.raises(InputError, match=r"feature 'b' \(table 't', 5 rows\): row id 5"):
        reo.apply(JaggedFeatures(["b"], torch.tensor([5]), torch.tensor([1])))
    with pytest.raises(ConfigError, match="read by tables"):
        Reordering([TableReordering("t", m, ["a"]), TableReordering("u", m, ["a"])])
    w = torch.arange(10.0).view(5, 2)
    pw = reo.permute_rows("t", w)
    assert torch.equal(pw[torch.from_numpy(m)], w)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("reorder") / "train"
    cfg = SyntheticConfig(preset="criteo-kaggle-tiny", max_rows=300, pooling_factors=[1] * 24 + [3, 2])
    generate_dataset(cfg, d, 3000, seed=0, shard_rows=1000, progress=False)
    return d


def test_reorder_shards_writes_files(shards, tmp_path):
    summary = reorder_shards(shards, tmp_path / "out", hot_ratio=0.05, batch_size=256, max_batches=6,
                             names=["C3", "C25"], progress=False)
    assert sorted(summary["tables"]) == ["C25", "C3"]
    back = Reordering.load(tmp_path / "out")
    assert set(back.tables) == {"C3", "C25"}
    assert back.tables["C3"].info["batches"] == 6 and back.tables["C3"].info["graph_edges"] > 0


def test_training_with_reordering_equals_training_without_up_to_permutation(shards):
    """DLRM over the synthetic shards, every table reordered: the same losses, and every table's rows are
    the plain run's rows permuted by the map."""
    from embedscale.data.shards import Manifest

    manifest = Manifest.load(shards)
    tables = [TableSpec(f"t{s.name}", s.num_rows, 8, features=[s.name]) for s in manifest.sparse]
    reo = build_reorder(shards, tables, hot_ratio=0.02, batch_size=512, max_batches=4, progress=False)
    assert set(reo.tables) == {t.name for t in tables}
    cfg = ModelConfig(arch="dlrm", embedding_dim=8, bottom_mlp=[16], top_mlp=[16])

    def model(init):
        torch.manual_seed(0)
        emb = LocalEmbeddingBags(tables, optimizer="rowwise_adagrad", lr=0.05, init=init, seed=1)
        return build_model(cfg, tables, manifest.num_dense, embedding=emb)

    plain = model("uniform")
    start = {t.name: plain.sparse_arch.embedding.table_weight(t.name).clone() for t in tables}
    renamed = model(lambda spec, w: w.copy_(reo.permute_rows(spec.name, start[spec.name])))
    opts = [torch.optim.Adagrad(m.dense_parameters(), lr=0.05) for m in (plain, renamed)]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = [[], []]
    for batch in ShardLoader(shards, 500, prefetch=0):
        for i, (m, opt, b) in enumerate(((plain, opts[0], batch), (renamed, opts[1], reo.apply(batch)))):
            loss = loss_fn(m(b.dense, b.sparse), b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[i].append(float(loss.detach()))
    assert len(losses[0]) == 6
    assert np.allclose(losses[0], losses[1], rtol=0, atol=1e-6)
    moved = 0
    for t in tables:
        a = plain.sparse_arch.embedding.table_weight(t.name)
        b = renamed.sparse_arch.embedding.table_weight(t.name)
        assert torch.allclose(reo.permute_rows(t.name, a), b, atol=1e-6)
        moved += int((a != start[t.name]).any(1).sum())
    assert moved > 100  # the rows did train
