"""Pipelined host-table training (EL-Rec section V) against an independent reference: sequential training of
the same model on the same batches with the host tables in a plain ``LocalEmbeddingBags`` of their own.

Bitwise equality (losses, host and device tables, dense weights, evaluation metrics, mid-run checkpoints)
at pipeline depths 1, 2 and 4; the same runs with the life-cycle cache off read stale rows and differ,
which shows the comparison can fail; the cache never holds more rows than the last k batches; two ranks.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.data.loader import ShardLoader
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import ConfigError, InputError
from embedscale.models import build_model, dense_parameters
from embedscale.pipeline import (
    HostParameterServer,
    LifeCycleCache,
    PipelinedEmbedding,
    Pipeline,
    PipelinedLoader,
    PipelineError,
    select_features,
)
from embedscale.plan.forms import TableForm
from embedscale.specs import ModelConfig, TableSpec, to_dict
from embedscale.train.checkpoint import load_checkpoint
from embedscale.train.trainer import Trainer, pipelined_trainer

BATCH = 256
SAMPLES = 12 * BATCH
LR = 0.05
MODEL = ModelConfig(arch="dlrm", embedding_dim=8, bottom_mlp=[16], top_mlp=[16])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a loaded 2-core machine OpenMP barriers with a descheduled thread cost
    milliseconds per tiny op. Restored after this module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- reference ---------------------------------------------------------------------------------------
class ConcatEmbedding(nn.Module):
    """Reference: plain embedding modules, each fed its own features, outputs in ``order``."""

    def __init__(self, modules, order):
        super().__init__()
        self.mods = nn.ModuleList(modules)
        self.feature_names = list(order)
        self.keys = [list(m.feature_names) for m in modules]
        cols, c = {}, 0
        for m in modules:
            for f, d in zip(m.feature_names, m.feature_dims):
                cols[f] = (c, d)
                c += d
        self.register_buffer("perm", torch.tensor([cols[f][0] + j for f in order for j in range(cols[f][1])]))

    def forward(self, jf):
        outs = [m(select_features(jf, k)) for m, k in zip(self.mods, self.keys)]
        return torch.cat(outs, 1).index_select(1, self.perm)


NUM_ROWS = [3000, 2500, 2000, 1500, 800, 50, 30, 20, 10, 5]  # the first five are host-placed
MULTI_HOT = {1, 3}  # features with 1 + Poisson(2) ids per sample


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Power-law (Zipf, s = 1.1) row ids, labels from a fixed random rule; some host features multi-hot,
    one host table mean-pooled. Written as a shard directory, read by ShardLoader as in a real run."""
    rng = np.random.default_rng(0)
    n = SAMPLES + 2 * BATCH
    d = tmp_path_factory.mktemp("pipeline_data")
    infos = [SparseFeatureInfo(f"C{t + 1}", r, t in MULTI_HOT) for t, r in enumerate(NUM_ROWS)]
    sparse = {}
    for t, info in enumerate(infos):
        p = 1.0 / np.arange(1, info.num_rows + 1) ** 1.1
        perm = rng.permutation(info.num_rows)  # hot rows scattered over the table
        lengths = 1 + rng.poisson(2, n) if info.multi_hot else np.ones(n, dtype=np.int64)
        values = perm[rng.choice(info.num_rows, int(lengths.sum()), p=p / p.sum())]
        sparse[info.name] = (values, lengths) if info.multi_hot else values
    dense = rng.random((n, 13), dtype=np.float32)
    labels = (dense[:, 0] + 0.3 * (sparse["C1"] % 3 == 0) + 0.2 * rng.random(n) > 0.8).astype(np.int8)
    with ShardWriter(d, [f"I{i + 1}" for i in range(13)], infos, shard_rows=1000) as w:
        w.write(labels, dense, sparse)
    specs = [TableSpec(f.name, f.num_rows, 8, pooling="mean" if t == 3 else "sum") for t, f in enumerate(infos)]
    return d, specs, {f.name for f in infos[:5]}


def split(specs, host_names):
    """``(host tables, device tables)``: the tables ``host_names`` names are the ones whose form is host."""
    return [s for s in specs if s.name in host_names], [s for s in specs if s.name not in host_names]


def make_model(specs, host_names, kind: str, optimizer: str = "rowwise_adagrad", server_group=None):
    host, dev = split(specs, host_names)
    dev_modules = [LocalEmbeddingBags(dev, optimizer=optimizer, lr=LR, seed=1)] if dev else []
    if kind == "ref":
        emb = ConcatEmbedding(dev_modules + [LocalEmbeddingBags(host, optimizer=optimizer, lr=LR, seed=2)],
                              [f for s in specs for f in s.features])
    else:
        emb = PipelinedEmbedding(specs, HostParameterServer(host, optimizer=optimizer, lr=LR, seed=2,
                                                            share_group=server_group, timeout_s=60), dev_modules)
    torch.manual_seed(0)
    model = build_model(MODEL, specs, 13, embedding=emb)
    return model, torch.optim.Adagrad(list(dense_parameters(model)), lr=LR), emb


def host_weights(emb, specs, host_names) -> dict[str, torch.Tensor]:
    host, _ = split(specs, host_names)
    if isinstance(emb, ConcatEmbedding):
        return {s.name: emb.mods[-1].table_weight(s.name).clone() for s in host}
    st = emb.host_state()
    return {s.name: st[f"{s.name}.weight"] for s in host}


def fit(dataset, tmp_path: Path, kind: str, depth: int = 1, use_cache: bool = True):
    """Trainer.fit (evaluation every 4 steps, checkpoint every 5) of the reference or the pipelined model."""
    d, specs, host = dataset
    model, opt, emb = make_model(specs, host, kind)
    train = ShardLoader(d, BATCH, stop=SAMPLES)
    evl = ShardLoader(d, BATCH, start=SAMPLES)
    run_dir = tmp_path / f"{kind}{depth}{use_cache}"
    kw = dict(eval_every=4, checkpoint_every=5, log_every=0, progress=False)
    if kind == "ref":
        tr = Trainer(model, opt, train, evl, run_dir, **kw)
    else:
        tr = pipelined_trainer(model, opt, train, evl, run_dir, pipeline_depth=depth, use_cache=use_cache, **kw)
    tr.fit()
    ck = load_checkpoint(run_dir / "checkpoints" / "step-00000005")
    # the reference holds the host tables as device tables
    mid = {n: e["weight"] for n, e in ck["tables"].items() if n in host}
    mid.update({k[:-len(".weight")]: v for k, v in ck["host"].items() if k.endswith(".weight")})
    assert sorted(mid) == sorted(host)
    evals = [(r.step, r.eval_logloss, r.eval_auc) for r in tr.rows if r.eval_logloss == r.eval_logloss]
    dense = torch.cat([p.detach().flatten() for p in dense_parameters(model)])
    dev = (emb.mods[0] if kind == "ref" else emb.device_modules[0]).weights.clone()
    return {"losses": tr.losses, "host": host_weights(emb, specs, host), "dense": dense, "device": dev, "mid": mid,
            "evals": evals, "stats": getattr(tr.train_loader, "last_stats", {})}


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    return fit(dataset, tmp_path_factory.mktemp("ref"), "ref")


def assert_same(a, b):
    assert a["losses"] == b["losses"]
    for name in b["host"]:
        assert torch.equal(a["host"][name], b["host"][name]), name
        assert torch.equal(a["mid"][name], b["mid"][name]), f"{name} in the step-5 checkpoint"
    assert torch.equal(a["dense"], b["dense"])
    assert torch.equal(a["device"], b["device"])
    assert a["evals"] == b["evals"] and len(a["evals"]) == 3  # steps 4, 8 and 12 (the final one)


# -- the bars ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_pipelined_training_is_bitwise_sequential(dataset, reference, tmp_path, depth):
    ours = fit(dataset, tmp_path, "pipe", depth)
    assert_same(ours, reference)
    if depth > 1:  # stale rows were there and the cache patched them
        assert ours["stats"]["patched_rows"] > 0 and ours["stats"]["cache_peak_rows"] > 0


@pytest.mark.parametrize("depth", [2, 4])
def test_without_the_cache_staleness_changes_the_result(dataset, reference, tmp_path, depth):
    ours = fit(dataset, tmp_path, "pipe", depth, use_cache=False)
    assert ours["losses"][0] == reference["losses"][0]  # batch 0 cannot be stale
    assert ours["losses"] != reference["losses"]
    assert any(not torch.equal(ours["host"][n], reference["host"][n]) for n in reference["host"])


def test_cache_holds_at_most_the_rows_of_the_last_k_batches(dataset):
    d, specs, host = dataset
    depth = 3
    model, opt, emb = make_model(specs, host, "pipe")
    loader = PipelinedLoader(ShardLoader(d, BATCH, stop=SAMPLES, prefetch=0), emb, depth)
    lossf = nn.BCEWithLogitsLoss()
    per_batch, held = [], []
    for b in loader:
        loss = lossf(model(b.dense, b.sparse), b.labels)
        opt.zero_grad()
        loss.backward()
        per_batch.append(sum(hr.rows.numel() for hr in emb.server.prepare(b.sparse)))
        held.append(emb.cache.num_rows)
    bounds = [sum(per_batch[max(0, t - depth + 1):t + 1]) for t in range(len(per_batch))]
    assert all(h <= b for h, b in zip(held, bounds)), list(zip(held, bounds))
    assert held[-1] > per_batch[-1]  # it does hold more than one batch's rows at depth 3
    # the peak is taken at insertion (the patcher thread may evict right after, before `held` is read)
    assert max(held) <= loader.last_stats["cache_peak_rows"] <= max(bounds)
    assert emb.cache.num_rows == 0  # the drained pipeline leaves the server current and the cache empty


@pytest.mark.parametrize("depth", [2, 3])
def test_lookahead_peeks_the_next_batch_and_trains_the_same(dataset, depth):
    """With lookahead the server takes a batch from the loader before it waits for older gradients; peek()
    gives the batch the pass hands out next (the same object, with the device features its lookup gets), None
    at the end, and training is bit for bit what it is without lookahead."""
    d, specs, host = dataset
    runs = {}
    for lookahead in (False, True):
        model, opt, emb = make_model(specs, host, "pipe")
        loader = PipelinedLoader(ShardLoader(d, BATCH, stop=SAMPLES, prefetch=0), emb, depth, lookahead=lookahead)
        lossf = nn.BCEWithLogitsLoss()
        losses, peeked = [], []
        for b in loader:
            if peeked:
                assert b is peeked[-1], "peek() promised another batch"
                assert emb._pending.device_features is want_dev  # the lookup takes the features peek selected
            if lookahead:
                nxt = loader.peek()
                assert loader.peek() is nxt  # peeking twice: the same batch
                peeked.append(nxt)
                want_dev = loader.device_features(nxt) if nxt is not None else None
            loss = lossf(model(b.dense, b.sparse), b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert not lookahead or (peeked[-1] is None and len(peeked) == len(losses) > 3)
        runs[lookahead] = (losses, host_weights(emb, specs, host), emb.device_modules[0].weights.clone())
    assert runs[True][0] == runs[False][0]
    for name, w in runs[False][1].items():
        assert torch.equal(runs[True][1][name], w), name
    assert torch.equal(runs[True][2], runs[False][2])


def test_lookahead_needs_depth_two(dataset):
    d, specs, host = dataset
    _, _, emb = make_model(specs, host, "pipe")
    with pytest.raises(ConfigError, match="lookahead needs depth >= 2"):
        PipelinedLoader(ShardLoader(d, BATCH, stop=SAMPLES, prefetch=0), emb, 1, lookahead=True)
    with pytest.raises(ConfigError, match="lookahead needs depth >= 2"):
        Pipeline(emb, [], 1, lookahead=True)
    with pytest.raises(PipelineError, match="peek needs"):
        PipelinedLoader(ShardLoader(d, BATCH, stop=SAMPLES, prefetch=0), emb, 2).peek()


def _pooled_batches(seed: int, n: int, B: int = 6):
    """Hand-made multi-hot batches with per-sample weights, some empty bags, keys in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        per_key = {}
        for k, rows in [("user", 40), ("a", 30), ("b", 30), ("x", 5), ("w", 25)]:
            lens = torch.randint(0, 4, (B,), generator=g)
            per_key[k] = (torch.randint(0, rows // 3, (int(lens.sum()),), generator=g), lens)
        keys = ["w", "x", "b", "user", "a"]
        values = torch.cat([per_key[k][0] for k in keys])
        lengths = torch.cat([per_key[k][1] for k in keys])
        weights = torch.rand(values.numel(), generator=g) + 0.5
        out.append(Batch(torch.zeros(B, 1), JaggedFeatures(keys, values, lengths, weights), torch.zeros(B)))
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_module_matches_plain_lookups_multi_dim_weighted(optimizer):
    """Two dims, a table read by two features, mean pooling, per-sample weights, interleaved host/device."""
    tables = [TableSpec("user", 40, 4), TableSpec("x", 5, 4),
              TableSpec("item", 30, 6, features=["a", "b"], pooling="mean"), TableSpec("w", 25, 4)]
    host, dev = split(tables, {"user", "item", "w"})
    order = [f for t in tables for f in t.features]
    ref = ConcatEmbedding([LocalEmbeddingBags(dev, optimizer=optimizer, lr=0.3, seed=3),
                           LocalEmbeddingBags(host, optimizer=optimizer, lr=0.3, seed=4)], order)
    ours = PipelinedEmbedding(tables, HostParameterServer(host, optimizer=optimizer, lr=0.3, seed=4),
                              [LocalEmbeddingBags(dev, optimizer=optimizer, lr=0.3, seed=3)])
    batches = _pooled_batches(0, 10)
    proj = torch.randn(ours.output_dim, generator=torch.Generator().manual_seed(1))
    for b in batches:
        out = ref(b.sparse)
        (out.sin() * proj).sum().backward()
    got = []
    for b in PipelinedLoader(batches, ours, depth=3):
        out = ours(b.sparse)
        got.append(out.detach())
        (out.sin() * proj).sum().backward()
    for t in host:
        assert torch.equal(ours.host_state()[f"{t.name}.weight"], ref.mods[1].table_weight(t.name)), t.name
    assert torch.equal(ours.device_modules[0].weights, ref.mods[0].weights)
    # and the lookups themselves (forward, no grad) agree after training
    assert torch.equal(ours(batches[0].sparse), ref(batches[0].sparse))


def test_host_tables_compose_with_tt_tables():
    """EL-Rec V with III: host tables pipelined beside a device-side MixedEmbedding holding a TT table (its
    cores trained by their own optimizer in backward) equal the sequential reference, where the same
    MixedEmbedding sits beside the host tables in a plain LocalEmbeddingBags."""
    from embedscale.embedding.mixed import MixedEmbedding

    tables = [TableSpec("user", 40, 4), TableSpec("x", 5, 4),
              TableSpec("item", 30, 4, features=["a", "b"], pooling="mean"), TableSpec("w", 2000, 4)]
    host, dev = split(tables, {"user", "item"})
    order = [f for t in tables for f in t.features]

    def tt_side():  # w: a TT table of rank 4
        return MixedEmbedding(dev, tt={"w": 4}, optimizer="rowwise_adagrad", lr=0.3, seed=3)

    ref = ConcatEmbedding([tt_side(), LocalEmbeddingBags(host, optimizer="rowwise_adagrad", lr=0.3, seed=4)], order)
    ours = PipelinedEmbedding(tables, HostParameterServer(host, optimizer="rowwise_adagrad", lr=0.3, seed=4),
                              [tt_side()])
    batches = _pooled_batches(1, 10)
    proj = torch.randn(ours.output_dim, generator=torch.Generator().manual_seed(2))
    want = []
    for b in batches:
        out = ref(b.sparse)
        want.append(out.detach())
        (out.sin() * proj).sum().backward()
    got = []
    loader = PipelinedLoader(batches, ours, depth=3)
    for b in loader:
        out = ours(b.sparse)
        got.append(out.detach())
        (out.sin() * proj).sum().backward()
    assert loader.last_stats["patched_rows"] > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for t in host:
        assert torch.equal(ours.host_state()[f"{t.name}.weight"], ref.mods[1].table_weight(t.name)), t.name
    cores = [ours.device_modules[0].tt["w"].state_dict(), ref.mods[0].tt["w"].state_dict(),
             tt_side().tt["w"].state_dict()]  # ours, reference, untrained
    assert cores[0].keys() == cores[1].keys() and any(k.startswith("core") for k in cores[0])
    assert all(torch.equal(cores[0][k], cores[1][k]) for k in cores[0])
    assert not all(torch.equal(cores[0][k], cores[2][k]) for k in cores[0] if k.startswith("core"))


# -- two ranks ---------------------------------------------------------------------------------------
def _rank_worker(rank, world, data_dir, specs_d, host_names):
    """Data-parallel training on this rank's slices: synchronous, then pipelined at depths 2 and 3 (with and
    without the cache), each with one server per rank and with one server shared by the local ranks
    (``S``); returns losses and final host/dense weights of each. Every table is host-placed:
    device-side modules keep their own data-parallel synchronisation (not this module's business)."""
    import torch.distributed as dist

    from embedscale.pipeline.shared import local_group

    specs = [TableSpec(**s) for s in specs_d]
    group = local_group()
    out = {}
    for depth, cache, shared in [(0, True, ""), (2, True, ""), (3, True, ""), (2, False, ""), (0, True, "S"),
                                 (2, True, "S"), (4, True, "S"), (2, False, "S")]:
        model, opt, emb = make_model(specs, set(host_names), "pipe", server_group=group if shared else None)
        if shared:  # one copy of the tables on the machine: a write by one rank is seen by the other
            w = emb.server.store.weights
            orig = w[0].clone()
            dist.barrier()
            if rank == 0:
                w[0] = 12345.0
            dist.barrier()
            out[f"peer_sees_write{depth}{cache}"] = float(w[0])
            dist.barrier()
            if rank == 0:
                w[0] = orig
            dist.barrier()
        params = list(dense_parameters(model))
        loader = ShardLoader(data_dir, BATCH, stop=SAMPLES // 2, rank=rank, world_size=world, prefetch=0)
        it = loader if depth == 0 else PipelinedLoader(loader, emb, depth, use_cache=cache)
        losses = []
        for b in it:
            logits = model(b.dense, b.sparse)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, b.labels, reduction="sum") / b.global_size
            opt.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
            opt.step()
            losses.append(float(loss))
        hw = host_weights(emb, specs, set(host_names))
        out[f"{depth}{cache}{shared}"] = {"losses": torch.tensor(losses),
                                  "host": torch.cat([w.flatten() for w in hw.values()]),
                                  "dense": torch.cat([p.detach().flatten() for p in params])}
    return out


def test_two_ranks_pipelined_equals_sequential(dataset):
    from embedscale.train.launch import spawn_local

    d, specs, _ = dataset
    host = [s.name for s in specs]  # every table host-placed
    res = spawn_local(_rank_worker, 2, str(d), [to_dict(s) for s in specs], host, timeout_s=120)
    seq = res[0]["0True"]
    for key in ["0True", "2True", "3True", "2False"]:
        r0, r1 = res[0][key], res[1][key]
        assert torch.equal(r0["host"], r1["host"]) and torch.equal(r0["dense"], r1["dense"]), key  # replicas agree
    for key in ["2True", "3True"]:
        assert torch.equal(res[0][key]["losses"], seq["losses"]) and torch.equal(res[1][key]["losses"],
                                                                                  res[1]["0True"]["losses"])
        assert torch.equal(res[0][key]["host"], seq["host"]) and torch.equal(res[0][key]["dense"], seq["dense"])
    assert not torch.equal(res[0]["2False"]["host"], seq["host"])
    # one server shared by the local ranks: the same bits as one replica per rank, sequential or pipelined;
    # without the cache it reads stale rows too
    for key in ["0TrueS", "2TrueS", "4TrueS"]:
        for r in (0, 1):
            assert torch.equal(res[r][key]["losses"], res[r]["0True"]["losses"]), key
            assert torch.equal(res[r][key]["host"], seq["host"]) and torch.equal(res[r][key]["dense"], seq["dense"])
    assert not torch.equal(res[0]["2FalseS"]["host"], seq["host"])
    for depth in ("0True", "2True", "4True", "2False"):
        assert res[1][f"peer_sees_write{depth}"] == res[0][f"peer_sees_write{depth}"] == 12345.0  # shared storage
    assert not list(Path("/dev/shm").glob("embedscale-ps-*")) if Path("/dev/shm").is_dir() else True
    # data parallelism itself: the same math as one process on the global batches, up to rounding
    model, opt, emb = make_model(specs, host, "ref")
    lossf = nn.BCEWithLogitsLoss()
    for b in ShardLoader(d, BATCH, stop=SAMPLES // 2, prefetch=0):
        loss = lossf(model(b.dense, b.sparse), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    single = torch.cat([w.flatten() for w in host_weights(emb, specs, host).values()])
    assert torch.allclose(seq["host"], single, atol=1e-4)
    assert not torch.equal(single, torch.cat([w.flatten() for w in host_weights(make_model(specs, host, "ref")[2],
                                                                                 specs, host).values()]))


# -- errors and plumbing -----------------------------------------------------------------------------
def test_bad_host_id_is_named_from_the_server_thread():
    tables = [TableSpec("small", 10, 4), TableSpec("big", 100, 4)]
    emb = PipelinedEmbedding.from_tables(tables, {"big": TableForm("host")}, optimizer="sgd", seed=0)
    good = JaggedFeatures.from_dense(["small", "big"], torch.tensor([[1, 7], [2, 3]]))
    bad = JaggedFeatures.from_dense(["small", "big"], torch.tensor([[1, 7], [2, 100]]))
    batches = [Batch(torch.zeros(2, 1), jf, torch.zeros(2)) for jf in (good, bad)]
    seen = 0
    with pytest.raises(InputError, match=r"feature 'big' \(host table 'big', 100 rows\): row id 100 at sample 1"):
        for b in PipelinedLoader(batches, emb, depth=2):
            emb(b.sparse).sum().backward()
            seen += 1
    assert seen == 1 and not emb.pipelined
    with pytest.raises(InputError, match="row id 100"):
        emb(bad)  # the synchronous path checks too


def test_misuse_is_an_error_not_a_hang():
    tables = [TableSpec("small", 10, 4), TableSpec("big", 100, 4)]
    emb = PipelinedEmbedding.from_tables(tables, {"big": TableForm("host")}, optimizer="sgd", seed=0)
    jf = JaggedFeatures.from_dense(["small", "big"], torch.tensor([[1, 7], [2, 3]]))
    batches = [Batch(torch.zeros(2, 1), jf, torch.zeros(2)) for _ in range(3)]
    with pytest.raises(PipelineError, match="did not prefetch"):
        for b in PipelinedLoader(batches, emb, depth=2):
            emb(JaggedFeatures(jf.keys, jf.values.clone(), jf.lengths)).sum().backward()
    with pytest.raises(PipelineError, match="backward never ran"):
        for b in PipelinedLoader(batches, emb, depth=2):
            emb(b.sparse)
    with pytest.raises(ConfigError, match="depth"):
        PipelinedLoader(batches, emb, depth=0)
    with pytest.raises(ConfigError, match=r"tables \['small'\] are \['tt'\].*pass device_modules"):
        PipelinedEmbedding.from_tables(tables, {"big": TableForm("host"), "small": TableForm("tt", tt_rank=2)})
    with pytest.raises(ConfigError, match="produced by device module 0 and the host parameter server"):
        PipelinedEmbedding(tables, HostParameterServer(tables[1:]), [LocalEmbeddingBags(tables)])
    with pytest.raises(ConfigError, match=r"features \['small'\] are produced by no device module"):
        PipelinedEmbedding(tables, HostParameterServer(tables[1:]), [])


def test_mid_run_checkpoint_while_gradients_are_pending(dataset):
    """A state_dict taken while the server still owes gradients equals sequential training's tables then;
    it loads back; breaking out of the loop applies every gradient received."""
    d, specs, host = dataset
    batches = list(ShardLoader(d, BATCH, stop=SAMPLES, prefetch=0))
    gate = threading.Event()

    def gated():  # the server cannot read batch 5, so it cannot pull the gradients of batches 3.. (depth 3)
        for i, b in enumerate(batches):
            if i == 5:
                assert gate.wait(60)
            yield b

    model, opt, emb = make_model(specs, host, "pipe")
    ref_model, ref_opt, ref_emb = make_model(specs, host, "ref")
    lossf = nn.BCEWithLogitsLoss()
    loader = PipelinedLoader(gated(), emb, depth=3)
    for step, b in enumerate(loader):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            loss = lossf(m(b.dense, b.sparse), b.labels)
            o.zero_grad()
            loss.backward()
            o.step()
        if step == 4:
            assert emb.server.batches_applied <= 3  # gradients of batches 3 and 4 at least are pending
            mid = {k: v.clone() for k, v in emb.state_dict().items()}
            with torch.no_grad():  # an evaluation lookup now reads the server and patches from the cache
                model.eval(), ref_model.eval()
                assert torch.equal(model(b.dense, b.sparse), ref_model(b.dense, b.sparse))
                model.train(), ref_model.train()
            for name, w in host_weights(ref_emb, specs, host).items():
                assert torch.equal(mid[f"host.{name}.weight"], w), name
                assert torch.equal(mid[f"host.{name}.momentum"], ref_emb.mods[-1].table_momentum(name)), name
            gate.set()
        if step == 6:
            break  # prefetched-but-unused batches are dropped; every gradient received is applied
    assert loader.last_stats["batches"] == 7 and not emb.pipelined and emb.server.batches_applied == 7
    end = emb.state_dict()
    for name, w in host_weights(ref_emb, specs, host).items():
        assert torch.equal(end[f"host.{name}.weight"], w), name
    fresh = make_model(specs, host, "pipe")[2]
    fresh.load_state_dict(mid)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in mid.items())


def test_life_cycle_counters():
    cache = LifeCycleCache([2], with_momentum=True)
    cache.insert(0, [torch.tensor([1, 4])], [torch.full((2, 2), 1.0)], [torch.tensor([1.0, 1.0])], life=2)
    cache.insert(1, [torch.tensor([4, 6])], [torch.full((2, 2), 2.0)], [torch.tensor([2.0, 2.0])], life=3)
    w, m = torch.zeros(4, 2), torch.zeros(4)
    assert cache.patch(0, torch.tensor([0, 1, 4, 6]), w, m) == 4  # row 4 from both entries
    assert w[:, 0].tolist() == [0.0, 1.0, 2.0, 2.0] and m.tolist() == [0.0, 1.0, 2.0, 2.0]  # newest copy wins
    w2 = torch.zeros(4, 2)  # the same with positions planned ahead (as the server does for one rank)
    plans = {0: (torch.tensor([1, 2]), torch.tensor([0, 1])), 1: (torch.tensor([2, 3]), torch.tensor([0, 1]))}
    assert cache.patch(0, torch.tensor([0, 1, 4, 6]), w2, None, plans) == 4 and torch.equal(w, w2)
    assert cache.advance(1) == 0 and cache.advance(2) == 2  # batch 0's rows: two pulls
    w = torch.zeros(2, 2)
    assert cache.patch(0, torch.tensor([1, 4]), w) == 1 and w[:, 0].tolist() == [0.0, 2.0]
    assert cache.advance(3) == 2 and cache.num_rows == 0 and cache.peak_rows == 4
