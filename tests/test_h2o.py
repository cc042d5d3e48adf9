"""H2O's decode-time eviction against the NumPy reference, step by step."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvcache
from kvjax.cache import kept_sets
from kvjax.policies.base import Context
from kvjax.policies.h2o import H2O
from kvjax.stats import AttentionStats
from kvjax.models import load
from tests.conftest import left_pad, random_ids, stepper
from tests.reference import RefLlama, h2o_update


@pytest.mark.parametrize("model", ["sharp_dir", "sharp_mha_dir"])
def test_h2o_decode_eviction_matches_reference(request, model):
    """The prompt token by token, then 50 decode steps: kept positions per layer and KV head
    after every step equal the reference's; logits within 1e-5 of the logit scale."""
    model_dir = request.getfixturevalue(model)
    budget, recent, prompt_len, steps = 12, 4, 8, 50
    ids = random_ids(prompt_len + steps, 260, seed=40)
    prefill, decode = stepper(load(model_dir).model, H2O(budget=budget, recent=recent, prefill_mode="stream"), 16 + steps)
    logits, cache = prefill(*left_pad(ids[:prompt_len], 16))
    ours, kept = [np.asarray(logits[0])], [kept_sets(cache)]
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        ours.append(np.asarray(logits[0]))
        kept.append(kept_sets(cache))

    ref = RefLlama(model_dir)
    caches, update = ref.empty_caches(), h2o_update(budget, recent)
    ref_logits = [ref.step(ids[t], t, caches, update, rolling=False) for t in range(prompt_len)][-1:]
    ref_kept = [[[[e["pos"] for e in head] for head in layer] for layer in caches]]
    for t in range(prompt_len, prompt_len + steps):
        ref_logits.append(ref.step(ids[t], t, caches, update, rolling=False))
        ref_kept.append([[[e["pos"] for e in head] for head in layer] for layer in caches])
    for step, (a, b) in enumerate(zip(kept, ref_kept)):
        assert a == b, f"kept positions differ after step {step}"
    ref_logits = np.stack(ref_logits)
    np.testing.assert_allclose(np.stack(ours), ref_logits, atol=1e-5 * np.abs(ref_logits).max(), rtol=0)
    # heavy hitters really are kept: some kept tokens are neither recent nor the first few
    assert any(any(recent <= p < prompt_len + steps - recent for p in head) for layer in kept[-1] for head in layer)


def test_h2o_full_prefill_keeps_top_observed_attention_and_recent():
    rng = np.random.RandomState(41)
    b, kvh, g, t, d = 1, 2, 2, 30, 4
    pos = jnp.arange(t)[None]
    colsum = rng.rand(b, kvh, g, t).astype(np.float32)
    k = jnp.asarray(rng.randn(b, kvh, t, d), jnp.float32)
    p = H2O(budget=10, recent=3)
    cache = p.prefill(0, kvcache.empty(b, kvh, 10, d, jnp.float32, p.cache_state), k, k, Context(pos), AttentionStats(colsum=jnp.asarray(colsum)))
    for h in range(kvh):
        acc = colsum[0, h].sum(0)
        heavy = np.argsort(-acc[: t - 3], kind="stable")[:7]
        assert kept_sets((cache,))[0][h] == sorted(set(heavy.tolist()) | {27, 28, 29})
        held = np.asarray(cache.pos[0, h])
        np.testing.assert_allclose(np.asarray(cache.state["mass"][0, h]), acc[held], rtol=1e-6)  # scores carried over


def test_h2o_errors():
    with pytest.raises(ValueError, match=r"budget=4 must exceed recent=4"):
        H2O(budget=4, recent=4)
    with pytest.raises(ValueError, match=r"recent=0 must be >= 1"):
        H2O(budget=4, recent=0)


@pytest.mark.parametrize("mode", ["full", "stream"])
def test_h2o_ratio_budget_per_row(sharp_dir, mode):
    """`H2O(ratio=r)`: in one batch, a row of n prompt tokens keeps max(recent + 1, floor(n (1 - r))) slots
    after the prompt and through decoding, and keeps what a token-budget H2O of that row's count keeps
    when the row runs alone (that path is checked against the NumPy reference above); the prompt
    attended whole, or read token by token (H2O's own setting)."""
    model = load(sharp_dir).model
    ratio, recent, steps = 0.5, 3, 6
    lengths = (40, 23)
    rows = [random_ids(n, 260, seed=50 + n) for n in lengths]
    bucket = 64
    toks = np.zeros((2, bucket), np.int32)
    pos = np.full((2, bucket), -1, np.int32)
    for i, ids in enumerate(rows):
        toks[i, bucket - len(ids):], pos[i, bucket - len(ids):] = ids, np.arange(len(ids))
    policy = H2O(ratio=ratio, recent=recent, prefill_mode=mode)
    assert "ratio=0.5" in policy.describe() and "ratio" not in H2O(budget=8, recent=2).describe()
    prefill, decode = stepper(model, policy, bucket + steps)
    _, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    nxt = np.random.RandomState(3).randint(4, 260, (steps, 2))
    kept = [kept_sets(cache, r) for r in range(2)]
    for s in range(steps):
        _, cache = decode(jnp.asarray(nxt[s]), jnp.asarray([n + s for n in lengths]), cache)
    for r, n in enumerate(lengths):
        want = max(recent + 1, int(np.floor(n * (1 - ratio))))
        assert all(len(head) == want for layer in kept[r] for head in layer)
        assert all(len(head) == want for layer in kept_sets(cache, r) for head in layer)  # through decoding
        alone_prefill, alone_decode = stepper(model, H2O(budget=want, recent=recent, prefill_mode=mode),
                                              bucket + steps)
        _, alone = alone_prefill(*left_pad(rows[r], bucket))
        assert kept_sets(alone) == kept[r]
        for s in range(steps):
            _, alone = alone_decode(jnp.asarray([nxt[s, r]]), jnp.asarray([n + s]), alone)
        assert kept_sets(alone) == kept_sets(cache, r)
    with pytest.raises(ValueError, match="exactly one of budget"):
        H2O(budget=8, ratio=0.5, recent=2)
    with pytest.raises(ValueError, match="prefill_mode must be 'full' or 'stream'"):
        H2O(ratio=0.5, recent=2, prefill_mode="chunked", chunk=1)


def test_h2o_ratio_recent_window_follows_each_rows_budget(sharp_dir):
    """Under a ratio, H2O's default recent window is half of each row's own budget (kvjax's reading of
    the paper's equal split), not half of a token budget given elsewhere: as `--ratio 0.8 --budget 128`
    builds it, a 60-token row keeps 11 slots (5 recent) and a 200-token row 39 (19 recent), each the
    set a token-budget H2O of that size and split keeps alone (checked against the NumPy reference
    above)."""
    from kvjax.policies import make_policy

    model = load(sharp_dir).model
    policy = make_policy("h2o", 128, ratio=0.8)
    lengths, bucket = (60, 200), 256
    rows = [random_ids(n, 260, seed=70 + n) for n in lengths]
    toks = np.zeros((2, bucket), np.int32)
    pos = np.full((2, bucket), -1, np.int32)
    for i, ids in enumerate(rows):
        toks[i, bucket - len(ids):], pos[i, bucket - len(ids):] = ids, np.arange(len(ids))
    prefill, _ = stepper(model, policy, bucket + 4)
    _, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    # kvpress's count, int(n (1 - r)) in float64: 11 of 60 and 39 of 200 at r = 0.8 (0.19999999999999996 of each)
    for r, (n, want, recent) in enumerate(zip(lengths, (11, 39), (5, 19))):
        kept = kept_sets(cache, r)
        assert all(len(head) == want for layer in kept for head in layer), (n, [len(h) for h in kept[0]])
        alone, _ = stepper(model, H2O(budget=want, recent=recent), bucket + 4)
        _, c = alone(*left_pad(rows[r], bucket))
        assert kept_sets(c) == kept


def _numpy_h2o_chunks(q, k, budget, recent, chunk):
    """Plain NumPy transcription of H2O's chunked rule (`kvjax.policies.h2o`'s docstring): before a chunk,
    its victims are the cached tokens outside the recent window of its first token, lightest score first
    (ties: the oldest); query i sees the cache but the first max(0, i + 1 - free) victims, and the chunk's
    tokens up to itself; then every key's score grows by the attention the chunk's queries gave it (over
    the group's query heads), the victims the chunk needed leave, and the chunk's tokens enter."""
    _, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    history = []
    acc = [{} for _ in range(kvh)]
    for s in range(0, t, chunk):
        cpos = list(range(s, s + chunk))
        for j in range(kvh):
            free = budget - len(acc[j])
            victims = sorted((p for p in acc[j] if p <= s - recent), key=lambda p: (acc[j][p], p))
            gained = {p: 0.0 for p in list(acc[j]) + cpos}
            for i, qp in enumerate(cpos):
                hidden = set(victims[: max(0, i + 1 - free)])
                keys = [p for p in sorted(acc[j]) if p not in hidden] + cpos[: i + 1]
                for gi in range(g):
                    logit = k[0, j, keys] @ q[0, j * g + gi, qp] / np.sqrt(d)
                    pr = np.exp(logit - logit.max())
                    for p, w in zip(keys, pr / pr.sum()):
                        gained[p] += w
            for p in victims[: max(0, chunk - free)]:
                del acc[j][p]
                del gained[p]
            acc[j] = {p: acc[j].get(p, 0.0) + gained[p] for p in gained}
        history.append(([sorted(a) for a in acc], [dict(a) for a in acc]))
    return history


@pytest.mark.parametrize("chunk", [8, 32])
def test_h2o_chunked_matches_the_stated_rule(chunk):
    """H2O read in chunks of 8 and 32 (96 tokens into 40 slots, recent 4): after every chunk the kept
    positions and their accumulated scores are the NumPy transcription's of the stated rule (chunk 1 is
    the stream: `tests/test_chunked.py`)."""
    from kvjax import attention
    from kvjax.policies import H2O as H2OPolicy

    rng = np.random.default_rng(11)
    b, kvh, g, t, d, budget, recent = 1, 2, 2, 96, 8, 40, 4
    q = rng.normal(size=(b, kvh * g, t, d)).astype(np.float32) * 2
    k = rng.normal(size=(b, kvh, t, d)).astype(np.float32)
    pos = np.arange(t, dtype=np.int32)[None]
    with pytest.warns(UserWarning, match="different method"):
        policy = H2OPolicy(budget=budget, recent=recent, prefill_mode="chunked", chunk=chunk)
    cache = kvcache.empty(b, kvh, budget, d, jnp.float32, policy.cache_state)
    ref = _numpy_h2o_chunks(q.astype(np.float64), k.astype(np.float64), budget, recent, chunk)
    for step, s in enumerate(range(0, t, chunk)):
        sl = slice(s, s + chunk)
        ctx = Context(jnp.asarray(pos[:, sl]))
        cache = policy.make_room(0, cache, ctx)
        visible, _ = policy.chunk_visible(0, cache, ctx)
        _, stats = attention.prefix_attention(
            jnp.asarray(q[:, :, sl]), jnp.asarray(k[:, :, sl]), jnp.asarray(k[:, :, sl]), ctx.pos, cache.k, cache.v,
            cache.pos, cache.log_w, scale=d**-0.5, slot_visible=visible, stats=policy.stats(0).prefill)
        cache = policy.absorb(0, cache, jnp.asarray(k[:, :, sl]), jnp.asarray(k[:, :, sl]), ctx, stats)
        kept, scores = ref[step]
        assert kept_sets((cache,))[0] == kept, f"chunk {step}"
        held, score = np.asarray(cache.pos[0]), np.asarray(cache.state["mass"][0])
        for j in range(kvh):
            got = {int(p): float(x) for p, x in zip(held[j], score[j]) if p >= 0}
            np.testing.assert_allclose([got[p] for p in kept[j]], [scores[j][p] for p in kept[j]], rtol=1e-4)
    assert all(len(hd) == budget for hd in kept_sets((cache,))[0])
