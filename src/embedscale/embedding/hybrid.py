"""Row groups of one table: its hot rows exact, its cold rows a tensor-train table (issue 16's row groups).

A few rows of a skewed table take most of its lookups (OPER section 3.1, Fig. 2): a TT table (EL-Rec section
III) pays its slice products on every one of them, and compresses the very rows the model reads most.
:class:`HybridTTEmbeddingBag` keeps a table's ``H`` hottest rows as exact rows and stores only the other
``N - H`` in TT cores (a :class:`~embedscale.embedding.tt.TTEmbeddingBag` of ``N - H`` rows).

**Ids.** The table's ids are *reordered* ids (EL-Rec section IV, :mod:`embedscale.reorder`): the hot rows take
the first ids in frequency order, so id ``i < H`` is hot row ``i`` and id ``i >= H`` is row ``i - H`` of the TT
part. The module that renames the ids (``MixedEmbedding``'s reordering) comes first; this one only splits.

**Pooling.** One bag's hot and cold ids pool separately and add up; ``mean`` divides both by the whole bag's
length (and per-sample weights ride along), so the result equals an exact table holding the hot rows followed by
the materialised TT rows (:meth:`HybridTTEmbeddingBag.full_weight`, the tests' reference).

**Training.** The hot rows take the exact tables' fused optimizer (``sgd`` or FBGEMM's row-wise Adagrad, at the
exact tables' learning rate), the TT part the TT optimizer (EL-Rec III-B). On several ranks the table is a
data-parallel replica (EL-Rec VI-B): the hot rows' dense gradient ``[H, dim]`` joins the TT cores' gradients in
the step's one :class:`~embedscale.embedding.tt.GradSyncBucket` sum (as ``"<table>#hot"``), and every rank applies
the same update to the summed gradient (a zero gradient leaves a row as it was, under both optimizers).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from embedscale.embedding.optim import aggregate_row_gradients, rowwise_adagrad_update_, sgd_update_
from embedscale.embedding.tt import MODES, TTEmbeddingBag, _make_bags, _sync_and_apply, default_init_std
from embedscale.errors import ConfigError

HOT_OPTIMIZERS = ("sgd", "rowwise_adagrad")
HOT_SUFFIX = "#hot"  # the hot rows' name in a GradSyncBucket


class _HotSync:
    """The hot rows as a member of a ``GradSyncBucket`` (``name``, ``grad_sync``, ``_apply_dense``)."""

    def __init__(self, owner: "HybridTTEmbeddingBag") -> None:
        self.owner = owner
        self.name = owner.name + HOT_SUFFIX
        self.grad_sync = None

    def _apply_dense(self, dense: list[torch.Tensor]) -> None:
        o = self.owner
        o._apply_hot(torch.arange(o.hot_rows, device=dense[0].device), dense[0])


#: up to this many hot rows the backward sums gradients into a dense ``[H, dim]`` buffer and updates every hot row
#: (an untouched row's zero gradient leaves it as it was, both optimizers); beyond, per unique row (one sort)
DENSE_HOT_ROWS = 1 << 16


class _HotLookup(torch.autograd.Function):
    """Pooled hot rows over the whole batch (a cold id reads hot row 0 at weight 0); backward sums each row's
    gradient and updates it (fused), or hands the dense gradient to the ranks' sum first."""

    @staticmethod
    def forward(ctx, anchor, module, ids, offsets, weight):  # noqa: ARG004
        ctx.module, ctx.ids, ctx.offsets, ctx.weight = module, ids, offsets, weight
        return F.embedding_bag(ids, module.hot_weight, offsets, mode="sum", per_sample_weights=weight,
                               include_last_offset=True)

    @staticmethod
    def backward(ctx, grad_out):
        m = ctx.module
        with torch.no_grad():
            lengths = ctx.offsets.diff()
            bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                          output_size=ctx.ids.numel())
            g = grad_out.index_select(0, bag).mul_(ctx.weight.unsqueeze(1))
            if m._hot.grad_sync is not None or m.hot_rows <= DENSE_HOT_ROWS:
                dense = torch.zeros_like(m.hot_weight)
                dense.index_add_(0, ctx.ids, g.to(dense.dtype))
                if m._hot.grad_sync is not None:
                    _sync_and_apply(m._hot, [dense])
                else:
                    m._hot._apply_dense([dense])
            elif ctx.ids.numel():
                rows, summed = aggregate_row_gradients(ctx.ids, g, num_rows=m.hot_rows)
                m._apply_hot(rows, summed)
        return None, None, None, None, None


class HybridTTEmbeddingBag(nn.Module):
    """``H`` exact hot rows and a TT table of the other ``N - H`` rows behind one ``nn.EmbeddingBag``-style call.

    Args:
        num_embeddings: rows ``N`` of the table.
        embedding_dim: its dim.
        tt_rank: rank of the TT part (one int, or the inner ranks).
        hot_rows: ``H``, ``0 < H < N``: ids ``0 .. H-1`` are the exact rows (the reordered hot rows).
        mode: ``sum`` or ``mean`` (over the whole bag).
        include_last_offset: as ``nn.EmbeddingBag``.
        optimizer, lr, eps: the hot rows' fused optimizer (``sgd``, ``rowwise_adagrad`` or ``None``: the hot
            rows are an ``nn.Parameter`` with autograd gradients).
        hot_init: ``[H, dim]`` initial values of the hot rows (default: uniform in ``+-1/sqrt(N)``).
        tt_optimizer, tt_lr: the TT part's optimizer and learning rate (``TTEmbeddingBag``'s).
        init_std: std of the TT part's rows at init (default ``1/sqrt(3 N)``, the whole table's).
        seed, device, name, validate: as ``TTEmbeddingBag``; ``tt_options``: more of its keyword arguments.

    Attributes:
        cold: the ``TTEmbeddingBag`` of rows ``H .. N-1``.
        hot_weight, hot_state: the hot rows and their row-wise Adagrad state (buffers; ``hot_state`` only with
            ``rowwise_adagrad``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tt_rank: int | Sequence[int] = 32, *,
                 hot_rows: int, mode: str = "sum", include_last_offset: bool = False,
                 optimizer: str | None = "sgd", lr: float = 0.01, eps: float = 1e-8,
                 hot_init: torch.Tensor | None = None, tt_optimizer: str | None = "sgd", tt_lr: float | None = None,
                 init_std: float | None = None, seed: int | None = None,
                 device: torch.device | str | None = None, name: str = "tt", validate: bool = True,
                 **tt_options) -> None:
        super().__init__()
        if not isinstance(hot_rows, int) or isinstance(hot_rows, bool) or not 0 < hot_rows < num_embeddings:
            raise ConfigError(f"table {name!r}: hot_rows must be an integer in (0, {num_embeddings}), got {hot_rows!r}")
        if mode not in MODES:
            raise ConfigError(f"table {name!r}: mode {mode!r} is not one of {MODES}")
        if optimizer is not None and optimizer not in HOT_OPTIMIZERS:
            raise ConfigError(f"table {name!r}: the hot rows' optimizer {optimizer!r} is not one of {HOT_OPTIMIZERS} "
                              "or None")
        self.name = name
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.hot_rows = int(hot_rows)
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.validate = validate
        self.dtype = torch.float32
        self.hot_optimizer = optimizer
        self.hot_lr = float(lr)
        self.eps = float(eps)
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.cold = TTEmbeddingBag(self.num_embeddings - self.hot_rows, embedding_dim, tt_rank, mode="sum",
                                   include_last_offset=True, optimizer=tt_optimizer,
                                   lr=lr if tt_lr is None else tt_lr, eps=eps,
                                   init_std=default_init_std(self.num_embeddings) if init_std is None else init_std,
                                   seed=seed, device=device, name=name, validate=False, **tt_options)
        if hot_init is None:
            bound = 1.0 / float(self.num_embeddings) ** 0.5
            gen = torch.Generator(device=device)
            gen.manual_seed(0 if seed is None else int(seed) + 7919)
            hot_init = torch.empty(self.hot_rows, embedding_dim, device=device).uniform_(-bound, bound, generator=gen)
        hot_init = torch.as_tensor(hot_init, dtype=self.dtype).to(device)
        if tuple(hot_init.shape) != (self.hot_rows, self.embedding_dim):
            raise ConfigError(f"table {name!r}: hot_init has shape {tuple(hot_init.shape)}, expected "
                              f"({self.hot_rows}, {self.embedding_dim})")
        if optimizer is None:
            self.hot_weight = nn.Parameter(hot_init.clone())
        else:
            self.register_buffer("hot_weight", hot_init.clone())
        if optimizer == "rowwise_adagrad":
            self.register_buffer("hot_state", torch.zeros(self.hot_rows, device=device, dtype=torch.float32))
        self._hot = _HotSync(self)

    # -- what MixedEmbedding and the checkpoints use ----------------------------------------------------
    @property
    def grad_sync(self):
        return self.cold.grad_sync

    @grad_sync.setter
    def grad_sync(self, sync: Callable[[list[torch.Tensor]], None] | None) -> None:
        self.cold.grad_sync = sync
        self._hot.grad_sync = sync

    @property
    def sync_names(self) -> list[str]:
        """The names this table contributes to a ``GradSyncBucket`` under: the TT cores', the hot rows'."""
        return [self.name, self._hot.name]

    @property
    def lr(self) -> float:
        return self.cold.lr

    @property
    def optimizer(self) -> str | None:
        return self.cold.optimizer

    @property
    def device(self) -> torch.device:
        return self.hot_weight.device

    @property
    def memory_bytes(self) -> int:
        """Bytes of the hot rows, their state, the TT cores and theirs."""
        hot = self.hot_weight.numel() * self.hot_weight.element_size()
        if hasattr(self, "hot_state"):
            hot += self.hot_state.numel() * self.hot_state.element_size()
        return hot + self.cold.memory_bytes

    def extra_repr(self) -> str:
        return f"name={self.name!r}, rows={self.num_embeddings}, hot_rows={self.hot_rows}, mode={self.mode}"

    def full_weight(self) -> torch.Tensor:
        """All ``N`` rows materialised: the hot rows, then the TT part's rows (a reference, not for large tables)."""
        return torch.cat([self.hot_weight.detach(), self.cold.full_weight(self.cold.num_embeddings)])

    # -- lookup ---------------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows ``[B, embedding_dim]`` (``nn.EmbeddingBag``'s signature and conventions)."""
        bags = _make_bags(self, input, offsets, per_sample_weights)  # checks ids in [0, N); mean's 1/length
        values, scale, offs = bags.values, bags.scale, bags.offsets
        # both parts see the whole batch (same bags, no split): an id of the other part reads row 0 at weight 0
        is_hot = values < self.hot_rows
        w_hot = is_hot.to(self.dtype)
        w_cold = 1.0 - w_hot
        if scale is not None:
            w_hot, w_cold = w_hot * scale, w_cold * scale
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        out_cold = self.cold(torch.where(is_hot, zero, values - self.hot_rows), offs, w_cold)
        hot_ids = torch.where(is_hot, values, zero)
        if self.hot_optimizer is not None and torch.is_grad_enabled():
            anchor = torch.empty(0, device=self.device, requires_grad=True)
            out_hot = _HotLookup.apply(anchor, self, hot_ids, offs, w_hot)
        else:
            out_hot = F.embedding_bag(hot_ids, self.hot_weight, offs, mode="sum", per_sample_weights=w_hot,
                                      include_last_offset=True)
        return out_hot + out_cold

    @torch.no_grad()
    def _apply_hot(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """The fused optimizer on unique hot ``rows`` with their summed gradients."""
        if self.hot_optimizer == "sgd":
            sgd_update_(self.hot_weight, rows, grads, self.hot_lr)
        else:
            rowwise_adagrad_update_(self.hot_weight, self.hot_state, rows, grads, self.hot_lr, self.eps)
