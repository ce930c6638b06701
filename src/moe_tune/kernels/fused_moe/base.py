"""The call signatures every fused MoE backend implements: `gather_gmm` (fused dispatch) and `gmm_combine`
(fused combine). The public ops (`op.py`) normalize group sizes and offsets, check shapes, pick configs per
direction and own the gradients; backends only implement the forward semantics below, each with a
`transpose_rhs` form that the gradients run.

Conventions shared with ragged_dot (`ragged_dot/base.py`):
- `group_sizes` int32 [total_groups] arrives normalized by `metadata.select_shard` (sizes >= 0, summing to
  at most m; an out-of-range offset already turned into all-zero sizes), `group_offset` an int32 scalar or
  None (= 0, total_groups == groups). The local groups are `[group_offset, group_offset + groups)` and
  their rows the range `[start, end)` of `metadata.group_bounds(group_sizes, m=m, groups=groups,
  group_offset=...)`: start = first row of the first local group, end = one past the last local row. That
  range is the one source of truth for which rows a shard owns.
- rhs float [groups, k, n] in the activations' dtype, or a `moe_tune.QArray` scaled along k (scale
  [groups, k/bs, n]); with `transpose_rhs` the same forward weights, read as [groups, n, k] (rhs[g].T).
- Low-precision operands are multiplied with float32 accumulation.
- Gate and up as two arrays: a backend that sets `split_weights = True` may be given `rhs` as a tuple of
  parts (gate, up), each [groups, k, f] (or QArray), that stand for their concatenation along n (for the
  transposed forms: along the contraction); `weight_parts` / `weights_shape` read either form. For any other
  backend the op concatenates them first (one copy of the weights per call).
"""

from __future__ import annotations

import abc
from typing import Any, Union

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.core.quant import QArray, split


Weights = Union[jax.Array, QArray, tuple]  # one array / QArray, or a tuple of parts (`split_weights`)


def weight_parts(rhs: Weights) -> list:
    """The parts of `rhs`: a tuple's items, else [rhs]."""
    return list(rhs) if isinstance(rhs, tuple) else [rhs]


def concatenated(parts: list) -> jax.Array | QArray:
    """Weight parts concatenated along n (a QArray's values and scales alike): one copy of the weights."""
    if isinstance(parts[0], QArray):
        return QArray(jnp.concatenate([p.qvalue for p in parts], axis=2),
                      jnp.concatenate([p.scale for p in parts], axis=2))
    return jnp.concatenate(parts, axis=2)


def kernel_parts(rhs: Weights, *, tile: int, glu: str | None) -> list[tuple[jax.Array, jax.Array | None]]:
    """The (values, float32 scale or None) of each weight array a Pallas kernel reads for `rhs`: its parts as
    they are when each part's width along n is a multiple of `tile` (the kernel's block along n: no block
    straddles two parts) and, with glu, they are gate and up of one width; else their concatenation, one
    array (one copy, as the op makes for a backend that takes no parts). `FusedMoeProblem.parts_split` says
    where a config must keep its blocks inside the parts."""
    parts = weight_parts(rhs)
    widths = [p.shape[2] for p in parts]
    fits = all(w % tile == 0 for w in widths) and (not glu or (len(parts) == 2 and widths[0] == widths[1]))
    return [split(p) for p in (parts if len(parts) == 1 or fits else [concatenated(parts)])]


def kernel_operands(parts: list[tuple[jax.Array, jax.Array | None]]) -> list[jax.Array]:
    """The arrays to pass a kernel for `kernel_parts`: each part's values, then its scale when quantized."""
    return [a for values, scale in parts for a in (values, scale) if a is not None]


def weight_refs(refs: tuple, count: int, quantized: bool) -> tuple[list, tuple]:
    """The kernel's refs of `count` weight operands (`kernel_operands`' order) as [(values ref, scale ref or
    None)], and the refs after them."""
    step = 2 if quantized else 1
    weights = [(refs[i * step], refs[i * step + 1] if quantized else None) for i in range(count)]
    return weights, refs[count * step:]


def weights_shape(rhs: Weights) -> tuple[int, int, int]:
    """(groups, k, n) of the weights the parts stand for, concatenated along their last axis."""
    parts = weight_parts(rhs)
    groups, k, _ = parts[0].shape
    return groups, k, sum(p.shape[2] for p in parts)


class FusedMoeBackend(Backend[Any, FusedMoeProblem]):
    """One implementation of the fused dispatch and combine. Subclasses set `name`, `config_cls` (a frozen
    `KernelConfig`; one config class serves all four directions, each tuned separately), `platforms`,
    `revision`, and implement `default_config` and the two kernels (and `config_error` /
    `candidate_values` when they have tunables)."""

    op = "fused_moe"
    split_weights: bool = False  # whether `rhs` may come as a tuple of parts (module docstring)

    @abc.abstractmethod
    def gather_gmm(
        self,
        x: jax.Array,
        rows: jax.Array,
        rhs: jax.Array | QArray,
        group_sizes: jax.Array,
        *,
        config: KernelConfig,
        out_dtype: jnp.dtype,
        group_offset: jax.Array | None = None,
        glu: str | None = None,
        transpose_rhs: bool = False,
    ) -> jax.Array:
        """Fused dispatch: `out[i] = x[rows[i]] @ rhs[group(i)]` for the rows i of the local groups, zero
        elsewhere; no gathered [m, k] copy of x is written.

        x [tokens, k] (f32 / bf16 / f16); rows int32 [m]: the token each expert-ordered row reads, in [0,
        tokens) for local rows, anything elsewhere (never read there); rhs [groups, k, n] (transpose_rhs:
        [groups, n, k] read as rhs[g].T, the combine's backward; x is then [tokens, n]); glu: an
        `activations.ACTIVATIONS` name (never with transpose_rhs): rhs is gate and up concatenated along n
        and out = act(h[:, :n/2]) * h[:, n/2:], the activation applied in float32 before the one rounding.
        -> [m, n] ([m, n/2] with glu; [m, k] with transpose_rhs) in out_dtype."""

    @abc.abstractmethod
    def gmm_combine(
        self,
        h: jax.Array,
        rhs: jax.Array | QArray,
        group_sizes: jax.Array,
        rows: jax.Array,
        row_weights: jax.Array,
        *,
        tokens: int,
        config: KernelConfig,
        out_dtype: jnp.dtype,
        group_offset: jax.Array | None = None,
        skip_zero_weights: bool = False,
        transpose_rhs: bool = False,
    ) -> jax.Array:
        """Fused combine: `out[t] = sum over local rows i with rows[i] == t of row_weights[i] * (h[i] @
        rhs[group(i)])`, accumulated in float32, rounded once to out_dtype; no [m, n] product is written,
        and a token's contributions are not summed as a sequential chain of row additions.

        h [m, k]; rhs [groups, k, n] (transpose_rhs: [groups, n, k] read as rhs[g].T, the dispatch's
        backward; h is then [m, n]); rows int32 [m] (token of each row, in [0, tokens) for local rows);
        row_weights float32 [m]; tokens static. -> [tokens, n] ([tokens, k] with transpose_rhs).

        The rules of `ragged_gather_reduce`: rows outside the local groups are invalid and never read (their
        h rows may be NaN, their rows / weights anything); a valid row multiplies even at weight 0 (0 x NaN =
        NaN) unless `skip_zero_weights`, which drops rows whose weight is exactly 0 like invalid ones. A
        token no valid row reaches is 0."""

    def takes(self, rhs: Weights) -> Weights:
        """`rhs` as this backend takes it: the parts only with `split_weights`, else their concatenation (inside
        the caller's program: the copy is part of what runs, and of what a sweep times)."""
        parts = weight_parts(rhs)
        if len(parts) == 1:
            return parts[0]
        return tuple(parts) if self.split_weights else concatenated(parts)

    def run(self, problem: FusedMoeProblem, config: KernelConfig, inputs: dict[str, Any]) -> jax.Array:
        """Run `problem.direction` on the inputs `FusedMoeOp.make_inputs` builds: `a` (x, dh, h or dout),
        `rows`, `rhs` (the dispatch's as gate and up, as `moe_mlp` passes them), `group_sizes`, and for the
        combine kernel `weights`; optional `group_offset`."""
        inputs = {**inputs, "rhs": self.takes(inputs["rhs"])}
        out_dtype = jnp.dtype(problem.dtype)
        common = dict(config=config, out_dtype=out_dtype, group_offset=inputs.get("group_offset"),
                      transpose_rhs=problem.transpose_rhs)
        if problem.kernel == "gather_gmm":
            glu = None if problem.transpose_rhs else problem.glu
            return self.gather_gmm(inputs["a"], inputs["rows"], inputs["rhs"], inputs["group_sizes"], glu=glu,
                                   **common)
        return self.gmm_combine(inputs["a"], inputs["rhs"], inputs["group_sizes"], inputs["rows"],
                                inputs["weights"], tokens=problem.tokens, **common)
