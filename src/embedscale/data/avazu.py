"""The Avazu click log (Kaggle CTR prediction ``train``, ``.gz`` too): a schema of the tabular reader.

A comma-separated file with the header ``id,click,hour,C1,banner_pos,site_id,...,C21`` (``AVAZU_COLUMNS``):
24 columns. The label is ``click``; ``id`` is a row identifier and is not a feature. A file without the
header line (``header="none"``, or ``"auto"`` for a mix) holds the same columns in the same order.

Choices, recorded in ``manifest.extra``:

- ``hour`` (``YYMMDDHH``, all of it in October 2014) becomes two dense features, ``hour_of_day`` (0-23)
  and ``day_of_week`` (0 = Monday), each through ``log(1 + x)`` like Criteo's dense features, so models
  see one scale. The date itself is not a feature: train and test cover different days.
- the 21 categorical columns are strings; each value's bytes become a 64-bit key by FNV-1a (stable
  across processes and machines, unlike Python's ``hash()``), an empty value is key 0 as a missing
  Criteo value is. Keys become rows as for Criteo (``CategoricalEncoder``: ``hash`` or ``vocab``).
  Two different strings sharing a 64-bit key is possible in principle and ignored (odds ~ V^2 / 2^65).
"""

from __future__ import annotations

from typing import Sequence

from embedscale.data.decode import split_hour  # noqa: F401 (re-exported: the hour's decoding lives in decode)
from embedscale.data.raw import BLOCK_BYTES
from embedscale.data.schema import Schema
from embedscale.data.shards import Manifest
from embedscale.data.tabular import convert
from embedscale.errors import ConfigError
from embedscale.specs import AVAZU_COLUMNS

DENSE_NAMES = ["hour_of_day", "day_of_week"]
SPARSE_NAMES = AVAZU_COLUMNS[3:]


HEADERS = ("present", "none", "auto")


def schema(header: str = "present") -> Schema:
    """The Avazu schema (a fresh copy). ``header``: ``present`` (every file starts with Avazu's header line),
    ``none`` (no file has one: the columns are in Avazu's order, ``AVAZU_COLUMNS``) or ``auto`` (a file's
    first line is a header when it is Avazu's)."""
    if header not in HEADERS:
        raise ConfigError(f"avazu: header must be one of {', '.join(HEADERS)}, got {header!r}")
    return Schema.from_dict({
        "format": "csv", "header": header, "columns": list(AVAZU_COLUMNS), "label": "click", "name": "avazu",
        "dense": [{"column": "hour", "name": "hour_of_day", "parse": "yymmddhh_hour", "transform": "log1p"},
                  {"column": "hour", "name": "day_of_week", "parse": "yymmddhh_weekday", "transform": "log1p"}],
        "sparse": [{"column": n} for n in SPARSE_NAMES],
        "notes": {"dense_transform": "hour (YYMMDDHH) -> log1p(hour of day), log1p(day of week, Monday = 0)",
                  "categorical_key": "FNV-1a 64 of the value's bytes; empty = key 0",
                  "missing_categorical": "empty value = key 0 before hashing or vocabulary"},
    }, "avazu preset")


AVAZU = schema()


def convert_avazu(paths, out_dir, *, categorical: str = "hash", table_rows: int | Sequence[int] = 0,
                  min_frequency: int = 1, shard_rows: int = 1_000_000, skip_malformed: bool = False,
                  max_rows: int | None = None, progress: bool = True, block_bytes: int = BLOCK_BYTES,
                  header: str = "present", **kwargs) -> Manifest:
    """Convert raw Avazu CSV files into an embedscale shard directory.

    Arguments as ``convert_criteo`` (``table_rows``: one value or a list of 21). With ``header="present"``
    every file must start with the Avazu header (a wrong header is an ``InputError`` naming ``<file>:1``);
    ``"none"`` reads files without one, their 24 columns in the header's order; ``"auto"`` takes either.
    Fields may be quoted (RFC 4180: ``"a,b"`` is one value).

    Returns:
        The ``Manifest``: dense ``hour_of_day``, ``day_of_week``; one-hot sparse ``C1``, ``banner_pos``,
        ... ``C21`` (21 features).

    Example::

        m = convert_avazu("train.gz", "data/avazu", categorical="vocab", min_frequency=5)
    """
    return convert(schema(header), paths, out_dir, categorical=categorical, table_rows=table_rows,
                   min_frequency=min_frequency, shard_rows=shard_rows, skip_malformed=skip_malformed,
                   max_rows=max_rows, progress=progress, block_bytes=block_bytes, **kwargs)
