"""The sparse input type and the batch every model and module consumes.

``JaggedFeatures`` has the layout of TorchRec's ``KeyedJaggedTensor``: for keys ``k_0..k_{F-1}`` and a
batch of ``B`` samples, ``lengths`` has ``F * B`` entries ordered key-major (all samples of ``k_0``,
then all of ``k_1``, ...), and ``values`` holds the row ids in that same order. ``weights`` (optional)
is one float per value (per-sample weights for weighted pooling).

As with TorchRec's ``KeyedJaggedTensor``, a module that needs some of the keys takes them with
``select(keys)`` / ``permute(order)`` / ``split(segments)`` rather than re-splitting the batch by hand: the
per-key value counts are read once per batch (``length_per_key_list``, ``F`` numbers) and carried to every
selection, and the ids stay on the batch's device (each key's values are one contiguous block, so a
selection is one ``cat`` of views). ``values`` and ``lengths`` are not to be modified in place after a
selection was taken (the cached counts would be stale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from embedscale.errors import InputError


@dataclass
class JaggedFeatures:
    """Keyed jagged sparse features (KJT layout): ``keys``, ``values``, ``lengths``, optional ``weights``."""

    keys: list[str]
    values: torch.Tensor  # int64 [total]
    lengths: torch.Tensor  # int64 [F * B], key-major
    weights: torch.Tensor | None = None  # float [total]

    def __post_init__(self) -> None:
        self.keys = list(self.keys)
        if self.lengths.dim() != 1 or self.values.dim() != 1:
            raise InputError("JaggedFeatures: values and lengths must be 1-D")
        F = len(self.keys)
        if F == 0:
            raise InputError("JaggedFeatures: no keys")
        if self.lengths.numel() % F:
            raise InputError(
                f"JaggedFeatures: {self.lengths.numel()} lengths is not a multiple of {F} keys"
            )
        if self.weights is not None and self.weights.numel() != self.values.numel():
            raise InputError(
                f"JaggedFeatures: {self.weights.numel()} weights for {self.values.numel()} values"
            )

    # -- shape ---------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys)

    def offsets(self) -> torch.Tensor:
        """Exclusive prefix sum of lengths, ``F * B + 1`` entries."""
        out = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    def length_per_key(self) -> torch.Tensor:
        return self.lengths.view(len(self.keys), -1).sum(1)

    def length_per_key_list(self) -> list[int]:
        """Values per key as Python ints: read once per batch (``F`` numbers, never the ids) and cached;
        every ``select``/``permute``/``split``/``to_dict`` of this batch reuses it."""
        lpk = getattr(self, "_lpk", None)
        if lpk is None:
            lpk = self.length_per_key().tolist() if self.keys else []
            object.__setattr__(self, "_lpk", lpk)
        return lpk

    def index_of(self, key: str) -> int:
        """Position of ``key`` among the keys (an ``InputError`` naming it and the keys when absent)."""
        pos = getattr(self, "_pos", None)
        if pos is None:
            pos = {k: i for i, k in enumerate(self.keys)}
            object.__setattr__(self, "_pos", pos)
        if key not in pos:
            raise InputError(f"JaggedFeatures: no feature {key!r}; the batch has {self.keys}")
        return pos[key]

    def validate(self) -> None:
        """Check lengths are non-negative and sum to the number of values."""
        if self.lengths.numel() and int(self.lengths.min()) < 0:
            raise InputError("JaggedFeatures: negative length")
        total = int(self.lengths.sum())
        if total != self.values.numel():
            raise InputError(f"JaggedFeatures: lengths sum to {total} but there are {self.values.numel()} values")

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, keys: Sequence[str], ids: torch.Tensor) -> "JaggedFeatures":
        """One-hot features: ``ids`` is ``[B, F]`` (one row id per sample and key)."""
        if ids.dim() != 2 or ids.shape[1] != len(keys):
            raise InputError(f"from_dense: ids of shape {tuple(ids.shape)} for {len(keys)} keys")
        B, F = ids.shape
        return cls(list(keys), ids.t().reshape(-1).to(torch.int64),
                   torch.ones(F * B, dtype=torch.int64, device=ids.device))

    @classmethod
    def from_lists(cls, per_key: dict[str, list[list[int]]]) -> "JaggedFeatures":
        """From python lists: ``{key: [ids of sample 0, ids of sample 1, ...]}``."""
        keys = list(per_key)
        sizes = {len(v) for v in per_key.values()}
        if len(sizes) != 1:
            raise InputError(f"from_lists: keys have different batch sizes {sorted(sizes)}")
        lengths = [len(s) for k in keys for s in per_key[k]]
        values = [x for k in keys for s in per_key[k] for x in s]
        return cls(keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))

    # -- access --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{key: (values, lengths)}`` per key."""
        B = self.batch_size
        vals = torch.split(self.values, self.length_per_key_list())
        lens = torch.split(self.lengths, B)
        return {k: (v, l) for k, v, l in zip(self.keys, vals, lens)}

    def permute(self, order: Sequence[int]) -> "JaggedFeatures":
        """The keys ``[keys[i] for i in order]`` (repeats allowed, any subset), their values, lengths and
        weights moved with them; as TorchRec's ``KeyedJaggedTensor.permute``. Each key's values are one
        contiguous block, so this is one ``cat`` of views on the batch's device: ids never leave it (only
        the ``F`` per-key counts are read, once per batch). The identity order returns ``self``."""
        F_ = len(self.keys)
        order = [int(i) for i in order]
        for i in order:
            if not 0 <= i < F_:
                raise InputError(f"JaggedFeatures.permute: index {i} outside the {F_} keys {self.keys}")
        if order == list(range(F_)):
            return self
        if not order:
            raise InputError("JaggedFeatures.permute: no keys selected")
        lpk = self.length_per_key_list()
        vals = torch.split(self.values, lpk)
        lens = self.lengths.view(F_, -1)
        wts = torch.split(self.weights, lpk) if self.weights is not None else None
        idx = torch.tensor(order, dtype=torch.int64, device=self.lengths.device)
        out = JaggedFeatures([self.keys[i] for i in order],
                             torch.cat([vals[i] for i in order]) if len(order) > 1 else vals[order[0]],
                             lens.index_select(0, idx).reshape(-1),
                             None if wts is None else (torch.cat([wts[i] for i in order]) if len(order) > 1
                                                       else wts[order[0]]))
        object.__setattr__(out, "_lpk", [lpk[i] for i in order])
        return out

    def select(self, keys: Sequence[str]) -> "JaggedFeatures":
        """The features ``keys``, in that order (``permute`` by name); an unknown key is an ``InputError``
        naming it and the batch's keys."""
        return self.permute([self.index_of(k) for k in keys])

    def split(self, segments: Sequence[int]) -> list["JaggedFeatures"]:
        """Consecutive groups of ``segments[i]`` keys each (they must add up to the number of keys), as
        TorchRec's ``KeyedJaggedTensor.split``; views of this batch's tensors, no copy."""
        F_ = len(self.keys)
        segments = [int(s) for s in segments]
        if sum(segments) != F_ or any(s <= 0 for s in segments):
            raise InputError(f"JaggedFeatures.split: segments {segments} do not cut {F_} keys into non-empty groups")
        if len(segments) == 1:
            return [self]
        lpk = self.length_per_key_list()
        B = self.batch_size
        out, k, v = [], 0, 0
        for s in segments:
            n = sum(lpk[k:k + s])
            part = JaggedFeatures(self.keys[k:k + s], self.values[v:v + n], self.lengths[k * B:(k + s) * B],
                                  None if self.weights is None else self.weights[v:v + n])
            object.__setattr__(part, "_lpk", lpk[k:k + s])
            out.append(part)
            k, v = k + s, v + n
        return out

    def slice_batch(self, start: int, stop: int) -> "JaggedFeatures":
        """Samples ``start:stop`` of every key (per-rank slicing for data parallelism)."""
        B = self.batch_size
        F = len(self.keys)
        if not (0 <= start <= stop <= B):
            raise InputError(f"slice_batch: [{start}, {stop}) outside batch of {B}")
        offs = self.offsets()
        lens = self.lengths.view(F, B)[:, start:stop].reshape(-1)
        first = torch.arange(F, device=offs.device) * B
        starts, ends = offs.index_select(0, first + start), offs.index_select(0, first + stop)
        counts = ends - starts  # values of each key in the slice
        n = int(counts.sum())  # one number read, not the ids: the positions are computed on the device
        shift = starts - (torch.cumsum(counts, 0) - counts)
        idx = torch.arange(n, device=offs.device) + torch.repeat_interleave(shift, counts, output_size=n)
        w = self.weights[idx] if self.weights is not None else None
        return JaggedFeatures(self.keys, self.values[idx], lens, w)

    def to(self, device: torch.device | str) -> "JaggedFeatures":
        w = self.weights.to(device) if self.weights is not None else None
        return JaggedFeatures(self.keys, self.values.to(device), self.lengths.to(device), w)

    # -- TorchRec interop ------------------------------------------------------------------------
    def to_kjt(self):
        """Convert to ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor`` (needs the torchrec extra)."""
        try:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError("to_kjt needs the optional torchrec extra: `make torchrec`") from e
        return KeyedJaggedTensor(keys=self.keys, values=self.values, lengths=self.lengths, weights=self.weights)

    @classmethod
    def from_kjt(cls, kjt) -> "JaggedFeatures":
        """Convert from a TorchRec ``KeyedJaggedTensor``."""
        return cls(list(kjt.keys()), kjt.values().to(torch.int64), kjt.lengths().to(torch.int64),
                   kjt.weights_or_none())


@dataclass
class Batch:
    """One mini-batch: ``dense [B, num_dense]`` float32, ``sparse`` features, ``labels [B]`` float32, and the
    sample ``weights [B]`` float32 of a weighted dataset (else None)."""

    dense: torch.Tensor
    sparse: JaggedFeatures
    labels: torch.Tensor
    global_size: int | None = None  # samples in the global batch this (rank's slice of a) batch belongs to
    weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def slice_batch(self, start: int, stop: int) -> "Batch":
        return Batch(self.dense[start:stop], self.sparse.slice_batch(start, stop), self.labels[start:stop],
                     weights=None if self.weights is None else self.weights[start:stop])

    def for_rank(self, rank: int, world_size: int) -> "Batch":
        """This rank's contiguous slice of a global batch (data parallelism); sizes differ by at most one."""
        B = self.batch_size
        start = (B * rank) // world_size
        stop = (B * (rank + 1)) // world_size
        return self.slice_batch(start, stop)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.dense.to(device), self.sparse.to(device), self.labels.to(device), self.global_size,
                     None if self.weights is None else self.weights.to(device))


def same_batch(a: JaggedFeatures, b: JaggedFeatures) -> bool:
    """``b`` is the batch ``a`` (the same object, or equal keys, lengths, values and weights): how an input pipeline
    knows the batch a lookup gets is the one it prepared."""
    if a is b:
        return True
    if a.keys != b.keys or a.values.shape != b.values.shape or a.lengths.shape != b.lengths.shape or \
            (a.weights is None) != (b.weights is None):
        return False
    return bool(torch.equal(a.values, b.values.to(a.values.device))) and \
        bool(torch.equal(a.lengths, b.lengths.to(a.lengths.device))) and \
        (a.weights is None or bool(torch.equal(a.weights, b.weights.to(a.weights.device))))
