"""The KV cache: a static-capacity pytree per layer.

Every array has a fixed slot count `C`, chosen by the policy from its budget, so
prefill and decode compile once per shape. Slots are identified by the absolute
position of the token they hold (`pos`, -1 when empty); masks are built from
`pos`, never from slot indices, which is what lets a ring buffer wrap, a policy
evict anywhere, and ALiBi / rolling RoPE stay right after eviction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

EMPTY = -1
# A slot its row may not use: a ratio budget gives each row its own slot count inside one array
# (`kvjax.policies.ring`). Invalid to attention (pos < 0), never filled by `append`.
DISABLED = -2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's cache.

    k, v:  [batch, kv_heads, C, head_dim]  keys (rotated or not, see the policy's
           `positions` mode) and values.
    pos:   [batch, kv_heads, C] int32  absolute position of each slot's token, -1 empty.
    log_w: [batch, kv_heads, C] f32    additive logit bias (log N_d for a compensation slot).
    state: the caching rule's own statistics, each named for what it holds (`Rule.cache_state`): per
           slot `[batch, kv_heads, C]` (H2O's "mass", MAT's "pi"), moving with its slot, or per KV head
           `[batch, kv_heads]` (RazorAttention's window length and folded-token count), which slot
           operations leave alone. A rule with none carries none.
    (log_w and the state are float64 in a float64 model.)
    """

    k: Float[Array, "b kvh c d"]
    v: Float[Array, "b kvh c d"]
    pos: Int[Array, "b kvh c"]
    log_w: Float[Array, "b kvh c"]
    state: dict[str, Float[Array, "b kvh *c"]] = dataclasses.field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return tree_nbytes(self)

    def held_bytes(self) -> np.ndarray:
        """`[b]` bytes of keys and values in the slots holding a token (pos >= 0), per row (`kvjax.cache.held_bytes`)."""
        valid = np.asarray(self.pos) >= 0
        return valid.sum(axis=(1, 2)) * (2 * self.k.shape[-1] * self.k.dtype.itemsize)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values at every KV head, unquantized (the full cache's per token)."""
        return 2 * self.k.shape[1] * self.k.shape[-1] * self.k.dtype.itemsize


def tree_nbytes(tree) -> int:
    """Bytes of every array leaf of `tree` (shapes only: works on abstract values too)."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class HeadwiseCache:
    """One layer's cache split by KV head into groups of different capacity.

    `groups[i]` holds KV heads `heads[i]` (a static tuple of head indices) in a
    LayerCache of its own capacity: RazorAttention's retrieval heads keep every
    token while local heads keep a few slots, and the bytes are really saved
    instead of a full-size cache being masked.
    """

    groups: tuple[LayerCache, ...]
    heads: tuple[tuple[int, ...], ...]

    @property
    def capacity(self) -> int:
        """The largest group's slot count."""
        return max(g.capacity for g in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def num_kv_heads(self) -> int:
        return sum(len(h) for h in self.heads)

    def held_bytes(self) -> np.ndarray:
        return sum(g.held_bytes() for g in self.groups)

    @property
    def token_bytes(self) -> int:
        return sum(g.token_bytes for g in self.groups)

    def positions(self) -> np.ndarray:
        """`[b, kvh, C_max]` slot positions in head order, groups padded with -1 to the largest capacity."""
        b = self.groups[0].pos.shape[0]
        out = np.full((b, self.num_kv_heads, self.capacity), EMPTY, np.int32)
        for heads, g in zip(self.heads, self.groups):
            out[:, list(heads), : g.capacity] = np.asarray(g.pos)
        return out


jax.tree_util.register_dataclass(HeadwiseCache, data_fields=["groups"], meta_fields=["heads"])


@dataclasses.dataclass(frozen=True)
class PooledLayerCache:
    """One layer's cache whose KV heads share one pool of slots, so each head holds its own number of tokens and
    the layer's bytes are the sum of its heads' counts (AdaKV's per-head budgets, `kvjax.policies.AdaKV`),
    not `kv_heads x` the largest count.

    k, v:  [batch, P, head_dim]  keys (rotated at absolute positions) and values.
    pos:   [batch, P] int32      position of each slot's token, -1 empty.
    head:  [batch, P] int32      the KV head that owns the slot, -1 empty.
    Two regions: the prompt's kept tokens in the first `P - num_kv_heads x room` slots, head by head in time
    order (a head's slots are one run, so a kernel reads only its own), then `room` slots per head, head by head,
    for the tokens decoded. `num_kv_heads` and `room` are static."""

    k: Float[Array, "b p d"]
    v: Float[Array, "b p d"]
    pos: Int[Array, "b p"]
    head: Int[Array, "b p"]
    num_kv_heads: int
    room: int

    @property
    def capacity(self) -> int:
        """Slots of the pool (all heads together)."""
        return self.k.shape[1]

    @property
    def prompt_slots(self) -> int:
        return self.capacity - self.num_kv_heads * self.room

    @property
    def nbytes(self) -> int:
        return tree_nbytes(self)

    def held_bytes(self) -> np.ndarray:
        valid = np.asarray(self.pos) >= 0
        return valid.sum(axis=1) * (2 * self.k.shape[-1] * self.k.dtype.itemsize)

    @property
    def token_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.k.shape[-1] * self.k.dtype.itemsize

    def positions(self) -> np.ndarray:
        """`[b, kvh, P]` each head's positions (-1 in the slots it does not own)."""
        pos, head = np.asarray(self.pos), np.asarray(self.head)
        return np.stack([np.where(head == h, pos, EMPTY) for h in range(self.num_kv_heads)], axis=1)

    def runs(self) -> Int[Array, "b kvh 2 2"]:
        """Each head's two runs of slots, `(start, length)`: its kept prompt tokens, then its decode slots (of
        which the empty ones have pos -1)."""
        b, kvh, p0 = self.pos.shape[0], self.num_kv_heads, self.prompt_slots
        count = jnp.sum(self.head[:, None, :p0] == jnp.arange(kvh, dtype=jnp.int32)[None, :, None], axis=-1)
        start = jnp.cumsum(count, axis=-1) - count  # [b, kvh]
        decode_start = jnp.broadcast_to(p0 + self.room * jnp.arange(kvh, dtype=jnp.int32), (b, kvh))
        return jnp.stack([jnp.stack([start, count], -1),
                          jnp.stack([decode_start, jnp.full((b, kvh), self.room, jnp.int32)], -1)], 2).astype(jnp.int32)


jax.tree_util.register_dataclass(PooledLayerCache, data_fields=["k", "v", "pos", "head"],
                                 meta_fields=["num_kv_heads", "room"])


def empty_pool(batch: int, kv_heads: int, prompt_slots: int, room: int, head_dim: int, dtype) -> PooledLayerCache:
    """An empty pool of `prompt_slots` (all heads' kept prompt tokens together) + `kv_heads x room` slots."""
    slots = prompt_slots + kv_heads * room
    return PooledLayerCache(k=jnp.zeros((batch, slots, head_dim), dtype), v=jnp.zeros((batch, slots, head_dim), dtype),
                            pos=jnp.full((batch, slots), EMPTY, jnp.int32),
                            head=jnp.full((batch, slots), EMPTY, jnp.int32), num_kv_heads=kv_heads, room=room)


def pool_prompt(cache: PooledLayerCache, k: Float[Array, "b kvh t d"], v: Float[Array, "b kvh t d"],
                pos: Int[Array, "b t"], keep: Bool[Array, "b kvh t"]) -> PooledLayerCache:
    """The kept (head, token) pairs of a prompt in the empty pool's prompt region, head by head in time order;
    the decode region empty."""
    b, kvh, t, d = k.shape
    src = compact(keep.reshape(b, 1, kvh * t), cache.prompt_slots)[:, 0]  # flat (head, token) index, -1 empty
    src = jnp.pad(src, ((0, 0), (0, cache.capacity - cache.prompt_slots)), constant_values=-1)
    ok = src >= 0
    idx = jnp.where(ok, src, 0)
    take = lambda x: jnp.take_along_axis(x.reshape(b, kvh * t, d), idx[..., None], axis=1)  # noqa: E731
    flat_pos = jnp.broadcast_to(pos[:, None, :], (b, kvh, t)).reshape(b, kvh * t)
    return dataclasses.replace(
        cache, k=jnp.where(ok[..., None], take(k), 0).astype(cache.k.dtype),
        v=jnp.where(ok[..., None], take(v), 0).astype(cache.v.dtype),
        pos=jnp.where(ok, jnp.take_along_axis(flat_pos, idx, axis=1), EMPTY),
        head=jnp.where(ok, idx // t, EMPTY).astype(jnp.int32))


def pool_append(cache: PooledLayerCache, k: Float[Array, "b kvh d"], v: Float[Array, "b kvh d"],
                pos: Int[Array, "b"]) -> PooledLayerCache:
    """One token per (row, KV head) into the head's next decode slot; rows with pos < 0 unchanged (as a token
    beyond the plan's room, which sized the region for every token to decode)."""
    b, kvh = k.shape[:2]
    p0, room = cache.prompt_slots, cache.room
    filled = jnp.sum(cache.pos[:, p0:].reshape(b, kvh, room) >= 0, axis=-1)  # [b, kvh]
    slot = p0 + room * jnp.arange(kvh)[None, :] + filled
    slot = jnp.where((pos[:, None] >= 0) & (filled < room), slot, cache.capacity)  # out of range -> dropped
    rows = jnp.arange(b)[:, None]
    return dataclasses.replace(
        cache, k=cache.k.at[rows, slot].set(k.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[rows, slot].set(v.astype(cache.v.dtype), mode="drop"),
        pos=cache.pos.at[rows, slot].set(jnp.broadcast_to(pos[:, None], (b, kvh)), mode="drop"),
        head=cache.head.at[rows, slot].set(jnp.broadcast_to(jnp.arange(kvh, dtype=jnp.int32), (b, kvh)), mode="drop"))


AnyLayerCache = LayerCache | HeadwiseCache | PooledLayerCache
Cache = tuple[AnyLayerCache, ...]
"""A model's cache: one layer cache per layer (a `LayerCache`, a `HeadwiseCache` when the plan splits the
layer's KV heads into groups, a `PooledLayerCache` for AdaKV's per-head budgets, or a quantized layer cache under
`Quantized`), a pytree."""


# The two kinds of a rule's named statistics (`Rule.cache_state`): one value per slot, or per KV head.
SLOT, HEAD = "slot", "head"


def empty(batch: int, kv_heads: int, capacity: int, head_dim: int, dtype,
          state: Mapping[str, str] = MappingProxyType({})) -> LayerCache:
    """An empty layer cache with the statistics `state` names (`{name: SLOT | HEAD}`, a rule's `cache_state`),
    zero."""
    shape = (batch, kv_heads, capacity)
    stat = jnp.promote_types(dtype, jnp.float32)  # float32, or float64 for float64 models
    for name, kind in state.items():
        if kind not in (SLOT, HEAD):
            raise ValueError(f"cache state {name!r}: kind {kind!r}; expected {SLOT!r} or {HEAD!r}")
    return LayerCache(
        k=jnp.zeros((*shape, head_dim), dtype),
        v=jnp.zeros((*shape, head_dim), dtype),
        pos=jnp.full(shape, EMPTY, jnp.int32),
        log_w=jnp.zeros(shape, stat),
        state={name: jnp.zeros(shape if kind == SLOT else shape[:2], stat) for name, kind in state.items()},
    )


def with_state(cache: LayerCache, **values: Array) -> LayerCache:
    """`cache` with the named statistics of its rule replaced (each cast to its own dtype and shape); a name the
    cache does not hold is an error, not a new array (its pytree is fixed when the engine allocates it)."""
    missing = sorted(set(values) - set(cache.state))
    if missing:
        raise KeyError(f"state {missing} is not in this cache (it holds {sorted(cache.state)}: the rule's "
                       "cache_state names what it keeps)")
    state = {n: jnp.broadcast_to(values[n], x.shape).astype(x.dtype) if n in values else x
             for n, x in cache.state.items()}
    return dataclasses.replace(cache, state=state)


def per_slot(x: Array) -> bool:
    """Whether a state array is per slot (`[b, kvh, C]`) rather than per KV head (`[b, kvh]`)."""
    return x.ndim == 3


def gather_prompt(
    cache: LayerCache,
    k: Float[Array, "b kvh t d"],
    v: Float[Array, "b kvh t d"],
    pos: Int[Array, "b t"],
    src: Int[Array, "b kvh c"],
    state: Mapping[str, Float[Array, "b kvh t"]] | None = None,
) -> LayerCache:
    """Fills every slot of the (empty) `cache` from prompt index `src` (a time index into k/v), or
    empties it (src < 0).

    The one gather every prefill compression shares: a policy only decides `src`
    (and, optionally, per-token values of its per-slot `state` that its slots start with).
    """
    return take_slots(as_slots(cache, k, v, pos, state), src)


def keep_top(score: Array, real: Array, always: Array, n_keep: Array) -> Array:
    """Keep-mask `[b, kvh, t]`: the `always` tokens, then the highest `score` among the other real
    tokens (ties: the earlier), `n_keep` per row in all (broadcastable `[b, 1, 1]`)."""
    s = jnp.where(always, jnp.inf, jnp.where(real, score, -jnp.inf))
    rank = jnp.argsort(jnp.argsort(-s, axis=-1, stable=True), axis=-1)
    return real & (rank < n_keep)


def victim_slot(cache: LayerCache, by: Float[Array, "b kvh c"], candidate: Array,
                evict_highest: bool) -> Int[Array, "b kvh"]:
    """The slot a new token takes: the first empty one, else the `candidate` slot with the highest
    (or lowest) statistic `by` (H2O's mass, MAT's pi), ties going to the oldest token. Shared by the
    evicting policies."""
    fill = -jnp.inf if evict_highest else jnp.inf
    key = jnp.where(candidate, by, fill)
    best = jnp.max(key, axis=-1, keepdims=True) if evict_highest else jnp.min(key, axis=-1, keepdims=True)
    victim = jnp.argmin(jnp.where(candidate & (key == best), cache.pos, jnp.iinfo(jnp.int32).max), axis=-1)
    empty = cache.pos == EMPTY  # a DISABLED slot is not free: its row's budget excludes it
    return jnp.where(jnp.any(empty, axis=-1), jnp.argmax(empty, axis=-1), victim)


def concat_slots(a: LayerCache, b: LayerCache) -> LayerCache:
    """`a`'s slots followed by `b`'s (same batch, heads, head_dim and state names); per-head state is `a`'s."""
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=2) if x.ndim > 2 else x, a, b)


def compact(keep: Array, capacity: int, *, right: bool = False) -> Int[Array, "b kvh c"]:
    """Time indices of the kept tokens (`keep`: bool `[b, kvh, t]`), in time order, padded with -1.

    Turns any keep-mask with at most `capacity` True per row into `gather_prompt`'s `src`.
    `right`: the kept tokens fill the last slots and the -1 come first (`capacity <= t`).
    """
    t = keep.shape[-1]
    if right:
        order = jnp.argsort(keep, axis=-1, stable=True)[..., t - capacity:]
        return jnp.where(jnp.take_along_axis(keep, order, axis=-1), order, -1).astype(jnp.int32)
    order = jnp.argsort(~keep, axis=-1, stable=True)[..., :capacity]
    src = jnp.where(jnp.take_along_axis(keep, order, axis=-1), order, -1).astype(jnp.int32)
    if capacity > t:  # room for decoded tokens beyond the prompt: empty slots
        src = jnp.pad(src, [(0, 0)] * (src.ndim - 1) + [(0, capacity - t)], constant_values=-1)
    return src


def as_slots(
    like: LayerCache,
    k: Float[Array, "b kvh n d"],
    v: Float[Array, "b kvh n d"],
    pos: Int[Array, "b n"],
    state: Mapping[str, Float[Array, "b kvh n"]] | None = None,
) -> LayerCache:
    """Tokens as cache slots of `like`'s dtypes and state names: their positions, the per-slot `state` given
    (else 0; a name `like` lacks is an error), `like`'s per-head state, no bias."""
    shape = k.shape[:3]
    given = dict(state or {})
    if set(given) - set(like.state):
        raise KeyError(f"state {sorted(set(given) - set(like.state))} is not in this cache (it holds "
                       f"{sorted(like.state)}: the rule's cache_state names what it keeps)")
    return LayerCache(
        k=k.astype(like.k.dtype),
        v=v.astype(like.v.dtype),
        pos=jnp.broadcast_to(pos[:, None, :], shape).astype(jnp.int32),
        log_w=jnp.zeros(shape, like.log_w.dtype),
        state={n: (jnp.broadcast_to(given[n], shape).astype(x.dtype) if n in given else jnp.zeros(shape, x.dtype))
               if per_slot(x) else x for n, x in like.state.items()},
    )


def chunk_slots(
    cache: LayerCache, k: Float[Array, "b kvh n d"], v: Float[Array, "b kvh n d"], pos: Int[Array, "b n"]
) -> LayerCache:
    """`cache`'s slots followed by a chunk's tokens as slots (state 0, no bias): the candidates a
    chunked prefill folds back into `cache.capacity` slots, in the key order of the chunk's attention."""
    return concat_slots(cache, as_slots(cache, k, v, pos))


def take_slots(cache: LayerCache, src: Int[Array, "b kvh c"]) -> LayerCache:
    """Slot `j` of the result is `cache`'s slot `src[..., j]`, or empty where `src < 0`."""
    take = jnp.maximum(src, 0)
    keep = src >= 0
    pick = lambda x: jnp.take_along_axis(x, take[..., None] if x.ndim == 4 else take, axis=2)  # noqa: E731
    return LayerCache(
        k=jnp.where(keep[..., None], pick(cache.k), 0).astype(cache.k.dtype),
        v=jnp.where(keep[..., None], pick(cache.v), 0).astype(cache.v.dtype),
        pos=jnp.where(keep, pick(cache.pos), EMPTY).astype(jnp.int32),
        log_w=jnp.where(keep, pick(cache.log_w), 0.0).astype(cache.log_w.dtype),
        state={n: jnp.where(keep, pick(x), 0.0).astype(x.dtype) if per_slot(x) else x for n, x in cache.state.items()},
    )


def limit_rows(cache: LayerCache, rows: Int[Array, "b"] | Int[Array, "b kvh"]) -> LayerCache:
    """`cache` with each row's slots at and past its own count `rows` DISABLED: how a ratio budget gives
    rows of one batch their own slot counts inside one static array."""
    rows = jnp.asarray(rows)
    rows = rows[:, None, None] if rows.ndim == 1 else rows[..., None]
    beyond = jnp.arange(cache.capacity) >= rows
    return dataclasses.replace(cache, pos=jnp.where(beyond, DISABLED, cache.pos).astype(jnp.int32))


def select(which: Array, a: LayerCache, b: LayerCache) -> LayerCache:
    """Per (row, KV head) (`which`: bool `[b, kvh, 1]`), `a`'s slots (and per-head state) where true, else `b`'s."""
    return jax.tree.map(lambda x, y: jnp.where(which.reshape(which.shape[:2] + (1,) * (x.ndim - 2)), x, y), a, b)


def write(
    cache: LayerCache,
    slot: Int[Array, "b kvh"],
    k: Float[Array, "b kvh d"],
    v: Float[Array, "b kvh d"],
    pos: Int[Array, "b"],
    state: Mapping[str, Float[Array, "b kvh"] | float] | None = None,
) -> LayerCache:
    """Writes one token per (row, KV head) into `slot`, its per-slot state the values given (else 0; per-head
    state is left alone); rows with pos < 0 are left unchanged.

    A scatter (O(head_dim) per head), so a donated cache is updated in place.
    """
    b, h = slot.shape
    slot = jnp.where(pos[:, None] >= 0, slot, cache.capacity)  # out of range -> dropped
    idx = (jnp.arange(b)[:, None], jnp.arange(h)[None, :], slot)
    given = dict(state or {})
    if set(given) - {n for n, x in cache.state.items() if per_slot(x)}:
        raise KeyError(f"write: {sorted(given)} are not per-slot state of this cache ({sorted(cache.state)})")
    value = lambda n, x: jnp.broadcast_to(jnp.asarray(given.get(n, 0.0), x.dtype), (b, h))  # noqa: E731
    return LayerCache(
        k=cache.k.at[idx].set(k.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[idx].set(v.astype(cache.v.dtype), mode="drop"),
        pos=cache.pos.at[idx].set(jnp.broadcast_to(pos[:, None], (b, h)).astype(jnp.int32), mode="drop"),
        log_w=cache.log_w.at[idx].set(0.0, mode="drop"),
        state={n: x.at[idx].set(value(n, x), mode="drop") if per_slot(x) else x for n, x in cache.state.items()},
    )


def append(cache: LayerCache, k: Float[Array, "b kvh d"], v: Float[Array, "b kvh d"], pos: Int[Array, "b"]):
    """Writes one token per row into the first free slot: the decode step of the policies that
    compress at prefill only and size the cache with a slot for every decoded token."""
    return write(cache, jnp.argmax(cache.pos == EMPTY, axis=-1), k, v, pos)


def ranks(pos: Int[Array, "... c"]) -> Int[Array, "... c"]:
    """Rank of each valid slot among the valid slots of its row, by position; -1 if empty.

    Rolling mode rotates keys by this rank (StreamingLLM's "positions within the
    cache"), so a cache of C slots never sees a position >= C.
    """
    valid = pos >= 0
    key = jnp.where(valid, pos, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=-1)
    rank = jnp.argsort(order, axis=-1).astype(jnp.int32)
    return jnp.where(valid, rank, EMPTY)


def kept_positions(cache: Cache) -> list[np.ndarray]:
    """The inspection API: per layer, `[batch, kv_heads, C]` positions held, sorted, -1 last.

    Sorting makes the result independent of slot layout, so it can be compared
    with a plain-Python reference of any policy.
    """
    out = []
    for layer in cache:
        p = layer.positions() if isinstance(layer, HeadwiseCache | PooledLayerCache) else np.asarray(layer.pos)
        out.append(np.sort(np.where(p < 0, np.iinfo(np.int32).max, p), axis=-1))
        out[-1] = np.where(out[-1] == np.iinfo(np.int32).max, EMPTY, out[-1])
    return out


def kept_sets(cache: Cache, row: int = 0) -> list[list[list[int]]]:
    """Per layer, per KV head, the sorted list of positions kept for batch row `row`."""
    return [[[int(p) for p in head if p >= 0] for head in layer[row]] for layer in kept_positions(cache)]


def nbytes(cache: Cache) -> int:
    return sum(layer.nbytes for layer in cache)


def held_bytes(cache: Cache) -> np.ndarray:
    """`[b]` the KV bytes each row's cache really holds: per layer, the keys and values of its slots that hold a
    token (pos >= 0), not the slots allocated. Empty and DISABLED slots, and slots a policy emptied (KVzip, a
    ratio budget's spare rows), count nothing; a head-wise cache (RazorAttention, DuoAttention) counts each group's
    own slots, a pooled one (AdaKV) its valid pool slots, a quantized one its codes, scales and zeros and the
    residual's full-precision tokens (`kvjax.quant.QuantizedLayerCache.held_bytes`). Positions, logit biases and a
    rule's statistics are bookkeeping, not KV, and are not counted (nor in `full_bytes`)."""
    return np.asarray(sum(layer.held_bytes() for layer in cache), np.int64)


def full_bytes(cache: Cache, tokens) -> np.ndarray:
    """The full cache's KV bytes for `tokens` tokens per row (an int or `[b]`): every token's keys and values at
    every layer and KV head, in the model's dtype."""
    return np.asarray(tokens, np.int64) * sum(layer.token_bytes for layer in cache)


def held_fraction(cache: Cache, tokens) -> np.ndarray:
    """`[b]` `held_bytes / full_bytes`: the share of the full cache's KV bytes for the same `tokens` that `cache`
    holds (1 for the full cache; what every policy reports as its compression, whatever its own ratio means)."""
    return held_bytes(cache) / np.maximum(full_bytes(cache, tokens), 1)


def num_slots(cache: Cache) -> int:
    """Slots per sequence, summed over layers and KV heads."""
    groups = [g for layer in cache for g in (layer.groups if isinstance(layer, HeadwiseCache) else (layer,))]
    return sum(g.capacity if isinstance(g, PooledLayerCache) else g.pos.shape[1] * g.capacity for g in groups)
