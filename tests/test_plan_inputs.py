"""Topology (link classes, L) and the synthetic power-law profile."""

import math

import numpy as np
import pytest

from embedscale.errors import ConfigError
from embedscale.plan.synthetic_profile import ZipfProfile, profile_from_spec, zipf_weights
from embedscale.plan.topology import LinkTopology, as_link_topology, load_topology
from embedscale.specs import TableSpec, Topology


def test_link_classes_and_cost_matrix():
    t = as_link_topology(Topology(num_hosts=2, ranks_per_host=2, local_bw=1000, intra_host_bw=100,
                                  inter_host_bw=25, intra_host_latency_us=2, inter_host_latency_us=8))
    assert t.link_class().tolist() == [[0, 1, 2, 2], [1, 0, 2, 2], [2, 2, 0, 1], [2, 2, 1, 0]]
    assert t.cost_matrix()[0].tolist() == pytest.approx([1e-6, 1e-5, 4e-5, 4e-5])  # us per byte
    assert t.embedding_cost(64)[0, 2] == pytest.approx(64 / 25e3)
    assert t.latency_us[0].tolist() == [0, 2, 8, 8]
    # harmonic mean over the 12 ordered pairs: 4 at 100, 8 at 25
    assert t.p2p_bandwidth() == pytest.approx(1 / ((4 / 100 + 8 / 25) / 12))
    assert LinkTopology.from_dict(t.to_dict()).bandwidth.tolist() == t.bandwidth.tolist()


def test_topology_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"bandwidth\[0\]\[1\] = -1.0 GB/s must be positive"):
        LinkTopology(1, 2, 0, [[1, -1], [1, 1]], np.zeros((2, 2)), 1.0)
    with pytest.raises(ConfigError, match="unknown link class 'rack'"):
        LinkTopology.from_link_classes(1, 2, {"rack": 1})
    (tmp_path / "t.yaml").write_text("num_hosts: 2\nranks_per_host: 4\nintra_host_bw: fast\n")
    with pytest.raises(ConfigError, match="intra_host_bw: expected a number"):
        load_topology(tmp_path / "t.yaml")
    (tmp_path / "u.yaml").write_text("num_hosts: 2\nranks_per_host: 4\n")
    assert load_topology(tmp_path / "u.yaml").world_size == 8


def test_zipf_profile_is_exact_and_permuted():
    p = ZipfProfile({"a": 1000, "b": 7}, alpha=1.2, samples=5000, pooling={"a": 2.0, "b": 1.0}, seed=3)
    for name, n in (("a", 1000), ("b", 7)):
        rows = p.sorted_rows(name)
        assert np.array_equal(np.sort(rows), np.arange(n))  # a bijection
        c = p.counts(name)
        assert np.all(np.diff(c[rows]) <= 0)
        np.testing.assert_allclose(c.sum(), p.total(name))
    h = sum(r ** -1.2 for r in range(1, 8))
    np.testing.assert_allclose(p.sorted_counts("b"), [5000 * r ** -1.2 / h for r in range(1, 8)])
    assert p.total("a") == 10_000
    assert not np.array_equal(p.sorted_rows("a"), np.arange(1000))  # hot rows are scattered
    assert math.isclose(zipf_weights(3, 0.0).sum(), 1.0)


def test_profile_spec_errors():
    tabs = [TableSpec("a", 10), TableSpec("b", 5)]
    assert profile_from_spec({"kind": "zipf", "alpha": 0.9}, tabs).table_names == ["a", "b"]
    with pytest.raises(ConfigError, match="unknown key"):
        profile_from_spec({"alpah": 1.0}, tabs)
    with pytest.raises(ConfigError, match="alpha has no value for table"):
        profile_from_spec({"alpha": {"a": 1.0}}, tabs)
    with pytest.raises(ConfigError, match="alpha must be a finite number"):
        profile_from_spec({"alpha": -1.0}, tabs)
