"""Vectorised decoders of raw-log fields: Arrow ``binary`` columns in, numpy arrays and a ``bad`` mask out.

The raw readers let Arrow's CSV parser cut lines into fields (typed ``binary``, so Arrow converts
nothing) and decode the values here by rules we own: Arrow's number parser accepts ``0x1f`` and `` 5``
as integers, which the formats forbid. Every decoder returns a per-row ``bad`` mask instead of raising;
the reader then names the offending lines.

Numbers are decoded 8 characters at a time: the 8 bytes that end a field are loaded as one 64-bit word,
the bytes before the field's start are replaced by ``'0'``, and a 65,536-entry table maps each pair of
characters to its value (or to "not a digit"), so a field costs a handful of array operations whatever
its length. When every non-empty field of a column has the same width (Criteo's 8-digit hex), the
fields lie back to back in Arrow's data buffer and are decoded with no gather at all.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

_DEC = np.full(256, 255, np.uint8)  # 255: not a digit
_DEC[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX = _DEC.copy()
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _pair_table(digits: np.ndarray, radix: int) -> np.ndarray:
    """Two characters read as a little-endian uint16 (first character in the low byte) -> their value
    ``first * radix + second``, or 0xFFFF when either is not a digit."""
    pair = np.arange(1 << 16)
    first, second = digits[pair & 0xFF].astype(np.int64), digits[pair >> 8].astype(np.int64)
    return np.where((first < radix) & (second < radix), first * radix + second, 0xFFFF).astype(np.uint16)


_DEC_PAIRS = _pair_table(_DEC, 10)
_HEX_PAIRS = _pair_table(_HEX, 16)
_ZERO_WORD = np.uint64(int.from_bytes(b"0" * 8, "little"))
# _KEEP[L] keeps the last L characters of a little-endian word (its high L bytes)
_KEEP = np.array([(0xFFFFFFFFFFFFFFFF << (8 * (8 - L))) & 0xFFFFFFFFFFFFFFFF for L in range(9)], np.uint64)


def column_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n + 1], data uint8) of a binary array, honouring its slice offset."""
    if arr.type != pa.binary():
        arr = arr.cast(pa.binary())
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4).astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size else np.zeros(0, np.uint8)
    return offsets, data


def _per_chunk(col: pa.ChunkedArray | pa.Array, fn: Callable[[pa.Array], tuple]) -> tuple:
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = [fn(c) for c in chunks if len(c)]
    if not parts:
        return fn(pa.array([], pa.binary()))
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(p) for p in zip(*parts))


def _nulls(arr: pa.Array) -> np.ndarray | bool:
    # the readers ask Arrow for no nulls; should one appear anyway, it is a bad row, not a 0
    return arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else False


def _fixed_width_hex(offsets: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """All non-empty fields of one even width <= 16: reshape the data buffer, no gather. None otherwise."""
    lens = np.diff(offsets)
    nonempty = lens > 0
    widths = lens[nonempty]
    value = np.zeros(len(lens), np.uint64)
    bad = np.zeros(len(lens), bool)
    if not len(widths):
        return value, bad
    w = int(widths[0])
    if w > 16 or w % 2 or not (widths == w).all():
        return None
    pairs = _HEX_PAIRS[data[offsets[0]:offsets[-1]].view(np.uint16)].reshape(-1, w // 2)
    if pairs.max() > 255:  # only then find the rows
        bad[nonempty] = (pairs > 255).any(1)
    padded = np.zeros((len(pairs), 8), np.uint8)
    padded[:, 8 - w // 2:] = pairs
    value[nonempty] = padded.view(">u8").ravel()
    return value, bad


def _digits(arr: pa.Array, pairs: np.ndarray, radix: int, max_len: int, signed: bool):
    """Every field as a number in ``radix`` -> (uint64 magnitude, negative, digit count, bad)."""
    offsets, data = column_buffers(arr)
    n = len(offsets) - 1
    lo, hi = int(offsets[0]), int(offsets[-1])
    longest = min(int(np.diff(offsets).max(initial=0)), max_len)  # longer fields are bad anyway
    words = max(1, -(-longest // 8))
    pad = 8 * words  # '0's in front, so the word ending at any field's end starts inside the buffer
    buf = np.empty(pad + hi - lo, np.uint8)
    buf[:pad] = ord("0")
    buf[pad:] = data[lo:hi]
    start, end = offsets[:-1] + (pad - lo), offsets[1:] + (pad - lo)
    neg = np.zeros(n, bool)
    if signed and n:
        neg = (buf[np.minimum(start, len(buf) - 1)] == ord("-")) & (end > start)
        start = start + neg
    lens = end - start
    bad = (lens > max_len) | (neg & (lens == 0)) | _nulls(arr)
    word_at = np.ndarray((len(buf) - 7,), "<u8", buffer=buf, strides=(1,))  # word_at[i] = buf[i:i + 8]
    value = np.zeros(n, np.uint64)
    r2 = radix * radix
    for k in range(words):  # 8 characters at a time, from the right
        keep = _KEEP[np.clip(lens - 8 * k, 0, 8)]
        w = (word_at[end - 8 * (k + 1)] & keep) | (_ZERO_WORD & ~keep)
        p = pairs[w.view(np.uint16)].reshape(n, 4)
        if p.max(initial=0) >= r2:
            bad |= (p >= r2).any(1)
        p = p.astype(np.uint64)
        chunk = ((p[:, 0] * np.uint64(r2) + p[:, 1]) * np.uint64(r2) + p[:, 2]) * np.uint64(r2) + p[:, 3]
        value += chunk * np.uint64(radix ** (8 * k))
    return value, neg, lens, bad


def parse_decimal(col, max_digits: int = 18) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decimal integers ``-?[0-9]{1,max_digits}`` -> (int64 values, missing mask, bad mask).

    An empty field is missing (value 0). Anything else, ``+5``, `` 5``, ``0x1f``, ``1.0``, is bad."""
    def one(arr):
        v, neg, lens, bad = _digits(arr, _DEC_PAIRS, 10, max_digits, signed=True)
        v = v.astype(np.int64)
        return np.where(neg, -v, v), (lens == 0) & ~neg, bad
    return _per_chunk(col, one)


def parse_hex(col, max_digits: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Hexadecimal values ``[0-9a-fA-F]{0,16}`` -> (uint64 keys, bad mask); empty (missing) is 0, as
    ``int("0", 16)`` in Meta's DLRM reference, which fills missing fields with ``"0"`` before parsing."""
    def one(arr):
        if max_digits == 16 and not arr.null_count:
            fast = _fixed_width_hex(*column_buffers(arr))
            if fast is not None:
                return fast
        v, _, _, bad = _digits(arr, _HEX_PAIRS, 16, max_digits, signed=False)
        return v, bad
    return _per_chunk(col, one)


def parse_label(col) -> tuple[np.ndarray, np.ndarray]:
    """Click labels: exactly ``0`` or ``1`` -> (int8 labels, bad mask)."""
    def one(arr):
        offsets, data = column_buffers(arr)
        c = data[np.minimum(offsets[:-1], len(data) - 1)] if len(data) else np.zeros(len(arr), np.uint8)
        ok = (np.diff(offsets) == 1) & ((c == ord("0")) | (c == ord("1")))
        return (c == ord("1")).astype(np.int8), ~ok | _nulls(arr)
    return _per_chunk(col, one)


def field_lengths(col) -> np.ndarray:
    """Bytes in each field."""
    return _per_chunk(col, lambda arr: (np.diff(column_buffers(arr)[0]),))[0]


FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)


def fnv1a64(col) -> np.ndarray:
    """Stable 64-bit FNV-1a hash of each value's bytes; the empty (missing) value is key 0.

    Unlike Python's ``hash()`` it is the same in every process and on every machine."""
    def one(arr):
        offsets, data = column_buffers(arr)
        start, lens = offsets[:-1], np.diff(offsets)
        nonempty = lens > 0
        widths = lens[nonempty]
        if len(widths) and (widths == widths[0]).all():  # one width (e.g. 8 hex digits): no gather, no where
            w = int(widths[0])
            chars = data[offsets[0]:offsets[-1]].reshape(-1, w)
            hv = np.full(len(chars), FNV_OFFSET, dtype=np.uint64)
            with np.errstate(over="ignore"):
                for k in range(w):
                    hv ^= chars[:, k]
                    hv *= FNV_PRIME
            h = np.zeros(len(start), np.uint64)
            h[nonempty] = hv
            return (h,)
        h = np.full(len(start), FNV_OFFSET, dtype=np.uint64)
        last = max(len(data) - 1, 0)
        data = data if len(data) else np.zeros(1, np.uint8)
        with np.errstate(over="ignore"):
            for k in range(int(lens.max(initial=0))):  # character positions, not rows
                c = data[np.minimum(start + k, last)].astype(np.uint64)
                h = np.where(k < lens, (h ^ c) * FNV_PRIME, h)
        h[lens == 0] = 0
        return (h,)
    return _per_chunk(col, one)[0]


def show(value: bytes, limit: int = 40) -> str:
    """A field's bytes for an error message."""
    text = value.decode("utf-8", "replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")
