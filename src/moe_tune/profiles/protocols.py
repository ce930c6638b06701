"""What profiles need of an op's problems, backends and op objects, as Protocols: profiles import nothing
from the kernels package (data flows kernels -> profiles); callers pass the objects in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class ProblemLike(Protocol):
    """One call's static description (a frozen dataclass): its key fields, and which of them are token counts."""

    # Key fields that may differ between a call and the entry lookup picks as nearest (token counts).
    SIZE_FIELDS: ClassVar[tuple[str, ...]]

    def key_fields(self) -> dict[str, Any]:
        """The problem's shape/dtype fields, in key order."""
        ...


class ProblemClass(Protocol):
    """The class of an op's problems: builds one back from an entry's key fields (validate)."""

    SIZE_FIELDS: ClassVar[tuple[str, ...]]

    def from_key_fields(self, fields: Mapping[str, Any]) -> ProblemLike:
        ...


class BackendLike(Protocol):
    """A kernel backend as lookup sees it: its name, kernel revision and config rules."""

    name: str
    revision: int

    def coerce_config(self, config: Any, problem: Any) -> Any:
        """A config instance for `config` (an instance or its JSON); raises when unusable for `problem`."""
        ...

    def default_config(self, problem: Any) -> Any:
        ...


class RegistryLike(Protocol):
    def get(self, name: str) -> BackendLike:
        """The backend called `name`; raises (naming the choices) when there is none."""
        ...


class OpLike(Protocol):
    """An op object as validate sees it: its name, problem class and backends."""

    name: str
    problem_class: ProblemClass
    backends: RegistryLike
    # The names of an entry's `fields`, in key order: the problem's key fields, then backend, distribution.
    key_field_names: tuple[str, ...]
    # Names some entries' `fields` hold besides those (e.g. ragged_dot's quantization fields).
    optional_key_field_names: tuple[str, ...]
