"""``--quantize auto``: each table at the narrowest served form the model's eval AUC allows.

The eval split is scored with every table at FP32 (the reference AUC), then the tables are narrowed one at a
time, largest first: each takes the first of INT4, INT8, FP16 at which the model's AUC, with every table
decided so far in its chosen form, stays within ``tolerance`` of the reference; a table where none does stays
FP32. So the drop of the whole export, not of each table alone, is bounded by the tolerance. A table byte
``budget`` (if given) is met afterwards by narrowing the largest tables that are still wider than INT4, whatever
the AUC (the report says what it cost); a budget that even all-INT4 tables exceed is an error.

Scoring uses the served lookup itself (:class:`~embedscale.serve.predict.ServedEmbedding` over shared tables:
every table through the fused quantized kernel), so the AUC measured is the AUC served. At most ``samples``
eval rows are scored (the first ones of the split).
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from embedscale.data.loader import ShardLoader
from embedscale.data.metrics import binary_metrics
from embedscale.errors import ConfigError
from embedscale.models import build_model
from embedscale.serve.predict import ServedEmbedding
from embedscale.serve.quantize import quantize_rows, row_bytes
from embedscale.specs import ModelConfig, TableSpec

NARROWEST_FIRST = ("int4", "int8", "fp16")


class Scorer:
    """The served model over in-memory tables whose forms can be swapped, scoring fixed eval batches."""

    def __init__(self, model_cfg: dict, specs: list[TableSpec], num_dense: int, dense_state: dict,
                 weights: dict[str, torch.Tensor], batches: list, tt_tables: list[dict] = (),
                 tt_tensors: dict | None = None):
        """``specs``: every table in the trained model's order (the dense model's columns follow it); those
        named in ``tt_tables`` are served as cores, the others start at FP32 from ``weights``."""
        self.weights = weights
        tt = {t["name"]: t for t in tt_tables}
        tables = [tt.get(t.name) or {"name": t.name, "features": list(t.features), "num_rows": t.num_rows,
                                     "dim": t.dim, "pooling": t.pooling, "form": "fp32"} for t in specs]
        self.emb = ServedEmbedding(tables, {n: w.contiguous() for n, w in weights.items()}, shared=True,
                                   tt=tt_tensors)
        torch.manual_seed(0)
        self.model = build_model(ModelConfig(**model_cfg), specs, num_dense, embedding=self.emb)
        self.model.load_state_dict(dense_state, strict=False)
        self.model.eval()
        self.batches = batches

    def set_form(self, name: str, form: str) -> None:
        self.emb.set_table(name, quantize_rows(self.weights[name], form), form)

    def auc(self) -> float:
        z, y = [], []
        with torch.no_grad():
            for dense, sparse, labels in self.batches:
                z.append(self.model(dense, sparse).double().numpy())
                y.append(labels)
        return float(binary_metrics(np.concatenate(y), np.concatenate(z))["auc"])


def eval_batches(directory, start: int, stop: int, samples: int, batch_size: int = 4096) -> list:
    """Up to ``samples`` rows of an eval split as ``(dense, sparse, labels)`` batches, read once."""
    out, n = [], 0
    for b in ShardLoader(directory, batch_size, start=start, stop=min(stop, start + samples)):
        out.append((b.dense, b.sparse, b.labels.double().numpy()))
        n += len(b.labels)
    if not n:
        raise ConfigError(f"{directory}: --quantize auto needs eval rows to measure AUC; the eval split is empty")
    return out


def choose_forms(scorer: Scorer, specs: list[TableSpec], tolerance: float, budget: int | None = None,
                 progress: bool = True) -> tuple[dict[str, str], dict]:
    """``({table: form}, report)``: the greedy narrowing of the module docstring over the row tables ``specs``
    (TT tables keep their cores)."""
    reference = scorer.auc()
    forms = {t.name: "fp32" for t in specs}
    trials = []
    order = sorted(specs, key=lambda t: -t.num_rows * t.dim)
    for t in tqdm(order, desc="quantize auto", unit="table", disable=not progress):
        for form in NARROWEST_FIRST:
            scorer.set_form(t.name, form)
            auc = scorer.auc()
            trials.append({"table": t.name, "form": form, "auc": auc})
            if reference - auc <= tolerance:
                forms[t.name] = form
                break
        else:
            scorer.set_form(t.name, "fp32")
    forced = _meet_budget(scorer, order, forms, budget)
    return forms, {"tolerance": tolerance, "reference_auc": reference, "auc": scorer.auc(), "budget": budget,
                   "table_bytes": table_bytes(specs, forms), "forced_by_budget": forced, "trials": trials,
                   "eval_samples": int(sum(len(b[2]) for b in scorer.batches))}


def table_bytes(specs: list[TableSpec], forms: dict[str, str]) -> int:
    return int(sum(t.num_rows * row_bytes(forms[t.name], t.dim) for t in specs))


def _meet_budget(scorer: Scorer, order: list[TableSpec], forms: dict[str, str], budget: int | None) -> list[str]:
    """Narrow the largest tables still wider than INT4 until the table bytes fit ``budget``; the tables
    narrowed this way (the AUC no longer bounds them)."""
    if budget is None or table_bytes(order, forms) <= budget:
        return []
    smallest = table_bytes(order, {t.name: "int4" for t in order})
    if smallest > budget:
        raise ConfigError(f"--table-budget {budget:,} bytes: the tables take {smallest:,} bytes even all at INT4")
    forced = []
    for t in order:
        if table_bytes(order, forms) <= budget:
            break
        if forms[t.name] != "int4":
            forms[t.name] = "int4"
            scorer.set_form(t.name, "int4")
            forced.append(t.name)
    return forced


__all__ = ["NARROWEST_FIRST", "Scorer", "choose_forms", "eval_batches", "table_bytes"]
