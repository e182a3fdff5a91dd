"""Where tensors live: the one module that names a device.

A run's device is decided here, once, from the configured name (:func:`run_device`: ``cuda:LOCAL_RANK`` for an
accelerator named without an index in a distributed run, so every rank binds its own GPU); the device a
process group's collectives take tensors on is decided here too (:func:`backend_device`). Every other module
takes the device it is given: a tensor's ``.device``, its module's device, or the run's device passed down.

Host memory is named, never spelt: :data:`HOST`. The rule, enforced on the source by
``tests/test_device_literals.py``: no module but this one writes a device name (``"cpu"``, ``"cuda"``) or calls
``.cpu()`` / ``.cuda()``. Data crosses to host memory only on purpose and says so with ``x.to(HOST)``:

- at the numpy boundary (``x.to(HOST).numpy()``: numpy reads host memory only);
- for files (checkpoint payloads, state dicts written or compared on the host);
- for state OPER keeps in host memory (the address map, Section 5.1) and input the host converts before it
  crosses to the run's device once;
- for the C++ kernels, which are host code: :func:`on_host` says whether a tensor is where they can run.

``x.to(HOST)`` returns ``x`` itself when it is already in host memory, as ``.cpu()`` does: no copy on CPU runs.
Designed for GPU runs, untested on GPU (no GPU here).
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")


def on_host(x: torch.Tensor | torch.device) -> bool:
    """``x`` (a tensor or a device) is in host memory."""
    return (x.device if isinstance(x, torch.Tensor) else torch.device(x)).type == HOST.type


def run_device(name: str | torch.device, local_rank: int | None = None) -> torch.device:
    """The device of a run's tensors from the configured ``name`` (``train.device``). An accelerator named
    without an index (``"cuda"``) in a distributed run binds the process's local rank (``cuda:LOCAL_RANK``, the
    rank within its host, torchrun's ``LOCAL_RANK``); an index given is kept; host memory stays :data:`HOST`
    (a host device carries no index)."""
    dev = torch.device(name)
    if dev.type == HOST.type:
        return HOST
    if dev.index is None and local_rank is not None:
        return torch.device(dev.type, int(local_rank))
    return dev


def backend_device(backend: str) -> torch.device:
    """The device a ``torch.distributed`` backend's collectives take tensors on: the current CUDA device for
    NCCL, host memory for gloo and MPI (their all-to-all is CPU-only). Designed for GPU (NCCL branch untested
    here)."""
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def process_group_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for a run on ``device``: NCCL for CUDA, gloo for host memory and any
    other device."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
