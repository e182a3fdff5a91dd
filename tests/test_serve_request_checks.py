"""Request rows are checked and encoded as a plain-Python model of the rules says (the batch-at-once check of
common requests accepts exactly the rows the rules accept), and a full queue refuses a request before encoding
it. References: the rules written out here row by row, ids laid out by hand, ``predict``'s probabilities."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from embedscale.serve.encode import RequestError, RowEncoder

DENSE, SPARSE, ROWS = ["I1", "I2"], ["C1", "C2", "C3"], 50
ENCODING = {"dense": DENSE, "sparse": [{"name": c, "num_rows": ROWS, "multi_hot": False} for c in SPARSE],
            "schema": None, "categorical": "ids", "dense_stats": None}


def valid_by_rules(row) -> bool:
    """The request rules, row by row: an object of exactly the features; dense values null, an integer under
    18 digits or a finite float; categorical ones null, an integer or a string of at most 4,096 characters
    (strings then fail the id check of an id-encoded model); booleans are neither."""
    if not isinstance(row, dict) or set(row) != set(DENSE + SPARSE):
        return False
    for f in DENSE:
        v = row[f]
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if isinstance(v, float) and not math.isfinite(v) or isinstance(v, int) and abs(v) >= 10 ** 18:
            return False
    for f in SPARSE:
        v = row[f]
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < ROWS:
            return False
    return True


def random_row(rng: random.Random) -> dict:
    row = {f: rng.choice([rng.randint(-5, 5), rng.uniform(-1, 1), None]) for f in DENSE}
    row.update({f: rng.choice([rng.randrange(ROWS), None]) for f in SPARSE})
    k = rng.randrange(14)
    f = rng.choice(DENSE + SPARSE)
    if k == 0:
        row[f] = rng.choice([True, "7", [1], {"a": 1}, 1.5])
    elif k == 1:
        row[f] = rng.choice([float("nan"), float("inf"), 10 ** 18, -(10 ** 19), 10 ** 400, 10 ** 18 - 1])
    elif k == 2:
        row[f] = rng.choice([-1, ROWS, ROWS - 1, 0, "x" * 5000])
    elif k == 3:
        del row[f]
    elif k == 4:
        row["C9"] = 1
    return row


def encode_or_none(enc: RowEncoder, rows: list):
    try:
        return enc.encode_rows(rows)
    except RequestError:
        return None


def test_rows_are_accepted_exactly_as_the_rules_say_and_encoded_in_place():
    enc = RowEncoder(ENCODING)
    rng = random.Random(7)
    accepted = 0
    for _ in range(400):
        rows = [random_row(rng) for _ in range(rng.choice([1, 3, 8]))]
        got = encode_or_none(enc, rows)
        assert (got is not None) == all(valid_by_rules(r) for r in rows), rows
        if got is None:
            continue
        accepted += 1
        dense = [[0.0 if r[f] is None else float(r[f]) for f in DENSE] for r in rows]
        assert torch.equal(got.dense, torch.tensor(dense, dtype=torch.float32))
        ids = [r[f] for f in SPARSE for r in rows if r[f] is not None]  # feature-major, nulls as empty bags
        lengths = [0 if r[f] is None else 1 for f in SPARSE for r in rows]
        assert got.sparse.values.tolist() == ids and got.sparse.lengths.tolist() == lengths
    assert 20 < accepted < 380  # both kinds of batch were drawn


def test_a_bad_row_among_good_ones_is_named_by_row_and_feature():
    enc = RowEncoder(ENCODING)
    rows = [{"I1": 1, "I2": 0.5, "C1": 3, "C2": 4, "C3": None} for _ in range(6)]
    rows[4] = dict(rows[4], C2=ROWS)
    with pytest.raises(RequestError) as e:
        enc.encode_rows(rows)
    assert (e.value.row, e.value.field) == (4, "C2")
    rows[4] = dict(rows[0], I2=float("nan"))
    with pytest.raises(RequestError) as e:
        enc.encode_rows(rows)
    assert (e.value.row, e.value.field) == (4, "I2")


def test_a_full_queue_refuses_before_encoding(tmp_path):
    from serve_fixtures import train_tiny, write_criteo
    from starlette.testclient import TestClient

    from embedscale.serve.export import export
    from embedscale.serve.predict import load_export, predict_file
    from embedscale.serve.server import ServeConfig, make_app

    run_dir, _ = train_tiny(tmp_path)
    export(run_dir, tmp_path / "model", "int8")
    rows = write_criteo(tmp_path / "q.tsv", 4, seed=5)
    predict_file(tmp_path / "model", tmp_path / "q.tsv", tmp_path / "q.parquet")
    import pyarrow.parquet as pq

    probs = pq.read_table(tmp_path / "q.parquet").column("probability").to_numpy()
    served = load_export(tmp_path / "model")
    calls = []
    encode = served.encoder.encode_rows
    served.encoder.encode_rows = lambda r: (calls.append(len(r)), encode(r))[1]
    app = make_app(served, ServeConfig(queue_rows=8))
    with TestClient(app) as client:
        batcher = app.state.serve["batcher"]
        batcher.queued_rows = 6  # rows of other requests waiting: 4 more do not fit
        r = client.post("/v1/predict", content=json.dumps({"rows": rows}))
        assert r.status_code == 503 and "queue is full" in r.json()["error"] and calls == []
        batcher.queued_rows = 0
        r = client.post("/v1/predict", content=json.dumps({"rows": rows}))
        assert r.status_code == 200 and calls == [4]
        np.testing.assert_allclose(r.json()["probabilities"], probs, rtol=2e-6, atol=1e-7)


def test_a_followed_model_is_warmed_on_the_last_batch_before_the_swap(tmp_path, monkeypatch):
    """``load_and_warm`` (what ``--follow`` runs off the serving thread) scores the last batch served with the new
    model before handing it over, and its scores then are the reference's (``predict``); a batch the new model
    cannot score leaves it loaded, cold."""
    from serve_fixtures import train_tiny, write_criteo

    from embedscale.serve.export import export
    from embedscale.serve.predict import ServedModel, load_export, predict_file
    from embedscale.serve.server import load_and_warm

    run_dir, _ = train_tiny(tmp_path)
    export(run_dir, tmp_path / "model", "int8")
    rows = write_criteo(tmp_path / "q.tsv", 5, seed=9)
    predict_file(tmp_path / "model", tmp_path / "q.tsv", tmp_path / "q.parquet")
    import pyarrow.parquet as pq

    probs = pq.read_table(tmp_path / "q.parquet").column("probability").to_numpy()
    sample = load_export(tmp_path / "model").encoder.encode_rows(rows)
    scored = []
    logits = ServedModel.logits
    monkeypatch.setattr(ServedModel, "logits", lambda self, enc: scored.append(enc.rows) or logits(self, enc))
    new = load_and_warm(tmp_path / "model", sample)
    assert scored == [5]
    np.testing.assert_allclose(torch.sigmoid(new.logits(sample)).numpy(), probs, rtol=2e-6, atol=1e-7)
    bad = sample.__class__(sample.dense, sample.sparse.__class__(sample.sparse.keys, sample.sparse.values + 10 ** 9,
                                                                 sample.sparse.lengths))
    assert load_and_warm(tmp_path / "model", bad).version == new.version
