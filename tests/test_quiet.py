"""Issue 90 item 8: quiet by default. A warning at the command line is one line; the compile cache is announced
once per KVJAX_HOME; a progress bar's ETA excludes the first unit (its compile) and a nested bar is not drawn off
a terminal."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

from kvjax import cli, progress

REPO = Path(__file__).resolve().parents[1]


def test_a_warning_at_the_command_line_is_one_line(capsys):
    def main(argv):
        warnings.warn("PyramidKV(budget=256) is SnapKV in every layer", UserWarning)
        return 0

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.run(main, [], compile_cache=None) == 0
    err = capsys.readouterr().err
    assert err == "warning: PyramidKV(budget=256) is SnapKV in every layer\n", err


def test_the_compile_cache_is_announced_once_per_home(tmp_path):
    """The note used to be printed by every run (the README said once): only the run that creates the cache does."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR",)}
    env |= {"KVJAX_HOME": str(tmp_path / "home"), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "kvjax.experiments.generate", "--max-new-tokens", "2", "--compare", "full", "hi"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path)
    second = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stderr.count("compile cache: ") == 1 and "compile cache: " not in second.stderr


def fake_clock(bar: progress.Bar) -> list[float]:
    now = [0.0]
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = 0.0
    return now


def test_progress_eta_excludes_the_first_unit():
    """A first unit of 100 s (its compile) then 1 s a unit: tqdm's own ETA after the second unit was 05:34 (hand
    computed from its smoothed rate); the bar's is the steady 1 unit/s, 8 left: 00:08, and the elapsed time still
    counts the first unit."""
    bar = progress.Bar(total=10, file=io.StringIO(), mininterval=0, miniters=1, desc="x")
    now = fake_clock(bar)
    now[0] = 100.0
    bar.update(1)
    assert "<?" in bar.format_meter(**bar.format_dict)  # no rate yet: the first unit was the compile
    now[0] = 101.0
    bar.update(1)
    assert bar.format_meter(**bar.format_dict).endswith("2/10 [01:41<00:08,  1.00it/s]")
    bar.close()


def test_progress_a_nested_bar_is_not_drawn_off_a_terminal():
    out = io.StringIO()  # not a terminal
    inner = progress.bar(total=3, desc="inner", nested=True, file=out)
    inner.update(3)
    inner.close()
    assert out.getvalue() == "" and "\x1b[A" not in out.getvalue()
    outer = progress.bar(total=3, desc="outer", file=out)
    outer.update(3)
    outer.close()
    assert "outer" in out.getvalue()
