"""Tower partitioner quality (DMT 3.3, Table 6): planted feature groups recovered, and DMT-DLRM with the
partitioner's towers against naive strided towers over several seeds, with the Mann-Whitney p-value.

Data: ``embedscale.towers.planted.PlantedGroups``: 16 one-hot features in 4 planted groups at random
positions, 50 rows per table, every group a noisy view (90%) of one entity per sample. Two teachers:
``within`` (features of a group interact pairwise, latent width 2) and ``both`` (additionally the groups'
entities interact with each other, latent width 4; the structure DMT 5.2.3 reports for its production
model: item, user and item-user interactions). Train samples ``[0, --train)``, eval samples
``[10^7, 10^7 + --eval)`` of one data seed.

Per model seed (``--seeds``, default 5):

1. on each teacher, train a plain DLRM (N = 16) one epoch; run ``learn_towers`` (coherent strategy,
   4 towers, max/min size ratio 1) on its embeddings over 8192 fresh samples; score the partition
   against the planted groups with the adjusted Rand index. Baseline in the same run, on the same model:
   DMT 3.3's pipeline alone (uncentred ``|cos|``, coordinates + constrained K-Means, no swap refinement,
   4 coordinate restarts: the partitioner before centring and refinement were added);
2. on ``both``, train DMT-DLRM (4 towers, DLRM tower modules ``c = 0, p = 1, D = 8``: each tower emits
   one mixed vector, DMT 5.2.2's 16-tower setting; CR 8) with the partitioner's towers and with the
   naive strided towers of DMT 5.2.3, same seed, same data; evaluate AUC. (With ``c >= 1`` every
   feature keeps its own projected vector and the assignment barely matters: the linear module cannot
   mix a feature away; with ``p`` it can, which is where a meaningful assignment pays.)

``--ablation K`` (a separate mode) trains ``K`` further plain DLRMs per teacher (initial weights from
seeds 1000 .. 1000 + K - 1, data order from seed k) and scores four partitioners on each: DMT's pipeline
alone, with the swap refinement, with the centred interaction, with both (the default). It prints one
JSON line with the ARI of every variant on every model.

Everything runs in one process (``build_dmt_model`` without a ``TowerComm``: the tower transform does not
change the model, only where it runs). The one-sided Mann-Whitney U test asks whether TP's AUCs are
stochastically greater than naive's (DMT Table 6 reports the same test over 9 runs). Also reports
training FLOPs per sample of DLRM and DMT-DLRM (DMT Table 4's column).

Prints one JSON line on stdout (figure: median AUC with TP towers; baseline: median AUC with naive
towers; ratio: their quotient); progress on stderr.

    .venv/bin/python benchmarks/bench_dmt_quality.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from scipy.stats import mannwhitneyu

from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.models import build_model
from embedscale.models.dmt import DMTConfig, build_dmt_model, training_flops_per_sample
from embedscale.specs import ModelConfig
from embedscale.towers.partitioner import adjusted_rand_index, learn_towers, naive_assignment
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 seeds, fewer samples")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--train", type=int, default=400_000)
    ap.add_argument("--eval", type=int, default=100_000)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--ablation", type=int, default=0, metavar="K",
                    help="instead: K more trained models per teacher, ARI of four partitioner variants on each")
    args = ap.parse_args()
    seeds = 3 if args.quick else args.seeds
    n_train = 300_000 if args.quick else args.train
    torch.set_num_threads(1)
    N, T, D, batch, sparse_lr = 16, 4, 8, 512, 1.0
    within = PlantedGroups(num_features=16, num_groups=4, num_rows=50, latent_dim=2, interaction="within",
                           seed=args.data_seed)
    data = PlantedGroups(num_features=16, num_groups=4, num_rows=50, latent_dim=4, interaction="both",
                         seed=args.data_seed)
    assert (within.group_labels == data.group_labels).all()
    tables = data.tables(N)
    ev, ev_logit = data.batch_with_logit(10**7, args.eval)
    teacher_auc = roc_auc(ev.labels.numpy(), ev_logit)
    cfg = ModelConfig(arch="dlrm", embedding_dim=N, bottom_mlp=[32], top_mlp=[64, 32])
    dmt = DMTConfig(towers=T, tower_module="dlrm", c=0, p=1, tower_dim=D)
    naive = naive_assignment(data.feature_names, T)
    if args.ablation:
        return ablation(args.ablation, {"within": within, "both": data}, tables, cfg, n_train, batch, sparse_lr, T)
    load0 = os.getloadavg()
    log(f"bench_dmt_quality: {seeds} seeds, {n_train} train samples, load {load0}; teacher AUC {teacher_auc:.4f}")
    rows = []
    t0 = time.time()
    for s in range(seeds):
        row = {"seed": s}
        for name, d in (("within", within), ("both", data)):
            plain = build_model(cfg, tables, d.num_dense,
                                embedding=LocalEmbeddingBags(tables, optimizer="rowwise_adagrad", lr=sparse_lr, seed=s))
            train(plain, d, n_train, batch, s)
            tp, report = learn_towers(plain, d.batches(2 * 10**7, 8192, 2048), T, "coherent", max_ratio=1.0, seed=s)
            row[f"ari_{name}"] = adjusted_rand_index(tp.labels(d.feature_names), d.group_labels)
            dmt_only, _ = learn_towers(plain, d.batches(2 * 10**7, 8192, 2048), T, "coherent", max_ratio=1.0, seed=s,
                                       center=False, refine=False, restarts=4)
            row[f"ari_{name}_dmt_pipeline"] = adjusted_rand_index(dmt_only.labels(d.feature_names), d.group_labels)
            if name == "both":
                row["plain_dlrm_auc"] = auc(plain, ev)
                row["tp_towers"] = tp.towers
        for name, assignment in (("tp", tp), ("naive", naive)):
            m = build_dmt_model(cfg, tables, data.num_dense, dmt, assignment=assignment, seed=s, lr=sparse_lr)
            train(m, data, n_train, batch, s)
            row[f"{name}_auc"] = auc(m, ev)
        rows.append(row)
        log(f"seed {s}: ARI within {row['ari_within']:.3f} both {row['ari_both']:.3f} (DMT pipeline alone "
            f"{row['ari_within_dmt_pipeline']:.3f}, {row['ari_both_dmt_pipeline']:.3f}); AUC plain "
            f"{row['plain_dlrm_auc']:.4f}, TP {row['tp_auc']:.4f}, naive {row['naive_auc']:.4f} ({time.time() - t0:.0f} s)")
    tp_aucs = [r["tp_auc"] for r in rows]
    naive_aucs = [r["naive_auc"] for r in rows]
    p = float(mannwhitneyu(tp_aucs, naive_aucs, alternative="greater").pvalue)
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
        "config": {"seeds": seeds, "train_samples": n_train, "eval_samples": args.eval, "data_seed": args.data_seed,
                   "features": 16, "planted_groups": 4, "towers": T, "tower_module": "dlrm c=0 p=1",
                   "compression_ratio": dmt_model.compression_ratio, "embedding_dim": N, "tower_dim": D, "batch": batch, "sparse_lr": sparse_lr, "dense": "adagrad 0.05",
                   "mann_whitney_p_tp_greater": p,
                   "ari_within": [round(r["ari_within"], 4) for r in rows],
                   "ari_both": [round(r["ari_both"], 4) for r in rows],
                   "ari_within_dmt_pipeline": [round(r["ari_within_dmt_pipeline"], 4) for r in rows],
                   "ari_both_dmt_pipeline": [round(r["ari_both_dmt_pipeline"], 4) for r in rows],
                   "ari_min": min(min(r["ari_within"], r["ari_both"]) for r in rows), "auc_tp": tp_aucs, "auc_naive": naive_aucs,
                   "auc_plain_dlrm": [r["plain_dlrm_auc"] for r in rows], "teacher_auc": teacher_auc,
                   "tp_wins": sum(a > b for a, b in zip(tp_aucs, naive_aucs)), "planted": data.groups(),
                   "tp_towers_seed0": rows[0]["tp_towers"], "naive_towers": naive.towers,
                   "flops_per_sample_train": fl, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                   "wall_s": round(time.time() - t0, 1)},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
