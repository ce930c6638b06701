"""`KernelOp`: the one object that describes an op (`moe_tune.kernels.get_op(name)`).

It owns the op's problem class, its backend registry, its shape options (`ShapeOption`, below), the one
`resolve_config` the public wrapper calls at trace time (the caller's config, else the tables, else the
backend's default; the version guard and the can't-run fallback included), and what the tuner needs: how to
build a problem from user-facing options, real inputs for it, the float64 reference the candidates are
checked against, how to call a backend, and how close is close enough.

The shape options of an op are declared as data (`ShapeOption`): what `KernelOp.problem(**options)` takes,
and what the CLI turns into flags (`--top-k`, `--weighted/--unweighted`, ...) and model presets fill in. An
option shared by several ops (dtype, the gather ops' tokens / hidden / top_k ...) is declared once here and
listed by each op that takes it, so its flag and help text are the same everywhere.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import numpy as np

from moe_tune import profiles
from moe_tune.core import contexts, devices
from moe_tune.core.errors import UsageError
from moe_tune.kernels.base import Backend, BackendRegistry, KernelConfig
from moe_tune.kernels.guard import chip_guard, guard
from moe_tune.kernels.layer_shape import LayerShape
from moe_tune.kernels.ragged_dot.problem import SUPPORTED_DTYPES
from moe_tune.core.quant_format import ACTIVATION_QDTYPES, QLAYOUTS, QUANT_NAMES


@dataclasses.dataclass(frozen=True)
class ShapeOption:
    """One keyword of `KernelOp.problem()`.

    type: `int` (a positive integer), `str`, `bool` (a flag pair: `--name` / `negative_flag`), or a tuple of
    strings (one of these choices). default: None means "not given": the op's `default_problem_options()` (or
    the problem's own default) supplies it. listable: the CLI accepts `N[,N...]`: several values make a
    campaign (`sweep --op`: one sweep per combination; `sweep --model`: token counts and ep sizes); elsewhere one
    value is taken. aliases: extra flags (e.g. `--g` for `--groups`).
    """

    name: str
    type: type | tuple[str, ...]
    help: str
    default: Any = None
    listable: bool = False
    aliases: tuple[str, ...] = ()
    negative_flag: str | None = None  # bool options: the flag that sets False (default `--no-<name>`)

    @property
    def flag(self) -> str:
        """`--top-k` for `top_k`."""
        return "--" + self.name.replace("_", "-")

    @property
    def off_flag(self) -> str:
        """The flag that turns a bool option off."""
        return self.negative_flag or "--no-" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.type if isinstance(self.type, tuple) else None


DTYPE = ShapeOption("dtype", SUPPORTED_DTYPES, "Input dtype.")
OUT_DTYPE = ShapeOption("out_dtype", SUPPORTED_DTYPES, "Output dtype (default: --dtype).")

# ragged_dot
M = ShapeOption("m", int, "ragged_dot: rows of lhs (tokens x top_k on this shard).", listable=True)
K = ShapeOption("k", int, "ragged_dot: contracting dim (hidden size for gate/up).", listable=True)
N = ShapeOption("n", int, "ragged_dot: output dim (expert width for gate/up).", listable=True)
GROUPS = ShapeOption("groups", int, "ragged_dot: experts on this shard.", aliases=("--g",), listable=True)
RHS_QUANT = ShapeOption("rhs_quant", QUANT_NAMES, "ragged_dot, fused_moe: quantize the weights (rhs) to this dtype, "
                        "one scale per channel (or per --quant-block along k; int4 usually 128; mxfp4: blocks of 32, "
                        "OCP MX); its key gains the quantization fields.")
LHS_QUANT = ShapeOption("lhs_quant", ACTIVATION_QDTYPES,
                        "ragged_dot: quantize the activations (lhs) too (w8a8), one scale per row (or per "
                        "--quant-block along k).")
LHS_DYNAMIC = ShapeOption("lhs_dynamic", bool, "ragged_dot: with --lhs-quant, the kernel quantizes the float "
                          "activations where it loads each tile (dynamic w8a8: scales from the tile, per row and "
                          "block: --quant-block, else the weights' block) instead of reading quantized ones.",
                          negative_flag="--lhs-stored")
QUANT_BLOCK = ShapeOption("quant_block", int, "ragged_dot: elements along k sharing one scale (sub-channel; "
                          "default: all of k) for the quantized operands.")
QUANT = (RHS_QUANT, LHS_QUANT, QUANT_BLOCK, LHS_DYNAMIC)
RHS_QLAYOUT = ShapeOption("rhs_qlayout", QLAYOUTS, "ragged_dot: with --rhs-quant, how the quantized weights lie in "
                          "memory: kn ([g, k, n], the default) or nk ([g, n, k], k contiguous: what swap-AB GPU "
                          "kernels read); an nk key gains rhs_qlayout.")

# the gather ops
TOKENS = ShapeOption("tokens", int, "gather ops: tokens in the batch; with --model, comma-separated counts per "
                     "device of the expert axis.", listable=True)
HIDDEN = ShapeOption("hidden", int, "gather ops: hidden size (row width).", listable=True)
TOP_K = ShapeOption("top_k", int, "gather ops: experts per token.", listable=True)
EXPERTS = ShapeOption("experts", int, "gather ops: routed experts (all shards).", listable=True)
EP = ShapeOption("ep", int, "gather ops: expert-parallel size; the valid rows are about 1/ep of them; with --model, "
                 "comma-separated sizes: > 1, the layer across that many devices (sharded_moe_mlp).", listable=True)
WEIGHTED = ShapeOption("weighted", bool, "ragged_gather: with or without row weights.",
                       negative_flag="--unweighted")


def names(options: tuple[ShapeOption, ...]) -> tuple[str, ...]:
    return tuple(option.name for option in options)


logger = logging.getLogger("moe_tune")

# Largest error allowed, relative to max |reference|, by the lowest-precision dtype involved. Wrong
# configs produce errors of order one (missing or misplaced rows), far above these.
TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What one kernel call runs with: the backend (after the version guard and the can't-run fallback), the
    config, and where the config came from (for the log)."""

    backend: Backend
    config: KernelConfig
    source: str


@dataclasses.dataclass(frozen=True)
class BenchPlan:
    """What `moe-tune bench` times beside a backend's tuned and default configs (`KernelOp.bench_plan`), all
    compiled once and timed interleaved in the same trace rounds.

    - `baseline`: the variant the tuned config is compared with (`<baseline>_vs_tuned`); `advice`: how to run
      it instead where it is faster.
    - `variants`: name -> function of the inputs (the op's, with `inputs` added), timed besides `tuned` and
      `default`; `same_as`: `tuned` / `default` when one of `variants` runs it (timed once, e.g. a choice).
    - `copy_bytes`: time an elementwise copy of this many bytes too (`copy`: the copy bandwidth); `least_bytes`:
      the bytes any kernel moves at least, at that bandwidth the memory roofline; `compute_bound`: the
      variant whose time bounds the compute (a dense matmul of the same FLOPs). 0 / None: no such bound.
    - `ratios`: extra name -> (numerator, denominator) variant ratios; `shown`: the variants named in the
      comparison's reference column; `details`: recorded with the result (the valid fraction, ...)."""

    baseline: str
    advice: str
    variants: Mapping[str, Callable[[Mapping[str, Any]], Any]]
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    same_as: Mapping[str, str] = dataclasses.field(default_factory=dict)
    copy_bytes: int = 0
    least_bytes: int = 0
    compute_bound: str | None = None
    ratios: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    shown: tuple[str, ...] = ()
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def freeze_config(config: Any) -> Any:
    """A caller's config as a static (hashable) argument: a field dict becomes a sorted tuple of items."""
    return tuple(sorted(config.items())) if isinstance(config, Mapping) else config


def _thaw(config: Any) -> Any:
    return dict(config) if isinstance(config, tuple) else config


class KernelOp(abc.ABC):
    name: ClassVar[str]
    backends: ClassVar[BackendRegistry]
    # The plain-JAX backend that the version guard and the can't-run fallback (and any fallback flags) select.
    fallback: ClassVar[str]
    description: ClassVar[str] = ""
    problem_class: ClassVar[type]  # the op's problem (a frozen dataclass, `profiles.protocols.ProblemLike`)
    directions: ClassVar[tuple[str, ...]] = ("fwd",)  # separately tuned passes (e.g. fwd and gradients)
    options: ClassVar[tuple[ShapeOption, ...]] = ()  # the shape options `problem()` takes (CLI flags, model presets)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An op's own `problem()` is wrapped by `checked_options`: every op refuses a keyword it does not
        declare the same way."""
        super().__init_subclass__(**kwargs)
        if "problem" in cls.__dict__ and not getattr(cls.__dict__["problem"], "checks_options", False):
            cls.problem = checked_options(cls.__dict__["problem"])

    def check_options(self, given: Mapping[str, Any], required: tuple[str, ...] = ()) -> None:
        """UsageError naming the first keyword of `given` that is not one of this op's declared shape options
        (`options`, plus `direction`), with the close match if any (a misspelled `quant_blok`, a problem
        field such as `rhs_qblock`), or the first of `required` not given. Callers holding options meant
        for several ops keep this op's own first (`option_names`, as `commands.options.problems` and
        `layer.models` do)."""
        accepted = (*self.option_names, "direction")
        fields = {field.name for field in dataclasses.fields(self.problem_class)} \
            if dataclasses.is_dataclass(getattr(self, "problem_class", None)) else set()
        for name in given:
            if name not in accepted:
                close = difflib.get_close_matches(str(name), accepted, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                if name in fields:  # the problem's own field: its constructor takes it, not the options
                    hint = f" ({name!r} is a field of {self.problem_class.__name__}, which takes it)"
                raise UsageError(f"{self.name}.problem() takes no option {name!r}{hint}; its options are "
                                 f"{', '.join(accepted)}")
        missing = [name for name in required if name not in given]
        if missing:
            raise UsageError(f"{self.name}.problem() needs {', '.join(missing)}; its options are {', '.join(accepted)}")

    @functools.cached_property
    def key_field_names(self) -> tuple[str, ...]:
        """The names of a table entry's `fields` for this op, in key order: the problem's key fields (those
        of the default problem: every problem of the op has the same), then `backend` and `distribution`."""
        return (*self.problem(**self.default_problem_options()).key_fields(), "backend", "distribution")

    @property
    def optional_key_field_names(self) -> tuple[str, ...]:
        """Names of `fields` only some problems' keys have (ragged_dot: the quantization fields, only when an
        operand is quantized), so that the keys of the other problems stay what they were."""
        return tuple(getattr(self.problem_class, "OPTIONAL_KEY_FIELDS", ()))

    @property
    def option_names(self) -> tuple[str, ...]:
        """The keywords of `problem()`, in declaration order."""
        return tuple(option.name for option in self.options)

    # -- the runtime side -------------------------------------------------------------------------------------

    def backend(self, name: str | Backend | None = None, *, force_fallback: bool = False) -> Backend:
        """The backend called `name` (an instance is returned as is); None: the one a `use_backend` block
        names for this op, else the platform's default (`devices.platform()`). `force_fallback`: the plain-JAX
        fallback whatever `name` says."""
        if force_fallback:
            return self.backends.get(self.fallback)
        if isinstance(name, Backend):
            return name
        if name is None:  # a `use_backend` block's choice, else the platform's default
            name = contexts.chosen_backend(self.name)
        return self.backends.resolve(name, devices.platform())

    def lookup(self, problem: Any, *, backend: str | Backend | None = None, **options: Any) -> profiles.LookupResult:
        """The config the runtime would use for `problem` with `backend` (None: the platform's), and why.
        `options`: those of `moe_tune.profiles.lookup` (distribution, device_kind, strict, stale_policy)."""
        if not isinstance(problem, self.problem_class):
            raise UsageError(f"{self.name}.lookup takes the op's problem ({self.problem_class.__name__}, from "
                             f"get_op({self.name!r}).problem(...)), got {type(problem).__name__}")
        from moe_tune.profiles.lookup import device_of_kind  # another kind: its platform's default backend, rules

        with devices.judging(device_of_kind(options.get("device_kind"))):
            return profiles.lookup(self.name, problem, backend=self.backend(backend), **options)

    def resolve_config(self, backend: str | Backend, problem: Any, given: Any = None, *,
                       distribution: str | None = None) -> Resolved:
        """The backend and config one call of the op runs with (called at trace time, so it costs nothing
        per call under jit).

        - The version guard first: a backend whose `jax_versions` exclude the installed JAX is replaced by
          the plain-JAX `fallback` (one warning). Then the chip guard: a backend the chip cannot run the
          problem on at all (`Backend.chip_error`) is replaced by the fallback with its default config, even
          for a given config (one warning).
        - `given` (a config, or its fields as a dict or `freeze_config` tuple): used as is, validated by
          `coerce_config`; a config the caller passed is never silently replaced (InvalidConfigError).
        - Else the tables (`lookup`: exact, nearest, heuristic default) for the routing `distribution` (None:
          the `moe_tune.core.contexts` block around the call, else the environment's). A looked-up config the
          backend cannot run for this problem (`config_error`, e.g. pallas_tpu with a hidden size that is not
          a multiple of 128) runs on the plain-JAX fallback with its default config instead.
        """
        requested = self.backend(backend)
        impl = guard(requested, self.backends.get(self.fallback))
        rerouted = chip_guard(impl, self.backends.get(impl.chip_fallback or self.fallback), problem)
        if rerouted is not impl:  # a config given for a backend the chip cannot run does not fit the fallback
            impl, given = rerouted, None
        if given is not None:
            config, source = _thaw(given), "given by the caller"
        else:
            found = self.lookup(problem, backend=impl, distribution=distribution)
            config, source = found.config, f"{found.source}: {found.reason}"
            unsupported = impl.config_error(config, problem)
            if unsupported is not None:
                impl = self.backends.get(self.fallback)
                config, source = impl.default_config(problem), f"{requested.name} cannot run it: {unsupported}"
        config = impl.coerce_config(config, problem)
        logger.info("%s %s: backend %s, config %s (%s)", self.name, problem.key_fields(), impl.name, config.label(),
                    source)
        return Resolved(impl, config, source)

    # -- the tuner side ---------------------------------------------------------------------------------------

    @abc.abstractmethod
    def problem(self, **options: Any) -> Any:
        """Build (and validate) a problem from CLI-style options (keywords only: the declared `options` and
        `direction`); raise UsageError on bad input, an unknown keyword included (`check_options`)."""

    @abc.abstractmethod
    def default_problem_options(self) -> dict[str, Any]:
        """Options of the realistic default shape a bare `moe-tune sweep --op NAME` tunes."""

    @abc.abstractmethod
    def make_inputs(self, problem: Any, distribution: str, seed: int) -> dict[str, np.ndarray]:
        """Real (random, seeded) host inputs for `problem`, with group sizes drawn from `distribution`."""

    @abc.abstractmethod
    def reference(self, problem: Any, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Float64 expected output."""

    @abc.abstractmethod
    def run(self, backend: Backend, config: KernelConfig, problem: Any, inputs: Mapping[str, jax.Array]) -> jax.Array:
        """Trace one call of `backend` with `config` (inside jit)."""

    @abc.abstractmethod
    def describe(self, problem: Any) -> str:
        """One-line human description of a problem."""

    def memory_estimate(self, problem: Any) -> int:
        """Bytes of memory a sweep (or `moe-tune bench`) of `problem` needs at least before any candidate runs:
        the host inputs, their device copy, the float64 reference and one candidate output. Pure arithmetic
        on the problem, so that an absurd shape is refused before anything is allocated. 0: unknown."""
        return 0

    def sweep_memory(self, problem: Any, workers: int) -> int:
        """Bytes a sweep of `problem` with `workers` compile worker processes (1: none) holds at its peak.
        By default `memory_estimate` alone: the workers' shares (each its device copy of the inputs and one
        output) are not counted. An op whose workers each hold a large share (moe_fusion: a whole layer's
        weights and gradients) counts them here."""
        return self.memory_estimate(problem)

    def distribution_record(self, problem: Any, distribution: str, seed: int,
                            inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """What an entry records of the inputs it was tuned on, beyond the distribution's name and seed."""
        return {"group_sizes": np.asarray(inputs["group_sizes"]).tolist()}

    def tolerance(self, problem: Any, config: KernelConfig | None = None) -> float:
        """The relative error a candidate's output may have against the float64 reference: `config` (the
        candidate's; None: any of the problem's) for an op whose configs round differently on purpose."""
        # the float dtypes: a quantized operand's products are exact (its `*_qdtype` does not loosen this)
        dtypes = [v for k, v in problem.key_fields().items() if k.endswith("dtype") and not k.endswith("qdtype")]
        return max(TOLERANCE.get(d, 2e-2) for d in dtypes)

    def flops(self, problem: Any) -> int:
        return getattr(problem, "flops", 0)

    # -- what generic code asks of an op (targets, the tuner's inputs thread, bench, report, the layer) ------

    def input_shapes(self, problem: Any, place: Callable[[tuple[int, ...], Any], Any]) -> dict[str, Any] | None:
        """The inputs `make_inputs` makes for `problem`, each array as `place(shape, dtype)` gives it (the same
        pytree: QArrays, DynamicQuant), so that a kernel call compiles before (or without) its inputs. None:
        the op's inputs are not known without making them."""
        return None

    @property
    def has_input_shapes(self) -> bool:
        """Whether the op describes its inputs' shapes (`input_shapes`)."""
        return type(self).input_shapes is not KernelOp.input_shapes

    def abstract_inputs(self, problem: Any, device: Any = None) -> dict[str, Any]:
        """The inputs `run` takes, as `jax.ShapeDtypeStruct`s committed to `device` (None: uncommitted), at any
        size (nothing is allocated); ValueError for an op that does not describe them (`has_input_shapes`)."""
        sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
        place = lambda shape, dtype: jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=sharding)
        shapes = self.input_shapes(problem, place)
        if shapes is None:
            raise ValueError(f"no abstract inputs for op {self.name!r}: its inputs are known only once made")
        return shapes

    def bench_plan(self, problem: Any, backend: Backend, tuned: KernelConfig, inputs: Mapping[str, Any], *,
                   distribution: str, seed: int) -> BenchPlan:
        """What `moe-tune bench` times beside `backend`'s `tuned` and default configs, on the op's `inputs`
        (host arrays): by default the op's plain-JAX fallback, as `fallback`."""
        plain = self.backends.get(self.fallback)
        config = plain.default_config(problem)
        return BenchPlan(baseline="fallback", advice=f"pass backend={self.fallback!r} for this shape",
                         variants={"fallback": lambda x: self.run(plain, config, problem, x)})

    def kernel_label(self, direction: str | None) -> str:
        """The op and direction as a report's `kernel` column names them: the direction shown when the op
        has several (or for one other than fwd)."""
        shown = direction and (len(self.directions) > 1 or direction != "fwd")
        return f"{self.name} {direction}" if shown else self.name

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, Any]]:
        """(role, problem) of each call of this op one `moe_mlp` layer of `layer`'s shape looks up: `runs`
        `fwd` what serving runs (the layer evaluated), `all` what training runs (a training step, and the
        evaluation between steps), None every tunable call of the unfused layer in every direction of its
        ops (what is compiled for a chip). By default none."""
        return []


def checked_options(build: Callable[..., Any]) -> Callable[..., Any]:
    """`build` (an op's `problem(self, *, ...)`) behind `KernelOp.check_options`: keywords only, each one
    the op declares, the ones without a default given."""
    required = tuple(name for name, param in inspect.signature(build).parameters.items()
                     if param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is inspect.Parameter.empty)

    @functools.wraps(build)
    def problem(self: KernelOp, *args: Any, **options: Any) -> Any:
        if args:
            raise UsageError(f"{self.name}.problem() takes keyword arguments only ({', '.join(self.option_names)}), "
                             f"got {len(args)} positional")
        self.check_options(options, required)
        return build(self, **options)

    problem.checks_options = True
    return problem


# Elements per block of `relative_error`: its float64 temporaries stay at tens of MB. Whole-array ones took
# several times the output's size, and a drhs output can be gigabytes ([128, 2048, 1408] f32 is 1.5 GB:
# checking it took the sweep past 18 GB and the OOM killer).
_ERROR_BLOCK = 1 << 22


def relative_error(out: np.ndarray, expected: np.ndarray, scale: float | None = None) -> float:
    """max |out - expected| / max |expected|, in float64; NaN/inf in `out` counts as infinitely wrong.
    `scale`: max |expected| (`error_scale`) when the caller checks many outputs against one reference."""
    out, expected = np.asarray(out), np.asarray(expected)
    if out.shape != expected.shape:
        return float("inf")
    out, expected = out.reshape(-1), expected.reshape(-1)
    worst = 0.0
    for lo in range(0, out.size, _ERROR_BLOCK):
        # one float64 temporary per block, the casts inside the subtraction (no copies of the operands)
        diff = np.subtract(out[lo:lo + _ERROR_BLOCK], expected[lo:lo + _ERROR_BLOCK], dtype=np.float64)
        block_worst = float(np.max(np.abs(diff, out=diff)))
        if not np.isfinite(block_worst):
            return float("inf")
        worst = max(worst, block_worst)
    return worst / max(error_scale(expected) if scale is None else scale, 1e-30)


def error_scale(expected: np.ndarray) -> float:
    """max |expected|, in float64 (the denominator of `relative_error`)."""
    expected = np.asarray(expected).reshape(-1)
    return max((float(np.max(np.abs(expected[lo:lo + _ERROR_BLOCK]))) for lo in range(0, expected.size, _ERROR_BLOCK)),
               default=0.0)
