"""Attention-Gate (Zeng et al., "In-context KV-cache eviction for LLMs via Attention-Gate").

Before each attention layer, a small attention block MHA' (h' heads of dim d'_k, Xavier
init) reads the layer's input hidden states and projects to one logit per KV head and
token; the keep flag is `sigmoid(logit + gamma) > tau` (eq. 6), trained through a
straight-through estimator (forward exactly binary, backward the sigmoid's gradient).
The flags mask the attention as eq. 7: a key whose flag is 0 is invisible to every
later query; a query always sees its own key. At inference the gate runs at prefill
only: evicted keys are never cached (`kvjax.policies.gate.GateEviction`), decoded tokens
are always kept.

Decisions where the paper leaves room:

* one flag per **KV head** (W^O' maps to `num_kv_heads` outputs): the cache holds KV heads,
  so a per-query-head flag could save no memory under GQA; for MHA this is the paper's
  one flag per attention head;
* MHA' is **causal** and uses the model's RoPE: a token's flag never depends on later
  tokens. A bidirectional gate would, during training, let the flags of context tokens
  depend on the very targets the LM loss predicts, and at inference the decode tokens
  that follow a prompt are not there yet;
* the gate reads the same RMS-normalised hidden states as the attention projections;
* the eviction loss `alpha * |mean(AG) - beta|` (eq. 1) averages the (STE) flags over
  every real token, KV head and layer.

`attach_gates(model, cfg)` adds a gate to every attention layer; `save_gates` /
`load_gates` keep them apart from the base checkpoint (a directory with `gate.json` and
`gate.safetensors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax import attention
from kvjax.errors import InvalidInput, MissingFile
from kvjax.rope import RopeConfig, apply_rope, inv_freq


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """The gate's shape and the paper's hyper-parameters (see `PRESETS`)."""

    heads: int = 4  # h'
    head_dim: int | None = None  # d'_k; None: the model's head_dim
    tau: float = 0.5  # keep if sigmoid(x + gamma) > tau
    gamma: float = 2.0  # >= 0: initial keep probabilities near 1
    alpha: float = 5.0  # weight of the eviction loss
    beta: float = 0.4  # target mean keep flag, in [0, tau]

    def __post_init__(self):
        if not 0 < self.tau < 1:
            raise ValueError(f"GateConfig: tau={self.tau} must be in (0, 1)")
        if not 0 <= self.beta <= self.tau:
            raise ValueError(f"GateConfig: beta={self.beta} must be in [0, tau={self.tau}]")
        if self.gamma < 0 or self.alpha < 0:
            raise ValueError(f"GateConfig: gamma={self.gamma} and alpha={self.alpha} must be >= 0")
        if self.heads < 1 or (self.head_dim is not None and self.head_dim < 1):
            raise ValueError(f"GateConfig: heads={self.heads} and head_dim={self.head_dim} must be >= 1")


# Section 4.1 (continual pre-training, base frozen) and 4.2 (fine-tuning with LoRA; alpha 1 or 0.5).
PRESETS = {
    "cpt": GateConfig(tau=0.5, gamma=2.0, alpha=5.0, beta=0.4),
    "sft": GateConfig(tau=0.3, gamma=0.0, alpha=1.0, beta=0.28),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def ste_flags(x: Float[Array, "..."], gamma: float, tau: float) -> Float[Array, "..."]:
    """Keep flags `sigmoid(x + gamma) > tau` as exact 0 / 1 values whose gradient is the
    sigmoid's (the straight-through estimator)."""
    return (jax.nn.sigmoid(x + gamma) > tau).astype(x.dtype)


def _ste_fwd(x, gamma, tau):
    p = jax.nn.sigmoid(x + gamma)
    return (p > tau).astype(x.dtype), p


def _ste_bwd(gamma, tau, p, g):
    return (g * p * (1 - p),)


ste_flags.defvjp(_ste_fwd, _ste_bwd)


class AttentionGate(nnx.Module):
    """MHA' + gate: hidden states `[b, t, D]` -> keep flags `[b, kv_heads, t]`."""

    def __init__(self, hidden: int, kv_heads: int, head_dim: int, cfg: GateConfig, rope: RopeConfig | None, *,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        dk = cfg.head_dim or head_dim
        xavier = nnx.initializers.xavier_uniform()
        lin = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=dtype, kernel_init=xavier,
                                rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj = (lin(hidden, cfg.heads * dk) for _ in range(3))
        self.o_proj = lin(cfg.heads * dk, kv_heads)
        self.cfg, self.head_dim, self.rope = cfg, dk, rope

    def logits(self, x: Float[Array, "b t D"], pos: Int[Array, "b t"]) -> Float[Array, "b kvh t"]:
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.cfg.heads, self.head_dim).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if self.rope is not None:
            freq = inv_freq(self.rope, self.head_dim, np.float32)
            q, k = apply_rope(q, pos[:, None], freq), apply_rope(k, pos[:, None], freq)
        o, _ = attention.prefill_attention(q, k, v, pos, pos, scale=self.head_dim**-0.5, self_attention=True)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, -1)).transpose(0, 2, 1).astype(jnp.float32)

    def __call__(self, x: Float[Array, "b t D"], pos: Int[Array, "b t"]) -> Float[Array, "b kvh t"]:
        return ste_flags(self.logits(x, pos), self.cfg.gamma, self.cfg.tau)


def eviction_loss(flags: list[Float[Array, "b kvh t"]], real: Float[Array, "b t"], cfg: GateConfig):
    """Eq. 1, `alpha * |mean(AG) - beta|`, and the mean keep flag (over real tokens, heads, layers)."""
    w = real.astype(jnp.float32)[:, None, :]
    kept = sum(jnp.sum(f * w) for f in flags) / (len(flags) * flags[0].shape[1] * jnp.maximum(jnp.sum(w), 1.0))
    return cfg.alpha * jnp.abs(kept - cfg.beta), kept


def eviction_ratios(flags: list[Array], real: Array) -> np.ndarray:
    """`[layers, kv_heads]` fraction of the real tokens each head evicts."""
    w = np.asarray(real, np.float32)[:, None, :]
    return np.stack([1.0 - (np.asarray(f, np.float32) * w).sum((0, 2)) / max(w.sum(), 1.0) for f in flags])


# ---- attaching, saving, loading ----


def _attention_layers(model):
    return [layer.self_attn for layer in model.layers]


def attach_gates(model, cfg: GateConfig, *, seed: int = 0):
    """Adds a fresh gate to every attention layer of `model` (in place; returns it)."""
    c = model.cfg
    rope = c.rope if c.position_embedding == "rope" else None
    rngs = nnx.Rngs(seed)
    for attn in _attention_layers(model):
        attn.gate = AttentionGate(c.hidden_size, c.num_kv_heads, c.head_dim, cfg, rope, dtype=model.dtype, rngs=rngs)
    return model


@contextlib.contextmanager
def without_gates(model):
    """The model with its gates detached inside the block (the base model, same weights)."""
    layers = _attention_layers(model)
    gates = [a.gate for a in layers]
    try:
        for a in layers:
            a.gate = None
        yield model
    finally:
        for a, g in zip(layers, gates):
            a.gate = g


def gate_config(model) -> GateConfig | None:
    gate = _attention_layers(model)[0].gate
    return None if gate is None else gate.cfg


def _shape(model) -> dict:
    c = model.cfg
    return {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "num_kv_heads": c.num_kv_heads}


def _flat(model) -> dict[str, np.ndarray]:
    out = {}
    for i, attn in enumerate(_attention_layers(model)):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"layers.{i}.{name}"] = np.asarray(getattr(attn.gate, name).kernel[...])
    return out


def save_gates(model, path: str | Path) -> Path:
    """Writes the gates of `model` to `path/gate.json` + `path/gate.safetensors`."""
    from safetensors.numpy import save_file

    cfg = gate_config(model)
    if cfg is None:
        raise ValueError("the model has no Attention-Gates to save (attach_gates or load_gates first)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_flat(model), str(path / "gate.safetensors"))
    (path / "gate.json").write_text(json.dumps({"config": dataclasses.asdict(cfg), "model": _shape(model)}, indent=2))
    return path


def load_gates(model, path: str | Path, **overrides):
    """Attaches the gates saved in `path` to `model` (in place; returns it). `overrides` replace
    saved hyper-parameters (e.g. `tau=`) and are validated like any GateConfig."""
    from safetensors.numpy import load_file

    path = Path(path)
    meta_file, weights = path / "gate.json", path / "gate.safetensors"
    for f in (meta_file, weights):
        if not f.is_file():
            raise MissingFile(f"{f} not found: --gate-params must be a directory written by "
                              "kvjax.experiments.train_gate (gate.json + gate.safetensors)")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidInput(f"{meta_file} is not valid JSON ({err})") from None
    if meta["model"] != _shape(model):
        raise ValueError(f"the gates in {path} were trained for a model with {meta['model']}, this model has "
                         f"{_shape(model)}")
    cfg = dataclasses.replace(GateConfig(**meta["config"]), **overrides)
    attach_gates(model, cfg)
    arrays = load_file(str(weights))
    expected = _flat(model)
    if set(arrays) != set(expected):
        raise ValueError(f"{weights} holds {sorted(set(arrays) ^ set(expected))[:4]}... that do not match the gates "
                         f"of {cfg}")
    for i, attn in enumerate(_attention_layers(model)):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key, var = f"layers.{i}.{name}", getattr(attn.gate, name).kernel
            if arrays[key].shape != var[...].shape:
                raise ValueError(f"{weights}: {key} is {arrays[key].shape}, the gate expects {var[...].shape}")
            var.set_value(jnp.asarray(arrays[key], var[...].dtype))
    return model
