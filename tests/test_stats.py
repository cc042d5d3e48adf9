"""The typed attention-statistics contract (kvjax.stats): requests are static and composable, results
are pytrees holding only what was asked for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax.policies.compose import ByLayer, HeadSplit
from kvjax.policies.h2o import H2O
from kvjax.policies.mat import mat
from kvjax.policies.plan import resolve
from kvjax.policies.scored import SnapKV
from kvjax.stats import NO_STATS, AttentionStats, StatsRequest


def test_requests_are_static_values_that_compose():
    a, b = StatsRequest(colsum=True), StatsRequest.last(8) | StatsRequest.last(2)
    assert (a | b) == StatsRequest(colsum=True, last_queries=frozenset({2, 8}))
    assert hash(a | b) == hash(StatsRequest(colsum=True, last_queries={8, 2}))  # a jit static key
    assert not NO_STATS and (a | b) and (a | b).names() == ["colsum", "last_probs[2]", "last_probs[8]"]
    for bad in ({0}, {2.5}, {True}):
        with pytest.raises(ValueError, match="last_queries"):
            StatsRequest(last_queries=bad)


def test_a_combinator_asks_for_what_its_members_ask():
    """A layer split by heads asks the union of its groups' requests (its plan answers: the split is no rule);
    a layer split resolves to its member's."""
    snap, h2o = SnapKV(budget=8, observation_window=4), H2O(budget=8, recent=4)
    heads = resolve(HeadSplit(layers=((((0,), snap), ((1,), h2o)),)), 1, 2).layers[0]
    assert heads.prefill_stats() == StatsRequest(colsum=True, last_queries=frozenset({4}))
    assert heads.decode_stats() == StatsRequest(probs=True)
    layers = ByLayer(split=1, shallow=snap, deep=mat(8, 2, prefill_mode="full"))
    assert layers.at_layer(0).stats(0).prefill == StatsRequest.last(4)
    assert layers.at_layer(3).stats(3).prefill == layers.at_layer(3).stats(3).decode == StatsRequest(first_logit=True)


def test_attention_returns_exactly_the_request_and_jit_carries_it():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)])
    pos = jnp.arange(6)[None]
    run = jax.jit(lambda q, k, v: attention.prefill_attention(q, k, v, pos, pos, scale=8**-0.5,
                                                              stats=StatsRequest.last(3)))
    _, stats = run(q, k, v)
    assert isinstance(stats, AttentionStats) and stats.colsum is None and stats.first_logit is None
    assert stats.last(3).shape == (1, 2, 2, 3, 6)
    # hand check: the last query's probabilities over the 6 keys of head 0
    s = np.einsum("d,kd->k", np.asarray(q[0, 0, 5]), np.asarray(k[0, 0])) * 8**-0.5
    np.testing.assert_allclose(stats.last(3)[0, 0, 0, 2], np.exp(s - s.max()) / np.exp(s - s.max()).sum(),
                               rtol=1e-5)
    with pytest.raises(KeyError, match=r"last_probs\[4\] was not requested; computed: \[3\]"):
        stats.last(4)
    with pytest.raises(ValueError, match="probs"):
        attention.prefill_attention(q, k, v, pos, pos, scale=1.0, stats=StatsRequest(probs=True))
    with pytest.raises(ValueError, match=r"decode_attention cannot compute statistics \['colsum'\]"):
        attention.decode_attention(q[:, :, 0], k, v, jnp.broadcast_to(pos[:, None], (1, 2, 6)),
                                   jnp.zeros((1, 2, 6)), scale=1.0, stats=StatsRequest(colsum=True))
