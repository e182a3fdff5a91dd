"""Where checkpoints live: a local directory, or any fsspec URI (``s3://bucket/runs/big``, ``gs://...``,
``memory://...``), behind one small path type.

:func:`location` turns what a user gave into a ``pathlib.Path`` (a local path: everything works as before,
temporary directories renamed into place) or an :class:`ObjectPath` (a URI: an fsspec file system and a
path in it). An ``ObjectPath`` offers the few ``Path`` methods the checkpoint code uses (``/``, ``name``,
``parent``, ``is_dir``, ``is_file``, ``iterdir``, ``read_text``, ...) plus what an object store needs instead
of renames: :meth:`ObjectPath.write_bytes` puts one object whole (a single PUT: a reader sees the old
object or the new one), :meth:`ObjectPath.read_ranges` reads byte ranges (a restore reads only the rows a
rank needs), :func:`remove_tree` deletes a directory. An object store has no rename, so a checkpoint there is
written part by part with its manifest last, and a reader takes a step directory only once its manifest
exists (``train.checkpoint``).

Options of the file system come from the standard places: the AWS environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_DEFAULT_REGION``, ...) and fsspec's own configuration
(``FSSPEC_S3='{"endpoint_url": "...", "client_kwargs": {...}}'`` or ``~/.config/fsspec/``), so every rank of a
run launched with the same environment reaches the same store. For S3 the connect timeout is short and the
retries few, so an unreachable endpoint or a missing bucket is a :class:`StorageError` naming the URI within
seconds, never a silent wait.

``BYTES_READ`` counts the bytes this process read from remote locations (whole objects and ranges);
``LOCAL_BYTES_READ`` those :func:`fetch_ranges` read from local files.

:func:`fetch_ranges` reads many byte ranges of many files at once: the ranges of one object that touch or lie
within :data:`MAX_GAP` bytes of each other become one request, and every request of one file system goes out in
one batch (fsspec's ``cat_ranges``: concurrent on an asynchronous file system such as S3's, at most
``concurrency`` requests in flight); local files are read with ``pread``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from embedscale.errors import EmbedscaleError
from embedscale.io import atomic_open

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_S3 = {"s3", "s3a"}
# S3: fail fast. botocore's defaults (60 s connect timeout, retried) leave a bad endpoint hanging for minutes
_S3_DEFAULTS = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                                  "retries": {"max_attempts": 2, "mode": "standard"}},
                "use_listings_cache": False}
_S3_RETRIES = 2  # s3fs's own retries of a failed call (its default: 5, backing off)
BYTES_READ = [0]  # a list: a counter the readers add to (tests and benchmarks read and reset it)
LOCAL_BYTES_READ = [0]  # the same for local files read by fetch_ranges
MAX_GAP = 4096  # fetch_ranges: ranges of one object this close are one request (a request costs more than 4 KiB)


class StorageError(EmbedscaleError):
    """A checkpoint location that cannot be used: an unknown protocol, a missing bucket, an unreachable
    endpoint, refused credentials. The message names the URI."""


def is_uri(x) -> bool:
    """Whether ``x`` is a URI of a non-local file system (``s3://...``); ``file://`` and plain paths are local."""
    if isinstance(x, ObjectPath):
        return True
    m = _URI.match(str(x)) if isinstance(x, str) else None
    return bool(m) and m.group(1).lower() not in ("file", "local")


def location(x: str | os.PathLike | "ObjectPath") -> "Path | ObjectPath":
    """``x`` as a ``Path`` (a local path or ``file://`` URI) or an :class:`ObjectPath` (any other fsspec URI)."""
    if isinstance(x, (ObjectPath, Path)):
        return x
    s = os.fspath(x)
    if not is_uri(s):
        return Path(s[len("file://"):] if s.startswith("file://") else s)
    return ObjectPath.from_uri(s)


_ENV = ("AWS_", "FSSPEC_", "GOOGLE_", "AZURE_")  # the environment a file system reads when it is made
_FILESYSTEMS: dict = {}  # (protocol, pid, that environment) -> file system


def _filesystem(protocol: str, uri: str):
    """The file system of ``protocol`` with S3's fail-fast defaults: one per process and environment (fsspec's
    own cache ignores the environment, so a process whose ``AWS_ENDPOINT_URL`` changed would keep the old
    endpoint)."""
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry
    except ImportError:  # pragma: no cover - a pinned dependency
        raise StorageError(f"{uri}: fsspec is not installed (pip install fsspec)") from None
    if protocol not in known_implementations and protocol not in registry:  # registry: registered at run time
        raise StorageError(f"{uri}: unknown storage protocol {protocol!r} (a local path, or an fsspec URI such as "
                           "s3://bucket/path)")
    key = (protocol, os.getpid(), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV))))
    if key in _FILESYSTEMS:
        return _FILESYSTEMS[key]
    try:
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **(_S3_DEFAULTS if protocol in _S3 else {}))
        if protocol in _S3:
            fs.retries = _S3_RETRIES
        _FILESYSTEMS[key] = fs
    except ImportError as e:
        raise StorageError(f"{uri}: the {protocol}:// file system needs a package that is not installed ({e})") \
            from None
    except (ValueError, TypeError) as e:
        raise StorageError(f"{uri}: cannot open the {protocol}:// file system ({e})") from None
    return fs


def _failed(uri: str, e: BaseException) -> StorageError:
    """A ``StorageError`` naming ``uri`` for an error of the file system (a missing bucket, an endpoint that
    does not answer, refused credentials)."""
    kind = type(e).__name__
    if isinstance(e, FileNotFoundError):
        return StorageError(f"{uri}: not found ({e}); is the bucket there, and the endpoint the right one "
                            "(AWS_ENDPOINT_URL)?")
    if isinstance(e, PermissionError):
        return StorageError(f"{uri}: access refused ({e}); check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE)")
    return StorageError(f"{uri}: storage error ({kind}: {e})")


class ObjectPath:
    """A path on an fsspec file system (module docstring): ``fs`` and ``path`` (without the protocol)."""

    def __init__(self, fs, path: str, protocol: str):
        self.fs, self.path, self.protocol = fs, path.rstrip("/"), protocol

    @classmethod
    def from_uri(cls, uri: str) -> "ObjectPath":
        protocol = _URI.match(uri).group(1).lower()
        fs = _filesystem(protocol, uri)
        return cls(fs, fs._strip_protocol(uri), protocol)

    # -- pathlib-like ------------------------------------------------------------------------------
    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(self.fs, f"{self.path}/{name}", self.protocol)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.path}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectPath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.fs, self.path.rsplit("/", 1)[0] if "/" in self.path else self.path, self.protocol)

    def with_name(self, name: str) -> "ObjectPath":
        return self.parent / name

    def _do(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StorageError:
            raise
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - botocore/aiohttp raise many kinds: one named error
            raise _failed(str(self), e) from None

    def exists(self) -> bool:
        return bool(self._do(self.fs.exists, self.path))

    def is_dir(self) -> bool:
        return bool(self._do(self.fs.isdir, self.path))

    def is_file(self) -> bool:
        return bool(self._do(self.fs.isfile, self.path))

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator["ObjectPath"]:
        try:
            names = self._do(self.fs.ls, self.path, detail=False)
        except FileNotFoundError:
            return iter(())
        return iter([ObjectPath(self.fs, n, self.protocol) for n in sorted(names) if n.rstrip("/") != self.path])

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing on an object store (a prefix exists once an object is under it)."""

    def size(self) -> int:
        return int(self._do(self.fs.size, self.path))

    def read_bytes(self) -> bytes:
        try:
            data = self._do(self.fs.cat_file, self.path)
        except FileNotFoundError as e:
            raise _failed(str(self), e) from None
        BYTES_READ[0] += len(data)
        return data

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def read_ranges(self, starts: list[int], ends: list[int]) -> list[bytes]:
        """The bytes ``[starts[i], ends[i])`` of this object, in one batch of ranged reads."""
        if not starts:
            return []
        try:
            out = self._do(self.fs.cat_ranges, [self.path] * len(starts), list(starts), list(ends),
                           on_error="raise")
        except FileNotFoundError as e:
            raise _failed(str(self), e) from None
        BYTES_READ[0] += sum(len(b) for b in out)
        return out

    def write_bytes(self, data: bytes) -> None:
        """Put the object whole (one PUT: readers see the old object or the new one)."""
        try:
            self._do(self.fs.pipe_file, self.path, bytes(data))
        except FileNotFoundError as e:
            raise _failed(str(self), e) from None

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self._do(self.fs.rm_file, self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def check(self) -> None:
        """Reach the store (on S3: the bucket, the first part of the path, must exist); a named error within
        seconds otherwise (module docstring)."""
        if self.protocol not in _S3:
            self._do(self.fs.exists, self.path)  # reaches the backend: its errors named
            return
        root = self.path.split("/", 1)[0]
        try:
            self._do(self.fs.info, root)  # the bucket itself (HEAD), not a listing of it
        except FileNotFoundError as e:
            raise StorageError(f"{self}: the bucket {root!r} does not exist or is not reachable ({e}); check "
                               "the URI and the endpoint (AWS_ENDPOINT_URL)") from None


def coalesce(starts: list[int], ends: list[int], max_gap: int = MAX_GAP) -> tuple[list[int], list[int], list[int]]:
    """Merge the ranges ``[starts[i], ends[i])`` of one object that overlap, touch or lie within ``max_gap`` bytes
    of each other: ``(merged starts, merged ends, which merged range holds each input range)``."""
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    ms: list[int] = []
    me: list[int] = []
    home = [0] * len(starts)
    for i in order:
        if ms and starts[i] <= me[-1] + max_gap:
            me[-1] = max(me[-1], ends[i])
        else:
            ms.append(starts[i])
            me.append(ends[i])
        home[i] = len(ms) - 1
    return ms, me, home


def fetch_ranges(requests: list[tuple["Path | ObjectPath", int, int]], *, max_gap: int = MAX_GAP,
                 concurrency: int | None = None) -> list[bytes]:
    """The bytes of every ``(path, start, end)`` of ``requests``, in order (module docstring): nearby ranges of a
    file coalesced, one batch of requests per file system (``concurrency``: at most this many in flight; ``None``
    the file system's default)."""
    out: list[bytes] = [b""] * len(requests)
    by_file: dict = {}
    for i, (p, s, e) in enumerate(requests):
        if e > s:
            by_file.setdefault(p, []).append(i)
    merged = []  # (path, start, end, [(request, offset in the merged range)])
    for p, idx in by_file.items():
        ms, me, home = coalesce([requests[i][1] for i in idx], [requests[i][2] for i in idx], max_gap)
        parts: list[list] = [[] for _ in ms]
        for i, h in zip(idx, home):
            parts[h].append((i, requests[i][1] - ms[h]))
        merged += [(p, a, b, q) for a, b, q in zip(ms, me, parts)]
    groups: dict = {}
    for k, (p, _, _, _) in enumerate(merged):
        groups.setdefault(id(p.fs) if isinstance(p, ObjectPath) else None, []).append(k)
    for key, ks in groups.items():
        if key is None:
            datas = _pread_ranges([merged[k] for k in ks])
        else:
            datas = _cat_ranges([merged[k] for k in ks], concurrency)
        for k, data in zip(ks, datas):
            for i, off in merged[k][3]:
                out[i] = data[off:off + requests[i][2] - requests[i][1]]
    return out


def _cat_ranges(ranges: list[tuple], concurrency: int | None) -> list[bytes]:
    """One ``cat_ranges`` batch over the object ranges ``(path, start, end, _)`` of one file system."""
    p0 = ranges[0][0]
    kw = {"batch_size": concurrency} if concurrency and getattr(p0.fs, "async_impl", False) else {}
    try:
        got = p0._do(p0.fs.cat_ranges, [r[0].path for r in ranges], [r[1] for r in ranges], [r[2] for r in ranges],
                     on_error="raise", **kw)
    except FileNotFoundError as e:
        raise _failed(str(p0), e) from None
    BYTES_READ[0] += sum(len(b) for b in got)
    return got


def _pread_ranges(ranges: list[tuple]) -> list[bytes]:
    """The local ranges ``(path, start, end, _)``, each file opened once."""
    out: list[bytes] = []
    files: dict = {}
    try:
        for p, start, end, _ in ranges:
            if p not in files:
                files[p] = open(p, "rb")
            out.append(os.pread(files[p].fileno(), end - start, start))
    finally:
        for f in files.values():
            f.close()
    LOCAL_BYTES_READ[0] += sum(len(b) for b in out)
    return out


def check_location(x) -> None:
    """A checkpoint location a run is about to use: a remote one must be reachable with its bucket there (a
    named :class:`StorageError` within seconds, before any data is prepared); a local one needs nothing."""
    loc = location(x)
    if isinstance(loc, ObjectPath):
        loc.check()


def remove_tree(p: "Path | ObjectPath") -> None:
    """Remove a directory and everything under it (missing: nothing to do)."""
    if isinstance(p, ObjectPath):
        try:
            p._do(p.fs.rm, p.path, recursive=True)
        except FileNotFoundError:
            pass
        return
    shutil.rmtree(p, ignore_errors=True)


def write_bytes(p: "Path | ObjectPath", data: bytes) -> None:
    """``data`` into ``p`` atomically: a local file through a temporary file renamed, an object in one PUT."""
    if isinstance(p, ObjectPath):
        p.write_bytes(data)
        return
    with atomic_open(p, "wb") as f:
        f.write(data)


__all__ = ["BYTES_READ", "LOCAL_BYTES_READ", "MAX_GAP", "ObjectPath", "StorageError", "check_location", "coalesce",
           "fetch_ranges", "is_uri", "location", "remove_tree", "write_bytes"]
