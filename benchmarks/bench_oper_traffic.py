"""OPER planned against what the executor pays (distinct rows per batch, the replicas' sparse AllReduce over all
ranks) against OPER's own equations (eq. 3: every access; eq. 5: a replica's rows all-reduced among its holders):
what changes in the plans, in the bytes measured on the wire and in the measured step time.

Same run, 2 ranks (gloo, one host), the same data and profile: ``embedscale plan --strategy oper --traffic
access|distinct`` for a topology (``--hosts H --ranks-per-host R``: one host of 2 ranks, or 2 hosts of one rank,
where the model's inter-host links are 4x slower than its AllReduce), then ``embedscale train --dist-plan`` of
each plan, ``--repeats`` interleaved rounds. Per plan: rows replicated, the bytes each cost model predicts, the
bytes the transport counted (rows, ids, gradients, and the replicas' sync), the steady step (median of each
run's ``train_step_seconds`` median, after its first 10 steps). Figure: steady samples/s of the distinct plan;
baseline: the access plan's.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_oper_traffic.py --work /tmp/bench_traffic [--hosts 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _plan_common import emit, log
from embedscale.data.profile import AccessProfile
from embedscale.plan.cost import evaluate
from embedscale.plan.forms import table_profile
from embedscale.plan.plan import Plan
from embedscale.specs import TableSpec, Topology

TRAFFIC = ("access", "distinct")


def _es(*args, cwd: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "embedscale", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"embedscale {' '.join(args)} failed:\n{p.stderr[-3000:]}")


def model_bytes(plan: Plan, profile, topo: Topology, per_rank: int) -> dict:
    """Bytes per step (all ranks) each cost model charges: rows and gradients over the links, and the sync."""
    feats = plan.meta.get("features", {})
    prof = table_profile(profile, [TableSpec(t.name, t.num_rows, dim=t.dim, features=feats.get(t.name, [t.name]))
                                   for t in plan.tables])
    out = {}
    for traffic in TRAFFIC:
        c = evaluate(plan, prof, topo, batch_size=per_rank, traffic=traffic)
        out[traffic] = {"links": float(c.comm_bytes_matrix.sum()), "sync": float(c.allreduce_bytes_per_rank.sum()),
                        "max_rank_cost_us": c.max_rank_cost}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/bench_traffic")
    ap.add_argument("--max-rows", type=int, default=500_000, help="Cap every table's rows.")
    ap.add_argument("--samples", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=4096, help="Global batch (2 ranks).")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hosts", type=int, default=1, help="Hosts of the topology the plans are made for (1 or 2).")
    ap.add_argument("--extra-memory", type=float, default=0.05)
    args = ap.parse_args()
    if args.hosts not in (1, 2):
        raise SystemExit("--hosts: 1 or 2 (2 ranks)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    per_rank = args.batch // 2
    load0 = os.getloadavg()
    if not (work / "data" / "manifest.json").exists():
        _es("data", "synthetic", "--preset", "criteo-kaggle", "--max-rows", str(args.max_rows), "--samples",
            str(args.samples), "--out", "data", "--no-progress", cwd=work)
    if not (work / "profile").exists():
        _es("profile", "data", "--out", "profile", cwd=work)
    profile = AccessProfile.load(work / "profile")
    topo = Topology(num_hosts=args.hosts, ranks_per_host=2 // args.hosts)
    plans, info = {}, {}
    for traffic in TRAFFIC:
        d = work / f"plans-{args.hosts}h-{traffic}"
        if not (d / "oper" / "plan.json").exists():
            _es("plan", "--profile", "profile", "--batch-size", str(per_rank), "--hosts", str(args.hosts),
                "--ranks-per-host", str(2 // args.hosts), "--strategy", "oper", "--traffic", traffic,
                "--extra-memory", str(args.extra_memory), "--out", d.name, "--json", cwd=work)
        plans[traffic] = str(d / "oper")
        plan = Plan.load(d / "oper")
        h = plan.holders.sum(axis=1)
        info[traffic] = {"replicated_rows_everywhere": int(plan.meta.get("replicated_rows_everywhere", 0)),
                         "replica_rows": int(plan.part_rows[h > 1].sum()),
                         "replica_partitions_some_ranks": int(((h > 1) & (h < plan.world_size)).sum()),
                         "plan_seconds": float(plan.meta.get("plan_seconds", 0.0)),
                         "model_bytes": model_bytes(plan, profile, topo, per_rank)}
        log(f"{traffic}: {info[traffic]}")
    steady = {k: [] for k in TRAFFIC}
    measured = {k: [] for k in TRAFFIC}
    load_runs = os.getloadavg()
    for rep in range(args.repeats):
        for traffic in TRAFFIC:
            rd = work / "runs" / f"{args.hosts}h-{traffic}-{rep}"
            shutil.rmtree(rd, ignore_errors=True)
            t = time.perf_counter()
            _es("train", "--data-source", "shards", "--data-path", "data", "--train-batch-size", str(args.batch),
                "--train-max-steps", str(args.steps), "--train-eval-every", "0", "--nproc", "2", "--dist-plan",
                plans[traffic], "--run-dir", str(rd), "--no-progress", cwd=work)
            s = json.loads((rd / "summary.json").read_text())
            steady[traffic].append(float(s["train_step_seconds"]["median"]))
            measured[traffic].append({"embedding": float(s["embedding_bytes_on_wire_per_step"]),
                                      "sync": float(s["grad_sync_bytes_per_step"])})
            log(f"{traffic} run {rep}: steady {steady[traffic][-1] * 1e3:.1f} ms/step (p90 "
                f"{s['train_step_seconds']['p90'] * 1e3:.1f}); bytes/step embedding "
                f"{measured[traffic][-1]['embedding'] / 1e6:.3f} MB sync {measured[traffic][-1]['sync'] / 1e6:.3f} MB; "
                f"{time.perf_counter() - t:.0f} s wall, load {os.getloadavg()[0]:.1f}")
            shutil.rmtree(rd / "checkpoints", ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in steady.items()}
    p90 = {k: float(np.percentile(v, 90)) for k, v in steady.items()}
    bytes_med = {k: {f: float(np.median([m[f] for m in measured[k]])) for f in ("embedding", "sync")}
                 for k in TRAFFIC}
    emit("oper_traffic", args.batch / med["distinct"], args.batch / med["access"],
         "steady train samples/s (global batch / median over the interleaved runs of each run's median step "
         "after its first 10): oper planned by distinct traffic vs by OPER's eqs. 3 and 5",
         {"data": f"synthetic criteo-kaggle capped at {args.max_rows} rows", "samples": args.samples, "dim": 16,
          "ranks": 2, "plan_topology": f"{args.hosts} host(s) x {2 // args.hosts} rank(s)",
          "global_batch": args.batch, "steps": args.steps, "repeats": args.repeats,
          "extra_memory": args.extra_memory, "model": "DLRM defaults"},
         steady_step_s_median=med, steady_step_s_p90=p90, runs_steady_step_s=steady, measured_bytes_per_step=bytes_med,
         plans=info, load_average_before=load0, load_average_runs_start=load_runs,
         load_average_after=os.getloadavg())


if __name__ == "__main__":
    main()
