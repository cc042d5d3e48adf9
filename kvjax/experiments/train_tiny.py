"""Trains kvjax's embedded default model from scratch: a small Llama (GQA, RoPE; its warm stage is
MHA, mean-pooled to --kv-heads after it) on the Python standard library's source and English
reference docs, mixed with synthetic long-range tasks.

    python -m kvjax.experiments.train_tiny [--out DIR] [--steps 3000]

1. a byte-level BPE (`tokenizers`, digits split one by one so keys copy digit by digit) is
   trained on the training split and saved as a `transformers` fast tokenizer;
2. the corpus is tokenised once (cached in OUT/training/data.npz);
3. the model trains with AdamW + cosine decay in two stages: `--warm-steps` of short, wide rows of
   pure short-period repeats, where induction heads form; then rows of `--seq-len` tokens: natural
   text, and passkey / key-value / fact-QA / copy / induction tasks with up-weighted answers
   (`kvjax.experiments.tasks`), whose mixture anneals from the induction-heavy one to the main one while
   the tasks grow to the full row (`--curriculum`, `kvjax.experiments.tasks.Curriculum`);
4. OUT becomes a Hugging Face directory (config.json, tokenizer, model.safetensors) with a model
   card (README.md), the loss curve and the evaluation numbers (`kvjax.experiments.model_card`).

Every batch is a pure function of (seed, step), and training resumes from OUT/training/checkpoints:
rerunning the same command after a crash continues where it stopped, with the same result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.experiments import cli, corpus
from kvjax.experiments.records import training_identity, write_atomic
from kvjax.experiments.tasks import INDUCTION_ONLY, Curriculum, RowSampler
from kvjax.errors import InvalidInput
from kvjax.rope import RopeConfig
from kvjax.train import TrainConfig, next_token_loss, train, write_curve
from kvjax.models.gqa import to_grouped_query
from kvjax.models.llama import Llama, LlamaConfig
from kvjax.models.loading import save_pretrained
from kvjax.models.tiny import SPECIAL  # <unk> <s> </s> <pad>: ids 0..3, as the random test models
from kvjax import drive
from kvjax.cli import HelpFormatter


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE over `texts`, as a `transformers` fast tokenizer that prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL) + 256:
        raise InvalidInput(f"vocab_size={vocab_size} must be >= {len(SPECIAL) + 256} (specials + 256 bytes)")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def model_config(args, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.ffn, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.seq_len, rope=RopeConfig(theta=10000.0), bos_token_id=1,
        eos_token_ids=(2,), pad_token_id=3,
    )


def tokenize_corpus(tok, cache: Path) -> dict[str, np.ndarray]:
    """Token streams {code, docs} x {train, heldout}, documents joined by a blank line; cached."""
    if cache.is_file():
        with np.load(cache) as f:
            return dict(f)
    out = {}
    for split in corpus.SPLITS:
        for name, docs in (("code", corpus.code_documents(split)), ("docs", corpus.doc_documents(split))):
            ids = tok([t + "\n\n" for _, t in docs], add_special_tokens=False)["input_ids"]
            out[f"{name}_{split}"] = np.concatenate([np.asarray(i, np.int32) for i in ids])
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **out)
    return out


def batches(args, tok, data: dict[str, np.ndarray]) -> Callable[[int], dict]:
    """Step i -> {"tokens", "weights"}: a pure function of (seed, i), so a resumed run sees the same data.

    The first `--warm-steps` are a second, short and wide batch shape of pure short-period repeats:
    induction heads form within a few hundred steps on such rows, and did not in that budget on
    full-length mixed rows (see kvjax.experiments.tasks). Then the main stage's regime anneals from the warm
    one (`Curriculum`) while its tasks grow from the shortest span that fits them to the full row."""
    curriculum = Curriculum()
    sampler = RowSampler(tok, data["code_train"], data["docs_train"], args.seq_len, answer_weight=args.answer_weight,
                         mixture=curriculum.main)
    if sampler.min_span >= args.seq_len:
        raise InvalidInput(f"--seq-len {args.seq_len} is too short for the tasks with this tokenizer "
                         f"(they need {sampler.min_span + 1} tokens)")
    warm_sampler = RowSampler(tok, data["code_train"], data["docs_train"], args.warm_len, mixture=INDUCTION_ONLY)
    warm_regime = (INDUCTION_ONLY, curriculum.warm_alphabet, curriculum.warm_period)
    ramp = max(1, int(args.curriculum * (args.steps - args.warm_steps)))

    def batch(i: int) -> dict:
        rng = np.random.default_rng([args.seed, i])
        if i < args.warm_steps:
            rows = [warm_sampler.row(rng, None, warm_regime) for _ in range(args.warm_batch)]
        else:
            p = min(1.0, (i - args.warm_steps) / ramp)
            lo = sampler.min_span
            span, regime = int(lo + (args.seq_len - 1 - lo) * p), curriculum.at(p, sampler.vocab)
            rows = [sampler.row(rng, span, regime) for _ in range(args.batch)]
        return {"tokens": jnp.asarray(np.stack([r[0] for r in rows])),
                "weights": jnp.asarray(np.stack([r[1] for r in rows]))}

    return batch


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.train_tiny", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--out", default="kvjax/models/default",
                   help="output HF directory (default: the embedded default, kvjax/models/default)")
    p.add_argument("--steps", type=int, default=3000, help="all steps, the warm stage's included")
    p.add_argument("--batch", type=int, default=8, help="rows per step after the warm stage")
    p.add_argument("--seq-len", type=int, default=512, help="training length = max_position_embeddings")
    p.add_argument("--warm-steps", type=int, default=500,
                   help="first steps: pure short-period repeats in short rows, until induction heads form")
    p.add_argument("--warm-len", type=int, default=128, help="row length of the warm stage")
    p.add_argument("--warm-batch", type=int, default=32, help="rows per warm step")
    p.add_argument("--vocab", type=int, default=512, help="the BPE tokenizer's vocabulary size")
    p.add_argument("--hidden", type=int, default=128, help="the model's hidden size")
    p.add_argument("--ffn", type=int, default=384, help="the MLP's intermediate size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="query heads per layer")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads per layer after the warm stage (GQA)")
    p.add_argument("--warm-kv-heads", type=int,
                   help="KV heads in the warm stage (default --heads: MHA, where induction heads form fast); "
                        "mean-pooled to --kv-heads after it (kvjax.models.gqa)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate (AdamW; constant in the warm stage, then cosine decay)")
    p.add_argument("--warmup", type=int, default=100,
                   help="steps of linear learning-rate warm-up at the start of each stage")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's weight decay")
    p.add_argument("--answer-weight", type=float, default=4.0, help="loss weight of the tokens a task asks for")
    p.add_argument("--curriculum", type=float, default=0.5,
                   help="fraction of the main stage over which the tasks grow from the shortest span that fits "
                        "them to the full row and the induction-heavy regime anneals to the main mixture "
                        "(kvjax.experiments.tasks.Curriculum)")
    p.add_argument("--save-every", type=int, default=100,
                   help="steps between checkpoints in OUT/training (a killed run resumes from the last)")
    p.add_argument("--seed", type=int, default=0, help="the random seed of the initialisation and the training rows")
    p.add_argument("--no-eval", action="store_true", help="skip the model card's evaluation")
    cli.add_compile_cache_flag(p)
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden {args.hidden} must divide by --heads {args.heads}, and --heads by --kv-heads "
                f"{args.kv_heads}")
    if args.warm_kv_heads is None:
        args.warm_kv_heads = args.heads
    if args.heads % args.warm_kv_heads or args.warm_kv_heads % args.kv_heads:
        p.error(f"--warm-kv-heads {args.warm_kv_heads} must divide --heads {args.heads} and be a multiple of "
                f"--kv-heads {args.kv_heads}")
    if args.seq_len < 256:
        p.error(f"--seq-len {args.seq_len} is too short for the tasks (>= 256)")
    if not 0 <= args.warm_steps < args.steps:
        p.error(f"--warm-steps {args.warm_steps} must be in [0, --steps {args.steps})")
    if not 2 * Curriculum().warm_period[1] < args.warm_len <= args.seq_len:
        p.error(f"--warm-len {args.warm_len} must hold two periods of the warm repeats "
                f"(> {2 * Curriculum().warm_period[1]}) and be <= --seq-len {args.seq_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    work = out / "training"
    tok_dir = work / "tokenizer"
    t0 = time.time()
    if (tok_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    else:
        texts = [t for _, t in corpus.code_documents("train")] + [t for _, t in corpus.doc_documents("train")]
        tok = train_bpe(texts, args.vocab)
        tok.model_max_length = args.seq_len
        tok.save_pretrained(tok_dir)
    data = tokenize_corpus(tok, work / "data.npz")
    print(f"data     {corpus.fingerprint()}: " + ", ".join(f"{k} {len(v):,}" for k, v in data.items())
          + f" tokens ({time.time() - t0:.0f} s)")

    batch = batches(args, tok, data)

    def loss(m, b):
        return next_token_loss(drive.logits(m, b["tokens"]), b["tokens"], b["weights"]), {}

    cfg = model_config(args, len(tok))
    model = Llama(dataclasses.replace(cfg, num_kv_heads=args.warm_kv_heads), rngs=nnx.Rngs(args.seed))
    print(f"model    {cfg.num_layers} layers, d={cfg.hidden_size}, {cfg.num_heads}/{args.warm_kv_heads} heads "
          f"(warm stage) then {cfg.num_heads}/{cfg.num_kv_heads}, vocab {cfg.vocab_size}, length "
          f"{cfg.max_position_embeddings}")
    common = dict(lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, save_every=args.save_every)
    t1 = time.time()
    history, resumed_from = [], 0
    if args.warm_steps:  # at the peak rate: the main stage's cosine starts after it
        warm = train(model, batch, loss, TrainConfig(steps=args.warm_steps, decay="constant", **common), work / "warm",
                     identity=training_identity(args, skip=("steps",)))
        model, history, resumed_from = warm.model, warm.history, warm.resumed_from
    if args.warm_kv_heads != cfg.num_kv_heads:
        model = to_grouped_query(model, cfg.num_kv_heads)  # then uptrained by the main stage (GQA, sec. 2.1)
    result = train(model, lambda i: batch(args.warm_steps + i), loss,
                   TrainConfig(steps=args.steps - args.warm_steps, decay="cosine", **common), work,
                   identity=training_identity(args, skip=("steps",)))
    history += [{**h, "step": h["step"] + args.warm_steps} for h in result.history]
    write_curve(history, work)
    if result.resumed_from:
        resumed_from = args.warm_steps + result.resumed_from
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(result.model, nnx.Param)))
    train_s = time.time() - t1
    save_pretrained(result.model, out, tokenizer=tok)
    prev = json.loads((work / "run.json").read_text()) if (work / "run.json").is_file() else {}
    minutes = prev.get("train_minutes", prev.get("train_seconds_this_run", 0.0) / 60) + train_s / 60
    meta = {
        "command": "python -m kvjax.experiments.train_tiny " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args), "parameters": int(n_params), "corpus": corpus.fingerprint(),
        "tokens_per_step": args.batch * args.seq_len, "train_seconds_this_run": round(train_s, 1),
        "train_minutes": round(minutes, 1), "cores": os.cpu_count(),
        "resumed_from": resumed_from, "final_loss": history[-1]["loss"],
        "platform": jax.devices()[0].platform,
    }
    write_atomic(work / "run.json", json.dumps(meta, indent=2))
    print(f"trained  {len(history)} steps (from {resumed_from}) in {train_s / 60:.1f} min; "
          f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}; {n_params / 1e6:.2f} M parameters")
    if not args.no_eval:
        from kvjax.experiments.model_card import write_card

        write_card(out, data, meta)
    print(f"wrote    {out} (HF directory; model card {out / 'README.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
