"""The one reader of tabular click logs: a ``Schema`` in, columnar shards out (``convert``).

Formats: CSV/TSV (with or without a header; Arrow's multi-threaded CSV parser cuts whole-line blocks into
``binary`` columns, ``data.raw``), Parquet (a file or a directory of them, read with ``pyarrow.parquet``
one record batch at a time, row group by row group), JSON lines (Arrow's JSON reader per block of lines)
and libFM/libSVM/libFFM (split in Python, line by line: the slow format, ``data.libfm``). Every format
yields Arrow tables that ``data.decode.Decoder`` turns into labels, dense values and categorical keys;
keys become rows through ``CategoricalEncoder`` and rows are written by ``ShardWriter``. The Criteo and
Avazu readers are two schemas of this one.

Memory is bounded by the block (8 MiB of lines, or a Parquet batch) whatever the file size, plus the
vocabulary in vocab mode (16 B per distinct value while counting) or the distinct-key sets of tables
sized from the data (8 B per value, up to the cap).

Splits: ``sources`` maps ``train``/``eval``/``test`` to files, or a split column (``train``, ``eval``,
``test``) or a time column with a cut routes each row. The training rows alone build the vocabularies,
the hashed table sizes and the standardisation statistics; eval and test rows are encoded with them
(unseen values go to the out-of-vocabulary row 0). The training split is the dataset in ``out``; eval and
test are datasets of the same schema in ``out/eval`` and ``out/test``, named in the manifest's
``extra["splits"]``. ``vocab_from`` encodes new files with an existing dataset's encoding instead.

Malformed input is named ``<file>:<line>: <column> <value> <what is wrong>`` (Parquet: ``<file>: row
<n>``); ``skip_malformed`` drops and counts such rows instead. Everything is written into a staging
directory beside ``out`` and renamed into place when complete: a failed conversion leaves no ``out``
(and an older dataset there untouched).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import sys
import tempfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.json as pajson

from embedscale.data.categorical import CategoricalEncoder
from embedscale.data.decode import SPLITS, Decoded, Decoder
from embedscale.data.fields import show
from embedscale.data.libfm import LineParser
from embedscale.data.raw import (BLOCK_BYTES, MAX_EXAMPLES, LineBlock, _gzip_error, _lines, _open_raw, _prefetch,
                                 iter_line_blocks, read_block_table, split_fields)
from embedscale.data.schema import LABEL_VALUES, Schema
from embedscale.data.shards import MANIFEST, Manifest, ShardWriter, SparseFeatureInfo
from embedscale.errors import ConfigError, InputError
from embedscale.io import _umask, atomic_save_npy

PARQUET_BATCH_ROWS = 65_536


@dataclass
class Chunk:
    """Rows of one file parsed into ``table`` (None: none parsed), with the line (1-based) or Parquet row
    (0-based) of every table row, and the lines the parser itself rejected."""

    path: str
    table: pa.Table | None
    lines: np.ndarray
    rejected: list[tuple[int, str]]
    resolve: Callable
    where: str  # the format, for messages
    rows_unit: bool = False  # Parquet: "row N", else "line N"
    split: int = 0  # the split of the file (file-given splits)
    raw: LineBlock | None = None  # CSV/TSV: the lines (valid while the chunk is decoded), to recount fields
    num_fields: int = 0
    sep: str = ""
    quoted: bool = False  # csv: RFC 4180 quoting
    absent: dict[str, np.ndarray] | None = None  # jsonl: key -> the table rows whose record lacks it

    def field_count_problem(self, line: int, lines: list[bytes]) -> str | None:
        """A line Arrow took as a row but has another number of fields (an empty line is one empty row)."""
        try:
            nf = len(split_fields(lines[line - self.raw.first_line], self.sep.encode(), self.quoted))
        except ValueError as e:
            return str(e)
        return f"expected {self.num_fields} fields, got {nf}" if nf != self.num_fields else None

    def at(self, line: int) -> str:
        return f"{self.path}: row {line}" if self.rows_unit else f"{self.path}:{line}"


# --------------------------------------------------------------------------------------------------
# sources: a format's files -> chunks


class _Columns:
    """The column names of CSV/TSV files (from the header or the schema) and how a reference resolves."""

    def __init__(self, schema: Schema):
        self.schema = schema
        self.names: list[str] | None = list(schema.columns) or None
        self.header: list[bytes] | None = None  # the first header line's fields

    def resolve(self, ref):
        if isinstance(ref, int):
            if ref >= len(self.names):
                raise ConfigError(f"column position {ref} is outside the file's {len(self.names)} columns")
            return self.names[ref]
        if ref not in self.names:
            raise ConfigError(f"column {ref!r} is not among the file's columns ({', '.join(self.names)})")
        return ref


def _first_line(path: Path) -> bytes:
    raw, f = _open_raw(path)
    try:
        return f.readline()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise _gzip_error(path, 1, e) from None
    finally:
        f.close()
        raw.close()


def _csv_is_header(schema: Schema, cols: _Columns, path: Path) -> bool:
    """Whether ``path`` starts with a header line (and, the first time, the column names)."""
    sep = schema.sep.encode()
    head = _first_line(path).rstrip(b"\r\n")
    try:
        fields = split_fields(head, sep, schema.format == "csv")
    except ValueError as e:
        raise InputError(f"{path}:1: {e}") from None
    known = cols.header or ([c.encode() for c in schema.columns] if schema.columns else None)
    if schema.header is True:
        if not head and not _first_line(path):
            raise InputError(f"{path}: empty file, expected a header line")
        if known is not None and fields != known:
            raise InputError(f"{path}:1: header is {show(head, 200)}, expected {show(sep.join(known), 200)} "
                             f"(files without a header line: header none, or auto)")
        is_header = True
    elif schema.header is False:
        is_header = False
    elif known is not None:  # auto
        is_header = fields == known
    elif isinstance(schema.label, str):  # a header names the label column
        is_header = schema.label.encode() in fields
        if not is_header:
            raise ConfigError(f"{path}: header: auto, but the first line does not name the label column "
                              f"{schema.label!r} and the schema lists no columns (give columns: [...])")
    else:  # a positional label: the first line is a header when that field is not a label
        is_header = schema.label < len(fields) and fields[schema.label] not in _label_texts(schema)
    if is_header:
        cols.header = fields
        if cols.names is None:
            cols.names = [x.decode("utf-8", "replace") for x in fields]
    elif cols.names is None and head:
        cols.names = [f"c{i}" for i in range(len(fields))]
    return is_header


def _label_texts(schema: Schema) -> set[bytes]:
    return set(LABEL_VALUES[schema.label_values])


def _csv_chunks(schema: Schema, path: Path, block_bytes: int, update, split: int, cols: _Columns,
                include: list[str] | None) -> Iterator[Chunk]:
    is_header = _csv_is_header(schema, cols, path)
    if cols.names is None:  # an empty file without a header: no rows
        return
    sep = schema.sep
    names = cols.names
    for item in iter_line_blocks(path, block_bytes, header=is_header, on_progress=update, reuse=3):
        if isinstance(item, bytes):
            continue
        yield _csv_chunk(item, names, sep, include, cols, split, schema.format)


def _csv_chunk(block: LineBlock, names: list[str], sep: str, include, cols, split: int, fmt: str) -> Chunk:
    quoted = fmt == "csv"
    try:
        table = read_block_table(block, names, sep, include, quoted)
        if table.num_rows == block.num_lines:
            return Chunk(block.path, table, np.arange(block.first_line, block.first_line + block.num_lines),
                         [], cols.resolve, fmt, split=split, raw=block, num_fields=len(names), sep=sep, quoted=quoted)
    except pa.ArrowInvalid:
        pass
    # the slow path: name the lines with the wrong number of fields, parse the others again
    lines = _lines(block.data)
    bsep = sep.encode()
    rejected, good = [], []
    for i, line in enumerate(lines):
        try:
            nf = len(split_fields(line, bsep, quoted))
        except ValueError as e:
            rejected.append((block.first_line + i, str(e)))
            continue
        if nf != len(names):
            rejected.append((block.first_line + i, f"expected {len(names)} fields, got {nf}"))
        else:
            good.append(i)
    table = None
    if good:
        data = b"\n".join(lines[i] for i in good) + b"\n"
        try:
            table = read_block_table(LineBlock(block.path, data, 0, len(good)), names, sep, include, quoted)
        except pa.ArrowInvalid:
            table = None
        if table is None or table.num_rows != len(good):
            span = f"{block.path}:{block.first_line}-{block.first_line + block.num_lines - 1}"
            raise InputError(f"{span}: malformed input but no single line could be named (a stray '\\r' "
                             f"inside a line?)")
    return Chunk(block.path, table, block.first_line + np.asarray(good, np.int64), rejected, cols.resolve, fmt,
                 split=split)


def _jsonl_chunks(path: Path, block_bytes: int, update, split: int, keys: list[str]) -> Iterator[Chunk]:
    def resolve(ref):
        if isinstance(ref, int):
            raise ConfigError(f"{path}: JSON lines columns are named by key, not by position ({ref})")
        return ref

    for block in iter_line_blocks(path, block_bytes, on_progress=update, reuse=3):
        data = bytes(block.data)
        opts = pajson.ReadOptions(block_size=max(1 << 20, len(data) + 1))
        try:
            table = pajson.read_json(pa.py_buffer(data), read_options=opts)
            if table.num_rows == block.num_lines:
                lines = np.arange(block.first_line, block.first_line + block.num_lines)
                yield Chunk(block.path, table, lines, [], resolve, "jsonl", split=split,
                            absent=_absent_keys(table, keys, lambda: _lines(data)))
                continue
        except pa.ArrowInvalid:
            pass
        lines = _lines(data)
        rejected, good = [], []
        for i, line in enumerate(lines):
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"a JSON {type(obj).__name__}, not an object")
                good.append(i)
            except ValueError as e:
                rejected.append((block.first_line + i, f"not a JSON object ({str(e).splitlines()[0]})"))
        table = absent = None
        if good:
            try:
                table = pajson.read_json(pa.py_buffer(b"\n".join(lines[i] for i in good) + b"\n"), read_options=opts)
            except pa.ArrowInvalid as e:
                raise InputError(f"{block.path}:{block.first_line}-{block.first_line + block.num_lines - 1}: "
                                 f"{str(e).splitlines()[0]} (a key whose values change type?)") from None
            absent = _absent_keys(table, keys, lambda: [lines[i] for i in good])
        yield Chunk(block.path, table, block.first_line + np.asarray(good, np.int64), rejected, resolve, "jsonl",
                    split=split, absent=absent)


def _absent_keys(table: pa.Table, keys: list[str], records: Callable[[], list[bytes]]) -> dict[str, np.ndarray]:
    """key -> the rows whose record has no such key. Arrow reads an absent key as null, as ``null``
    itself: the records of null rows alone are parsed again to tell them apart."""
    n = table.num_rows
    out, nulls = {}, {}
    for key in keys:
        i = table.schema.get_field_index(key)
        if i < 0:
            out[key] = np.ones(n, bool)
        elif table.column(i).null_count:
            nulls[key] = np.flatnonzero(table.column(i).is_null().to_numpy(zero_copy_only=False))
    if nulls:
        lines = records()
        objs = {int(r): json.loads(lines[r]) for r in np.unique(np.concatenate(list(nulls.values())))}
        for key, rows in nulls.items():
            mask = np.zeros(n, bool)
            mask[np.array([r for r in rows if key not in objs[int(r)]], np.int64)] = True
            if mask.any():
                out[key] = mask
    return out


def _parquet_files(path: Path) -> list[str]:
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*.parquet"))
        if not files:
            raise InputError(f"{path}: a directory without .parquet files")
        return files
    return [str(path)]


def _parquet_chunks(schema: Schema, path: Path, needed: Callable[[list[str]], list[str]], update,
                    split: int) -> Iterator[Chunk]:
    for file in _parquet_files(path):
        try:
            pf = pq.ParquetFile(file)
            names = pf.schema_arrow.names
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"{file}: not a readable Parquet file ({str(e).splitlines()[0]})") from None

        def resolve(ref, names=names, file=file):
            if isinstance(ref, int):
                if ref >= len(names):
                    raise ConfigError(f"{file}: column position {ref} is outside its {len(names)} columns")
                return names[ref]
            if ref not in names:
                raise InputError(f"{file}: no column {ref!r} (columns: {', '.join(names)})")
            return ref

        cols = needed(resolve)
        row = 0
        try:
            # row group by row group, as the encoder consumes them: a dataset scanner reads ahead of a slower
            # consumer without bound (2.3 GiB at peak on 1 GB of Criteo rows, against 1.2 GiB as CSV)
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=cols, use_threads=True):
                n = batch.num_rows
                yield Chunk(file, pa.Table.from_batches([batch]), np.arange(row, row + n), [], resolve, "parquet",
                            rows_unit=True, split=split)
                row += n
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"{file}: unreadable Parquet data after row {row} ({str(e).splitlines()[0]})") from None
        update(os.path.getsize(file))


def _libfm_chunks(schema: Schema, path: Path, block_bytes: int, update, split: int) -> Iterator[Chunk]:
    """libFM/libSVM ``label index:value ...`` or libFFM ``label field:index:value ...`` (``data.libfm``)."""
    parser = LineParser(schema)
    for block in iter_line_blocks(path, block_bytes, on_progress=update, reuse=3):
        table, good, rejected = parser.table(_lines(block.data), block.first_line)
        yield Chunk(block.path, table, block.first_line + np.asarray(good, np.int64), rejected, parser.resolve,
                    schema.format, split=split)


# --------------------------------------------------------------------------------------------------
# the conversion driver


class _Skipped:
    def __init__(self) -> None:
        self.count = 0
        self.examples: list[str] = []

    def add(self, where: list[str]) -> None:
        self.count += len(where)
        self.examples.extend(where[: MAX_EXAMPLES - len(self.examples)])


def _as_paths(paths) -> list[Path]:
    if paths is None:
        return []
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [Path(p) for p in paths]
    for p in out:
        if not (p.is_file() or p.is_dir()):
            raise InputError(f"{p}: no such file")
    return out


class _Reader:
    """Files of every split -> decoded, checked blocks (malformed rows raised or skipped and counted)."""

    def __init__(self, schema: Schema, decoder: Decoder, sources: dict[str, list[Path]], block_bytes: int,
                 skip_malformed: bool, progress: bool):
        self.schema, self.decoder, self.sources = schema, decoder, sources
        self.block_bytes, self.skip_malformed, self.progress = block_bytes, skip_malformed, progress
        self.columns: _Columns | None = None  # CSV/TSV: the column names, once the first file is open
        self.absent_counts: dict[str, int] = {}  # JSON lines: optional key -> records without it

    def _needed(self, resolve) -> list[str]:
        s = self.schema
        refs = [s.label] + [c.column for c in s.dense] + [c.column for c in s.sparse]
        refs += [s.weight] if s.weight is not None else []
        names = [resolve(r) for r in refs]
        for extra in (self.decoder.split_column, self.decoder.time_column):
            if extra:
                names.append(resolve(extra) if not isinstance(extra, str) else extra)
        return list(dict.fromkeys(names))

    def _chunks(self, splits: Sequence[str], update) -> Iterator[Chunk]:
        s = self.schema
        cols = self.columns = _Columns(s)
        for name in splits:
            split = SPLITS.index(name)
            for path in self.sources.get(name, []):
                if s.format in ("csv", "tsv"):
                    if cols.names is None:
                        _csv_is_header(s, cols, path)  # the names, before the include list
                    include = self._needed(cols.resolve) if cols.names else None
                    yield from _csv_chunks(s, path, self.block_bytes, update, split, cols, include)
                elif s.format == "parquet":
                    yield from _parquet_chunks(s, path, self._needed, update, split)
                elif s.format == "jsonl":
                    yield from _jsonl_chunks(path, self.block_bytes, update, split, self._needed(lambda r: r))
                else:
                    yield from _libfm_chunks(s, path, self.block_bytes, update, split)

    def _absent(self, chunk: Chunk, dec: Decoded, count: bool, problems: list) -> np.ndarray:
        """JSON lines: records without a declared key. An optional column's are counted (``count``: once, in
        the writing pass) and read as missing; any other's are malformed lines, named with the key (added to
        ``problems`` and ``dec.bad``). Returns the rows so named."""
        named = np.zeros(dec.rows, bool)
        optional = {c.column for c in [*self.schema.dense, *self.schema.sparse] if c.optional}
        for key, rows in chunk.absent.items():
            if key in optional:
                if count:
                    self.absent_counts[key] = self.absent_counts.get(key, 0) + int(rows.sum())
                continue
            for i in np.flatnonzero(rows & ~named):
                problems.append((int(chunk.lines[i]), f"no key {key!r} (a column that may be absent is "
                                                      f"optional: true in the schema)"))
            named |= rows
        dec.bad |= named
        return named

    def blocks(self, splits: Sequence[str], desc: str, skipped: _Skipped | None,
               raw_dense: bool = False) -> Iterator[tuple[Decoded, np.ndarray | None]]:
        """(decoded good rows, their standardised columns' raw values when ``raw_dense``) of every block."""
        from tqdm import tqdm

        files = [p for name in splits for p in self.sources.get(name, [])]
        total = sum(_size(p) for p in files)
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not self.progress,
                  file=sys.stderr) as bar:
            chunks = _prefetch(self._chunks(splits, bar.update))
            try:
                for chunk in chunks:
                    yield self._decode(chunk, skipped, raw_dense)
            finally:
                chunks.close()

    def _decode(self, chunk: Chunk, skipped: _Skipped | None, raw_dense: bool):
        problems = list(chunk.rejected)
        dec = raw = None
        table = chunk.table
        if table is not None and table.num_rows:
            if chunk.where == "jsonl":  # a key no line of the block has: missing in every row
                for name in self._needed(chunk.resolve):
                    if table.schema.get_field_index(name) < 0:
                        table = table.append_column(name, pa.nulls(table.num_rows))
            dec = self.decoder.decode(table, chunk.resolve, chunk.path)
            named = self._absent(chunk, dec, skipped is not None, problems) if chunk.absent else False
            if dec.bad.any():
                lines = _lines(chunk.raw.data) if chunk.raw is not None else None
                for i in np.flatnonzero(dec.bad & ~named):
                    line = int(chunk.lines[i])
                    why = chunk.field_count_problem(line, lines) if lines is not None else None
                    problems.append((line, why or dec.why(int(i))))
            if raw_dense and self.decoder.standardised:
                raw = self.decoder.raw_dense(table, chunk.resolve, chunk.path)
        if problems:
            problems.sort()
            where = [f"{chunk.at(line)}: {reason}" for line, reason in problems]
            if not self.skip_malformed:
                more = f" (and {len(where) - 1} more malformed lines in this block)" if len(where) > 1 else ""
                raise InputError(where[0] + more)
            if skipped is not None:
                skipped.add(where)
            if dec is not None and dec.bad.any():
                keep = ~dec.bad
                raw = raw[:, keep] if raw is not None else None
                dec = dec.select(keep)
        if dec is None:
            return None, None
        if dec.split is None:
            dec.split = np.full(dec.rows, chunk.split, np.int8)
        return dec, raw


def _size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*.parquet"))
    return p.stat().st_size


def _encoding_from(dataset: Path, schema: Schema) -> dict:
    """What ``vocab_from`` carries: mode, table rows, vocabularies, standardisation statistics."""
    m = Manifest.load(dataset)
    x = m.extra
    if m.sparse_names != schema.sparse_names or m.dense_names != schema.dense_names:
        raise ConfigError(f"--vocab-from {dataset}: its features differ from this schema's: "
                          + describe_difference(m.dense_names, m.sparse_names, schema.dense_names,
                                                schema.sparse_names))
    out = {"categorical": x.get("categorical", "hash"), "table_rows": [s.num_rows for s in m.sparse],
           "min_frequency": x.get("min_frequency", 1), "dense_stats": x.get("dense_stats"),
           "columns": x.get("columns")}
    if out["categorical"] == "vocab":
        vocab = []
        for name in m.sparse_names:
            f = dataset / f"vocab-{name}.npy"
            if not f.exists():
                raise ConfigError(f"--vocab-from {dataset}: {f.name} is missing (a vocab dataset keeps one per feature)")
            vocab.append(np.load(f, allow_pickle=False))
        out["vocab"] = vocab
    return out


def describe_difference(dense_a, sparse_a, dense_b, sparse_b, rows_a=None, rows_b=None) -> str:
    """The features (and table rows) two schemas do not share, in words."""
    parts = []
    for what, a, b in (("dense", dense_a, dense_b), ("categorical", sparse_a, sparse_b)):
        only_a = [n for n in a if n not in b]
        only_b = [n for n in b if n not in a]
        if only_a:
            parts.append(f"{what} {', '.join(only_a)} only in the first")
        if only_b:
            parts.append(f"{what} {', '.join(only_b)} only in the second")
        if not only_a and not only_b and list(a) != list(b):
            parts.append(f"{what} features in another order")
    if rows_a is not None and rows_b is not None:
        diff = [f"{n}: {ra} vs {rows_b[n]}" for n, ra in rows_a.items() if n in rows_b and rows_b[n] != ra]
        if diff:
            parts.append("table rows differ (" + "; ".join(diff[:8]) + (" ..." if len(diff) > 8 else "") + ")")
    return "; ".join(parts) or "none"


def convert(schema: Schema, sources, out_dir, *, categorical: str = "hash",
            table_rows: int | Sequence[int] | dict = 0, min_frequency: int = 1, load_factor: float = 0.5,
            max_table_rows: int = 1_000_000, shard_rows: int = 1_000_000, skip_malformed: bool = False,
            max_rows: int | None = None, progress: bool = True, block_bytes: int = BLOCK_BYTES,
            vocab_from: str | os.PathLike | None = None, split_column: str | None = None,
            time_column: str | None = None, eval_from: str | None = None, test_from: str | None = None) -> Manifest:
    """Read click logs described by ``schema`` into an embedscale shard directory.

    Args:
        schema: the columns and the format (``Schema.load("schema.yaml")``, a preset).
        sources: files (or Parquet directories) read in order, or ``{"train": [...], "eval": [...], "test":
            [...]}``. Eval and test become ``out/eval`` and ``out/test``.
        categorical: ``hash`` (key % rows) or ``vocab`` (rows by descending count, ``min_frequency`` cut).
        table_rows: hashed table rows: one for all, a list, or ``{feature: rows}``; 0 (and the schema's
            ``rows: 0``) sizes a table from the training data: ``min(max_table_rows, ceil(distinct /
            load_factor))``.
        vocab_from: an existing dataset whose encoding (vocabularies or table rows, statistics) this one
            reuses, so its rows mean the same; unseen values go to row 0 (vocab) or hash as before.
        split_column / time_column with eval_from (and test_from): route rows by a column instead of by file.
        skip_malformed, max_rows, shard_rows, progress, block_bytes: as ``convert_criteo``.

    Returns:
        The training dataset's ``Manifest`` (``extra["splits"]`` names the eval and test datasets).
    """
    sources = _check_sources(sources, split_column, time_column, max_rows, shard_rows)
    out = Path(out_dir)
    _check_out_dir(out)
    rows = _table_rows_given(schema, table_rows)
    decoder = Decoder(schema, split_column, time_column, eval_from, test_from)
    carried = None
    if vocab_from:
        carried = _encoding_from(Path(vocab_from), schema)
        categorical, rows, min_frequency = carried["categorical"], carried["table_rows"], carried["min_frequency"]
    enc = CategoricalEncoder(schema.sparse_names, categorical, rows, min_frequency, load_factor, max_table_rows)
    if carried is not None:
        schema = _reuse_encoding(carried, schema, enc, decoder)
    reader = _Reader(schema, decoder, sources, block_bytes, skip_malformed, progress)
    row_split = bool(split_column or time_column)

    # pass 1: the training rows' vocabularies, distinct counts and dense statistics
    needs_stats = bool(decoder.standardised) and decoder.stats is None
    passes = 2 if (enc.needs_counts or needs_stats) else 1
    if passes == 2:
        categorical = _statistics_pass(reader, schema, enc, decoder, needs_stats, max_rows, categorical)

    # pass 2: the shards
    extra = _manifest_extra(schema, sources, enc, decoder, categorical, load_factor, max_table_rows, vocab_from)
    shards = _ShardPass(schema, sources, enc, reader, row_split, max_rows)
    manifest = shards.run_staged(out, extra, categorical, shard_rows, passes)
    _warn_skipped_and_absent(schema, shards.skipped, reader)
    return manifest


def _check_sources(sources, split_column, time_column, max_rows, shard_rows) -> dict[str, list[Path]]:
    """``sources`` as ``{split: [paths]}``, checked with the options that route rows."""
    sources = {"train": _as_paths(sources)} if not isinstance(sources, dict) else \
        {k: _as_paths(v) for k, v in sources.items() if v}
    unknown = sorted(set(sources) - set(SPLITS))
    if unknown:
        raise ConfigError(f"splits are train, eval, test; got {', '.join(unknown)}")
    if not any(sources.values()):
        raise InputError("no input files given")
    if not sources.get("train"):
        raise InputError("no training files given (PATHS or --train: the dataset itself; its vocabulary and table "
                         "sizes come from them unless --vocab-from DATASET)")
    if (split_column or time_column) and set(sources) != {"train"}:
        raise ConfigError("a split column or time column routes the rows of one set of files: give no --eval/--test files")
    if split_column and time_column:
        raise ConfigError("give a split column or a time column, not both")
    if max_rows is not None and max_rows < 0:
        raise ConfigError(f"max_rows must be >= 0, got {max_rows}")
    if shard_rows <= 0:
        raise ConfigError(f"shard_rows must be positive, got {shard_rows}")
    return sources


def _check_out_dir(out: Path) -> None:
    """``out`` is absent, empty or an embedscale dataset, and writable."""
    if out.exists() and out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"{out}: not writable (permission denied)")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).exists())):
        raise ConfigError(f"{out}: exists and is not an embedscale dataset (no {MANIFEST}); choose another --out "
                          f"or remove it")


def _table_rows_given(schema: Schema, table_rows) -> list[int]:
    """Per categorical feature, the rows ``table_rows`` (one for all, a list or ``{feature: rows}``) asks for."""
    names = schema.sparse_names
    if isinstance(table_rows, dict):
        unknown = sorted(set(table_rows) - set(names))
        if unknown:
            raise ConfigError(f"table rows given for {', '.join(unknown)}, which the schema does not have "
                              f"(categorical: {', '.join(names)})")
        return [int(table_rows.get(c.name, c.rows)) for c in schema.sparse]
    if np.isscalar(table_rows):
        return [c.rows or int(table_rows) for c in schema.sparse]
    return [int(r) for r in table_rows]


def _reuse_encoding(carried: dict, schema: Schema, enc: CategoricalEncoder, decoder: Decoder) -> Schema:
    """``vocab_from``: take the other dataset's vocabularies and standardisation statistics; a CSV/TSV schema
    without column names takes that dataset's names. Returns the schema to read with."""
    if carried["categorical"] == "vocab":
        enc.set_vocab(carried["vocab"])
    if decoder.standardised:
        decoder.stats = [tuple(s) for s in carried["dense_stats"]]
    if carried["columns"] and schema.format in ("csv", "tsv") and not schema.columns:
        schema = Schema.from_dict({**schema.to_dict(), "columns": carried["columns"]}, "schema")  # names of before
    return schema


def _statistics_pass(reader: _Reader, schema: Schema, enc: CategoricalEncoder, decoder: Decoder,
                     needs_stats: bool, max_rows: int | None, categorical: str) -> str:
    """Pass 1 over the training rows (the first ``max_rows``): count the keys (vocabularies, tables sized from
    the data) and the standardised columns' mean and deviation. Returns the categorical mode (``auto``
    becomes what the counts decided)."""
    acc = np.zeros((len(decoder.standardised), 3))  # count, sum, sum of squares
    seen = 0
    for dec, raw in reader.blocks(["train"], f"{schema.name} 1/2 statistics", None, raw_dense=needs_stats):
        if dec is None:
            continue
        train = dec.split == 0
        if max_rows is not None:  # the rows pass 2 keeps
            train &= np.arange(dec.rows) < max_rows - seen
            seen += dec.rows
        if not train.all():
            raw = raw[:, train] if raw is not None else None
            dec = dec.select(train)
        if enc.needs_counts:
            enc.count(dec.keys)
        if raw is not None and raw.size:
            acc += np.stack([np.full(len(raw), raw.shape[1]), raw.sum(1), (raw * raw).sum(1)], axis=1)
        if max_rows is not None and seen >= max_rows:
            break
    if enc.needs_counts:
        enc.build()
        categorical = enc.mode  # auto: vocab or hash, as the counts decided
    if needs_stats:
        decoder.stats = []
        for count, s1, s2 in acc:
            mean = s1 / count if count else 0.0
            var = max(s2 / count - mean * mean, 0.0) if count else 0.0
            decoder.stats.append((float(mean), float(np.sqrt(var)) or 1.0))
    return categorical


def _manifest_extra(schema: Schema, sources: dict, enc: CategoricalEncoder, decoder: Decoder, categorical: str,
                    load_factor: float, max_table_rows: int, vocab_from) -> dict:
    """What every split's manifest records of the conversion: sources, encoding, statistics, schema."""
    names = schema.sparse_names
    all_files = [str(p) for name in SPLITS for p in sources.get(name, [])]
    extra = {"source": all_files, "format": schema.name, "categorical": categorical}
    if categorical == "hash":
        extra["table_rows"] = list(enc.table_rows)
        if any(enc.sized_from_data):
            extra["table_sizing"] = {"sized_from_data": [n for n, a in zip(names, enc.sized_from_data) if a],
                                     "load_factor": load_factor, "max_table_rows": max_table_rows}
    else:
        extra.update(min_frequency=enc.min_frequency, vocab_files=[f"vocab-{n}.npy" for n in names],
                     vocab_order="rows 1..V by descending count, ties by ascending key; row 0: rarer or unseen "
                                 "keys; vocab-<feature>.npy[i - 1] is the key of row i")
    if decoder.standardised:
        extra["dense_stats"] = [list(s) for s in decoder.stats]
    if vocab_from:
        extra["vocab_from"] = str(vocab_from)
    extra.update(schema.notes)
    extra["schema"] = schema.to_dict()
    return extra


class _ShardPass:
    """Pass 2: every split's rows encoded and written as shards into a staging directory beside ``out``, renamed
    into place when complete (a failure leaves no ``out``, an older dataset there untouched)."""

    def __init__(self, schema: Schema, sources: dict, enc: CategoricalEncoder, reader: _Reader, row_split: bool,
                 max_rows: int | None) -> None:
        self.schema, self.sources, self.enc, self.reader = schema, sources, enc, reader
        self.row_split, self.max_rows = row_split, max_rows
        self.skipped = _Skipped()
        self.present = [name for name in SPLITS if sources.get(name)] if not row_split else list(SPLITS)
        self.all_files = [str(p) for name in SPLITS for p in sources.get(name, [])]

    def run_staged(self, out: Path, extra: dict, categorical: str, shard_rows: int, passes: int) -> Manifest:
        out_parent = out.resolve().parent
        try:
            made = _make_parents(out_parent)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out_parent))
        except OSError as e:  # a read-only place: name the directory asked for
            raise OSError(e.errno, e.strerror, str(out)) from e
        try:
            writers = self._writers(staging, extra, shard_rows)
            counts = self._write(writers, passes)
            manifest = self._close(writers, counts, categorical)
            _publish(staging, out)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    d.rmdir()
            if isinstance(e, OSError) and e.filename and str(e.filename).startswith(str(staging)):
                # name the file the user asked for, not the staging copy (a full disk, a size limit)
                where = out / Path(e.filename).relative_to(staging)
                raise OSError(e.errno, e.strerror, str(where)) from e
            raise
        return manifest

    def _writers(self, staging: Path, extra: dict, shard_rows: int) -> dict[str, ShardWriter]:
        s = self.schema
        sparse = [SparseFeatureInfo(c.name, r, c.multi_hot, c.id_weights)
                  for c, r in zip(s.sparse, self.enc.table_rows)]
        writers = {}
        for name in self.present:
            d = staging if name == "train" else staging / name
            writers[name] = ShardWriter(d, s.dense_names, sparse, shard_rows=shard_rows,
                                        extra={**extra, "split": name}, weighted=s.weight is not None)
        return writers

    def _write(self, writers: dict[str, ShardWriter], passes: int) -> dict[str, int]:
        """Every block's good rows (the first ``max_rows``), encoded, to the writer of its split; rows per split."""
        schema, enc, max_rows = self.schema, self.enc, self.max_rows
        counts = dict.fromkeys(self.present, 0)
        total = 0
        for dec, _ in self.reader.blocks(self.present if not self.row_split else ["train"],
                                         f"{schema.name} {passes}/{passes} shards", self.skipped):
            if dec is None:
                continue
            if max_rows is not None and total + dec.rows > max_rows:
                dec = dec.head(max_rows - total)
            total += dec.rows
            for i, name in enumerate(SPLITS):
                if name not in writers:
                    continue
                part = dec if (dec.split == i).all() else dec.select(dec.split == i)
                if not part.rows:
                    continue
                counts[name] += part.rows
                sp = {}
                for f, c in enumerate(schema.sparse):
                    ids = enc.encode_feature(f, part.keys[f])
                    sp[c.name] = (ids, part.lengths[f]) if c.multi_hot else ids
                    if c.id_weights:
                        sp[c.name] += (part.id_weights[f],)
                writers[name].write(part.labels, part.dense, sp, weights=part.weights)
            if max_rows is not None and total >= max_rows:
                break
        return counts

    def _close(self, writers: dict[str, ShardWriter], counts: dict[str, int], categorical: str) -> Manifest:
        """Finish the manifests, refuse a split without rows, write the vocabularies, drop the empty row-routed
        splits. Returns the training manifest."""
        reader, skipped, present, row_split = self.reader, self.skipped, self.present, self.row_split
        why = f" ({skipped.count} malformed lines skipped)" if skipped.count else ""
        if reader.columns is not None and reader.columns.names:
            for w in writers.values():
                w.manifest.extra["columns"] = list(reader.columns.names)  # what --vocab-from files without a header use
        for w in writers.values():
            if reader.absent_counts:
                w.manifest.extra["absent_keys"] = dict(reader.absent_counts)  # optional keys read as missing
        for name in present:
            if counts[name] == 0 and self.max_rows != 0 and (name == "train" or not row_split):
                files = (", ".join(str(p) for p in self.sources.get(name, [])) if not row_split
                         else ", ".join(self.all_files))
                raise InputError(f"{files}: no rows{why}" if name == "train" or row_split
                                 else f"{files}: no rows{why} (the {name} files)")
        kept = [n for n in present if counts[n] or n == "train"]
        splits = {n: n for n in kept if n != "train"}
        for name in kept:
            w = writers[name]
            w.manifest.extra["skipped"] = {"count": skipped.count, "examples": skipped.examples}
            if name == "train" and splits:
                w.manifest.extra["splits"] = splits
            w.close()
            if categorical == "vocab":
                for fname, (_, _, by_row) in zip(self.schema.sparse_names, self.enc.vocab):
                    atomic_save_npy(w.dir / f"vocab-{fname}.npy", by_row)  # key of row i is by_row[i - 1]
        for name in present:
            if name not in kept:
                shutil.rmtree(writers[name].dir, ignore_errors=True)
        return writers["train"].manifest


def _warn_skipped_and_absent(schema: Schema, skipped: _Skipped, reader: _Reader) -> None:
    """Warn (at ``convert``'s caller's caller) of skipped malformed lines and of optional keys read as missing."""
    if skipped.count:
        warnings.warn(f"{schema.name}: skipped {skipped.count} malformed line(s), first: "
                      + "; ".join(skipped.examples[:3]), stacklevel=4)
    if reader.absent_counts:
        warnings.warn(f"{schema.name}: records without an optional key, read as missing: " + ", ".join(
            f"{k} {n:,}" for k, n in reader.absent_counts.items()), stacklevel=4)


def _make_parents(d: Path) -> list[Path]:
    """Create ``d`` and its missing parents; return the ones created (removed again on failure)."""
    made = []
    p = d
    while not p.exists():
        made.append(p)
        p = p.parent
    d.mkdir(parents=True, exist_ok=True)
    return made


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished dataset into place; an older dataset at ``out`` goes only once the new one is there."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        else:
            out.rmdir()
    os.replace(staging, out)
    os.chmod(out, 0o777 & ~_umask())  # mkdtemp made it 0700; a dataset directory is as mkdir would make it
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
