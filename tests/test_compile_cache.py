"""The sweeps' persistent compilation cache stays bounded: `compiling.trim_cache` and its variable."""

from __future__ import annotations

import os

import pytest

from moe_tune.core import settings
from moe_tune.core.errors import UsageError
from moe_tune.tuner import compiling


def _entry(directory, name: str, size: int, mtime: int):
    path = directory / name
    path.write_bytes(b"x" * size)
    os.utime(path, (mtime, mtime))
    return path


def test_trim_removes_the_oldest_entries_down_to_three_quarters_and_nothing_else(tmp_path):
    entries = [_entry(tmp_path, f"jit_cand_{i}-{i:04x}-cache", 100, 1000 + i) for i in range(10)]
    atime = _entry(tmp_path, "jit_cand_0-0000-atime", 8, 999)
    foreign = _entry(tmp_path, "notes.txt", 5000, 1)  # the user's file in a dir they named: never touched
    assert compiling.trim_cache(tmp_path, 1008) == 0  # at the cap: nothing to do
    assert all(p.exists() for p in (*entries, atime))
    assert compiling.trim_cache(tmp_path, 800) == 8 + 4 * 100  # 1008 -> 600, 3/4 of 800, oldest first
    assert not atime.exists() and [p.exists() for p in entries] == [False] * 4 + [True] * 6
    assert foreign.exists()
    assert compiling.trim_cache(tmp_path, 800) == 0  # below the cap now: the next sweep leaves it


def test_a_bad_cache_size_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.COMPILE_CACHE_DIR, str(tmp_path))
    assert settings.compile_cache_max_bytes() == settings.DEFAULT_COMPILE_CACHE_MAX_BYTES
    monkeypatch.setenv(settings.COMPILE_CACHE_MAX_BYTES, "4G")
    with pytest.raises(UsageError, match=r"\$MOE_TUNE_COMPILE_CACHE_MAX_BYTES='4G' is not a positive number"):
        compiling.check_cache()
    monkeypatch.setenv(settings.COMPILE_CACHE_MAX_BYTES, str(2**20))
    assert compiling.check_cache() == tmp_path and settings.compile_cache_max_bytes() == 2**20
