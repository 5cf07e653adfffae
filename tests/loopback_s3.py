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


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>")
"""The body S3 answers a throttled request with (HTTP 503)."""


class FaultProxy:
    """An HTTP reverse proxy on 127.0.0.1 in front of an S3 endpoint: passes requests through, except that the
    next ``fail_next(n)`` requests, and after ``fail_every(n)`` every n-th request, are answered 503 SlowDown as S3
    throttling does, and the next ``stall_next(n)`` are held unanswered for ``stall_s`` seconds (a server that
    stopped sending). Counts what it did."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import threading
        from urllib.parse import urlsplit

        self.upstream = urlsplit(upstream).netloc
        self.to_fail = 0
        self.to_stall = 0
        self.fail_method: str | None = None
        self.every = 0
        self.seen = 0
        self.stall_s = 5.0
        self.failed = 0
        self.stalled = 0
        self.passed = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail_next(self, n: int, method: str | None = None) -> None:
        """Answer the next n requests (of `method` only, when given) 503 SlowDown."""
        with self.lock:
            self.to_fail, self.fail_method = n, method

    def fail_every(self, n: int) -> None:
        """Answer every n-th request from now on 503 SlowDown (0: none), a steady share of throttled requests."""
        with self.lock:
            self.every, self.seen = n, 0

    def stall_next(self, n: int, seconds: float) -> None:
        with self.lock:
            self.to_stall, self.stall_s = n, seconds

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, req) -> None:
        import http.client
        import time

        body = _read_body(req)
        with self.lock:
            self.seen += 1
            fail = self.to_fail > 0 and self.fail_method in (None, req.command)
            stall = not fail and self.to_stall > 0
            self.to_fail -= fail
            if self.every and not fail and not stall and self.seen % self.every == 0:
                fail = True
            self.to_stall -= stall
            self.failed += fail
            self.stalled += stall
        if stall:
            time.sleep(self.stall_s)
            req.close_connection = True
            return
        if fail:
            req.send_response(503, "Slow Down")
            req.send_header("Content-Type", "application/xml")
            req.send_header("Content-Length", str(len(SLOW_DOWN)))
            req.end_headers()
            if req.command != "HEAD":
                req.wfile.write(SLOW_DOWN)
            return
        conn = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            conn.putrequest(req.command, req.path, skip_host=True, skip_accept_encoding=True)
            for key, value in req.headers.items():
                conn.putheader(key, value)
            conn.endheaders(body)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        with self.lock:
            self.passed += 1
        req.send_response(resp.status, resp.reason)
        for key, value in resp.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                req.send_header(key, value)
        length = resp.getheader("Content-Length") if req.command == "HEAD" else None
        req.send_header("Content-Length", length or str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)


def _read_body(req) -> bytes:
    """The request body as sent (a chunked body keeps its framing, to be forwarded with its headers as is)."""
    if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
        raw = b""
        while True:
            line = req.rfile.readline()
            raw += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = req.rfile.readline()
                    raw += trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        return raw
            raw += req.rfile.read(size + 2)
    return req.rfile.read(int(req.headers.get("Content-Length") or 0))


@contextmanager
def fault_proxy(upstream: str) -> Iterator[FaultProxy]:
    """A FaultProxy in front of `upstream` (an endpoint URL from loopback_s3), closed after."""
    proxy = FaultProxy(upstream)
    try:
        yield proxy
    finally:
        proxy.close()
