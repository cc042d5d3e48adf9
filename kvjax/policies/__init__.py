"""Cache policies: frozen dataclasses of pure functions (see `base.Policy`)."""

from kvjax.errors import InvalidInput
from kvjax.policies import options, registry
from kvjax.policies.base import (
    AppendsWhileDecoding,
    ChunkRule,
    Context,
    KeepsEveryToken,
    LayerPolicy,
    Policy,
    PooledRule,
    PromptMasking,
    ReadsTokens,
    Rule,
    StepOnlyWrites,
)
from kvjax.policies.chunkkv import ChunkKV
from kvjax.policies.compose import (
    EVERY_LAYER,
    ByHead,
    ByLayer,
    HeadSplit,
    PerLayer,
    by_head,
    by_layer,
    on_windows,
)
from kvjax.policies.duo import DuoAttention, DuoAttentionOnce, duo_from_pattern, streaming_heads
from kvjax.policies.gate import GateEviction
from kvjax.policies.h2o import H2O
from kvjax.policies.mat import (
    AnchorCache,
    default_shallow_layers,
    grid_search_anchors,
    mat,
    mat_with_anchor,
    mat_with_sink,
)
from kvjax.policies.kvzip import KVgrad, KVzip
from kvjax.policies.kvzap import KVzap
from kvjax.policies.dms import DMS
from kvjax.policies.critical import CriticalAdaKV, CriticalKV
from kvjax.policies.plan import Group, LayerPlan, Plan, resolve
from kvjax.policies.quantized import Quantized
from kvjax.policies.razor import CompensatedWindow, RazorAttention, razor_from_heads
from kvjax.policies.decoding import Decoding, recompress
from kvjax.policies.rkv import RKV
from kvjax.policies.triattention import QueryCentres, TriAttention
from kvjax.policies.ring import FullCache, LocalWindow, StreamingLLM
from kvjax.policies.scored import (
    TOVA,
    AdaKV,
    ExpectedAttention,
    KeyDiff,
    KNorm,
    ObservedAttention,
    PromptStreamingLLM,
    PyramidKV,
    SlimKV,
    SnapKV,
)


# Every method registers itself in its own module (`kvjax.policies.options.register`); what the command lines, the
# suites and the tables know of the methods is derived from those registrations.
REGISTRY = registry.Registry()
"""`--policy` name -> its `Method` (callable as `build(budget, **options)`), live: kvjax's own, any registered since, and
a user's own class named `module:Class`. `make_policy(name, budget, **options)` builds from it and refuses an option
the method does not take."""
NO_BUDGET = options.Live(options.no_budget)
"""The methods sized by their own options rather than --budget (live)."""


def reduces_to(policy: Policy) -> str | None:
    """What `policy`'s parameters reduce it to, when that is another method (PyramidKV below kvpress's
    pyramid = SnapKV), for the tables to say; None when it is itself."""
    return policy.same_as()


def make_policy(name: str, budget: int | None = None, **given) -> Policy:
    """Builds a registered policy by name (or a user's own class, `module:Class`); `budget` is the cache size in
    tokens per KV head.

    Options a policy does not take are an error, so a typo is not silently ignored.
    """
    m = registry.method(name)
    if m.budget and budget is None and given.get("ratio") is None:
        raise InvalidInput(f"policy {name!r} needs a budget or a ratio")
    accepted = set(m.parameters) - {"budget"}
    unknown = set(given) - accepted
    if unknown:
        raise InvalidInput(f"policy {name!r} does not take {sorted(unknown)}; it takes {sorted(accepted)}")
    return m(budget, **given)


__all__ = [
    "AdaKV", "AnchorCache", "AppendsWhileDecoding", "ByHead", "ByLayer", "ChunkKV", "ChunkRule", "CompensatedWindow", "Context", "DuoAttention", "DuoAttentionOnce", "ExpectedAttention", "GateEviction", "HeadSplit", "PromptStreamingLLM", "KeepsEveryToken", "RazorAttention", "ReadsTokens", "by_head",
    "razor_from_heads", "EVERY_LAYER", "FullCache", "H2O", "KNorm", "KVgrad", "KVzip", "KeyDiff", "LayerPolicy", "LocalWindow",
    "ObservedAttention", "PerLayer", "Plan", "LayerPlan", "Group", "resolve", "Policy", "PooledRule", "PromptMasking", "PyramidKV", "Quantized", "REGISTRY", "Decoding", "recompress", "RKV", "DMS", "QueryCentres", "TriAttention", "Rule", "SlimKV", "SnapKV", "StepOnlyWrites", "StreamingLLM", "TOVA",
    "by_layer", "default_shallow_layers", "duo_from_pattern", "streaming_heads", "grid_search_anchors", "make_policy", "mat", "mat_with_anchor", "on_windows",
    "mat_with_sink", "reduces_to",
    "CriticalAdaKV", "CriticalKV", "KVzap",
]
