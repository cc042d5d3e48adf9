"""Compressed-cache decode attention in Pallas, GPU and TPU variants.

Specification: `kvjax.attention.decode_attention` without ALiBi / sliding window
(those models decode through the reference). One query per sequence and query head
against `C` cache slots: a slot is valid where its stored position is >= 0, its
logit gets the slot's `log_w` (RazorAttention's compensation token), and the `g`
query heads of a KV head share one program, so K/V are read once per group.

* GPU (Triton): flash-decoding. Grid `(b, kvh, splits)`: the slots are split so a
  batch-1 decode still fills the SMs; each program loops over its blocks, partial
  results are merged with their log-sum-exps in jnp. The group is padded to 16 rows,
  the smallest tile `tl.dot` takes.
* TPU (Mosaic): grid `(b, kvh, nk)`, the slot axis sequential with VMEM accumulators.

With `logits=True` the kernel also writes the masked, biased logits `[b, kvh, g, C]`
from which `probs` (H2O's per-slot attention summed over the group) and `first_logit`
(MAT's logit to position 0) are computed without a second read of K.

Inference only (no VJP).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kvjax.pallas import tiles
from kvjax.pallas.blocks import DECODE, check_shapes, resolve
from kvjax.stats import NO_STATS, AttentionStats, StatsRequest

GPU_PROGRAMS = 256  # ~2 waves on an H100 (132 SMs); 32 splits per KV head measured best at C = 16K-64K
GPU_WARPS, GPU_STAGES = 4, 2  # Triton's warps per program and pipelining depth (benchmarks.decode_tuning sweeps them)


def _tile(q, k, pos, log_w, scale):
    s = tiles.qk(q, k) * scale
    return jnp.where(pos >= 0, s + log_w, tiles.MASKED)  # [gp, bk]


def _gpu_kernel(q_ref, k_ref, v_ref, pos_ref, logw_ref, o_ref, m_ref, l_ref, *s_ref, bk, scale):
    q = q_ref[...]

    def body(j, carry):
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        s = _tile(q, k_ref[sl, :], pos_ref[:, sl], logw_ref[:, sl], scale)
        if s_ref:
            s_ref[0][:, sl] = s
        return tiles.online_step(carry, s, v_ref[sl, :])

    m, l, acc = jax.lax.fori_loop(0, k_ref.shape[0] // bk, body, tiles.online_init(*q.shape))
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l  # unnormalised: merged across splits outside


def _tpu_kernel(q_ref, k_ref, v_ref, pos_ref, logw_ref, o_ref, lse_ref, *rest, nk, scale):
    *s_ref, m_scr, l_scr, acc_scr = rest
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_scr[...], l_scr[...], acc_scr[...] = tiles.online_init(*acc_scr.shape)

    s = _tile(q_ref[...], k_ref[...], pos_ref[...], logw_ref[...], scale)
    if s_ref:
        s_ref[0][...] = s
    m_scr[...], l_scr[...], acc_scr[...] = tiles.online_step((m_scr[...], l_scr[...], acc_scr[...]), s, v_ref[...])

    @pl.when(j == nk - 1)
    def _():
        o, lse = tiles.online_finish(m_scr[...], l_scr[...], acc_scr[...])
        o_ref[...], lse_ref[...] = o.astype(o_ref.dtype), lse


@functools.partial(jax.jit, static_argnames=("scale", "logits", "variant", "interpret", "block", "splits", "warps",
                                                      "stages"))
def _decode(q, k, v, slot_pos, log_w, *, scale, logits, variant, interpret, block, splits, warps=GPU_WARPS,
            stages=GPU_STAGES):
    b, h, d = q.shape
    kvh, c = k.shape[1], k.shape[2]
    g = h // kvh
    bk = block
    dp = tiles.gpu_head_dim(d) if variant == "gpu" else d
    q, k, v = (tiles.pad_axis(x, x.ndim - 1, dp) for x in (q, k, v))
    # A cache whose slot count is not a whole number of tiles (of tiles x splits, on the GPU) is padded, and padding
    # copies all of it at every step (4x the cache's bytes in a compiled TPU step's cost analysis). On the TPU the
    # tile is the largest of 512 / 256 / 128 slots that divides the cache (`tiles.dividing`). The GPU still pads
    # (C = 4096 + 256 new tokens is padded to 32 x 128 x 2): fewer splits would avoid the copy and lose programs
    # at batch 1, a trade only a GPU can time.
    if variant == "gpu":
        gp = max(16, tiles.next_pow2(g))
        nblocks = -(-c // bk)
        splits = max(1, min(nblocks, splits or tiles.next_pow2(-(-GPU_PROGRAMS // (b * kvh)))))
        cp = tiles.round_up(c, bk * splits)
    else:
        gp, splits = tiles.round_up(g, 8), 1
        bk = tiles.dividing(c, [x for x in (bk, 256, 128) if x <= bk]) or bk
        cp = tiles.round_up(c, bk)
    qg = tiles.pad_axis(q.reshape(b, kvh, g, dp), 2, gp)
    kp, vp = tiles.pad_axis(k, 2, cp), tiles.pad_axis(v, 2, cp)
    pos = tiles.pad_axis(slot_pos, 2, cp, -1)[:, :, None]
    lw = tiles.pad_axis(log_w.astype(jnp.float32), 2, cp)[:, :, None]
    s_shape = [jax.ShapeDtypeStruct((b, kvh, gp, cp), jnp.float32)] if logits else []
    if variant == "gpu":
        cs = cp // splits
        o, m, l, *s = pl.pallas_call(
            functools.partial(_gpu_kernel, bk=bk, scale=scale),
            grid=(b, kvh, splits),
            in_specs=[
                pl.BlockSpec((None, None, gp, dp), lambda b, kh, i: (b, kh, 0, 0)),
                pl.BlockSpec((None, None, cs, dp), lambda b, kh, i: (b, kh, i, 0)),
                pl.BlockSpec((None, None, cs, dp), lambda b, kh, i: (b, kh, i, 0)),
                pl.BlockSpec((None, None, 1, cs), lambda b, kh, i: (b, kh, 0, i)),
                pl.BlockSpec((None, None, 1, cs), lambda b, kh, i: (b, kh, 0, i)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, None, gp, dp), lambda b, kh, i: (b, kh, i, 0, 0)),
                pl.BlockSpec((None, None, None, gp, 1), lambda b, kh, i: (b, kh, i, 0, 0)),
                pl.BlockSpec((None, None, None, gp, 1), lambda b, kh, i: (b, kh, i, 0, 0)),
            ] + [pl.BlockSpec((None, None, gp, cs), lambda b, kh, i: (b, kh, 0, i))] * logits,
            out_shape=[
                jax.ShapeDtypeStruct((b, kvh, splits, gp, dp), jnp.float32),
                jax.ShapeDtypeStruct((b, kvh, splits, gp, 1), jnp.float32),
                jax.ShapeDtypeStruct((b, kvh, splits, gp, 1), jnp.float32),
            ] + s_shape,
            compiler_params=tiles.compiler_params(variant, 3, 0, num_warps=warps, num_stages=stages),
            interpret=tiles.interpret_mode(variant, interpret),
            name="kvjax_decode_gpu",
        )(qg, kp, vp, pos, lw)
        # Merge the splits (flash-decoding's reduction).
        m_all = jnp.max(m, axis=2, keepdims=True)
        w = jnp.exp(m - m_all) * (l > 0)
        l_all = jnp.sum(w * l, axis=2)
        o, lse = tiles.online_finish(m_all[:, :, 0], l_all, jnp.sum(w * o, axis=2))
    else:
        nk = cp // bk
        o, lse, *s = pl.pallas_call(
            functools.partial(_tpu_kernel, nk=nk, scale=scale),
            grid=(b, kvh, nk),
            in_specs=[
                pl.BlockSpec((None, None, gp, dp), lambda b, kh, j: (b, kh, 0, 0)),
                pl.BlockSpec((None, None, bk, dp), lambda b, kh, j: (b, kh, j, 0)),
                pl.BlockSpec((None, None, bk, dp), lambda b, kh, j: (b, kh, j, 0)),
                pl.BlockSpec((None, None, 1, bk), lambda b, kh, j: (b, kh, 0, j)),
                pl.BlockSpec((None, None, 1, bk), lambda b, kh, j: (b, kh, 0, j)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, gp, dp), lambda b, kh, j: (b, kh, 0, 0)),
                pl.BlockSpec((None, None, gp, 1), lambda b, kh, j: (b, kh, 0, 0)),
            ] + [pl.BlockSpec((None, None, gp, bk), lambda b, kh, j: (b, kh, 0, j))] * logits,
            out_shape=[jax.ShapeDtypeStruct((b, kvh, gp, dp), q.dtype),
                       jax.ShapeDtypeStruct((b, kvh, gp, 1), jnp.float32)] + s_shape,
            scratch_shapes=[pltpu.VMEM((gp, 1), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                            pltpu.VMEM((gp, dp), jnp.float32)],
            compiler_params=tiles.compiler_params(variant, 2, 1),
            interpret=tiles.interpret_mode(variant, interpret),
            name="kvjax_decode_tpu",
        )(qg, kp, vp, pos, lw)
    out = o[:, :, :g, :d].reshape(b, h, d).astype(q.dtype)
    lse = lse[:, :, :g, 0]
    return out, lse, (s[0][:, :, :g, :c] if logits else None)


def decode_attention(
    q: Float[Array, "b h d"],
    k: Float[Array, "b kvh c d"],
    v: Float[Array, "b kvh c d"],
    slot_pos: Int[Array, "b kvh c"],
    log_w: Float[Array, "b kvh c"],
    *,
    scale: float,
    stats: StatsRequest = NO_STATS,
    variant: str = "gpu",
    interpret: bool = False,
    block: int | None = None,
    splits: int | None = None,
    warps: int | None = None,
    stages: int | None = None,
) -> tuple[Float[Array, "b h d"], AttentionStats]:
    """`kvjax.attention.decode_attention` (same statistics: `probs`, `first_logit`) as a kernel.

    `block`: slots per tile; `splits` (GPU): slot ranges per (sequence, KV head), merged after
    the kernel; by default enough for ~`GPU_PROGRAMS` programs. `warps` / `stages` (GPU): Triton's
    warps per program and pipelining depth, by default `GPU_WARPS` / `GPU_STAGES`. TPU takes none of
    the three."""
    if variant == "tpu" and (splits, warps, stages) != (None, None, None):
        raise ValueError(f"pallas decode_attention: splits={splits}, warps={warps}, stages={stages} are GPU (Triton) "
                         f"options; the TPU variant has none of them")
    for name, x in (("splits", splits), ("warps", warps), ("stages", stages)):
        if x is not None and x < 1:
            raise ValueError(f"pallas decode_attention: {name}={x} must be >= 1")
    blocks = resolve(DECODE, variant, interpret, None, block)
    check_shapes("pallas decode_attention", q=(q, "bhd"), k=(k, "bgcd"), v=(v, "bgcd"), slot_pos=(slot_pos, "bgc"),
                 log_w=(log_w, "bgc"))
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"pallas decode_attention: query heads ({q.shape[1]}) must be a multiple of KV heads "
                         f"({k.shape[1]}); shapes q {q.shape}, k {k.shape}")
    if stats.colsum or stats.last_queries:
        raise ValueError(f"decode_attention cannot compute statistics {stats.names()}; it takes probs and first_logit")
    out, lse, s = _decode(q, k, v, slot_pos, log_w, scale=scale, logits=bool(stats), variant=variant,
                          interpret=interpret, block=blocks.block_k, splits=splits,
                          warps=warps or GPU_WARPS, stages=stages or GPU_STAGES)
    first_logit = None
    if stats.first_logit:
        raw = s - log_w[:, :, None, :].astype(s.dtype)  # q.k_0 * scale, as the reference returns it
        first_logit = jnp.max(jnp.where((slot_pos == 0)[:, :, None, :], raw, tiles.MASKED), axis=-1)
    probs = jnp.sum(jnp.exp(s - lse[..., None]), axis=2) if stats.probs else None
    return out, AttentionStats(first_logit=first_logit, probs=probs)
