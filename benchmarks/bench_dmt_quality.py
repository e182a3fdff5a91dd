"""Tower partitioner quality (DMT 3.3, 5.2.3, Table 6): planted feature groups recovered, and DMT-DLRM with the
partitioner's towers against naive strided towers over several seeds, with the Mann-Whitney p-value.

Why the teacher is ``group_sums`` (``embedscale.towers.planted``). DMT 3.2: a tower module compresses the
features of a tower *before* they interact with other towers, so features whose combination matters
should share a tower. The DLRM tower module (Listing 1) with ``c = 0, p = 1`` (DMT 5.2.2's 16-tower
setting) is linear, and DLRM's dot interaction has no self-dots: a tower can *add* its features (one
mixed vector of width ``D``), never multiply them; products only form between different towers. The
earlier teachers could not show the assignment: ``within`` (products of features of one group) is
unreachable for coherent towers and reachable for naive ones, whose towers split every group; with
``entities`` every feature of a group is a 90% view of one entity, so every naive tower holds a view
of every entity and no information is lost (measured: TP ahead on 3 of 5 seeds, p = 0.58). The
``group_sums`` teacher is DMT's hierarchical interaction by construction: the click depends on
``sum_{g<h} s_g^T M_gh s_h``, ``s_g`` the sum of the latents of group ``g``'s features (independent per
feature, ``correlation = 0``: no redundancy). A coherent tower computes ``s_g`` exactly (``D = 8 >= 2``);
a naive tower holds one feature of each group: the 6 cross-group pairs inside each tower (24 of the 96
the teacher sums) cannot be formed at all, and the rest arrive mixed in one dot per pair of towers.

Data: 16 one-hot features in 4 planted groups at random positions, 50 rows per table, latent width 2,
row biases and dense part as the other teachers. Train samples ``[0, --train)``, eval samples
``[10^7, 10^7 + --eval)`` of one data seed (``--data-seed``).

Per model seed ``s`` (``--seeds``, default 9 as DMT Table 6), one seeded function of ``s`` alone:

1. train a plain DLRM (N = 16, dense init from ``torch.manual_seed(s)``) one epoch of ``--train``
   samples; run ``learn_towers`` (coherent strategy, 4 towers, max/min size ratio 1) on its embeddings
   over 8192 fresh samples; score the partition against the planted groups (adjusted Rand index).
   Baseline on the same model: DMT 3.3's pipeline alone (uncentred ``|cos|``, coordinates + constrained
   K-Means, no swap refinement, 4 coordinate restarts);
2. train DMT-DLRM (4 towers, DLRM tower modules ``c = 0, p = 1, D = 8``, CR 8) with the partitioner's
   towers and with the naive strided towers of DMT 5.2.3. The arms differ in the assignment only: same
   tables, tower-module and dense initial weights (seed ``s``), same samples in the same order, same
   eval set; evaluate AUC.

Statistics: one-sided Mann-Whitney U (TP's AUCs stochastically greater than naive's; DMT Table 6), and,
since the arms are paired by seed, the one-sided Wilcoxon signed-rank p. Also training FLOPs per sample
of DLRM and DMT-DLRM (DMT Table 4's column). ``--jobs 2`` trains two seeds at a time (same results:
every seed is seeded).

``--ablation K`` (a separate mode, the earlier teachers ``within`` and ``both``) trains ``K`` further
plain DLRMs per teacher (initial weights from seeds 1000 .. 1000 + K - 1, data order from seed k) and
scores four partitioners on each: DMT's pipeline alone, with the swap refinement, with the centred
interaction, with both (the default). It prints one JSON line with the ARI of every variant.

Everything runs in one process per seed (``build_dmt_model`` without a ``TowerComm``: the tower transform
does not change the model, only where it runs).

Prints one JSON line on stdout (figure: median AUC with TP towers; baseline: median AUC with naive
towers; ratio: their quotient); progress on stderr.

    .venv/bin/python benchmarks/bench_dmt_quality.py --seeds 9 --train 4000000 --jobs 2   # [--quick]

Measured (that command, 1010 s, benchmarks/results/dmt.md 2a): TP ahead on 9 of 9 seeds, mean AUC 0.7932 vs
0.7573, median 0.7913 vs 0.7593, one-sided Mann-Whitney p = 0.00021 (paired Wilcoxon 0.0020); the
partitioner recovered the planted groups (ARI >= 0.9) on 4 of 9 models only (DMT's pipeline alone 0 of 9).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch
from scipy.stats import mannwhitneyu, wilcoxon

from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.models import build_model
from embedscale.models.dmt import DMTConfig, build_dmt_model, training_flops_per_sample
from embedscale.specs import ModelConfig
from embedscale.plan.towers import adjusted_rand_index, naive_assignment
from embedscale.towers.learn import learn_towers
from embedscale.towers.planted import PlantedGroups
from embedscale.train.metrics import roc_auc


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(model, data, n, batch, seed):
    torch.manual_seed(seed)
    opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.05)
    for b in data.batches(0, n, batch):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels).backward()
        opt.step()
    return model


@torch.no_grad()
def auc(model, ev) -> float:
    model.eval()
    out = roc_auc(ev.labels.numpy(), model(ev.dense, ev.sparse).numpy())
    model.train()
    return out


VARIANTS = {"dmt_pipeline": dict(center=False, refine=False, restarts=4), "refine": dict(center=False),
            "center": dict(refine=False), "center_refine": {}}


def ablation(k_models, teachers, tables, cfg, n_train, batch, sparse_lr, T) -> None:
    """ARI of the partitioner variants on ``k_models`` extra trained models per teacher (see the docstring)."""
    load0, t0 = os.getloadavg(), time.time()
    ari = {f"{name}/{v}": [] for name in teachers for v in VARIANTS}
    for k in range(k_models):
        for name, d in teachers.items():
            torch.manual_seed(1000 + k)
            plain = build_model(cfg, tables, d.num_dense,
                                embedding=LocalEmbeddingBags(tables, optimizer="rowwise_adagrad", lr=sparse_lr, seed=k))
            train(plain, d, n_train, batch, k)
            for v, kw in VARIANTS.items():
                a, _ = learn_towers(plain, d.batches(2 * 10**7, 8192, 2048), T, "coherent", max_ratio=1.0, seed=k, **kw)
                ari[f"{name}/{v}"].append(round(adjusted_rand_index(a.labels(d.feature_names), d.group_labels), 4))
            log(f"model {k} {name}: " + ", ".join(f"{v} {ari[f'{name}/{v}'][-1]:.3f}" for v in VARIANTS)
                + f" ({time.time() - t0:.0f} s)")
    hits = {v: sum(x >= 0.9 for name in teachers for x in ari[f"{name}/{v}"]) for v in VARIANTS}
    print(json.dumps({"benchmark": "dmt_partitioner_ablation", "figure": hits["center_refine"],
                      "baseline": hits["dmt_pipeline"], "unit": f"partitions with ARI >= 0.9 of {2 * k_models}",
                      "config": {"models_per_teacher": k_models, "train_samples": n_train, "init_seeds": "1000+k",
                                 "hits": hits, "ari": ari, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                                 "wall_s": round(time.time() - t0, 1)}}))


N, T, D, BATCH, SPARSE_LR = 16, 4, 8, 512, 1.0
MODEL = ModelConfig(arch="dlrm", embedding_dim=N, bottom_mlp=[32], top_mlp=[64, 32])
TOWERS = DMTConfig(towers=T, tower_module="dlrm", c=0, p=1, tower_dim=D)


def group_sums_data(data_seed: int) -> PlantedGroups:
    return PlantedGroups(num_features=16, num_groups=4, num_rows=50, latent_dim=2, interaction="group_sums",
                         correlation=0.0, seed=data_seed)


def run_seed(s: int, n_train: int, n_eval: int, data_seed: int) -> dict:
    """One seed: plain DLRM, its towers (partitioner and DMT's pipeline alone, ARI), DMT-DLRM with TP and
    with naive towers (eval AUC). Depends on ``s`` only (every generator is seeded), so seeds may run in
    any order and in parallel."""
    torch.set_num_threads(1)
    data = group_sums_data(data_seed)
    tables = data.tables(N)
    ev = data.batch(10**7, n_eval)
    row = {"seed": s}
    torch.manual_seed(s)  # the plain model's dense init (build_model draws from the global generator)
    plain = build_model(MODEL, tables, data.num_dense,
                        embedding=LocalEmbeddingBags(tables, optimizer="rowwise_adagrad", lr=SPARSE_LR, seed=s))
    train(plain, data, n_train, BATCH, s)
    tp, _ = learn_towers(plain, data.batches(2 * 10**7, 8192, 2048), T, "coherent", max_ratio=1.0, seed=s)
    row["ari"] = adjusted_rand_index(tp.labels(data.feature_names), data.group_labels)
    dmt_only, _ = learn_towers(plain, data.batches(2 * 10**7, 8192, 2048), T, "coherent", max_ratio=1.0, seed=s,
                               center=False, refine=False, restarts=4)
    row["ari_dmt_pipeline"] = adjusted_rand_index(dmt_only.labels(data.feature_names), data.group_labels)
    row["plain_dlrm_auc"] = auc(plain, ev)
    row["tp_towers"] = tp.towers
    # the two arms differ in the assignment only: same tables, tower-module and dense init (seed s; all
    # towers hold 4 features, so the modules have the same shapes), same samples in the same order
    for name, assignment in (("tp", tp), ("naive", naive_assignment(data.feature_names, T))):
        m = build_dmt_model(MODEL, tables, data.num_dense, TOWERS, assignment=assignment, seed=s, lr=SPARSE_LR)
        train(m, data, n_train, BATCH, s)
        row[f"{name}_auc"] = auc(m, ev)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 seeds, 1M samples")
    ap.add_argument("--seeds", type=int, default=9)
    ap.add_argument("--train", type=int, default=4_000_000)
    ap.add_argument("--eval", type=int, default=100_000)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="seeds trained in parallel (one thread each)")
    ap.add_argument("--ablation", type=int, default=0, metavar="K",
                    help="instead: K more trained models per teacher (within, both), ARI of four partitioner variants")
    args = ap.parse_args()
    seeds = 3 if args.quick else args.seeds
    n_train = 1_000_000 if args.quick else args.train
    torch.set_num_threads(1)
    cfg, batch, sparse_lr = MODEL, BATCH, SPARSE_LR
    if args.ablation:
        within = PlantedGroups(num_features=16, num_groups=4, num_rows=50, latent_dim=2, interaction="within",
                               seed=args.data_seed)
        both = PlantedGroups(num_features=16, num_groups=4, num_rows=50, latent_dim=4, interaction="both",
                             seed=args.data_seed)
        return ablation(args.ablation, {"within": within, "both": both}, within.tables(N), cfg, n_train, batch,
                        sparse_lr, T)
    data = group_sums_data(args.data_seed)
    tables = data.tables(N)
    ev, ev_logit = data.batch_with_logit(10**7, args.eval)
    teacher_auc = roc_auc(ev.labels.numpy(), ev_logit)
    dmt = TOWERS
    naive = naive_assignment(data.feature_names, T)
    load0 = os.getloadavg()
    log(f"bench_dmt_quality: {seeds} seeds, {n_train} train samples, load {load0}; teacher AUC {teacher_auc:.4f}")
    rows = []
    t0 = time.time()
    job = functools.partial(run_seed, n_train=n_train, n_eval=args.eval, data_seed=args.data_seed)
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:  # every seed is seeded: order-free
        for row in pool.imap(job, range(seeds)):
            rows.append(row)
            log(f"seed {row['seed']}: ARI {row['ari']:.3f} (DMT pipeline alone {row['ari_dmt_pipeline']:.3f}); AUC "
                f"plain {row['plain_dlrm_auc']:.4f}, TP {row['tp_auc']:.4f}, naive {row['naive_auc']:.4f} "
                f"({time.time() - t0:.0f} s)")
    tp_aucs = [r["tp_auc"] for r in rows]
    naive_aucs = [r["naive_auc"] for r in rows]
    p = float(mannwhitneyu(tp_aucs, naive_aucs, alternative="greater").pvalue)
    p_paired = float(wilcoxon(tp_aucs, naive_aucs, alternative="greater").pvalue) if seeds > 1 else float("nan")
    b = data.batch(0, 64)
    plain = build_dmt_model(cfg, tables, data.num_dense, DMTConfig(tower_module="none", towers=1))
    dmt_model = build_dmt_model(cfg, tables, data.num_dense, dmt, assignment=naive)
    dmt_c1 = build_dmt_model(cfg, tables, data.num_dense, DMTConfig(towers=T, tower_module="dlrm", compression=4),
                             assignment=naive)
    fl = {"dlrm": training_flops_per_sample(plain, b.dense, b.sparse)["train"],
          "dmt_dlrm_p1_D8": training_flops_per_sample(dmt_model, b.dense, b.sparse)["train"],
          "dmt_dlrm_c1_CR4": training_flops_per_sample(dmt_c1, b.dense, b.sparse)["train"]}
    med_tp, med_naive = statistics.median(tp_aucs), statistics.median(naive_aucs)
    out = {
        "benchmark": "dmt_partitioner_quality",
        "figure": round(med_tp, 5),
        "baseline": round(med_naive, 5),
        "ratio": round(med_tp / med_naive, 5),
        "unit": "median eval AUC of DMT-DLRM (TP towers vs naive strided towers)",
        "config": {"seeds": seeds, "jobs": args.jobs, "train_samples": n_train, "eval_samples": args.eval,
                   "data_seed": args.data_seed,
                   "teacher": "group_sums k=2 correlation=0", "features": 16, "planted_groups": 4, "towers": T,
                   "tower_module": "dlrm c=0 p=1", "compression_ratio": dmt_model.compression_ratio,
                   "embedding_dim": N, "tower_dim": D, "batch": batch, "sparse_lr": sparse_lr, "dense": "adagrad 0.05",
                   "mann_whitney_p_tp_greater": p, "wilcoxon_paired_p_tp_greater": p_paired,
                   "auc_tp_mean": statistics.mean(tp_aucs), "auc_naive_mean": statistics.mean(naive_aucs),
                   "auc_tp": tp_aucs, "auc_naive": naive_aucs,
                   "tp_wins": sum(a > b for a, b in zip(tp_aucs, naive_aucs)),
                   "ari": [round(r["ari"], 4) for r in rows],
                   "ari_dmt_pipeline": [round(r["ari_dmt_pipeline"], 4) for r in rows],
                   "ari_min": min(r["ari"] for r in rows),
                   "auc_plain_dlrm": [r["plain_dlrm_auc"] for r in rows], "teacher_auc": teacher_auc,
                   "planted": data.groups(), "tp_towers": [r["tp_towers"] for r in rows], "naive_towers": naive.towers,
                   "flops_per_sample_train": fl, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                   "wall_s": round(time.time() - t0, 1)},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
