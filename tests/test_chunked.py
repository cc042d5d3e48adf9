"""Chunked prefill (`prefill_mode="chunked"`): against stream mode, full prefill, and a NumPy reference
of "score cache ∪ chunk, keep the top"; bounded memory and one compilation across prompt lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import attention
from kvjax import cache as kvcache
from kvjax.errors import InvalidInput
from kvjax.masks import Mask
from kvjax.policies import (
    H2O,
    TOVA,
    FullCache,
    KNorm,
    LocalWindow,
    ObservedAttention,
    PyramidKV,
    RazorAttention,
    recompress,
    SlimKV,
    SnapKV,
    StreamingLLM,
    make_policy,
    mat,
)
from kvjax.policies.base import Context
from kvjax.scoring import chunked_logprobs, stream_logprobs
from kvjax.models import load
from tests.conftest import compile_log, left_pad, prefill_policy, random_ids
import functools
from kvjax import drive, engine

T = 45  # two rows: one of 45 tokens, one of 40 (left padded)


@pytest.fixture(scope="module")
def sharp(sharp_dir):
    yield load(sharp_dir).model
    _RUNS.clear()


@pytest.fixture(scope="module")
def prompts(sharp):
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(4, sharp.cfg.vocab_size, (2, T)), jnp.int32)
    pos = np.tile(np.arange(T, dtype=np.int32), (2, 1))
    pos[1] = np.where(np.arange(T) < 5, -1, np.arange(T) - 5)
    return toks, jnp.asarray(pos)


_RUNS = {}


def _run(model, toks, pos, policy, steps=0):
    """Prefill, then `steps` teacher-forced decode steps: (logits per step, kept positions per step).
    Memoized per policy: the stream and full-prefill references are shared by several tests."""
    key = (id(model), policy, steps)
    if key not in _RUNS:
        _RUNS[key] = _run_uncached(model, toks, pos, policy, steps)
    return _RUNS[key]


def _run_uncached(model, toks, pos, policy, steps):
    logits, cache = jax.jit(functools.partial(prefill_policy, model), static_argnums=(2, 3))(toks, pos, policy, T + 3)
    out, kept = [np.asarray(logits)], [kvcache.kept_positions(cache)]
    nxt = jnp.max(pos, axis=1) + 1
    for s in range(steps):
        logits, cache = jax.jit(functools.partial(drive.decode, model), static_argnums=3)(toks[:, s], nxt + s, cache, drive.plan(model, policy))
        out.append(np.asarray(logits))
        kept.append(kvcache.kept_positions(cache))
    return out, kept


def _assert_same(a, b, tol):
    (la, ka), (lb, kb) = a, b
    for step, (x, y) in enumerate(zip(ka, kb)):
        for layer, (p, q) in enumerate(zip(x, y)):
            np.testing.assert_array_equal(p, q, err_msg=f"kept positions, step {step}, layer {layer}")
    for step, (x, y) in enumerate(zip(la, lb)):
        np.testing.assert_allclose(x, y, rtol=0, atol=tol, err_msg=f"logits, step {step}")


STREAM_EXACT = [
    ("streaming-abs", lambda **m: StreamingLLM(budget=12, sinks=3, **m)),
    ("streaming-rolling", lambda **m: StreamingLLM(budget=12, sinks=3, positions="rolling", **m)),
    ("local", lambda **m: LocalWindow(size=10, **m)),
    ("full", lambda **m: FullCache(**m)),
    ("h2o", lambda **m: H2O(budget=12, recent=4, **m)),
    ("mat", lambda **m: mat(12, 4, shallow_layers=1, sinks=2, **m)),
    ("razor", lambda **m: RazorAttention(retrieval=((True, False), (False, True)), buffer=8, sinks=2, **m)),
]


@pytest.mark.parametrize("name,make", STREAM_EXACT, ids=[n for n, _ in STREAM_EXACT])
def test_chunk_of_one_is_stream_mode(sharp, prompts, name, make):
    """chunk=1 reads the prompt exactly as stream mode does: kept positions per layer and KV head
    after the prompt and after each decode step, and logits within 1e-5 of the logit scale (float32;
    all but RazorAttention within 1e-5 absolute, Razor's compensation mean 1.2e-5). (RazorAttention's
    local heads: their window and compensation slot; its retrieval heads: everything.)"""
    stream = _run(sharp, *prompts, make(prefill_mode="stream"), steps=3)
    scale = max(1.0, float(np.abs(stream[0][0]).max()))
    _assert_same(_run(sharp, *prompts, make(prefill_mode="chunked", chunk=1), steps=3), stream, 1e-5 * scale)


@pytest.mark.parametrize("positions,chunk", [("absolute", 7), ("rolling", 4), ("rolling", 64)])
def test_ring_chunks_of_any_size_are_stream_mode(sharp, prompts, chunk, positions):
    """A ring's chunk query sees the sinks and its own window (what the stream's ring holds when that
    token arrives), so chunked StreamingLLM is the token-by-token result at any chunk size, in absolute
    and in rolling positions (a sink's distance counted from min(query, C - 1), as ranks do)."""
    make = lambda **m: StreamingLLM(budget=12, sinks=3, positions=positions, **m)  # noqa: E731
    stream = _run(sharp, *prompts, make(prefill_mode="stream"))
    scale = np.abs(stream[0][0]).max()
    _assert_same(_run(sharp, *prompts, make(prefill_mode="chunked", chunk=chunk)), stream, 1e-5 * max(scale, 1))


SCORED = [
    ("snapkv", lambda **m: SnapKV(budget=10, observation_window=4, kernel=3, **m)),
    ("pyramidkv", lambda **m: PyramidKV(budget=10, observation_window=4, num_layers=2, **m)),
    ("slimkv", lambda **m: SlimKV(budget=10, observation_window=4, kernel=3, **m)),
    ("observed-normalized", lambda **m: ObservedAttention(budget=10, normalize=True, **m)),
    ("tova", lambda **m: TOVA(budget=10, **m)),
    ("knorm", lambda **m: KNorm(budget=10, **m)),
]


@pytest.mark.parametrize("name,make", SCORED, ids=[n for n, _ in SCORED])
def test_one_chunk_holding_the_prompt_is_full_prefill(sharp, prompts, name, make):
    """A chunk at least as long as the prompt compresses it as the whole-prompt prefill does: the same
    kept positions, and logits within 1e-5 of the logit scale."""
    full = _run(sharp, *prompts, make())
    scale = np.abs(full[0][0]).max()
    _assert_same(_run(sharp, *prompts, make(prefill_mode="chunked", chunk=64)), full, 1e-5 * max(scale, 1))


def _numpy_snapkv_chunks(q, k, pos, budget, window, kernel, chunk):
    """Plain NumPy: per KV head, the positions kept after each chunk when the chunk's last `window`
    queries score the cache's tokens and the chunk's (cache first, empty slots as score 0 in front,
    as the cache holds them), SnapKV's way: mean over window queries, prefix only, max-pool, mean
    over the group; the latest `window` tokens always kept, then the top scores (ties: earlier)."""
    _, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    kept = [[] for _ in range(kvh)]
    history = []
    for s in range(0, t, chunk):
        cpos = list(range(s, s + chunk))
        last = cpos[-1]
        for j in range(kvh):
            cand = [None] * (budget - len(kept[j])) + kept[j] + cpos  # None: an empty slot
            real = [c for c in cand if c is not None]
            score = np.zeros(len(cand))
            for gi in range(g):
                qs = q[0, j * g + gi, last - window + 1: last + 1]  # [w, d]
                logit = qs @ k[0, j, real].T / np.sqrt(d)  # [w, n_real]
                qp = np.arange(last - window + 1, last + 1)[:, None]
                logit = np.where(np.asarray(real)[None] <= qp, logit, -np.inf)
                p = np.exp(logit - logit.max(axis=1, keepdims=True))
                p = (p / p.sum(axis=1, keepdims=True)).mean(axis=0)
                full = np.zeros(len(cand))
                full[[i for i, c in enumerate(cand) if c is not None]] = p
                full = np.where([c is not None and c < last + 1 - window for c in cand], full, 0.0)
                pooled = np.array([full[max(0, i - kernel // 2): i + kernel // 2 + 1].max() for i in range(len(cand))])
                score += pooled / g
            always = [c for c in real if c > last - window]
            others = sorted((c for c in real if c <= last - window), key=lambda c: (-score[cand.index(c)], c))
            kept[j] = sorted(always + others[: budget - len(always)])
        history.append([list(x) for x in kept])
    return history


def test_chunked_snapkv_matches_numpy_reference():
    """Four chunks of 10 tokens into a 12-slot SnapKV cache (2 KV heads, 2 query heads each): the
    chunk's attention over cache ∪ chunk (`attention.prefix_attention`) and the policy's fold keep,
    after every chunk, the positions a NumPy transcription of the rule keeps."""
    rng = np.random.default_rng(3)
    b, kvh, g, t, d, chunk, budget, window = 1, 2, 2, 40, 8, 10, 12, 4
    q = rng.normal(size=(b, kvh * g, t, d)).astype(np.float32) * 2
    k = rng.normal(size=(b, kvh, t, d)).astype(np.float32)
    v = rng.normal(size=(b, kvh, t, d)).astype(np.float32)
    pos = np.arange(t, dtype=np.int32)[None]
    policy = SnapKV(budget=budget, observation_window=window, kernel=3, prefill_mode="chunked", chunk=chunk)
    cache = kvcache.empty(b, kvh, budget, d, jnp.float32)
    ours = []
    for s in range(0, t, chunk):
        sl = slice(s, s + chunk)
        _, stats = attention.prefix_attention(
            jnp.asarray(q[:, :, sl]), jnp.asarray(k[:, :, sl]), jnp.asarray(v[:, :, sl]), jnp.asarray(pos[:, sl]),
            cache.k, cache.v, cache.pos, cache.log_w, scale=d**-0.5, stats=policy.stats(0).prefill)
        cache = policy.absorb(0, cache, jnp.asarray(k[:, :, sl]), jnp.asarray(v[:, :, sl]),
                              Context(jnp.asarray(pos[:, sl])), stats)
        ours.append(kvcache.kept_sets((cache,))[0])
        # the kept slots hold the right keys
        held = np.asarray(cache.pos[0])
        for j in range(kvh):
            for slot, p_ in enumerate(held[j]):
                if p_ >= 0:
                    np.testing.assert_array_equal(np.asarray(cache.k[0, j, slot]), k[0, j, p_])
    assert ours == _numpy_snapkv_chunks(q, k, pos, budget, window, 3, chunk)
    assert len(ours) == 4 and all(len(h) == budget for h in ours[-1])


def _numpy_scored_chunks(method, q, k, v, budget, window, chunk, keep_count, kernel=3):
    """Plain NumPy transcription of the chunked rule of the score-based policies, for `method` in
    pyramidkv, slimkv, tova, knorm: after each chunk, the slots the cache holds (empty ones first, then
    its tokens in position order) and the chunk are scored as one prompt by the chunk's own queries
    (PyramidKV: SnapKV's mean over the last `window` queries, max-pool, mean over the group; SlimKV: the
    window attention summed over window queries and the group's heads times max |v|, prefix only,
    avg-pool; TOVA: the chunk's last query, averaged over every head of the layer, one ranking for all KV
    heads; KNorm: minus the key's norm), the latest `window` tokens are kept, then the top scores (ties:
    earlier), `keep_count(tokens read)` in all."""
    _, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    kept = [[] for _ in range(kvh)]
    history = []

    def probs(j, gi, real, rows):  # attention of the query rows over the real candidates
        qs = q[0, j * g + gi, rows]
        logit = qs @ k[0, j, real].T / np.sqrt(d)
        logit = np.where(np.asarray(real)[None] <= np.asarray(rows)[:, None], logit, -np.inf)
        p = np.exp(logit - logit.max(axis=1, keepdims=True))
        return p / p.sum(axis=1, keepdims=True)

    for s in range(0, t, chunk):
        cpos = list(range(s, s + chunk))
        last = cpos[-1]
        n_keep = int(keep_count(last + 1))
        cands = [[None] * (budget - len(kept[j])) + kept[j] + cpos for j in range(kvh)]
        scores = []
        for j in range(kvh):
            cand = cands[j]
            real = [c for c in cand if c is not None]
            at = [i for i, c in enumerate(cand) if c is not None]
            prefix = np.array([c is not None and c < last + 1 - window for c in cand])
            sc = np.zeros(len(cand))
            if method == "pyramidkv":
                for gi in range(g):
                    full = np.zeros(len(cand))
                    full[at] = probs(j, gi, real, list(range(last - window + 1, last + 1))).mean(axis=0)
                    full = np.where(prefix, full, 0.0)
                    sc += np.array([full[max(0, i - kernel // 2): i + kernel // 2 + 1].max()
                                    for i in range(len(cand))]) / g
            elif method == "slimkv":
                s1 = np.zeros(len(cand))
                for gi in range(g):
                    s1[at] += probs(j, gi, real, list(range(last - window + 1, last + 1))).sum(axis=0)
                s2 = np.zeros(len(cand))
                s2[at] = np.abs(v[0, j, real]).max(axis=-1)
                full = np.where(prefix, s1 * s2, 0.0)
                padded = np.concatenate([np.zeros(kernel // 2), full, np.zeros(kernel // 2)])
                sc = np.array([padded[i: i + kernel].sum() / kernel for i in range(len(cand))])
            elif method == "tova":
                for gi in range(g):
                    sc[at] += probs(j, gi, real, [last])[0] / h
            else:  # knorm
                sc[at] = -np.linalg.norm(k[0, j, real], axis=-1)
            scores.append(sc)
        if method == "tova":  # one ranking over the layer: the mean of every head's
            shared = {}
            for j in range(kvh):
                for i, c in enumerate(cands[j]):
                    if c is not None:
                        shared[c] = shared.get(c, 0.0) + scores[j][i]
        for j in range(kvh):
            real = [c for c in cands[j] if c is not None]
            score_of = (lambda c: shared[c]) if method == "tova" else (lambda c: scores[j][cands[j].index(c)])
            always = [c for c in real if c > last - window]
            others = sorted((c for c in real if c <= last - window), key=lambda c: (-score_of(c), c))
            kept[j] = sorted(always + others[: n_keep - len(always)])
        history.append([list(x) for x in kept])
    return history


SCORED_CHUNK_RULES = [
    ("pyramidkv", lambda **m: PyramidKV(budget=12, observation_window=4, kernel=3, num_layers=4, **m)),
    ("slimkv", lambda **m: SlimKV(budget=12, observation_window=4, kernel=3, **m)),
    ("tova", lambda **m: TOVA(budget=12, **m)),
    ("knorm", lambda **m: KNorm(budget=12, **m)),
]


@pytest.mark.parametrize("name,make", SCORED_CHUNK_RULES, ids=[n for n, _ in SCORED_CHUNK_RULES])
def test_chunked_score_policies_match_the_stated_rule(name, make):
    """Four chunks of 10 tokens (PyramidKV in its layer 1 of 4): after every chunk the policy keeps what
    the NumPy transcription of the stated chunked rule keeps (each chunk scored by its own queries, the
    cache's earlier survivors among the candidates), and the kept slots hold their tokens' keys."""
    rng = np.random.default_rng(7)
    b, kvh, g, t, d, chunk = 1, 2, 2, 40, 8, 10
    q = rng.normal(size=(b, kvh * g, t, d)).astype(np.float32) * 2
    k = rng.normal(size=(b, kvh, t, d)).astype(np.float32)
    v = rng.normal(size=(b, kvh, t, d)).astype(np.float32)
    pos = np.arange(t, dtype=np.int32)[None]
    layer = 1
    with pytest.warns(UserWarning, match="chunk"):
        policy = make(prefill_mode="chunked", chunk=chunk)
    cap = policy.capacity(layer, t, t)
    cache = kvcache.empty(b, kvh, cap, d, jnp.float32, policy.cache_state)
    ours = []
    for s in range(0, t, chunk):
        sl = slice(s, s + chunk)
        _, stats = attention.prefix_attention(
            jnp.asarray(q[:, :, sl]), jnp.asarray(k[:, :, sl]), jnp.asarray(v[:, :, sl]), jnp.asarray(pos[:, sl]),
            cache.k, cache.v, cache.pos, cache.log_w, scale=d**-0.5, stats=policy.stats(layer).prefill)
        cache = policy.absorb(layer, cache, jnp.asarray(k[:, :, sl]), jnp.asarray(v[:, :, sl]),
                              Context(jnp.asarray(pos[:, sl])), stats)
        ours.append(kvcache.kept_sets((cache,))[0])
        held = np.asarray(cache.pos[0])
        for j in range(kvh):
            for slot, p_ in enumerate(held[j]):
                if p_ >= 0:
                    np.testing.assert_array_equal(np.asarray(cache.k[0, j, slot]), k[0, j, p_])
    ref = _numpy_scored_chunks(name, q, k, v, cap, policy.observation_window, chunk,
                               lambda n: policy.keep_count(layer, np.asarray(n)))
    assert ours == ref
    assert any(len(h) < 40 for h in ours[-1])  # it evicted


def test_chunked_decode_after_prefill_appends(sharp, prompts):
    """After a chunked prefill, SnapKV decodes by appending into the slots reserved for new tokens."""
    policy = SnapKV(budget=10, observation_window=4, kernel=3, prefill_mode="chunked", chunk=8)
    _, kept = _run(sharp, *prompts, policy, steps=3)
    before, after = kept[0][0][0, 0], kept[-1][0][0, 0]
    assert set(before[before >= 0]) < set(after[after >= 0])
    assert set(after[after >= 0]) - set(before[before >= 0]) == {T, T + 1, T + 2}


def test_chunked_scoring_streams_exactly_and_compiles_once(sharp):
    """`chunked_logprobs` (a host loop over one compiled chunk step) gives StreamingLLM's token-by-token
    log-probabilities, and texts of different lengths reuse its one compilation."""
    ids = np.random.default_rng(1).integers(4, sharp.cfg.vocab_size, 300).tolist()
    ref = stream_logprobs(sharp, ids, StreamingLLM(budget=24, sinks=4, positions="rolling", prefill_mode="stream"))
    policy = StreamingLLM(budget=24, sinks=4, positions="rolling", prefill_mode="chunked", chunk=32)
    np.testing.assert_allclose(chunked_logprobs(sharp, ids, policy), ref, rtol=0, atol=1e-4)
    with compile_log() as compiles:
        for n in (100, 200, 290):
            chunked_logprobs(sharp, ids[:n], policy)
    assert compiles == [], f"{len(compiles)} compilations for texts of other lengths"


@pytest.fixture(scope="module")
def default_model():
    from kvjax.models import load_default

    return load_default().model


def _compiled_chunk_bytes(model, policy, prompt_len):
    """XLA's memory analysis of the compiled chunk step for a prompt of `prompt_len` tokens: arguments
    (weights, cache, the chunk), outputs and temporaries, in bytes; and the compiled text's hash."""
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: drive.empty_cache(model, drive.plan(model, policy, prompt_len, prompt_len), 1))
    chunk = jax.ShapeDtypeStruct((1, policy.chunk), jnp.int32)
    compiled = engine.chunk.pure.lower(graphdef, state, chunk, chunk, cache, all_logits=True,
                                       plan=drive.plan(model, policy, prompt_len, prompt_len)).compile()
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    return total, hash(compiled.as_text())


def test_chunked_prefill_memory_is_bounded(default_model):
    """Measured, not timed: under chunked StreamingLLM and chunked SnapKV the compiled chunk step
    (everything device memory holds while a prompt is read) is the same program of the same size for
    8K, 32K and 128K-token prompts; chunked FullCache's grows with the prompt."""
    lengths = (8192, 32768, 131072)
    for policy in (StreamingLLM(budget=256, positions="rolling", prefill_mode="chunked", chunk=512),
                   SnapKV(budget=256, prefill_mode="chunked", chunk=512)):
        sizes = [_compiled_chunk_bytes(default_model, policy, n) for n in lengths]
        assert len(set(sizes)) == 1, (policy.describe(), sizes)
    full = [_compiled_chunk_bytes(default_model, FullCache(prefill_mode="chunked", chunk=512), n)[0] for n in lengths]
    assert full[0] < full[1] < full[2], full
    assert full[2] > 3 * full[1] // 2


def test_chunked_refusals():
    """A rule that cannot be chunked says why; so do options that contradict the chunked mode."""
    from kvjax.policies import CompensatedWindow

    with pytest.raises(InvalidInput, match="cannot run prefill_mode='chunked' with fold='prefill' is Algorithm 1"):
        CompensatedWindow(prefill_mode="chunked", chunk=8, fold="prefill")
    with pytest.raises(InvalidInput, match="exceeds the window c - beta = 56"):
        mat(64, 8, prefill_mode="chunked", chunk=57)
    with pytest.raises(InvalidInput, match="rolling positions cannot be computed for a chunk"):
        SnapKV(budget=64, positions="rolling", prefill_mode="chunked", chunk=64)
    with pytest.raises(InvalidInput, match="a ratio is a share of the whole prompt"):
        SnapKV(ratio=0.5, prefill_mode="chunked", chunk=64)
    with pytest.raises(InvalidInput, match="shorter than observation_window=32"):
        SnapKV(budget=64, prefill_mode="chunked", chunk=16)
    with pytest.raises(InvalidInput, match="exceeds budget - recent"):
        H2O(budget=16, recent=8, prefill_mode="chunked", chunk=9)
    with pytest.raises(InvalidInput, match="a chunk size is given exactly when"):
        StreamingLLM(budget=16, chunk=8)
    with pytest.raises(InvalidInput, match="a chunk size is given exactly when"):
        StreamingLLM(budget=16, prefill_mode="chunked")
    with pytest.raises(InvalidInput, match="streaming .*does not take|does not take"):
        make_policy("gate", chunk=8)
    # described with its chunk, so records of chunked and whole-prompt runs never mix
    assert "chunk=8" in make_policy("streaming", 16, prefill_mode="chunked", chunk=8).describe()
    assert "chunk" not in make_policy("streaming", 16).describe()


def test_decoding_keeps_the_reference_top_every_n_steps():
    """`recompress(SnapKV(budget=B, observation_window=W), every=N)` while decoding, against NumPy: the cache has
    B + N slots; every N decode steps (kvpress's compression interval), a cache of more than B tokens keeps the
    latest W tokens plus the B - W best by SnapKV's score, computed from the last W queries'
    attention over the slots they saw (summed over the group's heads, max-pooled over time)."""
    rng = np.random.default_rng(5)
    b, kvh, g, d, steps = 1, 2, 2, 8, 70
    B, W, N, kernel = 12, 3, 5, 3
    policy = recompress(SnapKV(budget=B, observation_window=W, kernel=kernel), N)
    assert policy.capacity(0, 1000) == B + N
    q = rng.normal(size=(steps, kvh * g, d)).astype(np.float32) * 2
    k = rng.normal(size=(steps, kvh, d)).astype(np.float32)
    cache = kvcache.empty(b, kvh, B + N, d, jnp.float32, policy.cache_state)
    kept = [[] for _ in range(kvh)]
    acc = [dict() for _ in range(kvh)]
    checked = 0

    @jax.jit  # one decode step (the position an array: one compilation; op by op it took minutes)
    def step(cache, q_t, k_t, t):
        p_ = Context(t)
        cache = policy.step(0, cache, k_t, k_t, p_)
        _, stats = attention.decode_attention(q_t, cache.k, cache.v, cache.pos, cache.log_w,
                                              scale=d**-0.5, stats=policy.stats(0).decode)
        return policy.observe(0, cache, p_, stats)

    for t in range(steps):
        cache = step(cache, jnp.asarray(q[t][None]), jnp.asarray(k[t][None]), jnp.asarray([t], jnp.int32))
        assert cache.capacity == B + N
        full = False
        for j in range(kvh):  # the reference
            kept[j].append(t)
            logits = np.stack([q[t, j * g + i] @ k[kept[j], j].T for i in range(g)]) * d**-0.5
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = (probs / probs.sum(axis=1, keepdims=True)).sum(axis=0)
            if (t + 1) % N > N - W or (t + 1) % N == 0:  # the last W steps of each interval of N
                for pos_, pr in zip(kept[j], probs):
                    acc[j][pos_] = acc[j].get(pos_, 0.0) + pr
            if (t + 1) % N == 0:  # a compression: nothing to evict until the cache holds more than B
                full |= len(kept[j]) > B
                s = np.array([acc[j].get(x, 0.0) if x <= t - W else 0.0 for x in kept[j]])
                pooled = [s[max(0, i - kernel // 2): i + kernel // 2 + 1].max() for i in range(len(s))]
                window = [x for x in kept[j] if x > t - W]
                best = sorted((x for x in kept[j] if x <= t - W), key=lambda x: (-pooled[kept[j].index(x)], x))
                kept[j] = sorted(window + best[: B - W])
                acc[j] = {}
        ours = kvcache.kept_sets((cache,))[0]
        assert ours == kept, f"step {t}"
        checked += full
    assert checked == steps // N - B // N  # compressions that evict: at 15, 20, ... tokens


def test_agnostic_protocol_compresses_the_context_once_whatever_the_question(sharp):
    """Question-agnostic: the kept context positions depend on the context only (two questions, the
    same kept set), and one context with several questions is compressed once: each answer equals
    the answer to that question asked alone. Question-aware compression, by contrast, keeps
    different context tokens for different questions (so the check above can fail)."""
    from kvjax import generate

    rng = np.random.default_rng(7)
    vocab = sharp.cfg.vocab_size
    context = rng.integers(4, vocab, 60).tolist()
    questions = [rng.integers(4, vocab, 6).tolist() for _ in range(3)]
    policy = SnapKV(budget=16, observation_window=4, kernel=3)

    def context_kept(gen, row):
        kept = kvcache.kept_sets(gen.cache, row)
        return [[[p for p in head if p < len(context)] for head in layer] for layer in kept]

    together = generate(sharp, [context], policy, questions=questions, max_new_tokens=5)
    kept = [context_kept(together, r) for r in range(3)]
    assert kept[0] == kept[1] == kept[2]
    for r, q in enumerate(questions):
        alone = generate(sharp, [context], policy, questions=[q], max_new_tokens=5)
        assert alone.sequences()[0] == together.sequences()[r]
        assert context_kept(alone, 0) == kept[r]
    aware = [context_kept(generate(sharp, [context + q], policy, max_new_tokens=5), 0) for q in questions]
    assert any(a != aware[0] for a in aware[1:])


def test_host_loop_equals_the_scan(sharp, prompts):
    """`engine.chunks` (one compiled chunk step, looped on the host) builds the cache that
    `model.prefill`'s scan builds."""
    from kvjax import engine

    policy = SnapKV(budget=10, observation_window=4, kernel=3, prefill_mode="chunked", chunk=8)
    logits, cache = engine.chunks(sharp, *prompts, drive.plan(sharp, policy, T + 3, prompts[0].shape[1]))[:2]
    ref_logits, ref_kept = _run(sharp, *prompts, policy)
    np.testing.assert_allclose(np.asarray(logits), ref_logits[0], rtol=0, atol=1e-5)
    for a, b in zip(kvcache.kept_positions(cache), ref_kept[0]):
        np.testing.assert_array_equal(a, b)


def test_anllm_chunked_is_stream_at_one_and_eq4_at_any_chunk(tiny_dir):
    """AnLLM's REDUCTION in chunks: at chunk 1 exactly the stream (kept positions, logits within 1e-5);
    at chunk 5, while no region overflows, the last logits of the eq. 4-masked full forward (the
    cache drops only what the mask hides) and the kept set "every anchor + the tokens after the last"."""
    from kvjax.anllm_anchors import anchor_mask
    from kvjax.policies.anllm import AnchorReduction
    from tests.test_anllm import ANCHOR, _with_anchors

    model = load(tiny_dir).model
    n = 50
    ids = _with_anchors(n, seed=11)
    toks, pos = jnp.asarray([ids]), jnp.arange(n, dtype=jnp.int32)[None]
    make = lambda **m: AnchorReduction(anchor_ids=(ANCHOR,), anchor_slots=16, sequence=12, **m)  # noqa: E731
    run = lambda policy: prefill_policy(model, toks, pos, policy, n + 4)  # noqa: E731
    ls, cs = run(make(prefill_mode="stream"))
    l1, c1 = run(make(prefill_mode="chunked", chunk=1))
    np.testing.assert_allclose(np.asarray(l1), np.asarray(ls), rtol=0, atol=1e-5)
    assert kvcache.kept_sets(c1) == kvcache.kept_sets(cs)
    full = np.asarray(drive.logits(model, toks, anchors=anchor_mask(jnp.asarray([[t == ANCHOR for t in ids]]))))[0, -1]
    l5, c5 = run(make(prefill_mode="chunked", chunk=5))
    np.testing.assert_allclose(np.asarray(l5)[0], full, rtol=0, atol=1e-5)
    last = max(i for i, t in enumerate(ids) if t == ANCHOR)
    expect = [i for i in range(n) if ids[i] == ANCHOR or i > last]
    assert all(head == expect for layer in kvcache.kept_sets(c5) for head in layer)


def test_generate_chunked_compiles_once_for_every_prompt_bucket(sharp):
    """`generate` under a chunked policy loops one compiled chunk step over the prompt: prompts in
    other length buckets (here 128 and 512 tokens) compile nothing new, and the answer equals the
    stream-mode answer."""
    from kvjax import generate

    rng = np.random.default_rng(2)
    policy = StreamingLLM(budget=32, sinks=4, prefill_mode="chunked", chunk=32)
    generate(sharp, [rng.integers(4, sharp.cfg.vocab_size, 40).tolist()], policy, max_new_tokens=4)
    prompt = rng.integers(4, sharp.cfg.vocab_size, 300).tolist()
    with compile_log() as compiles:
        for n in (100, 300):
            out = generate(sharp, [prompt[:n]], policy, max_new_tokens=4)
    assert compiles == [], f"{len(compiles)} compilations for prompts in new buckets"
    stream = generate(sharp, [prompt], StreamingLLM(budget=32, sinks=4, prefill_mode="stream"), max_new_tokens=4)
    assert out.sequences() == stream.sequences()


def test_chunk_attention_says_it_has_no_pallas_kernel():
    """A chunk over a cache has no Pallas kernel: asked for one, it runs in XLA and warns (once), the
    same numbers as `impl="xla"`, never a silent fallback."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, 2, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4)))
    cache = kvcache.empty(1, 1, 2, 4, jnp.float32)
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    args = (q, k, v, pos, cache.k, cache.v, cache.pos, cache.log_w)
    attention.warn_once.cache_clear()
    with pytest.warns(UserWarning, match="has no kernel for it"):
        out, _ = attention.prefix_attention(*args, scale=0.5, impl="pallas")
    np.testing.assert_array_equal(out, attention.prefix_attention(*args, scale=0.5)[0])


def test_decode_with_alibi_or_a_window_says_it_has_no_pallas_kernel():
    """The decode kernel takes no ALiBi or sliding window: asked for it, decode runs in XLA and warns once,
    with the numbers of `impl="xla"`."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 2, 4)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 1, 5, 4)), jnp.float32) for _ in range(2))
    slot_pos = jnp.arange(5, dtype=jnp.int32)[None, None]
    coords = dict(q_coord=jnp.full((1, 1), 4, jnp.int32), k_coord=slot_pos)
    args = (q, k, v, slot_pos, jnp.zeros((1, 1, 5)))
    for extra in (dict(mask=Mask(window=3)), dict(mask=Mask(alibi=attention.alibi_slopes(2)))):
        attention.warn_once.cache_clear()
        with pytest.warns(UserWarning, match="the Pallas decode kernel takes neither"):
            out, _ = attention.decode_attention(*args, scale=0.5, impl="pallas", **coords, **extra)
        np.testing.assert_array_equal(out, attention.decode_attention(*args, scale=0.5, **coords, **extra)[0])


@pytest.mark.parametrize("chunk", [1, 8, 32])
def test_mat_chunks_of_any_size_are_stream_mode(sharp, chunk):
    """MAT's chunk queries each see what Algorithm 1's stream holds when that token arrives (the closed form
    at its own length over the cache; the chunk's tokens all stay in the window), so chunked MAT is the
    token-by-token result at chunk sizes 1, 8 and 32: every token's log-prob over a 100-token text (anchors
    evicted many times) within 1e-5 of the log-prob scale, and the kept positions per layer and KV head after the prompt and 3
    decode steps. (It once cut the cache to its post-chunk state first: chunk token i saw c - n + i + 1
    slots, and every token but a chunk's last was scored against fewer.)"""
    n = 100
    rng = np.random.default_rng(5)
    ids = rng.integers(4, sharp.cfg.vocab_size, n).tolist()
    make = lambda **m: mat(40, 6, shallow_layers=1, sinks=2, **m)  # noqa: E731  (window c - beta = 34)
    stream = stream_logprobs(sharp, ids, make(prefill_mode="stream"))
    ours = chunked_logprobs(sharp, ids, make(prefill_mode="chunked", chunk=chunk))
    np.testing.assert_allclose(ours, stream, rtol=0, atol=1e-5 * max(1.0, float(np.abs(stream).max())))

    toks = jnp.asarray(rng.integers(4, sharp.cfg.vocab_size, (2, n)), jnp.int32)
    pos = np.tile(np.arange(n, dtype=np.int32), (2, 1))
    pos[1] = np.where(np.arange(n) < 9, -1, np.arange(n) - 9)
    pos = jnp.asarray(pos)

    def kept(policy):
        _, cache = jax.jit(functools.partial(prefill_policy, sharp), static_argnums=(2, 3))(toks, pos, policy, n + 3)
        out = [kvcache.kept_positions(cache)]
        nxt = jnp.max(pos, axis=1) + 1
        for s in range(3):
            _, cache = jax.jit(functools.partial(drive.decode, sharp), static_argnums=3)(toks[:, s], nxt + s, cache, drive.plan(sharp, policy))
            out.append(kvcache.kept_positions(cache))
        return out

    for step, (a, b) in enumerate(zip(kept(make(prefill_mode="chunked", chunk=chunk)),
                                      kept(make(prefill_mode="stream")))):
        for layer, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_array_equal(x, y, err_msg=f"kept positions, step {step}, layer {layer}")


def test_decode_and_chunk_steps_are_keyed_by_the_sized_plan(tiny):
    """`engine.decode` and `engine.chunk` compile once per sized plan (with the cache's shapes): a budget
    policy's plan is the same for prompts of every bucket and any max_len, so a second bucket compiles no new
    decode or chunk step; FullCache's plan grows with max_len, and so does its cache: a new compilation."""
    from kvjax import engine

    model = tiny.model

    def steps(policy, bucket, max_len):
        """Prompt (chunked: the host loop of chunk steps), then one decode step; the compilations of both."""
        plan = drive.plan(model, policy, max_len, bucket)
        tokens, positions = left_pad(random_ids(bucket - 3, 260, seed=bucket), bucket)
        with compile_log() as log:
            if policy.prefill_mode == "chunked":
                _, cache = engine.chunks(model, tokens, positions, plan)[:2]
            else:
                _, cache = engine.prefill(model, tokens, positions, plan=plan)
            engine.decode(model, jnp.asarray([7]), jnp.asarray([bucket]), cache, plan=plan)
        return plan, log

    ring = StreamingLLM(budget=16, sinks=4, prefill_mode="chunked", chunk=8)
    plan_a, first = steps(ring, 32, 48)
    plan_b, second = steps(ring, 64, 96)
    assert plan_a == plan_b and len(first) >= 1 and second == []
    plan_a, first = steps(FullCache(), 32, 48)
    plan_b, second = steps(FullCache(), 32, 64)
    assert plan_a != plan_b and len(second) >= 2  # the prompt pass and the decode step, for a new plan
