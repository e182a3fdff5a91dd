"""What a click log holds, column by column: the schema the tabular reader (``data.tabular``) follows.

A schema names the file format, the label column, the dense and categorical (one-hot or multi-hot)
columns, an optional sample-weight column and how each is decoded. It is written as YAML (``Schema.load``)
or built from command-line flags (``Schema.from_flags``); the Criteo and Avazu readers are two fixed
schemas (``data.criteo.CRITEO``, ``data.avazu.AVAZU``). Example::

    format: csv            # csv | tsv | parquet | jsonl | libfm | libsvm | libffm
    header: true           # csv/tsv: true or present (every file starts with it) | false or none | auto (a
                           # file's first line is a header when it repeats the first file's (or the schema's
                           # columns), or its label is not a label); csv fields may be quoted (RFC 4180)
    label: click           # a column name or 0-based position; label_values: 01 | -1/1 | bool
    dense:                 # parse: float | int; transform: none | log1p (DLRM: log(1 + max(x, 0))) | standardise
      - {column: price, transform: log1p, missing: 0}
    sparse:                # key: string (FNV-1a of the bytes) | hex | int; rows: hashed table size
      - {column: site, rows: 10000}
      - {column: tags, separator: "|"}   # multi-hot: the values of one field, cut at the separator
                                         # (a Parquet/JSON list column: multi_hot: true)
    weight: w              # optional sample weight (>= 0): weights the training loss (train.loss) and eval metrics;
                           # an empty weight is an error naming the file and line (no default weight)

libFM and libSVM files (``label index:value ...``, SVMlight's text format, which libFM reads: libFM 1.4.2
manual, section 2.1) have no column names. By default every index is a row of one multi-hot table, named
``features`` (a bag of the line's indices), keyed by the index itself (``key: int``); declare one ``sparse``
column (e.g. ``[{column: ids, key: int, rows: 50000}]``) to name or size it. With ``fields``, a list of index
ranges ``{name, first, last}``, each range is a field: by default one multi-hot table per field, or as the
``dense`` and ``sparse`` lists say (a dense field's value is its value). An index in no range is an error
naming the file, line and index. A categorical index's value is its weight in the bag: by default it must be
1 (the value of every pair in the public ``.libfm`` benchmark files; another is an error naming the line,
index and value); a sparse column with ``id_weights: true`` keeps the values, and the model pools the bag as
the weighted sum of its rows (``JaggedFeatures.weights``), e.g. ``sparse: [{column: features, key: int,
id_weights: true}]``.

libFFM files (``format: libffm``, ``label field:index:value``) name the field of every pair: a field is
named ``f<field>`` unless ``fields`` names them by field number; with names and no ``dense``/``sparse``,
every named field is a multi-hot table, and a field number beyond the names is an error. A categorical
field's key is its index (its value must be 1); a dense field's value is its value.

JSON lines: a record without a declared key is an error naming the file, line and key, unless the column
is ``optional: true`` (then it reads as missing, and the records are counted in ``manifest.extra
["absent_keys"]`` and reported). A JSON ``null`` is a missing value, as an empty CSV field is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embedscale.errors import ConfigError
from embedscale.io import read_yaml

FORMATS = ("csv", "tsv", "parquet", "jsonl", "libfm", "libsvm", "libffm")
INDEX_FORMATS = ("libfm", "libsvm")  # label index:value (SVMlight)
ALL_INDICES = "features"  # the one table of an index format without field ranges
HEADERS = {True: True, False: False, "auto": "auto", "present": True, "none": False}
LABEL_VALUES = {"01": {b"0": 0, b"1": 1}, "-1/1": {b"-1": 0, b"1": 1, b"+1": 1},
                "bool": {b"false": 0, b"true": 1, b"False": 0, b"True": 1, b"FALSE": 0, b"TRUE": 1,
                         b"0": 0, b"1": 1}}
DENSE_PARSE = ("float", "int", "yymmddhh_hour", "yymmddhh_weekday")
TRANSFORMS = ("none", "log1p", "standardise")
KEYS = ("string", "hex", "int")


@dataclass
class DenseColumn:
    """One dense feature: read from ``column``, named ``name`` (default: the column's name)."""

    column: str | int
    name: str = ""
    parse: str = "float"  # float | int (decimal integers only) | yymmddhh_hour | yymmddhh_weekday (Avazu's hour)
    transform: str = "none"  # none | log1p (DLRM: log(1 + max(x, 0)) in float32) | standardise (train mean, std)
    missing: float = 0.0  # the value of an empty field, before the transform
    optional: bool = False  # jsonl: a record may lack the key (read as missing, counted)


@dataclass
class SparseColumn:
    """One categorical feature: one value per row, or several cut at ``separator`` (multi-hot)."""

    column: str | int
    name: str = ""
    key: str = "string"  # string (FNV-1a 64 of the bytes) | hex | int; an empty value is key 0
    separator: str = ""  # multi-hot when set
    rows: int = 0  # hashed table rows; 0 = sized from the data (load factor and cap)
    multi_hot: bool = False  # several values per row: a separator, a Parquet/JSON list, a repeated libFM field
    optional: bool = False  # jsonl: a record may lack the key (read as missing, counted)
    id_weights: bool = False  # libfm/libsvm/libffm bags: each id's value is its weight in the pooled sum


@dataclass
class Schema:
    format: str = "csv"
    label: str | int = "label"
    label_values: str = "01"
    dense: list[DenseColumn] = field(default_factory=list)
    sparse: list[SparseColumn] = field(default_factory=list)
    weight: str | int | None = None
    header: bool | str = True  # csv/tsv: True ("present") | False ("none") | "auto"
    delimiter: str = ""  # csv: ",", tsv: "\t"
    columns: list[str] = field(default_factory=list)  # csv/tsv: the names (without a header, or the header itself)
    fields: list[Any] = field(default_factory=list)  # libfm/libsvm: {name, first, last}; libffm: names by field
    name: str = "table"  # the format's name in manifests and progress bars
    notes: dict = field(default_factory=dict)  # documented choices, copied into the manifest's extra

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, where: str = "schema") -> "Schema":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: a schema is a mapping (format, label, dense, sparse, ...), got "
                              f"{type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        d = dict(d)
        d["dense"] = [_column(DenseColumn, c, f"{where}: dense[{i}]") for i, c in enumerate(d.get("dense") or [])]
        d["sparse"] = [_column(SparseColumn, c, f"{where}: sparse[{i}]") for i, c in enumerate(d.get("sparse") or [])]
        s = cls(**d)
        s.check(where)
        return s

    @classmethod
    def load(cls, path: str | Path) -> "Schema":
        return cls.from_dict(read_yaml(path, "schema file") or {}, str(path))

    @classmethod
    def from_flags(cls, fmt: str, label: str, dense: str, sparse: str, multi_hot: tuple[str, ...] = (),
                   weight: str | None = None, header: str = "true", delimiter: str = "",
                   transform: str = "none", label_values: str = "01") -> "Schema":
        """The simple cases on the command line: comma-separated column lists (names or positions)."""
        d = {"format": fmt, "label": _ref(label), "label_values": label_values, "weight": _ref(weight) if weight else None,
             "header": {"true": True, "false": False}.get(header, header), "delimiter": delimiter,
             "dense": [{"column": _ref(c), "transform": transform} for c in _split(dense)],
             "sparse": [{"column": _ref(c)} for c in _split(sparse)]}
        for item in multi_hot:
            col, _, sep = item.rpartition(":")
            if not col or not sep:
                raise ConfigError(f"--multi-hot {item!r}: expected COLUMN:SEPARATOR, e.g. tags:|")
            d["sparse"].append({"column": _ref(col), "separator": sep})
        return cls.from_dict(d, "flags")

    def check(self, where: str = "schema") -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"{where}: format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.label_values not in LABEL_VALUES:
            raise ConfigError(f"{where}: label_values {self.label_values!r} is not one of {', '.join(LABEL_VALUES)}")
        if not isinstance(self.header, (bool, str)) or self.header not in HEADERS:
            raise ConfigError(f"{where}: header must be true (present), false (none) or auto, got {self.header!r}")
        self.header = HEADERS[self.header]
        if self.format in INDEX_FORMATS:
            self._index_fields(where)
        elif self.format == "libffm":
            self._ffm_fields(where)
        for c in self.dense:
            if c.parse not in DENSE_PARSE:
                raise ConfigError(f"{where}: dense column {c.column!r}: parse {c.parse!r} is not one of "
                                  f"{', '.join(DENSE_PARSE)}")
            if c.transform not in TRANSFORMS:
                raise ConfigError(f"{where}: dense column {c.column!r}: transform {c.transform!r} is not one of "
                                  f"{', '.join(TRANSFORMS)}")
            c.name = c.name or str(c.column if isinstance(c.column, str) else self.column_name(c.column))
        for c in self.sparse:
            if c.key not in KEYS:
                raise ConfigError(f"{where}: sparse column {c.column!r}: key {c.key!r} is not one of {', '.join(KEYS)}")
            if c.rows < 0:
                raise ConfigError(f"{where}: sparse column {c.column!r}: rows must be >= 0 (0 = from the data)")
            c.name = c.name or str(c.column if isinstance(c.column, str) else self.column_name(c.column))
            c.multi_hot = c.multi_hot or bool(c.separator) or c.id_weights
            if c.id_weights and self.format not in (*INDEX_FORMATS, "libffm"):
                raise ConfigError(f"{where}: sparse column {c.column!r}: id_weights are the values of libfm, libsvm "
                                  f"or libffm pairs, not of {self.format}")
        names = [c.name for c in self.dense] + [c.name for c in self.sparse]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"{where}: feature name(s) {', '.join(dup)} used twice (give each a distinct name:)")
        if self.name == "table":
            self.name = self.format

    def _index_fields(self, where: str) -> None:
        """libFM/libSVM: check the index ranges; without dense or sparse lists, one table per range (or one
        table over all indices without ranges)."""
        ranges = index_ranges(self.fields, where)
        names = [r[2] for r in ranges]
        unknown = [c.column for c in [*self.dense, *self.sparse] if ranges and c.column not in names]
        if unknown:
            raise ConfigError(f"{where}: {', '.join(map(repr, unknown))} name no field of the index ranges "
                              f"(fields: {', '.join(names)})")
        if not self.dense and not self.sparse:
            self.sparse = [SparseColumn(name, key="int", multi_hot=True) for _, _, name in ranges] or \
                [SparseColumn(ALL_INDICES, key="int", multi_hot=True)]
        elif not ranges:
            if self.dense or len(self.sparse) != 1:
                raise ConfigError(f"{where}: a {self.format} schema without field ranges (fields: [{{name, first, "
                                  f"last}}, ...]) reads every index into one categorical table: give one sparse "
                                  f"column (its name and rows) and no dense ones, or give the ranges")
            self.sparse[0].multi_hot = True

    def _ffm_fields(self, where: str) -> None:
        """libFFM: every declared column is a field (a number, a name in ``fields``, or ``f<number>``); without
        dense or sparse lists, every named field is a table of bags."""
        if not self.dense and not self.sparse:
            if not self.fields:
                raise ConfigError(f"{where}: a libffm schema names its fields (fields: [name of field 0, ...]) "
                                  f"or lists its dense and sparse fields")
            self.sparse = [SparseColumn(str(n), key="int", multi_hot=True) for n in self.fields]
        names = [str(n) for n in self.fields]
        unknown = [c.column for c in [*self.dense, *self.sparse] if isinstance(c.column, str) and c.column not in names
                   and not (not names and c.column[:1] == "f" and c.column[1:].isdigit())]
        if unknown:
            raise ConfigError(f"{where}: {', '.join(map(repr, unknown))} name no libffm field (fields: "
                              f"{', '.join(names) or 'none named: f0, f1, ... or field numbers'})")

    def column_name(self, ref: str | int) -> str:
        """A column's name: names stay, positions are named by ``columns`` (or ``c<position>``)."""
        if isinstance(ref, str):
            return ref
        return self.columns[ref] if ref < len(self.columns) else f"c{ref}"

    @property
    def sep(self) -> str:
        return self.delimiter or ("\t" if self.format == "tsv" else ",")

    @property
    def dense_names(self) -> list[str]:
        return [c.name for c in self.dense]

    @property
    def sparse_names(self) -> list[str]:
        return [c.name for c in self.sparse]

    def to_dict(self) -> dict:
        return asdict(self)


def index_ranges(fields: list, where: str = "schema") -> list[tuple[int, int, str]]:
    """libFM/libSVM ``fields``: ``{name, first, last}`` index ranges -> sorted (first, last, name), checked."""
    out = []
    for i, r in enumerate(fields):
        if not isinstance(r, dict) or set(r) != {"name", "first", "last"}:
            raise ConfigError(f"{where}: fields[{i}] of a libfm/libsvm schema is {{name, first, last}} (an index "
                              f"range), got {r!r}")
        try:
            first, last = int(r["first"]), int(r["last"])
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: fields[{i}]: first and last are indices, got {r!r}") from None
        if not 0 <= first <= last:
            raise ConfigError(f"{where}: fields[{i}] ({r['name']}): expected 0 <= first <= last, got {first}, {last}")
        out.append((first, last, str(r["name"])))
    out.sort()
    for a, b in zip(out, out[1:]):
        if b[0] <= a[1]:
            raise ConfigError(f"{where}: fields {a[2]} ({a[0]}-{a[1]}) and {b[2]} ({b[0]}-{b[1]}) overlap")
    return out


def _column(cls, c, where: str):
    if isinstance(c, (str, int)):
        c = {"column": c}
    if not isinstance(c, dict) or "column" not in c:
        raise ConfigError(f"{where}: expected a column name, a position or a mapping with 'column', got {c!r}")
    unknown = sorted(set(c) - set(cls.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    return cls(**c)


def _ref(s: str | None) -> str | int | None:
    if s is None:
        return None
    s = s.strip()
    return int(s) if s.isdigit() else s


def _split(s: str | None) -> list[str]:
    return [x for x in (s or "").split(",") if x.strip()]
