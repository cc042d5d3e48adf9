"""The attention statistics a cache policy reads: what it asks for, and what attention returns.

A rule names what it needs per layer (`Rule.stats`: a `RuleStats` of a prompt's and a decode step's) as a
`StatsRequest` each: frozen and hashable, so it is part of the static key of a jitted prefill or decode
(a different request is a different program, never a silent one). Attention returns an
`AttentionStats`: a registered pytree holding exactly the requested arrays, the others `None`, so a
policy that reads a statistic it did not ask for fails at trace time, naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
from jax import Array


@dataclasses.dataclass(frozen=True)
class StatsRequest:
    """Which statistics one attention call computes besides its output.

    * `first_logit`: each query's scaled logit to the key at position 0 (MAT's π);
    * `colsum`: each key's probability summed over the queries (H2O's accumulated attention);
    * `last_queries`: for each W, the probabilities of the last W queries (SnapKV's observation window of W
      queries, TOVA's last query with W = 1), returned as `AttentionStats.last_probs[W]`;
    * `probs`: in decode, the query's probabilities over the cache slots, summed over the group;
    * `gate_keep`: at prefill, the prompt is attended under the model's Attention-Gates (eq. 7) and their
      keep flags are handed on. The model computes them (the gates are its weights), not attention:
      attention only applies them as `key_keep`.
    * `query_moments`: for each `(sinks, future)`, the mean and covariance of the prompt's unrotated queries
      (positions from `sinks` on), both rotated by RoPE averaged over the `future` positions after the prompt
      (ExpectedAttention's statistics of future queries). The model computes them (it knows its RoPE).
    * `out_norms`: for each p in {1, 2}, the p-norm of each prompt token's value through each query head's block
      of the layer's output projection, ‖v W_o^i‖_p (query head i reads KV head i // g), `[b, kvh, g, t]`
      grouped by KV head: the size of what the token writes into the residual stream (CriticalKV's p = 1).
      kvjax computes them from the model's `kvjax.layer.Geometry.out_proj`; a model that gives none is refused.
    * `hidden`: at prefill, the layer's attention input itself (`Context.hidden`, KVzap's surrogate reads it). Every
      prompt pass hands it to the rules; a pass whose inputs are kept for later caching (`kvjax.step.Capture`)
      keeps it only when asked, as it is as large as the queries.
    """

    first_logit: bool = False
    colsum: bool = False
    last_queries: frozenset[int] = frozenset()
    probs: bool = False
    gate_keep: bool = False
    query_moments: frozenset[tuple[int, int]] = frozenset()
    out_norms: frozenset[int] = frozenset()
    hidden: bool = False

    def __post_init__(self):
        last = frozenset(self.last_queries)
        if any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in last):
            raise ValueError(f"StatsRequest: last_queries={sorted(last, key=str)} must be integers >= 1")
        object.__setattr__(self, "last_queries", last)
        moments = frozenset(tuple(m) for m in self.query_moments)
        if any(len(m) != 2 or m[0] < 0 or m[1] < 1 for m in moments):
            raise ValueError(f"StatsRequest: query_moments={sorted(moments)} must be (sinks >= 0, future >= 1) pairs")
        object.__setattr__(self, "query_moments", moments)
        orders = frozenset(self.out_norms)
        if not orders <= {1, 2}:
            raise ValueError(f"StatsRequest: out_norms={sorted(orders, key=str)} must be norm orders 1 or 2")
        object.__setattr__(self, "out_norms", orders)

    @classmethod
    def last(cls, w: int) -> StatsRequest:
        """The probabilities of the last `w` queries, and nothing else."""
        return cls(last_queries=frozenset({w}))

    def __or__(self, other: StatsRequest) -> StatsRequest:
        return StatsRequest(self.first_logit or other.first_logit, self.colsum or other.colsum,
                            self.last_queries | other.last_queries, self.probs or other.probs,
                            self.gate_keep or other.gate_keep, self.query_moments | other.query_moments,
                            self.out_norms | other.out_norms, self.hidden or other.hidden)

    def __bool__(self) -> bool:
        return (self.first_logit or self.colsum or bool(self.last_queries) or self.probs or self.gate_keep
                or bool(self.query_moments) or bool(self.out_norms) or self.hidden)

    def attention_part(self) -> StatsRequest:
        """What attention itself measures (the query moments and the output norms are the layer's, the attention
        input the model's)."""
        return dataclasses.replace(self, query_moments=frozenset(), out_norms=frozenset(), hidden=False)

    def names(self) -> list[str]:
        """The requested statistics in words, for error messages."""
        flags = [f.name for f in dataclasses.fields(self)
                 if f.name not in ("last_queries", "query_moments", "out_norms") and getattr(self, f.name)]
        return (flags + [f"last_probs[{w}]" for w in sorted(self.last_queries)]
                + [f"query_moments[{m}]" for m in sorted(self.query_moments)]
                + [f"out_norms[{p}]" for p in sorted(self.out_norms)])


NO_STATS = StatsRequest()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionStats:
    """What one attention call measured (shapes: see the attention function that made it).

    `gate_keep` is not measured: it is the Attention-Gate's keep mask (eq. 7) that the attention
    applied, handed on with the statistics so the gate's policy keeps exactly what attention used.
    """

    first_logit: Array | None = None
    colsum: Array | None = None
    last_probs: Mapping[int, Array] = dataclasses.field(default_factory=dict)  # W -> the last W queries' probabilities
    probs: Array | None = None
    gate_keep: Array | None = None
    # (sinks, future) -> (mean [b, kvh, g, d], covariance [b, kvh, g, d, d]), grouped by KV head
    query_moments: Mapping[tuple[int, int], tuple[Array, Array]] = dataclasses.field(default_factory=dict)
    # p -> ‖v W_o^i‖_p of each token's value through each query head's output projection, [b, kvh, g, t]
    out_norms: Mapping[int, Array] = dataclasses.field(default_factory=dict)

    def last(self, w: int) -> Array:
        """The last `w` queries' probabilities; a KeyError naming what was computed otherwise."""
        if w not in self.last_probs:
            raise KeyError(f"last_probs[{w}] was not requested; computed: {sorted(self.last_probs)}")
        return self.last_probs[w]

    def map(self, f: Callable[[Array], Array]) -> AttentionStats:
        """`f` on every array (e.g. a head group's slice)."""
        return jax.tree.map(f, self)


@dataclasses.dataclass(frozen=True)
class RuleStats:
    """What attention returns to one rule (`Rule.stats`): over a prompt (to `prefill`, and over each chunk of a
    chunked one, to `absorb`) and at each decode step (to `observe`)."""

    prefill: StatsRequest = NO_STATS
    decode: StatsRequest = NO_STATS
