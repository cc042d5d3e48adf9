"""Pallas kernels for prefill and decode attention (`attention_impl="pallas"`).

`kvjax.reference` is their specification (their masks are `kvjax.masks`, shared with it) and
`kvjax.attention` dispatches to them. The variant follows
the backend: Triton on GPU, Mosaic on TPU, and on CPU the GPU kernel in interpret
mode (how the tests run both variants; slow, for checking only).
"""

from __future__ import annotations

from kvjax.backends import compiling_for, platform
from kvjax.pallas.decode import decode_attention
from kvjax.pallas.prefill import colsum, prefill_attention

__all__ = ["colsum", "compiling_for", "decode_attention", "platform", "platform_variant", "prefill_attention"]


def platform_variant() -> tuple[str, bool]:
    """(variant, interpret) for the backend programs are traced for (`platform`)."""
    backend = platform()
    if backend == "tpu":
        return "tpu", False
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu", False
    return "gpu", True
