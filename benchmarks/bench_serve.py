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

A request holds ``--rows`` rows of raw ids (the export is id-encoded); ``--ranking``: one user context (the 13
counts, C1-C13) and ``--rows`` candidates (C14-C26), the common ranking call, which every server scores once
per context (``serve.ranking``: the dense-side work is the same for the baseline); ``--expanded`` adds ours
scoring each candidate as a whole row (what per-context scoring saves); ``--torchrec-expanded`` the baseline
so, as TorchRec's DLRM serves a ranking call (one sample a candidate, the context's features repeated in
each); ``--malloc-default`` ours with glibc's default ``malloc`` (what keeping freed memory saves). The
closed-loop line also gives each server's CPU milliseconds per answered request (``/proc``), which the host's
load does not inflate as it does the wall-clock figures. ``--workers``, ``--threads``, ``--dense``: the
servers' options, alike on every side.
``--max-rows 0``: full-size tables (33.8M rows). ``--overload-seconds``: then each server at half,
twice and half again its closed-loop rate measured just before in the same round (``--no-own-saturation``:
ours of the first rounds): the 503s' latency, the server's resident memory and the steady p99 before and after
(one more JSON line), twice, ours interleaved with the same server under other options
(``--overload-against``; by default as before: the GIL's switch interval at Python's 5 ms, the full queue
refused after routing, requests encoded on the event loop; and ours encoding on the loop). Every server stamps
its answers (``serve --timing-headers``), so a 503's time is split into the way to the server's Python code,
the server's own time and the way back; the event loop's and the compute thread's CPU, CPU wait and sleep
through the overload come from ``/proc``
(schedstat). ``--breakdown``: the server CPU a request by stage (parse, encode,
lookup, dense, respond; :func:`breakdown`), in the first line. The load
goes to 127.0.0.1 through a lean keep-alive HTTP client; every loop is bounded in requests and seconds. Prints
one JSON line per load mode on stdout: QPS and p50/p90/p99/p99.9 latency of ours (INT8) and the baseline (TorchRec INT8; FP32 beside it), the ratio of their QPS, the load
average, the config.

    .venv/bin/python benchmarks/bench_serve.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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


def table_rows(max_rows: int) -> list[int]:
    """criteo-kaggle's table sizes, capped at ``max_rows`` (0: full size, 33.8M rows in all)."""
    return [min(int(r), max_rows) if max_rows else int(r) for r in PRESETS["criteo-kaggle"]]


def make_exports(out: Path, max_rows: int, dim: int, forms=("int8", "fp32")) -> dict[str, Path]:
    """One random DLRM exported with INT8 and with FP32 tables (id-encoded: request values are rows)."""
    rows = table_rows(max_rows)
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


def run(coro):
    """``asyncio.run`` on uvloop when installed (the ``serve`` extra): a load generator that takes less of the
    cores the servers share with it."""
    gc.collect()  # the generator's own full collections stalled it 50-160 ms (counted as the servers' latency)
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])  # and its young ones (as the server's --gc-young)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def start(export: Path, args: argparse.Namespace, torchrec: bool = False,
          expand: bool = False, extra: tuple[str, ...] = (), env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """One server on 127.0.0.1: ``embedscale serve``, or with ``torchrec`` the same server with TorchRec's
    quantized EmbeddingBagCollection as its lookup (``_torchrec_serve.py``); ``extra``: more serve options (they
    win over the ones given here); ``env``: more environment for it."""
    import httpx

    port = free_port()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "_torchrec_serve.py")] if torchrec else \
        [sys.executable, "-m", "embedscale", "serve"]
    proc = subprocess.Popen([*cmd, str(export), "--host", "127.0.0.1",
                             "--port", str(port), "--max-batch", str(args.max_batch), "--max-wait-ms",
                             str(args.max_wait_ms), "--max-rows", str(max(args.rows, 1024)),
                             "--queue-rows", str(args.queue_rows), "--workers", str(args.workers),
                             "--threads", str(args.threads), "--dense", args.dense,
                             "--compute-nice", str(args.compute_nice), "--timing-headers",
                             *(["--expand-ranking"] if expand else []), *extra],
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # full-size tables under load: TorchRec's from_float takes minutes
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{export}: the server did not start")


def request_bodies(n: int, rows: int, tables: list[int], seed: int = 0, ranking: bool = False) -> list[bytes]:
    """``n`` request bodies of ``rows`` rows each; ``ranking``: one user context (the 13 counts and C1-C13) and
    ``rows`` candidates (C14-C26), the common ranking call."""
    rng = np.random.default_rng(seed)
    out = []
    cat = lambda j: int(min(rng.zipf(1.2), tables[j]) - 1)  # noqa: E731 - power-law ids, hot rows first
    for _ in range(n):
        if ranking:
            ctx = {f"I{i}": int(rng.integers(0, 100)) for i in range(1, 14)}
            ctx.update({f"C{j + 1}": cat(j) for j in range(13)})
            cands = [{f"C{j + 1}": cat(j) for j in range(13, len(tables))} for _ in range(rows)]
            out.append(json.dumps({"context": ctx, "candidates": cands}).encode())
            continue
        reqs = []
        for _ in range(rows):
            r = {f"I{i}": int(rng.integers(0, 100)) for i in range(1, 14)}
            r.update({f"C{j + 1}": cat(j) for j in range(len(tables))})
            reqs.append(r)
        out.append(json.dumps({"rows": reqs}).encode())
    return out


class Client:
    """A lean HTTP/1.1 client over asyncio streams for the load loops (keep-alive connections, pooled; loopback
    only): the load generator shares the host's 2 cores with the servers, and a light one leaves them more."""

    def __init__(self, url: str, timeout: float = 60.0):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        if host.strip("[]") not in ("127.0.0.1", "::1", "localhost"):
            raise SystemExit(f"{url}: load goes to loopback addresses only")
        self.host, self.port, self.timeout, self.idle = host.strip("[]"), int(port), timeout, []
        self.errors: list[str] = []
        self.made: dict = {}

    async def warm(self, n: int) -> None:
        """Open ``n`` keep-alive connections before the load starts (its requests then do not pay a connect)."""
        for _ in range(n):
            try:
                self.idle.append(await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout))
            except (OSError, asyncio.TimeoutError) as e:
                self.errors.append(repr(e))
                return

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, body)``; status 0 when the connection failed or timed out."""
        status, data, _ = await self.post_clock(path, body)
        return status, data

    async def post_clock(self, path: str, body: bytes) -> tuple[int, bytes, tuple | None]:
        """``(status, body, clock)``: ``clock`` is ``(sent, arrived, answered, read)`` in ns of the host's
        monotonic clock when the server stamps ``x-embedscale-clock`` (``serve --timing-headers``: its arrival
        in the server's Python code and its answer), else ``None``. A kept-alive connection the server has
        closed meanwhile (its idle timeout) is replaced once."""
        for attempt in range(2):
            reused = bool(self.idle) and attempt == 0  # the retry opens a new connection
            conn = self.idle.pop() if reused else None
            try:
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout)
                sent = time.monotonic_ns()
                status, data, keep, stamp = await asyncio.wait_for(self._exchange(conn, path, body), self.timeout)
                read = time.monotonic_ns()
                break
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ValueError, IndexError) as e:
                if conn is not None:
                    conn[1].close()
                if not (reused and isinstance(e, (IndexError, ConnectionError, asyncio.IncompleteReadError))):
                    self.errors.append(repr(e))
                    return 0, b"", None
        else:
            return 0, b"", None
        if keep:
            self.idle.append(conn)
        else:
            conn[1].close()
        return status, data, (sent, *stamp, read) if stamp else None

    def _request(self, path: str, body: bytes) -> bytes:
        """The request's bytes, made once per body (the load loops send the same bodies again)."""
        key = (path, id(body))
        if key not in self.made:
            self.made[key] = (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % (path.encode(), self.host.encode(), len(body)) + body,
                              body)  # the body kept alive: its id stays its own
        return self.made[key][0]

    async def _exchange(self, conn, path: str, body: bytes) -> tuple[int, bytes, bool, tuple | None]:
        r, w = conn
        w.write(self._request(path, body))
        await w.drain()
        head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        length, keep, stamp = 0, True, None
        for line in head[1:]:
            k, _, v = line.partition(":")
            k = k.lower()
            if k == "content-length":
                length = int(v)
            elif k == "connection" and v.strip().lower() == "close":
                keep = False
            elif k == "x-embedscale-clock":
                stamp = tuple(int(x) for x in v.split())
        return status, await r.readexactly(length), keep, stamp

    def close(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle = []


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    lat, codes = [], []
    t_end = time.monotonic() + seconds
    c = Client(url)

    async def client(k: int) -> None:
        i = k
        while time.monotonic() < t_end and i < 100_000:  # bounded in time and count
            t0 = time.perf_counter()
            status, _ = await c.post("/v1/predict", bodies[i % len(bodies)])
            lat.append(time.perf_counter() - t0)
            codes.append(status)
            i += concurrency

    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    wall = time.monotonic() - t0
    c.close()
    if c.errors:
        print(f"{url}: {len(c.errors)} requests failed, first: {c.errors[0]}", file=sys.stderr)
    return summary(lat, codes, wall)


async def open_loop(url: str, bodies: list[bytes], rate: float, seconds: float, warm: int = 64) -> dict:
    lat, codes, clocks = [], [], []
    n = int(rate * seconds)
    c = Client(url)
    await c.warm(warm)

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        status, _, clock = await c.post_clock("/v1/predict", bodies[i % len(bodies)])
        codes.append(status)
        lat.append(time.perf_counter() - t0)
        clocks.append(clock)

    t0 = time.monotonic()
    tasks = []
    for i in range(n):  # a fixed schedule: request i at i / rate
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    c.close()
    if c.errors:
        print(f"{url}: {len(c.errors)} requests failed, first: {c.errors[0]}", file=sys.stderr)
    return {**summary(lat, codes, wall), "503_split": split_503(codes, clocks)}


def split_503(codes: list[int], clocks: list) -> dict | None:
    """Where a refused request's time went (ms, p50 / p99 / max; ``serve --timing-headers``): ``to_server`` from
    the client's send to the server's Python code (the kernel, the accept, the event loop's backlog),
    ``in_server`` there until the answer starts, ``back`` from then to the client's read of the answer (the
    kernel and the client's own loop), ``total`` (send to read, on one clock)."""
    parts = {"to_server": [], "in_server": [], "back": [], "total": []}
    for code, c in zip(codes, clocks):
        if code == 503 and c:
            sent, arrived, answered, read = c
            for k, v in (("to_server", arrived - sent), ("in_server", answered - arrived), ("back", read - answered),
                         ("total", read - sent)):
                parts[k].append(v / 1e6)
    if not parts["total"]:
        return None
    return {k: [round(float(np.percentile(v, q)), 3) for q in (50, 99, 100)] for k, v in parts.items()}


def summary(lat: list[float], codes: list[int], wall: float) -> dict:
    ok = [x for x, c in zip(lat, codes) if c == 200]
    busy = [x for x, c in zip(lat, codes) if c == 503]
    q = (lambda p: float(np.percentile(ok, p)) * 1000) if ok else (lambda p: float("nan"))
    q503 = (lambda p: float(np.percentile(busy, p)) * 1000) if busy else (lambda p: float("nan"))
    return {"requests": len(codes), "ok": len(ok), "503": codes.count(503), "failed": len(codes) - len(ok)
            - codes.count(503), "qps": len(ok) / wall, "p50_ms": q(50), "p90_ms": q(90), "p99_ms": q(99),
            "p999_ms": q(99.9), "p50_503_ms": q503(50), "p99_503_ms": q503(99), "max_503_ms": q503(100)}


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` and its children (``--workers``) in MB (``VmRSS``, summed)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = 0.0
        for p in [pid, *map(int, kids)]:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        return total
    except OSError:
        return float("nan")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` and its children (``--workers``) so far, in seconds: the
    server's work per request, which the host's load does not inflate as it does the wall-clock figures."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = 0
        for p in [pid, *map(int, kids)]:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        return total / tick
    except OSError:
        return float("nan")


def schedstat(pid: int) -> dict[int, tuple[float, float]]:
    """Every thread of process ``pid``: ``(ms on a CPU, ms runnable but waiting for one)`` so far
    (``/proc/PID/task/TID/schedstat``). Over a phase, a thread's wall time less these two is time it slept:
    idle, or waiting for a lock (the GIL)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            run_ns, wait_ns, _ = Path(task, "schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[int(task.name)] = (int(run_ns) / 1e6, int(wait_ns) / 1e6)
    return out


def thread_split(pid: int, before: dict, after: dict, wall_s: float) -> dict:
    """Over a phase of ``wall_s`` seconds: the event loop's thread (the main one) and the busiest other (the
    compute thread): ms on a CPU, ms waiting for a CPU, ms asleep (idle or waiting for the GIL), per second."""
    delta = {t: (after[t][0] - before.get(t, (0, 0))[0], after[t][1] - before.get(t, (0, 0))[1]) for t in after}
    main = delta.get(pid, (0.0, 0.0))
    others = sorted((v for t, v in delta.items() if t != pid), reverse=True)
    per_s = lambda v: {"run": round(v[0] / wall_s, 1), "wait_cpu": round(v[1] / wall_s, 1),  # noqa: E731
                       "asleep": round(1000 - (v[0] + v[1]) / wall_s, 1)}
    return {"loop": per_s(main), "compute": per_s(others[0]) if others else None}


async def sampled(coro, pid: int, every: float = 0.1) -> tuple[dict, list[float]]:
    """Run a load ``coro`` while sampling process ``pid``'s resident memory every ``every`` s."""
    samples = [rss_mb(pid)]
    task = asyncio.ensure_future(coro)
    while not task.done():
        await asyncio.sleep(every)
        samples.append(rss_mb(pid))
    return await task, samples


def overload(url: str, pid: int, bodies: list[bytes], saturation: float, seconds: float) -> dict:
    """Steady load (half the saturation rate), then twice the saturation rate, then the steady load again: the
    503s' latency, the server's resident memory through it all, and the steady p99 before and after."""
    before, mem0 = run(sampled(open_loop(url, bodies, saturation / 2, seconds), pid))
    s0, t0 = schedstat(pid), time.monotonic()
    over, mem1 = run(sampled(open_loop(url, bodies, 2 * saturation, seconds), pid))
    over["threads_ms_per_s"] = thread_split(pid, s0, schedstat(pid), time.monotonic() - t0)
    after, mem2 = run(sampled(open_loop(url, bodies, saturation / 2, seconds), pid))
    return {"saturation_qps": saturation, "steady_before": before, "overload": over, "steady_after": after,
            "rss_mb": {"before": max(mem0), "peak_overload": max(mem1), "after": max(mem2)},
            "recovery_p99_ratio": after["p99_ms"] / before["p99_ms"] if before["p99_ms"] else None}


def breakdown(export: Path, bodies: list[bytes], batch_requests: int, repeats: int = 30) -> dict:
    """Server CPU per request by stage, in this process on one thread (its CPU time, so the host's load does
    not inflate it; medians over ``repeats`` passes of ``batch_requests`` requests scored together, as the
    batcher does): ``parse`` (the body's JSON and the
    ranking call's checks), ``encode`` (raw values to model inputs), ``lookup`` (the pooled lookup of every
    table, context and candidates at once), ``dense`` (the rest of the forward: bottom MLP, interaction, top
    MLP), ``respond`` (the answer's JSON). What the HTTP stack and batching add is the closed loop's CPU per
    request less their sum."""
    from embedscale.serve.predict import load_export
    from embedscale.serve.ranking import concat
    from embedscale.serve.server import _encode, _ranking_rows, score
    from fastapi.responses import JSONResponse

    torch.set_num_threads(1)
    served = load_export(export)
    sa = served.model.sparse_arch
    t = {k: [] for k in ("parse", "encode", "lookup", "forward", "respond")}
    clock = time.thread_time  # CPU time of this thread: the host's load does not inflate it
    for rep in range(repeats):
        chunk = [bodies[(rep * batch_requests + i) % len(bodies)] for i in range(batch_requests)]
        t0 = clock()
        docs = [json.loads(b) for b in chunk]
        rows = [_ranking_rows(d) if "candidates" in d else d["rows"] for d in docs]
        t1 = clock()
        parts = [_encode(served, r) for r in rows]
        t2 = clock()
        with torch.inference_mode():
            whole = concat([p.context for p in parts] + [p.candidates for p in parts]) \
                if hasattr(parts[0], "context") else concat(parts)
            sa.pooled(whole.sparse) if hasattr(sa, "pooled") else sa(whole.sparse)
        t3 = clock()
        probs = torch.sigmoid(score(served, parts)).numpy()
        t4 = clock()
        start = 0
        for p in parts:
            JSONResponse({"model_version": served.version, "probabilities": probs[start:start + p.rows].tolist()})
            start += p.rows
        t5 = clock()
        for k, a, b in (("parse", t0, t1), ("encode", t1, t2), ("lookup", t2, t3), ("forward", t3, t4),
                        ("respond", t4, t5)):
            t[k].append((b - a) * 1e3 / batch_requests)
    med = {k: statistics.median(v) for k, v in t.items()}
    med["dense"] = max(med.pop("forward") - med["lookup"], 0.0)  # the forward's own lookup counted once
    return {k: round(med[k], 4) for k in ("parse", "encode", "lookup", "dense", "respond")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-rows", type=int, default=100_000, help="rows a table at most (0: full size, 33.8M rows)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rows", type=int, default=100, help="candidate rows per request")
    ap.add_argument("--ranking", action="store_true", help="requests of one user context and --rows candidates")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rate", type=float, default=20.0, help="open loop: requests per second offered")
    ap.add_argument("--seconds", type=float, default=10.0, help="per load run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--max-wait-ms", type=float, default=2.0)
    ap.add_argument("--queue-rows", type=int, default=8192, help="rows queued at most (beyond: 503)")
    ap.add_argument("--workers", type=int, default=1, help="server processes, each side")
    ap.add_argument("--expanded", action="store_true",
                    help="--ranking: also ours scoring the candidates as expanded rows (serve --expand-ranking)")
    ap.add_argument("--torchrec-expanded", action="store_true",
                    help="--ranking: also the TorchRec baseline scoring each candidate as a whole row, as TorchRec's "
                         "DLRM serves a ranking call (it has no per-context scoring)")
    ap.add_argument("--malloc-default", action="store_true",
                    help="also ours with glibc's default malloc (EMBEDSCALE_THREADS=torch), not keeping freed memory")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per server process")
    ap.add_argument("--dense", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="the dense model's precision, both sides (serve --dense)")
    ap.add_argument("--compute-nice", type=int, default=10,
                    help="the compute threads' niceness above the event loop's, every side (serve --compute-nice)")
    ap.add_argument("--no-fp32", action="store_true", help="without the FP32 export beside (full size: 2.2 GB)")
    ap.add_argument("--overload-seconds", type=float, default=0.0,
                    help="then ours at half, twice and half again the saturation rate, this long each (0: not)")
    ap.add_argument("--own-saturation", action=argparse.BooleanOptionalAction, default=True,
                    help="each overload phase at multiples of its server's own closed-loop rate measured just before "
                         "(on a shared host the rate of the first rounds says little about later ones); else of ours "
                         "in the first rounds")
    ap.add_argument("--overload-against", nargs="*", metavar="NAME=OPTIONS",
                    default=["before=--switch-interval-ms 0 --refuse-in-handler --no-encode-thread --no-gc-freeze "
                             "--gc-young 0", "gc-young-700=--gc-young 0"],
                    help="the overload phase also runs these servers, ours with other serve options, interleaved "
                         "(default: as before, the GIL's switch interval left at Python's, the full queue refused "
                         "after routing, requests encoded on the event loop, no gc.freeze, Python's young "
                         "collections; and ours with Python's young collections (--gc-young 0); "
                         "e.g. loop-encodes=--no-encode-thread: ours encoding on the loop)")
    ap.add_argument("--quick", action="store_true", help="small tables, short runs")
    ap.add_argument("--breakdown", action="store_true",
                    help="also the server CPU per request by stage (parse, encode, lookup, dense, respond)")
    ap.add_argument("--no-torchrec", action="store_true", help="without the TorchRec baseline (torchrec not installed)")
    args = ap.parse_args()
    if args.quick:
        args.max_rows, args.seconds, args.repeats, args.rows = 10_000, 3.0, 2, 20
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        paths = make_exports(Path(tmp), args.max_rows, args.dim, ("int8",) if args.no_fp32 else ("int8", "fp32"))
        print(f"exports made in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        bodies = request_bodies(64, args.rows, table_rows(args.max_rows), ranking=args.ranking)
        servers: dict = {}
        over = None
        stages = {n: breakdown(paths["int8"], bodies, n) for n in (1, max(args.max_batch // max(args.rows, 1), 1))} \
            if args.breakdown else None
        try:
            for form, p in paths.items():
                servers[form] = start(p, args)
            if not args.no_torchrec:
                servers["torchrec-int8"] = start(paths["int8"], args, torchrec=True)
            if args.ranking and args.expanded:  # ours scoring each candidate as a whole row: what per-context saves
                servers["int8-expanded"] = start(paths["int8"], args, expand=True)
            if args.malloc_default:  # ours with glibc's default malloc (freed memory handed back to the system)
                servers["int8-malloc-default"] = start(paths["int8"], args, env={"EMBEDSCALE_THREADS": "torch"})
            if args.ranking and args.torchrec_expanded and not args.no_torchrec:
                servers["torchrec-int8-expanded"] = start(paths["int8"], args, torchrec=True, expand=True)
            runs = {(mode, form): [] for mode in ("closed", "open") for form in servers}
            for rep in range(args.repeats):
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))  # interleaved, rotated
                for form in order:
                    url = servers[form][1]
                    cpu0 = cpu_seconds(servers[form][0].pid)
                    runs["closed", form].append(run(closed_loop(url, bodies, args.concurrency, args.seconds)))
                    done = runs["closed", form][-1]
                    done["cpu_ms_per_request"] = (cpu_seconds(servers[form][0].pid) - cpu0) * 1e3 / max(done["ok"], 1)
                    runs["open", form].append(run(open_loop(url, bodies, args.rate, args.seconds)))
                    print(f"round {rep}: {form} closed {runs['closed', form][-1]['qps']:.1f} qps p99 "
                          f"{runs['closed', form][-1]['p99_ms']:.1f} ms, open p99 "
                          f"{runs['open', form][-1]['p99_ms']:.1f} ms, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
            if args.overload_seconds:
                # the best closed-loop rate seen: on a shared host the median undershoots the server's capacity
                saturation = max(r["qps"] for r in runs["closed", "int8"])
                against = dict(v.split("=", 1) for v in args.overload_against)
                for name, extra in against.items():  # the same server with other options, beside ours
                    servers[f"int8-{name}"] = start(paths["int8"], args, extra=tuple(extra.split()))
                over = {}
                for rep in range(2):  # interleaved, rotated
                    for form in ["int8", *(f"int8-{n}" for n in against)][::1 if rep == 0 else -1]:
                        url, pid = servers[form][1], servers[form][0].pid
                        sat = run(closed_loop(url, bodies, args.concurrency, args.seconds))  # its own saturation
                        base = sat["qps"] if args.own_saturation else saturation
                        over.setdefault(form, []).append({**overload(url, pid, bodies, base,
                                                                     args.overload_seconds), "closed_loop": sat})
                        r = over[form][-1]["overload"]
                        print(f"overload {rep}: {form} saturation {sat['qps']:.1f} qps; at 2x 503 p50 "
                              f"{r['p50_503_ms']:.1f} p99 {r['p99_503_ms']:.1f} ms, split {r['503_split']}, threads {r['threads_ms_per_s']}, "
                              f"load {os.getloadavg()[0]:.1f}", file=sys.stderr)
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    report(args, runs, servers, over, load0, stages)


def report(args, runs: dict, servers: dict, over: dict | None, load0, stages: dict | None = None) -> None:
    """One JSON line per load mode (and one for the overload phase when run)."""
    config = {k: v for k, v in vars(args).items()}
    servers = [f for f in servers if runs.get(("closed", f))]  # not the overload phase's own server
    for mode in ("closed", "open"):
        med = {form: {k: statistics.median(r[k] for r in runs[mode, form]) for k in runs[mode, form][0]}
               for form in servers}
        p90 = {form: float(np.percentile([r["qps"] for r in runs[mode, form]], 90)) for form in servers}
        base = "torchrec-int8" if "torchrec-int8" in med else "fp32" if "fp32" in med else "int8"  # int8: alone
        print(json.dumps({"figure": f"serve_{mode}_loop_qps_int8", "value": med["int8"]["qps"],
                          "baseline": ("the same INT8 model with TorchRec's quantized EmbeddingBagCollection as its "
                                       "lookup, same server, same run") if base == "torchrec-int8" else
                                      "the same model's FP32 export, same server, same run" if base == "fp32" else
                                      "none (ours alone: --no-torchrec --no-fp32)",
                          "baseline_value": med[base]["qps"],
                          "ratio": med["int8"]["qps"] / med[base]["qps"] if med[base]["qps"] else None,
                          "ratio_vs_expanded": med["int8"]["qps"] / med["int8-expanded"]["qps"]
                          if "int8-expanded" in med and med["int8-expanded"]["qps"] else None,
                          "ratio_vs_torchrec_expanded": med["int8"]["qps"] / med["torchrec-int8-expanded"]["qps"]
                          if "torchrec-int8-expanded" in med and med["torchrec-int8-expanded"]["qps"] else None,
                          "ratio_vs_malloc_default": med["int8"]["qps"] / med["int8-malloc-default"]["qps"]
                          if "int8-malloc-default" in med and med["int8-malloc-default"]["qps"] else None,
                          "ratio_vs_fp32": med["int8"]["qps"] / med["fp32"]["qps"]
                          if "fp32" in med and med["fp32"]["qps"] else None,
                          "cpu_ms_per_request": {f: med[f].get("cpu_ms_per_request") for f in servers},
                          "cpu_ratio": med[base]["cpu_ms_per_request"] / med["int8"]["cpu_ms_per_request"]
                          if mode == "closed" and med["int8"].get("cpu_ms_per_request") else None,
                          "cpu_ms_per_request_by_stage": stages,
                          "cpu_ms_per_request_http_and_batching":  # ours: the closed loop's less its stages
                          med["int8"]["cpu_ms_per_request"] - sum(stages[max(stages)].values())
                          if mode == "closed" and stages else None,
                          "median": med, "p90_qps": p90,
                          "rounds": {f: runs[mode, f] for f in servers},
                          "load": {"start": load0, "end": os.getloadavg()}, "config": config}))
    if over:
        worst = lambda form: float(np.nanmax([r["overload"]["p99_503_ms"] for r in over[form]]))  # noqa: E731
        others = [f for f in over if f != "int8"]
        print(json.dumps({"figure": "serve_overload_503_p99_ms", "value": worst("int8"),
                          "baseline": "10 ms (the bar); beside it the same server with other options "
                                      f"({', '.join(args.overload_against)}), interleaved; steady p99 at half "
                                      "saturation before and after",
                          "baseline_value": {f: worst(f) for f in others},
                          "p50_503_ms": {f: [r["overload"]["p50_503_ms"] for r in over[f]] for f in over},
                          "p99_503_ms": {f: [r["overload"]["p99_503_ms"] for r in over[f]] for f in over},
                          "split_503": {f: [r["overload"]["503_split"] for r in over[f]] for f in over},
                          "saturation_qps": {f: [r["closed_loop"]["qps"] for r in over[f]] for f in over},
                          "recovery_p99_ratio": [r["recovery_p99_ratio"] for r in over["int8"]], "runs": over,
                          "load": {"start": load0, "end": os.getloadavg()}, "config": config}))


if __name__ == "__main__":
    main()
