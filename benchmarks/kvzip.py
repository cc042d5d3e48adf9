"""What KVzip's replay costs: the prompt pass, and the replay after it, against SnapKV's prompt pass.

    python -m benchmarks.kvzip [--model smollm2] [--lengths 1024,2048,4096] [--ratio 0.75] [--out benchmarks/results]

KVzip (`kvjax.kvzip`) caches the context whole, then replays it through the model (the repeat prompt and the
context again, 2048 tokens per replay, attending the cached context) to score every slot. Per context length, one
row of batch 1 with random token ids: the prompt pass under KVzip's plan (the full cache's), the replay and
eviction (`kvzip.compress`), and SnapKV's prompt pass at the same ratio, each the median of `--repeats` runs
(with their range) after a compiling call (its seconds beside them: first compiles, as this benchmark never uses
the persistent compilation cache). A CPU table is refused on a busy machine (`--max-load`, `--allow-load`;
`benchmarks.timing`). Writes kvzip_<platform>[_<model>].json / .md; numbers are for reading, never asserted in
tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax import engine, kvzip
from kvjax.engine import bucket_length
from kvjax.policies import KVzip, SnapKV
from benchmarks import timing
from kvjax.cli import add_compile_cache_flag, description, model_help, out_dir, HelpFormatter
from kvjax import drive
from kvjax.models import load


def best(fn, repeats: int) -> tuple[float, timing.Spread]:
    """(first call's seconds, compile included; the seconds of `repeats` calls after it)."""
    first, _ = timing.timed(lambda: jax.block_until_ready(fn()))
    return first, timing.repeat(lambda: jax.block_until_ready(fn()), repeats, warmup=0)


def measure(lm, length: int, ratio: float, repeats: int) -> dict:
    model = lm.model
    rng = np.random.RandomState(length)
    ids = rng.randint(100, lm.config.vocab_size, length).tolist()
    bucket = bucket_length(length)
    tokens = np.zeros((1, bucket), np.int32)
    pos = np.full((1, bucket), -1, np.int32)
    tokens[0, bucket - length:], pos[0, bucket - length:] = ids, np.arange(length)
    tokens, pos = jnp.asarray(tokens), jnp.asarray(pos)
    zip_policy = KVzip(ratio=ratio, **kvzip.replay_prompts(lm.tokenizer))
    zip_plan = drive.plan(model, zip_policy, bucket + 16, bucket)
    snap_plan = drive.plan(model, SnapKV(ratio=ratio), bucket + 16, bucket)
    row = dict(length=length)
    row["prefill_first_s"], spread = best(lambda: engine.prefill(model, tokens, pos, plan=zip_plan), repeats)
    row |= spread.fields("prefill_s")
    _, cache = engine.prefill(model, tokens, pos, plan=zip_plan)
    row["replay_first_s"], spread = best(lambda: kvzip.compress(model, cache, zip_plan, [ids]), repeats)
    row |= spread.fields("replay_s")
    row["snapkv_first_s"], spread = best(lambda: engine.prefill(model, tokens, pos, plan=snap_plan), repeats)
    row |= spread.fields("snapkv_s")
    row["replays"] = len(kvzip.replays(ids, zip_policy))
    row["replay_tokens"] = sum(len(r[2]) for r in kvzip.replays(ids, zip_policy))
    for k, v in row.items():
        if isinstance(v, float) and not np.isfinite(v):
            raise FloatingPointError(f"{k} at {length} tokens is {v}")
    return row


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kvzip", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens, comma-separated")
    p.add_argument("--ratio", type=float, default=0.75,
                   help="share of the context's cache evicted, by KVzip and SnapKV alike")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per step after a compiling one; the median is shown, with the range")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p, measures_compile=True)
    args = p.parse_args(argv)
    from kvjax.experiments.common import DEFAULT_MODEL_DIR

    guard = timing.LoadGuard(args, cpu=jax.devices()[0].platform == "cpu")  # the load before the run
    lm = load(args.model or DEFAULT_MODEL_DIR)
    guard.check()  # after the model loaded: an error in the command line or the model is said first
    name = "default" if args.model is None else Path(str(args.model)).stem.split(".")[0].lower()
    rows = [measure(lm, n, args.ratio, args.repeats) for n in tqdm([int(x) for x in args.lengths.split(",")],
                                                                   desc="context lengths")]
    plat = jax.devices()[0].platform
    meta = dict(platform=plat, device=str(jax.devices()[0]), cpu=timing.machine(),
                model=str(args.model or DEFAULT_MODEL_DIR), ratio=args.ratio, repeats=args.repeats,
                jax=jax.__version__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"kvzip_{plat}" + ("" if args.model is None else f"_{name}")
    loadavg = guard.record()
    (out / f"{stem}.json").write_text(json.dumps(guard.stamp(dict(meta=meta, rows=rows), loadavg), indent=2))
    lines = [f"# KVzip's replay cost ({meta['device']}, {name} model, jax {jax.__version__})", "",
             f"Batch 1, random token ids, ratio {args.ratio}; seconds, the median of {args.repeats} runs after a "
             "compiling call (min–max in brackets, then the first call's seconds, compilation included, in square "
             "brackets). Prompt pass: KVzip's (the full cache's); replay: `kvzip.compress` (every "
             "replay and the eviction); SnapKV: its prompt pass at the same ratio. `python -m benchmarks.kvzip "
             + " ".join(argv if argv is not None else __import__("sys").argv[1:]) + "`.", "",
             "| context | prompt pass s | replay s | replays (tokens) | KVzip total / prompt pass | SnapKV prompt pass s |"
             " KVzip total / SnapKV |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["prefill_s"] + r["replay_s"]
        lines.append(f"| {r['length']} | {timing.cell(r, 'prefill_s')} [{r['prefill_first_s']:.1f}] | "
                     f"{timing.cell(r, 'replay_s')} [{r['replay_first_s']:.1f}] | {r['replays']} ({r['replay_tokens']}) | "
                     f"{total / r['prefill_s']:.2f} | {timing.cell(r, 'snapkv_s')} [{r['snapkv_first_s']:.1f}] | "
                     f"{total / r['snapkv_s']:.2f} |")
    lines = guard.mark(lines, args.repeats, loadavg)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main, compile_cache=False))  # its first calls' seconds include first compiles
