"""How every entry point (`python -m experiments.<name>`, `models.fetch`, `benchmarks.*`) ends: a user error as one line, a bug with its traceback.

    if __name__ == "__main__":
        sys.exit(cli.run(main))

A `kvjax.errors.UserError` (a missing or corrupt file, a bad value, a non-finite result) prints
`error: <message>` on stderr and exits with status 2, as argparse does for a bad option. Every
other exception is a bug in kvjax and keeps its traceback. `--debug` (or `KVJAX_DEBUG=1`) shows the
traceback of user errors too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence

from kvjax.errors import UserError


def description(doc: str | None) -> str:
    """A module docstring's first paragraph as one line: an entry point's `--help` description (its first line
    alone stopped mid-sentence). A paragraph that introduces a list (`...:`) ends as a sentence."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return text[:-1] + "." if text.endswith(":") else text


def model_help(default: str | None = None) -> str:
    """--model's help, the same in every suite, trainer and benchmark: every form `models.load` reads, and the
    default."""
    return ("a local Hugging Face directory, a .gguf file, or a fetched model's name (smollm2, after python -m "
            "models.fetch smollm2)" + (f"; default: {default}" if default else ""))


def debugging(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("KVJAX_DEBUG", "") not in ("", "0")


class LengthHandled(logging.Filter):
    """Drops transformers' warning that a text tokenized past the tokenizer's `model_max_length` "will result in
    indexing errors": never true of kvjax's entry points, which refuse such a prompt themselves
    (`kvjax.errors.PromptTooLong`, naming the model's positions), truncate it (--truncate: the warning then
    contradicts what happens), or score a long text in windows (perplexity)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will result in indexing errors" not in record.getMessage()


_LENGTH_HANDLED = LengthHandled()


def run(main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_LENGTH_HANDLED)  # once: a set of filters
    try:
        return main(argv)
    except UserError as err:
        if debugging(argv):
            raise
        print(f"error: {err.cli_message()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debugging(argv):
            raise
        # every finished record was appended and fsynced as it finished (experiments.records.ResultLog)
        print("interrupted: the records finished so far are kept; run the same command again to resume",
              file=sys.stderr)
        return 130
    except RecursionError:
        if debugging(argv):
            raise
        print("error: an input nests too deeply to be read (a JSON file nested thousands of levels?)", file=sys.stderr)
        return 2
    except OSError as err:
        if debugging(argv) or err.errno not in _USER_ERRNOS:
            raise
        # a full disk or a read-only place: the environment's to fix, not kvjax's (records written so far are whole)
        print(f"error: {err.strerror}: {err.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


_USER_ERRNOS = {__import__("errno").ENOSPC, __import__("errno").EROFS, __import__("errno").EACCES,
                __import__("errno").EDQUOT}
