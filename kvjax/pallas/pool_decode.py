"""Decode attention over a pool of slots shared by a layer's KV heads (`kvjax.cache.PooledLayerCache`, AdaKV's
per-head budgets), GPU and TPU variants: each KV head reads only its own slots, so the work is the kept slots'.

Specification: `kvjax.reference.decode_attention` over the pool broadcast to every head with the other heads'
slots masked (`kvjax.layer._decode_pooled`'s reference path). A head's slots are two runs of the pool
(`PooledLayerCache.runs`: its kept prompt tokens, then its decode slots); the grid is `(b, kvh, splits)` as
`kvjax.pallas.decode`'s, and program `i` folds the `i`-th share of each run into an online softmax, a loop whose
trip count is read from the runs (not the pool's size); the shares are merged by log-sum-exp outside. Tiles may
start anywhere in the pool, so the pool is padded by one tile and each tile masks the slots outside its run.

TPU (Mosaic) variant: a tile must start at a multiple of its size there (the lanes of `pos`), so the grid is
`(b, kvh, j)` over the aligned tiles that cover the head's two runs, listed from a small scalar-prefetched table
(each run's first tile and tile count); tile `j` masks the slots outside the run it was listed for, the pipeline
skips the copy once `j` passes the head's tiles (the block index repeats), and the softmax is folded in VMEM
scratch across `j`.

Validated in interpret mode on the CPU (tests/test_pallas_pool.py); the TPU variant is compiled by libtpu for
v5e and v6e (tests/test_tpu_aot.py); neither has run on its hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kvjax.cache import PooledLayerCache
from kvjax.pallas import tiles
from kvjax.pallas.decode import GPU_PROGRAMS, GPU_STAGES, GPU_WARPS

BLOCK = 64  # GPU: slots per tile, a head's run read in tiles of this size from the run's first slot
TPU_BLOCK = 128  # TPU: slots per aligned tile (the lanes of a vector register)


def _kernel(runs_ref, q_ref, k_ref, v_ref, pos_ref, o_ref, m_ref, l_ref, *, bk, splits, scale):
    """One (row, KV head, split): its share of each of the head's two runs of slots."""
    i = pl.program_id(2)
    q = q_ref[...]
    carry = tiles.online_init(*q.shape)
    for r in range(2):
        start, length = runs_ref[r, 0], runs_ref[r, 1]
        share = (length + splits - 1) // splits
        lo = start + i * share
        hi = jnp.minimum(start + length, lo + share)  # this split's slots of the run: lo .. hi - 1

        def body(j, carry, lo=lo, hi=hi):
            first = lo + j * bk
            sl = pl.ds(first, bk)
            idx = first + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            ok = (idx < hi) & (pos_ref[:, sl] >= 0)
            s = jnp.where(ok, tiles.qk(q, k_ref[sl, :]) * scale, tiles.MASKED)
            return tiles.online_step(carry, s, v_ref[sl, :])

        carry = jax.lax.fori_loop(0, (jnp.maximum(hi - lo, 0) + bk - 1) // bk, body, carry)
    m, l, acc = carry
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def attend(q: Float[Array, "b h d"], cache: PooledLayerCache, *, scale: float, variant: str = "gpu",
           interpret: bool = False, splits: int | None = None) -> Float[Array, "b h d"]:
    """Each KV head's queries (`q`, rotated) over that head's slots of the pool: `[b, h, d]`. `splits` (GPU):
    shares of each run per (row, KV head), merged after the kernel."""
    if variant == "tpu":
        if splits is not None:
            raise ValueError(f"pool_decode.attend: splits={splits} is a GPU option; the TPU variant has none")
        return _attend_tpu(q, cache, scale=scale, interpret=interpret)
    if variant != "gpu":
        raise ValueError(f"pool_decode.attend: variant={variant!r}; expected 'gpu' or 'tpu'")
    return _attend_gpu(q, cache, scale=scale, interpret=interpret, splits=splits)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "splits"))
def _attend_gpu(q, cache: PooledLayerCache, *, scale, interpret, splits):
    b, h, d = q.shape
    kvh = cache.num_kv_heads
    g = h // kvh
    bk = BLOCK
    dp = tiles.gpu_head_dim(d)
    gp = max(16, tiles.next_pow2(g))
    splits = splits or max(1, tiles.next_pow2(-(-GPU_PROGRAMS // (b * kvh))))
    p = cache.capacity
    pp = tiles.round_up(p, bk) + bk  # a tile may start at any slot of a run: one tile of padding after the pool
    qg = tiles.pad_axis(tiles.pad_axis(q.reshape(b, kvh, g, d), 3, dp), 2, gp)
    k = tiles.pad_axis(tiles.pad_axis(cache.k, 2, dp), 1, pp)
    v = tiles.pad_axis(tiles.pad_axis(cache.v, 2, dp), 1, pp)
    pos = tiles.pad_axis(cache.pos, 1, pp, -1)[:, None]  # [b, 1, pp]
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, bk=bk, splits=splits, scale=scale),
        grid=(b, kvh, splits),
        in_specs=[pl.BlockSpec((None, None, 2, 2), lambda b, kh, i: (b, kh, 0, 0)),
                  pl.BlockSpec((None, None, gp, dp), lambda b, kh, i: (b, kh, 0, 0)),
                  pl.BlockSpec((None, pp, dp), lambda b, kh, i: (b, 0, 0)),
                  pl.BlockSpec((None, pp, dp), lambda b, kh, i: (b, 0, 0)),
                  pl.BlockSpec((None, 1, pp), lambda b, kh, i: (b, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, None, gp, dp), lambda b, kh, i: (b, kh, i, 0, 0)),
                   pl.BlockSpec((None, None, None, gp, 1), lambda b, kh, i: (b, kh, i, 0, 0)),
                   pl.BlockSpec((None, None, None, gp, 1), lambda b, kh, i: (b, kh, i, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits, gp, dp), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gp, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, gp, 1), jnp.float32)],
        compiler_params=tiles.compiler_params("gpu", 3, 0, num_warps=GPU_WARPS, num_stages=GPU_STAGES),
        interpret=tiles.interpret_mode("gpu", interpret),
        name="kvjax_pool_decode_gpu",
    )(cache.runs(), qg, k, v, pos)
    # merge the splits (flash-decoding's reduction)
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all) * (l > 0)
    out, _ = tiles.online_finish(m_all[:, :, 0], jnp.sum(w * l, axis=2), jnp.sum(w * o, axis=2))
    return out[:, :, :g, :d].reshape(b, h, d).astype(q.dtype)


# the TPU table's columns, per (row, KV head): each run's first slot and length, first tile and tile count
S0, L0, F0, N0, S1, L1, F1, N1 = range(8)


def _tile_table(runs: Int[Array, "b kvh 2 2"], bk: int) -> Int[Array, "b kvh 8"]:
    start, length = runs[..., 0], runs[..., 1]  # [b, kvh, 2]
    first = start // bk
    count = jnp.where(length > 0, (start + length - 1) // bk - first + 1, 0)
    cols = [start[..., 0], length[..., 0], first[..., 0], count[..., 0],
            start[..., 1], length[..., 1], first[..., 1], count[..., 1]]
    return jnp.stack(cols, -1).astype(jnp.int32)


def _tpu_tile(b, kh, j, tab):
    """The pool tile grid step `j` reads: the first run's tiles, then the second's, then the last one again (the
    first run's last, or tile 0, when the second run is empty), so the index never leaves the pool."""
    in_first = j < tab[b, kh, N0]
    later = tab[b, kh, F1] + jnp.minimum(j - tab[b, kh, N0], jnp.maximum(tab[b, kh, N1] - 1, 0))
    last_first = tab[b, kh, F0] + jnp.maximum(tab[b, kh, N0] - 1, 0)
    later = jnp.where(tab[b, kh, N1] > 0, later, jnp.where(tab[b, kh, N0] > 0, last_first, 0))
    return jnp.where(in_first, tab[b, kh, F0] + j, later)


def _tpu_kernel(tab_ref, q_ref, k_ref, v_ref, pos_ref, o_ref, m_scr, l_scr, acc_scr, *, bk, nj, scale):
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_scr[...], l_scr[...], acc_scr[...] = tiles.online_init(*acc_scr.shape)

    @pl.when(j < tab_ref[b, kh, N0] + tab_ref[b, kh, N1])
    def _():
        in_first = j < tab_ref[b, kh, N0]
        start = jnp.where(in_first, tab_ref[b, kh, S0], tab_ref[b, kh, S1])
        end = start + jnp.where(in_first, tab_ref[b, kh, L0], tab_ref[b, kh, L1])
        idx = _tpu_tile(b, kh, j, tab_ref) * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        ok = (idx >= start) & (idx < end) & (pos_ref[...] >= 0)
        s = jnp.where(ok, tiles.qk(q_ref[...], k_ref[...]) * scale, tiles.MASKED)
        m_scr[...], l_scr[...], acc_scr[...] = tiles.online_step((m_scr[...], l_scr[...], acc_scr[...]), s, v_ref[...])

    @pl.when(j == nj - 1)
    def _():
        o_ref[...] = tiles.online_finish(m_scr[...], l_scr[...], acc_scr[...])[0]


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _attend_tpu(q, cache: PooledLayerCache, *, scale, interpret):
    b, h, d = q.shape
    kvh = cache.num_kv_heads
    g = h // kvh
    bk = TPU_BLOCK
    gp = tiles.round_up(g, 8)
    pp = tiles.round_up(cache.capacity, bk)
    # a head's tiles: its prompt run's (all prompt slots at most) and its decode run's, each one more if unaligned
    nj = -(-cache.prompt_slots // bk) + 1 + -(-cache.room // bk) + 1
    qg = tiles.pad_axis(q.reshape(b, kvh, g, d), 2, gp)
    k, v = tiles.pad_axis(cache.k, 1, pp), tiles.pad_axis(cache.v, 1, pp)
    pos = tiles.pad_axis(cache.pos, 1, pp, -1)[:, None]  # [b, 1, pp]
    tile = lambda b, kh, j, tab: _tpu_tile(b, kh, j, tab)  # noqa: E731
    o = pl.pallas_call(
        functools.partial(_tpu_kernel, bk=bk, nj=nj, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, kvh, nj),
            in_specs=[pl.BlockSpec((None, None, gp, d), lambda b, kh, j, tab: (b, kh, 0, 0)),
                      pl.BlockSpec((None, bk, d), lambda b, kh, j, tab: (b, tile(b, kh, j, tab), 0)),
                      pl.BlockSpec((None, bk, d), lambda b, kh, j, tab: (b, tile(b, kh, j, tab), 0)),
                      pl.BlockSpec((None, 1, bk), lambda b, kh, j, tab: (b, 0, tile(b, kh, j, tab)))],
            out_specs=pl.BlockSpec((None, None, gp, d), lambda b, kh, j, tab: (b, kh, 0, 0)),
            scratch_shapes=[pltpu.VMEM((gp, 1), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                            pltpu.VMEM((gp, d), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, kvh, gp, d), jnp.float32),
        compiler_params=tiles.compiler_params("tpu", 2, 1),
        interpret=tiles.interpret_mode("tpu", interpret),
        name="kvjax_pool_decode_tpu",
    )(_tile_table(cache.runs(), bk), qg, k, v, pos)
    return o[:, :, :g].reshape(b, h, d).astype(q.dtype)


__all__ = ["BLOCK", "TPU_BLOCK", "attend"]
