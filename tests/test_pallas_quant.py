"""The Pallas kernel that decodes from a quantized cache's codes (`kvjax.pallas.quant_decode`, run in interpret
mode) against its specification, `kvjax.quant.attend`, which tests/test_quant.py checks against the view path
and a NumPy transcription of KIVI."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import quant
from kvjax.errors import InvalidInput
from kvjax.cache import LayerCache
from kvjax.pallas import quant_decode
from kvjax.quant import KVQuant


def _cache(spec: KVQuant, b, kvh, c, d, seed):
    """A quantized cache with empty slots anywhere, a logit bias on some slots, and each row's newest position
    in one slot per head (the token a rule just placed, read in full precision)."""
    rng = np.random.default_rng(seed)
    k, v = (rng.normal(size=(b, kvh, c, d)).astype(np.float32) for _ in range(2))
    k[..., 3] *= 8  # an outlier channel
    pos = np.stack([np.stack([rng.permutation(c) for _ in range(kvh)]) for _ in range(b)]).astype(np.int32)
    pos[rng.random((b, kvh, c)) < 0.25] = -1
    pos[:, :, 0] = np.arange(b)[:, None] + c  # the newest token: beyond every other position
    log_w = np.where(rng.random((b, kvh, c)) < 0.1, np.log(3.0), 0.0).astype(np.float32)
    lc = LayerCache(k=jnp.asarray(k), v=jnp.asarray(v), pos=jnp.asarray(pos), log_w=jnp.asarray(log_w))
    newest = jnp.asarray(np.arange(b) + c, jnp.int32)
    current = tuple(jnp.asarray(rng.normal(size=(b, kvh, d)), jnp.float32) for _ in range(2))
    return quant.store(spec, lc, newest), newest, current


SPECS = [KVQuant(8), KVQuant(8, residual=8), KVQuant(4, group=8), KVQuant(2, group=4, residual=6),
         KVQuant(4, group=16, residual=16)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", ""))
@pytest.mark.parametrize("g", [1, 3])
def test_kernel_equals_the_blockwise_reference(spec, g):
    """Output, per-slot probabilities (H2O's statistic) and the first position's logit (MAT's) of the kernel
    equal `quant.attend`'s on the same cache, to 1e-5 in float32, with slots read from the residual and the
    current token, empty slots, compensation biases, and a slot count no tile size divides."""
    b, kvh, c, d = 2, 2, 75, 16
    qc, newest, current = _cache(spec, b, kvh, c, d, seed=g)
    q = jnp.asarray(np.random.default_rng(9).normal(size=(b, kvh * g, d)), jnp.float32)
    want = quant.attend(q, qc, newest, current, scale=d ** -0.5, probs=True, first_logit=True)
    got = quant_decode.attend(q, qc, newest, current, scale=d ** -0.5, probs=True, first_logit=True, interpret=True,
                              splits=3)
    for name, a, w in zip(("output", "probs", "first_logit"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=name)
    out, none_p, none_f = quant_decode.attend(q, qc, newest, current, scale=d ** -0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want[0]), atol=1e-5, rtol=1e-5)
    assert none_p is None and none_f is None


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", ""))
def test_tpu_variant_equals_the_blockwise_reference(spec):
    """The TPU variant (tiles of lcm(128, G) slots, key scales laid out tile by tile, interpreted by the TPU
    interpreter) against `quant.attend`, on a slot count that leaves a partial last tile."""
    b, kvh, c, d, g = 2, 2, 300, 16, 3
    qc, newest, current = _cache(spec, b, kvh, c, d, seed=4)
    q = jnp.asarray(np.random.default_rng(8).normal(size=(b, kvh * g, d)), jnp.float32)
    want = quant.attend(q, qc, newest, current, scale=d ** -0.5, probs=True, first_logit=True)
    got = quant_decode.attend(q, qc, newest, current, scale=d ** -0.5, probs=True, first_logit=True, variant="tpu",
                              interpret=True)
    for name, a, w in zip(("output", "probs", "first_logit"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=name)


def test_supported_tiles():
    """Triton's tiles are powers of two >= 16: int8 at head size 64, KIVI 2-bit at 64 (16-column planes) with
    G = 32 qualify; 2-bit at head size 32 (8-column planes) or G = 24 do not; a value group that is not whole
    plane columns (G = 2 at 2 bits) never does, even interpreted."""
    def qc(spec, d):
        return quant.empty(spec, 1, 1, 64, d, jnp.float32)

    assert quant_decode.supported(qc(KVQuant(8), 64), 64)
    assert quant_decode.supported(qc(KVQuant(2, group=32, residual=32), 64), 64)
    assert not quant_decode.supported(qc(KVQuant(2, group=32), 32), 32)
    assert not quant_decode.supported(qc(KVQuant(2, group=8), 64), 64)
    # (a value group narrower than a byte's codes, G = 2 at 2 bits, would make the cache larger than 16-bit: such a
    # cache is refused before any kernel sees it, issue 61)
    with pytest.raises(InvalidInput, match="takes more bytes quantized"):
        qc(KVQuant(2, group=2), 64)
    with pytest.raises(ValueError, match="powers of two"):
        quant_decode.attend(jnp.zeros((1, 1, 32)), qc(KVQuant(2, group=32), 32), jnp.asarray([0]),
                            (jnp.zeros((1, 1, 32)), jnp.zeros((1, 1, 32))), scale=1.0)


def test_a_layer_under_attention_impl_pallas_decodes_quantized_caches_with_the_kernel(monkeypatch):
    """`kvjax.layer.decode` with `impl="pallas"` sends a quantized cache's decode steps to the kernel (counted, through
    `kvjax.attention`, the one place that dispatches to kernels) and
    gives the reference path's outputs and kept positions, through H2O (whose eviction reads the kernel's
    per-slot probabilities) and the full cache, over 2-bit KIVI with a residual."""
    import dataclasses

    import jax

    from kvjax import layer
    from kvjax.policies import H2O, FullCache, Quantized, resolve

    calls = []
    real = quant_decode.attend
    monkeypatch.setattr(quant_decode, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    kvh, h, d, t = 2, 4, 16, 24
    rng = np.random.default_rng(4)
    prompt = [jnp.asarray(rng.normal(size=(1, n, t, d)), jnp.float32) for n in (h, kvh, kvh)]
    steps = [[jnp.asarray(rng.normal(size=(1, n, d)), jnp.float32) for n in (h, kvh, kvh)] for _ in range(6)]
    for base in (FullCache(), H2O(budget=20, recent=4)):
        plan = resolve(Quantized(base, bits=2, group=4, residual=4), 1, kvh).sized(t + 6, t).layers[0]
        outs = {}
        for impl in ("xla", "pallas"):
            geom = layer.Geometry(layer=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5, impl=impl)
            _, cache = layer.prefill(dataclasses.replace(geom, impl="xla"), plan,
                                     layer.init_layer_cache(plan, 1, kvh, d, jnp.float32), *prompt, jnp.arange(t)[None])
            step = jax.jit(lambda c, q, k, v, p, geom=geom, plan=plan: layer.decode(geom, plan, c, q, k, v, p))
            got = []
            for i, (q, k, v) in enumerate(steps):
                o, cache = step(cache, q, k, v, jnp.asarray([t + i], jnp.int32))
                got.append(np.asarray(o))
            outs[impl] = (np.stack(got), np.asarray(cache.pos))
        np.testing.assert_allclose(outs["pallas"][0], outs["xla"][0], atol=1e-5, rtol=1e-5, err_msg=base.describe())
        np.testing.assert_array_equal(outs["pallas"][1], outs["xla"][1])
    assert calls, "the kernel was never called"


def test_the_kernel_path_compiles_once_per_cache_shape():
    """Positions, the newest position and the cache's contents are arrays: a second cache of the same shape and
    width, at other positions, compiles nothing."""
    from tests.conftest import compile_log

    spec, d = KVQuant(2, group=4, residual=6), 16
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, d)), jnp.float32)
    qc, newest, current = _cache(spec, 2, 2, 40, d, seed=1)
    quant_decode.attend(q, qc, newest, current, scale=0.25, probs=True, interpret=True)[0].block_until_ready()
    qc2, _, current2 = _cache(spec, 2, 2, 40, d, seed=2)
    later = jnp.asarray([47, 48], jnp.int32)
    with compile_log() as compiles:
        quant_decode.attend(q, qc2, later, current2, scale=0.25, probs=True, interpret=True)[0].block_until_ready()
    assert compiles == []


GPU_SPECS = [KVQuant(8), KVQuant(8, residual=32), KVQuant(4, group=32), KVQuant(4, group=32, residual=64),
             KVQuant(2, group=32, residual=32), KVQuant(2, group=16)]


@pytest.mark.skipif(__import__("jax").default_backend() != "gpu", reason="compiles the kernel with Triton: a GPU")
@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.describe().replace(" ", ""))
@pytest.mark.parametrize("d", [64, 128])
def test_compiled_kernel_equals_the_blockwise_reference_on_a_gpu(spec, d):
    """Triton-compiled (not interpreted): output, per-slot probabilities and first logit equal `quant.attend`'s at
    head sizes 64 and 128 (SmolLM2's, Llama's), GQA 3, with residual, empty slots and a slot count no tile divides.
    Both sides in float32 with full-precision matmuls (no TF32), so 1e-4 bounds summation order only."""
    import jax

    b, kvh, c, g = 2, 2, 1000, 3
    qc, newest, current = _cache(spec, b, kvh, c, d, seed=d)
    q = jnp.asarray(np.random.default_rng(9).normal(size=(b, kvh * g, d)), jnp.float32)
    assert quant_decode.supported(qc, d)
    with jax.default_matmul_precision("highest"):
        want = quant.attend(q, qc, newest, current, scale=d ** -0.5, probs=True, first_logit=True)
        got = quant_decode.attend(q, qc, newest, current, scale=d ** -0.5, probs=True, first_logit=True)
    for name, a, w in zip(("output", "probs", "first_logit"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-4, rtol=1e-4, err_msg=name)
