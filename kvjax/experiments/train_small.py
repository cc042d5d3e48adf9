"""Trains kvjax-small: the embedded default grown deeper and taught a 2048-token context.

    python -m kvjax.experiments.train_small [--out kvjax/models/small] [--init kvjax/models/default]

1. the trained default model (`--init`, 2 layers, 512 tokens) is grown to `--layers` by block
   expansion (`kvjax.models.grow`: copies with zeroed output projections, so training starts from a model
   that retrieves), and its RoPE base is raised for the longer context (NTK-aware: theta * s^(d/(d-2))
   for s = seq_len / 512, so the slowest dimensions turn no further at 2048 than they did at 512);
2. a short stage trains all layers on 512-token rows, a long stage on `--seq-len` rows, each row
   one task of a random span (so every length up to the row is seen) after natural text; an optional
   third stage (`--extend-steps`) goes on at `--seq-len` from the long stage's model (or from a trained
   model, `--from`), with its own schedule (`--extend-lr`), more suite rows, a second pool of suite
   prompts drawn with another seed, and spans from the upper half of the context only: the long stage's
   spans are uniform from the shortest task up, so a key ~2000 tokens before its question is rare there
   (the committed model's passkey at 2040 tokens: 38 % at depth 0, 100 % at depths 0.75-1); its row kinds
   can be changed (`--extend-mixture`), and its key-value rows made question-dense (`--extend-kv-queries N`:
   N lookups on a table of 4-199 lines instead of 1-3 on a table filling the span) and its fact rows too
   (`--extend-fact-queries N`: N questions on 3-16 made-up facts instead of one on 1-3);
3. besides the default's tasks, a share of rows (`MIXTURE.suite`) are whole prompts of the
   evaluation suites in their own templates, with their answers: the LongBench-format datasets
   built from the *training* split of the library text, and RULER's niah / vt / cwe / fwe tasks
   drawn with seeds the evaluation never uses; this is how a 1 M-parameter model learns task formats
   a large model follows from instructions.

Every batch is a pure function of (seed, step); each stage resumes from its checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from kvjax.experiments import cli, corpus
from kvjax.experiments.common import nonnegative_int, positive_float, positive_int
from kvjax.experiments.records import dumps_finite, training_identity, write_atomic
from kvjax.experiments.tasks import (
    EXTEND_MIXTURE,
    MIXTURE,
    RowSampler,
    mixture,
    mixture_text,
)
from kvjax.experiments.train_tiny import tokenize_corpus
from kvjax.errors import MissingFile
from kvjax.rope import RopeConfig
from kvjax.train import TrainConfig, next_token_loss, train, write_curve
from kvjax.models import load
from kvjax.models.grow import grow_depth
from kvjax.models.loading import save_pretrained
from kvjax import drive
from kvjax.cli import HelpFormatter

RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
TRAIN_SEED = 1_000_003  # RULER samples for training: never the evaluation's seed (42)


def ntk_theta(theta: float, scale: float, head_dim: int) -> float:
    """The RoPE base that stretches the slowest frequency by `scale` (NTK-aware scaling, bloc97 2023)."""
    return theta * scale ** (head_dim / (head_dim - 2))


# The model's answer as the metric reads it: the number after "is", the name or the
# count after "Answer:", the next line of code.
ANSWER_FORMS = {"stdlib_passkey": " {}.", "stdlib_kv_retrieval": " {}.", "stdlib_qa": " {}", "stdlib_lcc": "{}\n",
                "stdlib_paragraph_kv": " {}.", "stdlib_marker_count": " {}"}


def suite_examples(tok, seq_len: int, samples: int, seed: int):
    """(task, prompt text, answer text, references) of the evaluation suites' tasks, from training text and
    seeds: the LongBench-format datasets at every scale that fits `seq_len`, RULER's tasks at its lengths."""
    from kvjax.experiments.longbench import suite
    from kvjax.experiments.longbench.harness import build_prompt
    from kvjax.experiments.ruler import tasks as ruler

    scales = [s for s in (1, 2, 4, 8) if s * 512 <= seq_len]
    for k, (name, build) in enumerate(tqdm(suite.BUILDERS.items(), desc="suite prompts")):
        for scale in scales:
            for row in build(np.random.default_rng([seed, k, scale]), samples, split="train", scale=scale):
                answer = ANSWER_FORMS.get(name, "{}").format(row["answers"][0])
                yield name, build_prompt(tok, name, row, 10**9, chat=False), answer, row["answers"]
    count = ruler.token_counter(tok)
    lengths = [n for n in (768, 1024, 1536, 2048, 3072, 4096) if n <= seq_len]
    for k, name in enumerate(tqdm(RULER_TASKS, desc="RULER prompts")):
        for n in lengths:
            try:
                drawn = ruler.generate(name, n, samples, count, seed=TRAIN_SEED + 100_000 * seed + 1000 * k + n)
            except ValueError:  # does not fit at this length with this tokenizer (vt, cwe below 2048)
                continue
            for s in drawn:
                yield name, s.prompt, " " + " ".join(s.outputs) + ("." if name.startswith("niah") else ""), s.outputs


def suite_prompts(tok, seq_len: int, samples: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`suite_examples` as (prompt ids, answer ids + EOS): the model learns to stop after its answer,
    as F1-scored answers need."""
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [(enc(prompt), enc(answer) + [tok.eos_token_id])
            for _, prompt, answer, _ in suite_examples(tok, seq_len, samples, seed)]


def cached_pool(path: Path, tok, seq_len: int, samples: int, seed: int) -> list:
    """`suite_prompts`, built once and kept in `path` (tokenizing RULER's haystacks takes minutes)."""
    if path.is_file():
        return json.loads(path.read_text())
    pool = suite_prompts(tok, seq_len, samples, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(pool))
    return pool


def batches(args, sampler: RowSampler, short: RowSampler, lo: int, extend: RowSampler | None = None):
    """Step i -> {"tokens", "weights"}: the short stage's rows for i < --short-steps, then the long stage's,
    then (from --short-steps + --long-steps) the extension's. Task spans are uniform in [lo, row length),
    the extension's in [row length / 2, row length)."""

    def batch(i: int) -> dict:
        rng = np.random.default_rng([args.seed, i])
        if i < args.short_steps:
            s, n, first = short, args.short_batch, lo
        elif i < args.short_steps + args.long_steps or extend is None:
            s, n, first = sampler, args.long_batch, lo
        else:
            s, n, first = extend, args.long_batch, max(lo, extend.seq_len // 2)
        rows = [s.row(rng, int(rng.integers(first, s.seq_len))) for _ in range(n)]
        return {"tokens": jnp.asarray(np.stack([r[0] for r in rows])),
                "weights": jnp.asarray(np.stack([r[1] for r in rows]))}

    return batch


def checked(convert):
    """An argparse type that validates with `convert` and keeps the text (so the run's record stays JSON)."""
    def check(text: str) -> str:
        convert(text)
        return text
    return check


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.train_small", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="a new directory for the trained model (to replace the committed "
                                                 "kvjax-small, --out kvjax/models/small)")
    p.add_argument("--init", default="kvjax/models/default", help="the trained model to grow (an HF directory)")
    p.add_argument("--from", dest="from_", metavar="DIR",
                   help="a trained kvjax-small (an HF directory with its eval.json) to run only the extension "
                        "on: no growth, no short or long stage (needs --extend-steps); an extended one is "
                        "extended further, with the rows after its extension's")
    p.add_argument("--layers", type=positive_int, default=4, help="a multiple of --init's layers")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="the long stage's rows = the context")
    p.add_argument("--rope-theta", type=float, help="default: NTK-aware for --seq-len over --init's context")
    p.add_argument("--short-steps", type=positive_int, default=1000,
                   help="optimizer steps of the short stage (rows of --init's context)")
    p.add_argument("--short-batch", type=positive_int, default=8, help="rows per step of the short stage")
    p.add_argument("--long-steps", type=positive_int, default=400,
                   help="optimizer steps of the long stage (rows of --seq-len)")
    p.add_argument("--long-batch", type=positive_int, default=2,
                   help="rows per step of the long stage and the extension")
    p.add_argument("--extend-steps", type=nonnegative_int, default=0,
                   help="a third stage at --seq-len from the long stage's model (0: none)")
    p.add_argument("--extend-lr", type=positive_float, default=5e-4,
                   help="the extension's peak learning rate (AdamW, linear warm-up, then cosine decay)")
    p.add_argument("--extend-mixture", type=checked(mixture), default=mixture_text(EXTEND_MIXTURE), metavar="KIND=SHARE,...",
                   help="the extension's row kinds (unnamed kinds: 0), e.g. kv=0.45,suite=0.2,text=0.1,"
                        "passkey=0.1,facts=0.1,induction=0.05; default: " + mixture_text(EXTEND_MIXTURE))
    p.add_argument("--extend-kv-queries", type=nonnegative_int, default=0, metavar="N",
                   help="the extension's key-value rows: N > 0 asks N questions on a table of 4-199 lines; "
                        "0 (default) fills the span with the table and asks 1-3")
    p.add_argument("--extend-fact-queries", type=nonnegative_int, default=0, metavar="N",
                   help="the extension's fact rows: N > 0 asks N questions on 3-16 facts hidden in text; "
                        "0 (default) hides 1-3 and asks one")
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="peak learning rate of the short and long stages (AdamW, linear warm-up, then cosine decay)")
    p.add_argument("--warmup", type=int, default=50,
                   help="steps of linear learning-rate warm-up at the start of each stage")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's weight decay")
    p.add_argument("--answer-weight", type=float, default=4.0, help="loss weight of the tokens a task asks for")
    p.add_argument("--suite-samples", type=positive_int, default=48, help="pool prompts per (task, size)")
    p.add_argument("--save-every", type=positive_int, default=50,
                   help="steps between checkpoints in OUT/training (a killed run resumes from the last)")
    p.add_argument("--seed", type=int, default=0, help="the random seed of the training rows and the suite prompts")
    p.add_argument("--no-eval", action="store_true", help="skip the model card's evaluation")
    cli.add_compile_cache_flag(p)
    args = p.parse_args(argv)
    if args.from_ and not args.extend_steps:
        p.error(f"--from {args.from_} runs only the extension stage: pass --extend-steps N (N > 0)")
    return args


# the options a --from run takes from the base model's recorded training (so that its rows are those the
# whole run with --extend-steps would draw); the rest are the extension's own
EXTENSION_OPTIONS = {"out", "from_", "extend_steps", "extend_lr", "extend_mixture", "extend_kv_queries",
                     "extend_fact_queries", "save_every", "no_eval"}


def continued(args) -> tuple[argparse.Namespace, dict]:
    """For `--from DIR`: the arguments of DIR's recorded training with this run's extension options, and
    that record (`eval.json`'s "training")."""
    card = Path(args.from_) / "eval.json"
    if not card.is_file():
        raise MissingFile(f"--from {args.from_}: no eval.json there (the record of how it was trained)")
    base = json.loads(card.read_text())["training"]
    merged = {**base["args"], **{k: v for k, v in vars(args).items() if k in EXTENSION_OPTIONS}}
    # an extended model is extended further with the rows after its own extension's
    merged["extend_offset"] = base["args"].get("extend_offset", 0) + base["args"].get("extend_steps", 0)
    return argparse.Namespace(**{**vars(args), **merged}), base


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    base = None
    if args.from_:
        args, base = continued(args)
    out, work = Path(args.out), Path(args.out) / "training"
    init = load(args.from_ or args.init)
    tok, cfg0 = init.tokenizer, init.config
    if base is None:
        short_len = cfg0.max_position_embeddings
        theta = args.rope_theta or ntk_theta(cfg0.rope.theta, args.seq_len / short_len, cfg0.head_dim)
        model = grow_depth(init.model, args.layers, rope=RopeConfig(theta=theta),
                           max_position_embeddings=args.seq_len)
        print(f"model    {args.layers} layers grown from {args.init} ({cfg0.num_layers}), RoPE theta "
              f"{cfg0.rope.theta:g} -> {theta:.0f}, context {short_len} -> {args.seq_len}")
    else:
        short_len, theta, model = load(args.init).config.max_position_embeddings, cfg0.rope.theta, init.model
        print(f"model    {args.from_} ({cfg0.num_layers} layers, trained by: {base['command']}); only the extension")
    tok.model_max_length = args.seq_len

    data = tokenize_corpus(tok, work / "data.npz")
    pool = cached_pool(work / "prompts.json", tok, args.seq_len, args.suite_samples, args.seed)
    print(f"prompts  {len(pool)} suite prompts of {min(len(p) + len(a) for p, a in pool)}-"
          f"{max(len(p) + len(a) for p, a in pool)} tokens")
    make = lambda n: RowSampler(tok, data["code_train"], data["docs_train"], n, mixture=MIXTURE,  # noqa: E731
                                answer_weight=args.answer_weight, prompts=pool)
    long, short = make(args.seq_len), make(short_len)
    extend = None
    if args.extend_steps:
        more = cached_pool(work / "prompts_extend.json", tok, args.seq_len, args.suite_samples, args.seed + 1)
        extend = RowSampler(tok, data["code_train"], data["docs_train"], args.seq_len,
                            mixture=mixture(args.extend_mixture), answer_weight=args.answer_weight, prompts=pool + more,
                            kv_queries=args.extend_kv_queries, fact_queries=args.extend_fact_queries)
    batch = batches(args, long, short, short.min_span, extend)

    def loss(m, b):
        return next_token_loss(drive.logits(m, b["tokens"]), b["tokens"], b["weights"]), {}

    common = dict(lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, save_every=args.save_every,
                  decay="cosine")
    # every option of the run and the content of the weights it starts from: a checkpoint of another run in
    # OUT/training is refused, never resumed (kvjax.train.claim_training)
    ident = training_identity(args, models=("init", "from_"))
    t0 = time.time()
    at = args.short_steps + args.long_steps + getattr(args, "extend_offset", 0)
    if base is None:
        first = train(model, batch, loss, TrainConfig(steps=args.short_steps, **common), work / "short",
                      identity=ident)
        result = train(first.model, lambda i: batch(args.short_steps + i), loss,
                       TrainConfig(steps=args.long_steps, **common), work, identity=ident)
        history = first.history + [{**h, "step": h["step"] + args.short_steps} for h in result.history]
    else:
        result, history = argparse.Namespace(model=model), []
    if args.extend_steps:
        result = train(result.model, lambda i: batch(at + i), loss,
                       TrainConfig(steps=args.extend_steps, **{**common, "lr": args.extend_lr}), work / "extend",
                       identity=ident)
        history += [{**h, "step": h["step"] + at} for h in result.history]
    write_curve(history, work)
    train_s = time.time() - t0
    save_pretrained(result.model, out, tokenizer=tok)
    prev = json.loads((work / "run.json").read_text()) if (work / "run.json").is_file() else {}
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(result.model, nnx.Param)))
    meta = {
        "command": "python -m kvjax.experiments.train_small " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args), "parameters": int(n_params), "corpus": corpus.fingerprint(), "rope_theta": theta,
        "tokens_per_step": {"short": args.short_batch * short_len, "long": args.long_batch * args.seq_len},
        "train_minutes": round(prev.get("train_minutes", 0.0) + train_s / 60, 1), "cores": os.cpu_count(),
        "final_loss": history[-1]["loss"], "platform": jax.devices()[0].platform,
        "init": str(args.init), "suite_prompts": len(pool),
    }
    if base is not None:  # the extension's minutes add to the base's; its command and args are the base's plus it
        meta.update(base=base, train_minutes=round(base["train_minutes"] + train_s / 60, 1))
    if not math.isfinite(history[-1]["loss"]):
        raise FloatingPointError(f"the final loss is {history[-1]['loss']}")
    write_atomic(work / "run.json", dumps_finite(meta))
    print(f"trained  {len(history)} steps in {train_s / 60:.1f} min; loss {history[0]['loss']:.3f} -> "
          f"{history[-1]['loss']:.3f}; {n_params / 1e6:.2f} M parameters; wrote {out}")
    if not args.no_eval:
        from kvjax.experiments.small_card import write_card

        write_card(out, data, meta)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
