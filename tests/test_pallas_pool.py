"""The Pallas kernel that decodes over AdaKV's pool (`kvjax.pallas.pool_decode`, interpreted on the CPU) against its
specification, the reference decode over the pool broadcast to every head with the other heads' slots masked
(`kvjax.attention.pooled_decode_attention(impl="xla")`, itself checked against kvpress's AdaKV in
tests/test_kvpress.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax import cache as kvcache
from kvjax.pallas import pool_decode


def _pool(b, kvh, t, d, room, steps, seed, kept=None, slots=None):
    """A pool from a random keep mask over a `t`-token prompt (head 2 keeps nothing from the prompt in row 0), then
    `steps` decoded tokens per head."""
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.normal(size=(b, kvh, t, d)), jnp.float32) for _ in range(2))
    keep = rng.random((b, kvh, t)) < (kept if kept is not None else 0.4)
    keep[0, min(2, kvh - 1)] = False
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    slots = slots or int(keep.sum(axis=(1, 2)).max()) + 3
    cache = kvcache.empty_pool(b, kvh, slots, room, d, jnp.float32)
    cache = kvcache.pool_prompt(cache, k, v, pos, jnp.asarray(keep))
    for s in range(steps):
        kk, vv = (jnp.asarray(rng.normal(size=(b, kvh, d)), jnp.float32) for _ in range(2))
        cache = kvcache.pool_append(cache, kk, vv, jnp.full((b,), t + s, jnp.int32))
    return cache


@pytest.mark.parametrize("g, splits", [(1, 1), (3, 2), (2, 5)])
def test_kernel_equals_the_masked_reference(g, splits):
    """Output of each query head over its KV head's runs (prompt slots, decode slots partly empty), runs that start
    anywhere and are no multiple of the tile, a head with no prompt slot, more splits than some runs have tiles."""
    b, kvh, t, d = 2, 3, 150, 16
    cache = _pool(b, kvh, t, d, room=7, steps=4, seed=g)
    q = jnp.asarray(np.random.default_rng(10 + g).normal(size=(b, kvh * g, d)), jnp.float32)
    pos = jnp.full((b,), t + 3, jnp.int32)
    want = attention.pooled_decode_attention(q, cache, pos, scale=d ** -0.5)
    got = pool_decode.attend(q, cache, scale=d ** -0.5, interpret=True, splits=splits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("g", [1, 4])
def test_tpu_variant_equals_the_masked_reference(g):
    """The TPU variant (aligned 128-slot tiles listed per head, interpreted by the TPU interpreter) on runs that
    start and end inside tiles, share a tile with another head's run, and a head with no prompt slot."""
    b, kvh, t, d = 2, 3, 300, 16
    cache = _pool(b, kvh, t, d, room=150, steps=4, seed=g)
    q = jnp.asarray(np.random.default_rng(20 + g).normal(size=(b, kvh * g, d)), jnp.float32)
    pos = jnp.full((b,), t + 3, jnp.int32)
    want = attention.pooled_decode_attention(q, cache, pos, scale=d ** -0.5)
    got = pool_decode.attend(q, cache, scale=d ** -0.5, variant="tpu", interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_runs_are_each_heads_slots():
    """`PooledLayerCache.runs` covers exactly the slots each head owns (prompt run) and its decode region."""
    cache = _pool(2, 3, 60, 8, room=5, steps=2, seed=4)
    runs, head, pos = np.asarray(cache.runs()), np.asarray(cache.head), np.asarray(cache.pos)
    for row in range(2):
        for h in range(3):
            (s0, n0), (s1, n1) = runs[row, h]
            owned = set(np.nonzero(head[row] == h)[0])
            assert owned == set(range(s0, s0 + n0)) | {s for s in range(s1, s1 + n1) if pos[row, s] >= 0}


def test_the_kernel_compiles_once_per_pool_shape():
    """Runs (starts, lengths) are arrays: another pool of the same shape with other per-head counts compiles
    nothing."""
    from tests.conftest import compile_log

    q = jnp.ones((2, 3, 16), jnp.float32)
    first = _pool(2, 3, 150, 16, room=7, steps=1, seed=1, kept=0.3, slots=200)
    other = _pool(2, 3, 150, 16, room=7, steps=3, seed=2, kept=0.3, slots=200)
    assert not np.array_equal(np.asarray(first.runs()), np.asarray(other.runs()))
    pool_decode.attend(q, first, scale=0.25, interpret=True, splits=2).block_until_ready()
    with compile_log() as compiles:
        pool_decode.attend(q, other, scale=0.25, interpret=True, splits=2).block_until_ready()
    assert compiles == []


def test_adakv_generation_under_attention_impl_pallas_decodes_with_the_kernel(sharp_dir, monkeypatch):
    """`attention_impl="pallas"` (interpreted on the CPU) sends AdaKV's decode steps to the pool kernel, with the
    same tokens and kept positions as the reference."""
    from kvjax import generate
    from kvjax.cache import kept_sets
    from kvjax.policies import AdaKV, SnapKV
    from kvjax.models import load

    calls = []
    real = pool_decode.attend
    monkeypatch.setattr(pool_decode, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = np.random.RandomState(6).randint(4, 100, 70).tolist()
    pol = AdaKV(scorer=SnapKV(budget=16, observation_window=4))
    outs = [generate(load(sharp_dir, attention_impl=impl).model, [prompt], pol, max_new_tokens=6, eos_ids=[])
            for impl in ("xla", "pallas")]
    assert calls, "the kernel was never called"
    assert outs[0].sequences() == outs[1].sequences()
    assert kept_sets(outs[0].cache) == kept_sets(outs[1].cache)
