"""The documentation site (mkdocs.yml, docs/): it builds with warnings as errors, its API reference holds every
public name of the documented modules, an undocumented public name fails the build, and the Python snippets of
the guides run against the code as it is (a block whose first line is `# not run: <why>` is only shown)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = ("kvjax", "kvjax.policies", "kvjax.models", "kvjax.experiments.driver")


def _hooks():
    spec = importlib.util.spec_from_file_location("site_files", ROOT / "docs" / "hooks" / "site_files.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def inventory(path: Path) -> set[str]:
    """The object names in a Sphinx inventory (objects.inv, version 2: four header lines, then zlib)."""
    raw = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = raw.index(b"\n", header_end) + 1
    assert raw.startswith(b"# Sphinx inventory version 2")
    lines = zlib.decompress(raw[header_end:]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line}


def test_the_site_builds_strictly_with_every_guide_page(site):
    for page in ("getting-started", "composing", "own-model", "models", "suites", "design", "policies/scored",
                 "policies/mat", "policies/razor", "reproduce/mat", "report-smollm2", "reference/policies"):
        assert (site / page / "index.html").is_file(), page
    # files from beside the code: a model card, a benchmark table, a notebook
    assert (site / "kvjax" / "models" / "small" / "index.html").is_file()
    assert (site / "benchmarks" / "results" / "quant_cpu.png").is_file()
    assert (site / "colab" / "quickstart.ipynb").is_file()
    # equations are MathML, rendered at build time: no raw TeX is left for a script to typeset
    for page in ("policies/scored", "policies/razor", "policies/ring"):
        html = (site / page / "index.html").read_text()
        assert "<math" in html and 'class="arithmatex"' not in html and "\\frac" not in html, page


def test_every_public_name_is_in_the_generated_reference(site):
    names = inventory(site / "objects.inv")
    missing = []
    for module in DOCUMENTED:
        mod = importlib.import_module(module)
        assert mod.__all__, module
        for n in mod.__all__:
            obj = getattr(mod, n)
            # a name that is also a submodule's (kvjax.generate the function and the module) is documented
            # where it is defined
            canonical = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
            if f"{module}.{n}" not in names and canonical not in names:
                missing.append(f"{module}.{n}")
    assert not missing, missing


def test_a_public_name_without_a_docstring_fails_the_build(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        """A package."""
        from pkg.impl import Documented, bare

        LIMIT = 3
        """The limit."""
        ANSWER = 42

        __all__ = ["Documented", "bare", "LIMIT", "ANSWER"]
    '''))
    (pkg / "impl.py").write_text(textwrap.dedent('''
        class Documented:
            """Says what it is."""

        def bare(x):
            return x
    '''))
    hooks = _hooks()
    assert hooks.undocumented("pkg", search_paths=[str(tmp_path)]) == ["pkg.bare", "pkg.ANSWER"]
    # and kvjax's own documented modules have none
    for module in DOCUMENTED:
        assert hooks.undocumented(module) == [], module


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
RUNNABLE = [p for p in PAGES if any(not b.startswith("# not run:") for b in python_blocks(p))]


def test_every_snippet_is_run_or_says_why_not():
    assert len(RUNNABLE) >= 8, [p.name for p in RUNNABLE]
    for page in PAGES:
        for block in python_blocks(page):
            first = block.splitlines()[0]
            assert not first.startswith("# not run") or len(first) > len("# not run: ") + 5, (page, first)


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_guide_snippets_run(page, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # the snippets name kvjax/models/small as a path from the repository root
    namespace: dict = {"__name__": "__docs__"}
    for block in python_blocks(page):
        if block.startswith("# not run:"):
            continue
        # compiled as a file of its own: not under this module's `from __future__ import annotations`
        exec(compile(block, f"{page.name}:snippet", "exec", dont_inherit=True), namespace)


def test_the_menu_has_five_sections_and_the_results_page_links_every_table():
    """The site's menu: Home and five sections (Use, Methods, Reproduce, Results, Reference), at most 40 pages; the
    benchmark tables are reached from the Results page, which links every one of them."""
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):  # mkdocs.yml's !!python/name tags are the theme's, not the menu's
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]
    sections = [next(iter(entry)) for entry in nav]
    assert sections == ["Home", "Use", "Methods", "Reproduce", "Results", "Reference"]

    def leaves(entry):
        value = next(iter(entry.values()))
        return [value] if isinstance(value, str) else [leaf for e in value for leaf in leaves(e)]

    pages = [leaf for entry in nav for leaf in leaves(entry)]
    assert len(pages) <= 40, len(pages)
    linked = set(re.findall(r"\]\((benchmarks/results/[^)]+\.md)\)", (ROOT / "docs" / "results.md").read_text()))
    tables = {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "results").glob("*.md")}
    assert tables == linked, (tables - linked, linked - tables)
