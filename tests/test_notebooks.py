"""The Colab notebooks are committed without outputs, install kvjax in their first cell, and import only what the
documentation (README.md and the site under docs/) documents. They run top to bottom from an installed wheel in
`tests/test_wheel.py` (the quickstart in the default suite, the other three under `pytest -m slow`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def documentation() -> str:
    """The README and every page of the documentation site."""
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])


def test_the_four_notebooks_exist_and_the_documentation_links_them():
    names = {p.name for p in NOTEBOOKS}
    assert names == {"quickstart.ipynb", "compose_policies.ipynb", "attention_patterns.ipynb",
                     "longbench_real_model.ipynb"}
    readme = documentation()
    for n in names:
        assert f"colab/{n}" in readme


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_stripped_badge_and_public_imports(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    # no link to a repository that does not exist: the install cell installs from a source the user sets
    assert "github.com/kvjax/kvjax" not in path.read_text()
    install = _code(nb)[0]
    assert 'KVJAX_SOURCE = ""' in install and "set KVJAX_SOURCE" in install
    readme = documentation()
    for src in _code(nb):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("kvjax", "models", "experiments"):
                assert re.search(rf"\b{re.escape(node.module)}\b", readme), f"{path.name}: {node.module} not documented"
