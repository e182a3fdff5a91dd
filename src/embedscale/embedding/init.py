"""Placement-independent row initialisation.

Every row's initial value is a pure function of ``(seed, table index, row id)`` (a counter-based hash,
splitmix64), so a row starts with the same value whichever rank owns it, however a table is sharded,
and whether it is built in one process or across many: single-process and N-rank training start from
the same model, and a re-sharded run can re-create any row without the others.

The distribution is the DLRM reference's: uniform in ``[-1/sqrt(num_rows), 1/sqrt(num_rows)]``.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def uniform_rows(seed: int, table_index: int, rows: np.ndarray, dim: int, num_rows: int,
                 chunk: int = 1 << 20) -> np.ndarray:
    """float32 ``[len(rows), dim]``: the initial values of ``rows`` of table ``table_index``."""
    rows = np.asarray(rows, dtype=np.uint64)
    bound = 1.0 / np.sqrt(max(num_rows, 1))
    out = np.empty((rows.size, dim), dtype=np.float32)
    key = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(1000003) + np.uint64(table_index))
    cols = np.arange(dim, dtype=np.uint64)
    for a in range(0, rows.size, chunk):
        r = rows[a:a + chunk]
        with np.errstate(over="ignore"):
            x = _splitmix64(_splitmix64(key ^ r)[:, None] + cols[None, :] * _GOLDEN)
        u = (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # [0, 1)
        out[a:a + chunk] = ((2.0 * u - 1.0) * bound).astype(np.float32)
    return out
