"""Where raytrain reads and writes: one resolver from a user's URI to every framework's view of the same place.

`resolve("/mnt/lustre/team")`, `resolve("s3://bucket/runs")` or `resolve("hdfs://nn:8020/runs")` gives a
`StorageLocation` that carries its URI and the pyarrow path and filesystem (Ray Data, the checkpoint store). The
stages that need another view build it from there: Spark's URI and settings in raytrain.enrich.spark
(`spark_uri`, `spark_conf`), Ray Train's storage pair in raytrain.trainer.launch (`ray_storage`).

Layout under a shared root: `<root>/<user>/<project>/<run>/{data,checkpoints,reports,exports}/` (`run_root`).
"""

from __future__ import annotations

import functools
import getpass
import io
import os
import posixpath
import re
import uuid
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from raytrain import s3
from raytrain.errors import RaytrainError

SUPPORTED_SCHEMES = ("file", "s3", "hdfs")
# Hadoop's names for S3 connectors mean the same bucket; accept them so a `spark_uri` resolves back.
_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3"}


_URI_EXAMPLES = {
    "file": "file:///absolute/path",
    "s3": "s3://bucket/key",
    "hdfs": "hdfs://namenode:8020/absolute/path",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")


MANIFEST = "_manifest.json"
"""The file written last into a data folder (enriched rows, packed sequences): it vouches for the files listed in
it; a folder without it is an interrupted write."""


@dataclass(frozen=True)
class StorageLocation:
    """A resolved place on local/parallel POSIX storage, S3 or HDFS. Build with `resolve`, never by hand."""

    scheme: str
    """One of SUPPORTED_SCHEMES: "file" (any POSIX mount: local disk, Lustre, GPFS, WekaFS), "s3", "hdfs"."""
    path: str
    """Filesystem-native path for `filesystem`: "/mnt/x" (file, hdfs) or "bucket/key" (s3); no trailing slash."""
    authority: str = ""
    """"host:port" of the HDFS namenode ("" = fs.defaultFS); unused for file and s3 (the bucket is in `path`)."""
    s3_endpoint: str | None = None
    """S3 endpoint URL ("http://127.0.0.1:9000") for non-AWS or loopback servers; None = AWS default."""

    # ---- views for each consumer -------------------------------------------------------------------------
    @property
    def uri(self) -> str:
        """Canonical URI: file:///mnt/x, s3://bucket/key, hdfs://nn:8020/path."""
        if self.scheme == "s3":
            return f"s3://{self.path}"
        if self.scheme == "hdfs":
            return f"hdfs://{self.authority}{self.path}"
        return f"file://{self.path}"

    @property
    def local_path(self) -> str | None:
        """The POSIX path when scheme is "file" (usable with open/os/DeepSpeed), else None."""
        return self.path if self.scheme == "file" else None

    @property
    def is_posix(self) -> bool:
        """True for a POSIX mount: rename and os.replace are atomic there."""
        return self.scheme == "file"

    @property
    def filesystem(self) -> pafs.FileSystem:
        """pyarrow filesystem for `path`, created on first use and shared by all locations on the same store."""
        return _filesystem(self.scheme, self.authority, self.s3_endpoint)

    @property
    def name(self) -> str:
        """Last path component ("" for a bucket root or "/")."""
        return posixpath.basename(self.path)

    # ---- navigation --------------------------------------------------------------------------------------
    def join(self, *parts: str) -> StorageLocation:
        """Child location; each part may hold "a/b". Raises RaytrainError for empty, absolute, "." or ".." parts."""
        components: list[str] = []
        for part in parts:
            if not isinstance(part, str) or not part.strip("/"):
                raise RaytrainError(f"storage join under {self.uri}: empty path part {part!r}; pass a name")
            if part.startswith("/"):
                raise RaytrainError(
                    f"storage join under {self.uri}: part {part!r} is absolute; pass a relative name or resolve() it"
                )
            for comp in part.strip("/").split("/"):
                if comp in ("", ".", ".."):
                    raise RaytrainError(
                        f"storage join under {self.uri}: part {part!r} contains {comp!r}; paths may not leave "
                        "or re-enter their parent, pass a plain relative name"
                    )
                components.append(comp)
        base = self.path.rstrip("/")
        return _replace_path(self, base + "/" + "/".join(components) if base else "/".join(components))

    @property
    def parent(self) -> StorageLocation:
        """The containing location (itself at the root)."""
        parent = posixpath.dirname(self.path)
        return _replace_path(self, parent or self.path)

    # ---- small I/O helpers (all via `filesystem`; POSIX-specific where atomicity needs it) ----------------
    def exists(self) -> bool:
        """True when a file or directory (or S3 prefix with objects) is here."""
        return self.filesystem.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        """True when a directory (or a non-empty S3 prefix) is here."""
        return self.filesystem.get_file_info(self.path).type == pafs.FileType.Directory

    def is_file(self) -> bool:
        """True when a file (object) is here."""
        return self.filesystem.get_file_info(self.path).type == pafs.FileType.File

    def size(self) -> int:
        """Size in bytes of the file here; RaytrainError when missing."""
        info = self.filesystem.get_file_info(self.path)
        if info.type != pafs.FileType.File:
            raise RaytrainError(f"{self.uri}: no file here (found {info.type.name})")
        return int(info.size)

    def mtime_s(self) -> float | None:
        """Modification time (epoch seconds) as the storage reports it, or None when unknown/missing."""
        info = self.filesystem.get_file_info(self.path)
        return None if info.mtime is None else info.mtime.timestamp()

    def mkdirs(self) -> None:
        """Create the directory and parents (no-op on S3, where prefixes exist once objects do)."""
        if self.scheme != "s3":
            self.filesystem.create_dir(self.path, recursive=True)

    def listdir(self) -> list[str]:
        """Sorted names of the immediate children; [] when missing (S3 cannot tell missing from empty)."""
        try:
            infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except NotADirectoryError:
            return []
        return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)

    def list_files(self) -> dict[str, int]:
        """All files below this directory, recursively: {relative posix path: size in bytes}; {} when missing."""
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, recursive=True, allow_not_found=True))
        prefix = self.path.rstrip("/") + "/"
        return {i.path[len(prefix) :]: int(i.size) for i in infos if i.type == pafs.FileType.File}

    def open_input(self, text: bool = False) -> IO[Any]:
        """Open the file here for reading (bytes, or UTF-8 text when `text`). On S3 every read is retried also when
        the SDK would not (``raytrain.s3.read_range``)."""
        if self.scheme == "s3":
            raw = s3.RangeReader(self.filesystem.open_input_file(self.path), s3.s3_retry_settings())
            stream: Any = io.BufferedReader(raw, buffer_size=_S3_READ_BUFFER)
        else:
            stream = self.filesystem.open_input_stream(self.path)
        return io.TextIOWrapper(stream, encoding="utf-8") if text else stream

    def open_output(self, text: bool = False) -> IO[Any]:
        """Open the file here for writing, creating parents (bytes, or UTF-8 text when `text`). Not atomic."""
        if self.scheme != "s3":
            self.filesystem.create_dir(posixpath.dirname(self.path), recursive=True)
        stream = self.filesystem.open_output_stream(self.path)
        return io.TextIOWrapper(stream, encoding="utf-8") if text else stream

    def read_bytes(self) -> bytes:
        """Whole file content."""
        with self.open_input() as f:
            return f.read()

    def read_text(self) -> str:
        """Whole file content decoded as UTF-8."""
        return self.read_bytes().decode("utf-8")

    def write_atomic(self, data: bytes | str) -> None:
        """Write a small file so that readers see the old content or the new, never a torn one.

        POSIX: temp file in the same directory + fsync + os.replace + fsync of the directory. S3: one object
        upload (a PUT / CompleteMultipartUpload is atomic). HDFS: temp + delete + rename; a reader may briefly
        find no file (never a partial one), so readers of pointer files must tolerate a missing file.
        """
        payload = data.encode("utf-8") if isinstance(data, str) else data
        if self.scheme == "file":
            _posix_write_atomic(self.path, payload)
        elif self.scheme == "s3":
            with self.filesystem.open_output_stream(self.path) as f:
                f.write(payload)
        else:
            tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
            self.filesystem.create_dir(posixpath.dirname(self.path), recursive=True)
            with self.filesystem.open_output_stream(tmp) as f:
                f.write(payload)
            if self.exists():
                self.filesystem.delete_file(self.path)  # HDFS rename refuses an existing destination
            self.filesystem.move(tmp, self.path)

    def create_exclusive(self, data: bytes | str) -> bool:
        """Create the file here holding `data` only if nothing is there; True when this call created it.

        Atomic on every backend, so of several processes racing exactly one gets True: POSIX O_CREAT|O_EXCL
        (atomic across clients on Lustre, GPFS, WekaFS and NFSv3+), S3 a PUT with `If-None-Match: *`
        (raytrain.s3), HDFS the namenode's create without overwrite (`hdfs dfs -put -d`).
        """
        payload = data.encode("utf-8") if isinstance(data, str) else data
        if self.scheme == "file":
            return _posix_create_exclusive(self.path, payload)
        if self.scheme == "s3":

            return s3.create(self.uri, self.path, payload, self.s3_endpoint) is not None
        return _hdfs_create_exclusive(self, payload)

    def delete_file(self, missing_ok: bool = True) -> None:
        """Remove the file here."""
        try:
            self.filesystem.delete_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def delete_dir(self, missing_ok: bool = True) -> None:
        """Remove the directory/prefix here and everything below it."""
        if not self.exists():
            if missing_ok:
                return
            raise RaytrainError(f"{self.uri}: cannot delete, nothing is there")
        self.filesystem.delete_dir(self.path)

    def __str__(self) -> str:
        return self.uri


def resolve(uri: str, *, s3_endpoint: str | None = None) -> StorageLocation:
    """Turn a user's path or URI into a StorageLocation.

    Accepts a POSIX path (relative paths become absolute against the working directory), `file:///abs`,
    `s3://bucket/key` (also s3a://, s3n://) and `hdfs://[host:port]/abs`. The S3 endpoint is `s3_endpoint`,
    else $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL, else AWS. Raises RaytrainError for an empty path, an
    unknown scheme, a scheme with a relative path ("s3:bucket", "file:x"), "..", or a missing bucket.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise RaytrainError(f"storage path is empty ({uri!r}); pass a POSIX path, file://, s3:// or hdfs:// URI")
    uri = uri.strip()
    scheme_match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if scheme_match is None:
        return StorageLocation(scheme="file", path=os.path.abspath(os.path.expanduser(uri)))

    raw_scheme = scheme_match.group(1).lower()
    scheme = _SCHEME_ALIASES.get(raw_scheme, raw_scheme)
    if scheme not in SUPPORTED_SCHEMES:
        raise RaytrainError(
            f"storage URI {uri!r}: unknown scheme {raw_scheme!r}; use a POSIX path or one of "
            f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)}"
        )
    if not uri[len(raw_scheme) + 1 :].startswith("//"):
        raise RaytrainError(
            f"storage URI {uri!r} has a scheme but a relative path; write it as {_URI_EXAMPLES[scheme]}"
        )
    parts = urlsplit(uri)
    if parts.query or parts.fragment:
        raise RaytrainError(f"storage URI {uri!r}: query strings and fragments are not supported; remove them")
    _reject_dotdot(uri, parts.path)

    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise RaytrainError(
                f"storage URI {uri!r}: file URIs take no host ({parts.netloc!r}); write file:///absolute/path"
            )
        if not parts.path:
            raise RaytrainError(f"storage URI {uri!r} names no path; write file:///absolute/path")
        return StorageLocation(scheme="file", path=posixpath.normpath(parts.path))

    if scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise RaytrainError(f"storage URI {uri!r} names no bucket; write s3://bucket/key")
        key = parts.path.strip("/")
        if "//" in key:
            raise RaytrainError(f"storage URI {uri!r} has an empty path component ('//'); remove it")
        endpoint = s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return StorageLocation(scheme="s3", path=f"{bucket}/{key}" if key else bucket, s3_endpoint=endpoint or None)

    path = posixpath.normpath(parts.path) if parts.path.strip("/") else ""
    if not path:
        raise RaytrainError(f"storage URI {uri!r} names no path; write hdfs://namenode:8020/absolute/path")
    return StorageLocation(scheme="hdfs", path=path, authority=parts.netloc)


def validate_name(value: str, field: str) -> str:
    """Return `value` when it is a safe single path component ([A-Za-z0-9._-]+, not "." or ".."), else raise."""
    if not isinstance(value, str) or not _NAME_RE.match(value) or value in (".", ".."):
        raise RaytrainError(
            f"{field}={value!r} is not a valid name: use letters, digits, '.', '_' or '-' (e.g. {field}=my-run-01)"
        )
    return value


@dataclass(frozen=True)
class RunPaths:
    """The folders of one run below its root (``run_root``): the one place their names are written."""

    root: StorageLocation

    @property
    def checkpoints(self) -> StorageLocation:
        return self.root.join("checkpoints")

    @property
    def reports(self) -> StorageLocation:
        """Reports, metrics, TensorBoard events and (``logs``) the command logs."""
        return self.root.join("reports")

    @property
    def logs(self) -> StorageLocation:
        return self.reports.join("logs")

    @property
    def data(self) -> StorageLocation:
        return self.root.join("data")

    @property
    def sample(self) -> StorageLocation:
        """The sample dataset, when input.path is 'sample'."""
        return self.data.join("sample")

    @property
    def enriched(self) -> StorageLocation:
        return self.data.join("enriched")

    @property
    def quarantine(self) -> StorageLocation:
        return self.data.join("quarantine")

    @property
    def corpus(self) -> StorageLocation:
        """The context corpus's sentence tables, one folder per corpus key."""
        return self.data.join("corpus")

    @property
    def waves(self) -> StorageLocation:
        """A streamed enrichment's wave records and dedup state (raytrain.enrich.waves)."""
        return self.data.join("waves")

    @property
    def packed(self) -> StorageLocation:
        return self.data.join("packed")

    @property
    def exports(self) -> StorageLocation:
        return self.root.join("exports")


def parquet_names(folder: StorageLocation) -> list[str]:
    """The Parquet files of a folder Spark wrote, as paths relative to it in read order: its own files, or those
    of its ``wave-NNNNN`` subfolders wave by wave (a streamed enrichment), each in name order."""
    def ours(name: str) -> bool:
        parts = name.split("/")
        return name.endswith(".parquet") and not parts[-1].startswith(("_", ".")) and (
            len(parts) == 1 or (len(parts) == 2 and parts[0].startswith("wave-")))

    return sorted(n for n in folder.list_files() if ours(n))


def run_root(root: StorageLocation, user: str, project: str, run: str) -> StorageLocation:
    """`<root>/<user>/<project>/<run>`; each name validated, the error names the field (user/project/run)."""
    return root.join(validate_name(user, "user"), validate_name(project, "project"), validate_name(run, "run"))


def default_user(configured: str | None = None) -> str:
    """The user name for run paths: `configured` (from the job config), else $RAYTRAIN_USER, $USER, $LOGNAME,
    else getpass.getuser(). Raises RaytrainError when none is found or the name is not path-safe."""
    for field, value in (
        ("user", configured),
        ("RAYTRAIN_USER", os.environ.get("RAYTRAIN_USER")),
        ("USER", os.environ.get("USER")),
        ("LOGNAME", os.environ.get("LOGNAME")),
    ):
        if value:
            return validate_name(value, field)
    try:
        return validate_name(getpass.getuser(), "user")
    except (KeyError, OSError) as exc:  # no passwd entry (containers with arbitrary uids)
        raise RaytrainError("cannot tell the user name; set user=<name> in the config or RAYTRAIN_USER") from exc


SERVICE_USERS = frozenset({"ray"})
"""OS accounts that run jobs on a cluster (the user of Ray's container images), never a person: a run is never
named after, or owned by, one of these."""

_HOW_TO_NAME = (
    "say who you are when you submit: ray job submit --runtime-env-json '{\"env_vars\": {\"RAYTRAIN_USER\": "
    "\"'$USER'\"}}' ... (or --metadata-json '{\"user\": \"'$USER'\"}', or storage.user=<name>)"
)


def submitting_user(configured: str | None = None) -> str:
    """The person this job acts for, who owns the runs it creates: $RAYTRAIN_USER (set by the submitter in the
    job's runtime_env), else the `user` of `ray job submit --metadata-json`, else `configured` (storage.user),
    else, outside a submitted Ray job, USER/LOGNAME/getpass. Raises RaytrainError inside a submitted job that
    names nobody (its process runs as the cluster's service account, shared by everyone) and for a service
    account such as `ray`, saying how to give a name."""
    named = os.environ.get("RAYTRAIN_USER")
    if named:
        return validate_name(named, "RAYTRAIN_USER")
    metadata = _ray_job_metadata()
    if metadata.get("user"):
        return validate_name(str(metadata["user"]), "ray job metadata 'user'")
    if configured:
        return validate_name(configured, "storage.user")
    if metadata.get("job_submission_id"):
        raise RaytrainError(f"job {metadata['job_submission_id']} names no user, and its process runs as the "
                            f"cluster's account, shared by everyone who submits; {_HOW_TO_NAME}")
    user = default_user()
    if user in SERVICE_USERS:
        raise RaytrainError(f"this process runs as {user!r}, a service account shared by everyone on the cluster, "
                            f"not a person; {_HOW_TO_NAME}")
    return user


def _ray_job_metadata() -> dict[str, Any]:
    """The metadata `ray job submit` gave this job (Ray passes it to the entrypoint in RAY_JOB_CONFIG_JSON_ENV_VAR,
    with its job_submission_id); {} outside a submitted job."""
    import json

    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    except ValueError:
        return {}
    metadata = config.get("metadata") if isinstance(config, dict) else None
    return metadata if isinstance(metadata, dict) else {}


RUN_UMASK = 0o027
"""Process umask for everything a job writes: directories 0750, files 0640 (owner writes, the group reads, other
users see nothing)."""


def apply_run_umask() -> int:
    """Set RUN_UMASK on this process (driver, trainer worker) so its files, DeepSpeed's and torch.save's included,
    keep other users out; returns the previous umask."""
    return os.umask(RUN_UMASK)


def secure_run_dir(loc: StorageLocation, group: str = "") -> None:
    """POSIX run folders: mode 0750; with `group` (storage.group) also that group and the setgid bit, so every
    file and folder created below inherits the team's group. A no-op on S3/HDFS (bucket policies / HDFS ACLs
    decide there). Raises RaytrainError when this user may not give the folder that group."""
    if not loc.is_posix or os.stat(loc.path).st_uid != os.geteuid():
        return  # another user's folder (a shared parent): theirs to set
    mode = 0o750
    if group:
        import grp

        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError as exc:
            raise RaytrainError(f"storage.group={group!r}: no such group on this host; use a group you belong "
                                "to (`id -Gn`) or leave storage.group empty") from exc
        try:
            os.chown(loc.path, -1, gid)
        except PermissionError as exc:
            raise RaytrainError(f"storage.group={group!r}: cannot give {loc.path} that group ({exc}); you must "
                                "be a member of it (`id -Gn`)") from exc
        mode |= 0o2000
    os.chmod(loc.path, mode)


# ---- internals ---------------------------------------------------------------------------------------------
def _replace_path(loc: StorageLocation, path: str) -> StorageLocation:
    return StorageLocation(scheme=loc.scheme, path=path, authority=loc.authority, s3_endpoint=loc.s3_endpoint)


_S3_READ_BUFFER = 1 << 20
"""Bytes read ahead per S3 GET for small reads through ``open_input`` (larger reads go as one GET each)."""


def _reject_dotdot(uri: str, path: str) -> None:
    if any(comp == ".." for comp in path.split("/")):
        raise RaytrainError(f"storage URI {uri!r} contains '..'; give the resolved path instead")


def _filesystem(scheme: str, authority: str, s3_endpoint: str | None) -> pafs.FileSystem:
    """One pyarrow filesystem per store (cached: S3/HDFS clients are costly to build and hold connection pools).
    S3 clients retry with backoff and time out as ``raytrain.s3.s3_retry_settings`` says (read per call, so a changed
    RAYTRAIN_S3_* variable takes effect on the next use)."""
    if scheme == "file":
        return _local_filesystem()
    if scheme == "s3":
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return s3.s3_filesystem(s3_endpoint, region if s3_endpoint else None, s3.s3_retry_settings())
    return _hdfs_filesystem(authority)


@functools.lru_cache(maxsize=1)
def _local_filesystem() -> pafs.FileSystem:
    return pafs.LocalFileSystem()


@functools.lru_cache(maxsize=8)
def _hdfs_filesystem(authority: str) -> pafs.FileSystem:
    host, _, port = authority.partition(":")
    # HadoopFileSystem needs libhdfs + a Hadoop classpath; it is only built when an hdfs:// location is used.
    try:
        return pafs.HadoopFileSystem(host or "default", int(port) if port else 0)
    except (OSError, ValueError) as exc:
        raise RaytrainError(
            f"cannot connect to HDFS at {authority or 'fs.defaultFS'}: {exc}; set HADOOP_HOME, CLASSPATH "
            "(`hadoop classpath --glob`) and ARROW_LIBHDFS_DIR on every node"
        ) from exc


def _posix_create_exclusive(path: str, payload: bytes) -> bool:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
    except FileExistsError:
        return False
    try:
        os.write(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))
    return True


HDFS_CLI = "hdfs"
"""The Hadoop CLI used for HDFS's exclusive create (pyarrow's HadoopFileSystem only opens files to overwrite them,
and its move() replaces an existing file): $HADOOP_HOME/bin/hdfs when set, else `hdfs` on PATH."""


def _hdfs_create_exclusive(loc: StorageLocation, payload: bytes) -> bool:
    """`hdfs dfs -put -d - <uri>`: -d writes straight to the destination (no ._COPYING_ file renamed into
    place) through FileSystem.create(overwrite=false), which the namenode refuses when the file exists."""
    import shutil
    import subprocess

    home = os.environ.get("HADOOP_HOME")
    cli = os.path.join(home, "bin", HDFS_CLI) if home and os.path.exists(os.path.join(home, "bin", HDFS_CLI)) \
        else shutil.which(HDFS_CLI)
    if cli is None:
        raise RaytrainError(f"{loc.uri}: the HDFS run lock needs the `hdfs` command (set HADOOP_HOME or PATH)")
    loc.parent.mkdirs()
    done = subprocess.run([cli, "dfs", "-put", "-d", "-", loc.uri], input=payload, capture_output=True,
                          check=False)
    if done.returncode == 0:
        return True
    err = done.stderr.decode("utf-8", "replace")
    if "File exists" in err or "FileAlreadyExistsException" in err:
        return False
    raise RaytrainError(f"{loc.uri}: `hdfs dfs -put -d` failed ({done.returncode}): {err.strip()[:500]}")


def _posix_write_atomic(path: str, payload: bytes) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """fsync a POSIX directory so a rename/create in it survives a crash (best effort where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some parallel filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)
