"""`Quantized(policy, bits=2)`: any policy's kept slots stored as int8 or KIVI codes (`kvjax.quant`).

The wrapper changes no rule: `resolve` plans with the wrapped policy's rules and puts the `KVQuant` on
the plan, and `kvjax.layer` stores each layer's cache quantized between calls (eviction scores are computed
on the dequantized cache). Its description names both, so a record's identity includes the width.
"""

from __future__ import annotations

import dataclasses

from kvjax.errors import InvalidInput
from kvjax.policies.base import Policy, PooledRule, check_numbers, refuse_hooked
from kvjax.quant import KVQuant


@dataclasses.dataclass(frozen=True)
class Quantized(Policy):
    """`policy`'s kept slots stored as codes: `bits=8` int8 per token (symmetric, a scale per KV head and
    token), `bits=4 | 2` KIVI (keys per channel over `group` slots, values per token over `group` channels,
    the `residual` most recent tokens also in full precision). The wrapped policy's rules run unchanged on
    the dequantized cache."""

    policy: Policy
    bits: int
    group: int | None = None
    residual: int = 0

    def __post_init__(self):
        check_numbers(self)
        self.kv_quant  # noqa: B018  (checks the width, group and residual)
        if isinstance(self.policy, Quantized):
            raise InvalidInput("Quantized(Quantized(...)): a cache is quantized once")
        pooled = [p for p in _members(self.policy) if isinstance(p, PooledRule)]
        if pooled:
            raise InvalidInput(f"{type(pooled[0]).__name__}: its KV heads share one pool of slots "
                               "(kvjax.cache.PooledLayerCache), which is not stored quantized; quantize a policy "
                               "whose heads keep their own slots")
        replaying = [p for p in _members(self.policy) if p.replays_prompt]
        if replaying:
            # generation replayed nothing under the wrapper, so the 4-bit "KVzip" kept every slot: refused instead
            raise InvalidInput(f"{type(replaying[0]).__name__}: its slots are scored by replaying the prompt through "
                               "the model over the full-precision cache, which a quantized cache does not keep; a "
                               "quantized KVzip-family cache is not supported (quantize SnapKV, StreamingLLM, ... "
                               "or run KVzip unquantized)")
        refuse_hooked("a quantized cache (--kv-bits)", [p for p in _members(self.policy) if not p.replays_prompt])
        shrinking = [p for p in _members(self.policy) if type(p).shrink is not Policy.shrink]
        if shrinking:
            raise InvalidInput(f"{shrinking[0].describe()} moves its cache on the host after the prompt (shrink); it "
                               "is not combined with a quantized cache")

    @property
    def kv_quant(self) -> KVQuant:
        return KVQuant(self.bits, self.group, self.residual)

    # The wrapped policy decides everything else.
    @property
    def prefill_mode(self):
        return self.policy.prefill_mode

    @property
    def chunk(self):
        return self.policy.chunk

    def describe(self) -> str:
        return f"Quantized({self.policy.describe()}, {self.kv_quant.describe()})"

    def at_layer(self, layer):
        # `resolve` unwraps a Quantized policy; reaching here means one sits inside a combinator, where its
        # width would be lost.
        raise InvalidInput(f"{self.describe()} inside a combinator: quantize the whole policy "
                           "(Quantized(by_layer(...), bits=...)), not one of its members")

    def check(self, num_layers, num_kv_heads=None):
        self.policy.check(num_layers, num_kv_heads)

    def on_sliding_window(self, window):
        return dataclasses.replace(self, policy=self.policy.on_sliding_window(window))


def _members(policy: Policy) -> list[Policy]:
    """The policies a layer dispatch (`by_layer`, `PerLayer`) hands its layers to, recursively; else the policy."""
    members = policy.members()
    return [m for member in dict.fromkeys(members) for m in _members(member)] if members else [policy]
