"""What the sharded embedding puts on the wire per iteration, predicted from a plan and an access profile.

OPER's eq. (3) charges every access of a remote row. The executor (``embedding.sharded``) fetches a
remote row once per iteration however often the rank's mini-batch reads it (deduplication per source
rank, OPER 5.1), so its traffic is the expected number of *distinct* remote rows a rank touches. If a
table sees ``n`` lookups per rank per iteration, each reading row ``k`` with probability ``p_k`` (its
share of the table's accesses in the profile), row ``k`` appears in the rank's batch with probability

    u_k = 1 - (1 - p_k) ** n,

and rank ``i`` sends, per iteration, for the retrieve design,

    sum over rows k it reads from a peer j != i:  u_k * (8 [id] + S_k [row back] + S_k [gradient, training])

with ``S_k`` the row's bytes. The figures are totals over all ranks of the bytes sent (the transport's
``ByteCounter`` counts the same); gradient synchronisation of replicas is reported apart, except with
``grad_sync="alltoall"`` (``embedding.sharded``), where it rides in the same all-to-alls: every rank sends
each of its ``W - 1`` peers the slot and the gradient of every replica row its batch read,

    sum over replica rows k:  u_k * (W - 1) * (8 + S_k)   per rank (``replica_sync``, in the total).
"""

from __future__ import annotations

import numpy as np

ID_BYTES = 8


def expected_wire_bytes(amap, tables, profile, lookups_per_rank: dict[str, float] | float, *,
                        mode: str = "training", grad_sync: str = "local_aggregated") -> dict:
    """Expected bytes sent per iteration by all ranks together for the retrieve design.

    Args:
        amap: the ``AddressMap`` the executor runs.
        tables: the table specs (row bytes).
        profile: per-row access counts (``.counts(table)``) of the data the batches come from.
        lookups_per_rank: per table (or one number for all), ids a rank looks up per iteration
            (local batch size x mean pooling factor x features reading the table).
        mode: ``training`` (rows and gradients) or ``inference`` (rows only).
        grad_sync: the executor's replica synchronisation; ``alltoall`` adds its bytes to the total.

    Returns:
        ``{"total": bytes, "ids": ..., "rows": ..., "grads": ..., "replica_sync": ..., "per_rank": [...]}``.
    """
    W = amap.world_size
    per_rank = np.zeros(W)
    ids = rows = grads = sync = 0.0
    fused = mode == "training" and grad_sync == "alltoall"
    for t, spec in enumerate(tables):
        c = np.asarray(profile.counts(spec.name), dtype=np.float64)
        total = c.sum()
        if total == 0:
            continue
        n = lookups_per_rank[spec.name] if isinstance(lookups_per_rank, dict) else float(lookups_per_rank)
        u = -np.expm1(n * np.log1p(-np.minimum(c / total, 1.0)))  # P(row in a rank's batch)
        gids = amap.table_base[t] + np.arange(spec.num_rows)
        for rank in range(W):
            src, _, slot = amap.fetch(rank, gids)
            remote = src != rank
            if fused:
                b_sync = float(u[slot >= 0].sum()) * (W - 1) * (ID_BYTES + spec.row_bytes)
                sync += b_sync
                per_rank[rank] += b_sync
            e = float(u[remote].sum())
            b_rows = e * spec.row_bytes
            b_grads = b_rows if mode == "training" else 0.0
            ids += e * ID_BYTES
            rows += b_rows
            grads += b_grads
            per_rank[rank] += e * ID_BYTES + b_grads  # what this rank sends: ids and gradients ...
            # ... and the rows its peers send back to it are sent by the owners:
            per_rank += np.bincount(src[remote], weights=u[remote] * spec.row_bytes, minlength=W)
    return {"total": ids + rows + grads + sync, "ids": ids, "rows": rows, "grads": grads, "replica_sync": sync,
            "per_rank": per_rank.tolist()}
