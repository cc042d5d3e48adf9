"""Pallas kernels (GPU and TPU variants) against the jnp reference.

On CPU both variants run in interpret mode; on a GPU (or TPU) the matching variant is
compiled and run natively, so `pytest tests/test_pallas.py` there checks the real kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import attention, reference
from kvjax.anllm_anchors import anchor_mask
from kvjax.errors import InvalidInput
from kvjax.generate import generate
from kvjax.masks import Mask
from kvjax.pallas import decode as pdecode
from kvjax.pallas import platform_variant, tiles
from kvjax.pallas import prefill as pprefill
from kvjax.policies import H2O, FullCache, SnapKV, StreamingLLM
from kvjax.stats import AttentionStats, StatsRequest
from kvjax.models import load

VARIANTS = ["gpu", "tpu"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SMALL = dict(block_q=16, block_k=16)  # small blocks: several per test prompt, partial last blocks


def _run(variant: str) -> dict:
    """Native where this backend runs `variant`, interpret mode otherwise."""
    native, interpret = platform_variant()
    return dict(variant=variant, interpret=interpret or variant != native)


def _qkv(rng, b, h, kvh, t, s, d, dtype):
    q = jnp.asarray(rng.normal(size=(b, h, t, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, kvh, s, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, kvh, s, d)), dtype)
    return q, k, v


def _left_padded_positions(rng, b, t):
    pad = rng.integers(0, t // 2 + 1, size=b)
    pad[0] = 0
    return jnp.asarray(np.stack([np.arange(t) - p for p in pad]).clip(-1), jnp.int32)


def _check_prefill(variant, q, k, v, pos, tol, **kw):
    ref, stats = attention.prefill_attention(q, k, v, pos, pos, scale=q.shape[-1] ** -0.5,
                                             stats=StatsRequest(colsum=True), mask=Mask(**kw))
    out, lse = pprefill.prefill_attention(q, k, v, pos, pos, scale=q.shape[-1] ** -0.5, **_run(variant), **SMALL,
                                          mask=Mask(**kw))
    real = np.asarray(pos >= 0)[:, None, :, None]  # padding queries are never read
    diff = np.where(real, np.asarray(out, np.float32) - np.asarray(ref, np.float32), 0.0)
    assert np.abs(diff).max() <= tol, np.abs(diff).max()
    col = pprefill.colsum(q, k, lse, pos, pos, scale=q.shape[-1] ** -0.5, **_run(variant),
                          **SMALL, mask=Mask(**kw))
    np.testing.assert_allclose(np.asarray(col), np.asarray(stats.colsum), atol=tol * 10, rtol=tol)


MASKS = ["causal", "window", "alibi", "anchors", "gate"]


def _mask_kwargs(name, rng, pos, kvh):
    b, t = pos.shape
    if name == "window":
        return {"window": int(rng.integers(1, t + 1))}
    if name == "alibi":
        return {}  # slopes need the head count: set by the caller
    if name == "anchors":
        flags = jnp.asarray(rng.random((b, t)) < 0.15)
        keep = jnp.asarray(rng.random((b, t)) < 0.05)
        return {"anchors": anchor_mask(flags, pos >= 0, keep & (pos >= 0))}
    if name == "gate":
        return {"key_keep": jnp.asarray(rng.random((b, kvh, t)) < 0.3)}
    return {}


# The random-shape sweeps cost 3-8 s an example in interpret mode (each shape compiles): the default
# suite draws a few so CI stays within its time, `pytest -m slow` draws many (the *_thorough copies).
SWEEP = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def sweep(strategies: dict, examples: int = 3, thorough: int = 20):
    """(default test, slow thorough test) over `strategies`, both parametrized by the kernel variant."""

    def make(body):
        def build(n):
            return pytest.mark.parametrize("variant", VARIANTS)(settings(max_examples=n, **SWEEP)(
                given(**strategies)(body)))

        return build(examples), pytest.mark.slow(build(thorough))

    return make


def _prefill_random_shapes(variant, b, kvh, g, t, d, mask, bf16, seed):
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    q, k, v = _qkv(rng, b, kvh * g, kvh, t, t, d, dtype)
    pos = _left_padded_positions(rng, b, t)
    kw = _mask_kwargs(mask, rng, pos, kvh)
    if mask == "alibi":
        kw["alibi"] = attention.alibi_slopes(kvh * g)
    _check_prefill(variant, q, k, v, pos, TOL[dtype], **kw)


test_prefill_random_shapes, test_prefill_random_shapes_thorough = sweep(dict(
    b=st.integers(1, 2), kvh=st.sampled_from([1, 2]), g=st.sampled_from([1, 4, 8]), t=st.integers(1, 70),
    d=st.sampled_from([8, 16]), mask=st.sampled_from(MASKS), bf16=st.booleans(), seed=st.integers(0, 2**16),
))(_prefill_random_shapes)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("g", [1, 4, 8])
def test_prefill_only_the_diagonal_visible(variant, g):
    """Attention-Gate with every key evicted: each query sees only itself, so the output is its own v."""
    rng = np.random.default_rng(g)
    b, kvh, t, d = 2, 2, 37, 16
    q, k, v = _qkv(rng, b, kvh * g, kvh, t, t, d, jnp.float32)
    pos = _left_padded_positions(rng, b, t)
    keep = jnp.zeros((b, kvh, t), bool)
    _check_prefill(variant, q, k, v, pos, 1e-5, key_keep=keep)
    out, _ = pprefill.prefill_attention(q, k, v, pos, pos, scale=d**-0.5, mask=Mask(key_keep=keep), **_run(variant),
                                        **SMALL)
    own = jnp.repeat(v, g, axis=1)
    real = np.asarray(pos >= 0)[:, None, :, None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, own, 0), atol=1e-6)


def test_block_table_skips_masked_blocks():
    """Causal: query block i reads blocks 0..i; a window of one block: at most 2; left padding: none
    of the padding-only blocks; eq. 4 with one anchor per block: a late block skips the middle."""
    t, blk = 128, 16
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    qm, km = tiles.query_meta(pos), tiles.key_meta(pos)
    cnt, idx = tiles.block_table(qm, km, None, 1, blk, blk, window=None, anchors=False)
    assert cnt[0, 0].tolist() == list(range(1, 9))
    assert idx[0, 0, 5, :6].tolist() == list(range(6))
    cnt, _ = tiles.block_table(qm, km, None, 1, blk, blk, window=blk, anchors=False)
    assert cnt[0, 0].tolist() == [1] + [2] * 7
    padded = jnp.where(jnp.arange(t) < 40, -1, jnp.arange(t) - 40)[None].astype(jnp.int32)
    cnt, idx = tiles.block_table(tiles.query_meta(padded), tiles.key_meta(padded), None, 1, blk, blk, window=None,
                                 anchors=False)
    assert cnt[0, 0].tolist() == [0, 0, 1, 2, 3, 4, 5, 6] and idx[0, 0, 2, 0] == 2
    gate = jnp.zeros((1, 1, 1, t), jnp.int32).at[..., 0].set(1)  # only key 0 kept (+ the diagonal)
    cnt, idx = tiles.block_table(qm, km, gate, 1, blk, blk, window=None, anchors=False)
    assert cnt[0, 0, 7] == 2 and idx[0, 0, 7, :2].tolist() == [0, 7]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_empty_slots_and_compensation(variant, g, dtype):
    rng = np.random.default_rng(g)
    b, kvh, c, d = 3, 2, 75, 16  # 75 slots: not a multiple of any block
    q = jnp.asarray(rng.normal(size=(b, kvh * g, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, kvh, c, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, kvh, c, d)), dtype)
    pos = np.tile(rng.permutation(c), (b, kvh, 1))
    pos[rng.random((b, kvh, c)) < 0.3] = -1  # empty slots anywhere
    pos[2, :, 1:], pos[2, :, 0] = -1, 5  # a row with a single valid slot
    pos = jnp.asarray(pos, jnp.int32)
    log_w = jnp.asarray(np.where(rng.random((b, kvh, c)) < 0.1, np.log(7.0), 0.0), jnp.float32)  # Razor's log N_d
    wanted = StatsRequest(probs=True, first_logit=True)
    ref, rstats = attention.decode_attention(q, k, v, pos, log_w, scale=d**-0.5, stats=wanted)
    out, ostats = pdecode.decode_attention(q, k, v, pos, log_w, scale=d**-0.5, stats=wanted, **_run(variant), block=16)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=0)
    np.testing.assert_allclose(ostats.probs, rstats.probs, atol=tol, rtol=0)
    has0 = np.asarray((pos == 0).any(-1))[:, :, None]
    np.testing.assert_allclose(np.where(has0, ostats.first_logit, 0), np.where(has0, rstats.first_logit, 0),
                               atol=tol * 10, rtol=0)


def test_decode_launch_options_are_gpu_only_and_do_not_change_the_result():
    """`splits`, `warps` and `stages` (benchmarks.decode_tuning's sweep) are Triton launch options: the GPU
    variant with other values gives the reference's output; the TPU variant, which has none, refuses them."""
    rng = np.random.default_rng(5)
    b, kvh, g, c, d = 2, 2, 4, 96, 16
    q = jnp.asarray(rng.normal(size=(b, kvh * g, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, kvh, c, d)), jnp.float32) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, kvh, c))
    log_w = jnp.zeros((b, kvh, c), jnp.float32)
    ref, _ = attention.decode_attention(q, k, v, pos, log_w, scale=d**-0.5)
    out, _ = pdecode.decode_attention(q, k, v, pos, log_w, scale=d**-0.5, variant="gpu", interpret=True, block=16,
                                      splits=3, warps=8, stages=1)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    for bad in (dict(splits=2), dict(warps=8), dict(stages=3)):
        with pytest.raises(ValueError, match="GPU"):
            pdecode.decode_attention(q, k, v, pos, log_w, scale=d**-0.5, variant="tpu", interpret=True, **bad)
    with pytest.raises(ValueError, match="warps=0"):
        pdecode.decode_attention(q, k, v, pos, log_w, scale=d**-0.5, variant="gpu", interpret=True, warps=0)


def _decode_random_shapes(variant, b, kvh, g, c, seed):
    rng = np.random.default_rng(seed)
    d = 16
    q = jnp.asarray(rng.normal(size=(b, kvh * g, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, kvh, c, d)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(np.where(rng.random((b, kvh, c)) < 0.2, -1, rng.integers(0, 1000, (b, kvh, c))), jnp.int32)
    pos = pos.at[:, :, 0].set(0)  # at least one valid slot per row
    log_w = jnp.asarray(rng.normal(size=(b, kvh, c)), jnp.float32)
    ref, _ = attention.decode_attention(q, k, v, pos, log_w, scale=d**-0.5)
    out, _ = pdecode.decode_attention(q, k, v, pos, log_w, scale=d**-0.5, **_run(variant), block=32)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


test_decode_random_shapes, test_decode_random_shapes_thorough = sweep(dict(
    b=st.integers(1, 3), kvh=st.sampled_from([1, 2, 4]), g=st.sampled_from([1, 4, 8]), c=st.integers(1, 300),
    seed=st.integers(0, 2**16),
))(_decode_random_shapes)


def test_bad_variant_and_impl():
    x = jnp.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="variant='cuda'"):
        pprefill.prefill_attention(x, x, x, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), scale=1.0,
                                   variant="cuda")
    with pytest.raises(ValueError, match="attention_impl='triton'"):
        attention.decode_attention(x[:, :, 0], x, x, jnp.zeros((1, 2, 4), jnp.int32), jnp.zeros((1, 2, 4)),
                                   scale=1.0, impl="triton")


@pytest.mark.parametrize("policy", [FullCache(), StreamingLLM(budget=24, sinks=4), SnapKV(budget=20, observation_window=8),
                                    H2O(budget=20, recent=6)], ids=lambda p: type(p).__name__)
def test_generation_with_pallas_matches_reference(sharp_dir, policy):
    """attention_impl="pallas" (prefill, colsum and decode kernels in interpret mode) gives the
    reference's tokens and cache."""
    xla, pallas = load(sharp_dir).model, load(sharp_dir, attention_impl="pallas").model
    prompts = [list(np.random.default_rng(1).integers(4, 250, 45)), list(range(30, 50))]
    a = generate(xla, prompts, policy, max_new_tokens=12)
    b = generate(pallas, prompts, policy, max_new_tokens=12)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for ca, cb in zip(a.cache, b.cache):
        np.testing.assert_array_equal(np.asarray(ca.pos), np.asarray(cb.pos))
        np.testing.assert_allclose(np.asarray(ca.k), np.asarray(cb.k), atol=1e-4)
    assert jax.tree.leaves(a.cache)  # sanity: caches were compared


@pytest.mark.parametrize("variant", VARIANTS)
def test_colsum_of_the_last_w_queries(variant):
    """colsum from query `T - W` on = SnapKV's observation-window probabilities summed over the window."""
    rng = np.random.default_rng(3)
    b, kvh, g, t, d, w = 2, 2, 4, 53, 16, 11
    q, k, v = _qkv(rng, b, kvh * g, kvh, t, t, d, jnp.float32)
    pos = _left_padded_positions(rng, b, t)
    _, stats = attention.prefill_attention(q, k, v, pos, pos, scale=d**-0.5, stats=StatsRequest.last(w))
    _, lse = pprefill.prefill_attention(q, k, v, pos, pos, scale=d**-0.5, **_run(variant), **SMALL)
    col = pprefill.colsum(q, k, lse, pos, pos, scale=d**-0.5, q_start=t - w, **_run(variant), **SMALL)
    np.testing.assert_allclose(col, stats.last(w).sum(axis=3), atol=1e-5, rtol=0)


def test_block_sizes_are_validated_and_shapes_quoted():
    """Tiles follow the variant's rules (Triton: powers of two >= 16; Mosaic: (8, 128) multiples) unless
    interpreted, and a wrapper given inconsistent shapes names them all instead of failing inside
    the kernel."""
    from kvjax.pallas.blocks import DECODE, PREFILL, BlockSizes, resolve

    assert resolve(PREFILL, "gpu", False) == BlockSizes(64, 64) and resolve(DECODE, "tpu", False).block_k == 512
    assert resolve(PREFILL, "gpu", False, block_q=16) == BlockSizes(16, 64)
    with pytest.raises(ValueError, match="powers of two"):
        resolve(PREFILL, "gpu", False, block_k=48)
    with pytest.raises(ValueError, match=r"multiples of \(8, 128\)"):
        resolve(PREFILL, "tpu", False, block_q=16, block_k=64)
    assert resolve(PREFILL, "tpu", True, block_q=16, block_k=16) == BlockSizes(16, 16)  # interpreted: any size
    with pytest.raises(ValueError, match="variant='cuda'"):
        resolve(DECODE, "cuda", False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockSizes(16, 16).block_q = 32

    q, k, v = (jnp.zeros(s) for s in [(1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)])
    pos = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"axis s of k_pos is 7, elsewhere 8.*k_pos \(1, 7\)"):
        pprefill.prefill_attention(q, k, v, pos, pos[:, :7], scale=0.25, **_run("gpu"))
    with pytest.raises(ValueError, match=r"pallas colsum: axis t of lse is 5"):
        pprefill.colsum(q, k, jnp.zeros((1, 4, 5)), pos, pos, scale=0.25, **_run("gpu"))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        pprefill.prefill_attention(q[:, :3], k, v, pos, pos, scale=0.25, **_run("gpu"))
    with pytest.raises(ValueError, match=r"pallas decode_attention: axis c of log_w is 6"):
        pdecode.decode_attention(q[:, :, 0], k, v, pos[:, None].repeat(2, 1), jnp.zeros((1, 2, 6)), scale=0.25,
                                 **_run("gpu"))


# --- cuDNN dispatch (issue #25): the common case only ------------------------------------------

def _route(**over):
    kw = dict(stats=StatsRequest(), mask=Mask(), self_attention=True, dtype=jnp.bfloat16, head_dim=64)
    impl, backend = over.pop("impl", "pallas"), over.pop("backend", "gpu")
    return attention.prefill_route(impl, backend, **{**kw, **over})


def test_cudnn_is_routed_only_plain_causal_prompts():
    """A call with H2O's column sums (which need the kernel's log-sum-exps) or any mask beyond causality
    never takes cuDNN; neither does f32, a head size cuDNN refuses, a chunk against a cache, the xla
    implementation or a CPU. SnapKV's windows and MAT's first logit (computed beside any route) do."""
    assert _route() == "cudnn" and _route(dtype=jnp.float16, head_dim=128) == "cudnn"
    assert _route(stats=StatsRequest.last(8)) == "cudnn"
    assert _route(stats=StatsRequest(first_logit=True, last_queries=frozenset({1, 32}))) == "cudnn"
    refused = [dict(stats=StatsRequest(colsum=True)), dict(stats=StatsRequest(colsum=True, last_queries=frozenset({8})))] + [
        dict(mask=Mask(alibi=np.ones(8))), dict(mask=Mask(window=64)), dict(mask=Mask(anchors=object())),
        dict(mask=Mask(key_keep=jnp.ones((1, 1, 4), bool))), dict(mask=Mask(softcap=50.0)), dict(dtype=jnp.float32),
        dict(head_dim=60), dict(head_dim=256),
        dict(self_attention=False)]
    for over in refused:
        assert _route(**over) == "pallas", over
    assert _route(impl="xla") == "xla" and _route(backend="cpu") == "pallas"


def test_tpu_splash_is_routed_only_plain_causal_prompts():
    """On a TPU the plain causal prompt goes to jax's splash attention (any dtype and head size it compiles, see
    tests/test_tpu_aot.py); column sums, any mask beyond causality, a chunk against a cache and the xla
    implementation keep kvjax's code."""
    assert _route(backend="tpu") == "splash" and _route(backend="tpu", dtype=jnp.float32, head_dim=128) == "splash"
    assert _route(backend="tpu", stats=StatsRequest(first_logit=True, last_queries=frozenset({1, 32}))) == "splash"
    for over in [dict(stats=StatsRequest(colsum=True)), dict(mask=Mask(window=64)), dict(mask=Mask(softcap=50.0)),
                 dict(mask=Mask(key_keep=jnp.ones((1, 1, 4), bool))), dict(self_attention=False)]:
        assert _route(backend="tpu", **over) == "pallas", over
    assert _route(backend="tpu", impl="xla") == "xla"


@pytest.mark.parametrize("t, block", [(200, None), (256, None), (300, 256)])
def test_tpu_splash_prefill_equals_the_reference_with_left_padding(t, block):
    """`splash_prefill` (jax's TPU splash attention in the TPU interpreter) on left-padded rows of a GQA prompt, a
    length no tile divides and one it does, and in the larger tiles of a long prompt: the reference's outputs,
    zeros for padding queries."""
    b, h, kvh, d = 2, 4, 2, 32
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.normal(size=(b, h, t, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, kvh, t, d)), jnp.float32) for _ in range(2))
    n = np.array([t, t - 37])  # row 1 is left-padded
    pos = jnp.asarray(np.where(np.arange(t)[None] >= (t - n)[:, None], np.arange(t)[None] - (t - n)[:, None], -1),
                      jnp.int32)
    want, _ = reference.prefill_attention(q, k, v, pos, pos, scale=d ** -0.5, self_attention=True)
    want = jnp.where((pos >= 0)[:, None, :, None], want, 0)
    got = attention.splash_prefill(q, k, v, pos, scale=d ** -0.5, interpret=True, block=block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_splash_tiles_grow_past_64k_tokens():
    """Hand-computed: 128-token tiles up to 512 of them (65,536 tokens), then the smallest larger tile that keeps
    the count at 512; a prompt past 512 x 512 tokens is refused by name, as a user error."""
    want = {1: 128, 65536: 128, 65537: 256, 102400: 256, 131072: 256, 131073: 512, 262144: 512}
    assert {t: attention.splash_block(t) for t in want} == want
    with pytest.raises(InvalidInput, match="262145-token prompt"):
        attention.splash_block(262145)


def test_prefill_attention_takes_cudnn_for_the_plain_case_only(monkeypatch):
    """The dispatch as a call sees it, on a GPU (the backend faked): the plain prompt goes to cuDNN and
    returns no statistics; with statistics, ALiBi or gate flags the Pallas kernel runs instead."""
    calls = []
    monkeypatch.setattr(attention, "_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "cudnn_prefill", lambda q, *a, **k: calls.append("cudnn") or jnp.zeros_like(q))

    def kernel(q, k, v, q_pos, k_pos, **kw):
        calls.append("pallas")
        return jnp.zeros_like(q), jnp.zeros(q.shape[:3], jnp.float32)

    monkeypatch.setattr(attention.kernels, "prefill_attention", kernel)
    monkeypatch.setattr(attention.kernels, "colsum", lambda q, k, *a, **kw: jnp.zeros(q.shape[:3], jnp.float32))
    monkeypatch.setattr(attention.kernels, "platform_variant", lambda: ("gpu", False))
    q, k, v = _qkv(np.random.default_rng(0), 1, 4, 2, 16, 16, 64, jnp.bfloat16)
    pos = jnp.arange(16)[None]
    kw = dict(scale=0.125, impl="pallas", self_attention=True)
    _, stats = attention.prefill_attention(q, k, v, pos, pos, **kw)
    assert calls == ["cudnn"] and stats == AttentionStats()
    for extra in (dict(stats=StatsRequest(colsum=True)), dict(mask=Mask(alibi=attention.alibi_slopes(4))),
                  dict(mask=Mask(key_keep=jnp.ones((1, 2, 16), bool)))):
        calls.clear()
        attention.prefill_attention(q, k, v, pos, pos, **kw, **extra)
        assert calls == ["pallas"], extra


def test_cudnn_route_returns_the_references_window_and_first_logit_statistics(monkeypatch):
    """SnapKV's observation-window probabilities and MAT's first logit on the cuDNN route (a GPU faked, cuDNN's
    API run by its XLA implementation) equal the reference's, on left-padded rows, as does the output."""
    monkeypatch.setattr(attention, "_backend", lambda: "gpu")
    cudnn = attention.cudnn_prefill
    calls = []
    monkeypatch.setattr(attention, "cudnn_prefill",
                        lambda *a, **k: calls.append("cudnn") or cudnn(*a, **k, implementation="xla"))
    rng = np.random.default_rng(3)
    b, kvh, t, d = 2, 2, 32, 16
    q, k, v = _qkv(rng, b, 2 * kvh, kvh, t, t, d, jnp.bfloat16)
    pos = np.full((b, t), -1, np.int32)
    for r, n in enumerate((32, 21)):
        pos[r, t - n:] = np.arange(n)
    pos = jnp.asarray(pos)
    req = StatsRequest(first_logit=True, last_queries=frozenset({1, 8}))
    got, got_stats = attention.prefill_attention(q, k, v, pos, pos, scale=d**-0.5, stats=req, impl="pallas",
                                                 self_attention=True)
    want, want_stats = reference.prefill_attention(q, k, v, pos, pos, scale=d**-0.5, stats=req, self_attention=True)
    assert calls == ["cudnn"]
    real = np.asarray(pos >= 0)[:, None, :, None]
    np.testing.assert_allclose(np.where(real, np.asarray(got, np.float32), 0),
                               np.where(real, np.asarray(want, np.float32), 0), atol=2e-2, rtol=0)
    np.testing.assert_allclose(got_stats.first_logit, want_stats.first_logit, atol=1e-6, rtol=0)
    for w in (1, 8):
        np.testing.assert_allclose(got_stats.last_probs[w], want_stats.last_probs[w], atol=1e-6, rtol=0)
    assert got_stats.colsum is None


@pytest.mark.parametrize("g", [1, 2])
def test_cudnn_adapter_equals_the_reference_on_left_padded_rows(g):
    """The rotation to right padding and back around `jax.nn.dot_product_attention` (run here with its
    XLA implementation): each real query's output equals the reference's; padding queries give 0."""
    rng = np.random.default_rng(1)
    b, kvh, t, d = 3, 2, 24, 16
    q, k, v = _qkv(rng, b, kvh * g, kvh, t, t, d, jnp.float32)
    pos = np.full((b, t), -1, np.int32)
    for r, n in enumerate((24, 17, 5)):
        pos[r, t - n:] = np.arange(n)
    pos = jnp.asarray(pos)
    want, _ = attention.prefill_attention(q, k, v, pos, pos, scale=d**-0.5)
    got = attention.cudnn_prefill(q, k, v, pos, scale=d**-0.5, implementation="xla")
    real = np.asarray(pos >= 0)[:, None, :, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5, rtol=0)
    assert not np.asarray(got)[~np.broadcast_to(real, got.shape)].any()
