"""The fused C++ CPU kernel of the embedding training step: build once, load at run time, or fall back.

``kernels.cpp`` holds the backward + sparse optimizer update of :class:`embedscale.embedding.local.LocalEmbeddingBags`'
pooled lookup in one OpenMP pass over the features (tables): every looked-up value's output gradient is
accumulated into its row through a dense row -> slot map (no sort), then SGD or row-wise Adagrad is applied
once per distinct row (FBGEMM ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD``: duplicates summed first; the
formulas of :mod:`embedscale.embedding.optim`). Each row's contributions are summed in batch order, as the
PyTorch path (stable sort by row, then a weighted segment sum) does.

The same extension serves the sharded step of :class:`embedscale.embedding.sharded.ShardedEmbedding` (retrieve
design, OPER 5.1-5.2; its inference lookups and those of ``PgasShardedEmbedding`` too): the index conversion's
id check + global row ids (``sharded_feature_gids``) and code decode + remote split (``sharded_remote_split``)
in one pass each, the pooling over ``[storage | fetch area]`` (``fused_pooled_forward`` over the feature-major
values, written sample-major), the per-row gradient sums of backward (``sharded_row_grad_sums``: a row -> slot
map, no sort) and the owner's merge of its own and its peers' sums with the optimizer update
(``sharded_apply_row_grads``). Each gives the bits of the PyTorch ops it replaces (same order of additions,
same rounding); the calls release the GIL, so the prefetch thread's conversion runs beside the step.

The extension is compiled ONCE, outside training and the test suite, by the install step::

    python -m embedscale.embedding.kernels --build

(``make`` runs it). It is cached under ``$EMBEDSCALE_KERNELS_DIR``, else ``$TORCH_EXTENSIONS_DIR/embedscale``,
else ``<venv>/var/embedscale-kernels``, in a directory named after a hash of the source and compiler flags,
so a changed source is never loaded stale. At run time :func:`fused_ops` only *loads* a finished build;
when there is none (no compiler, not built yet, another build) it returns ``None`` after logging one line,
and the callers keep the pure PyTorch path: training never compiles. ``EMBEDSCALE_NO_KERNELS=1`` keeps the
PyTorch path on purpose; ``LocalEmbeddingBags(cpu_kernel=False)`` does so for one module.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from embedscale.device import on_host

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
QUANT_SOURCE = Path(__file__).with_name("quant_kernels.cpp")
"""The serving lookup's kernel: pooling straight from INT8 / INT4 / FP16 rows (``quantized_pooled_forward``)."""
SOURCES = (SOURCE, QUANT_SOURCE)
CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-march=native", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
MAX_DIM = 1024
"""Largest row width the kernel takes (``MAX_DIM`` in ``kernels.cpp``)."""

_state: dict[str, object] = {}
_lock = threading.Lock()  # fused_ops: one load per process


def takes(weights: torch.Tensor) -> bool:
    """The kernel can update this storage: float32 in host memory (the kernel is CPU code; every other
    device and dtype keeps the PyTorch path)."""
    return on_host(weights) and weights.dtype == torch.float32


def cache_root() -> Path:
    """Where builds are cached (see the module docstring)."""
    env = os.environ.get("EMBEDSCALE_KERNELS_DIR")
    if env:
        return Path(env)
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env) / "embedscale"
    return Path(sys.prefix) / "var" / "embedscale-kernels"


def build_name(source: Path = SOURCE) -> str:
    """Module name of the current source: a hash of the source, flags and torch version."""
    h = hashlib.sha256(source.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    return f"embedscale_{source.stem}_{h.hexdigest()[:16]}"


def library_path(source: Path = SOURCE) -> Path:
    name = build_name(source)
    return cache_root() / name / f"{name}.so"


def build(verbose: bool = False, source: Path = SOURCE) -> Path:
    """Compile the extension of ``source`` (minutes on a loaded machine); returns the shared library's path."""
    from torch.utils.cpp_extension import load  # heavy import, only for the build step

    name = build_name(source)
    directory = cache_root() / name
    if (directory / f"{name}.so").exists():
        return directory / f"{name}.so"
    # built in a directory of its own, then renamed into place: a process never finds a half-linked library
    # under the final name, and two concurrent builds of one source leave one whole build
    work = cache_root() / f".{name}.build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        # copies of the flags: load() appends torch's libraries to the list it is given, which would rename every
        # later build of this process (build_name hashes the flags)
        load(name=name, sources=[str(source)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
             build_directory=str(work), verbose=verbose)
        if not (work / f"{name}.so").exists():  # pragma: no cover - load() raises on a failed build
            raise RuntimeError(f"build of {source} produced no {work / f'{name}.so'}")
        try:
            os.rename(work, directory)
        except OSError:  # another build of the same source landed first: keep it
            if not (directory / f"{name}.so").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return directory / f"{name}.so"


def _import(path: Path, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def fused_ops() -> ModuleType | None:
    """The loaded extension, or ``None`` (logged once) when no build of the current source exists. Loaded
    once per process, under a lock: a second thread never sees (or re-initialises) a module still loading."""
    return _ops(SOURCE, "the embedding step")


def quant_ops() -> ModuleType | None:
    """The serving lookup's extension (``quant_kernels.cpp``), or ``None`` as :func:`fused_ops`."""
    return _ops(QUANT_SOURCE, "the quantized lookup")


def _ops(source: Path, user: str) -> ModuleType | None:
    key = source.stem
    if key in _state:
        return _state[key]  # type: ignore[return-value]
    with _lock:
        if key not in _state:
            _state[key] = _load_ops(source, user)
        return _state[key]  # type: ignore[return-value]


def _load_ops(source: Path, user: str) -> ModuleType | None:
    ops = None
    path = library_path(source) if source.exists() else None
    if path is None:
        log.warning("fused CPU kernel source %s is not installed: %s uses PyTorch ops", source, user)
    elif os.environ.get("EMBEDSCALE_NO_KERNELS"):
        log.info("fused CPU kernel disabled (EMBEDSCALE_NO_KERNELS): %s uses PyTorch ops", user)
    elif not path.exists():
        log.warning("fused CPU kernel not built (%s missing; run `python -m embedscale.embedding.kernels "
                    "--build`): %s uses PyTorch ops", path, user)
    else:
        try:
            ops = _import(path, path.stem)
        except (ImportError, OSError) as e:
            log.warning("fused CPU kernel %s does not load (%s): %s uses PyTorch ops", path, e, user)
    return ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embedscale.embedding.kernels",
                                 description="Build or locate the fused C++ CPU embedding kernel.")
    ap.add_argument("--build", action="store_true", help="compile the extension if no build of this source exists")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    code = 0
    for source in SOURCES:
        path = library_path(source)
        if args.build and not path.exists():
            t0 = time.monotonic()
            try:
                path = build(verbose=args.verbose, source=source)
            except Exception as e:  # compiler missing or failing: say so, the PyTorch path remains
                print(f"error: building {source.name} failed ({type(e).__name__}: {e}); "
                      f"its callers will use PyTorch ops", file=sys.stderr)
                code = 2
                continue
            print(f"built {path} in {time.monotonic() - t0:.0f} s")
            continue
        print(f"{path} {'exists' if path.exists() else 'is not built'}")
        code = code or (0 if path.exists() else 1)
    return code


if __name__ == "__main__":
    sys.exit(main())
