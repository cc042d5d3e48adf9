"""A persistent compilation cache for every command line (issue #64, item 3): a second run of a command compiles
nothing the first compiled, `--no-compile-cache` neither reads nor writes the cache, and the flag is in every
command's --help and in no run's identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.experiments import cli, passkey
from kvjax import compile_cache

REPO = Path(__file__).resolve().parents[1]

# runs `python -m MODULE ARGS...` (its __main__ block, so `kvjax.cli.run`) and writes jax's compile events to
# $EVENTS_OUT when it exits
_COUNTING = """
import atexit, collections, json, os, runpy, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda e, **k: events.update([e]))
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **k: events.update([e]))
atexit.register(lambda: open(os.environ["EVENTS_OUT"], "w").write(json.dumps(events)))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _run(home: Path, out: Path, events: Path, *extra: str) -> tuple[str, dict]:
    """One passkey run on the embedded default model in a fresh process: (stderr, compile counts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(KVJAX_HOME=str(home), EVENTS_OUT=str(events), JAX_PLATFORMS="cpu")
    argv = ["kvjax.experiments.passkey", "--lengths", "300", "--depths", "0.5", "--samples", "1", "--policy", "full",
            "--out", str(out), *extra]
    r = subprocess.run([sys.executable, "-c", _COUNTING, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = json.loads(events.read_text())
    compiles = counts.get("/jax/core/compile/backend_compile_duration", 0)  # every program asked for, hit or not
    hits = counts.get("/jax/compilation_cache/cache_hits", 0)
    return r.stderr, {"programs": compiles, "compiled": compiles - hits, "hits": hits}


def _entries(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()} if d.is_dir() else {}


def test_a_second_run_compiles_nothing_the_first_compiled(tmp_path):
    home = tmp_path / "home"
    cache = home / "compile-cache"
    err, first = _run(home, tmp_path / "a", tmp_path / "a.json")
    assert first["programs"] > 0 and first["compiled"] == first["programs"]
    written = _entries(cache)
    assert len(written) >= first["programs"]  # every program kept, however fast it compiled
    assert err.count(f"compile cache: {cache} ") == 1  # its location, printed once

    # the same work again in a new process (a fresh --out: the records would otherwise skip it) compiles nothing
    err, second = _run(home, tmp_path / "b", tmp_path / "b.json")
    assert second["programs"] == first["programs"] and second["compiled"] == 0 and second["hits"] == first["programs"]
    assert _entries(cache) == written


@pytest.mark.slow
def test_no_compile_cache_neither_reads_nor_writes_the_cache(tmp_path):
    home = tmp_path / "home"
    cache = home / "compile-cache"
    _, first = _run(home, tmp_path / "a", tmp_path / "a.json")
    written = _entries(cache)
    err, off = _run(home, tmp_path / "b", tmp_path / "b.json", "--no-compile-cache")
    assert off["hits"] == 0 and off["compiled"] == first["programs"]  # everything compiled again
    assert _entries(cache) == written and "compile cache" not in err
    _run(tmp_path / "other", tmp_path / "c", tmp_path / "c.json", "--no-compile-cache")
    assert not (tmp_path / "other").exists()


def test_the_flag_turns_the_cache_off_before_main_runs(monkeypatch):
    """What `kvjax.cli.run` does with the flag, in this process (the slow test above runs real commands)."""
    import jax

    seen = []
    main = lambda argv: seen.append((jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir))  # noqa: E731
    monkeypatch.setattr(compile_cache, "_announce_at_first_compile", lambda path: None)
    before = jax.config.jax_enable_compilation_cache
    try:
        cli.run(main, ["--out", "x", "--no-compile-cache"])
        cli.run(main, ["--out", "x"])
        cli.run(main, ["--out", "x"], compile_cache=False)  # a benchmark that reports compile seconds
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
    assert [on for on, _ in seen] == [False, True, False]
    assert seen[1][1]  # a directory: the test suite's own (conftest), kept as a user's JAX_COMPILATION_CACHE_DIR is


def test_an_unwritable_home_is_one_note_and_the_run_goes_on(tmp_path):
    home = tmp_path / "home"
    home.write_text("a file, not a directory")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(KVJAX_HOME=str(home), JAX_PLATFORMS="cpu")
    code = "import jax; from kvjax import compile_cache; print(compile_cache.enable(), jax.config.jax_compilation_cache_dir)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["None", "None"], r.stderr
    assert r.stderr.splitlines() == [(f"note: no persistent compilation cache: {home / 'compile-cache'} cannot be "
                                      "written (set KVJAX_HOME to a writable directory)")]


def test_the_flag_and_its_abbreviations_are_read_before_parsing():
    assert compile_cache.requested_off(["--out", "x", "--no-compile-cache"])
    assert compile_cache.requested_off(["--no-compile"])  # argparse takes an unambiguous prefix
    assert not compile_cache.requested_off(["--no-compensation", "--no-torch"])
    assert not compile_cache.requested_off(["prompt", "--", "--no-compile-cache"])  # a positional after --


def test_the_flag_is_in_no_runs_identity(tiny_dir, tmp_path, capsys):
    """Parsing stores nothing for the flag, so no identity built from the parsed options (a suite's, a trainer's)
    can hold it; and a run with --no-compile-cache resumes one without it: the cache does not change results."""
    import argparse

    from kvjax.experiments.common import add_run_args
    from kvjax.experiments.records import options_of, training_identity

    p = argparse.ArgumentParser()
    add_run_args(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(["--no-compile-cache", "--seed", "3"])
    assert not [k for k in vars(args) if "compile" in k]
    assert options_of(args) == options_of(p.parse_args(["--seed", "3"])) and "--seed" in options_of(args)
    assert training_identity(args) == training_identity(p.parse_args(["--seed", "3"]))

    out = tmp_path / "pk"
    argv = ["--model", str(tiny_dir), "--lengths", "300", "--depths", "0.5", "--samples", "1", "--out", str(out)]
    assert passkey.main(argv) == 0
    ident = (out / "identity.json").read_text()
    records = (out / "samples.jsonl").read_text()
    assert passkey.main(argv + ["--no-compile-cache", "--compare", "full,streaming"]) == 0
    assert "compile" not in ident and (out / "identity.json").read_text() == ident
    assert (out / "samples.jsonl").read_text().startswith(records)


ENTRY_POINTS = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                      for d in ("benchmarks", "kvjax/experiments", "kvjax/models") for p in (REPO / d).rglob("*.py")
                      if "cli.run(main" in p.read_text())


def test_the_entry_points_are_found():
    assert {"kvjax.experiments.report", "kvjax.experiments.ruler.__main__", "benchmarks.e2e", "kvjax.models.fetch"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_command_that_compiles_documents_the_flag(module, capsys):
    import importlib

    source = (REPO / (module.replace(".", "/") + ".py")).read_text()
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    if "compile_cache=None" in source:  # a command that compiles nothing (a download, data files)
        assert "--no-compile-cache" not in text
    else:
        assert "--no-compile-cache" in text, module
