"""The model contract, checked where it is broken: what a forward returns, against what kvjax asked for.

A model kvjax drives returns `(logits, carry)` from `model(tokens, positions, carry, step)` (`kvjax.model.CachedLM`).
A forward that breaks the contract used to fail deep inside a compiled loop (a `while_loop`'s "carry input and output
must have the same pytree structure", "Cannot broadcast", "argmax requires ndarray"), or not at all: carry entries
handed back in another order, when every layer's cache has the same shape, gave wrong tokens without an error. So:

- `forward` calls the model and checks its outputs against the step, from shapes alone (at trace time: free at run
  time): a pair `(logits, carry)`; logits of the step's positions (`step.select`: the last, or every one) over the
  whole vocabulary (`cfg.vocab_size`); one carry entry per layer (`cfg.num_layers`), each of the structure and shapes
  it went in with where the step hands the cache back (a prompt, a chunk, a token, an extension).
- `check_layer_order` asks the model once per structure (`kvjax.structure.Structure`: class, tree, forward) for one
  decode step over caches whose slot counts differ layer by layer (`jax.eval_shape`: traced, never run), so an entry
  handed back in another layer's place shows by its shape: the layer index each entry was built for.

Every failure is a `kvjax.errors.InvalidInput` naming the model's class, what it returned and what was expected.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import layer, structure
from kvjax import step as steps
from kvjax.errors import InvalidInput
from kvjax.policies.plan import resolve
from kvjax.policies.ring import FullCache

# Steps whose carry entries come back with the structure and shapes they went in with (a cache in, the cache out).
MIRRORED = (steps.Prompt, steps.Shared, steps.Chunk, steps.Token, steps.Append)


def _shape(x) -> str:
    return str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__


def _signature(entry):
    """What identifies a carry entry's layout: its tree and each leaf's shape and dtype."""
    leaves, tree = jax.tree.flatten(entry)
    return tree, tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else (type(x),) for x in leaves)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def check_outputs(model, step: steps.Step, tokens_shape: tuple[int, int], carry, out) -> tuple:
    """`out` (what `model(tokens, positions, carry, step)` returned) as `(logits, carry)`, checked against the
    contract; an `InvalidInput` naming what is wrong and what was expected otherwise."""
    name, cfg = type(model).__name__, model.cfg
    b, t = tokens_shape
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise InvalidInput(f"{name}'s forward returned {got}; the contract is (logits, carry) "
                           "(kvjax.model.CachedLM)")
    logits, new = out
    if isinstance(logits, (tuple, list)) and _is_array(new):
        raise InvalidInput(f"{name}'s forward returned (carry, logits); the contract is (logits, carry)")
    want = (b, cfg.vocab_size) if step.last else (b, t, cfg.vocab_size)
    if not _is_array(logits):
        raise InvalidInput(f"{name}'s forward returned {type(logits).__name__} for its logits; expected an array of "
                           f"shape {want}")
    if tuple(logits.shape) != want:
        which = "the last position's (step.select(hidden) before the head)" if step.last else "every position's"
        why = (f"; its last axis is {logits.shape[-1]} wide, not the vocabulary's {cfg.vocab_size} (cfg.vocab_size)"
               if logits.ndim == len(want) and logits.shape[:-1] == want[:-1] else "")
        raise InvalidInput(f"{name}'s forward returned logits of shape {tuple(logits.shape)} for a "
                           f"{type(step).__name__} step, which asks for {which}: shape {want}{why}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise InvalidInput(f"{name}'s forward returned {logits.dtype} logits; expected floating point")
    if not isinstance(new, (tuple, list)):
        raise InvalidInput(f"{name}'s forward returned a {type(new).__name__} as its carry; expected a tuple of "
                           f"{cfg.num_layers} entries, one per layer")
    new = tuple(new)
    if len(new) != cfg.num_layers:
        raise InvalidInput(f"{name}'s forward returned {len(new)} carry entries for its {cfg.num_layers} layers "
                           "(cfg.num_layers): one per layer, in layer order, each from its layer's kvjax.layer.attend")
    if isinstance(step, MIRRORED):
        _check_mirrored(name, carry, new)
    return logits, new


def _check_mirrored(name: str, carry, new) -> None:
    given = [_signature(c) for c in carry]
    for j, entry in enumerate(new):
        got = _signature(entry)
        if got == given[j]:
            continue
        owner = [i for i, g in enumerate(given) if g == got]
        if owner:
            raise InvalidInput(f"{name}'s forward returned layer {owner[0]}'s carry entry in layer {j}'s place: carry "
                               "entries go back in layer order, each from its own layer's kvjax.layer.attend")
        shapes = lambda e: [_shape(x) for x in jax.tree.leaves(e)][:4]  # noqa: E731
        raise InvalidInput(f"{name}'s forward returned a carry entry for layer {j} that is not the one it was given "
                           f"(leaves {shapes(entry)} ...; given {shapes(carry[j])} ...): hand each layer's entry to "
                           "kvjax.layer.attend and return what it gives back")


def forward(model, tokens, positions, carry, step: steps.Step) -> tuple:
    """`model(tokens, positions, carry, step)`, its outputs checked (`check_outputs`)."""
    return check_outputs(model, step, tokens.shape, carry, model(tokens, positions, carry, step))


_ORDER_CHECKED: set = set()


def check_layer_order(model) -> None:
    """Once per model structure: one decode step traced over caches of `4 + i` slots in layer i, so every layer's
    entry has its own shape, and the carry handed back compared entry by entry (`check_outputs`): an entry in
    another layer's place is refused naming both layers. Traced with `jax.eval_shape`: nothing is computed."""
    shape, arrays = structure.split(model)
    if shape in _ORDER_CHECKED:
        return
    cfg = model.cfg
    if cfg.num_layers > 1:
        base = resolve(FullCache(), cfg.num_layers, cfg.num_kv_heads)
        plan = dataclasses.replace(base, layers=tuple(
            dataclasses.replace(lp, sizes=(4 + lp.layer,) * len(lp.groups)) for lp in base.layers))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else x, arrays)

        def one_step(arrays):
            m = structure.merge(shape, arrays)
            tokens, positions = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)
            carry = layer.init_cache(plan, 1, cfg.num_kv_heads, cfg.head_dim, m.dtype)
            return forward(m, tokens, positions, carry, steps.Token(plan))

        jax.eval_shape(one_step, abstract)
    _ORDER_CHECKED.add(shape)


__all__ = ["MIRRORED", "check_layer_order", "check_outputs", "forward"]
