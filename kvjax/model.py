"""The model contract: one cached forward and a config. kvjax drives the sequence (`kvjax.drive`); the model only
computes.

    logits, carry = model(tokens, positions, carry, step)

`tokens`, `positions`: `[b, t]` (positions -1 on padding; prompts are left padded). `carry`: one entry per layer,
handed untouched to `kvjax.layer.attend` in that layer's attention and collected back in layer order. `step`
(`kvjax.step`): what the forward does to the cache (a whole prompt, a chunk, one token, a read-only extension,
several plans sharing one pass, the plain forward); the model passes it to `kvjax.layer.attend` and picks its
logits with `step.select(hidden)` before its final norm and head. Logits are float32 (or the model's accumulation
dtype). A model of any structure satisfies it: kvjax's Flax NNX `kvjax.models.llama.Llama`, or a registered pytree of
arrays (`tests/test_own_model.py`); `kvjax.engine.compiled` jits either.

Compiling one body for many layers: `step.layer_runs(num_layers)` gives the runs of neighbouring layers the step
treats alike (`kvjax.layer_runs`; equal plans up to the index, rules that read nothing of it). A model may run each
run whose layers also share a structure as one `lax.scan` over their parameters and stacked carry entries, every
scanned layer passing the run's first index to `attend`; `kvjax.models.llama.Llama` does, so a 30-layer program compiles
a few layer bodies instead of 30. An unrolled model is as correct.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Float, Int

from kvjax.step import Step


class LMConfig(Protocol):
    """What kvjax reads of a model: its vocabulary, depth and attention shape (query heads, KV heads, head size), its position limit, its stop and pad
    ids (`generate`'s defaults) and each layer's attention window (`windows`: an int or None for every layer, or a
    tuple with one entry per layer, None for a global layer; `kvjax.policies.on_windows` fits a policy to it)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    @property
    def windows(self) -> int | None | tuple[int | None, ...]: ...


@runtime_checkable
class CachedLM(Protocol):
    """A causal LM whose attention caches through `kvjax.layer.attend`."""

    cfg: LMConfig
    dtype: Any  # the dtype of its cache

    def __call__(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], carry: tuple, step: Step
                 ) -> tuple[Float[Array, "b V"] | Float[Array, "b t V"], tuple]:
        """Every layer, each attending through `kvjax.layer.attend(geometry, step, carry[i], q, k, v, positions,
        tokens)`: the logits of `step.select(hidden)` and the layers' new carry entries."""


__all__ = ["CachedLM", "LMConfig"]
