"""Pallas kernels for prefill and decode attention (`attention_impl="pallas"`).

`kvjax.reference` is their specification (their masks are `kvjax.masks`, shared with it) and
`kvjax.attention` dispatches to them. The variant follows
the backend: Triton on GPU, Mosaic on TPU, and on CPU the GPU kernel in interpret
mode (how the tests run both variants; slow, for checking only).
"""

from __future__ import annotations

import jax

from kvjax.pallas.decode import decode_attention
from kvjax.pallas.prefill import colsum, prefill_attention

__all__ = ["colsum", "decode_attention", "platform_variant", "prefill_attention"]


def platform_variant() -> tuple[str, bool]:
    """(variant, interpret) for the default backend."""
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu", False
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu", False
    return "gpu", True
