"""The tower partitioner's planning side (TP, DMT section 3.3): the feature-to-tower assignment and the
partition of features into balanced, meaningful towers, from an interaction matrix. numpy and scipy only.

Steps (DMT 3.3, section 5.1 "dot-product based TP on a 2D plane"; step 1, the interaction matrix from a
trained model's embeddings, is :mod:`embedscale.towers.learn`):

2. **Distance matrix** ``D = f(I)`` (:func:`distance_matrix`): the *coherent* strategy ``1 - I`` puts
   similar features together, the *diverse* strategy ``I`` puts dissimilar ones together.
3. **Coordinates**: features embedded in ``R^n`` (``n = 2`` by default, ``n < N``) by minimising
   ``sum_{i<j} (||X_i - X_j|| - D(i, j))^2`` with Adam (:func:`embed_coordinates`; a few seeded
   restarts, the lowest stress kept).
4. **Constrained K-Means** (Bradley, Bennett and Demiriz 2000) with the size constraint
   ``max tower size <= K * min tower size`` (:func:`constrained_kmeans`): the assignment step is a
   minimum-cost assignment of features to tower slots, exact (``scipy.optimize.linear_sum_assignment``).
5. **Refinement** (ours): pairwise swaps between towers while they lower the within-tower distance in
   ``D`` itself (:func:`refine_by_swaps`); of several seeded runs of steps 3-5 the partition with the
   lowest mean within-tower distance is kept (:func:`partition_features`).

Baseline: the naive strided assignment of DMT 5.2.3 (:func:`naive_assignment`): feature ``i`` to tower
``i % T``. :func:`adjusted_rand_index` scores a partition against planted groups. A
:class:`TowerAssignment` is saved as JSON, atomically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.io import atomic_write_json, read_json

STRATEGIES = ("coherent", "diverse")
ASSIGNMENT_VERSION = 1


# --------------------------------------------------------------------------------------------------
# the assignment


@dataclass
class TowerAssignment:
    """Features of every tower, in order. ``towers[t]`` lists tower ``t``'s feature names.

    Example::

        >>> a = TowerAssignment([["C1", "C3"], ["C2"]])
        >>> a.num_towers, a.tower_of("C3"), a.sizes
        (2, 0, [2, 1])
    """

    towers: list[list[str]]
    strategy: str = "manual"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.towers = [list(t) for t in self.towers]
        if not self.towers:
            raise ConfigError("tower assignment: no towers")
        seen: dict[str, int] = {}
        for t, fs in enumerate(self.towers):
            if not fs:
                raise ConfigError(f"tower assignment: tower {t} has no features")
            for f in fs:
                if f in seen:
                    raise ConfigError(f"tower assignment: feature {f!r} is in towers {seen[f]} and {t}")
                seen[f] = t
        self._tower_of = seen

    @property
    def num_towers(self) -> int:
        return len(self.towers)

    @property
    def sizes(self) -> list[int]:
        return [len(t) for t in self.towers]

    @property
    def features(self) -> list[str]:
        return [f for t in self.towers for f in t]

    def tower_of(self, feature: str) -> int:
        try:
            return self._tower_of[feature]
        except KeyError:
            raise ConfigError(f"feature {feature!r} is in no tower; towers hold {sorted(self._tower_of)}") from None

    def labels(self, features: Sequence[str]) -> np.ndarray:
        """Tower of every feature of ``features`` (int array)."""
        return np.array([self.tower_of(f) for f in features], dtype=np.int64)

    def check_covers(self, features: Sequence[str]) -> None:
        """Raise unless the towers hold exactly ``features``."""
        missing = [f for f in features if f not in self._tower_of]
        extra = sorted(set(self._tower_of) - set(features))
        if missing or extra:
            raise ConfigError(f"tower assignment does not match the model's features: missing {missing}, "
                              f"unknown {extra}")

    @classmethod
    def from_labels(cls, features: Sequence[str], labels: Sequence[int], strategy: str = "manual",
                    meta: dict | None = None) -> "TowerAssignment":
        labels = np.asarray(labels)
        T = int(labels.max()) + 1 if labels.size else 0
        return cls([[f for f, l in zip(features, labels) if l == t] for t in range(T)], strategy, meta or {})

    def to_dict(self) -> dict:
        return {"version": ASSIGNMENT_VERSION, "strategy": self.strategy, "towers": self.towers, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "TowerAssignment":
        d = read_json(path, "tower assignment")
        if not isinstance(d, dict) or d.get("version") != ASSIGNMENT_VERSION or "towers" not in d:
            raise FormatError(f"{path}: not a tower assignment of version {ASSIGNMENT_VERSION}")
        try:
            return cls(d["towers"], d.get("strategy", "manual"), d.get("meta", {}))
        except ConfigError as e:
            raise FormatError(f"{path}: {e}") from None


def naive_assignment(features: Sequence[str], num_towers: int) -> TowerAssignment:
    """DMT 5.2.3's baseline: feature ``i`` to tower ``i % T`` (balanced, strided, meaning-blind)."""
    check_towers(len(features), num_towers)
    return TowerAssignment([list(features[t::num_towers]) for t in range(num_towers)], "naive")


def check_towers(F: int, T: int) -> None:
    if isinstance(T, bool) or not isinstance(T, int) or T <= 0:
        raise ConfigError(f"number of towers must be a positive integer, got {T!r}")
    if T > F:
        raise ConfigError(f"{T} towers for {F} features: every tower needs at least one feature")


# --------------------------------------------------------------------------------------------------
# step 2: distance


def distance_matrix(interaction: np.ndarray, strategy: str = "coherent") -> np.ndarray:
    """``D = f(I)``: ``1 - I`` (coherent: similar features together) or ``I`` (diverse), DMT 3.3."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"tower partitioner: strategy {strategy!r} is not one of {STRATEGIES}")
    I = np.asarray(interaction, dtype=np.float64)
    if I.ndim != 2 or I.shape[0] != I.shape[1]:
        raise InputError(f"interaction matrix must be square, got shape {I.shape}")
    D = 1.0 - I if strategy == "coherent" else I.copy()
    D = 0.5 * (D + D.T)
    np.fill_diagonal(D, 0.0)
    return D


# --------------------------------------------------------------------------------------------------
# step 3: coordinates


def embed_coordinates(distance: np.ndarray, dim: int = 2, *, steps: int = 1500, lr: float = 0.05,
                      restarts: int = 4, seed: int = 0) -> tuple[np.ndarray, float]:
    """Coordinates ``X [F, dim]`` whose pairwise distances match ``distance`` (DMT 3.3), by Adam on
    ``sum_{i<j} (||X_i - X_j|| - D_ij)^2``; ``restarts`` seeded random starts, the lowest stress kept.

    The restarts run side by side in one ``[restarts, F, dim]`` array (Adam is elementwise, so each
    start follows exactly the path it would follow alone). Gradient and Adam step are written out in
    numpy (a few whole-array operations per step): the objective's gradient is
    ``dS/dX_i = sum_{j != i} 2 (d_ij - D_ij) (X_i - X_j) / d_ij`` with ``d_ij = sqrt(||X_i - X_j||^2 + 1e-12)``,
    and the step is ``torch.optim.Adam``'s (betas 0.9/0.999, eps 1e-8, bias-corrected), without torch: the
    planner imports none, and autograd on these tiny tensors cost ~1 ms of framework overhead per step (tests
    check the two agree). The starts are standard normals from ``numpy.random.default_rng(seed)``, scaled by
    the mean target distance.

    Returns:
        ``(X, stress)`` with stress the objective divided by ``sum_{i<j} D_ij^2`` (0 = exact).
    """
    D = np.asarray(distance, dtype=np.float64)
    F = D.shape[0]
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ConfigError(f"tower partitioner: coordinate dim must be a positive integer, got {dim!r}")
    iu = np.triu_indices(F, k=1)
    target = D[iu]
    denom = float((target ** 2).sum()) or 1.0
    scale = float(target.mean()) if target.size else 1.0
    R = max(1, restarts)
    X = np.random.default_rng(seed).standard_normal((R, F, dim)) * max(scale, 1e-3)
    step_lr = lr * max(scale, 1e-3)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    m = np.zeros_like(X)
    v = np.zeros_like(X)
    pairs = np.arange(len(target))
    incidence = np.zeros((F, len(target)))  # +1 at i, -1 at j for pair p = (i, j): sums pair terms per point
    incidence[iu[0], pairs] = 1.0
    incidence[iu[1], pairs] = -1.0
    for t in range(1, steps + 1):
        diff = X[:, iu[0]] - X[:, iu[1]]  # [R, P, dim]: X_i - X_j for every pair i < j
        d = np.sqrt(np.einsum("rpk,rpk->rp", diff, diff) + 1e-12)
        g = incidence @ ((2.0 * (d - target) / d)[..., None] * diff)  # [R, F, dim]
        m += (1 - beta1) * (g - m)
        v *= beta2
        v += (1 - beta2) * g * g
        denom_t = np.sqrt(v) / math.sqrt(1 - beta2 ** t) + eps
        X -= (step_lr / (1 - beta1 ** t)) * m / denom_t
    diff = X[:, iu[0]] - X[:, iu[1]]
    st = ((np.sqrt((diff ** 2).sum(2)) - target) ** 2).sum(1) / denom
    best = int(np.argmin(st))  # the first of equal stresses, as sequential restarts would keep
    return X[best].copy(), float(st[best])


# --------------------------------------------------------------------------------------------------
# step 4: constrained K-Means


def size_bounds(num_items: int, k: int, max_ratio: float) -> list[tuple[int, int]]:
    """Every (min size m, max size M) window with ``k m <= F <= k M`` and ``M <= max_ratio * m``."""
    check_towers(num_items, k)
    if not max_ratio >= 1:
        raise ConfigError(f"tower partitioner: max/min tower size ratio must be >= 1, got {max_ratio}")
    out = []
    for m in range(num_items // k, 0, -1):
        M = min(num_items - (k - 1) * m, int(math.floor(max_ratio * m + 1e-9)))
        if k * M >= num_items and M >= m:
            out.append((m, M))
    if not out:
        raise ConfigError(f"no balanced split of {num_items} features into {k} towers has max/min size ratio "
                          f"<= {max_ratio}; the smallest possible is {math.ceil(num_items / k) / (num_items // k):.3g}")
    return out


def _assign(sqdist: np.ndarray, m: int, M: int) -> np.ndarray:
    """Exact min-cost assignment of items to ``k`` clusters with sizes in ``[m, M]``: cluster ``c``
    has ``M`` slots, the first ``m`` of them compulsory (cost lowered by a constant every solution pays
    the same number of times, since all ``k m`` compulsory slots are filled whenever ``F >= k m``)."""
    F, k = sqdist.shape
    big = float(sqdist.max()) * F + 1.0
    cost = np.repeat(sqdist, M, axis=1)  # column c * M + s
    slot = np.tile(np.arange(M), k)
    cost = cost - np.where(slot < m, big, 0.0)[None, :]
    from scipy.optimize import linear_sum_assignment  # scipy on first use: only the towers command assigns

    rows, cols = linear_sum_assignment(cost)
    labels = np.empty(F, dtype=np.int64)
    labels[rows] = cols // M
    return labels


def constrained_kmeans(X: np.ndarray, k: int, max_ratio: float = 1.0, *, n_init: int = 10, max_iter: int = 100,
                       seed: int = 0) -> tuple[np.ndarray, float]:
    """K-Means with cluster sizes bounded so that ``max size <= max_ratio * min size`` (Bradley et al.
    2000, as in DMT 3.3). Every feasible (min, max) size window is tried with ``n_init`` k-means++
    starts; the lowest within-cluster sum of squares wins.

    Returns:
        ``(labels [F], inertia)``; cluster numbers ordered by the smallest member index.
    """
    X = np.asarray(X, dtype=np.float64)
    F = X.shape[0]
    windows = size_bounds(F, k, max_ratio)
    rng = np.random.default_rng(seed)
    best, best_inertia = None, math.inf
    for m, M in windows:
        for _ in range(n_init):
            # k-means++ initialisation
            centers = [X[rng.integers(F)]]
            for _ in range(1, k):
                d2 = np.min(((X[:, None, :] - np.array(centers)[None]) ** 2).sum(2), axis=1)
                p = d2 / d2.sum() if d2.sum() > 0 else np.full(F, 1.0 / F)
                centers.append(X[rng.choice(F, p=p)])
            C = np.array(centers)
            labels = None
            for _ in range(max_iter):
                sq = ((X[:, None, :] - C[None]) ** 2).sum(2)
                new = _assign(sq, m, M)
                if labels is not None and np.array_equal(new, labels):
                    break
                labels = new
                C = np.array([X[labels == c].mean(0) for c in range(k)])
            inertia = float(((X - C[labels]) ** 2).sum())
            if inertia < best_inertia - 1e-12:
                best, best_inertia = labels, inertia
    # canonical numbering: clusters by their first feature
    first = {}
    for i, c in enumerate(best):
        first.setdefault(int(c), len(first))
    return np.array([first[int(c)] for c in best], dtype=np.int64), best_inertia


# --------------------------------------------------------------------------------------------------
# scores


def adjusted_rand_index(a: Sequence[int], b: Sequence[int]) -> float:
    """Adjusted Rand index of two labelings (Hubert and Arabie 1985): 1 = identical partitions, about 0
    for independent ones."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise InputError(f"adjusted_rand_index: labelings of {a.size} and {b.size} items")
    _, ai = np.unique(a, return_inverse=True)
    _, bi = np.unique(b, return_inverse=True)
    table = np.zeros((ai.max() + 1, bi.max() + 1), dtype=np.int64)
    np.add.at(table, (ai, bi), 1)
    from scipy.special import comb  # scipy on first use (see _assign)

    sum_comb = comb(table, 2).sum()
    sa = comb(table.sum(1), 2).sum()
    sb = comb(table.sum(0), 2).sum()
    total = comb(a.size, 2)
    expected = sa * sb / total if total else 0.0
    max_index = 0.5 * (sa + sb)
    if max_index == expected:
        return 1.0
    return float((sum_comb - expected) / (max_index - expected))


def partition_scores(interaction: np.ndarray, labels: Sequence[int]) -> dict:
    """Mean interaction inside towers and across towers, and tower sizes."""
    I = np.asarray(interaction)
    lab = np.asarray(labels)
    same = lab[:, None] == lab[None, :]
    off = ~np.eye(len(lab), dtype=bool)
    within = float(I[same & off].mean()) if (same & off).any() else float("nan")
    across = float(I[~same].mean()) if (~same).any() else float("nan")
    sizes = np.bincount(lab).tolist()
    return {"within_tower_interaction": within, "cross_tower_interaction": across, "sizes": sizes,
            "max_min_ratio": max(sizes) / min(sizes)}


# --------------------------------------------------------------------------------------------------
# the pipeline


def within_tower_distance(distance: np.ndarray, labels: Sequence[int]) -> float:
    """Mean distance ``D(i, j)`` over the pairs that share a tower (what the partition minimises)."""
    lab = np.asarray(labels)
    same = (lab[:, None] == lab[None, :]) & ~np.eye(len(lab), dtype=bool)
    return float(np.asarray(distance)[same].mean()) if same.any() else 0.0


def refine_by_swaps(distance: np.ndarray, labels: Sequence[int], max_swaps: int = 10_000) -> tuple[np.ndarray, int]:
    """Local search on the partition's own target: while some exchange of two features between two towers
    lowers the sum of within-tower distances ``sum_t sum_{i<j in t} D(i, j)``, make the best one.

    Tower sizes never change (the constrained K-Means chose them), so the mean within-tower distance falls
    with the sum. The gain of swapping ``i`` (tower ``a``) and ``j`` (tower ``b``) is
    ``S[i, a] + S[j, b] - S[i, b] - S[j, a] + 2 D(i, j)`` with ``S[i, t] = sum_{k in t} D(i, k)``, all pairs
    at once. Ends in a partition no single swap improves (a 2-opt local optimum).

    Returns:
        ``(labels, swaps made)``.
    """
    D = np.asarray(distance, dtype=np.float64)
    lab = np.array(labels, dtype=np.int64)
    k = int(lab.max()) + 1
    swaps = 0
    for swaps in range(max_swaps + 1):
        onehot = np.eye(k)[lab]  # [F, k]
        S = D @ onehot  # S[i, t]
        own = S[np.arange(len(lab)), lab]
        # gain[i, j]: S[i,a] + S[j,b] - S[i,b] - S[j,a] + 2 D_ij with a = lab[i], b = lab[j]
        gain = own[:, None] + own[None, :] - S[:, lab] - S[:, lab].T + 2 * D
        gain[lab[:, None] == lab[None, :]] = 0.0
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[i, j] <= 1e-12 * max(1.0, float(np.abs(D).max())):
            break
        lab[i], lab[j] = lab[j], lab[i]
    return lab, swaps


def _canonical(labels: np.ndarray) -> np.ndarray:
    """Clusters numbered by their first feature."""
    first: dict[int, int] = {}
    for c in labels:
        first.setdefault(int(c), len(first))
    return np.array([first[int(c)] for c in labels], dtype=np.int64)


def partition_features(features: Sequence[str], interaction: np.ndarray, num_towers: int, *,
                       strategy: str = "coherent", max_ratio: float = 1.0, coord_dim: int = 2, seed: int = 0,
                       steps: int = 1500, restarts: int = 8, n_init: int = 20, trials: int = 4,
                       refine: bool = True, random_starts: int = 64) -> tuple[TowerAssignment, dict]:
    """DMT 3.3 steps 2-4 on a given interaction matrix: distance, coordinates, constrained K-Means.

    ``trials`` runs of coordinates + K-Means (seeds ``seed .. seed + trials - 1``) guard against the
    local optima of both; each partition is then refined by :func:`refine_by_swaps` on ``D`` itself (the
    quantity the 2-D coordinates only approximate), and so are ``random_starts`` random partitions with
    the tower sizes of the best one (a multi-start local search: the K-Means starts of several trials
    can all fall into the same local optimum). The partition with the smallest mean within-tower
    distance in ``D`` is kept. Refinement, random starts and selection are ours, not DMT's:
    ``refine=False`` gives DMT's pipeline alone (best of the trials), which on planted groups misses by a
    swapped pair or two in about one trained model in five (``benchmarks/results/dmt.md``).
    """
    features = list(features)
    I = np.asarray(interaction, dtype=np.float64)
    if I.shape != (len(features), len(features)):
        raise InputError(f"interaction matrix of shape {I.shape} for {len(features)} features")
    check_towers(len(features), num_towers)
    D = distance_matrix(I, strategy)
    best = None
    for t in range(max(1, trials)):
        X, stress = embed_coordinates(D, coord_dim, steps=steps, restarts=restarts, seed=seed + t)
        labels, inertia = constrained_kmeans(X, num_towers, max_ratio, n_init=n_init, seed=seed + t)
        kmeans_score = within_tower_distance(D, labels)
        swaps = 0
        if refine:
            labels, swaps = refine_by_swaps(D, labels)
            labels = _canonical(labels)
        score = within_tower_distance(D, labels)
        if best is None or score < best[0] - 1e-12:
            best = (score, X, stress, labels, inertia, seed + t, kmeans_score, swaps, "kmeans")
    if refine and random_starts > 0:
        rng = np.random.default_rng([seed, 0x5EED])
        best_labels = best[3]
        for _ in range(random_starts):  # a random partition with the same tower sizes
            labels, swaps = refine_by_swaps(D, rng.permutation(best_labels))
            labels = _canonical(labels)
            score = within_tower_distance(D, labels)
            if score < best[0] - 1e-12:
                best = best[:3] + (labels,) + best[4:7] + (swaps, "random start")
    score, X, stress, labels, inertia, used_seed, kmeans_score, swaps, origin = best
    meta = {"strategy": strategy, "max_ratio": max_ratio, "coord_dim": coord_dim, "stress": stress,
            "inertia": inertia, "seed": used_seed, "within_tower_distance": score,
            "kmeans_within_tower_distance": kmeans_score, "refinement_swaps": swaps, "best_from": origin}
    assignment = TowerAssignment.from_labels(features, labels, strategy, meta)
    naive = naive_assignment(features, num_towers)
    report = {
        "features": features, "num_towers": num_towers, "strategy": strategy, "max_ratio": max_ratio,
        "stress": stress, "inertia": inertia, "within_tower_distance": score,
        "kmeans_within_tower_distance": kmeans_score, "refinement_swaps": swaps, "best_from": origin,
        "coordinates": X.tolist(),
        "towers": assignment.towers, "interaction": I.tolist(), **partition_scores(I, labels),
        "naive": {"towers": naive.towers, "within_tower_distance": within_tower_distance(D, naive.labels(features)),
                  **partition_scores(I, naive.labels(features))},
    }
    return assignment, report
