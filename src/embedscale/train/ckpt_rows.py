"""Read only the table rows a rank needs from a checkpoint: the row index of its manifest, and a row reader.

A checkpoint's rank files hold table rows by row id (``train.checkpoint``). A re-sharding restore wants some
rows of each table (a rank's share under its own plan); reading every rank file whole costs every rank the
whole checkpoint. The index says, per rank file and table, which rows the file holds and where: runs
``[first row, end row, position in the file's entry]`` of consecutive row ids, written beside each rank file
when it is written (``rank-XXXXX.index.json``, :func:`write_rank_index`) and gathered into the manifest by
rank 0 (``index``, :func:`collect_index`). A table whose rows do not form runs (more than one run per 64 rows, or
more than 4096 runs) is indexed by its row count only: its reader reads the entry's row ids (8 bytes a row).

:class:`RowReader` opens rank files memory-mapped (``torch.load(..., mmap=True, weights_only=True)``), only
those whose runs hold a wanted row, and gathers the wanted rows of ``weight`` and ``momentum``, so only their
pages are read; ``bytes_read`` counts the bytes of the rows it gathered and of any row ids it had to read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from embedscale.device import HOST
from embedscale.errors import FormatError
from embedscale.io import atomic_write_text

INDEX = "index"  # the manifest's key
SCATTERED = 64  # a table's rows are indexed as runs while runs <= rows / SCATTERED ...
MAX_RUNS = 4096  # ... and at most this many per rank file (the manifest stays small)


def row_runs(rows: np.ndarray) -> list[list[int]] | None:
    """Runs ``[first, end, position]`` of consecutive row ids in ``rows`` (file order), or ``None`` when there
    are more than ``len(rows) / SCATTERED`` of them."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return []
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    if cut.size + 1 > min(MAX_RUNS, max(1, rows.size // SCATTERED)):
        return None
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [rows.size]])
    return [[int(rows[s]), int(rows[e - 1]) + 1, int(s)] for s, e in zip(starts, ends)]


def index_name(shard: str) -> str:
    return shard[:-len(".pt")] + ".index.json" if shard.endswith(".pt") else shard + ".index.json"


def write_rank_index(path: Path, payload: dict) -> None:
    """The index of the rank file ``path`` (written from its ``payload``, nothing read back) beside it."""
    tables = {}
    for name, e in (payload.get("tables") or {}).items():
        if "rows" not in e:  # a delta's bitmap: not indexed (restore reads it whole)
            continue
        rows = e["rows"].numpy()
        tables[name] = {"rows": int(rows.size), "runs": row_runs(rows)}
    atomic_write_text(path.parent / index_name(path.name), json.dumps({"tables": tables}, separators=(",", ":")))


def collect_index(ckpt_dir: Path, shards: list[str]) -> dict | None:
    """The manifest's ``index``: every rank file's index (``None`` when one is missing: no index)."""
    out = {}
    for s in shards:
        p = Path(ckpt_dir) / index_name(s)
        try:
            out[s] = json.loads(p.read_text())["tables"]
        except (OSError, ValueError, KeyError):
            return None
    return out


class RowReader:
    """Rows of a checkpoint's tables by row id, reading only those (module docstring).

    Args:
        ckpt_dir: a complete full checkpoint whose manifest has an ``index``.
        manifest: its manifest (``checkpoint.read_manifest``).
    """

    def __init__(self, ckpt_dir: str | Path, manifest: dict):
        self.dir = Path(ckpt_dir)
        self.index = manifest.get(INDEX)
        if not isinstance(self.index, dict) or manifest.get("delta") is not None:
            raise FormatError(f"{self.dir}: the manifest has no row index (a delta, or written before it)")
        self.num_rows = dict(zip(manifest["tables"], manifest["table_rows"]))
        self._files: dict[str, dict] = {}
        self.bytes_read = 0

    def _file(self, shard: str) -> dict:
        if shard not in self._files:
            path = self.dir / shard
            try:
                self._files[shard] = torch.load(path, map_location=HOST, weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - torch raises many kinds here
                raise FormatError(f"{path}: not a readable checkpoint file ({type(e).__name__}: {e})") from None
        return self._files[shard]

    def read(self, table: str, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight [k, dim], momentum [k] or None)`` of ``rows`` (row ids of ``table``, any order); a row no
        rank file holds is a ``FormatError`` naming table and row."""
        rows = np.asarray(rows, dtype=np.int64)
        n = self.num_rows.get(table)
        if n is None:
            raise FormatError(f"{self.dir}: no table {table!r} in the checkpoint")
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise FormatError(f"{self.dir}: table {table!r}: row {int(rows.max())} outside [0, {n})")
        where_file = np.full(rows.size, -1, dtype=np.int64)
        where_pos = np.zeros(rows.size, dtype=np.int64)
        shards = list(self.index)
        for f, shard in enumerate(shards):
            entry = self.index[shard].get(table)
            if not entry or not entry["rows"]:
                continue
            if entry["runs"] is None:  # scattered: the entry's row ids tell
                ids = self._file(shard)["tables"][table]["rows"].numpy().astype(np.int64, copy=False)
                self.bytes_read += ids.nbytes
                order = np.argsort(ids, kind="stable")
                k = np.searchsorted(ids[order], rows)
                hit = (k < ids.size) & (ids[order][np.minimum(k, ids.size - 1)] == rows)
                where_file[hit], where_pos[hit] = f, order[k[hit]]
                continue
            runs = np.asarray(entry["runs"], dtype=np.int64).reshape(-1, 3)
            k = np.searchsorted(runs[:, 0], rows, side="right") - 1
            ok = k >= 0
            ok[ok] = rows[ok] < runs[k[ok], 1]
            where_file[ok], where_pos[ok] = f, runs[k[ok], 2] + rows[ok] - runs[k[ok], 0]
        if (where_file < 0).any():
            raise FormatError(f"{self.dir}: no rank file holds row {int(rows[where_file < 0][0])} of table {table!r}")
        return self._gather(table, shards, where_file, where_pos)

    def _gather(self, table, shards, where_file, where_pos):
        weight = momentum = None
        for f in np.unique(where_file).tolist():
            e = self._file(shards[f])["tables"][table]
            sel = np.flatnonzero(where_file == f)
            idx = torch.from_numpy(where_pos[sel])
            w = e["weight"].index_select(0, idx)
            if weight is None:
                weight = torch.empty((where_file.size, w.shape[1]), dtype=w.dtype)
                momentum = torch.empty(where_file.size, dtype=e["momentum"].dtype) if "momentum" in e else None
            weight[torch.from_numpy(sel)] = w
            self.bytes_read += w.nbytes
            if momentum is not None:
                m = e["momentum"].index_select(0, idx)
                momentum[torch.from_numpy(sel)] = m
                self.bytes_read += m.nbytes
        if weight is None:  # no rows asked for: empty, shaped as the table's entries
            e = next((self._file(s)["tables"][table] for s in shards if (self.index[s].get(table) or {}).get("rows")),
                     None)
            if e is None:
                return torch.zeros((0, 0)), None
            weight = e["weight"][:0].clone()
            momentum = e["momentum"][:0].clone() if "momentum" in e else None
        return weight, momentum


__all__ = ["INDEX", "RowReader", "collect_index", "row_runs", "write_rank_index"]
