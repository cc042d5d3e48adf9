"""The methods index: every `--policy` name with its paper, the memory it holds, its page and its options, derived
from the methods' own declarations (`kvjax.policies.options`), a researcher's own methods included.

    python -m kvjax.experiments.methods                          # every method, one line each
    python -m kvjax.experiments.methods --policy snapkv          # one method's options: flag, default, help
    python -m kvjax.experiments.methods --policy my_rules:MyRule # a class of your own, its options from its fields
    python -m kvjax.experiments.methods --import my_rules        # kvjax's methods and those my_rules registers
    python -m kvjax.experiments.methods --write                  # (in a clone) the tables of README.md and the docs

The tables in README.md and docs/policies/index.md are written by `--write` and checked by `tests/test_methods.py`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kvjax import cli
from kvjax.errors import InvalidInput
from kvjax.policies import options, registry

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- methods table: python -m kvjax.experiments.methods --write -->"
END = "<!-- end of the methods table -->"


def page_title(page: str, docs: Path = ROOT / "docs") -> str:
    """A docs page's first heading (`policies/scored.md` -> "Score-based compression: SnapKV and its family")."""
    for line in (docs / page).read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    raise InvalidInput(f"{docs / page} has no '# ' heading")


def tables() -> dict[Path, str]:
    """The generated table each file holds between `BEGIN` and `END`."""
    return {ROOT / "README.md": options.pages_table("docs/", page_title),
            ROOT / "docs" / "policies" / "index.md": options.methods_table()}


def replace_block(text: str, table: str, where: Path) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise InvalidInput(f"{where}: expected one '{BEGIN}' and one '{END}'")
    head, rest = text.split(BEGIN)
    return f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}"


def describe(m: options.Method) -> str:
    """One method's card: name, paper, memory, page, and each option with its flag, its default and its help."""
    lines = [f"{m.name}: {m.paper}; memory {m.memory}; " + (f"docs/{m.docs}" if m.docs else f"declared in {m.source}"),
             "  --budget N: slots per layer and KV head" if m.budget else "  (sized by its own options, no --budget)"]
    for dest, spec in sorted(m.options.items(), key=lambda kv: kv[1].flag):
        default = m.defaults.get(dest)
        shown = "" if spec.const is not options.NO_CONST or default is None else f" (default {default})"
        lines.append(f"  {spec.flag}{shown}: {spec.help}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.methods", description=__doc__.split("\n\n")[0],
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--import", dest="modules", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (a module of yours that registers methods); repeatable")
    p.add_argument("--policy", help="show this method's options (a registered name or module:Class)")
    p.add_argument("--write", action="store_true", help="write the methods tables of README.md and docs/ (a clone)")
    args = p.parse_args(argv)
    for name in args.modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise InvalidInput(f"--import {name}: {err}") from None
    if args.write:
        for path, table in tables().items():
            path.write_text(replace_block(path.read_text(), table, path))
            print(f"wrote {path}")
        return 0
    if args.policy:
        print(describe(registry.method(args.policy)))
        return 0
    for m in options.methods().values():
        print(f"{m.name:20} {m.memory[:44]:44} {m.paper}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, compile_cache=None))  # compiles nothing
