"""Restores that read only what a rank needs, counted by the file system (not by the code's own counters).

A checkpoint is materialised here (tables, row-wise state, a dense state) and written by 4 ranks; a delta over
it replaces a known set of rows. Restoring through ``checkpoint.read_rows`` (what the sharded and DMT restores
call; one process: ``checkpoint.read_shards``):

- a delta on 3 ranks: each rank's rows bitwise equal to the materialised tables with the delta's rows laid
  over them, and the bytes the file system served it at most 1.2x its share of the two checkpoints' files
  (their bytes times the part of all rows the rank restores), for a local directory (``countfs://``, a
  counting wrapper of the local file system) and a local S3 server (moto's, bytes counted in s3fs's own ranged
  read); each rank reading every rank file whole (the restores before) reads far more (the test tells the two
  apart);
- DMT's row ranges (a tower group's contiguous rows) on 2 ranks: the same bound and rows;
- one process (the single-process trainer, a 1-rank sharded or DMT run: it holds every row, its share is the
  whole checkpoint) reads every rank file whole, each byte exactly once (a delta: with its base's);
- end to end, a 2-rank DMT run resumed from a delta continues as the uninterrupted run, bitwise.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_checkpoint_storage import CountingFS  # noqa: E402  (registers countfs://)

from embedscale.storage import location  # noqa: E402
from embedscale.train.checkpoint import (assemble_table, base_ref, delta_entry, read_manifest,  # noqa: E402
                                         read_rows, read_shards, step_dir, write_manifest, write_rank_file)
from embedscale.train.launch import spawn_local  # noqa: E402

WRITERS, DIM = 4, 8
ROWS = [3000, 800, 1600]
TOUCHED = 0.1  # the share of each table's rows a delta replaces


def materialised():
    """Base tables, row-wise state and dense state; the delta's rows per table and their new values."""
    g = torch.Generator().manual_seed(7)
    w = [torch.randn(n, DIM, generator=g) for n in ROWS]
    m = [torch.rand(n, generator=g) for n in ROWS]
    dense = torch.randn(300, 300, generator=g)  # ~30% of the checkpoint, as in the field
    rng = np.random.default_rng(8)
    touched = [np.sort(rng.choice(n, int(n * TOUCHED), replace=False)) for n in ROWS]
    dw = [torch.randn(t.size, DIM, generator=g) for t in touched]
    dm = [torch.rand(t.size, generator=g) for t in touched]
    return w, m, dense, touched, dw, dm


def at_delta():
    """The tables at the delta's step: the base's with the delta's rows laid over them (independent reference)."""
    w, m, _, touched, dw, dm = materialised()
    w, m = [x.clone() for x in w], [x.clone() for x in m]
    for t, rows in enumerate(touched):
        w[t][torch.from_numpy(rows)], m[t][torch.from_numpy(rows)] = dw[t], dm[t]
    return w, m


FIELDS = {"tables": [f"t{t}" for t in range(len(ROWS))], "table_rows": ROWS, "epoch": 0, "batch_in_epoch": 1,
          "samples": 1}


def write_checkpoints(home: str) -> tuple:
    """A full checkpoint (step 1) and a delta over it (step 2) under ``home``: their directories."""
    w, m, dense, touched, dw, dm = materialised()
    full, delta = location(step_dir(home, 1)), location(step_dir(home, 2))
    for r in range(WRITERS):
        tables = {}
        for t, n in enumerate(ROWS):
            lo, hi = n * r // WRITERS, n * (r + 1) // WRITERS
            tables[f"t{t}"] = {"rows": torch.arange(lo, hi), "weight": w[t][lo:hi].clone(),
                               "momentum": m[t][lo:hi].clone()}
        write_rank_file(full, r, {"rank": r, "tables": tables, **({"dense": {"w": dense}} if r == 0 else {})})
    write_manifest(full, WRITERS, {**FIELDS, "step": 1})
    for r in range(WRITERS):  # each writer its touched rows (its own range), the dense state on rank 0
        tables = {}
        for t, n in enumerate(ROWS):
            lo, hi = n * r // WRITERS, n * (r + 1) // WRITERS
            k = np.flatnonzero((touched[t] >= lo) & (touched[t] < hi))
            tables[f"t{t}"] = delta_entry(touched[t][k], dw[t][k], dm[t][k], n)
        write_rank_file(delta, r, {"rank": r, "tables": tables, **({"dense": {"w": dense + 1}} if r == 0 else {})})
    write_manifest(delta, WRITERS, {**FIELDS, "step": 2}, delta=base_ref(full))
    return full, delta


def file_bytes(d) -> int:
    """The bytes of a checkpoint's rank files, from the local directory under it."""
    local = Path(str(d).split("://", 1)[-1])
    return sum(os.path.getsize(local / s) for s in read_manifest(d)["shards"])


S3_SERVED = [0]


def count_s3() -> None:
    """Count the bytes s3fs's own reads return (whole objects and ranges) in ``S3_SERVED`` (file systems made
    after this call)."""
    import s3fs

    if getattr(s3fs.S3FileSystem, "_counted", False):
        return
    inner = s3fs.S3FileSystem._cat_file

    async def counted(self, path, start=None, end=None, **kw):
        data = await inner(self, path, start=start, end=end, **kw)
        S3_SERVED[0] += len(data)
        return data

    s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._counted = counted, True


def served() -> int:
    return CountingFS.counted[0] + S3_SERVED[0]


def reset() -> None:
    CountingFS.counted[:] = [0, 0]
    S3_SERVED[0] = 0


def share(kind: str, rank: int, world: int) -> dict:
    """The rows a rank restores: ``flat``, a row-wise split of every table; ``dmt``, whole tables per rank
    (tower groups of contiguous row ranges: table t on rank t % world) with one table split."""
    if kind == "flat":
        return {f"t{t}": np.arange(n * rank // world, n * (rank + 1) // world) for t, n in enumerate(ROWS)}
    out = {f"t{t}": np.arange(n) for t, n in enumerate(ROWS[1:], 1) if t % world == rank}
    out["t0"] = np.arange(ROWS[0] * rank // world, ROWS[0] * (rank + 1) // world)
    return out


def _restore(rank, world, where, kind):
    """This rank's delta restore over the group and without one (every file whole, as before):
    ``[[bytes served, rows, dense], ...]``."""
    import torch.distributed as dist

    from embedscale.train.checkpoint import merged

    count_s3()
    d = location(where)
    out = []
    for group in (dist.group.WORLD, None):
        reset()
        m = read_manifest(d)
        got = read_rows(d, m, share(kind, rank, world), group)
        if got is None:  # no group: every rank file whole, as one process reads them (the restores before)
            assert group is None
            shards = read_shards(d, m)
            rows = {t: tuple(x[torch.from_numpy(r)] for x in assemble_table(shards, t, ROWS[int(t[1:])], d))
                    for t, r in share(kind, rank, world).items()}
        else:
            shards, rows, _ = got
        out.append([served(), {t: list(v) for t, v in rows.items()}, merged(shards, "dense")["w"]])
    return out


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    from s3_server import local_s3

    count_s3()  # before the file system is made: its sync reads bind the async ones when it is
    with local_s3("restore-bytes") as fs:
        yield fs


def homes(where: str, tmp_path: Path, request) -> tuple[str, Path]:
    """The checkpoint home (``countfs://`` over a local directory, or S3) and the local mirror whose file sizes
    are the reference (S3: the same checkpoints also written locally)."""
    if where == "local":
        return f"countfs://{tmp_path}/checkpoints", tmp_path / "checkpoints"
    request.getfixturevalue("s3")
    write_checkpoints(str(tmp_path / "mirror"))
    return f"s3://restore-bytes/{tmp_path.name}", tmp_path / "mirror"


@pytest.mark.parametrize("kind,world", [("flat", 3), ("dmt", 2)])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_delta_restore_reads_a_rank_s_share_counted_by_the_file_system(tmp_path, request, where, kind, world):
    home, mirror = homes(where, tmp_path, request)
    _, delta = write_checkpoints(home)
    total = file_bytes(step_dir(mirror, 1)) + file_bytes(step_dir(mirror, 2))  # a delta needs both
    w, m = at_delta()
    both = spawn_local(_restore, world, str(delta), kind, timeout_s=600)
    for spread in (True, False):
        out = [b[0 if spread else 1] for b in both]
        for q, (read, rows, dense) in enumerate(out):
            assert torch.equal(dense, materialised()[2] + 1)  # the delta's dense state, not the base's
            for t, want in share(kind, q, world).items():
                i = int(t[1:])
                assert torch.equal(rows[t][0], w[i][torch.from_numpy(want)]), (q, t)
                assert torch.equal(rows[t][1], m[i][torch.from_numpy(want)]), (q, t)
        shares = [total * sum(r.size for r in share(kind, q, world).values()) / sum(ROWS) for q in range(world)]
        worst = max(o[0] / sh for o, sh in zip(out, shares))  # a rank's share: its rows' part of the files
        if spread:
            assert worst <= 1.2, worst
        else:  # every rank reading every rank file whole: well over the bar
            assert worst > 1.4, worst


def _one(where):
    """A restore by one process (the single-process trainer, a 1-rank sharded or DMT run): the bytes served and
    ``{table: (weight, momentum)}``."""
    count_s3()
    d = location(where)
    m = read_manifest(d)
    reset()
    assert read_rows(d, m, {f"t{t}": np.arange(n) for t, n in enumerate(ROWS)}) is None  # no group: every file
    shards = read_shards(d, m)
    got = {f"t{t}": assemble_table(shards, f"t{t}", n, d) for t, n in enumerate(ROWS)}
    return served(), got


@pytest.mark.parametrize("where", ["local", "s3"])
def test_one_process_reads_every_byte_once(tmp_path, request, where):
    """One process holds every row: its share is the whole checkpoint. It reads every rank file whole: each byte
    exactly once (a delta: its files and its base's, and the base's manifest read to check it, twice)."""
    home, mirror = homes(where, tmp_path, request)
    full, delta = write_checkpoints(home)
    manifest = os.path.getsize(step_dir(mirror, 1) / "manifest.json")
    base_total, delta_total = file_bytes(step_dir(mirror, 1)), file_bytes(step_dir(mirror, 2))
    read, rows = _one(str(full))
    assert read == base_total
    w, m, *_ = materialised()
    assert all(torch.equal(rows[f"t{t}"][0], w[t]) and torch.equal(rows[f"t{t}"][1], m[t]) for t in range(3))
    read, rows = _one(str(delta))
    assert read == delta_total + base_total + 2 * manifest
    w, m = at_delta()
    assert all(torch.equal(rows[f"t{t}"][0], w[t]) and torch.equal(rows[f"t{t}"][1], m[t]) for t in range(3))


def test_a_dmt_run_resumed_from_a_delta_continues_exactly(tmp_path):
    """DMT towers on 2 ranks, a checkpoint every step (full at step 1, deltas at 2 and 3): resumed from the delta
    at step 3 (each rank reading its row ranges only), step 4 equals the uninterrupted run's, bitwise."""
    from test_delta_checkpoint import assert_same_state
    from test_distributed_train import _rank, make_data
    from test_dmt_workflow import config as dmt_config

    from embedscale.specs import to_dict
    from embedscale.train.checkpoint import load_checkpoint

    data = tmp_path / "data"
    data.mkdir()
    make_data(data)
    cfg = dmt_config(tmp_path, data, train__max_steps=4, train__checkpoint_every=1, train__eval_every=0,
                     train__checkpoint_full_every=4, dist__timeout_s=300)
    spawn_local(_rank, 2, to_dict(cfg), str(tmp_path / "whole"), None, timeout_s=600)
    delta = step_dir(tmp_path / "whole", 3)
    assert read_manifest(delta)["delta"]["base_step"] == 1 and read_manifest(delta)["kind"] == "dmt"
    spawn_local(_rank, 2, to_dict(cfg), str(tmp_path / "resumed"), str(delta), timeout_s=600)
    got, want = load_checkpoint(tmp_path / "resumed"), load_checkpoint(step_dir(tmp_path / "whole", 4))
    assert got["step"] == 4 and got["losses"] == want["losses"]
    assert_same_state(got, want)
