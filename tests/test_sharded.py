"""ShardedEmbedding on 2 and 4 gloo ranks against a single-process dense reference.

The reference is per-table ``torch.nn.EmbeddingBag`` over the *global* batch, initialised with the same
placement-independent rows, trained with SGD / row-wise Adagrad written densely here. Each rank of the
sharded run sees its slice of every global batch; the loss is the global-batch mean, so the sharded
result must equal the reference (outputs and final weights within 1e-5) for every plan and design.
"""

import numpy as np
import pytest
import torch

from embedscale.comm.collective import CollectiveTransport
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding import kernels
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.context import Stage
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import InputError
from embedscale.specs import TableSpec
from embedscale.train.launch import spawn_local

DIM, B, STEPS, LR, EPS = 4, 24, 3, 0.5, 1e-8


def tables():
    return [TableSpec("t0", 40, DIM, features=["f0"]), TableSpec("t1", 7, DIM, features=["f1", "f2"], pooling="mean"),
            TableSpec("t2", 90, DIM, features=["f3"])]


def plans(world):
    """name -> (owner arrays, replicated rows, holders): table-wise, row-wise, and row-level with replicas."""
    ts = tables()
    rng = np.random.default_rng(7)
    table_wise = [np.full(t.num_rows, i % world) for i, t in enumerate(ts)]
    row_wise = [np.minimum(np.arange(t.num_rows) * world // t.num_rows, world - 1) for t in ts]
    scattered = [rng.integers(0, world, t.num_rows) for t in ts]
    replicas = [np.array([0, 1, 2]), np.array([3]), np.array([5, 6, 7, 8])]  # hot rows (see batches)
    partial = np.zeros((8, world), bool)
    partial[:, 0] = True
    partial[::2, 1] = True  # some replicas held by ranks 0 and 1 only: the others fetch them
    return {"table_wise": (table_wise, None, None), "row_wise": (row_wise, None, None),
            "oper_replicas": (scattered, replicas, None), "partial_replicas": (scattered, replicas, partial)}


def batches():
    """Global batches with skew (hot rows 0-8), multi-hot, empty bags and per-sample weights."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        per_key = {}
        for k, rows in zip(["f0", "f1", "f2", "f3"], [40, 7, 7, 90]):
            lens = torch.randint(0, 4, (B,), generator=g)
            vals = (torch.rand(int(lens.sum()), generator=g) ** 3 * rows).long()
            per_key[k] = (vals, lens)
        keys = list(per_key)
        values = torch.cat([per_key[k][0] for k in keys])
        lengths = torch.cat([per_key[k][1] for k in keys])
        weights = torch.rand(values.numel(), generator=g) + 0.5
        out.append((JaggedFeatures(keys, values, lengths, weights), torch.randn(B, 4 * DIM, generator=g)))
    return out


def reference(optimizer):
    ts = tables()
    bags = [torch.nn.EmbeddingBag(t.num_rows, DIM, mode="sum") for t in ts]
    for i, (t, bag) in enumerate(zip(ts, bags)):
        bag.weight.data = torch.from_numpy(uniform_rows(0, i, np.arange(t.num_rows), DIM, t.num_rows))
    mom = [torch.zeros(t.num_rows) for t in ts]
    fmap = {"f0": 0, "f1": 1, "f2": 1, "f3": 2}
    outs = []
    for jf, c in batches():
        parts = []
        for k, (v, l) in jf.to_dict().items():
            t = fmap[k]
            offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(l, 0)[:-1]])
            w = jf.weights[jf.offsets()[jf.keys.index(k) * B]: jf.offsets()[(jf.keys.index(k) + 1) * B]]
            if ts[t].pooling == "mean":
                w = w / torch.repeat_interleave(l.clamp(min=1), l).float()
            parts.append(bags[t](v, offs, per_sample_weights=w))
        out = torch.cat(parts, 1)
        outs.append(out.detach().clone())
        loss = (out * c).sum() / B
        for bag in bags:
            bag.weight.grad = None
        loss.backward()
        with torch.no_grad():
            for t, bag in enumerate(bags):
                g = bag.weight.grad
                if optimizer == "sgd":
                    bag.weight -= LR * g
                else:
                    touched = g.abs().sum(1) > 0
                    mom[t] += torch.where(touched, g.pow(2).mean(1), torch.zeros(()))
                    bag.weight -= LR * g / (mom[t].sqrt() + EPS)[:, None]
    return outs, [b.weight.detach() for b in bags]


def _worker(rank, world, scenarios):
    results = {}
    transport = CollectiveTransport()
    ts = tables()
    for name, design, optimizer, sync in scenarios:
        owner, replicas, holders = plans(world)[name]
        amap = AddressMap.build(ts, world, owner, replicas, holders)
        emb = ShardedEmbedding(ts, amap, transport, rank, design=design, optimizer=optimizer, lr=LR, eps=EPS,
                               grad_sync=sync)
        outs = []
        for jf, c in batches():
            lo, hi = B * rank // world, B * (rank + 1) // world
            out = emb(jf.slice_batch(lo, hi))
            outs.append(out.detach().clone())
            loss = (out * c[lo:hi]).sum() / B
            loss.backward()
        results[(name, design, optimizer, sync)] = (outs, torch.from_numpy(amap.storage_gids(rank)), emb.weight.clone())
    return results


SCENARIOS = [(p, d, o, "local_aggregated") for p in ["table_wise", "row_wise", "oper_replicas", "partial_replicas"]
             for d in ["retrieve", "send"] for o in ["sgd", "rowwise_adagrad"]]
# replica gradients riding in the retrieve design's all-to-all (partial replicas: non-holders contribute too)
SCENARIOS += [(p, "retrieve", o, "alltoall") for p in ["oper_replicas", "partial_replicas"]
              for o in ["sgd", "rowwise_adagrad"]]


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_training_equals_single_process(world):
    results = spawn_local(_worker, world, SCENARIOS)
    refs = {o: reference(o) for o in ["sgd", "rowwise_adagrad"]}
    base = np.cumsum([0] + [t.num_rows for t in tables()])
    for sc in SCENARIOS:
        ref_outs, ref_w = refs[sc[2]]
        full = torch.cat(ref_w)
        for step in range(STEPS):
            got = torch.cat([results[r][sc][0][step] for r in range(world)])
            torch.testing.assert_close(got, ref_outs[step], atol=1e-5, rtol=0, msg=lambda m: f"{sc} step {step}: {m}")
        seen = np.zeros(base[-1], bool)
        for r in range(world):
            _, gids, w = results[r][sc]
            torch.testing.assert_close(w, full[gids], atol=1e-5, rtol=0, msg=lambda m: f"{sc} rank {r}: {m}")
            seen[gids.numpy()] = True
        assert seen.all(), f"{sc}: some rows are on no rank"


@pytest.mark.parametrize("multi_hot", [False, True])
def test_bad_row_id_names_feature_table_and_value(multi_hot):
    """A row id outside its table is an error naming the feature, its table and the value, before any message."""
    ts = tables()
    amap = AddressMap.build(ts, 1, [np.zeros(t.num_rows, dtype=np.int64) for t in ts])
    emb = ShardedEmbedding(ts, amap, CollectiveTransport(rank=0, world_size=1), 0, optimizer=None)
    keys = ["f0", "f1", "f2", "f3"]
    n = 2 if multi_hot else 1  # ids per bag, 3 samples
    vals = [torch.zeros(3 * n, dtype=torch.int64) for _ in keys]
    vals[2][-1] = 7  # f2 reads table t1, which has 7 rows
    jf = JaggedFeatures(keys, torch.cat(vals), torch.full((4 * 3,), n, dtype=torch.int64))
    with pytest.raises(InputError, match=r"feature f2: row id 7 outside table 't1' \[0, 7\)"):
        emb(jf)
    vals[2][-1] = 6
    vals[3][0] = -1
    jf = JaggedFeatures(keys, torch.cat(vals), torch.full((4 * 3,), n, dtype=torch.int64))
    with pytest.raises(InputError, match=r"feature f3: row id -1 outside table 't2'"):
        emb(jf)


class _HostReads:
    """Counts every way a tensor's data reaches the host as Python or numpy data inside a block:
    ``.cpu()``, ``.numpy()`` / ``__array__``, ``.tolist()``, ``.to("cpu")`` (a string or ``device=`` literal).
    Records ``(how, numel)``. On a CPU-only machine ``.cpu()`` is a no-op copy-wise, but it is still a call,
    so adding one back to the lookup path fails this test as it would cost a device-to-host copy on GPU."""

    def __init__(self):
        self.calls = []
        self._saved = {}

    def _wrap(self, name, how, pred=None):
        real = getattr(torch.Tensor, name)
        self._saved[name] = real

        def spy(t, *a, **k):
            if pred is None or pred(a, k):
                self.calls.append((how, t.numel()))
            return real(t, *a, **k)
        setattr(torch.Tensor, name, spy)

    def __enter__(self):
        def to_host(a, k):
            args = list(a) + [k.get("device")]
            return any(x == "cpu" or (isinstance(x, str) and x.startswith("cpu")) for x in args if x is not None)
        self._wrap("cpu", "cpu")
        self._wrap("numpy", "numpy")
        self._wrap("__array__", "__array__")
        self._wrap("tolist", "tolist")
        self._wrap("to", "to('cpu')", to_host)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)


def _host_copy_worker(rank, world, scenarios):
    out = {}
    transport = CollectiveTransport()
    ts = tables()
    for name, design, sync in scenarios:
        owner, replicas, holders = plans(world)[name]
        amap = AddressMap.build(ts, world, owner, replicas, holders)
        emb = ShardedEmbedding(ts, amap, transport, rank, design=design, optimizer="rowwise_adagrad", lr=LR,
                               grad_sync=sync)
        jf, c = batches()[0]
        lo, hi = B * rank // world, B * (rank + 1) // world
        part = jf.slice_batch(lo, hi)
        with _HostReads() as spy:
            y = emb(part)
            (y * c[lo:hi]).sum().backward()
        out[(name, design, sync)] = (spy.calls, part.values.numel())
    return out


def test_sharded_lookup_reads_no_ids_on_the_host():
    """Forward and backward of the sharded lookup (both designs, replicas, replica gradients in the
    all-to-all) never convert a batch's ids to host data: the only host reads are per-peer counts (at most
    ``2 W`` numbers each), and ``.cpu()`` / ``.numpy()`` / ``.to('cpu')`` are never called."""
    world = 2
    scenarios = [("row_wise", "retrieve", "local_aggregated"), ("partial_replicas", "retrieve", "alltoall"),
                 ("oper_replicas", "retrieve", "local_aggregated"), ("oper_replicas", "send", "local_aggregated")]
    results = spawn_local(_host_copy_worker, world, scenarios)
    for r in range(world):
        for sc, (calls, n_ids) in results[r].items():
            assert n_ids > 4 * world, sc  # the batch is larger than any count vector, so the test can tell
            bad = [c for c in calls if c[0] != "tolist" or c[1] > 2 * world]
            assert not bad, f"rank {r} {sc}: host reads {bad} in the lookup path"


def test_host_read_spy_catches_a_cpu_copy():
    """The spy above fails when ids are moved to the host (so the test can fail)."""
    ids = torch.arange(100)
    with _HostReads() as spy:
        ids.cpu()
        ids.to("cpu")
        ids.tolist()
        ids.numpy()
    assert [c[0] for c in spy.calls] == ["cpu", "to('cpu')", "tolist", "numpy"]
    assert all(c[1] == 100 for c in spy.calls)


def test_address_map_stays_in_host_memory_when_the_storage_moves():
    """Moving the module moves its storage (a buffer) and the replica slot -> storage row table the update
    reads; the address map and the per-feature tables stay in host memory, where a batch's ids are decoded
    (OPER 5.1: never a copy of the map on the accelerator; 'meta' stands in for one here)."""
    ts = tables()
    amap = AddressMap.build(ts, 1, [np.zeros(t.num_rows, dtype=np.int64) for t in ts], [np.array([1]), [], []])
    emb = ShardedEmbedding(ts, amap, CollectiveTransport(rank=0, world_size=1), 0, optimizer=None)
    assert emb.tmap.device == torch.device("cpu")
    code = emb.tmap.row_code
    emb.to(torch.device("meta"))
    assert emb._follow_storage() == torch.device("meta")
    assert emb.replica_storage_rows.device == torch.device("meta")
    for t in (*emb.tmap.tensors().values(), emb._feature_rows, emb.region_slot):
        assert t.device == torch.device("cpu")
    assert emb.tmap.row_code is code  # not copied
    assert len(emb.host_tensors()) == len(emb.tmap.tensors()) + 4


PREFETCH_SCENARIOS = [("row_wise", "sgd", "local_aggregated"), ("oper_replicas", "rowwise_adagrad", "local_aggregated"),
                      ("oper_replicas", "rowwise_adagrad", "alltoall"), ("partial_replicas", "sgd", "alltoall")]
PREFETCH_STEPS = 6


def _global_gids(jf: JaggedFeatures, amap: AddressMap) -> np.ndarray:
    """Every value's global row id, brute force (feature by feature)."""
    table_of = {f: i for i, t in enumerate(tables()) for f in t.features}
    out = []
    for k, (v, _l) in jf.to_dict().items():
        out.append(amap.table_base[table_of[k]] + v.numpy())
    return np.concatenate(out)


def _prefetch_worker(rank, world):
    import torch.distributed as dist

    ts = tables()
    transport = CollectiveTransport()
    parts = [[jf.slice_batch(B * r // world, B * (r + 1) // world) for r in range(world)] for jf, _ in batches()]
    grads = [c for _, c in batches()]
    lo, hi = B * rank // world, B * (rank + 1) // world
    calls = {"n": 0}
    real = dist.all_to_all_single

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    dist.all_to_all_single = counted
    out = {}
    try:
        for name, optimizer, sync in PREFETCH_SCENARIOS:
            owner, replicas, holders = plans(world)[name]
            amap = AddressMap.build(ts, world, owner, replicas, holders)
            runs = {}
            for prefetch in (None, "thread", "inline", "two_ahead"):
                emb = ShardedEmbedding(ts, amap, transport, rank, optimizer=optimizer, lr=LR, eps=EPS, grad_sync=sync)
                outs, per_step, requests_ok = [], [], []
                for s in range(PREFETCH_STEPS):
                    b = s % STEPS
                    if prefetch == "two_ahead":  # the batches of the next two steps are queued
                        for a in ((1, 2) if s == 0 else (2,)):
                            emb.prefetch(parts[(s + a) % STEPS][rank])
                    elif prefetch:
                        emb.prefetch(parts[(s + 1) % STEPS][rank], background=prefetch == "thread")
                    n0 = calls["n"]
                    y = emb(parts[b][rank])
                    outs.append(y.detach().clone())
                    ((y * grads[b][lo:hi]).sum() / B).backward()
                    per_step.append(calls["n"] - n0)
                    if prefetch:  # what the peers asked this rank for, next step: the rows it owns of their batch
                        nxt = emb.next_prefetched()
                        ok = nxt.state is Stage.ANNOUNCED
                        for p in range(world):
                            if p == rank:
                                continue
                            src, off, _ = amap.fetch(p, _global_gids(parts[(s + 1) % STEPS][p], amap))
                            want = np.unique(off[src == rank])
                            ok = ok and np.array_equal(nxt.requests[p].numpy(), want)
                        requests_ok.append(ok)
                    with torch.no_grad():  # an evaluation between steps, on another batch: the queue waits
                        emb(parts[(s + 2) % STEPS][rank])
                runs[prefetch] = (outs, emb.weight.clone(), per_step, requests_ok)
            out[(name, optimizer, sync)] = runs
        # prefetch(next) must be followed by forward(next): another batch is an error, on every rank
        owner, replicas, holders = plans(world)["oper_replicas"]
        emb = ShardedEmbedding(ts, AddressMap.build(ts, world, owner, replicas, holders), transport, rank)
        emb.prefetch(parts[1][rank])
        emb(parts[0][rank]).sum().backward()
        try:
            emb(parts[2][rank])
            out["wrong_batch"] = "no error"
        except InputError as e:
            out["wrong_batch"] = str(e)
    finally:
        dist.all_to_all_single = real
    return out


def test_prefetched_conversion_is_exact_and_saves_two_all_to_alls():
    """``prefetch`` (the next batch's conversion, its counts in this step's row exchange and its ids in this
    step's gradient exchange) gives bit for bit the outputs and rows of the synchronous step over 6 steps on
    2 ranks (with an evaluation on another batch between steps), the requests each owner receives are the
    rows it owns of the peers' next batches (brute force from the address map), and a steady-state step makes
    two all-to-alls instead of four (one more with a local-aggregated replica AllReduce: none here, it is
    an all_reduce)."""
    world = 2
    results = spawn_local(_prefetch_worker, world, timeout_s=600)
    for r in range(world):
        res = results[r]
        assert "another batch than the one prefetched" in res["wrong_batch"], res["wrong_batch"]
        for sc in PREFETCH_SCENARIOS:
            sync_outs, sync_w, sync_calls, _ = res[sc][None]
            assert sync_calls == [4] * PREFETCH_STEPS, (sc, sync_calls)
            for how in ("thread", "inline", "two_ahead"):
                pre_outs, pre_w, pre_calls, requests_ok = res[sc][how]
                for s in range(PREFETCH_STEPS):
                    assert torch.equal(pre_outs[s], sync_outs[s]), f"rank {r} {sc} {how} step {s}"
                assert torch.equal(pre_w, sync_w), f"rank {r} {sc} {how}: rows differ after {PREFETCH_STEPS} steps"
                assert all(requests_ok), f"rank {r} {sc} {how}: prefetched requests {requests_ok}"
                assert pre_calls == [4] + [2] * (PREFETCH_STEPS - 1), (sc, how, pre_calls)


def onehot_batches():
    """Global batches of one unweighted id per bag (the benchmark's criteo case: no per-value scale)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        values = torch.cat([(torch.rand(B, generator=g) ** 3 * rows).long() for rows in (40, 7, 7, 90)])
        out.append((JaggedFeatures(["f0", "f1", "f2", "f3"], values, torch.ones(4 * B, dtype=torch.int64)),
                    torch.randn(B, 4 * DIM, generator=g)))
    return out


KERNEL_SCENARIOS = [(p, d, o, s, data) for p in ["row_wise", "oper_replicas", "partial_replicas"]
                    for d, s in [("retrieve", "local_aggregated"), ("retrieve", "alltoall"), ("send", "local_aggregated")]
                    for o in ["sgd", "rowwise_adagrad"] for data in ["jagged", "onehot"]]


def _kernel_worker(rank, world, scenarios):
    ts = tables()
    transport = CollectiveTransport()
    out = {}
    for name, design, optimizer, sync, data in scenarios:
        owner, replicas, holders = plans(world)[name]
        amap = AddressMap.build(ts, world, owner, replicas, holders)
        data_ = batches() if data == "jagged" else onehot_batches()
        lo, hi = B * rank // world, B * (rank + 1) // world
        runs = {}
        for kernel in (False, True):
            emb = ShardedEmbedding(ts, amap, transport, rank, design=design, optimizer=optimizer, lr=LR, eps=EPS,
                                   grad_sync=sync)
            emb.cpu_kernel = kernel
            emb.track_touched()
            outs = []
            for s, (jf, c) in enumerate(data_):
                if kernel and design == "retrieve":  # the prefetched step takes the same kernel path
                    emb.prefetch(data_[(s + 1) % STEPS][0].slice_batch(lo, hi))
                y = emb(jf.slice_batch(lo, hi))
                outs.append(y.detach().clone())
                ((y * c[lo:hi]).sum() / B).backward()
            with torch.no_grad():
                inf = emb(data_[0][0].slice_batch(lo, hi))
            state = [emb.weight.clone(), emb.touched.clone()] + \
                ([emb.momentum.clone()] if optimizer == "rowwise_adagrad" else [])
            runs[kernel] = (outs + [inf], state, emb._kslot is not None)
        out[(name, design, optimizer, sync, data)] = runs
    return out


@pytest.mark.skipif(kernels.fused_ops() is None,
                    reason="fused C++ kernel not built: run `python -m embedscale.embedding.kernels --build`")
@pytest.mark.parametrize("world", [2, 3])  # 3 ranks: sums of three contributions (association)
def test_cpu_kernel_step_is_the_pytorch_step_bit_for_bit(world):
    """The C++ kernel's pooling, per-row gradient sums and fused updates of the sharded step (both designs,
    replicas synced by AllReduce or in the all-to-all, SGD and row-wise Adagrad, weighted multi-hot bags with
    empty and mean-pooled ones, and unweighted one-hot bags; the kernel run prefetched) give the same bits as
    the PyTorch ops on 2 and 3 ranks over 3 steps: outputs, an inference lookup, rows, Adagrad state and the
    rows marked updated; and the kernel did run (its row -> slot map exists) where it was enabled only."""
    results = spawn_local(_kernel_worker, world, KERNEL_SCENARIOS, timeout_s=600)
    for r in range(world):
        for sc in KERNEL_SCENARIOS:
            (t_outs, t_state, t_used), (k_outs, k_state, k_used) = results[r][sc][False], results[r][sc][True]
            assert k_used and not t_used, (r, sc, k_used, t_used)
            for s, (a, b) in enumerate(zip(t_outs, k_outs)):
                assert torch.equal(a, b), f"rank {r} {sc} output {s}: max diff {(a - b).abs().max()}"
            for what, a, b in zip(("rows", "touched", "momentum"), t_state, k_state):
                assert torch.equal(a, b), f"rank {r} {sc}: {what} differ"
            assert bool(t_state[1].any()), (r, sc)  # some rows were updated: the comparison can fail
