"""Tile math shared by the Pallas kernels and their block tables, in plain jnp.

Every kernel works on tiles of queries `[bq, d]` against keys `[bk, d]` and folds
them into FlashAttention's online softmax (running max `m`, denominator `l`,
unnormalised output `acc`). Which keys a query sees comes from per-token int32
metadata, through the rules of `kvjax.masks` (the spec the jnp reference `kvjax.reference` uses too):

* query metadata `qm [t, 4]`: position (-1 on padding), AnLLM segment, is-anchor, unused;
* key metadata `km [4, s]`: position, segment, is-anchor, keep (AnLLM's kept span);
* optional per-KV-head `gate [1, s]`: Attention-Gate's key keep-mask (the diagonal is always kept).

Queries run down the sublanes and keys along the lanes, the layout both Triton and
Mosaic want for `q @ k.T`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from kvjax import masks

MASKED = masks.MASKED  # finite, so a fully masked tile never makes NaN
QM, KM = 4, 4  # metadata columns / rows

POS, SEG, ANCHOR, KEEP = 0, 1, 2, 3


def precision(a, b):
    """The matmul precision for these operands: f32 operands multiply in full f32 (Triton would otherwise pick
    TF32, ~1e-3 off the reference, and Mosaic a bf16 pass); half-precision operands take the default, the only
    one Mosaic accepts for them (`contract_precision<fp32>` on bf16 operands fails libtpu's compile)."""
    wide = jnp.dtype(a.dtype) == jnp.float32 and jnp.dtype(b.dtype) == jnp.float32
    return jax.lax.Precision.HIGHEST if wide else None


def matmul(a, b, contract: tuple[int, int]) -> Array:
    """`a @ b` contracting axis `contract[0]` of `a` with `contract[1]` of `b`, accumulated in f32."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision(a, b),
                               preferred_element_type=jnp.float32)


def qk(q: Float[Array, "m d"], k: Float[Array, "n d"]) -> Float[Array, "m n"]:
    return matmul(q, k, (1, 1))


class QueryMeta(NamedTuple):
    """One query tile's metadata, each `[bq, 1]` (segment / anchor None without AnLLM)."""

    pos: Int[Array, "bq 1"]
    seg: Int[Array, "bq 1"] | None
    anchor: Int[Array, "bq 1"] | None


class KeyMeta(NamedTuple):
    """One key tile's metadata, each `[1, bk]`."""

    pos: Int[Array, "1 bk"]
    seg: Int[Array, "1 bk"] | None
    anchor: Int[Array, "1 bk"] | None
    keep: Int[Array, "1 bk"] | None


# Columns are loaded from the refs one by one rather than sliced out of a loaded
# `[bq, 4]` value: Triton has no lowering for slicing a value, only for strided loads.
def load_query_meta(qm_ref, rows=slice(None), *, anchors: bool) -> QueryMeta:
    col = lambda c: qm_ref[rows, c : c + 1]  # noqa: E731
    return QueryMeta(col(POS), *((col(SEG), col(ANCHOR)) if anchors else (None, None)))


def load_key_meta(km_ref, cols=slice(None), *, anchors: bool) -> KeyMeta:
    row = lambda r: km_ref[r : r + 1, cols]  # noqa: E731
    return KeyMeta(row(POS), *((row(SEG), row(ANCHOR), row(KEEP)) if anchors else (None, None, None)))


def tile_logits(
    q: Float[Array, "bq d"],
    k: Float[Array, "bk d"],
    qm: QueryMeta,
    km: KeyMeta,
    gate: Int[Array, "1 bk"] | None,
    slope,
    *,
    scale: float,
    window: int | None,
) -> Float[Array, "bq bk"]:
    """Scaled logits of one tile with ALiBi (`slope` or None) and every mask applied."""
    s = qk(q, k) * scale
    if slope is not None:
        s = s + masks.alibi_bias(slope, qm.pos, km.pos, jnp.float32)
    return jnp.where(tile_visible(qm, km, gate, window=window), s, MASKED)


def tile_visible(qm: QueryMeta, km: KeyMeta, gate, *, window) -> Bool[Array, "bq bk"]:
    vis = masks.causal(qm.pos, km.pos, window)
    if qm.seg is not None:
        vis &= masks.eq4(qm.seg, qm.anchor > 0, km.seg, km.anchor > 0, km.keep > 0)
    if gate is not None:
        vis &= masks.gate(gate > 0, qm.pos, km.pos)
    return vis


def online_step(carry, s: Float[Array, "bq bk"], v: Float[Array, "bk d"]):
    """Folds one tile of logits into `(m [bq, 1], l [bq, 1], acc [bq, d])`."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    pv = matmul(p.astype(v.dtype), v, (1, 0))
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def online_init(bq: int, d: int):
    return (jnp.full((bq, 1), MASKED, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, d), jnp.float32))


def online_finish(m, l, acc):
    """Normalised output and log-sum-exp; a query with no live tile (padding) gets zeros."""
    safe = jnp.where(l > 0, l, 1.0)
    return acc / safe, jnp.where(l > 0, m + jnp.log(safe), MASKED)


# ---- wrapper-side helpers (plain jnp, outside the kernels) ----


def interpret_mode(variant: str, interpret: bool):
    """`pallas_call`'s `interpret=`: the TPU variant runs in the TPU interpreter (which checks its
    memory spaces and DMA), the GPU variant in the generic one."""
    if not interpret:
        return False
    return pltpu.InterpretParams() if variant == "tpu" else True


def compiler_params(variant: str, parallel: int, sequential: int, num_warps: int = 4, num_stages: int = 2):
    """Mosaic's grid semantics (TPU), or Triton's warps per program and software-pipelining depth (GPU)."""
    if variant == "tpu":
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * parallel + ("arbitrary",) * sequential)
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def dividing(n: int, candidates) -> int | None:
    """The first of `candidates` that divides `n` (a tile or split count that needs no padding), else None."""
    return next((x for x in candidates if n % x == 0), None)


def query_meta(pos: Int[Array, "b t"], segment=None, anchor=None) -> Int[Array, "b t 4"]:
    z = jnp.zeros_like(pos)
    cols = [pos, z if segment is None else segment, z if anchor is None else anchor.astype(jnp.int32), z]
    return jnp.stack(cols, axis=-1).astype(jnp.int32)


def key_meta(pos: Int[Array, "b s"], segment=None, anchor=None, keep=None) -> Int[Array, "b 4 s"]:
    z = jnp.zeros_like(pos)
    rows = [pos, z if segment is None else segment, *(z if x is None else x.astype(jnp.int32) for x in (anchor, keep))]
    return jnp.stack(rows, axis=1).astype(jnp.int32)


def pad_axis(x, axis: int, to: int, value=0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def live_blocks(
    qm: Int[Array, "b t 4"],
    km: Int[Array, "b 4 s"],
    gate: Int[Array, "b kvh 1 s"] | None,
    kv_heads: int,
    bq: int,
    bk: int,
    *,
    window: int | None,
    anchors: bool,
) -> Bool[Array, "b kvh nq nk"]:
    """Whether each (query block, key block) can hold a visible key.

    Decided from per-block summaries (position and segment ranges, any anchor / kept /
    gated key), so it is conservative: a live block may still be fully masked tile by
    tile, but a block marked dead never holds a visible key. Cost O(T/bq * T/bk).
    """
    b, t, _ = qm.shape
    s = km.shape[2]
    nq, nk = t // bq, s // bk
    big = jnp.iinfo(jnp.int32).max
    qb = qm.reshape(b, nq, bq, QM)
    kb = km.reshape(b, KM, nk, bk)
    q_real = qb[..., POS] >= 0
    k_real = kb[:, POS] >= 0
    qmax = jnp.max(jnp.where(q_real, qb[..., POS], -1), -1)[:, :, None]  # [b, nq, 1]
    qmin = jnp.min(jnp.where(q_real, qb[..., POS], big), -1)[:, :, None]
    kmin = jnp.min(jnp.where(k_real, kb[:, POS], big), -1)[:, None, :]  # [b, 1, nk]
    kmax = jnp.max(jnp.where(k_real, kb[:, POS], -1), -1)[:, None, :]
    live = jnp.any(q_real, -1)[:, :, None] & jnp.any(k_real, -1)[:, None, :] & (kmin <= qmax)
    if window is not None:
        live &= kmax > qmin - window
    if anchors:
        live &= masks.eq4_blocks(qb[..., SEG], qb[..., ANCHOR] > 0, q_real, kb[:, SEG], kb[:, ANCHOR] > 0,
                                 kb[:, KEEP] > 0, k_real)
    live = jnp.broadcast_to(live[:, None], (b, kv_heads, nq, nk))
    if gate is not None:
        kept = jnp.any(gate.reshape(b, kv_heads, nk, bk) > 0, -1)[:, :, None, :]  # [b, kvh, 1, nk]
        diagonal = ((kmin <= qmax) & (kmax >= qmin))[:, None]
        live &= kept | diagonal
    return live


def block_table(qm, km, gate, kv_heads: int, bq: int, bk: int, *, window: int | None,
                anchors: bool) -> tuple[Int[Array, "b kvh nq"], Int[Array, "b kvh nq nk"]]:
    """Per query block, how many key blocks can hold a visible key (`live_blocks`) and which (ascending, live
    first): the GPU kernel's loop reads exactly these."""
    live = live_blocks(qm, km, gate, kv_heads, bq, bk, window=window, anchors=anchors)
    order = jnp.argsort(~live, axis=-1, stable=True).astype(jnp.int32)
    return jnp.sum(live, -1).astype(jnp.int32), order


def block_range(qm, km, gate, kv_heads: int, bq: int, bk: int, *, window: int | None,
                anchors: bool) -> tuple[Int[Array, "b kvh nq"], Int[Array, "b kvh nq"]]:
    """Per query block, the first live key block and the span to the last live one (0 when none): the TPU
    kernel's table. Mosaic prefetches its tables into SMEM (1 MiB on v5e / v6e), where `block_table`'s
    `[b, kvh, nq, nk]` does not fit past about 16K tokens; the span is exact for causal and window masks and
    conservative (dead blocks inside it are read, and masked tile by tile) for eq. 4 and gates."""
    live = live_blocks(qm, km, gate, kv_heads, bq, bk, window=window, anchors=anchors)
    nk = live.shape[-1]
    first = jnp.argmax(live, axis=-1).astype(jnp.int32)
    last = (nk - 1 - jnp.argmax(live[..., ::-1], axis=-1)).astype(jnp.int32)
    return first, jnp.where(jnp.any(live, -1), last - first + 1, 0).astype(jnp.int32)


def gpu_head_dim(d: int) -> int:
    """Triton tiles need power-of-two sizes and `tl.dot` a contraction of at least 16:
    the GPU variant zero-pads the head dimension to this (zeros change no logit)."""
    return max(16, next_pow2(d))


def next_pow2(n: int) -> int:
    return 1 << max(0, int(np.ceil(np.log2(max(n, 1)))))
