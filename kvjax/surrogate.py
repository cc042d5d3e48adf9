"""KVzap's surrogate (Jegou et al. 2026, arXiv:2601.07891): per layer, a linear map or a two-layer MLP from the
layer's attention input `h` (after its input norm) to one score per KV head, trained to predict the log of
KVzip+'s score of the token's key-value pair (`kvjax.kvzap.fit`). The `kvjax.policies.KVzap` rule evicts the
pairs it scores below a threshold.

As kvpress 0.5.5's `KVzapModel` computes it: `linear`: `h W + b`; `mlp`: `GELU(h W1 + b1) W2 + b2` with the exact
(erf) GELU of `torch.nn.GELU()`; in float32 here whatever the model's dtype (kvpress casts the surrogate to the
hidden states' dtype: the same numbers for a float32 model). `to_kvpress` maps the weights to its `state_dict`
(torch's `Linear` stores `W` transposed).

A surrogate is a frozen value: its weights are numpy arrays held by the policy, so they are constants of the
compiled program (a few hundred KB for SmolLM2's linear one), and it hashes and compares by the digest of its
weights, the identity records and tables give it (`describe`). `save` / `load` keep one as an orbax checkpoint
(`params/`) beside `kvzap.json` (its kind, shapes and how it was trained).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax.errors import InvalidInput, MissingFile

KINDS = {"linear": ("w", "b"), "mlp": ("w1", "b1", "w2", "b2")}  # each layer's arrays, by kind
META = "kvzap.json"


@dataclasses.dataclass(frozen=True, eq=False)
class Surrogate:
    """`kind` ("linear" or "mlp") and `layers`, one mapping of float32 arrays per model layer: linear `w` `[D, kvh]`,
    `b` `[kvh]`; mlp `w1` `[D, H]`, `b1` `[H]`, `w2` `[H, kvh]`, `b2` `[kvh]`."""

    kind: str
    layers: tuple[Mapping[str, np.ndarray], ...]

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidInput(f"KVzap surrogate: kind={self.kind!r}; expected one of {tuple(KINDS)}")
        if not self.layers:
            raise InvalidInput("KVzap surrogate: no layers")
        layers = []
        for i, arrays in enumerate(self.layers):
            if set(arrays) != set(KINDS[self.kind]):
                raise InvalidInput(f"KVzap surrogate: layer {i} holds {sorted(arrays)}; a {self.kind} one holds "
                                   f"{list(KINDS[self.kind])}")
            layers.append({n: np.asarray(arrays[n], np.float32) for n in KINDS[self.kind]})
        first = layers[0]
        for i, arrays in enumerate(layers):
            if any(arrays[n].shape != first[n].shape for n in arrays):
                raise InvalidInput(f"KVzap surrogate: layer {i}'s shapes differ from layer 0's")
            if not all(np.all(np.isfinite(x)) for x in arrays.values()):
                raise InvalidInput(f"KVzap surrogate: layer {i} has non-finite weights")
        object.__setattr__(self, "layers", tuple(layers))

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the kind and every weight's bytes: what two surrogates are equal by."""
        h = hashlib.sha256(self.kind.encode())
        for arrays in self.layers:
            for n in KINDS[self.kind]:
                h.update(n.encode() + str(arrays[n].shape).encode() + arrays[n].tobytes())
        return h.hexdigest()

    def __hash__(self):
        return hash(self.digest)

    def __eq__(self, other):
        return isinstance(other, Surrogate) and other.digest == self.digest

    def __repr__(self):  # what a policy's description shows
        return f"{self.kind}:{self.digest[:12]}"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def input_dim(self) -> int:
        return self.layers[0]["w" if self.kind == "linear" else "w1"].shape[0]

    @property
    def kv_heads(self) -> int:
        return self.layers[0]["b" if self.kind == "linear" else "b2"].shape[0]

    def scores(self, layer: int, hidden: Float[Array, "*b D"]) -> Float[Array, "*b kvh"]:
        """Each token's predicted score per KV head, from its attention input."""
        return apply(self.kind, {n: jnp.asarray(x) for n, x in self.layers[layer].items()}, hidden)

    def params(self) -> list[dict[str, Array]]:
        """The weights as a pytree of jnp arrays (per layer), what `apply` and training take."""
        return [{n: jnp.asarray(x) for n, x in arrays.items()} for arrays in self.layers]

    def save(self, path: str | Path, info: Mapping[str, Any] | None = None) -> Path:
        """Writes `path/kvzap.json` (kind, shapes, `info`: how it was trained) and `path/params` (orbax)."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(path / "params", {"layers": [dict(a) for a in self.layers]}, force=True)
        ckpt.wait_until_finished()
        meta = {"kind": self.kind, "num_layers": self.num_layers, "input_dim": self.input_dim,
                "kv_heads": self.kv_heads, "digest": self.digest, **dict(info or {}),
                "files": checkpoint_files(path / "params")}
        (path / META).write_text(json.dumps(meta, indent=1) + "\n")
        return path

    def to_kvpress(self) -> dict[str, np.ndarray]:
        """The weights as kvpress's `KVzapModel.state_dict()` names and lays them out."""
        out = {}
        for i, a in enumerate(self.layers):
            if self.kind == "linear":
                out |= {f"layers.{i}.weight": a["w"].T, f"layers.{i}.bias": a["b"]}
            else:
                out |= {f"layers.{i}.0.weight": a["w1"].T, f"layers.{i}.0.bias": a["b1"],
                        f"layers.{i}.2.weight": a["w2"].T, f"layers.{i}.2.bias": a["b2"]}
        return {k: np.ascontiguousarray(v) for k, v in out.items()}


def apply(kind: str, arrays: Mapping[str, Array], hidden: Float[Array, "*b D"]) -> Float[Array, "*b kvh"]:
    """A layer's surrogate on `hidden`, in float32 (see the module)."""
    h = hidden.astype(jnp.float32)
    if kind == "linear":
        return h @ arrays["w"] + arrays["b"]
    return jax.nn.gelu(h @ arrays["w1"] + arrays["b1"], approximate=False) @ arrays["w2"] + arrays["b2"]


def checkpoint_files(params: Path) -> dict[str, int]:
    """`{relative name: size}` of an orbax checkpoint's files: recorded at save, checked before a restore, so a
    partial copy is refused naming the file it lacks (orbax's own error comes from a background thread's traceback)."""
    return {f.relative_to(params).as_posix(): f.stat().st_size for f in sorted(params.rglob("*")) if f.is_file()}


def _check_files(path: Path, meta: dict) -> None:
    have = checkpoint_files(path / "params")
    for name, size in meta.get("files", {}).items():
        if have.get(name) != size:
            got = "missing" if name not in have else f"{have[name]} bytes, not {size}"
            raise InvalidInput(f"{path / 'params' / name}: {got}; the surrogate directory is a partial or damaged "
                               "copy: copy it whole, or train it again")


def load(path: str | Path) -> tuple[Surrogate, dict]:
    """(the surrogate saved at `path`, its kvzap.json)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not (path / META).is_file() or not (path / "params").is_dir():
        raise MissingFile(f"{path}: not a KVzap surrogate (a directory with {META} and params/, written by "
                          "python -m kvjax.experiments.train_kvzap)")
    try:
        meta = json.loads((path / META).read_text())
    except ValueError as err:
        raise InvalidInput(f"{path / META} is not valid JSON ({err})") from None
    _check_files(path, meta)
    checkpointer = ocp.StandardCheckpointer()
    try:
        tree = checkpointer.restore(path / "params")
    except (OSError, ValueError) as err:  # orbax / tensorstore: a file of the checkpoint missing or cut short
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InvalidInput(f"{path / 'params'}: the surrogate's parameters cannot be read ({first[:160]}); the "
                           "directory is a partial or damaged copy: copy it whole, or train it again") from None
    finally:
        checkpointer.close()  # its background threads, which otherwise report a closed event loop at exit
    got = Surrogate(meta.get("kind"), tuple(tree["layers"]))
    if got.digest != meta.get("digest"):
        raise InvalidInput(f"{path}: its weights' digest is not the one {META} records (a partial or mixed copy)")
    return got, meta


__all__ = ["KINDS", "Surrogate", "apply", "load"]
