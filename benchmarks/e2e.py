"""End to end at model shapes, random weights: kvjax's policies against transformers (SDPA) and
transformers + kvpress, side by side in one run, on the same weights and device.

    python -m benchmarks.e2e                                    # the reduced CPU shape, 2K-8K prompts
    python -m benchmarks.e2e --shape llama-3.2-1b --dtype bfloat16 --lengths 4096,32768,131072 \
        --attention-impl pallas --max-batch-tokens 262144                               # a GPU
    python -m benchmarks.e2e --shape llama-3.1-8b --dtype bfloat16 --lengths 4096,32768 --attention-impl pallas
    python -m benchmarks.e2e --shape issue25 --lengths 1024,4096,16384 --batches 1 --budget 256 \
        --policies full,streaming --new 64 --compile-layers ''   # issue #25's CPU table
    python -m benchmarks.e2e --model smollm2 --batches 1 --policies full,streaming,snapkv,'snapkv chunked 512' \
        --compile-layers ''                      # the real model (python -m kvjax.models.fetch smollm2), 2K-8K prompts

Per (implementation, policy, prompt length, batch): time to first token (the prompt's prefill and the
first sampled token), decode tokens/s per row, cache bytes, peak device memory (GPU/TPU only: CPU
backends do not report it; on a CPU the peak resident memory above the idle process while the cell runs,
sampled every 5 ms), decode's share of its memory roofline (the device's read rate, measured in the run, over the
bytes a step must read: every weight and the whole cache; `benchmarks.timing.decode_roofline`) and, for kvjax, the
first call's compile seconds of prefill and decode.
`--compile-layers 16,32` adds the compile-time table of the shape at those depths. Compile seconds are first
compiles: this benchmark never uses the persistent compilation cache. Time to first token and decode speed are
the median of `--repeats` runs after a warm-up, with their range; a CPU table is refused on a busy machine
(`--max-load`, `--allow-load`; `benchmarks.timing`), and the load average before and after is under it. Cache bytes are
kvjax's whole cache (keys, values and each slot's position and statistics, decode slots included)
and the K/V tensors of transformers' cache. Writes
benchmarks/results/e2e_<platform>.{json,md,png} (e2e_<platform>_<shape>.* for a shape other than `cpu`).
The tables are rewritten after every cell, so a run cut short keeps what it measured. Numbers are
for reading, never asserted in tests. On a GPU, give JAX part of the memory and leave torch the rest
(`XLA_PYTHON_CLIENT_MEM_FRACTION=0.45`): both run in this one process. kvpress 0.5.5 needs the pinned
transformers (< 5.3): under transformers 5.17 its presses fail on the first prefill (`KeyError:
'cache_position'`), so a machine with a newer one needs transformers 5.2.0 carried with kvpress.

`--model` (a directory, a GGUF file or a fetched name such as smollm2) runs a real checkpoint instead of
random weights: transformers reads the same file (for GGUF through its own GGUF loader, which yields
the same dequantized float32 weights bit for bit, `tests/test_gguf.py`), and the results are
e2e_<platform>_<model name>.*.

Budgets: `--budget` tokens per layer and KV head for kvjax; kvpress takes a compression ratio, so it
gets `1 - budget / prompt`, the same kept count. MAT's prompt is attended whole here
(`prefill_mode="full"`): its token-by-token protocol is MAT Table 6's, in `kvjax.experiments.efficiency`.
RazorAttention protects a fixed quarter of the KV heads (random weights have no retrieval heads).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from benchmarks import timing
from benchmarks.timing import rss_peak
from kvjax.experiments.efficiency import peak_bytes
from kvjax import Sampling, engine
from kvjax.cache import nbytes
from kvjax.generate import bucket_length, check_finite_steps, decode_fn, eos_array, pad_left, prefill_fn
from kvjax.policies import FullCache, PyramidKV, RazorAttention, SnapKV, StreamingLLM, mat
from kvjax.cli import add_compile_cache_flag, description, model_help, out_dir, HelpFormatter
from kvjax.experiments.common import int_list, positive_int
from kvjax import drive
from kvjax.models import load
from kvjax.models.tiny import make_random_checkpoint, tiny_config

# Published shapes (config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B), a CPU-sized one, and the
# model of issue #25's first table (4 layers, d 256), for its prefill / decode / kvpress columns re-measured.
SHAPES = {
    "issue25": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=32),
    "cpu": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                num_kv_heads=2, head_dim=64),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128),
}


def kvjax_policies(budget: int, num_layers: int, num_kv_heads: int, chunk: int) -> dict:
    rng = np.random.default_rng(0)
    table = tuple(tuple(bool(x) for x in rng.permutation(num_kv_heads) < max(1, num_kv_heads // 4))
                  for _ in range(num_layers))
    return {
        "full": FullCache(),
        "streaming": StreamingLLM(budget=budget, sinks=4),
        "snapkv": SnapKV(budget=budget, observation_window=32, kernel=7),
        "pyramidkv": PyramidKV(budget=budget, observation_window=32, kernel=7, num_layers=num_layers),
        "mat": mat(budget, budget // 4, shallow_layers=2, sinks=4, prefill_mode="full"),
        "razor": RazorAttention(retrieval=table, buffer=budget),
        f"streaming chunked {chunk}": StreamingLLM(budget=budget, sinks=4, prefill_mode="chunked", chunk=chunk),
        f"snapkv chunked {chunk}": SnapKV(budget=budget, observation_window=32, kernel=7, prefill_mode="chunked", chunk=chunk),
    }


def _seconds(fn):
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t, out


def time_kvjax(model, prompts: np.ndarray, policy, new: int, repeats: int) -> dict:
    graphdef, state = engine.split(model)
    b, n = prompts.shape
    tokens, positions = pad_left(prompts.tolist(), bucket_length(n), 0)
    key = jax.random.key(0)
    kw = dict(plan=drive.plan(model, policy, tokens.shape[1] + new, tokens.shape[1]), sampling=Sampling())
    t = time.perf_counter()
    compiled = prefill_fn.pure.lower(graphdef, state, tokens, positions, key, **kw).compile()
    compile_prefill = time.perf_counter() - t
    pre = functools.partial(compiled, graphdef, state, tokens, positions, key)
    first, first_finite, cache = jax.block_until_ready(pre())  # the warm-up
    ttft = timing.Spread(tuple(_seconds(pre)[0] for _ in range(repeats)))
    lengths = jnp.full((b,), n, jnp.int32)
    args = (first, first_finite, lengths, key, jnp.asarray(eos_array(())), jnp.int32(new), jnp.int32(0), jnp.int32(0))
    dkw = dict(plan=kw["plan"], sampling=Sampling(), buffer=new)
    t = time.perf_counter()
    dec = decode_fn.pure.lower(graphdef, state, cache, *args, **dkw).compile()
    compile_decode = time.perf_counter() - t
    seconds, steps = [], 0
    for i in range(repeats + 1):  # the first run warms up
        c = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
        s, (out, steps, nonfinite, c) = _seconds(lambda: dec(graphdef, state, c, *args))  # noqa: B023
        check_finite_steps(np.asarray(nonfinite))
        seconds += [s] if i else []
    return {**ttft.fields("ttft_s"), **timing.Spread(tuple(seconds)).rate(int(steps) - 1).fields("decode_tok_s"),
            "cache_bytes": nbytes(c), "peak_bytes": peak_bytes(), "compile_prefill_s": compile_prefill,
            "compile_decode_s": compile_decode, "prefill_s": ttft.median}


def time_torch(model, prompts: np.ndarray, new: int, repeats: int, press=None) -> dict:
    """transformers (greedy), optionally with a kvpress press compressing the prefill, measured as kvjax is:
    the prefill forward and its first token (TTFT), then `new - 1` decode steps on a copy of its cache,
    positions continuing the prompt's as kvpress's pipeline passes them."""
    import contextlib
    import copy

    import torch
    from transformers import DynamicCache

    x = torch.tensor(prompts, device=model.device)
    b, n = x.shape
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def prefill():
        cache = DynamicCache()
        with torch.no_grad(), (press(model) if press is not None else contextlib.nullcontext()):
            # the last position's logits only, as kvjax's prefill computes (a 128K-entry vocabulary over a
            # whole 32K prompt would be 8 GiB of logits)
            out = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return first, cache

    def decode(first, cache):
        tok = first
        with torch.no_grad():
            for i in range(new - 1):
                pos = torch.full((b, 1), n + i, device=model.device)
                tok = model(tok, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1].argmax(
                    -1, keepdim=True)
        sync()
        return cache

    first, cache = prefill()  # the warm-up
    ttft = []
    for _ in range(repeats):
        t = time.perf_counter()
        first, cache = prefill()
        ttft.append(time.perf_counter() - t)
    seconds = []
    for i in range(repeats + 1):  # the first run warms up
        c = copy.deepcopy(cache)
        t = time.perf_counter()
        c = decode(first, c)
        seconds += [time.perf_counter() - t] if i else []
    kv = sum(t.numel() * t.element_size() for layer in c.layers for t in (layer.keys, layer.values))
    peak = torch.cuda.max_memory_allocated() if model.device.type == "cuda" else None
    ttft = timing.Spread(tuple(ttft))
    return {**ttft.fields("ttft_s"), **timing.Spread(tuple(seconds)).rate(new - 1).fields("decode_tok_s"),
            "cache_bytes": kv, "peak_bytes": peak, "prefill_s": ttft.median}


def compile_table(shape: dict, layers: list[int], length: int, budget: int, dtype, impl: str = "xla") -> list[dict]:
    """First-call compile seconds of prefill and decode at each depth (full, StreamingLLM, MAT)."""
    rows = []
    for n_layers in layers:
        with tempfile.TemporaryDirectory() as d:
            make_random_checkpoint(d, tiny_config(**{**shape, "num_layers": n_layers},
                                                  max_position_embeddings=2 * length), seed=0)
            model = load(d, tokenizer=False, dtype=dtype, attention_impl=impl).model
        prompts = np.random.default_rng(0).integers(4, shape["vocab_size"], (1, length))
        for name, policy in (("full", FullCache()), ("streaming", StreamingLLM(budget=budget, sinks=4)),
                             ("mat", mat(budget, budget // 4, prefill_mode="full"))):
            r = time_kvjax(model, prompts, policy, new=8, repeats=1)
            rows.append({"layers": n_layers, "policy": name, "compile_prefill_s": r["compile_prefill_s"],
                         "compile_decode_s": r["compile_decode_s"]})
    return rows


def write(out: Path, meta: dict, rows: list[dict], compile_rows: list[dict], guard: timing.LoadGuard,
          show: bool = True) -> None:
    plat = meta["platform"]
    stem = f"e2e_{plat}" if meta["shape"] == "cpu" else f"e2e_{plat}_{meta['shape']}"
    if meta.get("model"):
        stem = f"e2e_{plat}_{meta['model']}"
    loadavg = guard.record()
    (out / f"{stem}.json").write_text(json.dumps(guard.stamp({"meta": meta, "rows": rows, "compile": compile_rows},
                                                             loadavg), indent=2))
    mib = lambda x: "" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
    what = f"{meta['shape']} shape, random weights" if not meta.get("model") else f"{meta['model']}"
    lines = [f"# End to end, {what} ({meta['device']}, jax {meta['jax']})", "",
             f"Shape {meta['config']}, {meta['dtype']}, {meta['new']} new tokens, greedy; kvjax budget "
             f"{meta['budget']} per layer and KV head, kvpress the same kept count as a ratio. Time to first token "
             f"and decode speed: the median of {meta['repeats']} runs after a warm-up (min–max). Command: "
             f"`{meta['command']}`.", "",
             "| impl | policy | prompt | batch | TTFT s | decode tok/s per row | decode, % of roofline | cache MiB | "
             "peak MiB | peak RSS MiB | compile prefill s | compile decode s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        comp = [f"{r[k]:.1f}" if k in r else "" for k in ("compile_prefill_s", "compile_decode_s")]
        roof = f"{r['decode_tok_s'] / r['roofline_tok_s']:.0%}" if r.get("roofline_tok_s") else ""
        lines.append(f"| {r['impl']} | {r['policy']} | {r['prompt']} | {r['batch']} | {timing.cell(r, 'ttft_s')} | "
                     f"{timing.cell(r, 'decode_tok_s', '.1f')} | {roof} | {mib(r['cache_bytes'])} | "
                     f"{mib(r['peak_bytes'])} | {mib(r.get('rss_bytes'))} | {comp[0]} | {comp[1]} |")
    if meta.get("read_bytes_s"):
        lines += ["", f"Roofline: a decode step reads every weight ({meta['weight_bytes'] / 2**20:.0f} MiB) and the whole "
                      f"cache (the cache MiB column) once, at the device's read rate, measured in this run as "
                      f"{timing.cell(meta, 'read_bytes_s', '.1f', 1e-9)} GB/s (a compiled sum over 1 GiB, "
                      "`benchmarks.timing.read_bandwidth`); the column is decode tok/s over that bound. Near 100 %, "
                      "a faster decode must read fewer bytes (narrower weights or cache), not compute faster."]
    lines += ["", "Peak RSS: the process's peak resident memory above its level when the cell started (both "
                  "implementations share the process; the weights are loaded before), so a cell's own temporaries "
                  "and cache; the first kvjax cell of a shape includes its compilation.",
              "", "A compile time of 0.0 s: the program was compiled for an earlier cell with the same shapes (a "
                  "bounded cache does not grow with the prompt), so this prompt length compiled nothing."]
    if compile_rows:
        lines += ["", f"Compile seconds at depth ({meta['shape']} shape otherwise, a {meta['compile_length']}-token "
                      "prompt, first call: trace, lower and XLA compile):", "",
                  "| layers | policy | prefill s | decode s |", "|---|---|---|---|"]
        lines += [f"| {r['layers']} | {r['policy']} | {r['compile_prefill_s']:.1f} | {r['compile_decode_s']:.1f} |"
                  for r in compile_rows]
    lines = guard.mark(lines, meta.get("repeats"), loadavg)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if show:
        print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for impl, pol in dict.fromkeys((r["impl"], r["policy"]) for r in rows):
        mine = [r for r in rows if (r["impl"], r["policy"]) == (impl, pol) and r["batch"] == 1]
        x = [r["prompt"] for r in mine]
        axes[0].plot(x, [r["ttft_s"] for r in mine], marker="o", label=f"{impl} {pol}")
        axes[1].plot(x, [r["decode_tok_s"] for r in mine], marker="o", label=f"{impl} {pol}")
    axes[0].set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (s)")
    axes[1].set(xscale="log", xlabel="prompt tokens", ylabel="decode tokens/s (batch 1)")
    axes[1].legend(fontsize=6)
    fig.suptitle(f"{meta.get('model') or meta['shape'] + ' shape'}, {meta['device']}")
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu",
                   help="the random-weight model's shape: a named model's, issue #25's, or a reduced one (cpu)")
    p.add_argument("--model", help="a real checkpoint instead of --shape's random weights: " + model_help())
    p.add_argument("--lengths", type=int_list, default="2048,4096,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--batches", type=int_list, default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--max-batch-tokens", type=positive_int, default=16384,
                   help="cells whose batch x prompt exceeds this are skipped (the CPU's prefill time)")
    p.add_argument("--new", type=positive_int, default=32, help="tokens generated per row")
    p.add_argument("--budget", type=positive_int, default=512, help="the compressing policies' slots per KV head")
    p.add_argument("--chunk", type=positive_int, default=512, help="tokens per chunk of the chunked prompt pass")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs per cell, after a warm-up; the median is shown")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' and cache's dtype, in kvjax and transformers alike")
    p.add_argument("--compile-layers", default="16,32", help="depths of the compile-time table ('' for none)")
    p.add_argument("--policies", default="", help="kvjax policies to run, comma-separated (default: all of them); "
                   "kvpress runs the ones it has")
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="kvjax's attention: the jnp reference or the Pallas kernels (a GPU's plain prompts: cuDNN)")
    p.add_argument("--no-torch", action="store_true", help="skip transformers and kvpress: kvjax's rows alone")
    p.add_argument("--out", type=out_dir, default="benchmarks/results", help="folder for the tables and plots")
    timing.add_load_args(p)
    add_compile_cache_flag(p, measures_compile=True)
    args = p.parse_args(argv)
    guard = timing.LoadGuard(args, cpu=jax.devices()[0].platform == "cpu")  # the load before the run
    lengths, batches = args.lengths, args.batches
    if not any(n * b <= args.max_batch_tokens for n in lengths for b in batches):
        p.error(f"--max-batch-tokens {args.max_batch_tokens} is below every --lengths x --batches cell: nothing "
                "would be measured")
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    if args.model:
        from kvjax.models.loading import resolve

        ckpt = resolve(args.model)
        lm = load(ckpt, tokenizer=False, dtype=dtype, attention_impl=args.attention_impl)
        model, c = lm.model, lm.config
        shape = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        if max(lengths) + args.new > c.max_position_embeddings:
            p.error(f"--lengths {','.join(map(str, lengths))} + --new {args.new} exceed the model's "
                    f"{c.max_position_embeddings} positions")
    else:
        shape = SHAPES[args.shape]
    policies = kvjax_policies(args.budget, shape["num_layers"], shape["num_kv_heads"], args.chunk)
    if args.policies:
        chosen = [x.strip() for x in args.policies.split(",")]
        unknown = [x for x in chosen if x not in policies]
        if unknown:
            p.error(f"--policies: unknown {unknown}; choose from {sorted(policies)}")
        policies = {name: policies[name] for name in chosen}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.model:
        ckpt = Path(tempfile.mkdtemp())
        make_random_checkpoint(ckpt, tiny_config(**shape, max_position_embeddings=bucket_length(max(lengths)) + args.new),
                               seed=0, dtype=dtype)  # in the run's dtype: an 8B checkpoint in f32 is 32 GB of disk
        model = load(ckpt, tokenizer=False, dtype=dtype, attention_impl=args.attention_impl).model
    torch_model = None
    if not args.no_torch:
        import torch
        from transformers import AutoModelForCausalLM

        device = "cuda" if torch.cuda.is_available() and jax.devices()[0].platform == "gpu" else "cpu"
        where = dict(gguf_file=ckpt.name) if ckpt.is_file() else {}
        torch_model = AutoModelForCausalLM.from_pretrained(ckpt.parent if ckpt.is_file() else ckpt,
                                                           dtype=getattr(torch, args.dtype),
                                                           attn_implementation="sdpa", **where).eval().to(device)
    meta = {"platform": jax.devices()[0].platform, "device": str(jax.devices()[0]), "jax": jax.__version__,
            "cpu": timing.machine(), "shape": args.shape, "config": shape,
            "dtype": args.dtype, "new": args.new, "budget": args.budget, "compile_length": lengths[0],
            "attention_impl": args.attention_impl, "model": args.model and Path(args.model).name.removesuffix(".gguf"),
            "repeats": args.repeats,
            "command": "python -m benchmarks.e2e " + " ".join(argv if argv is not None else __import__("sys").argv[1:])}
    guard.check()  # after the model loaded: an error in the command line or the model is said first
    # the decode roofline: the device's read rate over the weights and the cache (`timing.decode_roofline`)
    bandwidth = timing.read_bandwidth(repeats=max(args.repeats, 3))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    meta |= {**bandwidth.fields("read_bytes_s"), "weight_bytes": weight_bytes}
    roofline = lambda r: {"roofline_tok_s": timing.decode_roofline(bandwidth.median, weight_bytes,  # noqa: E731
                                                                   r["cache_bytes"])}
    rows = []
    cells = [(n, b) for n in lengths for b in batches if n * b <= args.max_batch_tokens]
    for n, b in tqdm(cells, desc="cells"):
        prompts = np.random.default_rng(n + b).integers(4, shape["vocab_size"], (b, n))
        for name, policy in policies.items():
            with rss_peak() as rss:
                r = time_kvjax(model, prompts, policy, args.new, args.repeats)
            rows.append({"impl": "kvjax", "policy": name, "prompt": n, "batch": b, **r, **roofline(r),
                         "rss_bytes": rss["bytes"]})
        write(out, meta, rows, [], guard, show=False)
        if torch_model is not None:
            from kvpress import PyramidKVPress, SnapKVPress, StreamingLLMPress

            ratio = max(0.0, 1 - args.budget / n)
            with rss_peak() as rss:
                r = time_torch(torch_model, prompts, args.new, args.repeats)
            rows.append({"impl": "transformers", "policy": "full", "prompt": n, "batch": b, **r, **roofline(r),
                         "rss_bytes": rss["bytes"]})
            for name, press in (("streaming", StreamingLLMPress(compression_ratio=ratio, n_sink=4)),
                                ("snapkv", SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)),
                                ("pyramidkv", PyramidKVPress(compression_ratio=ratio, window_size=32, kernel_size=7))):
                if name not in policies:
                    continue
                with rss_peak() as rss:
                    r = time_torch(torch_model, prompts, args.new, args.repeats, press=press)
                rows.append({"impl": "kvpress", "policy": name, "prompt": n, "batch": b, **r, **roofline(r),
                             "rss_bytes": rss["bytes"]})
        write(out, meta, rows, [], guard, show=False)
    layers = [int(x) for x in args.compile_layers.split(",") if x.strip()]
    write(out, meta, rows, compile_table(shape, layers, lengths[0], args.budget, dtype, args.attention_impl)
          if layers else [], guard)


if __name__ == "__main__":
    from kvjax import cli  # a user error: one line, exit 2 (kvjax.cli)

    raise SystemExit(cli.run(main, compile_cache=False))  # its compile seconds are first compiles
