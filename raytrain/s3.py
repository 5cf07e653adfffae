"""S3 clients: pyarrow's filesystem and boto3's client with the same retries and timeouts, and the conditional
writes (create only if absent, replace only if unchanged) that make the run lock atomic on S3.

Every S3 client retries throttling (503 SlowDown), 5xx answers and broken connections with exponential backoff and
jitter (the AWS SDKs' "standard" mode) and times out stalled requests (``S3RetrySettings``, RAYTRAIN_S3_*).
Credentials are never passed in: each process takes them from the standard AWS chain.
"""

from __future__ import annotations

import functools
import io
import os
import random
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from raytrain.errors import RaytrainError


@dataclass(frozen=True)
class S3RetrySettings:
    """How every S3 client raytrain builds (pyarrow's and botocore's) retries and times out."""

    max_attempts: int = 10
    """Attempts per request, the first included (1 = no retry). Throttling (503 SlowDown), 5xx and connection
    errors are retried with exponential backoff and jitter (the AWS SDKs' "standard" mode)."""
    connect_timeout_s: float = 10.0
    """Seconds to open a connection."""
    request_timeout_s: float = 60.0
    """Seconds a request may go without receiving data before it is abandoned (and retried)."""


_S3_ENV = {
    "max_attempts": "RAYTRAIN_S3_MAX_ATTEMPTS",
    "connect_timeout_s": "RAYTRAIN_S3_CONNECT_TIMEOUT_S",
    "request_timeout_s": "RAYTRAIN_S3_REQUEST_TIMEOUT_S",
}


def s3_retry_settings() -> S3RetrySettings:
    """``S3RetrySettings`` defaults, each overridden by its RAYTRAIN_S3_* environment variable when set (read in
    the process that builds the client). RaytrainError naming the variable for a value out of range."""
    values: dict[str, Any] = {}
    for name, var in _S3_ENV.items():
        raw = os.environ.get(var, "").strip()
        if not raw:
            continue
        try:
            value = int(raw) if name == "max_attempts" else float(raw)
        except ValueError:
            value = 0
        if not (0 < value < 1e6):  # also refuses nan/inf
            raise RaytrainError(f"{var}={raw!r}: expected a positive {'whole ' if name == 'max_attempts' else ''}"
                                f"number (default {getattr(S3RetrySettings, name)})")
        values[name] = value
    return S3RetrySettings(**values)


class RetryingS3FileSystem(pafs.S3FileSystem):
    """pafs.S3FileSystem with AWS standard retries that keeps them when pickled: pyarrow's own pickling drops the
    retry strategy (the copy a Ray task or Ray Train worker unpickles would retry 3 times). The pickled state is
    pyarrow's constructor dict (Ray Data reads it) plus the settings; credentials are never passed in, each
    process takes them from the standard AWS chain."""

    def __init__(self, settings: S3RetrySettings, **options: Any) -> None:
        super().__init__(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=settings.max_attempts),
                         connect_timeout=settings.connect_timeout_s, request_timeout=settings.request_timeout_s,
                         **options)
        self._settings = settings

    def __reduce__(self) -> tuple[Any, ...]:
        _, (state,) = super().__reduce__()
        return _rebuild_s3_filesystem, ({**state, _SETTINGS_KEY: self._settings},)


_SETTINGS_KEY = "raytrain_retry_settings"


def _rebuild_s3_filesystem(state: dict[str, Any]) -> RetryingS3FileSystem:
    options = {k: v for k, v in state.items() if k not in (_SETTINGS_KEY, "connect_timeout", "request_timeout")}
    return RetryingS3FileSystem(state[_SETTINGS_KEY], **options)


@functools.lru_cache(maxsize=32)
def s3_filesystem(endpoint: str | None, region: str | None, settings: S3RetrySettings) -> RetryingS3FileSystem:
    if endpoint is None:
        return RetryingS3FileSystem(settings)
    split = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    return RetryingS3FileSystem(settings, endpoint_override=split.netloc, scheme=split.scheme, region=region)


# ---- reads that survive an error answer longer than the range read -------------------------------------------
# pyarrow hands the AWS SDK a buffer of exactly the bytes it asked for. When S3 answers a GET with an error instead
# (503 SlowDown, ~250 bytes of XML) and the range is shorter than that body, the body overflows the buffer and the
# SDK reports "Failed to flush response stream" as INTERNAL_FAILURE, which its retry strategy never retries: a
# throttled read of any small object (the `latest` pointer, owner.json, a lock) or of a file's short last chunk
# ended the caller (benchmarks/RESULTS.md, 'Throttled S3 reads of small objects').
MISREAD = "Failed to flush response stream"


def read_range(f: Any, nbytes: int, position: int, settings: S3RetrySettings) -> bytes:
    """``f.read_at(nbytes, position)`` on a pyarrow S3 file, retried with exponential backoff and jitter (up to
    ``settings.max_attempts`` attempts) when the SDK reports the unretried overflow above."""
    for attempt in range(1, settings.max_attempts + 1):
        try:
            return f.read_at(nbytes, position)
        except OSError as exc:
            if MISREAD not in str(exc) or attempt == settings.max_attempts:
                raise
            time.sleep(random.uniform(0, min(20.0, 0.05 * 2**attempt)))
    raise AssertionError("unreachable")


class RangeReader(io.RawIOBase):
    """A seekable reader over a pyarrow S3 file whose reads go through ``read_range``. Wrap it in
    ``io.BufferedReader`` for small reads; reads larger than the buffer go to S3 as one ranged GET each."""

    def __init__(self, f: Any, settings: S3RetrySettings) -> None:
        super().__init__()
        self._f, self._settings = f, settings
        self._size, self._pos = f.size(), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        data = self._read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self._read(self._size - self._pos)

    def _read(self, n: int) -> bytes:
        n = min(n, self._size - self._pos)
        if n <= 0:
            return b""
        data = read_range(self._f, n, self._pos, self._settings)
        self._pos += len(data)
        return data

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def s3_client_config() -> Any:
    """The botocore ``Config`` for any boto3/botocore S3 client in raytrain: the same retries and timeouts as the
    pyarrow filesystem (``s3_retry_settings``), botocore's "standard" retry mode. Needs botocore installed."""
    from botocore.config import Config

    settings = s3_retry_settings()
    return Config(retries={"mode": "standard", "total_max_attempts": settings.max_attempts},
                  connect_timeout=settings.connect_timeout_s, read_timeout=settings.request_timeout_s)


# ---- conditional writes (If-None-Match / If-Match) ------------------------------------------------------------
# Codes S3 answers when a condition does not hold: 412 on a failed If-Match / If-None-Match, 409 when another
# conditional write to the same key is in flight, 404 for If-Match on a key that is gone.
_LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "412", "409"}


def create(uri: str, path: str, data: bytes, endpoint: str | None) -> str | None:
    """Write `data` at `path` ("bucket/key" of `uri`) only if no object is there; the new object's ETag, or None
    when one already was."""
    try:
        reply = _put(uri, path, endpoint, data, IfNoneMatch="*")
    except _client_error() as exc:
        if _lost_race(exc):
            return None
        raise
    return str(reply["ETag"])


def replace(uri: str, path: str, data: bytes, etag: str, endpoint: str | None) -> str | None:
    """Overwrite the object at `path` only while its ETag is still `etag`; the new ETag, or None when it changed
    (or vanished) since it was read."""
    try:
        reply = _put(uri, path, endpoint, data, IfMatch=etag)
    except _client_error() as exc:
        if _lost_race(exc):
            return None
        raise
    return str(reply["ETag"])


def read(uri: str, path: str, endpoint: str | None) -> tuple[bytes, str] | None:
    """(content, ETag) of the object at `path`, or None when there is none."""
    bucket, key = _bucket_key(uri, path)
    try:
        reply = client(endpoint).get_object(Bucket=bucket, Key=key)
    except _client_error() as exc:
        if _code(exc) in ("NoSuchKey", "404"):
            return None
        raise
    return reply["Body"].read(), str(reply["ETag"])


@functools.lru_cache(maxsize=8)
def client(endpoint: str | None) -> Any:
    """A boto3 S3 client for `endpoint` (None = AWS): the standard credentials chain, ``s3_client_config``."""
    try:
        import boto3
    except ImportError as exc:  # pragma: no cover - boto3 is a dependency
        raise RaytrainError("the S3 run lock needs boto3: pip install boto3") from exc
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region, config=s3_client_config())


def _put(uri: str, path: str, endpoint: str | None, data: bytes, **condition: str) -> dict[str, Any]:
    bucket, key = _bucket_key(uri, path)
    return client(endpoint).put_object(Bucket=bucket, Key=key, Body=data, **condition)


def _bucket_key(uri: str, path: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or "/" not in path:
        raise RaytrainError(f"{uri}: conditional writes need an object key on s3://bucket/key")
    bucket, key = path.split("/", 1)
    return bucket, key


def _client_error() -> type[Exception]:
    from botocore.exceptions import ClientError

    return ClientError


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", {}) or {}
    return str((response.get("Error") or {}).get("Code", ""))


def _lost_race(exc: Exception) -> bool:
    status = str(((getattr(exc, "response", {}) or {}).get("ResponseMetadata") or {}).get("HTTPStatusCode", ""))
    return _code(exc) in _LOST_RACE or status in ("412", "409")
