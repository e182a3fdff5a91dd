"""The tower partitioner (DMT 3.3) against brute force and planted structure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.plan.towers import (
    TowerAssignment,
    _assign,
    adjusted_rand_index,
    constrained_kmeans,
    distance_matrix,
    embed_coordinates,
    naive_assignment,
    partition_features,
    refine_by_swaps,
    size_bounds,
)
from embedscale.towers.learn import interaction_matrix, learn_towers, plot_interaction
from embedscale.towers.planted import PlantedGroups


def ari_brute(a, b):
    """ARI from its definition over all pairs: (index - expected) / (max - expected)."""
    n = len(a)
    pairs = list(itertools.combinations(range(n), 2))
    same_a = np.array([a[i] == a[j] for i, j in pairs])
    same_b = np.array([b[i] == b[j] for i, j in pairs])
    index = float((same_a & same_b).sum())
    sa, sb, total = float(same_a.sum()), float(same_b.sum()), len(pairs)
    expected = sa * sb / total
    mx = 0.5 * (sa + sb)
    return 1.0 if mx == expected else (index - expected) / (mx - expected)


def test_adjusted_rand_index_matches_definition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.integers(0, 4, 15)
        b = rng.integers(0, 3, 15)
        assert adjusted_rand_index(a, b) == pytest.approx(ari_brute(a, b), abs=1e-12)
    a = np.array([0, 0, 1, 1, 2, 2])
    assert adjusted_rand_index(a, (a + 1) % 3) == 1.0  # a relabelling is the same partition
    assert adjusted_rand_index(a, [0, 1, 0, 1, 0, 1]) < 0
    with pytest.raises(InputError):
        adjusted_rand_index([0, 1], [0, 1, 2])


def test_naive_assignment_is_dmt_strided_example():
    feats = [str(i) for i in range(26)]
    a = naive_assignment(feats, 8)
    assert a.towers[0] == ["0", "8", "16", "24"] and a.towers[2] == ["2", "10", "18"] and a.towers[7] == ["7", "15", "23"]
    with pytest.raises(ConfigError, match="at least one feature"):
        naive_assignment(feats[:3], 4)


def test_interaction_matrix_matches_loops_and_skips_empty_bags():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(7, 4, 3, generator=g) + torch.tensor([2.0, 0.0, 0.0])  # a shared constant part
    e[2, 1] = 0.0  # an empty bag: no direction
    for center in (False, True):
        I = interaction_matrix([e[:3], e[3:]], center=center)
        mean = torch.zeros(4, 3, dtype=torch.float64)
        if center:  # every feature's mean over its non-empty bags
            for i in range(4):
                rows = [e[b, i].double() for b in range(7) if e[b, i].norm() > 0]
                mean[i] = sum(rows) / len(rows)
        want = np.zeros((4, 4))
        cnt = np.zeros((4, 4))
        for b in range(7):
            for i in range(4):
                for j in range(4):
                    if e[b, i].norm() > 0 and e[b, j].norm() > 0:
                        u, v = e[b, i].double() - mean[i], e[b, j].double() - mean[j]
                        want[i, j] += abs(float(u @ v / (u.norm() * v.norm())))
                        cnt[i, j] += 1
        want = want / cnt
        np.fill_diagonal(want, 1.0)
        np.testing.assert_allclose(I, want, atol=1e-12)
    # a feature that never varies has no direction once centred: no interaction with anything
    const = e.clone()
    const[:, 3] = torch.tensor([1.0, 2.0, 3.0])
    I = interaction_matrix(const, center=True)
    assert (I[3, :3] == 0).all() and (I[:3, 3] == 0).all() and I[3, 3] == 1.0
    D = distance_matrix(I, "coherent")
    np.testing.assert_allclose(D + np.eye(4), 1 - I + np.eye(4), atol=1e-12)
    np.testing.assert_allclose(distance_matrix(I, "diverse"), I - np.eye(4), atol=1e-12)
    with pytest.raises(ConfigError, match="strategy"):
        distance_matrix(I, "random")


def test_coordinates_recover_planar_distances():
    rng = np.random.default_rng(1)
    P = rng.random((9, 2))
    D = np.linalg.norm(P[:, None] - P[None], axis=2)
    X, stress = embed_coordinates(D, 2, steps=800, restarts=2, seed=0)
    assert stress < 1e-3
    np.testing.assert_allclose(np.linalg.norm(X[:, None] - X[None], axis=2), D, atol=0.02)


def test_assignment_step_is_the_exact_constrained_optimum():
    rng = np.random.default_rng(2)
    for F, k, m, M in [(6, 2, 2, 4), (7, 3, 2, 3), (8, 3, 1, 4)]:
        sq = rng.random((F, k))
        got = _assign(sq, m, M)
        sizes = np.bincount(got, minlength=k)
        assert sizes.min() >= m and sizes.max() <= M
        best = min(sq[np.arange(F), lab].sum() for lab in itertools.product(range(k), repeat=F)
                   if m <= min(np.bincount(lab, minlength=k)) and max(np.bincount(lab, minlength=k)) <= M)
        assert sq[np.arange(F), got].sum() == pytest.approx(best)


def test_constrained_kmeans_balances_and_finds_the_brute_force_optimum():
    rng = np.random.default_rng(3)
    # two blobs of 7 and 2 points: unconstrained K-Means would split 7/2, ratio <= 2 forces 6/3 .. 3/6
    X = np.concatenate([rng.normal(0, 0.05, (7, 2)), rng.normal(5, 0.05, (2, 2))])
    labels, inertia = constrained_kmeans(X, 2, max_ratio=2.0, seed=0)
    sizes = np.bincount(labels)
    assert max(sizes) <= 2 * min(sizes)

    def inertia_of(lab):
        return sum(((X[lab == c] - X[lab == c].mean(0)) ** 2).sum() for c in range(2))

    best = min(inertia_of(np.array(lab)) for lab in itertools.product(range(2), repeat=9)
               if 0 < min(np.bincount(lab, minlength=2)) and max(np.bincount(lab, minlength=2)) <= 2 * min(
                   np.bincount(lab, minlength=2)))
    assert inertia == pytest.approx(best, rel=1e-9)
    with pytest.raises(ConfigError, match="smallest possible"):
        size_bounds(26, 8, 1.0)
    assert (3, 4) in size_bounds(26, 8, 4 / 3)


def _planted_embeddings(groups, N=12, B=400, seed=0):
    """Per-sample embeddings whose features of a group share a 2-d subspace (what a model that learnt
    group-local interactions holds), plus noise."""
    rng = np.random.default_rng(seed)
    G = int(max(groups)) + 1
    basis = np.linalg.qr(rng.standard_normal((N, N)))[0][:, : 2 * G]
    e = np.zeros((B, len(groups), N))
    for f, g in enumerate(groups):
        coef = rng.standard_normal((B, 2))
        e[:, f] = coef @ basis[:, 2 * g: 2 * g + 2].T + 0.15 * rng.standard_normal((B, N))
    return torch.from_numpy(e).float()


def test_partitioner_recovers_planted_groups_and_diverse_spreads_them():
    groups = np.random.default_rng(4).permutation(np.arange(16) % 4)
    names = [f"C{i + 1}" for i in range(16)]
    I = interaction_matrix(_planted_embeddings(groups))
    coherent, rep = partition_features(names, I, 4, strategy="coherent", seed=0, steps=600, restarts=2, trials=2)
    assert adjusted_rand_index(coherent.labels(names), groups) >= 0.9
    assert rep["within_tower_interaction"] > rep["naive"]["within_tower_interaction"]
    assert coherent.sizes == [4, 4, 4, 4]
    diverse, _ = partition_features(names, I, 4, strategy="diverse", seed=0, steps=600, restarts=2, trials=2)
    for tower in diverse.towers:  # every tower mixes groups
        assert len({groups[names.index(f)] for f in tower}) >= 3


def test_centring_ignores_constant_parts_that_hide_the_groups():
    """Every feature's embeddings plus a large constant part of its own (a table that drifted as a whole):
    DMT's uncentred |cos| sees mostly the constants, the centred one sees the planted groups."""
    groups = np.random.default_rng(4).permutation(np.arange(16) % 4)
    names = [f"C{i + 1}" for i in range(16)]
    e = _planted_embeddings(groups)
    offsets = torch.from_numpy(np.random.default_rng(7).standard_normal((16, e.shape[2])) * 1.5).float()
    drifted = e + offsets
    raw, _ = partition_features(names, interaction_matrix(drifted, center=False), 4, seed=0, steps=600, restarts=2)
    centred, _ = partition_features(names, interaction_matrix(drifted, center=True), 4, seed=0, steps=600,
                                    restarts=2)
    assert adjusted_rand_index(raw.labels(names), groups) < 0.5
    assert adjusted_rand_index(centred.labels(names), groups) == 1.0
    np.testing.assert_allclose(interaction_matrix(drifted, center=True), interaction_matrix(e, center=True),
                               atol=0.05)


def test_swap_refinement_reaches_a_2_opt_optimum_and_never_worsens():
    rng = np.random.default_rng(5)
    F, k = 10, 2
    A = rng.random((F, F))
    D = (A + A.T) / 2
    np.fill_diagonal(D, 0)

    def within(lab):
        return sum(D[i, j] for i in range(F) for j in range(i + 1, F) if lab[i] == lab[j])

    start = np.arange(F) % k
    lab, swaps = refine_by_swaps(D, start)
    assert sorted(np.bincount(lab)) == sorted(np.bincount(start))  # sizes kept
    assert within(lab) <= within(start) and swaps > 0
    for i in range(F):  # no single swap improves on it (checked by recomputing, not by the gain formula)
        for j in range(F):
            if lab[i] != lab[j]:
                other = lab.copy()
                other[i], other[j] = lab[j], lab[i]
                assert within(other) >= within(lab) - 1e-12
    # planted blocks, started one pair away: the refinement puts the pair back
    groups = np.repeat(np.arange(3), 4)
    Dp = np.where(groups[:, None] == groups[None, :], 0.2, 1.0) + 0.01 * rng.random((12, 12))
    Dp = (Dp + Dp.T) / 2
    np.fill_diagonal(Dp, 0)
    off = groups.copy()
    off[0], off[4] = off[4], off[0]
    lab, swaps = refine_by_swaps(Dp, off)
    assert adjusted_rand_index(lab, groups) == 1.0 and swaps == 1
    # partition_features with the refinement never ends above the same runs without it
    I = 1 - Dp
    names = [f"f{i}" for i in range(12)]
    for seed in range(3):
        _, with_r = partition_features(names, I, 3, seed=seed, steps=300, restarts=2, trials=2)
        _, without = partition_features(names, I, 3, seed=seed, steps=300, restarts=2, trials=2, refine=False)
        assert with_r["within_tower_distance"] <= without["within_tower_distance"] + 1e-12


class _EmbOnly(torch.nn.Module):
    """A 'trained model' whose pooled embeddings are planted: exercises learn_towers' plumbing."""

    def __init__(self, groups):
        super().__init__()
        self.feature_names = [f"C{i + 1}" for i in range(len(groups))]
        self.feature_dims = [12] * len(groups)
        self.groups = groups
        self.calls = 0

    def pooled(self, sparse):
        self.calls += 1
        return _planted_embeddings(self.groups, B=sparse.batch_size, seed=self.calls).reshape(sparse.batch_size, -1)


def test_learn_towers_end_to_end_with_unequal_towers(tmp_path):
    groups = np.random.default_rng(5).permutation(np.arange(10) % 3)  # groups of 4, 3, 3
    model = torch.nn.Module()
    model.sparse_arch = _EmbOnly(groups)
    from embedscale.data.batch import JaggedFeatures

    batches = [JaggedFeatures.from_dense(model.sparse_arch.feature_names, torch.zeros(100, 10, dtype=torch.int64))] * 4
    a, rep = learn_towers(model, batches, 3, "coherent", max_ratio=1.0, steps=600, restarts=2, trials=2, max_batches=3)
    assert model.sparse_arch.calls == 3
    assert rep["max_ratio_used"] == pytest.approx(4 / 3) and sorted(a.sizes) == [3, 3, 4]
    assert adjusted_rand_index(a.labels(model.sparse_arch.feature_names), groups) >= 0.9
    a.save(tmp_path / "towers.json")
    b = TowerAssignment.load(tmp_path / "towers.json")
    assert b.towers == a.towers and b.strategy == "coherent"
    plot_interaction(rep, tmp_path / "towers.png")
    assert (tmp_path / "towers.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.json").write_text('{"version": 1, "towers": [["a"], ["a"]]}')
    with pytest.raises(FormatError, match="towers 0 and 1"):
        TowerAssignment.load(tmp_path / "bad.json")


def test_learn_towers_on_a_trained_dlrm():
    """A small DLRM trained on planted groups: the coherent partition recovers them (ARI >= 0.9)."""
    from embedscale.embedding.local import LocalEmbeddingBags
    from embedscale.models import build_model
    from embedscale.specs import ModelConfig

    torch.manual_seed(0)
    data = PlantedGroups(num_features=8, num_groups=2, num_rows=30, seed=1)
    tables = data.tables(8)
    model = build_model(ModelConfig(embedding_dim=8, bottom_mlp=[16], top_mlp=[16]), tables, data.num_dense,
                        embedding=LocalEmbeddingBags(tables, optimizer="rowwise_adagrad", lr=1.0, seed=0))
    opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.05)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for b in data.batches(0, 120_000, 512):
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels).backward()
            opt.step()
        a, _ = learn_towers(model, data.batches(10**7, 4096, 1024), 2, "coherent", steps=600, restarts=2, trials=2)
    finally:
        torch.set_num_threads(threads)
    assert adjusted_rand_index(a.labels(data.feature_names), data.group_labels) >= 0.9


def test_assignment_validation():
    with pytest.raises(ConfigError, match="no features"):
        TowerAssignment([["a"], []])
    a = TowerAssignment([["a", "b"], ["c"]])
    with pytest.raises(ConfigError, match="missing"):
        a.check_covers(["a", "b", "c", "d"])
    with pytest.raises(ConfigError, match="in no tower"):
        a.tower_of("z")
    with pytest.raises(InputError, match="square"):
        distance_matrix(np.zeros((2, 3)))


def test_group_sums_teacher_matches_its_definition():
    """``interaction="group_sums"`` (the AUC benchmark's teacher, DMT 3.2's hierarchical interaction): the
    logit recomputed sample by sample from the definition: group sums of the features' latents, a bilinear
    form per pair of groups, row biases, dense part."""
    d = PlantedGroups(num_features=6, num_groups=3, num_rows=7, latent_dim=2, num_dense=2, interaction="group_sums",
                      correlation=0.0, seed=3)
    n = 40
    b, logit = d.batch_with_logit(100, n)
    ids = b.sparse.values.numpy().reshape(len(b.sparse.keys), n).T  # one-hot, key-major
    for s in range(n):
        sums = [sum(d.feature_latents[f, ids[s, f]] for f in range(6) if d.group_labels[f] == g) for g in range(3)]
        pair = sum(sums[g] @ d.group_forms[g, h] @ sums[h] for g in range(3) for h in range(g + 1, 3))
        row = sum(d.biases[f, ids[s, f]] for f in range(6))
        dense = float(b.dense[s].double().numpy() @ d.dense_w)
        want = d.bias + d.coef[0] * pair + d.coef[2] * row + d.coef[3] * dense
        assert logit[s] == pytest.approx(want, abs=1e-6)  # the batch holds the dense features as float32
    # the interaction part has the configured scale (pair_scale 1.5) on a large draw
    big, big_logit = d.batch_with_logit(0, 20_000)
    assert d.coef[1] == 0.0 and np.std(big_logit) > 1.0
    # the other teachers' draws are untouched by the new one (drawn last)
    w = PlantedGroups(num_features=6, num_groups=3, num_rows=7, latent_dim=2, num_dense=2, interaction="within",
                      correlation=0.0, seed=3)
    assert (w.group_labels == d.group_labels).all() and np.array_equal(w.biases, d.biases)
    with pytest.raises(ConfigError, match="interaction 'sums' is not one of"):
        PlantedGroups(interaction="sums")
