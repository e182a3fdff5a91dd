"""libFM, libSVM and libFFM text lines -> Arrow tables of the tabular reader (``data.tabular``).

libFM reads SVMlight's format, ``label index:value index:value ...`` (libFM 1.4.2 manual, section 2.1), as
libSVM does: ``format: libfm`` and ``format: libsvm`` are the same reader. Without field ranges every index
is an id of one multi-hot table (``schema.ALL_INDICES``): a line is a bag of ids. With ``fields``
(``{name, first, last}`` index ranges) an index belongs to the field whose range holds it. libFFM
(``format: libffm``) names the field of every pair: ``label field:index:value``.

A categorical pair's value is the id's weight in the bag. By default it must be 1, the value of every pair in
the public ``.libfm`` benchmark files (e.g. Frappe and MovieLens as the NFM paper's code ships them): another
value rejects its line, named with the index and the value, never dropped or replaced in silence. A column
with ``id_weights`` keeps the values (a ``<name>/weights`` list column beside the ids), and the model pools
the bag as the weighted sum of its rows. A dense field's value is the feature's value. An index in no range, or a
libFFM field number beyond the schema's named fields, rejects its line too.

Lines are split in Python, one at a time: the slow format of the reader.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from embedscale.data.fields import show
from embedscale.data.schema import Schema, index_ranges
from embedscale.data.shards import ID_WEIGHTS


class LineParser:
    """The pairs of one schema's lines -> a table of binary columns: the label, one column per dense or
    one-hot field (the value, or the index as the key), a list column per multi-hot field (the indices)."""

    def __init__(self, schema: Schema):
        self.ffm = schema.format == "libffm"
        self.ranges = [] if self.ffm else index_ranges(schema.fields)
        self.firsts = np.array([r[0] for r in self.ranges], np.int64)
        self.names_by_field = {i: str(n) for i, n in enumerate(schema.fields)} if self.ffm else {}
        # libFM/libSVM without ranges: every index goes to the schema's one table
        self.everything = schema.sparse[0].name if not self.ffm and not self.ranges else None
        self.label = schema.label
        self.label_name = self._name(schema.label) if schema.label != 0 else "label"
        self.roles: dict[str, str] = {}
        for c in schema.dense:
            self.roles[self._name(c.column)] = "dense"
        for c in schema.sparse:
            self.roles[self._name(c.column)] = "multi" if c.multi_hot else "sparse"
        self.weighted = {self._name(c.column) for c in schema.sparse if c.id_weights}  # bags keeping their values

    def _name(self, ref) -> str:
        return self.names_by_field.get(ref, f"f{ref}") if isinstance(ref, int) else ref

    def resolve(self, ref) -> str:
        """A schema reference -> its column in the table (a libFFM field number -> its name)."""
        return self.label_name if ref == self.label else self._name(ref)

    def _field_of(self, i: int) -> str | None:
        pos = int(np.searchsorted(self.firsts, i, side="right")) - 1
        return self.ranges[pos][2] if pos >= 0 and i <= self.ranges[pos][1] else None

    def _pair(self, tok: bytes) -> tuple[str, bytes, bytes]:
        """(field name, index, value) of one ``index:value`` or ``field:index:value``; ValueError: why not."""
        parts = tok.split(b":")
        if self.ffm:
            if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
                raise ValueError(f"{show(tok)} is not field:index:value")
            f = int(parts[0])
            if self.names_by_field and f not in self.names_by_field:
                raise ValueError(f"field {f} ({show(tok)}) is beyond the schema's {len(self.names_by_field)} "
                                 f"fields (fields: {', '.join(self.names_by_field.values())})")
            return self._name(f), parts[1], parts[2]
        if len(parts) != 2 or not parts[0].isdigit():
            raise ValueError(f"{show(tok)} is not index:value")
        name = self.everything or self._field_of(int(parts[0]))
        if name is None:
            spans = ", ".join(f"{n} {a}-{b}" for a, b, n in self.ranges)
            raise ValueError(f"index {int(parts[0])} is in no field of the schema (fields: {spans})")
        return name, parts[0], parts[1]

    def _line(self, toks: list[bytes]) -> dict[str, object]:
        """One line's fields; ValueError: why the line is rejected."""
        row: dict[str, object] = {}
        for tok in toks[1:]:
            name, idx, val = self._pair(tok)
            try:
                value = float(val)
            except ValueError:
                raise ValueError(f"{show(tok)}: value {show(val)} is not a number") from None
            role = self.roles.get(name)
            if role is None:  # a field the schema names but does not use
                continue
            if role != "dense" and value != 1 and name not in self.weighted:
                raise ValueError(f"{name} value {show(val)} is not 1 (index {int(idx)}: a categorical id's "
                                 f"weight in its bag; id_weights: true on the column keeps them)")
            if role == "multi":
                row.setdefault(name, []).append(idx)
                if name in self.weighted:
                    row.setdefault(name + ID_WEIGHTS, []).append(val)
                continue
            if name in row:
                raise ValueError(f"field {name} appears twice (declare it multi-hot)")
            row[name] = val if role == "dense" else idx
        return row

    def table(self, lines: list[bytes], first_line: int) -> tuple[pa.Table | None, list[int], list[tuple[int, str]]]:
        """(the table of the good lines, their positions in ``lines``, (line number, why) of the others)."""
        cols: dict[str, list] = {name: [] for name in [*self.roles, *(n + ID_WEIGHTS for n in self.weighted)]}
        labels: list[bytes] = []
        rejected, good = [], []
        for i, line in enumerate(lines):
            toks = line.split()
            try:
                if not toks:
                    raise ValueError("empty line")
                row = self._line(toks)
            except ValueError as e:
                rejected.append((first_line + i, str(e)))
                continue
            good.append(i)
            labels.append(toks[0])
            for name, role in self.roles.items():
                cols[name].append(row.get(name, [] if role == "multi" else b""))
            for name in self.weighted:
                cols[name + ID_WEIGHTS].append(row.get(name + ID_WEIGHTS, []))
        if not good:
            return None, good, rejected
        arrays = {self.label_name: pa.array(labels, pa.binary())}
        for name, role in self.roles.items():
            arrays[name] = pa.array(cols[name], pa.list_(pa.binary()) if role == "multi" else pa.binary())
        for name in self.weighted:
            arrays[name + ID_WEIGHTS] = pa.array(cols[name + ID_WEIGHTS], pa.list_(pa.binary()))
        return pa.table(arrays), good, rejected
