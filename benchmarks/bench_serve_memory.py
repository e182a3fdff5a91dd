"""Resident memory of ``embedscale serve --workers N``: do the workers share one copy of the tables?

An INT8 DLRM export over the criteo-kaggle tables (``--max-rows`` caps them; 0: full size, 33.8M rows) is served
by ``--workers 1`` and then ``--workers 2`` (each on 127.0.0.1, after ``--requests`` ranking requests of
``--rows`` candidates so every worker has touched its tables). The figure is the proportional set size (PSS,
``/proc/PID/smaps_rollup``: a page shared by k processes counts 1/k in each) summed over the server's process
tree, so pages the workers share (the memory-mapped tables, the libraries) count once; RSS sums are reported
beside it. The bar: two workers at most 1.2x the memory of one. Prints one JSON line.

    .venv/bin/python benchmarks/bench_serve_memory.py [--max-rows 0] [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_serve import free_port, make_exports, request_bodies  # noqa: E402

from embedscale.data.synthetic import PRESETS  # noqa: E402


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        todo.extend(kids.get(q, []))
    return out


def memory_kib(pids: list[int]) -> dict:
    pss = rss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
        except OSError:
            continue
    return {"pss_kib": pss, "rss_kib": rss, "processes": len(pids)}


def measure(export: Path, workers: int, bodies: list[bytes], requests: int) -> dict:
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "embedscale", "serve", str(export), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", str(workers), "--max-rows", "1024"],
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(url + "/readyz", timeout=2).status_code == 200
                if ready and len(tree(proc.pid)) >= (1 if workers == 1 else workers + 1):  # uvicorn: + a supervisor
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        with httpx.Client(timeout=120) as c:  # bounded: ``requests`` calls; both workers take some
            codes = [c.post(url + "/v1/predict", content=bodies[i % len(bodies)]).status_code for i in range(requests)]
        time.sleep(2)
        return {**memory_kib(tree(proc.pid)), "ok": codes.count(200), "requests": requests}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-rows", type=int, default=0, help="cap every table's rows (0: full criteo-kaggle)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    cap = args.max_rows or 10**12
    tables = [min(int(r), cap) for r in PRESETS["criteo-kaggle"]]
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_exports(Path(tmp), cap, args.dim, forms=("int8",))
        bodies = request_bodies(32, args.rows, tables)
        one = measure(paths["int8"], 1, bodies, args.requests)
        two = measure(paths["int8"], 2, bodies, args.requests)
        table_bytes = json.loads((paths["int8"] / "export.json").read_text())["table_bytes"]
    print(json.dumps({"benchmark": "serve_workers_memory", "figure": round(two["pss_kib"] / one["pss_kib"], 3),
                      "unit": "PSS of 2 workers / PSS of 1", "bar": 1.2, "one_worker": one, "two_workers": two,
                      "rss_ratio": round(two["rss_kib"] / one["rss_kib"], 3), "table_bytes": table_bytes,
                      "load": os.getloadavg(), "config": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
