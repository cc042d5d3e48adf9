"""kvjax's policies inside a researcher's own JAX model: a Llama written here as pure functions over a dict of
arrays (no Flax, nothing from `kvjax/models/`), a registered pytree that implements only the one cached forward of
`kvjax.model.CachedLM`, its attention calling `kvjax.layer.attend`. kvjax drives it: its logits are checked against
transformers (full cache) and transformers + kvpress (a compressed prompt); it generates through `kvjax.generate`
the same greedy text as kvjax's own Llama under every policy family, scores text through `kvjax.scoring`, runs a
suite (`kvjax.experiments.passkey`), and compiles once per sized plan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import drive, engine, layer, scoring
from kvjax.cache import HeadwiseCache
from kvjax.generate import generate
from kvjax.model import CachedLM
from kvjax.policies import (H2O, AnchorCache, FullCache, KVzip, Quantized, RazorAttention, SnapKV,
                            StreamingLLM)
from tests.conftest import compile_log

torch = pytest.importorskip("torch")

# ---- the researcher's model: pure functions over `params`, and one forward --------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """What kvjax reads of the model (`kvjax.model.LMConfig`), and the shape its functions need."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    theta: float = 10000.0
    eps: float = 1e-6
    windows: int | None = None  # no sliding window


def rope(cfg: Config):
    def rotate(x, positions):
        """Llama's rotate-half RoPE of `x` `[..., t, d]` at `positions` (broadcastable to `x[..., 0]`)."""
        d = cfg.head_dim
        inv = 1.0 / cfg.theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
        ang = positions[..., None].astype(jnp.float32) * inv
        cos, sin = jnp.concatenate([jnp.cos(ang)] * 2, -1), jnp.concatenate([jnp.sin(ang)] * 2, -1)
        x1, x2 = jnp.split(x, 2, axis=-1)
        return (x * cos + jnp.concatenate([-x2, x1], -1) * sin).astype(x.dtype)

    return rotate


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OwnLlama:
    """The whole model a researcher writes: parameters (arrays), a static config, and the forward."""

    params: dict
    cfg: Config = dataclasses.field(metadata=dict(static=True))
    dtype = jnp.float32  # of its cache

    def __call__(self, tokens, positions, carry, step):
        c, p = self.cfg, self.params
        x, new = p["embed"][tokens], []
        b, t, _ = x.shape
        split = lambda y, n: y.reshape(b, t, n, c.head_dim).transpose(0, 2, 1, 3)  # noqa: E731
        for i, (w, entry) in enumerate(zip(p["layers"], carry, strict=True)):
            h = rms(x, w["ln1"], c.eps)
            q, k, v = split(h @ w["q"].T, c.num_heads), split(h @ w["k"].T, c.num_kv_heads), split(h @ w["v"].T,
                                                                                                c.num_kv_heads)
            geom = layer.Geometry(layer=i, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                  scale=c.head_dim ** -0.5, rope=rope(c))
            o, entry = layer.attend(geom, step, entry, q, k, v, positions, tokens)  # unrotated q / k: kvjax rotates
            x = x + o.transpose(0, 2, 1, 3).reshape(b, t, -1) @ w["o"].T
            h = rms(x, w["ln2"], c.eps)
            x = x + (jax.nn.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T
            new.append(entry)
        return rms(step.select(x), p["norm"], c.eps) @ p["head"].T, tuple(new)


def own_model(state: dict, cfg: Config) -> OwnLlama:
    """The model from a transformers Llama state dict (names as `model.safetensors` holds them)."""
    names = [("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"), ("q", "self_attn.q_proj"),
             ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
             ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj")]
    sd = {k: jnp.asarray(np.asarray(v), jnp.float32) for k, v in state.items()}
    return OwnLlama(params={
        "embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"],
        "head": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
        "layers": [{n: sd[f"model.layers.{i}.{w}.weight"] for n, w in names} for i in range(cfg.num_layers)],
    }, cfg=cfg)


# ---- fixtures ----------------------------------------------------------------------------------------------------

LAYERS, KV_HEADS = 2, 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' Llama, the own model on its weights, and kvjax's Llama loaded from its checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvjax.models import load

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=KV_HEADS, head_dim=8, rope_theta=10000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=512, initializer_range=0.2,
                      attn_implementation="eager", eos_token_id=2, pad_token_id=0)
    pt = LlamaForCausalLM(cfg).eval()
    own = own_model({k: v.numpy() for k, v in pt.state_dict().items()},
                    Config(vocab_size=97, num_layers=LAYERS, num_heads=8, num_kv_heads=KV_HEADS, head_dim=8,
                           max_position_embeddings=512, eos_token_ids=(2,), pad_token_id=0))
    path = tmp_path_factory.mktemp("own")
    pt.save_pretrained(path)
    return pt, own, load(path, tokenizer=False).model


def run(model, policy, ids, new_tokens, max_len=64):
    """Prefill `ids` under `policy`, then teacher-force `new_tokens`, through kvjax's compiled steps: the prompt's
    last logits, each step's, and the caches."""
    plan = drive.plan(model, policy, max_len, len(ids))
    logits, caches = engine.prefill(model, jnp.asarray([ids], jnp.int32),
                                    jnp.arange(len(ids), dtype=jnp.int32)[None], plan=plan)
    steps = []
    for j, t in enumerate(new_tokens):
        out, caches = engine.decode(model, jnp.asarray([t], jnp.int32), jnp.asarray([len(ids) + j], jnp.int32),
                                    caches, plan=plan)
        steps.append(np.asarray(out[0]))
    return np.asarray(logits[0]), np.asarray(steps), caches


def kept(cache) -> list[list[list[int]]]:
    """Each KV head's kept positions (row 0), sorted: head-wise groups put back in head order."""
    if isinstance(cache, HeadwiseCache):
        by_head = {}
        for heads, g in zip(cache.heads, cache.groups):
            by_head |= {h: kept(g)[i] for i, h in enumerate(heads)}
        return [by_head[h] for h in sorted(by_head)]
    return [sorted(int(p) for p in row if p >= 0) for row in np.asarray(cache.pos[0])]


# ---- tests ----------------------------------------------------------------------------------------------------


def test_own_model_is_a_cached_lm_with_only_a_forward(models):
    """The own model satisfies the contract with a forward, a config and a dtype: nothing else."""
    _, own, _ = models
    assert isinstance(own, CachedLM)
    assert [n for n in dir(OwnLlama) if not n.startswith("_")] == ["dtype"]


def test_own_model_full_cache_matches_transformers(models):
    from transformers import DynamicCache

    pt, own, _ = models
    ids = np.random.RandomState(1).randint(0, 97, 30)
    prompt, new = ids[:24], ids[24:]
    ours_prompt = np.asarray(drive.logits(own, jnp.asarray([prompt], jnp.int32))[0])
    _, ours_steps, _ = run(own, FullCache(), prompt, new)
    with torch.no_grad():
        cache = DynamicCache()
        theirs_prompt = pt(torch.tensor(prompt[None]), past_key_values=cache).logits[0].numpy()
        theirs_steps = [pt(torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[24 + j]]))
                        .logits[0, -1].numpy() for j, t in enumerate(new)]
    np.testing.assert_allclose(ours_prompt, theirs_prompt, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(ours_steps, np.stack(theirs_steps), atol=2e-4, rtol=1e-4)


def test_own_model_snapkv_prompt_matches_kvpress(models):
    """The prompt compressed by SnapKV (kvpress's conventions) inside the own model: the next token's logits equal
    transformers + kvpress's SnapKVPress, and differ from the full cache's (the compression did something)."""
    kvpress = pytest.importorskip("kvpress")
    from transformers import DynamicCache

    pt, own, _ = models
    t = 70
    ids = np.random.RandomState(2).randint(0, 97, t + 1)
    ours = SnapKV(ratio=0.6, observation_window=16, kernel=5, pool="avg", group_agg="mean")
    _, ours_steps, caches = run(own, ours, ids[:t], ids[t:], max_len=128)
    _, full_steps, _ = run(own, FullCache(), ids[:t], ids[t:], max_len=128)
    with torch.no_grad(), kvpress.SnapKVPress(compression_ratio=0.6, window_size=16, kernel_size=5)(pt):
        cache = DynamicCache()
        pt(torch.tensor(np.asarray([ids[:t]])), past_key_values=cache)
    kept_by_kvpress = cache.layers[0].keys.shape[2]  # before decoding appends
    with torch.no_grad():
        theirs = pt(torch.tensor([[ids[t]]]), past_key_values=cache, position_ids=torch.tensor([[t]])).logits[0, -1]
    assert kept_by_kvpress == int(t * 0.4)
    assert int(jnp.sum(caches[0].pos[0, 0] >= 0)) == int(t * 0.4) + 1  # the kept prompt and the decoded token
    np.testing.assert_allclose(ours_steps[0], theirs.numpy(), atol=2e-4, rtol=1e-4)
    assert np.abs(ours_steps[0] - full_steps[0]).max() > 1e-3


def test_own_model_streaming_decode_evicts_and_compiles_once_per_sized_plan(models):
    """StreamingLLM evicting while the own model decodes: after each step the cache holds the 2 sinks and the most
    recent tokens (hand-computed positions). Its prompt pass and decode step compile once per sized plan: another
    prompt of the same length and more steps compile nothing; a plan sized for more tokens compiles both again."""
    _, own, _ = models
    ids = np.random.RandomState(3).randint(0, 97, 20)
    policy = StreamingLLM(budget=8, sinks=2)
    run(own, policy, ids[:12], ids[12:15])
    other = np.random.RandomState(4).randint(0, 97, 20)
    with compile_log() as compiled:
        _, steps, caches = run(own, policy, other[:12], other[12:])
    assert compiled == []
    assert np.isfinite(steps).all()
    last = len(other) - 1
    for c in caches:
        assert sorted(int(p) for p in np.asarray(c.pos[0, 0]) if p >= 0) == [0, 1, *range(last - 5, last + 1)]
    with compile_log() as compiled:
        run(own, FullCache(), other[:12], other[12:14], max_len=80)
    assert len(compiled) == 2  # FullCache's plan (80 slots, no other test's): one prompt pass, one decode step
    with compile_log() as compiled:
        run(own, FullCache(), ids[:12], ids[12:16], max_len=80)
    assert compiled == []
    with compile_log() as compiled:
        run(own, FullCache(), other[:12], other[12:14], max_len=96)
    assert len(compiled) == 2  # a larger plan: its own prompt pass and decode step


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
def test_own_model_keeps_what_llama_keeps(models, name):
    """The own model and kvjax's Flax Llama (`kvjax/models/llama.py`, itself checked against transformers and kvpress)
    on the same weights, under each policy: the same kept positions per KV head in every layer after the prompt
    and after decoding, and the same logits, within float32 rounding. A policy that evicts nothing here would
    prove nothing, so each must have evicted."""
    _, own, llama = models
    policy, ids, n_prompt = OWN_VS_LLAMA[name](), np.random.RandomState(4).randint(0, 97, 44), 40
    ours_last, ours_steps, ours_caches = run(own, policy, ids[:n_prompt], ids[n_prompt:])
    theirs_last, theirs_steps, caches = run(llama, policy, ids[:n_prompt], ids[n_prompt:])
    np.testing.assert_allclose(ours_last, theirs_last, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(ours_steps, theirs_steps, atol=2e-4, rtol=1e-4)
    for ours, theirs in zip(ours_caches, caches):
        assert kept(ours) == kept(theirs)
    assert min(len(h) for c in ours_caches for h in kept(c)) < len(ids)


GENERATE = {
    **{k: OWN_VS_LLAMA[k] for k in ("streaming", "snapkv", "snapkv-chunked", "mat", "razor-headwise", "h2o")},
    "full": FullCache,
    "kvzip": lambda: KVzip(ratio=0.5, repeat_ids=(5, 6, 7), continue_ids=(8, 9), suffix_ids=(10,), chunk_size=16),
    "4-bit": lambda: Quantized(StreamingLLM(budget=24, sinks=2), bits=4, group=8, residual=8),
}


@pytest.mark.filterwarnings("ignore:.*This is a different method from the paper's")
@pytest.mark.parametrize("name", list(GENERATE))
def test_own_model_generates_what_llama_generates(models, name):
    """`kvjax.generate` drives the own model (it implements only the forward): two prompts, greedy, the same
    tokens as kvjax's Llama on the same weights under every policy family, and the same kept positions."""
    _, own, llama = models
    policy = GENERATE[name]()
    prompts = [np.random.RandomState(5).randint(11, 97, 40).tolist(), np.random.RandomState(6).randint(11, 97, 33)
               .tolist()]
    ours = generate(own, prompts, policy, max_new_tokens=10)
    theirs = generate(llama, prompts, policy, max_new_tokens=10)
    assert ours.sequences() == theirs.sequences()
    assert ours.lengths.tolist() == theirs.lengths.tolist()
    for a, b in zip(ours.cache, theirs.cache):
        assert kept(a) == kept(b)
    if name != "full":  # each policy evicted something, or the comparison proves little
        assert min(len(h) for c in ours.cache for h in kept(c)) < 40 + 10


def test_own_model_perplexity_through_scoring(models):
    """`kvjax.scoring` on the own model: the perplexity under StreamingLLM (compressing after every token, and
    in chunks) equals kvjax's Llama's, and differs from the full cache's (the cache evicted)."""
    _, own, llama = models
    ids = np.random.RandomState(7).randint(0, 97, 120).tolist()
    for policy in (StreamingLLM(budget=16, sinks=2, prefill_mode="stream"),
                   StreamingLLM(budget=16, sinks=2, prefill_mode="chunked", chunk=16)):
        ours = scoring.logprobs(own, ids, policy)
        np.testing.assert_allclose(ours, scoring.logprobs(llama, ids, policy), atol=2e-4, rtol=1e-4)
        full = drive.logits(own, jnp.asarray([ids], jnp.int32))[0, :-1]
        whole = np.take_along_axis(np.asarray(jax.nn.log_softmax(full, -1)), np.asarray(ids[1:])[:, None], 1)[:, 0]
        assert np.abs(ours - whole).max() > 1e-2


def own_from_checkpoint(directory, c) -> OwnLlama:
    """The own model built from a kvjax checkpoint's weights and its Llama config `c`."""
    from safetensors.numpy import load_file

    return own_model(load_file(str(directory / "model.safetensors")),
                     Config(vocab_size=c.vocab_size, num_layers=c.num_layers, num_heads=c.num_heads,
                            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, theta=c.rope.theta, eps=c.rms_norm_eps,
                            max_position_embeddings=c.max_position_embeddings, eos_token_ids=c.eos_token_ids,
                            pad_token_id=c.pad_token_id))


def test_own_model_runs_the_passkey_suite(tiny_dir, tiny, tmp_path):
    """`kvjax.experiments.passkey` (its Python API) on the own model built from a kvjax checkpoint's weights, with that
    checkpoint's tokenizer: the same records (outputs) as kvjax's Llama."""
    from kvjax.experiments import passkey
    from kvjax.experiments.records import ResultLog

    own = own_from_checkpoint(tiny_dir, tiny.model.cfg)
    policy = SnapKV(budget=64, observation_window=8)
    args = (tiny.tokenizer, policy, [300], [0.0, 1.0], 2)
    ours = passkey.run(own, *args, ResultLog(tmp_path / "own.jsonl"), progress=False, label="s")
    theirs = passkey.run(tiny.model, *args, ResultLog(tmp_path / "llama.jsonl"), progress=False, label="s")
    assert len(ours) == 4
    assert [(r["id"], r["output"]) for r in ours] == [(r["id"], r["output"]) for r in theirs]


def test_own_model_runs_a_suite_with_records_and_resume(tiny_dir, tiny, tmp_path, capsys):
    """The suite runner itself (`passkey.suite`: an identity, a lock, records, resume, tables) on the pure-pytree own
    model with no checkpoint path and no Llama config (`LoadedModel(model, tokenizer)`): the same outputs as kvjax's
    Llama on the same weights, an identity naming the own class, a rerun that resumes with every record reused, and
    a model of another class refused on that --out."""
    import json

    from kvjax.errors import InvalidInput
    from kvjax.experiments import passkey
    from kvjax.models.loading import LoadedModel
    from kvjax.policies import StreamingLLM

    own = own_from_checkpoint(tiny_dir, tiny.model.cfg)
    lm = LoadedModel(own, tiny.tokenizer)

    def run(model, out, progress=False):
        return passkey.suite(model, [StreamingLLM(budget=64, sinks=4)], out, lengths=[300], depths=[0.0, 1.0],
                             samples=1, progress=progress)

    ours = run(lm, tmp_path / "own")
    theirs = run(tiny, tmp_path / "llama")
    assert ours.summary == theirs.summary
    identity = json.loads((tmp_path / "own" / "identity.json").read_text())
    assert identity["model class"] == f"{OwnLlama.__module__}.{OwnLlama.__qualname__}" and identity["model"] is None
    records = (tmp_path / "own" / "samples.jsonl").read_text()
    assert records.count("\n") == 2
    capsys.readouterr()
    assert run(lm, tmp_path / "own", progress=True).summary == ours.summary
    assert "2 records of this identity reused, 0 to compute" in capsys.readouterr().err
    assert (tmp_path / "own" / "samples.jsonl").read_text() == records
    with pytest.raises(InvalidInput, match="holds results of another configuration"):
        run(tiny, tmp_path / "own")
