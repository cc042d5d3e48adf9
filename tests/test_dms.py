"""DMS's threshold rule (`--policy dms`) against kvpress 0.5.5's `DMSPress(KnormPress(), threshold, sliding_window_size,
decoding=True)`: per layer and KV head, the positions kvpress leaves unmasked after a prompt and each decoded token are
the ones kvjax's cache holds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput
from kvjax.policies import DMS, KNorm, SnapKV, make_policy
from tests.conftest import left_pad, sdpa_llama, stepper

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")

T, STEPS, WINDOW = 60, 12, 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sdpa_llama(tmp_path_factory.mktemp("dms"), seed=7)  # DMSPress masks through SDPA only (eager crashes)


def test_dms_kept_positions_match_kvpress_dms_press(pair):
    pt, model = pair
    ids = np.random.RandomState(9).randint(0, 97, T + STEPS)
    from transformers import DynamicCache

    full = DynamicCache()
    with torch.no_grad():  # a threshold inside the keys' scores (minus their norms): some evicted, some kept
        pt(torch.tensor(ids[None, :T]), past_key_values=full)
    threshold = -float(np.median(np.concatenate([layer.keys[0].norm(dim=-1).numpy().ravel() for layer in full.layers])))
    press = kvpress.DMSPress(press=kvpress.KnormPress(), threshold=threshold, sliding_window_size=WINDOW,
                             decoding=True)
    ours = make_policy("dms", threshold=threshold, dms_window=WINDOW, dms_decoding=True)
    cache = DynamicCache()
    prefill, decode = stepper(model, ours, 128 + STEPS)
    with torch.no_grad(), press(pt):
        pt(torch.tensor(ids[None, :T]), past_key_values=cache)
        _, our_cache = prefill(*left_pad(ids[:T].tolist(), 128))
        for t in range(T, T + STEPS + 1):
            length = t  # tokens read so far
            theirs = []
            for layer in pt.model.layers:
                masked = layer.self_attn.masked_key_indices
                kept = np.ones((2, length), bool)
                if masked is not None:
                    kept[masked[1].numpy(), masked[2].numpy()] = False
                theirs.append([np.flatnonzero(h).tolist() for h in kept])
            assert kept_sets(our_cache) == theirs, f"after {t - T} decoded tokens"
            if t == T + STEPS:
                break
            pt(torch.tensor([[ids[t]]]), past_key_values=cache, position_ids=torch.tensor([[t]]))
            _, our_cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), our_cache)
    evicted = sum(length - len(h) for layer in theirs for h in layer)
    assert 0 < evicted < 3 * 2 * length  # the threshold evicted some tokens, not all


def test_dms_refuses_a_scorer_that_needs_attention():
    with pytest.raises(InvalidInput, match="needs statistics of the attention"):
        DMS(scorer=SnapKV(ratio=0.0), threshold=0.0)
    with pytest.raises(InvalidInput, match="give it"):
        make_policy("dms")
    assert "KNorm" in DMS(scorer=KNorm(ratio=0.0), threshold=-1.0).describe()
