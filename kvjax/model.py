"""The model contract: what kvjax's generation, scoring, few-shot evaluation and engine call on a model.

`models.llama.Llama` (and every family built on it) is one; a model of your own that provides these names
runs through `kvjax.generate`, `kvjax.scoring` and the suites. Its attention layers call `kvjax.layer` (see
the README's "Your own model"), so each method below is the model's own forward around those calls. The
engine compiles a model with `nnx.split` / `nnx.merge`, so a model is a Flax NNX module.

Every cached call takes the plan (`model.plan(policy, max_len, prompt_len)`), the one place a policy is
resolved; the plan is hashable and the static key of each compiled program (prefill, chunk, decode); everything
that varies between calls (tokens, positions, lengths) is an array.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Float, Int

from kvjax.cache import Cache
from kvjax.policies.base import Policy
from kvjax.policies.plan import Plan


class LMConfig(Protocol):
    """The configuration fields kvjax reads."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


@runtime_checkable
class CachedLM(Protocol):
    """A causal LM whose attention caches through kvjax's policies.

    Positions are `[b, t]` (`[b]` for one decode step), -1 on padding (prompts are left padded); logits are
    float32 or the model's dtype. Every method is pure in the model's state: the cache goes in and comes out."""

    cfg: LMConfig
    dtype: Any

    def plan(self, policy: Policy, max_len: int | None = None, prompt_len: int = 0) -> Plan:
        """`policy` as this model runs it, resolved per layer and head group; sized when `max_len` is given."""

    def init_cache(self, policy: Policy, batch: int, max_len: int, prompt_len: int = 0) -> Cache:
        """Empty caches of the sized plan's slot counts."""

    def size_rows(self, cache: Cache, positions: Int[Array, "b t"], plan: Plan) -> Cache:
        """A fresh cache made ready for the whole prompts at `positions` to be read token by token or in chunks."""

    def prefill_plan(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], plan: Plan
                     ) -> tuple[Float[Array, "b V"], Cache]:
        """A prompt under a sized plan: the last position's logits and the compressed cache."""

    def prefill_plans(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], plans: tuple[Plan, ...]
                      ) -> tuple[Float[Array, "b V"], tuple[Cache, ...]]:
        """One plain prompt pass cached under several sized plans (`Plan.plain_prompt_pass`)."""

    def prefill_chunk(self, tokens: Int[Array, "b n"], positions: Int[Array, "b n"], cache: Cache, plan: Plan,
                      all_logits: bool = True) -> tuple[Array, Cache]:
        """One chunk of a prompt under `prefill_mode="chunked"`: logits (every position's, or the last) and the cache."""

    def decode(self, tokens: Int[Array, "b"], positions: Int[Array, "b"], cache: Cache, plan: Plan
               ) -> tuple[Float[Array, "b V"], Cache]:
        """One token per row through the cache."""

    def stream(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan, *,
               all_logits: bool = True) -> tuple[Array, Cache]:
        """Tokens read one by one through the decode path (a scan)."""

    def extend(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan
               ) -> Float[Array, "b t V"]:
        """A chunk attending the read-only cache and itself (every position's logits); the cache is unchanged."""


@runtime_checkable
class ReplayLM(CachedLM, Protocol):
    """A `CachedLM` that KVzip (`kvjax.kvzip`) can replay a context through."""

    def replay_scores(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: Cache, plan: Plan,
                      span: Int[Array, "b 3"]) -> tuple[Float[Array, "b kvh c"], ...]:
        """`extend` of a right-padded replay chunk over the read-only cache; per layer, each cached slot's
        reconstruction score for the context chunk `span` = (sinks, start, end) (`kvjax.layer.replay`)."""


__all__ = ["CachedLM", "LMConfig", "ReplayLM"]
