"""The trainer-side life-cycle embedding cache that resolves pipelined training's read-after-write conflict.

EL-Rec (SC 2022) section V-B, Fig. 10: while the trainer computes batch ``t``, the parameter server has
already read the rows of batches ``t + 1 .. t + k - 1`` from host memory, before the gradients of the
batches in flight reached it; a prefetched row that one of those batches updates is *stale*. The cache
keeps the up-to-date copy of every row a recent batch updated, and patches incoming prefetched rows with it.

Life cycle (V-B): the rows of a finished batch enter the cache with a life-cycle counter (LC) equal to the
number of gradient batches the server still has to pull before it has applied this batch (the queues'
length ``k`` once the pipeline is full, fewer while it fills). Every gradient pull decrements the counters;
a row whose counter reaches zero is evicted, since every batch prefetched from then on reads it fresh from
the server. A row updated again re-enters with a full counter. The trainer learns of the pulls from the
prefetched batches themselves: each carries ``applied``, the number of gradient batches the server had
applied when it read the rows (:meth:`LifeCycleCache.advance`).

Why this is exact: batch ``s`` was read after the server applied batches ``< applied(s)``; the cache then
holds, for every row touched by a batch in ``[applied(s), s)``, the value after the latest of those
batches (entries of older batches were evicted, and those rows are current on the server), so a patched
row is the row sequential training would read. The optimizer state (row-wise Adagrad's per-row sum) is
cached and patched with the weights.

Size: after batch ``t`` the cache holds rows of batches ``t - k + 1 .. t`` only, so never more than the
unique rows of the last ``k`` batches (``peak_rows`` records the largest size it reached).

Storage per dim group: sorted unique flat rows (int64), their weights ``[n, dim]``, optimizer state and
int32 counters, all on the trainer's device; lookups are one ``searchsorted``, inserts one merge (sort),
evictions one mask: no Python loop per row.
"""

from __future__ import annotations

from typing import Sequence

import torch

from embedscale.errors import InputError


class LifeCycleCache:
    """Up-to-date copies of recently updated host rows, evicted by life-cycle counters (EL-Rec V-B).

    Args:
        dims: embedding dim of each host dim group (one sub-cache per group).
        device: where the cached rows live (the trainer's device).
        dtype: weight dtype.
        with_momentum: also cache the row-wise Adagrad state (one float32 per row).

    Attributes:
        applied: gradient pulls observed so far (see :meth:`advance`).
        peak_rows: most rows held at once, over all groups.
        hits, lookups: prefetched rows found in the cache / looked for.
    """

    def __init__(self, dims: Sequence[int], *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, with_momentum: bool = False) -> None:
        self.dims = list(dims)
        self.device = torch.device(device) if device is not None else torch.get_default_device()
        self.dtype = dtype
        self.with_momentum = with_momentum
        self.reset()

    def reset(self) -> None:
        """Empty every group and restart the pull count (a new pass of the pipeline)."""
        dev = self.device
        self._rows = [torch.empty(0, dtype=torch.int64, device=dev) for _ in self.dims]
        self._weights = [torch.empty(0, d, dtype=self.dtype, device=dev) for d in self.dims]
        self._momentum = [torch.empty(0, dtype=torch.float32, device=dev) if self.with_momentum else None
                          for _ in self.dims]
        self._lc = [torch.empty(0, dtype=torch.int32, device=dev) for _ in self.dims]
        self.applied = 0
        self.peak_rows = 0
        self.hits = 0
        self.lookups = 0

    # -- size ---------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows held now, over all groups."""
        return sum(r.numel() for r in self._rows)

    def group_rows(self, group: int) -> torch.Tensor:
        """Sorted flat rows of ``group`` held now (a copy)."""
        return self._rows[group].clone()

    def row_bytes(self) -> int:
        """Bytes one cached row of each group takes, summed over the rows held now."""
        n = 0
        for g, d in enumerate(self.dims):
            per = d * torch.finfo(self.dtype).bits // 8 + 8 + 4 + (4 if self.with_momentum else 0)
            n += self._rows[g].numel() * per
        return n

    # -- life cycle ---------------------------------------------------------------------------------
    def advance(self, applied: int) -> int:
        """The server has now pulled and applied ``applied`` gradient batches: decrement every counter by
        the pulls since the last call and evict the rows that reach zero. Returns the rows evicted."""
        pulls = int(applied) - self.applied
        if pulls < 0:
            raise InputError(f"LifeCycleCache.advance: applied went back from {self.applied} to {applied}")
        if pulls == 0:
            return 0
        self.applied = int(applied)
        evicted = 0
        for g in range(len(self.dims)):
            lc = self._lc[g]
            if lc.numel() == 0:
                continue
            lc.sub_(pulls)
            keep = lc > 0
            kept = int(keep.sum())
            if kept == lc.numel():
                continue
            evicted += lc.numel() - kept
            self._rows[g] = self._rows[g][keep]
            self._weights[g] = self._weights[g][keep]
            self._lc[g] = lc[keep]
            if self._momentum[g] is not None:
                self._momentum[g] = self._momentum[g][keep]
        return evicted

    def patch(self, group: int, rows: torch.Tensor, weights: torch.Tensor,
              momentum: torch.Tensor | None = None) -> int:
        """Replace, in place, the prefetched ``weights`` (and ``momentum``) of every row of ``rows`` (sorted
        unique flat rows) that the cache holds by the cached fresh copy. Returns the number replaced."""
        cached = self._rows[group]
        self.lookups += rows.numel()
        if cached.numel() == 0 or rows.numel() == 0:
            return 0
        pos = torch.searchsorted(cached, rows)
        pos_c = pos.clamp_(max=cached.numel() - 1)
        hit = cached.index_select(0, pos_c) == rows
        where = hit.nonzero().view(-1)
        n = where.numel()
        if n == 0:
            return 0
        src = pos_c.index_select(0, where)
        weights.index_copy_(0, where, self._weights[group].index_select(0, src))
        if momentum is not None and self._momentum[group] is not None:
            momentum.index_copy_(0, where, self._momentum[group].index_select(0, src))
        self.hits += n
        return n

    def insert(self, group: int, rows: torch.Tensor, weights: torch.Tensor,
               momentum: torch.Tensor | None, life: int) -> None:
        """Put the updated rows of a finished batch (``rows`` sorted unique) with counter ``life``; a row
        already held is replaced by the new copy and its counter reset."""
        if life <= 0 or rows.numel() == 0:
            return
        cached = self._rows[group]
        new_lc = torch.full((rows.numel(),), int(life), dtype=torch.int32, device=rows.device)
        if cached.numel():
            pos = torch.searchsorted(rows, cached).clamp_(max=rows.numel() - 1)
            keep = rows.index_select(0, pos) != cached
            all_rows = torch.cat([cached[keep], rows])
            order = torch.argsort(all_rows)
            self._rows[group] = all_rows.index_select(0, order)
            self._weights[group] = torch.cat([self._weights[group][keep], weights.to(self.dtype)]).index_select(0, order)
            self._lc[group] = torch.cat([self._lc[group][keep], new_lc]).index_select(0, order)
            if self._momentum[group] is not None:
                self._momentum[group] = torch.cat([self._momentum[group][keep], momentum]).index_select(0, order)
        else:
            self._rows[group] = rows.clone()
            self._weights[group] = weights.to(self.dtype).clone()
            self._lc[group] = new_lc
            if self._momentum[group] is not None:
                self._momentum[group] = momentum.clone()
        self.peak_rows = max(self.peak_rows, self.num_rows)

    def stats(self) -> dict:
        return {"rows": self.num_rows, "peak_rows": self.peak_rows, "hits": self.hits, "lookups": self.lookups,
                "applied": self.applied}
