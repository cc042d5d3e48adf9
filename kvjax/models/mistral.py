"""Mistral: the Llama decoder with GQA and sliding-window attention (`sliding_window` in config.json).

A query attends to its `sliding_window` latest tokens (itself included), as transformers'
sliding-window mask does. Under FullCache a windowed model keeps a `sliding_window`-slot
ring buffer (`FullCache.on_sliding_window`), not the whole context.
"""

from __future__ import annotations

import dataclasses

from kvjax.models.llama import LlamaConfig


def config_from_hf(hf) -> LlamaConfig:
    return dataclasses.replace(
        LlamaConfig.from_hf(hf), sliding_window=getattr(hf, "sliding_window", None), model_type="mistral"
    )
