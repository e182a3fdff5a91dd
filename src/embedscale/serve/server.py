"""``embedscale serve``: an HTTP prediction server for an export (Starlette via FastAPI, on uvicorn).

Endpoints: ``POST /v1/predict`` (``{"rows": [{feature: raw value, ...}, ...]}``, or a ranking call
``{"context": {shared features}, "candidates": [{the others}, ...]}`` -> ``{"model_version": ...,
"probabilities": [...]}``), ``GET /v1/model`` (the export's version, source and tables), ``POST
/v1/model/rollback`` (serve the model before the last swap again), ``/healthz`` (the process answers),
``/readyz`` (a model is loaded and the server is not draining) and ``/metrics`` (Prometheus text: requests by
status, latency histogram, batch sizes, queue depth, model version, swaps).

Dynamic micro-batching: a request's rows are checked and encoded in the request's own task (a bad request
is answered 4xx at once and never reaches the model), then queued; one batcher takes queued requests until
``max_batch`` rows or until ``max_wait`` has passed since the first of them, scores them in one forward pass
(in a worker thread, so the event loop keeps accepting) and hands each request its slice. The queue is
bounded in rows (``queue_rows``, counting a request's rows from its admission, while it is encoded): a request
that does not fit is answered 503 at once instead of waiting; when not even one row fits, an ASGI middleware
in front of the routing answers it (:class:`Admission`: no handler runs, the body is not read). The event loop
parses a request and a thread beside it encodes it (``encode_thread``), so the loop reads and refuses the next
ones meanwhile; the interpreter's switch interval is shortened while serving (``switch_interval_ms``) so that
a thread waiting for the GIL gets it sooner. The compute thread runs at a lower priority than the event loop
(``compute_nice``): under overload the thread that reads requests and refuses what does not fit gets a core
first, so a refusal does not queue behind a forward pass for the CPU. Once the model is loaded (and after each
swap) the objects alive are frozen out of Python's cyclic garbage collector (``gc_freeze``, :func:`gc.freeze`):
its full collections would otherwise walk every object of the model and the libraries, stalls of the whole
process of 50-160 ms measured under load, while a request's own objects are freed by their reference counts.
For the same reason the young generation is collected only after ``gc_young`` net allocations (Python's 700
made 1,100-1,300 young collections and 6-7 full ones, up to 12 ms each, in 8 s at twice the saturation; at 10,000
there were none, as a request's objects are freed as soon as it is answered, while garbage in cycles still
triggers a collection once that many objects of it are alive). The process keeps the memory a batch frees for
the next one (:func:`embedscale.threads.keep_freed_memory`, as training does): with glibc's defaults the compute
thread faulted 45-180 pages a request back in, 0.13-0.46 ms of system CPU a request.

Bad requests are 4xx JSON errors ``{"error": ..., "field": ..., "row": ...}``: a body over ``max_body``
bytes (413), not JSON or not an object (400), more than ``max_rows`` rows (413), a missing, unknown or
ill-typed feature or a value the schema's parser rejects (422, naming the row and the feature). Unseen
categorical values are not errors: they go where training sent them (the out-of-vocabulary row, or their
hash bucket). SIGTERM stops accepting, answers what is in flight and queued, and exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from embedscale.serve.encode import Encoded, RequestError
from embedscale.serve.predict import ServedModel, load_export, read_manifest
from embedscale.serve.ranking import RankingInput, concat, encode_ranking, rank_logits, ranks_by_context
from embedscale.threads import keep_freed_memory


@dataclass
class ServeConfig:
    """Batching and limits of the server."""

    max_batch: int = 256  # rows scored together at most
    max_wait_ms: float = 2.0  # the longest a queued request waits for others to join its batch
    queue_rows: int = 4096  # rows waiting at most; beyond: 503
    max_rows: int = 1024  # rows of one request at most
    max_body: int = 1 << 20  # bytes of one request body at most
    delay_ms: float = 0.0  # added to every forward pass (tests: a slow model fills the queue)
    follow: str | None = None  # an export directory to watch: a new export there is swapped in between batches
    follow_poll_s: float = 1.0
    threads: int = 1  # torch's intra-op threads per server process (one core each; the event loop has the rest)
    dense: str = "fp32"  # the dense model's precision: fp32, bf16 or int8 (ServedModel.set_dense)
    by_context: bool = True  # a DLRM scores a ranking call once per context (serve.ranking); False: expanded rows
    compute_nice: int = 10  # the compute thread's niceness above the event loop's (Batcher._lower_priority)
    switch_interval_ms: float = 0.5  # the interpreter's GIL switch interval while serving (0: Python's, 5 ms)
    refuse_in_handler: bool = False  # a full queue refused in the handler only, after routing (benchmarks: as before)
    timing_headers: bool = False  # every prediction answer carries x-embedscale-clock (benchmarks: where time goes)
    encode_thread: bool = True  # encode a request's rows in a thread beside the event loop
    gc_freeze: bool = True  # the objects alive after loading (and after each swap) left out of full collections
    gc_young: int = 10_000  # young-generation collection threshold while serving (0: Python's, 700 allocations)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, version: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("embedscale_requests", "Prediction requests answered, by HTTP status", ["code"],
                                registry=r)
        self.latency = Histogram("embedscale_request_latency_seconds", "Time from a request's arrival to its answer",
                                 buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5), registry=r)
        self.batch = Histogram("embedscale_batch_rows", "Rows scored per forward pass",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=r)
        self.queue = Gauge("embedscale_queue_rows", "Rows waiting to be scored", registry=r)
        self.version = Gauge("embedscale_model_info", "The model being served (value 1)", ["model_version"],
                             registry=r)
        self.version.labels(model_version=version).set(1)
        self.swaps = Counter("embedscale_model_swaps", "Models swapped in by --follow", registry=r)

    def swapped(self, old: str, new: str) -> None:
        self.version.remove(old)
        self.version.labels(model_version=new).set(1)
        self.swaps.inc()


class Batcher:
    """The bounded queue and the batching loop (one per server). A queued request carries the model that
    encoded it; a batch holds requests of one model only (a swap falls between two batches), so no answer mixes
    two versions, and of one kind (rows, or ranking calls with one split of the features)."""

    def __init__(self, cfg: ServeConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued_rows = 0
        self.held = None  # a request of another model than the batch being gathered: first of the next batch
        self.compute_tid: int | None = None  # the compute thread's native id (its priority is lowered)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedscale-model",
                                       initializer=self._lower_priority)
        self.encoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedscale-encode") \
            if cfg.encode_thread else None
        self.task: asyncio.Task | None = None
        self.last_input: list | None = None  # the last batch scored: a model about to be swapped in warms on it

    def _lower_priority(self) -> None:
        """In the compute thread: raise its niceness by ``compute_nice`` (Linux ``setpriority`` on a thread id
        acts on that thread alone), so that the event loop's thread wins the CPU when both are runnable."""
        self.compute_tid = threading.get_native_id()
        if self.cfg.compute_nice > 0 and sys.platform.startswith("linux"):
            now = os.getpriority(os.PRIO_PROCESS, self.compute_tid)
            os.setpriority(os.PRIO_PROCESS, self.compute_tid, min(now + self.cfg.compute_nice, 19))

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Score what is queued, then stop."""
        await self.queue.join()
        if self.task is not None:
            self.task.cancel()
        self.pool.shutdown(wait=True)
        if self.encoding is not None:
            self.encoding.shutdown(wait=True)

    def reserve(self, rows: int) -> bool:
        """Count ``rows`` of a request still being encoded as waiting (the queue's bound holds them too); ``False``
        when they do not fit (the caller answers 503)."""
        if self.queued_rows + rows > self.cfg.queue_rows:
            return False
        self.queued_rows += rows
        self.metrics.queue.set(self.queued_rows)
        return True

    def release(self, rows: int) -> None:
        """Give back a reservation whose request will not be queued (a bad value, a drain)."""
        self.queued_rows -= rows
        self.metrics.queue.set(self.queued_rows)

    def submit(self, enc: Encoded, served: ServedModel, reserved: int = 0) -> asyncio.Future | None:
        """Queue a request's rows (encoded by ``served``; ``reserved`` of them counted already by
        :meth:`reserve`); ``None`` when the queue has no room for them (the caller answers 503)."""
        if not reserved and self.queued_rows + enc.rows > self.cfg.queue_rows:
            return None
        fut = asyncio.get_running_loop().create_future()
        self.queued_rows += enc.rows - reserved
        self.metrics.queue.set(self.queued_rows)
        self.queue.put_nowait((enc, served, fut))
        return fut

    async def _first(self):
        if self.held is not None:
            item, self.held = self.held, None
            return item
        return await self.queue.get()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self._first()]
            rows = items[0][0].rows
            deadline = loop.time() + self.cfg.max_wait_ms / 1000
            while rows < self.cfg.max_batch:
                if self.queue.empty():  # wait for company until the deadline (short sleeps: no get is cancelled)
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    await asyncio.sleep(min(left, 0.0005))
                    continue
                item = self.queue.get_nowait()
                if (item[1] is not items[0][1] or _kind(item[0]) != _kind(items[0][0])
                        or rows + item[0].rows > self.cfg.max_batch):
                    self.held = item  # another model's or kind's request, or one past max_batch: the next batch
                    break
                items.append(item)
                rows += item[0].rows
            try:
                await self._score(loop, items, rows)
            finally:
                for _ in items:
                    self.queue.task_done()

    async def _score(self, loop, items, rows: int) -> None:
        self.queued_rows -= rows
        self.metrics.queue.set(self.queued_rows)
        self.metrics.batch.observe(rows)
        served = items[0][1]
        try:
            probs = await loop.run_in_executor(self.pool, self._forward, served, [e for e, _, _ in items])
        except Exception as e:  # noqa: BLE001 - every waiting request learns of it
            for _, _, fut in items:
                if not fut.done():
                    fut.set_exception(e)
            return
        start = 0
        for enc, _, fut in items:
            if not fut.done():
                fut.set_result((served.version, probs[start:start + enc.rows].tolist()))
            start += enc.rows

    def _forward(self, served: ServedModel, parts: list) -> np.ndarray:
        if self.cfg.delay_ms:
            time.sleep(self.cfg.delay_ms / 1000)
        self.last_input = parts
        return torch.sigmoid(score(served, parts)).numpy()


def _kind(enc) -> tuple | None:
    """What a batch must share: ``None`` for rows, the context's features for a ranking call."""
    return enc.context_features if isinstance(enc, RankingInput) else None


def score(served: ServedModel, parts: list) -> torch.Tensor:
    """The logits of a batch: encoded rows, or ranking calls of one split (``serve.ranking``)."""
    if isinstance(parts[0], RankingInput):
        with served.autocast():
            return rank_logits(served.model, served.encoder, parts)
    return served.logits(concat(parts))


class Admission:
    """ASGI middleware in front of the routing: ``POST /v1/predict`` that finds the queue without room for even one
    row is answered 503 here, before Starlette routes it, FastAPI builds a request or a handler runs; its body is
    left unread (uvicorn discards the rest of a request answered whole and keeps the connection). Under overload
    the event loop's thread refuses at the smallest cost it can in Python. With ``timing_headers`` every
    prediction answer carries ``x-embedscale-clock: <arrival ns> <answer ns>`` (``time.monotonic_ns``: the host's
    monotonic clock, which a client on the same host reads too, so it can split a request's time into before,
    in and after the server's Python code)."""

    def __init__(self, app, state: dict, cfg: ServeConfig, metrics: Metrics):
        self.app, self.state, self.cfg, self.metrics = app, state, cfg, metrics
        self.refused = metrics.requests.labels(code="503")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/predict":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        if self.cfg.timing_headers:
            send = _stamped(send, time.monotonic_ns())
        batcher = self.state["batcher"]
        if (self.cfg.refuse_in_handler or batcher is None or scope["method"] != "POST"
                or batcher.queued_rows < self.cfg.queue_rows):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": _full_message(batcher, self.cfg), "field": None, "row": None}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        self.refused.inc()
        self.metrics.latency.observe(time.perf_counter() - t0)


def _stamped(send, arrived_ns: int):
    """``send`` adding ``x-embedscale-clock: <arrived_ns> <now ns>`` to the response's start."""
    async def stamped(message):
        if message["type"] == "http.response.start":
            clock = b"%d %d" % (arrived_ns, time.monotonic_ns())
            message = {**message, "headers": [*message.get("headers", []), (b"x-embedscale-clock", clock)]}
        await send(message)
    return stamped


def _error(status: int, message: str, field=None, row=None):
    return JSONResponse({"error": message, "field": field, "row": row}, status_code=status)


def make_app(served: ServedModel, cfg: ServeConfig | None = None):
    """The ASGI application serving ``served``."""
    import contextlib

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    cfg = cfg or ServeConfig()
    metrics = Metrics(served.version)
    state = {"ready": False, "batcher": None, "served": served, "previous": None}
    torch.set_num_threads(cfg.threads)
    served.set_dense(cfg.dense)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        switch = sys.getswitchinterval()
        if cfg.switch_interval_ms:  # how long a thread waiting for the GIL waits before asking its holder for it
            sys.setswitchinterval(cfg.switch_interval_ms / 1000)
        state["batcher"] = Batcher(cfg, metrics)
        state["batcher"].start()
        follower = asyncio.get_running_loop().create_task(follow(state, cfg, metrics)) if cfg.follow else None
        _freeze_heap(cfg)
        thresholds = gc.get_threshold()
        if cfg.gc_young:  # collections of the young objects (a request's) this many allocations apart
            gc.set_threshold(cfg.gc_young, *thresholds[1:])
        state["ready"] = True
        try:
            yield
        finally:
            state["ready"] = False
            if follower is not None:
                follower.cancel()
            await state["batcher"].stop()
            sys.setswitchinterval(switch)
            gc.set_threshold(*thresholds)
            if cfg.gc_freeze:
                gc.unfreeze()

    app = FastAPI(title="embedscale", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Admission, state=state, cfg=cfg, metrics=metrics)

    @app.post("/v1/predict")
    async def predict(request: Request):
        t0 = time.perf_counter()
        resp = await _predict(request, cfg, state)
        metrics.requests.labels(code=str(resp.status_code)).inc()
        metrics.latency.observe(time.perf_counter() - t0)
        return resp

    @app.get("/v1/model")
    async def model():
        served = state["served"]
        m = served.manifest
        return {"model_version": served.version, "source": m.get("source"), "eval": m.get("eval"),
                "tables": [{k: t[k] for k in ("name", "num_rows", "dim", "form")} for t in m["tables"]],
                "features": served.encoder.features}

    @app.post("/v1/model/rollback")
    async def rollback():
        """Serve the model before the last swap again (the two trade places: a second rollback undoes it)."""
        if state["previous"] is None:
            return _error(409, "no previous model to roll back to (nothing was swapped in since the start)")
        old, state["served"], state["previous"] = state["served"], state["previous"], state["served"]
        metrics.swapped(old.version, state["served"].version)
        print(f"rollback: now serving {state['served'].version} (was {old.version})", file=sys.stderr, flush=True)
        return {"model_version": state["served"].version, "previous": old.version}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if not state["ready"]:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return {"status": "ready", "model_version": state["served"].version}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics, app.state.serve = metrics, state
    return app


async def follow(state: dict, cfg: ServeConfig, metrics: Metrics) -> None:
    """Watch ``cfg.follow`` (an export directory, replaced whole by ``embedscale export``): a new export (another
    ``model_version``) is loaded beside the one serving, then swapped in; requests already queued finish on the
    model that encoded them. An export that cannot be loaded is reported and the current one kept."""
    loop = asyncio.get_running_loop()
    path = Path(cfg.follow)
    seen = None
    while True:
        await asyncio.sleep(cfg.follow_poll_s)
        try:
            st = (path / "export.json").stat()
            key = (st.st_ino, st.st_mtime_ns)
            if key == seen:
                continue
            seen = key
            if read_manifest(path)["model_version"] == state["served"].version:
                continue
            new, wall, cpu = await loop.run_in_executor(None, _timed_load, path, state["batcher"].last_input, cfg)
        except Exception as e:  # noqa: BLE001 - a half-made or damaged export never stops the server
            print(f"follow {path}: not loaded ({e}); still serving {state['served'].version}", file=sys.stderr,
                  flush=True)
            continue
        old = state["served"]
        state["served"], state["previous"] = new, old
        metrics.swapped(old.version, new.version)
        _freeze_heap(cfg, collect=False)  # the new model's objects too (a swapped-out model is freed by refcounts)
        print(f"follow {path}: now serving {new.version} (was {old.version}; loaded in {wall:.1f} ms (thread CPU "
              f"{cpu:.1f} ms))", file=sys.stderr, flush=True)


def _freeze_heap(cfg: ServeConfig, collect: bool = True) -> None:
    """With ``cfg.gc_freeze``: collect once, then move every object alive to the collector's permanent
    generation (:func:`gc.freeze`), so that the full collections serving triggers walk only what came since."""
    if cfg.gc_freeze:
        if collect:
            gc.collect()
        gc.freeze()


def _timed_load(path: Path, sample, cfg: ServeConfig) -> tuple[ServedModel, float, float]:
    """:func:`load_and_warm` with its wall and this thread's CPU time (ms)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    new = load_and_warm(path, sample, cfg)
    return new, (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3


def load_and_warm(path: Path, sample, cfg: ServeConfig | None = None) -> ServedModel:
    """Load the export at ``path`` and score ``sample`` (the last batch served: its parts, or encoded rows) with
    it once, off the serving thread: its memory is touched and its first pass run before the swap, not on the
    first requests after it. A sample the new model cannot score (other tables) only leaves it cold."""
    if isinstance(sample, (Encoded, RankingInput)):
        sample = [sample]
    new = load_export(path)
    if cfg is not None:
        new.set_dense(cfg.dense)
    if sample is not None:
        try:
            score(new, sample)
        except Exception as e:  # noqa: BLE001 - warming is an optimisation; the model itself loaded
            print(f"follow {path}: not warmed ({e})", file=sys.stderr, flush=True)
    return new


async def _predict(request, cfg: ServeConfig, state: dict):
    batcher = state["batcher"]
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > cfg.max_body):
        return _error(413, f"request body of {size} bytes is over the limit of {cfg.max_body}")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > cfg.max_body:
            return _error(413, f"request body over the limit of {cfg.max_body} bytes")
    if batcher is not None and batcher.queued_rows >= cfg.queue_rows:
        # not even one row fits: refused before the body is parsed (read first: the connection stays reusable)
        return _queue_full(batcher, cfg)
    rows = _parsed(body, cfg)
    if isinstance(rows, Response):
        return rows
    reserved = len(rows) if rows and batcher is not None else 0
    if reserved and not batcher.reserve(reserved):
        return _queue_full(batcher, cfg)  # before encoding: under overload a refusal costs no encoding
    try:  # the rows count as waiting from here: requests being encoded cannot overfill the queue
        served = state["served"]  # one model for this request: its encoding and its scores
        if cfg.encode_thread and batcher is not None:  # encoded beside the event loop, which reads the next ones
            enc = await asyncio.get_running_loop().run_in_executor(batcher.encoding, _encoded, served, rows, cfg)
        else:
            enc = _encoded(served, rows, cfg)
        if isinstance(enc, Response):
            return enc
        if enc.rows == 0:
            return JSONResponse({"model_version": served.version, "probabilities": []})
        if not state["ready"] or batcher is None:
            return _error(503, "the server is not ready (starting or draining)")
        fut = batcher.submit(enc, served, reserved)
        if fut is None:
            return _queue_full(batcher, cfg)
        reserved = 0  # the batcher's now
    finally:
        if reserved:
            batcher.release(reserved)
    version, probs = await fut
    return JSONResponse({"model_version": version, "probabilities": probs})


def _parsed(body: bytes, cfg: ServeConfig):
    """A request's body parsed and its shape checked: its rows (a list, or a ranking call's
    :class:`_Candidates`), or the error response (4xx)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return _error(400, f"the body is not JSON ({e})")
    if not isinstance(doc, dict):
        return _error(400, "the body must be a JSON object {\"rows\": [...]}")
    ranking = "candidates" in doc or "context" in doc
    allowed = ("context", "candidates") if ranking else ("rows",)
    extra = sorted(k for k in doc if k not in allowed)
    if extra:
        return _error(422, f"unknown key {extra[0]!r} (a request is {{\"rows\": [...]}} or {{\"context\": "
                           "{...}, \"candidates\": [...]}})", field=extra[0])
    rows = _ranking_rows(doc) if ranking else doc.get("rows")
    if isinstance(rows, tuple):  # a malformed ranking call: (message, field, candidate)
        return _error(422, rows[0], field=rows[1], row=rows[2])
    what = "candidates" if ranking else "rows"
    if not isinstance(rows, list):
        return _error(422, "'rows' must be a list of objects, one per row to score", field="rows")
    if len(rows) > cfg.max_rows:
        return _error(413, f"{len(rows)} {what}; at most {cfg.max_rows} a request", field=what)
    return rows


def _encoded(served: ServedModel, rows: list, cfg: ServeConfig):
    """:func:`_encode`, a bad value answered 422 naming its row and feature."""
    try:
        return _encode(served, rows, cfg.by_context)
    except RequestError as e:
        return _error(422, str(e), field=e.field, row=e.row)


def _encode(served: ServedModel, rows: list, by_context: bool = True):
    """Rows, or a ranking call's candidates (:class:`_Candidates`), as the model's inputs: a DLRM gets a ranking
    call as context and candidates (``serve.ranking``), another model its expanded rows. A bad value is a
    ``RequestError`` naming the row, the candidate or the context."""
    if not isinstance(rows, _Candidates):
        return served.encoder.encode_rows(rows)
    enc = encode_ranking(served.encoder, rows.context, rows) if by_context and ranks_by_context(served.model) \
        else None
    if enc is not None:
        return enc
    try:  # the expanded rows' checks name what is missing or unknown
        return served.encoder.encode_rows(rows.expand())
    except RequestError as e:
        raise RequestError(str(e).replace("row ", "candidate ", 1), row=e.row, field=e.field) from None


def _queue_full(batcher: Batcher, cfg: ServeConfig):
    return _error(503, _full_message(batcher, cfg))


def _full_message(batcher: Batcher, cfg: ServeConfig) -> str:
    return f"the queue is full ({batcher.queued_rows} rows waiting, at most {cfg.queue_rows}); retry later"


class _Candidates(list):
    """A ranking call's candidates (a list of them) with its ``context``; :meth:`expand` gives its rows."""

    context: dict

    def expand(self) -> list[dict]:
        return [{**self.context, **c} for c in self]


def _ranking_rows(doc: dict):
    """The candidates of a ranking call ``{"context": {features shared by all}, "candidates": [{the others},
    ...]}`` (a :class:`_Candidates`: one row per candidate, the context's features added when expanded); a
    problem is ``(message, field, candidate)``."""
    ctx, cands = doc.get("context", {}), doc.get("candidates")
    if not isinstance(ctx, dict):
        return ("'context' must be an object of the features every candidate shares", "context", None)
    if not isinstance(cands, list):
        return ("'candidates' must be a list of objects, one per candidate to score", "candidates", None)
    shared = ctx.keys()
    for i, c in enumerate(cands):
        if not isinstance(c, dict):
            return (f"candidate {i}: expected an object of features, got {type(c).__name__}", None, i)
        if not shared.isdisjoint(c):
            both = sorted(set(c) & set(ctx))
            return (f"candidate {i}: feature {both[0]!r} is in the context too", both[0], i)
    out = _Candidates(cands)
    out.context = ctx
    return out


def _serve_prefork(export_dir: Path, host: str, port: int, cfg: ServeConfig, log_level: str, workers: int) -> int:
    """``--workers N``: bind the port here, then fork N workers that each load the export with its tables
    memory-mapped (``load_export(shared=True)``) and serve the inherited socket with uvicorn. Forked after
    torch is imported and before any torch op runs (no thread pool yet), the workers share this process's pages
    (torch's libraries, copy-on-write) as they share the tables' file mapping, so memory grows by what a worker
    writes, not by a whole process. SIGTERM/SIGINT go to every worker (each drains); the exit code is 0 when all
    drained, 2 when one could not start (its error names why)."""
    read_manifest(export_dir)  # a path that is not an export: one error here, before any worker
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    sock.set_inheritable(True)
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # a worker: never returns into the caller's code
            code = 2
            try:
                code = _prefork_worker(sock, export_dir, cfg, log_level)
            except BaseException as e:  # noqa: BLE001 - reported, then this worker ends
                print(f"worker {os.getpid()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            finally:
                os._exit(code)
        pids.append(pid)
    sock.close()
    print(f"serving {export_dir} with {workers} workers on http://{host}:{port}", file=sys.stderr, flush=True)
    forward = lambda num, frame: [_signal_quietly(p, num) for p in pids]  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0 if all(c == 0 for c in codes) else 2


def _signal_quietly(pid: int, num: int) -> None:
    try:
        os.kill(pid, num)
    except ProcessLookupError:
        pass


def _prefork_worker(sock: socket.socket, export_dir: Path, cfg: ServeConfig, log_level: str) -> int:
    import uvicorn

    for s in (signal.SIGTERM, signal.SIGINT):  # uvicorn drains on them in run(), then re-raises them into these
        signal.signal(s, lambda num, frame: None)
    app = make_app(load_export(export_dir, shared=True), cfg)
    server = uvicorn.Server(uvicorn.Config(app, fd=sock.fileno(), log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=30, lifespan="on"))
    server.run()
    return 0 if server.started else 2


def serve(export_dir, host: str = "127.0.0.1", port: int = 8080, cfg: ServeConfig | None = None,
          log_level: str = "warning", workers: int = 1) -> int:
    """Load ``export_dir`` and serve it until SIGTERM or SIGINT (in-flight and queued requests are answered
    first); returns the exit code, 0 after a drain. ``workers`` > 1: that many processes on one port, each with
    its own batcher, the tables memory-mapped from the export (one copy in memory): :func:`_serve_prefork`."""
    import uvicorn

    keep_freed_memory()  # (inherited by prefork workers)
    if workers > 1:
        return _serve_prefork(Path(export_dir), host, port, cfg or ServeConfig(), log_level, workers)
    served = load_export(export_dir)
    app = make_app(served, cfg)
    got = []
    previous = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                               timeout_graceful_shutdown=30, lifespan="on"))
        print(f"serving {served.version} from {export_dir} on http://{host}:{port}", file=sys.stderr, flush=True)
        server.run()  # uvicorn's own SIGTERM/SIGINT handling drains; it re-raises the signal into ours after
        if not server.started:
            return 2
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


__all__ = ["Batcher", "Metrics", "ServeConfig", "concat", "make_app", "score", "serve"]
