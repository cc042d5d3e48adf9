"""Decode speed and cache bytes of the quantized cache (`kvjax.quant`): 16-bit vs int8 vs KIVI 4 / 2-bit.

    python -m benchmarks.quant [--lengths 4096,16384,65536] [--steps 32] [--shape smollm2|llama-3.1-8b]
                               [--batch 1] [--kernel] [--no-variants] [--out benchmarks/results]

One attention layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head size 64, bfloat16; or Llama-3.1-8B's,
32 / 8 heads of 128), batch 1 (or `--batch`),
its cache filled with `L` random tokens, then `--steps` tokens decoded through `kvjax.layer.decode` under
`FullCache` stored at each width: as kvjax decodes it (from the codes, `DECODE_BLOCK` slots at a time, its loops
unrolled by `quant.DECODE_UNROLL`), and, in the same run, with those loops rolled (one block per iteration, the
setting before `DECODE_UNROLL`) and through the view path every other rule takes (the layer's cache dequantized,
attended and requantized on every call). `--kernel` (a GPU) adds the Pallas kernels: the codes kernel
(`kvjax.pallas.quant_decode`) at each width against the 16-bit decode kernel, with the bytes per second they read.
Writes quant_<platform>[_<shape>][_b<batch>].json / .md / .png; numbers are for reading, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks import timing
from kvjax import cache as kvcache
from kvjax import layer, quant
from kvjax.policies import FullCache, Quantized, resolve
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter

SHAPES = {"smollm2": dict(num_heads=9, num_kv_heads=3, head_dim=64),  # SmolLM2-135M's attention
          "llama-3.1-8b": dict(num_heads=32, num_kv_heads=8, head_dim=128)}
SHAPE = SHAPES["smollm2"]
WIDTHS = {16: None, 8: dict(bits=8), 4: dict(bits=4, group=32, residual=128), 2: dict(bits=2, group=32, residual=128)}


def filled(plan, length: int, dtype, shape=SHAPE, batch: int = 1):
    """A cache of `plan`'s size holding `length` random tokens at positions 0..length-1 in each of `batch` rows,
    stored as the plan says."""
    h, d = shape["num_kv_heads"], shape["head_dim"]
    c = plan.sizes[0]
    rng = np.random.RandomState(length)
    pos = np.where(np.arange(c) < length, np.arange(c), -1).astype(np.int32)
    b = batch
    lc = kvcache.LayerCache(k=jnp.asarray(rng.randn(b, h, c, d), dtype), v=jnp.asarray(rng.randn(b, h, c, d), dtype),
                            pos=jnp.broadcast_to(jnp.asarray(pos), (b, h, c)),
                            log_w=jnp.zeros((b, h, c)))
    return layer.stored(plan, lc, jnp.full((b,), length - 1))


def _as_view(geom, plan, c, q, k, v, pos):
    """`layer.decode` as the rules that read keys in their step run it: through the dequantized view."""
    saved = layer._reads_codes
    layer._reads_codes = lambda geom, plan: False
    try:
        return layer.decode(geom, plan, c, q, k, v, pos)
    finally:
        layer._reads_codes = saved


def time_width(bits: int, length: int, steps: int, repeats: int, dtype, view: bool = False,
               unroll: int | None = None, impl: str = "xla", shape=SHAPE, batch: int = 1) -> dict:
    """Decode tokens/s (the median of `repeats` runs after a compiling one, with their range: `tok_s_min`,
    `tok_s_max`) and bytes at one width; `unroll` overrides `quant.DECODE_UNROLL` (1: the rolled loop);
    `impl="pallas"`: the codes read by `kvjax.pallas.quant_decode` (a GPU)."""
    saved = quant.DECODE_UNROLL
    quant.DECODE_UNROLL = unroll or saved  # read when `attend` is traced
    try:
        return _time_width(bits, length, steps, repeats, dtype, view, impl, shape, batch)
    finally:
        quant.DECODE_UNROLL = saved


def _time_width(bits: int, length: int, steps: int, repeats: int, dtype, view: bool, impl: str, shape,
                batch: int) -> dict:
    spec = WIDTHS[bits]
    policy = FullCache() if spec is None else Quantized(FullCache(), **spec)
    plan = resolve(policy, 1, shape["num_kv_heads"]).sized(length + steps).layers[0]
    geom = layer.Geometry(layer=0, **shape, scale=shape["head_dim"] ** -0.5, impl=impl)
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(steps, batch, shape["num_heads"], shape["head_dim"]), dtype)
    kv = jnp.asarray(rng.randn(2, steps, batch, shape["num_kv_heads"], shape["head_dim"]), dtype)

    @jax.jit
    def run(cache):
        def step(c, x):
            i, qi, ki, vi = x
            o, c = (_as_view if view else layer.decode)(geom, plan, c, qi, ki, vi, jnp.full((batch,), length) + i)
            return c, o

        return jax.lax.scan(step, cache, (jnp.arange(steps, dtype=jnp.int32), q, kv[0], kv[1]))

    cache = filled(plan, length, dtype, shape, batch)
    seconds = timing.repeat(lambda: jax.block_until_ready(run(cache)), repeats)  # after a compiling call
    return dict(bits=bits, length=length, **seconds.rate(steps).fields("tok_s"), cache_bytes=cache.nbytes,
                kv_bytes=sum(x.nbytes for name, x in vars(cache).items() if name.startswith(("k", "v", "res")) and
                             x is not None))


def kernel_error(bits: int, length: int, shape=SHAPE) -> float:
    """Largest absolute difference between the kernel's decode output and `quant.attend`'s, one step over the
    filled cache, float32 (on a GPU, where the kernel is compiled; interpreted on a CPU)."""
    from kvjax.pallas import quant_decode

    spec = WIDTHS[bits]
    plan = resolve(Quantized(FullCache(), **spec), 1, shape["num_kv_heads"]).sized(length + 1).layers[0]
    qc = filled(plan, length, jnp.float32, shape)
    rng = np.random.RandomState(1)
    h, kvh, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    q = jnp.asarray(rng.randn(1, h, d), jnp.float32)
    cur = tuple(jnp.asarray(rng.randn(1, kvh, d), jnp.float32) for _ in range(2))
    newest = jnp.asarray([length - 1])
    want = quant.attend(q, qc, newest, cur, scale=d ** -0.5)[0]
    from kvjax.pallas import platform_variant

    got = quant_decode.attend(q, qc, newest, cur, scale=d ** -0.5, interpret=platform_variant()[1])[0]
    err = float(jnp.max(jnp.abs(got - want)))
    if not np.isfinite(err):  # a non-finite output is an error, not a table entry
        raise FloatingPointError(f"the codes kernel's output at {bits} bits, {length} slots is not finite")
    return err


def plot(rows: list[dict], widths: list[int], plat: str, path: Path) -> None:
    """Decode steps/s and cache bytes against cached tokens, one line per width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, w in enumerate(widths):
        pts = [r for r in rows if r["bits"] == w]
        a.plot([r["length"] for r in pts], [r["tok_s"] for r in pts], marker="o", label=f"{w}-bit", color=f"C{i}")
        if any("tok_s_kernel" in r for r in pts):
            a.plot([r["length"] for r in pts if "tok_s_kernel" in r],
                   [r["tok_s_kernel"] for r in pts if "tok_s_kernel" in r], marker="x", ls="--",
                   label=f"{w}-bit, Pallas kernel", color=f"C{i}")
        b.plot([r["length"] for r in pts], [r["cache_bytes"] / 2**20 for r in pts], marker="o", label=f"{w}-bit",
               color=f"C{i}")
    a.set(xscale="log", xlabel="cached tokens", ylabel="decode steps/s (one layer)", title=f"decode ({plat})")
    b.set(xscale="log", yscale="log", xlabel="cached tokens", ylabel="cache MiB (one layer)", title="cache bytes")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--lengths", default="4096,16384,65536",
                   help="tokens L in the cache before decoding, comma-separated")
    p.add_argument("--steps", type=int, default=32, help="tokens decoded per run")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per cell after a compiling one; the median is shown, with the range")
    p.add_argument("--widths", default="16,8,4,2",
                   help="cache widths in bits, comma-separated (16: unquantized, 8: int8, 4 and 2: KIVI)")
    p.add_argument("--kernel", action="store_true", help="also the Pallas kernel reading codes (a GPU): its "
                   "tokens/s, and its largest difference from the jnp reference on the same cache")
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES), help="one attention layer of this model")
    p.add_argument("--batch", type=int, default=1, help="rows decoded at once, each with its own cache")
    p.add_argument("--no-variants", action="store_true", help="skip the rolled-loop and view columns (slow at "
                   "large shapes; they are the jnp path's settings, not kvjax's)")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p)
    args = p.parse_args(argv)
    shape, batch = SHAPES[args.shape], args.batch
    if batch < 1:
        p.error(f"--batch: {batch}; expected at least 1")
    lengths = [int(x) for x in args.lengths.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    bad = [w for w in widths if w not in WIDTHS]
    if bad:
        p.error(f"--widths: {bad}; expected some of {sorted(WIDTHS)}")
    plat = jax.devices()[0].platform
    guard = timing.LoadGuard(args, cpu=plat == "cpu")
    guard.check()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in tqdm(lengths, desc="cache lengths"):
        for w in widths:
            timed = functools.partial(time_width, w, n, args.steps, args.repeats, jnp.bfloat16, shape=shape,
                                      batch=batch)
            row = timed()
            variants = {"view": dict(view=True), "rolled": dict(unroll=1)} if w != 16 and not args.no_variants else {}
            if args.kernel:  # 16-bit: kvjax.pallas.decode, the kernel the codes kernel is measured against
                if w != 16:
                    row["kernel_err"] = kernel_error(w, n, shape)
                variants["kernel"] = dict(impl="pallas")
            for name, kw in variants.items():
                r = timed(**kw)
                row |= {k.replace("tok_s", f"tok_s_{name}"): r[k] for k in ("tok_s", "tok_s_min", "tok_s_max")}
            rows.append(row)
    meta = dict(platform=plat, device=str(jax.devices()[0]), cpu=timing.machine(),
                shape=shape, shape_name=args.shape, batch=batch, dtype="bfloat16", steps=args.steps,
                jax=jax.__version__, widths=WIDTHS)
    stem = f"quant_{plat}" + (f"_{args.shape}" if args.shape != "smollm2" else "") + (f"_b{batch}" if batch > 1 else "")
    loadavg = guard.record()
    (out / f"{stem}.json").write_text(json.dumps(guard.stamp(dict(meta=meta, rows=rows), loadavg), indent=2))
    base = {r["length"]: r for r in rows if r["bits"] == 16}
    lines = [f"# Quantized cache: decode speed and bytes ({meta['device']}, jax {jax.__version__})", "",
             f"One attention layer of {args.shape}'s shape ({shape}), bfloat16, batch {batch}, FullCache holding L tokens, "
             f"{args.steps} tokens decoded (the median of {args.repeats} runs, min–max in brackets). 8: int8 per "
             "token; 4 / 2: KIVI, G = 32, R = 128. "
             "Bytes: the whole layer cache (codes, scales, zeros, positions, scores, biases, residual).", "",
             f"Decode tok/s from the codes (kvjax's path for FullCache, its block loops unrolled by "
             f"{quant.DECODE_UNROLL}; and rolled, one 512-slot block per loop iteration) and through the view (the "
             "layer's cache dequantized and requantized on every call, the path of rules that read keys in their "
             "step).", "",
             "| L | bits | decode tok/s | x 16-bit speed | rolled loop tok/s | via the view tok/s | x 16-bit | cache MiB | "
             "x 16-bit bytes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get(r["length"])
        ratio = lambda k, ref="tok_s": f"{r[k] / b[ref]:.2f}" if b and k in r else "-"  # noqa: E731
        view = timing.cell(r, "tok_s_view", ".1f") or "-"
        rolled = timing.cell(r, "tok_s_rolled", ".1f") or "-"
        lines.append(f"| {r['length']} | {r['bits']} | {timing.cell(r, 'tok_s', '.1f')} | {ratio('tok_s')} | {rolled} | {view} | "
                     f"{ratio('tok_s_view')} | {r['cache_bytes'] / 2**20:.2f} | {ratio('cache_bytes', 'cache_bytes')} |")
    if args.kernel:
        lines += ["", "The Pallas kernel reading codes (`--kernel`): tokens/s, and its largest absolute difference "
                  "from the jnp reference (one step, float32)" + (" -- interpreted on a CPU, where its speed means nothing" if
                  plat == "cpu" else "") + ". 16-bit: kvjax's decode kernel (`kvjax.pallas.decode`). GB/s: the "
                  "cache's key and value bytes (codes, scales, zeros, residual) read once per step:", "",
                  "| L | bits | kernel tok/s | x 16-bit kernel | GB/s | max abs difference |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            if "tok_s_kernel" in r:
                b = base.get(r["length"], {})
                x16 = f"{r['tok_s_kernel'] / b['tok_s_kernel']:.2f}" if "tok_s_kernel" in b else "-"
                err = f"{r['kernel_err']:.1e}" if "kernel_err" in r else "-"
                lines.append(f"| {r['length']} | {r['bits']} | {timing.cell(r, 'tok_s_kernel', '.1f')} | {x16} | "
                             f"{r['kv_bytes'] * r['tok_s_kernel'] / 1e9:.1f} | {err} |")
    lines = guard.mark(lines, args.repeats, loadavg)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    plot(rows, widths, plat, out / f"{stem}.png")


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main))
