"""What computed a run, from the things themselves: the source of kvjax that ran, and the model as it is in memory.

A run's identity (`kvjax.experiments.records.claim_results_dir`, OUT/identity.json) decides whether a rerun resumes
its records or is refused. It used to name the model by the files under its path and kvjax by its version
string, so two models in memory that shared a path string shared records (the second resumed into the first's),
and a run after an edit to a policy reused the records of the code before it. Both are now digests:

* `source_digest()`: every source and data file of the installed `kvjax` package (its library, models and
  suites: `*.py`, `*.json`, `*.jsonl`, `*.txt`), so any edit starts new records or is refused, by name;
* `model_identity(model)`: the model's class, a digest of its config and a digest of every array it holds
  (`kvjax.structure.split`: an NNX module's state or a pytree's leaves, Attention-Gates and LoRA included),
  whether it came from a path or was built in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from pathlib import Path

import jax
import numpy as np

SOURCE_SUFFIXES = (".py", ".json", ".jsonl", ".txt")
DIGEST_CHARS = 16


@functools.cache
def source_digest() -> str:
    """A digest of the kvjax package's source and data files (relative name and content), computed once a process.
    The models' weights are not in it: a model's own digest is (`model_identity`)."""
    root = Path(__file__).resolve().parents[1]  # the kvjax package
    h = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()
                       and "__pycache__" not in p.parts and "training" not in p.relative_to(root).parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def _config_text(cfg) -> str:
    """A config as stable text: a dataclass's fields as JSON, anything else its repr; no memory address."""
    try:
        text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=repr) if dataclasses.is_dataclass(cfg) \
            else repr(cfg)
    except TypeError:  # a field that cannot be deep-copied
        text = repr(cfg)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def weights_digest(model) -> str:
    """A digest of every array of `model` (shape, dtype and bytes, in the model's tree order)."""
    from kvjax.structure import split

    _, arrays = split(model)
    h = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    for x in jax.tree.leaves(arrays):
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def model_identity(model) -> dict[str, str]:
    """`{"model class", "model config", "weights"}`: what makes two models compute the same thing."""
    cls = type(model)
    config = hashlib.blake2b(_config_text(model.cfg).encode(), digest_size=DIGEST_CHARS // 2).hexdigest()
    return {"model class": f"{cls.__module__}.{cls.__qualname__}", "model config": config,
            "weights": weights_digest(model)}


__all__ = ["model_identity", "source_digest", "weights_digest"]
