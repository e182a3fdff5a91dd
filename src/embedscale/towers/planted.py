"""Synthetic click data with planted feature groups: the ground truth the tower partitioner must find.

DMT 5.2.3 finds, on production data, that the structure the partitioner captures is "interactions
between dedicated item, item-user, and dedicated user features": features come in groups that describe
one entity each (a user, an item, a context), and the click depends on how the entities interact.
:class:`PlantedGroups` makes data with that structure by construction, so the partitioner's output can
be scored (adjusted Rand index against the planted groups) and the AUC of DMT with the partitioner's
towers compared with naive towers (DMT Table 6).

Model. ``F`` one-hot sparse features in ``G`` groups (the group of each feature drawn at random, sizes as
equal as possible), ``num_rows`` rows per table. Every sample has one *entity* per group, uniform over
``num_rows``. A feature's id is its group entity's row under a fixed per-feature permutation with
probability ``correlation``, otherwise uniform (a noisy view of the entity). Every entity of group ``g``
has a latent vector ``w_g[entity]`` in ``R^k``; every row of every feature has a bias. Two teachers:

* ``interaction="entities"``: the groups' entities interact::

      logit = b0 + s_pair * sum_{g<h} <w_g[u_g], w_h[u_h]> + s_row * sum_f beta_f[id_f] + s_dense * <v, dense>

  Inside a group the features are redundant views of one entity; across groups the entities interact.
  A tower that holds one group can compress it to its entity's ``k``-vector; a tower that mixes groups
  must carry several entities in the same width.
* ``interaction="within"`` (default): the features of a group interact pairwise through per-row latents
  (``sum_g sum_{i<j in g} <z_i[id_i], z_j[id_j]>``, groups in orthogonal subspaces), entities only
  correlate the ids.
* ``interaction="both"``: the sum of the two, each scaled to half the interaction variance.
* ``interaction="group_sums"``: every group is summarised by the *sum* of its features' latents, and
  the groups' summaries interact through a bilinear form per pair of groups::

      s_g = sum_{f in g} z_f[id_f]                       (z_f[row] in R^k, independent per feature)
      logit = b0 + s_pair * sum_{g<h} s_g^T M_gh s_h + s_row * sum_f beta_f[id_f] + s_dense * <v, dense>

  This is DMT 3.2's hierarchical interaction by construction: compress inside a group (a linear map of
  the group's embeddings gives ``s_g`` exactly, DMT Listing 1's ``p`` vector), then interact across groups
  (DLRM's dot of the tower vectors; ``M_gh`` is random, so the tower maps must differ per group). With
  ``correlation=0`` the features of a group carry independent parts of ``s_g``: no feature is a
  redundant view of another, so a tower that mixes groups cannot route around the loss (unlike the
  ``entities`` teacher, where every feature of a group is a noisy copy of the same entity).

Deterministic in ``seed``; samples ``[first, first + n)`` are a function of ``(seed, first, n)``.
"""

from __future__ import annotations

import numpy as np
import torch

from embedscale.data.batch import Batch, JaggedFeatures
from embedscale.errors import ConfigError
from embedscale.specs import TableSpec

INTERACTIONS = ("entities", "within", "both", "group_sums")


class PlantedGroups:
    """Click data with planted feature groups (see the module docstring).

    Args:
        num_features: F.
        num_groups: G.
        num_rows: rows per table (and entities per group).
        latent_dim: k, the width of the teacher's latent vectors.
        num_dense: dense features.
        pair_scale, row_scale, dense_scale: standard deviations of the three logit parts.
        correlation: probability that a feature's id is its group entity's row (else uniform).
        interaction: ``entities``, ``within``, ``both`` or ``group_sums``.
        seed: the data seed (groups, teacher, samples).

    Example::

        >>> data = PlantedGroups(num_features=8, num_groups=2, num_rows=50, seed=0)
        >>> batch = data.batch(0, 16)
        >>> batch.sparse.keys[:3], batch.dense.shape, sorted(set(data.group_labels.tolist()))
        (['C1', 'C2', 'C3'], torch.Size([16, 4]), [0, 1])
    """

    def __init__(self, num_features: int = 16, num_groups: int = 4, num_rows: int = 50, latent_dim: int = 2,
                 num_dense: int = 4, pair_scale: float = 1.5, row_scale: float = 0.3, dense_scale: float = 0.4,
                 correlation: float = 0.9, interaction: str = "within", seed: int = 0):
        if num_groups <= 0 or num_features < num_groups:
            raise ConfigError(f"planted groups: {num_groups} groups for {num_features} features")
        if num_rows <= 0 or latent_dim <= 0 or num_dense < 0:
            raise ConfigError("planted groups: num_rows and latent_dim must be positive, num_dense >= 0")
        if not 0.0 <= correlation <= 1.0:
            raise ConfigError(f"planted groups: correlation must be in [0, 1], got {correlation}")
        if interaction not in INTERACTIONS:
            raise ConfigError(f"planted groups: interaction {interaction!r} is not one of {INTERACTIONS}")
        self.num_features, self.num_groups, self.num_rows = num_features, num_groups, num_rows
        self.latent_dim, self.num_dense, self.seed = latent_dim, num_dense, seed
        self.correlation, self.interaction = float(correlation), interaction
        rng = np.random.default_rng([seed, 0xD47])
        self.feature_names = [f"C{i + 1}" for i in range(num_features)]
        self.group_labels = rng.permutation(np.arange(num_features) % num_groups)
        k = latent_dim
        self.entity_latents = rng.standard_normal((num_groups, num_rows, k)) / np.sqrt(k)
        self.latents = np.zeros((num_features, num_rows, num_groups * k))  # "within" teacher only
        for f in range(num_features):
            g = self.group_labels[f]
            self.latents[f, :, g * k:(g + 1) * k] = rng.standard_normal((num_rows, k)) / np.sqrt(k)
        self.biases = rng.standard_normal((num_features, num_rows))
        self.entity_rows = np.stack([rng.permutation(num_rows) for _ in range(num_features)])
        self.dense_w = rng.standard_normal(num_dense) / max(np.sqrt(num_dense), 1.0)
        if interaction == "group_sums":  # drawn last: the other teachers' draws stay as they were
            self.feature_latents = rng.standard_normal((num_features, num_rows, k)) / np.sqrt(k)
            self.group_forms = rng.standard_normal((num_groups, num_groups, k, k)) / np.sqrt(k)
        # scale the parts on a calibration draw ("both": the two interaction parts get equal shares)
        ent, within, row, dn = self._raw_parts(*self._draw(rng, 4096))

        def inv(x):
            return 1.0 / float(x.std()) if x.std() > 0 else 0.0

        pair = ent * inv(ent) + within * inv(within)
        c_pair = pair_scale * inv(pair)
        self.coef = np.array([c_pair * inv(ent), c_pair * inv(within), row_scale * inv(row),
                              dense_scale * inv(dn) if num_dense else 0.0])
        self.bias = -float(np.mean(self._logit(ent, within, row, dn)))

    def tables(self, dim: int) -> list[TableSpec]:
        return [TableSpec(f, self.num_rows, dim) for f in self.feature_names]

    def groups(self) -> list[list[str]]:
        """The planted groups, as feature-name lists."""
        return [[f for f, g in zip(self.feature_names, self.group_labels) if g == q] for q in range(self.num_groups)]

    def _draw(self, rng: np.random.Generator, n: int):
        R, F = self.num_rows, self.num_features
        entity = rng.integers(0, R, (n, self.num_groups))  # one entity per sample and group
        ids = self.entity_rows[np.arange(F)[None, :], entity[:, self.group_labels]]
        noise = rng.random((n, F)) >= self.correlation
        ids[noise] = rng.integers(0, R, int(noise.sum()))
        dense = rng.standard_normal((n, self.num_dense))
        return ids, entity, dense

    def _raw_parts(self, ids: np.ndarray, entity: np.ndarray, dense: np.ndarray):
        """Unscaled (entity interactions, within-group interactions, row biases, dense) per sample."""
        F, n = self.num_features, len(ids)
        ent = within = np.zeros(n)
        if self.interaction in ("entities", "both"):
            w = self.entity_latents[np.arange(self.num_groups)[None, :], entity]  # [n, G, k]
            s = w.sum(1)
            ent = 0.5 * ((s * s).sum(1) - (w * w).sum((1, 2)))  # sum_{g<h} <w_g, w_h>
        if self.interaction == "group_sums":
            z = self.feature_latents[np.arange(F)[None, :], ids]  # [n, F, k]
            sums = np.stack([z[:, self.group_labels == g].sum(1) for g in range(self.num_groups)], 1)  # [n, G, k]
            for g in range(self.num_groups):
                for h in range(g + 1, self.num_groups):
                    ent = ent + np.einsum("nk,kl,nl->n", sums[:, g], self.group_forms[g, h], sums[:, h])
        if self.interaction in ("within", "both"):
            z = self.latents[np.arange(F)[None, :], ids]  # [n, F, G k]
            s = z.sum(1)
            within = 0.5 * ((s * s).sum(1) - (z * z).sum((1, 2)))  # cross-group terms are 0
        row = self.biases[np.arange(F)[None, :], ids].sum(1)
        dn = dense @ self.dense_w if self.num_dense else np.zeros(n)
        return ent, within, row, dn

    def _logit(self, ent, within, row, dn):
        return self.coef[0] * ent + self.coef[1] * within + self.coef[2] * row + self.coef[3] * dn

    def batch_with_logit(self, first: int, n: int) -> tuple[Batch, np.ndarray]:
        """Samples ``[first, first + n)`` and the teacher's logits."""
        rng = np.random.default_rng([self.seed, 0x5A3, first, n])
        ids, entity, dense = self._draw(rng, n)
        logit = self.bias + self._logit(*self._raw_parts(ids, entity, dense))
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        sparse = JaggedFeatures.from_dense(self.feature_names, torch.from_numpy(ids))
        return Batch(torch.from_numpy(dense.astype(np.float32)), sparse, torch.from_numpy(labels)), logit

    def batch(self, first: int, n: int) -> Batch:
        """Samples ``[first, first + n)``: dense float32 ``[n, num_dense]``, one-hot sparse, labels."""
        return self.batch_with_logit(first, n)[0]

    def batches(self, first: int, n: int, batch_size: int):
        """Consecutive batches covering ``[first, first + n)``."""
        for a in range(first, first + n, batch_size):
            yield self.batch(a, min(batch_size, first + n - a))
