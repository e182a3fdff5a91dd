"""Reader of the raw Avazu click log (Kaggle CTR prediction ``train``, ``.gz`` too).

A comma-separated file with the header ``id,click,hour,C1,banner_pos,site_id,...,C21`` (``AVAZU_COLUMNS``):
24 columns. The label is ``click``; ``id`` is a row identifier and is not a feature.

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

import datetime
import re
from typing import Sequence

import numpy as np
import pyarrow as pa

from embedscale.data.fields import field_lengths, fnv1a64, parse_decimal, parse_label, show
from embedscale.data.raw import BLOCK_BYTES, Decoded, LogFormat, convert_log
from embedscale.data.shards import Manifest
from embedscale.specs import AVAZU_COLUMNS

DENSE_NAMES = ["hour_of_day", "day_of_week"]
SPARSE_NAMES = AVAZU_COLUMNS[3:]
_HOUR = re.compile(rb"[0-9]{8}")
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (Monday = 0)


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


def _decode(table: pa.Table) -> Decoded:
    labels, bad = parse_label(table.column("click"))
    hour, missing, b = parse_decimal(table.column("hour"), max_digits=8)
    hh, weekday, valid = split_hour(hour)
    bad |= b | missing | (field_lengths(table.column("hour")) != 8) | ~valid
    dense = np.log1p(np.stack([hh, weekday], axis=1).astype(np.float32))
    keys = np.stack([fnv1a64(table.column(name)) for name in SPARSE_NAMES])
    return Decoded(labels, dense, keys, bad)


def _check_line(fields: list[bytes]) -> str | None:
    if fields[1] not in (b"0", b"1"):
        return f"click {show(fields[1])} is not 0 or 1"
    h = fields[2]
    if not _HOUR.fullmatch(h):
        return f"hour {show(h)} is not YYMMDDHH"
    try:
        datetime.datetime(2000 + int(h[:2]), int(h[2:4]), int(h[4:6]), int(h[6:8]))
    except ValueError:
        return f"hour {show(h)} is not a valid date and hour (YYMMDDHH)"
    return None


AVAZU = LogFormat(
    name="avazu", delimiter=",", column_names=list(AVAZU_COLUMNS), dense_names=DENSE_NAMES,
    sparse_names=SPARSE_NAMES, decode=_decode, check_line=_check_line,
    header=",".join(AVAZU_COLUMNS).encode(), include=AVAZU_COLUMNS[1:],
    notes={"dense_transform": "hour (YYMMDDHH) -> log1p(hour of day), log1p(day of week, Monday = 0)",
           "categorical_key": "FNV-1a 64 of the value's bytes; empty = key 0",
           "missing_categorical": "empty value = key 0 before hashing or vocabulary"},
)


def convert_avazu(paths, out_dir, *, categorical: str = "hash", table_rows: int | Sequence[int] = 1_000_000,
                  min_frequency: int = 1, shard_rows: int = 1_000_000, skip_malformed: bool = False,
                  max_rows: int | None = None, progress: bool = True, block_bytes: int = BLOCK_BYTES) -> Manifest:
    """Convert raw Avazu CSV files into an embedscale shard directory.

    Arguments as ``convert_criteo`` (``table_rows``: one value or a list of 21). Every file must start
    with the Avazu header; a wrong header is an ``InputError`` naming ``<file>:1``.

    Returns:
        The ``Manifest``: dense ``hour_of_day``, ``day_of_week``; one-hot sparse ``C1``, ``banner_pos``,
        ... ``C21`` (21 features).

    Example::

        m = convert_avazu("train.gz", "data/avazu", categorical="vocab", min_frequency=5)
    """
    return convert_log(AVAZU, paths, out_dir, categorical=categorical, table_rows=table_rows,
                       min_frequency=min_frequency, shard_rows=shard_rows, skip_malformed=skip_malformed,
                       max_rows=max_rows, progress=progress, block_bytes=block_bytes)
