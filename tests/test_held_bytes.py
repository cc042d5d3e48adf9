"""The KV bytes a cache really holds (`kvjax.cache.held_bytes`, `held_fraction`), per cache kind, hand-computed: the
slots holding a token (pos >= 0), keys and values only; quantized caches by their codes, scales, zeros and residual;
head-wise caches per group; pooled caches by their valid slots. And what generation reports: the full cache holds
all of its prompt, DuoAttention its bytes (not its share of heads)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import FullCache, generate, quant
from kvjax import cache as kvcache
from kvjax.cache import DISABLED, EMPTY, HeadwiseCache
from kvjax.policies import AdaKV, SnapKV
from kvjax.policies.duo import DuoAttention
from tests.conftest import prefill_policy, random_ids


def with_pos(lc, pos):
    import dataclasses

    return dataclasses.replace(lc, pos=jnp.asarray(pos, jnp.int32))


def test_plain_cache_counts_the_slots_holding_a_token():
    # 2 rows, 2 KV heads, 4 slots, head size 8, float32: a slot's keys and values are 2 x 8 x 4 = 64 bytes
    lc = with_pos(kvcache.empty(2, 2, 4, 8, jnp.float32), [[[0, 1, 2, EMPTY], [0, 1, EMPTY, EMPTY]],
                                                          [[0, DISABLED, DISABLED, DISABLED], [5, EMPTY, EMPTY, EMPTY]]])
    np.testing.assert_array_equal(kvcache.held_bytes((lc, lc)), [2 * 5 * 64, 2 * 2 * 64])
    # the full cache for 3 and 6 tokens: 2 layers x 2 KV heads x 64 bytes per token
    np.testing.assert_array_equal(kvcache.full_bytes((lc, lc), [3, 6]), [3 * 256, 6 * 256])
    np.testing.assert_allclose(kvcache.held_fraction((lc, lc), [3, 6]), [10 / 12, 4 / 24])
    assert kvcache.nbytes((lc,)) > lc.held_bytes().sum()  # allocated is not held


def test_headwise_cache_counts_each_group():
    # RazorAttention / DuoAttention: head 0 keeps all 6 tokens, head 1 a group of 2 slots
    whole = with_pos(kvcache.empty(1, 1, 6, 8, jnp.float32), [[[0, 1, 2, 3, 4, 5]]])
    local = with_pos(kvcache.empty(1, 1, 2, 8, jnp.float32), [[[0, 5]]])
    hw = HeadwiseCache((whole, local), ((0,), (1,)))
    np.testing.assert_array_equal(kvcache.held_bytes((hw,)), [8 * 64])
    np.testing.assert_array_equal(kvcache.full_bytes((hw,), 6), [6 * 2 * 64])
    np.testing.assert_allclose(kvcache.held_fraction((hw,), [6]), [8 / 12])


def test_pooled_cache_counts_its_valid_slots():
    # AdaKV: 5 prompt slots + 2 heads x 2 decode slots; head 0 kept 3 tokens, head 1 one, one decoded token
    pool = kvcache.empty_pool(1, 2, 5, 2, 8, jnp.float32)
    import dataclasses

    pool = dataclasses.replace(pool, pos=jnp.asarray([[0, 3, 4, 2, EMPTY, 5, EMPTY, EMPTY, EMPTY]], jnp.int32),
                               head=jnp.asarray([[0, 0, 0, 1, EMPTY, 0, EMPTY, EMPTY, EMPTY]], jnp.int32))
    np.testing.assert_array_equal(kvcache.held_bytes((pool,)), [5 * 64])
    np.testing.assert_array_equal(kvcache.full_bytes((pool,), 5), [5 * 2 * 64])


def test_int8_cache_counts_codes_scales_and_residual():
    lc = with_pos(kvcache.empty(1, 2, 4, 8, jnp.float32), [[[0, 1, 2, EMPTY], [2, EMPTY, EMPTY, EMPTY]]])
    qc = quant.store(quant.KVQuant(8), lc, jnp.asarray([EMPTY]))
    # per slot: 8 + 8 bytes of codes, a float32 scale for the key and one for the value: 24 bytes; 4 slots
    np.testing.assert_array_equal(qc.held_bytes(), [4 * 24])
    assert qc.token_bytes == 2 * 2 * 8 * 4  # the full cache's: float32 keys and values
    # a residual of 2: positions 1 and 2 of head 0, 2 of head 1 also in float32 (64 bytes each)
    qr = quant.store(quant.KVQuant(8, residual=2), lc, jnp.asarray([EMPTY]))
    assert qr.spec.residual == 2
    np.testing.assert_array_equal(kvcache.held_bytes((qr,)), [4 * 24 + 3 * 64])


def test_kivi_cache_counts_key_groups_holding_a_token():
    # 4 bits, group 4, head size 16, 8 slots, 3 tokens in the first key group, the second group empty
    lc = with_pos(kvcache.empty(1, 1, 8, 16, jnp.float32), [[[0, 1, 2] + [EMPTY] * 5]])
    qc = quant.store(quant.KVQuant(4, group=4), lc, jnp.asarray([EMPTY]))
    # per slot: 8 + 8 bytes of codes, the value's scale and zero per 4 channels (4 + 4 float32): 48 bytes;
    # per key group holding a token: a scale and a zero per channel (16 + 16 float32): 128 bytes
    np.testing.assert_array_equal(qc.held_bytes(), [3 * 48 + 128])
    assert qc.token_bytes == 2 * 16 * 4


PROMPT = 40  # tiny: 2 layers x 2 KV heads x head size 16, float32: 128 bytes per (layer, KV head, token)


def test_generation_reports_the_full_cache_as_all_of_its_prompt(tiny):
    gen = generate(tiny.model, [random_ids(PROMPT, 200), random_ids(PROMPT - 9, 200, seed=1)], FullCache(),
                   max_new_tokens=2)
    np.testing.assert_array_equal(gen.held_bytes, [PROMPT * 512, (PROMPT - 9) * 512])
    np.testing.assert_array_equal(gen.held_fraction, [1.0, 1.0])


def test_duo_reports_its_bytes_not_its_share_of_heads(tiny):
    # 3 of 4 KV heads streaming (kvpress's "ratio" 0.75): each holds 4 sinks + 8 recent, the retrieval head all 40
    duo = DuoAttention(streaming=((True, False), (True, True)), sinks=4, recent=8)
    gen = generate(tiny.model, [random_ids(PROMPT, 200)], duo, max_new_tokens=2)
    np.testing.assert_array_equal(gen.held_bytes, [(3 * 12 + PROMPT) * 128])
    np.testing.assert_allclose(gen.held_fraction, [(3 * 12 + PROMPT) / (4 * PROMPT)])
    assert gen.held_fraction[0] != pytest.approx(1 - 0.75)


def test_adakv_pool_holds_what_it_kept(tiny):
    ids = random_ids(PROMPT, 200)
    tokens, positions = jnp.asarray([ids]), jnp.arange(PROMPT, dtype=jnp.int32)[None]
    _, cache = prefill_policy(tiny.model, tokens, positions, AdaKV(scorer=SnapKV(ratio=0.75, observation_window=4)), 48)
    assert isinstance(cache[0], kvcache.PooledLayerCache)
    kept = sum(int((k >= 0).sum()) for k in kvcache.kept_positions(cache))
    assert kept == 2 * 2 * (PROMPT // 4)  # a quarter of each layer's prompt pairs, shared among its heads
    np.testing.assert_array_equal(kvcache.held_bytes(cache), [kept * 128])
    np.testing.assert_allclose(kvcache.held_fraction(cache, PROMPT), [0.25])
