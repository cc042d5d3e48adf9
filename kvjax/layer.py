"""What a model's attention layer calls to run kvjax's cache policies, and the only code that calls policy rules.

A model's attention calls one function, with its `Geometry` (scale, sliding window, soft-cap, ALiBi, and a RoPE
function of positions), the step its forward was given (`kvjax.step`), its entry of the forward's carry and its
*unrotated* q / k / v:

    o, entry = layer.attend(geom, step, entry, q, k, v, positions, tokens)

`attend` does what the step says with the layer's sized `LayerPlan` (the step's plan at `geom.layer`): a whole
prompt (`prefill`, or `prefill_shared` for several plans), one chunk (`chunk`), one token per row (`decode`), a
read-only extension (`extend`, `replay`), the plain forward. Those functions are public for tests and custom
drivers; empty caches come from `init_cache` (the plan's sizes).

Shapes: q `[b, h, t, d]`, k / v `[b, kvh, t, d]` (`decode`: `[b, h, d]`, `[b, kvh, d]`), positions `[b, t]`
(`[b]`), -1 on padding. Head-group dispatch (a plan that splits the KV heads: RazorAttention, DuoAttention),
rolling positions (keys cached unrotated and rotated by their rank), the eq. 4 mask and cache construction live
here, so a model of any structure (Flax, pure pytrees, ...) only projects, calls `attend`, and projects back
(`kvjax/models/llama.py` and the pure-pytree decoder of `tests/test_own_model.py` do exactly that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import attention, quant
from kvjax import step as steps
from kvjax import cache as kvcache
from kvjax.cache import AnyLayerCache, HeadwiseCache, LayerCache, PooledLayerCache
from kvjax.errors import InvalidInput
from kvjax.masks import Mask
from kvjax.policies import base as rule_kinds
from kvjax.policies.base import Context
from kvjax.policies.plan import LayerPlan
from kvjax.quant import QuantizedLayerCache
from kvjax.stats import NO_STATS, AttentionStats, StatsRequest

Rope = Callable[[Array, Array], Array]  # (x [..., t, d], positions broadcastable to x[..., 0]) -> rotated x


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What one layer's attention computes with, besides its inputs.

    `rope(x, positions)` rotates `x` at `positions` (None: the model has no rotary positions, e.g. ALiBi);
    `alibi`: the ALiBi slopes of its query heads (None: no ALiBi); `window`: how far back a query sees
    (None: the whole context); `softcap`: Gemma 2's logit cap; `impl`: "xla" (the jnp reference) or "pallas".
    `out_proj`: the layer's output projection split by query head, `[num_heads, head_dim, hidden]`: query head i's
    output `o_i` adds `o_i @ out_proj[i]` to the residual stream (a Llama's o_proj weight `[h * d, hidden]` reshaped;
    query head i reads KV head `i // (num_heads // num_kv_heads)`, as transformers' `repeat_kv`). None: the model
    gives none, and the rules that weigh a token by what it writes (CriticalKV, KVzip+) refuse it."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rope: Rope | None = None
    alibi: np.ndarray | None = None
    window: int | None = None
    softcap: float | None = None
    impl: str = "xla"
    out_proj: Array | None = None

    def rotate(self, x, positions):
        return x if self.rope is None else self.rope(x, positions)

    def mask(self, anchors=None, key_keep=None) -> Mask:
        """The layer's `kvjax.masks.Mask` (its window, soft-cap and ALiBi), with a call's eq. 4 `anchors` and
        gate `key_keep` flags."""
        return Mask(window=self.window, softcap=self.softcap, alibi=self.alibi, anchors=anchors, key_keep=key_keep)


# ---- caches ----------------------------------------------------------------------------------------


def init_layer_cache(plan: LayerPlan, batch: int, num_kv_heads: int, head_dim: int, dtype) -> AnyLayerCache:
    """Empty arrays of a sized layer plan's slot counts (one array, or one per head group)."""
    if plan.sizes is None:
        raise ValueError("init_layer_cache needs a sized plan (Plan.sized(max_len, prompt_len))")
    def empty(heads, n, rule):
        if plan.quant is None:
            return kvcache.empty(batch, heads, n, head_dim, dtype, rule.cache_state)
        return quant.empty(plan.quant, batch, heads, n, head_dim, dtype, rule.cache_state)

    if plan.pooled:  # (`resolve` refuses to quantize a pool)
        return kvcache.empty_pool(batch, num_kv_heads, num_kv_heads * plan.sizes[0], plan.sizes[1], head_dim, dtype)
    if not plan.split:
        return empty(num_kv_heads, plan.sizes[0], plan.groups[0].rule)
    return HeadwiseCache(tuple(empty(len(g.kv_heads), n, g.rule) for g, n in zip(plan.groups, plan.sizes)),
                         tuple(g.kv_heads for g in plan.groups))


def init_cache(plan, batch: int, num_kv_heads: int, head_dim: int, dtype) -> tuple[AnyLayerCache, ...]:
    """Every layer's empty cache for a sized `Plan`."""
    return tuple(init_layer_cache(lp, batch, num_kv_heads, head_dim, dtype) for lp in plan.layers)


def rule_groups(plan: LayerPlan, cache: AnyLayerCache) -> list[tuple[list[int] | None, rule_kinds.Rule, LayerCache]]:
    """`[(kv_heads, rule, cache)]` of a layer's plan: its one rule over all its KV heads (`kv_heads` None), or
    each head group's heads, rule and cache. Every function below goes through it."""
    if not plan.split:
        return [(None, plan.groups[0].rule, cache)]
    return [(list(g.kv_heads), g.rule, c) for g, c in zip(plan.groups, cache.groups)]


def regroup(cache: AnyLayerCache, caches: list[LayerCache]) -> AnyLayerCache:
    """The layer's cache from what `rule_groups`' rules returned, in its order."""
    return HeadwiseCache(tuple(caches), cache.heads) if isinstance(cache, HeadwiseCache) else caches[0]


def read(cache: LayerCache | QuantizedLayerCache, pos: Int[Array, "b *t"]) -> LayerCache:
    """A group's cache as its rule reads it in a call at positions `pos`: a quantized one dequantized, the
    residual's tokens within R of this call's newest in full precision (`kvjax.quant.view`)."""
    return quant.view(cache, quant.newest(pos)) if isinstance(cache, QuantizedLayerCache) else cache


def stored(plan: LayerPlan, cache: LayerCache, pos: Int[Array, "b *t"]) -> LayerCache | QuantizedLayerCache:
    """What a rule returned, stored as the plan says: quantized, with the tokens up to this call's (`pos`)
    newest in the residual, or as it is."""
    return cache if plan.quant is None else quant.store(plan.quant, cache, quant.newest(pos))


def kv_heads(x: Float[Array, "b kvh ..."], heads: list[int] | None) -> Float[Array, "b kvh2 ..."]:
    return x if heads is None else x[:, heads]


def size_rows(plan: LayerPlan, cache: AnyLayerCache, positions: Int[Array, "b t"]) -> AnyLayerCache:
    """A fresh cache made ready for whole prompts at `positions` to be read token by token or in chunks: each
    rule sets what depends on a row's prompt (a ratio budget, RazorAttention's L = max(S0, N / C))."""
    ctx = Context(positions)
    return regroup(cache, [stored(plan, rule.size_rows(plan.layer, read(g, positions), ctx), positions)
                           for _, rule, g in rule_groups(plan, cache)])


# ---- what a call is given ------------------------------------------------------------------------------


def check_inputs(call: str, geom: Geometry, plan: LayerPlan | None, q, k, v, pos, tokens=None) -> None:
    """Refuses, at trace time, inputs of the wrong shape for `call` ("prefill", "chunk", "decode": the shapes of the
    module docstring), or without the token ids a rule of `plan` reads (AnLLM's anchors), naming the argument and
    the shape expected (an IndexError, or "None is not a valid value" deep in a rule, said neither)."""
    one = call == "decode"
    b, d = (q.shape[0] if jnp.ndim(q) else None), geom.head_dim
    t = None if one or jnp.ndim(q) != 4 else q.shape[2]
    dims = lambda *names: "[" + ", ".join(names) + "]"  # noqa: E731
    per_token = () if one else ("t",)
    want = {"q": ((b, geom.num_heads, d) if one else (b, geom.num_heads, t, d), dims("b", "h", *per_token, "d")),
            "k": ((b, geom.num_kv_heads, d) if one else (b, geom.num_kv_heads, t, d), dims("b", "kvh", *per_token, "d")),
            "pos": ((b,) if one else (b, t), dims("b", *per_token))}
    want["v"], want["tokens"] = want["k"], want["pos"]
    given = {"q": q, "k": k, "v": v, "pos": pos, **({} if tokens is None else {"tokens": tokens})}
    for name, x in given.items():
        shape, spelled = want[name]
        if tuple(jnp.shape(x)) != shape:
            raise InvalidInput(f"layer.{call}: {name} has shape {tuple(jnp.shape(x))}; expected {spelled} = {shape} "
                               f"(h = {geom.num_heads}, kvh = {geom.num_kv_heads}, d = {d}"
                               + ("; positions keep the batch axis, -1 on padding" if name == "pos" else "") + ")")
    readers = [] if plan is None else [g.rule for g in plan.groups if isinstance(g.rule, rule_kinds.ReadsTokens)]
    if readers and tokens is None:
        raise InvalidInput(f"layer.{call}: {readers[0].describe()} reads the token ids: pass tokens "
                           f"({dims('b', *per_token)} = {want['pos'][0]}, the ids at pos)")


# ---- a whole prompt ----------------------------------------------------------------------------------


def prefill(geom: Geometry, plan: LayerPlan | None, cache: AnyLayerCache | None, q, k, v, pos, tokens=None, *,
            anchor_mask=None, key_keep=None, gate_keep=None, hidden=None):
    """A prompt attended whole (causal, the layer's window / ALiBi / soft-cap, an eq. 4 `anchor_mask`, gate
    `key_keep` flags), then cached by each of `plan`'s groups: `(output [b, h, t, d], cache)`. With `plan`
    None, the plain forward (no cache). `gate_keep`: the flags handed to a gate policy (bool `[b, kvh, t]`);
    `hidden`: the layer's attention input `[b, t, D]`, handed to the rules (`Context.hidden`)."""
    check_inputs("prefill", geom, plan, q, k, v, pos, tokens)
    if plan is not None and plan.prefill_stats().gate_keep:
        want = (k.shape[0], geom.num_kv_heads, k.shape[2])
        if gate_keep is None or tuple(jnp.shape(gate_keep)) != want:
            raise InvalidInput(f"layer.prefill: {plan.rule.describe()} keeps what the Attention-Gates keep: pass "
                               f"gate_keep, their flags (bool [b, kvh, t] = {want}; kvjax.gate), got "
                               + ("none" if gate_keep is None else f"shape {tuple(jnp.shape(gate_keep))}"))
    q_rot, k_rot = geom.rotate(q, pos[:, None, :]), geom.rotate(k, pos[:, None, :])
    wanted = NO_STATS if plan is None else plan.prefill_stats()
    o, stats = attention.prefill_attention(
        q_rot, k_rot, v, pos, pos, scale=geom.scale, stats=wanted.attention_part(),
        mask=geom.mask(anchor_mask, key_keep), impl=geom.impl, self_attention=True,
    )
    if plan is None:
        return o, cache
    stats = _layer_stats(geom, wanted, stats, q, v, pos, plan.describe)
    if gate_keep is not None:
        stats = dataclasses.replace(stats, gate_keep=gate_keep)
    return o, cache_prompt(geom, plan, cache, k, k_rot, v, pos, tokens, stats, hidden)


def prefill_shared(geom: Geometry, plans: tuple[LayerPlan, ...], caches, q, k, v, pos, tokens=None, hidden=None):
    """One prompt attended once for several plans (no eq. 4 mask, no gates: the attention is the same for all),
    each caching it under its own rules: `(output, caches)` (`kvjax.generate.generate_many`)."""
    wanted = _shared_stats(geom, plans, q, k, v, pos, tokens)
    q_rot, k_rot = geom.rotate(q, pos[:, None, :]), geom.rotate(k, pos[:, None, :])
    o, stats = attention.prefill_attention(
        q_rot, k_rot, v, pos, pos, scale=geom.scale, stats=wanted.attention_part(), mask=geom.mask(),
        impl=geom.impl, self_attention=True,
    )
    return o, _cache_shared(geom, plans, caches, wanted, stats, q, k, k_rot, v, pos, tokens, hidden)


def capture(geom: Geometry, q, k, v, pos, hidden=None, colsum: bool = False):
    """The plain prompt pass's attention, keeping what `recache_shared` caches the prompt from: `(output, (q, k, v,
    hidden, colsum))`, the column sums (H2O's, the one statistic that needs the whole attention) only with `colsum`."""
    check_inputs("prefill", geom, None, q, k, v, pos)
    q_rot, k_rot = geom.rotate(q, pos[:, None, :]), geom.rotate(k, pos[:, None, :])
    o, stats = attention.prefill_attention(q_rot, k_rot, v, pos, pos, scale=geom.scale,
                                           stats=StatsRequest(colsum=colsum), mask=geom.mask(), impl=geom.impl,
                                           self_attention=True)
    return o, (q, k, v, hidden, stats.colsum)


def recache_shared(geom: Geometry, plans: tuple[LayerPlan, ...], caches, captured, pos, tokens=None):
    """`prefill_shared`'s caches from a `capture`d pass of the prompt, attending nothing again: the last queries'
    statistics come from the captured queries and keys (O(W x s)), the column sums from the capture."""
    q, k, v, hidden, colsum = captured
    wanted = _shared_stats(geom, plans, q, k, v, pos, tokens)
    if wanted.colsum and colsum is None:
        raise InvalidInput(" / ".join(lp.describe() for lp in plans) + " needs the prompt's column sums: capture "
                           "the pass with colsum=True")
    q_rot, k_rot = geom.rotate(q, pos[:, None, :]), geom.rotate(k, pos[:, None, :])
    first_logit, last_probs = attention.prompt_statistics(q_rot, k_rot, pos, pos, wanted, scale=geom.scale,
                                                          mask=geom.mask())
    stats = AttentionStats(first_logit=first_logit, colsum=colsum if wanted.colsum else None, last_probs=last_probs)
    return _cache_shared(geom, plans, caches, wanted, stats, q, k, k_rot, v, pos, tokens, hidden)


def _shared_stats(geom: Geometry, plans: tuple[LayerPlan, ...], q, k, v, pos, tokens) -> StatsRequest:
    """What the plans sharing a prompt ask of it, their inputs checked."""
    wanted = NO_STATS
    for lp in plans:
        check_inputs("prefill", geom, lp, q, k, v, pos, tokens)
        wanted = wanted | lp.prefill_stats()
    return wanted


def _cache_shared(geom, plans, caches, wanted, stats, q, k, k_rot, v, pos, tokens, hidden):
    stats = _layer_stats(geom, wanted, stats, q, v, pos, lambda: " / ".join(lp.describe() for lp in plans))
    return tuple(cache_prompt(geom, lp, c, k, k_rot, v, pos, tokens, stats, hidden) for lp, c in zip(plans, caches))


def cache_prompt(geom: Geometry, plan: LayerPlan, cache, k, k_rot, v, pos, tokens, stats, hidden=None):
    """Each head group of `plan` builds its cache from the attended prompt (`stats` hold at least what its rule
    asked for; `hidden`: the attention input, `Context.hidden`); rolling positions cache the keys unrotated."""
    check_prompt_fits(plan, cache, k.shape[2])
    k_store = k if plan.position_mode == "rolling" else k_rot
    ctx = Context(pos, tokens, hidden)
    return regroup(cache, [
        stored(plan, rule.prefill(geom.layer, read(c, pos), kv_heads(k_store, heads), kv_heads(v, heads), ctx,
                                  stats if heads is None else stats.map(lambda a: a[:, heads])), pos)
        for heads, rule, c in rule_groups(plan, cache)])


def query_moments(geom: Geometry, q, pos, requests):
    """ExpectedAttention's statistics of future queries, for each `(sinks, future)`: the mean and covariance of the
    prompt's unrotated queries `q` `[b, h, t, d]` at positions >= sinks, both rotated by the layer's RoPE
    averaged over the `future` positions after each row's prompt (R = the mean rotation matrix: R mu,
    R S R^T); grouped by KV head, `[b, kvh, g, d]` and `[b, kvh, g, d, d]`."""
    if geom.rope is None:
        raise InvalidInput("ExpectedAttention's future queries need a RoPE model")
    b, h, t, d = q.shape
    q32 = q.astype(jnp.float32)
    length = jnp.max(pos, axis=1) + 1  # [b]
    eye = jnp.eye(d, dtype=jnp.float32)
    out = {}
    for sinks, future in sorted(requests):
        valid = (pos >= sinks)[:, None, :, None]  # [b, 1, t, 1]
        n = jnp.maximum(jnp.sum(valid, axis=2, keepdims=True), 1)
        mu = jnp.sum(jnp.where(valid, q32, 0.0), axis=2, keepdims=True) / n  # [b, h, 1, d]
        centred = jnp.where(valid, q32 - mu, 0.0)
        cov = jnp.einsum("bhsi,bhsj->bhij", centred, centred) / n
        # the rotation at position p maps the basis vector e_i to column i of R_p: rotate the identity
        future_pos = (length[:, None] + jnp.arange(future))[:, :, None]  # [b, future, 1]
        rotated = geom.rope(jnp.broadcast_to(eye, (b, future, d, d)), jnp.broadcast_to(future_pos, (b, future, d)))
        rot = jnp.swapaxes(rotated.astype(jnp.float32).mean(axis=1), -1, -2)  # [b, d, d]: R[i, k]
        mean = jnp.einsum("bik,bhk->bhi", rot, mu[:, :, 0])
        cov = jnp.einsum("bik,bhkl,bjl->bhij", rot, cov, rot)
        out[(sinks, future)] = (mean.reshape(b, geom.num_kv_heads, h // geom.num_kv_heads, d),
                                cov.reshape(b, geom.num_kv_heads, h // geom.num_kv_heads, d, d))
    return out


def output_norms(geom: Geometry, v: Float[Array, "b kvh t d"], orders, who: str) -> dict:
    """For each p of `orders`, ‖v W_o^i‖_p: each value `v` through each query head i's block of the output projection
    (`geom.out_proj`), `[b, kvh, g, t]` (query head i = KV head * g + its rank in the group), computed one query head
    at a time so that the `[b, t, hidden]` products of only one head are ever held. `who` is named when the model
    gives no output projection."""
    h, d, kvh = geom.num_heads, geom.head_dim, geom.num_kv_heads
    if geom.out_proj is None:
        raise InvalidInput(f"{who} weighs each token by its output projection, and this model gives none: "
                           f"kvjax.layer.Geometry.out_proj is None (the o_proj weight as [num_heads, head_dim, hidden])")
    w = jnp.asarray(geom.out_proj)
    if w.ndim != 3 or w.shape[:2] != (h, d):
        raise InvalidInput(f"kvjax.layer.Geometry.out_proj has shape {w.shape}; expected [num_heads, head_dim, hidden] "
                           f"= ({h}, {d}, hidden)")
    g = h // kvh
    v32 = v.astype(jnp.float32)

    def head(args):
        i, wi = args
        y = jnp.einsum("btd,dD->btD", jnp.take(v32, i // g, axis=1), wi.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
        return jnp.stack([jnp.linalg.norm(y, ord=p, axis=-1) for p in sorted(orders)])  # [P, b, t]

    out = jax.lax.map(head, (jnp.arange(h), w))  # [h, P, b, t]
    b, t = v.shape[0], v.shape[2]
    out = jnp.moveaxis(out, 1, 0).transpose(0, 2, 1, 3).reshape(len(orders), b, kvh, g, t)
    return {p: out[i] for i, p in enumerate(sorted(orders))}


def _layer_stats(geom: Geometry, wanted, stats, q, v, pos, who):
    """The prompt's statistics the layer computes itself, not attention: the query moments and the output norms."""
    if wanted.query_moments:
        stats = dataclasses.replace(stats, query_moments=query_moments(geom, q, pos, wanted.query_moments))
    if wanted.out_norms:
        stats = dataclasses.replace(stats, out_norms=output_norms(geom, v, wanted.out_norms, who()))
    return stats


def _extension(geom: Geometry, plan: LayerPlan, cache: LayerCache, q, k, pos):
    """What a chunk extending the read-only `cache` attends with (`extend`, `replay`): the cache as read at `pos`,
    and the chunk's queries and keys rotated at their positions. A pooled cache has no per-head slots to extend."""
    if isinstance(cache, PooledLayerCache):
        raise InvalidInput(f"{plan.rule.describe()}: a pooled per-head cache cannot be extended by a chunk")
    return read(cache, pos), geom.rotate(q, pos[:, None, :]), geom.rotate(k, pos[:, None, :])


def extend(geom: Geometry, plan: LayerPlan, cache: LayerCache, q, k, v, pos, anchor_mask=None):
    """A chunk attending the read-only `cache` (absolute positions) and itself (prefix caching)."""
    cache, q_rot, k_rot = _extension(geom, plan, cache, q, k, pos)
    o, _ = attention.prefix_attention(
        q_rot, k_rot, v, pos, cache.k, cache.v, cache.pos, cache.log_w, scale=geom.scale,
        mask=geom.mask(anchor_mask), slot_visible=plan.prefix_visible(cache, anchor_mask),
        impl=geom.impl,
    )
    return o


def replay(geom: Geometry, plan: LayerPlan, cache: LayerCache, q, k, v, pos, span, *, plus: bool = False,
           hidden=None):
    """`extend` for KVzip's replay (`kvjax.kvzip`): the output, and each cached slot's reconstruction score
    `[b, kvh, c]` from the chunk's queries (`span` `[b, 3]`: sinks, chunk start, chunk end), both from one set of
    logits (`attention.replay_attention`). `plus` (KVzip+): each
    probability divided by its query's attention input norm ‖h‖ (`hidden` `[b, t, D]`, the replay's input to the
    layer's projections) and multiplied by ‖v W_o^i‖_2, its slot's value through its query head's output projection,
    before the maximum (kvpress's `kvzip_plus_normalization`)."""
    if not geom.mask().plain:
        raise InvalidInput("KVzip's replay scores plain softmax attention: no soft-cap, ALiBi or sliding window")
    cache, q_rot, k_rot = _extension(geom, plan, cache, q, k, pos)
    weights = None
    if plus:
        who = f"{plan.describe()} with KVzip+'s normalisation"
        if hidden is None:
            raise InvalidInput(f"{who} divides each replay query's scores by its input's norm, and this model gives "
                               "none: pass hidden (the attention's input, [b, t, D]) to kvjax.layer.attend")
        h_norm = jnp.linalg.norm(hidden.astype(jnp.float32), axis=-1)  # [b, t]
        per_query = jnp.where(pos >= 0, 1.0 / jnp.where(pos >= 0, h_norm, 1.0), 0.0)
        weights = (per_query, output_norms(geom, cache.v, {2}, who)[2])
    return attention.replay_attention(q_rot, k_rot, v, pos, cache.k, cache.v, cache.pos, cache.log_w, span,
                                      geom.scale, slot_visible=plan.prefix_visible(cache, None), weights=weights)


@jax.custom_vjp
def _gradient_tap(o, tap, out_proj):
    return o


def _gradient_tap_fwd(o, tap, out_proj):
    return o, out_proj


def _gradient_tap_bwd(out_proj, g):
    """`g` = ∂Φ/∂o `[b, h, t, d]` passes on; `tap`'s cotangent is ‖∂Φ/∂a‖ `[b, t]`, a = o W_o the attention's output
    after the projection: ∂Φ/∂o = ∂Φ/∂a W_oᵀ, solved for ∂Φ/∂a (W_o `[h d, D]` of rank D)."""
    b, h, t, d = g.shape
    w = out_proj.reshape(h * d, -1).astype(jnp.float32)
    rhs = g.transpose(0, 2, 1, 3).reshape(b * t, h * d).astype(jnp.float32).T  # [h d, b t] = W (∂Φ/∂a)ᵀ
    with jax.default_matmul_precision("float32"):
        if w.shape[0] != w.shape[1]:  # more rows than columns: the normal equations
            rhs, w = w.T @ rhs, w.T @ w
        grad_a = jnp.linalg.solve(w, rhs)  # [D, b t]
    return g, jnp.linalg.norm(grad_a, axis=0).reshape(b, t), None


_gradient_tap.defvjp(_gradient_tap_fwd, _gradient_tap_bwd)


def grad_replay(geom: Geometry, plan: LayerPlan, cache: LayerCache, q, k, v, pos, tap):
    """`extend` for KVgrad's replay (`kvjax.drive.grad_replay`): the output, through which the backward pass writes
    each replay query's ‖∂Φ/∂a‖ into `tap`'s cotangent (a: the layer's attention output after W_o), and what the
    scores are made of once it has: the replay's rotated queries and keys, each cached slot's ‖v W_o^i‖_2 per query
    head, the softmax scale. A padding query's output is zero, so nothing it computes reaches a real one's gradient."""
    if not geom.mask().plain:
        raise InvalidInput("KVgrad's replay scores plain softmax attention: no soft-cap, ALiBi or sliding window")
    who = plan.describe()
    norms = output_norms(geom, read(cache, pos).v, {2}, who)[2]  # refuses a model without out_proj
    w = jnp.asarray(geom.out_proj)
    if geom.num_heads * geom.head_dim < w.shape[-1]:
        raise InvalidInput(f"{who}: the gradient of the attention's output after W_o ({w.shape[-1]} wide) cannot be "
                           f"recovered through W_o from its {geom.num_heads * geom.head_dim}-wide input's")
    o = extend(geom, plan, cache, q, k, v, pos)
    o = _gradient_tap(jnp.where((pos >= 0)[:, None, :, None], o, 0), tap, jax.lax.stop_gradient(w))
    q_rot, k_rot = geom.rotate(q, pos[:, None, :]), geom.rotate(k, pos[:, None, :])
    return o, (q_rot, k_rot, norms, jnp.asarray(geom.scale, jnp.float32))


# ---- a plan's sizes: a rule that keeps every token never evicts one ------------------------------------


def check_prompt_fits(plan: LayerPlan, cache: AnyLayerCache, length: int) -> None:
    """Refuses, at trace time (shapes are static), a prompt of `length` tokens (padding included) longer than the
    cache of a rule that keeps every token (FullCache): it would keep only the prompt's last slots, a window."""
    for _, rule, c in rule_groups(plan, cache):
        if isinstance(rule, rule_kinds.KeepsEveryToken) and length > c.capacity:
            raise InvalidInput(f"layer {plan.layer}: {rule.describe()} keeps every token, and its cache was sized for "
                               f"{c.capacity}; a prompt of {length} tokens does not fit: size the plan for the whole "
                               f"sequence (plan.sized(max_len >= {length} + the tokens to decode, prompt_len))")


def past_the_plan(plan: LayerPlan, cache: AnyLayerCache, newest: Int[Array, "b"]):
    """Rows whose token at position `newest` falls past the cache of a rule that keeps every token (which would
    overwrite its oldest slots): a `[b]` bool array, or None when no rule of the plan keeps every token. With
    concrete positions (a step called eagerly) such a step is refused here; under `jit` the positions are
    traced, and the callers return NaN for those rows (a compiled step cannot raise), never another window's
    attention."""
    caps = [c.capacity for _, rule, c in rule_groups(plan, cache) if isinstance(rule, rule_kinds.KeepsEveryToken)]
    if not caps:
        return None
    if not isinstance(newest, jax.core.Tracer):
        last = int(np.max(np.asarray(newest)))
        if last >= min(caps):
            raise InvalidInput(f"layer {plan.layer}: {plan.describe()} keeps every token, and its cache was "
                               f"sized for {min(caps)}; a token at position {last} is past it: size the plan for the "
                               f"whole sequence (plan.sized(max_len >= {last + 1}, prompt_len))")
    return newest >= min(caps)


def _poisoned(o, past):
    """`o` `[b, h, ...]` with NaN in the rows `past` says overran the plan (`past_the_plan`)."""
    if past is None:
        return o
    return jnp.where(past.reshape(-1, *([1] * (o.ndim - 1))), jnp.nan, o).astype(o.dtype)


# ---- one chunk of a prompt, one token ------------------------------------------------------------------


def _per_group(geom: Geometry, plan: LayerPlan, cache, q, k, v, pos, run_rule):
    """`run_rule(q, k, v, rule, cache, mask)` once for the layer, or once per head group when the plan splits the
    KV heads, each with its query heads, KV heads, own rule, cache (read, and stored back, as the plan stores it)
    and mask (its heads' ALiBi slopes); the outputs (query heads on axis 1) return to head order."""
    def run(q, k, v, rule, c, mask):
        o, c = run_rule(q, k, v, rule, read(c, pos), mask)
        return o, stored(plan, c, pos)

    mask = geom.mask()
    g = geom.num_heads // geom.num_kv_heads
    outs, caches, order = [], [], []
    for heads, sub, c in rule_groups(plan, cache):
        if heads is None:
            return run(q, k, v, sub, c, mask)
        qh = [h * g + j for h in heads for j in range(g)]
        o, c = run(q[:, qh], k[:, heads], v[:, heads], sub, c, mask.heads(qh))
        outs.append(o)
        caches.append(c)
        order += qh
    return jnp.concatenate(outs, axis=1)[:, np.argsort(order)], regroup(cache, caches)


def chunk(geom: Geometry, plan: LayerPlan, cache: AnyLayerCache, q, k, v, pos, tokens):
    """A chunk of the prompt (`prefill_mode="chunked"`): it attends the compressed cache and itself, then each
    rule folds it into its cache (see `kvjax.policies.base`): `(output [b, h, n, d], cache)`."""
    return _over_chunk("chunk", _chunk_heads, geom, plan, cache, q, k, v, pos, tokens)


def _over_chunk(call: str, heads: Callable, geom: Geometry, plan: LayerPlan, cache: AnyLayerCache, q, k, v, pos,
                tokens):
    """What `chunk` and `append` share: the inputs checked, each head group's rule run by `heads(geom, q, k, v, pos,
    rule, cache, tokens, mask)`, the rows past a rule that keeps every token poisoned (`past_the_plan`)."""
    check_inputs(call, geom, plan, q, k, v, pos, tokens)
    past = past_the_plan(plan, cache, jnp.max(pos, axis=1))
    o, cache = _per_group(geom, plan, cache, q, k, v, pos,
                          lambda q, k, v, rule, c, mask: heads(geom, q, k, v, pos, rule, c, tokens, mask))
    return _poisoned(o, past), cache


def _chunk_heads(geom: Geometry, q, k, v, pos, rule: rule_kinds.Rule, cache: LayerCache, tokens, mask: Mask):
    ctx = Context(pos, tokens)
    cache = rule.make_room(geom.layer, cache, ctx)
    slot_visible, chunk_visible = rule.chunk_visible(geom.layer, cache, ctx)
    kw = dict(scale=geom.scale, mask=mask, slot_visible=slot_visible, chunk_visible=chunk_visible,
              stats=rule.stats(geom.layer).prefill, impl=geom.impl)
    if rule.position_mode(geom.layer) == "absolute":
        k_rot = geom.rotate(k, pos[:, None, :])
        o, stats = attention.prefix_attention(geom.rotate(q, pos[:, None, :]), k_rot, v, pos, cache.k, cache.v,
                                              cache.pos, cache.log_w, **kw)
        return o, rule.absorb(geom.layer, cache, k_rot, v, ctx, stats)
    # Rolling: keys are cached unrotated. A ring ranks its window contiguously, so a window key is at its true
    # distance (rotated relative to the chunk's last position, keeping angles small); a sink is ranked first,
    # so its distance runs from min(query, C - 1) (`ChunkRule.rolling_sinks`).
    if mask.alibi is not None or geom.rope is None:
        raise InvalidInput("rolling positions in a chunked prefill need RoPE; this model uses ALiBi")
    sinks = rule.rolling_sinks(geom.layer, cache.capacity)
    base = jnp.max(pos, axis=1, keepdims=True)  # [b, 1]
    coord = lambda p: jnp.where(p < sinks, p, p - base[..., None] if p.ndim == 3 else p - base)  # noqa: E731
    o, stats = attention.prefix_attention(
        geom.rotate(q, (pos - base)[:, None, :]), geom.rotate(k, coord(pos)[:, None, :]), v, pos,
        geom.rotate(cache.k, coord(cache.pos)), cache.v, cache.pos, cache.log_w,
        q_sinks=geom.rotate(q, jnp.minimum(pos, cache.capacity - 1)[:, None, :]), sinks=sinks, **kw,
    )
    return o, rule.absorb(geom.layer, cache, k, v, ctx, stats)


def append(geom: Geometry, plan: LayerPlan, cache: AnyLayerCache, q, k, v, pos, tokens=None):
    """Tokens that follow the prompt, as one chunk (`kvjax.step.Append`; the plan's rules only append while decoding):
    the chunk attends the cache and, causally, itself, then each rule writes its tokens in order with `step`, as
    `decode` fed them one at a time would: `(output [b, h, n, d], cache)`."""
    return _over_chunk("append", _append_heads, geom, plan, cache, q, k, v, pos, tokens)


def _append_heads(geom: Geometry, q, k, v, pos, rule: rule_kinds.Rule, cache: LayerCache, tokens, mask: Mask):
    k_rot = geom.rotate(k, pos[:, None, :])
    # Every slot the cache holds is before the chunk, and nothing is evicted while it is read: token i of the chunk
    # sees the cache and tokens 0..i, what it sees when fed alone after them.
    o, _ = attention.prefix_attention(geom.rotate(q, pos[:, None, :]), k_rot, v, pos, cache.k, cache.v, cache.pos,
                                      cache.log_w, scale=geom.scale, mask=mask, impl=geom.impl)

    def write(c, x):
        k_t, v_t, pos_t, tokens_t = x
        return rule.step(geom.layer, c, k_t, v_t, Context(pos_t, tokens_t)), None

    per_token = (jnp.moveaxis(k_rot, 2, 0), jnp.moveaxis(v, 2, 0), pos.T, None if tokens is None else tokens.T)
    return o, jax.lax.scan(write, cache, per_token)[0]


def decode(geom: Geometry, plan: LayerPlan, cache: AnyLayerCache, q, k, v, pos, tokens=None, hidden=None):
    """One token per row (`q` `[b, h, d]`, `k`, `v` `[b, kvh, d]`, `pos` `[b]`, -1: a padding step that changes
    nothing) through the cache: each rule inserts it (evicting if full), attention reads the cache, each rule
    observes what it asked for: `(output [b, h, d], cache)`. A token past the cache of a rule that keeps every
    token is refused (`past_the_plan`). `hidden` `[b, D]`: the token's attention input (`Context.hidden`)."""
    check_inputs("decode", geom, plan, q, k, v, pos, tokens)
    past = past_the_plan(plan, cache, pos)
    if isinstance(cache, QuantizedLayerCache) and _reads_codes(geom, plan):
        o, cache = _decode_codes(geom, plan.rule, cache, q, k, v, pos, tokens, hidden)
    elif isinstance(cache, PooledLayerCache):
        o, cache = _decode_pooled(geom, plan.rule, cache, q, k, v, pos, tokens, hidden)
    else:
        o, cache = _per_group(geom, plan, cache, q, k, v, pos, lambda q, k, v, rule, c, mask: _decode_heads(
            geom, q, k, v, pos, rule, c, mask, tokens, hidden))
    return _poisoned(o, past), cache


def _decode_heads(geom: Geometry, q, k, v, pos, rule: rule_kinds.Rule, cache: LayerCache, mask: Mask, tokens=None,
                  hidden=None):
    b, kvh = k.shape[:2]
    rolling = rule.position_mode(geom.layer) == "rolling"
    k_store = k if rolling else geom.rotate(k[:, :, None], pos[:, None, None])[:, :, 0]
    ctx = Context(pos, tokens, hidden)
    cache = rule.step(geom.layer, cache, k_store, v, ctx)
    if rolling:
        # StreamingLLM: positions are ranks inside the cache, the query being the newest.
        k_coord = kvcache.ranks(cache.pos)
        q_coord = jnp.max(k_coord, axis=-1)  # [b, kvh]
        keys = geom.rotate(cache.k, k_coord)
        qg = q.reshape(b, kvh, -1, geom.head_dim)
        q = geom.rotate(qg, q_coord[:, :, None]).reshape(b, -1, geom.head_dim)
    else:
        k_coord, q_coord = cache.pos, jnp.broadcast_to(pos[:, None], (b, kvh))
        keys = cache.k
        q = geom.rotate(q[:, :, None], pos[:, None, None])[:, :, 0]
    o, stats = attention.decode_attention(
        q, keys, cache.v, cache.pos, cache.log_w, scale=geom.scale, stats=rule.stats(geom.layer).decode,
        q_coord=q_coord, k_coord=k_coord, mask=mask, impl=geom.impl,
    )
    return o, rule.observe(geom.layer, cache, ctx, stats)


def _decode_pooled(geom: Geometry, rule: rule_kinds.PooledRule, cache: PooledLayerCache, q, k, v, pos, tokens=None,
                   hidden=None):
    """A decode step over a pool shared by the KV heads (AdaKV): the rule places each head's token in its decode
    slots, and each KV head's queries attend the slots it owns (`attention.pooled_decode_attention`)."""
    if rule.stats(geom.layer).decode:
        raise InvalidInput(f"{rule.describe()}: a pooled cache's decode computes no statistics")
    cache = rule.step(geom.layer, cache, geom.rotate(k[:, :, None], pos[:, None, None])[:, :, 0], v,
                      Context(pos, tokens, hidden))
    q_rot = geom.rotate(q[:, :, None], pos[:, None, None])[:, :, 0]
    return attention.pooled_decode_attention(q_rot, cache, pos, scale=geom.scale, mask=geom.mask(),
                                             impl=geom.impl), cache


def _reads_codes(geom: Geometry, plan: LayerPlan) -> bool:
    """Whether a decode step over this quantized cache can read the codes directly (`_decode_codes`): one rule
    whose `step` only writes the new token (a `StepOnlyWrites` rule), keys at absolute positions, and no ALiBi,
    window or soft-cap, which the blockwise reader does not apply. Otherwise the cache is read as a view."""
    return (not plan.split and isinstance(plan.rule, rule_kinds.StepOnlyWrites)
            and plan.rule.position_mode(geom.layer) == "absolute" and geom.mask().plain)


def _decode_codes(geom: Geometry, rule: rule_kinds.Rule, qc: QuantizedLayerCache, q, k, v, pos, tokens=None,
                  hidden=None):
    """A decode step that never dequantizes the layer's cache as a whole: the rule places the token from the
    slots' positions and statistics (its keys and values are placeholders it only writes to, which XLA drops),
    `quant.write_token` stores that one token, `quant.attend` reads the codes block by block, and the rule
    observes what it asked for. The same numbers as reading the cache as a view (tests/test_quant.py)."""
    ctx = Context(pos, tokens, hidden)
    k_store = geom.rotate(k[:, :, None], pos[:, None, None])[:, :, 0]
    shape = (*qc.pos.shape, geom.head_dim)
    meta = LayerCache(k=jnp.zeros(shape, k_store.dtype), v=jnp.zeros(shape, v.dtype), pos=qc.pos, log_w=qc.log_w,
                      state=qc.state)
    stepped = rule.step(geom.layer, meta, k_store, v, ctx)
    want = rule.stats(geom.layer).decode
    q_rot = geom.rotate(q[:, :, None], pos[:, None, None])[:, :, 0]
    # attention reads the codes as they were before this token, the token itself in full precision (the
    # view the rule wrote it into); the token's key group is requantized after
    placed = dataclasses.replace(qc, pos=stepped.pos, log_w=stepped.log_w, state=stepped.state)
    o, probs, first = attention.quantized_decode_attention(q_rot, placed, pos, (k_store, v), scale=geom.scale,
                                                           probs=want.probs, first_logit=want.first_logit,
                                                           impl=geom.impl)
    seen = rule.observe(geom.layer, stepped, ctx, AttentionStats(first_logit=first, probs=probs))
    qc = quant.write_token(qc, stepped, k_store, v, pos)
    return o, dataclasses.replace(qc, pos=seen.pos, log_w=seen.log_w, state=seen.state)


# ---- the one function a model's attention calls ----------------------------------------------------------


def attend(geom: Geometry, step: steps.Step, carry, q, k, v, pos, tokens=None, *, gate=None, hidden=None):
    """A layer's attention under `step` (`kvjax.step`), from its unrotated `q` `[b, h, t, d]`, `k`, `v`
    `[b, kvh, t, d]` at `pos` `[b, t]` (-1 on padding): `(output [b, h, t, d], carry)`, `carry` this layer's entry of
    the model's carry, as the step defines it. `tokens` `[b, t]`: the ids (AnLLM's anchors, MAT's rules read them).
    `gate`: the layer's Attention-Gate as a thunk returning its keep flags `[b, kvh, t]` (None: the layer has none);
    kvjax calls it where the step needs it (the plain forward, a prompt under gated rules). `hidden`: the layer's
    input to its q / k / v projections `[b, t, D]` (KVzip+'s replay divides by its norm, KVzap's surrogate reads it,
    a probe gets it; None: the model gives none, and those refuse it)."""
    i = geom.layer
    if isinstance(step, steps.Forward):
        keep = None if gate is None else gate()
        o, _ = prefill(geom, None, None, q, k, v, pos, anchor_mask=step.anchors, key_keep=keep)
        return o, keep
    if isinstance(step, steps.Probe):
        o, _ = prefill(geom, None, None, q, k, v, pos)
        return o, step.read(geom, q, k, pos, hidden)
    if isinstance(step, steps.Prompt):
        lp = step.plan.layers[i]
        keep = None
        if lp.prefill_stats().gate_keep:
            if gate is None:
                raise InvalidInput(f"{lp.rule.describe()} needs Attention-Gates: kvjax.gate.load_gates(model, DIR) "
                                   "(--gate-params DIR)")
            # nothing differentiates a cached prompt: the flags go as a bool mask, which lets attention skip the
            # blocks every head evicted (the plain forward keeps the float flags that carry the gates' gradient)
            keep = gate() > 0
        return prefill(geom, lp, carry, q, k, v, pos, tokens, anchor_mask=lp.prompt_mask(Context(pos, tokens)),
                       key_keep=keep, gate_keep=keep, hidden=hidden)
    if isinstance(step, steps.Shared):
        return prefill_shared(geom, tuple(plan.layers[i] for plan in step.plans), carry, q, k, v, pos, tokens,
                              hidden)
    if isinstance(step, steps.Capture):
        return capture(geom, q, k, v, pos, hidden if step.hidden else None, step.colsum)
    if isinstance(step, steps.Recache):
        captured, caches = carry
        # the model's output goes nowhere (its logits are not returned): zeros of the attention output's shape
        return jnp.zeros_like(q), recache_shared(geom, tuple(plan.layers[i] for plan in step.plans), caches,
                                                 captured, pos, tokens)
    if isinstance(step, steps.Chunk):
        return chunk(geom, step.plan.layers[i], carry, q, k, v, pos, tokens)
    if isinstance(step, steps.Append):
        return append(geom, step.plan.layers[i], carry, q, k, v, pos, tokens)
    if isinstance(step, steps.Token):
        o, carry = decode(geom, step.plan.layers[i], carry, q[:, :, 0], k[:, :, 0], v[:, :, 0], pos[:, 0],
                          None if tokens is None else tokens[:, 0], None if hidden is None else hidden[:, 0])
        return o[:, :, None], carry
    if isinstance(step, steps.Replay):
        cache, span = carry
        return replay(geom, step.plan.layers[i], cache, q, k, v, pos, span, plus=step.plus, hidden=hidden)
    if isinstance(step, steps.GradReplay):
        cache, span, tap = carry
        return grad_replay(geom, step.plan.layers[i], cache, q, k, v, pos, tap)
    if isinstance(step, steps.Extend):
        lp = step.plan.layers[i]
        return extend(geom, lp, carry, q, k, v, pos, lp.prompt_mask(Context(pos, tokens))), carry
    raise InvalidInput(f"kvjax.layer.attend: {step!r} is not a kvjax.step")


__all__ = ["Geometry", "append", "attend", "cache_prompt", "chunk", "decode", "extend", "grad_replay", "init_cache", "init_layer_cache", "prefill",
           "prefill_shared", "recache_shared", "capture", "output_norms", "query_moments", "read", "regroup", "rule_groups", "size_rows", "stored"]
