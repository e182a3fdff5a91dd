"""In one process a run's ids are checked once, by the ``ShardLoader``: the embedding behind
it is built with ``validate=False`` (``assemble.build``, ``EmbeddingEnv.validate``). A bad id still fails with
the loader's message naming the feature."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import ROWS, config, make_data  # noqa: E402

from embedscale import assemble, workflow  # noqa: E402
from embedscale.data.loader import ShardLoader  # noqa: E402
from embedscale.data.shards import ShardWriter, SparseFeatureInfo  # noqa: E402
from embedscale.embedding import local  # noqa: E402
from embedscale.errors import InputError  # noqa: E402
from embedscale.pipeline import server  # noqa: E402
from embedscale.specs import TableConfig  # noqa: E402


@pytest.fixture
def counts(monkeypatch):
    """Calls of the loader's check, and of the embedding's id check (``bag_plan`` with ``validate``)."""
    n = {"loader": 0, "embedding": 0, "lookups": 0}
    check, plan = ShardLoader._check, local.bag_plan

    def counted_check(self, *a, **k):
        n["loader"] += 1
        return check(self, *a, **k)

    def counted_plan(*a, **k):
        n["lookups"] += 1
        n["embedding"] += bool(k.get("validate", True))
        return plan(*a, **k)

    monkeypatch.setattr(ShardLoader, "_check", counted_check)
    monkeypatch.setattr(local, "bag_plan", counted_plan)
    monkeypatch.setattr(server, "bag_plan", counted_plan)  # the host parameter server's reads
    return n


def test_single_process_run_checks_ids_once(tmp_path, counts):
    data = tmp_path / "data"
    make_data(data)
    cfg = config(tmp_path, data)
    cfg.train.max_steps = 3
    workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    assert counts["lookups"] > 0 and counts["loader"] >= 3  # the train steps' batches (and the eval's)
    assert counts["embedding"] == 0, counts


def test_single_process_run_with_host_tables_checks_ids_once(tmp_path, counts):
    """Host tables (EL-Rec V parameter server) beside the device tables: neither checks the loader's ids again."""
    data = tmp_path / "data"
    make_data(data)
    cfg = config(tmp_path, data)
    cfg.train.max_steps = 3
    cfg.model.tables = [TableConfig("t_C1", 30, 4, features=["C1"]), TableConfig("t_C2", 9, 4, features=["C2"]),
                        TableConfig("t_C3", 120, 4, features=["C3"], placement="host"),
                        TableConfig("t_C4", 5, 4, features=["C4"])]
    workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
    assert counts["lookups"] > 0 and counts["loader"] >= 3
    assert counts["embedding"] == 0, counts


def test_the_embedding_still_checks_when_asked(tmp_path, counts):
    """The counter sees the embedding's check (so the 0 above means something); a model built for batches
    that no loader checked keeps it (``build``'s default)."""
    data = tmp_path / "data"
    make_data(data)
    cfg = config(tmp_path, data)
    tables = assemble.tables_for(cfg, assemble.prepare_data(cfg, progress=False).manifest)
    model, _ = assemble.build(cfg, tables, 3, "cpu")
    loader = ShardLoader(data, 50, prefetch=0, validate=False)
    batch = next(iter(loader))
    model(batch.dense, batch.sparse)
    assert counts["embedding"] == counts["lookups"] > 0 and counts["loader"] == 0


def test_bad_id_fails_in_the_loader_naming_the_feature(tmp_path):
    data = tmp_path / "bad"
    rng = np.random.default_rng(0)
    n = 100
    ids = {f"C{i + 1}": rng.integers(0, r, n) for i, r in enumerate(ROWS)}
    ids["C3"][57] = ROWS[2]  # one past the table's last row
    sp = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(ROWS)]
    with ShardWriter(data, ["I1", "I2", "I3"], sp, shard_rows=150) as w:
        w.write(np.zeros(n, np.int8), np.zeros((n, 3), np.float32), ids)
    cfg = config(tmp_path, data)
    cfg.train.max_steps = 3
    with pytest.raises(InputError, match=r"feature C3: row id 120 outside its table \[0, 120\)"):
        workflow.train(cfg, tmp_path / "run", resume=False, progress=False)
