"""TT tables against independent references written here: the table materialised from the cores by eq. 2
(numpy's unravel_index for eq. 3, einsum for the products) looked up by ``nn.EmbeddingBag``; one optimizer
step computed by torch autograd through that materialisation plus the update rule; and the TT-Rec
reference class."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from embedscale.embedding.tt import (
    GradSyncBucket,
    TTEmbeddingBag,
    TTRecEmbeddingBag,
    core_shapes,
    default_init_std,
    factor_dim,
    factor_rows,
    tt_num_parameters,
)
from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec

TOL = 1e-5


# -- independent reference -------------------------------------------------------------------------
def materialise(cores, row_shape, dim_shape, ranks, num_rows):
    """``[num_rows, dim]`` from eq. 2, differentiable in ``cores`` (cores ``[m_k, R_{k-1}, n_k R_k]``)."""
    rows = np.arange(num_rows)
    tt_idx = np.unravel_index(rows, row_shape)  # eq. 3, i_1 most significant
    d = len(cores)
    out = None
    for k in range(d):
        s = cores[k][torch.from_numpy(tt_idx[k].astype(np.int64))]  # [rows, R_{k-1}, n_k R_k]
        s = s.view(num_rows, ranks[k], dim_shape[k], ranks[k + 1])
        if out is None:
            out = s[:, 0]  # [rows, n_1, R_1]
        else:
            out = torch.einsum("bjr,brns->bjns", out, s).reshape(num_rows, -1, ranks[k + 1])
    return out.reshape(num_rows, -1)


def ref_table(m):
    return materialise([c.detach() for c in m.cores], m.row_shape, m.dim_shape, m.ranks, m.num_embeddings)


def ref_bag(m, weight=None):
    w = ref_table(m) if weight is None else weight
    bag = nn.EmbeddingBag(m.num_embeddings, m.embedding_dim, mode=m.mode, include_last_offset=m.include_last_offset)
    with torch.no_grad():
        bag.weight.copy_(w)
    return bag


def expected_step(m, ids, offsets, psw, grad_out, lr, eps, optimizer, state=None):
    """Cores after one step: autograd through the materialised table, then the optimizer's rule."""
    cores = [c.detach().clone().requires_grad_(True) for c in m.cores]
    w = materialise(cores, m.row_shape, m.dim_shape, m.ranks, m.num_embeddings)
    out = nn.functional.embedding_bag(ids, w, offsets, mode=m.mode, per_sample_weights=psw,
                                      include_last_offset=m.include_last_offset)
    (out * grad_out).sum().backward()
    new, new_state = [], []
    for k, c in enumerate(cores):
        g = c.grad
        if optimizer == "sgd":
            new.append(c.detach() - lr * g)
            continue
        s = state[k].clone() if state is not None else torch.zeros_like(g if optimizer == "adagrad" else g[:, 0, 0])
        if optimizer == "adagrad":
            s = s + g * g
            new.append(c.detach() - lr * g / (s.sqrt() + eps))
        else:  # row-wise over core slices
            s = s + (g * g).mean(dim=(1, 2))
            new.append(c.detach() - lr * g / (s.sqrt() + eps).view(-1, 1, 1))
        new_state.append(s)
    return new, new_state


def batch(num_rows, B, rng, hot=8, max_len=4):
    """Jagged bags with repeats (a hot set) and empty bags."""
    lengths = torch.from_numpy(rng.integers(0, max_len + 1, B))
    n = int(lengths.sum())
    ids = np.where(rng.random(n) < 0.5, rng.integers(0, hot, n), rng.integers(0, num_rows, n))
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.from_numpy(ids.astype(np.int64)), offsets


# -- factorisation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_rows", [1, 7, 1000, 1001, 123_457, 10_131_227, 39_884_406])
@pytest.mark.parametrize("d", [2, 3, 4])
def test_factor_rows_covers_with_little_padding(num_rows, d):
    f = factor_rows(num_rows, d)
    assert len(f) == d and math.prod(f) >= num_rows
    # never more padding than the plain balanced choice ceil(M^(1/d))^d
    c = math.ceil(num_rows ** (1 / d) - 1e-9)
    while c ** d < num_rows:
        c += 1
    assert math.prod(f) <= c ** d
    assert max(f) - min(f) <= 5
    assert f[-1] == max(f)


@pytest.mark.parametrize("dim", [1, 4, 13, 16, 64, 128])
def test_factor_dim_exact_balanced(dim):
    f = factor_dim(dim, 3)
    assert math.prod(f) == dim and f == sorted(f)
    brute = min(max(a, b, dim // (a * b)) for a in range(1, dim + 1) for b in range(1, dim + 1)
                if dim % (a * b) == 0)
    assert max(f) == brute


def test_defaults_and_sizes():
    assert factor_dim(16) == [2, 2, 4] and factor_dim(64) == [4, 4, 4]
    m = TTEmbeddingBag(10_131_227, 16, 32, optimizer=None)
    assert math.prod(m.row_shape) >= 10_131_227
    assert m.num_parameters == tt_num_parameters(10_131_227, 16, 32)
    assert [tuple(c.shape) for c in m.cores] == core_shapes(m.row_shape, m.dim_shape, [1, 32, 32, 1])
    assert m.core_bytes * 300 < m.uncompressed_bytes  # a 10M x 16 table in a few MB


# -- forward == nn.EmbeddingBag over the materialised table -----------------------------------------
@pytest.mark.parametrize("cls", [TTEmbeddingBag, TTRecEmbeddingBag])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("shape", [dict(num_cores=3), dict(num_cores=2), dict(num_cores=4),
                                   dict(row_shape=[5, 3, 7], dim_shape=[3, 1, 4])])
def test_forward_equals_materialised_embedding_bag(cls, mode, shape):
    rng = np.random.default_rng(0)
    M = 100 if "row_shape" in shape else 997
    dim = 12 if "dim_shape" in shape else 16
    rank = [3, 5] if "row_shape" in shape else 4
    m = cls(M, dim, rank, mode=mode, optimizer="sgd", seed=1, init_std=0.5, **shape)
    bag = ref_bag(m)
    ids, offsets = batch(M, 64, rng)
    psw = torch.rand(ids.numel()) if mode == "sum" else None
    with torch.no_grad():
        got = m(ids, offsets, psw)
    want = bag(ids, offsets, per_sample_weights=psw)
    assert got.shape == (64, dim)
    assert (got - want).abs().max() < TOL


def test_forward_conventions_2d_input_last_offset_and_grouping_fallback():
    rng = np.random.default_rng(1)
    m = TTEmbeddingBag(500, 8, 4, optimizer=None, seed=2, init_std=0.5, include_last_offset=True)
    bag = ref_bag(m)
    ids, offsets = batch(500, 32, rng)
    offs = torch.cat([offsets, torch.tensor([ids.numel()])])
    want = bag(ids, offs)
    assert (m(ids, offs) - want).abs().max() < TOL
    m.max_padding = 0.0  # every level falls back to the per-entry gather
    assert (m(ids, offs) - want).abs().max() < TOL
    m.grouped = False
    assert (m(ids, offs) - want).abs().max() < TOL
    ids2 = torch.from_numpy(rng.integers(0, 500, (10, 3)))
    m2 = TTEmbeddingBag(500, 8, 4, optimizer="sgd", seed=2, init_std=0.5)
    m2.copy_cores_from(m)
    assert (m2(ids2) - nn.functional.embedding_bag(ids2, ref_table(m2), mode="sum")).abs().max() < TOL
    empty = m2(torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    assert empty.shape == (3, 8) and not empty.any()


def test_reuse_levels_count_distinct_prefixes():
    m = TTEmbeddingBag(1000, 4, 2, row_shape=[10, 10, 10], dim_shape=[1, 2, 2], optimizer=None)
    ids = torch.tensor([0, 1, 2, 2, 9, 10, 11, 999, 999])  # prefixes (0,0) (0,1) (9,9); rows 7 distinct
    with torch.no_grad():
        m(ids, torch.arange(ids.numel()))
    assert m.last_sizes == [2, 3, 7]


# -- one optimizer step ------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fused_steps_equal_autograd_and_ttrec(optimizer, mode):
    rng = np.random.default_rng(3)
    M, dim, lr, eps = 600, 8, 0.3, 1e-8
    ours = TTEmbeddingBag(M, dim, [4, 3], mode=mode, optimizer=optimizer, lr=lr, eps=eps, seed=4, init_std=0.3)
    ttrec = TTRecEmbeddingBag(M, dim, [4, 3], mode=mode, optimizer=optimizer, lr=lr, eps=eps, seed=9)
    ttrec.copy_cores_from(ours)
    state = None
    for step in range(2):
        ids, offsets = batch(M, 48, rng)
        psw = torch.rand(ids.numel()) if mode == "sum" else None
        grad_out = torch.randn(48, dim)
        want, state = expected_step(ours, ids, offsets, psw, grad_out, lr, eps, optimizer, state)
        for m in (ours, ttrec):
            (m(ids, offsets, psw) * grad_out).sum().backward()
            for c, w in zip(m.cores, want):
                assert (c - w).abs().max() < TOL * max(1.0, float(w.abs().max()))
            for s, w in zip(m.states, state):
                assert (s - w).abs().max() < TOL * max(1.0, float(w.abs().max()))
        for c in ours.cores:
            assert c.grad is None


def test_fused_step_with_padding_fallback_and_without_grouping():
    rng = np.random.default_rng(5)
    ids, offsets = batch(400, 40, rng)
    grad_out = torch.randn(40, 8)
    results = []
    for grouped, pad in ((True, 4.0), (True, 0.0), (False, 4.0)):
        m = TTEmbeddingBag(400, 8, 4, optimizer="adagrad", lr=0.2, seed=6, grouped=grouped, max_padding=pad)
        (m(ids, offsets) * grad_out).sum().backward()
        results.append([c.clone() for c in m.cores])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert (a - b).abs().max() < 1e-6


def test_autograd_mode_gradients():
    rng = np.random.default_rng(7)
    m = TTEmbeddingBag(300, 6, 3, optimizer=None, seed=8, init_std=0.4)
    ids, offsets = batch(300, 20, rng)
    g = torch.randn(20, 6)
    (m(ids, offsets) * g).sum().backward()
    cores = [c.detach().clone().requires_grad_(True) for c in m.cores]
    w = materialise(cores, m.row_shape, m.dim_shape, m.ranks, 300)
    (nn.functional.embedding_bag(ids, w, offsets, mode="sum") * g).sum().backward()
    for c, r in zip(m.cores, cores):
        assert (c.grad - r.grad).abs().max() < TOL
    assert len(list(m.parameters())) == 3


@pytest.mark.parametrize("cls", [TTEmbeddingBag, TTRecEmbeddingBag])
def test_grad_sync_data_parallel_equals_full_batch(cls):
    """Two replicas, each half the batch, gradients summed by grad_sync: the full-batch step."""
    rng = np.random.default_rng(9)
    ids = torch.from_numpy(rng.integers(0, 500, 64))
    g = torch.randn(64, 8)
    full = cls(500, 8, 4, optimizer="adagrad", lr=0.1, seed=1)
    (full(ids, torch.arange(64)) * g).sum().backward()

    rank0 = cls(500, 8, 4, optimizer="adagrad", lr=0.1, seed=1)
    other = TTEmbeddingBag(500, 8, 4, optimizer=None)  # rank 1's gradient via autograd
    other.copy_cores_from(rank0)
    (other(ids[32:], torch.arange(32)) * g[32:]).sum().backward()
    calls = []

    def all_reduce(grads):
        calls.append(len(grads))
        for mine, theirs in zip(grads, [c.grad for c in other.cores]):
            mine.add_(theirs)

    rank0.grad_sync = all_reduce
    (rank0(ids[:32], torch.arange(32)) * g[:32]).sum().backward()
    assert calls == [3]
    for a, b in zip(rank0.cores, full.cores):
        assert (a - b).abs().max() < TOL


def test_grad_sync_bucket_one_sum_for_all_tables_equals_full_batch():
    """Two TT tables sharing a GradSyncBucket, two replicas with half the batch each: one sync call per step
    (all six cores, in the bucket's table order whatever order the backwards ran in), and every table ends as
    the full-batch step leaves it; a table contributing twice before the others is an error."""
    rng = np.random.default_rng(11)
    ids = {n: torch.from_numpy(rng.integers(0, r, 64)) for n, r in (("a", 500), ("b", 900))}
    g = {n: torch.randn(64, 8) for n in ids}
    kw = dict(optimizer="rowwise_adagrad", lr=0.1)
    full = {n: TTEmbeddingBag(r, 8, 4, seed=i, name=n, **kw) for i, (n, r) in enumerate((("a", 500), ("b", 900)))}
    for n, m in full.items():
        (m(ids[n], torch.arange(64)) * g[n]).sum().backward()
    mine = {n: TTEmbeddingBag(r, 8, 4, seed=i, name=n, **kw) for i, (n, r) in enumerate((("a", 500), ("b", 900)))}
    other = {}
    for n, m in mine.items():  # the other replica's gradients, by autograd on its half of the batch
        other[n] = TTEmbeddingBag(m.num_embeddings, 8, 4, optimizer=None)
        other[n].copy_cores_from(m)
        (other[n](ids[n][32:], torch.arange(32)) * g[n][32:]).sum().backward()
    calls = []

    def all_reduce(grads):
        calls.append([tuple(t.shape) for t in grads])
        theirs = [c.grad for n in ("a", "b") for c in other[n].cores]
        for x, y in zip(grads, theirs):
            x.add_(y)

    bucket = GradSyncBucket(all_reduce, ["a", "b"])
    for m in mine.values():
        m.grad_sync = bucket
    out_b = (mine["b"](ids["b"][:32], torch.arange(32)) * g["b"][:32]).sum()
    out_a = (mine["a"](ids["a"][:32], torch.arange(32)) * g["a"][:32]).sum()
    out_b.backward()  # b first: the bucket still sums in its order, a then b
    assert calls == [] and bucket.pending == ["b"]
    out_a.backward()
    assert calls == [[tuple(c.shape) for n in ("a", "b") for c in mine[n].cores]] and bucket.syncs == 1
    for n in ("a", "b"):
        for x, y in zip(mine[n].cores, full[n].cores):
            assert (x - y).abs().max() < TOL
    mine["a"](ids["a"][:8], torch.arange(8)).sum().backward()
    with pytest.raises(InputError, match="'a': a second backward before the TT tables \\['b'\\]"):
        mine["a"](ids["a"][:8], torch.arange(8)).sum().backward()
    with pytest.raises(ConfigError, match="repeat"):
        GradSyncBucket(all_reduce, ["a", "a"])


def test_grad_sync_bucket_deferred_sum_finishes_within_backward_and_equals_blocking():
    """A sync that can start asynchronously (``start``): the bucket starts the sum at the last table's backward
    and finishes it, and updates, in the backward's final callback: after every later node of the same backward
    (a dense layer below), before ``backward()`` returns; the cores equal the blocking path's exactly."""
    rng = np.random.default_rng(12)
    ids = {n: torch.from_numpy(rng.integers(0, r, 48)) for n, r in (("a", 500), ("b", 900))}
    kw = dict(optimizer="rowwise_adagrad", lr=0.1)
    events = []

    class Sync:
        def __init__(self):
            self.scale = 2.0  # "the other rank's" gradient equals ours: the sum doubles it

        def __call__(self, grads):
            events.append("blocking")
            for x in grads:
                x.mul_(self.scale)

        def start(self, grads):
            events.append("start")

            def finish():
                events.append("finish")
                for x in grads:
                    x.mul_(self.scale)
            return finish

    def run(deferred):
        mods = {n: TTEmbeddingBag(r, 8, 4, seed=i, name=n, **kw) for i, (n, r) in enumerate((("a", 500), ("b", 900)))}
        bucket = GradSyncBucket(Sync(), ["a", "b"], deferred=deferred)
        for m in mods.values():
            m.grad_sync = bucket
        w = torch.ones(16, requires_grad=True)
        before = [c.clone() for c in mods["a"].cores]

        def dense_below(grad):  # a node the engine runs after both tables' backward
            events.append("dense")
            assert all(torch.equal(x, y) for x, y in zip(mods["a"].cores, before)) == deferred
            return grad

        w.register_hook(dense_below)
        scale = (w * 2).sum()  # made before the lookups: the engine runs its backward after theirs
        out = sum((mods[n](ids[n], torch.arange(48)) * scale).sum() for n in ("a", "b"))
        out.backward()
        assert bucket.syncs == 1 and bucket.pending == []
        return [c.clone() for n in ("a", "b") for c in mods[n].cores]

    blocking = run(False)
    assert events == ["blocking", "dense"]
    events.clear()
    deferred = run(True)
    assert events == ["start", "dense", "finish"]
    assert all(torch.equal(x, y) for x, y in zip(blocking, deferred))
    events.clear()
    mods = TTEmbeddingBag(500, 8, 4, seed=0, name="a", **kw)  # outside a backward (a direct call): blocking
    mods.grad_sync = GradSyncBucket(Sync(), ["a"])
    mods.grad_sync.contribute(mods, mods._zero_grads())
    assert events == ["blocking"] and mods.grad_sync.syncs == 1


def test_mixed_embedding_sums_all_tt_tables_in_one_call():
    """MixedEmbedding's TT tables share one bucket: one grad_sync call per backward, holding every core."""
    from embedscale.embedding.mixed import MixedEmbedding

    tables = [TableSpec("s", 50, 4), TableSpec("x", 3000, 4), TableSpec("y", 4000, 4)]
    calls = []
    emb = MixedEmbedding(tables, tt={"x": 2, "y": 3}, optimizer="rowwise_adagrad", lr=0.1, seed=0,
                         grad_sync=lambda grads: calls.append(len(grads)))
    jf = JaggedFeatures.from_dense(["s", "x", "y"], torch.tensor([[1, 5, 7], [2, 2999, 3999]]))
    for step in range(3):
        emb(jf).sum().backward()
        assert calls == [6] * (step + 1)
    assert emb.grad_sync_bucket.syncs == 3 and all(m.grad_sync is emb.grad_sync_bucket for m in emb.tt.values())


# -- initialisation, state, errors -------------------------------------------------------------------
def test_init_reconstructs_intended_distribution():
    m = TTEmbeddingBag(20_000, 16, 16, optimizer="sgd", seed=0)
    w = m.full_weight()
    target = default_init_std(20_000)
    assert abs(float(w.std()) / target - 1) < 0.1
    assert abs(float(w.mean())) < 0.05 * target
    assert abs(float(m.full_weight().std()) - float(TTEmbeddingBag(20_000, 16, 16, seed=0).full_weight().std())) == 0
    custom = TTEmbeddingBag(20_000, 16, 16, init_std=0.01, seed=1).full_weight()
    assert abs(float(custom.std()) / 0.01 - 1) < 0.1


def test_state_dict_round_trip_and_from_spec():
    spec = TableSpec("big", 5000, 8, pooling="mean")
    a = TTEmbeddingBag.from_spec(spec, 6, optimizer="adagrad", lr=0.1, seed=0)
    assert (a.name, a.mode, a.ranks) == ("big", "mean", [1, 6, 6, 1])
    ids = torch.arange(0, 5000, 7)
    a(ids, torch.arange(0, ids.numel(), 4)).sum().backward()  # non-zero Adagrad state
    sd = a.state_dict()
    assert set(sd) == {f"{p}{k}" for p in ("core", "state") for k in range(3)}
    b = TTEmbeddingBag.from_spec(spec, 6, optimizer="adagrad", lr=0.1, seed=1)
    b.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(a(ids, torch.arange(0, ids.numel(), 4)), b(ids, torch.arange(0, ids.numel(), 4)))
    assert all(torch.equal(x, y) for x, y in zip(a.states, b.states))


def test_errors_name_table_and_value():
    m = TTEmbeddingBag(100, 8, 2, name="C3")
    with pytest.raises(InputError, match=r"'C3'.*row id 100 .*\[0, 100\)"):
        m(torch.tensor([1, 100]), torch.tensor([0]))
    with pytest.raises(InputError, match=r"'C3'.*row id -1"):
        m(torch.tensor([-1, 3]), torch.tensor([0]))
    with pytest.raises(InputError, match="offsets"):
        m(torch.tensor([1, 2, 3]), torch.tensor([0, 3, 2]))
    with pytest.raises(InputError, match="needs offsets"):
        m(torch.tensor([1, 2]))
    with pytest.raises(InputError, match="per_sample_weights"):
        m(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3))
    mean = TTEmbeddingBag(100, 8, 2, mode="mean", optimizer=None)  # weighted mean: weighted sum / length
    got = mean(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), torch.tensor([2.0, 4.0, 5.0]))
    rows = ref_table(mean)
    assert (got[0] - (2 * rows[1] + 4 * rows[2]) / 2).abs().max() < TOL and (got[1] - 5 * rows[3]).abs().max() < TOL
    with pytest.raises(ConfigError, match="dim_shape"):
        TTEmbeddingBag(100, 8, 2, dim_shape=[2, 2, 3])
    with pytest.raises(ConfigError, match="covers"):
        TTEmbeddingBag(100, 8, 2, row_shape=[4, 4, 4])
    with pytest.raises(ConfigError, match="optimizer"):
        TTEmbeddingBag(100, 8, 2, optimizer="adam")
    with pytest.raises(ConfigError, match="pool"):
        TTEmbeddingBag.from_spec(TableSpec("s", 10, 4, pooling="none"), 2)


# -- compression policy and report ---------------------------------------------------------------------
def test_tt_policy_and_compression_bars():
    from embedscale.embedding.compression import EL_REC_THRESHOLD_ROWS, compression_report, split_tables, table_bytes
    from embedscale.plan.forms import TableForm, decide_forms
    from embedscale.specs import CRITEO_KAGGLE_ROWS, CRITEO_TERABYTE_ROWS, TableConfig

    def el_rec(tables, requests=()):  # EL-Rec VI-A: the tables of more than 1M rows are TT of rank 32
        return decide_forms(tables, requests=requests, tt_min_rows=EL_REC_THRESHOLD_ROWS + 1, tt_rank=32)

    tables = [TableSpec("a", 1_000_000, 16), TableSpec("b", 1_000_001, 16), TableSpec("c", 5_000_000, 16)]
    forms = el_rec(tables, [TableConfig("c", 5_000_000, 16, compression="tt", tt_rank=8)])
    assert forms == {"a": TableForm(), "b": TableForm("tt", tt_rank=32), "c": TableForm("tt", tt_rank=8)}
    plain, tt = split_tables(tables, forms)
    assert [t.name for t in plain] == ["a"] and [t.name for t in tt] == ["b", "c"]
    m = TTEmbeddingBag.from_spec(tables[1], forms["b"].tt_rank, optimizer=None)
    expected = sum(mk * m.ranks[k] * nk * m.ranks[k + 1] for k, (mk, nk) in enumerate(zip(m.row_shape, m.dim_shape)))
    assert table_bytes(tables[1], forms["b"]) == expected * 4 == m.core_bytes
    assert table_bytes(tables[0], forms["a"]) == 1_000_000 * 16 * 4
    with pytest.raises(ConfigError, match="pooling 'none'"):
        el_rec([TableSpec("s", 2_000_000, 16, pooling="none")])
    # EL-Rec Table III: Kaggle >= 7x (7.29x), Terabyte at dim 64 >= 70x (74.19x)
    kaggle_tables = [TableSpec(f"C{i}", n, 16) for i, n in enumerate(CRITEO_KAGGLE_ROWS)]
    tera_tables = [TableSpec(f"C{i}", n, 64) for i, n in enumerate(CRITEO_TERABYTE_ROWS)]
    kaggle = compression_report(kaggle_tables, el_rec(kaggle_tables))
    tera = compression_report(tera_tables, el_rec(tera_tables))
    assert kaggle.bytes_before == sum(CRITEO_KAGGLE_ROWS) * 64
    assert kaggle.ratio >= 7 and tera.ratio >= 70
    assert "**total**" in kaggle.to_markdown() and kaggle.to_dict()["ratio"] == kaggle.ratio


# -- MixedEmbedding ---------------------------------------------------------------------------------------
MIXED_TT = {"v": 3, "x": 2}  # the TT tables of mixed_tables() and their ranks


def mixed_tables():
    return [TableSpec("u", 50, 4, features=["f2", "f1"]), TableSpec("v", 3000, 4, features=["f3", "f4"]),
            TableSpec("w", 40, 4, pooling="mean"), TableSpec("x", 2000, 4, pooling="mean")]


def mixed_batch(rng, B=16):
    sizes = {"f1": 50, "f2": 50, "f3": 3000, "f4": 3000, "w": 40, "x": 2000}
    keys = ["x", "f3", "f1", "w", "f4", "f2"]  # not in table order
    lengths = {k: rng.integers(0, 4, B) for k in keys}
    values = [rng.integers(0, sizes[k], int(lengths[k].sum())) for k in keys]
    return JaggedFeatures(keys, torch.from_numpy(np.concatenate(values)),
                          torch.from_numpy(np.concatenate([lengths[k] for k in keys])))


def reference_mixed(emb, jf):
    """Per feature: nn.functional.embedding_bag over the table (materialised for TT); with per-sample
    weights, mean = weighted sum / bag length."""
    per = {k: (v, l) for k, (v, l) in jf.to_dict().items()}
    wts = dict(zip(jf.keys, torch.split(jf.weights, jf.length_per_key().tolist()))) if jf.weights is not None else {}
    outs = []
    for f in emb.feature_names:
        t = emb._feature_table[f]
        if t.name in emb.tt:
            w = ref_table(emb.tt[t.name])
        else:
            w = emb.local.table_weight(t.name)
        v, l = per[f]
        offs = torch.cumsum(l, 0) - l
        if f in wts:
            o = nn.functional.embedding_bag(v, w, offs, mode="sum", per_sample_weights=wts[f])
            if t.pooling == "mean":
                o = o / l.clamp(min=1).unsqueeze(1)
            outs.append(o)
        else:
            outs.append(nn.functional.embedding_bag(v, w, offs, mode=t.pooling))
    return torch.cat(outs, 1)


def test_mixed_forward_matches_reference_and_steps_like_its_parts():
    from embedscale.embedding.local import LocalEmbeddingBags
    from embedscale.models.builder import EmbeddingEnv, build_embedding
    from embedscale.embedding.mixed import MixedEmbedding
    from embedscale.plan.forms import TableForm

    rng = np.random.default_rng(11)
    tables = mixed_tables()
    emb = MixedEmbedding(tables, tt=MIXED_TT, optimizer="rowwise_adagrad", lr=0.1, seed=3, tt_init_std=0.3)
    assert emb.feature_names == ["f2", "f1", "f3", "f4", "w", "x"] and set(emb.tt) == {"v", "x"}
    assert emb.tt["v"].optimizer == "adagrad"
    jf = mixed_batch(rng)
    with torch.no_grad():
        got = emb(jf)
    assert got.shape == (16, 24)
    assert (got - reference_mixed(emb, jf)).abs().max() < TOL
    weighted = JaggedFeatures(jf.keys, jf.values, jf.lengths, torch.rand(jf.values.numel()))
    with torch.no_grad():
        assert (emb(weighted) - reference_mixed(emb, weighted)).abs().max() < TOL
    # one step: each part moves exactly as it does alone with the same input and gradient columns
    local = LocalEmbeddingBags([tables[0], tables[2]], optimizer="rowwise_adagrad", lr=0.1, seed=3)
    tt_v = TTEmbeddingBag.from_spec(tables[1], 3, optimizer="adagrad", lr=0.1)
    tt_x = TTEmbeddingBag.from_spec(tables[3], 2, optimizer="adagrad", lr=0.1)
    tt_v.copy_cores_from(emb.tt["v"])
    tt_x.copy_cores_from(emb.tt["x"])
    g = torch.randn(16, 24)
    (emb(jf) * g).sum().backward()
    cols = dict(zip(emb.feature_names, g.split(4, 1)))
    per = jf.to_dict()
    lk = ["f1", "f2", "w"]
    local_jf = JaggedFeatures(lk, torch.cat([per[k][0] for k in lk]), torch.cat([per[k][1] for k in lk]))
    assert local.feature_names == ["f2", "f1", "w"]
    (local(local_jf) * torch.cat([cols[k] for k in local.feature_names], 1)).sum().backward()
    for name in ("u", "w"):
        assert (local.table_weight(name) - emb.local.table_weight(name)).abs().max() < TOL
    for m, feats in ((tt_v, ["f3", "f4"]), (tt_x, ["x"])):
        vals = torch.cat([per[f][0] for f in feats])
        lens = torch.cat([per[f][1] for f in feats])
        (m(vals, torch.cumsum(lens, 0) - lens) * torch.cat([cols[f] for f in feats])).sum().backward()
        for a, b in zip(m.cores, emb.tt[m.name].cores):
            assert (a - b).abs().max() < TOL
    env = EmbeddingEnv(device=torch.device("cpu"), optimizer="sgd", tt_lr=0.1)  # the test's own device
    forms = {t.name: TableForm("tt", tt_rank=MIXED_TT[t.name]) if t.name in MIXED_TT else TableForm() for t in tables}
    assert isinstance(build_embedding([tables[0]], None, env, forms=forms), LocalEmbeddingBags)
    built = build_embedding(tables, None, env, forms=forms)
    assert isinstance(built, MixedEmbedding) and {n: m.ranks[1] for n, m in built.tt.items()} == MIXED_TT
    with pytest.raises(ConfigError, match=r"TT ranks given for tables \['y'\]"):
        MixedEmbedding(tables, tt={"y": 2})
    with pytest.raises(InputError, match="missing"):
        emb(JaggedFeatures.from_dense(["f1"], torch.tensor([[1]])))
    with pytest.raises(InputError, match=r"'v'.*row id 3000"):
        emb(JaggedFeatures.from_dense(["f1", "f2", "f3", "f4", "w", "x"], torch.tensor([[1, 1, 3000, 1, 1, 1]])))


def test_mixed_in_dlrm_state_dict_and_reordering():
    from embedscale.embedding.mixed import MixedEmbedding
    from embedscale.models import build_model
    from embedscale.reorder import Reordering, TableReordering
    from embedscale.specs import ModelConfig

    rng = np.random.default_rng(12)
    tables = mixed_tables()
    cfg = ModelConfig(arch="dlrm", embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
    perm_v = rng.permutation(3000)
    reo = Reordering([TableReordering("anything", perm_v, ["f3", "f4"])])

    def model(seed, reordering=None):
        torch.manual_seed(0)
        emb = MixedEmbedding(tables, tt=MIXED_TT, optimizer="sgd", lr=0.05, seed=seed, reordering=reordering)
        return build_model(cfg, tables, 3, embedding=emb)

    a = model(1, reo)
    assert "sparse_arch.embedding.remap.v" in a.state_dict()
    jf = mixed_batch(rng, 8)
    dense = torch.rand(8, 3)
    loss = a(dense, jf).sum()
    loss.backward()  # fused updates of both kinds, dense grads for the MLPs
    b = model(2, reo)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert torch.equal(a(dense, jf), b(dense, jf))
        # the installed map renames ids exactly as the data-path reordering does
        plain = model(3)
        plain.load_state_dict({k: v for k, v in a.state_dict().items() if "remap" not in k})
        assert torch.allclose(plain(dense, reo.apply(jf)), a(dense, jf), atol=1e-6)
        assert not torch.allclose(plain(dense, jf), a(dense, jf), atol=1e-6)
    with pytest.raises(ConfigError, match="only some features"):
        MixedEmbedding(tables, tt=MIXED_TT, reordering=Reordering([TableReordering("v", perm_v, ["f3"])]))


def test_mixed_prefetch_builds_tt_inputs_ahead_with_the_same_results():
    """MixedEmbedding.prefetch(next batch) builds the TT tables' renamed ids, bags and reuse plans on a worker;
    the lookup of that batch takes them (``prefetched_tt_steps``) and trains exactly as without prefetching, a
    lookup of another batch in between (an evaluation) takes nothing and leaves the queue; a batch never looked
    up goes stale without harm."""
    from embedscale.embedding.mixed import MixedEmbedding
    from embedscale.reorder import Reordering, TableReordering

    rng = np.random.default_rng(21)
    tables = mixed_tables()
    reo = Reordering([TableReordering("v", rng.permutation(3000), ["f3", "f4"])])
    batches = [mixed_batch(rng) for _ in range(5)]
    other = mixed_batch(rng)
    grads = [torch.randn(16, 24) for _ in batches]

    def train(prefetch: bool):
        emb = MixedEmbedding(tables, tt=MIXED_TT, optimizer="rowwise_adagrad", lr=0.1, seed=3, tt_init_std=0.3,
                             reordering=reo)
        outs = []
        if prefetch:
            emb.prefetch(batches[0])
        for i, (jf, g) in enumerate(zip(batches, grads)):
            if prefetch and i + 1 < len(batches):
                emb.prefetch(batches[i + 1])
            if i == 2:
                with torch.no_grad():
                    outs.append(emb(other))  # another batch: computed here, the queue left for the training step
            out = emb(jf)
            (out * g).sum().backward()
            outs.append(out.detach())
        return emb, outs

    ref, ref_outs = train(False)
    emb, outs = train(True)
    assert ref.prefetched_tt_steps == 0 and emb.prefetched_tt_steps == len(batches) and emb.pending_batches == 0
    for a, b in zip(outs, ref_outs):
        assert torch.equal(a, b)
    for k, v in ref.state_dict().items():
        assert torch.equal(emb.state_dict()[k], v), k
    emb.prefetch(batches[0])
    emb.prefetch(batches[1])
    emb.prefetch(batches[2])  # two never looked up: the oldest goes
    assert emb.pending_batches == 2
    with torch.no_grad():
        assert torch.equal(emb(batches[1]), ref(batches[1]))
    assert emb.prefetched_tt_steps == len(batches) + 1
