"""Decode speed and cache bytes: FullCache vs StreamingLLM at growing prompt lengths.

    python -m benchmarks.decode [--lengths 1024,4096,16384] [--new 128] [--out benchmarks/results]

Writes decode_<platform>.json / .md / .png. Also times transformers' PyTorch
`generate` on the same weights and prompt when torch is installed. Each time is the median of
`--repeats` runs, with their range (`benchmarks.timing`); a CPU table is refused on a busy machine
(`--max-load`, `--allow-load`). Numbers are for reading, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from benchmarks import timing
from kvjax.experiments.efficiency import time_policy
from kvjax import FullCache, StreamingLLM
from kvjax.policies import mat
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter
from kvjax.models import load
from kvjax.models.tiny import make_random_checkpoint, tiny_config

BENCH_CONFIG = dict(
    vocab_size=260, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2,
    head_dim=32, max_position_embeddings=32768,
)


def bench_model(seed: int = 0, attention_impl: str = "xla"):
    """The tiny Llama of BENCH_CONFIG with random weights, saved to a temp folder and loaded: (model, folder)."""
    tmp = Path(tempfile.mkdtemp())
    make_random_checkpoint(tmp, tiny_config(**BENCH_CONFIG), seed=seed)
    return load(tmp, attention_impl=attention_impl).model, tmp


def bench_meta(**extra) -> dict:
    """Where a benchmark ran and on what model, for its JSON."""
    return dict(platform=jax.devices()[0].platform, device=str(jax.devices()[0]),
                cpu=timing.machine(), config=BENCH_CONFIG, jax=jax.__version__, **extra)


def time_kvjax(model, ids, policy, new, repeats=3):
    """Decode tokens/s and prefill seconds, each the median of `repeats` samples with its range, and cache bytes.
    A sample is one `kvjax.experiments.efficiency.time_policy` call timing one prefill and one decode loop, each after an
    untimed one (the first of all compiles)."""
    runs = [time_policy(model, [ids], policy, new, 1) for _ in range(repeats)]
    spread = lambda key: timing.Spread(tuple(r[key] for r in runs))  # noqa: E731
    return dict(**spread("decode_tok_s").fields("tok_s"), **spread("prefill_s").fields("prefill_s"),
                cache_bytes=runs[-1]["cache_bytes"])


def time_torch(path, ids, new, repeats=3):
    import torch
    from transformers import LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() and jax.devices()[0].platform == "gpu" else "cpu"
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    x = torch.tensor([ids], device=device)

    def run(n):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)
    # Decode time = (n new tokens) - (1 new token): removes the prefill from the figure; one sample per repeat.
    decode = timing.Spread(tuple(run(new) - run(1) for _ in range(repeats)))
    return decode.rate(new - 1).fields("tok_s")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--new", type=int, default=256, help="tokens decoded per prompt")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per cell; the median is shown, with the range")
    p.add_argument("--budget", type=int, default=256, help="StreamingLLM's and MAT's slots per KV head (MAT's c)")
    p.add_argument("--no-torch", action="store_true",
                   help="skip transformers' PyTorch generate even when torch is installed")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    plat = jax.devices()[0].platform
    guard = timing.LoadGuard(args, cpu=plat == "cpu")
    guard.check()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, tmp = bench_model()
    try:
        import torch  # noqa: F401

        with_torch = not args.no_torch
    except ImportError:
        with_torch = False

    # MAT decodes with its own eviction rule; its prompt is attended whole here (prefill_mode="full")
    # so that the 16K prefill is not 16K sequential steps: this row measures decode cost.
    policies = {
        "full": FullCache(),
        f"streaming{args.budget}": StreamingLLM(budget=args.budget, sinks=4),
        f"mat{args.budget}": mat(args.budget, args.budget // 4, shallow_layers=2, sinks=4, prefill_mode="full"),
    }
    rows = []
    for n in tqdm(lengths, desc="prompt lengths"):
        ids = np.random.RandomState(n).randint(4, 260, n).tolist()
        for name, policy in policies.items():
            rows.append(dict(impl="kvjax", policy=name, prompt=n, **time_kvjax(model, ids, policy, args.new, args.repeats)))
        if with_torch:
            rows.append(dict(impl="torch", policy="full", prompt=n, **time_torch(tmp, ids, args.new, args.repeats)))

    meta = bench_meta(new_tokens=args.new, repeats=args.repeats)
    loadavg = guard.record()
    (out / f"decode_{plat}.json").write_text(json.dumps(guard.stamp(dict(meta=meta, rows=rows), loadavg), indent=2))
    lines = [f"# Decode benchmark ({meta['device']}, jax {jax.__version__})", "",
             f"Tiny Llama {BENCH_CONFIG}, batch 1, {args.new} new tokens, float32, greedy.", "",
             "| impl | policy | prompt | decode tok/s | prefill s | cache MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        mib = f"{r['cache_bytes'] / 2**20:.2f}" if "cache_bytes" in r else "-"
        pre = timing.cell(r, "prefill_s") or "-"
        lines.append(f"| {r['impl']} | {r['policy']} | {r['prompt']} | {timing.cell(r, 'tok_s', '.1f')} | {pre} | {mib} |")
    lines = guard.mark(lines, args.repeats, loadavg)
    (out / f"decode_{plat}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (impl, pol) in sorted({(r["impl"], r["policy"]) for r in rows}):
        pts = [(r["prompt"], r["tok_s"]) for r in rows if (r["impl"], r["policy"]) == (impl, pol)]
        ax.plot(*zip(*pts), marker="o", label=f"{impl} {pol}")
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="decode tokens/s", title=f"decode speed ({plat})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"decode_{plat}.png", dpi=120)


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main))
