"""The Criteo click log (Kaggle Display Advertising ``train.txt``, Terabyte ``day_N``, ``.gz`` too): a schema
of the tabular reader (``data.tabular``).

One tab-separated line per impression, no header: ``label, I1..I13, C1..C26``. Integer features
``-?[0-9]{0,18}``, categorical ``[0-9a-fA-F]{0,16}``, label ``0`` or ``1``. Anything else is a malformed line.
The dense transform is the DLRM reference's (``log(1 + max(x, 0))``, a missing value is 0); categorical
values are their hex value as the key (missing: 0, as the reference fills ``"0"``).
"""

from __future__ import annotations

from typing import Sequence

from embedscale.data.raw import BLOCK_BYTES
from embedscale.data.schema import DenseColumn, Schema, SparseColumn
from embedscale.data.shards import Manifest
from embedscale.data.tabular import convert
from embedscale.specs import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE

DENSE_NAMES = [f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, CRITEO_NUM_SPARSE + 1)]
COLUMNS = ["label"] + DENSE_NAMES + SPARSE_NAMES


def schema() -> Schema:
    """The Criteo schema (a fresh copy: callers may change it, e.g. to read a comma-separated variant)."""
    return Schema.from_dict({
        "format": "tsv", "header": False, "columns": COLUMNS, "label": "label", "name": "criteo",
        "dense": [vars(DenseColumn(n, parse="int", transform="log1p")) for n in DENSE_NAMES],
        "sparse": [vars(SparseColumn(n, key="hex")) for n in SPARSE_NAMES],
        "notes": {"dense_transform": "log1p(max(x, 0)), missing = 0 (DLRM reference)",
                  "missing_categorical": "key 0 before hashing or vocabulary (DLRM reference fills '0')"},
    }, "criteo preset")


CRITEO = schema()


def convert_criteo(paths, out_dir, *, categorical: str = "hash", table_rows: int | Sequence[int] = 0,
                   min_frequency: int = 1, shard_rows: int = 1_000_000, skip_malformed: bool = False,
                   max_rows: int | None = None, progress: bool = True, block_bytes: int = BLOCK_BYTES,
                   **kwargs) -> Manifest:
    """Convert raw Criteo TSV files into an embedscale shard directory (``data.tabular.convert`` with the
    Criteo schema; ``kwargs``: its other arguments, e.g. ``vocab_from``, ``load_factor``).

    Streams ``block_bytes`` of whole lines at a time, so peak memory does not grow with the file (it does
    grow with the vocabulary in ``vocab`` mode: 16 bytes per distinct value while counting).

    Args:
        paths: one file or a list, read in order (``.gz`` is decompressed on the fly), or
            ``{"train": [...], "eval": [...], "test": [...]}``.
        out_dir: the shard directory; a dataset already there is replaced only once this one is complete.
        categorical: ``"hash"`` (key % table_rows, one pass) or ``"vocab"`` (two passes: count, then map).
        table_rows: hash buckets, one for all 26 features or a list of 26 (hash mode); 0 = sized from the
            data (a counting pass: distinct values / load factor 0.5, at most 1M rows).
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
    return convert(schema(), paths, out_dir, categorical=categorical, table_rows=table_rows,
                   min_frequency=min_frequency, shard_rows=shard_rows, skip_malformed=skip_malformed,
                   max_rows=max_rows, progress=progress, block_bytes=block_bytes, **kwargs)
