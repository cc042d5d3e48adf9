"""Efficiency per cache policy vs context length (MAT's Table 6 protocol): decode tokens/s, prefill
time, cache bytes and peak device memory.

    python -m kvjax.experiments.efficiency [--model DIR] [--lengths 128,256,480] [--new 32] [--batch 1]
        [--compare full,streaming,mat] [--budget 128]

Each cell compiles first, then times the prefill once and the decode loop (`lax.while_loop`, no
early stop) as the best of `--repeats` runs on fresh copies of the cache. Peak device memory is the
allocator's high-water mark (`memory_stats()["peak_bytes_in_use"]`, GPU/TPU); CPU backends do not
report it, so there the column is empty and cache bytes are the memory figure. Prompts are random
token ids: speed does not depend on the text. Cells go to OUT/cells.jsonl as they finish (a rerun
keeps them); OUT/results.{json,md} and OUT/efficiency.png.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import engine
from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    add_compare_args,
    add_run_args,
    compared,
    int_list,
    model_help,
    positive_int,
    suite_model,
)
from kvjax.experiments.records import shown
from kvjax import Sampling
from kvjax.cache import nbytes
from kvjax.generate import bucket_length, check_finite_steps, decode_fn, eos_array, pad_left, position_limit, prefill_fn
from kvjax import drive
from kvjax.cli import HelpFormatter


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def time_policy(model, prompts: list[list[int]], policy, new: int, repeats: int = 3) -> dict:
    """Prefill seconds, decode tokens/s (per row), cache bytes and peak device bytes for one batch."""
    graphdef, state = engine.split(model)
    n = max(map(len, prompts))
    bucket = bucket_length(n)
    tokens, positions = pad_left(prompts, bucket, 0)
    key = jax.random.key(0)
    plan = drive.plan(model, policy, bucket + new, bucket)
    pre = functools.partial(prefill_fn.pure, graphdef, state, tokens, positions, key, plan=plan, sampling=Sampling())
    jax.block_until_ready(pre())  # compile
    t = time.perf_counter()
    first, first_finite, cache = jax.block_until_ready(pre())
    prefill_s = time.perf_counter() - t
    dec = functools.partial(decode_fn.pure, graphdef, state, plan=plan, sampling=Sampling(), buffer=new)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    best, steps, c = float("inf"), 0, cache
    for _ in range(repeats + 1):  # the first run compiles
        c = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
        t = time.perf_counter()
        out, steps, nonfinite, c = dec(c, first, first_finite, lengths, key, jnp.asarray(eos_array(())),
                                       jnp.int32(new), jnp.int32(0), jnp.int32(0))
        jax.block_until_ready(out)
        check_finite_steps(np.asarray(nonfinite))
        best = min(best, time.perf_counter() - t)
    return {"prefill_s": prefill_s, "decode_tok_s": (int(steps) - 1) / best, "cache_bytes": nbytes(c),
            "peak_bytes": peak_bytes()}


def write_report(out: Path, rows: list[dict], meta: dict) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, figures) of the timings; draws OUT/efficiency.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"Efficiency on {meta['device']} (jax {meta['jax']}): {meta['model']}, batch {meta['batch']}, "
             f"{meta['new']} new tokens, greedy", "",
             "| policy | context | prefill ms | decode tok/s | cache MiB | peak MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        lines.append(f"| {r['label']} | {r['length']} | {1e3 * r['prefill_s']:.1f} | {r['decode_tok_s']:.1f} | "
                     f"{r['cache_bytes'] / 2**20:.3f} | {peak} |")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for lab in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == lab]
        x = [r["length"] for r in mine]
        axes[0].plot(x, [r["decode_tok_s"] for r in mine], marker="o", label=lab)
        axes[1].plot(x, [1e3 * r["prefill_s"] for r in mine], marker="o", label=lab)
        axes[2].plot(x, [r["cache_bytes"] / 2**20 for r in mine], marker="o", label=lab)
    for ax, y in zip(axes, ["decode tokens/s", "prefill ms", "cache MiB"]):
        ax.set(xlabel="context tokens", ylabel=y, xscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "efficiency.png", dpi=110)
    plt.close(fig)
    return "\n".join(lines), {"meta": meta, "rows": rows}, [out / "efficiency.png"]


def suite(lm, policies, out, *, lengths: list[int] | None = None, new: int = 32, batch: int = 1, repeats: int = 3,
          progress: bool = True) -> driver.SuiteResult:
    """Prefill seconds, decode tokens/s and cache bytes of each policy (`{label: policy}`, a list or
    one) at each context length (default max/4, max/2, max - new), into `out`; summary
    `{"meta": ..., "rows": [one per policy x length]}`."""
    cfg = lm.model.cfg  # the contract's: any model
    if new < 2:
        raise driver.ArgumentError(f"new={new} must be >= 2 (one prefill token, then decoded ones)")
    n = cfg.max_position_embeddings
    lengths = list(lengths or [n // 4, n // 2, n - new])
    policies = driver.labelled(policies)
    for lab, pol in policies.items():
        limit = position_limit(drive.plan(lm.model, pol), cfg, new)
        too_long = [L for L in lengths if limit is not None and L > limit]
        if too_long:
            raise driver.ArgumentError(
                f"lengths={too_long} + new={new} exceed max_position_embeddings={n} under {lab} (rolling positions "
                "with prefill_mode=stream or chunked lift the limit)")
    dtype, impl = lm.load_options.get("dtype", "float32"), lm.load_options.get("attention_impl", "xla")
    rid = lambda cell: f"{lm.path}|{dtype}|{impl}|{policies[cell[1]].describe()}|{cell[0]}|{batch}|{new}"  # noqa: E731
    prompts = lambda L: np.random.default_rng(L).integers(4, cfg.vocab_size, (batch, L)).tolist()  # noqa: E731

    def run(cell: list) -> list[dict]:
        (L, lab), = cell
        pol = policies[lab]
        return [{"id": rid((L, lab)), "policy": pol.describe(), "length": L,
                 **time_policy(lm.model, prompts(L), pol, new, repeats)}]

    def report(log):
        rows = [log.records[rid(cell)] | {"label": cell[1]} for cell in cells]
        meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "model": shown(lm.path), "batch": batch,
                "new": new, "dtype": dtype}
        return write_report(Path(out), rows, meta)

    cells = [(L, lab) for L in lengths for lab in policies]  # a rerun keeps the cells already timed
    return driver.run_suite(driver.Suite("efficiency", "cells.jsonl", cells, rid, run, report), out, lm,
                            {"new": new, "batch": batch, "repeats": repeats}, policies, progress=progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.efficiency", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--lengths", type=int_list,
                   help="comma-separated context lengths (default: max/4, max/2, max - new)")
    p.add_argument("--new", type=positive_int, default=32, help="decoded tokens per timing (>= 2)")
    p.add_argument("--batch", type=positive_int, default=1, help="prompts decoded together (rows of random token ids)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed decode loops per cell after a compiling one; the fastest is kept")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and the cache's dtype")
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="pallas: the kernels of kvjax.pallas (interpret mode on CPU: slow, for checking)")
    p.add_argument("--out", default="results/efficiency",
                   help="where the results go (a folder; a rerun with the same options resumes there)")
    add_compare_args(p, default="full,streaming,mat")
    add_run_args(p)
    args = p.parse_args(argv)
    lm = suite_model(args, dtype=args.dtype, attention_impl=args.attention_impl)
    res = driver.call(p, suite, lm, compared(p, args, lm.config.num_layers, lm.path), args.out, lengths=args.lengths, new=args.new,
                      batch=args.batch, repeats=args.repeats)
    print(res.table)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
