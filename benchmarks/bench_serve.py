"""The prediction server under load: INT8 tables against the FP32 export of the same model, same host, same run.

A DLRM over synthetic Criteo-Kaggle-shaped tables (26 tables, rows capped at ``--max-rows``, dim 16, OPER's
MLP sizes; random weights: serving cost does not depend on what was learned) is exported twice, with INT8
and with FP32 tables. Three servers run on 127.0.0.1 (each its own process): ``embedscale serve`` of the INT8
export (ours), of the FP32 export, and the baseline: the same server and INT8 export with TorchRec's quantized
``EmbeddingBagCollection`` (FBGEMM's INT8 kernel) as the tables' lookup (``_torchrec_serve.py``: same HTTP stack,
same micro-batching, same dense model). Two load generators run against each, the variants interleaved round
by round so machine load hits them alike:

* closed loop: ``--concurrency`` clients, each sending its next request when the last is answered;
* open loop: requests sent at a fixed offered rate (``--rate`` per second) whatever the answers, so queueing
  shows in the latency (a request that finds the queue full is counted as a 503, not retried).

A request is a ranking call: ``--rows`` candidate rows of raw ids (the export is id-encoded). Every loop is
bounded in requests and seconds. Prints one JSON line per load mode on stdout: QPS and p50/p90/p99/p99.9
latency of ours (INT8) and the baseline (TorchRec INT8; FP32 beside it), the ratio of their QPS, the load
average, the config.

    .venv/bin/python benchmarks/bench_serve.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from embedscale.data.synthetic import PRESETS  # noqa: E402
from embedscale.models import build_model  # noqa: E402
from embedscale.serve.export import FORMAT, VERSION, write_export  # noqa: E402
from embedscale.serve.quantize import quantize_rows, row_bytes  # noqa: E402
from embedscale.specs import ModelConfig, TableSpec  # noqa: E402


def make_exports(out: Path, max_rows: int, dim: int, forms=("int8", "fp32")) -> dict[str, Path]:
    """One random DLRM exported with INT8 and with FP32 tables (id-encoded: request values are rows)."""
    rows = [min(int(r), max_rows) for r in PRESETS["criteo-kaggle"]]
    specs = [TableSpec(f"t_C{i + 1}", n, dim, [f"C{i + 1}"]) for i, n in enumerate(rows)]
    cfg = ModelConfig(arch="dlrm", embedding_dim=dim, bottom_mlp=[512, 256, 64], top_mlp=[512, 256])
    torch.manual_seed(0)
    model = build_model(cfg, specs, 13)
    emb = model.sparse_arch.embedding
    dense = {f"dense.{k}": v.contiguous() for k, v in model.state_dict().items()
             if not k.startswith("sparse_arch.embedding.")}
    encoding = {"dense": [f"I{i}" for i in range(1, 14)],
                "sparse": [{"name": t.features[0], "num_rows": t.num_rows, "multi_hot": False} for t in specs],
                "schema": None, "categorical": "ids", "dense_stats": None}
    paths = {}
    for form in forms:
        tensors = dict(dense)
        tables = []
        for t in specs:
            tensors[f"table.{t.name}"] = quantize_rows(emb.table_weight(t.name).detach(), form)
            tables.append({"name": t.name, "features": list(t.features), "num_rows": t.num_rows, "dim": dim,
                           "pooling": "sum", "form": form, "bytes_per_row": row_bytes(form, dim)})
        manifest = {"format": FORMAT, "version": VERSION, "model_version": f"bench-{form}", "created": "",
                    "source": {}, "eval": {}, "num_dense": 13, "tables": tables, "encoding": encoding,
                    "weights": "weights.safetensors",
                    "model": {k: getattr(cfg, k) for k in ("arch", "embedding_dim", "bottom_mlp", "top_mlp",
                                                           "cross_layers", "cross_low_rank")},
                    "table_bytes": sum(t["bytes_per_row"] * t["num_rows"] for t in tables)}
        paths[form] = out / form
        write_export(paths[form], manifest, tensors)
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(export: Path, args: argparse.Namespace, torchrec: bool = False) -> tuple[subprocess.Popen, str]:
    """One server on 127.0.0.1: ``embedscale serve``, or with ``torchrec`` the same server with TorchRec's
    quantized EmbeddingBagCollection as its lookup (``_torchrec_serve.py``)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "_torchrec_serve.py")] if torchrec else \
        [sys.executable, "-m", "embedscale", "serve"]
    proc = subprocess.Popen([*cmd, str(export), "--host", "127.0.0.1",
                             "--port", str(port), "--max-batch", str(args.max_batch), "--max-wait-ms",
                             str(args.max_wait_ms), "--max-rows", str(max(args.rows, 1024))],
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{export}: the server did not start")


def request_bodies(n: int, rows: int, tables: list[int], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        reqs = []
        for _ in range(rows):
            r = {f"I{i}": int(rng.integers(0, 100)) for i in range(1, 14)}
            r.update({f"C{j + 1}": int(min(rng.zipf(1.2), t) - 1) for j, t in enumerate(tables)})
            reqs.append(r)
        out.append(json.dumps({"rows": reqs}).encode())
    return out


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    import httpx

    lat, codes = [], []
    t_end = time.monotonic() + seconds

    async def client(k: int) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            i = k
            while time.monotonic() < t_end and i < 100_000:  # bounded in time and count
                t0 = time.perf_counter()
                r = await c.post(url + "/v1/predict", content=bodies[i % len(bodies)])
                lat.append(time.perf_counter() - t0)
                codes.append(r.status_code)
                i += concurrency

    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    return summary(lat, codes, time.monotonic() - t0)


async def open_loop(url: str, bodies: list[bytes], rate: float, seconds: float) -> dict:
    import httpx

    lat, codes = [], []
    n = int(rate * seconds)

    async def one(c, i: int) -> None:
        t0 = time.perf_counter()
        try:
            r = await c.post(url + "/v1/predict", content=bodies[i % len(bodies)])
            codes.append(r.status_code)
        except httpx.HTTPError:
            codes.append(0)
        lat.append(time.perf_counter() - t0)

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=512)) as c:
        tasks = []
        for i in range(n):  # a fixed schedule: request i at i / rate
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(c, i)))
        await asyncio.gather(*tasks)
    return summary(lat, codes, time.monotonic() - t0)


def summary(lat: list[float], codes: list[int], wall: float) -> dict:
    ok = [x for x, c in zip(lat, codes) if c == 200]
    q = (lambda p: float(np.percentile(ok, p)) * 1000) if ok else (lambda p: float("nan"))
    return {"requests": len(codes), "ok": len(ok), "503": codes.count(503), "failed": len(codes) - len(ok)
            - codes.count(503), "qps": len(ok) / wall, "p50_ms": q(50), "p90_ms": q(90), "p99_ms": q(99),
            "p999_ms": q(99.9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rows", type=int, default=100, help="candidate rows per request")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rate", type=float, default=20.0, help="open loop: requests per second offered")
    ap.add_argument("--seconds", type=float, default=10.0, help="per load run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--max-wait-ms", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="small tables, short runs")
    ap.add_argument("--no-torchrec", action="store_true", help="without the TorchRec baseline (torchrec not installed)")
    args = ap.parse_args()
    if args.quick:
        args.max_rows, args.seconds, args.repeats, args.rows = 10_000, 3.0, 2, 20
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_exports(Path(tmp), args.max_rows, args.dim)
        tables = [min(int(r), args.max_rows) for r in PRESETS["criteo-kaggle"]]
        bodies = request_bodies(64, args.rows, tables)
        servers = {form: start(p, args) for form, p in paths.items()}
        if not args.no_torchrec:
            servers["torchrec-int8"] = start(paths["int8"], args, torchrec=True)
        runs = {(mode, form): [] for mode in ("closed", "open") for form in servers}
        try:
            for rep in range(args.repeats):
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))  # interleaved, rotated
                for form in order:
                    url = servers[form][1]
                    runs["closed", form].append(asyncio.run(closed_loop(url, bodies, args.concurrency, args.seconds)))
                    runs["open", form].append(asyncio.run(open_loop(url, bodies, args.rate, args.seconds)))
                    print(f"round {rep}: {form} closed {runs['closed', form][-1]['qps']:.1f} qps, open p99 "
                          f"{runs['open', form][-1]['p99_ms']:.1f} ms", file=sys.stderr)
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    config = {k: v for k, v in vars(args).items()}
    for mode in ("closed", "open"):
        med = {form: {k: statistics.median(r[k] for r in runs[mode, form]) for k in runs[mode, form][0]}
               for form in servers}
        p90 = {form: float(np.percentile([r["qps"] for r in runs[mode, form]], 90)) for form in servers}
        base = "torchrec-int8" if "torchrec-int8" in med else "fp32"
        print(json.dumps({"figure": f"serve_{mode}_loop_qps_int8", "value": med["int8"]["qps"],
                          "baseline": ("the same INT8 model with TorchRec's quantized EmbeddingBagCollection as its "
                                       "lookup, same server, same run") if base != "fp32" else
                                      "the same model's FP32 export, same server, same run",
                          "baseline_value": med[base]["qps"],
                          "ratio": med["int8"]["qps"] / med[base]["qps"] if med[base]["qps"] else None,
                          "ratio_vs_fp32": med["int8"]["qps"] / med["fp32"]["qps"] if med["fp32"]["qps"] else None,
                          "median": med, "p90_qps": p90, "load": {"start": load0, "end": os.getloadavg()},
                          "config": config}))


if __name__ == "__main__":
    main()
