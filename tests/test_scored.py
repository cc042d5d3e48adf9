"""Score-based prefill policies against NumPy transcriptions of their definitions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvcache
from kvjax import generate
from kvjax.attention import prefill_attention
from kvjax.cache import kept_sets, nbytes
from kvjax.policies.base import Context
from kvjax.policies.scored import TOVA, KNorm, ObservedAttention, PyramidKV, SlimKV, SnapKV
from kvjax.stats import AttentionStats, StatsRequest
from kvjax.models import load
from tests.conftest import random_ids
from kvjax import drive

B, KVH, G, T, D = 2, 2, 3, 40, 8
LENGTHS = [40, 27]  # left padding in the second row; neither a multiple of the window or kernel


def inputs(seed=0):
    rng = np.random.RandomState(seed)
    pos = np.full((B, T), -1, np.int32)
    for r, n in enumerate(LENGTHS):
        pos[r, T - n :] = np.arange(n)
    k = rng.randn(B, KVH, T, D).astype(np.float32)
    v = rng.randn(B, KVH, T, D).astype(np.float32) * rng.choice([1, 5], size=(B, KVH, T, 1))
    return pos, k, v, rng


def window_probs(rng, w):
    """Random attention rows of the last w queries (causal over real keys), as attention returns them."""
    p = np.zeros((B, KVH, G, w, T), np.float32)
    for r, n in enumerate(LENGTHS):
        for i in range(w):
            t = T - w + i  # time index of the query
            keys = np.arange(T - n, t + 1)
            x = rng.rand(KVH, G, len(keys)) ** 4
            p[r, :, :, i, keys] = np.moveaxis(x / x.sum(-1, keepdims=True), -1, 0)
    return p


def kept(policy, pos, k, v, stats):
    cap = policy.capacity(0, T + 4, T)
    cache = policy.prefill(0, kvcache.empty(B, KVH, cap, D, jnp.float32), jnp.asarray(k), jnp.asarray(v),
                           Context(jnp.asarray(pos)), jax.tree.map(jnp.asarray, stats))
    return [kept_sets((cache,), row=r)[0] for r in range(B)], cache


def np_pool(x, kernel, kind):
    pad = kernel // 2
    if kind == "avg":  # F.avg_pool1d with zero padding counted
        xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
        return np.stack([xp[..., i : i + kernel].mean(-1) for i in range(x.shape[-1])], -1)
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], constant_values=-np.inf)
    return np.stack([xp[..., i : i + kernel].max(-1) for i in range(x.shape[-1])], -1)


def np_topk_with_window(score_prefix, n, window, n_keep):
    """Keep the window and the best `n_keep - window` prefix tokens (positions 0..n-1)."""
    best = np.argsort(-score_prefix, kind="stable")[: max(n_keep - window, 0)]
    return sorted(set(best.tolist()) | set(range(n - window, n)))


@pytest.mark.parametrize("pool,kernel,agg", [("max", 7, "mean"), ("avg", 5, "mean"), ("avg", 5, "max"), ("none", 1, "sum")])
def test_snapkv_kept_positions(pool, kernel, agg):
    pos, k, v, rng = inputs(1)
    w, budget = 6, 14
    probs = window_probs(rng, w)
    got, _ = kept(SnapKV(budget=budget, observation_window=w, kernel=kernel, pool=pool, group_agg=agg), pos, k, v, AttentionStats(last_probs={w: probs}))
    for r, n in enumerate(LENGTHS):
        prefix = probs[r][..., T - n : T - w].mean(axis=2)  # [kvh, g, n - w]: mean over window queries
        pooled = np_pool(prefix, kernel, pool) if pool != "none" else prefix
        s = {"mean": pooled.mean(1), "max": pooled.max(1), "sum": pooled.sum(1)}[agg]
        for h in range(KVH):
            assert got[r][h] == np_topk_with_window(s[h], n, w, budget), (r, h)


@pytest.mark.parametrize("combine", ["product", "sum", "s1", "s2"])
def test_slimkv_equations_3_to_5_and_listing_1(combine):
    pos, k, v, rng = inputs(2)
    w, budget, kernel = 5, 12, 5
    probs = window_probs(rng, w)
    got, _ = kept(SlimKV(budget=budget, observation_window=w, kernel=kernel, combine=combine), pos, k, v, AttentionStats(last_probs={w: probs}))
    for r, n in enumerate(LENGTHS):
        for h in range(KVH):
            s1 = probs[r, h][:, :, T - n : T - w].sum(axis=(0, 1))  # eq. 3: over the group's heads and window queries
            s2 = np.abs(v[r, h, T - n : T - w]).max(-1)  # eq. 4
            # eq. 5 / Listing 1 / Table 3's "only S1" and "only S2"
            s = {"product": s1 * s2, "sum": s1 + s2, "s1": s1, "s2": s2}[combine]
            assert got[r][h] == np_topk_with_window(np_pool(s, kernel, "avg"), n, w, budget)


def test_knorm_tova_observed_attention():
    pos, k, v, rng = inputs(3)
    got, _ = kept(KNorm(budget=10), pos, k, v, {})
    for r, n in enumerate(LENGTHS):
        for h in range(KVH):
            norms = np.linalg.norm(k[r, h, T - n :], axis=-1)
            assert got[r][h] == sorted(np.argsort(norms, kind="stable")[:10].tolist())
    probs = window_probs(rng, 1)
    got, _ = kept(TOVA(ratio=0.6), pos, k, v, AttentionStats(last_probs={1: probs}))
    for r, n in enumerate(LENGTHS):
        keep = max(1, int(n * 0.4))
        s = probs[r, :, :, 0, T - n : T - 1].mean(axis=(0, 1))  # all heads of the layer
        expected = np_topk_with_window(s, n, 1, keep)
        assert got[r][0] == got[r][1] == expected
    colsum = rng.rand(B, KVH, G, T).astype(np.float32)
    for normalize in (False, True):
        got, _ = kept(ObservedAttention(budget=9, normalize=normalize), pos, k, v, AttentionStats(colsum=colsum))
        for r, n in enumerate(LENGTHS):
            s = colsum[r][..., T - n :]
            if normalize:  # kvpress: divided by the number of queries that see the key
                s = s / np.arange(n, 0, -1)
            for h in range(KVH):
                assert got[r][h] == sorted(np.argsort(-s[h].mean(0), kind="stable")[:9].tolist())


def kvpress_layer_budget(q_len, ratio, window, beta, layer, num_layers):
    """kvpress's PyramidKVPress.get_layer_budget, transcribed."""
    m = window + q_len * (1 - ratio)
    min_num = (m - window) / beta
    max_num = (m - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (m - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return round(q_len * (1 - ratio))
    steps = (max_num - min_num) / (num_layers - 1)
    return round(max_num - layer * steps)


def test_pyramidkv_budgets_follow_the_formula():
    for ratio in (0.25, 0.5, 0.8):
        p = PyramidKV(ratio=ratio, observation_window=8, beta=20, num_layers=6)
        for q in (40, 63, 100, 257, 1000):
            for layer in range(6):
                want = min(max(kvpress_layer_budget(q, ratio, 8, 20, layer, 6), 1), q)
                assert int(p.keep_count(layer, np.array(q))) == want, (ratio, q, layer)
                assert int(p.keep_count(layer, jnp.asarray([q]))[0]) == want
        budgets = [int(p.keep_count(layer, np.array(1000))) for layer in range(6)]
        assert budgets == sorted(budgets, reverse=True)  # decreasing with depth


def test_attention_statistics_match_a_direct_softmax():
    rng = np.random.RandomState(4)
    b, kvh, g, t, d = 2, 2, 2, 24, 8
    q = rng.randn(b, kvh * g, t, d).astype(np.float32)
    k = rng.randn(b, kvh, t, d).astype(np.float32)
    pos = np.tile(np.arange(t), (b, 1)).astype(np.int32)
    pos[1, :5] = -1
    pos[1, 5:] = np.arange(t - 5)
    _, st = prefill_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), jnp.asarray(pos), jnp.asarray(pos),
                              scale=d**-0.5, stats=StatsRequest(colsum=True, last_queries=frozenset({6})), block=8)
    s = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, g, axis=1)) / math.sqrt(d)
    visible = (pos[:, None, :] >= 0) & (pos[:, None, :] <= pos[:, :, None])
    s = np.where(visible[:, None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # padding queries see no key: their rows are NaN, then 0
        p = np.exp(s - s.max(-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(-1, keepdims=True)).reshape(b, kvh, g, t, t)
    np.testing.assert_allclose(np.asarray(st.last(6)), p[:, :, :, -6:], atol=1e-6)
    real_q = (pos >= 0)[:, None, None, :, None]
    np.testing.assert_allclose(np.asarray(st.colsum), np.where(real_q, p, 0).sum(3), atol=1e-5)


@pytest.mark.parametrize("policy", [
    SnapKV(budget=24, observation_window=8, kernel=5), SlimKV(budget=24, observation_window=8, kernel=5), KNorm(budget=24),
    TOVA(budget=24), ObservedAttention(budget=24), PyramidKV(budget=24, observation_window=8, kernel=5, num_layers=2),
], ids=lambda p: type(p).__name__)
def test_cache_holds_the_budget_and_decodes(sharp_dir, policy):
    model = load(sharp_dir).model
    g = generate(model, [random_ids(100, 260, seed=5), random_ids(70, 260, seed=6)], policy, max_new_tokens=9, eos_ids=())
    assert g.lengths.tolist() == [9, 9]
    cfg = model.cfg
    for i, layer in enumerate(g.cache):
        kept_prompt = int(policy.keep_count(i, np.arange(1, 129)).max())
        # The bucket is 128: the budget + the new tokens' buffer (9 rounded up to 16), not 128 + 9.
        assert layer.capacity == kept_prompt + g.room and g.room == 16
        held = (np.asarray(layer.pos) >= 0).sum(-1)
        assert (held[0] == int(policy.keep_count(i, np.array(100))) + 8).all()  # 8 decoded tokens were inserted
    # k, v float32, pos and log_w per slot; no statistic (ObservedAttention keeps a running `mass` in a chunked
    # prefill only)
    assert nbytes(g.cache) == sum(cfg.num_kv_heads * 2 * l.capacity * (2 * cfg.head_dim * 4 + 2 * 4) for l in g.cache)


def test_errors():
    with pytest.raises(ValueError, match="exactly one of budget"):
        SnapKV(budget=10, ratio=0.5)
    with pytest.raises(ValueError, match="exactly one of budget"):
        SnapKV()
    with pytest.raises(ValueError, match=r"ratio=1.0 must be in \[0, 1\)"):
        SnapKV(ratio=1.0)
    with pytest.raises(ValueError, match="budget=16 must be at least observation_window=32"):
        SnapKV(budget=16)
    with pytest.raises(ValueError, match="pool='mean'"):
        SnapKV(budget=64, pool="mean")
    with pytest.raises(ValueError, match="combine='mul'"):
        SlimKV(budget=64, combine="mul")
    with pytest.raises(ValueError, match="prefill_mode must be 'full'"):
        KNorm(budget=8, prefill_mode="stream")
    with pytest.raises(ValueError, match="num_layers=32 but the model has 2 layers"):
        PyramidKV(budget=64).check(2)


def test_token_by_token_scoring_refuses_prefill_only_compressors(sharp_dir):
    from kvjax.policies import H2O
    from kvjax.scoring import perplexity

    model = load(sharp_dir).model
    ids = random_ids(40, 260, seed=8)
    with pytest.raises(ValueError, match=r"SnapKV\(.*compresses a whole prompt once"):
        perplexity(model, ids, SnapKV(budget=16, observation_window=4))
    assert np.isfinite(perplexity(model, ids, H2O(budget=16, recent=4, prefill_mode="stream")))


def test_ratio_counts_under_jit_are_kvpress_float64_counts(sharp_dir):
    """A ratio's count is kvpress's `int(n * (1 - ratio))` in float64, also under jit: 100 tokens at ratio 0.8
    keep 19 (float32 rounds 100 * 0.2 up to 20, one slot more than kvpress), for a prompt compressor and for a
    ring policy's per-row budget."""
    from kvjax.cache import kept_sets
    from kvjax.policies import StreamingLLM
    from kvjax.models import load
    from tests.conftest import left_pad, random_ids, stepper

    assert int(100 * (1 - 0.8)) == 19 and int(np.float32(100) * np.float32(1 - 0.8)) == 20
    model = load(sharp_dir).model
    ids = random_ids(100, 260, seed=90)
    for policy in (SnapKV(ratio=0.8, observation_window=4, kernel=3), StreamingLLM(budget=None, ratio=0.8, sinks=2)):
        prefill, _ = stepper(model, policy, 128 + 2)
        _, cache = prefill(*left_pad(ids, 128))
        assert all(len(h) == 19 for layer in kept_sets(cache) for h in layer), policy.describe()


def test_expected_attention_refuses_chunks_without_first_warning_they_change_it():
    """ExpectedAttention's query statistics are the whole prompt's: a chunked prefill is refused with that reason,
    and not also warned about as if it would run as another method."""
    import warnings

    from kvjax.errors import InvalidInput
    from kvjax.policies import ExpectedAttention

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(InvalidInput, match="statistics of future queries are the whole prompt's"):
            ExpectedAttention(ratio=0.5, prefill_mode="chunked", chunk=32)
    assert not [w for w in seen if "chunk" in str(w.message)], [str(w.message) for w in seen]


def test_adakv_pool_bytes_are_the_sum_of_its_per_head_budgets(sharp_dir):
    """AdaKV(SnapKV(budget=B)) keeps, per layer, one pool of `kv_heads x (B + room)` slots: its bytes are that many
    slots of (key, value, position, head index), by formula, while its heads keep different counts summing to
    `kv_heads x B`; decoding fills each head's token into the pool, and every head then holds its prompt slots and
    each decoded position."""
    from kvjax.cache import PooledLayerCache
    from kvjax.policies import AdaKV

    lm = load(sharp_dir)
    cfg = lm.config
    budget, new, prompt = 12, 5, random_ids(60, cfg.vocab_size, seed=3)
    out = generate(lm.model, [prompt], AdaKV(scorer=SnapKV(budget=budget, observation_window=4)),
                   max_new_tokens=new, eos_ids=[])
    room = out.room  # the generation buffer: a slot per head for every token decoded
    d, kvh = cfg.head_dim, cfg.num_kv_heads
    uneven = False
    for layer, kept in zip(out.cache, kept_sets(out.cache)):
        assert isinstance(layer, PooledLayerCache)
        slots = kvh * (budget + room)
        assert layer.capacity == slots
        assert layer.nbytes == slots * (2 * d * 4 + 4 + 4)  # float32 key and value, int32 position and head
        from_prompt = [[p for p in h if p < len(prompt)] for h in kept]
        assert sum(map(len, from_prompt)) == kvh * budget
        uneven |= len({len(h) for h in from_prompt}) > 1
        for h in kept:
            assert [p for p in h if p >= len(prompt)] == list(range(len(prompt), len(prompt) + new - 1))
    assert uneven, "every head kept the same count: the test shows nothing about per-head budgets"
    snap = generate(lm.model, [prompt], SnapKV(budget=budget, observation_window=4), max_new_tokens=new, eos_ids=[])
    assert nbytes(out.cache) == nbytes(snap.cache)  # the same slots; a head index where SnapKV keeps a logit bias


def test_adakv_composes_with_by_layer_and_ratios_and_refuses_a_head_group(sharp_dir):
    """AdaKV at a ratio in some layers (`by_layer`): those layers pool their heads, each row keeping
    `kv_heads x floor(n (1 - ratio))` prompt tokens; inside a head split (`by_head`) it is refused by name."""
    from kvjax.errors import InvalidInput
    from kvjax.policies import AdaKV, FullCache, StreamingLLM, by_head, by_layer

    lm = load(sharp_dir)
    cfg = lm.config
    prompts = [random_ids(90, cfg.vocab_size, seed=1), random_ids(61, cfg.vocab_size, seed=2)]
    pol = by_layer(StreamingLLM(budget=40), AdaKV(scorer=SnapKV(ratio=0.5, observation_window=8)), 1)
    out = generate(lm.model, prompts, pol, max_new_tokens=4, eos_ids=[])
    assert [type(c).__name__ for c in out.cache] == ["LayerCache"] + ["PooledLayerCache"] * (cfg.num_layers - 1)
    for row, p in enumerate(prompts):
        kept = kept_sets(out.cache, row)[1]
        assert sum(len([q for q in h if q < len(p)]) for h in kept) == cfg.num_kv_heads * math.floor(len(p) * 0.5)
    split = by_head([[True] + [False] * (cfg.num_kv_heads - 1)] * cfg.num_layers, FullCache(),
                    AdaKV(scorer=SnapKV(budget=40, observation_window=8)))
    with pytest.raises(InvalidInput, match="cannot cache one head group"):
        drive.plan(lm.model, split)
