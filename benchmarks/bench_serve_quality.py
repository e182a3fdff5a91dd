"""Served quality: eval AUC of a model exported with INT8 and INT4 tables against its FP32 export.

A DLRM (the library's defaults: dim 16, bottom MLP 512-256-64, top 512-256) is trained by ``embedscale train``'s
own path (``workflow.run_main``, one process) on synthetic criteo-kaggle data at full cardinality (26 tables,
33.8M rows; ``--max-rows`` caps them), ``--train`` samples, one pass, then exported three times
(``embedscale export --quantize fp32|int8|int4``, the checkpoint of the best evaluation) and each export is
loaded as ``embedscale serve`` loads it (``load_export``: the fused quantized lookup) and scores the run's eval
split (``--eval`` samples, drawn after the training ones). The real rows (``--data real``): the first 8,000 of
the Criteo sample trained (vocabulary mode, min frequency 2, 2 epochs), each export scored by ``embedscale
predict`` on the last 2,000. The figure is each form's AUC difference from FP32
(the bars: INT8 within 0.001, INT4 within 0.003) and the table bytes over FP32's (0.31x / 0.19x at dim 16).
Quality figures do not depend on machine load; the load is printed beside them all the same.

    .venv/bin/python benchmarks/bench_serve_quality.py [--train 400000] [--eval 100000] [--max-rows 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from embedscale.assemble import prepare_data  # noqa: E402
from embedscale.data.metrics import binary_metrics  # noqa: E402
from embedscale.serve.auto_quantize import eval_batches  # noqa: E402
from embedscale.serve.export import export  # noqa: E402
from embedscale.serve.predict import load_export, predict_file  # noqa: E402
from embedscale.specs import RunConfig, from_dict  # noqa: E402
from embedscale.workflow import run_main  # noqa: E402


def served_auc(export_dir: Path, batches: list, dense_precision: str = "fp32") -> tuple[float, float]:
    """(AUC, logloss) of the eval batches scored by the export loaded as the server loads it."""
    served = load_export(export_dir, shared=True)
    served.set_dense(dense_precision)
    z, y = [], []
    with torch.no_grad(), served.autocast():
        for dense, sparse, labels in batches:
            z.append(served.model(dense, sparse).double().numpy())
            y.append(labels)
    m = binary_metrics(np.concatenate(y), np.concatenate(z))
    return float(m["auc"]), float(m["logloss"])


REAL = ROOT.parent / "shared" / "data" / "criteo_kaggle_head10k.tsv"


def forms_on_synthetic(args, root: Path) -> dict:
    """Train on full-size synthetic criteo-kaggle, export each form, score the run's eval split."""
    cfg = from_dict(RunConfig, {
        "out_dir": str(root / "runs"),
        "data": {"source": "synthetic", "train_samples": args.train, "eval_samples": args.eval,
                 "synthetic": {"preset": "criteo-kaggle", "max_rows": args.max_rows}},
        "train": {"batch_size": args.batch, "epochs": 1, "eval_every": 0}})
    run_main(cfg, progress=False)
    (run_dir,) = [p.parent for p in (root / "runs").glob("*/checkpoints")]
    prepared = prepare_data(cfg, progress=False)
    batches = eval_batches(prepared.eval.directory, prepared.eval.start, prepared.eval.stop, args.eval)
    return each_form(run_dir, root, lambda d, dense="fp32": served_auc(d, batches, dense))


def forms_on_real(root: Path, real: Path) -> dict:
    """The real Criteo rows: rows 0-8k trained (vocabulary, min frequency 2, 2 epochs, the defaults
    otherwise), each form's export scored by ``predict`` on rows 8k-10k (never trained on)."""
    lines = real.read_text().splitlines(keepends=True)
    (root / "train.tsv").write_text("".join(lines[:8000]))
    (root / "eval.tsv").write_text("".join(lines[8000:10000]))
    cfg = from_dict(RunConfig, {
        "out_dir": str(root / "runs"),
        "data": {"source": "criteo", "path": str(root / "train.tsv"), "categorical": "vocab", "min_frequency": 2},
        "train": {"epochs": 2}})
    run_main(cfg, progress=False)
    (run_dir,) = [p.parent for p in (root / "runs").glob("*/checkpoints")]

    def score(d: Path, dense: str = "fp32") -> tuple[float, float]:
        r = predict_file(d, root / "eval.tsv", root / "p.parquet", dense=dense)
        return float(r["auc"]), float(r["logloss"])

    return each_form(run_dir, root, score)


def each_form(run_dir: Path, root: Path, score) -> dict:
    forms = {}
    for form in ("fp32", "int8", "int4"):
        m = export(run_dir, root / form, form)
        auc, logloss = score(root / form)
        forms[form] = {"auc": auc, "logloss": logloss, "table_bytes": m["table_bytes"]}
        print(f"{form}: AUC {auc:.6f} logloss {logloss:.6f} table bytes {m['table_bytes']:,}", file=sys.stderr)
        for dense in ("bf16", "int8") if form == "int8" else ():  # the served dense precisions (serve --dense)
            auc, logloss = score(root / form, dense)
            forms[f"int8+dense-{dense}"] = {"auc": auc, "logloss": logloss, "table_bytes": m["table_bytes"]}
            print(f"int8 tables, dense {dense}: AUC {auc:.6f} logloss {logloss:.6f}", file=sys.stderr)
        if form != "fp32":
            (root / form / "weights.safetensors").unlink()  # disk: one export at a time beside FP32
    return forms


def report(data: str, forms: dict, args, load0, seconds: float) -> None:
    ref = forms["fp32"]
    for form, bar in (("int8", 0.001), ("int4", 0.003), ("int8+dense-bf16", 0.001), ("int8+dense-int8", 0.001)):
        f = forms[form]
        print(json.dumps({"figure": f"served_auc_delta_{form}_vs_fp32", "data": data, "value": f["auc"] - ref["auc"],
                          "baseline": "the same model's FP32 export, same eval rows", "baseline_value": ref["auc"],
                          "auc": f["auc"], "bar": bar, "met": abs(f["auc"] - ref["auc"]) <= bar,
                          "table_bytes_ratio": f["table_bytes"] / ref["table_bytes"], "forms": forms,
                          "seconds": seconds, "load": {"start": load0, "end": os.getloadavg()},
                          "config": vars(args)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=400_000, help="training samples (one pass)")
    ap.add_argument("--eval", type=int, default=100_000, help="eval samples")
    ap.add_argument("--max-rows", type=int, default=0, help="cap every table's rows (0: full size, 33.8M rows)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--data", choices=("synthetic", "real", "both"), default="both",
                    help=f"real: the first 10k rows of Criteo ({REAL}; skipped with a message when absent)")
    ap.add_argument("--work", default="", help="working directory (default: a temporary one, removed after)")
    args = ap.parse_args()
    for data in ("real", "synthetic") if args.data == "both" else (args.data,):
        if data == "real" and not REAL.is_file():
            print(f"{REAL}: not found; the real rows are not measured", file=sys.stderr)
            continue
        load0, t0 = os.getloadavg(), time.monotonic()
        with tempfile.TemporaryDirectory(dir=args.work or None) as tmp:
            forms = forms_on_real(Path(tmp), REAL) if data == "real" else forms_on_synthetic(args, Path(tmp))
        report(data, forms, args, load0, time.monotonic() - t0)


if __name__ == "__main__":
    main()
