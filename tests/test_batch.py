import pytest
import torch

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.errors import InputError


def ref_lists(jf, field="values"):
    """Independent view: per key, the list of id lists (or, with ``field="weights"``, weight lists) per sample."""
    out, pos = {}, 0
    B = jf.batch_size
    flat = getattr(jf, field)
    for k_i, k in enumerate(jf.keys):
        out[k] = []
        for b in range(B):
            n = int(jf.lengths[k_i * B + b])
            out[k].append(flat[pos:pos + n].tolist())
            pos += n
    return out


def test_from_lists_and_slices_match_python_slicing():
    data = {"a": [[1, 2], [3], [], [4, 5, 6]], "b": [[7], [8, 9], [10], []]}
    jf = JaggedFeatures.from_lists(data)
    assert ref_lists(jf) == data
    for lo, hi in [(0, 4), (1, 3), (2, 4), (0, 1), (3, 4), (2, 2)]:
        s = jf.slice_batch(lo, hi)
        assert ref_lists(s) == {k: v[lo:hi] for k, v in data.items()}


def test_for_rank_partitions_the_batch():
    ids = torch.arange(30).view(10, 3)
    b = Batch(torch.randn(10, 2), JaggedFeatures.from_dense(["x", "y", "z"], ids), torch.zeros(10))
    parts = [b.for_rank(r, 3) for r in range(3)]
    assert [p.batch_size for p in parts] == [3, 3, 4]
    assert torch.equal(torch.cat([p.dense for p in parts]), b.dense)
    for k_i, k in enumerate("xyz"):
        got = torch.cat([p.sparse.to_dict()[k][0] for p in parts])
        assert torch.equal(got, ids[:, k_i])


def test_validation_errors():
    with pytest.raises(InputError, match="multiple"):
        JaggedFeatures(["a", "b"], torch.tensor([1]), torch.tensor([1]))
    jf = JaggedFeatures(["a"], torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(InputError, match="sum to 1"):
        jf.validate()
    with pytest.raises(InputError, match="weights"):
        JaggedFeatures(["a"], torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([1.0]))


def test_kjt_round_trip():
    pytest.importorskip("torchrec", reason="optional torchrec extra not installed (make torchrec)")
    data = {"a": [[1, 2], [3], []], "b": [[4], [5, 6], [7]]}
    jf = JaggedFeatures.from_lists(data)
    jf.weights = torch.arange(jf.values.numel(), dtype=torch.float32)
    kjt = jf.to_kjt()
    assert kjt.keys() == ["a", "b"]
    assert [t.tolist() for t in kjt.to_dict()["b"].to_dense()] == [[4], [5, 6], [7]]
    back = JaggedFeatures.from_kjt(kjt)
    assert back.keys == jf.keys
    assert torch.equal(back.values, jf.values) and torch.equal(back.lengths, jf.lengths)
    assert torch.equal(back.weights, jf.weights)


def _weighted(data):
    """The batch of ``data`` with weight ``100 * key index + position`` per value, and the same as lists."""
    jf = JaggedFeatures.from_lists(data)
    w = [float(100 * i + j) for i, k in enumerate(data) for j in range(sum(len(s) for s in data[k]))]
    wl, pos = {}, 0
    for k in data:
        wl[k] = []
        for s in data[k]:
            wl[k].append(w[pos:pos + len(s)])
            pos += len(s)
    return JaggedFeatures(jf.keys, jf.values, jf.lengths, torch.tensor(w)), wl


def _ref_weights(jf):
    return ref_lists(jf, "weights")


DATA = {"a": [[1, 2], [3], [], [4, 5, 6]], "b": [[7], [8, 9], [10], []], "c": [[], [], [11], [12]],
        "d": [[13, 14, 15], [16], [17], [18]]}


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2], [1, 3], [0, 0, 2], [3, 1, 0, 2, 3]])
def test_permute_matches_python_lists(order):
    jf, wl = _weighted(DATA)
    keys = list(DATA)
    p = jf.permute(order)
    assert p.keys == [keys[i] for i in order]
    assert ref_lists(p) == {keys[i]: DATA[keys[i]] for i in order}
    assert _ref_weights(p) == {keys[i]: wl[keys[i]] for i in order}
    assert p.lengths.numel() == len(order) * jf.batch_size
    p.validate()
    # the per-key counts it carries are the ones a fresh batch computes
    assert p.length_per_key_list() == [sum(len(s) for s in DATA[keys[i]]) for i in order]


def test_select_by_name_and_unknown_key():
    jf, wl = _weighted(DATA)
    s = jf.select(["d", "a"])
    assert s.keys == ["d", "a"]
    assert ref_lists(s) == {"d": DATA["d"], "a": DATA["a"]}
    assert _ref_weights(s) == {"d": wl["d"], "a": wl["a"]}
    assert jf.select(list(DATA)) is jf  # the identity costs nothing
    with pytest.raises(InputError, match="no feature 'zz'.*'a', 'b'"):
        jf.select(["a", "zz"])
    with pytest.raises(InputError, match="index 4 outside"):
        jf.permute([4])


@pytest.mark.parametrize("segments", [[4], [1, 3], [2, 2], [1, 1, 1, 1], [3, 1]])
def test_split_matches_python_lists(segments):
    jf, wl = _weighted(DATA)
    keys = list(DATA)
    parts = jf.split(segments)
    k = 0
    for s, part in zip(segments, parts):
        ks = keys[k:k + s]
        assert part.keys == ks
        assert ref_lists(part) == {x: DATA[x] for x in ks}
        assert _ref_weights(part) == {x: wl[x] for x in ks}
        k += s
    with pytest.raises(InputError, match="segments"):
        jf.split([1, 2])


def test_select_keeps_values_on_their_device_and_reads_counts_once(monkeypatch):
    jf = JaggedFeatures.from_lists(DATA)
    calls = []
    real = torch.Tensor.tolist

    def spy(t):
        calls.append(t.numel())
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    a = jf.select(["b", "c"])
    b = jf.select(["d"])
    jf.to_dict()
    a.select(["c"])
    assert calls == [4]  # the 4 per-key counts, once for the batch and everything selected from it
    assert a.values.device == jf.values.device and b.values.device == jf.values.device


@pytest.mark.parametrize("lo,hi", [(0, 4), (1, 3), (3, 4), (2, 2), (0, 1)])
def test_slice_batch_moves_weights_with_values(lo, hi):
    jf, wl = _weighted(DATA)
    s = jf.slice_batch(lo, hi)
    assert ref_lists(s) == {k: v[lo:hi] for k, v in DATA.items()}
    assert _ref_weights(s) == {k: v[lo:hi] for k, v in wl.items()}
