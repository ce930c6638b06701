"""The static description of one dispatch (`ragged_gather`) or combine (`ragged_gather_reduce`,
`dense_gather_reduce`) call: what a config is chosen for and what tables are keyed on."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from moe_tune.core.errors import UsageError
from moe_tune.kernels.ragged_dot.problem import check_positive, supported_dtype

GATHER_OPS = ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce")


@dataclasses.dataclass(frozen=True)
class GatherProblem:
    """Shapes and dtype of a token gather between `tokens` token rows and `rows` expert-ordered rows.

    - `ragged_gather` (dispatch): x [tokens, hidden] -> out [rows, hidden]; out[i] = x[indices[i]] (* w[i])
      for i in [start, end), zero elsewhere. `weighted`: whether a weights vector is passed.
    - `ragged_gather_reduce` / `dense_gather_reduce` (combine): x [rows, hidden] -> out [tokens, hidden],
      rows = tokens * top_k (the reduce group size); always weighted.

    `experts` and `ep` (expert-parallel size) only shape the sweep's inputs: the valid range is the rows
    routed to the first `experts / ep` experts, a fraction of about 1/ep. The runtime cannot see them (start
    and end are traced values), so they are recorded with an entry but are not part of its key.
    """

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("tokens", "rows")  # what `nearest` lookup may vary

    tokens: int
    rows: int
    hidden: int
    dtype: str = "float32"
    weighted: bool = True
    direction: str = "fwd"
    experts: int | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        check_positive(self, ("tokens", "rows", "hidden", "ep"))
        if self.experts is not None:
            if self.experts <= 0:
                raise UsageError(f"experts must be a positive integer, got {self.experts!r}")
            if self.experts % self.ep:
                raise UsageError(f"experts ({self.experts}) must be a multiple of the expert-parallel size ep "
                                 f"({self.ep})")
            if self.top_k > self.experts:  # a token goes to top_k distinct experts
                raise UsageError(f"top_k ({self.top_k}) must not exceed experts ({self.experts}): each token is "
                                 "routed to top_k distinct experts")
        if self.direction != "fwd":
            raise UsageError(f"gather ops have one direction, fwd (their gradients are the other op); got "
                             f"{self.direction!r}")
        object.__setattr__(self, "dtype", supported_dtype(self.dtype))

    @property
    def top_k(self) -> int:
        """Rows per token (the fan-out of dispatch, the reduce group size of combine)."""
        return self.rows // self.tokens

    def row_bytes(self) -> int:
        return self.hidden * jnp.dtype(self.dtype).itemsize

    def key_fields(self) -> dict[str, Any]:
        """The fields a table entry is keyed on (order is the key's order)."""
        return {"direction": self.direction, "tokens": self.tokens, "rows": self.rows, "hidden": self.hidden,
                "dtype": self.dtype, "weighted": self.weighted}

    @classmethod
    def from_key_fields(cls, fields: dict[str, Any]) -> "GatherProblem":
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})
