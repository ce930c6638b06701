"""Where tables live. Read order, highest first: `use_profiles(...)` overlays (innermost first),
`$MOE_TUNE_PROFILE_DIR`, the user cache dir, the tables shipped in the package. Sweeps write to
`--profile-dir`, else `$MOE_TUNE_PROFILE_DIR`, else the user cache dir."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import platformdirs

from moe_tune.core import paths, settings
from moe_tune.core.errors import UsageError

ENV_PROFILE_DIR = settings.PROFILE_DIR
_overlays: list[Path] = []


def user_dir() -> Path:
    return platformdirs.user_cache_path("moe-tune") / "profiles"


def shipped_dir() -> Path:
    return Path(__file__).parent / "data"


def search_dirs() -> list[tuple[str, Path]]:
    """(origin, dir) pairs in lookup order: overlay, env, user, shipped."""
    found = [("use_profiles", p) for p in reversed(_overlays)]
    env = settings.profile_dir()
    if env is not None:
        found.append(("env", env))
    found += [("user", user_dir()), ("shipped", shipped_dir())]
    return found


def write_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit is not None:
        return Path(explicit).expanduser()
    return settings.profile_dir() or user_dir()


def table_path(directory: Path, device_kind: str, op: str) -> Path:
    return Path(directory) / device_kind / f"{op}.json"


@contextlib.contextmanager
def use_profiles(path: str | os.PathLike) -> Iterator[Path]:
    """Within the block, tables under `path` take precedence over every other profile dir.

    Lookups happen when a function is traced: a function jitted before entering the block keeps the
    configs it was traced with.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"use_profiles takes a directory path (str or os.PathLike), got {type(path).__name__}")
    directory = Path(path).expanduser()
    _overlays.append(directory)
    try:
        yield directory
    finally:
        _overlays.remove(directory)


def writable_dir(directory: str | os.PathLike) -> Path:
    """`directory`, created if needed, once a file can be written in it; MoeTuneError (one line naming it and
    what stands in the way: a file, a symlink loop, a permission) otherwise.

    Checked before a sweep or a campaign starts, so that a profile dir that cannot hold the table fails at
    once rather than after the sweep (or as a traceback from deep inside the log or the table write)."""
    return paths.writable_dir(directory, "cannot create or write the profile dir")
