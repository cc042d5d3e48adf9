"""Run in a subprocess with 8 host devices (see test_mesh.py): sharded vs single-device results."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

jax.config.update("jax_default_matmul_precision", "highest")

from kvjax import FullCache, StreamingLLM, generate  # noqa: E402
from kvjax.sharding import make_mesh, shard_model  # noqa: E402
from kvjax.models import load  # noqa: E402
from kvjax import drive


def logits_trace(model, policy, ids, prompt_len=20, steps=10):
    """Prefill + decode logits of a batch, as a [steps + 1, b, V] array."""
    graphdef, state = nnx.split(model)
    plan = drive.plan(model, policy, 64, prompt_len)
    prefill = jax.jit(lambda s, t, p: drive.prompt(nnx.merge(graphdef, s), t, p, plan))
    decode = jax.jit(lambda s, t, p, c: drive.decode(nnx.merge(graphdef, s), t, p, c, plan))
    logits, cache = prefill(state, ids[:, :prompt_len], jnp.broadcast_to(jnp.arange(prompt_len), (ids.shape[0], prompt_len)))
    out = [logits]
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = decode(state, ids[:, t], jnp.full((ids.shape[0],), t), cache)
        out.append(logits)
    return np.asarray(jnp.stack(out)), cache


def main(path):
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.RandomState(0)
    prompts = [rng.randint(4, 260, n).tolist() for n in (17, 25, 9, 30)]
    ids = jnp.asarray(rng.randint(4, 260, (4, 40)))
    single = load(path).model
    sharded = shard_model(load(path).model, make_mesh(data=2, model=4))
    report = {"kernel_spec": str(sharded.layers[0].self_attn.q_proj.kernel.get_value().sharding.spec)}
    for name, policy in {"full": FullCache(), "streaming": StreamingLLM(budget=12, sinks=2)}.items():
        a = generate(single, prompts, policy, max_new_tokens=16, eos_ids=())
        b = generate(sharded, prompts, policy, max_new_tokens=16, eos_ids=())
        la, _ = logits_trace(single, policy, ids)
        lb, cache = logits_trace(sharded, policy, ids)
        report[name] = {
            "same_tokens": a.tokens.tolist() == b.tokens.tolist(),
            "max_logit_diff": float(np.abs(la - lb).max()),
            "logit_scale": float(np.abs(la).max()),
            "cache_spec": str(cache[0].k.sharding.spec) if hasattr(cache[0].k.sharding, "spec") else str(cache[0].k.sharding),
            "generate_cache_devices": len(b.cache[0].k.sharding.device_set),
        }
    # the Pallas kernels (interpreted on these host devices) under the mesh: each device's shard of heads and
    # rows through `kvjax.attention.per_shard`, since XLA cannot partition a kernel
    from kvjax.policies import Quantized, SnapKV

    single = load(path, attention_impl="pallas").model
    sharded = shard_model(load(path, attention_impl="pallas").model, make_mesh(data=2, model=4))
    for name, policy in {"pallas-snapkv": SnapKV(budget=12, observation_window=4), "pallas-4bit": Quantized(FullCache(), bits=4, group=4)}.items():
        a = generate(single, prompts, policy, max_new_tokens=8, eos_ids=())
        b = generate(sharded, prompts, policy, max_new_tokens=8, eos_ids=())
        report[name] = {"same_tokens": a.tokens.tolist() == b.tokens.tolist(),
                        "generate_cache_devices": len(jax.tree.leaves(b.cache)[0].sharding.device_set)}
    try:
        shard_model(load(path).model, make_mesh(data=1, model=8))
        report["error"] = None
    except ValueError as e:
        report["error"] = str(e)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
