"""Live row migration between two plans (``embedding.migrate``).

The reference for "the module after migrating to P2" is the existing re-shard path: train k steps under P1,
write a checkpoint (every rank's ``shard_state`` in the one checkpoint format), build the P2 module and load
the checkpoint's rows into it (``DistributedRun.restore``'s way: ``read_shards``, ``table_pieces``,
``load_rows``), train m more steps. Migrating instead must give the same bits: every step's pooled outputs and
losses, every row and the row-wise optimizer state, on 2 gloo ranks, for both transports (collective
all-to-all and the PGAS heap), both designs, with replicas that appear and disappear and owners that change.
The collective-transport module migrates in place (``migrate_in_place``: its map edited, its storage kept, its
rows compared by global id); the PGAS one into a freshly built P2 module (``migrate``). The bytes a migration
sends are checked against a brute-force count over the rows and a hand count; the in-place routes against the
whole-map ones (``migration_routes``), and what an in-place migration writes against a hand count.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.pgas import PgasTransport, heap_segments
from embedscale.data.batch import JaggedFeatures
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.migrate import (Placement, edit_map, in_place_routes, migrate, migrate_in_place,
                                         migration_routes, row_bytes)
from embedscale.embedding.pgas_lookup import HeapTooSmall, PgasShardedEmbedding
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import ConfigError
from embedscale.specs import TableSpec
from embedscale.train.checkpoint import read_manifest, read_shards, table_pieces, write_manifest, write_rank_file
from embedscale.train.launch import spawn_local
from embedscale.train.run import table_entry

DIM, B, K, M, LR, EPS, W = 4, 20, 3, 3, 0.3, 1e-8, 2
KEYS, ROWS = ["f0", "f1", "f2", "f3"], [40, 7, 7, 90]


def tables():
    return [TableSpec("t0", 40, DIM, features=["f0"]), TableSpec("t1", 7, DIM, features=["f1", "f2"], pooling="mean"),
            TableSpec("t2", 90, DIM, features=["f3"])]


def maps():
    """P1 and P2: rows scattered over the ranks by two seeds (most owners differ), and replicas that stay
    (t0 rows 1-2, t2 rows 5-6), disappear (t0 row 0, t1 row 3, t2 rows 7-8) and appear (t0 row 3, t2 rows
    10-11); t2 row 9 a replica held by its owner alone under P1."""
    ts = tables()
    r1, r2 = np.random.default_rng(7), np.random.default_rng(11)
    holders = np.ones((9, W), bool)
    holders[8] = False  # the owner is added by AddressMap.build
    p1 = AddressMap.build(ts, W, [r1.integers(0, W, t.num_rows) for t in ts],
                          [np.array([0, 1, 2]), np.array([3]), np.array([5, 6, 7, 8, 9])], holders)
    p2 = AddressMap.build(ts, W, [r2.integers(0, W, t.num_rows) for t in ts],
                          [np.array([1, 2, 3]), np.zeros(0, np.int64), np.array([5, 6, 10, 11])])
    return p1, p2


def batches(n):
    """Skewed multi-hot global batches (hot rows 0-8), empty bags, per-sample weights, regression targets."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        vals, lens = [], []
        for rows in ROWS:
            c = torch.randint(0, 4, (B,), generator=g)
            vals.append((torch.rand(int(c.sum()), generator=g) ** 3 * rows).long())
            lens.append(c)
        values = torch.cat(vals)
        out.append((JaggedFeatures(KEYS, values, torch.cat(lens), torch.rand(values.numel(), generator=g) + 0.5),
                    torch.randn(B, 4 * DIM, generator=g)))
    return out


def _module(kind, amap, transport, rank, design, optimizer):
    kw = dict(design=design, optimizer=optimizer, lr=LR, eps=EPS)
    if kind.startswith("pgas"):  # pgas_inplace: heap room for the migration to happen in it
        return PgasShardedEmbedding(tables(), amap, transport, rank, max_batch_size=-(-B // W), chunk_bags=7,
                                    storage_spare=1.0 if kind == "pgas_inplace" else 0.0, **kw)
    return ShardedEmbedding(tables(), amap, transport, rank, **kw)


def _train(emb, rank, steps):
    """Steps of a squared loss (its gradient depends on the rows): per step the pooled output and the loss."""
    outs, losses = [], []
    lo, hi = B * rank // W, B * (rank + 1) // W
    for jf, c in steps:
        out = emb(jf.slice_batch(lo, hi))
        loss = ((out - c[lo:hi]) ** 2).sum() / B
        loss.backward()
        outs.append(out.detach().clone())
        losses.append(loss.detach().clone())
    return outs, losses


def _state(emb, rank):
    """The rows this rank holds by global id (ascending; an edited map's free rows left out) and their state."""
    gids = emb.amap.storage_gids(rank)
    idx = np.flatnonzero(gids >= 0)
    idx = torch.from_numpy(idx[np.argsort(gids[idx], kind="stable")])
    return {"gids": torch.from_numpy(gids)[idx], "weight": emb.weight.detach()[idx].clone(),
            "momentum": emb.momentum[idx].clone() if emb.optimizer == "rowwise_adagrad" else torch.zeros(0)}


def _touched_by_gid(emb, rank) -> dict:
    gids = emb.amap.storage_gids(rank)
    return {int(g): bool(t) for g, t in zip(gids.tolist(), emb.touched.tolist()) if g >= 0}


def _checkpoint_reshard(old, new, rank, ckpt):
    """The existing re-shard path: old's rows written as a checkpoint (``DistributedRun.save``), read back
    into ``new`` by table and row id (``DistributedRun.restore``)."""
    st = old.shard_state()
    gids, base = st["gids"].numpy(), old.amap.table_base
    entries = {}
    for t, spec in enumerate(old.tables):
        sel = torch.from_numpy(np.flatnonzero((gids >= base[t]) & (gids < base[t + 1])))
        entries[spec.name] = table_entry(st["weight"][sel], st["momentum"][sel] if "momentum" in st else None,
                                         gids[sel.numpy()] - base[t])
    write_rank_file(ckpt, rank, {"rank": rank, "world_size": W, "tables": entries})
    dist.barrier()
    if rank == 0:
        write_manifest(ckpt, W, {"kind": "plan", "tables": [t.name for t in old.tables]})
    dist.barrier()
    shards = read_shards(ckpt, read_manifest(ckpt))
    g, ws, ms = [], [], []
    for t, spec in enumerate(new.tables):
        r, w, m = table_pieces(shards, spec.name)
        g.append(r + base[t])
        ws.append(w)
        ms.append(m)
    mom = torch.cat(ms) if new.optimizer == "rowwise_adagrad" else None
    assert new.load_rows(np.concatenate(g), torch.cat(ws), mom) == new.weight.shape[0]
    if hasattr(old, "close"):
        old.close()


def _worker(rank, world, job, tmp, scenarios):
    p1, p2 = maps()
    ct = CollectiveTransport()
    pt = PgasTransport(job_id=job, slot_bytes=256)  # small ring slots: the migration streams in rounds
    steps = batches(K + M)
    res = {}
    for kind, design, optimizer in scenarios:
        tr = pt if kind.startswith("pgas") else ct
        # migrated: k steps under P1, migrate, m steps under P2
        a = _module(kind, p1, tr, rank, design, optimizer)
        a.track_touched()
        outs_a, loss_a = _train(a, rank, steps[:K])
        was = _touched_by_gid(a, rank)  # row -> updated since tracking
        if kind == "pgas":  # a heap without room for P2's storage: refused before anything moves, then rebuilt
            cap = a._cap
            a._cap = min(int(p2.storage_rows(q)) for q in range(W)) - 1  # as if its heap were one row short
            with pytest.raises(HeapTooSmall):
                migrate_in_place(a, p2)
            a._cap = cap
            a2 = _module(kind, p2, tr, rank, design, optimizer)
            mig = migrate(a, a2)
        else:  # in place: the running module's map edited, its storage kept (pgas_inplace: inside its heap)
            a2 = a
            mig = migrate_in_place(a, p2)
        after = _state(a2, rank)
        now = _touched_by_gid(a2, rank)
        touched = [now[g] for g in sorted(p2.storage_gids(rank).tolist())]
        want = [was.get(g, True) for g in sorted(p2.storage_gids(rank).tolist())]  # kept: its bit; received: updated
        o, lo = _train(a2, rank, steps[K:])
        # reference: k steps under P1, a checkpoint, the P2 module built from it, m steps
        b = _module(kind, p1, tr, rank, design, optimizer)
        outs_b, loss_b = _train(b, rank, steps[:K])
        b2 = _module(kind, p2, tr, rank, design, optimizer)
        _checkpoint_reshard(b, b2, rank, tmp / f"ckpt-{kind}-{design}-{optimizer}")
        ref_after = _state(b2, rank)
        ob, lb = _train(b2, rank, steps[K:])
        res[(kind, design, optimizer)] = {
            "migrated": (outs_a + o, loss_a + lo, _state(a2, rank), after),
            "reference": (outs_b + ob, loss_b + lb, _state(b2, rank), ref_after),
            "migration": mig.to_dict(), "touched": (touched, want)}
        for m in (a2, b2):
            if hasattr(m, "close"):
                m.close()
    dist.barrier()
    return res


SCENARIOS = [("collective", "retrieve", "rowwise_adagrad"), ("collective", "send", "rowwise_adagrad"),
             ("collective", "retrieve", "sgd"), ("pgas", "retrieve", "rowwise_adagrad"),
             ("pgas_inplace", "retrieve", "rowwise_adagrad"), ("pgas_inplace", "send", "rowwise_adagrad")]


def brute_force_moves(old: AddressMap, new: AddressMap) -> np.ndarray:
    """``[W, W]`` rows rank p sends rank q: row by row, who holds it under each plan (Python sets)."""
    held_old = [set(old.storage_gids(q).tolist()) for q in range(W)]
    held_new = [set(new.storage_gids(q).tolist()) for q in range(W)]
    out = np.zeros((W, W), np.int64)
    for g in range(old.num_rows):
        src = int(old.owner_of(np.array([g]))[0])
        for q in range(W):
            if g in held_new[q] and g not in held_old[q]:
                out[src, q] += 1
    return out


def test_migrate_equals_checkpoint_reshard(tmp_path):
    """Train k steps under P1, migrate to P2, train m steps == train k steps, checkpoint, restore under P2,
    train m steps: bitwise (outputs, losses, rows, row-wise state) for both transports and designs."""
    job = f"m{uuid.uuid4().hex[:10]}"
    results = spawn_local(_worker, W, job, tmp_path, SCENARIOS, timeout_s=300)
    assert heap_segments(job) == [], "heap segments left after a normal exit"
    p1, p2 = maps()
    moves = brute_force_moves(p1, p2)
    assert moves.sum() > 0 and moves[0, 1] > 0 and moves[1, 0] > 0  # rows move both ways
    for sc in SCENARIOS:
        for r in range(W):
            res = results[r][sc]
            (ao, al, ast, a0), (bo, bl, bst, b0) = res["migrated"], res["reference"]
            for name in ("gids", "weight", "momentum"):
                assert torch.equal(a0[name], b0[name]), f"{sc} rank {r}: {name} right after the migration"
                assert torch.equal(ast[name], bst[name]), f"{sc} rank {r}: {name} after {M} more steps"
            for s in range(K + M):
                assert torch.equal(ao[s], bo[s]), f"{sc} rank {r} step {s}: pooled output"
                assert torch.equal(al[s], bl[s]), f"{sc} rank {r} step {s}: loss"
            mig = res["migration"]
            assert mig["in_place"] == (sc[0] != "pgas")
            rb = DIM * 4 + (4 if sc[2] == "rowwise_adagrad" else 0)
            assert mig["row_bytes"] == rb
            assert mig["rows_sent"] == moves[r].sum() and mig["rows_received"] == moves[:, r].sum(), (sc, r, mig)
            assert mig["bytes_sent"] == mig["bytes_planned"] == moves[r].sum() * rb, (sc, r, mig)
            assert mig["sent_per_peer"] == (moves[r] * rb).tolist()
            assert mig["rows_kept"] + mig["rows_received"] == p2.storage_rows(r)
            assert mig["replicas_added"] > 0 and mig["replicas_dropped"] > 0
            # delta tracking: a kept row keeps its bit, a received row counts as updated
            got, want = res["touched"]
            assert got == want and sum(want) < len(want), (sc, r)


def test_bytes_against_hand_count():
    """One table of 8 rows, dim 4, float32 on 2 ranks. P1: rows 0-3 on rank 0, 4-7 on rank 1, row 0
    replicated on both. P2: rows 0-2 and 6 on rank 0 (row 6 moves 1 -> 0), rows 3-5, 7 on rank 1 (row 3
    moves 0 -> 1), row 0 no longer replicated (dropped on rank 1), row 5 replicated (appears on rank 0).
    Rank 0 sends row 3: 1 row; rank 1 sends rows 5 and 6: 2 rows. A row is 16 weight bytes + 4 of
    row-wise Adagrad state = 20 bytes: rank 0 sends 20 bytes, rank 1 40."""
    ts = [TableSpec("t", 8, 4, features=["f"])]
    p1 = AddressMap.build(ts, 2, [np.array([0, 0, 0, 0, 1, 1, 1, 1])], [np.array([0])])
    p2 = AddressMap.build(ts, 2, [np.array([0, 0, 0, 1, 1, 1, 0, 1])], [np.array([5])])
    r0, r1 = migration_routes(p1, p2, 0), migration_routes(p1, p2, 1)
    assert [g.tolist() for g in r0.send_gids] == [[], [3]] and [g.tolist() for g in r1.send_gids] == [[5, 6], []]
    assert [g.tolist() for g in r0.recv_gids] == [[], [5, 6]] and [g.tolist() for g in r1.recv_gids] == [[3], []]
    assert r0.keep_gids.tolist() == [0, 1, 2] and r1.keep_gids.tolist() == [4, 5, 7]
    # rows 0-2 at rank 0's storage rows: owned region 1, 2, 3 (row 0 is a replica, after the owned rows)
    assert r0.keep_rows.tolist() == [3, 0, 1]
    emb = ShardedEmbedding(ts, p1, _NoTransport(), 0, optimizer="rowwise_adagrad")
    assert row_bytes(emb) == 20
    assert (r0.rows_sent * row_bytes(emb), r1.rows_sent * row_bytes(emb)) == (20, 40)
    emb_sgd = ShardedEmbedding(ts, p1, _NoTransport(), 0, optimizer="sgd")
    assert row_bytes(emb_sgd) == 16


def test_edited_map_is_the_new_plan_and_routes_are_the_whole_map_routes():
    """``edit_map`` turns P1's map into one that decodes as P2's (every row's owner, holders and the rank each
    rank reads it from, brute force over all rows) while every row that stays plain on its rank keeps its
    storage row; ``in_place_routes`` (from the changed rows and the replicas alone) sends and receives exactly
    what ``migration_routes`` (both whole maps) does; and so on for a second edit back to P1."""
    p1, p2 = maps()
    g = np.arange(p1.num_rows)
    cur = p1
    for target in (p2, p1):
        e = edit_map(cur, Placement.of_map(target))
        new = e.new
        assert np.array_equal(new.owner_of(g), target.owner_of(g))
        assert np.array_equal(new.holders_of(g), target.holders_of(g))
        for r in range(W):
            assert np.array_equal(new.fetch(r, g)[0], target.fetch(r, g)[0])
            before, after = cur.storage_gids(r), new.storage_gids(r)
            assert sorted(after[after >= 0].tolist()) == sorted(target.storage_gids(r).tolist())
            stay = [q for q, x in enumerate(before[:cur.num_owned()[r]]) if x >= 0 and new.holders_of([x])[0, r]
                    and new.slot_of([x])[0] < 0]
            assert stay and all(after[q] == before[q] for q in stay), r  # a plain row that stays keeps its row
            a, b = in_place_routes(e, r), migration_routes(cur, target, r)
            assert [x.tolist() for x in a.send_gids] == [x.tolist() for x in b.send_gids], r
            assert [x.tolist() for x in a.recv_gids] == [x.tolist() for x in b.recv_gids], r
            assert a.rows_kept == b.keep_gids.size
            # the rows a route writes are where the new map puts them, the rows it reads where the old one had them
            for q in range(W):
                assert after[a.recv_rows[q]].tolist() == a.recv_gids[q].tolist()
                assert before[a.send_rows[q]].tolist() == a.send_gids[q].tolist()
            assert before[a.local_src].tolist() == after[a.local_dst].tolist()
            pb = {x: q for q, x in enumerate(before.tolist()) if x >= 0}
            pa = {x: q for q, x in enumerate(after.tolist()) if x >= 0}
            assert {x for x in pb if x in pa and pb[x] != pa[x]} == set(before[a.local_src].tolist())  # every one
        changed = {x for x in g.tolist() if (cur.slot_of([x])[0] >= 0, cur.owner_of([x])[0])
                   != (target.slot_of([x])[0] >= 0, target.owner_of([x])[0])
                   and not (cur.slot_of([x])[0] >= 0 and target.slot_of([x])[0] >= 0)}
        assert set(e.changed.tolist()) == changed  # the rows whose owned region changes, by brute force
        cur = new


def _hand_worker(rank, world):
    """One table of 1,000 rows (module docstring of the test below); rows and state set from the global id."""
    ts = [TableSpec("t", 1000, 4, features=["f"])]
    o1 = np.repeat([0, 1], 500)
    p1 = AddressMap.build(ts, 2, [o1], [np.array([0, 1])])
    o2 = o1.copy()
    o2[[10, 11]], o2[600] = 1, 0
    emb = ShardedEmbedding(ts, p1, CollectiveTransport(), rank, optimizer="rowwise_adagrad")
    with torch.no_grad():  # one lookup: the pooling table gets its spare rows after the storage
        emb(JaggedFeatures(["f"], torch.tensor([3, 700]), torch.tensor([1, 1])))
        gids = torch.from_numpy(p1.storage_gids(rank))
        emb.weight.copy_(gids[:, None].float() + torch.arange(4.0) / 10)
        emb.momentum.copy_(gids.float() / 1000)
    w0, ptr = emb.weight.clone(), emb.weight.data_ptr()
    mig = migrate_in_place(emb, Placement.of_arrays(ts, 2, [o2], [np.array([1, 2])]))
    return {"mig": mig.to_dict(), "before": w0, "after": emb.weight.clone(), "momentum": emb.momentum.clone(),
            "gids": torch.from_numpy(emb.amap.storage_gids(rank)), "same_ptr": emb.weight.data_ptr() == ptr}


def test_in_place_migration_writes_only_what_moves():
    """One table of 1,000 rows on 2 ranks. P1: rows 0-499 on rank 0, 500-999 on rank 1, rows 0-1 replicated.
    P2: rows 10 and 11 move to rank 1, row 600 to rank 0, row 0 stops being a replica (rank 0 keeps it),
    row 2 becomes one, row 1 stays one. By hand:

    * rank 0 (storage: rows 2-499 at 0-497, replicas 0, 1 at 498, 499): rows 2, 10, 11 leave its owned region
      (offsets 0, 8, 9 free); rows 0 and 600 arrive there, in id order at 0 and 8; replica 1 stays at 499,
      new replica 2 takes row 0's place, 498. Sends rows 2, 10, 11 (3); receives row 600 (1); moves rows 0
      (498 -> 0) and 2 (0 -> 498) locally: 3 rows written, at storage rows 0, 8, 498; codes changed: rows 0,
      2, 10, 11, 600 (5).
    * rank 1 (rows 500-999 at 0-499, replicas 0, 1 at 500, 501): row 600 leaves (offset 100); rows 10, 11
      arrive, at 100 and, one row short, at 500: the owned region grows by one into the replica region's
      head (replica 0's row, dropped), replica 1 stays at 501 and new replica 2 comes at 502. Sends row 600
      (1), receives rows 2, 10, 11 (3), moves nothing locally: 3 rows written, at 100, 500, 502; codes
      changed: rows 0, 2, 10, 11, 600 (5; row 1's code, rank 1 offset 501, is the same).

    Every other storage row keeps its bits and the storage stays the same tensor (rank 1 grows into the
    pooling table's spare rows); every row held holds its own value and row-wise state."""
    res = spawn_local(_hand_worker, 2, timeout_s=300)
    want = {0: dict(sent=3, recv=1, local=2, written=[0, 8, 498], codes=5, rows=500),
            1: dict(sent=1, recv=3, local=0, written=[100, 500, 502], codes=5, rows=503)}
    for r in range(2):
        m, w = res[r]["mig"], want[r]
        assert (m["rows_sent"], m["rows_received"], m["local_moves"]) == (w["sent"], w["recv"], w["local"]), m
        assert m["rows_written"] == w["recv"] + w["local"] == len(w["written"])
        assert m["codes_changed"] == w["codes"] and m["storage_rows"] == w["rows"], m
        assert m["in_place"] and not m["storage_grew"] and res[r]["same_ptr"]
        before, after, gids = res[r]["before"], res[r]["after"], res[r]["gids"]
        n = min(before.shape[0], after.shape[0])
        untouched = torch.ones(n, dtype=torch.bool)
        untouched[[x for x in w["written"] if x < n]] = False
        assert torch.equal(after[:n][untouched], before[:n][untouched])
        live = gids >= 0
        assert torch.equal(after[live], gids[live][:, None].float() + torch.arange(4.0) / 10)
        assert torch.equal(res[r]["momentum"][live], gids[live].float() / 1000)
        assert int((~live).sum()) == (1 if r == 0 else 0)  # free rows: rank 0's offset 9


def test_holders_of_is_storage_membership():
    """``AddressMap.holders_of`` (owners, replicas on every rank, a replica held by its owner alone) against
    each rank's ``storage_gids``, row by row."""
    for amap in maps():
        h = amap.holders_of(np.arange(amap.num_rows))
        for q in range(W):
            held = set(amap.storage_gids(q).tolist())
            assert h[:, q].tolist() == [g in held for g in range(amap.num_rows)]


def test_routes_refuse_other_tables_and_world():
    ts = [TableSpec("t", 8, 4, features=["f"])]
    p1 = AddressMap.build(ts, 2, [np.zeros(8, np.int64)])
    with pytest.raises(ConfigError, match="4 ranks"):
        migration_routes(p1, AddressMap.build(ts, 4, [np.zeros(8, np.int64)]), 0)
    with pytest.raises(ConfigError, match="tables"):
        migration_routes(p1, AddressMap.build([TableSpec("t", 9, 4, features=["f"])], 2, [np.zeros(9, np.int64)]), 0)


def test_migrate_refuses_modules_that_differ():
    """Another optimizer, another world size, or a prefetched batch pending: a named error, nothing moved."""
    from embedscale.embedding.migrate import check_compatible
    from embedscale.errors import EmbedscaleError

    ts = [TableSpec("t", 8, 4, features=["f"])]
    p1 = AddressMap.build(ts, 2, [np.array([0, 0, 0, 0, 1, 1, 1, 1])])
    p2 = AddressMap.build(ts, 2, [np.array([0, 1, 0, 1, 0, 1, 0, 1])])
    old = ShardedEmbedding(ts, p1, _NoTransport(), 0, optimizer="rowwise_adagrad")
    with pytest.raises(ConfigError, match="optimizer"):
        migrate(old, ShardedEmbedding(ts, p2, _NoTransport(), 0, optimizer="sgd"))
    with pytest.raises(ConfigError, match="4 ranks"):
        migrate(old, ShardedEmbedding(ts, AddressMap.build(ts, 4, [np.zeros(8, np.int64)]), _NoTransport(), 0,
                                      optimizer="rowwise_adagrad"))
    old.prefetch(JaggedFeatures(["f"], torch.tensor([1, 2]), torch.tensor([1, 1])), background=False)
    with pytest.raises(EmbedscaleError, match="prefetched"):
        check_compatible(old, ShardedEmbedding(ts, p2, _NoTransport(), 0, optimizer="rowwise_adagrad"))


class _NoTransport:
    """A transport stand-in for modules that never look anything up."""

    def exchange(self, *a, **k):  # pragma: no cover - never called
        raise AssertionError("no exchange expected")


# -- the drift monitor in an N-rank run (train.replan_every) ----------------------------------------------------

DRIFT_B, DRIFT_STEPS, EVERY = 64, 7, 4


def drift_data(path):
    """A dataset of a DriftingStream's batches in step order (row ids = the stream's id indices; the hot set
    of 8 rows per table rotates every 4 steps), its last fifth the eval split."""
    from embedscale.data.drift_stream import DriftConfig, DriftingStream
    from embedscale.data.shards import ShardWriter, SparseFeatureInfo

    cfg = DriftConfig(tables=("C1", "C2", "C3"), initial_ids=200, new_ids_per_step=0, hot_ids=8, hot_share=0.9,
                      rotate_every=EVERY, batch_size=DRIFT_B, num_dense=3)
    s = DriftingStream(cfg, seed=5)
    steps = 10  # 8 training steps' rows, then 2 of eval
    with ShardWriter(path, ["I1", "I2", "I3"], [SparseFeatureInfo(t, 200) for t in cfg.tables],
                     shard_rows=2 * DRIFT_B) as w:
        for step in range(steps):
            cols = s.batch(step)
            w.write(cols.labels, cols.dense, s.batch_indices(step))


def drift_config(tmp, data_dir, **train):
    from embedscale.specs import RunConfig, from_dict

    return from_dict(RunConfig, {
        "name": "drift", "out_dir": str(tmp / "runs"),
        "data": {"source": "shards", "path": str(data_dir), "eval_fraction": 0.2},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8]},
        "train": {"batch_size": DRIFT_B, "max_steps": DRIFT_STEPS, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                  "eval_every": 0, "checkpoint_every": EVERY, "sparse_optimizer": "rowwise_adagrad",
                  "dense_optimizer": "adagrad", "prefetch": 0, **train},
        "dist": {"plan": "oper", "timeout_s": 300}})


def _drift_rank(rank, world, cfg_dict, run_dir, resume_from):
    from embedscale.specs import RunConfig, from_dict
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False, resume_from=resume_from)
    return True


def test_run_replans_and_equals_restart_under_new_plan(tmp_path):
    """On a drifting stream a 2-rank run with train.replan_every re-plans at step 4 (replans.csv, summary) and
    its losses, rows and dense state equal those of the run restarted from its step-4 checkpoint under the
    new plan; its last checkpoint, a delta on the step-4 one, holds the same state as the restart's full one."""
    import json

    from embedscale.specs import to_dict
    from embedscale.train.checkpoint import step_dir
    from embedscale.train.replan import read_replans

    data = tmp_path / "data"
    drift_data(data)
    live = tmp_path / "live"
    # full checkpoint at step 4 (before the re-plan), a delta at step 7: the rows tracked across the migration
    cfg = drift_config(tmp_path, data, replan_every=EVERY, replan_min_gain=0.0, replan_weigh_costs=False,
                       replan_lag=0, checkpoint_full_every=2 * EVERY)  # the re-plan at the check (restart below)
    spawn_local(_drift_rank, W, to_dict(cfg), str(live), None, timeout_s=600)
    assert read_manifest(step_dir(live, DRIFT_STEPS))["delta"]["base_step"] == EVERY
    rows = read_replans(live)
    assert [int(r["step"]) for r in rows] == [EVERY], rows
    rec = rows[0]
    assert int(rec["rows_moved"]) > 0 and int(rec["bytes"]) > 0 and float(rec["gain"]) > 0
    assert float(rec["balance_after"]) <= float(rec["balance_before"])
    summary = json.loads((live / "summary.json").read_text())
    assert summary["replan_checks"] == 1 and [r["step"] for r in summary["replans"]] == [EVERY]
    new_plan = live / "replans" / f"step-{EVERY}"
    assert (new_plan / "plan.json").exists()
    for png in ("replans.png", "curves.png"):  # the re-plans drawn (balance before/after, rows moved, time)
        assert (live / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # the reference: restarted from the step-4 checkpoint under the new plan, no monitor
    ref = tmp_path / "restart"
    rcfg = drift_config(tmp_path, data, replan_every=0)
    rcfg.dist.plan = str(new_plan)
    spawn_local(_drift_rank, W, to_dict(rcfg), str(ref), str(step_dir(live, EVERY)), timeout_s=600)
    assert_same_run(live, ref, DRIFT_STEPS)


def assert_same_run(a_dir, b_dir, steps: int) -> tuple[dict, dict]:
    """The last checkpoints of two runs are at ``steps`` and hold the same losses, rows, row-wise state and dense
    state, bit for bit; returns both (``load_checkpoint``)."""
    from embedscale.train.checkpoint import load_checkpoint

    a, b = load_checkpoint(a_dir), load_checkpoint(b_dir)
    assert a["step"] == b["step"] == steps
    assert a["losses"] == b["losses"]
    for name in a["tables"]:
        assert torch.equal(a["tables"][name]["weight"], b["tables"][name]["weight"]), name
        assert torch.equal(a["tables"][name]["momentum"], b["tables"][name]["momentum"]), name
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k
    return a, b


def test_resume_restores_the_rolling_profile_and_replans_alike(tmp_path):
    """A 2-rank run with train.replan_every 4 re-plans at step 4; the same run resumed from its step-4
    checkpoint (written before the step-4 check) restores every rank's rolling profile from the rank files,
    so it checks at step 4 too (an empty profile would skip that check) and decides as the uninterrupted
    run: the same checks, re-plans (replans.csv) and plans, array for array."""
    import json

    from embedscale.plan.plan import Plan
    from embedscale.specs import to_dict
    from embedscale.train.checkpoint import step_dir
    from embedscale.train.replan import read_replans

    data = tmp_path / "data"
    drift_data(data)
    cfg = drift_config(tmp_path, data, replan_every=EVERY, replan_min_gain=0.0, replan_weigh_costs=False,
                       replan_lag=0, max_steps=2 * EVERY + 1)  # the re-plan at the check step
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    spawn_local(_drift_rank, W, to_dict(cfg), str(whole), None, timeout_s=600)
    spawn_local(_drift_rank, W, to_dict(cfg), str(resumed), str(step_dir(whole, EVERY)), timeout_s=600)
    keys = ("step", "reason", "gain", "rows_moved", "bytes", "rows_written", "balance_before", "balance_after")
    ra, rb = ([{k: r[k] for k in keys} for r in read_replans(rd)] for rd in (whole, resumed))
    assert ra == rb and [int(r["step"]) for r in ra][:1] == [EVERY], (ra, rb)
    summary = [json.loads((rd / "summary.json").read_text()) for rd in (whole, resumed)]
    assert summary[0]["replan_checks"] == summary[1]["replan_checks"] >= 1
    for step in (int(r["step"]) for r in ra):
        a, b = Plan.load(whole / "replans" / f"step-{step}"), Plan.load(resumed / "replans" / f"step-{step}")
        for name in ("part_table", "part_start", "part_stop", "owner_of_part", "holders", "fetch"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (step, name)
        for t in range(len(a.tables)):
            assert np.array_equal(a.order(t), b.order(t)), (step, t)


def hand_cost(plan, counts: dict, samples: float, topo, batch: int) -> dict:
    """OPER eqs. 2-5 (``traffic="access"``, training) worked in plain Python from the plan's arrays and the
    topology's figures, partition by partition: every rank reads row k ``A_k = B c_k / samples`` times from its
    fetch rank (``S_k A_k`` bytes the server looks up at ``1 / local_bw``; a remote read also crosses the link
    ``i <- j`` twice, the row and its gradient, at ``1 / bw``), one latency round per direction (the slowest
    link a rank reads over), and a row held by ``h > 1`` ranks is all-reduced among them (``2 (h-1)/h S_k``
    per holder). Returns per-rank lookup, communication and total (microseconds per iteration)."""
    m = plan.world_size
    host = [r // topo.ranks_per_host for r in range(m)]
    bw = [[topo.local_bw if i == j else topo.intra_host_bw if host[i] == host[j] else topo.inter_host_bw
           for j in range(m)] for i in range(m)]
    lat = [[0.0 if i == j else topo.intra_host_latency_us if host[i] == host[j] else topo.inter_host_latency_us
            for j in range(m)] for i in range(m)]
    lookup, link, slowest, allreduce = [0.0] * m, [0.0] * m, [0.0] * m, [0.0] * m
    for t, tab in enumerate(plan.tables):
        order, c = plan.order(t), np.asarray(counts[tab.name], dtype=np.float64)
        for p in range(plan.table_partitions(t).start, plan.table_partitions(t).stop):
            rows = order[plan.part_start[p]:plan.part_stop[p]]
            vol = batch * float(c[rows].sum()) / samples * tab.row_bytes  # bytes each rank reads of it
            holders = [j for j in range(m) if plan.holders[p, j]]
            for i in range(m):
                j = int(plan.fetch[p, i])
                lookup[j] += vol / (bw[j][j] * 1e3)
                if j != i and vol > 0:
                    link[i] += 2 * vol / (bw[i][j] * 1e3)
                    slowest[i] = max(slowest[i], lat[i][j])
            h = len(holders)
            if h > 1:
                for j in holders:
                    allreduce[j] += 2 * (h - 1) / h * len(rows) * tab.row_bytes / (topo.allreduce_bw * 1e3)
    comm = np.array(link) + 2 * np.array(slowest) + np.array(allreduce)
    return {"lookup": np.array(lookup), "comm": comm, "total": np.array(lookup) + comm}


def test_drift_and_plan_returns_the_fresh_plan_and_balances():
    """``plan.drift.drift_and_plan`` (and ``drift``, its report alone): each plan's bottleneck, max / mean
    per-rank cost and degrees of balance on the old and the new profile, the gain of the fresh plan it returns
    and the rows whose owner changes, against OPER's equations worked by hand (:func:`hand_cost`) and a row by
    row count; and the re-plan rule at the threshold."""
    from embedscale.data.profile import AccessProfile
    from embedscale.plan.api import make_plan
    from embedscale.plan.drift import drift, drift_and_plan
    from embedscale.specs import Topology

    ts = [TableSpec("a", 300, 4, features=["a"]), TableSpec("b", 200, 4, features=["b"])]
    rng = np.random.default_rng(0)
    old = AccessProfile({"a": rng.zipf(1.3, 300).astype(float), "b": rng.zipf(1.3, 200).astype(float)}, 1000)
    new = AccessProfile({"a": old.tables["a"][::-1].copy(), "b": np.roll(old.tables["b"], 77)}, 1000)
    topo = Topology(ranks_per_host=4)
    plan = make_plan("oper", ts, old, topo, batch_size=64)
    rep, fresh = drift_and_plan(plan, new, topo, batch_size=64, min_gain=0.0)
    dob = lambda x: float(x.min() / x.max())  # noqa: E731
    hand = {"before": hand_cost(plan, old.tables, old.samples, topo, 64),
            "after": hand_cost(plan, new.tables, new.samples, topo, 64),
            "replanned": hand_cost(fresh, new.tables, new.samples, topo, 64)}
    for key, h in hand.items():
        tot = h["total"]
        assert rep[key]["max_rank_cost"] == pytest.approx(tot.max(), rel=1e-9), key
        assert rep[key]["balance"] == pytest.approx(tot.max() / tot.mean(), rel=1e-9), key
        assert rep[key]["dob_lookup"] == pytest.approx(dob(h["lookup"]), rel=1e-9), key
        assert rep[key]["dob_comm"] == pytest.approx(dob(h["comm"]), rel=1e-9), key
    gain = 1 - hand["replanned"]["total"].max() / hand["after"]["total"].max()
    assert rep["replan_gain"] == pytest.approx(gain, rel=1e-9)
    moved = sum(int(np.count_nonzero(plan.owner(t.name, np.arange(t.num_rows)) != fresh.owner(t.name, np.arange(t.num_rows))))
                for t in ts)
    assert rep["rows_moved"] == moved
    degraded = dob(hand["after"]["lookup"]) < 0.9 or dob(hand["after"]["comm"]) < 0.9
    assert rep["replan"] == (gain > 0.0 or degraded)
    # drift: the same verdict and figures, checked against the same hand computation
    alone = drift(plan, new, topo, batch_size=64, min_gain=0.0)
    assert alone["replan"] == rep["replan"]
    for key in ("after", "replanned"):
        assert alone[key]["max_rank_cost"] == pytest.approx(hand[key]["total"].max(), rel=1e-9), key
    high, _ = drift_and_plan(plan, new, topo, batch_size=64, min_gain=0.999, dob_floor=0.0)
    assert high["replan"] is False and "keep the plan" in high["reason"]


def test_one_process_refuses_replan_every(tmp_path):
    """``train.replan_every`` in a run of one process (nothing to re-plan between ranks) is a ConfigError naming
    the key, from ``workflow.train``, ``workflow.run_main`` and the ``train`` command (exit 2, ``error: ...``),
    before anything is written; the same config with ``train.replan_every 0`` trains."""
    from click.testing import CliRunner

    from embedscale import workflow
    from embedscale.cli import main
    from embedscale.specs import dump_config

    data = tmp_path / "data"
    drift_data(data)
    cfg = drift_config(tmp_path, data, replan_every=EVERY, max_steps=2, checkpoint_every=0)
    cfg.dist.nproc = 1
    run = tmp_path / "one"
    with pytest.raises(ConfigError, match=r"train\.replan_every 4"):
        workflow.train(cfg, run)
    assert not run.exists()
    with pytest.raises(ConfigError, match=r"train\.replan_every 4"):
        workflow.run_main(cfg, progress=False)
    assert not (tmp_path / "runs").exists()
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    r = CliRunner().invoke(main, ["train", "--config", str(tmp_path / "cfg.yaml"), "--no-progress", "--run-dir",
                                  str(run)])
    assert r.exit_code == 2 and "error: train.replan_every 4" in r.output and "Traceback" not in r.output, r.output
    assert not run.exists()
    cfg.train.replan_every = 0
    assert workflow.train(cfg, run, progress=False)["steps"] == 2


def test_incremental_plan_moves_few_rows_and_balances():
    """``plan.incremental``: a hot set that lands on one rank under the running plan. The incremental plan keeps
    every other row where it was (owners compared row by row), takes the fresh plan's replicas, moves at most
    ``max_moves`` rows, and balances the lookups (DoB from a brute-force per-row count of eq. 2, checked
    against ``plan.cost.evaluate``), while the plan from scratch moves a large part of the tables."""
    from embedscale.data.profile import AccessProfile
    from embedscale.plan.api import make_plan
    from embedscale.plan.cost import dob, evaluate
    from embedscale.plan.drift import rows_moved
    from embedscale.plan.incremental import incremental_plan, row_placement
    from embedscale.specs import Topology

    ts = [TableSpec("a", 3000, 8, features=["a"]), TableSpec("b", 2000, 8, features=["b"])]
    rng = np.random.default_rng(0)
    old = AccessProfile({"a": rng.poisson(5, 3000).astype(float), "b": rng.poisson(5, 2000).astype(float)}, 10_000)
    topo, bs = Topology(ranks_per_host=4), 64
    plan = make_plan("oper", ts, old, topo, batch_size=bs)
    new_counts = {t.name: rng.poisson(5, t.num_rows).astype(float) for t in ts}
    own_a = plan.owner("a", np.arange(3000))
    hot = np.flatnonzero(own_a == 0)[:12]  # every hot row on rank 0
    new_counts["a"][hot] += np.linspace(300, 3000, hot.size)
    new = AccessProfile(new_counts, 10_000)
    assert evaluate(plan, new, topo, batch_size=bs).dob_lookup < 0.8
    fresh = make_plan("oper", ts, new, topo, batch_size=bs)
    inc, changed = incremental_plan(plan, fresh, new, batch_size=bs, max_moves=200)
    inc.validate()
    moved_rows, n_rep = 0, 0
    for t, tab in enumerate(ts):
        o_old, o_new = plan.owner(tab.name, np.arange(tab.num_rows)), inc.owner(tab.name, np.arange(tab.num_rows))
        f_own, f_mask = row_placement(fresh, t)
        _, i_mask = row_placement(inc, t)
        rep = np.array([bin(int(m)).count("1") > 1 for m in f_mask])
        assert np.array_equal(i_mask[rep], f_mask[rep]), tab.name  # the fresh plan's replicas, row by row
        assert not any(bin(int(m)).count("1") > 1 for m in i_mask[~rep]), tab.name  # and no others
        n_rep += int(rep.sum())
        moved_rows += int(np.count_nonzero(o_old != o_new))
    # at most max_moves rebalancing moves, plus replicated rows whose old owner is not among their holders
    assert moved_rows == changed <= 200 + n_rep, (changed, n_rep)
    # eq. 2 by brute force: every rank reads every row from its fetch rank, A_k = B c_k / samples times S_k
    load = np.zeros(4)
    for tab in ts:
        a_k = bs * new.tables[tab.name] / new.samples * tab.row_bytes
        for i in range(4):
            load += np.bincount(inc.fetch_rank(tab.name, np.arange(tab.num_rows), i), weights=a_k, minlength=4)
    cost = evaluate(inc, new, topo, batch_size=bs, part_counts=inc.part_counts)
    np.testing.assert_allclose(cost.lookup_bytes_per_rank, load, rtol=1e-9)
    assert dob(load) >= 0.95, load
    assert rows_moved(plan, inc)["rows_moved"] == changed < rows_moved(plan, fresh)["rows_moved"] / 10


def test_monitor_check_keeps_a_plan_that_holds_and_prefers_the_incremental_one():
    """Rank 0's check (``DriftMonitor._check``, no collectives): on the profile the plan was made for it keeps
    the plan without a search (no fresh plan); on a profile whose hot rows all sit on rank 0 it re-plans with
    the incremental plan, which moves a small fraction of the rows the plan from scratch would move."""
    from types import SimpleNamespace

    from embedscale.data.profile import AccessProfile
    from embedscale.plan.api import make_plan
    from embedscale.plan.drift import rows_moved
    from embedscale.specs import DistConfig, Topology
    from embedscale.train.replan import DriftMonitor

    class _Total:  # stands in for the summed RollingProfile
        def __init__(self, prof):
            self.prof = prof

        def to_access_profile(self):
            return self.prof

    ts = [TableSpec("a", 3000, 8, features=["a"]), TableSpec("b", 2000, 8, features=["b"])]
    rng = np.random.default_rng(1)
    old = AccessProfile({t.name: rng.poisson(5, t.num_rows).astype(float) for t in ts}, 10_000)
    W, B = 2, 128
    plan = make_plan("oper", ts, old, Topology(ranks_per_host=W), batch_size=B // W)
    run = SimpleNamespace(cfg=SimpleNamespace(dist=DistConfig(), train=SimpleNamespace(batch_size=B)), world=W,
                          plan=plan, state=SimpleNamespace(step=10))
    mon = DriftMonitor.__new__(DriftMonitor)
    mon.min_gain, mon.incremental = 0.05, True
    report, fresh = mon._check(run, _Total(old))
    assert fresh is None and report["replan"] is False and "keep the plan" in report["reason"]
    counts = {t.name: rng.poisson(5, t.num_rows).astype(float) for t in ts}
    hot = np.flatnonzero(plan.owner("a", np.arange(3000)) == 0)[:16]
    counts["a"][hot] += 2000.0
    new = AccessProfile(counts, 10_000)
    report, inc = mon._check(run, _Total(new))
    assert report["replan"] is True and report["replan_strategy"].endswith("+incremental"), report["reason"]
    assert inc.meta.get("incremental") and report["rows_moved"] == rows_moved(plan, inc)["rows_moved"]
    assert report["rows_moved"] < report["fresh"]["rows_moved"] / 10, (report["rows_moved"], report["fresh"])
    assert report["replanned"]["max_rank_cost"] < report["after"]["max_rank_cost"]
