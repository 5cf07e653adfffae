"""User-facing errors: each names what is wrong (field, row, path) and how to fix it."""


class RaytrainError(Exception):
    """An error the user can fix; the CLI prints its message without a traceback and exits 1."""


class ConfigError(RaytrainError):
    """A job config or ds_config that is malformed or inconsistent (CLI exit code 2)."""


class CorruptCheckpointError(RaytrainError):
    """A checkpoint whose files differ from its manifest (missing, truncated, a changed byte), naming the file.

    Not retried: reading the same bytes again fails the same way, so the launcher ends the run at the first one."""
