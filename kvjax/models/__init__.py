"""Model definitions and loading from local Hugging Face directories."""

from kvjax.errors import MissingFile
from kvjax.models import embedded as _embedded
from kvjax.models.llama import Llama, LlamaConfig
from kvjax.models.loading import LoadedModel, load, save_pretrained

DEFAULT_DIR = _embedded.DEFAULT_DIR
"""The embedded default model's directory, kvjax-tiny (2 layers, 512 tokens): the fast tests' and most suites'
default."""
SMALL_DIR = _embedded.SMALL_DIR
"""kvjax-small's directory (6 layers, 2048 tokens): the main job's, the report's and the notebooks' model."""
EMBEDDED = _embedded.EMBEDDED
"""`{name: directory}` of the models kvjax ships: `load("kvjax-small")`, `load("kvjax-tiny")` from anywhere."""


def load_default(**kwargs) -> LoadedModel:
    """`load(DEFAULT_DIR, **kwargs)`: the embedded default model with its tokenizer."""
    if not (DEFAULT_DIR / "model.safetensors").is_file():
        raise MissingFile(f"the default model is missing from {DEFAULT_DIR}; rebuild it with "
                                "python -m kvjax.experiments.train_tiny")
    return load(DEFAULT_DIR, **kwargs)


__all__ = ["DEFAULT_DIR", "EMBEDDED", "SMALL_DIR", "Llama", "LlamaConfig", "LoadedModel", "load", "load_default", "save_pretrained"]
