"""Model presets: the shipped models.json, name lookup, and the kernel problems of one MoE layer."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from moe_tune.core.errors import UsageError
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.layer.models import ModelPreset, get_preset, kernel_problems, presets

# The published expert-layer shapes the package must ship: a copy, kept in the repository, of the project's
# shared models.json (so that the check runs, and fails, wherever the suite runs).
PUBLISHED_MODELS = Path(__file__).parent / "data" / "models.json"


def shipped_json() -> dict:
    return json.loads(resources.files("moe_tune").joinpath("data/models.json").read_text(encoding="utf-8"))


def test_every_preset_loads_with_positive_sizes():
    names = [name for name in shipped_json() if not name.startswith("_")]
    assert sorted(presets()) == sorted(names) and names
    for name in names:
        preset = get_preset(name)
        assert isinstance(preset, ModelPreset) and preset.name == name
        assert min(preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k) > 0
        assert preset.shared_experts >= 0
        assert preset.top_k <= preset.experts


def test_presets_are_read_once():
    assert presets() is presets()


def test_unknown_name_names_the_close_match_and_all_models():
    with pytest.raises(UsageError) as err:
        get_preset("deepseek-v4")
    message = str(err.value)
    assert "\n" not in message
    assert "did you mean deepseek-v3" in message
    for name in presets():
        assert name in message


def gemm_rows(preset: ModelPreset, tokens: int) -> int:
    """The documented convention: every (token, k) entry of a shard's `tokens` tokens is one row."""
    return tokens * preset.top_k


def test_deepseek_v3_expert_parallel():
    preset, tokens, ep = get_preset("deepseek-v3"), 4096, 8
    cases = kernel_problems(preset, tokens, ep=ep)
    dots = [c for c in cases if c.op == "ragged_dot"]
    assert len(dots) == 6
    shapes = {"gate/up": (preset.hidden, preset.expert_intermediate),
              "down": (preset.expert_intermediate, preset.hidden)}
    for role, (k, n) in shapes.items():
        mine = [c.problem for c in dots if c.role == role]
        assert sorted(p.direction for p in mine) == ["dlhs", "drhs", "fwd"]
        for p in mine:
            assert isinstance(p, RaggedDotProblem)
            assert (p.m, p.k, p.n, p.groups) == (gemm_rows(preset, tokens), k, n, preset.experts // ep)
            assert (p.lhs_dtype, p.rhs_dtype, p.out_dtype) == ("bfloat16",) * 3
    assert dots[0].problem.groups == 32
    gathers = {c.role: c for c in cases if c.op != "ragged_dot"}
    assert {role: c.op for role, c in gathers.items()} == {"dispatch": "ragged_gather",
                                                           "combine": "ragged_gather_reduce"}
    for case in gathers.values():
        p = case.problem
        assert isinstance(p, GatherProblem)
        assert (p.tokens, p.rows, p.hidden, p.top_k, p.experts, p.ep) == (tokens, gemm_rows(preset, tokens), preset.hidden, preset.top_k, preset.experts, ep)
    assert not gathers["dispatch"].problem.weighted and gathers["combine"].problem.weighted
    assert len(cases) == 8


def test_mixtral_without_expert_parallelism_uses_dense_combine():
    cases = kernel_problems(get_preset("mixtral-8x7b"), 512, dtype="float32")
    assert [(c.op, c.role) for c in cases if c.op != "ragged_dot"] == [("ragged_gather", "dispatch"),
                                                                      ("dense_gather_reduce", "combine")]
    dots = [c.problem for c in cases if c.op == "ragged_dot"]
    assert {(p.m, p.groups, p.lhs_dtype) for p in dots} == {(512 * 2, 8, "float32")}


@pytest.mark.parametrize("kwargs", [{"ep": 3}, {"ep": 0}, {"ep": 16}])
def test_bad_expert_parallel_size(kwargs):
    with pytest.raises(UsageError):
        kernel_problems(get_preset("mixtral-8x7b"), 128, **kwargs)


@pytest.mark.parametrize("tokens", [0, -1, 2.5])
def test_bad_tokens(tokens):
    with pytest.raises(UsageError):
        kernel_problems(get_preset("qwen3-30b-a3b"), tokens)


@pytest.mark.parametrize("name", sorted(presets()))
def test_key_fields_round_trip(name):
    preset = get_preset(name)
    eps = [ep for ep in (1, 2, 8) if preset.experts % ep == 0]
    for ep in eps:
        for case in kernel_problems(preset, 64, ep=ep):
            fields = case.problem.key_fields()
            again = type(case.problem).from_key_fields(fields)
            assert again.key_fields() == fields


def test_shipped_json_is_the_published_shapes():
    published = json.loads(PUBLISHED_MODELS.read_text(encoding="utf-8"))
    assert len(published) > 5 and shipped_json() == published
