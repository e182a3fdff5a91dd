"""The all-in-one address map (OPER section 5.1): every row of every table -> (rank, offset).

All tables share one global id space: row ``r`` of table ``t`` has global id ``table_base[t] + r``. Each
rank holds one flat storage: first the rows it owns (``num_owned[rank]`` of them), then the replica rows
it holds. For every global id the map says who owns it and at which offset, and whether it is replicated
(its replica slot). ``fetch(rank, gids)`` decodes, for the rows a rank's mini-batch needs, the rank it
reads each row from and the offset there: itself when it owns or holds a replica, else the plan's fetch
rank for replicas (inference, Algorithm 1) or the owner.

The map is built from any plan (OPER, table-wise, row-wise, TorchRec's, hand-written) in O(rows) numpy
and lives in host memory, as in the paper; the executor decodes a batch through its torch copy on the run's
device (``TorchAddressMap``) and never re-decides placement.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from embedscale.errors import ConfigError
from embedscale.specs import TableSpec


@dataclass
class AddressMap:
    """Per-row placement of all tables over ``world_size`` ranks.

    Attributes:
        world_size: ranks.
        table_names: table order of the global id space.
        table_base: int64 ``[T + 1]``: global id of each table's row 0 (and the total).
        owner: int32 ``[G]`` owner rank of every global id.
        owner_offset: int64 ``[G]`` offset in the owner's owned storage.
        replica_slot: int64 ``[G]``: replica slot or -1.
        replica_gid: int64 ``[S]`` global id of every slot.
        replica_local: int64 ``[S, W]``: index of slot ``s`` in rank ``w``'s replica region, or -1.
        replica_fetch: int64 ``[S, W]``: the rank ``w`` reads slot ``s`` from.
    """

    world_size: int
    table_names: list[str]
    table_base: np.ndarray
    owner: np.ndarray
    owner_offset: np.ndarray
    replica_slot: np.ndarray
    replica_gid: np.ndarray
    replica_local: np.ndarray
    replica_fetch: np.ndarray

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def build(cls, tables: list[TableSpec], world_size: int, owner: list[np.ndarray],
              replicas: list[np.ndarray] | None = None, replica_holders: np.ndarray | None = None,
              replica_fetch: np.ndarray | None = None) -> "AddressMap":
        """From per-table owner arrays and optional replicas.

        Args:
            owner: per table, int ``[num_rows]`` owner rank of every row.
            replicas: per table, the rows that are replicated (global slot order = table order, then
                the order given).
            replica_holders: bool ``[S, W]`` which ranks hold each slot (default: every rank, as for
                training-time data parallelism, OPER 4.3).
            replica_fetch: int ``[S, W]`` the rank each rank reads each slot from (default: itself if it
                holds the slot, else the owner).

        Owned offsets are assigned in global id order per rank, so any two ranks agree on them.
        """
        W = int(world_size)
        if len(owner) != len(tables):
            raise ConfigError(f"address map: {len(owner)} owner arrays for {len(tables)} tables")
        sizes = np.array([t.num_rows for t in tables], dtype=np.int64)
        base = np.zeros(len(tables) + 1, dtype=np.int64)
        np.cumsum(sizes, out=base[1:])
        own = np.empty(base[-1], dtype=np.int32)
        for t, (spec, o) in enumerate(zip(tables, owner)):
            o = np.asarray(o)
            if o.shape != (spec.num_rows,):
                raise ConfigError(f"address map: table {spec.name!r}: owner array of shape {o.shape}, "
                                  f"expected ({spec.num_rows},)")
            if o.size and (o.min() < 0 or o.max() >= W):
                bad = int(np.flatnonzero((o < 0) | (o >= W))[0])
                raise ConfigError(f"address map: table {spec.name!r} row {bad}: owner rank {int(o[bad])} "
                                  f"outside world size {W}")
            own[base[t]:base[t + 1]] = o
        if replicas is not None and any(len(r) for r in replicas):
            gids = np.concatenate([base[t] + np.asarray(r, dtype=np.int64) for t, r in enumerate(replicas)])
            if np.unique(gids).size != gids.size:
                raise ConfigError("address map: a row is listed as replicated twice")
            if gids.size and (gids.min() < 0 or (np.concatenate([np.asarray(r) for r in replicas]) < 0).any()):
                raise ConfigError("address map: negative replicated row id")
        else:
            gids = np.zeros(0, dtype=np.int64)
        S = gids.size
        slot = np.full(base[-1], -1, dtype=np.int64)
        slot[gids] = np.arange(S)
        holders = np.ones((S, W), dtype=bool) if replica_holders is None else np.array(replica_holders, bool)
        if holders.shape != (S, W):
            raise ConfigError(f"address map: replica_holders has shape {holders.shape}, expected {(S, W)}")
        holders[np.arange(S), own[gids]] = True  # a replicated row's owner is one of its holders
        # the owned region holds the rows a rank owns that are not replicated, in global id order;
        # a replicated row lives in the replica region of each holder (its owner included)
        plain = slot < 0
        key = np.where(plain, own, W)  # replicated rows sort after every rank's owned rows
        order = np.argsort(key, kind="stable")
        counts = np.bincount(key, minlength=W + 1).astype(np.int64)
        starts = np.zeros(W + 1, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        offset = np.empty(base[-1], dtype=np.int64)
        offset[order] = np.arange(base[-1], dtype=np.int64) - np.repeat(starts, counts)
        local = np.where(holders, np.cumsum(holders, axis=0) - 1, -1).astype(np.int64)
        num_owned = counts[:W]
        # a replicated row's "owner offset" is its place in the owner's replica region
        offset[gids] = num_owned[own[gids]] + local[np.arange(S), own[gids]]
        if replica_fetch is None:
            fetch = np.where(holders, np.arange(W)[None, :], own[gids][:, None]).astype(np.int64)
        else:
            fetch = np.asarray(replica_fetch, dtype=np.int64)
            if fetch.shape != (S, W):
                raise ConfigError(f"address map: replica_fetch has shape {fetch.shape}, expected {(S, W)}")
            if S and (fetch.min() < 0 or fetch.max() >= W):
                raise ConfigError(f"address map: replica_fetch names a rank outside world size {W}")
            src_holds = holders[np.arange(S)[:, None], fetch]
            if not src_holds.all():
                s_, w_ = np.argwhere(~src_holds)[0]
                raise ConfigError(f"address map: rank {w_} fetches replica slot {s_} (global row "
                                  f"{gids[s_]}) from rank {fetch[s_, w_]}, which does not hold it")
        return cls(W, [t.name for t in tables], base, own, offset, slot, gids, local, fetch)

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self.table_base[-1])

    @property
    def num_slots(self) -> int:
        return int(self.replica_gid.size)

    def num_owned(self) -> np.ndarray:
        """Rows of each rank's owned region (owned and not replicated)."""
        plain = self.replica_slot < 0
        return np.bincount(self.owner[plain], minlength=self.world_size).astype(np.int64)

    def num_replicas_held(self) -> np.ndarray:
        return (self.replica_local >= 0).sum(0).astype(np.int64)

    def storage_rows(self, rank: int) -> int:
        return int(self.num_owned()[rank] + self.num_replicas_held()[rank])

    def owned_gids(self, rank: int) -> np.ndarray:
        """Global ids of rank ``rank``'s owned region (owned, not replicated), in storage order."""
        g = np.flatnonzero((self.owner == rank) & (self.replica_slot < 0))
        return g[np.argsort(self.owner_offset[g], kind="stable")]

    def replica_gids_on(self, rank: int) -> np.ndarray:
        """Global ids of the replicas rank ``rank`` holds, in its replica-region order."""
        held = np.flatnonzero(self.replica_local[:, rank] >= 0)
        return self.replica_gid[held[np.argsort(self.replica_local[held, rank])]]

    def storage_gids(self, rank: int) -> np.ndarray:
        """Global id of every row of rank ``rank``'s flat storage (owned, then replicas)."""
        return np.concatenate([self.owned_gids(rank), self.replica_gids_on(rank)])

    def fetch(self, rank: int, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each global id: (rank it is read from, offset in that rank's storage, replica slot or -1)."""
        slot = self.replica_slot[gids]
        src = self.owner[gids].astype(np.int64)
        off = self.owner_offset[gids].copy()
        rep = slot >= 0
        if rep.any():
            s = slot[rep]
            f = self.replica_fetch[s, rank]
            src[rep] = f
            off[rep] = self.num_owned()[f] + self.replica_local[s, f]
        return src, off, slot


class TorchAddressMap:
    """The same map as torch tensors on the run's device, for per-batch decoding inside the lookup.

    Built on the host from the numpy map, then moved once with :meth:`to` to the device the embedding's
    storage lives on, so a batch's ids are decoded by torch ops where they already are (no host round
    trip per step). On CUDA the packed code table costs 8 bytes per row of all tables on every rank, as
    the host map does; designed for GPU, tested on CPU only.

    Every gid's ``(src, offset)`` from this rank's point of view is packed into one int64 ``code``
    (``src << 40 | offset``, bit 62 set when the row is a replica), so a batch decodes with one gather
    and its codes sort by (source rank, offset): the order of the requests to each peer.
    """

    SHIFT = 40  # offsets below 2**40 rows per rank, ranks below 2**22
    REPLICA = 1 << 62
    KEY_MASK = REPLICA - 1
    OFF_MASK = (1 << SHIFT) - 1

    def __init__(self, amap: AddressMap, rank: int):
        self.amap = amap
        self.rank = rank
        self.table_base = torch.from_numpy(amap.table_base)
        src, off, slot = amap.fetch(rank, np.arange(amap.num_rows))
        if amap.num_rows and (int(off.max()) > self.OFF_MASK or int(src.max()) >= 1 << (62 - self.SHIFT)):
            raise ConfigError("address map: a rank holds more than 2**40 rows, or more than 2**22 ranks")
        code = (src.astype(np.int64) << self.SHIFT) | off.astype(np.int64)
        code[slot >= 0] |= self.REPLICA
        self.code = torch.from_numpy(code)
        self.slot = torch.from_numpy(slot)
        self.num_owned = torch.from_numpy(amap.num_owned())
        self.replica_local = torch.from_numpy(amap.replica_local[:, rank].copy()) if amap.num_slots else \
            torch.zeros(0, dtype=torch.int64)

    @property
    def device(self) -> torch.device:
        return self.code.device

    def to(self, device: torch.device | str | None) -> "TorchAddressMap":
        """This map with its tensors on ``device`` (``self`` when they are already there)."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        if self.code.device == device:
            return self
        out = copy.copy(self)
        for name in ("table_base", "code", "slot", "num_owned", "replica_local"):
            setattr(out, name, getattr(self, name).to(device))
        return out

    @property
    def src(self) -> torch.Tensor:
        """Rank every gid is read from (int64, all gids)."""
        return (self.code & self.KEY_MASK) >> self.SHIFT

    @property
    def off(self) -> torch.Tensor:
        """Offset of every gid in the storage of the rank it is read from."""
        return self.code & self.OFF_MASK

    def decode(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(src, offset, replica slot or -1)`` of each gid."""
        c = self.code.index_select(0, gids)
        return (c & self.KEY_MASK) >> self.SHIFT, c & self.OFF_MASK, self.slot.index_select(0, gids)


def address_map_from_plan(plan, tables: list[TableSpec]) -> AddressMap:
    """The executor's map of a ``plan.Plan``: owners, replica rows, their holders and fetch paths.

    Works for any plan (OPER, baselines, TorchRec's converted, hand-written): a partition held by more
    than one rank is replicated; its rows' holders and fetch ranks are the partition's. Within a rank the
    executor lays rows out its own way (owned region, then replicas); placement is the plan's.
    """
    if plan.table_names != [t.name for t in tables]:
        raise ConfigError(f"plan tables {plan.table_names} differ from the model's {[t.name for t in tables]}")
    for pt, spec in zip(plan.tables, tables):
        if pt.num_rows != spec.num_rows:
            raise ConfigError(f"plan table {pt.name!r} has {pt.num_rows} rows, the model's has {spec.num_rows}")
    owners, replicas, holders, fetch = [], [], [], []
    multi = plan.holders.sum(1) > 1
    for t, spec in enumerate(tables):
        sl = plan.table_partitions(t)
        lens = plan.part_rows[sl]
        order = plan.order(t)
        own = np.empty(spec.num_rows, dtype=np.int32)
        own[order] = np.repeat(plan.owner_of_part[sl], lens)
        owners.append(own)
        reps = np.flatnonzero(multi[sl]) + sl.start
        if reps.size:
            rl = plan.part_rows[reps]
            idx = np.concatenate([np.arange(plan.part_start[p], plan.part_stop[p]) for p in reps])
            replicas.append(order[idx])
            holders.append(np.repeat(plan.holders[reps], rl, axis=0))
            fetch.append(np.repeat(plan.fetch[reps], rl, axis=0))
        else:
            replicas.append(np.zeros(0, dtype=np.int64))
    W = plan.world_size
    H = np.concatenate(holders) if holders else np.zeros((0, W), bool)
    Fm = np.concatenate(fetch) if fetch else np.zeros((0, W), np.int64)
    return AddressMap.build(tables, W, owners, replicas, H, Fm)
