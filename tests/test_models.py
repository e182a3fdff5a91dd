"""Tests of embedscale.models (DLRM, DCN-v2, build_model) against references written here."""

from __future__ import annotations

import doctest
import importlib
import math
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

import embedscale.models as models
from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError, InputError
from embedscale.models import DCN, DLRM, CrossNet, DenseArch, InteractionArch, SparseArch, build_model
from embedscale.specs import ModelConfig, TableSpec


# --------------------------------------------------------------------------------------------------
# reference embedding module: one nn.EmbeddingBag per table, same interface as LocalEmbeddingBags


class RefEmbeddingBags(nn.Module):
    """forward(JaggedFeatures) -> [B, sum of dims], features in ``feature_names`` order."""

    def __init__(self, tables: list[TableSpec], device=None, **_ignored) -> None:
        super().__init__()
        self.feature_names = [f for t in tables for f in t.features]
        self.table_of = {f: t.name for t in tables for f in t.features}
        self.bags = nn.ModuleDict(
            {t.name: nn.EmbeddingBag(t.num_rows, t.dim, mode=t.pooling, device=device) for t in tables}
        )

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        per_key = features.to_dict()
        out = []
        for f in self.feature_names:
            values, lengths = per_key[f]
            offsets = torch.cumsum(lengths, 0) - lengths
            out.append(self.bags[self.table_of[f]](values, offsets))
        return torch.cat(out, dim=1)


def make_tables(dims=(4, 4, 4), rows=(7, 11, 5)) -> list[TableSpec]:
    return [TableSpec(f"t{i}", num_rows=r, dim=d) for i, (d, r) in enumerate(zip(dims, rows))]


def random_features(tables: list[TableSpec], B: int, gen: torch.Generator, max_len: int = 3) -> dict:
    """Multi-hot lists, some samples with no ids at all (an empty bag pools to zeros)."""
    per_key = {}
    for t in tables:
        lens = torch.randint(0, max_len + 1, (B,), generator=gen).tolist()
        per_key[t.name] = [torch.randint(0, t.num_rows, (n,), generator=gen).tolist() for n in lens]
    return per_key


def linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


# --- hand-written forward pieces, float64, from the model's own parameters -----------------------------


def manual_pool(emb: RefEmbeddingBags, per_key: dict[str, list[list[int]]], B: int) -> list[list[torch.Tensor]]:
    """pooled[b][f]: sum of the rows of sample b's ids of feature f (python loop over ids)."""
    pooled = []
    for b in range(B):
        row = []
        for f in emb.feature_names:
            w = emb.bags[emb.table_of[f]].weight.detach().double()
            acc = torch.zeros(w.shape[1], dtype=torch.float64)
            for i in per_key[f][b]:
                acc = acc + w[i]
            row.append(acc)
        pooled.append(row)
    return pooled


def manual_mlp(layers: list[nn.Linear], x: torch.Tensor, relu_last: bool) -> torch.Tensor:
    for k, lin in enumerate(layers):
        x = x @ lin.weight.detach().double().t() + lin.bias.detach().double()
        if k < len(layers) - 1 or relu_last:
            x = torch.clamp(x, min=0.0)
    return x


# --------------------------------------------------------------------------------------------------
# InteractionArch


@pytest.mark.parametrize("F", [1, 4])
def test_interaction_equals_double_loop_over_pairs(F):
    torch.manual_seed(0)
    B, D = 3, 5
    dense = torch.randn(B, D, dtype=torch.float64)
    sparse = torch.randn(B, F, D, dtype=torch.float64)
    out = InteractionArch(F)(dense, sparse)
    assert out.shape == (B, D + (F + 1) * F // 2)
    for b in range(B):
        vecs = [dense[b]] + [sparse[b, f] for f in range(F)]
        expected = list(dense[b].tolist())
        for i in range(F + 1):
            for j in range(i + 1, F + 1):
                expected.append(sum(float(vecs[i][k]) * float(vecs[j][k]) for k in range(D)))
        np.testing.assert_allclose(out[b].numpy(), np.array(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("F", [1, 26])
def test_interaction_gradients_equal_per_pair_products(F):
    """The backward (index_add into the flattened Gram matrix, then bmm) against autograd through an explicit
    sum of products per pair i < j, in float64."""
    torch.manual_seed(1)
    B, D = 4, 3
    dense = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(B, F, D, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(B, D + (F + 1) * F // 2, dtype=torch.float64)
    (InteractionArch(F)(dense, sparse) * weights).sum().backward()
    got = dense.grad.clone(), sparse.grad.clone()
    d2 = dense.detach().clone().requires_grad_(True)
    s2 = sparse.detach().clone().requires_grad_(True)
    vecs = [d2] + [s2[:, f] for f in range(F)]
    cols = [d2] + [(vecs[i] * vecs[j]).sum(1, keepdim=True) for i in range(F + 1) for j in range(i + 1, F + 1)]
    (torch.cat(cols, dim=1) * weights).sum().backward()
    torch.testing.assert_close(got[0], d2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], s2.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_dense", [True, False])
def test_interaction_same_bits_as_plain_autograd_and_float64_pairs(with_dense):
    """float32 at table1's width (26 features, D 16): the output and both gradients bit for bit those of the
    plain autograd composition (cat, bmm with the transposed view, the pairs gathered by advanced indexing),
    and within float32 rounding of an explicit float64 sum of products per pair."""
    torch.manual_seed(2)
    B, F, D = 96, 26, 16
    dense = torch.randn(B, D, requires_grad=True)
    sparse = torch.randn(B, F, D, requires_grad=True)
    width = (D + (F + 1) * F // 2) if with_dense else F * (F - 1) // 2
    weights = torch.randn(B, width)
    inter = InteractionArch(F, with_dense=with_dense)
    out = inter(dense if with_dense else None, sparse)
    (out * weights).sum().backward()

    d2, s2 = (x.detach().clone().requires_grad_(True) for x in (dense, sparse))
    v = torch.cat([d2.unsqueeze(1), s2], dim=1) if with_dense else s2
    i, j = torch.triu_indices(v.shape[1], v.shape[1], offset=1)
    pairs = torch.bmm(v, v.transpose(1, 2))[:, i, j]
    plain = torch.cat([d2, pairs], dim=1) if with_dense else pairs
    (plain * weights).sum().backward()
    assert torch.equal(out, plain)
    assert torch.equal(sparse.grad, s2.grad)
    if with_dense:
        assert torch.equal(dense.grad, d2.grad)

    d3, s3 = (x.detach().double().requires_grad_(True) for x in (dense, sparse))
    vecs = ([d3] if with_dense else []) + [s3[:, f] for f in range(F)]
    cols = ([d3] if with_dense else []) + [(vecs[a] * vecs[b]).sum(1, keepdim=True)
                                           for a in range(len(vecs)) for b in range(a + 1, len(vecs))]
    (torch.cat(cols, dim=1) * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), torch.cat(cols, dim=1).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse.grad.double(), s3.grad, rtol=1e-4, atol=1e-4)
    if with_dense:
        torch.testing.assert_close(dense.grad.double(), d3.grad, rtol=1e-4, atol=1e-4)


def test_interaction_rejects_wrong_shapes():
    with pytest.raises(InputError, match=r"\[B, 3, D\]"):
        InteractionArch(3)(torch.randn(2, 4), torch.randn(2, 2, 4))


# --------------------------------------------------------------------------------------------------
# CrossNet


def test_cross_layers_equal_formula_by_hand():
    torch.manual_seed(1)
    d, L, B = 3, 2, 2
    cross = CrossNet(d, L).double()
    with torch.no_grad():
        for b in cross.b:
            b.normal_()  # biases start at zero; make them count
    x0 = torch.randn(B, d, dtype=torch.float64)
    out = cross(x0)
    W = [w.detach().numpy() for w in cross.W]
    bias = [b.detach().numpy() for b in cross.b]
    for s in range(B):
        x0s = x0[s].numpy()
        x = x0s.copy()
        for layer in range(L):
            nxt = np.zeros(d)
            for i in range(d):
                h = sum(W[layer][i, j] * x[j] for j in range(d)) + bias[layer][i]
                nxt[i] = x0s[i] * h + x[i]
            x = nxt
        np.testing.assert_allclose(out[s].detach().numpy(), x, rtol=1e-12, atol=1e-12)


def test_low_rank_cross_equals_full_rank_with_w_equal_uv():
    torch.manual_seed(2)
    d, r, L = 6, 2, 3
    low = CrossNet(d, L, low_rank=r).double()
    full = CrossNet(d, L).double()
    with torch.no_grad():
        for layer in range(L):
            low.b[layer].normal_()
            full.W[layer].copy_(low.U[layer] @ low.V[layer])
            full.b[layer].copy_(low.b[layer])
    x0 = torch.randn(5, d, dtype=torch.float64)
    torch.testing.assert_close(low(x0), full(x0), rtol=1e-10, atol=1e-10)
    assert not hasattr(low, "W") and tuple(low.U[0].shape) == (d, r) and tuple(low.V[0].shape) == (r, d)


def test_cross_net_zero_layers_is_identity_and_checks_width():
    x = torch.randn(2, 4)
    torch.testing.assert_close(CrossNet(4, 0)(x), x)
    with pytest.raises(InputError, match=r"\[B, 5\]"):
        CrossNet(5, 1)(x)
    with pytest.raises(ConfigError, match="low_rank"):
        CrossNet(4, 1, low_rank=-1)


# --------------------------------------------------------------------------------------------------
# init


def test_init_matches_dlrm_reference_distribution():
    torch.manual_seed(3)
    lin = linears(DenseArch(512, [256]))[0]
    w_std = math.sqrt(2.0 / (512 + 256))
    b_std = math.sqrt(1.0 / 256)
    assert abs(lin.weight.std().item() / w_std - 1) < 0.03
    assert abs(lin.weight.mean().item()) < 0.05 * w_std
    assert abs(lin.bias.std().item() / b_std - 1) < 0.15
    cross = CrossNet(256, 1)
    assert abs(cross.W[0].std().item() / math.sqrt(1.0 / 256) - 1) < 0.03
    assert torch.count_nonzero(cross.b[0]) == 0


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_construction_is_deterministic_under_manual_seed(arch):
    tables = make_tables()
    cfg = ModelConfig(arch=arch, embedding_dim=4, bottom_mlp=[8], top_mlp=[8], cross_layers=2)

    def state(seed):
        torch.manual_seed(seed)
        model = build_model(cfg, tables, 3, RefEmbeddingBags(tables))
        return model.state_dict()

    a, b, c = state(0), state(0), state(1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


# --------------------------------------------------------------------------------------------------
# forward against a manual step-by-step computation


def test_dlrm_forward_equals_manual_step_by_step():
    torch.manual_seed(4)
    tables = make_tables(dims=(3, 3, 3))
    B, num_dense = 4, 5
    emb = RefEmbeddingBags(tables)
    model = DLRM(num_dense, emb, embedding_dim=3, bottom_mlp=[6, 4], top_mlp=[7])
    gen = torch.Generator().manual_seed(5)
    per_key = random_features(tables, B, gen)
    dense = torch.randn(B, num_dense, generator=gen)
    logits = model(dense, JaggedFeatures.from_lists(per_key))
    assert logits.shape == (B,)

    bottom = manual_mlp(linears(model.dense_arch), dense.double(), relu_last=True)
    pooled = manual_pool(emb, per_key, B)
    F = len(tables)
    rows = []
    for b in range(B):
        vecs = [bottom[b]] + pooled[b]
        z = [float(v) for v in bottom[b]]
        for i in range(F + 1):
            for j in range(i + 1, F + 1):
                z.append(float((vecs[i] * vecs[j]).sum()))
        rows.append(z)
    top_in = torch.tensor(rows, dtype=torch.float64)
    expected = manual_mlp(linears(model.over_arch), top_in, relu_last=False).squeeze(1)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)


def test_dcn_forward_equals_manual_step_by_step():
    torch.manual_seed(6)
    tables = make_tables(dims=(2, 5, 3))
    B, num_dense, D = 4, 3, 2
    emb = RefEmbeddingBags(tables)
    model = DCN(num_dense, emb, embedding_dim=D, feature_dims=[2, 5, 3], bottom_mlp=[4], top_mlp=[6, 5],
                cross_layers=2, cross_low_rank=0)
    with torch.no_grad():
        for b in model.cross_net.b:
            b.normal_(0, 0.1)
    gen = torch.Generator().manual_seed(7)
    per_key = random_features(tables, B, gen)
    dense = torch.randn(B, num_dense, generator=gen)
    logits = model(dense, JaggedFeatures.from_lists(per_key))

    bottom = manual_mlp(linears(model.dense_arch), dense.double(), relu_last=True)
    pooled = manual_pool(emb, per_key, B)
    x0 = torch.stack([torch.cat([bottom[b]] + pooled[b]) for b in range(B)])
    assert x0.shape == (B, D + 10) and model.cross_net.in_features == D + 10
    x = x0
    for W, bias in zip(model.cross_net.W, model.cross_net.b):
        x = x0 * (x @ W.detach().double().t() + bias.detach().double()) + x
    expected = manual_mlp(linears(model.over_arch), x, relu_last=False).squeeze(1)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)


def first_order_by_hand(model, pooled_b: list[torch.Tensor], dense_b: torch.Tensor) -> float:
    """sum_f <u_f, e_f> + <v, x> of one sample, from the model's ``first_order`` parameters, in a Python loop."""
    u = model.first_order.sparse.detach().double()
    total, k = 0.0, 0
    for e in pooled_b:
        for j in range(e.shape[0]):
            total += float(u[k + j]) * float(e[j])
        k += e.shape[0]
    if model.first_order.dense is not None:
        v = model.first_order.dense.detach().double()
        total += sum(float(v[i]) * float(dense_b[i]) for i in range(v.shape[0]))
    return total


@pytest.mark.parametrize("num_dense", [0, 3])
def test_dlrm_first_order_and_no_dense_equal_manual_forward(num_dense):
    """DLRM with the first-order term, with and without dense features, against a forward written out by hand
    (no bottom MLP without dense features: the embeddings' own pairwise dots feed the top MLP)."""
    torch.manual_seed(11)
    tables = make_tables(dims=(3, 3, 3))
    B = 4
    emb = RefEmbeddingBags(tables)
    model = DLRM(num_dense, emb, embedding_dim=3, bottom_mlp=[5], top_mlp=[6], first_order=True)
    with torch.no_grad():
        if model.first_order.dense is not None:
            model.first_order.dense.normal_()  # zero at init: make its term visible
    assert (model.dense_arch is None) == (num_dense == 0)
    gen = torch.Generator().manual_seed(12)
    per_key = random_features(tables, B, gen)
    dense = torch.randn(B, num_dense, generator=gen)
    logits = model(dense, JaggedFeatures.from_lists(per_key))

    pooled = manual_pool(emb, per_key, B)
    bottom = manual_mlp(linears(model.dense_arch), dense.double(), relu_last=True) if num_dense else None
    rows = []
    for b in range(B):
        vecs = ([bottom[b]] if num_dense else []) + pooled[b]
        z = [float(v) for v in bottom[b]] if num_dense else []
        for i in range(len(vecs)):
            for j in range(i + 1, len(vecs)):
                z.append(float((vecs[i] * vecs[j]).sum()))
        rows.append(z)
    deep = manual_mlp(linears(model.over_arch), torch.tensor(rows, dtype=torch.float64), relu_last=False).squeeze(1)
    wide = torch.tensor([first_order_by_hand(model, pooled[b], dense[b].double()) for b in range(B)])
    torch.testing.assert_close(logits.double(), deep + wide, rtol=1e-5, atol=1e-5)
    assert float(wide.abs().max()) > 1e-3  # the term is there to be checked


@pytest.mark.parametrize("num_dense", [0, 2])
def test_dcn_first_order_and_no_dense_equal_manual_forward(num_dense):
    torch.manual_seed(13)
    tables = make_tables(dims=(2, 5, 3))
    B, D = 4, 2
    emb = RefEmbeddingBags(tables)
    model = DCN(num_dense, emb, embedding_dim=D, feature_dims=[2, 5, 3], bottom_mlp=[4], top_mlp=[6],
                cross_layers=2, first_order=True)
    with torch.no_grad():
        for b in model.cross_net.b:
            b.normal_(0, 0.1)
        if model.first_order.dense is not None:
            model.first_order.dense.normal_()
    gen = torch.Generator().manual_seed(14)
    per_key = random_features(tables, B, gen)
    dense = torch.randn(B, num_dense, generator=gen)
    logits = model(dense, JaggedFeatures.from_lists(per_key))

    pooled = manual_pool(emb, per_key, B)
    if num_dense:
        bottom = manual_mlp(linears(model.dense_arch), dense.double(), relu_last=True)
        x0 = torch.stack([torch.cat([bottom[b]] + pooled[b]) for b in range(B)])
    else:
        assert model.dense_arch is None
        x0 = torch.stack([torch.cat(pooled[b]) for b in range(B)])
    assert model.cross_net.in_features == (D if num_dense else 0) + 10
    x = x0
    for W, bias in zip(model.cross_net.W, model.cross_net.b):
        x = x0 * (x @ W.detach().double().t() + bias.detach().double()) + x
    deep = manual_mlp(linears(model.over_arch), x, relu_last=False).squeeze(1)
    wide = torch.tensor([first_order_by_hand(model, pooled[b], dense[b].double()) for b in range(B)])
    torch.testing.assert_close(logits.double(), deep + wide, rtol=1e-5, atol=1e-5)


def test_first_order_is_a_config_switch_of_the_flat_models():
    tables = make_tables()
    small = dict(embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
    for arch in ("dlrm", "dcn"):
        on = build_model(ModelConfig(arch=arch, **small), tables, 3, RefEmbeddingBags(tables))
        off = build_model(ModelConfig(arch=arch, first_order=False, **small), tables, 3, RefEmbeddingBags(tables))
        assert on.first_order is not None and off.first_order is None
        assert tuple(on.first_order.sparse.shape) == (12,) and tuple(on.first_order.dense.shape) == (3,)
        names = {n for n, _ in on.named_parameters()}
        assert {"first_order.sparse", "first_order.dense"} <= names
        assert {id(p) for p in on.first_order.parameters()} <= {id(p) for p in on.dense_parameters()}


# --------------------------------------------------------------------------------------------------
# gradients and parameter split


@pytest.mark.parametrize("arch,low_rank", [("dlrm", 0), ("dcn", 0), ("dcn", 2)])
def test_gradient_reaches_every_dense_parameter_and_the_embedding(arch, low_rank):
    torch.manual_seed(8)
    tables = make_tables()
    cfg = ModelConfig(arch=arch, embedding_dim=4, bottom_mlp=[8], top_mlp=[8], cross_layers=2,
                      cross_low_rank=low_rank)
    emb = RefEmbeddingBags(tables)
    model = build_model(cfg, tables, 3, emb)
    gen = torch.Generator().manual_seed(9)
    B = 32
    per_key = random_features(tables, B, gen)
    loss = nn.functional.binary_cross_entropy_with_logits(
        model(torch.randn(B, 3, generator=gen), JaggedFeatures.from_lists(per_key)),
        torch.randint(0, 2, (B,), generator=gen).float(),
    )
    loss.backward()
    dense = list(model.dense_parameters())
    named = {id(p): n for n, p in model.named_parameters()}
    for p in dense:
        assert p.grad is not None and p.grad.abs().sum() > 0, named[id(p)]
    for t in tables:
        grad = emb.bags[t.name].weight.grad
        seen = sorted({i for ids in per_key[t.name] for i in ids})
        unseen = sorted(set(range(t.num_rows)) - set(seen))
        assert (grad[seen].abs().sum(1) > 0).all(), t.name
        assert (grad[unseen] == 0).all(), t.name


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_dense_parameters_are_all_but_the_embedding(arch):
    tables = make_tables()
    emb = RefEmbeddingBags(tables)
    model = build_model(ModelConfig(arch=arch, embedding_dim=4, bottom_mlp=[8], top_mlp=[8]), tables, 3, emb)
    assert model.sparse_arch.embedding is emb
    dense_ids = [id(p) for p in model.dense_parameters()]
    emb_ids = {id(p) for p in emb.parameters()}
    all_ids = {id(p) for p in model.parameters()}
    assert len(dense_ids) == len(set(dense_ids)) > 0
    assert not set(dense_ids) & emb_ids
    assert set(dense_ids) | emb_ids == all_ids


# --------------------------------------------------------------------------------------------------
# build_model


def test_build_model_default_sizes_follow_oper_table_1():
    tables = [TableSpec(f"C{i + 1}", num_rows=5, dim=16) for i in range(26)]
    dlrm = build_model(ModelConfig(arch="dlrm"), tables, 13, RefEmbeddingBags(tables))
    assert isinstance(dlrm, DLRM)
    bottom = [tuple(lin.weight.shape) for lin in linears(dlrm.dense_arch)]
    assert bottom == [(512, 13), (256, 512), (64, 256), (16, 64)]
    top_in = 16 + 27 * 26 // 2
    assert [tuple(lin.weight.shape) for lin in linears(dlrm.over_arch)] == [(512, top_in), (256, 512), (1, 256)]

    dcn = build_model(ModelConfig(arch="DCN", cross_low_rank=8), tables, 13, RefEmbeddingBags(tables))
    assert isinstance(dcn, DCN)
    d0 = 16 + 26 * 16
    assert dcn.cross_net.num_layers == 3
    assert [tuple(u.shape) for u in dcn.cross_net.U] == [(d0, 8)] * 3
    assert [tuple(lin.weight.shape) for lin in linears(dcn.over_arch)] == [(512, d0), (256, 512), (1, 256)]

    gen = torch.Generator().manual_seed(0)
    sparse = JaggedFeatures.from_dense([t.name for t in tables], torch.randint(0, 5, (2, 26), generator=gen))
    for model in (dlrm, dcn):
        assert model(torch.randn(2, 13, generator=gen), sparse).shape == (2,)


def test_build_model_dcn_allows_mixed_dims():
    tables = make_tables(dims=(4, 8, 2))
    model = build_model(ModelConfig(arch="dcn", embedding_dim=4, bottom_mlp=[8], top_mlp=[8]), tables, 3,
                        RefEmbeddingBags(tables))
    assert model.cross_net.in_features == 4 + 14
    sparse = JaggedFeatures.from_dense(["t0", "t1", "t2"], torch.tensor([[1, 2, 3], [0, 0, 0]]))
    assert model(torch.randn(2, 3), sparse).shape == (2,)


def test_build_model_errors():
    tables = make_tables()
    small = dict(embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
    with pytest.raises(ConfigError, match="'transformer'.*dlrm, dcn"):
        build_model(ModelConfig(arch="transformer", **small), tables, 3, RefEmbeddingBags(tables))
    mixed = make_tables(dims=(4, 8, 4))
    with pytest.raises(ConfigError, match="table 't1': dim 8 differs from model.embedding_dim 4"):
        build_model(ModelConfig(arch="dlrm", **small), mixed, 3, RefEmbeddingBags(mixed))
    with pytest.raises(ConfigError, match=r"model.bottom_mlp\[1\]"):
        build_model(ModelConfig(arch="dlrm", embedding_dim=4, bottom_mlp=[8, 0]), tables, 3, RefEmbeddingBags(tables))
    with pytest.raises(ConfigError, match="model.cross_low_rank"):
        build_model(ModelConfig(arch="dcn", cross_low_rank=-1, **small), tables, 3, RefEmbeddingBags(tables))
    with pytest.raises(ConfigError, match="num_dense"):
        build_model(ModelConfig(**small), tables, -1, RefEmbeddingBags(tables))
    one = make_tables(rows=(5,), dims=(4,))
    with pytest.raises(ConfigError, match="without dense features.*at least 2 sparse features"):
        build_model(ModelConfig(**small), one, 0, RefEmbeddingBags(one))
    seq = [TableSpec("t0", num_rows=5, dim=4, pooling="none")]
    with pytest.raises(ConfigError, match="table 't0': pooling 'none'"):
        build_model(ModelConfig(**small), seq, 3, RefEmbeddingBags(make_tables(rows=(5,), dims=(4,))))
    extra = RefEmbeddingBags(make_tables(rows=(5, 5, 5, 5), dims=(4, 4, 4, 4)))
    with pytest.raises(ConfigError, match=r"\['t3'\] that no table reads"):
        build_model(ModelConfig(**small), tables, 3, extra)
    with pytest.raises(ConfigError, match=r"\['t2'\] of the tables are not produced"):
        build_model(ModelConfig(**small), tables, 3, RefEmbeddingBags(tables[:2]))
    with pytest.raises(ConfigError, match="feature_names"):
        build_model(ModelConfig(**small), tables, 3, nn.Linear(2, 2))


def test_models_reject_mismatched_dims_and_inputs():
    tables = make_tables(dims=(4, 8, 4))
    with pytest.raises(ConfigError, match=r"different embedding dims.*'t1': 8"):
        sparse_arch = SparseArch(RefEmbeddingBags(tables), [4, 8, 4])
        sparse_arch(JaggedFeatures.from_dense(["t0", "t1", "t2"], torch.zeros(1, 3)))
    # dims declared uniform but the module returns 16 columns: caught at the first forward.
    model = DLRM(3, RefEmbeddingBags(tables), embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
    sparse = JaggedFeatures.from_dense(["t0", "t1", "t2"], torch.zeros(2, 3))
    with pytest.raises(ConfigError, match=r"returned shape \[2, 16\], expected \[2, 12\]"):
        model(torch.randn(2, 3), sparse)
    model = DLRM(3, RefEmbeddingBags(make_tables()), embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
    with pytest.raises(InputError, match=r"expected shape \[B, 3\], got \[2, 5\]"):
        model(torch.randn(2, 5), sparse)
    with pytest.raises(InputError, match="dense features have 4 samples"):
        model(torch.randn(4, 3), sparse)


def test_build_model_without_embedding_constructs_local_embedding_bags(monkeypatch):
    made = {}

    class FakeLocal(RefEmbeddingBags):
        def __init__(self, tables, device=None, **kw):
            made.update(tables=tables, device=device)
            super().__init__(tables, device=device)

    monkeypatch.setattr("embedscale.models.flat.LocalEmbeddingBags", FakeLocal)  # the default the builder makes
    tables = make_tables()
    device = torch.device("meta")  # the device comes from the caller; nothing is hard-coded
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
    model = build_model(cfg, tables, 3)
    assert isinstance(model.sparse_arch.embedding, FakeLocal)
    assert made["tables"] is tables and made["device"] is None
    on_meta = build_model(cfg, tables, 3, device=device)
    assert made["device"] is device
    assert all(p.device.type == "meta" for p in on_meta.parameters())



# --------------------------------------------------------------------------------------------------
# behaviour: a tiny training run learns a planted rule


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_training_learns_planted_separable_rule(arch):
    torch.manual_seed(10)
    gen = torch.Generator().manual_seed(11)
    tables = [TableSpec("user", num_rows=20, dim=4), TableSpec("item", num_rows=30, dim=4)]
    B = 256
    ids = torch.stack([torch.randint(0, 20, (B,), generator=gen), torch.randint(0, 30, (B,), generator=gen)], 1)
    dense = torch.randn(B, 3, generator=gen)
    planted = torch.randperm(20, generator=gen)[:10]
    user_sign = torch.where(torch.isin(ids[:, 0], planted), 1.0, -1.0)
    labels = (user_sign + 0.8 * dense[:, 0] > 0).float()
    sparse = JaggedFeatures.from_dense(["user", "item"], ids)

    emb = RefEmbeddingBags(tables)
    model = build_model(ModelConfig(arch=arch, embedding_dim=4, bottom_mlp=[8], top_mlp=[16], cross_layers=1),
                        tables, 3, emb)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=0.02)
    sparse_opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    losses = []
    for _ in range(150):
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        accuracy = ((model(dense, sparse) > 0).float() == labels).float().mean().item()
    assert losses[-1] < 0.25 * losses[0], (losses[0], losses[-1])
    assert accuracy > 0.95


# --------------------------------------------------------------------------------------------------
# docstring examples run


@pytest.mark.parametrize("module", ["embedscale.models.dlrm", "embedscale.models.dcn", "embedscale.models"])
def test_docstring_examples_run(module, monkeypatch):
    try:
        importlib.import_module("embedscale.embedding.local").LocalEmbeddingBags
    except (ImportError, AttributeError):  # not written yet: run the examples on the reference module
        monkeypatch.setitem(sys.modules, "embedscale.embedding.local",
                            types.SimpleNamespace(LocalEmbeddingBags=RefEmbeddingBags))
    result = doctest.testmod(importlib.import_module(module), verbose=False)
    assert result.attempted > 0 and result.failed == 0, result


def test_public_api():
    assert set(models.__all__) >= {"build_model", "DLRM", "DCN", "CrossNet", "SparseArch", "DenseArch",
                                   "InteractionArch", "OverArch"}
    assert models.ARCHS == ("dlrm", "dcn")


def test_a_checkpoint_without_the_first_order_term_is_named_as_such():
    from embedscale.errors import FormatError
    from embedscale.train.run import dense_state, load_dense_state

    tables = make_tables()
    small = dict(embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
    old = build_model(ModelConfig(first_order=False, **small), tables, 3, RefEmbeddingBags(tables))
    new = build_model(ModelConfig(**small), tables, 3, RefEmbeddingBags(tables))
    with pytest.raises(FormatError, match="first_order.dense.*model.first_order false"):
        load_dense_state(new, dense_state(old), "ckpt")
    load_dense_state(old, dense_state(old), "ckpt")  # the same shape loads


def test_mlps_match_a_plain_linear_relu_reference_forward_and_backward():
    """The MLPs' in-place ReLUs give the values and gradients of out-of-place Linear + ReLU layers (float64
    reference built from the same weights)."""
    from embedscale.models.dlrm import OverArch

    torch.manual_seed(0)
    bottom, top = DenseArch(13, [32, 16, 8]), OverArch(8, [16, 4])
    x = torch.rand(64, 13)
    out = top(bottom(x))
    (out ** 2).sum().backward()
    linears = [m for m in list(bottom.modules()) + list(top.modules()) if isinstance(m, torch.nn.Linear)]
    ws = [m.weight.detach().double().requires_grad_() for m in linears]
    bs = [m.bias.detach().double().requires_grad_() for m in linears]
    h = x.double()
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = h @ w.t() + b
        if i != len(ws) - 1:  # every layer but the logit's has its ReLU
            h = torch.relu(h)
    (h ** 2).sum().backward()
    torch.testing.assert_close(out.double(), h.detach(), rtol=1e-5, atol=1e-6)
    for m, w, b in zip(linears, ws, bs):
        torch.testing.assert_close(m.weight.grad.double(), w.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(m.bias.grad.double(), b.grad, rtol=1e-4, atol=1e-6)
