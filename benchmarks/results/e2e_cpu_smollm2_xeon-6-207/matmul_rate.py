"""The float32 matmul rate of XLA (jax) and of PyTorch on this CPU, interleaved in one process (15 runs each after a
warm-up; median GFLOP/s, with the slowest and fastest run): a 2048² square and SmolLM2's MLP up projection at a
2048-token prompt, [2048, 576] @ [576, 1536]. From the repository root, on a quiet machine:
PYTHONPATH=. python benchmarks/results/e2e_cpu_smollm2_xeon-6-207/matmul_rate.py OUT.json"""
import json
import os
import sys
import time

import kvjax.backends  # noqa: F401  (before jax: the platform)
import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import timing

load_before = os.getloadavg()
f = jax.jit(lambda a, b: a @ b)
rows = []
for sa, sb in [((2048, 2048), (2048, 2048)), ((2048, 576), (576, 1536))]:
    a, b = np.random.rand(*sa).astype(np.float32), np.random.rand(*sb).astype(np.float32)
    ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
    f(ja, jb).block_until_ready()
    ta @ tb
    seconds = {"xla": [], "torch": []}
    for _ in range(15):
        t = time.perf_counter()
        f(ja, jb).block_until_ready()
        seconds["xla"].append(time.perf_counter() - t)
        t = time.perf_counter()
        ta @ tb
        seconds["torch"].append(time.perf_counter() - t)
    flop = 2 * sa[0] * sa[1] * sb[1]
    for impl, s in seconds.items():
        rate = timing.Spread(tuple(s)).rate(flop / 1e9)
        rows.append({"impl": impl, "a": sa, "b": sb, "gflop_s": rate.median, "gflop_s_min": rate.min,
                     "gflop_s_max": rate.max})
        print(f"{impl:5s} {sa} @ {sb}: {rate.median:.0f} GFLOP/s ({rate.min:.0f}–{rate.max:.0f})")
out = {"machine": timing.machine(), "jax": jax.__version__, "torch": torch.__version__,
       "torch_threads": torch.get_num_threads(), "load_before": load_before, "load_after": os.getloadavg(),
       "rows": rows}
with open(sys.argv[1], "w") as fh:
    json.dump(out, fh, indent=1)
