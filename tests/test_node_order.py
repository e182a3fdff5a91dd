"""Ranks follow ``--node-rank``, not torchrun's rendezvous order: two torchrun nodes on one host (c10d
rendezvous, 2 ranks each), node 1 started first. torchrun numbers the nodes by (host name, agent pid), so it
gives node 1 group rank 0 (checked here: ``EMBEDSCALE_TORCHRUN_RANK``); with ``EMBEDSCALE_NODE_RANK`` (what the
multi-node launcher sets) the ranks renumber themselves ``node * 2 + local`` and the process group made after
it holds every rank once, in that order (an all_gather of each rank's node as launched and local rank, against
the list worked out by hand). A node rank given twice is a named error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from embedscale.train.launch import follow_node_rank, init_from_env
follow_node_rank()
rank, world = init_from_env(timeout_s=120)
me = torch.tensor([int(os.environ["TEST_NODE"]), int(os.environ["LOCAL_RANK"])])  # the node as launched
out = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
dist.all_gather(out, me)
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "torchrun_rank": int(os.environ.get("EMBEDSCALE_TORCHRUN_RANK", rank)),
               "gathered": [o.tolist() for o in out]}, f)
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(node: int, endpoint: str, script: Path, out: Path, as_rank: int) -> subprocess.Popen:
    env = {**os.environ, "EMBEDSCALE_NODE_RANK": str(as_rank), "TEST_NODE": str(node), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint}", "--rdzv-id=node-order",
           f"--rdzv-conf=is_host={'1' if node == 0 else '0'},join_timeout=120", str(script), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _run(tmp_path: Path, ranks: tuple[int, int]) -> tuple[list, list[str]]:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    endpoint = f"127.0.0.1:{_port()}"
    first = _node(1, endpoint, script, out, ranks[1])  # node 1 first: the smaller agent pid
    time.sleep(1.0)
    second = _node(0, endpoint, script, out, ranks[0])
    errs = []
    for p in (first, second):
        try:
            _, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        errs.append(err.decode(errors="replace"))
    files = [out / f"rank-{r}.json" for r in range(4)]
    return [json.loads(f.read_text()) for f in files if f.exists()], errs


def test_ranks_follow_the_node_rank_not_the_rendezvous_order(tmp_path):
    got, errs = _run(tmp_path, (0, 1))
    assert len(got) == 4, errs
    want = [[0, 0], [0, 1], [1, 0], [1, 1]]  # rank r: node r // 2, local rank r % 2
    for g in got:
        assert g["gathered"] == want
    if any(g["rank"] != g["torchrun_rank"] for g in got):  # torchrun gave node 1 the first ranks (usual here)
        assert {g["rank"]: g["torchrun_rank"] for g in got} == {0: 2, 1: 3, 2: 0, 3: 1}


def test_a_node_rank_given_twice_is_a_named_error(tmp_path):
    got, errs = _run(tmp_path, (1, 1))
    assert "--node-rank 1 is given to two nodes" in "".join(errs), errs
