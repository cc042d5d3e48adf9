"""Compile and run seconds of kvjax's whole-model programs (issue #64), with the model's layers unrolled and
scanned: each program lowered and compiled from a cold cache `--repeats` times (jax's caches cleared between), then
run `--repeats` times, on the CPU.

    python -m benchmarks.compile --model smollm2 [--length 4096] [--repeats 3] [--layer-loop unroll,scan]

The programs: the prompt pass (`kvjax.engine.prefill`, what `generate` compiles for one policy) under FullCache,
SnapKV, MAT (its prompt read token by token: a scan over the decode step) and RazorAttention (head-wise groups);
the decode loop (`kvjax.generate.decode_fn`, SnapKV's cache, 32 tokens), and the same with a token's step traced in
runs of layers as a prompt's are ("decode loop scanned", the design kvjax declines: not a default
program); and one plain prompt pass shared by four plans (`kvjax.generate.prefill_many_fn`: SnapKV, TOVA, KNorm,
StreamingLLM); on request, "shared pass of N" plans, "capture" (the pass that keeps each layer's attention inputs and
column sums, `kvjax.generate.capture_fn`) and "recache of N" (the N plans' caches made from a capture,
`kvjax.generate.recache_fn`: what `generate_many` runs for each group when there are several), `--batch` rows (default 1; the decode loop is batch 1) of `--length` tokens, and the peak resident
memory above the process's while each program was compiled once more and run (`run_seconds`). Each
figure is the median of `--repeats` (min–max); compile seconds are tracing + lowering to StableHLO + XLA's
compilation. `--layer-loop`: `unroll` traces every layer (kvjax before the scan), `scan` (the default) runs each run of
layers alike as one scanned body (`kvjax.models.llama.Llama.__call__`). A CPU table is refused on a busy machine
(`benchmarks.timing`). Writes compile_<platform>[_<model>].json / .md. Numbers are for reading, never asserted in
tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from kvjax.progress import Bar

from benchmarks import timing
from benchmarks.timing import rss_peak
from kvjax import drive, engine
from kvjax import step as steps
from kvjax.cli import add_compile_cache_flag, description, model_help, out_dir, HelpFormatter
from kvjax.errors import InvalidInput
from kvjax.generate import Sampling, capture_fn, decode_fn, prefill_many_fn, recache_fn
from kvjax.policies import (
    TOVA,
    AnchorCache,
    FullCache,
    KNorm,
    RazorAttention,
    SnapKV,
    StreamingLLM,
)
from kvjax.models import load

NEW_TOKENS = 32
PROGRAMS = ("prefill full", "prefill snapkv", "prefill mat", "prefill razor", "decode loop", "shared pass of 4",
            "decode loop scanned")


@contextlib.contextmanager
def token_step_scanned(name: str):
    """For "decode loop scanned": a token's step traced with its layers in runs as a prompt's are (what
    `kvjax.step.Token.layer_runs` declines, with this program's run time as its reason); otherwise nothing."""
    if name != "decode loop scanned":
        yield
        return
    unrolled = steps.Token.layer_runs
    steps.Token.layer_runs = steps.Step.layer_runs
    try:
        yield
    finally:
        steps.Token.layer_runs = unrolled


def _policies(cfg) -> dict:
    half = cfg.num_kv_heads // 2 or 1  # RazorAttention: the first half of each layer's KV heads are retrieval heads
    retrieval = tuple(tuple(h < half for h in range(cfg.num_kv_heads)) for _ in range(cfg.num_layers))
    return {"full": FullCache(), "snapkv": SnapKV(ratio=0.5), "mat": AnchorCache(budget=512, anchor_slots=128),
            "razor": RazorAttention(retrieval=retrieval, buffer=256, sinks=4, compression=5)}


def program(lm, name: str, length: int, batch: int = 1):
    """`(jitted program, its array arguments, its static keywords)` of one of `PROGRAMS`: `batch` random prompts of
    `length` tokens (the arrays are real, so the compiled program also runs: `run_seconds`); the decode loop is
    batch 1."""
    model, cfg = lm.model, lm.model.cfg
    graphdef, state = engine.split(model)
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 4, cfg.vocab_size, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    key = jax.random.key(0)
    max_len = length + NEW_TOKENS
    pols = _policies(cfg)
    if name.startswith("prefill "):
        plan = drive.plan(model, pols[name.split()[1]], max_len, length)
        return engine.prefill.pure, (graphdef, state, tokens, positions), {"plan": plan}
    if name.startswith("decode loop"):  # 32 tokens after a SnapKV prompt of `length` (its cache's slots, zeros)
        plan = drive.plan(model, pols["snapkv"], max_len, length)
        cache = drive.empty_cache(model, plan, 1)
        i32 = lambda *x: jnp.asarray(x, jnp.int32)  # noqa: E731
        args = (graphdef, state, cache, i32(5), jnp.ones((1,), bool), i32(length), key, i32(-1, -1, -1, -1),
                jnp.int32(NEW_TOKENS), jnp.int32(0), jnp.int32(0))
        return decode_fn.pure, args, {"plan": plan, "sampling": Sampling(), "buffer": NEW_TOKENS}
    if name == "capture":
        return capture_fn.pure, (graphdef, state, tokens, positions, key), {
            "hidden": False, "colsum": True, "sampling": Sampling()}
    if name.startswith(("shared pass of ", "recache of ")):
        n = int(name.rsplit(" ", 1)[1])
        kinds = (lambda r: SnapKV(ratio=r), lambda r: TOVA(ratio=r), lambda r: KNorm(ratio=r),
                 lambda r: StreamingLLM(budget=max(8, int(length * (1 - r)))))
        ratios = (0.5, 0.75, 0.875, 0.25, 0.9375, 0.96875)  # distinct plans: a kind at each ratio in turn
        plans = tuple(drive.plan(model, kinds[i % 4](ratios[i // 4 % len(ratios)]), max_len, length)
                      for i in range(n))
        if name.startswith("recache of "):  # its argument is a capture of the prompt, made here (not timed)
            captured = capture_fn.pure(graphdef, state, tokens, positions, key, hidden=False, colsum=True,
                                       sampling=Sampling())[2]
            return recache_fn.pure, (graphdef, state, tokens, positions, captured), {"plans": plans}
        return prefill_many_fn.pure, (graphdef, state, tokens, positions, key), {
            "plans": plans, "sampling": Sampling()}
    raise InvalidInput(f"--programs: {name!r} is not one of {', '.join(PROGRAMS)}, 'capture', 'shared pass of N' or "
                       "'recache of N'")


def run_seconds(fn, args, kw, repeats: int) -> tuple[float, ...]:
    """Seconds of each of `repeats` runs of the compiled program (after one untimed run), on fresh copies of its
    arguments (a donated cache is consumed by each run)."""
    exe = fn.lower(*args, **kw).compile()

    def once():
        fresh = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, args)
        jax.block_until_ready(fresh)
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*fresh))
        return time.perf_counter() - t0

    once()
    return tuple(once() for _ in range(repeats))


HIT = "/jax/compilation_cache/cache_hits"


def compile_seconds(fn, args, kw) -> tuple[float, float]:
    """(trace + lower, XLA compile) seconds of one cold compilation: jax's in-memory caches cleared first. A program
    loaded from a persistent compilation cache is refused: jax decides once per process whether it uses that cache
    (at its first compilation), so only a process that turned it off before compiling anything measures cold
    compiles; `python -m benchmarks.compile` does (`kvjax.cli.run(compile_cache=False)`)."""
    jax.clear_caches()
    hits = []

    def listener(name, *args, **kwargs):
        if name == HIT:
            hits.append(name)

    jax.monitoring.register_event_listener(listener)
    try:
        t0 = time.perf_counter()
        lowered = fn.lower(*args, **kw)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
    finally:
        jax.monitoring.unregister_event_listener(listener)
    if hits:
        raise InvalidInput("a program came from the persistent compilation cache, not a cold compile: this process "
                           "uses the cache; run python -m benchmarks.compile, which turns it off before compiling")
    return t1 - t0, t2 - t1


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--programs", default=",".join(PROGRAMS[:-1]),
                   help=f"a comma list of: {', '.join(PROGRAMS)}; or 'shared pass of N' (N plans: SnapKV, TOVA, KNorm, "
                   "StreamingLLM in turn, at ratios 0.5, 0.75, ...), 'capture' (the pass kept for recaching, with "
                   "column sums), 'recache of N' (the same N plans' caches from a capture)")
    p.add_argument("--batch", type=int, default=1, help="prompt rows of the prompt passes (default 1; the decode "
                   "loop is batch 1 only)")
    p.add_argument("--repeats", type=int, default=3, help="cold compilations per program (default 3)")
    p.add_argument("--layer-loop", default="unroll,scan",
                   help="how each program runs the model's layers, a comma list of: unroll, scan (default both)")
    p.add_argument("--no-run", action="store_true", help="compile only (no run seconds)")
    p.add_argument("--tag", help="appended to the tables' names (compile_<platform>_<model>_<tag>.md), so that a "
                   "run of other programs does not replace the main table")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p, measures_compile=True)
    args = p.parse_args(argv)
    from kvjax.experiments.common import DEFAULT_MODEL_DIR

    names = [n.strip() for n in args.programs.split(",") if n.strip()]
    for n in names:
        counted = n.startswith(("shared pass of ", "recache of ")) and n.rsplit(" ", 1)[1].isdigit() \
            and 1 <= int(n.rsplit(" ", 1)[1]) <= 24
        if n not in PROGRAMS and n != "capture" and not counted:
            raise InvalidInput(f"--programs: {n!r} is not one of {', '.join(PROGRAMS)}, 'capture', 'shared pass of N' "
                               "or 'recache of N' (N from 1 to 24)")
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", args.tag):
        raise InvalidInput(f"--tag {args.tag!r}: letters, digits, '_' and '-' only (it names a file)")
    if args.repeats < 1:
        raise InvalidInput(f"--repeats {args.repeats}: at least 1")
    if args.batch < 1 or args.batch > 1 and any(n.startswith("decode loop") for n in names):
        raise InvalidInput(f"--batch {args.batch}: at least 1, and 1 with a decode loop program")
    guard = timing.LoadGuard(args, cpu=jax.devices()[0].platform == "cpu")
    loops = [x.strip() for x in args.layer_loop.split(",") if x.strip()]
    if not loops or set(loops) - {"unroll", "scan"}:
        raise InvalidInput(f"--layer-loop {args.layer_loop!r}: a comma list of unroll, scan")
    cfg = load(args.model or DEFAULT_MODEL_DIR, tokenizer=False).model.cfg
    if not 16 <= args.length <= cfg.max_position_embeddings - NEW_TOKENS:
        raise InvalidInput(f"--length {args.length}: between 16 and the model's window less {NEW_TOKENS} "
                           f"({cfg.max_position_embeddings - NEW_TOKENS})")
    guard.check()  # after the model loaded: an error in the command line or the model is said first
    rows = []
    for loop in tqdm(loops, desc="layer loops"):
        lm = load(args.model or DEFAULT_MODEL_DIR, tokenizer=False, layer_loop=loop)
        for name in Bar(names, desc=f"programs ({loop})", nested=True):
            fn, fargs, kw = program(lm, name, args.length, args.batch)
            with token_step_scanned(name):
                runs = [compile_seconds(fn, fargs, kw) for _ in range(args.repeats)]
                with rss_peak() as mem:
                    ran = None if args.no_run else run_seconds(fn, fargs, kw, args.repeats)
            row = {"program": name, "layer_loop": loop}
            row |= timing.Spread(tuple(a for a, _ in runs)).fields("lower_s")
            row |= timing.Spread(tuple(b for _, b in runs)).fields("compile_s")
            row |= timing.Spread(tuple(a + b for a, b in runs)).fields("total_s")
            if ran is not None:
                row |= timing.Spread(ran).fields("run_s")
                row["run_peak_rss_gb"] = None if mem["bytes"] is None else round(mem["bytes"] / 1e9, 2)
            rows.append(row)
        del lm
        jax.clear_caches()
    plat = jax.devices()[0].platform
    name = "default" if args.model is None else Path(str(args.model)).stem.split(".")[0].lower()
    meta = dict(platform=plat, device=str(jax.devices()[0]), cpu=timing.machine(),
                model=str(args.model or DEFAULT_MODEL_DIR), layers=cfg.num_layers, length=args.length,
                batch=args.batch, repeats=args.repeats, jax=jax.__version__, layer_loops=loops)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"compile_{plat}" + ("" if args.model is None else f"_{name}") + (f"_{args.tag}" if args.tag else "")
    loadavg = guard.record()
    (out / f"{stem}.json").write_text(json.dumps(guard.stamp(dict(meta=meta, rows=rows), loadavg), indent=2))
    by = {(r["program"], r["layer_loop"]): r for r in rows}
    cols = [(loop, what) for what in ("total_s", "run_s", "run_peak_rss_gb") for loop in loops
            if what == "total_s" or not args.no_run]
    head = {"total_s": "compile s", "run_s": "run s", "run_peak_rss_gb": "peak RSS GB above the process's, compiling and running"}
    lines = [f"# Compile and run seconds, {name} model ({meta['layers']} layers), {meta['device']}, "
             f"jax {jax.__version__}", "",
             f"Batch {args.batch}, {args.length}-token prompts, {NEW_TOKENS} new tokens. Each program traced, lowered and "
             "compiled "
             f"cold {args.repeats} times, then run {args.repeats} times after one untimed run (median, min–max), "
             "with its layers unrolled (`layer_loop=\"unroll\"`: every layer traced, what kvjax did before) and "
             "scanned (`\"scan\"`, the default: one body per run of layers alike; a token's step stays unrolled, "
             "`kvjax.step.Token.layer_runs`). `python -m benchmarks.compile "
             + " ".join(argv if argv is not None else __import__("sys").argv[1:]) + "`.", "",
             "| program | " + " | ".join(f"{head[w]} ({lp})" for lp, w in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for prog in names:
        lines.append(f"| {prog} | " + " | ".join(
            ("–" if by[prog, lp][w] is None else f"{by[prog, lp][w]:.2f}") if w == "run_peak_rss_gb"
            else timing.cell(by[prog, lp], w, ".1f" if w == "total_s" else ".2f") for lp, w in cols) + " |")
    lines = guard.mark(lines, args.repeats, loadavg)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main, compile_cache=False))  # compile seconds are cold compiles
