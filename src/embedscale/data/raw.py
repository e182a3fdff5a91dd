"""Shared machinery of the raw click-log readers (``criteo.py``, ``avazu.py``).

A raw log is read in blocks of whole lines (``block_bytes`` each, so memory stays bounded whatever
the file size). Each block is split into columns by Arrow's multi-threaded CSV parser with every column
typed ``binary``: Arrow only cuts fields, and all values are decoded here, vectorised over the block, by
rules we own (``parse_decimal``, ``parse_hex``, ``fnv1a64``). Arrow's own number parser is not used
because it silently accepts values the formats forbid (``0x1f``, `` 5``).

Errors are found on the fast path but named on the slow one: when Arrow rejects a block (wrong number of
fields) or the vectorised decoders flag a row, only that block is re-scanned line by line in Python
(``LogFormat.check_line``) to report ``<file>:<line>: <what is wrong>`` with 1-based line numbers.

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
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from embedscale.errors import ConfigError, InputError
from embedscale.io import atomic_save_npy, atomic_write_json
from embedscale.data.shards import MANIFEST, Manifest, ShardWriter, SparseFeatureInfo

BLOCK_BYTES = 32 << 20
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


def _open_raw(path: Path):
    raw = open(path, "rb")
    if path.suffix == ".gz":
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    return raw, raw


def iter_line_blocks(path: str | os.PathLike, block_bytes: int = BLOCK_BYTES, header: bool = False,
                     on_progress: Callable[[int], None] | None = None) -> Iterator[LineBlock | bytes]:
    """Yield the header line (bytes, when ``header``) and then blocks of whole lines of ``path``.

    ``.gz`` files are decompressed on the fly. ``on_progress(n)`` is told every ``n`` bytes of the file
    (compressed bytes for ``.gz``) consumed.
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
            head = f.readline()
            if not head:
                raise InputError(f"{path}: empty file, expected a header line")
            yield head
            line_no = 2
        while True:
            # read straight behind the carried partial line: no copy of the block on the way to Arrow
            buf = bytearray(len(carry) + block_bytes)
            buf[:len(carry)] = carry
            got = f.readinto(memoryview(buf)[len(carry):])
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
    )


# --------------------------------------------------------------------------------------------------
# vectorised decoders of binary columns


def _buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n+1], data uint8) of a binary array, honouring its slice offset."""
    if arr.type != pa.binary():
        arr = arr.cast(pa.binary())
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4).astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size else np.zeros(1, np.uint8)
    return offsets, data


def _per_chunk(col: pa.ChunkedArray | pa.Array, fn: Callable[[pa.Array], tuple]) -> tuple:
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = [fn(c) for c in chunks if len(c)]
    if not parts:
        return fn(pa.array([], pa.binary()))
    return tuple(np.concatenate(p) for p in zip(*parts))


def _fixed_width(offsets: np.ndarray, data: np.ndarray, lut: np.ndarray, base: int):
    """Fast path when every non-empty field has the same width (Criteo's 8-digit hex): the fields lie
    back to back in the data buffer, so they reshape into a ``[fields, width]`` matrix with no gather."""
    lens = np.diff(offsets)
    nonempty = lens > 0
    widths = lens[nonempty]
    if not len(widths):
        return np.zeros(len(lens), np.uint64), np.zeros(len(lens), bool)
    w = int(widths[0])
    if w > 16 or not (widths == w).all():
        return None
    bad = np.zeros(len(lens), bool)
    if base == 16 and w % 2 == 0:  # two hex digits -> one byte per lookup, bytes read as big-endian
        pairs = _HEX_PAIRS[data[offsets[0]:offsets[-1]].view(np.uint16)].reshape(-1, w // 2)
        if pairs.max() > 255:
            bad[nonempty] = (pairs > 255).any(1)
        padded = np.zeros((len(pairs), 8), np.uint8)
        padded[:, 8 - w // 2:] = pairs
        v = padded.view(">u8").ravel().astype(np.uint64)
    else:
        d = lut[data[offsets[0]:offsets[-1]]].reshape(-1, w)
        if d.max() >= base:  # only then find the rows
            bad[nonempty] = (d >= base).any(1)
        v = np.zeros(len(d), np.uint64)
        for k in range(w):  # digit positions, not rows
            v = v * np.uint64(base) + d[:, k]
    value = np.zeros(len(lens), np.uint64)
    value[nonempty] = v
    return value, bad


def _digits(arr: pa.Array, lut: np.ndarray, base: int, max_len: int, signed: bool):
    """Digits of every field in ``base`` -> (uint64 magnitude, negative, digit count, bad) per field."""
    offsets, data = _buffers(arr)
    n = len(offsets) - 1
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(n, bool)
    if not signed:
        fast = _fixed_width(offsets, data, lut, base)
        if fast is not None:
            return fast[0], np.zeros(n, bool), np.diff(offsets), fast[1] | nulls
    start, end = offsets[:-1], offsets[1:]
    neg = np.zeros(n, dtype=bool)
    last = len(data) - 1
    if signed and n:
        neg = (data[np.minimum(start, last)] == ord("-")) & (end > start)
        start = start + neg
    lens = end - start
    bad = (lens > max_len) | (neg & (lens == 0)) | nulls
    width = int(min(lens.max(initial=0), max_len))
    value = np.zeros(n, dtype=np.uint64)
    invalid = np.zeros(n, dtype=bool)
    for k in range(width):  # digit positions, right-aligned; positions before a field's start count 0
        pos = end - width + k
        inside = pos >= start
        d = lut[data[np.maximum(pos, 0)]]
        d = np.where(inside, d, 0)
        invalid |= d >= base
        value = value * np.uint64(base) + d
    return value, neg, lens, bad | invalid


_DEC = np.full(256, 255, np.uint8)  # 255: not a digit
_DEC[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX = _DEC.copy()
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
# every pair of bytes, read as a little-endian uint16 (first character low) -> its byte value, or 0xFFFF
_hi, _lo = _HEX[np.arange(1 << 16) & 0xFF].astype(np.uint16), _HEX[np.arange(1 << 16) >> 8].astype(np.uint16)
_HEX_PAIRS = np.where((_hi < 16) & (_lo < 16), _hi * 16 + _lo, 0xFFFF).astype(np.uint16)
del _hi, _lo


def parse_decimal(col, max_digits: int = 18) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decimal integers ``-?[0-9]{1,max_digits}`` -> (int64 values, missing mask, bad mask).

    An empty field is missing (value 0). Anything else, ``+5``, `` 5``, ``0x1f``, ``1.0``, is bad."""
    def one(arr):
        v, neg, lens, bad = _digits(arr, _DEC, 10, max_digits, signed=True)
        v = v.astype(np.int64)
        v = np.where(neg, -v, v)
        return v, (lens == 0) & ~neg, bad
    return _per_chunk(col, one)


def parse_hex(col, max_digits: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Hexadecimal values ``[0-9a-fA-F]{0,16}`` -> (uint64 keys, bad mask); empty (missing) is 0, as
    ``int("0", 16)`` in Meta's DLRM reference, which fills missing fields with ``"0"`` before parsing."""
    def one(arr):
        v, _, _, bad = _digits(arr, _HEX, 16, max_digits, signed=False)
        return v, bad
    return _per_chunk(col, one)


def parse_label(col) -> tuple[np.ndarray, np.ndarray]:
    """Click labels: exactly ``0`` or ``1`` -> (int8 labels, bad mask)."""
    def one(arr):
        offsets, data = _buffers(arr)
        c = data[np.minimum(offsets[:-1], len(data) - 1)]
        ok = (np.diff(offsets) == 1) & ((c == ord("0")) | (c == ord("1")))
        return (c == ord("1")).astype(np.int8), ~ok
    return _per_chunk(col, one)


def show(value: bytes, limit: int = 40) -> str:
    """A field's bytes for an error message."""
    text = value.decode("utf-8", "replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")


FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)


def fnv1a64(col) -> tuple[np.ndarray]:
    """Stable 64-bit FNV-1a hash of each value's bytes; the empty (missing) value is key 0.

    Unlike Python's ``hash()`` it is the same in every process and on every machine."""
    def one(arr):
        offsets, data = _buffers(arr)
        start, lens = offsets[:-1], np.diff(offsets)
        h = np.full(len(start), FNV_OFFSET, dtype=np.uint64)
        last = len(data) - 1
        with np.errstate(over="ignore"):
            for k in range(int(lens.max(initial=0))):  # character positions, not rows
                active = k < lens
                c = data[np.minimum(start + k, last)].astype(np.uint64)
                h = np.where(active, (h ^ c) * FNV_PRIME, h)
        h[lens == 0] = 0
        return (h,)
    return _per_chunk(col, one)


def fnv1a64_py(value: bytes) -> int:
    """Plain-Python FNV-1a 64 (the reference ``fnv1a64`` is checked against); empty -> 0."""
    if not value:
        return 0
    h = 0xCBF29CE484222325
    for c in value:
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


# --------------------------------------------------------------------------------------------------
# categorical keys -> table rows


class ValueCounter:
    """Exact per-value counts of one categorical column, merged block by block (16 bytes per distinct value)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, keys: np.ndarray) -> None:
        k, c = np.unique(keys, return_counts=True)
        self._pending.append((k, c.astype(np.int64)))
        self._pending_size += len(k)
        if self._pending_size > max(1 << 20, len(self.keys)):
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([self.keys] + [k for k, _ in self._pending])
        counts = np.concatenate([self.counts] + [c for _, c in self._pending])
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        self.keys, self.counts = keys[starts], np.add.reduceat(counts, starts) if len(keys) else counts
        self._pending, self._pending_size = [], 0

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct keys, their counts)."""
        self._merge()
        return self.keys, self.counts


class CategoricalEncoder:
    """Keys -> table rows for every sparse feature, in one of the two ways of Meta's DLRM reference.

    ``hash``: row = key % table_rows[f] (the reference's ``--max-ind-range``: ``int(x, 16) % max_ind_range``).
    ``vocab``: the reference's dictionary of every distinct value, with a frequency cut as in the MLPerf /
    NVIDIA DLRM preprocessing: keys seen at least ``min_frequency`` times get rows 1..V in order of
    descending count, ties by ascending key (row 1 is the most frequent value: hot rows first, and the
    same order on every run); row 0 is the shared out-of-vocabulary row of all rarer keys. A missing
    value is key 0, as in the reference, and gets its own row like any other value when frequent enough.
    """

    def __init__(self, names: list[str], mode: str, table_rows: int | Sequence[int] = 1_000_000,
                 min_frequency: int = 1) -> None:
        if mode not in ("hash", "vocab"):
            raise ConfigError(f"categorical must be 'hash' or 'vocab', got {mode!r}")
        rows = [int(table_rows)] * len(names) if np.isscalar(table_rows) else [int(r) for r in table_rows]
        if len(rows) != len(names):
            raise ConfigError(f"table_rows has {len(rows)} entries for {len(names)} sparse features {names[0]}..{names[-1]}")
        bad = [f"{n}={r}" for n, r in zip(names, rows) if r <= 0]
        if bad:
            raise ConfigError(f"table_rows must be positive: {', '.join(bad)}")
        if int(min_frequency) < 1:
            raise ConfigError(f"min_frequency must be >= 1, got {min_frequency}")
        self.names, self.mode, self.min_frequency = list(names), mode, int(min_frequency)
        self.table_rows = rows
        self.counters = [ValueCounter() for _ in names] if mode == "vocab" else None
        self.vocab: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (sorted keys, their rows, keys by row)

    @property
    def needs_counts(self) -> bool:
        return self.mode == "vocab" and not self.vocab

    def count(self, keys: np.ndarray) -> None:
        """Pass 1 of vocab mode: ``keys [N, F]``."""
        for f, counter in enumerate(self.counters):
            counter.add(keys[:, f])

    def build(self) -> None:
        """Close pass 1: fix each feature's vocabulary and row count."""
        for f, counter in enumerate(self.counters):
            keys, counts = counter.result()
            keep = counts >= self.min_frequency
            k, c = keys[keep], counts[keep]
            by_row = k[np.lexsort((k, -c))]  # descending count, then ascending key
            rows = np.empty(len(k), np.int64)
            rows[np.searchsorted(k, by_row)] = np.arange(1, len(k) + 1)
            self.vocab.append((k, rows, by_row))
            self.table_rows[f] = len(k) + 1
        self.counters = None

    def encode(self, keys: np.ndarray) -> np.ndarray:
        """``keys [N, F]`` uint64 -> rows ``[N, F]`` int64."""
        out = np.empty(keys.shape, np.int64)
        for f in range(keys.shape[1]):
            if self.mode == "hash":
                out[:, f] = keys[:, f] % np.uint64(self.table_rows[f])
            else:
                k, rows, _ = self.vocab[f]
                if not len(k):
                    out[:, f] = 0
                    continue
                pos = np.minimum(np.searchsorted(k, keys[:, f]), len(k) - 1)
                out[:, f] = np.where(k[pos] == keys[:, f], rows[pos], 0)
        return out


# --------------------------------------------------------------------------------------------------
# the conversion driver


@dataclass
class Decoded:
    """A block decoded: ``bad[N]`` marks rows the vectorised checks reject (then the block is re-scanned)."""

    labels: np.ndarray  # int8 [N]
    dense: np.ndarray  # float32 [N, D]
    keys: np.ndarray  # uint64 [N, F]
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
        return Decoded(np.zeros(0, np.int8), np.zeros((0, D), np.float32), np.zeros((0, F), np.uint64),
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
            for item in iter_line_blocks(path, block_bytes, header=fmt.header is not None, on_progress=update):
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
                    dec = Decoded(dec.labels[:keep], dec.dense[:keep], dec.keys[:keep], dec.bad[:keep])
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

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    skipped = _Skipped()
    sparse = [SparseFeatureInfo(n, r) for n, r in zip(fmt.sparse_names, enc.table_rows)]
    extra = {"source": [str(p) for p in files], "format": fmt.name, "categorical": categorical}
    if categorical == "hash":
        extra["table_rows"] = list(enc.table_rows)
    else:
        extra.update(min_frequency=enc.min_frequency, vocab_files=[f"vocab-{n}.npy" for n in fmt.sparse_names])
    extra.update(fmt.notes)
    try:
        writer = ShardWriter(staging, fmt.dense_names, sparse, shard_rows=shard_rows, extra=extra)
        desc = f"{fmt.name} {passes}/{passes} shards"
        rows = 0
        for dec in _iter_decoded(fmt, files, skipped=skipped, desc=desc, **common):
            writer.write(dec.labels, dec.dense, dict(zip(fmt.sparse_names, enc.encode(dec.keys).T)))
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
