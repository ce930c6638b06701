"""JAX's persistent compilation cache for sweeps, so that re-running or resuming a sweep (and the finalists
recompiled on resume) costs no XLA compile for a candidate compiled before.

Only the tuner turns it on (the CLI's `sweep`, and every compile worker): a model that imports moe-tune
keeps whatever cache settings it has.

JAX never deletes from this cache: every candidate of every sweep stays (2,930 entries, 76 MB, after a day of
CPU sweeps here; a GPU's executables are larger). So a sweep that turns it on first trims it back below
`$MOE_TUNE_COMPILE_CACHE_MAX_BYTES` (4 GiB by default), oldest entries first. JAX's own bound
(`jax_compilation_cache_max_size`) would do it at every write, reading every entry's access-time file under
a lock: per compile, a cost that grows with the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from moe_tune.core import settings
from moe_tune.core.paths import writable_dir


def cache_dir() -> Path | None:
    """`$MOE_TUNE_COMPILE_CACHE_DIR` ("off" disables), else `<user cache dir>/moe-tune/jax_cache`."""
    return settings.compile_cache_dir()


def check() -> Path | None:
    """`cache_dir()`, created, once a file can be written in it (None when disabled); a MoeTuneError naming
    it and the variable otherwise (JAX would only warn at each cache write), a UsageError for a bad
    `$MOE_TUNE_COMPILE_CACHE_MAX_BYTES`. A sweep's preflight calls it."""
    directory = cache_dir()
    if directory is None:
        return None
    settings.compile_cache_max_bytes()  # a bad value: one line naming the variable, before the sweep
    return writable_dir(directory, "cannot create or write the compile cache dir",
                        f"; set ${settings.COMPILE_CACHE_DIR} to a writable dir, or to `off`")


def enable(*, trim_to_size: bool = True) -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()` and cache every executable, however quick
    its compile (JAX's default skips compiles under a second: most candidates of a CPU sweep). Returns the
    dir, or None when disabled. Call before the first compile. Raises what `check` raises. `trim_to_size`:
    first `trim` it to `$MOE_TUNE_COMPILE_CACHE_MAX_BYTES` (the sweep's process does; its workers do not)."""
    directory = check()
    if directory is None:
        return None
    if trim_to_size:
        trim(directory, settings.compile_cache_max_bytes())
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    settings.share_compile_cache_dir(directory)  # compile workers inherit the same dir
    return directory


# The files JAX's cache writes (jax/_src/lru_cache.py): only these are ever removed, whatever else the dir holds.
ENTRY_SUFFIXES = ("-cache", "-atime")


def trim(directory: Path, max_bytes: int) -> int:
    """When the cache entries in `directory` take more than `max_bytes`, remove the oldest written until they
    take at most 3/4 of it (so that the next sweeps need not trim again); returns the bytes removed. An entry
    another process removes or replaces meanwhile is passed over."""
    entries = []
    with os.scandir(directory) as found:
        for entry in found:
            if entry.name.endswith(ENTRY_SUFFIXES):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    removed = 0
    for _, size, path in sorted(entries):
        if total - removed <= max_bytes * 3 // 4:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed += size
    return removed
