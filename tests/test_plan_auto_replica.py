"""The TT lookup on several ranks (``Costs.tt_replica_factor``): replicated cores take a dense gradient per core,
summed across ranks and applied to the whole core, not the fused per-slice update of one process; the planner
prices a TT table on several ranks at that path's measured cost.

Reference: the documented sums worked in plain Python (``L tt(R) f + cores 2 (M-1)/M / allreduce_bw``, the row
groups' ``a L exact + (1-d) L tt(R) f + ...``), and the update a replicated table applies checked against the fused
one on the same batches (the calibration times the same work done two ways).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedscale.errors import ConfigError
from embedscale.embedding.tt import TTEmbeddingBag
from embedscale.plan.auto import Costs, candidates, hybrid_candidate, table_stats, tt_core_bytes
from embedscale.specs import TableSpec

COSTS = Costs(tt_lookup_s={8: 1.0e-6, 32: 2.0e-6}, tt_replica_factor=0.8)


def _stats(n: int = 1_000_000, world: int = 2):
    p = np.arange(1, n + 1, dtype=np.float64) ** -1.1
    return table_stats(TableSpec("t", n, 16), np.round(p / p.sum() * 4e6).astype(np.int64), 1e6, 1024, world,
                       hot_touch=1e9, tt_min_rows=1)


def test_the_replica_factor_by_hand():
    assert COSTS.tt(8) == pytest.approx(1.0e-6) and COSTS.tt(8, world=1) == pytest.approx(1.0e-6)
    assert COSTS.tt(8, world=2) == pytest.approx(0.8e-6) and COSTS.tt(32, None, 4) == pytest.approx(1.6e-6)
    assert Costs(tt_lookup_s={8: 1.0e-6}).tt(8, world=2) == pytest.approx(1.0e-6)  # not measured: as one process


def test_tt_candidates_on_two_ranks_are_priced_at_the_replica_path():
    s = _stats()
    ar = COSTS.allreduce_gbs * 1e9
    c = next(c for c in candidates(s, 2, COSTS, tt_rank_list=(8,), forms=("tt",)) if c.label == "tt-8")
    assert c.seconds == pytest.approx(s.lookups_rank * 0.8e-6 + tt_core_bytes(s.num_rows, 16, 8) * 2 * 0.5 / ar, rel=1e-9)
    one = _stats(world=1)
    c1 = next(c for c in candidates(one, 1, COSTS, tt_rank_list=(8,), forms=("tt",)) if c.label == "tt-8")
    assert c1.seconds == pytest.approx(one.lookups_rank * 1.0e-6, rel=1e-9)  # one process: the fused path, no all-reduce
    h = 50
    a, d = s.share_of_rows(h), min(1.0, s.distinct_of_rows(h) / s.distinct_rank)
    g = hybrid_candidate(s, 8, h, 2, COSTS)
    want = s.lookups_rank * (a * COSTS.exact_lookup_s + (1 - d) * 0.8e-6) \
        + (tt_core_bytes(s.num_rows, 16, 8) + h * 64) * 2 * 0.5 / ar + COSTS.row_group_overhead_s
    assert g.seconds == pytest.approx(want, rel=1e-9)


def test_the_replica_path_applies_the_fused_update():
    """The two steps the calibration times do the same work: a TT table whose cores' gradient is summed (over one
    rank) and applied whole ends where the fused per-slice update ends, batch after batch."""
    rng = np.random.default_rng(0)
    fused, rep = (TTEmbeddingBag(5000, 8, 4, optimizer="rowwise_adagrad", lr=0.05, seed=1, name="t")
                  for _ in range(2))
    rep.grad_sync = lambda grads: None
    off = torch.arange(64)
    for _ in range(3):
        ids = torch.from_numpy(rng.zipf(1.3, 64) % 5000)
        for m in (fused, rep):
            m(ids, off).sum().backward()
    for a, b in zip(fused.cores, rep.cores):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.equal(fused.cores[0], TTEmbeddingBag(5000, 8, 4, seed=1, name="t").cores[0])  # it moved


def test_the_factor_survives_a_costs_file_and_a_bad_one_is_named(tmp_path):
    from embedscale.plan.auto import load_costs
    COSTS.save(tmp_path / "c.json")
    assert load_costs(tmp_path / "c.json").tt_replica_factor == pytest.approx(0.8)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="tt_replica_factor"):
            Costs.from_dict({**COSTS.to_dict(), "tt_replica_factor": bad}, "costs.json")
