"""How every entry point (`python -m kvjax.experiments.<name>`, `kvjax.models.fetch`, `benchmarks.*`) ends: a user error as one line, a bug with its traceback.

    if __name__ == "__main__":
        sys.exit(cli.run(main))

A `kvjax.errors.UserError` (a missing or corrupt file, a bad value, a non-finite result) prints
`error: <message>` on stderr and exits with status 2, as argparse does for a bad option. Every
other exception is a bug in kvjax and keeps its traceback. `--debug` (or `KVJAX_DEBUG=1`) shows the
traceback of user errors too.

Before `main` runs, the persistent compilation cache is turned on (`kvjax.compile_cache`: programs kept under
`$KVJAX_HOME/compile-cache`, so a resumed run compiles nothing it compiled before), unless the command line
says `--no-compile-cache` (each parser documents it: `add_compile_cache_flag`). A command that reports compile
seconds runs with `compile_cache=False` (never the cache, even one set by `JAX_COMPILATION_CACHE_DIR`); one that
compiles nothing with `compile_cache=None` (jax is left alone).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from kvjax import compile_cache as _compile_cache
from kvjax.errors import UserError


class HelpFormatter(argparse.HelpFormatter):
    """Every entry point's help: each option's default said after its help, unless the help already says it (or the
    option has none: a flag, an option that is unset by default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = (None, False, argparse.SUPPRESS)
        if (action.option_strings and "default" not in text.lower() and "%(default)" not in text
                and not isinstance(action.default, bool) and action.default not in quiet
                and not isinstance(action, (argparse._StoreConstAction, argparse._HelpAction))):
            shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
            text += f" (default: {shown})"
        return text


def out_dir(text: str) -> Path:
    """An --out folder (an argparse type): a path that is not an existing file, which a run could not write into."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder; pass a folder for the results")
    return path


def description(doc: str | None) -> str:
    """A module docstring's first paragraph as one line: an entry point's `--help` description (its first line
    alone stopped mid-sentence). A paragraph that introduces a list (`...:`) ends as a sentence."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return text[:-1] + "." if text.endswith(":") else text


def model_help(default: str | None = None) -> str:
    """--model's help, the same in every suite, trainer and benchmark: every form `kvjax.models.load` reads, and the
    default."""
    return ("a local Hugging Face directory, a .gguf file, or a fetched model's name (smollm2, after python -m "
            "kvjax.models.fetch smollm2)" + (f"; default: {default}" if default else ""))


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


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning at the command line: `warning: <message>` on one line, beside any progress bar. Python's own format
    adds the file, line number and source line of the code that warned, which a user cannot act on (`--debug`
    keeps it)."""
    from tqdm import tqdm

    tqdm.write(f"warning: {message}", file=file or sys.stderr)


def add_compile_cache_flag(parser, *, measures_compile: bool = False) -> None:
    """`--no-compile-cache` on a parser (or argument group) whose command goes through `run`; `measures_compile`:
    the command runs with `compile_cache=False` (it reports first compiles) and takes the flag so that every
    command does."""
    _compile_cache.add_flag(parser, help="accepted by every command; this one reports compile seconds, so it never "
                            "uses the persistent compilation cache" if measures_compile else _compile_cache.HELP)


def run(main: Callable[[list[str]], int], argv: Sequence[str] | None = None, *,
        compile_cache: bool | None = True) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if compile_cache is not None:
        if compile_cache and not _compile_cache.requested_off(argv):
            _compile_cache.enable()
        else:
            _compile_cache.disable()
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_LENGTH_HANDLED)  # once: a set of filters
    if not debugging(argv):
        warnings.showwarning = _one_line_warning
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
        # every finished record was appended and fsynced as it finished (kvjax.experiments.records.ResultLog)
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
