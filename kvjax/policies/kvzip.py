"""KVzip (Kim et al. 2025, arXiv:2505.23416): query-agnostic eviction scored by context reconstruction.

After the context is cached whole, the model is asked to repeat it ("Repeat the previous context exactly.",
then the context again, teacher-forced, `chunk_size` context tokens per replay); each cached KV pair is scored
by the largest attention any replay query of its group gives it (softmax over the attention sinks, the chunk
being repeated and the replay tokens themselves), and the lowest-scored pairs over all layers and KV heads are
evicted together (`layerwise=False`: layers keep different shares), the first `sinks` positions never. As
kvpress 0.5.5's `KVzipPress`, whose conventions these are (its tests: `tests/test_kvpress.py`).

The rule here only caches the prompt whole (like `AdaKV`'s, sized to the prompt); the replay needs the model, so
it runs in the policy's hook after the prompt pass (`KVzip.after_prompt`: `scores`, `evicted` and `compress` below,
the model's replays run by the driver's `kvjax.after_prompt.PromptPass`). Evicted
slots are emptied, not freed: a layer's cache stays `[b, kvh, prompt + new tokens]` (kvpress masks them).

The replay prompts are token ids of the model's tokenizer (`kvjax.kvzip.replay_prompts`), part of the policy
and so of a run's identity: `repeat_ids` opens the first chunk's replay, `continue_ids` (followed by the previous
chunk's last 8 tokens) the others, `suffix_ids` (the chat template's assistant header, or "\\n") ends both.
`prefix`: the chat template's tokens before the context, which are not replayed (their scores stay 0, as in
kvpress, so they are evicted first after the sinks).

KVzip+ (`plus=True`, kvpress's `kvzip_plus_normalization`, from the KVzap paper, arXiv:2601.07891): each replay
query's probability of a pair is divided by the norm of that query's attention input ‖h‖ and multiplied by
‖v W_o^i‖_2, the pair's value through the query head's block of the output projection, before the maximum over the
group's heads and the replay's queries (docs/policies/kvzip-plus.md). The model gives W_o
(`kvjax.layer.Geometry.out_proj`) and h (`kvjax.layer.attend(..., hidden=)`); one that gives neither is refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvcache
from kvjax import values
from kvjax.cache import Cache, LayerCache
from kvjax.errors import InvalidInput, NonFiniteError
from kvjax.policies.base import AppendsWhileDecoding, LayerPolicy, ratio_option, sinks_option
from kvjax.policies.options import given, option, register


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzip(LayerPolicy, AppendsWhileDecoding):
    """KVzip at compression `ratio` (the share of all layers' and heads' context slots evicted; per layer with
    `layerwise`), the first `sinks` positions kept, `chunk_size` context tokens per replay; the replay prompts'
    token ids (`kvjax.kvzip.replay_prompts(tokenizer)`) and the chat template's `prefix` length; `plus`: KVzip+'s
    scores. See the module."""

    ratio: float = ratio_option(dataclasses.MISSING)
    repeat_ids: tuple[int, ...]
    continue_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    sinks: int = sinks_option(4)
    chunk_size: int = option(2048, flag="--kvzip-chunk", type=values.positive_int,
                             help="KVzip: context tokens per replay (kvpress's chunk_size)")
    layerwise: bool = option(False, flag="--kvzip-layerwise", const=True,
                             help="KVzip: evict --ratio of each layer's slots instead of a share of all layers' "
                                  "together")
    prefix: int = 0
    plus: bool = False  # KVzip+'s normalisation (see the module)
    evicts_while_decoding = False

    def after_prompt(self, run):
        # the replay needs the model: the context cached whole, its slots scored by replaying it, the lowest emptied
        return run.plan, compress(run, self)
    replays_prompt = True
    chunk_refusal = ("its replay attends every context token once the whole context is cached, which a chunked "
                     "prefill (a cache bounded while the prompt is read) never holds")

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.ratio < 1:
            raise InvalidInput(f"KVzip: ratio={self.ratio} must be in [0, 1)")
        if self.sinks < 0 or self.prefix < 0:
            raise InvalidInput(f"KVzip: sinks={self.sinks} and prefix={self.prefix} must be >= 0")
        if self.chunk_size < 1:
            raise InvalidInput(f"KVzip: chunk_size={self.chunk_size} must be >= 1")
        if not self.repeat_ids or not self.continue_ids:
            raise InvalidInput("KVzip: repeat_ids and continue_ids are the replay prompts' token ids "
                               "(kvjax.kvzip.replay_prompts(tokenizer))")
        for name in ("repeat_ids", "continue_ids", "suffix_ids"):
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
        if self.prefill_mode != "full":
            raise InvalidInput(f"KVzip cannot run prefill_mode={self.prefill_mode!r}: {self.chunk_refusal}")
        if self.positions != "absolute":
            raise InvalidInput("KVzip: positions must be 'absolute' (the replay continues the context's positions)")

    def capacity(self, layer, max_len, prompt_len=0):
        return max_len  # the whole prompt, then the decoded tokens: eviction empties slots (see the docstring)

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        real = jnp.broadcast_to((ctx.pos >= 0)[:, None, :], k.shape[:3])
        return kvcache.gather_prompt(cache, k, v, ctx.pos, kvcache.compact(real, cache.capacity))

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        return kvcache.append(cache, k, v, ctx.pos)

    def describe(self) -> str:
        return (f"KVzip(ratio={self.ratio!r}, sinks={self.sinks}, chunk_size={self.chunk_size}, "
                f"layerwise={self.layerwise}, prefix={self.prefix}, repeat_ids={list(self.repeat_ids)}, "
                f"continue_ids={list(self.continue_ids)}, suffix_ids={list(self.suffix_ids)}"
                + (", plus=True)" if self.plus else ")"))  # KVzip's description stays what its records are keyed by


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVgrad(KVzip):
    """KVgrad (kvpress 0.5.5's `KVgradPress`, https://openreview.net/forum?id=cg1wTCJjjk): KVzip's replay, each pair
    scored by input x gradient attribution, max over the replay's queries p and the group's query heads i of
    A_{p,c} ‖v_c W_o^i‖_2 ‖∂Φ/∂a_p‖_2, where A is KVzip's reconstruction probability, a_p the layer's attention output
    (after W_o) at replay query p and Φ = Σ_p ‖h_p^L‖² over the replay's last hidden states (before the final norm);
    one forward and one backward pass (`jax.vjp`) per replay of `chunk_size` context tokens
    (`kvjax.drive.grad_replay`). The model gives W_o (`kvjax.layer.Geometry.out_proj`, of rank hidden: the gradient
    of a_p is recovered from the gradient of the attention's output before W_o); one that gives none is refused.
    Eviction, sinks, `layerwise`, the replay prompts and the refusal of a chunked prefill are KVzip's. See
    docs/policies/kvgrad.md."""

    chunk_size: int = 512  # kvpress 0.5.5's KVgradPress default (KVzipPress: 2048)

    def __post_init__(self):
        super().__post_init__()
        if self.plus:
            raise InvalidInput("KVgrad always weighs the replay's probabilities by ‖v W_o‖ and by the gradient's norm: "
                               "KVzip+'s normalisation (plus=True) does not apply (kvpress's KVgradPress has none)")

    def describe(self) -> str:
        return "KVgrad" + super().describe()[len("KVzip"):]


# ---- the replay: KVzip's scores of a cached context and the eviction over all layers (after the prompt pass) ----

POSTFIX = 8  # a later chunk's replay starts with the previous chunk's last tokens (kvpress: prev_postfix_size)
# Replays are padded to a multiple of this many tokens: a power-of-two bucket would double a 2048-token chunk's
# replay (2048 + its prompt), and a context's replays are all one length but the last, so few programs compile.
REPLAY_ROUND = 256


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


def scores(run, context: list[int], policy: KVzip, row: int = 0) -> np.ndarray:
    """`[layers, kv_heads, len(context)]`: the KVzip score of each context position of batch row `row` of `run.cache`
    (a `kvjax.after_prompt.PromptPass`), after all replays (sinks not yet raised). The cache is read only."""
    layers = _row_cache(run.cache, row)
    total = None
    for start, end, ids in replays(context, policy):
        n = len(ids)
        t = -(-n // REPLAY_ROUND) * REPLAY_ROUND
        tokens = np.zeros((1, t), np.int32)
        positions = np.full((1, t), -1, np.int32)
        tokens[0, :n] = ids
        positions[0, :n] = len(context) + np.arange(n)  # right padded, as `extend` takes a chunk
        span = np.asarray([[min(policy.sinks, start), start, end]], np.int32)
        # KVgrad: one forward and one backward pass
        got = run.replay(tokens, positions, layers, span, plus=policy.plus, grad=isinstance(policy, KVgrad))
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


def compress(run, policy: KVzip) -> Cache:
    """`run.cache` (the prompts cached whole under `run.plan`, one row per prompt) with KVzip's evicted slots emptied;
    the layers' shapes are unchanged. Policies that differ only in how much they evict (ratio, layerwise) share each
    row's replay scores through `run.memo` instead of replaying again."""
    if any(not isinstance(lc, LayerCache) for lc in run.cache):
        raise InvalidInput("KVzip: every layer must hold one cache array (no head groups, no quantized cache)")
    # what the scores depend on (the sinks are in each replay's softmax)
    replay = (type(policy), policy.sinks, policy.chunk_size, policy.prefix, policy.repeat_ids, policy.continue_ids,
              policy.suffix_ids, policy.plus)
    pos = [np.array(lc.pos) for lc in run.cache]
    for row, context in enumerate(run.prompts):
        key = (replay, row, tuple(context))
        if key not in run.memo:
            run.memo[key] = scores(run, list(context), policy, row)
        gone = evicted(run.memo[key], policy)
        for i, p in enumerate(pos):
            r = p[row]
            h, c = np.nonzero((r >= 0) & (r < len(context)))
            drop = gone[i, h, r[h, c]]
            r[h[drop], c[drop]] = -1
    return tuple(dataclasses.replace(lc, pos=jnp.asarray(p)) for lc, p in zip(run.cache, pos))


def _row_cache(cache: Cache, row: int) -> Cache:
    return jax.tree.map(lambda x: x[row:row + 1], cache)


# ---- registration: --ratio of all layers' slots evicted together; the replay prompts are the model's tokenizer's ids
# (`replay`, given by the suites from the model's tokenizer: kvjax.kvzip.replay_prompts)


def _builder(kind: type, plus: bool = False):
    def build(budget, ratio=None, sinks=None, kvzip_chunk=None, kvzip_layerwise=None, replay=None) -> KVzip:
        if ratio is None:
            raise InvalidInput("KVzip evicts a share of all layers' slots together: give ratio (--ratio)")
        if replay is None:
            raise InvalidInput("KVzip's replay prompts are token ids of the model's tokenizer, and this model has "
                               "none (or give replay=kvjax.kvzip.replay_prompts(tokenizer))")
        return kind(ratio=ratio, **replay, **given(sinks=sinks, chunk_size=kvzip_chunk, layerwise=kvzip_layerwise),
                    **({"plus": True} if plus else {}))

    return build


MASKED = "**masked** (slots emptied, not freed)"
register("kvzip", build=_builder(KVzip), classes=(KVzip,), budget=False, paper="Kim et al. 2025",
         docs="policies/kvzip.md", chunked="refused", kvpress="`KVzipPress`", memory=MASKED)
# KVzip+: KVzip's replay scores divided by each replay query's input norm and multiplied by the pair's ‖v W_o‖_2
register("kvzip-plus", build=_builder(KVzip, plus=True), classes=(KVzip,), budget=False, paper="KVzap, 2026",
         docs="policies/kvzip-plus.md", chunked="refused", kvpress="`KVzipPress(kvzip_plus_normalization=True)`",
         memory=MASKED)
# KVgrad: --kvzip-chunk defaults to 512 (kvpress's KVgradPress)
register("kvgrad", build=_builder(KVgrad), classes=(KVgrad,), budget=False, paper="KVgrad (OpenReview)",
         docs="policies/kvgrad.md", chunked="refused", kvpress="`KVgradPress`", memory=MASKED)


__all__ = ["KVgrad", "KVzip", "POSTFIX", "REPLAY_ROUND", "compress", "evicted", "replays", "scores"]
