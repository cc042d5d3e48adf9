"""How far a compressed cache's generation drifts from the full cache's, step by step.

`forced(model, prompt, continuation, policy)` reads `prompt` twice, under the full cache and under `policy`, then
feeds both the same `continuation` (the full cache's own greedy output: teacher forcing) one token at a time through
each one's decode path, in one compiled scan. At every step it returns the KL divergence from the full cache's
next-token distribution to the policy's, KL(p_full || p_policy) in nats, and each side's negative log-likelihood of
the continuation's next token. A decode-time policy compresses as it goes, so the KL at step i measures what its
evictions up to i cost, with the history held fixed (the tokens the full cache chose).

Compiles once per policy, prompt bucket (`kvjax.engine.bucket_length`) and continuation length; the tokens and the
prompt's length are arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import drive, engine
from kvjax.model import CachedLM
from kvjax.errors import require_finite
from kvjax.generate import check_policy, check_positions, pad_left, token_ids
from kvjax.policies import FullCache, Policy
from kvjax.policies.plan import Plan


def _step_stats(full: Float[Array, "b V"], ours: Float[Array, "b V"], target: Int[Array, "b"]):
    """(KL(full || ours), -log full(target), -log ours(target)), each `[b]`, in float32."""
    lf = jax.nn.log_softmax(full.astype(jnp.float32), axis=-1)
    lo = jax.nn.log_softmax(ours.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(lf) * (lf - lo), axis=-1)
    pick = lambda lp: -jnp.take_along_axis(lp, target[:, None], axis=-1)[:, 0]  # noqa: E731
    return kl, pick(lf), pick(lo)


@engine.compiled(static=("plans",))
def _forced(model, tokens, positions, forced, *, plans: tuple[Plan, Plan]):
    """Both plans read the prompt, then the `forced` tokens `[b, n]` are decoded through each; per step `[n, b]`:
    KL, the full cache's NLL and the policy's of the forced token at that step."""
    full_plan, plan = plans
    logits_f, cache_f = drive.prompt(model, tokens, positions, full_plan)
    logits_p, cache_p = drive.prompt(model, tokens, positions, plan)
    start = jnp.max(positions, axis=1) + 1  # [b]: each row's first generated position

    def body(carry, x):
        cache_f, cache_p, logits_f, logits_p = carry
        i, target = x
        out = _step_stats(logits_f, logits_p, target)
        pos = start + i
        logits_f, cache_f = drive.decode(model, target, pos, cache_f, full_plan)
        logits_p, cache_p = drive.decode(model, target, pos, cache_p, plan)
        return (cache_f, cache_p, logits_f, logits_p), out

    n = forced.shape[1]
    _, (kl, nll_f, nll_p) = jax.lax.scan(body, (cache_f, cache_p, logits_f, logits_p), (jnp.arange(n), forced.T))
    return kl, nll_f, nll_p


def forced(model: CachedLM, prompt: Sequence[int], continuation: Sequence[int], policy: Policy, *,
           pad_id: int = 0) -> dict[str, np.ndarray]:
    """`{"kl", "nll_full", "nll"}`, each `[len(continuation)]`: at step i, KL(p_full || p_policy) of the next-token
    distributions after the prompt and `continuation[:i]`, and each side's NLL of `continuation[i]` (the module
    docstring). A non-finite value is an error naming its step."""
    check_policy(policy)
    prompt = token_ids(prompt, model.cfg.vocab_size)
    continuation = token_ids(continuation, model.cfg.vocab_size, "continuation")
    n = len(continuation)
    bucket = engine.bucket_length(len(prompt))
    full_plan, plan = drive.plan(model, FullCache()), drive.plan(model, policy)
    check_positions(plan, model.cfg, len(prompt) + n, "the prompt and its continuation")
    tokens, positions = pad_left([prompt], bucket, pad_id)
    plans = (full_plan.sized(bucket + n, bucket), plan.sized(bucket + n, bucket))
    kl, nll_f, nll_p = (np.asarray(x)[:, 0] for x in _forced(model, tokens, positions,
                                                             np.asarray([continuation], np.int32), plans=plans))
    for name, x in (("KL", kl), ("full cache's log-likelihood", nll_f), ("log-likelihood", nll_p)):
        require_finite(x[None], name, step="continuation token")
    return {"kl": np.maximum(kl, 0.0), "nll_full": nll_f, "nll": nll_p}


__all__ = ["forced"]
