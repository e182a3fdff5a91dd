"""Quality on the real Criteo rows: DLRM and DCN at the library's defaults vs a hashed one-hot logistic
regression.

The split is the issue's: the first 8,000 rows of ``criteo_kaggle_head10k.tsv`` train, the last 2,000
evaluate (file order; ``data.eval_fraction: 0.2``). Both models train with ``embedscale``'s defaults
(``TrainConfig``/``ModelConfig``: early stopping on the eval AUC, the best checkpoint kept); the only
settings given are the data (``data.source: criteo``, the path), ``data.table_rows: 20000`` (hash buckets
per table; until table sizes come from the data, the 1M-row default would write a 1.4 GB checkpoint at every
improvement for 8,000 rows) and ``train.epochs: 10`` (an upper bound: early stopping ends the run, and
``checkpoints/best`` is the model scored). The baseline, fitted in the same run on the same split and the same hashed ids, is
scikit-learn's ``LogisticRegression`` (default ``C=1``, lbfgs) on the one-hot encoding of the 26 hashed
categorical ids plus the 13 ``log1p`` dense features standardised on the training rows. Every figure
(AUC, normalised entropy, calibration) of all three comes from ``embedscale.data.metrics`` on the
predictions; the models' eval figures are those of the checkpoint ``best`` points to.

    .venv/bin/python benchmarks/bench_quality.py                   # DLRM, DCN, LR
    .venv/bin/python benchmarks/bench_quality.py --set train.lr_dense=0.02 --seeds 0 1 2

Prints one JSON line on stdout (figure: the worse of the two models' eval AUC, baseline: the LR's);
progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from embedscale.data.metrics import calibration, logloss, normalized_entropy, roc_auc
from embedscale.data.shards import iter_shards
from embedscale.specs import load_config
from embedscale.workflow import prepare_data, train

DATA = Path(__file__).resolve().parents[2] / "shared/data/criteo_kaggle_head10k.tsv"


def parse_sets(items: list[str]) -> dict:
    out = {}
    for s in items:
        k, _, v = s.partition("=")
        out[k] = yaml.safe_load(v)
    return out


def columns(split):
    """Labels, dense and the one categorical id per feature of ``split``'s rows."""
    ys, ds, ss = [], [], []
    for c in iter_shards(split.directory):
        ys.append(c.labels)
        ds.append(c.dense)
        ss.append(np.stack([c.sparse[k][0] for k in sorted(c.sparse, key=lambda n: int(n[1:]))], 1))
    y, d, s = np.concatenate(ys), np.concatenate(ds), np.concatenate(ss)
    return y[split.start:split.stop], d[split.start:split.stop], s[split.start:split.stop]


def logistic_regression(data) -> dict:
    """scikit-learn LogisticRegression (defaults) on one-hot hashed ids + standardised log1p dense."""
    from scipy import sparse as sp
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder

    ytr, dtr, str_ = columns(data.train)
    yev, dev, sev = columns(data.eval)
    enc = OneHotEncoder(handle_unknown="ignore")
    mu, sd = dtr.mean(0), dtr.std(0) + 1e-6
    xtr = sp.hstack([enc.fit_transform(str_), sp.csr_matrix((dtr - mu) / sd)]).tocsr()
    xev = sp.hstack([enc.transform(sev), sp.csr_matrix((dev - mu) / sd)]).tocsr()
    t0 = time.perf_counter()
    lr = LogisticRegression(max_iter=1000).fit(xtr, ytr)
    p = lr.predict_proba(xev)[:, 1]
    return {**figures(yev, p), "seconds": time.perf_counter() - t0}


def figures(y, p) -> dict:
    return {"auc": roc_auc(y, p), "ne": normalized_entropy(y, p), "logloss": logloss(y, p),
            "calibration": calibration(y, p)}


def run_model(arch: str, sets: dict, seed: int, root: Path) -> dict:
    over = {"data.source": "criteo", "data.path": str(DATA), "data.eval_fraction": 0.2, "data.table_rows": 20000,
            "model.arch": arch, "train.seed": seed, "train.epochs": 10, "out_dir": str(root), **sets}
    cfg = load_config(None, over)
    t0 = time.perf_counter()
    s = train(cfg, root / f"{arch}-{seed}", progress=False)
    best = s.get("best") or {}
    return {"auc": best.get("eval_auc", s["eval_auc"]), "ne": best.get("eval_ne", s.get("eval_ne")),
            "logloss": best.get("eval_logloss", s["eval_logloss"]),
            "calibration": best.get("eval_calibration", s.get("eval_calibration")),
            "best_step": best.get("step"), "last_auc": s["eval_auc"], "steps": s["steps"],
            "stopped_early": s.get("stopped_early"), "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--archs", nargs="+", default=["dlrm", "dcn"])
    args = ap.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} not found: the real Criteo rows are needed")
    sets = parse_sets(args.sets)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = load_config(None, {"data.source": "criteo", "data.path": str(DATA), "data.eval_fraction": 0.2,
                                  "data.table_rows": 20000, "out_dir": str(root), **sets})
        data = prepare_data(base, progress=False)
        res: dict = {"lr": [], **{a: [] for a in args.archs}}
        for seed in args.seeds:  # interleaved: every seed runs each model and the baseline
            res["lr"].append(logistic_regression(data))
            for a in args.archs:
                res[a].append(run_model(a, sets, seed, root))
                print(a, seed, json.dumps(res[a][-1]), file=sys.stderr)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("auc", "ne", "calibration", "logloss")}
           for k, v in res.items()}
    worst = min(med[a]["auc"] for a in args.archs)
    print(json.dumps({"figure": "eval AUC (median over seeds), worse of " + "/".join(args.archs), "value": worst,
                      "baseline": med["lr"]["auc"], "ratio": worst / med["lr"]["auc"], "median": med,
                      "runs": res, "load_avg": os.getloadavg(), "config": {"sets": sets, "seeds": args.seeds}}))


if __name__ == "__main__":
    main()
