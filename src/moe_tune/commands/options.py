"""The `moe-tune` command's options, generated from the facts they stand for: each op's shape flags from its
`KernelOp.options` (kernels/kernel_op.py), directions and backends from the op objects, strategies from
tuner/search, dtypes from the one list; and the one function that turns parsed shape flags into
problems. Errors become one line (`handle_errors`)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from moe_tune.core import distributions
from moe_tune.layer import models as presets
from moe_tune.core.errors import MoeTuneError, UsageError
from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.kernel_op import DTYPE, QUANT, ShapeOption, names
from moe_tune.targets import TARGETS
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.search import STRATEGIES

DTYPES = click.Choice(DTYPE.choices)


def handle_errors(fn: Callable) -> Callable:
    """User mistakes become one line and exit 2; runtime failures one line and exit 1; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with warnings.catch_warnings():  # restores the display below when the command returns
                warnings.showwarning = _show_warning
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


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as the CLI shows it: `warning: <message>`, one line, without the source location and line
    Python adds (which name click's frame, not the user's mistake)."""
    click.echo(f"warning: {message}", err=True)


RANGES = "moe_tune.ranges"  # click's per-invocation `meta`: the names of the shape flags given as a range A:B


def ranges_given() -> set[str]:
    """The shape flags of this invocation given as a range (`--m 1:16384`): each asks for a ladder."""
    ctx = click.get_current_context(silent=True)
    return set() if ctx is None else set(ctx.meta.get(RANGES, ()))


class _IntList(click.ParamType):
    """`512` or `512,4096,16384` -> a list of positive ints; `A:B` -> the counts of a ladder
    (`campaign.ladder.ladder_counts`), and the flag is recorded as a range (`ranges_given`)."""

    name = "N[,N...]|A:B"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        if ":" in str(value):
            counts = self._ladder(str(value), param, ctx)
            if ctx is not None and param is not None:
                ctx.meta.setdefault(RANGES, set()).add(param.name)
            return counts
        parts = str(value).split(",")
        if len(parts) > 1 and any(not part.strip() for part in parts):
            self.fail(f"{value!r} has an empty item (give N or N,N,... without empty items)", param, ctx)
        try:
            counts = [int(part) for part in parts if part.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)
        if not counts or any(c < 1 for c in counts):
            self.fail(f"{value!r}: the values must be positive integers", param, ctx)
        return counts

    def _ladder(self, value: str, param, ctx) -> list[int]:
        from moe_tune.campaign.ladder import ladder_counts

        try:
            lo, hi = (int(part) for part in value.split(":"))
        except ValueError:
            self.fail(f"{value!r} is not a ladder A:B of two integers (e.g. 1:16384)", param, ctx)
        try:
            return ladder_counts(lo, hi)
        except UsageError as e:
            self.fail(str(e), param, ctx)


INT_LIST = _IntList()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _all_shape_options() -> list[ShapeOption]:
    """Every op's shape options, each once, in the order the ops declare them (dtypes last)."""
    seen: dict[str, ShapeOption] = {}
    for name in op_names():
        for option in get_op(name).options:
            seen.setdefault(option.name, option)
    return sorted(seen.values(), key=lambda o: o.choices == DTYPE.choices)


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


DEFAULT_OP = op_names()[0]  # the first op the kernels register (the grouped matmul): a bare `sweep`'s
DEFAULT_DIRECTION = "fwd"


def shape_options(fn: Callable | None = None, *, layer: bool = False) -> Callable:
    """--op, --backend, the ops' shape options, --distribution and --direction (shared by `sweep`, `lookup`
    and `bench`); each op takes some of the shape options (`KernelOp.options`). `layer` (the commands that
    take --model): --op and --direction default to None, read as ragged_dot and fwd, or with --model as every
    op of the layer and what training runs (`sweep_campaign`, `bench_cases`)."""
    if fn is None:
        return functools.partial(shape_options, layer=layer)
    sweep = layer
    op_help = ("Op (default: ragged_dot; with --model: every op of the layer, or this one's kernels alone)."
               if sweep else None)
    direction_help = "The forward pass, a gradient, or all of the op's directions" + (
        " (default: fwd; with --model: all, what training runs)." if sweep else ".")
    options = [
        click.option("--op", type=click.Choice(op_names()), default=None if sweep else DEFAULT_OP,
                     show_default=not sweep, help=op_help),
        click.option("--backend", default=None, help=f"Backend (default: the platform's): {', '.join(backends())}; "
                                                     "which op has which: `moe-tune ops`."),
        *(_click_option(option) for option in _all_shape_options()),
        click.option("--distribution", type=click.Choice([*distributions.DISTRIBUTIONS, "all"]), default=None,
                     help=f"Distribution of rows (tokens) over groups (experts). Default: {distributions.DEFAULT} "
                          "for sweep; for lookup and bench the one the runtime assumes ($MOE_TUNE_DISTRIBUTION, "
                          f"else {distributions.DEFAULT}). sweep --distribution all: sweep each, then time each "
                          "winner under every distribution and record the config robust across them."),
        click.option("--direction", type=click.Choice([*directions(), "all"]),
                     default=None if sweep else DEFAULT_DIRECTION, show_default=not sweep, help=direction_help),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def problems(op_name: str, direction: str, shape: dict[str, Any], *, grid: bool = False) -> list[Any]:
    """The problems of `op_name` the shape flags ask for (the op's defaults fill the rest): one per requested
    direction (`all`: every direction the op has) and, with `grid`, per combination of the values of the flags
    that take several (`--m 256,1024 --groups 8,16`: four shapes); without it such a flag must have one value.
    UsageError for a flag the op does not take."""
    op = get_op(op_name)
    wanted = op.directions if direction == "all" else (direction,)
    unknown = [d for d in wanted if d not in op.directions]
    if unknown:
        raise UsageError(f"op {op_name!r} has no direction {unknown[0]!r}; it has {', '.join(op.directions)}")
    given = {k: v for k, v in shape.items() if v is not None}
    foreign = [k for k in given if k not in op.option_names]
    if foreign:
        raise UsageError(f"{flag(foreign[0])} does not apply to {op_name}; its shape options are "
                         f"{' '.join(flag(o) for o in op.option_names)}")
    values = [v if grid and isinstance(v, list) else [one(given, k)] for k, v in given.items()]
    defaults = op.default_problem_options()
    found = []
    for combination in itertools.product(*values):
        chosen = dict(zip(given, combination))
        for d in wanted:
            found.append(op.problem(**{**defaults, **chosen}, direction=d))
            _refuse_inert(op, {**defaults, **chosen}, chosen, d)
    return found


def _values(op: Any, name: str) -> tuple | None:
    """The values a choice or on/off shape option of `op` takes (None for a number)."""
    option = next(o for o in op.options if o.name == name)
    return option.choices or ((True, False) if option.type is bool else None)


def _matters(op: Any, options: dict[str, Any], name: str, direction: str) -> bool:
    """Whether the choice option `name` changes the problem `options` make: some value of it gives another
    problem than the others, or is refused there."""
    made = []
    for value in _values(op, name):
        try:
            made.append(op.problem(**{**options, name: value}, direction=direction))
        except UsageError:
            return True
    return any(problem != made[0] for problem in made)


def _refuse_inert(op: Any, options: dict[str, Any], chosen: dict[str, Any], direction: str) -> None:
    """UsageError for a choice flag given (`chosen`) that changes nothing in the problem (`--glu` of a stage
    without an activation): naming the other flag given that makes it so, where one does."""
    defaults = op.default_problem_options()
    for name in chosen:
        if _values(op, name) is None or _matters(op, options, name, direction):
            continue
        for other in chosen:
            if other == name or _values(op, other) is None:
                continue
            back = {k: v for k, v in options.items() if k != other}
            if other in defaults:
                back[other] = defaults[other]
            if _matters(op, back, name, direction):
                raise UsageError(f"{flag(name)} does not apply to {op.name} with {flag(other)} {chosen[other]}")
        raise UsageError(f"{flag(name)} does not apply to {op.name} here: every value gives the same problem")


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
MODEL_OPTIONS = ("tokens", "ep", "tp", "dtype", *names(QUANT))


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


LADDER_NOTE = ("a ladder: after its sweeps, where neighbouring counts' winners differ, both are timed between "
               "them and the table gets intervals with measured boundaries")


def sweep_campaign(op: str | None, direction: str | None, backend: str | None, model: str | None,
                   shape: dict[str, Any], *, settings: SweepSettings, where: Any, passes: Any) -> Any:
    """The campaign `sweep`'s flags ask for (`campaign.request.Campaign`): one sweep per direction (and per
    combination of listed shape values) of `op` (None: ragged_dot), or every kernel case of the layers of
    `model` (comma-separated presets, or `all`) at each --tokens and --ep (the layer across devices at --ep > 1,
    --tokens per device of the expert axis: `models.layer_cases`; with --op: that op's cases alone;
    --direction None: what training runs). Several values, several models or running elsewhere (--ray,
    --shard) make it a campaign of many; else it is one shape (one model's layer: its summary titled so).
    UsageError for a flag that does not apply."""
    from moe_tune.campaign.request import model_campaign_cases, op_cases
    from moe_tune.campaign.request import Campaign

    notes = (LADDER_NOTE,) if passes.ladder else ()
    if model is None:
        op = op or DEFAULT_OP
        grid = where.elsewhere or several(shape)
        cases = op_cases(op, problems(op, direction or DEFAULT_DIRECTION, shape, grid=grid))
        if where.ray_address is not None:  # a Ray task holds one device: a mesh's sweep cannot run there
            refused = [why for c in cases if (why := presets.left_out(c.op, c.problem, 1)) is not None]
            if refused:
                raise UsageError(refused[0])
        return Campaign(tuple(cases), settings, passes, where, backend, notes, one_shape=not grid)
    model_only(shape, explicit=["backend"] if backend is not None else [])
    models, eps = model.split(","), shape.get("ep") or [presets.LAYER_DEFAULTS["ep"]]
    tokens, _, dtype = presets.layer_settings(shape.get("tokens"), None, shape.get("dtype"))
    # --direction fwd: what serving runs; all (the default with --model): what training runs (models.layer_runs)
    runs = direction or presets.LAYER_DEFAULTS["direction"]
    # only the ragged_dot kernels are quantized
    # --ep > 1 (or --tp > 1; --tp defaults to 1): the layer across an ep x tp mesh (sharded_moe_mlp), --tokens
    # per device of the expert axis (models.sharded_runs); --ep 1: the one-device layer
    cases, left_out = model_campaign_cases(models, tokens, eps, dtype=dtype, quant=quant_options(shape),
                                           direction=runs, tp=one(shape, "tp"))
    # a mesh larger than this process's devices: a note (--target compiles kernels and leaves the strategy out)
    # where the sweeps run: this process, or Ray tasks of one device each
    on = 1 if where.ray_address is not None else None
    cases, absent = presets.runnable_here(cases, on) if passes.target is None else (cases, [])
    left_out = [*left_out, *absent]
    if op is not None:  # e.g. re-measuring one op's shipped entries after its backend's revision bump
        cases = [c for c in cases if c.op == op]
        if not cases:
            raise UsageError(f"the layer of {model} runs no {op} kernel (see `moe-tune models {models[0]}`)")
    many = len(models) > 1 or len(eps) > 1 or models == ["all"] or where.elsewhere
    return Campaign(tuple(cases), settings, passes, where, None, (*left_out, *notes),
                    layer=None if many else (model, f"(ep={eps[0]}, {dtype})"))


MAX_SEED = 2**32 - 1  # NumPy's seeds are unsigned 32-bit


def _check_race(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """`--race`: 0 (no racing) or a factor > 1, the rule `SweepSettings` applies, said the way the help says it."""
    if value is not None and value != 0 and not value > 1:
        raise click.BadParameter(f"{value} is not 0 (no racing) or a factor > 1", ctx, param)
    return value


def bench_cases(op: str | None, direction: str | None, model: str | None, shape: dict[str, Any]
                ) -> list[tuple[str, Any]]:
    """(op, problem) of what `bench` compares: one per direction of `op` (None: ragged_dot; direction None:
    fwd), or with `model` every kernel call its layer runs (--op: that op's; --direction None: training's)."""
    if model is None:
        op = op or DEFAULT_OP
        return [(op, problem) for problem in problems(op, direction or DEFAULT_DIRECTION, shape)]
    from moe_tune.commands import bench

    cases = bench.model_cases(model, shape.get("tokens"), ep=one(shape, "ep"), dtype=shape.get("dtype"),
                              quant=quant_options(shape), op=op, direction=direction)
    return [(name, problem) for name, problem in cases if presets.left_out(name, problem) is None]


def sweep_options(fn: Callable) -> Callable:
    """`sweep`'s flags (the settings, --model, where it runs, its passes) on `fn` (under `shape_options(layer=
    True)`), which gets them, with the shape flags, as one value: the `campaign.request.Campaign` they ask for
    (`sweep_campaign`). A bad value is one line and exit 2 (`handle_errors`)."""
    options = [
        click.option("--seed", type=click.IntRange(min=0, max=MAX_SEED), default=0, show_default=True,
                     help="Seed of inputs and group sizes."),
        click.option("--workers", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default=True,
                     help="Parallel compile worker processes; 1: candidates compile and run once in this process "
                          "(no worker: a candidate that crashes takes the sweep down)."),
        click.option("--samples", type=click.IntRange(min=1), default=None,
                     help="Timing samples (profiler-trace rounds) per candidate (default: the tuner's); the "
                          "finalists get twice as many, and at least 5 (a win needs them)."),
        click.option("--race", type=float, default=None, metavar="FACTOR", callback=_check_race,
                     help="After the first timing round, stop timing candidates more than FACTOR times slower than "
                          "the best so far: 0 (no racing) or a factor > 1 (default: the tuner's, 1.5)."),
        click.option("--max-candidates", type=click.IntRange(min=1), default=None,
                     help="Measure N candidates: the default config and a seeded sample spread across the space "
                          "(every value of each tunable once N allows it)."),
        click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Where to write the table (default: $MOE_TUNE_PROFILE_DIR, else the user cache dir)."),
        click.option("--keep-trace", "keep_trace_dir", type=click.Path(file_okay=False, path_type=Path),
                     default=None, help="Keep the profiler traces (xplane) here, to open with xprof."),
        click.option("--strategy", type=click.Choice(list(STRATEGIES)), default="grid", show_default=True,
                     help="; ".join(f"{name}: {s.summary}" for name, s in STRATEGIES.items()) + "."),
        click.option("--budget", type=int, default=None,
                     help="Try at most N candidates (the default config included)."),
        click.option("--time-budget", "time_budget_s", type=float, default=None, metavar="SECONDS",
                     help="Start no new candidates after this many seconds (finished ones are kept)."),
        click.option("--fresh", is_flag=True, help="Delete this sweep's log and start over instead of resuming."),
        click.option("--cold", is_flag=True,
                     help="No warm start: do not measure the winners of the nearest tuned shapes (same op and "
                          "backend) first, nor search only around them (grid: every candidate)."),
        click.option("--model", default=None,
                     help="Sweep the kernels one layer of this preset runs (see `moe-tune models`; several "
                          "comma-separated, or `all`): --direction all for training (gradients and the backward's "
                          "gathers too), fwd for serving; at --tokens, --ep and --dtype (--ep > 1: the layer across "
                          "that many devices under each ep_strategy, --tokens per device of the expert axis, --tp "
                          "splitting each expert's width; defaults: " + ", ".join(
                              f"{k} {v}" for k, v in presets.LAYER_DEFAULTS.items()) + ")."),
        click.option("--ray", "ray_address", metavar="ADDRESS", default=None,
                     help="Run the sweeps as Ray tasks, one accelerator each, on the Ray cluster at ADDRESS, or on "
                          "a private Ray started here with `local` ($RAY_ADDRESS is ignored then). Needs the `ray` "
                          "extra: pip install 'moe-tune[ray]'."),
        click.option("--shard", metavar="I/N", default=None,
                     help="Run only the I-th (0-based) of N disjoint shares of the plan (default: from "
                          "SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT when set); combine the shares' tables with "
                          "`moe-tune merge`."),
        click.option("--dry-run", is_flag=True, help="Print the campaign's plan and exit."),
        click.option("--ladder", is_flag=True,
                     help="The token counts given (--m / --tokens N,N,...) are a ladder: after their sweeps, time "
                          "neighbouring winners between their counts and store intervals with measured boundaries "
                          "(implied by a range, --m 1:16384: powers of two)."),
        click.option("--target", type=click.Choice(list(TARGETS), case_sensitive=False), default=None,
                     help="Do not sweep: compile every candidate for this chip with its real compiler, here, without "
                          "the chip, and store which compile beside its tables; a sweep "
                          "on the chip then skips the others. Needs the `tpu-compile` / `gpu-compile` extra."),
    ]
    setting_names = [f.name for f in dataclasses.fields(SweepSettings)]

    @functools.wraps(fn)
    @handle_errors
    def wrapper(*, op, backend, direction, model, distribution, samples, race, ray_address, shard, dry_run, target,
                ladder, **kwargs):
        from moe_tune.campaign.request import Passes, Where

        given = {name: kwargs.pop(name) for name in setting_names if name in kwargs}
        every = distribution == "all"  # --distribution all: every distribution, then the robust choice
        runs = tuple(distributions.DISTRIBUTIONS) if every else (distribution or distributions.DEFAULT,)
        given["distribution"] = distributions.DEFAULT if every else runs[0]  # each pass sets its own
        if samples is not None:
            given["samples"] = samples
        if race is not None:
            given["race"] = race or None  # 0: no racing
        passes = Passes(runs, ladder=ladder or bool(ranges_given()), target=target)
        campaign = sweep_campaign(op, direction, backend, model, kwargs, settings=SweepSettings(**given),
                                  where=Where(ray_address, shard_of(shard), dry_run), passes=passes)
        return fn(campaign)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def shard_of(text: str | None) -> tuple[int, int] | None:
    """`--shard I/N` as (index, count), else the SLURM job array's, else None."""
    from moe_tune.campaign.request import parse_shard, shard_from_env

    return parse_shard(text) if text is not None else shard_from_env()
