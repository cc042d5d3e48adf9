"""Decode attention over a pool of slots shared by a layer's KV heads (`kvjax.cache.PooledLayerCache`, AdaKV's
per-head budgets), GPU variant: each KV head reads only its own slots, so the work is the kept slots'.

Specification: `kvjax.reference.decode_attention` over the pool broadcast to every head with the other heads'
slots masked (`kvjax.layer._decode_pooled`'s reference path). A head's slots are two runs of the pool
(`PooledLayerCache.runs`: its kept prompt tokens, then its decode slots); the grid is `(b, kvh, splits)` as
`kvjax.pallas.decode`'s, and program `i` folds the `i`-th share of each run into an online softmax, a loop whose
trip count is read from the runs (not the pool's size); the shares are merged by log-sum-exp outside. Tiles may
start anywhere in the pool, so the pool is padded by one tile and each tile masks the slots outside its run.
Validated in interpret mode on the CPU (tests/test_pallas_pool.py); not yet compiled by Triton on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from kvjax.cache import PooledLayerCache
from kvjax.pallas import tiles
from kvjax.pallas.decode import GPU_PROGRAMS, GPU_STAGES, GPU_WARPS

BLOCK = 64  # slots per tile: a head's run is read in tiles of this size, starting at the run's first slot


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


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "splits"))
def attend(q: Float[Array, "b h d"], cache: PooledLayerCache, *, scale: float, interpret: bool = False,
           splits: int | None = None) -> Float[Array, "b h d"]:
    """Each KV head's queries (`q`, rotated) over that head's slots of the pool: `[b, h, d]`."""
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


__all__ = ["BLOCK", "attend"]
