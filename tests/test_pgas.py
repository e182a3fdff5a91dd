"""The PGAS transport and the fused lookups against independent references, and heap cleanup.

References: ``ShardedEmbedding`` over ``CollectiveTransport`` on the same batches in the same processes
(outputs at every step, final weights and optimizer state must be *bitwise* equal: ``torch.equal``,
which counts +0 and -0 as equal) and a single-process dense model (per-table ``nn.EmbeddingBag``, dense
SGD / row-wise Adagrad; within 1e-5). Scenarios run the fused ``PgasShardedEmbedding`` and the unchanged
``ShardedEmbedding`` over ``PgasTransport`` (byte counts equal to the collective's, peer by peer), with
ring slots of 256 bytes so that messages stream through the rings in several rounds; one scenario makes
an owner apply its updates late (a reader that does not wait for the owner's version word fails it),
one forces the fetch-area fallback. Multi-rank scenarios are batched into a few spawns.

Cleanup: after a normal exit, an exception in one rank, a SIGKILL of one rank after the heap is set up,
and a SIGKILL inside the rendezvous (between creating and unlinking the segments), no segment of the
job is left in the shared-memory directory, and the survivors fail with an error naming the dead rank
instead of hanging.
"""

import os
import time
import uuid

import numpy as np
import pytest
import torch

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.pgas import PgasTransport, heap_segments, slot_bytes_for
from embedscale.comm.timeline import Timeline, plot_timeline
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.pgas_lookup import PgasShardedEmbedding
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import InputError
from embedscale.specs import TableSpec
from embedscale.train.launch import RankFailed, spawn_local

DIM, B, STEPS, LR, EPS = 4, 26, 3, 0.5, 1e-8  # B = 26: uneven slices over 4 ranks
KEYS, ROWS = ["f0", "f1", "f2", "f3"], [40, 7, 7, 90]


def tables():
    return [TableSpec("t0", 40, DIM, features=["f0"]), TableSpec("t1", 7, DIM, features=["f1", "f2"], pooling="mean"),
            TableSpec("t2", 90, DIM, features=["f3"])]


def plans(world):
    """name -> (owner arrays, replicated rows, holders): table-wise, row-wise, rows scattered with replicas."""
    ts = tables()
    rng = np.random.default_rng(7)
    scattered = [rng.integers(0, world, t.num_rows) for t in ts]
    replicas = [np.array([0, 1, 2]), np.array([3]), np.array([5, 6, 7, 8])]
    partial = np.zeros((8, world), bool)
    partial[:, 0] = True
    partial[::2, 1] = True  # some replicas held by ranks 0 and 1 only: the others read them there
    return {"table_wise": ([np.full(t.num_rows, i % world) for i, t in enumerate(ts)], None, None),
            "row_wise": ([np.minimum(np.arange(t.num_rows) * world // t.num_rows, world - 1) for t in ts], None, None),
            "replicas": (scattered, replicas, None), "partial_replicas": (scattered, replicas, partial)}


def batches(weighted=True):
    """Skewed multi-hot global batches (hot rows 0-8), empty bags, optional per-sample weights."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        vals, lens = [], []
        for rows in ROWS:
            n = torch.randint(0, 4, (B,), generator=g)
            vals.append((torch.rand(int(n.sum()), generator=g) ** 3 * rows).long())
            lens.append(n)
        values, lengths = torch.cat(vals), torch.cat(lens)
        w = torch.rand(values.numel(), generator=g) + 0.5
        out.append((JaggedFeatures(KEYS, values, lengths, w if weighted else None),
                    torch.randn(B, 4 * DIM, generator=g)))
    return out


def dense_reference(optimizer, weighted=True):
    """Single process, dense: per-table EmbeddingBag over the global batch, dense SGD / row-wise Adagrad."""
    ts = tables()
    bags = [torch.nn.EmbeddingBag(t.num_rows, DIM, mode="sum") for t in ts]
    for i, (t, bag) in enumerate(zip(ts, bags)):
        bag.weight.data = torch.from_numpy(uniform_rows(0, i, np.arange(t.num_rows), DIM, t.num_rows))
    mom = [torch.zeros(t.num_rows) for t in ts]
    fmap = {"f0": 0, "f1": 1, "f2": 1, "f3": 2}
    outs = []
    for jf, c in batches(weighted):
        parts = []
        offs_all = jf.offsets()
        for k, (v, l) in jf.to_dict().items():
            t = fmap[k]
            offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(l, 0)[:-1]])
            i = jf.keys.index(k)
            w = jf.weights[offs_all[i * B]:offs_all[(i + 1) * B]] if weighted else torch.ones(v.numel())
            if ts[t].pooling == "mean":
                w = w / torch.repeat_interleave(l.clamp(min=1), l).float()
            parts.append(bags[t](v, offs, per_sample_weights=w))
        out = torch.cat(parts, 1)
        outs.append(out.detach().clone())
        for bag in bags:
            bag.weight.grad = None
        ((out * c).sum() / B).backward()
        with torch.no_grad():
            for t, bag in enumerate(bags):
                g = bag.weight.grad
                if optimizer == "sgd":
                    bag.weight -= LR * g
                else:
                    touched = g.abs().sum(1) > 0
                    mom[t] += torch.where(touched, g.pow(2).mean(1), torch.zeros(()))
                    bag.weight -= LR * g / (mom[t].sqrt() + EPS)[:, None]
    return outs, torch.cat([b.weight.detach() for b in bags])


def _train(emb, rank, world, weighted):
    outs = []
    for jf, c in batches(weighted):
        lo, hi = B * rank // world, B * (rank + 1) // world
        out = emb(jf.slice_batch(lo, hi))
        outs.append(out.detach().clone())
        ((out * c[lo:hi]).sum() / B).backward()
    with torch.no_grad():  # inference after training (PGAS retrieve: one-sided gets, no message)
        outs.append(emb(jf.slice_batch(lo, hi)).clone())
    mom = emb.momentum.clone() if hasattr(emb, "momentum") else torch.zeros(0)
    return outs, emb.weight.detach().clone(), mom


def _equality_worker(rank, world, rph, job, scenarios):
    ct = CollectiveTransport()
    # a small ring slot: messages larger than a slot stream through the ring in several rounds
    pt = PgasTransport(ranks_per_host=rph, job_id=job, slot_bytes=256)
    res = {}
    for name, design, optimizer, variant, weighted in scenarios:
        owner, replicas, holders = plans(world)[name]
        amap = AddressMap.build(tables(), world, owner, replicas, holders)
        kw = dict(design=design, optimizer=optimizer, lr=LR, eps=EPS)
        ct.counter.reset()
        ref = _train(ShardedEmbedding(tables(), amap, ct, rank, **kw), rank, world, weighted)
        ref_bytes = ct.counter.snapshot()
        pt.counter.reset()
        if variant == "unfused":
            emb = ShardedEmbedding(tables(), amap, pt, rank, **kw)
        else:
            extra = {"fetch_rows": 1} if variant == "fused_small_fetch" else {}
            emb = PgasShardedEmbedding(tables(), amap, pt, rank, max_batch_size=(B + world - 1) // world,
                                       chunk_bags=5, **kw, **extra)
        if variant == "fused_slow_owner" and rank == 1:  # updates land late: readers must wait for them
            apply = emb.apply_owned

            def slow_apply(rows, grads, apply=apply):
                time.sleep(0.3)
                apply(rows, grads)
            emb.apply_owned = slow_apply
        got = _train(emb, rank, world, weighted)
        res[(name, design, optimizer, variant, weighted)] = {
            "ref": ref, "got": got, "gids": torch.from_numpy(amap.storage_gids(rank)),
            "bytes": (ref_bytes, pt.counter.snapshot()), "stats": dict(emb.stats)}
    torch.distributed.barrier()  # every rank has set up every heap: no segment may have a name now
    res["names_during_run"] = heap_segments(job)
    return res


def _check(results, world, scenarios):
    refs = {(o, w): dense_reference(o, w) for o in ("sgd", "rowwise_adagrad") for w in (True, False)}
    base = np.cumsum([0] + [t.num_rows for t in tables()])
    for sc in scenarios:
        name, design, optimizer, variant, weighted = sc
        for r in range(world):
            (ro, rw, rm), (go, gw, gm) = results[r][sc]["ref"], results[r][sc]["got"]
            for step in range(STEPS + 1):  # the last: a no-grad forward after training
                assert torch.equal(go[step], ro[step]), f"{sc} rank {r} step {step}: output differs from collective"
            assert torch.equal(gw, rw), f"{sc} rank {r}: weights differ from the collective run"
            assert torch.equal(gm, rm), f"{sc} rank {r}: optimizer state differs from the collective run"
        ref_outs, ref_w = refs[(optimizer, weighted)]
        for step in range(STEPS):
            got = torch.cat([results[r][sc]["got"][0][step] for r in range(world)])
            torch.testing.assert_close(got, ref_outs[step], atol=1e-5, rtol=0, msg=lambda m: f"{sc} step {step}: {m}")
        seen = np.zeros(base[-1], bool)
        for r in range(world):
            gids = results[r][sc]["gids"]
            torch.testing.assert_close(results[r][sc]["got"][1], ref_w[gids], atol=1e-5, rtol=0,
                                       msg=lambda m: f"{sc} rank {r}: {m}")
            seen[gids.numpy()] = True
        assert seen.all()
        if variant == "unfused":  # the same exchanges: the same payload bytes, peer by peer, kind by kind
            for r in range(world):
                rb, pb = results[r][sc]["bytes"]
                assert (rb["sent"], rb["recv"], rb["by_kind"]) == (pb["sent"], pb["recv"], pb["by_kind"]), (sc, r)
        elif design == "send":  # every byte written into a peer is counted once by the writer, once by the reader
            sent = sum(results[r][sc]["bytes"][1]["sent_total"] for r in range(world))
            recv = sum(results[r][sc]["bytes"][1]["recv_total"] for r in range(world))
            assert sent == recv > 0, (sc, sent, recv)
        if variant == "fused_small_fetch":
            assert sum(results[r][sc]["stats"].get("fetch_overflows", 0) for r in range(world)) > 0
    for r in range(world):
        assert results[r]["names_during_run"] == [], "segment names must be unlinked once every rank mapped them"


def _scenarios(world, rph):
    """2 ranks: every plan, design, optimizer, fused and unfused; 4 ranks: every plan and design with SGD;
    2 hosts: the plans whose bags span ranks of both hosts."""
    out = []
    plans_ = ["row_wise", "partial_replicas"] if rph else ["table_wise", "row_wise", "replicas", "partial_replicas"]
    for p in plans_:
        for d in ["retrieve", "send"]:
            for o in (["sgd", "rowwise_adagrad"] if world == 2 else ["sgd"]):
                out.append((p, d, o, "fused", True))
            out.append((p, d, "sgd", "unfused", True))
    if world == 2:
        out += [("table_wise", "send", "rowwise_adagrad", "fused", False),  # feature blocks, unit scales
                ("row_wise", "send", "sgd", "fused", False),
                ("replicas", "retrieve", "rowwise_adagrad", "fused_small_fetch", True),
                ("row_wise", "retrieve", "sgd", "fused_slow_owner", True)]
    return out


def _lifetime_worker(rank, world, job):
    """Timeline, byte counts, output lifetime and the batch-size error of the fused send design."""
    pt = PgasTransport(job_id=job)
    owner, _, _ = plans(world)["table_wise"]
    amap = AddressMap.build(tables(), world, owner)
    emb = PgasShardedEmbedding(tables(), amap, pt, rank, design="send", optimizer=None, max_batch_size=B // world)
    (jf1, _), (jf2, _), (jf3, _) = batches()
    lo, hi = B * rank // world, B * (rank + 1) // world
    b1, b2, b3 = (j.slice_batch(lo, hi) for j in (jf1, jf2, jf3))
    tl = pt.enable_timeline()
    pt.counter.reset()
    out1 = emb(b1)
    keep = out1.clone()
    rec = {"timeline_bytes": tl.total_bytes, "sent": int(pt.counter.sent.sum()),
           "pooled_sent": pt.counter.by_kind.get("pooled", 0), "events": tl.n}
    out2 = emb(b2)
    rec["out1_intact_after_next"] = bool(torch.equal(out1, keep))  # double-buffered
    rec["out2_differs"] = not torch.equal(out2, keep)
    emb(b3)
    rec["out1_reused_after_two"] = not torch.equal(out1, keep)
    try:
        emb(jf1)  # the whole global batch: larger than the heap's output buffer
        rec["error"] = ""
    except InputError as e:
        rec["error"] = str(e)
    return rec


def _worker(rank, world, rph, job, scenarios):
    res = _equality_worker(rank, world, rph, job, scenarios)
    if world == 2:
        res["lifetime"] = _lifetime_worker(rank, world, job)
    return res


@pytest.mark.parametrize("world,rph", [(2, None), (4, None), (4, 2)], ids=["2ranks", "4ranks", "4ranks_2hosts"])
def test_bitwise_equal_to_collective_and_to_dense(world, rph):
    """Both designs, fused and unfused, bitwise against the collective transport and close to the dense
    model; 2 and 4 ranks on one host, 4 ranks on 2 hosts (heap within a host, collective across).
    At 2 ranks also: the timeline, byte counts, the output's lifetime and the batch-size error."""
    job = f"t{uuid.uuid4().hex[:10]}"
    scen = _scenarios(world, rph)
    results = spawn_local(_worker, world, rph, job, scen, timeout_s=300)
    assert heap_segments(job) == [], "segments left after a normal exit"
    _check(results, world, scen)
    if world == 2:
        for r, rec in enumerate(res["lifetime"] for res in results):
            assert rec["timeline_bytes"] == rec["sent"] > 0 and rec["events"] > 0, rec
            assert rec["pooled_sent"] > 0
            assert rec["out1_intact_after_next"] and rec["out2_differs"] and rec["out1_reused_after_two"], rec
            assert f"rank {r}" in rec["error"] and "exceeds" in rec["error"] and "embedscale-pgas" in rec["error"]


def _fault_worker(rank, world, job, fault):
    pt = PgasTransport(job_id=job, timeout_s=60)
    owner, _, _ = plans(world)["row_wise"]
    emb = PgasShardedEmbedding(tables(), AddressMap.build(tables(), world, owner), pt, rank, design="retrieve",
                               max_batch_size=B)
    (jf, c), = batches()[:1]
    lo, hi = B * rank // world, B * (rank + 1) // world
    out = emb(jf.slice_batch(lo, hi))
    if rank == 1:
        raise RuntimeError("injected failure in rank 1")
    if rank == 2:
        os.kill(os.getpid(), 9)
    (out * c[lo:hi]).sum().backward()  # rank 0 waits here for the gradients of ranks 1 and 2
    return "done"


@pytest.mark.parametrize("fault", ["after_setup", "kill_in_rendezvous"])
def test_no_segment_outlives_a_failed_job(fault, monkeypatch):
    """after_setup: of 3 ranks, rank 1 raises and rank 2 is SIGKILLed mid-step; kill_in_rendezvous: rank 1
    is SIGKILLed after creating its segment, before any rank unlinked one (the survivors clean up)."""
    job = f"t{uuid.uuid4().hex[:10]}"
    if fault == "kill_in_rendezvous":
        monkeypatch.setenv("EMBEDSCALE_PGAS_FAULT", "kill_after_create:1")
    with pytest.raises(RankFailed) as e:
        spawn_local(_fault_worker, 3 if fault == "after_setup" else 2, job, fault, timeout_s=90)
    assert heap_segments(job) == [], f"segments left after {fault}: {heap_segments(job)}"
    msg = str(e.value)
    if fault == "after_setup":  # the survivor names a rank that stopped instead of hanging
        assert "rank 0 failed" in msg and "exited while this rank waited" in msg, msg


def test_timeline_plot(tmp_path):
    tl = Timeline(capacity=4)
    for n in (100, 200, 300, 400, 500):
        tl.record(n, peer=1, kind="pooled")
    assert tl.n == 4 and tl.dropped == 1 and tl.total_bytes == 1000
    ev = tl.events()
    ev2 = dict(ev, nbytes=ev["nbytes"] * 2)
    base = [{"start_ns": int(ev["t_ns"][0]), "end_ns": int(ev["t_ns"][-1]) + 1000, "bytes": 1000}]
    p = plot_timeline([ev, ev2], tmp_path / "t.png", baseline=base)
    assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slot_bytes_from_plan_and_batch():
    amap = AddressMap.build(tables(), 2, plans(2)["row_wise"][0])
    small = slot_bytes_for(tables(), amap, max_batch_size=8)
    assert small == 64 << 10  # floor
    big = slot_bytes_for(tables(), amap, max_batch_size=1 << 20, design="send", cap=1 << 20)
    assert big == 1 << 20  # capped: larger messages stream through the ring
    mid = slot_bytes_for(tables(), amap, max_batch_size=4096, max_ids_per_bag=2, design="send", cap=1 << 30)
    assert mid % 64 == 0 and mid >= 4096 * 4 * 2 * 20
