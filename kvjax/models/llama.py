"""Llama in Flax NNX: RMSNorm, RoPE (default / linear / llama3), GQA, SwiGLU, tied or untied head;
with the options of the Llama-family checkpoints kvjax loads (Mistral, Qwen2/3, Baichuan, Gemma 2/3):
per-head q/k norms, Gemma's (1 + w) norms around attention and the MLP, GeGLU, scaled embeddings,
`query_pre_attn_scalar`, soft-capped logits, and per-layer sliding windows and RoPE bases.

The model only computes: its one cached forward `model(tokens, positions, carry, step)` (`kvjax.model.CachedLM`)
runs every layer, whose attention is projection -> `kvjax.layer.attend` -> output projection. kvjax drives the
sequence (`kvjax.drive`: plans, caches, prompts read whole, streamed or chunked, decoding); the model never reads a
policy, a plan or a mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax import attention, backends, layer_runs
from kvjax import layer as layer_fns
from kvjax.rope import RopeConfig, apply_rope, inv_freq
from kvjax.step import Step


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The decoder's shape and options, read from a checkpoint's config.json (or a GGUF file's metadata) by
    `kvjax.models.load`: one config for every family kvjax reads (Llama, Mistral, Qwen2 / 3, Gemma 2 / 3, Phi-3,
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
    # "scan": each run of layers alike is one scanned body (`Llama.__call__`); "unroll": every layer traced. How the
    # program is built, not what it computes; a run-time choice, not saved to config.json
    layer_loop: str = "scan"

    def __post_init__(self):
        attention.check_impl(self.attention_impl)
        if self.layer_loop not in ("scan", "unroll"):
            raise ValueError(f"layer_loop={self.layer_loop!r}; expected 'scan' or 'unroll'")
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

    @property
    def windows(self) -> int | None | tuple[int | None, ...]:
        """Every layer's attention window as `kvjax.policies.on_windows` takes it: one for all layers (`sliding_window`,
        Mistral's; None: the whole context), or one per layer (Gemma 2 / 3's `layer_types`)."""
        if self.layer_types is None:
            return self.sliding_window
        return tuple(self.window_of(i) for i in range(self.num_layers))

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

    def geometry(self, layer: int) -> layer_fns.Geometry:
        """This layer's attention for `kvjax.layer`, as layer `layer` (its index, or the first of the run of layers
        it is scanned with): scale, window, soft-cap, ALiBi slopes, its RoPE and its output projection per query
        head (o_proj's kernel `[h * d, D]` as `[h, d, D]`; none under LoRA, whose o_proj is no plain Linear)."""
        c = self.cfg
        out = self.o_proj.kernel[...].reshape(c.num_heads, c.head_dim, -1) if isinstance(self.o_proj, nnx.Linear) \
            else None
        return layer_fns.Geometry(
            layer=layer, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            scale=self.scale, rope=self._rotate if c.position_embedding == "rope" else None, alibi=self._alibi(),
            window=self.window, softcap=self.softcap, impl=c.attention_impl, out_proj=out)

    def __call__(self, x: Float[Array, "b t D"], pos: Int[Array, "b t"], carry, step: Step,
                 tokens: Int[Array, "b t"] | None, layer: int) -> tuple[Float[Array, "b t D"], object]:
        """Attention of the normed input `x` under `step`, as layer `layer`: projections, `kvjax.layer.attend`, output
        projection. The layer's Attention-Gate (if attached) goes to kvjax as a thunk, run where the step needs its
        flags. The index is an argument, not an attribute, so that layers alike have one structure (`nnx.graphdef`)
        and scan as one body."""
        q, k, v = self.qkv(x)
        gate = None if self.gate is None else functools.partial(self.gate, x, pos)
        o, carry = layer_fns.attend(self.geometry(layer), step, carry, q, k, v, pos, tokens, gate=gate, hidden=x)
        return self._out(o), carry

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

    def __call__(self, x, pos, carry, step: Step, tokens, layer: int):
        a, carry = self.self_attn(self.input_layernorm(x), pos, carry, step, tokens, layer)
        return self._finish(x, a), carry


def stacks_parameters() -> bool:
    """Whether a scanned run of layers (`Llama._scan`) stacks its layers' parameters, or picks each iteration's with a
    `lax.switch` over the layer index. A stack of separate arrays is a copy of them all inside the program: libtpu's
    compile of an 8B model's 64-token question read for a v6e needed the weights twice, more than the chip holds.
    The switch holds at most one layer's copy (`tests/test_tpu_aot.py`), but on the CPU, where memory is the host's,
    the SmolLM2 4K prompt pass ran slower with it than with the stack in side-by-side runs, so the CPU keeps the
    stack. Same arithmetic either way (`tests/test_layer_scan.py` runs both)."""
    return backends.platform() == "cpu"


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

    def __call__(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], carry: tuple, step: Step
                 ) -> tuple[Float[Array, "b V"] | Float[Array, "b t V"], tuple]:
        """The one cached forward (`kvjax.model.CachedLM`): every layer under `step`, each with its entry of `carry`;
        the logits of `step.select` of the final hidden states, and the layers' new carry entries.

        Each run of layers alike in structure and in what the step does with them (`kvjax.layer_runs`) is one
        `lax.scan` over their parameters and stacked carry entries (`cfg.layer_loop == "scan"`), so a program
        compiles one body per run instead of one per layer; "unroll" traces every layer."""
        if len(carry) != self.cfg.num_layers:
            raise ValueError(f"carry has {len(carry)} entries; the model has {self.cfg.num_layers} layers")
        x = self.embed(tokens)
        out = []
        runs = (layer_runs.every_layer(self.cfg.num_layers) if self.cfg.layer_loop == "unroll" else
                layer_runs.split(step.layer_runs(self.cfg.num_layers), self.structure_runs()))
        for start, stop in runs:
            if stop - start == 1:
                x, c = self.layers[start](x, positions, carry[start], step, tokens, start)
                out.append(c)
            else:
                x, cs = self._scan(start, stop, x, positions, carry[start:stop], step, tokens)
                out.extend(cs)
        return self._logits(step.select(x)), tuple(out)

    def structure_runs(self) -> layer_runs.Runs:
        """The runs of neighbouring layers of one structure (`nnx.graphdef`: their modules, shapes, windows, RoPE,
        gates or adapters)."""
        return layer_runs.runs_of([nnx.graphdef(layer) for layer in self.layers])

    def _scan(self, start, stop, x, positions, carry, step, tokens):
        """Layers `start .. stop - 1` as one scanned body over their parameters and stacked carry entries, each
        attending as layer `start` (the step treats them alike); the parameters stacked or picked per iteration
        (`stacks_parameters`)."""
        stack = lambda *xs: jnp.stack(xs)  # noqa: E731
        graph = nnx.graphdef(self.layers[start])
        states = [nnx.state(layer) for layer in self.layers[start:stop]]
        stacked = stacks_parameters()
        params = jax.tree.map(stack, *states) if stacked else jnp.arange(stop - start)
        pick = [lambda s=s: s for s in states]

        def body(x, xs):
            p, c = xs
            state = p if stacked else jax.lax.switch(p, pick)
            return nnx.merge(graph, state)(x, positions, c, step, tokens, start)

        x, cs = jax.lax.scan(body, x, (params, jax.tree.map(stack, *carry)))
        return x, tuple(jax.tree.map(lambda a, i=i: a[i], cs) for i in range(stop - start))
