"""The prediction server, started as ``embedscale serve`` on a loopback port: its answers equal ``predict``'s
for the same rows (requests sent concurrently, so batches mix them), a fuzz of malformed requests gets only
4xx JSON errors naming the row and feature and the server answers a valid request after, a full queue
answers 503, /healthz /readyz /metrics, and SIGTERM answers what is in flight and exits 0. Every request
goes to 127.0.0.1, from loops bounded in count and time."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from serve_fixtures import train_tiny, write_criteo

from embedscale.serve.export import export
from embedscale.serve.predict import predict_file

START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(export_dir: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """A server on a free loopback port; a port taken by another process between the probe and the server's bind
    (the tests run beside others) is tried again on a new one, up to three times."""
    for _ in range(3):
        try:
            return _start_on(free_port(), export_dir, *args)
        except _PortTaken:
            continue
    raise AssertionError("three free ports were taken before the server could bind them")


class _PortTaken(Exception):
    pass


def _start_on(port: int, export_dir: Path, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "embedscale", "serve", str(export_dir), "--host", "127.0.0.1",
                             "--port", str(port), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode()
            if "address already in use" in out:
                raise _PortTaken(out)
            raise AssertionError(f"the server exited with {proc.returncode}: {out}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise AssertionError("the server did not become ready")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-server")
    run_dir, _ = train_tiny(root)
    export(run_dir, root / "model", "int8")
    rows = write_criteo(root / "q.tsv", 48, seed=3)
    predict_file(root / "model", root / "q.tsv", root / "q.parquet")
    probs = pq.read_table(root / "q.parquet").column("probability").to_numpy()
    version = json.loads((root / "model" / "export.json").read_text())["model_version"]
    return root, rows, probs, version


@pytest.fixture(scope="module")
def server(model):
    root = model[0]
    proc, url = start(root / "model", "--max-rows", "64", "--max-body-bytes", "65536", "--max-wait-ms", "5")
    yield url
    stop(proc)


def post(url: str, body, client: httpx.Client | None = None, **kw) -> httpx.Response:
    send = client.post if client is not None else httpx.post
    if isinstance(body, (bytes, str)):
        return send(url + "/v1/predict", content=body, timeout=REQUEST_TIMEOUT_S, **kw)
    return send(url + "/v1/predict", json=body, timeout=REQUEST_TIMEOUT_S, **kw)


def test_answers_equal_predict(model, server):
    root, rows, probs, version = model
    chunks = [(0, 1), (1, 8), (8, 9), (9, 25), (25, 30), (30, 48)]
    with ThreadPoolExecutor(6) as pool:  # concurrent: the server batches them together as they come
        answers = list(pool.map(lambda c: post(server, {"rows": rows[c[0]:c[1]]}), chunks))
    got = []
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == version
        got.extend(r.json()["probabilities"])
    # the same float32 logits as predict (up to float32 rounding of different batch shapes), sigmoid in float32
    np.testing.assert_allclose(got, probs, rtol=2e-6, atol=1e-7)
    assert post(server, {"rows": []}).json()["probabilities"] == []


def test_ranking_call_scores_candidates_with_the_shared_context(model, server):
    root, rows, probs, version = model
    shared = [f"I{i}" for i in range(1, 14)] + ["C1", "C2"]
    context = {f: rows[0][f] for f in shared}
    cands = [{f: v for f, v in r.items() if f not in shared} for r in rows[:10]]
    r = post(server, {"context": context, "candidates": cands})
    assert r.status_code == 200, r.text
    full = post(server, {"rows": [{**context, **c} for c in cands]}).json()["probabilities"]
    np.testing.assert_allclose(r.json()["probabilities"], full, rtol=2e-6, atol=1e-7)
    assert r.json()["probabilities"][0] == pytest.approx(probs[0], rel=2e-6)  # candidate 0 is row 0 itself
    bad = [dict(c) for c in cands[:3]]
    bad[2]["C5"] = "not-hex"
    err = post(server, {"context": context, "candidates": bad}).json()
    assert err["row"] == 2 and err["field"] == "C5" and "candidate 2" in err["error"]
    bad[2] = {**cands[2], "C1": "ab"}
    err = post(server, {"context": context, "candidates": bad}).json()
    assert err["row"] == 2 and err["field"] == "C1" and "context too" in err["error"]
    assert httpx.post(server + "/v1/model/rollback", timeout=REQUEST_TIMEOUT_S).status_code == 409


def malformed(rng: random.Random, valid: dict) -> tuple[object, int | None, str | None]:
    """One malformed request: (body, the row it names or None, the field it names or None)."""
    rows = [dict(valid) for _ in range(rng.randint(1, 4))]
    i = rng.randrange(len(rows))
    feature = rng.choice(sorted(valid))
    kind = rng.randrange(12)
    if kind == 0:
        del rows[i][feature]
    elif kind == 1:
        rows[i]["C99"] = "ab"
        feature = "C99"
    elif kind == 2:
        rows[i][feature] = rng.choice([[1], {"a": 1}, True, [], {"x": None}])
        if feature.startswith("C") and rows[i][feature] == []:
            rows[i][feature] = {"x": 1}
    elif kind == 3:
        feature = f"I{rng.randint(1, 13)}"
        rows[i][feature] = rng.choice(["3", "abc", 1.5, 1e300 * 10, -2.25])
    elif kind == 4:
        feature = f"C{rng.randint(1, 26)}"
        rows[i][feature] = rng.choice(["xyz", "12345678901234567", "-1", "0x1g", 2.5, "g" * 3])
    elif kind == 5:
        rows[i] = rng.choice([[1, 2], "row", 7, None])
        feature = None
    elif kind == 6:
        return rng.choice([b"{", b"not json", b"\xff\xfe", b"[1, 2]", b"null", b"\"rows\""]), None, None
    elif kind == 7:
        return {"rows": rng.choice([{}, "x", 3, None])}, None, "rows"
    elif kind == 8:
        return {"rows": rows, "extra": 1}, None, "extra"
    elif kind == 9:
        return {"rows": [dict(valid)] * 65}, None, "rows"  # more than --max-rows 64
    elif kind == 10:
        return b'{"rows": [' + b" " * 70000 + b"]}", None, None  # over --max-body-bytes
    else:
        return {}, None, "rows"
    return {"rows": rows}, i, feature


def test_fuzz_of_malformed_requests_gets_only_4xx_then_serves(model, server):
    root, rows, probs, version = model
    rng = random.Random(29)
    deadline = time.monotonic() + 240
    sent = 0
    client = httpx.Client()  # one keep-alive connection
    for _ in range(300):  # bounded in count and in time
        if time.monotonic() > deadline:
            break
        body, row, field = malformed(rng, rows[0])
        r = post(server, json.dumps(body, allow_nan=True) if not isinstance(body, bytes) else body, client,
                 headers={"content-type": "application/json"})
        sent += 1
        assert 400 <= r.status_code < 500, (body if len(str(body)) < 500 else "large body", r.status_code, r.text)
        err = r.json()
        assert err["error"]
        if row is not None:
            assert err["row"] == row, (body, err)
        if field is not None and row is not None:
            assert err["field"] == field, (body, err)
    assert sent >= 100
    r = post(server, {"rows": rows[:2]}, client)
    client.close()
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["probabilities"], probs[:2], rtol=2e-6, atol=1e-7)


def test_health_ready_metrics_model(model, server):
    root, rows, probs, version = model
    assert httpx.get(server + "/healthz", timeout=REQUEST_TIMEOUT_S).json() == {"status": "ok"}
    assert httpx.get(server + "/readyz", timeout=REQUEST_TIMEOUT_S).status_code == 200
    m = httpx.get(server + "/v1/model", timeout=REQUEST_TIMEOUT_S).json()
    assert m["model_version"] == version and len(m["tables"]) == 26 and m["tables"][0]["form"] == "int8"
    post(server, {"rows": rows[:3]})
    text = httpx.get(server + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['embedscale_requests_total{code="200"}'] >= 1
    assert samples["embedscale_request_latency_seconds_count"] >= 1
    assert samples["embedscale_batch_rows_sum"] >= 3
    assert samples["embedscale_queue_rows"] == 0
    assert samples[f'embedscale_model_info{{model_version="{version}"}}'] == 1


def test_full_queue_answers_503_and_sigterm_drains(model):
    root, rows, probs, version = model
    # a slow model (1 s a batch) and room for 6 queued rows: requests of 3 rows beyond that are turned away
    proc, url = start(root / "model", "--test-delay-ms", "1000", "--queue-rows", "6", "--max-batch", "64")
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda k: post(url, {"rows": rows[3 * k:3 * k + 3]}), range(8)))
        codes = [r.status_code for r in answers]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
        for k, r in enumerate(answers):
            if r.status_code == 200:
                np.testing.assert_allclose(r.json()["probabilities"], probs[3 * k:3 * k + 3], rtol=2e-6, atol=1e-7)
            else:
                assert "queue is full" in r.json()["error"]
        # SIGTERM while requests are in flight: they are answered, then the process exits 0
        rows0 = metric(url, "embedscale_batch_rows_sum")
        with ThreadPoolExecutor(2) as pool:
            pending = [pool.submit(post, url, {"rows": rows[k:k + 1]}) for k in range(2)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the server holds both: queued, or in a started batch (1 s)
                if metric(url, "embedscale_queue_rows") + metric(url, "embedscale_batch_rows_sum") - rows0 >= 2:
                    break
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            done = [f.result(timeout=REQUEST_TIMEOUT_S) for f in pending]
        assert [r.status_code for r in done] == [200, 200]
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def test_serving_loads_no_training_code_and_no_torchrec():
    code = ("import sys, embedscale.serve.server, embedscale.serve.predict; "
            "print([m for m in sys.modules if m.startswith('embedscale.train') or m.startswith('torchrec') "
            "or m == 'embedscale.assemble'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_follow_swaps_versions_between_batches_never_mixing(model, tmp_path):
    """Two exports whose logits differ by exactly 1 (B: A's logit bias + 1) replace each other in the served
    directory while requests keep coming: every answer is wholly A's or wholly B's, as its version says, and
    none fails."""
    import threading

    from safetensors.torch import load_file

    from embedscale.serve.export import write_export

    root, rows, probs, version_a = model
    man_a = json.loads((root / "model" / "export.json").read_text())
    tensors_a = load_file(str(root / "model" / "weights.safetensors"))
    tensors_b = dict(tensors_a)
    (bias,) = [k for k, v in tensors_a.items() if k.startswith("dense.over_arch.") and k.endswith(".bias")
               and tuple(v.shape) == (1,)]
    tensors_b[bias] = tensors_a[bias] + 1.0
    man_b = {**man_a, "model_version": version_a + "-plus1"}
    live = tmp_path / "live"
    write_export(live, man_a, tensors_a)
    z_a = np.log(probs / (1 - probs))
    proc, url = start(live, "--follow", str(live), "--follow-poll-s", "0.05", "--max-wait-ms", "5")
    answers, stop_flag = [], threading.Event()

    def load(k: int) -> None:  # bounded in count and time
        client, deadline = httpx.Client(), time.monotonic() + 180
        for i in range(150):
            if stop_flag.is_set() or time.monotonic() > deadline:
                break
            lo = (7 * i + k) % 40
            answers.append((lo, post(url, {"rows": rows[lo:lo + 1 + (i % 8)]}, client)))
        client.close()

    try:
        loaders = [threading.Thread(target=load, args=(k,)) for k in range(3)]
        for t in loaders:
            t.start()
        seen = []
        for swap in range(6):
            man, tensors = (man_b, tensors_b) if swap % 2 == 0 else (man_a, tensors_a)
            write_export(live, man, tensors)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                v = httpx.get(url + "/v1/model", timeout=REQUEST_TIMEOUT_S).json()["model_version"]
                if v == man["model_version"]:
                    seen.append(v)
                    break
                time.sleep(0.05)
        stop_flag.set()
        for t in loaders:
            t.join(timeout=240)
        # rollback: the model before the last swap (B) again, in one request
        r = httpx.post(url + "/v1/model/rollback", timeout=REQUEST_TIMEOUT_S).json()
        assert r == {"model_version": man_b["model_version"], "previous": version_a}
        p = np.asarray(post(url, {"rows": rows[:4]}).json()["probabilities"], np.float64)
        np.testing.assert_allclose(np.log(p / (1 - p)), z_a[:4] + 1.0, atol=2e-3)
    finally:
        stop_flag.set()
        assert stop(proc) == 0
    assert seen == [man_b["model_version"], version_a] * 3
    assert answers and all(r.status_code == 200 for _, r in answers), [r.text for _, r in answers if r.status_code != 200]
    versions = set()
    for lo, r in answers:
        body = r.json()
        p = np.asarray(body["probabilities"], np.float64)
        shift = {version_a: 0.0, man_b["model_version"]: 1.0}[body["model_version"]]
        versions.add(body["model_version"])
        np.testing.assert_allclose(np.log(p / (1 - p)), z_a[lo:lo + len(p)] + shift, atol=2e-3)


def test_two_workers_answer_as_predict_from_one_mapped_copy(model):
    root, rows, probs, version = model
    proc, url = start(root / "model", "--workers", "2")
    try:
        chunks = [(0, 5), (5, 12), (12, 20), (20, 33), (33, 48)] * 2
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda c: post(url, {"rows": rows[c[0]:c[1]]}), chunks))
        for (lo, hi), r in zip(chunks, answers):
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["probabilities"], probs[lo:hi], rtol=2e-6, atol=1e-7)
        weights = str((root / "model" / "weights.safetensors").resolve())
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:  # the workers start one after the other: until both have loaded
            children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == proc.pid]
            mapping = [c for c in children if weights in _maps(c)]
            if len(mapping) >= 2:
                break
            time.sleep(0.2)
        assert len(mapping) == 2, (children, mapping)  # each worker reads the tables from the one file mapping
    finally:
        assert stop(proc) == 0


def _ppid(p: Path) -> int:
    try:
        return int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""
