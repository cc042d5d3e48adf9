"""Fewer key/value heads for a trained Llama: mean-pool each group of K/V heads into one.

This is the checkpoint conversion of the GQA paper (Ainslie et al., 2023, sec. 2.1): the key and
value projections of the heads that will share a KV head are averaged, the query and output
projections are kept, and the model is then trained on ("uptrained") to recover. kvjax's default
model uses it because induction heads form quickly with one KV head per query head and slowly with
shared ones (see `kvjax.experiments.tasks`): it warms up with MHA and converts before the main stage.

Query head h reads KV head h // (num_heads // num_kv_heads) (`repeat_kv`), so new KV head j is the
mean of old KV heads j * g .. j * g + g - 1 with g = old_kv_heads // new_kv_heads.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
from jaxtyping import Array, Float

from kvjax.models.llama import Llama


def mean_pool_heads(x: Float[Array, "... n"], old_heads: int, new_heads: int, head_dim: int) -> Float[Array, "... m"]:
    """A K/V projection's kernel [D, old_heads * head_dim] or bias [old_heads * head_dim], pooled."""
    *lead, n = x.shape
    if n != old_heads * head_dim:
        raise ValueError(f"last axis {n} != old_heads {old_heads} * head_dim {head_dim}")
    group = old_heads // new_heads
    return x.reshape(*lead, new_heads, group, head_dim).mean(-2).reshape(*lead, new_heads * head_dim)


def to_grouped_query(model: Llama, num_kv_heads: int) -> Llama:
    """A new `Llama` with `num_kv_heads` KV heads whose K/V projections are group means of `model`'s."""
    cfg = model.cfg
    if num_kv_heads < 1 or cfg.num_kv_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide the model's num_kv_heads={cfg.num_kv_heads}")
    out = Llama(dataclasses.replace(cfg, num_kv_heads=num_kv_heads), dtype=model.dtype, rngs=nnx.Rngs(0))
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for layer in state["layers"].values():
        for proj in ("k_proj", "v_proj"):
            p = layer["self_attn"][proj]
            for name in p:
                p[name] = mean_pool_heads(p[name], cfg.num_kv_heads, num_kv_heads, cfg.head_dim)
    params = nnx.state(out, nnx.Param)
    nnx.replace_by_pure_dict(params, state)
    nnx.update(out, params)
    return out
