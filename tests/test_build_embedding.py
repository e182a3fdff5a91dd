"""The one embedding builder: every form of a world of one, rows initialised placement-independently
(checked against ``embedding.init.uniform_rows`` directly), and its error cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedscale.embedding.build import EmbeddingEnv, build_embedding, embedding_parts
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.mixed import MixedEmbedding
from embedscale.errors import ConfigError
from embedscale.pipeline import PipelinedEmbedding
from embedscale.plan.forms import decide_forms
from embedscale.specs import TableConfig, TableSpec

DEV = torch.device("cpu")  # the test's own device; the builder takes it from env


def _tables(mixed: bool = False):
    """The tables and their forms (``b`` TT by ``tt_min_rows``, ``c`` host by its request when ``mixed``)."""
    tabs = [TableSpec("a", 30, 4), TableSpec("b", 500, 4), TableSpec("c", 200, 4)]
    requests = [TableConfig("c", 200, 4, placement="host")] if mixed else []
    return tabs, decide_forms(tabs, requests=requests, tt_min_rows=400 if mixed else 0, tt_rank=2)


def _ref(seed, index, spec):
    return uniform_rows(seed, index, np.arange(spec.num_rows), spec.dim, spec.num_rows)


def test_world_of_one_plain_tables_are_local_bags_with_hash_init():
    tabs, forms = _tables()
    emb = build_embedding(tabs, None, EmbeddingEnv(device=DEV, seed=7), forms=forms)
    assert type(emb) is LocalEmbeddingBags
    rows, tt, host = embedding_parts(emb)
    assert rows is emb and tt is None and host is None
    for i, t in enumerate(tabs):
        np.testing.assert_array_equal(emb.table_weight(t.name).detach().numpy()[: t.num_rows], _ref(7, i, t))


def test_tt_and_host_forms_make_the_mixed_and_pipelined_parts():
    tabs, forms = _tables(mixed=True)  # b: TT (tt_min_rows), c: host (placement: host), a: rows
    emb = build_embedding(tabs, None, EmbeddingEnv(device=DEV, seed=3), forms=forms)
    rows, tt, host = embedding_parts(emb)
    assert isinstance(host, PipelinedEmbedding) and isinstance(tt, MixedEmbedding)
    assert list(tt.tt) == ["b"] and tt.tt["b"].ranks == [1, 2, 2, 1]  # the form's rank
    # the uncompressed table keeps its index among all tables (0), so it starts as everywhere else
    np.testing.assert_array_equal(rows.table_weight("a").detach().numpy()[:30], _ref(3, 0, tabs[0]))
    np.testing.assert_array_equal(host.server.store.table_weight("c").detach().numpy()[:200], _ref(3, 2, tabs[2]))


def test_several_ranks_need_a_plan_and_a_transport():
    tabs, forms = _tables()
    with pytest.raises(ConfigError, match="2 ranks need a plan"):
        build_embedding(tabs, None, EmbeddingEnv(device=DEV, world_size=2), forms=forms)


def test_every_table_needs_a_form():
    tabs, forms = _tables(mixed=True)
    with pytest.raises(ConfigError, match=r"tables \['c'\] have no form"):
        build_embedding(tabs, None, EmbeddingEnv(device=DEV), forms={k: v for k, v in forms.items() if k != "c"})
