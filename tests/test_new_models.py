"""Qwen3, Gemma 2 and Gemma 3 (text) against transformers' PyTorch models on tiny random configs:
full-forward and prefill + decode logits, greedy generation through `kvjax.experiments.generate`, and
Gemma 3 under a policy (global layers compressed, local layers a window ring, bytes by formula)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.experiments import generate as gen_cli
from kvjax import FullCache, StreamingLLM, generate, kept_positions
from kvjax.cache import nbytes
from kvjax.policies import SnapKV
from kvjax.models import load
from kvjax.models.tiny import byte_tokenizer
from tests.conftest import random_ids
from tests.test_models import decode_logits
from kvjax import drive

torch = pytest.importorskip("torch")

VOCAB = 260  # the byte tokenizer's, so kvjax.experiments.generate can run on these checkpoints
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3)


def hf_model(arch: str):
    """(transformers model class, config kwargs): sliding windows shorter than the test sequences."""
    import transformers as tf

    if arch == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**BASE, tie_word_embeddings=False)
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **BASE, sliding_window=8, query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"] * 2)
    return tf.Gemma3ForCausalLM, tf.models.gemma3.Gemma3TextConfig(
        **BASE, sliding_window=8, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "gemma3"])
def checkpoint(request, tmp_path_factory):
    cls, cfg = hf_model(request.param)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    # The eager attention is transformers' reference: its SDPA path drops Gemma 2's soft-capping.
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms start at 1 (Gemma: 0): make them matter
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return request.param, model, path


def test_logits_equal_transformers_full_and_decode(checkpoint):
    arch, pt, path = checkpoint
    lm = load(path)
    ids = random_ids(40, VOCAB, seed=30, low=4)
    with torch.no_grad():
        ref = pt(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(np.asarray(drive.logits(lm.model, jnp.asarray([ids])))[0], ref, atol=1e-4, rtol=0)
    ours, _ = decode_logits(lm.model, ids, 13, FullCache())
    np.testing.assert_allclose(ours, ref[12:], atol=1e-4, rtol=0)
    c = lm.config
    if arch == "qwen3":
        assert c.qk_norm and c.head_dim * c.num_heads != c.hidden_size
    else:
        assert c.window_of(0) == 8 and (c.window_of(1) is None) == (arch == "gemma2")
        assert (c.attn_softcap, c.final_softcap) == ((2.0, 3.0) if arch == "gemma2" else (None, None))
        assert (c.local_rope is not None) == (arch == "gemma3") and c.qk_norm == (arch == "gemma3")


def cli_and_transformers_greedy(pt, path, prompt: str, new: int, capsys) -> tuple[str, str]:
    """(text of `python -m kvjax.experiments.generate --policy full`, text of transformers' greedy `generate`)."""
    assert gen_cli.main(["--model", str(path), "--policy", "full", "--max-new-tokens", str(new), prompt]) == 0
    text = capsys.readouterr().out.split(f">>> {prompt}\n", 1)[1].split("\n\ncache")[0]
    tok = byte_tokenizer()
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        out = pt.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=2, pad_token_id=3)
    return text, tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_greedy_generation_through_the_cli_equals_transformers(checkpoint, capsys):
    _, pt, path = checkpoint
    ours, theirs = cli_and_transformers_greedy(pt, path, "Attention sinks and windows", 24, capsys)
    assert ours == theirs and len(ours) > 0


def test_gemma_windows_matter(checkpoint):
    """Guards the parity test: the same weights with every layer global give other logits."""
    arch, pt, path = checkpoint
    if arch == "qwen3":
        pytest.skip("no sliding layers")
    import dataclasses

    from flax import nnx

    from kvjax.models.llama import Llama

    lm = load(path)
    ids = jnp.asarray([random_ids(40, VOCAB, seed=31, low=4)])
    glob = Llama(dataclasses.replace(lm.config, layer_types=None, sliding_window=None), rngs=nnx.Rngs(0))
    nnx.update(glob, nnx.state(lm.model))
    assert np.abs(np.asarray(drive.logits(glob, ids)) - np.asarray(drive.logits(lm.model, ids)))[0, 8:].max() > 1e-3


def test_gemma3_policy_compresses_the_global_layers_only(checkpoint):
    arch, _, path = checkpoint
    if arch != "gemma3":
        pytest.skip("Gemma 3 only")
    lm = load(path)
    c = lm.config
    prompt, new = random_ids(50, VOCAB, seed=3, low=4), 6
    out = generate(lm.model, [prompt], StreamingLLM(budget=16, sinks=2), max_new_tokens=new)
    caps = [layer.capacity for layer in out.cache]
    assert caps == [8, 8, 16, 8]  # sliding layers: a W-slot ring; the global layer: the policy's budget
    kept = kept_positions(out.cache)
    total = len(prompt) + new - 1  # positions 0..total-1 have been written
    for i, layer in enumerate(kept):
        held = sorted(p for p in np.asarray(layer)[0, 0] if p >= 0)
        if c.window_of(i) is not None:
            assert held == list(range(total - 8, total))  # the window's latest tokens
        else:
            assert held == [0, 1] + list(range(total - 14, total))  # 2 sinks + 14 recent
    # Bytes: per layer k and v [b, kvh, C, d] in float32, plus pos (int32) and log_w (float32); rings keep no state.
    b, kvh, d = 1, c.num_kv_heads, c.head_dim
    assert nbytes(out.cache) == sum(b * kvh * cap * (2 * d * 4 + 2 * 4) for cap in caps)
    # A scored policy on Gemma 3: the same split, kept positions inspectable in both kinds of layer.
    snap = generate(lm.model, [prompt], SnapKV(budget=20, observation_window=4), max_new_tokens=new)
    assert [layer.capacity for layer in snap.cache] == [8, 8, 20 + snap.room, 8]  # budget + the new tokens' buffer
    assert drive.plan(lm.model, SnapKV(budget=20, observation_window=4)).policy.describe().startswith(
        "PerLayer(0-1: LocalWindow(size=8")


def test_gemma2_softcap_is_refused_by_the_kernels(checkpoint):
    arch, _, path = checkpoint
    if arch != "gemma2":
        pytest.skip("Gemma 2 only")
    lm = load(path, attention_impl="pallas")
    with pytest.raises(ValueError, match=r"kernels do not implement attention-logit soft-capping \(softcap=2.0"):
        drive.logits(lm.model, jnp.asarray([random_ids(8, VOCAB, low=4)]))


def test_gemma3_multimodal_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gemma3", "text_config": {}}')
    with pytest.raises(ValueError, match=r"Gemma 3's image-text checkpoint; kvjax loads the text models"):
        load(tmp_path)


def test_every_policy_family_and_find_heads_run_on_the_new_models(checkpoint):
    from kvjax.heads import head_scores, probe_tokens, select_retrieval
    from kvjax.policies import H2O, PyramidKV, RazorAttention, SlimKV, mat

    arch, _, path = checkpoint
    lm = load(path)
    c = lm.config
    scores = head_scores(lm.model, probe_tokens(VOCAB, k=40, repeats=2, bos_id=1, exclude=(2, 3)))
    assert scores.echo.shape == (c.num_layers, c.num_heads) and np.isfinite(scores.induction).all()
    _, kv_mask = select_retrieval(scores, c.num_kv_heads, induction_ratio=0.25, echo_ratio=0.1)
    prompt = random_ids(60, VOCAB, seed=4, low=4)
    for policy in (H2O(budget=24, recent=12), PyramidKV(budget=24, observation_window=4, num_layers=c.num_layers),
                   SlimKV(budget=24, observation_window=4), mat(24, 6, shallow_layers=1, sinks=2),
                   RazorAttention(retrieval=tuple(map(tuple, kv_mask.tolist())), compression=4, buffer=16, sinks=2)):
        out = generate(lm.model, [prompt, prompt[:40]], policy, max_new_tokens=5)
        assert out.tokens.shape == (2, 5) and all(np.asarray(layer).size for layer in kept_positions(out.cache))


@pytest.fixture(scope="module")
def phi3_checkpoint(tmp_path_factory):
    import transformers as tf

    half = 16 // 2  # Phi-3's head_dim is hidden_size // heads
    rng = np.random.default_rng(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": (1 + rng.random(half)).round(3).tolist(), "long_factor": (2 + 4 * rng.random(half)).round(3).tolist()}
    cfg = tf.Phi3Config(**{**BASE, "max_position_embeddings": 256, "head_dim": 16}, original_max_position_embeddings=64,
                        rope_parameters=rope, sliding_window=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("phi3")
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model, path


@pytest.mark.parametrize("length,prompt_len", [(40, 13), (100, 70)])
def test_phi3_fused_weights_and_longrope_equal_transformers(phi3_checkpoint, length, prompt_len):
    """Short sequences use LongRoPE's short factors; past original_max_position_embeddings=64 every
    call uses the long ones (a 70-token prefill, then decoding)."""
    pt, path = phi3_checkpoint
    lm = load(path)
    assert lm.config.rope.rope_type == "longrope" and lm.config.rope.attention_factor > 1
    ids = random_ids(length, VOCAB, seed=7, low=4)
    with torch.no_grad():
        ref = pt(torch.tensor([ids])).logits[0].float().numpy()
    np.testing.assert_allclose(np.asarray(drive.logits(lm.model, jnp.asarray([ids])))[0], ref, atol=1e-4, rtol=0)
    ours, _ = decode_logits(lm.model, ids, prompt_len, FullCache(), bucket=128)
    np.testing.assert_allclose(ours, ref[prompt_len - 1:], atol=1e-4, rtol=0)


def test_phi3_greedy_generation_equals_transformers(phi3_checkpoint, capsys):
    pt, path = phi3_checkpoint
    ours, theirs = cli_and_transformers_greedy(pt, path, "Fused projections", 20, capsys)
    assert ours == theirs and len(ours) > 0


@pytest.mark.slow  # a sharded Gemma 3 through a suite: 80 s on 2 cores
def test_gemma3_sharded_and_through_a_suite(tmp_path):
    """Tensor and data parallel on a Gemma 3 checkpoint equal one device (tests/mesh_script.py), and a
    suite (passkey) runs on it under a policy."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import transformers as tf

    from kvjax.experiments import cli, passkey

    cfg = tf.models.gemma3.Gemma3TextConfig(**{**BASE, "num_attention_heads": 8, "num_key_value_heads": 4,
                                               "head_dim": 8}, sliding_window=8, query_pre_attn_scalar=20,
                                            layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(1)
    tf.Gemma3ForCausalLM(cfg).save_pretrained(tmp_path / "g3")
    byte_tokenizer().save_pretrained(tmp_path / "g3")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(root / "tests" / "mesh_script.py"), str(tmp_path / "g3")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("full", "streaming"):
        assert report[name]["same_tokens"] and report[name]["max_logit_diff"] <= 1e-5, report[name]
        assert report[name]["generate_cache_devices"] == 8
    argv = ["--model", str(tmp_path / "g3"), "--lengths", "300", "--depths", "0.5", "--samples", "2",
            "--policy", "streaming", "--budget", "64", "--out", str(tmp_path / "pk")]
    assert cli.run(passkey.main, argv) == 0
    assert len((tmp_path / "pk" / "samples.jsonl").read_text().splitlines()) == 2

