"""Qwen2: the Llama decoder with biases on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

import dataclasses

from kvjax.models.llama import LlamaConfig


def config_from_hf(hf) -> LlamaConfig:
    if getattr(hf, "use_sliding_window", False):
        raise ValueError(
            "Qwen2 with use_sliding_window=True (sliding window on some layers only) is not supported"
        )
    return dataclasses.replace(LlamaConfig.from_hf(hf), qkv_bias=True, o_bias=False, model_type="qwen2")
