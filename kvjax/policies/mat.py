"""MAT: Managing Anchor Tokens (`papers/mat-anchor-tokens.md`, Section 4.2, Algorithm 1).

Deep layers keep an *anchor cache* of β slots plus a window of the `c - β` most
recent tokens; shallow layers keep StreamingLLM's `s` sinks + window (eq. 5).
`mat(...)` builds the paper's policy as `ByLayer(StreamingLLM, AnchorCache)`.

Our reading of Algorithm 1 and Figure 3 (the text leaves the order of events open):

* Every token's π = q·k_0/√d (its attention logit to the first token, from its own
  query when it is processed) is stored with it: the attention logit cache A (eq. 3).
  With GQA a KV head's π aggregates its query heads' logits: mean by default
  (every query head reads the slot equally), max as the option. π is exactly
  q·k_0/√d in both prefill modes: on ALiBi models the bias −m·t of the real logit is
  left out, and so is a slot's `log_w`, or stream and full prefill would rank
  anchors by distance as well (tested on an ALiBi model).
* While the cache has a free slot, the new token is simply appended.
* When it is full, the new token enters the window and pushes out the window's
  oldest token, which joins the anchor candidates at once; the candidate with the
  highest π (ties: the oldest) is evicted (eq. 4). The first token is an anchor
  that is never a candidate. So after `n > c` tokens the anchors are exactly
  position 0 plus the `β - 1` lowest-π tokens among those that have left the
  window: Figure 3's "tokens with Bottom-β attention logits ... and a sliding
  window [of] the last c − β", and what `AnchorCache.prefill` computes in closed form.
* Layers are 0-indexed: layers `0 .. L_s - 1` are shallow (the paper's Figure 1
  and Section 3.2 call layers 0 and 1 shallow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp

from kvjax import cache as kvcache
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax import values
from kvjax.policies.base import (
    ChunkRule,
    LayerPolicy,
    Policy,
    PrefillMode,
    RatioBudget,
    check_ratio,
    group_agg_option,
    ratio_option,
)
from kvjax.policies.compose import EVERY_LAYER, ByLayer
from kvjax.policies.options import Option, given, option, register
from kvjax.policies.ring import StreamingLLM
from kvjax.stats import RuleStats, StatsRequest

GROUP_AGGREGATIONS = ("mean", "max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnchorCache(RatioBudget, LayerPolicy, ChunkRule):
    """Eq. 4 in every layer ("MAT (w. anchor)"): β anchors (position 0 + the lowest π) + a window.

    `prefill_mode="stream"` (default) compresses as the prompt is read, token by token, as the
    paper's evaluations do; `"full"` attends the whole prompt and keeps the closed form of
    Algorithm 1 over the prompt's π. The cache size `c` is `budget`, or with `ratio` each row's own
    `max(β + 1, floor(n (1 - ratio)))` for its `n` prompt tokens (`RatioBudget`): β is a count, the
    window `c - β` what the row's budget leaves.
    """

    cache_state = {"pi": kvcache.SLOT}  # each slot's anchor score pi = q.k_0 / sqrt(d), eq. 3

    budget: int | None = None
    anchor_slots: int = option(type=values.positive_int,  # β: the slots of anchor tokens (position 0 + the lowest π)
                               help="MAT's β: the slots of anchor tokens (the first token and the lowest π); default "
                                    "--budget / 4 (MAT's Fig. 5 is flat from 32 to 96 at c = 256)")
    group_agg: str = group_agg_option("mean")
    ratio: float | None = ratio_option()
    prefill_mode: PrefillMode = "stream"

    def __post_init__(self):
        super().__post_init__()
        check_ratio(self, self.budget)
        if self.anchor_slots < 1:
            raise InvalidInput(f"MAT: anchor_slots (beta)={self.anchor_slots} must be >= 1 (the first token is an "
                               "anchor)")
        if self.budget is not None and self.anchor_slots >= self.budget:
            raise InvalidInput(
                f"MAT: anchor_slots (beta)={self.anchor_slots} must be smaller than budget (c)={self.budget}, "
                "leaving at least one window slot for the current token"
            )
        if self.group_agg not in GROUP_AGGREGATIONS:
            raise InvalidInput(f"MAT: group_agg={self.group_agg!r}; expected one of {GROUP_AGGREGATIONS}")
        if self.chunk is not None and self.chunk > self.recent:
            raise InvalidInput(f"MAT: chunk={self.chunk} exceeds the window c - beta = {self.recent}: a chunk's "
                               "tokens must all be in the window when it ends, so that its anchors are known before "
                               "it attends")

    @property
    def recent(self) -> int:
        """The recent window `c - β` under a token budget (a ratio gives each row its own: `_row_budget`)."""
        return self.budget - self.anchor_slots

    def least_slots(self) -> int:
        return self.anchor_slots + 1

    def capacity(self, layer, max_len, prompt_len=0):
        # a sequence shorter than the budget never evicts
        return min(self.budget, max_len) if self.ratio is None else self.ratio_capacity(max_len, prompt_len)

    def _row_budget(self, cache: LayerCache):
        """`c` per (row, KV head) `[b, kvh]`: the budget, or the slots the row's ratio left enabled."""
        if self.ratio is None:
            return jnp.full(cache.pos.shape[:2], self.budget, jnp.int32)
        return cache.capacity - jnp.sum(cache.pos == kvcache.DISABLED, axis=-1)

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest(first_logit=True), decode=StatsRequest(first_logit=True))

    def _pi(self, first_logit):
        # first_logit: [b, kvh, g, ...] per query head -> [b, kvh, ...]
        return first_logit.mean(axis=2) if self.group_agg == "mean" else first_logit.max(axis=2)

    def _closed_form(self, p, pi, length, budget):
        """Algorithm 1's state after `length` tokens under a cache of `budget` slots (`[b, kvh | 1, 1]`),
        over tokens at positions `p` with their `pi` (`[b, kvh | 1, t]`, in time order): position 0,
        the `beta - 1` lowest pi among the tokens that left the window (ties: the newer stays, as the
        stream evicts the older), and the window of `budget - beta`."""
        real = p >= 0
        window = budget - self.anchor_slots
        left_window = real & (p >= 1) & (p < length - window)
        # Rank candidates by (pi ascending, position descending): reverse time, then a stable sort.
        key = jnp.where(left_window, pi, jnp.inf)[..., ::-1]
        rank = jnp.argsort(jnp.argsort(key, axis=-1, stable=True), axis=-1)[..., ::-1]
        return real & (
            (length <= budget) | (p == 0) | (p >= length - window) | (left_window & (rank < self.anchor_slots - 1))
        )

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        pi = self._pi(stats.first_logit)  # [b, kvh, t]
        length = (jnp.max(pos, axis=1) + 1)[:, None, None]
        budget = self.budget if self.ratio is None else self.prompt_rows(cache, pos)[:, None, None]
        keep = jnp.broadcast_to(self._closed_form(pos[:, None, :], pi, length, budget), pi.shape)
        out = kvcache.gather_prompt(cache, k, v, pos, kvcache.compact(keep, cache.capacity), {"pi": pi})
        return self.size_rows(layer, out, ctx)

    # Chunked, exactly the stream at any chunk size: every token of a chunk stays in the window to the chunk's
    # end (chunk <= c - beta), so the tokens Algorithm 1 evicts while the chunk is read are cache tokens that
    # leave the window, ranked by pi already in the cache. Stream mode's cache when the chunk's query i
    # arrives is therefore the closed form at length pos_i + 1 over the cache (plus the chunk's tokens up to
    # i): each query sees exactly those slots (`chunk_visible`), then the chunk is folded in by the closed
    # form at the chunk's end (`absorb`). The cache holds c slots and the chunk n more while it attends.
    def _time_order(self, cache: LayerCache):
        return jnp.argsort(jnp.where(cache.pos >= 0, cache.pos, jnp.iinfo(jnp.int32).max), axis=-1)

    def chunk_visible(self, layer, cache: LayerCache, ctx):
        order = self._time_order(cache)
        p = jnp.take_along_axis(cache.pos, order, axis=-1)[:, :, None, :]  # [b, kvh, 1, c], time order
        pi = jnp.take_along_axis(cache.state["pi"], order, axis=-1)[:, :, None, :]
        length = (ctx.pos + 1)[:, None, :, None]  # [b, 1, n, 1]: after query i's own insertion
        keep = self._closed_form(p, pi, length, self.budget)  # [b, kvh, n, c] (chunked: a token budget)
        inverse = jnp.argsort(order, axis=-1)[:, :, None, :]
        return jnp.take_along_axis(keep, jnp.broadcast_to(inverse, keep.shape), axis=-1), None

    def absorb(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        both = kvcache.chunk_slots(cache, k, v, pos)
        n = k.shape[2]
        pi = jnp.concatenate([both.state["pi"][..., :-n], self._pi(stats.first_logit)], axis=-1)  # the chunk's own pi
        both = kvcache.with_state(both, pi=pi)
        length = jnp.maximum(jnp.max(both.pos, axis=(1, 2)) + 1, 0)[:, None, None]
        order = self._time_order(both)
        c = kvcache.take_slots(both, order)  # time order, as the closed form ranks ties by it
        keep = self._closed_form(c.pos, c.state["pi"], length, self.budget)
        return kvcache.take_slots(c, kvcache.compact(keep, cache.capacity))

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos = ctx.pos
        window = self._row_budget(cache) - self.anchor_slots  # [b, kvh]
        leaving = pos[:, None, None] - window[..., None]  # the window's oldest token after this insert
        candidate = (cache.pos >= 1) & (cache.pos <= leaving)
        slot = kvcache.victim_slot(cache, cache.state["pi"], candidate, evict_highest=True)  # highest pi (eq. 4)
        return kvcache.write(cache, slot, k, v, pos)

    def observe(self, layer, cache: LayerCache, ctx, stats) -> LayerCache:
        pos = ctx.pos
        pi = self._pi(stats.first_logit)  # [b, kvh]
        mine = (cache.pos == pos[:, None, None]) & (pos[:, None, None] >= 0)
        return kvcache.with_state(cache, pi=jnp.where(mine, pi[..., None], cache.state["pi"]))


def mat(
    budget: int | None,
    anchor_slots: int,
    shallow_layers: int = 2,
    sinks: int = 4,
    *,
    group_agg: str = "mean",
    ratio: float | None = None,
    positions: str = "absolute",
    prefill_mode: PrefillMode = "stream",
    chunk: int | None = None,
) -> ByLayer:
    """MAT with cache size `c = budget`, `β = anchor_slots`, `L_s = shallow_layers`, `s = sinks`.

    `ratio` instead of `budget`: each row's `c` is its share of its own prompt (`RatioBudget`), in
    shallow and deep layers alike (MAT Table 2's "30 % KV"); `β` stays a count.
    `shallow_layers=EVERY_LAYER` is "MAT (w. sink)" (= StreamingLLM); `0` is "MAT (w. anchor)".
    """
    if not 0 <= shallow_layers:
        raise InvalidInput(f"MAT: shallow_layers (L_s)={shallow_layers} must be >= 0")
    if budget is not None and sinks >= budget:
        raise InvalidInput(f"MAT: sinks (s)={sinks} must be smaller than budget (c)={budget}")
    modes = dict(ratio=ratio, positions=positions, prefill_mode=prefill_mode, chunk=chunk)
    deep = AnchorCache(budget=budget, anchor_slots=anchor_slots, group_agg=group_agg, **modes)
    shallow = StreamingLLM(budget=budget, sinks=sinks, **modes)
    return ByLayer(split=shallow_layers, shallow=shallow, deep=deep)


def mat_with_sink(budget: int | None, sinks: int = 4, **kw) -> ByLayer:
    """The ablation "MAT (w. sink)": eq. 5 in every layer, i.e. StreamingLLM."""
    return mat(budget, anchor_slots=1, shallow_layers=EVERY_LAYER, sinks=sinks, **kw)


def mat_with_anchor(budget: int | None, anchor_slots: int, **kw) -> ByLayer:
    """The ablation "MAT (w. anchor)": eq. 4 in every layer."""
    return mat(budget, anchor_slots, shallow_layers=0, **kw)


def default_anchor_grid(budget: int) -> list[int]:
    """β values tried by `grid_search_anchors`: 1 and budget/8 .. budget/2 (Fig. 5 spans 8..128 at c=256)."""
    return sorted({b for b in (1, budget // 8, budget // 4, 3 * budget // 8, budget // 2) if 1 <= b < budget})


def grid_search_anchors(
    budget: int,
    evaluate: Callable[[Policy], float],
    grid: Sequence[int] | None = None,
    *,
    minimize: bool = True,
    **mat_kwargs,
) -> tuple[int, dict[int, float]]:
    """The paper's tuning of β for a budget: evaluate `mat(budget, β, ...)` for each β, keep the best.

    `evaluate` maps a policy to a number (e.g. `kvjax.scoring.perplexity` on held-out
    text, lower is better; or an accuracy with `minimize=False`).
    Returns (best β, {β: value}).
    """
    results = {b: float(evaluate(mat(budget, b, **mat_kwargs))) for b in (grid or default_anchor_grid(budget))}
    pick = min if minimize else max
    return pick(results, key=results.get), results


# ---- registration: MAT as its paper defines it, and its two ablations --------------------------------------------


def default_shallow_layers(num_layers: int | None) -> int:
    """MAT's L_s: the paper's 2 of 32 layers scaled to `num_layers` (at least 1 and below the depth, 0 for a
    1-layer model); 2 when the depth is not known."""
    if num_layers is None:
        return 2
    return min(max(1, round(2 * num_layers / 32)), num_layers - 1)


def _anchor_slots(budget, anchor_slots, ratio=None):
    # Default β = c/4: inside the range [32, 96] the paper found flat at c = 256 (Fig. 5). Under a ratio each row has
    # its own c, while β is one count: it must be chosen (the paper grid-searches it per budget).
    if anchor_slots is not None:
        return anchor_slots
    if ratio is not None:
        raise InvalidInput(f"MAT: ratio={ratio} sizes each row's c as a share of its prompt, but anchor_slots=None: "
                           "beta is a token count to choose (the paper grid-searches it per budget)")
    return max(1, budget // 4)


SHALLOW_LAYERS = Option(type=values.nonnegative_int, help="MAT's L_s: layers 0..L_s-1 keep sinks (eq. 5), the others "
                                                           "anchors (eq. 4); default the paper's 2 of 32 layers scaled "
                                                           "to the model's depth")


def _mat(budget, anchor_slots=None, shallow_layers=None, sinks=None, group_agg=None, ratio=None, positions=None,
         prefill_mode=None, chunk=None, num_layers=None) -> ByLayer:
    # --shallow-layers defaults to the paper's 2 of 32 layers scaled to the model's depth (at least 1, and below it,
    # so that some layer is deep: MAT with L_s = L would be StreamingLLM)
    return mat(None if ratio is not None else budget, _anchor_slots(budget, anchor_slots, ratio),
               shallow_layers if shallow_layers is not None else default_shallow_layers(num_layers),
               **given(sinks=sinks, group_agg=group_agg, ratio=ratio, positions=positions, prefill_mode=prefill_mode,
                       chunk=chunk))


def _mat_sink(budget, sinks=None, ratio=None, positions=None, prefill_mode=None, chunk=None) -> ByLayer:
    return mat_with_sink(None if ratio is not None else budget,
                         **given(sinks=sinks, ratio=ratio, positions=positions, prefill_mode=prefill_mode, chunk=chunk))


def _mat_anchor(budget, anchor_slots=None, group_agg=None, ratio=None, positions=None, prefill_mode=None,
                chunk=None) -> ByLayer:
    return mat_with_anchor(None if ratio is not None else budget, _anchor_slots(budget, anchor_slots, ratio),
                           **given(group_agg=group_agg, ratio=ratio, positions=positions, prefill_mode=prefill_mode,
                                   chunk=chunk))


register("mat", build=_mat, classes=(AnchorCache, StreamingLLM), options={"shallow_layers": SHALLOW_LAYERS},
         paper="MAT anchor tokens (papers/)", docs="policies/mat.md", chunked="exact (stream mode)")
register("mat-sink", build=_mat_sink, classes=(AnchorCache, StreamingLLM), paper="MAT's ablation: eq. 5 in every layer",
         docs="policies/mat.md", chunked="exact (stream mode)")
register("mat-anchor", build=_mat_anchor, classes=(AnchorCache,), paper="MAT's ablation: eq. 4 in every layer",
         docs="policies/mat.md", chunked="exact (stream mode)")
