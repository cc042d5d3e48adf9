"""Compiling kvjax for a TPU on a machine that has none: libtpu's compiler over a virtual topology.

The `libtpu` wheel holds the whole TPU compiler (XLA's TPU backend and Mosaic, which compiles the Pallas
kernels). Given a virtual topology (`jax.experimental.topologies.get_topology_desc`), `jax.jit(f).trace(...)
.lower().compile()` produces the program a TPU would run, with its memory and cost analyses, on a CPU: this
is how kvjax checks what interpret mode cannot (operand types and precision of Mosaic's matmuls, layouts,
VMEM) and sizes programs against a chip's HBM.

libtpu looks for a cloud metadata server when it starts unless told where it runs: `offline_env(chip)` are
the variables that stop it, and they must be in the environment **before** libtpu loads. Run the compile in
a process started with them (and, where the machine allows, in a network namespace with none:
`offline_command`); `topology` refuses to load libtpu without them.

    env = {**os.environ, **tpu.offline_env("v5e")}
    subprocess.run(tpu.offline_command([sys.executable, "my_compile.py"]), env=env)
    # in my_compile.py:
    topo = tpu.topology("v5e")
    with tpu.target(topo.devices[:1]) as mesh:
        compiled, seconds = tpu.compile(fn, *tpu.abstract(args, tpu.replicated(mesh)))

What this proves and what it does not: a program compiled this way is the one a TPU would be given, and its
memory analysis is the compiler's; its speed is not measured (there is no chip).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from kvjax.backends import compiling_for
from kvjax.errors import InvalidInput

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation as kvjax compiles for it: a 2x2 virtual topology (the smallest jax accepts: `v5e:1x1`
    is refused) and the chip's HBM, from Google's published specifications."""

    name: str
    topology: str
    accelerator_type: str
    hbm_bytes: int
    hbm_bandwidth: float  # bytes / s

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.hbm_bytes


CHIPS = {
    "v5e": Chip("v5e", "v5e:2x2", "v5litepod-4", 16 * GiB, 819e9),
    "v6e": Chip("v6e", "v6e:2x2", "v6e-4", 32 * GiB, 1640e9),
}


def chip(name: str) -> Chip:
    """The chip called `name` (`CHIPS`); an `InvalidInput` naming the known ones otherwise."""
    if name not in CHIPS:
        raise InvalidInput(f"TPU chip {name!r} is not one of {', '.join(CHIPS)}")
    return CHIPS[name]


def offline_env(chip_name: str) -> dict[str, str]:
    """libtpu's variables for a single host of the chip's 2x2 topology, so it never queries a metadata server."""
    c = chip(chip_name)
    return {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": c.accelerator_type, "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_WORKER_ID": "0", "TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
            # the CPU runs everything that is executed; the TPU is only compiled for
            "JAX_PLATFORMS": "cpu",
            # a process that loaded libtpu before kvjax.backends existed (or with JAX_PLATFORMS unset on purpose)
            # holds its lock; a compiler-only load shares nothing with it
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def unavailable() -> str | None:
    """Why a TPU compile cannot run here (None when it can): the `libtpu` wheel (the test extra pins it)."""
    if importlib.util.find_spec("libtpu") is None:
        return "the libtpu wheel is not installed (pip install -e '.[test]' pins it)"
    return None


def offline_command(argv: list[str]) -> list[str]:
    """`argv` inside a network namespace with no interface but loopback, where `unshare -rn` works (a user
    namespace maps the caller to root in it, so no privilege is needed where the kernel allows user namespaces);
    else `argv` as it is, which `offline_env` keeps off the network."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn", *argv]
    return list(argv)


def topology(chip_name: str):
    """The chip's virtual topology (4 devices). Refuses unless `offline_env(chip_name)` was set before libtpu
    loaded."""
    c = chip(chip_name)
    missing = {k: v for k, v in offline_env(chip_name).items() if os.environ.get(k) != v}
    if missing:
        raise RuntimeError(f"a TPU compile needs libtpu's offline variables set before it loads (kvjax.tpu."
                           f"offline_env({chip_name!r})); missing or different: {sorted(missing)}")
    from jax.experimental import topologies

    return topologies.get_topology_desc(c.topology, "tpu")


@contextlib.contextmanager
def target(devices, axes: tuple[str, ...] = ("x",), shape: tuple[int, ...] | None = None):
    """Traces inside compile for these TPU devices: the mesh is set (`jax.set_mesh`) and kvjax chooses its TPU
    code (`kvjax.pallas.compiling_for("tpu")`). Yields the mesh."""
    mesh = Mesh(np.asarray(devices).reshape(shape or (len(devices),)), axes)
    with jax.set_mesh(mesh), compiling_for("tpu"):
        yield mesh


def abstract(tree, sharding):
    """Every array (or ShapeDtypeStruct) of `tree` as a ShapeDtypeStruct placed by `sharding`: a `Sharding`, or a
    function of (path, leaf) returning one. Nothing is allocated."""
    place = sharding if callable(sharding) else (lambda path, leaf: sharding)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=place(path, x)), tree)


def on_device(device) -> SingleDeviceSharding:
    return SingleDeviceSharding(device)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def compile(fn, *args, **static):
    """`jax.jit(fn)` (or `fn` if already jitted) traced, lowered and compiled for the current `target`:
    `(compiled, seconds)`. Run inside `target`."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn, static_argnames=tuple(static))
    start = time.perf_counter()
    compiled = jitted.trace(*args, **static).lower().compile()
    return compiled, time.perf_counter() - start


def analysis(compiled) -> dict[str, float]:
    """The compiler's memory analysis (bytes of arguments, outputs, temporaries, aliased) and cost analysis
    (flops, bytes accessed) of one compiled program."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one dict per program in older jax
        cost = cost[0] if cost else {}
    cost = cost or {}
    out = {"argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
           "temp_bytes": int(mem.temp_size_in_bytes), "alias_bytes": int(mem.alias_size_in_bytes),
           "code_bytes": int(mem.generated_code_size_in_bytes),
           "flops": float(cost.get("flops", float("nan"))),
           "bytes_accessed": float(cost.get("bytes accessed", float("nan")))}
    # What the chip holds while the program runs: its inputs, outputs that do not reuse an input, temporaries.
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


__all__ = ["CHIPS", "Chip", "abstract", "chip", "analysis", "compile", "offline_command", "offline_env", "on_device",
           "replicated", "target", "topology", "unavailable"]
