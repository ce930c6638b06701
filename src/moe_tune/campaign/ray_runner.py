"""A campaign on Ray: one task per sweep, one accelerator per task, the driver the only table writer.

- `connect(address)`: `local` starts a private Ray on this machine (ignoring `RAY_ADDRESS`, so that a campaign
  never attaches to some other cluster by accident); anything else is the address of the cluster to use.
- `Accelerator`: what each task asks Ray for (one GPU, one `TPU` chip, or CPUs) and which JAX platform it
  must then see; `detect_accelerator` reads it off the cluster's resources.
- Each task runs in a fresh worker process (`max_calls=1`: nothing of one sweep's JAX state leaks into the
  next) and first checks that it sees exactly one device of the expected platform (`check_device`), so a
  mis-pinned task fails loudly instead of tuning the wrong chip; the device it got goes into the entry's
  provenance.
- Nothing is lost: the task's sweep log lines go to `LogRelay` (an actor on the driver's node) as they are
  appended, and the relay appends them to the sweep log in the driver's profile dir, the same file a
  sequential sweep on that device kind keeps. A task starts by restoring that log, so a retry (the process
  or node died: Ray runs the task again, on any node) and a restarted driver resume the sweep without
  running its finished candidates again.
- The driver collects results as they finish (`ray.wait`), writes each entry at once (the locked, atomic
  `write_entries`, with provenance: host and device), records a task that raised as a failed sweep, and goes
  on with the rest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from moe_tune.campaign.request import SweepOutcome, error_text, local_device
from moe_tune.campaign.request import PlannedSweep
from moe_tune.core.errors import MoeTuneError
from moe_tune.core.settings import COMPILE_CACHE_DIR
from moe_tune.profiles.table import table_path, write_dir
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.table import write_entries
from moe_tune.profiles.entry import recorded_revision
from moe_tune.tuner.request import SweepSettings

# A task whose process or node dies is run again this many times (an exception it raises is not retried:
# it would raise again).
MAX_RETRIES = 2


class DeviceMismatch(MoeTuneError):
    """A task does not see exactly one device of the platform it was scheduled for."""


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """What one sweep task asks Ray for and must then see. platform: `gpu`, `tpu` or `cpu` (what JAX must
    report); resources: the task's Ray options (`num_gpus`, `num_cpus`, `resources`); assigned: the Ray
    resource whose ids Ray assigns the task (`GPU`, `TPU`), of which it must hold exactly one, or None."""

    platform: str
    resources: dict[str, Any]
    assigned: str | None = None

    def __str__(self) -> str:
        return f"one {self.assigned} per sweep" if self.assigned else f"{self.resources['num_cpus']} CPU(s) per sweep"


def gpu(cpus: float = 1) -> Accelerator:
    return Accelerator("gpu", {"num_gpus": 1, "num_cpus": cpus}, "GPU")


def tpu(cpus: float = 1) -> Accelerator:
    # Ray sets TPU_VISIBLE_CHIPS for a task holding TPU chips, so JAX in the task sees only its chip
    return Accelerator("tpu", {"resources": {"TPU": 1}, "num_cpus": cpus}, "TPU")


def cpu(cpus: float) -> Accelerator:
    return Accelerator("cpu", {"num_cpus": cpus})


def connect(address: str) -> None:
    """Start a private Ray on this machine (`local`), or connect to the cluster at `address`."""
    options = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    saved = os.environ.pop("RAY_ADDRESS", None) if address == "local" else None  # `local` means local, always
    try:
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise MoeTuneError(f"cannot start or reach Ray at {address!r}: {_first_line(e)}") from None
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def detect_accelerator(cpus_per_sweep: float) -> Accelerator:
    """The cluster's accelerator: one GPU per sweep if it has GPUs, else one TPU chip if it has TPUs, else
    CPUs only. A sweep's compile workers each take a core, so a task reserves `cpus_per_sweep` CPUs (its
    `--workers`), at most the cluster's CPUs, and with a chip at most an even share of the CPUs per chip
    (at least 1), so that the CPUs never leave chips idle."""
    resources = ray.cluster_resources()
    cpus = resources.get("CPU", 1)
    for name, accelerator in (("GPU", gpu), ("TPU", tpu)):
        if resources.get(name):
            return accelerator(max(1, min(cpus_per_sweep, cpus // resources[name])))
    return cpu(min(cpus_per_sweep, cpus))


def check_device(accelerator: Accelerator) -> dict[str, Any]:
    """In a task: the device record (`host`, `device`, `device_kind`, `platform`, `accelerator_ids`) once the
    task is seen to hold exactly one device of `accelerator.platform`; DeviceMismatch otherwise."""
    import jax

    found, ids = jax.devices(), ray.get_runtime_context().get_accelerator_ids()
    record = {**local_device(), "accelerator_ids": {name: list(v) for name, v in ids.items() if v}}
    where = f"a task on {record['host']}"
    if len(found) != 1 or record["platform"] != accelerator.platform:
        raise DeviceMismatch(f"{where} sees {len(found)} device(s) of platform {record['platform']} "
                             f"({', '.join(map(str, found))}); it needs exactly one {accelerator.platform} device")
    if accelerator.assigned and len(ids.get(accelerator.assigned, [])) != 1:
        raise DeviceMismatch(f"{where} was assigned {accelerator.assigned} ids {ids.get(accelerator.assigned)}; "
                             "it needs exactly one")
    return record


@ray.remote(num_cpus=0)
class LogRelay:
    """On the driver's node: the campaign's sweep logs (appended as the tasks send their lines) and the
    progress of the running sweeps. One actor, so its writes never interleave."""

    def __init__(self, profile_dir: str):
        self.profile_dir = Path(profile_dir)
        self.running: dict[str, dict[str, Any]] = {}
        self.started: dict[str, dict[str, Any]] = {}  # by key: attempts (starts so far), the last device

    def start(self, key: str, device: dict[str, Any], log: str, fresh: bool) -> bytes:
        """A task starts `key` on `device`: the sweep log received so far (whole lines), to resume from. With
        `fresh`, the first start deletes the log (a retry then resumes what the first attempt sent)."""
        from moe_tune.tuner.request import read_log

        attempts = self.started.get(key, {}).get("attempts", 0) + 1
        self.started[key] = {"attempts": attempts, "device": device}
        self.running[key] = {"device": device, "stage": None, "completed": 0, "total": 0, "since": time.time()}
        path = self.profile_dir / log
        if fresh and attempts == 1:
            path.unlink(missing_ok=True)
        _, good_end = read_log(path)
        return path.read_bytes()[:good_end] if good_end else b""

    def append(self, log: str, data: bytes) -> None:
        """Append whole lines a task's sweep log appended. Lines starting with a header begin a new log (the
        task could not resume this one: another sweep version): the old one is set aside, as `SweepLog` does."""
        path = self.profile_dir / log
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and json.loads(data.split(b"\n", 1)[0]).get("type") == "header":
            path.replace(path.with_suffix(".stale.jsonl"))
        with open(path, "ab+") as f:
            if f.seek(0, os.SEEK_END):  # end a last line cut by a kill: it stays one line that read_log skips
                f.seek(-1, os.SEEK_END)
                data = data if f.read(1) == b"\n" else b"\n" + data
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def progress(self, key: str, stage: str, completed: float, total: int) -> None:
        self.running.setdefault(key, {}).update(stage=stage, completed=completed, total=total)

    def finish(self, key: str) -> None:
        self.running.pop(key, None)

    def snapshot(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """(the running sweeps by key: device, stage, completed, total; every started sweep by key: attempts,
        the device of the last)."""
        return self.running, self.started


class _RelayReporter:
    """The tuner's progress callbacks (`tuner.Reporter`), sent to the relay (fire and forget)."""

    def __init__(self, relay: Any, key: str):
        self.relay, self.key, self.totals, self.done = relay, key, {}, {}

    def stage(self, name: str, total: int) -> None:
        self.totals[name], self.done[name] = total, 0
        self.relay.progress.remote(self.key, name, 0, total)

    def advance(self, name: str, amount: float = 1) -> None:
        self.done[name] = self.done.get(name, 0) + amount
        self.relay.progress.remote(self.key, name, self.done[name], self.totals.get(name, 0))


SweepFn = Callable[..., Any]  # run_sweep's signature: (request, reporter, *, on_log) -> SweepResult


def _enable_compile_cache(driver_setting: str | None) -> None:
    """In a task, before its first compile: JAX's persistent compilation cache, as a sweep on the command line
    has it (a retried or resumed sweep compiles nothing twice), in the driver's `$MOE_TUNE_COMPILE_CACHE_DIR`
    where the driver set one (`off`, or a path every node can write) and else in the node's default dir."""
    from moe_tune.tuner import compiling

    if driver_setting is not None:
        os.environ[COMPILE_CACHE_DIR] = driver_setting  # this worker process runs one task only
    compiling.enable_cache()


def _sweep_task(sweep: PlannedSweep, settings: SweepSettings, accelerator: Accelerator, relay: Any,
                compile_cache_setting: str | None, sweep_fn: SweepFn | None) -> dict[str, Any]:
    """One sweep in a Ray task: check the device, turn the compile cache on, restore the log, run it in a
    scratch profile dir (the driver writes the table), send every log append to the relay. Returns the
    entry's JSON and the device."""
    from moe_tune.tuner import log_path_for, run_sweep

    device = check_device(accelerator)
    _enable_compile_cache(compile_cache_setting)
    scratch = Path(tempfile.mkdtemp(prefix="moe-tune-sweep-"))
    try:
        # fresh: the relay deletes the driver's copy of the log once; the scratch dir starts empty anyway
        request = sweep.request(dataclasses.replace(settings, profile_dir=scratch, fresh=False))
        log_path = log_path_for(request)
        log = str(log_path.relative_to(scratch))
        received = ray.get(relay.start.remote(sweep.key, device, log, settings.fresh))
        if received:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_bytes(received)

        def send(data: bytes) -> None:  # waits: a line counts as kept once the driver's side has it
            ray.get(relay.append.remote(log, data))

        result = (sweep_fn or run_sweep)(request, _RelayReporter(relay, sweep.key), on_log=send)
        return {"entry": result.entry.to_json(), "device": device, "resumed": result.resumed,
                "wall_s": result.wall_s}
    finally:
        relay.finish.remote(sweep.key)
        shutil.rmtree(scratch, ignore_errors=True)


def probe(accelerator: Accelerator) -> dict[str, Any]:
    """The device record of one task scheduled like a sweep (the campaign plans for its platform and device
    kind); DeviceMismatch when that task does not see exactly one device of the expected platform."""
    task = ray.remote(max_calls=1)(check_device).options(**accelerator.resources)
    try:
        return ray.get(task.remote(accelerator))
    except ray.exceptions.RayTaskError as e:
        raise _cause(e) from None


def _first_line(error: BaseException) -> str:
    """The first line of an error's message ("" for none): Ray's messages carry whole remote tracebacks."""
    lines = str(error).splitlines()
    return lines[0] if lines else ""


def _cause(error: ray.exceptions.RayTaskError) -> BaseException:
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else MoeTuneError(_first_line(error))


def provenance(entry: dict[str, Any], device: dict[str, Any]) -> list[dict[str, Any]]:
    """The entry's provenance as the driver writes it: one record (in `moe-tune merge`'s form) with the host
    and the device the task got."""
    parsed = Entry.from_json(entry, entry["key"])
    return [{"source": "ray", "hostname": device["host"], "device": device["device"],
             "accelerator_ids": device.get("accelerator_ids", {}), "median_s": parsed.median_s,
             "tuned_at": parsed.tuned_at, "backend_revision": recorded_revision(parsed), "won": True}]


class CampaignReporter(Protocol):
    """What the driver shows: the running sweeps (by key: device, stage, completed, total) every poll, and
    each sweep as it ends."""

    def running(self, sweeps: dict[str, dict[str, Any]]) -> None: ...

    def finished(self, outcome: SweepOutcome) -> None: ...


def run_on_ray(sweeps: Sequence[PlannedSweep], settings: SweepSettings, accelerator: Accelerator, *,
               reporter: CampaignReporter | None = None, sweep_fn: SweepFn | None = None,
               max_retries: int = MAX_RETRIES, poll_s: float = 0.5) -> list[SweepOutcome]:
    """Run every sweep of `sweeps` as a Ray task (Ray starts each as an accelerator frees up, in plan order)
    and write each entry to the table under `settings.profile_dir` as it arrives. Returns one outcome per
    sweep, in the order they ended. `sweep_fn` replaces `run_sweep` in the tasks (tests inject faults with
    it). A KeyboardInterrupt cancels the tasks still running; what finished is kept."""
    directory = write_dir(settings.profile_dir)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    relay = LogRelay.options(scheduling_strategy=here).remote(str(directory))
    task = ray.remote(max_calls=1)(_sweep_task).options(max_retries=max_retries, retry_exceptions=False,
                                                        **accelerator.resources)
    cache_setting = os.environ.get(COMPILE_CACHE_DIR)
    pending = {task.remote(sweep, settings, accelerator, relay, cache_setting, sweep_fn): sweep for sweep in sweeps}
    outcomes: list[SweepOutcome] = []
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=poll_s)
            running, started = ray.get(relay.snapshot.remote())
            for ref in ready:
                outcome = _collect(pending.pop(ref), ref, directory, started)
                outcomes.append(outcome)
                running.pop(outcome.sweep.key, None)
                if reporter is not None:
                    reporter.finished(outcome)
            if reporter is not None:
                reporter.running(running)
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    except ray.exceptions.RayError as e:  # the relay or the cluster itself failed
        raise MoeTuneError(f"Ray failed: {type(e).__name__}: {_first_line(e)}") from None
    finally:
        ray.kill(relay)
    return outcomes


def _collect(sweep: PlannedSweep, ref: ray.ObjectRef, directory: Path,
             started: dict[str, dict[str, Any]]) -> SweepOutcome:
    """The outcome of one finished task; its entry, with provenance, written to the table at once. `started`:
    the relay's record of the sweep's starts (a failed sweep's device comes from there)."""
    start = started.get(sweep.key, {})
    outcome = SweepOutcome(sweep, device=start.get("device"), attempts=start.get("attempts", 1))
    try:
        done = ray.get(ref)
    except ray.exceptions.RayTaskError as e:  # the sweep raised: recorded, the campaign goes on
        outcome.error = error_text(_cause(e))
        return outcome
    except ray.exceptions.RayError as e:  # its process or node died more often than it was retried
        outcome.error = f"{type(e).__name__}: {_first_line(e)}"
        return outcome
    entry = {**done["entry"], "provenance": provenance(done["entry"], done["device"])}
    outcome.table = table_path(directory, entry["device_kind"], sweep.op)
    write_entries(outcome.table, sweep.op, entry["device_kind"], [entry])
    outcome.entry = Entry.from_json(entry, entry["key"])
    outcome.device, outcome.resumed, outcome.wall_s = done["device"], done["resumed"], done["wall_s"]
    return outcome
