"""LoRA (Hu et al. 2021) as a small pure-JAX adapter: `y = x W + (x A) B * alpha / r`.

Attention-Gate's fine-tuning (Section 4.2) trains LoRA on q/k/v/o together with the gates.
`attach_lora` wraps those projections in place (A: normal(1/r) init, B: zeros, so the
model is unchanged at step 0); train the parameters whose path matches `LORA_PATTERN`;
`merge_lora` folds `A B * alpha / r` into the base kernels and removes the adapters, so
inference runs the plain model at no extra cost.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_PATTERN = r"lora_[ab]$"  # for TrainConfig.trainable


class LoRALinear(nnx.Module):
    """`base` (an nnx.Linear, frozen by the caller) plus a rank-`rank` update."""

    def __init__(self, base: nnx.Linear, rank: int, alpha: float, *, rngs: nnx.Rngs):
        if rank < 1:
            raise ValueError(f"LoRA: rank={rank} must be >= 1")
        d_in, d_out = base.kernel[...].shape
        dtype = base.kernel[...].dtype
        self.base = base
        self.lora_a = nnx.Param(nnx.initializers.normal(1.0 / rank)(rngs.params(), (d_in, rank), dtype))
        self.lora_b = nnx.Param(jnp.zeros((rank, d_out), dtype))
        self.scale = alpha / rank

    def __call__(self, x: Float[Array, "... i"]) -> Float[Array, "... o"]:
        return self.base(x) + (x @ self.lora_a[...]) @ self.lora_b[...] * self.scale

    def merged(self) -> nnx.Linear:
        self.base.kernel.set_value(self.base.kernel[...] + self.lora_a[...] @ self.lora_b[...] * self.scale)
        return self.base


def attach_lora(model, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = TARGETS, *, seed: int = 0):
    """Wraps the attention projections `targets` of every layer (in place; returns the model)."""
    rngs = nnx.Rngs(seed)
    for i, layer in enumerate(model.layers):
        for name in targets:
            base = getattr(layer.self_attn, name)
            if isinstance(base, LoRALinear):
                raise ValueError(f"{name} of layer {i} already has a LoRA adapter")
            setattr(layer.self_attn, name, LoRALinear(base, rank, alpha, rngs=rngs))
    return model


def merge_lora(model):
    """Folds every adapter into its base kernel and removes it (in place; returns the model)."""
    for layer in model.layers:
        for name in TARGETS:
            mod = getattr(layer.self_attn, name)
            if isinstance(mod, LoRALinear):
                setattr(layer.self_attn, name, mod.merged())
    return model
