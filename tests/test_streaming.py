"""FullCache / LocalWindow / StreamingLLM against plain-Python references."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import FullCache, LocalWindow, StreamingLLM, make_policy
from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput
from kvjax.policies.ring import ring_holder, ring_slot
from tests.conftest import left_pad, random_ids, stepper
from tests.reference import RefLlama, streaming_keep, streaming_update


def test_ring_holder_is_the_closed_form_of_writing_token_by_token():
    for sinks, cap in [(0, 1), (0, 5), (2, 3), (4, 8), (3, 10)]:
        lengths = np.arange(0, 40)
        got = np.asarray(ring_holder(jnp.asarray(lengths), sinks, cap))
        slot_of = np.asarray(ring_slot(jnp.arange(40), sinks, cap))
        for n in lengths:
            slots = [-1] * cap
            for p in range(n):
                # the layout's definition, written out: sinks first, then a ring of cap - sinks
                expected = p if p < sinks else sinks + (p - sinks) % (cap - sinks)
                assert slot_of[p] == expected
                slots[expected] = p
            assert got[n].tolist() == slots, (sinks, cap, n)


@pytest.mark.parametrize("prompt_len", [5, 12, 30], ids=["short", "at-budget", "long"])
@pytest.mark.parametrize(
    "policy,keep",
    [
        (StreamingLLM(budget=12, sinks=4), streaming_keep(4, 12)),
        (StreamingLLM(budget=12, sinks=0), streaming_keep(0, 12)),
        (LocalWindow(size=7), streaming_keep(0, 7)),
        (FullCache(), lambda ps: ps),
    ],
    ids=["streaming", "streaming-nosink", "local", "full"],
)
def test_kept_positions_after_every_step(tiny, policy, keep, prompt_len):
    ids = random_ids(60, 260, seed=7)
    bucket = 32
    prefill, decode = stepper(tiny.model, policy, max_len=bucket + 40)
    _, cache = prefill(*left_pad(ids[:prompt_len], bucket))
    seen = list(range(prompt_len))
    for t in range(prompt_len, prompt_len + 30):
        expected = sorted(keep(seen))
        for layer in kept_sets(cache):
            for head in layer:  # every layer and KV head keeps the same positions
                assert head == expected, (t, head, expected)
        _, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        seen.append(t)


@pytest.mark.parametrize("prefill_mode", ["full", "stream"])
@pytest.mark.parametrize("positions", ["rolling", "absolute"])
@pytest.mark.parametrize("prompt_len", [6, 20], ids=["short", "long"])
def test_streaming_logits_match_reference(sharp_dir, positions, prompt_len, prefill_mode):
    """Logits at every step equal a NumPy model that evicts by the plain rule and, in rolling
    mode, recomputes attention with positions reassigned by rank. "stream" feeds the prompt
    token by token too."""
    from kvjax.models import load

    sinks, budget = 2, 10
    ref = RefLlama(sharp_dir)
    update = streaming_update(sinks, budget)
    rolling = positions == "rolling"
    ids = random_ids(50, 260, seed=8)
    caches = ref.empty_caches()
    if prefill_mode == "full":
        ref_logits = [ref.prefill(ids[:prompt_len], caches, update)]
    else:
        ref_logits = [ref.step(ids[t], t, caches, update, rolling) for t in range(prompt_len)][-1:]
    for t in range(prompt_len, 45):
        ref_logits.append(ref.step(ids[t], t, caches, update, rolling))

    bucket = 32
    policy = StreamingLLM(budget=budget, sinks=sinks, positions=positions, prefill_mode=prefill_mode)
    prefill, decode = stepper(load(sharp_dir).model, policy, bucket + 45)
    logits, cache = prefill(*left_pad(ids[:prompt_len], bucket))
    ours = [np.asarray(logits[0])]
    for t in range(prompt_len, 45):
        logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        ours.append(np.asarray(logits[0]))
    ref_logits = np.stack(ref_logits)
    assert np.abs(ref_logits).max() > 0.5  # a sharp model: the comparison is not between near-zero logits
    np.testing.assert_allclose(np.stack(ours), ref_logits, atol=1e-4, rtol=0)


def test_rolling_differs_from_absolute_after_eviction(tiny):
    """Guards the test above: once tokens are evicted the two modes must disagree."""
    ids = random_ids(40, 260, seed=9)
    outs = {}
    for mode in ("absolute", "rolling"):
        prefill, decode = stepper(tiny.model, StreamingLLM(budget=8, sinks=2, positions=mode), 64)
        logits, cache = prefill(*left_pad(ids[:6], 16))
        for t in range(6, 30):
            logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        outs[mode] = np.asarray(logits)
    assert np.abs(outs["absolute"] - outs["rolling"]).max() > 1e-3


def test_capacity_is_the_budget_not_the_context():
    p = StreamingLLM(budget=256, sinks=4)
    assert p.capacity(0, 16_384) == 256
    assert p.capacity(0, 100) == 100  # never more slots than tokens
    assert LocalWindow(size=64).capacity(3, 10_000) == 64
    assert FullCache().capacity(0, 1234) == 1234


@pytest.mark.parametrize("budget,sinks", [(4, 4), (0, 0), (3, 5)])
def test_budget_smaller_than_sinks_plus_one_is_an_error(budget, sinks):
    with pytest.raises(ValueError, match=rf"budget={budget} is smaller than sinks \+ 1 = {sinks + 1}"):
        StreamingLLM(budget=budget, sinks=sinks)


def test_policy_errors():
    with pytest.raises(ValueError, match="size=0"):
        LocalWindow(size=0)
    with pytest.raises(ValueError, match="positions='relative'"):
        StreamingLLM(positions="relative")
    with pytest.raises(ValueError, match="unknown policy 'razorr'"):
        make_policy("razorr", 128)
    with pytest.raises(ValueError, match="needs a budget"):
        make_policy("streaming")


def test_policies_are_hashable_static_arguments():
    a, b = StreamingLLM(budget=64, sinks=4), StreamingLLM(budget=64, sinks=4)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, StreamingLLM(budget=64, sinks=2), FullCache(), LocalWindow(size=64)}) == 4
    for x, y in itertools.combinations([FullCache(), LocalWindow(size=8), StreamingLLM(budget=8, sinks=0)], 2):
        assert x != y


@pytest.mark.parametrize("mode", ["full", "stream"])
@pytest.mark.parametrize("make", [
    lambda r, m: StreamingLLM(budget=None, ratio=r, sinks=4, prefill_mode=m),
    lambda r, m: LocalWindow(size=None, ratio=r, prefill_mode=m),
], ids=["streaming", "local"])
def test_ratio_budget_keeps_floor_of_each_rows_prompt_and_holds_it_while_decoding(tiny, make, mode):
    """kvpress's compression_ratio for the ring policies: a row of n prompt tokens keeps
    floor(n * (1 - ratio)) slots, rows of different lengths in one batch each their own, and decoding
    keeps that count (the ring evicts), the positions those of sinks + the most recent tokens. The
    prompt attended whole or read token by token (its length is known before it is read)."""
    ratio, lengths, bucket, new = 0.6, [60, 37, 50], 64, 6
    policy = make(ratio, mode)
    sinks = getattr(policy, "sinks", 0)
    toks = np.zeros((3, bucket), np.int32)
    pos = np.full((3, bucket), -1, np.int32)
    for r, n in enumerate(lengths):
        toks[r, bucket - n:] = random_ids(n, 260, seed=r)
        pos[r, bucket - n:] = np.arange(n)
    prefill, decode = stepper(tiny.model, policy, bucket + new)
    _, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    assert cache[0].capacity == int(64 * (1 - ratio))  # the bucket's longest possible prompt
    for step in range(new + 1):
        for r, n in enumerate(lengths):
            total = n + step
            kept = int(np.floor(n * (1 - ratio)))  # the rule, per row, from its own prompt
            want = list(range(sinks)) + list(range(total - (kept - sinks), total))
            for layer in cache:
                for h in range(layer.pos.shape[1]):
                    held = sorted(int(p) for p in np.asarray(layer.pos[r, h]) if p >= 0)
                    assert held == want, (r, step, held)
        if step < new:
            _, cache = decode(jnp.asarray(random_ids(3, 260, seed=50 + step), jnp.int32),
                              jnp.asarray(lengths, jnp.int32) + step, cache)


def test_ratio_and_budget_are_exclusive_and_ratio_needs_the_whole_prompt():
    with pytest.raises(ValueError, match="exactly one of budget"):
        StreamingLLM(budget=128, ratio=0.5)
    with pytest.raises(ValueError, match="exactly one of size"):
        LocalWindow(size=None)
    with pytest.raises(ValueError, match="prefill_mode must be 'full' or 'stream'"):
        StreamingLLM(budget=None, ratio=0.5, prefill_mode="chunked", chunk=8)
    with pytest.raises(ValueError, match=r"ratio=1.0 must be in \[0, 1\)"):
        StreamingLLM(budget=None, ratio=1.0)


@pytest.mark.parametrize("prompt_len", [20, 9], ids=["long", "short"])
def test_prompt_streamingllm_chooses_its_window_once_then_appends(tiny, prompt_len):
    """kvpress's StreamingLLM (a press compresses at prefill only): the prompt's 4 sinks and its latest 8 tokens,
    then every new token kept, where `StreamingLLM` slides its window on."""
    from kvjax.policies.scored import PromptStreamingLLM

    ids = random_ids(60, 260, seed=7)
    prefill, decode = stepper(tiny.model, PromptStreamingLLM(budget=12, sinks=4), max_len=32 + 30)
    _, cache = prefill(*left_pad(ids[:prompt_len], 32))
    prompt = sorted(streaming_keep(4, 12)(list(range(prompt_len))))  # by hand: [0..3] + [prompt_len - 8 ..]
    assert prompt == (list(range(4)) + list(range(12, 20)) if prompt_len == 20 else list(range(9)))
    for t in range(prompt_len, prompt_len + 12):
        for layer in kept_sets(cache):
            for head in layer:
                assert head == prompt + list(range(prompt_len, t)), t
        _, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
    with pytest.raises(InvalidInput, match="prefill_mode='chunked'; it chooses its window once"):
        PromptStreamingLLM(budget=12, sinks=4, prefill_mode="chunked", chunk=16)
    with pytest.raises(InvalidInput, match="observation_window=8; its window is the latest kept tokens"):
        PromptStreamingLLM(budget=12, observation_window=8)


def test_prompt_streamingllm_at_a_ratio_keeps_each_prompts_share_then_appends(tiny):
    """kvpress's StreamingLLMPress at compression ratio 0.5 on a 20-token prompt keeps int(20 x 0.5) = 10: the 4
    sinks and the latest 6, then appends."""
    from kvjax.policies.scored import PromptStreamingLLM

    ids = random_ids(60, 260, seed=5)
    prefill, decode = stepper(tiny.model, PromptStreamingLLM(ratio=0.5, sinks=4), max_len=32 + 10)
    _, cache = prefill(*left_pad(ids[:20], 32))
    for t in range(20, 24):
        for layer in kept_sets(cache):
            for head in layer:
                assert head == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19] + list(range(20, t)), t
        _, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)


def test_duo_once_streams_its_streaming_heads_from_the_prompt_and_keeps_every_new_token(tiny):
    """kvpress's DuoAttentionPress: the streaming heads hold the prompt's sinks and window plus each new token,
    the other heads everything; `DuoAttention` holds the same slots at the prompt's end and then slides."""
    from kvjax.policies import DuoAttention, DuoAttentionOnce

    layers, kvh = tiny.config.num_layers, tiny.config.num_kv_heads
    table = tuple(tuple(h == 0 for h in range(kvh)) for _ in range(layers))  # head 0 of every layer streams
    ids = random_ids(60, 260, seed=3)
    sets = {}
    for kind in (DuoAttention, DuoAttentionOnce):
        prefill, decode = stepper(tiny.model, kind(streaming=table, sinks=2, recent=6), max_len=32 + 10)
        _, cache = prefill(*left_pad(ids[:20], 32))
        at = [kept_sets(cache)]
        for t in range(20, 25):
            _, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        sets[kind] = at + [kept_sets(cache)]
    prompt = [0, 1] + list(range(14, 20))
    for layer in range(layers):
        for h in range(kvh):
            whole = h != 0
            assert sets[DuoAttention][0][layer][h] == sets[DuoAttentionOnce][0][layer][h] == (
                list(range(20)) if whole else prompt)
            assert sets[DuoAttentionOnce][1][layer][h] == (list(range(25)) if whole else prompt + list(range(20, 25)))
            assert sets[DuoAttention][1][layer][h] == (list(range(25)) if whole else [0, 1] + list(range(19, 25)))
