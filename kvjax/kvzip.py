"""KVzip's replay (`kvjax.policies.KVzip`): the scores of a cached context, the eviction over all layers.

    cache = kvzip.compress(model, cache, plan, prompts)     # after the prompt pass (`generate` does it)

The context's cache (the whole prompt, as `KVzip`'s rule caches it) is read, never written, by replays of the
context: each is the repeat prompt, the chat template's suffix and `chunk_size` context tokens, teacher-forced
at the positions after the context (`kvjax.drive.replay`: an extension of the read-only cache whose attention
layers also return each slot's reconstruction score, `kvjax.attention.replay_attention`). Then the lowest-scored slots over all layers and KV heads (or per
layer, `layerwise`) are emptied, sinks never. One row at a time (kvpress's KVzip takes one); the replays of a
row are one compiled program per replay length, rounded up to `REPLAY_ROUND` tokens.

Cost: a row's replays read about `context + chunks x (prompt + suffix)` tokens against the cached context,
so KVzip's prefill is about twice the prompt pass plus the replay's attention to the whole context (kvpress's
warning: "2-3 times the initial prefilling cost"); `benchmarks/results/kvzip_cpu_smollm2.md`: the replay takes
2.3-3.1x the prompt pass on SmolLM2 at 1K-4K tokens (its attention computes each logit once for the replay's output
and its scores, `kvjax.attention.replay_attention`).

KVgrad (`kvjax.policies.KVgrad`) replays the same chunks through `kvjax.drive.grad_replay`: each replay is one
forward and one backward pass (`jax.vjp`), one compiled program per replay length as KVzip's; its activations, and
so its peak memory, are those of one replay (the chunk, its prompt and their attention to the cached context).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import drive, engine
from kvjax.cache import Cache, LayerCache
from kvjax.engine import compiled
from kvjax.errors import InvalidInput, NonFiniteError
from kvjax.policies.kvzip import KVgrad, KVzip

POSTFIX = 8  # a later chunk's replay starts with the previous chunk's last tokens (kvpress: prev_postfix_size)
# Replays are padded to a multiple of this many tokens: a power-of-two bucket would double a 2048-token chunk's
# replay (2048 + its prompt), and a context's replays are all one length but the last, so few programs compile.
REPLAY_ROUND = 256


def replay_prompts(tokenizer, chat: bool = False) -> dict:
    """`KVzip`'s replay fields for a transformers tokenizer, as kvpress builds them: the repeat prompts' ids,
    the suffix that ends a replay and the prefix length. `chat=True` (contexts wrapped in the tokenizer's chat
    template, as kvpress's pipeline wraps them): the template's assistant header and its tokens before the
    user's text; otherwise (raw text, as kvjax's suites feed it; kvpress without a template) "\\n" and 0."""
    def ids(text):
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    if not chat or getattr(tokenizer, "chat_template", None) is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix_text = text.split(separator)
        prefix_text = context.split(dummy)[0]
    return dict(repeat_ids=ids("\n\nRepeat the previous context exactly."),
                continue_ids=ids("\n\nRepeat the part of the previous context exactly, starting with"),
                suffix_ids=ids(suffix_text), prefix=len(ids(prefix_text)))


def replays(context: list[int], policy: KVzip) -> list[tuple[int, int, list[int]]]:
    """`(start, end, replay tokens)` per chunk of `context[prefix:]`: the chunk covers positions start..end-1."""
    body = context[policy.prefix:]
    out = []
    for i in range(0, len(body), policy.chunk_size):
        chunk = body[i:i + policy.chunk_size]
        head = list(policy.repeat_ids) if i == 0 else (  # the previous chunk's last POSTFIX tokens
            list(policy.continue_ids) + body[max(i - policy.chunk_size, i - POSTFIX):i])
        start = policy.prefix + i
        out.append((start, start + len(chunk), head + list(policy.suffix_ids) + chunk))
    return out


@compiled(static=("plan", "plus"))
def replay_fn(model, tokens, positions, cache, span, *, plan, plus=False):
    return drive.replay(model, tokens, positions, cache, plan, span, plus)


@compiled(static=("plan",))
def grad_replay_fn(model, tokens, positions, cache, span, *, plan):
    return drive.grad_replay(model, tokens, positions, cache, plan, span)


def scores(model, cache: Cache, plan, context: list[int], policy: KVzip, row: int = 0) -> np.ndarray:
    """`[layers, kv_heads, len(context)]`: the KVzip score of each context position of batch row `row`, after
    all replays (sinks not yet raised). The cache is read only."""
    layers = _row_cache(cache, row)
    graphdef, state = engine.split(model)
    total = None
    for start, end, ids in replays(context, policy):
        n = len(ids)
        t = -(-n // REPLAY_ROUND) * REPLAY_ROUND
        tokens = np.zeros((1, t), np.int32)
        positions = np.full((1, t), -1, np.int32)
        tokens[0, :n] = ids
        positions[0, :n] = len(context) + np.arange(n)  # right padded, as `extend` takes a chunk
        span = np.asarray([[min(policy.sinks, start), start, end]], np.int32)
        args = (graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), layers, jnp.asarray(span))
        if isinstance(policy, KVgrad):  # one forward and one backward pass
            got = grad_replay_fn.pure(*args, plan=plan)
        else:
            got = replay_fn.pure(*args, plan=plan, plus=policy.plus)
        got = np.stack([np.asarray(x[0], np.float32) for x in got])  # [L, kvh, c] by slot
        if not np.all(np.isfinite(got)):  # a NaN would sort anywhere and evict silently
            raise NonFiniteError(f"{type(policy).__name__}: non-finite reconstruction scores in the replay of positions "
                                 f"{start}-{end - 1}")
        total = got if total is None else total + got  # a slot belongs to one chunk: 0 elsewhere
    out = np.zeros((len(layers), layers[0].pos.shape[1], len(context)), np.float32)
    if total is None:
        return out
    for i, lc in enumerate(layers):
        pos = np.asarray(lc.pos[0])
        h, c = np.nonzero((pos >= 0) & (pos < len(context)))
        out[i, h, pos[h, c]] = total[i, h, c]
    return out


def evicted(score: np.ndarray, policy: KVzip) -> np.ndarray:
    """Bool `[layers, kv_heads, t]`: the positions KVzip evicts given `scores`: the sinks raised above every
    score, then the `ratio` share with the lowest scores over all layers and heads (`layerwise`: per layer,
    over its heads). Ties go to the earlier (layer, head, position), which kvpress's `topk` leaves open."""
    score = score.copy()
    score[..., :policy.sinks] = score.max() + 1.0
    n_layers, kvh, t = score.shape
    gone = np.zeros(score.shape, bool)
    if policy.layerwise:
        n = int(kvh * t * policy.ratio)
        for i in range(n_layers):
            gone[i].reshape(-1)[np.argsort(score[i].reshape(-1), kind="stable")[:n]] = True
    else:
        n = int(score.size * policy.ratio)
        gone.reshape(-1)[np.argsort(score.reshape(-1), kind="stable")[:n]] = True
    return gone


def compress(model, cache: Cache, plan, prompts: list[list[int]], memo: dict | None = None) -> Cache:
    """`cache` (the prompts cached whole under `plan`, a KVzip policy's, one row per prompt) with KVzip's evicted slots
    emptied; the layers' shapes are unchanged. `memo`: a dict shared by the calls of one generation over the
    same model and prompts (`kvjax.generate.generate_many`), where KVzip policies that differ only in how much
    they evict (ratio, layerwise) reuse each row's replay scores instead of replaying again."""
    policy = plan.policy
    if not isinstance(policy, KVzip):
        raise InvalidInput(f"kvzip.compress: {policy.describe()} is not KVzip")
    if any(not isinstance(lc, LayerCache) for lc in cache):
        raise InvalidInput("KVzip: every layer must hold one cache array (no head groups, no quantized cache)")
    memo = {} if memo is None else memo
    # what the scores depend on (the sinks are in each replay's softmax)
    replay = (type(policy), policy.sinks, policy.chunk_size, policy.prefix, policy.repeat_ids, policy.continue_ids,
              policy.suffix_ids, policy.plus)
    pos = [np.array(lc.pos) for lc in cache]
    for row, context in enumerate(prompts):
        key = (replay, row, tuple(context))
        if key not in memo:
            memo[key] = scores(model, cache, plan, list(context), policy, row)
        gone = evicted(memo[key], policy)
        for i, p in enumerate(pos):
            r = p[row]
            h, c = np.nonzero((r >= 0) & (r < len(context)))
            drop = gone[i, h, r[h, c]]
            r[h[drop], c[drop]] = -1
    return tuple(dataclasses.replace(lc, pos=jnp.asarray(p)) for lc, p in zip(cache, pos))


def _row_cache(cache: Cache, row: int) -> Cache:
    return jax.tree.map(lambda x: x[row:row + 1], cache)


__all__ = ["POSTFIX", "REPLAY_ROUND", "compress", "evicted", "replay_prompts", "replays", "scores"]
