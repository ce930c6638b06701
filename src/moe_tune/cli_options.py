"""The `moe-tune` command's options, generated from the facts they stand for: each op's shape flags from its
`KernelOp.options` (kernels/options.py), directions and backends from the op objects, strategies from
tuner/strategies, dtypes from the one list; and the one function that turns parsed shape flags into
problems. Errors become one line (`handle_errors`)."""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from typing import Any

import click

from moe_tune import distributions
from moe_tune.errors import MoeTuneError, UsageError
from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.options import QUANT, ShapeOption, names
from moe_tune.kernels.ragged_dot.problem import SUPPORTED_DTYPES

DTYPES = click.Choice(SUPPORTED_DTYPES)


def handle_errors(fn: Callable) -> Callable:
    """User mistakes become one line and exit 2; runtime failures one line and exit 1; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as e:  # plain click.echo: one unwrapped line, whatever the terminal width
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except MoeTuneError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt as e:  # a SweepInterrupted says what was kept
            click.echo(f"interrupted: {e}" if str(e) else "interrupted", err=True)
            sys.exit(130)

    return wrapper


class _IntList(click.ParamType):
    """`512` or `512,4096,16384` -> a list of positive ints."""

    name = "N[,N...]"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            counts = [int(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)
        if not counts or any(c < 1 for c in counts):
            self.fail(f"{value!r}: the values must be positive integers", param, ctx)
        return counts


INT_LIST = _IntList()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _all_shape_options() -> list[ShapeOption]:
    """Every op's shape options, each once, in the order the ops declare them (dtypes last)."""
    seen: dict[str, ShapeOption] = {}
    for name in op_names():
        for option in get_op(name).options:
            seen.setdefault(option.name, option)
    return sorted(seen.values(), key=lambda o: o.choices == SUPPORTED_DTYPES)


def _click_option(option: ShapeOption) -> Callable:
    if option.type is bool:
        return click.option(f"{option.flag}/{option.off_flag}", option.name, default=None, help=option.help)
    if option.listable:
        kind = INT_LIST
    elif option.choices is not None:
        kind = click.Choice(option.choices)
    else:
        kind = click.IntRange(min=1) if option.type is int else option.type
    return click.option(option.flag, *option.aliases, option.name, type=kind, help=option.help)


def directions() -> list[str]:
    """Every op's directions, each once."""
    return list(dict.fromkeys(d for name in op_names() for d in get_op(name).directions))


def backends() -> list[str]:
    """Every op's backend names, each once."""
    return list(dict.fromkeys(b for name in op_names() for b in get_op(name).backends.names()))


def shape_options(fn: Callable) -> Callable:
    """--op, --backend, the ops' shape options, --distribution and --direction (shared by `sweep`, `lookup`
    and `bench`); each op takes some of the shape options (`KernelOp.options`)."""
    options = [
        click.option("--op", type=click.Choice(op_names()), default="ragged_dot", show_default=True),
        click.option("--backend", default=None, help=f"Backend (default: the platform's): {', '.join(backends())}; "
                                                     "which op has which: `moe-tune ops`."),
        *(_click_option(option) for option in _all_shape_options()),
        click.option("--distribution", type=click.Choice(list(distributions.DISTRIBUTIONS)), default=None,
                     help=f"Distribution of rows (tokens) over groups (experts). Default: {distributions.DEFAULT} "
                          "for sweep; for lookup and bench the one the runtime assumes ($MOE_TUNE_DISTRIBUTION, "
                          f"else {distributions.DEFAULT})."),
        click.option("--direction", type=click.Choice([*directions(), "all"]), default="fwd", show_default=True,
                     help="The forward pass, a gradient, or all of the op's directions."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def problems(op_name: str, direction: str, shape: dict[str, Any], *, grid: bool = False) -> list[Any]:
    """The problems of `op_name` the shape flags ask for (the op's defaults fill the rest): one per requested
    direction (`all`: every direction the op has) and, with `grid`, per combination of the values of the flags
    that take several (`--m 256,1024 --groups 8,16`: four shapes); without it such a flag must have one value.
    UsageError for a flag the op does not take."""
    spec = get_op(op_name)
    wanted = spec.directions if direction == "all" else (direction,)
    unknown = [d for d in wanted if d not in spec.directions]
    if unknown:
        raise UsageError(f"op {op_name!r} has no direction {unknown[0]!r}; it has {', '.join(spec.directions)}")
    given = {k: v for k, v in shape.items() if v is not None}
    foreign = [k for k in given if k not in spec.option_names]
    if foreign:
        raise UsageError(f"{flag(foreign[0])} does not apply to {op_name}; its shape options are "
                         f"{' '.join(flag(o) for o in spec.option_names)}")
    values = [v if grid and isinstance(v, list) else [one(given, k)] for k, v in given.items()]
    defaults = spec.default_problem_options()
    return [spec.problem(**{**defaults, **dict(zip(given, combination))}, direction=d)
            for combination in itertools.product(*values) for d in wanted]


def several(shape: dict[str, Any]) -> bool:
    """Whether a shape flag was given several values (`--m 256,1024`): a campaign."""
    return any(isinstance(v, list) and len(v) > 1 for v in shape.values())


def one(shape: dict[str, Any], name: str) -> Any:
    """The value of a shape flag that takes `N[,N...]` where one value is wanted; UsageError for several."""
    value = shape.get(name)
    if not isinstance(value, list):
        return value
    if len(value) > 1:
        raise UsageError(f"several {flag(name)} values make a campaign: `sweep` (one sweep per shape) or "
                         f"`sweep --model` (--tokens, --ep); give one here")
    return value[0]


# The shape flags a `--model` run takes: the layer's token counts, ep and dtype, and its quantization.
MODEL_OPTIONS = ("tokens", "ep", "dtype", *names(QUANT))


def model_only(shape: dict[str, Any], *, explicit: list[str]) -> None:
    """UsageError when a flag other than `MODEL_OPTIONS` shapes a `--model` run."""
    explicit = explicit + [name for name, value in shape.items() if value is not None and name not in MODEL_OPTIONS]
    if explicit:
        raise UsageError(f"--model sweeps every kernel of the model's layer; {flag(explicit[0])} does not apply "
                         f"(only {', '.join(flag(o) for o in MODEL_OPTIONS)} shape it)")


def quant_options(shape: dict[str, Any]) -> dict[str, Any]:
    """The quantization flags given (`--rhs-quant`, `--lhs-quant`, `--quant-block`), for a model's layer."""
    return {name: shape[name] for name in names(QUANT) if shape.get(name) is not None}


def quant_flags(fn: Callable) -> Callable:
    """The quantization flags alone (`--rhs-quant`, `--lhs-quant`, `--quant-block`), for commands that take a
    model's layer rather than one shape (`models NAME`)."""
    for option in reversed(QUANT):
        fn = _click_option(option)(fn)
    return fn


def campaign_options(fn: Callable) -> Callable:
    """`sweep`'s campaign flags: --ray, --shard, --dry-run (`moe_tune.campaign`)."""
    options = [
        click.option("--ray", "ray_address", metavar="ADDRESS", default=None,
                     help="Run the sweeps as Ray tasks, one accelerator each, on the Ray cluster at ADDRESS, or on "
                          "a private Ray started here with `local` ($RAY_ADDRESS is ignored then). Needs the `ray` "
                          "extra: pip install 'moe-tune[ray]'."),
        click.option("--shard", metavar="I/N", default=None,
                     help="Run only the I-th (0-based) of N disjoint shares of the plan (default: from "
                          "SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT when set); combine the shares' tables with "
                          "`moe-tune merge`."),
        click.option("--dry-run", is_flag=True, help="Print the campaign's plan and exit."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def shard_of(text: str | None) -> tuple[int, int] | None:
    """`--shard I/N` as (index, count), else the SLURM job array's, else None."""
    from moe_tune.campaign.plan import parse_shard, shard_from_env

    return parse_shard(text) if text is not None else shard_from_env()
