"""kvjax's policies inside a researcher's own JAX model: a Llama written here as pure functions over a dict of
arrays (no Flax, nothing from `models/`), whose attention calls `kvjax.layer`. Its logits are checked against
transformers (full cache) and transformers + kvpress (a compressed prompt), and its decode step compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import layer
from kvjax.cache import HeadwiseCache
from kvjax.policies import H2O, AnchorCache, FullCache, RazorAttention, SnapKV, StreamingLLM
from kvjax.policies.plan import resolve
from tests.conftest import compile_log

torch = pytest.importorskip("torch")

HEADS, KV_HEADS, HEAD_DIM, LAYERS, THETA, EPS = 8, 2, 8, 2, 10000.0, 1e-6


@pytest.fixture(scope="module")
def pt_and_params():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=THETA,
                      rms_norm_eps=EPS, max_position_embeddings=512, initializer_range=0.2,
                      attn_implementation="eager")
    pt = LlamaForCausalLM(cfg).eval()
    sd = {k: jnp.asarray(v.numpy()) for k, v in pt.state_dict().items()}
    params = {
        "embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"], "head": sd["lm_head.weight"],
        "layers": [{n: sd[f"model.layers.{i}.{w}.weight"] for n, w in [
            ("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"), ("q", "self_attn.q_proj"),
            ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
            ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj")]} for i in range(LAYERS)],
    }
    return pt, params


# ---- the researcher's model: pure functions over `params` --------------------------------------------------


def rope(x, positions):
    """Llama's rotate-half RoPE of `x` `[..., t, d]` at `positions` (broadcastable to `x[..., 0]`)."""
    inv = 1.0 / THETA ** (jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM)
    ang = positions[..., None].astype(jnp.float32) * inv
    cos, sin = jnp.concatenate([jnp.cos(ang)] * 2, -1), jnp.concatenate([jnp.sin(ang)] * 2, -1)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return (x * cos + jnp.concatenate([-x2, x1], -1) * sin).astype(x.dtype)


def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * w


def geometry(i):
    return layer.Geometry(layer=i, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          scale=HEAD_DIM ** -0.5, rope=rope)


def qkv(p, h):
    """`[b, t, model]` -> q `[b, h, t, d]`, k, v `[b, kvh, t, d]` (unrotated: kvjax rotates)."""
    b, t, _ = h.shape
    split = lambda y, n: y.reshape(b, t, n, HEAD_DIM).transpose(0, 2, 1, 3)  # noqa: E731
    return split(h @ p["q"].T, HEADS), split(h @ p["k"].T, KV_HEADS), split(h @ p["v"].T, KV_HEADS)


def mlp(p, x):
    h = rms(x, p["ln2"])
    return x + (jax.nn.silu(h @ p["gate"].T) * (h @ p["up"].T)) @ p["down"].T


def _layers(params, plan, caches, tokens, pos, attend):
    """Every layer over `tokens` `[b, t]`, its attention `attend` (`layer.prefill` or `layer.chunk`): the final
    hidden states' logits `[b, t, vocab]` and every layer's cache."""
    x, new = params["embed"][tokens], []
    for i, (p, lp, c) in enumerate(zip(params["layers"], plan.layers, caches)):
        q, k, v = qkv(p, rms(x, p["ln1"]))
        o, c = attend(geometry(i), lp, c, q, k, v, pos, tokens)
        x = mlp(p, x + o.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1) @ p["o"].T)
        new.append(c)
    return rms(x, params["norm"]) @ params["head"].T, tuple(new)


def prefill(params, plan, caches, tokens, pos):
    """A whole prompt `[b, t]` (positions -1 on padding): logits `[b, t, vocab]` and every layer's cache."""
    return _layers(params, plan, caches, tokens, pos, layer.prefill)


def decode(params, plan, caches, token, pos):
    """One token per row (`token`, `pos` `[b]`): logits `[b, vocab]` and the caches."""
    x, new = params["embed"][token][:, None], []
    for i, (p, lp, c) in enumerate(zip(params["layers"], plan.layers, caches)):
        q, k, v = qkv(p, rms(x, p["ln1"]))
        o, c = layer.decode(geometry(i), lp, c, q[:, :, 0], k[:, :, 0], v[:, :, 0], pos, token)
        x = mlp(p, x + o.reshape(x.shape[0], 1, -1) @ p["o"].T)
        new.append(c)
    return (rms(x, params["norm"]) @ params["head"].T)[:, 0], tuple(new)


def chunk(params, plan, caches, tokens, pos):
    """One chunk of a prompt through the caches (`prefill_mode="chunked"`): the last logits and the caches."""
    logits, caches = _layers(params, plan, caches, tokens, pos, layer.chunk)
    return logits[:, -1], caches


def read_prompt(params, plan, caches, tokens, pos):
    """The prompt as the plan's policy reads it: whole, in chunks (a host loop), or token by token."""
    mode = plan.policy.prefill_mode
    if mode == "full":
        logits, caches = prefill(params, plan, caches, tokens, pos)
        return logits[:, -1], caches
    caches = tuple(layer.size_rows(lp, c, pos) for lp, c in zip(plan.layers, caches))  # a row's N, before reading
    if mode == "stream":  # a scan over the tokens: one decode step compiled, not one per token
        def body(caches, xs):
            logits, caches = decode(params, plan, caches, *xs)
            return caches, logits

        caches, logits = jax.lax.scan(body, caches, (tokens.T, pos.T))
        return logits[-1], caches
    n = plan.policy.chunk
    for s in range(0, tokens.shape[1], n):
        logits, caches = chunk(params, plan, caches, tokens[:, s:s + n], pos[:, s:s + n])
    return logits, caches


def run(params, policy, ids, new_tokens, max_len=64):
    """Prefill `ids` under `policy`, then teacher-force `new_tokens`: the prompt's logits and each step's."""
    plan = resolve(policy, LAYERS, KV_HEADS).sized(max_len, len(ids))
    caches = layer.init_cache(plan, 1, KV_HEADS, HEAD_DIM, jnp.float32)
    step = jax.jit(lambda c, t, p: decode(params, plan, c, t, p))
    logits, caches = jax.jit(lambda c, t, p: read_prompt(params, plan, c, t, p))(
        caches, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None])
    steps = []
    for j, t in enumerate(new_tokens):
        out, caches = step(caches, jnp.asarray([t], jnp.int32), jnp.asarray([len(ids) + j], jnp.int32))
        steps.append(out[0])
    return np.asarray(logits[0]), np.asarray(steps), caches, step


def kept(cache) -> list[list[list[int]]]:
    """Each KV head's kept positions (row 0), sorted: head-wise groups put back in head order."""
    if isinstance(cache, HeadwiseCache):
        by_head = {}
        for heads, g in zip(cache.heads, cache.groups):
            by_head |= {h: kept(g)[i] for i, h in enumerate(heads)}
        return [by_head[h] for h in sorted(by_head)]
    return [sorted(int(p) for p in row if p >= 0) for row in np.asarray(cache.pos[0])]


# ---- tests ----------------------------------------------------------------------------------------------


def test_own_model_full_cache_matches_transformers(pt_and_params):
    from transformers import DynamicCache

    pt, params = pt_and_params
    ids = np.random.RandomState(1).randint(0, 97, 30)
    prompt, new = ids[:24], ids[24:]
    plan = resolve(FullCache(), LAYERS, KV_HEADS).sized(64, len(prompt))
    ours_prompt, _ = prefill(params, plan, layer.init_cache(plan, 1, KV_HEADS, HEAD_DIM, jnp.float32),
                             jnp.asarray([prompt], jnp.int32), jnp.arange(len(prompt), dtype=jnp.int32)[None])
    ours_prompt = np.asarray(ours_prompt[0])
    _, ours_steps, _, _ = run(params, FullCache(), prompt, new)
    with torch.no_grad():
        cache = DynamicCache()
        theirs_prompt = pt(torch.tensor(prompt[None]), past_key_values=cache).logits[0].numpy()
        theirs_steps = [pt(torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[24 + j]]))
                        .logits[0, -1].numpy() for j, t in enumerate(new)]
    np.testing.assert_allclose(ours_prompt, theirs_prompt, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(ours_steps, np.stack(theirs_steps), atol=2e-4, rtol=1e-4)


def test_own_model_snapkv_prompt_matches_kvpress(pt_and_params):
    """The prompt compressed by SnapKV (kvpress's conventions) inside the own model: the next token's logits equal
    transformers + kvpress's SnapKVPress, and differ from the full cache's (the compression did something)."""
    kvpress = pytest.importorskip("kvpress")
    from transformers import DynamicCache

    pt, params = pt_and_params
    t = 70
    ids = np.random.RandomState(2).randint(0, 97, t + 1)
    ours = SnapKV(ratio=0.6, observation_window=16, kernel=5, pool="avg", group_agg="mean")
    _, ours_steps, caches, _ = run(params, ours, ids[:t], ids[t:], max_len=128)
    _, full_steps, _, _ = run(params, FullCache(), ids[:t], ids[t:], max_len=128)
    with torch.no_grad(), kvpress.SnapKVPress(compression_ratio=0.6, window_size=16, kernel_size=5)(pt):
        cache = DynamicCache()
        pt(torch.tensor([ids[:t]]), past_key_values=cache)
    kept_by_kvpress = cache.layers[0].keys.shape[2]  # before decoding appends
    with torch.no_grad():
        theirs = pt(torch.tensor([[ids[t]]]), past_key_values=cache, position_ids=torch.tensor([[t]])).logits[0, -1]
    assert kept_by_kvpress == int(t * 0.4)
    assert int(jnp.sum(caches[0].pos[0, 0] >= 0)) == int(t * 0.4) + 1  # the kept prompt and the decoded token
    np.testing.assert_allclose(ours_steps[0], theirs.numpy(), atol=2e-4, rtol=1e-4)
    assert np.abs(ours_steps[0] - full_steps[0]).max() > 1e-3


def test_own_model_streaming_decode_evicts_and_compiles_once(pt_and_params):
    """StreamingLLM evicting while the own model decodes: after each step the cache holds the 2 sinks and the most
    recent tokens (hand-computed positions), and the jitted step compiled once for every position."""
    pt, params = pt_and_params
    ids = np.random.RandomState(3).randint(0, 97, 20)
    policy = StreamingLLM(budget=8, sinks=2)
    _, steps, caches, step = run(params, policy, ids[:12], ids[12:15])
    assert np.isfinite(steps).all()
    with compile_log() as compiled:
        for j, t in enumerate(ids[15:]):
            _, caches = step(caches, jnp.asarray([t], jnp.int32), jnp.asarray([15 + j], jnp.int32))
    assert compiled == []
    last = len(ids) - 1
    for c in caches:
        kept = sorted(int(p) for p in np.asarray(c.pos[0, 0]) if p >= 0)
        assert kept == [0, 1, *range(last - 5, last + 1)]


OWN_VS_LLAMA = {
    "streaming": lambda: StreamingLLM(budget=12, sinks=2),
    "snapkv": lambda: SnapKV(budget=16, observation_window=4, kernel=3),
    "snapkv-chunked": lambda: SnapKV(budget=16, observation_window=4, kernel=3, prefill_mode="chunked", chunk=8),
    "mat": lambda: AnchorCache(budget=16, anchor_slots=4),  # MAT reads its prompt token by token (Algorithm 1)
    "razor-headwise": lambda: RazorAttention(retrieval=((True, False), (False, True)), buffer=6, sinks=2, compression=4),
    "h2o": lambda: H2O(budget=16, recent=6),
    "h2o-chunked": lambda: H2O(budget=16, recent=6, prefill_mode="chunked", chunk=8),
    # its local heads' window max(S0, N / C) is set from the whole prompt before the first chunk (layer.size_rows)
    "razor-chunked": lambda: RazorAttention(retrieval=((True, False), (False, True)), buffer=6, sinks=2,
                                            compression=4, prefill_mode="chunked", chunk=8),
}


@pytest.mark.filterwarnings("ignore:.*This is a different method from the paper's")  # chunked H2O / SnapKV, chosen
@pytest.mark.parametrize("name", list(OWN_VS_LLAMA))
def test_own_model_keeps_what_llama_keeps(pt_and_params, tmp_path, name):
    """The own model and kvjax's Flax Llama (`models/llama.py`, itself checked against transformers and kvpress)
    on the same weights, under each policy: the same kept positions per KV head in every layer after the prompt
    and after decoding, and the same logits, within float32 rounding. A policy that evicts nothing here would
    prove nothing, so each must have evicted."""
    from models import load

    pt, params = pt_and_params
    pt.save_pretrained(tmp_path)
    model = load(tmp_path, tokenizer=False).model
    policy, ids, n_prompt = OWN_VS_LLAMA[name](), np.random.RandomState(4).randint(0, 97, 44), 40
    ours_last, ours_steps, ours_caches, _ = run(params, policy, ids[:n_prompt], ids[n_prompt:])

    theirs_last, caches = model.prefill(jnp.asarray([ids[:n_prompt]], jnp.int32),
                                        jnp.arange(n_prompt, dtype=jnp.int32)[None], policy, 64)
    theirs_steps = []
    for j, t in enumerate(ids[n_prompt:]):
        out, caches = model.decode(jnp.asarray([t], jnp.int32), jnp.asarray([n_prompt + j], jnp.int32), caches,
                                   model.plan(policy))
        theirs_steps.append(np.asarray(out[0]))
    np.testing.assert_allclose(ours_last, np.asarray(theirs_last[0]), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(ours_steps, np.stack(theirs_steps), atol=2e-4, rtol=1e-4)
    for ours, theirs in zip(ours_caches, caches):
        assert kept(ours) == kept(theirs)
    assert min(len(h) for c in ours_caches for h in kept(c)) < len(ids)
