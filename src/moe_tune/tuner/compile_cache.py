"""JAX's persistent compilation cache for sweeps, so that re-running or resuming a sweep (and the finalists
recompiled on resume) costs no XLA compile for a candidate compiled before.

Only the tuner turns it on (the CLI's `sweep`, and every compile worker): a model that imports moe-tune
keeps whatever cache settings it has.
"""

from __future__ import annotations

from pathlib import Path

import jax

from moe_tune import settings
from moe_tune.paths import writable_dir


def cache_dir() -> Path | None:
    """`$MOE_TUNE_COMPILE_CACHE_DIR` ("off" disables), else `<user cache dir>/moe-tune/jax_cache`."""
    return settings.compile_cache_dir()


def check() -> Path | None:
    """`cache_dir()`, created, once a file can be written in it (None when disabled); a MoeTuneError naming
    it and the variable otherwise (JAX would only warn at each cache write). A sweep's preflight calls it."""
    directory = cache_dir()
    if directory is None:
        return None
    return writable_dir(directory, "cannot create or write the compile cache dir",
                        f"; set ${settings.COMPILE_CACHE_DIR} to a writable dir, or to `off`")


def enable() -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()` and cache every executable, however quick
    its compile (JAX's default skips compiles under a second: most candidates of a CPU sweep). Returns the
    dir, or None when disabled. Call before the first compile. Raises what `check` raises."""
    directory = check()
    if directory is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    settings.share_compile_cache_dir(directory)  # compile workers inherit the same dir
    return directory
