"""kvjax: KV-cache compression for JAX/Flax language models."""

from kvjax import backends  # noqa: F401  (first: before any jax backend starts; see kvjax/backends.py)
from kvjax.cache import Cache, LayerCache, kept_positions
from kvjax.generate import Generation, Sampling, generate, generate_many
from kvjax.policies import FullCache, LocalWindow, Policy, StreamingLLM, make_policy

__all__ = [
    "Cache", "FullCache", "Generation", "LayerCache", "LocalWindow", "Policy", "Sampling",
    "StreamingLLM", "generate", "generate_many", "kept_positions", "make_policy",
]
__version__ = "0.1.0"
