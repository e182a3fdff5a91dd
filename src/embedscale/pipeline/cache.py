"""The trainer-side life-cycle embedding cache that resolves pipelined training's read-after-write conflict.

EL-Rec (SC 2022) section V-B, Fig. 10: while the trainer computes batch ``t``, the parameter server has
already read the rows of batches ``t + 1 .. t + k - 1`` from host memory, before the gradients of the
batches in flight reached it; a prefetched row that one of those batches updates is *stale*. The cache
keeps the up-to-date copy of every row a recent batch updated, and patches incoming prefetched rows with it.

Life cycle (V-B): the rows of a finished batch enter the cache together, with a life-cycle counter (LC)
equal to the number of gradient batches the server still has to pull before it has applied this batch
(the queues' length ``k`` once the pipeline is full, fewer while it fills). Every gradient pull decrements
the counters; rows whose counter reaches zero are evicted, since every batch prefetched from then on reads
them fresh from the server. The trainer learns of the pulls from the prefetched batches themselves: each
carries ``applied``, the number of gradient batches the server had applied when it read the rows
(:meth:`LifeCycleCache.advance`).

Why this is exact: batch ``s`` was read after the server applied batches ``< applied(s)``; the cache then
holds the rows of every batch in ``[applied(s), s)`` as that batch left them, and a row found in several
entries is taken from the newest; rows of older batches were evicted and are current on the server. So
a patched row is the row sequential training would read. The optimizer state (row-wise Adagrad's per-row
sum) is cached and patched with the weights.

Layout: one entry per finished batch (all rows of a batch share one counter, so the counter is kept per
entry), each entry per host dim group the batch's sorted unique rows, their updated weights and state, on
the trainer's device. Inserting is by reference (the trainer's local buffer becomes the entry, no copy, no
merge). The optimizer step can be deferred: an entry may hold the rows as the batch read them plus their
aggregated updates and the step that applies them (``update``); the step then runs when a row is patched,
on the few rows a later batch reads (about a quarter of them in the pipeline benchmark), instead of on
every row of every batch on the trainer's critical path. The step is elementwise per row, so applying it
to a subset gives the same bits. Patching copies rows from each live entry, oldest first so the newest copy wins, at
positions the server computed ahead of time (one rank: it prefetched both batches) or found here by one
``searchsorted`` per entry; eviction drops whole entries. After batch ``t`` the cache holds entries of batches ``t - k + 1 .. t``
only, so never more than the rows of the last ``k`` batches (``peak_rows`` records the largest size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from embedscale.errors import InputError


@dataclass
class _Entry:
    """The rows one finished batch updated, per host dim group, with their life-cycle counter."""

    batch: int
    life: int
    rows: list[torch.Tensor | None]  # per group: int64 [u] sorted unique flat rows (None: nothing)
    weights: list[torch.Tensor | None]  # per group: [u, dim] after the batch's update (before, when ``update``)
    momentum: list[torch.Tensor | None]  # per group: float32 [u], or None (SGD)
    updates: list[torch.Tensor | None] | None = None  # per group: [u, dim] deferred aggregated updates
    update: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], None] | None = None  # in place (w, m, u)

    @property
    def num_rows(self) -> int:
        return sum(r.numel() for r in self.rows if r is not None)


class LifeCycleCache:
    """Up-to-date copies of recently updated host rows, evicted by life-cycle counters (EL-Rec V-B).

    Args:
        dims: embedding dim of each host dim group.
        device: where the cached rows live (the trainer's device).
        dtype: weight dtype.
        with_momentum: also cache the row-wise Adagrad state (one float32 per row).

    Attributes:
        applied: gradient pulls observed so far (see :meth:`advance`).
        peak_rows: most rows held at once (a row held by two entries counts twice).
        hits, lookups: replacements made (a row patched from two entries counts twice) / rows looked for.

    Example::

        >>> import torch
        >>> cache = LifeCycleCache([2])
        >>> cache.insert(0, [torch.tensor([3, 5])], [torch.ones(2, 2)], [None], life=2)   # batch 0's rows
        >>> w = torch.zeros(3, 2)
        >>> cache.patch(0, torch.tensor([1, 3, 4]), w)       # row 3 is stale: patched
        1
        >>> cache.advance(1), cache.num_rows                  # one pull: life 2 -> 1
        (0, 2)
        >>> cache.advance(2), cache.num_rows                  # another: life 0, evicted
        (2, 0)
    """

    def __init__(self, dims: Sequence[int], *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, with_momentum: bool = False) -> None:
        self.dims = list(dims)
        self.device = torch.device(device) if device is not None else torch.get_default_device()
        self.dtype = dtype
        self.with_momentum = with_momentum
        self.reset()

    def reset(self) -> None:
        """Empty the cache and restart the pull count (a new pass of the pipeline)."""
        self._entries: list[_Entry] = []
        self.applied = 0
        self.peak_rows = 0
        self.hits = 0
        self.lookups = 0

    # -- size ---------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows held now, over all groups and entries."""
        return sum(e.num_rows for e in self._entries)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def memory_bytes(self) -> int:
        """Bytes held now: rows (int64), weights, optimizer state."""
        n = 0
        for e in self._entries:
            for r, w, m in zip(e.rows, e.weights, e.momentum):
                if r is not None:
                    n += r.numel() * r.element_size() + w.numel() * w.element_size()
                    n += w.numel() * w.element_size() if e.updates is not None else 0
                    n += m.numel() * m.element_size() if m is not None else 0
        return n

    def latest(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(rows, weights, momentum)`` of every row of ``group`` held now, newest copy of each row
        (for checkpoints taken while a pipeline runs)."""
        dim = self.dims[group]
        rows = torch.empty(0, dtype=torch.int64, device=self.device)
        w = torch.empty(0, dim, dtype=self.dtype, device=self.device)
        m = torch.empty(0, dtype=torch.float32, device=self.device) if self.with_momentum else None
        for e in self._entries:  # oldest first: later copies overwrite
            r = e.rows[group]
            if r is None or r.numel() == 0:
                continue
            keep = ~torch.isin(rows, r)
            ew, em = self._rows_of(e, group, None)
            rows = torch.cat([rows[keep], r])
            w = torch.cat([w[keep], ew.to(self.dtype)])
            if m is not None:
                m = torch.cat([m[keep], em])
        return rows, w, m

    @staticmethod
    def _rows_of(e: _Entry, group: int, src: torch.Tensor | None):
        """Weights and state of ``e``'s rows at positions ``src`` (all when ``None``) as the batch left
        them: copies, with a deferred optimizer step applied to just these rows."""
        w, m = e.weights[group], e.momentum[group]
        if e.updates is None:
            if src is None:
                return w, m
            return w.index_select(0, src), (m.index_select(0, src) if m is not None else None)
        u = e.updates[group]
        if src is None:
            w, m = w.clone(), (m.clone() if m is not None else None)
        else:
            w, u = w.index_select(0, src), u.index_select(0, src)
            m = m.index_select(0, src) if m is not None else None
        e.update(w, m, u)
        return w, m

    # -- life cycle ---------------------------------------------------------------------------------
    def advance(self, applied: int) -> int:
        """The server has now pulled and applied ``applied`` gradient batches: decrement every counter by
        the pulls since the last call and evict the entries that reach zero. Returns the rows evicted."""
        pulls = int(applied) - self.applied
        if pulls < 0:
            raise InputError(f"LifeCycleCache.advance: applied went back from {self.applied} to {applied}")
        if pulls == 0:
            return 0
        self.applied = int(applied)
        evicted = 0
        keep = []
        for e in self._entries:
            e.life -= pulls
            if e.life > 0:
                keep.append(e)
            else:
                evicted += e.num_rows
        self._entries = keep
        return evicted

    def patch(self, group: int, rows: torch.Tensor, weights: torch.Tensor,
              momentum: torch.Tensor | None = None,
              plans: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """Replace, in place, the prefetched ``weights`` (and ``momentum``) of every row of ``rows`` (sorted
        unique flat rows) that the cache holds by the newest cached copy. Returns the replacements made.

        ``plans`` (optional) maps an entry's batch to ``(dst, src)``: positions in ``rows`` and in that
        entry's rows of their common rows, found ahead of time by the server (one rank: the server
        prefetched both batches, so it knows both row sets). Entries without a plan are searched here.
        """
        self.lookups += rows.numel()
        if rows.numel() == 0:
            return 0
        n = 0
        for e in self._entries:  # oldest first: a newer entry's copy overwrites an older one's
            cached = e.rows[group]
            if cached is None or cached.numel() == 0:
                continue
            plan = plans.get(e.batch) if plans is not None else None
            if plan is not None:
                where, src = plan
            else:
                pos = torch.searchsorted(cached, rows).clamp_(max=cached.numel() - 1)
                where = (cached.index_select(0, pos) == rows).nonzero().view(-1)
                src = pos.index_select(0, where)
            if where.numel() == 0:
                continue
            ew, em = self._rows_of(e, group, src)
            weights.index_copy_(0, where, ew.to(weights.dtype))
            if momentum is not None and em is not None:
                momentum.index_copy_(0, where, em)
            n += where.numel()
        self.hits += n
        return n

    def insert(self, batch: int, rows: list[torch.Tensor | None], weights: list[torch.Tensor | None],
               momentum: list[torch.Tensor | None], life: int, *, updates: list[torch.Tensor | None] | None = None,
               update: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], None] | None = None) -> None:
        """Put the rows a finished batch updated (per group: sorted unique rows, updated weights and state;
        held by reference, so the caller must not modify them afterwards) with counter ``life``.

        With ``updates`` and ``update``, ``weights`` and ``momentum`` are the rows *before* the batch's
        optimizer step and ``update(w, m, u)`` applies it in place; it runs only on rows that get patched."""
        if life <= 0:
            return
        if len(rows) != len(self.dims):
            raise InputError(f"LifeCycleCache.insert: {len(rows)} groups, the cache has {len(self.dims)}")
        if (updates is None) != (update is None):
            raise InputError("LifeCycleCache.insert: give both updates and update, or neither")
        mom = [m if self.with_momentum else None for m in momentum]
        self._entries.append(_Entry(int(batch), int(life), list(rows), list(weights), mom,
                                    list(updates) if updates is not None else None, update))
        self.peak_rows = max(self.peak_rows, self.num_rows)

    def stats(self) -> dict:
        return {"rows": self.num_rows, "entries": self.num_entries, "peak_rows": self.peak_rows,
                "hits": self.hits, "lookups": self.lookups, "applied": self.applied}
