"""Row-wise quantized tables: bytes per row, the error bound, FBGEMM's fused layout, and the pooled lookup
against a float64 dequantise-then-pool reference written here in numpy (every pooling mode, empty bags,
per-sample weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedscale.embedding.kernels import quant_ops
from embedscale.serve.quantize import dequantize_rows, pooled_lookup, pooled_lookup_many, quantize_rows, row_bytes

BITS = {"int8": 8, "int4": 4}


def table(rows=200, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * 0.05
    w[3] = 0.25  # a constant row
    w[5] = 0.0
    w[7, 0] = 3.0  # a wide row
    return w


def numpy_dequantize(stored: np.ndarray, form: str, dim: int) -> np.ndarray:
    """float64 values of fused rows, by the layout's definition: ``dim * bits / 8`` bytes of values (INT4: low
    nibble first), then fp16 scale, fp16 bias; fp16 / fp32 rows as they are."""
    if form in ("fp32", "fp16"):
        return stored.astype(np.float64)
    bits = BITS[form]
    nbytes = dim * bits // 8
    data = stored[:, :nbytes]
    scale = stored[:, nbytes:nbytes + 2].copy().view(np.float16).astype(np.float64)[:, 0]
    bias = stored[:, nbytes + 2:nbytes + 4].copy().view(np.float16).astype(np.float64)[:, 0]
    if bits == 8:
        q = data.astype(np.float64)
    else:
        q = np.empty((len(stored), dim))
        q[:, 0::2] = data & 0xF
        q[:, 1::2] = data >> 4
    return q * scale[:, None] + bias[:, None]


def numpy_pool(values: np.ndarray, bags: list[list[int]], mode: str, weights: list[list[float]] | None) -> np.ndarray:
    out = np.zeros((len(bags), values.shape[1]))
    for b, ids in enumerate(bags):
        for j, r in enumerate(ids):
            out[b] += values[r] * (weights[b][j] if weights is not None else 1.0)
        if mode == "mean" and ids:
            out[b] /= len(ids)
    return out


@pytest.mark.parametrize("form,dim", [("int8", 16), ("int8", 6), ("int4", 16), ("int4", 8), ("fp16", 16),
                                      ("fp32", 16)])
def test_bytes_per_row(form, dim):
    stored = quantize_rows(table(dim=dim), form)
    per_row = stored.shape[1] * stored.element_size()
    want = {"int8": dim + 4, "int4": dim // 2 + 4, "fp16": 2 * dim, "fp32": 4 * dim}[form]
    assert per_row == want == row_bytes(form, dim)
    assert stored.shape[0] == 200


def test_int4_needs_whole_bytes():
    with pytest.raises(ValueError, match="whole bytes"):
        quantize_rows(torch.zeros(3, 5), "int4")


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_error_within_half_a_step(form):
    w = table()
    stored = quantize_rows(w, form)
    back = numpy_dequantize(stored.numpy(), form, 16)
    levels = 2 ** BITS[form] - 1
    lo, hi = w.double().min(1).values.numpy(), w.double().max(1).values.numpy()
    # the step (max - min) / levels and the bias are rounded to fp16: half a step plus their rounding
    step = (hi - lo) / levels
    bound = step / 2 * 1.002 + np.abs(lo) * 2 ** -10 + 1e-7
    err = np.abs(back - w.double().numpy()).max(1)
    assert (err <= bound).all(), (err / bound).max()
    assert np.allclose(back[3], 0.25) and np.allclose(back[5], 0.0)  # constant rows come back exactly


@pytest.mark.parametrize("form", ["int8", "int4", "fp16", "fp32"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_float64_reference(form, mode, weighted):
    dim = 16
    stored = quantize_rows(table(dim=dim), form)
    rng = np.random.default_rng(1)
    bags = [list(rng.integers(0, 200, rng.integers(0, 6))) for _ in range(40)] + [[], [7, 7, 7], [3]]
    weights = [list(rng.random(len(b)) * 2) for b in bags] if weighted else None
    ids = torch.tensor([r for b in bags for r in b], dtype=torch.int64)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(b) for b in bags])]), dtype=torch.int64)
    w = torch.tensor([x for b in weights for x in b], dtype=torch.float32) if weighted else None
    got = pooled_lookup(stored, form, dim, ids, offsets, mode, w).double().numpy()
    wref = [[float(np.float32(x)) for x in b] for b in weights] if weighted else None
    ref = numpy_pool(numpy_dequantize(stored.numpy(), form, dim), bags, mode, wref)
    assert got.shape == (len(bags), dim)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    empty = [i for i, b in enumerate(bags) if not b]
    assert empty and (got[empty] == 0).all()


def _bags(rng, rows, n=40):
    bags = [list(rng.integers(0, rows, rng.integers(0, 6))) for _ in range(n)] + [[], [7, 7, 7], [3]]
    ids = torch.tensor([r for b in bags for r in b], dtype=torch.int64)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(b) for b in bags])]), dtype=torch.int64)
    return bags, ids, offsets


@pytest.mark.parametrize("use_kernel", [True, False])
def test_one_fused_lookup_of_many_tables_matches_float64_reference(use_kernel):
    """Tables of every form and several widths (16, 24: the kernel's specialised and generic widths, 8) pooled
    in one call, two features on one table, sum and mean, weighted and not: each feature's columns equal the
    float64 dequantise-then-pool of its bags."""
    if use_kernel and quant_ops() is None:
        pytest.skip("the fused quantized kernel is not built (python -m embedscale.embedding.kernels --build)")
    rng = np.random.default_rng(3)
    specs = [("int8", 16), ("int4", 24), ("fp16", 8), ("fp32", 16), ("int4", 16)]
    tables = [(quantize_rows(table(rows=150, dim=d, seed=i), f), f, d) for i, (f, d) in enumerate(specs)]
    features, refs = [], []
    for j, (t, mode, weighted) in enumerate([(0, "sum", False), (1, "mean", True), (2, "sum", True), (3, "mean", False),
                                            (4, "sum", False), (0, "mean", True)]):
        bags, ids, offsets = _bags(rng, 150)
        weights = [list(rng.random(len(b)) * 2) for b in bags] if weighted else None
        w = torch.tensor([x for b in weights for x in b], dtype=torch.float32) if weighted else None
        features.append((t, ids, offsets, mode, w))
        stored, form, dim = tables[t]
        wref = [[float(np.float32(x)) for x in b] for b in weights] if weighted else None
        refs.append(numpy_pool(numpy_dequantize(stored.numpy(), form, dim), bags, mode, wref))
    got = pooled_lookup_many(tables, features, len(refs[0]), use_kernel=use_kernel).double().numpy()
    ref = np.concatenate(refs, axis=1)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_fused_lookup_rejects_a_row_outside_its_table():
    if quant_ops() is None:
        pytest.skip("the fused quantized kernel is not built (python -m embedscale.embedding.kernels --build)")
    stored = quantize_rows(table(rows=10, dim=16), "int8")
    ids, offsets = torch.tensor([1, 10]), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="outside its table"):
        pooled_lookup_many([(stored, "int8", 16)], [(0, ids, offsets, "sum", None)], 2)


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_fbgemm_fused_layout(form):
    try:
        import fbgemm_gpu  # noqa: F401

        op = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf
    except (ImportError, AttributeError, RuntimeError) as e:
        pytest.skip(f"fbgemm_gpu's CPU ops are not importable ({e}); install the torchrec extra")
    w = table(rows=300, dim=16)
    ours = quantize_rows(w, form)
    theirs = op(w, BITS[form])
    assert ours.dtype == theirs.dtype == torch.uint8
    assert torch.equal(ours, theirs)  # the same bytes: tables move between the two unchanged
    back = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(ours, BITS[form])
    assert torch.equal(dequantize_rows(ours, form, 16), back)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_served_lookup_names_the_feature_of_a_row_outside_its_table(use_kernel):
    """The served tables' lookup pools as a per-feature dequantise-then-pool in float64, and a row id outside a
    table is an error naming the feature and the table (the fused kernel's check, or the one before the other
    path)."""
    from embedscale.data.batch import JaggedFeatures
    from embedscale.errors import InputError
    from embedscale.serve.predict import ServedEmbedding

    g = torch.Generator().manual_seed(5)
    w = {"ta": torch.randn(9, 8, generator=g), "tb": torch.randn(4, 8, generator=g)}
    tables = [{"name": n, "features": [f], "num_rows": w[n].shape[0], "dim": 8, "pooling": "sum", "form": "int8"}
              for n, f in (("ta", "fa"), ("tb", "fb"))]
    emb = ServedEmbedding(tables, {n: quantize_rows(v, "int8") for n, v in w.items()})
    emb.use_kernel = use_kernel
    jf = JaggedFeatures.from_lists({"fa": [[1, 8], [], [0]], "fb": [[3], [2, 2], []]})
    want = []
    for f, n in (("fa", "ta"), ("fb", "tb")):
        rows = dequantize_rows(quantize_rows(w[n], "int8"), "int8", 8).double()
        bags = {"fa": [[1, 8], [], [0]], "fb": [[3], [2, 2], []]}[f]
        want.append(torch.stack([rows[b].sum(0) if b else torch.zeros(8, dtype=torch.float64) for b in bags]))
    torch.testing.assert_close(emb(jf).double(), torch.cat(want, 1), rtol=1e-5, atol=1e-5)
    bad = JaggedFeatures.from_lists({"fa": [[1], [], [0]], "fb": [[3], [4], []]})
    with pytest.raises(InputError, match=r"feature 'fb': row id outside table 'tb' \[0, 4\)"):
        emb(bad)
