"""Reading text logs in whole-line blocks, the input side of the tabular reader (``data.tabular``).

A raw log is read in blocks of whole lines (``block_bytes`` each, so memory stays bounded whatever
the file size). Each block is split into columns by Arrow's multi-threaded CSV parser with every column
typed ``binary``: Arrow only cuts fields; the values are decoded, vectorised over the block, by rules we
own (``embedscale.data.fields``). Reading and Arrow's parse of the next block run in a background
thread while the current one is decoded, encoded (``CategoricalEncoder``) and written (``ShardWriter``).

Errors are found on the fast path but named on the slow one: when Arrow rejects a block (wrong number of
fields), only that block is re-scanned line by line in Python to name the lines; a value the vectorised
decoders flag is named from its row (``<file>:<line>: <column> <value> <what is wrong>``, 1-based lines).
Arrow's ``invalid_row_handler`` is not enough for this: it sees only wrong field counts, never a bad
value, and its ``InvalidRow.number`` is ``None`` when the parse is multi-threaded (pyarrow 26).

Categorical values become 64-bit keys (the hex value for Criteo, a stable FNV-1a hash for Avazu) and
keys become table rows in one of the two ways Meta's DLRM reference offers (``CategoricalEncoder``).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import os
import queue
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.csv as pacsv

from embedscale.errors import InputError

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
                     include: list[str] | None = None, quoted: bool = False) -> pa.Table:
    """Cut a block into ``binary`` columns with Arrow's CSV parser. ``quoted``: RFC 4180 quoting (``"a,b"`` is
    one field, ``""`` inside quotes is a quote; a quoted field does not span lines), as Python's ``csv``
    module reads it; else none (TSV and Criteo's raw logs have none).

    Raises ``pa.ArrowInvalid`` on a line with the wrong number of fields."""
    include = include or column_names
    return pacsv.read_csv(
        pa.py_buffer(block.data),
        read_options=pacsv.ReadOptions(column_names=column_names, use_threads=True,
                                       block_size=max(1 << 20, len(block.data) // (2 * pa.cpu_count()) + 1)),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if quoted else False, double_quote=quoted,
                                         escape_char=False, newlines_in_values=False, ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(column_types={c: pa.binary() for c in include}, include_columns=include,
                                             null_values=[], strings_can_be_null=False,
                                             quoted_strings_can_be_null=False, check_utf8=False),
        # measured on Criteo: Arrow's default mimalloc pool hands its pages back after every block and
        # page-faults them in again; glibc's heap keeps them (about half the kernel time per 100 MB)
        memory_pool=pa.system_memory_pool(),
    )


# --------------------------------------------------------------------------------------------------
# helpers of the reader (data.tabular)


UNTERMINATED = "a quoted field does not end on its line (a field spanning lines is not read)"


def split_fields(line: bytes, sep: bytes, quoted: bool = False) -> list[bytes]:
    """One line's fields, as ``read_block_table`` cuts them (quoted: by Python's ``csv`` module's rules).

    Raises ``ValueError(UNTERMINATED)`` for a quote opened and not closed on the line."""
    line = line.rstrip(b"\r\n")
    if not quoted or b'"' not in line:
        return line.split(sep)
    reader = csv.reader(io.StringIO(line.decode("utf-8", "surrogateescape") + "\n\n"), delimiter=sep.decode())
    fields = next(reader)
    if reader.line_num > 1:  # the open quote took the next line in
        raise ValueError(UNTERMINATED)
    return [f.encode("utf-8", "surrogateescape") for f in fields]


def _lines(data: bytes | memoryview) -> list[bytes]:
    data = bytes(data)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    return lines


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
