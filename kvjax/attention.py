"""Attention as the model calls it: one place that chooses the code each call runs.

`impl="xla"` runs the jnp reference (`kvjax.reference`, the specification); `impl="pallas"` runs
the kernels of `kvjax.pallas`, checked against it, and a prompt's plain causal attention goes to the
platform's own flash attention instead: cuDNN's on a GPU, jax's splash attention on a TPU (`prefill_route`). A kernel that cannot do what a call asks
raises (soft-capping) or runs the reference and says so once (a warning); it never falls back silently.

Layouts, masks and statistics are the reference's: see `kvjax.reference` and `kvjax.masks`.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from kvjax import pallas as kernels
from kvjax import quant, reference
from kvjax.errors import InvalidInput
from kvjax.pallas import pool_decode, quant_decode
from kvjax.masks import CAUSAL, AnchorMask, Mask
from kvjax.reference import PREFILL_BLOCK, alibi_slopes
from kvjax.stats import NO_STATS, AttentionStats, StatsRequest

# Replay queries per block (`replay_attention`): bounds its logits to [block, c + t] per query head. 64, 128 and
# 256 time the same on a CPU (SmolLM2, 4K context); the smallest of them with whole blocks keeps the temporaries small.
REPLAY_BLOCK = 128

__all__ = ["CAUSAL", "IMPLS", "PREFILL_BLOCK", "SPLASH_BLOCKS", "AnchorMask", "Mask", "alibi_slopes", "check_impl", "reconstruction_scores",
           "cudnn_prefill", "decode_attention", "splash_block", "splash_prefill",
           "pooled_decode_attention", "prompt_statistics", "prefill_attention", "prefill_route", "prefix_attention",
           "quantized_decode_attention", "replay_attention", "warn_once"]

# "xla": the jnp reference; "pallas": the kernels of kvjax.pallas (and cuDNN, see `prefill_route`).
IMPLS = ("xla", "pallas")


def _sharding_mesh():
    """`(mesh, data axis, model axis)` of the mesh set by `jax.set_mesh`, each axis None unless it has more than
    one device; `(None, None, None)` when nothing is split."""
    from kvjax.sharding import DATA, MODEL

    mesh = jax.sharding.get_abstract_mesh()
    axes = {} if mesh.empty else dict(mesh.shape)
    data = DATA if axes.get(DATA, 1) > 1 else None
    model = MODEL if axes.get(MODEL, 1) > 1 else None
    return (None, None, None) if data is None and model is None else (mesh, data, model)


def per_shard(fn, *args, layouts: tuple[str, ...], out: tuple[str, ...]):
    """`fn(*args)` (a Pallas kernel call, which XLA cannot partition) run on each device's shard of a mesh set
    with `jax.set_mesh` whose "data" or "model" axis has more than one device: `jax.shard_map` with each array's
    leading axes placed by its layout ("b": the batch over "data", "h": heads over "model", ".": whole), the
    Megatron split of `kvjax.sharding` (whole heads per device, a GQA group with its KV head). Without such a
    mesh, `fn(*args)`. `args` and `fn`'s outputs are flat tuples of arrays; `out` gives each output's layout."""
    mesh, data, model = _sharding_mesh()
    if mesh is None:
        return fn(*args)
    rows = [x.shape[layout.index("b")] for x, layout in zip(args, layouts) if "b" in layout]
    if data is not None and any(n % mesh.shape[data] for n in rows):
        data = None  # a batch the "data" axis does not divide (a single row scored, say): every device takes it all
    heads = [x.shape[layout.index("h")] for x, layout in zip(args, layouts) if "h" in layout]
    if model is not None and any(n % mesh.shape[model] for n in heads):
        # a head group that does not split evenly (RazorAttention's 2 retrieval heads over 4 chips, say): every
        # device runs all of it
        warn_once(f"a Pallas kernel over {sorted(set(heads))} heads runs whole on each of the mesh's {model!r} "
                  f"devices ({mesh.shape[model]}): the heads do not split evenly")
        model = None
    # even with nothing split, a kernel on a mesh runs under shard_map (whole on every device): XLA refuses to
    # partition a Mosaic call itself
    spec = lambda layout: P(*({"b": data, "h": model}.get(c) for c in layout))  # noqa: E731
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(x) for x in layouts), out_specs=tuple(spec(x) for x in out),
                         check_vma=False)(*args)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r}; expected one of {IMPLS}")


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """A UserWarning the first time `message` is said in a process: an implementation that falls back to
    another (same results, other speed) says so once, not at every traced call."""
    warnings.warn(message, stacklevel=3)


def _no_softcap_kernel(mask: Mask, impl):
    if mask.softcap is not None and impl == "pallas":
        raise ValueError(f"attention_impl='pallas': the kernels do not implement attention-logit soft-capping "
                         f"(softcap={mask.softcap}, Gemma 2); load the model with attention_impl='xla'")


def _backend() -> str:
    return kernels.platform()


def prefill_route(
    impl: str, backend: str, *, stats: StatsRequest, mask: Mask, self_attention: bool, dtype, head_dim: int,
) -> str:
    """Which code a prompt's attention runs: "xla" (the reference), "pallas" (kvjax.pallas), "cudnn" or "splash".

    The common case under `impl="pallas"` goes to the platform's own flash attention: a prompt attending
    itself, no mask beyond causality and padding (no ALiBi, window, anchor mask, gate flags or soft-capping),
    and no statistic that needs the kernel's log-sum-exps (`colsum`, H2O's). On a GPU that is cuDNN's
    (`jax.nn.dot_product_attention`), in half precision with a head size cuDNN accepts; on a TPU, jax's splash
    attention (`splash_prefill`). SnapKV's last queries and MAT's first logit are O(W x s) and come from
    `reference.prompt_statistics` on every route, so SnapKV, PyramidKV, SlimKV and TOVA prompts take these
    too. Any other call keeps kvjax's kernels, which compute what the policy asked for."""
    if impl != "pallas":
        return "xla"
    plain = self_attention and not stats.colsum and not stats.probs and mask.plain
    if backend == "tpu" and plain:
        return "splash"
    fits = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if backend == "gpu" and plain and fits else "pallas"


# Splash attention's tiles: jax's default (128) for prompts up to 64K tokens, twice as large each time the prompt
# doubles past that. Splash prefetches its block tables into the core's 1 MiB SMEM (for a causal mask, `[nq, nk]`
# next-block indices, int16 past 128 tiles, and an int8 `[nq, nk]` block mask): with 128-token tiles a 102,400-token
# prompt's index table alone is 1.4 MB (800 x 896 x 2 bytes) and libtpu refuses it on v5e and v6e, while 512 tiles
# a side (131,072 tokens in 256-token tiles, 768 KiB) compiles on both (`benchmarks/results/tpu_aot_v5e.md`). Frozen,
# not tuned for speed; up to 512-token tiles (262,144 tokens), the longest prompt compiled.
SPLASH_BLOCKS = (128, 256, 512)
SPLASH_MAX_BLOCKS = 512  # query (and key) tiles per prompt


def splash_block(t: int) -> int:
    """The query and key tile of `splash_prefill` for a `t`-token prompt (padded to a multiple of it): the smallest of
    `SPLASH_BLOCKS` that cuts the prompt into at most `SPLASH_MAX_BLOCKS` tiles."""
    for block in SPLASH_BLOCKS:
        if -(-t // block) <= SPLASH_MAX_BLOCKS:
            return block
    raise InvalidInput(f"a {t}-token prompt is longer than splash attention's tiles reach here "
                     f"({SPLASH_BLOCKS[-1] * SPLASH_MAX_BLOCKS} tokens)")


def splash_prefill(
    q: Float[Array, "b h t d"], k: Float[Array, "b kvh t d"], v: Float[Array, "b kvh t d"], pos: Int[Array, "b t"], *,
    scale: float, interpret: bool = False, block: int | None = None,
) -> Float[Array, "b h t d"]:
    """A left-padded prompt's causal self-attention through jax's TPU splash attention (`jax.experimental.pallas.
    ops.tpu.splash_attention`), forward only: each (row, KV head) is one MQA call over its group's query heads.

    Splash masks by index, not position: padding (left, and the tail up to a whole tile) is its own segment, so a
    real query never sees it, and its outputs are zeroed after, as the reference's. The scale goes on the
    queries (splash has none). `interpret` runs the kernel in the TPU interpreter (the CPU tests); `block`: the
    tiles, `splash_block(t)` unless given (the tests')."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    b, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    block = splash_block(t) if block is None else block
    tp = -(-t // block) * block
    tail = lambda x, axis: jnp.pad(x, [(0, tp - t if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
    qg = tail((q * jnp.asarray(scale, q.dtype)).reshape(b, kvh, g, t, d), 3)
    k, v = tail(k, 2), tail(v, 2)
    segment = tail((pos >= 0).astype(jnp.int32), 1)  # 1: the prompt's tokens; 0: padding
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((tp, tp))] * g)
    blocks = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    kernel = splash.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret)

    def one(qh, kh, vh, seg):  # [g, tp, d], [tp, d], [tp, d], [tp]
        return kernel(qh, kh, vh, segment_ids=splash.SegmentIds(q=seg, kv=seg))

    o = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qg, k, v, segment)  # [b, kvh, g, tp, d]
    o = o[:, :, :, :t].reshape(b, h, t, d)
    return jnp.where((pos >= 0)[:, None, :, None], o, 0).astype(q.dtype)


def cudnn_prefill(
    q: Float[Array, "b h t d"], k: Float[Array, "b kvh t d"], v: Float[Array, "b kvh t d"], pos: Int[Array, "b t"], *,
    scale: float, implementation: str | None = "cudnn",
) -> Float[Array, "b h t d"]:
    """A left-padded prompt's causal self-attention through `jax.nn.dot_product_attention`.

    That API masks padding at the end of a row (`*_seq_lengths`), so each row is rotated to right
    padding, attended, and rotated back; padding queries give 0. `implementation="xla"` runs the same
    adapter on any backend (how the CPU tests check it against the reference)."""
    b, h, t, d = q.shape
    n = jnp.sum(pos >= 0, axis=1).astype(jnp.int32)  # real tokens per row
    shift = (t - n)[:, None]
    to_right = (jnp.arange(t)[None, :] + shift) % t  # right-padded index j holds left-padded index to_right[j]
    move = lambda x, idx: jnp.take_along_axis(x, idx[:, None, :, None], axis=2)  # noqa: E731
    layout = lambda x: move(x, to_right).transpose(0, 2, 1, 3)  # noqa: E731  [b, t, heads, d]
    o = jax.nn.dot_product_attention(layout(q), layout(k), layout(v), scale=scale, is_causal=True,
                                     query_seq_lengths=n, key_value_seq_lengths=n, implementation=implementation)
    o = move(o.transpose(0, 2, 1, 3), (jnp.arange(t)[None, :] - shift) % t)
    return jnp.where((pos >= 0)[:, None, :, None], o, 0).astype(q.dtype)


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
    impl: str = "xla",
    self_attention: bool = False,
) -> tuple[Float[Array, "b h t d"], AttentionStats]:
    """`kvjax.reference.prefill_attention` (arguments and statistics), run by `impl`.

    `impl="pallas"` runs `kvjax.pallas.prefill_attention` (and its `colsum` pass); the O(W x s)
    statistics come from `reference.prompt_statistics` either way. On a GPU the common case goes to
    cuDNN instead (`prefill_route`)."""
    check_impl(impl)
    if stats.probs:
        raise ValueError("prefill_attention cannot compute statistics ['probs'] (a decode statistic)")
    route = prefill_route(impl, _backend(), stats=stats, mask=mask, self_attention=self_attention, dtype=q.dtype,
                          head_dim=q.shape[-1])
    if route in ("cudnn", "splash"):
        first_logit, last_probs = reference.prompt_statistics(q, k, q_pos, k_pos, stats, scale=scale)
        if route == "cudnn":
            out = cudnn_prefill(q, k, v, q_pos, scale=scale)
        else:
            out, = per_shard(lambda *a: (splash_prefill(*a, scale=scale),), q, k, v, q_pos, layouts=("bh", "bh", "bh", "b"),
                             out=("bh",))
        return out, AttentionStats(first_logit=first_logit, last_probs=last_probs)
    _no_softcap_kernel(mask, impl)
    if route == "xla":
        return reference.prefill_attention(q, k, v, q_pos, k_pos, scale=scale, stats=stats, mask=mask, block=block,
                                           self_attention=self_attention)
    out, colsum = _prefill_kernels(q, k, v, q_pos, k_pos, scale=scale, mask=mask, colsum=stats.colsum)
    first_logit, last_probs = reference.prompt_statistics(q, k, q_pos, k_pos, stats, scale=scale, mask=mask)
    return out, AttentionStats(first_logit=first_logit, colsum=colsum, last_probs=last_probs)


def prompt_statistics(q, k, q_pos, k_pos, stats: StatsRequest, *, scale: float, mask: Mask = CAUSAL):
    """`(first_logit, last_probs)` of a prompt's attention (`kvjax.reference.prompt_statistics`): O(W x s), computed
    apart from the attention whatever ran it, so a prompt attended once gives them again from its queries and keys
    (`kvjax.layer.recache_shared`)."""
    return reference.prompt_statistics(q, k, q_pos, k_pos, stats, scale=scale, mask=mask)


def _prefill_kernels(q, k, v, q_pos, k_pos, *, scale: float, mask: Mask, colsum: bool):
    """kvjax.pallas's prefill (and colsum pass) on each shard (`per_shard`): the output and the column sums or
    None. The mask's arrays travel as arguments, each with its layout."""
    variant, interpret = kernels.platform_variant()
    parts = {"alibi": "h", "key_keep": "bh"}
    given = [n for n in parts if getattr(mask, n) is not None]
    anchors = mask.anchors

    def run(q, k, v, q_pos, k_pos, *rest):
        arrays = dict(zip(given, rest))
        if anchors is not None:
            arrays["anchors"] = AnchorMask(*rest[len(given):])
        kw = dict(scale=scale, variant=variant, interpret=interpret, mask=mask.replace(**arrays))
        out, lse = kernels.prefill_attention(q, k, v, q_pos, k_pos, with_lse=colsum, **kw)
        out = out.astype(q.dtype)
        return (out, kernels.colsum(q, k, lse, q_pos, k_pos, **kw)) if colsum else (out,)

    extra = [getattr(mask, n) for n in given] + ([] if anchors is None else [anchors.segment, anchors.anchor,
                                                                             anchors.keep])
    layouts = ("bh", "bh", "bh", "b", "b", *(parts[n] for n in given), *(("b",) * (3 * (anchors is not None))))
    out = per_shard(run, q, k, v, q_pos, k_pos, *extra, layouts=layouts, out=("bh", "bh")[:1 + colsum])
    return out[0], (out[1] if colsum else None)


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
    impl: str = "xla",
    **kwargs,
) -> tuple[Float[Array, "b h t d"], AttentionStats]:
    """`kvjax.reference.prefix_attention` (its keyword arguments: the mask, the visibility of slots and chunk,
    statistics, rolling sinks): a chunk of new tokens attending a cache and, causally, itself.

    There is no Pallas kernel for a chunk over a cache: with `impl="pallas"` the reference runs and
    says so once (a warning), never silently."""
    check_impl(impl)
    if impl == "pallas":
        warn_once("attention_impl='pallas': a chunk attending a cache (chunked prefill, extend) runs in XLA; "
                   "kvjax.pallas has no kernel for it")
    return reference.prefix_attention(q, k, v, pos, cache_k, cache_v, slot_pos, log_w, **kwargs)


def quantized_decode_attention(q: Float[Array, "b h d"], qc, newest: Int[Array, "b"], current, *, scale: float,
                               probs: bool = False, first_logit: bool = False, impl: str = "xla"):
    """`kvjax.quant.attend` (a decode step over a quantized cache's codes), run by `impl`: under "pallas" the
    kernel `kvjax.pallas.quant_decode` (the platform's variant; interpreted on a CPU) where its tiles fit
    (`quant_decode.supported`), else the jnp reference, said once where the kernel was asked for."""
    check_impl(impl)
    if impl == "pallas":
        variant, interpret = kernels.platform_variant()
        if quant_decode.supported(qc, q.shape[-1], interpret, variant):
            leaves, tree = jax.tree.flatten(qc)

            def run(q, newest, cur_k, cur_v, *leaves):
                got = quant_decode.attend(q, jax.tree.unflatten(tree, leaves), newest, (cur_k, cur_v), scale=scale,
                                          probs=probs, first_logit=first_logit, variant=variant, interpret=interpret)
                return tuple(x for x in got if x is not None)

            out, *rest = per_shard(run, q, newest, *current, *leaves, layouts=("bh", "b", "bh", "bh")
                                   + ("bh",) * len(leaves), out=("bh",) * (1 + probs + first_logit))
            return out, (rest.pop(0) if probs else None), (rest.pop(0) if first_logit else None)
        warn_once(f"attention_impl='pallas': a quantized cache ({qc.spec.describe()}, head size {q.shape[-1]}) on "
                   f"{variant} decodes through the jnp reference (kvjax.quant.attend): its tiles do not fit the "
                   "kernel reading codes (kvjax.pallas.quant_decode.supported)")
    return quant.attend(q, qc, newest, current, scale=scale, probs=probs, first_logit=first_logit)


def pooled_decode_attention(q: Float[Array, "b h d"], cache, pos: Int[Array, "b"], *, scale: float,
                            mask: Mask = CAUSAL, impl: str = "xla") -> Float[Array, "b h d"]:
    """One query per row over a pool shared by the layer's KV heads (`kvjax.cache.PooledLayerCache`, the query's
    token already placed), each KV head's queries seeing its own slots. "xla": the reference `decode_attention`
    over the pool broadcast to every head, the other heads' slots masked (work: the pool's times the heads);
    "pallas": `kvjax.pallas.pool_decode` (the platform's variant; interpreted on a CPU), which reads only each
    head's runs of slots; with ALiBi, a window or a soft-cap (`mask`), the reference, said once."""
    check_impl(impl)
    if impl == "pallas":
        variant, interpret = kernels.platform_variant()
        if mask.plain and _sharding_mesh()[0] is None:
            return pool_decode.attend(q, cache, scale=scale, variant=variant, interpret=interpret)
        warn_once("attention_impl='pallas': a pooled per-head cache (AdaKV) decodes in XLA with ALiBi, a window, a "
                  "soft-cap or on a mesh that splits the model (the pool kernel is not yet run per shard)")
    b, kvh = pos.shape[0], cache.num_kv_heads
    owned = cache.head[:, None, :] == jnp.arange(kvh, dtype=jnp.int32)[None, :, None]
    slot_pos = jnp.where(owned, cache.pos[:, None, :], -1)  # [b, kvh, P]
    per_head = lambda x: jnp.broadcast_to(x[:, None], (b, kvh, *x.shape[1:]))  # noqa: E731
    o, _ = reference.decode_attention(q, per_head(cache.k), per_head(cache.v), slot_pos,
                                      jnp.zeros(slot_pos.shape, jnp.float32), scale=scale,
                                      q_coord=jnp.broadcast_to(pos[:, None], (b, kvh)), k_coord=slot_pos, mask=mask)
    return o


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
    impl: str = "xla",
) -> tuple[Float[Array, "b h d"], AttentionStats]:
    """`kvjax.reference.decode_attention`: one query per row against the cache slots, run by `impl`.

    `impl="pallas"` runs `kvjax.pallas.decode_attention`, except with ALiBi or a sliding window,
    which the kernel does not take: those models decode in the reference and say so once (a warning)."""
    check_impl(impl)
    _no_softcap_kernel(mask, impl)
    if stats.colsum or stats.last_queries:
        raise ValueError(f"decode_attention cannot compute statistics {stats.names()}; it takes probs and first_logit")
    mask.only(("window", "softcap", "alibi"), "decode_attention")
    if impl == "pallas" and (mask.alibi is not None or mask.window is not None):
        warn_once("attention_impl='pallas': decoding with ALiBi or a sliding window runs in XLA; the Pallas decode "
                   "kernel takes neither")
    elif impl == "pallas":
        variant, interpret = kernels.platform_variant()

        def run(*arrays):
            out, st = kernels.decode_attention(*arrays, scale=scale, stats=stats, variant=variant, interpret=interpret)
            return (out, *(x for x in (st.first_logit, st.probs) if x is not None))

        out, *rest = per_shard(run, q, k, v, slot_pos, log_w, layouts=("bh",) * 5,
                               out=("bh",) * (1 + stats.first_logit + stats.probs))
        first_logit = rest.pop(0) if stats.first_logit else None
        return out, AttentionStats(first_logit=first_logit, probs=rest.pop(0) if stats.probs else None)
    return reference.decode_attention(q, k, v, slot_pos, log_w, scale=scale, stats=stats, q_coord=q_coord,
                                      k_coord=k_coord, mask=mask)


def reconstruction_scores(
    q: Float[Array, "b h t d"], k: Float[Array, "b kvh t d"], pos: Int[Array, "b t"],
    cache_k: Float[Array, "b kvh c d"], cache_pos: Int[Array, "b kvh c"], span: Int[Array, "b 3"], scale: float,
    weights: tuple[Float[Array, "b t"], Float[Array, "b kvh g c"]] | None = None,
) -> Float[Array, "b kvh c"]:
    """Each cached slot's KVzip score in one layer: the largest probability any replay query of its KV group
    gives it, the softmax running over the sinks (positions < span[:, 0]), the chunk (span[:, 1] <= position
    < span[:, 2]) and the replay's own keys (causal); 0 outside the chunk. `q`, `k`: the replay's rotated
    queries and keys, `pos` its positions (-1 on padding); `cache_k` rotated at absolute positions. `weights`
    (KVzip+): `(per query, per query head and slot)` factors applied to the probabilities before the maximum."""
    b, h, t, d = q.shape
    kvh = cache_k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, t, d).astype(jnp.float32)
    sinks, start, end = (span[:, i][:, None, None] for i in range(3))
    in_chunk = (cache_pos >= start) & (cache_pos < end)
    seen = (cache_pos >= 0) & ((cache_pos < sinks) | in_chunk)  # [b, kvh, c]
    s_cache = jnp.einsum("bkgtd,bkcd->bkgtc", qg, cache_k.astype(jnp.float32)) * scale
    s_cache = jnp.where(seen[:, :, None, None, :], s_cache, -jnp.inf)
    causal = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] >= 0)  # [b, t(query), t(key)]
    s_self = jnp.einsum("bkgtd,bksd->bkgts", qg, k.astype(jnp.float32)) * scale
    s_self = jnp.where(causal[:, None, None], s_self, -jnp.inf)
    top = jnp.maximum(jnp.max(s_cache, axis=-1, keepdims=True), jnp.max(s_self, axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # a padding query sees nothing: its row is dropped below
    e_cache, e_self = jnp.exp(s_cache - top), jnp.exp(s_self - top)
    total = jnp.sum(e_cache, axis=-1, keepdims=True) + jnp.sum(e_self, axis=-1, keepdims=True)
    p = e_cache / jnp.where(total > 0, total, 1.0)
    p = jnp.where((pos >= 0)[:, None, None, :, None], p, 0.0)
    if weights is not None:
        per_query, per_slot = weights
        p = p * per_query[:, None, None, :, None] * per_slot[:, :, :, None, :]
    return jnp.where(in_chunk, jnp.max(p, axis=(2, 3)), 0.0)


def replay_attention(
    q: Float[Array, "b h t d"], k: Float[Array, "b kvh t d"], v: Float[Array, "b kvh t d"], pos: Int[Array, "b t"],
    cache_k: Float[Array, "b kvh c d"], cache_v: Float[Array, "b kvh c d"], cache_pos: Int[Array, "b kvh c"],
    log_w: Float[Array, "b kvh c"], span: Int[Array, "b 3"], scale: float, *,
    slot_visible: Bool[Array, "b kvh t c"] | None = None,
    weights: tuple[Float[Array, "b t"], Float[Array, "b kvh g c"]] | None = None,
    block: int = REPLAY_BLOCK,
) -> tuple[Float[Array, "b h t d"], Float[Array, "b kvh c"]]:
    """A KVzip replay's attention and its slots' scores from one set of logits: `reference.prefix_attention`'s
    output under a plain causal mask and `reconstruction_scores`' scores, equal up to float rounding.

    The two softmaxes differ only in their keys (the output's: every visible slot, with its `log_w`, and the
    replay's own keys; the scores': the sinks, the chunk and the replay's own keys), so one exponential of the
    logits, shifted by each query's largest logit over every valid key, serves both: the logits of the cache
    and of the replay are computed once, not once per softmax, and the output is normalised after the
    products with the values, never as a `[t, c + t]` probability tensor. Queries run in blocks of `block` (a
    `t` that is no multiple of it runs whole), so the passes over the logits stay in a CPU's caches: on SmolLM2
    the replay is 1.3-1.4x faster than the two functions (`benchmarks/results/kvzip_cpu_smollm2.md`).

    A padding query (`pos < 0`) sees no key: its output is zeros (the reference's is the values' mean; nothing
    reads either) and it scores nothing."""
    b, h, t, d = q.shape
    kvh = cache_k.shape[1]
    g = h // kvh
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(b, kvh, g, t, d).astype(acc)
    per_query_w = None if weights is None else weights[0]
    if t <= block or t % block:
        o, scores = _replay_block(qg, pos, per_query_w, slot_visible, k, v, pos, cache_k, cache_v, cache_pos, log_w,
                                  span, scale, None if weights is None else weights[1])
        return o.reshape(b, h, t, d).astype(q.dtype), scores
    n = t // block
    blocks = (qg.reshape(b, kvh, g, n, block, d).transpose(3, 0, 1, 2, 4, 5), pos.reshape(b, n, block).transpose(1, 0, 2),
              None if per_query_w is None else per_query_w.reshape(b, n, block).transpose(1, 0, 2),
              None if slot_visible is None else slot_visible.reshape(b, kvh, n, block, -1).transpose(2, 0, 1, 3, 4))
    o, scores = jax.lax.map(lambda xs: _replay_block(*xs, k, v, pos, cache_k, cache_v, cache_pos, log_w, span, scale,
                                                      None if weights is None else weights[1]), blocks)
    o = o.transpose(1, 2, 3, 0, 4, 5).reshape(b, h, t, d)
    return o.astype(q.dtype), jnp.max(scores, axis=0)


def _replay_block(qg, q_pos, per_query_w, slot_visible, k, v, pos, cache_k, cache_v, cache_pos, log_w, span, scale,
                  per_slot_w):
    """`replay_attention` for the queries `qg` `[b, kvh, g, tq, d]` at `q_pos` `[b, tq]`: their output `[b, kvh, g,
    tq, d]` and their largest probability of each slot `[b, kvh, c]`."""
    acc = qg.dtype
    s_cache = jnp.einsum("bkgtd,bkcd->bkgtc", qg, cache_k.astype(acc)) * scale
    s_self = jnp.einsum("bkgtd,bksd->bkgts", qg, k.astype(acc)) * scale
    valid = (cache_pos >= 0)[:, :, None, None, :]
    causal = ((pos[:, None, :] <= q_pos[:, :, None]) & (pos[:, None, :] >= 0))[:, None, None]  # [b, 1, 1, tq, t]
    top = jnp.maximum(jnp.max(jnp.where(valid, s_cache, -jnp.inf), axis=-1),
                      jnp.max(jnp.where(causal, s_self, -jnp.inf), axis=-1))
    top = jnp.where(jnp.isfinite(top), top, 0.0)[..., None]
    e_cache = jnp.where(valid, jnp.exp(s_cache - top), 0.0)
    e_self = jnp.where(causal, jnp.exp(s_self - top), 0.0)
    z_self = jnp.sum(e_self, axis=-1)
    real = q_pos >= 0

    # the output: prefix_attention's causal softmax over the visible slots (their log_w added) and the replay
    seen_by_query = (cache_pos[:, :, None, :] <= q_pos[:, None, :, None]) & (cache_pos >= 0)[:, :, None, :]
    if slot_visible is not None:
        seen_by_query &= slot_visible
    e_out = jnp.where(seen_by_query[:, :, None], e_cache * jnp.exp(log_w.astype(acc))[:, :, None, None, :], 0.0)
    z_out = jnp.sum(e_out, axis=-1) + z_self
    o = (jnp.einsum("bkgtc,bkcd->bkgtd", e_out.astype(v.dtype), cache_v, preferred_element_type=acc)
         + jnp.einsum("bkgts,bksd->bkgtd", e_self.astype(v.dtype), v, preferred_element_type=acc))
    o = jnp.where((z_out > 0)[..., None], o / jnp.where(z_out > 0, z_out, 1.0)[..., None], 0.0)

    # the scores: reconstruction_scores' softmax over the sinks, the chunk and the replay
    sinks, start, end = (span[:, i][:, None, None] for i in range(3))
    in_chunk = (cache_pos >= start) & (cache_pos < end)
    seen = (cache_pos >= 0) & ((cache_pos < sinks) | in_chunk)
    z = jnp.sum(jnp.where(seen[:, :, None, None, :], e_cache, 0.0), axis=-1) + z_self
    per_query = jnp.where(real[:, None, None, :], 1.0 / jnp.where(z > 0, z, 1.0), 0.0)  # [b, kvh, g, tq]
    if per_query_w is not None:
        per_query = per_query * per_query_w[:, None, None, :]
        p = e_cache * per_query[..., None] * per_slot_w[:, :, :, None, :]
    else:
        p = e_cache * per_query[..., None]
    return o, jnp.where(in_chunk, jnp.max(p, axis=(2, 3)), 0.0)
