"""AdaKV against SnapKV at equal total budget: cache bytes and decode speed.

    python -m benchmarks.adakv [--lengths 4096,16384] [--budget 256] [--new 64] [--attention-impl xla|pallas]
                               [--out benchmarks/results]

AdaKV (Feng et al. 2024) runs one top-k over all KV heads of a layer, so each head keeps a different number of
tokens; its total per layer is SnapKV's (`kv_heads x budget`). kvjax's AdaKV holds them in one pool per layer
shared by its heads (`kvjax.cache.PooledLayerCache`), so its bytes are SnapKV's (a head index per slot in place
of SnapKV's two per-slot statistics); its decode attends each head's own slots by masking the others in the jnp
reference, so its work is the pool's times the KV heads. This benchmark measures both on `benchmarks.decode`'s tiny Llama
(4 layers, 2 KV heads), batch 1, random weights, at the same budget for SnapKV(budget) and AdaKV(SnapKV(budget)),
with the full cache beside them. Times are the median of `--repeats` runs with their range; a CPU table is refused
on a busy machine (`benchmarks.timing`). Writes adakv_<platform>.json / .md / .png; numbers are for reading, never
asserted in tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from benchmarks import timing
from benchmarks.decode import BENCH_CONFIG, bench_meta, bench_model, time_kvjax
from kvjax import FullCache
from kvjax.policies import AdaKV, SnapKV
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter


def policies(budget: int) -> dict:
    return {"full": FullCache(), f"snapkv{budget}": SnapKV(budget=budget),
            f"adakv{budget}": AdaKV(scorer=SnapKV(budget=budget), alpha=0.2)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.adakv", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--lengths", default="4096,16384", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--budget", type=int, default=256,
                   help="SnapKV's slots per KV head; AdaKV's pool holds KV heads x this per layer")
    p.add_argument("--new", type=int, default=64, help="tokens decoded per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is shown, with the range")
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="pallas (a GPU): the decode kernels, AdaKV's pool read by kvjax.pallas.pool_decode")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    plat = jax.devices()[0].platform
    if args.attention_impl == "pallas" and plat != "gpu":
        p.error("--attention-impl pallas times the GPU kernels; on a CPU they run interpreted")
    guard = timing.LoadGuard(args, cpu=plat == "cpu")
    guard.check()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, _ = bench_model(attention_impl=args.attention_impl)
    rows = []
    for n in tqdm(lengths, desc="prompt lengths"):
        ids = np.random.RandomState(n).randint(4, BENCH_CONFIG["vocab_size"], n).tolist()
        for name, policy in policies(args.budget).items():
            rows.append(dict(policy=name, prompt=n, **time_kvjax(model, ids, policy, args.new, args.repeats)))

    meta = bench_meta(new_tokens=args.new, budget=args.budget, attention_impl=args.attention_impl, repeats=args.repeats)
    loadavg = guard.record()
    (out / f"adakv_{plat}.json").write_text(json.dumps(guard.stamp(dict(meta=meta, rows=rows), loadavg), indent=2))
    full = {r["prompt"]: r for r in rows if r["policy"] == "full"}
    lines = [f"# AdaKV vs SnapKV at equal total budget ({meta['device']}, jax {jax.__version__})", "",
             f"Tiny Llama {BENCH_CONFIG}, batch 1, float32, {args.new} new tokens, budget {args.budget} per KV head "
             f"(AdaKV: {BENCH_CONFIG['num_kv_heads']} x {args.budget} per layer, shared by its heads in one pool). "
             "AdaKV's decode masks the other heads' slots of the pool (the jnp reference; the Pallas pool kernel, `--attention-impl pallas`, is GPU-only).", "",
             "| prompt | policy | cache MiB | x full bytes | decode tok/s | x full speed | prefill s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = full[r["prompt"]]
        lines.append(f"| {r['prompt']} | {r['policy']} | {r['cache_bytes'] / 2**20:.2f} | "
                     f"{r['cache_bytes'] / f['cache_bytes']:.3f} | {timing.cell(r, 'tok_s', '.1f')} | "
                     f"{r['tok_s'] / f['tok_s']:.2f} | {timing.cell(r, 'prefill_s', '.2f')} |")
    lines = guard.mark(lines, args.repeats, loadavg)
    (out / f"adakv_{plat}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in policies(args.budget):
        pts = [r for r in rows if r["policy"] == name]
        a.plot([r["prompt"] for r in pts], [r["cache_bytes"] / 2**20 for r in pts], marker="o", label=name)
        b.plot([r["prompt"] for r in pts], [r["tok_s"] for r in pts], marker="o", label=name)
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="cache MiB", title="cache bytes")
    b.set(xscale="log", xlabel="prompt tokens", ylabel="decode tokens/s", title=f"decode ({plat})")
    a.legend()
    fig.tight_layout()
    fig.savefig(out / f"adakv_{plat}.png", dpi=120)


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main))
