"""Decode-time policies (`Decoding`, R-KV, TriAttention) hold their budget in bytes through a long generation, compose
with a quantized cache and with another method's prompt compression, and are refused by name where they cannot run.
(Their rules are checked against kvpress and the reference codes in test_kvpress, test_rkv and test_triattention.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax import generate
from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput
from kvjax.models import load
from kvjax.models.tiny import make_random_checkpoint, tiny_config
from kvjax.policies import (AdaKV, Decoding, H2O, KNorm, Quantized, SnapKV, make_policy, recompress)
from kvjax.policies.triattention import calibrate, triattention

B, N = 48, 16


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A random model with 8K positions (2 layers, 2 KV heads of 16 dimensions)."""
    path = make_random_checkpoint(tmp_path_factory.mktemp("long"), tiny_config(max_position_embeddings=8320), seed=4,
                                  init_std=0.3)
    return load(path).model


def _policies(model):
    centres = calibrate(model, np.random.default_rng(0).integers(4, 200, 256).tolist())
    return {"decoding": Decoding(scorer=KNorm(budget=B), every=N),
            "rkv": make_policy("rkv", B, decode_slots=N),
            "triattention": triattention(B, centres, observation_window=8, decode_slots=N)}


@pytest.mark.parametrize("name", ["decoding", "rkv", "triattention"])
def test_decode_time_policies_hold_their_budget_in_bytes_through_an_8k_generation(long_model, name):
    """8192 tokens generated after a 32-token prompt (its bucket no larger than B: a prompt kept whole is held whole
    until the first compression): the cache's arrays are B + N slots per layer and KV head (by `nbytes`), 128 times
    fewer than the full cache's, and the slots hold the latest token."""
    policy = _policies(long_model)[name]
    prompt = np.random.default_rng(1).integers(4, 200, 32).tolist()
    gen = generate(long_model, [prompt], policy, max_new_tokens=8192, eos_ids=[])
    cfg = long_model.cfg
    kv = sum(x.nbytes for layer in gen.cache for x in (layer.k, layer.v))
    assert kv == cfg.num_layers * cfg.num_kv_heads * (B + N) * 2 * cfg.head_dim * 4  # float32 K and V
    kept = kept_sets(gen.cache)
    assert all(len(h) <= B + N and max(h) == 32 + 8192 - 2 for layer in kept for h in layer)  # the last fed token
    assert all(len(h) >= B for layer in kept for h in layer)


def test_decoding_composes_with_a_quantized_cache(long_model):
    """`Quantized(recompress(KNorm), bits=8)`: the same schedule on int8 codes, a quarter of the float32 bytes of K
    and V, and the kept positions (ranked by the dequantized keys' norms) mostly the float32 run's."""
    prompt = np.random.default_rng(2).integers(4, 200, 100).tolist()
    plain = generate(long_model, [prompt], recompress(KNorm(budget=B), N), max_new_tokens=60, eos_ids=[])
    quant = generate(long_model, [prompt], Quantized(recompress(KNorm(budget=B), N), bits=8), max_new_tokens=60,
                     eos_ids=[])
    size = lambda c: sum(x.nbytes for x in jax.tree.leaves(c))  # noqa: E731
    assert size(quant.cache) < 0.5 * size(plain.cache)
    a, b = kept_sets(plain.cache), kept_sets(quant.cache)
    same = [len(set(x) & set(y)) / len(x) for la, lb in zip(a, b) for x, y in zip(la, lb)]
    assert min(same) > 0.8 and all(len(x) == len(y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def test_prefill_by_snapkv_then_decode_by_triattention(long_model):
    """`Decoding(scorer=TriAttention, prompt=SnapKV(budget=P))`, P < B + N: the prompt's kept set is SnapKV's alone,
    the cache B + N slots, and once generation fills them TriAttention returns it to its budget B."""
    prompt = np.random.default_rng(3).integers(4, 200, 120).tolist()
    snap = SnapKV(budget=40, observation_window=8)
    tri = _policies(long_model)["triattention"]
    both = Decoding(scorer=tri.scorer, every=N, prompt=snap, when="full")
    assert both.capacity(0, 10_000, 128) == B + N
    alone = generate(long_model, [prompt], snap, max_new_tokens=1, eos_ids=[])
    first = generate(long_model, [prompt], both, max_new_tokens=1, eos_ids=[])
    assert kept_sets(first.cache) == kept_sets(alone.cache)  # the prompt as SnapKV keeps it
    later = generate(long_model, [prompt], both, max_new_tokens=40, eos_ids=[])
    assert all(B <= len(h) <= B + N for layer in kept_sets(later.cache) for h in layer)


def test_what_decoding_cannot_run_is_refused_by_name():
    snap = SnapKV(budget=32, observation_window=8)
    with pytest.raises(InvalidInput, match="scorer=AdaKV.* is not a prompt compressor"):
        Decoding(scorer=AdaKV(scorer=snap), every=8)
    with pytest.raises(InvalidInput, match="prompt=H2O.* is not a prompt compressor"):
        Decoding(scorer=snap, every=8, prompt=H2O(budget=32))
    with pytest.raises(InvalidInput, match="needs a token budget"):
        Decoding(scorer=KNorm(ratio=0.5), every=8)
    with pytest.raises(InvalidInput, match="when='sometimes'"):
        Decoding(scorer=snap, every=8, when="sometimes")
    with pytest.raises(InvalidInput, match="shorter than the scorer's observation_window=8"):
        Decoding(scorer=snap, every=4)


def test_a_whole_prompt_in_a_plan_sized_for_less_is_refused(long_model):
    """`Decoding(prompt=None)` keeps the prompt whole: a plan sized without its length (B + N slots) cannot hold a
    longer prompt, and is refused by name instead of keeping the prompt's first slots and overwriting slot 0."""
    import jax.numpy as jnp

    from kvjax import drive

    policy = Decoding(scorer=KNorm(budget=B), every=N)
    plan = drive.plan(long_model, policy).sized(256)  # prompt_len 0: B + N slots
    tokens = jnp.asarray(np.random.default_rng(5).integers(4, 200, (1, 128)), jnp.int32)
    with pytest.raises(InvalidInput, match="a prompt of 128 tokens .* in 64 slots"):
        drive.prompt(long_model, tokens, jnp.arange(128, dtype=jnp.int32)[None], plan)


def test_recompress_every_is_refused_for_a_method_with_its_own_schedule(tmp_path, capsys):
    """`--recompress-every` on R-KV (which compresses while decoding every --decode-slots tokens) would be ignored:
    it is refused naming the flag, and a bad schedule of its own names --decode-slots, not --recompress-every."""
    from kvjax.experiments import perplexity as ppl_cli
    from tests.test_reliability import one_error_line, run_cli

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} of line {i}." for i in range(200)))
    base = ["--text", str(text), "--lengths", "100", "--budget", "32", "--out", str(tmp_path / "o")]
    code, err = run_cli(ppl_cli.main, base + ["--compare", "rkv", "--recompress-every", "8"], capsys)
    assert code == 2 and "--recompress-every 8: it compresses while decoding on its own schedule" in one_error_line(err)
    code, err = run_cli(ppl_cli.main, base + ["--compare", "rkv", "--decode-slots", "4"], capsys)
    assert code == 2 and "--decode-slots 4" in one_error_line(err) and "recompress" not in err
