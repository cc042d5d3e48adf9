"""Log-likelihood of text under a cache policy: one token at a time (StreamingLLM's protocol), or in
chunks (`prefill_mode="chunked"`), each chunk scored as it attends the cache compressed so far."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax import drive, engine
from kvjax.engine import compiled
from kvjax.errors import InvalidInput, require_finite
from kvjax.generate import bucket_length, check_policy, check_positions, token_ids
from kvjax.model import CachedLM
from kvjax.policies.base import Policy

# A text this many chunks long shows a progress bar.
PROGRESS_CHUNKS = 64


@compiled(static=("plan",))
def _stream_logprobs(model, tokens, positions, *, plan):
    # The scored texts are the prompts: a ratio budget is a share of each row's text.
    cache = drive.size_rows(plan, drive.empty_cache(model, plan, tokens.shape[0]), positions)
    # Each step scores the next token itself, so the scan keeps [b, t] log-probabilities, not [b, t, V] logits
    # (8 rows of 8192 tokens over a 49K vocabulary would be 13 GB). The last step's target wraps to token 0
    # and is dropped.
    targets = jnp.roll(tokens, -1, axis=1)

    def body(cache, xs):
        token, position, target = xs
        logits, cache = drive.decode(model, token, position, cache, plan)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return cache, jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]

    _, out = jax.lax.scan(body, cache, (tokens.T, positions.T, targets.T))
    return out.T[:, :-1]


def stream_logprobs(model: CachedLM, ids: Sequence[int], policy: Policy) -> np.ndarray:
    """`log p(x_t | x_<t)` for t = 1..n-1, the cache compressed after every token.

    The sequence is right padded to a power-of-two bucket with positions -1 (no-op
    steps), so lengths in one bucket share a compilation.
    """
    return stream_logprobs_rows(model, [ids], policy)[0]


def stream_logprobs_rows(model: CachedLM, rows: Sequence[Sequence[int]], policy: Policy) -> list[np.ndarray]:
    """`stream_logprobs` of several texts in one batch, each row its own length: a ratio budget keeps
    each row's share of its own text (`Rule.size_rows`)."""
    check_policy(policy)
    rows = [token_ids(ids, model.cfg.vocab_size, "text" if len(rows) == 1 else f"text {r}") for r, ids in enumerate(rows)]
    plan = drive.plan(model, policy)
    if not plan.evicts_while_decoding:
        raise InvalidInput(
            f"{policy.describe()} compresses a whole prompt once and then only appends; scored token by "
            "token it would never compress. Use a policy that evicts while decoding (streaming, mat, h2o, ...)"
        )
    lengths = [len(ids) for ids in rows]
    if min(lengths) < 2:
        raise InvalidInput(f"need at least 2 tokens to score, got {min(lengths)}")
    check_positions(plan, model.cfg, max(lengths), "a text")
    t = bucket_length(max(lengths))
    tokens = np.zeros((len(rows), t), np.int32)
    positions = np.full((len(rows), t), -1, np.int32)
    for r, ids in enumerate(rows):
        tokens[r, : len(ids)], positions[r, : len(ids)] = ids, np.arange(len(ids))
    out = np.asarray(_stream_logprobs(model, tokens, positions, plan=plan.sized(t, t)))
    # Column j scores token j + 1: name the token whose log-probability broke.
    logp = [out[r, : n - 1] for r, n in enumerate(lengths)]
    for lp in logp:
        require_finite(np.concatenate([[0.0], lp])[None], "log-probabilities", step="token")
    return logp


@jax.jit
def _token_logprobs(logits, targets):
    """`log p(target)` of each position's logits."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def chunked_logprobs(model: CachedLM, ids: Sequence[int], policy: Policy) -> np.ndarray:
    """`log p(x_t | x_<t)` for t = 1..n-1 under `prefill_mode="chunked"`: each chunk of `policy.chunk`
    tokens attends the cache compressed so far and itself, then is folded in.

    The host loop over one compiled chunk step that reads a prompt (`kvjax.engine.chunks`), every chunk's logits
    scored: one compilation for every text length (the cache's capacity, not the text, is in its shapes), and
    device memory bounded by budget + chunk."""
    check_policy(policy)
    if policy.prefill_mode != "chunked":
        raise InvalidInput(f"{policy.describe()}: chunked_logprobs needs prefill_mode='chunked'")
    ids = token_ids(ids, model.cfg.vocab_size, "text")
    n = len(ids)
    if n < 2:
        raise InvalidInput(f"need at least 2 tokens to score, got {n}")
    plan = drive.plan(model, policy)
    check_positions(plan, model.cfg, n, "a text")
    c = min(policy.chunk, model.cfg.max_position_embeddings)  # the chunk `engine.chunks` reads
    t = -(-n // c) * c  # right padded to whole chunks (positions -1): no left padding, columns are positions
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = ids
    positions = np.where(np.arange(t) < n, np.arange(t), -1)[None].astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)  # column j scores token j + 1 (the last column is unused)
    out = []
    bar = tqdm(total=t // c, desc="chunks", leave=False, disable=t // c < PROGRESS_CHUNKS)

    def each(s, logits):
        out.append(_token_logprobs(logits, targets[:, s:s + c])[0])  # kept on the device: no host round trip
        bar.update()

    engine.chunks(model, tokens, positions, plan.sized(n, n), all_logits=True, each=each)  # n tokens, none decoded
    bar.close()
    logp = np.concatenate([np.asarray(x) for x in out])[: n - 1]  # (a jnp concatenate would compile per count)
    require_finite(np.concatenate([[0.0], logp])[None], "log-probabilities", step="token")
    return logp


def logprobs(model: CachedLM, ids: Sequence[int], policy: Policy) -> np.ndarray:
    """`log p(x_t | x_<t)` for t = 1..n-1, the policy compressing as the text is read: in chunks under
    `prefill_mode="chunked"`, else token by token."""
    check_policy(policy)
    if policy.prefill_mode == "chunked":
        return chunked_logprobs(model, ids, policy)
    return stream_logprobs(model, ids, policy)


def logprobs_rows(model: CachedLM, rows: Sequence[Sequence[int]], policy: Policy) -> list[np.ndarray]:
    """`logprobs` of several texts, each compressed as it is read: one batch token by token (a ratio
    budget keeps each row's share of its own text), or each text in chunks under `prefill_mode="chunked"`."""
    check_policy(policy)
    if policy.prefill_mode == "chunked":
        return [chunked_logprobs(model, ids, policy) for ids in rows]
    return stream_logprobs_rows(model, rows, policy)


def perplexity(model: CachedLM, ids: Sequence[int], policy: Policy) -> float:
    return float(np.exp(-logprobs(model, ids, policy).mean()))
