"""Two torchrun "nodes" on one host, each with its own run directory, against one node of the same ranks.

Each node is an ``embedscale train --nnodes 2 --node-rank I --rdzv-endpoint 127.0.0.1:PORT --nproc 2`` launcher
(torchrun's c10d rendezvous underneath), with a run directory and an output directory of its own: nothing of
node 0's directories is visible to node 1 but through the rendezvous. The reference is the same 4 ranks on one
node (``spawn_local``, the same config with ``dist.topology_hosts 2`` set by hand: the topology the launch gives
the two nodes), so rank r computes the same thing in both and every loss and every row must be equal bitwise.
Node 1 writes its ranks' checkpoint files into its own directory; with no shared store, the test copies them
beside node 0's (what a shared checkpoint store does) and resumes the copy on 1 node x 3 ranks, against the
reference's checkpoint resumed on 3 ranks.

The nodes address themselves as 127.0.0.1 and 127.0.0.2 (torchrun ``--local-addr`` through ``PET_LOCAL_ADDR``):
the rendezvous orders the nodes by address, so node 0 holds ranks 0-1 as a cluster's first host would.
Several launchers start here: about a minute on a loaded 2-core machine (``multinode`` marker).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import local_s3  # noqa: E402
from test_distributed_train import make_data  # noqa: E402

from embedscale.cli import _flag, _param, resolve_config  # noqa: E402
from embedscale.specs import RunConfig, from_dict, to_dict  # noqa: E402
from embedscale.train.checkpoint import latest_checkpoint, load_checkpoint, read_manifest  # noqa: E402
from embedscale.train.launch import free_port, spawn_local  # noqa: E402

pytestmark = pytest.mark.multinode

STEPS, MORE = 4, 7  # steps on 4 ranks (checkpoints at 2 and 4), then resumed on 3 ranks up to MORE
RUN_TIMEOUT_S = 600


def settings(data: Path, steps: int, hosts: int | None = None) -> dict[str, str]:
    """The run's config, dotted key -> value: the launchers' flags and the reference's config alike."""
    out = {"data.source": "shards", "data.path": str(data), "data.eval_fraction": "0.2", "model.embedding_dim": "4",
           "model.bottom_mlp": "8", "model.top_mlp": "8", "train.batch_size": "48", "train.max_steps": str(steps),
           "train.checkpoint_every": "2", "train.log_every": "1", "train.eval_every": "0", "train.lr_dense": "0.1",
           "train.lr_sparse": "0.3", "dist.plan": "row_wise", "dist.timeout_s": "120", "name": "mn"}
    if hosts is not None:
        out["dist.topology_hosts"] = str(hosts)
    return out


def flags(items: dict[str, str]) -> list[str]:
    return [a for k, v in items.items() for a in (_flag(k), v)]


def _rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def one_node(world: int, items: dict[str, str], run_dir: Path, out_dir: Path) -> None:
    cfg = resolve_config(None, [], {_param(k): v for k, v in {**items, "out_dir": str(out_dir)}.items()})
    spawn_local(_rank, world, to_dict(cfg), str(run_dir), timeout_s=RUN_TIMEOUT_S)


def start_nodes(tmp: Path, items: dict[str, str]) -> tuple[list[subprocess.Popen], list[Path]]:
    """2 launchers of 2 ranks each (nodes 0 and 1), each its own run and output directory."""
    port = free_port()
    procs, dirs = [], []
    for node in (0, 1):
        rd = tmp / f"node{node}" / "run"
        dirs.append(rd)
        cmd = [sys.executable, "-m", "embedscale", "train", "--nnodes", "2", "--node-rank", str(node),
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "300", "--nproc", "2", "--run-dir", str(rd),
               "--out-dir", str(tmp / f"node{node}" / "out"), "--no-progress", *flags(items)]
        env = {**os.environ, "PET_LOCAL_ADDR": f"127.0.0.{node + 1}", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs, dirs


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[str, str]]:
    """Every launcher's (stdout, stderr) once it ended; any still running after ``timeout_s`` is killed."""
    try:
        return [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def two_nodes(tmp: Path, items: dict[str, str]) -> list[Path]:
    """Train on 2 nodes x 2 ranks, each node its own run and output directory; returns the run directories."""
    procs, dirs = start_nodes(tmp, items)
    outs = finish(procs, RUN_TIMEOUT_S)
    for node, (p, (out, err)) in enumerate(zip(procs, outs)):
        (tmp / f"node{node}.err").write_text(err)
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{out}\n{err[-4000:]}"
    return dirs


def rows_and_losses(path: Path) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    ck = load_checkpoint(path)
    return ck["losses"], {n: t["weight"] for n, t in ck["tables"].items()}, ck["dense"]


def assert_same(a, b, what: str) -> None:
    la, ta, da = a
    lb, tb, db = b
    assert la == lb, f"{what}: losses differ: {la} vs {lb}"
    assert ta.keys() == tb.keys() and da.keys() == db.keys()
    for n in ta:
        assert torch.equal(ta[n], tb[n]), f"{what}: table {n} differs (max {float((ta[n] - tb[n]).abs().max())})"
    for n in da:
        assert torch.equal(da[n], db[n]), f"{what}: dense {n} differs"


def gather_checkpoints(node_dirs: list[Path], dest: Path) -> None:
    """What a shared checkpoint store holds: node 0's run directory with node 1's rank files of every step
    copied into the same step directories."""
    shutil.copytree(node_dirs[0], dest, symlinks=True)
    for step in (node_dirs[1] / "checkpoints").iterdir():
        for f in step.glob("rank-*.pt"):
            shutil.copy2(f, dest / "checkpoints" / step.name / f.name)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mn-data")
    make_data(d, n=600)
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """The 2 x 2 run and its one-node reference (trained once for the module)."""
    tmp = tmp_path_factory.mktemp("mn")
    ref = tmp / "ref"
    one_node(4, settings(data, STEPS, hosts=2), ref, tmp / "ref-out")
    nodes = two_nodes(tmp, settings(data, STEPS))
    return ref, nodes


@pytest.fixture(scope="module")
def ref_on_three(runs, data, tmp_path_factory):
    """The reference continued on 1 node x 3 ranks (what both resumes below must equal), trained once."""
    ref_copy = tmp_path_factory.mktemp("mn-ref3") / "ref"
    shutil.copytree(runs[0], ref_copy, symlinks=True)
    one_node(3, settings(data, MORE, hosts=1), ref_copy, ref_copy.parent / "out")
    return rows_and_losses(ref_copy)


def test_two_nodes_own_directories_equal_one_node_bitwise(runs):
    ref, (n0, n1) = runs
    # rank 0 ran on node 0 (its summary), node 1 got rank 0's plan through the rendezvous, not its directory
    assert (n0 / "summary.json").is_file() and not (n1 / "summary.json").exists()
    topo = json.loads((n0 / "plan" / "plan.json").read_text())["meta"]["topology"]
    assert (topo["num_hosts"], topo["ranks_per_host"]) == (2, 2)  # the launch's: 2 nodes of 2 ranks, not set by hand
    files = sorted(f.relative_to(n0) for f in (n0 / "plan").rglob("*") if f.is_file())
    assert files and files == sorted(f.relative_to(n1) for f in (n1 / "plan").rglob("*") if f.is_file())
    for rel in files:
        assert (n1 / rel).read_bytes() == (n0 / rel).read_bytes(), rel
        if rel.suffix != ".json":  # the same plan as the one-node reference's (plan.json: but its planning time)
            assert (ref / rel).read_bytes() == (n0 / rel).read_bytes(), rel
    # each node wrote its own ranks' files of each checkpoint; the manifest is on rank 0's node
    for step in ("step-00000002", "step-00000004"):
        assert sorted(p.name for p in (n0 / "checkpoints" / step).glob("rank-*.pt")) == ["rank-00000.pt",
                                                                                          "rank-00001.pt"]
        assert sorted(p.name for p in (n1 / "checkpoints" / step).glob("rank-*.pt")) == ["rank-00002.pt",
                                                                                          "rank-00003.pt"]
        assert not (n1 / "checkpoints" / step / "manifest.json").exists()
    gathered = n0.parent.parent / "gathered"
    gather_checkpoints([n0, n1], gathered)
    assert read_manifest(latest_checkpoint(gathered))["world_size"] == 4
    assert_same(rows_and_losses(gathered), rows_and_losses(ref), "2 nodes x 2 ranks vs 1 node x 4 ranks")
    losses = rows_and_losses(ref)[0]
    assert len(losses) == STEPS and np.isfinite(losses).all()


def test_resume_on_one_node_of_three_ranks(runs, ref_on_three, data, tmp_path):
    ref, (n0, n1) = runs
    gathered = tmp_path / "gathered"
    gather_checkpoints([n0, n1], gathered)
    one_node(3, settings(data, MORE, hosts=1), gathered, tmp_path / "out-a")  # the 2-node run's, re-sharded onto 3
    a = rows_and_losses(gathered)
    assert read_manifest(latest_checkpoint(gathered))["world_size"] == 3 and len(a[0]) == MORE
    assert a[0][:STEPS] == rows_and_losses(ref)[0]  # continued from step 4, not started again
    assert_same(a, ref_on_three, "resumed on 1 node x 3 ranks")


def rank_pids(launchers: list[subprocess.Popen]) -> dict[int, int]:
    """rank -> pid of the ranks these launchers started (by the launcher's pid in their environment)."""
    mine = {str(p.pid).encode() for p in launchers}
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(e.split(b"=", 1) for e in (d / "environ").read_bytes().split(b"\0") if b"=" in e)
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if env.get(b"EMBEDSCALE_LAUNCHER_PID") in mine and b"LOCAL_RANK" in env and b"torch.distributed.run" not in cmd \
                and b"embedscale" in cmd:
            out[int(env[b"RANK"])] = int(d.name)
    return out


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


def test_a_stopped_rank_is_named_by_every_other_within_the_timeout(data, tmp_path):
    """SIGSTOP rank 3 (node 1's second rank) mid-run: ranks 0-2 end within dist.timeout_s + 5 s of the stop,
    each with an error naming rank 3 and the collective it waited in, and nothing of either node is left."""
    timeout = 10
    items = {**settings(data, 10**6), "dist.timeout_s": str(timeout), "train.epochs": "10000",
             "train.early_stopping_patience": "0", "train.checkpoint_every": "0"}
    procs, (n0, _) = start_nodes(tmp_path, items)
    victim, ended, trees = None, {}, set()
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ((n0 / "metrics.csv").is_file() and len((n0 / "metrics.csv").read_text().splitlines()) > 3):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.2)
        ranks = rank_pids(procs)
        assert sorted(ranks) == [0, 1, 2, 3]
        trees = set(ranks.values())
        victim = ranks[3]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout + 60 and len(ended) < 3:
            for r in (0, 1, 2):
                if r not in ended and gone(ranks[r]):
                    ended[r] = time.monotonic() - t0
            time.sleep(0.05)
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if victim is not None and not gone(victim):
            os.kill(victim, signal.SIGKILL)
    err = "".join(e for _, e in outs)
    assert all(p.returncode != 0 for p in procs)
    for r in (0, 1, 2):
        assert r in ended, f"rank {r} did not end within {timeout + 60} s of the stop:\n{err[-3000:]}"
        assert re.search(rf"error: rank {r}: .*rank 3 stopped answering", err), err[-3000:]
    for line in err.splitlines():
        if "rank 3 stopped answering" in line:
            assert re.search(r"(this rank was in|failed) \w+ ?\(called from embedscale\.", line) or \
                   re.search(r"in (all_\w+|broadcast|barrier|recv|send) \(called from", line), line
    print(f"ranks 0-2 ended {ended} s after rank 3 was stopped (timeout {timeout} s)")
    assert max(ended.values()) <= timeout + 5, f"ranks ended {ended} s after the stop (timeout {timeout} s)"
    assert not [p for p in trees if not gone(p)], "a process of the run is left"


def test_a_node_without_rank0s_checkpoint_is_a_named_error(runs, data, tmp_path):
    """Both nodes' run directories resumed as they are: node 0's holds a complete checkpoint, node 1's only its
    ranks' files of it. Node 1 must not start afresh beside a resuming rank 0: every launcher ends with the
    error naming the checkpoint and node 1's directory, long before any timeout."""
    _, (n0, n1) = runs
    tmp = tmp_path / "again"
    for node, src in enumerate((n0, n1)):
        shutil.copytree(src, tmp / f"node{node}" / "run", symlinks=True)
    t0 = time.monotonic()
    procs, _ = start_nodes(tmp, {**settings(data, MORE), "dist.timeout_s": "600"})
    outs = finish(procs, RUN_TIMEOUT_S)
    took = time.monotonic() - t0
    err = "".join(e for _, e in outs)
    assert all(p.returncode != 0 for p in procs), err[-3000:]
    assert "node 1: rank 0 resumes from" in err and "checkpoints/step-00000004" in err, err[-3000:]
    assert f"this node's run directory {tmp / 'node1' / 'run'} holds no complete checkpoint" in err
    for r in (0, 1, 3):  # the others end with node 1's error, not a timeout
        assert re.search(rf"error: rank {r}: node 1 failed while preparing the run: ConfigError: node 1: rank 0 "
                         "resumes from", err), err[-3000:]
    print(f"node 1 without rank 0's checkpoint: both launchers ended after {took:.0f} s")
    assert took < 300  # the preparation's wait would have been an hour; the collective timeout 600 s


def test_two_nodes_checkpoint_to_s3_and_resume_on_one_node_of_three(runs, ref_on_three, data, tmp_path):
    """No shared disk at all: the 2 x 2 run checkpoints to a local S3-compatible server (moto's, on loopback), each
    node's ranks writing their own files there, and 1 node x 3 ranks resumes from it. The reference: the 4-rank
    one-node run's local checkpoint continued on 3 ranks."""
    pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    ref = runs[0]
    with local_s3("mn-ckpt"):  # every launcher and rank started below inherits its environment
        uri = "s3://mn-ckpt/run"
        two_nodes(tmp_path, {**settings(data, STEPS), "train.checkpoint_dir": uri})
        assert_same(rows_and_losses(uri), rows_and_losses(ref), "2 nodes x 2 ranks, checkpoints on S3")
        resumed = tmp_path / "resumed"
        shutil.copytree(tmp_path / "node0" / "run", resumed, symlinks=True)  # rank 0's run directory, not its rows
        one_node(3, {**settings(data, MORE, hosts=1), "train.checkpoint_dir": uri}, resumed, tmp_path / "out-a")
        a = rows_and_losses(uri)
        assert read_manifest(latest_checkpoint(uri))["world_size"] == 3 and len(a[0]) == MORE
        assert_same(a, ref_on_three, "resumed from S3 on 1 node x 3 ranks")
