"""Overload: a request that does not fit the queue is refused (503) while the compute thread is still busy with
an earlier batch (here: blocked on an event), i.e. the refusal never waits on it; the compute thread runs at a
lower priority than the thread reading requests, as the operating system reports it; what was admitted is then
answered, equal to the model's own scores. The application runs in this process (its lifespan entered by hand)
and is reached through httpx's in-process ASGI transport: no socket, no timing assertion."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import httpx
import pytest
import torch

from embedscale.models import build_model
from embedscale.serve.export import FORMAT, VERSION, write_export
from embedscale.serve.predict import load_export
from embedscale.serve.quantize import quantize_rows, row_bytes
from embedscale.serve.server import ServeConfig, make_app
from embedscale.specs import ModelConfig, TableSpec

WAIT_S = 60  # generous: the machine may be loaded; nothing below waits this long when the code is right


def tiny_export(path):
    """A random two-table DLRM exported with INT8 tables (id-encoded: request values are row ids)."""
    specs = [TableSpec("t_C1", 50, 8, ["C1"]), TableSpec("t_C2", 30, 8, ["C2"])]
    cfg = ModelConfig(arch="dlrm", embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16])
    torch.manual_seed(0)
    model = build_model(cfg, specs, 2)
    emb = model.sparse_arch.embedding
    tensors = {f"dense.{k}": v.contiguous() for k, v in model.state_dict().items()
               if not k.startswith("sparse_arch.embedding.")}
    tables = []
    for t in specs:
        tensors[f"table.{t.name}"] = quantize_rows(emb.table_weight(t.name).detach(), "int8")
        tables.append({"name": t.name, "features": list(t.features), "num_rows": t.num_rows, "dim": 8,
                       "pooling": "sum", "form": "int8", "bytes_per_row": row_bytes("int8", 8)})
    encoding = {"dense": ["I1", "I2"], "schema": None, "categorical": "ids", "dense_stats": None,
                "sparse": [{"name": t.features[0], "num_rows": t.num_rows, "multi_hot": False} for t in specs]}
    manifest = {"format": FORMAT, "version": VERSION, "model_version": "tiny", "created": "", "source": {},
                "eval": {}, "num_dense": 2, "tables": tables, "encoding": encoding, "weights": "weights.safetensors",
                "model": {k: getattr(cfg, k) for k in ("arch", "embedding_dim", "bottom_mlp", "top_mlp",
                                                       "cross_layers", "cross_low_rank")},
                "table_bytes": sum(t["bytes_per_row"] * t["num_rows"] for t in tables)}
    write_export(path, manifest, tensors)
    return path


def rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"I1": int(torch.randint(0, 9, (), generator=g)), "I2": 0.5 * k,
             "C1": int(torch.randint(0, 50, (), generator=g)), "C2": int(torch.randint(0, 30, (), generator=g))}
            for k in range(n)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
@pytest.mark.parametrize("encode_thread", [False, True])
def test_full_queue_refused_while_the_compute_thread_is_blocked(tmp_path, encode_thread):
    export = tiny_export(tmp_path / "model")
    reference = load_export(export)  # the model scored directly, in this thread: what the answers must equal
    app = make_app(load_export(export), ServeConfig(queue_rows=4, max_batch=2, max_wait_ms=0, compute_nice=5,
                                                    encode_thread=encode_thread))
    release, entered, seen = threading.Event(), threading.Event(), {}

    def blocked_forward(forward):
        def run(served, parts):
            tid = threading.get_native_id()
            seen["nice"], seen["tid"] = os.getpriority(os.PRIO_PROCESS, tid), tid
            entered.set()
            assert release.wait(WAIT_S), "the test never released the compute thread"
            return forward(served, parts)
        return run

    async def scenario():
        loop = asyncio.get_running_loop()
        async with app.router.lifespan_context(app):
            batcher = app.state.serve["batcher"]
            batcher._forward = blocked_forward(batcher._forward)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=WAIT_S) as c:
                post = lambda body: c.post("/v1/predict", json=body)  # noqa: E731
                first = asyncio.ensure_future(post({"rows": rows(2, 1)}))  # taken into a batch: compute blocks
                assert await loop.run_in_executor(None, entered.wait, WAIT_S)
                queued = [asyncio.ensure_future(post({"rows": rows(2, s)})) for s in (2, 3)]  # fill the queue
                for _ in range(2000):  # bounded: until both wait in the queue (4 rows of 4)
                    if batcher.queued_rows == 4:
                        break
                    await asyncio.sleep(0.005)
                assert batcher.queued_rows == 4
                refused = await asyncio.wait_for(post({"rows": rows(1, 4)}), WAIT_S)
                busy = not release.is_set() and not first.done() and not any(q.done() for q in queued)
                release.set()
                answered = await asyncio.wait_for(asyncio.gather(first, *queued), WAIT_S)
                bad = rows(2, 5)
                bad[1]["I2"] = "many"  # not a number: named by row and feature (encoded beside the loop or on it)
                invalid = await asyncio.wait_for(post({"rows": bad}), WAIT_S)
        return refused, busy, answered, invalid

    refused, busy, answered, invalid = asyncio.run(scenario())
    assert invalid.status_code == 422 and (invalid.json()["row"], invalid.json()["field"]) == (1, "I2")
    assert refused.status_code == 503 and "queue is full" in refused.json()["error"]
    assert busy, "the refusal came only after the compute thread was released"
    for r, seed in zip(answered, (1, 2, 3)):
        assert r.status_code == 200, r.text
        expected = reference.predict_rows(rows(2, seed))
        assert r.json()["probabilities"] == pytest.approx(expected, rel=2e-6, abs=1e-7)
    # the compute thread ran 5 steps nicer than this (the event loop's) thread, as the OS reports it
    assert seen["tid"] != threading.get_native_id()
    assert seen["nice"] == min(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 5, 19)


def test_full_queue_refused_before_routing_with_the_clock_stamped(tmp_path):
    """A full queue's refusal is made in front of the routing: the prediction route's handler never runs for it
    (counted by wrapping the route), even for a body that is not JSON (not parsed), which, once the queue has
    room, the handler answers 400. Every answer's ``x-embedscale-clock`` (arrival, answer) lies within the
    client's own send and read on the same monotonic clock, in that order. While serving, the interpreter's
    switch interval is the configured one; after, Python's again."""
    export = tiny_export(tmp_path / "model")
    cfg = ServeConfig(queue_rows=2, max_batch=2, max_wait_ms=0, timing_headers=True, switch_interval_ms=0.5)
    app = make_app(load_export(export), cfg)
    release, entered, handled = threading.Event(), threading.Event(), []
    (route,) = [r for r in app.router.routes if getattr(r, "path", None) == "/v1/predict"]
    handler = route.app

    async def counting(scope, receive, send):
        handled.append(scope["path"])
        await handler(scope, receive, send)

    route.app = counting
    before = sys.getswitchinterval()

    async def scenario():
        loop = asyncio.get_running_loop()
        async with app.router.lifespan_context(app):
            switch = sys.getswitchinterval()
            batcher = app.state.serve["batcher"]
            forward = batcher._forward
            batcher._forward = lambda s, p: (entered.set(), release.wait(WAIT_S), forward(s, p))[2]
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=WAIT_S) as c:
                first = asyncio.ensure_future(c.post("/v1/predict", json={"rows": rows(2, 1)}))
                assert await loop.run_in_executor(None, entered.wait, WAIT_S)
                queued = asyncio.ensure_future(c.post("/v1/predict", json={"rows": rows(2, 2)}))
                for _ in range(2000):  # bounded: until it waits in the queue
                    if batcher.queued_rows == 2:
                        break
                    await asyncio.sleep(0.005)
                n_handled = len(handled)
                sent = time.monotonic_ns()
                refused = await asyncio.wait_for(c.post("/v1/predict", content=b"not json"), WAIT_S)
                read = time.monotonic_ns()
                refused_handled = len(handled) - n_handled
                release.set()
                answered = await asyncio.wait_for(asyncio.gather(first, queued), WAIT_S)
                bad = await c.post("/v1/predict", content=b"not json")
        return switch, refused, (sent, read), refused_handled, answered, bad

    switch, refused, (sent, read), refused_handled, answered, bad = asyncio.run(scenario())
    assert refused.status_code == 503 and "queue is full" in refused.json()["error"]
    assert refused_handled == 0, "the refused request reached the route's handler"
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]
    assert [r.status_code for r in answered] == [200, 200]
    arrived, answer = map(int, refused.headers["x-embedscale-clock"].split())
    assert sent <= arrived <= answer <= read
    for r in (*answered, bad):
        arrived, answer = map(int, r.headers["x-embedscale-clock"].split())
        assert arrived <= answer
    assert switch == pytest.approx(0.0005) and sys.getswitchinterval() == before


def test_rows_being_encoded_count_against_the_queue(tmp_path, monkeypatch):
    """A request's rows count as waiting from the moment it is admitted, while it is still being encoded beside
    the event loop: with room for 4 rows and a 3-row request held in its encoding, a 2-row request is refused
    (3 + 2 > 4: a plain count) and a 1-row one admitted; a request whose encoding fails (422) gives its rows
    back. The answers equal the model's own scores."""
    import embedscale.serve.server as server

    export = tiny_export(tmp_path / "model")
    reference = load_export(export)
    app = make_app(load_export(export), ServeConfig(queue_rows=4, max_batch=8, max_wait_ms=0, encode_thread=True))
    release, held = threading.Event(), threading.Event()
    encoded = server._encoded

    def slow_first(served, rows_, cfg):
        if len(rows_) == 3 and not release.is_set():
            held.set()
            assert release.wait(WAIT_S), "the test never released the encoding"
        return encoded(served, rows_, cfg)

    monkeypatch.setattr(server, "_encoded", slow_first)

    async def scenario():
        loop = asyncio.get_running_loop()
        async with app.router.lifespan_context(app):
            batcher = app.state.serve["batcher"]
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=WAIT_S) as c:
                post = lambda body: c.post("/v1/predict", json=body)  # noqa: E731
                first = asyncio.ensure_future(post({"rows": rows(3, 1)}))
                assert await loop.run_in_executor(None, held.wait, WAIT_S)
                waiting = batcher.queued_rows
                too_many = await asyncio.wait_for(post({"rows": rows(2, 2)}), WAIT_S)
                release.set()
                one = await asyncio.wait_for(post({"rows": rows(1, 3)}), WAIT_S)
                answered = await asyncio.wait_for(first, WAIT_S)
                bad = rows(3, 4)
                bad[2]["I2"] = "many"
                invalid = await asyncio.wait_for(post({"rows": bad}), WAIT_S)
                after = batcher.queued_rows
        return waiting, too_many, one, answered, invalid, after

    waiting, too_many, one, answered, invalid, after = asyncio.run(scenario())
    assert waiting == 3, "the rows being encoded were not counted as waiting"
    assert too_many.status_code == 503 and "queue is full" in too_many.json()["error"]
    assert invalid.status_code == 422 and invalid.json()["row"] == 2
    assert after == 0, "a request answered 422 kept its rows counted"
    for r, (n, seed) in ((one, (1, 3)), (answered, (3, 1))):
        assert r.status_code == 200, r.text
        assert r.json()["probabilities"] == pytest.approx(reference.predict_rows(rows(n, seed)), rel=2e-6, abs=1e-7)


@pytest.mark.parametrize("freeze", [True, False])
def test_the_loaded_model_is_left_out_of_full_collections(tmp_path, freeze):
    """With ``gc_freeze`` (the default) every object alive once the server has started (the model, torch, the
    libraries: thousands) is in the collector's permanent generation while serving, so a full collection walks
    only what came since (counted against the objects the collector tracked before the start); after the server
    stops, nothing stays frozen. Without it nothing is frozen."""
    import gc

    app = make_app(load_export(tiny_export(tmp_path / "model")), ServeConfig(gc_freeze=freeze))
    gc.collect()
    tracked_before = len(gc.get_objects())
    assert gc.get_freeze_count() == 0

    async def scenario():
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count(), len(gc.get_objects())

    frozen, tracked = asyncio.run(scenario())
    if freeze:
        assert frozen >= 0.9 * tracked_before and tracked < 0.1 * tracked_before, (frozen, tracked, tracked_before)
    else:
        assert frozen == 0 and tracked >= 0.9 * tracked_before, (frozen, tracked, tracked_before)
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("young", [10_000, 0])
def test_young_collections_wait_for_gc_young_allocations(tmp_path, young):
    """While serving, Python's collector runs its young generation only after ``gc_young`` net allocations
    (0: Python's own 700): 5,000 containers alive at once (a burst of requests' objects) trigger no collection
    at 10,000 and at least one at 700, counted by the collector's own statistics; garbage in cycles is still
    collected once 20,000 of it are alive (a weak reference to one of them is cleared); afterwards Python's
    thresholds are back."""
    import gc
    import weakref

    class Node:
        pass

    app = make_app(load_export(tiny_export(tmp_path / "model")), ServeConfig(gc_young=young))
    before = gc.get_threshold()

    async def scenario():
        async with app.router.lifespan_context(app):
            gc.collect(0)  # the count of allocations starts at 0 here
            n0 = gc.get_stats()[0]["collections"]
            burst = [[i] for i in range(5_000)]
            n1 = gc.get_stats()[0]["collections"]
            del burst
            first = Node()
            first.self = first
            probe = weakref.ref(first)
            del first
            for _ in range(20_000):
                cycle = Node()
                cycle.self = cycle
            del cycle
            return n1 - n0, probe() is None

    burst_collections, cycle_freed = asyncio.run(scenario())
    assert (burst_collections == 0) if young == 10_000 else (burst_collections >= 1), burst_collections
    assert cycle_freed, "garbage in cycles was never collected while serving"
    assert gc.get_threshold() == before


SERVE_LOOP = """
import resource, sys, threading
import numpy as np
import uvicorn
from embedscale.serve import server

def batch():  # a batch's buffers in the compute thread: eight 2 MB blocks, written and freed
    blocks = [np.ones((512, 1024), dtype=np.float32) for _ in range(8)]
    del blocks

def run(self):  # in place of serving: the compute thread's allocations, counted by the kernel
    def work():
        for _ in range(3):
            batch()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(20):
            batch()
        print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    self.started = True

uvicorn.Server.run = run
sys.exit(server.serve(sys.argv[1], port=0))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's fault counts")
def test_the_server_process_reuses_freed_memory_without_new_page_faults(tmp_path):
    """A process started by ``serve`` keeps the memory a batch frees for the next one: a thread that allocates,
    writes and frees a batch's buffers (eight 2 MB blocks) 20 times faults their pages in once, counted by the
    kernel (minor faults of the thread), against the same server entry with glibc's default ``malloc``
    (``EMBEDSCALE_THREADS=torch``), which faults every batch's blocks in again."""
    import subprocess

    export = tiny_export(tmp_path / "model")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "EMBEDSCALE_THREADS") and not k.startswith("MALLOC_")}

    def faults(extra: dict) -> int:
        out = subprocess.run([sys.executable, "-c", SERVE_LOOP, str(export)], env={**env, **extra},
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1])

    pages = 20 * 8 * (2 << 20) // 4096
    kept, default = faults({}), faults({"EMBEDSCALE_THREADS": "torch"})
    assert default > pages // 2, default  # glibc's default: most blocks faulted in again every batch
    assert kept < pages // 20, (kept, default)
