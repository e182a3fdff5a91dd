"""Shared machinery of the raw click-log readers (``criteo.py``, ``avazu.py``).

A raw log is read in blocks of whole lines (``block_bytes`` each, so memory stays bounded whatever
the file size). Each block is split into columns by Arrow's multi-threaded CSV parser with every column
typed ``binary``: Arrow only cuts fields; the values are decoded, vectorised over the block, by rules we
own (``embedscale.data.fields``). Reading and Arrow's parse of the next block run in a background
thread while the current one is decoded, encoded (``CategoricalEncoder``) and written (``ShardWriter``).

Errors are found on the fast path but named on the slow one: when Arrow rejects a block (wrong number of
fields) or the vectorised decoders flag a row, only that block is re-scanned line by line in Python
(``LogFormat.check_line``) to report ``<file>:<line>: <what is wrong>`` with 1-based line numbers.
Arrow's ``invalid_row_handler`` is not enough for this: it sees only wrong field counts, never a bad
value, and its ``InvalidRow.number`` is ``None`` when the parse is multi-threaded (pyarrow 26).

Categorical values become 64-bit keys (the hex value for Criteo, a stable FNV-1a hash for Avazu) and
keys become table rows in one of the two ways Meta's DLRM reference offers (``CategoricalEncoder``).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import queue
import shutil
import sys
import tempfile
import threading
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from embedscale.data.categorical import CategoricalEncoder
from embedscale.data.fields import show
from embedscale.data.shards import MANIFEST, Manifest, ShardWriter, SparseFeatureInfo
from embedscale.errors import ConfigError, InputError
from embedscale.io import atomic_save_npy, atomic_write_json

BLOCK_BYTES = 8 << 20  # measured: 8 MiB blocks beat 16 and 32 (fewer fresh pages per block), same CPU
MAX_EXAMPLES = 10

# --------------------------------------------------------------------------------------------------
# reading whole-line blocks


@dataclass
class LineBlock:
    """Whole lines of one file: ``data`` ends with a newline (or the file's end); ``first_line`` is 1-based."""

    path: str
    data: bytes | memoryview
    first_line: int
    num_lines: int


def _gzip_error(path: Path, line_no: int, e: Exception) -> InputError:
    """A damaged ``.gz`` input as an ``InputError`` naming the file and the last whole line block read before."""
    if isinstance(e, EOFError):
        why = "truncated gzip file (the compressed stream ends early)"
    elif isinstance(e, gzip.BadGzipFile):
        why = f"not a gzip file, though named .gz ({e})"
    else:
        why = f"damaged gzip data ({e})"
    return InputError(f"{path}: {why}" + (f", after line {line_no - 1}" if line_no > 1 else ""))


def _open_raw(path: Path):
    raw = open(path, "rb")
    if path.suffix == ".gz":
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    return raw, raw


def iter_line_blocks(path: str | os.PathLike, block_bytes: int = BLOCK_BYTES, header: bool = False,
                     on_progress: Callable[[int], None] | None = None, reuse: int = 0) -> Iterator[LineBlock | bytes]:
    """Yield the header line (bytes, when ``header``) and then blocks of whole lines of ``path``.

    ``.gz`` files are decompressed on the fly. ``on_progress(n)`` is told every ``n`` bytes of the file
    (compressed bytes for ``.gz``) consumed. ``reuse=k > 0`` cycles ``k`` read buffers instead of
    allocating (and page-faulting) a fresh one per block: a block's ``data`` is then overwritten ``k``
    blocks later, so hold no block longer than that.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    raw, f = _open_raw(path)
    with contextlib.ExitStack() as stack:
        stack.callback(raw.close)
        if f is not raw:
            stack.callback(f.close)
        pos = 0
        line_no = 1
        carry = b""
        if header:
            try:
                head = f.readline()
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise _gzip_error(path, line_no, e) from None
            if not head:
                raise InputError(f"{path}: empty file, expected a header line")
            yield head
            line_no = 2
        ring: list[bytearray] = []
        while True:
            # read straight behind the carried partial line: no copy of the block on the way to Arrow
            need = len(carry) + block_bytes
            if reuse and len(ring) == reuse and len(ring[0]) >= need:
                buf = ring.pop(0)
            else:
                buf = bytearray(need)
                if ring and len(ring) == reuse:
                    ring.pop(0)
            if reuse:
                ring.append(buf)
            buf[:len(carry)] = carry
            try:
                got = f.readinto(memoryview(buf)[len(carry):])
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise _gzip_error(path, line_no, e) from None
            if on_progress is not None:
                now = raw.tell()
                on_progress(now - pos)
                pos = now
            if not got:
                if carry:
                    yield LineBlock(str(path), memoryview(carry), line_no, 1)
                return
            end = len(carry) + got
            cut = buf.rfind(b"\n", 0, end) + 1
            if cut == 0:  # one line longer than a block: keep reading
                carry = bytes(buf[:end])
                continue
            carry = bytes(buf[cut:end])
            n = buf.count(b"\n", 0, cut)
            yield LineBlock(str(path), memoryview(buf)[:cut], line_no, n)
            line_no += n


def read_block_table(block: LineBlock, column_names: list[str], delimiter: str,
                     include: list[str] | None = None) -> pa.Table:
    """Cut a block into ``binary`` columns with Arrow's CSV parser (no quoting: raw logs have none).

    Raises ``pa.ArrowInvalid`` on a line with the wrong number of fields."""
    include = include or column_names
    return pacsv.read_csv(
        pa.py_buffer(block.data),
        read_options=pacsv.ReadOptions(column_names=column_names, use_threads=True,
                                       block_size=max(1 << 20, len(block.data) // (2 * pa.cpu_count()) + 1)),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char=False, double_quote=False,
                                         escape_char=False, newlines_in_values=False, ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(column_types={c: pa.binary() for c in include}, include_columns=include,
                                             null_values=[], strings_can_be_null=False,
                                             quoted_strings_can_be_null=False, check_utf8=False),
        # measured on Criteo: Arrow's default mimalloc pool hands its pages back after every block and
        # page-faults them in again; glibc's heap keeps them (about half the kernel time per 100 MB)
        memory_pool=pa.system_memory_pool(),
    )


# --------------------------------------------------------------------------------------------------
# the conversion driver


@dataclass
class Decoded:
    """A block decoded: ``bad[N]`` marks rows the vectorised checks reject (then the block is re-scanned)."""

    labels: np.ndarray  # int8 [N]
    dense: np.ndarray  # float32 [N, D]
    keys: np.ndarray  # uint64 [F, N], feature-major
    bad: np.ndarray  # bool [N]


@dataclass
class LogFormat:
    """What differs between raw logs: columns, header, the vectorised decoder and the line checker."""

    name: str
    delimiter: str
    column_names: list[str]
    dense_names: list[str]
    sparse_names: list[str]
    decode: Callable[[pa.Table], Decoded]
    check_line: Callable[[list[bytes]], str | None]  # reason a split line is malformed, or None
    header: bytes | None = None  # the exact first line every file must start with
    include: list[str] | None = None  # columns decoded (default all)
    notes: dict = field(default_factory=dict)  # documented choices, copied into manifest.extra


class _Skipped:
    def __init__(self) -> None:
        self.count = 0
        self.examples: list[str] = []

    def add(self, where: list[str]) -> None:
        self.count += len(where)
        self.examples.extend(where[: MAX_EXAMPLES - len(self.examples)])


def _lines(data: bytes | memoryview) -> list[bytes]:
    data = bytes(data)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    return lines


def _scan_block(fmt: LogFormat, block: LineBlock) -> list[tuple[int, str]]:
    """The slow path: (line index in block, reason) of every malformed line, checked in plain Python."""
    lines = _lines(block.data)
    delim = fmt.delimiter.encode()
    n = len(fmt.column_names)
    out = []
    for i, line in enumerate(lines):
        if line.endswith(b"\r"):
            line = line[:-1]
        fields = line.split(delim)
        if len(fields) != n:
            out.append((i, f"expected {n} fields, got {len(fields)}"))
            continue
        reason = fmt.check_line(fields)
        if reason:
            out.append((i, reason))
    return out


def _decode_block(fmt: LogFormat, block: LineBlock, table: pa.Table | Exception, skip_malformed: bool,
                  skipped: _Skipped | None) -> Decoded:
    """Decode one parsed block; malformed lines raise ``InputError`` or, when skipping, are dropped and counted."""
    if isinstance(table, Exception):
        problem = str(table).splitlines()[0]
    elif table.num_rows != block.num_lines:  # e.g. a lone '\r', which Arrow takes as a line break
        problem = f"Arrow found {table.num_rows} rows in {block.num_lines} lines"
    else:
        dec = fmt.decode(table)
        if not dec.bad.any():
            return dec
        problem = "rejected by the vectorised checks"
    bad = _scan_block(fmt, block)
    span = f"{block.path}:{block.first_line}-{block.first_line + block.num_lines - 1}"
    if not bad:
        raise InputError(f"{span}: malformed input ({problem}) but no single line could be named")
    where = [f"{block.path}:{block.first_line + i}: {reason}" for i, reason in bad]
    if not skip_malformed:
        more = f" (and {len(where) - 1} more malformed lines in this block)" if len(where) > 1 else ""
        raise InputError(where[0] + more)
    if skipped is not None:
        skipped.add(where)
    lines = _lines(block.data)
    drop = {i for i, _ in bad}
    if len(drop) == len(lines):
        D, F = len(fmt.dense_names), len(fmt.sparse_names)
        return Decoded(np.zeros(0, np.int8), np.zeros((0, D), np.float32), np.zeros((F, 0), np.uint64),
                       np.zeros(0, bool))
    good = b"\n".join(line for i, line in enumerate(lines) if i not in drop) + b"\n"
    clean = LineBlock(block.path, good, block.first_line, len(lines) - len(drop))
    try:
        dec = fmt.decode(_parse(fmt, clean))
    except pa.ArrowInvalid:
        dec = None
    if dec is None or dec.bad.any() or len(dec.labels) != clean.num_lines:
        raise InputError(f"{span}: lines still malformed after skipping the ones named")
    return dec


def _parse(fmt: LogFormat, block: LineBlock) -> pa.Table:
    return read_block_table(block, fmt.column_names, fmt.delimiter, fmt.include)


def _prefetch(items: Iterator, depth: int = 1) -> Iterator:
    """Run the generator ``items`` in a background thread, ``depth`` items ahead of the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def run() -> None:
        try:
            for x in items:
                if not put((x, None)):
                    return
            put((done, None))
        except BaseException as e:  # handed to the consumer, raised there
            put((done, e))
        finally:
            items.close()

    worker = threading.Thread(target=run, name="embedscale-reader", daemon=True)
    worker.start()
    try:
        while True:
            x, err = q.get()
            if x is done:
                if err is not None:
                    raise err
                return
            yield x
    finally:
        stop.set()
        worker.join()


def _iter_decoded(fmt: LogFormat, paths: list[Path], *, block_bytes: int, skip_malformed: bool,
                  skipped: _Skipped | None, max_rows: int | None, progress: bool, desc: str) -> Iterator[Decoded]:
    """Decoded blocks of all files in order. Reading and Arrow's parse run one block ahead in a
    background thread, so they overlap the numpy decode of the block before."""
    from tqdm import tqdm

    def parsed(update) -> Iterator:
        for path in paths:
            # 3 buffers: the block being decoded, the one queued, the one being read
            for item in iter_line_blocks(path, block_bytes, header=fmt.header is not None, on_progress=update,
                                         reuse=3):
                if isinstance(item, bytes):
                    yield path, item, None
                    continue
                try:
                    table = _parse(fmt, item)
                except pa.ArrowInvalid as e:
                    table = e
                yield path, item, table

    total = sum(p.stat().st_size for p in paths)
    rows = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, file=sys.stderr) as bar:
        blocks = _prefetch(parsed(bar.update))
        try:
            for path, item, table in blocks:
                if isinstance(item, bytes):
                    head = item.rstrip(b"\r\n")
                    if head != fmt.header:
                        raise InputError(f"{path}:1: header is {show(head, 200)}, expected {show(fmt.header, 200)}")
                    continue
                dec = _decode_block(fmt, item, table, skip_malformed, skipped)
                if max_rows is not None and rows + len(dec.labels) > max_rows:
                    keep = max_rows - rows
                    dec = Decoded(dec.labels[:keep], dec.dense[:keep], dec.keys[:, :keep], dec.bad[:keep])
                rows += len(dec.labels)
                if len(dec.labels):
                    yield dec
                if max_rows is not None and rows >= max_rows:
                    return
        finally:
            blocks.close()


def _as_paths(paths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [Path(p) for p in paths]
    if not out:
        raise InputError("no input files given")
    for p in out:
        if not p.is_file():
            raise InputError(f"{p}: no such file")
    return out


def convert_log(fmt: LogFormat, paths, out_dir, *, categorical: str = "hash",
                table_rows: int | Sequence[int] = 1_000_000, min_frequency: int = 1, shard_rows: int = 1_000_000,
                skip_malformed: bool = False, max_rows: int | None = None, progress: bool = True,
                block_bytes: int = BLOCK_BYTES) -> Manifest:
    """Convert raw logs into an embedscale shard directory (see ``convert_criteo`` for the arguments).

    Shards are written into a hidden staging directory inside ``out_dir`` and moved in, manifest last,
    only when every line has been read: after an error ``out_dir`` holds no new manifest and no new shard.
    """
    files = _as_paths(paths)
    if max_rows is not None and max_rows < 0:
        raise ConfigError(f"max_rows must be >= 0, got {max_rows}")
    if shard_rows <= 0:
        raise ConfigError(f"shard_rows must be positive, got {shard_rows}")
    enc = CategoricalEncoder(fmt.sparse_names, categorical, table_rows, min_frequency)
    common = dict(block_bytes=block_bytes, skip_malformed=skip_malformed, max_rows=max_rows, progress=progress)
    passes = 2 if enc.needs_counts else 1
    if enc.needs_counts:
        for dec in _iter_decoded(fmt, files, skipped=None, desc=f"{fmt.name} 1/2 vocabulary", **common):
            enc.count(dec.keys)
        enc.build()

    skipped = _Skipped()
    sparse = [SparseFeatureInfo(n, r) for n, r in zip(fmt.sparse_names, enc.table_rows)]
    extra = {"source": [str(p) for p in files], "format": fmt.name, "categorical": categorical}
    if categorical == "hash":
        extra["table_rows"] = list(enc.table_rows)
    else:
        extra.update(min_frequency=enc.min_frequency, vocab_files=[f"vocab-{n}.npy" for n in fmt.sparse_names],
                     vocab_order="rows 1..V by descending count, ties by ascending key; row 0: rarer or unseen "
                                 "keys; vocab-<feature>.npy[i - 1] is the key of row i")
    extra.update(fmt.notes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))  # same file system: moves are renames
    try:
        writer = ShardWriter(staging, fmt.dense_names, sparse, shard_rows=shard_rows, extra=extra)
        desc = f"{fmt.name} {passes}/{passes} shards"
        rows = 0
        for dec in _iter_decoded(fmt, files, skipped=skipped, desc=desc, **common):
            writer.write(dec.labels, dec.dense, dict(zip(fmt.sparse_names, enc.encode(dec.keys))))
            rows += len(dec.labels)
        if rows == 0 and max_rows != 0:
            why = f" ({skipped.count} malformed lines skipped)" if skipped.count else ""
            raise InputError(f"{', '.join(map(str, files))}: no rows{why}")
        writer.manifest.extra["skipped"] = {"count": skipped.count, "examples": skipped.examples}
        writer.close()
        if categorical == "vocab":
            for name, (_, _, by_row) in zip(fmt.sparse_names, enc.vocab):
                atomic_save_npy(staging / f"vocab-{name}.npy", by_row)  # key of row i is by_row[i - 1]
        manifest = writer.manifest
        _publish(staging, out, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if skipped.count:
        warnings.warn(f"{fmt.name}: skipped {skipped.count} malformed line(s), first: "
                      + "; ".join(skipped.examples[:3]), stacklevel=3)
    return manifest


def _publish(staging: Path, out: Path, manifest: Manifest) -> None:
    """Move a finished dataset from ``staging`` into ``out``: old manifest off, files in, manifest last."""
    with contextlib.suppress(FileNotFoundError):
        (out / MANIFEST).unlink()
    new = {s["file"] for s in manifest.shards}
    for old in list(out.glob("shard-*.arrow")) + list(out.glob("vocab-*.npy")):
        if old.name not in new:
            old.unlink()
    for f in staging.iterdir():
        if f.name != MANIFEST and not f.name.startswith("."):
            os.replace(f, out / f.name)
    atomic_write_json(out / MANIFEST, manifest.to_json())
