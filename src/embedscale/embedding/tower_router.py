"""The routing steps of DMT's semantic-preserving tower transform (SPTT, DMT section 3.1, Figure 7) and the flat
all_to_all, for one rank (:class:`TowerRouter`), with the autograd exchanges they run through.

Where rows live is the plan's (:class:`~embedscale.plan.tower_placement.TowerPlacement`); the process groups
and byte-counting transports are :class:`~embedscale.comm.hierarchical.TowerComm`'s. The lookup itself
(step b) and the tower modules run by the caller (:mod:`embedscale.embedding.towers`,
``embedscale.models.dmt``), so the same routing serves any embedding module. The steps, per iteration, for
the local mini-batch of every rank (DMT Figure 7):

a. *sparse-input all_to_all* (world): every rank sends the ids of its samples to the ranks holding
   their rows (:meth:`TowerRouter.route_ids`);
b. *local lookup*: every rank pools the bags of the global batch for the rows it holds (caller);
c. *peer permute*: the pooled rows are reordered into peer order (:meth:`TowerRouter.to_tower`);
   DMT 3.1.3 "step b and step c can be swapped": ``permute="ids"`` reorders the (smaller) ids before
   the lookup instead, and step c vanishes;
d. *intra-tower all_to_all* (tower group; intra-host when K = 1): member ``i`` sends member ``j`` the
   pooled rows of ``j``'s peers; with row-wise shards inside the tower it is a *reduce-scatter* of
   partial sums (DMT 3.1.3, second specialisation);
e. *shuffle*: the pieces, ``(members' features) x (peers' samples)``, become ``[peers' samples, tower
   features, N]``: every rank now holds the whole tower's embeddings for all its peers' samples, the
   input of the tower modules (DMT 3.2, Figure 8);
f. *peer all_to_all* (peer set, world size ``P``): every rank sends each peer that peer's samples and
   receives from every tower the tower's output for its own samples (:meth:`TowerRouter.from_tower`).

The backward pass runs the same exchanges in reverse (autograd functions below). With pass-through
towers the result is exactly the flat all_to_all's (the classic model-parallel lookup: ids to table
owners, owners pool, one all_to_all of pooled vectors back, :meth:`TowerRouter.flat_return`), bit for
bit, because only the route differs (DMT Table 3). The fourth specialisation of DMT 3.1.3 (a virtual
process group already in peer order, which drops step c) is not implemented: step c is one gather.

Designed for GPUs with NCCL (every tensor stays on the device of its input), tested on CPU with gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from embedscale.comm.transport import Transport
from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError, InputError
from embedscale.plan.tower_placement import TowerPlacement

PERMUTES = ("embeddings", "ids", "auto")


# --------------------------------------------------------------------------------------------------
# autograd exchanges


class _AllToAllV(torch.autograd.Function):
    """All-to-all of a 1-D tensor cut into ``send_counts`` pieces; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, transport: Transport, send_counts, recv_counts, kind):
        ctx.transport, ctx.send_counts, ctx.recv_counts, ctx.kind = transport, send_counts, recv_counts, kind
        recv = transport.exchange(list(torch.split(x, send_counts)), recv_counts=recv_counts, kind=kind)
        return torch.cat(recv)

    @staticmethod
    def backward(ctx, grad):
        back = ctx.transport.exchange(list(torch.split(grad.contiguous(), ctx.recv_counts)),
                                      recv_counts=ctx.send_counts, kind=ctx.kind + "_grad")
        return torch.cat(back), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Step d with row-wise shards (DMT 3.1.3): each member sums every member's partial pooled vectors
    of its peers' samples; backward is the all-gather of the gradients."""

    @staticmethod
    def forward(ctx, x, transport: Transport, send_counts, recv_count, kind):
        W = transport.world_size
        ctx.transport, ctx.send_counts, ctx.recv_count, ctx.kind = transport, send_counts, recv_count, kind
        recv = transport.exchange(list(torch.split(x, send_counts)), recv_counts=[recv_count] * W, kind=kind)
        out = recv[0].clone()
        for r in recv[1:]:  # member order: a fixed summation order on every rank
            out += r
        return out

    @staticmethod
    def backward(ctx, grad):
        W = ctx.transport.world_size
        g = grad.contiguous()
        back = ctx.transport.exchange([g] * W, recv_counts=ctx.send_counts, kind=ctx.kind + "_grad")
        return torch.cat(back), None, None, None, None


def _placeholder(rows: int, cols: int, device) -> torch.Tensor:
    """An empty-width lookup result for a rank that holds no rows. It requires grad (when autograd is
    on) so that the backward exchanges run on this rank too: every rank must join every collective."""
    return torch.zeros((rows, cols), device=device, requires_grad=torch.is_grad_enabled())


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    out_start = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - out_start, lengths, output_size=total) + \
        torch.arange(total, device=starts.device)


# --------------------------------------------------------------------------------------------------
# the router


@dataclass
class RoutedBatch:
    """What step a delivers to a rank: the global batch of its lookup features, and the bookkeeping."""

    features: JaggedFeatures | None  # lookup features x all ranks' samples (None: this rank holds no rows)
    sizes: list[int]  # local batch size of every rank
    peer_ordered: bool  # samples already in peer order (steps b and c swapped)


class TowerRouter:
    """Steps a, c, d, e, f of the tower transform, and the flat all_to_all, for one rank.

    Args:
        placement: the table placement (its layout gives the tower groups).
        comm: the rank's transports (:class:`TowerComm`, or any object with ``world``, ``tower``,
            ``peer`` transports and a ``rank``).
        permute: ``"embeddings"`` (step c on pooled rows, DMT's default order), ``"ids"`` (steps b and c
            swapped: the ids are put in peer order before the lookup) or ``"auto"`` (ids when the received
            ids are fewer bytes than the pooled rows; decided per rank, per batch).
    """

    def __init__(self, placement: TowerPlacement, comm, permute: str = "embeddings"):
        if permute not in PERMUTES:
            raise ConfigError(f"tower router: permute {permute!r} is not one of {PERMUTES}")
        self.placement = placement
        self.layout = layout = placement.layout
        self.comm = comm
        self.rank = comm.rank
        self.permute = permute
        W, S = layout.world_size, layout.group_size
        self.dim = placement.dim
        self.feature_names = placement.feature_names
        self._feature_index = {f: i for i, f in enumerate(self.feature_names)}
        F = len(self.feature_names)
        tabs = placement.tables
        ft = placement.feature_table
        self.my_features = placement.rank_features[self.rank]
        self.my_feature_names = [self.feature_names[f] for f in self.my_features]
        self.num_slots = [len(fs) for fs in placement.rank_features]
        self.max_slots = max(max(self.num_slots), 1)
        # per model feature: its group's first rank, slot (position in a holder's lookup), rows, bounds
        group_base = placement.feature_group * S
        slot = np.zeros(F, dtype=np.int64)
        dest = np.zeros(F, dtype=np.int64)
        for r in range(W):
            for pos, f in enumerate(placement.rank_features[r]):
                slot[f] = pos  # row-wise: the same position on every member
                if placement.sharding == "table":
                    dest[f] = r
        self._dest = torch.from_numpy(dest)
        self._group_base = torch.from_numpy(group_base)
        self._slot = torch.from_numpy(slot)
        self._rows = torch.tensor([tabs[t].num_rows for t in ft], dtype=torch.int64)
        self._bounds = torch.from_numpy(placement.bounds[ft])  # [F, S + 1]
        self._mean = torch.tensor([tabs[t].pooling == "mean" for t in ft])
        self._cache: dict = {}

    # -- helpers --------------------------------------------------------------------------------
    def _dev(self, t: torch.Tensor, device) -> torch.Tensor:
        key = (id(t), device)
        out = self._cache.get(key)
        if out is None:
            out = t.to(device)
            self._cache[key] = out
        return out

    def exchange_batch_sizes(self, batch_size: int, weighted: bool, device, bad: bool = False
                             ) -> tuple[list[int], bool, list[int]]:
        """Every rank's local batch size, whether any rank's batch has per-sample weights, and the ranks
        whose batch failed validation (so that a bad id is an error on every rank, not a hang)."""
        W = self.layout.world_size
        mine = torch.tensor([batch_size, int(weighted), int(bad)], dtype=torch.int64, device=device)
        got = self.comm.world.exchange([mine] * W, recv_counts=[3] * W, kind="meta")
        sizes = [int(g[0]) for g in got]
        return sizes, any(int(g[1]) for g in got), [r for r, g in enumerate(got) if int(g[2])]

    def peer_sources(self) -> list[int]:
        return self.layout.peer_order()

    # -- step a ---------------------------------------------------------------------------------
    def route_ids(self, features: JaggedFeatures) -> RoutedBatch:
        """Step a: send every id to the rank holding its row; assemble this rank's global batch.

        Accepts the model's features in any key order. Mean pooling and per-sample weights: table-wise,
        the holder pools whole bags itself (weights travel as they are); row-wise, each value carries
        ``weight / bag length`` for mean tables and shards pool ``sum``, so partial bags add up.
        """
        W = self.layout.world_size
        dev = features.values.device
        keys = features.keys
        self._check_keys(keys)
        B = features.batch_size
        values, lengths = features.values, features.lengths
        n = values.numel()
        key_model = torch.tensor([self._feature_index[k] for k in keys], dtype=torch.int64, device=dev)
        bag = torch.repeat_interleave(torch.arange(len(keys) * B, device=dev), lengths, output_size=n)
        fv = key_model[bag // B] if n else bag
        b = bag % B
        message = self._row_error(values, fv, b) if n else None
        sizes, weighted, bad_ranks = self.exchange_batch_sizes(B, features.weights is not None, dev,
                                                               message is not None)
        if bad_ranks:
            raise InputError(message or f"rank {self.rank}: rank(s) {bad_ranks} got row ids outside their tables "
                                        "(their errors name the feature); no rank looked anything up")
        row_wise = self.placement.sharding == "row"
        use_weights = weighted or (row_wise and bool(self._mean.any()))
        slot = self._dev(self._slot, dev)[fv]
        dest, local = self._destinations(values, fv, row_wise)
        scale = self._value_scales(features, fv, bag, row_wise) if use_weights else None
        M = self.max_slots
        key = (dest * M + slot) * B + b
        order = torch.argsort(key, stable=True)
        per_dest = torch.bincount(dest, minlength=W).tolist() if n else [0] * W
        counts = torch.bincount(key, minlength=W * M * B).view(W, M * B) if n else \
            torch.zeros((W, M * B), dtype=torch.int64, device=dev)
        send_len = [counts[d, : self.num_slots[d] * B] for d in range(W)]
        k = self.num_slots[self.rank]
        recv_len = self.comm.world.exchange(send_len, recv_counts=[k * s for s in sizes], kind="ids")
        per_src = [int(x.sum()) for x in recv_len]
        recv_val = self.comm.world.exchange(list(torch.split(local[order], per_dest)), recv_counts=per_src,
                                            kind="ids")
        recv_w = None
        if use_weights:
            recv_w = self.comm.world.exchange(list(torch.split(scale[order], per_dest)), recv_counts=per_src,
                                              kind="ids")
        if k == 0:
            return RoutedBatch(None, sizes, False)
        return self._assemble(recv_len, recv_val, recv_w, sizes, per_src, use_weights)

    def _check_keys(self, keys) -> None:
        unknown = [k for k in keys if k not in self._feature_index]
        missing = sorted(set(self.feature_names) - set(keys))
        if unknown or missing or len(keys) != len(self.feature_names):
            raise InputError(f"rank {self.rank}: tower routing got features {keys}; expected {self.feature_names}"
                             f" (unknown {unknown}, missing {missing})")

    def _row_error(self, values: torch.Tensor, fv: torch.Tensor, b: torch.Tensor) -> str | None:
        """The first row id outside its table, named (feature, table, tower group, sample), or ``None``."""
        pl = self.placement
        bad = (values < 0) | (values >= self._dev(self._rows, values.device)[fv])
        if not bool(bad.any()):
            return None
        i = int(torch.nonzero(bad)[0])
        f = int(fv[i])
        t = pl.tables[pl.feature_table[f]]
        return (f"rank {self.rank}: feature {self.feature_names[f]!r} (table {t.name!r}, tower group "
                f"{int(pl.feature_group[f])}): row id {int(values[i])} at sample {int(b[i])} is outside "
                f"[0, {t.num_rows})")

    def _destinations(self, values: torch.Tensor, fv: torch.Tensor, row_wise: bool):
        """Every value's holder rank and its row there (row-wise: the group member whose row range holds it)."""
        dev = values.device
        if not row_wise:
            return self._dev(self._dest, dev)[fv], values
        S = self.layout.group_size
        bounds = self._dev(self._bounds, dev)[fv]  # [n, S + 1]
        member = (values.unsqueeze(1) >= bounds[:, 1:S]).sum(1)
        dest = self._dev(self._group_base, dev)[fv] + member
        return dest, values - bounds.gather(1, member.unsqueeze(1)).squeeze(1)

    def _value_scales(self, features: JaggedFeatures, fv: torch.Tensor, bag: torch.Tensor, row_wise: bool):
        """Every value's weight as sent: the sample weight (1 without), over its bag's length for a mean table
        sharded row-wise."""
        dev, n = features.values.device, features.values.numel()
        scale = features.weights.to(torch.float32) if features.weights is not None else \
            torch.ones(n, dtype=torch.float32, device=dev)
        if row_wise:
            mean = self._dev(self._mean, dev)[fv]
            if bool(mean.any()):
                inv = 1.0 / features.lengths[bag].clamp(min=1).to(torch.float32)
                scale = torch.where(mean, scale * inv, scale)
        return scale

    def _assemble(self, recv_len, recv_val, recv_w, sizes, per_src, use_weights: bool) -> RoutedBatch:
        """This rank's global batch from what every source sent, slots in order, sources in peer order when
        steps b and c are swapped (DMT 3.1.3: when ids are the smaller object)."""
        W, k, dev = self.layout.world_size, self.num_slots[self.rank], recv_val[0].device
        peer = self.permute == "ids"
        if self.permute == "auto":
            id_bytes = sum(per_src) * (8 + (4 if use_weights else 0)) + k * sum(sizes) * 8
            peer = id_bytes < k * sum(sizes) * self.dim * 4
        src_order = self.layout.peer_order() if peer else list(range(W))
        L2 = [recv_len[s].view(k, sizes[s]) for s in range(W)]
        cnt = torch.stack([l.sum(1) for l in L2])  # [W, k] values per (source, slot)
        src_base = torch.cumsum(torch.tensor(per_src, device=dev), 0) - torch.tensor(per_src, device=dev)
        seg_start = src_base.unsqueeze(1) + (torch.cumsum(cnt, 1) - cnt)  # [W, k]
        so = torch.tensor(src_order, device=dev)
        idx = _ranges(seg_start[so].t().reshape(-1), cnt[so].t().reshape(-1))
        all_val = torch.cat(recv_val)[idx]
        all_w = torch.cat(recv_w)[idx] if recv_w is not None else None
        all_len = torch.cat([L2[s] for s in src_order], dim=1).reshape(-1)
        return RoutedBatch(JaggedFeatures(self.my_feature_names, all_val, all_len, all_w), sizes, peer)

    # -- steps c, d, e ----------------------------------------------------------------------------
    def to_tower(self, pooled: torch.Tensor | None, routed: RoutedBatch, device=None) -> torch.Tensor:
        """Steps c, d, e: this rank's pooled rows (global batch) -> ``[M, F_group * N]``, the whole
        tower's embeddings of the samples of this rank's peers, peers in group order, features in group
        order (``placement.group_features``)."""
        lay, pl = self.layout, self.placement
        S, P, N = lay.group_size, lay.num_groups, self.dim
        sizes = routed.sizes
        me_j = lay.local_index(self.rank)
        g = lay.group_of(self.rank)
        total = sum(sizes)
        width = len(self.my_features) * N
        if pooled is None:  # holds no rows; still part of every exchange, forward and backward
            pooled = _placeholder(total, width, device)
        dev = pooled.device
        if not routed.peer_ordered and P > 1 and S > 1:  # step c: peer permute
            order = lay.peer_order()
            starts = torch.tensor(np.cumsum([0] + sizes[:-1])[order], device=dev)
            pooled = pooled.index_select(0, _ranges(starts, torch.tensor([sizes[s] for s in order], device=dev)))
        M = [sum(sizes[q * S + j] for q in range(P)) for j in range(S)]
        x = pooled.reshape(-1)
        if pl.sharding == "row":  # step d as a reduce-scatter of partial sums
            out = _ReduceScatter.apply(x, self.comm.tower, [m * width for m in M], M[me_j] * width, "tower_a2a")
            return out.view(M[me_j], width)
        widths = [len(pl.rank_features[r]) * N for r in lay.group_ranks(g)]
        out = _AllToAllV.apply(x, self.comm.tower, [m * width for m in M], [M[me_j] * w for w in widths],
                               "tower_a2a")
        parts = torch.split(out, [M[me_j] * w for w in widths])
        # step e: (members' features) x (peers' samples) -> (peers' samples) x (tower features)
        return torch.cat([p.view(M[me_j], w) for p, w in zip(parts, widths)], dim=1)

    # -- step f -----------------------------------------------------------------------------------
    def from_tower(self, y: torch.Tensor, sizes: list[int], group_widths: Sequence[int]) -> torch.Tensor:
        """Step f: ``[M, O_g]`` tower outputs of this rank's peers' samples -> ``[B, sum_g O_g]``, this
        rank's samples with every tower group's output, groups in order."""
        lay = self.layout
        S, P = lay.group_size, lay.num_groups
        j = lay.local_index(self.rank)
        B = sizes[self.rank]
        O_me = y.shape[1]
        send = [sizes[q * S + j] * O_me for q in range(P)]
        recv = [B * int(w) for w in group_widths]
        out = _AllToAllV.apply(y.reshape(-1), self.comm.peer, send, recv, "peer_a2a")
        parts = torch.split(out, recv)
        return torch.cat([p.view(B, int(w)) for p, w in zip(parts, group_widths)], dim=1)

    def group_feature_order(self) -> list[int]:
        """Model indices of the features in the column order of ``from_tower`` with pass-through towers."""
        return [f for fs in self.placement.group_features for f in fs]

    # -- the flat baseline ------------------------------------------------------------------------
    def flat_return(self, pooled: torch.Tensor | None, routed: RoutedBatch, device=None) -> torch.Tensor:
        """The classic return path: one world all_to_all of pooled rows back to the samples' ranks.

        ``pooled`` rows in rank order (``permute="embeddings"``). Returns ``[B, F * N]`` in model order.
        """
        if routed.peer_ordered:
            raise ConfigError("flat_return needs the lookup in rank order (permute='embeddings')")
        lay, pl = self.layout, self.placement
        W, N = lay.world_size, self.dim
        sizes = routed.sizes
        B = sizes[self.rank]
        width = len(self.my_features) * N
        if pooled is None:
            pooled = _placeholder(sum(sizes), width, device)
        widths = [len(pl.rank_features[r]) * N for r in range(W)]
        out = _AllToAllV.apply(pooled.reshape(-1), self.comm.world, [s * width for s in sizes],
                               [B * w for w in widths], "flat_a2a")
        parts = torch.split(out, [B * w for w in widths])
        x = torch.cat([p.view(B, w) for p, w in zip(parts, widths)], dim=1)
        cat_order = [f for r in range(W) for f in pl.rank_features[r]]
        return to_model_order(x, cat_order, N)


def to_model_order(x: torch.Tensor, order: Sequence[int], dim: int) -> torch.Tensor:
    """Columns ``[B, F * dim]`` whose feature blocks are model features ``order`` -> model order."""
    order = list(order)
    if order == list(range(len(order))):
        return x
    inv = torch.empty(len(order), dtype=torch.int64)
    inv[torch.tensor(order)] = torch.arange(len(order))
    B = x.shape[0]
    return x.view(B, len(order), dim).index_select(1, inv.to(x.device)).reshape(B, len(order) * dim)
