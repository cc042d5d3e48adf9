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
from kvjax.policies import TOVA, ExpectedAttention, KeyDiff, KNorm, ObservedAttention, PyramidKV, SnapKV, StreamingLLM
from kvjax.models import load
from tests.conftest import left_pad, sdpa_llama, stepper

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
        "expected": (ExpectedAttention(ratio=RATIO), kvpress.ExpectedAttentionPress(compression_ratio=RATIO)),
        "expected-mean": (ExpectedAttention(ratio=RATIO, future=64, covariance=False, vnorm=False, sinks=2),
                          kvpress.ExpectedAttentionPress(compression_ratio=RATIO, n_future_positions=64,
                                                         use_covariance=False, use_vnorm=False, n_sink=2)),
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


@pytest.mark.parametrize("name", ["snapkv", "streaming", "knorm", "keydiff", "expected", "expected-mean", "tova",
                                  "observed", "pyramidkv"])
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


@pytest.fixture(scope="module")
def sdpa_pair(tmp_path_factory):
    return sdpa_llama(tmp_path_factory.mktemp("kvpress_sdpa"), seed=1)


def test_duo_attention_kept_positions_match_kvpress_for_a_fixed_pattern(sdpa_pair):
    """DuoAttention with a fixed head pattern: per layer and KV head, the positions our streaming heads keep
    (in their own arrays) are the ones kvpress's DuoAttentionPress leaves unmasked, and retrieval heads keep
    everything, at two head compressions."""
    from transformers import DynamicCache

    from kvjax.policies import DuoAttention, streaming_heads

    pt, model = sdpa_pair
    scores = np.random.default_rng(2).random((3, 2))
    ids = np.random.RandomState(8).randint(0, 97, T)
    for compression in (0.34, 0.67):
        press = kvpress.DuoAttentionPress(head_compression_ratio=compression)
        press.post_init_from_model = lambda model: None  # the fixed pattern below, not one from the hub
        press.sink_size, press.recent_size = 8, 24
        press.streaming_mask = torch.zeros(scores.shape, dtype=torch.bool)
        n = round(scores.size * compression)
        press.streaming_mask.view(-1)[torch.as_tensor(np.argsort(scores, axis=None)[:n])] = True
        with torch.no_grad(), press(pt):
            pt(torch.tensor(ids[None]), past_key_values=DynamicCache())
        ours = DuoAttention(streaming=streaming_heads(scores, compression), sinks=8, recent=24)
        assert np.array_equal(np.asarray(ours.streaming), press.streaming_mask.numpy())
        prefill, _ = stepper(model, ours, 128 + 1)
        _, cache = prefill(*left_pad(ids.tolist(), 128))
        kept = kept_sets(cache)
        for layer in range(3):
            masked = pt.model.layers[layer].self_attn.masked_key_indices
            for h in range(2):
                gone = {int(s) for b, hh, s in zip(*masked) if int(hh) == h} if masked is not None else set()
                assert kept[layer][h] == sorted(set(range(T)) - gone), (compression, layer, h)


def test_duo_scores_match_kvpress_on_the_fly(sdpa_pair, monkeypatch):
    """kvpress's on-the-fly DuoAttention scores (the mean query and key repeated with RoPE, the area under the
    last query's cumulated attention), on the same token rows: kvpress's BookSum download and tokenizer are
    replaced by these rows, which is all that changes."""
    import pandas as pd

    from kvjax.heads import duo_scores
    from kvpress.presses import duo_attention_press as duo

    pt, model = sdpa_pair
    rows = [np.random.RandomState(s).randint(0, 97, 60).tolist() for s in range(3)]

    class Encoded(dict):
        def to(self, device):
            return self

    class FakeData:
        def to_pandas(self):
            return pd.DataFrame({"chapter": [f"text{i}" for i in range(len(rows))]})

    monkeypatch.setattr(duo, "load_dataset", lambda *a, **k: FakeData())
    monkeypatch.setattr(duo.AutoTokenizer, "from_pretrained", lambda *a, **k: (
        lambda text, return_tensors=None: Encoded(input_ids=torch.tensor([rows[int(text[4:])]]))))
    duo.cache.clear()
    theirs = duo.duo_attention_on_the_fly(pt, num_samples=3, q_len=40)
    ours = duo_scores(model, rows, q_len=40)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_adakv_kept_positions_per_head_match_kvpress(sdpa_pair):
    """AdaKV(SnapKV): the positions each KV head keeps after the layer-wide top-k (each head first keeping
    its alpha share) are those kvpress's AdaKVPress leaves unmasked, at two ratios; the heads keep different
    counts whose sum is the layer's budget; the next token's logits (each head attending its own slots of the
    pooled cache) equal kvpress's."""
    from transformers import DynamicCache

    from kvjax.policies import AdaKV

    pt, model = sdpa_pair
    ids = np.random.RandomState(9).randint(0, 97, T + 1)
    varied = False
    for ratio in (0.5, 0.8):
        press = kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=WINDOW,
                                                       kernel_size=KERNEL), alpha_safeguard=0.2)
        cache_pt = DynamicCache()
        with torch.no_grad():
            with press(pt):
                pt(torch.tensor(ids[None, :T]), past_key_values=cache_pt)
            theirs = pt(torch.tensor([[ids[T]]]), past_key_values=cache_pt,
                        position_ids=torch.tensor([[T]])).logits[0, -1].numpy()
        ours = AdaKV(scorer=SnapKV(ratio=ratio, observation_window=WINDOW, kernel=KERNEL, pool="avg",
                                   group_agg="mean"), alpha=0.2)
        prefill, decode = stepper(model, ours, 128 + 1)
        _, cache = prefill(*left_pad(ids[:T].tolist(), 128))
        # the next token attends each head's own slots of the pool: kvpress's masked attention
        logits, _ = decode(jnp.asarray([ids[T]], jnp.int32), jnp.asarray([T], jnp.int32), cache)
        np.testing.assert_allclose(np.asarray(logits[0]), theirs, atol=1e-4, rtol=0)
        kept = kept_sets(cache)
        n_kept = int(T * (1 - ratio))
        for layer in range(3):
            masked = pt.model.layers[layer].self_attn.masked_key_indices
            for h in range(2):
                gone = {int(s) for b, hh, s in zip(*masked) if int(hh) == h}
                assert kept[layer][h] == sorted(set(range(T)) - gone), (ratio, layer, h)
            assert sum(len(x) for x in kept[layer]) == 2 * n_kept
            varied |= len(kept[layer][0]) != len(kept[layer][1])
    assert varied  # the heads really keep different counts


@pytest.fixture(scope="module")
def distinct_pair(tmp_path_factory):
    """A GQA pair with a vocabulary large enough for 120 distinct token ids: a repeated id has the same layer-0 key
    norm up to rounding, a tie KNorm's two implementations break differently, and the difference then spreads
    to every later layer through the tokens decoded after it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, initializer_range=0.2,
                      attn_implementation="eager")
    pt = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("kvpress_distinct")
    pt.save_pretrained(path)
    return pt, load(path).model


@pytest.mark.parametrize("scorer,prompt", [("knorm", "scorer"), ("knorm", "whole"),
                                           pytest.param("keydiff", "scorer", marks=pytest.mark.slow),
                                           pytest.param("keydiff", "whole", marks=pytest.mark.slow)])
def test_decoding_kept_positions_match_kvpress_decoding_press(distinct_pair, scorer, prompt):
    """`Decoding(scorer(budget=B), every=N)` against kvpress's `DecodingPress(scorer, compression_interval=N,
    target_size=B)` (the prompt kept whole, then the whole cache compressed every N steps) and, with
    `prompt=scorer` (`recompress`), against `PrefillDecodingPress` (the scorer compresses the prompt to B first):
    20 tokens decoded one by one, two compressions, the same kept positions per layer and KV head (scorers that
    read keys only, where the two frameworks' group aggregations cannot differ)."""
    from transformers import DynamicCache

    from kvjax.policies import Decoding, recompress

    pt, model = distinct_pair
    every, steps = 8, 20
    budget = int(T * (1 - RATIO))
    press_of = {"knorm": kvpress.KnormPress, "keydiff": kvpress.KeyDiffPress}[scorer]
    ranker = {"knorm": KNorm, "keydiff": KeyDiff}[scorer](budget=budget)
    decoding = kvpress.DecodingPress(base_press=press_of(), compression_interval=every, target_size=budget)
    if prompt == "scorer":
        ours = recompress(ranker, every)
        press = kvpress.PrefillDecodingPress(prefilling_press=press_of(compression_ratio=RATIO),
                                             decoding_press=decoding)
    else:
        ours, press = Decoding(scorer=ranker, every=every), decoding
    ids = np.random.RandomState(11).permutation(257)[:T + steps]  # distinct ids: no ties

    class Recorded(DynamicCache):
        """Keeps every key handed to the cache, per layer, in position order: a decoded token's key depends on
        the compressed cache of the layers below it, so only this run's keys identify its kept positions."""
        seen: dict

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.seen.setdefault(layer_idx, []).append(key_states[0].clone())
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    compressed = Recorded()
    compressed.seen = {}
    with torch.no_grad():
        with press(pt):
            pt(torch.tensor(ids[None, :T]), past_key_values=compressed)
            for t in range(T, T + steps):
                pt(torch.tensor([[ids[t]]]), past_key_values=compressed, position_ids=torch.tensor([[t]]))

    prefill, decode = stepper(model, ours, 128 + steps)
    _, cache = prefill(*left_pad(ids[:T].tolist(), 128))
    assert cache[0].capacity == (128 if prompt == "whole" else budget) + every  # the padded prompt or B, + N
    for t in range(T, T + steps):
        _, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
    our_kept = kept_sets(cache)
    for layer in range(model.cfg.num_layers):
        fk, ck = torch.cat(compressed.seen[layer], dim=1), compressed.layers[layer].keys[0]
        assert fk.shape[1] == T + steps
        for h in range(fk.shape[0]):
            theirs = sorted(int(torch.where((fk[h] == row).all(-1))[0][0]) for row in ck[h])
            assert len(theirs) == budget + steps - 2 * every  # two compressions, then 4 appended
            assert our_kept[layer][h] == theirs, (scorer, prompt, layer, h)
