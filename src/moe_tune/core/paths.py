"""Checks that a path the user gave can be written, made before the work that would write it, so that a bad
path is one line naming it (`errors.path_error`) rather than a traceback after minutes of work."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from moe_tune.core.errors import MoeTuneError, path_error


def writable_dir(directory: str | os.PathLike, what: str, hint: str = "") -> Path:
    """`directory`, created if needed, once a file can be written in it; else MoeTuneError:
    `{what} {directory}: {why}{hint}` (e.g. `cannot write traces to ./t: Permission denied`)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        error = path_error(what, directory, e)
        raise MoeTuneError(f"{error}{hint}") from None
    return directory
