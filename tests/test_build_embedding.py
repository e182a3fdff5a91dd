"""The one embedding builder: every form of a world of one, rows initialised placement-independently
(checked against ``embedding.init.uniform_rows`` directly), and its error cases; the DMT tower embedding
(one process against rows pooled in float64 by hand, two ranks against one process, models bit-identical to
the construction they replace)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from embedscale.comm.hierarchical import TowerComm
from embedscale.plan.tower_placement import TowerLayout
from embedscale.data.batch import JaggedFeatures
from embedscale.models.builder import EmbeddingEnv, build_embedding, embedding_parts
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.mixed import MixedEmbedding
from embedscale.embedding.towers import LocalTowerEmbedding, TowerSetup
from embedscale.errors import ConfigError
from embedscale.models.dmt import DMTConfig, build_dmt_model, build_flat_model
from embedscale.models.tower_modules import build_tower_modules, tower_out_features
from embedscale.pipeline import PipelinedEmbedding
from embedscale.embedding.towers import tower_forms
from embedscale.plan.forms import TableForm, decide_forms
from embedscale.specs import ModelConfig, TableConfig, TableSpec
from embedscale.plan.towers import TowerAssignment
from embedscale.train.launch import spawn_local

DEV = torch.device("cpu")  # the test's own device; the builder takes it from env


def _tables(mixed: bool = False):
    """The tables and their forms (``b`` TT by ``tt_min_rows``, ``c`` host by its request when ``mixed``)."""
    tabs = [TableSpec("a", 30, 4), TableSpec("b", 500, 4), TableSpec("c", 200, 4)]
    requests = [TableConfig("c", 200, 4, placement="host")] if mixed else []
    return tabs, decide_forms(tabs, requests=requests, tt_min_rows=400 if mixed else 0, tt_rank=2)


def _ref(seed, index, spec):
    return uniform_rows(seed, index, np.arange(spec.num_rows), spec.dim, spec.num_rows)


def test_world_of_one_plain_tables_are_local_bags_with_hash_init():
    tabs, forms = _tables()
    emb = build_embedding(tabs, None, EmbeddingEnv(device=DEV, seed=7), forms=forms)
    assert type(emb) is LocalEmbeddingBags
    rows, tt, host = embedding_parts(emb)
    assert rows is emb and tt is None and host is None
    for i, t in enumerate(tabs):
        np.testing.assert_array_equal(emb.table_weight(t.name).detach().numpy()[: t.num_rows], _ref(7, i, t))


def test_tt_and_host_forms_make_the_mixed_and_pipelined_parts():
    tabs, forms = _tables(mixed=True)  # b: TT (tt_min_rows), c: host (placement: host), a: rows
    emb = build_embedding(tabs, None, EmbeddingEnv(device=DEV, seed=3), forms=forms)
    rows, tt, host = embedding_parts(emb)
    assert isinstance(host, PipelinedEmbedding) and isinstance(tt, MixedEmbedding)
    assert list(tt.tt) == ["b"] and tt.tt["b"].ranks == [1, 2, 2, 1]  # the form's rank
    # the uncompressed table keeps its index among all tables (0), so it starts as everywhere else
    np.testing.assert_array_equal(rows.table_weight("a").detach().numpy()[:30], _ref(3, 0, tabs[0]))
    np.testing.assert_array_equal(host.server.store.table_weight("c").detach().numpy()[:200], _ref(3, 2, tabs[2]))


def test_several_ranks_need_a_plan_and_a_transport():
    tabs, forms = _tables()
    with pytest.raises(ConfigError, match="2 ranks need a plan"):
        build_embedding(tabs, None, EmbeddingEnv(device=DEV, world_size=2), forms=forms)


def test_every_table_needs_a_form():
    tabs, forms = _tables(mixed=True)
    with pytest.raises(ConfigError, match=r"tables \['c'\] have no form"):
        build_embedding(tabs, None, EmbeddingEnv(device=DEV), forms={k: v for k, v in forms.items() if k != "c"})


# --------------------------------------------------------------------------------------------------
# DMT towers (DMT 3.1): built by the same builder from env.towers


TOWER_DIM = 4
TOWER_FEATURES = [f"f{i}" for i in range(8)]
TOWER_ASSIGN = [["f0", "f1", "f2", "f5"], ["f3", "f4", "f6", "f7"]]
# sha256 (first 16 hex digits) of every model's state_dict (names and raw bytes), seed 5, recorded from the
# models built before the tower embedding moved into build_embedding (commit f187fb2, models/dmt.py built
# LocalTowerEmbedding / TowerEmbedding / FlatTableWiseEmbedding itself): the move is bit-identical.
PRE_MOVE_SINGLE = {"dlrm": "7dad2682bb25cb8a", "dcn": "93574b4fc84b58a5", "none": "54a3bb268a467c67"}
PRE_MOVE_RANKS = [{"dlrm": "723691e82dd6660d", "dcn": "030c6e1715fea0d3", "none": "8a08017755b4b430",
                   "flat": "6179f027bd91a4cf"},
                  {"dlrm": "ca8931829cd87a72", "dcn": "cdf1284c5f448eda", "none": "94d9adbdfd637a84",
                   "flat": "5a58a2b12354db16"}]


def _tower_tables():
    n = TOWER_DIM
    return [TableSpec("t0", 40, n, features=["f0"]), TableSpec("t1", 7, n, features=["f1", "f2"], pooling="mean"),
            TableSpec("t2", 90, n, features=["f3"]), TableSpec("t3", 25, n, features=["f4"]),
            TableSpec("t4", 60, n, features=["f5"]), TableSpec("t5", 33, n, features=["f6"]),
            TableSpec("t6", 50, n, features=["f7"])]


def test_tower_forms_name_each_tables_first_tower():
    assert {k: f.tower for k, f in TFORMS.items()} == {"t0": 0, "t1": 0, "t2": 1, "t3": 1, "t4": 0, "t5": 1, "t6": 1}
    assert all(f.kind == "tower" for f in TFORMS.values())
    assert {f.kind for f in tower_forms(_tower_tables(), None).values()} == {"sharded"}  # the flat baseline


def _tower_model_cfg(arch="dlrm"):
    return ModelConfig(arch=arch, embedding_dim=TOWER_DIM, bottom_mlp=[8], top_mlp=[8], cross_layers=1)


TFORMS = tower_forms(_tower_tables(), TowerAssignment(TOWER_ASSIGN))


def _tower_batch(b=6):
    g = torch.Generator().manual_seed(4)
    per_key = {}
    for t in _tower_tables():
        for f in t.features:
            lens = torch.randint(0, 4, (b,), generator=g)  # empty bags included
            per_key[f] = [torch.randint(0, t.num_rows, (int(n),), generator=g).tolist() for n in lens]
    return per_key, JaggedFeatures.from_lists({f: per_key[f] for f in TOWER_FEATURES})


def _tower_setup(kind="dlrm", comm=None, towers=None):
    sizes = [len(t) for t in TOWER_ASSIGN]
    mods = build_tower_modules(kind, sizes, TOWER_DIM, out_dim=2, seed=5, towers=towers)
    outs = [tower_out_features(kind, f, TOWER_DIM, 2) for f in sizes]
    return TowerSetup(TowerAssignment(TOWER_ASSIGN), mods, outs, comm=comm, model_order=(kind == "none"))


def _digest(model) -> str:
    """The model's state before the move, hashed: the logit calibration (added later, identity at init) left out."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        if k.startswith("calibration."):
            continue
        h.update(k.encode())
        h.update(v.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _dmt_models(comm=None) -> dict:
    a = TowerAssignment(TOWER_ASSIGN)
    hosts = {} if comm is not None else {"num_hosts": 2}
    out = {"dlrm": build_dmt_model(_tower_model_cfg(), _tower_tables(), 3, DMTConfig(compression=2), assignment=a,
                                   comm=comm, seed=5, **hosts),
           "dcn": build_dmt_model(_tower_model_cfg("dcn"), _tower_tables(), 3,
                                  DMTConfig(compression=2, towers=2 if comm is not None else 4), comm=comm, seed=5,
                                  assignment=a if comm is not None else TowerAssignment(_ASSIGN_4)),
           "none": build_dmt_model(_tower_model_cfg(), _tower_tables(), 3, DMTConfig(tower_module="none"),
                                   assignment=a, comm=comm, seed=5, **hosts)}
    if comm is not None:
        out["flat"] = build_flat_model(_tower_model_cfg(), _tower_tables(), 3, comm, seed=5)
    return out


_ASSIGN_4 = [["f0", "f5"], ["f1", "f2"], ["f3", "f7"], ["f4", "f6"]]


def test_one_process_towers_hold_hash_rows_and_apply_each_tower_module():
    tabs = _tower_tables()
    setup = _tower_setup()
    emb = build_embedding(tabs, None, EmbeddingEnv(device=DEV, seed=5, towers=setup), forms=TFORMS)
    assert type(emb) is LocalTowerEmbedding
    ref_rows = {t.name: _ref(5, i, t) for i, t in enumerate(tabs)}
    for t in tabs:  # every row starts where it starts in any other form or placement
        np.testing.assert_array_equal(emb.embedding.table_weight(t.name).detach().numpy()[: t.num_rows],
                                      ref_rows[t.name])
    per_key, jf = _tower_batch()
    # the reference: every bag pooled in float64 from the materialised rows, then each tower's module
    table_of = {f: t for t in tabs for f in t.features}
    pooled = {}
    for f in TOWER_FEATURES:
        t = table_of[f]
        bags = [ref_rows[t.name][ids].astype(np.float64) for ids in per_key[f]]
        pooled[f] = np.stack([(b.mean(0) if t.pooling == "mean" else b.sum(0)) if len(b) else np.zeros(TOWER_DIM)
                              for b in bags])
    want = torch.cat([setup.modules[i](torch.from_numpy(np.stack([pooled[f] for f in fs], 1)).float())
                      for i, fs in enumerate(TOWER_ASSIGN)], 1)
    with torch.no_grad():
        torch.testing.assert_close(emb(jf), want.detach())
    # pass-through towers in one process: the plain model's fused lookup itself
    plain = build_embedding(tabs, None, EmbeddingEnv(device=DEV, seed=5, towers=_tower_setup("none")), forms=TFORMS)
    assert type(plain) is LocalEmbeddingBags


def test_tower_embedding_errors():
    tabs = _tower_tables()
    with pytest.raises(ConfigError, match="place their own rows"):
        build_embedding(tabs, object(), EmbeddingEnv(device=DEV, towers=_tower_setup()), forms=TFORMS)
    host = dict(TFORMS, t0=TableForm("host"))
    with pytest.raises(ConfigError, match="table 't0'.*host"):
        build_embedding(tabs, None, EmbeddingEnv(device=DEV, towers=_tower_setup()), forms=host)
    with pytest.raises(ConfigError, match=r"tables \['t0'\] have no form"):
        build_embedding(tabs, None, EmbeddingEnv(device=DEV, towers=_tower_setup()),
                        forms={k: v for k, v in TFORMS.items() if k != "t0"})
    with pytest.raises(ConfigError, match="needs comm"):
        TowerSetup(flat=True)
    with pytest.raises(ConfigError, match="3 tower widths for 2 towers"):
        TowerSetup(TowerAssignment(TOWER_ASSIGN), {}, [1, 2, 3])


def test_dmt_models_are_bit_identical_to_the_pre_move_construction():
    torch.manual_seed(99)  # nothing may depend on the global generator
    assert {k: _digest(m) for k, m in _dmt_models().items()} == PRE_MOVE_SINGLE


def _two_rank_towers(rank, world):
    comm = TowerComm(TowerLayout(world, 1))  # 2 hosts of one rank: 2 tower groups, one tower each
    torch.manual_seed(99 + rank)
    digests = {k: _digest(m) for k, m in _dmt_models(comm).items()}
    emb = build_embedding(_tower_tables(), None, EmbeddingEnv(device=DEV, seed=5,
                                                              towers=_tower_setup(comm=comm, towers=[rank])),
                          forms=TFORMS)
    _, jf = _tower_batch()
    lo, hi = jf.batch_size * rank // world, jf.batch_size * (rank + 1) // world
    with torch.no_grad():
        out = emb(jf.slice_batch(lo, hi))
    return {"digests": digests, "type": type(emb).__name__, "out": out, "lo": lo, "hi": hi}


def test_two_rank_tower_transform_pools_as_one_process_and_models_are_pre_move():
    results = spawn_local(_two_rank_towers, 2, timeout_s=300)
    one = build_embedding(_tower_tables(), None, EmbeddingEnv(device=DEV, seed=5, towers=_tower_setup()), forms=TFORMS)
    _, jf = _tower_batch()
    with torch.no_grad():
        want = one(jf)
    for rank, r in enumerate(results):
        assert r["type"] == "TowerEmbedding"
        torch.testing.assert_close(r["out"], want[r["lo"]:r["hi"]])
        assert r["digests"] == PRE_MOVE_RANKS[rank]
