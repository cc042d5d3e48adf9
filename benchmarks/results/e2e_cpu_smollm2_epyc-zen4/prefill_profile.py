"""A prompt pass of SmolLM2 under FullCache (batch 1), timed, its compiled HLO written and one run profiled by jax
(profile.md). From the repository root: python benchmarks/results/e2e_cpu_smollm2_epyc-zen4/prefill_profile.py T [HLO [TRACE]]."""
import sys, time, functools
import kvjax.backends
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from experiments import driver
from kvjax import drive, Sampling
from kvjax.generate import prefill_fn, pad_left, bucket_length
from kvjax.policies import FullCache
n = int(sys.argv[1])
import os
if os.environ.get("TORCH"):
    import torch; x = torch.ones(1000, 1000); (x @ x).sum()
    print("torch threads", torch.get_num_threads())
lm = driver.load_model("smollm2"); model = lm.model
rng = np.random.default_rng(0)
prompts = rng.integers(4, 49152, (1, n))
graphdef, state = nnx.split(model)
tokens, positions = pad_left(prompts.tolist(), bucket_length(n), 0)
key = jax.random.key(0)
kw = dict(plan=drive.plan(model, FullCache(), tokens.shape[1] + 32, tokens.shape[1]), sampling=Sampling())
c = prefill_fn.pure.lower(graphdef, state, tokens, positions, key, **kw).compile()
if len(sys.argv) > 2:
    open(sys.argv[2], "w").write(c.as_text())
pre = lambda: jax.block_until_ready(c(graphdef, state, tokens, positions, key))
pre()
ts = []
for _ in range(3):
    t = time.perf_counter(); pre(); ts.append(time.perf_counter() - t)
print("prefill", n, [round(x, 3) for x in ts], flush=True)
if len(sys.argv) > 3:
    jax.profiler.start_trace(sys.argv[3]); pre(); jax.profiler.stop_trace()
