"""The GPU decode kernel's launch parameters, swept: slots per tile, slot splits, Triton warps and stages.

    python -m benchmarks.decode_tuning [--lengths 32768] [--batches 1,8] [--out benchmarks/results]

At each cache length and batch (32 query / 8 KV heads, d = 128, bf16, as `benchmarks.attention`),
first (block, splits) over a grid at the kernel's default warps / stages, then (warps, stages) at the
best (block, splits). Bandwidth is the K and V bytes over the time per call (chained inside one jit,
`benchmarks.attention.best_time`), beside the device's datasheet peak and an elementwise f32 pass
(`x + 1` over 2 GiB, bytes read and written) measured in the same run. That pass is not a ceiling: on an
H200 it measured 3.6 TB/s while the kernel read 3.9 TB/s at batch 8. Writes decode_tuning_<platform>.{json,md}; the
kernel's defaults (`kvjax.pallas.decode.GPU_*`, `kvjax.pallas.blocks.DECODE`) are chosen from it.
A GPU only: on a CPU the kernel runs in the interpreter and its timings mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.attention import best_time, peak_bandwidth
from kvjax import pallas as kernels
from kvjax.pallas import decode as pallas_decode
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s (read + written) of an elementwise f32 pass `x + 1` over `nbytes`: a reference point, not a ceiling."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    jax.block_until_ready(f(x))
    import time

    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def inputs(batch, c, h=32, kvh=8, d=128, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, h, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(batch, kvh, c, d)), dtype) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (batch, kvh, c))
    return q, k, v, pos, jnp.zeros((batch, kvh, c), jnp.float32), 2 * k.size * k.dtype.itemsize


def time_config(q, k, v, pos, log_w, nbytes, **kw) -> dict:
    fn = jax.jit(lambda *a: kernels.decode_attention(*a, scale=q.shape[-1] ** -0.5, **kw)[0])
    try:
        us = 1e6 * best_time(fn, q, k, v, pos, log_w)
    except Exception as e:  # a configuration Triton cannot compile (e.g. too much shared memory) is a row, not a stop
        return {**kw, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    return {**kw, "us": us, "GBps": nbytes / us / 1e3}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_tuning", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--lengths", default="32768", help="cache lengths C in slots, comma-separated")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--blocks", default="64,128,256", help="slots per tile to sweep, comma-separated")
    p.add_argument("--splits", default="8,16,32,64,128",
                   help="slot splits to sweep, comma-separated (one over C / block is skipped)")
    p.add_argument("--warps", default="2,4,8",
                   help="Triton warps to sweep at the best block and splits, comma-separated")
    p.add_argument("--stages", default="1,2,3,4",
                   help="Triton pipeline stages to sweep at the best block and splits, comma-separated")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    add_compile_cache_flag(p)
    args = p.parse_args(argv)
    variant, interpret = kernels.platform_variant()
    if variant != "gpu" or interpret:
        p.error(f"a GPU is needed (this backend: {jax.default_backend()})")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    peak = peak_bandwidth()
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "peak_GBps": peak and peak / 1e9,
            "copy_GBps": copy_bandwidth() / 1e9,
            "defaults": {"block": kernels.blocks.DECODE["gpu"].block_k, "warps": pallas_decode.GPU_WARPS,
                         "stages": pallas_decode.GPU_STAGES, "programs": pallas_decode.GPU_PROGRAMS}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c, b in itertools.product(ints(args.lengths), ints(args.batches)):
        q, k, v, pos, lw, nbytes = inputs(b, c)
        base = {"C": c, "batch": b}
        rows.append({**base, "phase": "default", **time_config(q, k, v, pos, lw, nbytes)})
        grid = [dict(block=bk, splits=n) for bk in ints(args.blocks) for n in ints(args.splits) if c // bk >= n]
        first = [{**base, "phase": "block x splits", **time_config(q, k, v, pos, lw, nbytes, **kw)}
                 for kw in tqdm(grid, desc=f"C={c} batch {b}: block x splits")]
        rows += first
        best = max((r for r in first if "us" in r), key=lambda r: r["GBps"], default=None)
        if best is not None:
            pipe = [dict(block=best["block"], splits=best["splits"], warps=w, stages=s)
                    for w in ints(args.warps) for s in ints(args.stages)]
            rows += [{**base, "phase": "warps x stages", **time_config(q, k, v, pos, lw, nbytes, **kw)}
                     for kw in tqdm(pipe, desc=f"C={c} batch {b}: warps x stages")]
        del q, k, v
        write(out, info, rows)
    print(write(out, info, rows))


def write(out: Path, info: dict, rows: list, platform: str | None = None) -> str:
    platform = platform or jax.default_backend()
    (out / f"decode_tuning_{platform}.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    peak, copy = info["peak_GBps"], info["copy_GBps"]
    lines = [f"# Pallas decode kernel, launch parameters swept on {info['device']} (jax {info['jax']})", "",
             f"32 / 8 heads, d = 128, bf16. Datasheet peak {peak or float('nan'):.0f} GB/s; an elementwise f32 pass "
             f"(x + 1 over 2 GiB, read + written) measured {copy:.0f} GB/s in this run (not a ceiling). Kernel defaults: {info['defaults']}.", "",
             "Best per (C, batch):", "", "| C | batch | block | splits | warps | stages | µs | GB/s | % of peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    cells = sorted({(r["C"], r["batch"]) for r in rows})
    for c, b in cells:
        ok = [r for r in rows if (r["C"], r["batch"]) == (c, b) and "us" in r]
        if not ok:
            continue
        r = max(ok, key=lambda r: r["GBps"])
        pct = f"{100 * r['GBps'] / peak:.0f}%" if peak else "n/a"
        lines.append(f"| {c} | {b} | {r.get('block', 'default')} | {r.get('splits', 'auto')} | {r.get('warps', 'default')} | "
                     f"{r.get('stages', 'default')} | {r['us']:.1f} | {r['GBps']:.0f} | {pct} |")
    lines += ["", "Every configuration:", "", "| C | batch | phase | block | splits | warps | stages | µs | GB/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"{r['us']:.1f} | {r['GBps']:.0f}" if "us" in r else f"{r['error']} | -"
        lines.append(f"| {r['C']} | {r['batch']} | {r['phase']} | {r.get('block', 'default')} | {r.get('splits', 'auto')} | "
                     f"{r.get('warps', 'default')} | {r.get('stages', 'default')} | {t} |")
    text = "\n".join(lines) + "\n"
    (out / f"decode_tuning_{platform}.md").write_text(text)
    return text


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main))
