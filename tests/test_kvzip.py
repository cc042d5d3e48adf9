"""KVzip (`kvjax.kvzip`, `kvjax.policies.KVzip`): kept positions equal to kvpress 0.5.5's KVzipPress on a random
GQA Llama, the replay prompts built as kvpress builds them, generation with questions, compile-once replays."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import kvzip
from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput
from kvjax.policies import KVzip
from tests.conftest import compile_log, left_pad, sdpa_llama, stepper
from kvjax import drive

T = 100
REPEAT, CONTINUE, SUFFIX = (5, 6, 7, 8), (9, 10, 11), (12,)  # stand-ins for the tokenizer's ids


def policy(ratio, **kw):
    return KVzip(ratio=ratio, repeat_ids=REPEAT, continue_ids=CONTINUE, suffix_ids=SUFFIX, **kw)


@pytest.fixture(scope="module")
def sdpa_pair(tmp_path_factory):
    return sdpa_llama(tmp_path_factory.mktemp("kvzip"), seed=1, input_norm_noise=0.5)


def kvpress_kept(pt) -> list[list[list[int]]]:
    """Per layer and KV head, the context positions (of `T`) kvpress's press left unmasked after its prefill."""
    out = []
    for layer in pt.model.layers:
        masked = layer.self_attn.masked_key_indices
        out.append([sorted(set(range(T)) - {int(s) for b, hh, s in zip(*masked) if int(hh) == h}) for h in range(2)])
    return out


def stub_replay_tokenizer(monkeypatch):
    """kvpress's KVzip family loads the model's tokenizer for its replay prompts: a stub that gives this file's ids
    (`REPEAT`, `CONTINUE`, `SUFFIX`) for kvpress's texts, no chat template."""
    import torch
    from kvpress.presses import kvzip_press

    texts = {"": [], "\n": SUFFIX, "\n\nRepeat the previous context exactly.": REPEAT,
             "\n\nRepeat the part of the previous context exactly, starting with": CONTINUE}

    class Tokenizer:
        chat_template = None

        def encode(self, text, return_tensors=None, add_special_tokens=False):
            return torch.tensor([texts[text]], dtype=torch.long)

    monkeypatch.setattr(kvzip_press.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())


def compressed(model, ids, pol, bucket=128):
    prefill, _ = stepper(model, pol, bucket + 1)
    _, cache = prefill(*left_pad(list(ids), bucket))
    return kvzip.compress(model, cache, drive.plan(model, pol, bucket + 1, bucket), [list(ids)])


@pytest.mark.parametrize("ratio, chunk, layerwise, plus", [(0.5, 2048, False, False), (0.8, 32, False, False),
                                                           (0.6, 40, True, False), (0.7, 32, False, True),
                                                           (0.5, 2048, True, True)],
                         ids=["one-replay", "four-replays", "layerwise", "plus-four-replays", "plus-layerwise"])
def test_kept_positions_per_head_and_next_logits_match_kvpress(sdpa_pair, monkeypatch, ratio, chunk, layerwise, plus):
    """Per layer and KV head, the positions KVzip keeps are those kvpress's KVzipPress leaves unmasked: one replay
    of the whole context, four replays of 32 tokens (later ones opened by the previous chunk's last 8 tokens, with
    the sinks in their softmax), and per-layer budgets; then the next token's logits agree. KVzip+ (`plus`, kvpress's
    `kvzip_plus_normalization`): the same, each probability divided by its replay query's input norm and multiplied
    by the slot's ‖v W_o‖_2 per query head. kvpress's tokenizer (a hub download) is replaced by the same prompt ids;
    no chat template, as for a base model."""
    import torch
    from transformers import DynamicCache

    import kvpress

    pt, model = sdpa_pair
    stub_replay_tokenizer(monkeypatch)
    ids = np.random.RandomState(9).randint(13, 97, T + 1)
    press = kvpress.KVzipPress(compression_ratio=ratio, chunk_size=chunk, layerwise=layerwise,
                               kvzip_plus_normalization=plus)
    cache_pt = DynamicCache()
    with torch.no_grad():
        with press(pt):
            pt.model(input_ids=torch.tensor(ids[None, :T]), past_key_values=cache_pt)
        theirs = pt(torch.tensor([[ids[T]]]), past_key_values=cache_pt, position_ids=torch.tensor([[T]])).logits[0, -1]

    pol = policy(ratio, chunk_size=chunk, layerwise=layerwise, plus=plus)
    cache = compressed(model, ids[:T], pol)
    if plus:  # the normalisation changes what is kept
        assert kept_sets(cache) != kept_sets(compressed(model, ids[:T], policy(ratio, chunk_size=chunk,
                                                                              layerwise=layerwise)))
    kept = kept_sets(cache)
    assert kept == kvpress_kept(pt)
    counts = [len(h) for layer in kept for h in layer]
    assert sum(counts) == 6 * T - int(6 * T * ratio) and len(set(counts)) > 1  # one global share, uneven heads
    _, decode = stepper(model, pol, 129)
    import jax.numpy as jnp

    ours, _ = decode(jnp.asarray([ids[T]], jnp.int32), jnp.asarray([T], jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(ours[0]), theirs.numpy(), atol=1e-4, rtol=0)


def test_replays_are_kvpress_prepare_by_hand():
    """A 20-token context after a 2-token template prefix, chunks of 7: replays of positions 2-8, 9-15, 16-19,
    each later one opened by the previous chunk's last tokens (at most 8, here all 7)."""
    ctx = list(range(100, 120))
    got = kvzip.replays(ctx, policy(0.5, chunk_size=7, prefix=2))
    assert [(s, e) for s, e, _ in got] == [(2, 9), (9, 16), (16, 20)]
    assert got[0][2] == [5, 6, 7, 8, 12] + list(range(102, 109))
    assert got[1][2] == [9, 10, 11] + list(range(102, 109)) + [12] + list(range(109, 116))
    assert got[2][2] == [9, 10, 11] + list(range(109, 116)) + [12] + list(range(116, 120))
    wide = kvzip.replays(ctx, policy(0.5, chunk_size=10))
    assert wide[1][2][:11] == [9, 10, 11] + list(range(102, 110))  # the last 8 of a 10-token chunk


def test_evicted_share_sinks_and_layerwise_by_hand():
    """Two layers, one head, five positions, layer 1 scored low everywhere: 40 % of all ten slots (the four lowest
    over both layers) are all of layer 1's non-sinks, while `layerwise` takes 40 % of each layer (two each); the
    sink (position 0, scored lowest) is never evicted."""
    score = np.asarray([[[0.0, 0.9, 0.1, 0.5, 0.2]], [[0.0, 0.01, 0.02, 0.03, 0.04]]], np.float32)
    gone = kvzip.evicted(score, policy(0.4, sinks=1))
    assert [list(np.nonzero(g[0])[0]) for g in gone] == [[], [1, 2, 3, 4]]
    gone = kvzip.evicted(score, policy(0.4, sinks=1, layerwise=True))
    assert [list(np.nonzero(g[0])[0]) for g in gone] == [[2, 4], [1, 2]]


def test_generation_with_questions_compresses_each_row_alone(sdpa_pair):
    """Through `generate` (the question-agnostic protocol): a batch of two contexts of different lengths keeps,
    row by row, what each keeps alone, and the questions and generated tokens follow in the emptied cache."""
    from kvjax.generate import generate

    _, model = sdpa_pair
    pol = policy(0.7, chunk_size=24)
    rng = np.random.RandomState(3)
    contexts = [rng.randint(13, 97, n).tolist() for n in (90, 61)]
    questions = [rng.randint(13, 97, 5).tolist() for _ in contexts]
    both = generate(model, contexts, pol, questions=questions, max_new_tokens=4)
    for row, (ctx, q) in enumerate(zip(contexts, questions)):
        alone = generate(model, [ctx], pol, questions=[q], max_new_tokens=4)
        assert [[[p for p in h if p < len(ctx)] for h in layer] for layer in kept_sets(both.cache, row)] == \
               [[[p for p in h if p < len(ctx)] for h in layer] for layer in kept_sets(alone.cache)]
        assert both.sequences()[row] == alone.sequences()[0]
        kept = sum(len([p for p in h if p < len(ctx)]) for layer in kept_sets(alone.cache) for h in layer)
        assert kept == 6 * len(ctx) - int(6 * len(ctx) * 0.7)
        after = kept_sets(alone.cache)[0][0]
        fed = len(q) + int(alone.lengths[0]) - 1  # the question, then each generated token but the last
        assert [p for p in after if p >= len(ctx)] == list(range(len(ctx), len(ctx) + fed))


def test_replays_compile_once_per_length_bucket(sdpa_pair):
    """Context positions, chunk spans and token ids are arrays: another context of the same length compiles
    no replay."""
    _, model = sdpa_pair
    pol = policy(0.5, chunk_size=32)
    compressed(model, np.random.RandomState(1).randint(13, 97, T), pol)
    prefill, _ = stepper(model, pol, 129)
    _, cache = prefill(*left_pad(np.random.RandomState(2).randint(13, 97, T).tolist(), 128))
    ids = np.random.RandomState(2).randint(13, 97, T).tolist()
    with compile_log() as compiles:
        kvzip.compress(model, cache, drive.plan(model, pol, 129, 128), [ids])
    assert compiles == []


def test_refusals():
    """A chunked prefill, a ratio outside [0, 1), or no replay prompt are errors naming why."""
    with pytest.raises(InvalidInput, match="replay attends every context token"):
        policy(0.5, prefill_mode="chunked", chunk=16)
    with pytest.raises(InvalidInput, match="ratio=1"):
        policy(1)
    with pytest.raises(InvalidInput, match="replay prompts"):
        KVzip(ratio=0.5, repeat_ids=(), continue_ids=CONTINUE, suffix_ids=SUFFIX)


def test_command_line_builds_the_replay_from_the_models_tokenizer(capsys, tmp_path):
    """`--policy kvzip --ratio R` on the embedded model (which has a tokenizer): the policy's description carries the
    tokenizer's ids of kvpress's repeat prompt; --budget, a missing --ratio and a model without a tokenizer are
    one-line errors naming why."""
    import shutil

    from kvjax.experiments import generate as gen_cli
    from kvjax.experiments.common import DEFAULT_MODEL_DIR
    from kvjax.models.loading import load_tokenizer

    assert gen_cli.main(["--policy", "kvzip", "--ratio", "0.5", "--kvzip-chunk", "16", "--max-new-tokens", "2",
                         "The sky is blue. The grass is green."]) == 0
    out = capsys.readouterr().out
    ids = load_tokenizer(DEFAULT_MODEL_DIR).encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
    assert f"repeat_ids={ids}" in out and "chunk_size=16" in out
    with pytest.raises(InvalidInput, match="--budget 8 does not apply to --policy kvzip"):
        gen_cli.main(["--policy", "kvzip", "--budget", "8"])
    with pytest.raises(InvalidInput, match=r"give ratio \(--ratio\)"):
        gen_cli.main(["--policy", "kvzip"])
    bare = tmp_path / "bare"
    shutil.copytree(DEFAULT_MODEL_DIR, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(InvalidInput, match="this model has none"):
        gen_cli.main(["--model", str(bare), "--policy", "kvzip", "--ratio", "0.5"])


def test_a_sweep_of_ratios_replays_each_context_once(sdpa_pair, monkeypatch):
    """`generate_many` over KVzip at two ratios (and layerwise) gives what separate calls give, and replays each
    context once: the policies differ only in how much they evict."""
    from kvjax.generate import generate, generate_many

    _, model = sdpa_pair
    contexts = [np.random.RandomState(s).randint(13, 97, n).tolist() for s, n in ((4, 80), (5, 50))]
    pols = [policy(0.5, chunk_size=32), policy(0.8, chunk_size=32), policy(0.6, chunk_size=32, layerwise=True)]
    calls = []
    from kvjax.policies import kvzip as method  # where the hook takes its scores from

    real = method.scores
    monkeypatch.setattr(method, "scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    together = generate_many(model, contexts, pols, max_new_tokens=3)
    assert len(calls) == len(contexts)
    for pol, got in zip(pols, together):
        alone = generate(model, contexts, pol, max_new_tokens=3)
        assert kept_sets(got.cache, 1) == kept_sets(alone.cache, 1) and got.sequences() == alone.sequences()
    assert len(calls) == len(contexts) * (1 + len(pols))


def test_non_finite_scores_are_an_error(sdpa_pair, monkeypatch):
    """A NaN in the replay's scores stops the eviction with an error naming the replay, instead of sorting anywhere."""
    from kvjax.errors import NonFiniteError

    from kvjax import attention

    _, model = sdpa_pair
    real = attention.replay_attention

    def nan_scores(*args, **kwargs):
        out, scores = real(*args, **kwargs)
        return out, scores * jnp.nan

    monkeypatch.setattr(attention, "replay_attention", nan_scores)
    with pytest.raises(NonFiniteError, match="replay of positions 0-99"):
        compressed(model, np.random.RandomState(1).randint(13, 97, T), policy(0.5, chunk_size=128))


def test_kvzip_plus_refuses_a_model_without_its_inputs_and_is_registered():
    """KVzip+ reads each replay query's attention input and the layer's output projection: a model that gives neither
    (`kvjax.layer.attend(..., hidden=)`, `Geometry.out_proj`) is refused in one line naming what is missing."""
    from kvjax import layer
    from kvjax.policies import make_policy, resolve

    pol = policy(0.5, plus=True)
    assert make_policy("kvzip-plus", ratio=0.5, replay=dict(repeat_ids=REPEAT, continue_ids=CONTINUE,
                                                            suffix_ids=SUFFIX, prefix=0)) == pol
    lp = resolve(pol, 1, 2).sized(16, 8).layers[0]
    cache = layer.init_layer_cache(lp, 1, 2, 8, jnp.float32)
    geom = layer.Geometry(layer=0, num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5)
    q, kv, pos, span = jnp.ones((1, 4, 4, 8)), jnp.ones((1, 2, 4, 8)), jnp.arange(8, 12)[None], jnp.asarray([[0, 0, 8]])
    for hidden, missing in ((None, "pass hidden"), (jnp.ones((1, 4, 64)), r"Geometry\.out_proj is None")):
        with pytest.raises(InvalidInput, match=missing) as e:
            layer.replay(geom, lp, cache, q, kv, kv, pos, span, plus=True, hidden=hidden)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("block", [8, 32, 7], ids=["3-blocks", "one-block", "whole"])
@pytest.mark.parametrize("plus", [False, True], ids=["kvzip", "plus"])
def test_replay_attention_is_prefix_attention_and_reconstruction_scores(plus, block):
    """`attention.replay_attention` (one set of logits, query blocks) against the two computations it fuses, the
    reference's `prefix_attention` (the replay's output) and `reconstruction_scores` (its slots' scores): 2 rows,
    24 queries in 3 blocks, in one, or whole (24 is no multiple of 7), padding queries, empty slots, a `log_w`
    bias, a slot hidden from some queries, KVzip+'s factors; a bfloat16 replay's output stays bfloat16."""
    import jax

    from kvjax import attention, reference

    b, kvh, g, t, c, d = 2, 2, 3, 24, 40, 8
    ks = jax.random.split(jax.random.key(0), 8)
    q = jax.random.normal(ks[0], (b, kvh * g, t, d))
    k, v = jax.random.normal(ks[1], (b, kvh, t, d)), jax.random.normal(ks[2], (b, kvh, t, d))
    cache_k, cache_v = jax.random.normal(ks[3], (b, kvh, c, d)), jax.random.normal(ks[4], (b, kvh, c, d))
    cache_pos = np.broadcast_to(np.arange(c), (b, kvh, c)).copy()
    cache_pos[0, 1, 5:9] = -1  # emptied slots
    cache_pos[1, :, -3:] = -1
    cache_pos = jnp.asarray(cache_pos)
    log_w = 0.3 * jax.random.normal(ks[5], (b, kvh, c))
    pos = np.broadcast_to(c + np.arange(t), (b, t)).copy()
    pos[0, 20:] = -1  # right padding
    pos = jnp.asarray(pos)
    visible = jnp.ones((b, kvh, t, c), bool).at[1, 0, :10, 12].set(False)
    span = jnp.asarray([[4, 10, 30], [2, 0, 20]])
    weights = None
    if plus:
        weights = (jax.random.uniform(ks[6], (b, t), minval=0.5, maxval=2.0),
                   jax.random.uniform(ks[7], (b, kvh, g, c), minval=0.5, maxval=2.0))
    out, scores = attention.replay_attention(q, k, v, pos, cache_k, cache_v, cache_pos, log_w, span, 0.3,
                                             slot_visible=visible, weights=weights, block=block)
    want, _ = reference.prefix_attention(q, k, v, pos, cache_k, cache_v, cache_pos, log_w, scale=0.3,
                                         slot_visible=visible)
    real = np.asarray(pos >= 0)[:, None, :, None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want, 0), rtol=2e-5, atol=2e-6)
    want_scores = attention.reconstruction_scores(q, k, pos, cache_k, cache_pos, span, 0.3, weights)
    np.testing.assert_allclose(scores, want_scores, rtol=2e-5, atol=1e-7)
    assert np.count_nonzero(np.asarray(scores)) > 20  # the chunks' slots are scored
    assert out.shape == q.shape and out.dtype == q.dtype
    half = [x.astype(jnp.bfloat16) for x in (q, k, v, cache_k, cache_v)]
    out16, _ = attention.replay_attention(*half[:3], pos, *half[3:], cache_pos, log_w, span, 0.3, block=block)
    assert out16.shape == q.shape and out16.dtype == jnp.bfloat16
