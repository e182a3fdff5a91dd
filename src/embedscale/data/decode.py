"""A parsed block of a click log (an Arrow table, any format) -> labels, dense values, categorical keys.

``Decoder`` follows a ``Schema`` column by column, vectorised over the block. Text columns (CSV/TSV,
libFM) are decoded by the rules of ``data.fields``; typed columns (Parquet, JSON lines) go the same way
after Arrow renders them as text, except numbers read as dense values, which are taken as they are.
So the same table reads into the same values whatever the format: an integer ``3`` in Parquet and
``3`` in a CSV file are the same dense value and the same categorical key (FNV-1a of ``b"3"``).
A missing value (an empty field, a JSON ``null`` or absent key, a Parquet null) is key 0 or the dense
column's ``missing`` value. Every value the schema rejects marks its row ``bad`` with the reason, named
by the column and the value; the reader names the line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedscale.data.fields import fnv1a64, field_lengths, parse_decimal, parse_hex, parse_label, show
from embedscale.data.schema import LABEL_VALUES, DenseColumn, Schema, SparseColumn
from embedscale.data.shards import ID_WEIGHTS
from embedscale.errors import ConfigError, InputError

SPLITS = ("train", "eval", "test")
_FLOAT = r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"
_HOUR = re.compile(rb"[0-9]{8}")
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (Monday = 0)


def log1p_float32(v: np.ndarray) -> np.ndarray:
    """``log(1 + max(x, 0))`` rounded to float32, the same bits on every CPU.

    numpy's float32 ``log1p`` has SIMD paths (AVX-512 on some CPUs, AVX2 or libm on others) that differ in the
    last bit for a few percent of values, so shards converted on two machines would differ. Computed in float64
    (accurate to an ulp of float64 on every path) and rounded once, the result is the correctly rounded float32
    except within 2^-29 of a rounding tie: on integer inputs 0..3M it matches libm bit for bit."""
    return np.log1p(np.maximum(np.asarray(v, np.float64), 0.0)).astype(np.float32)


@dataclass
class Decoded:
    """A block decoded. ``keys[f]`` holds feature f's keys: one per row, or ``lengths[f]`` per row (multi-hot)."""

    labels: np.ndarray  # int8 [N]
    dense: np.ndarray  # float32 [N, D] (standardised columns: the raw value until the train statistics are known)
    keys: list[np.ndarray]  # uint64
    lengths: list[np.ndarray | None]
    weights: np.ndarray | None = None  # float32 [N]
    split: np.ndarray | None = None  # int8 [N]: 0 train, 1 eval, 2 test
    bad: np.ndarray | None = None  # bool [N]
    reasons: list[tuple[str, np.ndarray, Callable[[int], str]]] = field(default_factory=list)
    id_weights: dict[int, np.ndarray] = field(default_factory=dict)  # feature f -> float32, one per key

    @property
    def rows(self) -> int:
        return len(self.labels)

    def why(self, i: int) -> str:
        """Why row ``i`` is bad: the first column that rejected it, with its value."""
        for _, mask, reason in self.reasons:
            if mask[i]:
                return reason(i)
        return "rejected"

    def select(self, keep: np.ndarray) -> "Decoded":
        """The rows where ``keep`` is True."""
        keys = []
        for k, ln in zip(self.keys, self.lengths):
            keys.append(k[keep] if ln is None else k[np.repeat(keep, ln)])
        return Decoded(self.labels[keep], self.dense[keep], keys,
                       [None if ln is None else ln[keep] for ln in self.lengths],
                       None if self.weights is None else self.weights[keep],
                       None if self.split is None else self.split[keep], np.zeros(int(keep.sum()), bool),
                       id_weights={f: w[np.repeat(keep, self.lengths[f])] for f, w in self.id_weights.items()})

    def head(self, n: int) -> "Decoded":
        keep = np.zeros(self.rows, bool)
        keep[:n] = True
        return self.select(keep)


def parse_float(col) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decimal numbers (``1``, ``-2.5``, ``1e-3``; no spaces, no ``inf``/``nan``) -> (float64, missing, bad)."""
    col = _one(col)
    text = col.cast(pa.string()) if not pa.types.is_string(col.type) else col
    lens = field_lengths(col) if len(col) else np.zeros(0, np.int64)
    missing = lens == 0
    bad = np.zeros(len(col), bool)
    nulled = pc.if_else(pa.array(missing), pa.scalar(None, pa.string()), text)
    try:
        v = pc.cast(nulled, pa.float64())
    except pa.ArrowInvalid:  # only now find the rows
        ok = pc.match_substring_regex(text, _FLOAT).to_numpy(zero_copy_only=False)
        bad = ~ok & ~missing
        nulled = pc.if_else(pa.array(bad | missing), pa.scalar(None, pa.string()), text)
        v = pc.cast(nulled, pa.float64())
    out = v.to_numpy(zero_copy_only=False)
    out = np.where(missing | bad, 0.0, out)
    bad |= ~np.isfinite(out)
    return out, missing, bad


def split_hour(hour: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``YYMMDDHH`` integers -> (hour of day, day of week with Monday = 0, valid mask)."""
    yy, mm, dd, hh = hour // 1_000_000, hour // 10_000 % 100, hour // 100 % 100, hour % 100
    months = (2000 + yy - 1970) * 12 + np.clip(mm - 1, 0, 11)
    first = months.astype("datetime64[M]").astype("datetime64[D]")
    day = first + np.clip(dd - 1, 0, 30).astype("timedelta64[D]")
    same_month = day.astype("datetime64[M]") == first.astype("datetime64[M]")  # 31 April is not a date
    valid = (hour >= 0) & (mm >= 1) & (mm <= 12) & (dd >= 1) & (hh <= 23) & same_month
    weekday = (day.astype(np.int64) + _EPOCH_WEEKDAY) % 7
    return hh, weekday, valid


def as_text(col) -> pa.Array:
    """A column as ``binary`` without nulls (a null becomes the empty, i.e. missing, value); a binary column
    without nulls is returned as it is (chunks and all: the decoders take chunked arrays, no copy)."""
    if col.type == pa.binary() and not col.null_count:
        return col
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    t = col.type
    if pa.types.is_dictionary(t):
        col, t = col.dictionary_decode(), t.value_type
    if pa.types.is_boolean(t):
        col, t = col.cast(pa.int8()), pa.int8()
    if pa.types.is_binary(t) and not col.null_count:
        return col
    if pa.types.is_null(t):
        return pa.array([b""] * len(col), pa.binary())
    if not (pa.types.is_binary(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_large_binary(t) or pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise TypeError(t)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        col = col.cast(pa.string())
    return pc.fill_null(col.cast(pa.binary()), b"")


def _one(col):
    """One array (a chunked column's chunks combined)."""
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def _numeric(col) -> bool:
    t = col.type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _values(text) -> Callable[[int], bytes]:
    return lambda i: text[i].as_py() or b""


class Decoder:
    """Decode blocks of one schema. ``resolve(ref)`` names a schema column reference in the block's table."""

    def __init__(self, schema: Schema, split_column: str | None = None, time_column: str | None = None,
                 eval_from: str | None = None, test_from: str | None = None):
        self.schema = schema
        self.label_set = LABEL_VALUES[schema.label_values]
        keys = list(self.label_set)
        self._label_keys = pa.array(keys, pa.binary())
        self._label_map = np.array([self.label_set[k] for k in keys], np.int8)
        self.split_column, self.time_column = split_column, time_column
        self.eval_from, self.test_from = eval_from, test_from
        if time_column and eval_from is None:
            raise ConfigError(f"--time-column {time_column} needs --eval-from (the first time of the eval split)")
        self.stats: list[tuple[float, float]] | None = None  # (mean, std) of each standardised column
        self._not_integers: set[str] = set()  # float columns seen holding a non-integer
        self.standardised = [j for j, c in enumerate(schema.dense) if c.transform == "standardise"]

    # -- columns -----------------------------------------------------------------------------
    @staticmethod
    def _column(table: pa.Table, name: str, where: str):
        i = table.schema.get_field_index(name)
        if i < 0:
            raise InputError(f"{where}: no column {name!r} (columns: {', '.join(table.column_names)})")
        return table.column(i)

    def decode(self, table: pa.Table, resolve: Callable, where: str) -> Decoded:
        s = self.schema
        n = table.num_rows
        reasons: list = []
        bad = np.zeros(n, bool)

        def flag(name: str, mask, why: Callable[[bytes], str], text=None, col=None, at=None) -> None:
            """Rows ``mask`` are bad; ``at(i)`` (default: column ``text``'s value of row i) is the value named."""
            nonlocal bad
            if isinstance(mask, np.ndarray) and mask.any():
                get = at or _values(text if text is not None else _text_of(col, name, where))
                reasons.append((name, mask, lambda i, get=get: f"{name} {show(get(i))} {why(get(i))}"))
                bad |= mask

        # label
        lname = resolve(s.label)
        lcol = self._column(table, lname, where)
        ltext = _text_of(lcol, lname, where)
        if s.label_values == "01":
            labels, b = parse_label(ltext)
        else:
            idx = pc.index_in(_one(ltext), value_set=self._label_keys)
            b = idx.is_null().to_numpy(zero_copy_only=False)
            labels = self._label_map[np.asarray(pc.fill_null(idx, 0).to_numpy(zero_copy_only=False), np.int64)]
        want = {"01": "0 or 1", "-1/1": "-1 or 1", "bool": "true or false"}[s.label_values]
        flag(lname, b, lambda v: f"is not {want}", text=ltext)

        # dense
        D = len(s.dense)
        dense = np.empty((D, n), np.float32)
        for j, c in enumerate(s.dense):
            name = resolve(c.column)
            col = self._column(table, name, where)
            v, b, why, text = self._dense_values(c, col, name, where)
            flag(name, b, why, text=text, col=col)
            dense[j] = self._transform(j, c, v)

        # categorical
        keys, lengths, id_weights = [], [], {}
        for f, c in enumerate(s.sparse):
            name = resolve(c.column)
            col = self._column(table, name, where)
            k, ln, b, why, at = self._keys(c, col, name, where)
            if b is not None:
                flag(name, b, why, at=at)
            keys.append(k)
            lengths.append(ln)
            if c.id_weights:
                id_weights[f], b, at = _id_weights(self._column(table, name + ID_WEIGHTS, where), ln)
                flag(name, b, lambda v: "is not a finite weight", at=at)

        weights = None
        if s.weight is not None:
            name = resolve(s.weight)
            col = self._column(table, name, where)
            text = None
            if _numeric(col):
                w = pc.fill_null(col.cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False)
                missing = np.zeros(n, bool)
                b = ~np.isfinite(w)
            else:
                text = _text_of(col, name, where)
                w, missing, b = parse_float(text)
            b = b | missing | (w < 0)
            flag(name, b, lambda v: "is not a number >= 0", text=text, col=col)
            weights = w.astype(np.float32)

        split = None
        if self.split_column:
            text = _text_of(self._column(table, self.split_column, where), self.split_column, where)
            idx = pc.index_in(_one(text), value_set=pa.array([x.encode() for x in SPLITS], pa.binary()))
            b = idx.is_null().to_numpy(zero_copy_only=False)
            flag(self.split_column, b, lambda v: "is not train, eval or test", text=text)
            split = np.asarray(pc.fill_null(idx, 0).to_numpy(zero_copy_only=False), np.int8)
        elif self.time_column:
            split, b, text = self._time_split(table, where)
            flag(self.time_column, b, lambda v: "is not a number", text=text)
        return Decoded(labels, dense.T, keys, lengths, weights, split, bad, reasons, id_weights)

    def _dense_values(self, c: DenseColumn, col, name: str, where: str):
        """(values, bad, reason of a bad value, the column's text if it was read as text)."""
        if c.parse in ("yymmddhh_hour", "yymmddhh_weekday"):
            text = _text_of(col, name, where)
            hour, missing, b = parse_decimal(text, max_digits=8)
            hh, weekday, valid = split_hour(hour)
            b = b | missing | (field_lengths(text) != 8) | ~valid
            return (hh if c.parse == "yymmddhh_hour" else weekday), b, _why_hour, text
        if _numeric(col):  # Parquet / JSON numbers: taken as they are
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            missing = col.is_null().to_numpy(zero_copy_only=False)
            if pa.types.is_integer(col.type) or pa.types.is_boolean(col.type):
                v = pc.fill_null(col.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
                v = v.astype(np.float64) if c.parse == "float" else v  # as the text of the number would read
                b = np.zeros(len(v), bool)
            else:
                v = pc.fill_null(col.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
                b = ~np.isfinite(v)
                if c.parse == "int":
                    b |= v != np.round(v)
            v = np.where(missing, c.missing, v) if missing.any() else v
            return v, b, (lambda v: "is not a finite number"), None
        text = _text_of(col, name, where)
        if c.parse == "int":
            v, missing, b = parse_decimal(text)
            why = (lambda v: "is not an integer (at most 18 digits)")
        else:
            why = (lambda v: "is not a finite number")
            b = None
            if name not in self._not_integers:  # integers (Criteo's counts) decode faster by the integer rules
                iv, missing, b = parse_decimal(text)
                if b.any():
                    self._not_integers.add(name)  # from now on straight to the float parser
                    b = None
                else:
                    v = iv.astype(np.float64)
            if b is None:
                v, missing, b = parse_float(text)
        if c.missing != 0 and missing.any():
            v = np.where(missing, c.missing, v)
        return v, b, why, text

    def _transform(self, j: int, c: DenseColumn, v: np.ndarray) -> np.ndarray:
        if c.transform == "log1p":  # the DLRM reference's: log(1 + max(x, 0)) in float32
            return log1p_float32(v)
        if c.transform == "standardise" and self.stats is not None:
            mean, std = self.stats[self.standardised.index(j)]
            return ((v - mean) / std).astype(np.float32)
        return v.astype(np.float32)  # none, or standardised before the train statistics are known (pass 1)

    def raw_dense(self, table: pa.Table, resolve: Callable, where: str) -> np.ndarray:
        """The standardised columns' values before the transform, float64 ``[len(standardised), N]``."""
        out = []
        for j in self.standardised:
            c = self.schema.dense[j]
            name = resolve(c.column)
            v, _, _, _ = self._dense_values(c, self._column(table, name, where), name, where)
            out.append(np.asarray(v, np.float64))
        return np.array(out).reshape(len(out), table.num_rows)

    def _keys(self, c: SparseColumn, col, name: str, where: str):
        """(keys, lengths or None, bad or None, reason, text)."""
        lengths = None
        t = col.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            if not c.multi_hot:
                raise InputError(f"{where}: column {name!r} holds lists: declare it multi-hot in the schema "
                                 f"(multi_hot: true, or a separator)")
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            col = pc.list_flatten(col)
        elif c.multi_hot:
            text = _one(_text_of(col, name, where))
            lens = field_lengths(text)
            parts = pc.split_pattern(text, c.separator)
            lengths = pc.list_value_length(parts).to_numpy(zero_copy_only=False).astype(np.int64)
            lengths[lens == 0] = 0  # an empty field: no values
            parts = pc.if_else(pa.array(lens == 0), pa.scalar(None, parts.type), parts)
            col = pc.list_flatten(parts)
        if c.multi_hot and lengths is None:
            lengths = np.ones(len(col), np.int64)
        text = _text_of(col, name, where)
        bad = None
        why = None
        if c.key == "string":
            k = fnv1a64(text)
        elif c.key == "hex":
            k, bad = parse_hex(text)
            why = (lambda v: "is not hexadecimal (at most 16 digits)")
        else:
            v, _, bad = parse_decimal(text)
            k = v.view(np.uint64)
            why = (lambda v: "is not an integer (at most 18 digits)")
        at = _values(text)
        if bad is not None and lengths is not None:  # a bad value marks its row; the row's first one is named
            row = np.repeat(np.arange(len(lengths)), lengths)
            rb = np.zeros(len(lengths), bool)
            rb[row[bad]] = True
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            bad_values = bad

            def at(i, get=at):
                j = int(starts[i]) + int(np.flatnonzero(bad_values[starts[i]:starts[i] + lengths[i]])[0])
                return get(j)
            bad = rb
        return k, lengths, bad, why, at

    def _time_split(self, table: pa.Table, where: str):
        col = self._column(table, self.time_column, where)
        text = _text_of(col, self.time_column, where)
        n = table.num_rows
        cuts = [self.eval_from] + ([self.test_from] if self.test_from is not None else [])
        try:
            num = [float(x) for x in cuts]
        except ValueError:
            num = None
        split = np.zeros(n, np.int8)
        if num is not None:
            v, missing, b = parse_float(text)
            b = b | missing
            for i, cut in enumerate(num, 1):
                split[v >= cut] = i
            return split, b, text
        s = _one(text).cast(pa.string())
        for i, cut in enumerate(cuts, 1):
            split[pc.greater_equal(s, cut).to_numpy(zero_copy_only=False)] = i
        return split, np.zeros(n, bool), text


def _text_of(col, name: str, where: str) -> pa.Array:
    try:
        return as_text(col)
    except TypeError as e:
        raise InputError(f"{where}: column {name!r} holds {e} values, not numbers or text") from None


def _id_weights(col, lengths: np.ndarray):
    """A list column of per-id weights (text) -> (float32 weights, bad rows, the value named for a bad row)."""
    text = as_text(pc.list_flatten(_one(col)))
    w, missing, bad = parse_float(text)
    bad |= missing
    rows = np.zeros(len(lengths), bool)
    rows[np.repeat(np.arange(len(lengths)), lengths)[bad]] = True
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    def at(i):
        return text[int(starts[i]) + int(np.flatnonzero(bad[starts[i]:starts[i] + lengths[i]])[0])].as_py()
    return w.astype(np.float32), rows, at


def _why_hour(v: bytes) -> str:
    return "is not YYMMDDHH" if not _HOUR.fullmatch(v) else "is not a valid date and hour (YYMMDDHH)"
