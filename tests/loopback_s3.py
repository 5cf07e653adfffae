"""A moto S3 server on 127.0.0.1 with dummy credentials, shared by the S3 tests (unit and integration)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

AWS_VARS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def loopback_s3() -> Iterator[str]:
    """Start the server, set AWS_VARS in os.environ, yield the endpoint URL; stop and restore the env after."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in AWS_VARS}
    os.environ.update(AWS_VARS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
