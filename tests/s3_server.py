"""A local S3-compatible server for tests: moto's, on loopback, with the AWS environment pointing every process
started inside the block (launchers and ranks too) at it."""

from __future__ import annotations

import contextlib
import os
import socket
import time


@contextlib.contextmanager
def local_s3(bucket: str):
    """Start moto's server on 127.0.0.1, create ``bucket``; yields its fsspec filesystem."""
    from moto.server import ThreadedMotoServer

    from embedscale.storage import location

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    _wait_listening(port)
    # botocore's standard retry mode retries a refused or reset connection (a loaded machine, many ranks at once)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "8"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        fs = location(f"s3://{bucket}").fs
        fs.mkdir(bucket)
        yield fs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    """The server thread binds its socket some time after ``start()`` returns: wait until it accepts."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local S3 server on 127.0.0.1:{port} did not start within {timeout_s:.0f} s")
            time.sleep(0.05)
