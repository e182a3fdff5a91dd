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

import numpy as np

PAGE = 4096
SECTOR = 512  # the logical block of almost every device; a device with larger ones refuses and is read by page


class EdgeReader:
    """Partial pages of a memory-mapped file, read by sector. ``take(view, start)`` returns the bytes of ``view``
    (a contiguous array over the map, at file offset ``start``): the view itself when it covers whole pages,
    else a copy whose partial first and last pages were read by sector. ``direct_bytes`` counts those reads."""

    def __init__(self, path: str | os.PathLike):
        self.direct_bytes = 0
        self._fd = None
        if hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self._fd = None
        if self._fd is not None:
            self._buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT needs
            weakref.finalize(self, os.close, self._fd)

    @property
    def active(self) -> bool:
        return self._fd is not None

    def take(self, view: np.ndarray, start: int) -> np.ndarray:
        end = start + view.nbytes
        if self._fd is None or not view.nbytes or (start % PAGE == 0 and end % PAGE == 0):
            return view
        flat = view.reshape(-1).view(np.uint8)
        out = np.empty(view.nbytes, np.uint8)
        head = min(end, start - start % PAGE + PAGE) if start % PAGE else start  # end of a partial first page
        tail = max(head, end - end % PAGE) if end % PAGE else end  # start of a partial last page
        for a, b in ((start, head), (tail, end)):
            if a < b:
                out[a - start:b - start] = self._sectors(a, b, flat[a - start:b - start])
        out[head - start:tail - start] = flat[head - start:tail - start]
        return out.view(view.dtype).reshape(view.shape)

    def _sectors(self, a: int, b: int, mapped: np.ndarray) -> np.ndarray:
        """File bytes ``[a, b)`` (within one page) by an ``O_DIRECT`` read of their sectors; on a refusal the
        mapped bytes, and every later read through the map."""
        lo, hi = a - a % SECTOR, -(-b // SECTOR) * SECTOR
        try:
            n = os.preadv(self._fd, [memoryview(self._buf)[:hi - lo]], lo)
        except OSError:
            n = -1
        if n < b - lo:
            self._fd = None  # the finalizer closes it
            return mapped
        self.direct_bytes += hi - lo
        return np.frombuffer(self._buf, np.uint8, count=b - a, offset=a - lo)

    def whole_pages(self, start: int, nbytes: int) -> tuple[int, int]:
        """The range of whole pages in ``[start, start + nbytes)`` (what the map reads when edges are direct), or
        every page it touches when they are not."""
        end = start + nbytes
        if self._fd is None:
            return start - start % PAGE, end
        lo = -(-start // PAGE) * PAGE
        return lo, max(lo, end - end % PAGE)
