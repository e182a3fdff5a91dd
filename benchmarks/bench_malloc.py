"""Freed memory kept for the next step (``embedscale.threads.keep_freed_memory``) against glibc's default malloc.

The dense arches of a DLRM with OPER Table 1's MLPs (bottom 13-512-256-64-16, the dot interaction of 26 pooled
embeddings, top 367-512-256-1) at 2,048 samples, one intra-op thread (one rank's share of 2 cores): the forward
without autograd (an inference step) and forward + backward (a training step), timed in a fresh interpreter per
setting and round, the two settings alternating round by round: ``kept`` (what every embedscale rank runs) and
``glibc`` (malloc as it comes: a freed heap top above a few MB handed back to the kernel, blocks of a few MB served
by ``mmap``, so every step's activations are faulted in again). Figures: the process CPU time of a step (medians
over the steps of all rounds; the machine's load inflates it far less than wall time) and the minor page faults
per step.

    .venv/bin/python benchmarks/bench_malloc.py [--rounds 3] [--steps 30]

Prints one JSON line on stdout (figure = the kept inference step in ms, baseline = glibc's; training inside).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
STEP = """
import json, resource, sys, time
import torch
from embedscale.models.dlrm import DenseArch, InteractionArch, OverArch
from embedscale.threads import keep_freed_memory
torch.set_num_threads(1)
if sys.argv[1] == "kept":
    assert keep_freed_memory({})
torch.manual_seed(0)
B, F, D = 2048, 26, 16
bottom, inter, top = DenseArch(13, [512, 256, 64, D]), InteractionArch(F), OverArch(D + (F + 1) * F // 2, [512, 256])
x, e = torch.rand(B, 13), torch.randn(B, F * D, requires_grad=True)
def step(train):
    z = top(inter(bottom(x), e.view(B, F, D)))
    if train:
        z.sum().backward()
out = {}
for train in (False, True):
    times, faults = [], []
    with torch.set_grad_enabled(train):
        for s in range(5 + int(sys.argv[2])):
            c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step(train)
            if s >= 5:
                times.append(time.process_time() - c0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    out["training" if train else "inference"] = {"cpu_s": times, "faults": faults}
print(json.dumps(out))
"""


def _run(setting: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "EMBEDSCALE_THREADS")
           and not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", STEP, setting, str(steps)], env=env, capture_output=True, text=True,
                         timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    load_before = os.getloadavg()
    runs: dict = {"kept": [], "glibc": []}
    for r in range(args.rounds):
        for setting in (("kept", "glibc") if r % 2 == 0 else ("glibc", "kept")):
            runs[setting].append(_run(setting, args.steps))
            print(f"  round {r + 1} {setting} done", file=sys.stderr, flush=True)
    res = {}
    for phase in ("inference", "training"):
        ph = {}
        for setting, rs in runs.items():
            t = [x for run in rs for x in run[phase]["cpu_s"]]
            f = [x for run in rs for x in run[phase]["faults"]]
            ph[setting] = {"cpu_median_ms": 1e3 * statistics.median(t),
                           "cpu_p90_ms": 1e3 * statistics.quantiles(t, n=10)[-1],
                           "faults_per_step": statistics.median(f)}
        ph["ratio"] = ph["glibc"]["cpu_median_ms"] / ph["kept"]["cpu_median_ms"]
        res[phase] = ph
    print(json.dumps({"benchmark": "malloc_kept", "figure": res["inference"]["kept"]["cpu_median_ms"],
                      "baseline": res["inference"]["glibc"]["cpu_median_ms"], "ratio": res["inference"]["ratio"],
                      "unit": "ms CPU per inference step (lower is better)",
                      "median_ms": res["inference"]["kept"]["cpu_median_ms"],
                      "p90_ms": res["inference"]["kept"]["cpu_p90_ms"], "training": res["training"],
                      "inference": res["inference"],
                      "config": {"rounds": args.rounds, "steps": args.steps, "batch": 2048, "threads": 1,
                                 "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                                 "command": " ".join([".venv/bin/python", "benchmarks/bench_malloc.py",
                                                      *sys.argv[1:]])}}))


if __name__ == "__main__":
    main()
