"""Typed form kinds: ``TableForm.kind`` is a ``FormKind`` and every candidate of the auto planner carries a
``CandidateKind``, checked against hand-worked expectations and against the candidate's own form (a separate
field the kind must agree with), not against the code that derives it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedscale.errors import ConfigError
from embedscale.plan.auto import Candidate, CandidateKind, Costs, candidates, table_stats
from embedscale.plan.forms import SHARDED, FormKind, TableForm
from embedscale.specs import TableSpec


def test_table_form_kind_is_typed_and_written_as_text():
    f = TableForm("tt", tt_rank=8)
    assert f.kind is FormKind.TT and f.kind == "tt" and f == TableForm(FormKind.TT, tt_rank=8)
    d = f.to_dict()
    assert type(d["kind"]) is str and d["kind"] == "tt"
    assert TableForm.from_dict(json.loads(json.dumps(d))) == f
    assert hash(TableForm("host")) == hash(TableForm(FormKind.HOST))


def test_form_kind_errors_quote_the_kind_as_a_config_gives_it():
    with pytest.raises(ConfigError, match=r"table form 'bogus' is not one of sharded, tt, host, tower"):
        TableForm("bogus")
    with pytest.raises(ConfigError, match=r"tt_rank 3 given for a 'host' table form"):
        TableForm("host", tt_rank=3)


@pytest.mark.parametrize("label,kind", [("sharded", CandidateKind.SHARDED), ("replicated", CandidateKind.REPLICATED),
                                        ("tt-8", CandidateKind.TT), ("tt-16-hot93", CandidateKind.TT),
                                        ("host-2", CandidateKind.HOST), ("f3", None)])
def test_candidate_kind_of_a_label(label, kind):
    assert CandidateKind.of(label) is kind
    assert Candidate(label, SHARDED, 1.0, 0.0, 0.0).kind is kind


def test_replicated_is_a_placement_of_the_sharded_form():
    assert CandidateKind.REPLICATED.form is FormKind.SHARDED
    assert {k.form for k in CandidateKind} == {FormKind.SHARDED, FormKind.TT, FormKind.HOST}


def test_the_planners_candidates_carry_the_kind_of_their_form():
    counts = np.random.default_rng(0).zipf(1.3, 200_000) % 50_000
    counts = np.bincount(counts, minlength=50_000).astype(np.int64)
    s = table_stats(TableSpec("t", 50_000, 16), counts, 100_000, 512, 2, hot_touch=10.0)
    costs = Costs(executor_overhead_s={"sharded": 1e-4, "tt": 2e-4, "host": 3e-4}, executor_world=2)
    for hot_row_touch in (0.0, 1.0):
        cs = candidates(s, 2, costs, tt_rank_list=(8,), host_depth=2, hot_row_touch=hot_row_touch)
        got = {(c.kind, c.form.kind) for c in cs}
        assert got == {(CandidateKind.SHARDED, "sharded"), (CandidateKind.REPLICATED, "sharded"),
                       (CandidateKind.TT, "tt"), (CandidateKind.HOST, "host")}, hot_row_touch
        for c in cs:  # the overhead by kind is the one the costs file gives for the form's kind
            assert costs.executor_overhead(c.kind, 2) == costs.executor_overhead_s[c.form.kind]
