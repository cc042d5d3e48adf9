"""Phi-3: the Llama decoder with fused projections and LongRoPE.

Its checkpoints fuse q/k/v into `qkv_proj` (rows: the q heads, then the k heads, then the v heads)
and gate/up into `gate_up_proj` (gate rows first); `Phi3Tensors` presents them under the Llama
names the loader expects. LongRoPE ("su" / "longrope" in `rope_scaling`) scales each frequency by
its short factor, or by its long factor once a call reaches past `original_max_position_embeddings`
(transformers' switch), and multiplies cos and sin by the attention factor. A `sliding_window` in
config.json applies to every layer, as in Mistral. Partial rotary embeddings (Phi-4-mini's
`partial_rotary_factor` < 1) are refused.
"""

from __future__ import annotations

import numpy as np

from kvjax.errors import InvalidInput
from kvjax.rope import RopeConfig
from kvjax.models.llama import LlamaConfig


def config_from_hf(hf) -> LlamaConfig:
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise InvalidInput(f"partial_rotary_factor={partial}: kvjax's Phi-3 rotates whole heads only")
    return LlamaConfig.from_hf(
        hf,
        rope=RopeConfig.from_hf(rope, getattr(hf, "rope_theta", 10000.0), hf.max_position_embeddings,
                                getattr(hf, "original_max_position_embeddings", None)),
        sliding_window=getattr(hf, "sliding_window", None),
        model_type="phi3",
    )


class Phi3Tensors:
    """Presents a Phi-3 checkpoint under Llama names: `qkv_proj` split into q/k/v, `gate_up_proj`
    into gate/up (row slices of the fused weight)."""

    def __init__(self, inner, cfg: LlamaConfig):
        self.inner, self.files = inner, inner.files
        h, kvh, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        q, kv = h * d, kvh * d
        self._parts = {  # Llama suffix -> (fused suffix, row slice)
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", slice(0, q)),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", slice(q, q + kv)),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", slice(q + kv, q + 2 * kv)),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", slice(0, f)),
            "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", slice(f, 2 * f)),
        }
        self._rows = {"self_attn.qkv_proj.weight": q + 2 * kv, "mlp.gate_up_proj.weight": 2 * f}  # fused rows

    def _split(self, name: str):
        for suffix, (fused, rows) in self._parts.items():
            if name.endswith(suffix):
                return name[: -len(suffix)] + fused, rows
        return name, None

    def source(self, name: str) -> str:
        return self._split(name)[0]

    def names(self) -> set[str]:
        out = set()
        for n in self.inner.names():
            fused = [s for s, (f, _) in self._parts.items() if n.endswith(f)]
            out |= {n[: -len(self._parts[s][0])] + s for s in fused} if fused else {n}
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        src, rows = self._split(name)
        got = self.inner.shape(src)
        if rows is None:
            return got
        want = next(n for suffix, n in self._rows.items() if src.endswith(suffix))
        if got[0] != want:
            raise InvalidInput(f"weight {src!r} in {self.inner.file(src).name} has {got[0]} rows, but config.json "
                               f"implies {want}")
        return (rows.stop - rows.start, *got[1:])

    def file(self, name: str):
        return self.inner.file(self.source(name))

    def get(self, name: str) -> np.ndarray:
        src, rows = self._split(name)
        arr = self.inner.get(src)
        return arr if rows is None else arr[rows]


__all__ = ["Phi3Tensors", "config_from_hf"]
