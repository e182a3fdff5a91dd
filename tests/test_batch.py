import pytest
import torch

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.errors import InputError


def ref_lists(jf):
    """Independent view: per key, the list of id lists per sample."""
    out, pos = {}, 0
    B = jf.batch_size
    for k_i, k in enumerate(jf.keys):
        out[k] = []
        for b in range(B):
            n = int(jf.lengths[k_i * B + b])
            out[k].append(jf.values[pos:pos + n].tolist())
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
