"""Cache policies: frozen dataclasses of pure functions (see `base.Policy`)."""

from kvjax.policies.base import LayerPolicy, Policy
from kvjax.policies.compose import EVERY_LAYER, ByLayer, by_layer
from kvjax.policies.mat import AnchorCache, grid_search_anchors, mat, mat_with_anchor, mat_with_sink
from kvjax.policies.ring import FullCache, LocalWindow, StreamingLLM


def _mat_anchors(budget, anchors):
    # Default β = c/4: inside the range [32, 96] the paper found flat at c = 256 (Fig. 5).
    return anchors if anchors is not None else max(1, budget // 4)


# CLI name -> constructor. Keyword names are the command-line options (experiments/common.py).
REGISTRY = {
    "full": lambda budget, positions="absolute", prefill_mode="full": FullCache(
        positions=positions, prefill_mode=prefill_mode
    ),
    "local": lambda budget, positions="absolute", prefill_mode="full": LocalWindow(
        window=budget, positions=positions, prefill_mode=prefill_mode
    ),
    "streaming": lambda budget, sinks=4, positions="absolute", prefill_mode="full": StreamingLLM(
        budget=budget, sinks=sinks, positions=positions, prefill_mode=prefill_mode
    ),
    "mat": lambda budget, anchors=None, shallow_layers=2, sinks=4, group_agg="mean", positions="absolute",
    prefill_mode="stream": mat(
        budget, _mat_anchors(budget, anchors), shallow_layers, sinks,
        group_agg=group_agg, positions=positions, prefill_mode=prefill_mode,
    ),
    "mat-sink": lambda budget, sinks=4, positions="absolute", prefill_mode="stream": mat_with_sink(
        budget, sinks, positions=positions, prefill_mode=prefill_mode
    ),
    "mat-anchor": lambda budget, anchors=None, group_agg="mean", positions="absolute", prefill_mode="stream": mat_with_anchor(
        budget, _mat_anchors(budget, anchors), group_agg=group_agg, positions=positions, prefill_mode=prefill_mode
    ),
}


def make_policy(name: str, budget: int | None = None, **options) -> Policy:
    """Builds a registered policy by name; `budget` is the cache size in tokens per KV head.

    Options a policy does not take are an error, so a typo is not silently ignored.
    """
    import inspect

    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {sorted(REGISTRY)}")
    if name != "full" and budget is None:
        raise ValueError(f"policy {name!r} needs a budget")
    accepted = set(inspect.signature(REGISTRY[name]).parameters) - {"budget"}
    unknown = set(options) - accepted
    if unknown:
        raise ValueError(f"policy {name!r} does not take {sorted(unknown)}; it takes {sorted(accepted)}")
    return REGISTRY[name](budget, **options)


__all__ = [
    "AnchorCache", "ByLayer", "EVERY_LAYER", "FullCache", "LayerPolicy", "LocalWindow", "Policy",
    "REGISTRY", "StreamingLLM", "by_layer", "grid_search_anchors", "make_policy", "mat",
    "mat_with_anchor", "mat_with_sink",
]
