"""kvjax drives the sequence; the model only computes (`kvjax.model.CachedLM`: one cached forward).

Planning, cache construction and reading a prompt live here, in one copy each, for any model that has the forward
`model(tokens, positions, carry, step) -> (logits, carry)`:

    plan = drive.plan(model, policy, max_len, prompt_len)        # the policy fitted to the model, resolved, sized
    logits, cache = drive.prompt(model, tokens, positions, plan)  # whole, token by token or chunk by chunk
    logits, cache = drive.decode(model, token, position, cache, plan)

Every call into the model goes through `kvjax.contract.forward`, which checks what the forward returns against the
contract (shapes only: free at run time), and `plan` checks once per model structure that the forward hands each
layer's carry entry back in its place (`kvjax.contract.check_layer_order`). Every function here traces: called
eagerly it runs op by op, inside `jax.jit` (`kvjax.engine.compiled`) it is
one program keyed by the sized plan. `generate`, `scoring`, `fewshot`, KVzip's replay and the suites call these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax import cache as kvcache
from kvjax import attention, contract, layer
from kvjax import step as steps
from kvjax.cache import Cache
from kvjax.model import CachedLM
from kvjax.policies.base import Policy
from kvjax.policies.compose import on_windows
from kvjax.policies.plan import Plan, resolve


def plan(model: CachedLM, policy: Policy, max_len: int | None = None, prompt_len: int = 0) -> Plan:
    """`policy` as `model` runs it: fitted to its attention windows (`kvjax.policies.on_windows`: with one sliding
    window W, FullCache keeps a W-slot ring; with per-layer windows, the policy compresses the global layers while
    each sliding layer keeps its W-slot ring, as kvpress does on Gemma 3), checked and resolved into each layer's
    rule and head groups. With `max_len`, sized: each group's slot count fixed for sequences of at most `max_len`
    tokens whose (padded) prompt is `prompt_len` long, the key of every compiled step."""
    contract.check_layer_order(model)  # once per model structure: traced, nothing computed
    c = model.cfg
    resolved = resolve(on_windows(policy, c.windows, c.num_layers, c.num_kv_heads), c.num_layers, c.num_kv_heads)
    return resolved if max_len is None else resolved.sized(max_len, prompt_len)


def empty_cache(model: CachedLM, plan: Plan, batch: int) -> Cache:
    """Every layer's empty cache for a sized plan."""
    return layer.init_cache(plan, batch, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype)


def size_rows(plan: Plan, cache: Cache, positions: Int[Array, "b t"]) -> Cache:
    """A fresh `cache` made ready for the whole prompts at `positions` (or each row's last position, `[b, 1]`) to be
    read token by token or in chunks: each rule sets what depends on a row's prompt (a ratio budget,
    RazorAttention's L = max(S0, N / C))."""
    return tuple(layer.size_rows(lp, c, positions) for lp, c in zip(plan.layers, cache))


def forward(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"] | None = None,
            anchors=None) -> tuple[Float[Array, "b t V"], tuple | None]:
    """The plain causal forward (training, parity): every position's logits and each layer's Attention-Gate keep
    flags (None when the model has no gates). `anchors`: AnLLM's eq. 4 mask (`kvjax.anllm_anchors.anchor_mask`)."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    carry = (None,) * model.cfg.num_layers
    logits, flags = contract.forward(model, tokens, positions, carry, steps.Forward(anchors))
    return logits, (None if flags[0] is None else flags)


def probe(model: CachedLM, tokens: Int[Array, "b t"], read) -> tuple:
    """The plain forward over `tokens` (positions 0..t-1), each layer's attention handed to `read(geometry, q, k,
    positions, hidden)` (`kvjax.step.Probe`): what `read` returned, layer by layer."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return contract.forward(model, tokens, positions, (None,) * model.cfg.num_layers, steps.Probe(read))[1]


def logits(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"] | None = None,
           anchors=None) -> Float[Array, "b t V"]:
    """`forward`'s logits."""
    return forward(model, tokens, positions, anchors)[0]


def prompt(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], plan: Plan
           ) -> tuple[Float[Array, "b V"], Cache]:
    """A left-padded prompt (positions -1 on padding) read as `plan`'s policy reads it: whole (`prefill_mode="full"`),
    token by token through the decode path ("stream", a scan) or chunk by chunk ("chunked", a scan over chunks of
    `policy.chunk` tokens); the last position's logits and the cache."""
    cache = empty_cache(model, plan, tokens.shape[0])
    mode = plan.policy.prefill_mode
    if mode == "full":
        return contract.forward(model, tokens, positions, cache, steps.Prompt(plan))
    cache = size_rows(plan, cache, positions)  # what depends on a row's whole prompt, before the first token
    if mode == "stream":
        return stream(model, tokens, positions, cache, plan, all_logits=False)
    b, t = tokens.shape
    # A chunk longer than the prompt reads it whole either way: capped there, an absurd chunk (10**5, 10**9) never
    # pads the prompt to its size. Padding (position -1) goes first and is a no-op.
    n = min(plan.policy.chunk, t)
    pad = -t % n
    tokens = jnp.pad(tokens, ((0, 0), (pad, 0)))
    positions = jnp.pad(positions, ((0, 0), (pad, 0)), constant_values=-1)
    split = lambda x: x.reshape(b, -1, n).transpose(1, 0, 2)  # noqa: E731  [chunks, b, n]

    def body(cache, xs):
        out, cache = chunk(model, xs[0], xs[1], cache, plan)
        return cache, out

    cache, out = jax.lax.scan(body, cache, (split(tokens), split(positions)))
    return out[-1], cache


def shared(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], plans: tuple[Plan, ...]
           ) -> tuple[Float[Array, "b V"], tuple[Cache, ...]]:
    """One plain pass over a prompt for several sized plans (`Plan.plain_prompt_pass`): the last logits, the same for
    all, and each plan's cache. A comparison of prompt compressors pays for one forward instead of one per policy."""
    step = steps.Shared(tuple(plans))
    caches = [empty_cache(model, p, tokens.shape[0]) for p in plans]
    out, per_layer = contract.forward(model, tokens, positions, tuple(zip(*caches)), step)
    return out, tuple(zip(*per_layer))


def capture(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], hidden: bool = False,
            colsum: bool = False) -> tuple[Float[Array, "b V"], tuple]:
    """The plain pass over a prompt (`shared`'s, nothing cached), keeping each layer's attention inputs: the last
    logits and, per layer, `(q, k, v, hidden, colsum)` (`kvjax.step.Capture`: the attention input and H2O's column
    sums only if asked), for `recache`."""
    step = steps.Capture(hidden, colsum)
    return contract.forward(model, tokens, positions, (None,) * model.cfg.num_layers, step)


def recache(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], captured: tuple,
            plans: tuple[Plan, ...]) -> tuple[Cache, ...]:
    """`shared`'s caches of a prompt for several sized plans, from what `capture` kept of the same prompt's pass
    (`kvjax.step.Recache`): each plan's cache. A comparison of more prompt compressors than one program should hold
    runs the model once and recaches the prompt per group of plans."""
    step = steps.Recache(tuple(plans))
    caches = [empty_cache(model, p, tokens.shape[0]) for p in plans]
    carry = tuple(zip(captured, zip(*caches)))
    return tuple(zip(*contract.forward(model, tokens, positions, carry, step)[1]))


def chunk(model: CachedLM, tokens: Int[Array, "b n"], positions: Int[Array, "b n"], cache: Cache, plan: Plan,
          all_logits: bool = False) -> tuple[Array, Cache]:
    """One chunk of a prompt under `prefill_mode="chunked"`: it attends the cache and itself, then each rule folds it
    in; the chunk's logits (the last, or all) and the cache."""
    return contract.forward(model, tokens, positions, cache, steps.Chunk(plan, last=not all_logits))


def decode(model: CachedLM, tokens: Int[Array, "b"], positions: Int[Array, "b"], cache: Cache, plan: Plan
           ) -> tuple[Float[Array, "b V"], Cache]:
    """One token per row at `positions` (-1: a padding step that changes nothing) through the cache."""
    return contract.forward(model, tokens[:, None], positions[:, None], cache, steps.Token(plan))


def stream(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan, *,
           all_logits: bool = True) -> tuple[Array, Cache]:
    """`t` tokens fed one at a time through `decode` (padding: position -1, a no-op): the reference semantics of
    "compress after every token" (StreamingLLM's perplexity protocol). Every step's logits `[b, t, V]` (a `lax.scan`
    over the `t` steps), or the last step's: then the leading steps where every row is padding (a left padded
    bucket longer than its longest row) are not run, as a `lax.while_loop` from the first real step, so the steps
    run follow the rows' lengths, not the bucket's, and the compiled program is the bucket's alone."""

    if all_logits:
        def body(cache, xs):
            out, cache = decode(model, xs[0], xs[1], cache, plan)
            return cache, out

        cache, out = jax.lax.scan(body, cache, (tokens.T, positions.T))
        return out.transpose(1, 0, 2), cache

    tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)

    def step(carry):
        i, cache, _ = carry
        out, cache = decode(model, tokens[:, i], positions[:, i], cache, plan)
        return i + 1, cache, out

    first = jnp.argmax(jnp.any(positions >= 0, axis=0)).astype(jnp.int32)  # 0 when every step is padding
    shape = jax.eval_shape(step, (first, cache, None))[2]
    init = (first, cache, jnp.zeros(shape.shape, shape.dtype))
    _, cache, out = jax.lax.while_loop(lambda c: c[0] < tokens.shape[1], step, init)
    return out, cache


def follow(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan
           ) -> tuple[Float[Array, "b V"], Cache]:
    """`t` tokens that follow the prompt (a question; left padded, position -1 on padding) read into its cache: the
    last step's logits and the cache. One forward over the chunk where the plan's decoding only appends
    (`Plan.decode_appends`: SnapKV & co, KVzip, FullCache; `kvjax.step.Append`), else fed one at a time (`stream`),
    the reference they equal."""
    if plan.decode_appends:
        return contract.forward(model, tokens, positions, cache, steps.Append(plan))
    return stream(model, tokens, positions, cache, plan, all_logits=False)


def extend(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan
           ) -> Float[Array, "b t V"]:
    """Logits of a chunk (right padded, positions -1) that continues a prefilled `cache`, which is only read: prefix
    caching (few-shot demonstrations, AnLLM's anchors reused for many continuations). The chunk follows the rules'
    eq. 4 mask within itself and against the cache; nothing is evicted."""
    return contract.forward(model, tokens, positions, cache, steps.Extend(plan))[0]


def replay(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan,
           span: Int[Array, "b 3"], plus: bool = False) -> tuple[Float[Array, "b kvh c"], ...]:
    """KVzip's replay (`kvjax.kvzip`): the tokens extend the read-only `cache` (right padded), and each layer returns
    its cached slots' reconstruction scores for the context chunk `span` = (sinks, start, end); KVzip+'s with `plus`."""
    return contract.forward(model, tokens, positions, tuple((c, span) for c in cache), steps.Replay(plan, plus))[1]


def grad_replay(model: CachedLM, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan,
                span: Int[Array, "b 3"]) -> tuple[Float[Array, "b kvh c"], ...]:
    """KVgrad's replay (`kvjax.kvzip`, `kvjax.policies.KVgrad`): `replay`'s extension of the read-only `cache`, then one
    backward pass (`jax.vjp` of the forward, nothing but each layer's zero `tap` differentiated, the weights and the
    cache constant) of Φ = Σ_p ‖h_p^L‖² over the replay's last hidden states: per layer, each slot of the chunk `span`
    scored max over the replay's queries p and the group's query heads i of A_{p,c} ‖v_c W_o^i‖_2 ‖∂Φ/∂a_p‖_2
    (`attention.reconstruction_scores` with those factors), a_p the layer's attention output after W_o."""
    b, t = tokens.shape
    step = steps.GradReplay(plan)

    def forward(taps):
        carry = tuple((c, span, tap) for c, tap in zip(cache, taps))
        return contract.forward(model, tokens, positions, carry, step)

    taps = tuple(jnp.zeros((b, t), jnp.float32) for _ in cache)
    logits, pullback, parts = jax.vjp(forward, taps, has_aux=True)
    (grad_norms,) = pullback(jnp.zeros_like(logits))  # `GradReplay.select` puts Φ's gradient in
    out = []
    for c, (q, k, out_norms, scale), grad_norm in zip(cache, parts, grad_norms):
        c = layer.read(c, positions)
        per_query = jnp.where(positions >= 0, grad_norm, 0.0)
        out.append(attention.reconstruction_scores(q, k, positions, c.k, c.pos, span, scale, (per_query, out_norms)))
    return tuple(out)


def equal_bytes_budget(model: CachedLM, policy: Policy, prompt_len: int, new_tokens: int) -> int:
    """The token budget per (layer, KV head) at which a one-array-per-layer policy (StreamingLLM, H2O,
    SnapKV, ...) holds as many slots as `policy` does for one `prompt_len`-token prompt and
    `new_tokens` generated: equal slots are equal key and value bytes (a rule's own statistics add a few
    bytes per slot or head, `Rule.cache_state`, not counted here). This is how RazorAttention, whose retrieval heads keep the whole prompt, is compared with
    the token-budget policies at the same memory. Shapes only: nothing is allocated."""
    sized = plan(model, policy, prompt_len + new_tokens, prompt_len)
    cache = jax.eval_shape(lambda: empty_cache(model, sized, 1))
    return max(1, kvcache.num_slots(cache) // (model.cfg.num_layers * model.cfg.num_kv_heads))


__all__ = ["chunk", "decode", "empty_cache", "equal_bytes_budget", "extend", "follow", "forward", "grad_replay", "logits", "plan", "probe", "prompt", "replay", "shared",
           "size_rows", "stream"]
