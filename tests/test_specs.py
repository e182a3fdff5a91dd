import pytest

from embedscale.errors import ConfigError
import dataclasses

from embedscale.specs import (RunConfig, TableConfig, TableSpec, dump_config, feature_to_table, from_dict, leaf_fields,
                              load_config)


def test_defaults_round_trip_through_yaml(tmp_path):
    cfg = RunConfig()
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_overrides_beat_file_and_are_typed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr_dense: 0.5\n  batch_size: 64\n")
    cfg = load_config(p, {"train.batch_size": "128", "model.bottom_mlp": ["8", "4"]})
    assert cfg.train.lr_dense == 0.5
    assert cfg.train.batch_size == 128
    assert cfg.model.bottom_mlp == [8, 4]


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr_dnese: 0.5\n")
    with pytest.raises(ConfigError, match=r"train\.lr_dnese"):
        load_config(p)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"train\.batch_size"):
        load_config(None, {"train.batch_size": "many"})


def test_bad_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+"):
        load_config(p)


def test_tables_from_yaml_and_validation():
    cfg = from_dict(RunConfig, {"model": {"tables": [{"name": "a", "num_rows": 10, "features": ["f1", "f2"]}]}})
    assert cfg.model.tables[0].features == ["f1", "f2"]
    with pytest.raises(ConfigError, match="num_rows"):
        TableSpec("x", 0)
    with pytest.raises(ConfigError, match="pooling"):
        TableSpec("x", 3, pooling="max")
    with pytest.raises(ConfigError, match="'f'"):
        feature_to_table([TableSpec("a", 3, features=["f"]), TableSpec("b", 3, features=["f"])])


def test_table_spec_holds_only_facts():
    """A TableSpec is rows, dim, features, pooling, bytes; a table's form lives in the plan."""
    assert [f.name for f in dataclasses.fields(TableSpec)] == ["name", "num_rows", "dim", "features", "pooling",
                                                               "bytes_per_value"]
    with pytest.raises(TypeError):
        TableSpec("t", 10, compression="tt")  # the form is not a fact


def test_config_tables_keep_the_form_keys_as_requests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  tables:\n    - {name: big, num_rows: 5000, dim: 8, compression: tt, tt_rank: 8}\n"
                 "    - {name: far, num_rows: 900, features: [f1, f2], placement: host, pooling: mean}\n")
    big, far = load_config(p).model.tables
    assert isinstance(big, TableConfig) and (big.compression, big.tt_rank, big.placement) == ("tt", 8, "device")
    assert big.spec == TableSpec("big", 5000, 8) and type(big.spec) is TableSpec
    assert (far.placement, far.compression) == ("host", "none")
    assert far.spec == TableSpec("far", 900, 16, features=["f1", "f2"], pooling="mean")
    assert load_config(p) == from_dict(RunConfig, __import__("yaml").safe_load(dump_config(load_config(p))))
    with pytest.raises(ConfigError, match=r"table 'big': compression 'ttt' is not 'none' or 'tt'"):
        load_config(None, {"model.tables": [{"name": "big", "num_rows": 5, "compression": "ttt"}]})
    with pytest.raises(ConfigError, match=r"table 'x': placement 'gpu' is not 'device' or 'host'"):
        load_config(None, {"model.tables": [{"name": "x", "num_rows": 5, "placement": "gpu"}]})
    with pytest.raises(ConfigError, match=r"model\.tables\[0\].*tt_rnak"):
        load_config(None, {"model.tables": [{"name": "x", "num_rows": 5, "tt_rnak": 4}]})
    with pytest.raises(ConfigError, match=r"table 'x': tt_rank must be positive, got 0"):
        load_config(None, {"model.tables": [{"name": "x", "num_rows": 5, "compression": "tt", "tt_rank": 0}]})
    with pytest.raises(ConfigError, match=r"table 'x': num_rows must be positive"):
        load_config(None, {"model.tables": [{"name": "x", "num_rows": 0}]})


def test_every_leaf_is_a_flag():
    names = {n for n, _, _ in leaf_fields()}
    assert {"train.lr_dense", "data.synthetic.preset", "model.bottom_mlp"} <= names
    assert not any(n.startswith("model.tables") for n in names)
