"""TorchRec interop: ``KeyedJaggedTensor`` in, ``KeyedTensor`` out, ``EmbeddingBagCollection`` names.

A TorchRec user moves code and trained tables in and out of embedscale's embeddings
(:class:`~embedscale.embedding.local.LocalEmbeddingBags`, :class:`~embedscale.embedding.sharded.ShardedEmbedding`):

* **Input.** A TorchRec ``KeyedJaggedTensor`` (KJT) is recognised by its methods (``keys()``, ``values()``,
  ``lengths()``, ``weights_or_none()``: duck typing, so this module never imports torchrec) and converted to
  :class:`~embedscale.data.batch.JaggedFeatures`, which has the KJT's layout (key-major lengths, values in
  that order, optional per-value weights): the conversion moves no ids.
* **Output.** Given a KJT, the modules return what TorchRec's ``EmbeddingBagCollection`` (EBC) returns: a
  ``KeyedTensor`` whose keys are the pooled features (tables in order, each table's features in order, as
  the EBC's ``_embedding_names``), ``length_per_key`` their dims, ``values()`` the ``[B, sum of dims]``
  pooled embeddings. Building it needs torchrec, which is then installed (the caller made a KJT).
* **State dicts.** An EBC saves table ``t`` as ``embedding_bags.<t>.weight`` (``[num_embeddings, dim]``); the
  modules load those names as well as their own, and :func:`ebc_state_dict` gives the EBC's names back.
  An EBC's state dict has no optimizer state: a row-wise Adagrad module loading EBC weights starts its
  per-row state from zero (a fresh optimizer, as a TorchRec run that restores only the weights).
* **Tables.** :func:`table_specs_from_ebc` turns an EBC (or its ``EmbeddingBagConfig`` list) into
  :class:`~embedscale.specs.TableSpec` (name, rows, dim, features, ``sum``/``mean`` pooling), so both
  modules have the same tables, features (several features may share a table) and output columns.

torchrec is an optional extra (``make torchrec``): embedscale imports and works without it; the one
import of it (:func:`keyed_tensor`) is inside the function, guarded, and only reached with a KJT in hand.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError, InputError
from embedscale.specs import TableSpec

EBC_PREFIX = "embedding_bags."
_KJT_METHODS = ("keys", "values", "lengths", "weights_or_none")


def is_kjt(features: Any) -> bool:
    """``features`` is a TorchRec ``KeyedJaggedTensor`` (or anything with its methods), not ``JaggedFeatures``."""
    return not isinstance(features, JaggedFeatures) and all(
        callable(getattr(features, m, None)) for m in _KJT_METHODS)


def jagged_from_kjt(kjt: Any) -> JaggedFeatures:
    """The KJT's keys, values, lengths and weights as ``JaggedFeatures`` (same tensors, ids as int64)."""
    keys = list(kjt.keys())
    values, lengths = kjt.values(), kjt.lengths()
    if values.is_floating_point() or lengths.is_floating_point():
        raise InputError(f"KeyedJaggedTensor with keys {keys}: values ({values.dtype}) and lengths "
                         f"({lengths.dtype}) must be integer ids and counts")
    return JaggedFeatures(keys, values.to(torch.int64), lengths.to(torch.int64), kjt.weights_or_none())


def as_jagged(features: Any) -> tuple[JaggedFeatures, bool]:
    """``(JaggedFeatures, was_kjt)``: a module's input as embedscale's jagged type, and whether it came as a KJT
    (then the module answers with a ``KeyedTensor``). Anything else than the two is an ``InputError``."""
    if isinstance(features, JaggedFeatures):
        return features, False
    if is_kjt(features):
        return jagged_from_kjt(features), True
    raise InputError(f"expected JaggedFeatures or a TorchRec KeyedJaggedTensor, got {type(features).__name__}")


def keyed_tensor(keys: Sequence[str], dims: Sequence[int], values: torch.Tensor):
    """TorchRec ``KeyedTensor`` of ``values [B, sum(dims)]`` (keys along dim 1), as an EBC's forward returns."""
    try:  # optional extra: only reached when the input was a KJT, i.e. torchrec is installed
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ImportError as e:  # pragma: no cover - a KJT without torchrec
        raise ImportError("a KeyedTensor output needs the optional torchrec extra: `make torchrec`") from e
    return KeyedTensor(keys=list(keys), length_per_key=[int(d) for d in dims], values=values, key_dim=1)


def ebc_weight_key(table: str, prefix: str = "") -> str:
    """An EBC's state-dict name of table ``table``'s weight: ``{prefix}embedding_bags.{table}.weight``."""
    return f"{prefix}{EBC_PREFIX}{table}.weight"


def ebc_state_dict(tables: Iterable[str], weight_of, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{prefix}embedding_bags.<table>.weight``: each table's ``[num_rows, dim]`` weight, detached
    (``weight_of(table)``), in the tables' order: what ``EmbeddingBagCollection.load_state_dict`` takes."""
    return {ebc_weight_key(t, prefix): weight_of(t).detach() for t in tables}


def has_ebc_names(state_dict: Mapping[str, Any], prefix: str = "") -> bool:
    """The state dict holds some ``{prefix}embedding_bags.*`` entry (an EBC's naming)."""
    head = prefix + EBC_PREFIX
    return any(k.startswith(head) for k in state_dict)


def table_specs_from_ebc(ebc_or_configs: Any) -> list[TableSpec]:
    """``TableSpec`` s of an ``EmbeddingBagCollection`` (``embedding_bag_configs()``) or of a list of
    ``EmbeddingBagConfig``: name, ``num_embeddings`` rows, ``embedding_dim``, ``feature_names`` (the table's
    name when empty, as TorchRec) and pooling (``SUM`` or ``MEAN``; anything else is a ``ConfigError``
    naming the table). Only fp32 tables (``DataType.FP32``) are taken."""
    get = getattr(ebc_or_configs, "embedding_bag_configs", None)
    configs = list(get() if callable(get) else ebc_or_configs)
    specs = []
    for c in configs:
        pooling = str(getattr(c.pooling, "name", c.pooling)).lower()
        if pooling not in ("sum", "mean"):
            raise ConfigError(f"TorchRec table {c.name!r}: pooling {pooling!r} is not sum or mean")
        dtype = str(getattr(getattr(c, "data_type", None), "name", "FP32"))
        if dtype != "FP32":
            raise ConfigError(f"TorchRec table {c.name!r}: data type {dtype} (only FP32 tables are taken)")
        specs.append(TableSpec(c.name, int(c.num_embeddings), int(c.embedding_dim),
                               features=list(c.feature_names) or [c.name], pooling=pooling))
    if not specs:
        raise ConfigError("TorchRec EmbeddingBagCollection: no tables")
    return specs
