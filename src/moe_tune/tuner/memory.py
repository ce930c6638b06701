"""Refuse a problem that cannot fit before allocating anything for it.

A sweep (and `moe-tune bench`) holds the problem's inputs on the host and on the device, the float64
reference and a candidate's output at once. A shape typed wrong (`--m 100000000 --k 100000 --n 100000`)
would otherwise die in NumPy with a 36 TiB allocation traceback; the op knows what its problem needs
(`KernelOp.memory_estimate`), this module knows what the machine has.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moe_tune.core.errors import UsageError


def available_bytes() -> int | None:
    """Memory available to a new allocation: /proc/meminfo's MemAvailable on Linux, else free physical pages
    (os.sysconf); None when neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def check_fits(op: Any, problem: Any, workers: int = 1) -> None:
    """UsageError (one line) when `problem`'s inputs, reference and output, with `workers` compile worker
    processes (1: none), need more memory than is available (an op that cannot estimate its need says 0:
    not checked)."""
    need, have = op.sweep_memory(problem, workers), available_bytes()
    if have is not None and need > have:
        fewer = " (fewer --workers need less)" if workers > 1 and op.sweep_memory(problem, 1) < need else ""
        raise UsageError(f"{op.describe(problem)} needs about {_size(need)} of memory for its inputs, reference "
                         f"and output with --workers {workers}; this machine has {_size(have)} available{fewer}")
