"""Which of jax's backends may start in a kvjax process: on a machine with no accelerator, the CPU only.

The test extra installs `libtpu` (kvjax compiles for TPU on a CPU with it, `kvjax.tpu`). Once installed, jax
loads it at the first computation of *any* process unless told the platforms to use: libtpu then takes its
process lock (`/tmp/libtpu_lockfile`, which makes a later TPU compile in another process fail) and looks for
a cloud metadata server over the network. kvjax never runs on a TPU that is not there, so where the machine has
no accelerator device node (`ACCELERATOR_NODES`) and the user chose no platform (`JAX_PLATFORMS`), jax is
given the CPU only, before any backend starts. Imported first by `kvjax/__init__.py`.
"""

from __future__ import annotations

import glob
import os

import jax

# TPU VMs: /dev/accel* (v4, v5e) or numbered /dev/vfio/N groups (v5p, v6e); NVIDIA: /dev/nvidia*; AMD (ROCm):
# /dev/kfd; CUDA under WSL2: /dev/dxg. A GPU whose nodes appear only later, or another plugin, needs JAX_PLATFORMS.
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def has_accelerator() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def cpu_only_without_accelerator() -> bool:
    """Sets jax's platforms to "cpu" unless the user chose some or the machine has an accelerator; whether it
    did. Has no effect on a process whose backends already started."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or has_accelerator():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


cpu_only_without_accelerator()
