"""What every kernel backend is: a named implementation of one op with a frozen config, validity rules,
a heuristic default and a search space pruned by those rules.

Ops subclass `Backend` once (`ragged_dot/base.py`: `RaggedDotBackend`, which adds the op's call signature;
`gather/base.py`: `GatherBackend`, `GatherReduceBackend`) and each backend module subclasses that. The tuner
and the public ops only talk to this interface plus the op's `KernelOp` (`kernels/kernel_op.py`). How to add a
backend: `kernels/README.md`.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from moe_tune.core.errors import InvalidConfigError, UsageError


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base of all backend configs: frozen (hashable, so static under jit) and JSON round-trippable."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InvalidConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}; fields are {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise InvalidConfigError(f"bad {cls.__name__} {dict(data)}: {e}") from None

    def label(self) -> str:
        """Short human-readable form, e.g. `tm=128 tk=1024 tn=512`."""
        return " ".join(f"{k}={v}" for k, v in self.to_dict().items()) or "(no tunables)"


ConfigT = TypeVar("ConfigT", bound=KernelConfig)
ProblemT = TypeVar("ProblemT")


class Backend(abc.ABC, Generic[ConfigT, ProblemT]):
    """One implementation of one op.

    Subclasses set `op`, `name`, `config_cls`, `platforms` (where it compiles natively; elsewhere it may
    still run in an emulation such as Pallas interpret mode, see `runs_on`) and implement the methods below.
    """

    op: ClassVar[str]
    name: ClassVar[str]
    config_cls: ClassVar[type[KernelConfig]]
    platforms: ClassVar[tuple[str, ...]]
    description: ClassVar[str] = ""
    # The JAX versions the backend is known to work with (a PEP 440 specifier; "" = any). Outside them the
    # op wrappers fall back to the op's plain-JAX backend with one warning (`kernels/guard.py`).
    jax_versions: ClassVar[str] = ""
    # Revision of the kernel's code, recorded in every table entry tuned with it. Bump it when a change to the
    # kernel can change which config is fastest or whether a config is valid (not for comments, refactors or
    # fixes that leave the generated code alone): entries tuned with another revision are then stale, and
    # lookup uses, skips or refuses them by `$MOE_TUNE_STALE_POLICY` (`profiles/entry.py`).
    revision: ClassVar[int] = 1
    # The backend that serves a problem the chip cannot run here (`chip_error`); None: the op's plain-JAX fallback.
    chip_fallback: ClassVar[str | None] = None

    def runs_on(self, platform: str) -> bool:
        """Whether the backend can execute at all on `platform` (natively or emulated)."""
        return platform in self.platforms

    def config_error(self, config: ConfigT, problem: ProblemT) -> str | None:
        """Why `config` cannot run `problem`, or None when it can. The one place validity rules live."""
        return None

    def chip_error(self, problem: ProblemT) -> str | None:
        """Why the chip this process compiles for (`moe_tune.core.devices`) cannot run `problem` on this backend with
        any config (an instruction the chip lacks, say), or None. The op then runs on its fallback with one
        warning (`guard.chip_guard`); `config_error` refuses every config of such a problem too."""
        return None

    @abc.abstractmethod
    def default_config(self, problem: ProblemT) -> ConfigT:
        """The heuristic config used when no table has an entry. Must be valid for `problem`."""

    def candidate_values(self, problem: ProblemT) -> Mapping[str, Iterable[Any]]:
        """Per-field values whose cartesian product is the unpruned search space."""
        return {}

    def search_space(self, problem: ProblemT) -> list[ConfigT]:
        """Every valid candidate for `problem`, the default first, no duplicates."""
        values = self.candidate_values(problem)
        grid = [self.config_cls(**dict(zip(values, combo))) for combo in itertools.product(*values.values())]
        space = [self.default_config(problem)]
        seen = set(space)
        for cfg in grid:
            if cfg not in seen and self.config_error(cfg, problem) is None:
                seen.add(cfg)
                space.append(cfg)
        return space

    def tunables(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.config_cls)]

    def coerce_config(self, config: Any, problem: ProblemT) -> ConfigT:
        """Accept a config instance or a dict; raise InvalidConfigError (naming the reason) when unusable. For a
        dict, the message shows the fields the caller gave and names any default the rule broke (a default
        the caller never passed is otherwise a puzzle: `{"tm": 16}` breaks `tail <= tm` with tail's 32)."""
        given = dict(config) if isinstance(config, Mapping) else None
        if given is not None:
            config = self.config_cls.from_dict(given)
        if not isinstance(config, self.config_cls):
            raise InvalidConfigError(
                f"backend {self.name!r} takes a {self.config_cls.__name__}, got {type(config).__name__}"
            )
        reason = self.config_error(config, problem)
        if reason is None:
            return config
        if given is None:
            raise InvalidConfigError(f"{self.name} config {config.label()} is invalid: {reason}")
        raise InvalidConfigError(
            f"{self.name} config {given} is invalid: {reason}{_defaults_named(config, given, reason)}")


def _defaults_named(config: KernelConfig, given: Mapping[str, Any], reason: str) -> str:
    """`; tail=32 is the default (not given): pass a value that fits` for each field the caller left to its
    default that `reason` names, else ''."""
    named = [f"{name}={value!r}" for name, value in config.to_dict().items()
             if name not in given and re.search(rf"\b{re.escape(name)}\b", reason)]
    if not named:
        return ""
    which = "is the default" if len(named) == 1 else "are defaults"
    return f"; {', '.join(named)} {which} (not given): pass a value that fits"



def positive_int_error(name: str, value: Any) -> str | None:
    """`config_error`'s message when a tunable is not a positive integer (a bool is not one), else None."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return f"{name} must be a positive integer, got {value!r}"
    return None


class BackendRegistry:
    """Name -> backend instance for one op, plus the per-platform default backend."""

    def __init__(self, op: str, platform_defaults: Mapping[str, str]):
        self.op = op
        self._backends: dict[str, Backend] = {}
        self._platform_defaults = dict(platform_defaults)

    def register(self, backend: Backend) -> Backend:
        self._backends[backend.name] = backend
        return backend

    def unregister(self, name: str) -> None:
        self._backends.pop(name, None)

    def names(self) -> list[str]:
        return list(self._backends)

    def get(self, name: str) -> Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise UsageError(
                f"unknown backend {name!r} for op {self.op!r}; choose from {', '.join(self._backends)}"
            ) from None

    def default_for(self, platform: str) -> Backend:
        return self.get(self._platform_defaults.get(platform, self._platform_defaults["cpu"]))

    def resolve(self, name: str | None, platform: str) -> Backend:
        return self.default_for(platform) if name is None else self.get(name)

    def native_to(self, platform: str) -> list[Backend]:
        """The backends that run natively on `platform` (not emulated, as a Pallas kernel in interpret mode)."""
        return [b for b in self._backends.values() if platform in b.platforms]

    def tunable_for(self, platform: str) -> Backend:
        """The backend whose configs a chip of `platform` would tune: its default when that has tunables, else
        the backend with tunables most specific to the platform (GPU's dense combine defaults to plain `jax`,
        which has nothing to tune; its own kernel is `triton`, not the `tiled` that compiles everywhere)."""
        default = self.default_for(platform)
        if default.tunables():
            return default
        native = [b for b in self.native_to(platform) if b.tunables()]
        return min(native, key=lambda b: len(b.platforms), default=default)
