"""The all-in-one address map (OPER section 5.1): every row of every table -> (rank, offset).

All tables share one global id space: row ``r`` of table ``t`` has global id ``table_base[t] + r``. Each
rank holds one flat storage: first the rows it owns (``num_owned[rank]`` of them), then the replica rows
it holds. For every global id the map says who owns it and at which offset, and whether it is replicated
(its replica slot). ``fetch(rank, gids)`` decodes, for the rows a rank's mini-batch needs, the rank it
reads each row from and the offset there: itself when it owns or holds a replica, else the plan's fetch
rank for replicas (inference, Algorithm 1) or the owner.

Memory. The map is the only structure of the executor that grows with the rows of *all* tables on
*every* rank (the criteo-terabyte preset has 187.8M rows), so it keeps one packed code per row and
nothing else per row: ``row_code`` holds ``offset | source rank << shift | replica flag << flag_bit``
in 32 bits when every rank's storage fits the bits left after the rank (4 bytes per row; ``int64``
otherwise, the same layout as ``TorchAddressMap``'s codes). A row that is not replicated has the same
(rank, offset) for every rank: its owner and its offset there. A replicated row's code is one rank's
view of it (the rank that claimed the map, see ``view``; the owner's until then); the per-slot arrays
(``replica_gid``, ``replica_local``, ``replica_fetch``, ``replica_owner``) answer for every other rank,
and a gid finds its slot by binary search among the replicated gids. Replicas are the hot head (OPER
4.3): bytes per slot, not per row. ``TorchAddressMap`` shares ``row_code`` (on the CPU: one copy per
process, the numpy and the torch map together) and its codes *are* the executor's packed (rank, offset)
keys in the map's layout (``TorchAddressMap.SHIFT`` etc. per instance): a batch decodes with one gather of
4-byte codes and a widening, against an 8-byte gather before (``benchmarks/bench_address_map.py``).
Range representations (sorted partition bounds, searchsorted decode) were measured and rejected: OPER's
partitions are ranges of rows sorted by access count, scattered over the id space (a per-row plan), and
even for a row-wise plan a searchsorted decode of a 4096 x 26 batch took 1.65 ms against 0.16 ms for the
gather (a one-off measurement, benchmarks/results/history.md "The address map").

The map is built from any plan (OPER, table-wise, row-wise, TorchRec's, hand-written) in O(rows) numpy,
chunk by chunk (transient memory bounded by the chunk, not the tables), and lives in host memory, as in
the paper; the executor decodes a batch through its torch view, in host memory too
(``TorchAddressMap``), and never re-decides placement.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import numpy as np
import torch

from embedscale.device import HOST
from embedscale.errors import ConfigError
from embedscale.specs import TableSpec

_CHUNK = 1 << 22  # rows per construction / scan step: bounds the transient memory
_CLAIM = threading.Lock()  # one rank claims a map's shared codes (module-wide: maps stay deep-copyable)


def _layout(world_size: int, max_storage: int) -> tuple[np.dtype, int, int]:
    """``(dtype, shift, flag_bit)`` of the packed row code: 32 bits when the offsets fit, else 64."""
    rank_bits = (int(world_size) - 1).bit_length()
    shift32 = 30 - rank_bits
    if shift32 >= 1 and max_storage <= 1 << shift32:
        return np.dtype(np.int32), shift32, 30
    if max_storage > 1 << TorchAddressMap.SHIFT or world_size > 1 << (62 - TorchAddressMap.SHIFT):
        raise ConfigError("address map: a rank holds more than 2**40 rows, or more than 2**22 ranks")
    return np.dtype(np.int64), TorchAddressMap.SHIFT, 62


@dataclass(eq=False)
class AddressMap:
    """Placement of all tables over ``world_size`` ranks, at most one packed code per row.

    Attributes:
        world_size: ranks.
        table_names: table order of the global id space.
        table_base: int64 ``[T + 1]``: global id of each table's row 0 (and the total).
        row_code: int32 or int64 ``[G]``: ``offset | src << shift | replica << flag_bit`` of every global id
            (see the module docstring: a replicated row's code is the ``home`` rank's view of it).
        shift, flag_bit: the code's layout.
        owned_count: int64 ``[W]`` rows of each rank's owned region (owned, not replicated).
        replica_gid: int64 ``[S]`` global id of every slot.
        replica_owner: int32 ``[S]`` owner rank of every slot.
        replica_local: ``[S, W]``: index of slot ``s`` in rank ``w``'s replica region, or -1.
        replica_fetch: ``[S, W]``: the rank ``w`` reads slot ``s`` from.
        replica_order: int64 ``[S]`` slots by increasing global id (binary search gid -> slot).
        home: the rank whose view the replicated rows' codes hold (None: the owner's).
        free: per rank, the offsets of its owned region no row uses (a map edited in place by a live
            migration, ``embedding.migrate.edit_map``: its owned region keeps every staying row where it
            was, so it may have free rows and be out of global id order); ``None``: a map from :meth:`build`
            (owned region dense, in global id order).
    """

    world_size: int
    table_names: list[str]
    table_base: np.ndarray
    row_code: np.ndarray
    shift: int
    flag_bit: int
    owned_count: np.ndarray
    replica_gid: np.ndarray
    replica_owner: np.ndarray
    replica_local: np.ndarray
    replica_fetch: np.ndarray
    replica_order: np.ndarray
    home: int | None = None
    free: list[np.ndarray] | None = None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def build(cls, tables: list[TableSpec], world_size: int, owner: list[np.ndarray],
              replicas: list[np.ndarray] | None = None, replica_holders: np.ndarray | None = None,
              replica_fetch: np.ndarray | None = None) -> "AddressMap":
        """From per-table owner arrays and optional replicas.

        Args:
            owner: per table, int ``[num_rows]`` owner rank of every row (the smallest integer type that
                holds the ranks keeps the caller's transient memory low).
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
        owners = []
        for spec, o in zip(tables, owner):
            o = np.asarray(o)
            if o.shape != (spec.num_rows,):
                raise ConfigError(f"address map: table {spec.name!r}: owner array of shape {o.shape}, "
                                  f"expected ({spec.num_rows},)")
            if o.size and (o.min() < 0 or o.max() >= W):
                bad = int(np.flatnonzero((o < 0) | (o >= W))[0])
                raise ConfigError(f"address map: table {spec.name!r} row {bad}: owner rank {int(o[bad])} "
                                  f"outside world size {W}")
            owners.append(o)
        # replicated rows: their global ids (slot order), owners and holders
        if replicas is not None and len(replicas) != len(tables):
            raise ConfigError(f"address map: {len(replicas)} replica lists for {len(tables)} tables")
        parts, rep_owner = [], []
        for t, (spec, r) in enumerate(zip(tables, replicas or [])):
            r = np.asarray(r, dtype=np.int64).reshape(-1)
            if r.size and (r.min() < 0 or r.max() >= spec.num_rows):
                bad = int(r[(r < 0) | (r >= spec.num_rows)][0])
                raise ConfigError(f"address map: table {spec.name!r}: replicated row {bad} outside "
                                  f"[0, {spec.num_rows})")
            parts.append(base[t] + r)
            rep_owner.append(owners[t][r].astype(np.int32))
        gids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        rep_own = np.concatenate(rep_owner) if rep_owner else np.zeros(0, dtype=np.int32)
        S = gids.size
        by_gid = np.argsort(gids, kind="stable").astype(np.int64)
        if S and (np.diff(gids[by_gid]) == 0).any():
            raise ConfigError("address map: a row is listed as replicated twice")
        holders = np.ones((S, W), dtype=bool) if replica_holders is None else np.array(replica_holders, bool)
        if holders.shape != (S, W):
            raise ConfigError(f"address map: replica_holders has shape {holders.shape}, expected {(S, W)}")
        holders[np.arange(S), rep_own] = True  # a replicated row's owner is one of its holders
        if replica_fetch is None:
            fetch = np.where(holders, np.arange(W, dtype=np.int32)[None, :], rep_own[:, None]).astype(np.int32)
        else:
            fetch = np.asarray(replica_fetch)
            if fetch.shape != (S, W):
                raise ConfigError(f"address map: replica_fetch has shape {fetch.shape}, expected {(S, W)}")
            if S and (fetch.min() < 0 or fetch.max() >= W):
                raise ConfigError(f"address map: replica_fetch names a rank outside world size {W}")
            fetch = fetch.astype(np.int32)
            src_holds = holders[np.arange(S)[:, None], fetch]
            if not src_holds.all():
                s_, w_ = np.argwhere(~src_holds)[0]
                raise ConfigError(f"address map: rank {w_} fetches replica slot {s_} (global row "
                                  f"{gids[s_]}) from rank {fetch[s_, w_]}, which does not hold it")
        held = holders.sum(0).astype(np.int64)
        local_dtype = np.int32 if S < 2**31 else np.int64
        local = np.where(holders, np.cumsum(holders, axis=0, dtype=np.int64) - 1, -1).astype(local_dtype)
        # the owned region holds the rows a rank owns that are not replicated, in global id order
        num_owned = np.zeros(W, dtype=np.int64)
        for o in owners:
            for lo in range(0, o.size, _CHUNK):
                num_owned += np.bincount(o[lo:lo + _CHUNK], minlength=W)[:W]
        num_owned -= np.bincount(rep_own, minlength=W)[:W].astype(np.int64)
        dtype, shift, flag_bit = _layout(W, int((num_owned + held).max()) if W else 0)
        code = np.empty(int(base[-1]), dtype=dtype)
        sorted_gids = gids[by_gid]
        counter = np.zeros(W + 1, dtype=np.int64)
        for t, o in enumerate(owners):
            for lo in range(0, o.size, _CHUNK):
                hi = min(lo + _CHUNK, o.size)
                g0 = int(base[t]) + lo
                key = o[lo:hi].astype(np.int16 if W < 2**15 else np.int64)  # radix-sortable
                a, b = np.searchsorted(sorted_gids, [g0, g0 + hi - lo])
                if b > a:
                    key[sorted_gids[a:b] - g0] = W  # replicated rows: no place in the owned region
                order = np.argsort(key, kind="stable")
                counts = np.bincount(key, minlength=W + 1).astype(np.int64)
                starts = np.zeros(W + 1, dtype=np.int64)
                np.cumsum(counts[:-1], out=starts[1:])
                rank_in = np.empty(hi - lo, dtype=np.int64)
                rank_in[order] = np.arange(hi - lo, dtype=np.int64) - np.repeat(starts - counter, counts)
                code[g0:g0 + hi - lo] = (key.astype(np.int64) << shift) | rank_in
                counter += counts
        amap = cls(W, [t.name for t in tables], base, code, shift, flag_bit, num_owned, gids, rep_own, local,
                   fetch, by_gid)
        if S:  # replicated rows: the owner's view (its replica region) until a rank claims the map
            code[gids] = amap._slot_codes(rep_own.astype(np.int64), np.arange(S))
        return amap

    # -- the packed code ------------------------------------------------------------------------
    def _slot_codes(self, src: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Codes of replica ``slots`` read from ranks ``src`` (which hold them)."""
        off = self.owned_count[src] + self.replica_local[slots, src]
        return ((np.int64(1) << self.flag_bit) | (src.astype(np.int64) << self.shift) | off).astype(
            self.row_code.dtype)

    def _unpack(self, code: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(replicated, src, offset)`` of packed codes (src and offset meaningful for plain rows)."""
        c = code.astype(np.int64)
        rep = (c >> self.flag_bit) != 0
        src = (c >> self.shift) & ((1 << (self.flag_bit - self.shift)) - 1)
        return rep, src, c & ((1 << self.shift) - 1)

    def view(self, rank: int) -> np.ndarray:
        """``row_code`` with every replicated row as ``rank`` reads it (its fetch rank and offset there).

        Rows that are not replicated read the same for every rank, so the array is shared: the first rank
        to ask claims the map (its replicated rows' codes are rewritten for it, O(slots)); another rank of
        the same process (tests, benchmarks) gets a private copy. One rank per process shares one array."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"address map: rank {rank} outside world size {self.world_size}")
        S = self.num_slots
        if S == 0:
            return self.row_code
        codes = self._slot_codes(self.replica_fetch[:, rank].astype(np.int64), np.arange(S))
        with _CLAIM:
            if self.home is None or self.home == rank:
                self.row_code[self.replica_gid] = codes
                self.home = rank
                return self.row_code
        out = self.row_code.copy()
        out[self.replica_gid] = codes
        return out

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self.table_base[-1])

    @property
    def num_slots(self) -> int:
        return int(self.replica_gid.size)

    def num_owned(self) -> np.ndarray:
        """Rows of each rank's owned region (owned and not replicated; with :attr:`free` rows, those too)."""
        return self.owned_count.copy()

    def num_replicas_held(self) -> np.ndarray:
        return (self.replica_local >= 0).sum(0).astype(np.int64)

    def storage_rows(self, rank: int) -> int:
        return int(self.owned_count[rank] + self.num_replicas_held()[rank])

    def slot_of(self, gids) -> np.ndarray:
        """Replica slot of each global id, or -1 (binary search among the replicated gids)."""
        gids = np.asarray(gids, dtype=np.int64)
        if self.num_slots == 0:
            return np.full(gids.shape, -1, dtype=np.int64)
        i = np.searchsorted(self.replica_gid, gids, sorter=self.replica_order)
        s = self.replica_order[np.minimum(i, self.num_slots - 1)]
        return np.where(self.replica_gid[s] == gids, s, -1)

    def owner_of(self, gids) -> np.ndarray:
        """Owner rank of each global id (int32)."""
        gids = np.asarray(gids, dtype=np.int64)
        rep, src, _ = self._unpack(self.row_code[gids])
        out = src.astype(np.int32)
        if rep.any():
            out[rep] = self.replica_owner[self.slot_of(gids[rep])]
        return out

    def owner_offset_of(self, gids) -> np.ndarray:
        """Offset of each global id in its owner's storage (a replicated row: in the owner's replica region)."""
        gids = np.asarray(gids, dtype=np.int64)
        rep, _, off = self._unpack(self.row_code[gids])
        if rep.any():
            s = self.slot_of(gids[rep])
            own = self.replica_owner[s].astype(np.int64)
            off[rep] = self.owned_count[own] + self.replica_local[s, own]
        return off

    def owned_gids(self, rank: int) -> np.ndarray:
        """Global ids of rank ``rank``'s owned region (owned, not replicated), in storage order (= gid order)."""
        out = []
        for lo in range(0, self.num_rows, _CHUNK):
            c = self.row_code[lo:lo + _CHUNK]
            out.append(lo + np.flatnonzero((c >> self.shift) == rank))  # replicated rows: flag above the rank
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)

    def owned_rows(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(gids, offsets)`` of rank ``rank``'s owned region: its rows in global id order and where each sits
        (``arange`` for a map from :meth:`build`; any free rows of an edited map are in neither)."""
        gids = self.owned_gids(rank)
        return gids, (self.row_code[gids] & ((1 << self.shift) - 1)).astype(np.int64)

    def replica_gids_on(self, rank: int) -> np.ndarray:
        """Global ids of the replicas rank ``rank`` holds, in its replica-region order."""
        held = np.flatnonzero(self.replica_local[:, rank] >= 0)
        return self.replica_gid[held[np.argsort(self.replica_local[held, rank])]]

    def storage_gids(self, rank: int) -> np.ndarray:
        """Global id of every row of rank ``rank``'s flat storage (owned, then replicas); -1 at a free row."""
        if self.free is None:
            return np.concatenate([self.owned_gids(rank), self.replica_gids_on(rank)])
        gids, off = self.owned_rows(rank)
        owned = np.full(int(self.owned_count[rank]), -1, dtype=np.int64)
        owned[off] = gids
        return np.concatenate([owned, self.replica_gids_on(rank)])

    def holders_of(self, gids) -> np.ndarray:
        """bool ``[len(gids), W]``: the ranks whose storage holds each global id (its owner; a replicated
        row's holders, the owner among them). A row is in rank ``q``'s ``storage_gids(q)`` iff
        ``holders_of(row)[q]``."""
        gids = np.asarray(gids, dtype=np.int64)
        rep, src, _ = self._unpack(self.row_code[gids])
        out = np.zeros((gids.size, self.world_size), dtype=bool)
        plain = np.flatnonzero(~rep)
        out[plain, src[plain]] = True
        r = np.flatnonzero(rep)
        if r.size:  # a replicated row: its holders (the owner among them), by its slot
            out[r] = self.replica_local[self.slot_of(gids[r])] >= 0
        return out

    def fetch(self, rank: int, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each global id: (rank it is read from, offset in that rank's storage, replica slot or -1)."""
        gids = np.asarray(gids, dtype=np.int64)
        rep, src, off = self._unpack(self.row_code[gids])
        slot = np.full(gids.shape, -1, dtype=np.int64)
        if rep.any():
            s = self.slot_of(gids[rep])
            f = self.replica_fetch[s, rank].astype(np.int64)
            slot[rep] = s
            src[rep] = f
            off[rep] = self.owned_count[f] + self.replica_local[s, f]
        return src, off, slot


class TorchAddressMap:
    """Rank ``rank``'s view of the map as torch tensors (in host memory), for per-batch decoding.

    Built on the host from the numpy map (sharing its ``row_code``: no copy per row, see ``AddressMap.view``)
    and kept there by the sharded executor (OPER 5.1): a batch's ids are decoded where the input pipeline
    holds them, and only the decoded batch crosses to the device (no copy of ``row_code``, 4-8 bytes per row of
    all tables, on any accelerator). :meth:`to` moves the view where a caller needs it elsewhere.

    ``codes(gids)`` gives every gid's ``(src, offset)`` from this rank's point of view packed into one int64,
    ``src << self.SHIFT | offset`` with ``self.REPLICA`` set when the row is a replica: the packed row codes,
    gathered and widened (no other pass). The layout is the map's: ``SHIFT``, ``REPLICA``, ``KEY_MASK`` and
    ``OFF_MASK`` are read from the instance (the class values are the 64-bit layout's, ``src << 40``, bit 62).
    The codes sort by (source rank, offset): the order of the requests to each peer.
    """

    SHIFT = 40  # the 64-bit layout: offsets below 2**40 rows per rank, ranks below 2**22
    REPLICA = 1 << 62
    KEY_MASK = REPLICA - 1
    OFF_MASK = (1 << SHIFT) - 1
    _TENSORS = ("table_base", "row_code", "src_lut", "slot_lut", "region_slot", "num_owned", "replica_local",
                "replica_gid", "replica_order")

    def __init__(self, amap: AddressMap, rank: int):
        self.amap = amap
        self.rank = rank
        self.table_base = torch.from_numpy(amap.table_base)
        self.row_code = torch.from_numpy(amap.view(rank))
        self.SHIFT = amap.shift
        self.REPLICA = 1 << amap.flag_bit
        self.KEY_MASK = self.REPLICA - 1
        self.OFF_MASK = (1 << amap.shift) - 1
        self.src_lut = self.slot_lut = self.region_slot = None
        if amap.row_code.dtype == np.int64:
            assert amap.shift == TorchAddressMap.SHIFT and amap.flag_bit == 62
        else:  # 32-bit layout: h = code >> shift = flag << rank_bits | src indexes small tables
            rank_bits = amap.flag_bit - amap.shift
            h = np.arange(2 << rank_bits, dtype=np.int64)
            self.src_lut = torch.from_numpy(h & ((1 << rank_bits) - 1))
            if amap.num_slots:
                self._slot_tables(amap, rank, h, rank_bits)
        self.num_owned = torch.from_numpy(amap.num_owned())
        self.replica_local = torch.from_numpy(amap.replica_local[:, rank].astype(np.int64))
        self.replica_gid = torch.from_numpy(amap.replica_gid)
        self.replica_order = torch.from_numpy(amap.replica_order)

    def _slot_tables(self, amap: AddressMap, rank: int, h: np.ndarray, rank_bits: int) -> None:
        """Slots from codes, for ``decode``: a replicated row's code names the rank this rank reads it from and
        its offset there, i.e. its place in that rank's replica region; ``region_slot`` lists the regions of
        the ranks this rank reads replicas from (after a -1 for the rows that are not replicated) and
        ``slot_lut[h] + offset`` is a code's index there (negative, clamped to the -1, for plain rows)."""
        parts, slut = [np.full(1, -1, dtype=np.int64)], np.full(h.size, -(1 << 40), dtype=np.int64)
        pos = 1
        for f in np.unique(amap.replica_fetch[:, rank]).tolist():
            held = np.flatnonzero(amap.replica_local[:, f] >= 0)
            parts.append(held[np.argsort(amap.replica_local[held, f], kind="stable")].astype(np.int64))
            hf = (1 << rank_bits) | f
            slut[hf] = pos - int(amap.owned_count[f])
            pos += held.size
        self.region_slot = torch.from_numpy(np.concatenate(parts))
        self.slot_lut = torch.from_numpy(slut)

    @property
    def device(self) -> torch.device:
        return self.row_code.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this view holds (the ones that move with :meth:`to`)."""
        return {n: getattr(self, n) for n in self._TENSORS if getattr(self, n) is not None}

    def to(self, device: torch.device | str | None) -> "TorchAddressMap":
        """This map with its tensors on ``device`` (``self`` when they are already there)."""
        device = torch.device(device) if device is not None else HOST
        if self.row_code.device == device:
            return self
        out = copy.copy(self)
        for name, t in self.tensors().items():
            setattr(out, name, t.to(device))
        return out

    def codes(self, gids: torch.Tensor) -> torch.Tensor:
        """int64 ``src << self.SHIFT | offset`` (``self.REPLICA``: replica) of each gid, as this rank reads it."""
        return self.row_code.index_select(0, gids).to(torch.int64)

    def slots(self, gids: torch.Tensor) -> torch.Tensor:
        """Replica slot of each gid, or -1 (binary search among the replicated gids: bytes per slot only)."""
        S = self.replica_gid.numel()
        if S == 0:
            return torch.full_like(gids, -1)
        i = torch.searchsorted(self.replica_gid, gids, sorter=self.replica_order).clamp_(max=S - 1)
        s = self.replica_order.index_select(0, i)
        return torch.where(self.replica_gid.index_select(0, s) == gids, s, torch.full_like(s, -1))

    def sources(self, gids: np.ndarray) -> np.ndarray:
        """The rank each gid (int64 NumPy, host) is read from: ``decode``'s first part alone, in NumPy on the
        host map (one gather and a shift; a few microseconds for a few thousand gids, where each torch operation
        costs more than the work)."""
        c = self.row_code.to(HOST).numpy()[gids].astype(np.int64, copy=False)
        if self.src_lut is not None:
            return self.src_lut.to(HOST).numpy()[c >> self.SHIFT]
        return (c & self.KEY_MASK) >> self.SHIFT

    def decode(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(src, offset, replica slot or -1)`` of each gid."""
        if self.src_lut is not None:  # 32-bit layout: small tables indexed by the code's rank and flag bits
            c = self.row_code.index_select(0, gids)
            h = c >> self.SHIFT
            src = self.src_lut.index_select(0, h)
            off = c.bitwise_and_(self.OFF_MASK).to(torch.int64)
            if self.region_slot is None:
                return src, off, torch.full_like(off, -1)
            pos = self.slot_lut.index_select(0, h).add_(off).clamp_(min=0)
            return src, off, self.region_slot.index_select(0, pos)
        c = self.codes(gids)
        slot = torch.full_like(c, -1)
        if self.replica_gid.numel():
            rep = (c >= self.REPLICA).nonzero().squeeze(1)
            slot.index_copy_(0, rep, self.slots(gids.index_select(0, rep)))
        return (c & self.KEY_MASK) >> self.SHIFT, c & self.OFF_MASK, slot


def address_map_from_plan(plan, tables: list[TableSpec]) -> AddressMap:
    """The executor's map of a ``plan.Plan``: owners, replica rows, their holders and fetch paths.

    Works for any plan (OPER, baselines, TorchRec's converted, hand-written): a partition held by more
    than one rank is replicated; its rows' holders and fetch ranks are the partition's. Within a rank the
    executor lays rows out its own way (owned region, then replicas); placement is the plan's. The
    per-table owner arrays it passes to ``AddressMap.build`` take the smallest integer type of the ranks.
    """
    return AddressMap.build(tables, plan.world_size, *plan_placement(plan, tables))


def plan_placement(plan, tables: list[TableSpec]) -> tuple[list, list, np.ndarray, np.ndarray]:
    """What :func:`address_map_from_plan` builds from: ``(owners, replicas, replica_holders, replica_fetch)``,
    the arguments of ``AddressMap.build`` (``embedding.migrate.edit_map`` edits a running map with them)."""
    if plan.table_names != [t.name for t in tables]:
        raise ConfigError(f"plan tables {plan.table_names} differ from the model's {[t.name for t in tables]}")
    for pt, spec in zip(plan.tables, tables):
        if pt.num_rows != spec.num_rows:
            raise ConfigError(f"plan table {pt.name!r} has {pt.num_rows} rows, the model's has {spec.num_rows}")
    W = plan.world_size
    own_dtype = np.int8 if W <= 127 else np.int16 if W <= 32767 else np.int32
    owners, replicas, holders, fetch = [], [], [], []
    multi = plan.holders.sum(1) > 1
    for t, spec in enumerate(tables):
        sl = plan.table_partitions(t)
        lens = plan.part_rows[sl]
        order = plan.rows_by_partition[t]
        own = np.repeat(plan.owner_of_part[sl].astype(own_dtype), lens)
        if order is not None:
            by_row = np.empty(spec.num_rows, dtype=own_dtype)
            by_row[order] = own
            own = by_row
        owners.append(own)
        reps = np.flatnonzero(multi[sl]) + sl.start
        if reps.size:
            rl = plan.part_rows[reps]
            idx = np.concatenate([np.arange(plan.part_start[p], plan.part_stop[p]) for p in reps])
            replicas.append(idx if order is None else np.asarray(order)[idx])
            holders.append(np.repeat(plan.holders[reps], rl, axis=0))
            fetch.append(np.repeat(plan.fetch[reps], rl, axis=0))
        else:
            replicas.append(np.zeros(0, dtype=np.int64))
    H = np.concatenate(holders) if holders else np.zeros((0, W), bool)
    Fm = np.concatenate(fetch) if fetch else np.zeros((0, W), np.int32)
    return owners, replicas, H, Fm
