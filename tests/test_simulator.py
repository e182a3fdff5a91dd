"""The DMT cluster simulator: FLOP formulas against the real models (torch's flop counter), byte splits
against brute-force enumeration, and DMT Figure 10's trend."""

from __future__ import annotations

import math

import pytest
import torch

from embedscale.data.batch import JaggedFeatures
from embedscale.errors import ConfigError
from embedscale.models.dmt import DMTConfig, build_dmt_model, training_flops_per_sample
from embedscale.specs import ModelConfig, TableSpec
from embedscale.towers.simulator import HARDWARE, CollectiveModel, Workload, dense_flops, simulate, sweep


def test_table_1_hardware():
    assert (HARDWARE["V100"].peak_tflops, HARDWARE["A100"].scale_out_gbit_s, HARDWARE["H100"].scale_up_gbyte_s) == \
        (15.7, 200.0, 450.0)


def test_dlrm_flops_match_dmt_table_3():
    assert dense_flops(Workload(), 0)["train_flops"] / 1e6 == pytest.approx(14.74, abs=0.02)


@pytest.mark.parametrize("arch,towers", [("dlrm", 0), ("dlrm", 2), ("dcn", 0), ("dcn", 2)])
def test_flop_formulas_match_the_models(arch, towers):
    """Forward FLOPs of the formula = torch's count on the model this library builds (small dims)."""
    w = Workload(arch=arch, num_features=6, embedding_dim=8, num_dense=3, bottom_mlp=(16,), top_mlp=(16, 8),
                 cross_layers=2, cross_low_rank=4, tower_dim=4, tower_cross_layers=1, tower_cross_low_rank=0)
    tables = [TableSpec(f"C{i}", 5, 8) for i in range(6)]
    cfg = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=[16], top_mlp=[16, 8], cross_layers=2, cross_low_rank=4)
    dmt = DMTConfig(towers=towers or 1, tower_module="none" if not towers else "auto", compression=2)
    model = build_dmt_model(cfg, tables, 3, dmt, num_hosts=towers or 1)
    B = 4
    feats = JaggedFeatures.from_dense([t.name for t in tables], torch.zeros(B, 6, dtype=torch.int64))
    counted = training_flops_per_sample(model, torch.rand(B, 3), feats)["forward"]
    formula = dense_flops(w, towers)["train_flops"] / 3
    # the formula counts the cross layers' elementwise work too (2 d per layer); torch counts matmuls only
    if arch == "dcn":
        d = 8 + 6 * (4 if towers else 8)
        formula -= 2 * 2 * 2 * d
        if towers:
            formula -= towers * 1 * 2 * 2 * (3 * 8)
    assert counted == pytest.approx(formula, rel=1e-9)


def test_all_to_all_byte_split_matches_enumeration():
    """Cross-host vs intra-host shares of an all_to_all over G ranks at L per host, by enumeration."""
    cm = CollectiveModel(decay=0.0, latency_us=0.0)
    hw = HARDWARE["A100"]
    for G, L in [(16, 8), (32, 8), (8, 8), (12, 4)]:
        pairs = [(s, d) for s in range(G) for d in range(G) if s != d]
        cross = sum(1 for s, d in pairs if s // L != d // L) / G  # per-rank share of destinations
        intra = sum(1 for s, d in pairs if s // L == d // L) / G
        V = 1e9
        want = max(V / G * cross / (hw.scale_out_gbit_s / 8 * 1e9), V / G * intra / (hw.scale_up_gbyte_s * 1e9))
        assert cm.all_to_all(V, G, L, hw) == pytest.approx(want)


def test_efficiency_falls_with_world_size():
    cm = CollectiveModel()
    effs = [cm.efficiency(w) for w in (2, 16, 64, 512)]
    assert effs[0] == 1.0 and all(a > b for a, b in zip(effs, effs[1:]))


def test_speedup_grows_with_scale_as_dmt_figure_10():
    for hw in ("A100", "H100"):
        rows = [simulate(g, hw) for g in (16, 32, 64, 128, 256, 512)]
        dmt = [r["speedup_dmt"] for r in rows]
        assert all(a < b for a, b in zip(dmt, dmt[1:])), dmt
        assert all(r["speedup_tm_over_sptt"] > 1 for r in rows)  # DMT Figure 11: modules add on top
        assert all(r["speedup_sptt"] > 1 for r in rows)
        assert rows[-1]["flat"]["embedding_comm"] > rows[-1]["dmt"]["embedding_comm"] * 2
    r = simulate(64, "A100")
    assert math.isclose(r["flat"]["total"], sum(v for k, v in r["flat"].items() if k != "total"))
    assert r["throughput"]["dmt"] == pytest.approx(64 * 16384 / r["dmt"]["total"])


def test_sweep_and_errors():
    rows = sweep(gpus=(16, 256), hardware=("V100", "A100"), archs=("dlrm",))
    assert [(r["hardware"], r["gpus"]) for r in rows] == [("V100", 16), ("A100", 16), ("A100", 256)]
    with pytest.raises(ConfigError, match="multiple"):
        simulate(12, "A100")
    with pytest.raises(KeyError):
        simulate(16, "TPU")
