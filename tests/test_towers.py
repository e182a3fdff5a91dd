"""The tower transform, tower modules and DMT models, against independent references.

Multi-rank (one gloo spawn per world size, every scenario inside):

* pass-through towers (SPTT alone) equal the flat all_to_all (classic ids-to-owners, owners pool, pooled
  all_to_all back) *bitwise*: logits of every step, dense gradients, dense parameters and every table's
  rows after training (DMT Table 3), on 4 ranks as 2 hosts x 2 and 8 ranks as 2 hosts x 4, and on 8
  ranks as 4 hosts x 2 with one-host and two-host towers (DMT 3.1.3);
* the specialisations (steps b and c swapped; row-wise shards with a reduce-scatter) equal it up to
  float reassociation;
* everything equals a single-process model trained on the global batch (an independent reference);
* DMT models with tower modules equal their single-process twin, tower-module gradients stay inside
  the tower, and the bytes crossing hosts shrink by exactly the configured CR (counted).
"""

from __future__ import annotations

import math

import pytest
import torch

from embedscale.comm.hierarchical import HostAwareTransport, LinkModel, TowerComm
from embedscale.embedding.tower_router import TowerRouter
from embedscale.plan.tower_placement import TowerLayout, TowerPlacement
from embedscale.comm.collective import CollectiveTransport
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.towers import TowerEmbedding
from embedscale.errors import ConfigError, InputError
from embedscale.models.dmt import DMTConfig, DMTDLRM, build_dmt_model, build_flat_model, train_step
from embedscale.specs import ModelConfig, TableSpec
from embedscale.models.tower_modules import (
    DCNTowerModule,
    DLRMTowerModule,
    build_tower_modules,
    compression_ratio,
    tower_out_features,
)
from embedscale.plan.towers import TowerAssignment
from embedscale.train.launch import spawn_local

N = 4
STEPS = 3
LR = 0.1
FEATURES = [f"f{i}" for i in range(8)]
ASSIGN = {2: [["f0", "f1", "f2", "f5"], ["f3", "f4", "f6", "f7"]],
          4: [["f0", "f5"], ["f1", "f2"], ["f3", "f7"], ["f4", "f6"]]}


def tables():
    return [TableSpec("t0", 40, N, features=["f0"]), TableSpec("t1", 7, N, features=["f1", "f2"], pooling="mean"),
            TableSpec("t2", 90, N, features=["f3"]), TableSpec("t3", 25, N, features=["f4"]),
            TableSpec("t4", 60, N, features=["f5"]), TableSpec("t5", 33, N, features=["f6"]),
            TableSpec("t6", 50, N, features=["f7"])]


def model_cfg(arch="dlrm"):
    return ModelConfig(arch=arch, embedding_dim=N, bottom_mlp=[8], top_mlp=[8], cross_layers=1)


def batches(global_b):
    """Multi-hot global batches with empty bags; per-sample weights in step 1."""
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(STEPS):
        per_key = {}
        for t in tables():
            for f in t.features:
                lens = torch.randint(0, 4, (global_b,), generator=g)
                per_key[f] = [torch.randint(0, t.num_rows, (int(n),), generator=g).tolist() for n in lens]
        jf = JaggedFeatures.from_lists({f: per_key[f] for f in FEATURES})
        if step == 1:
            jf = JaggedFeatures(jf.keys, jf.values, jf.lengths, torch.rand(jf.values.numel(), generator=g) + 0.5)
        out.append((torch.rand(global_b, 3, generator=g), jf,
                    torch.randint(0, 2, (global_b,), generator=g).float()))
    return out


def _local_bags(model):
    """The LocalEmbeddingBags inside a model (plain DLRM over a tower executor, or a DMT model)."""
    from embedscale.embedding.local import LocalEmbeddingBags

    emb = model.sparse_arch
    while emb is not None and not isinstance(emb, LocalEmbeddingBags):
        emb = getattr(emb, "embedding", None)
    return emb


def _shard_weights(model):
    emb = _local_bags(model)
    if emb is None:
        return {}
    return {spec.name: emb.table_weight(spec.name).clone() for spec in emb.tables}


def _train(model, rank, world, global_b, comm):
    opt = torch.optim.SGD(model.dense_parameters(), lr=LR)
    logits, grads, nbytes = [], None, None
    for step, (dense, jf, y) in enumerate(batches(global_b)):
        lo, hi = global_b * rank // world, global_b * (rank + 1) // world
        comm.reset_bytes()
        _, out = train_step(model, opt, dense[lo:hi], jf.slice_batch(lo, hi), y[lo:hi], global_b, comm)
        logits.append(out)
        if step == 0:
            grads = [p.grad.clone() for p in model.global_parameters()]
            nbytes = comm.bytes_report()
    return {"logits": logits, "grads": grads, "params": [p.detach().clone() for p in model.global_parameters()],
            "towers": {k: v.clone() for k, v in model.sparse_arch.towers.state_dict().items()}
            if hasattr(model.sparse_arch, "towers") else {},
            "weights": _shard_weights(model), "bytes": nbytes}


def _bytes_one_step(model, comm, rank, world, global_b):
    """Cross-host and intra-host bytes of one forward + backward (nothing updated that matters)."""
    comm.reset_bytes()
    dense, jf, y = batches(global_b)[0]
    lo, hi = global_b * rank // world, global_b * (rank + 1) // world
    model(dense[lo:hi], jf.slice_batch(lo, hi)).sum().backward()
    from embedscale.models.dmt import sync_dense_gradients

    sync_dense_gradients(model, comm)
    return comm.bytes_report()


def _worker(rank, world, layouts, global_b):
    out = {}
    for lname, (L, K, scenarios) in layouts.items():
        comm = TowerComm(TowerLayout(world, L, K))
        P = comm.layout.num_groups
        assign = TowerAssignment(ASSIGN[P])
        for name in scenarios:
            torch.manual_seed(123)  # nothing below may depend on it: every rank builds the same model
            if name == "flat":
                ref = build_dmt_model(model_cfg(), tables(), 3, DMTConfig(tower_module="none", hosts_per_tower=K),
                                      assignment=assign, comm=comm, seed=5, lr=LR)
                model = build_flat_model(model_cfg(), tables(), 3, comm, placement=ref.sparse_arch.embedding.placement,
                                         seed=5, lr=LR)
            elif name == "error":
                model = build_dmt_model(model_cfg(), tables(), 3, DMTConfig(tower_module="none", hosts_per_tower=K),
                                        assignment=assign, comm=comm, seed=5)
                ids = torch.zeros(1, len(FEATURES), dtype=torch.int64)
                if rank == world - 1:
                    ids[0, 7] = 10_000  # feature f7, table t6
                try:
                    model(torch.rand(1, 3), JaggedFeatures.from_dense(FEATURES, ids))
                    out[(lname, name)] = "no error"
                except InputError as e:
                    out[(lname, name)] = str(e)
                continue
            elif name == "bytes_dlrm_4":  # one step of DMT-DLRM at CR 4, counting bytes
                dmt = DMTConfig(tower_module="dlrm", compression=4, hosts_per_tower=K)
                model = build_dmt_model(model_cfg(), tables(), 3, dmt, assignment=assign, comm=comm, seed=5)
                out[(lname, name)] = _bytes_one_step(model, comm, rank, world, global_b)
                continue
            else:
                model = build_dmt_model(model_cfg("dcn" if name == "dmt_dcn" else "dlrm"), tables(), 3,
                                        scenario_config(name, K), assignment=assign, comm=comm, seed=5, lr=LR)
            out[(lname, name)] = _train(model, rank, world, global_b, comm)
    return out


def scenario_config(name, K=1):
    return {"sptt": DMTConfig(tower_module="none", permute="embeddings", hosts_per_tower=K),
            "sptt_ids": DMTConfig(tower_module="none", permute="ids", hosts_per_tower=K),
            "sptt_row": DMTConfig(tower_module="none", sharding="row", hosts_per_tower=K),
            "dmt_dlrm": DMTConfig(tower_module="dlrm", compression=2, hosts_per_tower=K),
            "dmt_dcn": DMTConfig(tower_module="dcn", compression=2, hosts_per_tower=K)}[name]


def reference(name, num_hosts, P, global_b):
    """The same model in one process, trained on the global batch."""
    arch = "dcn" if name == "dmt_dcn" else "dlrm"
    cfg = scenario_config(name)
    model = build_dmt_model(model_cfg(arch), tables(), 3, cfg, assignment=TowerAssignment(ASSIGN[P]), seed=5,
                            lr=LR, num_hosts=P)
    opt = torch.optim.SGD(model.dense_parameters(), lr=LR)
    logits = []
    for dense, jf, y in batches(global_b):
        logits.append(train_step(model, opt, dense, jf, y, global_b)[1])
    emb = _local_bags(model)
    weights = {t.name: emb.table_weight(t.name).clone() for t in tables()}
    towers = {k: v for k, v in model.sparse_arch.towers.state_dict().items()} \
        if hasattr(model.sparse_arch, "towers") else {}
    return {"logits": logits, "params": [p.detach() for p in model.global_parameters()], "weights": weights,
            "towers": towers}


def _check_equal(results, world, lname, a, b, exact, global_b):
    for r in range(world):
        x, y = results[r][(lname, a)], results[r][(lname, b)]
        for step in range(STEPS):
            if exact:
                assert torch.equal(x["logits"][step], y["logits"][step]), f"{lname} {b} rank {r} step {step}"
            else:
                torch.testing.assert_close(x["logits"][step], y["logits"][step], atol=1e-5, rtol=0)
        for p, q in zip(x["grads"], y["grads"]):
            assert torch.equal(p, q) if exact else torch.allclose(p, q, atol=1e-5), f"{lname} {b} grads rank {r}"
        for p, q in zip(x["params"], y["params"]):
            assert torch.equal(p, q) if exact else torch.allclose(p, q, atol=1e-5), f"{lname} {b} params rank {r}"
        if exact:
            assert x["weights"].keys() == y["weights"].keys()
            for k in x["weights"]:
                assert torch.equal(x["weights"][k], y["weights"][k]), f"{lname} {b} table {k} rank {r}"


def _check_reference(results, world, lname, name, ref, global_b, atol=2e-5):
    for r in range(world):
        got = results[r][(lname, name)]
        lo, hi = global_b * r // world, global_b * (r + 1) // world
        for step in range(STEPS):
            torch.testing.assert_close(got["logits"][step], ref["logits"][step][lo:hi], atol=atol, rtol=0,
                                       msg=lambda m: f"{lname} {name} rank {r} step {step}: {m}")
        for p, q in zip(got["params"], ref["params"]):
            torch.testing.assert_close(p, q, atol=atol, rtol=0)
        for k, v in got["towers"].items():  # this rank's tower modules equal the single-process ones
            # (ModuleDict key "3.project.weight" on a rank = ModuleList key of tower 3 in one process)
            torch.testing.assert_close(v, ref["towers"][k], atol=atol, rtol=0)
        for k, w in got["weights"].items():
            table, lo_r, hi_r = k, 0, None
            if "[" in k:  # row shard name[lo:hi]
                table, rng = k[:-1].split("[")
                lo_r, hi_r = map(int, rng.split(":"))
            full = ref["weights"][table]
            hi_r = full.shape[0] if hi_r is None else hi_r
            torch.testing.assert_close(w[: hi_r - lo_r], full[lo_r:hi_r], atol=atol, rtol=0)


def _check_bytes(results, world, lname):
    """Cross-host embedding bytes of one step: SPTT equals flat; tower modules divide them by CR exactly;
    tower-module gradients stay on the host."""
    emb_kinds = ("peer_a2a", "peer_a2a_grad", "tower_a2a", "tower_a2a_grad", "flat_a2a", "flat_a2a_grad")

    def cross(name):
        rep = [results[r][(lname, name)] for r in range(world)]
        return sum((x["bytes"] if "bytes" in x else x)["cross"].get(k, 0) for x in rep for k in emb_kinds)

    flat, sptt, cr2, cr4 = cross("flat"), cross("sptt"), cross("dmt_dlrm"), cross("bytes_dlrm_4")
    assert flat > 0 and sptt == flat, (flat, sptt)
    assert sptt == cr2 * 2 and sptt == cr4 * 4, (sptt, cr2, cr4)
    for r in range(world):
        rep = results[r][(lname, "dmt_dlrm")]["bytes"]
        assert rep["cross"].get("tower_grads", 0) == 0 and rep["intra"].get("tower_grads", 0) > 0
        assert rep["cross"].get("dense_grads", 0) > 0


LAYOUTS_4 = {"2x2": (2, 1, ["flat", "sptt", "sptt_ids", "sptt_row", "dmt_dlrm", "dmt_dcn", "bytes_dlrm_4", "error"]),
             "4x1_k2": (1, 2, ["flat", "sptt"])}  # towers over 2 hosts (DMT 3.1.3)
LAYOUTS_8 = {"2x4": (4, 1, ["flat", "sptt", "dmt_dlrm", "bytes_dlrm_4"])}


@pytest.mark.parametrize("world,layouts,global_b", [(4, LAYOUTS_4, 26), (8, LAYOUTS_8, 43)])
def test_tower_transform_multi_rank(world, layouts, global_b):
    results = spawn_local(_worker, world, layouts, global_b, timeout_s=240)
    for lname, (L, K, scenarios) in layouts.items():
        layout = TowerLayout(world, L, K)
        P = layout.num_groups
        _check_equal(results, world, lname, "flat", "sptt", True, global_b)  # DMT Table 3: bit for bit
        if "sptt_ids" in scenarios:
            for r in range(world):
                a, b = results[r][(lname, "flat")], results[r][(lname, "sptt_ids")]
                assert torch.equal(a["logits"][0], b["logits"][0])  # same bags, same sums
            _check_equal(results, world, lname, "flat", "sptt_ids", False, global_b)
        if "sptt_row" in scenarios:
            _check_equal(results, world, lname, "flat", "sptt_row", False, global_b)
        ref_plain = reference("sptt", layout.num_hosts, P, global_b)
        for name in [s for s in scenarios if s in ("sptt", "sptt_ids", "sptt_row", "dmt_dlrm", "dmt_dcn")]:
            ref = ref_plain if name.startswith("sptt") else reference(name, layout.num_hosts, P, global_b)
            _check_reference(results, world, lname, name, ref, global_b)
        if "bytes_dlrm_4" in scenarios:
            _check_bytes(results, world, lname)
        if "error" in scenarios:
            for r in range(world):
                msg = results[r][(lname, "error")]
                if r == world - 1:  # only the last rank's batch holds the bad id; every rank raises
                    assert f"rank {r}" in msg and "'f7'" in msg and "'t6'" in msg and "tower group" in msg, msg
                else:
                    assert f"rank {r}" in msg and f"[{world - 1}]" in msg, msg
    # tower modules are identical on the ranks of one tower group
    for lname, (L, K, scenarios) in layouts.items():
        for name in [s for s in scenarios if s.startswith("dmt")]:
            S = L * K
            for r in range(world):
                a = results[r][(lname, name)]["towers"]
                b = results[(r // S) * S][(lname, name)]["towers"]
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------------
# single process: layout, placement, modules, models


def test_peer_order_and_groups():
    lay = TowerLayout(4, 2)
    assert lay.peer_order() == [0, 2, 1, 3]  # DMT 3.1.1's example
    lay = TowerLayout(8, 4)
    assert lay.peer_order() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert lay.peer_ranks(6) == [2, 6] and lay.group_ranks(1) == [4, 5, 6, 7]
    lay = TowerLayout(8, 2, hosts_per_tower=2)
    assert lay.group_size == 4 and lay.num_groups == 2 and lay.peer_ranks(5) == [1, 5]
    with pytest.raises(ConfigError, match="towers of 3"):
        TowerLayout(8, 2, hosts_per_tower=3)
    with pytest.raises(ConfigError, match="multiple"):
        TowerLayout(6, 4)


def test_placement_balances_and_covers():
    lay = TowerLayout(4, 2)
    pl = TowerPlacement(tables(), [0, 0, 1, 1, 0, 1, 1], lay, "table")
    held = sorted(f for r in range(4) for f in pl.rank_features[r])
    assert held == list(range(8))  # every feature pooled by exactly one rank
    for r in range(4):
        assert all(pl.feature_group[f] == lay.group_of(r) for f in pl.rank_features[r])
    # pooled output per member differs by at most the largest table's
    loads = [len(pl.rank_features[r]) for r in range(4)]
    assert max(loads[:2]) - min(loads[:2]) <= 2 and max(loads[2:]) - min(loads[2:]) <= 1
    row = TowerPlacement(tables(), [0, 0, 1, 1, 0, 1, 1], lay, "row")
    for i, t in enumerate(tables()):
        g = [0, 0, 1, 1, 0, 1, 1][i]
        spans = [(lo, hi) for r in lay.group_ranks(g) for (ti, lo, hi) in row.rank_tables[r] if ti == i]
        assert spans[0][0] == 0 and spans[-1][1] == t.num_rows
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, disjoint, complete
    with pytest.raises(ConfigError, match="dims"):
        TowerPlacement([TableSpec("a", 3, 4), TableSpec("b", 3, 8)], [0, 0], lay)


class _Loopback:
    """A one-rank comm without torch.distributed: world, tower and peer are the rank itself."""

    def __init__(self):
        self.rank = 0
        self.layout = TowerLayout(1, 1)
        t = HostAwareTransport(CollectiveTransport(0, 1), [0], 1)
        self.world = self.tower = self.peer = t


def test_router_one_rank_equals_local_lookup_and_names_bad_ids():
    pl = TowerPlacement(tables(), [0] * 7, TowerLayout(1, 1), "table")
    router = TowerRouter(pl, _Loopback(), "embeddings")
    dense, jf, _ = batches(5)[1]
    routed = router.route_ids(jf)
    assert routed.features.keys == [pl.feature_names[f] for f in pl.rank_features[0]]
    assert torch.equal(routed.features.values, jf.values) and torch.equal(routed.features.weights, jf.weights)
    bad = JaggedFeatures(jf.keys, jf.values.clone(), jf.lengths)
    bad.values[0] = -1
    with pytest.raises(InputError, match=r"rank 0: feature 'f0' \(table 't0'"):
        router.route_ids(bad)
    with pytest.raises(InputError, match="expected"):
        router.route_ids(JaggedFeatures(["f0"], torch.tensor([1]), torch.tensor([1])))


def test_link_model_sleeps_for_cross_host_bytes_only():
    link = LinkModel(cross_host_gbit_s=8.0, latency_us=10)
    assert link.seconds(0, 0) == 0.0
    assert math.isclose(link.seconds(1_000_000, 500_000), 10e-6 + 1e-3)
    assert math.isclose(link.seconds(0, 0, 10**9), 0.0)  # intra-host not modelled
    both = LinkModel(cross_host_gbit_s=8.0, intra_host_gbit_s=80.0)
    assert math.isclose(both.seconds(1_000_000, 0, 20_000_000), 2e-3)  # the slower of the two links
    with pytest.raises(ConfigError):
        LinkModel(0.0)


def test_dlrm_tower_module_is_listing_1():
    torch.manual_seed(0)
    tm = DLRMTowerModule(3, 8, 4, c=2, p=1)
    embs = torch.randn(5, 3, 8)
    o1 = embs.reshape(5, 24) @ tm.mix.weight.t() + tm.mix.bias
    o2 = torch.stack([embs[:, f] @ tm.project.weight.t() + tm.project.bias for f in range(3)], 1).reshape(5, -1)
    torch.testing.assert_close(tm(embs), torch.cat([o1, o2], 1))
    assert tm.out_features == 4 * (2 * 3 + 1) and tm.num_vectors == 7


def test_dcn_tower_module_is_listing_2():
    torch.manual_seed(0)
    tm = DCNTowerModule(2, 3, 2, cross_layers=2, low_rank=0)
    embs = torch.randn(4, 2, 3)
    x0 = embs.reshape(4, 6)
    x = x0
    for W, b in zip(tm.cross.W, tm.cross.b):
        x = x0 * (x @ W.t() + b) + x
    torch.testing.assert_close(tm(embs), x @ tm.project.weight.t() + tm.project.bias)
    assert tm.out_features == 4


def test_compression_ratio_and_deterministic_modules():
    mods = build_tower_modules("dlrm", [3, 5], 16, out_dim=4, seed=3)
    assert compression_ratio(list(mods.values())) == 4.0
    again = build_tower_modules("dlrm", [3, 5], 16, out_dim=4, seed=3, towers=[1])
    assert torch.equal(again[1].project.weight, mods[1].project.weight)
    assert not torch.equal(mods[0].project.weight, mods[1].project.weight)
    assert compression_ratio(list(build_tower_modules("none", [3, 5], 16).values())) == 1.0
    for kind in ("none", "dlrm", "dcn"):  # widths known without building (every rank needs all of them)
        for t, m in build_tower_modules(kind, [3, 5], 16, out_dim=4, c=2, p=1).items():
            assert tower_out_features(kind, [3, 5][t], 16, 4, c=2, p=1) == m.out_features
    with pytest.raises(ConfigError, match="no features"):
        build_tower_modules("dlrm", [3, 0], 16, out_dim=4)


def test_single_process_dmt_models():
    assign = TowerAssignment(ASSIGN[2])
    dense, jf, y = batches(9)[0]
    m = build_dmt_model(model_cfg(), tables(), 3, DMTConfig(compression=2), assignment=assign, num_hosts=2, seed=1)
    assert isinstance(m, DMTDLRM) and m.num_vectors == 8 and m.compression_ratio == 2.0
    # the tower outputs are each tower's module applied to its features' pooled embeddings
    with torch.no_grad():
        e = m.sparse_arch.embedding(jf).view(9, 8, N)
        want = torch.cat([m.sparse_arch.towers[t](e[:, [FEATURES.index(f) for f in fs]])
                          for t, fs in enumerate(ASSIGN[2])], 1)
        torch.testing.assert_close(m.sparse_arch(jf), want)
    assert m(dense, jf).shape == (9,)
    # pass-through: the plain DLRM, the same as build_model's with the same seed
    plain = build_dmt_model(model_cfg(), tables(), 3, DMTConfig(tower_module="none"), assignment=assign,
                            num_hosts=2, seed=1)
    assert type(plain).__name__ == "DLRM" and len(list(plain.tower_parameters())) == 0
    dcn = build_dmt_model(model_cfg("dcn"), tables(), 3, DMTConfig(compression=2, towers=4),
                          assignment=TowerAssignment(ASSIGN[4]), seed=1)
    assert dcn(dense, jf).shape == (9,) and len(list(dcn.tower_parameters())) > 0
    with pytest.raises(ConfigError, match="divide"):
        build_dmt_model(model_cfg(), tables(), 3, DMTConfig(compression=3), assignment=assign, num_hosts=2)
    with pytest.raises(ConfigError, match="2 towers"):
        build_dmt_model(model_cfg(), tables(), 3, DMTConfig(towers=4), assignment=assign)
    with pytest.raises(ConfigError, match="not a DMT"):
        build_dmt_model(model_cfg(), tables(), 3, arch="xdeepfm")


def test_towers_split_across_groups_rejects_shared_table():
    split = TowerAssignment([["f0", "f1", "f3", "f4"], ["f2", "f5", "f6", "f7"]])  # t1's features apart

    class FakeComm(_Loopback):
        def __init__(self):
            super().__init__()
            self.layout = TowerLayout(2, 1)

    mods = build_tower_modules("none", split.sizes, N)
    with pytest.raises(ConfigError, match="table 't1'"):
        TowerEmbedding(tables(), split, mods, FakeComm(), [m.out_features for m in mods.values()])
