"""Model definitions and loading from local Hugging Face directories."""

from models.llama import Llama, LlamaConfig
from models.loading import LoadedModel, load, save_pretrained

__all__ = ["Llama", "LlamaConfig", "LoadedModel", "load", "save_pretrained"]
