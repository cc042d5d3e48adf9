"""Peak resident memory of a passkey run, each cell in its own process: what a suite needs on this machine.

    python -m benchmarks.memory --model smollm2 --out docs/report-smollm2/runs/memory

Each cell `TOKENSxPROMPTS` runs `python -m kvjax.experiments.passkey --policy full --lengths TOKENS --samples PROMPTS
--batch PROMPTS --depths 0.5` (the full cache: the most a policy holds) as a child process, and records the
child's peak resident set size (its VmHWM: the kernel's own peak, nothing sampled). OUT/rss.json
is rewritten atomically after every cell, with the model's cache shape, so `kvjax.experiments.report_page`'s `memory`
block can say how much of the growth per token is the cache. Memory, not time: another job on the cores does
not change it, so there is no load guard. The children use the persistent compilation cache as any passkey run
does, so a cell whose programs are cached does not count the compiler's own memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from kvjax.experiments.records import write_atomic
from kvjax.cli import description, model_help, out_dir, HelpFormatter
from kvjax.errors import InvalidInput


def cells(text: str) -> list[tuple[int, int]]:
    """[(2048, 1), (2048, 8)] of "2048x1,2048x8"."""
    try:
        out = [tuple(int(v) for v in cell.split("x")) for cell in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(c) != 2 or min(c) < 1 for c in out):
        raise InvalidInput(f"--cells {text}: not TOKENSxPROMPTS,... with positive numbers")
    return out


# The child reports its own high-water mark: its parent's `ru_maxrss` would count the forked image before
# `exec` (Linux carries the old address space's peak into the process's maximum), so a small child forked from
# a large parent would report the parent's size. VmHWM belongs to the address space `exec` made.
_REPORTER = """
import runpy, sys
report, sys.argv = sys.argv[1], sys.argv[2:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    with open("/proc/self/status") as f:
        peak = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(report, "w") as f:
        f.write(peak)
"""


def peak_rss(module: str, args: list[str], env: dict | None = None) -> int:
    """The peak resident bytes of `python -m module *args` run to its end (VmHWM, in KiB); a failed run is an
    internal error with its output."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "peak"
        child = subprocess.run([sys.executable, "-c", _REPORTER, str(report), module, *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if child.returncode != 0:
            raise RuntimeError(f"python -m {module} {' '.join(args)} exited {child.returncode}:\n{child.stdout[-4000:]}")
        return int(report.read_text()) * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help=model_help())
    p.add_argument("--cells", default="2048x1,2048x8,8000x1", help="TOKENSxPROMPTS, comma-separated")
    p.add_argument("--out", type=out_dir, required=True, help="folder for the tables and plots")
    args = p.parse_args(argv)
    todo = cells(args.cells)
    from kvjax.models import load
    from kvjax.models.loading import resolve

    lm = load(resolve(args.model), tokenizer=False)  # the cache's shape and dtype, for the block's per-token bytes
    config, dtype = lm.config, str(getattr(lm.model, "dtype", ""))
    del lm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tokens, prompts in tqdm(todo, desc="peak RSS"):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = ["--model", args.model, "--policy", "full", "--lengths", str(tokens), "--samples", str(prompts),
                   "--batch", str(prompts), "--depths", "0.5"]
            rss = peak_rss("kvjax.experiments.passkey", [*cmd, "--out", tmp])
        rows.append({"command": "python -m kvjax.experiments.passkey " + " ".join(cmd), "prompt_tokens": tokens,
                     "prompts": prompts, "peak_rss_bytes": rss})
        record = {"dtype": dtype, "layers": config.num_layers, "kv_heads": config.num_kv_heads,
                  "head_dim": config.head_dim, "machine": platform.platform(), "python": platform.python_version(),
                  "cells": rows}
        write_atomic(out / "rss.json", json.dumps(record, indent=1) + "\n")
    for r in rows:
        print(f"{r['prompt_tokens']} tokens x {r['prompts']}: {r['peak_rss_bytes'] / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    from kvjax import cli

    raise SystemExit(cli.run(main, compile_cache=None))  # it compiles nothing; each child keeps its own flag
