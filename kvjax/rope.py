"""Rotary position embeddings (HF Llama convention: rotate halves, not pairs).

Inverse frequencies are computed once in NumPy float32 from the model config,
exactly as `transformers.modeling_rope_utils` does, so that logits match the
PyTorch models to float32 round-off. Positions are arrays, so the same code
rotates keys at their absolute positions or at their rank in a cache.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Hashable RoPE parameters (a static part of the model config)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # LongRoPE (Phi-3's "su"): per-frequency factors below / above `original_max_position_embeddings`,
    # and the factor cos and sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; kvjax supports {SUPPORTED_ROPE_TYPES}"
            )

    @classmethod
    def from_hf(cls, params: dict | None, default_theta: float = 10000.0, max_position_embeddings: int | None = None,
                original_max_position_embeddings: int | None = None) -> "RopeConfig":
        """Reads transformers' `rope_parameters` (v5) or `rope_scaling` (v4) dict."""
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "su":  # Phi-3's name for LongRoPE
            rope_type = "longrope"
        if rope_type == "longrope":
            old = int(params.get("original_max_position_embeddings") or original_max_position_embeddings)
            factor = params.get("factor") or (max_position_embeddings or old) / old
            # transformers' default: sqrt(1 + ln(factor) / ln(original)) when the context was extended.
            att = params.get("attention_factor")
            if att is None:
                att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
            return cls(theta=float(params.get("rope_theta", default_theta)), rope_type="longrope",
                       original_max_position_embeddings=old, short_factor=tuple(map(float, params["short_factor"])),
                       long_factor=tuple(map(float, params["long_factor"])), attention_factor=float(att))
        kw = dict(theta=float(params.get("rope_theta", default_theta)), rope_type=rope_type)
        if rope_type in ("linear", "llama3"):
            kw["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kw["low_freq_factor"] = float(params["low_freq_factor"])
            kw["high_freq_factor"] = float(params["high_freq_factor"])
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return cls(**kw)

    def to_hf(self) -> dict:
        out = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out


def inv_freq(cfg: RopeConfig, head_dim: int, dtype=np.float32, long: bool = False) -> np.ndarray:
    """[head_dim // 2] inverse frequencies after any scaling: float32 as transformers computes
    them, or float64 for float64 models. LongRoPE: `long` picks the factors of sequences longer
    than `original_max_position_embeddings`."""
    dtype = np.dtype(dtype)
    if cfg.rope_type == "longrope":
        ext = np.asarray(cfg.long_factor if long else cfg.short_factor, dtype)
        if ext.shape != (head_dim // 2,):
            raise ValueError(f"longrope factors have {ext.size} entries; head_dim={head_dim} needs {head_dim // 2}")
        return (1.0 / (ext * cfg.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(dtype) / head_dim))
                ).astype(dtype)
    freq = 1.0 / (cfg.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(dtype) / head_dim))
    freq = freq.astype(dtype)
    if cfg.rope_type == "linear":
        freq = freq / np.float32(cfg.factor)
    elif cfg.rope_type == "llama3":
        old = cfg.original_max_position_embeddings
        low_wavelen = old / cfg.low_freq_factor
        high_wavelen = old / cfg.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / cfg.factor, freq)
        smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freq = np.where(medium, smoothed, scaled).astype(dtype)
    return freq


def apply_rope(
    x: Float[Array, "*batch t d"], positions: Int[Array, "*batch t"], freq, scale: float = 1.0
) -> Float[Array, "*batch t d"]:
    """Rotates `x` by `positions` (any integer array broadcastable to x[..., 0]); `scale` multiplies
    cos and sin (LongRoPE's attention factor)."""
    dt = jnp.promote_types(x.dtype, jnp.float32)
    angles = positions[..., None].astype(dt) * jnp.asarray(freq, dt)  # [..., t, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(dt)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
