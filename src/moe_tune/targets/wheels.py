"""Where the compile-only compilers come from: libtpu (TPU) and the CUDA 12 PJRT plugin (GPU).

They are the pinned wheels of the extras `moe-tune[tpu-compile]` and `moe-tune[gpu-compile]` (the versions
`jax[tpu]` / `jax[cuda12]` pin for the installed jax). Installed into the environment's site-packages, JAX
finds them on every `import jax`: on a machine without the chips the CUDA plugin then logs "Could not find
cuda drivers" several times per import, and libtpu probes for a TPU and takes a host-wide lock file. So
`make test` installs them apart, under `<venv>/compile-only` (`python -m moe_tune.targets.wheels` prints
the pip arguments), and only the compile worker processes (`targets/jobs.py`) put that folder on their path.
Wheels installed into site-packages by the extras work too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from moe_tune.core.errors import MoeTuneError


def compile_wheels() -> dict[str, tuple[str, ...]]:
    """platform -> the wheels its compiler needs, pinned for the installed jax: the libtpu that `jax[tpu]`
    pins (read from jax's own metadata), and the CUDA 12 plugin and PJRT of jax's version. pyproject.toml's
    extras list the same for the jax this repo develops with (a test checks they agree there); on another jax
    (0.11 on the GPU machines) these pins follow it."""
    jax_version = importlib.metadata.version("jax")
    libtpu = next((r.split(";")[0].strip() for r in importlib.metadata.requires("jax") or ()
                   if r.startswith("libtpu") and "extra == \"tpu\"" in r), "libtpu")
    return {"tpu": (libtpu,), "gpu": (f"jax-cuda12-plugin=={jax_version}", f"jax-cuda12-pjrt=={jax_version}")}


# platform -> a module the wheels provide (how their presence is detected)
_PROVIDES = {"tpu": "libtpu", "gpu": "jax_cuda12_plugin"}
ENV_DIR = "MOE_TUNE_COMPILE_WHEELS"  # overrides where the separately installed wheels are


class MissingCompilerError(MoeTuneError):
    """The compile-only wheels for a target's platform are not installed."""


def wheels_dir() -> Path:
    """The folder the compile-only wheels are installed into apart from site-packages."""
    return Path(os.environ.get(ENV_DIR) or Path(sys.prefix) / "compile-only")


def _in_dir(module: str, folder: Path) -> bool:
    return (folder / module).is_dir()


def available(platform: str) -> bool:
    """Whether the compiler for `platform` (`tpu` / `gpu`) is installed here or in `wheels_dir()`."""
    module = _PROVIDES[platform]
    return _in_dir(module, wheels_dir()) or importlib.util.find_spec(module) is not None


def require(platform: str) -> None:
    """MissingCompilerError (one line, naming the extra) unless the compiler for `platform` is installed."""
    if not available(platform):
        raise MissingCompilerError(
            f"compiling for a {platform.upper()} target needs the compile-only wheels: "
            f"pip install 'moe-tune[{platform}-compile]' (or `make test`, which installs them into {wheels_dir()})")


def worker_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a compile worker process: the wheels' folder first on its path; the CPU as its only
    JAX backend (compile-only topologies need no backend of their own, and the CUDA plugin then skips its
    check for CUDA libraries); libtpu allowed alongside other processes that loaded it (no TPU is opened)."""
    env = dict(os.environ if base is None else base)
    folder = str(wheels_dir())
    if Path(folder).is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH", "")) if p)
    env["JAX_PLATFORMS"] = "cpu"
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def pip_arguments(platforms: tuple[str, ...] = ("tpu", "gpu")) -> list[str]:
    """`pip install` arguments that put the wheels into `wheels_dir()`."""
    pins = compile_wheels()
    return ["--no-deps", "--target", str(wheels_dir()), *(w for p in platforms for w in pins[p])]


def install(platforms: tuple[str, ...] = ("tpu", "gpu")) -> None:
    """pip-install the compile-only wheels into `wheels_dir()` (what `make test` runs)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *pip_arguments(platforms)], check=True)


if __name__ == "__main__":
    # `python -m moe_tune.targets.wheels install`: install them; without arguments: print the pip arguments
    if sys.argv[1:] == ["install"]:
        install()
    else:
        print(" ".join(pip_arguments()))
