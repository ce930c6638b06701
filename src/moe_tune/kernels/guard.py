"""The version guard: a kernel backend declares the JAX versions it supports (`Backend.jax_versions`);
outside them the op falls back to its plain-JAX backend, with one warning that names both versions. The chip
guard does the same for a problem the chip cannot run on a backend (`Backend.chip_error`).

Pallas kernels break across JAX releases (lowering rules and Pallas APIs move); a model should keep
running, slower, rather than fail to compile or, worse, compute something else.
"""

from __future__ import annotations

import functools

import jax
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from moe_tune.core.errors import warn_caller
from moe_tune.kernels.base import Backend


def installed_jax() -> str:
    return jax.__version__


@functools.cache
def _supported(specifier: str, version: str) -> bool:
    return not specifier or SpecifierSet(specifier).contains(Version(version), prereleases=True)


def supports_installed_jax(impl: Backend) -> bool:
    return _supported(impl.jax_versions, installed_jax())


_warned: set[tuple[str, ...]] = set()


def _fall_back(impl: Backend, fallback: Backend, why: str, *, detail: str = "") -> Backend:
    """`fallback`, warning once per backend and reason (`why`) that `impl` is replaced."""
    if (impl.op, impl.name, why) not in _warned:
        _warned.add((impl.op, impl.name, why))
        kind = "the backend" if fallback.name == impl.chip_fallback else "the plain-JAX fallback"
        warn_caller(f"moe-tune: backend {impl.name!r} of {impl.op} {why}; using {kind} {fallback.name!r}{detail}")
    return fallback


def guard(impl: Backend, fallback: Backend) -> Backend:
    """`impl` when the installed JAX is in its supported range, else `fallback` (warning once per backend)."""
    if supports_installed_jax(impl):
        return impl
    return _fall_back(impl, fallback, f"supports jax {impl.jax_versions}, but jax {installed_jax()} is installed")


def chip_guard(impl: Backend, fallback: Backend, problem) -> Backend:
    """`impl`, or `fallback` when the chip cannot run `problem` on it at all (`Backend.chip_error`): one
    warning per backend and reason. The Triton fp8 kernels, for one, abort the process while compiling for
    a GPU below compute capability 8.9 (an LLVM fatal error, not an exception)."""
    reason = impl.chip_error(problem)
    if reason is None:
        return impl
    detail = "" if fallback.name == impl.chip_fallback else " with its default config"  # a named backend: its tables
    return _fall_back(impl, fallback, f"cannot run here: {reason}", detail=detail)
