"""The fused sparse optimizer on a sharded embedding's storage (the ``update`` stage's arithmetic).

A mixin of :class:`~embedscale.embedding.sharded.ShardedEmbedding`: per-row gradient sums merged without a second
sort, one fused update per row (SGD or row-wise Adagrad, ``embedding.optim``; FBGEMM's exact optimizers sum a row's
repeats first), replica rows synced over all ranks (OPER 5.3), and the C++ CPU kernel's fused path
(``embedding/kernels.cpp``: the same bits as the PyTorch ops). It touches only the storage (``weight``,
``momentum``, the updated-rows flags ``touched``) and its scratch buffers.
"""

from __future__ import annotations

import torch

from embedscale.embedding import kernels
from embedscale.embedding.grad_sync import gather_replica_grads, sync_replica_entries, sync_replica_grads
from embedscale.embedding.optim import aggregate_row_gradients, rowwise_adagrad_update_, sgd_update_

_NONE = torch.iinfo(torch.int64).max  # no entry yet (``merge_and_apply``'s first-entry table)


class RowUpdates:
    """The storage's fused optimizer (mixed into ``ShardedEmbedding``; see the module docstring)."""

    # -- the C++ CPU kernel (embedding/kernels.cpp): same bits as the PyTorch ops ------------------
    def kernel_ops(self):
        """The loaded C++ kernel when it applies to this module (``cpu_kernel``, float32 storage on the CPU,
        ``dim`` <= ``kernels.MAX_DIM``, built), else ``None``: the PyTorch ops."""
        if not self.cpu_kernel or self.dim > kernels.MAX_DIM or not kernels.takes(self.weight) or self.weight_decay:
            return None  # (weight decay: the PyTorch update, optim)
        return kernels.fused_ops()

    def _kernel_slot(self, n: int) -> torch.Tensor:
        """The kernel's row -> slot map over ``n`` storage rows (int32, all -1 between calls; 4 bytes a row)."""
        if self._kslot is None or self._kslot.numel() < n or self._kslot.device != self.weight.device:
            self._kslot = torch.full((n,), -1, dtype=torch.int32, device=self.weight.device)
        return self._kslot

    def kernel_row_sums(self, pos: torch.Tensor, kern: tuple, scale, grad_out: torch.Tensor, n: int, R: int):
        """Backward of a kernel-pooled lookup over ``[storage (n rows) | fetch area (R rows)]``: ``(rows_l,
        g_l, g_r)``, the storage rows read (first-seen order) with their gradient sums, and the sum of every
        fetch-area row; each sum over its values in batch order, as ``aggregate_row_gradients`` (one pass, a
        row -> slot map, no sort). ``rows_l`` and ``g_l`` are views of buffers reused by the next step."""
        offsets, one_hot, B = kern
        nv = pos.numel()
        g = grad_out if grad_out.dtype == torch.float32 and grad_out.stride(1) == 1 else \
            grad_out.to(torch.float32).contiguous()
        urows = self._kscratch.take("urows", nv, torch.int64, pos.device)
        ugrads = self._kscratch.take("ugrads", nv * self.dim, torch.float32, pos.device).view(nv, self.dim)
        fetched = torch.empty((R, self.dim), dtype=torch.float32, device=pos.device)
        u = kernels.fused_ops().sharded_row_grad_sums(
            pos, None if one_hot else offsets, None if scale is None else scale.contiguous(), g, B,
            len(self.feature_names), n, self._kernel_slot(n), urows, ugrads, fetched)
        return urows[:u], ugrads[:u], fetched

    def _kernel_apply(self, lists: list) -> None:
        """The fused optimizer by the C++ kernel: ``lists`` of ``(rows, grads, map or None, limit)``, summed per
        storage row in list order (a row's contributions added in that order, from zero: the association of
        ``_merge_row_grads`` and ``aggregate_row_gradients``), then one update per row. ``rows`` index ``map``
        when given (entries < 0 skipped); storage rows >= ``limit`` are skipped."""
        w = self.weight
        n = w.shape[0]
        none = w.new_empty(0, dtype=torch.int64)
        rows = [r.to(torch.int64).contiguous() for r, _g, _m, _l in lists]
        grads = [g.to(torch.float32).contiguous() for _r, g, _m, _l in lists]
        maps = [none if m is None else m for _r, _g, m, _l in lists]
        kernels.fused_ops().sharded_apply_row_grads(
            w, self.momentum if self.optimizer == "rowwise_adagrad" else None, self.touched, self._kernel_slot(n),
            rows, grads, maps, [int(lim) for _r, _g, _m, lim in lists], self.lr, self.eps)

    # -- updates ----------------------------------------------------------------------------------
    def apply_owned(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Fused optimizer on storage rows (repeats allowed: summed first, as FBGEMM's exact optimizers)."""
        if self.optimizer is None or rows.numel() == 0:
            return
        if self.kernel_ops() is not None:  # repeats summed in order, as the stable sort below sums them
            self._kernel_apply([(rows, grads, None, self.weight.shape[0])])
            return
        uniq, g = aggregate_row_gradients(rows, grads, num_rows=self.weight.shape[0])
        self._update(uniq, g)

    def _update(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Fused optimizer on *unique* storage rows, each with its summed gradient."""
        if self.optimizer is None or rows.numel() == 0:
            return
        if self.kernel_ops() is not None:
            self._kernel_apply([(rows, grads, None, self.weight.shape[0])])
            return
        if self.optimizer == "sgd":
            sgd_update_(self.weight, rows, grads, self.lr, self.weight_decay)
        else:
            rowwise_adagrad_update_(self.weight, self.momentum, rows, grads, self.lr, self.eps, self.weight_decay)
        if self.touched is not None:  # delta checkpoints: the rows updated since track_touched()
            self.touched[rows] = True

    def _merge_row_grads(self, rows: torch.Tensor, grads: torch.Tensor, more: list) -> tuple:
        """Sum per storage row: ``rows`` (unique, with ``grads``) first, then each ``(rows_q, grads_q)`` of
        ``more`` in order (each ``rows_q`` unique), without sorting: a row's sum is ``grads + grads_q0 +
        grads_q1 ...`` in that order, the association of summing the concatenation in order. A persistent
        row -> slot table (storage-sized, -1 outside this call) finds each row's slot. Returns unique rows
        and their sums (rows in first-seen order)."""
        more = [(r, g) for r, g in more if r.numel()]
        if not more:
            return rows, grads
        dev = rows.device
        n = self.weight.shape[0]
        if self._slot_of is None or self._slot_of.numel() < n or self._slot_of.device != dev:
            self._slot_of = torch.full((n,), -1, dtype=torch.int64, device=dev)
        slot_of = self._slot_of
        k = rows.numel()
        slot_of.index_copy_(0, rows, torch.arange(k, device=dev))
        all_rows, places = [rows], []
        for r, _g in more:
            s = slot_of.index_select(0, r)
            new = s < 0
            m = int(new.sum())
            if m:
                nr = r[new]
                ns = torch.arange(k, k + m, device=dev)
                slot_of.index_copy_(0, nr, ns)
                s = s.masked_scatter(new, ns)
                all_rows.append(nr)
                k += m
            places.append(s)
        out = grads.new_zeros((k, grads.shape[1]))
        out[:rows.numel()] = grads
        for s, (_r, g) in zip(places, more):
            out.index_add_(0, s, g.to(out.dtype))
        all_rows = torch.cat(all_rows)
        slot_of.index_fill_(0, all_rows, -1)
        return all_rows, out

    def merge_and_apply(self, first: tuple, more: list) -> None:
        """One fused update from per-row sums with a single host synchronisation (the count of rows updated).

        ``first``: ``(rows, grads)``, unique storage rows; ``more``: ``(rows, grads)`` lists in order, each
        list's rows unique, ``-1`` for an entry to skip (a row another path updates). A row's sum adds the
        lists in order from ``first``'s (or from zero), the association of :meth:`_merge_row_grads`; rows in
        first-seen order. Every size but the number of distinct rows is known on the host: slots are
        assigned by a scatter of each entry's first occurrence (no ``nonzero``, no ``unique``) into a buffer
        sized for every entry, and cut to the rows once that count is read."""
        rows0, g0 = first
        dev, k = g0.device, rows0.numel()
        more = [(r.to(dev), g) for r, g in more if r.numel()]
        if not more:
            self._update(rows0, g0)
            return
        n = self.weight.shape[0]
        if self._slot_of is None or self._slot_of.numel() < n + 1 or self._slot_of.device != dev:
            self._slot_of = torch.full((n + 1,), -1, dtype=torch.int64, device=dev)
        slot_of = self._slot_of  # row -> slot (-1 outside this call); entry n: the skipped entries' row
        slot_of.index_copy_(0, rows0, torch.arange(k, device=dev))
        r_all = torch.cat([r for r, _g in more])
        L = r_all.numel()
        skip = r_all < 0
        r_idx = torch.where(skip, n, r_all)
        pos = torch.arange(L, device=dev)
        if self._first_of is None or self._first_of.numel() != slot_of.numel() or self._first_of.device != dev:
            self._first_of = torch.full_like(slot_of, _NONE)
        first_pos = self._first_of  # row -> its first entry (_NONE outside this call)
        first_pos.scatter_reduce_(0, r_idx, pos, "amin")
        fresh = (slot_of.index_select(0, r_idx) < 0) & ~skip & (first_pos.index_select(0, r_idx) == pos)
        m_dev = fresh.sum()
        new_slot = torch.where(fresh, k + torch.cumsum(fresh, 0) - 1, -1)
        slot_of.scatter_reduce_(0, r_idx, new_slot, "amax")
        slots = torch.where(skip, k + L, slot_of.index_select(0, r_idx))  # skipped: the spare slot past all
        out = g0.new_zeros((k + L + 1, g0.shape[1]))
        out[:k] = g0
        rows = torch.full((k + L + 1,), -1, dtype=torch.int64, device=dev)
        rows[:k] = rows0
        rows.index_copy_(0, torch.where(fresh, new_slot, k + L), torch.where(fresh, r_all, -1))
        a = 0
        for r, g in more:
            out.index_add_(0, slots[a:a + r.numel()], g.to(out.dtype))
            a += r.numel()
        m = int(m_dev)  # the step's one read of a count the device computed
        slot_of.index_fill_(0, rows[:k + m], -1)
        slot_of[n] = -1
        first_pos.index_fill_(0, r_idx, _NONE)
        self._update(rows[:k + m], out[:k + m])

    def apply_partial_bag_grads(self, served, dtype) -> None:
        """Owner side of the send design's backward: for every peer, the rows it asked this rank to pool
        (``offsets``), each value's partial bag, its scale, and the gradients of those partial bags. Sums
        per row, applies owned rows, and sends replica rows through the replica AllReduce."""
        dev = self.weight.device
        rows, grads, rep_slots, rep_grads = [], [], [], []
        for offsets, pbag, scale, g_bags in served:
            if offsets.numel() == 0:
                continue
            r, g = aggregate_row_gradients(offsets.to(dev), g_bags, src_index=pbag.to(dev), scale=scale.to(dev))
            owned = r < self.num_owned
            rows.append(r[owned])
            grads.append(g[owned])
            if not bool(owned.all()):
                rep_slots.append(self.region_slot.to(dev)[r[~owned] - self.num_owned])
                rep_grads.append(g[~owned])
        if rows:
            self.apply_owned(torch.cat(rows), torch.cat(grads))
        if self.num_slots:
            self.sync_and_apply_replicas(
                torch.cat(rep_slots) if rep_slots else torch.zeros(0, dtype=torch.int64, device=dev),
                torch.cat(rep_grads) if rep_grads else torch.zeros((0, self.dim), dtype=dtype, device=dev))

    def apply_owned_and_replica_sums(self, owned: list, replicas: list) -> None:
        """One fused update from per-row sums (the send design's owner side): ``owned`` lists ``(storage rows,
        sums)`` in order, each list's rows unique and owned; ``replicas`` lists ``(storage rows, sums)`` of replica
        rows held here, summed over all ranks first (OPER 5.3, ``grad_sync.sync_replica_entries``); a row's sum
        adds the lists in order. Reads one count on the host (``merge_and_apply``), plus the replica sync's."""
        if self.optimizer is None:
            return
        dev = self.weight.device
        lists = list(owned)
        if self.num_slots:
            rs = self.region_slot.to(dev)
            slots = torch.cat([rs.index_select(0, r - self.num_owned) for r, _g in replicas]) if replicas else \
                torch.zeros(0, dtype=torch.int64, device=dev)
            grads = torch.cat([g for _r, g in replicas]) if replicas else self.weight.new_zeros(0, self.dim)
            st: dict = {}
            synced = sync_replica_entries(slots, grads, self.num_slots, method=self.grad_sync, group=self.sync_group,
                                          stats=st)
            self.stats["grad_sync_bytes"] = self.stats.get("grad_sync_bytes", 0) + st.get("bytes_sent", 0)
            lists += [(self.replica_storage_rows.index_select(0, s), g) for s, g in synced]
        self.merge_and_apply((torch.zeros(0, dtype=torch.int64, device=dev), self.weight.new_zeros(0, self.dim)),
                             lists)

    def sync_and_apply_replicas(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """Sum replica gradients over all ranks (OPER 5.3) and apply them on every holder."""
        if self.num_slots == 0 or self.optimizer is None:
            return
        st: dict = {}
        uslots, g = sync_replica_grads(slots, grads, self.num_slots, method=self.grad_sync,
                                       group=self.sync_group, stats=st)
        self.stats["grad_sync_bytes"] = self.stats.get("grad_sync_bytes", 0) + st.get("bytes_sent", 0)
        self._apply_replicas(uslots, g)

    def sync_replica_lists(self, slots: torch.Tensor, grads: torch.Tensor, order: torch.Tensor) -> list:
        """The replica gradients summed over all ranks (OPER 5.3) as ``(slots, sums)`` lists whose per-slot sum
        in list order is the synced gradient: one list, or one per rank in rank order (``allgather``, summed by
        the caller's merge). ``slots`` unique, ``order`` the permutation that sorts them."""
        if self.num_slots == 0 or self.optimizer is None:
            return []
        st: dict = {}
        if self.grad_sync == "allgather":
            out = gather_replica_grads(slots, grads, group=self.sync_group, stats=st)
        else:
            out = [sync_replica_grads(slots.index_select(0, order), grads.index_select(0, order), self.num_slots,
                                      method=self.grad_sync, group=self.sync_group, stats=st, presorted=True)]
        self.stats["grad_sync_bytes"] = self.stats.get("grad_sync_bytes", 0) + st.get("bytes_sent", 0)
        return out

    def _apply_replicas(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply the summed gradients of replica ``slots`` (unique) to the ones this rank holds."""
        rows, g = self._replica_rows(slots, grads)
        self._update(rows, g)

    def _replica_rows(self, slots: torch.Tensor, grads: torch.Tensor) -> tuple:
        """The storage rows of the replica ``slots`` (unique) this rank holds, with their gradients."""
        local = self.tmap.replica_local.to(slots.device).index_select(0, slots)
        keep = (local >= 0).nonzero().squeeze(1)
        return self.num_owned + local.index_select(0, keep), grads.index_select(0, keep)

    def apply_row_sums(self, own: list, replicas: list | None, kernel: bool) -> None:
        """One fused update of every storage row from per-row sums: ``own`` lists ``(rows, sums)`` in order (this
        rank's first, then each peer's; each list's rows unique; rows past the owned region skipped: replicas
        are synced instead), ``replicas`` per rank ``(slots, sums)`` of replica rows (every rank's, rank order:
        the same bits on every holder) or ``None``. A row's sum adds the lists in order. ``kernel``: the C++
        kernel merges and updates in one call (a batch it pooled)."""
        if kernel and self.optimizer is not None:
            lists = [(r, g, None, self.num_owned) for i, (r, g) in enumerate(own) if i == 0 or r.numel()]
            if replicas is not None:
                rmap = self.replica_storage_rows
                lists += [(s, g, rmap, self.weight.shape[0]) for s, g in replicas]
            self._kernel_apply(lists)
            return
        owned = []
        for r, g in own:
            keep = r < self.num_owned
            if bool(keep.all()):
                owned.append((r, g))
            else:
                sel = keep.nonzero().squeeze(1)
                owned.append((r.index_select(0, sel), g.index_select(0, sel)))
        upd_rows, upd_g = self._merge_row_grads(owned[0][0], owned[0][1], owned[1:])
        if replicas is not None:
            dev = upd_g.device
            uslots, gsum = aggregate_row_gradients(torch.cat([s.to(dev) for s, _g in replicas]),
                                                   torch.cat([g for _s, g in replicas]), num_rows=self.num_slots)
            rr, rg = self._replica_rows(uslots, gsum)  # disjoint from the owned rows: one update for both
            upd_rows, upd_g = torch.cat([upd_rows, rr]), torch.cat([upd_g, rg.to(upd_g.dtype)])
        self._update(upd_rows, upd_g)
