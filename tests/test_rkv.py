"""R-KV against a NumPy transcription of its reference code (Zefan-Cai/R-KV, `rkv/compression/r1_kv.py`
`update_kv` and `rkv/utils.py` `compute_attention_scores` / `cal_similarity`), one query head per KV head (where
kvjax's group sum and the reference's max over the group's logits are the same)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax import cache as kvcache
from kvjax.errors import InvalidInput
from kvjax.policies import RKV, Context, make_policy
from kvjax.stats import AttentionStats


def reference_score(K, Q, w, ks=7, lam=0.07, thr=0.5):
    """The reference's score of the L - w keys before the window. K: (H, L, d) keys; Q: (H, w, d) the last w
    queries (one per KV head)."""
    H, L, d = K.shape
    logits = np.einsum("hqd,hld->hql", Q, K) / np.sqrt(d)
    x = logits[:, -w:, : L - w]  # compute_attention_scores, then attn_weights[..., -w:, :-w]
    x = np.exp(x - x.max(-1, keepdims=True))
    imp = (x / x.sum(-1, keepdims=True)).mean(1)
    p = ks // 2
    pad = np.pad(imp, ((0, 0), (p, p)), constant_values=-np.inf)  # F.max_pool1d's padding
    imp = np.stack([pad[:, i: i + ks].max(-1) for i in range(L - w)], -1)
    Kn = K / (np.linalg.norm(K, axis=-1, keepdims=True) + 1e-8)
    S = Kn @ Kn.transpose(0, 2, 1)
    for h in range(H):
        np.fill_diagonal(S[h], 0.0)
    last = np.where(S > thr, np.arange(L), 0).max(-1)  # retain_direction="last"; 0 where none is similar
    for h in range(H):
        S[h, np.arange(L), last[h]] = 0.0
    red = S.mean(1)
    red = np.exp(red - red.max(-1, keepdims=True))
    red = (red / red.sum(-1, keepdims=True))[:, : L - w]
    return lam * imp - (1 - lam) * red


def reference_keep(K, Q, budget, w, **kw):
    """Positions kept by `update_kv`: the top `budget - w` scores and the window, per KV head (sorted)."""
    L = K.shape[1]
    if L < budget:
        return [list(range(L))] * K.shape[0]
    s = reference_score(K, Q, w, **kw)
    return [sorted(np.argsort(-s[h], kind="stable")[: budget - w].tolist() + list(range(L - w, L)))
            for h in range(K.shape[0])]


def duplicated_keys(rng, n, kvh, d):
    """Random keys with near-duplicates (several above the 0.5 similarity threshold), so redundancy matters."""
    k = rng.normal(size=(n, kvh, d)).astype(np.float32)
    for i in range(3, n, 4):
        k[i] = k[i - 3] + 0.2 * rng.normal(size=(kvh, d))
    return k


@pytest.mark.parametrize("pad", [0, 3])
def test_rkv_prompt_score_matches_the_reference_transcription(pad):
    """The prompt's score and kept set, its row left-padded by `pad` slots (the reference's index 0 is the first
    real key)."""
    rng = np.random.default_rng(0)
    kvh, d, t, w, budget = 2, 8, 40, 8, 20
    k = duplicated_keys(rng, t, kvh, d)
    q = rng.normal(size=(t, kvh, d)).astype(np.float32) * 2
    logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)  # what a prompt's attention hands over: [h, t, t]
    probs = np.pad(probs, ((0, 0), (0, 0), (pad, 0)))
    stats = AttentionStats(last_probs={w: jnp.asarray(probs[None, :, None, -w:])})
    rule = RKV(budget=budget)
    kj = jnp.asarray(np.pad(k.transpose(1, 0, 2), ((0, 0), (pad, 0), (0, 0)), constant_values=1.0)[None])
    pos = jnp.asarray(np.r_[[-1] * pad, np.arange(t)], jnp.int32)[None]
    ours = np.asarray(rule.score(0, kj, kj, pos, stats))[0, :, pad:]
    theirs = reference_score(k.transpose(1, 0, 2), q.transpose(1, 0, 2)[:, -w:], w)
    np.testing.assert_allclose(ours[:, : t - w], theirs, rtol=1e-5, atol=1e-7)
    cache = kvcache.empty(1, kvh, budget + 4, d, jnp.float32, rule.cache_state)
    kept = kvcache.kept_sets((rule.prefill(0, cache, kj, kj, Context(pos), stats),))[0]  # positions, not slots
    assert kept == reference_keep(k.transpose(1, 0, 2), q.transpose(1, 0, 2)[:, -w:], budget, w)


def test_rkv_while_decoding_keeps_what_the_reference_keeps():
    """`rkv(budget=B, decode_slots=N)` decoding token by token from an empty cache: B + N slots; whenever the length
    is a multiple of N and the cache holds at least B tokens (the reference's `step_length` schedule), the kept
    positions are the reference's `update_kv` on the cache with the last w decode queries."""
    rng = np.random.default_rng(1)
    kvh, d, steps, B, N, w = 2, 8, 75, 16, 8, 4
    policy = make_policy("rkv", B, decode_slots=N, observation_window=w)
    rule = policy.scorer
    assert policy.capacity(0, 10_000) == B + N
    q = rng.normal(size=(steps, kvh, d)).astype(np.float32) * 2
    k = duplicated_keys(rng, steps, kvh, d)
    cache = kvcache.empty(1, kvh, B + N, d, jnp.float32, policy.cache_state)

    @jax.jit
    def step(cache, q_t, k_t, t):
        ctx = Context(t)
        cache = policy.step(0, cache, k_t, k_t, ctx)
        _, stats = attention.decode_attention(q_t, cache.k, cache.v, cache.pos, cache.log_w, scale=d**-0.5,
                                              stats=policy.stats(0).decode)
        return policy.observe(0, cache, ctx, stats)

    kept = [[] for _ in range(kvh)]
    compressions = 0
    for t in range(steps):
        cache = step(cache, jnp.asarray(q[t][None]), jnp.asarray(k[t][None]), jnp.asarray([t], jnp.int32))
        for h in range(kvh):
            kept[h].append(t)
        if t % N == 0 and len(kept[0]) >= B:
            compressions += 1
            for h in range(kvh):
                K = k[kept[h], h][None]
                kept[h] = [kept[h][i] for i in reference_keep(K, q[t - w + 1: t + 1, h][None], B, w,
                                                              ks=rule.kernel, lam=rule.mix_lambda)[0]]
        assert max(len(x) for x in kept) <= B + N
        assert kvcache.kept_sets((cache,))[0] == kept, f"step {t}"
    assert compressions == 8  # at positions 16, 24, ..., 72


def test_rkv_refuses_what_it_cannot_run():
    with pytest.raises(InvalidInput, match="chunked"):
        RKV(budget=16, prefill_mode="chunked", chunk=16)
    with pytest.raises(InvalidInput, match="does not take"):
        make_policy("rkv", 16, ratio=0.5)
