"""Where a plan's 2-rank training step goes (a diagnosis): stage timers inside real ``embedscale train`` runs.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/bench_plan_auto_breakdown.py --work /tmp/bench_auto_full \\
        [--plans auto,elrec_rule,...] [--steps 30] [--skip 5]

A diagnostic, not a speed claim. It runs ``embedscale train --nproc 2`` on the plans that
``bench_plan_auto_full.py`` made in ``--work`` (``plans-auto/auto``, ``plans-elrec/oper``, ``plans-mix_*/oper``)
with a ``sitecustomize`` on the ranks' ``PYTHONPATH`` that wraps, in every rank, the stages of a step with
wall-clock timers (inclusive, per step, the first ``--skip`` steps dropped):

* ``step``: ``DistributedRun.train_step`` (what the loop's timer, hence ``train_samples_per_s``, covers);
* ``forward`` (the DDP forward: embedding and dense), ``backward`` (``loss.backward``: the dense backward, the
  DDP all-reduce and every embedding backward with its exchange and update), ``opt`` (the dense optimizer);
* ``sharded_fwd`` / ``sharded_bwd``: ``ShardedEmbedding``'s forward (ids bucketed, rows fetched) and its
  backward (``grad_dist`` and ``update``: gradients sent back, row-wise Adagrad);
* ``tt_fwd.<table>`` / ``tt_bwd.<table>`` / ``tt_sync.<table>``: each TT table's lookup (sort, reuse plan,
  GEMMs), its fused backward (inclusive of the sync) and the core gradients' all-reduce (``grad_sync``); with
  the tables sharing one ``tt.GradSyncBucket``, ``tt_sync.all``: the contributions, the one sum and the updates;
* ``host_fwd`` / ``host_bwd``: the host tables' pooling and backward (their rows' all-gather, the updates
  pushed to the server); ``host_prefetch`` (server thread: read the batch's rows) and ``host_patch``
  (patcher thread) run beside the trainer;
* ``pipeline_wait``: the loop waiting for the next prefetched batch (outside the step timer).

Prints, per plan, the median per step of every stage (both ranks' mean of medians) and one JSON line.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SITE = r'''
import atexit, json, os, threading, time
from collections import defaultdict
_T = defaultdict(list)          # stage -> per-step seconds (summed within a step)
_CUR = defaultdict(float)
_LOCK = threading.Lock()
_STEP = [0]

def _add(key, dt):
    with _LOCK:
        _CUR[key] += dt

def _wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _add(key(a) if callable(key) else key, time.perf_counter() - t0)
    setattr(cls, name, g)

def _install():
    import torch
    from embedscale.train import distributed as D
    from embedscale.embedding import sharded as S, tt as TT, compression as C
    from embedscale.pipeline import embedding as PE, loop as PL
    orig_step = D.DistributedRun.train_step
    def train_step(self, batch):
        t0 = time.perf_counter()
        out = orig_step(self, batch)
        dt = time.perf_counter() - t0
        with _LOCK:
            _CUR["step"] += dt
            for k, v in _CUR.items():
                _T[k].append(v)
            _CUR.clear()
            _STEP[0] += 1
        return out
    D.DistributedRun.train_step = train_step
    _wrap(torch.nn.parallel.DistributedDataParallel, "forward", "forward")
    ob = torch.Tensor.backward
    def backward(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return ob(self, *a, **k)
        finally:
            _add("backward", time.perf_counter() - t0)
    torch.Tensor.backward = backward
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    t_opt = [0.0]
    register_optimizer_step_pre_hook(lambda o, a, k: t_opt.__setitem__(0, time.perf_counter()))
    register_optimizer_step_post_hook(lambda o, a, k: _add("opt", time.perf_counter() - t_opt[0]))
    _wrap(S.ShardedEmbedding, "forward", "sharded_fwd")
    _wrap(S._Lookup, "backward", "sharded_bwd")
    _wrap(TT.TTEmbeddingBag, "forward", lambda a: "tt_fwd." + str(a[0].name))
    _wrap(TT._EffTTLookup, "backward", lambda a: "tt_bwd." + str(a[0].module.name))
    ofused = TT.TTEmbeddingBag._backward_fused
    def fused(self, *a, **k):
        gs = self.grad_sync
        if gs is not None and not isinstance(gs, getattr(TT, "GradSyncBucket", ())):
            def timed(dense, gs=gs, name=self.name):
                t0 = time.perf_counter()
                try:
                    return gs(dense)
                finally:
                    _add("tt_sync." + str(name), time.perf_counter() - t0)
            self.grad_sync = timed
        try:
            return ofused(self, *a, **k)
        finally:
            self.grad_sync = gs
    TT.TTEmbeddingBag._backward_fused = fused
    if hasattr(TT, "GradSyncBucket"):  # one sum for all TT tables: the last contribution runs it and the updates
        _wrap(TT.GradSyncBucket, "contribute", "tt_sync.all")
    _wrap(PE._HostLookup, "forward", "host_fwd")
    _wrap(PE._HostLookup, "backward", "host_bwd")
    _wrap(PE.PipelinedEmbedding, "prefetch", "host_prefetch")
    _wrap(PE.PipelinedEmbedding, "_patch", "host_patch")
    _wrap(PL.PipelineLoop if hasattr(PL, "PipelineLoop") else PL.Pipeline, "next", "pipeline_wait")

def _dump():
    out = os.environ.get("EMBEDSCALE_STAGE_OUT")
    if out and _T:
        with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({k: v for k, v in _T.items()}, f)

if os.environ.get("EMBEDSCALE_STAGE_OUT") and os.environ.get("RANK") is not None:
    try:
        _install()
        atexit.register(_dump)
    except Exception as e:  # a diagnostic: never break the run
        import sys
        print("stage timers not installed:", repr(e), file=sys.stderr)
'''


def plan_dirs(work: Path) -> dict[str, Path]:
    out = {"auto": work / "plans-auto" / "auto", "elrec_rule": work / "plans-elrec" / "oper"}
    for d in sorted(work.glob("plans-mix_*")):
        out[d.name[len("plans-"):]] = d / "oper"
    for name, d in list(out.items()):
        if not (d / "plan.json").exists():
            out.pop(name)
    return out


def run_plan(work: Path, plan: Path, site: Path, out: Path, batch: int, steps: int, depth: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rd = out / "run"
    shutil.rmtree(rd, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}", "EMBEDSCALE_STAGE_OUT": str(out)}
    cmd = [sys.executable, "-m", "embedscale", "train", "--data-source", "shards", "--data-path", "data",
           "--train-batch-size", str(batch), "--train-max-steps", str(steps), "--train-eval-every", "0",
           "--train-checkpoint-every", "0", "--nproc", "2", "--dist-plan", str(plan), "--train-pipeline-depth",
           str(depth), "--run-dir", str(rd), "--no-progress"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"train under {plan} failed:\n{p.stderr[-3000:]}")
    s = json.loads((rd / "summary.json").read_text())
    shutil.rmtree(rd, ignore_errors=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"samples_per_s": float(s["train_samples_per_s"]), "wall_s": wall, "ranks": ranks}


def summarize(ranks: list[dict], skip: int) -> dict[str, float]:
    keys = sorted(set().union(*ranks))
    out = {}
    for k in keys:
        meds = []
        for r in ranks:
            v = r.get(k, [])
            v = v[skip:] if len(v) > skip else v
            meds.append(float(np.median(v)) if v else 0.0)
        out[k] = float(np.mean(meds))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/bench_auto_full")
    ap.add_argument("--plans", default="")
    ap.add_argument("--extra-plan", action="append", default=[], help="NAME=DIR: another plan directory to run.")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    plans = plan_dirs(work)
    for e in args.extra_plan:
        k, v = e.split("=", 1)
        plans[k] = Path(v).resolve()
    if args.plans:
        plans = {k: v for k, v in plans.items() if k in args.plans.split(",")}
    site = Path(tempfile.mkdtemp(prefix="stage-timers-"))
    (site / "sitecustomize.py").write_text(SITE)
    load0 = os.getloadavg()
    res: dict[str, list] = {k: [] for k in plans}
    for rep in range(args.repeats):
        for name, d in plans.items():
            r = run_plan(work, d, site, work / "breakdown" / f"{name}-{rep}", args.batch, args.steps, args.depth)
            st = summarize(r["ranks"], args.skip)
            res[name].append({"samples_per_s": r["samples_per_s"], "wall_s": r["wall_s"], "stages_ms":
                              {k: v * 1e3 for k, v in st.items()}})
            print(f"{name} run {rep}: {r['samples_per_s']:,.0f} samples/s ({args.batch / r['samples_per_s'] * 1e3:.0f}"
                  f" ms/step); load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            for k, v in st.items():
                print(f"    {k:<24} {v * 1e3:8.2f} ms", file=sys.stderr, flush=True)
    shutil.rmtree(site, ignore_errors=True)
    print(json.dumps({"benchmark": "plan_auto_full_breakdown", "work": str(work), "steps": args.steps,
                      "skip": args.skip, "global_batch": args.batch, "plans": {k: str(v) for k, v in plans.items()},
                      "results": res, "load_average_before": load0, "load_average_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
