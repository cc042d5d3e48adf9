"""Combinators: build a policy from others."""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import Policy

# `split` meaning "every layer is shallow", whatever the model's depth.
EVERY_LAYER = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByLayer(Policy):
    """`shallow` for layers `0 .. split-1`, `deep` for the rest (MAT's split at L_s).

    Both must process prompts the same way (`prefill_mode`), since a prompt runs
    through all layers at once.
    """

    split: int
    shallow: Policy
    deep: Policy

    def __post_init__(self):
        if self.split < 0:
            raise ValueError(f"ByLayer: split={self.split} must be >= 0")
        if self.shallow.prefill_mode != self.deep.prefill_mode:
            raise ValueError(
                f"ByLayer: shallow prefill_mode={self.shallow.prefill_mode!r} differs from deep "
                f"prefill_mode={self.deep.prefill_mode!r}"
            )

    def check(self, num_layers: int) -> None:
        if self.split != EVERY_LAYER and self.split > num_layers:
            raise ValueError(
                f"ByLayer: split (shallow layers L_s)={self.split} is out of range for a model with "
                f"{num_layers} layers (0..{num_layers}, or EVERY_LAYER)"
            )
        self.shallow.check(num_layers)
        self.deep.check(num_layers)

    @property
    def evicts_while_decoding(self):
        return self.shallow.evicts_while_decoding and self.deep.evicts_while_decoding

    @property
    def prefill_mode(self):
        return self.shallow.prefill_mode

    def with_window(self, window):
        return dataclasses.replace(self, shallow=self.shallow.with_window(window), deep=self.deep.with_window(window))

    def _at(self, layer: int) -> Policy:
        return self.shallow if layer < self.split else self.deep

    def position_mode(self, layer):
        return self._at(layer).position_mode(layer)

    def capacity(self, layer, max_len, prompt_len=0):
        return self._at(layer).capacity(layer, max_len, prompt_len)

    def prefill(self, layer, cache, k, v, pos, stats):
        return self._at(layer).prefill(layer, cache, k, v, pos, stats)

    def step(self, layer, cache, k, v, pos):
        return self._at(layer).step(layer, cache, k, v, pos)

    def observe(self, layer, cache, pos, stats):
        return self._at(layer).observe(layer, cache, pos, stats)

    def prefill_stats(self, layer):
        return self._at(layer).prefill_stats(layer)

    def decode_stats(self, layer):
        return self._at(layer).decode_stats(layer)

    def describe(self):
        return f"ByLayer(split={self.split}, shallow={self.shallow.describe()}, deep={self.deep.describe()})"


def by_layer(shallow: Policy, deep: Policy, split: int) -> ByLayer:
    return ByLayer(split=split, shallow=shallow, deep=deep)
