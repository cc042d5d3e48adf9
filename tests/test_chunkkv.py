"""ChunkKV: kept positions equal to kvpress 0.5.5's `ChunkKVPress(scorer press)` on a hidden-size-64 random Llama
(SDPA attention: `ChunkKVPress` refuses a layer that returns its attention matrix), per layer and KV head, for
every inner scorer the two share, with and without a last partial chunk; each row of a batch as kvpress on that
row alone; the refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput
from kvjax.policies import (
    TOVA,
    AdaKV,
    ChunkKV,
    ExpectedAttention,
    KeyDiff,
    KNorm,
    PyramidKV,
    SnapKV,
    StreamingLLM,
    make_policy,
)
from tests.conftest import left_pad, stepper
from tests.test_kvpress import KERNEL, RATIO, WINDOW, sdpa_pair  # noqa: F401  (the fixture, reused)

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")

T = 100  # 14 chunks of 7 and a partial chunk of 2 (at RATIO 6 of 15 are kept); 5 chunks of 20


def scorers(name):
    return {
        "snapkv": (SnapKV(ratio=RATIO, observation_window=WINDOW, kernel=KERNEL, pool="avg", group_agg="mean"),
                   kvpress.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=KERNEL)),
        "tova": (TOVA(ratio=RATIO), kvpress.TOVAPress(compression_ratio=RATIO)),
        "knorm": (KNorm(ratio=RATIO), kvpress.KnormPress(compression_ratio=RATIO)),
        "keydiff": (KeyDiff(ratio=RATIO), kvpress.KeyDiffPress(compression_ratio=RATIO)),
        "expected": (ExpectedAttention(ratio=RATIO), kvpress.ExpectedAttentionPress(compression_ratio=RATIO)),
    }[name]


def kvpress_kept(pt, press, ids):
    """Per layer, per KV head, the sorted positions kvpress's compressed cache holds for the prompt `ids` (each kept
    key found in the uncompressed cache), and the next token's logits after `ids`'s last token is appended."""
    from transformers import DynamicCache

    full, compressed = DynamicCache(), DynamicCache()
    x = torch.tensor(np.asarray(ids)[None])
    with torch.no_grad():
        pt(x, past_key_values=full)
        with press(pt):
            pt(x, past_key_values=compressed)
    out = []
    for layer in range(len(full.layers)):
        fk, ck = full.layers[layer].keys[0], compressed.layers[layer].keys[0]
        out.append([sorted(int(torch.where((fk[h] == row).all(-1))[0][0]) for row in ck[h])
                    for h in range(fk.shape[0])])
    return out, compressed


@pytest.mark.parametrize("name,chunk", [("snapkv", 7), ("snapkv", 20), ("tova", 7), ("knorm", 7), ("keydiff", 7),
                                        ("expected", 7)])
def test_kept_positions_match_kvpress_chunkkv(sdpa_pair, name, chunk):  # noqa: F811
    pt, model = sdpa_pair
    ours, press = scorers(name)
    ids = np.random.RandomState(7).randint(0, 97, T + 1)
    theirs, compressed = kvpress_kept(pt, kvpress.ChunkKVPress(press, chunk_length=chunk), ids[:T])
    policy = ChunkKV(scorer=ours, chunk_length=chunk)
    prefill, decode = stepper(model, policy, 128 + 1)
    _, cache = prefill(*left_pad(ids[:T].tolist(), 128))
    kept = kept_sets(cache)
    for layer in range(model.cfg.num_layers):
        for h in range(model.cfg.num_kv_heads):
            assert kept[layer][h] == theirs[layer][h], (name, chunk, layer, h)
        assert kept[layer][0] == kept[layer][1]  # one selection for the layer's KV heads
    n = len(theirs[0][0])
    # whole chunks: 6 of 15 (42 tokens, or 37 with the partial chunk of 2), 2 of 5
    assert n == (40 if chunk == 20 else 37 if T - 1 in theirs[0][0] else 42)
    # the cache holds what the bucket's longest prompt keeps (128 tokens: 7 of 19 chunks of 7, 2 of 7 of 20), plus the
    # decoded token's slot
    assert cache[0].k.shape[2] == policy.capacity(0, 129, 128) == (49 if chunk == 7 else 40) + 1
    if name == "snapkv" and chunk == 7:  # the next token attends only what is kept, as in kvpress
        with torch.no_grad():
            want = pt(torch.tensor([[ids[T]]]), past_key_values=compressed,
                      position_ids=torch.tensor([[T]])).logits[0, -1].numpy()
        logits, _ = decode(jnp.asarray([ids[T]]), jnp.asarray([T]), cache)
        np.testing.assert_allclose(np.asarray(logits[0]), want, atol=1e-4, rtol=0)


def test_each_row_of_a_batch_keeps_its_own_chunks_as_kvpress_on_that_row(sdpa_pair):  # noqa: F811
    """Rows of 100 (5 whole chunks of 20), 61 (3 and a partial chunk of 1) and 15 tokens (under one chunk: the
    scorer's own token selection, each KV head its own) in one left-padded batch: each row keeps what kvpress keeps
    for that row alone (kvpress on a batch would give every row the first row's chunks)."""
    pt, model = sdpa_pair
    lengths, bucket, chunk = (100, 61, 15), 128, 20
    rows = [np.random.RandomState(20 + i).randint(0, 97, n) for i, n in enumerate(lengths)]
    tokens = np.zeros((len(rows), bucket), np.int32)
    pos = np.full((len(rows), bucket), -1, np.int32)
    for i, r in enumerate(rows):
        tokens[i, bucket - len(r):], pos[i, bucket - len(r):] = r, np.arange(len(r))
    policy = ChunkKV(scorer=SnapKV(ratio=0.5, observation_window=4, kernel=KERNEL, pool="avg"), chunk_length=chunk)
    prefill, _ = stepper(model, policy, bucket + 1)
    _, cache = prefill(jnp.asarray(tokens), jnp.asarray(pos))
    for i, r in enumerate(rows):
        theirs, _ = kvpress_kept(pt, kvpress.ChunkKVPress(kvpress.SnapKVPress(compression_ratio=0.5, window_size=4,
                                                                              kernel_size=KERNEL), chunk_length=chunk), r)
        kept = kept_sets(cache, row=i)
        for layer in range(model.cfg.num_layers):
            for h in range(model.cfg.num_kv_heads):
                assert kept[layer][h] == theirs[layer][h], (i, layer, h)
    assert [len(kept_sets(cache, row=i)[0][0]) for i in range(3)] == [40, 21, 7]  # 2 of 5; 2 of 4 (one whole, the partial one); 7
    short = kept_sets(cache, row=2)
    assert any(layer[0] != layer[1] for layer in short)  # below one chunk each KV head selects its own tokens


def test_registry_budget_memory_and_refusals():
    assert make_policy("chunkkv", ratio=0.5) == ChunkKV(scorer=SnapKV(ratio=0.5))
    policy = make_policy("chunkkv", 64, chunk_length=10)
    assert policy == ChunkKV(scorer=SnapKV(budget=64), chunk_length=10)
    assert "ChunkKV(scorer=SnapKV(budget=64" in policy.describe() and "chunk_length=10" in policy.describe()
    # a token budget keeps budget // chunk_length whole chunks: the cache holds them plus the decoded tokens
    assert policy.capacity(0, 130, 100) == 60 + 30
    assert ChunkKV(scorer=KNorm(ratio=0.5), chunk_length=7).capacity(0, 110, 100) == 49 + 10  # 7 of 14 or 15 chunks
    for scorer, name in ((PyramidKV(ratio=0.5, num_layers=3), "PyramidKV"), (AdaKV(scorer=SnapKV(ratio=0.5)), "AdaKV")):
        with pytest.raises(InvalidInput, match=f"ChunkKV cannot wrap {name}"):
            ChunkKV(scorer=scorer)
    for scorer in (StreamingLLM(budget=16), ChunkKV(scorer=SnapKV(ratio=0.5))):
        with pytest.raises(InvalidInput, match=f"scorer={type(scorer).__name__} is not a prompt compressor"):
            ChunkKV(scorer=scorer)
    with pytest.raises(InvalidInput, match="ChunkKV cannot run prefill_mode='chunked'"):
        ChunkKV(scorer=SnapKV(ratio=0.5), prefill_mode="chunked", chunk=32)
    with pytest.warns(UserWarning), pytest.raises(InvalidInput, match="ChunkKV cannot run prefill_mode='chunked'"):
        ChunkKV(scorer=SnapKV(budget=64, prefill_mode="chunked", chunk=32))
    with pytest.raises(InvalidInput, match="ChunkKV cannot run prefill_mode='stream'"):
        ChunkKV(scorer=SnapKV(ratio=0.5), prefill_mode="stream")
    with pytest.raises(InvalidInput, match="less than one chunk"):
        ChunkKV(scorer=SnapKV(budget=32), chunk_length=40)
    with pytest.raises(InvalidInput, match="chunk_length=0"):
        ChunkKV(scorer=SnapKV(ratio=0.5), chunk_length=0)
