"""Live row migration: move a running sharded embedding from one plan to another between two steps.

Issue 17 part 4 (online re-planning; OPER section 4 plans, executed as in section 5.1). A run trains under
plan P1 (its ``ShardedEmbedding`` / ``PgasShardedEmbedding``); the drift monitor finds a plan P2 for the
same tables and world size. :func:`migrate` moves the running module onto P2 so that afterwards it *is*
the module ``embedding.build.build_embedding`` makes for P2 loaded with the same rows and row-wise
optimizer state, as a checkpoint written under P1 and restored under P2 (the re-shard path of
``train.distributed``) would give: bit for bit.

How. The caller builds the P2 module (the builder, with P2's address map; on PGAS its heap too) and hands
both modules to :func:`migrate`. Every rank holds both address maps, so every rank knows, without
asking, which rows each peer needs and who sends them (:func:`migration_routes`):

* a row a rank holds under both plans (owned or a replica) stays: copied from its old storage;
* a row a rank holds under P2 but not under P1 (a row whose owner changes, a replica that appears) comes
  from the row's P1 *owner*: its current value and row-wise state. Replicas are identical on every holder
  (every holder applies the same summed gradient, OPER 5.3), so the owner's copy is every holder's;
* a row a rank held under P1 but not under P2 (a replica that disappears, a row that leaves) is dropped
  there: its owner's value, the one every holder had, lives on where P2 puts it. That is the fold-back.

All moving rows go in **one** all-to-all through the run's ``Transport`` (the collective's
``all_to_all_single``, or the PGAS rings), the counts known on both sides (no metadata round): each row as
its weight bytes then its row-wise Adagrad accumulator bytes (``row_bytes``), on the storage's device.
Everything is numpy / torch over whole arrays: a loop over the ranks, never over rows. The bytes are
counted by the transport's convention (``comm.transport``: the bytes a rank sends to other ranks; the
``migrate`` kind of its counter) and returned in :class:`Migration` with the rows moved.

Delta checkpoints: the new module tracks updated rows when the old one did; a row it kept keeps its bit,
a row it received counts as updated (conservative: the next delta holds it, which is exact).
Designed for GPU (every tensor stays on the storage's device; the transport moves them to its wire);
tested on CPU (gloo, and the PGAS heap) only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.errors import ConfigError, EmbedscaleError

KIND = "migrate"  # the transport counter's label for migrated rows


@dataclass
class MigrationRoutes:
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

    @property
    def rows_sent(self) -> int:
        return int(sum(g.size for q, g in enumerate(self.send_gids) if q != self.rank))

    @property
    def rows_received(self) -> int:
        return int(sum(g.size for p, g in enumerate(self.recv_gids) if p != self.rank))


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

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _storage_index(amap: AddressMap, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(gids sorted, their storage rows)`` of ``rank``'s storage under ``amap``."""
    gids = amap.storage_gids(rank)
    order = np.argsort(gids, kind="stable")
    return gids[order], order.astype(np.int64)


def _shard_gids(amap: AddressMap, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(gids, storage rows)`` of the rows ``rank`` owns under ``amap`` (owned region and owned replicas),
    in global id order: the rows it is the source of in a migration (its ``shard_state``'s rows)."""
    owned = amap.owned_gids(rank)
    rep = amap.replica_gids_on(rank)
    mine = np.flatnonzero(amap.owner_of(rep) == rank)
    gids = np.concatenate([owned, rep[mine]])
    rows = np.concatenate([np.arange(owned.size, dtype=np.int64), owned.size + mine.astype(np.int64)])
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
    if old._queue:
        raise EmbedscaleError(f"migration (rank {old.rank}): {len(old._queue)} prefetched batch(es) pending; "
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
    added = int(np.setdiff1d(new_rep, old_rep).size)
    dropped = int(np.setdiff1d(old_rep, new_rep).size)
    if release:
        _release(old)
    return Migration(rank=me, rows_kept=int(routes.keep_gids.size), rows_sent=routes.rows_sent,
                     rows_received=routes.rows_received, row_bytes=rb, bytes_sent=int(sent.sum()),
                     bytes_planned=routes.rows_sent * rb, replicas_added=added, replicas_dropped=dropped,
                     seconds=time.perf_counter() - t0, sent_per_peer=[int(x) for x in sent])


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
