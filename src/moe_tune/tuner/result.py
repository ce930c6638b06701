"""How a sweep reports progress (`Reporter`) and how it ends: `SweepResult`, `SweepError` (no winner),
`SweepInterrupted` (a KeyboardInterrupt, with what was kept)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moe_tune.core.errors import MoeTuneError
from moe_tune.profiles.entry import Entry
from moe_tune.tuner.candidate import OK, Candidate
from moe_tune.tuner.request import SweepRequest


class SweepError(MoeTuneError):
    """The sweep could not produce a winner (every candidate failed or was wrong)."""


class Reporter:
    """Progress callbacks; the CLI draws them with rich, the library default ignores them."""

    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, amount: float = 1) -> None:
        pass


@dataclasses.dataclass
class SweepResult:
    request: SweepRequest
    key: str
    entry: Entry  # the table entry, as written
    candidates: list[Candidate]
    table_path: Path | None
    wall_s: float
    log_path: Path | None = None
    resumed: int = 0  # candidates restored from the sweep log
    interrupted: bool = False

    @property
    def best(self) -> Candidate:
        return next(c for c in self.candidates if c.config.to_dict() == self.entry.config and c.status == OK)

    @property
    def default(self) -> Candidate:
        return next(c for c in self.candidates if c.is_default)


class SweepInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt stopped a sweep. The finished candidates are in the log (`log_path`); `result` is
    the entry written from them, or None when too little had finished. str() says what was kept."""

    def __init__(self, message: str, *, log_path: Path, kept: int, result: SweepResult | None):
        super().__init__(message)
        self.log_path, self.kept, self.result = log_path, kept, result

    def __str__(self) -> str:
        return self.args[0]
