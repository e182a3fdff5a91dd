"""The fused C++ CPU kernel of the embedding step (embedding/kernels.cpp) against a float64 reference and
against the pure PyTorch path (same bits), and the rule that falls back to PyTorch.

The kernel is built once by the install step (``python -m embedscale.embedding.kernels --build``, run by
``make``); without a build these tests skip (and the module uses the PyTorch path).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.embedding import kernels
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.optim import row_mean_squares
from embedscale.specs import TableSpec

LR, EPS = 0.1, 1e-8

built = pytest.mark.skipif(kernels.fused_ops() is None,
                           reason="fused C++ kernel not built: run `python -m embedscale.embedding.kernels --build`")


def batch(specs: list[TableSpec], B: int, kind: str, weighted: bool, gen: torch.Generator) -> JaggedFeatures:
    """Ids of every table's feature, key-major; duplicates within and across bags are frequent (few rows)."""
    k = len(specs)
    if kind == "onehot":
        lengths = torch.ones(k * B, dtype=torch.int64)
    elif kind == "fixed":
        lengths = torch.full((k * B,), 3, dtype=torch.int64)
    else:  # jagged, with empty bags
        lengths = torch.randint(0, 5, (k * B,), generator=gen)
        lengths[::7] = 0
    per = lengths.view(k, B).sum(1)
    values = torch.cat([torch.randint(0, s.num_rows, (int(c),), generator=gen) for s, c in zip(specs, per)])
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return JaggedFeatures([s.name for s in specs], values, lengths, weights)


def reference(specs, w0, m0, jf: JaggedFeatures, grad_out: torch.Tensor, optimizer: str):
    """Float64 output, and weights / momentum after one step, table by table, value by value."""
    B = grad_out.shape[0]
    lengths = jf.lengths.view(len(specs), B)
    values = jf.values.tolist()
    weights = jf.weights.double().tolist() if jf.weights is not None else None
    outs, new_w, new_m = [], [], []
    col, i = 0, 0
    for t, spec in enumerate(specs):
        D = spec.dim
        w = w0[t].double()
        G = torch.zeros_like(w)
        out = torch.zeros(B, D, dtype=torch.float64)
        for b in range(B):
            L = int(lengths[t, b])
            s = 1.0 / L if spec.pooling == "mean" and L else 1.0
            for _ in range(L):
                r, c = values[i], (weights[i] if weights is not None else 1.0) * s
                out[b] += c * w[r]
                G[r] += c * grad_out[b, col:col + D].double()
                i += 1
        outs.append(out)
        if optimizer == "sgd":
            new_w.append(w - LR * G)
        else:
            m = m0[t].double() + G.pow(2).mean(1)
            touched = G.abs().sum(1) > 0
            step = LR * G / (m.sqrt() + EPS).unsqueeze(1)
            new_w.append(torch.where(touched.unsqueeze(1), w - step, w))
            new_m.append(torch.where(touched, m, m0[t].double()))
        col += D
    return torch.cat(outs, 1), new_w, new_m


def make(specs, optimizer: str, cpu_kernel: bool) -> LocalEmbeddingBags:
    return LocalEmbeddingBags(specs, optimizer=optimizer, lr=LR, eps=EPS, seed=3, cpu_kernel=cpu_kernel)


CASES = [(opt, pooling, kind, weighted, dims)
         for opt in ("sgd", "rowwise_adagrad")
         for pooling in ("sum", "mean")
         for kind in ("onehot", "fixed", "jagged")
         for weighted in (False, True)
         for dims in ((16, 16, 16), (5, 12))]


@built
@pytest.mark.parametrize("optimizer,pooling,kind,weighted,dims", CASES)
def test_kernel_matches_float64_reference_and_pytorch_path(optimizer, pooling, kind, weighted, dims):
    sizes = [9, 40, 3]
    specs = [TableSpec(f"t{i}", sizes[i], d, pooling=pooling) for i, d in enumerate(dims)]
    gen = torch.Generator().manual_seed(len(dims) * 100 + (kind == "jagged"))
    B = 24
    jf = batch(specs, B, kind, weighted, gen)
    grad_out = torch.randn(B, sum(dims), generator=gen)
    fast, slow = make(specs, optimizer, True), make(specs, optimizer, False)
    assert fast.uses_cpu_kernel and not slow.uses_cpu_kernel
    w0 = [fast.table_weight(s.name).clone() for s in specs]
    m0 = [fast.table_momentum(s.name).clone() + 0.5 for s in specs] if optimizer == "rowwise_adagrad" else None
    for mod in (fast, slow):
        mod.track_touched()
        if m0 is not None:
            for s, m in zip(specs, m0):
                mod.table_momentum(s.name).copy_(m)
    ref_out, ref_w, ref_m = reference(specs, w0, m0, jf, grad_out, optimizer)
    for mod in (fast, slow):
        out = mod(jf)
        (out * grad_out).sum().backward()
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    for t, s in enumerate(specs):
        torch.testing.assert_close(fast.table_weight(s.name).double(), ref_w[t], rtol=1e-5, atol=1e-6)
        if optimizer == "rowwise_adagrad":
            torch.testing.assert_close(fast.table_momentum(s.name).double(), ref_m[t], rtol=1e-5, atol=1e-7)
        # the update moved the rows the batch looked up (the comparison above is not vacuous)
        assert not torch.equal(fast.table_weight(s.name), w0[t])
    # both paths give the same bits: same per-row summation order and rounding
    assert torch.equal(fast.weights, slow.weights)
    if optimizer == "rowwise_adagrad":
        assert torch.equal(fast.momentum, slow.momentum)
    assert torch.equal(fast.touched, slow.touched)


@built
def test_kernel_over_several_steps_equals_pytorch_path_bit_for_bit():
    specs = [TableSpec("a", 1000, 16), TableSpec("b", 50, 16, pooling="mean"), TableSpec("c", 7, 16)]
    gen = torch.Generator().manual_seed(0)
    fast, slow = make(specs, "rowwise_adagrad", True), make(specs, "rowwise_adagrad", False)
    for step in range(4):
        jf = batch(specs, 64, ("fixed", "jagged", "onehot", "jagged")[step], step % 2 == 1, gen)
        g = torch.randn(64, 48, generator=gen)
        outs = []
        for mod in (fast, slow):
            out = mod(jf)
            (out * g).sum().backward()
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
    assert torch.equal(fast.weights, slow.weights) and torch.equal(fast.momentum, slow.momentum)
    assert fast.buffer_bytes >= 4 * 1057  # the kernel's row -> slot map of the group
    fast.release_buffers()
    assert fast.buffer_bytes == 0


@built
def test_shared_table_falls_back_to_pytorch(monkeypatch):
    """Two features reading one table could update the same row from two threads: the rule of
    ``_kernel_applies`` keeps such a group on the PyTorch path."""
    specs = [TableSpec("item", 30, 8, features=["a", "b"]), TableSpec("u", 10, 8)]
    mod = make(specs, "sgd", True)
    calls = []
    monkeypatch.setattr(mod, "_kernel_update", lambda *a: calls.append(a))
    jf = JaggedFeatures.from_dense(["a", "b", "u"], torch.tensor([[1, 2, 3], [2, 2, 9]]))
    mod(jf).sum().backward()
    assert calls == []
    solo = make([TableSpec("item", 30, 8), TableSpec("u", 10, 8)], "sgd", True)
    monkeypatch.setattr(solo, "_kernel_update", lambda *a: calls.append(a))
    solo(JaggedFeatures.from_dense(["item", "u"], torch.tensor([[1, 3], [2, 9]]))).sum().backward()
    assert len(calls) == 1


@built
def test_unvalidated_id_of_a_neighbouring_table_is_refused_not_raced():
    """With validation off, an id past its table reads the next table's row (the PyTorch path's documented
    behaviour); the kernel, whose threads own one table each, refuses to update it (a clear error)."""
    mod = LocalEmbeddingBags([TableSpec("a", 5, 4), TableSpec("b", 5, 4)], optimizer="sgd", seed=0, validate=False)
    jf = JaggedFeatures.from_dense(["a", "b"], torch.tensor([[1, 2], [7, 3]]))  # a's id 7 is b's row 2
    with pytest.raises(RuntimeError, match="outside their feature's table"):
        mod(jf).sum().backward()


def test_missing_build_falls_back_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("EMBEDSCALE_KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger="embedscale.embedding.kernels"):
        assert kernels.fused_ops() is None
        mods = [make([TableSpec("t", 10, 4)], "sgd", True) for _ in range(2)]
    lines = [r for r in caplog.records if "not built" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path) in lines[0].getMessage()
    assert not mods[0].uses_cpu_kernel
    jf = JaggedFeatures.from_dense(["t"], torch.tensor([[1], [1]]))
    w = mods[0].table_weight("t")[1].clone()
    mods[0](jf).sum().backward()  # the PyTorch path trains
    torch.testing.assert_close(mods[0].table_weight("t")[1], w - 2 * LR)


def test_row_mean_squares_is_the_mean_of_squares():
    g = torch.randn(50, 13, dtype=torch.float32)
    for D in (1, 2, 5, 13):
        torch.testing.assert_close(row_mean_squares(g[:, :D].contiguous()).double(),
                                   g[:, :D].double().pow(2).mean(1), rtol=1e-6, atol=0)


@built
@pytest.mark.parametrize("one_hot,weighted", [(True, False), (False, True)])
def test_sharded_row_sums_and_update_match_float64_brute_force(one_hot, weighted):
    """The sharded step's kernels (``sharded_row_grad_sums``, ``sharded_apply_row_grads``) against a float64
    sum value by value: every storage row read gets its sum (first-seen order), every fetch-area row its own;
    the update applies row-wise Adagrad to each distinct row of the lists, skipping rows past a list's limit
    and map entries < 0; the slot map is all -1 afterwards."""
    ops = kernels.fused_ops()
    gen = torch.Generator().manual_seed(1)
    F_, B, D, n, R = 3, 40, 16, 30, 12
    lengths = torch.ones(F_ * B, dtype=torch.int64) if one_hot else torch.randint(0, 4, (F_ * B,), generator=gen)
    offsets = torch.zeros(F_ * B + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    nv = int(offsets[-1])
    pos = torch.randint(0, n + R, (nv,), generator=gen)
    pos[:R] = n + torch.arange(R)  # every fetch-area row is read
    scale = torch.rand(nv, generator=gen) + 0.5 if weighted else None
    grad = torch.randn(B, F_ * D, generator=gen)
    slot = torch.full((n,), -1, dtype=torch.int32)
    urows, ugrads, fetched = torch.empty(nv, dtype=torch.int64), torch.empty(nv, D), torch.empty(R, D)
    u = ops.sharded_row_grad_sums(pos, None if one_hot else offsets, scale, grad, B, F_, n, slot, urows, ugrads,
                                  fetched)
    ref = torch.zeros(n + R, D, dtype=torch.float64)
    bag = torch.repeat_interleave(torch.arange(F_ * B), lengths)
    for i in range(nv):
        f, b = int(bag[i]) // B, int(bag[i]) % B
        ref[pos[i]] += (1.0 if scale is None else float(scale[i])) * grad[b, f * D:(f + 1) * D].double()
    seen = list(dict.fromkeys(int(p) for p in pos if p < n))
    assert urows[:u].tolist() == seen and bool((slot == -1).all())
    torch.testing.assert_close(ugrads[:u].double(), ref[seen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fetched.double(), ref[n:], rtol=1e-5, atol=1e-5)

    w0, m0 = torch.randn(n, D, generator=gen), torch.rand(n, generator=gen)
    w, m, touched = w0.clone(), m0.clone(), torch.zeros(n, dtype=torch.bool)
    r1, g1 = torch.tensor([3, 7, 25, 3]), torch.randn(4, D, generator=gen)  # 25 >= limit 20: skipped
    s2, g2 = torch.tensor([0, 1, 2]), torch.randn(3, D, generator=gen)  # through a map: slot 1 has no row
    rmap = torch.tensor([7, -1, 28])
    ops.sharded_apply_row_grads(w, m, touched, slot, [r1, s2], [g1, g2], [torch.empty(0, dtype=torch.int64), rmap],
                                [20, n], LR, EPS)
    G = torch.zeros(n, D, dtype=torch.float64)
    for r, g in [(3, g1[0]), (7, g1[1]), (3, g1[3]), (7, g2[0]), (28, g2[2])]:
        G[r] += g.double()
    hit = G.abs().sum(1) > 0
    m_ref = torch.where(hit, m0.double() + G.pow(2).mean(1), m0.double())
    w_ref = torch.where(hit.unsqueeze(1), w0.double() - LR * G / (m_ref.sqrt() + EPS).unsqueeze(1), w0.double())
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.double(), m_ref, rtol=1e-5, atol=1e-7)
    assert touched.nonzero().squeeze(1).tolist() == [3, 7, 28] and bool((slot == -1).all())
    with pytest.raises(RuntimeError, match="outside the storage"):  # checked before any row is touched
        ops.sharded_apply_row_grads(w, m, touched, slot, [torch.tensor([1, n])], [torch.zeros(2, D)],
                                    [torch.empty(0, dtype=torch.int64)], [n], LR, EPS)
    assert bool((slot == -1).all()) and torch.equal(w[1], w_ref[1].float())


@built
def test_sharded_conversion_kernels_match_torch():
    """The index conversion's kernels against torch's ops: the sorted unique remote keys and their inverse
    (``torch.unique``), the remote split of packed codes, the replica slots read locally (ascending), and the
    id check naming the first bad value."""
    ops = kernels.fused_ops()
    gen = torch.Generator().manual_seed(2)
    shift, me = 20, 1
    code_tab = (torch.randint(0, 3, (500,), generator=gen) << shift) | torch.randint(0, 300, (500,), generator=gen)
    gids = torch.randint(0, 500, (4000,), generator=gen) ** 2 // 500  # skewed: many repeats
    n = gids.numel()
    code, key = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    remote, ridx = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.int64)
    nr = ops.sharded_remote_split(gids, code_tab.to(torch.int32), shift, (1 << 30) - 1, me, code, key, remote, ridx)
    want_key = code_tab[gids]
    assert torch.equal(key, want_key) and torch.equal(remote, (want_key >> shift) != me)
    assert torch.equal(ridx[:nr], ((want_key >> shift) != me).nonzero().squeeze(1))
    for sel in (ridx[:nr], ridx[:0], ridx[:1]):
        runiq, rinv = ops.sharded_remote_unique(key, sel)
        u, inv = torch.unique(key[sel], sorted=True, return_inverse=True)
        assert torch.equal(runiq, u) and torch.equal(rinv, inv)
    num_owned, region_slot = 250, torch.arange(50) * 3 + 7  # storage rows 250.. hold replica slots
    slots = ops.sharded_local_replicas(key, remote, num_owned, (1 << shift) - 1, region_slot)
    off = key & ((1 << shift) - 1)
    held = torch.unique(off[(~remote) & (off >= num_owned)]) - num_owned
    assert torch.equal(slots, region_slot[held])
    values = torch.tensor([0, 4, 2, 9, 1])
    gids_out = torch.empty(5, dtype=torch.int64)
    per, base, rows = torch.tensor([2, 3]), torch.tensor([0, 5]), torch.tensor([5, 9])
    assert ops.sharded_feature_gids(values, per, base, rows, True, gids_out) == 3  # 9 is past the second table
    assert ops.sharded_feature_gids(values, per, base, rows, False, gids_out) == -1
    assert gids_out.tolist() == [0, 4, 7, 14, 6]


def test_building_one_kernel_leaves_the_names_of_the_others(monkeypatch, tmp_path):
    """`--build` compiles both sources in one process: the first build must not change the name (a hash of source,
    flags and torch version) under which the second is built and later looked up by a fresh process. torch's load()
    appends its libraries to the flag lists it is given; the stand-in does the same."""
    import torch.utils.cpp_extension as ext

    def load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        extra_cflags.append("-DADDED_BY_LOAD")
        extra_ldflags.append("-ltorch")
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setenv("EMBEDSCALE_KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(ext, "load", load)
    names = [kernels.build_name(s) for s in kernels.SOURCES]
    built = [kernels.build(source=s) for s in kernels.SOURCES]
    assert [p.stem for p in built] == names
    assert [kernels.build_name(s) for s in kernels.SOURCES] == names
