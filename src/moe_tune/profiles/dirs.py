"""Where tables live. Read order, highest first: `use_profiles(...)` overlays (innermost first),
`$MOE_TUNE_PROFILE_DIR`, the user cache dir, the tables shipped in the package. Sweeps write to
`--profile-dir`, else `$MOE_TUNE_PROFILE_DIR`, else the user cache dir."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from moe_tune.core import contexts, paths, settings
from moe_tune.core.contexts import use_profiles  # noqa: F401  (the public name's home for `profiles`)

ENV_PROFILE_DIR = settings.PROFILE_DIR


def user_dir() -> Path:
    return platformdirs.user_cache_path("moe-tune") / "profiles"


def shipped_dir() -> Path:
    return Path(__file__).parent / "data"


def search_dirs() -> list[tuple[str, Path]]:
    """(origin, dir) pairs in lookup order: overlay, env, user, shipped."""
    found = [("use_profiles", p) for p in contexts.profile_overlays()]
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


def writable_dir(directory: str | os.PathLike) -> Path:
    """`directory`, created if needed, once a file can be written in it; MoeTuneError (one line naming it and
    what stands in the way: a file, a symlink loop, a permission) otherwise.

    Checked before a sweep or a campaign starts, so that a profile dir that cannot hold the table fails at
    once rather than after the sweep (or as a traceback from deep inside the log or the table write)."""
    return paths.writable_dir(directory, "cannot create or write the profile dir")
