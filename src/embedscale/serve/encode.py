"""Raw feature values -> the model's inputs, exactly as the training data was encoded.

An export keeps the dataset's schema (columns, dense parsing and transform, categorical key kind), its
categorical encoding (``hash``: row = key % table rows; ``vocab``: the training vocabulary, unseen or rare
values to the out-of-vocabulary row 0) and the standardisation statistics. :class:`RowEncoder` decodes with
the training reader's own :class:`~embedscale.data.decode.Decoder` and
:class:`~embedscale.data.categorical.CategoricalEncoder`, so a value served is the row it was trained on.

Two inputs: JSON rows (``{"I1": 3, "C1": "68fd1e64", ...}``, every feature of the schema by name, checked
by :meth:`RowEncoder.check_rows` with an error naming the row and the feature) and files of the schema
(:func:`read_file`: csv/tsv, parquet, jsonl; labeled or not). A dataset without a raw schema (synthetic data,
shard directories) is served by *ids*: each categorical value is its row, checked against the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.data.categorical import CategoricalEncoder
from embedscale.data.decode import Decoder
from embedscale.data.schema import Schema
from embedscale.errors import InputError

LABEL = "__label__"  # the label column a request or an unlabeled file gets (never read)
WEIGHT = "__weight__"


class RequestError(InputError):
    """A request row the model cannot score: ``row`` (0-based) and ``field`` name it."""

    def __init__(self, message: str, row: int | None = None, field: str | None = None):
        super().__init__(message)
        self.row, self.field = row, field


@dataclass
class Encoded:
    """Model inputs of N rows: ``dense [N, D]`` float32, ``sparse`` (features in schema order), ``labels``
    (int8 ``[N]``, or ``None`` unlabeled), ``weights`` (sample weights or ``None``)."""

    dense: torch.Tensor
    sparse: JaggedFeatures
    labels: np.ndarray | None = None
    weights: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.dense.shape[0])


class RowEncoder:
    """Encode raw rows with an export's ``encoding`` (manifest section) and vocabularies."""

    def __init__(self, encoding: dict, vocab: dict[str, np.ndarray] | None = None):
        self.encoding = encoding
        self.dense_names = list(encoding["dense"])
        self.sparse = [dict(s) for s in encoding["sparse"]]  # {name, num_rows, multi_hot}
        self.sparse_names = [s["name"] for s in self.sparse]
        self.schema = Schema.from_dict(encoding["schema"], "export schema") if encoding.get("schema") else None
        self.features = self.dense_names + self.sparse_names
        if self.schema is None:
            return
        self.decoder = Decoder(self.schema)
        if self.decoder.standardised:
            self.decoder.stats = [tuple(s) for s in encoding["dense_stats"]]
        self.cat = CategoricalEncoder(self.sparse_names, encoding["categorical"],
                                      [s["num_rows"] for s in self.sparse])
        if encoding["categorical"] == "vocab":
            self.cat.set_vocab([np.asarray(vocab[n]).view(np.uint64) for n in self.sparse_names])
        self._kinds = {c.name: ("dense", c) for c in self.schema.dense}
        self._kinds.update({c.name: ("sparse", c) for c in self.schema.sparse})

    # -- JSON rows ---------------------------------------------------------------------------------
    def check_rows(self, rows, features: list[str] | None = None) -> None:
        """Every row a JSON object holding exactly the schema's features (or ``features``, a part of them) with
        values of their kind (dense: a number or null; categorical: a string, an integer or null; multi-hot: a
        list of them); the first problem is a :class:`RequestError` naming the row and the feature."""
        if not isinstance(rows, list):
            raise RequestError("'rows' must be a list of objects, one per row to score", field="rows")
        features = self.features if features is None else features
        want = set(features)
        if _plain_rows(rows, want, [f for f in self.dense_names if f in want],
                       [f for f in self.sparse_names if f in want]):
            return  # the common request, checked column by column at once; any other gets the checks below
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise RequestError(f"row {i}: expected an object of features, got {type(r).__name__}", row=i)
            missing = [f for f in features if f not in r]
            if missing:
                raise RequestError(f"row {i}: missing feature {missing[0]!r}"
                                   + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                                   row=i, field=missing[0])
            extra = sorted(k for k in r if k not in want)
            if extra:
                raise RequestError(f"row {i}: unknown feature {extra[0]!r} (the schema's features: "
                                   f"{', '.join(self.features)})", row=i, field=str(extra[0]))
            for f in features:
                why = self._bad_value(f, r[f])
                if why:
                    raise RequestError(f"row {i}, feature {f!r}: {why}", row=i, field=f)

    def _bad_value(self, f: str, v) -> str | None:
        """Why ``v`` cannot be feature ``f``'s value, or ``None`` (:func:`_plain_ok` accepts a subset at once)."""
        dense = f in self.dense_names
        multi = not dense and self._multi_hot(f)
        if v is None:
            return None
        if dense:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return f"expected a number or null, got {type(v).__name__} {_show(v)}"
            if isinstance(v, float) and not math.isfinite(v):
                return f"{v} is not a finite number"
            if isinstance(v, int) and abs(v) >= 10 ** 18:
                return f"{v} is out of range (at most 18 digits)"
            return None
        values = v if multi and isinstance(v, list) else [v]
        for x in values:
            if isinstance(x, bool) or not isinstance(x, (str, int)):
                kind = "a list of strings or integers" if multi else "a string, an integer or null"
                return f"expected {kind}, got {type(x).__name__} {_show(x)}"
            if isinstance(x, str) and len(x) > 4096:
                return f"a value of {len(x)} characters (at most 4096)"
        return None

    def _multi_hot(self, f: str) -> bool:
        return bool(self.sparse[self.sparse_names.index(f)]["multi_hot"])

    def encode_rows(self, rows: list[dict], features: list[str] | None = None) -> Encoded:
        """Checked JSON rows -> model inputs (a value the schema's parser rejects, e.g. ``"xyz"`` for a hex
        key, is a :class:`RequestError` naming row and feature). ``features``: the rows hold these features
        only (a ranking call's context or its candidates); the others are encoded as missing values, and only
        the given features' inputs are meant to be read (``serve.ranking``)."""
        self.check_rows(rows, features)
        given = set(self.features if features is None else features)
        if self.schema is None:
            return self._ids(rows, given)
        n = len(rows)
        cols = {LABEL: pa.array([b"0"] * n, pa.binary())}
        if self.schema.weight is not None:
            cols[WEIGHT] = pa.array([1.0] * n, pa.float64())
        for f in self.dense_names:
            # as the text of a file: the training reader's parsers (and their errors) apply unchanged
            cols[f] = pa.array([None if r[f] is None else repr(r[f]) for r in rows], pa.string()) \
                if f in given else pa.nulls(n, pa.string())
        for f in self.sparse_names:
            if f not in given:
                cols[f] = pa.nulls(n, pa.list_(pa.string()) if self._multi_hot(f) else pa.string())
            elif self._multi_hot(f):
                vals = [None if r[f] is None else [str(x) for x in (r[f] if isinstance(r[f], list) else [r[f]])]
                        for r in rows]
                cols[f] = pa.array(vals, pa.list_(pa.string()))
            else:
                cols[f] = pa.array([None if r[f] is None else str(r[f]) for r in rows], pa.string())
        return self.encode_table(pa.table(cols), "request", labeled=False)

    # -- tables (requests and files) ---------------------------------------------------------------
    def resolve(self, ref) -> str:
        """A schema column reference -> the name of the column in a request table (the feature's name)."""
        s = self.schema
        if ref == s.label:
            return LABEL
        if s.weight is not None and ref == s.weight:
            return WEIGHT
        for c in s.dense + s.sparse:
            if c.column == ref:
                return c.name
        return str(ref)

    def encode_table(self, table: pa.Table, where: str, *, labeled: bool, first_line: int = 0,
                     resolve=None) -> Encoded:
        """A decoded block of raw columns -> model inputs. A rejected row is a :class:`RequestError` naming
        its row (``first_line`` + its index) and the feature with its value."""
        dec = self.decoder.decode(table, resolve or self.resolve, where)
        if dec.bad.any():
            i = int(np.flatnonzero(dec.bad)[0])
            name = next((n for n, mask, _ in dec.reasons if mask[i]), None)
            raise RequestError(f"{where}: row {first_line + i}: {dec.why(i)}", row=first_line + i, field=name)
        values, lengths = [], []
        for f, k in enumerate(dec.keys):
            values.append(self.cat.encode_feature(f, k))
            n = dec.rows
            lengths.append(dec.lengths[f] if dec.lengths[f] is not None else np.ones(n, np.int64))
        sparse = JaggedFeatures(self.sparse_names, torch.from_numpy(np.concatenate(values).astype(np.int64)),
                                torch.from_numpy(np.concatenate(lengths).astype(np.int64)))
        return Encoded(torch.from_numpy(np.ascontiguousarray(dec.dense, np.float32)), sparse,
                       dec.labels if labeled else None, dec.weights if labeled else None)

    def _ids(self, rows: list[dict], given: set[str]) -> Encoded:
        """Rows of an id-encoded dataset: dense values as given (missing 0), categorical values their rows; a
        feature not ``given`` is missing in every row (dense 0, an empty bag)."""
        n_rows = len(rows)
        dense = np.zeros((n_rows, len(self.dense_names)), np.float32)
        for j, f in enumerate(self.dense_names):
            if f in given:
                dense[:, j] = [0.0 if r[f] is None else float(r[f]) for r in rows]
        values, lengths = [], []
        for s in self.sparse:
            f, n = s["name"], s["num_rows"]
            if f not in given:
                lengths.append(np.zeros(n_rows, np.int64))
                continue
            col = [r[f] for r in rows]
            if set(map(type, col)) <= {int} and -n <= min(col, default=0) and max(col, default=0) <= n:
                ids = np.array(col, dtype=np.int64)  # one id a row, every one a small int: checked as an array
                if not ids.size or (0 <= ids.min() and ids.max() < n):
                    values.append(ids)
                    lengths.append(np.ones(n_rows, np.int64))
                    continue
            ids, lens = [], []
            for i, r in enumerate(rows):
                v = r[f]
                bag = [] if v is None else (v if isinstance(v, list) else [v])
                for x in bag:
                    if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n:
                        raise RequestError(f"row {i}, feature {f!r}: {_show(x)} is not a row id in [0, {n}) "
                                           "(this model was trained on id-encoded data)", row=i, field=f)
                ids.extend(bag)
                lens.append(len(bag))
            values.append(np.array(ids, np.int64))
            lengths.append(np.array(lens, np.int64))
        cat = lambda parts: torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))  # noqa: E731
        return Encoded(torch.from_numpy(dense), JaggedFeatures(self.sparse_names, cat(values), cat(lengths)))


_NONE = type(None)


def _plain_rows(rows: list, want: set, dense: list[str], sparse: list[str]) -> bool:
    """Every row an object of exactly the features ``want``, dense values ``None``, ints or floats (finite, under
    18 digits), categorical ones ``None``, ints or strings of at most 4,096 characters: valid for sure. ``False``
    means only "check them row by row" (:meth:`RowEncoder.check_rows`, whose messages name row and feature);
    the checks are the same, made per column in C loops."""
    if not all(type(r) is dict and r.keys() == want for r in rows):
        return False
    for f in dense:
        col = [r[f] for r in rows]
        kinds = set(map(type, col))
        if not kinds <= {int, float, _NONE}:
            return False
        try:
            a = np.array([0 if x is None else x for x in col], dtype=np.float64) if kinds - {_NONE} else None
        except OverflowError:  # an integer past float64's range
            return False
        if a is not None and not (np.isfinite(a).all() and (np.abs(a) < 1e18).all()):
            return False
    for f in sparse:
        col = [r[f] for r in rows]
        kinds = set(map(type, col))
        if not kinds <= {int, str, _NONE}:
            return False
        if str in kinds and max(len(x) for x in col if type(x) is str) > 4096:
            return False
    return True


def _show(v, limit: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


# -- files ------------------------------------------------------------------------------------------
def read_file(enc: RowEncoder, path: str | Path, block_rows: int = 65536) -> Iterator[Encoded]:
    """Blocks of a file of the export's schema (csv/tsv, parquet, jsonl; with or without the label column:
    labeled blocks carry labels) as model inputs. A row the training reader would reject is an error
    naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    s = enc.schema
    if s is None:
        raise InputError(f"{path}: this model was trained on id-encoded data (no raw schema); score files of "
                         "raw values with a model trained on a raw source (criteo, avazu, table)")
    if s.format in ("csv", "tsv"):
        yield from _csv_blocks(enc, path, block_rows)
    elif s.format == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        labeled = s.column_name(s.label) in pf.schema_arrow.names
        line = 0
        for batch in pf.iter_batches(batch_size=block_rows):
            yield _block(enc, pa.Table.from_batches([batch]), str(path), labeled, line, named=True)
            line += batch.num_rows
    elif s.format == "jsonl":
        import pyarrow.json as pj

        table = pj.read_json(path)
        labeled = s.column_name(s.label) in table.column_names
        for start in range(0, table.num_rows, block_rows):
            yield _block(enc, table.slice(start, block_rows), str(path), labeled, start + 1, named=True)
    else:
        raise InputError(f"{path}: predict reads csv, tsv, parquet and jsonl files; the schema's format is "
                         f"{s.format}")


def _csv_blocks(enc: RowEncoder, path: Path, block_rows: int) -> Iterator[Encoded]:
    import pyarrow.csv as pcsv

    s = enc.schema
    sep = s.delimiter or ("\t" if s.format == "tsv" else ",")
    with open(path, "rb") as fh:
        first = fh.readline().rstrip(b"\r\n").split(sep.encode())
    label = s.column_name(s.label)
    header = s.header is True or (s.header == "auto" and label.encode() in first)
    if header:
        names = [x.decode() for x in first]
    else:
        names = list(s.columns)
        if len(first) == len(names) - 1 and label in names:  # an unlabeled file: every column but the label
            names = [n for n in names if n != label]
        elif len(first) != len(names):
            raise InputError(f"{path}:1: {len(first)} fields, the schema has {len(names)} columns "
                             f"({', '.join(names)}) or {len(names) - 1} without the label")
    labeled = label in names
    read = pcsv.ReadOptions(column_names=names, skip_rows=1 if header else 0, block_size=1 << 22)
    parse = pcsv.ParseOptions(delimiter=sep, quote_char=False if s.format == "tsv" else '"')
    convert = pcsv.ConvertOptions(column_types={n: pa.binary() for n in names}, strings_can_be_null=False,
                                  quoted_strings_can_be_null=False)
    try:
        reader = pcsv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid as e:
        raise InputError(f"{path}: {e}") from None
    line = 2 if header else 1
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as e:
            raise InputError(f"{path}: {e}") from None
        for start in range(0, batch.num_rows, block_rows):
            part = pa.Table.from_batches([batch.slice(start, block_rows)])
            yield _block(enc, part, str(path), labeled, line + start, named=True)
        line += batch.num_rows


def _block(enc: RowEncoder, table: pa.Table, where: str, labeled: bool, first_line: int, named: bool) -> Encoded:
    s = enc.schema
    if not labeled:
        table = table.append_column(s.column_name(s.label), pa.array([b"0"] * table.num_rows, pa.binary()))
    if s.weight is not None and s.column_name(s.weight) not in table.column_names:
        table = table.append_column(s.column_name(s.weight), pa.array([1.0] * table.num_rows, pa.float64()))
    try:
        out = enc.encode_table(table, where, labeled=labeled, first_line=first_line, resolve=s.column_name)
    except RequestError as e:
        raise InputError(str(e).replace(f"{where}: row ", f"{where}: line ", 1)) from None
    return out


__all__ = ["Encoded", "RequestError", "RowEncoder", "read_file"]
