"""Row groups of one table: its hot rows exact, its cold rows a tensor-train table (row groups).

A few rows of a skewed table take most of its lookups (OPER section 3.1, Fig. 2), and a TT table (EL-Rec section
III) compresses the very rows the model reads most. :class:`HybridTTEmbeddingBag` keeps a table's ``H`` hottest
rows exact: a TT table whose distinct rows ``< H`` are read from an exact ``[H, dim]`` block instead of its cores.

**Ids.** The table's ids are *reordered* ids (EL-Rec section IV, :mod:`embedscale.reorder`): the hot rows take
the first ids in frequency order, so id ``i < H`` is hot row ``i``. The module that renames the ids
(``MixedEmbedding``'s reordering) comes first.

**One lookup.** The Eff-TT lookup (EL-Rec III-A) already finds the batch's distinct rows (ascending, so the hot
ones come first) and computes each once; the hot ones are then replaced by their exact rows before pooling, and in
backward their gradients (already summed per distinct row, III-B's in-advance aggregation) go to the exact rows
and not to the cores. No second lookup, no second sort: a few element-wise operations over the distinct rows.
(The cores still compute the hot rows' products, a few of the batch's distinct rows, and cover all ``N`` rows:
their slices are shared with the cold rows.) The result equals an exact table holding the hot rows followed by
the TT rows ``H..N-1`` (:meth:`HybridTTEmbeddingBag.full_weight`, the tests' reference).

**Training.** The hot rows take the exact tables' fused optimizer (``sgd`` or FBGEMM's row-wise Adagrad, at the
exact tables' learning rate), the cores the TT optimizer (EL-Rec III-B). On several ranks the table is a
data-parallel replica (EL-Rec VI-B): the hot rows' dense gradient ``[H, dim]`` rides with the cores' gradients in
the step's one :class:`~embedscale.embedding.tt.GradSyncBucket` sum, and every rank applies the same update to the
summed gradient (a zero gradient leaves a row as it was, under both optimizers).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from embedscale.embedding.optim import rowwise_adagrad_update_, sgd_update_
from embedscale.embedding.tt import TTEmbeddingBag, _ReusePlan, default_init_std
from embedscale.errors import ConfigError

HOT_OPTIMIZERS = ("sgd", "rowwise_adagrad")


class HybridTTEmbeddingBag(TTEmbeddingBag):
    """A TT table of ``N`` rows whose ``H`` first (hot) rows are exact (``nn.EmbeddingBag``-style call).

    Args:
        num_embeddings: rows ``N`` of the table.
        embedding_dim: its dim.
        tt_rank: rank of the TT cores (one int, or the inner ranks).
        hot_rows: ``H``, ``0 < H < N``: ids ``0 .. H-1`` are exact rows (the reordered hot rows).
        optimizer, lr, eps: the hot rows' fused optimizer (``sgd``, ``rowwise_adagrad`` or ``None``: the hot
            rows are an ``nn.Parameter`` with autograd gradients).
        hot_init: ``[H, dim]`` initial values of the hot rows (default: uniform in ``+-1/sqrt(N)``).
        tt_optimizer, tt_lr: the cores' optimizer and learning rate (``TTEmbeddingBag``'s ``optimizer``, ``lr``).
        init_std: std of the TT rows at init (default ``1/sqrt(3 N)``).
        mode, include_last_offset, seed, device, name, validate and ``tt_options``: as ``TTEmbeddingBag``.

    Attributes:
        hot_weight, hot_state: the hot rows and their row-wise Adagrad state (buffers; ``hot_state`` only with
            ``rowwise_adagrad``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tt_rank: int | Sequence[int] = 32, *,
                 hot_rows: int, optimizer: str | None = "sgd", lr: float = 0.01, eps: float = 1e-8,
                 hot_init: torch.Tensor | None = None, tt_optimizer: str | None = "sgd", tt_lr: float | None = None,
                 init_std: float | None = None, device: torch.device | str | None = None, name: str = "tt",
                 **tt_options) -> None:
        if not isinstance(hot_rows, int) or isinstance(hot_rows, bool) or not 0 < hot_rows < num_embeddings:
            raise ConfigError(f"table {name!r}: hot_rows must be an integer in (0, {num_embeddings}), got {hot_rows!r}")
        if optimizer is not None and optimizer not in HOT_OPTIMIZERS:
            raise ConfigError(f"table {name!r}: the hot rows' optimizer {optimizer!r} is not one of {HOT_OPTIMIZERS} "
                              "or None")
        if (optimizer is None) != (tt_optimizer is None):
            raise ConfigError(f"table {name!r}: the hot rows and the cores are both trained by a fused optimizer or "
                              f"both by autograd (optimizer {optimizer!r}, tt_optimizer {tt_optimizer!r})")
        super().__init__(num_embeddings, embedding_dim, tt_rank, optimizer=tt_optimizer,
                         lr=lr if tt_lr is None else tt_lr, eps=eps,
                         init_std=default_init_std(num_embeddings) if init_std is None else init_std,
                         device=device, name=name, **tt_options)
        self.hot_rows = int(hot_rows)
        self.hot_optimizer = optimizer
        self.hot_lr = float(lr)
        dev = self.device
        if hot_init is None:
            bound = 1.0 / float(num_embeddings) ** 0.5
            gen = torch.Generator(device=dev)
            gen.manual_seed(int(tt_options.get("seed") or 0) + 7919)
            hot_init = torch.empty(self.hot_rows, embedding_dim, device=dev).uniform_(-bound, bound, generator=gen)
        hot_init = torch.as_tensor(hot_init, dtype=self.dtype).to(dev)
        if tuple(hot_init.shape) != (self.hot_rows, embedding_dim):
            raise ConfigError(f"table {name!r}: hot_init has shape {tuple(hot_init.shape)}, expected "
                              f"({self.hot_rows}, {embedding_dim})")
        if optimizer is None:
            self.hot_weight = nn.Parameter(hot_init.clone())
        else:
            self.register_buffer("hot_weight", hot_init.clone())
        if optimizer == "rowwise_adagrad":
            self.register_buffer("hot_state", torch.zeros(self.hot_rows, device=dev, dtype=torch.float32))

    @property
    def memory_bytes(self) -> int:
        """Bytes of the cores, their state, the hot rows and theirs."""
        hot = self.hot_weight.numel() * self.hot_weight.element_size()
        if hasattr(self, "hot_state"):
            hot += self.hot_state.numel() * self.hot_state.element_size()
        return super().memory_bytes + hot

    def extra_repr(self) -> str:
        return super().extra_repr() + f", hot_rows={self.hot_rows}"

    def full_weight(self, num_rows: int | None = None) -> torch.Tensor:
        """All rows materialised: the hot rows, then the TT rows (a reference, not for large tables)."""
        tt = super().full_weight(num_rows)
        return torch.cat([self.hot_weight.detach().to(tt.dtype), tt[self.hot_rows:]])

    # -- the hooks of TTEmbeddingBag's lookup --------------------------------------------------------------
    def _hot(self, plan: _ReusePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mask, row)`` of the batch's distinct rows: which are hot, and each one's hot row (clamped)."""
        return plan.rows < self.hot_rows, plan.rows.clamp(max=self.hot_rows - 1)

    def _exact_rows(self, rows: torch.Tensor, plan: _ReusePlan) -> torch.Tensor:
        mask, hot = self._hot(plan)
        return torch.where(mask.unsqueeze(1), self.hot_weight.index_select(0, hot).to(rows.dtype), rows)

    def _exact_grads(self, G: torch.Tensor, plan: _ReusePlan, dense) -> torch.Tensor:
        mask, hot = self._hot(plan)
        g = G * mask.unsqueeze(1).to(G.dtype)  # the hot rows' gradients (each row once: distinct rows)
        # dense (several ranks): its last entry (_zero_grads) is the hot rows', summed across ranks with the cores'
        # gradients and applied in _apply_dense; else applied now
        dense_hot = dense[self.num_cores] if dense is not None else torch.zeros_like(self.hot_weight)
        dense_hot.index_add_(0, hot, g.to(dense_hot.dtype))  # a cold row adds zeros to row H-1
        if dense is None:
            self._apply_hot(dense_hot)
        return G - g  # the cores take the cold rows' gradients only

    def _zero_grads(self) -> list[torch.Tensor]:
        return super()._zero_grads() + [torch.zeros_like(self.hot_weight)]

    @torch.no_grad()
    def _apply_dense(self, grads: list[torch.Tensor]) -> None:
        super()._apply_dense(grads[: self.num_cores])
        self._apply_hot(grads[self.num_cores])

    @torch.no_grad()
    def _apply_hot(self, grad: torch.Tensor) -> None:
        """The fused optimizer on every hot row with its dense gradient (zero where untouched: unchanged)."""
        rows = torch.arange(self.hot_rows, device=grad.device)
        if self.hot_optimizer == "sgd":
            sgd_update_(self.hot_weight, rows, grad, self.hot_lr)
        else:
            rowwise_adagrad_update_(self.hot_weight, self.hot_state, rows, grad, self.hot_lr, self.eps)
