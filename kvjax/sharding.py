"""Running over a device mesh: tensor parallel over heads, data parallel over the batch.

    mesh = make_mesh(data=2, model=4)          # 8 devices: 2-way batch x 4-way heads
    shard_model(lm.model, mesh)                 # parameters placed on the mesh
    generate(lm.model, prompts, policy, ...)    # unchanged: the batch is split over "data"

Megatron-style placement, by the module holding a parameter: q/k/v and gate/up projections
are split over their output features (whole heads per device), o/down projections over their
input features, the LM head over the vocabulary; embeddings and norms are replicated. Inside
`jax.jit`, XLA propagates these shardings to activations and the KV cache (KV heads over
"model", batch over "data") and inserts the collectives. The same code runs multi-host: start
every process with `jax.distributed.initialize()`, build the mesh over `jax.devices()` (all hosts'
devices), and feed each process the same prompts.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # kernel [in, out]: split out
_ROW = ("o_proj", "down_proj")  # kernel [in, out]: split in


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A `(data, model)` mesh over the first `data * model` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model > len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices; {len(devices)} available")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), (DATA, MODEL))


def check_shardable(cfg, model_axis: int) -> None:
    """Raises ValueError unless whole heads (query and KV) and MLP features split over `model_axis`."""
    for name, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % model_axis:
            raise ValueError(f"{name}={n} is not divisible by the mesh's tensor-parallel axis '{MODEL}' of size {model_axis}")


def param_spec(path: tuple, shape: tuple[int, ...], model_axis: int) -> P:
    """Where a parameter's axes go, from its path in the module tree."""
    *mods, leaf = (str(p) for p in path)
    mod = mods[-1] if mods else ""
    if mod in _COLUMN:
        return P(None, MODEL) if leaf == "kernel" else P(MODEL)
    if mod in _ROW:
        return P(MODEL, None) if leaf == "kernel" else P()
    if mod == "lm_head" and shape[-1] % model_axis == 0:
        return P(None, MODEL)  # vocabulary-parallel logits
    return P()


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places the model's parameters on `mesh` (in place; returns the model)."""
    model_axis = mesh.shape[MODEL]
    check_shardable(model.cfg, model_axis)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            value = node.get_value()
            node.set_value(jax.device_put(value, NamedSharding(mesh, param_spec(path, value.shape, model_axis))))
    return model


def mesh_of(state) -> Mesh | None:
    """The mesh the parameters live on, if they were placed by `shard_model` (which places every parameter, so the
    first leaf with a sharding tells: every compiled call asks, `kvjax.engine.compiled`)."""
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return sharding.mesh if isinstance(sharding, NamedSharding) and DATA in sharding.mesh.axis_names else None
    return None


def shard_batch(x, mesh: Mesh | None):
    """Splits an array's leading (batch) axis over "data"; a no-op without a mesh."""
    if mesh is None:
        return x
    if x.shape[0] % mesh.shape[DATA]:
        raise ValueError(f"a batch of {x.shape[0]} is not divisible by the mesh's '{DATA}' axis of size {mesh.shape[DATA]}")
    return jax.device_put(x, NamedSharding(mesh, P(DATA, *([None] * (x.ndim - 1)))))
