"""The MoE layer on a GPU, for `gpu_check.py --layers`: fused against unfused, each on its tuned kernels.

For one preset, token count and ep: every forward kernel call of the layer (`models.layer_runs`, direction
fwd: the ragged_dots, the gathers and the two fused stages) is swept on `triton` (each candidate checked
against its float64 reference) into the check's tables, then `moe_mlp` runs as three programs, compiled once
each and timed interleaved in the same trace rounds (`fused_cpu.timed`):

  * unfused: the GPU defaults (triton ragged_dot and gathers, `registry.py`), on the configs tuned here;
  * fused_jax: `fused=True` on the plain-JAX fused backend (the GPU default for fused_moe today);
  * fused_triton: `fused=True` on the triton fused kernels, on the configs tuned here.

Forward and forward+backward (the backward kernels run their default configs: only the forward is swept).
Each variant's output is compared with the layer in float32 (the fused_jax program on float32 copies of the
inputs, float32 dots): `rel_error` is the relative Frobenius error. This is the evidence for the GPU default of fused_moe
and of `moe_fusion` (`kernels/fused_moe/registry.py`). Nothing is asserted here.
"""

from __future__ import annotations

import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from fused_cpu import layer_inputs, timed
from moe_tune import moe_mlp, use_backend
from moe_tune.core import settings
from moe_tune.layer.models import ModelPreset, get_preset, layer_runs
from moe_tune.tuner import SweepRequest, run_sweep

# A layer small enough for interpret mode (`--small`): 2 experts per token over 8.
TOY = ModelPreset(name="toy", hidden=64, expert_intermediate=32, experts=8, top_k=2, shared_experts=0)
VARIANTS = {"unfused": (False, None), "fused_jax": (True, "jax"), "fused_triton": (True, "triton")}


def _layer(preset: ModelPreset, ep: int, fused: bool, backend: str | None):
    """inputs -> the layer's output, traced inside a `use_backend` block for the fused op where one is named."""
    def run(a):
        call = lambda: moe_mlp(a["x"], a["logits"], a["w_gate"], a["w_up"], a["w_down"], preset.top_k,
                               expert_offset=0 if ep > 1 else None, fused=fused)
        if backend is None:
            return call()
        with use_backend("fused_moe", backend):
            return call()
    return run


def _train(fn):
    return jax.grad(lambda a: jnp.sum(fn(a).astype(jnp.float32)))


def _sweeps(preset: ModelPreset, tokens: int, ep: int, dtype: str, max_candidates: int, profile_dir: str) -> list:
    """Sweep every forward kernel call of the layer on triton; a summary per sweep."""
    done = []
    for kc in layer_runs(preset, tokens, dtype=dtype, ep=ep, direction="fwd"):
        if kc.op == "moe_fusion":  # the choice between the layers: timed below instead
            continue
        started = time.perf_counter()
        sweep = run_sweep(SweepRequest.make(kc.op, kc.problem, backend="triton", max_candidates=max_candidates,
                                            profile_dir=profile_dir, cold=True))
        summary = {"op": kc.op, "role": kc.role, "shape": kc.problem.key_fields(),
                   "wall_s": time.perf_counter() - started, "config": sweep.best.config,
                   **{key: getattr(sweep.entry, key) for key in ("candidates", "failures", "timing_fallback",
                                                                 "speedup_over_default", "verdict")}}
        print(f"  swept {kc.op} {kc.role}: {summary['candidates']['tried']} candidates in {summary['wall_s']:.1f} s, "
              f"best {summary['config']}", flush=True)
        done.append(summary)
    return done


def _errors(preset: ModelPreset, ep: int, inputs: dict) -> dict[str, float]:
    """Each variant's forward output against the layer in float32, as a relative Frobenius error."""
    wide = {k: v.astype(jnp.float32) for k, v in inputs.items()}
    with jax.default_matmul_precision("float32"):  # not TF32, which a GPU may use for float32 dots
        reference = np.asarray(jax.jit(_layer(preset, ep, True, "jax"))(wide), np.float64)
    errors = {}
    for name, (fused, backend) in VARIANTS.items():
        out = np.asarray(jax.jit(_layer(preset, ep, fused, backend))(inputs).astype(jnp.float32), np.float64)
        errors[name] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
    return errors


def layer_case(name: str, tokens: int, ep: int, *, dtype: str, samples: int, max_candidates: int,
               profile_dir: str) -> dict:
    """Sweep, check and time one layer (module docstring); errors are recorded, never raised."""
    preset = TOY if name == "toy" else get_preset(name)
    case = {"model": name, "op": "moe_layer", "tokens": tokens, "ep": ep, "dtype": dtype}
    print(f"\nlayer {name} tokens={tokens} ep={ep} {dtype}", flush=True)
    try:
        os.environ[settings.PROFILE_DIR] = profile_dir  # the layer's lookups read the tables swept here
        case["sweeps"] = _sweeps(preset, tokens, ep, dtype, max_candidates, profile_dir)
        inputs = layer_inputs(preset, tokens, ep, dtype)
        case["rel_error"] = _errors(preset, ep, inputs)
        print("  rel error vs float32: " + ", ".join(f"{k} {v:.2e}" for k, v in case["rel_error"].items()),
              flush=True)
        case["modes"] = {}
        for mode, wrap in (("fwd", lambda f: f), ("fwd+bwd", _train)):
            fns = {v: wrap(_layer(preset, ep, fused, backend)) for v, (fused, backend) in VARIANTS.items()}
            result = timed(fns, inputs, samples)
            t = result["times_s"]
            result["ratios"] = {"unfused_vs_fused_triton": t["unfused"] / t["fused_triton"],
                                "fused_jax_vs_fused_triton": t["fused_jax"] / t["fused_triton"]}
            case["modes"][mode] = result
            print(f"  {mode:<7} " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items())
                  + f"; unfused/fused_triton {result['ratios']['unfused_vs_fused_triton']:.2f}, "
                    f"fused_jax/fused_triton {result['ratios']['fused_jax_vs_fused_triton']:.2f} "
                    f"(spread {max(result['spread'].values()):.0%})", flush=True)
    except Exception as e:  # noqa: BLE001 - record it and go on to the next case
        case["error"] = f"{type(e).__name__}: {e}"
        case["traceback"] = traceback.format_exc()[-4000:]
        print(f"  FAILED {case['error'][:300]}", flush=True)
    return case
