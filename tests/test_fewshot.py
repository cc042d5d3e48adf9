"""Prefix caching (`kvjax.drive.extend`) and AnLLM's few-shot metrics (`kvjax.fewshot`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import fewshot
from kvjax.anllm_anchors import anchor_mask
from kvjax.fewshot import Item
from kvjax.policies import FullCache, StreamingLLM
from kvjax.policies.anllm import AnchorReduction
from tests.conftest import left_pad, random_ids, prefill_policy
from kvjax import drive

ANCHOR = 10


def _extend(model, policy, prefix, chunk, chunk_bucket=16):
    """Prefill `prefix`, then extend with `chunk` right padded to `chunk_bucket`: logits [len(chunk), V]."""
    toks, pos = left_pad(prefix, 64)
    _, cache = prefill_policy(model, toks, pos, policy, 64 + chunk_bucket)
    ct = np.zeros((1, chunk_bucket), np.int32)
    cp = np.full((1, chunk_bucket), -1, np.int32)
    ct[0, : len(chunk)], cp[0, : len(chunk)] = chunk, len(prefix) + np.arange(len(chunk))
    return np.asarray(drive.extend(model, jnp.asarray(ct), jnp.asarray(cp), cache, drive.plan(model, policy)))[0, : len(chunk)]


def test_extend_full_cache_equals_full_forward(tiny):
    ids = random_ids(50, tiny.config.vocab_size, seed=1)
    full = np.asarray(drive.logits(tiny.model, jnp.asarray([ids])))[0]
    np.testing.assert_allclose(_extend(tiny.model, FullCache(), ids[:39], ids[39:]), full[39:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["anchor_in_chunk", "prefix_ends_with_anchor", "chunk_starts_with_anchor"])
def test_extend_anchor_cache_equals_eq4_forward(tiny, layout):
    """The REDUCTION cache of the prefix + eq. 4 across the boundary = one forward under eq. 4."""
    n, cut = 52, 40
    ids = random_ids(n, tiny.config.vocab_size, seed=7, low=11)
    for i in (3, 4, 17, 30):
        ids[i] = ANCHOR
    ids[{"anchor_in_chunk": 45, "prefix_ends_with_anchor": cut - 1, "chunk_starts_with_anchor": cut}[layout]] = ANCHOR
    flags = jnp.asarray([[t == ANCHOR for t in ids]])
    full = np.asarray(drive.logits(tiny.model, jnp.asarray([ids]), anchors=anchor_mask(flags)))[0]
    policy = AnchorReduction(anchor_ids=(ANCHOR,), anchor_slots=8, sequence=16)
    np.testing.assert_allclose(_extend(tiny.model, policy, ids[:cut], ids[cut:]), full[cut:], atol=1e-5, rtol=0)


def test_extend_rejects_rolling_positions(tiny):
    toks, pos = left_pad([5, 6, 7], 16)
    policy = StreamingLLM(budget=8, sinks=2, positions="rolling")
    _, cache = prefill_policy(tiny.model, toks, pos, policy, 32)
    with pytest.raises(ValueError, match="rolling positions in layer 0"):
        drive.extend(tiny.model, toks, pos, cache, drive.plan(tiny.model, policy))


def test_cached_scores_match_full_scores_and_cache_length(tiny):
    v = tiny.config.vocab_size
    demos = random_ids(45, v, seed=2, low=11)
    for i in (9, 20, 33, 44):
        demos[i] = ANCHOR
    item = Item(query=(12, 13, 14), options=((20, 21), (30,), (40, 41, 42)), answer=2)
    full = fewshot.full_scores(tiny.model, demos, item)
    room = fewshot.room_for([item])
    cached = fewshot.cached_scores(tiny.model, fewshot.prefix_cache(tiny.model, demos, FullCache(), room),
                                   len(demos), item, FullCache())
    np.testing.assert_allclose(cached, full, atol=1e-4, rtol=0)

    # By hand: log p(option | demos + query) from the plain forward of each whole row.
    for r, opt in enumerate(item.options):
        row = demos + list(item.query) + list(opt)
        logp = np.asarray(nnx.log_softmax(drive.logits(tiny.model, jnp.asarray([row]))[0], axis=-1))
        want = sum(logp[len(row) - len(opt) - 1 + j, t] for j, t in enumerate(opt))
        assert abs(full[r] - want) < 1e-4

    policy = AnchorReduction(anchor_ids=(ANCHOR,), anchor_slots=8, sequence=16)
    cache = fewshot.prefix_cache(tiny.model, demos, policy, room)
    assert fewshot.cache_length(cache) == 4  # the demos end with an anchor: only the 4 anchors stay
    demos[-1] = 11
    assert fewshot.cache_length(fewshot.prefix_cache(tiny.model, demos, policy, room)) == 3 + 11


def test_item_errors():
    with pytest.raises(ValueError, match="answer=3"):
        Item(query=(1,), options=((2,), (3,)), answer=3)
    with pytest.raises(ValueError, match="query is empty"):
        Item(query=(), options=((2,), (3,)), answer=0)
