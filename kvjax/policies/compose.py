"""Combinators: build a policy from others."""

from __future__ import annotations

import dataclasses

from kvjax.errors import InvalidInput
from kvjax.policies.base import Policy, PromptMasking, check_numbers, refuse_hooked
from kvjax.policies.plan import resolve
from kvjax.policies.quantized import Quantized
from kvjax.policies.ring import FullCache

# `split` meaning "every layer is shallow", whatever the model's depth.
EVERY_LAYER = 2**31 - 1
"""`ByLayer(split=EVERY_LAYER, ...)`: every layer uses the shallow policy, whatever the model's depth."""


class LayerDispatch(Policy):
    """A policy that hands each layer to one of its member policies (`_at(layer)`; all of them: `members()`).

    All members must process prompts the same way (`prefill_mode`), since a prompt runs
    through every layer at once; per-token hooks go to the layer's member only.
    """

    def _at(self, layer: int) -> Policy:
        raise NotImplementedError

    def members(self) -> tuple[Policy, ...]:
        raise NotImplementedError

    def _check_modes(self, name: str) -> None:
        refuse_hooked(name, self.members())
        modes = {(m.prefill_mode, m.chunk) for m in self.members()}
        if len(modes) > 1:
            raise InvalidInput(f"{name}: its policies process prompts differently ((prefill_mode, chunk) "
                               f"{sorted(modes, key=str)}); give them one prefill_mode and chunk")

    def at_layer(self, layer: int) -> Policy:
        return self._at(layer).at_layer(layer)

    # A prompt runs through every layer at once: the members agree on how (`_check_modes`).
    @property
    def prefill_mode(self):
        return self.members()[0].prefill_mode

    @property
    def chunk(self):
        return self.members()[0].chunk

    def shrink(self, cache, room: int):
        """Each member that sizes its cache after prefill (the gate) shrinks its own layers."""
        members, cache = list(self.members()), list(cache)
        for m in dict.fromkeys(members):
            own = [self._at(i) == m for i in range(len(cache))]
            # the member sees its own layers only (None elsewhere), so its sizes depend on them alone
            new, small = m.shrink(tuple(c if o else None for c, o in zip(cache, own)), room)
            if new is m:
                continue
            cache = [s if o else c for c, s, o in zip(cache, small, own)]
            members = [new if x == m else x for x in members]
        return self._with_members(tuple(members)), tuple(cache)

    def _with_members(self, members: tuple[Policy, ...]) -> "LayerDispatch":
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByLayer(LayerDispatch):
    """`shallow` for layers `0 .. split-1`, `deep` for the rest (MAT's split at L_s)."""

    split: int
    shallow: Policy
    deep: Policy

    def __post_init__(self):
        check_numbers(self)
        if self.split < 0:
            raise InvalidInput(f"ByLayer: split={self.split} must be >= 0")
        self._check_modes("ByLayer")

    def check(self, num_layers: int, num_kv_heads: int | None = None) -> None:
        if self.split != EVERY_LAYER and self.split > num_layers:
            raise InvalidInput(
                f"ByLayer: split (shallow layers L_s)={self.split} is out of range for a model with "
                f"{num_layers} layers (0..{num_layers}, or EVERY_LAYER)"
            )
        if self.split == num_layers and self.shallow != self.deep:
            # every layer shallow: the combination is its shallow policy alone (MAT with L_s = 2 on a 2-layer
            # model is StreamingLLM), which a table would print as the method
            raise InvalidInput(
                f"ByLayer: split (shallow layers L_s)={self.split} puts all {num_layers} layers of the model in "
                f"{self.shallow.describe()}, so this is that policy alone, not the combination; give a split "
                f"below {num_layers}, or run the shallow policy itself (EVERY_LAYER says so on purpose)")
        self.shallow.check(num_layers, num_kv_heads)
        self.deep.check(num_layers, num_kv_heads)

    def on_sliding_window(self, window):
        return dataclasses.replace(self, shallow=self.shallow.on_sliding_window(window), deep=self.deep.on_sliding_window(window))

    def _at(self, layer: int) -> Policy:
        return self.shallow if layer < self.split else self.deep

    def members(self):
        return (self.shallow, self.deep)

    def _with_members(self, members):
        return dataclasses.replace(self, shallow=members[0], deep=members[1])

    def describe(self):
        return f"ByLayer(split={self.split}, shallow={self.shallow.describe()}, deep={self.deep.describe()})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerLayer(LayerDispatch):
    """`layers[l]` caches layer `l`: one policy per layer (e.g. Gemma's sliding-window layers keep a
    window ring while the global layers are compressed; see `on_windows`)."""

    layers: tuple[Policy, ...]

    def __post_init__(self):
        if not self.layers:
            raise InvalidInput("PerLayer: layers is empty")
        self._check_modes("PerLayer")

    def check(self, num_layers: int, num_kv_heads: int | None = None) -> None:
        if len(self.layers) != num_layers:
            raise InvalidInput(f"PerLayer has {len(self.layers)} policies for a model with {num_layers} layers")
        for m in set(self.layers):
            m.check(num_layers, num_kv_heads)

    def on_sliding_window(self, window):
        return dataclasses.replace(self, layers=tuple(p.on_sliding_window(window) for p in self.layers))

    def _at(self, layer: int) -> Policy:
        return self.layers[layer]

    def members(self):
        return self.layers

    def _with_members(self, members):
        return dataclasses.replace(self, layers=members)

    def describe(self):
        # Runs of equal policies are named once: "0-5: FullCache(...); 6: SnapKV(...)".
        runs, start = [], 0
        for i in range(1, len(self.layers) + 1):
            if i == len(self.layers) or self.layers[i] != self.layers[start]:
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                runs.append(f"{span}: {self.layers[start].describe()}")
                start = i
        return f"PerLayer({'; '.join(runs)})"


def by_layer(shallow: Policy, deep: Policy, split: int) -> ByLayer:
    """Layers `0 .. split - 1` cached by `shallow`, the rest by `deep` (MAT is
    `by_layer(StreamingLLM, AnchorCache, L_s)`); each member may itself be any policy or combinator."""
    return ByLayer(split=split, shallow=shallow, deep=deep)


class ByHead(Policy):
    """Per layer, the KV heads split into groups, each cached by its own policy in its own array.

    Subclasses define `head_split(layer)`. The model's plan (`kvjax.policies.plan`) turns each group
    into a `Group` with its own rule: `kvjax.layer` allocates a `kvjax.cache.HeadwiseCache` (one
    `LayerCache` per group, of that group's capacity) and runs every rule method group by group
    (`kvjax.layer.rule_groups`), so the split itself caches nothing.
    """

    def head_split(self, layer: int) -> tuple[tuple[tuple[int, ...], Policy], ...]:
        raise NotImplementedError

    def _subs(self, layer):
        return [sub for _, sub in self.head_split(layer)]

    @property
    def prefill_mode(self):
        return self._subs(0)[0].prefill_mode

    @property
    def chunk(self):
        return self._subs(0)[0].chunk

    def _num_layers(self) -> int:
        raise NotImplementedError

    def check(self, num_layers, num_kv_heads=None):
        for layer in range(num_layers):
            split = self.head_split(layer)
            refuse_hooked(type(self).__name__, [sub for _, sub in split])
            heads = sorted(h for hs, _ in split for h in hs)
            if num_kv_heads is not None and heads != list(range(num_kv_heads)):
                raise InvalidInput(
                    f"{type(self).__name__}: layer {layer} splits KV heads {heads}, but the model has "
                    f"{num_kv_heads} KV heads per layer (each must be in exactly one group)"
                )
            modes = {sub.position_mode(layer) for _, sub in split} | {sub.prefill_mode for _, sub in split}
            if len(modes) != 2:
                raise InvalidInput(f"{type(self).__name__}: the groups of layer {layer} differ in position or "
                                 f"prefill mode ({sorted(modes)}); a layer's prompt is attended once for all heads")
            for _, sub in split:
                if isinstance(sub, PromptMasking) or sub.stats(layer).prefill.gate_keep:
                    # AnLLM's eq. 4 mask and the gate's keep flags shape the whole layer's prompt attention
                    # (every head of it): one head group cannot have them while its neighbours do not.
                    raise InvalidInput(f"{type(self).__name__}: {sub.describe()} cannot cache a head group of layer "
                                       f"{layer}: it masks the prompt's attention for every head of the layer; give "
                                       "it whole layers (by_layer / PerLayer)")
                sub.check(num_layers)



@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadSplit(ByHead):
    """An explicit split: `layers[l]` is `((kv_heads, policy), ...)` for layer `l`."""

    layers: tuple[tuple[tuple[tuple[int, ...], Policy], ...], ...]

    def __post_init__(self):
        if not self.layers:
            raise InvalidInput("HeadSplit: no layers")
        for layer, split in enumerate(self.layers):
            if not split or any(not heads for heads, _ in split):
                raise InvalidInput(f"HeadSplit: layer {layer} has an empty group")

    def _num_layers(self):
        return len(self.layers)

    def check(self, num_layers, num_kv_heads=None):
        if len(self.layers) != num_layers:
            raise InvalidInput(f"HeadSplit: {len(self.layers)} layers given, the model has {num_layers}")
        super().check(num_layers, num_kv_heads)

    def head_split(self, layer):
        return self.layers[layer]

    def on_sliding_window(self, window):
        return dataclasses.replace(self, layers=tuple(
            tuple((heads, sub.on_sliding_window(window)) for heads, sub in split) for split in self.layers
        ))

    def describe(self):
        return "HeadSplit(" + "; ".join(
            f"layer {i}: " + ", ".join(f"heads {list(h)} -> {sub.describe()}" for h, sub in split)
            for i, split in enumerate(self.layers)
        ) + ")"


def by_head(mask, selected: Policy, rest: Policy) -> HeadSplit:
    """`selected` for the KV heads where `mask[layer][head]` is true, `rest` for the others
    (RazorAttention's retrieval heads full, the rest local). `mask`: `[layers][kv_heads]` bools."""
    layers = []
    for row in mask:
        yes = tuple(i for i, m in enumerate(row) if m)
        no = tuple(i for i, m in enumerate(row) if not m)
        layers.append(tuple((h, p) for h, p in ((yes, selected), (no, rest)) if h))
    return HeadSplit(layers=tuple(layers))


def on_windows(policy: Policy, windows: int | None | tuple[int | None, ...], num_layers: int,
               num_kv_heads: int | None = None) -> Policy:
    """`policy` as a model with sliding-window attention runs it. `windows`: how far back every layer's queries see
    (an int: Mistral's one window; None: the whole context), or each layer's (Gemma 2 / 3's local and global
    layers, None for a global one).

    One window for all layers: the policy's own `on_sliding_window` (FullCache becomes a W-slot ring). Per-layer
    windows: the policy compresses the global layers only while each sliding layer keeps a W-slot ring, as
    kvpress does on Gemma 3 (a local layer never sees more than W tokens, so there is nothing there to compress);
    a `PerLayer` keeps its own choice per layer, each sliding layer still bounded by its W. A `Quantized` policy
    is fitted inside, its cache stored as before."""
    if isinstance(policy, Quantized):
        return dataclasses.replace(policy, policy=on_windows(policy.policy, windows, num_layers, num_kv_heads))
    if not isinstance(windows, tuple):
        return policy if windows is None else policy.on_sliding_window(windows)
    if len(windows) != num_layers:
        raise InvalidInput(f"on_windows: {len(windows)} windows for a model of {num_layers} layers")
    if isinstance(policy, PerLayer):
        return PerLayer(layers=tuple(p if w is None else p.on_sliding_window(w) for p, w in zip(policy.layers, windows)))
    modes = resolve(policy, num_layers, num_kv_heads).layers  # the global layers' position modes
    return PerLayer(layers=tuple(
        policy if w is None else
        FullCache(positions=modes[i].position_mode, prefill_mode=policy.prefill_mode, chunk=policy.chunk
                  ).on_sliding_window(w)
        for i, w in enumerate(windows)))
