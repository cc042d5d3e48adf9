"""ChunkKV (Liu et al. 2025, arXiv:2502.00299): keep whole chunks of contiguous prompt tokens, ranked by an inner
scorer's token scores, so a kept token keeps its neighbours (a phrase, not a scattered word).

The selection is kvpress 0.5.5's `ChunkKVPress(press, chunk_length)`, read as the specification:

* the inner scorer's token scores `s[h, j]` (its `score`; the tokens it always keeps, its observation window and
  ExpectedAttention's sinks, score the largest other score of the row plus one, as kvpress's scorers pad them);
* a row of `n` prompt tokens is cut from position 0 into `n // c` chunks of `c = chunk_length` tokens and, when
  `n % c > 0`, one last partial chunk of the remaining tokens; a chunk's score is the mean over its tokens of the
  scores summed over the layer's KV heads (so every KV head keeps the same positions);
* the top `max(1, int(chunks (1 - ratio)))` chunks are kept, the partial chunk counting as one: a row keeps
  `kept x c` tokens, or fewer when the partial chunk is among them; the window is kept only if its chunks win
  (its scores make that all but certain, but it is not forced);
* a row shorter than one chunk is the inner scorer's own token selection (kvpress delegates to the press).

Where kvjax differs from kvpress: rows of a batch choose their own chunks (kvpress's `top_chunks.indices[0]` gives
every row the first row's), and a token `budget` on the scorer keeps `max(1, budget // c)` chunks (kvpress has
ratios only). The cache holds only the kept tokens plus room for the decoded ones (kvpress gathers them too).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvcache
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.base import LayerPolicy, StepOnlyWrites, check_numbers
from kvjax import values
from kvjax.policies.options import given, option, register
from kvjax.policies.scored import AdaKV, ExpectedAttention, PyramidKV, ScoredPolicy, SnapKV, snapkv_scorer

# The scorers ChunkKV refuses by name, and why (any other `ScoredPolicy` is wrapped).
REFUSED = {
    PyramidKV: "its per-layer budgets are replaced by ChunkKV's chunk count (kvpress's ChunkKVPress(PyramidKVPress) "
               "ranks chunks by SnapKV's scores and ignores the pyramid); wrap SnapKV(...) instead",
    AdaKV: "its per-head counts and ChunkKV's chunks shared by the layer's heads are two different selections "
           "(kvpress's AdaKVPress is no ScorerPress either)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkKV(LayerPolicy, StepOnlyWrites):
    """ChunkKV (Liu et al. 2025) on a prompt compressor's score (`ChunkKV(scorer=SnapKV(ratio=0.5))`): whole chunks
    of `chunk_length` contiguous prompt tokens kept, ranked by the mean of the scorer's token scores summed over the
    layer's KV heads, `max(1, int(chunks (1 - ratio)))` of them (the last partial chunk counting as one; a token
    `budget`: `max(1, budget // chunk_length)`), as kvpress's `ChunkKVPress`. Every KV head keeps the same positions;
    each row its own chunks. A row shorter than one chunk is compressed by the scorer itself.

    `chunk_length` defaults to kvpress's 20 (the paper recommends 10). The scorer must attend the whole prompt: a
    chunked prefill is refused (the chunks' ranking is a ranking over the whole prompt)."""

    scorer: ScoredPolicy
    chunk_length: int = option(20, type=values.positive_int,
                               help="ChunkKV: contiguous tokens per chunk, kept or evicted whole (kvpress's 20)")
    evicts_while_decoding = False  # compresses the prompt once, then appends
    chunk_refusal = ("its chunks are ranked over the whole prompt, which a chunked (or token-by-token) prefill has not "
                     "read when it evicts")

    def __post_init__(self):
        check_numbers(self)
        for cls, why in REFUSED.items():
            if isinstance(self.scorer, cls):
                raise InvalidInput(f"ChunkKV cannot wrap {cls.__name__}: {why}")
        if isinstance(self.scorer, ChunkKV) or not isinstance(self.scorer, ScoredPolicy):
            raise InvalidInput(f"ChunkKV: scorer={type(self.scorer).__name__} is not a prompt compressor that scores "
                               "tokens (SnapKV, SlimKV, TOVA, KNorm, KeyDiff, ExpectedAttention, ObservedAttention)")
        if self.chunk_length < 1:
            raise InvalidInput(f"ChunkKV: chunk_length={self.chunk_length} must be >= 1")
        for mode in (self.prefill_mode, self.scorer.prefill_mode):
            if mode != "full":
                raise InvalidInput(f"ChunkKV cannot run prefill_mode={mode!r}: {self.chunk_refusal}")
        if self.scorer.budget is not None and self.scorer.budget < self.chunk_length:
            raise InvalidInput(f"ChunkKV: budget={self.scorer.budget} is less than one chunk "
                               f"(chunk_length={self.chunk_length}): a row keeps at least one whole chunk")
        object.__setattr__(self, "positions", self.scorer.positions)
        super().__post_init__()

    def stats(self, layer):
        return self.scorer.stats(layer)

    def check(self, num_layers, num_kv_heads=None):
        self.scorer.check(num_layers, num_kv_heads)

    # -- counts (numpy over lengths, float64 as kvpress's Python floats) ----------------------------------------
    def kept_chunks(self, length):
        """Chunks a row of `length` prompt tokens keeps (`length >= chunk_length`), numpy."""
        length = np.asarray(length, np.int64)
        chunks = -(-length // self.chunk_length)  # the partial chunk counts as one
        if self.scorer.ratio is not None:
            n = np.floor(chunks * (1 - np.float64(self.scorer.ratio)))
        else:
            n = np.minimum(chunks, self.scorer.budget // self.chunk_length)
        return np.maximum(1, n).astype(np.int64)

    def keep_count(self, layer, length):
        """The most tokens a row of `length` prompt tokens keeps (numpy): whole chunks, at most the prompt; the
        scorer's count below one chunk."""
        length = np.asarray(length, np.int64)
        chunked = np.minimum(length, self.kept_chunks(np.maximum(length, 1)) * self.chunk_length)
        short = np.asarray(self.scorer.keep_count(layer, length), np.int64)
        return np.where(length >= self.chunk_length, chunked, short)

    def capacity(self, layer, max_len, prompt_len=0):
        kept = int(np.max(self.keep_count(layer, np.arange(1, prompt_len + 1)))) if prompt_len else 0
        return kept + (max_len - prompt_len)

    # -- prefill ----------------------------------------------------------------------------------------------
    def _always(self, p, length):
        """`[b, 1, t]`: the tokens the scorer always keeps (its window; ExpectedAttention's sinks)."""
        real = p >= 0
        out = real & (p >= (length - self.scorer.observation_window)[:, None, None])
        if isinstance(self.scorer, ExpectedAttention):
            out = out | (real & (p < self.scorer.sinks))
        return out

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        sc, c = self.scorer, self.chunk_length
        b, t = pos.shape
        length = jnp.max(pos, axis=1) + 1  # [b]
        p = pos[:, None, :]
        real = p >= 0
        always = self._always(p, length)
        s = sc.score(layer, k, v, pos, stats).astype(jnp.float32)
        s = jnp.broadcast_to(s, (b, k.shape[1], t))
        # kvpress's scorers pad what they always keep with the row's largest other score + 1
        top = jnp.max(jnp.where(real & ~always, s, -jnp.inf), axis=(1, 2), keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, 0.0) + 1
        s = jnp.where(always, top, jnp.where(real, s, 0.0))

        # chunk j holds positions [j c, (j + 1) c): each row's chunks start at its own position 0
        n_chunks = -(-t // c)
        cid = jnp.where(pos >= 0, pos // c, n_chunks)  # padding -> dropped
        rows = jnp.arange(b)[:, None]
        total = jnp.zeros((b, n_chunks), jnp.float32).at[rows, cid].add(s.sum(axis=1), mode="drop")
        size = jnp.zeros((b, n_chunks), jnp.float32).at[rows, cid].add(1.0, mode="drop")
        chunk_score = jnp.where(size > 0, total / jnp.maximum(size, 1), -jnp.inf)
        table = jnp.asarray(self.kept_chunks(np.maximum(np.arange(t + 1), 1)), jnp.int32)
        n_kept = table[jnp.clip(length, 0, t)]  # [b]
        rank = jnp.argsort(jnp.argsort(-chunk_score, axis=-1, stable=True), axis=-1)
        kept_chunk = (rank < n_kept[:, None]) & (size > 0)
        by_chunk = jnp.take_along_axis(kept_chunk, jnp.clip(cid, 0, n_chunks - 1), axis=1) & (pos >= 0)  # [b, t]
        keep = jnp.broadcast_to(by_chunk[:, None, :], s.shape)

        # a row shorter than one chunk: the scorer's own selection (kvpress delegates to the press)
        short = kvcache.keep_top(s, real, always, sc._keep(layer, length, t)[:, None, None])
        keep = jnp.where((length >= c)[:, None, None], keep, short)
        return kvcache.gather_prompt(cache, k, v, pos, kvcache.compact(keep, cache.capacity))

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        return kvcache.append(cache, k, v, ctx.pos)  # capacity() reserved a slot per new token

    def describe(self):
        return f"ChunkKV(scorer={self.scorer.describe()}, chunk_length={self.chunk_length})"


def _chunkkv(budget, ratio=None, observation_window=None, kernel=None, pool=None, group_agg=None,
             chunk_length=None) -> ChunkKV:
    # ChunkKV on SnapKV's score: whole chunks of chunk_length (kvpress's 20) contiguous tokens, ranked by their mean
    # score summed over the KV heads
    return ChunkKV(scorer=snapkv_scorer(budget, ratio, observation_window, kernel, pool, group_agg),
                   **given(chunk_length=chunk_length))


register("chunkkv", build=_chunkkv, classes=(SnapKV, ChunkKV), paper="Liu et al. 2025", docs="policies/chunkkv.md",
         chunked="refused", kvpress="`ChunkKVPress`", memory="real (whole chunks of contiguous tokens)")


__all__ = ["ChunkKV"]
