"""A report page's tables and verdicts, regenerated from the records committed beside it.

    python -m experiments.report_page docs/report-smollm2.md            # rewrite the page's generated blocks
    python -m experiments.report_page docs/report-smollm2.md --check    # exit 1 where the page differs

A generated block opens with `<!-- records: KIND PATH [KEY=VALUE ...] -->` (PATH: a run directory, relative to the
page; the options are the block's, e.g. `only=snapkv,kvzip`) and ends with `<!-- /records -->`; everything between is the function `BLOCKS[KIND]` of that directory's records, and is
overwritten. The prose around a block is the page's own. So every number a block shows comes from committed
records, and `tests/test_report_page.py` holds the committed page to its records. Reads files only: no model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from experiments import cli
from experiments.records import write_atomic
from experiments.ruler import compare
from kvjax.errors import InvalidInput, MissingFile

OPEN = re.compile(r"<!-- records: (\S+) (\S+)((?: \S+=\S+)*) -->\n(.*?)<!-- /records -->", re.S)


def ruler(run: Path, where: str, only: str | None = None, plot: str | None = None, *, figures: Path | None = None
          ) -> str:
    """A RULER run (`experiments.ruler`, or the report's RULER section) at `run` (`where` from the page): its
    configuration from identity.json, prompts found per policy and task, and SlimKV's claim by `compare.slimkv_claims`.
    `only`: the methods shown ("snapkv,kvzip": their labels at every ratio), the full cache always. `plot`: a PNG
    (relative to the page) of each method's share of prompts found against the KV bytes it held, drawn into the
    directory `figures` (the page's) when given: a check compares the text and draws nothing."""
    identity = json.loads((run / "identity.json").read_text())
    rows = compare.read(run)
    if only:
        keep = {"full", *only.split(",")}
        rows = [r for r in rows if compare.split_label(r["label"])[0] in keep]
        if not rows:
            raise InvalidInput(f"{where}: no records of {only}")
    fmt = identity.get("--chat-template", "off (records from before the option)")
    lines = [f"Records: `{where}` ({len(rows)}{', ' + only if only else ''}), chat template {fmt}, protocol "
             f"{identity['--protocol']}, batch {identity['--batch']}, seed {identity['--seed']}, "
             f"{identity['model dtype']} weights {identity['weights']}.", "", compare.table(rows), "",
             "Against the full cache: each policy's share minus the full cache's, in points, paired over the same "
             "prompts. KV held: the share of the full cache's KV bytes the compressed prompt held (blank: records "
             "from before the measurement).", ""]
    if plot:
        if figures is not None:
            compare.plot_held(rows, figures / plot)
        lines += [f"![score against KV bytes held]({plot})", ""]
    claims = compare.slimkv_claims(rows)
    if claims:
        lines += ["SlimKV's claim, by the rule of `experiments.verdicts` (holds / does not hold beyond two paired "
                  "standard errors, else inconclusive):", ""] + [f"- {c}" for c in claims] + [""]
    return "\n".join(lines)


BLOCKS: dict[str, Callable[..., str]] = {"ruler": ruler}


def regenerate(page: Path, draw: bool = False) -> str:
    """`page`'s text with every generated block rewritten from its records; `draw`: the blocks' figures too."""
    text = page.read_text()

    def block(m: re.Match) -> str:
        kind, where, extra = m.group(1), m.group(2), m.group(3)
        if kind not in BLOCKS:
            raise InvalidInput(f"{page}: block kind {kind!r} is unknown (known: {', '.join(BLOCKS)})")
        run = page.parent / where
        if not run.is_dir():
            raise MissingFile(f"{page}: block {kind} reads {run}, which is not a directory")
        options = dict(kv.split("=", 1) for kv in extra.split())
        try:
            text = BLOCKS[kind](run, where, **options, figures=page.parent if draw else None)
        except TypeError as err:
            raise InvalidInput(f"{page}: block {kind} {where}: {err}") from None
        return f"<!-- records: {kind} {where}{extra} -->\n{text}<!-- /records -->"

    return OPEN.sub(block, text)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.report_page", description=cli.description(__doc__))
    p.add_argument("page", help="the markdown page (its blocks name record directories relative to it)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page differs from its records")
    args = p.parse_args(argv)
    page = Path(args.page)
    if not page.is_file():
        raise MissingFile(f"{page}: no such page")
    new = regenerate(page, draw=not args.check)
    if args.check:
        if new != page.read_text():
            print(f"{page}: its generated blocks differ from its records (python -m experiments.report_page {page})",
                  file=sys.stderr)
            return 1
        return 0
    if new != page.read_text():
        write_atomic(page, new)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, compile_cache=None))
