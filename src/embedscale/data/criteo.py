"""Reader of raw Criteo click logs (Kaggle ``train.txt``, Terabyte ``day_0`` .. ``day_23``, ``.gz`` too).

Each line: the label, 13 integer features ``I1..I13`` and 26 categorical features ``C1..C26`` (32-bit
values written in hex), tab-separated, an empty field meaning missing. The conversion follows Meta's DLRM
reference (facebookresearch/dlrm ``data_utils.py``, ``getCriteoAdData`` / ``transformCriteoAdData``):

- dense: a missing value is 0, negatives are clamped to 0 (``X_int[X_int < 0] = 0``), then
  ``log(1 + x)``, stored float32.
- categorical: a missing value is ``"0"``, i.e. key 0, before anything else. ``hash`` mode then takes
  ``int(x, 16) % table_rows`` (the reference's ``--max-ind-range``); ``vocab`` mode numbers the values
  as ``CategoricalEncoder`` documents (the reference keeps every value; ``min_frequency`` adds the
  MLPerf-style cut that sends rarer values to a shared row 0).

Values are stricter than Python's ``int()``: dense ``-?[0-9]{1,18}``, categorical ``[0-9a-fA-F]{0,16}``,
label ``0`` or ``1``. Anything else is a malformed line.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import pyarrow as pa

from embedscale.data.fields import parse_decimal, parse_hex, parse_label, show
from embedscale.data.raw import BLOCK_BYTES, Decoded, LogFormat, convert_log
from embedscale.data.shards import Manifest
from embedscale.specs import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE

DENSE_NAMES = [f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, CRITEO_NUM_SPARSE + 1)]
COLUMNS = ["label"] + DENSE_NAMES + SPARSE_NAMES

_INT = re.compile(rb"-?[0-9]{1,18}")
_HEX = re.compile(rb"[0-9a-fA-F]{0,16}")


def dense_transform(values: np.ndarray) -> np.ndarray:
    """The reference's dense transform: ``log(1 + max(x, 0))`` in float32 (missing already 0)."""
    return np.log1p(np.maximum(values, 0).astype(np.float32))


def _decode(table: pa.Table) -> Decoded:
    n = table.num_rows
    labels, bad = parse_label(table.column("label"))
    dense = np.empty((CRITEO_NUM_DENSE, n), np.float32)  # feature-major while decoding: contiguous writes
    for j, name in enumerate(DENSE_NAMES):
        v, _, b = parse_decimal(table.column(name))  # missing parses as 0
        dense[j] = dense_transform(v)
        bad |= b
    keys = np.empty((CRITEO_NUM_SPARSE, n), np.uint64)
    for j, name in enumerate(SPARSE_NAMES):
        keys[j], b = parse_hex(table.column(name))
        bad |= b
    return Decoded(labels, dense.T, keys, bad)


def _check_line(fields: list[bytes]) -> str | None:
    if fields[0] not in (b"0", b"1"):
        return f"label {show(fields[0])} is not 0 or 1"
    for name, v in zip(DENSE_NAMES, fields[1:14]):
        if v and not _INT.fullmatch(v):
            return f"{name} {show(v)} is not an integer (at most 18 digits)"
    for name, v in zip(SPARSE_NAMES, fields[14:]):
        if not _HEX.fullmatch(v):
            return f"{name} {show(v)} is not hexadecimal (at most 16 digits)"
    return None


CRITEO = LogFormat(
    name="criteo", delimiter="\t", column_names=COLUMNS, dense_names=DENSE_NAMES, sparse_names=SPARSE_NAMES,
    decode=_decode, check_line=_check_line,
    notes={"dense_transform": "log1p(max(x, 0)), missing = 0 (DLRM reference)",
           "missing_categorical": "key 0 before hashing or vocabulary (DLRM reference fills '0')"},
)


def convert_criteo(paths, out_dir, *, categorical: str = "hash", table_rows: int | Sequence[int] = 1_000_000,
                   min_frequency: int = 1, shard_rows: int = 1_000_000, skip_malformed: bool = False,
                   max_rows: int | None = None, progress: bool = True, block_bytes: int = BLOCK_BYTES) -> Manifest:
    """Convert raw Criteo TSV files into an embedscale shard directory.

    Streams ``block_bytes`` of whole lines at a time, so peak memory does not grow with the file (it does
    grow with the vocabulary in ``vocab`` mode: 16 bytes per distinct value while counting).

    Args:
        paths: one file or a list, read in order (``.gz`` is decompressed on the fly).
        out_dir: the shard directory; a dataset already there is replaced only once this one is complete.
        categorical: ``"hash"`` (key % table_rows, one pass) or ``"vocab"`` (two passes: count, then map).
        table_rows: hash buckets, one for all 26 features or a list of 26 (hash mode).
        min_frequency: vocab mode: values seen fewer times share row 0.
        shard_rows: rows per shard file.
        skip_malformed: skip malformed lines, counted in ``manifest.extra["skipped"]`` and warned about,
            instead of stopping with ``InputError("<file>:<line>: <what is wrong>")``.
        max_rows: stop after this many (valid) rows.
        progress: a tqdm bar per pass on stderr.

    Returns:
        The ``Manifest``: dense ``I1..I13``, one-hot sparse ``C1..C26`` with ``num_rows`` = the table
        rows (hash) or vocabulary size + 1 (vocab); ``extra`` records source, mode, table_rows or
        min_frequency, the transforms and the skipped lines.

    Example::

        m = convert_criteo("train.txt", "data/criteo", categorical="vocab", min_frequency=4)
        m.rows, [s.num_rows for s in m.sparse]
    """
    return convert_log(CRITEO, paths, out_dir, categorical=categorical, table_rows=table_rows,
                       min_frequency=min_frequency, shard_rows=shard_rows, skip_malformed=skip_malformed,
                       max_rows=max_rows, progress=progress, block_bytes=block_bytes)
