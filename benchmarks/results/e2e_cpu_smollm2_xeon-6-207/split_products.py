"""The 210 weight products of a SmolLM2 decode step (random weights, [in, out]) three ways, 20 interleaved runs:
plain, each product split in two halves along its output by slicing, and with the halves stored apart (two
independent dots the two cores could run at once); first the largest difference from plain. profile.md:
python split_products.py LABEL (both cores), taskset -c 0 python split_products.py LABEL (one)"""
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
# split each product into two halves along `out` (two independent dots the executor may run at once)
def mv2(a, m):
    h = m.shape[1] // 2
    return jnp.concatenate([a @ m[:, :h], a @ m[:, h:]], -1)
def layers2(x, weights):
    for w in weights:
        q, k, v = mv2(x, w[0]), x @ w[1], x @ w[2]
        a = mv2(q, w[3]) + jnp.sum(k) + jnp.sum(v)
        x = x + mv2(jax.nn.silu(mv2(a, w[4])) * mv2(a, w[5]), w[6]) * 0.01
    return x
Wh = [[(w[:, :w.shape[1]//2], w[:, w.shape[1]//2:]) for w in ws] for ws in W]
Wh = jax.tree.map(lambda a: jnp.asarray(np.asarray(a).copy()), Wh)
def mvh(a, m):
    return jnp.concatenate([a @ m[0], a @ m[1]], -1)
def layers3(x, weights):
    for w in weights:
        q, k, v = mvh(x, w[0]), mvh(x, w[1]), mvh(x, w[2])
        a = mvh(q, w[3]) + jnp.sum(k) + jnp.sum(v)
        x = x + mvh(jax.nn.silu(mvh(a, w[4])) * mvh(a, w[5]), w[6]) * 0.01
    return x
fs = {"plain": (jax.jit(layers), W), "split_view": (jax.jit(layers2), W), "split_stored": (jax.jit(layers3), Wh)}
x = jnp.asarray(rng.standard_normal((1, D), dtype=np.float32))
ts = {k: [] for k in fs}
outs = {k: np.asarray(f(x, w)) for k, (f, w) in fs.items()}
print({k: float(np.abs(v - outs["plain"]).max()) for k, v in outs.items()})
for _ in range(20):
    for k, (f, w) in fs.items():
        t = time.perf_counter(); f(x, w).block_until_ready(); ts[k].append(1e3 * (time.perf_counter() - t))
print(sys.argv[1:], {k: (round(np.median(v), 2), round(min(v), 2), round(max(v), 2)) for k, v in ts.items()})
