"""LocalEmbeddingBags against an independent reference: per-table nn.EmbeddingBag + plain torch optimizers."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding import local as local_mod
from embedscale.embedding import optim as optim_mod
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec

TOL = 1e-6


# -- reference -------------------------------------------------------------------------------------
def tables_by_feature(tables):
    return {f: t for t in tables for f in t.features}


def make_reference(ours: LocalEmbeddingBags) -> dict[str, nn.EmbeddingBag]:
    """One nn.EmbeddingBag per table with our initial weights (dense grads, plain torch optimizers)."""
    ref = {}
    for t in ours.tables:
        bag = nn.EmbeddingBag(t.num_rows, t.dim, mode="mean" if t.pooling == "mean" else "sum")
        with torch.no_grad():
            bag.weight.copy_(ours.table_weight(t.name))
        ref[t.name] = bag
    return ref


def split_features(jf: JaggedFeatures):
    """{key: (values, offsets [B], weights or None)} per key, from the KJT layout."""
    B = jf.batch_size
    lpk = jf.length_per_key().tolist()
    vals = torch.split(jf.values, lpk)
    wts = torch.split(jf.weights, lpk) if jf.weights is not None else [None] * len(lpk)
    out = {}
    for i, k in enumerate(jf.keys):
        lens = jf.lengths[i * B:(i + 1) * B]
        offs = torch.cumsum(lens, 0) - lens
        out[k] = (vals[i], offs, wts[i], lens)
    return out


def reference_forward(ours: LocalEmbeddingBags, ref: dict[str, nn.EmbeddingBag], jf: JaggedFeatures):
    spec_of = tables_by_feature(ours.tables)
    per_key = split_features(jf)
    outs = []
    for f in ours.feature_names:
        spec = spec_of[f]
        v, offs, w, lens = per_key[f]
        bag = ref[spec.name]
        if spec.pooling == "mean" and w is not None:
            # weighted mean = weighted sum / bag length (nn.EmbeddingBag has no weighted mean mode)
            per_value_len = torch.repeat_interleave(lens, lens).clamp(min=1).to(w.dtype)
            outs.append(F.embedding_bag(v, bag.weight, offs, mode="sum", per_sample_weights=w / per_value_len))
        else:
            outs.append(bag(v, offs, per_sample_weights=w))
    return torch.cat(outs, dim=1)


class DenseRowwiseAdagrad:
    """Reference EXACT_ROWWISE_ADAGRAD on dense gradients: m += mean(G^2, dim=1); W -= lr G / (sqrt(m) + eps).

    Rows not looked up have G = 0, so they keep their weight and state, as in the sparse update.
    """

    def __init__(self, params, lr, eps):
        self.params = list(params)
        self.lr, self.eps = lr, eps
        self.state = [torch.zeros(p.shape[0]) for p in self.params]

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.state):
            g = p.grad
            m += g.pow(2).mean(1)
            p -= self.lr * g / (m.sqrt() + self.eps).unsqueeze(1)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def make_optimizer(name, ref, lr, eps=1e-8):
    params = [ref[k].weight for k in ref]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return DenseRowwiseAdagrad(params, lr=lr, eps=eps)


def random_features(tables, B, gen, *, max_len=3, one_hot=False, weighted=False, keys=None, hot_rows=None):
    """Random KJT over the features of ``tables``; ``hot_rows`` draws ids from the first rows (duplicates)."""
    spec_of = tables_by_feature(tables)
    keys = keys or [f for t in tables for f in t.features]
    lengths, values = [], []
    for k in keys:
        rows = spec_of[k].num_rows
        lens = torch.ones(B, dtype=torch.int64) if one_hot else torch.randint(0, max_len + 1, (B,), generator=gen)
        n = int(lens.sum())
        hi = min(rows, hot_rows) if hot_rows else rows
        values.append(torch.randint(0, hi, (n,), generator=gen))
        lengths.append(lens)
    values = torch.cat(values)
    w = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return JaggedFeatures(keys, values, torch.cat(lengths), w)


MIXED = [
    TableSpec("a", 40, 8),
    TableSpec("b", 30, 4, pooling="mean"),
    TableSpec("c", 25, 8, features=["c1", "c2"]),  # two features share one table
    TableSpec("d", 20, 4, features=["d1", "d2"], pooling="mean"),
]
SAME_DIM = [TableSpec("u", 50, 8), TableSpec("v", 10, 8), TableSpec("w", 70, 8, features=["w1", "w2", "w3"])]


# -- forward ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", [None, "sgd"])
@pytest.mark.parametrize("case", ["one_hot", "multi_hot", "weighted", "weighted_one_hot", "shuffled_keys"])
@pytest.mark.parametrize("tables", [MIXED, SAME_DIM], ids=["mixed_dims", "same_dim"])
def test_forward_matches_per_table_embedding_bag(tables, case, optimizer):
    gen = torch.Generator().manual_seed(1)
    ours = LocalEmbeddingBags(tables, optimizer=optimizer, seed=3)
    ref = make_reference(ours)
    keys = [f for t in tables for f in t.features]
    if case == "shuffled_keys":
        keys = keys[::-1]
    jf = random_features(tables, 12, gen, one_hot=case in ("one_hot", "weighted_one_hot"),
                         weighted=case.startswith("weighted"), keys=keys)
    out = ours(jf)
    expected = reference_forward(ours, ref, jf)
    assert out.shape == (12, sum(ours.feature_dims))
    assert torch.allclose(out, expected, atol=TOL, rtol=0), (out - expected).abs().max()
    views = ours.forward_dict(jf)
    assert list(views) == ours.feature_names
    assert torch.equal(torch.cat(list(views.values()), dim=1), out.detach())


def test_empty_bags_give_zeros_for_sum_and_mean():
    tables = [TableSpec("s", 10, 4), TableSpec("m", 10, 4, pooling="mean")]
    ours = LocalEmbeddingBags(tables, seed=0)
    jf = JaggedFeatures.from_lists({"s": [[], [1, 2]], "m": [[3], []]})
    out = ours(jf).detach()
    assert torch.equal(out[0, :4], torch.zeros(4))
    assert torch.equal(out[1, 4:], torch.zeros(4))
    w = ours.table_weight
    assert torch.allclose(out[1, :4], w("s")[1] + w("s")[2], atol=TOL)
    assert torch.allclose(out[0, 4:], w("m")[3], atol=TOL)


def test_output_column_order_follows_given_table_order():
    # dims 4, 8, 4: the dim groups reorder storage, the output must not move.
    tables = [TableSpec("x", 5, 4), TableSpec("y", 5, 8), TableSpec("z", 5, 4)]
    ours = LocalEmbeddingBags(tables, seed=0)
    jf = JaggedFeatures.from_dense(["x", "y", "z"], torch.tensor([[1, 2, 3]]))
    out = ours(jf).detach()[0]
    expected = torch.cat([ours.table_weight("x")[1], ours.table_weight("y")[2], ours.table_weight("z")[3]])
    assert torch.equal(out, expected)
    assert ours.feature_names == ["x", "y", "z"] and ours.feature_dims == [4, 8, 4]


# -- training steps --------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("case", ["one_hot", "multi_hot", "weighted"])
@pytest.mark.parametrize("tables", [MIXED, SAME_DIM], ids=["mixed_dims", "same_dim"])
def test_training_steps_match_reference_optimizer(tables, case, optimizer):
    lr = 0.05
    gen = torch.Generator().manual_seed(7)
    ours = LocalEmbeddingBags(tables, optimizer=optimizer, lr=lr, seed=11)
    ref = make_reference(ours)
    opt = make_optimizer(optimizer, ref, lr)
    before = {t.name: ours.table_weight(t.name).clone() for t in tables}
    for step in range(3):
        # hot_rows=6: every table sees repeated ids within the batch (and within bags when multi-hot)
        jf = random_features(tables, 16, gen, one_hot=case == "one_hot", weighted=case == "weighted", hot_rows=6)
        grad_out = torch.randn(16, sum(ours.feature_dims), generator=gen)
        out = ours(jf)
        (out * grad_out).sum().backward()
        opt.zero_grad()
        expected = reference_forward(ours, ref, jf)
        (expected * grad_out).sum().backward()
        opt.step()
        assert torch.allclose(out, expected, atol=TOL, rtol=0), f"step {step} forward"
        for t in tables:
            diff = (ours.table_weight(t.name) - ref[t.name].weight).abs().max()
            assert diff <= TOL, f"step {step} table {t.name}: {diff}"
    for t in tables:  # the steps did move the looked-up rows (the comparison above is not vacuous)
        assert not torch.equal(ours.table_weight(t.name), before[t.name])
    if optimizer == "rowwise_adagrad":
        for t, m in zip(tables, opt.state):
            assert torch.allclose(ours.table_momentum(t.name), m, atol=TOL, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_all_samples_on_one_row(optimizer):
    """Duplicates are summed before the update (exact): one row read by every sample of the batch."""
    tables = [TableSpec("t", 5, 4, features=["f", "g"])]
    ours = LocalEmbeddingBags(tables, optimizer=optimizer, lr=0.1, seed=0)
    ref = make_reference(ours)
    opt = make_optimizer(optimizer, ref, 0.1)
    before = ours.table_weight("t").clone()
    jf = JaggedFeatures.from_dense(["f", "g"], torch.full((32, 2), 3))
    grad_out = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    (ours(jf) * grad_out).sum().backward()
    (reference_forward(ours, ref, jf) * grad_out).sum().backward()
    opt.step()
    assert torch.allclose(ours.table_weight("t"), ref["t"].weight, atol=TOL, rtol=0)
    assert not torch.equal(ours.table_weight("t")[3], before[3])
    assert torch.equal(ours.table_weight("t")[:3], before[:3])


def test_fused_mode_materialises_no_weight_grad():
    ours = LocalEmbeddingBags(SAME_DIM, optimizer="sgd", lr=0.1, seed=0)
    assert list(ours.parameters()) == []  # a dense optimizer over model.parameters() never sees the tables
    w0 = ours.weights.clone()
    jf = random_features(SAME_DIM, 8, torch.Generator().manual_seed(0))
    ours(jf).pow(2).sum().backward()
    assert ours.weights.grad is None and not ours.weights.requires_grad
    assert not torch.equal(ours.weights, w0)


def test_no_grad_forward_does_not_update():
    ours = LocalEmbeddingBags(SAME_DIM, optimizer="sgd", lr=0.1, seed=0)
    w0 = ours.weights.clone()
    with torch.no_grad():
        out = ours(random_features(SAME_DIM, 8, torch.Generator().manual_seed(0)))
    assert not out.requires_grad and torch.equal(ours.weights, w0)


@pytest.mark.parametrize("one_hot", [True, False])
def test_dense_mode_matches_fused_sgd(one_hot):
    """optimizer=None: a regular nn.Parameter with dense grads; plain torch SGD on it equals fused SGD."""
    gen = torch.Generator().manual_seed(5)
    dense = LocalEmbeddingBags(MIXED, optimizer=None, seed=2)
    fused = LocalEmbeddingBags(MIXED, optimizer="sgd", lr=0.1, seed=2)
    assert [p is dense.weights for p in dense.parameters()] == [True]
    opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    for _ in range(2):
        jf = random_features(MIXED, 8, gen, weighted=True, hot_rows=4, one_hot=one_hot)
        g = torch.randn(8, sum(dense.feature_dims), generator=gen)
        opt.zero_grad()
        (dense(jf) * g).sum().backward()
        assert dense.weights.grad is not None and dense.weights.grad.shape == dense.weights.shape
        opt.step()
        (fused(jf) * g).sum().backward()
    assert torch.allclose(dense.weights, fused.weights, atol=TOL, rtol=0)


# -- sequences, row-level API ------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_sequences_lookup_and_train(optimizer):
    tables = [TableSpec("hist", 12, 4, features=["h1", "h2"], pooling="none"), TableSpec("p", 9, 4)]
    ours = LocalEmbeddingBags(tables, optimizer=optimizer, lr=0.1, seed=4)
    assert ours.feature_names == ["p"] and ours.sequence_feature_names == ["h1", "h2"]
    ref = nn.Embedding(12, 4)
    with torch.no_grad():
        ref.weight.copy_(ours.table_weight("hist"))
    opt = make_optimizer(optimizer, {"hist": ref}, 0.1)
    jf = JaggedFeatures.from_lists({"p": [[1], [2]], "h1": [[3, 3, 5], []], "h2": [[5], [0, 11]]})
    seq = ours.lookup_sequences(jf)
    assert list(seq) == ["h1", "h2"]
    assert torch.equal(seq["h1"][1], torch.tensor([3, 0])) and torch.equal(seq["h2"][1], torch.tensor([1, 2]))
    gen = torch.Generator().manual_seed(0)
    loss = 0
    ref_loss = 0
    for f, ids in (("h1", [3, 3, 5]), ("h2", [5, 0, 11])):
        g = torch.randn(3, 4, generator=gen)
        assert torch.allclose(seq[f][0], ref(torch.tensor(ids)), atol=TOL)
        loss = loss + (seq[f][0] * g).sum()
        ref_loss = ref_loss + (ref(torch.tensor(ids)) * g).sum()
    loss.backward()
    ref_loss.backward()
    opt.step()
    assert torch.allclose(ours.table_weight("hist"), ref.weight, atol=TOL, rtol=0)
    assert not torch.equal(ours.table_weight("hist")[3], seq["h1"][0][0].detach())  # row 3 moved


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_apply_row_gradients_equals_dense_reference(optimizer):
    # a large eps, so that eps placement (sqrt(m) + eps, not sqrt(m + eps)) matters
    ours = LocalEmbeddingBags(SAME_DIM, optimizer=optimizer, lr=0.2, eps=0.3, seed=1)
    ref = make_reference(ours)
    opt = make_optimizer(optimizer, ref, 0.2, eps=0.3)
    gen = torch.Generator().manual_seed(3)
    rows = torch.tensor([0, 7, 7, 3, 0, 9])
    grads = torch.randn(6, 8, generator=gen)
    grads_copy = grads.clone()
    ours.apply_row_gradients(rows, grads, table="v")  # table-local rows
    flat = torch.tensor([2, 2, 49]) + ours.row_offset("w")  # flat rows of table w
    g2 = torch.randn(3, 8, generator=gen)
    ours.apply_row_gradients(flat, g2)
    assert torch.equal(grads, grads_copy)  # the caller's gradients are not modified
    for t in ref.values():
        t.weight.grad = torch.zeros_like(t.weight)
    ref["v"].weight.grad.index_add_(0, rows, grads)
    ref["w"].weight.grad.index_add_(0, torch.tensor([2, 2, 49]), g2)
    opt.step()
    for t in SAME_DIM:
        assert torch.allclose(ours.table_weight(t.name), ref[t.name].weight, atol=TOL, rtol=0)


def test_lookup_rows_and_bags_use_flat_offsets():
    ours = LocalEmbeddingBags(SAME_DIM, optimizer="sgd", lr=0.5, seed=1)
    off = ours.row_offset("w")
    assert off == 60 and ours.row_offset("u") == 0 and ours.row_offset("v") == 50
    assert torch.equal(ours.lookup_rows(torch.tensor([4, 1]), "w"), ours.table_weight("w")[[4, 1]])
    assert torch.equal(ours.lookup_rows(torch.tensor([off + 4])), ours.table_weight("w")[[4]])
    flat = torch.tensor([1, off + 2, off + 2, 51])
    offsets = torch.tensor([0, 3, 3, 4])
    w = ours.weights.view(-1, 8).clone()
    out = ours.lookup_bags(flat, offsets)
    expected = F.embedding_bag(flat, w, offsets, mode="sum", include_last_offset=True)
    assert torch.allclose(out, expected, atol=TOL)
    out.sum().backward()  # SGD: each looked-up row moves by -lr per occurrence
    moved = w.clone()
    moved.index_add_(0, flat, torch.full((4, 8), -0.5))
    assert torch.allclose(ours.weights.view(-1, 8), moved, atol=TOL)


# -- checkpoints -------------------------------------------------------------------------------------
def test_state_dict_round_trip(tmp_path: Path):
    gen = torch.Generator().manual_seed(0)
    a = LocalEmbeddingBags(MIXED, optimizer="rowwise_adagrad", lr=0.1, seed=0)
    jf = random_features(MIXED, 8, gen, hot_rows=5)
    a(jf).sum().backward()
    sd = a.state_dict()
    assert set(sd) == {f"{t.name}.{k}" for t in MIXED for k in ("weight", "momentum")}
    assert sd["b.weight"].shape == (30, 4) and sd["b.momentum"].shape == (30,)
    torch.save(sd, tmp_path / "emb.pt")
    loaded = torch.load(tmp_path / "emb.pt", weights_only=True)
    b = LocalEmbeddingBags(MIXED, optimizer="rowwise_adagrad", lr=0.1, seed=99)
    assert not torch.equal(a.weights, b.weights)
    b.load_state_dict(loaded)
    assert torch.equal(a.weights, b.weights) and torch.equal(a.momentum, b.momentum)
    jf2 = random_features(MIXED, 8, gen, hot_rows=5)
    a(jf2).sum().backward()
    b(jf2).sum().backward()
    assert torch.equal(a.weights, b.weights)
    # nested under a parent module: keys get the prefix
    parent = nn.Module()
    parent.emb = b
    assert "emb.a.weight" in parent.state_dict()
    parent.load_state_dict(parent.state_dict())
    missing = {k: v for k, v in loaded.items() if k != "a.momentum"}
    with pytest.raises(RuntimeError, match="a.momentum"):
        b.load_state_dict(missing)
    with pytest.raises(RuntimeError, match="shape"):
        b.load_state_dict({**loaded, "a.weight": torch.zeros(3, 8)})


# -- errors ------------------------------------------------------------------------------------------
def test_out_of_range_and_negative_ids_name_feature_table_and_value():
    ours = LocalEmbeddingBags(MIXED, seed=0)
    good = {"a": [[1], [2]], "b": [[1], [2]], "c1": [[1], [2]], "c2": [[3], [4]], "d1": [[0], [1]], "d2": [[1], [2]]}
    for one_hot in (True, False):
        bad = dict(good, c2=[[3], [25]] if one_hot else [[3, 1], [25]])
        with pytest.raises(InputError, match=r"feature 'c2' \(table 'c', 25 rows\): row id 25 at sample 1"):
            ours(JaggedFeatures.from_lists(bad))
        neg = dict(good, d1=[[-2], [1]] if one_hot else [[], [1, -2]])
        with pytest.raises(InputError, match=r"feature 'd1' \(table 'd'.*negative row id -2"):
            ours(JaggedFeatures.from_lists(neg))
    two = {k: [v[0] * 2, v[1] * 2] for k, v in good.items()}  # every bag 2 ids long: the fixed-length path
    with pytest.raises(InputError, match=r"feature 'c2' \(table 'c', 25 rows\): row id 25 at sample 1"):
        ours(JaggedFeatures.from_lists(dict(two, c2=[[3, 3], [4, 25]])))
    with pytest.raises(InputError, match=r"feature 'd1' \(table 'd'.*negative row id -2"):
        ours(JaggedFeatures.from_lists(dict(two, d1=[[-2, 0], [1, 1]])))
    ours.validate = False  # the switch is honoured: the check is skipped (torch's own error remains)
    with pytest.raises(Exception) as e:
        ours(JaggedFeatures.from_lists(dict(good, a=[[1], [10**6]])))
    assert not isinstance(e.value, InputError)


def test_key_errors():
    ours = LocalEmbeddingBags(SAME_DIM, seed=0)
    base = {"u": [[1]], "v": [[1]], "w1": [[1]], "w2": [[1]], "w3": [[1]]}
    with pytest.raises(InputError, match=r"feature 'zz' is not read by any table"):
        ours(JaggedFeatures.from_lists({**base, "zz": [[0]]}))
    with pytest.raises(InputError, match=r"got 4 features .* expected the 5 .*missing \['w2'\]"):
        ours(JaggedFeatures.from_lists({k: v for k, v in base.items() if k != "w2"}))
    with pytest.raises(InputError, match="appears twice"):
        ours(JaggedFeatures(["u", "u", "v", "w1", "w2", "w3"], torch.ones(6, dtype=torch.int64),
                            torch.ones(6, dtype=torch.int64)))
    with pytest.raises(InputError, match="lengths sum to"):
        ours(JaggedFeatures(list(base), torch.ones(4, dtype=torch.int64), torch.tensor([1, 2, 0, 1, 1])))
    with pytest.raises(InputError, match=r"table 'v'.*row 10 is outside \[0, 10\)"):
        ours.lookup_rows(torch.tensor([10]), "v")
    with pytest.raises(InputError, match="table 'nope'"):
        ours.table_weight("nope")
    with pytest.raises(InputError, match="row -1"):
        LocalEmbeddingBags(SAME_DIM, optimizer="sgd").apply_row_gradients(torch.tensor([-1]), torch.zeros(1, 8), "u")


def test_config_errors():
    with pytest.raises(ConfigError, match="optimizer 'adam'"):
        LocalEmbeddingBags(SAME_DIM, optimizer="adam")
    with pytest.raises(ConfigError, match="read by tables"):
        LocalEmbeddingBags([TableSpec("t", 10, 4, features=["f"]), TableSpec("s", 10, 4, features=["f"])])


# -- layout, init, house rules --------------------------------------------------------------------------
def test_layout_views_and_sizes():
    ours = LocalEmbeddingBags(MIXED, optimizer="rowwise_adagrad", seed=0)
    rows_dims = [(t.num_rows, t.dim) for t in MIXED]
    assert ours.num_parameters == sum(r * d for r, d in rows_dims) == ours.weights.numel()
    assert ours.memory_bytes == 4 * ours.num_parameters + 4 * sum(r for r, _ in rows_dims)
    assert [g.dim for g in ours.groups] == [8, 4]
    w = ours.table_weight("c")
    assert w.shape == (25, 8) and w.untyped_storage().data_ptr() == ours.weights.untyped_storage().data_ptr()
    with torch.no_grad():
        w[2] = 7.0  # a view: writes reach the lookup
    jf = JaggedFeatures.from_lists({"a": [[0]], "b": [[0]], "c1": [[2]], "c2": [[0]], "d1": [[0]], "d2": [[0]]})
    assert torch.equal(ours.forward_dict(jf)["c1"][0], torch.full((8,), 7.0))


def test_uniform_init_bound_and_seed():
    a = LocalEmbeddingBags(MIXED, seed=5)
    b = LocalEmbeddingBags(MIXED, seed=5)
    c = LocalEmbeddingBags(MIXED, seed=6)
    assert torch.equal(a.weights, b.weights) and not torch.equal(a.weights, c.weights)
    for t in MIXED:
        w = a.table_weight(t.name)
        bound = t.num_rows ** -0.5
        assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.5 * bound


def test_aggregate_row_gradients_sums_duplicates():
    rows = torch.tensor([5, 1, 5, 5, 2])
    src = torch.arange(12.0).view(3, 4)
    index = torch.tensor([0, 1, 2, 0, 1])
    scale = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0])
    uniq, grads = optim_mod.aggregate_row_gradients(rows, src, index, scale, num_rows=6)
    assert uniq.tolist() == [1, 2, 5]
    expected = torch.stack([2 * src[1], src[1], src[0] + 0.5 * src[2] + 3 * src[0]])
    assert torch.allclose(grads, expected)


def test_library_code_names_no_device():
    for mod in (local_mod, optim_mod):
        text = Path(mod.__file__).read_text()
        assert not re.search(r"""["'](cuda|cpu)(:\d+)?["']""", text), mod.__file__


def test_state_dict_is_weights_only_loadable_from_bytes():
    ours = LocalEmbeddingBags(SAME_DIM, optimizer="sgd", seed=0)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd) == {"u.weight", "v.weight", "w.weight"} and torch.equal(sd["w.weight"], ours.table_weight("w"))


# -- fixed-length multi-hot, chunked sorts, reused buffers ---------------------------------------
def float64_step(tables, weights0, jf, grad_out, optimizer, lr, eps=1e-8):
    """Independent float64 reference of one fused step: per-feature embedding_bag on float64 copies of the
    initial tables, dense autograd gradients, then the optimizer formula (optim's docstring)."""
    spec_of = tables_by_feature(tables)
    W = {t.name: weights0[t.name].double().requires_grad_(True) for t in tables}
    per_key = split_features(jf)
    outs = []
    for t in tables:
        if t.pooling == "none":
            continue
        for f in t.features:
            v, offs, w, lens = per_key[f]
            s = w.double() if w is not None else torch.ones(v.numel(), dtype=torch.float64)
            if spec_of[f].pooling == "mean":
                s = s / torch.repeat_interleave(lens, lens).clamp(min=1).double()
            outs.append(F.embedding_bag(v, W[t.name], offs, mode="sum", per_sample_weights=s))
    out = torch.cat(outs, dim=1)
    (out * grad_out.double()).sum().backward()
    after = {}
    for name, p in W.items():
        g = p.grad
        if optimizer == "sgd":
            after[name] = p.detach() - lr * g
        else:
            m = g.pow(2).mean(1, keepdim=True)
            after[name] = p.detach() - lr * g / (m.sqrt() + eps)
    return out.detach(), after


def fixed_length_features(tables, B, L, gen, *, weighted=False, hot_rows=None):
    keys = [f for t in tables for f in t.features]
    spec_of = tables_by_feature(tables)
    values = torch.cat([torch.randint(0, min(spec_of[k].num_rows, hot_rows or spec_of[k].num_rows), (B * L,),
                                      generator=gen) for k in keys])
    w = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return JaggedFeatures(keys, values, torch.full((len(keys) * B,), L, dtype=torch.int64), w)


ONE_TABLE_PER_FEATURE = [TableSpec("p", 60, 8), TableSpec("q", 45, 8, pooling="mean"), TableSpec("r", 30, 8)]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("tables", [ONE_TABLE_PER_FEATURE, MIXED, SAME_DIM], ids=["own_tables", "mixed", "shared"])
@pytest.mark.parametrize("L", [2, 5])
def test_fixed_length_multi_hot_step_matches_float64_reference(tables, L, weighted, optimizer):
    """Every bag L ids long (the [k, B*L] fast path; bag of value i is i // L in the backward): forward and
    updated rows of one step equal a float64 dense-autograd reference."""
    gen = torch.Generator().manual_seed(L)
    ours = LocalEmbeddingBags(tables, optimizer=optimizer, lr=0.3, seed=1)
    w0 = {t.name: ours.table_weight(t.name).clone() for t in tables}
    B = 7
    jf = fixed_length_features(tables, B, L, gen, weighted=weighted, hot_rows=6)  # hot rows: many duplicates
    grad_out = torch.randn(B, ours.output_dim, generator=gen)
    out = ours(jf)
    (out * grad_out).sum().backward()
    ref_out, ref_after = float64_step(tables, w0, jf, grad_out, optimizer, lr=0.3)
    torch.testing.assert_close(out.detach().double(), ref_out, rtol=1e-5, atol=1e-6)
    for t in tables:
        torch.testing.assert_close(ours.table_weight(t.name).double(), ref_after[t.name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed_length", "jagged"])
def test_table_chunked_sort_gives_the_same_bits_as_one_sort(monkeypatch, optimizer, fixed):
    """The backward sorts table runs in chunks (optim.SORT_CHUNK, made small here so a small batch has
    several chunks): the same order as one sort of all rows, hence bit-identical updates, and the float64
    reference holds."""
    tables = [TableSpec(f"t{i}", 40 + 7 * i, 8, pooling="mean" if i % 2 else "sum") for i in range(6)]
    gen = torch.Generator().manual_seed(3)
    B = 16
    jf = (fixed_length_features(tables, B, 4, gen, hot_rows=9) if fixed
          else random_features(tables, B, gen, max_len=6, hot_rows=9))
    grad_out = torch.randn(B, 8 * len(tables), generator=gen)
    # the PyTorch path (the C++ kernel, when built, sorts nothing)
    chunked = LocalEmbeddingBags(tables, optimizer=optimizer, lr=0.2, seed=2, cpu_kernel=False)
    single = LocalEmbeddingBags(tables, optimizer=optimizer, lr=0.2, seed=2, cpu_kernel=False)
    w0 = {t.name: chunked.table_weight(t.name).clone() for t in tables}
    calls = []
    real_sort = torch.sort

    def counting_sort(*a, **k):
        calls.append(a[0].numel())
        return real_sort(*a, **k)

    monkeypatch.setattr(optim_mod, "SORT_CHUNK", 8)
    monkeypatch.setattr(optim_mod.torch, "sort", counting_sort)
    (chunked(jf) * grad_out).sum().backward()
    assert len(calls) > 1 and sum(calls) == jf.values.numel()  # several chunks, every value sorted once
    monkeypatch.setattr(optim_mod, "SORT_CHUNK", 10**9)
    calls.clear()
    (single(jf) * grad_out).sum().backward()
    assert calls == [jf.values.numel()]
    assert torch.equal(chunked.weights, single.weights)
    if optimizer == "rowwise_adagrad":
        assert torch.equal(chunked.momentum, single.momentum)
    _, ref_after = float64_step(tables, w0, jf, grad_out, optimizer, lr=0.2)
    for t in tables:
        torch.testing.assert_close(chunked.table_weight(t.name).double(), ref_after[t.name], rtol=1e-5, atol=1e-6)


def test_sort_chunks_merge_whole_runs():
    sc = optim_mod.sort_chunks
    assert sc([3, 3, 3]) == [9]  # all under SORT_CHUNK: one chunk
    big = optim_mod.SORT_CHUNK
    assert sc([big, 1, big - 1, 5]) == [big, big + 5]  # a short tail joins the last chunk
    assert sc([2 * big, big // 2, big // 2]) == [2 * big, big]
    assert sum(sc([7, big, 3, big // 3])) == 7 + big + 3 + big // 3


def test_two_lookups_before_one_backward_keep_their_rows():
    """A training lookup's rows live in a buffer reused across steps; a second lookup taken before the
    first one's backward must not overwrite them (SGD is linear: the result is both steps' gradients)."""
    tables = ONE_TABLE_PER_FEATURE
    gen = torch.Generator().manual_seed(5)
    ours = LocalEmbeddingBags(tables, optimizer="sgd", lr=0.5, seed=4)
    w0 = {t.name: ours.table_weight(t.name).clone() for t in tables}
    B = 5
    jf1 = fixed_length_features(tables, B, 3, gen, hot_rows=5)
    jf2 = fixed_length_features(tables, B, 3, gen, hot_rows=5)
    g1, g2 = torch.randn(B, ours.output_dim, generator=gen), torch.randn(B, ours.output_dim, generator=gen)
    out1 = ours(jf1)
    out2 = ours(jf2)  # rows of lookup 1 are still held by its graph
    ((out1 * g1).sum() + (out2 * g2).sum()).backward()
    _, a1 = float64_step(tables, w0, jf1, g1, "sgd", lr=0.5)
    _, a2 = float64_step(tables, w0, jf2, g2, "sgd", lr=0.5)
    for t in tables:
        want = a1[t.name] + a2[t.name] - w0[t.name].double()
        torch.testing.assert_close(ours.table_weight(t.name).double(), want, rtol=1e-5, atol=1e-6)
    # steady state, as a training loop runs it (the previous step's output still bound while the next
    # lookup runs): the rows buffer is reused after each backward, and the steps stay correct
    out = None
    ptrs = set()
    for _ in range(3):
        w0 = {t.name: ours.table_weight(t.name).clone() for t in tables}
        jf = fixed_length_features(tables, B, 3, gen, hot_rows=5)
        out = ours(jf)
        ptrs.add(ours._scratch._bufs["rows0"].data_ptr())
        assert out.grad_fn.plans[0].rows.data_ptr() == ours._scratch._bufs["rows0"].data_ptr()  # reused
        (out * g1).sum().backward()
        _, a = float64_step(tables, w0, jf, g1, "sgd", lr=0.5)
        for t in tables:
            torch.testing.assert_close(ours.table_weight(t.name).double(), a[t.name], rtol=1e-5, atol=1e-6)
    assert len(ptrs) == 1 and ours.buffer_bytes > 0
    ours.release_buffers()
    assert ours.buffer_bytes == 0
