"""Managed ids against a reference written in plain Python (dicts, one id at a time)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.managed import ManagedIds, ManagedIdTable, reset_rows, shard_bounds, shard_of
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.specs import TableSpec


M64 = (1 << 64) - 1


def ref_shard(x: int, shards: int) -> int:
    """embedding/managed.py's shard hash in Python integers: bits 32..62 of (x * 0x9E3779B97F4A7C15 mod 2^64)
    after ``h ^= h >> 29`` (unsigned), mod ``shards``."""
    h = (x * 0x9E3779B97F4A7C15) & M64
    h ^= h >> 29
    return ((h >> 32) & 0x7FFFFFFF) % shards


class Reference:
    """The semantics of embedding/managed.py's docstring, per id, in dicts: ``shards`` mapping shards, shard s
    owning rows [1 + s R // S, 1 + (s + 1) R // S) (R = num_rows - 1) and ``cap // S`` pending ids (one more
    for the first ``cap % S``)."""

    def __init__(self, num_rows, k, policy, ttl=None, pending_capacity=None, shards=1):
        self.n, self.k, self.policy, self.ttl, self.S = num_rows, k, policy, ttl, shards
        cap = 4 * num_rows if pending_capacity is None else pending_capacity
        self.cap = [cap // shards + (s < cap % shards) for s in range(shards)]
        r = num_rows - 1
        self.range = [range(1 + s * r // shards, 1 + (s + 1) * r // shards) for s in range(shards)]
        self.t = 0
        self.row_of = {}      # id -> row
        self.rows = {}        # row -> [id, last, freq]
        self.pending = {}     # id -> [count, last]
        self.counters = dict(lookups=0, hits=0, collisions=0, admissions=0, evictions=0, pending_dropped=0)

    def shard(self, x):
        return ref_shard(x, self.S)

    def assign(self, batch):
        self.t += 1
        t = self.t
        order, count = [], {}
        for x in batch:
            if x not in count:
                order.append(x)
                count[x] = 0
            count[x] += 1
        for x in order:  # hits
            if x in self.row_of:
                r = self.rows[self.row_of[x]]
                r[1] = t
                r[2] += count[x]
        evicted, admitted = [], []

        def evict(row):
            x = self.rows.pop(row)[0]
            del self.row_of[x]
            evicted.append((x, row))

        if self.policy == "ttl":
            for row in sorted(self.rows):
                if t - self.rows[row][1] > self.ttl:
                    evict(row)
        for x in order:
            if x in self.row_of:
                continue
            c, _ = self.pending.get(x, (0, 0))
            c += count[x]
            self.pending[x] = [c, t]
            if c < self.k:
                continue
            mine = self.range[self.shard(x)]
            free = [r for r in mine if r not in self.rows]
            if free:
                row = free[0]
            elif self.policy == "ttl":
                continue
            else:
                eligible = [r for r in mine if self.rows[r][1] < t]
                if not eligible:
                    continue
                if self.policy == "lru":
                    row = min(eligible, key=lambda r: (self.rows[r][1], r))
                else:
                    row = min(eligible, key=lambda r: (self.rows[r][2], self.rows[r][1], r))
                evict(row)
            del self.pending[x]
            self.rows[row] = [x, t, c]
            self.row_of[x] = row
            admitted.append((x, row))
        for s in range(self.S):
            ids = [x for x in self.pending if self.shard(x) == s]
            if len(ids) > self.cap[s]:
                drop = sorted(ids, key=lambda x: (self.pending[x][1], x))[:len(ids) - self.cap[s]]
                for x in drop:
                    del self.pending[x]
                self.counters["pending_dropped"] += len(drop)
        out = [self.row_of.get(x, 0) for x in batch]
        self.counters["lookups"] += len(batch)
        self.counters["collisions"] += sum(r == 0 for r in out)
        self.counters["hits"] += sum(r != 0 for r in out)
        self.counters["admissions"] += len(admitted)
        self.counters["evictions"] += len(evicted)
        return out, admitted, evicted


def _stream(seed, steps, universe, batch):
    rng = np.random.default_rng(seed)
    # raw 64-bit ids, negative ones too; a skewed draw so some ids repeat within and across batches
    pool = rng.integers(-(2**63), 2**63 - 1, size=universe, dtype=np.int64)
    p = 1.0 / np.arange(1, universe + 1) ** 0.8
    p /= p.sum()
    for _ in range(steps):
        yield pool[rng.choice(universe, size=rng.integers(1, batch + 1), p=p)]


@pytest.mark.parametrize("policy,k,ttl,pcap", [("lru", 1, None, None), ("lru", 2, None, 6), ("lfu", 1, None, None),
                                              ("lfu", 3, None, None), ("ttl", 1, 2, None), ("ttl", 2, 1, 5)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_rows,shards", [(7, 1), (7, 3), (11, 4)])
def test_matches_reference(policy, k, ttl, pcap, seed, num_rows, shards):
    table = ManagedIdTable("t", num_rows, admit_after=k, policy=policy, ttl=ttl, pending_capacity=pcap, shards=shards)
    ref = Reference(num_rows, k, policy, ttl, pcap, shards)
    evictions = 0
    for step, ids in enumerate(_stream(seed, 120, 25, 10)):
        a = table.assign(torch.from_numpy(ids))
        rows, admitted, evicted = ref.assign(ids.tolist())
        assert a.rows.tolist() == rows, f"step {step}"
        assert sorted(zip(a.admitted_ids.tolist(), a.admitted_rows.tolist())) == sorted(admitted), f"step {step}"
        assert sorted(zip(a.evicted_ids.tolist(), a.evicted_rows.tolist())) == sorted(evicted), f"step {step}"
        assert table.mapping() == ref.row_of
        evictions += len(evicted)
    assert table.counters == ref.counters
    assert evictions > 10  # the streams did exercise eviction
    if shards > 1:  # every shard admitted its ids into its own rows only
        got = {ref_shard(x, shards) for x in ref.row_of}
        assert len(got) > 1
        assert all(r in ref.range[ref_shard(x, shards)] for x, r in table.mapping().items())


def test_shard_hash_matches_python_integers():
    rng = np.random.default_rng(5)
    ids = np.concatenate([rng.integers(-(2**63), 2**63 - 1, size=500, dtype=np.int64),
                          np.array([-(2**63), -1, 0, 1, 2**63 - 1], dtype=np.int64), np.arange(200, dtype=np.int64)])
    for S in (1, 2, 3, 16):
        got = shard_of(torch.from_numpy(ids), S).tolist()
        assert got == [ref_shard(int(x), S) for x in ids], S
    # consecutive ids spread over the shards (Fibonacci hashing)
    counts = np.bincount(shard_of(torch.arange(1600), 16).numpy(), minlength=16)
    assert counts.min() >= 80 and counts.max() <= 120
    assert shard_bounds(11, 4) == [1, 3, 6, 8, 11]


def _hosts(world, **kw):
    return [ManagedIdTable("t", 11, shards=4, hosted=[s for s in range(4) if s % world == r], **kw)
            for r in range(world)]


@pytest.mark.parametrize("policy,ttl", [("lru", None), ("lfu", None), ("ttl", 2)])
def test_shards_hosted_on_several_ranks_equal_the_whole_table_and_rehost_from_its_state(policy, ttl):
    """The hosted shards of a world of W, each fed the batch's ids of its shards (batch order kept), assign
    every position the row the whole table does; the hosts' states merged restore onto another hosting
    (W = 1, 3, 5) and continue identically."""
    kw = dict(admit_after=2, policy=policy, ttl=ttl, pending_capacity=9)
    whole = ManagedIdTable("t", 11, shards=4, **kw)
    two = _hosts(2, **kw)
    stream = list(_stream(7, 80, 40, 16))

    def run(tables, ids):
        t = torch.from_numpy(ids)
        host = shard_of(t, 4) % len(tables)
        rows = torch.zeros_like(t)
        reset = []
        for r, tab in enumerate(tables):
            mine = host == r
            a = tab.assign(t[mine])
            rows[mine] = a.rows
            reset += a.reset.tolist()
        return rows.tolist(), sorted(reset)

    for ids in stream[:40]:
        want = whole.assign(torch.from_numpy(ids))
        assert run(two, ids) == (want.rows.tolist(), want.reset.tolist())
    merged = {k: v for tab in two for k, v in tab.state_dict().items()}
    assert {**two[0].mapping(), **two[1].mapping()} == whole.mapping()
    assert sum(tab.counters["evictions"] for tab in two) == whole.counters["evictions"] > 0
    for world in (1, 3, 5):  # 5: rank 4 hosts no shard (an empty table that still steps)
        hosts = _hosts(world, **kw)
        for tab in hosts:
            tab.load_state_dict(merged)
        other = ManagedIdTable("t", 11, shards=4, **kw)
        other.load_state_dict(whole.state_dict())
        for ids in stream[40:]:
            want = other.assign(torch.from_numpy(ids))
            assert run(hosts, ids) == (want.rows.tolist(), want.reset.tolist())
        total = {k: sum(tab.counters[k] for tab in hosts) for k in other.counters}
        assert total == other.counters
    with pytest.raises(InputError, match="not hosted here"):
        two[0].assign(torch.from_numpy(stream[0]))
    with pytest.raises(FormatError, match="lacks mapping shard"):
        _hosts(1, **kw)[0].load_state_dict(two[0].state_dict())
    with pytest.raises(ConfigError, match="shards"):
        ManagedIdTable("t", 4, shards=4)


def test_ties_and_in_batch_order():
    # LRU with 3 own rows: ids 10, 11, 12 admitted together (same last step); 13 then evicts the lowest row
    t = ManagedIdTable("t", 4, policy="lru")
    a = t.assign(torch.tensor([12, 10, 11, 12]))
    assert a.rows.tolist() == [1, 2, 3, 1]  # free rows in first-occurrence order
    a = t.assign(torch.tensor([13, 11, 14]))  # 11 is touched in this batch: rows 1 (12) and 2 (10) go
    assert a.rows.tolist() == [1, 3, 2]
    assert sorted(a.evicted_ids.tolist()) == [10, 12]
    # LFU: the lowest frequency goes first, ties by last step then row
    f = ManagedIdTable("f", 3, policy="lfu")
    f.assign(torch.tensor([5, 5, 6]))   # 5 -> row 1 (freq 2), 6 -> row 2 (freq 1)
    a = f.assign(torch.tensor([7]))
    assert a.evicted_ids.tolist() == [6] and a.rows.tolist() == [2]
    # admission after k accesses; the default row before
    g = ManagedIdTable("g", 3, admit_after=3, policy="lru")
    assert g.assign(torch.tensor([9, 9])).rows.tolist() == [0, 0]
    assert g.assign(torch.tensor([9])).rows.tolist() == [1]
    assert g.counters["collisions"] == 2 and g.counters["admissions"] == 1


@pytest.mark.parametrize("policy,ttl", [("lfu", None), ("ttl", 2)])
def test_state_round_trip_and_config_check(policy, ttl):
    a = ManagedIdTable("t", 6, admit_after=2, policy=policy, ttl=ttl)
    b = ManagedIdTable("t", 6, admit_after=2, policy=policy, ttl=ttl)
    stream = list(_stream(3, 60, 20, 8))
    for ids in stream[:30]:
        a.assign(torch.from_numpy(ids))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for ids in stream[30:]:
        assert a.assign(torch.from_numpy(ids)).rows.tolist() == b.assign(torch.from_numpy(ids)).rows.tolist()
    assert a.counters == b.counters
    with pytest.raises(FormatError, match="differs"):
        ManagedIdTable("t", 6, admit_after=3, policy=policy, ttl=ttl).load_state_dict(a.state_dict())
    many = ManagedIds({"u": ManagedIdTable("u", 4), "v": ManagedIdTable("v", 5, policy="ttl", ttl=3)})
    many.assign({"u": torch.tensor([1, 2]), "v": torch.tensor([3])})
    other = ManagedIds({"u": ManagedIdTable("u", 4), "v": ManagedIdTable("v", 5, policy="ttl", ttl=3)})
    other.load_state_dict(many.state_dict())
    assert other["u"].mapping() == {1: 1, 2: 2} and other["v"].mapping() == {3: 1}


def test_bad_config():
    with pytest.raises(ConfigError, match="'fifo'"):
        ManagedIdTable("t", 4, policy="fifo")
    with pytest.raises(ConfigError, match="ttl"):
        ManagedIdTable("t", 4, policy="ttl")
    with pytest.raises(ConfigError, match="num_rows"):
        ManagedIdTable("t", 1)


def test_reset_rows_on_local_embedding_bags():
    ebc = LocalEmbeddingBags([TableSpec("a", 10, 4), TableSpec("b", 8, 4)], optimizer="rowwise_adagrad", seed=0)
    table = ManagedIdTable("b", 8, policy="lru")
    ebc.momentum.fill_(1.0)
    before = ebc.weights.detach().clone()
    a = table.assign(torch.tensor([100, 200, 100]))
    reset_rows(ebc.table_weight("b"), ebc.table_momentum("b"), a.reset, init="zeros")
    w, m = ebc.table_weight("b"), ebc.table_momentum("b")
    assert a.reset.tolist() == [1, 2]
    assert torch.all(w[1:3] == 0) and torch.all(m[1:3] == 0)
    keep = torch.ones(8, dtype=torch.bool)
    keep[1:3] = False
    assert torch.equal(w[keep], before[40:].view(8, 4)[keep]) and torch.all(m[keep] == 1)
    assert torch.equal(ebc.table_weight("a"), before[:40].view(10, 4))  # the other table untouched
    gen = torch.Generator().manual_seed(0)
    reset_rows(ebc.table_weight("b"), None, torch.tensor([5]), generator=gen)
    assert float(w[5].abs().max()) <= 1 / 8 ** 0.5


def test_empty_batch_and_shape():
    t = ManagedIdTable("t", 4, policy="lru")
    a = t.assign(torch.zeros(0, dtype=torch.int64))
    assert a.rows.numel() == 0 and t.step == 1 and t.counters["lookups"] == 0
    a = t.assign(torch.tensor([[5, 6], [6, 7]]))
    assert a.rows.tolist() == [[1, 2], [2, 3]]
    assert t.rows_of(torch.tensor([7, 8])).tolist() == [3, 0]
    with pytest.raises(InputError, match="integers"):
        t.assign(torch.tensor([1.0]))


def test_an_unsharded_state_of_the_former_format_loads_as_one_shard():
    """A mapping saved before mapping shards (one table-wide state, row 0 included) resumes as ``shards=1``
    and continues as the dict reference does; any other shard count is a named error."""
    stream = list(_stream(4, 40, 20, 8))
    state = {"config": torch.tensor([6, 2, 0, -1, 24]), "step": torch.tensor(20),
             "counters": torch.tensor([100, 60, 40, 9, 4, 0]),
             "row_id": torch.tensor([0, 11, 12, 13, 0, 15]), "row_used": torch.tensor([False, True, True, True,
                                                                                       False, True]),
             "row_last": torch.tensor([0, 19, 20, 18, 0, 20]), "row_freq": torch.tensor([0, 3, 4, 2, 0, 5]),
             "pend_ids": torch.tensor([21, 22]), "pend_count": torch.tensor([1, 1]), "pend_last": torch.tensor([19, 20])}
    t = ManagedIdTable("t", 6, admit_after=2, policy="lru", pending_capacity=24)
    t.load_state_dict(state)
    ref = Reference(6, 2, "lru", None, 24)
    ref.t = 20
    ref.rows = {1: [11, 19, 3], 2: [12, 20, 4], 3: [13, 18, 2], 5: [15, 20, 5]}
    ref.row_of = {v[0]: r for r, v in ref.rows.items()}
    ref.pending = {21: [1, 19], 22: [1, 20]}
    ref.counters = dict(lookups=100, hits=60, collisions=40, admissions=9, evictions=4, pending_dropped=0)
    assert t.mapping() == ref.row_of and t.step == 20
    for ids in stream:
        assert t.assign(torch.from_numpy(ids)).rows.tolist() == ref.assign(ids.tolist())[0]
    assert t.counters == ref.counters
    with pytest.raises(FormatError, match="unsharded.*shards 1"):
        ManagedIdTable("t", 6, admit_after=2, policy="lru", pending_capacity=24, shards=2).load_state_dict(state)


@pytest.mark.parametrize("policy,k,ttl,pcap", [("lru", 1, None, None), ("lfu", 2, None, 12), ("ttl", 2, 3, 9)])
def test_delta_state_over_its_base_is_the_whole_state(policy, k, ttl, pcap):
    """A delta checkpoint holds the id mappings that changed: a delta state (rows changed since the base, which of the
    base's pending ids stay unchanged, the new or changed pending entries) laid over the base's full state
    (``apply_delta``) equals the full state at the delta's step, key for key and bit for bit, for each of 2
    hosts and merged; a table so restored continues as the original. The delta holds far fewer rows than
    the table when few rows changed, and a delta that does not fit its base is a FormatError."""
    from embedscale.embedding.managed import apply_delta

    kw = dict(admit_after=k, policy=policy, ttl=ttl, pending_capacity=pcap)
    hosts = [ManagedIdTable("t", 41, shards=4, hosted=[s for s in range(4) if s % 2 == r], **kw) for r in range(2)]
    whole = ManagedIds({"t": ManagedIdTable("t", 41, shards=4, **kw)})
    stream = list(_stream(11, 70, 120, 24))

    def feed(ids):
        t = torch.from_numpy(ids)
        host = shard_of(t, 4) % 2
        for r, tab in enumerate(hosts):
            tab.assign(t[host == r])
        whole["t"].assign(t)

    for ids in stream[:40]:
        feed(ids)
    base = [tab.state_dict() for tab in hosts]
    for tab in hosts:
        tab.track()
    whole_base = whole.state_dict()
    whole.track()
    for step, ids in enumerate(stream[40:48]):
        feed(ids)
    for r, tab in enumerate(hosts):
        got = apply_delta({f"t.{k}": v for k, v in base[r].items()},
                          {f"t.{k}": v for k, v in tab.delta_state_dict().items()})
        want = tab.state_dict()
        assert sorted(got) == sorted(f"t.{k}" for k in want)
        for key, v in want.items():
            assert torch.equal(got[f"t.{key}"], v), (r, key)
    # merged over the hosts (as a checkpoint's rank files are) and restored on a world of one
    merged_base = {f"t.{k}": v for b in base for k, v in b.items()}
    merged_delta = {f"t.{k}": v for tab in hosts for k, v in tab.delta_state_dict().items()}
    restored = ManagedIds({"t": ManagedIdTable("t", 41, shards=4, **kw)})
    restored.load_state_dict(apply_delta(merged_base, merged_delta))
    assert restored["t"].mapping() == whole["t"].mapping()
    assert apply_delta(whole_base, whole.state_dict(delta=True)).keys() == whole.state_dict().keys()
    for ids in stream[48:]:
        want = whole["t"].assign(torch.from_numpy(ids))
        assert restored["t"].assign(torch.from_numpy(ids)).rows.tolist() == want.rows.tolist()
    assert restored["t"].counters == whole["t"].counters
    # the delta names only the changed rows: after one more small batch, a few of the table's 40 rows
    small = ManagedIdTable("t", 41, shards=4, **kw)
    for ids in stream[:40]:
        small.assign(torch.from_numpy(ids))
    small.track()
    small.assign(torch.from_numpy(stream[40][:3]))
    d = small.delta_state_dict()
    changed_rows = sum(d[f"{s}.d.rows"].numel() for s in range(4))
    changed_pend = sum(d[f"{s}.d.pend_ids"].numel() for s in range(4))
    assert 0 < changed_rows + changed_pend and changed_rows <= 3 + (40 if policy == "ttl" else 0)
    assert changed_pend <= 3
    with pytest.raises(FormatError, match="does not fit its base"):  # a delta over another base
        apply_delta({f"t.{k}": v for k, v in base[0].items()},
                    {f"t.{k}": v for k, v in small.delta_state_dict().items()} | {"t.base_step": torch.tensor(3)})
    with pytest.raises(ConfigError, match="needs a base"):
        ManagedIdTable("t", 41, shards=4, **kw).delta_state_dict()
