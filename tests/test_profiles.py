"""Lookup: exact / nearest / default, profile-dir precedence, broken tables never break a model."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.core.errors import TableError
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.kernels.ragged_dot.tiled import TiledConfig
from moe_tune.profiles import entry_key, key_fields, lookup, use_profiles, write_entries
from moe_tune.profiles.entry import key_from_fields

PROBLEM = RaggedDotProblem(m=1024, k=256, n=128, groups=8)


def _entry(problem, config, backend="tiled", distribution="balanced"):
    fields = key_fields(problem, backend, distribution)
    return {"key": key_from_fields("ragged_dot", fields), "fields": fields, "config": config,
            "timing": {"median_s": 1e-3}}


def _write(directory, *entries):
    write_entries(directory / "cpu" / "ragged_dot.json", "ragged_dot", "cpu", entries)


def test_exact_entry_wins(isolated_profiles):
    _write(isolated_profiles, _entry(PROBLEM, {"tm": 32, "tk": 256, "tn": 128}))
    found = get_op("ragged_dot").lookup(PROBLEM)
    assert found.source == "exact" and found.config == TiledConfig(32, 256, 128)
    assert found.path == isolated_profiles / "cpu" / "ragged_dot.json"


def test_profiles_lookup_takes_the_backend_instance(isolated_profiles):
    """The pinned `moe_tune.profiles.lookup` gets the backend object (profiles know nothing of kernels); the
    op object's `lookup` picks it by name or by platform, and both give the same answer."""
    _write(isolated_profiles, _entry(PROBLEM, {"tm": 32, "tk": 256, "tn": 128}))
    tiled = get_op("ragged_dot").backends.get("tiled")
    found = lookup("ragged_dot", PROBLEM, backend=tiled)
    assert found.source == "exact" and found.config == TiledConfig(32, 256, 128)
    assert get_op("ragged_dot").lookup(PROBLEM, backend="tiled") == found == get_op("ragged_dot").lookup(PROBLEM)
    assert found.entry.key == found.key and found.entry.median_s == 1e-3
    with pytest.raises(TypeError, match="backend instance"):
        lookup("ragged_dot", PROBLEM, backend="tiled")


def test_nearest_is_same_everything_but_m_nearest_in_log_space(isolated_profiles):
    _write(isolated_profiles,
           _entry(PROBLEM.with_m(512), {"tm": 32, "tk": 256, "tn": 128}),
           _entry(PROBLEM.with_m(8192), {"tm": 512, "tk": 256, "tn": 128}),
           _entry(RaggedDotProblem(m=1100, k=256, n=256, groups=8), {"tm": 1, "tk": 1, "tn": 1}))  # other n
    found = get_op("ragged_dot").lookup(PROBLEM.with_m(900))  # log-distance: 512 is closer than 8192
    assert found.source == "nearest" and found.config == TiledConfig(32, 256, 128)
    assert get_op("ragged_dot").lookup(PROBLEM.with_m(4000)).config == TiledConfig(512, 256, 128)


def test_nearest_prefers_same_distribution(isolated_profiles):
    _write(isolated_profiles,
           _entry(PROBLEM.with_m(1000), {"tm": 64, "tk": 256, "tn": 128}, distribution="skewed"),
           _entry(PROBLEM.with_m(4096), {"tm": 256, "tk": 256, "tn": 128}))
    assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 256
    assert get_op("ragged_dot").lookup(PROBLEM, distribution="skewed").config.tm == 64


def test_default_when_nothing_matches():
    found = get_op("ragged_dot").lookup(PROBLEM)
    assert found.source == "default" and found.entry is None
    assert found.config == moe_tune.kernels.ragged_dot.BACKENDS.get("tiled").default_config(PROBLEM)


def test_use_profiles_takes_precedence_over_env_dir(isolated_profiles, tmp_path):
    _write(isolated_profiles, _entry(PROBLEM, {"tm": 32, "tk": 256, "tn": 128}))
    overlay = tmp_path / "overlay"
    _write(overlay, _entry(PROBLEM, {"tm": 128, "tk": 256, "tn": 128}))
    with use_profiles(overlay):
        assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 128
    assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 32


def test_invalid_tuned_config_is_not_used(isolated_profiles):
    _write(isolated_profiles, _entry(PROBLEM, {"tm": 0, "tk": 256, "tn": 128}))
    found = get_op("ragged_dot").lookup(PROBLEM)
    assert found.source == "default" and "unusable config" in found.reason


@pytest.mark.parametrize("content", ["{not json", '{"schema_version": 1}', '{"schema_version": 99, "entries": {}}', ""])
def test_broken_table_warns_once_and_falls_through(isolated_profiles, tmp_path, content):
    broken = tmp_path / "overlay"
    (broken / "cpu").mkdir(parents=True)
    (broken / "cpu" / "ragged_dot.json").write_text(content)
    _write(isolated_profiles, _entry(PROBLEM, {"tm": 32, "tk": 256, "tn": 128}))
    with use_profiles(broken):
        with pytest.warns(RuntimeWarning, match="ragged_dot.json"):
            assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 32
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only once
            assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 32
        with pytest.raises(TableError, match="ragged_dot.json"):
            get_op("ragged_dot").lookup(PROBLEM, strict=True)
        # and a model still runs
        out = moe_tune.ragged_dot(jnp.ones((1024, 256)), jnp.ones((8, 256, 128)), jnp.full((8,), 128, jnp.int32))
        assert np.allclose(np.asarray(out), 256.0)


def test_table_is_reread_when_it_changes(isolated_profiles):
    _write(isolated_profiles, _entry(PROBLEM, {"tm": 32, "tk": 256, "tn": 128}))
    assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 32
    _write(isolated_profiles, _entry(PROBLEM, {"tm": 64, "tk": 256, "tn": 128}))
    assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 64


def test_key_names_every_field():
    key = entry_key("ragged_dot", PROBLEM, "tiled", "balanced")
    assert key == ("ragged_dot|direction=fwd|m=1024|k=256|n=128|groups=8|lhs_dtype=float32|rhs_dtype=float32"
                   "|out_dtype=float32|backend=tiled|distribution=balanced")


def test_profile_dirs_are_read_in_order_and_a_users_table_wins_over_the_shipped_one(isolated_profiles, tmp_path,
                                                                                    monkeypatch):
    """use_profiles(...) > $MOE_TUNE_PROFILE_DIR > the user cache dir > the shipped tables: each dir holds an
    exact entry with its own tm; taking the dirs away one at a time uncovers the next one (the user's entry
    wins over the shipped one while both exist)."""
    from moe_tune.profiles import table as dirs

    user, shipped, overlay = dirs.user_dir(), dirs.shipped_dir(), tmp_path / "overlay"
    assert isolated_profiles not in (user, shipped)
    for directory, tm in ((shipped, 40), (user, 48), (isolated_profiles, 56), (overlay, 64)):
        _write(directory, _entry(PROBLEM, {"tm": tm, "tk": 256, "tn": 128}))
    table = lambda directory: directory / "cpu" / "ragged_dot.json"

    def found(tm, directory):
        result = get_op("ragged_dot").lookup(PROBLEM)
        assert (result.source, result.config.tm, result.path) == ("exact", tm, table(directory))

    with use_profiles(overlay):
        found(64, overlay)
    found(56, isolated_profiles)
    monkeypatch.delenv("MOE_TUNE_PROFILE_DIR")
    found(48, user)
    table(user).unlink()
    found(40, shipped)


def test_runtime_assumes_balanced_groups_unless_the_environment_names_another(isolated_profiles, monkeypatch,
                                                                              caplog):
    """$MOE_TUNE_DISTRIBUTION picks which distribution's entry the runtime looks up, in lookup() and in the op
    at trace time."""
    import logging

    import jax

    _write(isolated_profiles, _entry(PROBLEM, {"tm": 48, "tk": 256, "tn": 128}),
           _entry(PROBLEM, {"tm": 64, "tk": 256, "tn": 128}, distribution="skewed"))
    lhs, rhs = jnp.zeros((PROBLEM.m, PROBLEM.k)), jnp.zeros((PROBLEM.groups, PROBLEM.k, PROBLEM.n))
    sizes = jnp.full((PROBLEM.groups,), PROBLEM.m // PROBLEM.groups, jnp.int32)
    caplog.set_level(logging.INFO, logger="moe_tune")

    def traced_tm() -> int:
        caplog.clear()
        jax.make_jaxpr(lambda a, b: moe_tune.ragged_dot(a, b, sizes, backend="tiled"))(lhs, rhs)
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ragged_dot")]
        assert "(exact: " in line, line
        return int(line.split(" tm=")[1].split()[0])

    assert get_op("ragged_dot").lookup(PROBLEM).config.tm == 48 and traced_tm() == 48
    monkeypatch.setenv("MOE_TUNE_DISTRIBUTION", "skewed")
    found = get_op("ragged_dot").lookup(PROBLEM)
    assert found.source == "exact" and found.config.tm == 64 and found.entry.fields["distribution"] == "skewed"
    assert traced_tm() == 64
    monkeypatch.setenv("MOE_TUNE_DISTRIBUTION", "lopsided")
    with pytest.raises(moe_tune.core.errors.UsageError, match="lopsided"):
        get_op("ragged_dot").lookup(PROBLEM)
