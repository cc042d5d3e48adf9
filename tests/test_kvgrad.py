"""KVgrad (`kvjax.policies.KVgrad`, `kvjax.drive.grad_replay`): kept positions and scores equal to kvpress 0.5.5's
KVgradPress on the random GQA Llama of tests/test_kvzip.py, padding that changes nothing, a batch's rows scored
alone, the refusals and the registry."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import drive, kvzip
from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput
from kvjax.policies import KVgrad, KVzip
from tests.conftest import left_pad, stepper
from tests.test_kvzip import (  # noqa: F401  (sdpa_pair: the fixture)
    CONTINUE, REPEAT, SUFFIX, T, kvpress_kept, sdpa_pair, stub_replay_tokenizer)

RTOL = 1e-4  # kvjax's scores against kvpress's: float32, summed in another order (and ∂Φ/∂a solved through W_o)


def policy(ratio, **kw):
    return KVgrad(ratio=ratio, repeat_ids=REPEAT, continue_ids=CONTINUE, suffix_ids=SUFFIX, **kw)


def compressed(model, ids, pol, bucket=128):
    prefill, _ = stepper(model, pol, bucket + 1)
    _, cache = prefill(*left_pad(list(ids), bucket))
    return kvzip.compress(model, cache, drive.plan(model, pol, bucket + 1, bucket), [list(ids)])


@pytest.mark.parametrize("ratio, chunk, layerwise", [(0.5, 512, False), (0.8, 32, False), (0.6, 40, True)],
                         ids=["one-replay", "four-replays", "layerwise"])
def test_scores_kept_positions_and_next_logits_match_kvpress(sdpa_pair, monkeypatch, ratio, chunk, layerwise):
    """Each context position's score per layer and KV head is kvpress's KVgradPress's (max over the replay's queries
    and the group's heads of A ‖v W_o‖ ‖∂Φ/∂a‖, Φ the replay's last hidden states' squared norm) to `RTOL`; the
    positions kept are the same, per layer and KV head (one replay, four replays of 32 tokens, per-layer budgets), and
    so is the next token's logits. KVgrad keeps other positions than KVzip and KVzip+ at the same ratio."""
    import torch
    from transformers import DynamicCache

    import kvpress

    pt, model = sdpa_pair
    stub_replay_tokenizer(monkeypatch)
    press = kvpress.KVgradPress(compression_ratio=ratio, chunk_size=chunk, layerwise=layerwise)
    theirs_scores = []
    real_post = type(press).compress_post

    def compress_post(self, model):  # the scores before the sinks are raised
        theirs_scores.append(self.score_val[:, 0].clone().float().numpy())
        return real_post(self, model)

    monkeypatch.setattr(type(press), "compress_post", compress_post)
    ids = np.random.RandomState(9).randint(13, 97, T + 1)
    cache_pt = DynamicCache()
    with torch.no_grad():
        with press(pt):
            pt.model(input_ids=torch.tensor(ids[None, :T]), past_key_values=cache_pt)
        theirs = pt(torch.tensor([[ids[T]]]), past_key_values=cache_pt, position_ids=torch.tensor([[T]])).logits[0, -1]

    pol = policy(ratio, chunk_size=chunk, layerwise=layerwise)
    prefill, decode = stepper(model, pol, 129)
    _, full = prefill(*left_pad(list(ids[:T]), 128))
    ours_scores = kvzip.scores(model, full, drive.plan(model, pol, 129, 128), list(ids[:T]), pol)
    np.testing.assert_allclose(ours_scores, theirs_scores[0], rtol=RTOL, atol=1e-7)
    cache = compressed(model, ids[:T], pol)
    kept = kept_sets(cache)
    for other in (KVzip, lambda **kw: KVzip(plus=True, **kw)):
        pol_zip = other(ratio=ratio, repeat_ids=REPEAT, continue_ids=CONTINUE, suffix_ids=SUFFIX, chunk_size=chunk,
                        layerwise=layerwise)
        assert kept != kept_sets(compressed(model, ids[:T], pol_zip))
    assert kept == kvpress_kept(pt)
    counts = [len(h) for layer in kept for h in layer]
    assert sum(counts) == 6 * T - int(6 * T * ratio)
    ours, _ = decode(jnp.asarray([ids[T]], jnp.int32), jnp.asarray([T], jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(ours[0]), theirs.numpy(), atol=1e-4, rtol=0)


def test_padding_the_replay_changes_no_score(sdpa_pair):
    """A replay right padded to 40 or to 90 tokens (positions -1) scores every slot alike: padding queries attend
    (a masked row's softmax is uniform) but their zeroed output keeps Φ's padding terms out of the real gradients."""
    _, model = sdpa_pair
    pol = policy(0.5, chunk_size=24)
    ids = np.random.RandomState(5).randint(13, 97, 60).tolist()
    prefill, _ = stepper(model, pol, 129)
    _, cache = prefill(*left_pad(ids, 128))
    plan = drive.plan(model, pol, 129, 128)
    start, end, replay = kvzip.replays(ids, pol)[1]
    got = []
    for t in (40, 90):
        tokens = np.zeros((1, t), np.int32)
        positions = np.full((1, t), -1, np.int32)
        tokens[0, :len(replay)] = replay
        positions[0, :len(replay)] = len(ids) + np.arange(len(replay))
        span = jnp.asarray([[pol.sinks, start, end]], jnp.int32)
        got.append(np.stack([np.asarray(s) for s in drive.grad_replay(model, jnp.asarray(tokens),
                                                                        jnp.asarray(positions), cache, plan, span)]))
    assert np.all(got[0] >= 0) and np.count_nonzero(got[0]) > 0
    np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-8)


def test_a_batch_compresses_each_row_alone(sdpa_pair):
    """Through `generate`: a batch of two contexts of different lengths keeps, row by row, what each keeps alone."""
    from kvjax.generate import generate

    _, model = sdpa_pair
    pol = policy(0.7, chunk_size=24)
    contexts = [np.random.RandomState(3).randint(13, 97, n).tolist() for n in (90, 61)]
    both = generate(model, contexts, pol, max_new_tokens=2)
    for row, ctx in enumerate(contexts):
        alone = generate(model, [ctx], pol, max_new_tokens=2)
        assert [[[p for p in h if p < len(ctx)] for h in layer] for layer in kept_sets(both.cache, row)] == \
               [[[p for p in h if p < len(ctx)] for h in layer] for layer in kept_sets(alone.cache)]
        assert both.sequences()[row] == alone.sequences()[0]


def test_refusals_and_registry():
    """KVzip+'s normalisation, a chunked prefill, a model without its output projection and an output projection
    narrower than the residual stream are refused in one line naming why; `--policy kvgrad` builds the policy, whose
    replays hold kvpress's 512 context tokens by default."""
    from kvjax import layer
    from kvjax.policies import make_policy, resolve

    with pytest.raises(InvalidInput, match="does not apply"):
        policy(0.5, plus=True)
    with pytest.raises(InvalidInput, match="replay attends every context token"):
        policy(0.5, prefill_mode="chunked", chunk=16)
    pol = policy(0.5)
    assert pol.chunk_size == 512 and pol.describe().startswith("KVgrad(ratio=0.5")
    assert make_policy("kvgrad", ratio=0.5, replay=dict(repeat_ids=REPEAT, continue_ids=CONTINUE,
                                                        suffix_ids=SUFFIX, prefix=0)) == pol
    lp = resolve(pol, 1, 2).sized(16, 8).layers[0]
    cache = layer.init_layer_cache(lp, 1, 2, 8, jnp.float32)
    q, kv, pos, tap = jnp.ones((1, 4, 4, 8)), jnp.ones((1, 2, 4, 8)), jnp.arange(8, 12)[None], jnp.zeros((1, 4))
    for out_proj, missing in ((None, r"Geometry\.out_proj is None"), (jnp.ones((4, 8, 64)), "cannot be recovered")):
        geom = layer.Geometry(layer=0, num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5, out_proj=out_proj)
        with pytest.raises(InvalidInput, match=missing) as e:
            layer.grad_replay(geom, lp, cache, q, kv, kv, pos, tap)
        assert "\n" not in str(e.value)
