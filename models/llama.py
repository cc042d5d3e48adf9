"""Llama in Flax NNX: RMSNorm, RoPE (default / linear / llama3), GQA, SwiGLU, tied or untied head;
with the options of the Llama-family checkpoints kvjax loads (Mistral, Qwen2/3, Baichuan, Gemma 2/3):
per-head q/k norms, Gemma's (1 + w) norms around attention and the MLP, GeGLU, scaled embeddings,
`query_pre_attn_scalar`, soft-capped logits, and per-layer sliding windows and RoPE bases.

Three entry points share one set of layers:

* `model(tokens)`: full causal forward, logits for every position (training, parity).
* `model.prefill(tokens, positions, policy, max_len)`: full attention over a
  left-padded prompt (`positions` = -1 on padding), each layer's cache built by
  the policy; returns the last position's logits and the cache.
* `model.decode(tokens, positions, cache, plan)`: one token per row through
  the cache, under `plan = model.plan(policy, max_len, prompt_len)`.

The plan (and the policy it was resolved from) is a static, hashable object, so these trace to fixed shapes;
every cached call takes the plan, and no call resolves a policy again (`plan` is the only place that does).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax import attention
from kvjax import layer as layer_fns
from kvjax.cache import AnyLayerCache, Cache, LayerCache
from kvjax.policies.base import Context, Policy
from kvjax.policies.compose import on_windows
from kvjax.policies.plan import LayerPlan, Plan, resolve
from kvjax.rope import RopeConfig, apply_rope, inv_freq
from kvjax.stats import NO_STATS


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The decoder's shape and options, read from a checkpoint's config.json (or a GGUF file's metadata) by
    `models.load`: one config for every family kvjax reads (Llama, Mistral, Qwen2 / 3, Gemma 2 / 3, Phi-3,
    Baichuan)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    sliding_window: int | None = None  # Mistral: a query sees its `sliding_window` latest keys
    position_embedding: str = "rope"  # or "alibi" (Baichuan-13B)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k, before RoPE
    gemma_norm: bool = False  # Gemma: RMSNorm scales by (1 + w), in float32, then casts
    sandwich_norm: bool = False  # Gemma 2/3: norms after attention, before and after the MLP
    hidden_act: str = "silu"  # "gelu_pytorch_tanh": Gemma's GeGLU
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power instead of head_dim's
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    # Per layer "sliding_attention" (the `sliding_window` latest tokens) or "full_attention"
    # (Gemma 2/3); None: every layer alike (`sliding_window` for all, as Mistral, or none).
    layer_types: tuple[str, ...] | None = None
    local_rope: RopeConfig | None = None  # Gemma 3: the RoPE of sliding layers, when it differs
    model_type: str = "llama"
    attention_impl: str = "xla"  # or "pallas" (kvjax.pallas); a run-time choice, not saved to config.json

    def __post_init__(self):
        attention.check_impl(self.attention_impl)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.position_embedding not in ("rope", "alibi"):
            raise ValueError(f"position_embedding={self.position_embedding!r}; expected 'rope' or 'alibi'")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r}: kvjax supports {sorted(ACTIVATIONS)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types={list(self.layer_types)}: one of {LAYER_TYPES} per layer "
                                 f"({self.num_layers})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    def window_of(self, layer: int) -> int | None:
        """How far back `layer`'s queries see: `sliding_window`, or None (the whole context)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def rope_of(self, layer: int) -> RopeConfig:
        if self.local_rope is not None and self.window_of(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf, **family) -> "LlamaConfig":
        """From a `transformers` config object (v4 `rope_scaling` or v5 `rope_parameters`); `family`:
        the fields a model family reads its own way (Gemma's activation and RoPE, Phi-3's LongRoPE)."""
        act = family.get("hidden_act", getattr(hf, "hidden_act", "silu"))
        if act != "silu" and "hidden_act" not in family:
            raise ValueError(f"hidden_act={act!r}: kvjax's Llama supports only 'silu'")
        if "rope" not in family:
            # One path for every family: LongRoPE's default factor (and so its attention factor) comes from the
            # context extension, max / original positions, as transformers computes it.
            rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
            family["rope"] = RopeConfig.from_hf(rope, getattr(hf, "rope_theta", 10000.0), hf.max_position_embeddings,
                                                getattr(hf, "original_max_position_embeddings", None))
        eos = hf.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        heads = hf.num_attention_heads
        return cls(**{**dict(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf, "attention_bias", False)),
            o_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos,
            pad_token_id=hf.pad_token_id,
        ), **family})

    def to_hf(self):
        """The equivalent `transformers.LlamaConfig` (for saving a checkpoint)."""
        from transformers import LlamaConfig as HFLlamaConfig

        if self.model_type != "llama" or self.qkv_bias != self.o_bias:
            raise NotImplementedError(f"saving a {self.model_type!r} model is not supported (only llama)")

        return HFLlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope.to_hf(),
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.qkv_bias,
            mlp_bias=self.mlp_bias,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            pad_token_id=self.pad_token_id,
        )


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}
LAYER_TYPES = ("sliding_attention", "full_attention")


@functools.lru_cache(maxsize=None)
def _freq(rope: RopeConfig, head_dim: int, float64: bool = False, long: bool = False) -> np.ndarray:
    return inv_freq(rope, head_dim, np.float64 if float64 else np.float32, long)


def _acc(dtype):
    """Norms, RoPE and logits run in float32 for half-precision weights, float64 for float64."""
    return jnp.promote_types(dtype, jnp.float32)


class RMSNorm(nnx.Module):
    """Llama's `w * norm(x)` (w starts at 1), or with `plus_one` Gemma's `(1 + w) * norm(x)` computed
    in float32 before the cast (w starts at 0), each as transformers computes it."""

    def __init__(self, dim: int, eps: float, *, dtype, plus_one: bool = False):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if plus_one else jnp.ones((dim,), dtype))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(_acc(x.dtype))
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (y * (1.0 + self.weight[...].astype(y.dtype))).astype(x.dtype)
        return self.weight[...] * y.astype(x.dtype)


def _norm(cfg: LlamaConfig, dim: int, dtype) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype, plus_one=cfg.gemma_norm)


def _linear(i, o, bias, dtype, rngs, std=0.02):
    init = nnx.initializers.normal(std)
    return nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=init, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, *, dtype, rngs: nnx.Rngs, std: float = 0.02):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(d, cfg.num_heads * hd, cfg.qkv_bias, dtype, rngs, std)
        self.k_proj = _linear(d, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, rngs, std)
        self.v_proj = _linear(d, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, rngs, std)
        self.o_proj = _linear(cfg.num_heads * hd, d, cfg.o_bias, dtype, rngs, std)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _norm(cfg, hd, dtype), _norm(cfg, hd, dtype)
        self.cfg = cfg
        self.layer = layer
        # This layer's attention: how far back it sees, its scale, soft-cap and RoPE.
        self.window = cfg.window_of(layer)
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_softcap
        self.rope = cfg.rope_of(layer)
        self.gate = nnx.data(None)  # an Attention-Gate (kvjax.gate.attach_gates / load_gates), or None

    def qkv(self, x: Float[Array, "b t D"]):
        """The layer's unrotated projections `(q [b, h, t, d], k, v [b, kvh, t, d])` of the normed input `x`
        (q / k norms applied): what `kvjax.layer` and the head probes (`kvjax.heads`) take."""
        b, t, _ = x.shape
        c = self.cfg
        split = lambda y, n: y.reshape(b, t, n, c.head_dim).transpose(0, 2, 1, 3)
        q, k, v = split(self.q_proj(x), c.num_heads), split(self.k_proj(x), c.num_kv_heads), split(
            self.v_proj(x), c.num_kv_heads)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _out(self, o: Float[Array, "b h t d"]) -> Float[Array, "b t D"]:
        b, h, t, d = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, h * d))

    @property
    def geometry(self) -> layer_fns.Geometry:
        """This layer's attention for `kvjax.layer`: scale, window, soft-cap, ALiBi slopes and its RoPE."""
        c = self.cfg
        return layer_fns.Geometry(
            layer=self.layer, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            scale=self.scale, rope=self._rotate if c.position_embedding == "rope" else None, alibi=self._alibi(),
            window=self.window, softcap=self.softcap, impl=c.attention_impl)

    def prefill(
        self,
        x: Float[Array, "b t D"],
        pos: Int[Array, "b t"],
        plan: LayerPlan | None,
        cache: LayerCache | None,
        anchor_mask: attention.AnchorMask | None = None,
        tokens: Int[Array, "b t"] | None = None,
    ):
        """Attention over a prompt: `(output, cache, keep)`, `keep` `[b, kvh, t]` the gate's flags
        (eq. 7) when a gate runs: in the plain forward (`plan` None), and at prefill under a plan
        whose rules ask for them. With a plan, each of its groups caches its heads under its rule."""
        q, k, v = self.qkv(x)
        wanted = NO_STATS if plan is None else plan.prefill_stats()
        keep = None
        if wanted.gate_keep and self.gate is None:
            raise ValueError(f"{plan.rule.describe()} needs Attention-Gates: kvjax.gate.load_gates(model, DIR) "
                             "(--gate-params DIR)")
        if self.gate is not None and (plan is None or wanted.gate_keep):
            keep = self.gate(x, pos)
        # Under a plan nothing differentiates the prompt, so the gate's flags go as a bool mask, which
        # lets attention skip the blocks every head evicted; the plain forward keeps the float flags
        # that carry the gates' training gradient.
        key_keep = keep if keep is None or plan is None else keep > 0
        o, cache = layer_fns.prefill(self.geometry, plan, cache, q, k, v, pos, tokens, anchor_mask=anchor_mask,
                                     key_keep=key_keep, gate_keep=None if keep is None or plan is None else key_keep)
        return self._out(o), cache, keep

    def prefill_shared(self, x, pos, plans: tuple[LayerPlan, ...], caches, tokens):
        """A prompt attended once for several plans of this layer (`kvjax.layer.prefill_shared`)."""
        q, k, v = self.qkv(x)
        o, caches = layer_fns.prefill_shared(self.geometry, plans, caches, q, k, v, pos, tokens)
        return self._out(o), caches

    def extend(
        self,
        x: Float[Array, "b t D"],
        pos: Int[Array, "b t"],
        plan: LayerPlan,
        cache: LayerCache,
        anchor_mask: attention.AnchorMask | None = None,
    ) -> Float[Array, "b t D"]:
        """A chunk attending the read-only `cache` (absolute positions) and itself."""
        q, k, v = self.qkv(x)
        return self._out(layer_fns.extend(self.geometry, plan, cache, q, k, v, pos, anchor_mask))

    def replay(self, x: Float[Array, "b t D"], pos: Int[Array, "b t"], plan: LayerPlan, cache: LayerCache,
               span: Int[Array, "b 3"]) -> tuple[Float[Array, "b t D"], Float[Array, "b kvh c"]]:
        """`extend`, also returning KVzip's reconstruction scores of the cached slots (`kvjax.layer.replay`)."""
        q, k, v = self.qkv(x)
        o, scores = layer_fns.replay(self.geometry, plan, cache, q, k, v, pos, span)
        return self._out(o), scores

    def chunk(
        self, x: Float[Array, "b n D"], pos: Int[Array, "b n"], plan: LayerPlan, cache: AnyLayerCache,
        tokens: Int[Array, "b n"],
    ) -> tuple[Float[Array, "b n D"], AnyLayerCache]:
        """A chunk of the prompt (`prefill_mode="chunked"`): it attends the compressed cache and itself,
        then the policy folds it into the cache (`kvjax.layer.chunk`)."""
        q, k, v = self.qkv(x)
        o, cache = layer_fns.chunk(self.geometry, plan, cache, q, k, v, pos, tokens)
        return self._out(o), cache

    def _rotate(self, x, positions):
        """RoPE at `positions`; identity for ALiBi models (no position in the keys)."""
        if self.cfg.position_embedding != "rope":
            return x
        f64 = x.dtype == jnp.float64
        if self.rope.rope_type != "longrope":
            return apply_rope(x, positions, _freq(self.rope, self.cfg.head_dim, f64))
        # LongRoPE switches to its long factors once a call reaches past the original context
        # (transformers: max(position_ids) + 1 > original_max_position_embeddings), per call.
        long = jnp.max(positions) + 1 > self.rope.original_max_position_embeddings
        freq = jnp.where(long, _freq(self.rope, self.cfg.head_dim, f64, True), _freq(self.rope, self.cfg.head_dim, f64))
        return apply_rope(x, positions, freq, self.rope.attention_factor)

    def _alibi(self):
        return attention.alibi_slopes(self.cfg.num_heads) if self.cfg.position_embedding == "alibi" else None

    def decode(
        self, x: Float[Array, "b 1 D"], pos: Int[Array, "b"], plan: LayerPlan, cache: AnyLayerCache, tokens=None
    ):
        q, k, v = self.qkv(x)  # [b, h, 1, d], [b, kvh, 1, d]
        o, cache = layer_fns.decode(self.geometry, plan, cache, q[:, :, 0], k[:, :, 0], v[:, :, 0], pos, tokens)
        return self._out(o[:, :, None, :]), cache


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, std: float = 0.02):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(d, f, cfg.mlp_bias, dtype, rngs, std)
        self.up_proj = _linear(d, f, cfg.mlp_bias, dtype, rngs, std)
        self.down_proj = _linear(f, d, cfg.mlp_bias, dtype, rngs, std)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Llama: `x + attn(norm(x))`, then `x + mlp(post_attention_layernorm(x))`. Gemma 2/3 (`sandwich_norm`):
    `x + post_attention_layernorm(attn(input_layernorm(x)))`, then
    `x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))` (transformers' names)."""

    def __init__(self, cfg: LlamaConfig, layer: int, *, dtype, rngs: nnx.Rngs, std: float = 0.02):
        d = cfg.hidden_size
        self.input_layernorm = _norm(cfg, d, dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, rngs=rngs, std=std)
        self.post_attention_layernorm = _norm(cfg, d, dtype)
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = _norm(cfg, d, dtype)
            self.post_feedforward_layernorm = _norm(cfg, d, dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, std=std)
        self.sandwich = cfg.sandwich_norm

    def _finish(self, x, a):
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))

    # `plan`: this layer's `LayerPlan` (None: the plain forward, no cache)
    def prefill(self, x, pos, plan, cache, anchor_mask=None, tokens=None):
        a, cache, keep = self.self_attn.prefill(self.input_layernorm(x), pos, plan, cache, anchor_mask, tokens)
        return self._finish(x, a), cache, keep

    def extend(self, x, pos, plan, cache, anchor_mask=None):
        return self._finish(x, self.self_attn.extend(self.input_layernorm(x), pos, plan, cache, anchor_mask))

    def replay(self, x, pos, plan, cache, span):
        a, scores = self.self_attn.replay(self.input_layernorm(x), pos, plan, cache, span)
        return self._finish(x, a), scores

    def prefill_shared(self, x, pos, plans, caches, tokens):
        a, caches = self.self_attn.prefill_shared(self.input_layernorm(x), pos, plans, caches, tokens)
        return self._finish(x, a), caches

    def chunk(self, x, pos, plan, cache, tokens):
        a, cache = self.self_attn.chunk(self.input_layernorm(x), pos, plan, cache, tokens)
        return self._finish(x, a), cache

    def decode(self, x, pos, plan, cache, tokens=None):
        a, cache = self.self_attn.decode(self.input_layernorm(x), pos, plan, cache, tokens)
        return self._finish(x, a), cache


class Llama(nnx.Module):
    """kvjax's functional decoder (Flax NNX) for every family it loads; its attention is projection ->
    `kvjax.layer` -> output projection, and it satisfies `kvjax.model.CachedLM`."""

    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, init_std: float = 0.02):
        """`init_std`: normal init of every matrix (HF's initializer_range); weights are loaded over it."""
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(init_std),
            rngs=rngs,
        )
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, dtype=dtype, rngs=rngs, std=init_std) for i in range(cfg.num_layers)]
        )
        self.norm = _norm(cfg, cfg.hidden_size, dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs, init_std)
        )

    def embed(self, tokens: Int[Array, "..."]) -> Float[Array, "... D"]:
        x = self.embed_tokens(tokens)
        if self.cfg.embed_scale:  # Gemma: sqrt(hidden_size), rounded to the weights' dtype first
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        return x

    def _logits(self, h: Float[Array, "... D"]) -> Float[Array, "... V"]:
        h = self.norm(h)
        out = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        out = out.astype(_acc(out.dtype))
        if self.cfg.final_softcap is not None:
            out = self.cfg.final_softcap * jnp.tanh(out / self.cfg.final_softcap)
        return out

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"] | None = None,
        anchor_mask: attention.AnchorMask | None = None,
    ):
        """Full causal forward: logits `[b, t, vocab]`; `anchor_mask` restricts attention to AnLLM's eq. 4."""
        return self.forward(tokens, positions, anchor_mask)[0]

    def forward(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"] | None = None,
        anchor_mask: attention.AnchorMask | None = None,
    ) -> tuple[Float[Array, "b t V"], list[Float[Array, "b kvh t"]] | None]:
        """`__call__` that also returns each layer's Attention-Gate keep flags (None without gates)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed(tokens)
        flags = []
        for layer in self.layers:
            x, _, keep = layer.prefill(x, positions, None, None, anchor_mask)
            flags.append(keep)
        return self._logits(x), (flags if flags[0] is not None else None)

    def native_policy(self, policy: Policy) -> Policy:
        """The policy as this model runs it (`kvjax.policies.on_windows`): with one sliding window W, FullCache
        keeps a W-slot ring; with per-layer windows (Gemma 2/3's `layer_types`), the policy compresses the global
        layers only while each sliding layer keeps its W-slot ring, as kvpress does on Gemma 3. To choose every
        layer's policy yourself, pass a `PerLayer` (its sliding layers are still bounded by W)."""
        c = self.cfg
        windows = c.sliding_window if c.layer_types is None else tuple(c.window_of(i) for i in range(c.num_layers))
        return on_windows(policy, windows, c.num_layers, c.num_kv_heads)

    def plan(self, policy: Policy, max_len: int | None = None, prompt_len: int = 0) -> Plan:
        """`policy` as this model runs it (`native_policy`), checked and resolved into each layer's
        rule and head groups (`kvjax.policies.plan`): everything below reads the plan. With `max_len`,
        sized: each group's slot count fixed for sequences of at most `max_len` tokens whose (padded)
        prompt is `prompt_len` long, which is all a compiled prefill depends on (`kvjax.engine.prefill`)."""
        c = self.cfg
        plan = resolve(self.native_policy(policy), c.num_layers, c.num_kv_heads)
        return plan if max_len is None else plan.sized(max_len, prompt_len)

    def init_cache(self, policy: Policy, batch: int, max_len: int, prompt_len: int = 0) -> Cache:
        return self._empty_cache(self.plan(policy, max_len, prompt_len), batch)

    def _empty_cache(self, plan: Plan, batch: int) -> Cache:
        """Empty arrays of a sized plan's slot counts (`Plan.sized`)."""
        return layer_fns.init_cache(plan, batch, self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype)

    def size_rows(self, cache: Cache, positions: Int[Array, "b t"], plan: Plan) -> Cache:
        """The fresh `cache` made ready for the whole prompts at `positions` to be read token by token:
        each layer's rule (each head group's) sets what depends on a row's prompt, a ratio budget."""
        return tuple(layer_fns.size_rows(lp, c, positions) for lp, c in zip(plan.layers, cache))

    def prefill(
        self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], policy: Policy, max_len: int
    ) -> tuple[Float[Array, "b V"], Cache]:
        """Prompt pass: last-position logits and the compressed cache (capacity for `max_len` tokens);
        `prefill_plan` under `self.plan(policy, max_len, t)`."""
        return self.prefill_plan(tokens, positions, self.plan(policy, max_len, tokens.shape[1]))

    def prefill_plan(
        self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], plan: Plan
    ) -> tuple[Float[Array, "b V"], Cache]:
        """Prompt pass under a sized plan (`Llama.plan(policy, max_len, t)`): last-position logits and the
        compressed cache. `prefill_mode == "stream"` runs the prompt token by token through the cache
        instead of attending it whole; "chunked", chunk by chunk."""
        if plan.layers[0].sizes is None:
            raise ValueError("prefill_plan needs a sized plan: model.plan(policy, max_len, prompt_len)")
        policy = plan.policy
        caches = self._empty_cache(plan, tokens.shape[0])
        if policy.prefill_mode == "stream":
            caches = self.size_rows(caches, positions, plan)
            logits, caches = self.stream(tokens, positions, caches, plan, all_logits=False)
            return logits, caches
        if policy.prefill_mode == "chunked":
            # what depends on a row's whole prompt (RazorAttention's window max(S0, N / C)) is set before the
            # first chunk, as for the stream
            return self._chunked(tokens, positions, self.size_rows(caches, positions, plan), plan)
        x = self.embed(tokens)
        out = []
        for layer, lp, cache in zip(self.layers, plan.layers, caches):
            anchor_mask = lp.prompt_mask(Context(positions, tokens))  # AnLLM: eq. 4 over the prompt
            x, cache, _ = layer.prefill(x, positions, lp, cache, anchor_mask, tokens)
            out.append(cache)
        return self._logits(x[:, -1]), tuple(out)

    def prefill_plans(
        self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], plans: tuple[Plan, ...]
    ) -> tuple[Float[Array, "b V"], tuple[Cache, ...]]:
        """One pass over a prompt for several sized plans whose prompt attention is the same (each attends the
        whole prompt, `prefill_mode="full"`, with no eq. 4 mask and no gates: `Plan.plain_prompt_pass`): the last
        logits, the same for all, and each plan's cache. A comparison of prompt compressors (SnapKV, PyramidKV,
        TOVA, ...) pays for one forward instead of one per policy."""
        for plan in plans:
            if not plan.plain_prompt_pass:
                raise ValueError(f"{plan.policy.describe()} does not attend its prompt as a plain causal pass "
                                 "(chunked or stream prefill, an eq. 4 mask or gates): prefill it alone")
        b = tokens.shape[0]
        caches = [self._empty_cache(plan, b) for plan in plans]
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x, layer_caches = layer.prefill_shared(x, positions, tuple(plan.layers[i] for plan in plans),
                                                   tuple(c[i] for c in caches), tokens)
            caches = [c[:i] + (lc,) + c[i + 1:] for c, lc in zip(caches, layer_caches)]
        return self._logits(x[:, -1]), tuple(caches)

    def _chunked(self, tokens, positions, caches, plan: Plan) -> tuple[Float[Array, "b V"], Cache]:
        """`prefill` in chunks of `plan.policy.chunk` tokens: one `lax.scan`, the prompt left-padded to whole
        chunks (padding: position -1, a no-op), so the cache carried between chunks is all that grows
        with the prompt besides the tokens themselves."""
        b, t = tokens.shape
        # A chunk longer than the prompt reads it whole either way: capped there, an absurd chunk (10**5, 10**9)
        # never pads the prompt to its size
        n = min(plan.policy.chunk, t)
        pad = -t % n
        tokens = jnp.pad(tokens, ((0, 0), (pad, 0)))
        positions = jnp.pad(positions, ((0, 0), (pad, 0)), constant_values=-1)
        split = lambda x: x.reshape(b, -1, n).transpose(1, 0, 2)  # noqa: E731  [chunks, b, n]

        def body(carry, xs):
            cache, _ = carry
            logits, cache = self.prefill_chunk(xs[0], xs[1], cache, plan, all_logits=False)
            return (cache, logits), None

        init = (caches, jnp.zeros((b, self.cfg.vocab_size), _acc(self.dtype)))
        (caches, logits), _ = jax.lax.scan(body, init, (split(tokens), split(positions)))
        return logits, caches

    def prefill_chunk(
        self,
        tokens: Int[Array, "b n"],
        positions: Int[Array, "b n"],
        cache: Cache,
        plan: Plan,
        *,
        all_logits: bool = True,
    ) -> tuple[Float[Array, "b n V"] | Float[Array, "b V"], Cache]:
        """One chunk of a chunked prefill: the chunk attends `cache` and itself in every layer, then
        each layer's policy folds it in. Returns the chunk's logits (all, or the last) and the cache.

        A host loop over this (one compilation for every prompt length) or `prefill`'s scan give
        the same cache."""
        x = self.embed(tokens)
        out = []
        for layer, lp, c in zip(self.layers, plan.layers, cache):
            x, c = layer.chunk(x, positions, lp, c, tokens)
            out.append(c)
        return self._logits(x if all_logits else x[:, -1]), tuple(out)

    def extend(
        self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan
    ) -> Float[Array, "b t V"]:
        """Logits of a chunk of tokens that continues a prefilled `cache`, which is only read.

        Prefix caching: a cached prefix (few-shot demonstrations, AnLLM's anchors) is
        reused for many continuations, each attended in one parallel pass. The chunk
        follows the rules' `prompt_mask` within itself and `prefix_visible` against
        the cache; nothing is evicted while it runs. Right-pad with positions -1.
        """
        for lp in plan.layers:
            if lp.split or lp.position_mode != "absolute":
                raise ValueError(f"extend needs one cache array per layer in absolute positions; "
                                 f"{plan.policy.describe()} has head groups or rolling positions in layer {lp.layer}")
        x = self.embed(tokens)
        for layer, lp, c in zip(self.layers, plan.layers, cache):
            x = layer.extend(x, positions, lp, c, lp.prompt_mask(Context(positions, tokens)))
        return self._logits(x)

    def replay_scores(
        self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan,
        span: Int[Array, "b 3"],
    ) -> tuple[Float[Array, "b kvh c"], ...]:
        """KVzip's replay (`kvjax.kvzip`): the tokens extend the read-only `cache` as in `extend` (right padded),
        and each layer returns its cached slots' reconstruction scores for the chunk `span` (sinks, start, end)."""
        x = self.embed(tokens)
        out = []
        for layer, lp, c in zip(self.layers, plan.layers, cache):
            if lp.split or lp.position_mode != "absolute":
                raise ValueError(f"KVzip's replay needs one cache array per layer in absolute positions; "
                                 f"{plan.policy.describe()} has head groups or rolling positions in layer {lp.layer}")
            x, scores = layer.replay(x, positions, lp, c, span)
            out.append(scores)
        return tuple(out)

    def stream(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"],
        cache: Cache,
        plan: Plan,
        *,
        all_logits: bool = True,
    ) -> tuple[Float[Array, "b t V"] | Float[Array, "b V"], Cache]:
        """Feeds `t` tokens one at a time through `decode` in a `lax.scan` (padding: pos -1, a no-op).

        Exact for every policy and position mode: the reference semantics of
        "compress after every token" (StreamingLLM's perplexity protocol). Returns
        all logits `[b, t, V]`, or only the last step's with `all_logits=False`.
        """
        b = tokens.shape[0]

        def body(carry, xs):
            cache, last = carry
            tok, pos = xs
            logits, cache = self.decode(tok, pos, cache, plan)
            return (cache, logits), (logits if all_logits else None)

        init = (cache, jnp.zeros((b, self.cfg.vocab_size), _acc(self.dtype)))
        (cache, last), seq = jax.lax.scan(body, init, (tokens.T, positions.T))
        return (seq.transpose(1, 0, 2) if all_logits else last), cache

    def decode(
        self, tokens: Int[Array, "b"], positions: Int[Array, "b"], cache: Cache, plan: Plan
    ) -> tuple[Float[Array, "b V"], Cache]:
        """One token per row at `positions` through the cache."""
        x = self.embed(tokens[:, None])
        out = []
        for layer, lp, c in zip(self.layers, plan.layers, cache):
            x, c = layer.decode(x, positions, lp, c, tokens)
            out.append(c)
        return self._logits(x[:, 0]), tuple(out)
