"""Columnar shards plus a manifest: the one on-disk format every reader writes and the loader reads.

A dataset is a directory::

    manifest.json          what is in it (see ``Manifest``)
    shard-00000.arrow      Arrow IPC file, uncompressed, memory-mappable
    shard-00001.arrow      ...

Each shard has the columns ``label`` (int8, 0/1), ``dense`` (fixed_size_list<float32>[num_dense],
already transformed, e.g. log(1+x); absent when there are no dense features: Arrow has no list of
size 0), ``weight`` (float32, only in a dataset with sample weights: ``Manifest.weighted``), and one
column per sparse feature: int64 for one-hot features, ``list<int64>`` for multi-hot ones, followed for a
feature with id weights (``SparseFeatureInfo.id_weights``) by ``<feature>/weights``, ``list<float32>``, a
weight per id (a bag pooled as the weighted sum of its rows). Row ids are already in ``[0, num_rows)`` of
their table.

Shards are written through a temporary name and renamed; the manifest is written last, so a directory
without a manifest is an unfinished write and is never read as a dataset.

Page-aligned layout (``write_shard_file``): a shard's record batches are cut at the dataset rows that are
multiples of ``ALIGN_ROWS`` (4,096 rows: a page of int8 labels), and each record batch's body starts on a
4 KiB page (its message metadata padded through a custom-metadata entry). A fixed-width column of a batch
whose rows are a multiple of 4,096 then fills whole pages, and so does a 4- or 8-byte column's run of a
multiple of 1,024 rows starting at a dataset row that is a multiple of 1,024: a rank's slice of a global batch (``data.loader``)
reads no page of its neighbours' rows, except the shared pages of the one-byte labels. Shards written
before this layout read the same, with up to a page more per column and run (they need no rewrite, but a
rewrite makes each rank's reads divide by the ranks).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from embedscale.data.page_edges import EdgeReader
from embedscale.errors import FormatError
from embedscale.io import atomic_write_json, read_json

MANIFEST = "manifest.json"
FORMAT = "embedscale.shards"
VERSION = 1


ID_WEIGHTS = "/weights"  # the column of a feature's per-id weights: "<feature>/weights"
PAGE = 4096  # bytes: the page a record batch's body is aligned to (x86-64 and most arm64 kernels)
ALIGN_ROWS = PAGE  # rows: record batches start at dataset rows that are multiples of this (module docstring)
_PAD_KEY = "embedscale.pad"  # the custom-metadata entry whose length puts a batch's body on a page


@dataclass
class SparseFeatureInfo:
    name: str
    num_rows: int
    multi_hot: bool = False
    id_weights: bool = False  # multi-hot: a weight per id (pooled as weighted sum), column "<name>/weights"


@dataclass
class Manifest:
    """What a shard directory holds. ``extra`` carries reader- or generator-specific facts
    (source file, skipped lines, vocabulary sizes, the teacher's AUC ceiling, ...)."""

    dense_names: list[str]
    sparse: list[SparseFeatureInfo]
    shards: list[dict] = field(default_factory=list)  # {"file", "rows", "positives"}
    extra: dict[str, Any] = field(default_factory=dict)
    weighted: bool = False  # shards carry a ``weight`` column (sample weights)

    @property
    def rows(self) -> int:
        return sum(s["rows"] for s in self.shards)

    @property
    def positives(self) -> int:
        return sum(s["positives"] for s in self.shards)

    @property
    def sparse_names(self) -> list[str]:
        return [s.name for s in self.sparse]

    @property
    def num_dense(self) -> int:
        return len(self.dense_names)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "rows": self.rows,
            "positives": self.positives,
            "dense_names": self.dense_names,
            "sparse": [{k: v for k, v in vars(s).items() if k != "id_weights" or v} for s in self.sparse],
            "shards": self.shards,
            "extra": self.extra,
            **({"weighted": True} if self.weighted else {}),
        }

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Manifest":
        path = Path(directory) / MANIFEST
        d = read_json(path, "shard manifest")
        if d.get("format") != FORMAT:
            raise FormatError(f"{path}: not an embedscale shard manifest (format={d.get('format')!r})")
        if d.get("version") != VERSION:
            raise FormatError(f"{path}: manifest version {d.get('version')} is not {VERSION}")
        m = cls(d["dense_names"], [SparseFeatureInfo(**s) for s in d["sparse"]], d["shards"], d.get("extra", {}),
                bool(d.get("weighted", False)))
        for s in m.shards:
            check_shard(path, Path(directory) / s["file"], s.get("rows"), m)
        return m


def check_shard(manifest_path: Path, shard: Path, rows: Any, m: Manifest) -> None:
    """A shard agrees with its manifest entry: it exists, is an Arrow IPC file with every column the manifest
    lists (of the listed type) and exactly the listed rows. Cheap: the file's footer and batch headers only
    (memory-mapped), no column is read. Else a ``FormatError`` naming the manifest, the shard and the column
    or both row counts."""
    name = shard.name
    if not shard.exists():
        raise FormatError(f"{manifest_path}: shard {name} is listed but missing")
    try:
        reader = ipc.open_file(mapped(shard, random_access=True))  # the footer and batch headers only
        schema = reader.schema
        n = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except (pa.ArrowInvalid, OSError) as e:
        raise FormatError(f"{shard}: not a readable Arrow shard ({e})") from None
    want = arrow_schema(m.num_dense, m.sparse, m.weighted)
    for f in want:
        i = schema.get_field_index(f.name)
        if i < 0:
            raise FormatError(f"{manifest_path}: lists column {f.name!r}, which shard {shard} lacks "
                              f"(it has {', '.join(schema.names)})")
        if schema.field(i).type != f.type:
            raise FormatError(f"{manifest_path}: column {f.name!r} is {f.type} but {schema.field(i).type} in "
                              f"shard {shard}")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows != n:
        raise FormatError(f"{manifest_path}: shard {name} is listed with {rows!r} rows but {shard} holds {n}")


def arrow_schema(num_dense: int, sparse: list[SparseFeatureInfo], weighted: bool = False) -> pa.Schema:
    cols = [pa.field("label", pa.int8())]
    if num_dense:
        cols.append(pa.field("dense", pa.list_(pa.float32(), num_dense)))
    if weighted:
        cols.append(pa.field("weight", pa.float32()))
    for s in sparse:
        cols.append(pa.field(s.name, pa.list_(pa.int64()) if s.multi_hot else pa.int64()))
        if s.id_weights:
            cols.append(pa.field(s.name + ID_WEIGHTS, pa.list_(pa.float32())))
    return pa.schema(cols)


def record_batch(manifest: "Manifest", schema: pa.Schema, n: int, labels, dense, sparse: dict[str, Any],
                 weights, writer: str, error: type = ValueError) -> pa.RecordBatch:
    """``n`` rows in the shard layout of ``manifest`` (label, dense list, weight, one column per sparse feature):
    what ``ShardWriter`` and ``data.stream.StreamWriter`` (``writer`` names it in the error) write."""
    D = manifest.num_dense
    arrays = [pa.array(np.asarray(labels, dtype=np.int8))]
    if D:
        flat = np.ascontiguousarray(dense, dtype=np.float32).reshape(n * D)
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), D))
    if manifest.weighted:
        if weights is None:
            raise error(f"a weighted {writer} needs weights")
        arrays.append(pa.array(np.asarray(weights, dtype=np.float32)))
    for s in manifest.sparse:
        col = sparse[s.name]
        if s.multi_hot:
            values, lengths = col[:2]
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(values, np.int64))))
            if s.id_weights:
                if len(col) != 3:
                    raise error(f"{writer}: feature {s.name} has id weights: give (values, lengths, weights)")
                arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(col[2], np.float32))))
        else:
            arrays.append(pa.array(np.asarray(col, dtype=np.int64)))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


class ShardWriter:
    """Append row blocks; writes a shard every ``shard_rows`` rows and the manifest on ``close()``.

    ``write(labels[N], dense[N, D], sparse, weights=None)`` where ``sparse[name]`` is an int64 array ``[N]``
    for a one-hot feature or a tuple ``(values, lengths)`` for a multi-hot one; ``weights[N]`` (>= 0) when
    the writer is ``weighted``. Zero dense or zero sparse features are fine. Use as a context manager: on
    an exception nothing is left that looks like a finished dataset.

    Example (your own arrays; ``embedscale data table`` does this for files)::

        with ShardWriter("data/mine", ["age"], [SparseFeatureInfo("city", 100)]) as w:
            w.write(np.array([0, 1]), np.array([[0.3], [0.7]]), {"city": np.array([4, 99])})
    """

    def __init__(self, directory: str | os.PathLike, dense_names: list[str], sparse: list[SparseFeatureInfo],
                 shard_rows: int = 1_000_000, extra: dict | None = None, weighted: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / MANIFEST).exists():
            (self.dir / MANIFEST).unlink()  # an old dataset here is being replaced
        self.manifest = Manifest(list(dense_names), list(sparse), [], dict(extra or {}), bool(weighted))
        self.schema = arrow_schema(len(dense_names), self.manifest.sparse, self.manifest.weighted)
        self.shard_rows = int(shard_rows)
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0

    def write(self, labels: np.ndarray, dense: np.ndarray, sparse: dict[str, Any],
              weights: np.ndarray | None = None) -> None:
        n = len(labels)
        if n == 0:
            return
        rb = record_batch(self.manifest, self.schema, n, labels, dense, sparse, weights, "ShardWriter")
        # split across shard boundaries
        while rb.num_rows:
            room = self.shard_rows - self._pending_rows
            take = rb.slice(0, room)
            self._pending.append(take)
            self._pending_rows += take.num_rows
            rb = rb.slice(take.num_rows)
            if self._pending_rows >= self.shard_rows:
                self._flush()

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        name = f"shard-{len(self.manifest.shards):05d}.arrow"
        tmp = self.dir / f".{name}.tmp"
        table = pa.Table.from_batches(self._pending, schema=self.schema).combine_chunks()
        try:
            write_shard_file(tmp, self.schema, table, self.manifest.rows)
            os.replace(tmp, self.dir / name)
        except OSError as e:  # Arrow's errors name no file: say which one (a full disk, a read-only directory)
            tmp.unlink(missing_ok=True)
            if e.filename is not None or e.errno is None:
                raise
            raise OSError(e.errno, os.strerror(e.errno), str(self.dir / name)) from e
        positives = int(np.asarray(table.column("label").to_numpy()).sum())
        self.manifest.shards.append({"file": name, "rows": table.num_rows, "positives": positives})
        self._pending, self._pending_rows = [], 0

    def close(self) -> Manifest:
        self._flush()
        atomic_write_json(self.dir / MANIFEST, self.manifest.to_json())
        return self.manifest

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


def write_shard_file(path: str | os.PathLike, schema: pa.Schema, table: pa.Table, first_row: int) -> None:
    """``table`` as an Arrow IPC file in the page-aligned layout (module docstring), its first row being row
    ``first_row`` of the dataset: record batches cut by ``aligned_cuts``, each body starting on a page."""
    rb = table.combine_chunks().to_batches()
    rb = rb[0] if rb else pa.RecordBatch.from_pylist([], schema=schema)
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, schema) as w:
        for lo, hi in aligned_cuts(first_row, rb.num_rows):
            piece = rb.slice(lo, hi - lo)
            # the file's magic (8 bytes) and its schema go out with the first batch
            at = sink.tell() or 8 + _message_lengths(schema, piece, 0)[0]
            w.write_batch(piece, custom_metadata={_PAD_KEY: " " * _page_pad(schema, piece, at)})


def aligned_cuts(first_row: int, rows: int) -> list[tuple[int, int]]:
    """A shard's record batches as row ranges ``[lo, hi)`` of the shard, cut where the dataset row
    ``first_row + lo`` is a multiple of ``ALIGN_ROWS``: a head up to the first such row, the rows between the
    first and the last such row, and a tail; the whole shard when no ``ALIGN_ROWS`` rows between two such rows
    lie in it (a small shard gains nothing from cuts). One empty range for an empty shard."""
    head = min(rows, -first_row % ALIGN_ROWS)
    body = head + (rows - head) // ALIGN_ROWS * ALIGN_ROWS
    if body == head:
        return [(0, rows)]
    cuts = sorted({0, head, body, rows})
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b] or [(0, 0)]


_LENGTHS: dict[tuple[bytes, int, int], tuple[int, int]] = {}  # (schema, rows > 0, pad) -> _message_lengths, per process


def _message_lengths(schema: pa.Schema, batch: pa.RecordBatch, pad: int) -> tuple[int, int]:
    """Bytes of the schema message, and of a record batch message's prefix and metadata (what precedes its
    body), with a pad entry of ``pad`` bytes: measured on a one-row probe, whose metadata has the size of any
    batch's of the schema (buffers and lengths are fixed-size fields of the flatbuffer); kept per schema."""
    key = (schema.serialize().to_pybytes(), min(1, batch.num_rows), pad)
    if key not in _LENGTHS:
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, schema) as w:
            w.write_batch(batch.slice(0, min(1, batch.num_rows)), custom_metadata={_PAD_KEY: " " * pad})
        head = sink.getvalue().to_pybytes()
        schema_len = 8 + int.from_bytes(head[4:8], "little")
        if len(_LENGTHS) > 65_536:
            _LENGTHS.clear()
        _LENGTHS[key] = schema_len, 8 + int.from_bytes(head[schema_len + 4:schema_len + 8], "little")
    return _LENGTHS[key]


def _page_pad(schema: pa.Schema, batch: pa.RecordBatch, at: int) -> int:
    """The pad entry's length that starts the body of a batch message written at file offset ``at`` on a
    page. The message grows by 8 bytes for about every 8 bytes of pad, so a length near the shortfall hits
    the page; 0 when none does (the file is then valid, only not aligned)."""
    short = -(at + _message_lengths(schema, batch, 0)[1]) % PAGE
    for guess in (short, short + PAGE):
        for step in range(33):
            pad = guess + (step + 1) // 2 * (1 if step % 2 else -1)  # guess, guess + 1, guess - 1, ...
            if pad >= 0 and (at + _message_lengths(schema, batch, pad)[1]) % PAGE == 0:
                return pad
    return 0


@dataclass
class Columns:
    """A block of rows as numpy arrays (views of the memory-mapped shard where possible)."""

    labels: np.ndarray  # int8 [N]
    dense: np.ndarray  # float32 [N, D]
    sparse: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (values int64, lengths int64 [N])
    weights: np.ndarray | None = None  # float32 [N] (weighted datasets)
    id_weights: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32, one per value

    @property
    def rows(self) -> int:
        return len(self.labels)


def _column_to_jagged(col: pa.Array, n: int) -> tuple[np.ndarray, np.ndarray]:
    if pa.types.is_list(col.type):
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy()[offsets[0]:offsets[-1]]
        return values.astype(np.int64, copy=False), np.diff(offsets).astype(np.int64)
    return col.to_numpy().astype(np.int64, copy=False), np.ones(n, dtype=np.int64)


def read_shard(path: str | os.PathLike, num_dense: int) -> Columns:
    """Memory-map one shard and return its columns."""
    try:
        source = pa.memory_map(str(path), "r")
        table = ipc.open_file(source).read_all().combine_chunks()
    except (pa.ArrowInvalid, OSError) as e:
        raise FormatError(f"{path}: not a readable Arrow shard ({e})") from None
    n = table.num_rows
    labels = table.column("label").chunk(0).to_numpy() if n else np.zeros(0, np.int8)
    dense = (table.column("dense").chunk(0).flatten().to_numpy().reshape(n, num_dense)
             if n and num_dense else np.zeros((n, num_dense), np.float32))
    weights = None
    if "weight" in table.column_names:
        weights = table.column("weight").chunk(0).to_numpy() if n else np.zeros(0, np.float32)
    sparse, id_weights = {}, {}
    for name in table.column_names:
        if name in ("label", "dense", "weight"):
            continue
        col = table.column(name).chunk(0) if n else None
        if name.endswith(ID_WEIGHTS) and name[:-len(ID_WEIGHTS)] in table.column_names:
            id_weights[name[:-len(ID_WEIGHTS)]] = col.flatten().to_numpy() if n else np.zeros(0, np.float32)
            continue
        sparse[name] = _column_to_jagged(col, n) if n else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    return Columns(labels, dense, sparse, weights, id_weights)


def iter_shards(directory: str | os.PathLike) -> Iterator[Columns]:
    """Every shard of a dataset directory in order."""
    m = Manifest.load(directory)
    for s in m.shards:
        yield read_shard(Path(directory) / s["file"], m.num_dense)


class ShardRows:
    """Row ranges of one shard, read through its memory map: only the rows asked for are copied out.

    The shard's record batches are mapped once as zero-copy numpy views of their column buffers (nothing is
    read yet); ``read(lo, hi)`` returns the rows ``[lo, hi)`` as ``(first row, Columns)`` pieces, one per record
    batch the range crosses, whose arrays are views of just those rows, and adds their size to ``bytes_read``:
    per row its label, dense values, sample weight, one-hot ids, and for a list column (multi-hot ids, id
    weights) an offset plus its values. Those are the bytes a consumer copies out of the map; the operating
    system pages them in 4 KiB pages, so a range shorter than a page per column costs a page. With
    ``random_access`` and ``sector_edges`` a column's partial first and last page are read by sector instead
    (``page_edges``: the arrays are then copies), so ranks whose rows share a page do not each read all of it.
    """

    def __init__(self, path: str | os.PathLike, num_dense: int, random_access: bool = False,
                 sector_edges: bool = False):
        self.path = Path(path)
        self.num_dense = num_dense
        try:
            source, self._mm = _map(self.path, random_access)
            self._base = source.address
            reader = ipc.open_file(source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (pa.ArrowInvalid, OSError) as e:
            raise FormatError(f"{path}: not a readable Arrow shard ({e})") from None
        self._parts = [_batch_views(b, num_dense) for b in batches if b.num_rows] or [_batch_views(
            pa.RecordBatch.from_pylist([], schema=reader.schema), num_dense)]
        self._firsts = np.cumsum([0] + [len(p["label"]) for p in self._parts])
        self.rows = int(self._firsts[-1])
        self.bytes_read = 0
        self._edges = EdgeReader(self.path) if sector_edges and self._mm is not None else None

    def read(self, lo: int, hi: int) -> list[tuple[int, Columns]]:
        """The rows ``[lo, hi)`` (``0 <= lo <= hi <= rows``) as ``(first row, Columns)`` pieces."""
        if not 0 <= lo <= hi <= self.rows:
            raise ValueError(f"{self.path}: rows [{lo}, {hi}) outside its {self.rows} rows")
        out = []
        for k, part in enumerate(self._parts):
            first = int(self._firsts[k])
            a, b = max(lo, first) - first, min(hi, int(self._firsts[k + 1])) - first
            if a < b or (lo == hi and k == 0):
                cols, nbytes = _part_rows(part, a, max(a, b))
                self.bytes_read += nbytes
                self._advise(cols)
                out.append((first + a, self._take_edges(cols)))
        return out

    def _take_edges(self, cols: Columns) -> Columns:
        """The columns with their partial first and last pages read by sector (``EdgeReader``)."""
        if self._edges is None or not self._edges.active:
            return cols
        arrays = [cols.labels, cols.dense, cols.weights, *(v for v, _ in cols.sparse.values()),
                  *cols.id_weights.values()]
        mine = [i for i, v in enumerate(arrays) if v is not None
                and 0 <= v.__array_interface__["data"][0] - self._base <= len(self._mm) - v.nbytes]  # in the map
        for i, v in zip(mine, self._edges.take([(arrays[i], arrays[i].__array_interface__["data"][0] - self._base)
                                                for i in mine])):
            arrays[i] = v
        k = len(cols.sparse)
        sparse = {n: (v, ln) for (n, (_, ln)), v in zip(cols.sparse.items(), arrays[3:3 + k])}
        return Columns(arrays[0], arrays[1], sparse, arrays[2], dict(zip(cols.id_weights, arrays[3 + k:])))

    def _advise(self, cols: Columns) -> None:
        """With ``random_access``: ask the kernel for the pages of these rows now (``MADV_WILLNEED``), every
        column at once, rather than one page fault at a time as they are copied."""
        if self._mm is None:
            return
        views = [cols.labels, cols.dense, cols.weights, *(v for v, _ in cols.sparse.values()),
                 *cols.id_weights.values()]
        page = mmap.PAGESIZE
        for v in views:
            if v is None or not v.nbytes:
                continue
            start = v.__array_interface__["data"][0] - self._base
            if 0 <= start and start + v.nbytes <= len(self._mm):
                lo, hi = (self._edges.whole_pages(start, v.nbytes) if self._edges is not None
                          else (start - start % page, start + v.nbytes))
                if hi > lo:
                    self._mm.madvise(mmap.MADV_WILLNEED, lo, hi - lo)


def mapped(path: str | os.PathLike, random_access: bool = False) -> pa.Buffer:
    """The file memory-mapped read-only, as an Arrow buffer. Arrow's own ``memory_map`` advises the kernel to
    read ahead every range it hands out (a record batch's body is the whole shard); this map reads only the
    pages a reader touches, plus the kernel's readahead around a fault, which ``random_access``
    (``MADV_RANDOM``) turns off: short, strided runs of rows then read their own pages only."""
    return _map(path, random_access)[0]


def _map(path: str | os.PathLike, random_access: bool) -> tuple[pa.Buffer, mmap.mmap | None]:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return pa.py_buffer(b""), None  # Arrow names it as unreadable
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if random_access and hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
        return pa.py_buffer(mm), mm
    return pa.py_buffer(mm), None


def _batch_views(rb: pa.RecordBatch, num_dense: int) -> dict[str, Any]:
    """Zero-copy numpy views of a record batch's columns: ``label``, ``dense`` [n, D], ``weight``, and per sparse
    column (ids or ``<feature>/weights``) ``(values, offsets)``, offsets ``None`` for a one-hot column."""
    n = rb.num_rows
    views: dict[str, Any] = {"label": rb.column("label").to_numpy(zero_copy_only=False), "sparse": {}}
    views["dense"] = (rb.column("dense").flatten().to_numpy(zero_copy_only=False).reshape(n, num_dense)
                      if num_dense else np.zeros((n, 0), np.float32))
    names = rb.schema.names
    views["weight"] = rb.column("weight").to_numpy(zero_copy_only=False) if "weight" in names else None
    for name in names:
        if name in ("label", "dense", "weight"):
            continue
        col = rb.column(name)
        if pa.types.is_list(col.type):
            views["sparse"][name] = (col.values.to_numpy(zero_copy_only=False), col.offsets.to_numpy())
        else:
            views["sparse"][name] = (col.to_numpy(zero_copy_only=False), None)
    return views


def _part_rows(part: dict[str, Any], a: int, b: int) -> tuple[Columns, int]:
    """Rows ``[a, b)`` of a record batch's views as ``Columns``, and the bytes they span (``ShardRows``)."""
    n = b - a
    labels, dense, w = part["label"][a:b], part["dense"][a:b], part["weight"]
    w = None if w is None else w[a:b]
    nbytes = labels.nbytes + dense.nbytes + (0 if w is None else w.nbytes)
    jagged = {}
    for name, (values, offsets) in part["sparse"].items():
        if offsets is None or n == 0:
            v, lengths = values[a:b] if offsets is None else values[:0], np.ones(n, dtype=np.int64)
            nbytes += v.nbytes
        else:
            o = offsets[a:b + 1]
            v, lengths = values[o[0]:o[-1]], np.diff(o).astype(np.int64)
            nbytes += v.nbytes + n * offsets.itemsize
        jagged[name] = (v, lengths)
    sparse = {k: (v.astype(np.int64, copy=False), ln) for k, (v, ln) in jagged.items()
              if not (k.endswith(ID_WEIGHTS) and k[:-len(ID_WEIGHTS)] in jagged)}
    id_weights = {k[:-len(ID_WEIGHTS)]: v for k, (v, _) in jagged.items() if k not in sparse}
    return Columns(labels, dense, sparse, w, id_weights), nbytes
