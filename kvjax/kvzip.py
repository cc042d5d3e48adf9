"""KVzip's replay (`kvjax.policies.KVzip`): the scores of a cached context, the eviction over all layers, from a
model and its cache (the method's own code is `kvjax.policies.kvzip`: its hook `KVzip.after_prompt`, which
`generate` runs after the prompt pass; these are its entry points outside a generation), and the replay prompts.

    cache = kvzip.compress(model, cache, plan, prompts)     # after the prompt pass

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

import numpy as np

from kvjax.errors import InvalidInput
from kvjax.after_prompt import PromptPass, grad_replay_fn, replay_fn  # noqa: F401  (replay_fn: benchmarks.tpu_aot)
from kvjax.cache import Cache
from kvjax.policies import kvzip as method
from kvjax.policies.kvzip import POSTFIX, REPLAY_ROUND, evicted, replays  # noqa: F401  (re-exported)


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


def scores(model, cache: Cache, plan, context: list[int], policy, row: int = 0) -> np.ndarray:
    """`[layers, kv_heads, len(context)]`: the KVzip score of each context position of batch row `row`
    (`kvjax.policies.kvzip.scores`, the model's replays run by a `PromptPass`). The cache is read only."""
    return method.scores(_pass(model, cache, plan, [context]), list(context), policy, row)


def compress(model, cache: Cache, plan, prompts: list[list[int]], memo: dict | None = None) -> Cache:
    """`cache` (the prompts cached whole under `plan`, a KVzip policy's, one row per prompt) with KVzip's evicted slots
    emptied (`KVzip.after_prompt`, which `kvjax.generate` runs); `memo` as `PromptPass.memo`."""
    if not isinstance(plan.policy, method.KVzip):
        raise InvalidInput(f"kvzip.compress: {plan.policy.describe()} is not KVzip")
    run = _pass(model, cache, plan, prompts)
    run.memo = {} if memo is None else memo
    return plan.policy.after_prompt(run)[1]


def _pass(model, cache: Cache, plan, prompts) -> PromptPass:
    width = cache[0].pos.shape[-1]
    return PromptPass(model, plan, cache, [list(p) for p in prompts], max_len=width, prompt_len=width)


__all__ = ["POSTFIX", "REPLAY_ROUND", "compress", "evicted", "grad_replay_fn", "replay_fn", "replay_prompts", "replays",
           "scores"]
