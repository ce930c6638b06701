"""The version guard: a kernel backend declares the JAX versions it supports (`Backend.jax_versions`);
outside them the op falls back to its plain-JAX backend, with one warning that names both versions.

Pallas kernels break across JAX releases (lowering rules and Pallas APIs move); a model should keep
running, slower, rather than fail to compile or, worse, compute something else.
"""

from __future__ import annotations

import functools

import jax
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from moe_tune.errors import warn_caller
from moe_tune.kernels.base import Backend


def installed_jax() -> str:
    return jax.__version__


@functools.cache
def _supported(specifier: str, version: str) -> bool:
    return not specifier or SpecifierSet(specifier).contains(Version(version), prereleases=True)


def supports_installed_jax(impl: Backend) -> bool:
    return _supported(impl.jax_versions, installed_jax())


_warned: set[tuple[str, str]] = set()


def guard(impl: Backend, fallback: Backend) -> Backend:
    """`impl` when the installed JAX is in its supported range, else `fallback` (warning once per backend)."""
    if supports_installed_jax(impl):
        return impl
    if (impl.op, impl.name) not in _warned:
        _warned.add((impl.op, impl.name))
        warn_caller(
            f"moe-tune: backend {impl.name!r} of {impl.op} supports jax {impl.jax_versions}, but jax "
            f"{installed_jax()} is installed; using the plain-JAX fallback {fallback.name!r}")
    return fallback
