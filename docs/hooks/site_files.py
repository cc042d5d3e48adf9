"""MkDocs hooks for kvjax's site (mkdocs.yml names this file).

- The site shows files that live beside the code, not under docs/: the model cards (models/*/README.md and
  their plots), the committed benchmark results (benchmarks/results/) and the notebooks (colab/). They are
  added to the site at the same relative paths, so a page links them as `kvjax/models/small/README.md` from the
  site's root and the link checker sees them.
- Equations are rendered at build time: the TeX that pymdownx.arithmatex marks is converted to MathML
  (latex2mathml), which browsers draw natively, so the site shows its equations offline, with no script.
- A public name without a docstring fails the strict build: every name in `__all__` of the modules the API
  reference documents must say what it is (mkdocstrings itself renders an undocumented name silently).
"""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.plugins.kvjax")

ROOT = Path(__file__).resolve().parents[2]
# (folder under the repository root, file patterns) shown on the site
SITE_FILES = [
    ("kvjax/models/default", ("README.md", "*.png")),
    ("kvjax/models/small", ("README.md", "*.png")),
    ("benchmarks/results", ("*.md", "*.png", "*.json")),
    ("colab", ("*.ipynb",)),
]
# The modules whose public names the reference must document (issue: "every public name exported by ...").
DOCUMENTED = ("kvjax", "kvjax.policies", "kvjax.models", "kvjax.experiments.driver")


def on_files(files, config):
    # The site's home page is the README (one landing text, not two that drift apart).
    files.append(File("README.md", str(ROOT), config["site_dir"], config["use_directory_urls"]))
    for folder, patterns in SITE_FILES:
        for pattern in patterns:
            for path in sorted((ROOT / folder).glob(pattern)):
                uri = path.relative_to(ROOT).as_posix()
                files.append(File(uri, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "README.md":
        # the README links the site's pages from the repository root
        markdown = markdown.replace("](docs/", "](")
    return markdown


MATH = re.compile(r'<(span|div) class="arithmatex">\\[(\[](.*?)\\[)\]]</\1>', re.S)


def on_page_content(content, page, config, files):
    from latex2mathml.converter import convert

    def mathml(m):
        tex = html.unescape(m.group(2))
        try:
            return convert(tex, display="block" if m.group(1) == "div" else "inline")
        except Exception as err:  # noqa: BLE001  (any parse failure is reported and fails the strict build)
            log.warning(f"{page.file.src_uri}: cannot render the equation {tex!r}: {err}")
            return m.group(0)

    return MATH.sub(mathml, content)


def undocumented(module: str, search_paths: list[str] | None = None) -> list[str]:
    """Names in `module.__all__` whose object (followed through re-exports) has no docstring, read statically
    with griffe as mkdocstrings reads them (a constant's docstring is the string literal after it)."""
    import griffe

    loader = griffe.GriffeLoader(search_paths=search_paths or [str(ROOT)])
    mod = loader.load(module)
    # re-exports are followed into the packages they come from
    for name in {module.split(".")[0]} | (set() if search_paths else {"kvjax"}):
        loader.load(name)
    loader.resolve_aliases(implicit=True, external=False)
    names = mod.exports
    if names is None:
        return [f"{module}: no __all__"]
    missing = []
    for name in names:
        name = name if isinstance(name, str) else name.name
        obj = mod.get_member(name) if name in mod.members else None
        if obj is None:
            missing.append(f"{module}.{name} (not found)")
            continue
        target = obj.final_target if obj.is_alias else obj
        if not (target.docstring and target.docstring.value.strip()):
            missing.append(f"{module}.{name}")
    return missing


def on_pre_build(config):
    for module in DOCUMENTED:
        for name in undocumented(module):
            log.warning(f"public name without a docstring: {name}")
