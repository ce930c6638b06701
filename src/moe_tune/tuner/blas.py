"""The float64 reference of a sweep on one BLAS thread.

NumPy's OpenBLAS runs each matmul on as many threads as there are cores. When another process keeps one of
those cores busy (a compile worker, another sweep), its threads wait for each other: on this 2-core machine
under another process's load (~2.4), the reference of the `strategies_cpu.py` shape (16 groups, one float64
matmul each) took a median 0.42 s at m=256 and 0.88 s at m=2048 on OpenBLAS's 2 threads, 0.07 and 0.21 s on
one; 0.70 / 1.35 s against 0.10 / 0.33 s with a busy loop added (on the quiet machine 2 threads are faster
alone; results/warm_phases_cpu_2core_2026-11-26_session17_C.txt, benchmarks/reference_threads_cpu.py; NOTES.md,
issue 32, session 17 (C)). This most likely was the "inputs and reference" phase of 1.2-1.3 s that session 16
measured in warm sweeps at m=256 (0.37 s in the cold one between them): it follows the other cores' load, not
warm or cold (0.27-0.28 s in warm and cold sweeps alike on a quiet machine in session 17, 0.95-1.21 s in warm
ones beside the held-out benchmark). A sweep now computes the reference while its compile workers compile
(`tuner/inputs.py`), so the cores are taken: one thread.

The thread count is OpenBLAS's process-wide setting, found by name in the OpenBLAS library this process
loaded; without one (another BLAS), `one_thread` changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator

import numpy as np  # noqa: F401 - loads NumPy's BLAS, which `_openblas` looks for

# (get, set) of the thread count, as OpenBLAS builds name them: NumPy's wheels (scipy-openblas, 64-bit
# integers), OpenBLAS's own 64-bit integer build, and the plain build
_NAMES = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
          ("openblas_get_num_threads", "openblas_set_num_threads"))


@functools.cache
def _openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) of the thread count of the OpenBLAS this process loaded, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "openblas" in line.lower()}
    except OSError:  # not Linux
        return None
    for path in sorted(p for p in paths if ".so" in p):
        try:
            lib = ctypes.CDLL(path)  # loaded already: the same library, not a second copy
        except OSError:
            continue
        for get_name, set_name in _NAMES:
            if hasattr(lib, get_name) and hasattr(lib, set_name):
                get, set_ = getattr(lib, get_name), getattr(lib, set_name)
                get.restype, set_.restype = ctypes.c_int, None
                set_.argtypes = [ctypes.c_int]
                return get, set_
    return None


def threads() -> int | None:
    """OpenBLAS's thread count now, or None when this process has no OpenBLAS to ask."""
    found = _openblas()
    return None if found is None else found[0]()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with OpenBLAS on one thread (the process's setting: whatever thread runs BLAS meanwhile
    gets one too), and restore the count after it."""
    found = _openblas()
    if found is None:
        yield
        return
    get, set_ = found
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)
