"""A prompt recached from a captured pass (`kvjax.drive.capture` / `recache`, the steps `Capture` / `Recache`), how
`generate_many` caches more plans than one shared pass holds: each plan's cache and the logits of one shared pass
(`drive.shared`), for plans that read every prompt statistic, and a compiled recache that runs none of the
model's forward."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from kvjax import drive
from kvjax.errors import InvalidInput
from kvjax.generate import pad_left
from kvjax.policies import H2O, TOVA, CriticalKV, ExpectedAttention, FullCache, KNorm, KVzap, SnapKV, StreamingLLM
from kvjax.surrogate import Surrogate
from tests.conftest import random_ids

MLP = 176  # the test model's MLP width and vocabulary: shapes no other array of these programs has
VOCAB = 260


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvjax.models import load
    from kvjax.models.tiny import make_random_checkpoint, tiny_config

    cfg = tiny_config(num_layers=3, intermediate_size=MLP)
    assert cfg.vocab_size == VOCAB
    return load(make_random_checkpoint(tmp_path_factory.mktemp("recache"), cfg, seed=3, init_std=0.3)).model


def kvzap() -> KVzap:
    rng = np.random.RandomState(4)
    layers = tuple({"w": rng.randn(64, 2) / 8, "b": np.zeros(2)} for _ in range(3))
    return KVzap(surrogate=Surrogate("linear", layers), threshold=0.0, window=8)


# every statistic a prompt pass gives a rule: none, the keys' norms, the accumulated attention (colsum), the last
# queries' window, the last query, the future queries' moments, the values through W_o, the attention input
POLICIES = [FullCache(), StreamingLLM(budget=12, sinks=2), KNorm(budget=12), H2O(budget=12, recent=4),
            SnapKV(budget=12, observation_window=4, kernel=3), TOVA(budget=12), ExpectedAttention(ratio=0.5),
            CriticalKV(scorer=KNorm(budget=12)), kvzap()]


def prompt(length: int = 40):
    tokens, positions = pad_left([random_ids(length, VOCAB, seed=30), random_ids(length * 2 // 3, VOCAB, seed=31)],
                                 length, 0)
    return np.asarray(tokens), np.asarray(positions)


def test_recached_caches_are_those_of_one_shared_pass(model):
    """Bit for bit, on prompts longer than one attention block (`kvjax.reference.PREFILL_BLOCK`), as an evaluation's
    are: there the column sums are accumulated block by block in both programs. (In a prompt of one block, XLA may
    fold the pass's sum over the queries and H2O's over the group's heads into one reduction, and the masses then
    differ in their last bit from the recache's, which sums the captured sums.)"""
    tokens, positions = prompt(600)
    plans = tuple(drive.plan(model, p, 640, 600) for p in POLICIES)
    logits, caches = jax.jit(lambda t, p: drive.shared(model, t, p, plans))(tokens, positions)
    first, captured = jax.jit(lambda t, p: drive.capture(model, t, p, hidden=True, colsum=True))(tokens, positions)
    again = jax.jit(lambda t, p, c: drive.recache(model, t, p, c, plans))(tokens, positions, captured)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(logits))
    assert len(again) == len(plans)
    for policy, want, got in zip(POLICIES, caches, again):
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=policy.describe())
    # the attention input and the column sums are kept only when asked for; KVzap, which reads the input, and H2O,
    # which reads the sums, refuse a capture without them
    _, bare = jax.jit(lambda t, p: drive.capture(model, t, p))(tokens, positions)
    assert all(layer[3] is None and layer[4] is None for layer in bare)
    reads_hidden = [any(lp.prefill_stats().hidden for lp in p.layers) for p in plans]
    assert reads_hidden == [False] * (len(plans) - 1) + [True]
    with pytest.raises(InvalidInput, match="gives none"):
        drive.recache(model, tokens, positions, bare, plans[-1:])
    with pytest.raises(InvalidInput, match="column sums"):
        drive.recache(model, tokens, positions, bare, plans[3:4])


def forward_arrays(text: str) -> list[str]:
    """The shapes in compiled HLO text of the model's own arrays: the MLP's weights (`[64, MLP]`, `[MLP, 64]`, stacked
    or not) and activations (`[2, 40, MLP]`), the embedding or head (`[VOCAB, 64]`, `[64, VOCAB]`), the logits."""
    mlp = rf"\w+\[(?:\d+,)*(?:64,{MLP}|{MLP},64)\]|\w+\[2,40,{MLP}\]"
    vocab = rf"\w+\[(?:\d+,)*(?:{VOCAB},64|64,{VOCAB})\]|\w+\[2,(?:40,)?{VOCAB}\]"
    return re.findall(mlp, text) + re.findall(vocab, text)


def test_a_compiled_recache_runs_none_of_the_forward(model):
    """Nothing the model computes reaches a recache's caches, so XLA keeps none of it: no weight or activation of
    the MLP, embedding or head in the compiled program (the capture, a forward, has them), and no attention of the
    whole prompt (no `[.., 40, 40]` probabilities: H2O's column sums come from the capture)."""
    tokens, positions = prompt()
    plans = tuple(drive.plan(model, p, 64, 40) for p in POLICIES[:-1])
    capture = jax.jit(lambda t, p: drive.capture(model, t, p, colsum=True))
    captured = capture(tokens, positions)[1]
    text = jax.jit(lambda t, p, c: drive.recache(model, t, p, c, plans)).lower(tokens, positions, captured)
    text = text.compile().as_text()
    assert forward_arrays(text) == [] and re.findall(r"\w+\[(?:\d+,)*40,40\]", text) == []
    forward = forward_arrays(capture.lower(tokens, positions).compile().as_text())
    assert any(str(MLP) in f for f in forward) and any(str(VOCAB) in f for f in forward)
