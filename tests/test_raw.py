"""Block reading and the background prefetch of the raw readers."""

from __future__ import annotations

import gzip
import random

import pytest

from embedscale.data.raw import LineBlock, _prefetch, iter_line_blocks
from embedscale.errors import InputError


def _lines(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [bytes(rng.choice(b"abc\t") for _ in range(rng.choice([0, 3, 40, 700]))) for _ in range(n)]


@pytest.mark.parametrize("reuse", [0, 3])
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_blocks_hold_whole_lines_in_order(tmp_path, reuse, trailing_newline):
    lines = _lines(300)
    text = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    path = tmp_path / "log.tsv"
    path.write_bytes(text)
    got, first_lines = [], []
    for block in iter_line_blocks(path, block_bytes=256, reuse=reuse):  # lines up to 700 bytes > block
        assert isinstance(block, LineBlock)
        data = bytes(block.data)  # copied now: with reuse the buffer is overwritten 3 blocks later
        assert data.count(b"\n") == block.num_lines or (not trailing_newline and not data.endswith(b"\n"))
        first_lines.append(block.first_line)
        got.append(data)
    assert b"".join(got) == text
    starts = [1]
    for d in got[:-1]:
        starts.append(starts[-1] + d.count(b"\n"))
    assert first_lines == starts


def test_header_and_gzip(tmp_path):
    path = tmp_path / "log.csv.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"a,b\n1,2\n3,4\n")
    items = list(iter_line_blocks(path, header=True))
    assert items[0] == b"a,b\n" and bytes(items[1].data) == b"1,2\n3,4\n" and items[1].first_line == 2


def test_prefetch_keeps_order_and_raises_producer_errors():
    def produce():
        yield from range(5)
        raise InputError("bad.tsv:6: broken")

    got = []
    with pytest.raises(InputError, match="bad.tsv:6"):
        for x in _prefetch(produce()):
            got.append(x)
    assert got == [0, 1, 2, 3, 4]


def test_prefetch_stops_its_producer_when_the_consumer_stops():
    closed = []

    def produce():
        try:
            yield from range(1000)
        finally:
            closed.append(True)

    items = _prefetch(produce())
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    assert closed == [True]
