"""Mistral, Qwen2 (parity with transformers) and Baichuan (parity with an independent NumPy forward)."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from kvjax import FullCache, StreamingLLM
from kvjax.attention import alibi_slopes
from kvjax.models import load
from tests.conftest import left_pad, random_ids, stepper
from kvjax import drive

torch = pytest.importorskip("torch")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_hf(cls_config, cls_model, path, **kw):
    torch.manual_seed(0)
    model = cls_model(cls_config(**{**COMMON, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))  # norms start at 1 and biases at 0: make them matter
    model.save_pretrained(path)
    return model


def decode_logits(model, ids, prompt_len, policy, bucket=32):
    """Logits at positions prompt_len-1 .. len(ids)-1 from prefill + token-by-token decode."""
    prefill, decode = stepper(model, policy, bucket + len(ids))
    logits, cache = prefill(*left_pad(ids[:prompt_len], bucket))
    out = [np.asarray(logits[0])]
    for t in range(prompt_len, len(ids)):
        logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        out.append(np.asarray(logits[0]))
    return np.stack(out), cache


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_parity_with_transformers(tmp_path, arch):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "mistral":  # a window shorter than the sequence, so it matters
        pt = save_hf(MistralConfig, MistralForCausalLM, tmp_path, sliding_window=8)
    else:
        pt = save_hf(Qwen2Config, Qwen2ForCausalLM, tmp_path)
    lm = load(tmp_path)
    ids = random_ids(40, 97, seed=30, low=0)
    with torch.no_grad():
        ref = pt(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(np.asarray(drive.logits(lm.model, jnp.asarray([ids])))[0], ref, atol=1e-4, rtol=0)
    ours, cache = decode_logits(lm.model, ids, 13, FullCache())
    np.testing.assert_allclose(ours, ref[12:], atol=1e-4, rtol=0)
    if arch == "mistral":
        assert lm.config.sliding_window == 8
        assert all(layer.capacity == 8 for layer in cache)  # FullCache keeps a W-slot ring, not the context
        assert drive.plan(lm.model, FullCache()).policy.describe().startswith("LocalWindow(size=8")
    else:
        assert lm.config.qkv_bias and not lm.config.o_bias


def test_mistral_window_matters(tmp_path):
    """Guards the parity test: the same weights without the window give different logits."""
    from transformers import MistralConfig, MistralForCausalLM

    save_hf(MistralConfig, MistralForCausalLM, tmp_path, sliding_window=8)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ids = jnp.asarray([random_ids(40, 97, seed=31, low=0)])
    windowed = np.asarray(drive.logits(load(tmp_path).model, ids))
    cfg["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert np.abs(np.asarray(drive.logits(load(tmp_path).model, ids)) - windowed)[0, 8:].max() > 1e-3


# ---------------------------------------------------------------- Baichuan


def press_slopes(n: int) -> list[float]:
    """ALiBi slopes as Press et al. (2022) define them."""
    def geometric(m):
        return [2 ** (-8 * (i + 1) / m) for i in range(m)]

    if math.log2(n).is_integer():
        return geometric(n)
    low = 2 ** math.floor(math.log2(n))
    return geometric(low) + geometric(2 * low)[0::2][: n - low]


@pytest.mark.parametrize("heads", [8, 32, 40])
def test_alibi_slopes(heads):
    np.testing.assert_allclose(alibi_slopes(heads), press_slopes(heads), rtol=1e-6)


BAICHUAN_LAYOUTS = {
    # 7B layout: RoPE, config has max_position_embeddings
    "7b": dict(hidden_size=64, num_attention_heads=8, max_position_embeddings=256, model_max_length=256),
    # 13B layout: ALiBi, only model_max_length; 40 heads (not a power of two), as Baichuan2-13B
    "13b": dict(hidden_size=160, num_attention_heads=40, model_max_length=256),
}


def make_baichuan(path, layout, seed=0, std=0.15):
    """A synthetic checkpoint with Baichuan's exact tensor names and config.json."""
    rng = np.random.RandomState(seed)
    c = dict(architectures=["BaichuanForCausalLM"], model_type="baichuan", vocab_size=300, intermediate_size=96,
             num_hidden_layers=2, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0,
             auto_map={"AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
             **BAICHUAN_LAYOUTS[layout])
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    w = {"model.embed_tokens.weight": rng.randn(v, h), "model.norm.weight": 1 + 0.1 * rng.randn(h),
         "lm_head.weight": rng.randn(v, h) * 0.5}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.W_pack.weight": rng.randn(3 * h, h) * std, p + "self_attn.o_proj.weight": rng.randn(h, h) * std,
              p + "mlp.gate_proj.weight": rng.randn(f, h) * std, p + "mlp.up_proj.weight": rng.randn(f, h) * std,
              p + "mlp.down_proj.weight": rng.randn(h, f) * std,
              p + "input_layernorm.weight": 1 + 0.1 * rng.randn(h), p + "post_attention_layernorm.weight": 1 + 0.1 * rng.randn(h)}
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: x.astype(np.float32) for k, x in w.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c))
    for name in ("modeling_baichuan.py", "configuration_baichuan.py"):  # remote code must never run
        (path / name).write_text("raise RuntimeError('kvjax executed checkpoint code')\n")
    return {k: x.astype(np.float64) for k, x in w.items()}, c


def baichuan_reference(w, c, ids, keys_for=None):
    """Baichuan's forward in NumPy, from the published architecture. `keys_for(t)` may restrict
    query t to a list of (key position, coordinate) with the query's coordinate (cache policies)."""
    n, h, heads = len(ids), c["hidden_size"], c["num_attention_heads"]
    d = h // heads
    alibi = "max_position_embeddings" not in c
    slopes = np.asarray(press_slopes(heads))
    rms = lambda x, g: g * x / np.sqrt((x * x).mean(-1, keepdims=True) + c["rms_norm_eps"])
    freq = 1.0 / 10000 ** (np.arange(0, d, 2) / d)

    def rope(x, pos):  # x [n, heads, d]
        a = np.asarray(pos, float)[:, None, None] * freq
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)

    keys_for = keys_for or (lambda t: ([(j, j) for j in range(t + 1)], t))
    x = w["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = rms(x, w[p + "input_layernorm.weight"]) @ w[p + "self_attn.W_pack.weight"].T
        q, k, v = (qkv[:, j * h : (j + 1) * h].reshape(n, heads, d) for j in range(3))
        if not alibi:
            q, k = rope(q, np.arange(n)), rope(k, np.arange(n))
        out = np.zeros((n, heads, d))
        for t in range(n):
            keys, q_coord = keys_for(t)
            js = np.array([j for j, _ in keys])
            coord = np.array([cc for _, cc in keys])
            s = np.einsum("hd,jhd->hj", q[t], k[js]) / np.sqrt(d)
            if alibi:
                s = s + slopes[:, None] * (coord - q_coord)[None]
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[t] = np.einsum("hj,jhd->hd", pr / pr.sum(-1, keepdims=True), v[js])
        x = x + out.reshape(n, h) @ w[p + "self_attn.o_proj.weight"].T
        hx = rms(x, w[p + "post_attention_layernorm.weight"])
        g = hx @ w[p + "mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (hx @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w["lm_head.weight"]
    head = head / np.linalg.norm(head, axis=1, keepdims=True)  # NormHead
    return rms(x, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("layout", ["7b", "13b"])
def test_baichuan_matches_numpy_reference(tmp_path, layout):
    w, c = make_baichuan(tmp_path, layout)
    lm = load(tmp_path)
    assert lm.config.position_embedding == ("rope" if layout == "7b" else "alibi")
    assert lm.config.num_kv_heads == lm.config.num_heads == c["num_attention_heads"]
    ids = random_ids(30, 300, seed=32, low=0)
    ref = baichuan_reference(w, c, ids)
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(np.asarray(drive.logits(lm.model, jnp.asarray([ids])))[0], ref, atol=1e-4, rtol=0)
    ours, _ = decode_logits(lm.model, ids, 11, FullCache())
    np.testing.assert_allclose(ours, ref[10:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("positions", ["absolute", "rolling"])
def test_streaming_on_alibi_uses_stored_positions(tmp_path, positions):
    """ALiBi after eviction: the bias comes from the kept tokens' positions (or cache ranks)."""
    w, c = make_baichuan(tmp_path, "13b")
    sinks, budget = 2, 8
    window = budget - sinks

    def keys_for(t):
        kept = [j for j in range(t + 1) if j < sinks or t - j < window]
        coords = kept if positions == "absolute" else list(range(len(kept)))
        return list(zip(kept, coords)), coords[-1]

    ids = random_ids(30, 300, seed=33, low=0)
    ref = baichuan_reference(w, c, ids, keys_for)
    model = load(tmp_path).model
    policy = StreamingLLM(budget=budget, sinks=sinks, positions=positions, prefill_mode="stream")
    stream = nnx.jit(lambda m, t, p: drive.stream(m, t, p, drive.empty_cache(m, drive.plan(m, policy, 32), 1), drive.plan(m, policy))[0])
    ours = np.asarray(stream(model, jnp.asarray([ids]), jnp.arange(30)[None]))[0]
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert np.abs(ref - baichuan_reference(w, c, ids)).max() > 1e-3  # eviction changed something


def test_baichuan_loader_errors(tmp_path):
    from safetensors.numpy import load_file

    make_baichuan(tmp_path, "7b")
    t = load_file(str(tmp_path / "model.safetensors"))
    t["model.layers.1.self_attn.W_pack.weight"] = np.zeros((64, 64), np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.W_pack.weight' .* has shape \(64, 64\), but config.json implies \(192, 64\)"):
        load(tmp_path)
    del t["model.layers.1.self_attn.W_pack.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"'model.layers.1.self_attn.W_pack.weight' is missing"):
        load(tmp_path)


@pytest.mark.parametrize("name", ["full", "local", "streaming", "mat", "mat-sink", "mat-anchor"])
def test_every_policy_runs_on_window_and_alibi_models(tmp_path, name):
    from transformers import MistralConfig, MistralForCausalLM

    from kvjax import generate, make_policy
    from kvjax.cache import kept_sets

    save_hf(MistralConfig, MistralForCausalLM, tmp_path / "mistral", sliding_window=8)
    make_baichuan(tmp_path / "baichuan", "13b")
    policy = make_policy(name, 12, **({"num_layers": 2} if name == "mat" else {}))  # MAT's L_s scaled to 2 layers
    for d in ("mistral", "baichuan"):
        model = load(tmp_path / d).model
        g = generate(model, [random_ids(20, 97, seed=34, low=3)], policy, max_new_tokens=10, eos_ids=())
        assert g.lengths.tolist() == [10]
        for layer in kept_sets(g.cache):  # nothing kept that the step did not see, no duplicates
            assert all(len(set(h)) == len(h) and max(h) == 28 for h in layer)


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    # no factor given: transformers derives it, and the attention factor, from max / original positions
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.5 + 0.2 * i for i in range(8)]},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_rope_parameters_equal_transformers_in_every_family(tmp_path, family, rope):
    """Every rope_type kvjax accepts, through one RoPE-parameter path for every family: logits equal
    transformers' over 40 tokens (past LongRoPE's and Llama 3's original 16 positions). LongRoPE without an
    explicit factor once took attention factor 1.0 on Llama / Qwen / Mistral configs, where transformers
    takes sqrt(1 + ln(64 / 16) / ln 16) = 1.22 (logits off by up to 1.7)."""
    import transformers

    cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    extra = {"original_max_position_embeddings": 16} if rope == "longrope" else {}
    pt = save_hf(getattr(transformers, f"{cls}Config"), getattr(transformers, f"{cls}ForCausalLM"), tmp_path,
                 rope_parameters=dict(ROPES[rope]), max_position_embeddings=64, **extra)
    lm = load(tmp_path)
    assert lm.config.rope.rope_type == rope
    ids = random_ids(40, 97, seed=31, low=0)
    with torch.no_grad():
        ref = pt(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(drive.logits(lm.model, jnp.asarray([ids]))[0]), ref, atol=1e-4 * max(1, np.abs(ref).max()))
