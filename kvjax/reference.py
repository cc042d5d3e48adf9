"""Reference attention in plain jnp: the specification the Pallas kernels must match.

Layouts: queries `[b, h, t, d]`, keys/values `[b, kvh, s, d]` with `h = kvh * g`
(GQA: query head `i` reads KV head `i // g`, as in transformers). Scores and
softmax run in float32 for half-precision inputs (float64 for float64 ones). Which keys a query
sees is `kvjax.masks`, the spec the kernels build their tiles from too.

This module imports no kernel: `kvjax.attention` chooses between it, the Pallas kernels and cuDNN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax import masks
from kvjax.masks import CAUSAL, AnchorMask, Mask
from kvjax.stats import NO_STATS, AttentionStats, StatsRequest

_MASKED = masks.MASKED
# Queries per block in prefill: bounds the score buffer to [block, T] per head.
PREFILL_BLOCK = 512

def _group(q: Float[Array, "b h t d"], kv_heads: int) -> Float[Array, "b kvh g t d"]:
    b, h, t, d = q.shape
    if h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kv_heads})")
    return q.reshape(b, kv_heads, h // kv_heads, t, d)


def _acc(dtype):
    """Accumulation/softmax dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes (Press et al. 2022): geometric from 2^(-8/n) for a power of two n; otherwise
    those of the closest lower power of two followed by every other slope of the next one."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return np.asarray(power_of_2(num_heads), np.float32)
    low = 2 ** math.floor(math.log2(num_heads))
    rest = alibi_slopes(2 * low)[0::2][: num_heads - low]
    return np.concatenate([power_of_2(low), rest]).astype(np.float32)


def _softcap(s, cap: float | None):
    """Gemma 2's attention-logit soft-capping, `cap * tanh(s / cap)`, on the scaled scores."""
    return s if cap is None else cap * jnp.tanh(s / cap)


def _bias_and_mask(s, q_pos, k_pos, mask: Mask):
    """Adds the mask's ALiBi (slope * (k - q)) and masks keys that are invisible by position (causality, the
    window). s: [b, kvh, g, tq, tk]; q_pos: [b, kvh | 1, tq]; k_pos: [b, kvh | 1, tk] (positions, or ranks in
    rolling mode)."""
    qp, kp = q_pos[:, :, None, :, None], k_pos[:, :, None, None, :]  # [b, kvh|1, 1, tq, tk] once broadcast
    if mask.alibi is not None:
        kvh, g = s.shape[1], s.shape[2]
        s = s + masks.alibi_bias(jnp.asarray(mask.alibi, s.dtype).reshape(1, kvh, g, 1, 1), qp, kp, s.dtype)
    return jnp.where(masks.causal(qp, kp, mask.window), s, _MASKED)


def logits(q: Float[Array, "b h tq d"], k: Float[Array, "b kvh tk d"], q_pos: Int[Array, "b tq"],
           k_pos: Int[Array, "b tk"], *, scale: float, mask: Mask = CAUSAL) -> Float[Array, "b kvh g tq tk"]:
    """Scaled, soft-capped, biased attention logits grouped by KV head, `MASKED` where the position mask hides
    a key (causality, the window): what attention's softmax reads, for inspection and probes
    (`kvjax.heads`). Takes the mask's window, soft-cap and ALiBi."""
    mask.only(("window", "softcap", "alibi"), "reference.logits")
    return _grouped_logits(_group(q, k.shape[1]), k, q_pos, k_pos, scale, mask)


def _grouped_logits(qg, k, q_pos, k_pos, scale, mask: Mask):
    """`logits` of grouped queries `[b, kvh, g, tq, d]` (eq. 4 and gate flags are the caller's): the one place the
    reference scales, soft-caps, biases and position-masks a block of scores."""
    s = _softcap(jnp.einsum("bkgqd,bksd->bkgqs", qg, k, preferred_element_type=_acc(qg.dtype)) * scale, mask.softcap)
    return _bias_and_mask(s, q_pos[:, None], k_pos[:, None], mask)


def _eq4(q_seg, q_anchor, k_seg, k_anchor, k_keep):
    """Eq. 4 between per-token arrays `[b, tq]` and `[b, tk]`: `[b, tq, tk]`."""
    return masks.eq4(q_seg[:, :, None], q_anchor[:, :, None], k_seg[:, None, :], k_anchor[:, None, :],
                     k_keep[:, None, :])


def _softmax(s, q_pos, k_pos, key_keep):
    """Softmax over the keys (last axis); with Attention-Gate's `key_keep` `[b, kvh, s]` (eq. 7), each
    key's weight is multiplied by its keep flag, a query's own key always by 1.

    Flags in {0, 1} make this exactly the masked softmax. Flags from the gate's straight-through
    estimator are exactly binary too, but a product (rather than a -inf mask) carries the
    gradient to evicted keys' flags as well: d p / d flag = how much re-admitting the key would
    change the output, which is what the gate learns from.
    """
    if key_keep is None:
        return jax.nn.softmax(s, axis=-1)
    diagonal = masks.own_key(q_pos[:, None, None, :, None], k_pos[:, None, None, None, :])
    w = jnp.where(diagonal, 1.0, key_keep[:, :, None, None, :].astype(s.dtype))
    causal = s > _MASKED
    m = jax.lax.stop_gradient(jnp.max(jnp.where(causal & (w > 0), s, _MASKED), axis=-1, keepdims=True))
    # An evicted key may out-score every kept one: clip its exponent so 0 * exp never overflows.
    e = jnp.where(causal, w * jnp.exp(jnp.minimum(s - m, 60.0)), 0.0)
    z = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(z > 0, z, 1.0)  # a padding query (no visible key) gets zeros


def _prefill_block(q, k, v, q_pos, k_pos, scale, mask: Mask, colsum, q_anc=None):
    """One block of queries. q: [b, kvh, g, tq, d]; k, v: [b, kvh, tk, d]; q_pos: [b, tq]; k_pos: [b, tk].

    With `colsum`, also returns each key's probability mass summed over the block's real
    queries, from the same probabilities (H2O's score costs no second pass). The mask's `anchors`
    (an AnchorMask over the keys) with `q_anc` = (segment, anchor) of the block's queries
    restricts the keys to eq. 4."""
    s = _grouped_logits(q, k, q_pos, k_pos, scale, mask)
    if mask.anchors is not None:
        seen = _eq4(q_anc[0], q_anc[1], mask.anchors.segment, mask.anchors.anchor, mask.anchors.keep)
        s = jnp.where(seen[:, None, None], s, _MASKED)
    p = _softmax(s, q_pos, k_pos, mask.key_keep)
    out = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v, preferred_element_type=_acc(v.dtype))
    if not colsum:
        return out, None
    return out, jnp.sum(jnp.where((q_pos >= 0)[:, None, None, :, None], p, 0.0), axis=3)


def _prefill_skipping(qg, k, v, pos, v_mean, scale, mask: Mask, want_colsum, block):
    """Self-attention over a prompt (queries and keys are the same `t` tokens, `pos` their positions) in
    `block x block` tiles, flash style: per query block, a running max and sum over the key blocks
    that can hold a visible key, so the tiles above the causal diagonal (and, with a window, those
    wholly older than it; with eq. 4 or bool gate flags, those they hide wholly) are never computed.
    The same masks and softmax as `_prefill_block`, so the same numbers; with `want_colsum`, a second
    pass over the same tiles, once each query's normaliser is known, sums each key's probability over
    the real queries.

    qg: [b, kvh, g, t, d] (t a multiple of `block`); k, v: [b, kvh, t, d]; pos: [b, t]; v_mean: [b, kvh, d],
    what a query that sees no key (padding) gets, as the reference's softmax over all-masked logits
    gives it: the mean value over the prompt's keys."""
    b, kvh, g, t, d = qg.shape
    n = t // block
    acc_t = _acc(qg.dtype)
    # The scale goes on the queries once rather than on every tile's logits: on a CPU, XLA writes the
    # scaled tile out as one more pass over memory (about 8 % of a 16K prefill). Only in float32 or
    # wider, where it costs one rounding of q; a bfloat16 q would lose 8 bits to it.
    if qg.dtype == acc_t:
        qg, scale = qg * jnp.asarray(scale, qg.dtype), 1.0
    kb = k.reshape(b, kvh, n, block, d)
    vb = v.reshape(b, kvh, n, block, d)
    pb = pos.reshape(b, n, block)
    window, softcap, anchor_mask = mask.window, mask.softcap, mask.anchors
    seg = None if anchor_mask is None else tuple(x.reshape(b, n, block) for x in
                                                 (anchor_mask.segment, anchor_mask.anchor, anchor_mask.keep))
    keep = None if mask.key_keep is None else mask.key_keep.reshape(b, kvh, n, block)
    v_mean = v_mean[:, :, None, None, :]

    # Block-sparse skipping: tiles that eq. 4 or the gate hide wholly are dead too, decided from
    # per-block summaries over the batch (`masks.eq4_blocks`, the Pallas kernels' rule). The gate's
    # flags count only as a bool mask: float flags are the straight-through estimator's, whose
    # gradient reaches evicted keys through their tiles (see `_softmax`).
    sparse = None
    real = pb >= 0
    if seg is not None:
        sparse = jnp.any(masks.eq4_blocks(seg[0], seg[1], real, seg[0], seg[1], seg[2], real), axis=0)
    if keep is not None and keep.dtype == jnp.bool_:  # a query's own key is in the diagonal tile
        kept = jnp.any(keep, axis=(0, 1, 3))[None, :] | jnp.eye(n, dtype=bool)
        sparse = kept if sparse is None else sparse & kept

    def live(i, j):
        ok = j <= i
        if window is not None:  # the block's newest key is at least `window` older than the query block's oldest
            ok &= (j + 1) * block - 1 > i * block - window
        if sparse is not None:
            ok &= sparse[i, j]
        return ok

    def tile(i, j, qi):
        """Logits, visibility and key weights of query block i against key block j."""
        kj, pj = kb[:, :, j], pb[:, j]
        s = _softcap(jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=acc_t) * scale, softcap)
        s = _bias_and_mask(s, pb[:, i][:, None], pj[:, None], mask)
        if seg is not None:
            seen = _eq4(seg[0][:, i], seg[1][:, i], seg[0][:, j], seg[1][:, j], seg[2][:, j])
            s = jnp.where(seen[:, None, None], s, _MASKED)
        causal = s > _MASKED
        if keep is None:
            return s, causal, causal
        diagonal = masks.own_key(pb[:, i][:, None, None, :, None], pj[:, None, None, None, :])
        w = jnp.where(diagonal, 1.0, keep[:, :, j][:, :, None, None, :].astype(s.dtype))
        return s, causal, w

    # A tile below the diagonal whose keys are all real (not padding), with no window, ALiBi, eq. 4 or
    # gate, is wholly visible: it skips the masks (on a CPU, with a small head dim, the elementwise
    # passes over a tile cost as much as its two matmuls). The same numbers: every mask there is true.
    plain = window is None and mask.alibi is None and seg is None and keep is None

    def one(i, qi):
        def update(carry, j, e, m_new):
            m, z, acc = carry
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", e.astype(v.dtype), vb[:, :, j],
                                                      preferred_element_type=acc_t)
            return m_new, z * alpha + jnp.sum(e, axis=-1), acc

        def step(carry, j):
            def compute(carry):
                s, causal, w = tile(i, j, qi)
                counted = causal & (w > 0) if keep is not None else causal
                m_new = jax.lax.stop_gradient(jnp.maximum(carry[0], jnp.max(jnp.where(counted, s, _MASKED), axis=-1)))
                return update(carry, j, jnp.where(causal, w * jnp.exp(jnp.minimum(s - m_new[..., None], 60.0)), 0.0),
                              m_new)

            def visible(carry):
                s = _softcap(jnp.einsum("bkgqd,bksd->bkgqs", qi, kb[:, :, j], preferred_element_type=acc_t) * scale,
                             softcap)
                m_new = jax.lax.stop_gradient(jnp.maximum(carry[0], jnp.max(s, axis=-1)))
                return update(carry, j, jnp.exp(s - m_new[..., None]), m_new)

            if not plain:
                return jax.lax.cond(live(i, j), compute, lambda c: c, carry), None
            kind = jnp.where(~live(i, j), 0, jnp.where((j < i) & jnp.all(pb[:, j] >= 0), 2, 1))
            return jax.lax.switch(kind, (lambda c: c, compute, visible), carry), None

        init = (jnp.full((b, kvh, g, block), _MASKED, acc_t), jnp.zeros((b, kvh, g, block), acc_t),
                jnp.zeros((b, kvh, g, block, d), acc_t))
        # Under a gradient, a scan keeps every step's residuals for the backward pass: here each tile's
        # logits and weights, O(T^2) per layer (a 4096-token training batch of 16 asked an H100 for 188 GiB).
        # Rematerializing the step recomputes one tile's logits in the backward pass instead; a call that
        # nothing differentiates (inference) runs the step as before.
        (m, z, acc), _ = jax.lax.scan(jax.checkpoint(step), init, jnp.arange(n))
        # a query that sees no key (padding): the reference's value for it (uniform softmax, or zeros with gates)
        none = jnp.zeros_like(v_mean) if keep is not None else v_mean
        out = jnp.where((z > 0)[..., None], acc / jnp.where(z > 0, z, 1.0)[..., None], none)
        if not want_colsum:
            return out, None
        real = (pb[:, i] >= 0)[:, None, None, :, None]

        def col(j):
            def compute(_):
                s, causal, w = tile(i, j, qi)
                p = jnp.where(causal, w * jnp.exp(jnp.minimum(s - m[..., None], 60.0)), 0.0) / jnp.where(
                    z > 0, z, 1.0)[..., None]
                return jnp.sum(jnp.where(real, p, 0.0), axis=3)

            return jax.lax.cond(live(i, j), compute, lambda _: jnp.zeros((b, kvh, g, block), acc_t), None)

        return out, jax.lax.map(col, jnp.arange(n)).transpose(1, 2, 3, 0, 4).reshape(b, kvh, g, t)

    qblocks = qg.reshape(b, kvh, g, n, block, d).transpose(3, 0, 1, 2, 4, 5)
    out, colsum = jax.lax.map(lambda xs: one(xs[0], xs[1]), (jnp.arange(n), qblocks))
    out = out.transpose(1, 2, 3, 0, 4, 5).reshape(b, kvh, g, t, d)
    return out, None if colsum is None else colsum.sum(axis=0)



def prefill_attention(
    q: Float[Array, "b h t d"],
    k: Float[Array, "b kvh s d"],
    v: Float[Array, "b kvh s d"],
    q_pos: Int[Array, "b t"],
    k_pos: Int[Array, "b s"],
    *,
    scale: float,
    stats: StatsRequest = NO_STATS,
    mask: Mask = CAUSAL,
    block: int = PREFILL_BLOCK,
    self_attention: bool = False,
) -> tuple[Float[Array, "b h t d"], AttentionStats]:
    """Causal attention by positions; long prompts run in query blocks, never `[T, T]` at once.

    `self_attention`: the queries and keys are the same left-padded tokens (`q_pos` is `k_pos`, in
    time order), as in a prompt's prefill; then a prompt longer than `block` runs in tiles that skip
    every key block after the query block (and, with a window, those wholly before it; with eq. 4 or
    bool `key_keep`, those the mask hides from every query of the block).

    `mask` (`kvjax.masks.Mask`), every part of it: ALiBi adds `slope * (k_pos - q_pos)`; `window`: a query
    sees only its `window` latest keys (Mistral's sliding window); `anchors`: AnLLM's eq. 4; `key_keep`: per
    KV head, the keys later queries may see (Attention-Gate's eq. 7; a query always sees its own key): bool,
    or the gate's float flags (differentiable, see `_softmax`); `softcap`: Gemma 2's cap.

    Optional statistics (`stats`, an `AttentionStats` of the requested ones):

    * `first_logit`: `[b, kvh, g, t]` each query's scaled logit to the key at position 0.
    * `last_probs[W]`: `[b, kvh, g, W, s]` the attention probabilities of the last W queries
      (SnapKV's observation window; also TOVA with W = 1). Only `W x s`, never `s x s`.
    * `colsum`: `[b, kvh, g, s]` every key's attention summed over all queries (H2O's
      accumulated attention), accumulated block by block.
    """
    if stats.probs:
        raise ValueError("prefill_attention cannot compute statistics ['probs'] (a decode statistic)")
    b, h, t, d = q.shape
    kvh = k.shape[1]
    qg = _group(q, kvh)
    want_colsum = stats.colsum
    anchor_mask, key_keep = mask.anchors, mask.key_keep
    q_anc = None if anchor_mask is None else (anchor_mask.segment, anchor_mask.anchor)
    if self_attention and t > block:
        if k.shape[2] != t:
            raise ValueError(f"self_attention: queries ({t}) and keys ({k.shape[2]}) must be the same tokens")
        pad = -t % block
        v_mean = jnp.mean(v.astype(_acc(v.dtype)), axis=2)
        pad_t = lambda x, axis, value=0: jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)],  # noqa: E731
                                                  constant_values=value)
        pos = pad_t(q_pos, 1, -1)
        anc = None if anchor_mask is None else AnchorMask(pad_t(anchor_mask.segment, 1), pad_t(anchor_mask.anchor, 1),
                                                      pad_t(anchor_mask.keep, 1))
        padded = mask.replace(anchors=anc, key_keep=None if key_keep is None else pad_t(key_keep, 2))
        out, colsum = _prefill_skipping(pad_t(qg, 3), pad_t(k, 2), pad_t(v, 2), pos, v_mean, scale, padded,
                                        want_colsum, block)
        out = out[:, :, :, :t]
        colsum = None if colsum is None else colsum[..., :t]
    elif t <= block:
        out, colsum = _prefill_block(qg, k, v, q_pos, k_pos, scale, mask, want_colsum, q_anc)
    else:
        n = -(-t // block)
        pad = n * block - t
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
        qp = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
        qg = qg.reshape(b, kvh, h // kvh, n, block, d).transpose(3, 0, 1, 2, 4, 5)
        qp = qp.reshape(b, n, block).transpose(1, 0, 2)
        blocks = lambda x: jnp.pad(x, ((0, 0), (0, pad))).reshape(b, n, block).transpose(1, 0, 2)
        qa = None if anchor_mask is None else (blocks(anchor_mask.segment), blocks(anchor_mask.anchor))
        out, colsum = jax.lax.map(
            lambda xs: _prefill_block(xs[0], k, v, xs[1], k_pos, scale, mask, want_colsum, xs[2]),
            (qg, qp, qa),
        )
        out = out.transpose(1, 2, 3, 0, 4, 5).reshape(b, kvh, h // kvh, n * block, d)[:, :, :, :t]
        colsum = None if colsum is None else colsum.sum(axis=0)
    first_logit, last_probs = prompt_statistics(q, k, q_pos, k_pos, stats, scale=scale, mask=mask)
    out_stats = AttentionStats(first_logit=first_logit, colsum=colsum, last_probs=last_probs)
    return out.reshape(b, h, t, d).astype(q.dtype), out_stats


def prompt_statistics(
    q: Float[Array, "b h t d"],
    k: Float[Array, "b kvh s d"],
    q_pos: Int[Array, "b t"],
    k_pos: Int[Array, "b s"],
    stats: StatsRequest,
    *,
    scale: float,
    mask: Mask = CAUSAL,
) -> tuple[Float[Array, "b kvh g t"] | None, dict[int, Float[Array, "b kvh g w s"]]]:
    """`(first_logit, last_probs)` of a prompt's attention as `prefill_attention` defines them: O(W x s),
    so computed here whatever code ran the attention itself (the kernels return only the output and `colsum`)."""
    kvh, t = k.shape[1], q.shape[2]
    last_probs = {}
    for w in sorted(stats.last_queries):
        start = max(t - w, 0)  # a prompt bucket shorter than the window: all of it
        sw = _grouped_logits(_group(q[:, :, start:], kvh), k, q_pos[:, start:], k_pos, scale, mask)
        if mask.anchors is not None:
            sw = jnp.where(mask.anchors.visible(slice(start, None))[:, None, None], sw, _MASKED)
        real = (q_pos[:, start:] >= 0)[:, None, None, :, None]  # padding queries contribute nothing
        last_probs[w] = jnp.where(real, _softmax(sw, q_pos[:, start:], k_pos, mask.key_keep), 0.0)
    first_logit = None
    if stats.first_logit:
        first = jnp.argmax(k_pos == 0, axis=1)  # time index of position 0, per row
        k0 = jnp.take_along_axis(k, first[:, None, None, None], axis=2)[:, :, 0]  # [b, kvh, d]
        first_logit = jnp.einsum("bkgqd,bkd->bkgq", _group(q, kvh), k0, preferred_element_type=_acc(q.dtype)) * scale
    return first_logit, last_probs


def prefix_attention(
    q: Float[Array, "b h t d"],
    k: Float[Array, "b kvh t d"],
    v: Float[Array, "b kvh t d"],
    pos: Int[Array, "b t"],
    cache_k: Float[Array, "b kvh c d"],
    cache_v: Float[Array, "b kvh c d"],
    slot_pos: Int[Array, "b kvh c"],
    log_w: Float[Array, "b kvh c"],
    *,
    scale: float,
    mask: Mask = CAUSAL,
    slot_visible: Bool[Array, "b kvh t c"] | None = None,
    chunk_visible: Bool[Array, "b t t"] | None = None,
    stats: StatsRequest = NO_STATS,
    q_sinks: Float[Array, "b h t d"] | None = None,
    sinks: int = 0,
) -> tuple[Float[Array, "b h t d"], AttentionStats]:
    """A chunk of `t` new tokens attending a cache of `C` slots and, causally, itself.

    What prefix caching needs (AnLLM's cached demonstrations, Wang et al. 2023a) and what a
    chunked prefill runs: the cache slots are valid where `slot_pos >= 0`, carry the `log_w` bias,
    and may be further restricted per query by `slot_visible`; inside the chunk `chunk_visible`
    (`[b, query, key]`) and the mask's `anchors` (eq. 4 over the chunk) restrict the causal mask. One softmax
    over slots and chunk. The window and ALiBi use absolute positions. `mask.key_keep` is refused: the
    gate's flags of cached slots are the cache's (evicted slots are gone).

    `q_sinks`, `sinks`: the queries rotated for keys at positions `< sinks` (slots or chunk), `q`
    being used for the others: a ring in rolling positions measures a sink's distance from the
    query's rank, not its position (`ChunkRule.rolling_sinks`).

    `stats`, over the keys `[cache slots; chunk]` (the candidates `ChunkRule.absorb` chooses from):
    `last_probs[W]` `[b, kvh, g, W, C + t]`, the probabilities of the chunk's last W queries
    (W <= t); `colsum` `[b, kvh, g, C + t]`, each key's probability summed over the real queries;
    `first_logit` `[b, kvh, g, t]`, each query's scaled logit to the key at position 0 (a slot or a
    chunk token), without bias or soft-cap, as `prefill_attention` returns it.
    """
    mask.only(("window", "softcap", "alibi", "anchors"), "prefix_attention")
    kvh = k.shape[1]
    qg = _group(q, kvh)
    b, _, g, t, d = qg.shape
    acc = _acc(q.dtype)

    def logits(keys, key_pos):
        s = _softcap(jnp.einsum("bkgqd,bkcd->bkgqc", qg, keys, preferred_element_type=acc) * scale, mask.softcap)
        if q_sinks is None:
            return s
        s_sink = _softcap(jnp.einsum("bkgqd,bkcd->bkgqc", _group(q_sinks, kvh), keys, preferred_element_type=acc)
                          * scale, mask.softcap)
        return jnp.where((key_pos < sinks)[:, :, None, None, :], s_sink, s)

    sc = _bias_and_mask(logits(cache_k, slot_pos) + log_w[:, :, None, None, :].astype(acc), pos[:, None], slot_pos,
                        mask)
    if slot_visible is not None:
        sc = jnp.where(slot_visible[:, :, None], sc, _MASKED)
    sx = _bias_and_mask(logits(k, jnp.broadcast_to(pos[:, None], (b, kvh, t))), pos[:, None], pos[:, None], mask)
    if chunk_visible is not None:
        sx = jnp.where(chunk_visible[:, None, None], sx, _MASKED)
    if mask.anchors is not None:
        sx = jnp.where(mask.anchors.visible()[:, None, None], sx, _MASKED)
    p = jax.nn.softmax(jnp.concatenate([sc, sx], axis=-1), axis=-1)
    c = cache_k.shape[2]
    out = jnp.einsum("bkgqc,bkcd->bkgqd", p[..., :c].astype(v.dtype), cache_v, preferred_element_type=acc)
    out += jnp.einsum("bkgqs,bksd->bkgqd", p[..., c:].astype(v.dtype), v, preferred_element_type=acc)
    real = (pos >= 0)[:, None, None, :, None]  # padding queries contribute nothing
    if stats.probs or any(w > t for w in stats.last_queries):
        raise ValueError(f"prefix_attention cannot compute {stats.names()} for a chunk of {t} tokens")
    first_logit = None
    if stats.first_logit:
        at0 = lambda keys, p0: jnp.sum(jnp.where(p0[..., None], keys, 0), axis=2)  # noqa: E731
        k0 = at0(cache_k, slot_pos == 0) + at0(k, jnp.broadcast_to((pos == 0)[:, None], k.shape[:3]))
        first_logit = jnp.einsum("bkgqd,bkd->bkgq", qg, k0.astype(qg.dtype), preferred_element_type=acc) * scale
    out_stats = AttentionStats(
        first_logit=first_logit, colsum=jnp.sum(jnp.where(real, p, 0.0), axis=3) if stats.colsum else None,
        last_probs={w: jnp.where(real[:, :, :, t - w:], p[:, :, :, t - w:], 0.0) for w in sorted(stats.last_queries)})
    return out.reshape(b, kvh * g, t, d).astype(q.dtype), out_stats



def decode_attention(
    q: Float[Array, "b h d"],
    k: Float[Array, "b kvh c d"],
    v: Float[Array, "b kvh c d"],
    slot_pos: Int[Array, "b kvh c"],
    log_w: Float[Array, "b kvh c"],
    *,
    scale: float,
    stats: StatsRequest = NO_STATS,
    q_coord: Int[Array, "b kvh"] | None = None,
    k_coord: Int[Array, "b kvh c"] | None = None,
    mask: Mask = CAUSAL,
) -> tuple[Float[Array, "b h d"], AttentionStats]:
    """One query per row against `C` cache slots (the query's own token already inserted).

    Validity comes from `slot_pos >= 0`; `log_w` is added to each slot's logit
    (RazorAttention's `log N_d` compensation weight). The mask's ALiBi and sliding window use
    `k_coord - q_coord`: absolute positions, or ranks in the cache in rolling mode; its soft-cap applies.
    Eq. 4 and gate flags belong to a prompt (a cache holds what they kept) and are refused.
    Optional statistics:

    * `probs`: `[b, kvh, c]` attention probabilities summed over the group's query heads;
    * `first_logit`: `[b, kvh, g]` `q.k_0 * scale` for the slot holding position 0, without its `log_w`
      or ALiBi bias, as prefill's (-inf-like if evicted).
    """
    if stats.colsum or stats.last_queries:
        raise ValueError(f"decode_attention cannot compute statistics {stats.names()}; it takes probs and first_logit")
    mask.only(("window", "softcap", "alibi"), "decode_attention")
    b, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, d)
    raw = jnp.einsum("bkgd,bkcd->bkgc", qg, k, preferred_element_type=_acc(q.dtype)) * scale
    s = _softcap(raw, mask.softcap) + log_w[:, :, None, :]
    if mask.alibi is not None or mask.window is not None:
        s = _bias_and_mask(s[:, :, :, None], q_coord[:, :, None], jnp.where(slot_pos >= 0, k_coord, -1),
                           mask)[:, :, :, 0]
    s = jnp.where((slot_pos >= 0)[:, :, None, :], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgc,bkcd->bkgd", p.astype(v.dtype), v, preferred_element_type=_acc(v.dtype))
    first_logit = None
    if stats.first_logit:
        # MAT's pi is q.k_0 / sqrt(d) (the paper's definition), the same quantity prefill returns:
        # without the slot's log_w or an ALiBi bias, which would rank anchors by distance too.
        first_logit = jnp.max(jnp.where((slot_pos == 0)[:, :, None, :], raw, _MASKED), axis=-1)
    out_stats = AttentionStats(first_logit=first_logit, probs=p.sum(axis=2) if stats.probs else None)
    return out.reshape(b, h, d).astype(q.dtype), out_stats
