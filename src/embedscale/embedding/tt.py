"""Tensor-train (TT) embedding tables: EL-Rec's Eff-TT table and the plain TT-Rec reference.

A table ``T`` of ``M`` rows and dim ``N`` is stored as ``d`` TT cores (EL-Rec section II-B, eqs. 1-2).
The rows are factorised ``M <= m_1 * ... * m_d`` (padded: rows past ``M`` exist in the cores but are never
read) and the dim exactly ``N = n_1 * ... * n_d``. Core ``k`` holds one *slice* per index ``i_k``::

    core k: [m_k, R_{k-1}, n_k * R_k]         R_0 = R_d = 1, R_1 .. R_{d-1} = the TT rank

Row ``i`` has TT indices ``i_k = (i // prod_{j>k} m_j) mod m_k`` (eq. 3, ``i_1`` most significant) and is
the product of its slices (eq. 2); element ``(j_1, ..., j_d)`` of the row is column
``(..((j_1 n_2 + j_2) n_3 + j_3)..)`` of the ``[M, N]`` table, the same layout as TT-Rec's
``tt_matrix_to_full``.

:class:`TTEmbeddingBag` is a drop-in for ``torch.nn.EmbeddingBag`` (``input``, ``offsets``,
``per_sample_weights``, ``mode`` ``sum``/``mean``, ``include_last_offset``) implementing EL-Rec's Eff-TT:

* **Batch-level reuse (section III-A, Algorithm 1, eq. 5).** The batch's distinct rows are found with
  one sort; their distinct prefixes ``(i_1, .., i_{d-1})`` with one ``unique_consecutive`` per level
  (the rows are sorted, so a level's prefixes are too). The product of the first ``d - 1`` cores is
  computed once per distinct prefix with batched GEMM (``torch.bmm``) into the *reuse buffer*, level by
  level (level ``k`` reuses level ``k - 1``: the two-level reuse of the section's title for ``d = 3``);
  the last core is applied once per distinct row; the rows are pooled by ``offsets`` with one
  ``embedding_bag`` over the distinct rows. Algorithm 1's atomic flags become the sort. Where a level's
  core slices are larger than the prefix rows they multiply (the middle cores, ``R x n R`` slices), its
  entries are grouped by slice so the batched GEMM reads every distinct slice once (``_Group``; what
  cuBLAS's pointer arrays give for free on a GPU costs a gather per entry on a CPU); ``grouped=False``
  keeps Algorithm 1's one-slice-per-entry GEMM.
* **In-advance gradient aggregation (III-B, Fig. 6b).** The output gradient is first summed per distinct
  row (a segment sum over the sorted occurrences), then pushed through the cores once per distinct row
  and, through the reuse buffer, once per distinct prefix (eq. 6): the gradients of rows that share a
  prefix are summed before they reach the earlier cores.
* **Fused core update (III-B).** The aggregated slice gradients update the cores in place inside
  ``loss.backward()`` (SGD: one ``index_add_`` per core, no gradient tensor at all; Adagrad: the slice
  gradients summed per distinct slice, then the state and slice update). Cores never get a ``.grad``;
  do not call ``backward`` twice through the same lookup. ``optimizer=None`` instead makes the cores
  ``nn.Parameter`` s with ordinary autograd gradients (the same reuse forward, differentiated by torch).

Optimizers on the cores: ``sgd``; ``adagrad`` (element-wise, what TT-Rec's ``tt_adagrad_backward``
applies: ``s += g*g; w -= lr * g / (sqrt(s) + eps)``); ``rowwise_adagrad`` (one state per core slice, FBGEMM's
row-wise rule with a core slice as the row: ``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)``). The
gradient ``g`` of a slice is the sum over the whole batch (exact, not per occurrence).

Data parallelism: TT tables are small, so every rank holds all the cores and trains them data-parallel
(EL-Rec section VI-B). Set :attr:`TTEmbeddingBag.grad_sync` to a callable that sums a list of dense core
gradients across ranks in place (e.g. ``torch.distributed.all_reduce`` on each); the fused backward then
builds dense per-core gradients, calls it, and applies the update on the synced gradients, so every
replica stays identical. Several TT tables share one :class:`GradSyncBucket` as their ``grad_sync``: each
table's backward hands its dense gradients to the bucket, and when the last table of the step has, the bucket
sums all of them across ranks in one call (one all-reduce per step instead of one per table: on gloo each
all-reduce is a blocking round trip of the ranks, 4-12 ms on the shared 2-core machine against 1-4 ms of a
rank-8 table's backward compute) and then applies every table's update; the sums, hence the updates, are the
per-table ones. Inside ``loss.backward()`` the bucket starts that sum asynchronously and finishes it, with the
updates, in the backward's final callback (``GradSyncBucket.deferred``), so the other ranks' lateness is not
waited for in the middle of the backward.

:class:`TTRecEmbeddingBag` is the faithful baseline (TT-Rec, Yin et al., MLSys 2021, as released in
``FBTT-Embedding``): no reuse, one chain of slice products per looked-up index, the backward computes
the core gradients per occurrence (eq. 6 for every index), aggregates them into dense core-shaped
gradients (TT-Rec's ``atomicAdd`` into ``d_tt_cores``) and then updates the whole cores.

Initialisation (TT-Rec's initialisation study: sampled Gaussian cores calibrated so the reconstructed
table has the intended spread): every core entry is drawn ``N(0, s^2)`` with
``s = (std^2 / prod_k R_k) ^ (1 / 2d)``, so each reconstructed element, a sum of ``prod R_k`` products
of ``d`` independent entries, has mean 0 and standard deviation ``std``; by default ``std`` is that of
DLRM's ``U(-1/sqrt(M), 1/sqrt(M))`` rows, ``1/sqrt(3M)``.

Everything here is plain PyTorch on the device the module lives on; designed for, untested on GPU (on a
GPU the ``bmm`` calls are cuBLAS batched GEMMs, as in EL-Rec). float32 only.

Example::

    >>> import torch
    >>> from embedscale.embedding.tt import TTEmbeddingBag
    >>> bag = TTEmbeddingBag(1_000_000, 16, tt_rank=8, optimizer="sgd", lr=0.1, seed=0)
    >>> bag.row_shape, bag.dim_shape
    ([100, 100, 100], [2, 2, 4])
    >>> out = bag(torch.tensor([3, 5, 999_999, 3]), torch.tensor([0, 2]))   # two bags
    >>> out.shape
    torch.Size([2, 16])
    >>> out.sum().backward()          # cores updated in place
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from embedscale.embedding.optim import aggregate_row_gradients
from embedscale.errors import ConfigError, InputError
from embedscale.plan.forms import core_shapes, factor_dim, factor_rows, tt_ranks  # the TT size arithmetic (numpy)
from embedscale.specs import TableSpec

TT_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
MODES = ("sum", "mean")


# --------------------------------------------------------------------------------------------------
# factorisation and sizes


def tt_num_parameters(num_rows: int, dim: int, tt_rank: int | Sequence[int] = 32, num_cores: int = 3) -> int:
    """Values stored by a TT table of ``num_rows x dim`` with the default factorisation."""
    shapes = core_shapes(factor_rows(num_rows, num_cores), factor_dim(dim, num_cores), tt_ranks(tt_rank, num_cores))
    return sum(math.prod(s) for s in shapes)


def default_init_std(num_rows: int) -> float:
    """Standard deviation of DLRM's row init ``U(-1/sqrt(M), 1/sqrt(M))``: ``1/sqrt(3M)``."""
    return 1.0 / math.sqrt(3.0 * num_rows)


def core_init_std(target_std: float, ranks: Sequence[int]) -> float:
    """Entry std ``s`` of i.i.d. Gaussian cores whose product has element std ``target_std``:
    ``Var = s^(2d) * prod(R_1..R_{d-1})`` (see the module docstring)."""
    d = len(ranks) - 1
    return (target_std ** 2 / math.prod(ranks[1:-1])) ** (1.0 / (2 * d))


# --------------------------------------------------------------------------------------------------
# bags: nn.EmbeddingBag's input conventions


@dataclass
class _Bags:
    values: torch.Tensor  # int64 [n]
    offsets: torch.Tensor  # int64 [B + 1]
    scale: torch.Tensor | None  # [n] per-value factor (per-sample weight or 1/bag length) or None

    @property
    def num_bags(self) -> int:
        return self.offsets.numel() - 1

    def bag_of_value(self) -> torch.Tensor:
        lengths = self.offsets.diff()
        return torch.repeat_interleave(torch.arange(self.num_bags, device=self.values.device), lengths,
                                       output_size=self.values.numel())


def _make_bags(module, input: torch.Tensor, offsets: torch.Tensor | None,
               per_sample_weights: torch.Tensor | None) -> _Bags:
    """Validate ``nn.EmbeddingBag``-style arguments and return the bags (ids checked against the table)."""
    name = module.name
    if input.dtype not in (torch.int64, torch.int32):
        raise InputError(f"TT table {name!r}: input must be int32/int64 ids, got {input.dtype}")
    if input.dim() == 2:
        if offsets is not None:
            raise InputError(f"TT table {name!r}: offsets must be None for 2-D input (fixed-length bags)")
        B, L = input.shape
        values = input.reshape(-1).to(torch.int64)
        offs = torch.arange(0, B * L + 1, max(L, 1), device=input.device, dtype=torch.int64)
        if L == 0:
            offs = torch.zeros(B + 1, device=input.device, dtype=torch.int64)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif input.dim() == 1:
        if offsets is None:
            raise InputError(f"TT table {name!r}: 1-D input needs offsets")
        if offsets.dim() != 1:
            raise InputError(f"TT table {name!r}: offsets must be 1-D, got shape {tuple(offsets.shape)}")
        values = input.to(torch.int64)
        offs = offsets.to(torch.int64)
        n = values.numel()
        if not module.include_last_offset:
            offs = torch.cat([offs, torch.tensor([n], dtype=torch.int64, device=offs.device)])
        if offs.numel() == 0:
            raise InputError(f"TT table {name!r}: include_last_offset=True needs at least one offset")
        if module.validate:
            bad = (offs[0] != 0) | (offs[-1] != n)
            if offs.numel() > 1:
                bad = bad | (offs.diff() < 0).any()
            if bool(bad):
                raise InputError(f"TT table {name!r}: offsets must start at 0, never decrease and end at {n} "
                                 f"(the number of ids); got {offs.tolist()[:8]}{'...' if offs.numel() > 8 else ''}")
    else:
        raise InputError(f"TT table {name!r}: input must be 1-D (with offsets) or 2-D, got shape {tuple(input.shape)}")
    n = values.numel()
    if module.validate and n:
        lo, hi = torch.aminmax(values)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= module.num_embeddings:
            bad = lo if lo < 0 else hi
            raise InputError(f"TT table {name!r} ({module.num_embeddings} rows): row id {bad} is outside "
                             f"[0, {module.num_embeddings})")
    scale = None
    if per_sample_weights is not None:
        if per_sample_weights.numel() != n:
            raise InputError(f"TT table {name!r}: {per_sample_weights.numel()} per_sample_weights for {n} ids")
        scale = per_sample_weights.reshape(-1).to(module.dtype)
    if module.mode == "mean":
        # mean = (weighted) sum / bag length, as LocalEmbeddingBags; an empty bag pools to zeros
        lengths = offs.diff()
        inv = 1.0 / lengths.clamp(min=1).to(module.dtype)
        inv_v = torch.repeat_interleave(inv, lengths, output_size=n)
        scale = inv_v if scale is None else scale * inv_v
    return _Bags(values, offs, scale)


# --------------------------------------------------------------------------------------------------
# shared core machinery


class _TTCores(nn.Module):
    """Cores, factorisation, initialisation, optimizer state and materialisation (no lookup)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tt_rank: int | Sequence[int] = 32, *,
                 mode: str = "sum", include_last_offset: bool = False, num_cores: int = 3,
                 row_shape: Sequence[int] | None = None, dim_shape: Sequence[int] | None = None,
                 optimizer: str | None = "sgd", lr: float = 0.01, eps: float = 1e-8,
                 init_std: float | None = None, seed: int | None = None,
                 device: torch.device | str | None = None, name: str = "tt", validate: bool = True) -> None:
        super().__init__()
        if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings <= 0:
            raise ConfigError(f"TT table {name!r}: num_embeddings must be a positive integer, got {num_embeddings!r}")
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise ConfigError(f"TT table {name!r}: embedding_dim must be a positive integer, got {embedding_dim!r}")
        if mode not in MODES:
            raise ConfigError(f"TT table {name!r}: mode {mode!r} is not one of {MODES}")
        if optimizer is not None and optimizer not in TT_OPTIMIZERS:
            raise ConfigError(f"TT table {name!r}: optimizer {optimizer!r} is not one of {TT_OPTIMIZERS} or None")
        d = len(row_shape) if row_shape is not None else (len(dim_shape) if dim_shape is not None else num_cores)
        if d < 2:
            raise ConfigError(f"TT table {name!r}: needs at least 2 cores, got {d}")
        rs = list(row_shape) if row_shape is not None else factor_rows(num_embeddings, d)
        ds = list(dim_shape) if dim_shape is not None else factor_dim(embedding_dim, d)
        if len(rs) != d or len(ds) != d:
            raise ConfigError(f"TT table {name!r}: row_shape {rs} and dim_shape {ds} must both have {d} factors")
        if any(x <= 0 for x in rs + ds):
            raise ConfigError(f"TT table {name!r}: factors must be positive, got row_shape {rs}, dim_shape {ds}")
        if math.prod(rs) < num_embeddings:
            raise ConfigError(f"TT table {name!r}: row_shape {rs} covers {math.prod(rs)} rows, fewer than "
                              f"num_embeddings {num_embeddings}")
        if math.prod(ds) != embedding_dim:
            raise ConfigError(f"TT table {name!r}: dim_shape {ds} multiplies to {math.prod(ds)}, not "
                              f"embedding_dim {embedding_dim}")
        self.name = name
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.row_shape = rs
        self.dim_shape = ds
        self.ranks = tt_ranks(tt_rank, d)
        self.num_cores = d
        self.optimizer = optimizer
        self.lr = float(lr)
        self.eps = float(eps)
        self.validate = validate
        self.dtype = torch.float32
        self.grad_sync: Callable[[list[torch.Tensor]], None] | None = None
        device = torch.device(device) if device is not None else torch.get_default_device()
        self._core_names = [f"core{k}" for k in range(d)]
        for k, shape in enumerate(core_shapes(rs, ds, self.ranks)):
            t = torch.empty(shape, device=device, dtype=self.dtype)
            if optimizer is None:
                setattr(self, f"core{k}", nn.Parameter(t))
            else:
                self.register_buffer(f"core{k}", t)
            if optimizer == "adagrad":
                self.register_buffer(f"state{k}", torch.zeros(shape, device=device, dtype=torch.float32))
            elif optimizer == "rowwise_adagrad":
                self.register_buffer(f"state{k}", torch.zeros(shape[0], device=device, dtype=torch.float32))
        self.init_std = float(init_std) if init_std is not None else default_init_std(num_embeddings)
        self.reset_parameters(seed)

    # -- parameters ------------------------------------------------------------------------------
    @property
    def cores(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self._core_names]

    @property
    def states(self) -> list[torch.Tensor]:
        if self.optimizer not in ("adagrad", "rowwise_adagrad"):
            return []
        return [getattr(self, f"state{k}") for k in range(self.num_cores)]

    @property
    def device(self) -> torch.device:
        return self.core0.device

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Gaussian cores calibrated to ``init_std`` (module docstring); optimizer state zeroed."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed))
        s = core_init_std(self.init_std, self.ranks)
        for c in self.cores:
            c.normal_(0.0, s, generator=gen)
        for st in self.states:
            st.zero_()

    @torch.no_grad()
    def copy_cores_from(self, other: "_TTCores") -> None:
        """Copy cores and optimizer state from a TT table of the same shapes."""
        if [tuple(c.shape) for c in self.cores] != [tuple(c.shape) for c in other.cores]:
            raise ConfigError(f"TT table {self.name!r}: core shapes {[tuple(c.shape) for c in self.cores]} differ "
                              f"from {[tuple(c.shape) for c in other.cores]}")
        for a, b in zip(self.cores, other.cores):
            a.copy_(b)
        for a, b in zip(self.states, other.states):
            if a.shape == b.shape:
                a.copy_(b)

    @property
    def num_parameters(self) -> int:
        return sum(c.numel() for c in self.cores)

    @property
    def core_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.cores)

    @property
    def memory_bytes(self) -> int:
        """Bytes of cores plus optimizer state."""
        return self.core_bytes + sum(s.numel() * s.element_size() for s in self.states)

    @property
    def uncompressed_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * 4

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, rows={self.num_embeddings}, dim={self.embedding_dim}, row_shape={self.row_shape}, "
                f"dim_shape={self.dim_shape}, ranks={self.ranks}, mode={self.mode}, optimizer={self.optimizer}, "
                f"lr={self.lr}")

    def tt_indices(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Eq. 3: the TT index ``i_k`` of every row, per core (``i_1`` most significant)."""
        out = []
        rest = rows.to(torch.int64)
        for m in reversed(self.row_shape):
            out.append(rest % m)
            rest = rest // m
        return out[::-1]

    @torch.no_grad()
    def full_weight(self, num_rows: int | None = None) -> torch.Tensor:
        """The materialised ``[num_embeddings, dim]`` table (eq. 2 for every row; for tests and small tables)."""
        d = self.num_cores
        P = self.cores[0].view(self.row_shape[0], self.dim_shape[0], self.ranks[1])  # [prefixes, a, R]
        a = self.dim_shape[0]
        for k in range(1, d):
            C = self.cores[k]  # [m_k, R_k, n_k R_{k+1}]
            X = torch.einsum("par,mrs->pmas", P, C)  # [prefixes, m_k, a, n_k R_{k+1}]
            a *= self.dim_shape[k]
            P = X.reshape(-1, a, self.ranks[k + 1])
        n = self.num_embeddings if num_rows is None else num_rows
        return P.reshape(-1, self.embedding_dim)[:n].clone()

    @torch.no_grad()
    def lookup_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, dim]`` without autograd, one chain per row (any ids, no pooling)."""
        idx = self.tt_indices(rows.reshape(-1))
        P = self.cores[0].index_select(0, idx[0]).view(-1, self.dim_shape[0], self.ranks[1])
        for k in range(1, self.num_cores):
            C = self.cores[k].index_select(0, idx[k])
            P = torch.bmm(P, C).view(P.shape[0], -1, self.ranks[k + 1])
        return P.reshape(-1, self.embedding_dim)

    # -- optimizer ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _apply_dense(self, grads: list[torch.Tensor]) -> None:
        """Update every core from dense core-shaped gradients (zero where untouched)."""
        for k, (c, g) in enumerate(zip(self.cores, grads)):
            if self.optimizer == "sgd":
                c.add_(g, alpha=-self.lr)
            elif self.optimizer == "adagrad":
                s = getattr(self, f"state{k}")
                s.addcmul_(g, g)
                c.addcdiv_(g, s.sqrt().add_(self.eps), value=-self.lr)
            else:
                s = getattr(self, f"state{k}")
                s.add_(g.pow(2).mean(dim=(1, 2)))
                c.add_(g * (s.sqrt().add_(self.eps).reciprocal_().mul_(-self.lr)).view(-1, 1, 1))

    @torch.no_grad()
    def _apply_slices(self, k: int, slices: torch.Tensor, grads: torch.Tensor) -> None:
        """Update core ``k``'s distinct ``slices`` (no repeats) with their summed gradients ``[u, ...]``."""
        c = self.cores[k]
        if self.optimizer == "sgd":
            c.index_add_(0, slices, grads, alpha=-self.lr)
            return
        s_all = getattr(self, f"state{k}")
        if self.optimizer == "adagrad":
            s = s_all.index_select(0, slices).addcmul_(grads, grads)
            s_all.index_copy_(0, slices, s)
            c.index_add_(0, slices, grads / s.sqrt_().add_(self.eps), alpha=-self.lr)
        else:
            s = s_all.index_select(0, slices).add_(grads.pow(2).mean(dim=(1, 2)))
            s_all.index_copy_(0, slices, s)
            mult = s.sqrt_().add_(self.eps).reciprocal_().mul_(-self.lr)
            c.index_add_(0, slices, grads * mult.view(-1, 1, 1))


# --------------------------------------------------------------------------------------------------
# Eff-TT


@dataclass
class _Group:
    """Entries of one reuse level grouped by their core slice, for one batched GEMM per distinct slice.

    Entry ``u`` multiplies its prefix product ``P[parent[u]]`` by core slice ``C[idx[u]]``. Sorting the
    entries by slice and padding every slice's group to the largest group's size ``L`` turns the level
    into one ``bmm`` of ``J`` (distinct slices) matrix products ``[L * a, R] x [R, n R']``: every core
    slice is read once instead of once per entry (on a CPU the per-entry gather of slices, not the
    arithmetic, is what costs), and in backward the slice gradient ``sum_u P_u^T G_u`` of eq. 6 comes out
    already summed per distinct slice. ``slot`` is each entry's row in the padded ``[J * L]`` layout,
    ``src`` the parent of every padded row (padding rows point at parent 0: their output is dropped and
    their output gradient is zero, so they add nothing to either gradient).
    """

    slices: torch.Tensor  # distinct core-slice indices [J], ascending
    slot: torch.Tensor  # [U] padded row of each entry
    src: torch.Tensor  # [J * L] parent of each padded row (0 for padding)
    L: int
    num_parents: int


@dataclass
class _Level:
    """One reuse level ``k >= 1``: ``idx`` core-``k`` slice per entry, ``parent`` position of each entry's
    prefix in level ``k - 1`` (entries are sorted by parent; ``parent_offsets`` are the segment starts),
    ``group`` the slice grouping or ``None`` (per-entry gather + ``bmm``)."""

    idx: torch.Tensor
    parent: torch.Tensor
    parent_offsets: torch.Tensor
    group: _Group | None


@dataclass
class _ReusePlan:
    """Distinct rows and prefixes of a batch (section III-A, Algorithm 1).

    ``first`` holds the distinct core-0 indices (level 0); ``levels[k - 1]`` describes level ``k``: the
    distinct prefixes ``(i_1..i_{k+1})`` for ``k < d - 1`` (the reuse buffer) and the distinct rows for
    ``k = d - 1``. ``perm``/``counts``/``inverse`` map the batch's occurrences to the distinct rows.
    """

    perm: torch.Tensor  # occurrences sorted by row
    counts: torch.Tensor  # occurrences of each distinct row
    inverse: torch.Tensor  # distinct-row position of every occurrence
    first: torch.Tensor
    levels: list[_Level]
    rows: torch.Tensor | None = None  # the distinct rows, ascending

    @property
    def sizes(self) -> list[int]:
        """Entries per level: distinct ``i_1``, distinct prefixes, ..., distinct rows."""
        return [int(self.first.numel())] + [int(lv.idx.numel()) for lv in self.levels]


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner of each item, include-last offsets)`` of consecutive segments of ``counts`` items."""
    offs = counts.new_zeros(counts.numel() + 1)
    torch.cumsum(counts, 0, out=offs[1:])
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    return owner, offs


def _segment_sum(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum of consecutive row segments of ``x [n, ...]`` (``offsets`` include-last): ``[segments, ...]``."""
    n = x.shape[0]
    flat = x.reshape(n, -1)
    idx = torch.arange(n, device=x.device)
    out = F.embedding_bag(idx, flat, offsets, mode="sum", include_last_offset=True)
    return out.view(-1, *x.shape[1:])


def _make_group(idx: torch.Tensor, parent: torch.Tensor, num_parents: int, max_padding: float) -> _Group | None:
    U = idx.numel()
    sorted_idx, order = torch.sort(idx, stable=True)
    slices, counts = torch.unique_consecutive(sorted_idx, return_counts=True)
    J = slices.numel()
    L = int(counts.max())
    if J * L > max_padding * U:
        return None  # too skewed: padding would cost more than the gather saves
    owner, offs = _segments(counts)
    slot_sorted = owner * L + (torch.arange(U, device=idx.device) - offs[owner])
    slot = torch.empty_like(slot_sorted)
    slot[order] = slot_sorted
    src = torch.zeros(J * L, dtype=torch.int64, device=idx.device)
    src[slot] = parent
    return _Group(slices, slot, src, L, num_parents)


class GradSyncBucket:
    """One gradient sum across ranks for several TT replicas per step (see the module docstring).

    ``sync``: a callable summing a list of dense tensors across ranks in place (e.g.
    ``compression.replica_grad_sync``, which flattens the list into one buffer: one all-reduce). ``tables``:
    the names of the TT tables sharing the bucket; every one of them contributes exactly once per backward
    (a replica whose slice of the batch reads no row contributes zeros, ``_EmptySyncLookup``). When the last
    one has, their gradients are summed in one call, in the order of ``tables`` (the same on every rank,
    whatever order autograd ran the backwards in), and every table's update is applied to its summed
    gradient. A table contributing twice before the bucket is complete is an error (a backward that did not
    reach every TT table, then another step), never a silent mix of two steps.

    ``deferred`` (default): when ``sync`` can be started asynchronously (``sync.start(grads)`` returns a callable
    that finishes it, e.g. ``compression.ReplicaGradSync``) and the last contribution comes inside an autograd
    backward, the sum is started there and finished, and the updates applied, in a final callback of that
    backward: still within ``loss.backward()``, but the all-reduce no longer holds the rank until every rank
    reaches it while the backward has other work (the dense layers below the embeddings, the sharded tables'
    backward). The updates and their values are the same either way."""

    def __init__(self, sync: Callable[[list[torch.Tensor]], None], tables: Sequence[str], *,
                 deferred: bool = True) -> None:
        if not tables:
            raise ConfigError("GradSyncBucket: no TT tables")
        if len(set(tables)) != len(tables):
            raise ConfigError(f"GradSyncBucket: table names repeat in {list(tables)}")
        self.sync = sync
        self.tables = list(tables)
        self.deferred = deferred
        self._pending: dict[str, tuple["_TTCores", list[torch.Tensor]]] = {}
        self.syncs = 0  # sums run (one per training step)

    @property
    def pending(self) -> list[str]:
        """Tables that contributed to the sum not yet run."""
        return [t for t in self.tables if t in self._pending]

    def contribute(self, module: "_TTCores", dense: list[torch.Tensor]) -> None:
        name = module.name
        if name not in self.tables:
            raise ConfigError(f"GradSyncBucket: TT table {name!r} is not one of its tables {self.tables}")
        if name in self._pending:
            raise InputError(f"TT table {name!r}: a second backward before the TT tables "
                             f"{[t for t in self.tables if t not in self._pending]} had theirs; every TT table's "
                             "lookup must reach the loss once per step (their gradients are summed across ranks "
                             "together)")
        self._pending[name] = (module, dense)
        if len(self._pending) < len(self.tables):
            return
        order = [self._pending[t] for t in self.tables]
        self._pending = {}
        grads = [g for _, d in order for g in d]
        start = getattr(self.sync, "start", None)
        if self.deferred and start is not None and torch._C._current_autograd_node() is not None:
            # inside loss.backward(): launch the sum now, wait for it and update at the end of the backward (the
            # engine's final callbacks), so the all-reduce runs beside the rest of the backward
            finish = start(grads)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(finish, order))
            return
        self.sync(grads)
        self._finish(None, order)

    def _finish(self, finish: Callable[[], None] | None, order) -> None:
        if finish is not None:
            finish()
        self.syncs += 1
        for m, d in order:
            m._apply_dense(d)


def _sync_and_apply(module: "_TTCores", dense: list[torch.Tensor]) -> None:
    """Sum ``dense`` across ranks through ``module.grad_sync`` and apply it (a bucket defers both until every
    table sharing it has contributed)."""
    if isinstance(module.grad_sync, GradSyncBucket):
        module.grad_sync.contribute(module, dense)
    else:
        module.grad_sync(dense)
        module._apply_dense(dense)


class _EffTTLookup(torch.autograd.Function):
    """Eff-TT pooled lookup whose backward aggregates in advance and updates the cores (fused)."""

    @staticmethod
    def forward(ctx, anchor, module, bags, plan):  # noqa: ARG004
        out, saved = module._forward_reuse(bags, plan, keep=True)
        ctx.module, ctx.bags, ctx.plan, ctx.saved = module, bags, plan, saved
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.no_grad():
            ctx.module._backward_fused(ctx.bags, ctx.plan, ctx.saved, grad_out)
        ctx.saved = None
        return None, None, None, None


class _EmptySyncLookup(torch.autograd.Function):
    """A lookup of no rows on a data-parallel replica: zeros forward; backward contributes zero core
    gradients to ``grad_sync`` (the other ranks wait for them) and applies the summed update."""

    @staticmethod
    def forward(ctx, anchor, module, out):  # noqa: ARG004
        ctx.module = module
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ARG004
        m = ctx.module
        with torch.no_grad():
            _sync_and_apply(m, m._zero_grads())
        return None, None, None


class TTEmbeddingBag(_TTCores):
    """A TT-compressed embedding table with EL-Rec's Eff-TT lookup; drop-in for ``nn.EmbeddingBag``.

    Args:
        num_embeddings: rows ``M``.
        embedding_dim: dim ``N``.
        tt_rank: TT rank ``R`` (one int, or the ``d - 1`` inner ranks). EL-Rec evaluates 32-128.
        mode: ``sum`` or ``mean`` pooling (``mean`` of an empty bag is zeros, as ``nn.EmbeddingBag``; unlike
            ``nn.EmbeddingBag``, ``mean`` accepts per-sample weights: the weighted sum over the bag length,
            as ``LocalEmbeddingBags``).
        include_last_offset: ``offsets`` has ``B + 1`` entries (``nn.EmbeddingBag``'s flag).
        num_cores: ``d`` (3 default), used when ``row_shape``/``dim_shape`` are not given.
        row_shape, dim_shape: explicit factorisations (default :func:`factor_rows`, :func:`factor_dim`).
        optimizer: ``sgd``, ``adagrad``, ``rowwise_adagrad`` (fused, in backward) or ``None`` (cores are
            ``nn.Parameter`` s with autograd gradients).
        lr, eps: optimizer settings (``lr`` may be changed between steps).
        init_std: std of the reconstructed entries at init (default ``1/sqrt(3M)``).
        seed: seed of the initialisation (a generator on ``device``), ``None`` = global RNG.
        device: where the cores live.
        name: the table name, used in error messages.
        validate: check ids (one min/max per call) and offsets.
        grouped: multiply each level grouped by core slice (:class:`_Group`; default) or with one
            gathered slice per entry (``False``: the plain batched GEMM of Algorithm 1).
        max_padding: a level is grouped only while its padded size is at most this many times its
            entries (skewed levels fall back to the gather).

    Attributes:
        last_sizes: entries per reuse level of the last lookup (distinct ``i_1``, prefixes, rows).
        grad_sync: ``None``, a callable summing a list of dense core gradients across ranks in place, or a
            :class:`GradSyncBucket` several tables share (one sum per step).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tt_rank: int | Sequence[int] = 32, *,
                 grouped: bool = True, max_padding: float = 4.0, **kwargs) -> None:
        super().__init__(num_embeddings, embedding_dim, tt_rank, **kwargs)
        self.grouped = grouped
        self.max_padding = float(max_padding)
        # Group level k by slice only where a core slice (R_k n_k R_{k+1} values) outweighs the prefix row
        # it multiplies (n_1..n_{k-1} R_k values): there reading each slice once saves traffic; elsewhere
        # (the last core, whose slices are R x n_d) the padded prefix rows would cost more than they save.
        a = [math.prod(self.dim_shape[:k]) for k in range(self.num_cores)]
        self._group_level = [k > 0 and self.dim_shape[k] * self.ranks[k + 1] > a[k] for k in range(self.num_cores)]
        self.last_sizes: list[int] = []

    @classmethod
    def from_spec(cls, spec: TableSpec, tt_rank: int | Sequence[int], **kwargs) -> "TTEmbeddingBag":
        """The TT table of rank ``tt_rank`` (the table's form, ``TableForm.tt_rank``) of a ``TableSpec`` (its
        rows, dim, pooling and name)."""
        if spec.pooling not in MODES:
            raise ConfigError(f"table {spec.name!r}: TT tables pool with 'sum' or 'mean', not {spec.pooling!r}")
        if spec.bytes_per_value != 4:
            raise ConfigError(f"table {spec.name!r}: TT tables store float32 (bytes_per_value 4), "
                              f"got {spec.bytes_per_value}")
        return cls(spec.num_rows, spec.dim, tt_rank, mode=spec.pooling, name=spec.name, **kwargs)

    # -- planning ----------------------------------------------------------------------------------
    def _plan(self, values: torch.Tensor) -> _ReusePlan:
        """Algorithm 1 as sorts: distinct rows, then distinct prefixes level by level."""
        sorted_rows, perm = torch.sort(values)
        uniq, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.repeat_interleave(torch.arange(uniq.numel(), device=values.device), counts,
                                                output_size=values.numel())
        levels: list[_Level] = []
        cur = uniq
        for k in range(self.num_cores - 1, 0, -1):
            m = self.row_shape[k]
            idx = cur % m
            prefix = cur // m  # sorted, because cur is
            pu, pc = torch.unique_consecutive(prefix, return_counts=True)
            parent, parent_offsets = _segments(pc)
            group = (_make_group(idx, parent, pu.numel(), self.max_padding)
                     if self.grouped and self._group_level[k] else None)
            levels.append(_Level(idx, parent, parent_offsets, group))
            cur = pu
        return _ReusePlan(perm, counts, inverse, cur, levels[::-1], uniq)

    # -- forward -----------------------------------------------------------------------------------
    @torch.no_grad()
    def reuse_plan(self, values: torch.Tensor) -> _ReusePlan:
        """The reuse plan (Algorithm 1: distinct rows and prefixes, from sorts of the ids) of a lookup of the 1-D
        ids ``values``: input-only work, which an input pipeline builds ahead of the step and hands to
        :meth:`forward` (``reuse_plan=``) with those same ids."""
        return self._plan(values.to(torch.int64))

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None, *,
                reuse_plan: _ReusePlan | None = None) -> torch.Tensor:
        """Pooled rows ``[B, embedding_dim]`` (``nn.EmbeddingBag``'s signature and conventions). ``reuse_plan``:
        :meth:`reuse_plan` of these very ids (1-D ``input``), built ahead; by default built here."""
        bags = _make_bags(self, input, offsets, per_sample_weights)
        if bags.values.numel() == 0:
            out = torch.zeros(bags.num_bags, self.embedding_dim, device=self.device, dtype=self.dtype)
            if self.optimizer is not None and self.grad_sync is not None and torch.is_grad_enabled():
                # a replica whose slice of the batch reads no row still joins the ranks' gradient sum
                anchor = torch.empty(0, device=self.device, requires_grad=True)
                return _EmptySyncLookup.apply(anchor, self, out)
            return out.requires_grad_(self.optimizer is None and torch.is_grad_enabled())
        plan = reuse_plan if reuse_plan is not None else self._plan(bags.values)
        self.last_sizes = plan.sizes
        if self.optimizer is not None and torch.is_grad_enabled():
            anchor = torch.empty(0, device=self.device, requires_grad=True)
            return _EffTTLookup.apply(anchor, self, bags, plan)
        out, _ = self._forward_reuse(bags, plan, keep=False)
        return out

    def _forward_reuse(self, bags: _Bags, plan: _ReusePlan, keep: bool):
        """Reuse buffer level by level, last core per distinct row, then pool (section III-A).

        Returns the pooled output and, with ``keep``, per level the left operand of its product (the
        padded or gathered prefix products) and the gathered core slices, which the backward reuses.
        """
        cores = self.cores
        P = cores[0].index_select(0, plan.first).view(-1, self.dim_shape[0], self.ranks[1])
        saved = []
        for k, lv in enumerate(plan.levels, start=1):
            a, R = P.shape[1], P.shape[2]
            if lv.group is not None:
                g = lv.group
                J = g.slices.numel()
                X = P.index_select(0, g.src).view(J, g.L * a, R)
                C = cores[k].index_select(0, g.slices)  # each distinct slice once
                Y = torch.bmm(X, C).view(J * g.L, -1).index_select(0, g.slot)
            else:
                X = P.index_select(0, lv.parent)  # each entry's prefix product, from the reuse buffer
                C = cores[k].index_select(0, lv.idx)  # [U_k, R_k, n_k R_{k+1}]
                Y = torch.bmm(X, C)
            if keep:
                saved.append((X, C))
            P = Y.view(lv.idx.numel(), -1, self.ranks[k + 1])
        rows = self._exact_rows(P.view(-1, self.embedding_dim), plan)  # distinct rows
        out = F.embedding_bag(plan.inverse, rows, bags.offsets, mode="sum", per_sample_weights=bags.scale,
                              include_last_offset=True)
        return out, saved

    # -- backward ------------------------------------------------------------------------------------
    def _backward_fused(self, bags: _Bags, plan: _ReusePlan, saved, grad_out: torch.Tensor) -> None:
        """In-advance aggregation, core gradients through the reuse buffer, fused update (section III-B)."""
        # 1. sum the output gradient per distinct row: a segment sum over the occurrences sorted by row
        src = bags.bag_of_value().index_select(0, plan.perm)
        w = bags.scale.index_select(0, plan.perm) if bags.scale is not None else None
        _, row_offs = _segments(plan.counts)
        G = F.embedding_bag(src, grad_out.contiguous(), row_offs, mode="sum", per_sample_weights=w,
                            include_last_offset=True)  # [U, N]: gradient of every distinct row
        dense = self._zero_grads() if self.grad_sync is not None else None
        G = self._exact_grads(G, plan, dense)
        cores = self.cores
        # 2. level by level, last core first: eq. 6 once per distinct entry; the prefix gradients of
        # entries that share a prefix are summed before they go on to the earlier cores
        for k in range(self.num_cores - 1, 0, -1):
            lv = plan.levels[k - 1]
            X, C = saved[k - 1]
            U = lv.idx.numel()
            num_parents = lv.parent_offsets.numel() - 1
            if lv.group is not None:
                g = lv.group
                J = g.slices.numel()
                a = X.shape[1] // g.L
                Gp = G.new_zeros(J * g.L, G.numel() // U)
                Gp.index_copy_(0, g.slot, G.reshape(U, -1))
                Gp = Gp.view(J, g.L * a, -1)
                dC = torch.bmm(X.transpose(1, 2), Gp)  # [J, R_k, n_k R_{k+1}]: summed per distinct slice
                dX = torch.bmm(Gp, C.transpose(1, 2)).view(J * g.L, a, -1)
                G = G.new_zeros(num_parents, a, dX.shape[2]).index_add_(0, g.src, dX)
                self._accumulate(k, g.slices, dC, dense, distinct=True)
            else:
                Gk = G.reshape(U, X.shape[1], -1)  # [U_k, a_{k-1}, n_k R_{k+1}]
                dC = torch.bmm(X.transpose(1, 2), Gk)  # per distinct entry
                dX = torch.bmm(Gk, C.transpose(1, 2))
                G = _segment_sum(dX, lv.parent_offsets)
                self._accumulate(k, lv.idx, dC, dense, distinct=False)
        self._accumulate(0, plan.first, G.reshape(-1, *cores[0].shape[1:]), dense, distinct=True)
        if dense is not None:
            _sync_and_apply(self, dense)

    # -- hooks of rows kept exact (embedding.hybrid) ---------------------------------------------------
    def _exact_rows(self, rows: torch.Tensor, plan: _ReusePlan) -> torch.Tensor:
        """The batch's distinct rows as the table holds them (all from the cores here)."""
        return rows

    def _exact_grads(self, G: torch.Tensor, plan: _ReusePlan, dense) -> torch.Tensor:
        """The distinct rows' gradients the cores take (all of them here)."""
        return G

    def _zero_grads(self) -> list[torch.Tensor]:
        """Zero dense gradients of everything ``_apply_dense`` updates (a replica with no row to look up)."""
        return [torch.zeros_like(c) for c in self.cores]

    def _accumulate(self, k: int, slices: torch.Tensor, grads: torch.Tensor, dense, distinct: bool) -> None:
        """Fused update of core ``k`` (or accumulation into the dense gradient when syncing ranks)."""
        if dense is not None:
            dense[k].index_add_(0, slices, grads)
            return
        if self.optimizer == "sgd":
            self.cores[k].index_add_(0, slices, grads, alpha=-self.lr)  # repeats add up: exact SGD
            return
        if not distinct:
            shape = grads.shape
            slices, summed = aggregate_row_gradients(slices, grads.reshape(shape[0], -1), num_rows=self.row_shape[k])
            grads = summed.view(-1, *shape[1:])
        self._apply_slices(k, slices, grads)


# --------------------------------------------------------------------------------------------------
# TT-Rec reference


class _TTRecLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, module, bags, idx):  # noqa: ARG004
        ctx.module, ctx.bags, ctx.idx = module, bags, idx
        return module._forward_chain(bags, idx)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.no_grad():
            ctx.module._backward_per_occurrence(ctx.bags, ctx.idx, grad_out)
        return None, None, None, None


class TTRecEmbeddingBag(_TTCores):
    """The TT-Rec baseline: one slice-product chain per looked-up index, per-occurrence backward.

    Same arguments, core layout and optimizers as :class:`TTEmbeddingBag` (so cores can be copied
    between the two with ``copy_cores_from``). Forward: for every index ``(i_1..i_d)`` of the batch the
    slices are multiplied (batched GEMM over all occurrences, repeats included) and the rows pooled.
    Backward (fused, as TT-Rec's ``tt_sgd_backward``/``tt_adagrad_backward``): eq. 6 for every occurrence
    (the forward chain recomputed, as TT-Rec does), the per-occurrence slice gradients added into dense
    core-shaped gradients, then every core updated as a whole. ``optimizer=None`` gives autograd
    gradients instead.
    """

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        bags = _make_bags(self, input, offsets, per_sample_weights)
        if bags.values.numel() == 0:
            out = torch.zeros(bags.num_bags, self.embedding_dim, device=self.device, dtype=self.dtype)
            return out.requires_grad_(self.optimizer is None and torch.is_grad_enabled())
        idx = self.tt_indices(bags.values)
        if self.optimizer is not None and torch.is_grad_enabled():
            anchor = torch.empty(0, device=self.device, requires_grad=True)
            return _TTRecLookup.apply(anchor, self, bags, idx)
        return self._forward_chain(bags, idx)

    def _chain(self, idx: list[torch.Tensor], keep: bool):
        cores = self.cores
        P = cores[0].index_select(0, idx[0]).view(-1, self.dim_shape[0], self.ranks[1])
        prods = [P]
        for k in range(1, self.num_cores):
            C = cores[k].index_select(0, idx[k])
            P = torch.bmm(P, C).view(P.shape[0], -1, self.ranks[k + 1])
            if keep:
                prods.append(P)
        return P.view(-1, self.embedding_dim), prods

    def _forward_chain(self, bags: _Bags, idx: list[torch.Tensor]) -> torch.Tensor:
        rows, _ = self._chain(idx, keep=False)
        n = rows.shape[0]
        return F.embedding_bag(torch.arange(n, device=rows.device), rows, bags.offsets, mode="sum",
                               per_sample_weights=bags.scale, include_last_offset=True)

    def _backward_per_occurrence(self, bags: _Bags, idx: list[torch.Tensor], grad_out: torch.Tensor) -> None:
        d = self.num_cores
        _, prods = self._chain(idx, keep=True)  # recompute the chain, per occurrence
        g = grad_out.index_select(0, bags.bag_of_value())
        if bags.scale is not None:
            g = g * bags.scale.unsqueeze(1)
        n = g.shape[0]
        grads = [torch.zeros_like(c) for c in self.cores]
        G = g.view(n, -1, self.dim_shape[-1])
        for k in range(d - 1, 0, -1):
            X = prods[k - 1]
            C = self.cores[k].index_select(0, idx[k])
            Gk = G.reshape(n, X.shape[1], -1)
            grads[k].index_add_(0, idx[k], torch.bmm(X.transpose(1, 2), Gk))
            G = torch.bmm(Gk, C.transpose(1, 2))
        grads[0].index_add_(0, idx[0], G.reshape(n, *self.cores[0].shape[1:]))
        if self.grad_sync is not None:
            _sync_and_apply(self, grads)
        else:
            self._apply_dense(grads)
