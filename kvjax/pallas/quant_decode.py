"""Decode attention that reads a quantized cache's codes (`kvjax.quant`) in a Pallas kernel, GPU and TPU variants.

Specification: `kvjax.quant.attend` (the jnp reference, 512 slots dequantized at a time), same arguments and
outputs. The kernel streams the codes and their scales and dequantizes each tile in registers, so the bytes it
reads fall with the bit width; everything a slot reads from elsewhere than its codes (the current token, the
full-precision residual of KIVI's R most recent tokens) is attended in jnp from those small arrays and merged
with the kernel's partial softmax by log-sum-exp, as flash-decoding merges its splits.

Layout inside the kernel. KIVI packs `8 / bits` codes per byte along the channels (channel `per * i + t` in
bits `t * bits` of byte `i`), so the kernel works on `per` channel planes of `d / per` columns: plane `t` of a
tile is `(byte >> t * bits) & mask`, the query and the keys' per-channel scales are split into the same planes
outside the kernel, and the output planes are interleaved back after it. Keys are dequantized one key group
(`G` slots, one scale and zero row) per tile; a value's scale and zero (one per `G` channels) are spread over a
tile's columns with column masks (Triton lowers no value slicing). int8 is one plane with a scale per slot.

Grid `(b, kvh, splits)` as `kvjax.pallas.decode`. Triton needs power-of-two tiles of at least 16: `d / per`
and (KIVI) `G` must be; `supported` says whether a cache qualifies, and callers fall back to the reference
otherwise. Inference only. Validated in interpret mode on the CPU (tests/test_pallas_quant.py); its Triton
compilation is exercised on a GPU by `bash benchmarks/gpu.sh`.

TPU (Mosaic) variant: grid `(b, kvh, nk)`, one tile of a multiple of `lcm(128, G)` slots a step (`tpu_tile`), the
softmax folded in VMEM scratch across steps. Codes are widened to int32 before their planes are shifted out; the
key scales and zeros are laid out tile by tile outside the kernel (`[nk, tile groups x planes, d / per]`, a
block equal to the array's last two dimensions, as Mosaic requires), and each key group's row is broadcast over
its G slots inside; int8 tiles are up to 512 slots. KIVI groups of a multiple of 8 slots compile (`supported(...,
variant="tpu")`); compiled by libtpu for v5e and v6e (tests/test_tpu_aot.py), never run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import math

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kvjax.pallas import tiles
from kvjax.pallas.decode import GPU_PROGRAMS, GPU_STAGES, GPU_WARPS
from kvjax.quant import QuantizedLayerCache, _residual_hit

BLOCK_INT8 = 128  # slots per tile for int8 codes (the 16-bit kernel's tile); KIVI tiles are one key group


def _pow2_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supported(qc: QuantizedLayerCache, head_dim: int, interpret: bool = False, variant: str = "gpu") -> bool:
    """Whether the kernel takes this cache. GPU: Triton's power-of-two tiles of at least 16 (channel planes of
    `d / per` columns; KIVI's key groups of G slots); TPU: key groups of a multiple of 8 slots (whole sublane
    tiles of the broadcast scales). In interpret mode any size runs."""
    s = qc.spec
    per = 8 // s.bits if s.kivi else 1
    if s.kivi and s.group % per:  # a value's channel group must be whole columns of every plane
        return False
    if interpret:
        return True
    if variant == "tpu":
        return not s.kivi or s.group % 8 == 0
    return _pow2_16(head_dim // per) and (not s.kivi or _pow2_16(s.group))


def _kernel(q_ref, pos_ref, lw_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref, *s_ref,
            bk, per, bits, vgroup_cols, v_groups, scale):
    """One (row, KV head, split): the split's tiles folded into an online softmax over `per` output planes."""
    mask = (1 << bits) - 1 if per > 1 else None
    gp, dp = q_ref.shape[1], q_ref.shape[2]
    col_group = jax.lax.broadcasted_iota(jnp.int32, (1, dp), 1) // vgroup_cols if per > 1 else None

    def plane(codes, t):
        return ((codes >> (t * bits)) & mask).astype(jnp.float32)

    def spread(ref, sl):
        """A value's per-(slot, channel group) scale or zero over the tile's columns: `[bk, dp]`."""
        out = jnp.zeros((bk, dp), jnp.float32)
        for gamma in range(v_groups):
            out = jnp.where(col_group == gamma, ref[sl, gamma:gamma + 1].astype(jnp.float32), out)
        return out

    def body(j, carry):
        m, l, acc = carry
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        codes = kc_ref[sl, :]
        if per == 1:  # int8: one plane, a scale per slot
            k = codes.astype(jnp.float32) * ks_ref[sl, :].astype(jnp.float32)
            s = tiles.qk(q_ref[0].astype(jnp.float32), k)
        else:  # KIVI keys: the tile is one key group, one scale and zero row per plane
            s = jnp.zeros((gp, bk), jnp.float32)
            for t in range(per):
                k = kz_ref[t, pl.ds(j, 1), :].astype(jnp.float32) + ks_ref[t, pl.ds(j, 1), :].astype(
                    jnp.float32) * plane(codes, t)
                s = s + tiles.qk(q_ref[t].astype(jnp.float32), k)
        s = jnp.where(pos_ref[:, sl] >= 0, s * scale + lw_ref[:, sl], tiles.MASKED)
        if s_ref:
            s_ref[0][:, sl] = s
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        vcodes = vc_ref[sl, :]
        if per == 1:
            vs = [vcodes.astype(jnp.float32) * vs_ref[sl, :].astype(jnp.float32)]
        else:
            vsc, vzr = spread(vs_ref, sl), spread(vz_ref, sl)
            vs = [vzr + vsc * plane(vcodes, t) for t in range(per)]
        acc = tuple(alpha * a + tiles.matmul(p, v, (1, 0)) for a, v in zip(acc, vs))
        return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), acc

    init = (jnp.full((gp, 1), tiles.MASKED, jnp.float32), jnp.zeros((gp, 1), jnp.float32),
            tuple(jnp.zeros((gp, dp), jnp.float32) for _ in range(per)))
    m, l, acc = jax.lax.fori_loop(0, kc_ref.shape[0] // bk, body, init)
    for t in range(per):
        o_ref[t] = acc[t]
    m_ref[...], l_ref[...] = m, l


def _dims(q, qc: QuantizedLayerCache):
    """`(b, d, kvh, C, g, per, d / per)`: the query's and cache's sizes, the group, and the channel planes (`per`
    codes to a byte; int8: one plane)."""
    b, h, d = q.shape
    kvh, c = qc.pos.shape[1:]
    per = 8 // qc.spec.bits if qc.spec.kivi else 1
    return b, d, kvh, c, h // kvh, per, d // per


def _padded(qc: QuantizedLayerCache, pos_codes, cp: int):
    """The operands both variants read, padded to `cp` slots: positions and biases as rows `[b, kvh, 1, cp]`, the
    key and value codes, and the scales and zeros: int8's per slot as columns `[b, kvh, cp, 1]` (no zero point:
    the scales stand in, unread); KIVI's values' `[b, kvh, cp, d / G]` (its keys' are laid out by each variant)."""
    pad = lambda x, value=0: tiles.pad_axis(x, 2, cp, value)  # noqa: E731
    pos, lw = pad(pos_codes, -1)[:, :, None], pad(qc.log_w.astype(jnp.float32))[:, :, None]
    if qc.spec.kivi:
        ks = kz = None
        vs, vz = pad(qc.v_scale), pad(qc.v_zero)
    else:
        ks, vs = pad(qc.k_scale)[..., None], pad(qc.v_scale)[..., None]
        kz, vz = ks, vs
    return pos, lw, pad(qc.k_codes), pad(qc.v_codes), ks, kz, vs, vz


@functools.partial(jax.jit, static_argnames=("scale", "logits", "interpret", "splits"))
def _codes_partials(q, qc: QuantizedLayerCache, pos_codes, *, scale, logits, interpret, splits):
    """The kernel over the codes of the slots `pos_codes >= 0`: merged `(m, l [b, kvh, g, 1], acc [b, kvh, g, d])`
    and, with `logits`, the tile logits `[b, kvh, g, C]` (log_w included, MASKED elsewhere)."""
    s = qc.spec
    b, d, kvh, c, g, per, dp = _dims(q, qc)
    bk = s.group if s.kivi else BLOCK_INT8
    gp = max(16, tiles.next_pow2(g))
    nblocks = -(-c // bk)
    splits = max(1, min(nblocks, splits or tiles.next_pow2(-(-GPU_PROGRAMS // (b * kvh)))))
    cp = tiles.round_up(c, bk * splits)
    cs = cp // splits
    # the query in channel planes: channel per * i + t -> plane t, column i
    qp = q.reshape(b, kvh, g, dp, per).transpose(0, 1, 4, 2, 3)
    qp = tiles.pad_axis(qp, 3, gp)  # [b, kvh, per, gp, dp]
    pos, lw, kc, vc, ks, kz, vs, vz = _padded(qc, pos_codes, cp)
    if s.kivi:
        ng = cp // bk
        planes = lambda x: tiles.pad_axis(x, 2, ng).reshape(b, kvh, ng, dp, per).transpose(0, 1, 4, 2, 3)  # noqa: E731
        ks, kz = planes(qc.k_scale), planes(qc.k_zero)  # [b, kvh, per, ng, dp]
        k_spec = pl.BlockSpec((None, None, per, cs // bk, dp), lambda b, kh, i: (b, kh, 0, i, 0))
        v_spec = pl.BlockSpec((None, None, cs, d // s.group), lambda b, kh, i: (b, kh, i, 0))
    else:
        k_spec = v_spec = pl.BlockSpec((None, None, cs, 1), lambda b, kh, i: (b, kh, i, 0))
    code_spec = pl.BlockSpec((None, None, cs, dp), lambda b, kh, i: (b, kh, i, 0))
    row_spec = pl.BlockSpec((None, None, 1, cs), lambda b, kh, i: (b, kh, 0, i))
    s_shape = [jax.ShapeDtypeStruct((b, kvh, gp, cp), jnp.float32)] if logits else []
    o, m, l, *s_out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, per=per, bits=s.bits, vgroup_cols=(s.group // per) if s.kivi else 1,
                          v_groups=(d // s.group) if s.kivi else 0, scale=scale),
        grid=(b, kvh, splits),
        in_specs=[pl.BlockSpec((None, None, per, gp, dp), lambda b, kh, i: (b, kh, 0, 0, 0)), row_spec, row_spec,
                  code_spec, k_spec, k_spec, code_spec, v_spec, v_spec],
        out_specs=[pl.BlockSpec((None, None, None, per, gp, dp), lambda b, kh, i: (b, kh, i, 0, 0, 0)),
                   pl.BlockSpec((None, None, None, gp, 1), lambda b, kh, i: (b, kh, i, 0, 0)),
                   pl.BlockSpec((None, None, None, gp, 1), lambda b, kh, i: (b, kh, i, 0, 0))]
                  + [pl.BlockSpec((None, None, gp, cs), lambda b, kh, i: (b, kh, 0, i))] * logits,
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits, per, gp, dp), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gp, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gp, 1), jnp.float32)] + s_shape,
        compiler_params=tiles.compiler_params("gpu", 3, 0, num_warps=GPU_WARPS, num_stages=GPU_STAGES),
        interpret=tiles.interpret_mode("gpu", interpret),
        name="kvjax_quant_decode_gpu",
    )(qp, pos, lw, kc, ks, kz, vc, vs, vz)
    # merge the splits (flash-decoding's reduction), then the planes back to channels
    m_all = jnp.max(m, axis=2)  # [b, kvh, gp, 1]
    w = jnp.exp(m - m_all[:, :, None]) * (l > 0)
    l_all = jnp.sum(w * l, axis=2)
    acc = jnp.sum(w[:, :, :, None] * o, axis=2)  # [b, kvh, per, gp, dp]
    acc = acc.transpose(0, 1, 3, 4, 2).reshape(b, kvh, gp, d)  # column i of plane t -> channel per * i + t
    return m_all[:, :, :g], l_all[:, :, :g], acc[:, :, :g], (s_out[0][:, :, :g, :c] if logits else None)


def tpu_tile(qc: QuantizedLayerCache) -> int:
    """Slots per TPU tile: a multiple of 128 (the lanes of `pos`) holding whole key groups (KIVI), the largest of
    4, 2 or 1 such units (512 slots at most for int8) that divides the cache, so its codes are not padded (a copy
    of all of them at every step); else the largest, padded."""
    unit = math.lcm(128, qc.spec.group) if qc.spec.kivi else 128
    sizes = [m * unit for m in (4, 2, 1) if m * unit <= max(512, unit)]
    return tiles.dividing(qc.capacity, sizes) or sizes[0]


def _tpu_kernel(q_ref, pos_ref, lw_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref, *rest,
                bk, per, bits, group, vgroup_cols, v_groups, scale, nk):
    *s_ref, m_scr, l_scr, acc_scr = rest
    j = pl.program_id(2)
    dp = q_ref.shape[2]
    mask = (1 << bits) - 1

    @pl.when(j == 0)
    def _():
        m_scr[...] = jnp.full(m_scr.shape, tiles.MASKED, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    codes = kc_ref[...].astype(jnp.int32)  # [bk, dp]
    if per == 1:  # int8: one plane, a scale per slot
        k = codes.astype(jnp.float32) * ks_ref[...].astype(jnp.float32)
        s = tiles.qk(q_ref[0].astype(jnp.float32), k)
    else:  # KIVI keys: each key group's scale and zero row (row g * per + t of the tile's table) over its G slots
        s = 0.0
        for t in range(per):
            rows = lambda ref: jnp.concatenate(  # noqa: E731
                [jnp.broadcast_to(ref[g * per + t: g * per + t + 1, :].astype(jnp.float32), (group, dp))
                 for g in range(bk // group)], axis=0)
            k = rows(kz_ref) + rows(ks_ref) * ((codes >> (t * bits)) & mask).astype(jnp.float32)
            s = s + tiles.qk(q_ref[t].astype(jnp.float32), k)
    s = jnp.where(pos_ref[...] >= 0, s * scale + lw_ref[...], tiles.MASKED)
    if s_ref:
        s_ref[0][...] = s
    m = m_scr[...]
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    vcodes = vc_ref[...].astype(jnp.int32)
    if per == 1:
        vs = [vcodes.astype(jnp.float32) * vs_ref[...].astype(jnp.float32)]
    else:
        col_group = jax.lax.broadcasted_iota(jnp.int32, (1, dp), 1) // vgroup_cols

        def spread(ref):
            out = jnp.zeros((bk, dp), jnp.float32)
            for gamma in range(v_groups):
                out = jnp.where(col_group == gamma, ref[:, gamma:gamma + 1].astype(jnp.float32), out)
            return out

        vsc, vzr = spread(vs_ref), spread(vz_ref)
        vs = [vzr + vsc * ((vcodes >> (t * bits)) & mask).astype(jnp.float32) for t in range(per)]
    for t in range(per):
        acc_scr[t] = alpha * acc_scr[t] + tiles.matmul(p, vs[t], (1, 0))
    m_scr[...], l_scr[...] = m_new, alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)

    @pl.when(j == nk - 1)
    def _():
        o_ref[...], m_ref[...], l_ref[...] = acc_scr[...], m_scr[...], l_scr[...]


@functools.partial(jax.jit, static_argnames=("scale", "logits", "interpret"))
def _codes_partials_tpu(q, qc: QuantizedLayerCache, pos_codes, *, scale, logits, interpret):
    """`_codes_partials` by the TPU kernel: merged `(m, l [b, kvh, g, 1], acc [b, kvh, g, d])`, logits or None."""
    s = qc.spec
    b, d, kvh, c, g, per, dp = _dims(q, qc)
    bk = tpu_tile(qc)
    gp = tiles.round_up(g, 8)
    cp = tiles.round_up(c, bk)
    nk = cp // bk
    qp = tiles.pad_axis(q.reshape(b, kvh, g, dp, per).transpose(0, 1, 4, 2, 3), 3, gp)  # [b, kvh, per, gp, dp]
    pos, lw, kc, vc, ks, kz, vs, vz = _padded(qc, pos_codes, cp)
    if s.kivi:
        tg = bk // s.group  # key groups per tile
        # [b, kvh, groups, d] -> per tile, row g * per + t: group g's scales of plane t's channels
        table = lambda x: tiles.pad_axis(x, 2, nk * tg).reshape(b, kvh, nk, tg, dp, per).transpose(  # noqa: E731
            0, 1, 2, 3, 5, 4).reshape(b, kvh, nk, tg * per, dp)
        ks, kz = table(qc.k_scale), table(qc.k_zero)
        k_spec = pl.BlockSpec((None, None, None, tg * per, dp), lambda b, kh, j: (b, kh, j, 0, 0))
        v_spec = pl.BlockSpec((None, None, bk, d // s.group), lambda b, kh, j: (b, kh, j, 0))
    else:
        k_spec = v_spec = pl.BlockSpec((None, None, bk, 1), lambda b, kh, j: (b, kh, j, 0))
    code_spec = pl.BlockSpec((None, None, bk, dp), lambda b, kh, j: (b, kh, j, 0))
    row_spec = pl.BlockSpec((None, None, 1, bk), lambda b, kh, j: (b, kh, 0, j))
    o, m, l, *s_out = pl.pallas_call(
        functools.partial(_tpu_kernel, bk=bk, per=per, bits=s.bits, group=s.group or 1,
                          vgroup_cols=(s.group // per) if s.kivi else 1, v_groups=(d // s.group) if s.kivi else 0,
                          scale=scale, nk=nk),
        grid=(b, kvh, nk),
        in_specs=[pl.BlockSpec((None, None, per, gp, dp), lambda b, kh, j: (b, kh, 0, 0, 0)), row_spec, row_spec,
                  code_spec, k_spec, k_spec, code_spec, v_spec, v_spec],
        out_specs=[pl.BlockSpec((None, None, per, gp, dp), lambda b, kh, j: (b, kh, 0, 0, 0)),
                   pl.BlockSpec((None, None, gp, 1), lambda b, kh, j: (b, kh, 0, 0)),
                   pl.BlockSpec((None, None, gp, 1), lambda b, kh, j: (b, kh, 0, 0))]
                  + [pl.BlockSpec((None, None, gp, bk), lambda b, kh, j: (b, kh, 0, j))] * logits,
        out_shape=[jax.ShapeDtypeStruct((b, kvh, per, gp, dp), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, gp, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, gp, 1), jnp.float32)]
                  + [jax.ShapeDtypeStruct((b, kvh, gp, cp), jnp.float32)] * logits,
        scratch_shapes=[pltpu.VMEM((gp, 1), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                        pltpu.VMEM((per, gp, dp), jnp.float32)],
        compiler_params=tiles.compiler_params("tpu", 2, 1),
        interpret=tiles.interpret_mode("tpu", interpret),
        name="kvjax_quant_decode_tpu",
    )(qp, pos, lw, kc, ks, kz, vc, vs, vz)
    acc = o.transpose(0, 1, 3, 4, 2).reshape(b, kvh, gp, d)  # column i of plane t -> channel per * i + t
    return m[:, :, :g], l[:, :, :g], acc[:, :, :g], (s_out[0][:, :, :g, :c] if logits else None)


def attend(q: Float[Array, "b h d"], qc: QuantizedLayerCache, newest: Int[Array, "b"], current, *,
           scale: float, probs: bool = False, first_logit: bool = False, variant: str = "gpu",
           interpret: bool = False, splits: int | None = None):
    """`kvjax.quant.attend` with the codes read by the kernel: `(output [b, h, d], probs [b, kvh, C] | None,
    first_logit [b, kvh, g] | None)`."""
    from kvjax.reference import _MASKED

    spec = qc.spec
    b, h, d = q.shape
    kvh, c = qc.pos.shape[1:]
    g = h // kvh
    if variant == "tpu" and splits is not None:
        raise ValueError(f"pallas quantized decode: splits={splits} is a GPU option; the TPU variant has none")
    if not supported(qc, d, interpret, variant):
        need = ("Triton's powers of two >= 16 (planes of d / per columns, key groups of G slots)" if variant == "gpu"
                else "key groups of a multiple of 8 slots")
        raise ValueError(f"pallas quantized decode: head size {d} with {spec.describe()} gives tiles the {variant} "
                         f"kernel cannot take ({need}); use kvjax.quant.attend")
    qg = q.reshape(b, kvh, g, d).astype(jnp.float32)
    dot = lambda x: jnp.einsum("bkgd,bk...d->bkg...", qg, x.astype(jnp.float32)) * scale  # noqa: E731
    valid = qc.pos >= 0
    now = valid & (qc.pos == newest[:, None, None])
    elsewhere_logit = jnp.where(now[:, :, None], dot(current[0])[..., None], _MASKED)  # [b, kvh, g, C]
    elsewhere = now
    if spec.residual:
        hit, ring = _residual_hit(qc, qc.pos, newest)
        hit &= ~now
        res_logit = dot(qc.res_k)  # [b, kvh, g, R]
        from_res = jnp.take_along_axis(res_logit, jnp.broadcast_to(ring[:, :, None], elsewhere_logit.shape), axis=3)
        elsewhere_logit = jnp.where(hit[:, :, None], from_res, elsewhere_logit)
        elsewhere = now | hit
    e_s = jnp.where(elsewhere[:, :, None], elsewhere_logit + qc.log_w[:, :, None], _MASKED)
    pos_codes = jnp.where(elsewhere, -1, qc.pos)
    if variant == "tpu":
        m_c, l_c, acc_c, s_codes = _codes_partials_tpu(q, qc, pos_codes, scale=scale, logits=probs or first_logit,
                                                       interpret=interpret)
    else:
        m_c, l_c, acc_c, s_codes = _codes_partials(q, qc, pos_codes, scale=scale, logits=probs or first_logit,
                                                   interpret=interpret, splits=splits)
    # the slots read elsewhere, as one more partial softmax
    m_e = jnp.max(e_s, axis=-1, keepdims=True)
    p_e = jnp.where(elsewhere[:, :, None], jnp.exp(e_s - m_e), 0.0)
    l_e = jnp.sum(p_e, axis=-1, keepdims=True)
    acc_e = jnp.sum(jnp.where(now[:, :, None], p_e, 0.0), axis=-1)[..., None] * current[1][:, :, None].astype(
        jnp.float32)
    if spec.residual:
        r = spec.residual
        bins = jnp.where(hit, ring, r)[:, :, None, :]
        p_res = jnp.zeros((b, kvh, g, r), jnp.float32).at[
            jnp.arange(b)[:, None, None, None], jnp.arange(kvh)[None, :, None, None],
            jnp.arange(g)[None, None, :, None], jnp.broadcast_to(bins, p_e.shape)].add(p_e, mode="drop")
        acc_e = acc_e + jnp.einsum("bkgr,bkrd->bkgd", p_res, qc.res_v.astype(jnp.float32))
    m = jnp.maximum(m_c, m_e)
    w_c, w_e = jnp.exp(m_c - m) * (l_c > 0), jnp.exp(m_e - m) * (l_e > 0)
    l_all = w_c * l_c + w_e * l_e
    out, lse = tiles.online_finish(m, l_all, w_c * acc_c + w_e * acc_e)
    out = out.reshape(b, h, d).astype(q.dtype)
    if not (probs or first_logit):
        return out, None, None
    s_all = jnp.where(elsewhere[:, :, None], e_s, s_codes)
    p_out = jnp.sum(jnp.exp(s_all - lse), axis=2) if probs else None
    first = None
    if first_logit:
        raw = s_all - qc.log_w[:, :, None]
        first = jnp.max(jnp.where((valid & (qc.pos == 0))[:, :, None], raw, _MASKED), axis=-1)
    return out, p_out, first


__all__ = ["BLOCK_INT8", "attend", "supported", "tpu_tile"]
