"""One tile's dx dot of the fused dispatch's backward on CPU, alone: a [tm, f] @ w[g]^T (w [d, f], "NT", as
`fused_moe/tiled.py` forms it with transpose_rhs) against the pre-transposed weight ("NN"), whole or in 4
column blocks, at tm 128/256/384, in bfloat16 and float32, at deepseek-v2-lite's f=1408, d=2048 (one
24576-row pass over 4 groups). Prints min-of-3 time and GFLOP/s per form. Why: the breakdown of deepseek
bf16 prefill fwd+bwd showed the fused dx dots at ~223 GFLOP/s (FINDINGS.md: fused layer prefill).

    .venv/bin/python benchmarks/dot_forms_cpu.py
"""
import time, jax, jax.numpy as jnp, numpy as np
NT=(((1,),(1,)),((),()))
NN=(((1,),(0,)),((),()))
f,d=1408,2048
rng=np.random.default_rng(0)
W=jnp.asarray(rng.standard_normal((4,d,f)),jnp.bfloat16)   # like gate [groups, d, f]
WT=jnp.asarray(np.swapaxes(np.asarray(W),1,2))             # [groups, f, d]
def loop(tm, form, blocks=1):
    reps=24576//tm//4
    @jax.jit
    def run(a, W, WT):
        def body(i, acc):
            g=i%4
            x=jax.lax.dynamic_slice_in_dim(a, (i*tm)%(a.shape[0]-tm), tm)
            if form=='NT':
                w=W[g]
                outs=[jax.lax.dot_general(x, w[j*d//blocks:(j+1)*d//blocks], NT, preferred_element_type=jnp.float32) for j in range(blocks)]
            else:
                w=WT[g]
                outs=[jax.lax.dot_general(x, w[:, j*d//blocks:(j+1)*d//blocks], NN, preferred_element_type=jnp.float32) for j in range(blocks)]
            return acc+jnp.concatenate(outs,1)[:8]
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((8,d),jnp.float32))
    return run, reps
a=jnp.asarray(rng.standard_normal((4096,f)),jnp.bfloat16)
for dt in [jnp.bfloat16, jnp.float32]:
  A=a.astype(dt); Wd=W.astype(dt); WTd=WT.astype(dt)
  for tm in (128,256,384):
    for form,blocks in (('NT',1),('NN',1),('NT',4),('NN',4)):
        run,reps=loop(tm,form,blocks); run(A,Wd,WTd).block_until_ready()
        ts=[]
        for _ in range(3):
            t=time.perf_counter(); run(A,Wd,WTd).block_until_ready(); ts.append(time.perf_counter()-t)
        fl=2*tm*f*d*reps
        print(jnp.dtype(dt).name, tm, form, blocks, f"{min(ts)*1e3:.0f} ms", f"{fl/min(ts)/1e9:.0f} GFLOP/s", flush=True)
