"""Prefill seconds on the CPU: kvjax's XLA prefill that skips masked tiles, the same prefill computing
every tile (as before it), and transformers' PyTorch SDPA, side by side in one run on the same weights.

    python -m benchmarks.prefill [--lengths 1024,4096,16384] [--sparse-length 16384] [--out benchmarks/results]

The model is issue #25's: a random Llama of 4 layers, d 256, 8 / 2 heads, vocabulary 8192, float32.
Each figure is the median of `--repeats` timed calls (with their range) after one compiling call (kvjax) or
warm-up (torch); a CPU table is refused on a busy machine (`--max-load`, `--allow-load`; `benchmarks.timing`). A second table times one attention layer of the model's shape at `--sparse-length` tokens under
block-sparse masks (Attention-Gate flags evicting whole key blocks, AnLLM's eq. 4), skipping against
every tile. Writes prefill_<platform>.json / .md. Numbers are for reading, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax import FullCache, attention, engine
from kvjax.anllm_anchors import anchor_mask
from kvjax.masks import Mask
from benchmarks import timing
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter
from kvjax import drive
from kvjax.models import load
from kvjax.models.tiny import make_random_checkpoint, tiny_config

CONFIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2,
              head_dim=32, max_position_embeddings=32768)


def seconds_of(run, repeats: int) -> timing.Spread:
    """The seconds of `repeats` calls after a compiling (or warm-up) one."""
    return timing.repeat(run, repeats)


def time_kvjax(model, ids: np.ndarray, repeats: int, skip: bool) -> timing.Spread:
    tokens = jnp.asarray(ids[None])
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    original = attention.prefill_attention
    if not skip:  # the previous path: every query block against every key (the model always asks to skip)
        attention.prefill_attention = lambda *a, self_attention=False, **kw: original(*a, **kw)
    jax.clear_caches()  # the two paths share the jitted function's key: compile afresh for each
    try:
        plan = drive.plan(model, FullCache(), len(ids), len(ids))
        run = lambda: jax.block_until_ready(engine.prefill(model, tokens, pos, plan=plan))  # noqa: E731
        return seconds_of(run, repeats)
    finally:
        attention.prefill_attention = original


def time_torch(path: Path, ids: np.ndarray, repeats: int) -> timing.Spread:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    x = torch.tensor(ids[None])

    def run():
        with torch.no_grad():
            model(x, use_cache=True)

    return seconds_of(run, repeats)


def sparse_cases(t: int, kv_heads: int, block: int = attention.PREFILL_BLOCK) -> dict:
    """Masks for one layer of `t` tokens: none; a gate keeping every key of 1 key block in 10 (the rest
    evicted in every head: block-sparse), as bool flags (skippable) and as the float flags of training
    (every tile computed, for their gradient); eq. 4 with an anchor every 512 tokens and every 40."""
    kept = (np.arange(t) // block) % 10 == 0
    flags = jnp.asarray(np.broadcast_to(kept, (1, kv_heads, t)))
    anchors = lambda every: anchor_mask(jnp.asarray(np.arange(t)[None] % every == every - 1))  # noqa: E731
    return {"causal": Mask(), "gate, 90 % of key blocks evicted, bool flags": Mask(key_keep=flags),
            "gate, the same flags as float (training)": Mask(key_keep=flags.astype(jnp.float32)),
            "eq. 4, an anchor every 512 tokens": Mask(anchors=anchors(512)),
            "eq. 4, an anchor every 40 tokens": Mask(anchors=anchors(40))}


def time_sparse(t: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    h, kvh, d = CONFIG["num_heads"], CONFIG["num_kv_heads"], CONFIG["head_dim"]
    q, k, v = (jnp.asarray(rng.standard_normal((1, n, t, d), np.float32)) for n in (h, kvh, kvh))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    rows = []
    for name, masks in tqdm(sparse_cases(t, kvh).items(), desc="block-sparse masks"):
        row = {"mask": name, "tokens": t}
        for key, skip in (("every_tile_s", False), ("skipping_s", True)):
            f = jax.jit(lambda q, k, v, m, skip=skip: attention.prefill_attention(
                q, k, v, pos, pos, scale=d**-0.5, self_attention=skip, mask=m)[0])
            row |= seconds_of(lambda f=f: jax.block_until_ready(f(q, k, v, masks)), repeats).fields(key)
        row["speedup"] = row["every_tile_s"] / row["skipping_s"]
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per cell after a compiling one (torch: a warm-up); the median is shown")
    p.add_argument("--sparse-length", type=int, default=16384, help="tokens of the block-sparse table (0: none)")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p)
    args = p.parse_args(argv)
    plat = jax.devices()[0].platform
    guard = timing.LoadGuard(args, cpu=plat == "cpu")
    guard.check()
    tmp = Path(tempfile.mkdtemp())
    make_random_checkpoint(tmp, tiny_config(**CONFIG), seed=0)
    model = load(tmp).model
    rows = []
    for n in tqdm([int(x) for x in args.lengths.split(",")], desc="prefill"):
        ids = np.random.default_rng(n).integers(4, CONFIG["vocab_size"], n).astype(np.int32)
        row = {"prompt": n, **time_torch(tmp, ids, args.repeats).fields("torch_sdpa_s"),
               **time_kvjax(model, ids, args.repeats, skip=False).fields("kvjax_every_tile_s"),
               **time_kvjax(model, ids, args.repeats, skip=True).fields("kvjax_skipping_s")}
        row["skipping_vs_torch"] = row["torch_sdpa_s"] / row["kvjax_skipping_s"]
        row["skipping_vs_every_tile"] = row["kvjax_every_tile_s"] / row["kvjax_skipping_s"]
        rows.append(row)
        print(row)
    sparse = time_sparse(args.sparse_length, args.repeats) if args.sparse_length else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"platform": plat, "machine": timing.machine(), "config": CONFIG,
            "jax": jax.__version__, "repeats": args.repeats}
    loadavg = guard.record()
    (out / f"prefill_{plat}.json").write_text(json.dumps(guard.stamp({"meta": meta, "rows": rows, "sparse": sparse},
                                                                     loadavg), indent=2))
    lines = [f"# Prefill on {plat} ({meta['machine']}), issue #25's model: 4 layers, d 256, 8/2 heads, vocab 8192, f32",
             "", "The median of {r} calls after a compiling one (min–max), side by side in one run. Speed-up > 1: "
             "kvjax faster (from the medians).".format(r=args.repeats), "",
             "| prompt | torch SDPA s | kvjax every tile s | kvjax skipping s | vs torch | vs every tile |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {timing.cell(r, 'torch_sdpa_s', '.2f')} | {timing.cell(r, 'kvjax_every_tile_s', '.2f')} | "
              f"{timing.cell(r, 'kvjax_skipping_s', '.2f')} | {r['skipping_vs_torch']:.2f}x | "
              f"{r['skipping_vs_every_tile']:.2f}x |" for r in rows]
    if sparse:
        lines += ["", f"One attention layer (8 / 2 heads, d 32, f32) at {args.sparse_length} tokens under block-sparse "
                  "masks: the skipping path against every tile, same run.", "",
                  "| mask | every tile s | skipping s | speed-up |", "|---|---|---|---|"]
        lines += [f"| {r['mask']} | {timing.cell(r, 'every_tile_s', '.2f')} | {timing.cell(r, 'skipping_s', '.2f')} | "
                  f"{r['speedup']:.2f}x |" for r in sparse]
    lines = guard.mark(lines, args.repeats, loadavg)
    (out / f"prefill_{plat}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main))
