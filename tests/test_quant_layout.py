"""The memory layout of quantized weights (`QArray.layout`): "kn" stores [g, k, n] as it reads, "nk" stores
values [g, n, k] (k contiguous) and scales [g, n, k/bs] (per channel [g, n, 1]).

Both layouts hold the same logical array: `shape`, `dequantize` and every backend's results (fwd, dlhs, and
drhs of a quantized lhs) are bitwise those of "kn"; the layout is static pytree data (jit, tree_map, the
shard_map specs); `quantize` / `from_checkpoint` / `relayout` make it, a bad name is one UsageError line; the
tables key "nk" weights apart (`rhs_qlayout`) and the runtime finds a sweep of them.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from jax.sharding import PartitionSpec as P

import moe_tune
from moe_tune.cli import cli
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import (
    QArray,
    dequantize,
    dequantize_host,
    from_checkpoint,
    quantize,
    relayout,
)
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.megablox import MegabloxConfig
from moe_tune.kernels.ragged_dot.triton import TritonConfig
from moe_tune.layer.moe import weight_spec

OP = get_op("ragged_dot")
SIZES = [21, 0, 30, 9]  # an empty group; rows 60..63 past sum(group_sizes)
M, K, N = 64, 256, 64
G = len(SIZES)
# (dtype, block along k): per channel, and the sub-channel blocks of fp8 / int4 / mxfp4
FORMATS = {"int8": ("int8", None), "fp8/128": ("float8_e4m3fn", 128), "int4/128": ("int4", 128),
           "mxfp4": ("mxfp4", None)}


def _weights(seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((G, K, N), np.float32) / 16)


def _both(name: str, w: jax.Array | None = None) -> tuple[QArray, QArray]:
    """The weights quantized to format `name`, stored "kn" and "nk"."""
    dtype, block = FORMATS[name]
    w = _weights() if w is None else w
    return tuple(quantize(w, dtype, axis=1, block_size=block, layout=layout) for layout in ("kn", "nk"))


def _bits(x) -> np.ndarray:
    """An array's values as float32 (every stored dtype converts exactly), for bitwise comparisons."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("name", list(FORMATS))
def test_nk_stores_the_transpose_and_reads_as_kn(name):
    kn, nk = _both(name)
    assert nk.layout == "nk" and kn.layout == "kn" and nk.shape == kn.shape == (G, K, N)
    assert nk.qvalue.shape == (G, N, K) and nk.qvalue.dtype == kn.qvalue.dtype
    assert nk.scale.shape == (G, N, kn.scale.shape[1]) and nk.scale_shape == kn.scale.shape
    np.testing.assert_array_equal(_bits(nk.qvalue), _bits(jnp.swapaxes(kn.qvalue, 1, 2)))
    np.testing.assert_array_equal(_bits(nk.scale), _bits(jnp.swapaxes(kn.scale, 1, 2)))
    np.testing.assert_array_equal(np.asarray(dequantize(nk)), np.asarray(dequantize(kn)))
    host = lambda q: jax.tree.map(np.asarray, q)
    np.testing.assert_array_equal(dequantize_host(host(nk)), dequantize_host(host(kn)))
    back = relayout(nk, "kn")
    assert back.layout == "kn" and relayout(kn, "kn") is kn
    for mine, theirs in zip(jax.tree.leaves(back), jax.tree.leaves(kn)):
        np.testing.assert_array_equal(_bits(mine), _bits(theirs))
    host_nk = relayout(host(kn), "nk")  # host arrays stay NumPy, stored in their new order
    assert isinstance(host_nk.qvalue, np.ndarray) and host_nk.qvalue.flags.c_contiguous
    np.testing.assert_array_equal(_bits(host_nk.qvalue), _bits(nk.qvalue))
    assert nk[1:3].layout == "nk" and nk[1:3].shape == (2, K, N)  # a slice of experts keeps the layout


def test_from_checkpoint_takes_an_nk_checkpoint_as_stored():
    """gpt-oss-style mxfp4 experts stored [g, n, k]: uint8 two values a byte along k, e8m0 scale bytes."""
    kn, nk = _both("mxfp4")
    codes = np.asarray(jax.lax.bitcast_convert_type(nk.qvalue, jnp.uint4).astype(jnp.uint8))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the low nibble first
    scale_bits = np.asarray(jax.lax.bitcast_convert_type(nk.scale.astype(jnp.float8_e8m0fnu), jnp.uint8))
    loaded = from_checkpoint(packed, scale_bits, "mxfp4", packed_axis=-1, layout="nk")
    assert loaded.layout == "nk" and loaded.qvalue.shape == (G, N, K) and loaded.shape == (G, K, N)
    np.testing.assert_array_equal(np.asarray(dequantize(loaded)), np.asarray(dequantize(kn)))
    as_kn = from_checkpoint(np.asarray(kn.qvalue), np.asarray(kn.scale), "mxfp4")
    np.testing.assert_array_equal(np.asarray(dequantize(relayout(as_kn, "nk"))), np.asarray(dequantize(loaded)))


def test_layout_is_static_pytree_data():
    kn, nk = _both("int8")
    assert jax.tree.structure(kn) != jax.tree.structure(nk)  # jit traces each layout apart
    assert jax.tree.map(lambda x: x * 1, nk).layout == "nk"
    through = jax.jit(lambda q: q)(nk)
    assert through.layout == "nk" and through.qvalue.shape == (G, N, K)
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(nk)), np.asarray(dequantize(kn)))


def test_shard_map_specs_follow_the_stored_axes():
    """The layer's spec of expert weights names the logical axes; an "nk" array's stored ones get it swapped
    (the expert axis stays axis 0), its scales split with them."""
    mesh = type("Mesh", (), {"shape": {"e": 2, "t": 2}})()
    _, nk = _both("int4/128")
    spec = weight_spec(nk, "w_gate", ("e", None, "t"), mesh)  # [E, k, f] split by experts and by f
    assert spec == QArray(P("e", "t", None), P("e", "t", None), "nk")
    down = weight_spec(nk, "w_down", ("e", "t", None), mesh)  # [E, f, d]: k (here 256, 2 blocks) split
    assert down == QArray(P("e", None, "t"), P("e", None, "t"), "nk")
    per_channel = _both("int8")[1]
    assert weight_spec(per_channel, "w_down", ("e", "t", None), mesh) == QArray(P("e", None, "t"),
                                                                                 P("e", None, None), "nk")


def test_bad_layouts_are_one_line_usage_errors():
    w = _weights()
    calls = [lambda: quantize(w, "int8", axis=1, layout="mk"),
             lambda: QArray(np.ones((2, 4), np.int8), np.ones((2, 1), np.float32), "KN"),
             lambda: relayout(quantize(w, "int8", axis=1), "n,k"),
             lambda: from_checkpoint(np.ones((2, 4), np.int8), np.ones((2, 1), np.float32), "int8", layout=None),
             lambda: RaggedDotProblem(m=8, k=K, n=N, groups=G, rhs_qdtype="int8", rhs_qlayout="nn")]
    for call in calls:
        with pytest.raises(UsageError, match="must be one of kn, nk") as err:
            call()
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="rank >= 2"):
        quantize(jnp.ones((8,)), "int8", axis=0, layout="nk")
    with pytest.raises(UsageError, match="needs rhs_qdtype"):
        RaggedDotProblem(m=8, k=K, n=N, groups=G, rhs_qlayout="nk")
    with pytest.raises(UsageError, match="needs rhs_quant"):
        OP.problem(m=8, k=K, n=N, groups=G, rhs_qlayout="nk")


def test_the_key_has_rhs_qlayout_for_nk_weights_only():
    lhs, sizes = jnp.ones((M, K)), jnp.asarray(SIZES, jnp.int32)
    kn, nk = _both("int4/128")
    plain = RaggedDotProblem.from_arrays(lhs, kn, sizes)
    stored = RaggedDotProblem.from_arrays(lhs, nk, sizes)
    asked = OP.problem(m=M, k=K, n=N, groups=G, rhs_quant="int4", quant_block=128)
    assert plain == asked == OP.problem(m=M, k=K, n=N, groups=G, rhs_quant="int4", quant_block=128,
                                        rhs_qlayout="kn")
    assert "rhs_qlayout" not in plain.key_fields() and plain.rhs_qlayout is None
    assert stored.key_fields() == {**plain.key_fields(), "rhs_qlayout": "nk"}
    assert stored == OP.problem(m=M, k=K, n=N, groups=G, rhs_quant="int4", quant_block=128, rhs_qlayout="nk")
    assert RaggedDotProblem.from_key_fields(stored.key_fields()) == stored
    inputs = OP.make_inputs(stored, "balanced", seed=0)  # a sweep of nk weights runs on nk weights
    assert inputs["b"].layout == "nk" and inputs["b"].qvalue.shape == (G, N, K)
    shapes = OP.input_shapes(stored, lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype))
    assert shapes["b"].layout == "nk" and shapes["b"].qvalue.shape == (G, N, K) and shapes["b"].shape == (G, K, N)


def test_an_nk_sweep_is_stored_apart_and_found_by_the_runtime(isolated_profiles):
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    shape = ["--m", "32", "--k", "64", "--n", "32", "--groups", "2", "--rhs-quant", "int8"]
    result = run("sweep", *shape, "--rhs-qlayout", "nk", "--backend", "tiled", "--max-candidates", "2",
                 "--samples", "1", "--workers", "1")
    assert result.exit_code == 0, result.output
    (key, data), = json.loads((isolated_profiles / "cpu" / "ragged_dot.json").read_text())["entries"].items()
    assert data["fields"]["rhs_qlayout"] == "nk" and key.endswith("|rhs_qlayout=nk|backend=tiled|distribution=balanced")
    lhs, sizes = jnp.ones((32, 64)), jnp.asarray([16, 16], jnp.int32)
    w = jnp.ones((2, 64, 32))
    nk, kn = (quantize(w, "int8", axis=1, layout=layout) for layout in ("nk", "kn"))
    assert OP.lookup(RaggedDotProblem.from_arrays(lhs, nk, sizes), backend="tiled").source == "exact"
    assert OP.lookup(RaggedDotProblem.from_arrays(lhs, kn, sizes), backend="tiled").source != "exact"
    assert run("validate").exit_code == 0
    assert "nk" in run("lookup", *shape, "--rhs-qlayout", "nk", "--backend", "tiled").output


def _equal_across_layouts(backend: str, kn: QArray, nk: QArray, configs=None, drhs: bool = False) -> None:
    """Each direction's kernel through `backend.run` (fwd and dlhs on the weights; with `drhs`, drhs of an
    int8 lhs stored in each layout too), both layouts in one jit: "nk" bitwise "kn"."""
    rng = np.random.default_rng(3)
    impl, sizes = BACKENDS.get(backend), jnp.asarray(SIZES, jnp.int32)
    fwd = RaggedDotProblem.from_arrays(jnp.ones((M, K)), nk, sizes)
    x = rng.standard_normal((M, K), np.float32)
    cases = [("fwd", fwd, x, (nk, kn)), ("dlhs", fwd.with_direction("dlhs"), rng.standard_normal((M, N)), (nk, kn))]
    if drhs:
        lhs = [quantize(jnp.asarray(x), "int8", axis=1, block_size=128, layout=layout) for layout in ("nk", "kn")]
        assert lhs[0].qvalue.shape == (K, M)  # the rule is the array's: a [m, k] lhs stored [k, m]
        problem = RaggedDotProblem.from_arrays(lhs[0], jnp.ones((G, K, N)), sizes).with_direction("drhs")
        cases.append(("drhs", problem, rng.standard_normal((M, N)), tuple(lhs)))
    for direction, problem, other, pair in cases:
        config = (configs or {}).get(direction) or impl.default_config(problem)
        assert impl.config_error(config, problem) is None, (direction, config)
        mine, theirs = _run_both(impl, problem, config, jnp.asarray(other, jnp.float32), pair, sizes)
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs), err_msg=direction)


def _run_both(impl, problem, config, other, pair, sizes):
    """One direction on each QArray of `pair` (the quantized operand: b, or drhs's a) in one jit."""
    def run(q):
        a, b = (q, other) if problem.direction == "drhs" else (other, q)
        return impl.run(problem, config, a, b, sizes)
    return jax.jit(lambda x, y: (run(x), run(y)))(*pair)


@pytest.mark.parametrize("backend", ["xla", "tiled"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_backends_equal_across_layouts(backend, name):
    _equal_across_layouts(backend, *_both(name), drhs=name == "int8")


# interpret mode: two k steps of 128 (fwd), whole n (dlhs contracts n = 64)
PALLAS = {"megablox": {"fwd": MegabloxConfig(16, 128, N), "dlhs": MegabloxConfig(16, N, 128)},
          "triton": {"fwd": TritonConfig(32, 128, 64), "dlhs": TritonConfig(32, 64, 128)}}


@pytest.mark.parametrize("backend", list(PALLAS))
@pytest.mark.parametrize("name", list(FORMATS))
def test_pallas_kernels_equal_across_layouts(backend, name):
    """megablox (Mosaic TPU) and triton in interpret mode."""
    _equal_across_layouts(backend, *_both(name), PALLAS[backend])


def test_the_op_and_its_vjp_take_nk_weights():
    """The public op: forward and lhs's gradient (dlhs, on the quantized weights) bitwise "kn"'s."""
    lhs = jnp.asarray(np.random.default_rng(1).standard_normal((M, K), np.float32))
    sizes = jnp.asarray(SIZES, jnp.int32)

    def grads(rhs):
        out, vjp = jax.vjp(lambda x: moe_tune.ragged_dot(x, rhs, sizes, backend="xla"), lhs)
        return out, vjp(jnp.ones_like(out))[0]

    kn, nk = _both("int4/128")
    for mine, theirs in zip(jax.jit(grads)(nk), jax.jit(grads)(kn)):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_fused_dispatch_and_combine_take_nk_weights():
    """gather_gmm of (gate, up) parts with glu and gmm_combine on the platform's fused backend: "nk" weights
    give "kn"'s results bitwise."""
    rng = np.random.default_rng(4)
    tokens, sizes = 24, jnp.asarray(SIZES, jnp.int32)
    x = jnp.asarray(rng.standard_normal((tokens, K), np.float32))
    rows = jnp.asarray(rng.integers(0, tokens, M), jnp.int32)
    weights = jnp.asarray(rng.random(M), jnp.float32)
    gate, up = (_both("int4/128", _weights(seed)) for seed in (5, 6))
    down = _both("int8", jnp.asarray(rng.standard_normal((G, N, K), np.float32) / 8))

    def layer(i: int):
        h = moe_tune.gather_gmm(x, rows, (gate[i], up[i]), sizes, glu="silu")
        return h, moe_tune.gmm_combine(h, down[i], sizes, rows, weights, tokens)

    for mine, theirs in zip(jax.jit(lambda: layer(1))(), jax.jit(lambda: layer(0))()):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_the_sharded_layer_takes_nk_weights():
    """sharded_moe_mlp on this host's one device (the specs of every stored axis through shard_map): "nk"
    expert weights give "kn"'s output bitwise."""
    rng = np.random.default_rng(7)
    tokens, hidden, width, experts = 16, 32, 16, 4
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32))
    logits = jnp.asarray(rng.standard_normal((tokens, experts), np.float32))
    floats = [rng.standard_normal(shape, np.float32) / 4 for shape in
              [(experts, hidden, width)] * 2 + [(experts, width, hidden)]]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("expert", "tensor"))

    def layer(layout: str):
        w = [quantize(jnp.asarray(f), "int8", axis=1, layout=layout) for f in floats]
        return jax.jit(lambda x, l, *w: moe_tune.sharded_moe_mlp(x, l, *w, 2, mesh=mesh, tensor_axis="tensor"))(
            x, logits, *w)

    out = np.asarray(layer("kn"))
    assert np.abs(out).max() > 0
    np.testing.assert_array_equal(np.asarray(layer("nk")), out)
