"""Which of jax's backends may start in a kvjax process: on a machine with no accelerator, the CPU only.

The test extra installs `libtpu` (kvjax compiles for TPU on a CPU with it, `kvjax.tpu`). Once installed, jax
loads it at the first computation of *any* process unless told the platforms to use: libtpu then takes its
process lock (`/tmp/libtpu_lockfile`, which makes a later TPU compile in another process fail) and looks for
a cloud metadata server over the network. kvjax never runs on a TPU that is not there, so where the machine has
no accelerator device node (`ACCELERATOR_NODES`) and the user chose no platform (`JAX_PLATFORMS`), jax is
given the CPU only, before any backend starts. Imported first by `kvjax/__init__.py`.

Also which backend a trace is *for* (`platform`), which differs from the one computing when kvjax compiles for a
TPU on a CPU (`compiling_for`, `kvjax.tpu`).
"""

from __future__ import annotations

import contextlib
import contextvars
import glob
import os

import jax

# TPU VMs: /dev/accel* (v4, v5e) or numbered /dev/vfio/N groups (v5p, v6e); NVIDIA: /dev/nvidia*; AMD (ROCm):
# /dev/kfd; CUDA under WSL2: /dev/dxg. A GPU whose nodes appear only later, or another plugin, needs JAX_PLATFORMS.
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def has_accelerator() -> bool:
    """Whether the machine has a device node of an accelerator jax could use (`ACCELERATOR_NODES`)."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def cpu_only_without_accelerator() -> bool:
    """Sets jax's platforms to "cpu" unless the user chose some or the machine has an accelerator; whether it
    did. Has no effect on a process whose backends already started."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or has_accelerator():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


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


__all__ = ["ACCELERATOR_NODES", "compiling_for", "cpu_only_without_accelerator", "has_accelerator", "platform"]

cpu_only_without_accelerator()
