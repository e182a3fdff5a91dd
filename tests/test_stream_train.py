"""Training on a stream of shards (``data.source: stream``) and progressive validation.

References, each independent of the stream code under test:
- the same rows written as a finished dataset and trained by the file path (``ShardLoader``): a stream run
  must take the same batches, so its losses and tables equal that run's;
- an uninterrupted stream run for a run stopped mid-shard and resumed (the shards before the resume
  position deleted first: it must not read them again);
- one process for two gloo ranks;
- a hand-written training loop that records every batch's logits before its update, and brute-force
  pairwise AUC / float64 logloss and NE over the window, for the progressive columns of ``metrics.csv``.
"""

from __future__ import annotations

import csv
import json
import math
import re
import threading
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from embedscale import assemble, workflow
from embedscale.cli import main
from embedscale.data.loader import ShardLoader
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.data.stream import END, StreamLoader, StreamWriter, shard_name
from embedscale.errors import ConfigError, FormatError
from embedscale.io import read_json
from embedscale.specs import RunConfig, from_dict, to_dict
from embedscale.train.checkpoint import latest_checkpoint, load_checkpoint, read_manifest
from embedscale.train.launch import spawn_local
from embedscale.train.metrics import MetricsLog

ROWS = [30, 9, 120, 5]
SHARDS, SHARD_ROWS, BATCH = 5, 130, 50  # 650 rows: 13 global batches, 8 of them across a shard boundary
STEPS = -(-SHARDS * SHARD_ROWS // BATCH)
SPARSE = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(ROWS)]
DENSE = ["I1", "I2", "I3"]


def shard_columns(k: int):
    rng = np.random.default_rng(100 + k)
    n = SHARD_ROWS
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    ids = [np.minimum((rng.random(n) ** 3 * r).astype(np.int64), r - 1) for r in ROWS]
    logit = 1.5 * dense[:, 0] + (ids[0] % 3 == 0) - (ids[2] < 10)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    return labels, dense, {f"C{i + 1}": ids[i] for i in range(len(ROWS))}


def write_stream(d, shards=SHARDS, end=True, delay_s=0.0):
    w = StreamWriter(d, DENSE, SPARSE)
    for k in range(shards):
        if delay_s:
            time.sleep(delay_s)
        w.write_shard(*shard_columns(k))
    if end:
        w.end()
    return w


def write_dataset(d):
    """The same rows as a finished dataset (the file path's reference)."""
    with ShardWriter(d, DENSE, SPARSE, shard_rows=SHARD_ROWS) as w:
        for k in range(SHARDS):
            w.write(*shard_columns(k))


def config(tmp_path, source, path, *, steps=0, window=120, checkpoint_every=0, plan="row_wise",
           idle_s=0.0) -> RunConfig:
    return from_dict(RunConfig, {
        "name": "s", "out_dir": str(tmp_path / "runs"),
        "data": {"source": source, "path": str(path), "eval_fraction": 0.0, "stream_poll_s": 0.05,
                 "stream_idle_s": idle_s},
        "model": {"embedding_dim": 4, "bottom_mlp": [8], "top_mlp": [8]},
        "train": {"batch_size": BATCH, "max_steps": steps, "lr_dense": 0.1, "lr_sparse": 0.3, "log_every": 1,
                  "lr_warmup_steps": 0, "dropout": 0.0, "progressive_window": window, "prefetch": 2,
                  "checkpoint_every": checkpoint_every, "eval_every": 0},
        "dist": {"plan": plan, "timeout_s": 300},
    })


def state(run_dir):
    ck = load_checkpoint(run_dir)
    return ck["losses"], torch.cat([ck["tables"][f"t_C{i + 1}"]["weight"] for i in range(len(ROWS))]), ck["dense"]


def rows(run_dir):
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def same_state(a, b, atol):
    np.testing.assert_allclose(a[0], b[0], rtol=0, atol=atol)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=atol)
    for k, v in b[2].items():
        torch.testing.assert_close(a[2][k], v, rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def files_reference(tmp_path_factory):
    """The same rows as a finished dataset, trained through the file path (ShardLoader)."""
    tmp = tmp_path_factory.mktemp("files")
    write_dataset(tmp / "data")
    workflow.train(config(tmp, "shards", tmp / "data"), tmp / "run", resume=False, progress=False)
    return state(tmp / "run")


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream") / "in"
    write_stream(d)
    return d


def test_run_trains_while_a_writer_adds_shards_and_ends_on_the_marker(tmp_path, files_reference):
    d = tmp_path / "in"
    StreamWriter(d, DENSE, SPARSE)  # the schema first: the run starts before any shard exists
    def produce():
        try:
            write_stream(d, delay_s=0.2)
        finally:  # a failing writer must not leave the run waiting for ever (the shard count then fails it)
            (d / END).touch()

    writer = threading.Thread(target=produce)
    writer.start()
    try:
        s = workflow.train(config(tmp_path, "stream", d), tmp_path / "run", resume=False, progress=False)
    finally:
        writer.join()
    assert s["steps"] == STEPS and s["samples"] == SHARDS * SHARD_ROWS
    assert s["stream"]["end"] == "marker" and s["stream"]["shards_read"] == SHARDS
    assert s["stream"]["position"] == {"shard": SHARDS, "row": 0}
    # the stream's batches are the file path's batches: same losses, tables and dense state
    same_state(state(tmp_path / "run"), files_reference, atol=1e-6)
    assert read_manifest(latest_checkpoint(tmp_path / "run"))["stream"] == {"shard": SHARDS, "row": 0}
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0
    assert all(r["pv_auc"] for r in rows(tmp_path / "run"))


def test_resume_mid_shard_continues_at_the_exact_shard_and_row(tmp_path, stream_dir):
    ref = tmp_path / "ref"
    workflow.train(config(tmp_path, "stream", stream_dir), ref, resume=False, progress=False)
    # a copy of the stream whose first shard is deleted after the stop: the resume must not need it
    d = tmp_path / "in"
    write_stream(d)
    run = tmp_path / "run"
    k = 3  # 150 rows: shard 1, row 20
    workflow.train(config(tmp_path, "stream", d, steps=k), run, resume=False, progress=False)
    assert read_manifest(latest_checkpoint(run))["stream"] == {"shard": 1, "row": 150 - SHARD_ROWS}
    (d / shard_name(0)).unlink()
    s = workflow.train(config(tmp_path, "stream", d), run, resume=True, progress=False)
    assert s["steps"] == STEPS and s["stream"]["shards_read"] == SHARDS - 1
    same_state(state(run), state(ref), atol=1e-6)
    assert [int(r["step"]) for r in rows(run)] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([float(r["train_loss"]) for r in rows(run)], state(ref)[0], rtol=0, atol=1e-6)


def _rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def test_two_ranks_on_a_stream_equal_one_process(tmp_path, stream_dir):
    one = tmp_path / "one"
    workflow.train(config(tmp_path, "stream", stream_dir), one, resume=False, progress=False)
    # the same shards without an END marker: the 2 ranks end when idle, rank 0 deciding for both
    d = tmp_path / "in"
    write_stream(d, end=False)
    two = tmp_path / "two"
    spawn_local(_rank, 2, to_dict(config(tmp_path, "stream", d, idle_s=1.0)), str(two), timeout_s=600)
    assert load_checkpoint(two)["manifest"]["world_size"] == 2
    same_state(state(two), state(one), atol=1e-5)
    assert read_json(two / "summary.json", "summary")["stream"]["end"] == "idle"
    # progressive validation gathers both ranks' slices: the same window figures as one process
    a, b = rows(two), rows(one)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for col in ("pv_auc", "pv_logloss", "pv_ne", "pv_samples"):
        np.testing.assert_allclose([float(r[col]) for r in a], [float(r[col]) for r in b], rtol=0, atol=1e-5,
                                   err_msg=col)


def brute_auc(y: np.ndarray, z: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties half: every pair."""
    pos, neg = z[y == 1], z[y == 0]
    d = pos[:, None] - neg[None, :]
    return float(((d > 0).sum() + 0.5 * (d == 0).sum()) / d.size)


def test_progressive_figures_equal_brute_force_over_the_window_of_pre_update_logits(tmp_path, stream_dir):
    window = 100  # the fewest latest batches holding >= 100 samples: 2 batches of 50 (exactly: a boundary case)
    run = tmp_path / "run"
    workflow.train(config(tmp_path, "stream", stream_dir, window=window), run, resume=False, progress=False)
    logged = rows(run)
    # by hand: the same model, batches and updates; every batch's logits taken before its update
    cfg = config(tmp_path, "stream", stream_dir)
    write_dataset(tmp_path / "data")
    model, opt = assemble.build(cfg, assemble.tables_for(cfg, assemble.prepare_data(cfg).manifest), 3,
                                torch.device("cpu"), validate=False)
    zs, ys = [], []
    for batch in ShardLoader(tmp_path / "data", BATCH, prefetch=0):
        model.train()
        logits = model(batch.dense, batch.sparse)
        zs.append(logits.detach().double().numpy().copy())
        ys.append(batch.labels.double().numpy())
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert len(logged) == len(zs) == STEPS
    for step, r in enumerate(logged, start=1):
        k = next(k for k in range(1, step + 1) if k * BATCH >= window or k == step)  # batches in the window
        z, y = np.concatenate(zs[step - k:step]), np.concatenate(ys[step - k:step])
        p = 1 / (1 + np.exp(-z))
        ll = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
        ctr = y.mean()
        ne = ll / float(-(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr)))
        assert float(r["pv_samples"]) == len(z), step
        assert float(r["pv_auc"]) == pytest.approx(brute_auc(y, z), abs=1e-9), step
        assert float(r["pv_logloss"]) == pytest.approx(ll, abs=1e-6), step
        assert float(r["pv_ne"]) == pytest.approx(ne, abs=1e-6), step


def test_a_half_written_shard_is_never_read(tmp_path):
    d = tmp_path / "in"
    w = write_stream(d, shards=1, end=False)
    whole = (d / shard_name(0)).read_bytes()
    (d / f".{shard_name(1)}.tmp").write_bytes(whole[: len(whole) // 2])  # a writer still at work
    loader = StreamLoader(d, BATCH, idle_s=0.3, poll_s=0.05, prefetch=0)
    got = sum(b.batch_size for b in loader)
    assert got == SHARD_ROWS and loader.end_reason == "idle" and loader.shards_read == 1
    # renamed into place, it is read from where the last pass stopped; the END marker ends the stream
    w.write_shard(*shard_columns(1))
    w.end()
    loader.seek({"shard": 1, "row": 0})
    assert sum(b.batch_size for b in loader) == SHARD_ROWS and loader.end_reason == "marker"
    # a truncated file under a shard's final name (the contract broken) is an error naming it, never skipped
    (d / END).unlink()
    (d / shard_name(2)).write_bytes(whole[: len(whole) // 2])
    loader.seek({"shard": 2, "row": 0})
    with pytest.raises(FormatError, match=shard_name(2)):
        list(loader)


def test_end_marker_count_and_rank_rules(tmp_path):
    d = tmp_path / "in"
    write_stream(d, shards=2, end=False)
    (d / END).write_text('{"shards": 3}\n')
    with pytest.raises(FormatError, match="3 shards but .*shard-00002.arrow is missing"):
        list(StreamLoader(d, BATCH, prefetch=0))
    with pytest.raises(ConfigError, match="follow file"):
        StreamLoader(d, BATCH, rank=0, world_size=2, idle_s=5)
    # ranks slice every global batch as the file loader does
    (d / END).write_text("")
    for rank in (0, 1):
        got = [b.labels for b in StreamLoader(d, BATCH, rank=rank, world_size=2, prefetch=0)]
        whole = [b.labels for b in StreamLoader(d, BATCH, prefetch=0)]
        assert [len(g) for g in got] == [len(x) // 2 + (rank and len(x) % 2) for x in whole]
        for g, x in zip(got, whole):
            lo = (len(x) * rank) // 2
            torch.testing.assert_close(g, x[lo:lo + len(g)])


@pytest.mark.parametrize("make, message", [
    (lambda d: None, "stream directory .* does not exist"),
    (lambda d: d.mkdir(), "is not a stream directory: no stream.json"),
    (lambda d: (d.mkdir(), (d / "stream.json").write_text('{"format": "other"}')), "not an embedscale stream"),
])
def test_bad_stream_directory_is_a_named_error_exit_2(tmp_path, make, message):
    d = tmp_path / "nope"
    make(d)
    r = CliRunner().invoke(main, ["train", "--data-source", "stream", "--data-path", str(d), "--run-dir",
                                  str(tmp_path / "run"), "--no-progress"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and "Traceback" not in r.output
    assert str(d) in r.output
    assert re.search(message, r.output), r.output


def test_old_metrics_files_still_read(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,epoch,samples,train_loss,eval_logloss,eval_auc,samples_per_s,"
                                          "seconds,eval_ne,eval_calibration\n3,0,30,0.5,,,10.0,1.0,,\n")
    (r,) = MetricsLog(tmp_path).read()
    assert r.step == 3 and r.train_loss == 0.5 and math.isnan(r.pv_auc) and math.isnan(r.pv_samples)


def test_other_ranks_read_what_rank_0_admitted_not_what_they_see(tmp_path):
    """With an idle end rank 0 decides: a rank that sees 3 shards reads only the one rank 0 admitted before it
    ended the stream (rank 0's clock ran out before shard 1 arrived), and ignores records of other attempts."""
    d = tmp_path / "in"
    write_stream(d, shards=3, end=False)
    follow = tmp_path / "follow.json"
    leader = StreamLoader(d, BATCH, rank=0, world_size=2, idle_s=0.2, poll_s=0.05, prefetch=0,
                          follow=(follow, "attempt-1"))
    rank1 = StreamLoader(d, BATCH, rank=1, world_size=2, idle_s=0.2, poll_s=0.05, prefetch=0,
                         follow=(follow, "attempt-1"))
    # the leader's record as it would be had shard 1 arrived just after rank 0 gave up on it
    follow.write_text(json.dumps({"token": "attempt-1", "start": {"shard": 0, "row": 0}, "admitted": 1,
                                  "ended": 1, "reason": "idle"}))
    got = [b.global_size for b in rank1]
    assert sum(got) == SHARD_ROWS and rank1.end_reason == "idle" and rank1.shards_read == 1
    # a record of another attempt (an earlier one that ended at once) is not this one's: rank 1 waits for the
    # leader's own record and both take every shard
    follow.write_text(json.dumps({"token": "attempt-0", "start": {"shard": 0, "row": 0}, "admitted": 0,
                                  "ended": 0, "reason": "idle"}))
    follower: list[int] = []
    t = threading.Thread(target=lambda: follower.extend(b.global_size for b in rank1))
    t.start()
    time.sleep(0.3)  # (rank 1 meanwhile looks at the stale record; the outcome does not depend on this)
    lead = sum(b.global_size for b in leader)
    t.join(timeout=120)
    assert lead == 3 * SHARD_ROWS and leader.end_reason == "idle"
    rec = json.loads(follow.read_text())
    assert (rec["admitted"], rec["ended"], rec["reason"]) == (3, 3, "idle")
    assert sum(follower) == lead and rank1.shards_read == 3 and rank1.end_reason == "idle"


def test_weighted_progressive_window_equals_brute_force_and_weight_0_is_nan():
    """Sample weights (a weighted dataset) weigh the window's figures; a window of weight 0 has none (NaN)."""
    from embedscale.train.loop import progressive_figures
    from embedscale.train.metrics import ProgressiveWindow

    class One:  # a world of one (no gather)
        world = 1

    rng = np.random.default_rng(3)
    pv = ProgressiveWindow(70)
    batches = []
    for size in (40, 40, 40, 25):  # the fewest latest batches holding >= 70: the last 3 (105; the last 2 hold 65)
        z, y, w = rng.normal(size=size), (rng.random(size) < 0.4).astype(float), rng.random(size) * 2
        pv.add(torch.from_numpy(z), torch.from_numpy(y), torch.from_numpy(w), size)
        batches.append((z, y, w))
    z, y, w = (np.concatenate([b[i] for b in batches[-3:]]) for i in range(3))
    pos, neg = y == 1, y == 0
    d = z[pos][:, None] - z[neg][None, :]
    ww = w[pos][:, None] * w[neg][None, :]
    auc = float(((d > 0) * ww).sum() + 0.5 * ((d == 0) * ww).sum()) / float(ww.sum())
    p = 1 / (1 + np.exp(-z))
    ll = float(np.sum(w * -(y * np.log(p) + (1 - y) * np.log(1 - p))) / w.sum())
    f = progressive_figures(One(), pv)
    assert f["samples"] == len(z) == 105
    assert f["auc"] == pytest.approx(auc, abs=1e-9) and f["logloss"] == pytest.approx(ll, abs=1e-9)
    zero = ProgressiveWindow(10)
    zero.add(torch.zeros(10), torch.ones(10), torch.zeros(10), 10)
    g = progressive_figures(One(), zero)
    assert math.isnan(g["auc"]) and math.isnan(g["logloss"]) and g["samples"] == 10
