"""Where the models kvjax ships live, and their names: `load("kvjax-small")` works from any directory and from an
installed wheel, and tables name them so (`kvjax.experiments.records.shown`), never by where they were installed."""

from pathlib import Path

# The embedded default model (trained by `python -m kvjax.experiments.train_tiny`; see its README.md).
DEFAULT_DIR = Path(__file__).resolve().parent / "default"
# kvjax-small: the default grown to 6 layers and a 2048-token context (`python -m kvjax.experiments.train_small`);
# the main job's model.
SMALL_DIR = Path(__file__).resolve().parent / "small"
EMBEDDED = {"kvjax-small": SMALL_DIR, "kvjax-tiny": DEFAULT_DIR}

__all__ = ["DEFAULT_DIR", "EMBEDDED", "SMALL_DIR"]
