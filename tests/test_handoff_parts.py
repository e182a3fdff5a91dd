"""Rank 0's run handed to another node through torchrun's store (``train.nodes.Handoff``): a plan file larger than
the store takes in one value (8 MiB, its libuv server) arrives whole. Reference: the file's own bytes."""

from __future__ import annotations

import datetime
import socket

import numpy as np
import torch.distributed as dist

from embedscale.train.nodes import Handoff


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_plan_file_over_the_stores_value_limit_arrives_whole(tmp_path):
    port = _port()
    t = datetime.timedelta(seconds=60)
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=t, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=t, wait_for_workers=False)
    src, dst = tmp_path / "rank0", tmp_path / "node1"
    (src / "plan").mkdir(parents=True)
    data = np.random.default_rng(0).integers(0, 256, 9 * 2**20 + 123, dtype=np.uint8).tobytes()  # > 8 MiB
    (src / "plan" / "rows_by_partition.npy").write_bytes(data)
    (src / "config.yaml").write_text("a: 1\n")
    Handoff(server, "t").publish(src, [])
    Handoff(client, "t")._write_files(dst, ["config.yaml", "plan/rows_by_partition.npy"])
    assert (dst / "plan" / "rows_by_partition.npy").read_bytes() == data
    assert (dst / "config.yaml").read_text() == "a: 1\n"
