"""The one key function. The tuner calls it when it writes an entry and the runtime when it reads one;
if the two ever disagreed, tuned entries would silently never be used."""

from __future__ import annotations

from typing import Any


def key_fields(problem: Any, backend: str, distribution: str) -> dict[str, Any]:
    """Everything a tuned config depends on: the problem's shape/dtype fields, the backend, the
    group-size distribution. Problems provide `key_fields()` (ordered)."""
    return {**problem.key_fields(), "backend": backend, "distribution": distribution}


def key_from_fields(op: str, fields: dict[str, Any]) -> str:
    """`ragged_dot|direction=fwd|m=4096|...|backend=tiled|distribution=balanced`."""
    return "|".join([op, *(f"{name}={value}" for name, value in fields.items())])


def entry_key(op: str, problem: Any, backend: str, distribution: str) -> str:
    return key_from_fields(op, key_fields(problem, backend, distribution))
