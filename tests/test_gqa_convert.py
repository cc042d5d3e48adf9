"""MHA -> GQA conversion by mean-pooling K/V heads (kvjax.models.gqa)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from kvjax.models.gqa import mean_pool_heads, to_grouped_query
from kvjax.models.llama import Llama
from kvjax.models.tiny import tiny_config
from kvjax import drive


def test_mean_pool_heads_averages_consecutive_heads():
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 12)  # [D=2, 4 heads x head_dim 3]
    y = np.asarray(mean_pool_heads(x, 4, 2, 3))
    heads = x.reshape(2, 4, 3)
    np.testing.assert_allclose(y.reshape(2, 2, 3), np.stack([heads[:, :2].mean(1), heads[:, 2:].mean(1)], 1))


def test_converted_model_is_exact_when_the_pooled_heads_were_equal():
    """If the heads of each group already share K/V, GQA gives the same logits; otherwise it differs."""
    model = Llama(tiny_config(num_heads=4, num_kv_heads=4), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(4, 200, (2, 24)).astype(np.int32)
    changed = to_grouped_query(model, 2)
    assert changed.cfg.num_kv_heads == 2 and changed.layers[0].self_attn.k_proj.kernel.shape == (64, 32)
    assert np.abs(np.asarray(drive.logits(changed, tokens)) - np.asarray(drive.logits(model, tokens))).max() > 1e-3
    for layer in model.layers:  # make heads (0, 1) and (2, 3) share K and V
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            k = np.asarray(proj.kernel.get_value()).reshape(64, 2, 2, 16)
            proj.kernel.set_value(np.repeat(k[:, :, :1], 2, axis=2).reshape(64, 64))
    np.testing.assert_allclose(np.asarray(drive.logits(to_grouped_query(model, 2), tokens)), np.asarray(drive.logits(model, tokens)), atol=1e-5)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide the model's num_kv_heads=4"):
        to_grouped_query(model, 3)
