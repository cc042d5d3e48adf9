"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences, read from config.json.

Shared: embeddings times sqrt(hidden_size); RMSNorm as `(1 + w) * norm(x)` in float32; a norm after
attention and around the MLP as well as before attention (`sandwich_norm`); GeGLU with the tanh
approximation of gelu; scores scaled by `query_pre_attn_scalar ** -0.5`; tied embeddings; layers
alternating sliding-window ("sliding_attention") and global attention as `layer_types` says.
Gemma 2 also soft-caps attention and final logits; Gemma 3 normalises q and k per head and gives
sliding layers their own RoPE (`rope_parameters["sliding_attention"]`, the old `rope_local_base_freq`).
A Gemma 3 config that sets `attn_logit_softcapping` is refused: transformers' Gemma 3 ignores the field.

Under a cache policy, the sliding layers keep a `sliding_window`-slot ring and the policy
compresses the global layers (`kvjax.drive.plan`), as kvpress does on Gemma 3.
"""

from __future__ import annotations

from kvjax.errors import InvalidInput
from kvjax.rope import RopeConfig
from kvjax.models.llama import LlamaConfig


def config_from_hf(hf) -> LlamaConfig:
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise InvalidInput(f"hidden_activation={act!r}: kvjax's Gemma supports gelu_pytorch_tanh")
    model_type = hf.model_type
    cap = getattr(hf, "attn_logit_softcapping", None)
    if model_type == "gemma3_text" and cap is not None:
        # transformers' Gemma 3 reads the field and never applies it (Gemma 3 replaced Gemma 2's cap by
        # q/k norms), so a checkpoint that sets it ran uncapped there; applying it gave logits 1.45 off,
        # ignoring it would run another model than the config says. Neither silently: refuse.
        raise InvalidInput(f"a gemma3_text config with attn_logit_softcapping={cap!r}: Gemma 3 has no attention "
                           "soft-capping (transformers ignores the field, so kvjax cannot tell which model was "
                           "meant); set it to null in config.json to run the model as transformers does")
    rope = getattr(hf, "rope_parameters", None) or {}
    # the same RoPE-parameter path as every family (LongRoPE's default factor from the context extension)
    ctx = (hf.max_position_embeddings, getattr(hf, "original_max_position_embeddings", None))
    if "full_attention" in rope:  # Gemma 3: one RoPE per layer type
        global_rope = RopeConfig.from_hf(rope["full_attention"], getattr(hf, "rope_theta", 1_000_000.0), *ctx)
        local_rope = RopeConfig.from_hf(rope.get("sliding_attention"), getattr(hf, "rope_local_base_freq", 10_000.0),
                                        *ctx)
    else:
        global_rope = RopeConfig.from_hf(rope or getattr(hf, "rope_scaling", None), getattr(hf, "rope_theta", 10000.0),
                                         *ctx)
        local_rope = None
    types = tuple(hf.layer_types) if getattr(hf, "layer_types", None) else None
    sliding = bool(types) and "sliding_attention" in types
    return LlamaConfig.from_hf(
        hf,
        rope=global_rope,
        local_rope=local_rope if local_rope != global_rope else None,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        sliding_window=hf.sliding_window if sliding else None,
        layer_types=types if sliding else None,
        qk_norm=model_type == "gemma3_text",
        gemma_norm=True,
        sandwich_norm=True,
        hidden_act="gelu_pytorch_tanh",
        embed_scale=True,
        query_pre_attn_scalar=getattr(hf, "query_pre_attn_scalar", None),
        attn_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
        model_type=model_type,
    )


def multimodal_error() -> InvalidInput:
    return InvalidInput("model_type 'gemma3' is Gemma 3's image-text checkpoint; kvjax loads the text models "
                        "(model_type 'gemma3_text', e.g. gemma-3-1b) and Gemma 2")


__all__ = ["config_from_hf", "multimodal_error"]
