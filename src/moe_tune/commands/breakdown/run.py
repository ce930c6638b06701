"""Re-run an entry's winner and default under `jax.profiler.trace` and read where their time goes.

Each config is compiled once under the program name the sweep's timing uses (`jit_moe_tune_cand_<i>`),
run once untimed (a first call's one-off costs stay out of the profile), then `runs` times inside one
trace, on the inputs the entry was tuned on (its distribution and seed). Readers (`SOURCES`):

- `trace` (CPU): the xplane's per-op thunk events, read as `tuner.timing` reads them;
- `xprof`: on CPU xprof's `trace_viewer` events (the same events, another reader: the two must agree), on
  GPU and TPU its `hlo_stats` tool (self time per HLO op), and on GPU its `kernel_stats` too.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from moe_tune.core import devices
from moe_tune.commands.breakdown import xprof_tools
from moe_tune.commands.breakdown.ops import Breakdown, OpEvent, OpTime, ranked, self_times
from moe_tune.core.errors import MoeTuneError, TableError, UsageError
from moe_tune.kernels import get_op
from moe_tune.core.settings import writable_dir
from moe_tune.profiles.entry import Entry
from moe_tune.tuner.timing import CANDIDATE_PREFIX, device_planes, plane_events, traceable, xplane_file

SOURCES = ("trace", "xprof")
KERNEL_STATS = "xprof kernel_stats"  # the reader whose table is of GPU kernels, not HLO ops


def profile_entry(entry: Entry, *, source: str | None = None, runs: int = 5,
                  keep_trace: Path | None = None) -> list[Breakdown]:
    """Breakdowns of the entry's winner and (when it differs) its default, in that order: one per config, and
    on GPU with `xprof` one more per config for its kernels. `source`: one of SOURCES (default: `trace` on
    CPU, `xprof` elsewhere). `keep_trace`: keep the traces there, openable with `xprof --logdir`.
    UsageError when the entry's backend cannot run here or the source cannot read this platform's traces."""
    platform = devices.platform()
    source = source or ("trace" if platform == "cpu" else "xprof")
    if source not in SOURCES:
        raise UsageError(f"unknown breakdown source {source!r}; sources are {', '.join(SOURCES)}")
    if source == "trace" and platform != "cpu":
        raise UsageError(f"the trace reader reads CPU traces; on {platform} use the xprof one")
    if keep_trace is not None:  # before anything is compiled: where `keep` copies them
        writable_dir(Path(keep_trace) / "plugins" / "profile", "cannot write traces to")
    spec = get_op(entry.op)
    backend, problem, configs = _runnable(entry, spec)
    if not backend.runs_on(platform):
        raise UsageError(f"backend {backend.name!r} of {entry.key} does not run on {platform}")
    recorded = entry.distribution or {}
    host_inputs = spec.make_inputs(problem, recorded.get("name") or entry.fields["distribution"],
                                   recorded.get("seed", 0))
    inputs = jax.device_put(host_inputs)
    found = []
    for index, (label, (config_json, config)) in enumerate(configs.items()):
        call = traceable(lambda x, config=config: spec.run(backend, config, problem, x), index)
        compiled = call.lower(inputs).compile()
        jax.block_until_ready(compiled(inputs))
        with tempfile.TemporaryDirectory(prefix="moe_tune_breakdown_") as trace_dir:
            with jax.profiler.trace(trace_dir):
                start = time.perf_counter()
                for _ in range(runs):
                    jax.block_until_ready(compiled(inputs))
                wall_s = (time.perf_counter() - start) / runs
            kept = None if keep_trace is None else keep(Path(trace_dir), Path(keep_trace), label)
            for reader, ops in read_ops(Path(trace_dir), platform, source, program(index), runs):
                what = " kernels" if reader == KERNEL_STATS else ""
                found.append(Breakdown(label + what, config_json, reader, runs, ops, kept, wall_s))
    return found


def _runnable(entry: Entry, spec: Any) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
    """(backend, problem, label -> (config JSON, config)) of the winner and (when it differs) the default.
    What the table holds is the table's fault, not the command's: a TableError (exit 1) naming the entry."""
    configs = {"winner": entry.config}
    if entry.default_config is not None and entry.default_config != entry.config:
        configs["default"] = entry.default_config
    try:
        backend = spec.backends.get(entry.backend)
        problem = spec.problem_class.from_key_fields(entry.fields)
        return backend, problem, {label: (raw, backend.coerce_config(raw, problem)) for label, raw in configs.items()}
    except UsageError as e:
        raise TableError(f"entry {entry.key!r} cannot be re-run: {e} (`moe-tune validate` checks tables)") from None


def program(index: int) -> str:
    """The HLO module name of the program `traceable(fn, index)` compiles."""
    return f"jit_{CANDIDATE_PREFIX}{index}"


def read_ops(trace_dir: Path, platform: str, source: str, module: str, runs: int
             ) -> list[tuple[str, tuple[OpTime, ...]]]:
    """(reader name, ops largest first) of the trace under `trace_dir`, of `runs` runs of program `module`:
    one table, or on GPU through xprof two (HLO ops, then kernels; the kernels alone where hlo_stats has no
    rows). MoeTuneError when it holds no op."""
    if source == "trace":
        tables = [("trace", ranked(*self_times(_xplane_events(trace_dir, platform, module)), runs))]
    else:
        xplane = xplane_file(trace_dir)
        if xplane is None:
            raise MoeTuneError(f"no xplane under {trace_dir}")
        if platform == "cpu":
            events = xprof_tools.trace_viewer_events(xprof_tools.tool_data(xplane, "trace_viewer"), module)
            tables = [("xprof trace_viewer", ranked(*self_times(events), runs))]
        else:
            tables = [("xprof hlo_stats", xprof_tools.hlo_stats_ops(xprof_tools.tool_data(xplane, "hlo_stats"), runs))]
            if platform == "gpu":
                kernels = (KERNEL_STATS, xprof_tools.kernel_stats_ops(xprof_tools.tool_data(xplane, "kernel_stats"),
                                                                      runs))
                # Seen on an H100 (JAX 0.11.2, xprof 2.24): a program XLA runs as a CUDA command buffer has no
                # hlo_stats rows, and its device-plane op is the buffer's 4 us launch; its kernels are in
                # kernel_stats, which is then the one table.
                tables = [kernels] if not tables[0][1] else [*tables, kernels]
    if not tables[0][1]:
        raise MoeTuneError(f"no per-op events of {module} in the trace ({tables[0][0]})")
    return tables


def _xplane_events(trace_dir: Path, platform: str, module: str) -> list[OpEvent]:
    """The per-op events of program `module` on the device planes of the xplane under `trace_dir`."""
    profile, plane_ids = device_planes(trace_dir, platform)
    if profile is None:
        raise MoeTuneError(f"no xplane under {trace_dir}")
    planes = list(profile.planes)
    return [OpEvent((plane, line), stats["hlo_op"], start, duration)
            for plane in plane_ids for line, _, start, duration, stats in plane_events(planes[plane])
            if stats.get("hlo_module") == module and "hlo_op" in stats]


def keep(trace_dir: Path, keep_dir: Path, label: str) -> str:
    """Copy the trace's sessions into `keep_dir/plugins/profile/<label>_<session>`, where `xprof --logdir
    keep_dir` lists them by name; returns `keep_dir`."""
    for session in sorted((trace_dir / "plugins" / "profile").glob("*")):
        shutil.copytree(session, keep_dir / "plugins" / "profile" / f"{label}_{session.name}", dirs_exist_ok=True)
    return str(keep_dir)


def as_json(breakdowns: list[Breakdown], entry: Entry) -> dict[str, Any]:
    """What `report --breakdown --format json` prints and `gpu_check` records."""
    return {"key": entry.key, "breakdowns": [b.to_json() for b in breakdowns]}
