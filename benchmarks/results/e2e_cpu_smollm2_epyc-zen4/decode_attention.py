"""Decode attention over 30 layers' caches (SmolLM2: kvh 3, g 3, d 64, f32, batch 1), variants timed (profile.md).
Run from the repository root: python benchmarks/results/e2e_cpu_smollm2_epyc-zen4/decode_attention.py C [names]."""
import sys, time, os
import kvjax.backends
import jax, jax.numpy as jnp, numpy as np
C = int(sys.argv[1]); L, b, kvh, g, d = 30, 1, 3, 3, 64
rng = np.random.default_rng(0)
ks = [jnp.asarray(rng.standard_normal((b, kvh, C, d), np.float32)) for _ in range(L)]
vs = [jnp.asarray(rng.standard_normal((b, kvh, C, d), np.float32)) for _ in range(L)]
q = jnp.asarray(rng.standard_normal((b, kvh * g, d), np.float32))
def qk_base(q, k):
    return jnp.einsum("bkgd,bkcd->bkgc", q.reshape(b, kvh, g, d), k)
def qk_dense(q, k):
    s = jnp.einsum("bcd,bqd->bqc", k.reshape(b, kvh * C, d), q).reshape(b, kvh, g, kvh, C)
    return jnp.stack([s[:, i, :, i] for i in range(kvh)], 1)
def qk_dense2(q, k):
    s = jnp.einsum("bcd,bqd->bcq", k.reshape(b, kvh * C, d), q).reshape(b, kvh, C, kvh, g)
    return jnp.stack([s[:, i, :, i] for i in range(kvh)], 1).transpose(0, 1, 3, 2)
def qk_loop(q, k):
    qg = q.reshape(b, kvh, g, d)
    return jnp.stack([jnp.einsum("bgd,bcd->bgc", qg[:, i], k[:, i]) for i in range(kvh)], 1)
def pv_base(p, v):
    return jnp.einsum("bkgc,bkcd->bkgd", p, v)
def pv_dense(p, v):
    eye = jnp.eye(kvh, dtype=p.dtype)
    pf = (p[:, :, :, None, :] * eye[None, :, None, :, None]).reshape(b, kvh * g, kvh * C)
    return jnp.einsum("bqc,bcd->bqd", pf, v.reshape(b, kvh * C, d)).reshape(b, kvh, g, d)
def pv_loop(p, v):
    return jnp.stack([jnp.einsum("bgc,bcd->bgd", p[:, i], v[:, i]) for i in range(kvh)], 1)
def make(qk, pv):
    def f(q, k, v):
        s = qk(q, k) * 0.125
        p = jax.nn.softmax(s, axis=-1)
        return pv(p, v).reshape(b, kvh * g, d)
    return f
variants = {"base": make(qk_base, pv_base), "qkdense": make(qk_dense, pv_base), "qkdense2": make(qk_dense2, pv_base),
            "qkloop": make(qk_loop, pv_loop), "dense_both": make(qk_dense, pv_dense), "pvdense": make(qk_base, pv_dense)}
def perhead(q, k, v):
    qg = q.reshape(b, kvh, g, d)
    outs = []
    for i in range(kvh):
        s = jnp.einsum("bgd,bcd->bgc", qg[:, i], k[:, i]) * 0.125
        p = jax.nn.softmax(s, axis=-1)
        outs.append(jnp.einsum("bgc,bcd->bgd", p, v[:, i]))
    return jnp.stack(outs, 1).reshape(b, kvh * g, d)
def halves(q, k, v):
    qg = q.reshape(b, kvh, g, d)
    h = C // 2
    parts = []
    for j in range(2):
        kj = jax.lax.slice_in_dim(k, j * h, (j + 1) * h, axis=2); vj = jax.lax.slice_in_dim(v, j * h, (j + 1) * h, axis=2)
        s = jnp.einsum("bkgd,bkcd->bkgc", qg, kj) * 0.125
        m = s.max(-1, keepdims=True); e = jnp.exp(s - m)
        parts.append((m, e.sum(-1, keepdims=True), jnp.einsum("bkgc,bkcd->bkgd", e, vj)))
    m = jnp.maximum(parts[0][0], parts[1][0])
    z = sum(zz * jnp.exp(mm - m) for mm, zz, _ in parts); o = sum(oo * jnp.exp(mm - m) for mm, _, oo in parts)
    return (o / z).reshape(b, kvh * g, d)
def time_all(fns, names=None):
    """Each variant over 30 layers (serially dependent), jitted: the median of 15 runs, the bytes of K and V over it."""
    ref = None
    for name, f in fns.items():
        if names and name not in names:
            continue

        @jax.jit
        def run(q, ks, vs, f=f):
            x = q
            for k, v in zip(ks, vs):
                x = f(x, k, v) * 0.5 + q * 0.5
            return x
        out = run(q, ks, vs).block_until_ready()
        ref = out if ref is None else ref
        ts = []
        for _ in range(15):
            t = time.perf_counter(); run(q, ks, vs).block_until_ready(); ts.append(time.perf_counter() - t)
        nbytes = 2 * L * b * kvh * C * d * 4; med = float(np.median(ts))
        print(f"{name:10s} C={C} {med*1e3:7.2f} ms ({min(ts)*1e3:.2f}-{max(ts)*1e3:.2f})  {nbytes/med/1e9:5.1f} GB/s  "
              f"maxdiff {float(jnp.max(jnp.abs(out-ref))):.2e}", flush=True)


variants.update(perhead=perhead, halves=halves)
time_all(variants, sys.argv[2].split(",") if len(sys.argv) > 2 else None)
