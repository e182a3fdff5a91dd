"""The ranking call scored once per context (``serve.ranking``) against its reference, the N expanded rows
``{**context, **candidate}`` scored by the model's own forward: several requests with different contexts in
one batch, the dense features in the context or split, with and without the first-order term; the batcher
keeps requests of different splits in different batches; the dense model's bf16 and int8 precisions stay
within their rounding of the float64 model. In-process, no server."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from embedscale.models import build_model
from embedscale.serve.encode import RowEncoder
from embedscale.serve.predict import ServedModel
from embedscale.serve.ranking import encode_ranking, rank_logits, ranks_by_context
from embedscale.serve.server import Batcher, Metrics, ServeConfig
from embedscale.specs import ModelConfig, TableSpec

ROWS = [50, 7, 300, 20, 11, 64]
DENSE = [f"I{i}" for i in range(1, 5)]
SPARSE = [f"C{j}" for j in range(1, len(ROWS) + 1)]


def served(first_order: bool, seed: int = 0) -> ServedModel:
    specs = [TableSpec(f"t_{f}", n, 8, [f]) for f, n in zip(SPARSE, ROWS)]
    cfg = ModelConfig(arch="dlrm", embedding_dim=8, bottom_mlp=[16], top_mlp=[32, 16], first_order=first_order)
    torch.manual_seed(seed)
    model = build_model(cfg, specs, len(DENSE)).eval()
    with torch.no_grad():  # a non-trivial calibration and first-order term: every part of the forward counts
        model.calibration.scale_shift.copy_(torch.tensor([1.3, -0.2]))
    encoding = {"dense": DENSE, "sparse": [{"name": f, "num_rows": n, "multi_hot": False} for f, n in zip(SPARSE, ROWS)],
                "schema": None, "categorical": "ids", "dense_stats": None}
    return ServedModel({"model_version": "v"}, model, RowEncoder(encoding), None)


def request(rng, ctx_features: list[str], n: int) -> tuple[dict, list[dict]]:
    def value(f):
        if f in DENSE:
            return None if rng.random() < 0.1 else float(rng.integers(0, 40))
        return int(rng.integers(0, ROWS[SPARSE.index(f)]))

    cand_features = [f for f in DENSE + SPARSE if f not in ctx_features]
    return {f: value(f) for f in ctx_features}, [{f: value(f) for f in cand_features} for _ in range(n)]


def expanded_logits(s: ServedModel, reqs) -> np.ndarray:
    """The reference: every candidate as a full row, scored by the model's own forward."""
    rows = [{**ctx, **c} for ctx, cands in reqs for c in cands]
    enc = s.encoder.encode_rows(rows)
    with torch.no_grad():
        return s.model(enc.dense, enc.sparse).numpy()


SPLITS = {"dense and C1-C3 in the context": DENSE + SPARSE[:3],
          "I2 and C1 per candidate": ["I1", "I3", "I4", "C2", "C3"],
          "the context holds one feature": ["C4"]}


@pytest.mark.parametrize("first_order", [False, True])
@pytest.mark.parametrize("split", list(SPLITS))
def test_rank_logits_equal_the_expanded_rows(split, first_order):
    s = served(first_order)
    assert ranks_by_context(s.model)
    rng = np.random.default_rng(1)
    reqs = [request(rng, SPLITS[split], n) for n in (1, 5, 9)]  # three contexts in one batch
    parts = [encode_ranking(s.encoder, ctx, cands) for ctx, cands in reqs]
    got = rank_logits(s.model, s.encoder, parts).numpy()
    np.testing.assert_allclose(got, expanded_logits(s, reqs), rtol=1e-5, atol=1e-5)


def test_requests_of_other_splits_are_batched_apart():
    """Ranking calls of two splits and a plain rows request queued together: each answer equals its expansion."""
    s = served(True)
    rng = np.random.default_rng(2)
    a = [request(rng, SPLITS["dense and C1-C3 in the context"], n) for n in (3, 4)]
    b = [request(rng, SPLITS["I2 and C1 per candidate"], 6)]
    rows = [{**ctx, **c} for ctx, cands in [request(rng, ["C1"], 5)] for c in cands]
    items = [encode_ranking(s.encoder, *r) for r in a] + [encode_ranking(s.encoder, *b[0]),
                                                          s.encoder.encode_rows(rows)]
    batches = []

    async def run():
        batcher = Batcher(ServeConfig(max_wait_ms=50), Metrics("v"))
        forward = batcher._forward
        batcher._forward = lambda m, parts: (batches.append(len(parts)), forward(m, parts))[1]
        futs = [batcher.submit(e, s) for e in items]  # all queued before the loop takes the first
        batcher.start()
        out = await asyncio.wait_for(asyncio.gather(*futs), 60)
        await asyncio.wait_for(batcher.stop(), 60)
        return out

    out = asyncio.run(run())
    assert batches == [2, 1, 1]  # the two calls of one split together; the other split and the rows apart
    want = [expanded_logits(s, [r]) for r in a + b]
    with torch.no_grad():
        enc = s.encoder.encode_rows(rows)
        want.append(s.model(enc.dense, enc.sparse).numpy())
    for (version, probs), z in zip(out, want):
        assert version == "v"
        np.testing.assert_allclose(probs, 1 / (1 + np.exp(-z)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision,bound", [("bf16", 0.05), ("int8", 0.1)])
def test_dense_precisions_stay_near_the_float64_model(precision, bound):
    s = served(True, seed=3)
    rng = np.random.default_rng(4)
    reqs = [request(rng, SPLITS["dense and C1-C3 in the context"], n) for n in (8, 8)]
    rows = [{**ctx, **c} for ctx, cands in reqs for c in cands]
    enc = s.encoder.encode_rows(rows)
    ref_model = copy.deepcopy(s.model).double()
    with torch.no_grad():
        ref = ref_model(enc.dense.double(), enc.sparse).numpy()
    s.set_dense(precision)
    plain = s.logits(enc).numpy()
    with s.autocast():
        ranked = rank_logits(s.model, s.encoder, [encode_ranking(s.encoder, *r) for r in reqs]).numpy()
    scale = np.abs(ref).max()
    for got in (plain, ranked):
        assert np.abs(got - ref).max() <= bound * max(scale, 1.0)
        assert np.abs(got - ref).max() > 0  # it did run in the lower precision


def test_another_model_scores_the_expanded_rows():
    """A DCN is not scored per context: its ranking call is encoded as the expanded rows, with the same scores as
    those rows sent as such."""
    from embedscale.serve.server import _Candidates, _encode, score

    s = served(False)
    specs = [TableSpec(f"t_{f}", n, 8, [f]) for f, n in zip(SPARSE, ROWS)]
    torch.manual_seed(0)
    s.model = build_model(ModelConfig(arch="dcn", embedding_dim=8, bottom_mlp=[16], top_mlp=[16], cross_layers=1),
                          specs, len(DENSE)).eval()
    assert not ranks_by_context(s.model)
    ctx, cands = request(np.random.default_rng(3), SPLITS["dense and C1-C3 in the context"], 6)
    call = _Candidates(cands)
    call.context = ctx
    enc = _encode(s, call)
    assert not hasattr(enc, "context_features")
    np.testing.assert_allclose(score(s, [enc]).numpy(), expanded_logits(s, [(ctx, cands)]), rtol=1e-6, atol=1e-6)
