"""The static description of one fused MoE kernel call (`fused_moe` op): what a config is chosen for and what
tables are keyed on.

Two stages (`dispatch`, `combine`), each with a forward and a backward direction; shapes are always those of
the stage's forward call (`k` the contraction, `n` the weights' output columns), so a stage's two directions
share every key field but `direction`:

- dispatch fwd: `gather_gmm(x [tokens, k], rows [m], rhs [g, k, n])` -> [m, n] (with `glu`: [m, n / 2]),
  row i reading `x[rows[i]]` in place of a gathered [m, k] copy.
- dispatch bwd: its gradient in x, a fused scatter-add: `gmm_combine(dh [m, n], rhs^T, rows, weights 1)`
  -> [tokens, k].
- combine fwd: `gmm_combine(h [m, k], rhs [g, k, n], rows, row_weights)` -> [tokens, n], the weighted sum
  over each token's rows in the down projection's epilogue.
- combine bwd: its gradient in h, `gather_gmm(dout [tokens, n], rows, rhs^T)` -> [m, k].
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS
from moe_tune.kernels.ragged_dot.problem import check_positive, checked_quant_fields, supported_dtype
from moe_tune.core.quant_format import QuantFormat

DIRECTIONS = ("fwd", "bwd")
STAGES = ("dispatch", "combine")
# The kernel each (stage, direction) runs and whether it reads the weights transposed.
KERNEL = {("dispatch", "fwd"): ("gather_gmm", False), ("dispatch", "bwd"): ("gmm_combine", True),
          ("combine", "fwd"): ("gmm_combine", False), ("combine", "bwd"): ("gather_gmm", True)}


@dataclasses.dataclass(frozen=True)
class FusedMoeProblem:
    """Shapes and dtypes of one fused dispatch or combine (`stage`) and its direction (see the module
    docstring).

    tokens: rows of the token-ordered side (x of dispatch, the output of combine). m: expert-ordered rows
    (tokens x top_k). k, n: the forward weights [groups, k, n] (dispatch with `glu`: n = 2 x the expert
    width, gate and up concatenated). groups: local experts. dtype: of the activations, the output, and the
    weights when float. glu: the activation name of dispatch's gated epilogue (`activations.ACTIVATIONS`),
    None for none (combine: always None). rhs_qdtype / rhs_qblock: quantized weights (QArray scaled along k;
    `rhs_format`, ragged_dot's rule: mxfp4 in blocks of 32, None: k), key fields only when set.
    `total_groups`, `experts`, `ep` shape the sweep's inputs only (not the key).
    """

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("tokens", "m")  # what `nearest` lookup may vary
    OPTIONAL_KEY_FIELDS: ClassVar[tuple[str, ...]] = ("rhs_qdtype", "rhs_qblock")

    tokens: int
    m: int
    k: int
    n: int
    groups: int
    dtype: str = "float32"
    stage: str = "dispatch"
    direction: str = "fwd"
    glu: str | None = None
    rhs_qdtype: str | None = None
    rhs_qblock: int | None = None
    total_groups: int | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        check_positive(self, ("tokens", "m", "k", "n", "groups", "ep"))
        if self.direction not in DIRECTIONS:
            raise UsageError(f"unknown direction {self.direction!r}; choose from {', '.join(DIRECTIONS)}")
        if self.stage not in STAGES:
            raise UsageError(f"unknown stage {self.stage!r}; choose from {', '.join(STAGES)}")
        object.__setattr__(self, "dtype", supported_dtype(self.dtype))
        if self.glu is not None:
            if self.glu not in ACTIVATIONS:
                raise UsageError(f"unknown glu activation {self.glu!r}; choose from {', '.join(ACTIVATIONS)}")
            if self.stage != "dispatch":
                raise UsageError("glu (the gated activation epilogue) belongs to dispatch, not combine")
            if self.n % 2:
                raise UsageError(f"with glu, n (gate and up concatenated) must be even, got {self.n}")
        if self.total_groups is not None and self.total_groups < self.groups:
            raise UsageError(f"total_groups ({self.total_groups}) < groups ({self.groups})")
        checked_quant_fields(self, "rhs")  # ragged_dot's rule for its weights: QuantFormat along k

    @property
    def rhs_format(self) -> QuantFormat | None:
        """The weights' quantization (its block concrete), None for float weights."""
        return None if self.rhs_qdtype is None else QuantFormat(self.rhs_qdtype, self.rhs_qblock)

    @property
    def kernel(self) -> str:
        """`gather_gmm` or `gmm_combine`: the backend method this direction calls."""
        return KERNEL[self.stage, self.direction][0]

    @property
    def transpose_rhs(self) -> bool:
        """Whether this direction reads the weights transposed (the backward directions)."""
        return KERNEL[self.stage, self.direction][1]

    @property
    def top_k(self) -> int:
        return max(1, self.m // self.tokens)

    @property
    def out_n(self) -> int:
        """Columns of the forward dispatch output: n / 2 with glu, else n."""
        return self.n // 2 if self.glu else self.n

    @property
    def rhs_parts(self) -> int:
        """How many arrays the weights come as: the dispatch's gate and up (2, each [groups, k, n / 2]), as
        `moe_mlp` passes them, when n is even; else 1 ([groups, k, n])."""
        return 2 if self.stage == "dispatch" and self.n % 2 == 0 else 1

    @property
    def parts_split(self) -> str | None:
        """What the dispatch's gate and up parts split, where a kernel's block must not straddle them (its
        block along that axis divides f = n / 2): "k", the contraction of the backward (dh @ [gate | up]^T);
        "n", the output columns of the forward without glu (the training forward's [m, 2f]); None where the
        weights are one array or glu gives each accumulator its own part."""
        if self.rhs_parts != 2 or (self.glu and not self.transpose_rhs):
            return None
        return "k" if self.transpose_rhs else "n"

    def with_direction(self, direction: str) -> "FusedMoeProblem":
        """The same stage's other direction (glu is kept: the dispatch backward differentiates through it)."""
        return dataclasses.replace(self, direction=direction)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def num_group_sizes(self) -> int:
        return self.total_groups or self.groups

    def itemsize(self) -> int:
        return np.dtype(jnp.dtype(self.dtype)).itemsize

    def key_fields(self) -> dict[str, Any]:
        """The fields a table entry is keyed on (in key order); the quantization fields only when quantized."""
        fields = {"direction": self.direction, "stage": self.stage, "tokens": self.tokens, "m": self.m, "k": self.k, "n": self.n,
                  "groups": self.groups, "dtype": self.dtype, "glu": self.glu or "none"}
        if self.rhs_qdtype is not None:
            fields.update(rhs_qdtype=self.rhs_qdtype, rhs_qblock=self.rhs_qblock)
        return fields

    @classmethod
    def from_key_fields(cls, fields: dict[str, Any]) -> "FusedMoeProblem":
        values = {f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields}
        if values.get("glu") == "none":
            values["glu"] = None
        return cls(**values)
