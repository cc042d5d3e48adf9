"""Pallas kernels vs the XLA (jnp) reference: decode over C cache slots, masked prefill over T tokens.

    python -m benchmarks.attention [--decode 1024,4096,16384,32768,65536] [--decode-batches 1,8,32]
                                   [--decode-dtypes bfloat16,float32] [--prefill 1024,4096,16384]
                                   [--masked 0,0.5,0.9] [--masking block|token] [--common 8192,16384,32768]
                                   [--out benchmarks/results]

Decode: batch B (each row its own cache), 32 query heads over 8 KV heads, d = 128; achieved
bandwidth is the K and V bytes read over the time (the kernel must read them once). Prefill:
batch 1, 32 / 8 heads, d = 128, bfloat16, causal, with a fraction of the keys removed by an
Attention-Gate keep-mask; FLOP rate counts the dense causal work `4 * h * T^2 / 2 * d`.
`--common`: the common case (causal, no mask, no statistics) through `attention.prefill_attention`
with `impl="pallas"`, which a GPU routes to cuDNN (`attention.prefill_route`), beside the Pallas
kernel on the same inputs, and the bare `jax.nn.dot_product_attention(implementation="cudnn")` call
(what the dispatch's padding adapter costs); % of peak against the dense bf16 tensor-core peak (`PEAK_FLOPS`).
`--masking block` drops whole 128-token key blocks (what block skipping can exploit;
Attention-Gate's evictions cluster this way when they follow sentence structure);
`token` drops random tokens (no block is empty, so no block can be skipped).

On a GPU or TPU both implementations run natively. On CPU the kernels only run in
interpret mode, a simulator whose timings mean nothing, so only the reference is
timed there unless `--interpret`. Writes attention_<platform>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax import attention
from kvjax import pallas as kernels
from kvjax.masks import Mask
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter

# Peak HBM bandwidth (bytes/s) by device kind, for "% of peak".
PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "TPU v4": 1.2e12, "TPU v5e": 0.82e12}
# Dense bf16 tensor-core peak (FLOP/s, no sparsity) by device kind, for the common case's "% of peak".
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v4": 275e12, "TPU v5e": 197e12}


def _peak(table: dict) -> float | None:
    kind = jax.devices()[0].device_kind
    return next((x for name, x in table.items() if name in kind), None)


def peak_bandwidth() -> float | None:
    return _peak(PEAK_BW)


def best_time(fn, q, *args, repeats=5, inner=20) -> float:
    """Seconds per call of `fn(q, *args) -> out` (out shaped like q), device time: `inner` calls
    chained inside one jit (each call's output is the next one's query), so the ~50 µs of
    host dispatch per jit call, larger than a decode step, is paid once per `inner` calls."""

    @jax.jit
    def chained(q, *args):
        return jax.lax.fori_loop(0, inner, lambda _, q: fn(q, *args).astype(q.dtype), q)

    jax.block_until_ready(chained(q, *args))  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(chained(q, *args))
        times.append(time.perf_counter() - t)
    return min(times) / inner


def bench_decode(c, variant, interpret, block=None, splits=None, h=32, kvh=8, d=128, dtype=jnp.bfloat16, batch=1):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, h, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(batch, kvh, c, d)), dtype) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (batch, kvh, c))
    log_w = jnp.zeros((batch, kvh, c), jnp.float32)
    scale = d**-0.5
    ref = jax.jit(lambda *a: attention.decode_attention(*a, scale=scale)[0])
    ker = jax.jit(lambda *a: kernels.decode_attention(*a, scale=scale, variant=variant, interpret=interpret,
                                                      block=block, splits=splits)[0])
    bytes_read = 2 * batch * kvh * c * d * jnp.dtype(dtype).itemsize
    row = {"C": c, "batch": batch, "dtype": jnp.dtype(dtype).name, "block": block or kernels.blocks.DECODE[variant or "gpu"].block_k, "splits": splits or "auto",
           "xla_us": 1e6 * best_time(ref, q, k, v, pos, log_w)}
    if variant is not None:
        row["pallas_us"] = 1e6 * best_time(ker, q, k, v, pos, log_w)
        row["pallas_GBps"] = bytes_read / row["pallas_us"] / 1e3
    row["xla_GBps"] = bytes_read / row["xla_us"] / 1e3
    return row


def gate_mask(t, kvh, masked, masking, rng, block=128):
    if masking == "token":
        return jnp.asarray(rng.random((1, kvh, t)) >= masked)
    nb = -(-t // block)
    keep_blocks = rng.random((1, kvh, nb)) >= masked
    return jnp.asarray(np.repeat(keep_blocks, block, axis=-1)[..., :t])


def bench_prefill(t, masked, masking, variant, interpret, h=32, kvh=8, d=128, dtype=jnp.bfloat16):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, h, t, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(1, kvh, t, d)), dtype) for _ in range(2))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    keep = gate_mask(t, kvh, masked, masking, rng) if masked > 0 else None
    scale = d**-0.5
    ref = jax.jit(lambda q, k, v: attention.prefill_attention(q, k, v, pos, pos, scale=scale, mask=Mask(key_keep=keep))[0])
    ker = jax.jit(lambda q, k, v: kernels.prefill_attention(q, k, v, pos, pos, scale=scale, mask=Mask(key_keep=keep),
                                                            variant=variant, interpret=interpret)[0])
    flops = 4 * h * t * t / 2 * d
    row = {"T": t, "masked": masked, "xla_ms": 1e3 * best_time(ref, q, k, v, repeats=3, inner=5)}
    if variant is not None:
        row["pallas_ms"] = 1e3 * best_time(ker, q, k, v, repeats=3, inner=5)
        row["pallas_TFLOPs_dense"] = flops / row["pallas_ms"] / 1e9
    return row


def bench_common(t, variant, interpret, h=32, kvh=8, d=128, dtype=jnp.bfloat16):
    """The common case: causal, no mask, no statistics, through kvjax's dispatch (cuDNN on a GPU) and
    through the Pallas kernel, on the same inputs."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, h, t, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(1, kvh, t, d)), dtype) for _ in range(2))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    scale = d**-0.5
    route = attention.prefill_route("pallas", jax.default_backend(), stats=attention.NO_STATS, mask=Mask(),
                                    self_attention=True, dtype=dtype, head_dim=d)
    dispatched = jax.jit(lambda q, k, v: attention.prefill_attention(q, k, v, pos, pos, scale=scale, impl="pallas",
                                                                     self_attention=True)[0])
    ker = jax.jit(lambda q, k, v: kernels.prefill_attention(q, k, v, pos, pos, scale=scale, variant=variant,
                                                            interpret=interpret)[0])
    flops = 4 * h * t * t / 2 * d
    row = {"T": t, "route": route, "dispatch_ms": 1e3 * best_time(dispatched, q, k, v, repeats=3, inner=5)}
    row["dispatch_TFLOPs"] = flops / row["dispatch_ms"] / 1e9
    if route == "cudnn":  # the bare call, without the adapter's left-to-right padding rotation
        layout = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
        bare = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            layout(q), layout(k), layout(v), scale=scale, is_causal=True, implementation="cudnn").transpose(0, 2, 1, 3))
        row["cudnn_bare_ms"] = 1e3 * best_time(bare, q, k, v, repeats=3, inner=5)
        row["cudnn_bare_TFLOPs"] = flops / row["cudnn_bare_ms"] / 1e9
    if variant is not None:
        row["pallas_ms"] = 1e3 * best_time(ker, q, k, v, repeats=3, inner=5)
        row["pallas_TFLOPs"] = flops / row["pallas_ms"] / 1e9
    return row


def write(out: Path, info: dict, decode: list, prefill: list, common: list) -> str:
    """attention_<platform>.{json,md} from the rows measured so far; returns the markdown."""
    peak = info["peak_GBps"] and info["peak_GBps"] * 1e9
    (out / f"attention_{info['platform']}.json").write_text(json.dumps({"info": info, "decode": decode, "prefill": prefill,
                                                                           "common": common}, indent=2))
    lines = [f"# Attention kernels on {info['device']} ({info['platform']}, variant {info['variant']})", "",
             "Decode, 32/8 heads, d=128 (GB/s: K and V bytes of every row over the time):", "",
             "| dtype | batch | C | block | splits | XLA µs | Pallas µs | Pallas GB/s | % of peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        pct = f"{100 * r['pallas_GBps'] * 1e9 / peak:.0f}%" if peak and "pallas_GBps" in r else "n/a"
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['C']} | {r['block']} | {r['splits']} | {r['xla_us']:.0f} | "
                     f"{r.get('pallas_us', float('nan')):.0f} | "
                     f"{r.get('pallas_GBps', float('nan')):.0f} | {pct} |")
    lines += ["", f"Prefill, causal, keys masked by an Attention-Gate mask ({info['masking']} granularity):", "",
              "| T | masked | XLA ms | Pallas ms | Pallas TFLOP/s (dense-equiv.) | speed-up vs unmasked kernel |",
              "|---|---|---|---|---|---|"]
    for r in prefill:
        lines.append(f"| {r['T']} | {r['masked']:.0%} | {r['xla_ms']:.2f} | {r.get('pallas_ms', float('nan')):.2f} | "
                     f"{r.get('pallas_TFLOPs_dense', float('nan')):.1f} | "
                     f"{r.get('speedup_vs_unmasked_kernel', float('nan')):.2f} |")
    if common:
        peak_flops = _peak(PEAK_FLOPS)
        lines += ["", "Prefill, the common case (batch 1, 32/8 heads, d=128, bf16, causal, no mask, no statistics): "
                      "kvjax's dispatch (`impl=\"pallas\"`) and the Pallas kernel; TFLOP/s of causal work:", "",
                  "| T | route | dispatch ms | dispatch TFLOP/s | % of peak | bare cuDNN TFLOP/s | Pallas kernel ms | "
                  "Pallas TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
        for r in common:
            pct = f"{100 * r['dispatch_TFLOPs'] * 1e12 / peak_flops:.0f}%" if peak_flops else "n/a"
            lines.append(f"| {r['T']} | {r['route']} | {r['dispatch_ms']:.2f} | {r['dispatch_TFLOPs']:.0f} | {pct} | "
                         f"{r.get('cudnn_bare_TFLOPs', float('nan')):.0f} | "
                         f"{r.get('pallas_ms', float('nan')):.2f} | {r.get('pallas_TFLOPs', float('nan')):.0f} |")
    (out / f"attention_{info['platform']}.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--decode", default="1024,4096,16384,32768,65536",
                   help="cache slots C of the decode table, comma-separated")
    p.add_argument("--decode-block", default="", help="decode kernel block sizes to compare (default: the kernel's)")
    p.add_argument("--decode-splits", default="", help="GPU decode splits to compare (default: the kernel's)")
    p.add_argument("--decode-batches", default="1", help="decode batch sizes")
    p.add_argument("--decode-dtypes", default="bfloat16", help="decode cache dtypes (bfloat16, float32)")
    p.add_argument("--prefill", default="1024,4096,16384",
                   help="prompt lengths T in tokens of the masked prefill table, comma-separated")
    p.add_argument("--masked", default="0,0.5,0.9",
                   help="shares of the keys the keep-mask removes in the prefill table, comma-separated")
    p.add_argument("--masking", choices=["block", "token"], default="block",
                   help="block: drop whole 128-token key blocks (what block skipping exploits); token: random tokens")
    p.add_argument("--common", default="", help="prompt lengths of the common-case table (causal, no mask)")
    p.add_argument("--interpret", action="store_true", help="on CPU, also run the kernels in interpret mode")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    add_compile_cache_flag(p)
    args = p.parse_args(argv)
    dtypes = [x for x in args.decode_dtypes.split(",") if x]
    bad = [x for x in dtypes if x not in ("bfloat16", "float32")]
    if bad:
        p.error(f"--decode-dtypes: {bad} not among bfloat16, float32")

    variant, interpret = kernels.platform_variant()
    if interpret and not args.interpret:
        variant = None  # CPU: the kernels would run in the interpreter; time the reference only
    platform = jax.default_backend()
    peak = peak_bandwidth()
    blocks = [int(x) for x in args.decode_block.split(",") if x] or [None]
    splits = [int(x) for x in args.decode_splits.split(",") if x] or [None]
    info = {"device": jax.devices()[0].device_kind, "platform": platform, "variant": variant,
            "peak_GBps": peak and peak / 1e9, "peak_TFLOPs": _peak(PEAK_FLOPS) and _peak(PEAK_FLOPS) / 1e12,
            "masking": args.masking}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the tables are rewritten after each section, cheapest first, so a run cut short keeps what it measured
    common = [bench_common(int(t), variant, interpret) for t in tqdm([x for x in args.common.split(",") if x],
                                                                     desc="common case")]
    write(out, info, [], [], common)
    prefill = [bench_prefill(int(t), float(m), args.masking, variant, interpret)
               for t in tqdm(args.prefill.split(","), desc="prefill") for m in args.masked.split(",")]
    for row in prefill:
        if "pallas_ms" in row:
            base = next(r for r in prefill if r["T"] == row["T"] and r["masked"] == 0)
            row["speedup_vs_unmasked_kernel"] = base["pallas_ms"] / row["pallas_ms"]
    write(out, info, [], prefill, common)
    decode = [bench_decode(int(c), variant, interpret, block, n, dtype=jnp.dtype(dt), batch=int(b))
              for dt in dtypes for b in args.decode_batches.split(",")
              for c in tqdm(args.decode.split(","), desc=f"decode {dt} batch {b}") for block in blocks for n in splits]
    print(write(out, info, decode, prefill, common))


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main))
