"""``embedscale doctor`` on two local nodes, and its named errors for an endpoint a node cannot use.

Two launchers (nodes 0 and 1, 2 ranks each, c10d rendezvous on 127.0.0.1) check a run whose nodes hold
different copies of the data (node 1's has fewer rows): the doctor must name the unequal batch counts per epoch
(what a training run would hang on), count them as a plain-Python division says, and write the measured
4 x 4 link matrix as a topology that ``embedscale plan --topology`` plans with (the plan records it). Alone,
a node whose endpoint nobody answers ends with a named error within its reach timeout, and node 0 refuses an
endpoint that is not its own address.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import make_data  # noqa: E402

from embedscale.cli import main  # noqa: E402
from embedscale.plan.plan import Plan  # noqa: E402
from embedscale.train.launch import free_port  # noqa: E402

BATCH = 48


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert proc.poll() is None, proc.communicate()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail("node 0's doctor did not answer on the endpoint")


@pytest.mark.multinode
def test_doctor_on_two_nodes_names_uneven_batches_and_writes_the_planners_topology(tmp_path):
    rows = {0: 600, 1: 400}
    for node, n in rows.items():
        make_data(tmp_path / f"data{node}", n=n)
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "embedscale", "doctor", "--nnodes", "2", "--node-rank", str(node),
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc", "2", "--run-dir", str(tmp_path / f"run{node}"),
               "--data-source", "shards", "--data-path", str(tmp_path / f"data{node}"),
               "--data-eval-fraction", "0", "--train-batch-size", str(BATCH), "--json"]
        env = {**os.environ, "PET_LOCAL_ADDR": f"127.0.0.{node + 1}", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        if node == 0:
            wait_listening(port, procs[0])
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # node 0 (rank 0's) has the report; the uneven data is a problem: exit 1
    assert procs[0].returncode == 1, outs[0]
    assert procs[1].returncode == 0, outs[1]
    rep = json.loads(outs[0][0].strip().splitlines()[-1])
    ranks = rep["ranks"]
    assert ranks["world_size"] == 4 and ranks["hosts"] == 2 and ranks["ranks_per_host"] == 2
    assert ranks["batches_per_epoch"] == [math.ceil(rows[r // 2] / BATCH) for r in range(4)]  # [13, 13, 9, 9]
    assert any("different batch counts per epoch" in p and "rank 2: 9 batches of 400 rows" in p
               for p in ranks["problems"])
    assert ranks["run_dir_shared_with_rank0"] == [True, True, False, False]
    assert len(ranks["clock_offset_ms"]) == 4 and ranks["clock_offset_ms"][0] == 0.0
    assert rep["node"]["interface"] == "lo" and "GLOO_SOCKET_IFNAME=lo" in rep["node"]["hint"]
    topo_file = tmp_path / "run0" / "topology.json"
    topo = json.loads(topo_file.read_text())
    bw = np.array(topo["bandwidth"])
    assert topo["num_hosts"] == 2 and topo["ranks_per_host"] == 2 and topo["source"] == "measured"
    off = ~np.eye(4, dtype=bool)
    assert bw.shape == (4, 4) and (bw > 0).all() and np.isfinite(bw).all()
    assert not np.isin(bw[off], [100.0, 23.75]).any()  # every pair measured, none the spec's default
    # the planner plans with it: the plan records the measured links
    r = CliRunner().invoke(main, ["plan", "--preset", "criteo-kaggle", "--max-rows", "200", "--strategy", "row_wise",
                                  "--topology", str(topo_file), "--out", str(tmp_path / "plans"), "--json"])
    assert r.exit_code == 0, r.output
    meta = Plan.load(tmp_path / "plans" / "row_wise").meta["topology"]
    np.testing.assert_array_equal(np.array(meta["bandwidth"]), bw)
    assert meta["source"] == "measured" and (meta["num_hosts"], meta["ranks_per_host"]) == (2, 2)


def test_unreachable_endpoint_is_a_named_error_within_the_reach_timeout(tmp_path):
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    r = CliRunner().invoke(main, ["doctor", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                                  f"127.0.0.1:{port}", "--run-dir", str(tmp_path)])  # --reach-timeout 8 s
    took = time.monotonic() - t0
    assert r.exit_code == 2, r.output
    assert f"rendezvous endpoint 127.0.0.1:{port} not reachable from this node within 8 s" in r.output
    assert "connection refused" in r.output
    print(f"unreachable endpoint: named error after {took:.1f} s")
    assert took < 10, took


def test_node0_needs_the_endpoint_to_be_its_own(tmp_path):
    r = CliRunner().invoke(main, ["doctor", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                                  "192.0.2.1:29400", "--run-dir", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "node 0 cannot listen there: 192.0.2.1 is not an address of this machine" in r.output
    r = CliRunner().invoke(main, ["doctor", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head"])
    assert r.exit_code == 2 and "expected HOST:PORT" in r.output
