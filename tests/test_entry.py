"""The typed table entry: every shipped and older entry round-trips unchanged; settings read at call time."""

from __future__ import annotations

import json

import pytest

from moe_tune.core import settings
from moe_tune.profiles import table as dirs
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.table import migrate, read_table
from moe_tune.profiles.validate import table_files

# Captured at import, before the autouse fixture points `dirs.shipped_dir` at an empty temporary dir.
SHIPPED = dirs.shipped_dir()


def _shipped_entries():
    for path in table_files(SHIPPED):
        for key, entry in read_table(path)["entries"].items():
            yield key, entry


def test_every_shipped_entry_round_trips_exactly():
    entries = list(_shipped_entries())
    assert entries
    for key, data in entries:
        entry = Entry.from_json(data)
        assert entry.key == key and entry.to_json() == data
        assert json.dumps(entry.to_json()) == json.dumps(data)  # the key order too
        assert entry.median_s == data["timing"]["median_s"] and entry.count("tried") == data["candidates"]["tried"]
        assert entry.backend == data["fields"]["backend"]
        assert entry.backend_revision == data["versions"]["backend_revision"]


def test_a_schema_1_entry_and_unknown_keys_round_trip():
    v1 = {"schema_version": 1, "op": "ragged_dot", "device_kind": "cpu",
          "entries": {"K": {"fields": {"m": 8}, "config": {"tm": 8}, "timing": {"median_s": 1e-3},
                            "from_the_future": {"x": 1}}}}
    data = migrate(v1)["entries"]["K"]
    entry = Entry.from_json(data)
    assert entry.to_json() == data and entry.extra == {"from_the_future": {"x": 1}}
    assert entry.backend_revision is None and entry.default_median_s is None and entry.count("tried") is None
    assert "tuned_at" not in entry.to_json()  # absent stays absent...
    assert entry.replace(tuned_at="now").to_json()["tuned_at"] == "now"  # ...until it is set
    assert Entry.from_json({"fields": {}, "config": {}}, key="K").to_json() == {"key": "K", "fields": {}, "config": {}}


def test_a_built_entry_writes_every_sweep_field_but_provenance():
    entry = Entry(key="K", op="ragged_dot", fields={"m": 8}, config={"tm": 8})
    data = entry.to_json()
    assert list(data)[:4] == ["key", "op", "fields", "config"] and "provenance" not in data
    assert data["timing_fallback"] is None and data["sweep_wall_s"] is None
    assert Entry.from_json(data) == entry


@pytest.mark.parametrize("bad", [[], {"config": {}}, {"fields": {}, "config": 3}])
def test_from_json_refuses_what_is_not_an_entry(bad):
    with pytest.raises(ValueError):
        Entry.from_json(bad, key="K")


def test_settings_read_the_environment_when_called(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.PROFILE_DIR, str(tmp_path))
    assert settings.profile_dir() == tmp_path and dirs.write_dir() == tmp_path
    monkeypatch.delenv(settings.PROFILE_DIR)
    assert settings.profile_dir() is None
    monkeypatch.setenv(settings.RAGGED_GATHER_FALLBACK, " Yes ")
    assert settings.ragged_gather_fallback() and not settings.ragged_gather_reduce_fallback()
    monkeypatch.setenv(settings.COMPILE_CACHE_DIR, "off")
    assert settings.compile_cache_dir() is None
    monkeypatch.setenv(settings.WORKER_MEMORY_LIMIT, "1000")
    assert settings.worker_memory_limit() == 1000
    monkeypatch.setenv(settings.STALE_POLICY, " SKIP")
    assert settings.stale_policy() == "skip"
