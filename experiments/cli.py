"""How every `python -m experiments.<name>` ends: a user error as one line, a bug with its traceback.

    if __name__ == "__main__":
        sys.exit(cli.run(main))

A `kvjax.errors.UserError` (a missing or corrupt file, a bad value, a non-finite result) prints
`error: <message>` on stderr and exits with status 2, as argparse does for a bad option. Every
other exception is a bug in kvjax and keeps its traceback. `--debug` (or `KVJAX_DEBUG=1`) shows the
traceback of user errors too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from kvjax.errors import UserError


def debugging(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("KVJAX_DEBUG", "") not in ("", "0")


def run(main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return main(argv)
    except UserError as err:
        if debugging(argv):
            raise
        print(f"error: {err.cli_message()}", file=sys.stderr)
        return 2
