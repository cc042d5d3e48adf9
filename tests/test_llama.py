"""Logit parity with transformers' PyTorch Llama, and the cache/forward consistency."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import FullCache, StreamingLLM
from kvjax.models import load
from tests.conftest import hf_llama, random_ids, stepper
from kvjax import drive

torch = pytest.importorskip("torch")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16: wavelengths 6 .. 2e4, so all three llama3 bands (kept, smoothed, divided) occur.
    "original_max_position_embeddings": 64,
}


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["rope", "llama3"])
def test_logits_match_transformers(tmp_path, kv_heads, tied, rope):
    extra = {"rope_parameters": rope} if rope else {}
    pt, path = hf_llama(tmp_path, num_key_value_heads=kv_heads, tie_word_embeddings=tied, **extra)
    lm = load(path)
    assert lm.config.tie_word_embeddings == tied and lm.config.num_kv_heads == kv_heads
    assert lm.config.rope.rope_type == ("llama3" if rope else "default")
    ids = np.random.RandomState(1).randint(0, 97, (2, 150))
    ref = torch_logits(pt, ids)
    out = np.asarray(drive.logits(lm.model, jnp.asarray(ids)))
    assert np.abs(ref).max() > 0.5  # the comparison is not between near-zero logits
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_sharded_safetensors_and_pytorch_bin(tmp_path):
    pt, path = hf_llama(tmp_path / "ref")
    ids = np.random.RandomState(2).randint(0, 97, (1, 40))
    ref = torch_logits(pt, ids)

    pt.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    np.testing.assert_allclose(np.asarray(drive.logits(load(tmp_path / "sharded").model, jnp.asarray(ids))), ref, atol=1e-4)

    binary = tmp_path / "bin"
    pt.config.save_pretrained(binary)
    torch.save(pt.state_dict(), binary / "pytorch_model.bin")
    np.testing.assert_allclose(np.asarray(drive.logits(load(binary).model, jnp.asarray(ids))), ref, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.1), ("float16", 0.02)])
def test_half_precision_loading(tmp_path, dtype, tol):
    pt, path = hf_llama(tmp_path)
    lm = load(path, dtype=dtype)
    assert lm.model.layers[0].self_attn.q_proj.kernel.get_value().dtype == jnp.dtype(dtype)
    ids = np.random.RandomState(3).randint(0, 97, (1, 32))
    out = np.asarray(drive.logits(lm.model, jnp.asarray(ids)))
    ref = torch_logits(pt, ids)
    # Tolerance is the half-precision rounding of a 2-layer model, relative to the logit scale.
    assert np.all(np.isfinite(out))
    assert np.abs(out - ref).max() <= tol * np.abs(ref).max()


def test_prefill_then_decode_equals_full_forward(tiny):
    """FullCache: prefill logits + token-by-token decode logits == the full forward (batch, left padding)."""
    model = tiny.model
    seqs = [random_ids(48, 260, seed=4), random_ids(48, 260, seed=5)]
    prompt_lens = [20, 11]
    full = [np.asarray(drive.logits(model, jnp.asarray([s])))[0] for s in seqs]
    bucket = 32
    prefill, decode = stepper(model, FullCache(), max_len=bucket + 48)
    toks = np.zeros((2, bucket), np.int32)
    pos = np.full((2, bucket), -1, np.int32)
    for r, (s, n) in enumerate(zip(seqs, prompt_lens)):
        toks[r, bucket - n :] = s[:n]
        pos[r, bucket - n :] = np.arange(n)
    logits, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    for r, n in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(logits[r]), full[r][n - 1], atol=1e-5, rtol=0)
    for t in range(25):
        step_tok = jnp.asarray([s[n + t] for s, n in zip(seqs, prompt_lens)], jnp.int32)
        step_pos = jnp.asarray([n + t for n in prompt_lens], jnp.int32)
        logits, cache = decode(step_tok, step_pos, cache)
        for r, n in enumerate(prompt_lens):
            np.testing.assert_allclose(np.asarray(logits[r]), full[r][n + t], atol=1e-5, rtol=0)


def test_rolling_equals_absolute_without_eviction(tiny):
    """With nothing evicted, a slot's rank is its position: rolling mode changes nothing."""
    ids = random_ids(40, 260, seed=6)
    outs = []
    for mode in ("absolute", "rolling"):
        prefill, decode = stepper(tiny.model, StreamingLLM(budget=64, sinks=4, positions=mode), max_len=64)
        tok, pos = jnp.asarray([ids[:16]]), jnp.arange(16)[None]
        logits, cache = prefill(tok, pos)
        seq = [np.asarray(logits)]
        for t in range(16, 40):
            logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
            seq.append(np.asarray(logits))
        outs.append(np.concatenate(seq))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=0)
