"""Exceptions that the CLI turns into one-line messages (exit 2 for usage, 1 for runtime)."""


class MoeTuneError(Exception):
    """A problem the user can fix; the CLI prints it without a traceback and exits 1."""


class UsageError(MoeTuneError, ValueError):
    """Bad input: unknown op/backend/dtype/distribution, inconsistent shapes. The CLI exits 2."""


class InvalidConfigError(UsageError):
    """A config that its backend cannot run for the given problem."""


class TableError(MoeTuneError):
    """A profile table that cannot be read, parsed or written."""
