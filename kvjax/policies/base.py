"""The cache-policy interface: `Policy` builds plans, `Rule` caches a layer.

A `Policy` is what a user passes; it says which `Rule` caches each layer and KV-head group
(`kvjax.policies.plan.resolve`). A `Rule` is what `kvjax.layer` calls for a model's attention layer; a rule
that folds a prompt chunk by chunk is also a `ChunkRule`, one that masks the prompt's attention a
`PromptMasking`, one whose layer's heads share a pool of slots a `PooledRule`; `KeepsEveryToken`, `ReadsTokens`
and `StepOnlyWrites` say what else `kvjax.layer` must know of a rule. Every hook `kvjax.layer` and the plan read
is declared on these classes. A single rule is its own policy (`LayerPolicy`); combinators (`by_layer`,
`by_head`, ...) are policies only.

Both are frozen (hence hashable) dataclasses, passed to `jax.jit` as static arguments (in the sized plan). Its methods are pure functions of arrays; `layer` is a Python int, so
a policy may behave differently per layer (MAT's shallow/deep split, PyramidKV's
per-layer budgets) and still trace to static shapes.

`resolve` reads each layer's rule once (`rule = policy.at_layer(layer)`; a policy that splits the
layer's KV heads, `head_split(layer)`, is resolved into one rule per head group, each with its
own cache), and the layer functions call only that rule, always with the same arguments: `ctx`, a
`Context` of the tokens' positions and ids, and the `stats` attention returned. Per layer:

* prefill (`prefill_mode == "full"`): full causal attention over the prompt, then
  `cache = rule.prefill(layer, empty_cache, k, v, ctx, stats)`;
* decode: `cache = rule.step(layer, cache, k, v, ctx)` inserts the new token
  (evicting if needed), attention runs over the cache (the new token included),
  then `cache = rule.observe(layer, cache, ctx, stats)` lets the rule update
  its per-slot statistics from what attention returned (nothing is recomputed);
* prefill (`prefill_mode == "stream"`): `cache = rule.size_rows(layer, empty_cache, ctx)` sets
  what depends on each row's whole prompt (a ratio budget), then the prompt goes token by token
  through the decode path, so every prompt token only sees what the rule kept, as in
  StreamingLLM's perplexity protocol and MAT's evaluation.
* prefill (`prefill_mode == "chunked"`, `chunk = n`): the prompt goes `n` tokens at a time. Per
  chunk, `cache = rule.make_room(layer, cache, ctx)`, then the chunk attends the cache (the
  slots `chunk_visible` allows each query) and itself causally, returning the prompt's statistics over
  `[cache slots; chunk]`, then `cache = rule.absorb(layer, cache, k, v, ctx, stats)` takes the
  chunk in and evicts back to the budget. Memory is O(budget + chunk) whatever the prompt's length.

`stats(layer)` names the statistics attention must return, a `kvjax.stats.RuleStats` of a prompt's and a
decode step's `StatsRequest`; attention hands them over as an `AttentionStats`. The default is none, so
attention computes none. A rule that asks for `gate_keep` has the prompt attended
under the model's Attention-Gates (eq. 7) and gets their flags in `stats.gate_keep`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import warnings
from collections.abc import Hashable, Mapping
from types import MappingProxyType
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax import cache as kvcache
from kvjax import values
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.options import option
from kvjax.stats import AttentionStats, RuleStats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """What a rule is told about the tokens it caches, besides their keys and values: the same for every
    rule and every call, so no rule needs a flag to be handed what it reads (AnLLM reads the ids).

    `pos`: positions, -1 on padding; `tokens`: the token ids (None where the caller has none, e.g. a
    hidden-state forward). `[b, t]` for a prompt or a chunk, `[b]` for one decode step. `hidden`: the layer's
    input to its q / k / v projections, `[b, t, D]` or `[b, D]` (KVzap's surrogate reads it), given to a whole
    prompt's and a decode step's rules; None where the model gives none, or for a chunk."""

    pos: Int[Array, "b *t"]
    tokens: Int[Array, "b *t"] | None = None
    hidden: Float[Array, "b *t D"] | None = None


PositionMode = Literal["absolute", "rolling"]
PrefillMode = Literal["full", "stream", "chunked"]
POSITION_MODES = ("absolute", "rolling")
PREFILL_MODES = ("full", "stream", "chunked")


class Rule(abc.ABC):
    """What caches one layer, or one KV-head group of it: `kvjax.layer` calls only these, for the model's attention.

    A rule that can also fold a prompt chunk by chunk is a `ChunkRule`; one that masks the prompt's attention
    is a `PromptMasking` too. Which rule caches which layer and heads is the `Policy`'s business (a plan)."""

    # False for rules that compress a whole prompt once and then only append (SnapKV & co): fed token by
    # token (kvjax.scoring), they would never compress.
    evicts_while_decoding: bool = True
    # The rule's own statistics in its cache, each named for what it holds: {name: "slot" | "head"}, an array per
    # slot (moving with its token: H2O's "mass") or per KV head (RazorAttention's "recent"); see
    # `kvjax.cache.LayerCache.state`. The engine allocates them; none by default.
    cache_state: Mapping[str, str] = MappingProxyType({})

    @abc.abstractmethod
    def position_mode(self, layer: int) -> PositionMode:
        """'absolute': keys cached rotated at their positions; 'rolling': unrotated, rotated by rank."""

    @abc.abstractmethod
    def capacity(self, layer: int, max_len: int, prompt_len: int) -> int:
        """Static slot count of `layer` for sequences of at most `max_len` tokens whose prompt
        (padded) is `prompt_len` long."""

    @abc.abstractmethod
    def prefill(
        self,
        layer: int,
        cache: LayerCache,
        k: Float[Array, "b kvh t d"],
        v: Float[Array, "b kvh t d"],
        ctx: Context,
        stats: AttentionStats,
    ) -> LayerCache:
        """Compresses a whole (left-padded, ctx.pos = -1 on padding) prompt into `cache`."""

    @abc.abstractmethod
    def step(
        self,
        layer: int,
        cache: LayerCache,
        k: Float[Array, "b kvh d"],
        v: Float[Array, "b kvh d"],
        ctx: Context,
    ) -> LayerCache:
        """Inserts one token per row (`ctx.pos` `[b]`), evicting if full. Rows with pos < 0 are unchanged."""

    def observe(self, layer: int, cache: LayerCache, ctx: Context, stats: AttentionStats) -> LayerCache:
        """Updates per-slot statistics after the decode attention of the token at `ctx.pos` `[b]`."""
        del layer, ctx, stats
        return cache

    def size_rows(self, layer: int, cache: LayerCache, ctx: Context) -> LayerCache:
        """Before a whole prompt at positions `ctx.pos` `[b, t]` (-1 on padding) is read token by token into the
        fresh `cache` (prefill_mode "stream", or text scored token by token): a budget that depends on
        each row's prompt (a ratio) is set here, since `step` sees one token at a time. Default: nothing."""
        del layer, ctx
        return cache

    def layer_key(self, layer: int) -> Hashable:
        """What this rule's methods read of `layer` once its slots are sized (a budget that varies with depth:
        PyramidKV's): layers whose sized plans are equal and whose rules give equal keys run as one compiled body,
        a scan over those layers (`kvjax.layer_runs`), called with the first of them. None: every layer alike. A
        rule that holds rules (CriticalKV's, ChunkKV's scorer) reads what they read."""
        fields = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        inner = tuple(x.layer_key(layer) for x in (getattr(self, f.name) for f in fields) if isinstance(x, Rule))
        return inner if any(k is not None for k in inner) else None

    def stats(self, layer: int) -> RuleStats:
        """Statistics attention must return to this rule (see `kvjax.attention`): the prompt's (to `prefill`, and
        a chunk's to `absorb`) and each decode step's (to `observe`). Default: none."""
        del layer
        return RuleStats()

    @abc.abstractmethod
    def describe(self) -> str:
        """The rule and its parameters, as records and tables name it."""


class KeepsEveryToken(Rule):
    """A rule that never evicts (FullCache), a kind of its own as `ChunkRule` is: its cache must hold every token
    of the sequence, so `kvjax.layer` refuses a prompt longer than its slots, or a token past them, rather than
    evicting silently."""


class ReadsTokens(Rule):
    """A rule that reads the token ids (`Context.tokens`: AnLLM's anchors): `kvjax.layer` refuses a call without
    them."""


class StepOnlyWrites(Rule):
    """A rule whose `step` only writes the new token, into a slot chosen from positions and the rule's own
    statistics, reading no cached key or value (the rings, H2O, SnapKV & co, KVzip, AdaKV): a decode step over a
    quantized cache then reads the codes directly (`kvjax.quant`) instead of dequantizing the layer first. Any other
    rule's `step` may read the cached keys and values (RazorAttention's compensation token averages them)."""


class AppendsWhileDecoding(StepOnlyWrites):
    """A rule whose decode step only appends: `step` writes the token into a free slot (the plan reserves one per
    token after the prompt) and `observe` changes nothing (SnapKV & co, KVzip, FullCache). Tokens that follow the
    prompt (a question) are then attended as one chunk and written in order (`kvjax.step.Append`): the cache and
    logits of feeding them one at a time, from one forward instead of one per token."""


class PooledRule(Rule):
    """A rule whose layer's KV heads share one pool of slots (`kvjax.cache.PooledLayerCache`), so that heads keep
    different numbers of tokens (AdaKV): the plan allocates the pool from `pool_capacity` rather than from
    `capacity`, and refuses such a rule in a head group or over a quantized cache (`kvjax.policies.plan.resolve`).
    Its `prefill` and `step` take and return the pool."""

    @abc.abstractmethod
    def pool_capacity(self, layer: int, max_len: int, prompt_len: int) -> tuple[int, int]:
        """`(prompt slots, decode slots)` per KV head of `layer` for sequences of at most `max_len` tokens whose
        (padded) prompt is `prompt_len` long: the pool holds `kv_heads x` each (`kvjax.cache.empty_pool`)."""


class ChunkRule(Rule):
    """A rule that folds a prompt into its cache chunk by chunk (`prefill_mode="chunked"`)."""

    def make_room(self, layer: int, cache: LayerCache, ctx: Context) -> LayerCache:
        """Before a chunk at positions `ctx.pos` `[b, n]` attends: evicts what the chunk's tokens will replace
        (H2O frees its victims here, as its `step` does before a token attends). Default: nothing."""
        del layer, ctx
        return cache

    def chunk_visible(
        self, layer: int, cache: LayerCache, ctx: Context
    ) -> tuple[Bool[Array, "b kvh n c"] | None, Bool[Array, "b n n"] | None]:
        """Which cache slots and which earlier chunk tokens each query of the chunk may see, beyond
        causality: what the cache would hold when that token is reached (a ring's sinks + window),
        or what the rule's mask allows (AnLLM's eq. 4). None: all of them."""
        del layer, cache, ctx
        return None, None

    def rolling_sinks(self, layer: int, capacity: int) -> int:
        """Rolling positions in a chunk: the leading positions whose distance to a query is measured
        from `min(query, capacity - 1)` (a ring's sinks, ranked first in a full cache); the other
        keys are at their true distance. Only a ring keeps ranks that a chunk can compute."""
        raise InvalidInput(f"{self.describe()}: rolling positions cannot be computed for a chunk of the prompt "
                           "(they are ranks in a cache with gaps); use positions='absolute' or prefill_mode='stream'")

    @abc.abstractmethod
    def absorb(
        self,
        layer: int,
        cache: LayerCache,
        k: Float[Array, "b kvh n d"],
        v: Float[Array, "b kvh n d"],
        ctx: Context,
        stats: AttentionStats,
    ) -> LayerCache:
        """Takes a chunk (positions `ctx.pos` `[b, n]`, -1 on padding) into `cache`, evicting back to the budget."""


class PromptMasking(Rule):
    """A rule that restricts the prompt's attention itself (AnLLM's eq. 4), for every head of its layers."""

    @abc.abstractmethod
    def prompt_mask(self, ctx: Context):
        """A `kvjax.masks.AnchorMask` over the prompt at `ctx` (None: no restriction)."""

    def prefix_visible(self, layer: int, cache: LayerCache, anchor_mask) -> Bool[Array, "b kvh t c"] | None:
        """Which slots of `cache` each query of a chunk that extends it may see (`kvjax.drive.extend`),
        given the chunk's `prompt_mask` (None when it has none). None: every valid slot."""
        del layer, cache, anchor_mask
        return None


class Policy(abc.ABC):
    """What a user passes: it builds a plan, saying which `Rule` caches each layer and KV-head group
    (`kvjax.policies.plan.resolve`). A single rule is its own policy (`LayerPolicy`); combinators
    (`by_layer`, `by_head`, MAT, RazorAttention, DuoAttention, `Quantized`) only build plans."""

    prefill_mode: PrefillMode
    # Prompt tokens per chunk when prefill_mode == "chunked", else None.
    chunk: int | None = None
    # Whether the policy scores its slots by running the model again over the cached prompt once it is read
    # (KVzip's replay, `kvjax.kvzip`): the cache it scores is the full-precision one.
    replays_prompt: bool = False

    def at_layer(self, layer: int) -> "Policy":
        """The policy that caches `layer`: itself, or for a combinator the member that owns the layer.

        `resolve` asks for each layer's rule once, here, and `kvjax.layer` then calls only that rule's methods;
        so a combinator forwards nothing, and a member's hooks (AnLLM's prompt mask, the gate) act in its
        own layers only."""
        del layer
        return self

    def head_split(self, layer: int) -> tuple[tuple[tuple[int, ...], "Policy"], ...] | None:
        """`((kv_heads, policy), ...)` when `layer`'s KV heads are cached in separate groups of
        different capacity (`kvjax.cache.HeadwiseCache`); None for one array over all heads."""
        del layer
        return None

    def members(self) -> tuple[Policy, ...]:
        """The policies this one hands whole layers to (`by_layer`'s shallow and deep, `PerLayer`'s layers), each
        resolved further by its own `at_layer`; () for a policy that caches its layers itself or splits their
        heads (`head_split`)."""
        return ()

    def same_as(self) -> str | None:
        """What this policy's parameters reduce it to, when that is another method (PyramidKV whose pyramid never
        fits is SnapKV), for the tables to say (`kvjax.policies.reduces_to`); None: the method itself."""
        return None

    def check(self, num_layers: int, num_kv_heads: int | None = None) -> None:
        """Raises ValueError if the policy cannot run on a model of `num_layers` layers
        (and `num_kv_heads` KV heads per layer, for policies that name heads)."""

    def on_sliding_window(self, window: int) -> "Policy":
        """This policy on a model whose attention never looks back more than `window` tokens (Mistral's
        sliding window, Gemma's local layers).

        Only rules that would otherwise keep tokens the model can no longer see change (FullCache,
        RazorAttention's retrieval heads: a ring of `window` slots); the attention mask hides older
        tokens for the rest.
        """
        del window
        return self

    def shrink(self, cache, room: int) -> tuple["Policy", object]:
        """After prefill (on the host): a policy whose cache size is only known once the prompt is
        compressed returns itself sized to `cache` plus `room` decode slots, and the cache moved
        into it (Attention-Gate). Default: unchanged."""
        del room
        return self, cache

    def after_prompt(self, run) -> tuple[object, object]:
        """The method's hook once its prompt is cached, before any question or decoding: `(plan, cache)` decoding
        goes on with. `run` (a `kvjax.after_prompt.PromptPass`) holds the model, the plan, the cache, the prompts
        and the forwards a method may run over the cached context (KVzip replays it). Default: `shrink` (the
        Attention-Gate's cut to what it kept), the plan sized again when the policy changed."""
        policy, cache = self.shrink(run.cache, run.max_len - run.prompt_len)
        return (run.plan if policy == self else run.resized(policy)), cache

    @property
    def has_own_hook(self) -> bool:
        """Whether the method overrides `after_prompt` (KVzip's replay): a hook that a combinator or a quantized
        cache would not run, so they refuse such a member (`refuse_hooked`) rather than drop it silently."""
        return type(self).after_prompt is not Policy.after_prompt

    def describe(self) -> str:
        """`Name(own fields..., positions=..., prefill_mode=...)`: the method's parameters first."""
        fields = sorted(dataclasses.fields(self), key=lambda f: f.name in ("positions", "prefill_mode", "chunk"))
        # `chunk` exists only in chunked mode: other runs keep the descriptions their records are keyed by.
        fields = [f for f in fields if not (f.name == "chunk" and getattr(self, f.name) is None)]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"


# Every numeric option's valid values, by name: an option means the same in every policy that takes it. A range
# states what is valid, as NaN fails every comparison; any other numeric option must be finite (NaN, inf: refused).
OPTION_RANGES = {
    "ratio": (lambda x: 0 <= x < 1, "in [0, 1) (the fraction of each prompt removed)"),
    "alpha": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "epsilon": (lambda x: 0 <= x < math.inf, "a finite number >= 0"),
    "compression": (lambda x: x >= 1, ">= 1 (inf: the buffer alone)"),  # RazorAttention's Table 1: C = inf
}
OPTION_SYMBOLS = {"compression": "compression (C)"}  # the paper's symbol, said with the option


def check_numbers(policy) -> None:
    """The one check of every numeric option of every policy (a dataclass field holding a number, bools aside): in
    its `OPTION_RANGES` range, or finite, or `InvalidInput` naming the policy, the option and its value. Each
    policy's `__post_init__` calls it first, so a NaN never reaches a comparison that it would pass
    (`beta < 1` is False for NaN) or a score that it would turn to NaN."""
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        ok, what = OPTION_RANGES.get(field.name, (math.isfinite, "a finite number"))
        if not ok(value):
            raise InvalidInput(f"{type(policy).__name__}: {OPTION_SYMBOLS.get(field.name, field.name)}={value} must be "
                               f"{what}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerPolicy(Policy, Rule):
    """A policy applying one rule to every layer, with its position and prefill modes."""

    positions: PositionMode = option("absolute", choices=POSITION_MODES,
                                     help="keys cached at their absolute positions, or unrotated and rotated by "
                                          "their rank in the cache (rolling, StreamingLLM's protocol past the window)")
    prefill_mode: PrefillMode = option("full", choices=PREFILL_MODES,
                                       help="attend the prompt whole then compress, token by token, or --chunk "
                                            "tokens at a time in memory bounded by the budget")
    chunk: int | None = option(None, type=values.positive_int, help="prompt tokens per chunk with --prefill-mode "
                                                                    "chunked")
    # Why prefill_mode="chunked" is refused: a rule that is no `ChunkRule`, or one that is but refuses it.
    chunk_refusal: ClassVar[str] = "it has no rule to fold a chunk of the prompt into its cache"

    def __post_init__(self):
        check_numbers(self)
        name = type(self).__name__
        if self.positions not in POSITION_MODES:
            raise InvalidInput(f"positions={self.positions!r}; expected one of {POSITION_MODES}")
        if self.prefill_mode not in PREFILL_MODES:
            raise InvalidInput(f"prefill_mode={self.prefill_mode!r}; expected one of {PREFILL_MODES}")
        if (self.prefill_mode == "chunked") != (self.chunk is not None):
            raise InvalidInput(f"{name}: chunk={self.chunk} with prefill_mode={self.prefill_mode!r}: a chunk size is "
                               "given exactly when prefill_mode='chunked' (--prefill-mode chunked --chunk N)")
        if self.chunk is not None and self.chunk < 1:
            raise InvalidInput(f"{name}: chunk={self.chunk} must be >= 1")
        if self.prefill_mode == "chunked" and not isinstance(self, ChunkRule):
            raise InvalidInput(f"{name} cannot run prefill_mode='chunked': {self.chunk_refusal}")
        if self.prefill_mode == "chunked" and self.positions == "rolling" and type(self).rolling_sinks is \
                ChunkRule.rolling_sinks:
            raise InvalidInput(f"{name}: rolling positions cannot be computed for a chunk of the prompt (they are "
                               "ranks in a cache with gaps); use positions='absolute' or prefill_mode='stream'")

    def position_mode(self, layer: int) -> PositionMode:
        return self.positions


def warn_chunked_method(policy: Policy, how: str) -> None:
    """Says, where a user chooses a chunked prefill, that it changes `policy`'s method: a UserWarning,
    shown once per place in the user's code by Python's default filter."""
    warnings.warn(f"{type(policy).__name__} with prefill_mode='chunked', chunk={policy.chunk}: {how} This is a different "
                  "method from the paper's; prefill_mode='full' (or 'stream') runs the paper's.", UserWarning,
                  stacklevel=4)


# -- the options several methods share, declared once (`kvjax.policies.options`) ---------------------------------


def ratio_option(default=None) -> float | None:
    """The `ratio` field of a policy with a ratio budget: `--ratio` (`dataclasses.MISSING`: a required ratio)."""
    return option(default, type=values.fraction_removed,
                  help="fraction of each prompt removed, instead of --budget (kvpress's compression_ratio: each row "
                       "keeps floor(n (1 - ratio)) of its n tokens); RazorAttention: the share its local heads drop")


def sinks_option(default: int) -> int:
    """The `sinks` field: `--sinks`, the first tokens always kept."""
    return option(default, type=values.nonnegative_int, help="attention sinks: the first tokens, always kept")


def recent_option(default: int | None) -> int | None:
    """The `recent` field: `--recent`, the most recent tokens, never evicted."""
    return option(default, type=values.nonnegative_int,
                  help="the most recent tokens, never evicted (H2O: half the budget unless given; DuoAttention: its "
                       "streaming heads' window)")


def observation_window_option(default: int) -> int:
    """The `observation_window` field of a prompt compressor: `--observation-window`."""
    return option(default, type=values.nonnegative_int,
                  help="the last prompt tokens, always kept and (SnapKV & co) the queries that score the others")


def group_agg_option(default: str = "mean") -> str:
    """The `group_agg` field: `--group-agg`, how a KV head's score combines its query heads."""
    return option(default, choices=("mean", "max", "sum"),
                  help="how a KV head's score combines its query heads (MAT: mean / max; SnapKV-style: mean / max / "
                       "sum)")


# -- ratio budgets (kvpress's compression ratio), shared by the policies that evict per row ------------
def check_ratio(policy: LayerPolicy, budget: int | None, name: str = "budget") -> None:
    """A policy sized by exactly one of a token `budget` (called `name`) or `ratio`, the fraction of each
    row's prompt removed. A ratio needs the prompt's length before the prompt is read: a whole prompt
    (prefill_mode 'full') or one read token by token ('stream'), not a chunked stream of any length."""
    cls, ratio = type(policy).__name__, policy.ratio
    if (budget is None) == (ratio is None):
        raise InvalidInput(f"{cls}: give exactly one of {name} (tokens) or ratio (fraction removed); "
                           f"got {name}={budget}, ratio={ratio}")
    if ratio is not None and not 0 <= ratio < 1:
        raise InvalidInput(f"{cls}: ratio={ratio} must be in [0, 1)")
    if ratio is not None and policy.prefill_mode == "chunked":
        raise InvalidInput(f"{cls}: a ratio budget is a share of each row's prompt, known before the prompt is "
                           "read: prefill_mode must be 'full' or 'stream' (a chunked prefill bounds memory for a "
                           "prompt of any length; give a token budget)")


def ratio_slots(length, ratio: float, least: int, bound: int | None = None):
    """Slots a row keeps for a `length`-token prompt: `max(least, floor(length (1 - ratio)))` (numpy or
    jnp lengths); `least` is what the rule cannot do without (sinks + the current token, the recent window).

    Computed in float64 as kvpress computes `int(n * (1 - ratio))`: in float32, 100 * (1 - 0.8) rounds up to
    20 where float64 gives 19.999..., one slot more than kvpress. A jnp `length` (traced) reads a table of
    every length up to `bound`, made on the host in float64."""
    if isinstance(length, jax.Array):
        if bound is None:
            raise ValueError("ratio_slots of traced lengths needs their bound (the prompt's padded length)")
        table = np.maximum(least, np.floor(np.arange(bound + 1) * (1 - ratio))).astype(np.int32)
        return jnp.asarray(table)[jnp.clip(length, 0, bound)]
    return np.maximum(least, np.floor(np.asarray(length, np.float64) * (1 - ratio))).astype(np.int32)


class RatioBudget:
    """Sizing by a token budget or by `ratio`, the fraction of each row's prompt removed (kvpress's
    `compression_ratio`, the papers' "x % KV" read as a share of the prompt).

    A row of `n` prompt tokens keeps `max(least_slots(), floor(n (1 - ratio)))` slots, decoding
    included. The cache array is as large as its bucket's longest prompt needs; a row's slots past its
    own count are DISABLED (`kvjax.cache.limit_rows`), which attention never sees and `step` never
    fills, so rows of different lengths in one batch each keep their own budget."""

    ratio: float | None = None

    def least_slots(self) -> int:
        """The fewest slots the rule works with (sinks + the current token, the recent window, ...)."""
        raise NotImplementedError

    def row_slots(self, length, bound: int | None = None):
        """Slots a row keeps for a `length`-token prompt under `ratio` (`bound`: the padded length of traced ones)."""
        return ratio_slots(length, self.ratio, self.least_slots(), bound)

    def ratio_capacity(self, max_len: int, prompt_len: int) -> int:
        """The array's slot count under `ratio`: what the bucket's longest prompt (`prompt_len`) keeps."""
        return int(min(self.row_slots(np.int64(max(prompt_len, 1))), max_len))

    def prompt_rows(self, cache: LayerCache, pos: Int[Array, "b t"]) -> Int[Array, "b"]:
        """Each row's slot count for its prompt at positions `pos` (left or right padded with -1)."""
        return jnp.minimum(self.row_slots(jnp.max(pos, axis=1) + 1, pos.shape[1]), cache.capacity)

    def size_rows(self, layer, cache: LayerCache, ctx: Context) -> LayerCache:
        return cache if self.ratio is None else kvcache.limit_rows(cache, self.prompt_rows(cache, ctx.pos))

    def describe(self) -> str:
        # A token budget's description stays what it was before ratios existed (records are keyed by it).
        return super().describe().replace(", ratio=None", "").replace("(ratio=None, ", "(")


def refuse_hooked(owner: str, members) -> None:
    """A member with its own `after_prompt` (`Policy.has_own_hook`) inside `owner` (a combinator, a quantized cache),
    which runs only its own policy's hook, is refused by name."""
    hooked = [m for m in members if m.has_own_hook]
    if hooked:
        name = type(hooked[0]).__name__
        raise InvalidInput(f"{owner}: {name} runs a hook after its prompt (after_prompt: it needs the model, as "
                           f"KVzip's replay does), which {owner} does not run for a member; run {name} as a policy of "
                           "its own")
