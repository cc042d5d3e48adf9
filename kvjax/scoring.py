"""Log-likelihood of text under a cache policy, one token at a time (StreamingLLM's protocol)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.engine import compiled
from kvjax.errors import InvalidInput, require_finite
from kvjax.generate import bucket_length
from kvjax.policies.base import Policy


@compiled(static=("policy", "max_len"))
def _stream_logprobs(model, tokens, positions, *, policy, max_len):
    cache = model.init_cache(policy, tokens.shape[0], max_len)
    logits, _ = model.stream(tokens, positions, cache, policy)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def stream_logprobs(model: nnx.Module, ids: Sequence[int], policy: Policy) -> np.ndarray:
    """`log p(x_t | x_<t)` for t = 1..n-1, the cache compressed after every token.

    The sequence is right padded to a power-of-two bucket with positions -1 (no-op
    steps), so lengths in one bucket share a compilation.
    """
    if not policy.evicts_while_decoding:
        raise InvalidInput(
            f"{policy.describe()} compresses a whole prompt once and then only appends; scored token by "
            "token it would never compress. Use a policy that evicts while decoding (streaming, mat, h2o, ...)"
        )
    n = len(ids)
    if n < 2:
        raise InvalidInput(f"need at least 2 tokens to score, got {n}")
    t = bucket_length(n)
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = ids
    positions = np.where(np.arange(t) < n, np.arange(t), -1)[None].astype(np.int32)
    out = _stream_logprobs(model, tokens, positions, policy=policy, max_len=t)
    # Column j scores token j + 1: name the token whose log-probability broke.
    logp = np.asarray(out[0, : n - 1])
    require_finite(np.concatenate([[0.0], logp])[None], "log-probabilities", step="token")
    return logp


def perplexity(model: nnx.Module, ids: Sequence[int], policy: Policy) -> float:
    return float(np.exp(-stream_logprobs(model, ids, policy).mean()))
