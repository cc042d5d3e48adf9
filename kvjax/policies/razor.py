"""RazorAttention (RA): full caches for retrieval heads, sinks + window + a compensation token elsewhere.

Paper Algorithm 1 (RoPE models): a non-retrieval KV head keeps the first `N0`
sink tokens and the recent `L_h = max(S0, N / C)` tokens of its `N`-token
prompt; the dropped tokens `D` are replaced by one compensation slot holding
their mean key and value (eq. 4), attended with weight `N_d` (eq. 5), which is
softmax with `log N_d` added to that slot's logit: the cache's `log_w` field.

Two decode behaviours (`fold`):

* "decode" (default): the window slides while generating and every token that
  leaves it is folded into the compensation slot as a count-weighted running
  mean, so a local head never holds more than `N0 + L_h + 1` slots.
* "prefill": the paper's Algorithm 1 taken literally: compression happens once,
  after the prompt; generated tokens are appended (the local cache has room for
  them) and nothing more is dropped.

ALiBi models (paper §3.1): each head keeps its Theorem-1 vision scope `L_h`
(`kvjax.heads.alibi_scopes`); heads whose scope exceeds the buffer `S0` are kept
whole. The paper drops beyond-scope tokens outright (their attention is below
eps), so ALiBi local heads default to no sinks and no compensation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Literal

import jax.numpy as jnp

from kvjax import cache as kvcache
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax import values
from kvjax.policies.base import (
    ChunkRule,
    LayerPolicy,
    PrefillMode,
    RatioBudget,
    check_numbers,
    check_ratio,
    ratio_option,
    sinks_option,
)
from kvjax.policies.options import Option, given, option, register
from kvjax.policies.compose import ByHead
from kvjax.policies.ring import FullCache

FOLDS = ("decode", "prefill")


def buffer_length(n, buffer: int, compression: float):
    """Paper Algorithm 1, line 2: `L_h = max(S0, N / C)` (rounded up), for an int or an int array."""
    if isinstance(n, int):
        return max(buffer, math.ceil(n / compression))
    return jnp.maximum(buffer, jnp.ceil(n / compression).astype(jnp.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompensatedWindow(RatioBudget, LayerPolicy, ChunkRule):
    """A non-retrieval head group: `sinks` + a window of `L` recent tokens + one compensation slot.

    `L` is `max(buffer, ceil(n / compression))` for a row whose prompt has `n` tokens (RoPE),
    `scopes[h]` per head (ALiBi), or with `ratio` what is left of the row's share of its prompt,
    `max(sinks + 2, floor(n (1 - ratio)))` slots in all, the compensation slot included
    (`RatioBudget`). Slot layout: sinks in slots `0..sinks-1`, the window of recent tokens after them, the
    compensation slot last (when `compensate`). Its state, per row and KV head: `recent`, the number `L` of
    recent tokens the row keeps (so rows of one batch with different prompt lengths each keep their own `L` under
    one static capacity; 0 until a prompt sets it: S0), and `folded`, the compensation slot's count `N_d` of
    tokens folded into it (its `log_w` is `log N_d`).
    """

    sinks: int = 4
    buffer: int | None = 4000
    compression: float | None = 5.0
    ratio: float | None = None
    scopes: tuple[int, ...] | None = None
    compensate: bool = True
    fold: Literal["decode", "prefill"] = "decode"

    chunk_refusal = ("fold='prefill' is Algorithm 1 taken literally: one compression once the whole prompt "
                     "(its length N) is known")

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise InvalidInput(f"RazorAttention: sinks (N0)={self.sinks} must be >= 0")
        if self.ratio is not None and (self.buffer is not None or self.compression is not None):
            raise InvalidInput(f"RazorAttention: ratio={self.ratio} sizes the local heads instead of compression (C) "
                               f"and buffer (S0); got compression={self.compression}, buffer={self.buffer}: give one")
        if self.ratio is not None and self.scopes is not None:
            raise InvalidInput("RazorAttention: ALiBi heads keep their vision scope (Theorem 1); a ratio does not apply")
        if self.ratio is None and (self.buffer is None or self.compression is None):
            raise InvalidInput("RazorAttention: give compression (C) and buffer (S0), or a ratio")
        check_ratio(self, self.buffer, "buffer")
        if self.buffer is not None and self.buffer < 1:
            raise InvalidInput(f"RazorAttention: buffer (S0)={self.buffer} must be >= 1")
        if self.compression is not None and not self.compression >= 1:
            raise InvalidInput(f"RazorAttention: compression (C)={self.compression} must be >= 1")
        if self.fold not in FOLDS:
            raise InvalidInput(f"RazorAttention: fold={self.fold!r}; expected one of {FOLDS}")
        if self.positions != "absolute":
            raise InvalidInput(
                "RazorAttention: positions must be 'absolute' (the compensation token is a mean of "
                f"keys after RoPE, eq. 4), got {self.positions!r}"
            )
        if self.scopes is not None and min(self.scopes) < 1:
            raise InvalidInput(f"RazorAttention: scopes={self.scopes} must all be >= 1")
        if self.prefill_mode == "chunked" and self.fold == "prefill":
            raise InvalidInput(f"RazorAttention cannot run prefill_mode='chunked' with {self.chunk_refusal}")
        if self.prefill_mode == "stream" and self.fold == "prefill":
            raise InvalidInput("RazorAttention: fold='prefill' compresses a whole prompt once: prefill_mode must be "
                               "'full'")

    @property
    def cache_state(self):
        return {"recent": kvcache.HEAD, **({"folded": kvcache.HEAD} if self.compensate else {})}

    def least_slots(self) -> int:
        return self.sinks + 1 + int(self.compensate)  # the sinks, one window slot, the compensation slot

    def _recent(self, prompt_len: int) -> int:
        """`L`, the recent tokens kept for a `prompt_len`-token prompt (the array's; each row's: `_row_recent`)."""
        if self.scopes is not None:
            return max(self.scopes)
        if self.ratio is not None:
            return int(self.row_slots(max(prompt_len, 1))) - self.sinks - int(self.compensate)
        # Read whole, token by token or in chunks, a prompt's length is known when the cache is sized (0: a
        # text scored piece by piece, whose N is unknown: L is S0).
        return buffer_length(prompt_len, self.buffer, self.compression)

    def _layout(self, capacity: int) -> tuple[int, int]:
        """(first window slot, end of window slots) within a cache of `capacity` slots."""
        return self.sinks, capacity - int(self.compensate)

    def capacity(self, layer, max_len, prompt_len=0):
        kept = min(self.sinks + self._recent(prompt_len), max_len)
        room = max_len - prompt_len if self.fold == "prefill" else 0
        return kept + room + int(self.compensate)

    def _row_recent(self, n, kvh, bound: int):
        """`[b, kvh]` recent tokens `L` kept per row and head (`bound`: the prompt's padded length)."""
        if self.scopes is not None:
            return jnp.broadcast_to(jnp.asarray(self.scopes, jnp.int32), (n.shape[0], kvh))
        if self.ratio is not None:
            recent = self.row_slots(n, bound) - self.sinks - int(self.compensate)
        else:
            recent = buffer_length(n, self.buffer, self.compression)
        return jnp.broadcast_to(recent[:, None], (n.shape[0], kvh))

    def size_rows(self, layer, cache: LayerCache, ctx) -> LayerCache:
        pos = ctx.pos
        # Before a prompt is read token by token or in chunks: each row's L = max(S0, N / C) of its own N (or its
        # ratio's share) is set in the cache's state, as after a full prefill.
        if self.scopes is not None:
            return cache
        return kvcache.with_state(cache, recent=self._row_recent(jnp.max(pos, axis=1) + 1, cache.pos.shape[1],
                                                                 pos.shape[1]))

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        b, kvh, t, _ = k.shape
        n = jnp.max(pos, axis=1) + 1  # real tokens per row (left padded)
        recent = self._row_recent(n, kvh, t)  # [b, kvh]
        p = pos[:, None, :]  # [b, 1, t]
        real = p >= 0
        keep = real & ((p < self.sinks) | (p >= (n[:, None, None] - recent[:, :, None])))
        dropped = real & ~keep
        _, end = self._layout(cache.capacity)
        src = kvcache.compact(keep, end)
        if self.compensate:
            src = jnp.pad(src, ((0, 0), (0, 0), (0, 1)), constant_values=-1)
        cache = kvcache.with_state(kvcache.gather_prompt(cache, k, v, pos, src), recent=recent)
        if not self.compensate:
            return cache
        count = jnp.sum(dropped, axis=-1)  # [b, kvh]
        w = dropped.astype(cache.log_w.dtype)
        mean = lambda x: jnp.einsum("bht,bhtd->bhd", w, x.astype(w.dtype)) / jnp.maximum(count, 1)[..., None]
        last = jnp.max(jnp.where(dropped, p, kvcache.EMPTY), axis=-1)  # the newest dropped position
        return _set_compensation(cache, mean(k), mean(v), count, last)

    def _decode_recent(self, cache: LayerCache, start: int, end: int):
        """`[b, kvh]` recent tokens kept while tokens arrive one by one: the prompt's `L` kept in the cache's
        state, each head's scope (ALiBi), or `S0` for a row that had no prompt (N unknown)."""
        recent = cache.state["recent"]
        if self.scopes is not None:
            recent = jnp.broadcast_to(jnp.asarray(self.scopes, recent.dtype), recent.shape)
        # A ratio's L is always set (by prefill or `size_rows`); S0 is the L of an unknown N.
        return jnp.minimum(jnp.where(recent > 0, recent, self.buffer or 1), end - start)

    # Chunked (fold="decode"): before a chunk attends, the window tokens its tokens push out are folded
    # into the compensation slot, as `step` folds one before a token attends (at chunk 1, exactly the
    # stream); then the chunk's tokens take the freed window slots (sinks their own).
    def make_room(self, layer, cache: LayerCache, ctx) -> LayerCache:
        pos = ctx.pos
        start, end = self._layout(cache.capacity)
        slots = jnp.arange(cache.capacity)
        held = (slots >= start) & (slots < end) & (cache.pos >= 0)
        arriving = jnp.sum((pos >= self.sinks), axis=1)[:, None]  # sink tokens take their own slots
        need = jnp.sum(held, axis=-1) + arriving - self._decode_recent(cache, start, end)  # [b, kvh]
        rank = jnp.argsort(jnp.argsort(jnp.where(held, cache.pos, jnp.iinfo(jnp.int32).max), axis=-1), axis=-1)
        leaving = held & (rank < need[..., None])  # the oldest window tokens
        if self.compensate:
            cache = _fold_all(cache, leaving)
        return kvcache.take_slots(cache, jnp.where(leaving, -1, slots))

    def absorb(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        start, end = self._layout(cache.capacity)
        c = cache.capacity
        both = kvcache.chunk_slots(cache, k, v, pos)  # L (the per-head state `recent`) stays the cache's
        slots = jnp.arange(c)
        chunk_pos = both.pos[..., c:]  # [b, kvh, n]
        # Sinks: slot j holds position j, from the cache or from the chunk.
        from_chunk = jnp.argmax(chunk_pos[..., None, :] == slots[:start, None], axis=-1)  # [b, kvh, sinks]
        has = jnp.any(chunk_pos[..., None, :] == slots[:start, None], axis=-1)
        sink_src = jnp.where(cache.pos[..., :start] >= 0, slots[:start], jnp.where(has, c + from_chunk, -1))
        # The window: its kept tokens, then the chunk's non-sink tokens, in the window's slots.
        in_window = jnp.concatenate([(slots >= start) & (slots < end) & (cache.pos >= 0), chunk_pos >= self.sinks], -1)
        src = [sink_src, kvcache.compact(in_window, end - start)]
        if self.compensate:
            src.append(jnp.full(sink_src.shape[:2] + (1,), c - 1, jnp.int32))
        return kvcache.take_slots(both, jnp.concatenate(src, axis=-1).astype(jnp.int32))

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos = ctx.pos
        start, end = self._layout(cache.capacity)
        slots = jnp.arange(cache.capacity)
        in_window = (slots >= start) & (slots < end)
        held = in_window & (cache.pos >= 0)
        if self.fold == "prefill":
            # Appending: the first empty window slot (capacity has room for every generated token).
            slot = jnp.argmax(in_window & (cache.pos < 0), axis=-1)
            return kvcache.write(cache, _sink_or(pos, self.sinks, slot), k, v, pos)
        recent = self._decode_recent(cache, start, end)
        full = jnp.sum(held, axis=-1) >= recent  # [b, kvh]
        oldest = jnp.argmin(jnp.where(held, cache.pos, jnp.iinfo(jnp.int32).max), axis=-1)
        empty = jnp.argmax(in_window & (cache.pos < 0), axis=-1)
        slot = jnp.where(full, oldest, empty)
        evicting = full & (pos[:, None] >= self.sinks)
        if self.compensate:
            cache = _fold(cache, slot, evicting)
        return kvcache.write(cache, _sink_or(pos, self.sinks, slot), k, v, pos)


def _sink_or(pos, sinks, slot):
    """Sink positions live in the slot of their own index; other tokens go to `slot`."""
    return jnp.where(pos[:, None] < sinks, pos[:, None], slot)


def _set_compensation(cache: LayerCache, k_hat, v_hat, count, last) -> LayerCache:
    """Writes eq. 4's mean key/value with weight `count` (`log_w = log N_d`) into the last slot."""
    some = count > 0
    dt = cache.log_w.dtype
    return kvcache.with_state(dataclasses.replace(
        cache,
        k=cache.k.at[:, :, -1].set(jnp.where(some[..., None], k_hat, 0).astype(cache.k.dtype)),
        v=cache.v.at[:, :, -1].set(jnp.where(some[..., None], v_hat, 0).astype(cache.v.dtype)),
        pos=cache.pos.at[:, :, -1].set(jnp.where(some, last, kvcache.EMPTY).astype(jnp.int32)),
        log_w=cache.log_w.at[:, :, -1].set(jnp.where(some, jnp.log(jnp.maximum(count, 1).astype(dt)), 0.0)),
    ), folded=count)


def _fold_all(cache: LayerCache, leaving) -> LayerCache:
    """Folds every slot where `leaving` (`[b, kvh, C]`) into the compensation slot: the count-weighted
    mean of the old mean and the leaving tokens, `_fold` for several tokens at once."""
    dt = cache.log_w.dtype
    count = cache.state["folded"]
    w = leaving.astype(dt)
    new = count + jnp.sum(w, axis=-1)
    mix = lambda old, x: (old.astype(dt) * count[..., None] + jnp.einsum("bhc,bhcd->bhd", w, x.astype(dt))) / \
        jnp.maximum(new, 1)[..., None]  # noqa: E731
    last = jnp.maximum(cache.pos[:, :, -1], jnp.max(jnp.where(leaving, cache.pos, kvcache.EMPTY), axis=-1))
    return _set_compensation(cache, mix(cache.k[:, :, -1], cache.k), mix(cache.v[:, :, -1], cache.v), new, last)


def _fold(cache: LayerCache, slot, evicting) -> LayerCache:
    """Folds the token in `slot` into the compensation slot where `evicting`: a count-weighted running mean."""
    idx = (jnp.arange(slot.shape[0])[:, None], jnp.arange(slot.shape[1])[None, :], slot)
    dt = cache.log_w.dtype
    count = cache.state["folded"]
    new = count + evicting
    mix = lambda old, x: (old.astype(dt) * count[..., None] + x.astype(dt) * evicting[..., None]) / jnp.maximum(new, 1)[..., None]
    k_hat, v_hat = mix(cache.k[:, :, -1], cache.k[idx]), mix(cache.v[:, :, -1], cache.v[idx])
    last = jnp.where(evicting, cache.pos[idx], cache.pos[:, :, -1])
    return _set_compensation(cache, k_hat, v_hat, new, last)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RazorAttention(ByHead):
    """RazorAttention: per layer, retrieval KV heads in a FullCache, the rest in a CompensatedWindow.

    `retrieval[layer][kv_head]` marks the retrieval heads (`kvjax.heads`). For ALiBi
    models give `scopes[layer][kv_head]` (Theorem 1's `L_h`) instead: heads whose
    scope exceeds `buffer` are retrieval heads, the others keep their scope, in
    groups of power-of-two capacity so a layer has few arrays.
    """

    retrieval: tuple[tuple[bool, ...], ...] | None = None
    scopes: tuple[tuple[int, ...], ...] | None = None
    compression: float | None = option(None, type=values.positive_float,  # C; Table 2: buffer max(4000, N / 5)
                                       help="RazorAttention: C, local heads keep max(S0, N / C); 5 unless a ratio "
                                            "is given")
    buffer: int | None = option(None, type=values.positive_int,  # S0; 4000 without a ratio
                                help="RazorAttention: S0, the least window of a local head; 4000 unless a ratio is "
                                     "given")
    # Instead of C and S0: a local head keeps this share of each row's prompt (`CompensatedWindow`).
    ratio: float | None = ratio_option()
    sinks: int = sinks_option(4)  # N0
    compensate: bool = option(True, flag="--no-compensation", dest="compensate", const=False,
                              help="RazorAttention: drop tokens without the compensation token")
    fold: Literal["decode", "prefill"] = option("decode", choices=("decode", "prefill"),
                                                help="RazorAttention: fold tokens leaving the window while decoding, "
                                                     "or compress the prompt only and append generated tokens (the "
                                                     "paper's Algorithm 1)")
    # The model's sliding window (`on_sliding_window`): its retrieval heads then keep a ring of that many
    # slots, all such a model can still attend to, instead of the whole context.
    sliding_window: int | None = None
    # "full" (Algorithm 1: L = max(S0, N / C) from the prompt's length N), or the prompt read token by
    # token ("stream") or in chunks ("chunked", `chunk`): local heads keep the same max(S0, N / C), the
    # prompt's length being known before it is read (a text scored piece by piece: S0).
    prefill_mode: PrefillMode = "full"
    chunk: int | None = None

    def __post_init__(self):
        check_numbers(self)
        if self.ratio is None:  # the paper's Table 2 sizes, unless a ratio replaces them
            object.__setattr__(self, "compression", 5.0 if self.compression is None else self.compression)
            object.__setattr__(self, "buffer", 4000 if self.buffer is None else self.buffer)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise InvalidInput(f"RazorAttention: sliding_window={self.sliding_window} must be >= 1")
        if (self.retrieval is None) == (self.scopes is None):
            raise InvalidInput("RazorAttention: give exactly one of retrieval (RoPE heads) or scopes (ALiBi)")
        if self.ratio is not None and self.scopes is not None:
            raise InvalidInput("RazorAttention: ALiBi heads keep their vision scope (Theorem 1); a ratio does not apply")
        rows = self.retrieval if self.retrieval is not None else self.scopes
        if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
            raise InvalidInput("RazorAttention: the head table must have the same non-zero number of heads per layer")
        # Validates the shared hyper-parameters once, with the paper's names in the messages.
        CompensatedWindow(sinks=self.sinks, buffer=self.buffer, compression=self.compression, ratio=self.ratio,
                          compensate=self.compensate, fold=self.fold, prefill_mode=self.prefill_mode, chunk=self.chunk)

    def _num_layers(self):
        return len(self.retrieval if self.retrieval is not None else self.scopes)

    def _num_kv_heads(self):
        return len((self.retrieval if self.retrieval is not None else self.scopes)[0])

    def check(self, num_layers, num_kv_heads=None):
        if num_layers != self._num_layers() or (num_kv_heads is not None and num_kv_heads != self._num_kv_heads()):
            raise InvalidInput(
                f"RazorAttention: the heads table is {self._num_layers()} layers x {self._num_kv_heads()} KV heads, "
                f"the model has {num_layers} layers x {num_kv_heads} KV heads"
            )
        super().check(num_layers, num_kv_heads)

    def is_retrieval(self, layer: int, head: int) -> bool:
        if self.retrieval is not None:
            return bool(self.retrieval[layer][head])
        return self.scopes[layer][head] > self.buffer

    def head_split(self, layer):
        heads = range(self._num_kv_heads())
        full = tuple(h for h in heads if self.is_retrieval(layer, h))
        local = [h for h in heads if not self.is_retrieval(layer, h)]
        modes = dict(prefill_mode=self.prefill_mode, chunk=self.chunk)
        whole = FullCache(**modes)
        whole = whole if self.sliding_window is None else whole.on_sliding_window(self.sliding_window)
        split = [(full, whole)] if full else []
        common = dict(sinks=self.sinks, buffer=self.buffer, compression=self.compression, ratio=self.ratio,
                      compensate=self.compensate, fold=self.fold, **modes)
        if self.scopes is None:
            if local:
                split.append((tuple(local), CompensatedWindow(**common)))
            return tuple(split)
        buckets: dict[int, list[int]] = {}
        for h in local:  # ALiBi: heads of similar scope share an array
            buckets.setdefault(1 << max(0, math.ceil(math.log2(self.scopes[layer][h]))), []).append(h)
        for _, hs in sorted(buckets.items()):
            split.append((tuple(hs), CompensatedWindow(**common, scopes=tuple(self.scopes[layer][h] for h in hs))))
        return tuple(split)

    def on_sliding_window(self, window):
        return dataclasses.replace(self, sliding_window=window if self.sliding_window is None
                                   else min(window, self.sliding_window))

    def describe(self):
        table = self.retrieval if self.retrieval is not None else self.scopes
        n_ret = sum(self.is_retrieval(i, h) for i in range(len(table)) for h in range(len(table[0])))
        kind = "retrieval" if self.retrieval is not None else "ALiBi scopes"
        # which heads, not only how many: two head tables must never share a description (records are keyed by it)
        digest = hashlib.sha1(repr(table).encode()).hexdigest()[:8]
        return (f"RazorAttention({kind} {digest}: {n_ret}/{len(table) * len(table[0])} KV heads kept whole, "
                + (f"ratio={self.ratio}, " if self.ratio is not None else
                   f"compression={self.compression}, buffer={self.buffer}, ") + f"sinks={self.sinks}, "
                f"compensate={self.compensate}, fold={self.fold!r}"
                + ("" if self.sliding_window is None else f", sliding_window={self.sliding_window}")
                + ("" if self.prefill_mode == "full" else f", prefill_mode={self.prefill_mode!r}")
                + ("" if self.chunk is None else f", chunk={self.chunk}") + ")")


def razor_from_heads(
    heads,
    *,
    compression: float | None = None,
    buffer: int | None = None,
    ratio: float | None = None,
    sinks: int | None = None,
    compensate: bool | None = None,
    fold: Literal["decode", "prefill"] = "decode",
    prefill_mode: PrefillMode = "full",
    chunk: int | None = None,
) -> RazorAttention:
    """RazorAttention from a heads file (path or `kvjax.heads.load_heads` dict).

    A RoPE file names the retrieval KV heads; an ALiBi file gives every KV head's
    vision scope. Unset `sinks` / `compensate` follow the paper: 4 sinks and a
    compensation token for RoPE (Algorithm 1), neither for ALiBi (§3.1 keeps the
    recent `L_h` tokens only).
    """
    from kvjax.heads import load_heads

    if heads is None:
        raise InvalidInput("RazorAttention needs a heads file (--heads, from python -m kvjax.experiments.find_heads)")
    data = heads if isinstance(heads, dict) else load_heads(heads)
    alibi = "kv_scopes" in data
    common = dict(
        compression=compression, buffer=buffer, ratio=ratio, fold=fold, prefill_mode=prefill_mode, chunk=chunk,
        sinks=sinks if sinks is not None else (0 if alibi else 4),
        compensate=compensate if compensate is not None else not alibi,
    )
    table = data["kv_scopes"] if alibi else data["retrieval_kv_heads"]
    if len(table) != data["num_layers"] or any(len(r) != data["num_kv_heads"] for r in table):
        raise InvalidInput(
            f"heads file: its table is not {data['num_layers']} layers x {data['num_kv_heads']} KV heads as it declares"
        )
    if alibi and data.get("control") is not None:
        # A Table 1 control on an ALiBi model: the control's heads (`retrieval_kv_heads`) are kept whole and
        # every other head keeps its scope, at most S0, so the control decides which heads are protected
        # (without this, each head's scope would decide it and the control would change nothing).
        s0 = buffer if buffer is not None else 4000
        protected = data["retrieval_kv_heads"]
        whole = 2**31 - 1  # any scope beyond S0 is kept whole
        table = [[whole if keep else min(int(x), s0) for x, keep in zip(r, p)] for r, p in zip(table, protected)]
    if alibi:
        return RazorAttention(scopes=tuple(tuple(int(x) for x in r) for r in table), **common)
    return RazorAttention(retrieval=tuple(tuple(bool(x) for x in r) for r in table), **common)


# ---- registration ------------------------------------------------------------------------------------------------

HEADS = Option(help="RazorAttention: the heads file from python -m kvjax.experiments.find_heads (kvjax-small ships its "
                    "own)")


def _razor(budget, heads=None, compression=None, buffer=None, ratio=None, sinks=None, compensate=None, fold=None,
           prefill_mode=None, chunk=None) -> RazorAttention:
    # No token budget: --compression C and --buffer S0 set the local heads' window (default 5 and 4000), or --ratio
    # the share of each prompt a local head keeps
    return razor_from_heads(heads, compression=compression, buffer=buffer, ratio=ratio, sinks=sinks,
                            compensate=compensate, **given(fold=fold, prefill_mode=prefill_mode, chunk=chunk))


def _razor_table1(budget, heads=None, buffer=None, prefill_mode=None, chunk=None) -> RazorAttention:
    # Table 1's protocol: the heads of the table kept whole, every other head "only the recent 4K tokens" (--buffer
    # S0, default 4000): no sinks, no compensation token, no N / C
    return razor_from_heads(heads, compression=math.inf, buffer=buffer if buffer is not None else 4000, sinks=0,
                            compensate=False, **given(prefill_mode=prefill_mode, chunk=chunk))


register("razor", build=_razor, classes=(RazorAttention, LayerPolicy), options={"heads": HEADS}, budget=False,
         paper="RazorAttention (papers/)", docs="policies/razor.md", chunked="window max(S0, N/C) in every mode",
         memory="real, head-wise arrays")
register("razor-table1", build=_razor_table1, classes=(RazorAttention, LayerPolicy), options={"heads": HEADS},
         budget=False, paper="RazorAttention Table 1's protocol", docs="policies/razor.md",
         chunked="window max(S0, N/C) in every mode", memory="real, head-wise arrays")
