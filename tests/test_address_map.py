"""The address map (one packed code per row): every global id decodes as a brute-force reference says, for hand maps
and for the plans of every planner, and the map holds at most 8 bytes per row per rank."""

import copy
import functools

import numpy as np
import pytest
import torch

import embedscale.embedding.address_map as am
from embedscale.embedding.address_map import AddressMap, TorchAddressMap, address_map_from_plan
from embedscale.errors import ConfigError
from embedscale.plan.api import make_plan
from embedscale.plan.plan import Plan
from embedscale.plan.synthetic_profile import ZipfProfile, rank_to_row_bijection
from embedscale.specs import TableSpec, Topology


# -- the reference: one Python dict entry per row -------------------------------------------------------
def reference(tables, W, owner, replicas, holders, fetch):
    """``{rank: {gid: (src, offset, slot)}}`` and every rank's storage (list of gids), by plain loops.

    Layout (the executor's contract): a rank's owned region holds the rows it owns that are not replicated,
    by increasing global id; then its replica region holds the slots it holds, by slot number (table
    order, then the order the replicas were given)."""
    base = np.concatenate([[0], np.cumsum([t.num_rows for t in tables])]).astype(int)
    own = {}
    for t, o in enumerate(owner):
        for r, w in enumerate(o):
            own[int(base[t]) + r] = int(w)
    slot_gid = [int(base[t]) + int(r) for t, rs in enumerate(replicas) for r in rs]
    slot_of = {g: s for s, g in enumerate(slot_gid)}
    hold = [[bool(holders[s][w]) or own[g] == w for w in range(W)] for s, g in enumerate(slot_gid)]
    owned = {w: [g for g in sorted(own) if own[g] == w and g not in slot_of] for w in range(W)}
    region = {w: [s for s in range(len(slot_gid)) if hold[s][w]] for w in range(W)}
    storage = {w: owned[w] + [slot_gid[s] for s in region[w]] for w in range(W)}
    pos = {w: {g: i for i, g in enumerate(storage[w])} for w in range(W)}
    out = {}
    for r in range(W):
        m = {}
        for g in own:
            if g in slot_of:
                s = slot_of[g]
                f = int(fetch[s][r]) if fetch is not None else (r if hold[s][r] else own[g])
                m[g] = (f, pos[f][g], s)
            else:
                m[g] = (own[g], pos[own[g]][g], -1)
        out[r] = m
    return out, storage, own


def reference_from_plan(plan: Plan):
    """The same reference, from the plan's partitions (per-row dicts)."""
    owner, replicas, holders, fetch = [], [], [], []
    for t, tab in enumerate(plan.tables):
        o = np.empty(tab.num_rows, dtype=int)
        order = plan.order(t)
        reps = []
        for p in range(plan.table_partitions(t).start, plan.table_partitions(t).stop):
            rows = order[plan.part_start[p]:plan.part_stop[p]]
            o[rows] = plan.owner_of_part[p]
            if plan.holders[p].sum() > 1:
                for r in rows:
                    reps.append(int(r))
                    holders.append(plan.holders[p].tolist())
                    fetch.append(plan.fetch[p].tolist())
        owner.append(o)
        replicas.append(reps)
    return reference(plan.tables, plan.world_size, owner, replicas, holders, fetch)


def check(amap: AddressMap, ref, storage, own, W: int) -> None:
    G = amap.num_rows
    gids = np.arange(G)
    assert sorted(own) == list(range(G))
    np.testing.assert_array_equal(amap.owner_of(gids), [own[g] for g in range(G)])
    for r in range(W):
        want = np.array([ref[r][g] for g in range(G)], dtype=np.int64).reshape(G, 3)
        src, off, slot = amap.fetch(r, gids)
        np.testing.assert_array_equal(np.stack([src, off, slot], 1), want, err_msg=f"AddressMap.fetch rank {r}")
        tm = TorchAddressMap(amap, r)
        tsrc, toff, tslot = tm.decode(torch.from_numpy(gids))
        np.testing.assert_array_equal(np.stack([tsrc.numpy(), toff.numpy(), tslot.numpy()], 1), want,
                                      err_msg=f"TorchAddressMap.decode rank {r}")
        code = tm.codes(torch.from_numpy(gids)).numpy()  # the map's own packing: its instance's constants
        np.testing.assert_array_equal(code & tm.OFF_MASK, want[:, 1])
        np.testing.assert_array_equal((code & tm.KEY_MASK) >> tm.SHIFT, want[:, 0])
        np.testing.assert_array_equal((code & tm.REPLICA) != 0, want[:, 2] >= 0)
        assert tm.KEY_MASK == tm.REPLICA - 1 and tm.OFF_MASK == (1 << tm.SHIFT) - 1
        if G:  # codes sort by (source rank, offset): the order of the requests to each peer
            order = np.lexsort((want[:, 1], want[:, 0]))
            assert (np.diff(code[order] & tm.KEY_MASK) > 0).all() or G == 1
        np.testing.assert_array_equal(tm.slots(torch.from_numpy(gids[::-1].copy())).numpy(), want[::-1, 2])
        np.testing.assert_array_equal(amap.storage_gids(r), storage[r], err_msg=f"storage of rank {r}")
        assert amap.storage_rows(r) == len(storage[r])
        # the owner's offset of a row: where it sits in its owner's storage
        np.testing.assert_array_equal(amap.owner_offset_of(gids), [storage[own[g]].index(g) for g in range(G)])
        # shuffled and repeated ids decode alike
        g2 = np.random.default_rng(r).integers(0, G, 3 * G) if G else gids
        np.testing.assert_array_equal(np.stack(amap.fetch(r, g2), 1), want[g2])
        np.testing.assert_array_equal(np.stack([x.numpy() for x in tm.decode(torch.from_numpy(g2))], 1), want[g2])
    assert amap.num_owned().sum() + amap.num_slots == G


def random_case(rng, W: int):
    tables = [TableSpec(f"t{i}", int(rng.integers(1, 40)), dim=4) for i in range(int(rng.integers(1, 5)))]
    owner = [rng.integers(0, W, t.num_rows) for t in tables]
    replicas = [rng.choice(t.num_rows, int(rng.integers(0, t.num_rows // 2 + 1)), replace=False) for t in tables]
    S = sum(len(r) for r in replicas)
    holders = rng.random((S, W)) < 0.5
    rep_own = np.concatenate([o[r] for o, r in zip(owner, replicas)]) if S else np.zeros(0, int)
    hold = holders.copy()
    hold[np.arange(S), rep_own] = True
    fetch = np.zeros((S, W), dtype=np.int64)
    for s in range(S):
        choices = np.flatnonzero(hold[s])
        for w in range(W):
            fetch[s, w] = w if hold[s, w] else rng.choice(choices)
    return tables, owner, replicas, holders, fetch


@pytest.mark.parametrize("seed", range(12))
def test_hand_maps_with_replicas_and_per_row_owners(seed):
    rng = np.random.default_rng(seed)
    W = int(rng.integers(1, 6))
    tables, owner, replicas, holders, fetch = random_case(rng, W)
    default_fetch = seed % 3 == 0  # the default paths: every holder reads itself, the others the owner
    amap = AddressMap.build(tables, W, owner, replicas, holders, None if default_fetch else fetch)
    ref, storage, own = reference(tables, W, owner, [list(r) for r in replicas], holders,
                                  None if default_fetch else fetch)
    check(amap, ref, storage, own, W)


def test_default_replicas_are_held_everywhere_and_read_locally():
    tables = [TableSpec("a", 7), TableSpec("b", 3)]
    owner = [np.array([0, 1, 1, 0, 2, 2, 0]), np.array([2, 0, 1])]
    amap = AddressMap.build(tables, 3, owner, [np.array([5, 1]), np.array([2])])
    ref, storage, own = reference(tables, 3, owner, [[5, 1], [2]], np.ones((3, 3), bool), None)
    check(amap, ref, storage, own, 3)
    # by hand: rank 1 owns rows 2 (plain), then the three replicas in slot order (a5, a1, b2)
    # by hand: rank 1 owns row a2 (a1 is replicated), then holds the replicas in slot order (a5, a1, b2 = gid 9)
    assert amap.storage_gids(1).tolist() == [2, 5, 1, 9]
    assert amap.fetch(1, np.array([5, 9, 0]))[0].tolist() == [1, 1, 0]
    assert amap.fetch(1, np.array([5, 9, 0]))[1].tolist() == [1, 3, 0]


def test_64_bit_layout_decodes_alike(monkeypatch):
    """The 64-bit layout (ranks whose storage outgrows 32 bits) against the same reference."""
    monkeypatch.setattr(am, "_layout", lambda W, n: (np.dtype(np.int64), 40, 62))
    rng = np.random.default_rng(7)
    tables, owner, replicas, holders, fetch = random_case(rng, 3)
    amap = AddressMap.build(tables, 3, owner, replicas, holders, fetch)
    tm = TorchAddressMap(amap, 0)
    assert amap.row_code.dtype == np.int64 and tm.src_lut is None
    assert (tm.SHIFT, tm.REPLICA) == (TorchAddressMap.SHIFT, TorchAddressMap.REPLICA)
    ref, storage, own = reference(tables, 3, owner, [list(r) for r in replicas], holders, fetch)
    check(amap, ref, storage, own, 3)


def test_layout_picks_32_bits_while_the_offsets_fit():
    assert am._layout(4, 1 << 28) == (np.dtype(np.int32), 28, 30)
    assert am._layout(4, (1 << 28) + 1)[0] == np.dtype(np.int64)
    assert am._layout(1, 1 << 30)[0] == np.dtype(np.int32)
    assert am._layout(1000, 1 << 20)[:2] == (np.dtype(np.int32), 20)
    with pytest.raises(ConfigError, match="2\\*\\*40 rows"):
        am._layout(2, (1 << 40) + 1)


def good_plan() -> Plan:
    # tests/test_plan_plan.py's hand plan: a permuted table with a replicated partition, a replicated table
    tables = [TableSpec("a", 6, dim=2), TableSpec("b", 3, dim=4)]
    holders = np.array([[0, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 1]], dtype=bool)
    fetch = np.array([[1, 1, 1], [0, 0, 2], [2, 2, 2], [0, 1, 2]])
    return Plan(tables, 3, [np.array([4, 0, 5, 1, 2, 3]), None], [0, 0, 0, 1], [0, 2, 3, 0], [2, 3, 6, 3],
                [1, 0, 2, 0], holders, fetch)


TABLES = [TableSpec("a", 300, dim=8), TableSpec("b", 57, dim=8), TableSpec("c", 5, dim=8), TableSpec("d", 90, dim=8)]


@functools.lru_cache(maxsize=1)
def plans():
    prof = ZipfProfile.from_tables(TABLES, alpha=1.2, samples=20_000)
    out = {"hand": good_plan()}
    for W in (1, 2, 4):
        topo = Topology(ranks_per_host=W)
        for s in ("table_wise", "row_wise"):
            out[f"{s}-{W}"] = make_plan(s, TABLES, prof, topo)
        for mode in ("training", "inference"):
            # OPER's eq. 3 / 5 costs: its training rule replicates the hot head (the executor's costs do not on
            # one host, plan.oper), which this test needs
            out[f"oper-{mode}-{W}"] = make_plan("oper", TABLES, prof, topo, mode=mode, extra_memory=0.3,
                                                batch_size=64, traffic="access")
    return out


@pytest.mark.parametrize("name", list(plans()))
def test_plans_decode_as_their_partitions_say(name):
    plan = plans()[name]
    amap = address_map_from_plan(plan, [TableSpec(t.name, t.num_rows, dim=t.dim) for t in plan.tables])
    ref, storage, own = reference_from_plan(plan)
    if name.startswith("oper") and plan.world_size > 1:
        assert amap.num_slots > 0, "the oper plans of this test replicate a hot head"
    check(amap, ref, storage, own, plan.world_size)


def test_one_process_several_ranks_share_only_what_they_may():
    """The first rank's view shares the map's codes (one copy per process); another rank's view is its own."""
    plan = plans()["oper-training-4"]
    amap = address_map_from_plan(plan, [TableSpec(t.name, t.num_rows, dim=t.dim) for t in plan.tables])
    assert amap.num_slots
    t2 = TorchAddressMap(amap, 2)
    assert t2.row_code.data_ptr() == amap.row_code.__array_interface__["data"][0]
    t0 = TorchAddressMap(amap, 0)
    assert t0.row_code.data_ptr() != t2.row_code.data_ptr()
    ref, _, _ = reference_from_plan(plan)
    g = torch.arange(amap.num_rows)
    for r, tm in ((0, t0), (2, t2)):  # both still right after the other was made
        want = np.array([ref[r][i] for i in range(amap.num_rows)])
        np.testing.assert_array_equal(np.stack([x.numpy() for x in tm.decode(g)], 1), want)


def test_bad_inputs_are_named():
    t = [TableSpec("a", 4)]
    with pytest.raises(ConfigError, match="table 'a' row 2: owner rank 5 outside world size 2"):
        AddressMap.build(t, 2, [np.array([0, 1, 5, 0])])
    with pytest.raises(ConfigError, match="table 'a': replicated row 4 outside"):
        AddressMap.build(t, 2, [np.array([0, 1, 1, 0])], [np.array([4])])
    with pytest.raises(ConfigError, match="replicated twice"):
        AddressMap.build(t, 2, [np.array([0, 1, 1, 0])], [np.array([1, 1])])
    with pytest.raises(ConfigError, match="does not hold it"):
        AddressMap.build(t, 2, [np.array([0, 1, 1, 0])], [np.array([1])], np.array([[False, True]]),
                         np.array([[0, 1]]))


# -- memory --------------------------------------------------------------------------------------------
def held_bytes(*objs) -> int:
    """Bytes of every numpy array and torch tensor the objects hold, each buffer counted once."""
    seen: dict[int, int] = {}
    for obj in objs:
        for v in vars(obj).values():
            if isinstance(v, np.ndarray):
                seen[v.__array_interface__["data"][0]] = max(seen.get(v.__array_interface__["data"][0], 0), v.nbytes)
            elif isinstance(v, torch.Tensor):
                p = v.untyped_storage().data_ptr()
                seen[p] = max(seen.get(p, 0), v.untyped_storage().nbytes())
    return sum(seen.values())


def oper_style_plan(n: int, W: int, hot: int, part_rows: int) -> Plan:
    """One table of ``n`` rows planned as OPER plans it: rows by decreasing popularity (the synthetic
    profile's scattered rank -> row bijection), a replicated hot head, then ranges of that order per rank."""
    a, b = rank_to_row_bijection(n, 0, 0)
    order = ((a * np.arange(n, dtype=np.int64) + b) % n).astype(np.int32)
    starts = np.concatenate([np.arange(0, hot, max(1, hot // 4)), np.arange(hot, n, part_rows)])
    stops = np.append(starts[1:], n)
    P = starts.size
    owner = np.arange(P) % W
    holders = np.zeros((P, W), dtype=bool)
    holders[np.arange(P), owner] = True
    holders[starts < hot] = True
    return Plan([TableSpec("big", n, dim=64)], W, [order], np.zeros(P, int), starts, stops, owner, holders)


def test_map_of_a_large_oper_style_table_holds_at_most_8_bytes_per_row():
    n, W = 50_000_000, 4
    plan = oper_style_plan(n, W, hot=n // 1000, part_rows=1 << 20)
    amap = address_map_from_plan(plan, [TableSpec("big", n, dim=64)])
    tm = TorchAddressMap(amap, 1)
    per_row = held_bytes(amap, tm) / n
    assert amap.num_slots == n // 1000
    assert per_row <= 8.0, f"{per_row:.3f} bytes per row"
    # spot checks against the plan's own queries (Plan.address: the rank a rank reads from)
    g = np.random.default_rng(0).integers(0, n, 20_000)
    src, off, slot = (x.numpy() for x in tm.decode(torch.from_numpy(g)))
    np.testing.assert_array_equal(src, plan.address(0, g, rank=1)[0])
    np.testing.assert_array_equal(slot >= 0, plan.replicas(0, g).any(1))
    plain = slot < 0
    # owned region in global id order: a plain row's offset counts the owner's plain rows below it
    own = np.empty(n, dtype=np.int8)
    own[plan.rows_by_partition[0]] = np.repeat(plan.owner_of_part.astype(np.int8), plan.part_rows)
    own[amap.replica_gid] = -1
    for w in range(W):
        sel = plain & (src == w)
        np.testing.assert_array_equal(off[sel], np.searchsorted(np.flatnonzero(own == w), g[sel]))


def test_a_map_deep_copies():
    """Modules holding a map may be deep-copied (DMT copies models): the copy decodes alike, on its own codes."""
    plan = plans()["oper-training-2"]
    amap = address_map_from_plan(plan, [TableSpec(t.name, t.num_rows, dim=t.dim) for t in plan.tables])
    TorchAddressMap(amap, 1)
    twin = copy.deepcopy(amap)
    assert twin.row_code is not amap.row_code and twin.home == 1
    g = np.arange(amap.num_rows)
    for r in range(2):
        np.testing.assert_array_equal(np.stack(twin.fetch(r, g)), np.stack(amap.fetch(r, g)))
