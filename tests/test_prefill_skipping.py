"""The XLA prefill that skips masked tiles (`self_attention=True`) against the blocked reference that
computes every tile: the same outputs and statistics (1e-5 in f32, 2e-2 in bf16) with windows, ALiBi,
AnLLM's eq. 4, the gate's keep flags and soft-capping, the same gradients, and the model's prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax.anllm_anchors import anchor_mask
from kvjax.masks import Mask
from kvjax.stats import StatsRequest
from tests.conftest import prefill_policy

STATS = StatsRequest(colsum=True, first_logit=True, last_queries=frozenset({8}))
STAT_NAMES = {"colsum": lambda s: s.colsum, "first_logit": lambda s: s.first_logit, "last_probs[8]": lambda s: s.last(8)}


def _inputs(seed, dtype=jnp.float32, b=2, h=4, kvh=2, t=300, d=16):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=s), dtype) for s in [(b, h, t, d), (b, kvh, t, d), (b, kvh, t, d)])
    pos = jnp.asarray(np.stack([np.arange(t) - p for p in (0, 37)]).clip(-1), jnp.int32)  # row 2 left padded
    return rng, q, k, v, pos


CASES = {
    "causal": {},  # the tiles below the diagonal with no padding take the unmasked path
    "softcap": {"softcap": 5.0},
    "window": {"window": 50},
    "alibi": {"alibi": True},
    "anchors": {"anchors": True},
    "gate": {"gate": True},
    "gate_window_softcap": {"gate": True, "window": 100, "softcap": 5.0},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_skipping_equals_every_tile(case, dtype):
    opts = dict(CASES[case])
    rng, q, k, v, pos = _inputs(1, dtype)
    parts = dict(window=opts.get("window"), softcap=opts.get("softcap"))
    if opts.get("alibi"):
        parts["alibi"] = attention.alibi_slopes(q.shape[1])
    if opts.get("anchors"):
        parts["anchors"] = anchor_mask(jnp.asarray(rng.random(pos.shape) < 0.1))
    if opts.get("gate"):
        parts["key_keep"] = jnp.asarray(rng.random((k.shape[0], k.shape[1], k.shape[2])) < 0.6)
    kw = dict(scale=q.shape[-1] ** -0.5, stats=STATS, mask=Mask(**parts),
              block=64)  # 300 tokens: 5 query blocks, the last one partial
    ref, ref_stats = attention.prefill_attention(q, k, v, pos, pos, **kw)
    out, stats = attention.prefill_attention(q, k, v, pos, pos, self_attention=True, **kw)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
    for name, get in STAT_NAMES.items():
        np.testing.assert_allclose(np.asarray(get(stats), np.float32), np.asarray(get(ref_stats), np.float32),
                                   atol=tol, rtol=tol)


def _hidden_blocks_case(kind):
    """320 tokens in blocks of 64 whose key blocks 1 and 2 (tokens 64..191) the later queries cannot
    see: eq. 4 with anchors at 60 and 250 (queries from 251 are a sequence that sees blocks 1-2 only
    through anchors, and they hold none), or gate flags (bool) that evict both blocks in every head."""
    rng, q, k, v, pos = _inputs(5, b=1, t=320)
    pos = pos[:1]
    if kind == "anchors":
        flags = np.zeros((1, 320), bool)
        flags[0, [60, 250]] = True
        return q, k, v, pos, Mask(anchors=anchor_mask(jnp.asarray(flags))), 256  # rows from 256 see none
    keep = rng.random((1, k.shape[1], 320)) < 0.6
    keep[:, :, 64:192] = False
    return q, k, v, pos, Mask(key_keep=jnp.asarray(keep)), 192  # rows from 192 see them only as evicted


@pytest.mark.parametrize("kind", ["anchors", "gate"])
def test_blocks_that_eq4_or_the_gate_hide_wholly_are_never_computed(kind):
    """NaN values in the hidden blocks: the skipping path never reads them for the queries that
    cannot see them (a computed tile would give 0 * NaN), and those rows and every statistic equal
    the every-tile reference on clean values."""
    q, k, v, pos, mask, first = _hidden_blocks_case(kind)
    poisoned = v.at[:, :, 64:192].set(jnp.nan)
    kw = dict(scale=0.25, stats=StatsRequest(colsum=True), block=64, mask=mask)
    ref, ref_stats = attention.prefill_attention(q, k, v, pos, pos, **kw)
    out, stats = attention.prefill_attention(q, k, poisoned, pos, pos, self_attention=True, **kw)
    np.testing.assert_allclose(np.asarray(out[:, :, first:]), np.asarray(ref[:, :, first:]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out[:, :, :64]), np.asarray(ref[:, :, :64]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats.colsum), np.asarray(ref_stats.colsum), atol=1e-5, rtol=1e-5)


def test_float_gate_flags_keep_every_tile_for_their_gradient():
    """The straight-through flags (float) are not a skip mask: an evicted key's tile is computed,
    since the gates' gradient reaches its flag through it (so the NaN of the test above shows)."""
    q, k, v, pos, mask, first = _hidden_blocks_case("gate")
    poisoned = v.at[:, :, 64:192].set(jnp.nan)
    out, _ = attention.prefill_attention(q, k, poisoned, pos, pos, scale=0.25, block=64, self_attention=True,
                                         mask=Mask(key_keep=mask.key_keep.astype(jnp.float32)))
    assert np.isnan(np.asarray(out[:, :, first:])).all()


def test_skipping_has_the_references_gradients_gate_flags_included():
    rng, q, k, v, pos = _inputs(2, b=1, t=150, d=8)
    pos = pos[:1]
    flags = jnp.asarray(rng.random((1, k.shape[1], 150)) < 0.5, jnp.float32)

    def loss(q, k, v, f, skip):
        out, _ = attention.prefill_attention(q, k, v, pos, pos, scale=0.3, mask=Mask(key_keep=f), block=32,
                                             self_attention=skip)
        return jnp.sum(out**2)

    want = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, flags, False)
    got = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, flags, True)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_model_prefill_of_a_long_prompt_equals_transformers(tiny, tiny_dir):
    """A 700-token prompt (two 512-query blocks, so the skipping path) through the model's prefill: the
    last logits equal transformers' eager forward."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    from kvjax.policies import FullCache
    from tests.conftest import random_ids

    ids = random_ids(700, 260, seed=9)
    logits, _ = prefill_policy(tiny.model, jnp.asarray([ids]), jnp.arange(700, dtype=jnp.int32)[None], FullCache(), 704)
    hf = LlamaForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(np.asarray(logits[0]), theirs, atol=1e-4, rtol=0)


def test_the_gradient_keeps_no_tile_residuals():
    """Training differentiates the tile loop; its backward pass must recompute each tile's logits rather
    than keep them all. Bound, by hand: one T x T float32 score matrix per query head (256 MiB at
    T = 4096, 4 heads), which a backward pass storing every tile's probabilities exceeds (1.6 GiB before
    the step was rematerialized)."""
    b, h, kvh, t, d = 1, 4, 2, 4096, 32
    q, k, v = jnp.ones((b, h, t, d)), jnp.ones((b, kvh, t, d)), jnp.ones((b, kvh, t, d))
    pos = jnp.arange(t)[None]

    def loss(q, k, v):
        return attention.prefill_attention(q, k, v, pos, pos, scale=d**-0.5, self_attention=True)[0].sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < b * h * t * t * 4
