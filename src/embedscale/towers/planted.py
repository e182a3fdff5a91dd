"""Synthetic click data with planted feature groups: the ground truth the tower partitioner must find.

DMT 3.2-3.3 argue that feature interactions are sparse and concentrated in groups of features
("dedicated item, item-user, and dedicated user features", DMT 5.2.3), and that towers aligned with
those groups keep model quality while compressing. :class:`PlantedGroups` makes data where this holds
by construction, so the partitioner's output can be scored (adjusted Rand index against the planted
groups) and the AUC of towers from the partitioner compared with naive towers (DMT Table 6).

Model. ``F`` one-hot sparse features in ``G`` groups (group of each feature drawn at random, sizes as
equal as possible), ``num_rows`` rows per table. Every sample has one *entity* per group (uniform over
``num_rows``); with probability ``correlation`` a feature's id is its group entity's row (a fixed
permutation per feature), otherwise uniform: the features of a group describe the same thing. Every row of feature ``f`` has a latent
vector ``z_f[row]`` in the ``k``-dimensional subspace of its group (``R^(G k)``, groups' subspaces
orthogonal) and a bias. The teacher's logit is::

    logit = b0 + s_pair * sum_g sum_{i<j in g} <z_i, z_j> + s_row * sum_f beta_f + s_dense * <w, dense>

so pairs inside a group interact and pairs across groups do not. A model that fits the teacher learns
features of one group in a shared subspace, which the per-sample cosine interaction of DMT 3.3 sees.
Deterministic in ``seed``; samples ``[first, first + n)`` are a function of ``(seed, first, n)``.
"""

from __future__ import annotations

import numpy as np
import torch

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.errors import ConfigError
from embedscale.specs import TableSpec


class PlantedGroups:
    """Click data whose feature interactions live inside planted feature groups (see module docstring).

    Args:
        num_features: F.
        num_groups: G.
        num_rows: rows per table.
        latent_dim: k, the teacher's latent width per group.
        num_dense: dense features.
        pair_scale, row_scale, dense_scale: standard deviations of the three logit parts.
        correlation: probability that a feature's id is its group's entity's row (else uniform): the
            features of a group describe one entity per sample, as a user's or an item's features do.
        context_per_group: features per group whose ids ignore the entity (uniform, independent):
            "context" features whose interactions with the group are genuinely pairwise (a function of
            two independent ids, which no single feature's bias can absorb).
        seed: the data seed (groups, teacher, samples).

    Example::

        >>> data = PlantedGroups(num_features=8, num_groups=2, num_rows=50, seed=0)
        >>> batch = data.batch(0, 16)
        >>> batch.sparse.keys[:3], batch.dense.shape, sorted(set(data.group_labels.tolist()))
        (['C1', 'C2', 'C3'], torch.Size([16, 4]), [0, 1])
    """

    def __init__(self, num_features: int = 16, num_groups: int = 4, num_rows: int = 50, latent_dim: int = 2,
                 num_dense: int = 4, pair_scale: float = 1.5, row_scale: float = 0.3, dense_scale: float = 0.4,
                 correlation: float = 0.9, context_per_group: int = 0, seed: int = 0):
        if num_groups <= 0 or num_features < num_groups:
            raise ConfigError(f"planted groups: {num_groups} groups for {num_features} features")
        if num_rows <= 0 or latent_dim <= 0 or num_dense < 0:
            raise ConfigError("planted groups: num_rows and latent_dim must be positive, num_dense >= 0")
        self.num_features, self.num_groups, self.num_rows = num_features, num_groups, num_rows
        self.latent_dim, self.num_dense, self.seed = latent_dim, num_dense, seed
        rng = np.random.default_rng([seed, 0xD47])
        self.feature_names = [f"C{i + 1}" for i in range(num_features)]
        self.group_labels = rng.permutation(np.arange(num_features) % num_groups)
        k = latent_dim
        self.latents = np.zeros((num_features, num_rows, num_groups * k))
        for f in range(num_features):
            g = self.group_labels[f]
            self.latents[f, :, g * k:(g + 1) * k] = rng.standard_normal((num_rows, k)) / np.sqrt(k)
        self.biases = rng.standard_normal((num_features, num_rows))
        if not 0.0 <= correlation <= 1.0:
            raise ConfigError(f"planted groups: correlation must be in [0, 1], got {correlation}")
        self.correlation = float(correlation)
        self.entity_rows = np.stack([rng.permutation(num_rows) for _ in range(num_features)])
        # the first `context_per_group` features of every group (in feature order) ignore the entity
        self.context = np.zeros(num_features, dtype=bool)
        for g in range(num_groups):
            members = np.flatnonzero(self.group_labels == g)
            self.context[members[:context_per_group]] = True
        self.dense_w = rng.standard_normal(num_dense) / max(np.sqrt(num_dense), 1.0)
        # scale the parts on a calibration draw
        ids, dense = self._draw(rng, 4096)
        pair, row, dn = self._parts(ids, dense)
        self.coef = np.array([pair_scale / max(pair.std(), 1e-12), row_scale / max(row.std(), 1e-12),
                              dense_scale / max(dn.std(), 1e-12) if num_dense else 0.0])
        z = self._logit_parts(pair, row, dn)
        self.bias = -float(np.mean(z))

    def tables(self, dim: int) -> list[TableSpec]:
        return [TableSpec(f, self.num_rows, dim) for f in self.feature_names]

    def groups(self) -> list[list[str]]:
        """The planted groups, as feature-name lists."""
        return [[f for f, g in zip(self.feature_names, self.group_labels) if g == q] for q in range(self.num_groups)]

    def _draw(self, rng: np.random.Generator, n: int):
        R, F = self.num_rows, self.num_features
        entity = rng.integers(0, R, (n, self.num_groups))  # one entity per sample and group
        ids = self.entity_rows[np.arange(F)[None, :], entity[:, self.group_labels]]
        noise = (rng.random((n, F)) >= self.correlation) | self.context[None, :]
        ids[noise] = rng.integers(0, R, int(noise.sum()))
        dense = rng.standard_normal((n, self.num_dense))
        return ids, dense

    def _parts(self, ids: np.ndarray, dense: np.ndarray):
        F = self.num_features
        z = self.latents[np.arange(F)[None, :], ids]  # [n, F, G k]
        s = z.sum(1)
        pair = 0.5 * ((s * s).sum(1) - (z * z).sum((1, 2)))  # sum_{i<j} <z_i, z_j>; cross-group terms are 0
        row = self.biases[np.arange(F)[None, :], ids].sum(1)
        dn = dense @ self.dense_w if self.num_dense else np.zeros(len(ids))
        return pair, row, dn

    def _logit_parts(self, pair, row, dn):
        return self.coef[0] * pair + self.coef[1] * row + self.coef[2] * dn

    def batch(self, first: int, n: int) -> Batch:
        """Samples ``[first, first + n)``: dense float32 ``[n, num_dense]``, one-hot sparse, labels."""
        rng = np.random.default_rng([self.seed, 0x5A3, first, n])
        ids, dense = self._draw(rng, n)
        logit = self.bias + self._logit_parts(*self._parts(ids, dense))
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        sparse = JaggedFeatures.from_dense(self.feature_names, torch.from_numpy(ids))
        return Batch(torch.from_numpy(dense.astype(np.float32)), sparse, torch.from_numpy(labels))

    def teacher_logit(self, batch: Batch) -> np.ndarray:
        ids = batch.sparse.values.view(self.num_features, -1).t().numpy()
        return self.bias + self._logit_parts(*self._parts(ids, batch.dense.numpy().astype(np.float64)))

    def batches(self, first: int, n: int, batch_size: int):
        """Consecutive batches covering ``[first, first + n)``."""
        for a in range(first, first + n, batch_size):
            yield self.batch(a, min(batch_size, first + n - a))
