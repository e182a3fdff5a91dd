"""Freed memory kept for the next step (``threads.keep_freed_memory``): a loop that allocates, writes and frees
the activations of a DLRM step (six 8 MB blocks, 2,048 samples x 1,024 floats each) has their pages faulted in
once, not on every step. Counted by the kernel (minor page faults, ``getrusage``) in a fresh interpreter, against
the same loop under glibc's default ``malloc`` (``EMBEDSCALE_THREADS=torch``: malloc left alone); the user's own
malloc settings are left alone too."""

import os
import subprocess
import sys

import pytest

from embedscale.threads import keep_freed_memory

STEPS, BLOCKS, PAGES = 20, 6, 8 * 2 ** 20 // 4096
LOOP = f"""
import resource
import numpy as np
from embedscale.threads import keep_freed_memory
kept = keep_freed_memory()
def step():
    blocks = [np.ones((2048, 1024), dtype=np.float32) for _ in range({BLOCKS})]
    del blocks
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({STEPS}):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(extra_env: dict) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "EMBEDSCALE_THREADS") and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", LOOP], env={**env, **extra_env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's fault counts")
def test_freed_memory_is_reused_without_new_page_faults():
    kept, faults = _faults({})
    default_kept, default_faults = _faults({"EMBEDSCALE_THREADS": "torch"})
    assert kept and not default_kept
    # glibc's default: blocks of every step faulted in again (its freed heap top handed back)
    assert default_faults > STEPS * PAGES, default_faults
    assert faults < STEPS * PAGES // 10, (faults, default_faults)  # kept: not even one block per step


def test_user_malloc_settings_win():
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not keep_freed_memory({"MALLOC_ARENA_MAX": "2"})
    assert not keep_freed_memory({"EMBEDSCALE_THREADS": "torch"})
