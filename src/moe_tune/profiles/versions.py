"""What an entry was tuned with, and when an entry is stale.

Every entry records `versions`: the jax, jaxlib, moe-tune and tune-jax distributions installed when it was
tuned and `backend_revision`, the `Backend.revision` of the kernel it was tuned for (`entry_versions`).

An entry is *stale* when it was tuned with

- another revision of its kernel backend (a bumped revision means the kernel changed in a way that can change
  which config is fastest or whether a config is valid), or
- another JAX major.minor than the installed one (XLA and Pallas lowering change between minor releases).

An entry without `backend_revision` (schema 1, before revisions were recorded) counts as revision 1: every
backend started at revision 1 when revisions were introduced, so such an entry is stale exactly when its
backend has been bumped since. An entry whose JAX version is missing or unparseable is not stale on that
count (nothing to compare).

What lookup does with a stale entry is the *stale policy*: `use` (the default: use it, warn once per table and
difference), `skip` (ignore it, warn once: lookup goes on to the next profile dir's exact entry, then the
nearest fresh entry, then the heuristic default) or `error` (raise `StaleEntryError` naming the file, the key
and what differs). Set by, highest first: `lookup(..., stale_policy=...)`, `use_stale_policy(...)` blocks,
`$MOE_TUNE_STALE_POLICY`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from moe_tune.core import contexts, settings
from moe_tune.core.contexts import DEFAULT_STALE_POLICY, STALE_POLICIES, check_policy, use_stale_policy  # noqa: F401
from moe_tune.core.errors import TableError
from moe_tune.profiles.entry import Entry

ENV_STALE_POLICY = settings.STALE_POLICY
DISTRIBUTIONS = ("jax", "jaxlib", "moe-tune", "tune-jax")
UNRECORDED_REVISION = 1  # what an entry without `backend_revision` is taken to have been tuned with


class StaleEntryError(TableError):
    """A stale entry met under the `error` stale policy; the message names the file, the key and what differs."""


def installed_versions() -> dict[str, str]:
    """Installed version of each distribution an entry records ("unknown" when not installed)."""
    found = {}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "unknown"
    return found


def installed_jax() -> str:
    import jax

    return jax.__version__


def entry_versions(backend: Any) -> dict[str, Any]:
    """The `versions` record of an entry tuned now with `backend` (a Backend instance or class):
    `{"jax", "jaxlib", "moe-tune", "tune-jax", "backend_revision"}`."""
    return {**installed_versions(), "backend_revision": int(getattr(backend, "revision", UNRECORDED_REVISION))}


def stale_policy(explicit: str | None = None) -> str:
    """The policy in force: `explicit`, else the innermost `use_stale_policy` block, else the environment."""
    if explicit is not None:
        return check_policy(explicit)
    block = contexts.block_stale_policy()
    if block is not None:
        return block
    env = settings.stale_policy()
    if env is None:
        return DEFAULT_STALE_POLICY
    return check_policy(env, f"${ENV_STALE_POLICY}")


def _minor(version: Any) -> tuple[int, int] | None:
    match = re.match(r"^\s*(\d+)\.(\d+)", str(version)) if version is not None else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def _versions_of(entry: Entry | Mapping[str, Any]) -> Mapping[str, Any]:
    """An entry's `versions` record (an `Entry` or its JSON); {} when it has none."""
    versions = entry.versions if isinstance(entry, Entry) else entry.get("versions")
    return versions if isinstance(versions, Mapping) else {}


def recorded_revision(entry: Entry | Mapping[str, Any]) -> int:
    """The backend revision an entry was tuned with (`UNRECORDED_REVISION` when it does not say)."""
    revision = _versions_of(entry).get("backend_revision")
    return revision if isinstance(revision, int) and not isinstance(revision, bool) else UNRECORDED_REVISION


def staleness(entry: Entry | Mapping[str, Any], backend: Any, jax_version: str | None = None) -> list[str]:
    """What differs between what `entry` was tuned with and what is installed; empty when it is fresh.

    Each item is one difference, free of anything entry-specific so that it can key a once-only warning:
    `"tiled revision 1 (installed: 2)"`, `"jax 0.9 (installed: 0.10)"`.
    """
    found = []
    versions = _versions_of(entry)
    current = int(getattr(backend, "revision", UNRECORDED_REVISION))
    tuned = recorded_revision(entry)
    if tuned != current:
        unrecorded = "" if "backend_revision" in versions else ", assumed: the entry predates recorded revisions"
        found.append(f"{backend.name} revision {tuned}{unrecorded} (installed: {current})")
    tuned_jax, installed = _minor(versions.get("jax")), _minor(jax_version or installed_jax())
    if tuned_jax is not None and installed is not None and tuned_jax != installed:
        found.append(f"jax {tuned_jax[0]}.{tuned_jax[1]} (installed: {installed[0]}.{installed[1]})")
    return found
