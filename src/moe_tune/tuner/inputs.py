"""A sweep's inputs, their float64 reference, the device copy and the host views of it that the compile workers
get, made on a background thread while the first candidates compile.

Compiling a candidate needs only the inputs' shapes; its first run (the check) needs the inputs and the
reference. The shapes come from `targets.calls.abstract_inputs` (what the compile-only targets compile for)
for the ops it describes, so the seeded inputs too are made on the thread (the op's RNG: 0.25 s of a 1.3 s
warm sweep at the `strategies_cpu.py` shape), and checked against those shapes there (a mismatch is a bug,
raised where the inputs are needed); for other ops the inputs are made here first. A compile worker asks for
the payload once it has compiled (`shared_payload.Deferred`).

The float64 reference runs on one BLAS thread (`threadpoolctl`): the compile workers hold the cores, and
OpenBLAS's threads wait for each other when another process keeps a core busy. Beside such load the
`strategies_cpu.py` shape's reference took a median 0.42 s (m=256) and 0.88 s (m=2048) on 2 threads, 0.07 and
0.21 s on one; alone 2 threads are faster (results/warm_phases_cpu_2core_2026-11-26_session17_C.txt,
`benchmarks/reference_threads_cpu.py`). That most likely was session 16's unexplained 1.2-1.3 s "inputs and
reference" phase in warm sweeps at m=256: the phase follows the other cores' load, not warm or cold.

On CPU the host arrays the op made are dropped once the device copy exists: `host` is a view of that copy
(there `np.asarray` of a device array does not copy), so a sweep holds its inputs once, not twice (at deepseek-v2-lite
prefill they are 2.1-2.3 GiB; NOTES.md, issue 32, session 17 (C)).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import jax
import numpy as np
from threadpoolctl import threadpool_limits

from moe_tune.core import devices
from moe_tune.tuner.gate import Reference
from moe_tune.targets.calls import DESCRIBED_OPS, abstract_inputs
from moe_tune.tuner.shared_inputs import shared_inputs


class SweepInputs:
    """The inputs of one sweep (a pytree of arrays), their shapes at once and the rest when ready.

    `shapes`: ShapeDtypeStructs of the inputs. `device`, `host`, `reference` wait for the background thread
    (and raise what it raised). `token` names (inputs, reference) for the compile workers, `payload()` is
    what they get: (host inputs, `gate.Reference`)."""

    def __init__(self, shapes: Any, token: str) -> None:
        self.shapes = shapes
        self.token = token
        self._ready = threading.Event()
        self._payload_ready = threading.Event()  # before the device copy: the workers do not need it
        self._payload: tuple[Any, Reference] | None = None
        self._device: Any = None
        self._host: Any = None
        self._reference: Reference | None = None
        self._error: BaseException | None = None

    @classmethod
    def prepare(cls, op: Any, problem: Any, distribution: str, seed: int) -> SweepInputs:
        """`op.make_inputs(problem, distribution, seed)`, its reference and device copy on a thread (the
        inputs here first when their shapes cannot be known without them)."""
        abstract = _shapes(abstract_inputs(op.name, problem)) if getattr(op, "name", None) in DESCRIBED_OPS else None
        host = op.make_inputs(problem, distribution, seed) if abstract is None else None
        made = cls(_shapes(host) if abstract is None else abstract, uuid.uuid4().hex)

        def finish() -> None:
            nonlocal host
            try:
                if host is None:
                    host = op.make_inputs(problem, distribution, seed)
                    if _shapes(host) != made.shapes:
                        raise RuntimeError(f"moe-tune bug: {op.name}'s inputs {_shapes(host)} are not the shapes "
                                           f"targets/calls.py gives ({made.shapes})")
                with threadpool_limits(limits=1, user_api="blas"):
                    reference = Reference.of(op.reference(problem, host))
                made._payload = (host, reference)
                made._payload_ready.set()
                device = jax.block_until_ready(jax.device_put(host))
                made._set(device, reference, None if devices.platform() == "cpu" else host)
            except BaseException as e:  # noqa: BLE001 - raised where the inputs are needed
                made._error = e
            finally:
                made._payload_ready.set()
                made._ready.set()

        threading.Thread(target=finish, name="moe_tune sweep inputs", daemon=True).start()
        return made

    @classmethod
    def given(cls, inputs: Any, reference: Reference) -> SweepInputs:
        """Inputs already on the device and their reference (the same token for the same arrays and
        reference: a worker gets them once however many calls pass them)."""
        token, host = shared_inputs(inputs)
        made = cls(_shapes(inputs), f"{token}.{reference.token}")
        made._set(inputs, reference, host)
        made._payload_ready.set()
        made._ready.set()
        return made

    def _set(self, device: Any, reference: Reference, host: Any = None) -> None:
        """`host` None: views of the device copy (on CPU `np.asarray` does not copy; elsewhere it would)."""
        self._device, self._reference = device, reference
        self._host = jax.tree.map(np.asarray, device) if host is None else host
        self._payload = (self._host, reference)  # the arrays the op made are dropped (`prepare`)

    def ready(self) -> bool:
        """Whether the reference and the device copy are made (`device` and the others will not wait)."""
        return self._ready.is_set()

    def payload_ready(self) -> bool:
        """Whether `payload` will not wait (the reference is made; the device copy may not be yet)."""
        return self._payload_ready.is_set()

    def failed(self) -> bool:
        """Whether making them raised (`wait` raises it)."""
        return self._error is not None

    def wait(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def device(self) -> Any:
        self.wait()
        return self._device

    @property
    def host(self) -> Any:
        self.wait()
        return self._host

    @property
    def reference(self) -> Reference:
        self.wait()
        return self._reference

    def payload(self) -> tuple[Any, Reference]:
        """What a compile worker gets (waits for the reference, not for the device copy): (host inputs,
        reference)."""
        self._payload_ready.wait()
        if self._payload is None:
            self.wait()  # raises what making them raised
        return self._payload


def _shapes(inputs: Any) -> Any:
    """ShapeDtypeStructs of host or device arrays, the dtype as the device copy has it (int64 is int32
    there unless x64 is on)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype)), inputs)
