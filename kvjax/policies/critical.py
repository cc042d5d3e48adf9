"""CriticalKV (Feng et al. 2025, arXiv:2502.03805): any prompt compressor's scores rescaled by what each token writes
into the residual stream, ‖v W_o‖, with a two-stage selection; `CriticalAdaKV` is the same on AdaKV's head-wise
budgets. As kvpress 0.5.5's `CriticalKVPress` and `CriticalAdaKVPress` (docs/policies/criticalkv.md).

    CriticalKV(scorer=SnapKV(ratio=0.5))             # any ScoredPolicy: SnapKV, TOVA, KNorm, ExpectedAttention, ...
    CriticalAdaKV(scorer=SnapKV(ratio=0.5))          # AdaKV's layer-wide budgets, then the two stages per head

Per KV head, with s the scorer's score, n the scorer's count and f = `first_stage_ratio`:

1. stage 1 keeps the top `floor(f n)` tokens by s (at least 1 when f > 0; kvpress computes the count from the ratio,
   `int((1 - ratio) L f)`, and so does kvjax for a ratio);
2. stage 2 ranks the others by `(s + epsilon) * mean_i ‖v W_o^i‖_1`, the L1 norm of the token's value through the
   output projection block of each query head i of the group, averaged over the group; the top ones fill the count.

The output projection is the model's (`kvjax.layer.Geometry.out_proj`); the norms are computed by `kvjax.layer` at the
prompt's pass when the rule asks for them (`StatsRequest.out_norms`). A model that gives no output projection is
refused, naming the field. Prefill only, as the scorers it wraps: decoding appends.
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
from kvjax.policies.scored import AdaKV, ScoredPolicy, SnapKV, snapkv_scorer
from kvjax.stats import RuleStats, StatsRequest

CHUNK_REFUSAL = ("its output-projection norms are computed at a whole prompt's pass, and kvpress's two stages rank "
                 "a whole prompt")


def _check(policy, scorer: ScoredPolicy, first_stage_ratio: float) -> None:
    name = type(policy).__name__
    if not isinstance(scorer, ScoredPolicy):
        raise InvalidInput(f"{name}: scorer={scorer!r} is not a prompt compressor (SnapKV, PyramidKV, SlimKV, TOVA, "
                           "KNorm, KeyDiff, ExpectedAttention, ObservedAttention)")
    if not 0 <= first_stage_ratio <= 1:
        raise InvalidInput(f"{name}: first_stage_ratio={first_stage_ratio} must be in [0, 1]")
    if policy.prefill_mode != "full" or scorer.prefill_mode != "full":
        raise InvalidInput(f"{name} cannot run prefill_mode='chunked': {CHUNK_REFUSAL}")


def _out_norms(scorer: ScoredPolicy, layer: int) -> RuleStats:
    want = scorer.stats(layer)
    return RuleStats(prefill=want.prefill | StatsRequest(out_norms=frozenset({1})), decode=want.decode)


def _output_l1(stats) -> jnp.ndarray:
    """kvpress's `vwl1norm`: ‖v W_o^i‖_1 averaged over the query heads i of each KV group, `[b, kvh, t]`."""
    return stats.out_norms[1].mean(axis=2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticalKV(LayerPolicy, StepOnlyWrites):
    """CriticalKV on `scorer` (any `ScoredPolicy`, sized by its budget or ratio): stage 1 keeps the top
    `first_stage_ratio` share of the scorer's count by its score, stage 2 fills the count by
    `(score + epsilon) * ‖v W_o‖_1` (see the module). The scorer's observation window is always kept, as by the
    scorer alone (kvpress gives it the top score: kept whenever stage 1's count covers it)."""

    scorer: ScoredPolicy
    epsilon: float = option(1e-4, type=values.positive_float,
                            help="CriticalKV: added to each score before it is weighed by ||v W_o||_1 (kvpress's)")
    first_stage_ratio: float = option(0.5, type=values.probability,
                                      help="CriticalKV: the share of the count chosen by the score alone (kvpress's)")
    evicts_while_decoding = False
    chunk_refusal = CHUNK_REFUSAL

    def __post_init__(self):
        check_numbers(self)
        _check(self, self.scorer, self.first_stage_ratio)
        object.__setattr__(self, "positions", self.scorer.positions)
        super().__post_init__()

    def stats(self, layer):
        return _out_norms(self.scorer, layer)

    def capacity(self, layer, max_len, prompt_len=0):
        return self.scorer.capacity(layer, max_len, prompt_len)

    def first_count(self, layer: int, length) -> np.ndarray:
        """Stage 1's count per KV head for prompts of `length` tokens (numpy): kvpress's
        `int((1 - ratio) * L * first_stage_ratio)` under a ratio, `floor(n * first_stage_ratio)` of the scorer's count
        `n` otherwise (a token budget, PyramidKV's per-layer counts); at least 1 when `first_stage_ratio > 0`."""
        sc = self.scorer
        lengths = np.asarray(length, np.int64)
        if sc.ratio is not None and type(sc).keep_count is ScoredPolicy.keep_count:
            base = (1 - sc.ratio) * lengths.astype(np.float64)
        else:
            base = np.asarray(sc.keep_count(layer, lengths), np.float64)
        n = np.floor(base * self.first_stage_ratio)
        return (np.maximum(1, n) if self.first_stage_ratio > 0 else n).astype(np.int32)

    def keep(self, layer, k, v, pos, stats):
        """Bool `[b, kvh, t]`: the prompt tokens each KV head keeps."""
        sc = self.scorer
        length = jnp.max(pos, axis=1) + 1  # [b]
        p = pos[:, None, :]
        real = p >= 0
        in_window = real & (p >= (length - sc.observation_window)[:, None, None])
        score = sc.score(layer, k, v, pos, stats).astype(jnp.float32)
        table = jnp.asarray(self.first_count(layer, np.arange(pos.shape[1] + 1)))
        first = kvcache.keep_top(score, real, in_window, table[jnp.clip(length, 0, pos.shape[1])][:, None, None])
        rescaled = (score + self.epsilon) * _output_l1(stats)
        return kvcache.keep_top(rescaled, real, in_window | first, sc._keep(layer, length, pos.shape[1])[:, None, None])

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        keep = self.keep(layer, k, v, ctx.pos, stats)
        return kvcache.gather_prompt(cache, k, v, ctx.pos, kvcache.compact(keep, cache.capacity))

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        return kvcache.append(cache, k, v, ctx.pos)  # capacity() reserved a slot per new token

    def check(self, num_layers, num_kv_heads=None):
        self.scorer.check(num_layers, num_kv_heads)

    def describe(self):
        return (f"CriticalKV(scorer={self.scorer.describe()}, epsilon={self.epsilon}, "
                f"first_stage_ratio={self.first_stage_ratio})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticalAdaKV(AdaKV):
    """CriticalAdaKV (kvpress's `CriticalAdaKVPress`): AdaKV's head budgets, then CriticalKV's two stages per head.

    Each head first keeps its `alpha` share of the scorer's count n (the safeguard); the layer's `kvh x n` top scores
    over all heads give each head its budget B_h; stage 1 keeps each head's top `floor(first_stage_ratio B_h)` by the
    score, stage 2 fills B_h by `(score + epsilon) * ‖v W_o‖_1`. The scorer's window enters with the layer's top score
    + 1, as in `AdaKV` and kvpress (not forced). Memory: AdaKV's pool (the heads' budgets sum to the layer's)."""

    epsilon: float = 1e-4  # the options CriticalKV declares (`register` below takes them from it)
    first_stage_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        _check(self, self.scorer, self.first_stage_ratio)

    def stats(self, layer):
        return _out_norms(self.scorer, layer)

    def keep(self, layer, k, v, pos, stats):
        score, real, n_keep = self._safeguarded(layer, k, v, pos, stats)
        budgets = jnp.sum(self._layer_top(score, real, n_keep), axis=-1, keepdims=True)  # [b, kvh, 1]
        big = jnp.finfo(jnp.float32).max
        rank = jnp.argsort(jnp.argsort(-score, axis=-1, stable=True), axis=-1)
        first = jnp.floor(budgets * self.first_stage_ratio).astype(jnp.int32)
        score = jnp.where(real & (rank < first), big, score)
        # kvpress: (max + epsilon) * norm, above every other rescaled score
        rescaled = jnp.where(score == big, jnp.inf, (score + self.epsilon) * _output_l1(stats))
        rank = jnp.argsort(jnp.argsort(-rescaled, axis=-1, stable=True), axis=-1)
        return real & (rank < budgets)

    def describe(self):
        return (f"CriticalAdaKV(scorer={self.scorer.describe()}, alpha={self.alpha}, epsilon={self.epsilon}, "
                f"first_stage_ratio={self.first_stage_ratio})")


def _criticalkv(budget, ratio=None, observation_window=None, kernel=None, pool=None, group_agg=None, epsilon=None,
                first_stage_ratio=None) -> CriticalKV:
    # CriticalKV on SnapKV's score (the Python API wraps any scorer)
    return CriticalKV(scorer=snapkv_scorer(budget, ratio, observation_window, kernel, pool, group_agg),
                      **given(epsilon=epsilon, first_stage_ratio=first_stage_ratio))


def _critical_adakv(budget, ratio=None, observation_window=None, kernel=None, pool=None, group_agg=None,
                    adakv_alpha=None, epsilon=None, first_stage_ratio=None) -> CriticalAdaKV:
    return CriticalAdaKV(scorer=snapkv_scorer(budget, ratio, observation_window, kernel, pool, group_agg),
                         **given(alpha=adakv_alpha, epsilon=epsilon, first_stage_ratio=first_stage_ratio))


register("criticalkv", build=_criticalkv, classes=(SnapKV, CriticalKV), paper="Feng et al. 2025",
         docs="policies/criticalkv.md", chunked="refused", kvpress="`CriticalKVPress`")
register("critical-adakv", build=_critical_adakv, classes=(SnapKV, CriticalKV, CriticalAdaKV), paper="Feng et al. 2025",
         docs="policies/criticalkv.md", chunked="refused", kvpress="`CriticalAdaKVPress`", memory="real (AdaKV's pool)")


__all__ = ["CriticalAdaKV", "CriticalKV"]
