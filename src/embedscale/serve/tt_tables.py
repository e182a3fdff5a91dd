"""Tensor-train tables in an export: served as their cores (EL-Rec section III), never materialised.

A TT table (and a row-group table: its hot rows exact beside the cores, ``embedding.hybrid``) is exported as the
tensors of its trained module (``tt.<table>.core<k>``, ``tt.<table>.hot_weight``) and the index reordering its
cores were trained under (``reorder.<table>``: ``map[id] = row``, EL-Rec section IV); the manifest's table entry
(form ``tt``) holds the factorisation read off the core shapes: core ``k`` is ``[m_k, R_{k-1}, n_k R_k]``
(``embedding.tt``), so ``row_shape``, ``dim_shape`` and the ranks follow. At load the same module class is built
without an optimizer and looks the ids up with the Eff-TT forward, so an export scores as the trained model.
"""

from __future__ import annotations

import torch
from torch import nn

from embedscale.embedding.hybrid import HybridTTEmbeddingBag
from embedscale.embedding.tt import TTEmbeddingBag
from embedscale.errors import FormatError, InputError


def tt_entry(name: str, features: list[str], num_rows: int, dim: int, pooling: str, state: dict) -> tuple[dict, dict]:
    """The manifest entry and the export tensors of TT table ``name`` from a checkpoint's ``tt`` state (its
    ``<name>.core<k>`` and, for row groups, ``<name>.hot_weight``); optimizer state is left behind."""
    cores = []
    while f"{name}.core{len(cores)}" in state:
        cores.append(state[f"{name}.core{len(cores)}"].detach().to(torch.float32).contiguous())
    if len(cores) < 2:
        raise FormatError(f"TT table {name!r}: the checkpoint holds {len(cores)} cores")
    ranks = [int(c.shape[1]) for c in cores] + [1]
    dim_shape = [int(c.shape[2]) // ranks[k + 1] for k, c in enumerate(cores)]
    tensors = {f"tt.{name}.core{k}": c for k, c in enumerate(cores)}
    hot = state.get(f"{name}.hot_weight")
    if hot is not None:
        tensors[f"tt.{name}.hot_weight"] = hot.detach().to(torch.float32).contiguous()
    entry = {"name": name, "features": list(features), "num_rows": num_rows, "dim": dim, "pooling": pooling,
             "form": "tt", "row_shape": [int(c.shape[0]) for c in cores], "dim_shape": dim_shape,
             "tt_ranks": ranks[1:-1], "hot_rows": int(hot.shape[0]) if hot is not None else 0,
             "bytes": int(sum(t.numel() * 4 for t in tensors.values()))}
    return entry, tensors


def tt_module(t: dict, weights: dict[str, torch.Tensor]) -> nn.Module:
    """The served module of a ``tt`` table entry: cores (and hot rows) loaded, no optimizer, no gradients."""
    kw = dict(row_shape=t["row_shape"], dim_shape=t["dim_shape"], mode=t["pooling"], include_last_offset=True,
              name=t["name"], validate=False)
    if t["hot_rows"]:
        m = HybridTTEmbeddingBag(t["num_rows"], t["dim"], t["tt_ranks"], hot_rows=t["hot_rows"], optimizer=None,
                                 tt_optimizer=None, **kw)
    else:
        m = TTEmbeddingBag(t["num_rows"], t["dim"], t["tt_ranks"], optimizer=None, **kw)
    own = m.state_dict()
    with torch.no_grad():
        for k, dst in own.items():
            src = weights.get(f"tt.{t['name']}.{k}")
            if src is None or tuple(src.shape) != tuple(dst.shape):
                raise FormatError(f"TT table {t['name']!r}: tensor tt.{t['name']}.{k} is missing or of another shape "
                                  f"({None if src is None else tuple(src.shape)}, expected {tuple(dst.shape)})")
            dst.copy_(src)
    m.requires_grad_(False)
    return m.eval()


def tt_pool(module: nn.Module, reorder: torch.Tensor | None, t: dict, feature: str, ids: torch.Tensor,
            offsets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """One feature's bags pooled from a served TT table (ids renamed by the table's reordering first)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t["num_rows"]):
        raise InputError(f"feature {feature!r}: row id outside table {t['name']!r} [0, {t['num_rows']})")
    rows = reorder[ids] if reorder is not None else ids
    with torch.no_grad():
        return module(rows, offsets, per_sample_weights=weights)


__all__ = ["tt_entry", "tt_module", "tt_pool"]
