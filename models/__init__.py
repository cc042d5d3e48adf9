"""Model definitions and loading from local Hugging Face directories."""

from pathlib import Path

from kvjax.errors import MissingFile
from models.llama import Llama, LlamaConfig
from models.loading import LoadedModel, load, save_pretrained

# The embedded default model (trained by `python -m experiments.train_tiny`; see its README.md).
DEFAULT_DIR = Path(__file__).resolve().parent / "default"
"""The embedded default model's directory (2 layers, 512 tokens): the fast tests' and most suites' default."""
# kvjax-small: the default grown to 6 layers and a 2048-token context (`python -m experiments.train_small`);
# the main job's model.
SMALL_DIR = Path(__file__).resolve().parent / "small"
"""kvjax-small's directory (6 layers, 2048 tokens): the main job's and the report's model."""


def load_default(**kwargs) -> LoadedModel:
    """`load(DEFAULT_DIR, **kwargs)`: the embedded default model with its tokenizer."""
    if not (DEFAULT_DIR / "model.safetensors").is_file():
        raise MissingFile(f"the default model is missing from {DEFAULT_DIR}; rebuild it with "
                                "python -m experiments.train_tiny")
    return load(DEFAULT_DIR, **kwargs)


__all__ = ["DEFAULT_DIR", "SMALL_DIR", "Llama", "LlamaConfig", "LoadedModel", "load", "load_default", "save_pretrained"]
