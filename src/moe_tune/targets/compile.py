"""Compile one traced call for a target chip with its real compiler, on a machine without the chip.

Runs in a process that can see the compile-only wheels (`wheels.worker_env`; `jobs.CompilePool` starts such
processes): `get_topology_desc` gives compile-only devices of the target, the call's abstract arguments are
committed to one of them, and `jax.jit(fn).lower(...).compile()` runs Mosaic TPU / Triton / XLA to the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
from collections.abc import Callable
from typing import Any

from moe_tune.core import devices
from moe_tune.core.chips import Target
from moe_tune.targets.gpu_config import target_config_text

OK, REJECTED, CRASHED, ERROR = "ok", "rejected", "crashed", "error"
MESSAGE_CHARS = 300
# memory_analysis() fields worth keeping (bytes)
_MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                  "generated_code_size_in_bytes")


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """How one call fared with a target's compiler.

    status: `ok`; `rejected` (the lowering or the compiler raised: `message` is its first meaningful line;
    `stage` says which of `lower` / `compile`); `crashed` (the compiling process died, e.g. an LLVM fatal
    error: `message` is the last meaningful line it printed); `error` (tracing the call raised something no
    compiler did: a bug of the call, not a verdict on the config). compile_s: seconds of lower + compile.
    memory: `memory_analysis()` byte counts of a compiled call (temp, argument, output, generated code).
    """

    target: str
    status: str
    message: str = ""
    stage: str = ""
    compile_s: float = 0.0
    memory: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CompileResult":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def first_line(message: str) -> str:
    """The compiler's message cut to what names the problem: its first non-empty line (joined with the next
    when it ends with a colon, as `RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:` does), without the
    HLO text that follows ` for %`, at most MESSAGE_CHARS characters."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    text = re.split(r" for %| = \w+\[", text)[0]
    return text[:MESSAGE_CHARS]


@functools.cache
def topology_device(target: Target) -> Any:
    """One compile-only device of the target (topologies are built once per process)."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        topology = topologies.get_topology_desc(target.topology, "tpu")
    else:
        topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                                target_config=target_config_text(target))
    return topology.devices[0]


def acting_as(target: Target) -> contextlib.AbstractContextManager[devices.Device]:
    """Inside, moe-tune judges every rule for the target chip (`devices.judging`): kernels traced take their
    compiled path and the backends' rules (`config_error`, `search_space`) prune with the chip's budgets."""
    return devices.judging(devices.Device(target.platform, target.device_kind))


def _memory(compiled: Any) -> dict[str, int]:
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it; the compile itself succeeded
        return {}
    if analysis is None:
        return {}
    return {name: int(getattr(analysis, name)) for name in _MEMORY_FIELDS if hasattr(analysis, name)}


def compile_call(target: Target, fn: Callable[[Any], Any], make_args: Callable[[Any], Any]) -> CompileResult:
    """Lower and compile `fn(make_args(device))` for `target`. Whatever the compiler raises, and what the
    lowering raises as a verdict on the kernel, is a `rejected` result; any other exception (a bug in the
    call) propagates."""
    import jax

    device = topology_device(target)
    args = make_args(device)
    start = time.perf_counter()
    stage = "lower"
    # A SparseCore kernel reads its chip from the default device (`pltpu.get_tpu_info`): the target's, here.
    default = jax.default_device(device) if target.platform == "tpu" else contextlib.nullcontext()
    try:
        with acting_as(target), default:
            lowered = jax.jit(fn).lower(args)
            stage = "compile"
            compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - sorted below: the chip's verdict, or a bug of the call
        if stage == "lower" and not _is_lowering_verdict(e):
            raise
        return CompileResult(target.name, REJECTED, first_line(f"{type(e).__name__}: {e}"), stage,
                             time.perf_counter() - start)
    return CompileResult(target.name, OK, "", "", time.perf_counter() - start, _memory(compiled))


def _is_lowering_verdict(error: Exception) -> bool:
    """Whether an error raised while lowering is the chip's lowering rejecting the kernel (Pallas' Mosaic /
    Triton rules raise ValueError or NotImplementedError, Mosaic's verifier a MosaicError, XLA a
    JaxRuntimeError) rather than a bug of the call (a TypeError, an AttributeError...)."""
    import jax

    return (isinstance(error, (ValueError, NotImplementedError, jax.errors.JaxRuntimeError))
            or "Mosaic" in type(error).__name__)
