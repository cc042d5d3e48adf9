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
import pickle
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.errors import InvalidInput, MissingFile, MissingKey, NonFiniteWeights
from kvjax.model import CachedLM
from kvjax.models import baichuan, gemma, mistral, phi3, qwen2, qwen3
from kvjax.models.llama import Llama, LlamaConfig

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
    "qwen3": Architecture(Llama, from_hf=qwen3.config_from_hf),
    "gemma2": Architecture(Llama, from_hf=gemma.config_from_hf),
    "gemma3_text": Architecture(Llama, from_hf=gemma.config_from_hf),
    "phi3": Architecture(Llama, from_hf=phi3.config_from_hf, tensors=lambda t, cfg, d: phi3.Phi3Tensors(t, cfg)),
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
    """What `kvjax.models.load` returns: the model, its tokenizer (or None), its config, where it came from, and
    how it was loaded. A suite's Python API takes one (`passkey.suite`, `needle.suite`, ...); for a model of your
    own (any `kvjax.model.CachedLM`, not only an NNX module), `LoadedModel(model, tokenizer)`: the suites read the
    model's `cfg`, and the run's identity comes from the model itself (`kvjax.experiments.identity.model_identity`),
    not from a path. `tests/test_own_model.py` runs passkey's so."""

    model: nnx.Module | CachedLM
    tokenizer: object | None  # a transformers tokenizer, or None if the directory has none
    config: LlamaConfig | None = None  # the checkpoint's (kvjax's Llama); None for a model of your own
    path: Path | None = None
    # How it was loaded (dtype, attention_impl, allow_nonfinite; gate_params once gates are attached):
    # part of the identity of every result computed with it (kvjax.experiments.driver.open_records).
    load_options: dict = dataclasses.field(default_factory=dict)


def resolve(path_or_id: str | Path) -> Path:
    """A local directory, a GGUF file, an embedded model's name (`"kvjax-small"`, `"kvjax-tiny"`:
    `kvjax.models.EMBEDDED`), a model `kvjax.models.fetch` knows by name (`"smollm2"`), or a hub id already in the
    local HF cache; never downloads."""
    from kvjax.models import fetch
    from kvjax.models.embedded import EMBEDDED

    if isinstance(path_or_id, str) and path_or_id in EMBEDDED:
        return EMBEDDED[path_or_id]
    if isinstance(path_or_id, str) and path_or_id in fetch.KNOWN:
        return fetch.known_model(path_or_id)
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if p.is_file():
        from kvjax.models.gguf import is_gguf

        if is_gguf(p):
            return p
        raise InvalidInput(f"model path {str(p)!r} is a file but not a GGUF file; pass the checkpoint directory "
                           "or a .gguf file")
    if p.exists():
        raise InvalidInput(f"model path {str(p)!r} is neither a directory nor a file")
    name = str(path_or_id)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith(".gguf"):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(name, local_files_only=True, cache_dir=constants.HF_HUB_CACHE))
        except LocalEntryNotFoundError:
            raise MissingFile(
                f"model {name!r} is not a local directory and is not in the local Hugging Face "
                f"cache ({constants.HF_HUB_CACHE}); kvjax never downloads at run time. Download it "
                "where there is network (e.g. `hf download " + name + "`) and pass the directory."
            ) from None
    kind = "GGUF file" if name.endswith(".gguf") else "model directory"
    raise MissingFile(f"{kind} {name!r} does not exist")


def quiet_transformers() -> None:
    """Imports transformers (tokenizers, configs, GGUF metadata) without its import-time advisory "PyTorch was not
    found. Models won't be available ...": kvjax's models are JAX's, and a user of the base install cannot act on
    it. Called where kvjax first needs transformers (`load`, `tokenizer_at`, `read_config`); other advice stays."""
    import os
    import sys

    if "transformers" in sys.modules:
        return
    before = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        import transformers  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = before


def read_config(path: Path):
    """(kvjax config, architecture, config.json dict); transformers' AutoConfig where it knows the type."""
    quiet_transformers()
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise MissingFile(f"no config.json in {path}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidInput(f"{cfg_file} is not valid JSON ({err})") from None
    except RecursionError:
        raise InvalidInput(f"{cfg_file} nests too deeply to be a config") from None
    if not isinstance(raw, dict):
        raise InvalidInput(f"{cfg_file} holds a JSON {type(raw).__name__}, not an object")
    model_type = raw.get("model_type")
    if model_type == "gemma3":
        raise gemma.multimodal_error()
    if model_type not in ARCHITECTURES:
        raise InvalidInput(
            f"unknown model_type {model_type!r} in {cfg_file}; kvjax supports {sorted(ARCHITECTURES)}"
        )
    _note_remote_code(cfg_file, raw)
    arch = ARCHITECTURES[model_type]
    try:
        if arch.from_json is not None:
            return arch.from_json(raw), arch, raw
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        return arch.from_hf(hf), arch, raw
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, InvalidInput):
            raise
        raise InvalidInput(f"{cfg_file} is not a valid {model_type} config ({type(err).__name__}: {err})") from err


_remote_code_noted: set[Path] = set()


def _note_remote_code(cfg_file: Path, raw: dict) -> None:
    """Says once per checkpoint that its own code (`auto_map`) is never run: kvjax reads the
    config and maps the weights itself, so the hint is not silently ignored either."""
    if ("auto_map" in raw or raw.get("trust_remote_code")) and cfg_file not in _remote_code_noted:
        _remote_code_noted.add(cfg_file)
        log.warning("%s: this checkpoint ships its own code (auto_map %s); kvjax never runs it and reads "
                    "the weights with its own %r implementation", cfg_file, sorted(raw.get("auto_map", {})),
                    raw.get("model_type"))


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
                from safetensors import SafetensorError, safe_open

                try:
                    h = self._st[f] = safe_open(str(f), framework="np")
                except SafetensorError as err:  # truncated or not a safetensors file at all
                    raise InvalidInput(f"{f} is not a readable safetensors file ({err})") from None
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
                    raise MissingFile(f"{path / index} names shard files that are missing: {missing}")
                return files
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (path / single).is_file():
                return [path / single]
        raise MissingFile(
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
            from safetensors import SafetensorError

            try:
                return self._st[f].get_tensor(name)
            except SafetensorError as err:  # the header is whole but the data was cut short
                raise InvalidInput(f"{f}: tensor {name!r} cannot be read ({err})") from None
        return _torch_to_numpy(self._torch[f][name])


def _torch_load(f: Path) -> dict:
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{f.name} is a PyTorch checkpoint and torch is not installed; install "
            "`kvjax[torch]` or convert the checkpoint to safetensors"
        ) from None
    # Memory mapping needs the zip format of torch >= 1.6; legacy pickled files load whole.
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
    except pickle.UnpicklingError as err:
        raise InvalidInput(f"{f} cannot be read as plain tensors ({_torch_reason(err)}); kvjax never runs code pickled "
                           "in a checkpoint: use a safetensors copy of the model") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise InvalidInput(f"{f} is not a readable PyTorch checkpoint ({_torch_reason(err)})") from None


def _torch_reason(err: Exception) -> str:
    """torch.load's error in one line, without its advice: it suggests `weights_only=False`, which
    runs whatever code the file pickled; kvjax never does that and never tells a user to."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    chunks = [c for c in text.split("\n\n") if c.strip()] or [type(err).__name__]
    reason = " ".join(chunks[0].split()).split(". ")[0].rstrip(".")
    return type(err).__name__ if "weights_only" in reason else reason


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
    path_or_id: str | Path, *, dtype="float32", tokenizer: bool = True, attention_impl: str = "xla",
    allow_nonfinite: bool = False, layer_loop: str = "scan",
) -> LoadedModel:
    """Loads a model (and its tokenizer, if there is one) from a local HF directory, a GGUF file
    (`kvjax.models.gguf`: dequantized tensor by tensor to `dtype`) or a fetched model's name ("smollm2").

    `attention_impl="pallas"` runs attention through the kernels of `kvjax.pallas`; `layer_loop="unroll"` traces
    every layer instead of scanning each run of layers alike (`kvjax.models.llama.Llama.__call__`). A weight
    holding NaN or inf is refused (`NonFiniteError`, naming the tensor) unless `allow_nonfinite`;
    a checkpoint tensor the config does not use (e.g. a config with fewer layers) is refused too."""
    quiet_transformers()
    if isinstance(dtype, str):
        if dtype == "float64":  # for exactness tests against float64 references
            if not jax.config.jax_enable_x64:
                raise InvalidInput("dtype='float64' needs jax_enable_x64 (e.g. `with jax.enable_x64(True):`)")
            dtype = jnp.float64
        elif dtype not in DTYPES:
            raise InvalidInput(f"dtype {dtype!r} not supported; use one of {list(DTYPES)}")
        else:
            dtype = DTYPES[dtype]
    path = resolve(path_or_id)
    if path.is_file():  # a GGUF file: config, tokenizer and tensors from it
        from kvjax.models.gguf import GGUFFile

        tensors = GGUFFile(path)
        arch = ARCHITECTURES[tensors.hf_model_type]
        try:
            cfg = arch.from_hf(tensors.hf_config())
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, InvalidInput):
                raise
            raise InvalidInput(f"{path}: its metadata is not a valid {tensors.arch_name} config "
                               f"({type(err).__name__}: {err})") from err
    else:
        cfg, arch, raw = read_config(path)
        tensors = _Tensors(path)
        if arch.tensors is not None:
            tensors = arch.tensors(tensors, cfg, raw)
    cfg = dataclasses.replace(cfg, attention_impl=attention_impl, layer_loop=layer_loop)
    # The checkpoint's depth against the config's before anything is built (a config claiming 100000
    # layers once built for minutes before its weights were found missing)
    layers = {int(n.split(".")[2]) for n in tensors.names() if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if layers and (len(layers) != cfg.num_layers or max(layers) != cfg.num_layers - 1):
        raise InvalidInput(f"the checkpoint in {path} has {len(layers)} layers, its config {cfg.num_layers}; fix the "
                           "config or pass the directory the weights belong to")
    model = nnx.eval_shape(lambda: arch.model(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    params = hf_parameters(model)
    available = tensors.names()
    for name, (var, transpose) in params.items():
        if name not in available:
            raise MissingKey(
                f"weight {tensors.source(name)!r} is missing from the checkpoint in {path} "
                f"(files: {[f.name for f in tensors.files]})"
            )
        want = tuple(var.get_value().shape[::-1] if transpose else var.get_value().shape)
        got = tensors.shape(name)
        if got != want:
            raise InvalidInput(
                f"weight {name!r} in {tensors.file(name).name} has shape {got}, but config.json "
                f"implies {want}"
            )
    extra = sorted(n for n in available - params.keys() if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        # Dropping weights silently runs another model than the checkpoint (e.g. a 1-layer config
        # over a 2-layer checkpoint printed garbage): the config and the weights must agree.
        raise InvalidInput(
            f"{len(extra)} tensors of the checkpoint in {path} are not used by its config.json "
            f"({cfg.num_layers} layers): {extra[:6]}{' ...' if len(extra) > 6 else ''}; fix config.json "
            "or pass the directory the weights belong to")
    for name, (var, transpose) in params.items():
        arr = tensors.get(name)
        if not allow_nonfinite:
            bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            if bad:
                raise NonFiniteWeights(tensors.source(name), tensors.file(name), bad)
        var.set_value(jnp.asarray(arr.T if transpose else arr, dtype=dtype))
    tok = None
    if tokenizer and path.is_file():
        tok = tensors.tokenizer()
    elif tokenizer and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tok = load_tokenizer(path)
    return LoadedModel(model=model, tokenizer=tok, config=cfg, path=path,
                       load_options={"dtype": jnp.dtype(dtype).name, "attention_impl": attention_impl,
                                     "allow_nonfinite": allow_nonfinite})


def tokenizer_at(path: Path):
    """The tokenizer `load` would return for `path` (a GGUF file or a model directory), without the weights;
    None when there is none."""
    quiet_transformers()
    if path.is_file():
        from kvjax.models.gguf import GGUFFile

        return GGUFFile(path).tokenizer()
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return load_tokenizer(path)
    return None


def load_tokenizer(path: Path):
    """transformers' AutoTokenizer for a local directory; a broken tokenizer file is an
    `InvalidInput` naming the directory (the tokenizers library's own message is cryptic)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # tokenizers raises a bare Exception for malformed JSON
        files = [f for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model") if (path / f).is_file()]
        raise InvalidInput(f"the tokenizer in {path} ({', '.join(files)}) cannot be read: "
                           f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err


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
