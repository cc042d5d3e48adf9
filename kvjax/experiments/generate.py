"""Generate continuations under cache policies, side by side, with the KV bytes each holds against the full cache's.

    python -m kvjax.experiments.generate                                   # full, streaming, snapkv at 64 slots
    python -m kvjax.experiments.generate --model smollm2 --compare full,snapkv --budget 128 "Why is the sky blue?"

Without --model, the embedded default model (kvjax-tiny, a 0.52 M-parameter Llama trained by
`python -m kvjax.experiments.train_tiny`); without a prompt, a passkey prompt as long as the model's window
allows, so a compressing policy has something to evict. Each policy's continuation is printed with the bytes its
compressed prompt holds, and a note where it evicted nothing. `--chat-template auto` (the default) wraps each
prompt in the tokenizer's chat template where it has one, as an instruct model expects.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    add_chat_template_arg,
    add_compare_args,
    add_run_args,
    attach_gate_params,
    chat_template_on,
    compared,
    model_help,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    probability,
    prompt_ids,
    utf8_text,
)
from kvjax.experiments.records import shown
from kvjax import FullCache, Sampling, generate_many
from kvjax.cache import PooledLayerCache, nbytes, num_slots
from kvjax.progress import Bar
from kvjax.cli import HelpFormatter


class DecodeProgress:
    """A progress bar over the generated tokens of every policy's decode loop (`generate_many` runs one loop per
    policy, each calling this with its step from 0), fed by the loops."""

    def __init__(self, total: int, rows: int):
        self.total, self.rows, self.bar = total, rows, None
        self.done, self.last = 0, -1  # steps of the loops finished before this one; this loop's last step

    def __call__(self, step: int) -> None:
        if self.bar is None:  # opened by the first token, so an error before decoding prints no bar
            self.bar = Bar(total=self.total, unit="tok", desc="decode", file=sys.stderr, leave=False)
        if step <= self.last:  # the next policy's loop started
            self.done += self.last + 1
        self.last = step
        self.bar.update(self.done + step + 1 - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def default_prompt(tok, max_position: int, max_new_tokens: int) -> str:
    """Without a prompt: a passkey prompt (`kvjax.experiments.passkey`: the key at its middle) as long as the model's
    window allows after `max_new_tokens`, so a compressing policy has something to evict."""
    from kvjax.experiments.passkey import passkey_prompt

    ids, _ = passkey_prompt(tok, max(max_position - max_new_tokens - 8, 64), 0.5, 71432)
    return tok.decode(ids[1:])  # BOS comes back with the tokenizer


def shown_prompt(text: str, width: int = 160) -> str:
    """A prompt as printed: whole when short, else its head and tail around "..."."""
    flat = " ".join(text.split())
    return f"{flat[:width]} ... {flat[-width:]}" if len(flat) > 2 * width + 5 else text


def report_cache(out, full_slots: int) -> list[str]:
    """The cache lines of one policy: its slots (per layer and KV head, and per row over layers x KV heads, against
    the full cache's), and the KV bytes its compressed prompt holds against the full cache's (in all rows), with
    what it allocated (`kvjax.cache.nbytes`: a policy that only masks allocates the full cache)."""
    held, full = int(np.sum(out.held_bytes)), int(np.sum(out.full_bytes))
    caps = sorted({g.capacity // getattr(g, "num_kv_heads", 1) if isinstance(g, PooledLayerCache) else g.capacity
                   for layer in out.cache for g in getattr(layer, "groups", (layer,))})
    return [f"cache    {'/'.join(map(str, caps))} slots per KV head and layer; {num_slots(out.cache)} slots per "
            f"sequence over layers x KV heads (full cache: {full_slots})",
            f"held     {held / 2**10:.1f} KiB of keys and values for the prompt, the full cache's {full / 2**10:.1f} KiB "
            f"({100 * held / max(full, 1):.1f} %, {full / max(held, 1):.1f}x smaller); allocated "
            f"{nbytes(out.cache) / 2**10:.1f} KiB"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.generate", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("prompt", nargs="*", type=utf8_text,
                   help="one or more prompts (a batch); default: a passkey prompt as long as the model's window "
                        "allows, the key at its middle")
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and the cache's dtype; default float32")
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="pallas: the kernels of kvjax.pallas (interpret mode on CPU: slow, for checking); default xla")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens generated per prompt; default 32")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 (the default): greedy")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling's p; default 1")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="the sampling key's seed; default 0")
    p.add_argument("--truncate", action="store_true", help="middle-truncate prompts that are too long")
    add_chat_template_arg(p)
    add_compare_args(p, default="full,streaming,snapkv", budget=64)
    add_run_args(p)
    args = p.parse_args(argv)

    lm = driver.load_model(args.model, dtype=args.dtype, attention_impl=args.attention_impl,
                           allow_nonfinite=args.allow_nonfinite, tokenizer=False)
    attach_gate_params(args, lm)
    policies = compared(p, args, lm.config.num_layers, lm.path)
    if lm.tokenizer is None:  # after the policies, whose own errors name what they lack (KVzip's replay)
        p.error(f"{lm.path} has no tokenizer files")
    tok = lm.tokenizer
    chat = chat_template_on(tok, args.chat_template)
    texts = args.prompt or [default_prompt(tok, lm.config.max_position_embeddings, args.max_new_tokens)]
    prompts = [sum(prompt_ids(tok, t, "", on=True), []) if chat else tok(t)["input_ids"] for t in texts]
    progress = DecodeProgress(args.max_new_tokens * len(policies), len(prompts))
    try:
        outs = generate_many(lm.model, prompts, list(policies.values()), max_new_tokens=args.max_new_tokens,
                             sampling=Sampling(args.temperature, args.top_p), key=jax.random.key(args.seed),
                             truncate=args.truncate, progress=progress)
    finally:
        progress.close()
    print(f"model    {shown(lm.path)}  ({lm.config.num_layers} layers, {lm.config.num_kv_heads} KV heads, {args.dtype};"
          f" chat template {'on' if chat else 'off'})")
    for ids in prompts:
        print(f"prompt   {len(ids)} tokens")
    for (label, policy), out in zip(policies.items(), outs):
        print(f"\n[{label}] {policy.describe()}")
        for text, seq in zip(texts, out.sequences()):
            print(f">>> {shown_prompt(text)}\n{tok.decode(seq, skip_special_tokens=True)}")
        max_len = out.prompt_bucket + out.room  # what a full cache would hold in this compilation
        full_slots = lm.config.num_layers * lm.config.num_kv_heads * FullCache().capacity(0, max_len, out.prompt_bucket)
        print("\n" + "\n".join(report_cache(out, full_slots)))
        if float(np.min(out.held_fraction)) >= 1 and not isinstance(policy, FullCache):
            print("note     nothing was evicted: the prompt fits in the policy's budget (pass a longer prompt or a "
                  "smaller --budget)")
    first = outs[0]
    speed = first.decode_tokens_per_s if first.decode_steps > 1 else None
    print(f"\nspeed    prompt pass (first call: compile + run) {first.prefill_s:.2f} s; decode "
          + (f"{speed:.1f} tokens/s" if speed is not None else "n/a (fewer than 3 tokens)")
          + f" ({first.decode_steps} steps x {len(prompts)} rows on {jax.devices()[0].platform}, compilation excluded; "
          f"{next(iter(policies))})")
    hint_chat(tok, chat, [o.lengths for o in outs])
    return 0


def hint_chat(tok, chat: bool, lengths: list[np.ndarray]) -> None:
    """A one-line hint when an instruct model read raw text and stopped at once: its chat template is what it was
    tuned on (`--chat-template on`, or auto)."""
    if not chat and getattr(tok, "chat_template", None) is not None and min(int(x.min()) for x in lengths) <= 2:
        print("hint     the model stopped after a token or two: its tokenizer has a chat template, which an instruct "
              "model expects; pass --chat-template on (or auto)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(cli.run(main))
