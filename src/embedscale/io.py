"""Atomic writes: a file is either the old one or the whole new one, never half-written.

Everything embedscale writes and reads back (manifests, profiles, plans, checkpoints, metrics) goes
through these helpers: write to a temporary file beside the target, flush, fsync, then rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Iterator

import yaml

from embedscale.errors import ConfigError, FormatError


def _umask() -> int:
    """The process's umask (read by setting and restoring it: the only portable way)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success rename it onto ``path``, on error remove it.

    The file gets the mode ``open`` would give it (0666 minus the umask), not mkstemp's 0600. An ``OSError``
    without a file name (a full disk: ENOSPC, EFBIG) is raised again naming ``path``, so the CLI can say
    ``error: <path>: <strerror>``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_save_npy(path: str | os.PathLike, array) -> None:
    """``np.save`` through a temporary file (never with pickled objects)."""
    import numpy as np

    with atomic_open(path, "wb") as f:
        np.save(f, np.asarray(array), allow_pickle=False)


def read_yaml(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a YAML (or JSON) file a user wrote, with a ``ConfigError`` that names it: missing, or not YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read JSON with an error that names the file (a local path, or a remote ``storage.ObjectPath``)."""
    path = Path(path) if isinstance(path, (str, os.PathLike)) else path
    if not path.exists():
        raise FormatError(f"{what} not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise FormatError(f"{path}:{line}: {what} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") \
            from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


def new_run_dir(cfg) -> Path:
    """A new run directory ``cfg.out_dir / NAME-YYYYmmdd-HHMMSS`` (``-1``, ``-2``, ... when that one exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(cfg.out_dir) / f"{cfg.name}-{stamp}"
    n = 1
    while path.exists():
        path = Path(cfg.out_dir) / f"{cfg.name}-{stamp}-{n}"
        n += 1
    path.mkdir(parents=True)
    return path
