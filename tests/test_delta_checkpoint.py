"""Delta checkpoints (``train.checkpoint_full_every``).

The reference for "the run's state at step s" is the full checkpoint that the same run, trained with every
checkpoint full (``checkpoint_full_every: 0``), writes at step s: training does not depend on how it is
checkpointed, so base + delta must equal it bitwise (tables, row-wise optimizer state, dense state, dense
optimizer, losses, position), for one process and for 2 gloo ranks. Restoring a delta onto another world
size (2 -> 1), resuming from a delta (1 and 2 ranks) against the uninterrupted run, the delta's size against
a hand count of what it must hold, the named errors of a missing / damaged / rewritten base, ``embedscale
evaluate`` on a delta, and the best checkpoint's retention keeping a base.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import ROWS, config, distributed, make_data  # noqa: E402
from test_dmt_workflow import config as dmt_config  # noqa: E402

from embedscale import workflow  # noqa: E402
from embedscale.cli import main  # noqa: E402
from embedscale.data.batch import JaggedFeatures  # noqa: E402
from embedscale.data.loader import ShardLoader  # noqa: E402
from embedscale.data.shards import ShardWriter, SparseFeatureInfo  # noqa: E402
from embedscale.embedding.local import LocalEmbeddingBags  # noqa: E402
from embedscale.errors import FormatError  # noqa: E402
from embedscale.specs import RunConfig, TableSpec, from_dict, to_dict  # noqa: E402
from embedscale.train.checkpoint import (DELTA_VERSION, delta_entry, entry_rows, load_checkpoint,  # noqa: E402
                                         read_manifest, read_shard, step_dir)
from embedscale.train.launch import spawn_local  # noqa: E402

STEPS, FULL_EVERY = 6, 4
BASES = {1: None, 2: 1, 3: 1, 4: None, 5: 4, 6: 4}  # checkpoint every step, a full one every 4 steps


def cfg_for(tmp: Path, data_dir: Path, full_every: int, steps: int = STEPS):
    cfg = config(tmp, data_dir, plan="oper")  # N ranks: OPER's plan (rows split and the hot ones replicated)
    cfg.train.max_steps = steps
    cfg.train.checkpoint_every = 1
    cfg.train.eval_every = 2
    cfg.train.checkpoint_full_every = full_every
    # the logit's Platt fit at each best evaluation is of the eval logits' reduction order (1 rank against 2), not
    # of the checkpoint: compared apart (tests/test_calibration.py)
    cfg.train.calibrate = False
    return cfg


def ckpt(run: Path, step: int) -> Path:
    return step_dir(run, step)


def _equal(a, b, where: str, atol: float = 0.0) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}", atol)
    elif isinstance(a, torch.Tensor):
        if atol:
            assert torch.allclose(a.double(), b.double(), rtol=0, atol=atol), where
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]", atol)
    else:
        assert a == b or (atol and abs(a - b) <= atol), f"{where}: {a} != {b}"


def assert_same_state(a: dict, b: dict, atol: float = 0.0) -> None:
    """Two ``load_checkpoint`` results hold the same run state (bitwise unless ``atol``)."""
    for key in ("step", "epoch", "batch_in_epoch", "samples"):
        assert a[key] == b[key], key
    for key in ("tables", "dense", "optimizer", "losses", "host", "tt"):
        _equal(a[key], b[key], key, atol)


def changed_rows(a: dict, b: dict) -> dict[str, set[int]]:
    """Rows whose weight or row-wise state differs between two whole-state loads."""
    out = {}
    for name, t in a["tables"].items():
        u = b["tables"][name]
        diff = (t["weight"] != u["weight"]).any(1) | (t["momentum"] != u["momentum"])
        out[name] = set(np.flatnonzero(diff.numpy()).tolist())
    return out


def stored_rows(d: Path) -> dict[str, set[int]]:
    """The rows a checkpoint's own rank files hold, per table (a delta's: its touched rows)."""
    out: dict[str, set[int]] = {}
    for name in read_manifest(d)["shards"]:
        for table, e in read_shard(d / name)["tables"].items():
            out.setdefault(table, set()).update(entry_rows(e).tolist())
    return out


def check_schedule_and_state(delta_run: Path, full_run: Path) -> None:
    for s, base in BASES.items():
        m = read_manifest(ckpt(delta_run, s))
        assert (m.get("delta") or {}).get("base_step") == base, (s, m.get("delta"))
        assert "delta" not in read_manifest(ckpt(full_run, s))
        got, want = load_checkpoint(ckpt(delta_run, s)), load_checkpoint(ckpt(full_run, s))
        assert_same_state(got, want)
        if base is None:
            continue
        assert m["version"] == DELTA_VERSION
        kept = stored_rows(ckpt(delta_run, s))
        changed = changed_rows(got, load_checkpoint(ckpt(delta_run, base)))
        for t, n in zip(m["tables"], m["table_rows"]):
            assert changed[t] <= kept.get(t, set()), t  # every row that moved since the base is in the delta
        assert sum(len(v) for v in kept.values()) < sum(m["table_rows"])  # and it is a delta: not every row


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("delta-data")
    make_data(d)
    return d


@pytest.fixture(scope="module")
def one(tmp_path_factory, data_dir):
    """One process, 6 steps checkpointed every step: with deltas (full every 4) and all full."""
    tmp = tmp_path_factory.mktemp("delta-one")
    for fe in (FULL_EVERY, 0):
        workflow.train(cfg_for(tmp, data_dir, fe), tmp / f"full{fe}", resume=False, progress=False)
    return {"delta": tmp / f"full{FULL_EVERY}", "full": tmp / "full0", "tmp": tmp}


@pytest.fixture(scope="module")
def two(tmp_path_factory, data_dir):
    """The same on 2 gloo ranks (the default OPER plan: rows split and replicated)."""
    tmp = tmp_path_factory.mktemp("delta-two")
    for fe in (FULL_EVERY, 0):
        distributed(cfg_for(tmp, data_dir, fe), tmp / f"full{fe}", 2)
    return {"delta": tmp / f"full{FULL_EVERY}", "full": tmp / "full0", "tmp": tmp}


# -- the touched-row hook -------------------------------------------------------------------------------
def test_touched_rows_are_the_rows_looked_up_since_tracking():
    ebc = LocalEmbeddingBags([TableSpec("a", 50, 4), TableSpec("b", 30, 8, features=["x", "y"])],
                             optimizer="rowwise_adagrad", lr=0.1, seed=0)
    batches = [torch.tensor([[1, 2, 3], [7, 2, 2]]), torch.tensor([[4, 29, 0], [1, 5, 5]])]
    for i, ids in enumerate(batches):
        if i == 1:
            ebc.track_touched()  # rows of batch 0 are forgotten
        ebc(JaggedFeatures.from_dense(["a", "x", "y"], ids)).sum().backward()
    ids = batches[1]
    assert set(np.flatnonzero(ebc.table_touched("a").numpy())) == set(ids[:, 0].tolist())
    assert set(np.flatnonzero(ebc.table_touched("b").numpy())) == set(ids[:, 1:].reshape(-1).tolist())


@pytest.mark.parametrize("rows,num_rows", [([5, 1, 9], 1000), (list(range(0, 400, 3))[::-1], 500), ([], 10)])
def test_delta_entry_round_trip(rows, num_rows):
    w = torch.arange(len(rows) * 2, dtype=torch.float32).view(-1, 2)
    m = torch.arange(len(rows), dtype=torch.float32)
    e = delta_entry(np.array(rows, dtype=np.int64), w, m, num_rows)
    bitmap = "rows_bitmap" in e
    assert bitmap == (-(-num_rows // 8) < 4 * len(rows))  # the smaller encoding
    back = entry_rows(e)
    order = {r: i for i, r in enumerate(rows)}
    assert sorted(back.tolist()) == sorted(rows)
    for j, r in enumerate(back.tolist()):  # each row keeps its own values
        assert torch.equal(e["weight"][j], w[order[r]]) and float(e["momentum"][j]) == float(m[order[r]])


# -- base + delta == the run's state -----------------------------------------------------------------
def test_one_process_base_plus_delta_is_the_runs_state(one):
    check_schedule_and_state(one["delta"], one["full"])


def test_two_ranks_base_plus_delta_is_the_runs_state(two):
    check_schedule_and_state(two["delta"], two["full"])
    assert read_manifest(ckpt(two["delta"], 5))["world_size"] == 2


def test_two_rank_delta_restores_onto_one_process(tmp_path, data_dir, two):
    """A 2-rank delta (step 5, base step 4) restored by a single-process run: its first checkpoint (full, world 1)
    holds exactly the 2-rank run's state; it then trains on like the 2-rank run (1e-5: another reduction order)."""
    run = tmp_path / "run"
    for s in (4, 5):
        shutil.copytree(ckpt(two["delta"], s), ckpt(run, s))
    workflow.train(cfg_for(tmp_path, data_dir, FULL_EVERY, steps=5), run, resume=True, progress=False)
    m = read_manifest(ckpt(run, 5))
    assert m["world_size"] == 1 and "delta" not in m
    assert_same_state(load_checkpoint(ckpt(run, 5)), load_checkpoint(ckpt(two["full"], 5)))
    workflow.train(cfg_for(tmp_path, data_dir, FULL_EVERY, steps=6), run, resume=True, progress=False)
    assert_same_state(load_checkpoint(ckpt(run, 6)), load_checkpoint(ckpt(two["full"], 6)), atol=1e-5)


# -- resuming from a delta continues as the uninterrupted run --------------------------------------
def test_one_process_resume_from_delta_continues_exactly(tmp_path, data_dir, one):
    run = tmp_path / "run"
    shutil.copytree(one["delta"], run, symlinks=True)
    for s in range(4, STEPS + 1):
        shutil.rmtree(ckpt(run, s))
    (run / "checkpoints" / "best").unlink(missing_ok=True)
    assert "delta" in read_manifest(ckpt(run, 3))  # the latest is a delta (base step 1)
    workflow.train(cfg_for(tmp_path, data_dir, FULL_EVERY), run, resume=True, progress=False)
    got, want = load_checkpoint(run), load_checkpoint(one["full"])
    assert got["step"] == STEPS
    assert np.allclose(got["losses"], want["losses"], rtol=0, atol=1e-6)
    assert_same_state(got, want, atol=1e-6)
    # a resumed process starts its deltas on a full checkpoint of its own
    assert [(read_manifest(ckpt(run, s)).get("delta") or {}).get("base_step") for s in (4, 5, 6)] == [None, 4, 4]


def test_two_ranks_resume_from_delta_continues_exactly(tmp_path, data_dir, two):
    run = tmp_path / "run"
    distributed(cfg_for(tmp_path, data_dir, FULL_EVERY), run, 2, resume_from=str(ckpt(two["delta"], 3)))
    got, want = load_checkpoint(run), load_checkpoint(two["full"])
    assert got["step"] == STEPS
    assert np.allclose(got["losses"], want["losses"], rtol=0, atol=1e-6)
    assert_same_state(got, want, atol=1e-6)


# -- what a delta holds, and its errors ------------------------------------------------------------
BIG = [20000, 5000, 50000, 300]


def test_delta_bytes_are_the_touched_rows_the_dense_part_and_the_position(tmp_path):
    """A delta at step 3 (base step 1) holds the rows touched in steps 2-3, the dense state and optimizer, and
    the run position (RNG state, losses): its bytes at most 1.1x those, counted by hand from the restored
    state; far less than the full checkpoint."""
    rng = np.random.default_rng(1)
    n, dim = 2000, 32
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    ids = {f"C{i + 1}": np.minimum((rng.random(n) ** 2 * r).astype(np.int64), r - 1) for i, r in enumerate(BIG)}
    labels = (rng.random(n) < 1 / (1 + np.exp(-dense[:, 0]))).astype(np.int8)
    with ShardWriter(tmp_path / "data", ["I1", "I2", "I3"], [SparseFeatureInfo(f, r) for f, r in
                                                             zip(ids, BIG)], shard_rows=500) as w:
        w.write(labels, dense, ids)
    cfg = cfg_for(tmp_path, tmp_path / "data", 100, steps=3)
    cfg.model.embedding_dim = dim
    cfg.train.batch_size = 256
    cfg.train.eval_every = 0
    workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    delta, base = ckpt(tmp_path / "run", 3), ckpt(tmp_path / "run", 1)
    assert read_manifest(delta)["delta"]["base_step"] == 1
    # the rows steps 2 and 3 looked up, from the data (brute force): exactly the rows the delta holds
    data = workflow.prepare_data(cfg)
    loader = ShardLoader(data.train.directory, cfg.train.batch_size, start=data.train.start, stop=data.train.stop)
    loader.set_epoch(0, 0)
    looked_up: dict[str, set[int]] = {}
    for i, batch in zip(range(3), loader):
        for f, (values, _) in batch.sparse.to_dict().items():
            if i >= 1:
                looked_up.setdefault(f"t_{f}", set()).update(values.tolist())
    assert stored_rows(delta) == looked_up
    got = load_checkpoint(delta)
    assert all(changed_rows(got, load_checkpoint(base))[t] <= rows for t, rows in looked_up.items())
    touched = sum(len(v) for v in looked_up.values())

    def nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(nbytes(v) for v in x.values()) if isinstance(x, dict) else 0

    r0 = read_shard(delta / "rank-00000.pt")
    expected = (touched * (dim * 4 + 4) + nbytes(got["dense"]) + nbytes(got["optimizer"])
                + nbytes(r0["rng_torch"]) + 8 * len(got["losses"]))
    size = sum(p.stat().st_size for p in delta.iterdir())
    full = sum(p.stat().st_size for p in base.iterdir())
    print(json.dumps({"delta_bytes": size, "expected_bytes": expected, "ratio": size / expected,
                      "full_bytes": full, "touched_rows": touched, "rows": sum(BIG)}))
    assert size <= 1.1 * expected, (size, expected)
    assert size < 0.2 * full


def test_delta_without_its_base_is_a_named_error(tmp_path, one):
    run = tmp_path / "run"
    shutil.copytree(one["delta"], run, symlinks=True)
    delta, base = ckpt(run, 3), ckpt(run, 1)
    shutil.copytree(base, tmp_path / "base-copy")
    shutil.rmtree(base)
    with pytest.raises(FormatError, match=r"step-00000003.*base .*step-00000001 is missing"):
        load_checkpoint(delta)
    shutil.copytree(tmp_path / "base-copy", base)
    load_checkpoint(delta)  # whole again
    (base / "rank-00000.pt").write_bytes((base / "rank-00000.pt").read_bytes()[:1000])  # truncated
    with pytest.raises(FormatError, match=r"step-00000003.*base is damaged.*rank-00000.pt"):
        load_checkpoint(delta)
    shutil.rmtree(base)
    shutil.copytree(tmp_path / "base-copy", base)
    m = json.loads((base / "manifest.json").read_text())
    m["id"] = "another"  # the base rewritten by another attempt
    (base / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match=r"base .*step-00000001 was rewritten"):
        load_checkpoint(delta)
    r = CliRunner().invoke(main, ["evaluate", str(delta)])
    assert r.exit_code == 2 and "error:" in r.output and "rewritten" in r.output and "Traceback" not in r.output


def test_evaluate_a_delta_checkpoint(one):
    figs = []
    for run in (one["delta"], one["full"]):
        r = CliRunner().invoke(main, ["evaluate", str(ckpt(run, 3)), "--json"])
        assert r.exit_code == 0, r.output
        figs.append(json.loads(r.output[r.output.index("{"):]))
    assert "delta" in read_manifest(ckpt(one["delta"], 3))
    for k in ("logloss", "auc", "ne", "samples"):
        assert figs[0][k] == figs[1][k], k


def test_best_checkpoint_retention_keeps_the_base_of_a_delta(tmp_path, data_dir):
    """Checkpoints only at improvements and the end, one full base for all: the previous best's directory is
    removed at every improvement, except the base the later deltas need."""
    cfg = cfg_for(tmp_path, data_dir, 100, steps=STEPS)
    cfg.train.checkpoint_every = 0
    cfg.train.eval_every = 1
    cfg.train.early_stopping_patience = 0
    workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    found = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    bests = [read_manifest(p)["early_stopping"]["best_step"] for p in found]
    assert max(bests) > 1  # a later evaluation improved on step 1's: step 1 was a removal candidate
    assert ckpt(tmp_path / "run", 1) in found
    for p in found:
        load_checkpoint(p)
    load_checkpoint(tmp_path / "run" / "checkpoints" / "best")
    assert any("delta" in read_manifest(p) for p in found)
    assert sum(ROWS) == sum(read_manifest(found[0])["table_rows"])


def _rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def test_dmt_two_ranks_base_plus_delta_is_the_runs_state(tmp_path, data_dir):
    """DMT towers (2 ranks, a tower per host): the same bitwise equality, through ``DMTRun.save``."""
    for fe in (FULL_EVERY, 0):
        cfg = dmt_config(tmp_path, data_dir, train__checkpoint_every=1, train__eval_every=2,
                         train__checkpoint_full_every=fe, dist__timeout_s=300)
        spawn_local(_rank, 2, to_dict(cfg), str(tmp_path / f"full{fe}"), timeout_s=600)
    assert read_manifest(ckpt(tmp_path / "full0", 1))["kind"] == "dmt"
    check_schedule_and_state(tmp_path / f"full{FULL_EVERY}", tmp_path / "full0")
