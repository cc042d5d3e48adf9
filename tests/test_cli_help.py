"""Every entry point's every option says what it does and what it defaults to (issue 90: `--samples`, `--batch`,
`--seed`, `--out` and `--dtype` had no help), read from the parsers the commands build."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                      for d in ("benchmarks", "kvjax/experiments", "kvjax/models") for p in (REPO / d).rglob("*.py")
                      if "cli.run(main" in p.read_text() and "results" not in p.parts)


def parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `module.main` builds (its `parse_args` stops the command)."""
    got = []

    def stop(self, *args, **kwargs):
        got.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(SystemExit):
        importlib.import_module(module).main([])
    return got[0]


def test_the_entry_points_are_found():
    assert {"kvjax.experiments.generate", "kvjax.experiments.ruler.__main__", "benchmarks.e2e",
            "kvjax.models.fetch"} <= set(ENTRY_POINTS) and len(ENTRY_POINTS) >= 30


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_cli_error_every_option_has_help_and_its_default(module, monkeypatch):
    p = parser_of(module, monkeypatch)
    quiet = (None, False, argparse.SUPPRESS)
    options = [a for a in p._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    assert [a.dest for a in options if not (a.help or "").strip()] == []
    shown = p.formatter_class(prog=p.prog)._get_help_string  # the text --help prints for an option
    for a in options:
        if a.option_strings and not isinstance(a.default, bool) and a.default not in quiet and \
                not isinstance(a, argparse._StoreConstAction):
            # the help formatter (kvjax.cli.HelpFormatter) says it where the help text does not
            assert "default" in shown(a).lower(), (a.option_strings, shown(a))
