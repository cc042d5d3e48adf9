"""A model's two halves for a compiled call: its static structure (the key of the compiled program) and its arrays.

kvjax drives two kinds of model with one convention: a Flax NNX module (`nnx.split` / `nnx.merge`) and any registered
pytree (`jax.tree.flatten` / `unflatten`; its static fields, such as a config, are in the structure). The structure is
hashable and equal only for models that compute the same thing from the same arrays: the same tree, the same class at
every node, and the same forward. jax's treedef equality ignores a registered class (two dataclasses with the same
fields compare equal, in jax 0.10), so a second class, or a subclass that changes the forward, would otherwise run the
first class's compiled program.
"""

from __future__ import annotations

import jax
from flax import nnx

from kvjax.errors import InvalidInput


def node_types(treedef) -> tuple:
    """The class of every inner node of `treedef`, depth first (a leaf has none)."""
    data = treedef.node_data()
    if data is None:
        return ()
    return (data[0], *(t for child in treedef.children() for t in node_types(child)))


@jax.tree_util.register_static
class Structure:
    """The static half of a model (`split`): the NNX graph definition or the pytree's treedef, with the classes of its
    nodes and the forward its class runs (`type(model).__call__`, so a method replaced on the class is a new program).
    Equal, and of equal hash, only where all of them are."""

    def __init__(self, tree, classes: tuple, forward):
        self.tree, self.classes, self.forward = tree, classes, forward
        self._key = (tree, classes, forward)

    @property
    def is_module(self) -> bool:
        return isinstance(self.tree, nnx.graph.GraphDef)

    def __eq__(self, other):
        return isinstance(other, Structure) and other._key == self._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"Structure({self.classes[0].__qualname__ if self.classes else '?'})"


def split(model) -> tuple[Structure, object]:
    """`(structure, arrays)` of a model: `nnx.split` of an NNX module, the flattened leaves of a registered pytree. A
    model that is neither (a plain object holding arrays: jax sees it as one opaque leaf) is refused by name."""
    forward = getattr(type(model), "__call__", None)
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
        return Structure(graphdef, (type(model),), forward), state
    leaves, treedef = jax.tree.flatten(model)
    if len(leaves) == 1 and leaves[0] is model and not isinstance(model, jax.Array):
        raise InvalidInput(f"a {type(model).__name__} model is neither a Flax NNX module nor a registered pytree, so "
                           "jax cannot see its arrays: register its class (jax.tree_util.register_dataclass, as "
                           "docs/own-model.md does) or make it an nnx.Module")
    return Structure(treedef, node_types(treedef), forward), leaves


def merge(structure: Structure | nnx.graph.GraphDef, arrays):
    """The model back from `split`'s halves (inside a trace: its arrays are the traced ones). `nnx.split`'s own graph
    definition is taken too (it holds every module's class; a method replaced on a class is not in it)."""
    if isinstance(structure, nnx.graph.GraphDef):
        return nnx.merge(structure, arrays)
    if structure.is_module:
        return nnx.merge(structure.tree, arrays)
    return jax.tree.unflatten(structure.tree, arrays)


__all__ = ["Structure", "merge", "node_types", "split"]
