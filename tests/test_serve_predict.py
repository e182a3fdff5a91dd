"""Export -> load -> predict against the trained model loaded the normal way (``workflow.build`` +
``load_model_state`` over the training data's shards): bitwise at FP32, and at INT8 equal to that model with
its tables replaced by a float64 dequantisation of the exported rows written here; an unlabeled file; the
encoding of raw rows against the rules worked by hand (hex % rows; vocabulary with the out-of-vocabulary
row 0); bad rows named."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from serve_fixtures import train_tiny, write_criteo
from test_serve_quantize import numpy_dequantize

from embedscale import workflow
from embedscale.data.loader import ShardLoader
from embedscale.errors import ConfigError, FormatError, InputError
from embedscale.serve.encode import RequestError, RowEncoder
from embedscale.serve.export import export
from embedscale.serve.predict import load_export, predict_file
from embedscale.train.trainer import load_model_state


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-predict")
    run_dir, cfg = train_tiny(root)
    return root, run_dir, cfg


def reference_logits(cfg, run_dir, tables_override=None):
    """The trained model as ``embedscale evaluate`` loads it, over every row of the training file in order."""
    data = workflow.prepare_data(cfg, progress=False)
    tables = workflow.tables_for(cfg, data.manifest)
    model, _ = workflow.build(cfg, tables, data.manifest.num_dense, torch.device("cpu"), validate=False)
    load_model_state(model, run_dir / "checkpoints" / "best")
    if tables_override:
        emb = model.sparse_arch.embedding
        with torch.no_grad():
            for name, w in tables_override.items():
                emb.table_weight(name).copy_(torch.from_numpy(w))
    model.eval()
    out = []
    with torch.no_grad():
        for b in ShardLoader(data.train.directory, 256, start=0, stop=data.manifest.rows):
            out.append(model(b.dense, b.sparse).numpy())
    return np.concatenate(out), data.manifest.rows


def test_fp32_export_predicts_bitwise_as_the_trained_model(trained, tmp_path):
    root, run_dir, cfg = trained
    m = export(run_dir, tmp_path / "model")  # a run directory: its checkpoints/best
    assert m["source"]["checkpoint"] == str((run_dir / "checkpoints" / "best").resolve())
    ref, rows = reference_logits(cfg, run_dir)
    res = predict_file(tmp_path / "model", root / "train.tsv", tmp_path / "p.parquet")
    got = pq.read_table(tmp_path / "p.parquet")
    assert res["rows"] == rows == got.num_rows
    z = got.column("logit").to_numpy()
    assert z.dtype == np.float32 and np.array_equal(z, ref)  # bit for bit
    assert res["labeled"] and 0.0 <= res["auc"] <= 1.0 and res["logloss"] > 0
    np.testing.assert_allclose(got.column("probability").to_numpy(), 1 / (1 + np.exp(-ref.astype(np.float64))))


def test_host_tables_and_vocab_export_predict_as_the_trained_model(tmp_path):
    """Tables in the host parameter server (EL-Rec V) are exported as rows; a vocabulary-encoded dataset's
    vocabularies travel in the export."""
    run_dir, cfg = train_tiny(tmp_path, rows=600, categorical="vocab", model={"host_min_rows": 1})
    ck = json.loads((run_dir / "checkpoints" / "best" / "manifest.json").read_text())
    assert len(ck["host_tables"]) == 26 and ck["tables"] == []
    m = export(run_dir, tmp_path / "model")
    assert m["encoding"]["categorical"] == "vocab"
    ref, rows = reference_logits(cfg, run_dir)
    predict_file(tmp_path / "model", tmp_path / "train.tsv", tmp_path / "p.parquet")
    z = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    assert len(z) == rows
    assert np.array_equal(z, ref)  # the host server pools as LocalEmbeddingBags does: bit for bit


def test_export_is_self_contained(trained, tmp_path):
    root, run_dir, cfg = trained
    export(run_dir, tmp_path / "model", "int8")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["export.json", "weights.safetensors"]
    moved = tmp_path / "elsewhere"
    (tmp_path / "model").rename(moved)
    man = json.loads((moved / "export.json").read_text())
    assert man["source"]["step"] == 12 and man["eval"]["auc"] > 0
    assert [t["form"] for t in man["tables"]] == ["int8"] * 26
    assert all(t["bytes_per_row"] == 4 + 4 for t in man["tables"])  # dim 4: 4 bytes + fp16 scale and bias
    assert man["encoding"]["schema"]["format"] == "tsv" and man["encoding"]["categorical"] == "hash"
    row = write_criteo(tmp_path / "one.tsv", 1, seed=5)[0]
    assert 0.0 < load_export(moved).predict_rows([row])[0] < 1.0


def test_int8_export_within_the_quantisation_of_its_tables(trained, tmp_path):
    root, run_dir, cfg = trained
    export(run_dir, tmp_path / "model", "int8")
    w = load_file(str(tmp_path / "model" / "weights.safetensors"))
    deq = {k[len("table."):]: numpy_dequantize(v.numpy(), "int8", 4).astype(np.float32)
           for k, v in w.items() if k.startswith("table.")}
    ref, _ = reference_logits(cfg, run_dir, deq)
    predict_file(tmp_path / "model", root / "train.tsv", tmp_path / "p.parquet")
    z = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    np.testing.assert_allclose(z, ref, rtol=1e-5, atol=1e-5)
    fp32, _ = reference_logits(cfg, run_dir)
    assert not np.array_equal(z, fp32)  # quantised: close to, not equal to, the FP32 model
    assert np.abs(z - fp32).max() < 0.05


def test_predict_an_unlabeled_file(trained, tmp_path):
    root, run_dir, cfg = trained
    export(run_dir, tmp_path / "model")
    write_criteo(tmp_path / "lab.tsv", 40, seed=9)
    write_criteo(tmp_path / "unlab.tsv", 40, labeled=False, seed=9)  # the same rows without the label
    a = predict_file(tmp_path / "model", tmp_path / "lab.tsv", tmp_path / "a.parquet")
    b = predict_file(tmp_path / "model", tmp_path / "unlab.tsv", tmp_path / "b.parquet")
    assert a["labeled"] and not b["labeled"] and "auc" not in b and b["rows"] == 40
    ta, tb = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert "label" not in tb.column_names
    assert np.array_equal(ta.column("logit").to_numpy(), tb.column("logit").to_numpy())


def test_bad_files_and_exports_are_named(trained, tmp_path):
    root, run_dir, cfg = trained
    export(run_dir, tmp_path / "model")
    bad = tmp_path / "bad.tsv"
    lines = (root / "train.tsv").read_text().splitlines()[:5]
    f = lines[3].split("\t")
    f[20] = "zz-not-hex"
    lines[3] = "\t".join(f)
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"bad.tsv: line 4: C7 .*zz-not-hex"):
        predict_file(tmp_path / "model", bad, tmp_path / "p.parquet")
    assert not (tmp_path / "p.parquet").exists()
    with pytest.raises(FormatError, match="not a model export"):
        load_export(tmp_path)
    with pytest.raises(ConfigError, match="int3"):
        export(run_dir, tmp_path / "m2", "int3")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(ConfigError, match="not a model export"):
        export(run_dir, tmp_path / "taken")
    assert (tmp_path / "taken" / "x").read_text() == "mine"


def hash_encoding(rows=7):
    return {"dense": ["I1"], "sparse": [{"name": "C1", "num_rows": rows, "multi_hot": False}],
            "schema": {"format": "tsv", "header": False, "columns": ["label", "I1", "C1"], "label": "label",
                       "dense": [{"column": "I1", "parse": "int", "transform": "log1p"}],
                       "sparse": [{"column": "C1", "key": "hex"}]},
            "categorical": "hash", "dense_stats": None}


def test_raw_rows_encode_by_the_training_rules():
    enc = RowEncoder(hash_encoding(7))
    e = enc.encode_rows([{"I1": 3, "C1": "68fd1e64"}, {"I1": None, "C1": None}, {"I1": -5, "C1": "0A"}])
    assert e.sparse.values.tolist() == [0x68fd1e64 % 7, 0, 10 % 7]  # hex key % rows; missing = key 0
    np.testing.assert_allclose(e.dense[:, 0].numpy(), [np.log(4.0), 0.0, 0.0], rtol=1e-6)  # log(1 + max(x, 0))
    v = hash_encoding(4)
    v["categorical"] = "vocab"
    vocab = {"C1": np.array([0xbeef, 0x10, 0x0], np.uint64).view(np.int64)}  # rows 1, 2, 3
    enc = RowEncoder(v, vocab)
    e = enc.encode_rows([{"I1": 1, "C1": "10"}, {"I1": 1, "C1": "ffff"}, {"I1": 1, "C1": "BEEF"},
                         {"I1": 1, "C1": None}])
    assert e.sparse.values.tolist() == [2, 0, 1, 3]  # unseen "ffff" -> the out-of-vocabulary row 0


@pytest.mark.parametrize("row,field,what", [
    ({"C1": "ab"}, "I1", "missing feature"),
    ({"I1": 1, "C1": "ab", "C2": "x"}, "C2", "unknown feature"),
    ({"I1": "3", "C1": "ab"}, "I1", "expected a number"),
    ({"I1": True, "C1": "ab"}, "I1", "expected a number"),
    ({"I1": 1.5, "C1": "ab"}, "I1", "not an integer"),
    ({"I1": 1, "C1": 2.5}, "C1", "expected a string"),
    ({"I1": 1, "C1": "xyz"}, "C1", "not hexadecimal"),
    ({"I1": 1, "C1": ["ab"]}, "C1", "expected a string"),
])
def test_bad_request_rows_name_row_and_feature(row, field, what):
    enc = RowEncoder(hash_encoding())
    with pytest.raises(RequestError, match=what) as e:
        enc.encode_rows([{"I1": 1, "C1": "ab"}, row])
    assert e.value.row == 1 and e.value.field == field


def _file_ranges(path) -> list[tuple[int, int]]:
    """This process's address ranges mapping ``path`` (/proc/self/maps)."""
    out = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def test_shared_load_reads_every_table_in_place_from_the_file(trained, tmp_path):
    root, run_dir, cfg = trained
    export(run_dir, tmp_path / "model")  # FP32: a private load copies the tables into LocalEmbeddingBags
    weights = (tmp_path / "model" / "weights.safetensors").resolve()
    shared = load_export(tmp_path / "model", shared=True)
    ranges = _file_ranges(weights)
    emb = shared.model.sparse_arch.embedding
    assert emb.rows is None and len(emb.stored) == 26
    for name, t in emb.stored.items():  # every table's values lie in the read-only mapping of the weights file
        assert any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in ranges), name
    private = load_export(tmp_path / "model")
    ptr = private.model.sparse_arch.embedding.rows.weights.data_ptr()
    assert not any(lo <= ptr < hi for lo, hi in _file_ranges(weights))
    write_criteo(tmp_path / "q.tsv", 30, seed=4)
    from embedscale.serve.encode import read_file
    enc = next(read_file(shared.encoder, tmp_path / "q.tsv"))
    assert np.array_equal(shared.logits(enc).numpy(), private.logits(enc).numpy())  # one-hot sums: the same bits


def test_private_load_copies_quantized_tables_out_of_the_file(trained, tmp_path):
    """One process serving alone (not ``shared``) holds its INT8 tables in its own memory, outside every mapping of
    the weights file (the kernel's /proc/self/maps): rows read at random from a file mapping slowed the whole
    server by a quarter at full size. The shared load still reads them in place, and both score alike."""
    root, run_dir, cfg = trained
    export(run_dir, tmp_path / "model", quantize="int8")
    weights = (tmp_path / "model" / "weights.safetensors").resolve()
    shared = load_export(tmp_path / "model", shared=True)
    private = load_export(tmp_path / "model")
    ranges = _file_ranges(weights)
    assert ranges and len(private.model.sparse_arch.embedding.stored) == 26
    for name, t in private.model.sparse_arch.embedding.stored.items():
        assert not any(lo <= t.data_ptr() < hi for lo, hi in ranges), name
    for name, t in shared.model.sparse_arch.embedding.stored.items():
        assert any(lo <= t.data_ptr() < hi for lo, hi in ranges), name
    write_criteo(tmp_path / "q.tsv", 30, seed=4)
    from embedscale.serve.encode import read_file
    enc = next(read_file(shared.encoder, tmp_path / "q.tsv"))
    assert np.array_equal(shared.logits(enc).numpy(), private.logits(enc).numpy())


def test_tt_tables_export_as_cores_and_predict_as_the_trained_model(tmp_path):
    """TT tables (EL-Rec III) leave the checkpoint as their cores, never materialised, and score as the trained
    model does (the same Eff-TT forward); an INT8 export quantizes the row tables and keeps the cores."""
    run_dir, cfg = train_tiny(tmp_path, rows=600, model={"tt_min_rows": 1, "tt_rank": 2})
    ck = json.loads((run_dir / "checkpoints" / "best" / "manifest.json").read_text())
    assert ck["tt_tables"]
    m = export(run_dir, tmp_path / "model")
    tt = [t for t in m["tables"] if t["form"] == "tt"]
    assert sorted(t["name"] for t in tt) == sorted(ck["tt_tables"])
    for t in tt:  # cores only: far below the table's rows
        assert t["bytes"] == 4 * sum(a * r0 * n * r1 for a, n, r0, r1 in zip(
            t["row_shape"], t["dim_shape"], [1] + t["tt_ranks"], t["tt_ranks"] + [1]))
    ref, rows = reference_logits(cfg, run_dir)
    predict_file(tmp_path / "model", tmp_path / "train.tsv", tmp_path / "p.parquet")
    z = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    assert np.array_equal(z, ref)  # the same Eff-TT forward over the same cores: bit for bit
    m8 = export(run_dir, tmp_path / "m8", "int8")
    assert {t["form"] for t in m8["tables"]} <= {"int8", "tt"}
