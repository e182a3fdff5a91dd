"""DLRM and DCN at the library's defaults against a logistic regression, on public click logs.

What a new user gets: each log comes as a training file and a test file and goes through the README's path
with no tuning flag (``embedscale data ... --test TEST`` with its defaults, then ``embedscale train
--data-source shards --data-path DATASET``, here through the same Python API: ``workflow.train`` on
``load_config`` with only the data, the arch and the seed set, then ``embedscale evaluate RUN --split test``).
Training holds out the last ``data.eval_fraction`` (0.1) of the training file as its eval split: early
stopping and ``checkpoints/best`` see only that split; the figures are the test split's, scored by the best
checkpoint, which no decision of the training has seen. The baseline, fitted in the same run on the same
files (encoded by ``embedscale data --categorical vocab --min-frequency 1``: every distinct training value its
own column, whatever the models' encoding defaults), is scikit-learn's ``LogisticRegression`` at its defaults
(``C=1``, lbfgs; ``max_iter=1000``) on the one-hot encoding of every categorical feature plus the dense features
standardised on its training rows;
it needs no eval split, so it is fitted on the whole training file (the eval split's rows included: the form a
user would fit) and scored on the same test split (``baseline``); the same fit on the model's training split
alone is reported beside it (``baseline_same_rows``). AUC and logloss of all models from
``embedscale.data.metrics``; the seeds are interleaved (each seed runs every model, the baseline is
deterministic and fitted once per log).

The logs (none is in the repository; give their paths, a log whose files are absent is skipped with a
message):

- ``criteo``: the first 10,000 rows of the Criteo Kaggle Display Advertising Challenge log
  (``criteo_kaggle_head10k.tsv``; label, 13 integer and 26 categorical fields). The first 8,000 rows are the
  training file (7,200 train, the last 800 the eval split), the last 2,000 the test file.
- ``avazu``: 8,998 rows of the Avazu CTR log (Kaggle "Click-Through Rate Prediction", 21 categorical fields
  and the hour) as sampled in github.com/Lapis-Hong/Wide-ResDNN, ``data/avazu/train.csv`` (8,087 rows: the
  training file) and ``data/avazu/dev.csv`` + ``data/avazu/test.csv`` (911 rows: the test files; they have
  no header line, so this script gives copies of them the training file's). Read by the Avazu preset
  (``embedscale data avazu --train ... --test ... --test ...``).
- ``frappe``: the frappe app-usage log (Baltrunas et al. 2015, arXiv:1505.03014; 10 categorical context
  fields, 2 sampled negatives per positive) in libFM format as distributed with github.com/hexiangnan/
  neural_factorization_machine, ``data/frappe/frappe.validation.libfm`` (57,722 rows: the training file) and
  ``frappe.test.libfm`` (28,860 rows: the test file); no dense features. Every row lists one index per field
  in field order, so this script writes it as a CSV of one categorical column per field (``f0``..``f9``,
  label 0/1) and reads it with ``embedscale data table --label label --sparse f0,...,f9``: the libFM reader of
  ``embedscale data table --format libfm`` reads the field-aware ``label field:index:value`` form.
- ``ipinyou``: a sample of the iPinYou real-time-bidding log (Zhang et al. 2014, arXiv:1407.7073) as
  distributed with github.com/wnzhang/deep-ctr (the code of Zhang et al. 2016, "Deep Learning over
  Multi-field Categorical Data"),
  ``data/train.fm.txt`` (26,773 rows, 255 clicks: the training file) and ``data/test.fm.txt`` (21,150 rows,
  50 clicks: the test file); 16 categorical fields (weekday, hour, user agent, IP, region, city, ad
  exchange, domain, slot id/width/height/visibility/format, creative, advertiser, slot price), one
  ``index:1`` per field in field order, written and read as frappe's. Its 50 test clicks make its AUC
  noisy (a standard error of about 0.03).
- ``movielens``: MovieLens 100K (GroupLens; Harper and Konstan 2015, ACM TiiS 5(4); ``u.data``, ``u.user``,
  ``u.item`` in ``--movielens-dir``) as a click log the way AutoInt (Song et al. 2019, section 5.1.1) uses
  MovieLens-1M: a rating above 3 a click, below 3 none, 3 removed (72,855 rows left). Split by time as a click log
  is: the ratings sorted by timestamp, the first 80% the training file, the last 20% the test file
  (:func:`movielens_csv`). Written as a CSV with a header and read with ``embedscale data table --sparse
  user,item,age,gender,occupation,zip3,year,hour,weekday --multi-hot genres:|``: every field categorical (age
  the user's age in years, zip3 the first three characters of the zip code, year the item's release year,
  hour and weekday of the rating in UTC) and the item's genres a bag per row (multi-hot; the LR gets one 0/1
  column per training genre).

    .venv/bin/python benchmarks/bench_vs_logreg.py --criteo ../shared/data/criteo_kaggle_head10k.tsv \\
        --avazu-train avazu/train.csv --avazu-test avazu/dev.csv --avazu-test avazu/test.csv \\
        --frappe-train frappe.validation.libfm --frappe-test frappe.test.libfm \\
        --ipinyou-train deep-ctr/data/train.fm.txt --ipinyou-test deep-ctr/data/test.fm.txt \\
        --movielens-dir ../shared/data/ml-100k --seeds 0 1 2 --jobs 2

``--jobs N`` trains N models at a time (separate processes; the figures are AUC and logloss, never timings).
``--set`` and ``--data-flag`` leave the defaults, for exploring only; the bar is measured without them.

Prints one JSON line per log and model on stdout (figure: our median test AUC; baseline: the LR's; the
differences in AUC and logloss; the test split's AUC standard error (Hanley and McNeil 1982, eq. 2, at the LR's
AUC); every seed's figures, the eval split's too; load; config); progress on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from embedscale.data.metrics import logloss, roc_auc
from embedscale.assemble import split_existing
from embedscale.data.shards import Manifest, iter_shards
from embedscale.specs import load_config
from embedscale.workflow import train

ROOT = Path(__file__).resolve().parents[1]
# the baseline's encoding: every distinct training value its own column (a raw one-hot encoding), whatever the
# library's defaults for the models' tables are
ONE_HOT = ["--categorical", "vocab", "--min-frequency", "1"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def embedscale_cli(*args: str) -> None:
    """``embedscale ARGS`` as a user runs it (this interpreter, this checkout's package)."""
    cmd = [sys.executable, "-m", "embedscale", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def libfm_csv(src: Path, dst: Path) -> int:
    """A libFM file of one ``index:1`` per field in field order (frappe, the iPinYou sample) as
    ``label,f0,...`` CSV (label 0/1); returns the rows written."""
    rows = 0
    width = None
    with open(src) as f, open(dst, "w") as out:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            ids = [p.split(":")[0] for p in parts[1:]]
            if width is None:
                width = len(ids)
                out.write(",".join(["label"] + [f"f{i}" for i in range(width)]) + "\n")
            if len(ids) != width or any(p.split(":")[1] != "1" for p in parts[1:]):
                sys.exit(f"{src}:{n}: expected {width} one-hot fields, got {line.strip()!r}")
            out.write(",".join(["1" if float(parts[0]) > 0 else "0"] + ids) + "\n")
            rows += 1
    return rows


def with_header(path: str, like: str, tmp: Path) -> str:
    """``path``, or a copy of it under ``like``'s header line when its first line is not that header (the
    Wide-ResDNN dev and test files have none; the Avazu preset reads a header on every file)."""
    with open(like) as f:
        header = f.readline()
    with open(path) as f:
        first = f.readline()
        if first == header:
            return path
        with open(tmp, "w") as out:
            out.write(header + first)
            out.writelines(f)
    return str(tmp)


def split_file(src: str, train_rows: int, tmp: Path) -> tuple[str, str]:
    """The first ``train_rows`` lines of ``src`` as a training file, the rest as a test file (in ``tmp``)."""
    tr, te = tmp / ("train-" + Path(src).name), tmp / ("test-" + Path(src).name)
    with open(src) as f, open(tr, "w") as a, open(te, "w") as b:
        for n, line in enumerate(f):
            (a if n < train_rows else b).write(line)
    return str(tr), str(te)


def prepare(name: str, args, tmp: Path, flags: list[str], tag: str = "") -> Path | None:
    """The log ``name`` encoded by ``embedscale data`` with ``flags`` (a training file and ``--test`` files);
    None when its files are absent."""
    out = tmp / f"data-{name}{tag}"
    if name == "criteo":
        if not args.criteo or not Path(args.criteo).exists():
            log(f"criteo: skipped, {args.criteo or '--criteo'} not found")
            return None
        tr, te = split_file(args.criteo, args.criteo_train_rows, tmp)
        embedscale_cli("data", "criteo", tr, "--test", te, "--out", str(out), "--no-progress", *flags)
    elif name == "avazu":
        files = [args.avazu_train, *args.avazu_test]
        if not args.avazu_train or not args.avazu_test or not all(Path(p).exists() for p in files):
            log(f"avazu: skipped, files not found ({files})")
            return None
        tests = [a for i, p in enumerate(args.avazu_test) for a in ("--test", with_header(p, args.avazu_train,
                                                                                       tmp / f"avazu-test{i}.csv"))]
        embedscale_cli("data", "avazu", "--train", args.avazu_train, *tests, "--out", str(out), "--no-progress",
                       *flags)
    elif name == "movielens":
        d = Path(args.movielens_dir)
        if not all((d / f).exists() for f in ("u.data", "u.user", "u.item")):
            log(f"movielens: skipped, u.data, u.user and u.item not all found in {d} (--movielens-dir)")
            return None
        tr, te = movielens_csv(d, tmp)
        embedscale_cli("data", "table", "--train", str(tr), "--test", str(te), "--label", "label", "--sparse",
                       ",".join(MOVIELENS_FIELDS), "--multi-hot", "genres:|", "--out", str(out), "--no-progress",
                       *flags)
    elif name in ONE_HOT_FIELDS:
        files = [getattr(args, f"{name}_train"), getattr(args, f"{name}_test")]
        if not all(p and Path(p).exists() for p in files):
            log(f"{name}: skipped, files not found ({files})")
            return None
        return one_hot_log(name, *files, ONE_HOT_FIELDS[name], tmp, out, flags)
    return out


ONE_HOT_FIELDS = {"frappe": 10, "ipinyou": 16}  # libFM logs of one-hot fields: the fields of a row


def one_hot_log(name: str, train_file: str, test_file: str, fields: int, tmp: Path, out: Path,
                flags: list[str]) -> Path:
    """A libFM log of ``fields`` one-hot fields (:func:`libfm_csv`) encoded by ``embedscale data table``."""
    tr, te = tmp / f"{name}-train.csv", tmp / f"{name}-test.csv"
    libfm_csv(Path(train_file), tr)
    libfm_csv(Path(test_file), te)
    sparse = ",".join(f"f{i}" for i in range(fields))
    embedscale_cli("data", "table", "--train", str(tr), "--test", str(te), "--label", "label", "--sparse",
                   sparse, "--out", str(out), "--no-progress", *flags)
    return out


MOVIELENS_FIELDS = ["user", "item", "age", "gender", "occupation", "zip3", "year", "hour", "weekday"]
RATINGS = ("1", "2", "3", "4", "5")


def movielens_rows(d: Path) -> list[tuple[int, list[str]]]:
    """MovieLens 100K's ratings as click rows ``(timestamp, [label, *MOVIELENS_FIELDS, genres])`` in time order
    (ties in file order): a rating above 3 is a click, below 3 none, 3 is dropped (AutoInt, section 5.1.1)."""
    users = {}
    for line in (d / "u.user").read_text(encoding="latin-1").splitlines():
        uid, age, gender, occupation, zipcode = line.split("|")
        users[uid] = [age, gender, occupation, zipcode[:3]]
    genres = (d / "u.genre").read_text(encoding="latin-1").split() if (d / "u.genre").exists() else []
    genre_names = [g.rpartition("|")[0] for g in genres] or [str(i) for i in range(19)]
    items = {}
    for line in (d / "u.item").read_text(encoding="latin-1").splitlines():
        f = line.split("|")
        year = f[2][-4:] if f[2] else "unknown"
        items[f[0]] = [year, "|".join(g for g, flag in zip(genre_names, f[5:]) if flag == "1")]
    rows = []
    for n, line in enumerate((d / "u.data").read_text().splitlines(), 1):
        f = line.split("\t")
        if len(f) != 4 or f[0] not in users or f[1] not in items or f[2] not in RATINGS or not f[3].isdigit():
            sys.exit(f"{d / 'u.data'}:{n}: expected user, item (of u.user, u.item), rating 1-5, time; got {line!r}")
        uid, iid, rating, ts = f
        if rating == "3":
            continue
        t = datetime.datetime.fromtimestamp(int(ts), datetime.timezone.utc)
        year, bag = items[iid]
        rows.append((int(ts), ["1" if int(rating) > 3 else "0", uid, iid, *users[uid], year, str(t.hour),
                               str(t.weekday()), bag]))
    rows.sort(key=lambda r: r[0])  # stable: ties keep the file's order
    return rows


def movielens_csv(d: Path, tmp: Path, test_fraction: float = 0.2) -> tuple[Path, Path]:
    """The click rows of :func:`movielens_rows` as a training CSV (the first ``1 - test_fraction`` in time)
    and a test CSV (the rest), with a header."""
    rows = movielens_rows(d)
    cut = len(rows) - int(round(test_fraction * len(rows)))
    header = ",".join(["label", *MOVIELENS_FIELDS, "genres"]) + "\n"
    paths = tmp / "movielens-train.csv", tmp / "movielens-test.csv"
    for path, part in zip(paths, (rows[:cut], rows[cut:])):
        with open(path, "w") as out:
            out.write(header)
            out.writelines(",".join(r) + "\n" for _, r in part)
    log(f"movielens: {len(rows)} click rows ({sum(r[0] == '1' for _, r in rows)} clicks); training file {cut} "
        f"rows to {datetime.datetime.fromtimestamp(rows[cut - 1][0], datetime.timezone.utc):%Y-%m-%d}, "
        f"test file {len(rows) - cut}")
    return paths


def columns(split):
    """Labels, dense values, the one id per one-hot categorical feature, and the bags of the multi-hot ones
    (name -> (ids, lengths)) of a split's rows."""
    ys, ds, ss, bags = [], [], [], {}
    multi = {f.name for f in Manifest.load(split.directory).sparse if f.multi_hot}
    for c in iter_shards(split.directory):
        names = sorted(set(c.sparse) - multi)
        ys.append(c.labels)
        ds.append(c.dense)
        ss.append(np.stack([c.sparse[k][0] for k in names], 1))
        for k in sorted(multi):
            bags.setdefault(k, []).append(c.sparse[k])
    y, d, s = np.concatenate(ys), np.concatenate(ds), np.concatenate(ss)
    rows = slice(split.start, split.stop)
    cut = {}
    for k, parts in bags.items():
        ids, lengths = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        ends = np.concatenate([[0], np.cumsum(lengths)])
        cut[k] = (ids[ends[split.start]:ends[split.stop]], lengths[rows])
    return y[rows], d[rows], s[rows], cut


def _bag_columns(bags: list[dict], vocab: dict | None = None):
    """The multi-hot features of ``bags`` (one dict per part of rows) as 0/1 columns, one per id seen in the
    training rows (``vocab``: name -> sorted ids; built from ``bags`` when None); an unseen id has none."""
    from scipy import sparse as sp

    names = sorted(bags[0])
    if vocab is None:
        vocab = {k: np.unique(np.concatenate([b[k][0] for b in bags])) for k in names}
    mats = []
    for k in names:
        ids, lengths = np.concatenate([b[k][0] for b in bags]), np.concatenate([b[k][1] for b in bags])
        rows = np.repeat(np.arange(len(lengths)), lengths)
        col = np.searchsorted(vocab[k], ids).clip(max=len(vocab[k]) - 1)
        seen = vocab[k][col] == ids
        m = sp.csr_matrix((np.ones(seen.sum()), (rows[seen], col[seen])), shape=(len(lengths), len(vocab[k])))
        mats.append((m > 0).astype(np.float64))
    return mats, vocab


def _fit_lr(train_parts, test) -> dict:
    """scikit-learn ``LogisticRegression`` (defaults, ``max_iter=1000``) on one-hot ids + standardised dense,
    fitted on the rows of ``train_parts`` (split columns), scored on ``test``'s."""
    from scipy import sparse as sp
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder

    ytr, dtr, s_tr = (np.concatenate(c) for c in list(zip(*train_parts))[:3])
    yte, dte, s_te, bags_te = test
    enc = OneHotEncoder(handle_unknown="ignore")
    mu, sd = dtr.mean(0), dtr.std(0) + 1e-6
    bag_tr, vocab = _bag_columns([t[3] for t in train_parts]) if bags_te else ([], None)
    bag_te = _bag_columns([bags_te], vocab)[0] if bags_te else []
    xtr = sp.hstack([enc.fit_transform(s_tr), *bag_tr, sp.csr_matrix((dtr - mu) / sd)]).tocsr()
    xte = sp.hstack([enc.transform(s_te), *bag_te, sp.csr_matrix((dte - mu) / sd)]).tocsr()
    t0 = time.perf_counter()
    p = LogisticRegression(max_iter=1000).fit(xtr, ytr).predict_proba(xte)[:, 1]
    auc, clicks = roc_auc(yte, p), int(yte.sum())
    return {"auc": auc, "logloss": logloss(yte, p), "seconds": time.perf_counter() - t0,
            "train_rows": len(ytr), "test_rows": len(yte), "test_clicks": clicks,
            "test_auc_se": hanley_mcneil_se(auc, clicks, len(yte) - clicks)}


def hanley_mcneil_se(auc: float, pos: int, neg: int) -> float:
    """The standard error of an AUC from ``pos`` clicks and ``neg`` non-clicks (Hanley and McNeil 1982, eq. 2)."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (pos - 1) * (q1 - auc * auc) + (neg - 1) * (q2 - auc * auc)) / (pos * neg)
    return float(np.sqrt(max(var, 0.0)))


def logistic_regression(dataset: Path) -> tuple[dict, dict]:
    """The baseline on the test split: fitted on the whole training file (train and eval splits), and on the
    model's training split alone."""
    data = split_existing(dataset, load_config().data.eval_fraction)  # the splits training uses
    if data.test is None or data.eval is None:
        sys.exit(f"{dataset}: the bench needs a test split and an eval split")
    train, ev, test = columns(data.train), columns(data.eval), columns(data.test)
    return _fit_lr([train, ev], test), _fit_lr([train], test)


def evaluate_test(run_dir: Path) -> dict:
    """``embedscale evaluate RUN --split test --json``: the run's best checkpoint on the test split."""
    cmd = [sys.executable, "-m", "embedscale", "evaluate", str(run_dir), "--split", "test", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    m = json.loads(r.stdout.strip().splitlines()[-1])
    if m.get("chosen") != "best":
        sys.exit(f"{run_dir}: evaluate scored the {m.get('chosen')} checkpoint, not the best")
    return m


def run_model(dataset: Path, arch: str, seed: int, sets: dict, root: Path) -> dict:
    """``embedscale train --data-source shards --data-path DATASET`` (``--model-arch``, ``--train-seed``), then
    its best checkpoint on the test split."""
    over = {"data.source": "shards", "data.path": str(dataset), "model.arch": arch, "train.seed": seed,
            "out_dir": str(root), **sets}
    cfg = load_config(None, over)
    t0 = time.perf_counter()
    run_dir = root / f"{dataset.name}-{arch}-{seed}"
    s = train(cfg, run_dir, progress=False)
    best = s.get("best") or {}
    test = evaluate_test(run_dir)
    return {"auc": test["auc"], "logloss": test["logloss"], "calibration": test.get("calibration"),
            "eval_auc": best.get("eval_auc", s["eval_auc"]),
            "eval_logloss": best.get("eval_logloss", s["eval_logloss"]), "best_step": best.get("step"),
            "test_step": test["step"], "steps": s["steps"], "stopped_early": s.get("stopped_early"),
            "seconds": time.perf_counter() - t0}


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = yaml.safe_load(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--criteo", default=str(ROOT.parent / "shared/data/criteo_kaggle_head10k.tsv"))
    ap.add_argument("--avazu-train")
    ap.add_argument("--criteo-train-rows", type=int, default=8000, help="the Criteo rows of the training file")
    ap.add_argument("--avazu-test", action="append", default=[])
    ap.add_argument("--frappe-train")
    ap.add_argument("--frappe-test")
    ap.add_argument("--ipinyou-train")
    ap.add_argument("--ipinyou-test")
    ap.add_argument("--movielens-dir", default=str(ROOT.parent / "shared/data/ml-100k"),
                    help="MovieLens 100K's u.data, u.user, u.item (and u.genre)")
    ap.add_argument("--logs", nargs="+", default=["criteo", "avazu", "frappe", "ipinyou", "movielens"])
    ap.add_argument("--archs", nargs="+", default=["dlrm", "dcn"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1, help="model runs at a time (processes; figures are not timings)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override (not the defaults: for exploring only)")
    ap.add_argument("--data-flag", dest="data_flags", action="append", default=[], metavar="FLAG",
                    help="a flag for `embedscale data` (not the defaults: for exploring only)")
    ap.add_argument("--work", default=None, help="keep the datasets and runs in this (new) directory")
    args = ap.parse_args()
    sets = parse_sets(args.sets)
    with tempfile.TemporaryDirectory() as tmp:
        if args.work:
            Path(args.work).mkdir(parents=True)
        tmp = Path(args.work or tmp)
        for name in args.logs:
            dataset = prepare(name, args, tmp, args.data_flags)
            if dataset is None:
                continue
            lr, lr_same = logistic_regression(prepare(name, args, tmp, ONE_HOT, "-one-hot"))
            log(f"{name} lr {json.dumps(lr)} (on the model's training split alone: {json.dumps(lr_same)})")
            runs: dict = {a: [] for a in args.archs}
            jobs = [(a, seed) for seed in args.seeds for a in args.archs]  # interleaved: each seed runs every model
            with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs)) as pool:
                done = pool.map(run_model, *zip(*[(dataset, a, seed, sets, tmp / "runs") for a, seed in jobs]))
                for (a, seed), r in zip(jobs, done):
                    runs[a].append(r)
                    log(f"{name} {a} seed {seed} {json.dumps(r)}")
            for a in args.archs:
                auc = statistics.median(r["auc"] for r in runs[a])
                ll = statistics.median(r["logloss"] for r in runs[a])
                aucs = [r["auc"] for r in runs[a]]
                print(json.dumps({
                    "figure": f"{name}: {a} test AUC at the defaults (median of {len(args.seeds)} seeds)",
                    "log": name, "model": a, "value": auc, "baseline": lr["auc"], "ratio": auc / lr["auc"],
                    "auc_diff": auc - lr["auc"], "logloss": ll, "baseline_logloss": lr["logloss"],
                    "logloss_diff": ll - lr["logloss"], "median": auc,
                    "p90": float(np.percentile(aucs, 90)), "test_auc_se": lr["test_auc_se"],
                    "bar_met": auc - lr["auc"] >= 0.005
                    and ll <= lr["logloss"], "runs": runs[a], "baseline_run": lr, "baseline_same_rows": lr_same,
                    "load_avg": os.getloadavg(),
                    "config": {"sets": sets, "data_flags": args.data_flags, "seeds": args.seeds,
                               "threads": torch.get_num_threads(), "jobs": args.jobs}}), flush=True)


if __name__ == "__main__":
    main()
