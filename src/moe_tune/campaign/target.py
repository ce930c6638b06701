"""A campaign's compile pass (`moe-tune sweep ... --target CHIP`), instead of its sweeps: plan the sweeps for
the chip's platform, compile their candidates (`targets.compile_sweep`) with a line per sweep as it ends."""

from __future__ import annotations

from collections.abc import Callable

from moe_tune.campaign.request import plan, shard
from moe_tune.campaign.request import Campaign
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles.table import write_dir
from moe_tune.targets import wheels
from moe_tune.targets.calls import DESCRIBED_OPS
from moe_tune.targets.compile import acting_as
from moe_tune.core.chips import get_target
from moe_tune.targets.compile_sweep import TargetSweep, compile_sweeps
from moe_tune.targets.records import records_path


def compile_pass(campaign: Campaign, *, print_line: Callable[[str], None] = print) -> list[TargetSweep]:
    """Compile the candidates of the campaign's cases for its target chip (`Campaign.placed` has ruled out
    --ray), its share of them with `--shard`; a dry run lists the sweeps. Returns a summary per sweep."""
    cases, settings, backend, where = campaign.cases, campaign.settings, campaign.backend, campaign.where
    target = get_target(campaign.passes.target)
    # a layer choice (moe_fusion) runs kernels of the described ops; a chip compiles those, not the choice
    layers = sorted({case.op for case in cases} - set(DESCRIBED_OPS))
    cases = [case for case in cases if case.op in DESCRIBED_OPS]
    if layers and not cases:
        raise UsageError(f"--target compiles kernels ({', '.join(DESCRIBED_OPS)}); {layers[0]} chooses between "
                         f"layers of them: compile their kernels instead (e.g. `--model M --op ragged_dot`)")
    if layers:
        print_line(f"note: {', '.join(layers)} left out: a choice between layers, whose kernels are compiled here")
    if not where.dry_run:
        wheels.require(target.platform)  # the one-line error before anything is printed
    # without --backend, what the chip would tune: its default, or its own kernel where that has no tunables
    sweeps = plan(cases, platform=target.platform, distribution=settings.distribution, backend=backend,
                  tunable=True)
    for sweep in sweeps:  # an emulated backend (triton in interpret mode on a TPU) proves nothing about the chip
        native = [b.name for b in get_op(sweep.op).backends.native_to(target.platform)]
        if sweep.backend not in native:
            raise UsageError(f"--backend {sweep.backend} is not a {target.platform.upper()} kernel; --target "
                             f"{target.name} compiles what the chip runs natively: {', '.join(native)}")
        with acting_as(target):  # a backend asked for by name that this chip cannot run at all (no SparseCores)
            reason = get_op(sweep.op).backends.get(sweep.backend).chip_error(sweep.problem) if backend else None
        if reason is not None:
            raise UsageError(f"--backend {sweep.backend} cannot run on {target.name}: {reason}")
    if where.share is not None:
        sweeps = shard(sweeps, *where.share)
    directory = write_dir(settings.profile_dir)
    print_line(f"compiling the candidates of {len(sweeps)} sweep(s) for {target.name} ({target.description}) "
               f"with {settings.workers} worker(s); records in {records_path(directory, target.device_kind, '<op>')}")
    if where.dry_run:
        for sweep in sweeps:
            print_line(f"  {get_op(sweep.op).describe(sweep.problem)} [{sweep.backend}]")
        return []

    done: set[int] = set()

    def progress(summary: TargetSweep, record, compiled: bool) -> None:
        if summary.ok + summary.failed == summary.candidates and id(summary) not in done:
            done.add(id(summary))
            print_line(line(summary))

    return compile_sweeps(sweeps, target, profile_dir=directory, workers=settings.workers,
                          max_candidates=settings.max_candidates, on_record=progress)


def line(summary: TargetSweep) -> str:
    """`ragged_dot fwd m=... [megablox]: 40 of 42 compile (2 fail: rejected: ...), 12.3 s compiling, 5 stored`."""
    text = (f"{get_op(summary.op).describe(summary.problem)} [{summary.backend}]: {summary.ok} of "
            f"{summary.candidates} compile")
    if summary.failed:
        text += f" ({summary.failed} fail; first: {summary.first_failure[:120]})"
    text += f", {summary.compile_s:.1f} s compiling"
    return text + (f", {summary.stored} from earlier runs" if summary.stored else "")
