"""Loading and saving models as local Hugging Face directories.

Never touches the network: a path that is not a directory is looked up in the
local Hugging Face cache only (`local_files_only=True`), and never runs a
checkpoint's own Python code (`trust_remote_code=False`).

Parameter names are derived from the module tree, whose attribute names follow
transformers' (`layers.0.self_attn.q_proj`): a Linear's `kernel` is the
transposed HF `weight`, an Embed's `embedding` is its `weight`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import baichuan, mistral, qwen2
from models.llama import Llama, LlamaConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How to read one `model_type`: its config (from transformers' AutoConfig, or from the raw
    config.json for models transformers does not know) and, if needed, a tensor-name adapter."""

    model: type
    from_hf: object = None  # transformers config -> kvjax config
    from_json: object = None  # config.json dict -> kvjax config (no AutoConfig, no remote code)
    tensors: object = None  # (tensors, config, config.json dict) -> adapted tensors


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(Llama, from_hf=LlamaConfig.from_hf),
    "mistral": Architecture(Llama, from_hf=mistral.config_from_hf),
    "qwen2": Architecture(Llama, from_hf=qwen2.config_from_hf),
    "baichuan": Architecture(
        Llama,
        from_json=baichuan.config_from_json,
        tensors=lambda t, cfg, d: baichuan.BaichuanTensors(t, cfg, baichuan.norm_head(d)),
    ),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Buffers some checkpoints carry that are recomputed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class LoadedModel:
    model: nnx.Module
    tokenizer: object | None  # a transformers tokenizer, or None if the directory has none
    config: LlamaConfig
    path: Path


def resolve(path_or_id: str | Path) -> Path:
    """A local directory, or a hub id already in the local HF cache; never downloads."""
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise NotADirectoryError(f"model path {str(p)!r} is a file; pass the checkpoint directory")
    name = str(path_or_id)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(name, local_files_only=True, cache_dir=constants.HF_HUB_CACHE))
        except LocalEntryNotFoundError:
            raise FileNotFoundError(
                f"model {name!r} is not a local directory and is not in the local Hugging Face "
                f"cache ({constants.HF_HUB_CACHE}); kvjax never downloads at run time. Download it "
                "where there is network (e.g. `hf download " + name + "`) and pass the directory."
            ) from None
    raise FileNotFoundError(f"model directory {name!r} does not exist")


def read_config(path: Path):
    """(kvjax config, architecture, config.json dict); transformers' AutoConfig where it knows the type."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    raw = json.loads(cfg_file.read_text())
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unknown model_type {model_type!r} in {cfg_file}; kvjax supports {sorted(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[model_type]
    if arch.from_json is not None:
        return arch.from_json(raw), arch, raw
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return arch.from_hf(hf), arch, raw


class _Tensors:
    """Name -> shape without reading data; `get(name)` reads one tensor as NumPy."""

    def __init__(self, path: Path):
        files = self._files(path)
        self.files = files
        self._where: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._torch: dict[Path, dict] = {}
        self._st: dict[Path, object] = {}
        for f in files:
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                h = self._st[f] = safe_open(str(f), framework="np")
                for k in h.keys():
                    self._where[k], self._shape[k] = f, tuple(h.get_slice(k).get_shape())
            else:
                sd = self._torch[f] = _torch_load(f)
                for k, t in sd.items():
                    self._where[k], self._shape[k] = f, tuple(t.shape)

    @staticmethod
    def _files(path: Path) -> list[Path]:
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (path / index).is_file():
                weight_map = json.loads((path / index).read_text())["weight_map"]
                files = sorted({path / f for f in weight_map.values()})
                missing = [str(f) for f in files if not f.is_file()]
                if missing:
                    raise FileNotFoundError(f"{path / index} names shard files that are missing: {missing}")
                return files
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (path / single).is_file():
                return [path / single]
        raise FileNotFoundError(
            f"no weights in {path}: expected model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin or pytorch_model.bin.index.json"
        )

    def names(self) -> set[str]:
        return set(self._where)

    def source(self, name: str) -> str:
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def file(self, name: str) -> Path:
        return self._where[name]

    def get(self, name: str) -> np.ndarray:
        f = self._where[name]
        if f in self._st:
            return self._st[f].get_tensor(name)
        return _torch_to_numpy(self._torch[f][name])


def _torch_load(f: Path) -> dict:
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{f.name} is a PyTorch checkpoint and torch is not installed; install "
            "`kvjax[torch]` or convert the checkpoint to safetensors"
        ) from None
    return torch.load(f, map_location="cpu", weights_only=True, mmap=True)


def _torch_to_numpy(t) -> np.ndarray:
    import ml_dtypes
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def hf_parameters(model: nnx.Module) -> dict[str, tuple[nnx.Variable, bool]]:
    """HF tensor name -> (the model's parameter, whether the HF tensor is its transpose)."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        *mods, leaf = (str(p) for p in path)
        transpose = leaf == "kernel"
        leaf = "weight" if leaf in ("kernel", "embedding") else leaf
        prefix = [] if mods and mods[0] == "lm_head" else ["model"]
        out[".".join(prefix + mods + [leaf])] = (node, transpose)
    return out


def load(
    path_or_id: str | Path, *, dtype="float32", tokenizer: bool = True, attention_impl: str = "xla"
) -> LoadedModel:
    """Loads a model (and its tokenizer, if the directory has one) from a local HF directory.

    `attention_impl="pallas"` runs attention through the kernels of `kvjax.pallas`."""
    if isinstance(dtype, str):
        if dtype == "float64":  # for exactness tests against float64 references
            if not jax.config.jax_enable_x64:
                raise ValueError("dtype='float64' needs jax_enable_x64 (e.g. `with jax.enable_x64(True):`)")
            dtype = jnp.float64
        elif dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; use one of {list(DTYPES)}")
        else:
            dtype = DTYPES[dtype]
    path = resolve(path_or_id)
    cfg, arch, raw = read_config(path)
    cfg = dataclasses.replace(cfg, attention_impl=attention_impl)
    model = nnx.eval_shape(lambda: arch.model(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    tensors = _Tensors(path)
    if arch.tensors is not None:
        tensors = arch.tensors(tensors, cfg, raw)
    params = hf_parameters(model)
    available = tensors.names()
    for name, (var, transpose) in params.items():
        if name not in available:
            raise KeyError(
                f"weight {tensors.source(name)!r} is missing from the checkpoint in {path} "
                f"(files: {[f.name for f in tensors.files]})"
            )
        want = tuple(var.get_value().shape[::-1] if transpose else var.get_value().shape)
        got = tensors.shape(name)
        if got != want:
            raise ValueError(
                f"weight {name!r} in {tensors.file(name).name} has shape {got}, but config.json "
                f"implies {want}"
            )
        arr = tensors.get(name)
        var.set_value(jnp.asarray(arr.T if transpose else arr, dtype=dtype))
    extra = sorted(n for n in available - params.keys() if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        log.warning("ignoring %d tensors the model does not use: %s", len(extra), extra[:5])
    tok = None
    if tokenizer and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return LoadedModel(model=model, tokenizer=tok, config=cfg, path=path)


def save_pretrained(model: nnx.Module, path: str | Path, tokenizer=None) -> Path:
    """Writes config.json + model.safetensors (+ tokenizer) that transformers and `load` read."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.cfg.to_hf().save_pretrained(path)
    tensors = {}
    for name, (var, transpose) in hf_parameters(model).items():
        arr = np.asarray(var.get_value())
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
