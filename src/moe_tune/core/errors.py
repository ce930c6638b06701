"""Exceptions that the CLI turns into one-line messages (exit 2 for usage, 1 for runtime), and the warnings
moe-tune gives a library user."""

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # moe-tune's own frames (core/ is one down)


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



def path_error(what: str, path: str | os.PathLike, error: OSError, kind: type[MoeTuneError] = MoeTuneError
               ) -> MoeTuneError:
    """One line for an OSError met while writing or reading `path` (the path the user gave), `what` then the
    path: `cannot write the plot r.png: Permission denied`, plus the file the system named when it lies
    elsewhere (an unwritable dir above), or what stands where a directory must be (a file, a symlink loop);
    never a temporary file written inside or beside `path`."""
    why = error.strerror or str(error) or type(error).__name__
    blocker = _file_in_the_way(path) if isinstance(error, (NotADirectoryError, FileExistsError)) else None
    if blocker is not None:  # says more than `File exists` / `Not a directory`
        why = blocker
    elif error.filename is not None and _elsewhere(str(error.filename), path):
        why += f" ({error.filename})"
    return kind(f"{what} {path}: {why}")


def _elsewhere(named: str, path: str | os.PathLike) -> bool:
    """Whether `named` is neither `path`, nor inside it, nor beside it."""
    named, given = os.path.abspath(named), os.path.abspath(path)
    return not (named == given or named.startswith(given + os.sep)
                or os.path.dirname(named) == os.path.dirname(given))


def _file_in_the_way(path: str | os.PathLike) -> str | None:
    """What stands where `path` needs a directory: its nearest existing ancestor (or itself) when that is a
    file or a symlink to nowhere (a loop, a dangling link), described; None when that is a directory."""
    current = os.path.abspath(path)
    while current != os.path.dirname(current):
        if os.path.islink(current) and not os.path.exists(current):
            return f"{current} is a symlink loop or a dangling symlink"
        if os.path.lexists(current):
            return None if os.path.isdir(current) else f"{current} is a file, not a directory"
        current = os.path.dirname(current)
    return None
