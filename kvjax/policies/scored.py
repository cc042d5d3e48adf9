"""Score-based prefill compression: SnapKV, PyramidKV, SlimKV, H2O (observed attention), KNorm, TOVA.

Each method is one score function returning `[batch, kv_heads, T]` over the prompt; one shared
selection keeps, per KV head, the top-scored prefix tokens plus the observation window (the last
`observation_window` prompt tokens, always kept), in a cache sized to what is kept plus the decode tokens,
so the memory really shrinks. Decoding then appends (these methods compress at prefill only;
H2O's decode-time eviction is `H2O`). Scores are computed per KV group from all query heads of
the group (`group_agg`): the cache holds KV heads, never repeated query heads.

Budgets: `budget` tokens per KV head (the window included), or `ratio`, the fraction of the
prompt removed (kvpress's `compression_ratio`: keep `max(1, int(L * (1 - ratio)))`). A prompt
no longer than the budget is kept whole.

Conventions (defaults are the papers'; kvpress's are options where they differ):
* SnapKV: the last `observation_window` queries' attention (softmax over all keys, causal inside the window),
  averaged over those queries, pooled over positions, aggregated over the group. Paper LongBench
  runs: window 32, kernel 7, max-pool; kvpress: window 64, kernel 5, avg-pool, mean over the group.
* SlimKV: S1 (eq. 3) = window attention summed over window queries and the group's heads,
  S2 (eq. 4) = max |v| over the head dimension; S = S1 * S2 (eq. 5, default) or S1 + S2 (Listing 1).
* H2O at prefill: every key's attention summed over all queries (the paper's accumulated score);
  `normalize=True` divides by the number of queries that can see the key (kvpress's ObservedAttention).
* TOVA: the last query's attention averaged over all heads of the layer (one ranking shared by
  the KV heads, as TOVA and kvpress do); the last token is always kept.
* KNorm: keep the keys with the smallest L2 norm.
* KeyDiff: keep the keys least similar (cosine) to the mean normalised key; no attention needed.

Chunked prefill (`prefill_mode="chunked", chunk=n`, memory bounded by the budget whatever the prompt's
length) is a different method for a prompt longer than one chunk, said here and warned once where it is
chosen: after each chunk attends the cache and itself, the whole-prompt rule runs on the cache's slots
plus the chunk as if they were the prompt. Scores come from that chunk's own queries (its last
`observation_window`; TOVA its last one; the observed attention sums its queries' attention into each
slot's running total; KNorm needs none), pooling runs over the slots in position order (across the gaps
left by evicted tokens), the latest `observation_window` tokens are kept and then the top scores, up to the
budget for the tokens read so far. Tokens evicted before the prompt's end were never scored against it
(in the audit that prompted this note, SnapKV on a 256-token prompt kept 98 % of the whole-prompt set at
chunk 64 and 91 % at chunk 32). One chunk holding the whole prompt is exactly the whole-prompt rule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvcache
from kvjax.cache import LayerCache, PooledLayerCache
from kvjax.errors import InvalidInput
from kvjax import values
from kvjax.policies.base import (
    AppendsWhileDecoding,
    ChunkRule,
    LayerPolicy,
    PooledRule,
    StepOnlyWrites,
    check_numbers,
    group_agg_option,
    observation_window_option,
    ratio_option,
    sinks_option,
    warn_chunked_method,
)
from kvjax.policies.options import WARNED, class_builder, fixed, given, option, register
from kvjax.stats import RuleStats, StatsRequest

POOLS = ("max", "avg", "none")
GROUP_AGGREGATIONS = ("mean", "max", "sum")
COMBINES = ("product", "sum", "s1", "s2")  # SlimKV's score


def pool1d(x: jax.Array, kernel: int, kind: str) -> jax.Array:
    """Stride-1 pooling over the last axis with `kernel // 2` padding on each side (zeros
    counted for avg, as `F.avg_pool1d`; ignored for max), so the length is unchanged."""
    if kind == "none" or kernel <= 1:
        return x
    pad = kernel // 2
    dims, strides = (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim
    padding = ((0, 0),) * (x.ndim - 1) + ((pad, pad),)
    if kind == "avg":
        return jax.lax.reduce_window(x, 0.0, jax.lax.add, dims, strides, padding) / kernel
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, strides, padding)


def aggregate(x: jax.Array, how: str, axis: int = 2) -> jax.Array:
    return {"mean": jnp.mean, "max": jnp.max, "sum": jnp.sum}[how](x, axis=axis)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoredPolicy(LayerPolicy, ChunkRule, AppendsWhileDecoding):
    """Shared budget, selection and decode-append for the prefill compressors."""

    budget: int | None = None
    ratio: float | None = ratio_option()
    observation_window: int = observation_window_option(32)  # always kept, and (SnapKV) the scoring queries
    evicts_while_decoding = False  # class attribute, not a field: compression happens at prefill only

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        if (self.budget is None) == (self.ratio is None):
            raise InvalidInput(f"{name}: give exactly one of budget (tokens) or ratio (fraction removed)")
        if self.ratio is not None and not 0 <= self.ratio < 1:
            raise InvalidInput(f"{name}: ratio={self.ratio} must be in [0, 1)")
        if self.observation_window < 0:
            raise InvalidInput(f"{name}: observation_window={self.observation_window} must be >= 0")
        if self.budget is not None and self.budget < 1:
            raise InvalidInput(f"{name}: budget={self.budget} must be >= 1 (tokens kept per KV head)")
        if self.budget is not None and self.budget < self.observation_window:
            raise InvalidInput(f"{name}: budget={self.budget} must be at least observation_window={self.observation_window}: the last "
                             "`observation_window` prompt tokens are always kept, so a smaller budget cannot hold them")
        if self.prefill_mode == "stream":
            raise InvalidInput(f"{name} compresses a prompt at once: prefill_mode must be 'full' or 'chunked'")
        if self.prefill_mode == "chunked" and self.ratio is not None:
            raise InvalidInput(f"{name}: a ratio is a share of the whole prompt, which a chunked prefill has not read "
                               "when it evicts; give a budget (--budget) with prefill_mode='chunked'")
        if self.prefill_mode == "chunked" and self.chunk < max(self.observation_window, 1):
            raise InvalidInput(f"{name}: chunk={self.chunk} is shorter than observation_window={self.observation_window}: each chunk is "
                               "scored by its last `observation_window` queries, so a chunk must hold them")
        if self.prefill_mode == "chunked":
            warn_chunked_method(self, "a prompt longer than one chunk is compressed after every chunk, each time scored "
                                      "by that chunk's own queries, so tokens evicted before the prompt's end (its "
                                      "question) were never scored against it.")

    # -- per-method parts -------------------------------------------------------------
    def score(self, layer, k, v, pos, stats) -> jax.Array:
        """[b, kvh, t]: higher is kept first. Only prefix positions (before the window) are used."""
        raise NotImplementedError

    def keep_count(self, layer: int, length):
        """Tokens kept out of a `length`-token prompt (numpy or jnp arrays of lengths)."""
        xp = jnp if isinstance(length, jax.Array) else np
        if self.budget is not None:
            return xp.minimum(length, self.budget)
        return xp.maximum(1, xp.floor(length * (1 - self.ratio))).astype(xp.int32)

    def _keep(self, layer: int, length, bound: int):
        """`keep_count` of traced lengths as its float64 (numpy) form gives them, kvpress's `int(n * (1 - ratio))`
        (float32 would round 100 * 0.2 up to 20): a table over 0..`bound` made on the host."""
        table = np.asarray(self.keep_count(layer, np.arange(bound + 1)), np.int32)
        return jnp.asarray(table)[jnp.clip(length, 0, bound)]

    # -- shared -----------------------------------------------------------------------
    def capacity(self, layer, max_len, prompt_len=0):
        # The most any prompt of this bucket keeps, plus a slot for every decoded token.
        kept = int(np.max(self.keep_count(layer, np.arange(1, prompt_len + 1)))) if prompt_len else 0
        return kept + (max_len - prompt_len)

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        length = jnp.max(pos, axis=1) + 1  # [b]
        n_keep = self._keep(layer, length, pos.shape[1])[:, None, None]
        p = pos[:, None, :]
        real = p >= 0
        in_window = real & (p >= (length - self.observation_window)[:, None, None])
        keep = kvcache.keep_top(self.score(layer, k, v, pos, stats), real, in_window, n_keep)
        return kvcache.gather_prompt(cache, k, v, pos, kvcache.compact(keep, cache.capacity))

    def absorb(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        # The whole prompt's rule on what a chunked prefill holds: score the cache's slots and the chunk
        # (in position order: the cache keeps its tokens right-aligned, empty slots first, so pooling
        # sees neighbours as in a prompt), keep the window of the latest tokens and the top scores.
        both = kvcache.chunk_slots(cache, k, v, pos)
        length = jnp.max(both.pos, axis=(1, 2)) + 1  # [b]: tokens read so far
        real = both.pos >= 0
        in_window = real & (both.pos >= (length - self.observation_window)[:, None, None])
        rank, stored = self._chunk_scores(layer, both, stats)
        # (a token budget: chunked prefill takes no ratio, so min(length, budget) is exact in any precision)
        keep = kvcache.keep_top(rank, real, in_window, self.keep_count(layer, length)[:, None, None])
        both = kvcache.with_state(both, **stored)
        return kvcache.take_slots(both, kvcache.compact(keep, cache.capacity, right=True))

    def _chunk_scores(self, layer, both: LayerCache, stats):
        """(the score a chunked prefill ranks by, the per-slot state it stores, by name) over cache ∪ chunk:
        a score of the slots' keys and the chunk's attention alone stores nothing."""
        return self.score(layer, both.k, both.v, both.pos, stats), {}

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos = ctx.pos
        return kvcache.append(cache, k, v, pos)  # capacity() reserved a slot per new token

    def count_query(self, probs, real, past):
        """What one decode query adds to each slot's count when `Decoding` ranks the cache by this rule (`probs`:
        its probabilities over the slots, summed over the KV group; `real`: the slots holding a token; `past`: the
        slots older than the window the next compression keeps): its probabilities, as a prompt's query gives them."""
        del real, past
        return probs

    def _prefix_only(self, s, pos):
        """Zeroes scores of padding and of the window before pooling (kvpress scores the prefix only).
        `pos`: `[b, t]` (a prompt) or `[b, kvh, t]` (a chunked prefill's slots)."""
        p = pos if pos.ndim == 3 else pos[:, None, :]
        length = jnp.max(p, axis=(1, 2), keepdims=True) + 1
        prefix = (p >= 0) & (p < length - self.observation_window)
        return jnp.where(prefix if s.ndim == 3 else prefix[:, :, None, :], s, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKV(ScoredPolicy):
    """SnapKV (Li et al. 2024): each prefix token scored by the attention the last `observation_window`
    prompt queries give it, pooled over `kernel` neighbouring positions (`pool`), the query heads of a KV
    group combined by `group_agg`; the window plus the top-scored prefix tokens are kept. Paper defaults
    (window 32, kernel 7, max-pool); kvpress's `SnapKVPress` is `observation_window=64, kernel=5, pool="avg"`."""

    kernel: int = option(7, type=values.odd_positive_int, help="pooling kernel over positions, odd (kvpress: 5)")
    pool: str = option("max", choices=("max", "avg", "none"), help="pooling of the scores over positions")
    group_agg: str = group_agg_option("mean")

    def __post_init__(self):
        super().__post_init__()
        _check(self, pool=self.pool, group_agg=self.group_agg, kernel=self.kernel)
        if self.observation_window < 1:
            raise InvalidInput(f"{type(self).__name__}: observation_window={self.observation_window} must be >= 1")

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest.last(self.observation_window))

    def score(self, layer, k, v, pos, stats):
        probs = stats.last(self.observation_window)  # [b, kvh, g, w, t]
        n = jnp.maximum(jnp.sum(jnp.any(probs > 0, axis=-1), axis=3), 1)  # real window queries
        s = self._prefix_only(probs.sum(axis=3) / n[..., None], pos)
        return aggregate(pool1d(s, self.kernel, self.pool), self.group_agg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PyramidKV(SnapKV):
    """SnapKV scoring with per-layer budgets decreasing linearly with depth (PyramidKV's formula,
    as kvpress computes it): the average budget M = window + L·(1 - ratio) (or `budget`), the top
    layer keeps (M - window)/beta, the bottom 2(M - window) - top, capped at L - window; falls back
    to SnapKV's budget when the pyramid does not fit."""

    beta: int = option(20, type=values.positive_int, help="PyramidKV: the steepness of the pyramid")
    num_layers: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise InvalidInput(f"PyramidKV: beta={self.beta} must be >= 1")
        if self.num_layers < 2:
            raise InvalidInput(f"PyramidKV: num_layers={self.num_layers} must be >= 2")
        if self.same_as() is not None:
            import warnings

            warnings.warn(f"PyramidKV(budget={self.budget}, observation_window={self.observation_window}, "
                          f"beta={self.beta}) is {self.same_as()}", UserWarning, stacklevel=3)

    def same_as(self) -> str | None:
        """What this policy reduces to, said in every table it appears in (`kvjax.policies.reduces_to`): with a
        token budget below `observation_window * (beta + 1)`, kvpress's pyramid never fits (its top layer
        would keep fewer than the window) and every layer falls back to SnapKV's budget at every length."""
        least = self.observation_window * (self.beta + 1)
        if self.budget is not None and self.budget < least:
            return (f"SnapKV in every layer: kvpress's pyramid needs budget >= observation_window * (beta + 1) = "
                    f"{least} and falls back to SnapKV's budget below it")
        return None

    def check(self, num_layers, num_kv_heads=None):
        if num_layers != self.num_layers:
            raise InvalidInput(f"PyramidKV: num_layers={self.num_layers} but the model has {num_layers} layers")

    def layer_key(self, layer):
        return layer  # each layer's count differs (`keep_count`)

    def keep_count(self, layer, length):
        xp = jnp if isinstance(length, jax.Array) else np
        q = length.astype(xp.float32) if xp is jnp else np.asarray(length, np.float64)
        w = self.observation_window
        m = self.budget if self.budget is not None else w + q * (1 - self.ratio)
        m = xp.minimum(m, q + w) if self.budget is not None else m
        min_num = (m - w) / self.beta
        max_num = (m - w) * 2 - min_num
        capped = max_num >= q - w
        max_num = xp.where(capped, q - w, max_num)
        min_num = xp.where(capped, (m - w) * 2 - max_num, min_num)
        fits = (q >= max_num) & (max_num >= min_num) & (min_num >= w)
        steps = (max_num - min_num) / (self.num_layers - 1)
        pyramid = xp.round(max_num - layer * steps)
        fallback = xp.round(q * (1 - self.ratio)) if self.budget is None else xp.minimum(q, self.budget)
        out = xp.where(fits, pyramid, fallback)
        return xp.clip(out, 1, q).astype(xp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlimKV(ScoredPolicy):
    """SlimKV: SnapKV's window attention S1 (summed over a KV group's query heads) combined with S2, each
    token's largest absolute value channel (eq. 4; `combine`:
    "product" is the paper's eq. 5, "sum" its Listing 1, "s1" / "s2" Table 3's ablations), pooled as SnapKV."""

    kernel: int = option(7, type=values.odd_positive_int, help="pooling kernel over positions, odd (kvpress: 5)")
    pool: str = option("avg", choices=("max", "avg", "none"), help="pooling of the scores over positions")
    # eq. 5; "sum" is Listing 1's S1 + S2; "s1" / "s2" prune by one of them alone (Table 3's ablations)
    combine: str = option("product", choices=("product", "sum", "s1", "s2"),
                          help="SlimKV: S1 * S2 (eq. 5), S1 + S2 (Listing 1), or S1 / S2 alone (Table 3's ablations)")

    def __post_init__(self):
        super().__post_init__()
        _check(self, pool=self.pool, kernel=self.kernel)
        if self.combine not in COMBINES:
            raise InvalidInput(f"SlimKV: combine={self.combine!r}; expected 'product' (eq. 5), 'sum' (Listing 1), "
                               "'s1' or 's2' (Table 3: one score alone)")
        if self.observation_window < 1:
            raise InvalidInput(f"SlimKV: observation_window={self.observation_window} must be >= 1")

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest.last(self.observation_window))

    def score(self, layer, k, v, pos, stats):
        s1 = stats.last(self.observation_window).sum(axis=(2, 3))  # eq. 3: window queries x group heads
        s2 = jnp.max(jnp.abs(v.astype(s1.dtype)), axis=-1)  # eq. 4
        s = {"product": lambda: s1 * s2, "sum": lambda: s1 + s2, "s1": lambda: s1, "s2": lambda: s2}[self.combine]()
        return pool1d(self._prefix_only(s, pos), self.kernel, self.pool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObservedAttention(ScoredPolicy):
    """H2O's score at prefill: attention each key received, summed over all prompt queries."""

    @property
    def cache_state(self):
        # a chunked prefill's running sum of each slot's attention over the chunks read so far; a whole prompt's
        # attention is summed at once, and nothing is kept
        return {"mass": kvcache.SLOT} if self.prefill_mode == "chunked" else {}

    observation_window: int = observation_window_option(0)
    normalize: bool = False
    group_agg: str = group_agg_option("mean")

    def __post_init__(self):
        super().__post_init__()
        _check(self, group_agg=self.group_agg)

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest(colsum=True))

    def score(self, layer, k, v, pos, stats):
        return self._normalized(aggregate(stats.colsum, self.group_agg), pos)  # colsum: [b, kvh, g, t]

    def _normalized(self, s, pos):
        if not self.normalize:
            return s
        p = pos if pos.ndim == 3 else pos[:, None, :]
        length = jnp.max(p, axis=(1, 2), keepdims=True) + 1
        return s / jnp.maximum(length - p, 1)  # queries at or after the key

    def _chunk_scores(self, layer, both, stats):
        # The observed attention accumulates over chunks: each slot stores its sum so far.
        total = both.state["mass"] + aggregate(stats.colsum, self.group_agg)
        return self._normalized(total, both.pos), {"mass": total}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TOVA(ScoredPolicy):
    """TOVA (Oren et al. 2024): keeps the tokens the last query attends most, its probabilities averaged over
    every head of the layer, so all KV heads of a layer keep the same positions."""

    observation_window: int = fixed(1)  # the last query scores, and is kept: not an option (as kvpress's TOVAPress)

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest.last(1))

    def score(self, layer, k, v, pos, stats):
        probs = stats.last(1)[:, :, :, 0]  # [b, kvh, g, t]: the last query
        layer_mean = probs.mean(axis=(1, 2), keepdims=True)[:, :, 0]  # over all heads of the layer
        return jnp.broadcast_to(layer_mean, probs.shape[:2] + probs.shape[3:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class KNorm(ScoredPolicy):
    """KNorm (Devoto et al. 2024): keeps the keys of smallest L2 norm; needs no attention statistics."""

    observation_window: int = observation_window_option(0)

    def score(self, layer, k, v, pos, stats):
        return -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptStreamingLLM(ScoredPolicy):
    """StreamingLLM's `sinks` first and latest tokens chosen once, from the prompt, and every later token appended:
    how a kvpress press runs StreamingLLM (`StreamingLLMPress`, and the streaming heads of `DuoAttentionPress`), as a
    press compresses at prefill only. `kvjax.policies.StreamingLLM` instead keeps its window sliding through the
    question and the answer (the paper's: a constant cache while decoding). Of the kept count (a budget, or a share
    of each prompt), the first `sinks` positions, then the latest."""

    sinks: int = sinks_option(4)
    observation_window: int = observation_window_option(0)  # the latest tokens are kept by their score

    def __post_init__(self):
        check_numbers(self)
        if self.prefill_mode != "full":
            raise InvalidInput(f"PromptStreamingLLM: prefill_mode={self.prefill_mode!r}; it chooses its window once "
                               "from a whole prompt, so only 'full' runs it (StreamingLLM reads a prompt in chunks)")
        if self.observation_window != 0:
            raise InvalidInput(f"PromptStreamingLLM: observation_window={self.observation_window}; its window is the "
                               "latest kept tokens after the sinks, so it takes none")
        super().__post_init__()
        if self.sinks < 0 or (self.budget is not None and self.sinks >= self.budget):
            raise InvalidInput(f"PromptStreamingLLM: sinks={self.sinks} must be >= 0 and below budget={self.budget}")

    def score(self, layer, k, v, pos, stats):
        # the sinks above every position, then the latest first: the top scores are StreamingLLM's sinks and window
        p = pos[:, None, :]
        return jnp.broadcast_to(jnp.where((p >= 0) & (p < self.sinks), jnp.float32(2.0**30), p.astype(jnp.float32)),
                                k.shape[:3])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpectedAttention(ScoredPolicy):
    """ExpectedAttention (kvpress's `ExpectedAttentionPress`): the attention future queries are expected to pay
    each key, from the statistics of the prompt's queries. With the mean mu and covariance S of the unrotated
    queries (positions from `sinks` on), both rotated by RoPE averaged over the `future` positions after the
    prompt, a key k scores softmax_k(k . mu / sqrt(d) + k^T S k / (2 d)) (the expectation of exp(q k / sqrt(d))
    for Gaussian queries; `covariance=False` drops the second term), averaged over the KV group's query heads
    and times |v| (`vnorm`, plus `epsilon` first). The first `sinks` tokens are always kept.
    The query statistics are the whole prompt's, so a chunked prefill is refused."""

    observation_window: int = observation_window_option(0)
    sinks: int = sinks_option(4)
    future: int = 512
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0
    chunk_refusal = "its statistics of future queries are the whole prompt's"

    def __post_init__(self):
        # refused before the base class warns that chunks make scoring a different method: it is not run at all
        if self.prefill_mode == "chunked":
            raise InvalidInput(f"ExpectedAttention cannot run prefill_mode='chunked': {self.chunk_refusal}")
        super().__post_init__()
        if self.sinks < 0 or self.future < 1:
            raise InvalidInput(f"ExpectedAttention: sinks={self.sinks} must be >= 0 and future={self.future} >= 1")

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest(query_moments=frozenset({(self.sinks, self.future)})))

    def score(self, layer, k, v, pos, stats):
        mean, cov = stats.query_moments[(self.sinks, self.future)]  # [b, kvh, g, d], [b, kvh, g, d, d]
        d = k.shape[-1]
        k = k.astype(jnp.float32)
        s = jnp.einsum("bhgd,bhtd->bhgt", mean, k) / jnp.sqrt(d)
        if self.covariance:
            s = s + jnp.einsum("bhti,bhgij,bhtj->bhgt", k, cov, k) / d / 2
        p = pos if pos.ndim == 3 else pos[:, None, :]
        scored = ((p >= self.sinks) & (p >= 0))[:, :, None]  # the sinks are not scored (kvpress drops them)
        s = jax.nn.softmax(jnp.where(scored, s, -jnp.inf), axis=-1).mean(axis=2)  # [b, kvh, t]
        if self.vnorm:
            s = (s + self.epsilon) * jnp.linalg.norm(v.astype(jnp.float32), axis=-1)
        top = jnp.max(jnp.where(scored[:, :, 0], s, -jnp.inf)) + 1  # the sinks above every scored key
        return jnp.where((p >= 0) & (p < self.sinks), top, jnp.where(scored[:, :, 0], s, -jnp.inf))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyDiff(ScoredPolicy):
    """KeyDiff (Park et al. 2025, arXiv:2504.15364): attention-free; a key's score is minus its cosine
    similarity to the anchor, the mean of the prompt's L2-normalised keys (per KV head), so the keys most like
    the average are evicted and the distinctive ones kept (kvpress's `KeyDiffPress`; the paper's block-wise
    iteration is a chunked prefill here, `prefill_mode="chunked"`)."""

    observation_window: int = observation_window_option(0)

    def score(self, layer, k, v, pos, stats):
        p = pos if pos.ndim == 3 else pos[:, None, :]
        real = (p >= 0)[..., None]
        k = k.astype(jnp.float32)
        unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-12)  # F.normalize's eps
        anchor = jnp.sum(jnp.where(real, unit, 0), axis=2, keepdims=True) / jnp.maximum(jnp.sum(real, axis=2,
                                                                                              keepdims=True), 1)
        # F.cosine_similarity: x . y / max(|x| |y|, 1e-8)
        cos = jnp.sum(k * anchor, axis=-1) / jnp.maximum(
            jnp.linalg.norm(k, axis=-1) * jnp.linalg.norm(anchor, axis=-1), 1e-8)
        return -cos


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaKV(LayerPolicy, PooledRule, StepOnlyWrites):
    """AdaKV (Feng et al. 2024, arXiv:2407.11550) on any prompt compressor's score (`AdaKV(SnapKV(ratio=0.5))`):
    instead of each KV head keeping the scorer's count, a layer keeps its KV heads' total (heads x count) by one
    top-k over all its heads' scores, so heads keep different numbers of tokens; each head first keeps its
    `alpha` share of the count (at least 1), the paper's safeguard. The scorer's observation window is kept in
    every head. As kvpress's `AdaKVPress`.

    Memory: the per-head counts are only known after the prompt, so the layer's KV heads share one pool of
    `kv_heads x` the scorer's capacity slots (`kvjax.cache.PooledLayerCache`): its bytes are the sum of the
    per-head counts, SnapKV's at the same budget, plus a head index per slot (kvpress masks evicted keys in a
    full-size cache). Decoding attends each head's own slots; the jnp reference masks the others, so its work
    is the pool's times the KV heads (no kernel yet that reads only a head's slots)."""

    scorer: ScoredPolicy
    alpha: float = option(0.2, flag="--adakv-alpha", type=values.probability,
                          help="AdaKV: the share of its count each head keeps before the top-k over the layer")
    evicts_while_decoding = False

    def __post_init__(self):
        check_numbers(self)
        if not isinstance(self.scorer, ScoredPolicy):
            raise InvalidInput(f"AdaKV: scorer={self.scorer!r} is not a prompt compressor (SnapKV, PyramidKV, SlimKV, "
                               "TOVA, KNorm, KeyDiff, ExpectedAttention, ObservedAttention)")
        if not 0 <= self.alpha <= 1:
            raise InvalidInput(f"AdaKV: alpha={self.alpha} must be in [0, 1]")
        if self.scorer.prefill_mode != "full":
            raise InvalidInput("AdaKV: the scorer must attend the whole prompt (prefill_mode='full'): the top-k runs "
                               "over every head's scores of the prompt")
        object.__setattr__(self, "positions", self.scorer.positions)
        object.__setattr__(self, "prefill_mode", "full")
        super().__post_init__()

    def stats(self, layer):
        return self.scorer.stats(layer)

    def capacity(self, layer, max_len, prompt_len=0):
        return self.scorer.capacity(layer, max_len, prompt_len)  # per head on average: the pool is kvh x this

    def pool_capacity(self, layer, max_len, prompt_len=0) -> tuple[int, int]:
        """(prompt slots, decode slots) per KV head: the pool holds `kv_heads x` each (`kvjax.cache.empty_pool`)."""
        room = max_len - prompt_len
        return self.scorer.capacity(layer, max_len, prompt_len) - room, room

    def prefill(self, layer, cache: PooledLayerCache, k, v, ctx, stats) -> PooledLayerCache:
        return kvcache.pool_prompt(cache, k, v, ctx.pos, self.keep(layer, k, v, ctx.pos, stats))

    def keep(self, layer, k, v, pos, stats):
        """Bool `[b, kvh, t]`: the prompt tokens each KV head keeps (`kvh x` the scorer's count per row in all)."""
        return self._layer_top(*self._safeguarded(layer, k, v, pos, stats))

    @staticmethod
    def _layer_top(score, real, n_keep):
        """The layer's `kvh x n_keep` highest `score`s of each row, over all its KV heads (ties: the earlier)."""
        b, kvh, t = score.shape
        flat = score.reshape(b, kvh * t)
        grank = jnp.argsort(jnp.argsort(-flat, axis=-1, stable=True), axis=-1).reshape(b, kvh, t)
        return real & (grank < (kvh * n_keep)[:, None, None])

    def _safeguarded(self, layer, k, v, pos, stats):
        """`(score, real, n_keep)`: the scorer's score `[b, kvh, t]` (padding -inf, the window above every scored key),
        each head's `alpha` share of `n_keep` `[b]` raised to the float32 maximum (the safeguard)."""
        sc = self.scorer
        length = jnp.max(pos, axis=1) + 1  # [b]
        p = pos[:, None, :]
        real = p >= 0
        in_window = real & (p >= (length - sc.observation_window)[:, None, None])
        n_keep = sc._keep(layer, length, pos.shape[1])  # [b] per head
        score = jnp.where(real, sc.score(layer, k, v, pos, stats).astype(jnp.float32), -jnp.inf)
        top = jnp.max(jnp.where(real & ~in_window, score, -jnp.inf), axis=(1, 2), keepdims=True)
        # A prompt no longer than the window has no scored key: any finite level puts its tokens above the padding
        # (-inf), which they tied with, so the layer's top-k took padding slots and kept no prompt token at all
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        score = jnp.where(in_window, top + 1, score)  # the window above every scored key (kvpress: max + 1)
        n_safe = jnp.where(n_keep > 0, jnp.maximum(1, jnp.floor(n_keep * self.alpha)), 0).astype(jnp.int32)
        rank = jnp.argsort(jnp.argsort(-score, axis=-1, stable=True), axis=-1)
        score = jnp.where(real & (rank < n_safe[:, None, None]), jnp.finfo(jnp.float32).max, score)
        return score, real, n_keep

    def step(self, layer, cache: PooledLayerCache, k, v, ctx) -> PooledLayerCache:
        return kvcache.pool_append(cache, k, v, ctx.pos)

    def check(self, num_layers, num_kv_heads=None):
        self.scorer.check(num_layers, num_kv_heads)

    def describe(self):
        return f"AdaKV(scorer={self.scorer.describe()}, alpha={self.alpha})"


def _check(policy, pool=None, group_agg=None, kernel=None):
    name = type(policy).__name__
    # `pool1d` pads kernel // 2 on each side, which keeps the length only for odd kernels; an even
    # kernel gives T + 1 scores (so does kvpress's F.avg_pool1d), i.e. no defined alignment.
    if kernel is not None and (kernel < 1 or kernel % 2 == 0):
        raise InvalidInput(f"{name}: kernel={kernel} must be a positive odd number (pooling pads kernel // 2 "
                         "on each side, so only an odd kernel keeps one score per token)")
    if pool is not None and pool not in POOLS:
        raise InvalidInput(f"{name}: pool={pool!r}; expected one of {POOLS}")
    if group_agg is not None and group_agg not in GROUP_AGGREGATIONS:
        raise InvalidInput(f"{name}: group_agg={group_agg!r}; expected one of {GROUP_AGGREGATIONS}")


# ---- registration: one method per class, each built from its fields' options ----------------------------------

register("snapkv", paper="Li et al. 2024", docs="policies/scored.md#snapkv", chunked=WARNED,
         kvpress="`SnapKVPress`")(SnapKV)
register("slimkv", paper="SlimKV, large activations (papers/)", docs="policies/scored.md#slimkv",
         chunked=WARNED)(SlimKV)
register("h2o-prefill", paper="Zhang et al. 2023 (H2O's score, at the prompt)",
         docs="policies/scored.md#observed-attention", chunked=WARNED, kvpress="`ObservedAttentionPress`")(
    ObservedAttention)
register("tova", paper="Oren et al. 2024", docs="policies/scored.md#tova", chunked=WARNED, kvpress="`TOVAPress`")(TOVA)
register("knorm", paper="Devoto et al. 2024", docs="policies/scored.md#knorm", chunked=WARNED,
         kvpress="`KnormPress`")(KNorm)
register("keydiff", paper="Park et al. 2025", docs="policies/scored.md#keydiff", chunked=WARNED,
         kvpress="`KeyDiffPress`")(KeyDiff)
register("expected-attention", paper="Devoto et al. 2025 (kvpress)", docs="policies/scored.md#expectedattention",
         chunked="refused", kvpress="`ExpectedAttentionPress`")(ExpectedAttention)


def _pyramidkv(budget, num_layers, **options) -> PyramidKV:
    return class_builder(PyramidKV)(budget, num_layers=num_layers, **options)


def snapkv_scorer(budget, ratio=None, observation_window=None, kernel=None, pool=None, group_agg=None) -> SnapKV:
    """SnapKV's score, sized by `budget` or `ratio`: the scorer the command line's wrappers (AdaKV, ChunkKV,
    CriticalKV) take."""
    return class_builder(SnapKV)(budget, **given(ratio=ratio, observation_window=observation_window, kernel=kernel,
                                                 pool=pool, group_agg=group_agg))


def _adakv(budget, ratio=None, observation_window=None, kernel=None, pool=None, group_agg=None,
           adakv_alpha=None) -> AdaKV:
    # AdaKV on SnapKV's score: one top-k over a layer's heads, each head at least --adakv-alpha of the count
    return AdaKV(scorer=snapkv_scorer(budget, ratio, observation_window, kernel, pool, group_agg),
                 **given(alpha=adakv_alpha))


def _prompt_streaming(budget, ratio=None, sinks=None) -> PromptStreamingLLM:
    # StreamingLLM as kvpress's StreamingLLMPress runs it: sinks and window chosen once from the prompt, then every
    # new token appended (`streaming` slides its window through the question and the answer, as the paper does)
    return class_builder(PromptStreamingLLM)(budget, **given(ratio=ratio, sinks=sinks))


register("pyramidkv", build=_pyramidkv, classes=(PyramidKV,), paper="Cai et al. 2024",
         docs="policies/scored.md#pyramidkv", chunked=WARNED, kvpress="`PyramidKVPress`")
register("adakv", build=_adakv, classes=(SnapKV, AdaKV), paper="Feng et al. 2024", docs="policies/scored.md#adakv",
         chunked="refused", kvpress="`AdaKVPress`", memory="real (one pool per layer shared by its heads)")
register("streaming-kvpress", build=_prompt_streaming, classes=(PromptStreamingLLM,),
         paper="kvpress's StreamingLLMPress (window from the prompt, then appended)", docs="policies/ring.md",
         chunked="refused", kvpress="`StreamingLLMPress`")


__all__ = ["AdaKV", "ExpectedAttention", "KNorm", "KeyDiff", "ObservedAttention", "PyramidKV", "ScoredPolicy", "SlimKV", "SnapKV", "TOVA"]
