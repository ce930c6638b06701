"""A sweep's inputs and float64 reference, and how compile workers receive them.

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
from typing import Any

import jax
import numpy as np
from threadpoolctl import threadpool_limits

from moe_tune.core import devices
from moe_tune.tuner.candidate import Reference

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
