"""Chunked prefill on the CPU, measured side by side in one run on kvjax-small (`kvjax/models/small`):

1. StreamingLLM perplexity over a 64K-token text (rolling positions, budget 256, 4 sinks), read token
   by token (`prefill_mode="stream"`, the paper's protocol) and in chunks of 512 (the same numbers):
   seconds, compilation included, and the largest difference between the two log-probabilities.
2. Prefill of one prompt of 4K .. 128K tokens under SnapKV (budget 256, window 32): the whole prompt
   attended at once (`prefill_mode="full"`) against chunks of 512 (`engine.chunks`, one
   compiled step looped on the host). Seconds (the median of `--repeats` after a compiling call, with their
   range), the
   compiled programs' device memory from XLA's memory analysis (arguments + outputs + temporaries),
   and the process's peak RSS, each (mode, length) in a fresh subprocess.

    python -m benchmarks.chunked [--lengths 4096,...,131072] [--full-up-to 32768] [--out benchmarks/results]

Whole-prompt prefills longer than `--full-up-to` are compiled for their memory figure but not run (on
2 CPU cores one would take tens of minutes). Seconds that include compilation are first compiles: this
benchmark never uses the persistent compilation cache. The table is refused on a busy machine (`--max-load`,
`--allow-load`; `benchmarks.timing`). Writes chunked_cpu.{json,md,png}. Numbers are for reading, never
asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import timing
from kvjax.cli import add_compile_cache_flag, description, out_dir, HelpFormatter
from kvjax import drive

LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
CHUNK = 512


def _model():
    from kvjax.models import SMALL_DIR, load

    return load(SMALL_DIR)


def perplexity_text(lm, n: int) -> list[int]:
    """`n` tokens of the library text (training and held-out documents, repeated if need be)."""
    from kvjax.experiments import corpus

    docs = [t for split in ("heldout", "train") for _, t in (*corpus.doc_documents(split),
                                                             *corpus.code_documents(split))]
    text, chars = [], 0
    for d in docs:  # about 3 characters a token: tokenise only what is needed
        text.append(d)
        chars += len(d)
        if chars > 6 * n:
            break
    ids = lm.tokenizer("\n\n".join(text))["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


def streaming_perplexity(n: int) -> dict:
    from kvjax.policies import StreamingLLM
    from kvjax.scoring import logprobs

    lm = _model()
    ids = perplexity_text(lm, n)
    out = {}
    for mode, chunk in (("chunked", CHUNK), ("stream", None)):
        policy = StreamingLLM(budget=256, sinks=4, positions="rolling", prefill_mode=mode, chunk=chunk)
        t = time.perf_counter()
        lp = logprobs(lm.model, ids, policy)
        out[mode] = {"seconds": time.perf_counter() - t, "ppl": float(np.exp(-lp.mean())), "logprobs": lp}
    diff = float(np.max(np.abs(out["stream"]["logprobs"] - out["chunked"]["logprobs"])))
    return {"tokens": n, "chunk": CHUNK, "max_abs_logprob_diff": diff,
            **{m: {k: v for k, v in r.items() if k != "logprobs"} for m, r in out.items()}}


def one_prefill(mode: str, length: int, repeats: int, run: bool) -> dict:
    """Run in a subprocess: memory analysis, seconds (if `run`) and peak RSS of one prefill."""
    import jax
    import jax.numpy as jnp

    from kvjax import engine
    from kvjax.policies import SnapKV

    lm = _model()
    model = lm.model
    rng = np.random.default_rng(length)
    tokens = rng.integers(4, model.cfg.vocab_size, (1, length)).astype(np.int32)
    positions = np.arange(length, dtype=np.int32)[None]
    graphdef, state = engine.split(model)
    max_len = length + 1
    if mode == "full":
        policy = SnapKV(budget=256)
        plan = drive.plan(model, policy, max_len, length)
        compiled = engine.prefill.pure.lower(graphdef, state, tokens, positions, plan=plan).compile()
        call = lambda: engine.prefill(model, jnp.asarray(tokens), jnp.asarray(positions), plan=plan)  # noqa: E731
    else:
        policy = SnapKV(budget=256, prefill_mode="chunked", chunk=CHUNK)
        cache = jax.eval_shape(lambda: drive.empty_cache(model, drive.plan(model, policy, max_len, length), 1))
        chunk = jax.ShapeDtypeStruct((1, CHUNK), jnp.int32)
        plan = drive.plan(model, policy, max_len, length)
        compiled = engine.chunk.pure.lower(graphdef, state, chunk, chunk, cache, plan=plan).compile()
        call = lambda: engine.chunks(model, tokens, positions, plan)  # noqa: E731
    mem = compiled.memory_analysis()
    out = {"mode": mode, "length": length,
           "xla_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes),
           "xla_temp_bytes": int(mem.temp_size_in_bytes)}
    if run:
        t = time.perf_counter()
        jax.block_until_ready(call())
        out["first_call_s"] = time.perf_counter() - t  # compilation included
        out |= timing.repeat(lambda: jax.block_until_ready(call()), repeats, warmup=0).fields("seconds")
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def write(out: Path, result: dict, guard: timing.LoadGuard) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    loadavg = guard.record()
    (out / "chunked_cpu.json").write_text(json.dumps(guard.stamp(result, loadavg), indent=2) + "\n")
    pp = result["perplexity"]
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    lines = [f"# Chunked prefill, {result['device']} ({result['date']})", "",
             f"Model: kvjax-small (6 layers, d 128, 4 / 2 heads), float32. Command: `{result['command']}`.", "",
             f"## StreamingLLM perplexity over {pp['tokens']} tokens (rolling positions, budget 256, 4 sinks)", "",
             "| read | seconds (one run, compilation included) | perplexity |", "|---|---|---|",
             f"| token by token (stream) | {pp['stream']['seconds']:.1f} | {pp['stream']['ppl']:.4f} |",
             f"| chunks of {pp['chunk']} | {pp['chunked']['seconds']:.1f} | {pp['chunked']['ppl']:.4f} |", "",
             f"Chunked is **{pp['stream']['seconds'] / pp['chunked']['seconds']:.1f}x** faster; the largest "
             f"difference between the two runs' log-probabilities is {pp['max_abs_logprob_diff']:.2e} "
             "(float32 summation order).", "",
             "## SnapKV prefill (budget 256, window 32): whole prompt vs chunks of 512", "",
             "| prompt tokens | full: s | chunked: s | full: XLA MiB | chunked: XLA MiB | full: peak RSS MiB | "
             "chunked: peak RSS MiB |", "|---|---|---|---|---|---|---|"]
    rows = {(r["mode"], r["length"]): r for r in result["prefill"]}
    for n in result["lengths"]:
        f, c = rows[("full", n)], rows[("chunked", n)]
        sec = lambda r: timing.cell(r, "seconds", ".2f") or "not run"  # noqa: E731
        lines.append(f"| {n} | {sec(f)} | {sec(c)} | {mib(f['xla_bytes'])} | {mib(c['xla_bytes'])} | "
                     f"{mib(f['peak_rss_bytes'])} | {mib(c['peak_rss_bytes'])} |")
    lines += ["", "XLA MiB: the compiled program's arguments (weights, cache, prompt) + outputs + temporaries; for "
              "chunked, the one chunk step every length reuses. Peak RSS: the whole process (Python, jax, the "
              "model, compilation), in a fresh subprocess per cell; for an unrun cell, compilation only."]
    lines = guard.mark(lines, result.get("repeats"), loadavg)
    (out / "chunked_cpu.md").write_text("\n".join(lines) + "\n")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode in ("full", "chunked"):
        pts = [(n, rows[(mode, n)]["seconds"]) for n in result["lengths"] if "seconds" in rows[(mode, n)]]
        if pts:
            a.plot(*zip(*pts), marker="o", label=mode)
        b.plot(result["lengths"], [rows[(mode, n)]["xla_bytes"] / 2**20 for n in result["lengths"]], marker="o",
               label=f"{mode}: XLA")
        b.plot(result["lengths"], [rows[(mode, n)]["peak_rss_bytes"] / 2**20 for n in result["lengths"]],
               marker="x", ls=":", label=f"{mode}: peak RSS")
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="prefill seconds", title="SnapKV prefill")
    b.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="MiB", title="memory")
    a.legend(fontsize=8)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "chunked_cpu.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chunked", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                   help="prompt lengths in tokens of the SnapKV prefill table, comma-separated")
    p.add_argument("--full-up-to", type=int, default=32768, help="longest whole-prompt prefill actually run")
    p.add_argument("--perplexity-tokens", type=int, default=65536,
                   help="tokens of the text StreamingLLM's perplexity is measured over")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed prefills per cell after a compiling call; the median is shown, with the range")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    p.add_argument("--cell", help=argparse.SUPPRESS)  # internal: mode,length,run (one subprocess)
    timing.add_load_args(p)
    add_compile_cache_flag(p, measures_compile=True)
    args = p.parse_args(argv)
    if args.cell:
        mode, n, run = args.cell.split(",")
        print(json.dumps(one_prefill(mode, int(n), args.repeats, run == "1")))
        return 0
    guard = timing.LoadGuard(args, cpu=True)  # kvjax-small on the CPU: this table is a CPU table
    guard.check()
    from tqdm import tqdm

    lengths = [int(x) for x in args.lengths.split(",")]
    cells = []
    for mode in ("chunked", "full"):
        for n in tqdm(lengths, desc=f"prefill {mode}"):
            run = mode == "chunked" or n <= args.full_up_to
            res = subprocess.run([sys.executable, "-m", "benchmarks.chunked", "--repeats", str(args.repeats),
                                  "--cell", f"{mode},{n},{int(run)}"], capture_output=True, text=True, check=True)
            cells.append(json.loads(res.stdout.strip().splitlines()[-1]))
    result = {"device": f"CPU ({timing.machine()})",
              "date": time.strftime("%Y-%m-%d"), "command": "python -m benchmarks.chunked " + " ".join(argv or sys.argv[1:]),
              "repeats": args.repeats, "lengths": lengths, "prefill": cells,
              "perplexity": streaming_perplexity(args.perplexity_tokens)}
    write(Path(args.out), result, guard)
    print((Path(args.out) / "chunked_cpu.md").read_text())
    return 0


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main, compile_cache=False))  # its seconds with compilation are first compiles
