"""Block expansion (kvjax.models.grow): the grown model computes what the original does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.rope import RopeConfig
from kvjax.models.grow import grow_depth, source_layers
from tests.conftest import random_ids
from kvjax import drive


def test_source_layers_follow_each_layer_with_its_copies():
    assert source_layers(2, 6) == [0, 0, 0, 1, 1, 1]
    assert source_layers(3, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="multiple"):
        source_layers(2, 5)


def test_grown_model_has_the_original_logits_until_its_rope_changes(tiny):
    ids = jnp.asarray([random_ids(40, 260, seed=2)])
    before = np.asarray(drive.logits(tiny.model, ids))
    grown = grow_depth(tiny.model, 6)
    assert grown.cfg.num_layers == 6 and len(grown.layers) == 6
    np.testing.assert_allclose(np.asarray(drive.logits(grown, ids)), before, atol=1e-5, rtol=0)
    # the copies are real layers: their input-side weights equal the source's, their outputs are zero
    src = tiny.model.layers[1].self_attn.q_proj.kernel[...]
    np.testing.assert_array_equal(grown.layers[4].self_attn.q_proj.kernel[...], src)
    assert not np.any(grown.layers[4].self_attn.o_proj.kernel[...])
    assert np.any(grown.layers[3].self_attn.o_proj.kernel[...])
    longer = grow_depth(tiny.model, 4, rope=RopeConfig(theta=40000.0), max_position_embeddings=2048)
    assert longer.cfg.max_position_embeddings == 2048
    assert np.abs(np.asarray(drive.logits(longer, ids)) - before).max() > 1e-3  # a new RoPE base is a new function
