"""Generate a continuation under a cache policy and report cache size and speed.

    python -m experiments.generate --model DIR --policy streaming --budget 256 "prompt"

Without --model, a tiny randomly initialised Llama is created locally and used
(its output is noise: it demonstrates the pipeline, not a language model).
"""

from __future__ import annotations

import argparse
import sys

import jax

from experiments.common import (
    add_policy_args,
    attach_gate_params,
    default_model_dir,
    policy_from_args,
)
from kvjax import FullCache, Sampling, generate
from kvjax.cache import nbytes, num_slots
from models import load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.generate", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="*", default=["The attention sink is"], help="one or more prompts (a batch)")
    p.add_argument("--model", help="local Hugging Face directory (default: a tiny random model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="pallas: the kernels of kvjax.pallas (interpret mode on CPU: slow, for checking)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--truncate", action="store_true", help="middle-truncate prompts that are too long")
    add_policy_args(p)
    args = p.parse_args(argv)

    if args.model:
        path, random_weights = args.model, False
    else:
        path, random_weights = default_model_dir()
    lm = load(path, dtype=args.dtype, attention_impl=args.attention_impl)
    attach_gate_params(args, lm.model)
    policy = policy_from_args(args, num_layers=lm.config.num_layers)
    if random_weights:
        print("NOTE: RANDOM WEIGHTS - the default model is a tiny randomly initialised Llama "
              f"({path}); its text is noise. Pass --model DIR for a real checkpoint.\n")
    if lm.tokenizer is None:
        print(f"error: {path} has no tokenizer files", file=sys.stderr)
        return 2
    tok = lm.tokenizer
    prompts = [tok(t)["input_ids"] for t in args.prompt]
    sampling = Sampling(args.temperature, args.top_p)
    kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, key=jax.random.key(args.seed), truncate=args.truncate)
    warm = generate(lm.model, prompts, policy, **kw)  # compiles
    out = generate(lm.model, prompts, policy, **kw)  # timed, compiled

    max_len = out.prompt_bucket + args.max_new_tokens
    full_slots = lm.config.num_layers * lm.config.num_kv_heads * FullCache().capacity(0, max_len, out.prompt_bucket)
    print(f"model    {path}  ({lm.config.num_layers} layers, {lm.config.num_kv_heads} KV heads, {args.dtype})")
    print(f"policy   {policy.describe()}")
    for text, seq in zip(args.prompt, out.sequences()):
        print(f"\n>>> {text}\n{tok.decode(seq, skip_special_tokens=True)}")
    caps = sorted({g.capacity for layer in out.cache for g in getattr(layer, "groups", (layer,))})
    print(
        f"\ncache    {'/'.join(map(str, caps))} slots per KV head and layer; {num_slots(out.cache)} slots "
        f"per sequence over layers x KV heads (full cache: {full_slots}); "
        f"{nbytes(out.cache) / 2**20:.3f} MiB for the batch of {len(prompts)}"
    )
    print(
        f"speed    first call (compile + run) {warm.prefill_s + warm.decode_s:.2f} s; "
        f"prefill {out.prefill_s * 1e3:.1f} ms; decode {out.decode_tokens_per_s:.1f} tokens/s "
        f"({out.decode_steps} steps x {len(prompts)} rows on {jax.devices()[0].platform})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
