"""Issue 89, items 1, 2, 4, 6, 9 and 14: compiled programs keyed by the model's class, and the model contract checked
where it is broken, on a researcher's own pytree model (`tests/own.py`) and the ways its forward can break it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import drive, engine, scoring
from kvjax.errors import InvalidInput
from kvjax.generate import generate
from kvjax.policies import FullCache, SnapKV, StreamingLLM
from tests import own
from tests.conftest import compile_log

PROMPT = np.random.RandomState(0).randint(3, 61, 40).tolist()


def prompt_logits(model, policy=FullCache()):
    plan = drive.plan(model, policy, 64, len(PROMPT))
    tokens, positions = jnp.asarray([PROMPT], jnp.int32), jnp.arange(len(PROMPT), dtype=jnp.int32)[None]
    return np.asarray(engine.prefill(model, tokens, positions, plan=plan)[0])


def test_contract_two_classes_of_one_structure_compile_their_own_programs():
    """jax 0.10's treedefs of two registered dataclasses with the same fields compare equal, so a compiled program
    keyed by the treedef ran the first class's forward for the second: a subclass that changes the forward
    (`Negated`) and another class with the same fields (`Twin`) got `Own`'s logits. Each now compiles its own."""
    base = own.init()
    a = prompt_logits(base)
    negated = prompt_logits(own.init(own.Negated))
    twin = prompt_logits(own.init(own.Twin))
    assert jax.tree.structure(base) == jax.tree.structure(own.init(own.Twin))  # what made it silent
    np.testing.assert_allclose(negated, -a, rtol=1e-6)
    np.testing.assert_allclose(twin, 2 * a, rtol=1e-6)


def test_contract_the_issues_two_classes_with_one_field_each():
    """The issue's own case, on `kvjax.engine.compiled` directly: `A` computes x @ w, `B` -(x @ w)."""

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class A:
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class B:
        w: jax.Array

        def __call__(self, x):
            return -(x @ self.w)

    @engine.compiled()
    def apply(model, x):
        return model(x)

    w, x = jnp.eye(3) * 2.0, jnp.ones((1, 3))
    assert apply(A(w), x).tolist() == [[2.0, 2.0, 2.0]]
    assert apply(B(w), x).tolist() == [[-2.0, -2.0, -2.0]]
    A.__call__ = lambda self, x: x @ self.w + 1  # a forward replaced on the class is another program too
    assert apply(A(w), x).tolist() == [[3.0, 3.0, 3.0]]


@pytest.mark.parametrize("policy", [FullCache(), SnapKV(budget=16, observation_window=4)], ids=["full", "snapkv"])
def test_contract_a_carry_handed_back_in_another_order_is_refused(policy):
    """Every layer's cache has the same shape here, so entries handed back in reverse order gave wrong tokens with
    no error. A probe over caches of different slot counts per layer finds them, naming both layers."""
    with pytest.raises(InvalidInput, match=r"Swapped's forward returned layer 1's carry entry in layer 0's place"):
        generate(own.init(own.Swapped), [PROMPT], policy, max_new_tokens=4)
    with pytest.raises(InvalidInput, match=r"layer 1's carry entry in layer 0's place"):
        scoring.perplexity(own.init(own.Swapped), PROMPT, StreamingLLM(budget=16, sinks=2, prefill_mode="stream"))


FAULTS = {
    "short": (own.Short, r"Short's forward returned 1 carry entries for its 2 layers \(cfg.num_layers\)"),
    "every-position": (own.EveryPosition, r"EveryPosition's forward returned logits of shape \(1, \d+, 61\) for a "
                                          r"\w+ step, which asks for the last position's \(step.select\(hidden\) "
                                          r"before the head\): shape \(1, 61\)"),
    "reversed": (own.Reversed, r"Reversed's forward returned \(carry, logits\); the contract is \(logits, carry\)"),
    "narrow": (own.Narrow, r"Narrow's forward returned logits of shape \(1, 56\) .*its last axis is 56 wide, not the "
                           r"vocabulary's 61 \(cfg.vocab_size\)"),
    "opaque": (lambda params, cfg: own.Opaque(own.Own(params, cfg)),
               r"a Opaque model is neither a Flax NNX module nor a registered pytree, so jax cannot see its arrays"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("entry", ["generate", "scoring"])
def test_contract_faults_are_named_in_one_line(fault, entry):
    """A forward that breaks the contract ended deep in a compiled loop ("carry input and output must have the same
    pytree structure", "Cannot broadcast to shape", "argmax requires ndarray", "DynamicJaxprTracer has no attribute
    cfg") or, with narrow logits, returned tokens from `generate` and blamed the weights in scoring. Each is now one
    `InvalidInput` naming what the forward returned and what was expected, from `generate` and from scoring."""
    cls, message = FAULTS[fault]
    model = own.init(cls)
    with pytest.raises(InvalidInput, match=message) as err:
        if entry == "generate":
            generate(model, [PROMPT], SnapKV(budget=16, observation_window=4), max_new_tokens=4)
        else:
            scoring.perplexity(model, PROMPT, StreamingLLM(budget=16, sinks=2, prefill_mode="chunked", chunk=8))
    assert "\n" not in str(err.value)


def test_contract_the_kept_contract_still_generates():
    """The checks refuse nothing that keeps the contract: the own model generates and scores."""
    out = generate(own.init(), [PROMPT], SnapKV(budget=16, observation_window=4), max_new_tokens=4)
    assert out.tokens.shape == (1, 4)
    assert np.isfinite(scoring.perplexity(own.init(), PROMPT, StreamingLLM(budget=16, sinks=2, prefill_mode="stream")))


def test_contract_new_tokens_compile_again_only_past_their_power_of_two(tiny):
    """The documented rule (docs/getting-started.md, `kvjax.generate.generate`): the new tokens get a buffer of
    `max_new_tokens` rounded up to a power of two (at least 16), and the cache room after the prompt is that buffer,
    so a count within the same power of two compiles nothing, and one past it compiles the prompt pass and the
    decode loop again (2 programs) where the policy's slot count grows with the room (FullCache, SnapKV), or the
    decode loop alone where it does not (StreamingLLM's ring)."""
    ids = PROMPT[:30]
    model = tiny.model
    for policy, programs in ((FullCache(), 2), (SnapKV(budget=16, observation_window=4), 2),
                             (StreamingLLM(budget=16, sinks=2), 1)):
        generate(model, [ids], policy, max_new_tokens=20)
        with compile_log() as compiled:
            generate(model, [ids], policy, max_new_tokens=30)  # 20 and 30: both in the 32-token buffer
        assert compiled == [], policy
        with compile_log() as compiled:
            generate(model, [ids], policy, max_new_tokens=33)  # past 32: the 64-token buffer
        assert len(compiled) == programs, (policy, compiled)
