"""Tables over time and across machines: versions and staleness, schema migration, validation, merging,
concurrent writers (real processes) and broken tables that never break a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.core.errors import TableError, UsageError
from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.kernels.ragged_dot.tiled import TiledConfig, TiledRaggedDot
from moe_tune.profiles import (SCHEMA_VERSION, StaleEntryError, entry_versions, key_fields, merge_tables, migrate,
                               read_table, use_profiles, use_stale_policy, validate_paths, validate_table,
                               write_entries)
from moe_tune.profiles.entry import key_from_fields
from moe_tune.profiles.table import migrate_v1_to_v2

PROBLEM = RaggedDotProblem(m=1024, k=256, n=128, groups=8)
TILED = get_op("ragged_dot").backends.get("tiled")
GOOD = {"tm": 32, "tk": 256, "tn": 128}


@pytest.fixture(autouse=True)
def tiled_at_revision_1(monkeypatch):
    """These tests write entries "tuned with revision 1" and bump the installed revision where they need a
    stale one: pin the installed revision to 1 first, whatever tiled's real revision is."""
    monkeypatch.setattr(TiledRaggedDot, "revision", 1)


def _entry(problem=PROBLEM, config=GOOD, *, backend="tiled", distribution="balanced", median=1e-3, revision=1,
           jax_version=None, **extra):
    fields = key_fields(problem, backend, distribution)
    versions = {"jax": jax_version or jax.__version__, "jaxlib": "x", "moe-tune": "0.1.0", "tune-jax": "x"}
    if revision is not None:
        versions["backend_revision"] = revision
    entry = {"key": key_from_fields("ragged_dot", fields), "op": "ragged_dot", "fields": fields, "config": config,
             "timing": {"median_s": median} if median is not None else None, "versions": versions,
             "device_kind": "cpu", "tuned_at": "2026-01-01T00:00:00+00:00"}
    return {**entry, **extra}


def _table(directory, device_kind="cpu", op="ragged_dot"):
    return directory / device_kind / f"{op}.json"


def _write(directory, *entries, device_kind="cpu"):
    return write_entries(_table(directory, device_kind), "ragged_dot", device_kind, entries)


# --- versions and staleness ---------------------------------------------------------------------------------


def test_every_backend_has_a_revision_and_entries_record_it():
    for name in op_names():
        for backend_name in get_op(name).backends.names():
            backend = get_op(name).backends.get(backend_name)
            assert isinstance(backend.revision, int) and backend.revision >= 1
    recorded = entry_versions(TILED)
    assert set(recorded) == {"jax", "jaxlib", "moe-tune", "tune-jax", "backend_revision"}
    assert recorded["backend_revision"] == TILED.revision and recorded["jax"] == jax.__version__


def test_stale_revision_is_used_with_one_warning_by_default(isolated_profiles, monkeypatch):
    path = _write(isolated_profiles, _entry(), _entry(PROBLEM.with_m(2048), {"tm": 64, "tk": 256, "tn": 128}))
    monkeypatch.setattr(TiledRaggedDot, "revision", 2)
    with pytest.warns(RuntimeWarning, match=r"tiled revision 1 \(installed: 2\)") as record:
        found = get_op("ragged_dot").lookup(PROBLEM)
    assert str(path) in str(record[0].message) and "using them" in str(record[0].message)
    assert record[0].filename == __file__  # attributed to the caller, not to a line inside moe-tune
    assert found.source == "exact" and found.config == TiledConfig(**GOOD)
    assert found.stale == "tiled revision 1 (installed: 2)" and "stale" in found.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per table and difference, not per entry
        assert get_op("ragged_dot").lookup(PROBLEM.with_m(2048)).config.tm == 64


def test_fresh_entry_is_not_stale(isolated_profiles):
    _write(isolated_profiles, _entry(jax_version=jax.__version__.rsplit(".", 1)[0] + ".999"))  # other patch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = get_op("ragged_dot").lookup(PROBLEM)
    assert found.source == "exact" and found.stale == ""


def test_other_jax_minor_is_stale(isolated_profiles):
    _write(isolated_profiles, _entry(jax_version="0.4.30"))
    major, minor = jax.__version__.split(".")[:2]
    with pytest.warns(RuntimeWarning, match=rf"jax 0\.4 \(installed: {major}\.{minor}\)"):
        assert get_op("ragged_dot").lookup(PROBLEM).stale.startswith("jax 0.4")


def test_skip_falls_through_to_next_dir_then_nearest_then_default(isolated_profiles, tmp_path, monkeypatch):
    overlay = tmp_path / "overlay"
    _write(overlay, _entry(config={"tm": 128, "tk": 256, "tn": 128}, revision=1))  # stale once bumped
    _write(isolated_profiles, _entry(revision=2))  # fresh exact entry, lower priority
    monkeypatch.setattr(TiledRaggedDot, "revision", 2)
    monkeypatch.setenv("MOE_TUNE_STALE_POLICY", "skip")
    with use_profiles(overlay):
        with pytest.warns(RuntimeWarning, match="skipping them"):
            found = get_op("ragged_dot").lookup(PROBLEM)
        assert found.source == "exact" and found.config.tm == 32 and found.path == _table(isolated_profiles)
        assert "skipped stale exact entry in" in found.reason and found.stale == ""

        # No fresh exact entry anywhere: the nearest fresh entry, never a stale one.
        _write(isolated_profiles, _entry(PROBLEM.with_m(4096), {"tm": 256, "tk": 256, "tn": 128}, revision=2))
        _write(overlay, _entry(PROBLEM.with_m(2900), {"tm": 8, "tk": 256, "tn": 128}, revision=1))
        found = get_op("ragged_dot").lookup(PROBLEM.with_m(3000))  # 2900 is nearer, but stale
        assert found.source == "nearest" and found.config.tm == 256 and found.stale == ""

    # Only stale entries: the default.
    only_stale = tmp_path / "only_stale"
    _write(only_stale, _entry(PROBLEM.with_m(300), revision=1))
    with use_profiles(only_stale), use_stale_policy("skip"):
        monkeypatch.setenv("MOE_TUNE_PROFILE_DIR", str(tmp_path / "empty"))
        with pytest.warns(RuntimeWarning, match=r"skipping them \(stale policy 'skip'"):
            found = get_op("ragged_dot").lookup(PROBLEM.with_m(300))
        assert found.source == "default" and found.config == TILED.default_config(PROBLEM.with_m(300))
        assert "skipped stale exact entry" in found.reason


def test_error_policy_names_file_key_and_difference(isolated_profiles, monkeypatch):
    path = _write(isolated_profiles, _entry(revision=1))
    monkeypatch.setattr(TiledRaggedDot, "revision", 3)
    key = _entry()["key"]
    with use_stale_policy("error"):
        with pytest.raises(StaleEntryError) as info:
            get_op("ragged_dot").lookup(PROBLEM)
    message = str(info.value)
    assert str(path) in message and key in message and "tiled revision 1 (installed: 3)" in message
    assert isinstance(info.value, TableError)
    with pytest.raises(StaleEntryError):
        get_op("ragged_dot").lookup(PROBLEM, stale_policy="error")  # the argument works the same
    with pytest.raises(StaleEntryError):  # and so does the environment, also for a nearest entry
        monkeypatch.setenv("MOE_TUNE_STALE_POLICY", "error")
        get_op("ragged_dot").lookup(PROBLEM.with_m(1000))
    with pytest.warns(RuntimeWarning, match="using them"):
        assert get_op("ragged_dot").lookup(PROBLEM, stale_policy="use").stale  # the argument wins over the env


def test_unknown_policy_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_STALE_POLICY", "sometimes")
    with pytest.raises(UsageError, match="MOE_TUNE_STALE_POLICY"):
        get_op("ragged_dot").lookup(PROBLEM)
    with pytest.raises(UsageError):
        with use_stale_policy("never"):
            pass


def test_entry_without_revision_counts_as_revision_1(isolated_profiles, monkeypatch):
    _write(isolated_profiles, _entry(revision=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_op("ragged_dot").lookup(PROBLEM).stale == ""
    monkeypatch.setattr(TiledRaggedDot, "revision", 2)
    with pytest.warns(RuntimeWarning, match="predates recorded revisions"):
        assert get_op("ragged_dot").lookup(PROBLEM, stale_policy="skip").source == "default"


def test_a_model_runs_under_every_policy_but_error(isolated_profiles, monkeypatch):
    _write(isolated_profiles, _entry(revision=1))
    monkeypatch.setattr(TiledRaggedDot, "revision", 2)
    args = (jnp.ones((1024, 256)), jnp.ones((8, 256, 128)), jnp.full((8,), 128, jnp.int32))
    for policy in ("use", "skip"):
        with use_stale_policy(policy), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert np.allclose(np.asarray(moe_tune.ragged_dot(*args)), 256.0)


# --- schema -----------------------------------------------------------------------------------------------


def _v1_table_text() -> tuple[str, str]:
    """A table as moe-tune 0.1 (schema 1) wrote it."""
    entry = _entry(revision=None)  # schema 1 recorded no backend_revision
    entry["versions"] = {"jax": jax.__version__, "jaxlib": jax.__version__, "moe-tune": "0.1.0", "tune-jax": "unknown"}
    table = {"schema_version": 1, "op": "ragged_dot", "device_kind": "cpu", "entries": {entry["key"]: entry}}
    return json.dumps(table, indent=1) + "\n", entry["key"]


def test_v1_table_is_migrated_on_read_and_rewritten_at_the_current_schema(isolated_profiles):
    text, key = _v1_table_text()
    path = _table(isolated_profiles)
    path.parent.mkdir(parents=True)
    path.write_text(text)

    raw = json.loads(text)
    migrated = migrate(raw)
    assert raw == json.loads(text)  # pure
    assert migrated["schema_version"] == SCHEMA_VERSION == 3
    assert migrated["entries"][key]["versions"]["jax"] == jax.__version__
    no_versions = {"schema_version": 1, "entries": {"k": {"fields": {}, "config": {}}}}
    assert migrate_v1_to_v2(no_versions)["entries"]["k"] == {"fields": {}, "config": {}, "key": "k", "versions": {}}

    assert read_table(path)["schema_version"] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = get_op("ragged_dot").lookup(PROBLEM)
    assert found.source == "exact" and found.config == TiledConfig(**GOOD) and found.stale == ""
    assert [str(p) for p in validate_table(path, get_op=get_op)] == [
        f"{path}: warning: schema_version 1 (migrated to 3 on read; rewritten at 3 on the next write or merge)"]

    _write(isolated_profiles, _entry(PROBLEM.with_m(64)))
    on_disk = json.loads(path.read_text())
    assert on_disk["schema_version"] == 3 and set(on_disk["entries"]) == {key, _entry(PROBLEM.with_m(64))["key"]}


def test_newer_schema_is_refused_naming_the_file(isolated_profiles, tmp_path):
    newer = tmp_path / "newer"
    path = _table(newer)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "op": "ragged_dot", "device_kind": "cpu",
                                "entries": {}}))
    with pytest.raises(TableError, match="written by a newer moe-tune") as info:
        read_table(path)
    assert str(path) in str(info.value)
    _write(isolated_profiles, _entry())
    with use_profiles(newer), pytest.warns(RuntimeWarning, match="newer moe-tune"):
        assert get_op("ragged_dot").lookup(PROBLEM).path == _table(isolated_profiles)
    with pytest.raises(TableError, match="newer moe-tune"):  # and a sweep will not overwrite it
        write_entries(path, "ragged_dot", "cpu", [_entry()])


# --- broken tables --------------------------------------------------------------------------------------


def _truncated():
    return json.dumps({"schema_version": SCHEMA_VERSION, "op": "ragged_dot", "device_kind": "cpu",
                       "entries": {_entry()["key"]: _entry()}}, indent=1)[:300]


def _table_with(entry):
    return json.dumps({"schema_version": SCHEMA_VERSION, "op": "ragged_dot", "device_kind": "cpu",
                       "entries": {"k": entry}})


BROKEN = {
    "truncated": (_truncated, "not valid JSON"),
    "empty": (lambda: "", "empty file"),
    "binary": (lambda: b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01garbage\x80\x81", "not UTF-8"),
    "nul-garbage": (lambda: "\x00\x00\x00{}", "not valid JSON"),
    "deeply-nested": (lambda: "[" * 200_000, "not valid JSON"),
    "entry-missing-fields": (lambda: _table_with({"config": GOOD}), "entry 'k': lacks a 'fields' object"),
    "entry-not-object": (lambda: _table_with([1, 2]), "entry 'k': is list, not an object"),
    "fields-not-object": (lambda: _table_with({"fields": "m=1", "config": GOOD}), "'fields' is str"),
    "no-schema": (lambda: '{"entries": {}}', "schema_version None is not supported"),
    "list": (lambda: "[]", "not a moe-tune table"),
    "directory": (None, "is a directory"),
}


def _make_broken(directory, name):
    make, _ = BROKEN[name]
    path = _table(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    if make is None:
        path.mkdir()
        (path / "x").write_text("{}")
    else:
        content = make()
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_table_warns_once_falls_through_and_strict_names_file_and_problem(isolated_profiles, tmp_path, name):
    broken = tmp_path / "broken"
    path = _make_broken(broken, name)
    _write(isolated_profiles, _entry())
    problem_text = BROKEN[name][1]
    with use_profiles(broken):
        with pytest.warns(RuntimeWarning) as record:
            found = get_op("ragged_dot").lookup(PROBLEM)
        assert len(record) == 1 and str(path) in str(record[0].message) and problem_text in str(record[0].message)
        assert found.source == "exact" and found.path == _table(isolated_profiles)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert get_op("ragged_dot").lookup(PROBLEM).source == "exact"
        with pytest.raises(TableError) as info:
            get_op("ragged_dot").lookup(PROBLEM, strict=True)
        assert str(path) in str(info.value) and problem_text in str(info.value)
        with pytest.raises(TableError, match=problem_text.replace("(", r"\(")):
            read_table(path)
        args = (jnp.ones((1024, 256)), jnp.ones((8, 256, 128)), jnp.full((8,), 128, jnp.int32))
        assert np.allclose(np.asarray(moe_tune.ragged_dot(*args)), 256.0)
    problems = validate_table(path, get_op=get_op)
    assert len(problems) == 1 and problems[0].severity == "error" and problem_text in str(problems[0])


def test_broken_table_with_nothing_behind_it_uses_the_default(tmp_path):
    broken = tmp_path / "broken"
    _make_broken(broken, "truncated")
    with use_profiles(broken), pytest.warns(RuntimeWarning, match="not valid JSON"):
        assert get_op("ragged_dot").lookup(PROBLEM).source == "default"


def test_device_kind_path_that_is_a_file_is_skipped(isolated_profiles, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "cpu").write_text("not a directory")
    _write(isolated_profiles, _entry())
    with use_profiles(broken):
        with pytest.warns(RuntimeWarning, match="cpu/ragged_dot.json"):
            assert get_op("ragged_dot").lookup(PROBLEM).source == "exact"
        with pytest.raises(TableError, match="Not a directory"):
            get_op("ragged_dot").lookup(PROBLEM, strict=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied_table_is_skipped(isolated_profiles, tmp_path):
    broken = tmp_path / "broken"
    path = _write(broken, _entry(config={"tm": 128, "tk": 256, "tn": 128}))
    path.chmod(0)
    _write(isolated_profiles, _entry())
    try:
        with use_profiles(broken):
            with pytest.warns(RuntimeWarning, match="permission denied"):
                assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 32
            with pytest.raises(TableError, match="permission denied"):
                read_table(path)
    finally:
        path.chmod(0o644)


def test_permission_denied_table_is_skipped_even_as_root(isolated_profiles, tmp_path, monkeypatch):
    """The same path as above where the test runs as root (which the file mode cannot stop): the read fails
    with the PermissionError a non-root reader gets."""
    broken = tmp_path / "broken"
    path = _write(broken, _entry(config={"tm": 128, "tk": 256, "tn": 128}))
    _write(isolated_profiles, _entry())
    real = type(path).read_bytes

    def read_bytes(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(type(path), "read_bytes", read_bytes)
    with use_profiles(broken):
        with pytest.warns(RuntimeWarning, match=f"{path}: cannot read: permission denied"):
            assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 32


def test_entry_config_of_the_wrong_types_does_not_break_lookup(isolated_profiles):
    _write(isolated_profiles, _entry(config={"tm": "32", "tk": None, "tn": [1]}))
    found = get_op("ragged_dot").lookup(PROBLEM)
    assert found.source == "default" and "unusable config" in found.reason


# --- validate -------------------------------------------------------------------------------------------


def test_valid_tables_have_no_problems(isolated_profiles):
    _write(isolated_profiles, _entry(), _entry(PROBLEM.with_m(64), distribution="skewed"))
    from moe_tune.kernels.gather import GatherProblem
    gather = GatherProblem(tokens=64, rows=128, hidden=256)
    fields = key_fields(gather, "jax", "balanced")
    key = key_from_fields("ragged_gather", fields)
    write_entries(_table(isolated_profiles, op="ragged_gather"), "ragged_gather", "cpu",
                  [{"key": key, "fields": fields, "config": {}, "timing": {"median_s": 1e-4},
                    "versions": entry_versions(get_op("ragged_gather").backends.get("jax"))}])
    report = validate_paths(get_op=get_op)  # every profile dir
    assert report.ok and report.problems == [] and len(report.files) == 2
    assert report.lines() == ["2 tables checked: 0 errors, 0 warnings"]
    files = validate_paths([isolated_profiles], get_op=get_op).files
    assert files == validate_paths([isolated_profiles / "cpu"], get_op=get_op).files


def test_validate_judges_configs_as_on_the_tables_device(isolated_profiles):
    """A Triton tile that fits an H100's 227 KiB of shared memory is valid in the H100's table, though it is
    over this machine's (unknown GPU) budget; one over the H100's is an error there too."""
    kind, triton = "nvidia_h100_80gb_hbm3", get_op("ragged_dot").backends.get("triton")
    problem = RaggedDotProblem(m=4096, k=768, n=2048, groups=8, lhs_dtype="bfloat16", rhs_dtype="bfloat16",
                               out_dtype="bfloat16")
    base = {"block_m": 32, "block_k": 128, "block_n": 256, "num_warps": 8}
    fits, over = {**base, "num_stages": 2}, {**base, "block_m": 256, "num_stages": 4}
    entries = [_entry(problem, fits, backend="triton", revision=triton.revision, device_kind=kind),
               _entry(problem.with_m(8192), over, backend="triton", revision=triton.revision, device_kind=kind)]
    path = _write(isolated_profiles, *entries, device_kind=kind)
    as_here = validate_table(path, get_op=get_op)
    as_h100 = validate_table(path, get_op=get_op, on_its_device=True)
    assert {p.key for p in as_here} == {e["key"] for e in entries} and "99 KiB" in str(as_here[0])
    assert [p.key for p in as_h100] == [entries[1]["key"]] and "227 KiB budget" in str(as_h100[0]), as_h100


def test_validate_names_file_entry_and_what_is_wrong(isolated_profiles, monkeypatch):
    good = _entry()
    wrong_key = {**_entry(PROBLEM.with_m(64)), "key": "ragged_dot|m=64"}
    bad_backend = _entry(backend="nope")
    bad_config = _entry(PROBLEM.with_m(128), {"tm": 0, "tk": 256, "tn": 128})
    extra_field = _entry(PROBLEM.with_m(256), config={"tm": 32, "tk": 256, "tn": 128, "tq": 1})
    missing = _entry(PROBLEM.with_m(512))
    del missing["fields"]["m"]
    missing["key"] = key_from_fields("ragged_dot", missing["fields"])
    bad_problem = _entry(PROBLEM.with_m(768))
    bad_problem["fields"]["m"] = -5
    bad_problem["key"] = key_from_fields("ragged_dot", bad_problem["fields"])
    reordered = _entry(PROBLEM.with_m(96))
    reordered["fields"] = dict(reversed(list(reordered["fields"].items())))
    reordered["key"] = key_from_fields("ragged_dot", reordered["fields"])
    bad_dist = _entry(PROBLEM.with_m(32), distribution="zipf")
    bad_timing = _entry(PROBLEM.with_m(48), median=-1.0)
    stale = _entry(PROBLEM.with_m(16), jax_version="0.4.30")
    entries = [good, wrong_key, bad_backend, bad_config, extra_field, missing, bad_problem, reordered, bad_dist,
               bad_timing, stale]
    path = _table(isolated_profiles)
    path.parent.mkdir(parents=True)
    table = {"schema_version": SCHEMA_VERSION, "op": "ragged_dot", "device_kind": "cpu",
             "entries": {e["key"] if e is not wrong_key else "ragged_dot|m=64": e for e in entries}}
    table["entries"]["ragged_dot|m=64"] = wrong_key
    path.write_text(json.dumps(table))

    report = validate_paths([path], get_op=get_op)
    by_key = {}
    for p in report.problems:
        assert p.path == path
        by_key.setdefault(p.key, []).append(p)
    assert good["key"] not in by_key
    expectations = {
        "ragged_dot|m=64": "key does not match its fields",
        bad_backend["key"]: "unknown backend 'nope'",
        bad_config["key"]: "is not valid for backend 'tiled'",
        extra_field["key"]: "has no field(s) ['tq']",
        missing["key"]: "fields lack m",
        bad_problem["key"]: "fields do not describe a valid ragged_dot problem: m must be a positive integer",
        reordered["key"]: "fields are not canonical",
        bad_dist["key"]: "unknown distribution 'zipf'",
        bad_timing["key"]: "timing.median_s -1.0 is not a positive number",
        stale["key"]: "stale: tuned with jax 0.4",
    }
    for key, text in expectations.items():
        assert any(text in str(p) for p in by_key[key]), (key, [str(p) for p in by_key.get(key, [])])
        assert all(str(p).startswith(f"{path}: entry {key!r}: ") for p in by_key[key])
    assert [p.severity for p in by_key[stale["key"]]] == ["warning"]
    assert not report.ok and len(report.errors) == len(expectations) - 1
    assert report.lines()[-1] == f"1 table checked: {len(expectations) - 1} errors, 1 warning"


def test_validate_whole_file_problems(tmp_path):
    unknown_op = tmp_path / "p" / "cpu" / "nope.json"
    unknown_op.parent.mkdir(parents=True)
    unknown_op.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "op": "nope", "device_kind": "cpu",
                                      "entries": {}}))
    misplaced = tmp_path / "p" / "tpu_v5_lite" / "ragged_dot.json"
    misplaced.parent.mkdir(parents=True)
    misplaced.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "op": "ragged_dot", "device_kind": "cpu",
                                     "entries": {}}))
    no_device = tmp_path / "p" / "gpu" / "ragged_dot.json"
    no_device.parent.mkdir(parents=True)
    no_device.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "op": "ragged_dot", "entries": {}}))
    invalid = tmp_path / "p" / "cpu" / "ragged_gather.json"
    invalid.write_text('{"schema_version": 2, "entries": {"a": ')
    report = validate_paths([tmp_path / "p", tmp_path / "missing.json", tmp_path / "p" / "cpu" / "nope.json"],
                            get_op=get_op)
    lines = [str(p) for p in report.errors]
    assert len(report.files) == 4  # the file given twice is checked once
    assert f"{unknown_op}: unknown op 'nope'" in "\n".join(lines)
    assert any(line.startswith(f"{misplaced}: table is for device_kind 'cpu' but lies in directory 'tpu_v5_lite'")
               for line in lines)
    assert f"{no_device}: no 'device_kind' at the top level" in lines
    assert any(line.startswith(f"{invalid}: not valid JSON") for line in lines)
    assert f"{tmp_path / 'missing.json'}: no such file or directory" in lines
    empty = tmp_path / "empty"
    empty.mkdir()
    report = validate_paths([empty], get_op=get_op)
    assert report.ok and [p.severity for p in report.problems] == ["warning"]


# --- merge ----------------------------------------------------------------------------------------------


def test_merge_keeps_the_faster_entry_and_records_provenance(tmp_path):
    a = _write(tmp_path / "host_a", _entry(median=1e-3, hostname="a"),
               _entry(PROBLEM.with_m(64), median=None, hostname="a"))
    b = _write(tmp_path / "host_b", _entry(config={"tm": 64, "tk": 256, "tn": 128}, median=2e-3, hostname="b"),
               _entry(PROBLEM.with_m(64), {"tm": 64, "tk": 256, "tn": 128}, median=5e-3, hostname="b"),
               _entry(PROBLEM.with_m(128), median=1e-3, hostname="b"))
    out = _table(tmp_path / "merged")
    report = merge_tables(out, [a, b])
    assert (report.count("added"), report.count("replaced"), report.count("kept")) == (3, 0, 0)
    assert report.inputs == [a, b] and report.op == "ragged_dot" and report.device_kind == "cpu"
    entries = read_table(out)["entries"]
    k1, k2, k3 = (_entry(p)["key"] for p in (PROBLEM, PROBLEM.with_m(64), PROBLEM.with_m(128)))
    assert entries[k1]["config"]["tm"] == 32 and entries[k1]["hostname"] == "a"
    assert entries[k2]["config"]["tm"] == 64  # the untimed entry loses
    prov = entries[k1]["provenance"]
    assert [(r["source"], r["hostname"], r["median_s"], r["won"]) for r in prov] == [
        (str(a.absolute()), "a", 1e-3, True), (str(b.absolute()), "b", 2e-3, False)]
    assert all(r["tuned_at"] for r in prov)
    assert [r["source"] for r in entries[k3]["provenance"]] == [str(b.absolute())]
    assert "fastest of 2" in "\n".join(report.lines())
    assert validate_table(out, get_op=get_op) == []

    before = out.read_text()
    again = merge_tables(out, [a, b])  # idempotent: OUT is an input too, and its entries win ties
    assert again.count("kept") == 3 and out.read_text() == before and again.inputs == [out, a, b]

    c = _write(tmp_path / "host_c", _entry(median=0.5e-3, hostname="c"))
    merge_tables(out, [c])
    prov = read_table(out)["entries"][k1]["provenance"]
    assert [(r["hostname"], r["won"]) for r in prov] == [("a", False), ("b", False), ("c", True)]


def test_merge_prefers_the_newest_kernel_revision(tmp_path):
    old = _write(tmp_path / "old", _entry(median=1e-4, revision=1))
    new = _write(tmp_path / "new", _entry(config={"tm": 64, "tk": 256, "tn": 128}, median=1e-3, revision=2))
    report = merge_tables(tmp_path / "out" / "cpu" / "ragged_dot.json", [old, new])
    assert read_table(report.out)["entries"][_entry()["key"]]["config"]["tm"] == 64
    assert "newest kernel revision (2)" in report.decisions[0].reason


def test_merge_refuses_other_device_kinds_or_ops_naming_the_file(tmp_path):
    a = _write(tmp_path / "a", _entry())
    gpu = _write(tmp_path / "b", _entry(), device_kind="nvidia_h100")
    out = _table(tmp_path / "out")
    with pytest.raises(TableError) as info:
        merge_tables(out, [a, gpu])
    assert str(gpu) in str(info.value) and "device_kind 'nvidia_h100'" in str(info.value)
    assert not out.exists()
    existing = _write(tmp_path / "out2", _entry(), device_kind="tpu")
    with pytest.raises(TableError, match=f"{existing}: table is for device_kind 'tpu', not 'cpu'"):
        merge_tables(existing, [a])
    broken = _make_broken(tmp_path / "broken", "truncated")
    with pytest.raises(TableError, match=f"{broken}: not valid JSON"):
        merge_tables(out, [a, broken])
    with pytest.raises(UsageError):
        merge_tables(out, [])
    report = merge_tables(tmp_path / "flat.json", [a])
    assert report.notes and "lookup reads <profile dir>/cpu/ragged_dot.json" in report.notes[0]


# --- concurrent writers: real processes -------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import os, sys, time
    from moe_tune.profiles import write_entries
    path, prefix, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    while not os.path.exists(go):
        time.sleep(0.01)
    for i in range(count):
        write_entries(path, "ragged_dot", "cpu", [{"key": f"{prefix}-{i}", "fields": {}, "config": {},
                                                   "timing": {"median_s": 1e-3}}])
""")


def _writer(path, prefix, count, go):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), prefix, str(count), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc):
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out


def test_two_processes_writing_one_table_keep_every_entry(tmp_path):
    path = _table(tmp_path / "profiles")
    go = tmp_path / "go"
    procs = [_writer(path, f"w{n}", 25, go) for n in range(2)]
    go.touch()
    for proc in procs:
        _finish(proc)
    assert set(read_table(path)["entries"]) == {f"w{n}-{i}" for n in range(2) for i in range(25)}
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_merge_while_another_process_writes_the_table_keeps_both(tmp_path):
    out = _table(tmp_path / "profiles")
    inputs = [_write(tmp_path / f"host{h}", *(_entry(PROBLEM.with_m(16 * (i + 1)), median=(h + 1) * 1e-3)
                                              for i in range(h * 5, h * 5 + 10))) for h in range(2)]
    merged_keys = {k for p in inputs for k in read_table(p)["entries"]}
    go = tmp_path / "go"
    proc = _writer(out, "sweep", 40, go)
    go.touch()
    merges = 0
    while proc.poll() is None or merges == 0:
        merge_tables(out, inputs)
        merges += 1
    _finish(proc)
    entries = read_table(out)["entries"]
    assert set(entries) == merged_keys | {f"sweep-{i}" for i in range(40)}
    for key in merged_keys:  # host 0 (entries 0-9) is faster than host 1 (entries 5-14) where both have one
        i = entries[key]["fields"]["m"] // 16 - 1
        assert entries[key]["timing"]["median_s"] == (1e-3 if i < 10 else 2e-3)
