"""A sharded embedding's rows as state: checkpoints, delta tracking, EBC interop and live migration.

A mixin of :class:`~embedscale.embedding.sharded.ShardedEmbedding`. Every row of the model is in exactly one
rank's shard state (its owned rows and the replicas it owns); :meth:`ShardState.track_touched` records which
rows the optimizer updated for delta checkpoints; a TorchRec ``EmbeddingBagCollection``'s state dict loads by
table and row (:mod:`embedscale.embedding.interop`); :meth:`ShardState.adopt_address_map` runs the storage under a
live migration's edited map with every row in its place.
"""

from __future__ import annotations

import numpy as np
import torch

from embedscale.device import HOST
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.interop import ebc_weight_key, has_ebc_names
from embedscale.errors import ConfigError, InputError


class ShardState:
    """The storage's rows as checkpoint state (mixed into ``ShardedEmbedding``; see the module docstring)."""

    def track_touched(self) -> None:
        """Record from now on which storage rows the optimizer updates (owned rows and replicas: one bool per
        storage row, set by the update); called again, forget the rows recorded so far. For delta checkpoints:
        ``shard_state(touched_only=True)``."""
        if self.touched is None:
            self.touched = torch.zeros(self.weight.shape[0], dtype=torch.bool, device=self.weight.device)
        else:
            self.touched.zero_()

    def shard_state(self, touched_only: bool = False) -> dict:
        """The rows this rank owns (its owned region, and the replicas it owns), with optimizer state:
        what a sharded checkpoint stores. Every row of the model is in exactly one rank's shard state.
        ``touched_only``: only those updated since :meth:`track_touched` (a delta checkpoint's)."""
        rep = self.amap.replica_gids_on(self.rank)
        mine = self.amap.owner_of(rep) == self.rank
        owned, off = self.amap.owned_rows(self.rank)  # off: arange unless a live migration edited the map
        gids = np.concatenate([owned, rep[mine]])
        idx = torch.from_numpy(np.concatenate([off, self.num_owned + np.flatnonzero(mine)]))
        if touched_only:
            if self.touched is None:
                raise ConfigError("shard_state(touched_only=True): rows are not tracked (call track_touched first)")
            hit = self.touched.index_select(0, idx.to(self.touched.device)).to(HOST).numpy()
            gids, idx = gids[hit], idx[torch.from_numpy(hit)]
        st = {"gids": torch.from_numpy(gids), "weight": self.weight[idx.to(self.weight.device)].detach().to(HOST)}
        if self.optimizer == "rowwise_adagrad":
            st["momentum"] = self.momentum[idx.to(self.momentum.device)].to(HOST)
        return st

    @torch.no_grad()
    def adopt_address_map(self, amap: AddressMap) -> None:
        """Run under ``amap`` from now on: the running map as a live migration edited it
        (``embedding.migrate.migrate_in_place``, which writes the rows that move itself). The storage takes
        ``amap``'s size for this rank and every row keeps its place: a shorter storage is a view of the same
        memory, a longer one grows into the pooling table's spare rows when there are enough (no copy), else
        once into a new tensor with a quarter more room (amortised over migrations); the row-wise state and
        the updated-rows flags follow the same way. Rows past the old size start at zero."""
        if amap.world_size != self.world_size or amap.table_names != self.amap.table_names:
            raise ConfigError("sharded embedding: adopt_address_map needs a map of the same tables and world size")
        n, dev, me = amap.storage_rows(self.rank), self.weight.device, self.rank
        self.amap = amap
        self._set_map(amap, dev)
        self.weight, self._backing = _resized(self.weight, n, self._backing)
        if self.optimizer == "rowwise_adagrad":
            self.momentum, self._momentum_room = _resized(self.momentum, n, self._momentum_room)
        if self.touched is not None:
            self.touched, self._touched_room = _resized(self.touched, n, self._touched_room)

    def _shard_gids(self, rank: int) -> np.ndarray:
        """Global ids of the rows in ``rank``'s shard state (``shard_state``'s order), from the address map."""
        rep = self.amap.replica_gids_on(rank)
        return np.concatenate([self.amap.owned_gids(rank), rep[self.amap.owner_of(rep) == rank]])

    @torch.no_grad()
    def ebc_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Collective (every rank calls it): the whole tables under a TorchRec ``EmbeddingBagCollection``'s
        names, ``{prefix}embedding_bags.<table>.weight [num_rows, dim]``, on every rank (on the storage's
        device). Each rank sends the rows of its shard state (every row is in exactly one) to every peer
        through the transport, and every rank places them by table and row. Weights only (an EBC's state
        dict has no optimizer state); needs the memory of all tables on every rank."""
        me, W = self.rank, self.world_size
        st = self.shard_state()
        dev = self.weight.device
        mine = st["weight"].to(dev)
        counts = [self._shard_gids(p).size if p != me else 0 for p in range(W)]
        got = self.transport.exchange([mine if p != me else mine[:0] for p in range(W)], recv_counts=counts,
                                      kind="checkpoint")
        got[me] = mine
        gids = np.concatenate([st["gids"].numpy() if p == me else self._shard_gids(p) for p in range(W)])
        if gids.size != self.amap.num_rows or np.unique(gids).size != gids.size:
            raise InputError(f"rank {me}: the shards hold {gids.size} rows ({np.unique(gids).size} distinct), "
                             f"the tables {self.amap.num_rows}")
        full = torch.empty((self.amap.num_rows, self.dim), dtype=self.weight.dtype, device=dev)
        full[torch.from_numpy(gids).to(dev)] = torch.cat(got)
        base = self.amap.table_base
        return {ebc_weight_key(t.name, prefix): full[int(base[i]):int(base[i]) + t.num_rows]
                for i, t in enumerate(self.tables)}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """An ``EmbeddingBagCollection``'s state dict (``{prefix}embedding_bags.<table>.weight``, whole
        tables, the same on every rank): each rank keeps the rows it holds (owned and replicas, by table and
        row: ``load_rows``); row-wise Adagrad state restarts at zero for them. Our own names as usual."""
        if not has_ebc_names(state_dict, prefix):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        expected, gids, rows, bad = set(), [], [], False
        for i, t in enumerate(self.tables):
            key = ebc_weight_key(t.name, prefix)
            expected.add(key)
            if key not in state_dict:
                missing_keys.append(key)
                continue
            w = state_dict[key]
            if tuple(w.shape) != (t.num_rows, self.dim):
                error_msgs.append(f"{key}: shape {tuple(w.shape)} in the checkpoint, ({t.num_rows}, {self.dim}) "
                                  f"in the module")
                bad = True
                continue
            gids.append(int(self.amap.table_base[i]) + np.arange(t.num_rows, dtype=np.int64))
            rows.append(w.detach())
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if rows and not bad:  # all or nothing: every rank skips a bad checkpoint alike
            with torch.no_grad():
                g = np.concatenate(gids)
                zeros = torch.zeros(g.size, dtype=torch.float32) if self.optimizer == "rowwise_adagrad" else None
                self.load_rows(g, torch.cat([r.to(self.weight.device) for r in rows]), zeros)

    def load_rows(self, gids: np.ndarray, weight: torch.Tensor, momentum: torch.Tensor | None = None) -> int:
        """Fill every storage row (owned or replica) whose global id is in ``gids``; returns rows filled."""
        mine = self.amap.storage_gids(self.rank)
        gids = np.asarray(gids)
        order = np.argsort(gids, kind="stable")  # runs of sorted ids (a shard's, a table's) merge in O(n)
        sorted_gids = gids[order]
        pos = np.searchsorted(sorted_gids, mine)
        pos = np.clip(pos, 0, max(len(gids) - 1, 0))
        hit = (sorted_gids[pos] == mine) if len(gids) else np.zeros(len(mine), bool)
        dst = torch.from_numpy(np.flatnonzero(hit))
        src = torch.from_numpy(order[pos[hit]])
        self.weight[dst] = weight[src].to(self.weight)
        if momentum is not None and self.optimizer == "rowwise_adagrad":
            self.momentum[dst] = momentum[src].to(self.momentum)
        return int(hit.sum())


def _resized(t: torch.Tensor, n: int, room: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t`` (a storage-sized tensor, rows first) as ``n`` rows, its rows in place: a view of ``room`` (the
    tensor ``t`` heads, with spare rows after it) when that holds ``n`` rows, else a new tensor with a quarter
    more room, ``t`` copied once. Returns ``(the n rows, the room they head)``; rows past ``len(t)`` are zero."""
    old = t.shape[0]
    if n <= old:
        return t[:n], room
    if room is None or room.data_ptr() != t.data_ptr() or room.shape[0] < n or room.dtype != t.dtype or \
            room.device != t.device or room.shape[1:] != t.shape[1:]:
        spare = room.shape[0] - old if room is not None and room.data_ptr() == t.data_ptr() else 0
        room = torch.empty((n + max(n // 4, spare), *t.shape[1:]), dtype=t.dtype, device=t.device)
        room[:old].copy_(t)
    room[old:n].zero_()
    return room[:n], room
