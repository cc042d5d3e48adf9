"""Pallas kernels for prefill and decode attention (`attention_impl="pallas"`).

`kvjax.reference` is their specification (their masks are `kvjax.masks`, shared with it) and
`kvjax.attention` dispatches to them. The variant follows
the backend: Triton on GPU, Mosaic on TPU, and on CPU the GPU kernel in interpret
mode (how the tests run both variants; slow, for checking only).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from kvjax.pallas.decode import decode_attention
from kvjax.pallas.prefill import colsum, prefill_attention

__all__ = ["colsum", "compiling_for", "decode_attention", "platform", "platform_variant", "prefill_attention"]

# The backend a program is traced for when it is not the default one: an ahead-of-time compile for a TPU
# topology on a CPU-only machine (`kvjax.tpu`) traces with jax's default backend still "cpu".
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvjax_target_backend", default=None)


@contextlib.contextmanager
def compiling_for(backend: str):
    """Traces inside choose the code of `backend` ("tpu", "gpu", "cpu") instead of the default backend's: the
    kernels' variant, not interpreted, and the prompt route (`kvjax.attention.prefill_route`)."""
    if backend not in ("tpu", "gpu", "cpu"):
        raise ValueError(f"compiling_for({backend!r}); expected 'tpu', 'gpu' or 'cpu'")
    token = _TARGET.set(backend)
    try:
        yield
    finally:
        _TARGET.reset(token)


def platform() -> str:
    """The backend programs are traced for: `compiling_for`'s, else jax's default ("gpu" for cuda / rocm)."""
    backend = _TARGET.get() or jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm") else backend


def platform_variant() -> tuple[str, bool]:
    """(variant, interpret) for the backend programs are traced for (`platform`)."""
    backend = platform()
    if backend == "tpu":
        return "tpu", False
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu", False
    return "gpu", True
