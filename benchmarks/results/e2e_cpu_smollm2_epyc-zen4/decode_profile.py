"""Where a SmolLM2 decode step goes on this CPU (profile.md): the 32-token decode loop under FullCache after a T-token
prompt (batch 1), timed, then one run under jax's profiler with its ops' durations summed by kind; and the same 210
matrix-vector products a step makes (30 layers' q, k, v, o, gate, up, down) with the weights stored [in, out], as
kvjax stores them, against [out, in]. From the repository root:
python benchmarks/results/e2e_cpu_smollm2_epyc-zen4/decode_profile.py T TRACE_DIR"""
import collections
import glob
import gzip
import json
import re
import sys
import time

import kvjax.backends  # noqa: F401  (before jax: the platform and its flags)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import driver
from kvjax import Sampling, drive
from kvjax.generate import bucket_length, decode_fn, eos_array, pad_left, prefill_fn
from kvjax.policies import FullCache

n, trace, new = int(sys.argv[1]), sys.argv[2], 32
model = driver.load_model("smollm2").model
graphdef, state = nnx.split(model)
tokens, positions = pad_left(np.random.default_rng(0).integers(4, 49152, (1, n)).tolist(), bucket_length(n), 0)
key = jax.random.key(0)
plan = drive.plan(model, FullCache(), tokens.shape[1] + new, tokens.shape[1])
first, ok, cache = prefill_fn.pure(graphdef, state, tokens, positions, key, plan=plan, sampling=Sampling())
args = (first, ok, jnp.full((1,), n, jnp.int32), key, jnp.asarray(eos_array(())), jnp.int32(new), jnp.int32(0),
        jnp.int32(0))
dec = decode_fn.pure.lower(graphdef, state, cache, *args, plan=plan, sampling=Sampling(), buffer=new).compile()


def run():
    c = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
    t = time.perf_counter()
    jax.block_until_ready(dec(graphdef, state, c, *args))
    return time.perf_counter() - t


run()
ts = [run() for _ in range(5)]
print(f"decode loop, {n}-token prompt: {[round((new - 1) / x, 1) for x in ts]} tok/s (5 runs)")
c = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
jax.profiler.start_trace(trace, create_perfetto_trace=True)
jax.block_until_ready(dec(graphdef, state, c, *args))
jax.profiler.stop_trace()
events = json.load(gzip.open(sorted(glob.glob(trace + "/**/*.trace.json.gz", recursive=True))[-1]))["traceEvents"]
ms, calls = collections.Counter(), collections.Counter()
for e in events:
    if e.get("ph") == "X":
        kind = re.sub(r"\.\d+$", "", e["name"])
        ms[kind] += e["dur"] / 1e3
        calls[kind] += 1
print(f"profiled run, {new - 1} steps; ms summed by op kind (both cores' threads):")
for kind, v in ms.most_common(12):
    print(f"  {v:8.1f} ms x{calls[kind]:<5d} {kind}")

rng = np.random.default_rng(0)
shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
w_in_out = [[jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for s in shapes] for _ in range(30)]
w_out_in = [[w.T.copy() for w in ws] for ws in w_in_out]
x = jnp.asarray(rng.standard_normal((1, 576), np.float32))


def layers(x, weights, mv):
    for w in weights:
        q, k, v = mv(x, w[0]), mv(x, w[1]), mv(x, w[2])
        a = mv(q, w[3]) + jnp.sum(k) + jnp.sum(v)
        x = x + mv(jax.nn.silu(mv(a, w[4])) * mv(a, w[5]), w[6]) * 0.01
    return x


forms = {"[in, out] (x @ w)": (jax.jit(lambda x, w: layers(x, w, lambda a, m: a @ m)), w_in_out),
         "[out, in] (x @ w.T)": (jax.jit(lambda x, w: layers(x, w, lambda a, m: a @ m.T)), w_out_in)}
seconds = {name: [] for name in forms}
for fn, w in forms.values():
    fn(x, w).block_until_ready()
for _ in range(20):  # interleaved
    for name, (fn, w) in forms.items():
        t = time.perf_counter()
        fn(x, w).block_until_ready()
        seconds[name].append(time.perf_counter() - t)
nbytes = 30 * sum(a * b for a, b in shapes) * 4
print("210 matrix-vector products (one step's weights, 405 MiB), median of 20 interleaved runs (min-max):")
for name, s in seconds.items():
    m = float(np.median(s))
    print(f"  {name:20s} {m * 1e3:6.2f} ms ({min(s) * 1e3:.2f}-{max(s) * 1e3:.2f}), {nbytes / m / 1e9:4.1f} GB/s")
