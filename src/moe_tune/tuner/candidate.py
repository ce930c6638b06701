"""One candidate of a sweep and the correctness gate it passes before its time counts.

A `Candidate` is one config of the backend, its index (its jitted function is named `moe_tune_cand_<index>`
so that its program can be found in the profiler trace) and what happened to it: status (`OK`, `WRONG`,
`FAILED`), where and why it failed, its relative error, compiles and timings. `Reference` is the sweep's
float64 reference output with its scale; `check_all` judges candidates against it: a candidate whose output is
off the reference is wrong, and a wrong candidate never wins.

`SweepInputs` makes the inputs, their device copy and the reference on a background thread while the first
candidates compile (compiling needs only the shapes, from the op's abstract inputs; the first run needs the
arrays). The reference runs on one BLAS thread: the compile workers hold the cores, and OpenBLAS threads wait
for each other beside such load (FINDINGS.md: warm start). On CPU the host arrays are views of
the device copy, so a sweep holds its inputs once.

The payload many worker requests share (inputs and reference) is pickled once (protocol 5) into one file in
shared memory (/dev/shm, else the temp dir); workers map it and read the arrays as read-only views without a
copy. A payload still being made is a `workers.pool.Deferred`, written when a worker first asks for it. Files of
processes that no longer run are removed the next time one is stored. `shared_inputs` gives arrays passed to
`compile_all` directly the same token-once treatment.
"""

from __future__ import annotations

import dataclasses
import glob
import mmap
import os
import pickle
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from threadpoolctl import threadpool_limits

from moe_tune.core import devices
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.kernel_op import error_scale, relative_error
from moe_tune.tuner.timing import Timing

OK, WRONG, FAILED = "ok", "wrong", "failed"


@dataclasses.dataclass
class Candidate:
    index: int
    config: KernelConfig
    is_default: bool = False
    status: str = OK
    stage: str = ""  # where it failed: "compile", "run", "check"
    reason: str = ""
    error: float | None = None  # relative error vs the reference
    executable: Any = dataclasses.field(default=None, repr=False)
    worker_error: float | None = None  # its run in a worker, compared with the reference there (`gate`)
    compile_s: float | None = None
    compiles: int = 0  # XLA compilations spent on this candidate, wherever they ran
    timing: Timing | None = None
    first_timing: Timing | None = None  # a finalist's sweep-round timing, before the final round replaced it
    # the timing batch whose rounds its samples are, one per round (numbered across the runs of one sweep, so
    # a candidate restored from the log keeps its): candidates of one batch with as many samples are paired
    # round by round (`same_rounds`); None: not timed in a batch
    batch: int | None = None

    def fail(self, stage: str, reason: str) -> None:
        """Record a failure (or a wrong output, stage "check")."""
        self.status = WRONG if stage == "check" else FAILED
        self.stage, self.reason = stage, reason

    def record(self) -> dict[str, Any]:
        """JSON-ready summary (what tables keep)."""
        out: dict[str, Any] = {"config": self.config.to_dict(), "status": self.status}
        if self.is_default:
            out["is_default"] = True
        if self.reason:
            out["stage"], out["reason"] = self.stage, self.reason
        if self.error is not None:
            out["error"] = self.error
        sweep_round = self.sweep_round_timing  # every candidate's from one kind of round: comparable
        if sweep_round is not None:
            out.update(median_s=sweep_round.median_s, spread=sweep_round.spread, min_s=sweep_round.min_s,
                       max_s=sweep_round.max_s)
        return out

    @property
    def sweep_round_timing(self) -> Timing | None:
        """The timing of the round every candidate ran (a finalist's before the final round replaced it)."""
        return self.first_timing or self.timing

    def finalist_record(self) -> dict[str, Any]:
        """A finalist as the entry's verdict records it: its final-round and sweep-round timing."""
        first, final = self.sweep_round_timing, self.timing
        return {"config": self.config.to_dict(), "is_default": self.is_default, "median_s": final.median_s,
                "spread": final.spread, "min_s": final.min_s, "max_s": final.max_s, "samples": final.samples,
                "first_median_s": first.median_s, "first_spread": first.spread}


def same_rounds(cands: list[Candidate] | tuple[Candidate, ...]) -> bool:
    """Whether `cands` were timed in the same rounds, one sample each per round: all in one timing batch of
    this process with as many samples each (a batch stops timing a candidate for good, so k samples are its
    first k rounds), by the same clock."""
    timed = [c.timing for c in cands if c.batch is not None and c.timing is not None]
    return len(timed) == len(cands) > 0 and len({c.batch for c in cands}) == 1 and len(
        {(t.samples, len(t.samples_s), t.method) for t in timed}) == 1


def short(exc: BaseException) -> str:
    """One line: the exception type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def failure_reason(exc: BaseException) -> str:
    """The recorded reason for an exception, flagged as out of memory when it is one."""
    if isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in str(exc):
        return f"out of memory: {short(exc)}"
    return short(exc)


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
    """The reference output of a sweep (any shape; float64 on the host for the ops here) and its max |value|,
    computed once: every candidate's output is compared with it (`error`), in this process or in a compile
    worker, which gets it once per sweep with the inputs (`token` names it there)."""

    expected: np.ndarray
    scale: float
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def of(cls, expected: np.ndarray) -> Reference:
        return cls(expected, error_scale(expected))

    def error(self, out: np.ndarray) -> float:
        """`kernel_op.relative_error` of `out` against the reference (inf for NaN/inf or another shape)."""
        return relative_error(out, self.expected, self.scale)


def check_all(
    candidates: Sequence[Candidate],
    inputs: Mapping[str, jax.Array],
    reference: Reference,
    tolerance: float | Callable[[KernelConfig], float],
    on_done: Callable[[Candidate], None] | None = None,
) -> None:
    """Mark candidates off the reference as wrong: a relative error above `tolerance` (one number, or the
    op's per config: `KernelOp.tolerance(problem, config)`). A candidate that ran in a compile worker (see
    `compiling.compile_all`) is judged by the relative error computed there; one compiled in this process is
    run once here (also its warm-up)."""
    for cand in candidates:
        if cand.status != OK:
            continue
        allowed = tolerance(cand.config) if callable(tolerance) else tolerance
        out, error = None, cand.worker_error
        try:
            if error is not None:
                cand.worker_error = None
            else:
                out = np.asarray(jax.block_until_ready(cand.executable(inputs)))
        except Exception as e:  # noqa: BLE001
            cand.fail("run", failure_reason(e))
        else:
            cand.error = error if out is None else reference.error(out)
            if not cand.error <= allowed:
                cand.fail("check", f"relative error {cand.error:.3g} > tolerance {allowed:.3g}")
        if on_done is not None:
            on_done(cand)


_sent: tuple[Any, list[weakref.ref], str, Any] | None = None  # (treedef, leaves, token, host inputs)


def shared_inputs(inputs: Any) -> tuple[str, Any]:
    """(token, host copy) of `inputs` (a pytree of arrays)."""
    global _sent
    leaves, treedef = jax.tree.flatten(inputs)
    if (_sent is not None and _sent[0] == treedef and len(_sent[1]) == len(leaves)
            and all(ref() is leaf for ref, leaf in zip(_sent[1], leaves))):
        return _sent[2], _sent[3]
    token, host = uuid.uuid4().hex, jax.tree.map(np.asarray, inputs)
    try:
        refs = [weakref.ref(leaf) for leaf in leaves]
    except TypeError:  # a leaf that cannot be referenced weakly (a Python scalar): no reuse across calls
        return token, host
    _sent = (treedef, refs, token, host)
    if leaves:
        weakref.finalize(leaves[0], _forget, token)
    return token, host


def _forget(token: str) -> None:
    global _sent
    if _sent is not None and _sent[2] == token:
        _sent = None


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
        abstract = abstract_inputs(op, problem)
        abstract = None if abstract is None else _shapes(abstract)
        host = op.make_inputs(problem, distribution, seed) if abstract is None else None
        made = cls(_shapes(host) if abstract is None else abstract, uuid.uuid4().hex)

        def finish() -> None:
            nonlocal host
            try:
                if host is None:
                    host = op.make_inputs(problem, distribution, seed)
                    if _shapes(host) != made.shapes:
                        raise RuntimeError(f"moe-tune bug: {op.name}'s inputs {_shapes(host)} are not the shapes "
                                           f"its input_shapes give ({made.shapes})")
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


def abstract_inputs(op: Any, problem: Any) -> Any:
    """The op's inputs as shapes before they are made (`KernelOp.abstract_inputs`), None for an op that knows
    them only once made (`has_input_shapes`)."""
    return op.abstract_inputs(problem) if getattr(op, "has_input_shapes", False) else None


def _shapes(inputs: Any) -> Any:
    """ShapeDtypeStructs of host or device arrays, the dtype as the device copy has it (int64 is int32
    there unless x64 is on)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype)), inputs)


_PREFIX = "moe_tune_shared_"


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where a payload is: the pickle without its large buffers, and each buffer's (offset, size) in `path`."""

    path: str
    head: bytes
    spans: tuple[tuple[int, int], ...]


def _directory() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def store(payload: Any) -> Stored:
    """Write `payload`'s large buffers to a new file; what a worker needs to `load` it."""
    _remove_stale()
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
    fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}_", dir=_directory())
    spans, offset = [], 0
    try:
        with os.fdopen(fd, "wb") as f:
            for buffer in buffers:
                raw = buffer.raw()
                f.write(raw)
                spans.append((offset, raw.nbytes))
                offset += raw.nbytes
    except BaseException:
        os.unlink(path)
        raise
    return Stored(path, head, tuple(spans))


def load(stored: Stored) -> Any:
    """The payload, its arrays read-only views of the mapped file (valid after the file is removed)."""
    views = [memoryview(b"")] * len(stored.spans)
    if any(size for _, size in stored.spans):  # (an empty file cannot be mapped)
        with open(stored.path, "rb") as f:
            mapped = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        views = [mapped[offset:offset + size] for offset, size in stored.spans]
    return pickle.loads(stored.head, buffers=views)


def remove(stored: Stored) -> None:
    try:
        os.unlink(stored.path)
    except FileNotFoundError:
        pass


def _remove_stale() -> None:
    """Remove the payload files of processes that no longer run."""
    for path in glob.glob(os.path.join(_directory(), f"{_PREFIX}*")):
        pid = os.path.basename(path)[len(_PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
