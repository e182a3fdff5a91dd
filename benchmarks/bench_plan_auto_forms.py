"""Each table form's step cost measured directly against the auto planner's cost model, in and out of sample.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/bench_plan_auto_forms.py --work /tmp/bench_auto_full \\
        [--tables C3,C4,C12,C16,C21,C24] [--repeats 9]

A diagnosis of the per-table terms of ``plan.auto``'s model, one process, one thread (what each of
``embedscale train --nproc 2``'s ranks runs with here). For every table of ``--tables`` of the full-size profile in
``--work`` (``bench_plan_auto_full.py`` makes it), in one interleaved set of blocks (median of ``--repeats``; all
steps see the same load, which on a shared machine moves 5x within minutes):

* the calibration's own steps (``embedscale calibrate``'s: a 1M-row Zipf 1.1 table exact and TT of ranks 8, 16,
  32, row groups against TT on it, and the rank-8 TT step on a 16M-row table for ``Costs.tt_size_slope``): the
  costs fitted from them are *in sample*;
* the table in every form, on rank batches drawn from its own profile counts (``--batch`` one-hot lookups): exact
  (``LocalEmbeddingBags``), TT of ranks 8, 16, 32 (``TTEmbeddingBag``) and row groups (``HybridTTEmbeddingBag``
  rank 8 with the rows a global batch of 2 ranks reads at least once exact, the ids frequency-ordered as the plan
  reorders them): its size and distribution are not the calibration's, *out of sample*.

The model's per-table seconds of each (``L exact``, ``L tt(R, N)``, the row groups' ``a L exact + (1-d) L tt(R, N)
+ overhead``; no exchange: one process) are compared with the measurement, with the size term and without it (the
baseline: the model before it). Prints one JSON line: figure = the largest absolute error with the size term,
baseline = without it.
"""

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from _plan_common import emit, log
from embedscale.calibrate import SIZE_RATIO, _half_lookup_rows, _interleaved_blocks, _zipf_ids
from embedscale.plan.auto import Costs
from embedscale.data.batch import JaggedFeatures
from embedscale.data.profile import AccessProfile
from embedscale.embedding.hybrid import HybridTTEmbeddingBag
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.embedding.tt import TTEmbeddingBag
from embedscale.plan.auto import table_stats
from embedscale.plan.forms import tables_from_profile
from embedscale.specs import TableSpec

RANKS = (8, 16, 32)


def _batches(counts: np.ndarray, batch: int, n: int, rng) -> tuple[list, list]:
    """``n`` batches of ``batch`` ids drawn by the profile's counts, as the table's ids and frequency-ordered."""
    p = counts.astype(np.float64) / counts.sum()
    ids = [rng.choice(len(p), size=batch, p=p) for _ in range(n)]
    rank_of = np.empty(len(p), dtype=np.int64)
    rank_of[np.argsort(-counts, kind="stable")] = np.arange(len(p))
    return [torch.from_numpy(b) for b in ids], [torch.from_numpy(rank_of[b]) for b in ids]


def _steps(t, counts, batch, rng, hot: int) -> dict:
    ids, freq = _batches(counts, batch, 6, rng)
    off = torch.arange(batch)
    jfs = [JaggedFeatures.from_dense(["t"], b.view(-1, 1)) for b in ids]
    ex = LocalEmbeddingBags([TableSpec("t", t.num_rows, t.dim)], optimizer="rowwise_adagrad", lr=0.01, seed=0,
                            validate=False)
    out = {"exact": ((lambda m: lambda jf: m(jf).sum().backward())(ex), jfs)}
    for r in RANKS:
        m = TTEmbeddingBag(t.num_rows, t.dim, r, optimizer="rowwise_adagrad", lr=0.01, seed=0, name="t",
                           validate=False)
        out[f"tt-{r}"] = ((lambda m: lambda b: m(b, off).sum().backward())(m), ids)
    if hot:
        m = HybridTTEmbeddingBag(t.num_rows, t.dim, RANKS[0], hot_rows=int(hot), optimizer="rowwise_adagrad", lr=0.01,
                                 tt_optimizer="rowwise_adagrad", tt_lr=0.01, seed=0, name="t", validate=False)
        out[f"tt-{RANKS[0]}-hot{hot}"] = ((lambda m: lambda b: m(b, off).sum().backward())(m), freq)
    return out


def _model(s, form: str, costs) -> float:
    """The model's single-process seconds of table ``s`` in ``form`` (no exchange term: one process)."""
    if form == "exact":
        return s.lookups_rank * costs.exact_lookup_s
    parts = form.split("-")
    r = int(parts[1])
    if len(parts) == 2:
        return s.lookups_rank * costs.tt(r, s.num_rows)
    h = int(parts[2][3:])
    a = s.share_of_rows(h)
    d = min(1.0, s.distinct_of_rows(h) / max(s.distinct_rank, 1e-12))
    return s.lookups_rank * (a * costs.exact_lookup_s + (1 - d) * costs.tt(r, s.num_rows)) + costs.row_group_overhead_s


def _reference_steps(batch: int, rng, rows: int = 1_000_000, alpha: float = 1.1) -> dict:
    """The calibration's steps (``embedscale calibrate``'s, ``--rows 1000000``): exact, TT of every rank, TT at
    16x the rows, row groups and their TT twin on frequency-ordered ids."""
    off = torch.arange(batch)
    ids = [torch.from_numpy(_zipf_ids(rng, rows, batch, alpha)) for _ in range(4)]
    freq = [torch.from_numpy(_zipf_ids(rng, rows, batch, alpha, permute=False)) for _ in range(4)]
    big = [torch.from_numpy(_zipf_ids(rng, rows * SIZE_RATIO, batch, alpha)) for _ in range(4)]
    ex = LocalEmbeddingBags([TableSpec("t", rows, 16)], optimizer="rowwise_adagrad", lr=0.01, seed=0, validate=False)
    jfs = [JaggedFeatures.from_dense(["t"], b.view(-1, 1)) for b in ids]
    step = lambda m: lambda b: m(b, off).sum().backward()  # noqa: E731
    tt = lambda n, r: TTEmbeddingBag(n, 16, r, optimizer="rowwise_adagrad", lr=0.01, seed=0, name="t",  # noqa: E731
                                     validate=False)
    out = {"ref-exact": ((lambda jf: ex(jf).sum().backward()), jfs)}
    out.update({f"ref-tt-{r}": (step(tt(rows, r)), ids) for r in RANKS})
    out["ref-tt-big"] = (step(tt(rows * SIZE_RATIO, RANKS[0])), big)
    out["ref-rg-tt"] = (step(tt(rows, RANKS[0])), freq)
    rg = HybridTTEmbeddingBag(rows, 16, RANKS[0], hot_rows=_half_lookup_rows(rows, alpha), optimizer="rowwise_adagrad",
                              lr=0.01, tt_optimizer="rowwise_adagrad", tt_lr=0.01, seed=0, name="t", validate=False)
    out["ref-rg"] = (step(rg), freq)
    return out


def _fit(t: dict, batch: int, rows: int = 1_000_000) -> Costs:
    """The costs ``embedscale calibrate`` fits from its steps' seconds ``t`` (the per-table terms only)."""
    return Costs(exact_lookup_s=t["ref-exact"] / batch, tt_lookup_s={r: t[f"ref-tt-{r}"] / batch for r in RANKS},
                 tt_rows=rows, tt_size_slope=(t["ref-tt-big"] / t[f"ref-tt-{RANKS[0]}"] - 1) / np.log2(SIZE_RATIO),
                 row_group_overhead_s=max(0.0, t["ref-rg"] - t["ref-rg-tt"]), source="measured")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/bench_auto_full")
    ap.add_argument("--tables", default="C3,C4,C12,C16,C21,C24")
    ap.add_argument("--batch", type=int, default=1024, help="Lookups per rank batch (one-hot).")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    ref = _reference_steps(args.batch, np.random.default_rng(1))
    prof = AccessProfile.load(Path(args.work) / "profile")
    samples = prof.samples() if callable(getattr(prof, "samples", None)) else prof.samples
    tables = {t.features[0]: t for t in tables_from_profile(prof, 16)}
    rng = np.random.default_rng(0)
    rows, worst, worst_plain, fitted = [], 0.0, 0.0, []
    for name in args.tables.split(","):
        t = tables[name]
        counts = np.asarray(prof.counts(name))
        s = table_stats(t, counts, samples, args.batch, 2)
        hot = s.rows_read_at_least(1.0, 2)
        measured = _interleaved_blocks({**ref, **_steps(t, counts, args.batch, rng, hot)}, args.repeats)
        costs = _fit(measured, args.batch)
        plain = replace(costs, tt_rows=0, tt_size_slope=0.0)
        log(f"{name}: calibration in the same blocks: exact {costs.exact_lookup_s * 1e9:.0f} ns, tt "
            + ", ".join(f"{r}: {v * 1e9:.0f} ns" for r, v in costs.tt_lookup_s.items())
            + f", size slope {costs.tt_size_slope:+.3f} per doubling; load {os.getloadavg()[0]:.1f}")
        fitted.append({"table": name, **costs.to_dict()})
        for form, m in measured.items():
            if form.startswith("ref-"):
                continue
            p, q = _model(s, form, costs), _model(s, form, plain)
            rows.append({"table": name, "rows": t.num_rows, "form": form, "measured_s": m, "predicted_s": p,
                         "error": p / m - 1, "predicted_without_size_s": q, "error_without_size": q / m - 1})
            worst, worst_plain = max(worst, abs(p / m - 1)), max(worst_plain, abs(q / m - 1))
            log(f"{name} ({t.num_rows:,} rows) {form}: measured {m * 1e3:.3f} ms, predicted {p * 1e3:.3f} ms "
                f"({p / m - 1:+.1%}; without the size term {q / m - 1:+.1%})")
    by_form = {}
    for r in rows:
        k = r["form"].split("-hot")[0] + ("-hot" if "-hot" in r["form"] else "")
        by_form.setdefault(k, []).append(r["error"])
    emit("plan_auto_forms_single_process", worst, worst_plain,
         "largest absolute relative error of the per-table model, out of sample (real full-size tables)",
         {"tables": args.tables, "batch": args.batch, "repeats": args.repeats, "threads": 1,
          "calibration": "1M-row Zipf 1.1 table (16M rows for the size slope), in the same interleaved blocks",
          "statistic": "median of blocks"},
         per_table=rows, error_by_form={k: [min(v), max(v)] for k, v in by_form.items()},
         costs_per_table=fitted, load_average_before=load0, load_average_after=os.getloadavg(),
         seconds=time.perf_counter() - t0)


if __name__ == "__main__":
    main()
