"""GPU smoke run: the device paths of training on one GPU in under 5 minutes. Designed for, untested on GPU.

There is no GPU where this was written: every figure it prints on a GPU is unmeasured by its authors. What
runs in CI is ``--dry-run``: the same functions on the CPU at tiny sizes (under 30 s), so the script never
rots. The device is chosen as a run chooses it: ``train.device`` (``cuda:0`` here, ``cpu`` with
``--dry-run``), checked by ``specs.check_device``.

Figures, one JSON line each (figure, baseline, ratio, median and p90, load, config):

* ``embedding_step``: one training step (forward, backward, fused row-wise Adagrad update) of
  ``LocalEmbeddingBags`` (the address-mapped flat storage of a rank's tables) against FBGEMM's TBE
  (``SplitTableBatchedEmbeddingBagsCodegen``, ``EmbeddingLocation.DEVICE`` on the GPU, ``HOST``/CPU in a dry
  run) from the same weights, steps interleaved; samples/s from the median and p90 step time, and the
  largest difference of the pooled output and of the updated rows between the two after one step. Without
  ``fbgemm_gpu`` (or, on a GPU, without its CUDA build) the baseline is ``null``.
* ``dlrm_mixed``: a single-process DLRM trained by ``workflow.train`` with one table of each form: rows in the
  flat storage, a tensor-train table (EL-Rec III) and a table on the host parameter server (EL-Rec V), against
  the same run with every table as rows (runs interleaved, ``--rounds``); training samples/s from the
  summary's step times (median, p90) and the final eval logloss of both.

The serving kernel has no figure here yet.

    .venv/bin/python benchmarks/gpu_smoke.py            # on a machine with a GPU
    .venv/bin/python benchmarks/gpu_smoke.py --dry-run  # anywhere: the same code paths on the CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embedscale import workflow
from embedscale.data.batch import JaggedFeatures
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import ConfigError
from embedscale.specs import RunConfig, TableSpec, check_device, from_dict


@dataclass
class Sizes:
    rows: tuple[int, ...]  # embedding_step: rows per table
    dim: int
    batch: int
    pooling: int  # ids per sample and feature
    steps: int
    samples: int  # dlrm_mixed: rows of the dataset
    table_rows: tuple[int, int, int]  # rows / TT / host table
    dlrm_batch: int
    dlrm_steps: int


GPU = Sizes(rows=(1_000_000,) * 8, dim=64, batch=8192, pooling=8, steps=50, samples=1_000_000,
            table_rows=(1_000_000, 4_000_000, 2_000_000), dlrm_batch=8192, dlrm_steps=100)
DRY = Sizes(rows=(500, 300, 200), dim=8, batch=64, pooling=2, steps=4, samples=1_200, table_rows=(300, 600, 400),
            dlrm_batch=64, dlrm_steps=6)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fbgemm_tbe(device: torch.device):
    """FBGEMM's TBE and its enums, or ``None`` (not installed, or no CUDA build for a GPU run)."""
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)
    except Exception as e:  # ImportError, or a build whose kernels fail to load
        log(f"fbgemm_gpu not usable ({type(e).__name__}: {e}): no baseline")
        return None
    TBE = SplitTableBatchedEmbeddingBagsCodegen
    if device.type == "cuda":
        return TBE, EmbeddingLocation.DEVICE, ComputeDevice.CUDA, OptimType, PoolingMode
    return TBE, EmbeddingLocation.HOST, ComputeDevice.CPU, OptimType, PoolingMode


def timed(methods: dict, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Each method's step times, the methods interleaved (order rotating), after two warm-up steps each."""
    for fn in methods.values():
        for _ in range(2):
            fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in methods}
    order = list(methods)
    for i in range(steps):
        for name in order[i % len(order):] + order[:i % len(order)]:
            sync(device)
            t0 = time.perf_counter()
            methods[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def rates(times: list[float], per_step: int) -> dict:
    s = sorted(times)
    p90 = s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]
    return {"median": round(per_step / statistics.median(s), 1), "p90": round(per_step / p90, 1)}


def embedding_step(device: torch.device, z: Sizes, seed: int = 0) -> dict:
    """``embedding_step``: ours against FBGEMM's TBE on ``device`` (module docstring)."""
    T, B, L, D = len(z.rows), z.batch, z.pooling, z.dim
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, n, (B * L,), generator=g) for n in z.rows]).to(device)
    names = [f"f{t}" for t in range(T)]
    jf = JaggedFeatures(names, ids, torch.full((T * B,), L, dtype=torch.int64, device=device))
    offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64, device=device)
    grad = torch.randn(B, T * D, generator=g).to(device)
    ours = LocalEmbeddingBags([TableSpec(n, r, D) for n, r in zip(names, z.rows)], device=device,
                              optimizer="rowwise_adagrad", lr=0.01, eps=1e-8, seed=seed, validate=False)
    w0 = [ours.table_weight(n).detach().clone() for n in names]

    def step_ours():
        out = ours(jf)
        (out * grad).sum().backward()
        return out

    methods, agreement, tbe = {"ours": step_ours}, None, None
    mod = fbgemm_tbe(device)
    if mod is not None:
        TBE, where, compute, optim, pooling = mod
        tbe = TBE([(r, D, where, compute) for r in z.rows], optimizer=optim.EXACT_ROWWISE_ADAGRAD,
                  learning_rate=0.01, eps=1e-8, pooling_mode=pooling.SUM,
                  **({"device": device} if device.type == "cuda" else {}))
        with torch.no_grad():
            for w, w_ours in zip(tbe.split_embedding_weights(), w0):
                w.copy_(w_ours)

        def step_tbe():
            out = tbe(ids, offsets)
            (out * grad).sum().backward()
            return out

        a, b = step_ours().detach(), step_tbe().detach()  # one step each from the same weights
        rows = max(float((x - ours.table_weight(n)[:x.shape[0]]).abs().max())
                   for x, n in zip(tbe.split_embedding_weights(), names))
        agreement = {"output_max_abs_diff": float((a - b).abs().max()), "rows_max_abs_diff": rows}
        methods["fbgemm"] = step_tbe
    times = timed(methods, z.steps, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"figure": "embedding_step", "unit": "samples/s", "ours": rates(times["ours"], B),
            "baseline": rates(times["fbgemm"], B) if tbe is not None else None,
            "baseline_name": "fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen EXACT_ROWWISE_ADAGRAD SUM"
            if tbe is not None else None,
            "ratio": round(med["fbgemm"] / med["ours"], 3) if tbe is not None else None,
            "agreement": agreement,
            "config": {"tables": T, "rows": list(z.rows), "dim": D, "batch": B, "ids_per_feature": L,
                       "steps": z.steps}}


def write_data(d: Path, z: Sizes, seed: int = 0) -> None:
    """A dataset for ``dlrm_mixed``: 4 dense features, three one-hot sparse ones (one per table), a label from a
    fixed logistic rule of both."""
    rng = np.random.default_rng(seed)
    n = z.samples
    dense = rng.normal(size=(n, 4)).astype(np.float32)
    ids = [rng.zipf(1.2, n) % r for r in z.table_rows]
    logit = dense[:, 0] - 0.5 * dense[:, 1] + 0.8 * (ids[0] % 3 == 0) - 0.6 * (ids[1] % 2 == 0) + 0.4 * (ids[2] < 5)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    sp = [SparseFeatureInfo(f"C{i + 1}", r) for i, r in enumerate(z.table_rows)]
    with ShardWriter(d, [f"I{i}" for i in range(4)], sp, shard_rows=max(1, n // 4)) as w:
        w.write(labels, dense, {f"C{i + 1}": ids[i] for i in range(3)})


def dlrm_config(d: Path, out: Path, device: str, z: Sizes, mixed: bool) -> RunConfig:
    rows, tt, host = z.table_rows
    tables = [{"name": "rows", "num_rows": rows, "dim": 16, "features": ["C1"]},
              {"name": "tt", "num_rows": tt, "dim": 16, "features": ["C2"],
               **({"compression": "tt", "tt_rank": 8} if mixed else {})},
              {"name": "host", "num_rows": host, "dim": 16, "features": ["C3"],
               **({"placement": "host"} if mixed else {})}]
    return from_dict(RunConfig, {
        "name": "gpu_smoke", "out_dir": str(out),
        "data": {"source": "shards", "path": str(d), "eval_fraction": 0.1},
        "model": {"arch": "dlrm", "embedding_dim": 16, "bottom_mlp": [32, 16], "top_mlp": [32], "tables": tables},
        "train": {"device": device, "batch_size": z.dlrm_batch, "max_steps": z.dlrm_steps, "eval_every": 0,
                  "prefetch": 2, "dropout": 0.0},
    })


def dlrm_mixed(device: str, z: Sizes, rounds: int) -> dict:
    """``dlrm_mixed``: the mixed-form run against the all-rows run (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        d = Path(tmp) / "data"
        write_data(d, z)
        runs: dict[str, list[dict]] = {"mixed": [], "rows": []}
        for r in range(rounds):
            for name in (("rows", "mixed") if r % 2 == 0 else ("mixed", "rows")):
                cfg = dlrm_config(d, Path(tmp) / "runs", device, z, mixed=name == "mixed")
                runs[name].append(workflow.train(cfg, Path(tmp) / f"{name}{r}", resume=False, progress=False))
    step = {k: [s["train_step_seconds"] for s in v] for k, v in runs.items()}
    med = {k: statistics.median(x["median"] for x in v) for k, v in step.items()}
    p90 = {k: statistics.median(x["p90"] for x in v) for k, v in step.items()}
    fig = lambda k: {"median": round(z.dlrm_batch / med[k], 1), "p90": round(z.dlrm_batch / p90[k], 1),  # noqa: E731
                     "eval_logloss": round(statistics.median(s["eval_logloss"] for s in runs[k]), 5)}
    return {"figure": "dlrm_mixed", "unit": "samples/s", "ours": fig("mixed"), "baseline": fig("rows"),
            "baseline_name": "the same DLRM with every table as rows in the flat storage",
            "ratio": round(med["rows"] / med["mixed"], 3),
            "config": {"table_rows": list(z.table_rows), "forms": ["rows", "tt (rank 8)", "host"],
                       "samples": z.samples, "batch": z.dlrm_batch, "steps": z.dlrm_steps, "rounds": rounds}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same code paths on the CPU at tiny sizes (CI)")
    ap.add_argument("--device", default="", help="train.device (default cuda:0; cpu with --dry-run)")
    ap.add_argument("--rounds", type=int, default=0, help="dlrm_mixed runs of each kind (default 2; 1 dry)")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.dry_run else "cuda:0")
    try:
        check_device(device)  # as a run's train.device is checked: a named error when the device is absent
    except ConfigError as e:
        sys.exit(f"gpu_smoke: {e} (--dry-run runs on the CPU)")
    z = DRY if args.dry_run else GPU
    rounds = args.rounds or (1 if args.dry_run else 2)
    common = {"device": device, "dry_run": args.dry_run, "torch": torch.__version__,
              "note": "designed for, untested on GPU"}
    for fn in (lambda: embedding_step(torch.device(device), z), lambda: dlrm_mixed(device, z, rounds)):
        load = os.getloadavg()[0]
        line = fn()
        line.update(common, load_start=round(load, 2), load_end=round(os.getloadavg()[0], 2))
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
