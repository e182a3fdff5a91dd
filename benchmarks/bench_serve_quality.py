"""Served quality: eval AUC of a model exported with INT8 and INT4 tables against its FP32 export.

A DLRM (the library's defaults: dim 16, bottom MLP 512-256-64, top 512-256) is trained by ``embedscale train``'s
own path (``workflow.run_main``, one process) on synthetic criteo-kaggle data at full cardinality (26 tables,
33.8M rows; ``--max-rows`` caps them), ``--train`` samples, one pass, then exported three times
(``embedscale export --quantize fp32|int8|int4``, the checkpoint of the best evaluation) and each export is
loaded as ``embedscale serve`` loads it (``load_export``: the fused quantized lookup) and scores the run's eval
split (``--eval`` samples, drawn after the training ones). The figure is each form's AUC difference from FP32
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
from embedscale.serve.predict import load_export  # noqa: E402
from embedscale.specs import RunConfig, from_dict  # noqa: E402
from embedscale.workflow import run_main  # noqa: E402


def served_auc(export_dir: Path, batches: list) -> tuple[float, float]:
    """(AUC, logloss) of the eval batches scored by the export loaded as the server loads it."""
    served = load_export(export_dir, shared=True)
    z, y = [], []
    with torch.no_grad():
        for dense, sparse, labels in batches:
            z.append(served.model(dense, sparse).double().numpy())
            y.append(labels)
    m = binary_metrics(np.concatenate(y), np.concatenate(z))
    return float(m["auc"]), float(m["logloss"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=400_000, help="training samples (one pass)")
    ap.add_argument("--eval", type=int, default=100_000, help="eval samples")
    ap.add_argument("--max-rows", type=int, default=0, help="cap every table's rows (0: full size, 33.8M rows)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--work", default="", help="working directory (default: a temporary one, removed after)")
    args = ap.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.work or None) as tmp:
        root = Path(tmp)
        cfg = from_dict(RunConfig, {
            "out_dir": str(root / "runs"),
            "data": {"source": "synthetic", "train_samples": args.train, "eval_samples": args.eval,
                     "synthetic": {"preset": "criteo-kaggle", "max_rows": args.max_rows}},
            "train": {"batch_size": args.batch, "epochs": 1, "eval_every": 0}})
        t0 = time.monotonic()
        run_main(cfg, progress=False)
        train_s = time.monotonic() - t0
        (run_dir,) = [p.parent for p in (root / "runs").glob("*/checkpoints")]
        prepared = prepare_data(cfg, progress=False)
        batches = eval_batches(prepared.eval.directory, prepared.eval.start, prepared.eval.stop, args.eval)
        forms = {}
        for form in ("fp32", "int8", "int4"):
            m = export(run_dir, root / form, form)
            auc, logloss = served_auc(root / form, batches)
            forms[form] = {"auc": auc, "logloss": logloss, "table_bytes": m["table_bytes"]}
            print(f"{form}: AUC {auc:.6f} logloss {logloss:.6f} table bytes {m['table_bytes']:,}", file=sys.stderr)
            if form != "fp32":
                (root / form / "weights.safetensors").unlink()  # disk: one export at a time beside FP32
    ref = forms["fp32"]
    for form, bar in (("int8", 0.001), ("int4", 0.003)):
        f = forms[form]
        print(json.dumps({"figure": f"served_auc_delta_{form}_vs_fp32", "value": f["auc"] - ref["auc"],
                          "baseline": "the same model's FP32 export, same eval rows", "baseline_value": ref["auc"],
                          "auc": f["auc"], "bar": bar, "met": abs(f["auc"] - ref["auc"]) <= bar,
                          "table_bytes_ratio": f["table_bytes"] / ref["table_bytes"], "forms": forms,
                          "train_seconds": train_s, "load": {"start": load0, "end": os.getloadavg()},
                          "config": vars(args)}))


if __name__ == "__main__":
    main()
