"""One of XLA's CPU flags against a decode step's and a prompt pass's weight products (profile.md): the 210
products of a vector with SmolLM2's 30 layers' weights (random, [in, out]) and the same weights against a
2048-token prompt, timed 20 and 3 times after a compiling call (median, min, max ms, and the compile seconds). Run
each flag in its own process: XLA_FLAGS=FLAG python xla_flags.py NAME"""
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: a CPU run only (libtpu never starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

D, F, L = 576, 1536, 30
rng = np.random.default_rng(0)
shapes = [(D, D), (D, 192), (D, 192), (D, D), (D, F), (D, F), (F, D)]
W = [[jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02) for s in shapes] for _ in range(L)]
def layers(x, weights):
    for w in weights:
        q, k, v = x @ w[0], x @ w[1], x @ w[2]
        a = q @ w[3] + jnp.sum(k) + jnp.sum(v)
        x = x + (jax.nn.silu(a @ w[4]) * (a @ w[5])) @ w[6] * 0.01
    return x
f = jax.jit(layers)
x1 = jnp.asarray(rng.standard_normal((1, D), dtype=np.float32))
xT = jnp.asarray(rng.standard_normal((2048, D), dtype=np.float32))
res = {}
for name, x, n in (("decode", x1, 20), ("prefill2k", xT, 3)):
    t0 = time.perf_counter(); y = f(x, W).block_until_ready(); c = time.perf_counter() - t0
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(x, W).block_until_ready(); ts.append(time.perf_counter() - t)
    res[name] = (round(1e3 * float(np.median(ts)), 2), round(1e3 * min(ts), 2), round(1e3 * max(ts), 2), round(c, 2))
print(sys.argv[1], json.dumps(res), flush=True)
