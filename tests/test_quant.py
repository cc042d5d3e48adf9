"""The quantized cache (`kvjax.quant`) against a NumPy transcription of KIVI's scheme and of int8 per token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvcache
from kvjax import layer, quant
from kvjax.errors import InvalidInput
from kvjax.policies import FullCache, GateEviction, Quantized, SnapKV, StreamingLLM, by_layer, resolve
from kvjax.quant import KVQuant
from tests.conftest import compile_log, random_ids
from kvjax import drive

# ---- NumPy transcription (KIVI, Liu et al. 2024, sec. 3-4; int8: absmax per token) ----------------------


def np_asym(x, bits, axis):
    """KIVI's asymmetric fake quantization of `x` reduced over `axis`: (codes, dequantized), float32."""
    x = x.astype(np.float32)
    mn, mx = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = ((mx - mn) / np.float32(2 ** bits - 1)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.round(np.clip((x - mn) / safe, 0, 2 ** bits - 1))
    return codes.astype(np.uint8), (codes * scale + mn).astype(np.float32)


def np_kivi_keys(k, bits, group):
    """Keys `[t, d]` per channel over consecutive groups of `group` tokens."""
    out = np.empty_like(k, dtype=np.float32)
    for s in range(0, len(k), group):
        out[s:s + group] = np_asym(k[s:s + group], bits, axis=0)[1]
    return out


def np_kivi_values(v, bits, group):
    """Values `[t, d]` per token over groups of `group` channels."""
    t, d = v.shape
    return np_asym(v.reshape(t, d // group, group), bits, axis=2)[1].reshape(t, d)


def np_int8(x):
    scale = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    return (np.clip(np.round(x / np.where(scale > 0, scale, 1)), -127, 127) * scale).astype(np.float32)


def np_attention(q, k, v, scale):
    """One query per query head `[h, d]` over `[kvh, t, d]` keys and values, grouped query heads."""
    h, kvh = q.shape[0], k.shape[0]
    kk, vv = np.repeat(k, h // kvh, axis=0), np.repeat(v, h // kvh, axis=0)
    logits = np.einsum("hd,htd->ht", q.astype(np.float64), kk) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("ht,htd->hd", p / p.sum(-1, keepdims=True), vv)


def rand(*shape, seed=0):
    x = np.random.RandomState(seed).randn(*shape).astype(np.float32)
    x[..., 3] *= 8  # an outlier channel, the case KIVI's per-channel keys are for
    return x


# ---- codes ---------------------------------------------------------------------------------------------


def test_packing_is_little_end_first_by_hand():
    codes = jnp.asarray([[1, 2, 3, 0, 3, 3, 3, 3]], jnp.uint8)
    assert quant.pack(codes, 2).tolist() == [[1 + (2 << 2) + (3 << 4), 255]]
    assert quant.pack(jnp.asarray([[5, 12]], jnp.uint8), 4).tolist() == [[5 + (12 << 4)]]
    x = jnp.asarray(np.random.RandomState(1).randint(0, 4, (3, 16)), jnp.uint8)
    assert (quant.unpack(quant.pack(x, 2), 2) == x).all()


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_codes_equal_the_numpy_transcription(bits):
    b, h, c, d, g = 2, 2, 24, 16, 8
    x = rand(b, h, c, d)
    valid = jnp.ones((b, h, c), bool)
    kc, ks, kz = quant.quantize_keys(jnp.asarray(x), valid, bits, g, jnp.float32)
    vc, vs, vz = quant.quantize_values(jnp.asarray(x), bits, g, jnp.float32)
    k = quant.dequantize_keys(kc, ks, kz, bits, g, jnp.float32)
    v = quant.dequantize_values(vc, vs, vz, bits, g, jnp.float32)
    for i in range(b):
        for j in range(h):
            np.testing.assert_allclose(k[i, j], np_kivi_keys(x[i, j], bits, g), rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(v[i, j], np_kivi_values(x[i, j], bits, g), rtol=1e-6, atol=1e-5)
            codes = np_asym(x[i, j].reshape(c, d // g, g), bits, axis=2)[0].reshape(c, d)
            np.testing.assert_array_equal(quant.unpack(vc, bits)[i, j], codes)
    # the round trip is within half a step of each group's scale, and a 2-bit key keeps the outlier channel
    step = np.repeat(np.asarray(ks), g, axis=2)
    assert np.all(np.abs(np.asarray(k) - x) <= step / 2 + 1e-6)
    assert kc.shape == (b, h, c, d * bits // 8) and kc.dtype == jnp.uint8 and ks.shape == (b, h, c // g, d)


def test_key_groups_ignore_empty_slots():
    x = rand(1, 1, 8, 8)
    valid = jnp.asarray([[[True] * 5 + [False] * 3]])
    garbage = x.copy()
    garbage[:, :, 5:] = 1e4  # what an empty slot holds must not widen its group's range
    kc, ks, kz = quant.quantize_keys(jnp.asarray(garbage), valid, 2, 8, jnp.float32)
    k = quant.dequantize_keys(kc, ks, kz, 2, 8, jnp.float32)
    np.testing.assert_allclose(k[0, 0, :5], np_kivi_keys(x[0, 0, :5], 2, 8), rtol=1e-6, atol=1e-5)


def test_int8_equals_the_numpy_transcription():
    x = rand(2, 3, 10, 16)
    c, s = quant.quantize_int8(jnp.asarray(x), jnp.float32)
    assert c.dtype == jnp.int8
    np.testing.assert_allclose(quant.dequantize_int8(c, s, jnp.float32), np_int8(x), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("spec", [KVQuant(8), KVQuant(4, 8, 4), KVQuant(2, 4, 0)])
def test_storing_a_view_again_changes_no_code(spec):
    """Why every slot can be requantized on every call: quantizing dequantized values gives the same codes (the
    scales to a rounding of float32)."""
    lc = kvcache.LayerCache(k=jnp.asarray(rand(1, 2, 16, 16)), v=jnp.asarray(rand(1, 2, 16, 16, seed=1)),
                            pos=jnp.broadcast_to(jnp.arange(16), (1, 2, 16)).astype(jnp.int32),
                            log_w=jnp.zeros((1, 2, 16)))
    once = quant.store(spec, lc, jnp.asarray([15]))
    again = quant.store(spec, quant.view(once), jnp.asarray([15]))
    for name in ("k_codes", "v_codes", "pos", "res_k", "res_pos"):
        np.testing.assert_array_equal(getattr(once, name), getattr(again, name))
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        if getattr(once, name) is not None:
            np.testing.assert_allclose(getattr(once, name), getattr(again, name), rtol=1e-6)


# ---- through a layer -------------------------------------------------------------------------------------


def _decode_all(spec, t, *, kvh=2, h=4, d=16):
    """`t` tokens decoded one by one through a FullCache layer stored under `spec` (no RoPE): the last output,
    the final cache and the inputs."""
    geom = layer.Geometry(layer=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5)
    plan = resolve(Quantized(FullCache(), spec.bits, spec.group, spec.residual), 1, kvh).sized(t).layers[0]
    q, k, v = rand(t, h, d, seed=2), rand(t, kvh, d, seed=3), rand(t, kvh, d, seed=4)
    step = jax.jit(lambda c, q, k, v, p: layer.decode(geom, plan, c, q, k, v, p))
    cache = layer.init_layer_cache(plan, 1, kvh, d, jnp.float32)
    for i in range(t):
        o, cache = step(cache, q[i][None], k[i][None], v[i][None], jnp.asarray([i], jnp.int32))
    return o[0], cache, (q, k, v), geom


@pytest.mark.parametrize("spec", [KVQuant(2, 4, 8), KVQuant(4, 8, 8), KVQuant(8, None, 4)])
def test_appending_stores_kivis_codes_and_attention_reads_them(spec):
    """A cache that only appends (the full cache, SnapKV & co after the prompt) holds exactly KIVI's
    dequantized keys and values for tokens out of the residual, full precision for the R recent ones; the
    last token's attention equals NumPy attention over them (1e-5, float32)."""
    t, r = 26, spec.residual
    o, cache, (q, k, v), geom = _decode_all(spec, t)
    old = t - r - (t - r) % (spec.group or 1)  # keys: whole groups whose tokens all left the residual
    ks, vs = np.empty_like(k.transpose(1, 0, 2)), np.empty_like(v.transpose(1, 0, 2))
    for j in range(k.shape[1]):
        if spec.kivi:
            ks[j], vs[j] = np_kivi_keys(k[:, j], spec.bits, spec.group), np_kivi_values(v[:, j], spec.bits, spec.group)
        else:
            ks[j], vs[j] = np_int8(k[:, j]), np_int8(v[:, j])
        ks[j, t - r:], vs[j, t - r:] = k[t - r:, j], v[t - r:, j]  # the residual
    seen = quant.view(cache)
    np.testing.assert_allclose(seen.k[0, :, :old], ks[:, :old], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(seen.k[0, :, t - r:], ks[:, t - r:], atol=0)
    np.testing.assert_allclose(seen.v[0], vs, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(o, np_attention(q[-1], ks, vs, geom.scale), atol=1e-5)
    assert not np.allclose(ks[:, :old], k.transpose(1, 0, 2)[:, :old], atol=1e-3)  # it is quantized


# ---- decoding from the codes (kvjax.layer._decode_codes) ---------------------------------------------------


def _decode_both(policy, t: int, steps: int, *, kvh=2, h=4, d=16):
    """A `t`-token prompt through `policy` (quantized), then `steps` decoded tokens, once reading the codes block by
    block and once reading the cache as a view (the rule and reference attention on the dequantized cache):
    per path, the outputs `[steps, h, d]` and the caches after every step."""
    geom = layer.Geometry(layer=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5)
    plan = resolve(policy, 1, kvh).sized(t + steps, t).layers[0]
    prompt = [jnp.asarray(rand(1, n, t, d, seed=i)) for i, n in enumerate((h, kvh, kvh))]
    _, first = layer.prefill(geom, plan, layer.init_layer_cache(plan, 1, kvh, d, jnp.float32), *prompt,
                             jnp.arange(t)[None])
    tokens = [(rand(1, h, d, seed=10 + i), rand(1, kvh, d, seed=50 + i) * (1 + i % 3), rand(1, kvh, d, seed=90 + i))
              for i in range(steps)]
    runs = {}
    for path in ("codes", "view"):
        reads = layer._reads_codes if path == "codes" else (lambda geom, plan: False)
        step = jax.jit(lambda c, q, k, v, pos, reads=reads: _with_reader(reads, geom, plan, c, q, k, v, pos))
        cache, outs, caches = first, [], []
        for i, (q, k, v) in enumerate(tokens):
            o, cache = step(cache, q, k, v, jnp.asarray([t + i], jnp.int32))
            outs.append(np.asarray(o[0]))
            caches.append(cache)
        runs[path] = (np.stack(outs), caches)
    return runs


def _with_reader(reads, geom, plan, cache, q, k, v, pos):
    saved = layer._reads_codes
    layer._reads_codes = reads
    try:
        return layer.decode(geom, plan, cache, q, k, v, pos)
    finally:
        layer._reads_codes = saved


# int8 with a residual and 2-bit KIVI with one run by default; int8 alone and 4-bit KIVI without a residual (the
# current token's full-precision read matters most there) under `pytest -m slow`: 15 s each on 2 cores
SPECS = [pytest.param(dict(bits=8), marks=pytest.mark.slow), dict(bits=8, residual=8),
         pytest.param(dict(bits=4, group=8), marks=pytest.mark.slow), dict(bits=2, group=4, residual=6)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_decoding_from_the_codes_equals_reading_the_view(spec):
    """Through the rules whose step only writes the new token, a decode step that reads the codes block by block
    gives the view path's outputs (to 1e-4 relative, float32: the sums run in another order, where a code off by one moves an output by 1e-2) and keeps the same
    positions. Appending (the full cache, SnapKV
    after its prompt): every step. Overwriting (StreamingLLM's ring, H2O): the first steps; later the view path
    drifts, as it re-derives every untouched group's scale from its own dequantized values each step (the codes
    path leaves them as they were quantized), which the last assertion of
    `test_decoding_from_the_codes_leaves_untouched_groups_as_they_were` pins down."""
    from kvjax.policies import H2O

    for base, exact in ((FullCache(), 20), (SnapKV(budget=20, observation_window=4), 20),
                        (StreamingLLM(budget=24, sinks=2), 3), (H2O(budget=24), 3)):
        runs = _decode_both(Quantized(base, **spec), 40, 20)
        (codes, c_caches), (view, v_caches) = runs["codes"], runs["view"]
        np.testing.assert_allclose(codes[:exact], view[:exact], rtol=1e-4, atol=5e-5, err_msg=base.describe())
        for a, b in zip(c_caches, v_caches):
            np.testing.assert_array_equal(a.pos, b.pos)


def test_decoding_from_the_codes_leaves_untouched_groups_as_they_were():
    """KIVI quantizes a key group when a token is written into it: after a ring step, the key groups the new token
    did not enter hold the same codes and scales, bit for bit; the group it entered holds its members' codes
    requantized with the new key (the NumPy transcription of KIVI's per-channel scheme over that group)."""
    spec = dict(bits=4, group=8)
    runs = _decode_both(Quantized(StreamingLLM(budget=24, sinks=2), **spec), 40, 6)
    caches = runs["codes"][1]
    for before, after in zip(caches, caches[1:]):
        slot = int(np.flatnonzero(np.asarray(before.pos[0, 0]) != np.asarray(after.pos[0, 0]))[0])
        g = slot // 8
        groups = np.arange(before.k_scale.shape[2]) != g
        np.testing.assert_array_equal(np.asarray(before.k_scale)[:, :, groups], np.asarray(after.k_scale)[:, :, groups])
        slots = np.arange(before.pos.shape[2]) // 8 != g
        np.testing.assert_array_equal(np.asarray(before.k_codes)[:, :, slots], np.asarray(after.k_codes)[:, :, slots])
        members = quant.view(after).k[0, 0, g * 8:(g + 1) * 8]
        np.testing.assert_allclose(members, np_kivi_keys(np.asarray(members), 4, 8), rtol=1e-6, atol=1e-6)
    view_caches = runs["view"][1]
    assert not np.array_equal(np.asarray(view_caches[-1].k_scale), np.asarray(caches[-1].k_scale))  # the drift


def test_decoding_from_the_codes_holds_no_dequantized_cache():
    """The compiled decode step over a 4096-slot KIVI cache has no float buffer of the cache's keys or values
    (`[b, kvh, C, d]`): the rule's placeholders are dropped by XLA and attention dequantizes 512 slots at a time.
    Read as a view, the same step holds several."""
    kvh, h, d = 2, 4, 16
    geom = layer.Geometry(layer=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5)
    plan = resolve(Quantized(FullCache(), 4, 8, 128), 1, kvh).sized(4096, 4088).layers[0]
    cache = layer.init_layer_cache(plan, 1, kvh, d, jnp.float32)
    whole = f"f32[1,{kvh},{cache.capacity},{d}]"
    args = (cache, jnp.zeros((1, h, d)), jnp.zeros((1, kvh, d)), jnp.zeros((1, kvh, d)), jnp.asarray([10]))
    held = {}
    for path, reads in (("codes", layer._reads_codes), ("view", lambda geom, plan: False)):
        fn = jax.jit(lambda c, q, k, v, p, reads=reads: _with_reader(reads, geom, plan, c, q, k, v, p))
        held[path] = fn.lower(*args).compile().as_text().count(whole)
    assert held["codes"] == 0 and held["view"] > 0, held


def test_bytes_by_formula():
    """Codes, scales, zeros, positions, scores, biases and the residual, counted by hand."""
    b, kvh, c, d, g, r = 1, 2, 64, 32, 16, 16
    f = 4  # float32 scales
    meta = 2 * b * kvh * c * 4  # pos (int32), log_w (float32); no rule state
    residual = 2 * b * kvh * r * d * f + b * kvh * r * 4
    two = quant.empty(KVQuant(2, g, r), b, kvh, c, d, jnp.float32)
    assert two.nbytes == (2 * b * kvh * c * d // 4  # codes, 4 per byte, keys and values
                          + 2 * b * kvh * (c // g) * d * f  # key scale + zero, per channel per group of slots
                          + 2 * b * kvh * c * (d // g) * f  # value scale + zero, per token per group of channels
                          + meta + residual)
    four = quant.empty(KVQuant(4, g, 0), b, kvh, c, d, jnp.float32)
    assert four.nbytes == 2 * b * kvh * c * d // 2 + 2 * b * kvh * (c // g) * d * f + 2 * b * kvh * c * (d // g) * f + meta
    eight = quant.empty(KVQuant(8), b, kvh, c, d, jnp.bfloat16)
    assert eight.nbytes == 2 * b * kvh * c * d + 2 * b * kvh * c * 2 + meta
    full = kvcache.empty(b, kvh, c, d, jnp.float32)
    assert full.nbytes == 2 * b * kvh * c * d * f + meta
    for spec, cache in ((KVQuant(2, g, r), two), (KVQuant(4, g, 0), four)):
        per_slot = spec.bytes_per_slot(d, f) * b * kvh * c
        assert cache.nbytes - meta - (residual if spec.residual else 0) == per_slot


# ---- the contract, the CLI -----------------------------------------------------------------------------


def test_refusals():
    with pytest.raises(InvalidInput, match="bits=3"):
        Quantized(FullCache(), bits=3)
    with pytest.raises(InvalidInput, match="group=4 does not apply"):
        Quantized(FullCache(), bits=8, group=4)
    with pytest.raises(InvalidInput, match="needs a group size"):
        Quantized(FullCache(), bits=2)
    with pytest.raises(InvalidInput, match="shrink"):
        Quantized(GateEviction(), bits=8)
    with pytest.raises(InvalidInput, match="inside a combinator"):
        resolve(by_layer(FullCache(), Quantized(StreamingLLM(budget=8), bits=8), 1), 2, 2)
    with pytest.raises(InvalidInput, match="divide the head size 12"):
        quant.empty(KVQuant(2, 8), 1, 1, 4, 12, jnp.float32)
    plan = resolve(Quantized(StreamingLLM(budget=8), 4, 8, 2), 2, 2).sized(64)
    assert "stored quantized (bits=4, group=8, residual=2)" in plan.describe()


def test_cli_flags_are_part_of_the_policy(tmp_path):
    import argparse

    from kvjax.experiments.common import add_policy_args, policies_from_args

    p = argparse.ArgumentParser()
    add_policy_args(p)
    parse = lambda *a: policies_from_args(p.parse_args(list(a)), ["streaming", "snapkv"])  # noqa: E731
    two = parse("--kv-bits", "2")
    assert [x.describe().endswith("bits=2, group=32, residual=128)") for x in two] == [True, True]
    assert parse("--kv-bits", "8", "--kv-residual", "16")[0].kv_quant == KVQuant(8, None, 16)
    with pytest.raises(InvalidInput, match="--kv-group 8 without --kv-bits"):
        parse("--kv-group", "8")
    with pytest.raises(InvalidInput, match="--kv-group 16 with --kv-bits 8"):
        parse("--kv-bits", "8", "--kv-group", "16")


# ---- a model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    from kvjax import models

    return models.load_default()


@pytest.mark.slow
def test_small_model_perplexity_and_bytes(small):
    """The default model reading 256 tokens of text token by token: int8 and 4-bit cost < 1 % perplexity, 2-bit with
    a residual of 128 (KIVI's setting) a few %; the cache is as small as the formula says."""
    from kvjax.experiments.common import default_text
    from kvjax.scoring import perplexity

    ids = small.tokenizer.encode(default_text())[:256]
    full = perplexity(small.model, ids, FullCache(prefill_mode="stream"))
    g = min(32, small.config.head_dim)
    ppl = {bits: perplexity(small.model, ids, Quantized(FullCache(prefill_mode="stream"), bits, None if bits == 8 else g,
                                                          0 if bits == 8 else 128)) for bits in (8, 4, 2)}
    assert abs(ppl[8] / full - 1) < 0.01 and abs(ppl[4] / full - 1) < 0.02
    assert 1 < ppl[2] / full < 1.1
    no_residual = perplexity(small.model, ids, Quantized(FullCache(prefill_mode="stream"), 2, g, 0))
    assert no_residual > ppl[2]  # the residual is what keeps 2 bits close


def test_compressed_and_quantized_generation_compiles_once(small):
    """Quantized(SnapKV) through generate: a second prompt of the same bucket compiles nothing; its cache holds
    the policy's slots in fewer bytes."""
    from kvjax.generate import generate

    policy = Quantized(SnapKV(budget=32), 2, min(32, small.config.head_dim), 16)
    vocab = small.config.vocab_size
    with compile_log() as first:
        generate(small.model, [random_ids(90, vocab, seed=1)], policy, max_new_tokens=6, eos_ids=())
    with compile_log() as second:
        g = generate(small.model, [random_ids(100, vocab, seed=2)], policy, max_new_tokens=6, eos_ids=())
    assert len(first) >= 2 and second == [] and g.lengths.tolist() == [6]
    plain = drive.empty_cache(small.model, drive.plan(small.model, SnapKV(budget=32), 134, 128), 1)
    packed = drive.empty_cache(small.model, drive.plan(small.model, policy, 134, 128), 1)
    assert kvcache.kept_positions(plain)[0].shape == kvcache.kept_positions(packed)[0].shape
    for a, b in zip(plain, packed):  # 2-bit codes of float32 keys and values: a 16th of their bytes
        assert b.k_codes.nbytes * 16 == a.k.nbytes and b.v_codes.nbytes * 16 == a.v.nbytes
    assert kvcache.nbytes(packed) < kvcache.nbytes(plain)


@pytest.mark.slow
def test_a_residual_larger_than_fits_runs_as_the_largest_that_fits_chunked_or_streamed(small):
    """LocalWindow(32) holds 32 slots: a residual of 64 would hold them all in full precision beside their codes, a
    "compressed" cache larger than the unquantized one (issue 61). It is cut to the most that fits
    (`KVQuant.largest_residual`), so scoring a text in chunks or token by token gives exactly the numbers of that
    residual, closer to the unquantized cache than with R = 0."""
    from kvjax.experiments.common import default_text
    from kvjax.policies import LocalWindow
    from kvjax.scoring import logprobs

    ids = small.tokenizer.encode(default_text())[:160]
    g = min(32, small.config.head_dim)
    most = KVQuant(2, g, 64).largest_residual(32, small.config.head_dim, jnp.dtype(small.model.dtype).itemsize)
    assert 0 < most < 32
    for mode in (dict(prefill_mode="chunked", chunk=16), dict(prefill_mode="stream")):
        plain = logprobs(small.model, ids, LocalWindow(size=32, **mode))
        asked = logprobs(small.model, ids, Quantized(LocalWindow(size=32, **mode), 2, g, 64))
        np.testing.assert_array_equal(asked, logprobs(small.model, ids, Quantized(LocalWindow(size=32, **mode), 2, g,
                                                                                   most)))
        bare = logprobs(small.model, ids, Quantized(LocalWindow(size=32, **mode), 2, g, 0))
        assert np.abs(bare - plain).max() > 1e-2
        assert np.abs(asked - plain).mean() < np.abs(bare - plain).mean()


@pytest.mark.slow
def test_a_prompt_compressed_whole_keeps_the_same_tokens_quantized(small):
    """Whole-prompt compression scores the prompt's own (full-precision) attention and keys, so every policy
    keeps the same positions per layer and KV head with a quantized cache; only their bytes differ. Head splits
    (DuoAttention-style `by_head`) and per-layer rules (PyramidKV) included."""
    from kvjax import engine
    from kvjax.policies import AdaKV, KeyDiff, LocalWindow, PyramidKV, by_head
    from tests.conftest import left_pad

    with pytest.raises(InvalidInput, match="share one pool of slots"):  # AdaKV's pool is not stored as codes
        drive.plan(small.model, Quantized(AdaKV(scorer=SnapKV(budget=48)), 2, 32, 16))

    cfg = small.config
    ids = random_ids(200, cfg.vocab_size, seed=5)
    tokens, positions = left_pad(ids, 256)
    split = by_head([[h % 2 == 0 for h in range(cfg.num_kv_heads)]] * cfg.num_layers, FullCache(), LocalWindow(size=16))
    for policy in (PyramidKV(budget=48, observation_window=8, beta=2, num_layers=cfg.num_layers), KeyDiff(budget=48),
                   split):
        plain = engine.prefill(small.model, tokens, positions, plan=drive.plan(small.model, policy, 264, 256))[1]
        q = Quantized(policy, 2, min(32, cfg.head_dim), 16)
        packed = engine.prefill(small.model, tokens, positions, plan=drive.plan(small.model, q, 264, 256))[1]
        for a, b in zip(kvcache.kept_positions(plain), kvcache.kept_positions(packed)):
            np.testing.assert_array_equal(a, b)
        assert kvcache.nbytes(packed) < kvcache.nbytes(plain)
