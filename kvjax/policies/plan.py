"""A policy resolved for one model: each layer's KV-head groups, each cached under its own rule.

`resolve(policy, num_layers, num_kv_heads)` is the one place a policy's structure is read (the
combinators' `at_layer` and `head_split`); the layer functions (`kvjax.layer`) allocate, prefill, fold chunks
and decode from the plan alone. A combinator is then a plan builder: MAT and `by_layer` choose a rule per
layer, RazorAttention and `by_head` split a layer's heads, PyramidKV gives each layer's rule its
own budget, and they nest (`by_layer(streaming, by_head(mask, full, snapkv), 2)`).

    plan = resolve(policy, num_layers, num_kv_heads)   # checked (a model's sliding windows: `on_windows` first)
    print(plan.describe())                             # one line per layer: its groups and rules
    plan = plan.sized(max_len=4096, prompt_len=4000)   # sized: each group's slot count fixed

A sized plan is what a compiled prefill is keyed by: two calls whose plans are equal (a budget
policy's capacities do not grow with `max_len`) share one compilation.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Hashable

from kvjax.errors import InvalidInput
from kvjax.layer_runs import Runs, runs_of
from kvjax.policies.base import AppendsWhileDecoding, Context, Policy, PooledRule, PositionMode, PromptMasking, Rule
from kvjax.policies.quantized import Quantized
from kvjax.quant import KVQuant
from kvjax.stats import NO_STATS, StatsRequest


@dataclasses.dataclass(frozen=True)
class Group:
    """KV heads cached together under one rule; `kv_heads` None: all of the layer's, in one array."""

    kv_heads: tuple[int, ...] | None
    rule: Rule


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Layer `layer`: `groups` cache its KV heads, each under its own rule: one group of all of them (`rule`), or
    the groups of `split_by`, the policy whose `head_split(layer)` made them (RazorAttention, `by_head`), each group
    in its own cache array (`kvjax.cache.HeadwiseCache`)."""

    layer: int
    groups: tuple[Group, ...]
    split_by: Policy | None = None  # the head split (`policy.at_layer(layer)`); None: one rule caches the layer
    sizes: tuple[int, ...] | None = None  # each group's slot count, once the plan is sized (`Plan.sized`)
    quant: KVQuant | None = None  # how every group's cache is stored (`kvjax.quant`); None: full precision

    @property
    def split(self) -> bool:
        """Whether the layer's KV heads are in groups, each in its own cache array."""
        return self.groups[0].kv_heads is not None

    @property
    def rule(self) -> Rule:
        """The rule that caches all of the layer's KV heads; a layer split into head groups has none (each group's
        is in `groups`)."""
        if self.split:
            raise InvalidInput(f"layer {self.layer}: {self.describe()}: its KV heads are split into groups, each "
                               "cached by its own rule (LayerPlan.groups)")
        return self.groups[0].rule

    def describe(self) -> str:
        """The layer's rule, or its head split's groups and their rules, as messages name them."""
        if not self.split:
            return self.groups[0].rule.describe()
        return "; ".join(f"KV heads {list(g.kv_heads)}: {g.rule.describe()}" for g in self.groups)

    @property
    def pooled(self) -> bool:
        """The layer's KV heads share one pool of `kv_heads x sizes[0]` slots (`kvjax.cache.PooledLayerCache`)."""
        return not self.split and isinstance(self.groups[0].rule, PooledRule)

    @property
    def position_mode(self) -> PositionMode:
        # the groups of a layer agree (ByHead.check): its prompt is attended once for every head
        return self.groups[0].rule.position_mode(self.layer)

    def prefill_stats(self) -> StatsRequest:
        """What the layer's prompt attention must return: every group's request, combined (the prompt is
        attended once for all heads)."""
        return functools.reduce(operator.or_, (g.rule.stats(self.layer).prefill for g in self.groups), NO_STATS)

    def decode_stats(self) -> StatsRequest:
        """What the layer's decode attention returns, over all groups (each group's rule reads its own)."""
        return functools.reduce(operator.or_, (g.rule.stats(self.layer).decode for g in self.groups), NO_STATS)

    @property
    def masking(self) -> PromptMasking | None:
        """The rule that masks the layer's prompt attention (AnLLM's eq. 4), if any: only a whole layer's
        (`ByHead.check` refuses one in a head group)."""
        rule = self.groups[0].rule
        return rule if not self.split and isinstance(rule, PromptMasking) else None

    def prompt_mask(self, ctx: Context):
        """The layer's eq. 4 `AnchorMask` over the prompt at `ctx`, or None."""
        return None if self.masking is None else self.masking.prompt_mask(ctx)

    def prefix_visible(self, cache, anchor_mask):
        """Which slots of `cache` a chunk extending it sees (`kvjax.layer.extend`); None: every valid slot."""
        return None if self.masking is None else self.masking.prefix_visible(self.layer, cache, anchor_mask)

    def body_key(self) -> Hashable:
        """What decides the layer's computation under a step: its plan but for its index, and what its rules read of
        the index (`Rule.layer_key`). Neighbouring layers with equal keys run as one compiled body."""
        return dataclasses.replace(self, layer=0), tuple(g.rule.layer_key(self.layer) for g in self.groups)

    def capacities(self, max_len: int, prompt_len: int = 0) -> tuple[int, ...]:
        """Each group's slot count for sequences of at most `max_len` tokens (prompts padded to `prompt_len`);
        a pooled layer's `(prompt slots per head, decode slots per head)`."""
        if self.pooled:
            return self.groups[0].rule.pool_capacity(self.layer, max_len, prompt_len)
        return tuple(g.rule.capacity(self.layer, max_len, prompt_len) for g in self.groups)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A policy resolved for a model: per layer a `LayerPlan` (the layer's rule and its KV-head groups).
    Built once by `resolve`; `sized(max_len, prompt_len)` fixes each group's slot count, and the sized plan
    is the static key of every compiled prefill, chunk and decode step."""

    policy: Policy
    layers: tuple[LayerPlan, ...]

    def rules(self) -> tuple[Rule, ...]:
        """Every group's rule, layer by layer."""
        return tuple(g.rule for lp in self.layers for g in lp.groups)

    @property
    def plain_prompt_pass(self) -> bool:
        """Whether the prompt is attended as a plain causal pass (the whole prompt at once, no AnLLM eq. 4
        mask, no Attention-Gates), so one pass serves several such plans (`kvjax.generate.generate_many`)."""
        return self.policy.prefill_mode == "full" and all(
            lp.masking is None and not lp.prefill_stats().gate_keep for lp in self.layers)

    def sized(self, max_len: int, prompt_len: int = 0) -> "Plan":
        """The plan with each group's slot count fixed for sequences of at most `max_len` tokens whose
        (padded) prompt is `prompt_len` long."""
        return dataclasses.replace(self, layers=tuple(
            dataclasses.replace(lp, sizes=lp.capacities(max_len, prompt_len)) for lp in self.layers))

    def runs(self) -> Runs:
        """The runs of neighbouring layers the plan treats alike (`LayerPlan.body_key`), each one compiled body."""
        return runs_of([lp.body_key() for lp in self.layers])

    @property
    def absolute(self) -> bool:
        """Whether any layer caches keys at their absolute positions (which then grow past the prompt)."""
        return any(lp.position_mode == "absolute" for lp in self.layers)

    @property
    def evicts_while_decoding(self) -> bool:
        """Whether every rule evicts as tokens arrive one by one (SnapKV & co compress a prompt once)."""
        return all(rule.evicts_while_decoding for rule in self.rules())

    @property
    def decode_appends(self) -> bool:
        """Whether every group's rule only appends while decoding (`AppendsWhileDecoding`), to per-head slots stored
        as they are (no pool shared by the heads, no quantized codes), keys at absolute positions: tokens after the
        prompt may then be read as one chunk (`kvjax.step.Append`)."""
        return all(lp.position_mode == "absolute" and not lp.pooled and lp.quant is None
                   and all(isinstance(g.rule, AppendsWhileDecoding) for g in lp.groups) for lp in self.layers)

    def describe(self) -> str:
        def sizes(lp: LayerPlan) -> str:
            quant = "" if lp.quant is None else f", stored quantized ({lp.quant.describe()})"
            if lp.sizes is not None and lp.pooled:
                return f" [a pool of {lp.sizes[0]} prompt + {lp.sizes[1]} decode slots per KV head]"
            return ("" if lp.sizes is None else f" [{', '.join(map(str, lp.sizes))} slots]") + quant

        return "\n".join(f"layer {lp.layer}: {lp.describe()}{sizes(lp)}" for lp in self.layers)


def resolve(policy: Policy, num_layers: int, num_kv_heads: int | None = None) -> Plan:
    """`policy` resolved into one `LayerPlan` per layer, after `policy.check` (so a combination that
    cannot work, e.g. AnLLM in one head group, is refused here with its reason)."""
    policy.check(num_layers, num_kv_heads)
    # A quantized cache changes no rule: the wrapped policy's rules, each layer's cache stored as codes.
    quant, rules_of = (policy.kv_quant, policy.policy) if isinstance(policy, Quantized) else (None, policy)
    layers = []
    for i in range(num_layers):
        member = rules_of.at_layer(i)  # the layer's rule, or the policy that splits its KV heads into groups
        split = member.head_split(i)
        groups = (Group(None, member),) if split is None else tuple(Group(tuple(h), sub) for h, sub in split)
        not_rules = [g.rule for g in groups if not isinstance(g.rule, Rule)]
        if not_rules:
            raise InvalidInput(f"{not_rules[0].describe()} is given layer {i} to cache, but it is no Rule (it only "
                               "builds plans)")
        pooled_group = [g.rule for g in groups if g.kv_heads is not None and isinstance(g.rule, PooledRule)]
        if pooled_group:
            raise InvalidInput(f"{pooled_group[0].describe()} ranks all of a layer's KV heads together in one pool; "
                               f"it cannot cache one head group of layer {i}")
        layers.append(LayerPlan(i, groups, None if split is None else member, quant=quant))
        if quant is not None and layers[-1].pooled:
            raise InvalidInput(f"{member.describe()}: its heads share one pool of slots "
                               "(kvjax.cache.PooledLayerCache), which cannot be stored quantized")
    return Plan(policy, tuple(layers))
