"""Offline text every Python installation has: the standard library's source and its English
reference documentation (`pydoc_data.topics`), split deterministically into train / held out.

The split is by a stable hash of each file's path (or topic name), so the held-out modules
(code completion, perplexity) and topics (QA) are never seen by `kvjax.experiments.train_tiny`.
The text itself depends on the Python version; `fingerprint()` names it in every result.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

from kvjax.errors import InvalidInput, MissingFile

# Directories of the standard library left out: test suites (huge, repetitive), vendored or GUI
# demo code, codec tables (encodings/), the build's config-* directory, and pydoc_data itself
# (its topics are the English half of the corpus).
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
                           "site-packages", "dist-packages", "__pycache__", "encodings"})
HELD_OUT_EVERY = 10  # one file / topic in ten is held out
SPLITS = ("train", "heldout")


def _split_of(name: str) -> str:
    return "heldout" if zlib.crc32(name.encode()) % HELD_OUT_EVERY == 0 else "train"


def _check(split: str) -> None:
    if split not in SPLITS:
        raise InvalidInput(f"split={split!r}; expected one of {SPLITS}")


@lru_cache(maxsize=None)
def stdlib_files() -> tuple[tuple[str, Path], ...]:
    """(path relative to the stdlib root, absolute path) of every included .py file, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        files.append((rel.as_posix(), f))
    if not files:
        raise MissingFile(f"no standard-library .py files under {root}")
    return tuple(sorted(files))


def code_documents(split: str = "train") -> list[tuple[str, str]]:
    """(module path, source) of the standard-library modules in `split`."""
    _check(split)
    out = []
    for rel, f in stdlib_files():
        if _split_of(rel) == split:
            text = f.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                out.append((rel, text))
    return out


def doc_documents(split: str = "train") -> list[tuple[str, str]]:
    """(topic name, text) of the `pydoc_data.topics` reference topics in `split`."""
    _check(split)
    from pydoc_data.topics import topics

    return [(k, topics[k]) for k in sorted(topics) if _split_of(k) == split]


def fingerprint() -> str:
    """Python version + a hash of the file list: two machines with the same fingerprint have the same corpus."""
    names = "\n".join(rel for rel, _ in stdlib_files()).encode()
    return f"python{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}-" + \
        hashlib.sha1(names).hexdigest()[:10]
