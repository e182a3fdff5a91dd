"""Suite-wide settings.

One intra-op thread for torch, here and in every process the tests start (``OMP_NUM_THREADS`` is inherited
by the CLI subprocesses; the launcher's ranks use one already, ``train.launch``). The tests' tensors are
tiny, so a second thread gains nothing, and on a machine whose cores are busy with other work the threads'
hand-offs wait for a core: a small training step measured 25x slower with 2 threads than with 1 at a load
average of 20 on 2 cores. That, not the work, is what made the suite slow and its multi-rank tests time out
under load.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the environment: torch reads OMP_NUM_THREADS when it loads)

torch.set_num_threads(1)
