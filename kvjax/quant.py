"""A quantized KV cache: a policy's kept slots stored as int8 or KIVI's 4 / 2-bit codes, in real bytes.

Eviction decides which tokens stay; quantization shrinks each one. `QuantizedLayerCache` holds the same
slots as a `kvjax.cache.LayerCache` (positions, logit biases and the rule's state unchanged) with the keys and values
replaced by codes:

* `KVQuant(bits=8)`: int8, symmetric, one scale per (KV head, slot) for keys and for values.
* `KVQuant(bits=4 | 2, group=G)`: KIVI (Liu et al., 2024). Keys per channel: each channel of a group of
  G consecutive slots shares a scale and a zero point (keys have outlier channels); values per token: each
  group of G channels of a slot shares them. Asymmetric, `x ~ zero + scale * code`, `code` in
  [0, 2^bits - 1], `scale = (max - min) / (2^bits - 1)`, `zero = min`. Codes are packed 8 / bits per byte.
* `residual=R`: the R most recent tokens (by position) are also held in full precision, as KIVI keeps its
  residual, and attention reads them from there; a token's codes are used once it is older.

How it composes with a policy (`kvjax.layer`): each layer call reads the quantized cache as a LayerCache
(`view`: codes dequantized, recent tokens from the residual), runs the policy's rule and attention on it
unchanged, and stores the result back (`store`). So eviction scores are computed from dequantized values
(and the full-precision residual), and every policy, chunked prefill and decoding work as they are.

Decoding reads the codes directly where it can (`write_token`, `attend`): when the layer's one rule places each
new token from positions and statistics alone (a `StepOnlyWrites` rule: the ring policies, H2O, SnapKV & co),
keys sit at absolute positions and no ALiBi, window or soft-cap applies, a decode step stores only the new token
(its key group requantized) and attends the codes `DECODE_BLOCK` slots at a time, so the layer's keys and values
are never dequantized as a whole (`tests/test_quant.py` checks the compiled step for such a buffer). It gives the
view path's numbers; the one difference is that groups no token entered keep their codes and scales as they
were quantized, where the view path re-derives them from their own dequantized values on every call (the same
codes, the scales moving in their last bits, now and then a code with them). Every other rule, and prompts and
chunks, go through the view.

Where this differs from KIVI, which appends to one sequence and never evicts: `store` quantizes every slot
from the view. A slot's codes are the same when its group's members are unchanged (quantizing dequantized
values is exact: the group's minimum and maximum are codes 0 and 2^bits - 1), so a prefill-then-append
policy (SnapKV & co, the full cache) sees KIVI's codes: a key group fills while its tokens are in the
residual (R >= G) and is quantized from full precision. A policy that writes a token into a slot of an
older key group (a ring buffer, H2O, TOVA, MAT), or moves slots (Decoding), requantizes that group from
its members' dequantized values: if the new token widens the group's range, the older members are rounded
a second time. With R = 0 a key group is quantized as it fills, each new member rounding the others again.
The prompt's own attention (prefill_mode "full") is in full precision, as in KIVI; a streamed prompt attends
the stored cache token by token; a chunk attends the stored cache (its residual counted back from the
chunk's last token) and, in full precision, its own tokens, so a chunk of n tokens sees up to n - 1 more
full-precision keys than the same tokens streamed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import cache as kvcache
from kvjax.cache import EMPTY, LayerCache
from kvjax.errors import InvalidInput

BITS = (8, 4, 2)


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How a cache is quantized: `bits` 8 (int8 per token), 4 or 2 (KIVI, group size `group`), and the
    `residual` most recent tokens kept in full precision besides their codes."""

    bits: int
    group: int | None = None
    residual: int = 0

    def __post_init__(self):
        if self.bits not in BITS:
            raise InvalidInput(f"kv bits={self.bits}; expected one of {BITS}")
        if self.bits == 8 and self.group is not None:
            raise InvalidInput(f"kv bits=8 is int8 with one scale per token: group={self.group} does not apply "
                               "(KIVI's group size is for 4 and 2 bits)")
        if self.bits < 8 and (self.group is None or self.group < 1):
            raise InvalidInput(f"kv bits={self.bits} (KIVI) needs a group size >= 1; got group={self.group}")
        if self.residual < 0:
            raise InvalidInput(f"kv residual={self.residual} must be >= 0")

    @property
    def kivi(self) -> bool:
        return self.bits < 8

    def check_head_dim(self, head_dim: int) -> None:
        if self.kivi and head_dim % self.group:
            raise InvalidInput(f"kv group={self.group}: values are quantized in groups of channels, which must divide "
                               f"the head size {head_dim}")
        if head_dim % (8 // self.bits):
            raise InvalidInput(f"kv bits={self.bits}: {8 // self.bits} codes are packed per byte, which must divide "
                               f"the head size {head_dim}")

    def describe(self) -> str:
        group = "" if self.group is None else f", group={self.group}"
        return f"bits={self.bits}{group}, residual={self.residual}"

    def code_bytes(self, capacity: int, head_dim: int, scale_bytes: int) -> int:
        """Exact bytes of the codes, scales and zeros of one (row, KV head) of `capacity` slots (`empty`'s arrays):
        KIVI's key scales cover whole groups of G slots, so a short cache pays for a whole group."""
        if not self.kivi:
            return 2 * capacity * (head_dim + scale_bytes)
        groups = -(-capacity // self.group)
        return 2 * capacity * head_dim * self.bits // 8 + 2 * groups * head_dim * scale_bytes \
            + 2 * capacity * (head_dim // self.group) * scale_bytes

    def largest_residual(self, capacity: int, head_dim: int, scale_bytes: int) -> int:
        """The most full-precision tokens (keys, values and a position each) a quantized cache of `capacity` slots can
        hold besides its codes and stay no larger than the same slots unquantized (keys and values at
        `scale_bytes`, the model's dtype; positions, biases and the rule's state are the same in both). Never more
        than the cache holds: a larger residual holds nothing more, and would make a 'compressed' cache larger."""
        plain = 2 * capacity * head_dim * scale_bytes
        per_token = 2 * head_dim * scale_bytes + 4
        return max(0, min(capacity, (plain - self.code_bytes(capacity, head_dim, scale_bytes)) // per_token))

    def fitted(self, capacity: int, head_dim: int, dtype) -> "KVQuant":
        """This spec for a cache of `capacity` slots of `dtype`: the residual cut to `largest_residual` (said once,
        as a warning naming both values), or refused when the codes alone outweigh the unquantized cache (a
        cache of fewer slots than one KIVI key group pays for the whole group's scales)."""
        size = jnp.dtype(dtype).itemsize
        if self.code_bytes(capacity, head_dim, size) > 2 * capacity * head_dim * size:
            raise InvalidInput(f"kv {self.describe()}: a cache of {capacity} slots at head size {head_dim} takes more "
                               f"bytes quantized ({self.code_bytes(capacity, head_dim, size)} per KV head) than "
                               f"unquantized ({2 * capacity * head_dim * size}); give it more slots, a smaller group, "
                               "or leave it unquantized")
        most = self.largest_residual(capacity, head_dim, size)
        if self.residual <= most:
            return self
        _say_once(f"kv {self.describe()}: residual={self.residual} cut to {most} for a cache of {capacity} slots (head "
                  f"size {head_dim}, {jnp.dtype(dtype).name}): more full-precision tokens besides the codes would make the quantized "
                  "cache larger than the unquantized one")
        return dataclasses.replace(self, residual=most)

    def bytes_per_slot(self, head_dim: int, scale_bytes: int) -> float:
        """Bytes of keys and values per (KV head, slot) by formula, the residual aside (`nbytes` counts it):
        int8 `2 (d + s)`; KIVI `2 d bits / 8` of codes, `2 s d / G` for the keys' per-channel scale and zero
        (one pair per channel per G slots) and `2 s d / G` for the values' (one pair per G channels)."""
        if not self.kivi:
            return 2 * (head_dim + scale_bytes)
        return 2 * head_dim * self.bits / 8 + 4 * scale_bytes * head_dim / self.group


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
    """A UserWarning the first time `message` is said in a process (a cache is built at every trace)."""
    warnings.warn(message, UserWarning, stacklevel=4)


# ---- codes ------------------------------------------------------------------------------------------


def pack(codes: Int[Array, "... d"], bits: int) -> Array:
    """Codes in [0, 2^bits) packed 8 / bits per uint8 along the last axis (the first code in the low bits)."""
    per = 8 // bits
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint8)  # the fields do not overlap: a sum is their OR


def unpack(packed: Array, bits: int) -> Int[Array, "... d"]:
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    c = (packed[..., None] >> shifts) & jnp.uint8(2 ** bits - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _asym(x, mn, mx, bits, dtype):
    """KIVI's asymmetric quantizer over groups already reduced to `mn` / `mx` (broadcastable to `x`):
    the scale and zero are rounded to the storage dtype first, so codes and dequantization agree."""
    top = 2 ** bits - 1
    scale = ((mx - mn) / top).astype(dtype)
    zero = mn.astype(dtype)
    s = scale.astype(jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)  # a constant group: every code 0, dequantized to its value exactly
    codes = jnp.round(jnp.clip((x - zero.astype(jnp.float32)) / safe, 0, top))
    return codes.astype(jnp.uint8), scale, zero


def quantize_int8(x: Float[Array, "... d"], dtype) -> tuple[Array, Array]:
    """Symmetric int8 per vector: `scale = max |x| / 127`, `code = round(x / scale)`."""
    x = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1) / 127).astype(dtype)
    s = scale.astype(jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)[..., None]
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def dequantize_int8(codes, scale, dtype):
    return (codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def quantize_values(x: Float[Array, "b kvh c d"], bits: int, group: int, dtype):
    """KIVI's values: per token, groups of `group` channels. `(packed [b, kvh, c, d bits / 8], scale, zero
    [b, kvh, c, d / group])`."""
    x = x.astype(jnp.float32)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    codes, scale, zero = _asym(g, g.min(-1, keepdims=True), g.max(-1, keepdims=True), bits, dtype)
    return pack(codes.reshape(x.shape), bits), scale[..., 0], zero[..., 0]


def dequantize_values(packed, scale, zero, bits: int, group: int, dtype):
    c = unpack(packed, bits).astype(jnp.float32)
    g = c.reshape(*c.shape[:-1], c.shape[-1] // group, group)
    x = zero.astype(jnp.float32)[..., None] + scale.astype(jnp.float32)[..., None] * g
    return x.reshape(c.shape).astype(dtype)


def _slot_groups(x, group: int, fill):
    """`[b, kvh, c, ...]` -> `[b, kvh, ceil(c / group), group, ...]`, the last group padded with `fill`."""
    c = x.shape[2]
    n = math.ceil(c / group)
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, n * group - c)
    x = jnp.pad(x, pad, constant_values=fill)
    return x.reshape(*x.shape[:2], n, group, *x.shape[3:])


def quantize_keys(x: Float[Array, "b kvh c d"], valid: Array, bits: int, group: int, dtype):
    """KIVI's keys: per channel, over groups of `group` consecutive slots, the statistics over the `valid`
    (held) slots only. `(packed [b, kvh, c, d bits / 8], scale, zero [b, kvh, ceil(c / group), d])`."""
    x = x.astype(jnp.float32)
    g = _slot_groups(x, group, 0.0)
    ok = _slot_groups(valid, group, False)[..., None]
    mn = jnp.min(jnp.where(ok, g, jnp.inf), axis=3, keepdims=True)
    mx = jnp.max(jnp.where(ok, g, -jnp.inf), axis=3, keepdims=True)
    none = ~jnp.any(ok, axis=3, keepdims=True)
    mn, mx = jnp.where(none, 0.0, mn), jnp.where(none, 0.0, mx)
    codes, scale, zero = _asym(g, mn, mx, bits, dtype)
    codes = codes.reshape(*x.shape[:2], -1, x.shape[-1])[:, :, : x.shape[2]]
    return pack(codes, bits), scale[:, :, :, 0], zero[:, :, :, 0]


def dequantize_keys(packed, scale, zero, bits: int, group: int, dtype):
    c = unpack(packed, bits).astype(jnp.float32)
    n = c.shape[2]
    per_slot = lambda s: jnp.repeat(s.astype(jnp.float32), group, axis=2)[:, :, :n]  # noqa: E731
    return (per_slot(zero) + per_slot(scale) * c).astype(dtype)


# ---- the cache --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantizedLayerCache:
    """A LayerCache whose keys and values are codes (see the module docstring).

    k_codes, v_codes: int8 `[b, kvh, C, d]` (8 bits) or uint8 `[b, kvh, C, d bits / 8]` (KIVI).
    k_scale (and k_zero): `[b, kvh, C]` (int8) or `[b, kvh, ceil(C / G), d]` (KIVI, per channel per G slots).
    v_scale (and v_zero): `[b, kvh, C]` (int8) or `[b, kvh, C, d / G]` (KIVI, per G channels per slot).
    pos, log_w, state: as in LayerCache.
    res_k, res_v `[b, kvh, R, d]`, res_pos `[b, kvh, R]`: the residual, a ring of the R most recent held
    tokens in full precision (slot `pos % R`), -1 where empty; None when R = 0.
    """

    k_codes: Array
    k_scale: Array
    k_zero: Array | None
    v_codes: Array
    v_scale: Array
    v_zero: Array | None
    pos: Int[Array, "b kvh c"]
    log_w: Float[Array, "b kvh c"]
    state: dict[str, Float[Array, "b kvh *c"]]
    res_k: Array | None
    res_v: Array | None
    res_pos: Array | None
    spec: KVQuant
    dtype: str  # the model's dtype, which dequantized keys and values take

    @property
    def capacity(self) -> int:
        return self.pos.shape[2]

    @property
    def nbytes(self) -> int:
        return kvcache.tree_nbytes(self)

    def held_bytes(self) -> np.ndarray:
        """`[b]` KV bytes of the slots holding a token (`kvjax.cache.held_bytes`): their key and value codes, their
        per-slot scales (int8; KIVI's values' scales and zeros), each KIVI key group's per-channel scales and zeros
        where the group holds a token, and the residual's full-precision keys and values that hold one."""
        nb = lambda x: int(np.prod(x.shape[3:], dtype=np.int64)) * x.dtype.itemsize  # noqa: E731  per slot
        valid = np.asarray(self.pos) >= 0  # [b, kvh, C]
        per_slot = nb(self.k_codes) + nb(self.v_codes) + nb(self.v_scale)
        per_slot += nb(self.v_zero) if self.v_zero is not None else 0
        held = valid.sum(axis=(1, 2)) * per_slot
        if self.spec.kivi:  # keys' scale and zero per channel per group of G slots
            g = self.spec.group
            c = valid.shape[2]
            pad = np.pad(valid, ((0, 0), (0, 0), (0, -c % g)))
            groups = pad.reshape(*valid.shape[:2], -1, g).any(-1).sum(axis=(1, 2))
            held = held + groups * (nb(self.k_scale) + nb(self.k_zero))
        else:
            held = held + valid.sum(axis=(1, 2)) * nb(self.k_scale)
        if self.res_pos is not None:
            held = held + (np.asarray(self.res_pos) >= 0).sum(axis=(1, 2)) * (nb(self.res_k) + nb(self.res_v))
        return held

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values at every KV head in the model's dtype (the full cache's per token)."""
        head_dim = self.k_codes.shape[-1] * 8 // self.spec.bits
        return 2 * self.pos.shape[1] * head_dim * jnp.dtype(self.dtype).itemsize


jax.tree_util.register_dataclass(
    QuantizedLayerCache,
    data_fields=["k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "pos", "log_w", "state", "res_k",
                 "res_v", "res_pos"],
    meta_fields=["spec", "dtype"])


def empty(spec: KVQuant, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype,
          state: Mapping[str, str] = MappingProxyType({})) -> QuantizedLayerCache:
    """An empty quantized cache (`state`: the rule's statistics, as `kvjax.cache.empty`'s, kept unquantized)."""
    spec.check_head_dim(head_dim)
    plain = kvcache.empty(batch, kv_heads, capacity, head_dim, dtype, state)
    return store(spec, plain, jnp.full((batch,), EMPTY, jnp.int32))


def view(qc: QuantizedLayerCache, newest: Int[Array, "b"] | None = None) -> LayerCache:
    """The cache as a LayerCache: codes dequantized to the model's dtype, held tokens of the residual read from
    it. `newest`: each row's newest position in the call that reads it (a decode step's token), so that the
    residual's oldest tokens give way: the R most recent tokens, that one included, are in full precision."""
    s, dtype = qc.spec, jnp.dtype(qc.dtype)
    if s.kivi:
        k = dequantize_keys(qc.k_codes, qc.k_scale, qc.k_zero, s.bits, s.group, dtype)
        v = dequantize_values(qc.v_codes, qc.v_scale, qc.v_zero, s.bits, s.group, dtype)
    else:
        k, v = dequantize_int8(qc.k_codes, qc.k_scale, dtype), dequantize_int8(qc.v_codes, qc.v_scale, dtype)
    if s.residual:
        ring = jnp.where(qc.pos >= 0, qc.pos % s.residual, 0)
        hit = (qc.pos >= 0) & (jnp.take_along_axis(qc.res_pos, ring, axis=2) == qc.pos)
        if newest is not None:
            hit &= qc.pos > newest[:, None, None] - s.residual
        hit = hit[..., None]
        k = jnp.where(hit, jnp.take_along_axis(qc.res_k, ring[..., None], axis=2), k)
        v = jnp.where(hit, jnp.take_along_axis(qc.res_v, ring[..., None], axis=2), v)
    return LayerCache(k=k, v=v, pos=qc.pos, log_w=qc.log_w, state=qc.state)


def store(spec: KVQuant, lc: LayerCache, newest: Int[Array, "b"]) -> QuantizedLayerCache:
    """`lc` quantized; the residual holds its slots at positions within `residual` of each row's newest token
    (the larger of `newest` and the newest position `lc` holds). Every quantized cache is made here, so its
    residual is `spec`'s fitted to `lc` (`KVQuant.fitted`): never larger than the cache unquantized."""
    dtype = lc.k.dtype
    spec = spec.fitted(lc.capacity, lc.k.shape[-1], dtype)
    valid = lc.pos >= 0
    if spec.kivi:
        kc, ks, kz = quantize_keys(lc.k, valid, spec.bits, spec.group, dtype)
        vc, vs, vz = quantize_values(lc.v, spec.bits, spec.group, dtype)
    else:
        (kc, ks), (vc, vs) = quantize_int8(lc.k, dtype), quantize_int8(lc.v, dtype)
        kz = vz = None
    res_k = res_v = res_pos = None
    if spec.residual:
        r = spec.residual
        top = jnp.maximum(newest, jnp.max(lc.pos, axis=(1, 2)))[:, None, None]
        recent = valid & (lc.pos > top - r)
        b, h, _ = lc.pos.shape
        idx = (jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], jnp.where(recent, lc.pos % r, r))
        res_k = jnp.zeros((b, h, r, lc.k.shape[-1]), dtype).at[idx].set(lc.k, mode="drop")
        res_v = jnp.zeros((b, h, r, lc.v.shape[-1]), dtype).at[idx].set(lc.v, mode="drop")
        res_pos = jnp.full((b, h, r), EMPTY, jnp.int32).at[idx].set(lc.pos, mode="drop")
    return QuantizedLayerCache(k_codes=kc, k_scale=ks, k_zero=kz, v_codes=vc, v_scale=vs, v_zero=vz, pos=lc.pos,
                               log_w=lc.log_w, state=lc.state, res_k=res_k, res_v=res_v, res_pos=res_pos, spec=spec,
                               dtype=jnp.dtype(dtype).name)


# ---- decoding from the codes --------------------------------------------------------------------------
# A decode step of a rule whose `step` only writes the new token (`StepOnlyWrites`: the ring policies,
# H2O, SnapKV & co) needs no dequantized cache: `write_token` stores that one token (its key group requantized,
# as `store` would), and `attend` reads the codes `block` slots at a time. Both equal `view` -> rule -> attention
# -> `store` (tests/test_quant.py), without ever holding the layer's keys and values dequantized.

DECODE_BLOCK = 512  # slots dequantized at a time by `attend` (a multiple of every group size that divides it)
# Blocks per iteration of `attend`'s two loops. Rolled (1), the loops ran one 512-slot block per iteration, and on an
# H200 int8 decoding from the codes ran 39x slower than 16-bit at 64K slots and 11x at 4K
# (benchmarks/results/quant_gpu_h200.md), about 18 µs per iteration: the likely cost is XLA:GPU's per-iteration
# loop overhead (its predicate read back, a launch per small kernel), which unrolling divides. The blocks stay
# 512 slots, so memory is unchanged.
DECODE_UNROLL = 16


def _residual_hit(qc: QuantizedLayerCache, slot_pos, newest: Int[Array, "b"]):
    """Where a slot at `slot_pos` ([b, kvh, n]) is read from the residual: held there, and within R of `newest`
    (`view`'s rule). Returns (hit [b, kvh, n], ring index [b, kvh, n])."""
    r = qc.spec.residual
    ring = jnp.where(slot_pos >= 0, slot_pos % r, 0)
    hit = (slot_pos >= 0) & (jnp.take_along_axis(qc.res_pos, ring, axis=2) == slot_pos)
    return hit & (slot_pos > newest[:, None, None] - r), ring


def _slots(qc: QuantizedLayerCache, start, n: int) -> tuple[Array, Array, Array]:
    """Keys and values of slots `start .. start + n - 1` dequantized from their codes, and their positions:
    `([b, kvh, n, d], [b, kvh, n, d], [b, kvh, n])`. Only slices are read (no gather), so a block costs its own
    bytes."""
    s, dtype = qc.spec, jnp.dtype(qc.dtype)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, n, axis=2)  # noqa: E731
    pos = take(qc.pos)
    if s.kivi:
        # the key groups the block spans (one more than n / G when it starts inside a group), then each slot's
        groups = n // s.group + 1
        first = start // s.group
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, groups), (0, 0)))  # noqa: E731  (a block near the end)
        per_slot = lambda x: jax.lax.dynamic_slice_in_dim(  # noqa: E731
            jnp.repeat(jax.lax.dynamic_slice_in_dim(pad(x), first, groups, axis=2), s.group, axis=2),
            start - first * s.group, n, axis=2).astype(jnp.float32)
        k = (per_slot(qc.k_zero) + per_slot(qc.k_scale) * unpack(take(qc.k_codes), s.bits)).astype(dtype)
        v = dequantize_values(take(qc.v_codes), take(qc.v_scale), take(qc.v_zero), s.bits, s.group, dtype)
    else:
        k, v = dequantize_int8(take(qc.k_codes), take(qc.k_scale), dtype), dequantize_int8(take(qc.v_codes),
                                                                                          take(qc.v_scale), dtype)
    return k, v, pos


def write_token(qc: QuantizedLayerCache, stepped: LayerCache, k: Float[Array, "b kvh d"],
                v: Float[Array, "b kvh d"], pos: Int[Array, "b"]) -> QuantizedLayerCache:
    """The token a rule's `step` placed (the slot whose position changed in `stepped`, whose keys and values are
    not read) stored into the codes: its value (and int8 key) alone, its KIVI key group requantized from its
    members as `view` reads them plus the new key, as `store` would; the residual ring takes it in full
    precision. Positions, biases and the rule's state are `stepped`'s."""
    s, dtype = qc.spec, jnp.dtype(qc.dtype)
    b, h, c = qc.pos.shape
    written = stepped.pos != qc.pos
    slot = jnp.where(jnp.any(written, axis=-1), jnp.argmax(written, axis=-1), c)  # [b, kvh]; c: none, dropped
    at = (jnp.arange(b)[:, None], jnp.arange(h)[None, :], slot)
    put = lambda x, new: x.at[at].set(new.astype(x.dtype), mode="drop")  # noqa: E731
    out = dict(pos=stepped.pos, log_w=stepped.log_w, state=stepped.state)
    if s.kivi:
        vc, vs, vz = quantize_values(v[:, :, None], s.bits, s.group, dtype)
        out.update(v_codes=put(qc.v_codes, vc[:, :, 0]), v_scale=put(qc.v_scale, vs[:, :, 0]),
                   v_zero=put(qc.v_zero, vz[:, :, 0]))
        # the key group of the written slot, requantized from its members (the new key in its slot)
        g = jnp.minimum(slot, c - 1) // s.group  # [b, kvh]
        members = g[..., None] * s.group + jnp.arange(s.group)  # [b, kvh, G] slot indices
        inside = members < c
        idx = jnp.minimum(members, c - 1)
        mpos = jnp.where(inside, jnp.take_along_axis(stepped.pos, idx, axis=2), EMPTY)
        old = jnp.take_along_axis(qc.pos, idx, axis=2)
        gs = jnp.take_along_axis(qc.k_scale, g[..., None, None], axis=2)  # [b, kvh, 1, d]
        gz = jnp.take_along_axis(qc.k_zero, g[..., None, None], axis=2)
        codes = unpack(jnp.take_along_axis(qc.k_codes, idx[..., None], axis=2), s.bits)
        keys = gz.astype(jnp.float32) + gs.astype(jnp.float32) * codes
        if s.residual:
            hit, ring = _residual_hit(qc, old, pos)
            keys = jnp.where(hit[..., None], jnp.take_along_axis(qc.res_k, ring[..., None], axis=2), keys)
        keys = jnp.where((members == slot[..., None])[..., None], k[:, :, None].astype(jnp.float32), keys)
        kc, ks, kz = quantize_keys(keys, mpos >= 0, s.bits, s.group, dtype)
        rows = jnp.where((slot < c)[..., None], members, c)
        out.update(k_codes=qc.k_codes.at[at[0][..., None], at[1][..., None], rows].set(kc, mode="drop"),
                   k_scale=qc.k_scale.at[at[0], at[1], jnp.where(slot < c, g, c)].set(ks[:, :, 0], mode="drop"),
                   k_zero=qc.k_zero.at[at[0], at[1], jnp.where(slot < c, g, c)].set(kz[:, :, 0], mode="drop"))
    else:
        (kc, ks), (vc, vs) = quantize_int8(k, dtype), quantize_int8(v, dtype)
        out.update(k_codes=put(qc.k_codes, kc), k_scale=put(qc.k_scale, ks), v_codes=put(qc.v_codes, vc),
                   v_scale=put(qc.v_scale, vs))
    if s.residual:
        ring = jnp.where(slot < c, jnp.maximum(pos, 0)[:, None] % s.residual, s.residual)
        r_at = (at[0], at[1], ring)
        out.update(res_k=qc.res_k.at[r_at].set(k.astype(dtype), mode="drop"),
                   res_v=qc.res_v.at[r_at].set(v.astype(dtype), mode="drop"),
                   res_pos=qc.res_pos.at[r_at].set(jnp.broadcast_to(pos[:, None], (b, h)), mode="drop"))
    return dataclasses.replace(qc, **out)


def attend(q: Float[Array, "b h d"], qc: QuantizedLayerCache, newest: Int[Array, "b"], current, *,
           scale: float, probs: bool = False, first_logit: bool = False, block: int = DECODE_BLOCK,
           unroll: int | None = None):
    """One query per row over the quantized cache, `block` slots dequantized at a time (two passes: the logits,
    then the values under their softmax): `(output [b, h, d], probs [b, kvh, C] | None, first_logit | None)`,
    the numbers `kvjax.reference.decode_attention` gives over `view(qc, newest)` with the token at `newest` in
    full precision (`current` = its (k, v) `[b, kvh, d]`, as a rule writes it into the view). The residual's
    tokens and the current one are attended from their own small arrays, their logits and probabilities
    mapped to their slots, so the blocks read codes only. Absolute positions; no ALiBi, window or soft-cap
    (`kvjax.layer` sends those through the view). `unroll`: blocks per loop iteration (`DECODE_UNROLL`)."""
    from kvjax.reference import _MASKED, _acc

    spec = qc.spec
    b, h, d = q.shape
    kvh, c = qc.pos.shape[1:]
    g = h // kvh
    n = min(block, c)
    starts = jnp.arange(-(-c // n)) * n
    qg = q.reshape(b, kvh, g, d)
    acc = _acc(q.dtype)
    dot = lambda x: jnp.einsum("bkgd,bk...d->bkg...", qg, x, preferred_element_type=acc) * scale  # noqa: E731
    # slots read elsewhere than their codes: the current token, and (R > 0) the residual's, by ring index
    now_all = (qc.pos == newest[:, None, None]) & (qc.pos >= 0)
    cur_logit = dot(current[0])  # [b, kvh, g]
    if spec.residual:
        hit_all, ring_all = _residual_hit(qc, qc.pos, newest)
        hit_all &= ~now_all
        res_logit = dot(qc.res_k)  # [b, kvh, g, R]

    def logits(carry, start):
        full, first = carry
        at = jnp.minimum(start, c - n)  # the last block ends at c, overlapping slots seen before
        k, _, pos = _slots(qc, at, n)
        raw = dot(k)
        if spec.residual:
            hit, ring = (jax.lax.dynamic_slice_in_dim(x, at, n, axis=2) for x in (hit_all, ring_all))
            from_res = jnp.take_along_axis(res_logit, jnp.broadcast_to(ring[:, :, None], raw.shape), axis=3)
            raw = jnp.where(hit[:, :, None], from_res, raw)
        raw = jnp.where(jax.lax.dynamic_slice_in_dim(now_all, at, n, axis=2)[:, :, None], cur_logit[..., None], raw)
        fresh = (at + jnp.arange(n)) >= start
        s = jnp.where((pos >= 0)[:, :, None, :], raw + jax.lax.dynamic_slice_in_dim(qc.log_w, at, n, 2)[:, :, None],
                      _MASKED)
        s = jnp.where(fresh, s, jax.lax.dynamic_slice_in_dim(full, at, n, 3))
        first = jnp.maximum(first, jnp.max(jnp.where((fresh & (pos == 0))[:, :, None, :], raw, _MASKED), -1))
        return (jax.lax.dynamic_update_slice_in_dim(full, s, at, 3), first), None

    init = (jnp.full((b, kvh, g, c), _MASKED, acc), jnp.full((b, kvh, g), _MASKED, acc))
    unroll = max(1, min(unroll or DECODE_UNROLL, len(starts)))
    (s, first), _ = jax.lax.scan(logits, init, starts, unroll=unroll)
    p = jax.nn.softmax(s, axis=-1)
    elsewhere = now_all | hit_all if spec.residual else now_all

    def values(out, start):
        at = jnp.minimum(start, c - n)
        _, v, _ = _slots(qc, at, n)
        keep = ((at + jnp.arange(n)) >= start) & ~jax.lax.dynamic_slice_in_dim(elsewhere, at, n, axis=2)[:, :, None]
        pb = jnp.where(keep, jax.lax.dynamic_slice_in_dim(p, at, n, 3), 0.0)
        return out + jnp.einsum("bkgc,bkcd->bkgd", pb.astype(v.dtype), v, preferred_element_type=acc), None

    out, _ = jax.lax.scan(values, jnp.zeros((b, kvh, g, d), acc), starts, unroll=unroll)
    p_now = jnp.sum(jnp.where(now_all[:, :, None], p, 0.0), axis=-1)  # [b, kvh, g]
    out = out + p_now[..., None] * current[1][:, :, None].astype(acc)
    if spec.residual:
        r = spec.residual
        bins = jnp.where(hit_all, ring_all, r)[:, :, None, :]  # r: not the residual's (dropped)
        p_res = jnp.zeros((b, kvh, g, r), acc).at[
            jnp.arange(b)[:, None, None, None], jnp.arange(kvh)[None, :, None, None],
            jnp.arange(g)[None, None, :, None], jnp.broadcast_to(bins, p.shape)].add(p, mode="drop")
        out = out + jnp.einsum("bkgr,bkrd->bkgd", p_res.astype(qc.res_v.dtype), qc.res_v, preferred_element_type=acc)
    return (out.reshape(b, h, d).astype(q.dtype), p.sum(axis=2) if probs else None,
            first if first_logit else None)


def newest(pos: Int[Array, "b *t"]) -> Int[Array, "b"]:
    """Each row's newest position in a call (`[b]` for a decode step, `[b, t]` for a prompt or a chunk)."""
    return pos if pos.ndim == 1 else jnp.max(pos, axis=1)


__all__ = ["BITS", "DECODE_BLOCK", "KVQuant", "QuantizedLayerCache", "attend", "dequantize_int8", "dequantize_keys",
           "dequantize_values", "empty", "newest", "pack", "quantize_int8", "quantize_keys", "quantize_values", "store",
           "unpack", "view", "write_token"]
