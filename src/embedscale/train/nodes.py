"""The ranks of a run across machines: the topology the launch gives, and rank 0's prepared run handed to
every node without a shared file system.

Topology. torchrun tells every rank where it stands: ``GROUP_WORLD_SIZE`` nodes (machines), ``LOCAL_WORLD_SIZE``
ranks on each, ``GROUP_RANK`` its node. Ranks ``h * ranks_per_host ...`` are node ``h`` (torchrun numbers the
ranks node by node; our launcher's nodes by ``--node-rank``, ``launch.follow_node_rank``). A launch over several nodes is the run's topology (:func:`launch_topology`): the planner
costs links by it (OPER 3.2's matrix L: fast within a host, slow across), PGAS shares memory within a host and
reaches the other hosts by the collective, DMT forms its towers from its hosts; ``dist.topology_hosts`` set by
hand only simulates hosts on one machine.

Preparation. Rank 0 prepares the run (data, profile, plan) into its run directory; the other ranks need the
plan and the run's record, and may run on machines that cannot see that directory (Kubernetes pods, cloud
VMs). Rank 0 puts the files the ranks read (``plan/``, ``run-plan.json``, ``config.yaml``, a DMT run's
towers) into the launch's key-value store (torchrun's rendezvous store, reachable before the process group
exists), under this attempt's token. On every other node its first rank (``LOCAL_RANK`` 0) waits for them,
writes them into the node's own run directory unless that directory is rank 0's (a shared file system: rank
0's nonce of this launch is there), prepares the node's data (its own cache: each machine converts or
generates its copy, and the tables must match rank 0's), then tells its node's other ranks. A failure on any
node is put in the store too: every rank waiting ends with an error naming the node and its cause within a
poll (``POLL_S``), instead of waiting for a timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from embedscale.errors import ConfigError, EmbedscaleError
from embedscale.io import atomic_open, atomic_write_text
from embedscale.train.checkpoint import latest_checkpoint

POLL_S = 0.2  # how often a waiting rank looks at the store
SAY_EVERY_S = 60.0  # a waiting node's first rank says what it waits for this often
HANDOFF = ".handoff"  # rank 0's nonce of this launch, in its run directory
STORE_PART = 4 << 20  # bytes of a handed file per store value (torchrun's libuv store refuses more than 8 MiB)
HANDED_FILES = ("run-plan.json", "config.yaml", "towers.json", "checkpoint_towers.json")  # beside plan/


_NODE_DIR = {"shared": True}  # whether this rank's run directory is rank 0's (set by the run's join)


def set_node_dir_shared(shared: bool) -> None:
    _NODE_DIR["shared"] = bool(shared)


def writes_node_dir(rank: int, env=os.environ) -> bool:
    """Whether this rank, not rank 0, makes its node's directories of a checkpoint: the first rank of a node
    whose run directory is its own (no shared file system with rank 0). The node's directory then holds its
    ranks' files of each checkpoint (``checkpoints/step-N/``, no manifest: rank 0's node has it)."""
    return rank != 0 and not _NODE_DIR["shared"] and node_of(env)[1] == 0


class NodeFailed(EmbedscaleError):
    """Another node (or rank 0) failed while the run was being prepared; the message names it and the cause."""


def launch_topology(world: int, env=os.environ) -> tuple[int, int]:
    """``(hosts, ranks_per_host)`` of this launch from torchrun's environment (one host outside torchrun). Nodes
    with different numbers of ranks are a ``ConfigError``: the hosts of a topology are equal."""
    hosts = int(env.get("GROUP_WORLD_SIZE", "1") or 1)
    per = int(env.get("LOCAL_WORLD_SIZE", str(world)) or world)
    if hosts * per != world:
        raise ConfigError(f"{world} ranks over {hosts} nodes of {per} local ranks: every node must run the same "
                          "number of ranks (--nproc / torchrun --nproc-per-node)")
    return hosts, per


def apply_launch_topology(cfg, world: int, env=os.environ) -> int:
    """A launch over several nodes sets ``dist.topology_hosts`` to its node count (returned). A config asking
    for another count of hosts (other than 1, the default) is a ``ConfigError`` naming both."""
    hosts, _ = launch_topology(world, env)
    if hosts > 1:
        asked = cfg.dist.topology_hosts
        if asked not in (1, hosts):
            raise ConfigError(f"dist.topology_hosts {asked}: this launch runs on {hosts} nodes (torchrun "
                              f"GROUP_WORLD_SIZE); the topology comes from the launch: drop dist.topology_hosts")
        cfg.dist.topology_hosts = hosts
    return cfg.dist.topology_hosts


def node_of(env=os.environ) -> tuple[int, int, int]:
    """``(node, local rank, nodes)`` of this rank (``GROUP_RANK``, ``LOCAL_RANK``, ``GROUP_WORLD_SIZE``)."""
    return (int(env.get("GROUP_RANK", "0") or 0), int(env.get("LOCAL_RANK", "0") or 0),
            int(env.get("GROUP_WORLD_SIZE", "1") or 1))


class Handoff:
    """Rank 0's prepared run, through the launch's store under one attempt's ``token``
    (``launch.rendezvous_store``); the keys of another attempt are never read."""

    def __init__(self, store, token: str):
        self.store = dist.PrefixStore(f"embedscale/prepared/{token}", store)
        self.token = token

    # -- rank 0 ------------------------------------------------------------------------------------------
    def publish(self, run_dir: Path, tables) -> None:
        """Rank 0, once the run is prepared: the files every rank reads, the tables, then ``ready``."""
        files = handed_files(run_dir)
        nonce = uuid.uuid4().hex  # this launch's, in rank 0's directory: a node that reads it there shares it
        atomic_write_text(run_dir / HANDOFF, nonce)
        for rel in files:  # in parts: torchrun's store takes values of at most 8 MiB (a full-size plan's rows: 135 MB)
            data = (run_dir / rel).read_bytes()
            parts = max(1, -(-len(data) // STORE_PART))
            self.store.set(f"file/{rel}/parts", str(parts))
            for i in range(parts):
                self.store.set(f"file/{rel}/{i}", data[i * STORE_PART:(i + 1) * STORE_PART])
        self.store.set("ready", json.dumps({"files": files, "tables": table_sizes(tables),
                                            "checkpoint": latest_name(run_dir), "run_dir": str(run_dir),
                                            "nonce": nonce}))
        self.store.set("node/0/ready", "rank 0")

    def fail(self, where: str, err: BaseException) -> None:
        """Tell every waiting rank that ``where`` (``rank 0``, ``node 1``) failed and why."""
        key = "failed" if where == "rank 0" else f"{where.replace(' ', '/')}/failed"
        try:
            self.store.set(key, f"{type(err).__name__}: {str(err).strip()}")
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0's node; the error stands anyway
            pass

    # -- the other ranks ---------------------------------------------------------------------------------
    def wait(self, key: str, watch: list[tuple[str, str]], what: str, timeout_s: float,
             say: Callable[[str], None] | None = None) -> bytes:
        """The value of ``key`` once set; a :class:`NodeFailed` as soon as a ``watch`` key (``(key, who)``) is
        set, naming ``who``; an ``EmbedscaleError`` after ``timeout_s`` saying what was awaited."""
        t0 = last = time.monotonic()
        while True:
            for k, who in watch:
                if self.store.check([k]):
                    me = f"rank {os.environ.get('RANK', '0')}: "
                    raise NodeFailed(f"{me}{who} failed while preparing the run: {self.store.get(k).decode()}")
            if self.store.check([key]):
                return self.store.get(key)
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise EmbedscaleError(f"{what} did not happen within {timeout_s:.0f} s")
            if say is not None and now - last >= SAY_EVERY_S:
                last = now
                say(f"still waiting ({now - t0:.0f} s) for {what}")
            time.sleep(POLL_S)

    def receive(self, run_dir: Path, timeout_s: float, make_inputs: Callable[[], object], env=os.environ):
        """Every rank but 0: the run prepared by rank 0, in this node's run directory; returns
        ``(make_inputs(), shared)`` (``shared``: the node's run directory is rank 0's)."""
        node, local, _ = node_of(env)
        rank = int(env.get("RANK", "0"))
        watch = [("failed", "rank 0")]
        if local != 0:  # the node's first rank writes what the node needs; the others wait for it
            mine = f"node/{node}"
            shared = self.wait(f"{mine}/ready", watch + [(f"{mine}/failed", f"node {node}")],
                               f"node {node}'s first rank to prepare the node", timeout_s) == b"shared"
            return make_inputs(), shared
        try:
            say = (lambda m: print(f"rank {rank} (node {node}): {m}", file=sys.stderr, flush=True))
            meta = json.loads(self.wait("ready", watch, "rank 0 to prepare the run", timeout_s, say))
            shared = _read(run_dir / HANDOFF) == meta["nonce"]
            if not shared:
                check_same_checkpoint(meta, run_dir, node)
                self._write_files(run_dir, meta["files"])
            inputs = make_inputs()
            check_same_tables(meta["tables"], table_sizes(inputs.tables), node)
            self.store.set(f"node/{node}/ready", "shared" if shared else "own")
            return inputs, shared
        except NodeFailed:
            self.fail(f"node {node}", NodeFailed("rank 0 failed"))
            raise
        except BaseException as e:
            self.fail(f"node {node}", e)
            raise

    def _write_files(self, run_dir: Path, files: list[str]) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        for rel in files:
            dst = run_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(dst, "wb") as f:
                for i in range(int(self.store.get(f"file/{rel}/parts"))):
                    f.write(self.store.get(f"file/{rel}/{i}"))

    def wait_all_nodes(self, nodes: int, timeout_s: float) -> None:
        """Every rank, its part prepared: wait until every node is, ending at once with the error of one that
        failed (before any rank joins the process group and would wait for the group's timeout instead)."""
        watch = [("failed", "rank 0")] + [(f"node/{h}/failed", f"node {h}") for h in range(nodes)]
        for h in range(nodes):
            self.wait(f"node/{h}/ready", watch, f"node {h} to prepare its part", timeout_s)


def handed_files(run_dir: Path) -> list[str]:
    """The files of rank 0's run directory every rank reads (relative paths, sorted): the plan directory's
    and :data:`HANDED_FILES` present."""
    out = [p.relative_to(run_dir).as_posix() for p in (run_dir / "plan").rglob("*")
           if p.is_file() and not p.name.startswith(".")] if (run_dir / "plan").is_dir() else []
    out += [n for n in HANDED_FILES if (run_dir / n).is_file()]
    return sorted(out)


def latest_name(run_dir: Path) -> str | None:
    """The latest complete checkpoint of ``run_dir`` (the one a resumed run restores), relative to it."""
    ck = latest_checkpoint(run_dir)
    return ck.relative_to(run_dir).as_posix() if ck is not None else None


def check_same_checkpoint(rank0: dict, run_dir: Path, node: int) -> None:
    """A node whose own run directory does not resume from rank 0's checkpoint (none there: no shared file
    system) is a ``ConfigError`` naming both: its ranks would restore another step than rank 0's."""
    theirs, mine = rank0.get("checkpoint"), latest_name(run_dir)
    if theirs != mine:
        have = f"holds {mine}" if mine else "holds no complete checkpoint"
        raise ConfigError(f"node {node}: rank 0 resumes from {rank0.get('run_dir')}/{theirs}; this node's run "
                          f"directory {run_dir} {have}. Without a shared file system every node needs that "
                          f"checkpoint: put rank 0's {theirs} (its manifest and every node's rank files) into each "
                          "node's run directory, or give the nodes a shared checkpoint directory"
                          if theirs else
                          f"node {node}: rank 0 starts {rank0.get('run_dir')} afresh; this node's run directory "
                          f"{run_dir} {have}: start it in an empty run directory")


def table_sizes(tables) -> list[list]:
    return [[t.name, int(t.num_rows)] for t in tables]


def check_same_tables(rank0: list, mine: list, node: int) -> None:
    """A node whose data made other tables than rank 0's (another file, another vocabulary) is a
    ``ConfigError`` naming the first table that differs."""
    a, b = {n: r for n, r in rank0}, {n: r for n, r in mine}
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            raise ConfigError(f"node {node}: its data makes table {name!r} with {b.get(name)} rows, rank 0's "
                              f"{a.get(name)}: every node must read the same dataset (data.path, data.seed)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
