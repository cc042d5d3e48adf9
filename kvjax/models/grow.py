"""Deeper Llama from a trained one, computing the same function: block expansion.

LLaMA Pro (Wu et al., 2024, sec. 3.2) grows a trained decoder by inserting copies of its blocks
whose output projections (attention `o_proj`, MLP `down_proj`) are zero: a copied block then adds
nothing to the residual stream, so the grown model's logits equal the original's, and training goes
on from a model that already works. kvjax-small starts this way from the embedded default, whose
induction and retrieval heads formed in a warm stage that does not work for deeper models from
scratch (see `kvjax.experiments.tasks`).

Layer i of the grown model copies old layer `i * old // new` (each old layer is followed by its
copies); the first copy of each old layer keeps its output projections, the others are zeroed.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from kvjax.models.llama import Llama

ZEROED = (("self_attn", "o_proj"), ("mlp", "down_proj"))


def source_layers(old: int, new: int) -> list[int]:
    """Old layer copied into each of the `new` layers."""
    if new < old or new % old:
        raise ValueError(f"num_layers={new} must be a multiple of the model's {old} layers")
    return [i * old // new for i in range(new)]


def grow_depth(model: Llama, num_layers: int, **config) -> Llama:
    """A `Llama` of `num_layers` layers (a multiple of the model's) that computes what `model` does.

    `config` replaces other `LlamaConfig` fields of the grown model (e.g. `rope`,
    `max_position_embeddings`, for a longer context); those change the function, of course."""
    cfg = model.cfg
    src = source_layers(cfg.num_layers, num_layers)
    out = Llama(dataclasses.replace(cfg, num_layers=num_layers, **config), dtype=model.dtype, rngs=nnx.Rngs(0))
    old = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    new = dict(old, layers={})
    for i, s in enumerate(src):
        layer = _copy_dicts(old["layers"][s])
        if i and src[i - 1] == s:  # a copy: its block adds zero to the residual stream
            for block, proj in ZEROED:
                layer[block][proj] = {k: jnp.zeros_like(v) for k, v in layer[block][proj].items()}
        new["layers"][i] = layer
    params = nnx.state(out, nnx.Param)
    nnx.replace_by_pure_dict(params, new)
    nnx.update(out, params)
    return out


def _copy_dicts(tree: dict) -> dict:
    return {k: _copy_dicts(v) if isinstance(v, dict) else v for k, v in tree.items()}
