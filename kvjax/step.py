"""What one forward of a model does to its cache: the `step` a model passes, untouched, to `kvjax.layer.attend`.

A model kvjax drives has one cached forward (`kvjax.model.CachedLM`):

    logits, carry = model(tokens, positions, carry, step)

`carry` is a tuple with one entry per layer, which the model hands to `kvjax.layer.attend` in that layer's
attention and collects back; what an entry holds is the step's business (a layer's cache, the caches of several
plans, a cache and a replay span, a gate's flags), never the model's. The model picks its logits with
`step.select(hidden)` (the last position, or every position) before its final norm and head, and reads nothing
else of the step: rules, plans and masks stay in kvjax.

Every step but `Forward` holds plans (sized where it builds a cache: `kvjax.drive.prompt`; the caches it is given
carry their shapes otherwise); it is static and hashable, the key of a compiled program, so two calls whose plans
are equal share one compilation (`kvjax.engine.compiled`). `Forward` (the plain causal pass
of training and parity tests) is a pytree: its eq. 4 anchor mask is an array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from kvjax import layer_runs
from kvjax.errors import InvalidInput
from kvjax.layer_runs import Runs
from kvjax.masks import AnchorMask
from kvjax.policies.plan import Plan


def _plan(plan: Plan, what: str) -> Plan:
    if not isinstance(plan, Plan):
        raise InvalidInput(f"{what} needs a plan (kvjax.drive.plan(model, policy, max_len, prompt_len)), got {plan!r}")
    return plan


class Step:
    """Base of the steps. `last`: the model's logits are its last position's (`[b, V]`), else every position's."""

    last: bool = True

    def select(self, x: Float[Array, "b t D"]) -> Float[Array, "b D"] | Float[Array, "b t D"]:
        """The hidden states whose logits this step returns: the last position's, or all."""
        return x[:, -1] if self.last else x

    def layer_runs(self, num_layers: int) -> Runs:
        """The runs of neighbouring layers this step treats alike (`kvjax.layer_runs`): a model may run each as one
        compiled body (a scan), whose `kvjax.layer.attend` is given the run's first layer index. The plain forwards:
        every layer alike; a step with plans: the layers their plans treat alike (`Plan.runs`)."""
        plans = self.plans_held()
        return layer_runs.split(*(p.runs() for p in plans)) if plans else ((0, num_layers),)

    def plans_held(self) -> tuple[Plan, ...]:
        """The plans this step runs (none for the plain forwards)."""
        return ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Forward(Step):
    """The plain causal forward, nothing cached: every position's logits; each layer's carry entry in is None and
    out is its Attention-Gate keep flags `[b, kvh, t]` (None without a gate). `anchors`: AnLLM's eq. 4 mask."""

    anchors: AnchorMask | None = None
    last = False


@dataclasses.dataclass(frozen=True)
class Probe(Step):
    """The plain causal forward, nothing cached, that hands each layer's attention to `read(geometry, q, k,
    positions, hidden)` (unrotated `q` `[b, h, t, d]`, `k` `[b, kvh, t, d]`; the `kvjax.layer.Geometry` rotates and
    masks as the layer does; `hidden` `[b, t, D]`, the layer's input to its projections, None where the model gives
    none): each layer's carry entry out is what `read` returns (arrays). How the head probes
    (`kvjax.heads`) ask any model for what they measure. A model scanning its layers traces `read` once per run of
    layers alike, with the run's first index in `geometry.layer`: `read` computes from its arguments, never from
    that index."""

    read: Callable
    last = False


@dataclasses.dataclass(frozen=True)
class Prompt(Step):
    """A whole prompt attended at once (causal, the plan's eq. 4 mask and gates), then cached by each layer's rules:
    carry entries are the layers' empty caches in, their caches out; the last position's logits."""

    plan: Plan

    def plans_held(self):
        return (self.plan,)

    def __post_init__(self):
        _plan(self.plan, "a prompt step")
        if self.plan.policy.prefill_mode != "full":
            raise InvalidInput(f"{self.plan.policy.describe()} reads its prompt {self.plan.policy.prefill_mode}: "
                               "kvjax.drive.prompt reads it so, not one whole-prompt step")


def _plain_passes(plans: tuple[Plan, ...], what: str) -> None:
    for plan in plans:
        if not _plan(plan, what).plain_prompt_pass:
            raise InvalidInput(f"{plan.policy.describe()} does not attend its prompt as a plain causal pass "
                               "(chunked or stream prefill, an eq. 4 mask or gates): prefill it alone")


@dataclasses.dataclass(frozen=True)
class Shared(Step):
    """One plain prompt pass cached under several plans (`Plan.plain_prompt_pass`): each carry entry is the layer's
    tuple of caches, one per plan; the last position's logits, the same for all."""

    plans: tuple[Plan, ...]

    def plans_held(self):
        return self.plans

    def __post_init__(self):
        _plain_passes(self.plans, "a shared prompt step")


@dataclasses.dataclass(frozen=True)
class Capture(Step):
    """The plain causal pass over a prompt, nothing cached: each layer's carry entry out is its attention's inputs and
    what only the whole attention measures, `(q, k, v, hidden, colsum)` (unrotated `q` `[b, h, t, d]`, `k` and `v`
    `[b, kvh, t, d]`; `hidden` `[b, t, D]`, the layer's input to its projections, only with `hidden`; `colsum`, H2O's
    accumulated attention `[b, kvh, g, t]`, only with `colsum`; else None), from which `Recache` caches the prompt
    under further plans without the model's forward or its attention; the last position's logits."""

    hidden: bool = False
    colsum: bool = False


@dataclasses.dataclass(frozen=True)
class Recache(Step):
    """`Shared`'s caching of a prompt from its `Capture`d pass: each carry entry is `(captured, caches)` in (the
    layer's `(q, k, v, hidden, colsum)` and its tuple of empty caches, one per plan) and its caches out. The layer
    reads the captured entry, not what the model computes now, and attends nothing again (its statistics of the last
    queries are O(W x s)), so nothing the model computes reaches the caches and a compiled recache holds only the
    plans' statistics and caching: XLA removes the rest (a program that returns only the caches). The logits are
    not the prompt's: `Capture` gave those."""

    plans: tuple[Plan, ...]

    def plans_held(self):
        return self.plans

    def __post_init__(self):
        _plain_passes(self.plans, "a recache step")


@dataclasses.dataclass(frozen=True)
class Chunk(Step):
    """One chunk of a prompt (`prefill_mode="chunked"`): it attends the cache and itself, then each rule folds it
    in. `last`: only the chunk's last logits (reading a prompt), else all of them (scoring a text)."""

    plan: Plan
    last: bool = True

    def plans_held(self):
        return (self.plan,)

    def __post_init__(self):
        _plan(self.plan, "a chunk step")


@dataclasses.dataclass(frozen=True)
class Token(Step):
    """One token per row (`tokens`, `positions` `[b, 1]`; position -1: a padding step that changes nothing) through
    the cache: each rule inserts it, evicting if full; the logits `[b, V]`."""

    plan: Plan

    def plans_held(self):
        return (self.plan,)

    def layer_runs(self, num_layers):
        """Every layer its own run: a token's step is unrolled. Scanned, each token stacks every layer's cache entry
        (and weights) and splits them again, copies that made SmolLM2's 32-token decode loop at 4K 2.0x slower on
        the CPU (1.27 s against 0.63 s, `benchmarks/results/compile_cpu_smollm2_token-step.md`), while the unrolled
        loop compiles in about 3 s."""
        return layer_runs.every_layer(num_layers)

    def __post_init__(self):
        _plan(self.plan, "a token step")


@dataclasses.dataclass(frozen=True)
class Append(Step):
    """Tokens that follow the prompt (a question; left padded, position -1 on padding) read as one chunk under a plan
    whose decoding only appends (`Plan.decode_appends`): the chunk attends the cache and, causally, itself, then each
    rule writes its tokens in order with its own `step`. The cache and logits of feeding the tokens one at a time
    (`Token`), from one forward; the last position's logits."""

    plan: Plan

    def plans_held(self):
        return (self.plan,)

    def __post_init__(self):
        if not _plan(self.plan, "an append step").decode_appends:
            raise InvalidInput(f"{self.plan.policy.describe()} does more than append while decoding (it evicts, "
                               "observes attention, pools or quantizes its slots, or caches rolling positions): feed "
                               "the tokens one at a time (kvjax.drive.stream)")


@dataclasses.dataclass(frozen=True)
class Extend(Step):
    """A chunk (right padded, positions -1) attending a read-only cache and itself (prefix caching): carry entries
    come back unchanged; every position's logits. Each layer holds one cache array at absolute positions. The plan
    need not be sized: the cache read has its shapes already."""

    plan: Plan
    last = False

    def plans_held(self):
        return (self.plan,)

    def __post_init__(self):
        for lp in _plan(self.plan, "an extension step").layers:
            if lp.split or lp.position_mode != "absolute":
                raise InvalidInput(f"extending a cache needs one cache array per layer in absolute positions; "
                                   f"{self.plan.policy.describe()} has head groups or rolling positions in layer "
                                   f"{lp.layer}")


@dataclasses.dataclass(frozen=True)
class Replay(Extend):
    """KVzip's replay (`kvjax.kvzip`): an `Extend` whose carry entries are `(cache, span)` in (`span` `[b, 3]`: sinks,
    chunk start, chunk end) and each cached slot's reconstruction score `[b, kvh, c]` out; `plus`: KVzip+'s scores
    (`kvjax.layer.replay`)."""

    plus: bool = False
    last = True


@jax.custom_vjp
def _objective(x):
    return x[:, -1]


def _objective_fwd(x):
    return x[:, -1], x


def _objective_bwd(x, _):
    # Φ = Σ_p ‖x_p‖² over every replay position (in float32, as kvpress sums it): its gradient replaces whatever
    # reaches the logits, so the forward's vjp, whatever its cotangent, is Φ's gradient
    return ((2 * x.astype(jnp.float32)).astype(x.dtype),)


_objective.defvjp(_objective_fwd, _objective_bwd)


@dataclasses.dataclass(frozen=True)
class GradReplay(Extend):
    """KVgrad's replay (`kvjax.drive.grad_replay`): an `Extend` whose carry entries are `(cache, span, tap)` in (`tap`
    `[b, t]` float32 zeros, whose cotangent is each replay query's ‖∂Φ/∂(attention output after W_o)‖) and
    `(q, k, out_norms, scale)` out (the replay's rotated queries and keys, each slot's ‖v W_o^i‖_2 `[b, kvh, g, c]`,
    the layer's softmax scale), from which the scores are made once the backward pass has run. `select` gives the
    model the last position's hidden state and, backwards, Φ = Σ_p ‖h_p^L‖²'s gradient 2 h^L at every position."""

    last = True

    def select(self, x: Float[Array, "b t D"]) -> Float[Array, "b D"]:
        """The last position's hidden states; backwards, Φ's gradient 2x at every position (the logits' ignored)."""
        return _objective(x)


__all__ = ["Capture", "Chunk", "Extend", "Forward", "GradReplay", "Probe", "Prompt", "Recache", "Replay", "Shared", "Step",
           "Token"]
