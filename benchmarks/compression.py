"""Prefill + compression time vs prefill alone (FullCache) for every score-based policy.

    python -m benchmarks.compression [--length 8192] [--out benchmarks/results]

Writes compression_<platform>.{json,md}. The goal: compression adds <= 10 % to the prefill. Each time is the
median of `--repeats` runs after a compiling one, with their range; a CPU table is refused on a busy machine
(`--max-load`, `--allow-load`; `benchmarks.timing`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from benchmarks import timing
from benchmarks.decode import BENCH_CONFIG
from kvjax import FullCache, Sampling
from kvjax.generate import pad_left, prefill_fn
from kvjax.policies import H2O, TOVA, KNorm, ObservedAttention, PyramidKV, SlimKV, SnapKV, StreamingLLM
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter
from kvjax import drive, engine
from kvjax.models import load
from kvjax.models.tiny import make_random_checkpoint, tiny_config


def time_prefill(graphdef, state, tokens, positions, plan, repeats) -> timing.Spread:
    run = lambda: jax.block_until_ready(prefill_fn.pure(graphdef, state, tokens, positions, jax.random.key(0),
                                                   plan=plan, sampling=Sampling()))
    return timing.repeat(run, repeats)  # after a compiling call


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.compression", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--length", type=int, default=8192, help="prompt length in tokens")
    p.add_argument("--budget", type=int, default=1024, help="each compressing policy's slots per KV head")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed prefills per policy after a compiling one; the median is shown, with the range")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p)
    args = p.parse_args(argv)
    guard = timing.LoadGuard(args, cpu=jax.devices()[0].platform == "cpu")
    guard.check()
    tmp = Path(tempfile.mkdtemp())
    make_random_checkpoint(tmp, tiny_config(**BENCH_CONFIG))
    model = load(tmp).model
    graphdef, state = engine.split(model)
    n = args.length
    tokens, positions = pad_left([np.random.RandomState(0).randint(4, 260, n).tolist()], n, 0)
    b = args.budget
    policies = {
        "full (prefill alone)": FullCache(),
        f"streaming{b}": StreamingLLM(budget=b),
        f"snapkv{b}": SnapKV(budget=b),
        f"pyramidkv{b}": PyramidKV(budget=b, num_layers=model.cfg.num_layers),
        f"slimkv{b}": SlimKV(budget=b),
        f"h2o-prefill{b}": ObservedAttention(budget=b),
        f"h2o{b}": H2O(budget=b, recent=b // 2),
        f"tova{b}": TOVA(budget=b),
        f"knorm{b}": KNorm(budget=b),
    }
    rows = []
    for name, policy in tqdm(policies.items(), desc="policies"):
        rows.append(dict(policy=name, prefill_s=time_prefill(graphdef, state, tokens, positions,
                                                                  drive.plan(model, policy, n + 1, n), args.repeats)))
    for r in rows:
        r |= r.pop("prefill_s").fields("prefill_s")  # the median, and the range
    base = rows[0]["prefill_s"]
    for r in rows:
        r["overhead_pct"] = 100 * (r["prefill_s"] / base - 1)
    plat = jax.devices()[0].platform
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loadavg = guard.record()
    (out / f"compression_{plat}.json").write_text(json.dumps(guard.stamp(dict(
        device=str(jax.devices()[0]), length=n, config=BENCH_CONFIG, repeats=args.repeats, rows=rows), loadavg), indent=2))
    lines = [f"# Prefill + compression at {n} tokens ({jax.devices()[0]})", "",
             "| policy | prefill s | overhead vs FullCache (medians) |", "|---|---|---|"]
    lines += [f"| {r['policy']} | {timing.cell(r, 'prefill_s')} | {r['overhead_pct']:+.1f} % |" for r in rows]
    lines = guard.mark(lines, args.repeats, loadavg)
    (out / f"compression_{plat}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main))
