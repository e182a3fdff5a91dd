"""Tests of AccessProfile: exact counts over shards, files, merge, overflow promotion, drift, errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from embedscale.data.profile import UINT32_MAX, AccessProfile
from embedscale.data.shards import Columns, Manifest, ShardWriter, SparseFeatureInfo
from embedscale.data.synthetic import SyntheticGenerator, generate_dataset
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.specs import SyntheticConfig

PFS = [1] * 23 + [2, 3, 5]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    # small tables (<= 8x a shard's ids) take the bincount path, the 100k-row ones the np.unique path
    d = tmp_path_factory.mktemp("prof") / "ds"
    cfg = SyntheticConfig(preset="criteo-kaggle-small", pooling_factors=PFS)
    generate_dataset(cfg, d, 25_000, seed=1, shard_rows=7_000, progress=False)
    return d


def arrow_counters(directory: Path) -> dict[str, Counter]:
    """Reference: read every shard with pyarrow (not read_shard) and count with collections.Counter."""
    out: dict[str, Counter] = {}
    manifest = json.loads((directory / "manifest.json").read_text())
    for s in manifest["shards"]:
        table = ipc.open_file(pa.memory_map(str(directory / s["file"]))).read_all()
        for info in manifest["sparse"]:
            col = table.column(info["name"]).combine_chunks()
            if pa.types.is_list(col.type):
                col = col.flatten()
            out.setdefault(info["name"], Counter()).update(col.to_pylist())
    return out


def test_counts_equal_counter_over_shards(dataset: Path):
    prof = AccessProfile.from_shards(dataset, progress=False)
    ref = arrow_counters(dataset)
    m = Manifest.load(dataset)
    assert prof.samples == m.rows == 25_000
    assert prof.table_names == m.sparse_names
    for info in m.sparse:
        c = prof.counts(info.name)
        assert c.dtype == np.uint32 and c.size == info.num_rows
        nz = np.flatnonzero(c)
        assert dict(zip(nz.tolist(), c[nz].tolist())) == dict(ref[info.name]), info.name
    assert prof.total("C26") == sum(ref["C26"].values())  # multi-hot: every id of every bag


def test_shared_table_and_num_rows(dataset: Path):
    m = Manifest.load(dataset)
    mapping = {f: ("shared" if f in ("C3", "C4") else f) for f in m.sparse_names}
    prof = AccessProfile.from_shards(dataset, feature_to_table=mapping, num_rows={"shared": 200_000}, progress=False)
    ref = arrow_counters(dataset)
    both = ref["C3"] + ref["C4"]
    c = prof.counts("shared")
    assert c.size == 200_000
    nz = np.flatnonzero(c)
    assert dict(zip(nz.tolist(), c[nz].tolist())) == dict(both)
    with pytest.raises(ConfigError, match="C5"):
        AccessProfile.from_shards(dataset, feature_to_table={f: f for f in m.sparse_names if f != "C5"},
                                  progress=False)


def test_save_load_merge_round_trip(dataset: Path, tmp_path: Path):
    prof = AccessProfile.from_shards(dataset, progress=False)
    prof.save(tmp_path / "p")
    loaded = AccessProfile.load(tmp_path / "p")
    assert isinstance(loaded.counts("C3"), np.memmap)
    assert loaded.samples == prof.samples and loaded.table_names == prof.table_names
    for name in prof.table_names:
        assert loaded.counts(name).dtype == prof.counts(name).dtype
        assert np.array_equal(loaded.counts(name), prof.counts(name))
    merged = prof.merge(loaded)
    assert merged.samples == 2 * prof.samples
    for name in prof.table_names:
        assert np.array_equal(merged.counts(name), 2 * prof.counts(name).astype(np.int64))
    # adding to a memory-mapped profile copies; the saved file is unchanged
    gen = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle-small", pooling_factors=PFS), seed=1)
    before = np.array(loaded.counts("C1"))
    extra = gen.sample(25_000, 1000)
    loaded.add(extra)
    added = Counter(extra.sparse["C1"][0].tolist())
    expect = before.astype(np.int64)
    expect[list(added)] += list(added.values())
    assert np.array_equal(loaded.counts("C1"), expect)
    assert np.array_equal(AccessProfile.load(tmp_path / "p").counts("C1"), before)
    assert loaded.samples == prof.samples + 1000
    # mismatches are clear errors
    other = AccessProfile({"C1": np.zeros(3, np.uint32)}, 0)
    with pytest.raises(InputError, match="different tables"):
        prof.merge(other)
    small = AccessProfile({n: np.zeros(prof.num_rows(n) + (n == "C7"), np.uint32) for n in prof.table_names}, 0)
    with pytest.raises(InputError, match="C7"):
        prof.merge(small)
    (tmp_path / "p" / "table-00002.npy").unlink()
    with pytest.raises(FormatError, match="table-00002.npy"):
        AccessProfile.load(tmp_path / "p")


def one_hot(name: str, ids) -> Columns:
    ids = np.asarray(ids, dtype=np.int64)
    return Columns(np.zeros(ids.size, np.int8), np.zeros((ids.size, 0), np.float32),
                   {name: (ids, np.ones(ids.size, np.int64))})


def test_overflow_promotes_to_int64_instead_of_wrapping():
    prof = AccessProfile({"t": np.array([UINT32_MAX - 2, 7, 0], dtype=np.uint32)}, 1)
    prof.add(one_hot("t", [1, 1, 2]))  # far from the limit on the touched rows: stays compact
    assert prof.counts("t").dtype == np.uint32
    assert prof.counts("t").tolist() == [UINT32_MAX - 2, 9, 1]
    prof.add(one_hot("t", [0, 0]))  # exactly the limit still fits
    assert prof.counts("t").dtype == np.uint32 and int(prof.counts("t")[0]) == UINT32_MAX
    prof.add(one_hot("t", [0, 2]))
    c = prof.counts("t")
    assert c.dtype == np.int64
    assert c.tolist() == [UINT32_MAX + 1, 9, 2]
    # the np.unique path (table much larger than the block) promotes too
    big = np.zeros(1000, dtype=np.uint32)
    big[500] = UINT32_MAX
    prof2 = AccessProfile({"t": big}, 0)
    prof2.add(one_hot("t", [500]))
    assert prof2.counts("t").dtype == np.int64 and int(prof2.counts("t")[500]) == UINT32_MAX + 1
    # merging two near-full tables also promotes
    a = AccessProfile({"t": np.array([UINT32_MAX - 1, 1], np.uint32)}, 1)
    s = a.merge(a)
    assert s.counts("t").dtype == np.int64 and s.counts("t").tolist() == [2 * (UINT32_MAX - 1), 2]


def test_out_of_range_row_id_names_table_feature_and_file(tmp_path: Path):
    info = [SparseFeatureInfo("C1", 10), SparseFeatureInfo("C2", 5)]
    with ShardWriter(tmp_path / "bad", ["I1"], info, shard_rows=4) as w:
        w.write(np.zeros(4, np.int8), np.zeros((4, 1), np.float32), {"C1": np.array([0, 1, 2, 3]),
                                                                     "C2": np.array([0, 1, 2, 3])})
        w.write(np.zeros(3, np.int8), np.zeros((3, 1), np.float32), {"C1": np.array([9, 12, 4]),
                                                                     "C2": np.array([0, 1, 2])})
    with pytest.raises(InputError) as e:
        AccessProfile.from_shards(tmp_path / "bad", progress=False)
    msg = str(e.value)
    assert "'C1'" in msg and "12" in msg and "shard-00001.arrow" in msg
    prof = AccessProfile({"C1": np.zeros(10, np.uint32)}, 0)
    with pytest.raises(InputError, match="row id -1"):
        prof.add(one_hot("C1", [3, -1]))


def test_sorted_rows_coverage_and_hot_rows_against_reference():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 6, 500).astype(np.uint32)
    prof = AccessProfile({"t": counts}, 10)
    ref = sorted(range(counts.size), key=lambda r: (-int(counts[r]), r))
    assert prof.sorted_rows("t").tolist() == ref
    total = int(counts.sum())
    for frac in (0.01, 0.1, 0.5):
        k = int(np.ceil(frac * counts.size))
        assert prof.coverage("t", frac) == pytest.approx(sum(int(counts[r]) for r in ref[:k]) / total)
    hot = prof.hot_rows("t", 0.8)
    cum = np.cumsum([int(counts[r]) for r in ref])
    k = int(np.argmax(cum >= 0.8 * total)) + 1
    assert hot.tolist() == ref[:k]
    sc = prof.sorted_counts("t")
    assert sc.tolist() == [int(counts[r]) for r in ref]
    prof.add(one_hot("t", [ref[-1]] * 9))  # the coldest row becomes the hottest: the order is recomputed
    assert prof.sorted_rows("t")[0] == ref[-1] and prof.sorted_counts("t")[0] == 9
    counts = prof.counts("t")
    total = int(counts.sum())
    s = prof.summary()["t"]
    assert s["rows"] == 500 and s["accessed_rows"] == int(np.count_nonzero(counts)) and s["accesses"] == total


def tv_reference(a: np.ndarray, b: np.ndarray) -> float:
    pa_, pb = a / a.sum(), b / b.sum()
    return 0.5 * sum(abs(x - y) for x, y in zip(pa_.tolist(), pb.tolist()))


def test_drift_zero_for_identical_and_positive_for_shifted():
    cfg = SyntheticConfig(preset="criteo-kaggle-tiny")
    g0, g1 = SyntheticGenerator(cfg, seed=0), SyntheticGenerator(cfg, seed=1)  # seed moves the hot rows
    p0 = AccessProfile({n: np.zeros(r, np.uint32) for n, r in zip(g0.feature_names, g0.num_rows)}, 0)
    p0.add(g0.sample(0, 20_000))
    same = p0.drift(p0)
    assert same["overall"]["tv"] == 0.0 and same["overall"]["hot_jaccard"] == 1.0
    assert all(t["tv"] == 0.0 and t["hot_jaccard"] == 1.0 for t in same["tables"].values())
    assert same["overall"]["hot_coverage"] >= 0.8
    p1 = AccessProfile({n: np.zeros(r, np.uint32) for n, r in zip(g1.feature_names, g1.num_rows)}, 0)
    p1.add(g1.sample(0, 20_000))
    d = p0.drift(p1)
    for name in ("C3", "C1", "C22"):
        assert d["tables"][name]["tv"] == pytest.approx(tv_reference(p0.counts(name).astype(float),
                                                                      p1.counts(name).astype(float)))
    assert d["tables"]["C3"]["tv"] > 0.5 and d["tables"]["C3"]["hot_jaccard"] < 0.2
    assert d["overall"]["tv"] > 0.3 and d["overall"]["hot_coverage"] < 0.8
    # same distribution, fresh samples: small but non-zero drift
    p2 = AccessProfile({n: np.zeros(r, np.uint32) for n, r in zip(g0.feature_names, g0.num_rows)}, 0)
    p2.add(g0.sample(20_000, 20_000))
    near = p0.drift(p2)
    assert 0.0 < near["overall"]["tv"] < d["overall"]["tv"]


def test_expected_profile_from_exact_probabilities():
    cfg = SyntheticConfig(preset="criteo-kaggle-tiny", pooling_factors=[1] * 25 + [4])
    gen = SyntheticGenerator(cfg, seed=4)
    exp = AccessProfile.expected(gen, 65_536)
    assert exp.counts("C26").dtype == np.float64
    assert exp.total("C1") == pytest.approx(65_536)
    assert exp.total("C26") == pytest.approx(4 * 65_536)
    obs = AccessProfile({n: np.zeros(r, np.uint32) for n, r in zip(gen.feature_names, gen.num_rows)}, 0)
    obs.add(gen.sample(0, 65_536))
    d = exp.drift(obs)
    assert d["tables"]["C2"]["tv"] < 0.05  # 583 rows, 65k draws: sampling noise only
    by_mapping = AccessProfile.expected({"C2": gen.access_probability(1)}, 10)
    assert np.allclose(by_mapping.counts("C2"), 10 * gen.access_probability(1))
