"""Why DLRM trained badly on full-size synthetic Criteo, and what fixes it: dense-lr warmup.

The old figure (``tt_quality.md`` before this fix: uncompressed 0.611 eval AUC after 2M samples of the
full-cardinality ``criteo-kaggle`` preset) looked like huge, barely trained tables. It was not: this
script trains one uncompressed DLRM (embedscale's defaults: dim 16, bottom MLP 512-256-64-16, top 512-256,
row-wise Adagrad on the rows, Adagrad on the MLPs) twice on the same batches, interleaved step by step,
with the same init:

* ``no_warmup``: ``train.lr_warmup_steps = 0``, the library's behaviour before this fix;
* ``warmup``: ``train.lr_warmup_steps`` (default 100): the dense lr ramps up linearly
  (``embedscale.train.trainer.warm_up_lr``).

It records, per ReLU layer of both MLPs, the fraction of units that are zero on every sample of a fixed
eval batch ("dead") after steps 1, 2, 5, 20, 100 and at the end, the eval AUC/logloss, and for the
``no_warmup`` model the eval AUC after resetting every row seen fewer than k times in training to its
initial value (if rarely trained rows were the noise, this would raise the AUC). The figure is the
``warmup`` model's AUC, the baseline the ``no_warmup`` one.

    .venv/bin/python benchmarks/bench_dense_warmup.py                      # 2M / 500k, batch 2048
    .venv/bin/python benchmarks/bench_dense_warmup.py --max-rows 100000    # the same with tables capped

Prints one JSON line on stdout; progress on stderr; ``--record`` writes ``benchmarks/results/dense_warmup.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from embedscale.data.loader import ShardLoader
from embedscale.embedding.init import uniform_rows
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.models import build_model
from embedscale.specs import DataConfig, ModelConfig, RunConfig, SyntheticConfig, TrainConfig
from embedscale.train.trainer import evaluate, warm_up_lr
from embedscale.workflow import hash_init, make_dense_optimizer, prepare_data, tables_for

RESULTS = Path(__file__).resolve().parent / "results" / "dense_warmup.md"
PROBE_STEPS = (1, 2, 5, 20, 100)


def dead_units(model, batch) -> dict[str, float]:
    """Per ReLU layer (``bottom 512`` ... ``top 256``): the fraction of units that output zero for every
    sample of ``batch``."""
    acts, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ReLU):
            hooks.append(mod.register_forward_hook(lambda m, i, o, n=name: acts.__setitem__(n, o.detach())))
    was = model.training
    model.eval()
    with torch.no_grad():
        model(batch.dense, batch.sparse)
    model.train(was)
    for h in hooks:
        h.remove()
    return {f"{'bottom' if n.startswith('dense_arch') else 'top'} {a.shape[1]}":
            round(float((a.max(0).values <= 0).float().mean()), 3) for n, a in acts.items()}


def teacher_signal(cfg: SyntheticConfig, seed: int, n: int = 200_000, min_rows: int = 1_000_000) -> dict:
    """What is learnable in the tables of at least ``min_rows`` rows: the teacher's AUC on ``n`` fresh samples
    with and without their row effects (the ``m / (m + K)`` learnability puts those on the few head rows),
    and the std of their share of the logit."""
    from embedscale.data.synthetic import SyntheticGenerator
    from embedscale.train.metrics import roc_auc

    g = SyntheticGenerator(cfg, seed)
    dense, sparse, label_u = g._draw([seed, 0xD1A6], n)
    z = g._logit_from_parts(g._raw_parts(dense, sparse))
    y = (label_u < 1.0 / (1.0 + np.exp(-z))).astype(np.int8)
    big = np.zeros(n)
    for ti, rows in enumerate(g.num_rows):
        if rows >= min_rows:
            r, ranks, _ = sparse[ti]
            big += g._row_effects(ti, r, ranks)[:, 0]
    big *= g._coef[1]
    return {"teacher_auc": roc_auc(y, z), "teacher_auc_without_large_table_rows": roc_auc(y, z - big),
            "large_table_logit_std": float(big.std()), "logit_std": float(z.std()),
            "large_tables": int(sum(rows >= min_rows for rows in g.num_rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=2_000_000)
    ap.add_argument("--eval", type=int, default=500_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--max-rows", type=int, default=0, help="cap every table (0 = full criteo-kaggle cardinalities)")
    ap.add_argument("--lr-sparse", type=float, default=TrainConfig.lr_sparse)
    ap.add_argument("--lr-dense", type=float, default=TrainConfig.lr_dense)
    ap.add_argument("--warmup", type=int, default=TrainConfig.lr_warmup_steps)
    ap.add_argument("--resets", default="2,5,30", help="k values of the rare-row reset check")
    ap.add_argument("--cache", default="runs/bench-data")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="write the report into benchmarks/results/")
    ap.add_argument("--no-results", action="store_true", help="no report even with --record")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    cfg = RunConfig(data=DataConfig(source="synthetic", train_samples=args.train, eval_samples=args.eval,
                                    seed=args.seed,
                                    synthetic=SyntheticConfig(preset="criteo-kaggle", max_rows=args.max_rows)),
                    model=ModelConfig(), train=TrainConfig(batch_size=args.batch, lr_sparse=args.lr_sparse,
                                                           lr_dense=args.lr_dense, seed=args.seed))
    data = prepare_data(cfg, cache_root=args.cache, progress=True)
    tables = tables_for(cfg, data.manifest)
    models = {}
    for name in ("no_warmup", "warmup"):
        torch.manual_seed(args.seed)
        emb = LocalEmbeddingBags(tables, optimizer="rowwise_adagrad", lr=args.lr_sparse,
                                 init=hash_init(args.seed, tables))
        m = build_model(cfg.model, tables, data.manifest.num_dense, embedding=emb)
        models[name] = (m, make_dense_optimizer(cfg.train, m.dense_parameters()), emb)
    warmups = {"no_warmup": 0, "warmup": args.warmup}
    train = ShardLoader(data.train.directory, args.batch, start=data.train.start, stop=data.train.stop, prefetch=2)
    ev = ShardLoader(data.eval.directory, 8192, start=data.eval.start, stop=data.eval.stop, prefetch=2)
    probe = next(iter(ev))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    counts = {t.name: np.zeros(t.num_rows, np.int64) for t in tables}
    feature_table = {f: t.name for t in tables for f in t.features}
    dead = {k: {"0": dead_units(m, probe)} for k, (m, _, _) in models.items()}
    step = 0
    for batch in tqdm(train, desc="train", file=sys.stderr):
        for name, (m, opt, _) in models.items():
            warm_up_lr(opt, step, warmups[name])
            loss = loss_fn(m(batch.dense, batch.sparse), batch.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        step += 1
        if step in PROBE_STEPS:
            for name, (m, _, _) in models.items():
                dead[name][str(step)] = dead_units(m, probe)
        sp = batch.sparse
        for k, v in zip(sp.keys, torch.split(sp.values, sp.lengths.view(len(sp.keys), -1).sum(1).tolist())):
            counts[feature_table[k]] += np.bincount(v.numpy(), minlength=counts[feature_table[k]].size)
    out = {}
    for name, (m, _, _) in models.items():
        dead[name][f"{step} (end)"] = dead_units(m, probe)
        e = evaluate(m, ev, progress=True)
        out[name] = {"eval_auc": e["auc"], "eval_logloss": e["logloss"], "dead_units": dead[name]}
        print(f"{name}: AUC {e['auc']:.5f} logloss {e['logloss']:.5f} dead {dead[name]}", file=sys.stderr, flush=True)
    # rare rows of the large tables back to their initial values: does the AUC rise?
    m, _, emb = models["no_warmup"]
    big = [(i, t) for i, t in enumerate(tables) if t.num_rows > 100_000]
    resets = {}
    with torch.no_grad():
        saved = {t.name: emb.table_weight(t.name).clone() for _, t in big}
        for k in [int(x) for x in args.resets.split(",") if x]:
            for i, t in big:
                w = emb.table_weight(t.name)
                w.copy_(saved[t.name])
                rare = np.flatnonzero((counts[t.name] > 0) & (counts[t.name] < k))
                w[torch.from_numpy(rare)] = torch.from_numpy(uniform_rows(args.seed, i, rare, t.dim, t.num_rows))
            resets[str(k)] = evaluate(m, ev)["auc"]
        for _, t in big:
            emb.table_weight(t.name).copy_(saved[t.name])
    signal = teacher_signal(cfg.data.synthetic, args.seed)
    result = {
        "benchmark": "dense_warmup", "figure": round(out["warmup"]["eval_auc"], 5),
        "baseline": round(out["no_warmup"]["eval_auc"], 5),
        "ratio": round(out["warmup"]["eval_auc"] / out["no_warmup"]["eval_auc"], 5),
        "unit": "eval AUC", "teacher_auc": data.teacher_auc, "models": out,
        "no_warmup_auc_with_rare_rows_reset": resets, "teacher_signal": signal,
        "config": {"train": args.train, "eval": args.eval, "batch": args.batch, "max_rows": args.max_rows,
                   "lr_sparse": args.lr_sparse, "lr_dense": args.lr_dense, "warmup": args.warmup, "steps": step,
                   "threads": torch.get_num_threads(), "seed": args.seed, "torch": torch.__version__,
                   "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                   "wall_s": round(time.perf_counter() - t_start, 1)},
    }
    print(json.dumps(result))
    if args.record and not args.no_results:
        write_markdown(result, " ".join(["benchmarks/bench_dense_warmup.py"] + sys.argv[1:]))


def write_markdown(r: dict, command: str) -> None:
    from embedscale.io import atomic_write_text

    c = r["config"]
    size = f"capped at {c['max_rows']:,} rows" if c["max_rows"] else "full cardinalities (5 tables over 1M rows)"
    lines = [f"### Dense-lr warmup: DLRM on synthetic criteo-kaggle, {size}", "",
             f"`.venv/bin/python {command}` — {c['train']:,} train / {c['eval']:,} eval samples, one epoch, batch "
             f"{c['batch']}, lr sparse {c['lr_sparse']} / dense {c['lr_dense']}, {c['threads']} thread(s), load "
             f"{c['loadavg_start'][0]:.1f} at start, {c['wall_s'] / 60:.0f} min. Teacher AUC {r['teacher_auc']:.4f}.",
             "", "| model | eval AUC | eval logloss | dead bottom-MLP outputs (the 16 units the dense features reach the model through), after steps 1 / 5 / 20 / end |",
             "| --- | ---: | ---: | --- |"]
    for name, label in (("no_warmup", "no warmup (before)"), ("warmup", f"warmup {c['warmup']} steps (default now)")):
        m = r["models"][name]
        last = [k for k in m["dead_units"] if k.endswith("(end)")][0]
        out_layer = [k for k in m["dead_units"]["0"] if k.startswith("bottom")][-1]
        seq = " / ".join(f"{m['dead_units'][s][out_layer]:.0%}" for s in ("1", "5", "20", last) if s in m["dead_units"])
        lines.append(f"| {label} | {m['eval_auc']:.5f} | {m['eval_logloss']:.5f} | {seq} |")
    lines += ["", "Dead units per ReLU layer after step 1 (fraction of units zero on all 8,192 probe samples):", "",
              "| model | " + " | ".join(r["models"]["warmup"]["dead_units"]["1"]) + " |",
              "| --- |" + " ---: |" * len(r["models"]["warmup"]["dead_units"]["1"])]
    for name in ("no_warmup", "warmup"):
        lines.append(f"| {name} | " + " | ".join(f"{v:.0%}" for v in r["models"][name]["dead_units"]["1"].values())
                     + " |")
    resets = ", ".join(f"rows seen < {k} times: {v:.5f}" for k, v in r["no_warmup_auc_with_rare_rows_reset"].items())
    lines += ["", f"The no-warmup model with the rarely trained rows of its tables over 100k rows reset to their "
              f"initial values: {resets} (as trained: {r['models']['no_warmup']['eval_auc']:.5f}).", ""]
    t = r["teacher_signal"]
    if t["large_tables"]:
        lines += [f"The teacher on 200k fresh samples: AUC {t['teacher_auc']:.4f}; without the row effects of its "
                  f"{t['large_tables']} tables of at least 1M rows {t['teacher_auc_without_large_table_rows']:.4f} "
                  f"(their part of the logit has std {t['large_table_logit_std']:.2f} of {t['logit_std']:.2f}). "
                  "A row's effect is scaled by m / (m + 2000), m its expected accesses in 200k samples: in these "
                  "tables only the head rows carry a learnable signal.", ""]
    path = RESULTS if not c["max_rows"] else RESULTS.with_name(f"dense_warmup-{c['max_rows']}.md")
    atomic_write_text(path, "\n".join(lines))


if __name__ == "__main__":
    main()
