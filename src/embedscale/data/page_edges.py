"""The partial pages at the ends of a rank's run of rows, read by sector (``O_DIRECT``), not by page.

The kernel reads a file through its page cache in whole 4 KiB pages, so where a rank's run of rows in a column
starts or ends inside a page, that page is read whole by every rank whose rows it holds: with runs of a few
pages (a rank's slice of a global batch) this is a large part of what each rank reads. ``EdgeReader`` reads
only the 512-byte sectors of such a page that hold the run's bytes, with ``O_DIRECT`` (no page cache, no
readahead); the run's whole pages still come from the memory map. Where the file system or device refuses
``O_DIRECT`` (tmpfs, 4 KiB-sector devices, ...) it reads through the map as before.
"""

from __future__ import annotations

import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PAGE = 4096
SECTOR = 512  # the logical block of almost every device; a device with larger ones refuses and is read by page


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    """The threads that issue a batch's sector reads (shared by every reader of the process)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=8, thread_name_prefix="embedscale-sectors"))
    return _POOL[0]


class EdgeReader:
    """Partial pages of a memory-mapped file, read by sector. ``take`` returns the bytes of contiguous arrays
    over the map (each with its file offset), their partial first and last pages read by sector;
    ``direct_bytes`` counts those reads."""

    def __init__(self, path: str | os.PathLike):
        self.direct_bytes = 0
        self._fd = None
        if hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self._fd = None
        if self._fd is not None:
            weakref.finalize(self, os.close, self._fd)

    @property
    def active(self) -> bool:
        return self._fd is not None

    def take(self, views: list[tuple[np.ndarray, int]]) -> list[np.ndarray]:
        """Each ``(view, file offset)``'s bytes: the view itself when it covers whole pages, else a copy whose
        partial first and last pages were read by sector, all of them at once (``_read``)."""
        cuts, reads = [], []
        for view, start in views:
            end = start + view.nbytes
            if self._fd is None or not view.nbytes or (start % PAGE == 0 and end % PAGE == 0):
                cuts.append(None)
                continue
            head = min(end, start - start % PAGE + PAGE) if start % PAGE else start  # end of a partial first page
            tail = max(head, end - end % PAGE) if end % PAGE else end  # start of a partial last page
            cuts.append((head, tail))
            reads += [(a, b) for a, b in ((start, head), (tail, end)) if a < b]
        got = iter(self._read(reads))
        out = []
        for (view, start), cut in zip(views, cuts):
            if cut is None:
                out.append(view)
                continue
            flat, head, tail = view.reshape(-1).view(np.uint8), cut[0] - start, cut[1] - start
            copy = np.empty(view.nbytes, np.uint8)
            copy[head:tail] = flat[head:tail]
            for a, b in ((0, head), (tail, view.nbytes)):
                if a < b:
                    sectors = next(got)
                    copy[a:b] = flat[a:b] if sectors is None else sectors
            out.append(copy.view(view.dtype).reshape(view.shape))
        return out

    def _read(self, ranges: list[tuple[int, int]]) -> list[np.ndarray | None]:
        """File bytes ``[a, b)`` (each within one page) by ``O_DIRECT`` reads of their sectors, issued together
        on a few threads (a read waits on the device; several in flight overlap). ``None`` for every range
        when one is refused (then every later read goes through the map)."""
        if not ranges:
            return []
        buf = mmap.mmap(-1, PAGE * len(ranges))  # page-aligned, as O_DIRECT needs; a page per range

        def one(i: int) -> bool:
            a, b = ranges[i]
            lo, hi = a - a % SECTOR, -(-b // SECTOR) * SECTOR
            try:
                return os.preadv(self._fd, [memoryview(buf)[i * PAGE:i * PAGE + hi - lo]], lo) >= b - lo
            except OSError:
                return False

        ok = list(_pool().map(one, range(len(ranges)))) if len(ranges) > 1 else [one(0)]
        if not all(ok):
            self._fd = None  # the finalizer closes it
            return [None] * len(ranges)
        self.direct_bytes += sum(-(-b // SECTOR) * SECTOR - (a - a % SECTOR) for a, b in ranges)
        return [np.frombuffer(buf, np.uint8, count=b - a, offset=i * PAGE + a % SECTOR)
                for i, (a, b) in enumerate(ranges)]

    def whole_pages(self, start: int, nbytes: int) -> tuple[int, int]:
        """The range of whole pages in ``[start, start + nbytes)`` (what the map reads when edges are direct), or
        every page it touches when they are not."""
        end = start + nbytes
        if self._fd is None:
            return start - start % PAGE, end
        lo = -(-start // PAGE) * PAGE
        return lo, max(lo, end - end % PAGE)
