"""Cache policies: frozen dataclasses of pure functions (see `base.Policy`)."""

from kvjax.policies.base import Policy
from kvjax.policies.ring import FullCache, LocalWindow, StreamingLLM

# CLI name -> constructor from (budget, options); every experiment's --policy goes through this.
REGISTRY = {
    "full": lambda budget, **kw: FullCache(**kw),
    "local": lambda budget, **kw: LocalWindow(window=budget, **kw),
    "streaming": lambda budget, sinks=4, **kw: StreamingLLM(budget=budget, sinks=sinks, **kw),
}


def make_policy(name: str, budget: int | None = None, **options) -> Policy:
    """Builds a registered policy by name; `budget` is the cache size in tokens per KV head."""
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {sorted(REGISTRY)}")
    if name != "full" and budget is None:
        raise ValueError(f"policy {name!r} needs a budget")
    return REGISTRY[name](budget, **options)


__all__ = ["FullCache", "LocalWindow", "Policy", "StreamingLLM", "make_policy", "REGISTRY"]
