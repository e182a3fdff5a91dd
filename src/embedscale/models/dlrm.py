"""DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and Recommendation
Systems") as four composable arches, and the pieces DCN shares with it.

This module owns the dense side of the model: the bottom MLP (``DenseArch``), the adapter that turns any
embedding module into ``[B, F, D]`` pooled embeddings (``SparseArch``), the dot interaction
(``InteractionArch``) and the top MLP (``OverArch``). The embedding itself is pluggable: any ``nn.Module``
with a ``feature_names`` attribute whose ``forward(JaggedFeatures)`` returns ``[B, sum of feature dims]``
with the features concatenated in ``feature_names`` order (``embedscale.embedding.local.LocalEmbeddingBags``,
a sharded executor, a TT table, ...). Its parameters are not dense parameters: ``dense_parameters()`` leaves
them out so they can get their own (sparse, row-wise) optimizer.

Default sizes follow OPER (USENIX ATC 2024) Table 1: bottom MLP 512-256-64-D with D = 16 for Criteo Kaggle
and Avazu (64 for Criteo Terabyte), top MLP 512-256-1. Sizes are given as *hidden* layers, as in
``ModelConfig``: the bottom MLP's last layer (width D) and the top MLP's logit layer (width 1) are implied.

Weight init is the DLRM reference's (``dlrm_s_pytorch.py``): every linear weight ~ N(0, sqrt(2 / (fan_in +
fan_out))) (Glorot normal), every bias ~ N(0, sqrt(1 / fan_out)). It draws from the default generator only,
so ``torch.manual_seed`` makes a model bit-for-bit reproducible.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError, InputError

__all__ = [
    "DLRM",
    "DenseArch",
    "FirstOrder",
    "InteractionArch",
    "LogitCalibration",
    "OverArch",
    "SparseArch",
    "check_dropout",
    "set_dropout",
    "set_dropout_rows",
    "dense_parameters",
    "init_linear_",
]


# --------------------------------------------------------------------------------------------------
# helpers shared with dcn.py


def init_linear_(layer: nn.Linear) -> nn.Linear:
    """Initialise ``layer`` in place as the DLRM reference does and return it.

    Weight ~ N(0, sqrt(2 / (fan_in + fan_out))), bias ~ N(0, sqrt(1 / fan_out)).

    Args:
        layer: the linear layer to initialise.

    Returns:
        nn.Linear: the same layer.

    Example::

        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> layer = init_linear_(torch.nn.Linear(4, 2))
        >>> tuple(layer.weight.shape)
        (2, 4)
    """
    fan_out, fan_in = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        if layer.bias is not None:
            layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out))
    return layer


def _check_sizes(what: str, in_features: int, layer_sizes: Sequence[int]) -> list[int]:
    if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
        raise ConfigError(f"{what}: in_features must be a positive integer, got {in_features!r}")
    sizes = list(layer_sizes)
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ConfigError(f"{what}: layer_sizes[{i}] must be a positive integer, got {s!r} (in {sizes})")
    return sizes


def _relu_mlp(in_features: int, layer_sizes: Sequence[int], device: torch.device | str | None) -> nn.Sequential:
    """Linear + ReLU per entry of ``layer_sizes`` (ReLU after the last layer too). Each ReLU works in place on its
    Linear's output, which nothing else reads (the Linear's backward keeps its input and weight, the ReLU's its
    result): the same values, one buffer fewer per layer (3-4% of a table1 dense forward + backward on one CPU
    thread)."""
    layers: list[nn.Module] = []
    width = in_features
    for size in layer_sizes:
        layers.append(init_linear_(nn.Linear(width, size, device=device)))
        layers.append(nn.ReLU(inplace=True))
        width = size
    return nn.Sequential(*layers)


def check_dropout(p: float) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ConfigError(f"train.dropout must be a number in [0, 1), got {p!r}")
    return float(p)


def set_dropout(model: nn.Module, p: float) -> int:
    """Dropout ``p`` in the hidden layers of every top MLP (``OverArch``) of ``model`` (DLRM, DCN and the DMT
    models built on them): regularisation for small data sets, the top MLP being where most dense
    parameters are. Returns how many top MLPs it set; ``p > 0`` on a model without one is a ``ConfigError``."""
    p = check_dropout(p)
    arches = [m for m in model.modules() if isinstance(m, OverArch)]
    if p and not arches:
        raise ConfigError(f"train.dropout {p}: {type(model).__name__} has no top MLP to apply it to")
    for m in arches:
        m.dropout = p
    return len(arches)


DROPOUT_BLOCK_ROWS = 256  # rows of a global batch whose dropout masks come from one seeded draw
_MASK_GENERATORS: dict[str, torch.Generator] = {}


def mask_bits(keep: float) -> int:
    """Bits of one uniform of :func:`dropout_mask`: 8 when ``keep`` is a multiple of 2^-8 (0.5, 0.75, ...:
    exact with half the random words), else 16."""
    return 8 if float(keep * 256).is_integer() else 16


def quantized_keep(keep: float) -> float:
    """The probability :func:`dropout_mask` keeps an element with: ``keep`` rounded to the mask's resolution
    (:func:`mask_bits`; at most 2^-17 away at 16 bits). Inverted dropout scales kept values by its inverse,
    so the expectation of every activation is unchanged (Srivastava et al. 2014, section 10)."""
    levels = 2 ** mask_bits(keep)
    return round(keep * levels) / levels


def dropout_mask(total: int, offset: int, rows: int, cols: int, keep: float, device,
                 dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """Rows ``[offset, offset + rows)`` of a ``[total, cols]`` keep-mask of a global batch, each element 1 (True)
    with probability :func:`quantized_keep` ``(keep)``, else 0; of ``dtype`` (a float mask comes out of the
    comparison itself: one pass, where bool-then-convert or a float-times-bool product take 3-10x longer on CPU).

    One seed is drawn from the CPU default generator per mask (every rank draws the same: the ranks' streams
    are in step), and block ``b`` of ``DROPOUT_BLOCK_ROWS`` rows of the global batch comes from a generator on
    ``device`` seeded with ``(seed, b)``: a rank draws only the blocks its rows touch, and row ``r``'s mask is
    the same whatever the world size. Every 64-bit random word gives eight 8-bit (or four 16-bit) uniforms
    (``torch.rand`` draws one per element: 4-6x slower on CPU); the blocks are drawn into one buffer."""
    seed = int(torch.randint(0, 2 ** 62, (1,)))
    dev = torch.device(device)
    gen = _MASK_GENERATORS.get(str(dev))
    if gen is None:
        gen = _MASK_GENERATORS[str(dev)] = torch.Generator(device=dev)
    first = offset // DROPOUT_BLOCK_ROWS
    last = (offset + max(rows, 1) - 1) // DROPOUT_BLOCK_ROWS
    bits = mask_bits(keep)
    per_words = DROPOUT_BLOCK_ROWS * cols * bits // 64  # a block is a whole number of words (256 rows)
    words = torch.empty((last - first + 1) * per_words, dtype=torch.int64, device=dev)
    for i, b in enumerate(range(first, last + 1)):
        gen.manual_seed((seed + b * 0x9E3779B97F4A7C15) % 2 ** 63)
        torch.randint(-(2 ** 63), 2 ** 63 - 1, (per_words,), dtype=torch.int64, device=dev, generator=gen,
                      out=words[i * per_words:(i + 1) * per_words])
    lo = offset - first * DROPOUT_BLOCK_ROWS
    u = words.view(torch.int8 if bits == 8 else torch.int16).view(-1, cols)[lo:lo + rows]
    levels = 2 ** bits  # a signed uniform in [-levels/2, levels/2): P(u < threshold) = quantized_keep(keep)
    threshold = round(keep * levels) - levels // 2
    if dtype == torch.bool:
        return u < threshold
    return torch.lt(u, threshold, out=torch.empty((u.shape[0], cols), dtype=dtype, device=dev))


class _ReluDropout(torch.autograd.Function):
    """``relu(h) * mask * scale`` for a 0/1 ``mask``: one output buffer written in place, and a backward of two
    passes (the ReLU's and the mask's gradient) where ``nn.ReLU`` followed by a product takes three passes and
    two more buffers. Where an element is kept, ``out > 0`` exactly when ``h > 0``, so the output is all the
    backward needs besides the mask."""

    @staticmethod
    def forward(ctx, h, mask, scale):
        mask.mul_(scale)
        out = torch.relu(h).mul_(mask)
        ctx.save_for_backward(out, mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, mask = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, out, 0).mul_(mask), None, None


def set_dropout_rows(model: nn.Module, global_size: int | None, offset: int) -> None:
    """The next training batch of ``model`` is rows ``[offset, offset + local)`` of a global batch of
    ``global_size`` rows (N ranks: each rank's contiguous share); dropout masks are drawn for the global batch
    (``OverArch.forward``)."""
    rows = None if not global_size else (int(global_size), int(offset))
    for m in model.modules():
        if isinstance(m, OverArch):
            m.global_rows = rows


def dense_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Every parameter of ``model`` except those of ``model.sparse_arch.embedding``.

    The embedding tables are trained by their own sparse optimizer; everything else (MLPs, cross layers)
    goes to a dense optimizer, and in data parallelism to the dense AllReduce.

    Args:
        model: a model with a ``sparse_arch.embedding`` submodule (``DLRM``, ``DCN``).

    Returns:
        Iterator[nn.Parameter]: the dense parameters, in ``model.parameters()`` order.
    """
    embedding_ids = {id(p) for p in model.sparse_arch.embedding.parameters()}
    for p in model.parameters():
        if id(p) not in embedding_ids:
            yield p


def _check_dense(dense: torch.Tensor, num_dense: int, sparse: JaggedFeatures) -> None:
    if dense.dim() != 2 or dense.shape[1] != num_dense:
        raise InputError(f"dense features: expected shape [B, {num_dense}], got {list(dense.shape)}")
    if sparse.batch_size != dense.shape[0]:
        raise InputError(
            f"batch size mismatch: dense features have {dense.shape[0]} samples, "
            f"sparse features {sparse.keys} have {sparse.batch_size}"
        )


def _check_num_dense(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"num_dense: the number of dense features must be an integer >= 0, got {n!r}")
    return n


# --------------------------------------------------------------------------------------------------
# the arches


class FirstOrder(nn.Module):
    """The first-order (wide) term: a linear model of the sample's features added to the deep part's logit,
    as the wide part of Wide & Deep (Cheng et al. 2016, section 3.1, ``w^T x``) and DeepFM's FM first-order
    term (Guo et al. 2017, eq. 2, ``<w, x>``): each feature value's own effect reaches the logit directly
    instead of being learned through the interaction.

    Each row's weight is a linear read-out of its embedding: ``w_r = <u_f, e_r>`` with one learned vector
    ``u_f`` per feature (``sparse``, the feature dims concatenated), so a bag pools its rows' weights as it
    pools their vectors (sum or mean) and the term costs no storage beside the tables: every table form
    (sharded rows, TT, host) and every checkpoint and re-sharding path carries it unchanged. The row's
    weight moves with its embedding at the tables' (sparse) learning rate; ``u_f`` starts at
    ``N(0, 1 / d_f)`` (unit expected norm), so the read-out direction is fixed from the first step and the
    rows learn their weight along it. Dense features get a plain linear term (``dense``, zero at init).

        first_order(e, x) = sum_f <u_f, e_f> + <v, x>

    Args:
        feature_dims: the embedding dim of every feature, in the embedding's output order.
        num_dense: dense features (0: no dense term).
        device: where to allocate the parameters.

    Example::

        >>> import torch
        >>> fo = FirstOrder([4, 4], num_dense=3)
        >>> fo(torch.rand(5, 8), torch.rand(5, 3)).shape
        torch.Size([5])
    """

    def __init__(self, feature_dims: Sequence[int], num_dense: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        dims = [int(d) for d in feature_dims]
        std = torch.tensor([d ** -0.5 for d in dims for _ in range(d)], device=device)
        self.sparse = nn.Parameter(torch.randn(sum(dims), device=device) * std)
        self.dense = nn.Parameter(torch.zeros(num_dense, device=device)) if num_dense else None

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        """
        Args:
            pooled: ``[B, sum of feature dims]`` pooled embeddings.
            dense: ``[B, num_dense]`` dense features (ignored when there are none).

        Returns:
            torch.Tensor: ``[B]``.
        """
        out = pooled @ self.sparse
        if self.dense is not None:
            out = out + dense @ self.dense
        return out


class LogitCalibration(nn.Module):
    """The logit's calibration map at inference, identity while training: beta calibration (Kull et al. 2017,
    eq. 4; ``data.metrics.beta_calibration``) ``a z + b + d softplus(-z)``, which is Platt scaling ``a z + b``
    (Platt 1999, section 2; Guo et al. 2017, section 4.2) when ``d = 0``: slope ``a`` for high scores, ``a - d``
    for low ones. The loop fits it on the eval split's raw logits at every evaluation (``train.calibrate``) and
    sets it here before that step's checkpoints (the best one among them) are written, so every checkpoint,
    export and server of the model predicts calibrated probabilities; both slopes positive keep the ranking (AUC) as it
    is. Stored as the buffers ``scale_shift = [a, b]`` and ``tail = [d]`` (``[1, 0]``, ``[0]``: no change; a
    checkpoint without them loads as that).

        >>> import torch
        >>> cal = LogitCalibration().eval()
        >>> cal.compose(0.5, 1.0)
        >>> cal(torch.tensor([2.0, -2.0])).tolist()
        [2.0, 0.0]
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("scale_shift", torch.tensor([1.0, 0.0], device=device))
        self.register_buffer("tail", torch.tensor([0.0], device=device))
        self.bypass = False  # uncalibrated(): the raw logit in eval mode too

    def compose(self, a: float, b: float) -> None:
        """Apply ``z -> a z + b`` after the present map: ``[a0, b0]`` becomes ``[a a0, a b0 + b]``, ``d0`` ``a d0``."""
        a0, b0 = (float(v) for v in self.scale_shift.double())
        self.scale_shift.copy_(torch.tensor([a * a0, a * b0 + b], dtype=torch.float64))
        self.tail.mul_(a)

    def set(self, a: float, b: float, d: float = 0.0) -> None:
        """Replace the map by ``z -> a z + b + d softplus(-z)``."""
        self.scale_shift.copy_(torch.tensor([a, b], dtype=torch.float64))
        self.tail.fill_(d)

    def forward(self, logit: torch.Tensor) -> torch.Tensor:
        if self.training or self.bypass:
            return logit
        out = logit * self.scale_shift[0] + self.scale_shift[1]
        # the tail only where it is set: softplus(-z) of z = -inf is inf, and 0 * inf is NaN
        return torch.where(self.tail != 0, out + self.tail * F.softplus(-logit), out)


def calibrate_logits(model: nn.Module, a: float, b: float, d: float | None = None) -> int:
    """Compose the Platt scaling ``(a, b)`` into every :class:`LogitCalibration` of ``model``, or with ``d`` given
    replace each map by the beta map ``(a, b, d)``; returns how many."""
    found = [m for m in model.modules() if isinstance(m, LogitCalibration)]
    for m in found:
        if d is None:
            m.compose(a, b)
        else:
            m.set(a, b, d)
    return len(found)


@contextlib.contextmanager
def uncalibrated(model: nn.Module | None):
    """Within: every :class:`LogitCalibration` of ``model`` passes the raw logit (the loop fits the map on it)."""
    found = [m for m in model.modules() if isinstance(m, LogitCalibration)] if model is not None else []
    for m in found:
        m.bypass = True
    try:
        yield
    finally:
        for m in found:
            m.bypass = False


class DenseArch(nn.Module):
    """The bottom MLP of DLRM: dense features to one vector per sample (Naumov et al. 2019, section 2).

    Every layer is Linear + ReLU, the last one included (as in the DLRM reference), so the output is the
    non-negative "dense embedding" that takes part in the dot interaction. For DLRM the last layer's width
    must equal the embedding dimension D.

    Args:
        in_features: number of dense features (13 for Criteo).
        layer_sizes: widths of all layers, the last one included (OPER Table 1: ``[512, 256, 64, 16]``).
        device: where to allocate the parameters (default: torch's default device).

    Example::

        >>> import torch
        >>> dense_arch = DenseArch(13, [32, 16])
        >>> dense_arch(torch.rand(4, 13)).shape
        torch.Size([4, 16])
    """

    def __init__(
        self, in_features: int, layer_sizes: Sequence[int], device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        sizes = _check_sizes("DenseArch", in_features, layer_sizes)
        if not sizes:
            raise ConfigError("DenseArch: layer_sizes is empty; the last layer must produce the embedding dim")
        self.in_features = in_features
        self.out_features = sizes[-1]
        self.model = _relu_mlp(in_features, sizes, device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """
        Args:
            features: dense features ``[B, in_features]``.

        Returns:
            torch.Tensor: ``[B, layer_sizes[-1]]``.
        """
        return self.model(features)


class SparseArch(nn.Module):
    """Pooled embedding lookups of every sparse feature, through any embedding module.

    Wraps an embedding module (``forward(JaggedFeatures) -> [B, sum of feature dims]`` in the order of its
    ``feature_names``) and reshapes its output to ``[B, F, D]`` for the DLRM dot interaction, or hands the
    flat ``[B, sum of dims]`` to DCN (``pooled``). The wrapped module is ``self.embedding``.

    Args:
        embedding: the embedding module; must have a ``feature_names`` attribute.
        feature_dims: the embedding dim of every feature, in ``embedding.feature_names`` order, or one int
            when all features share it.

    Example::

        >>> import torch
        >>> from embedscale.data.batch import JaggedFeatures
        >>> from embedscale.embedding.local import LocalEmbeddingBags
        >>> from embedscale.specs import TableSpec
        >>> tables = [TableSpec("t1", num_rows=10, dim=4), TableSpec("t2", num_rows=20, dim=4)]
        >>> sparse_arch = SparseArch(LocalEmbeddingBags(tables), feature_dims=4)
        >>> # sample 0: t1 ids [0, 1], t2 ids [5]; sample 1: t1 ids [3], t2 ids [] (pools to zeros)
        >>> features = JaggedFeatures.from_lists({"t1": [[0, 1], [3]], "t2": [[5], []]})
        >>> sparse_arch(features).shape
        torch.Size([2, 2, 4])
    """

    def __init__(self, embedding: nn.Module, feature_dims: int | Sequence[int]) -> None:
        super().__init__()
        names = getattr(embedding, "feature_names", None)
        if names is None:
            raise ConfigError(
                f"SparseArch: the embedding module {type(embedding).__name__} has no `feature_names` attribute "
                "(the order of the features in its output)"
            )
        names = list(names)
        if not names:
            raise ConfigError(f"SparseArch: the embedding module {type(embedding).__name__} has no features")
        if isinstance(feature_dims, int):
            dims = [feature_dims] * len(names)
        else:
            dims = list(feature_dims)
            if len(dims) != len(names):
                raise ConfigError(
                    f"SparseArch: {len(dims)} feature dims for the {len(names)} features {names} of the embedding"
                )
        for name, d in zip(names, dims):
            if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
                raise ConfigError(f"SparseArch: feature {name!r} has embedding dim {d!r}; must be a positive integer")
        self.embedding = embedding
        self.feature_names: list[str] = names
        self.feature_dims: list[int] = dims
        self.num_features = len(names)
        self.out_features = sum(dims)
        # One D shared by every feature, or None when dims differ (fine for DCN, not for the dot interaction).
        self.embedding_dim: int | None = dims[0] if len(set(dims)) == 1 else None

    def start(self, features: JaggedFeatures):
        """Begin the lookup of ``features`` ahead of its result, where the embedding can (its ``start``: the
        exchange in flight while the caller computes, OPER 5.2); hand what it returns to :meth:`pooled`.
        ``None``: the lookup runs whole in :meth:`pooled`."""
        start = getattr(self.embedding, "start", None)
        return start(features) if start is not None else None

    def pooled(self, features: JaggedFeatures, started=None) -> torch.Tensor:
        """
        Args:
            features: the sparse features of a batch of ``B`` samples.
            started: what :meth:`start` returned for them (its lookup completed here), or ``None``.

        Returns:
            torch.Tensor: ``[B, sum of feature dims]``, features in ``feature_names`` order.
        """
        out = self.embedding(features) if started is None else self.embedding.finish(started)
        expected = [features.batch_size, self.out_features]
        if out.dim() != 2 or list(out.shape) != expected:
            raise ConfigError(
                f"SparseArch: the embedding module {type(self.embedding).__name__} returned shape {list(out.shape)}, "
                f"expected {expected} for features {self.feature_names} with dims {self.feature_dims}"
            )
        return out

    def forward(self, features: JaggedFeatures) -> torch.Tensor:
        """
        Args:
            features: the sparse features of a batch of ``B`` samples.

        Returns:
            torch.Tensor: ``[B, F, D]`` pooled embeddings, features in ``feature_names`` order.
        """
        return self.vectors(self.pooled(features))

    def vectors(self, pooled: torch.Tensor) -> torch.Tensor:
        """:meth:`pooled`'s ``[B, F * D]`` output viewed as ``[B, F, D]`` (one shared D needed)."""
        if self.embedding_dim is None:
            raise ConfigError(
                "SparseArch: features have different embedding dims "
                f"{dict(zip(self.feature_names, self.feature_dims))}; [B, F, D] needs one shared D"
            )
        return pooled.view(-1, self.num_features, self.embedding_dim)


class _PairDots(torch.autograd.Function):
    """The dot product of every pair i < j of the vectors ``v`` ``[B, n, D]``: the Gram matrix ``v v^T`` by one
    ``bmm``, its strictly upper triangle gathered by one ``index_select`` of the flattened ``[B, n * n]``.

    The backward is the same computation autograd derives for ``bmm(v, v^T)`` (the output gradient scattered
    into a zero ``[B, n, n]`` matrix ``G``, then ``G v`` plus ``G^T v``), but forms ``G^T v`` by a ``bmm`` of
    ``G``'s transposed view, whose result is laid out as ``v`` is, instead of transposing ``v^T G``: the sum of
    the two terms is then a contiguous add rather than a strided one (7-9% of the interaction's forward +
    backward at table1's shapes on one CPU thread), with the bits of autograd's form on CPU (checked by the tests)."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, triu_flat: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(v, triu_flat)
        return torch.bmm(v, v.transpose(1, 2)).flatten(1).index_select(1, triu_flat)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        v, triu_flat = ctx.saved_tensors
        b, n = v.shape[0], v.shape[1]
        g = torch.zeros(b, n * n, dtype=grad.dtype, device=grad.device).index_add_(1, triu_flat, grad)
        g = g.view(b, n, n)
        return torch.bmm(g, v).add_(torch.bmm(g.transpose(1, 2), v)), None


class InteractionArch(nn.Module):
    """DLRM's dot interaction (Naumov et al. 2019, section 2.1.3 / "interaction op" ``dot``).

    Stacks the dense vector and the F pooled embeddings into F + 1 vectors of size D, takes the dot product
    of every pair i < j (the strictly upper triangle of the Gram matrix, pairs in row-major order with the
    dense vector as index 0: (0,1), (0,2), ..., (0,F), (1,2), ...), and concatenates the dense vector in
    front: the output has ``D + (F + 1) F / 2`` columns.

    Args:
        num_sparse_features: F.
        device: where to put the index buffer.
        with_dense: ``False`` for a model without dense features: the F embeddings alone, their
            ``F (F - 1) / 2`` pairwise dot products (no dense vector in front).

    Example::

        >>> import torch
        >>> inter = InteractionArch(num_sparse_features=3)
        >>> out = inter(torch.rand(5, 4), torch.rand(5, 3, 4))  # B=5, F=3, D=4
        >>> out.shape  # 4 + (4 * 3) / 2
        torch.Size([5, 10])
    """

    def __init__(self, num_sparse_features: int, device: torch.device | str | None = None,
                 with_dense: bool = True) -> None:
        super().__init__()
        F = num_sparse_features
        if isinstance(F, bool) or not isinstance(F, int) or F <= 0:
            raise ConfigError(f"InteractionArch: num_sparse_features must be a positive integer, got {F!r}")
        self.num_sparse_features = num_sparse_features
        self.with_dense = bool(with_dense)
        n = num_sparse_features + int(self.with_dense)
        # the pairs i < j as positions in the flattened [F+1, F+1] Gram matrix: one index_select forward, one
        # index_add backward (half the time of gram[:, i, j]'s gather and accumulating index_put on a 2-core CPU)
        i, j = torch.triu_indices(n, n, offset=1, device=device)
        self.register_buffer("triu_flat", i * n + j, persistent=False)

    def output_dim(self, embedding_dim: int) -> int:
        """Width of the output for embedding dim ``embedding_dim``: ``D + (F + 1) F / 2`` (without the dense
        vector: ``F (F - 1) / 2``)."""
        F = self.num_sparse_features
        if not self.with_dense:
            return F * (F - 1) // 2
        return embedding_dim + (F + 1) * F // 2

    def forward(self, dense_features: torch.Tensor | None, sparse_features: torch.Tensor) -> torch.Tensor:
        """
        Args:
            dense_features: bottom-MLP output ``[B, D]`` (``None`` when built ``with_dense=False``).
            sparse_features: pooled embeddings ``[B, F, D]``.

        Returns:
            torch.Tensor: ``[B, D + (F + 1) F / 2]``: the dense vector, then the pairwise dot products
            (without the dense vector: the ``F (F - 1) / 2`` dot products of the embeddings alone).
        """
        F = self.num_sparse_features
        if not self.with_dense:
            if sparse_features.dim() != 3 or sparse_features.shape[1] != F:
                raise InputError(f"InteractionArch: expected sparse [B, {F}, D], got {list(sparse_features.shape)}")
            return _PairDots.apply(sparse_features, self.triu_flat)  # [B, F (F - 1) / 2]
        if dense_features.dim() != 2 or sparse_features.dim() != 3 or sparse_features.shape[1] != F \
                or sparse_features.shape[0] != dense_features.shape[0] \
                or sparse_features.shape[2] != dense_features.shape[1]:
            raise InputError(
                f"InteractionArch: expected dense [B, D] and sparse [B, {F}, D], got dense "
                f"{list(dense_features.shape)} and sparse {list(sparse_features.shape)}"
            )
        vectors = torch.cat([dense_features.unsqueeze(1), sparse_features], dim=1)  # [B, F+1, D]
        pairs = _PairDots.apply(vectors, self.triu_flat)  # (v_i . v_j) for the pairs i < j
        return torch.cat([dense_features, pairs], dim=1)


class OverArch(nn.Module):
    """The top MLP: hidden Linear + ReLU layers, then one linear layer to a single logit (no sigmoid).

    Args:
        in_features: width of the input (the interaction output for DLRM, the cross output for DCN).
        layer_sizes: widths of the hidden layers (OPER Table 1: ``[512, 256]``); the logit layer is added.
            May be empty (a logistic regression on the input).
        device: where to allocate the parameters.

    Example::

        >>> import torch
        >>> over_arch = OverArch(10, [8, 4])
        >>> over_arch(torch.rand(3, 10)).shape
        torch.Size([3, 1])
    """

    def __init__(
        self, in_features: int, layer_sizes: Sequence[int], device: torch.device | str | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        sizes = _check_sizes("OverArch", in_features, layer_sizes)
        self.in_features = in_features
        self.model = _relu_mlp(in_features, sizes, device)
        self.model.append(init_linear_(nn.Linear(sizes[-1] if sizes else in_features, 1, device=device)))
        self.dropout = check_dropout(dropout)
        self.global_rows: tuple[int, int] | None = None  # (global batch size, this rank's first row in it)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """
        Args:
            features: ``[B, in_features]``.

        Returns:
            torch.Tensor: logits ``[B, 1]``.

        In training mode with ``dropout > 0`` every hidden ReLU's output is dropped with that probability
        (inverted dropout, Srivastava et al. 2014), applied functionally so the parameter names are the same
        with and without it (checkpoints load either way). The mask is drawn for the whole global batch
        (``global_rows``: its size and where this rank's rows start in it, set by :func:`set_dropout_rows`;
        default this batch alone) and this rank's rows cut out of it, so N ranks drop what one process
        training the same global batch drops (same seed: the same random stream on every rank).
        """
        if not (self.dropout and self.training):
            return self.model(features)
        total, offset = self.global_rows or (features.shape[0], 0)
        n, keep = features.shape[0], 1.0 - self.dropout
        scale = 1.0 / quantized_keep(keep)
        x = features
        for layer in self.model:
            if isinstance(layer, nn.ReLU):  # ReLU and a float mask of 0 / scale in one autograd node
                x = _ReluDropout.apply(x, dropout_mask(total, offset, n, x.shape[1], keep, x.device, x.dtype),
                                       scale)
            else:
                x = layer(x)
        return x


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019): bottom MLP, embedding lookups, dot interaction, top MLP.

    ``logit = OverArch(InteractionArch(DenseArch(dense), SparseArch(sparse)))`` (``+ FirstOrder(...)`` with
    ``first_order``). Every sparse feature must have the embedding dim D of the bottom MLP's output, so that
    all F + 1 vectors can be dotted. Without dense features (``dense_in_features = 0``, most libFM logs)
    there is no bottom MLP and the F embeddings are dotted among themselves (``F >= 2``).

    Args:
        dense_in_features: number of dense features (13 for Criteo, 1 for Avazu, 0 for none).
        embedding: the embedding module (``feature_names`` attribute, ``forward(JaggedFeatures) -> [B, F*D]``);
            reachable afterwards as ``model.sparse_arch.embedding``.
        embedding_dim: D, shared by every feature and the bottom MLP's last layer.
        bottom_mlp: hidden widths of the bottom MLP; a last layer of width D is added (OPER Table 1:
            512-256-64-D).
        top_mlp: hidden widths of the top MLP; the logit layer is added (OPER Table 1: 512-256-1).
        device: where to allocate the dense parameters (the embedding module is used as given).
        first_order: add the first-order (wide) term (:class:`FirstOrder`) to the logit.

    ``overlap`` (default ``True``): an embedding that can start its lookup ahead (``ShardedEmbedding.start``)
    has its exchange in flight while the bottom MLP computes, and the lookup completed after it (OPER 5.2);
    ``False`` runs the bottom MLP, then the whole lookup. The same results either way.

    Example::

        >>> import torch
        >>> from embedscale.data.batch import JaggedFeatures
        >>> from embedscale.embedding.local import LocalEmbeddingBags
        >>> from embedscale.specs import TableSpec
        >>> tables = [TableSpec("t1", num_rows=10, dim=4), TableSpec("t2", num_rows=20, dim=4)]
        >>> model = DLRM(13, LocalEmbeddingBags(tables), embedding_dim=4, bottom_mlp=[8], top_mlp=[8])
        >>> features = JaggedFeatures.from_lists({"t1": [[0, 1], [3]], "t2": [[5], [7]]})
        >>> model(torch.rand(2, 13), features).shape
        torch.Size([2])
    """

    def __init__(
        self,
        dense_in_features: int,
        embedding: nn.Module,
        embedding_dim: int,
        bottom_mlp: Sequence[int] = (512, 256, 64),
        top_mlp: Sequence[int] = (512, 256),
        device: torch.device | str | None = None,
        first_order: bool = False,
    ) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(embedding, embedding_dim)
        self.dense_in_features = _check_num_dense(dense_in_features)
        self.embedding_dim = embedding_dim
        if dense_in_features == 0 and self.sparse_arch.num_features < 2:
            raise ConfigError("DLRM without dense features needs at least 2 sparse features to interact, got "
                              f"{self.sparse_arch.feature_names}")
        self.dense_arch = (DenseArch(dense_in_features, list(bottom_mlp) + [embedding_dim], device=device)
                           if dense_in_features else None)
        self.inter_arch = InteractionArch(self.sparse_arch.num_features, device=device,
                                          with_dense=self.dense_arch is not None)
        self.over_arch = OverArch(self.inter_arch.output_dim(embedding_dim), list(top_mlp), device=device)
        self.first_order = (FirstOrder(self.sparse_arch.feature_dims, dense_in_features, device=device)
                            if first_order else None)
        self.calibration = LogitCalibration(device=device)
        self.overlap = True

    def forward(self, dense: torch.Tensor, sparse: JaggedFeatures) -> torch.Tensor:
        """
        Args:
            dense: dense features ``[B, dense_in_features]`` (``[B, 0]`` without any).
            sparse: sparse features of the same ``B`` samples.

        Returns:
            torch.Tensor: logits ``[B]`` (apply a sigmoid, or use ``BCEWithLogitsLoss``).
        """
        _check_dense(dense, self.dense_in_features, sparse)
        # the embedding's exchange in flight while the bottom MLP computes (OPER 5.2; the same bits either way)
        started = self.sparse_arch.start(sparse) if self.overlap and self.dense_arch is not None else None
        dense_out = self.dense_arch(dense) if self.dense_arch is not None else None
        pooled = self.sparse_arch.pooled(sparse, started)
        sparse_out = self.sparse_arch.vectors(pooled)
        logit = self.over_arch(self.inter_arch(dense_out, sparse_out)).squeeze(-1)
        if self.first_order is not None:
            logit = logit + self.first_order(pooled, dense)
        return self.calibration(logit)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """All parameters but the embedding module's (for a separate dense optimizer)."""
        return dense_parameters(self)
