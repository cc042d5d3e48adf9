"""Attention-Gate's cache: each KV head keeps only the prompt tokens its gate retained.

The gate's flags (`kvjax.gate`) are computed inside prefill, layer by layer, so how many
tokens a layer keeps is known only once the prompt has run. Prefill therefore writes the
kept tokens, compacted in time order, to the front of a prompt-sized cache; then, on the
host, `shrink` cuts every layer to the most any layer, head and row kept, rounded up
to a multiple of `bucket` (one size for all layers, so a few shapes serve every prompt), plus a
slot per token to decode. The memory saving is real for the whole decode; decoding appends normally (the
gate does not run on decoded tokens, which are all kept).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvcache
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax import values
from kvjax.policies.base import LayerPolicy
from kvjax.policies.options import given, option, register
from kvjax.stats import RuleStats, StatsRequest


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateEviction(LayerPolicy):
    """Keeps, per KV head, the prompt tokens whose Attention-Gate flag is 1 (eq. 7).

    `kept`: per-layer slots for the prompt, set by `shrink` after prefill (None: the whole prompt).
    """

    bucket: int = option(64, type=values.positive_int,
                         help="Attention-Gate: kept slots are rounded up to a multiple of this (fewer shapes)")
    kept: tuple[int, ...] | None = None
    evicts_while_decoding = False  # a class attribute, not a field

    def __post_init__(self):
        super().__post_init__()
        if self.bucket < 1:
            raise InvalidInput(f"GateEviction: bucket={self.bucket} must be >= 1")
        if self.prefill_mode != "full" or self.positions != "absolute":
            raise InvalidInput("GateEviction decides at prefill over the whole prompt: prefill_mode must be 'full' and "
                             "positions 'absolute'")

    def capacity(self, layer, max_len, prompt_len=0):
        if self.kept is None:
            return max_len
        return self.kept[layer] + (max_len - prompt_len)

    def check(self, num_layers, num_kv_heads=None):
        if self.kept is not None and len(self.kept) != num_layers:
            raise InvalidInput(f"GateEviction: kept has {len(self.kept)} layers, the model has {num_layers}")

    def stats(self, layer):
        # The gates' flags mask the prompt's attention (eq. 7) and decide what is kept.
        return RuleStats(prefill=StatsRequest(gate_keep=True))

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        keep = stats.gate_keep & (pos >= 0)[:, None, :]
        return kvcache.gather_prompt(cache, k, v, pos, kvcache.compact(keep, cache.capacity))

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos = ctx.pos
        return kvcache.append(cache, k, v, pos)

    def shrink(self, cache, room: int):
        """Every layer to the most any layer, head and row kept, rounded up to `bucket`: one size for
        all layers, so two prompts whose largest kept count falls in one bucket share a compiled
        decode. Layers given as None (another policy's, inside a combinator) are left alone."""
        mine = [c for c in cache if c is not None]
        most = max(int(jnp.max(jnp.sum(c.pos >= 0, axis=-1))) for c in mine)
        n = min(max(1, -(-most // self.bucket) * self.bucket), min(c.capacity for c in mine) - room)
        kept = tuple(0 if c is None else n for c in cache)
        small = tuple(None if c is None else jax.tree.map(lambda x: x[:, :, : n + room], c) for c in cache)
        return dataclasses.replace(self, kept=kept), small

# Attention-Gate: the trained gates decide (load them with --gate-params); no budget, and it decides over the whole
# prompt at absolute positions (its prompt-mode options are not its own)
register("gate", build=lambda budget, bucket=None: GateEviction(**given(bucket=bucket)), classes=(GateEviction,),
         budget=False, paper="Attention-Gate (papers/)", docs="policies/gate.md", chunked="refused",
         memory="real (cut to the most any head kept)")
