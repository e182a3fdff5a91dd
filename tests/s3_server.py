"""A local S3-compatible server for tests: moto's, on loopback, with the AWS environment pointing every process
started inside the block (launchers and ranks too) at it."""

from __future__ import annotations

import contextlib
import os
import socket


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
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
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
