"""Masked prefill attention in Pallas (FlashAttention-2 forward), GPU and TPU variants.

Specification: `kvjax.attention.prefill_attention` (the jnp reference). Supports
causal-by-position masks with left padding, a sliding window, ALiBi, AnLLM's eq. 4
(segments / anchors / kept span), an Attention-Gate per-head key keep-mask and GQA.
`[T, T]` is never materialised: per query block, a table built from block
summaries (`tiles.block_table`) lists the key blocks that can hold a visible key,
and only those are read and multiplied (block-sparse skipping).

Layout: the `g` query heads of a KV head are stacked along the query axis,
`[b, kvh, g * T, d]`, so one grid row `(b, kvh)` reads one K/V.

* GPU (`variant="gpu"`, Triton backend): grid `(b, kvh, g * nq)`; each program loops
  (`fori_loop`) over its live key blocks, reading K/V with dynamic slices. Chosen over
  Mosaic GPU because Triton lowers the dynamic trip count and scalar table reads this
  needs on A100 and H100 alike (Mosaic GPU targets Hopper+ warpgroup code).
* TPU (`variant="tpu"`, Mosaic): grid `(b, kvh, g * nq, nk)`, the key axis sequential
  with VMEM scratch accumulators; each query block's span of live key blocks (`tiles.block_range`:
  the first, and how many to the last) is scalar-prefetched into SMEM and the K/V index maps
  read it, so blocks outside the span are neither copied nor computed (the block index
  repeats, so the pipeline skips the DMA).

Also `colsum`: every key's probability summed over the queries at or after `q_start`
(H2O's accumulated attention), a second pass that reuses the forward's log-sum-exp.

Inference only: no VJP is defined (training runs the jnp reference under `jax.grad`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kvjax.masks import CAUSAL, Mask
from kvjax.pallas import tiles
from kvjax.pallas.blocks import PREFILL, check_shapes, resolve


def _gpu_kernel(cnt_ref, idx_ref, slope_ref, q_ref, k_ref, v_ref, qm_ref, km_ref, gate_ref, o_ref, *lse_ref,
                nq, bk, scale, window, anchors, gated, alibi):
    b, kh, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i = r % nq
    q, qm = q_ref[...], tiles.load_query_meta(qm_ref, anchors=anchors)
    slope = slope_ref[kh, r // nq] if alibi else None

    def body(j, carry):
        sl = pl.ds(pl.multiple_of(idx_ref[b, kh, i, j] * bk, bk), bk)
        gate = gate_ref[:, sl] if gated else None
        km = tiles.load_key_meta(km_ref, sl, anchors=anchors)
        s = tiles.tile_logits(q, k_ref[sl, :], qm, km, gate, slope, scale=scale, window=window)
        return tiles.online_step(carry, s, v_ref[sl, :])

    carry = jax.lax.fori_loop(0, cnt_ref[b, kh, i], body, tiles.online_init(*q.shape))
    o, lse = tiles.online_finish(*carry)
    o_ref[...] = o.astype(o_ref.dtype)
    if lse_ref:
        lse_ref[0][...] = lse


def _tpu_kernel(first_ref, span_ref, slope_ref, q_ref, k_ref, v_ref, qm_ref, km_ref, gate_ref, o_ref, *rest,
                nq, nk, scale, window, anchors, gated, alibi):
    *lse_ref, m_scr, l_scr, acc_scr = rest
    b, kh, r, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_scr[...], l_scr[...], acc_scr[...] = tiles.online_init(*acc_scr.shape)

    @pl.when(j < span_ref[b, kh, r % nq])
    def _():
        slope = slope_ref[kh, r // nq] if alibi else None
        s = tiles.tile_logits(q_ref[...], k_ref[...], tiles.load_query_meta(qm_ref, anchors=anchors),
                              tiles.load_key_meta(km_ref, anchors=anchors), gate_ref[...] if gated else None,
                              slope, scale=scale, window=window)
        m_scr[...], l_scr[...], acc_scr[...] = tiles.online_step((m_scr[...], l_scr[...], acc_scr[...]), s, v_ref[...])

    @pl.when(j == nk - 1)
    def _():
        o, lse = tiles.online_finish(m_scr[...], l_scr[...], acc_scr[...])
        o_ref[...] = o.astype(o_ref.dtype)
        if lse_ref:
            lse_ref[0][...] = lse


def _inputs(q, k, v, q_pos, k_pos, alibi, anchors, key_keep, bq, bk, variant):
    """Padded, grouped kernel operands and their dimensions (`dp`: the padded head dim)."""
    b, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    tp, sp = tiles.round_up(t, bq), tiles.round_up(s, bk)
    dp = tiles.gpu_head_dim(d) if variant == "gpu" else d
    q, k, v = (tiles.pad_axis(x, 3, dp) for x in (q, k, v))
    qg = tiles.pad_axis(q.reshape(b, kvh, g, t, dp), 3, tp).reshape(b, kvh, g * tp, dp)
    kp, vp = tiles.pad_axis(k, 2, sp), tiles.pad_axis(v, 2, sp)
    if anchors is None:
        qm, km = tiles.query_meta(q_pos), tiles.key_meta(k_pos)
    else:
        qm = tiles.query_meta(q_pos, anchors.segment, anchors.anchor)
        km = tiles.key_meta(k_pos, anchors.segment, anchors.anchor, anchors.keep)
    qm = tiles.pad_axis(qm, 1, tp).at[:, t:, tiles.POS].set(-1)  # padding: position -1
    km = tiles.pad_axis(km, 2, sp).at[:, tiles.POS, s:].set(-1)
    gate = jnp.ones((b, kvh, 1, sp), jnp.int32) if key_keep is None else tiles.pad_axis(
        key_keep.astype(jnp.int32)[:, :, None], 3, sp)
    slopes = jnp.zeros((kvh, g), jnp.float32) if alibi is None else jnp.asarray(alibi, jnp.float32).reshape(kvh, g)
    return qg, kp, vp, qm, km, gate, slopes, (b, h, t, d, dp, kvh, s, g, tp, sp)


@functools.partial(jax.jit, static_argnames=("scale", "alibi_on", "window", "variant", "interpret", "block_q",
                                             "block_k", "with_lse"))
def _forward(q, k, v, q_pos, k_pos, alibi, anchors, key_keep, *, scale, alibi_on, window, variant, interpret,
             block_q, block_k, with_lse):
    bq, bk = block_q, block_k
    qg, kp, vp, qm, km, gate, slopes, dims = _inputs(q, k, v, q_pos, k_pos, alibi if alibi_on else None, anchors,
                                                     key_keep, bq, bk, variant)
    b, h, t, d, dp, kvh, s, g, tp, sp = dims
    nq, nk = tp // bq, sp // bk
    table = tiles.block_table if variant == "gpu" else tiles.block_range
    cnt, idx = table(qm, km, None if key_keep is None else gate, kvh, bq, bk, window=window,
                     anchors=anchors is not None)
    flags = dict(scale=scale, window=window, anchors=anchors is not None, gated=key_keep is not None,
                 alibi=alibi_on)
    # The log-sum-exps only where asked for (H2O's colsum pass): a `[.., T, 1]` f32 array is laid out 128 lanes
    # wide in a TPU's HBM, 512 MiB for a 32K prompt of 32 heads.
    out_shape = [jax.ShapeDtypeStruct((b, kvh, g * tp, dp), q.dtype)] + [
        jax.ShapeDtypeStruct((b, kvh, g * tp, 1), jnp.float32)] * with_lse
    if variant == "gpu":
        full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
        o, *lse = pl.pallas_call(
            functools.partial(_gpu_kernel, nq=nq, bk=bk, **flags),
            grid=(b, kvh, g * nq),
            in_specs=[
                full(cnt), full(idx), full(slopes),
                pl.BlockSpec((None, None, bq, dp), lambda b, kh, r: (b, kh, r, 0)),
                pl.BlockSpec((None, None, sp, dp), lambda b, kh, r: (b, kh, 0, 0)),
                pl.BlockSpec((None, None, sp, dp), lambda b, kh, r: (b, kh, 0, 0)),
                pl.BlockSpec((None, bq, tiles.QM), lambda b, kh, r: (b, r % nq, 0)),
                pl.BlockSpec((None, tiles.KM, sp), lambda b, kh, r: (b, 0, 0)),
                pl.BlockSpec((None, None, 1, sp), lambda b, kh, r: (b, kh, 0, 0)),
            ],
            out_specs=[pl.BlockSpec((None, None, bq, dp), lambda b, kh, r: (b, kh, r, 0))]
                      + [pl.BlockSpec((None, None, bq, 1), lambda b, kh, r: (b, kh, r, 0))] * with_lse,
            out_shape=out_shape,
            compiler_params=tiles.compiler_params(variant, 3, 0),
            interpret=tiles.interpret_mode(variant, interpret),
            name="kvjax_prefill_gpu",
        )(cnt, idx, slopes, qg, kp, vp, qm, km, gate)
    else:
        def kv_block(b, kh, r, j, first, span, slopes):
            # Past the live span, repeat its last block: same block index, no new copy.
            return first[b, kh, r % nq] + jnp.minimum(j, jnp.maximum(span[b, kh, r % nq] - 1, 0))

        o, *lse = pl.pallas_call(
            functools.partial(_tpu_kernel, nq=nq, nk=nk, **flags),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3,
                grid=(b, kvh, g * nq, nk),
                in_specs=[
                    pl.BlockSpec((None, None, bq, dp), lambda b, kh, r, j, *_: (b, kh, r, 0)),
                    pl.BlockSpec((None, None, bk, dp), lambda b, kh, r, j, *t: (b, kh, kv_block(b, kh, r, j, *t), 0)),
                    pl.BlockSpec((None, None, bk, dp), lambda b, kh, r, j, *t: (b, kh, kv_block(b, kh, r, j, *t), 0)),
                    pl.BlockSpec((None, bq, tiles.QM), lambda b, kh, r, j, *_: (b, r % nq, 0)),
                    pl.BlockSpec((None, tiles.KM, bk), lambda b, kh, r, j, *t: (b, 0, kv_block(b, kh, r, j, *t))),
                    pl.BlockSpec((None, None, 1, bk), lambda b, kh, r, j, *t: (b, kh, 0, kv_block(b, kh, r, j, *t))),
                ],
                out_specs=[pl.BlockSpec((None, None, bq, dp), lambda b, kh, r, j, *_: (b, kh, r, 0))]
                          + [pl.BlockSpec((None, None, bq, 1), lambda b, kh, r, j, *_: (b, kh, r, 0))] * with_lse,
                scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                                pltpu.VMEM((bq, dp), jnp.float32)],
            ),
            out_shape=out_shape,
            compiler_params=tiles.compiler_params(variant, 3, 1),
            interpret=tiles.interpret_mode(variant, interpret),
            name="kvjax_prefill_tpu",
        )(cnt, idx, slopes, qg, kp, vp, qm, km, gate)
    o = o.reshape(b, kvh, g, tp, dp)[:, :, :, :t, :d].reshape(b, h, t, d)
    return o, (lse[0].reshape(b, kvh, g, tp)[:, :, :, :t].reshape(b, h, t) if with_lse else None)


def prefill_attention(
    q: Float[Array, "b h t d"],
    k: Float[Array, "b kvh s d"],
    v: Float[Array, "b kvh s d"],
    q_pos: Int[Array, "b t"],
    k_pos: Int[Array, "b s"],
    *,
    scale: float,
    mask: Mask = CAUSAL,
    variant: str = "gpu",
    interpret: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    with_lse: bool = True,
) -> tuple[Float[Array, "b h t d"], Float[Array, "b h t"] | None]:
    """Attention output and each query's log-sum-exp (MASKED for padding queries; None unless `with_lse`), under
    `mask`'s window, ALiBi, eq. 4 anchors and bool gate flags (no soft-cap: refused by name)."""
    blocks = resolve(PREFILL, variant, interpret, block_q, block_k)
    mask.only(("window", "alibi", "anchors", "key_keep"), "pallas prefill_attention")
    _check(q, k, v, q_pos, k_pos, mask.key_keep, name="pallas prefill_attention")
    return _forward(q, k, v, q_pos, k_pos, None if mask.alibi is None else jnp.asarray(mask.alibi), mask.anchors,
                    mask.key_keep, scale=scale, alibi_on=mask.alibi is not None, window=mask.window, variant=variant,
                    interpret=interpret, block_q=blocks.block_q, block_k=blocks.block_k, with_lse=with_lse)


def _check(q, k, v, q_pos, k_pos, key_keep, *, name, lse=None):
    arrays = dict(q=(q, "bhtd"), k=(k, "bgsd"), q_pos=(q_pos, "bt"), k_pos=(k_pos, "bs"))
    if v is not None:
        arrays["v"] = (v, "bgsd")
    if key_keep is not None:
        arrays["key_keep"] = (key_keep, "bgs")
    if lse is not None:
        arrays["lse"] = (lse, "bht")
    check_shapes(name, **arrays)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{name}: query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]}); "
                         f"shapes q {q.shape}, k {k.shape}")


# ---- colsum: a second pass over the probabilities, keys outer ----


def _colsum_tile(q, k, qm: tiles.QueryMeta, km: tiles.KeyMeta, gate, slope, lse, first, *, q_start, scale, window):
    """`first`: the tile's first query index; queries before `q_start` and padding count nothing."""
    s = tiles.tile_logits(q, k, qm, km, gate, slope, scale=scale, window=window)
    index = first + jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0)
    real = (qm.pos >= 0) & (lse > tiles.MASKED) & (index >= q_start)
    return jnp.sum(jnp.where(real, jnp.exp(s - lse), 0.0), axis=0, keepdims=True)  # [1, bk]


def _colsum_gpu_kernel(slope_ref, q_ref, lse_ref, qm_ref, k_ref, km_ref, gate_ref, out_ref, *, q_from, q_start, nq,
                       bq, tp, scale, window, anchors, gated, alibi):
    kh, hj = pl.program_id(1), pl.program_id(2)
    k, km = k_ref[...], tiles.load_key_meta(km_ref, anchors=anchors)
    gate = gate_ref[...] if gated else None
    slope = slope_ref[kh, hj] if alibi else None

    def body(i, acc):
        rows = pl.ds(pl.multiple_of(hj * tp + i * bq, bq), bq)
        qrows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        qm = tiles.load_query_meta(qm_ref, qrows, anchors=anchors)
        return acc + _colsum_tile(q_ref[rows, :], k, qm, km, gate, slope, lse_ref[rows, :], i * bq,
                                  q_start=q_start, scale=scale, window=window)

    out_ref[...] = jax.lax.fori_loop(q_from, nq, body, jnp.zeros((1, k.shape[0]), jnp.float32))


def _colsum_tpu_kernel(slope_ref, q_ref, lse_ref, qm_ref, k_ref, km_ref, gate_ref, out_ref, *, q_from, q_start, nq,
                       bq, scale, window, anchors, gated, alibi):
    kh, hj, i = pl.program_id(1), pl.program_id(2), pl.program_id(4)

    @pl.when(i == 0)
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(i >= q_from)
    def _():
        slope = slope_ref[kh, hj] if alibi else None
        out_ref[...] += _colsum_tile(q_ref[...], k_ref[...], tiles.load_query_meta(qm_ref, anchors=anchors),
                                     tiles.load_key_meta(km_ref, anchors=anchors), gate_ref[...] if gated else None,
                                     slope, lse_ref[...], i * bq, q_start=q_start, scale=scale, window=window)


@functools.partial(jax.jit, static_argnames=("scale", "alibi_on", "window", "variant", "interpret", "q_start",
                                             "block_q", "block_k"))
def _colsum(q, k, lse, q_pos, k_pos, alibi, anchors, key_keep, *, scale, alibi_on, window, variant, interpret,
            q_start, block_q, block_k):
    bq, bk = block_q, block_k
    qg, kp, _, qm, km, gate, slopes, dims = _inputs(q, k, k, q_pos, k_pos, alibi if alibi_on else None, anchors,
                                                    key_keep, bq, bk, variant)
    b, h, t, d, dp, kvh, s, g, tp, sp = dims
    nq, nk = tp // bq, sp // bk
    lse = tiles.pad_axis(lse.reshape(b, kvh, g, t), 3, tp, tiles.MASKED).reshape(b, kvh, g * tp, 1)
    flags = dict(q_from=q_start // bq, q_start=q_start, nq=nq, bq=bq, scale=scale, window=window,
                 anchors=anchors is not None, gated=key_keep is not None, alibi=alibi_on)
    out_shape = jax.ShapeDtypeStruct((b, kvh, g, 1, sp), jnp.float32)
    if variant == "gpu":
        col = pl.pallas_call(
            functools.partial(_colsum_gpu_kernel, tp=tp, **flags),
            grid=(b, kvh, g, nk),
            in_specs=[
                pl.BlockSpec(slopes.shape, lambda *_: (0, 0)),
                pl.BlockSpec((None, None, g * tp, dp), lambda b, kh, hj, j: (b, kh, 0, 0)),
                pl.BlockSpec((None, None, g * tp, 1), lambda b, kh, hj, j: (b, kh, 0, 0)),
                pl.BlockSpec((None, tp, tiles.QM), lambda b, kh, hj, j: (b, 0, 0)),
                pl.BlockSpec((None, None, bk, dp), lambda b, kh, hj, j: (b, kh, j, 0)),
                pl.BlockSpec((None, tiles.KM, bk), lambda b, kh, hj, j: (b, 0, j)),
                pl.BlockSpec((None, None, 1, bk), lambda b, kh, hj, j: (b, kh, 0, j)),
            ],
            out_specs=pl.BlockSpec((None, None, None, 1, bk), lambda b, kh, hj, j: (b, kh, hj, 0, j)),
            out_shape=out_shape,
            compiler_params=tiles.compiler_params(variant, 4, 0),
            interpret=tiles.interpret_mode(variant, interpret),
            name="kvjax_colsum_gpu",
        )(slopes, qg, lse, qm, kp, km, gate)
    else:
        col = pl.pallas_call(
            functools.partial(_colsum_tpu_kernel, **flags),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(b, kvh, g, nk, nq),
                in_specs=[
                    pl.BlockSpec((None, None, bq, dp), lambda b, kh, hj, j, i, _: (b, kh, hj * nq + i, 0)),
                    pl.BlockSpec((None, None, bq, 1), lambda b, kh, hj, j, i, _: (b, kh, hj * nq + i, 0)),
                    pl.BlockSpec((None, bq, tiles.QM), lambda b, kh, hj, j, i, _: (b, i, 0)),
                    pl.BlockSpec((None, None, bk, dp), lambda b, kh, hj, j, i, _: (b, kh, j, 0)),
                    pl.BlockSpec((None, tiles.KM, bk), lambda b, kh, hj, j, i, _: (b, 0, j)),
                    pl.BlockSpec((None, None, 1, bk), lambda b, kh, hj, j, i, _: (b, kh, 0, j)),
                ],
                out_specs=pl.BlockSpec((None, None, None, 1, bk), lambda b, kh, hj, j, i, _: (b, kh, hj, 0, j)),
            ),
            out_shape=out_shape,
            compiler_params=tiles.compiler_params(variant, 4, 1),
            interpret=tiles.interpret_mode(variant, interpret),
            name="kvjax_colsum_tpu",
        )(slopes, qg, lse, qm, kp, km, gate)
    return col[:, :, :, 0, :s]


def colsum(q, k, lse, q_pos, k_pos, *, scale, mask: Mask = CAUSAL, q_start=0, variant="gpu", interpret=False,
           block_q=None, block_k=None) -> Float[Array, "b kvh g s"]:
    """Each key's attention probability summed over the queries with index >= `q_start`, per
    query head, under `mask` (as `prefill_attention`'s); `lse` from `prefill_attention`. Query blocks before
    `q_start` are skipped."""
    blocks = resolve(PREFILL, variant, interpret, block_q, block_k)
    mask.only(("window", "alibi", "anchors", "key_keep"), "pallas colsum")
    _check(q, k, None, q_pos, k_pos, mask.key_keep, name="pallas colsum", lse=lse)
    return _colsum(q, k, lse, q_pos, k_pos, None if mask.alibi is None else jnp.asarray(mask.alibi), mask.anchors,
                   mask.key_keep, scale=scale, alibi_on=mask.alibi is not None, window=mask.window, variant=variant,
                   interpret=interpret, q_start=q_start, block_q=blocks.block_q, block_k=blocks.block_k)
