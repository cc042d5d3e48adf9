"""Where the embedded default model lives, and the random stand-in used when a checkout lacks its weights."""

from __future__ import annotations

from pathlib import Path

from kvjax.models import DEFAULT_DIR

# The embedded default: trained by `python -m kvjax.experiments.train_tiny` and committed (see its README.md).
DEFAULT_MODEL_DIR = DEFAULT_DIR
RANDOM_DEFAULT_DIR = Path.home() / ".cache" / "kvjax" / "random-tiny-llama"


def default_model_dir() -> tuple[Path, bool]:
    """(directory, is random) of the embedded default model.

    The trained default (kvjax/models/default); if it is missing (a checkout without its weights), a
    tiny *randomly initialised* Llama created on first use, flagged as random."""
    from kvjax.models.tiny import is_random, make_random_checkpoint

    if (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        return DEFAULT_MODEL_DIR, False
    if not (RANDOM_DEFAULT_DIR / "model.safetensors").is_file():
        make_random_checkpoint(RANDOM_DEFAULT_DIR)
    return RANDOM_DEFAULT_DIR, is_random(RANDOM_DEFAULT_DIR)
