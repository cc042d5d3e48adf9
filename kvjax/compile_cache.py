"""A persistent compilation cache for every command line (`kvjax.cli.run`), so that a run killed and started
again compiles nothing it compiled before.

XLA programs are kept on disk under `$KVJAX_HOME/compile-cache` (default `~/.cache/kvjax/compile-cache`; an already
set `JAX_COMPILATION_CACHE_DIR` is used instead), every program however fast it compiled. jax keys an entry by
the program, the compile options, the device and jax's version, so a hit is the executable the same compile
would have made: results do not depend on the cache, and `--no-compile-cache` (every entry point takes it) is
not part of any run's identity. The directory may be deleted at any time.

    from kvjax import compile_cache
    compile_cache.enable()       # what `kvjax.cli.run` does before it calls a command's `main`

The location is printed on stderr once per `KVJAX_HOME`, by the run whose first compile creates the directory (an
error before that is still one line). Benchmarks that report compile seconds never use the cache: theirs are first compiles.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

FLAG = "--no-compile-cache"
HELP = ("do not keep compiled programs on disk for later runs ($KVJAX_HOME/compile-cache, default "
        "~/.cache/kvjax/compile-cache, or JAX_COMPILATION_CACHE_DIR when set); results are the same either way")

_announced = False


def home() -> Path:
    """kvjax's home: `$KVJAX_HOME`, else ~/.cache/kvjax (the rule of `kvjax.models.fetch.home`)."""
    return Path(os.environ.get("KVJAX_HOME") or Path.home() / ".cache" / "kvjax").expanduser()


def default_dir() -> Path:
    return home() / "compile-cache"


def requested_off(argv: Sequence[str]) -> bool:
    """Whether `argv` turns the cache off: `--no-compile-cache`, or an abbreviation argparse would accept."""
    for arg in argv:
        if arg == "--":
            return False
        if arg.startswith("--no-compi") and FLAG.startswith(arg):
            return True
    return False


class _ReadByRun(argparse.Action):
    """The flag is read from the command line by `kvjax.cli.run` before `main` runs (the cache must be set before
    anything compiles); parsing stores nothing, so no run's identity can hold it."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        pass


def add_flag(parser, help: str = HELP) -> None:
    """`--no-compile-cache` on `parser` (or an argument group), documented in --help."""
    parser.add_argument(FLAG, action=_ReadByRun, help=help)


def enable(announce: bool = True) -> Path | None:
    """Turns the persistent compilation cache on (returns its directory), or None where kvjax's home cannot hold it
    (said in one line; the run goes on without it). A directory set before (`JAX_COMPILATION_CACHE_DIR`, or
    `jax.config`) is kept and not announced; kvjax's own is announced on stderr at the first compile."""
    import jax

    chosen = jax.config.jax_compilation_cache_dir
    path = Path(chosen) if chosen else default_dir()
    if not chosen:
        if not _can_create(path):  # jax would warn at every compile; one line instead, and the run goes on
            print(f"note: no persistent compilation cache: {path} cannot be written (set KVJAX_HOME to a writable "
                  "directory)", file=sys.stderr)
            return None
        jax.config.update("jax_compilation_cache_dir", str(path))  # jax creates it at the first compile
    jax.config.update("jax_enable_compilation_cache", True)
    # jax keeps only programs that compiled for a second or more by default: keep them all, so that a resumed run
    # compiles nothing (a user's own settings win)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor (0 lets jax pick one)
    if announce and not chosen and not path.exists():  # once per KVJAX_HOME: the run that makes the directory
        _announce_at_first_compile(path)
    return path


def _can_create(path: Path) -> bool:
    """Whether `path` is a directory kvjax may write in, or could be made one."""
    while not path.exists():
        if path.parent == path:
            return False
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def disable() -> None:
    """No persistent compilation cache in this process, even where `JAX_COMPILATION_CACHE_DIR` is set."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


def _announce_at_first_compile(path: Path) -> None:
    import jax

    def listener(event: str, **kwargs) -> None:
        global _announced
        if event == "/jax/compilation_cache/compile_requests_use_cache" and not _announced:
            _announced = True
            from tqdm import tqdm  # a line of its own beside a progress bar

            tqdm.write(f"compile cache: {path} (programs compiled once are reused by later runs; {FLAG} turns it "
                       "off)", file=sys.stderr)

    jax.monitoring.register_event_listener(listener)


__all__ = ["FLAG", "HELP", "add_flag", "default_dir", "disable", "enable", "home", "requested_off"]
