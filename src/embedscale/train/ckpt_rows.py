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

A re-sharding restore on N ranks (:meth:`RowReader.restore` with the ranks' CPU group) reads those other bytes
once over the ranks, not once per rank: the bytes of every rank file beside its tables' rows form one sequence,
each rank fetches 1/N of it (:func:`spread_ranges`) in the same batch as its rows (``storage.fetch_ranges``:
nearby ranges coalesced, requests concurrent), and one all_gather hands every rank the rest. A rank then reads
its rows plus 1/N of the rest: about its share of the checkpoint, where reading the dense state on every rank
cost N times it. The manifest's ``shard_bytes`` (the rank files' sizes) spare a size request per file. A delta
checkpoint's own rank files (no index: every rank needs its rows that changed) are read whole the same way, once
over the ranks (:func:`read_spread`); ``checkpoint.read_rows`` then reads from its base only the rows it lacks.
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
from embedscale.storage import ObjectPath, fetch_ranges, location, write_bytes

INDEX = "index"  # the manifest's key
SIZES = "shard_bytes"  # the manifest's key of the rank files' sizes (a restore then asks the store for none)
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
    extra = {}
    if written is not None:
        extra["bytes"] = Path(written).stat().st_size if isinstance(written, (str, Path)) else len(written)
        if tables:
            for name, at in tensor_places(written, payload, list(tables)).items():
                tables[name]["at"] = at
    write_bytes(location(path).parent / index_name(location(path).name),
                json.dumps({"tables": tables, **extra}, separators=(",", ":")).encode())


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
    holes = _holes(skip)
    if not holes:
        return torch.load(io.BytesIO(path.read_bytes()), map_location=HOST, weights_only=True)
    size = path.size()
    starts, ends = _kept(size, holes)
    return _load_sparse(size, starts, path.read_ranges(starts, ends), holes)


def _holes(skip: dict | None) -> list[tuple[int, int, str, str]]:
    """``(start, end, table, tensor)`` of the table tensors a rank file's index entry ``skip`` places, sorted."""
    return sorted((int(a["offset"]), int(a["offset"]) + _nbytes(a), name, key)
                  for name, e in (skip or {}).items() for key, a in (e.get("at") or {}).items())


def _kept(size: int, holes: list[tuple]) -> tuple[list[int], list[int]]:
    """The byte ranges of a file of ``size`` bytes outside ``holes``."""
    starts, ends, at = [], [], 0
    for lo, hi, *_ in holes:
        if lo > at:
            starts.append(at)
            ends.append(lo)
        at = max(at, hi)
    if at < size:
        starts.append(at)
        ends.append(size)
    return starts, ends


def _load_sparse(size: int, starts: list[int], parts: list[bytes], holes: list[tuple]) -> dict:
    """A rank file of ``size`` bytes from its ranges ``parts`` (at ``starts``), without the tensors in ``holes``:
    written into a sparse temporary file that ``torch.load`` maps; the tensors of the holes removed."""
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


def collect_index(ckpt_dir: Path, shards: list[str]) -> tuple[dict | None, list[int] | None]:
    """The manifest's ``index`` (every rank file's; ``None`` when one is missing: no index) and ``shard_bytes``
    (the rank files' sizes; ``None`` when one is not known)."""
    out, sizes = {}, []
    for s in shards:
        p = location(ckpt_dir) / index_name(s)
        try:
            got = json.loads(p.read_text())
            out[s] = got["tables"]
        except (OSError, ValueError, KeyError, EmbedscaleError):
            return None, None
        sizes.append(got.get("bytes"))
    return out, (sizes if all(isinstance(n, int) for n in sizes) else None)


class RowReader:
    """Rows of a checkpoint's tables by row id, reading only those (module docstring).

    Args:
        ckpt_dir: a complete full checkpoint whose manifest has an ``index``.
        manifest: its manifest (``checkpoint.read_manifest``).
        concurrency: remote byte ranges in flight at once (``None``: the file system's default; 1: one at a time).
    """

    def __init__(self, ckpt_dir: str | Path, manifest: dict, concurrency: int | None = None):
        self.dir = location(ckpt_dir)
        self.index = manifest.get(INDEX)
        if not isinstance(self.index, dict) or manifest.get("delta") is not None:
            raise FormatError(f"{self.dir}: the manifest has no row index (a delta, or written before it)")
        self.num_rows = dict(zip(manifest["tables"], manifest["table_rows"]))
        self.shard_names = list(manifest.get("shards") or self.index)
        self.sizes = dict(zip(self.shard_names, manifest.get(SIZES) or []))  # else asked of the store
        self.concurrency = concurrency
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
        return self.read_many({table: rows})[table]

    def read_many(self, wanted: dict[str, np.ndarray], extra: list[tuple] = ()) -> dict:
        """``{table: (weight, momentum)}`` of the rows ``wanted[table]`` (as :meth:`read`). Every remote byte range
        of every table and rank file goes out in one batch (``storage.fetch_ranges``: nearby ranges coalesced,
        requests concurrent), with the ``extra`` ranges ``(path, start, end)`` a caller adds (their bytes in
        ``self.extra_parts``)."""
        jobs, requests = [], []
        for table, rows in wanted.items():
            shards, where_file, where_pos = self._locate(table, rows)
            for f in np.unique(where_file).tolist():
                sel = np.flatnonzero(where_file == f)
                reqs, finish = self._plan(shards[f], table, ("weight", "momentum"), where_pos[sel])
                jobs.append((table, sel, len(requests), len(reqs), finish))
                requests += reqs
        got = fetch_ranges(requests + list(extra), concurrency=self.concurrency)
        self.extra_parts = got[len(requests):]
        pieces: dict[str, list] = {t: [] for t in wanted}
        for table, sel, at, k, finish in jobs:
            pieces[table].append((sel, *finish(got[at:at + k])))
        return {t: self._assemble(t, len(wanted[t]), pieces[t]) for t in wanted}

    def _locate(self, table: str, rows: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
        """``(rank files, file of each row, its position in the file's entry)``; a row outside the table or held
        by no rank file is a ``FormatError`` naming table and row."""
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
        return shards, where_file, where_pos

    def _tensors(self, shard: str, table: str, keys: tuple[str, ...], pos: np.ndarray | None) -> list:
        """Entries ``keys`` of ``table`` in rank file ``shard``, their rows at positions ``pos`` (all: ``None``);
        ``None`` for a tensor the entry lacks."""
        requests, finish = self._plan(shard, table, keys, pos)
        return finish(fetch_ranges(requests, concurrency=self.concurrency))

    def _plan(self, shard: str, table: str, keys: tuple[str, ...], pos: np.ndarray | None):
        """``(byte ranges, finish)``: the ranges to fetch for :meth:`_tensors` and the function turning their
        bytes into its result. Remote with places in the index: the ranges of those rows only (runs of
        neighbouring positions one range each); otherwise none, the rows taken from the file (local:
        memory-mapped)."""
        at = (self.index[shard].get(table) or {}).get("at") or {}
        ranged = isinstance(self.dir, ObjectPath) and "weight" in at and \
            all(k in at for k in keys if k != "momentum")  # no momentum place: the entry has none (SGD)
        if not ranged:
            def whole(_parts):
                e = self._file(shard)["tables"][table]
                return [None if k not in e else e[k] if pos is None else e[k].index_select(0, torch.from_numpy(pos))
                        for k in keys]
            return [], whole
        places = [at.get(k) for k in keys]
        some = next(a for a in places if a is not None)
        pos = np.arange(some["shape"][0]) if pos is None else np.asarray(pos, dtype=np.int64)
        order = np.argsort(pos, kind="stable")
        sp = pos[order]
        cut = np.flatnonzero(np.diff(sp) > 1) + 1  # runs of neighbouring rows: one range each
        lo = sp[np.concatenate([[0], cut])] if sp.size else sp
        hi = sp[np.concatenate([cut - 1, [sp.size - 1]])] + 1 if sp.size else sp
        path, requests = self.dir / shard, []
        for a in places:
            if a is not None:
                row = _nbytes({**a, "shape": [1, *a["shape"][1:]]})
                requests += [(path, s, e) for s, e in zip((a["offset"] + lo * row).tolist(),
                                                          (a["offset"] + hi * row).tolist())]

        def finish(parts):
            it = iter(parts)
            return [None if a is None else _rows_of(a, [next(it) for _ in range(lo.size)], pos, order, sp)
                    for a in places]
        return requests, finish

    def _assemble(self, table: str, k: int, pieces: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``k`` rows of ``table`` from ``pieces`` ``(positions among them, weight, momentum)``."""
        weight = momentum = None
        for sel, w, m in pieces:
            if weight is None:
                weight = torch.empty((k, w.shape[1]), dtype=w.dtype)
                momentum = torch.empty(k, dtype=m.dtype) if m is not None else None
            weight[torch.from_numpy(sel)] = w
            self.bytes_read += w.nbytes
            if momentum is not None:
                momentum[torch.from_numpy(sel)] = m
                self.bytes_read += m.nbytes
        if weight is None:  # no rows asked for: empty, shaped as the table's entries
            s = next((s for s in self.index if (self.index[s].get(table) or {}).get("rows")), None)
            if s is None:
                return torch.zeros((0, 0)), None
            weight, momentum = self._tensors(s, table, ("weight", "momentum"), np.zeros(0, dtype=np.int64))
        return weight, momentum

    def restore(self, wanted: dict[str, np.ndarray], group=None) -> tuple[list[dict], dict]:
        """A re-sharding restore's reads: ``(rank files without their tables' rows, read_many(wanted))``. With
        ``group`` (a CPU process group of every rank restoring), the rank files' other bytes (dense and optimizer
        state, run position) are read once over the group: each rank fetches 1/N of them, in the same batch as
        its rows, and one all_gather hands every rank the rest (:func:`spread_ranges`)."""
        import torch.distributed as dist

        if group is None or dist.get_world_size(group) == 1:
            shards = [read_shard(self.dir / s, self.index.get(s)) for s in self.shard_names]
            return shards, self.read_many(wanted)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        error, rows, files, sizes = None, {}, [], []
        try:
            files = [self._layout(s) for s in self.shard_names]
            mine, sizes = spread_ranges(files, rank, world)
            rows = self.read_many(wanted, extra=mine)
        except Exception as e:  # noqa: BLE001 - told to every rank before anyone waits in the all_gather
            error = e
        agree_read(error, group, self.dir)
        everything = _all_gather_bytes(b"".join(self.extra_parts), sizes, group)
        return [_sparse_file(f, parts) for f, parts in zip(files, _split_back(files, everything))], rows

    def _layout(self, shard: str) -> tuple:
        """``(path, size, kept starts, kept ends, holes)`` of a rank file: the bytes outside its tables' rows."""
        path = self.dir / shard
        size = self.sizes.get(shard) or (path.size() if isinstance(path, ObjectPath) else path.stat().st_size)
        holes = _holes(self.index.get(shard))
        return (path, size, *_kept(size, holes), holes)


def read_spread(paths: list, group, where) -> list[dict]:
    """Rank files read whole, once over the ranks of ``group`` (a CPU process group of every rank restoring):
    each rank fetches 1/N of their bytes (:func:`spread_ranges`), one all_gather hands every rank the rest. Without
    a group (or a group of one): each file read as :func:`read_shard` reads it."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return [read_shard(p) for p in paths]
    error, files, sizes, got = None, [], [], []
    try:
        for p in map(location, paths):
            size = p.size() if isinstance(p, ObjectPath) else p.stat().st_size
            files.append((p, size, [0], [size], []))
        mine, sizes = spread_ranges(files, dist.get_rank(group), dist.get_world_size(group))
        got = fetch_ranges(mine)
    except Exception as e:  # noqa: BLE001 - told to every rank before anyone waits in the all_gather
        error = e
    agree_read(error, group, where)
    everything = _all_gather_bytes(b"".join(got), sizes, group)
    return [_sparse_file(f, parts) for f, parts in zip(files, _split_back(files, everything))]


def _sparse_file(layout: tuple, parts: list[bytes]) -> dict:
    """A rank file from the bytes ``parts`` of its kept ranges (``layout``: ``(path, size, starts, ends, holes)``)."""
    path, size, starts, _, holes = layout
    try:
        payload = _load_sparse(size, starts, parts, holes)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds here
        raise FormatError(f"{path}: not a readable checkpoint file ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or "rank" not in payload:
        raise FormatError(f"{path}: not an embedscale checkpoint rank file")
    return payload


def spread_ranges(files: list[tuple], rank: int, world: int) -> tuple[list[tuple], list[int]]:
    """Rank ``rank``'s slice of the rank files' kept bytes (``files``: layouts ``(path, size, starts, ends, holes)``)
    and every rank's slice length: the kept ranges of all files in order are one sequence of ``T`` bytes, rank
    ``q`` reads ``[T q / N, T (q + 1) / N)`` of it, as ``(path, start, end)`` pieces."""
    total = sum(e - s for f in files for s, e in zip(f[2], f[3]))
    bounds = [total * q // world for q in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    mine, at = [], 0
    for path, _, starts, ends, _ in files:
        for s, e in zip(starts, ends):
            a, b = max(lo, at), min(hi, at + e - s)
            if a < b:
                mine.append((path, s + a - at, s + b - at))
            at += e - s
    return mine, [bounds[q + 1] - bounds[q] for q in range(world)]


def _split_back(files: list[tuple], everything: bytes) -> list[list[bytes]]:
    """The kept ranges' bytes of each file, cut from the sequence of all of them (:func:`spread_ranges`)."""
    mv, at, out = memoryview(everything), 0, []
    for _, _, starts, ends, _ in files:
        parts = []
        for s, e in zip(starts, ends):
            parts.append(mv[at:at + e - s])
            at += e - s
        out.append(parts)
    return out


def _all_gather_bytes(mine: bytes, sizes: list[int], group) -> bytes:
    """Every rank's ``mine`` (rank ``q``'s ``sizes[q]`` bytes long), concatenated in rank order: one all_gather
    over ``group`` of the slices padded to the longest."""
    import torch.distributed as dist

    top = max(sizes)
    pad = torch.zeros(top, dtype=torch.uint8)
    if mine:
        pad[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    out = [torch.empty(top, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, pad, group=group)
    return b"".join(o[:n].numpy().tobytes() for o, n in zip(out, sizes))


def agree_read(error: BaseException | None, group, where) -> None:
    """Every rank, its part of a restore read: all learn whether any rank failed (one all_gather), so none waits
    for the failed one in a collective. The failing rank raises its error, the others an error naming it."""
    import torch.distributed as dist

    ok = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    out = [torch.empty_like(ok) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, ok, group=group)
    failed = [q for q, t in enumerate(out) if int(t)]
    if error is not None:
        raise error
    if failed:
        raise EmbedscaleError(f"{where}: rank {failed[0]} could not read its part of the checkpoint (its error "
                              "says why)")


__all__ = ["INDEX", "SIZES", "RowReader", "agree_read", "collect_index", "read_spread", "row_runs", "spread_ranges",
           "write_rank_index"]


def read_shard(path: str | Path | ObjectPath, skip: dict | None = None) -> dict:
    """One rank file, read with ``weights_only=True``; a damaged file is a ``FormatError`` naming it. A local
    file is memory-mapped (read as its tensors are used); a remote one is read whole, or with ``skip`` (its
    entry of the manifest's row index) without its tables' rows (``ckpt_rows.read_remote_shard``)."""
    path = location(path)
    if not path.is_file():
        raise FormatError(f"checkpoint file not found: {path}")
    try:
        if isinstance(path, ObjectPath):
            payload = read_remote_shard(path, skip)
        else:
            payload = torch.load(path, map_location=HOST, weights_only=True, mmap=True)  # read as tensors are used
    except Exception as e:  # noqa: BLE001 - torch raises many kinds here
        raise FormatError(f"{path}: not a readable checkpoint file ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or "rank" not in payload:
        raise FormatError(f"{path}: not an embedscale checkpoint rank file")
    return payload
