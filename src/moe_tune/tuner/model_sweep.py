"""Sweep every tunable kernel of one model preset's MoE layer: for each token count, every op and direction
`models.kernel_problems` lists (ragged_dot gate/up and down in fwd, dlhs, drhs; dispatch; combine), each
with the platform's default backend for that op. One failing case is recorded and the others go on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from moe_tune import devices
from moe_tune.errors import MoeTuneError
from moe_tune.kernels import get_op
from moe_tune.models import KernelCase, ModelPreset, layer_cases
from moe_tune.profiles import dirs
from moe_tune.tuner import record
from moe_tune.tuner.spec import SweepResult, SweepSpec
from moe_tune.tuner.sweep import run_sweep


@dataclasses.dataclass
class CaseResult:
    """One kernel case of a model sweep: the sweep's result, or why it could not run."""

    tokens: int
    case: KernelCase
    result: SweepResult | None = None
    error: str | None = None


def model_cases(preset: ModelPreset, tokens: Iterable[int], *, ep: int, dtype: str,
                quant: Mapping[str, Any] | None = None) -> list[tuple[int, KernelCase]]:
    """(tokens, case) for every token count, in order; validates every count before anything runs. `quant`:
    the ragged_dot quantization options (`models.kernel_problems`)."""
    return layer_cases(preset, list(tokens), ep=ep, dtype=dtype, quant=quant)


def preflight(preset: ModelPreset, tokens: Iterable[int], *, ep: int, dtype: str,
              sweep_options: dict[str, Any] | None = None,
              quant: Mapping[str, Any] | None = None) -> list[tuple[int, KernelCase]]:
    """The cases of a model sweep, once every token count and the ep are checked and the profile dir can be
    written (one error for a bad dir, not one failed case per kernel)."""
    cases = model_cases(preset, tokens, ep=ep, dtype=dtype, quant=quant)
    record.writable_dir(dirs.write_dir((sweep_options or {}).get("profile_dir")))
    return cases


def sweep_model(
    preset: ModelPreset,
    tokens: Iterable[int],
    *,
    ep: int = 1,
    dtype: str = "bfloat16",
    sweep_options: dict[str, Any] | None = None,
    on_case: Callable[[int, KernelCase, int, int], Any] | None = None,
    reporter_for: Callable[[int, KernelCase], Any] | None = None,
    quant: Mapping[str, Any] | None = None,
) -> list[CaseResult]:
    """Run one sweep per (token count, kernel case) with `SweepSpec(op, problem, **sweep_options)`.

    `on_case(tokens, case, i, total)` is called before each sweep (the CLI prints a heading) and
    `reporter_for(tokens, case)` may supply its progress reporter; `quant` quantizes the layer's ragged_dot
    kernels (`models.kernel_problems`). A case whose sweep fails (no valid
    candidate, a backend that cannot run here) is recorded with its error and the next one runs; a
    KeyboardInterrupt stops the whole run. A case whose (op, problem) an earlier case already swept gets
    that result without a second sweep."""
    cases = preflight(preset, tokens, ep=ep, dtype=dtype, sweep_options=sweep_options, quant=quant)
    results: list[CaseResult] = []
    swept: dict[tuple[str, Any], CaseResult] = {}  # a layer can repeat a kernel (gpt-oss: gate/up == down)
    for i, (count, case) in enumerate(cases):
        if on_case is not None:
            on_case(count, case, i, len(cases))
        same = swept.get((case.op, case.problem))
        if same is not None:
            results.append(dataclasses.replace(same, tokens=count, case=case))
            continue
        try:
            backend = get_op(case.op).backends.default_for(devices.platform()).name
            spec = SweepSpec(case.op, case.problem, **{"backend": backend, **(sweep_options or {})})
            reporter = reporter_for(count, case) if reporter_for is not None else None
            results.append(CaseResult(count, case, result=run_sweep(spec, reporter)))
        except MoeTuneError as e:
            results.append(CaseResult(count, case, error=str(e)))
        except Exception as e:  # noqa: BLE001 - a kernel or runtime failure ends this case, not the whole run
            results.append(CaseResult(count, case, error=f"{type(e).__name__}: {e}"))
        swept[(case.op, case.problem)] = results[-1]
    return results
