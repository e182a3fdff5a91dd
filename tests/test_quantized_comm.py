"""Quantized embedding communication of the flat baseline (models.flat.QuantizedComm; DMT section 5's Strong
Baseline), against independent references: a float64 round trip within each codec's rounding bound, and on
2 gloo ranks the unquantized flat lookup's output rounded to float16 (bit for bit), its row updates within
bfloat16's rounding of the gradients, and exactly half its pooled-vector bytes.
"""

from __future__ import annotations

import pytest
import torch

from embedscale.comm.transport import Transport
from embedscale.errors import ConfigError, InputError
from embedscale.models.flat import QuantizedTransport, dequantize_rows_int8, quantize_rows_int8


class _Echo(Transport):
    """Rank 0 of 2 whose peer sends back exactly what it received: ``recv[p] = send[p]`` (counted)."""

    def __init__(self):
        super().__init__(0, 2)
        self.seen: list[torch.Tensor] = []

    def exchange(self, send, recv_counts=None, kind="data"):
        self.seen = [t.clone() for t in send]
        if recv_counts is not None:
            assert recv_counts == [int(t.shape[0]) for t in send]
        recv = [t.clone() for t in send]
        self._count(send, recv, kind)
        return recv


def _values(n: int, seed: int) -> torch.Tensor:
    """Magnitudes over 6 decades (1e-3 .. 1e3, inside float16's normal range), random signs."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 6 - 3)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (mag * sign).float()


@pytest.mark.parametrize("prec,unit", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_float_codecs_round_trip_within_half_an_ulp(prec, unit):
    inner = _Echo()
    q = QuantizedTransport(inner, forward=prec, backward=prec)
    send = [_values(96, 1), _values(160, 2)]
    for kind in ("flat_a2a", "flat_a2a_grad"):
        got = q.exchange(send, [96, 160], kind=kind)
        for x, y in zip(send, got):
            assert y.dtype == torch.float32 and y.shape == x.shape
            ref = x.double()  # the float64 value sent
            err = (y.double() - ref).abs()
            assert bool((err <= unit * ref.abs()).all()), float((err / ref.abs()).max())  # round to nearest
            assert float(err.max()) > 0  # the codec really ran
        # 2 bytes a value on the wire
        assert all(t.dtype == torch.uint8 and t.numel() == 2 * x.numel() for t, x in zip(inner.seen, send))
    assert inner.counter.by_kind["flat_a2a"] == 160 * 2 and inner.counter.by_kind["flat_a2a_grad"] == 160 * 2


def test_int8_rows_within_half_a_step_of_each_row():
    dim = 16
    x = _values(40 * dim, 3).view(40, dim)
    x[5] = 0.25  # a constant row is exact
    packed = quantize_rows_int8(x, dim)
    assert packed.dtype == torch.uint8 and packed.shape == (40, dim + 8)
    y = dequantize_rows_int8(packed, dim).view(40, dim).double()
    ref = x.double()
    step = (ref.amax(1, keepdim=True) - ref.amin(1, keepdim=True)) / 255
    assert bool(((y - ref).abs() <= step / 2 + 1e-6 * ref.abs().amax(1, keepdim=True)).all())
    assert torch.equal(y[5], ref[5])
    inner = _Echo()
    q = QuantizedTransport(inner, forward="int8", backward="fp32", row_width=dim)
    send = [x[:10].reshape(-1), x[10:].reshape(-1)]
    got = q.exchange(send, [10 * dim, 30 * dim], kind="flat_a2a")
    assert torch.allclose(got[1].double(), ref[10:].reshape(-1), atol=float(step.max()) / 2 + 1e-6)
    assert inner.counter.by_kind["flat_a2a"] == 30 * (dim + 8)  # 1 byte a value + 8 per row


def test_ids_counts_and_other_kinds_travel_unchanged():
    inner = _Echo()
    q = QuantizedTransport(inner)
    ids = [torch.arange(5), torch.arange(7) * 10**12]
    assert all(torch.equal(a, b) for a, b in zip(q.exchange(ids, kind="ids"), ids))
    f = [_values(8, 4), _values(8, 5)]
    assert all(torch.equal(a, b) for a, b in zip(q.exchange(f, kind="meta"), f))  # not a pooled kind
    assert not torch.equal(q.exchange(f, kind="flat_a2a_grad")[1], f[1])  # a pooled kind: quantized
    empty = q.exchange([torch.zeros(0, 3), torch.ones(2, 3)], kind="flat_a2a")  # a rank may send nothing
    assert empty[0].shape == (0, 3) and torch.equal(empty[1], torch.ones(2, 3))
    assert q.precision("flat_a2a") == "fp16" and q.precision("peer_a2a_grad") == "bf16"
    assert q.precision("dense_grads") == "fp32"


def test_bad_settings_and_values_are_errors():
    with pytest.raises(ConfigError, match="precision 'fp8'"):
        QuantizedTransport(_Echo(), forward="fp8")
    with pytest.raises(ConfigError, match="int8 needs row_width"):
        QuantizedTransport(_Echo(), backward="int8")
    q = QuantizedTransport(_Echo())
    with pytest.raises(InputError, match=r"flat_a2a.*70000.*float16"):
        q.exchange([torch.tensor([1.0, 70000.0]), torch.tensor([2.0])], kind="flat_a2a")
    assert float(q.exchange([torch.tensor([70000.0]), torch.tensor([2.0])], kind="flat_a2a_grad")[0][0]) == 70144.0
    q8 = QuantizedTransport(_Echo(), forward="int8", row_width=4)
    with pytest.raises(ConfigError, match="not whole rows of 4"):
        q8.exchange([torch.ones(6), torch.ones(4)], kind="flat_a2a")
    with pytest.raises(InputError, match="non-finite"):
        q8.exchange([torch.tensor([1.0, float("nan"), 0.0, 1.0]), torch.ones(4)], kind="flat_a2a")


# -- two ranks: the flat model-parallel lookup with and without quantized communication ---------------

DIM = 8
LR = 0.5


def _tables():
    from embedscale.specs import TableSpec

    return [TableSpec(f"t{i}", n, DIM) for i, n in enumerate((30, 11, 50, 23, 17))]


def _features(global_b: int):
    from embedscale.data.batch import JaggedFeatures

    g = torch.Generator().manual_seed(7)
    per = {}
    for t in _tables():
        lens = torch.randint(0, 4, (global_b,), generator=g)
        per[t.name] = [torch.randint(0, t.num_rows, (int(n),), generator=g).tolist() for n in lens]
    return JaggedFeatures.from_lists(per)


def _flat_worker(rank, world, global_b):
    from embedscale.comm.hierarchical import TowerComm
    from embedscale.plan.tower_placement import TowerLayout
    from embedscale.embedding.towers import FlatTableWiseEmbedding
    from embedscale.models.flat import QuantizedComm

    torch.set_num_threads(1)
    comm = TowerComm(TowerLayout(world, 1))  # one rank per host: every byte crosses hosts
    lo, hi = global_b * rank // world, global_b * (rank + 1) // world
    jf = _features(global_b).slice_batch(lo, hi)
    out = {}
    for name, c in (("plain", comm), ("quantized", QuantizedComm(comm))):
        emb = FlatTableWiseEmbedding(_tables(), c, optimizer="sgd", lr=LR, seed=0)
        before = {s.name: emb.embedding.table_weight(s.name).clone() for s in emb.embedding.tables}
        comm.reset_bytes()
        y = emb(jf)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank)) * 3
        y.backward(g)
        after = {s.name: emb.embedding.table_weight(s.name).clone() for s in emb.embedding.tables}
        out[name] = {"y": y.detach(), "g": g, "before": before, "after": after,
                     "bytes": dict(comm.world.cross_bytes)}
    return out


def test_flat_lookup_two_ranks_against_the_unquantized_one():
    from embedscale.train.launch import spawn_local

    res = spawn_local(_flat_worker, 2, 12, timeout_s=240)
    for r in res:
        p, q = r["plain"], r["quantized"]
        assert torch.equal(q["y"], p["y"].half().float())  # forward: each pooled vector rounded to fp16
        assert not torch.equal(q["y"], p["y"])
        for k in ("flat_a2a", "flat_a2a_grad"):  # 2 bytes a value instead of 4
            assert p["bytes"][k] > 0 and q["bytes"][k] * 2 == p["bytes"][k]
        assert q["bytes"]["ids"] == p["bytes"]["ids"]
        assert sorted(q["after"]) == sorted(p["after"]) and p["before"].keys() == q["before"].keys()
    # backward: every pooled gradient is rounded to bf16 (at most 2^-8 relative) before it reaches the owner,
    # so each row value moves by LR x (its gradients' sum) within LR x 2^-8 x (the sum of their magnitudes):
    # that bound, per row and column, from the global batch and both ranks' output gradients
    global_b = 12
    jf = _features(global_b)
    g = torch.cat([r["plain"]["g"] for r in res]).double()  # [global_b, F * DIM], model order = table order
    names = [t.name for t in _tables()]
    bound = {t.name: torch.zeros(t.num_rows, DIM, dtype=torch.float64) for t in _tables()}
    off = 0
    for f, key in enumerate(jf.keys):
        for b in range(global_b):
            n = int(jf.lengths[f * global_b + b])
            for v in jf.values[off:off + n].tolist():
                bound[key][v] += g[b, names.index(key) * DIM:(names.index(key) + 1) * DIM].abs()
            off += n
    differs = False
    for r in res:
        p, q = r["plain"], r["quantized"]
        for t in p["after"]:
            assert torch.equal(p["before"][t], q["before"][t])
            d = (q["after"][t].double() - p["after"][t].double()).abs()
            assert bool((d <= LR * 2.0 ** -8 * bound[t] + 1e-6).all()), t
            assert bool((d[bound[t].sum(1) == 0] == 0).all())  # untouched rows stay equal
            differs |= float(d.max()) > 0
    assert differs  # the backward codec really ran
