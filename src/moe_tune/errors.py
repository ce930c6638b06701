"""Exceptions that the CLI turns into one-line messages (exit 2 for usage, 1 for runtime), and the warnings
moe-tune gives a library user."""

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # moe-tune's own frames


class MoeTuneError(Exception):
    """A problem the user can fix; the CLI prints it without a traceback and exits 1."""


class UsageError(MoeTuneError, ValueError):
    """Bad input: unknown op/backend/dtype/distribution, inconsistent shapes. The CLI exits 2."""


class InvalidConfigError(UsageError):
    """A config that its backend cannot run for the given problem."""


class TableError(MoeTuneError):
    """A profile table that cannot be read, parsed or written."""


def warn_caller(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """`warnings.warn` attributed to the first frame outside moe-tune (the user's call into it), however
    deep inside moe-tune the warning is raised: a fixed `stacklevel` points into moe-tune from some call
    paths."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of warn_caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)

