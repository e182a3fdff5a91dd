"""TorchRec code and trained tables in and out (embedding/interop.py).

The reference is TorchRec itself: an ``EmbeddingBagCollection`` (EBC) trained a few steps with a torch
optimizer (so its rows are not the initial ones), with mean pooling, two features sharing one table and two
dims. Its state dict loaded into ``LocalEmbeddingBags`` / ``ShardedEmbedding`` (2 gloo ranks, row-level
placement with replicas) must give the EBC's ``KeyedTensor`` for the same ``KeyedJaggedTensor`` (within
1e-6), and the other way: our module trained further, its tables saved under the EBC's names and loaded into
a fresh EBC, gives our outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

torchrec = pytest.importorskip("torchrec", reason="needs the optional torchrec extra (`make torchrec`)")

from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402

from embedscale.comm.collective import CollectiveTransport  # noqa: E402
from embedscale.comm.pgas import PgasTransport  # noqa: E402
from embedscale.data.batch import JaggedFeatures  # noqa: E402
from embedscale.embedding.address_map import AddressMap  # noqa: E402
from embedscale.models.builder import EmbeddingEnv, build_embedding  # noqa: E402
from embedscale.embedding.interop import table_specs_from_ebc  # noqa: E402
from embedscale.embedding.local import LocalEmbeddingBags  # noqa: E402
from embedscale.embedding.pgas_lookup import PgasShardedEmbedding  # noqa: E402
from embedscale.embedding.sharded import ShardedEmbedding  # noqa: E402
from embedscale.errors import ConfigError, InputError  # noqa: E402
from embedscale.plan.forms import TableForm  # noqa: E402
from embedscale.train.launch import spawn_local  # noqa: E402

pytestmark = pytest.mark.torchrec
TOL = dict(atol=1e-6, rtol=0)


def configs(one_dim: bool = False, mean: bool = True):
    d2 = 8 if one_dim else 4
    return [EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=40, feature_names=["u"]),
            EmbeddingBagConfig(name="item", embedding_dim=8, num_embeddings=30, feature_names=["i", "i_hist"],
                               pooling=PoolingType.MEAN if mean else PoolingType.SUM),
            EmbeddingBagConfig(name="ctx", embedding_dim=d2, num_embeddings=25, feature_names=["c"])]


def kjt(seed: int, B: int = 12, keys=("c", "i_hist", "u", "i")) -> KeyedJaggedTensor:
    """Multi-hot, empty bags, keys in another order than the tables'."""
    g = torch.Generator().manual_seed(seed)
    rows = {"u": 40, "i": 30, "i_hist": 30, "c": 25}
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=g)
    values = torch.cat([torch.randint(0, rows[k], (int(n),), generator=g)
                        for k, n in zip(keys, lengths.view(len(keys), B).sum(1))])
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths)


def trained_ebc(one_dim: bool = False, seed: int = 0, steps: int = 3) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=configs(one_dim), device=torch.device("cpu"))
    opt = torch.optim.SGD(ebc.parameters(), lr=0.5)
    for s in range(steps):
        kt = ebc(kjt(100 + s))
        loss = (kt.values() * torch.linspace(-1, 1, kt.values().shape[1])).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ebc


def assert_same_kt(got, ref: KeyedTensor) -> None:
    assert isinstance(got, KeyedTensor)
    assert got.keys() == ref.keys() and got.length_per_key() == ref.length_per_key()
    g, r = got.to_dict(), ref.to_dict()
    for k in ref.keys():
        torch.testing.assert_close(g[k], r[k], **TOL, msg=lambda m: f"feature {k}: {m}")


@pytest.mark.parametrize("optimizer", [None, "sgd", "rowwise_adagrad"])
def test_local_embedding_round_trips_a_trained_ebc(optimizer):
    ebc = trained_ebc()
    specs = table_specs_from_ebc(ebc)
    assert [(t.name, t.num_rows, t.dim, t.features, t.pooling) for t in specs] == [
        ("user", 40, 8, ["u"], "sum"), ("item", 30, 8, ["i", "i_hist"], "mean"), ("ctx", 25, 4, ["c"], "sum")]
    ours = LocalEmbeddingBags(specs, optimizer=optimizer, lr=0.3, seed=5)
    init = {t.name: ours.table_weight(t.name).clone() for t in specs}
    ours.load_state_dict(ebc.state_dict())  # strict: the EBC's names, every table
    for t in specs:  # the trained rows, not the initial ones
        assert not torch.equal(ours.table_weight(t.name), init[t.name])
    with torch.no_grad():
        for seed in (1, 2):
            x = kjt(seed)
            assert_same_kt(ours(x), ebc(x))
    # plain tensors out for our own input type, as before
    jf = JaggedFeatures.from_kjt(kjt(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(jf), ebc(kjt(1)).values(), **TOL)

    # ... and back: train ours further, save under the EBC's names, load into a fresh EBC
    if optimizer is None:
        opt = torch.optim.SGD(ours.parameters(), lr=0.3)
    for s in range(2):
        out = ours(kjt(200 + s)).values()
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        if optimizer is None:
            opt.step()
            opt.zero_grad()
    sd = ours.ebc_state_dict()
    assert list(sd) == [f"embedding_bags.{t}.weight" for t in ("user", "item", "ctx")]
    assert not torch.equal(sd["embedding_bags.user.weight"], ebc.state_dict()["embedding_bags.user.weight"])
    back = EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))
    back.load_state_dict(sd)
    with torch.no_grad():
        x = kjt(3)
        assert_same_kt(ours(x), back(x))


def test_weighted_kjt_matches_a_weighted_ebc():
    torch.manual_seed(1)
    # TorchRec pools weighted features with sum only (embedding_bag's per_sample_weights)
    ebc = EmbeddingBagCollection(tables=configs(mean=False), is_weighted=True, device=torch.device("cpu"))
    ours = LocalEmbeddingBags(table_specs_from_ebc(ebc), optimizer=None)
    ours.load_state_dict(ebc.state_dict())
    x = kjt(4)
    w = torch.rand(x.values().numel()) + 0.5
    xw = KeyedJaggedTensor(keys=x.keys(), values=x.values(), lengths=x.lengths(), weights=w)
    with torch.no_grad():
        assert_same_kt(ours(xw), ebc(xw))


def test_adagrad_state_restarts_when_loading_ebc_weights():
    ebc = trained_ebc()
    ours = LocalEmbeddingBags(table_specs_from_ebc(ebc), optimizer="rowwise_adagrad", lr=0.1)
    ours(kjt(1)).values().sum().backward()
    assert float(ours.momentum.abs().sum()) > 0
    ours.load_state_dict(ebc.state_dict())
    assert float(ours.momentum.abs().sum()) == 0.0
    # our own checkpoint keeps it
    ours(kjt(1)).values().sum().backward()
    sd = {k: v.clone() for k, v in ours.state_dict().items()}
    again = LocalEmbeddingBags(table_specs_from_ebc(ebc), optimizer="rowwise_adagrad", lr=0.1)
    again.load_state_dict(sd)
    torch.testing.assert_close(again.momentum, ours.momentum, atol=0, rtol=0)


def test_ebc_state_dict_mismatches_are_named():
    ebc = trained_ebc()
    ours = LocalEmbeddingBags(table_specs_from_ebc(ebc), optimizer="sgd")
    sd = dict(ebc.state_dict())
    sd["embedding_bags.user.weight"] = torch.zeros(41, 8)
    with pytest.raises(RuntimeError, match=r"embedding_bags\.user\.weight: shape \(41, 8\)"):
        ours.load_state_dict(sd)
    del sd["embedding_bags.user.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*embedding_bags\.user\.weight"):
        ours.load_state_dict(sd)
    sd = dict(ebc.state_dict(), **{"embedding_bags.other.weight": torch.zeros(3, 8)})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*embedding_bags\.other\.weight"):
        ours.load_state_dict(sd)


def test_kjt_with_an_unknown_feature_is_named():
    ours = LocalEmbeddingBags(table_specs_from_ebc(configs()), optimizer="sgd")
    x = KeyedJaggedTensor(keys=["u", "i", "i_hist", "c", "zz"], values=torch.zeros(5, dtype=torch.long),
                          lengths=torch.ones(5, dtype=torch.long))
    with pytest.raises(InputError, match="'zz'"):
        ours(x)
    with pytest.raises(InputError, match="expected JaggedFeatures or a TorchRec KeyedJaggedTensor"):
        ours({"u": torch.zeros(1)})


def test_unsupported_torchrec_tables_are_named():
    cfg = EmbeddingBagConfig(name="seq", embedding_dim=8, num_embeddings=5, feature_names=["s"],
                             pooling=PoolingType.NONE)
    with pytest.raises(ConfigError, match="'seq'.*pooling 'none'"):
        table_specs_from_ebc([cfg])


def test_built_embedding_takes_a_kjt():
    ebc = trained_ebc()
    specs = table_specs_from_ebc(ebc)
    emb = build_embedding(specs, None, EmbeddingEnv(device=torch.device("cpu"), optimizer="sgd", lr=0.1, seed=0),
                          forms={t.name: TableForm() for t in specs})
    emb.load_state_dict(ebc.state_dict())
    with torch.no_grad():
        assert_same_kt(emb(kjt(7)), ebc(kjt(7)))


# -- sharded: 2 gloo ranks ------------------------------------------------------------------------------
def _plan(specs, world):
    rng = np.random.default_rng(3)
    owner = [rng.integers(0, world, t.num_rows) for t in specs]  # row-level placement
    replicas = [np.array([0, 1]), np.array([2, 3, 4]), np.array([1])]  # hot rows on every rank
    return AddressMap.build(specs, world, owner, replicas, None)


def _sharded_worker(rank, world, designs, job):
    return {d: _sharded_design(rank, world, d, job) for d in designs}


def _sharded_design(rank, world, design, job):
    ebc = trained_ebc(one_dim=True)  # the same seed and steps on every rank: the same trained tables
    specs = table_specs_from_ebc(ebc)
    if design == "pgas":  # the one-sided lookup (retrieve design through the symmetric heap)
        emb = PgasShardedEmbedding(specs, _plan(specs, world), PgasTransport(job_id=job), rank, optimizer="sgd",
                                   lr=0.3, seed=11, max_batch_size=12, max_ids_per_bag=4.0)
    else:
        emb = ShardedEmbedding(specs, _plan(specs, world), CollectiveTransport(), rank, design=design,
                               optimizer="sgd", lr=0.3, seed=11)
    emb.load_state_dict(ebc.state_dict())
    B = 12
    lo, hi = B * rank // world, B * (rank + 1) // world
    res = {}
    x = kjt(1, B=B)
    local = JaggedFeatures.from_kjt(x).slice_batch(lo, hi).to_kjt()
    with torch.no_grad():
        got, ref = emb(local), ebc(local)
    res["in"] = (got.keys(), got.length_per_key(), got.values(), ref.keys(), ref.values())
    gathered = emb.ebc_state_dict()
    res["gathered_in"] = {k: torch.equal(v, ebc.state_dict()[k]) for k, v in gathered.items()}
    # train ours: every rank its slice of the same global batches
    for s in range(2):
        xs = JaggedFeatures.from_kjt(kjt(300 + s, B=B)).slice_batch(lo, hi).to_kjt()
        out = emb(xs).values()
        ((out * torch.linspace(-1, 1, out.shape[1])).sum() / B).backward()
    back = EmbeddingBagCollection(tables=configs(one_dim=True), device=torch.device("cpu"))
    back.load_state_dict(emb.ebc_state_dict())
    x = kjt(5, B=B)
    local = JaggedFeatures.from_kjt(x).slice_batch(lo, hi).to_kjt()
    with torch.no_grad():
        res["back"] = (emb(local).values(), back(local).values())
    res["moved"] = not torch.equal(back.state_dict()["embedding_bags.item.weight"],
                                   ebc.state_dict()["embedding_bags.item.weight"])
    return res


def test_sharded_embedding_round_trips_a_trained_ebc():
    designs = ["retrieve", "send", "pgas"]  # one launch for all (each rank imports torchrec once)
    results = spawn_local(_sharded_worker, 2, designs, f"interop-{os.getpid()}", timeout_s=900)
    for r in range(2):
        for design in designs:
            res = results[r][design]
            keys, dims, got, ref_keys, ref = res["in"]
            assert keys == ref_keys == ["u", "i", "i_hist", "c"] and dims == [8, 8, 8, 8]
            torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"rank {r}, {design}, loaded: {m}")
            assert all(res["gathered_in"].values()), f"rank {r}: gathered tables differ: {res['gathered_in']}"
            ours, back = res["back"]
            torch.testing.assert_close(ours, back, **TOL, msg=lambda m: f"rank {r}, {design}, saved back: {m}")
            assert res["moved"], f"rank {r}: training changed nothing, the way back proves nothing"


def test_sharded_rejects_mixed_dims_from_torchrec():
    with pytest.raises(ConfigError, match="different dims"):
        specs = table_specs_from_ebc(configs())
        ShardedEmbedding(specs, _plan(specs, 1), None, 0)


def test_library_works_without_torchrec():
    """torchrec blocked in a fresh interpreter: the modules import and run; a duck-typed KJT is read without
    torchrec, and only the KeyedTensor answer asks for the extra, by name."""
    code = """
import sys
sys.modules["torchrec"] = None  # import torchrec -> ImportError
import torch
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding import interop, local, sharded  # noqa: F401
from embedscale.models import builder  # noqa: F401
from embedscale.specs import TableSpec
emb = local.LocalEmbeddingBags([TableSpec("t", 10, 4, features=["a", "b"])], optimizer="sgd", seed=0)
jf = JaggedFeatures.from_dense(["a", "b"], torch.tensor([[1, 2], [3, 4]]))
assert emb(jf).shape == (2, 8)
class FakeKJT:  # the four methods a KJT has
    def keys(self): return ["b", "a"]
    def values(self): return torch.tensor([2, 4, 1, 3])
    def lengths(self): return torch.ones(4, dtype=torch.long)
    def weights_or_none(self): return None
got, was_kjt = interop.as_jagged(FakeKJT())
assert was_kjt and got.keys == ["b", "a"]
try:
    emb(FakeKJT())
except ImportError as e:
    assert "torchrec extra" in str(e), e
else:
    raise AssertionError("a KeyedTensor without torchrec")
assert "torchrec" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=f"{Path(__file__).resolve().parents[1] / 'src'}{os.pathsep}"
                                      f"{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
