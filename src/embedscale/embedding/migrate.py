"""Live row migration: move a running sharded embedding from one plan to another between two steps.

Online re-planning (OPER section 4 plans, executed as in section 5.1). A run trains under
plan P1 (its ``ShardedEmbedding`` / ``PgasShardedEmbedding``); the drift monitor finds a plan P2 for the
same tables and world size. After the migration the module trains exactly as the module
``models.builder.build_embedding`` makes for P2 loaded with the same rows and row-wise optimizer state
would, as a checkpoint written under P1 and restored under P2 (the re-shard path of ``train.distributed``)
gives: bit for bit (losses, rows and state by global id; tests/test_migrate.py).

Which rows move. Every rank holds the running map and P2's placement, so every rank knows, without asking,
which rows each peer needs and who sends them:

* a row a rank holds under both plans (owned or a replica) stays;
* a row a rank holds under P2 but not under P1 (a row whose owner changes, a replica that appears) comes
  from the row's P1 *owner*: its current value and row-wise state. Replicas are identical on every holder
  (every holder applies the same summed gradient, OPER 5.3), so the owner's copy is every holder's;
* a row a rank held under P1 but not under P2 (a replica that disappears, a row that leaves) is dropped
  there: its owner's value, the one every holder had, lives on where P2 puts it. That is the fold-back.

All moving rows go in **one** all-to-all through the run's ``Transport`` (the collective's
``all_to_all_single``, or the PGAS rings), the counts known on both sides (no metadata round): each row as
its weight bytes then its row-wise Adagrad accumulator bytes (``row_bytes``), on the storage's device. The
bytes are counted by the transport's convention (``comm.transport``: the bytes a rank sends to other ranks;
the ``migrate`` kind of its counter) and returned in :class:`Migration` with the rows moved.

In place (:func:`migrate_in_place`, what ``train.replan`` runs): the cost follows what moves, not the tables.

1. The running map is *edited* into P2's (:func:`edit_map`): one vectorised pass over its packed codes finds
   the rows whose place in an owned region changes (owner changed, replicated or no longer), a handful of
   array operations per rank (O(ranks) Python) gives the arrivals the offsets the leavers freed (then new
   ones at the end of the owned region, which takes the head of the replica region), and only those rows'
   codes and the replicas' (P2's slot numbers, so replica gradients sum as under P2; a replica a rank keeps
   stays in its storage row, the replica region compacted) are rewritten. Every staying row keeps its
   offset: the owned region may have free rows and leave global id order (``AddressMap.free``).
2. The routes come from that difference alone (:func:`in_place_routes`: the changed rows and the replicated
   ones of either plan, O(k + slots)), never from a scan of both maps' storages.
3. The module keeps its storage, row-wise state and updated-rows flags (``ShardedEmbedding
   .adopt_address_map``: a longer storage grows into spare room, amortised); only rows that arrive (from
   peers) or change place locally (a row that becomes or stops being a replica; the replica region when the
   owned region grew) are written: :attr:`Migration.rows_written`, :attr:`Migration.codes_changed`.

A ``PgasShardedEmbedding`` (its storage lives in a symmetric heap its peers map) moves in place too when
the edited map's storage fits the heap's room (``PgasShardedEmbedding.fits``; a run with live re-planning
builds it with a quarter more room, ``EmbeddingEnv.storage_spare``): the storage grows inside the heap, the
views of the peers' storage follow, and the heap's version word tells peers the new rows are there. When it
does not fit (every rank decides alike, before anything moves: :class:`HeapTooSmall`), the caller builds
the P2 module (``models.builder.build_sharded``) and :func:`migrate` fills it (routes from both whole maps,
:func:`migration_routes`, O(rows); every kept row copied): the first version's path, kept as the reference
the in-place routes are tested against.

Delta checkpoints: a row that stays keeps its updated bit, a row received counts as updated (conservative:
the next delta holds it, which is exact). Designed for GPU (every tensor stays on the storage's device; the
transport moves them to its wire); tested on CPU (gloo, and the PGAS heap) only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from embedscale.device import HOST
from embedscale.embedding.address_map import AddressMap, plan_placement
from embedscale.embedding.pgas_lookup import HeapTooSmall, PgasShardedEmbedding
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import ConfigError, EmbedscaleError

KIND = "migrate"  # the transport counter's label for migrated rows


class _RowCounts:
    """Rows a rank sends to and receives from its peers (its own block excluded), for routes that hold
    ``rank``, ``send_gids`` and ``recv_gids``."""

    rank: int
    send_gids: list[np.ndarray]
    recv_gids: list[np.ndarray]

    @property
    def rows_sent(self) -> int:
        return int(sum(g.size for q, g in enumerate(self.send_gids) if q != self.rank))

    @property
    def rows_received(self) -> int:
        return int(sum(g.size for p, g in enumerate(self.recv_gids) if p != self.rank))


@dataclass
class MigrationRoutes(_RowCounts):
    """What rank ``rank`` keeps, sends and receives when the rows move from map ``old`` to map ``new``.

    Attributes:
        keep_gids, keep_rows: rows held under both plans: their global ids and their old storage rows.
        send_gids, send_rows: per peer ``q``, the rows this rank sends ``q`` (it owns them under P1, ``q``
            holds them under P2 and not under P1), in global id order, and their old storage rows.
        recv_gids: per peer ``p``, the rows that arrive from ``p``, in the order they arrive (global id).
    """

    rank: int
    keep_gids: np.ndarray
    keep_rows: np.ndarray
    send_gids: list[np.ndarray]
    send_rows: list[np.ndarray]
    recv_gids: list[np.ndarray]


@dataclass
class Migration:
    """One rank's account of a migration (:func:`migrate`).

    ``bytes_sent`` is what the transport counted (the bytes this rank sent to other ranks), ``bytes_planned``
    the routes' rows times ``row_bytes``: they agree. ``replicas_added`` / ``replicas_dropped``: replica
    rows this rank holds under P2 and not P1 / under P1 and not P2 (held as replicas)."""

    rank: int
    rows_kept: int
    rows_sent: int
    rows_received: int
    row_bytes: int
    bytes_sent: int
    bytes_planned: int
    replicas_added: int
    replicas_dropped: int
    seconds: float
    sent_per_peer: list[int] = field(default_factory=list)
    in_place: bool = False
    rows_written: int = 0  # storage rows written: received rows and local moves (in place), or every row
    local_moves: int = 0  # rows kept that changed place in this rank's storage (in place)
    codes_changed: int = 0  # address-map codes (this rank's view) that differ after the migration
    storage_rows: int = 0  # this rank's storage rows after it (free rows of the owned region included)
    storage_grew: bool = False  # the storage tensor was reallocated (no spare room left)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _storage_index(amap: AddressMap, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(gids sorted, their storage rows)`` of ``rank``'s storage under ``amap`` (free rows left out)."""
    gids = amap.storage_gids(rank)
    order = np.argsort(gids, kind="stable")
    order = order[gids[order] >= 0]
    return gids[order], order.astype(np.int64)


def _shard_gids(amap: AddressMap, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(gids, storage rows)`` of the rows ``rank`` owns under ``amap`` (owned region and owned replicas),
    in global id order: the rows it is the source of in a migration (its ``shard_state``'s rows)."""
    owned, off = amap.owned_rows(rank)
    rep = amap.replica_gids_on(rank)
    mine = np.flatnonzero(amap.owner_of(rep) == rank)
    gids = np.concatenate([owned, rep[mine]])
    rows = np.concatenate([off, int(amap.owned_count[rank]) + mine.astype(np.int64)])
    order = np.argsort(gids, kind="stable")
    return gids[order], rows[order]


def check_same_tables(old: AddressMap, new: AddressMap) -> None:
    """Two maps a migration may go between: the same tables (names, rows) on the same world size."""
    if old.world_size != new.world_size:
        raise ConfigError(f"migration: the new plan is for {new.world_size} ranks, the running one for "
                          f"{old.world_size}; another world size re-shards from a checkpoint")
    if old.table_names != new.table_names or not np.array_equal(old.table_base, new.table_base):
        raise ConfigError(f"migration: the new plan's tables {new.table_names} (bases {new.table_base.tolist()}) "
                          f"differ from the running ones {old.table_names} (bases {old.table_base.tolist()})")


def migration_routes(old: AddressMap, new: AddressMap, rank: int) -> MigrationRoutes:
    """The rows rank ``rank`` keeps, sends to and receives from every peer when moving from ``old`` to ``new``
    (module docstring). Every rank computes its own from the two maps alone; a row ``q`` receives from ``p``
    is exactly one ``p`` sends ``q``, in the same (global id) order. O(rows) numpy, a loop over the ranks."""
    check_same_tables(old, new)
    W = old.world_size
    if not 0 <= rank < W:
        raise ConfigError(f"migration: rank {rank} outside world size {W}")
    # receiving side: what the new storage needs that the old one lacks, from each row's P1 owner
    need = np.sort(new.storage_gids(rank), kind="stable")  # two sorted runs (owned rows, replicas): a merge
    have, have_rows = _storage_index(old, rank)
    pos = np.clip(np.searchsorted(have, need), 0, max(have.size - 1, 0))
    kept = have[pos] == need if have.size else np.zeros(need.size, bool)
    keep_gids, keep_rows = need[kept], have_rows[pos[kept]]
    missing = need[~kept]
    src = old.owner_of(missing).astype(np.int64)
    recv = [missing[src == p] for p in range(W)]  # need is sorted: each peer's rows in global id order
    # sending side: the rows this rank owns under P1 that a peer holds under P2 and not under P1
    mine, mine_rows = _shard_gids(old, rank)
    moves = new.holders_of(mine) & ~old.holders_of(mine)
    send_gids, send_rows = [], []
    for q in range(W):
        sel = np.flatnonzero(moves[:, q]) if q != rank else np.zeros(0, dtype=np.int64)
        send_gids.append(mine[sel])
        send_rows.append(mine_rows[sel])
    if recv[rank].size:  # a row this rank owns under P1 is in its old storage: never missing
        raise EmbedscaleError(f"migration: rank {rank} misses {recv[rank].size} of its own rows (inconsistent maps)")
    return MigrationRoutes(rank, keep_gids, keep_rows, send_gids, send_rows, recv)


def row_bytes(module: ShardedEmbedding) -> int:
    """Bytes one migrated row takes on the wire: its weight, then its row-wise Adagrad accumulator if any."""
    w = module.dim * module.weight.element_size()
    return w + (module.momentum.element_size() if module.optimizer == "rowwise_adagrad" else 0)


def _pack(module: ShardedEmbedding, rows: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, row_bytes]``: the rows' weight bytes then their accumulator bytes (bit copies)."""
    parts = [module.weight.detach().index_select(0, rows).contiguous().view(torch.uint8)]
    if module.optimizer == "rowwise_adagrad":
        m = module.momentum.index_select(0, rows).contiguous()
        parts.append(m.view(torch.uint8).view(rows.numel(), m.element_size()))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _unpack(module: ShardedEmbedding, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    wb = module.dim * module.weight.element_size()
    weight = buf[:, :wb].contiguous().view(module.weight.dtype)
    mom = buf[:, wb:].contiguous().view(module.momentum.dtype).view(-1) \
        if module.optimizer == "rowwise_adagrad" else None
    return weight, mom


def check_compatible(old: ShardedEmbedding, new: ShardedEmbedding) -> None:
    """The two modules of a migration: same tables, world, rank, optimizer, storage dtype and device; the old
    one with no prefetched batch pending (its conversion used the old map)."""
    check_same_tables(old.amap, new.amap)
    if [t.name for t in old.tables] != [t.name for t in new.tables] or old.dim != new.dim:
        raise ConfigError("migration: the new module's tables or dim differ from the running module's")
    for what in ("rank", "world_size", "optimizer"):
        if getattr(old, what) != getattr(new, what):
            raise ConfigError(f"migration: {what} {getattr(new, what)!r} in the new module, "
                              f"{getattr(old, what)!r} in the running one")
    if old.weight.dtype != new.weight.dtype or old.weight.device != new.weight.device:
        raise ConfigError(f"migration: the new storage is {new.weight.dtype} on {new.weight.device}, the running "
                          f"one {old.weight.dtype} on {old.weight.device}")
    if old.pending_batches:
        raise EmbedscaleError(f"migration (rank {old.rank}): {old.pending_batches} prefetched batch(es) pending; "
                              "migrate between steps, before prefetching under the new plan")


@torch.no_grad()
def migrate(old: ShardedEmbedding, new: ShardedEmbedding, *, release: bool = True) -> Migration:
    """Move ``old``'s rows and row-wise optimizer state into ``new`` (the P2 module just built), with one
    all-to-all through ``old.transport``; every rank calls it between the same two steps. Afterwards
    ``new`` holds exactly the rows and state a P1 checkpoint restored under P2 would give it. With
    ``release`` the old module's resources go (its prefetch thread; on PGAS its heap mapping): use ``new``.
    """
    t0 = time.perf_counter()
    check_compatible(old, new)
    me, W = old.rank, old.world_size
    routes = migration_routes(old.amap, new.amap, me)
    dev = old.weight.device
    rb = row_bytes(old)
    send = [_pack(old, torch.from_numpy(routes.send_rows[q]).to(dev)) if q != me
            else torch.empty((0, rb), dtype=torch.uint8, device=dev) for q in range(W)]
    recv_counts = [int(g.size) if p != me else 0 for p, g in enumerate(routes.recv_gids)]
    tr = old.transport
    before = tr.counter.sent.copy()
    got = tr.exchange(send, recv_counts=recv_counts, kind=KIND)
    sent = tr.counter.sent - before
    keep = torch.from_numpy(routes.keep_rows).to(dev)
    weights = [old.weight.detach().index_select(0, keep)]
    moms = [old.momentum.index_select(0, keep)] if old.optimizer == "rowwise_adagrad" else []
    for p in range(W):
        if p != me and got[p].shape[0]:
            w, m = _unpack(old, got[p].to(dev))
            weights.append(w)
            if m is not None:
                moms.append(m)
    gids = np.concatenate([routes.keep_gids] + [routes.recv_gids[p] for p in range(W) if p != me])
    filled = new.load_rows(gids, torch.cat(weights), torch.cat(moms) if moms else None)
    if filled != new.weight.shape[0] or gids.size != filled:
        raise EmbedscaleError(f"migration (rank {me}): filled {filled} of {new.weight.shape[0]} storage rows "
                              f"from {gids.size} kept and received rows")
    if old.touched is not None:  # delta checkpoints: kept rows keep their bit, received ones count as updated
        new.track_touched()
        new.touched.fill_(True)
        new.touched[torch.from_numpy(_positions(new.amap.storage_gids(me), routes.keep_gids)).to(dev)] = \
            old.touched.index_select(0, keep)
    new.stats.update(old.stats)
    old_rep, new_rep = old.amap.replica_gids_on(me), new.amap.replica_gids_on(me)
    added, dropped = _count_missing(new_rep, old_rep), _count_missing(old_rep, new_rep)
    codes = int((old.tmap.row_code.to(HOST, torch.int64) != new.tmap.row_code.to(HOST, torch.int64)).sum())
    if release:
        _release(old)
    return Migration(rank=me, rows_kept=int(routes.keep_gids.size), rows_sent=routes.rows_sent,
                     rows_received=routes.rows_received, row_bytes=rb, bytes_sent=int(sent.sum()),
                     bytes_planned=routes.rows_sent * rb, replicas_added=added, replicas_dropped=dropped,
                     seconds=time.perf_counter() - t0, sent_per_peer=[int(x) for x in sent], in_place=False,
                     rows_written=filled, codes_changed=codes, storage_rows=int(new.weight.shape[0]),
                     storage_grew=True)


# -- in place: the running map edited, the routes from the difference, the storage kept -------------------------

@dataclass
class Placement:
    """Where a plan puts every row: what :func:`edit_map` edits a running map into.

    Attributes:
        world_size, table_base: the ranks and the global id space (``AddressMap``'s).
        owner: ``[G]`` owner rank of every global id (the smallest integer type that holds the ranks).
        replica_gid: int64 ``[S]`` global ids of the replicated rows in slot order (table order, then the
            order given: ``AddressMap.build``'s numbering, so replica gradients sync by the same slots).
        holders: bool ``[S, W]`` the ranks holding each slot (its owner among them).
        fetch: int32 ``[S, W]`` the rank each rank reads each slot from.
    """

    world_size: int
    table_base: np.ndarray
    owner: np.ndarray
    replica_gid: np.ndarray
    holders: np.ndarray
    fetch: np.ndarray

    @classmethod
    def of_arrays(cls, tables, world_size: int, owners: list, replicas: list | None = None,
                  replica_holders=None, replica_fetch=None) -> "Placement":
        """From ``AddressMap.build``'s arguments (per-table owners, replicated rows, holders, fetch ranks)."""
        W = int(world_size)
        if len(owners) != len(tables) or (replicas is not None and len(replicas) != len(tables)):
            raise ConfigError(f"placement: {len(owners)} owner arrays / {len(replicas or [])} replica lists for "
                              f"{len(tables)} tables")
        base = np.zeros(len(tables) + 1, dtype=np.int64)
        np.cumsum([t.num_rows for t in tables], out=base[1:])
        for spec, o in zip(tables, owners):
            if np.shape(o) != (spec.num_rows,):
                raise ConfigError(f"placement: table {spec.name!r}: owner array of shape {np.shape(o)}, "
                                  f"expected ({spec.num_rows},)")
        owner = np.concatenate([np.asarray(o) for o in owners]) if owners else np.zeros(0, np.int8)
        if owner.size and (owner.min() < 0 or owner.max() >= W):
            raise ConfigError(f"placement: an owner rank outside world size {W}")
        parts = []
        for t, (spec, r) in enumerate(zip(tables, replicas or [])):
            r = np.asarray(r, dtype=np.int64).reshape(-1)
            if r.size and (r.min() < 0 or r.max() >= spec.num_rows):
                raise ConfigError(f"placement: table {spec.name!r}: a replicated row outside [0, {spec.num_rows})")
            parts.append(base[t] + r)
        gids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        S = gids.size
        if _sorted_union(gids).size != S:
            raise ConfigError("placement: a row is listed as replicated twice")
        own = owner[gids].astype(np.int32)
        holders = np.ones((S, W), dtype=bool) if replica_holders is None else np.array(replica_holders, bool)
        if holders.shape != (S, W):
            raise ConfigError(f"placement: replica_holders has shape {holders.shape}, expected {(S, W)}")
        holders[np.arange(S), own] = True
        if replica_fetch is None:
            fetch = np.where(holders, np.arange(W, dtype=np.int32)[None, :], own[:, None]).astype(np.int32)
        else:
            fetch = np.asarray(replica_fetch).astype(np.int32)
            if fetch.shape != (S, W) or (S and (fetch.min() < 0 or fetch.max() >= W)) or \
                    not holders[np.arange(S)[:, None], fetch].all():
                raise ConfigError("placement: replica_fetch of the wrong shape, or naming a rank that does not "
                                  "hold the row")
        return cls(W, base, owner, gids, holders, fetch)

    @classmethod
    def of_plan(cls, plan, tables) -> "Placement":
        """A ``plan.Plan``'s placement of ``tables`` (as ``address_map_from_plan`` reads it)."""
        return cls.of_arrays(tables, plan.world_size, *plan_placement(plan, tables))

    @classmethod
    def of_map(cls, amap: AddressMap) -> "Placement":
        """The placement ``amap`` encodes (O(rows): every row's owner decoded)."""
        return cls(amap.world_size, amap.table_base.copy(), amap.owner_of(np.arange(amap.num_rows)),
                   amap.replica_gid.copy(), amap.replica_local >= 0, amap.replica_fetch.astype(np.int32))


@dataclass
class MapEdit:
    """The running map ``old``, its edit ``new`` (:func:`edit_map`) and the rows whose place in an owned
    region changed (``changed``: global ids, ascending; their key ``old_key`` / ``new_key`` is the owner of
    a plain row, ``W`` for a replicated one). ``widened``: the codes went from 32 to 64 bits."""

    old: AddressMap
    new: AddressMap
    changed: np.ndarray
    old_key: np.ndarray
    new_key: np.ndarray
    widened: bool = False
    replicas_moved: np.ndarray | None = None  # replicated rows (either map) whose holders, places or fetch ranks change


def edit_map(old: AddressMap, target: Placement) -> MapEdit:
    """The running map ``old`` edited into ``target``'s placement, every staying row at its offset (module
    docstring, step 1). ``old`` is left as it was (its codes are copied once: 4 bytes a row, one memcpy).

    Deterministic from ``old`` and ``target`` alone, so every rank edits its copy of the map the same way:
    per rank, arriving rows (global id order) take the offsets freed by the rows that left and the map's
    free rows (ascending), then new offsets at the end of the owned region, which grows by the deficit into
    the head of the replica region (those replicas move to its end, not the whole region). The replicas are
    ``target``'s slots (its numbering: replica gradients sum by slot as under a map built for it), each
    rank's replica region after its owned region, kept replicas in place (:func:`_replica_layout`)."""
    W = old.world_size
    if target.world_size != W:
        raise ConfigError(f"migration: the new plan is for {target.world_size} ranks, the running one for {W}; "
                          "another world size re-shards from a checkpoint")
    if not np.array_equal(target.table_base, old.table_base):
        raise ConfigError(f"migration: the new plan's tables (bases {target.table_base.tolist()}) differ from the "
                          f"running ones {old.table_names} (bases {old.table_base.tolist()})")
    gids_s = target.replica_gid.astype(np.int64)
    S = gids_s.size
    rep_own = target.owner[gids_s].astype(np.int32)
    held = target.holders.sum(0).astype(np.int64)
    # one pass over the codes: a row's key is its owner when plain, W when replicated (the code's high bits)
    old_key = np.minimum(old.row_code >> old.shift, W).astype(np.int32)
    new_key = target.owner.astype(np.int32)
    new_key[gids_s] = W
    changed = np.flatnonzero(old_key != new_key)
    k_old, k_new = old_key[changed], new_key[changed]
    old_off = (old.row_code[changed] & ((1 << old.shift) - 1)).astype(np.int64)
    free = old.free if old.free is not None else [np.zeros(0, dtype=np.int64)] * W
    size = old.owned_count.astype(np.int64).copy()
    new_off = np.full(changed.size, -1, dtype=np.int64)
    new_free = []
    for r in range(W):  # O(ranks) Python; the arrays are the changed rows
        pool = np.sort(np.concatenate([free[r], old_off[k_old == r]]))
        arr = np.flatnonzero(k_new == r)
        if arr.size <= pool.size:
            new_off[arr] = pool[:arr.size]
            new_free.append(pool[arr.size:])
            continue
        deficit = arr.size - pool.size  # the region grows into the replica region's head (_replica_layout)
        new_off[arr] = np.concatenate([pool, size[r] + np.arange(deficit, dtype=np.int64)])
        new_free.append(np.zeros(0, dtype=np.int64))
        size[r] += deficit
    local = _replica_layout(old, gids_s, target.holders, size - old.owned_count)
    code, shift, flag_bit, widened = old.row_code.copy(), old.shift, old.flag_bit, False
    if code.dtype == np.int32 and int((size + held).max()) > 1 << shift:  # 32-bit offsets overflow: widen
        _rep, src, off = old._unpack(code)
        code, shift, flag_bit, widened = (src << 40) | off, 40, 62, True
    plain = k_new < W
    code[changed[plain]] = (k_new[plain].astype(np.int64) << shift) | new_off[plain]
    new = AddressMap(W, list(old.table_names), old.table_base.copy(), code, shift, flag_bit, size, gids_s, rep_own,
                     local, target.fetch.astype(np.int32), np.argsort(gids_s, kind="stable").astype(np.int64),
                     home=None, free=new_free)
    if S:  # replicated rows: the owner's view until a rank claims the map (AddressMap.view)
        code[gids_s] = new._slot_codes(rep_own.astype(np.int64), np.arange(S))
    return MapEdit(old, new, changed, k_old, k_new, widened, _replicas_moved(old, new, widened))


def _replicas_moved(old: AddressMap, new: AddressMap, widened: bool) -> np.ndarray:
    """Global ids (ascending) of the rows replicated under either map except those replicated under both
    with the same holders, the same storage row on every holder and the same fetch ranks: those need no
    route, no local move and keep their codes. One sort-based match of the two slot lists."""
    og, ng = old.replica_gid, new.replica_gid
    if not og.size or not ng.size or widened:
        return _sorted_union(og, ng)
    o_sorted = og[old.replica_order]
    pos = np.minimum(np.searchsorted(o_sorted, ng), og.size - 1)
    hit = o_sorted[pos] == ng
    s_n = np.flatnonzero(hit)
    s_o = old.replica_order[pos[hit]]
    lo, ln = old.replica_local[s_o].astype(np.int64), new.replica_local[s_n].astype(np.int64)
    same = ((lo >= 0) == (ln >= 0)).all(1) & (old.replica_fetch[s_o] == new.replica_fetch[s_n]).all(1) & \
        np.where(ln >= 0, (old.owned_count[None, :] + lo) == (new.owned_count[None, :] + ln), True).all(1)
    kept = np.zeros(ng.size, dtype=bool)
    kept[s_n[same]] = True
    still = np.zeros(og.size, dtype=bool)
    still[s_o[same]] = True
    return _sorted_union(ng[~kept], og[~still])


def _replica_layout(old: AddressMap, gids: np.ndarray, holders: np.ndarray, grown: np.ndarray) -> np.ndarray:
    """``[S, W]`` place of each new replica slot in each holder's replica region (-1: not held), the region
    dense: a replica a rank keeps stays at its storage row while that is inside the new region (which
    starts ``grown[w]`` rows later when the owned region grew); the new ones and those outside take the
    places left free, in slot order. So the rows that move are about the replicas added and dropped, plus
    the ``grown[w]`` the owned region took from the region's head (rotated to its end), never the whole
    region. O(slots) array work per rank."""
    S, W = holders.shape
    local = np.full((S, W), -1, dtype=np.int32 if S < 2**31 else np.int64)
    for w in range(W):
        held_old = np.flatnonzero(old.replica_local[:, w] >= 0)
        og, oi = old.replica_gid[held_old], old.replica_local[held_old, w].astype(np.int64)
        order = np.argsort(og, kind="stable")
        og, oi = og[order], oi[order]
        slots = np.flatnonzero(holders[:, w])
        g = gids[slots]
        at = np.full(slots.size, -1, dtype=np.int64)
        if og.size:
            pos = np.minimum(np.searchsorted(og, g), og.size - 1)
            hit = og[pos] == g
            at[hit] = oi[pos[hit]] - int(grown[w])
        n = slots.size
        stay = (at >= 0) & (at < n)
        used = np.zeros(n, dtype=bool)
        used[at[stay]] = True
        need = np.flatnonzero(~stay)
        at[need] = np.flatnonzero(~used)
        local[slots, w] = at
    return local


def _sorted_union(*arrays: np.ndarray) -> np.ndarray:
    """Sorted distinct values of ``arrays`` (one sort; numpy's hash-based ``unique`` was slower here)."""
    c = np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays])
    c.sort()
    return c[np.r_[True, c[1:] != c[:-1]]] if c.size else c


def _count_missing(a: np.ndarray, b: np.ndarray) -> int:
    """How many of the distinct values ``a`` are not in ``b`` (a sort and a binary search)."""
    if not a.size:
        return 0
    if not b.size:
        return int(a.size)
    b = np.sort(b)
    pos = np.minimum(np.searchsorted(b, a), b.size - 1)
    return int((b[pos] != a).sum())


def _rows_on(amap: AddressMap, gids: np.ndarray, rank: int) -> np.ndarray:
    """Storage row on ``rank`` of each of ``gids`` (all held there under ``amap``)."""
    slot = amap.slot_of(gids)
    out = (amap.row_code[gids] & ((1 << amap.shift) - 1)).astype(np.int64)
    rep = slot >= 0
    if rep.any():
        out[rep] = amap.owned_count[rank] + amap.replica_local[slot[rep], rank]
    return out


@dataclass
class InPlaceRoutes(_RowCounts):
    """What rank ``rank`` sends, receives and moves locally in an in-place migration (:func:`in_place_routes`).

    Attributes:
        send_gids, send_rows: per peer, the rows sent (global id order) and their storage rows before.
        recv_gids, recv_rows: per peer, the rows that arrive (global id order) and their storage rows after.
        local_src, local_dst: rows held before and after whose storage row changes: from, to.
        dropped_rows: storage rows (before) of the rows this rank no longer holds.
        rows_kept: rows held before and after (in place or moved locally).
        candidates: the global ids looked at (changed rows, replicas that move): no other row's code changed.
    """

    rank: int
    send_gids: list[np.ndarray]
    send_rows: list[np.ndarray]
    recv_gids: list[np.ndarray]
    recv_rows: list[np.ndarray]
    local_src: np.ndarray
    local_dst: np.ndarray
    dropped_rows: np.ndarray
    rows_kept: int
    candidates: np.ndarray


def in_place_routes(edit: MapEdit, rank: int) -> InPlaceRoutes:
    """Rank ``rank``'s routes from the maps' difference alone (module docstring, step 2): the rows whose
    holder set or place may change are the changed rows and the replicated rows whose holders, places or
    fetch ranks change (``MapEdit.replicas_moved``); the rest stay where they are on every rank. The same
    sends and receives as :func:`migration_routes` (tested), in O((changed + replicas that move) x ranks)."""
    old, new, W = edit.old, edit.new, edit.old.world_size
    if not 0 <= rank < W:
        raise ConfigError(f"migration: rank {rank} outside world size {W}")
    moved = edit.replicas_moved if edit.replicas_moved is not None else _sorted_union(old.replica_gid,
                                                                                     new.replica_gid)
    cand = _sorted_union(edit.changed, moved)
    h_old, h_new = old.holders_of(cand), new.holders_of(cand)
    src = old.owner_of(cand)
    moves = h_new & ~h_old
    mine = src == rank
    send_gids, send_rows, recv_gids, recv_rows = [], [], [], []
    for q in range(W):
        g = cand[mine & moves[:, q]] if q != rank else cand[:0]
        send_gids.append(g)
        send_rows.append(_rows_on(old, g, rank))
        g = cand[(src == q) & moves[:, rank]] if q != rank else cand[:0]
        recv_gids.append(g)
        recv_rows.append(_rows_on(new, g, rank))
    if (mine & moves[:, rank]).any():
        raise EmbedscaleError(f"migration: rank {rank} misses rows it owns (inconsistent maps)")
    both = cand[h_old[:, rank] & h_new[:, rank]]
    p_old, p_new = _rows_on(old, both, rank), _rows_on(new, both, rank)
    mv = p_old != p_new
    dropped = _rows_on(old, cand[h_old[:, rank] & ~h_new[:, rank]], rank)
    kept = int(new.storage_rows(rank)) - len(new.free[rank]) - sum(g.size for g in recv_gids)
    return InPlaceRoutes(rank, send_gids, send_rows, recv_gids, recv_rows, p_old[mv], p_new[mv], dropped, kept,
                         cand)


@torch.no_grad()
def migrate_in_place(module: ShardedEmbedding, target: Placement | AddressMap) -> Migration:
    """Move ``module`` (a running ``ShardedEmbedding``) onto ``target``'s placement in place (module docstring):
    collective, every rank between the same two steps; one all-to-all of the rows that change holder. The
    module keeps its storage (grown once when it must), row-wise state and updated-rows flags; afterwards it
    trains as the ``target`` module restored from a checkpoint of this one would (rows by global id; its map
    is the edited one, not ``AddressMap.build``'s layout). ``target`` may be a map (its placement is read)."""
    t0 = time.perf_counter()
    if module.pending_batches:
        raise EmbedscaleError(f"migration (rank {module.rank}): {module.pending_batches} prefetched batch(es) pending; "
                              "migrate between steps, before prefetching under the new plan")
    placement = Placement.of_map(target) if isinstance(target, AddressMap) else target
    me, W = module.rank, module.world_size
    edit = edit_map(module.amap, placement)
    pgas = isinstance(module, PgasShardedEmbedding)
    if pgas and not module.fits(edit.new):  # every rank alike, nothing moved yet: the caller rebuilds
        raise HeapTooSmall(f"migration (rank {me}): the new map's storage does not fit the PGAS heap; build the "
                           "new module and use migrate(old, new)")
    routes = in_place_routes(edit, me)
    dev = module.weight.device
    rb = row_bytes(module)
    adagrad = module.optimizer == "rowwise_adagrad"
    send = [_pack(module, torch.from_numpy(routes.send_rows[q]).to(dev)) if q != me
            else torch.empty((0, rb), dtype=torch.uint8, device=dev) for q in range(W)]
    src = torch.from_numpy(routes.local_src).to(dev)  # rows that change place: read before anything is written
    local_w = module.weight.detach().index_select(0, src)
    local_m = module.momentum.index_select(0, src) if adagrad else None
    local_t = module.touched.index_select(0, src) if module.touched is not None else None
    cand = routes.candidates
    before_codes = module.tmap.row_code.index_select(0, torch.from_numpy(cand).to(module.tmap.device)).to(HOST)
    tr = module.transport
    before = tr.counter.sent.copy()
    got = tr.exchange(send, recv_counts=[int(g.size) if p != me else 0 for p, g in enumerate(routes.recv_gids)],
                      kind=KIND)
    sent = tr.counter.sent - before
    ptr = module.weight.data_ptr()
    module.adopt_address_map(edit.new)  # the storage at its new size, every staying row in place
    if module.touched is not None and routes.dropped_rows.size:  # rows gone from here: no longer "updated"
        gone = routes.dropped_rows[routes.dropped_rows < module.touched.shape[0]]
        module.touched[torch.from_numpy(gone).to(dev)] = False
    dst = torch.from_numpy(routes.local_dst).to(dev)
    module.weight.index_copy_(0, dst, local_w)
    if adagrad:
        module.momentum.index_copy_(0, dst, local_m)
    if local_t is not None:
        module.touched.index_copy_(0, dst, local_t)
    for p in range(W):
        if p == me or not got[p].shape[0]:
            continue
        w, m = _unpack(module, got[p].to(dev))
        rows = torch.from_numpy(routes.recv_rows[p]).to(dev)
        module.weight.index_copy_(0, rows, w)
        if m is not None:
            module.momentum.index_copy_(0, rows, m)
        if module.touched is not None:
            module.touched[rows] = True
    if pgas:  # the rows are in place: peers may read them (the heap's version word)
        module.migrated()
    after_codes = module.tmap.row_code.index_select(0, torch.from_numpy(cand).to(module.tmap.device)).to(HOST)
    codes = edit.old.num_rows if edit.widened else \
        int((before_codes.to(torch.int64) != after_codes.to(torch.int64)).sum())
    old_rep, new_rep = edit.old.replica_gids_on(me), edit.new.replica_gids_on(me)
    received = routes.rows_received
    return Migration(rank=me, rows_kept=routes.rows_kept, rows_sent=routes.rows_sent, rows_received=received,
                     row_bytes=rb, bytes_sent=int(sent.sum()), bytes_planned=routes.rows_sent * rb,
                     replicas_added=_count_missing(new_rep, old_rep), replicas_dropped=_count_missing(old_rep, new_rep),
                     seconds=time.perf_counter() - t0, sent_per_peer=[int(x) for x in sent], in_place=True,
                     rows_written=received + int(routes.local_src.size), local_moves=int(routes.local_src.size),
                     codes_changed=codes, storage_rows=int(module.weight.shape[0]),
                     storage_grew=module.weight.data_ptr() != ptr)


def _positions(storage: np.ndarray, gids: np.ndarray) -> np.ndarray:
    """Storage row of each of ``gids`` (all present in ``storage``)."""
    order = np.argsort(storage, kind="stable")
    return order[np.searchsorted(storage, gids, sorter=order)].astype(np.int64)


def _release(module: ShardedEmbedding) -> None:
    """The old module's thread and heap (PGAS: ``close``); the module object stays valid but empty of work."""
    close = getattr(module, "close", None)
    if callable(close):
        close()
    elif module._pool is not None:
        module._pool.shutdown(wait=True)
        module._pool = None
