"""Planning the MoE layer across devices for a slice this machine does not have.

For a model preset at `tokens` per expert-axis shard on a slice (`core.chips.SLICES`), each way of the sharded
layer (`STRATEGIES`: each `ep_strategy`, in_kernel on TPU slices only, and `all_to_all` over the fixed-capacity
exchange) is compiled for the slice's compile-only chips (`slice_compile.py`, in compile workers) and
recorded: whether it fits (per-chip memory from `memory_analysis` against the chip's published HBM), the
collectives of the compiled program with the bytes one chip sends (`collectives.py`), the TPU compiler's own
estimate (`optimal_seconds`), and a floor from the chip's published facts: the largest of the layer's FLOPs
over peak bfloat16 FLOP/s, its HBM bytes over HBM bandwidth, and the collective bytes over the interconnect
bandwidth. All of it is estimates, none of it a time: the floor assumes balanced routing and every unit busy
at once; the compiler's estimate is its own model. The recommendation is the strategy that fits with the
lowest floor (ties within `TIE` go to the lower compiler estimate), with the reason.

The layer's work per chip, balanced routing: each chip's experts get `tokens x top_k` rows (entries); the
three projections take 2 x rows x hidden x intermediate/TP FLOPs each; HBM traffic is the local weights read
once plus the rows read and written by each projection and the tokens in and out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from moe_tune.core.chips import Slice, get_slice
from moe_tune.core.errors import UsageError
from moe_tune.layer.models import ModelPreset, get_preset
from moe_tune.targets import collectives, wheels
from moe_tune.targets.compile import REJECTED
from moe_tune.targets.jobs import crash_line
from moe_tune.targets.slice_compile import LAYER, SliceCompile, SliceJob
from moe_tune.workers import WorkerFailure, WorkerPool

# The ways a plan compiles the layer: the two ep_strategy names (all_to_all over the platform's ragged all-to-all)
# and all_to_all over the fixed-capacity exchange, what runs where the chip's compiler refuses the ragged one
# (libtpu on v5e:8x8: "Ragged all-to-all is currently not supported in limited ICI routing settings").
FIXED_ALL_TO_ALL = "all_to_all:fixed"
# in_kernel moves the rows by remote DMA inside Pallas TPU kernels: TPU slices only (`strategies_for`)
IN_KERNEL = "in_kernel"
STRATEGIES = ("all_gather", "all_to_all", FIXED_ALL_TO_ALL, IN_KERNEL)
# the kernels' backends a plan compiles with (`SliceJob.backend`)
BACKENDS = (None, "xla", "sparsecore")
TIE = 0.05  # floors within 5% of each other are a tie
_ESTIMATE_NOTE = ("estimates, not times: the floor is the slowest of compute, HBM and interconnect at their "
                  "published peaks with balanced routing; the compiler's estimate is its own cost model")


@dataclasses.dataclass(frozen=True)
class Work:
    """One chip's share of the layer: FLOPs and HBM bytes (the module docstring's model); `dma_bytes`: what
    the `in_kernel` strategy's kernels send to other chips (the routed rows there and back, balanced routing),
    which no XLA collective of its program shows."""

    flops: float
    hbm_bytes: float
    dma_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class StrategyPlan:
    """One strategy on the slice: the compile's outcome and what it says (see the module docstring)."""

    strategy: str
    compiled: SliceCompile
    fits: bool | None  # None: not compiled
    chip_bytes: int
    collective_bytes: int  # bytes one chip sends, all collectives together
    collectives: dict[str, dict[str, int]]
    floor_s: float | None
    bound: str  # which term sets the floor: compute, hbm, interconnect
    compiler_estimate_s: float | None  # the compiler's optimal_seconds; None where it gives none or one <= 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compiled"] = self.compiled.to_dict()
        return d


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    model: str
    tokens: int
    slice: str
    chip: str
    chips: int
    expert: int
    tensor: int
    dtype: str
    capacity_factor: float | None
    work: Work
    facts: dict[str, Any]
    strategies: list[StrategyPlan]
    recommended: str | None
    reason: str
    note: str = _ESTIMATE_NOTE

    @property
    def fits_any(self) -> bool:
        return any(s.fits for s in self.strategies)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["strategies"] = [s.to_dict() for s in self.strategies]
        return d


def ep_strategy_argument(way: str) -> str:
    """How a user passes `way` (one of `STRATEGIES`) to `moe_mlp` / `sharded_moe_mlp` as `ep_strategy`."""
    if way == FIXED_ALL_TO_ALL:
        return "ShardingConfig(strategy='all_to_all', exchange='fixed') (moe_tune.layer.sharding_choice)"
    return repr(way)


def mesh_shape(preset: ModelPreset, piece: Slice, tensor: int | None = None) -> tuple[int, int]:
    """(expert, tensor) sizes for the preset on the slice: `tensor` given, or 1 when the experts split evenly
    over every chip, else the largest expert axis that divides both the experts and the chips. One-line
    UsageError for a shape the layer cannot take."""
    chips = piece.chips
    if tensor is None:
        expert = math.gcd(preset.experts, chips)
        tensor = chips // expert
    if tensor < 1 or chips % tensor:
        raise UsageError(f"--tensor {tensor} does not divide the {chips} chips of {piece.name}")
    expert = chips // tensor
    if preset.experts % expert:
        raise UsageError(f"{preset.name}'s {preset.experts} experts do not split over an expert axis of {expert} "
                         f"({piece.name} with --tensor {tensor})")
    if preset.expert_intermediate % tensor:
        raise UsageError(f"{preset.name}'s expert intermediate {preset.expert_intermediate} does not split over a "
                         f"tensor axis of {tensor}")
    return expert, tensor


def layer_work(preset: ModelPreset, tokens: int, expert: int, tensor: int, dtype_bytes: int) -> Work:
    """One chip's FLOPs and HBM bytes for the layer's forward pass (the module docstring's model)."""
    rows = tokens * preset.top_k
    d, f = preset.hidden, preset.expert_intermediate // tensor
    weights = 3 * (preset.experts // expert) * d * f * dtype_bytes
    activations = rows * (2 * d + 3 * f) * dtype_bytes + 2 * tokens * d * dtype_bytes
    remote = rows * (expert - 1) / expert  # the entries whose experts live on another chip
    return Work(flops=6.0 * rows * d * f, hbm_bytes=float(weights + activations),
                dma_bytes=2.0 * remote * d * dtype_bytes)


def strategies_for(piece: Slice) -> tuple[str, ...]:
    """The ways a plan compiles by default on the slice: every one of `STRATEGIES` its chip runs (in_kernel on
    TPU only)."""
    return tuple(s for s in STRATEGIES if s != IN_KERNEL or piece.chip.platform == "tpu")


def floor(work: Work, sent_bytes: int, piece: Slice) -> tuple[float, str]:
    """(seconds, bound): the largest of compute, HBM and interconnect time at the chip's published peaks
    (a chip sends at half its bidirectional interconnect bandwidth)."""
    facts = piece.facts
    terms = {"compute": work.flops / facts.peak_bf16_flops, "hbm": work.hbm_bytes / facts.hbm_bandwidth,
             "interconnect": sent_bytes / (facts.interconnect_bandwidth / 2)}
    bound = max(terms, key=terms.get)
    return terms[bound], bound


def strategy_plan(strategy: str, compiled: SliceCompile, work: Work, piece: Slice) -> StrategyPlan:
    """What one strategy's compile says on the slice. A program the compiler refused for HBM does not fit
    (its chip_bytes: what the compiler said it needed, at the least); another refusal leaves `fits` None."""
    if not compiled.ok:
        fits = False if compiled.out_of_memory else None
        return StrategyPlan(strategy, compiled, fits, compiled.required_bytes, 0, {}, None, "", None)
    found = [collectives.Collective(**c) for c in compiled.collectives]
    # in_kernel's rows travel by DMA inside its kernels: counted as sent, though no collective shows them
    sent = sum(c.sent_bytes for c in found) + (int(work.dma_bytes) if strategy == IN_KERNEL else 0)
    seconds, bound = floor(work, sent, piece)
    estimate = compiled.cost.get("optimal_seconds")
    return StrategyPlan(strategy, compiled, compiled.chip_bytes <= piece.facts.hbm_bytes, compiled.chip_bytes, sent,
                        collectives.summary(found), seconds, bound,
                        estimate if estimate is not None and estimate > 0 else None)


def recommend(plans: Sequence[StrategyPlan], piece: Slice, capacity_factor: float | None = None
              ) -> tuple[str | None, str]:
    """(the strategy to run, why), or (None, why none)."""
    hbm_gb = piece.facts.hbm_bytes / 1e9
    fitting = [p for p in plans if p.fits]
    unfit = [p for p in plans if p.fits is False]
    if not fitting and not unfit:
        return None, "no strategy compiled for " + piece.name + ": " + "; ".join(
            f"{p.strategy}: {p.compiled.message}" for p in plans)
    if not fitting:
        sized = [p for p in unfit if p.chip_bytes]  # the compiler named what it needed
        least = min(sized or unfit, key=lambda p: p.chip_bytes)
        needs = (f"{least.chip_bytes / 1e9:.1f} GB per chip at the least" if sized else
                 f"more than the chip's HBM ({least.compiled.message})")
        return None, (f"does not fit: the layer alone needs {needs} ({least.strategy}), {piece.name} has "
                      f"{hbm_gb:.1f} GB per chip{_capacity_hint(unfit, capacity_factor)}")
    best = min(fitting, key=lambda p: p.floor_s)
    ties = [p for p in fitting if p.floor_s <= best.floor_s * (1 + TIE)]
    if len(ties) > 1:
        best, why = _tie_break(ties)
        reason = f"floors within {TIE:.0%} ({best.floor_s * 1e3:.3g} ms, {best.bound}-bound); {why}"
    else:
        reason = (f"lowest floor, {best.floor_s * 1e3:.3g} ms ({best.bound}-bound, "
                  f"{best.collective_bytes / 1e9:.3g} GB sent per chip)")
        rest = [p for p in fitting if p is not best]
        if rest:
            reason += "; " + ", ".join(f"{p.strategy} {p.floor_s * 1e3:.3g} ms ({p.bound}-bound, "
                                       f"{p.collective_bytes / 1e9:.3g} GB sent)" for p in rest)
    for p in plans:
        if p.fits is False:
            least = "at least " if p.compiled.out_of_memory else ""
            reason += (f"; {p.strategy} does not fit ({least}{p.chip_bytes / 1e9:.1f} GB per chip)"
                       f"{_capacity_hint([p], capacity_factor)}")
        elif p.fits is None:
            reason += f"; {p.strategy} did not compile ({p.compiled.message})"
    return best.strategy, reason


def _tie_break(ties: Sequence[StrategyPlan]) -> tuple[StrategyPlan, str]:
    """Among strategies whose floors tie: the lower compiler estimate where every one has one, else the one
    that sends clearly fewer collective bytes (by more than TIE), else the one that holds fewer bytes."""
    if all(p.compiler_estimate_s is not None for p in ties):
        best = min(ties, key=lambda p: p.compiler_estimate_s)
        others = ", ".join(f"{p.strategy} {p.compiler_estimate_s * 1e3:.3g} ms" for p in ties if p is not best)
        return best, f"the compiler estimates {best.compiler_estimate_s * 1e3:.3g} ms against {others}"
    least = min(ties, key=lambda p: p.collective_bytes)
    if all(p is least or p.collective_bytes > least.collective_bytes * (1 + TIE) for p in ties):
        others = ", ".join(f"{p.strategy} {p.collective_bytes / 1e9:.3g} GB" for p in ties if p is not least)
        return least, f"it sends the fewest bytes, {least.collective_bytes / 1e9:.3g} GB per chip against {others}"
    least = min(ties, key=lambda p: p.chip_bytes)
    others = ", ".join(f"{p.strategy} {p.chip_bytes / 1e9:.3g} GB" for p in ties if p is not least)
    return least, (f"they send alike; it holds the fewest bytes, {least.chip_bytes / 1e9:.3g} GB per chip "
                   f"against {others}")


def _capacity_hint(unfit: Sequence[StrategyPlan], capacity_factor: float | None) -> str:
    """A note for a layer that does not fit without a capacity factor: nothing dropped, its buffers are sized
    for the worst case (every entry to one chip)."""
    if capacity_factor is None and unfit:
        return " (without --capacity-factor the layer sizes its buffers for the worst case)"
    return ""


class PlanPool:
    """Compile workers for slice plans (the `moe_tune.workers` pool with the compile-only wheels on its path;
    one GPU chip per worker, as `jobs.CompilePool`). A context manager; reuse one for many plans."""

    def __init__(self, workers: int = 2, timeout: float | None = 600.0) -> None:
        self.timeout = timeout
        self._pool = WorkerPool(workers, env=wheels.worker_env)

    def __enter__(self) -> PlanPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, jobs: Sequence[SliceJob]) -> list[SliceCompile]:
        for platform in sorted({get_slice(j.slice).chip.platform for j in jobs}):
            wheels.require(platform)
        results: list[SliceCompile | None] = [None] * len(jobs)

        def arrived(index: int, status: str, value: Any) -> None:
            results[index] = SliceCompile.from_dict(value) if status == "ok" else _failed(value)

        def affinity(index: int) -> str | None:
            chip = get_slice(jobs[index].slice).chip
            return chip.name if chip.platform == "gpu" else None

        self._pool.map("moe_tune.targets.slice_compile:compile_program", [(i, (j,)) for i, j in enumerate(jobs)],
                       arrived, timeout=self.timeout, affinity=affinity)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.close()


def _failed(failure: WorkerFailure) -> SliceCompile:
    if not failure.started:
        raise RuntimeError(f"a compile worker did not start: {crash_line(failure.output) or 'no message'}")
    if failure.kind == "error":
        return SliceCompile(REJECTED, failure.message[:300])
    said = f"timed out after {failure.timeout:.0f} s" if failure.kind == "timeout" else crash_line(failure.output)
    return SliceCompile(REJECTED, f"the compiling process died: {said}".rstrip(": "))


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One plan to make: a preset's name (or a preset), tokens per expert-axis shard, a slice, the strategies
    and the layer's options (`plan`'s arguments)."""

    model: str | ModelPreset
    tokens: int
    slice: str
    strategies: Sequence[str] | None = None  # None: `strategies_for` the slice
    dtype: str = "bfloat16"
    tensor: int | None = None
    capacity_factor: float | None = None
    backend: str | None = None


def _prepared(request: PlanRequest) -> tuple[Slice, ModelPreset, int, int, Work, list[SliceJob], Sequence[str]]:
    """The request checked (one-line UsageErrors), its mesh, its work per chip, its compile jobs and its
    strategies."""
    import numpy as np

    piece = get_slice(request.slice)
    preset = request.model if isinstance(request.model, ModelPreset) else get_preset(request.model)
    if request.strategies is None:
        request = dataclasses.replace(request, strategies=strategies_for(piece))
    unknown = [s for s in request.strategies if s not in STRATEGIES]
    if unknown or not request.strategies:
        raise UsageError(f"unknown strategy {unknown[0] if unknown else ''!r}; known: {', '.join(STRATEGIES)}")
    if request.tokens < 1:
        raise UsageError(f"--tokens must be at least 1, not {request.tokens}")
    if request.backend not in BACKENDS:
        raise UsageError(f"unknown backend {request.backend!r}; known: {', '.join(b for b in BACKENDS if b)}")
    expert, tensor = mesh_shape(preset, piece, request.tensor)
    dtype_bytes = 2 if request.dtype == "bfloat16" else np.dtype(request.dtype).itemsize
    work = layer_work(preset, request.tokens, expert, tensor, dtype_bytes)
    jobs = [SliceJob(piece.name, preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k,
                     request.tokens, expert, tensor, request.dtype, LAYER, s, request.capacity_factor,
                     request.backend) for s in request.strategies]
    return piece, preset, expert, tensor, work, jobs, request.strategies


def plans(requests: Sequence[PlanRequest], pool: PlanPool | None = None) -> list[SlicePlan]:
    """The plans of `requests`, every compile of them at once in `pool` (else in compile workers started for
    them): each strategy of each request one compile."""
    prepared = [_prepared(r) for r in requests]  # every mistake refused before a worker starts
    own = pool is None
    pool = pool or PlanPool()
    try:
        compiled = pool.compile([job for *_, jobs, _ in prepared for job in jobs])
    finally:
        if own:
            pool.close()
    found, at = [], 0
    for request, (piece, preset, expert, tensor, work, jobs, ways) in zip(requests, prepared):
        mine, at = compiled[at:at + len(jobs)], at + len(jobs)
        strategy_plans = [strategy_plan(s, c, work, piece) for s, c in zip(ways, mine)]
        recommended, reason = recommend(strategy_plans, piece, request.capacity_factor)
        found.append(SlicePlan(preset.name, request.tokens, piece.name, piece.target, piece.chips, expert, tensor,
                               request.dtype, request.capacity_factor, work, dataclasses.asdict(piece.facts),
                               strategy_plans, recommended, reason))
    return found


def plan(model: str | ModelPreset, tokens: int, slice_name: str, *, strategies: Sequence[str] | None = None,
         dtype: str = "bfloat16", tensor: int | None = None, capacity_factor: float | None = None,
         backend: str | None = None, pool: PlanPool | None = None) -> SlicePlan:
    """The plan of `model`'s layer (a preset's name, or a preset) at `tokens` per expert-axis shard on the
    slice: one compile per strategy (None: `strategies_for` the slice), in `pool` (else in compile workers
    started for this plan)."""
    request = PlanRequest(model, tokens, slice_name, None if strategies is None else tuple(strategies), dtype, tensor,
                          capacity_factor, backend)
    return plans([request], pool)[0]
