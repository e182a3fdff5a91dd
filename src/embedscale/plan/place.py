"""Balanced model parallelism (OPER section 4.2).

Access-bound partitions are placed first, largest lookup load first, each on the rank with the lowest
lookup workload ``E_j`` (eq. 2); then memory-bound partitions, largest first, each on the rank with
the lowest memory ``M_j`` (eq. 1), ties broken by the lower lookup workload. A rank whose capacity the
partition would exceed is skipped; a partition no rank can take is a ``ConfigError``.

The loop runs over partitions (a few thousand), each step an ``argmin`` over ranks.
"""

from __future__ import annotations

import numpy as np

from embedscale.errors import ConfigError


def lookup_cost_per_partition(part_access: np.ndarray, part_row_bytes: np.ndarray, local_cost: np.ndarray,
                              world_size: int) -> np.ndarray:
    """``[P, M]`` eq. (2) cost of serving a partition from rank ``j`` when every rank reads it there:
    ``M * A_p * S_p * L[j][j]``."""
    return (world_size * part_access * part_row_bytes)[:, None] * local_cost[None, :]


def balanced_model_parallel(
    lookup: np.ndarray,
    nbytes: np.ndarray,
    access_bound: np.ndarray,
    capacity: np.ndarray,
    base_lookup: np.ndarray | None = None,
    base_memory: np.ndarray | None = None,
    describe=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OPER 4.2: owners for partitions.

    Args:
        lookup: ``[P, M]`` lookup cost of each partition on each rank (``lookup_cost_per_partition``).
        nbytes: ``[P]`` footprint.
        access_bound: ``[P]`` bool, from the partitioning (4.1).
        capacity: ``[M]`` bytes each rank may still take (``inf`` for none).
        base_lookup, base_memory: ``[M]`` load already on the ranks (e.g. rows replicated everywhere).
        describe: ``describe(p) -> str`` names a partition in errors.

    Returns:
        ``(owner [P], lookup per rank [M], memory per rank [M])``.
    """
    p, m = lookup.shape
    e = np.zeros(m) if base_lookup is None else np.asarray(base_lookup, dtype=np.float64).copy()
    mem = np.zeros(m) if base_memory is None else np.asarray(base_memory, dtype=np.float64).copy()
    cap = np.asarray(capacity, dtype=np.float64)
    owner = np.full(p, -1, dtype=np.int32)
    ab = np.flatnonzero(access_bound)
    mb = np.flatnonzero(~access_bound)
    first = ab[np.argsort(-lookup[ab].max(axis=1), kind="stable")]
    # memory-bound: biggest first; among equal sizes, the hotter first
    second = mb[np.lexsort((-lookup[mb].max(axis=1), -nbytes[mb]))]
    for phase, seq in ((0, first), (1, second)):
        for q in seq.tolist():
            b = nbytes[q]
            ok = mem + b <= cap
            if not ok.any():
                what = describe(q) if describe else f"partition {q}"
                j = int(np.argmax(cap - mem))
                raise ConfigError(
                    f"{what} ({int(b)} bytes) fits on no rank: the most free memory is {int(cap[j] - mem[j])} bytes on rank {j} "
                    f"(memory per rank {mem.astype(np.int64).tolist()}, capacity {cap.tolist()})"
                )
            if phase == 0:
                key = np.where(ok, e, np.inf)
                j = int(np.argmin(key))
            else:
                mkey = np.where(ok, mem, np.inf)
                lo = mkey.min()
                tie = np.flatnonzero(mkey == lo)
                j = int(tie[np.argmin(e[tie])]) if tie.size > 1 else int(tie[0])
            owner[q] = j
            e[j] += lookup[q, j]
            mem[j] += b
    return owner, e, mem
