"""The TT lookup's size term (``Costs.tt_size_slope``): a TT lookup into a larger table costs more (fewer core
slices shared among a batch's rows), and the planner's TT candidates are priced at their own table's size.

Reference: the documented formula ``tt(R) * (1 + slope * log2(rows / tt_rows))`` worked by hand, and the candidate's
documented sum ``L tt(R, N) + cores 2 (M-1)/M / allreduce_bw`` in plain Python.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from embedscale.errors import ConfigError
from embedscale.plan.auto import Costs, candidates, table_stats, tt_core_bytes
from embedscale.specs import TableSpec

COSTS = Costs(tt_lookup_s={8: 1.0e-6, 32: 2.0e-6}, tt_rows=1_000_000, tt_size_slope=0.1)


def test_the_size_factor_by_hand():
    assert COSTS.tt(8) == pytest.approx(1.0e-6)  # the calibration's own table
    assert COSTS.tt(8, 1_000_000) == pytest.approx(1.0e-6)
    assert COSTS.tt(8, 4_000_000) == pytest.approx(1.0e-6 * 1.2)  # two doublings, 10% each
    assert COSTS.tt(32, 16_000_000) == pytest.approx(2.0e-6 * 1.4)
    assert COSTS.tt(8, 250_000) == pytest.approx(1.0e-6 * 0.8)
    assert COSTS.tt(8, 10) == pytest.approx(0.5e-6)  # never below half
    # not measured (a costs file of before): no scaling at any size
    assert Costs(tt_lookup_s={8: 1.0e-6}).tt(8, 16_000_000) == pytest.approx(1.0e-6)


def test_a_tt_candidate_is_priced_at_its_tables_size():
    """Two tables of the same traffic, 1M and 8M rows: their TT candidates differ by the size term only."""
    out = {}
    for n in (1_000_000, 8_000_000):
        t = TableSpec("t", n, 16)
        counts = np.ones(n, dtype=np.int64)
        s = table_stats(t, counts, float(n), 1024, 2, hot_touch=1e9, tt_min_rows=1)
        c = next(c for c in candidates(s, 2, COSTS, tt_rank_list=(8,), forms=("tt",)) if c.label == "tt-8")
        ref = 1024 * 1.0e-6 * (1 + 0.1 * math.log2(n / 1_000_000)) \
            + tt_core_bytes(n, 16, 8) * 2 * 0.5 / (COSTS.allreduce_gbs * 1e9)
        assert c.seconds == pytest.approx(ref, rel=1e-9)
        out[n] = c.seconds
    assert out[8_000_000] > out[1_000_000]


def test_the_size_term_survives_a_costs_file_and_a_bad_one_is_named(tmp_path):
    p = tmp_path / "costs.json"
    COSTS.save(p)
    from embedscale.plan.auto import load_costs
    back = load_costs(p)
    assert back.tt_rows == 1_000_000 and back.tt_size_slope == pytest.approx(0.1)
    d = COSTS.to_dict()
    d["tt_size_slope"] = float("nan")
    with pytest.raises(ConfigError, match="tt_size_slope"):
        Costs.from_dict(d, "costs.json")
    d = COSTS.to_dict()
    d["tt_rows"] = -5
    with pytest.raises(ConfigError, match="tt_rows"):
        Costs.from_dict(d, "costs.json")
