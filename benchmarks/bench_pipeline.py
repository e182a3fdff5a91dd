"""Pipelined host-table training vs sequential (EL-Rec, SC 2022, section V, Fig. 16: 1.30x on average).

A DLRM on synthetic Criteo-Kaggle-shaped data (power-law rows, tables capped at ``--max-rows``) whose
largest tables (every table with at least ``--host-min-rows`` rows) are ``placement: host``: they live in
the host parameter server, the others in a device-side ``LocalEmbeddingBags``. The same model on the same
batches is trained, alternating within one run (so machine load hits every variant alike), with

* baseline: ``pipeline depth 1``, sequential (EL-Rec's "prefetch queue of length 1": the server reads
  batch t only after it applied batch t-1's gradients), at its best on the same cores: with 1 intra-op
  thread (``seq``) and with as many intra-op threads as the pipeline has cores (``seq_2threads``: the
  sequential run's ops spread over both cores); the baseline is the faster of the two (the
  pipeline uses a second core, so the sequential run must be offered it too);
* ours: ``pipeline depth k`` (default 2 and 4) with 1 intra-op thread (``depthk``: trainer, server and
  patcher threads on the 2 cores) and with 2 (``depthk_2threads``); the figure is the best of them.

Every variant starts from the same state and each pipelined run is checked bit for bit against the
sequential one with the same intra-op threads (losses, host tables). Throughput is end-to-end training
samples/s over the pass, pipeline start and drain included; medians over ``--repeats`` rounds, the variants
of a round in a rotated order. Per-thread CPU seconds give the idle-machine bound (sequential trainer + server
CPU over the larger thread of the pipelined run), which separates "nothing to overlap" from "no idle core".

Headline workload: host features multi-hot (``--pooling-factor`` ids per sample, as the large features of
production DLRMs; Criteo's are one-hot) and a mid-sized MLP. The run also measures (``--no-onehot`` skips
it) the one-hot Criteo DLRM with OPER's MLP sizes, where the host work is a few percent of a CPU step.

Prints one JSON line on stdout; progress on stderr; writes a report, ``pipeline.md``, into a temporary
directory (``--out`` names another path), or into ``benchmarks/results/`` with ``--record`` (the recorded result).

    .venv/bin/python benchmarks/bench_pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from embedscale.data.loader import ShardLoader
from embedscale.data.synthetic import SyntheticGenerator, generate_dataset
from embedscale.io import atomic_write_text
from embedscale.models import build_model, dense_parameters
from embedscale.pipeline import PipelinedEmbedding, PipelinedLoader
from embedscale.plan.forms import TableForm
from embedscale.specs import ModelConfig, SyntheticConfig


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Workload:
    """One benchmark configuration: data, model, and its initial state to restore before every run."""

    def __init__(self, name: str, data_root: Path, *, batch_size: int, batches: int, max_rows: int,
                 host_min_rows: int, pooling_factor: int, dim: int, bottom: list[int], top: list[int]) -> None:
        self.name = name
        probe = SyntheticGenerator(SyntheticConfig(preset="criteo-kaggle", max_rows=max_rows), 0)
        host_idx = [t for t, n in enumerate(probe.num_rows) if n >= host_min_rows]
        pfs = [pooling_factor if t in host_idx else 1 for t in range(len(probe.num_rows))]
        cfg = SyntheticConfig(preset="criteo-kaggle", max_rows=max_rows, pooling_factors=pfs)
        specs = SyntheticGenerator(cfg, 0).table_specs(dim)
        self.specs = specs
        self.forms = {s.name: TableForm("host") if t in host_idx else TableForm() for t, s in enumerate(specs)}
        self.host = [s for s in self.specs if self.forms[s.name].kind == "host"]
        d = data_root / f"pf{pooling_factor}_rows{max_rows}_b{batch_size}x{batches}"
        if not (d / "manifest.json").exists():
            log(f"[{name}] generating {batches * batch_size:,} samples into {d}")
            generate_dataset(cfg, d, batches * batch_size, seed=0, progress=False)
        self.batches = list(ShardLoader(d, batch_size, prefetch=0))[:batches]
        self.batch_size = batch_size
        self.config = {"model": "dlrm", "bottom_mlp": bottom, "top_mlp": top, "dim": dim, "batch_size": batch_size,
                       "batches": len(self.batches), "host_tables": [s.name for s in self.host],
                       "host_rows": sum(s.num_rows for s in self.host), "host_pooling_factor": pooling_factor,
                       "device_tables": len(self.specs) - len(self.host), "optimizer": "rowwise_adagrad"}
        self.emb = PipelinedEmbedding.from_tables(self.specs, self.forms, optimizer="rowwise_adagrad", lr=0.05, seed=0)
        torch.manual_seed(0)
        self.model = build_model(ModelConfig(arch="dlrm", embedding_dim=dim, bottom_mlp=bottom, top_mlp=top),
                                 self.specs, cfg.num_dense, embedding=self.emb)
        self.opt = torch.optim.Adagrad(list(dense_parameters(self.model)), lr=0.05)
        self.init = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.opt_init = copy.deepcopy(self.opt.state_dict())  # state_dict() holds references to live state
        self.lossf = nn.BCEWithLogitsLoss()
        log(f"[{name}] host tables {self.config['host_tables']} ({self.config['host_rows']:,} rows, pooling "
            f"factor {pooling_factor}); {self.config['device_tables']} device tables; "
            f"{len(self.batches)} batches of {batch_size}")

    def run(self, depth: int, threads: int = 1) -> dict:
        self.model.load_state_dict(self.init)
        self.opt.load_state_dict(copy.deepcopy(self.opt_init))
        torch.set_num_threads(threads)
        loader = PipelinedLoader(self.batches, self.emb, depth)
        losses = []
        t0, c0, tc0 = time.perf_counter(), time.process_time(), time.thread_time()
        for b in loader:
            loss = self.lossf(self.model(b.dense, b.sparse), b.labels)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            losses.append(loss.detach())
        wall, cpu, tcpu = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - tc0
        torch.set_num_threads(1)
        st = loader.last_stats
        return {"sps": len(self.batches) * self.batch_size / wall, "cpu_per_wall": cpu / wall, "trainer_cpu": tcpu,
                "server_cpu": st["server_cpu_s"] + st.get("patcher_cpu_s", 0.0), "stats": st,
                "losses": torch.stack(losses),
                "host": self.emb.host_state()}

    def rows_of_last_k(self, k: int) -> int:
        """Most host rows (counted per batch, as the cache holds them) in any k consecutive batches."""
        sizes = [sum(hr.rows.numel() for hr in self.emb.server.prepare(b.sparse)) for b in self.batches]
        return max(sum(sizes[max(0, t - k + 1):t + 1]) for t in range(len(sizes)))


def variants(depths: list[int], threads: list[int]) -> list[tuple[str, int, int]]:
    """``(name, depth, intra-op threads)`` of every run of a round: sequential first, then each depth."""
    sfx = lambda t: "" if t == 1 else f"_{t}threads"  # noqa: E731
    return [(f"seq{sfx(t)}", 1, t) for t in threads] + [(f"depth{k}{sfx(t)}", k, t) for k in depths for t in threads]


def measure(w: Workload, depths: list[int], repeats: int, threads: list[int]) -> dict:
    runs = variants(depths, threads)
    results: dict[str, list[dict]] = {n: [] for n, _, _ in runs}
    exact = True
    for r in range(repeats):
        # rotate the order every round: no variant always follows the same one (allocator, caches, load)
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for name, depth, t in order:
            results[name].append(w.run(depth, threads=t))
        for name, depth, t in runs:  # bitwise: every pipelined run against the sequential one, same threads
            res, seq = results[name][-1], results[f"seq{'' if t == 1 else f'_{t}threads'}"][-1]
            if depth > 1:
                exact &= torch.equal(res["losses"], seq["losses"]) and all(
                    torch.equal(res["host"][key], seq["host"][key]) for key in seq["host"])
        log(f"[{w.name}] round {r + 1}/{repeats}: " + ", ".join(f"{n} {v[-1]['sps']:,.0f}/s" for n, v in
                                                                results.items()) + f"; bitwise equal: {exact}")
        for v in results.values():  # keep memory flat
            v[-1].pop("host")
            v[-1].pop("losses")
    med = {n: statistics.median(x["sps"] for x in v) for n, v in results.items()}
    p90 = {n: float(np.percentile([x["sps"] for x in v], 10)) for n, v in results.items()}  # p90 pass time
    tcpu = {n: statistics.median(x["trainer_cpu"] for x in v) for n, v in results.items()}
    scpu = {n: statistics.median(x["server_cpu"] for x in v) for n, v in results.items()}
    seqs = [n for n, d, _ in runs if d == 1]
    pipes = [n for n, d, _ in runs if d > 1]
    base = max(seqs, key=lambda n: med[n])
    best = max(pipes, key=lambda n: med[n])
    one = [f"depth{k}" for k in depths]
    return {
        "median_sps": {n: round(v, 1) for n, v in med.items()},
        "sps_at_p90_time": {n: round(v, 1) for n, v in p90.items()},
        "ratio_vs_seq": {n: round(v / med["seq"], 3) for n, v in med.items()},
        "ratio_vs_best_seq": {n: round(v / med[base], 3) for n, v in med.items()},
        "best_seq": base,
        "best_pipelined": best,
        "best_depth": max(depths, key=lambda k: med[f"depth{k}"]),
        "ratio": round(med[best] / med[base], 3),
        "ratio_1thread_vs_seq_1thread": round(max(med[n] for n in one) / med["seq"], 3),
        "cpu_per_wall": {n: round(statistics.median(x["cpu_per_wall"] for x in v), 2) for n, v in results.items()},
        "trainer_thread_cpu_s": {n: round(v, 3) for n, v in tcpu.items()},
        "server_thread_cpu_s": {n: round(v, 3) for n, v in scpu.items()},
        "idle_2core_bound": {f"depth{k}": round((tcpu["seq"] + scpu["seq"]) / max(tcpu[f"depth{k}"],
                                                                                   scpu[f"depth{k}"]), 3)
                             for k in depths},
        "bitwise_equal_to_sequential": exact,
        "cache_peak_rows": {k: results[f"depth{k}"][0]["stats"]["cache_peak_rows"] for k in depths},
        "rows_of_last_k_batches_max": {k: w.rows_of_last_k(k) for k in depths},
        "patched_rows_per_pass": {k: results[f"depth{k}"][0]["stats"]["patched_rows"] for k in depths},
    }


def table(res: dict) -> list[str]:
    lines = ["| run | median samples/s | at the p90 pass time | vs sequential, 1 thread | vs best sequential | "
             "CPU s per wall s | trainer thread CPU s | server + patcher threads CPU s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, v in res["median_sps"].items():
        lines.append(f"| {n} | {v:,.0f} | {res['sps_at_p90_time'][n]:,.0f} | {res['ratio_vs_seq'][n]:.3f}x | "
                     f"{res['ratio_vs_best_seq'][n]:.3f}x | {res['cpu_per_wall'][n]:.2f} | "
                     f"{res['trainer_thread_cpu_s'][n]:.2f} | {res['server_thread_cpu_s'][n]:.2f} |")
    lines += ["", f"Figure: {res['best_pipelined']} against the best sequential run ({res['best_seq']}): "
              f"**{res['ratio']:.3f}x**; one intra-op thread each (the former figure): "
              f"{res['ratio_1thread_vs_seq_1thread']:.3f}x.",
              "", "Idle 2-core bound (sequential trainer + server CPU s over the pipelined run's larger thread; "
              "derived, not measured): " + ", ".join(f"{k} {v:.2f}x" for k, v in res["idle_2core_bound"].items()),
              "", f"Bitwise equal to sequential (losses, host tables): **{res['bitwise_equal_to_sequential']}**. "
              "Life-cycle cache peak vs the most host rows of k consecutive batches (the bound): " +
              "; ".join(f"depth {k}: {res['cache_peak_rows'][k]:,} <= {res['rows_of_last_k_batches_max'][k]:,}"
                        for k in res["cache_peak_rows"]) + "."]
    return lines


def write_markdown(out: dict, path: Path) -> None:
    """The report (``pipeline.md``) of a run from its JSON line."""
    c = out["config"]
    res, config, onehot, best, command = c, c, c.get("onehot_oper_dlrm"), c["best_pipelined"], c["command"]
    repeats = c["repeats"]
    lines = ["# Pipelined host-table training (EL-Rec section V, Fig. 16)", "", f"Command: `{command}`", "",
             f"DLRM (bottom {config['bottom_mlp']}, top {config['top_mlp']}, dim {config['dim']}), batch "
             f"{config['batch_size']}, {config['batches']} batches per run, {repeats} rounds (the variants of a "
             f"round in a rotated order); host tables {config['host_tables']} ({config['host_rows']:,} rows, "
             f"{config['host_pooling_factor']} ids per sample), {config['device_tables']} one-hot device tables; "
             "row-wise Adagrad; a trainer thread, a server thread and, at depth >= 2, a cache-patcher thread. "
             f"Figure: {res['best_pipelined']} vs the best sequential run ({res['best_seq']}) = "
             f"**{res['ratio']:.3f}x** "
             "(EL-Rec Fig. 16: 1.30x, against sequential training on the same GPU).", ""]
    lines += table(res)
    if onehot is not None:
        oc = onehot["config"]
        lines += ["", f"## One-hot Criteo DLRM, OPER MLP sizes (bottom {oc['bottom_mlp']}, top {oc['top_mlp']})", "",
                  f"Host tables {oc['host_tables']}, one id per sample; {oc['batches']} batches of {oc['batch_size']}.",
                  ""]
        lines += table(onehot)
    lines += ["", f"Load average before {out['config']['loadavg_before']}, after {out['config']['loadavg_after']} on "
              f"{c['cores']} cores (Linux autogroup scheduling `sched_autogroup_enabled` = "
              f"{c['sched_autogroup_enabled']}). Pipelining only helps when the server and patcher threads find a "
              f"free core: CPU s per wall s, sequential {res['cpu_per_wall']['seq']:.2f}, {best} "
              f"{res['cpu_per_wall'][best]:.2f}. On a saturated machine only the total CPU work counts, "
              "which pipelining does not reduce. The idle 2-core bound is what the per-thread CPU times allow "
              "(derived, not measured).", "",
              "```json", json.dumps(out), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines))


def sched_autogroup() -> str:
    """Linux autogroup scheduling shares CPU per session: under contention a process gets the same share with
    one thread or two, so a second (server) thread only helps when a core is idle."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and repeats")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="intra-op thread counts every variant runs with (default 1 and 2: the machine's cores)")
    ap.add_argument("--max-rows", type=int, default=1_000_000, help="cap of every table's rows")
    ap.add_argument("--host-min-rows", type=int, default=50_000)
    ap.add_argument("--pooling-factor", type=int, default=16, help="mean ids per sample of the host features")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--bottom-mlp", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--top-mlp", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--no-onehot", action="store_true", help="skip the one-hot OPER-sized DLRM measurement")
    ap.add_argument("--data-dir", default="", help="where to keep the synthetic datasets (default: a temp dir)")
    ap.add_argument("--out", default="", help="the report's path (default: pipeline.md in a temporary directory)")
    ap.add_argument("--record", action="store_true", help="write the report to benchmarks/results/pipeline.md")
    ap.add_argument("--render", default="", help="only rewrite --out from a saved JSON line of an earlier run")
    args = ap.parse_args()
    if args.record:
        args.out = args.out or str(Path(__file__).parent / "results" / "pipeline.md")
    elif not args.out:
        args.out = str(Path(tempfile.mkdtemp(prefix="bench_pipeline-")) / "pipeline.md")
    if args.render:
        out = json.loads(Path(args.render).read_text())
        write_markdown(out, Path(args.out))
        return
    if args.quick:
        args.batches, args.repeats = 12, 3
    if 1 not in args.threads:
        ap.error("--threads must include 1 (the one-thread runs are the reference of the CPU-time bound)")
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    tmp = None
    root = Path(args.data_dir) if args.data_dir else None
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_pipeline_")
        root = Path(tmp.name)
    main_w = Workload("multi-hot", root, batch_size=args.batch_size, batches=args.batches, max_rows=args.max_rows,
                      host_min_rows=args.host_min_rows, pooling_factor=args.pooling_factor, dim=args.dim,
                      bottom=args.bottom_mlp, top=args.top_mlp)
    res = measure(main_w, args.depths, args.repeats, args.threads)
    config = dict(main_w.config)
    del main_w
    onehot = None
    if not args.no_onehot:
        w = Workload("one-hot", root, batch_size=args.batch_size, batches=max(6, args.batches // 2),
                     max_rows=args.max_rows, host_min_rows=args.host_min_rows, pooling_factor=1, dim=args.dim,
                     bottom=[512, 256, 64], top=[512, 256])
        onehot = {"config": w.config, **measure(w, [2], max(2, args.repeats - 2), args.threads)}
        del w
    load_after = os.getloadavg()
    best = res["best_pipelined"]
    command = " ".join([".venv/bin/python", "benchmarks/bench_pipeline.py"] + sys.argv[1:])
    out = {
        "benchmark": "pipeline",
        "figure": res["median_sps"][best],
        "baseline": res["median_sps"][res["best_seq"]],
        "figure_p90": res["sps_at_p90_time"][best],
        "baseline_p90": res["sps_at_p90_time"][res["best_seq"]],
        "ratio": res["ratio"],
        "unit": "training samples/s",
        "config": {**config, "torch_threads": args.threads, "repeats": args.repeats, **res,
                   "onehot_oper_dlrm": onehot,
                   "loadavg_before": [round(x, 2) for x in load_before],
                   "loadavg_after": [round(x, 2) for x in load_after], "cores": os.cpu_count(),
                   "sched_autogroup_enabled": sched_autogroup(), "command": command},
    }
    print(json.dumps(out))
    write_markdown(out, Path(args.out))
    log(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
