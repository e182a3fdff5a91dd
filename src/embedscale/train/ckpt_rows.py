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

On an object store (``embedscale.storage``) there is no memory map: the index also says where each table
entry's ``rows``, ``weight`` and ``momentum`` lie in the rank file (``at``: byte offset, dtype, shape; found
when the file is written, by loading its structure without its data and checking the bytes there against the
tensor), and the reader fetches the wanted rows as byte ranges. :func:`read_remote_shard` reads a remote rank
file without its tables' rows (every other byte range, into a sparse temporary file that ``torch.load``
maps), so a restore's dense state, optimizer state and run position cost their own bytes only.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from embedscale.device import HOST
from embedscale.errors import EmbedscaleError, FormatError
from embedscale.storage import ObjectPath, location, write_bytes

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


TENSORS = ("rows", "weight", "momentum")  # a table entry's tensors whose place in the file the index gives


def write_rank_index(path: Path | ObjectPath, payload: dict, written=None) -> None:
    """The index of the rank file ``path`` (written from its ``payload``) beside it; with ``written`` (the file's
    bytes, or its local path) the byte ranges of the tables' tensors too (module docstring)."""
    tables = {}
    for name, e in (payload.get("tables") or {}).items():
        if "rows" not in e:  # a delta's bitmap: not indexed (restore reads it whole)
            continue
        rows = e["rows"].numpy()
        tables[name] = {"rows": int(rows.size), "runs": row_runs(rows)}
    if written is not None and tables:
        for name, at in tensor_places(written, payload, list(tables)).items():
            tables[name]["at"] = at
    write_bytes(location(path).parent / index_name(location(path).name),
                json.dumps({"tables": tables}, separators=(",", ":")).encode())


def tensor_places(written, payload: dict, names: list[str]) -> dict:
    """``{table: {tensor: {"offset", "dtype", "shape"}}}``: where the contiguous tensors of ``payload``'s table
    entries lie in the rank file ``written`` (its bytes or its local path), from its structure loaded without
    data; each place is checked against the tensor's first and last bytes, and left out when it does not match
    (a reader then reads that file whole)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        src = io.BytesIO(written) if not isinstance(written, (str, Path)) else written
        with FakeTensorMode():
            fake = torch.load(src, weights_only=True)
    except Exception:  # noqa: BLE001 - no structure: no places (the index's runs still hold)
        return {}
    out: dict = {}
    for name in names:
        for key in TENSORS:
            real, f = payload["tables"][name].get(key), (fake.get("tables") or {}).get(name, {}).get(key)
            off = getattr(f.untyped_storage(), "_checkpoint_offset", None) if f is not None else None
            if off is None or not real.is_contiguous() or not f.is_contiguous():
                continue
            off = int(off) + f.storage_offset() * f.element_size()
            if _matches(written, off, real):
                out.setdefault(name, {})[key] = {"offset": off, "dtype": str(real.dtype).removeprefix("torch."),
                                                 "shape": list(real.shape)}
    return out


def _matches(written, offset: int, t: torch.Tensor) -> bool:
    """Whether the bytes of ``written`` at ``offset`` start and end as ``t``'s do."""
    flat = t.detach().reshape(-1)
    if flat.numel() <= 1:  # a one-element or empty tensor may carry any stride (0): a fresh copy has stride 1
        flat = torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat)
    raw = flat.view(torch.uint8).numpy()
    k = min(64, raw.size)
    heads = [(offset, raw[:k]), (offset + raw.size - k, raw[raw.size - k:])]
    if isinstance(written, (str, Path)):
        with open(written, "rb") as f:
            got = []
            for o, want in heads:
                f.seek(o)
                got.append(f.read(k))
    else:
        mv = memoryview(written)
        got = [bytes(mv[o:o + k]) for o, _ in heads]
    return all(g == w.tobytes() for g, (_, w) in zip(got, heads))


def read_remote_shard(path: ObjectPath, skip: dict | None = None) -> dict:
    """A remote rank file (``torch.load(..., weights_only=True)``): whole, or without the table entries' tensors
    (``rows``, ``weight``, ``momentum``) whose places ``skip`` (the file's entry of the manifest index) gives.
    Those byte ranges are not fetched: the rest lands in a sparse temporary file that ``torch.load`` maps, and
    the skipped tensors are removed from the result (never zeros in their place)."""
    holes = sorted((int(a["offset"]), int(a["offset"]) + _nbytes(a), name, key)
                   for name, e in (skip or {}).items() for key, a in (e.get("at") or {}).items())
    if not holes:
        return torch.load(io.BytesIO(path.read_bytes()), map_location=HOST, weights_only=True)
    size, starts, ends, at = path.size(), [], [], 0
    for lo, hi, _, _ in holes:
        if lo > at:
            starts.append(at)
            ends.append(lo)
        at = max(at, hi)
    if at < size:
        starts.append(at)
        ends.append(size)
    parts = path.read_ranges(starts, ends)
    with tempfile.NamedTemporaryFile(prefix="embedscale-shard-", suffix=".pt") as f:
        f.truncate(size)
        for s, b in zip(starts, parts):
            f.seek(s)
            f.write(b)
        f.flush()
        payload = torch.load(f.name, map_location=HOST, weights_only=True, mmap=True)
    for _, _, name, key in holes:
        payload["tables"][name].pop(key, None)
    return payload


def _rows_of(at: dict, parts: list[bytes], pos: np.ndarray, order: np.ndarray, sp: np.ndarray) -> torch.Tensor:
    """The rows at positions ``pos`` of the tensor placed at ``at``, from the byte ranges ``parts`` of its runs of
    distinct sorted positions (``sp`` = ``pos[order]``)."""
    dtype, inner = getattr(torch, at["dtype"]), list(at["shape"][1:])
    if pos.size == 0:
        return torch.empty([0, *inner], dtype=dtype)
    flat = torch.frombuffer(bytearray(b"".join(parts)), dtype=dtype).reshape([-1, *inner])
    if pos.size < 2 or (np.diff(pos) > 0).all():  # ascending, each row once (a rank's runs): as fetched
        return flat
    out = torch.empty([pos.size, *inner], dtype=dtype)
    out[torch.from_numpy(order)] = flat[torch.from_numpy(np.searchsorted(np.unique(sp), sp))]  # repeats: once
    return out


def _nbytes(at: dict) -> int:
    return int(np.prod(at["shape"], dtype=np.int64)) * getattr(torch, at["dtype"]).itemsize


def collect_index(ckpt_dir: Path, shards: list[str]) -> dict | None:
    """The manifest's ``index``: every rank file's index (``None`` when one is missing: no index)."""
    out = {}
    for s in shards:
        p = location(ckpt_dir) / index_name(s)
        try:
            out[s] = json.loads(p.read_text())["tables"]
        except (OSError, ValueError, KeyError, EmbedscaleError):
            return None
    return out


class RowReader:
    """Rows of a checkpoint's tables by row id, reading only those (module docstring).

    Args:
        ckpt_dir: a complete full checkpoint whose manifest has an ``index``.
        manifest: its manifest (``checkpoint.read_manifest``).
    """

    def __init__(self, ckpt_dir: str | Path, manifest: dict):
        self.dir = location(ckpt_dir)
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
                self._files[shard] = (read_remote_shard(path) if isinstance(path, ObjectPath) else
                                      torch.load(path, map_location=HOST, weights_only=True, mmap=True))
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
                ids = self._tensors(shard, table, ("rows",), None)[0].numpy().astype(np.int64, copy=False)
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

    def _tensors(self, shard: str, table: str, keys: tuple[str, ...], pos: np.ndarray | None) -> list:
        """Entries ``keys`` of ``table`` in rank file ``shard``, their rows at positions ``pos`` (all: ``None``);
        ``None`` for a tensor the entry lacks. Remote with places in the index: the byte ranges of those rows
        only, every key's in one batch of ranged reads."""
        at = (self.index[shard].get(table) or {}).get("at") or {}
        ranged = isinstance(self.dir, ObjectPath) and "weight" in at and \
            all(k in at for k in keys if k != "momentum")  # no momentum place: the entry has none (SGD)
        if not ranged:
            e = self._file(shard)["tables"][table]
            return [None if k not in e else e[k] if pos is None else e[k].index_select(0, torch.from_numpy(pos))
                    for k in keys]
        places = [at.get(k) for k in keys]
        some = next(a for a in places if a is not None)
        pos = np.arange(some["shape"][0]) if pos is None else np.asarray(pos, dtype=np.int64)
        order = np.argsort(pos, kind="stable")
        sp = pos[order]
        cut = np.flatnonzero(np.diff(sp) > 1) + 1  # runs of neighbouring rows: one range each
        lo = sp[np.concatenate([[0], cut])] if sp.size else sp
        hi = sp[np.concatenate([cut - 1, [sp.size - 1]])] + 1 if sp.size else sp
        starts, ends = [], []
        for a in places:
            if a is not None:
                row = _nbytes({**a, "shape": [1, *a["shape"][1:]]})
                starts += (a["offset"] + lo * row).tolist()
                ends += (a["offset"] + hi * row).tolist()
        parts = iter((self.dir / shard).read_ranges(starts, ends))
        return [None if a is None else _rows_of(a, [next(parts) for _ in range(lo.size)], pos, order, sp)
                for a in places]

    def _gather(self, table, shards, where_file, where_pos):
        weight = momentum = None
        for f in np.unique(where_file).tolist():
            sel = np.flatnonzero(where_file == f)
            w, m = self._tensors(shards[f], table, ("weight", "momentum"), where_pos[sel])
            if weight is None:
                weight = torch.empty((where_file.size, w.shape[1]), dtype=w.dtype)
                momentum = torch.empty(where_file.size, dtype=m.dtype) if m is not None else None
            weight[torch.from_numpy(sel)] = w
            self.bytes_read += w.nbytes
            if momentum is not None:
                momentum[torch.from_numpy(sel)] = m
                self.bytes_read += m.nbytes
        if weight is None:  # no rows asked for: empty, shaped as the table's entries
            s = next((s for s in shards if (self.index[s].get(table) or {}).get("rows")), None)
            if s is None:
                return torch.zeros((0, 0)), None
            none = np.zeros(0, dtype=np.int64)
            weight, momentum = self._tensors(s, table, ("weight", "momentum"), none)
        return weight, momentum


__all__ = ["INDEX", "RowReader", "collect_index", "row_runs", "write_rank_index"]
