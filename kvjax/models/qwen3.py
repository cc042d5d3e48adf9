"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head's q and k before RoPE, no q/k/v
bias, and a `head_dim` independent of hidden size and heads. With `use_sliding_window`, the layers
its `layer_types` marks "sliding_attention" see the `sliding_window` latest tokens."""

from __future__ import annotations

import dataclasses

from kvjax.models.llama import LlamaConfig


def config_from_hf(hf) -> LlamaConfig:
    cfg = dataclasses.replace(LlamaConfig.from_hf(hf), qk_norm=True, model_type="qwen3")
    types = tuple(getattr(hf, "layer_types", None) or ())
    if getattr(hf, "use_sliding_window", False) and "sliding_attention" in types:
        cfg = dataclasses.replace(cfg, layer_types=types, sliding_window=hf.sliding_window)
    return cfg
