"""Managed tables in training against independent references.

* One process: ``workflow.train`` with ``model.managed`` equals the same loop (``Trainer``, ``fit``) over an
  ordinary table whose batches were mapped by the plain-Python dict implementation of the rules
  (``test_managed_ids.Reference``), the rows it reports reset to their initial values
  (``embedding.init.uniform_rows``) with zero Adagrad state: same losses, same rows, same mapping.
* 2 ranks (a plan with replicated rows of a managed table; 3 mapping shards, rank 0 hosting shards 0 and 2)
  equal one process (losses, rows, dense state within 1e-5, eval AUC; the mapping and counters equal); the id
  exchange's bytes match a count by the reference's hash; the 2-rank run's delta checkpoint of step 6 resumed
  on 3 ranks (one shard each) and in one process (all shards) continues as the uninterrupted run (each rank
  file holds its shards; a restore re-hosts them).
* A resume after a stop equals the uninterrupted run.
* Bad managed configs are errors naming table and key; the loader accepts any raw id of a managed table's
  feature and still rejects out-of-range ids of an unmanaged one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from embedscale import assemble, workflow
from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.data.drift_stream import DriftConfig, DriftingStream, write_drift_dataset
from embedscale.data.loader import ShardLoader
from embedscale.embedding.init import uniform_rows
from embedscale.data.shards import SparseFeatureInfo
from embedscale.data.stream import StreamWriter
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.managed import shard_bounds
from embedscale.embedding.managed_lookup import ManagedLookup, managed_of
from embedscale.errors import ConfigError, InputError
from embedscale.plan.plan import Plan
from embedscale.specs import ManagedConfig, RunConfig, TableSpec, from_dict, load_config, to_dict
from embedscale.train.checkpoint import load_checkpoint, step_dir
from embedscale.train.launch import spawn_local
from embedscale.train.loop import LoopConfig
from embedscale.train.trainer import Trainer

from test_managed_ids import Reference, ref_shard  # the dict implementation of embedding/managed.py's rules

ROWS = 12
TABLES = ("user", "item")
BATCH = 40
STEPS = 8
MANAGED = {"admit_after": 2, "policy": "lfu", "shards": 3}  # 3 mapping shards of 3-4 rows (ROWS - 1 = 11)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drift")
    stream = DriftingStream(DriftConfig(tables=TABLES, initial_ids=120, new_ids_per_step=4, hot_ids=10,
                                        hot_share=0.7, rotate_every=3, batch_size=BATCH, num_dense=2), seed=3)
    write_drift_dataset(stream, d, 10, num_rows=ROWS, shard_rows=130)  # 400 rows: 320 train, 80 eval
    return d


def config(tmp_path, data_dir, managed=MANAGED, **train) -> RunConfig:
    return from_dict(RunConfig, {
        "name": "m", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8], "managed": managed},
        "train": {"batch_size": BATCH, "max_steps": STEPS, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                  "lr_warmup_steps": 0, "prefetch": 0, "dropout": 0.0, **train},
        "dist": {"timeout_s": 300},
    })


def state(run_dir):
    ck = load_checkpoint(run_dir)
    w = torch.cat([ck["tables"][f"t_{t}"]["weight"] for t in TABLES])
    return ck["losses"], w, ck["dense"], ck["managed"]


def mapping_of(managed_state: dict, table: str) -> dict[int, int]:
    """id -> row of a checkpoint's mapping (every rank file's shards merged), read shard by shard."""
    S = int(managed_state[f"t_{table}.config"][5])
    bounds = shard_bounds(ROWS, S)
    out = {}
    for s in range(S):
        used = managed_state[f"t_{table}.{s}.row_used"]
        rows = torch.nonzero(used).squeeze(1)
        out.update(zip(managed_state[f"t_{table}.{s}.row_id"][rows].tolist(), (rows + bounds[s]).tolist()))
    return out


def counters_of(managed_state: dict, table: str) -> dict[str, int]:
    S = int(managed_state[f"t_{table}.config"][5])
    c = sum(managed_state[f"t_{table}.{s}.counters"] for s in range(S))
    return dict(zip(("lookups", "hits", "collisions", "admissions", "evictions", "pending_dropped"), c.tolist()))


# -- the reference: an ordinary table, batches mapped by the dict implementation ---------------------------
class MappedLoader:
    """A ShardLoader's batches with every sparse feature's raw ids mapped by ``Reference`` (``assign`` while
    training, which also resets the rows it reports in ``model``; the mapping as it stands for evaluation)."""

    def __init__(self, inner: ShardLoader, refs: dict, model, tables: list[TableSpec], seed: int, train: bool):
        self.inner, self.refs, self.model, self.tables, self.seed, self.train = inner, refs, model, tables, seed, train
        self.admissions = 0

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch, skip_batches=0):
        self.inner.set_epoch(epoch, skip_batches)

    def __iter__(self):
        emb = self.model.sparse_arch.embedding
        for b in self.inner:
            vals = b.sparse.to_dict()
            out = []
            for i, key in enumerate(b.sparse.keys):
                ids = vals[key][0].tolist()
                ref = self.refs[key]
                if self.train:
                    rows, admitted, evicted = ref.assign(ids)
                    reset = sorted({r for _, r in admitted + evicted})
                    self.admissions += len(admitted)
                    if reset:
                        name = f"t_{key}"
                        t = [s.name for s in self.tables].index(name)
                        with torch.no_grad():
                            emb.table_weight(name)[reset] = torch.from_numpy(
                                uniform_rows(self.seed, t, np.array(reset), 4, ROWS))
                            emb.table_momentum(name)[reset] = 0
                else:
                    rows = [ref.row_of.get(x, 0) for x in ids]
                out.append(torch.tensor(rows, dtype=torch.int64))
            sparse = JaggedFeatures(b.sparse.keys, torch.cat(out), b.sparse.lengths)
            yield Batch(b.dense, sparse, b.labels, weights=b.weights)


def reference_run(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir, managed={})  # an ordinary model: the same tables, the same initial rows
    data = assemble.prepare_data(cfg, progress=False)
    tables = assemble.tables_for(cfg, data.manifest)
    model, opt = assemble.build(cfg, tables, data.manifest.num_dense, torch.device("cpu"), validate=True)
    raw = frozenset(TABLES)
    refs = {t: Reference(ROWS, MANAGED["admit_after"], MANAGED["policy"], shards=MANAGED["shards"]) for t in TABLES}
    train = MappedLoader(ShardLoader(data.train.directory, BATCH, stop=data.train.stop, prefetch=0, raw_ids=raw),
                         refs, model, tables, cfg.train.seed, True)
    ev = MappedLoader(ShardLoader(data.eval.directory, 8192, start=data.eval.start, stop=data.eval.stop, prefetch=0,
                                  raw_ids=raw), refs, model, tables, cfg.train.seed, False)
    tr = Trainer(model, opt, train, ev, tmp_path / "reference", progress=False, loop=LoopConfig.from_train(cfg.train))
    summary = tr.fit()
    w = torch.cat([model.sparse_arch.embedding.table_weight(f"t_{t}").detach().clone() for t in TABLES])
    return tr.losses, w, summary, refs, train.admissions


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_dir):
    """The managed single-process run (checkpoints every 4 steps), trained once for the module."""
    tmp = tmp_path_factory.mktemp("single")
    summary = workflow.train(config(tmp, data_dir, checkpoint_every=4), tmp / "run", resume=False, progress=False)
    return tmp / "run", summary


def test_single_process_equals_dict_reference(tmp_path, data_dir, single):
    run_dir, summary = single
    losses, w, _, managed = state(run_dir)
    ref_losses, ref_w, ref_summary, refs, admissions = reference_run(tmp_path, data_dir)
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)
    for t in TABLES:
        assert mapping_of(managed, t) == refs[t].row_of
        counters = counters_of(managed, t)
        assert counters == refs[t].counters
        assert counters["evictions"] > 0  # the run did evict (the rows are fewer than the hot ids + new ones)
    assert admissions > 2 * (ROWS - 1)
    assert summary["eval_auc"] == pytest.approx(ref_summary["eval_auc"], abs=1e-9)  # eval maps with rows_of


def test_resume_after_a_stop_equals_the_uninterrupted_run(tmp_path, data_dir, single):
    run_dir, _ = single
    want = state(run_dir)
    rd = tmp_path / "stopped"
    workflow.train(config(tmp_path, data_dir, max_steps=3), rd, resume=False, progress=False)
    got_mid = load_checkpoint(rd)["managed"]
    assert got_mid and int(got_mid["t_user.step"]) == 3 and "t_user.2.row_id" in got_mid
    workflow.train(config(tmp_path, data_dir), rd, resume=True, progress=False)
    losses, w, dense, managed = state(rd)
    np.testing.assert_allclose(losses, want[0], rtol=0, atol=0)
    torch.testing.assert_close(w, want[1], rtol=0, atol=0)
    for k, v in want[3].items():
        assert torch.equal(managed[k], v), k


# -- 2 ranks ----------------------------------------------------------------------------------------
def replicated_plan(world: int) -> Plan:
    """Table t_user: rows 0-3 replicated on every rank (the default row among them), the rest split; t_item
    split row-wise. Resets then hit replicas and owned rows on both ranks."""
    ts = [TableSpec(f"t_{t}", ROWS, 4, features=[t]) for t in TABLES]
    pt, ps, pe, own, hold = [0], [0], [4], [0], [np.ones(world, bool)]
    for t in range(2):
        lo = 4 if t == 0 else 0
        cuts = np.linspace(lo, ROWS, world + 1).astype(int)
        for r in range(world):
            h = np.zeros(world, bool)
            h[(r + t) % world] = True
            pt.append(t), ps.append(cuts[r]), pe.append(cuts[r + 1]), own.append((r + t) % world), hold.append(h)
    return Plan(ts, world, [None, None], pt, ps, pe, owner=own, holders=np.array(hold), meta={"strategy": "hand"})


def _rank(rank, world, cfg_dict, run_dir, resume_from=None):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False, resume_from=resume_from)
    return True


def _crossing_ids(data_dir, world: int) -> int:
    """Over the first STEPS batches: the ids that travel to another rank (each rank's ids whose mapping shard
    another rank hosts), by the dict reference's hash."""
    src = ShardLoader(data_dir, BATCH, stop=STEPS * BATCH, prefetch=0, raw_ids=set(TABLES))
    n = 0
    for b in src:
        vals = b.sparse.to_dict()
        for t in TABLES:
            ids = vals[t][0].tolist()
            for r in range(world):
                n += sum(ref_shard(x, MANAGED["shards"]) % world != r
                         for x in ids[r * BATCH // world:(r + 1) * BATCH // world])
    return n


def test_two_ranks_equal_one_process_and_resume_on_other_world_sizes(tmp_path, data_dir, single):
    """2 ranks (rows of t_user replicated) assign, train and checkpoint as one process; their delta checkpoint
    of step 6 resumes on 3 ranks and in one process and continues as the uninterrupted run (the mapping
    shards re-hosted)."""
    run_dir, _ = single
    ref_losses, ref_w, ref_dense, ref_managed = state(run_dir)
    plan_dir = tmp_path / "plan"
    replicated_plan(2).save(plan_dir)
    cfg = config(tmp_path, data_dir, checkpoint_every=2, checkpoint_full_every=4)
    cfg.dist.plan = str(plan_dir)
    spawn_local(_rank, 2, to_dict(cfg), str(tmp_path / "two"), timeout_s=600)
    assert load_checkpoint(tmp_path / "two")["manifest"]["world_size"] == 2
    assert "delta" in load_checkpoint(step_dir(tmp_path / "two", 6))["manifest"]
    # its rank files hold the id mappings that changed since the base (step 4), not whole mappings
    from embedscale.train.checkpoint import MANAGED, read_shard
    for r in range(2):
        own = read_shard(step_dir(tmp_path / "two", 6) / f"rank-{r:05d}.pt")[MANAGED]
        assert {int(own[f"t_{t}.base_step"]) for t in TABLES} == {4}, sorted(own)[:8]
        assert not any(k.endswith(".row_id") and ".d." not in k for k in own)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    # summed over the ranks: the ids hosted by the other rank (int64), their rows back (int32: 24 rows in all)
    # plus the global ids of the reset rows the receiver holds, and metadata: per rank and step the [2, 2]
    # counts (one row of 2 int64 to the other rank) and the return's size (one int64)
    crossing = _crossing_ids(data_dir, 2)
    got = {k: v * STEPS for k, v in summary["managed_exchange_bytes"].items()}  # totals over the run
    assert got["ids"] == pytest.approx(8 * crossing) and got["meta"] == pytest.approx(2 * (8 * 2 + 8) * STEPS)
    resets = (got["rows"] - 4 * crossing) / 4
    assert resets == int(resets) and 0 < resets <= 2 * ROWS * STEPS  # at most every row of both tables a step
    assert summary["managed_exchange_bytes_per_step"] * STEPS == pytest.approx(got["ids"] + got["rows"] + got["meta"])
    assert summary["managed"] == {f"t_{t}": counters_of(ref_managed, t) for t in TABLES}
    assert summary["eval_auc"] == pytest.approx(single[1]["eval_auc"], abs=1e-6)  # eval maps through the hosts too
    losses, w, dense, managed = state(tmp_path / "two")
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-5)
    for k, v in ref_dense.items():
        torch.testing.assert_close(dense[k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert set(managed) == set(ref_managed)
    for k, v in ref_managed.items():
        assert torch.equal(managed[k], v), k
    ck6 = load_checkpoint(step_dir(tmp_path / "two", 6))["managed"]
    assert {k.split(".")[1] for k in ck6 if k.startswith("t_user.") and k.count(".") == 2} == {"0", "1", "2"}
    # the delta of step 6 resumed on 3 ranks (each hosting one mapping shard) continues as the uninterrupted run
    replicated_plan(3).save(tmp_path / "plan3")
    cfg3 = config(tmp_path, data_dir)
    cfg3.dist.plan = str(tmp_path / "plan3")
    spawn_local(_rank, 3, to_dict(cfg3), str(tmp_path / "three"), str(step_dir(tmp_path / "two", 6)), timeout_s=600)
    losses, w, dense, managed = state(tmp_path / "three")
    assert load_checkpoint(tmp_path / "three")["manifest"]["world_size"] == 3
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-5)
    for k, v in ref_managed.items():
        assert torch.equal(managed[k], v), k
    # ... and in one process (every shard hosted by the one table)
    trainer_cfg = config(tmp_path, data_dir)
    data = assemble.prepare_data(trainer_cfg, progress=False)
    tables = assemble.tables_for(trainer_cfg, data.manifest)
    model, opt = assemble.build(trainer_cfg, tables, data.manifest.num_dense, torch.device("cpu"), validate=False)
    tr = Trainer(model, opt, assemble.train_loader(trainer_cfg, data, torch.device("cpu")), None, tmp_path / "cont",
                 progress=False, loop=LoopConfig.from_train(trainer_cfg.train))
    assert tr.resume(step_dir(tmp_path / "two", 6))
    assert managed_of(model).ids["t_user"].step == 6
    tr.fit()
    np.testing.assert_allclose(tr.losses, ref_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([model.sparse_arch.embedding.table_weight(f"t_{t}").detach()
                                          for t in TABLES]), ref_w, rtol=0, atol=1e-5)
    assert managed_of(model).ids["t_user"].mapping() == mapping_of(ref_managed, "user")


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("managed,words", [
    ({"admit_after": 2, "policy": "fifo"}, ["table 'a'", "managed.policy", "fifo"]),
    ({"admit_after": 1, "policy": "ttl"}, ["table 'a'", "managed.ttl", "ttl >= 1"]),
    ({"admit_after": 1, "policy": "lru", "ttl": 5}, ["table 'a'", "managed.ttl", "lru"]),
    ({"admit_after": -1}, ["table 'a'", "managed.admit_after"]),
    ({"policy": "lfu"}, ["table 'a'", "managed.admit_after", "not managed"]),
    ({"admit_after": 1, "pending_capacity": -3}, ["table 'a'", "managed.pending_capacity"]),
    ({"admit_after": "two"}, ["managed.admit_after", "integer"]),
    ({"admit_after": 1, "evict": "lru"}, ["managed.evict"]),
    ({"admit_after": 1, "shards": -2}, ["table 'a'", "managed.shards", "-2"]),
    ({"shards": 4}, ["table 'a'", "managed.admit_after", "shards"]),
])
def test_bad_managed_config_is_a_named_error(tmp_path, managed, words):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"model": {"tables": [{"name": "a", "num_rows": 10, "managed": managed}]}}))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_model_managed_is_checked_and_cli_flags(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.managed\.policy: 'x'"):
        load_config(None, {"model.managed.admit_after": 1, "model.managed.policy": "x"})
    cfg = load_config(None, {"model.managed.admit_after": 3, "model.managed.policy": "ttl", "model.managed.ttl": 9})
    spec = [TableSpec("t_a", 10, features=["a"]), TableSpec("t_b", 1, features=["b"])]
    with pytest.raises(ConfigError, match="t_b.*num_rows >= 2"):
        assemble.managed_tables(cfg.model, spec)
    # mapping shards: each owns at least one row; the default does not depend on the world size
    cfg = load_config(None, {"model.managed.admit_after": 1, "model.managed.shards": 10})
    with pytest.raises(ConfigError, match=r"t_a.*managed\.shards 10 exceeds its 9 rows"):
        assemble.managed_tables(cfg.model, spec[:1])
    m = ManagedConfig(admit_after=1)
    assert [m.shards_for(n) for n in (2, 12, 129, 1025, 10**6)] == [1, 1, 2, 16, 16]


def test_managed_tt_or_dmt_table_is_refused(tmp_path, data_dir):
    cfg = config(tmp_path, data_dir)
    cfg.model.tt_min_rows = 5
    tables = [TableSpec(f"t_{t}", ROWS, 4, features=[t]) for t in TABLES]
    with pytest.raises(ConfigError, match=r"t_user.*form 'tt'"):
        assemble.managed_for(cfg, tables)
    cfg = config(tmp_path, data_dir)
    cfg.train.replan_every = 5  # live re-planning moves managed rows like any other (tests/test_managed_replan.py)
    assert set(assemble.managed_for(cfg, [TableSpec(f"t_{t}", ROWS, 4, features=[t]) for t in TABLES])) == {
        f"t_{t}" for t in TABLES}
    cfg = config(tmp_path, data_dir)
    cfg.model.arch = "dmt-dlrm"
    with pytest.raises(ConfigError, match="DMT"):  # before any batch is read
        workflow.train(cfg, tmp_path / "dmt", resume=False, progress=False)


def test_loader_passes_raw_ids_of_managed_features_only(tmp_path, data_dir):
    # the drift data's ids are raw 64-bit values (negative ones among them), far outside ROWS
    loader = ShardLoader(data_dir, 400, prefetch=0, raw_ids={"user", "item"})
    (b,) = list(loader)
    assert (b.sparse.values < 0).any() and (b.sparse.values >= ROWS).any()
    with pytest.raises(InputError, match=r"feature item: row id .* outside its table \[0, 12\)"):
        list(ShardLoader(data_dir, 400, prefetch=0, raw_ids={"user"}))
    with pytest.raises(InputError, match="not in the data"):
        ShardLoader(data_dir, 400, prefetch=0, raw_ids={"nope"})
    # an unmanaged run over raw ids: the loader rejects them, naming the feature
    cfg = config(tmp_path, data_dir, managed={})
    with pytest.raises(InputError, match="outside its table"):
        workflow.train(cfg, tmp_path / "unmanaged", resume=False, progress=False)


def test_a_stream_source_trains_managed_tables_as_the_shards_do(tmp_path, data_dir, single):
    """The same 8 batches of raw ids arriving as a stream (``data.source: stream``) train exactly as from shards."""
    run_dir, _ = single
    want = state(run_dir)
    src = ShardLoader(data_dir, BATCH, stop=STEPS * BATCH, prefetch=0, raw_ids=set(TABLES))
    w = StreamWriter(tmp_path / "stream", ["I1", "I2"], [SparseFeatureInfo(t, ROWS) for t in TABLES])
    for b in src:
        vals = b.sparse.to_dict()
        w.write_shard(b.labels.numpy().astype(np.int8), b.dense.numpy(), {t: vals[t][0].numpy() for t in TABLES})
    w.end()
    cfg = config(tmp_path, data_dir)
    cfg.data.source, cfg.data.path = "stream", str(tmp_path / "stream")
    workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    losses, weights, _, managed = state(tmp_path / "run")
    np.testing.assert_allclose(losses, want[0], rtol=0, atol=0)
    torch.testing.assert_close(weights, want[1], rtol=0, atol=0)


def test_a_table_of_two_features_maps_them_in_table_feature_order():
    """One managed table read by two features: its batch is feature ``a``'s ids then ``b``'s (the table's
    feature order, whatever the batch's key order), as the dict reference assigns them."""
    tables = [TableSpec("t", 6, 4, features=["a", "b"]), TableSpec("u", 5, 4, features=["c"])]
    emb = LocalEmbeddingBags(tables, optimizer="rowwise_adagrad", lr=0.1)
    lookup = ManagedLookup(tables, {"t": ManagedConfig(admit_after=1, policy="lru")}, emb, seed=0,
                           device=torch.device("cpu"))
    ref = Reference(6, 1, "lru")
    rng = np.random.default_rng(0)
    pool = rng.integers(-(2**63), 2**63 - 1, size=9, dtype=np.int64)
    for step in range(12):
        a, b = pool[rng.integers(0, 9, 3)], pool[rng.integers(0, 9, 3)]
        c = rng.integers(0, 5, 3)
        feats = JaggedFeatures(["c", "b", "a"], torch.from_numpy(np.concatenate([c, b, a])),
                               torch.ones(9, dtype=torch.int64))
        out = lookup.map(feats, training=True).to_dict()
        rows, _, _ = ref.assign(a.tolist() + b.tolist())
        assert out["a"][0].tolist() + out["b"][0].tolist() == rows, step
        assert out["c"][0].tolist() == c.tolist()  # an unmanaged feature passes through
    assert lookup.ids["t"].mapping() == ref.row_of


# -- the exchange on its own: multi-hot features, a table of two features, N ranks vs one ----------------
LOOKUP_TABLES = [TableSpec("t", 9, 4, features=["a", "b"]), TableSpec("u", 7, 4, features=["c"])]
LOOKUP_MANAGED = {"t": ManagedConfig(admit_after=1, policy="lru", shards=3),
                  "u": ManagedConfig(admit_after=2, policy="lfu", shards=2)}


def _lookup_batches(steps=14, B=6, seed=0):
    """Global batches ``{key: (lengths [B], values)}``: multi-hot (0-3 ids a sample), raw ids from small pools."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**63), 2**63 - 1, size=30, dtype=np.int64)
    out = []
    for _ in range(steps):
        b = {}
        for k in ("a", "b", "c"):
            lengths = rng.integers(0, 4, size=B)
            b[k] = (lengths, pool[rng.integers(0, 30 if k != "c" else 12, size=int(lengths.sum()))])
        out.append(b)
    return out


def _map_batches(batches, rank, world, group):
    """Every batch's rows for this rank's samples (keys in the order c, b, a), by a ManagedLookup over a
    LocalEmbeddingBags; then the table weights, the counters and an eval map of the last batch."""
    emb = LocalEmbeddingBags(LOOKUP_TABLES, optimizer="rowwise_adagrad", lr=0.1, seed=0)
    lookup = ManagedLookup(LOOKUP_TABLES, LOOKUP_MANAGED, emb, seed=0, device=torch.device("cpu"), group=group)
    rows = []

    def part(b):
        keys, vals, lens = ["c", "b", "a"], [], []
        for k in keys:
            lengths, values = b[k]
            B = lengths.size
            lo, hi = B * rank // world, B * (rank + 1) // world
            start = int(lengths[:lo].sum())
            vals.append(values[start:start + int(lengths[lo:hi].sum())])
            lens.append(lengths[lo:hi])
        return JaggedFeatures(keys, torch.from_numpy(np.concatenate(vals)), torch.from_numpy(np.concatenate(lens)))

    for b in batches:
        out = lookup.map(part(b), training=True).to_dict()
        rows.append({k: out[k][0].tolist() for k in ("a", "b", "c")})
    ev = lookup.map(part(batches[-1]), training=False).to_dict()
    return rows, emb.weights.detach().clone(), lookup.counters(), {k: ev[k][0].tolist() for k in ("a", "b", "c")}


def _lookup_rank(rank, world):
    import torch.distributed as tdist

    rows, w, counters, ev = _map_batches(_lookup_batches(), rank, world, tdist.group.WORLD)
    return {"rows": rows, "weights": w, "counters": counters, "eval": ev}


def test_the_id_exchange_on_two_ranks_equals_one_process():
    """Multi-hot features, a table read by two features, two tables of different shard counts: the rows each
    rank gets for its samples (training and eval), the reset rows (every rank holds every row here) and the
    counters equal one process's."""
    rows1, w1, c1, ev1 = _map_batches(_lookup_batches(), 0, 1, None)
    assert c1["t"]["evictions"] > 0 and c1["u"]["admissions"] > 0
    res = spawn_local(_lookup_rank, 2, timeout_s=300)
    for s in range(len(rows1)):
        for k in ("a", "b", "c"):
            assert res[0]["rows"][s][k] + res[1]["rows"][s][k] == rows1[s][k], (s, k)
    for r in res:
        torch.testing.assert_close(r["weights"], w1, rtol=0, atol=0)
        assert r["counters"] == c1
    assert {k: res[0]["eval"][k] + res[1]["eval"][k] for k in ev1} == ev1
