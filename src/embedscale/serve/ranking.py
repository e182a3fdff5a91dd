"""The ranking call: one user context and N candidates, the context's share of the work done once a request.

A ranking request ``{"context": {...}, "candidates": [...]}`` stands for N rows that share the context's
features. It is encoded as two parts, the context (one row, its features only) and the candidates (N rows,
theirs only), and a DLRM scores it so that what depends on the context alone is computed once per request,
not N times: the context's embedding lookups and, when every dense feature is in the context, the bottom MLP
(Naumov et al. 2019, section 2: the bottom MLP reads the dense features only). The context's pooled vectors
are then gathered to its candidates and the dot interaction and the top MLP run per candidate, exactly as for
the N expanded rows (the same numbers up to float32 rounding of another batch shape). Requests batched
together may have different contexts; a batch holds requests with one split of the features (the same
context features), each request's candidates gathering their own context.

A model of another kind (DCN, DMT towers, a flat model) scores the expanded rows instead
(:func:`ranks_by_context` says which).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from embedscale.data.batch import JaggedFeatures
from embedscale.models.dlrm import DLRM
from embedscale.serve.encode import Encoded, RequestError, RowEncoder


@dataclass
class RankingInput:
    """A ranking request encoded: ``context`` (one row, only ``context_features`` meaningful) and
    ``candidates`` (N rows, only the other features meaningful)."""

    context: Encoded
    candidates: Encoded
    context_features: tuple[str, ...]

    @property
    def rows(self) -> int:
        return self.candidates.rows


def ranks_by_context(model) -> bool:
    """Whether ``model`` is scored by :func:`rank_logits` (a plain DLRM); other models score expanded rows."""
    return type(model) is DLRM


def encode_ranking(encoder: RowEncoder, context: dict, candidates: list[dict]) -> RankingInput | None:
    """Encode a ranking call whose context and candidates together hold every feature once (checked by the
    caller for overlaps). ``None`` when the candidates do not all hold the same features or a feature is
    missing or unknown: the caller then expands the rows, whose checks name the row and the feature. A bad
    value is a :class:`RequestError` naming the candidate (``row``) or the context (``row`` ``None``)."""
    ctx_names = [f for f in encoder.features if f in context]
    cand_names = [f for f in encoder.features if f not in context]
    if len(ctx_names) != len(context) or not candidates:
        return None
    want = set(cand_names)
    if not all(type(c) is dict and c.keys() == want for c in candidates):
        return None
    try:
        ctx = encoder.encode_rows([context], ctx_names)
    except RequestError as e:
        raise RequestError(str(e).replace("row 0", "context", 1), row=None, field=e.field) from None
    try:
        cands = encoder.encode_rows(candidates, cand_names)
    except RequestError as e:  # "row i" is candidate i
        raise RequestError(str(e).replace("row ", "candidate ", 1), row=e.row, field=e.field) from None
    return RankingInput(ctx, cands, tuple(ctx_names))


def concat(parts: list[Encoded]) -> Encoded:
    """Several parts' inputs as one batch (rows in order; key-major jagged features re-joined per key)."""
    if len(parts) == 1:
        return parts[0]
    keys = parts[0].sparse.keys
    F = len(keys)
    vals, lens = [[] for _ in range(F)], [[] for _ in range(F)]
    for p in parts:
        for k, v in enumerate(torch.split(p.sparse.values, p.sparse.length_per_key_list())):
            vals[k].append(v)
        for k, ln in enumerate(p.sparse.lengths.view(F, -1)):
            lens[k].append(ln)
    sparse = JaggedFeatures(keys, torch.cat([t for k in range(F) for t in vals[k]]),
                            torch.cat([t for k in range(F) for t in lens[k]]))
    return Encoded(torch.cat([p.dense for p in parts]), sparse)


@torch.inference_mode()
def rank_logits(model: DLRM, encoder: RowEncoder, parts: list[RankingInput]) -> torch.Tensor:
    """The logits ``[sum of N]`` of the ranking requests ``parts`` (one split of the features), candidates in
    order: the DLRM forward (bottom MLP, lookup, dot interaction, top MLP, first-order term, calibration) with
    the context's lookups and, when it holds every dense feature, its bottom MLP run once per request, and the
    top MLP's first layer split (:func:`_first_layer`)."""
    names = set(parts[0].context_features)
    R = len(parts)
    both = concat([p.context for p in parts] + [p.candidates for p in parts])  # one lookup for all
    ctx = Encoded(both.dense[:R], None)
    cand = Encoded(both.dense[R:], None)
    idx = torch.repeat_interleave(torch.arange(R), torch.tensor([p.rows for p in parts]))
    sa = model.sparse_arch
    from_ctx = torch.tensor([f in names for f in sa.feature_names])
    cols = torch.repeat_interleave(from_ctx, torch.tensor(sa.feature_dims))
    pooled_all = sa.pooled(both.sparse)
    pooled_ctx = pooled_all[:R]
    pooled = torch.where(cols, pooled_ctx.index_select(0, idx), pooled_all[R:])
    dense_ctx = all(f in names for f in encoder.dense_names)
    dense_out_ctx = None
    if dense_ctx:
        dense = ctx.dense.index_select(0, idx)
        if model.dense_arch is not None:
            dense_out_ctx = model.dense_arch(ctx.dense)
        dense_out = dense_out_ctx.index_select(0, idx) if dense_out_ctx is not None else None
    else:
        mask = torch.tensor([f in names for f in encoder.dense_names])
        dense = torch.where(mask, ctx.dense.index_select(0, idx), cand.dense)
        dense_out = model.dense_arch(dense)
    z = model.inter_arch(dense_out, sa.vectors(pooled))
    split = _first_layer(model, tuple(sorted(names)), from_ctx, dense_ctx)
    if split is None:
        logit = model.over_arch(z).squeeze(-1)
    else:  # the context-only columns' share of the first layer once per request, the rest per candidate
        ctx_cols, rest_cols, w_ctx, w_rest, bias = split
        if dense_out_ctx is None and model.dense_arch is not None:  # its columns are per candidate: not read
            dense_out_ctx = torch.zeros(len(parts), model.embedding_dim)
        z_ctx = model.inter_arch(dense_out_ctx, sa.vectors(pooled_ctx)).index_select(1, ctx_cols)
        per_ctx = torch.addmm(bias, z_ctx, w_ctx.t())
        h = torch.addmm(per_ctx.index_select(0, idx), z.index_select(1, rest_cols), w_rest.t())
        logit = model.over_arch.model[1:](h).squeeze(-1)
    if model.first_order is not None:
        logit = logit + model.first_order(pooled, dense)
    return model.calibration(logit).float()


def _first_layer(model: DLRM, key: tuple, from_ctx: torch.Tensor, dense_ctx: bool):
    """The top MLP's first layer ``W z + b`` split by the interaction's columns: those that depend on the
    context alone (the bottom MLP's output when every dense feature is in the context, and the dot products of
    two context vectors) and the rest, ``(ctx_cols, rest_cols, W[:, ctx_cols], W[:, rest_cols], b)``, so that
    ``W z + b = (W_ctx z_ctx + b) + W_rest z_rest`` with the first term once per request. Cached per split;
    ``None`` when the first layer is not a plain ``nn.Linear`` (a quantized dense model) or the model is in
    training mode."""
    first = model.over_arch.model[0]
    if type(first) is not nn.Linear or model.training:
        return None
    cache = model.__dict__.setdefault("_ranking_first_layer", {})
    if key not in cache or cache[key][0] is not first.weight:
        ia = model.inter_arch
        ctx_vec = torch.cat([torch.tensor([dense_ctx]), from_ctx]) if ia.with_dense else from_ctx
        n = ctx_vec.numel()
        i, j = ia.triu_flat // n, ia.triu_flat % n
        D = model.embedding_dim if ia.with_dense else 0
        is_ctx = torch.cat([torch.full((D,), dense_ctx), ctx_vec[i] & ctx_vec[j]])
        ctx_cols, rest_cols = torch.nonzero(is_ctx).flatten(), torch.nonzero(~is_ctx).flatten()
        w = first.weight.detach()
        cache[key] = (first.weight, (ctx_cols, rest_cols, w[:, ctx_cols].contiguous(),
                                     w[:, rest_cols].contiguous(), first.bias.detach()))
    return cache[key][1]


__all__ = ["RankingInput", "concat", "encode_ranking", "rank_logits", "ranks_by_context"]
