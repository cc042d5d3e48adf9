"""Continual pre-training of an AnLLM (anchor-based attention, eq. 4) and saving it as a HF directory.

    python -m kvjax.experiments.train_anllm --model DIR --variant ep|ac --out DIR [--data a.txt b.txt] [--steps 100]

AnLLM-EP: the anchors are existing tokens (default the period "."). AnLLM-AC: a new
`<AC>` token is appended after every sentence of the data; it is added to the
tokenizer and the embedding (initialised from the embedding mean, or --ac-init
period for the official code's copy of "."). Without --data the text is Python's
own English reference documentation (`pydoc_data.topics`), so the command runs
offline. Training never reads the held-out part of the text (`kvjax.experiments.common.split_text`:
the held-out topics of the default text, which the zero-shot, LongBench and perplexity suites
read, or the last fifth of --data). The run resumes from OUT/training if it was interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    SPLIT_RULE,
    add_run_args,
    model_help,
    split_text,
    windows,
)
from kvjax.experiments.records import training_identity, write_atomic
from kvjax.anllm_anchors import (
    anchor_flags,
    anchor_mask,
    parse_placement,
    place_anchors,
    with_ac,
)
from kvjax.errors import InvalidInput
from kvjax.train import TrainConfig, next_token_loss, train
from kvjax.models.loading import save_pretrained
from kvjax.models.vocab import add_ac_token
from kvjax import drive
from kvjax.cli import HelpFormatter

# Sentences the anchor string is appended to, to see which id it gets at the end of a sentence.
ANCHOR_PROBES = ("The sky is blue", "It ends here", "word", "A b c")


def anchor_ids_of(tokenizer, anchors: list[str]) -> tuple[int, ...]:
    """The id each anchor string has where AnLLM-EP uses it: ending a sentence.

    Tokenized alone, "." is not that token on SentencePiece / Metaspace tokenizers (Llama-2, the
    paper's model): a bare "." becomes "▁.", while "blue." ends with ".". So the id is read off a
    sentence with the anchor appended: the one token it adds after the sentence's own tokens."""
    ids = []
    for a in anchors:
        for probe in ANCHOR_PROBES:
            base = tokenizer(probe, add_special_tokens=False)["input_ids"]
            full = tokenizer(probe + a, add_special_tokens=False)["input_ids"]
            if len(full) == len(base) + 1 and full[: len(base)] == base:
                ids.append(full[-1])
                break
        else:
            raise InvalidInput(f"anchor {a!r} is not one token at the end of a sentence for this tokenizer (e.g. "
                               f"{probe + a!r} -> {tokenizer.convert_ids_to_tokens(full)}); an anchor must be one")
    return tuple(ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.train_anllm", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help=model_help())
    p.add_argument("--variant", choices=["ep", "ac"], required=True,
                   help="ep: existing tokens (--anchor-tokens) are the anchors; ac: a new <AC> token (see --placement)")
    p.add_argument("--out", required=True,
                   help="the trained model's HF directory; a killed run resumes from OUT/training")
    p.add_argument("--data", nargs="*", help="text files (default: pydoc_data.topics)")
    p.add_argument("--anchor-tokens", nargs="+", default=["."], help="AnLLM-EP: anchor token strings")
    p.add_argument("--ac-init", choices=["mean", "period"], default="mean",
                   help="AnLLM-AC: <AC>'s initial embedding: the embeddings' mean, or the period's (the official code)")
    p.add_argument("--placement", default="sentence",
                   help="AnLLM-AC: where <AC> goes: sentence (after each sentence), or Table 3's every:N (after every "
                        "N tokens) and random:p (after each token with probability p)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (AdamW; constant after the warm-up)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up from 0")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    p.add_argument("--batch", type=int, default=4, help="windows per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute over float32 master weights")
    p.add_argument("--trainable", nargs="*", default=[], help="regexes of parameter paths to train (default all)")
    p.add_argument("--save-every", type=int, default=50,
                   help="steps between checkpoints in OUT/training (a killed run resumes from the last)")
    p.add_argument("--seed", type=int, default=0,
                   help="the random seed of the window order (and of --placement random:p)")
    add_run_args(p)
    args = p.parse_args(argv)

    lm = driver.load_model(args.model, allow_nonfinite=args.allow_nonfinite)
    model, tok = lm.model, lm.tokenizer
    # never the held-out text: an evaluation of the model on windows of the same text scores only that
    text = split_text(args.data)[0]
    try:
        placement = parse_placement(args.placement)[0]
    except ValueError as err:
        raise InvalidInput(f"--placement {args.placement}: {err}") from None
    if args.variant == "ep" and placement != "sentence":
        raise InvalidInput(f"--placement {args.placement} needs --variant ac: EP's anchor is the sentence-final token")
    if args.variant == "ac":
        model, tok, ac = add_ac_token(model, tok, init=args.ac_init)
        anchor_ids = (ac,)
        if placement == "sentence":
            ids = tok(with_ac(text), add_special_tokens=False)["input_ids"]
        else:
            ids = place_anchors(tok(text, add_special_tokens=False)["input_ids"], ac, args.placement, args.seed)
    else:
        anchor_ids = anchor_ids_of(tok, args.anchor_tokens)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    data = windows(ids, args.seq_len)
    order = np.random.default_rng(args.seed).permutation(len(data))

    def batch(i):  # a pure function of the micro-batch index: resuming replays nothing
        rows = order[(np.arange(args.batch) + i * args.batch) % len(order)]
        return {"tokens": jnp.asarray(data[rows])}

    def loss(m, b):
        t = b["tokens"]
        flags = anchor_flags(t, anchor_ids)
        return next_token_loss(drive.logits(m, t, anchors=anchor_mask(flags)), t), {"anchor_share": jnp.mean(flags)}

    cfg = TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup, accum=args.accum,
                      compute_dtype="bfloat16" if args.bf16 else None, trainable=tuple(args.trainable),
                      save_every=args.save_every)
    out = Path(args.out)
    result = train(model, batch, loss, cfg, out / "training",
                   identity=training_identity(args, models=("model",), files=("data",), skip=("steps",))
                   | {"held-out text": SPLIT_RULE})
    save_pretrained(result.model, out, tokenizer=tok)
    cfg_file = out / "config.json"
    meta = json.loads(cfg_file.read_text())
    meta["kvjax_anllm"] = {"variant": args.variant, "anchor_ids": list(anchor_ids), "placement": args.placement}
    write_atomic(cfg_file, json.dumps(meta, indent=2))
    h = result.history
    print(f"trained  {len(h)} steps on {len(data)} windows of {args.seq_len} tokens; loss {h[0]['loss']:.3f} -> "
          f"{h[-1]['loss']:.3f}; anchors {list(anchor_ids)} ({args.variant})")
    print(f"wrote    {out} (HF directory) and {out / 'training' / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
