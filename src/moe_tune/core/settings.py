"""Every `MOE_TUNE_*` environment variable, read in this one place.

Each accessor reads the environment when it is called (never at import), so a variable set or changed after
`import moe_tune` (a test's monkeypatch, a launcher) takes effect at the next lookup, trace or sweep.

`writable_dir` and its kin check that a path the user gave can be written, made before the work that would write it, so that a bad
path is one line naming it (`errors.path_error`) rather than a traceback after minutes of work.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

import platformdirs

from moe_tune.core.errors import MoeTuneError, UsageError, path_error

PROFILE_DIR = "MOE_TUNE_PROFILE_DIR"
DISTRIBUTION = "MOE_TUNE_DISTRIBUTION"
STALE_POLICY = "MOE_TUNE_STALE_POLICY"
RAGGED_GATHER_FALLBACK = "MOE_TUNE_RAGGED_GATHER_FALLBACK"
RAGGED_GATHER_REDUCE_FALLBACK = "MOE_TUNE_RAGGED_GATHER_REDUCE_FALLBACK"
COMPILE_CACHE_DIR = "MOE_TUNE_COMPILE_CACHE_DIR"
COMPILE_CACHE_MAX_BYTES = "MOE_TUNE_COMPILE_CACHE_MAX_BYTES"
WORKER_MEMORY_LIMIT = "MOE_TUNE_WORKER_MEMORY_LIMIT"
RAY_CONNECT_TIMEOUT = "MOE_TUNE_RAY_CONNECT_TIMEOUT"

DEFAULT_RAY_CONNECT_TIMEOUT_S = 20.0
DEFAULT_COMPILE_CACHE_MAX_BYTES = 4 * 2**30

_TRUE = ("1", "true", "yes", "on")


def _get(name: str) -> str:
    return os.environ.get(name, "").strip()


def profile_dir() -> Path | None:
    """`MOE_TUNE_PROFILE_DIR`: a profile dir read before the user cache dir and the shipped tables, and the
    dir sweeps write to when no `--profile-dir` is given. None when unset."""
    value = _get(PROFILE_DIR)
    return Path(value).expanduser() if value else None


def distribution() -> str | None:
    """`MOE_TUNE_DISTRIBUTION`: the group-size distribution the runtime assumes when it looks entries up
    (`balanced`, `skewed`, `uniform`, `single`); None when unset (the caller's default, `balanced`)."""
    return _get(DISTRIBUTION) or None


def stale_policy() -> str | None:
    """`MOE_TUNE_STALE_POLICY`: what lookup does with an entry tuned with another kernel revision or JAX
    minor version: `use` (with one warning), `skip` or `error`; None when unset. Checked by the caller."""
    return _get(STALE_POLICY).lower() or None


def _flag(name: str) -> bool:
    return _get(name).lower() in _TRUE


def ragged_gather_fallback() -> bool:
    """`MOE_TUNE_RAGGED_GATHER_FALLBACK=1`: run every gather kernel (dispatch, the backward of combine) on
    the plain-JAX path, as the ops' `ragged_gather_fallback=True` does for one call."""
    return _flag(RAGGED_GATHER_FALLBACK)


def ragged_gather_reduce_fallback() -> bool:
    """`MOE_TUNE_RAGGED_GATHER_REDUCE_FALLBACK=1`: run every gather-reduce kernel (combine, the backward of
    dispatch) on the plain-JAX path, as `ragged_gather_reduce_fallback=True` does for one call."""
    return _flag(RAGGED_GATHER_REDUCE_FALLBACK)


def compile_cache_dir() -> Path | None:
    """`MOE_TUNE_COMPILE_CACHE_DIR`: where sweeps keep JAX's persistent compilation cache (default
    `<user cache dir>/moe-tune/jax_cache`); `off` disables it (None)."""
    value = _get(COMPILE_CACHE_DIR)
    if value.lower() == "off":
        return None
    return Path(value).expanduser() if value else platformdirs.user_cache_path("moe-tune") / "jax_cache"


def compile_cache_dir_set() -> bool:
    """Whether `MOE_TUNE_COMPILE_CACHE_DIR` is set (a sweep sets it for its compile workers)."""
    return bool(_get(COMPILE_CACHE_DIR))


def share_compile_cache_dir(directory: Path) -> None:
    """Set `MOE_TUNE_COMPILE_CACHE_DIR` to `directory` unless it is set, so that worker processes started
    from now on use the same cache."""
    os.environ.setdefault(COMPILE_CACHE_DIR, str(directory))


def _positive(name: str, value: str, kind: type[int] | type[float], what: str) -> int | float:
    """`value` of the variable `name` as a positive `kind`; UsageError naming the variable otherwise."""
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or not number > 0 or number == float("inf"):
        raise UsageError(f"${name}={value!r} is not {what}; set it to one, or unset it")
    return number


def compile_cache_max_bytes() -> int:
    """`MOE_TUNE_COMPILE_CACHE_MAX_BYTES`: the size the compile cache is trimmed back from when a sweep starts
    (default 4 GiB; `tuner.compiling.trim_cache`). UsageError naming the variable when not a positive integer."""
    value = _get(COMPILE_CACHE_MAX_BYTES)
    if not value:
        return DEFAULT_COMPILE_CACHE_MAX_BYTES
    return int(_positive(COMPILE_CACHE_MAX_BYTES, value, int, "a positive number of bytes"))


def worker_memory_limit() -> int | None:
    """`MOE_TUNE_WORKER_MEMORY_LIMIT`: bytes of address space each compile worker may use (RLIMIT_AS), so
    that a candidate that runs out of memory fails alone; None when unset (no limit). UsageError (naming the
    variable) when it is not a positive integer: a sweep checks it before it starts any worker."""
    value = _get(WORKER_MEMORY_LIMIT)
    return int(_positive(WORKER_MEMORY_LIMIT, value, int, "a positive number of bytes")) if value else None


def ray_connect_timeout() -> float:
    """`MOE_TUNE_RAY_CONNECT_TIMEOUT`: seconds a campaign waits to reach the Ray cluster at `--ray ADDRESS`
    before it gives up with one line naming the address (default 20). UsageError when not a positive number."""
    value = _get(RAY_CONNECT_TIMEOUT)
    if not value:
        return DEFAULT_RAY_CONNECT_TIMEOUT_S
    return float(_positive(RAY_CONNECT_TIMEOUT, value, float, "a positive number of seconds"))


def no_gpu_preallocation(env: MutableMapping[str, str] | None = None) -> None:
    """Keep JAX from taking 75% of a GPU's memory when its backend starts (`XLA_PYTHON_CLIENT_PREALLOCATE`),
    in this process (`env` None) or in a child started with `env`, unless the user set it. moe-tune's CLI
    process only plans and names tables, and its workers share the GPU with it, with each other and with
    whatever else runs there."""
    (os.environ if env is None else env).setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
