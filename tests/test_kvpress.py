"""Kept-position and logit parity with kvpress 0.5.5 (PyTorch) on tiny random Llamas.

kvpress's conventions are options of ours: SnapKV/PyramidKV with avg-pooling and the mean over
the GQA group, ObservedAttention normalised by the number of queries, a token budget derived
from `compression_ratio`. Kept positions are recovered from kvpress's compressed cache by
matching each kept key against the uncompressed cache.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvcache
from kvjax.cache import kept_sets
from kvjax.policies import TOVA, KeyDiff, KNorm, ObservedAttention, PyramidKV, SnapKV, StreamingLLM
from models import load
from tests.conftest import left_pad, stepper

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")

T, RATIO, WINDOW, KERNEL = 100, 0.6, 16, 5  # T is not a multiple of the window or the kernel


def ours_and_theirs(name, num_layers):
    n_kept = int(T * (1 - RATIO))
    return {
        "snapkv": (SnapKV(ratio=RATIO, observation_window=WINDOW, kernel=KERNEL, pool="avg", group_agg="mean"),
                   kvpress.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=KERNEL)),
        "streaming": (StreamingLLM(budget=n_kept, sinks=4), kvpress.StreamingLLMPress(compression_ratio=RATIO, n_sink=4)),
        "knorm": (KNorm(ratio=RATIO), kvpress.KnormPress(compression_ratio=RATIO)),
        "keydiff": (KeyDiff(ratio=RATIO), kvpress.KeyDiffPress(compression_ratio=RATIO)),
        "tova": (TOVA(ratio=RATIO), kvpress.TOVAPress(compression_ratio=RATIO)),
        "observed": (ObservedAttention(ratio=RATIO, normalize=True, group_agg="mean"),
                     kvpress.ObservedAttentionPress(compression_ratio=RATIO)),
        "pyramidkv": (PyramidKV(ratio=RATIO, observation_window=WINDOW, kernel=KERNEL, pool="avg", num_layers=num_layers),
                      kvpress.PyramidKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=KERNEL)),
    }[name]


@pytest.fixture(scope="module", params=[(4, 4), (8, 2)], ids=["mha", "gqa4"])
def model_pair(request, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads = request.param
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                      max_position_embeddings=512, initializer_range=0.2, attn_implementation="eager")
    pt = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp(f"kvpress_{heads}_{kv_heads}")
    pt.save_pretrained(path)
    return pt, load(path).model


@pytest.mark.parametrize("name", ["snapkv", "streaming", "knorm", "keydiff", "tova", "observed", "pyramidkv"])
def test_kept_positions_and_next_logits_match_kvpress(model_pair, name):
    from transformers import DynamicCache

    pt, model = model_pair
    ours, press = ours_and_theirs(name, model.cfg.num_layers)
    ids = np.random.RandomState(7).randint(0, 97, T + 1)
    x = torch.tensor(ids[None, :T])
    full, compressed = DynamicCache(), DynamicCache()
    kw = {"output_attentions": True} if name == "observed" else {}
    with torch.no_grad():
        pt(x, past_key_values=full)
        with press(pt):
            pt(x, past_key_values=compressed, **kw)
        kept_keys = [layer.keys[0].clone() for layer in compressed.layers]  # before decoding appends
        theirs_logits = pt(torch.tensor([[ids[T]]]), past_key_values=compressed, position_ids=torch.tensor([[T]])).logits[0, -1].numpy()

    prefill, decode = stepper(model, ours, 128 + 1)
    _, cache = prefill(*left_pad(ids[:T].tolist(), 128))
    our_kept = kept_sets(cache)
    for layer in range(model.cfg.num_layers):
        fk, ck = full.layers[layer].keys[0], kept_keys[layer]
        for h in range(fk.shape[0]):
            theirs = sorted(int(torch.where((fk[h] == row).all(-1))[0][0]) for row in ck[h])
            assert our_kept[layer][h] == theirs, (name, layer, h)
    if name == "streaming":
        # kvpress compresses the prompt, then appends; our StreamingLLM keeps evicting while it
        # decodes (as the paper does). Compare the same thing: append into one more, free slot.
        cache = tuple(kvcache.concat_slots(layer, kvcache.empty(1, layer.k.shape[1], 1, layer.k.shape[3], layer.k.dtype))
                      for layer in cache)
        _, decode = stepper(model, KNorm(ratio=RATIO), 128 + 1)  # a prefill compressor's step appends
    logits, _ = decode(jnp.asarray([ids[T]]), jnp.asarray([T]), cache)
    assert np.abs(theirs_logits).max() > 0.5
    np.testing.assert_allclose(np.asarray(logits[0]), theirs_logits, atol=1e-4, rtol=0)
