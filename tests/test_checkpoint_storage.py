"""Checkpoints on an object store (``train.checkpoint_dir: s3://...``) against a local S3-compatible server
(moto's, on loopback), with the same run checkpointing to a local path as the reference.

- a 2-rank run checkpoints to S3, resumes from it on 3 ranks: losses and every table's rows bitwise equal to
  the same two runs with local checkpoints, and both equal to single-process training of all the steps;
- a re-sharding restore (2 -> 3 ranks) reads only what a rank needs: its rows (counted by the row reader,
  equal to the rows it stores now, computed here from the plan) and, through the storage layer, at most 1.2x
  a rank's share of the checkpoint;
- a step directory whose parts were written but not its manifest is never taken, and the next write removes it;
- a missing bucket, an unreachable endpoint or an unknown protocol is a named error within seconds;
- through a file system that counts the bytes it hands out (a wrapper of the local one, ``countfs://``): a
  re-sharding restore over 3 ranks reads at most 1.2x a rank's share on every rank, its rows and dense state
  bitwise equal to the tables materialised here, where every rank reading the rank files' dense state itself
  reads far more; ``fetch_ranges`` returns the bytes of a materialised blob, one request per group of nearby
  ranges (counted by the wrapper, groups found by brute force here); a rank that cannot read its part ends
  every rank with an error naming it, not a wait in the all_gather;
- a process whose S3 endpoint changed (one local server stopped, another started) reaches the new one.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import local_s3  # noqa: E402
from test_distributed_train import config  # noqa: E402

moto_server = pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
pytest.importorskip("s3fs", reason="s3fs is not installed")

from embedscale import storage, workflow  # noqa: E402
from embedscale.data.shards import ShardWriter, SparseFeatureInfo  # noqa: E402
from embedscale.errors import FormatError  # noqa: E402
from embedscale.specs import RunConfig, from_dict, to_dict  # noqa: E402
from embedscale.storage import ObjectPath, StorageError, location  # noqa: E402
from embedscale.train.checkpoint import (begin, is_checkpoint, latest_checkpoint, load_checkpoint,  # noqa: E402
                                         read_manifest, resolve_checkpoint, step_dir, write_manifest,
                                         write_rank_file)
from embedscale.train.launch import spawn_local  # noqa: E402
from fsspec.implementations.local import LocalFileSystem  # noqa: E402
import fsspec  # noqa: E402

ROWS = [4000, 50, 2500]  # two large tables: a rank's share of the checkpoint is mostly rows, as in the field
DIM = 8
K, M = 2, 2  # steps on 2 ranks, then on 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback; the AWS environment points every process (the ranks too) at it."""
    with local_s3("ckpt-tests") as fs:
        yield fs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("s3-data")
    rng = np.random.default_rng(3)
    n = 300
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    ids = [np.minimum((rng.random(n) ** 2 * r).astype(np.int64), r - 1) for r in ROWS]
    labels = (rng.random(n) < 1 / (1 + np.exp(-dense[:, 0]))).astype(np.int8)
    sp = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(ROWS)]
    with ShardWriter(d, ["I1", "I2", "I3"], sp, shard_rows=100) as w:
        w.write(labels, dense, {f"C{i + 1}": ids[i] for i in range(len(ROWS))})
    return d


def checkpoint_state(path):
    """Losses, the tables stacked in order and the dense state of a checkpoint or run directory (any home)."""
    ck = load_checkpoint(path)
    return ck["losses"], torch.cat([ck["tables"][f"t_C{i + 1}"]["weight"] for i in range(len(ROWS))]), ck["dense"]


def cfg_for(tmp: Path, data_dir: Path, steps: int, checkpoint_dir: str = "") -> RunConfig:
    cfg = config(tmp, data_dir, plan="row_wise")
    cfg.model.embedding_dim = DIM
    cfg.train.max_steps = steps
    cfg.train.checkpoint_every = 1
    cfg.train.eval_every = 0
    cfg.train.checkpoint_dir = checkpoint_dir
    return cfg


def _rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def _restore(rank, world, cfg_dict, run_dir, ckpt):
    """One rank of a fresh ``world``-rank run restoring ``ckpt``: the bytes it read through the storage layer,
    the row reader's count and the bytes of the rows it stores (its share, from the plan)."""
    from embedscale.train.distributed import DistributedRun
    from embedscale.train.distributed import join

    cfg = from_dict(RunConfig, cfg_dict)
    j = join(cfg, run_dir, False)
    run = DistributedRun(cfg, j.run_dir, j.rank, j.world, False, inputs=j.inputs)
    before = storage.BYTES_READ[0]
    run.restore(ckpt)
    read = storage.BYTES_READ[0] - before
    own = int(np.asarray(run.embedding.amap.storage_gids(run.rank)).size) * (DIM * 4 + 4)  # weight + momentum
    return [read, int(run.restore_bytes_read), own]


def _train(world, cfg, run_dir):
    spawn_local(_rank, world, to_dict(cfg), str(run_dir), timeout_s=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, s3):
    """The same run twice, K steps on 2 ranks then M more on 3: checkpoints on S3, and in the run directory."""
    tmp = tmp_path_factory.mktemp("s3-runs")
    out = {}
    for name, home in (("s3", "s3://ckpt-tests/runs/big"), ("local", "")):
        _train(2, cfg_for(tmp, data_dir, K, home), tmp / name)
        first = checkpoint_state(home or tmp / name)[0]
        _train(3, cfg_for(tmp, data_dir, K + M, home), tmp / name)
        out[name] = (home or tmp / name, first)
    return out


def test_a_run_resumed_from_s3_equals_the_same_run_with_local_checkpoints(runs, data_dir, tmp_path, s3):
    home, first = runs["s3"]
    assert not (runs["local"][0].parent / "s3" / "checkpoints").exists()  # nothing of it in the run directory
    worlds = {read_manifest(p)["step"]: read_manifest(p)["world_size"]
              for p in (location(home) / "checkpoints").iterdir() if is_checkpoint(p)}
    assert worlds == {s: (2 if s <= K else 3) for s in range(1, K + M + 1)}  # resumed from S3 at step K
    losses, w, dense = checkpoint_state(home)
    ref_losses, ref_w, ref_dense = checkpoint_state(runs["local"][0])
    assert losses[:K] == first and len(losses) == K + M
    assert losses == ref_losses  # bitwise: the same computation, only the checkpoints' home differs
    assert torch.equal(w, ref_w)
    assert dense.keys() == ref_dense.keys() and all(torch.equal(dense[k], ref_dense[k]) for k in dense)
    # and the uninterrupted single-process run of all K + M steps (independent reference)
    workflow.train(cfg_for(tmp_path, data_dir, K + M), tmp_path / "one", resume=False, progress=False)
    one_losses, one_w, one_dense = checkpoint_state(tmp_path / "one")
    np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(w, one_w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_resharding_restore_reads_only_a_rank_s_share(runs, data_dir, tmp_path, where):
    home = runs[where][0]
    ck = resolve_checkpoint(step_dir(home, K))  # written by 2 ranks
    assert read_manifest(ck)["world_size"] == 2
    m = read_manifest(ck)
    total = sum((ck / s).size() if isinstance(ck, ObjectPath) else os.path.getsize(ck / s) for s in m["shards"])
    out = spawn_local(_restore, 3, to_dict(cfg_for(tmp_path, data_dir, K + M)), str(tmp_path / "fresh"), str(ck),
                      timeout_s=600)
    for read, rows_read, own in out:
        assert rows_read == own  # the row reader took exactly the rows this rank stores, weight and momentum
        if where == "s3":  # every byte fetched: manifest, every file's dense state and run position, its rows
            assert read <= 1.2 * total / 3, (read, total)
        else:
            assert read == 0  # a local checkpoint is memory-mapped, nothing goes through the object store
    assert sum(o[2] for o in out) == sum(ROWS) * (DIM * 4 + 4)  # the shares cover every row once


def _tiny(d, rank: int) -> None:
    write_rank_file(d, rank, {"rank": rank, "tables": {"a": {"rows": torch.arange(4 * rank, 4 * rank + 4),
                                                              "weight": torch.full((4, 2), float(rank)),
                                                              "momentum": torch.zeros(4)}}})


def test_parts_without_a_manifest_are_never_a_checkpoint(s3):
    home = location("s3://ckpt-tests/half")
    done, half = step_dir(home, 1), step_dir(home, 2)
    for r in range(2):
        _tiny(done, r)
    write_manifest(done, 2, {"tables": ["a"], "table_rows": [8], "step": 1, "epoch": 0, "batch_in_epoch": 1,
                             "samples": 8})
    for r in range(2):  # a write killed before its manifest: every part is there, the manifest is not
        _tiny(half, r)
    assert (half / "rank-00001.pt").is_file() and not is_checkpoint(half)
    assert latest_checkpoint(home) == done
    assert resolve_checkpoint(home) == done
    with pytest.raises(FormatError, match="not a complete checkpoint"):
        read_manifest(half)
    ck = load_checkpoint(home)
    assert ck["step"] == 1 and torch.equal(ck["tables"]["a"]["weight"][4:], torch.ones(4, 2))
    begin(step_dir(home, 3))  # the next write (rank 0) removes the leftover, keeps the complete one
    assert not half.exists() and is_checkpoint(done)


def test_a_bad_location_is_a_named_error_within_seconds(s3, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="s3://no-such-bucket/run.*bucket 'no-such-bucket'"):
        latest_checkpoint("s3://no-such-bucket/run")
    with pytest.raises(StorageError, match="unknown storage protocol 'nosuchfs'"):
        latest_checkpoint("nosuchfs://bucket/run")
    assert time.monotonic() - t0 < 30
    # the command line: one line naming the URI before any data is prepared, no traceback, no run directory
    from click.testing import CliRunner

    from embedscale.cli import main

    res = CliRunner().invoke(main, ["train", "--checkpoint-dir", "s3://no-such-bucket/run", "--run-dir",
                                    str(tmp_path / "run"), "--no-progress"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.output.startswith("error: s3://no-such-bucket/run: the bucket 'no-such-bucket'"), res.output
    assert not (tmp_path / "run").exists()
    # an endpoint nobody answers on (a closed port on loopback): named, after a short connect timeout
    os.environ["AWS_ENDPOINT_URL"], saved = f"http://127.0.0.1:{_free_port()}", os.environ["AWS_ENDPOINT_URL"]
    try:
        fs = storage._filesystem("s3", "s3://x")
        dead_fs = type(fs)(**storage._S3_DEFAULTS, skip_instance_cache=True)
        dead_fs.retries = storage._S3_RETRIES
        dead = ObjectPath(dead_fs, "ckpt-tests/run", "s3")
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="s3://ckpt-tests/run"):
            dead.check()
        assert time.monotonic() - t0 < 60
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved


class CountingFS(LocalFileSystem):
    """The local file system under ``countfs://``, counting the bytes and requests of every read it serves."""

    protocol = "countfs"
    counted = [0, 0]  # bytes, requests (this process)

    def __init__(self, **kwargs):
        super().__init__(auto_mkdir=True, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        CountingFS.counted[0] += len(data)
        CountingFS.counted[1] += 1
        return data


fsspec.register_implementation("countfs", CountingFS, clobber=True)

WRITERS, CDIM = 4, 8
CROWS = [3000, 800, 1600]


def _materialised() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return ([torch.randn(n, CDIM, generator=g) for n in CROWS], [torch.rand(n, generator=g) for n in CROWS],
            torch.randn(300, 300, generator=g))  # a dense state of ~30% of the checkpoint


def _write_counted_checkpoint(d) -> None:
    weights, moms, dense = _materialised()
    for r in range(WRITERS):
        tables = {}
        for t, n in enumerate(CROWS):
            lo, hi = n * r // WRITERS, n * (r + 1) // WRITERS
            tables[f"t{t}"] = {"rows": torch.arange(lo, hi), "weight": weights[t][lo:hi].clone(),
                               "momentum": moms[t][lo:hi].clone()}
        write_rank_file(d, r, {"rank": r, "tables": tables, **({"dense": {"w": dense}} if r == 0 else {})})
    write_manifest(d, WRITERS, {"tables": [f"t{t}" for t in range(len(CROWS))], "table_rows": CROWS, "step": 1,
                                "epoch": 0, "batch_in_epoch": 1, "samples": 1})


def _counted_restore(rank, world, where):
    """This rank's restore read over the group (spread) and by itself: ``[[bytes, rows, dense], ...]``."""
    import torch.distributed as dist

    from embedscale.train.checkpoint import merged
    from embedscale.train.ckpt_rows import RowReader

    d = location(where)
    out = []
    for group in (dist.group.WORLD, None):
        CountingFS.counted[:] = [0, 0]
        m = read_manifest(d)
        wanted = {f"t{t}": np.arange(n * rank // world, n * (rank + 1) // world) for t, n in enumerate(CROWS)}
        shards, rows = RowReader(d, m).restore(wanted, group)
        out.append([CountingFS.counted[0], {t: list(v) for t, v in rows.items()}, merged(shards, "dense")["w"]])
    return out


def test_a_spread_restore_reads_a_rank_s_share_counted_by_the_file_system(tmp_path):
    d = location(f"countfs://{tmp_path}/checkpoints/step-00000001")
    _write_counted_checkpoint(d)
    total = sum(os.path.getsize(tmp_path / "checkpoints" / "step-00000001" / f"rank-{r:05d}.pt")
                for r in range(WRITERS))
    weights, moms, dense = _materialised()
    world = 3
    both = spawn_local(_counted_restore, world, str(d), timeout_s=600)
    for spread in (True, False):
        out = [b[0 if spread else 1] for b in both]
        for q, (read, rows, got_dense) in enumerate(out):
            assert torch.equal(got_dense, dense)
            for t, n in enumerate(CROWS):
                lo, hi = n * q // world, n * (q + 1) // world
                assert torch.equal(rows[f"t{t}"][0], weights[t][lo:hi])
                assert torch.equal(rows[f"t{t}"][1], moms[t][lo:hi])
        worst = max(o[0] for o in out) / (total / world)
        if spread:
            assert worst <= 1.2, worst
        else:  # every rank reading the dense state itself: well over the bar (the test can tell them apart)
            assert worst > 1.4, worst


def test_fetch_ranges_coalesces_nearby_ranges_into_one_request_each(tmp_path):
    blob = np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    (tmp_path / "blob").write_bytes(blob)
    p = location(f"countfs://{tmp_path}/blob")
    rng = np.random.default_rng(2)
    starts = sorted(rng.integers(0, 190_000, 60).tolist())
    ranges = [(s, s + int(rng.integers(1, 5000))) for s in starts]
    ranges += [(10, 10), (ranges[0][0], ranges[0][1])]  # an empty range, a repeated one
    order = rng.permutation(len(ranges))
    ranges = [ranges[i] for i in order]
    CountingFS.counted[:] = [0, 0]
    got = storage.fetch_ranges([(p, s, e) for s, e in ranges], max_gap=1000)
    assert got == [blob[s:e] for s, e in ranges]
    groups, end = 0, None  # brute force: walk the non-empty ranges by start, a new group past end + gap
    for s, e in sorted((s, e) for s, e in ranges if e > s):
        if end is None or s > end + 1000:
            groups += 1
            end = e
        else:
            end = max(end, e)
    assert CountingFS.counted[1] == groups < len(ranges)


def _failing_restore(rank, world, where):
    """Rank 1 asks for a row the tables do not have: ``[error type, message]`` of every rank."""
    import torch.distributed as dist

    from embedscale.train.ckpt_rows import RowReader

    d = location(where)
    m = read_manifest(d)
    wanted = {"t0": np.arange(CROWS[0], CROWS[0] + 1) if rank == 1 else np.arange(10)}
    try:
        RowReader(d, m).restore(wanted, dist.group.WORLD)
    except Exception as e:  # noqa: BLE001 - what each rank ends with is the result
        return [type(e).__name__, str(e)]
    return ["", ""]


def test_a_rank_that_cannot_read_its_part_ends_every_rank_with_a_named_error(tmp_path):
    d = location(f"countfs://{tmp_path}/checkpoints/step-00000001")
    _write_counted_checkpoint(d)
    t0 = time.monotonic()
    out = spawn_local(_failing_restore, 2, str(d), timeout_s=600)
    assert out[1][0] == "FormatError" and f"row {CROWS[0]} outside" in out[1][1], out
    assert out[0][0] == "EmbedscaleError" and "rank 1 could not read its part" in out[0][1], out
    assert time.monotonic() - t0 < 300  # no rank waited for the group's timeout


def test_a_process_whose_endpoint_changed_reaches_the_new_one(tmp_path):
    """The AWS environment of the moment picks the file system: a process that used one server, stopped it and
    started another (another endpoint) writes to and reads from the new one. A fresh process: the first file
    system it makes must be the one bound to the stopped server."""
    import subprocess

    script = tmp_path / "two_servers.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from s3_server import local_s3\n"
        "from embedscale.storage import location\n"
        "for bucket in ('first-server', 'second-server'):\n"
        "    with local_s3(bucket):\n"
        "        p = location(f's3://{bucket}/probe')\n"
        "        p.write_text(bucket)\n"
        "        print(p.read_text())\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["first-server", "second-server"]
