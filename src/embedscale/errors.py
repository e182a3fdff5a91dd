"""Errors a user can act on. Each message names the file, line, table, feature or value at fault."""


class EmbedscaleError(Exception):
    """Base class: anything embedscale raises on purpose."""


class InputError(EmbedscaleError, ValueError):
    """Bad input data: a malformed line, an index outside its table, a NaN, a label not 0/1."""


class ConfigError(EmbedscaleError, ValueError):
    """A config or spec that cannot be run: unknown key, unknown table, wrong type."""


class FormatError(EmbedscaleError, ValueError):
    """A file we wrote (shards, profile, plan, checkpoint) that is missing, corrupt or of another version."""


class CheckpointWriteError(EmbedscaleError):
    """A checkpoint could not be written (a full disk, a read-only directory); nothing of it was kept. ``errno``:
    the cause's."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno
