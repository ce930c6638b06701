"""Shared fixtures: every test gets its own profile dirs, so no test sees the developer's real tables."""

from __future__ import annotations

import gc
import os

# The suite compiles thousands of small XLA:CPU programs and takes no timing as a verdict, so this process
# compiles them without the CPU backend's optimization passes (about a third less compile time, the same
# results). XLA reads XLA_FLAGS once, when its first backend starts: the variable is set for that moment and put
# back, so subprocesses (sweeps, compile workers for other chips, `make demo`) run as a user's would;
# `run_once.check_env` hands the same flags to the suite's own multi-device check scripts.
from run_once import FAST_COMPILE_FLAGS  # noqa: E402  (no JAX in it)

_saved_flags = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = f"{_saved_flags or ''} {FAST_COMPILE_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.devices()  # the CPU backend starts here, with the flags
if _saved_flags is None:
    del os.environ["XLA_FLAGS"]
else:
    os.environ["XLA_FLAGS"] = _saved_flags

from moe_tune.profiles import table  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_profiles(tmp_path, monkeypatch):
    """Point $MOE_TUNE_PROFILE_DIR, the user cache dir and the shipped tables at fresh temporary dirs, so that
    no test's lookup depends on the tables this package ships (tests/test_shipped_tables.py reads those)."""
    env_dir = tmp_path / "env_profiles"
    monkeypatch.setenv("MOE_TUNE_PROFILE_DIR", str(env_dir))
    monkeypatch.setattr("moe_tune.profiles.table.user_dir", lambda: tmp_path / "user_profiles")
    monkeypatch.setattr("moe_tune.profiles.table.shipped_dir", lambda: tmp_path / "shipped_profiles")
    monkeypatch.delenv("MOE_TUNE_DISTRIBUTION", raising=False)
    # No persistent compile cache in tests (it is process-wide once on, and tests count compiles); the test
    # of the cache itself runs sweeps in subprocesses with their own cache dir.
    monkeypatch.setenv("MOE_TUNE_COMPILE_CACHE_DIR", "off")
    table._cache.clear()
    yield env_dir


@pytest.fixture
def on_chip(monkeypatch):
    """`on_chip("tpu")` / `on_chip("gpu")`: kernels traced afterwards take their compiled path for that chip
    (`moe_tune.core.devices.platform()`, the one function kernels read to choose compiled vs interpret mode)."""
    from moe_tune.core import devices

    return lambda platform: monkeypatch.setattr(devices, "platform", lambda: platform)


def pytest_generate_tests(metafunc):
    """A test taking `dtype` runs over the `dtypes` of the backend test class it belongs to."""
    if "dtype" in metafunc.fixturenames and metafunc.cls is not None and hasattr(metafunc.cls, "dtypes"):
        metafunc.parametrize("dtype", metafunc.cls.dtypes)


@pytest.fixture(autouse=True, scope="module")
def fresh_jax_caches():
    """Drop JAX's compiled and traced functions after each test module. In one long pytest process they pile
    up and every later test slows down (a real sweep took 3.6 s alone, 13.2 s after the metadata and kernel
    test modules, 5.8 s with this), which is what pushed CI past its 15 minutes."""
    yield
    jax.clear_caches()
    gc.collect()


FAKE_GPUS = 2  # accelerators the shared local Ray pretends to have (scheduling only; the tasks run on the CPU)


@pytest.fixture(scope="session")
def local_ray():
    """One private Ray for the whole test session (starting one costs seconds): 2 CPUs and `FAKE_GPUS` fake
    GPUs. Its workers get the tests dir on their path, so tests can hand them functions of test modules."""
    import os
    from pathlib import Path

    ray = pytest.importorskip("ray")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), saved) if p)
    try:
        ray.init(address="local", num_cpus=2, num_gpus=FAKE_GPUS, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    yield ray
    ray.shutdown()
