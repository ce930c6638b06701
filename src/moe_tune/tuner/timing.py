"""Time compiled candidates from the profiler trace (xplane), with a wall-clock cross-check.

Each sample round runs every candidate once, in a shuffled order, inside one profiler session; the
xplane (XSpace) it collects is read as tune-jax's profile reader reads it (a `jax.profiler.ProfileData`) and
each candidate's device time is the span of the events of one execution of its program (named
`jit_moe_tune_cand_<i>`), grouped by run id, or by tune-jax's own contiguity rule when the trace has no run
ids. The XSpace is handed over in memory (`collect`), not written to a file and read back, unless the traces
are kept for xprof. Wall-clock times of the same calls are kept: a
trace time longer than the wall time, a missing event, or a trace time far below the wall time of a long
call means the parse is broken, and every candidate is then timed by the wall clock instead (recorded as
the timing method), so that all candidates of a sweep are always compared by the same clock.
"""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
from tune_jax import profile_reader

CANDIDATE_PREFIX = "moe_tune_cand_"
_EVENT = re.compile(rf"jit_{CANDIDATE_PREFIX}(\d+)\(")

# Cross-check thresholds. Device time cannot exceed the wall time of the same call (small slack for clock
# differences); for calls long enough that dispatch overhead is negligible, it cannot be a small fraction.
_SLACK_S = 50e-6
_LONG_CALL_S = 2e-3
_MIN_TRACE_FRACTION = 0.3


def traceable(fn: Callable, index: int) -> Callable:
    """`jax.jit(fn)` under the program name `jit_moe_tune_cand_<index>`, which the trace parser looks for."""
    fn.__name__ = fn.__qualname__ = f"{CANDIDATE_PREFIX}{index}"
    return jax.jit(fn)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-candidate timing in seconds; `samples_s` are the values the statistics come from."""

    median_s: float
    min_s: float
    max_s: float
    spread: float  # (max - min) / median over the samples
    samples: int
    method: str  # "trace" or "wall"
    wall_median_s: float
    samples_s: tuple[float, ...]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["samples_s"] = list(self.samples_s)
        return d


def summarize(values: list[float], method: str, wall: list[float]) -> Timing:
    """The `Timing` of one candidate's samples (`values`: seconds per call, one per round, by `method`:
    trace or wall), with the median of its wall-clock samples `wall`."""
    med = statistics.median(values)
    return Timing(
        median_s=med, min_s=min(values), max_s=max(values),
        spread=(max(values) - min(values)) / med if med > 0 else 0.0,
        samples=len(values), method=method, wall_median_s=statistics.median(wall), samples_s=tuple(values),
    )


# Events that only record thread-pool and thunk bookkeeping: never part of an execution's identity, and
# most of a CPU trace's events. Reading an event's stats is most of the parse, so these are skipped unread.
_BOOKKEEPING = ("end: ", "ThreadpoolListener::", "SlinkyThreadPool::")


def plane_events(plane) -> Iterator[tuple[int, str, int, int, dict]]:
    """(line index, name, start ns, duration ns, stats) of a plane's events, bookkeeping events skipped
    unread. The one reading of an xplane's events: the timing here and `breakdown` both use it."""
    for line_index, line in enumerate(plane.lines):
        for event in line.events:
            if event.name.startswith(_BOOKKEEPING):
                continue
            yield line_index, event.name, event.start_ns, event.duration_ns, dict(event.stats)


def _spans_by_run(plane) -> dict[int, list[float]]:
    """Group a plane's events by execution (`run_id` stat): one execution's span is its first start to its
    last end, over every event of the run, and its program is the `hlo_module` of those that name one.

    CPU thunks and TPU/GPU module events carry `hlo_module` and `run_id` stats, which identify an execution
    even when two runs of one program are adjacent in time. On CPU a dot can run asynchronously: its own
    event is only the launch, and the run's "ThunkExecutor::Execute (wait for completion)" event, which has
    a run id but no module, is where its time shows.

    The same events as `plane_events` (bookkeeping skipped unread), but each event's stats are read only up
    to its run id and module: a CPU thunk has 9 stats and these are its 2nd and 4th, and reading stats is
    most of the parse (8 tiled calls, 13,400 events read: 64 -> 45 ms; FINDINGS.md: sweep speed).
    """
    spans: dict[int, list[int]] = {}
    modules: dict[int, str] = {}
    for line in plane.lines:
        for event in line.events:
            if event.name.startswith(_BOOKKEEPING):
                continue
            run = module = None
            for key, value in event.stats:
                if key == "run_id":
                    run = value
                elif key == "hlo_module":
                    module = value
                else:
                    continue
                if run is not None and module is not None:
                    break
            if run is None:
                continue
            start = event.start_ns
            end = start + event.duration_ns
            span = spans.get(run)
            if span is None:
                spans[run] = [start, end]
            else:
                span[0], span[1] = min(span[0], start), max(span[1], end)
            if module is not None:
                modules.setdefault(run, module)
    found: dict[int, list[float]] = defaultdict(list)
    for run, (start, end) in spans.items():
        if (match := _EVENT.match(f"{modules.get(run, '')}(")) is not None:
            found[int(match[1])].append((end - start) * 1e-9)
    return found


def _spans_by_contiguity(profile, plane_index: int) -> dict[int, list[float]]:
    """tune-jax's own event grouping (by program name and contiguity), for traces without run ids."""
    found: dict[int, list[float]] = defaultdict(list)
    events = profile_reader.get_events_from_plane(profile, plane_index, prefix_filter=f"jit_{CANDIDATE_PREFIX}")
    for name, seconds in events.items():
        if (match := _EVENT.match(name)) and seconds > 0:
            found[int(match[1])].append(seconds)
    return found


def xplane_file(trace_dir: Path) -> Path | None:
    """The newest xplane under a `jax.profiler.trace` dir, or None when there is none."""
    files = sorted(Path(trace_dir).glob("**/*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    return files[-1] if files else None


def device_planes(trace_dir: Path, platform: str) -> tuple[Any, list[int]]:
    """(the parsed profile of the xplane under `trace_dir`, the indexes of its `platform` device planes);
    (None, []) when the dir holds no xplane."""
    file = xplane_file(trace_dir)
    if file is None:
        return None, []
    profile = profile_reader.parse_profile_from_bytes(file.read_bytes())
    return profile, list(profile_reader.find_device_plane_ids(profile, platform))


def parse_trace(trace_dir: Path, platform: str) -> dict[int, list[float]]:
    """Candidate index -> device durations (s) of its executions found in the xplane under `trace_dir`."""
    profile, _ = device_planes(trace_dir, platform)
    return {} if profile is None else parse_profile(profile, platform)


def parse_profile(profile: Any, platform: str) -> dict[int, list[float]]:
    """Candidate index -> device durations (s) of its executions found in `profile` (a parsed xplane,
    `jax.profiler.ProfileData`).

    With several device planes (one per device) each candidate's events come from the device where it
    was slowest, as in tune-jax.
    """
    plane_ids = profile_reader.find_device_plane_ids(profile, platform)
    planes = list(profile.planes)
    per_plane = []
    for index in plane_ids:
        found = _spans_by_run(planes[index]) if hasattr(planes[index], "lines") else {}
        per_plane.append(found or _spans_by_contiguity(profile, index))
    candidates = {i for found in per_plane for i in found}
    return {i: max((found[i] for found in per_plane if i in found), key=max) for i in candidates}


def cross_check(trace: list[float], wall: list[float], expected: int) -> str | None:
    """Why a candidate's trace times cannot be trusted, or None.

    Each execution's device time is inside its own wall time, so the fastest trace time cannot exceed the
    fastest wall time; and for calls long enough that dispatch is negligible, the device time cannot be a
    small fraction of it. Minimum wall times are used because a shared machine only ever adds to them.
    """
    if len(trace) != expected:
        return f"found {len(trace)} trace events for {expected} runs"
    t, t_min, w = statistics.median(trace), min(trace), min(wall)
    if t_min > w + _SLACK_S and t_min > 1.1 * w:
        return f"trace time {t_min * 1e3:.3f} ms exceeds wall time {w * 1e3:.3f} ms"
    if w > _LONG_CALL_S and t < _MIN_TRACE_FRACTION * w:
        return f"trace time {t * 1e3:.3f} ms is under {_MIN_TRACE_FRACTION:.0%} of wall time {w * 1e3:.3f} ms"
    return None


def first_call_is_warm(platform: str) -> bool:
    """Whether an executable's first call here costs what later calls cost, so that a separate untimed
    warm-up call is a waste. On CPU it is: a 64-candidate sweep's warm-up calls took 4.4 s where the same
    candidates' medians summed to 4.3 s. Elsewhere a first call may load modules."""
    return platform == "cpu"


def _profile_options(keep_trace_dir: Path | None) -> jax.profiler.ProfileOptions:
    """The profiler's options: without the HLO protos of the programs run (the parse reads only the events'
    run ids and module names) unless the traces are kept for xprof, whose views use them. Writing them made
    stopping a trace of 6 tiled candidates 19% slower (2.65 vs 2.15 s, loaded machine; FINDINGS.md: profiler
    cost)."""
    options = jax.profiler.ProfileOptions()
    options.enable_hlo_proto = keep_trace_dir is not None
    return options


def _session_type() -> Any:
    """jaxlib's profiler session, whose `stop_and_get_profile_data` hands the XSpace over in memory (the
    `ProfileData` that `ProfileData.from_serialized_xspace` would build from the file); None when this
    jaxlib has none (then the trace goes through a file, as `jax.profiler.trace` writes it)."""
    try:
        from jax._src.lib import _profiler  # what jax.profiler.start_trace uses; not public
    except ImportError:
        return None
    session = getattr(_profiler, "ProfilerSession", None)
    return session if hasattr(session, "stop_and_get_profile_data") else None


def stop_profiler(session: Any) -> Any:
    """Stop a profiler session; its XSpace as a `jax.profiler.ProfileData`, in memory."""
    return session.stop_and_get_profile_data()


def collect(run: Callable[[], None], platform: str, keep_dir: Path | None = None) -> dict[int, list[float]]:
    """Run `run()` under the profiler; candidate index -> device durations (s) of the executions in its
    trace (`parse_profile`).

    The trace is read in memory: writing the xplane and reading it back cost more than collecting it (6
    tiled candidates: stopping 0.125 s with the file, 0.044 s in memory; parse 0.044 vs 0.035 s; FINDINGS.md:
    sweep speed). With `keep_dir` (`--keep-trace`, for xprof) it is written there, with the HLO
    protos xprof's views use (`_profile_options`).
    """
    session_type = None if keep_dir is not None else _session_type()
    options = _profile_options(keep_dir)
    if session_type is not None:
        jax.devices()  # the backends exist before the session starts (as jax.profiler.start_trace ensures)
        options.raise_error_on_start_failure = True  # another session active: an error, not an empty trace
        session = session_type(options)
        try:
            run()
        finally:
            profile = stop_profiler(session)
        return parse_profile(profile, platform)
    trace_dir = Path(tempfile.mkdtemp(prefix="moe_tune_trace_"))
    try:
        with jax.profiler.trace(str(trace_dir), profiler_options=options):
            run()
        found = parse_trace(trace_dir, platform)
        if keep_dir is not None:
            shutil.copytree(trace_dir, keep_dir, dirs_exist_ok=True)
        return found
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def time_candidates(
    calls: Mapping[int, Callable[[], jax.Array]],
    *,
    samples: int,
    platform: str,
    seed: int = 0,
    keep_trace_dir: Path | None = None,
    on_round: Callable[[int], None] | None = None,
    warmup: int = 1,
    race: float | None = None,
    best_s: float | None = None,
    cutoff_s: float | None = None,
    wall_only: bool = False,
) -> tuple[dict[int, Timing], str | None]:
    """Time each zero-argument call `samples` times, after `warmup` untimed calls each (the first call of
    an executable pays one-off costs: loading, first allocations, cold caches; with compile workers the
    check ran elsewhere, so nothing here has run yet); returns (timings, why the trace was not used).

    Racing (`race`, a factor > 1): after the first round, a call whose first sample is more than `race`
    times the fastest time known -- the fastest first sample of this round, or `best_s` (a median measured
    earlier, e.g. the best of a sweep's previous batches) when that is faster -- is not timed again; its
    timing has one sample. One sample is enough to know a call is that much slower, and the rounds left are
    spent on the ones that can still win. `cutoff_s`: a median a call has to beat to matter (a sweep passes
    the slowest of its finalists so far): after any round, a call whose median over `samples` is certain to
    be above it whatever its samples left (`_median_floor`: for 3 samples, both of its first two above) is
    not timed again; its median, of the samples it has, is above the cutoff too, so it ranks where it would
    have. `on_round(units)`: after each round, how many of the `len(calls) * samples` call-samples are done
    (timed, or skipped by racing or the cutoff). `wall_only`: no profiler, every call timed by the wall clock
    (for the rest of a final round whose trace failed the cross-check); the reason returned is then None.
    """
    rng = random.Random(seed)
    trace: dict[int, list[float]] = defaultdict(list)
    wall: dict[int, list[float]] = defaultdict(list)
    active = list(calls)
    for _ in range(warmup):
        for i in active:
            jax.block_until_ready(calls[i]())
    for round_index in range(samples):
        rng.shuffle(active)

        def one_round() -> None:
            for i in active:
                start = time.perf_counter()
                jax.block_until_ready(calls[i]())
                wall[i].append(time.perf_counter() - start)

        keep = None if keep_trace_dir is None else Path(keep_trace_dir) / f"round_{round_index}"
        if wall_only:
            one_round()
        for i, durations in ({} if wall_only else collect(one_round, platform, keep)).items():
            if i in calls:
                trace[i].extend(durations)
        done, kept = len(active), active
        values = trace if all(len(trace.get(i, ())) == len(wall[i]) for i in active) else wall
        if round_index == 0 and race is not None:
            kept = _race(kept, values, race, best_s)
        if cutoff_s is not None:
            kept = [i for i in kept if not _median_floor(values[i], samples) > cutoff_s]
        done += (len(active) - len(kept)) * (samples - 1 - round_index)
        active = kept
        if on_round is not None:
            on_round(done)

    if wall_only:
        return {i: summarize(wall[i], "wall", wall[i]) for i in calls}, None
    problems = {i: why for i in calls if (why := cross_check(trace.get(i, []), wall[i], len(wall[i])))}
    if problems:
        i, why = next(iter(problems.items()))
        fallback = f"profiler trace failed the wall-clock cross-check for {len(problems)} candidate(s), e.g. #{i}: {why}"
        return {i: summarize(wall[i], "wall", wall[i]) for i in calls}, fallback
    return {i: summarize(trace[i], "trace", wall[i]) for i in calls}, None


def _race(active: list[int], first: Mapping[int, list[float]], factor: float, best_s: float | None) -> list[int]:
    """The calls of `active` whose first sample is within `factor` of the fastest time known."""
    fastest = min(first[i][0] for i in active)
    if best_s is not None:
        fastest = min(fastest, best_s)
    return [i for i in active if first[i][0] <= factor * fastest]


def _median_floor(values: list[float], samples: int) -> float:
    """The least `statistics.median` of `samples` values can be, `values` being some of them and the others
    unknown (0 when nothing bounds it): the median is at least the lower middle value, and each unknown
    value may sit below it."""
    position = (samples - 1) // 2 - (samples - len(values))
    return sorted(values)[position] if position >= 0 else 0.0
