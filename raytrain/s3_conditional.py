"""Compare-and-swap on one S3 object: create only when absent (`If-None-Match: *`), replace only when unchanged
(`If-Match: <etag>`). The run lock is built on these two; pyarrow's S3 filesystem cannot send either header, so
this module talks to S3 through boto3 with the endpoint and region the StorageLocation resolved.

Every function takes an s3 StorageLocation (`path` = "bucket/key"). A lost race is a return value (None/False),
never an exception; other S3 errors propagate as botocore's ClientError.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

# Codes S3 answers when a condition does not hold: 412 on a failed If-Match / If-None-Match, 409 when another
# conditional write to the same key is in flight, 404 for If-Match on a key that is gone.
_LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "412", "409"}


def create(loc: StorageLocation, data: bytes) -> str | None:
    """Write `data` at `loc` only if no object is there; the new object's ETag, or None when one already was."""
    try:
        reply = _put(loc, data, IfNoneMatch="*")
    except _client_error() as exc:
        if _lost_race(exc):
            return None
        raise
    return str(reply["ETag"])


def replace(loc: StorageLocation, data: bytes, etag: str) -> str | None:
    """Overwrite the object at `loc` only while its ETag is still `etag`; the new ETag, or None when it changed
    (or vanished) since it was read."""
    try:
        reply = _put(loc, data, IfMatch=etag)
    except _client_error() as exc:
        if _lost_race(exc):
            return None
        raise
    return str(reply["ETag"])


def read(loc: StorageLocation) -> tuple[bytes, str] | None:
    """(content, ETag) of the object at `loc`, or None when there is none."""
    bucket, key = _bucket_key(loc)
    try:
        reply = client(loc.s3_endpoint).get_object(Bucket=bucket, Key=key)
    except _client_error() as exc:
        if _code(exc) in ("NoSuchKey", "404"):
            return None
        raise
    return reply["Body"].read(), str(reply["ETag"])


@functools.lru_cache(maxsize=8)
def client(endpoint: str | None) -> Any:
    """A boto3 S3 client for `endpoint` (None = AWS) with the standard credentials chain and standard retries."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - boto3 is a dependency
        raise RaytrainError("the S3 run lock needs boto3: pip install boto3") from exc
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    config = Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=10, read_timeout=30)
    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region, config=config)


def _put(loc: StorageLocation, data: bytes, **condition: str) -> dict[str, Any]:
    bucket, key = _bucket_key(loc)
    return client(loc.s3_endpoint).put_object(Bucket=bucket, Key=key, Body=data, **condition)


def _bucket_key(loc: StorageLocation) -> tuple[str, str]:
    if loc.scheme != "s3" or "/" not in loc.path:
        raise RaytrainError(f"{loc.uri}: conditional writes need an object key on s3://bucket/key")
    bucket, key = loc.path.split("/", 1)
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
