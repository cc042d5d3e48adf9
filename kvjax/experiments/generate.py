"""Generate a continuation under a cache policy and report cache size and speed.

    python -m kvjax.experiments.generate [--model DIR] --policy streaming --budget 256 "prompt"

Without --model, the embedded default model (`kvjax/models/default`, a 0.52 M-parameter Llama trained
by `python -m kvjax.experiments.train_tiny`) is used. The prompts are generated once: a progress bar
follows the decode loop, and its ticks time the decoding (compilation excluded).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    add_policy_args,
    add_run_args,
    attach_gate_params,
    model_help,
    nonnegative_float,
    nonnegative_int,
    policy_from_args,
    positive_int,
    probability,
    utf8_text,
)
from kvjax import FullCache, Sampling, generate
from kvjax.cache import PooledLayerCache, kept_positions, nbytes, num_slots


class DecodeProgress:
    """A tqdm bar over the generated tokens, fed by the decode loop; remembers when each tick came,
    so decode speed is measured on the run itself rather than on a second, timed run."""

    def __init__(self, total: int, rows: int):
        self.total, self.rows, self.ticks, self.bar = total, rows, [], None

    def __call__(self, step: int) -> None:
        self.ticks.append((step, time.perf_counter()))
        if self.bar is None:  # opened by the first token, so an error before decoding prints no bar
            self.bar = tqdm(total=self.total, unit="tok", desc="decode", file=sys.stderr, leave=False)
        self.bar.update(step + 1 - self.bar.n)

    def tokens_per_s(self) -> float | None:
        """Generated tokens per second over the batch, between the first and the last tick."""
        if len(self.ticks) < 2:
            return None
        (s0, t0), (s1, t1) = self.ticks[0], self.ticks[-1]
        return self.rows * (s1 - s0) / max(t1 - t0, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.generate", description=cli.description(__doc__))
    p.add_argument("prompt", nargs="*", type=utf8_text, default=["The attention sink is"],
                   help="one or more prompts (a batch)")
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="pallas: the kernels of kvjax.pallas (interpret mode on CPU: slow, for checking)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--truncate", action="store_true", help="middle-truncate prompts that are too long")
    add_policy_args(p)
    add_run_args(p)
    args = p.parse_args(argv)

    lm = driver.load_model(args.model, dtype=args.dtype, attention_impl=args.attention_impl,
                           allow_nonfinite=args.allow_nonfinite, tokenizer=False)
    attach_gate_params(args, lm)
    policy = policy_from_args(args, num_layers=lm.config.num_layers, model_dir=lm.path)
    path = lm.path
    if lm.tokenizer is None:  # after the policy, whose own error names what it lacks (KVzip's replay)
        p.error(f"{path} has no tokenizer files")
    tok = lm.tokenizer
    prompts = [tok(t)["input_ids"] for t in args.prompt]
    sampling = Sampling(args.temperature, args.top_p)
    progress = DecodeProgress(args.max_new_tokens, len(prompts))
    try:
        out = generate(lm.model, prompts, policy, max_new_tokens=args.max_new_tokens, sampling=sampling,
                       key=jax.random.key(args.seed), truncate=args.truncate, progress=progress)
    finally:
        progress.close()

    max_len = out.prompt_bucket + out.room  # what a full cache would hold in this compilation
    full_slots = lm.config.num_layers * lm.config.num_kv_heads * FullCache().capacity(0, max_len, out.prompt_bucket)
    print(f"model    {path}  ({lm.config.num_layers} layers, {lm.config.num_kv_heads} KV heads, {args.dtype})")
    print(f"policy   {policy.describe()}")
    for text, seq in zip(args.prompt, out.sequences()):
        print(f"\n>>> {text}\n{tok.decode(seq, skip_special_tokens=True)}")
    # a pool shared by a layer's KV heads (AdaKV) holds its heads' slots together: per head, its average
    caps = sorted({g.capacity // getattr(g, "num_kv_heads", 1) if isinstance(g, PooledLayerCache) else g.capacity
                   for layer in out.cache for g in getattr(layer, "groups", (layer,))})
    held = sum(int(np.sum(p >= 0)) for p in kept_positions(out.cache)) / len(prompts)
    print(
        f"\ncache    {'/'.join(map(str, caps))} slots per KV head and layer; {num_slots(out.cache)} slots "
        f"per sequence over layers x KV heads (full cache: {full_slots}), {held:.0f} holding a token; "
        f"{nbytes(out.cache) / 2**20:.3f} MiB for the batch of {len(prompts)}"
    )
    speed = progress.tokens_per_s()
    print(
        f"speed    prefill (first call: compile + run) {out.prefill_s:.2f} s; decode "
        + (f"{speed:.1f} tokens/s" if speed is not None else "n/a (fewer than 3 tokens)")
        + f" ({out.decode_steps} steps x {len(prompts)} rows on {jax.devices()[0].platform}, compilation excluded)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
