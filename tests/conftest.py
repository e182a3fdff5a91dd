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

import pytest

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the environment: torch reads OMP_NUM_THREADS when it loads)

torch.set_num_threads(1)


# The files that take longest, longest first (seconds of one worker on the 2-core machine: 207, 150, 118, 112, 90,
# 89, 73, 45, 44, 41). `make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`, which hands out files in
# collection order: starting with the longest ones keeps both workers busy to the end (longest-processing-time
# first) instead of leaving one file running alone at the tail.
LONGEST_FIRST = ("test_readme.py", "test_multinode.py", "test_faults.py", "test_plan_auto.py", "test_dmt_workflow.py",
                 "test_lifecycle.py", "test_replan_lag.py", "test_checkpoint_storage.py", "test_plan_rowgroups.py",
                 "test_plan_reorder.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


@pytest.fixture
def group(tmp_path):
    """A world of one: this process's default gloo group, for a test that drives one rank's collectives in process
    (an earlier in-process test of this worker may have left its own world of one, which serves as well)."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1, "a default process group of several ranks is left in this process"
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
